"""Lanes: the workers' chunks read in turns, through a stage, dealt to the
nets in turn, with the position after every batch (what ``state_dict``
saves).

Each worker has a lane, a small bounded queue of its own.  The chunk stream
of the source is lane 0's first chunk, lane 1's first, ..., then every
lane's second, a lane that ended being skipped.  Whoever needs data (a net's
enqueuer, or the net's own thread) advances the stream under one lock: it
takes the head of the lane whose turn it is and hands it to the stage, which
cuts it at batch boundaries (or shuffles it) and deals batch *i* to net
*i mod k*.

:class:`LaneDealer` is composed of parts it is given, each owning its state
(:func:`~blobfeed.feeders.dealing.make_dealer` chooses them once, from the
wiring options):

* the turn policy (:mod:`.turns`): strict round robin, which waits for the
  worker whose turn it is (``deterministic=True``), or first-ready;
* the stage (:mod:`.stages`): batches cut from the chunks as views, or a
  shuffle buffer; it also says what a position is (:mod:`.positions`);
* how batches go out (:mod:`.rounds`): at once, or in equal rounds, one
  batch per net (``equal=True``).

The dealer itself owns the lanes (bounded in chunks and in bytes), the nets'
outboxes (bounded in samples: how far the stream runs ahead of the slowest
net), the stream's place (epoch, batches, offset into the head chunk, each
worker's calls), the end of epochs and of the data, errors, and a resume's
first chunk.

An error of a worker is an item of its lane: it surfaces when the turns
reach it, after every batch that comes before it in the stream, whatever
the timing.

Epochs: a worker whose data ended while another epoch follows puts an
epoch marker in its lane and goes on.  The stream treats it as the end of
that lane for the epoch; once every lane reached its marker, the epoch's
last (partial) batch is dealt, every net gets an :class:`EpochEnd`, and the
next epoch starts afresh: round robin from the first worker, as a run
started in that epoch would.  So a position is always "this epoch, these
calls of each worker in it".
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
import threading
from typing import Any, Callable, Sequence

from ...errors import EndOfInput, FetcherError
from ..chunks import Chunk, EpochEnd
from ..pulling import POLL_S
from .base import DealerStats, DropCounter
from .positions import READABLE_VERSIONS, STATE_VERSION, Position, as_dict
from .rounds import Direct
from .stages import Cut, Stage
from .turns import StrictTurns, Turns

__all__ = ["BIG_BATCH_BYTES", "LaneDealer", "NetOutbox", "READABLE_VERSIONS", "STATE_VERSION", "default_outbox_samples"]

logger = logging.getLogger("blobfeed.feeders")

#: batches of at least this many bytes are big: with several nets, one of
#: them waits per outbox by default, not two
BIG_BATCH_BYTES = 1 << 20


def default_outbox_samples(batch_size: int, nets: int, sample_bytes: int = 0) -> int:
    """How far a lane dealer runs ahead of the slowest of ``nets`` nets by
    default, in samples waiting in one outbox (``sample_bytes``: the bytes of
    one sample, 0 when not known yet).

    Two batches, but one with several nets and big batches
    (:data:`BIG_BATCH_BYTES`).  Each net's feed holds a batch staged and its
    device queue more, so a second big batch per outbox bought no throughput
    (S1 served deterministically: the same batches/s with 1 and 2, 70 MB
    less PSS), while every piece waiting in an outbox holds its chunk --
    with process workers, one of the worker's shared-memory slots, which *k*
    full outboxes take from the worker *k* batches at a time.  Small batches
    keep two: they cost little memory, and a deeper outbox means fewer
    hand-offs between the nets.
    """
    if nets > 1 and batch_size * sample_bytes >= BIG_BATCH_BYTES:
        return batch_size
    return 2 * batch_size


#: batches a net's prefetching feed holds past its outbox (one in its device
#: queue, one staged behind it): a source read without prefetch
#: (``prefetch=False``) gets them in its outboxes instead, so a net may run
#: as far ahead of the others as with prefetch
FEED_AHEAD_BATCHES = 2


class _Ended:
    """A lane's marker: its worker raised StopIteration."""


_ENDED = _Ended()


