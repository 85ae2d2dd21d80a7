"""``shuffle_buffer=N``: a sample-level shuffle buffer (tf.data's ``shuffle``,
TF's ``shuffle_batch`` with ``min_after_dequeue``).

A batch takes ``batch_size`` rows drawn at random (without replacement) from
a buffer kept at ``N`` rows or more while input lasts; at the end the rest
leaves in random order.  ``N`` may exceed the data set ("shuffle
everything", ``shuffle(10**12)`` or ``sys.maxsize``): storage grows with the
rows actually held (it starts small and doubles), never with ``N``.

The buffer is a row table of ``len(buf)`` slots.  A pop draws ``n`` distinct
slots, takes their rows and fills the holes below the new end with the
table's last rows, so push and pop cost the rows they move, never the
buffer's size.  How a blob's rows are held depends on their size:

- small rows (under :data:`BY_REFERENCE_BYTES`, a label, a feature vector)
  are copied at push into a contiguous store per blob, and a batch is one
  gather per blob: a second copy of a few bytes is far cheaper than
  Python work per row;
- big rows (an image) stay in their chunk: the table holds (chunk, row)
  and each row is copied once, straight from its chunk into the batch.
  A batch of big rows of 1 MiB or more is assembled in recycled memory
  (the re-batcher's :class:`~.rebatch.BufferPool`): a copy into fresh pages
  took 1.6 times as long (W2s-like pipeline: ~130 page faults a batch).

A chunk is let go of at push if all its blobs are small, else as soon as
its last big row has left; the big rows of a chunk that holds a worker's
shared-memory slot or pinned object (a ``Pin``) are copied out at push, so
rows waiting here never hold a worker's memory.

The buffer runs under the lane dealer's lock, beside fetcher threads, so
its per-batch work avoids numpy calls that let go of the GIL for a few
bytes (``take``, a gather of rows of a 2-D array, every draw of a numpy
``Generator``): each such call lets another thread in, and getting the GIL
back can cost a switch interval (5 ms) while the stream's lock is held.
Rows are gathered as the elements of a 1-D ``void`` view (numpy keeps the
GIL for short gathers of a 1-D array) and slots are drawn from the bytes of
a Python ``random.Random`` seeded from ``rng``.
"""

from __future__ import annotations

import math
import operator
import random
from typing import Sequence

import numpy as np

from .chunks import Chunk
from .rebatch import POOL_MIN_BYTES, BufferPool

__all__ = ["ShuffleBuffer"]

#: rows of at least this many bytes stay in their chunk and are copied once,
#: into the batch; smaller rows are copied into the buffer's own store.  Per
#: row and blob, the reference path costs ~1 us of Python, the store two
#: more copies of the row: they break even near 4 KiB at ~10 GB/s.
BY_REFERENCE_BYTES = 4096

#: the row table's first capacity; it doubles when full, and halves when a
#: quarter full (the end of a "shuffle everything" epoch gives memory back)
INITIAL_ROWS = 256

#: 64-bit random words drawn at a time
_BITS_BLOCK = 4096


