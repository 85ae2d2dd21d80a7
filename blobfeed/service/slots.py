"""Shared memory between the service and one consumer: a ring of slots.

The service makes one anonymous ``memfd`` per connection (no name in
``/dev/shm``: nothing outlives the two processes, whatever kills them),
cut into ``slots`` slots of ``slot_bytes``, and passes its descriptor once,
at attach.  It writes each batch once into a free slot; the consumer hands
it out as read-only views of its mapping and tells the service the slot is
free once every view of it has died (in its next ``ack`` record).  A slot the consumer
never frees (a batch the user keeps) simply stays taken: the others keep
circulating.

Over TCP (:mod:`.tcp`) there is no shared memory: the service keeps only
the ring's bookkeeping (:class:`StreamSlots`) and sends a batch's bytes
after its record, straight from the batch's arrays; the consumer reads them
into a buffer of its own per slot (:class:`StreamBuffers`) and hands out
the same read-only views.  The freed slots in ``ack`` records, and so the flow control,
are the same.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from .wire import BatchCheck, WireError, dtype_from_wire, dtype_to_wire, wire_align

__all__ = [
    "ConsumerMapping", "SlotArea", "StreamBuffers", "StreamSlots", "batch_nbytes", "check_sealed", "sealed_memfd",
]

#: the largest shared region a consumer maps (a source's arena, a worker
#: process's slots): slots, and bytes of address space (all regions at once)
MAX_ARENA_SLOTS = 4096
MAX_ARENA_BYTES = 1 << 40
#: shared regions a consumer maps at once, and the largest header one may have
MAX_REGIONS = 256
MAX_REGION_HEADER = 1 << 20

#: Linux 5.1's F_SEAL_FUTURE_WRITE (not in Python's fcntl module): no new
#: writable mapping and no write(), while the mappings made before stay writable
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)


def check_sealed(fd: int, peer: str, what: str) -> None:
    """A consumer maps only shared memory whose size is sealed: a hostile
    service could otherwise truncate it under the consumer's views, and the
    consumer would die of SIGBUS reading them."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as err:
        raise WireError(f"{peer} sent {what} that is not a sealed memfd ({err})") from None
    if seals & fcntl.F_SEAL_SHRINK == 0:
        raise WireError(f"{peer} sent {what} that can shrink (not sealed against it)")


