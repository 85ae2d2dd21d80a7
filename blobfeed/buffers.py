"""``max_buffered_bytes="auto"``: the internal queue's byte limit follows
what the pipeline needs, within the budget.

As tf.data's autotune sizes a prefetch buffer (grown when it ran empty,
shrunk when it never does, within a RAM budget), the queue of a source in
arrival order holds at most a *working limit* of bytes that

* starts small (:data:`START_BYTES`, or the budget if that is smaller);
* **doubles**, up to the budget, after a window in which a net waited for
  input (at least :data:`STARVED_WAIT` of its time), a net's feed found the
  queue empty, *and* a worker waited because the queue was at its byte
  limit: the workers could have fetched more than the limit let them
  keep, and the net went short later (bursts);
* **halves**, down to :data:`FLOOR_BYTES`, after a window in which the
  queue's fill never went below :data:`LOW_WATERMARK` of the limit (it
  never ran near empty: a smaller buffer would have done as well, so the
  memory is given back, as when the net is the limit and the queue stays
  full); not within a hold (:data:`HOLD_S`, doubled each time a halving was
  undone, up to :data:`HOLD_MAX_S`) after a doubling, so a pipeline whose
  bursts are rarer than the window does not flap.

So the queue never holds more than the budget (as with a fixed
``max_buffered_bytes``), and holds less while less does as well.  A fixed
``max_buffered_bytes`` (an int or None) is not touched: nothing here runs
and the queue is the plain :class:`~blobfeed.queues.BlobsQueue`.

:class:`Watermarks` is the policy alone (a fake plant drives it in tests);
:class:`BufferTuner` measures the real queues (from the coordinator's
monitor, about once a second) and applies it.  docs/TUNING.md explains it
for users.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from .stats import SourceTotals

__all__ = ["Fill", "Watermarks", "BufferTuner", "START_BYTES", "FLOOR_BYTES"]

logger = logging.getLogger("blobfeed.buffers")

#: the working limit a source starts with (at most its budget)
START_BYTES = 8 << 20
#: the working limit is never below this many of the source's batches (within the budget)
FLOOR_BATCHES = 4
#: the working limit never goes below this (nor above the budget)
FLOOR_BYTES = 1 << 20
#: a window is at least this long
WINDOW_S = 1.0
#: the fill never went below this share of the limit over a window: halve
LOW_WATERMARK = 0.25
#: a net that waited for input at least this share of its time went short
STARVED_WAIT = 0.05
#: no halving for this long after a doubling, twice as long after each
#: doubling that undid a halving, up to HOLD_MAX_S
HOLD_S = 4.0
HOLD_MAX_S = 30.0


@dataclass(frozen=True)
class Fill:
    """What one window showed of a source's queue."""

    seconds: float
    #: some net waited for input at least STARVED_WAIT of its time
    starved: bool
    #: times a worker waited because the queue was at its byte limit
    held: int
    #: times a net's feed found the queue empty and waited
    empty: int
    #: the fewest bytes the queue held during the window
    low: int


