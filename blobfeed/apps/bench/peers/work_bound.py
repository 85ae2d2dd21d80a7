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
most any two-process loader can be ahead of it here.

``hand2``: the same two processes, each batch then handed to the
measuring process as a pipeline would, and no more: the slot's number
down a pipe; the measuring process (the training loop) makes the batch's
views over the shared memory, drops them and sends the slot back.  What
``work2`` loses with it is what handing batches over costs a lean Python
pipeline (no order, no resume, no metrics, one thread)."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import select
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from ..measure import Meter
from ..workloads import ORDERED_SEED, Workload

#: processes reading at once, as blobfeed's W7 row has worker processes
WORK_PROCESSES = 2
#: slots each process rotates through (a blobfeed worker process's ring)
SLOTS = 8
#: a slot's number on hand2's pipes
_SLOT = struct.Struct("<i")


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
    slot_bytes = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in layout)
    area = mmap.mmap(-1, slot_bytes * SLOTS)  # shared and anonymous, as a worker's slots
    slots = [_slot_views(area, s * slot_bytes, layout) for s in range(SLOTS)]
    rng = np.random.default_rng((ORDERED_SEED, k))
    done = 0
    while not stop.is_set():  # the map goes with the process
        order = rng.permutation(n)
        for lo in range(0, n - batch + 1, batch):
            _stack(dataset.__getitems__(order[lo:lo + batch].tolist()), slots[done % SLOTS])
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
        m = Meter(seconds, cpu=True)
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
        _end(stop, procs)
        layouts.close()
    return m.result(workers=WORK_PROCESSES)  # reads no stream: no samples_lost ("-")


def _end(stop: Any, procs: list[Any]) -> None:
    """Stop the processes: told, then killed if they do not end in time."""
    stop.set()
    for p in procs:
        p.join(10.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _slot_views(area: Any, at: int, layout: list[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """A batch's arrays over ``area`` from byte ``at``, laid out as ``layout``."""
    views = []
    for shape, dtype in layout:
        count = int(np.prod(shape))
        views.append(np.frombuffer(area, dtype, count=count, offset=at).reshape(shape))
        at += count * dtype.itemsize
    return views


def _stack(samples: Any, slot: list[np.ndarray]) -> None:
    """One batch's samples stacked into a slot's arrays, a column per blob."""
    for col, out in zip(zip(*samples), slot):
        if isinstance(col[0], np.generic):
            out[...] = col  # numbers in one assignment, as a blobfeed worker writes them
        else:
            np.stack(col, out=out)


def _hand(make_dataset: Callable[[], Any], batch: int, k: int, stop: Any, area: Any, slot_bytes: int,
          layout: list[tuple[tuple[int, ...], str]], out: Any, free: Any) -> None:
    """One of hand2's processes: :func:`_read`'s work into its slots of the
    shared ``area``, each slot's number written to ``out`` once stacked,
    and taken again when it comes back on ``free``."""
    dataset = make_dataset()
    n = len(dataset)
    shapes = [(shape, np.dtype(dt)) for shape, dt in layout]
    slots = [_slot_views(area, (k * SLOTS + s) * slot_bytes, shapes) for s in range(SLOTS)]
    out_fd, free_fd = out.fileno(), free.fileno()
    poller = select.poll()
    poller.register(free_fd, select.POLLIN)
    idle = list(range(SLOTS))
    rng = np.random.default_rng((ORDERED_SEED, k))
    while not stop.is_set():
        order = rng.permutation(n)
        for lo in range(0, n - batch + 1, batch):
            while not idle and not stop.is_set():
                if poller.poll(100):  # bounded: the stop is looked at between waits
                    data = os.read(free_fd, 4 * SLOTS)
                    if not data:
                        return  # the measuring process is gone
                    idle += [s for (s,) in _SLOT.iter_unpack(data)]
            if stop.is_set():
                return
            s = idle.pop()
            _stack(dataset.__getitems__(order[lo:lo + batch].tolist()), slots[s])
            os.write(out_fd, _SLOT.pack(s))


def run_hand2(wl: Workload, seconds: float) -> dict[str, Any]:
    """W7's work on :data:`WORK_PROCESSES` spawned processes, each batch
    handed to this process through a pipe and its slot given back (see the
    module's docstring); the meter counts each batch as this process takes it."""
    assert wl.dataset is not None, f"{wl.id} has no dataset"
    layout = _stacked_layout(wl.dataset(), wl.batch)  # (one batch read here, for the slots' size)
    slot_bytes = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in layout)
    slot_bytes += -slot_bytes % 64
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    area = ctx.RawArray("b", WORK_PROCESSES * SLOTS * slot_bytes)
    wire = [(shape, dtype.str) for shape, dtype in layout]
    procs, outs, frees = [], [], []
    for k in range(WORK_PROCESSES):
        out_r, out_w = ctx.Pipe(duplex=False)
        free_r, free_w = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_hand, args=(wl.dataset, wl.batch, k, stop, area, slot_bytes, wire, out_w,
                                                     free_r), daemon=True, name=f"hand2-{k}"))
        outs.append((out_r, out_w))
        frees.append((free_r, free_w))
    for p in procs:
        p.start()
    for (_, out_w), (free_r, _) in zip(outs, frees):
        out_w.close()  # the children's ends
        free_r.close()
    by_fd = {out_r.fileno(): (k, frees[k][1].fileno()) for k, (out_r, _) in enumerate(outs)}
    poller = select.poll()
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    try:
        m = Meter(seconds, cpu=True)
        m.begin()
        going = True
        while going:
            ready = poller.poll(1000)
            if not ready:
                dead = [p for p in procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"hand2: process {dead[0].name} exited with code {dead[0].exitcode}")
                continue
            for fd, _ in ready:
                k, back = by_fd[fd]
                data = os.read(fd, 4 * SLOTS)
                if not data:
                    raise RuntimeError(f"hand2: process {procs[k].name} exited with code {procs[k].exitcode}")
                for (s,) in _SLOT.iter_unpack(data):
                    views = _slot_views(area, (k * SLOTS + s) * slot_bytes, layout)
                    going = m.tick(views) and going
                    del views  # the training step's use of the batch ends here
                    os.write(back, _SLOT.pack(s))
    finally:
        _end(stop, procs)
        for out_r, _ in outs:
            out_r.close()
        for _, free_w in frees:
            free_w.close()
    return m.result(workers=WORK_PROCESSES)  # reads no stream: no samples_lost ("-")


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "work2": run_work2,
    "hand2": run_hand2,
}
#: it needs no optional package
NEEDS: dict[str, str] = {}
