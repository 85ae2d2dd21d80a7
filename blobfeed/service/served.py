"""One source served to consumers in other processes.

The source is wired as it would be in one process, by
``init_data_input_workers`` on a coordinator of the service's own, into
nets that only dequeue: one per consumer index when the source is dealt by
index (``num_consumers=n``: with ``deterministic=True`` the dealer gives
batch *i* to net *i mod n*, otherwise each net takes chunks as they come,
exactly as for *n* nets in one process), else one net whose batches go to
whichever consumer is ready first.  A consumer connection takes its
batches from its *outlet* (:class:`IndexOutlet`, :class:`SharedOutlet`) and
acknowledges each one when its ``run()`` returned it; only then is the
inner net told it returned the batch, so the source's position (its
``state_dict``) is always as of what consumers acknowledged.

What a consumer that leaves had not acknowledged is never lost: dealt by
index, it is kept for the next consumer of that index (which must come
within ``grace_period``, else the source fails naming it); first come, it
goes to the other consumers first (re-dealt).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import DequeueTimeout, EndOfInput, FetcherError
from ..feeders.chunks import Batch, EpochEnd
from .arena import SourceArena

if TYPE_CHECKING:
    from ..coordinator import GlobalCoordinator
    from ..feeders import Feed

__all__ = ["End", "IndexOutlet", "Item", "ServedSource", "SharedOutlet", "SourceTerms"]

logger = logging.getLogger("blobfeed.service")

#: how long an outlet waits for its feed before looking at its connection again
POLL_S = 0.1
#: serve_source(slots=None): each consumer gets slots for about this many
#: bytes of batches, at least SLOTS_MIN and at most SLOTS_MAX.  Small batches
#: need many in flight (a round trip per batch otherwise bounds the rate);
#: large ones need few (each is copied once, and the slots are memory: S1's
#: 9.6 MB batches get 3, which measured the same batches/s as 4).
SLOTS_BYTES = 8 << 20
SLOTS_MIN = 3
SLOTS_MAX = 64
#: slots when the batch size is not known when the consumer is welcomed (Ray)
SLOTS_UNKNOWN = 4
#: consumers a first-come source's arena is sized for (their number is not known)
ARENA_CONSUMERS = 4
#: batches each inner net holds in the arena besides those lent to its
#: consumer: one in its device queue, one staged behind it, one being assembled
ARENA_PER_NET = 3


def default_slots(slot_bytes: int | None) -> int:
    """Slots per consumer for batches of ``slot_bytes`` (None: not known yet)."""
    if not slot_bytes:
        return SLOTS_UNKNOWN
    return max(SLOTS_MIN, min(SLOTS_MAX, SLOTS_BYTES // slot_bytes))


class End(NamedTuple):
    """The source ended (``error`` None: its data is done) or failed."""

    error: BaseException | None


class Item(NamedTuple):
    """A batch or an epoch's end on its way to a consumer.

    ``s``: its place in the inner net's stream (what acknowledging it
    moves past); ``batch``: a :class:`Batch` or an :class:`EpochEnd`.
    """

    s: int
    batch: Any


class SourceTerms(NamedTuple):
    """What a consumer must agree with to attach (checked at ``hello``)."""

    name: str
    blob_names: tuple[str, ...]
    batch_size: int
    num_consumers: int | None
    equal: bool
    grace_period: float
    #: None: :func:`default_slots` of the batch size
    slots: int | None


class _Counts:
    """Per consumer label: batches delivered / acknowledged / re-dealt,
    seconds waited (by the service, for a batch the consumer had room for;
    by the consumer's run(), as it reported them)."""

    def __init__(self) -> None:
        self.delivered: collections.Counter[str] = collections.Counter()
        self.acknowledged: collections.Counter[str] = collections.Counter()
        self.redealt: collections.Counter[str] = collections.Counter()
        self.waited: collections.defaultdict[str, float] = collections.defaultdict(float)
        #: the consumers' own waits: what each connection's reported total grew by, summed per label
        self.run_waited: collections.defaultdict[str, float] = collections.defaultdict(float)


def _dequeue(source: "ServedSource", feed: "Feed", timeout: float) -> Any:
    """The feed's next batch or epoch end; an :class:`End` when its stream
    ended (None: the data is done) or failed; None when nothing came in time
    (``timeout`` 0: nothing is queued now; never counted as a timeout)."""
    if timeout <= 0 and not feed.device_queue.qsize():
        return None
    try:
        return feed.dequeue(timeout if timeout > 0 else POLL_S)
    except (DequeueTimeout, TimeoutError):
        return None
    except FetcherError as err:
        return End(err)
    except EndOfInput:
        if source.error is not None:
            return End(source.error)
        if source.stopped:
            # the service stops (its stop raced the consumer's "stopped"
            # record): consumers hear that, not a worker's error
            stopped = EndOfInput(f"source {source.name!r}: the service stopped")
            stopped.service_stop = True  # type: ignore[attr-defined]
            return End(stopped)
        return End(None)


class IndexOutlet:
    """The batches of one consumer index: its inner net's feed, and what an
    earlier consumer of that index left unacknowledged (sent again first)."""

    def __init__(self, source: "ServedSource", index: int, feed: "Feed") -> None:
        self.source = source
        self.index = index
        self.feed = feed
        self.label = str(index)
        #: what the last consumer of this index left unacknowledged, in order
        self.redo: collections.deque[Item] = collections.deque()
        self._s = 0
        #: the connection that has this index now, if any
        self.holder: Any = None
        #: when it was left without a holder (monotonic), None while held
        self.left_at: float | None = time.monotonic()
        #: a consumer attached to it once (the grace period counts from its leaving)
        self.attached_once = False
        #: its feed's data ended (a consumer was handed the end): nothing more
        #: comes but what ``redo`` holds
        self.finished = False

    def next(self, conn: Any, timeout: float) -> Item | End | None:
        src = self.source
        if self.redo:
            return self.redo.popleft()
        if src.error is not None:
            return End(src.error)
        batch = _dequeue(src, self.feed, timeout)
        if batch is None or isinstance(batch, End):
            if isinstance(batch, End) and batch.error is None:
                self.finished = True
            return batch
        item = Item(self._s, batch)
        self._s += 1
        return item

    def acked(self, item: Item) -> None:
        """A consumer's ``run()`` returned ``item``: the inner net moves past it."""
        self.feed.delivered(item.batch)

    def left(self, unacked: list[Item]) -> None:
        """The consumer that held this index left with ``unacked`` items."""
        self.redo.extendleft(reversed(unacked))
        self.holder = None
        self.left_at = time.monotonic()


class SharedOutlet:
    """First come, first served: one inner net, whose batches go to whichever
    consumer is ready; what a leaving consumer had not acknowledged goes to
    the others first.  Epoch ends go to every connected consumer."""

    def __init__(self, source: "ServedSource", feed: "Feed", skip: set[int]) -> None:
        self.source = source
        self.feed = feed
        self._lock = threading.Lock()
        self.redeal: collections.deque[Item] = collections.deque()
        #: per connection, epoch ends it is owed
        self.owed: dict[Any, collections.deque[Item]] = {}
        self._s = 0
        #: items acknowledged past the prefix (their s); the prefix: every s below is acknowledged
        self._acked: set[int] = set()
        self.prefix = 0
        #: items the inner stream holds before the prefix that a resumed run must skip
        self.skip = skip
        self._items: dict[int, Any] = {}
        #: the feed's data ended (a consumer was handed the end)
        self.finished = False

    def join(self, conn: Any) -> None:
        with self._lock:
            self.owed[conn] = collections.deque()

    def next(self, conn: Any, timeout: float) -> Item | End | None:
        src = self.source
        with self._lock:
            owed = self.owed.get(conn)
            if owed:
                return owed.popleft()
            if self.redeal:
                item = self.redeal.popleft()
                src.counts.redealt[conn.label] += 1
                return item
        if src.error is not None:
            return End(src.error)
        # one taker at a time: what a consumer takes, and the epoch ends it
        # hands every other consumer, must be in stream order
        with self._lock:
            batch = _dequeue(src, self.feed, timeout)
            if batch is None or isinstance(batch, End):
                if isinstance(batch, End) and batch.error is None:
                    self.finished = True
                return batch
            s = self._s
            self._s += 1
            self._items[s] = batch
            if s in self.skip:
                # acknowledged before a resume: not dealt again
                self.skip.discard(s)
                self._ack(s)
                src.hub.count_dropped(src.name, "resume", getattr(batch, "n", 0))
                return None
            if type(batch) is EpochEnd:
                # every consumer is told; the stream moves past it at once
                for other, queue in self.owed.items():
                    if other is not conn:
                        queue.append(Item(-1, batch))
                self._ack(s)
                return Item(-1, batch)
            return Item(s, batch)

    def acked(self, item: Item) -> None:
        if item.s < 0:
            return  # an epoch end told to one consumer: the stream passed it
        with self._lock:
            self._ack(item.s)

    def _ack(self, s: int) -> None:
        self._acked.add(s)
        while self.prefix in self._acked:
            self._acked.discard(self.prefix)
            batch = self._items.pop(self.prefix)
            self.feed.delivered(batch if type(batch) is EpochEnd else Batch((), batch.n))
            self.prefix += 1

    def left(self, conn: Any, unacked: list[Item]) -> None:
        with self._lock:
            self.owed.pop(conn, None)
            batches = [i for i in unacked if i.s >= 0]
            self.redeal.extendleft(reversed(batches))

    def acked_after(self) -> list[int]:
        """Items acknowledged past the prefix (relative to it), for a state."""
        with self._lock:
            return sorted(s - self.prefix for s in self._acked)


class ServedSource:
    """A source wired on the service's coordinator, and its outlets."""

    def __init__(
        self,
        terms: SourceTerms,
        coordinator: "GlobalCoordinator",
        feeds: list["Feed"],
        hub: Any,
    ) -> None:
        self.terms = terms
        self.name = terms.name
        self.coordinator = coordinator
        self.hub = hub
        self.counts = _Counts()
        self.error: BaseException | None = None
        self.stopped = False
        self._lock = threading.Lock()
        self.feeds = feeds
        #: the batch layout, known from the first batch (sizes the slots)
        self.slot_bytes: int | None = None
        self.connected = 0
        if terms.num_consumers is not None:
            self.outlets: list[IndexOutlet] = [IndexOutlet(self, i, f) for i, f in enumerate(feeds)]
            self.shared: SharedOutlet | None = None
        else:
            self.outlets = []
            self.shared = SharedOutlet(self, feeds[0], set())
        #: big batches are assembled here, in memory the consumers map
        self.arena = SourceArena(terms.name, self._arena_slots)
        for feed in feeds:
            feed.rebatcher.use_memory(self.arena)

    def _arena_slots(self, slot_bytes: int) -> int:
        """How many batches of ``slot_bytes`` the arena holds: what every
        consumer's slots lend out, and what each inner net holds besides."""
        per_consumer = self.terms.slots or default_slots(slot_bytes)
        consumers = self.terms.num_consumers or ARENA_CONSUMERS
        return consumers * per_consumer + len(self.feeds) * ARENA_PER_NET + 2

    @property
    def slots(self) -> int:
        """Slots per consumer: the ``slots`` served with, else :func:`default_slots`."""
        return self.terms.slots or default_slots(self.slot_bytes)

    # -- attach ----------------------------------------------------------------------
    def claim(self, conn: Any, index: int | None) -> IndexOutlet | SharedOutlet:
        """The outlet ``conn`` takes its batches from.

        Raises:
            ValueError: the index is taken, or out of range.
        """
        with self._lock:
            if self.shared is not None:
                self.shared.join(conn)
                self.connected += 1
                return self.shared
            if index is None:
                free = [o for o in self.outlets if o.holder is None]
                if not free:
                    raise ValueError(
                        f"source {self.name!r}: all {len(self.outlets)} consumer indexes are attached"
                    )
                outlet = free[0]
            else:
                outlet = self.outlets[index]
                if outlet.holder is not None:
                    raise ValueError(
                        f"source {self.name!r}: consumer index {index} is attached already "
                        f"({outlet.holder.peer}); each index attaches once"
                    )
            outlet.holder = conn
            outlet.left_at = None
            outlet.attached_once = True
            self.connected += 1
            return outlet

    def release(self, conn: Any, outlet: IndexOutlet | SharedOutlet, unacked: list[Item]) -> None:
        """``conn`` left; ``unacked``: what it had not acknowledged, in order."""
        with self._lock:
            self.connected -= 1
            if isinstance(outlet, SharedOutlet):
                outlet.left(conn, unacked)
                if unacked:
                    logger.warning(
                        "source %r: consumer %s left with %d batches unacknowledged: dealt to the others",
                        self.name, conn.label, sum(1 for i in unacked if i.s >= 0),
                    )
            else:
                outlet.left(unacked)
                if unacked and self.error is None and not self.stopped:
                    logger.warning(
                        "source %r: consumer %d left with %d items unacknowledged: kept for its "
                        "return (within %.3g s)", self.name, outlet.index, len(unacked), self.terms.grace_period,
                    )

    @property
    def failure(self) -> BaseException | None:
        """Why the source failed (a consumer index that did not come back, a
        fetcher error of its workers), None while it has not."""
        if self.error is not None:
            return self.error
        inner = self.feeds[0].source
        return inner.error if isinstance(inner.error, BaseException) else None

    @property
    def ended(self) -> bool:
        """Its data was dealt to the end (every batch acknowledged) and every
        consumer left: the source has nothing more to do."""
        if self.failure is not None or self.stopped or self.connected:
            return False
        if self.shared is not None:
            return self.shared.finished and not self.shared.redeal
        return all(o.finished and not o.redo and o.holder is None for o in self.outlets)

    def check_grace(self) -> None:
        """Fail the source if a consumer index has been away longer than the
        grace period (an index whose data ended and that left nothing
        unacknowledged is not away: it is done)."""
        if self.error is not None or self.stopped or not self.outlets:
            return
        now = time.monotonic()
        for o in self.outlets:
            if o.finished and not o.redo:
                continue
            if o.holder is None and o.left_at is not None and o.attached_once and now - o.left_at > self.terms.grace_period:
                self.fail(FetcherError(
                    f"source {self.name!r}: consumer {o.index} left and did not come back within "
                    f"{self.terms.grace_period:.3g} s (grace_period); its batches cannot go to another "
                    "consumer when the source is dealt by index"
                ))
                return

    def fail(self, error: BaseException) -> None:
        """The source fails with ``error``: its consumers get it, its
        workers stop.  The service's other sources go on (they share the
        coordinator: only this source's name is stopped, not waited for)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = error
        logger.error("%s", error)
        self.coordinator._request_stop_named(self.name)

    def drop_held(self) -> None:
        """At stop: let go of the batches waiting to be dealt again (they
        keep the slots of consumers that left mapped)."""
        for o in self.outlets:
            o.redo.clear()
        if self.shared is not None:
            with self.shared._lock:
                self.shared.redeal.clear()
                self.shared.owed.clear()
        self.arena.close()

    # -- state -----------------------------------------------------------------------
    @property
    def resumable(self) -> bool:
        """Can it save and load a state (``deterministic=True``)?"""
        return bool(self.feeds[0].source.dealer.resumable)

    def state_dict(self) -> dict[str, Any]:
        inner = self.coordinator.state_dict(self.name)
        state: dict[str, Any] = {"service_version": 1, "source": self.name, "inner": inner}
        if self.shared is not None:
            state["acked_after"] = self.shared.acked_after()
        return state
