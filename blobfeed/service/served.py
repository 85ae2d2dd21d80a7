"""One source served to consumers in other processes.

The source is wired as it would be in one process, by
``init_reader`` on a coordinator of the service's own, and read through
the library's reader seam (``blobfeed.reader``): one reader without
prefetch per consumer index when the source is dealt by index
(``num_consumers=n``: with ``deterministic=True`` the dealer gives batch
*i* to reader *i mod n*, otherwise each reader takes chunks as they come,
exactly as *n* nets in one process would), else one reader whose batches go
to whichever consumer is ready first.  A consumer connection takes its
batches from its *outlet* (:class:`IndexOutlet`, :class:`SharedOutlet`) and
acknowledges each one when its ``run()`` returned it; only then is the
reader told it was returned (``BatchReader.returned``), so the source's
position (its ``state_dict``) is always as of what consumers acknowledged.

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
from ..reader import Batch, EpochEnd
from .arena import SourceArena

if TYPE_CHECKING:
    from ..coordinator import GlobalCoordinator
    from ..reader import BatchReader

__all__ = ["End", "IndexOutlet", "Item", "ServedSource", "SharedOutlet", "SourceTerms"]

logger = logging.getLogger("blobfeed.service")
#: stops the service's coordinator as a user would (see coordinator.lifecycle.STOPS_AS_A_USER)
_blobfeed_stops_as_a_user = True

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
#: seconds an attach of an index waits for the consumer leaving it to be
#: let go of (past Connection._leave's 10 s bound on its sender's end)
LEAVING_S = 15.0
#: first come, a consumer holds at most its share of its slots unacknowledged:
#: the slots divided among ARENA_CONSUMERS consumers (more if more are
#: attached), but never fewer than this (what a few slots hold anyway)
SHARE_MIN = 4
#: batches each consumer index's reader holds in the arena besides those lent
#: to its consumer: the one its sender assembled and waits to send, and the
#: next one it may start to assemble (the reader has no prefetch)
ARENA_PER_NET = 2


#: first come: batches dealt past the oldest one not acknowledged, at most.
#: Everything acknowledged past it is kept (the position cannot pass it, and
#: a resume must not deal those again): a consumer that holds a batch while
#: the others go on would make that grow with the stream.  Past it, the
#: dealing waits for that batch (about 50 MiB of bookkeeping at the bound).
MAX_AHEAD = 1 << 18


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

    ``s``: its place in its reader's stream (what acknowledging it
    moves past); ``batch``: a :class:`Batch` or an :class:`EpochEnd`.
    """

    s: int
    batch: Any


#: consumers a first-come source serves at once unless told otherwise
#: (``serve_source(max_consumers=...)``): each holds two threads, a socket
#: and its slots' memory in the service, and anyone who can attach may
DEFAULT_MAX_CONSUMERS = 128


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
    #: first come: consumers attached at once, at most (None when dealt by index: the indexes bound it)
    max_consumers: int | None = None


#: first come: the consumers that left whose series a scrape still shows
#: (the last ones to leave; older ones' are dropped)
KEEP_LEFT = 64


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
        #: a retire and a scrape's copy, one at a time (a scrape between the
        #: two steps of a retire would see a total that goes back)
        self.lock = threading.Lock()
        #: labels of consumers that left, kept as they are, oldest first (see retire)
        self._gone: collections.deque[str] = collections.deque()
        #: the acknowledgements of the consumers whose series were dropped
        self._retired_acknowledged = 0

    def retire(self, label: str) -> None:
        """The consumer ``label`` left for good (first come: labels are
        connections, one per attach).  The last :data:`KEEP_LEFT` that left
        keep their series; older ones' are dropped, so that the series do not
        grow with the attaches.  (Summed into one series instead, each fold
        would be a jump that ``rate()`` reads as batches; a series that
        goes away is what Prometheus expects of a label that went away.)"""
        with self.lock:
            self._gone.append(label)
            while len(self._gone) > KEEP_LEFT:
                old = self._gone.popleft()
                self._retired_acknowledged += self.acknowledged.pop(old, 0)
                for counts in (self.delivered, self.redealt, self.waited, self.run_waited):
                    counts.pop(old, None)

    def total_acknowledged(self) -> int:
        """Batches acknowledged by every consumer, those whose series were dropped too."""
        with self.lock:
            return sum(self.acknowledged.values()) + self._retired_acknowledged

    def snapshot(self) -> list[list[tuple[str, float]]]:
        """Each count's (label, value) pairs, in the order of ``__init__``, copied at one moment."""
        with self.lock:
            return [list(c.items()) for c in (self.delivered, self.acknowledged, self.redealt, self.waited,
                                              self.run_waited)]


