"""``work2`` (W7): the work alone, with no pipeline.  Two processes each
read batches of a shuffled order through the dataset's own
``__getitems__`` and stack each batch once into one of 8 rotating slots
of shared memory (numbers, such as a record's size, in one assignment),
as a blobfeed worker process does; nothing is handed to
anyone.  Its batches/s is what any loader that reads on two processes and
copies each batch once to share it can reach on this machine: the two
copies of each byte (the dataset's into its own array, then into shared
memory) and the memory bus they share set it, not the loader.  Torch's
in-process loader does the same two copies (its collate stacks into a
fresh tensor) in one process; so ``work2`` over the best peer is the
most any two-process loader can be ahead of it here."""

from __future__ import annotations

import mmap
import multiprocessing
from collections.abc import Callable
from typing import Any

import numpy as np

from ..measure import Meter
from ..workloads import ORDERED_SEED, Workload

#: processes reading at once, as blobfeed's W7 row has worker processes
WORK_PROCESSES = 2
#: slots each process rotates through (a blobfeed worker process's ring)
SLOTS = 8


def _stacked_layout(dataset: Any, batch: int) -> list[tuple[tuple[int, ...], np.dtype]]:
    """The shape and dtype of each blob of one batch, from the dataset's first."""
    samples = dataset.__getitems__(list(range(batch)))
    return [((batch, *np.shape(col[0])), np.asarray(col[0]).dtype) for col in zip(*samples)]


def _read(make_dataset: Callable[[], Any], batch: int, k: int, stop: Any, counts: Any, layouts: Any) -> None:
    """One process: batches of its own shuffled order, each stacked into
    the next of its slots; ``counts[k]`` is how many it finished.  Its
    batch's layout goes on ``layouts`` first (the parent's meter counts
    arrays of it: the parent never maps the 2 GB file)."""
    dataset = make_dataset()
    n = len(dataset)
    layout = _stacked_layout(dataset, batch)
    layouts.put([(shape, dtype.str) for shape, dtype in layout])
    sizes = [int(np.prod(shape)) * dtype.itemsize for shape, dtype in layout]
    slot_bytes = sum(sizes)
    area = mmap.mmap(-1, slot_bytes * SLOTS)  # shared and anonymous, as a worker's slots
    slots = []
    for s in range(SLOTS):
        views, at = [], s * slot_bytes
        for (shape, dtype), size in zip(layout, sizes):
            views.append(np.frombuffer(area, dtype, count=size // dtype.itemsize, offset=at).reshape(shape))
            at += size
        slots.append(views)
    rng = np.random.default_rng((ORDERED_SEED, k))
    done = 0
    while not stop.is_set():  # the map goes with the process
        order = rng.permutation(n)
        for lo in range(0, n - batch + 1, batch):
            samples = dataset.__getitems__(order[lo:lo + batch].tolist())
            for col, out in zip(zip(*samples), slots[done % SLOTS]):
                if isinstance(col[0], np.generic):
                    out[...] = col  # numbers in one assignment, as a blobfeed worker writes them
                else:
                    np.stack(col, out=out)
            done += 1
            counts[k] = done
            if stop.is_set():
                break


def run_work2(wl: Workload, seconds: float) -> dict[str, Any]:
    """W7's work on :data:`WORK_PROCESSES` processes at once (spawned: a
    fork of a process with threads may inherit a held lock); the meter
    counts every batch either finished, polled each millisecond."""
    assert wl.dataset is not None, f"{wl.id} has no dataset"
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    counts = ctx.RawArray("q", WORK_PROCESSES)
    layouts = ctx.Queue()
    procs = [ctx.Process(target=_read, args=(wl.dataset, wl.batch, k, stop, counts, layouts), daemon=True,
                         name=f"work2-{k}") for k in range(WORK_PROCESSES)]
    for p in procs:
        p.start()
    try:
        m = Meter(seconds)
        m.begin()
        seen = 0
        going = True
        one: list[np.ndarray] | None = None  # arrays of one batch's layout: what the meter counts per batch
        while going:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"work2: process {dead[0].name} exited with code {dead[0].exitcode}")
            total = sum(counts)
            if total and one is None:  # a process put its layout before its first batch
                one = [np.zeros(shape, np.dtype(dtype)) for shape, dtype in layouts.get(timeout=30)]
            while seen < total and going and one is not None:
                going = m.tick(one)
                seen += 1
            if going:
                stop.wait(0.001)  # nothing sets it here: a bounded pause between polls
    finally:
        stop.set()
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
    return m.result(workers=WORK_PROCESSES)  # reads no stream: no samples_lost ("-")


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "work2": run_work2,
}
#: it needs no optional package
NEEDS: dict[str, str] = {}
