"""The body of a worker process: call ``fetch_fun`` and ship what it returns.

Runs in the child.  Large chunks (plain arrays, at least
``SHM_MIN_BYTES``) are written once into a free slot of the worker's shared
memory and announced by index; everything else (small chunks, ``None``,
malformed results) is pickled, several results to one message, because for
small arrays a pipe beats shared memory.  The parent validates everything:
the child only moves data, so every backend behaves the same.

Messages (pickled tuples on the pipe, each after its length: ``transport.send_message``):

* ``("items", [(seconds, result), ...])``: results in call order;
* ``("slot", seconds, index, [(dtype, shape, offset), ...], is_tuple, state)``
  (``state``: a stateful ``fetch_fun``'s, after this chunk, else None);
* ``("error", seconds, exception bytes, traceback, fatal)``;
* ``("epoch", seconds)``: ``fetch_fun`` raised StopIteration and the next
  epoch begins;
* ``("done", seconds)``: ``fetch_fun`` raised StopIteration in the last epoch;
* ``("note", text)``: something for the parent to log (once).
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

from ..worker_info import WorkerInfo, for_epoch, is_last_epoch, set_worker_info
from .chunks import Stamped
from .transport import SLOT_INDEX, FdHandle, SlotArea, align, pack_exception, send_message

__all__ = ["child_main"]

#: chunks at least this big (all plain arrays) travel through shared memory
SHM_MIN_BYTES = 32 * 1024
#: small results are sent once this many bytes are pending ...
INLINE_MAX_BYTES = 256 * 1024
#: ... or once the oldest has waited this long (counting the next fetch)
INLINE_MAX_DELAY_S = 0.005

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


def _plain_arrays(raw: Any) -> list[np.ndarray] | None:
    """The arrays of a chunk that can go through shared memory, else None."""
    if not isinstance(raw, (list, tuple)) or not raw:
        return None
    for a in raw:
        if type(a) is not np.ndarray or a.dtype.hasobject or not a.dtype.isnative:
            return None
    return list(raw)


def child_main(
    worker_id: int,
    index: int,
    num_workers: int,
    source: str,
    seed: int,
    payload: bytes,
    on_error: str,
    area_fd: FdHandle,
    slots: int,
    slot_bytes: int,
    free_fd: FdHandle,
    out_fd: FdHandle,
    pdeathsig: bool = True,
    epochs: int | None = 1,
    first_epoch: int = 0,
) -> None:
    """Entry point of a worker process (``multiprocessing`` target)."""
    # Ctrl-C in a terminal reaches the whole process group: the program gets
    # its KeyboardInterrupt and stops us; we must not die of it first (a
    # traceback each, and the interrupt turned into a FetcherError).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(pdeathsig, free_fd.fd)
    parent = os.getppid()
    area = SlotArea(area_fd.fd, slots, slot_bytes)
    os.close(area_fd.fd)
    # A process fetch_fun forks (a helper that outlives us) must not keep
    # the slots mapped, and with them the parent's memory, after we end.
    if hasattr(mmap, "MADV_DONTFORK"):
        area.mm.madvise(mmap.MADV_DONTFORK)
    try:
        _work(
            WorkerInfo(worker_id, index, num_workers, source, seed, np.random.default_rng(seed)),
            payload, on_error, area, free_fd.fd, out_fd.fd, parent, epochs, first_epoch,
        )
    finally:
        # we return on purpose: an exit with code 0 without this flag is a
        # death (os._exit(0) inside fetch_fun), which the parent reports at once
        area.set_ending()


def _work(
    first: WorkerInfo,
    payload: bytes,
    on_error: str,
    area: SlotArea,
    free_r: int,
    out: int,
    parent: int,
    epochs: int | None,
    epoch: int,
) -> None:
    worker_id = first.worker_id
    send = functools.partial(send_message, out)
    dumps = pickle.dumps
    perf = time.perf_counter
    slots, slot_bytes = area.slots, area.slot_bytes
    free = list(range(slots))

    def take_slot() -> int:
        while not free:
            data = os.read(free_r, SLOT_INDEX.size * slots)
            if not data:
                return -1  # the parent closed its end
            for (i,) in SLOT_INDEX.iter_unpack(data):
                if i < 0:
                    return -1
                free.append(i)
        return free.pop()

    def report(exc: BaseException, seconds: float, fatal: bool) -> None:
        data, tb = pack_exception(exc)
        send(dumps(("error", seconds, data, tb, fatal), protocol=5))

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
        report(err, 0.0, True)
        return
    pending: list[tuple[float, Any]] = []
    pending_bytes = 0
    oldest = 0.0
    noted_big = False

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        try:
            msg = dumps(("items", pending), protocol=5)
        except Exception:
            # one unpicklable result: send the others, and a stand-in the
            # parent's validator refuses with a clear message
            msg = dumps(("items", [(s, _sendable(r)) for s, r in pending]), protocol=5)
        send(msg)
        pending = []
        pending_bytes = 0

    def fetch_epoch() -> bool:
        """Fetch until StopIteration (True), an error or a stop (False)."""
        nonlocal oldest, noted_big, pending_bytes
        while not area.stopping() and os.getppid() == parent:
            t0 = perf()
            try:
                raw = fetch_fun(worker_id, area.hint())
            except StopIteration:
                flush()
                if is_last_epoch(epochs, epoch):
                    send(dumps(("done", perf() - t0)))
                else:
                    send(dumps(("epoch", perf() - t0)))
                return True
            except BaseException as exc:
                seconds = perf() - t0
                flush()
                report(exc, seconds, False)
                if on_error == "skip" and isinstance(exc, Exception):
                    continue
                return False
            seconds = perf() - t0
            state = None
            if type(raw) is Stamped:  # a stateful fetch_fun's state travels with its chunk
                raw, state = raw
            arrays = _plain_arrays(raw)
            nbytes = sum(align(a.nbytes) for a in arrays) if arrays is not None else 0
            if arrays is not None and SHM_MIN_BYTES <= nbytes <= slot_bytes:
                flush()
                slot = take_slot()
                if slot < 0:
                    return False
                base = area.offset(slot)
                meta = []
                off = 0
                for a in arrays:
                    dst = np.ndarray(a.shape, a.dtype, buffer=area.mm, offset=base + off)
                    np.copyto(dst, a, casting="no")
                    # the dtype itself: its .str loses a structured dtype's fields
                    meta.append((a.dtype, a.shape, off))
                    off += align(a.nbytes)
                send(dumps(("slot", seconds, slot, meta, isinstance(raw, tuple), state)))
                continue
            if nbytes > slot_bytes and not noted_big:
                noted_big = True
                send(dumps(("note", (
                    f"a chunk of {nbytes / 2**20:.2f} MiB is larger than a shared-memory slot "
                    f"({slot_bytes / 2**20:.2f} MiB): such chunks travel pickled through a pipe, "
                    "which is slower; pass backend=ProcessBackend(slot_bytes=...) with more"
                ))))
            if not pending:
                oldest = t0
            pending.append((seconds, raw if state is None else Stamped(raw, state)))
            pending_bytes += nbytes or 64
            # another fetch would hold these past the delay bound: send now
            if pending_bytes >= INLINE_MAX_BYTES or perf() - oldest + seconds >= INLINE_MAX_DELAY_S:
                flush()
        return False

    while True:
        # the same seed and generator the worker would have as a thread
        set_worker_info(for_epoch(first, epoch))
        if worker_init_fun is not None:
            try:
                worker_init_fun(worker_id)
            except BaseException as exc:
                report(exc, 0.0, True)
                return
        if not fetch_epoch() or is_last_epoch(epochs, epoch):
            break
        epoch += 1
    flush()


class Unsendable:
    """Stands in for a result that could not be pickled: the parent's
    validator refuses it, naming its type."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<unpicklable {self.type_name}>"


def _sendable(raw: Any) -> Any:
    try:
        pickle.dumps(raw, protocol=5)
        return raw
    except Exception:
        return Unsendable(f"{type(raw).__module__}.{type(raw).__qualname__}")
