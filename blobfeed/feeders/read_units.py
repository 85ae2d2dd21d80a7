"""Read units: how a random-access (or sharded) source's stream is cut
into units of consecutive global positions and handed to its workers.

:class:`UnitDispenser` makes the units in stream order and hands them out:
to a thread worker that asks (:meth:`UnitDispenser.take`), or pushed down a
worker process's pipe by whichever thread frees one
(:meth:`UnitDispenser.attach`); a worker whose process dies has its units
read again.  :class:`PipeUnits` is the worker process's end of that pipe.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import select
import struct
import threading
from typing import Callable, NamedTuple, Sequence

__all__ = ["PipeUnits", "ReadUnit", "UnitDispenser", "merge_ranges"]

logger = logging.getLogger("blobfeed.feeders")

#: names of worker process (or actor) incarnations with a dispenser: unique per program
HOLDERS = itertools.count(1)
#: a unit whose reading process died this many times fails the source
MAX_TRIES = 3
#: a unit as it travels to a worker process: (unit, g_lo, g_hi); unit -1 ends
UNIT_RECORD = struct.Struct("<qqq")
#: ``read_size=None`` with ``__getitems__``: the units after the first hold
#: whole batches of at least this many bytes of samples (or one batch, when
#: larger) ...
UNIT_BYTES = 64 * 1024
#: ... but at most this many batches: a unit is read by one worker, in one
#: call, and a dataset whose reads are slow per index (I/O) must still spread
#: over the workers
MAX_UNIT_BATCHES = 16
#: a worker process is pushed at most this many units it has not delivered
#: (and at most half its slots) before the first unit's bytes are known ...
MIN_AHEAD = 4
#: ... and after, for units of at least UNIT_BYTES (each goes to the parent
#: as soon as it is read), as many as hold about this many bytes (about 10 ms of
#: reading at a few GB/s): a unit read in a millisecond must not leave the
#: process idle for the milliseconds the parent's threads may wait for a
#: core they share with the workers (W7, 4 MiB units: 4 ahead left the two
#: cores 8-10 % idle, 12 about 2 %)
AHEAD_BYTES = 64 * 2**20


class ReadUnit(NamedTuple):
    """``hi - lo`` consecutive global positions, read as one chunk."""

    unit: int
    lo: int
    hi: int


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-empty ``[lo, hi)`` ranges covering ``ranges``."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class _Pushee(NamedTuple):
    """A worker process fed by push (:meth:`UnitDispenser.attach`)."""

    worker_id: int
    ahead: int
    send: Callable[[ReadUnit | None], None]
    failed: Callable[[ReadUnit | None, BaseException], None]


#: a send that raised: its holder's ``failed``, the unit, the error
_Failure = tuple[Callable[[ReadUnit | None, BaseException], None], ReadUnit | None, BaseException]
#: what :meth:`UnitDispenser._changed` leaves to do outside its lock: the
#: failed sends, and whether a unit read again went out
_Pushed = tuple[list[_Failure], bool]
#: nothing was pushed, nothing to do after (never appended to)
_NOTHING_PUSHED: _Pushed = ((), False)  # type: ignore[assignment]


class UnitDispenser:
    """Hands out the read units of a random-access source, in stream order,
    to whichever worker asks; knows who holds each unit until the stream
    has consumed it.  Thread-safe.

    Args:
        source: the source's name.
        n: the dataset's length.
        read_size: positions per unit (with ``auto``, the first unit's: the batch size).
        epochs: passes over the data (None: endless).
        unit_end: ``unit_end(g, read_size)``: where the unit that starts at
            global position ``g`` ends (a sharded source's units never cross
            a shard); None: ``read_size`` positions, never across an epoch.
        auto: the units after the first hold ``read_size x k`` positions,
            ``k`` the fewest batches of at least :data:`UNIT_BYTES` (at most
            :data:`MAX_UNIT_BATCHES`) once :meth:`sized` says how many bytes
            a sample takes; no worker takes a unit past the first before
            that (the units' bounds do not depend on timing).
    """

    def __init__(
        self, source: str, n: int, read_size: int, epochs: int | None,
        unit_end: Callable[[int, int], int] | None = None, auto: bool = False,
    ) -> None:
        self.source = source
        self.n = n
        #: the first unit's size (the batch's, when auto)
        self.base = read_size
        self.auto = auto
        self.read_size = read_size
        self.epochs = epochs
        self.unit_end = unit_end
        #: the window the user set (RandomAccessSource(window=...)); None: fitted (see _fit_window)
        self.fixed_window: int | None = None
        #: the workers the stream reads with (the default window follows them)
        self.workers = 1
        #: units a worker process may hold undelivered (see AHEAD_BYTES), at most its own bound
        self.ahead_limit = MIN_AHEAD
        #: a unit's bytes once the first one was seen (see sized)
        self.unit_bytes: int | None = None
        self.window = 8
        #: the dispenser's lock, entered directly (a Condition's ``with`` is
        #: two Python calls: the hot paths run twice a unit) ...
        self._mutex = threading.Lock()
        #: ... and the condition over it that thread workers wait on in take()
        self._cond = threading.Condition(self._mutex)
        #: the first global position of the stream, and ranges left out of it
        #: (a resume: what nets had returned already)
        self.start = 0
        self.skip: list[tuple[int, int]] = []
        self._reset()
        self.closed = False
        #: threads waiting in take() (a worker thread's; none with push alone)
        self._takers = 0
        #: called (outside the lock) when a worker took a unit to read again:
        #: the dealer lets it in past a full lane when it is the oldest
        self.on_redo_taken: Callable[[], None] | None = None
        #: holder -> the worker process it is, fed by push (:meth:`attach`)
        self._pushed: dict[int, _Pushee] = {}
        #: how an error names the samples of a unit ("indexes [3, 9, ...]"); None: by its number only
        self.describe: Callable[[ReadUnit], str] | None = None

    def _reset(self) -> None:
        self.read_size = self.base
        #: the units' size is known (auto: once the first unit's samples were seen)
        self._sized = not self.auto
        #: units made so far (unit -> ReadUnit), until consumed
        self._units: dict[int, ReadUnit] = {}
        self._made = 0  # units made
        self._cursor = self.start  # the next global position to put in a unit
        self._skip_i = 0
        #: the next unit to give a worker; the oldest the stream waits for
        self._next = 0
        self.oldest = 0
        #: unit -> worker id holding it (until consumed)
        self._owner: dict[int, int] = {}
        #: per holder (a worker process's incarnation): units it took and
        #: has not delivered, in the order it took them
        self._held: dict[int, list[int]] = {}
        #: holders whose process died: they take nothing more
        self._retired: set[int] = set()
        #: holder -> the worker id it reads for
        self._wid_of: dict[int, int] = {}
        #: units to read again (their reader died), smallest first: per
        #: worker id, for the process that replaces the dead one (its lane
        #: holds only units its incarnations read, in order) ...
        self._redo_of: dict[int, list[int]] = {}
        #: ... and those of worker ids that are stopped or not replaced, for
        #: any worker
        self._redo: list[int] = []
        #: unit -> how many processes died while reading it (see retire)
        self._tries: dict[int, int] = {}
        #: workers told to take no more units (set_num_workers)
        self._stopped: set[int] = set()
        #: worker id -> the unit whose read failed in its process (delivered(holder, None))
        self._failed: dict[int, int] = {}

    def restart(self, start: int, skip: Sequence[tuple[int, int]]) -> None:
        """A resume: the stream starts at global position ``start`` and leaves
        out ``skip`` (before any unit was handed out)."""
        with self._mutex:
            self.start = start
            self.skip = merge_ranges([(max(lo, start), hi) for lo, hi in skip if hi > start])
            self._reset()
            pushed = self._changed()
        self._after(pushed)

    def sized(self, sample_bytes: int) -> bool:
        """A sample takes ``sample_bytes`` (told once, by the stream's first
        unit): with ``auto`` the units after the first are sized from it,
        and the units a worker process is pushed ahead are fitted to their
        bytes (:data:`AHEAD_BYTES`).

        Called under the dealer's lock: ``on_redo_taken`` (which takes it)
        is not called.  Returns whether a unit to read again went out: the
        caller wakes the workers waiting for room itself."""
        with self._mutex:
            if self.unit_bytes is not None:
                return False
            if not self._sized:
                self._sized = True
                per_batch = max(1, sample_bytes * self.base)
                self.read_size = self.base * min(MAX_UNIT_BATCHES, max(1, -(-UNIT_BYTES // per_batch)))
            self.unit_bytes = max(1, sample_bytes * self.read_size)
            # a unit under UNIT_BYTES may wait in its process to go out with
            # the next ones (child.SHM_MIN_BYTES): a death would lose them all
            # and count as a process that delivered nothing (MAX_REPLACEMENTS)
            if self.unit_bytes >= UNIT_BYTES:
                self.ahead_limit = max(MIN_AHEAD, AHEAD_BYTES // self.unit_bytes)
            self._fit_window()
            failures, again = self._changed()
        self._after((failures, False))
        return again

    def set_window(self, window: int | None = None, workers: int | None = None) -> None:
        """The window the user set (None: fitted), or the worker count a
        fitted window follows (see :meth:`_fit_window`)."""
        with self._mutex:
            if window is not None:
                self.fixed_window = window
            if workers is not None:
                self.workers = workers
            self._fit_window()
            pushed = self._changed()
        self._after(pushed)

    def _fit_window(self) -> None:
        """The window (under the lock): the user's, else 4 per worker, at
        least 8, and where the worker processes pushed are sent more than
        :data:`MIN_AHEAD` units ahead, room for twice that many each (those
        each holds, and as many delivered and waiting for the stream)."""
        if self.fixed_window is not None:
            self.window = self.fixed_window
            return
        window = max(8, 4 * self.workers)
        ahead = min(min((e.ahead for e in self._pushed.values()), default=0), self.ahead_limit)
        if ahead > MIN_AHEAD:
            # (units of MIN_AHEAD are what 4 per worker was sized for: no
            # more memory in the lanes where nothing more is read ahead)
            window = max(window, 2 * ahead * len({e.worker_id for e in self._pushed.values()}))
        self.window = window

    def _fresh_waits(self) -> bool:
        """The next unit of the stream may not be handed out yet: it is past
        the window, or past the first before the units are sized."""
        return self._next >= self.oldest + self.window or (not self._sized and self._next >= 1)

    @property
    def end(self) -> int | None:
        """The global position where the data ends (None: endless)."""
        return None if self.epochs is None else self.epochs * self.n

    def _make(self) -> bool:
        """Make the next unit (under the lock); False at the end of the data."""
        end = self.end
        g = self._cursor
        skip = self.skip
        while self._skip_i < len(skip) and skip[self._skip_i][1] <= g:
            self._skip_i += 1
        if self._skip_i < len(skip) and skip[self._skip_i][0] <= g:
            g = skip[self._skip_i][1]
            self._skip_i += 1
        if end is not None and g >= end:
            self._cursor = g
            return False
        if self.unit_end is None:
            hi = min(g + self.read_size, (g // self.n + 1) * self.n)  # never across an epoch
        else:
            hi = self.unit_end(g, self.read_size)
        if self._skip_i < len(skip):
            hi = min(hi, skip[self._skip_i][0])
        self._units[self._made] = ReadUnit(self._made, g, hi)
        self._made += 1
        self._cursor = hi
        return True

    def unit(self, u: int) -> ReadUnit | None:
        """Unit ``u`` (made if it is not yet), or None past the end of the data."""
        with self._mutex:
            return self._unit(u)

    def peek(self, u: int) -> ReadUnit | None:
        """:meth:`unit`, without the lock when unit ``u`` was made and not
        consumed (a dict read is atomic; the stream asks this per batch)."""
        r = self._units.get(u)
        return r if r is not None else self.unit(u)

    def _unit(self, u: int) -> ReadUnit | None:
        while self._made <= u:
            if not self._make():
                return None
        return self._units.get(u)

    def position_of(self, u: int) -> int:
        """The global position where unit ``u`` starts (the end of the data,
        or of what was made, past it)."""
        with self._mutex:
            r = self._unit(u)
            return r.lo if r is not None else self._cursor

    def start_of(self, u: int) -> int:
        """:meth:`position_of`, without the lock when unit ``u`` was made
        and not consumed (a dict read is atomic)."""
        r = self._units.get(u)
        return r.lo if r is not None else self.position_of(u)

    def name_of(self, u: int) -> str:
        """How an error names unit ``u``: its number, and its samples where
        :attr:`describe` says them."""
        r = self._units.get(u)  # a dict read: atomic
        if r is None or self.describe is None:
            return f"read unit {u}"
        try:
            return f"read unit {u} ({self.describe(r)})"
        except Exception:  # an error message must not fail: the number alone
            logger.debug("source %r: naming read unit %d failed", self.source, u, exc_info=True)
            return f"read unit {u}"

    def holds(self, worker_id: int) -> bool:
        """Does ``worker_id`` hold a unit the stream has not consumed?"""
        with self._mutex:
            return worker_id in self._owner.values()

    def owner(self, u: int) -> int | None:
        """The worker that holds unit ``u``, None while nobody took it."""
        return self._owner.get(u)  # a dict read: atomic, no lock (called per chunk under the dealer's)

    def take(self, worker_id: int, ahead: int | None = None, holder: int | None = None) -> ReadUnit | None:
        """The next unit for ``worker_id``: a unit to read again first (its
        reader died: one of this worker id's own, else one of a worker id
        that is stopped or not replaced), else the next one of the stream,
        waiting while that would be more than ``window`` units past the
        oldest one the stream waits for.  ``holder`` (a worker process's
        incarnation) is told of each unit it takes, until :meth:`delivered`;
        with ``ahead``, it waits while it holds that many.  None: the data
        ended, the source stopped, or the holder was retired."""
        with self._mutex:
            held = self._held.setdefault(holder, []) if holder is not None else None
            if holder is not None and holder not in self._retired:
                self._wid_of[holder] = worker_id
            while not self._ended(worker_id, holder) and self._waits(worker_id, held, ahead):
                self._takers += 1
                try:
                    self._cond.wait()
                finally:
                    self._takers -= 1
            if self._ended(worker_id, holder):
                return None
            r, again = self._take(worker_id, held)
        if again and self.on_redo_taken is not None:
            self.on_redo_taken()
        return r

    def _ended(self, worker_id: int, holder: int | None) -> bool:
        """``worker_id`` (as ``holder``) takes no unit any more: the source
        stopped, the holder was retired, or the worker was told to stop and
        no unit waits to be read again (a stopped worker's process that dies
        leaves its units to any worker: the one that replaces it, when every
        other has ended, reads them before it ends)."""
        return self.closed or holder in self._retired or (
            worker_id in self._stopped and not self._redo and not self._redo_of.get(worker_id)
        )

    def _waits(self, worker_id: int, held: list[int] | None, ahead: int | None) -> bool:
        """No unit for ``worker_id`` now: none to read again and the next of
        the stream is not handed out yet, or it holds ``ahead`` already."""
        return ((not self._redo and not self._redo_of.get(worker_id) and self._fresh_waits())
                or (ahead is not None and held is not None and len(held) >= ahead))

    def _take(self, worker_id: int, held: list[int] | None) -> tuple[ReadUnit | None, bool]:
        """The unit ``take`` hands out now (None: past the data's end), and
        whether it is one read again."""
        own = self._redo_of.get(worker_id)
        r: ReadUnit | None
        again = bool(own or self._redo)
        if own:
            r = self._units[heapq.heappop(own)]
        elif self._redo:
            r = self._units[heapq.heappop(self._redo)]
        else:
            r = self._unit(self._next)
            if r is None:
                return None, False
            self._next += 1
        self._owner[r.unit] = worker_id
        if held is not None:
            held.append(r.unit)
        return r, again

    # -- push: units written to worker processes as they become free ----------
    def attach(self, worker_id: int, holder: int, ahead: int, send: Callable[[ReadUnit | None], None],
               failed: Callable[[ReadUnit | None, BaseException], None]) -> None:
        """Hand ``holder`` (a worker process's incarnation reading for
        ``worker_id``) its units as they become free, ``ahead`` at most that
        it has not delivered, with no thread of its own: ``send(r)`` is
        called by whichever thread frees one (a delivery, the stream taking
        a unit, a death), under this dispenser's lock, so it must not block
        (a record written to a pipe with room for ``ahead``); ``send(None)``
        once, when it gets no more (the data ended, the source stopped, the
        holder was retired or its worker stopped) or is detached.  A
        ``send`` that raises detaches and ends it: ``failed(r, exc)`` is then
        called outside this lock (the unit stays the holder's, as one it
        took), but maybe inside its caller's: ``consumed`` runs under the
        dealer's lock and a feed's, so ``failed`` must not take those (it
        must not fail the source in its own thread)."""
        with self._mutex:
            self._held.setdefault(holder, [])
            if holder not in self._retired:
                self._wid_of[holder] = worker_id
            self._pushed[holder] = _Pushee(worker_id, ahead, send, failed)
            self._fit_window()
            pushed = self._changed()
        self._after(pushed)

    def detach(self, holder: int) -> None:
        """``holder`` gets no more units: its ``send(None)``, unless it had it."""
        with self._mutex:
            entry = self._pushed.pop(holder, None)
            if entry is not None:
                self._push_end(entry)

    def _changed(self, settled: bool = False) -> _Pushed:
        """The state changed (under the lock): wake the threads waiting in
        :meth:`take`, and push what it now allows to the attached holders,
        each unit to the one that holds fewest (so no holder starves the
        others of the window).  What it returns goes to :meth:`_after`,
        outside the lock.

        ``settled``: the change ended no holder (a delivery, the stream
        taking a unit: twice a unit, on the reader's thread).  Every other
        change makes the whole pass, which ends the holders that take
        nothing more, so after a settled one only fresh units can go out,
        to holders with room, and the pass skips the rest: unless a unit
        waits to be read again, or a worker is stopped (a stopped worker's
        holder ends once no unit is left to read again, which a thread's
        :meth:`take` can bring about)."""
        if self._takers:
            self._cond.notify_all()
        if not self._pushed:
            return _NOTHING_PUSHED
        fresh_only = settled and not self._redo and not self._stopped and not any(self._redo_of.values())
        limit = self.ahead_limit
        failures: list[_Failure] = []
        again_any = False
        while not (fresh_only and self._fresh_waits()):
            # the holder that can take a unit and holds the fewest (the most
            # idle process; the first attached on a tie) takes the next one
            pick: tuple[int, _Pushee, list[int]] | None = None
            for holder, entry in list(self._pushed.items()):
                held = self._held.setdefault(holder, [])
                ahead = entry.ahead if entry.ahead < limit else limit
                if fresh_only:
                    if len(held) >= ahead:
                        continue
                elif self._ended(entry.worker_id, holder):
                    del self._pushed[holder]
                    self._push_end(entry)
                    continue
                elif self._waits(entry.worker_id, held, ahead):
                    continue
                if pick is None or len(held) < len(pick[2]):
                    pick = (holder, entry, held)
            if pick is None:
                break
            holder, entry, held = pick
            r, again = self._take(entry.worker_id, held)
            if r is None:
                # past the data's end: this holder gets no more.  The others
                # end when they are picked, as a thread of each that pulled
                # would have: one that is full now may still take a unit
                # read again (a death) after its next delivery.
                del self._pushed[holder]
                self._push_end(entry)
                continue
            again_any = again_any or again
            try:
                entry.send(r)
            except Exception as exc:
                # detached and ended here, under the lock (its end closes its
                # pipe: no other thread may close it meanwhile); the unit
                # stays its own, and a death hands it to another
                del self._pushed[holder]
                self._push_end(entry)
                failures.append((entry.failed, r, exc))
        return (failures, again_any) if failures or again_any else _NOTHING_PUSHED

    def _after(self, pushed: _Pushed) -> None:
        """What :meth:`_changed` left to do outside the lock: the callbacks.
        (``on_redo_taken`` takes the dealer's lock: a unit read again is
        never pushed by ``consumed``, which runs under it, as it frees no
        holder's room; ``sized``, which may, calls it not.)"""
        failures, again = pushed
        for failed, r, exc in failures:
            failed(r, exc)
        if again and self.on_redo_taken is not None:
            self.on_redo_taken()

    def _push_end(self, entry: _Pushee) -> None:
        try:
            entry.send(None)
        except Exception:  # closing a pipe whose reader is gone, say: nothing more to tell it
            logger.debug("source %r: ending a worker's units failed", self.source, exc_info=True)

    def active(self, worker_ids: Sequence[int]) -> list[int]:
        """Of ``worker_ids``, those not told to stop (:meth:`stop_workers`)."""
        with self._mutex:
            return [w for w in worker_ids if w not in self._stopped]

    def stop_workers(self, worker_ids: Sequence[int]) -> None:
        """These workers take no more units (they end once they delivered
        what they hold): the source runs on fewer workers."""
        with self._mutex:
            self._stopped.update(worker_ids)
            for w in worker_ids:
                self._release(w)
            pushed = self._changed()
        self._after(pushed)

    def release(self, worker_id: int) -> None:
        """``worker_id``'s dead process is not replaced: the units it held
        are read again by whichever worker asks first."""
        with self._mutex:
            self._release(worker_id)
            pushed = self._changed()
        self._after(pushed)

    def _release(self, worker_id: int) -> None:
        for u in self._redo_of.pop(worker_id, []):
            heapq.heappush(self._redo, u)

    def delivered(self, holder: int, unit: int | None) -> bool:
        """A worker process delivered ``unit`` (None: it failed on the oldest
        unit it held).  False: ``holder`` does not hold it (it was retired
        and the unit handed to another reader): drop what it read."""
        with self._mutex:
            held = self._held.get(holder)
            if not held:
                return False
            if unit is None:
                u = held.pop(0)
                wid = self._owner.get(u)
                if wid is not None:
                    self._failed[wid] = u
            elif unit in held:
                held.remove(unit)
            else:
                return False
            pushed = self._changed(settled=unit is not None)
        self._after(pushed)
        return True

    def failed_unit(self, worker_id: int, read: Sequence[int]) -> int | None:
        """The unit whose read failed in ``worker_id``: the one its process
        said, else the oldest it holds that is not in ``read`` (a thread
        reads one unit at a time); None when it holds none."""
        with self._mutex:
            u = self._failed.pop(worker_id, None)
            if u is not None:
                return u
            done = set(read)
            mine = [v for v, w in self._owner.items() if w == worker_id and v not in done]
            return min(mine) if mine else None

    def retired(self, holder: int) -> bool:
        """Was ``holder`` retired (its process died)?"""
        with self._mutex:
            return holder in self._retired

    def retire(self, holder: int, reading: int | None = None) -> list[tuple[int, int]]:
        """A worker process died: the units it held are read again, by the
        process that replaces it (the same worker id), or by whoever asks
        first when that worker id is stopped (or, see :meth:`release`, not
        replaced).

        A try is counted against the unit it was reading alone: ``reading``
        as its process said (no unit it still holds: none), or when None
        the oldest it held.  The others waited behind it (or were read, and
        their results died with it): a death says nothing of them, and with
        several units ahead an innocent one would reach :data:`MAX_TRIES`.
        Returns ``[(unit, tries)]`` when that unit's readers died
        :data:`MAX_TRIES` times (the source must fail), else ``[]``."""
        with self._mutex:
            self._retired.add(holder)
            wid = self._wid_of.pop(holder, None)
            redo = self._redo if wid is None or wid in self._stopped else self._redo_of.setdefault(wid, [])
            held = self._held.pop(holder, [])
            if reading is None and held:
                reading = held[0]
            poison = []
            for u in held:
                self._owner.pop(u, None)
                heapq.heappush(redo, u)
                if u == reading:
                    tries = self._tries[u] = self._tries.get(u, 0) + 1
                    if tries >= MAX_TRIES:
                        poison.append((u, tries))
            pushed = self._changed()
        self._after(pushed)
        return poison

    def consumed(self, u: int) -> None:
        """The stream took unit ``u`` (the oldest it waited for)."""
        with self._mutex:
            self._owner.pop(u, None)
            self._units.pop(u, None)
            self._tries.pop(u, None)
            self.oldest = u + 1
            pushed = self._changed(settled=True)
        self._after(pushed)

    def close(self) -> None:
        """The source stopped: every waiting ``take`` returns None."""
        with self._mutex:
            self.closed = True
            pushed = self._changed()
        self._after(pushed)


class PipeUnits:
    """A worker process's end of its units: records the parent writes
    (:data:`UNIT_RECORD`); a unit < 0 or the pipe's end: no more.

    ``before_wait`` is called when no unit is there yet, before waiting for
    one: the worker sends the results it holds back (the parent gives it
    more units only once they arrive).  The pipe is read without blocking
    (the worker process's own end: the parent never reads it), so a unit
    already there costs one read, not a poll and a read."""

    def __init__(self, fd: int, before_wait: Callable[[], None] | None = None,
                 reading: Callable[[int], None] | None = None) -> None:
        self.fd = fd
        self.before_wait = before_wait
        #: told each unit taken, before it is read, and -1 once what it read
        #: is sent and it waits for more (the parent learns from it which
        #: unit a process that died was reading: see retire)
        self.reading = reading
        os.set_blocking(fd, False)

    def take(self, worker_id: int, ahead: int | None = None) -> ReadUnit | None:
        size = UNIT_RECORD.size
        data = b""
        told = False
        while len(data) < size:
            try:
                part = os.read(self.fd, size - len(data))
            except BlockingIOError:
                part = None
            if part is None:  # (outside the except: an error of before_wait is its own)
                if not told and self.before_wait is not None:
                    told = True
                    self.before_wait()
                    if self.reading is not None:
                        # what it read is sent: waiting, it reads none (a
                        # kill now is no try against its last unit)
                        self.reading(-1)
                    continue  # (what it sent may have freed a unit meanwhile)
                select.select([self.fd], [], [])
                continue
            if not part:
                return None
            data += part
        unit, lo, hi = UNIT_RECORD.unpack(data)
        if unit < 0:
            return None
        if self.reading is not None:
            self.reading(unit)
        return ReadUnit(unit, lo, hi)