@dataclass
class Watermarks:
    """The working limit's policy: fed one :class:`Fill` at a time,
    returns the limit to use next.  No clock of its own (``now`` is passed)."""

    limit: int
    floor: int
    budget: int
    hold_until: float = 0.0
    #: doublings that undid a halving (each doubles the hold)
    regrows: int = 0
    #: the last change was a halving
    shrunk: bool = False
    #: why the last change was made (for the log line)
    reason: str = ""

    @classmethod
    def start(cls, budget: int, start: int | None = None, floor: int | None = None) -> "Watermarks":
        start = START_BYTES if start is None else start
        floor = FLOOR_BYTES if floor is None else floor
        return cls(limit=max(1, min(budget, start)), floor=max(1, min(budget, floor)), budget=budget)

    def fit_batches(self, batch_bytes: int) -> int:
        """The floor is at least :data:`FLOOR_BATCHES` batches of
        ``batch_bytes`` (within the budget), and the limit at least the
        floor: a queue that cannot hold a batch of each of a few workers
        holds all but one of them back, whatever they could do (and the
        worker tuner reads that another worker does not pay).  Returns the
        limit."""
        floor = min(self.budget, FLOOR_BATCHES * batch_bytes)
        if floor > self.floor:
            self.floor = floor
        if self.limit < self.floor:
            self.limit = self.floor
            self.reason = f"{FLOOR_BATCHES} batches of the source's samples: at least {_mib(self.floor)}"
        return self.limit

    def decide(self, now: float, f: Fill) -> int:
        if f.starved and f.held and f.empty:
            if self.limit < self.budget:
                if self.shrunk:
                    self.regrows += 1
                self.shrunk = False
                was, self.limit = self.limit, min(self.budget, 2 * self.limit)
                self.hold_until = now + min(HOLD_MAX_S, HOLD_S * 2 ** self.regrows)
                self.reason = (
                    f"a net waited for input on an empty queue while the workers waited for room "
                    f"(held back {f.held} times at {_mib(was)}): up to {_mib(self.limit)}"
                )
            return self.limit
        if (
            self.limit > self.floor and now >= self.hold_until and not f.empty
            and f.low >= LOW_WATERMARK * self.limit
        ):
            was, self.limit = self.limit, max(self.floor, self.limit // 2)
            self.shrunk = True
            self.reason = (
                f"the queue held at least {_mib(f.low)} all the time ({LOW_WATERMARK:.0%} of "
                f"{_mib(was)} or more): down to {_mib(self.limit)}"
            )
        return self.limit


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass
class _Followed:
    name: str
    run: int
    policy: Watermarks
    queue: Any
    t: float = 0.0
    marks: tuple[int, int] = (0, 0)
    nets: dict[str, tuple[float, float]] | None = None


class BufferTuner:
    """The sources of one coordinator wired with ``max_buffered_bytes="auto"``
    in arrival order.  Its ``tick`` is called by one thread (the
    coordinator's monitor), about once a second."""

    def __init__(self, gc: Any) -> None:
        self._gc = gc
        self._followed: dict[str, _Followed] = {}

    def add(self, name: str, source: Any, budget: int) -> None:
        """Source ``name`` (just wired, its dealer's queue a
        :class:`~blobfeed.queues.WatermarkQueue`) follows need."""
        queue = source.dealer.queue
        policy = Watermarks.start(budget)
        queue.set_byte_limit(policy.limit)
        self._followed[name] = _Followed(name, id(source), policy, queue)
        logger.info(
            "source %r: max_buffered_bytes='auto': the queue starts at %s, follows need up to %s",
            name, _mib(policy.limit), _mib(budget),
        )

    def forget(self, name: str | None = None) -> None:
        if name is None:
            self._followed.clear()
        else:
            self._followed.pop(name, None)

    @property
    def active(self) -> bool:
        return bool(self._followed)

    def tick(self, now: float, totals: Mapping[str, "SourceTotals"]) -> None:
        for name, f in list(self._followed.items()):
            src: Any = self._gc._known.sources.get(name)
            if src is None or id(src) != f.run or src.stopped:
                self._followed.pop(name, None)  # its run is over
                continue
            feeds: list[Any] = list(src.feeds)  # (before the identity test below narrows src's type)
            entry = totals.get(name)
            if src.halted or src.finished or entry is None or entry.live is not src:
                continue  # not started yet, or ending
            fetched = entry.fetch
            if fetched.samples and feeds:
                was = f.policy.limit
                batch = fetched.bytes // fetched.samples * max(feed.batch_size for feed in feeds)
                if f.policy.fit_batches(batch) != was:
                    f.queue.set_byte_limit(f.policy.limit)
                    logger.info("source %r: queue limit %s (was %s): %s", name, _mib(f.policy.limit), _mib(was),
                                f.policy.reason)
            nets = {net: (c.wait.total, c.busy) for net, ((_, c), _) in entry.feeds.items()}
            if f.nets is None:  # the first look: the window starts here
                f.t, f.nets, f.marks = now, nets, f.queue.take_marks()[:2]
                continue
            if now - f.t < WINDOW_S:
                continue
            held, empty, low = f.queue.take_marks()
            starved = False
            for net, (wait, ran) in nets.items():
                w0, r0 = f.nets.get(net, (0.0, 0.0))
                dw, db = max(0.0, wait - w0), max(0.0, ran - r0)
                if dw + db > 0 and dw / (dw + db) >= STARVED_WAIT:
                    starved = True
            fill = Fill(now - f.t, starved, held - f.marks[0], empty - f.marks[1], low)
            f.t, f.nets, f.marks = now, nets, (held, empty)
            was = f.policy.limit
            limit = f.policy.decide(now, fill)
            if limit != was:
                f.queue.set_byte_limit(limit)
                logger.info("source %r: queue limit %s (was %s): %s", name, _mib(limit), _mib(was),
                            f.policy.reason)
