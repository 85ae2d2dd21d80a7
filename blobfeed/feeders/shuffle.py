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
  ``take`` per blob: a second copy of a few bytes is far cheaper than
  Python work per row;
- big rows (an image) stay in their chunk: the table holds (chunk, row)
  and each row is copied once, straight from its chunk into the batch.

A chunk is let go of as soon as its last big row has left (at once if all
its blobs are small): it may hold a worker's shared-memory slot.
"""

from __future__ import annotations

import operator
from typing import Sequence

import numpy as np

from .chunks import Chunk

__all__ = ["ShuffleBuffer"]

#: rows of at least this many bytes stay in their chunk and are copied once,
#: into the batch; smaller rows are copied into the buffer's own store.  Per
#: row and blob, the reference path costs ~1 us of Python, the store two
#: more copies of the row: they break even near 4 KiB at ~10 GB/s.
BY_REFERENCE_BYTES = 4096

#: the row table's first capacity; it doubles when full, and halves when a
#: quarter full (the end of a "shuffle everything" epoch gives memory back)
INITIAL_ROWS = 256

#: uniform variates drawn from the generator at a time (one call per some
#: 100 batches instead of one per batch: the call costs more than the draw)
_DRAW_BLOCK = 4096


class ShuffleBuffer:
    """Rows of chunks, leaving in random order.

    Not thread-safe: its owner (the ordered stream) holds a lock.  The order
    of the rows that leave is a function of ``rng``'s state and of the
    sequence of calls, so the same generator and the same input give the
    same batches.

    Args:
        size: rows kept while input lasts (``ready``); any non-negative int,
            storage does not depend on it.
        axes: the batch axis of each blob.
        rng: the generator the order is drawn from; the buffer owns it.
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
        self._u = np.empty(0)  # uniform variates in [0, 1) not used yet
        self._u_at = 0
        self._reset()

    def _reset(self) -> None:
        """Empty, with no storage: the layout is taken from the next chunk."""
        self._n = 0
        self._cap = 0
        #: per blob: (dtype, row shape), fixed by the first chunk
        self._layout: tuple[tuple[np.dtype, tuple[int, ...]], ...] | None = None
        #: per blob: its row store (small rows, batch axis first) or None (by reference)
        self._stores: list[np.ndarray | None] = []
        #: the blobs held by reference
        self._big: tuple[int, ...] = ()
        #: per slot (blobs by reference only): [chunk id, row in the chunk]
        self._ref = np.empty((0, 2), np.int64)
        self._chunks: dict[int, Chunk] = {}
        self._left: dict[int, int] = {}  # rows of each chunk still held
        self._next_id = 0

    def __len__(self) -> int:
        return self._n

    # -- in ----------------------------------------------------------------------
    def push(self, chunk: Chunk) -> None:
        """Add the chunk's ``chunk.n`` rows (small rows copied now, big rows by reference)."""
        k = chunk.n
        if not k:
            return
        arrays = chunk.arrays
        if self._layout is None:
            self._start(arrays)
        self._check(arrays)
        n = self._n
        if n + k > self._cap:
            self._resize(max(2 * self._cap, n + k, INITIAL_ROWS))
        for store, a, ax in zip(self._stores, arrays, self.axes):
            if store is not None:
                store[n:n + k] = a if ax == 0 else np.moveaxis(a, ax, 0)
        if self._big:
            cid = self._next_id
            self._next_id += 1
            self._chunks[cid] = chunk
            self._left[cid] = k
            ref = self._ref
            ref[n:n + k, 0] = cid
            ref[n:n + k, 1] = np.arange(k)
        self._n = n + k

    def _start(self, arrays: Sequence[np.ndarray]) -> None:
        if len(arrays) != len(self.axes):
            raise ValueError(f"ShuffleBuffer.push: a chunk of {len(arrays)} blobs, the buffer has {len(self.axes)} batch axes")
        layout = []
        for a, ax in zip(arrays, self.axes):
            row = a.shape[:ax] + a.shape[ax + 1:]
            layout.append((a.dtype, row))
        self._layout = tuple(layout)
        self._big = tuple(
            b for b, (dtype, row) in enumerate(layout)
            if dtype.itemsize * int(np.prod(row, dtype=np.int64)) >= BY_REFERENCE_BYTES
        )
        self._stores = [None] * len(layout)  # allocated by _resize

    def _check(self, arrays: Sequence[np.ndarray]) -> None:
        """A chunk like the first (the source's validator guarantees it; a
        wrong one here would be cast or broadcast silently)."""
        layout = self._layout
        assert layout is not None
        if len(arrays) != len(layout):
            raise ValueError(f"ShuffleBuffer.push: a chunk of {len(arrays)} blobs, the buffer holds {len(layout)}")
        for b, (a, ax, (dtype, row)) in enumerate(zip(arrays, self.axes, layout)):
            shape = a.shape
            if a.dtype != dtype or shape[:ax] + shape[ax + 1:] != row:
                raise ValueError(
                    f"ShuffleBuffer.push: blob {b} has dtype {a.dtype} and shape {shape} (batch axis {ax}); "
                    f"the buffer holds rows of dtype {dtype} and shape {row}"
                )

    def _resize(self, cap: int) -> None:
        """Storage for ``cap`` rows, keeping the ``len(self)`` held."""
        layout = self._layout
        assert layout is not None
        n = self._n
        for b, (dtype, row) in enumerate(layout):
            if b in self._big:
                continue
            store = np.empty((cap,) + row, dtype)
            old = self._stores[b]
            if old is not None and n:
                store[:n] = old[:n]
            self._stores[b] = store
        if self._big:
            ref = np.empty((cap, 2), np.int64)
            ref[:n] = self._ref[:n]
            self._ref = ref
        self._cap = cap

    def ready(self, batch_size: int) -> bool:
        """A batch can leave while ``size`` rows stay behind."""
        return self._n >= self.size + batch_size

    # -- out ---------------------------------------------------------------------
    def pop(self, batch_size: int) -> Chunk:
        """``batch_size`` rows (fewer at the end) drawn at random without
        replacement, in random order, as a new chunk whose arrays are new."""
        total = self._n
        if batch_size < 1:
            raise ValueError(f"ShuffleBuffer.pop: batch_size must be >= 1, got {batch_size}")
        if not total:
            raise ValueError("ShuffleBuffer.pop: the buffer is empty")
        n = min(batch_size, total)
        pick, picked = self._draw(total, n)
        tail = total - n
        # the slots picked below the new end are refilled with the rows of
        # [tail, total) that stay: both lists are at most n long
        holes = [p for p in picked if p < tail]
        if holes:
            gone = set(picked)
            movers = [q for q in range(tail, total) if q not in gone]
            holes_a = np.array(holes, np.int64)
            movers_a = np.array(movers, np.int64)
        outs: list[np.ndarray] = []
        for store, ax in zip(self._stores, self.axes):
            if store is None:
                outs.append(None)  # type: ignore[arg-type]  # filled below
                continue
            got = store.take(pick, axis=0)  # one gather into new memory
            if ax:
                got = np.ascontiguousarray(np.moveaxis(got, 0, ax))
            outs.append(got)
            if holes:
                store[holes_a] = store.take(movers_a, axis=0)
        if self._big:
            ref = self._ref
            taken = ref.take(pick, axis=0).tolist()
            if holes:
                ref[holes_a] = ref.take(movers_a, axis=0)
            self._copy_big(outs, taken, n)
        self._n = tail
        if self._cap > INITIAL_ROWS and tail <= self._cap // 4:
            self._resize(max(INITIAL_ROWS, self._cap // 2))
        return Chunk(tuple(outs), n, -1)

    def _draw(self, total: int, n: int) -> tuple[np.ndarray, list[int]]:
        """``n`` distinct slots of ``range(total)``, uniformly, in random order.

        Cost O(n): the slots are drawn independently and a repeat is drawn
        again (a sequential draw without replacement), unless ``n`` is more
        than half of ``total`` (the end of input), where a permutation of
        ``total <= 2n`` slots costs as little.  numpy's ``choice(total, n,
        replace=False)`` costs more per call than the draw, and O(total)
        for some sizes.  A slot is ``floor(u * total)`` of a 53-bit uniform
        ``u``: off uniform by ``total / 2**53`` at most.
        """
        if 2 * n > total:
            pick = self.rng.permutation(total)[:n]
            return pick, pick.tolist()
        picked = self._slots(total, n)
        if len(set(picked)) == n:
            return np.array(picked, np.int64), picked
        seen: set[int] = set()
        out: list[int] = []
        while True:
            for p in picked:
                if p not in seen:
                    seen.add(p)
                    out.append(p)
                    if len(out) == n:
                        return np.array(out, np.int64), out
            picked = self._slots(total, n - len(out))

    def _slots(self, total: int, n: int) -> list[int]:
        """``n`` independent uniform slots of ``range(total)``."""
        at = self._u_at
        if at + n > len(self._u):
            self._u = self.rng.random(max(_DRAW_BLOCK, n))
            at = 0
        self._u_at = at + n
        slots = (self._u[at:at + n] * total).astype(np.int64)
        # u * total rounds to total for no u < 1 (checked, not assumed)
        return np.minimum(slots, total - 1, out=slots).tolist()

    def _copy_big(self, outs: list[np.ndarray], taken: list[list[int]], n: int) -> None:
        """The big blobs' batches, each row copied once from its chunk (no
        gather-then-scatter temporary); chunks whose last row left are let go."""
        chunks = self._chunks
        layout = self._layout
        assert layout is not None
        for b in self._big:
            ax = self.axes[b]
            dtype, row = layout[b]
            shape = row[:ax] + (n,) + row[ax:]
            out = np.empty(shape, dtype)
            if ax == 0:
                for j, (cid, r) in enumerate(taken):
                    out[j] = chunks[cid].arrays[b][r]
            else:
                lead = (slice(None),) * ax
                for j, (cid, r) in enumerate(taken):
                    out[lead + (j,)] = chunks[cid].arrays[b][lead + (r,)]
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
        dropped; the buffer is then empty and ready for new input."""
        dropped = self._n
        self._reset()
        return dropped
