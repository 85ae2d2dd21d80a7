"""Calls to a threaded Ray actor, put back in the order they were made.

A Ray actor with ``max_concurrency`` above 1 (each fetch actor runs its
fetch loop on one thread and takes the driver's other calls on another)
does not run one caller's calls in the order they were made: Ray's
documentation says so for threaded and async actors, and on Ray 2.60 3 000
one-way calls made in a row while the fetch loop ran came in with 1 to 108
inversions in each of 20 runs.  So every such call carries a number from
its sender, and the actor acts on it in that order (:class:`InOrder`), or
keeps only the newest value (:class:`Newest`).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Generic, Sequence, TypeVar

from .read_units import ReadUnit

__all__ = ["GivenUnits", "InOrder", "Newest"]

T = TypeVar("T")

#: calls of one sender an actor holds back at most, waiting for an earlier
#: one (the driver has at most a handful outstanding: more is a bug)
MAX_EARLY = 64


class InOrder:
    """Hands each sender's numbered items to ``take`` in the order of their
    numbers (0, 1, 2, ... per sender), holding back one that came early.
    Thread-safe: ``take`` runs under the lock, so no two items cross.

    Args:
        take: called with each item, in order.
        what: how an error names the calls (``"read units of source 'x', worker 2"``).
    """

    def __init__(self, take: Callable[[Any], None], what: str) -> None:
        self._take = take
        self._what = what
        self._lock = threading.Lock()
        #: sender -> the number of the next item it hands on
        self._next: dict[int, int] = {}
        #: sender -> items that came before an earlier one, by number
        self._early: dict[int, dict[int, Any]] = {}

    def put(self, sender: int, seq: int, item: Any) -> None:
        """Item number ``seq`` of ``sender``.

        Raises:
            ValueError: ``seq`` was handed on already, or more than
                :data:`MAX_EARLY` items wait for an earlier one.
        """
        with self._lock:
            nxt = self._next.get(sender, 0)
            early = self._early.setdefault(sender, {})
            if seq < nxt or seq in early:
                raise ValueError(f"{self._what}: call {seq} of sender {sender} came twice")
            if seq != nxt:
                if len(early) >= MAX_EARLY:
                    raise ValueError(
                        f"{self._what}: {len(early)} calls of sender {sender} wait for call {nxt}, "
                        f"which never came (at most {MAX_EARLY} wait)"
                    )
                early[seq] = item
                return
            self._take(item)
            nxt += 1
            while nxt in early:
                self._take(early.pop(nxt))
                nxt += 1
            self._next[sender] = nxt
            if not early:
                del self._early[sender]


class Newest(Generic[T]):
    """A value set by numbered calls: one with a lower number than the
    value's own (it was overtaken) changes nothing."""

    __slots__ = ("value", "_seq", "_lock")

    def __init__(self, value: T) -> None:
        #: read without the lock (one attribute load)
        self.value = value
        self._seq = -1
        self._lock = threading.Lock()

    def set(self, seq: int, value: T) -> bool:
        """Set ``value`` made as call ``seq``; False when a later call set it already."""
        with self._lock:
            if seq <= self._seq:
                return False
            self._seq = seq
            self.value = value
            return True


class GivenUnits:
    """A fetch actor's read units (a random-access source): given by the
    driver's numbered ``give_units`` calls, taken by the source's reader in
    the order they were given, the end (None) last.  A stop of the actor
    ends the wait.

    Each stream the driver starts on the actor reads for one holder (the
    driver's name for that incarnation of the worker, a number that only
    grows): :meth:`start` says which.  Calls of an earlier holder that come
    late (its feeder thread raced the restart) are dropped: the units it
    held are read again by the new one, and its end must not end the new
    stream before them.

    Args:
        what: how an error names the actor (``"source 'x', worker 2"``).
        stopping: True once the actor is told to stop.
        poll_s: how often a wait looks at ``stopping``.
    """

    def __init__(self, what: str, stopping: Callable[[], bool], poll_s: float) -> None:
        self._stopping = stopping
        self._poll_s = poll_s
        self._lock = threading.Lock()
        #: holder -> its units, in order (None: its end)
        self._queues: dict[int, queue.SimpleQueue[ReadUnit | None]] = {}
        #: the holder the current stream reads for (calls of lower ones are dropped)
        self._current = -1
        self._reading: queue.SimpleQueue[ReadUnit | None] = queue.SimpleQueue()
        self._order = InOrder(self._put, f"{what}: read units")

    def start(self, holder: int) -> None:
        """A stream of the driver's ``holder`` begins: the reader takes its units from now on."""
        with self._lock:
            self._current = max(self._current, holder)
            for old in [h for h in self._queues if h < self._current]:
                del self._queues[old]
            self._reading = self._queues.setdefault(self._current, queue.SimpleQueue())

    def give(self, holder: int, seq: int, units: Sequence[tuple[int, int, int] | None]) -> None:
        """Call ``seq`` of the driver's ``holder``."""
        self._order.put(holder, seq, (holder, units))

    def _put(self, item: tuple[int, Sequence[tuple[int, int, int] | None]]) -> None:
        holder, units = item
        with self._lock:
            if holder < self._current:
                return  # a replaced holder's late call (see the class)
            q = self._queues.setdefault(holder, queue.SimpleQueue())
        for u in units:
            q.put(None if u is None else ReadUnit(*u))

    def take(self, worker_id: int, ahead: int | None = None) -> ReadUnit | None:
        """The next unit; None: no more (the data ended, or the actor stops)."""
        q = self._reading
        while not self._stopping():
            try:
                return q.get(timeout=self._poll_s)
            except queue.Empty:
                continue
        return None