def sealed_memfd(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A ``memfd`` of ``size`` bytes and the service's writable mapping of it,
    sealed before its descriptor goes to any consumer.

    A consumer gets the descriptor, so without seals a hostile one could
    truncate it (the service's next write into it dies of SIGBUS, and every
    consumer with it) or map it writable and change the batches other
    consumers read.  Sealed, its size is fixed and only the mapping made
    here may write it; a kernel without ``F_SEAL_FUTURE_WRITE`` (before
    5.1) still gets the size seals.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        size_seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, size_seals | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except OSError:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, size_seals | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def batch_nbytes(arrays: Sequence[np.ndarray]) -> int:
    """Bytes one batch of ``arrays`` takes in a slot (each array aligned)."""
    return sum(wire_align(a.nbytes) for a in arrays)


class _Ring:
    """Which of a connection's slots are free (the service's side).  Thread-safe."""

    #: a batch written to a slot lies in the slot's memory (else its own
    #: arrays are what is sent, and the slot is bookkeeping only)
    holds_bytes = False

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.fd = -1
        self._cond = threading.Condition()
        #: give_back wakes the sender once this many slots are free (see take)
        self._want = 1
        self._free = list(range(slots - 1, -1, -1))
        #: per slot, 1 while it is in _free (its membership at a glance)
        self._is_free = bytearray(b"\x01") * slots
        self._closed = False

    def close_fd(self) -> None:
        """Nothing to close (see :class:`SlotArea`)."""

    def take(self, timeout: float, want: int = 1) -> int | None:
        """A free slot, waiting up to ``timeout`` for ``want`` of them to be
        free (then one is taken; after ``timeout``, one if any is); None if
        none came (or closed)."""
        with self._cond:
            if len(self._free) < want and not self._closed:
                self._want = want
                try:
                    self._cond.wait(timeout)
                finally:
                    self._want = 1
            if self._closed or not self._free:
                return None
            slot = self._free.pop()
            self._is_free[slot] = 0
            return slot

    def take_nowait(self) -> int | None:
        """A free slot if there is one now, else None."""
        with self._cond:
            if self._closed or not self._free:
                return None
            slot = self._free.pop()
            self._is_free[slot] = 0
            return slot

    def give_back(self, slots: list[int], peer: str) -> None:
        """The consumer freed ``slots`` (one ``ack``'s).

        Raises:
            WireError: one is no slot, or one that is free already (those
                before it are freed).
        """
        if not slots:
            return
        with self._cond:
            try:
                is_free = self._is_free
                for slot in slots:
                    if not 0 <= slot < self.slots or is_free[slot]:
                        raise WireError(f"{peer} freed slot {slot}, which it does not hold")
                    is_free[slot] = 1
                    self._free.append(slot)
            finally:
                if len(self._free) >= self._want:
                    self._cond.notify()

    def close(self) -> None:
        """Wake the sender."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def unmap(self) -> None:
        """Nothing mapped (see :class:`SlotArea`)."""


class StreamSlots(_Ring):
    """The service's end of a TCP connection's slots: the bookkeeping only;
    a batch's bytes go on the stream after its record, from its own arrays."""

    def write(self, slot: int, arrays: Sequence[np.ndarray]) -> list[list[Any]]:
        """What the ``batch`` record says of ``arrays`` (their bytes are the
        frame's payload, laid out as in a slot: see :func:`layout`).

        Raises:
            ValueError: the batch does not fit a slot (the source's layout changed).
        """
        meta, size = layout(arrays)
        if size > self.slot_bytes:
            raise ValueError(f"a batch of {size} bytes does not fit a slot of {self.slot_bytes}")
        return meta


def layout(arrays: Sequence[np.ndarray]) -> tuple[list[list[Any]], int]:
    """``[dtype, shape, offset]`` of each array packed into a slot (each at
    an aligned offset, from 0), and the bytes they take."""
    meta = []
    off = 0
    for a in arrays:
        meta.append([dtype_to_wire(a.dtype), list(a.shape), off])
        off += wire_align(a.nbytes)
    return meta, off


class SlotArea(_Ring):
    """The service's end of one connection's slots (shared memory).  Thread-safe."""

    holds_bytes = True

    def __init__(self, name: str, slots: int, slot_bytes: int) -> None:
        super().__init__(slots, slot_bytes)
        self.fd, self._mm = sealed_memfd(name, slots * slot_bytes)
        self._buf = np.frombuffer(self._mm, np.uint8)
        #: (dtype, shape) of each array -> (meta, its JSON): a source's
        #: batches have a handful of layouts (the last of an epoch is smaller)
        self._layouts: dict[tuple[Any, ...], tuple[list[list[Any]], str]] = {}

    def close_fd(self) -> None:
        """The consumer has its own descriptor now: ours is not needed."""
        with self._cond:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def write(self, slot: int, arrays: Sequence[np.ndarray]) -> list[list[Any]]:
        """Copy ``arrays`` once into ``slot``; what the ``batch`` record says of them."""
        base = slot * self.slot_bytes
        meta = []
        off = 0
        for a in arrays:
            if a.nbytes:
                self._copy(base + off, a)
            meta.append([dtype_to_wire(a.dtype), list(a.shape), off])
            off += wire_align(a.nbytes)
        return meta

    def write_encoded(self, slot: int, arrays: Sequence[np.ndarray]) -> tuple[list[list[Any]], str]:
        """:meth:`write`, with the meta's JSON text (the same for every batch of a layout)."""
        key = tuple([(a.dtype, a.shape) for a in arrays])  # (dtype.str is made anew per call)
        known = self._layouts.get(key)
        if known is None:
            meta = self.write(slot, arrays)
            if len(self._layouts) >= 64:
                self._layouts.clear()
            known = self._layouts[key] = (meta, json.dumps(meta, separators=(",", ":")))
            return known
        base = slot * self.slot_bytes
        for a, (_, _, off) in zip(arrays, known[0]):
            if a.nbytes:
                self._copy(base + off, a)
        return known

    def _copy(self, at: int, a: np.ndarray) -> None:
        """``a``'s bytes into the slots at byte ``at``: a contiguous array
        as one slice of the mapping (a fifth of numpy's view and copyto for
        a small batch), any other through numpy."""
        if a.flags.c_contiguous:
            self._mm[at:at + a.nbytes] = a  # type: ignore[call-overload]  # its bytes, in order (a buffer)
        else:
            np.copyto(np.ndarray(a.shape, a.dtype, buffer=self._buf, offset=at), a, casting="no")

    def read(self, slot: int, meta: list[list[Any]]) -> tuple[np.ndarray, ...]:
        """Views of the arrays written into ``slot`` (for re-dealing them)."""
        base = slot * self.slot_bytes
        return tuple(
            np.ndarray(tuple(shape), np.dtype(dt), buffer=self._buf, offset=base + off)
            for dt, shape, off in meta
        )

    def close(self) -> None:
        """Wake the sender; the mapping goes with the last view of it."""
        super().close()
        self.close_fd()

    def unmap(self) -> None:
        """Unmap now if nothing views the slots (else the last view does)."""
        self._buf = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass


def _int_numbers(meta: list[Any]) -> bool:
    """Every offset and dimension of ``meta`` (equal to a checked one) is an int."""
    for m in meta:
        if type(m[2]) is not int:
            return False
        for d in m[1]:
            if type(d) is not int:
                return False
    return True


class ConsumerMapping:
    """The consumer's end: the service's slots mapped read-only, handed out
    as views; ``on_free(slot)`` is called once the last view of a batch died.

    ``on_free`` runs from a weakref callback wherever the last view died
    (any thread, in the middle of any bytecode): it must only put the slot
    on a queue (C code), never do I/O itself.
    """

    def __init__(
        self, fd: int, slots: int, slot_bytes: int, on_free: Callable[[Any], None], check: BatchCheck | None = None,
    ) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        #: what every batch is checked against besides its slot (None: only the slot)
        self._check = check
        check_sealed(fd, "the service", "slots")
        size = os.fstat(fd).st_size
        if size < slots * slot_bytes:
            raise WireError(f"the service's shared memory holds {size} bytes, not {slots} x {slot_bytes}")
        self._mm = mmap.mmap(fd, slots * slot_bytes, prot=mmap.PROT_READ)
        self._on_free = on_free
        #: the shared regions the service handed over, by id: (mapping, slots, slot_bytes, header)
        self._regions: dict[int, tuple[mmap.mmap, int, int, int]] = {}
        #: regions retired while batches still viewed them: (weakref of the
        #: mapping, its bytes); bounded as the live ones are, apart from them
        #: (the service counts only its live regions), until the last view
        #: died (the mapping with it)
        self._retired: list[tuple[weakref.ref[mmap.mmap], int]] = []
        #: bytes of the regions mapped (live ones)
        self._region_bytes = 0
        #: id(weakref) -> (weakref, slot): the refs must live to fire
        self.outstanding: dict[int, tuple[Any, int]] = {}
        #: (dtype text, shape, offset) -> what _check_array found of it
        self._checked: dict[tuple[Any, ...], tuple[np.dtype, tuple[int, ...], int, int]] = {}
        #: per place (None: the consumer's slots; else a region's id), the
        #: last batch's (meta, n) there and the (shape, dtype, offset) of its
        #: arrays, all checked: the next batch of that layout in the same
        #: place (most are) is checked by comparing its meta with that one
        #: (per place: batches of two workers alternate between their regions)
        self._last: dict[int | None, tuple[Any, int, list[tuple[tuple[int, ...], np.dtype, int]]]] = {}

    def add_arena(self, fds: list[int], region: int, offset: int, slots: int, slot_bytes: int, peer: str) -> None:
        """Map a shared region (an ``arena`` record: one descriptor, a new
        id, sizes checked against the file and the bounds; the caller
        closes ``fds``)."""
        if len(fds) != 1:
            raise WireError(f"{peer} sent an arena with {len(fds)} descriptors, not 1")
        if region in self._regions:
            raise WireError(f"{peer} sent arena {region} a second time")
        if len(self._regions) >= MAX_REGIONS:
            raise WireError(f"{peer} sent more than {MAX_REGIONS} arenas at once")
        if not (
            0 < slots <= MAX_ARENA_SLOTS and 64 <= slot_bytes and 0 <= offset <= MAX_REGION_HEADER
            and offset % 64 == 0 and self._region_bytes + offset + slots * slot_bytes <= MAX_ARENA_BYTES
        ):
            raise WireError(f"{peer} offered an arena of {slots} slots of {slot_bytes} bytes after {offset}")
        check_sealed(fds[0], peer, "an arena")
        size = offset + slots * slot_bytes
        have = os.fstat(fds[0]).st_size
        if have < size:
            raise WireError(f"{peer}'s arena {region} holds {have} bytes, not {offset} + {slots} x {slot_bytes}")
        self._regions[region] = (mmap.mmap(fds[0], size, prot=mmap.PROT_READ), slots, slot_bytes, offset)
        self._region_bytes += size

    def retire(self, region: int, peer: str) -> None:
        """Let go of a shared region (a ``retire`` record): unmapped once the
        last batch that views it died."""
        entry = self._regions.pop(region, None)
        if entry is None:
            raise WireError(f"{peer} retired arena {region}, which it never sent")
        size = entry[3] + entry[1] * entry[2]
        self._region_bytes -= size
        self._last.pop(region, None)
        try:
            entry[0].close()
        except BufferError:
            # viewed: unmapped with the last view, and counted until then
            retired = self._retired = [(ref, n) for ref, n in self._retired if ref() is not None]
            retired.append((weakref.ref(entry[0]), size))
            if len(retired) > MAX_REGIONS or sum(n for _, n in retired) > MAX_ARENA_BYTES:
                raise WireError(f"{peer} retired more than {MAX_REGIONS} arenas (or {MAX_ARENA_BYTES >> 40} TiB) "
                                "that batches still view: a consumer keeps that many mapped at most, besides the "
                                "live ones")

    def _region_root(self, region: int, region_slot: int, peer: str) -> tuple[np.ndarray, int]:
        """A fresh array over a region's slot, and the slot's size."""
        entry = self._regions.get(region)
        if entry is None:
            raise WireError(f"{peer}: a batch in arena {region}, which it never sent (or retired)")
        mm, slots, size, offset = entry
        if not 0 <= region_slot < slots:
            raise WireError(f"{peer}: batch in slot {region_slot} of arena {region}, of {slots}")
        return np.frombuffer(mm, np.uint8, count=size, offset=offset + region_slot * size), size

    def views(self, slot: int, n: int, meta: Any, peer: str, arena_slot: int | None = None,
              region: int = -1) -> tuple[np.ndarray, ...]:
        """The arrays of a ``batch`` record, checked to lie inside ``slot``
        (or, with ``arena_slot``, inside that slot of the shared region
        ``region``, ``slot`` standing for it) and to hold ``n`` samples each
        (untrusted: the record came off a socket)."""
        if not 0 <= slot < self.slots:
            raise WireError(f"{peer}: batch in slot {slot}, of {self.slots}")
        where = None if arena_slot is None else region
        last = self._last.get(where)
        if last is not None and type(meta) is list and n == last[1] and type(n) is int and (
            meta == last[0]) and _int_numbers(meta):
            # the last batch's layout there, checked then (equal lists, and
            # ints where 1.0 or True would compare equal too)
            return self._viewed(slot, arena_slot, region, last[2], peer)
        if not isinstance(meta, list) or not meta or len(meta) > 1024:
            raise WireError(f"{peer}: a batch's arrays must be a non-empty list")
        check = self._check
        if check is not None:
            check.rows(n, len(meta), peer)
        # a fresh array over the mapping, not a slice of one: numpy collapses
        # view chains to the first array whose base is not an array, so this
        # `root` is the base of every view below
        if arena_slot is None:
            size = self.slot_bytes
            root = np.frombuffer(self._mm, np.uint8, count=size, offset=slot * size)
        else:
            root, size = self._region_root(region, arena_slot, peer)
        out = []
        layout = []
        checked = self._checked
        for i, m in enumerate(meta):
            # a source's batches have a handful of layouts: each is checked once
            # (only plain ints: True would find the entry of 1)
            if (
                type(m) is list and len(m) == 3 and type(m[0]) is str and type(m[1]) is list
                and type(m[2]) is int and all(type(d) is int for d in m[1])
            ):
                known = checked.get((m[0], tuple(m[1]), m[2]))
            else:
                known = None
            if known is None or known[2] + known[3] > size:
                known = self._check_array(m, n, f"{peer}: array {i}", size)
            dt, shape, off, nbytes = known
            if shape[0] != n:
                raise WireError(f"{peer}: array {i}: bad shape {list(shape)!r} for {n} samples")
            # one constructor, not a slice, a view and a reshape; its base is `root`
            out.append(np.ndarray(shape, dt, root, off))
            layout.append((shape, dt, off))
        if check is not None:
            check.arrays(n, [(a.dtype, a.shape) for a in out], peer)
        if where not in self._last and len(self._last) >= MAX_REGIONS + 1:
            self._last.clear()  # (ids are the service's: bounded like the regions)
        self._last[where] = (meta, n, layout)
        # every view's base is `root` (numpy collapses view chains): the slot
        # is free once `root` dies, which is when the last view died
        ref = weakref.ref(root, self._on_free)
        self.outstanding[id(ref)] = (ref, slot)
        return tuple(out)

    def _viewed(
        self, slot: int, arena_slot: int | None, region: int, layout: list[tuple[tuple[int, ...], np.dtype, int]],
        peer: str,
    ) -> tuple[np.ndarray, ...]:
        """:meth:`views` of a batch laid out as the last one (checked then,
        against a slot of the same size: the same region's)."""
        if arena_slot is None:
            size = self.slot_bytes
            root = np.frombuffer(self._mm, np.uint8, count=size, offset=slot * size)
        else:
            root, _ = self._region_root(region, arena_slot, peer)
        out = tuple([np.ndarray(shape, dt, root, off) for shape, dt, off in layout])
        ref = weakref.ref(root, self._on_free)
        self.outstanding[id(ref)] = (ref, slot)
        return out

    def _check_array(self, m: Any, n: int, where: str, size: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
        """``[dtype, shape, offset]`` checked to fit a slot: (dtype, shape, offset, bytes), remembered."""
        if not (isinstance(m, list) and len(m) == 3 and isinstance(m[1], list) and type(m[2]) is int):
            raise WireError(f"{where}: must be [dtype, shape, offset]")
        dt = dtype_from_wire(m[0], where)
        shape = m[1]
        if (
            len(shape) > 32 or not all(type(d) is int and d >= 0 for d in shape) or not shape or shape[0] != n
            or 0 in shape and not _shape_fits(shape, dt.itemsize, size)
        ):
            raise WireError(f"{where}: bad shape {shape!r} for {n} samples")
        nbytes = dt.itemsize * int(np.prod(shape, dtype=object))
        off = m[2]
        if off < 0 or off % 8 or off + nbytes > size:
            raise WireError(f"{where}: {nbytes} bytes at offset {off} do not fit a slot of {size}")
        known = (dt, tuple(shape), off, nbytes)
        if len(self._checked) >= 256:
            self._checked.clear()
        self._checked[(m[0], known[1], off)] = known
        return known

    def close(self) -> None:
        """Unmap now if no batch views the slots any more (else the last
        view unmaps them when it dies)."""
        maps = [self._mm] + [entry[0] for entry in self._regions.values()]
        self._regions = {}
        for mm in maps:
            try:
                mm.close()
            except BufferError:
                pass

    def freed(self, ref: Any) -> int | None:
        """The slot whose views died (``ref`` from the ``on_free`` queue)."""
        entry = self.outstanding.pop(id(ref), None)
        return None if entry is None else entry[1]


def _shape_fits(shape: Sequence[int], itemsize: int, size: int) -> bool:
    """Would an array of ``shape`` fit ``size`` bytes if its empty
    dimensions were not?  (An empty one takes 0 bytes whatever its other
    dimensions, 2**62 say, which numpy cannot make.)"""
    fits = itemsize
    for d in shape:
        fits *= d or 1
    return fits <= size


class StreamBuffers:
    """The consumer's end over TCP: a buffer of its own per slot, into which
    each batch's bytes are read off the stream, handed out as read-only
    views; ``on_free`` as for :class:`ConsumerMapping`.

    What the service says of a batch is checked before a byte of it is read
    (untrusted: it came off a socket): the slot is one the consumer does not
    hold (a batch is never written under views still in use); the batch
    passes ``check`` (one array per blob, each of ``n <= batch_size``
    samples, the first batch's dtypes and per-sample shapes); the arrays
    are packed from offset 0 as the service packs them; the payload is
    exactly their size and fits the slot offered.

    Args:
        channel: the connection, positioned at the batch's payload
            (:class:`~.tcp.StreamChannel`: ``unread``, ``recv_payload_into``).
        slots, slot_bytes: what the service's ``slots`` record said.
        check: the batch checks every carrier makes (the consumer's batch size and blobs).
        on_free: told (a weakref) when the last view of a batch died.
    """

    def __init__(
        self, channel: Any, slots: int, slot_bytes: int, check: BatchCheck, on_free: Callable[[Any], None],
    ) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._channel = channel
        self._check = check
        # anonymous memory, one mapping per slot, made (or grown) when a
        # batch is read into it, as large as that batch: what the service
        # offered costs nothing until its bytes arrive
        self._mms: list[mmap.mmap | None] = [None] * slots
        self._on_free = on_free
        #: id(weakref) -> (weakref, slot): the refs must live to fire
        self.outstanding: dict[int, tuple[Any, int]] = {}
        #: slots handed out whose views may still live
        self._held: set[int] = set()
        self._lock = threading.Lock()

    def views(self, slot: int, n: int, meta: Any, peer: str, arena_slot: int | None = None,
              region: int = -1) -> tuple[np.ndarray, ...]:
        """Read the payload of a ``batch`` record into ``slot``'s buffer; its arrays, read-only.

        Raises:
            WireError: the record and the payload do not agree with each
                other, with the slot, or with what was agreed (see the class);
                a batch said to be in an arena (there is none over TCP).
            OSError: the connection failed.
        """
        if arena_slot is not None:
            raise WireError(f"{peer}: a batch in an arena, over TCP")
        if not 0 <= slot < self.slots:
            raise WireError(f"{peer}: batch in slot {slot}, of {self.slots}")
        if not isinstance(meta, list):
            raise WireError(f"{peer}: a batch's arrays must be a list (one per blob)")
        self._check.rows(n, len(meta), peer)
        shapes: list[tuple[np.dtype, tuple[int, ...]]] = []
        off = 0
        for i, m in enumerate(meta):
            where = f"{peer}: array {i}"
            if not (isinstance(m, list) and len(m) == 3 and isinstance(m[1], list) and type(m[2]) is int):
                raise WireError(f"{where}: must be [dtype, shape, offset]")
            dt = dtype_from_wire(m[0], where)
            shape = m[1]
            if (
                not shape or len(shape) > 32 or shape[0] != n
                or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
                or 0 in shape and not _shape_fits(shape, dt.itemsize, self.slot_bytes)
            ):
                raise WireError(f"{where}: bad shape {shape!r} for {n} samples")
            if m[2] != off:
                raise WireError(f"{where}: at offset {m[2]}; packed after the arrays before it, it starts at {off}")
            off += wire_align(dt.itemsize * int(np.prod(shape, dtype=object)))
            if off > self.slot_bytes:
                raise WireError(f"{where}: the arrays take {off} bytes or more, over the slot's {self.slot_bytes}")
            shapes.append((dt, tuple(shape[1:])))
        self._check.arrays(n, [(dt, (n, *sample)) for dt, sample in shapes], peer)
        unread = self._channel.unread
        if unread != off:
            raise WireError(f"{peer}: {unread} bytes of payload for arrays that take {off}")
        with self._lock:
            if slot in self._held:
                raise WireError(f"{peer}: batch in slot {slot}, whose last batch the consumer has not freed")
            self._held.add(slot)
        mm = self._mms[slot]
        if mm is None or len(mm) < off:
            if mm is not None:
                try:
                    mm.close()  # no view of it is left (the slot was freed)
                except BufferError:
                    pass
            try:
                mm = self._mms[slot] = mmap.mmap(-1, max(off, 1))
            except BaseException:
                with self._lock:
                    self._held.discard(slot)
                raise
        with memoryview(mm) as whole, whole[:off] as part:
            self._channel.recv_payload_into(part)
        root = np.frombuffer(mm, np.uint8, count=len(mm))
        root.flags.writeable = False
        out = []
        for (dt, sample), m in zip(shapes, meta):
            nbytes = dt.itemsize * n * int(np.prod(sample, dtype=np.int64))
            out.append(root[m[2]:m[2] + nbytes].view(dt).reshape((n, *sample)))
        # every view's base is `root` (numpy collapses view chains): the slot
        # is free once `root` dies
        ref = weakref.ref(root, self._on_free)
        self.outstanding[id(ref)] = (ref, slot)
        return tuple(out)

    def freed(self, ref: Any) -> int | None:
        """The slot whose views died (``ref`` from the ``on_free`` queue)."""
        entry = self.outstanding.pop(id(ref), None)
        if entry is None:
            return None
        with self._lock:
            self._held.discard(entry[1])
        return entry[1]

    def close(self) -> None:
        """Let go of the buffers no batch views any more (the others go with their last view)."""
        for mm in self._mms:
            try:
                if mm is not None:
                    mm.close()
            except BufferError:
                pass

