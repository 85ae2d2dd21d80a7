"""The body of a worker process: run the worker loop and ship its events.

Runs in the child.  The loop is every backend's
(:func:`~blobfeed.feeders.worker_loop.worker_events`); its events
(:mod:`~blobfeed.feeders.messages`) go to the parent pickled, a list of
them per message on the pipe (each after its length:
``transport.send_message``).  Large results (plain arrays, at least
``SHM_MIN_BYTES``) are written once into a free slot of the worker's shared
memory and travel as an :class:`~blobfeed.feeders.messages.Arrays` naming
the slot; everything else (small chunks, ``None``, malformed results) is
pickled, several results to one message, because for small arrays a pipe
beats shared memory.  Exceptions travel packed
(``transport.pack_exception``).  The parent validates everything: the child
only moves data, so every backend behaves the same.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import pickle
import select
import signal
import threading
import time
from typing import Any

import numpy as np

from ..worker_info import WorkerInfo
from .messages import Arrays, Note, Raised, Result, arrays_nbytes, plain_arrays, unsendable, without_layout
from .messages import write_arrays
from .transport import SLOT_INDEX, WAKE, FdHandle, SlotArea, pack_exception, send_message
from .unit_slots import UnitSlots
from .worker_batches import BatchFiller
from .worker_loop import skips, worker_events

__all__ = ["child_main"]

#: chunks at least this big (all plain arrays) travel through shared memory
SHM_MIN_BYTES = 32 * 1024
#: small results are sent once this many bytes are pending ...
INLINE_MAX_BYTES = 256 * 1024
#: ... or once the oldest has waited this long (counting the next fetch)
INLINE_MAX_DELAY_S = 0.005
#: at most this many batches a worker assembled (see worker_batches) wait
#: inside blobfeed (being filled, on their way, queued) at once
BATCH_SLOTS = 2
#: seconds between two looks at the viewed count while a worker waits on it
#: (the parent wakes it when the count grows: this catches a lost wake-up)
VIEWED_POLL_S = 0.02

_PR_SET_PDEATHSIG = 1


def _die_with_parent(pdeathsig: bool, free_r: int) -> None:
    """SIGKILL this process when the program dies, however it dies: no
    orphan survives even a SIGKILL of the program.

    The free-slot pipe's write end is the program's alone, so its hang-up
    says the program is gone; a thread waits for it (without reading: the
    worker's loop reads the pipe), and sees it at once if the program died
    before this process got here.  When the parent process is the
    forkserver (``pdeathsig``), ``PR_SET_PDEATHSIG`` too: the forkserver
    exits with the program.  Never with "spawn": the signal comes when the
    parent *thread* ends, which is whichever thread called ``start()``.
    """
    if pdeathsig:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_wait_for_hangup, args=(free_r,), name="blobfeed-parent-watch", daemon=True).start()


def _wait_for_hangup(fd: int) -> None:
    poller = select.poll()
    poller.register(fd, 0)  # POLLHUP and POLLERR are always reported; no POLLIN
    while True:
        try:
            events = poller.poll()
        except InterruptedError:  # pragma: no cover - retried by Python anyway
            continue
        if any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in events):
            os.kill(os.getpid(), signal.SIGKILL)


def _read_payload(fd: int) -> bytearray:
    """The pickled ``(fetch_fun, worker_init_fun)`` the parent wrote into
    the memfd ``fd`` (see ``starting._payload_fd``)."""
    size = os.fstat(fd).st_size
    out = bytearray(size)
    view = memoryview(out)
    done = 0
    while done < size:
        n = os.preadv(fd, [view[done:]], done)
        if n <= 0:
            raise EOFError(f"the worker's payload ends at byte {done} of {size}")
        done += n
    return out


def child_main(
    worker_id: int,
    index: int,
    num_workers: int,
    source: str,
    seed: int,
    payload_fd: FdHandle,
    on_error: str,
    area_fd: FdHandle,
    slots: int,
    slot_bytes: int,
    free_fd: FdHandle,
    out_fd: FdHandle,
    pdeathsig: bool = True,
    epochs: int | None = 1,
    first_epoch: int = 0,
    units_fd: FdHandle | None = None,
) -> None:
    """Entry point of a worker process (``multiprocessing`` target).
    ``units_fd``: a random-access source's read units (see ``indexed.PipeUnits``)."""
    # Ctrl-C in a terminal reaches the whole process group: the program gets
    # its KeyboardInterrupt and stops us; we must not die of it first (a
    # traceback each, and the interrupt turned into a FetcherError).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(pdeathsig, free_fd.fd)
    parent = os.getppid()
    area = SlotArea(area_fd.fd, slots, slot_bytes)
    os.close(area_fd.fd)
    # multiprocessing's start-up (which imports the program's main module)
    # is over: a death before this flag is the start-up's, and the parent
    # says so (a script without the __main__ guard, see processes.py)
    area.set_started()
    try:
        payload = _read_payload(payload_fd.fd)
    finally:
        os.close(payload_fd.fd)
    # A process fetch_fun forks (a helper that outlives us) must not keep
    # the slots mapped, and with them the parent's memory, after we end.
    if hasattr(mmap, "MADV_DONTFORK"):
        area.mm.madvise(mmap.MADV_DONTFORK)
    try:
        _work(
            WorkerInfo(worker_id, index, num_workers, source, seed, np.random.default_rng(seed)),
            payload, on_error, area, free_fd.fd, out_fd.fd, parent, epochs, first_epoch,
            None if units_fd is None else units_fd.fd,
        )
    finally:
        # we return on purpose: an exit with code 0 without this flag is a
        # death (os._exit(0) inside fetch_fun), which the parent reports at once
        area.set_ending()


def _work(
    first: WorkerInfo,
    payload: bytes | bytearray,
    on_error: str,
    area: SlotArea,
    free_r: int,
    out: int,
    parent: int,
    epochs: int | None,
    epoch: int,
    units_fd: int | None = None,
) -> None:
    worker_id = first.worker_id
    dumps = functools.partial(pickle.dumps, protocol=5)
    perf = time.perf_counter
    slots, slot_bytes = area.slots, area.slot_bytes
    free = list(range(slots))
    # the parent said stop (or is gone): every later take_slot says so too,
    # also after one that a reader turned into a fallback (unit_slots)
    ended = False

    #: the layout of the last result sent in a slot (see messages.without_layout)
    sent_meta: list[Any] = [None]

    def send(events: list[Any]) -> None:
        for i, ev in enumerate(events):
            if type(ev) is Result and type(ev.raw) is Arrays:
                events[i] = without_layout(ev, sent_meta)
        send_message(out, dumps(events))

    def take_slot(inside: int = slots) -> int:
        """A free slot, once fewer than ``inside`` slots are out and not
        viewed by batches handed out (blocking); -1: stop."""
        nonlocal ended
        if ended:
            return -1
        while not free or slots - len(free) - area.viewed() >= inside:
            if free:
                # Waiting for the parent to hand a batch out (the viewed
                # count, in the shared header): with our flag up it writes a
                # WAKE on the free pipe when it does.  The flag and the count
                # are two words with no fence between them, so a wake-up lost
                # to the stores' order is caught by the timeout.
                area.set_waiting(True)
                try:
                    if slots - len(free) - area.viewed() < inside:
                        break
                    if not select.select([free_r], [], [], VIEWED_POLL_S)[0]:
                        continue
                finally:
                    area.set_waiting(False)
            data = os.read(free_r, SLOT_INDEX.size * slots)
            if not data:
                ended = True  # the parent closed its end
                return -1
            for (i,) in SLOT_INDEX.iter_unpack(data):
                if i == WAKE:
                    continue
                if i < 0:
                    ended = True
                    return -1
                free.append(i)
        return free.pop()

    def take_batch_slot() -> int:
        # A chunk fills a part of its slot, a whole batch all of it: with
        # every slot full of batches waiting in the parent, a worker held 8
        # batches (W2p: 150 MiB) where it held 8 chunks.  So at most
        # BATCH_SLOTS batches of a worker wait inside blobfeed; batches a
        # reader was handed (that the user may keep) do not count, so a user
        # keeping batches never stalls the worker.
        return take_slot(BATCH_SLOTS)

    def packed(event: Raised) -> Raised:
        data, tb = pack_exception(event.error)
        return event._replace(error=data, tb=tb)

    try:
        fetch_fun, worker_init_fun = pickle.loads(payload)
    except BaseException as exc:
        # a function pickled by reference to a module this process cannot
        # import, say: the cause, not a bare "exited with code 1"
        err = RuntimeError(
            f"fetch_fun / worker_init_fun could not be loaded in the worker process: {exc!r} "
            "(with backend='processes' they must be importable there, or defined where "
            "cloudpickle sends them by value)"
        )
        err.__cause__ = exc
        send([packed(Raised(0.0, err, True))])
        return
    pending: list[Any] = []
    pending_bytes = 0
    oldest = 0.0
    noted_big = False

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        events, pending = pending, []
        pending_bytes = 0
        try:
            data = dumps(events)
        except Exception:
            # An unpicklable result (MemoryError too: one that claims more
            # than there is): each result goes on its own, pickled once, so
            # the others still arrive; each bad one as a stand-in that the
            # parent's validator refuses, naming the pickling's error (and
            # a random-access source's read unit, its state)
            for ev in events:
                try:
                    data = dumps([ev])
                except Exception as exc:
                    unit = ev.state if units_fd is not None and type(ev.state) is int else None
                    bad = ev._replace(raw=unsendable(ev.raw, exc, unit))
                    try:
                        data = dumps([bad])
                    except Exception:  # the stateful fetcher's state was the unpicklable part
                        data = dumps([bad._replace(state=None)])
                send_message(out, data)
            return
        send_message(out, data)

    unit_slots: UnitSlots | None = None
    if units_fd is not None:
        from .read_units import PipeUnits

        # a random-access source's units come down a pipe; what is pending
        # goes out before waiting for the next one (the parent hands out
        # more once it has them)
        fetch_fun.units = PipeUnits(units_fd, flush, area.set_reading)
        unit_slots = UnitSlots(area.mm, area.offset, slot_bytes, take_slot, free.append, flush, SHM_MIN_BYTES)
        fetch_fun.into = unit_slots
    events = worker_events(
        fetch_fun, worker_init_fun, worker_id, first, area.hint,
        lambda: area.stopping() or os.getppid() != parent, epochs, epoch,
    )
    # a random-access source's chunks are its read units: never merged
    filler = BatchFiller(area.mm, area.offset, slot_bytes, take_batch_slot, SHM_MIN_BYTES) if units_fd is None else None

    def send_batch_begun() -> None:
        if filler is not None and not filler.gone:
            for result in filler.flush():
                send([result])

    try:
        for event in events:
            if unit_slots is not None and (waited := unit_slots.pop_waited()) and type(event) is Result:
                event = event._replace(seconds=max(0.0, event.seconds - waited))
            if type(event) is not Result:
                if unit_slots is not None:
                    unit_slots.drop()
                send_batch_begun()
                flush()
                if type(event) is Raised:
                    send([packed(event)])
                    if skips(on_error, event):
                        continue
                    return
                send([event])  # the epoch's end, or the last one's
                continue
            arrays = plain_arrays(event.raw)
            if unit_slots is not None:
                # stacked straight into a slot by the reader: sent as it lies
                where = unit_slots.claim(arrays or (), isinstance(event.raw, tuple))
                if where is not None:
                    flush()
                    send([event._replace(raw=where)])
                    continue
            if filler is not None and arrays is not None and event.state is None:
                size = area.whole()
                as_tuple = isinstance(event.raw, tuple)
                if size and filler.takes(arrays, as_tuple, size, event.seconds):
                    if filler.filling and not filler.matches(arrays, as_tuple, size):
                        send_batch_begun()
                    flush()
                    for result in filler.add(event.seconds, arrays, as_tuple, size):
                        send([result])
                    if filler.gone:
                        return
                    continue
            send_batch_begun()
            nbytes = arrays_nbytes(arrays) if arrays is not None else 0
            if arrays is not None and SHM_MIN_BYTES <= nbytes <= slot_bytes:
                flush()
                slot = take_slot()
                if slot < 0:
                    return
                where = write_arrays(arrays, area.mm, area.offset(slot), slot, isinstance(event.raw, tuple))
                send([event._replace(raw=where)])
                continue
            if nbytes > slot_bytes and not noted_big:
                noted_big = True
                send([Note(
                    f"a chunk of {nbytes / 2**20:.2f} MiB is larger than a shared-memory slot "
                    f"({slot_bytes / 2**20:.2f} MiB): such chunks travel pickled through a pipe, "
                    "which is slower; pass backend=ProcessBackend(slot_bytes=...) with more"
                )])
            now = perf()
            if not pending:
                oldest = now - event.seconds
            pending.append(event)
            pending_bytes += nbytes or 64
            # another fetch would hold these past the delay bound: send now
            if pending_bytes >= INLINE_MAX_BYTES or now - oldest + event.seconds >= INLINE_MAX_DELAY_S:
                flush()
    finally:
        events.close()
        send_batch_begun()
        flush()
