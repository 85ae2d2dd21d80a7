"""Cutting a stream of chunks into batches of exactly ``batch_size`` samples."""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import numpy as np

from .chunks import Batch, Chunk

__all__ = ["Rebatcher"]


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
    chunk (the batch is then a view of the chunk).
    """

    def __init__(self, axes: Sequence[int], batch_size: int, *, whole_chunks: bool = False) -> None:
        self.axes = tuple(axes)
        self.batch_size = batch_size
        #: dont_rebatch: every chunk is one batch, whatever its size
        self.whole_chunks = whole_chunks
        self._slicers = [_slicer(ax) for ax in self.axes]
        # [arrays, start, n, pin]: start is the first sample not yet handed out
        self._pieces: collections.deque[list[Any]] = collections.deque()
        self.pending = 0

    def push(self, chunk: Chunk) -> None:
        self._pieces.append([chunk.arrays, 0, chunk.n, chunk.pin])
        self.pending += chunk.n

    def pop(self) -> Batch | None:
        """A full batch if enough samples are pending, else None."""
        if self.whole_chunks:
            if not self._pieces:
                return None
            arrays, start, n, pin = self._pieces.popleft()
            self.pending -= n - start
            if pin is not None and not pin.views_ok():
                arrays = tuple(np.array(a) for a in arrays)
            return Batch(arrays, n - start)
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
        self.pending = 0
        return n

    def _take(self, bs: int) -> Batch:
        head = self._pieces[0]
        arrays, start, n, pin = head
        self.pending -= bs
        if n - start >= bs:
            # The whole batch lies inside one chunk: views, no copy -- unless
            # the chunk's memory is scarce (a worker process's slots): then a
            # copy, so that batches the user keeps never stall the worker.
            out = tuple(sl(a, start, start + bs) for sl, a in zip(self._slicers, arrays))
            if pin is not None and not pin.views_ok():
                out = tuple(np.array(a) for a in out)
            if n - start == bs:
                self._pieces.popleft()
            else:
                head[1] = start + bs
            return Batch(out, bs)
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
        out = tuple(np.concatenate(p, axis=ax) for p, ax in zip(parts, self.axes))
        return Batch(out, bs)
