"""Random-access sources: a dataset with ``__len__`` and ``__getitem__``
(torch's map-style ``Dataset``, grain's ``RandomAccessDataSource``), read by
blobfeed in an order it draws itself.

The order of epoch *e* is ``range(n)``, or with ``shuffle=True`` the
permutation ``numpy.random.default_rng((seed, e)).permutation(n)``: a
global shuffle, not a buffer.  The positions of the whole run are numbered
globally, ``g = e * n + p`` (position *p* of epoch *e*'s order).  They are
handed to the workers as *read units*: ``read_size`` consecutive positions
(fewer at an epoch's end), numbered 0, 1, 2, ... in stream order.  A worker
takes the next unit when it is free (:class:`UnitDispenser`), reads its
samples (``__getitems__`` when the dataset has it, else ``__getitem__`` per
index) and returns them as one chunk stamped with the unit's number; the
dealer (:mod:`.dealing.indexed`) puts the units back in order and cuts the
batches.  So the batches are a function of the data, the seed, the epoch and
the batch size only, whatever the workers and nets.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import operator
import os
import select
import struct
import threading
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from .chunks import Stamped

__all__ = [
    "IndexedReadError", "PipeUnits", "RandomAccessSource", "ReadUnit", "UnitDispenser", "UnitReader",
    "is_random_access",
]

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


def is_random_access(obj: Any) -> bool:
    """Whether ``obj`` is read as a random-access source: a
    :class:`RandomAccessSource`, or any object with ``__len__`` and
    ``__getitem__`` (even a callable one)."""
    if isinstance(obj, RandomAccessSource):
        return True
    kind = type(obj)
    return hasattr(kind, "__len__") and hasattr(kind, "__getitem__")


class RandomAccessSource:
    """A map-style dataset and how blobfeed reads it.

    Pass it (or the dataset itself, for the defaults) where a ``fetch_fun``
    goes: ``init_data_input_workers``, ``init_reader``,
    ``FeedServer.serve_source``.

    Args:
        dataset: an object with ``__len__`` and ``__getitem__(i)``; a sample
            is a tuple or list with one array per blob (without the batch
            axis), or a dict blob name -> array.  ``__getitems__(indices)``,
            when it has one, reads several at once and returns a list of such
            samples (torch >= 2.2's convention).
        shuffle: each epoch is a permutation of the dataset drawn from
            ``(seed, epoch)`` (a global shuffle); False: ``0 .. n-1`` in order.
        seed: the shuffle's seed; None: the wiring's ``seed`` (drawn and
            logged when that is None too).
        read_size: consecutive positions of the order a worker reads at
            once (one read unit); None: the batch size, and when the dataset
            has ``__getitems__``, the units after the first hold whole
            batches of at least :data:`UNIT_BYTES` of samples (as many bytes
            as the first unit's samples take), at most
            :data:`MAX_UNIT_BATCHES`.  The stream does not depend on it.
        window: a worker may not take a unit more than this many units past
            the oldest one the stream still waits for; None: ``4 x`` the
            worker count, at least 8.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        shuffle: bool = False,
        seed: int | None = None,
        read_size: int | None = None,
        window: int | None = None,
    ) -> None:
        from ..arguments import check_flag, check_index

        kind = type(dataset)
        if not hasattr(kind, "__len__") or not hasattr(kind, "__getitem__"):
            raise TypeError(
                f"a random-access source needs __len__ and __getitem__; {kind.__qualname__} has "
                f"{'neither' if not hasattr(kind, '__len__') and not hasattr(kind, '__getitem__') else 'only one'}"
            )
        self.dataset = dataset
        self.shuffle = check_flag("shuffle", shuffle)
        self.seed = None if seed is None else check_index("seed", seed, minimum=0)
        self.read_size = None if read_size is None else check_index("read_size", read_size)
        self.window = None if window is None else check_index("window", window)

    def __repr__(self) -> str:
        return (
            f"RandomAccessSource({type(self.dataset).__qualname__}, shuffle={self.shuffle}, "
            f"seed={self.seed}, read_size={self.read_size}, window={self.window})"
        )

    #: how wiring errors call such a source
    kind = "random-access source (an object with __len__ and __getitem__)"

    def length(self, source: str) -> int:
        """The number of samples of one epoch, checked."""
        return dataset_length(source, self.dataset)

    def reader(self, source: str, n: int, seed: int, blob_names: Sequence[str], axes: Sequence[int]) -> "UnitReader":
        """The ``fetch_fun`` its workers run (see :class:`UnitReader`)."""
        return UnitReader(source, self, n, seed, blob_names, axes)


def dataset_length(source: str, dataset: Any) -> int:
    """``len(dataset)``, checked: an int >= 1."""
    try:
        n = len(dataset)
    except Exception as exc:
        raise TypeError(f"source {source!r}: len(dataset) raised {safe_repr(exc)}") from exc
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"source {source!r}: len(dataset) must be an int >= 1, got {n!r}")
    return n


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The dataset indexes of epoch ``epoch``, in stream order."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng((seed, epoch)).permutation(n).astype(np.int64)


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
        self.window = 8
        self._cond = threading.Condition(threading.Lock())
        #: the first global position of the stream, and ranges left out of it
        #: (a resume: what nets had returned already)
        self.start = 0
        self.skip: list[tuple[int, int]] = []
        self._reset()
        self.closed = False
        #: called (outside the lock) when a worker took a unit to read again:
        #: the dealer lets it in past a full lane when it is the oldest
        self.on_redo_taken: Callable[[], None] | None = None

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
        #: unit -> how many readers of it died
        self._tries: dict[int, int] = {}
        #: workers told to take no more units (set_num_workers)
        self._stopped: set[int] = set()
        #: worker id -> the unit whose read failed in its process (delivered(holder, None))
        self._failed: dict[int, int] = {}

    def restart(self, start: int, skip: Sequence[tuple[int, int]]) -> None:
        """A resume: the stream starts at global position ``start`` and leaves
        out ``skip`` (before any unit was handed out)."""
        with self._cond:
            self.start = start
            self.skip = merge_ranges([(max(lo, start), hi) for lo, hi in skip if hi > start])
            self._reset()

    def sized(self, sample_bytes: int) -> None:
        """``auto``: a sample takes ``sample_bytes``; the units after the
        first are sized from it (once)."""
        with self._cond:
            if self._sized:
                return
            self._sized = True
            per_batch = max(1, sample_bytes * self.base)
            self.read_size = self.base * min(MAX_UNIT_BATCHES, max(1, -(-UNIT_BYTES // per_batch)))
            self._cond.notify_all()

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
        with self._cond:
            return self._unit(u)

    def _unit(self, u: int) -> ReadUnit | None:
        while self._made <= u:
            if not self._make():
                return None
        return self._units.get(u)

    def position_of(self, u: int) -> int:
        """The global position where unit ``u`` starts (the end of the data,
        or of what was made, past it)."""
        with self._cond:
            r = self._unit(u)
            return r.lo if r is not None else self._cursor

    def start_of(self, u: int) -> int:
        """:meth:`position_of`, without the lock when unit ``u`` was made
        and not consumed (a dict read is atomic)."""
        r = self._units.get(u)
        return r.lo if r is not None else self.position_of(u)

    def holds(self, worker_id: int) -> bool:
        """Does ``worker_id`` hold a unit the stream has not consumed?"""
        with self._cond:
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
        with self._cond:
            held = self._held.setdefault(holder, []) if holder is not None else None
            if holder is not None and holder not in self._retired:
                self._wid_of[holder] = worker_id
            own = self._redo_of.get(worker_id)
            while not self.closed and holder not in self._retired and worker_id not in self._stopped and (
                (not self._redo and not own and self._fresh_waits())
                or (ahead is not None and held is not None and len(held) >= ahead)
            ):
                self._cond.wait()
                own = self._redo_of.get(worker_id)
            if self.closed or holder in self._retired or worker_id in self._stopped:
                return None
            r: ReadUnit | None
            again = bool(own or self._redo)
            if own:
                r = self._units[heapq.heappop(own)]
            elif self._redo:
                r = self._units[heapq.heappop(self._redo)]
            else:
                r = self._unit(self._next)
                if r is None:
                    return None
                self._next += 1
            self._owner[r.unit] = worker_id
            if held is not None:
                held.append(r.unit)
        if again and self.on_redo_taken is not None:
            self.on_redo_taken()
        return r

    def active(self, worker_ids: Sequence[int]) -> list[int]:
        """Of ``worker_ids``, those not told to stop (:meth:`stop_workers`)."""
        with self._cond:
            return [w for w in worker_ids if w not in self._stopped]

    def stop_workers(self, worker_ids: Sequence[int]) -> None:
        """These workers take no more units (they end once they delivered
        what they hold): the source runs on fewer workers."""
        with self._cond:
            self._stopped.update(worker_ids)
            for w in worker_ids:
                self._release(w)
            self._cond.notify_all()

    def release(self, worker_id: int) -> None:
        """``worker_id``'s dead process is not replaced: the units it held
        are read again by whichever worker asks first."""
        with self._cond:
            self._release(worker_id)
            self._cond.notify_all()

    def _release(self, worker_id: int) -> None:
        for u in self._redo_of.pop(worker_id, []):
            heapq.heappush(self._redo, u)

    def delivered(self, holder: int, unit: int | None) -> bool:
        """A worker process delivered ``unit`` (None: it failed on the oldest
        unit it held).  False: ``holder`` does not hold it (it was retired
        and the unit handed to another reader): drop what it read."""
        with self._cond:
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
            self._cond.notify_all()
            return True

    def failed_unit(self, worker_id: int, read: Sequence[int]) -> int | None:
        """The unit whose read failed in ``worker_id``: the one its process
        said, else the oldest it holds that is not in ``read`` (a thread
        reads one unit at a time); None when it holds none."""
        with self._cond:
            u = self._failed.pop(worker_id, None)
            if u is not None:
                return u
            done = set(read)
            mine = [v for v, w in self._owner.items() if w == worker_id and v not in done]
            return min(mine) if mine else None

    def retired(self, holder: int) -> bool:
        """Was ``holder`` retired (its process died)?"""
        with self._cond:
            return holder in self._retired

    def retire(self, holder: int) -> list[tuple[int, int]]:
        """A worker process died: the units it held are read again, by the
        process that replaces it (the same worker id), or by whoever asks
        first when that worker id is stopped (or, see :meth:`release`, not
        replaced).  Returns those of them whose readers died
        :data:`MAX_TRIES` times, ``(unit, tries)`` (the source must fail)."""
        with self._cond:
            self._retired.add(holder)
            wid = self._wid_of.pop(holder, None)
            redo = self._redo if wid is None or wid in self._stopped else self._redo_of.setdefault(wid, [])
            poison = []
            for u in self._held.pop(holder, []):
                tries = self._tries[u] = self._tries.get(u, 0) + 1
                self._owner.pop(u, None)
                heapq.heappush(redo, u)
                if tries >= MAX_TRIES:
                    poison.append((u, tries))
            self._cond.notify_all()
            return poison

    def consumed(self, u: int) -> None:
        """The stream took unit ``u`` (the oldest it waited for)."""
        with self._cond:
            self._owner.pop(u, None)
            self._units.pop(u, None)
            self._tries.pop(u, None)
            self.oldest = u + 1
            self._cond.notify_all()

    def close(self) -> None:
        """The source stopped: every waiting ``take`` returns None."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class IndexedReadError(Exception):
    """Reading a random-access source failed: names the source, the index and
    (when the sample is at fault) the blob."""


class PipeUnits:
    """A worker process's end of its units: records the parent writes
    (:data:`UNIT_RECORD`); a unit < 0 or the pipe's end: no more.

    ``before_wait`` is called when no unit is there yet, before waiting for
    one: the worker sends the results it holds back (the parent gives it
    more units only once they arrive)."""

    def __init__(self, fd: int, before_wait: Callable[[], None] | None = None) -> None:
        self.fd = fd
        self.before_wait = before_wait

    def take(self, worker_id: int, ahead: int | None = None) -> ReadUnit | None:
        size = UNIT_RECORD.size
        if self.before_wait is not None and not select.select([self.fd], [], [], 0)[0]:
            self.before_wait()
        data = b""
        while len(data) < size:
            part = os.read(self.fd, size - len(data))
            if not part:
                return None
            data += part
        unit, lo, hi = UNIT_RECORD.unpack(data)
        return None if unit < 0 else ReadUnit(unit, lo, hi)


class UnitReader:
    """The ``fetch_fun`` of a random-access source: takes the next read unit,
    reads its samples, and returns them as one chunk stamped with the unit's
    number.  Raises StopIteration when no unit is left.

    Pickles without its unit source (a worker process gets a pipe of its own).
    """

    def __init__(
        self, source: str, spec: RandomAccessSource, n: int, seed: int, blob_names: Sequence[str],
        axes: Sequence[int],
    ) -> None:
        self.source = source
        self.dataset = spec.dataset
        self.shuffle = spec.shuffle
        self.n = n
        self.seed = seed
        self.blob_names = tuple(blob_names)
        self.axes = tuple(axes)
        #: where units come from: the dispenser (threads), a pipe (a process)
        self.units: Any = None
        #: (epoch, its order): one tuple, read and replaced at once (threads share it)
        self._order: tuple[int, np.ndarray] | None = None

    def __repr__(self) -> str:
        return f"<the reader of random-access source {self.source!r}: {type(self.dataset).__qualname__} of {self.n}>"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["units"] = None
        state["_order"] = None
        state.pop("into", None)
        return state

    #: ``UnitDispenser(unit_end=)`` for this source's units (None: the default cut)
    unit_end: Callable[[int, int], int] | None = None
    #: where a unit is stacked, when not in arrays of its own: called with
    #: each blob's (shape, dtype), it returns arrays to stack into, or None
    #: (a worker process sets its slots here: unit_slots.UnitSlots)
    into: Callable[[list[tuple[tuple[int, ...], np.dtype]]], list[np.ndarray] | None] | None = None

    def worker_ended(self, worker_id: int) -> None:
        """Worker ``worker_id`` makes no further call (it stopped, failed or
        ran out of units): called in that worker's own thread, whatever the
        backend (:func:`~.worker_loop.worker_events`).  A sharded reader
        closes the worker's open shard here; this reader holds nothing."""

    def layout_mismatch(
        self, layout: Sequence[tuple[np.dtype, tuple[int, ...]]], first: int, arrays: Sequence[np.ndarray],
        axes: Sequence[int], r: ReadUnit,
    ) -> IndexedReadError | None:
        """Unit ``r``'s chunk (``arrays``) against the per-sample ``layout``
        of the stream's first sample (sample ``first``): None when it fits,
        else the error naming the unit's first sample (the dealer checks
        the units in stream order, under its lock: the unit's samples are
        listed only for the error)."""
        for k, (a, ax, (dtype, shape)) in enumerate(zip(arrays, axes, layout)):
            got = a.shape[:ax] + a.shape[ax + 1:]
            if got != shape or a.dtype != dtype:
                idx = self.indexes(r)
                return IndexedReadError(
                    f"source {self.source!r}: {self.where(idx[0])} (read unit {r.unit}: {self.span(idx)}), blob "
                    f"{self.blob_names[k]!r}: dtype {a.dtype}, per-sample shape {got}; the stream's samples "
                    f"before it have dtype {dtype}, per-sample shape {shape} (as {self.where(first)})"
                )
        return None

    def where(self, i: int) -> str:
        """How errors name sample ``i`` (an index of the dataset)."""
        return f"dataset[{i}]"

    def span(self, idx: Sequence[int]) -> str:
        """How errors name the samples ``idx`` of a unit."""
        return f"indexes {_short(idx)}"

    def first_index(self, r: ReadUnit) -> int:
        """The first sample unit ``r`` reads (without listing the others)."""
        return int(self._indexes(r)[0])

    def _indexes(self, r: ReadUnit) -> np.ndarray:
        epoch, lo = divmod(r.lo, self.n)
        cached = self._order
        if cached is None or cached[0] != epoch:
            cached = self._order = (epoch, epoch_order(self.n, self.shuffle, self.seed, epoch))
        return cached[1][lo:lo + (r.hi - r.lo)]

    def indexes(self, r: ReadUnit) -> list[int]:
        """The dataset indexes unit ``r`` reads."""
        return self._indexes(r).tolist()

    def __call__(self, worker_id: int, batch_size: int) -> Stamped:
        r = self.units.take(worker_id)
        if r is None:
            raise StopIteration
        idx = self.indexes(r)
        samples = self._read(idx)
        if isinstance(samples, Mapping):  # the unit already stacked
            return Stamped(self._stacked(idx, samples), r.unit)
        return Stamped(self._stack(r.unit, idx, samples), r.unit)

    def _read(self, idx: list[int]) -> Sequence[Any] | Mapping[str, Any]:
        """The unit's samples, or a dict blob name -> the unit stacked
        (what ``__getitems__`` may return)."""
        ds = self.dataset
        many = getattr(ds, "__getitems__", None)
        if many is not None:
            try:
                samples = many(idx)
            except Exception as exc:
                raise IndexedReadError(
                    f"source {self.source!r}: dataset.__getitems__({_short(idx)}) raised {safe_repr(exc)}"
                ) from exc
            if isinstance(samples, Mapping):
                return samples
            try:
                count = len(samples)
            except TypeError:
                count = -1
            if count != len(idx):
                raise IndexedReadError(
                    f"source {self.source!r}: dataset.__getitems__({_short(idx)}) returned "
                    f"{type(samples).__name__} of {count if count >= 0 else 'no'} samples; expected a list of "
                    f"{len(idx)} samples, one per index"
                )
            return samples
        out = []
        for i in idx:
            try:
                out.append(ds[i])
            except Exception as exc:
                raise IndexedReadError(f"source {self.source!r}: dataset[{i}] raised {safe_repr(exc)}") from exc
        return out

    def _stacked(self, idx: list[int], unit: Mapping[str, Any]) -> list[np.ndarray]:
        """A unit ``__getitems__`` returned stacked, checked: every blob, an
        array of numbers with one sample per index along its batch axis
        (taken as it is: no copy).  Its per-sample dtype and shape are
        checked against the stream's by the dealer, as any unit's."""
        where = f"source {self.source!r}: dataset.__getitems__({_short(idx)}) returned"
        missing = [b for b in self.blob_names if b not in unit]
        if missing:
            raise IndexedReadError(
                f"{where} a dict without blob(s) {missing} (it has keys {sorted(map(str, unit))[:10]}); a unit "
                f"read at once is a dict with one array per blob {list(self.blob_names)}, the batch axis "
                "holding one sample per index"
            )
        out = []
        for b, ax in zip(self.blob_names, self.axes):
            v = unit[b]
            try:
                a = np.asarray(v)
            except Exception as exc:
                raise IndexedReadError(f"{where} blob {b!r}: not an array ({type(v).__name__}): {exc!r}") from exc
            if a.dtype.kind == "O":
                raise IndexedReadError(
                    f"{where} blob {b!r}: an object array ({type(v).__name__}); expected numbers"
                )
            if ax >= a.ndim:
                raise IndexedReadError(
                    f"{where} blob {b!r} with {a.ndim} dimensions; its batch axis is {ax} (one sample per index)"
                )
            if a.shape[ax] != len(idx):
                raise IndexedReadError(
                    f"{where} blob {b!r} with {a.shape[ax]} samples along its batch axis {ax} (shape {a.shape}); "
                    f"expected {len(idx)}, one per index"
                )
            out.append(a)
        return out

    def _blobs(self, i: int, sample: Any) -> list[np.ndarray]:
        """Sample ``i`` as one array per blob, checked."""
        return blob_arrays(f"source {self.source!r}: dataset[{i}]", self.blob_names, sample)

    def _stack(self, unit: int, idx: list[int], samples: Sequence[Any]) -> list[np.ndarray]:
        """The unit's samples stacked per blob.  Every sample must have the
        dtype and shape of the unit's first one (the dealer checks the
        units against each other, in stream order: see
        :meth:`layout_mismatch`)."""
        fast = self._stack_plain(samples)
        if fast is not None:
            return fast
        # anything else (a dict, a tensor, a number, a bad sample): sample
        # by sample, each checked, with the error naming its index
        per_blob: list[list[np.ndarray]] = [[] for _ in self.blob_names]
        first: list[tuple[np.dtype, tuple[int, ...]]] | None = None
        for i, sample in zip(idx, samples):
            arrays = self._blobs(i, sample)
            if first is None:
                first = [(a.dtype, a.shape) for a in arrays]
            for k, (a, (dtype, shape)) in enumerate(zip(arrays, first)):
                if a.shape != shape or a.dtype != dtype:
                    raise IndexedReadError(
                        f"source {self.source!r}: dataset[{i}] (read unit {unit}: indexes {_short(idx)}), blob "
                        f"{self.blob_names[k]!r}: dtype {a.dtype}, per-sample shape {a.shape}; the samples "
                        f"before it in its read unit have dtype {dtype}, per-sample shape {shape} "
                        f"(as dataset[{idx[0]}])"
                    )
                per_blob[k].append(a)
        out = []
        for k, (arrays, ax) in enumerate(zip(per_blob, self.axes)):
            if ax > arrays[0].ndim:
                raise IndexedReadError(
                    f"source {self.source!r}: blob {self.blob_names[k]!r}: batch axis {ax}, but its samples "
                    f"have {arrays[0].ndim} dimensions (shape {arrays[0].shape})"
                )
            try:
                out.append(np.stack(arrays, axis=ax))
            except Exception as exc:  # dtypes that do not stack, say
                raise IndexedReadError(
                    f"source {self.source!r}: blob {self.blob_names[k]!r}: the samples of indexes "
                    f"{_short(idx)} do not stack: {safe_repr(exc)}"
                ) from exc
        return out


    def _stack_plain(self, samples: Sequence[Any]) -> list[np.ndarray] | None:
        """The common case without a Python step per sample and blob: every
        sample a tuple or list with one numpy array (or numpy scalar) per
        blob, each blob of one dtype and shape throughout; None for anything
        else, which the checked way takes (it gives the errors).  Checking
        each sample in Python costs more than stacking them (277 µs against
        13 µs for 32 of W1's samples), so the checks here run in C: ``map``,
        ``set`` and ``zip`` over the samples."""
        n = len(self.blob_names)
        if not samples or not set(map(type, samples)) <= _PLAIN:
            return None
        # a sample with fewer arrays gives a _MISSING, one with more a column too many
        cols = list(itertools.zip_longest(*samples, fillvalue=_MISSING))
        if len(cols) != n:
            return None
        layout: list[tuple[tuple[int, ...], np.dtype]] = []
        for ax, col in zip(self.axes, cols):
            types = set(map(type, col))
            if len(types) == 1 and (t := next(iter(types))) in _SCALARS:
                dtype = _SCALARS[t]  # a numeric numpy scalar's type is its dtype: no pass over them
            else:
                if not all(issubclass(t, _NUMPY) for t in types):
                    return None
                dtypes = set(map(_DTYPE, col))
                if len(dtypes) != 1:
                    return None
                dtype = dtypes.pop()
            shape = col[0].shape
            if dtype.kind == "O" or ax > len(shape):
                return None
            layout.append((shape[:ax] + (len(col),) + shape[ax:], dtype))
        into = self.into(layout) if self.into is not None else None
        out = []
        for k, (ax, col, (shape, dtype)) in enumerate(zip(self.axes, cols, layout)):
            try:
                if into is not None:
                    # straight into the worker's slot: no array of our own
                    # (its pages faulted in anew each unit) and no copy after
                    stacked = np.stack(col, axis=ax, out=into[k])
                else:
                    # one C call; samples of other shapes raise (numpy >= 1.24)
                    stacked = np.array(col, dtype=dtype) if ax == 0 else np.stack(col, axis=ax)
            except ValueError:
                return None  # the checked way names the sample
            if stacked.shape != shape:
                return None
            out.append(stacked)
        return out


_PLAIN = {tuple, list}
_NUMPY = (np.ndarray, np.generic)
_MISSING = object()
#: numpy scalar types whose dtype their type says (not str, bytes, void, datetime: their size or unit varies)
_SCALARS = {t: np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                     np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
                                     np.complex128, np.longlong, np.ulonglong, np.longdouble, np.clongdouble)}
_DTYPE = operator.attrgetter("dtype")


def safe_repr(obj: Any) -> str:
    """``repr(obj)`` for an error message, even when that repr raises (a
    user's exception or value): its type then, not an error of its own."""
    try:
        return repr(obj)
    except Exception as exc:
        return f"{type(obj).__qualname__} (its repr raised {type(exc).__name__})"


def blob_arrays(where: str, names: Sequence[str], value: Any, batched: bool = False) -> list[np.ndarray]:
    """``value`` (a sample, or with ``batched`` a chunk of samples: a tuple
    or list with one array per blob, or a dict blob name -> array) as one
    numpy array per blob of ``names``, in order; IndexedReadError beginning
    with ``where`` when it is not that."""
    if isinstance(value, Mapping):
        missing = [b for b in names if b not in value]
        if missing:
            raise IndexedReadError(
                f"{where} is a dict without blob(s) {missing} (it has keys {sorted(map(str, value))[:10]}); "
                f"expected the blobs {list(names)}"
            )
        values = [value[b] for b in names]
    elif isinstance(value, (tuple, list)):
        if len(value) != len(names):
            raise IndexedReadError(
                f"{where} has {len(value)} arrays; expected {len(names)}, one per blob {list(names)}"
            )
        values = list(value)
    else:
        raise IndexedReadError(
            f"{where} is a {type(value).__name__}; expected a tuple or list with one array per blob "
            f"{list(names)}{' (each with its batch axis)' if batched else ''}, or a dict blob name -> array"
        )
    arrays = []
    for b, v in zip(names, values):
        try:
            a = np.asarray(v)
        except Exception as exc:
            raise IndexedReadError(
                f"{where}, blob {b!r}: not an array ({type(v).__name__}): {safe_repr(exc)}"
            ) from exc
        if a.dtype.kind == "O":
            raise IndexedReadError(
                f"{where}, blob {b!r}: an object array ({type(v).__name__}); expected numbers "
                "of one shape (a numpy array, a tensor, a number)"
            )
        arrays.append(a)
    return arrays


def _short(idx: Sequence[int]) -> str:
    return str(list(idx)) if len(idx) <= 8 else f"[{', '.join(map(str, idx[:8]))}, ... ({len(idx)} indexes)]"