def _dequeue(source: "ServedSource", reader: "BatchReader", timeout: float) -> Any:
    """The reader's next batch or epoch end; an :class:`End` when its stream
    ended (None: the data is done) or failed; None when nothing came in time
    (``timeout`` 0: nothing is queued now; never counted as a timeout)."""
    try:
        if timeout <= 0:
            read_ready = getattr(reader, "read_ready", None)  # a BatchReader's; a reader of ready() and read() too
            if read_ready is not None:
                return read_ready()
            return reader.read(POLL_S) if reader.ready() else None
        return reader.read(timeout)
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
    """The batches of one consumer index: its reader, and what an
    earlier consumer of that index left unacknowledged (sent again first)."""

    def __init__(self, source: "ServedSource", index: int, feed: "BatchReader") -> None:
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
        """A consumer's ``run()`` returned ``item``: the reader's position moves past it."""
        self.feed.returned(item.batch)

    def left(self, unacked: list[Item]) -> None:
        """The consumer that held this index left with ``unacked`` items."""
        self.redo.extendleft(reversed(unacked))
        self.holder = None
        self.left_at = time.monotonic()


class SharedOutlet:
    """First come, first served: one reader, whose batches go to whichever
    consumer is ready; what a leaving consumer had not acknowledged goes to
    the others first.  Epoch ends go to every connected consumer.

    Three promises hold whoever leaves, and when:

    * **Epochs stay whole.**  An epoch's end goes to a consumer only once
      every batch of that epoch (and before) was acknowledged: while one is
      out, its holder may leave, and it must go to a consumer still in that
      epoch, never to one told it ended.  So no consumer takes the next
      epoch's batches before every batch of this one was returned (a
      barrier, as a DDP step is anyway).
    * **The end waits.**  The data's end goes to a consumer only once every
      batch was acknowledged, none held and none waiting to be dealt again
      (a worker's error goes out at once, as ever).
    * **Fair shares.**  A consumer holds at most :meth:`share` batches
      unacknowledged, so one that attaches a moment after another still
      gets batches of a small data set.
    """

    def __init__(self, source: "ServedSource", feed: "BatchReader", skip: set[int]) -> None:
        self.source = source
        self.feed = feed
        #: guards everything below; waited on for a change (an ack, a hand-back, a take)
        self._cond = threading.Condition(threading.RLock())
        #: one taker of the inner feed at a time: the stream's order is the order taken
        self._taking = False
        #: batches handed back by consumers that left, to go out first (in order)
        self.redeal: collections.deque[Item] = collections.deque()
        #: per connection: the epoch of the batches it takes now (its epoch ends told)
        self._epoch_of: dict[Any, int] = {}
        #: per connection: batches it holds unacknowledged
        self._held: collections.Counter[Any] = collections.Counter()
        #: every batch dealt and not acknowledged (s -> (holder, epoch); holder None: in redeal)
        self._out: dict[int, tuple[Any, int]] = {}
        #: the epoch of the inner stream's next item
        self._epoch = 0
        #: the epoch ends the inner stream passed, by epoch, until every consumer was told
        self._ends: dict[int, EpochEnd] = {}
        #: the inner stream's end, once reached (the data's end or a failure)
        self._end: End | None = None
        self._s = 0
        #: items acknowledged past the prefix (their s); the prefix: every s below is acknowledged
        self._acked: set[int] = set()
        self.prefix = 0
        #: items the inner stream holds before the prefix that a resumed run must skip
        self.skip = skip
        self._items: dict[int, Any] = {}
        #: the feed's data ended (a consumer was handed the end)
        self.finished = False
        #: the position the dealing last waited at for MAX_AHEAD (see _stalled)
        self._stalled_at = -1

    def join(self, conn: Any) -> None:
        with self._cond:
            # the oldest epoch a batch is still out in: should its holder
            # leave, this consumer can take it (it is told that epoch's end after)
            self._epoch_of[conn] = min([self._epoch] + [e for _, e in self._out.values()])

    def share(self) -> int:
        """Batches a consumer may hold unacknowledged: its slots divided
        among the consumers attached, at least :data:`ARENA_CONSUMERS` of
        them, and at least :data:`SHARE_MIN` (under the lock)."""
        slots = self.source.slots
        return max(SHARE_MIN, -(-slots // max(ARENA_CONSUMERS, len(self._epoch_of))))

    def next(self, conn: Any, timeout: float) -> Item | End | None:
        src = self.source
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = self._ready(conn)
                if got is not None:
                    return got
                if src.error is not None:
                    return End(src.error)
                if self._may_take(conn):
                    # take from the inner feed, the lock released meanwhile
                    # (acknowledgements go on); no one else takes meanwhile
                    self._taking = True
                    self._cond.release()
                    try:
                        batch = _dequeue(src, self.feed, min(POLL_S, max(deadline - time.monotonic(), 0.0)))
                    finally:
                        self._cond.acquire()
                        self._taking = False
                        self._cond.notify_all()
                    if batch is not None:
                        got = self._taken(conn, batch)
                        if got is not None:
                            return got
                        continue
                    if time.monotonic() < deadline:
                        continue  # it waited for the feed already
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, POLL_S))

    def _ready(self, conn: Any) -> Item | End | None:
        """What ``conn`` may have now without taking from the feed (under the lock)."""
        e = self._epoch_of.get(conn)
        if e is None:
            return None  # it left
        if self._held[conn] < self.share():
            for i, item in enumerate(self.redeal):
                if self._out[item.s][1] <= e:
                    del self.redeal[i]
                    self._out[item.s] = (conn, self._out[item.s][1])
                    self._held[conn] += 1
                    self.source.counts.redealt[conn.label] += 1
                    return item
        if self._end is not None and self._end.error is not None:
            return self._end  # a failure goes out at once
        if e < self._epoch:
            if not self._out_until(e):
                self._epoch_of[conn] = e + 1
                end = self._ends[e]
                self._prune()
                return Item(-1, end)
            return None
        if self._end is not None and not self._out:
            self.finished = True
            return self._end  # stays: every later call ends too
        return None

    def _prune(self) -> None:
        """Forget the epoch ends no consumer, present or to come, is still to be told (under the lock)."""
        if self._ends:
            low = min([self._epoch, *self._epoch_of.values()] + [e for _, e in self._out.values()])
            for e in [e for e in self._ends if e < low]:
                del self._ends[e]

    def _out_until(self, epoch: int) -> bool:
        """Is a batch of ``epoch`` or before still out (held unacknowledged,
        or waiting to be dealt again)?  Should it be the asking consumer's
        own, it may still leave, and then only a consumer in that epoch may
        take it: one told the epoch's end must not."""
        return any(e <= epoch for _, e in self._out.values())

    def _may_take(self, conn: Any) -> bool:
        if self._s - self.prefix >= MAX_AHEAD:
            self._stalled()
            return False
        return (
            not self._taking and self._end is None and self._epoch_of.get(conn) == self._epoch
            and self._held[conn] < self.share()
        )

    def _stalled(self) -> None:
        """(Under the lock.)  The dealing is MAX_AHEAD past the oldest batch
        not acknowledged, and waits for it: said once for each such batch."""
        if self._stalled_at == self.prefix:
            return
        self._stalled_at = self.prefix
        holder = self._out.get(self.prefix, (None, 0))[0]
        who = f"consumer {holder.label}" if holder is not None else "no consumer (it waits to be dealt again)"
        logger.warning(
            "source %r: %s holds batch %d unacknowledged while the others took %d batches past it: the "
            "dealing waits for it (at most MAX_AHEAD, %d, are kept acknowledged past the position)",
            self.source.name, who, self.prefix, self._s - self.prefix - 1, MAX_AHEAD,
        )

    def _taken(self, conn: Any, batch: Any) -> Item | None:
        """The inner feed gave ``batch`` (or its end) to ``conn`` (under the lock):
        the item ``conn`` gets, or None when it is to look again."""
        if isinstance(batch, End):
            self._end = batch
            self._cond.notify_all()
            return None
        s = self._s
        self._s += 1
        # only its size, for the position: its arrays (a worker's slot,
        # maybe) go with the consumer's acknowledgement, not with the
        # oldest batch any consumer still holds
        self._items[s] = batch if type(batch) is EpochEnd else Batch((), batch.n)
        if type(batch) is EpochEnd:
            # told to each consumer once no other holds a batch of this epoch;
            # the stream moves past it at once (a resume's skip included)
            self.skip.discard(s)
            self._ends[self._epoch] = batch
            self._epoch += 1
            self._ack(s)
            self._cond.notify_all()
            return None
        if s in self.skip:
            # acknowledged before a resume: not dealt again
            self.skip.discard(s)
            self._ack(s)
            self.feed.count_dropped("resume", getattr(batch, "n", 0))
            return None
        self._out[s] = (conn, self._epoch)
        self._held[conn] += 1
        return Item(s, batch)

    def acked(self, item: Item) -> None:
        if item.s < 0:
            return  # an epoch end told to one consumer: the stream passed it
        with self._cond:
            holder, _ = self._out.pop(item.s, (None, 0))
            if holder is not None:
                self._held[holder] -= 1
            self._ack(item.s)
            self._cond.notify_all()

    def _ack(self, s: int) -> None:
        self._acked.add(s)
        while self.prefix in self._acked:
            self._acked.discard(self.prefix)
            self.feed.returned(self._items.pop(self.prefix))
            self.prefix += 1

    def left(self, conn: Any, unacked: list[Item]) -> None:
        with self._cond:
            self._epoch_of.pop(conn, None)
            self._held.pop(conn, None)
            batches = [i for i in unacked if i.s >= 0]
            for i in batches:
                _, e = self._out.get(i.s, (None, self._epoch))
                self._out[i.s] = (None, e)
            self.redeal.extendleft(reversed(batches))
            self._prune()
            self._cond.notify_all()

    def drop(self) -> None:
        """At stop: let go of the batches waiting to be dealt again."""
        with self._cond:
            for item in self.redeal:
                self._out.pop(item.s, None)
            self.redeal.clear()
            self._cond.notify_all()

    @property
    def lock(self) -> threading.Condition:
        """Held, nothing is acknowledged: the inner position and
        :meth:`acked_after` read under it agree (reentrant)."""
        return self._cond

    def acked_after(self) -> list[int]:
        """Items acknowledged past the prefix (relative to it), for a state:
        those acknowledged in this run, and those a resume is still to skip
        (acknowledged in a run before; 0 when the prefix waits at one)."""
        with self._cond:
            return sorted(s - self.prefix for s in self._acked | self.skip)


