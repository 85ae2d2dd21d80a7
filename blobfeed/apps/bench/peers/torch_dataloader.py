"""torch's ``DataLoader``, where torch is installed: ``torch0`` and
``torch2`` (map-style, one sample per ``__getitem__``, 0 or 2 worker
processes), ``torch0it`` and ``torch2it`` (an iterable dataset of the
workload's chunks, re-batched in the loop)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..measure import Meter
from ..workloads import Fetcher, Workload
from .base import _rebatched, feed, run_peer


def run_torch(wl: Workload, seconds: float, workers: int, iterable: bool) -> dict[str, Any]:
    """torch's DataLoader.  Map-style (``iterable`` False): one sample per
    ``__getitem__``, the default collate, batches made in the workers.
    Iterable: the workload's own chunks, ``batch_size=None``, re-batched in
    this process by the same plain loop as the other peers.  Worker
    processes start with ``fork``, torch's default on Linux."""
    import torch.utils.data as tud

    def body(fetcher: Fetcher, m: Meter) -> None:
        def worker() -> int:
            info = tud.get_worker_info()
            return 0 if info is None else info.id

        class Chunks(tud.IterableDataset):
            def __iter__(self) -> Iterator[list]:
                w = worker()
                while True:
                    yield fetcher.chunk(w)

        class Samples(tud.Dataset):
            def __len__(self) -> int:
                return 10**9

            def __getitem__(self, i: int) -> tuple:
                return fetcher.sample(i, worker() if fetcher.timed else 0)

        context = "fork" if workers else None
        if iterable:
            loader = tud.DataLoader(Chunks(), batch_size=None, num_workers=workers, multiprocessing_context=context)
        else:
            loader = tud.DataLoader(Samples(), batch_size=wl.batch, num_workers=workers, shuffle=False,
                                    multiprocessing_context=context)
        m.begin()
        it = iter(loader)
        try:
            tensors = ([t.numpy() for t in item] for item in it)
            feed(m, _rebatched(tensors, wl.batch) if iterable else tensors)
        finally:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    return run_peer(wl, seconds, body)


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "torch0": lambda wl, s: run_torch(wl, s, 0, False),
    "torch0it": lambda wl, s: run_torch(wl, s, 0, True),
    "torch2": lambda wl, s: run_torch(wl, s, 2, False),
    "torch2it": lambda wl, s: run_torch(wl, s, 2, True),
}
#: the optional package they need
NEEDS = {name: "torch" for name in RUNNERS}
