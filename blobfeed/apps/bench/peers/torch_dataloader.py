"""torch's ``DataLoader``, where torch is installed: ``torch0`` and
``torch2`` (map-style, one sample per ``__getitem__``, 0 or 2 worker
processes), ``torch0it`` and ``torch2it`` (an iterable dataset of the
workload's chunks, re-batched in the loop); and W7's ``torchmap0`` ...
``torchmap4``: the workload's own map-style dataset, shuffled, at 0, 1, 2
and 4 worker processes (W7's target takes the best of them and of grain's
``grainmap*``, so each loader is judged at its best worker count here)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..measure import Meter
from ..workloads import ORDERED_SEED, W7_PEER_WORKERS, Fetcher, Workload
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
    more than one epoch).  Without workers, torch runs with one intra-op
    thread, as it does in its workers (docs/BENCHMARKS.md, "W7 against torch
    with one thread")."""
    import torch
    import torch.utils.data as tud

    if workers == 0:
        # default_collate's stack of 4 MiB per blob ran on torch's intra-op
        # pool (a thread per core): on 2 cores the training loop ran at one of
        # two speeds (about 540 or 1 300 batches/s on W7, from one run to the
        # next); with one thread, at about 1 450 every time
        torch.set_num_threads(1)
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


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "torch0": lambda wl, s: run_torch(wl, s, 0, False),
    "torch0it": lambda wl, s: run_torch(wl, s, 0, True),
    "torch2": lambda wl, s: run_torch(wl, s, 2, False),
    "torch2it": lambda wl, s: run_torch(wl, s, 2, True),
    **{f"torchmap{k}": (lambda k: lambda wl, s: run_torch_map(wl, s, k))(k) for k in W7_PEER_WORKERS},
}
#: the optional package they need
NEEDS = {name: "torch" for name in RUNNERS}
