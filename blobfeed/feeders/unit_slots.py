"""A worker process's shared-memory slot as the place its read unit is stacked.

A random-access or sharded source's reader stacks each read unit's samples
into one array per blob.  In a worker process that array then went into a
slot of shared memory: a second copy of every byte, and a fresh array per
unit whose pages the kernel faulted in and zeroed each time (W7: 4 MiB a
unit, about 0.7 ms of a worker's 1.2 ms per batch).  With a
:class:`UnitSlots` set as the reader's ``into``, the reader stacks straight
into a slot; the worker process then sends the slot as the result's place
(:meth:`UnitSlots.claim`) with no copy.

One slot is held at a time, from :meth:`__call__` to the next
:meth:`claim` or :meth:`drop`: a reader that falls back to its own arrays
after taking one (a sample that does not stack, an error) gives it back.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from .messages import Arrays, layout_nbytes, place_arrays

__all__ = ["UnitSlots"]

Layout = Sequence[tuple[tuple[int, ...], np.dtype]]


class UnitSlots:
    """Slots of a worker process's area for its reader to stack units into.

    ``take_slot`` blocks for a free slot (-1: the parent is gone);
    ``give_back`` returns one never sent; ``before_take`` runs before a
    slot is waited for (the worker sends what it holds, so the parent can
    free slots).  Units under ``min_bytes`` or over a slot are left to the
    reader (small ones travel pickled, batched with others)."""

    def __init__(
        self, buf: Any, offset: Callable[[int], int], slot_bytes: int, take_slot: Callable[[], int],
        give_back: Callable[[int], None], before_take: Callable[[], None], min_bytes: int,
    ) -> None:
        self._buf = buf
        self._offset = offset
        self._slot_bytes = slot_bytes
        self._take_slot = take_slot
        self._give_back = give_back
        self._before_take = before_take
        self._min_bytes = min_bytes
        self._held: tuple[list[np.ndarray], Arrays] | None = None
        #: seconds spent waiting for a slot (and sending what was pending)
        #: since the last pop_waited: not the fetch's own time
        self._waited = 0.0

    def __call__(self, layout: Layout) -> list[np.ndarray] | None:
        """Arrays of ``layout``'s shapes and dtypes in a free slot, to be
        filled and returned as the unit's result; None: stack elsewhere."""
        self.drop()
        if not self._min_bytes <= layout_nbytes(layout) <= self._slot_bytes:
            return None
        # only plain numbers go into shared memory (messages.plain_arrays'
        # rule): numpy would write object pointers into the slot, and drop
        # references to whatever bytes lay there before
        if any(dtype.hasobject or not dtype.isnative for _, dtype in layout):
            return None
        t0 = time.perf_counter()
        try:
            self._before_take()
            slot = self._take_slot()
        finally:
            self._waited += time.perf_counter() - t0
        if slot < 0:
            return None
        try:
            self._held = place_arrays(layout, self._buf, self._offset(slot), slot, False)
        except BaseException:
            self._give_back(slot)
            raise
        return self._held[0]

    def pop_waited(self) -> float:
        """Seconds waited for slots since the last call (the child takes
        them off the fetch's time: a full ring is not a slow fetcher)."""
        waited, self._waited = self._waited, 0.0
        return waited

    def claim(self, arrays: Sequence[np.ndarray], as_tuple: bool) -> Arrays | None:
        """Where ``arrays`` lie when they are the held slot's arrays (the
        message that sends them, the slot now the parent's); None
        otherwise, the held slot given back."""
        held, self._held = self._held, None
        if held is None:
            return None
        views, packed = held
        if len(arrays) == len(views) and all(a is v for a, v in zip(arrays, views)):
            return packed._replace(as_tuple=as_tuple)
        self._give_back(packed.where)
        return None

    def drop(self) -> None:
        """Give the held slot back, unused (the unit failed, or ended otherwise)."""
        held, self._held = self._held, None
        if held is not None:
            self._give_back(held[1].where)
