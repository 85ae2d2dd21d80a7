"""Lanes: the workers' chunks in round robin (strict: ``deterministic=True``;
or first-ready), cut into batches once per source, optionally through a
shuffle stage, and dealt to the nets in turn, with the position after every
batch (what ``state_dict`` saves).

Each worker has a lane, a small bounded queue of its own.  The chunk stream
of the source is lane 0's first chunk, lane 1's first, ..., then every
lane's second, a lane that ended being skipped.  Whoever needs data (a net's
enqueuer, or the net's own thread) advances the stream under one lock: it
takes the head of the lane whose turn it is (or waits for that worker, never
for another), cuts it at batch boundaries into views and appends the pieces
of batch *i* to the outbox of net *i mod k*.  Every net's re-batcher then
receives exactly one batch's worth of pieces per batch, so it makes the same
batches as a single re-batcher would, without another copy.

An error of a worker is an item of its lane: it surfaces when the round robin
reaches it, after every batch that comes before it in the stream, whatever
the timing.

Epochs: a worker whose data ended while another epoch follows puts an
epoch marker in its lane and goes on.  The stream treats it as the end of
that lane for the epoch; once every lane reached its marker, the epoch's
last (partial) batch is dealt, every net gets an :class:`EpochEnd`, and the
next epoch starts afresh: round robin from the first worker, as a run
started in that epoch would.  So a position is always "this epoch, these
calls of each worker in it".

Equal shares (``equal=True``, several nets): the batches go out in rounds,
batches *r k* ... *r k + k - 1* for the *k* nets.  The pieces of a round
wait in the dealer (``_round``) until its last batch is complete, then go
to the outboxes together; at the end of an epoch (or of the data) a round
that is not complete is dropped, counted (reason ``"equal"``) and logged,
and its batch numbers are dealt again from the next epoch on: every epoch
starts a round, at net 0.  No net ever sees a batch of a dropped round, so
no net's position passes one, and a state never points into one.  With
``drop_last`` the epoch's last partial batch is dropped here (not by the
nets' feeds) before the round is judged, so it cannot leave one net a
batch short.
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ...errors import EndOfInput, FetcherError
from ..chunks import Chunk, EpochEnd
from ..shuffle import ShuffleBuffer
from .base import DealerStats, DropCounter

__all__ = ["BIG_BATCH_BYTES", "LaneDealer", "NetOutbox", "READABLE_VERSIONS", "STATE_VERSION", "default_outbox_samples"]

logger = logging.getLogger("blobfeed.feeders")

#: the layout version of ``state_dict``; a state of another version is refused
#: (version 1, before epochs, is read as a state in epoch 0)
STATE_VERSION = 2
READABLE_VERSIONS = (1, 2)


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
    """A lane's marker: its worker's error, at its place in the stream."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


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

    def get_nowait(self) -> tuple[bool, Chunk | None]:
        return self._dealer.take(self)

    def wait_for_item(self, timeout: float | None = None) -> bool:
        return self._dealer.wait_for(self, timeout)

    def qsize(self) -> int:
        return self._dealer.queued()

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
            (a resume's prefix, reason ``"resume"``), outside the lock.
        strict: True: strict round robin (``deterministic=True``); False:
            whichever lane has a chunk, from the one whose turn it is.
        shuffle: the shuffle stage, if any.
        max_bytes: bounds the bytes of the chunks waiting in all lanes
            together (``max_buffered_bytes``; None: counted, not bounded),
            shared equally by the lanes; a chunk always enters a lane that
            holds none (so a worker whose turn it is is never blocked).
            The shuffle buffer's rows are bounded by its size in samples.
        equal: with several nets, every net gets the same number of batches
            per epoch (see the module docstring): a round of batches, one per
            net, goes out once complete; an epoch's last incomplete round is
            dropped (``on_dropped("equal", n)``).
        drop_last: with ``equal``, the epoch's last partial batch is dropped
            (``on_dropped("drop_last", n)``) before its round is judged.
    """

    resumable: bool

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
        strict: bool = True,
        shuffle: ShuffleBuffer | None = None,
        max_bytes: int | None = None,
        equal: bool = False,
        drop_last: bool = False,
    ) -> None:
        self.source = source
        self.strict = strict
        self.equal = equal
        self.drop_last = drop_last
        #: equal shares: the nets per round (set at start; 0: every batch goes out at once)
        self._round_k = 0
        #: the pieces of the round being filled, (batch, outbox, piece), and their samples
        self._round: list[tuple[int, NetOutbox, Chunk]] = []
        self._round_n = 0
        #: log lines to write once the lock is released: (format, args)
        self._notes: list[tuple[Any, ...]] = []
        #: only a strict stream is a function of the wiring
        self.resumable = strict
        self.shuffle = shuffle
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
        self._on_error = on_error
        self._on_dropped = on_dropped
        self._lock = threading.Lock()
        self._items = threading.Condition(self._lock)  # nets wait here
        self._room = threading.Condition(self._lock)  # workers wait here
        self._lanes: dict[int, collections.deque[Any]] = {}
        #: chunks in all lanes, and their samples (kept, not counted: the
        #: depth is read per batch)
        self._lane_chunks = 0
        self._lane_n = 0
        self._order: list[int] = []
        #: lanes whose data ended in this epoch; of them, those ended for good
        self._ended: set[int] = set()
        self._done: set[int] = set()
        self._epoch = 0
        self.outboxes: list[NetOutbox] = []
        self._closed = False
        self._error: BaseException | None = None  # reached in the stream
        self._rr = 0  # position in _order whose turn it is
        self._offset = 0  # samples of that lane's head chunk already gone
        #: of ``_offset``, samples a resume must still count as dropped (the
        #: regenerated head chunk's prefix, which the nets had already), and
        #: the worker whose chunk that is
        self._prefix = 0
        self._prefix_lane = -1
        self._batch = 0  # global index of the batch being filled
        self._filled = 0  # samples in it so far
        #: the shuffle stage's last batch was partial (the epoch's last)
        self._shuffled_partial = False
        #: per worker: calls whose chunk is wholly dealt, and the fetcher's
        #: state after the last of them (a stateful fetch_fun)
        #: (lists by lane index, so that recording a position is two C copies)
        self._calls: list[int] = []
        self._states: list[Any] = []
        #: per lane: its fetcher's state at the next epoch's start, once its epoch ended
        self._next_states: list[Any] = []
        self._lane_of: dict[int, int] = {}
        #: batches completed -> the position after them, kept until every
        #: net has returned past it.  Entries are immutable tuples and never
        #: removed at or above the lowest net's next batch, so state() can
        #: read them without the lock (from a signal handler).
        self._positions: dict[int, tuple[Any, ...]] = {0: self._start_position()}
        #: no position below this batch number is kept
        self._kept_from = 0
        self._eof = False
        self._started = False
        self._lanes_closed = False
        self._close_reason: BaseException = EndOfInput(f"source {source!r}: stopped")

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
        return list(self._order)

    # -- wiring, before start ---------------------------------------------------
    def add_lanes(self, worker_ids: Sequence[int]) -> None:
        with self._lock:
            for wid in worker_ids:
                self._lanes[wid] = collections.deque()
                self._sizes[wid] = collections.deque()
                self._lane_bytes[wid] = 0
                self._order.append(wid)
                self._lane_of[wid] = len(self._calls)
                self._calls.append(0)
                self._states.append(None)
                self._next_states.append(None)
            # Deep lanes matter: a worker that waits a whole GIL switch
            # interval (5 ms: hundreds of small chunks) must not starve the
            # round robin, as it would not starve the internal queue.
            self.lane_capacity = max(2, self.capacity // len(self._order))
            self._lane_low = self.lane_capacity // 2
            if self.max_bytes is not None:
                self.lane_bytes = max(1, self.max_bytes // len(self._order))
                self._lane_bytes_low = self.lane_bytes // 2
            if not self._started and self._batch == 0:
                self._positions = {0: self._start_position()}

    def add_net(self) -> NetOutbox:
        with self._lock:
            if self._started:
                raise ValueError(
                    f"source {self.source!r} is deterministic and already running: "
                    "wire every net before start()"
                )
            box = NetOutbox(self, len(self.outboxes))
            self.outboxes.append(box)
            return box

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                # one net gets every round whole: nothing to hold back
                self._round_k = len(self.outboxes) if self.equal and len(self.outboxes) > 1 else 0
                # several nets: the outbox may shrink once a chunk tells the sample size
                self._outbox_sizing = self._outbox_asked is None and len(self.outboxes) > 1
                self._record(self._batch)

    # -- workers -----------------------------------------------------------------
    def put(self, worker_id: int, chunk: Chunk, nbytes: int = 0) -> bool:
        """Append ``chunk`` (``nbytes`` bytes) to the worker's lane, waiting
        while the lane is full (in chunks, or in bytes unless it holds no
        chunk); False once closed."""
        with self._room:
            lane = self._lanes[worker_id]
            sizes = self._sizes[worker_id]
            while not self._lanes_closed and (
                len(lane) >= self.lane_capacity
                or (sizes and self._lane_bytes[worker_id] + nbytes > self.lane_bytes)
            ):
                self._room.wait()
            if self._lanes_closed:
                return False
            if self._outbox_sizing and nbytes and chunk.n:
                self._outbox_sizing = False
                self.outbox_samples = default_outbox_samples(self.batch_size, len(self.outboxes), nbytes // chunk.n)
            lane.append(chunk)
            sizes.append(nbytes)
            self._lane_bytes[worker_id] += nbytes
            self._queued_bytes += nbytes
            self._lane_chunks += 1
            self._lane_n += chunk.n
            if len(lane) == 1:
                self._items.notify_all()
            return True

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
        the lanes and the shuffle buffer (what comes after it or could not
        be dealt before it) are dropped and the outboxes (what comes before)
        are still handed out.  Returns the samples discarded.  Idempotent."""
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
            if self.shuffle is not None:
                # its chunks may hold a worker's shared memory: let go now
                lost += self.shuffle.clear()
            # an unfinished round of equal shares never goes out (an error
            # in the stream ends the epoch short too)
            lost += self._round_n
            self._round.clear()
            self._round_n = 0
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
            held = self._lane_samples() + sum(b.samples for b in self.outboxes) + self._round_n
            if self.shuffle is not None:
                held += len(self.shuffle)
            return DealerStats(held, self._lane_chunks, self.capacity, self._queued_bytes, self.max_bytes)

    def queued(self) -> int:
        """Chunks waiting in the lanes (what ``capacity`` bounds; pieces
        already dealt to a net and rows in the shuffle buffer are held, not
        waiting)."""
        return self._lane_chunks

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
        with self._lock:
            return self._items.wait_for(
                lambda: bool(box.pieces) or self._closed or self._error is not None or self._eof
                or self._can_advance(),
                timeout,
            )

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
        if self._eof or not self._order:
            return False
        n = len(self._order)
        for k in range(n):
            wid = self._order[(self._rr + k) % n]
            if wid in self._ended:
                continue
            if self._lanes[wid]:
                return self._outbox_has_room()
            if self.strict:
                return False  # strict: only this lane's worker may go next
        if len(self._ended) < n:
            return False  # first-ready: every lane still going is empty
        # every lane ended: the end can be dealt (a shuffle's rest as room allows)
        return self.shuffle is None or not len(self.shuffle) or self._outbox_has_room()

    def _outbox_has_room(self) -> bool:
        box = self.outboxes[self._batch % len(self.outboxes)]
        return box.samples < self.outbox_samples or self._batch < box.skip_until

    def _advance(self) -> Any:
        """Deal what the next lane's head allows.  Returns None when it must
        wait (that worker has nothing yet, or the outbox is full), the error
        when the stream reached one, else True."""
        if self._eof or not self._order:
            return None
        n_lanes = len(self._order)
        for _ in range(n_lanes):
            wid = self._order[self._rr]
            if wid in self._ended or (not self.strict and not self._lanes[wid]):
                self._rr = (self._rr + 1) % n_lanes
                continue
            break
        else:
            if len(self._ended) == n_lanes:
                if self.shuffle is not None and len(self.shuffle):
                    # the buffer's rest, a batch at a time as room allows:
                    # all at once would hold the whole buffer as batches
                    if not self._outbox_has_room():
                        return None
                    self._deal_batch(self.shuffle.pop(self.batch_size))
                    return True
                if len(self._done) < n_lanes:
                    return self._next_epoch()
                return self._end()
            return None
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
            self._ended.add(wid)
            if head is _ENDED:
                self._done.add(wid)
            elif head.state is not None:
                # the position's state once the next epoch starts (its calls at 0)
                self._next_states[self._lane_of[wid]] = head.state
            self._rr = (self._rr + 1) % n_lanes
            self._room.notify_all()
            return True
        if isinstance(head, _Failed):
            self._error = head.error
            self._items.notify_all()
            return head.error
        if not self._outbox_has_room():
            return None
        chunk: Chunk = head
        if self._prefix:
            bad = self._drop_prefix(chunk)
            if bad is not None:
                return bad
        if self.shuffle is not None:
            lane.popleft()
            self._consumed(wid, chunk, lane)
            # (the buffer copies what a pinned chunk holds out of the
            # worker's memory: rows wait there for long, and must not starve
            # the worker of its slots)
            self.shuffle.push(chunk)
            while self.shuffle.ready(self.batch_size):
                self._deal_batch(self.shuffle.pop(self.batch_size))
            return True
        if len(self.outboxes) == 1 and self._batch >= self.outboxes[0].skip_until:
            return self._deal_whole(wid, chunk, lane)
        take = min(chunk.n - self._offset, self.batch_size - self._filled)
        self._deal(self._piece(chunk, self._offset, take))
        self._offset += take
        self._filled += take
        if self._offset == chunk.n:
            lane.popleft()
            self._offset = 0
            self._consumed(wid, chunk, lane)
        if self._filled == self.batch_size:
            self._batch += 1
            self._filled = 0
            self._record(self._batch)
            if self._round_k and not self._batch % self._round_k:
                self._release_round()
        return True

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

    def _deal_whole(self, wid: int, chunk: Chunk, lane: collections.deque[Any]) -> bool:
        """One net: the rest of the head chunk goes to it uncut (its feed's
        re-batcher cuts it, as in arrival order); the stream only counts
        where the batches end in it, and records the position there."""
        start = self._offset
        left = chunk.n - start
        box = self.outboxes[0]
        box.pieces.append(chunk if start == 0 else self._piece(chunk, start, left))
        box.samples += left
        bs = self.batch_size
        while left >= bs - self._filled:  # a batch ends inside this chunk
            room = bs - self._filled
            left -= room
            self._filled = 0
            self._batch += 1
            if not left:
                break  # at the chunk's end: recorded after it is consumed
            self._offset += room
            self._record(self._batch)
        else:
            self._filled += left
        lane.popleft()
        self._offset = 0
        self._consumed(wid, chunk, lane)
        if not self._filled:
            self._record(self._batch)
        return True

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
        self._rr = (self._rr + 1) % len(self._order)
        # A worker blocked on its full lane sleeps until the lane is half
        # empty, then refills it in a burst: one wake-up (a GIL hand-off) per
        # half lane instead of one per chunk, as the internal queue does.
        if len(lane) <= self._lane_low and left <= self._lane_bytes_low:
            self._room.notify_all()

    def _deal_batch(self, batch: Chunk) -> None:
        """A whole batch made by the shuffle stage (the epoch's last may be partial)."""
        self._shuffled_partial = batch.n < self.batch_size
        self._deal(batch)
        self._batch += 1
        self._record(self._batch)
        if self._round_k and not self._batch % self._round_k and not self._shuffled_partial:
            # (a partial one is the epoch's last: the epoch's end settles its round)
            self._release_round()

    def _end(self) -> Any:
        """Every lane ended (and the shuffle buffer, if any, is empty): the
        last partial batch (if any) is dealt already; stop."""
        partial = bool(self._filled) or self._shuffled_partial
        self._shuffled_partial = False
        if self._filled:
            self._batch += 1
            self._filled = 0
            self._record(self._batch)
        if self._round_k:
            # the end of the data ends the last epoch: its round is judged
            # as at any epoch's end; the position after the last round that
            # went out is the end (a resume there deals nothing more)
            self._settle_round(partial)
            self._record(self._batch)
        self._eof = True
        self._items.notify_all()
        return None

    def _next_epoch(self) -> bool:
        """Every lane reached the end of this epoch: its last partial batch
        is dealt already; every net gets the epoch's end; the next epoch
        starts where a run started in it would."""
        partial = bool(self._filled) or self._shuffled_partial
        self._shuffled_partial = False
        if self._filled:
            self._batch += 1
            self._filled = 0
        if self._round_k:
            self._settle_round(partial)
        for box in self.outboxes:
            if self._epoch >= box.marks_from:
                box.pieces.append(EpochEnd(self._epoch))  # type: ignore[arg-type]
        self._epoch += 1
        self._ended = set(self._done)
        self._rr = 0
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

    def _release_round(self) -> None:
        """The round being filled is complete: its pieces go to their nets
        (under the lock)."""
        for _, box, piece in self._round:
            box.pieces.append(piece)
            box.samples += piece.n
        self._round.clear()
        self._round_n = 0

    def _settle_round(self, partial: bool) -> None:
        """Equal shares at the end of an epoch (or of the data), with
        ``_batch`` batches dealt, the last of them partial if ``partial``
        (under the lock): a complete last round goes out; an incomplete one
        is dropped and counted, and its batch numbers are dealt again from
        the next epoch on, so every epoch starts a round at net 0."""
        k = self._round_k
        ended = self._batch
        if partial and self.drop_last:
            # dropped here rather than by one net's feed, which would leave
            # that net a batch short of the others
            last = self._batch - 1
            n = 0
            while self._round and self._round[-1][0] == last:
                n += self._round.pop()[2].n
            self._round_n -= n
            self._batch = last
            if n:
                if self._on_dropped is not None:
                    self._on_dropped("drop_last", n)
                self._notes.append((
                    "source %r: dropped the last partial batch of epoch %d, %d samples (drop_last=True)",
                    self.source, self._epoch, n,
                ))
        if self._batch % k:
            start = self._batch - self._batch % k
            n = self._round_n
            self._round.clear()
            self._round_n = 0
            if n and self._on_dropped is not None:
                self._on_dropped("equal", n)
            self._notes.append((
                "source %r: dropped the incomplete last round of epoch %d: %d batches (%d samples) for "
                "%d of its %d nets (equal=True: every net gets the same number of batches per epoch)",
                self.source, self._epoch, self._batch - start, n, self._batch - start, k,
            ))
            self._batch = start
        else:
            self._release_round()
        # positions past the last round that went out were never reached by
        # any net (none of their batches went out): gone, so a state cannot
        # find one; the entries at or below every net's next batch stay
        for b in range(self._batch + 1, ended + 1):
            self._positions.pop(b, None)

    def _piece(self, chunk: Chunk, lo: int, n: int) -> Chunk:
        if lo == 0 and n == chunk.n:
            return chunk
        arrays = tuple(
            a[lo:lo + n] if ax == 0 else a[(slice(None),) * ax + (slice(lo, lo + n),)]
            for a, ax in zip(chunk.arrays, self.axes)
        )
        return Chunk(arrays, n, chunk.worker_id, chunk.seq, chunk.pin, chunk.state)

    def _deal(self, piece: Chunk) -> None:
        box = self.outboxes[self._batch % len(self.outboxes)]
        if self._batch < box.skip_until:
            # before this net's resumed position: it had it already
            self._dropped_on_resume(piece.n)
            return
        if self._round_k:
            # equal shares: it waits for the rest of its round.  A piece in a
            # worker's shared memory is copied out: the round may need more
            # of that worker's chunks than it has slots, and would wait for
            # them forever
            if piece.pin is not None:
                piece = Chunk(tuple(np.array(a) for a in piece.arrays), piece.n, piece.worker_id, piece.seq,
                              None, piece.state)
            self._round.append((self._batch, box, piece))
            self._round_n += piece.n
            return
        box.pieces.append(piece)
        box.samples += piece.n

    def _record(self, batches: int) -> None:
        if self.shuffle is not None:
            # The buffer's content is not a position in the workers' streams:
            # a shuffled source resumes by running again from its start and
            # dropping the batches each net had (replayed, never copied twice).
            return
        positions = self._positions
        # drop the positions every net has returned past (keys are batch numbers)
        boxes = self.outboxes
        low = boxes[0].next_batch if len(boxes) == 1 else min([b.next_batch for b in boxes], default=0)
        while self._kept_from < low:
            positions.pop(self._kept_from, None)
            self._kept_from += 1
        # a tuple per batch (the dict is made only when a state is asked for)
        positions[batches] = (batches, self._epoch, self._rr, self._offset, tuple(self._calls), tuple(self._states))

    def _start_position(self) -> tuple[Any, ...]:
        n = len(self._order)
        return (0, 0, 0, 0, (0,) * n, (None,) * n)

    @staticmethod
    def _as_dict(pos: tuple[Any, ...]) -> dict[str, Any]:
        batches, epoch, rr, offset, calls, states = pos
        return {"batches": batches, "epoch": epoch, "rr": rr, "offset": offset,
                "calls": list(calls), "states": list(states)}

    # -- state ---------------------------------------------------------------------
    def state(self, layout: dict[str, Any], nets: Sequence[str]) -> dict[str, Any]:
        """The position after the last batch each net's ``run()`` returned.

        Takes no lock, so it is safe in a signal handler that interrupted a
        thread holding it (the checkpoint-on-SIGTERM pattern): the positions
        are immutable tuples, never removed at or above the lowest net's next
        batch, and each net's next batch is an int only its own thread writes.
        """
        boxes = list(self.outboxes)
        positions = self._positions
        pos = None
        nets_at: list[list[Any]] = []
        for _ in range(1000):
            nets_at = [[name, b.next_batch, b.epoch] for name, b in zip(nets, boxes)]
            low = min((n[1] for n in nets_at), default=0)
            pos = positions.get(0 if self.shuffle is not None else low)
            if pos is not None:
                break
            kept = list(positions)  # a C-level copy: atomic under the GIL
            if kept and low > max(kept):
                # a net's next batch is past the end (the stream ended there)
                pos = positions.get(max(kept))
                if pos is not None:
                    break
            # else the positions were pruned past our reading of the nets
            # by another thread meanwhile: read the nets again
        if pos is None:
            raise RuntimeError(f"source {self.source!r}: no consistent position found")
        return {
            "version": STATE_VERSION,
            "source": self.source,
            **layout,
            "position": self._as_dict(pos),
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
            self._rr = pos["rr"]
            self._filled = 0
            self._round.clear()
            self._round_n = 0
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
            self._positions = {}
            self._kept_from = self._batch
            # the regenerated head chunk of lane rr: its first samples were dealt
            self._offset = self._prefix = pos["offset"]
            self._prefix_lane = self._order[self._rr] if self._order else -1
            self._record(self._batch)
            if self.shuffle is not None:
                self._positions[0] = self._start_position()
            return [(c, s) for c, s in zip(pos["calls"], pos["states"])]
