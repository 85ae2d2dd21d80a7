"""grain, where installed: ``grain0`` (no worker process), ``grain2``
(``mp_prefetch``, 2 workers, chunks re-batched in the parent) and
``grain2b`` (the re-batching inside the workers: exact batches per
worker); and W7's ``grainmap0`` ... ``grainmap4``: grain's ``DataLoader``
over the workload's own map-style dataset with a shuffling
``IndexSampler``, at 0, 1, 2 and 4 worker processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..measure import Meter
from ..workloads import ORDERED_SEED, W7_PEER_WORKERS, Fetcher, Workload
from .base import feed, run_peer


#: grain's ``min_shm_size``: smaller arrays are pickled, as blobfeed's process workers do below 32 KiB
GRAIN_MIN_SHM_BYTES = 32 * 1024


class GrainChunk:
    """grain's map function: element ``i`` is a chunk of worker ``i % workers``
    (``mp_prefetch`` gives worker ``w`` the elements ``w, w + workers, ...``)."""

    def __init__(self, fetcher: Fetcher, workers: int) -> None:
        self.fetcher = fetcher
        self.workers = workers

    def __call__(self, i: Any) -> tuple:
        return tuple(self.fetcher.chunk(int(i) % self.workers))


def run_grain(wl: Workload, seconds: float, workers: int, batch_in_workers: bool) -> dict[str, Any]:
    """grain: a ``MapDataset`` of the workload's chunks, read without grain's
    read threads (they only cost here), ``min_shm_size`` 32 KiB, re-batched
    by grain's own ``RebatchIterDataset`` -- in the parent, or inside each
    worker before ``mp_prefetch`` (``batch_in_workers``: exact batches per
    worker)."""
    import grain  # type: ignore[import-not-found,import-untyped,unused-ignore]  # an optional peer

    def body(fetcher: Fetcher, m: Meter) -> None:
        ds = grain.MapDataset.range(0, 2**40).map(GrainChunk(fetcher, max(workers, 1)))
        it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
        it_ds = grain.experimental.WithOptionsIterDataset(
            it_ds, grain.experimental.DatasetOptions(min_shm_size=GRAIN_MIN_SHM_BYTES)
        )
        if batch_in_workers:
            it_ds = grain.experimental.RebatchIterDataset(it_ds, wl.batch)
        if workers:
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        if not batch_in_workers:
            it_ds = grain.experimental.RebatchIterDataset(it_ds, wl.batch)
        m.begin()
        it = iter(it_ds)
        try:
            feed(m, (list(b) for b in it))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    return run_peer(wl, seconds, body)


def run_grain_map(wl: Workload, seconds: float, workers: int) -> dict[str, Any]:
    """grain's ``DataLoader(data_source=dataset, sampler=IndexSampler(n,
    shuffle=True, seed=0, num_epochs=None), operations=[Batch(wl.batch,
    drop_remainder=True)], worker_count=workers)``: grain reads the
    records by index with its default read options (a pool of read threads
    in each worker) and stacks them in the workers; 0 workers reads in this
    process."""
    import grain  # type: ignore[import-not-found,import-untyped,unused-ignore]  # an optional peer

    assert wl.dataset is not None
    dataset = wl.dataset()
    sampler = grain.samplers.IndexSampler(num_records=len(dataset), shuffle=True, seed=ORDERED_SEED, num_epochs=None)
    loader = grain.DataLoader(data_source=dataset, sampler=sampler,
                              operations=[grain.transforms.Batch(batch_size=wl.batch, drop_remainder=True)],
                              worker_count=workers)
    m = Meter(seconds)
    m.begin()
    it = iter(loader)
    try:
        for batch in it:
            if not m.tick([np.asarray(a) for a in batch]):
                break
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
        del it  # its worker processes end with it (and with the measurement's process group)
    return m.result(workers=workers)


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "grain0": lambda wl, s: run_grain(wl, s, 0, False),
    "grain2": lambda wl, s: run_grain(wl, s, 2, False),
    "grain2b": lambda wl, s: run_grain(wl, s, 2, True),
    **{f"grainmap{k}": (lambda k: lambda wl, s: run_grain_map(wl, s, k))(k) for k in W7_PEER_WORKERS},
}
#: the optional package they need
NEEDS = {name: "grain" for name in RUNNERS}
