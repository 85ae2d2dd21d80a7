"""Whole batches assembled inside a worker process (:class:`BatchFiller`).

A worker process writes each chunk ``fetch_fun`` returns into a slot of its
shared memory, and the parent's re-batcher copies the pieces into batches.
When nothing downstream needs a chunk as it came, the worker instead copies
its chunks straight into batch-sized slots and announces each slot once it
holds a whole batch: one message and one copy per batch, and the parent
hands the slot out as the batch itself (a view), copying nothing.

The parent allows it per message (:meth:`~.transport.SlotArea.set_whole`):
only for a source dealt in arrival order whose every reader cuts batches of
one size along axis 0 (see ``InputSource.whole_batch_size``), where which
samples share a batch was never promised.  Anything else (a chunk of another
layout, one of a batch or more, a stateful fetcher's result, a source that
stopped allowing it, the worker's end) first sends the batch begun so far as
an ordinary, smaller chunk, so the order of a worker's samples never changes.

Such a smaller chunk is rare on purpose: the parent's re-batcher keeps the
samples' order, so after it every batch of the stream straddles two of the
workers' slots and is copied once in the parent (as it was before workers
assembled batches), until another smaller chunk happens to realign them.
So a batch begun waits in its worker for the samples that complete it (no
timer sends it early), and a worker assembles batches only while its calls
are fast enough to fill one within :data:`FILL_MAX_S`.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any, Callable, Sequence

import numpy as np

from .messages import Arrays, Result, align

__all__ = ["BatchFiller", "FILL_MAX_S"]

#: a worker assembles batches while its calls would fill one within this
#: long (their fetch seconds per sample, averaged): a slow fetcher's samples
#: would wait in the worker for a batch that others could complete sooner
FILL_MAX_S = 0.05
#: calls judged before a worker stops assembling batches
MIN_CALLS = 4


class BatchFiller:
    """One worker process's batch under assembly, in one of its slots.

    Args:
        buf: the worker's shared memory (anything with the buffer protocol).
        offset: the byte offset of a slot in ``buf``.
        slot_bytes: the size of a slot.
        take_slot: a free slot (blocking until the parent gives one back),
            or -1 when the parent is gone.
        min_bytes: batches smaller than this are not assembled here (they
            travel pickled: a slot is not worth it).
    """

    def __init__(
        self, buf: Any, offset: Callable[[int], int], slot_bytes: int, take_slot: Callable[[], int],
        min_bytes: int,
    ) -> None:
        self._buf = buf
        self._offset = offset
        self._slot_bytes = slot_bytes
        self._take_slot = take_slot
        self._min_bytes = min_bytes
        self._slot = -1
        self._size = 0
        self._filled = 0
        #: (dtype, per-sample shape, offset in the slot) of each array
        self._layout: list[tuple[np.dtype, tuple[int, ...], int]] = []
        self._as_tuple = False
        #: the fetch seconds of each call whose samples start in this batch
        self._calls: list[float] = []
        #: fetch seconds per sample of the last calls
        self._recent: collections.deque[float] = collections.deque(maxlen=2 * MIN_CALLS)
        #: assembling now (with hysteresis: see worth)
        self._on = True
        self.gone = False

    @property
    def filling(self) -> bool:
        return self._slot >= 0

    def takes(self, arrays: Sequence[np.ndarray], as_tuple: bool, size: int, seconds: float) -> bool:
        """Does a chunk of ``arrays`` (``seconds`` of fetching) go into a
        batch of ``size`` here (after :meth:`flush` of a batch of another
        layout, if need be)?"""
        first = arrays[0]
        if first.ndim == 0:
            return False
        rows = first.shape[0]
        if not 0 < rows < size:
            return False  # a batch or more: the parent cuts it into views
        # judged between batches only: a batch begun is completed
        if not self._worth(seconds / rows, size) and not self.filling:
            return False
        total = 0
        for a in arrays:
            if a.ndim == 0 or a.shape[0] != rows:
                return False  # malformed: the parent's checks name it
            total += align(a.nbytes // rows * size)
        return self._min_bytes <= total <= self._slot_bytes

    def matches(self, arrays: Sequence[np.ndarray], as_tuple: bool, size: int) -> bool:
        """Does a chunk of ``arrays`` continue the batch begun here?"""
        if size != self._size or as_tuple != self._as_tuple or len(arrays) != len(self._layout):
            return False
        for a, (dt, shape, _) in zip(arrays, self._layout):
            if a.dtype != dt or a.shape[1:] != shape:
                return False
        return True

    def _worth(self, per_sample: float, size: int) -> bool:
        """Are the calls fast enough to fill a batch of ``size`` within
        :data:`FILL_MAX_S`?  Measured on the fetch seconds (not wall time:
        a loaded machine that stalls the worker does not turn it off), as
        the median of the last calls (a first call that warms up is not
        the rule), with hysteresis (off past the bound, on again under half
        of it): every switch costs copies (see the module)."""
        recent = self._recent
        recent.append(per_sample)
        if len(recent) < MIN_CALLS:
            return self._on
        fill = statistics.median(recent) * size
        self._on = fill <= FILL_MAX_S if self._on else fill <= FILL_MAX_S / 2
        return self._on

    def add(self, seconds: float, arrays: Sequence[np.ndarray], as_tuple: bool, size: int) -> list[Result]:
        """Copy a chunk (that :meth:`takes`, and :meth:`matches` the batch
        begun if any) in; the whole batches it completed, as results to send.
        ``gone`` is set (and nothing more is written) once no slot can be had."""
        out: list[Result] = []
        rows = arrays[0].shape[0]
        start = 0
        self._calls.append(seconds)
        while start < rows:
            if self._slot < 0:
                if not self._begin(arrays, as_tuple, size):
                    return out
            take = min(size - self._filled, rows - start)
            base = self._offset(self._slot)
            for a, (dt, shape, off) in zip(arrays, self._layout):
                if not a.nbytes:
                    continue
                per = a.nbytes // rows
                dst = np.ndarray((take, *shape), dt, buffer=self._buf, offset=base + off + self._filled * per)
                np.copyto(dst, a[start:start + take], casting="no")
            self._filled += take
            start += take
            if self._filled == size:
                out.append(self._result())
        return out

    def flush(self) -> list[Result]:
        """The batch begun, as it is (a smaller chunk), if any."""
        return [self._result()] if self._slot >= 0 and self._filled else []

    def _begin(self, arrays: Sequence[np.ndarray], as_tuple: bool, size: int) -> bool:
        slot = self._take_slot()
        if slot < 0:
            self.gone = True
            return False
        rows = arrays[0].shape[0]
        layout, off = [], 0
        for a in arrays:
            layout.append((a.dtype, a.shape[1:], off))
            off += align(a.nbytes // rows * size)
        self._slot, self._size, self._filled = slot, size, 0
        self._layout, self._as_tuple = layout, as_tuple
        return True

    def _result(self) -> Result:
        """The batch begun, as one result in its slot; nothing is begun after."""
        n = self._filled
        meta = [(dt, (n, *shape), off) for dt, shape, off in self._layout]
        # each call counted once, in the batch its samples start in (a
        # batch may hold only the rest of a call counted before: none)
        calls = tuple(self._calls)
        result = Result(sum(calls), Arrays(self._slot, meta, self._as_tuple), None, calls)
        self._slot, self._filled, self._calls = -1, 0, []
        return result

