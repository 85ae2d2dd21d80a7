"""Ray Data, where ``ray[data]`` is installed: ``raydata`` (W1, W2, W3), on
a local cluster of 2 CPUs, and ``raysplit`` (S1, S2), the same dataset
through ``streaming_split`` to consumer processes (Ray actors)."""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..measure import Meter, Tally, watch_consumers
from ..workloads import Fetcher, Workload
from .base import run_peer


#: what ``import ray.data`` needs beyond Ray (the extra ``ray[data]``):
#: ``find_spec("ray.data")`` alone succeeds without them
RAYDATA_NEEDS = ("ray", "pandas", "pyarrow", "fsspec")


#: Ray Data (``raydata``): the CPUs of its local cluster (this machine's 2,
#: as blobfeed's 2 fetcher threads); the bytes of one block, Ray Data's
#: default ``target_max_block_size`` (each ``map_batches`` call makes one
#: block of about this many bytes of the workload's chunks); and
#: ``iter_batches``'s ``prefetch_batches``.  From a sweep on this machine
#: (docs/BENCHMARKS.md, "Ray Data as a peer"): blocks of 1-16 MiB were
#: slower on all three workloads (W2: 25 batches/s at 4 MiB, a batch
#: spanning several blocks), 64 MiB about the same; prefetching 1-4
#: batches cost W1 and W3 up to half (its formatting threads and the loop
#: share the GIL) and did not help W2 beyond the noise
RAYDATA_CPUS = 2
RAYDATA_BLOCK_BYTES = 128 << 20
RAYDATA_PREFETCH = 0
#: the dataset's rows (one a chunk) and read tasks: far more chunks than a
#: window takes, in read tasks small enough to plan at once
RAYDATA_ROWS = 10**8
RAYDATA_READ_TASKS = 100


class RayDataChunks:
    """Ray Data's ``map_batches`` function: the batch's rows are chunk
    numbers; row ``i`` becomes a chunk of worker ``i % workers`` (as grain's
    element ``i``), and the call returns them concatenated: one block."""

    def __init__(self, fetcher: Fetcher, blobs: tuple[str, ...], workers: int) -> None:
        self.fetcher = fetcher
        self.blobs = blobs
        self.workers = workers

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        chunks = [self.fetcher.chunk(int(i) % self.workers) for i in rows["id"]]
        return {name: np.concatenate([c[k] for c in chunks]) for k, name in enumerate(self.blobs)}


def run_raydata(wl: Workload, seconds: float) -> dict[str, Any]:
    """Ray Data: ``ray.data.range`` of chunk numbers, ``map_batches`` making
    blocks of ``RAYDATA_BLOCK_BYTES`` of the workload's own chunks (Ray
    tasks of 1 CPU, at most ``RAYDATA_CPUS`` at once), and
    ``iter_batches(batch_size=wl.batch, batch_format="numpy", drop_last=True)``
    re-batching them to the workload's exact batch.  The local cluster
    (``address="local"``: its own, never one that happens to run here) is
    started before the clock, as R1's; the PSS column is the whole
    cluster's (every Ray process descends from this one)."""
    import logging

    import ray
    import ray.data

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=RAYDATA_CPUS, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        cluster_s = time.perf_counter() - t0
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.target_max_block_size = RAYDATA_BLOCK_BYTES
        logging.getLogger("ray.data").setLevel(logging.WARNING)

        def body(fetcher: Fetcher, m: Meter) -> None:
            one = fetcher.chunk(0)
            per_block = max(1, round(RAYDATA_BLOCK_BYTES / sum(a.nbytes for a in one)))
            ds = ray.data.range(RAYDATA_ROWS, override_num_blocks=RAYDATA_READ_TASKS).map_batches(
                RayDataChunks(fetcher, wl.blobs, RAYDATA_CPUS), batch_size=per_block, batch_format="numpy"
            )
            m.extra.update(chunks_per_block=per_block, cluster_start_s=cluster_s)
            m.begin()
            it = iter(ds.iter_batches(batch_size=wl.batch, batch_format="numpy", prefetch_batches=RAYDATA_PREFETCH,
                                      drop_last=True))
            try:
                for batch in it:
                    if not m.tick([batch[name] for name in wl.blobs]):
                        return
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()  # shuts the executor down
                # Ray Data's formatting threads end at their next batch; one
                # still inside ``ray.get`` at ``ray.shutdown()`` makes Ray end
                # the process ("The core worker has already been shutdown")
                for t in threading.enumerate():
                    if t.name == "iter_threaded":
                        t.join(10)
            raise RuntimeError(f"{wl.id}/raydata: the dataset ended inside the window")

        return run_peer(wl, seconds, body, pss=True)
    finally:
        ray.shutdown()


