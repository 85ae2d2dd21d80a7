"""One consumer's ledger: what the service sent it and what it acknowledged.

Every carrier (Unix socket, TCP, Ray) keeps one :class:`Ledger` per
attached consumer.  It numbers what goes out (``g``, from 0: batches and
epoch ends), keeps what is in flight in order, takes the consumer's
cumulative acknowledgement (everything up to ``g`` was returned by its
``run()``) after checking it, settles what it acknowledges with the
consumer's outlet (``outlet.acked``), and when the consumer leaves hands
back what it had not acknowledged (dealt again, in order).

A carrier with slots (a ring of shared memory, or a TCP stream's buffers)
also keeps here which slots the consumer holds: a slot may be freed only
by the consumer it was sent to, once, and a slot freed before its batch's
acknowledgement goes back to the ring with that acknowledgement, not
before (see :meth:`Ledger.free`).

Thread-safe: the carrier's sender (or Ray's take) records, its receiver
(or Ray's ack) acknowledges, under one lock.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

from ..reader import EpochEnd
from .wire import WireError

__all__ = ["Ledger"]

#: the number of an item taken for the consumer that never reached it
UNSENT = -2


class Ledger:
    """One consumer's items in flight, numbered, and their acknowledgement.

    Args:
        outlet: where the consumer's items come from (``acked(item)`` on
            each acknowledged one).
        counts: the source's counters (``acknowledged[label]``).
        label: the consumer's label in those counters.
        ordered: the consumer's acknowledgements come in order (one socket):
            each must move past the last.  Ray's calls may come out of
            order, so there a late or repeated one changes nothing.
    """

    def __init__(self, outlet: Any, counts: Any, label: str, ordered: bool = True) -> None:
        self.outlet = outlet
        self.counts = counts
        self.label = label
        #: who the consumer is, for messages (its carrier sets it)
        self.peer = f"consumer {label}"
        self.ordered = ordered
        self.lock = threading.Lock()
        #: what was sent (or taken) and not acknowledged: (g, item, slot, meta), in order
        self._inflight: collections.deque[tuple[int, Any, int, Any]] = collections.deque()
        #: the number of the next item
        self._g = 0
        #: items below this number were sent: what the consumer may acknowledge
        self._sent = 0
        #: the consumer left: acknowledgements are refused
        self._left = False
        #: slots of the items in flight (sent or being sent, not acknowledged)
        self._unacked_slots: set[int] = set()
        #: of those, the slots the consumer freed already: they go back to
        #: the ring with their item's acknowledgement, not before (see free)
        self._freed_early: set[int] = set()
        #: slots taken for this consumer and not freed by it yet: the only
        #: slots it may free (one it was never sent is a lie)
        self._held: set[int] = set()

    # -- going out ---------------------------------------------------------------------
    def number(self) -> int:
        """The next item's number (one thread, the sender, numbers)."""
        g = self._g
        self._g += 1
        return g

    def hold(self, slot: int) -> None:
        """``slot`` was taken for this consumer: held and unacknowledged from
        now, before its batch is written (a free of it that arrives during
        the write is early, kept until the acknowledgement, never a reuse)."""
        with self.lock:
            self._held.add(slot)
            self._unacked_slots.add(slot)

    def record(self, g: int, item: Any, slot: int = -1, meta: Any = None) -> None:
        """Item ``g`` (in ``slot``, laid out as ``meta``; -1: none) is in flight."""
        with self.lock:
            self._inflight.append((g, item, slot, meta))
            if slot >= 0:
                self._unacked_slots.add(slot)

    def sent(self, g: int) -> None:
        """Items up to ``g`` are sent (or about to be: called before the
        send, since the acknowledgement may come before send() returns)."""
        self._sent = g + 1

    def unsent(self, item: Any) -> None:
        """An item taken for the consumer that never reached it: it counts as
        unacknowledged (handed back on leave), never acknowledged."""
        with self.lock:
            self._inflight.append((UNSENT, item, -1, None))

    def in_flight(self) -> int:
        """Items sent and not acknowledged."""
        with self.lock:
            return sum(1 for g, _, _, _ in self._inflight if g >= 0)

    def outstanding(self) -> int:
        """Items sent (or taken) and not acknowledged, at a glance (no lock)."""
        return len(self._inflight)

    def holds_any(self) -> bool:
        """Does the consumer hold anything unacknowledged (or taken for it)?"""
        return bool(self._inflight)

    # -- coming back -------------------------------------------------------------------
    def check_ack(self, g: int) -> None:
        """Raise what :meth:`ack` would for ``g`` (an ordered ledger), without
        settling anything: an acknowledgement read together with others is
        checked as it is read (see ``Connection._merge``), so that a lie
        among them does not take the ones before it along.  A ``g`` that
        passes stays good until it is taken: ``sent`` only grows, and the
        head moves only by the acknowledgements the same thread takes.

        Raises:
            WireError: ``g`` was never sent, or does not move past the last
                acknowledgement.
        """
        if g == -1:
            return
        with self.lock:
            if self._left:
                return  # ack() refuses nothing then either: it counts nothing
            head = self._inflight[0][0] if self._inflight else None
            if head is None or head < 0 or not head <= g < self._sent:
                raise WireError(
                    f"{self.peer} acknowledged items up to {g}; its next unacknowledged item is {head} "
                    f"and the last sent {self._sent - 1}"
                )

    def ack(self, g: int) -> tuple[bool, list[int]]:
        """The consumer's run() returned every item up to ``g`` (cumulative;
        -1: nothing new).  Settles them with the outlet and counts them.

        Returns:
            (False, []) if the consumer left already (what it held was
            handed back: its run() must not return it); else (True, the
            slots freed early whose items this acknowledges: they may be
            written again now).

        Raises:
            WireError: ``g`` was never sent; in order (a socket), also one
                that does not move past the last acknowledgement.
        """
        with self.lock:
            if self._left:
                return False, []
            if self.ordered:
                if g == -1:
                    return True, []
                head = self._inflight[0][0] if self._inflight else None
                if head is None or head < 0 or not head <= g < self._sent:
                    raise WireError(
                        f"{self.peer} acknowledged items up to {g}; its next unacknowledged item is {head} "
                        f"and the last sent {self._sent - 1}"
                    )
            elif not -1 <= g < self._sent:
                raise WireError(f"{self.peer} acknowledged item {g}; {self._sent} were sent")
            return True, self._settle(g)

    def _settle(self, upto: int) -> list[int]:
        """(Under the lock.)  Acknowledge the head up to ``upto``; the slots
        freed early that may be written again now."""
        inflight, outlet = self._inflight, self.outlet
        n = 0
        back = []
        while inflight and 0 <= inflight[0][0] <= upto:
            _, item, slot, _ = inflight.popleft()
            if slot >= 0:
                self._unacked_slots.discard(slot)
                if slot in self._freed_early:
                    self._freed_early.discard(slot)
                    back.append(slot)
            outlet.acked(item)
            if type(item.batch) is not EpochEnd:
                n += 1
        if n or self.ordered:
            self.counts.acknowledged[self.label] += n
        return back

    def free(self, slots: list[int]) -> list[int]:
        """Of the slots the consumer freed, those that may be written again now.

        A slot whose batch is not acknowledged yet keeps its batch until the
        acknowledgement (or, should the consumer leave, until it was dealt
        again from it): a consumer that freed it and left without the
        acknowledgement would otherwise have that batch dealt again out of
        a slot that holds another one by then.  An honest consumer does
        free early: a net on a GPU drops the host's views once its batch is
        on the device, before run() returns it.

        Raises:
            WireError: a slot it does not hold (never sent, or freed already).
        """
        with self.lock:
            stranger = [s for s in slots if s not in self._held]
            if stranger or len(set(slots)) < len(slots):
                bad = min(stranger) if stranger else min(s for s in slots if slots.count(s) > 1)
                raise WireError(f"{self.peer} freed slot {bad}, which it does not hold")
            self._held.difference_update(slots)
            early = self._unacked_slots.intersection(slots)
            if not early:
                return slots
            twice = early & self._freed_early
            if twice or len(early) < sum(1 for s in slots if s in early):
                raise WireError(f"{self.peer} freed slot {min(twice or early)}, which it does not hold")
            self._freed_early |= early
            return [s for s in slots if s not in early]

    # -- leaving -----------------------------------------------------------------------
    def close(self) -> bool:
        """The consumer is gone: acknowledgements from now on are refused.
        True the first time."""
        with self.lock:
            first, self._left = not self._left, True
            return first

    def not_returned(self) -> set[int]:
        """The numbers of what the consumer's run() never returned (in flight)."""
        with self.lock:
            return {g for g, _, _, _ in self._inflight}

    def hand_back(self, keep: Callable[[Any, int, Any], Any] | None = None) -> list[Any]:
        """What the consumer had not acknowledged, in order, to be dealt
        again (the ledger is empty after).  ``keep(item, slot, meta)``: the
        item to hand back for one that lies in ``slot`` (a copy out of a
        slot that goes with its consumer)."""
        with self.lock:
            self._left = True
            out = []
            for _, item, slot, meta in self._inflight:
                if keep is not None and slot >= 0 and meta is not None:
                    item = keep(item, slot, meta)
                out.append(item)
            self._inflight.clear()
            return out
