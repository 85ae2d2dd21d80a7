"""What parent and worker process share: a shared-memory slot area, and
exceptions that travel with their traceback.

The area is an anonymous ``memfd`` (no name in /dev/shm, so nothing can leak
after a crash or a SIGKILL), mapped by both sides and cut into ``slots``
equal slots after a small header.  A slot circulates as in Caffe's
``QueuePair``: the worker takes a free one, writes a chunk into it once, and
sends its index; the parent hands the chunk out as read-only views and gives
the index back (over a pipe of 4-byte records) once nothing views it.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import traceback
from typing import Any

__all__ = [
    "HEADER_BYTES", "SlotArea", "mem_available", "pack_exception", "unpack_exception",
]

#: area header: [0:8] the batch-size hint, [8:16] the stop flag
HEADER_BYTES = 64
_HINT = struct.Struct("<q")
#: one free slot index on the free pipe; -1 tells the worker to stop
SLOT_INDEX = struct.Struct("<i")
#: every array in a slot starts at a multiple of this
ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SlotArea:
    """One worker's shared memory: a header and ``slots`` slots of ``slot_bytes``."""

    def __init__(self, fd: int, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.size = HEADER_BYTES + slots * slot_bytes
        self.mm = mmap.mmap(fd, self.size)

    @classmethod
    def create(cls, name: str, slots: int, slot_bytes: int) -> tuple["SlotArea", int]:
        """A new area, and its descriptor (for the worker; close it once the worker has it)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, HEADER_BYTES + slots * slot_bytes)
            return cls(fd, slots, slot_bytes), fd
        except BaseException:
            os.close(fd)
            raise

    def offset(self, slot: int) -> int:
        return HEADER_BYTES + slot * self.slot_bytes

    def set_hint(self, value: int) -> None:
        _HINT.pack_into(self.mm, 0, value)

    def hint(self) -> int:
        return _HINT.unpack_from(self.mm, 0)[0]

    def set_stop(self) -> None:
        _HINT.pack_into(self.mm, 8, 1)

    def stopping(self) -> bool:
        return _HINT.unpack_from(self.mm, 8)[0] != 0


def mem_available() -> int | None:
    """Bytes of memory the kernel says are available (``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process, as text
    (``concurrent.futures`` does the same): the ``__cause__`` of the original
    exception once it has crossed the process boundary."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def pack_exception(exc: BaseException) -> tuple[bytes, str]:
    """The exception itself, pickled, and its traceback as text.

    The object travels as it is (same type, same arguments), never rebuilt as
    ``type(exc)(message)``, which fails for exceptions whose constructor takes
    other arguments.  Only what does not survive a pickle round trip is
    replaced, by a ``RuntimeError`` carrying its type and text.
    """
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for dumps in _dumpers():
        try:
            data = dumps(exc)
            pickle.loads(data)
            return data, tb
        except Exception:
            continue
    stand_in = RuntimeError(
        f"{type(exc).__module__}.{type(exc).__qualname__}: {exc} "
        "(the original exception could not be pickled)"
    )
    return pickle.dumps(stand_in), tb


def unpack_exception(data: bytes, tb: str) -> BaseException:
    """The exception of :func:`pack_exception`, its remote traceback as ``__cause__``."""
    try:
        exc: BaseException = pickle.loads(data)
    except Exception as err:  # a class the parent cannot import, say
        exc = RuntimeError(f"an exception from a worker process could not be unpickled: {err!r}")
    exc.__cause__ = RemoteTraceback(tb)
    return exc


def _dumpers() -> list[Any]:
    # by reference first (the parent gets the very class); cloudpickle for
    # what plain pickle cannot do (a class defined in a closure, say)
    out: list[Any] = [pickle.dumps]
    try:
        import cloudpickle

        out.append(cloudpickle.dumps)
    except ImportError:
        pass
    return out


class FdHandle:
    """A descriptor handed to a worker process as it starts.

    Pickled while the process object is sent to the child, it is duplicated
    into the child by multiprocessing itself (SCM_RIGHTS for forkserver and
    spawn), as ``multiprocessing.heap`` hands over its arenas.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        return _rebuild_fd, (reduction.DupFd(self.fd),)


def _rebuild_fd(dup: Any) -> FdHandle:
    return FdHandle(dup.detach())
