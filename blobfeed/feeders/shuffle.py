"""``shuffle_buffer=N``: a sample-level shuffle buffer (tf.data's ``shuffle``,
TF's ``shuffle_batch`` with ``min_after_dequeue``).

The buffer holds references to the chunks' rows, not copies: each batch is
gathered straight from the chunks into its own arrays, so every byte is
copied once, as re-batching would.  A batch takes ``batch_size`` rows drawn
at random (without replacement) from a buffer kept at ``N`` rows or more
while input lasts; at the end the rest leaves in random order.

The rows are two flat index arrays (chunk, row): a push appends, a pop
takes random slots and fills their holes with the last rows, so both cost
the rows they move, not the buffer's size.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .chunks import Chunk

__all__ = ["ShuffleBuffer"]

#: a batch's rows are copied one by one (no temporary) from rows of this
#: many bytes, or when the batch has few rows; else chunk by chunk
ROW_BY_ROW_BYTES = 4096
ROW_BY_ROW_MAX = 256


class ShuffleBuffer:
    """Not thread-safe: its owner (the ordered stream) holds a lock."""

    def __init__(self, size: int, axes: Sequence[int], rng: np.random.Generator) -> None:
        self.size = size
        self.axes = tuple(axes)
        self.rng = rng
        self._chunks: dict[int, Chunk] = {}
        self._left: dict[int, int] = {}  # rows of each chunk still in the buffer
        self._next_id = 0
        self._n = 0
        cap = max(64, 2 * size)
        self._cid = np.empty(cap, np.int64)
        self._row = np.empty(cap, np.int64)

    def __len__(self) -> int:
        return self._n

    def push(self, chunk: Chunk) -> None:
        cid = self._next_id
        self._next_id += 1
        self._chunks[cid] = chunk
        self._left[cid] = chunk.n
        n, k = self._n, chunk.n
        if n + k > len(self._cid):
            cap = max(2 * len(self._cid), n + k)
            self._cid = np.resize(self._cid, cap)
            self._row = np.resize(self._row, cap)
        self._cid[n:n + k] = cid
        self._row[n:n + k] = np.arange(k)
        self._n = n + k

    def ready(self, batch_size: int) -> bool:
        """A batch can leave while ``size`` rows stay behind."""
        return self._n >= self.size + batch_size

    def pop(self, batch_size: int) -> Chunk:
        """``batch_size`` rows (fewer at the end) drawn at random, gathered into new arrays."""
        total = self._n
        n = min(batch_size, total)
        pick = self.rng.choice(total, n, replace=False)  # distinct, in random order
        cids, rows = self._cid[pick], self._row[pick]
        # The picked slots below the new end get the rows above it that stay.
        tail = total - n
        holes = pick[pick < tail]
        if len(holes):
            stays = np.ones(n, bool)
            stays[pick[pick >= tail] - tail] = False
            movers = tail + np.flatnonzero(stays)
            self._cid[holes] = self._cid[movers]
            self._row[holes] = self._row[movers]
        self._n = tail
        chunks = self._chunks
        first = chunks[int(cids[0])]
        outs = []
        row_bytes = 0
        for a, ax in zip(first.arrays, self.axes):
            shape = list(a.shape)
            row_bytes += a.nbytes // max(1, shape[ax])
            shape[ax] = n
            outs.append(np.empty(shape, a.dtype))
        cid_list = cids.tolist()
        if n <= ROW_BY_ROW_MAX or row_bytes >= ROW_BY_ROW_BYTES:
            self._copy_rows(outs, cid_list, rows.tolist())
        else:
            self._copy_groups(outs, cids, rows)
        left = self._left
        for cid in cid_list:
            left[cid] -= 1
            if not left[cid]:
                del left[cid], chunks[cid]  # its memory (a slot, say) goes back
        return Chunk(tuple(outs), n, -1)

    def _copy_rows(self, outs: list[np.ndarray], cids: list[int], rows: list[int]) -> None:
        """Row j of the batch from its chunk, one assignment a row and blob:
        no temporary, so big rows are copied once."""
        chunks = self._chunks
        axes = self.axes
        if all(ax == 0 for ax in axes):
            for j, (cid, r) in enumerate(zip(cids, rows)):
                for out, a in zip(outs, chunks[cid].arrays):
                    out[j] = a[r]
            return
        for j, (cid, r) in enumerate(zip(cids, rows)):
            for out, a, ax in zip(outs, chunks[cid].arrays, axes):
                lead = (slice(None),) * ax
                out[lead + (j,)] = a[lead + (r,)]

    def _copy_groups(self, outs: list[np.ndarray], cids: np.ndarray, rows: np.ndarray) -> None:
        """Many small rows: one gather per chunk and blob."""
        order = np.argsort(cids, kind="stable")
        bounds = np.flatnonzero(np.diff(cids[order])) + 1
        for group in np.split(order, bounds):
            chunk = self._chunks[int(cids[group[0]])]
            src_rows = rows[group]
            for out, a, ax in zip(outs, chunk.arrays, self.axes):
                lead = (slice(None),) * ax
                out[lead + (group,)] = a[lead + (src_rows,)]
