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

import fcntl
import mmap
import os
import pickle
import select
import struct
import traceback
from typing import Any

import numpy as np

from ..shared_regions import SharedRegion

__all__ = [
    "HEADER_BYTES", "MessageReader", "SlotArea", "mem_available", "pack_exception", "send_message",
    "unpack_exception",
]

#: area header: [0:8] the batch-size hint, [8:16] the stop flag (parent to
#: worker), [16:24] the ending flag (worker to parent: it returns on purpose),
#: [24:32] the started flag (worker to parent: its start-up is over),
#: [32:40] the size of the batches the worker may assemble itself, 0: none,
#: [40:48] how many of its slots batches handed out view (both parent to
#: worker, see worker_batches), [48:56] the worker waits for that count to
#: grow (worker to parent: a batch handed out then writes it a wake-up),
#: [56:64] 1 + the read unit it reads, 0: none (worker to parent).  Each an
#: 8-byte integer in the machine's byte order, written and read whole (see SlotArea)
HEADER_BYTES = 64
#: Linux 5.1's F_SEAL_FUTURE_WRITE (not in Python's fcntl module)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
#: one free slot index on the free pipe; -1 tells the worker to stop, and
#: WAKE wakes it to look at the viewed count again
SLOT_INDEX = struct.Struct("<i")
#: on the free-slot pipe: no slot, look at the viewed count again
WAKE = -2


#: the length of one message on a worker's pipe, before its bytes
_LENGTH = struct.Struct("<Q")
#: a message length the reader allocates at once; longer ones grow as they arrive
_TRUSTED_LENGTH = 64 << 20


def send_message(fd: int, data: bytes) -> None:
    """Write one message (its length, then its bytes) to the blocking pipe ``fd``."""
    view = memoryview(_LENGTH.pack(len(data)) + data) if len(data) < 65536 else None
    if view is None:  # a big message: not copied to prepend its length
        _write_all(fd, memoryview(_LENGTH.pack(len(data))))
        view = memoryview(data)
    _write_all(fd, view)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


