"""The dealer of a random-access source: read units put back in order.

Workers take read units from a :class:`~blobfeed.feeders.indexed.UnitDispenser`
as they free up, each in increasing order, and hand each unit's samples over
as one chunk stamped with its number (``chunk.state``).  The stream is unit
0, 1, 2, ...: each lane is kept sorted by unit (a worker's units increase;
the process that replaces a dead one may read an older one), so the unit the
stream waits for is at the head of its holder's lane as soon as it is read,
and :class:`UnitTurns` only looks there.  Batches are cut from that stream as
for a deterministic source (:class:`~.stages.Cut`), batch *i* to net *i mod
k*, epochs ending where the dispenser's units cross an epoch.

A position is ``(batches, g)``: the batches dealt and the global position
(``epoch * n + offset`` in the epochs' orders) of the next sample.  A state
records where the slowest net is, the ranges of the batches faster nets
already returned, and the ranges an earlier resume left out: a resume with
another number of nets, workers or backend reads the rest of the stream,
leaving those out, and deals it anew from net 0.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..chunks import Chunk, EpochEnd
from ...errors import FetcherError
from ..pulling import Puller
from ..read_units import UnitDispenser, merge_ranges
from .base import DropCounter
from .lanes import LaneDealer, _Failed
from .positions import Positions
from .rounds import Direct
from .stages import Cut
from .turns import Turns

__all__ = ["INDEXED_STATE_VERSION", "IndexedDealer", "UnitTurns"]

#: the layout version of a random-access source's ``state_dict``
INDEXED_STATE_VERSION = 3


class UnitTurns(Turns):
    """The stream reads unit ``next`` from the lane of the worker holding it."""

    strict = True
    resumable = True

    def __init__(self, dispenser: UnitDispenser) -> None:
        super().__init__()
        self.units = dispenser
        #: the unit the stream waits for
        self.next = 0
        #: the epoch the stream is in
        self.epoch = 0
        #: called with the lane whose head is unit ``next`` the first time
        #: :meth:`turn` finds it there (the dealer checks its layout), and
        #: the unit it was called for last
        self.on_head: Callable[[Any], None] | None = None
        self.checked = -1

    def _head_ok(self, lanes: Any) -> int | None:
        u = self.next
        wid = self.units.owner(u)
        if wid is None:
            return None
        lane = lanes[wid]
        if not lane:
            return None
        head = lane[0]
        if type(head) is Chunk and head.state == u:
            return wid
        if isinstance(head, _Failed) and (head.state is None or head.state <= u):
            return wid
        return None

    def turn(self, lanes: Any) -> int | None:
        if self.all_ended():
            return None
        wid = self._head_ok(lanes)
        if wid is not None and self.checked != self.next and self.on_head is not None:
            self.checked = self.next
            self.on_head(lanes[wid])
        return wid

    def ready(self, lanes: Any) -> bool:
        return not self.all_ended() and self._head_ok(lanes) is not None

    def passed(self) -> None:
        self.units.consumed(self.next)
        self.next += 1

    def lane_ended(self, worker_id: int, for_good: bool) -> None:  # pragma: no cover - never at a head we pick
        pass

    def all_ended(self) -> bool:
        """The stream's epoch has no unit left."""
        r = self.units.peek(self.next)
        return r is None or r.lo // self.units.n > self.epoch

    def all_done(self) -> bool:
        if self.units.peek(self.next) is not None:
            return False
        end = self.units.end
        return end is None or self.epoch + 1 >= end // self.units.n

    def next_epoch(self) -> None:
        self.epoch += 1


class UnitPositions(Positions):
    """A position per batch, ``(batches, g)``."""

    def reset(self, lanes: int) -> None:
        self.kept = {0: self._now(0)}


class UnitCut(Cut):
    positions = UnitPositions