class _NextEpoch:
    """A lane's marker: its worker's data ended for this epoch; it goes on
    with the next one (``state``: its stateful fetcher's state then)."""

    __slots__ = ("state",)

    def __init__(self, state: Any = None) -> None:
        self.state = state


_NEXT_EPOCH = _NextEpoch()


class _Failed:
    """A lane's marker: its worker's error, at its place in the stream
    (``state``: a random-access source's unit whose read failed)."""

    def __init__(self, error: BaseException, state: Any = None) -> None:
        self.error = error
        self.state = state


class NetOutbox:
    """One net's end of a :class:`LaneDealer`: the pieces of its batches.

    A :class:`~blobfeed.feeders.dealing.base.Reader`.
    """

    def __init__(self, dealer: "LaneDealer", index: int) -> None:
        self._dealer = dealer
        self.index = index
        self.pieces: collections.deque[Chunk] = collections.deque()
        self.samples = 0
        #: global index of this net's next batch that run() has not returned
        self.next_batch = index
        #: batches dealt to this net to be thrown away (a resume: before its position)
        self.skip_until = index
        #: epochs whose end run() has reported to this net (EndOfEpoch raised)
        self.epoch = 0
        #: ends of epochs before this one are not dealt (a resume: it had them)
        self.marks_from = 0
        #: its net's feed has an enqueuer (the thread that waits in wait_for_item)
        self.prefetch = True

    def get_nowait(self) -> tuple[bool, Chunk | None]:
        return self._dealer.take(self)

    def wait_for_item(self, timeout: float | None = None) -> bool:
        return self._dealer.wait_for(self, timeout)

    def qsize(self) -> int:
        return self._dealer.queued()

    @property
    def pulled(self) -> bool:
        """This net's enqueuer receives the stream's chunks (see pulling)."""
        return self._dealer._puller is not None

    def starved_share(self) -> float | None:
        """A pulled stream: the share of the time since the last call that
        its enqueuer waited for the workers (None at the first call)."""
        puller = self._dealer._puller
        return puller.starved_share() if puller is not None else None

    def returned(self) -> None:
        """``Net.run()`` returned this net's next batch (its position moves on).

        Per batch, so no lock: only the net's own thread writes its
        ``next_batch``, and an int store is atomic; the dealer prunes the
        positions as it records new ones.
        """
        self.next_batch += len(self._dealer.outboxes)

    def epoch_returned(self, dropped: int = 0) -> None:
        """``Net.run()`` reported the end of this net's current epoch, after
        ``dropped`` batches of it that its feed dropped (``drop_last``)."""
        self._dealer.epoch_returned(self, dropped)