class MessageReader:
    """The parent's end of a worker's pipe: whole messages, until the worker
    process has ended.

    The end of the worker is its process's ``sentinel``, not the pipe's EOF:
    a process ``fetch_fun`` forked inherits the pipe's write end and may
    keep it open for as long as it lives, so EOF may never come.  Once the
    sentinel is ready the messages the worker wrote before it ended are read
    (without blocking) and then the stream ends, a message cut short by its
    death included.
    """

    def __init__(self, fd: int, sentinel: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._sentinel = sentinel
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._poller.register(sentinel, select.POLLIN)
        #: the worker process has ended: read what is left, never wait
        self._ended = False

    def recv(self) -> bytearray | None:
        """The next message; None once the worker ended and no whole message is left."""
        head = self._read(_LENGTH.size)
        if head is None:
            return None
        return self._read(_LENGTH.unpack(head)[0])

    def _read(self, n: int) -> bytearray | None:
        # The length comes off the pipe, which is not to be trusted (a helper
        # fetch_fun forked may write to it): room for more than a message
        # of ordinary size is made as the bytes arrive, never up front.
        buf = bytearray(min(n, _TRUSTED_LENGTH))
        view = memoryview(buf)
        pos = 0
        while pos < n:
            if pos == len(buf):
                view.release()
                buf.extend(bytes(min(n - pos, max(pos, _TRUSTED_LENGTH))))
                view = memoryview(buf)
            try:
                got = os.readv(self.fd, [view[pos:]])
            except BlockingIOError:
                got = -1
            except OSError:  # closed under us: stopped
                return None
            if got == 0:
                return None  # EOF: every holder of the write end closed it
            if got > 0:
                pos += got
                continue
            if self._ended:
                return None  # nothing more will come
            for fd, _ in self._poller.poll():
                if fd == self._sentinel:
                    self._ended = True
        return buf


class SlotArea:
    """One worker's shared memory: a header and ``slots`` slots of ``slot_bytes``."""

    def __init__(self, fd: int, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.size = HEADER_BYTES + slots * slot_bytes
        self.mm = mmap.mmap(fd, self.size)
        # The header as 8-byte words, written and read one aligned word at
        # a time: the other process reads a field while this one writes
        # it.  ``struct.pack_into`` clears the field's bytes before it
        # writes them, so a worker read 0 for a value that never changed
        # (a fetcher's batch size; a batch it was filling sent early).
        # Word i is bytes [8i:8i+8] of the layout above HEADER_BYTES.
        self._words = memoryview(self.mm)[:HEADER_BYTES].cast("q")

    @classmethod
    def create(cls, name: str, slots: int, slot_bytes: int) -> tuple["SlotArea", int]:
        """A new area, and its descriptor (the parent's to keep: the worker
        gets it, and so may a consumer in another process that reads the
        worker's batches where they lie, see :meth:`shared_region`).  Its
        size is sealed: nobody holding the descriptor can shrink it under
        the mappings."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, HEADER_BYTES + slots * slot_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            return cls(fd, slots, slot_bytes), fd
        except BaseException:
            os.close(fd)
            raise

    def shared_region(self, name: str, fd: int) -> SharedRegion | None:
        """The area as a region another process may map (``fd``: its
        descriptor, see :mod:`blobfeed.shared_regions`), sealed against
        new writable mappings first (the parent's and the worker's, made
        before, stay writable): call once the worker mapped it.  None on a
        kernel without that seal (before 5.1): another process could map
        it writable and change the worker's header and batches, so it is
        not shared (its batches are copied)."""
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except OSError:
            return None
        base = np.frombuffer(self.mm, np.uint8, count=1).__array_interface__["data"][0]
        return SharedRegion(name, fd, base, HEADER_BYTES, self.slots, self.slot_bytes)

    def offset(self, slot: int) -> int:
        return HEADER_BYTES + slot * self.slot_bytes

    def close(self) -> None:
        """Unmap the area, unless arrays still view it (it is unmapped
        with the last of them)."""
        self._words.release()
        try:
            self.mm.close()
        except BufferError:
            pass

    def set_hint(self, value: int) -> None:
        self._words[0] = value

    def hint(self) -> int:
        return self._words[0]

    def set_whole(self, size: int) -> None:
        self._words[4] = size

    def whole(self) -> int:
        """The size of the batches the worker may assemble itself (0: it may not)."""
        return self._words[4]

    def set_viewed(self, slots: int) -> bool:
        """Publish the viewed count; whether the worker waits for it (see
        :meth:`set_waiting`)."""
        self._words[5] = slots
        return self._words[6] != 0

    def viewed(self) -> int:
        """How many of the worker's slots batches handed out view now."""
        return self._words[5]

    def set_waiting(self, waiting: bool) -> None:
        """The worker waits (or no longer) for the viewed count to grow."""
        self._words[6] = int(waiting)

    def set_stop(self) -> None:
        self._words[1] = 1

    def stopping(self) -> bool:
        return self._words[1] != 0

    def set_ending(self) -> None:
        self._words[2] = 1

    def ending(self) -> bool:
        """True once the worker returns by itself (after its last message):
        an exit with code 0 without it is a death (``os._exit(0)``)."""
        return self._words[2] != 0

    def set_reading(self, unit: int) -> None:
        self._words[7] = unit + 1

    def reading(self) -> int:
        """The read unit the worker reads (-1: none, before its first and
        while it waits for the next): the one to blame if it died."""
        return self._words[7] - 1

    def set_started(self) -> None:
        self._words[3] = 1

    def started(self) -> bool:
        """True once the worker's own code runs: a death before it happened
        in the process's start-up (importing the main module, say)."""
        return self._words[3] != 0


def mem_available(
    meminfo: str = "/proc/meminfo",
    cgroup: str = "/proc/self/cgroup",
    cgroup_root: str = "/sys/fs/cgroup",
) -> int | None:
    """Bytes of memory this process may still take, or None when unknown:
    the kernel's ``MemAvailable``, and within a container the room left under
    its cgroup's memory limit (memfd pages count against it), whichever is
    less."""
    free: int | None = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    room = _cgroup_room(cgroup, cgroup_root)
    if room is not None and (free is None or room < free):
        return room
    return free


def _cgroup_room(cgroup: str, root: str) -> int | None:
    """Room under the tightest memory limit of this process's cgroup and its
    ancestors (cgroup v2; v1's memory controller too), or None."""
    try:
        with open(cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    room: int | None = None

    def tighter(limit: int, used: int) -> None:
        nonlocal room
        left = max(0, limit - used)
        if room is None or left < room:
            room = left

    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        # The cgroup and every ancestor of it the mount shows (in a container
        # the mount's root is often the container's own cgroup, its path
        # in /proc/self/cgroup absent from the mount).
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:depth])
            limit, used = _read_int(os.path.join(d, files[0])), _read_int(os.path.join(d, files[1]))
            if limit is not None and used is not None and limit < 2**60:  # v1's "no limit" is huge
                tighter(limit, used)
    return room


def _read_int(path: str) -> int | None:
    """An integer file of the cgroup filesystem; None when absent or "max"."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
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

    The object travels as it is (same type, same arguments, same attributes),
    never rebuilt as ``type(exc)(message)``, which fails for exceptions whose
    constructor takes other arguments.  Pickle's own way is tried first (it
    honours a class's ``__reduce__``); where it fails or gives back other
    arguments (``type(exc)(*exc.args)`` fails or means something else when
    ``__init__`` takes other parameters than ``args`` holds: torch issues
    30147, 34130), the object is rebuilt without calling ``__init__``, from
    its type, ``args`` and attributes.  Only what survives neither is
    replaced, by a ``RuntimeError`` carrying its type and text.
    """
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for candidate in (exc, _ExceptionState(exc)):
        for dumps in _dumpers():
            try:
                data = dumps(candidate)
                back = pickle.loads(data)
            except Exception:
                continue
            if type(back) is type(exc) and _same_args(back.args, exc.args):
                return data, tb
    stand_in = RuntimeError(
        f"{type(exc).__module__}.{type(exc).__qualname__}: {exc} "
        "(the original exception could not be pickled)"
    )
    return pickle.dumps(stand_in), tb


class _ExceptionState:
    """Pickles as "the exception rebuilt from its type, args and attributes"."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        exc = self.exc
        return _rebuild_exception, (type(exc), exc.args, dict(getattr(exc, "__dict__", {})))


def _rebuild_exception(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    # as BaseException.__reduce__ + __setstate__ do, but without __init__
    exc = cls.__new__(cls, *args)
    exc.args = args
    if state:
        exc.__setstate__(state)
    return exc


def _same_args(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays among them, say
        try:
            return pickle.dumps(a) == pickle.dumps(b)
        except Exception:
            return False


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
