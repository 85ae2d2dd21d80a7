"""``shuffle_buffer=N``: a sample-level shuffle buffer (tf.data's ``shuffle``,
TF's ``shuffle_batch`` with ``min_after_dequeue``).

The buffer holds references to the chunks' rows, not copies: each batch is
gathered straight from the chunks into its own arrays, so every byte is
copied once, as re-batching would.  A batch takes ``batch_size`` rows drawn
at random (without replacement) from a buffer kept at ``N`` rows or more
while input lasts; at the end the rest leaves in random order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .chunks import Chunk

__all__ = ["ShuffleBuffer"]


class ShuffleBuffer:
    """Not thread-safe: its owner (the ordered stream) holds a lock."""

    def __init__(self, size: int, axes: Sequence[int], rng: np.random.Generator) -> None:
        self.size = size
        self.axes = tuple(axes)
        self.rng = rng
        self._chunks: dict[int, Chunk] = {}
        self._left: dict[int, int] = {}  # rows of each chunk still in the buffer
        self._next_id = 0
        self._cid = np.empty(0, np.int64)
        self._row = np.empty(0, np.int64)

    def __len__(self) -> int:
        return len(self._cid)

    def push(self, chunk: Chunk) -> None:
        cid = self._next_id
        self._next_id += 1
        self._chunks[cid] = chunk
        self._left[cid] = chunk.n
        self._cid = np.concatenate([self._cid, np.full(chunk.n, cid, np.int64)])
        self._row = np.concatenate([self._row, np.arange(chunk.n, dtype=np.int64)])

    def ready(self, batch_size: int) -> bool:
        """A batch can leave while ``size`` rows stay behind."""
        return len(self._cid) >= self.size + batch_size

    def pop(self, batch_size: int) -> Chunk:
        """``batch_size`` rows (fewer at the end) drawn at random, gathered into new arrays."""
        total = len(self._cid)
        n = min(batch_size, total)
        pick = self.rng.choice(total, n, replace=False)
        cids, rows = self._cid[pick], self._row[pick]
        keep = np.ones(total, bool)
        keep[pick] = False
        self._cid, self._row = self._cid[keep], self._row[keep]
        first = self._chunks[int(cids[0])]
        outs = []
        for a, ax in zip(first.arrays, self.axes):
            shape = list(a.shape)
            shape[ax] = n
            outs.append(np.empty(shape, a.dtype))
        order = np.argsort(cids, kind="stable")
        bounds = np.flatnonzero(np.diff(cids[order])) + 1
        for group in np.split(order, bounds):
            cid = int(cids[group[0]])
            chunk = self._chunks[cid]
            src_rows = rows[group]
            for out, a, ax in zip(outs, chunk.arrays, self.axes):
                if ax == 0:
                    out[group] = a[src_rows]
                else:
                    lead = (slice(None),) * ax
                    out[lead + (group,)] = a[lead + (src_rows,)]
            self._left[cid] -= len(group)
            if not self._left[cid]:
                del self._left[cid], self._chunks[cid]  # its memory (a slot, say) goes back
        return Chunk(tuple(outs), n, -1)
