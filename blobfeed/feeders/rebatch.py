"""Cutting a stream of chunks into batches of exactly ``batch_size`` samples."""

from __future__ import annotations

import collections
import math
import mmap
import queue
import weakref
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import numpy as np

from ..queues import drained
from .chunks import Batch, Chunk

__all__ = ["BatchMemory", "BufferPool", "Cut", "Rebatcher"]

#: batches at least this big are assembled into recycled buffers
POOL_MIN_BYTES = 1 << 20
#: buffers kept per size, beyond those that batches still use
POOL_KEEP = 8
#: ``batch()`` calls after which spares that stayed idle throughout go back
POOL_WINDOW = 64
_NEVER = 1 << 62
_ALIGN = 64




class BatchMemory(Protocol):
    """Memory of someone else's that big batches may be assembled in (a
    served source's arena, which its consumers map)."""

    def take(self, nbytes: int) -> np.ndarray | None:
        """A uint8 array of at least ``nbytes`` whose death gives its memory
        back (the owner watches it), or None: use the pool's own."""
        ...


class BufferPool:
    """Recycled memory for batches that must be copied (they span chunks).

    A copy into freshly allocated pages runs at a fraction of the speed of
    one into warm memory, and a batch freed by the net's thread after
    another thread allocated it rarely comes back warm.  So big batches are
    assembled into buffers from here, and a buffer comes back once nothing
    references any array of its batch: a batch the user keeps is never
    overwritten.

    The pool follows demand: a burst (the device queue filling while the
    net paused) needs several buffers at once, a steady flow fewer.  Spares
    that stayed in the free list for a whole window of :data:`POOL_WINDOW`
    calls, and buffers of a size no longer asked for, are released (one
    spare per size is kept as a cushion), so a run's memory follows what it
    holds, not its worst moment.  Buffers are anonymous mappings of their
    own, so a released one goes back to the system at once, whatever
    malloc's thresholds have become.

    The batch's death is heard through a weak reference whose callback is C
    code (``SimpleQueue.put``): the last reference dies wherever the user
    drops a batch, often the main thread, where a Python finalizer could
    swallow a Ctrl-C.  Returned buffers are collected by the next
    :meth:`batch` call.  One thread at a time calls :meth:`batch` (the
    enqueuer assembles every big batch).
    """

    def __init__(self, *, size_classes: bool = False) -> None:
        #: round each request up to a power of two: for buffers of many
        #: sizes (chunks of a varying row count), so that they are reused
        self._size_classes = size_classes
        self._free: dict[int, list[np.ndarray]] = {}
        self._returned: "queue.SimpleQueue[weakref.ref[np.ndarray]]" = queue.SimpleQueue()
        #: by id of the weak reference to a batch's root array (a weak
        #: reference to an array cannot be hashed): (it, size, the memory)
        self._out: dict[int, tuple["weakref.ref[np.ndarray]", int, np.ndarray]] = {}
        #: per size, the fewest spares seen free at a call in this window
        self._low: dict[int, int] = {}
        self._calls = 0
        #: where batches are assembled first, if set (see Rebatcher.use_memory)
        self.memory: BatchMemory | None = None

    def batch(self, layout: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
        """Uninitialised arrays of these shapes and dtypes, in one buffer."""
        self._collect()
        offsets, total = [], 0
        for shape, dtype in layout:
            offsets.append(total)
            nbytes = math.prod(shape) * dtype.itemsize
            total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if self._size_classes:
            total = max(1 << (max(total, 1) - 1).bit_length(), 1 << 16)
        if self.memory is not None:
            root = self.memory.take(total)
            if root is not None:
                return self._views(root, layout, offsets)
        free = self._free.setdefault(total, [])
        self._low[total] = min(self._low.get(total, len(free)), len(free))
        self._calls += 1
        if self._calls >= POOL_WINDOW:
            self._trim()
        mem = free.pop() if free else np.frombuffer(mmap.mmap(-1, total), np.uint8)
        # `root`'s base is a memoryview, not an array, so numpy stops there:
        # every view below keeps `root` (not `mem`) alive, and its weak
        # reference says when the last of them died.  (``mem.data`` is
        # ``memoryview(mem)``; numpy's stubs type an array as a buffer only
        # from Python 3.12 on.)
        root = np.frombuffer(mem.data, np.uint8)
        ref = weakref.ref(root, self._returned.put)
        self._out[id(ref)] = (ref, total, mem)
        return self._views(root, layout, offsets)

    @staticmethod
    def _views(
        root: np.ndarray, layout: Sequence[tuple[tuple[int, ...], np.dtype]], offsets: list[int]
    ) -> list[np.ndarray]:
        return [
            root[off:off + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
            for (shape, dtype), off in zip(layout, offsets)
        ]

    def _collect(self) -> None:
        for ref in drained(self._returned):
            _, total, mem = self._out.pop(id(ref))
            free = self._free.setdefault(total, [])
            if len(free) < POOL_KEEP:
                free.append(mem)

    def _trim(self) -> None:
        for total, free in self._free.items():
            idle = self._low.get(total)
            # A size not asked for all window keeps nothing; one that was
            # keeps one spare beyond what it used.
            keep = 0 if idle is None else max(len(free) - idle + 1, 0)
            del free[keep:]
        self._low.clear()
        self._calls = 0


def _read_only(arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """The one rule for what a batch hands out (docs/CONTRACT.md, "What
    run() returns"): every array is read-only, a view of a chunk or a copy
    alike, on every backend.  A view of a fetcher's array would otherwise
    write the user's own data, and a view of a worker process's slot cannot
    be written at all, so a copy that could be would make the rule depend on
    sizes.  ``arrays`` are blobfeed's own views or copies, never a fetcher's
    array objects, whose flags stay the user's.  No copy: some 60 ns an
    array (``setflags(False)``: the keyword form costs twice that)."""
    for a in arrays:
        # numpy's stubs make setflags' arguments keyword-only; numpy takes
        # them positionally (a typing.cast here would be a call per batch)
        a.setflags(False)  # type: ignore[call-arg]  # write=False
    return arrays


def _writable_copy(a: np.ndarray) -> np.ndarray:
    """A batch array of ``Net(writable=True)`` that views memory not
    blobfeed's (a fetcher's array, a worker process's slot): copied, so a
    write never reaches the source."""
    return np.array(a)


def _slicer(axis: int) -> Callable[[np.ndarray, int, int], np.ndarray]:
    if axis == 0:
        return lambda a, lo, hi: a[lo:hi]
    lead = (slice(None),) * axis
    return lambda a, lo, hi: a[lead + (slice(lo, hi),)]


class Rebatcher:
    """Cuts a stream of chunks into batches of exactly ``batch_size`` samples.

    Not thread-safe: one owner at a time.  Guarantees (docs/CONTRACT.md): samples keep
    their order, a chunk's leftover goes first into the next batch, and each
    byte is copied at most once -- not at all when a batch lies inside one
    chunk (the batch is then a view of the chunk).  Every batch's arrays are
    read-only (see :func:`_read_only`).

    A big batch (1 MiB or more) that spans chunks is filled as its chunks
    arrive: each piece is copied into the batch's buffer at :meth:`push`, and
    the chunk is let go at once.  Holding the chunks until the batch was
    complete kept a worker process's shared-memory slots busy (a batch of
    small chunks holds many), so that chunks arriving meanwhile had to be
    copied out of their slots: a second copy of up to half the bytes.
    """

    def __init__(
        self, axes: Sequence[int], batch_size: int, *, whole_chunks: bool = False, writable: bool = False
    ) -> None:
        self.axes = tuple(axes)
        self.batch_size = batch_size
        #: dont_rebatch: every chunk is one batch, whatever its size
        self.whole_chunks = whole_chunks
        #: ``Net(writable=True)``: batches are the caller's to write (a batch
        #: viewing a chunk is copied; blobfeed's own copies are handed out as
        #: they are)
        self.writable = writable
        self._slicers = [_slicer(ax) for ax in self.axes]
        self._pool = BufferPool()
        # [arrays, start, n, pin]: start is the first sample not yet handed out
        self._pieces: collections.deque[list[Any]] = collections.deque()
        self.pending = 0
        #: batches of at least this many samples are big (from the first chunk)
        self._big_at = _NEVER
        #: the big batch being filled (an array per blob, ``_fill_bs`` samples) and its samples so far
        self._fill: list[np.ndarray] | None = None
        self._filled = 0
        self._fill_bs = 0
        #: big batches filled and not handed out yet, in order (before everything in _pieces)
        self._done: collections.deque[list[np.ndarray]] = collections.deque()

    def push(self, chunk: Chunk) -> None:
        self._pieces.append([chunk.arrays, 0, chunk.n, chunk.pin])
        self.pending += chunk.n
        if self._big_at == _NEVER:
            sample_bytes = sum(a.nbytes for a in chunk.arrays) // max(1, chunk.n)
            if sample_bytes:
                self._big_at = -(-POOL_MIN_BYTES // sample_bytes)
        if self.big:
            self._absorb()

    def _absorb(self) -> None:
        """Copy what is pending into big batches as far as it goes: every
        piece that a batch spanning chunks needs is copied now, and its chunk
        let go.  A batch that lies inside one chunk stays a view."""
        bs = self.batch_size
        if (self._fill is not None or self._done) and self._fill_bs != bs:
            self._unfill()  # filled at another size: cut again at this one
        pieces = self._pieces
        while pieces:
            head = pieces[0]
            arrays, start, n, _ = head
            if self._fill is None:
                if n - start >= bs:
                    return  # the next batch is a view of this chunk
                layout = []
                for a, ax in zip(arrays, self.axes):
                    shape = list(a.shape)
                    shape[ax] = bs
                    layout.append((tuple(shape), a.dtype))
                self._fill, self._filled, self._fill_bs = self._pool.batch(layout), 0, bs
            fill, filled = self._fill, self._filled
            take = min(bs - filled, n - start)
            for sl, dst, src in zip(self._slicers, fill, arrays):
                np.copyto(sl(dst, filled, filled + take), sl(src, start, start + take), casting="no")
            self._filled = filled + take
            if start + take == n:
                pieces.popleft()
            else:
                head[1] = start + take
            if self._filled == bs:
                self._done.append(fill)
                self._fill = None

    def _unfill(self) -> None:
        """The batch size changed: what was filled goes back to the head of
        the pending pieces, in order, to be cut at the new size."""
        back = [(f, self._fill_bs) for f in self._done]
        if self._fill is not None:
            back.append((self._fill, self._filled))
        for fill, k in reversed(back):
            arrays = tuple([sl(f, 0, k) for sl, f in zip(self._slicers, fill)])
            self._pieces.appendleft([arrays, 0, k, None])
        self._done.clear()
        self._fill = None

    def use_memory(self, memory: BatchMemory | None) -> None:
        """Assemble big batches in ``memory`` while it has room (a served
        source's arena: its consumers then read them without another copy)."""
        self._pool.memory = memory

    def pop(self) -> Batch | None:
        """A full batch if enough samples are pending, else None."""
        if self.whole_chunks:
            if not self._pieces:
                return None
            arrays, start, n, pin = self._pieces.popleft()
            self.pending -= n - start
            if pin is not None and not pin.views_ok():
                return Batch(self._hand_out(tuple(np.array(a) for a in arrays), True), n - start)
            if self.writable:
                return Batch(tuple([_writable_copy(a) for a in arrays]), n - start)
            # views: the chunk's arrays are the fetcher's own objects
            return Batch(_read_only(tuple([a.view() for a in arrays])), n - start)
        bs = self.batch_size  # once: another thread may reset it (reset_data_input)
        if self.pending < bs:
            return None
        return self._take(bs)

    def pop_partial(self) -> Batch | None:
        """Everything pending as one (smaller) batch, or None when empty."""
        if self.pending == 0:
            return None
        return self._take(self.pending)

    def clear(self) -> int:
        """Discard everything pending without assembling it; returns the
        number of samples discarded."""
        n = self.pending
        self._pieces.clear()
        self._done.clear()
        self._fill = None
        self.pending = 0
        return n

    def cut(self, partial: bool = False) -> "Cut | None":
        """Take the samples of the next batch, as views, without copying:
        :meth:`join` assembles them, and may run outside the owner's lock
        (it touches no state of the rebatcher but the thread-safe pool).
        None when not enough samples are pending (``partial``: all of them)."""
        bs = self.pending if partial else self.batch_size
        if not bs or self.pending < bs:
            return None
        views, parts, own = self._cut(bs)
        return Cut(bs, views, parts, own)

    @property
    def big(self) -> bool:
        """Whether a batch costs enough to copy that it is worth assembling
        outside the owner's lock (known once a chunk was pushed)."""
        return not self.whole_chunks and self.batch_size >= self._big_at

    def absorbs(self, sample_bytes: int) -> bool:
        """Whether chunks of samples of ``sample_bytes`` make big batches,
        each piece copied at :meth:`push` and its chunk let go (see the
        class docstring)."""
        return not self.whole_chunks and self.batch_size * sample_bytes >= POOL_MIN_BYTES

    def join(self, cut: "Cut") -> Batch:
        """The batch of ``cut``: its views, or one copy of its parts."""
        if cut.views is not None:
            return Batch(self._hand_out(cut.views, cut.own), cut.n)
        assert cut.parts is not None
        return self._join(cut.parts, cut.n)

    def _take(self, bs: int) -> Batch:
        views, parts, own = self._cut(bs)
        if views is not None:
            return Batch(self._hand_out(views, own), bs)
        return self._join(parts, bs)  # type: ignore[arg-type]

    def _hand_out(self, arrays: tuple[np.ndarray, ...], own: bool) -> tuple[np.ndarray, ...]:
        """A batch's arrays as ``run()`` hands them out: read-only, or with
        ``writable`` the caller's (``own``: blobfeed's own copy, else a view
        of a chunk, copied)."""
        if not self.writable:
            return _read_only(arrays)
        if own:
            return arrays
        return tuple([_writable_copy(a) for a in arrays])

    def _cut(self, bs: int) -> tuple[tuple[np.ndarray, ...] | None, list[list[np.ndarray]] | None, bool]:
        """(views, None, own) when the batch lies inside one chunk (``own``
        False) or was filled already (in blobfeed's memory: ``own`` True),
        else (None, parts, False)."""
        if self._done or self._fill is not None:
            if self._done and bs == self._fill_bs:
                self.pending -= bs
                return tuple(self._done.popleft()), None, True
            fill = self._fill
            if fill is not None and not self._done and bs == self._filled and not self._pieces:
                # the rest at an epoch's end (pop_partial): what was filled
                self._fill = None
                self.pending -= bs
                return tuple([sl(f, 0, bs) for sl, f in zip(self._slicers, fill)]), None, True
            self._unfill()  # another size (the batch size changed): cut below
        head = self._pieces[0]
        arrays, start, n, pin = head
        self.pending -= bs
        if n - start >= bs:
            # The whole batch lies inside one chunk: views, no copy -- unless
            # the chunk's memory is scarce (a worker process's slots): then a
            # copy, so that batches the user keeps never stall the worker.
            out = tuple([sl(a, start, start + bs) for sl, a in zip(self._slicers, arrays)])
            if n - start == bs:
                self._pieces.popleft()
            else:
                head[1] = start + bs
            if pin is not None and not pin.views_ok():
                return None, [[a] for a in out], False
            return out, None, False
        parts: list[list[np.ndarray]] = [[] for _ in arrays]
        need = bs
        while need:
            head = self._pieces[0]
            arrays, start, n, _ = head
            take = min(need, n - start)
            for i, (sl, a) in enumerate(zip(self._slicers, arrays)):
                parts[i].append(sl(a, start, start + take))
            need -= take
            if start + take == n:
                self._pieces.popleft()
            else:
                head[1] = start + take
        return None, parts, False

    def _join(self, parts: list[list[np.ndarray]], bs: int) -> Batch:
        if bs < self._big_at:
            return Batch(self._hand_out(tuple([np.concatenate(p, axis=ax) for p, ax in zip(parts, self.axes)]), True), bs)
        layout = []
        for p, ax in zip(parts, self.axes):
            shape = list(p[0].shape)
            shape[ax] = bs
            layout.append((tuple(shape), p[0].dtype))
        out = self._pool.batch(layout)
        for p, ax, o in zip(parts, self.axes, out):
            np.concatenate(p, axis=ax, out=o)
        return Batch(self._hand_out(tuple(out), True), bs)


class Cut(NamedTuple):
    """The samples of one batch, taken but not yet assembled."""

    n: int
    #: the batch itself, when it is views of one chunk
    views: tuple[np.ndarray, ...] | None
    #: else, per blob, the slices to join (copied once)
    parts: list[list[np.ndarray]] | None
    #: ``views`` are blobfeed's own memory (a big batch filled as its chunks came)
    own: bool = False