class LaneDealer:
    """The chunk stream of a source read through lanes.  Thread-safe.

    Args:
        source: the source's name.
        batch_size: the one batch size of every net (the stream cuts batches).
        axes: each blob's batch axis.
        capacity: bounds the chunks waiting in all lanes together (the
            source's ``max_buffered_batches``, as its internal queue is
            bounded), shared equally by the lanes, two at least each.
        outbox_samples: how far the stream runs ahead of the slowest net
            (samples waiting in one outbox), so a net that stops taking cannot
            make the others grow memory without bound: they wait for it, as
            solvers fed by Caffe's DataReader do.  None: two batches, one
            with several nets and big batches, judged by the first chunk's
            bytes (:func:`default_outbox_samples`): every piece waiting in
            an outbox holds its chunk, with process workers one of the
            worker's few shared-memory slots.
        on_error: the source's failure, called when the stream reaches a
            worker's error (outside the lock).
        on_dropped: ``(reason, samples)``, for samples thrown away on purpose
            (a resume's prefix, reason ``"resume"``; an equal share's
            ``"equal"`` and ``"drop_last"``), under the lock.
        turns: the turn policy (default :class:`~.turns.StrictTurns`,
            ``deterministic=True``; :class:`~.turns.FirstReadyTurns`:
            whichever lane has a chunk, from the one whose turn it is).
        stage: what the head chunk goes through (default :class:`~.stages.Cut`;
            :class:`~.stages.Shuffled`: a shuffle buffer).
        rounds: how the batches go out (default :class:`~.rounds.Direct`;
            :class:`~.rounds.EqualRounds`: every net gets the same number
            of batches per epoch).  Wired to the nets at :meth:`start`.
        max_bytes: bounds the bytes of the chunks waiting in all lanes
            together (``max_buffered_bytes``; None: counted, not bounded),
            shared equally by the lanes; a chunk always enters a lane that
            holds none (so a worker whose turn it is is never blocked).
            The shuffle buffer's rows are bounded by its size in samples.
    """

    def __init__(
        self,
        source: str,
        batch_size: int,
        axes: Sequence[int],
        capacity: int,
        outbox_samples: int | None,
        on_error: Callable[[BaseException], None],
        *,
        on_dropped: DropCounter | None = None,
        turns: Turns | None = None,
        stage: Stage | None = None,
        rounds: Direct | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.source = source
        self.batch_size = batch_size
        self.axes = tuple(axes)
        self.capacity = capacity
        self.lane_capacity = max(2, capacity)
        self._lane_low = self.lane_capacity // 2
        self.max_bytes = max_bytes
        self.lane_bytes = sys.maxsize if max_bytes is None else max_bytes
        self._lane_bytes_low = self.lane_bytes // 2
        #: per lane: the bytes of each chunk in it (in step with its chunks), and their sum
        self._sizes: dict[int, collections.deque[int]] = {}
        self._lane_bytes: dict[int, int] = {}
        #: bytes of the chunks in all lanes
        self._queued_bytes = 0
        if outbox_samples is not None and (type(outbox_samples) is not int or outbox_samples < 1):
            raise ValueError(f"source {source!r}: outbox_samples must be an int >= 1, got {outbox_samples!r}")
        #: what the wiring asked for (None: by the number of nets, at start)
        self._outbox_asked = outbox_samples
        #: the default outbox waits for the first chunk's size (set at start)
        self._outbox_sizing = False
        self.outbox_samples = default_outbox_samples(batch_size, 1) if outbox_samples is None else outbox_samples
        #: a net reads it without prefetch: the default outboxes hold what its feed would
        self._bare = False
        self._on_error = on_error
        self._on_dropped = on_dropped
        self._lock = threading.Lock()
        self._items = threading.Condition(self._lock)  # nets wait here
        self._room = threading.Condition(self._lock)  # workers wait here
        #: workers waiting in put() for room (a notify of nobody is skipped:
        #: the stream frees room once a chunk)
        self._room_waiters = 0
        self._lanes: dict[int, collections.deque[Any]] = {}
        #: chunks in all lanes, and their samples (kept, not counted: the
        #: depth is read per batch)
        self._lane_chunks = 0
        self._lane_n = 0
        self.outboxes: list[NetOutbox] = []
        # -- the parts (see the module docstring)
        self._turns = StrictTurns() if turns is None else turns
        self._stage = Cut() if stage is None else stage
        self._stage.bind(self)
        #: how batches go out: directly until start() wires the given part to the nets
        self._rounds_asked = Direct() if rounds is None else rounds
        self._rounds = Direct().wire(source, self.outboxes, on_dropped)
        #: log lines to write once the lock is released: (format, args)
        self._notes: list[tuple[Any, ...]] = []
        self._epoch = 0
        self._closed = False
        self._error: BaseException | None = None  # reached in the stream
        self._offset = 0  # samples of the head chunk of the lane whose turn it is already gone
        #: of ``_offset``, samples a resume must still count as dropped (the
        #: regenerated head chunk's prefix, which the nets had already), and
        #: the worker whose chunk that is
        self._prefix = 0
        self._prefix_lane = -1
        self._batch = 0  # global index of the batch being filled
        #: per worker: calls whose chunk is wholly dealt, and the fetcher's
        #: state after the last of them (a stateful fetch_fun)
        #: (lists by lane index, so that recording a position is two C copies)
        self._calls: list[int] = []
        self._states: list[Any] = []
        #: per lane: its fetcher's state at the next epoch's start, once its epoch ended
        self._next_states: list[Any] = []
        self._lane_of: dict[int, int] = {}
        #: batches completed -> the position after them (the stage says
        #: which are kept); recorded through ``_record``, bound once
        self._positions = self._stage.positions(self._position, self.outboxes)
        self._record = self._positions.record
        self._eof = False
        self._started = False
        self._lanes_closed = False
        self._close_reason: BaseException = EndOfInput(f"source {source!r}: stopped")
        #: receives the workers' chunks in the thread that waits for them
        #: (:mod:`blobfeed.feeders.pulling`; see IndexedDealer.use_puller)
        self._puller: Any = None

    @property
    def strict(self) -> bool:
        """Strict round robin (``deterministic=True``)."""
        return self._turns.strict

    @property
    def resumable(self) -> bool:
        """Only a strict stream is a function of the wiring."""
        return self._turns.resumable

    @property
    def closed(self) -> bool:
        return self._lanes_closed

    @property
    def epoch(self) -> int:
        """The epoch the stream is in (after a load: the one it resumes in)."""
        return self._epoch

    @property
    def worker_ids(self) -> list[int]:
        """The lanes' worker ids, in round-robin order."""
        return list(self._turns.order)

    # -- wiring, before start ---------------------------------------------------
    def add_lanes(self, worker_ids: Sequence[int]) -> None:
        with self._lock:
            for wid in worker_ids:
                self._lanes[wid] = collections.deque()
                self._sizes[wid] = collections.deque()
                self._lane_bytes[wid] = 0
                self._turns.add(wid)
                self._lane_of[wid] = len(self._calls)
                self._calls.append(0)
                self._states.append(None)
                self._next_states.append(None)
            # Deep lanes matter: a worker that waits a whole GIL switch
            # interval (5 ms: hundreds of small chunks) must not starve the
            # round robin, as it would not starve the internal queue.
            lanes = len(self._turns.order)
            self.lane_capacity = max(2, self.capacity // lanes)
            self._lane_low = self.lane_capacity // 2
            if self.max_bytes is not None:
                self.lane_bytes = max(1, self.max_bytes // lanes)
                self._lane_bytes_low = self.lane_bytes // 2
            if not self._started and self._batch == 0:
                self._positions.reset(lanes)

    def add_net(self, prefetch: bool = True) -> NetOutbox:
        """A new net's outbox (before start); ``prefetch``: its feed holds
        batches of its own ahead (else its outbox holds them: see
        :data:`FEED_AHEAD_BATCHES`)."""
        with self._lock:
            if self._started:
                raise ValueError(
                    f"source {self.source!r} is deterministic and already running: "
                    "wire every net before start()"
                )
            box = NetOutbox(self, len(self.outboxes))
            box.prefetch = prefetch
            self.outboxes.append(box)
            if not prefetch and self._outbox_asked is None and not self._bare:
                self._bare = True
                self.outbox_samples += FEED_AHEAD_BATCHES * self.batch_size
            return box

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._rounds = self._rounds_asked.wire(self.source, self.outboxes, self._on_dropped)
                # several nets: the outbox may shrink once a chunk tells the sample size
                self._outbox_sizing = self._outbox_asked is None and len(self.outboxes) > 1
                self._record(self._batch)

    # -- workers -----------------------------------------------------------------
    def put(self, worker_id: int, chunk: Chunk, nbytes: int = 0) -> bool:
        """Append ``chunk`` (``nbytes`` bytes) to the worker's lane, waiting
        while the lane is full (in chunks, or in bytes unless it holds no
        chunk); False once closed."""
        with self._lock:  # (_room's lock, entered directly: a Condition's `with` is two Python calls)
            lane = self._lanes[worker_id]
            sizes = self._sizes[worker_id]
            # (the hook only when the lane is full: put runs once a chunk)
            while not self._lanes_closed and (
                len(lane) >= self.lane_capacity
                or (sizes and self._lane_bytes[worker_id] + nbytes > self.lane_bytes)
            ) and self._may_wait(worker_id, chunk):
                self._room_waiters += 1
                try:
                    self._room.wait()
                finally:
                    self._room_waiters -= 1
            if self._lanes_closed:
                return False
            if self._outbox_sizing and nbytes and chunk.n:
                self._outbox_sizing = False
                self.outbox_samples = default_outbox_samples(self.batch_size, len(self.outboxes), nbytes // chunk.n) + (
                    FEED_AHEAD_BATCHES * self.batch_size if self._bare else 0
                )
            if self.sorted_lanes:
                i, j = self._insert_at(lane, sizes, chunk)
                lane.insert(i, chunk)
                sizes.insert(j, nbytes)
            else:
                i = len(lane)
                lane.append(chunk)
                sizes.append(nbytes)
            self._lane_bytes[worker_id] += nbytes
            self._queued_bytes += nbytes
            self._lane_chunks += 1
            self._lane_n += chunk.n
            if i == 0:
                self._items.notify_all()
            return True

    # hooks of put (a random-access source's dealer has its own)
    def _may_wait(self, worker_id: int, chunk: Chunk) -> bool:
        """May ``chunk`` wait for room in its full lane?"""
        return True

    #: lanes are kept in an order of the dealer's own (:meth:`_insert_at`);
    #: False: a chunk goes at its lane's end (not asked, once a chunk)
    sorted_lanes = False

    def _insert_at(self, lane: collections.deque[Any], sizes: collections.deque[int], chunk: Chunk) -> tuple[int, int]:
        """Where ``chunk`` goes: its index in the lane and in ``sizes``
        (one entry per chunk of the lane), when :attr:`sorted_lanes`.  Here: at the end."""
        return len(lane), len(sizes)

    def sink(self, worker_id: int) -> Callable[[Chunk, int], bool]:
        return functools.partial(self.put, worker_id)

    def put_error(self, worker_id: int, error: BaseException) -> None:
        """The worker failed: the error takes its place in the stream."""
        self._mark(worker_id, _Failed(error))

    def finish(self, worker_id: int) -> None:
        """The worker raised StopIteration: its lane ends after what it holds."""
        self._mark(worker_id, _ENDED)

    def end_of_input(self) -> None:
        """Every lane ends with its own marker: nothing more to do."""

    def end_epoch(self, worker_id: int, state: Any = None) -> bool:
        """The worker's data ended for this epoch and it starts the next one
        (``state``: its stateful fetcher's state at that start).  False once
        the stream is closed (the worker must stop)."""
        return self._mark(worker_id, _NEXT_EPOCH if state is None else _NextEpoch(state))

    def _mark(self, worker_id: int, item: Any) -> bool:
        with self._lock:
            if self._lanes_closed:
                return False
            self._lanes[worker_id].append(item)
            self._items.notify_all()
            return True

    def close(self, reason: BaseException | None, *, in_order: bool = False) -> int:
        """Stop or failure of the source: wake everyone; nets then get
        ``reason``.  ``in_order`` (the stream reached an error of a worker):
        the lanes and what the stage and the rounds hold (what comes after
        it or could not be dealt before it) are dropped and the outboxes
        (what comes before) are still handed out.  Returns the samples
        discarded.  Idempotent."""
        try:
            return self._close(reason, in_order)
        finally:
            if self._puller is not None and not in_order:
                # (outside our lock: the puller holds its own while it puts here)
                self._puller.release()  # nothing is pulled any more; a pull waiting now returns

    def _close(self, reason: BaseException | None, in_order: bool) -> int:
        with self._lock:
            self._lanes_closed = True
            lost = self._lane_samples()
            for lane in self._lanes.values():
                lane.clear()
            for sizes in self._sizes.values():
                sizes.clear()
            self._lane_bytes = dict.fromkeys(self._lane_bytes, 0)
            self._lane_chunks = self._lane_n = self._queued_bytes = 0
            self._offset = self._prefix = 0
            lost += self._stage.clear()
            # an unfinished round of equal shares never goes out (an error
            # in the stream ends the epoch short too)
            lost += self._rounds.clear()
            self._room.notify_all()
            self._items.notify_all()
            if in_order:
                return lost
            if not self._closed:
                self._closed = True
                if reason is not None:
                    self._close_reason = reason
            for box in self.outboxes:
                lost += sum(p.n for p in box.pieces)
                box.pieces.clear()
                box.samples = 0
            return lost

    # -- what it holds -----------------------------------------------------------
    def _lane_samples(self) -> int:
        """Samples in the lanes not yet dealt (under the lock)."""
        return self._lane_n - self._offset + self._prefix

    def stats(self) -> DealerStats:
        with self._lock:
            held = self._lane_samples() + sum(b.samples for b in self.outboxes) + self._rounds.held
            held += self._stage.held()
            return DealerStats(held, self._lane_chunks, self.capacity, self._queued_bytes, self.max_bytes)

    def queued(self) -> int:
        """Chunks waiting in the lanes (what ``capacity`` bounds; pieces
        already dealt to a net and rows in the shuffle buffer are held, not
        waiting); a stream received by its enqueuer counts one more for
        each worker process with a message waiting in its pipe (its
        results wait there, not in the lanes)."""
        puller = self._puller
        return self._lane_chunks + (puller.waiting() if puller is not None else 0)

    def queued_bytes(self) -> int:
        """Bytes of the chunks waiting in the lanes (what ``max_bytes`` bounds)."""
        return self._queued_bytes

    # -- nets --------------------------------------------------------------------
    def take(self, box: NetOutbox) -> tuple[bool, Chunk | None]:
        error = None
        with self._lock:
            while not box.pieces and not self._closed and self._error is None:
                step = self._advance()
                if step is None:
                    break
                if isinstance(step, BaseException):
                    error = step
                    break
            piece = box.pieces.popleft() if box.pieces else None
            # Wake the enqueuers only for what this thread leaves behind
            # (pieces of other nets, or more of its own), or when this
            # outbox was full (room for the stream to go on): a wake-up per
            # piece would be a GIL hand-off per piece.
            was_full = piece is not None and box.samples >= self.outbox_samples
            if box.pieces or was_full or (len(self.outboxes) > 1 and any(b.pieces for b in self.outboxes)):
                self._items.notify_all()
            exc: BaseException | None = None
            if piece is not None:
                box.samples -= piece.n
            elif self._error is not None:
                exc = self._error
            elif self._closed:
                exc = self._close_reason
            elif self._eof:
                if box.skip_until >= self._batch + len(self.outboxes):
                    # a resumed state said this net had batches the data does
                    # not hold (a net's next batch is at most a round past the
                    # data's last: its own in the round that never came)
                    exc = error = FetcherError(
                        f"source {self.source!r}, net {box.index}: the resumed state says this net had "
                        f"returned the batches before {box.skip_until}, but the data ended after {self._batch} "
                        "batches: the data changed since the state was saved, or the state is damaged"
                    )  # the source's error (its health, the other nets), not only this net's
                else:
                    exc = EndOfInput(f"source {self.source!r}: every worker finished")
            notes = self._notes
            if notes:
                self._notes = []
        if notes:
            for note in notes:
                logger.info(*note)  # never under the lock: a slow handler would stall every net
        if error is not None:
            self._on_error(error)  # outside the lock: it closes the source's lanes
        if piece is not None:
            return True, piece
        if exc is not None:
            raise exc.with_traceback(None)
        return False, None

    def wait_for(self, box: NetOutbox, timeout: float | None) -> bool:
        def ready() -> bool:
            return (bool(box.pieces) or self._closed or self._error is not None or self._eof
                    or self._can_advance())

        puller = self._puller
        if puller is not None:
            with self._lock:
                if ready():
                    return True
            # the chunks come in this thread (False: nothing to pull now)
            if puller.pull(timeout):
                with self._lock:
                    return ready()
            if not puller.closed:
                # between a worker handed over and its replacement added:
                # the next pull must not wait for a notify that never comes
                timeout = POLL_S if timeout is None else min(timeout, POLL_S)
        with self._lock:
            return self._items.wait_for(ready, timeout)

    def stalled_by(self, box: NetOutbox) -> tuple[int, int] | None:
        """Why ``box``'s net has nothing while the stream is held up by a
        sibling: ``(index, samples)`` of the net whose turn it is, whose full
        outbox (``samples`` dealt to it and not taken) stops the stream;
        None when ``box`` has pieces, the stream can go on, or it ended."""
        with self._lock:
            if box.pieces or self._closed or self._error is not None or self._eof or len(self.outboxes) < 2:
                return None
            turn = self.outboxes[self._batch % len(self.outboxes)]
            if turn is box or self._outbox_has_room():
                return None
            return turn.index, turn.samples

    def epoch_returned(self, box: NetOutbox, dropped: int) -> None:
        with self._lock:
            box.next_batch += dropped * len(self.outboxes)
            box.epoch += 1

    # -- the stream, under the lock ----------------------------------------------
    def _can_advance(self) -> bool:
        """Would :meth:`_advance` deal something now?  (What a waiting reader
        waits for: it must mirror ``_advance``'s choice of lane, or a reader
        sleeps while another worker's lane could be dealt.)"""
        turns = self._turns
        if self._eof or not turns.order:
            return False
        if turns.ready(self._lanes):
            return self._outbox_has_room()
        if not turns.all_ended():
            return False  # the lanes still going have nothing yet (strict: the one whose turn it is)
        # every lane ended: the end can be dealt (the stage's rest as room allows)
        return not self._stage.held() or self._outbox_has_room()

    def _outbox_has_room(self) -> bool:
        box = self.outboxes[self._batch % len(self.outboxes)]
        return box.samples < self.outbox_samples or self._batch < box.skip_until

    def _advance(self) -> Any:
        """Deal what the next lane's head allows.  Returns None when it must
        wait (that worker has nothing yet, or the outbox is full), the error
        when the stream reached one, else True."""
        turns = self._turns
        if self._eof or not turns.order:
            return None
        wid = turns.turn(self._lanes)
        if wid is None:
            if not turns.all_ended():
                return None
            if self._stage.held():
                return self._stage.drain()
            if not turns.all_done():
                return self._next_epoch()
            return self._end()
        lane = self._lanes[wid]
        if not lane:
            return None
        head = lane[0]
        if head is _ENDED or type(head) is _NextEpoch:
            if self._prefix and wid == self._prefix_lane:
                return self._fail_state(
                    f"state['position']['offset'] is {self._offset}, but worker {wid} has no "
                    f"chunk at call {self._calls[self._lane_of[wid]]} any more (its data ended)"
                )
            lane.popleft()
            turns.lane_ended(wid, head is _ENDED)
            if isinstance(head, _NextEpoch) and head.state is not None:
                # the position's state once the next epoch starts (its calls at 0)
                self._next_states[self._lane_of[wid]] = head.state
            turns.passed()
            self._room.notify_all()
            return True
        if isinstance(head, _Failed):
            self._error = head.error
            self._items.notify_all()
            return head.error
        if not self._outbox_has_room():
            return None
        if self._prefix:
            bad = self._drop_prefix(head)
            if bad is not None:
                return bad
        return self._stage.feed(wid, head, lane)

    def _drop_prefix(self, chunk: Chunk) -> BaseException | None:
        """A resume's first chunk: its first ``offset`` samples were dealt
        before the state was taken.  They are counted as dropped; an offset
        the regenerated chunk does not have is the state's error."""
        if chunk.worker_id != self._prefix_lane or self._offset >= chunk.n:
            return self._fail_state(
                f"state['position']['offset'] is {self._offset}, but the chunk it points into "
                f"(worker {self._prefix_lane}) is worker {chunk.worker_id}'s call {chunk.seq} "
                f"of {chunk.n} samples"
            )
        self._dropped_on_resume(self._prefix)
        self._prefix = 0
        return None

    def _fail_state(self, why: str) -> BaseException:
        """The loaded state does not fit what the fetchers return now: the
        stream's error (under the lock)."""
        cause = ValueError(why)
        err = FetcherError(f"source {self.source!r}: the loaded state does not fit this fetch_fun: {why}")
        err.__cause__ = cause
        self._error = err
        self._items.notify_all()
        return err

    def _dropped_on_resume(self, n: int) -> None:
        """Samples a resume fetched again and throws away: counted at once,
        under the lock, so no scrape sees them neither held nor dropped (the
        hub's lock is taken after ours, never before)."""
        if self._on_dropped is not None:
            self._on_dropped("resume", n)

    def _consumed(self, wid: int, chunk: Chunk, lane: collections.deque[Any]) -> None:
        """``chunk``, the head of ``wid``'s lane, is wholly dealt (popped already)."""
        self._lane_chunks -= 1
        self._lane_n -= chunk.n
        nbytes = self._sizes[wid].popleft()
        self._queued_bytes -= nbytes
        left = self._lane_bytes[wid] = self._lane_bytes[wid] - nbytes
        i = self._lane_of[wid]
        self._calls[i] = chunk.seq + 1
        if chunk.state is not None:
            self._states[i] = chunk.state
        self._turns.passed()
        # A worker blocked on its full lane sleeps until the lane is half
        # empty, then refills it in a burst: one wake-up (a GIL hand-off) per
        # half lane instead of one per chunk, as the internal queue does.
        if self._room_waiters and len(lane) <= self._lane_low and left <= self._lane_bytes_low:
            self._room.notify_all()

    def _end(self) -> Any:
        """Every lane ended (and the stage holds nothing): the last partial
        batch (if any) is dealt already; stop."""
        partial = self._stage.end_batch(record=True)
        if self._settle(partial):
            # the end of the data ends the last epoch: its round is judged
            # as at any epoch's end; the position after the last round that
            # went out is the end (a resume there deals nothing more)
            self._record(self._batch)
        self._eof = True
        self._items.notify_all()
        return None

    def _next_epoch(self) -> bool:
        """Every lane reached the end of this epoch: its last partial batch
        is dealt already; every net gets the epoch's end; the next epoch
        starts where a run started in it would."""
        self._settle(self._stage.end_batch(record=False))
        for box in self.outboxes:
            if self._epoch >= box.marks_from:
                box.pieces.append(EpochEnd(self._epoch))  # type: ignore[arg-type]
        self._epoch += 1
        self._turns.next_epoch()
        self._offset = 0
        self._calls = [0] * len(self._calls)
        for i, state in enumerate(self._next_states):
            if state is not None:
                self._states[i] = state
        self._next_states = [None] * len(self._next_states)
        # the position after the epoch's last batch is the next epoch's start
        self._record(self._batch)
        self._items.notify_all()
        return True

    def _settle(self, partial: bool) -> bool:
        """The end of an epoch (or of the data), its last batch partial if
        ``partial``: the rounds settle it (equal shares).  False: there are
        no rounds."""
        dealt = self._batch
        batches = self._rounds.settle(dealt, partial, self._epoch, self._notes)
        if batches is None:
            return False
        self._batch = batches
        # positions past the last round that went out were never reached by
        # any net (none of their batches went out): gone, so a state cannot
        # find one; the entries at or below every net's next batch stay
        self._positions.forget(batches, dealt)
        return True

    def _position(self, batches: int) -> Position:
        """The stream's position now, after ``batches`` batches (a tuple per
        batch: the dict is made only when a state is asked for)."""
        return (batches, self._epoch, self._turns.rr, self._offset, tuple(self._calls), tuple(self._states))

    # -- state ---------------------------------------------------------------------
    def state(self, layout: dict[str, Any], nets: Sequence[str]) -> dict[str, Any]:
        """The position after the last batch each net's ``run()`` returned.

        Takes no lock, so it is safe in a signal handler that interrupted a
        thread holding it (the checkpoint-on-SIGTERM pattern): see
        :meth:`~.positions.Positions.find`.
        """
        pos, nets_at = self._positions.find(nets, self.source)
        return {
            "version": STATE_VERSION,
            "source": self.source,
            **layout,
            "position": as_dict(pos),
            # a list, not a dict: nets on one source may share a name
            # per net: its next batch, and the epochs it was told ended
            "nets": nets_at,
        }

    def load(self, state: dict[str, Any]) -> list[tuple[int, Any]]:
        """Continue from ``state`` (already checked against the layout).
        Returns, per lane in order, (calls to skip, fetcher state or None);
        the epoch to start in is :attr:`epoch`.  Loading again replaces what
        an earlier load set."""
        pos = state["position"]
        with self._lock:
            self._epoch = pos.get("epoch", 0)
            self._batch = pos["batches"]
            self._turns.rr = pos["rr"]
            self._stage.reset()
            self._rounds.clear()
            self._calls = list(pos["calls"])
            self._states = list(pos["states"])
            for box, (_, nxt, *rest) in zip(self.outboxes, state["nets"]):
                box.next_batch = box.skip_until = nxt
                box.epoch = rest[0] if rest else 0
                box.pieces.clear()
                box.samples = 0
                # the ends this net had not been told of when the state was
                # taken (the stream's position had passed them) come first
                for e in range(box.epoch, self._epoch):
                    box.pieces.append(EpochEnd(e))  # type: ignore[arg-type]
                box.marks_from = max(box.epoch, self._epoch)
            # the regenerated head chunk of lane rr: its first samples were dealt
            self._offset = self._prefix = pos["offset"]
            order = self._turns.order
            self._prefix_lane = order[self._turns.rr] if order else -1
            self._positions.restart(self._batch, len(order))
            self._record(self._batch)
            return [(c, s) for c, s in zip(pos["calls"], pos["states"])]