class ServedSource:
    """A source wired on the service's coordinator, and its outlets."""

    def __init__(
        self,
        terms: SourceTerms,
        coordinator: "GlobalCoordinator",
        feeds: list["BatchReader"],
    ) -> None:
        self.terms = terms
        self.name = terms.name
        self.coordinator = coordinator
        #: it has a position (deterministic): fixed when it is wired
        self._resumable = coordinator.open_source(terms.name).resumable
        self.counts = _Counts()
        self.error: BaseException | None = None
        self.stopped = False
        self._lock = threading.Lock()
        #: notified when a consumer is released (see claim)
        self._released = threading.Condition(self._lock)
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
            feed.use_memory(self.arena)

    def _arena_slots(self, slot_bytes: int) -> int:
        """How many batches of ``slot_bytes`` the arena holds: what every
        consumer's slots lend out, and what each reader holds besides."""
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
                most = self.terms.max_consumers
                if most is not None and self.connected >= most:
                    raise ValueError(
                        f"source {self.name!r}: {self.connected} consumers are attached, the most it serves at "
                        f"once (max_consumers={most}): attach once one leaves, or serve it with a larger "
                        "max_consumers"
                    )
                self.shared.join(conn)
                self.connected += 1
                return self.shared
            if index is None:
                free = [o for o in self.outlets if o.holder is None]
                if not free and self._leaving():
                    # (as below: an index whose consumer is leaving is free in a moment)
                    self._released.wait_for(
                        lambda: any(o.holder is None for o in self.outlets) or not self._leaving(), LEAVING_S
                    )
                    free = [o for o in self.outlets if o.holder is None]
                if not free:
                    raise ValueError(
                        f"source {self.name!r}: all {len(self.outlets)} consumer indexes are attached"
                    )
                outlet = free[0]
            else:
                outlet = self.outlets[index]
                # A consumer that is leaving (its connection closed: after
                # its bye, its attachment's stop() returned) frees its index
                # once the service took back what it held: a process that
                # detached and attaches the index again waits for that, it
                # is not refused.  One still attached is refused at once.
                holder = outlet.holder
                if holder is not None and holder.closed.is_set():
                    self._released.wait_for(lambda: outlet.holder is not holder, LEAVING_S)
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

    def _leaving(self) -> bool:
        """(Under the lock.)  Is an index's consumer leaving (its connection
        closed, not yet let go of)?"""
        return any(o.holder is not None and o.holder.closed.is_set() for o in self.outlets)

    def release(self, conn: Any, outlet: IndexOutlet | SharedOutlet, unacked: list[Item]) -> None:
        """``conn`` left; ``unacked``: what it had not acknowledged, in order."""
        # (a peer can leave holding batches as often as it attaches: the
        # connection's log of closes, throttled, tells it)
        warn = logger.warning if conn.closures is None else conn.closures.departure
        with self._lock:
            self.connected -= 1
            self._released.notify_all()
            if isinstance(outlet, SharedOutlet):
                outlet.left(conn, unacked)
                self.counts.retire(conn.label)
                # (an epoch's end it was told and had not read is no batch: nothing is dealt again)
                held = sum(1 for i in unacked if i.s >= 0)
                if held:
                    warn(
                        "source %r: consumer %s left with %d batches unacknowledged: dealt to the others",
                        self.name, conn.label, held,
                    )
            else:
                outlet.left(unacked)
                if unacked and self.error is None and not self.stopped:
                    warn(
                        "source %r: consumer %d left with %d items unacknowledged: kept for its "
                        "return (within %.3g s)", self.name, outlet.index, len(unacked), self.terms.grace_period,
                    )

    @property
    def failure(self) -> BaseException | None:
        """Why the source failed (a consumer index that did not come back, a
        fetcher error of its workers), None while it has not."""
        if self.error is not None:
            return self.error
        return self.feeds[0].error

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
        self.coordinator.request_stop_coordinator(self.name)

    def drop_held(self) -> None:
        """At stop: let go of the batches waiting to be dealt again (they
        keep the slots of consumers that left mapped)."""
        for o in self.outlets:
            o.redo.clear()
        if self.shared is not None:
            self.shared.drop()
        self.arena.close()

    # -- state -----------------------------------------------------------------------
    @property
    def resumable(self) -> bool:
        """Can it save and load a state (``deterministic=True``)?"""
        return self._resumable

    def state_dict(self) -> dict[str, Any]:
        if not self._resumable:
            raise ValueError(
                f"source {self.name!r} is not deterministic: a served source has a position to save and "
                "resume only with serve_source(..., deterministic=True)"
            )
        if self.shared is None:
            inner = self.coordinator.state_dict(self.name)
            return {"service_version": 1, "source": self.name, "inner": inner}
        # One moment for both: an acknowledgement moves the inner position
        # (feed.delivered, under the outlet's lock) and what is acknowledged
        # after it; read apart, a position before an acknowledgement and the
        # list after it skip batches still out and deal acknowledged ones again.
        with self.shared.lock:
            inner = self.coordinator.state_dict(self.name)
            return {"service_version": 1, "source": self.name, "inner": inner,
                    "acked_after": self.shared.acked_after()}