class ShuffleBuffer:
    """Rows of chunks, leaving in random order.

    Not thread-safe: its owner (the lane dealer) holds a lock.  The order
    of the rows that leave is a function of ``rng``'s state at construction
    and of the sequence of calls, so the same generator and the same input
    give the same batches.

    Args:
        size: rows kept while input lasts (``ready``); any non-negative int,
            storage does not depend on it.
        axes: the batch axis of each blob.
        rng: the generator the order is drawn from: one draw at construction
            seeds the buffer's own ``random.Random``.
    """

    def __init__(self, size: int, axes: Sequence[int], rng: np.random.Generator) -> None:
        if isinstance(size, bool):
            raise TypeError(f"ShuffleBuffer size: expected an int, got {size!r}")
        try:
            size = operator.index(size)
        except TypeError:
            raise TypeError(f"ShuffleBuffer size: expected an int, got {type(size).__name__}") from None
        if size < 0:
            raise ValueError(f"ShuffleBuffer size: expected >= 0 rows, got {size}")
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"ShuffleBuffer rng: expected a numpy.random.Generator, got {type(rng).__name__}")
        self.size = size  # a Python int: size + batch_size cannot overflow
        self.axes = tuple(int(ax) for ax in axes)
        self.rng = rng
        self._random = random.Random(int(rng.integers(2**63)))
        self._bits = np.empty(0, "<u8")  # random bits not used yet
        self._bits_at = 0
        self._reset()

    def _reset(self) -> None:
        """Empty, with no storage: the layout is taken from the next chunk."""
        self._n = 0
        self._cap = 0
        #: per blob: (dtype, row shape), fixed by the first chunk
        self._layout: tuple[tuple[np.dtype, tuple[int, ...]], ...] | None = None
        #: the blobs held in a store, and those held by reference
        self._small: tuple[int, ...] = ()
        self._big: tuple[int, ...] = ()
        self._big_row_bytes = 0  # bytes of a row of all big blobs together
        #: per blob: its row store (small rows, batch axis first) or None
        self._stores: list[np.ndarray | None] = []
        #: per blob: its store as a 1-D array of rows (see the module's docstring)
        self._rows: list[np.ndarray | None] = []
        #: per small blob: (blob, the dtype to view its gathered rows as or
        #: None, row shape, batch axis)
        self._unpack: tuple[tuple[int, np.dtype | None, tuple[int, ...], int], ...] = ()
        #: per slot, if any blob is held by reference: [chunk id, row in the chunk]
        self._ref = np.empty((0, 2), np.int64)
        self._ref_rows = self._ref
        #: per chunk id: the arrays of its big blobs (None for the others)
        self._chunks: dict[int, tuple[np.ndarray | None, ...]] = {}
        self._left: dict[int, int] = {}  # rows of each chunk still held
        self._next_id = 0
        #: memory for batches of big rows, given back when a batch dies
        self._pool = BufferPool()

    def __len__(self) -> int:
        return self._n

    # -- in ----------------------------------------------------------------------
    def push(self, chunk: Chunk) -> None:
        """Add the chunk's ``chunk.n`` rows (small rows copied now, big rows
        by reference, or copied now too if the chunk has a ``pin``).

        Raises:
            ValueError: the chunk's blobs are not like the first chunk's
                (count, dtype, per-sample shape).
        """
        k = chunk.n
        if not k:
            return
        arrays = chunk.arrays
        layout = self._layout
        if layout is None:
            layout = self._start(arrays)
        if len(arrays) != len(layout):
            raise ValueError(f"ShuffleBuffer.push: a chunk of {len(arrays)} blobs, the buffer holds {len(layout)}")
        axes = self.axes
        for b, a in enumerate(arrays):
            # the source's validator guarantees this; a wrong chunk here
            # would be cast or broadcast silently
            dtype, row = layout[b]
            ax = axes[b]
            shape = a.shape
            if a.dtype != dtype or (shape[1:] if ax == 0 else shape[:ax] + shape[ax + 1:]) != row:
                raise ValueError(
                    f"ShuffleBuffer.push: blob {b} has dtype {a.dtype} and shape {shape} (batch axis {ax}); "
                    f"the buffer holds rows of dtype {dtype} and shape {row}"
                )
        n = self._n
        if n + k > self._cap:
            self._resize(max(2 * self._cap, n + k, INITIAL_ROWS))
        stores = self._stores
        for b in self._small:
            ax = axes[b]
            stores[b][n:n + k] = arrays[b] if ax == 0 else np.moveaxis(arrays[b], ax, 0)  # type: ignore[index]
        if self._big:
            cid = self._next_id
            self._next_id += 1
            # only the big blobs' arrays: the small rows are in the stores.
            # A pinned chunk's memory is a worker's slot (or pinned object):
            # rows may wait here for long, so its big rows are copied out.
            pinned = chunk.pin is not None
            held: list[np.ndarray | None] = [None] * len(arrays)
            for b in self._big:
                held[b] = np.array(arrays[b]) if pinned else arrays[b]
            self._chunks[cid] = tuple(held)
            self._left[cid] = k
            ref = self._ref
            ref[n:n + k, 0] = cid
            ref[n:n + k, 1] = np.arange(k)
        self._n = n + k

    def _start(self, arrays: Sequence[np.ndarray]) -> tuple[tuple[np.dtype, tuple[int, ...]], ...]:
        """Take the layout from the first chunk."""
        if len(arrays) != len(self.axes):
            raise ValueError(f"ShuffleBuffer.push: a chunk of {len(arrays)} blobs, the buffer has {len(self.axes)} batch axes")
        layout = tuple((a.dtype, a.shape[:ax] + a.shape[ax + 1:]) for a, ax in zip(arrays, self.axes))
        row_bytes = [dtype.itemsize * math.prod(row) for dtype, row in layout]
        self._big = tuple(b for b in range(len(layout)) if row_bytes[b] >= BY_REFERENCE_BYTES)
        self._small = tuple(b for b in range(len(layout)) if row_bytes[b] < BY_REFERENCE_BYTES)
        self._big_row_bytes = sum(row_bytes[b] for b in self._big)
        self._stores = [None] * len(layout)  # allocated by _resize
        self._rows = [None] * len(layout)
        self._layout = layout
        return layout

    def _resize(self, cap: int) -> None:
        """Storage for ``cap`` rows, keeping the ``len(self)`` held."""
        layout = self._layout
        assert layout is not None
        n = self._n
        unpack = []
        for b in self._small:
            dtype, row = layout[b]
            store = np.empty((cap,) + row, dtype)
            old = self._stores[b]
            if old is not None and n:
                store[:n] = old[:n]
            self._stores[b] = store
            rows = self._rows[b] = _as_rows(store)
            unpack.append((b, dtype if rows.dtype != dtype else None, row, self.axes[b]))
        self._unpack = tuple(unpack)
        if self._big:
            ref = np.empty((cap, 2), np.int64)
            ref[:n] = self._ref[:n]
            self._ref = ref
            self._ref_rows = _as_rows(ref)
        self._cap = cap

    def ready(self, batch_size: int) -> bool:
        """A batch can leave while ``size`` rows stay behind."""
        return self._n >= self.size + batch_size

    # -- out ---------------------------------------------------------------------
    def pop(self, batch_size: int) -> Chunk:
        """``batch_size`` rows (fewer at the end) drawn at random without
        replacement, in random order, as a new chunk whose arrays are new.

        Raises:
            ValueError: ``batch_size < 1``, or the buffer is empty.
        """
        total = self._n
        if batch_size < 1:
            raise ValueError(f"ShuffleBuffer.pop: batch_size must be >= 1, got {batch_size}")
        if not total:
            raise ValueError("ShuffleBuffer.pop: the buffer is empty")
        n = min(batch_size, total)
        pick, picked = self._draw(total, n)
        tail = total - n
        # The slots picked below the new end (holes) get the rows of
        # [tail, total) that stay (movers).  Usually (n much smaller than
        # the buffer) no slot of [tail, total) was picked: every picked slot
        # is a hole and the movers are that whole slice.
        holes: np.ndarray | None = None
        movers: np.ndarray | slice = slice(tail, total)
        if tail:
            if max(picked) < tail:
                holes = pick
            else:
                below = [p for p in picked if p < tail]
                if below:
                    gone = set(picked)
                    holes = np.array(below, np.int64)
                    movers = np.array([q for q in range(tail, total) if q not in gone], np.int64)
        outs: list[np.ndarray | None] = [None] * len(self.axes)
        all_rows = self._rows
        for b, as_dtype, row, ax in self._unpack:
            rows = all_rows[b]
            assert rows is not None
            got = rows[pick]  # the one gather: new memory, the batch's own
            if holes is not None:
                rows[holes] = rows[movers]
            if as_dtype is not None:
                got = got.view(as_dtype).reshape((n,) + row)
            if ax:
                got = np.ascontiguousarray(np.moveaxis(got, 0, ax))
            outs[b] = got
        if self._big:
            ref = self._ref_rows
            taken = ref[pick].view(np.int64).reshape(n, 2).tolist()
            if holes is not None:
                ref[holes] = ref[movers]
            self._copy_big(outs, taken, n)
        self._n = tail
        if self._cap > INITIAL_ROWS and tail <= self._cap // 4:
            self._resize(max(INITIAL_ROWS, self._cap // 2))
        return Chunk(tuple(outs), n, -1)  # type: ignore[arg-type]

    def _draw(self, total: int, n: int) -> tuple[np.ndarray, list[int]]:
        """``n`` distinct slots of ``range(total)``, uniformly, in random
        order, as an array and as a list.

        Cost O(n): the slots are drawn independently and a repeat is drawn
        again (a sequential draw without replacement), unless ``n`` is more
        than half of ``total`` (the end of input), where a sample of
        ``total <= 2n`` slots costs as little.  (numpy's ``choice(total, n,
        replace=False)`` costs more per call than this whole draw, lets go
        of the GIL, and is O(total) for some sizes.)
        """
        if 2 * n > total:
            picked = self._random.sample(range(total), n)
            return np.array(picked, np.int64), picked
        at = self._bits_at
        if at + n <= len(self._bits):  # _slots inlined: this is most of a pop's cost
            self._bits_at = at + n
            pick = (self._bits[at:at + n] % total).view(np.int64)
        else:
            pick = self._slots(total, n)
        picked = pick.tolist()
        if len(set(picked)) == n:
            return pick, picked
        seen: set[int] = set()
        out: list[int] = []
        while True:
            for p in picked:
                if p not in seen:
                    seen.add(p)
                    out.append(p)
                    if len(out) == n:
                        return np.array(out, np.int64), out
            picked = self._slots(total, n - len(out)).tolist()

    def _slots(self, total: int, n: int) -> np.ndarray:
        """``n`` independent uniform slots of ``range(total)``: 64 random
        bits modulo ``total``, off uniform by ``total / 2**64`` at most.
        The bits come in blocks (a call per some 100 batches: the call
        costs more than the bits), little-endian so that the order is the
        same on every machine."""
        at = self._bits_at
        if at + n > len(self._bits):
            self._bits = np.frombuffer(self._random.randbytes(8 * max(_BITS_BLOCK, n)), "<u8")
            at = 0
        self._bits_at = at + n
        # uint64 % a Python int is uint64 (NEP 50), < total < 2**63: a valid int64
        return (self._bits[at:at + n] % total).view(np.int64)

    def _copy_big(self, outs: list[np.ndarray | None], taken: list[list[int]], n: int) -> None:
        """The big blobs' batches, each row copied once from its chunk (no
        gather-then-scatter temporary); chunks whose last row left are let go."""
        chunks = self._chunks
        layout = self._layout
        assert layout is not None
        shapes = []
        for b in self._big:
            dtype, row = layout[b]
            ax = self.axes[b]
            shapes.append((row[:ax] + (n,) + row[ax:], dtype))
        if n * self._big_row_bytes >= POOL_MIN_BYTES:
            mem = self._pool.batch(shapes)
        else:
            mem = [np.empty(shape, dtype) for shape, dtype in shapes]
        for b, out in zip(self._big, mem):
            ax = self.axes[b]
            if ax == 0:
                for j, (cid, r) in enumerate(taken):
                    out[j] = chunks[cid][b][r]  # type: ignore[index]
            else:
                lead = (slice(None),) * ax
                for j, (cid, r) in enumerate(taken):
                    out[lead + (j,)] = chunks[cid][b][lead + (r,)]  # type: ignore[index]
            outs[b] = out
        left = self._left
        for cid, _ in taken:
            k = left[cid] - 1
            if k:
                left[cid] = k
            else:
                del left[cid], chunks[cid]  # its memory (a slot, say) goes back

    # -- dropping ----------------------------------------------------------------
    def clear(self) -> int:
        """Drop every row held and let go of every chunk at once (a chunk may
        hold a worker's shared-memory slot).  Returns the number of rows
        dropped; the buffer is then empty and ready for new input (of any
        layout)."""
        dropped = self._n
        self._reset()
        return dropped


def _as_rows(store: np.ndarray) -> np.ndarray:
    """``store`` (C-contiguous, rows along axis 0) as a 1-D array of one
    element a row (``void`` if a row has several items): a gather from it is
    numpy's 1-D fast path, which keeps the GIL for short gathers.  Object
    rows (references) and empty rows are indexed as they are."""
    if store.ndim == 1:
        return store  # already one element a row
    cap = len(store)
    row_bytes = store.itemsize * (store.size // cap if cap else 0)
    if store.dtype.hasobject or not row_bytes:
        return store
    return store.reshape(cap, -1).view(np.dtype((np.void, row_bytes))).reshape(cap)
