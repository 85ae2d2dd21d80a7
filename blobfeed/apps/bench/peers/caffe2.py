"""``caffe2``: Caffe2's original re-batching, written from its
description: ``np.append`` growth, ``np.split``, the leftover put back
with ``put(block=False)`` and dropped when the queue is full.  It counts
the samples it drops."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..measure import Meter, Tally
from ..workloads import Fetcher, Workload


def _caffe2_pipeline(wl: Workload, fetch: Fetcher) -> tuple[Callable[[], list], Callable[[], dict[str, int]], Callable[[], None]]:
    """Caffe2's data_workers re-batching (see the module docstring)."""
    internal: queue.Queue = queue.Queue(800)
    device: queue.Queue = queue.Queue(4)
    stop = threading.Event()
    stats = {"dropped": 0, "held": 0}
    bs = wl.batch

    def fetcher(wid: int) -> None:
        while not stop.is_set():
            try:
                chunk = fetch(wid, bs)
            except StopIteration:
                return
            while True:
                try:
                    internal.put(chunk, timeout=0.1)
                    break
                except queue.Full:
                    if stop.is_set():
                        stats[f"held{wid}"] = len(chunk[0])  # not a loss of the algorithm
                        return

    def enqueuer() -> None:
        while not stop.is_set():
            cur: list | None = None
            while cur is None or len(cur[0]) < bs:
                try:
                    chunk = internal.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set():
                        stats["held"] = 0 if cur is None else len(cur[0])
                        return
                    continue
                if cur is None:
                    cur = [a.copy() for a in chunk]
                else:
                    cur = [np.append(c, a, axis=0) for c, a in zip(cur, chunk)]
            if len(cur[0]) > bs:
                parts = [np.split(c, [bs]) for c in cur]
                cur = [p[0] for p in parts]
                leftover = [p[1] for p in parts]
                try:
                    internal.put(leftover, block=False)
                except queue.Full:
                    stats["dropped"] += len(leftover[0])  # Caffe2 dropped these silently
            while True:
                try:
                    device.put(cur, timeout=0.1)
                    break
                except queue.Full:
                    if stop.is_set():
                        stats["held"] = len(cur[0])
                        return

    threads = [threading.Thread(target=fetcher, args=(w,), daemon=True) for w in range(2)]
    threads.append(threading.Thread(target=enqueuer, daemon=True))

    def start() -> None:
        for t in threads:
            t.start()

    def get() -> list:
        return device.get(timeout=60)

    def finish() -> dict[str, int]:
        stop.set()
        for t in threads:
            t.join(5)
        held = sum(len(item[0]) for item in list(internal.queue)) + sum(len(b[0]) for b in list(device.queue))
        return {"dropped": stats["dropped"], "held": held + sum(v for k, v in stats.items() if k.startswith("held"))}

    return get, finish, start


def run_caffe2(wl: Workload, seconds: float) -> dict[str, Any]:
    tally = Tally()
    try:
        fetch = wl.fetcher(tally)
        get, finish, start = _caffe2_pipeline(wl, fetch)
        m = Meter(seconds)
        delivered = 0
        m.begin()
        start()
        while True:
            batch = get()
            delivered += len(batch[0])
            if not m.tick(batch):
                break
        tally.finish()
        counts = finish()
        fetched = tally.fetched()
        lost = fetched - delivered - counts["held"]
        extra = wl.ideal(tally, m.result()["batches_per_s"])
        return m.result(samples_lost=int(lost), dropped_counted=counts["dropped"],
                        lost_share=lost / max(fetched, 1), **extra)
    finally:
        tally.close()


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "caffe2": run_caffe2,
}
#: they need no optional package
NEEDS: dict[str, str] = {}
