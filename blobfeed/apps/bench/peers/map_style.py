"""W7's peers: the same map-style dataset (its ``__len__``, ``__getitem__``,
``__getitems__``) read with a global shuffle by torch's ``DataLoader``
(``torchmap0`` ... ``torchmap4``) and grain's ``DataLoader`` with an
``IndexSampler`` (``grainmap0`` ... ``grainmap4``), at 0, 1, 2 and 4 worker
processes: the target takes the best of them, so each peer is judged at its
best worker count on this machine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..measure import Meter
from ..workloads import ORDERED_SEED, W7_PEER_WORKERS, Workload


def _endless(make: Callable[[], Any]) -> Iterator[Any]:
    """The batches of ``make()``'s iterations, one epoch after another."""
    while True:
        yield from make()


def run_torch_map(wl: Workload, seconds: float, workers: int) -> dict[str, Any]:
    """torch's map-style ``DataLoader(dataset, batch_size=wl.batch,
    shuffle=True, num_workers=workers, drop_last=True)``: torch's sampler
    draws each epoch's permutation, its fetcher calls the dataset's
    ``__getitems__`` once per batch (torch >= 2.2) and ``default_collate``
    stacks the samples into tensors (in the workers).  Worker processes
    start with ``fork`` (torch's default on Linux) and are kept from one
    epoch to the next (``persistent_workers=True``, what one sets for
    more than one epoch)."""
    import torch
    import torch.utils.data as tud

    assert wl.dataset is not None
    dataset = wl.dataset()
    gen = torch.Generator()
    gen.manual_seed(ORDERED_SEED)
    loader = tud.DataLoader(dataset, batch_size=wl.batch, shuffle=True, num_workers=workers, drop_last=True,
                            generator=gen, persistent_workers=workers > 0,
                            multiprocessing_context="fork" if workers else None)
    m = Meter(seconds)
    m.begin()
    its: list[Any] = []

    def epoch() -> Iterator[Any]:
        it = iter(loader)
        its[:] = [it]
        return it

    try:
        for batch in _endless(epoch):
            if not m.tick([t.numpy() for t in batch]):
                break
    finally:
        for it in its:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
    return m.result(workers=workers)  # no samples_lost: a peer does not count what it loses ("-")


def run_grain_map(wl: Workload, seconds: float, workers: int) -> dict[str, Any]:
    """grain's ``DataLoader(data_source=dataset, sampler=IndexSampler(n,
    shuffle=True, seed=0, num_epochs=None), operations=[Batch(wl.batch,
    drop_remainder=True)], worker_count=workers)``: grain reads the
    records by index with its default read options (a pool of read threads
    in each worker) and stacks them in the workers; 0 workers reads in this
    process."""
    import grain  # type: ignore[import-not-found]  # an optional peer

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
    **{f"torchmap{k}": (lambda k: lambda wl, s: run_torch_map(wl, s, k))(k) for k in W7_PEER_WORKERS},
    **{f"grainmap{k}": (lambda k: lambda wl, s: run_grain_map(wl, s, k))(k) for k in W7_PEER_WORKERS},
}
#: the optional package they need
NEEDS = {name: ("torch" if name.startswith("torch") else "grain") for name in RUNNERS}
