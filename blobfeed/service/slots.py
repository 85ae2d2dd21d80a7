"""Shared memory between the service and one consumer: a ring of slots.

The service makes one anonymous ``memfd`` per connection (no name in
``/dev/shm``: nothing outlives the two processes, whatever kills them),
cut into ``slots`` slots of ``slot_bytes``, and passes its descriptor once,
at attach.  It writes each batch once into a free slot; the consumer hands
it out as read-only views of its mapping and tells the service the slot is
free once every view of it has died (``free`` record).  A slot the consumer
never frees (a batch the user keeps) simply stays taken: the others keep
circulating.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from ..feeders.messages import align
from .wire import WireError, dtype_from_wire, dtype_to_wire

__all__ = ["ConsumerMapping", "SlotArea", "batch_nbytes"]


def batch_nbytes(arrays: Sequence[np.ndarray]) -> int:
    """Bytes one batch of ``arrays`` takes in a slot (each array aligned)."""
    return sum(align(a.nbytes) for a in arrays)


class SlotArea:
    """The service's end of one connection's slots.  Thread-safe."""

    def __init__(self, name: str, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, slots * slot_bytes)
            self._mm = mmap.mmap(self.fd, slots * slot_bytes)
        except BaseException:
            os.close(self.fd)
            raise
        self._buf = np.frombuffer(self._mm, np.uint8)
        self._cond = threading.Condition()
        self._free = list(range(slots - 1, -1, -1))
        self._closed = False

    def close_fd(self) -> None:
        """The consumer has its own descriptor now: ours is not needed."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def take(self, timeout: float) -> int | None:
        """A free slot, waiting up to ``timeout``; None if none came (or closed)."""
        with self._cond:
            if not self._free and not self._closed:
                self._cond.wait(timeout)
            if self._closed or not self._free:
                return None
            return self._free.pop()

    def give_back(self, slot: int, peer: str) -> None:
        """The consumer freed ``slot``.

        Raises:
            WireError: ``slot`` is no slot, or one that is free already.
        """
        with self._cond:
            if not 0 <= slot < self.slots or slot in self._free:
                raise WireError(f"{peer} freed slot {slot}, which it does not hold")
            self._free.append(slot)
            self._cond.notify()

    def write(self, slot: int, arrays: Sequence[np.ndarray]) -> list[list[Any]]:
        """Copy ``arrays`` once into ``slot``; what the ``batch`` record says of them."""
        base = slot * self.slot_bytes
        meta = []
        off = 0
        for a in arrays:
            if a.nbytes:
                dst = np.ndarray(a.shape, a.dtype, buffer=self._buf, offset=base + off)
                np.copyto(dst, a, casting="no")
            meta.append([dtype_to_wire(a.dtype), list(a.shape), off])
            off += align(a.nbytes)
        return meta

    def read(self, slot: int, meta: list[list[Any]]) -> tuple[np.ndarray, ...]:
        """Views of the arrays written into ``slot`` (for re-dealing them)."""
        base = slot * self.slot_bytes
        return tuple(
            np.ndarray(tuple(shape), np.dtype(dt), buffer=self._buf, offset=base + off)
            for dt, shape, off in meta
        )

    def close(self) -> None:
        """Wake the sender; the mapping goes with the last view of it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.close_fd()

    def unmap(self) -> None:
        """Unmap now if nothing views the slots (else the last view does)."""
        self._buf = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass


class ConsumerMapping:
    """The consumer's end: the service's slots mapped read-only, handed out
    as views; ``on_free(slot)`` is called once the last view of a batch died.

    ``on_free`` runs from a weakref callback wherever the last view died
    (any thread, in the middle of any bytecode): it must only put the slot
    on a queue (C code), never do I/O itself.
    """

    def __init__(self, fd: int, slots: int, slot_bytes: int, on_free: Callable[[Any], None]) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        size = os.fstat(fd).st_size
        if size < slots * slot_bytes:
            raise WireError(f"the service's shared memory holds {size} bytes, not {slots} x {slot_bytes}")
        self._mm = mmap.mmap(fd, slots * slot_bytes, prot=mmap.PROT_READ)
        self._on_free = on_free
        #: id(weakref) -> (weakref, slot): the refs must live to fire
        self.outstanding: dict[int, tuple[Any, int]] = {}

    def views(self, slot: int, n: int, meta: Any, peer: str) -> tuple[np.ndarray, ...]:
        """The arrays of a ``batch`` record, checked to lie inside ``slot``
        and to hold ``n`` samples each (untrusted: the record came off a socket)."""
        if not 0 <= slot < self.slots:
            raise WireError(f"{peer}: batch in slot {slot}, of {self.slots}")
        if not isinstance(meta, list) or not meta or len(meta) > 1024:
            raise WireError(f"{peer}: a batch's arrays must be a non-empty list")
        # a fresh array over the mapping, not a slice of one: numpy collapses
        # view chains to the first array whose base is not an array, so this
        # `root` is the base of every view below
        root = np.frombuffer(self._mm, np.uint8, count=self.slot_bytes, offset=slot * self.slot_bytes)
        out = []
        for i, m in enumerate(meta):
            where = f"{peer}: array {i}"
            if not (isinstance(m, list) and len(m) == 3 and isinstance(m[1], list) and type(m[2]) is int):
                raise WireError(f"{where}: must be [dtype, shape, offset]")
            dt = dtype_from_wire(m[0], where)
            shape = m[1]
            if len(shape) > 32 or not all(type(d) is int and d >= 0 for d in shape) or not shape or shape[0] != n:
                raise WireError(f"{where}: bad shape {shape!r} for {n} samples")
            nbytes = dt.itemsize * int(np.prod(shape, dtype=object))
            off = m[2]
            if off < 0 or off % 8 or off + nbytes > self.slot_bytes:
                raise WireError(f"{where}: {nbytes} bytes at offset {off} do not fit a slot of {self.slot_bytes}")
            out.append(root[off:off + nbytes].view(dt).reshape(shape))
        # every view's base is `root` (numpy collapses view chains): the slot
        # is free once `root` dies, which is when the last view died
        ref = weakref.ref(root, self._on_free)
        self.outstanding[id(ref)] = (ref, slot)
        return tuple(out)

    def close(self) -> None:
        """Unmap now if no batch views the slots any more (else the last
        view unmaps them when it dies)."""
        try:
            self._mm.close()
        except BufferError:
            pass

    def freed(self, ref: Any) -> int | None:
        """The slot whose views died (``ref`` from the ``on_free`` queue)."""
        entry = self.outstanding.pop(id(ref), None)
        return None if entry is None else entry[1]