class IndexedDealer(LaneDealer):
    """A random-access source's stream (see the module docstring).

    Args: as :class:`~.lanes.LaneDealer`'s, and ``dispenser``: the source's units.
    """

    def __init__(
        self,
        source: str,
        batch_size: int,
        axes: Sequence[int],
        capacity: int,
        on_error: Callable[[BaseException], None],
        dispenser: UnitDispenser,
        *,
        on_dropped: DropCounter | None = None,
        rounds: Direct | None = None,
        max_bytes: int | None = None,
        outbox_samples: int | None = None,
        window: int | None = None,
        reader: Any = None,
    ) -> None:
        self.units = dispenser
        #: the source's UnitReader (its blob names, a unit's indexes): the
        #: units' layouts are checked in stream order (None: not checked)
        self._reader = reader
        #: the per-sample layout of the stream's first sample, and its index
        self._layout: tuple[list[tuple[Any, tuple[int, ...]]], int] | None = None
        #: the dispenser's window (None: by the worker count, at start)
        self.window = window
        if window is not None:
            dispenser.set_window(window)
        dispenser.on_redo_taken = self._wake_workers
        self._unit_turns = UnitTurns(dispenser)
        if reader is not None:
            self._unit_turns.on_head = self._head_reached
        super().__init__(
            source, batch_size, axes, capacity, outbox_samples, on_error, on_dropped=on_dropped,
            turns=self._unit_turns, stage=UnitCut(), rounds=rounds, max_bytes=max_bytes,
        )
        self._epoch = self._unit_turns.epoch
        #: global ranges a loaded state said the faster nets had returned past
        #: its position (a resume with the same nets re-reads and drops them):
        #: a state saved before the stream dealt them again must still say so
        self._loaded_returned: list[tuple[int, int]] = []

    # -- workers -----------------------------------------------------------------
    # hooks of LaneDealer.put: a lane stays sorted by unit (a worker process
    # that replaced a dead one may read a unit older than what its lane
    # holds), and the unit the stream waits for always enters (its lane may
    # be full of later units)
    sorted_lanes = True

    def _may_wait(self, worker_id: int, chunk: Chunk) -> bool:
        """Never wait with the oldest unit the stream waits for, nor while
        this worker holds it (it reads it next: a unit to read again, taken
        after later ones); never while the net's thread receives the chunks
        (it would wait for itself: the dispenser's window bounds the lanes
        then, see :meth:`use_puller`)."""
        if self._puller is not None:
            return False
        units = self.units
        oldest = units.oldest
        return chunk.state != oldest and units.owner(oldest) != worker_id

    def _insert_at(self, lane: Any, sizes: Any, chunk: Chunk) -> tuple[int, int]:
        """The chunks (and failed reads, see put_error) come first in a lane,
        sorted by unit; the other markers after them."""
        unit = chunk.state
        end = self._sorted_end(lane, len(sizes))
        i = end
        while i and lane[i - 1].state > unit:
            i -= 1
        if i == len(lane):
            return i, len(sizes)
        # sizes has one entry per chunk: the failed reads before i are not
        return i, (i if end == len(sizes) else sum(1 for k in range(i) if type(lane[k]) is Chunk))

    def use_puller(self) -> Puller | None:
        """Asked by every group of worker processes at its start: the
        :class:`~blobfeed.feeders.pulling.Puller` through which the thread
        that waits for chunks here receives its workers' messages itself,
        rather than a receiver thread each.  Given when one net with an
        enqueuer reads this stream (that enqueuer is the only thread that
        waits here); None: receiver threads.  The lanes then never make a
        put wait: the dispenser's window bounds the units handed out and
        not yet dealt."""
        with self._lock:
            if self._puller is None and not self._closed and len(self.outboxes) == 1 and self.outboxes[0].prefetch:
                self._puller = Puller(self.source)
            return self._puller

    def _wake_workers(self) -> None:
        """A worker took a unit to read again: if it is the oldest, that
        worker's chunks no longer wait for room (see :meth:`put`)."""
        with self._room:
            self._room.notify_all()

    @staticmethod
    def _sorted_end(lane: Any, chunks: int) -> int:
        """Where the sorted part of a lane (chunks, failed reads) ends."""
        i = chunks
        while i < len(lane) and (type(lane[i]) is Chunk or type(lane[i]) is _Failed and lane[i].state is not None):
            i += 1
        return i

    def put_error(self, worker_id: int, error: BaseException) -> None:
        """The worker failed: the error surfaces at the unit whose read
        failed, at its sorted place in the lane (later units may be there
        already: a unit read again after its reader died), or at once when
        it holds none (its ``worker_init_fun`` failed, say: no unit of the
        stream would ever reach it)."""
        with self._lock:
            lane = self._lanes[worker_id]
            unit = self.units.failed_unit(worker_id, [c.state for c in lane if type(c) is Chunk])
            if not self._lanes_closed:
                if unit is None:
                    lane.append(_Failed(error))
                else:
                    i = self._sorted_end(lane, len(self._sizes[worker_id]))
                    while i and lane[i - 1].state > unit:
                        i -= 1
                    lane.insert(i, _Failed(error, unit))
                self._items.notify_all()
        if unit is None and not self.units.holds(worker_id):
            with self._lock:
                if self._error is None:
                    self._error = error  # what the nets get once what was dealt is out
                self._items.notify_all()
            self._on_error(error)

    def _consumed(self, wid: int, chunk: Chunk, lane: Any) -> None:
        super()._consumed(wid, chunk, lane)
        # a worker may wait with the unit the stream now waits for
        if self._room_waiters:
            self._room.notify_all()

    # -- the stream --------------------------------------------------------------
    def _head_reached(self, lane: Any) -> None:
        """The unit the stream waits for is at the head of ``lane``, seen
        there for the first time (:attr:`UnitTurns.on_head`): its layout is
        checked, and a unit that does not fit fails the stream there."""
        if type(lane[0]) is Chunk:
            bad = self._check_layout(lane[0])
            if bad is not None:
                lane[0] = _Failed(bad, self._unit_turns.next)

    def _check_layout(self, chunk: Chunk) -> BaseException | None:
        """The unit the stream reaches against its first sample's layout
        (the first unit's fixes it): in stream order, so whatever worker read
        what, a sample of another dtype or shape fails the same way."""
        reader = self._reader
        r = self.units.unit(chunk.state)
        if r is None:  # pragma: no cover - a unit the stream reaches exists
            return None
        if self._layout is None:
            self._layout = ([(a.dtype, a.shape[:ax] + a.shape[ax + 1:]) for a, ax in zip(chunk.arrays, self.axes)],
                            reader.first_index(r))
            # read_size=None: the later units are sized by the bytes of a sample
            if self.units.sized(sum(a.nbytes for a in chunk.arrays) // max(1, chunk.n)):
                self._room.notify_all()  # (under our lock: see UnitDispenser.sized)
            return None
        layout, first = self._layout
        # the unit's sample ids are listed only when it does not fit (a
        # unit of a million samples: 30 ms under the dealer's lock)
        cause = reader.layout_mismatch(layout, first, chunk.arrays, self.axes, r)
        if cause is None:
            return None
        err = FetcherError(f"{cause}")
        err.__cause__ = cause
        return err

    def _position(self, batches: int) -> Any:
        # (per batch: the unit the stream is in was made, its start read without the dispenser's lock)
        return (batches, self.units.start_of(self._unit_turns.next) + self._offset)

    def start(self) -> None:
        self.units.set_window(workers=len(self._turns.order))
        super().start()

    def close(self, reason: BaseException | None, *, in_order: bool = False) -> int:
        self.units.close()
        return super().close(reason, in_order=in_order)

    # -- state ---------------------------------------------------------------------
    def _as_entries(self, ranges: Sequence[tuple[int, int]]) -> list[list[int]]:
        """Global ``[lo, hi)`` ranges as ``[epoch, offset, count]``, one per epoch."""
        n = self.units.n
        out = []
        for lo, hi in merge_ranges(ranges):
            while lo < hi:
                e, off = divmod(lo, n)
                stop = min(hi, (e + 1) * n)
                out.append([e, off, stop - lo])
                lo = stop
        return out

    def state(self, layout: dict[str, Any], nets: Sequence[str]) -> dict[str, Any]:
        """Where the slowest net is, and what the faster ones returned beyond
        it (lock-free, as :meth:`LaneDealer.state`)."""
        pos, nets_at = self._positions.find(nets, self.source)
        batches, g = pos[0], pos[1]  # (batches, g): see _position
        kept = self._positions.kept
        k = len(nets_at)
        returned: list[tuple[int, int]] = []
        # net j's batches past the position that it returned, from what this
        # run dealt (the keys of `kept`: never a loop as long as a number)
        ahead = {j: nxt for j, (_, nxt, _) in enumerate(nets_at) if nxt > batches}
        for b in sorted(list(kept)):  # list(): a C-level copy, atomic under the GIL
            if b < batches or b % k not in ahead or b >= ahead[b % k]:
                continue
            lo, hi = kept.get(b), kept.get(b + 1)
            if lo is not None and hi is not None:
                returned.append((lo[1], hi[1]))
        # and what the loaded state said they had, not yet dealt again
        returned += [(max(lo, g), hi) for lo, hi in self._loaded_returned if hi > g]
        epoch, offset = divmod(g, self.units.n)
        if epoch and not offset:
            # the end of an epoch: said as such (the end of the data is in
            # the last epoch), whether or not its end was dealt yet
            epoch, offset = epoch - 1, self.units.n
        layout = dict(layout)
        kind = layout.pop("kind")  # "random_access" or "sharded": see random_access_layout
        return {
            "version": INDEXED_STATE_VERSION,
            "kind": kind,
            "source": self.source,
            **layout,
            "position": {"batches": batches, "epoch": epoch, "offset": offset},
            # left out of this stream by an earlier resume
            "skip": self._as_entries([r for r in self.units.skip if r[1] > g]),
            # the batches past the position that some net already returned
            "returned": self._as_entries(returned),
            "nets": nets_at,
        }

    def load(self, state: dict[str, Any]) -> list[tuple[int, Any]]:
        """Continue from a checked ``state``: the same nets (as many as when
        it was saved) each get exactly the batches an uninterrupted run would
        have given them; another number of nets gets the rest of the stream,
        what any net returned left out, dealt anew from net 0."""
        pos = state["position"]
        n = self.units.n
        g = pos["epoch"] * n + pos["offset"]

        def ranges(key: str) -> list[tuple[int, int]]:
            return [(e * n + off, e * n + off + c) for e, off, c in state[key]]

        same = len(state["nets"]) == len(self.outboxes)
        with self._lock:
            t = self._unit_turns
            t.epoch = self._epoch = pos["epoch"]
            t.next = 0
            self._stage.reset()
            self._rounds.clear()
            self._offset = self._prefix = 0
            if same:
                # the faster nets' batches are read again and dropped (skip_until)
                self._loaded_returned = ranges("returned")
                self.units.restart(g, ranges("skip"))
                self._batch = pos["batches"]
                for box, (_, nxt, told) in zip(self.outboxes, state["nets"]):
                    self._place(box, nxt, told)
            else:
                self._loaded_returned = []
                self.units.restart(g, ranges("skip") + ranges("returned"))
                self._batch = 0
                told = min(entry[2] for entry in state["nets"])
                for box in self.outboxes:
                    self._place(box, box.index, told)
            self._positions.restart(self._batch, 0)
            self._record(self._batch)
        return []

    def _place(self, box: Any, nxt: int, told: int) -> None:
        box.next_batch = box.skip_until = nxt
        box.epoch = told
        box.pieces.clear()
        box.samples = 0
        for e in range(told, self._epoch):
            box.pieces.append(EpochEnd(e))
        box.marks_from = max(told, self._epoch)