class SplitConsumer:
    """``raysplit``'s consumer: a Ray actor (a process of its own, as a Ray
    Train worker) that takes its split's batches as fast as it can and
    counts each in its slot of the measurement's tally, until the tally's
    stop flag."""

    def consume(self, split: Any, counts: Tally, slot: int, batch: int, blob: str) -> int:
        taken = 0
        for b in split.iter_batches(batch_size=batch, batch_format="numpy", prefetch_batches=RAYDATA_PREFETCH,
                                    drop_last=True):
            taken += len(b[blob])
            counts.add(slot, 1)
            if counts.stopping:
                break
        return taken


#: raysplit's blocks: see docs/BENCHMARKS.md, "The feeding service: S1, S2, S8, attach"
RAYSPLIT_BLOCK_BYTES = 16 << 20
#: raysplit: seconds to wait for the consumers to see the stop flag before Ray is shut down regardless
RAYSPLIT_STOP_S = 30.0


def run_raysplit(wl: Workload, seconds: float) -> dict[str, Any]:
    """Ray Data's ``streaming_split(n)`` (S1, S2): the ``raydata`` dataset
    (the same blocks of the workload's chunks, made by Ray tasks on the
    cluster's ``RAYDATA_CPUS``) split among ``wl.consumers`` Ray actors of
    no CPU of their own (as trainer processes), each iterating its split
    with ``iter_batches(batch_size=wl.batch, batch_format="numpy",
    drop_last=True)``.  The window is timed from outside, as the service's
    (``measure.watch_consumers``); the PSS column is the whole cluster's,
    the consumers included.  Its ``first_batch_ms`` is from the splits'
    first request, once the cluster is up."""
    import logging

    import ray
    import ray.data

    counts = Tally()
    ray.init(address="local", num_cpus=RAYDATA_CPUS, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.target_max_block_size = RAYSPLIT_BLOCK_BYTES
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        fetcher = wl.fetcher(None)  # RayDataChunks takes chunks: nothing to count
        one = fetcher.chunk(0)
        per_block = max(1, round(RAYSPLIT_BLOCK_BYTES / sum(a.nbytes for a in one)))
        ds = ray.data.range(RAYDATA_ROWS, override_num_blocks=RAYDATA_READ_TASKS).map_batches(
            RayDataChunks(fetcher, wl.blobs, RAYDATA_CPUS), batch_size=per_block, batch_format="numpy"
        )
        actor: Any = ray.remote(num_cpus=0)(SplitConsumer)
        consumers = [actor.remote() for _ in range(wl.consumers)]
        t_start = time.perf_counter()
        splits = ds.streaming_split(wl.consumers, equal=False)
        refs = [c.consume.remote(split, counts, k, wl.batch, wl.blobs[0])
                for k, (c, split) in enumerate(zip(consumers, splits))]

        def check() -> None:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if done:
                ray.get(done)  # raises a consumer's error
                raise RuntimeError(f"{wl.id}/raysplit: a consumer's split ended inside the window")

        w = watch_consumers(counts, wl.consumers, seconds, t_start, check)
        counts.finish()
        ray.wait(refs, num_returns=len(refs), timeout=RAYSPLIT_STOP_S)
        total = sum(w.batches)
        return {
            "batches_per_s": total / w.seconds,
            "gb_per_s": total * wl.batch * sum(a.nbytes // len(a) for a in one) / w.seconds / 1e9,
            "first_batch_ms": w.first_batch_s * 1e3,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "pss_mb": w.pss_mb,
            "consumer_min_share": min(w.batches) / (total / len(w.batches)) if total else 0.0,
            "chunks_per_block": per_block,
            # no samples_lost: a peer does not count what it loses ("-" in the table)
        }
    finally:
        ray.shutdown()
        counts.close()


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "raydata": run_raydata,
    "raysplit": run_raysplit,
}
#: the optional package they need
NEEDS = {name: "ray.data" for name in RUNNERS}
