"""A lane dealer's turn policy: which worker's lane the stream reads next.

The lanes are read in round robin, in worker order, from the one whose turn
it is (``rr``), a lane that ended in this epoch being passed over.  The two
policies differ in what they do at an empty lane:

* :class:`StrictTurns` (``deterministic=True``) waits for that worker, never
  for another, so the stream is a function of the wiring (resumable);
* :class:`FirstReadyTurns` (epochs, a shuffle or ``equal=True`` without
  ``deterministic``) passes it over too, so a stalled worker does not stall
  the others.

A policy owns the round robin's state (the order, whose turn it is, which
lanes ended in this epoch and which for good) and nothing else; the dealer
calls it under its lock.
"""

from __future__ import annotations

import collections
from typing import Any, Mapping

__all__ = ["FirstReadyTurns", "StrictTurns", "Turns"]

Lanes = Mapping[int, "collections.deque[Any]"]


class Turns:
    """The round robin over the lanes (see the module docstring)."""

    #: strict round robin: the stream is a function of the wiring
    strict = False
    #: a position in the stream can be saved and resumed from
    resumable = False

    def __init__(self) -> None:
        #: the lanes' worker ids, in round-robin order
        self.order: list[int] = []
        #: position in ``order`` whose turn it is (part of every saved position)
        self.rr = 0
        #: lanes whose data ended in this epoch; of them, those ended for good
        self.ended: set[int] = set()
        self.done: set[int] = set()

    def add(self, worker_id: int) -> None:
        self.order.append(worker_id)

    def turn(self, lanes: Lanes) -> int | None:
        """The worker whose lane is read now (``rr`` moved past the lanes
        passed over), or None: every lane is passed over (they all ended in
        this epoch, see :meth:`all_ended`, or none has anything yet)."""
        raise NotImplementedError

    def ready(self, lanes: Lanes) -> bool:
        """Would :meth:`turn` find a lane with something at its head?  (What a
        waiting reader waits for; ``rr`` does not move.)"""
        raise NotImplementedError

    def passed(self) -> None:
        """The lane whose turn it was is done with for this turn: the next one's."""
        self.rr = (self.rr + 1) % len(self.order)

    def lane_ended(self, worker_id: int, for_good: bool) -> None:
        """The lane reached its marker: the end of its epoch, or of its data."""
        self.ended.add(worker_id)
        if for_good:
            self.done.add(worker_id)

    def all_ended(self) -> bool:
        """Every lane reached the end of this epoch (or of its data)."""
        return len(self.ended) == len(self.order)

    def all_done(self) -> bool:
        """Every lane's data ended for good."""
        return len(self.done) == len(self.order)

    def next_epoch(self) -> None:
        """A new epoch: round robin from the first worker again, as a run
        started in it would; the lanes ended for good stay ended."""
        self.ended = set(self.done)
        self.rr = 0


class StrictTurns(Turns):
    """Strict round robin: an empty lane whose turn it is is waited for."""

    strict = True
    resumable = True

    def turn(self, lanes: Lanes) -> int | None:
        order, ended = self.order, self.ended
        n = len(order)
        for _ in range(n):
            wid = order[self.rr]
            if wid not in ended:
                return wid
            self.rr = (self.rr + 1) % n
        return None

    def ready(self, lanes: Lanes) -> bool:
        order, ended = self.order, self.ended
        n = len(order)
        for k in range(n):
            wid = order[(self.rr + k) % n]
            if wid not in ended:
                return bool(lanes[wid])  # only this lane's worker may go next
        return False


class FirstReadyTurns(Turns):
    """First ready: from the lane whose turn it is, the first that has
    something; empty lanes are passed over."""

    def turn(self, lanes: Lanes) -> int | None:
        order, ended = self.order, self.ended
        n = len(order)
        for _ in range(n):
            wid = order[self.rr]
            if wid not in ended and lanes[wid]:
                return wid
            self.rr = (self.rr + 1) % n
        return None

    def ready(self, lanes: Lanes) -> bool:
        order, ended = self.order, self.ended
        n = len(order)
        for k in range(n):
            wid = order[(self.rr + k) % n]
            if wid not in ended and lanes[wid]:
                return True
        return False
