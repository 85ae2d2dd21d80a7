"""``copy``: the copy bound of W2, one ``np.copyto`` per batch into
buffers rotated through more memory than the last-level cache.
``copy2``: the same in two threads at once (numpy copies without the GIL):
what the machine's memory moves when both cores copy, so how far a path
that copies each byte twice can go (S1)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..measure import Meter
from ..workloads import Workload


def _buffers(wl: Workload) -> tuple[np.ndarray, list[np.ndarray]]:
    chunk = wl.fetcher(None).chunk(0)
    batch_bytes = wl.batch * chunk[0][0].nbytes
    src = np.random.default_rng(0).integers(0, 255, size=batch_bytes, dtype=np.uint8)
    # rotate through 256 MiB of destinations: far more than any last-level cache
    n_buf = max(2, (256 << 20) // batch_bytes)
    bufs = [np.empty(batch_bytes, np.uint8) for _ in range(n_buf)]
    for b in bufs:
        b.fill(1)  # fault the pages in first: this bound is about copying
    return src, bufs


def run_copy2(wl: Workload, seconds: float) -> dict[str, Any]:
    """Two threads copy batches at once; the meter counts both."""
    other_src, other_bufs = _buffers(wl)
    done = threading.Event()

    def copier() -> None:
        i = 0
        while not done.is_set():
            np.copyto(other_bufs[i % len(other_bufs)], other_src)
            i += 1
            copied.append(1)  # list.append is atomic: counted in the meter's thread

    copied: list[int] = []
    thread = threading.Thread(target=copier, name="copy2", daemon=True)
    thread.start()
    try:
        src, bufs = _buffers(wl)
        m = Meter(seconds)
        m.begin()
        i = 0
        while True:
            dst = bufs[i % len(bufs)]
            np.copyto(dst, src)
            i += 1
            ok = m.tick([dst])
            while copied and ok:  # the other thread's batches, in the same window
                copied.pop()
                ok = m.tick([dst])
            if not ok:
                break
    finally:
        done.set()
        thread.join(10.0)
    return m.result()


def run_copy(wl: Workload, seconds: float) -> dict[str, Any]:
    src, bufs = _buffers(wl)
    n_buf = len(bufs)
    m = Meter(seconds)
    m.begin()
    i = 0
    while True:
        dst = bufs[i % n_buf]
        np.copyto(dst, src)
        i += 1
        if not m.tick([dst]):
            break
    return m.result()  # copies, loses nothing to count: no samples_lost ("-" in the table)


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "copy": run_copy,
    "copy2": run_copy2,
}
#: they need no optional package
NEEDS: dict[str, str] = {}
