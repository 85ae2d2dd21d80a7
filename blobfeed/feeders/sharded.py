"""Sharded sources: data cut into shards fixed by the data (files, tar parts,
record files), each read sequentially from a sample offset.

A :class:`ShardedSource` is a random-access source underneath: the same
global positions, read units, :class:`~.indexed.UnitDispenser`, dealer,
state, resume, worker replacement and ``set_num_workers``.  What differs is
the order and how a unit is read:

* the order of epoch *e* is the shards in the permutation
  ``numpy.random.default_rng((seed, e)).permutation(num_shards)`` (or in
  order without ``shuffle``), and the samples of each shard in order (or,
  with ``shuffle_block=B``, each block of ``B`` consecutive samples of a
  shard permuted by ``default_rng((seed, e, shard, block))``);
* a read unit never crosses a shard's end (the dispenser's ``unit_end`` is
  :meth:`ShardedReader.unit_end`), and with ``shuffle_block`` it covers whole
  blocks (except after a resume that starts inside one);
* a worker reads a unit with ``read_shard(shard, offset)``, an iterator of
  chunks, taking chunks until it has the unit's samples; it keeps the
  iterator (and what it read past the unit) when the next unit it takes
  continues the same shard there, else it reopens.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

try:  # numpy 2 moved these
    from numpy.exceptions import TooHardError
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy import TooHardError, byte_bounds  # type: ignore[attr-defined,no-redef]

from .chunks import Stamped
from .indexed import IndexedReadError, RandomAccessSource, UnitReader, _short, blob_arrays, safe_repr
from .read_units import ReadUnit
from .messages import plain_arrays

__all__ = ["ShardedReader", "ShardedSource"]

logger = logging.getLogger("blobfeed.feeders")

#: a source may have at most this many shards (its sizes travel to every worker)
MAX_SHARDS = 1 << 24
#: global positions stay below this (as ``blobfeed.coordinator.checkpoint.MAX_POSITION``:
#: a read unit's record says them as signed 64-bit ints): the shard sizes and their sum too
MAX_POSITION = 1 << 62
#: a read_shard that gives this many chunks of no sample in a row fails the source
MAX_EMPTY_CHUNKS = 1000


def _sizes(shard_sizes: Any) -> np.ndarray:
    """``shard_sizes`` as an int64 array, checked: ints >= 0, each and their
    sum below :data:`MAX_POSITION`, at least one sample in all.  Checked
    with numpy (a list of a million shards costs no Python step per shard
    unless it is wrong)."""
    if isinstance(shard_sizes, (str, bytes, Mapping)) or not isinstance(shard_sizes, (Sequence, np.ndarray)):
        raise TypeError(
            f"shard_sizes must be a list of ints (the number of samples of each shard), got "
            f"{type(shard_sizes).__name__}"
        )
    if len(shard_sizes) == 0:
        raise ValueError("shard_sizes is empty: a sharded source needs at least one shard")
    if len(shard_sizes) > MAX_SHARDS:
        raise ValueError(f"shard_sizes has {len(shard_sizes)} shards; at most {MAX_SHARDS}")

    def bad(k: int) -> ValueError:
        v = shard_sizes[k]
        shown = int(v) if isinstance(v, np.integer) else v
        return ValueError(f"shard_sizes[{k}] must be an int >= 0 (samples in shard {k}), got {safe_repr(shown)}")

    def too_big(k: int) -> ValueError:
        return ValueError(
            f"shard_sizes[{k}] = {int(shard_sizes[k])}: at most {MAX_POSITION - 1} samples (blobfeed counts "
            "global positions in signed 64-bit ints)"
        )

    if isinstance(shard_sizes, np.ndarray):
        if shard_sizes.ndim != 1 or shard_sizes.dtype.kind not in "iu":
            raise ValueError(
                f"shard_sizes must be a 1-d array of ints (samples per shard), got dtype {shard_sizes.dtype}, "
                f"shape {shard_sizes.shape}"
            )
        raw = shard_sizes
    else:
        if not all(issubclass(t, _INT) and not issubclass(t, _BOOL) for t in set(map(type, shard_sizes))):
            raise bad(next(k for k, v in enumerate(shard_sizes)
                           if isinstance(v, _BOOL) or not isinstance(v, _INT)))
        try:
            raw = np.asarray(shard_sizes)
        except OverflowError:
            raw = np.asarray(shard_sizes, dtype=object)
        if raw.dtype.kind not in "iu":  # ints past 64 bits, numpy ints of mixed signs: one by one
            for k, v in enumerate(shard_sizes):
                if v < 0:
                    raise bad(k)
                if v >= MAX_POSITION:
                    raise too_big(k)
            raw = np.array([int(v) for v in shard_sizes], dtype=np.int64)
    if raw.dtype.kind == "i":
        neg = np.flatnonzero(raw < 0)
        if len(neg):
            raise bad(int(neg[0]))
    big = np.flatnonzero(raw >= MAX_POSITION)
    if len(big):
        raise too_big(int(big[0]))
    sizes = raw.astype(np.int64)
    # each size < 2**62 and at most 2**24 of them: the int64 sum may wrap
    # only when the largest times the count reaches 2**62; then summed exactly
    if int(sizes.max()) * len(sizes) >= MAX_POSITION:
        total = 0
        for k, v in enumerate(sizes.tolist()):
            total += v
            if total >= MAX_POSITION:
                raise ValueError(
                    f"shard_sizes sum to {sum(sizes.tolist())} samples (from shard_sizes[{k}] on); at most "
                    f"{MAX_POSITION - 1} samples (blobfeed counts global positions in signed 64-bit ints)"
                )
    if int(sizes.sum()) < 1:
        raise ValueError(f"shard_sizes {list(map(int, sizes[:8]))}... has no sample: a source needs at least one")
    return sizes


_INT = (int, np.integer)
_BOOL = (bool, np.bool_)


def sizes_digest(sizes: np.ndarray) -> str:
    """What a state records of the shard sizes: their SHA-256 (as int64, little-endian)."""
    return "sha256:" + hashlib.sha256(sizes.astype("<i8").tobytes()).hexdigest()[:32]


class ShardedSource(RandomAccessSource):
    """Data in shards, each read sequentially, and how blobfeed reads it.

    Pass it where a ``fetch_fun`` goes: ``init_data_input_workers``,
    ``init_reader``, ``FeedServer.serve_source``.  Its batch stream is a
    function of the shards, the seed, the epoch and the batch size only, as
    for a :class:`RandomAccessSource` (docs/SOURCES.md).

    Args:
        shard_sizes: the number of samples of each shard (ints >= 0), in
            shard order 0, 1, ...: the order is drawn from it.
        read_shard: ``read_shard(shard, offset)``: an iterable of chunks
            holding the samples of shard ``shard`` from sample ``offset`` on,
            in order.  A chunk is a tuple or list with one array per blob (a
            dict blob name -> array too), all with the same number of
            samples along their batch axis (``batch_columns``), any number.
            It must pickle for ``backend="processes"`` (cloudpickle).
        shuffle: each epoch reads the shards in a permutation drawn from
            ``(seed, epoch)``; False: shard 0, 1, ... in order.  The samples
            of a shard stay in order (see ``shuffle_block``).
        seed: the shuffle's seed; None: the wiring's ``seed``.
        read_size: samples a worker reads at once (one read unit, never
            across a shard's end); None: the batch size.
        window: as :class:`RandomAccessSource`'s.
        shuffle_block: 0: the samples of a shard in order; B >= 2: each run
            of B consecutive samples of a shard (from its start) is permuted,
            by a permutation drawn from ``(seed, epoch, shard, block)`` (also
            without ``shuffle``); a read unit then covers whole blocks.
    """

    kind = "sharded source"

    def __init__(
        self,
        shard_sizes: Sequence[int],
        read_shard: Callable[[int, int], Iterable[Any]],
        *,
        shuffle: bool = False,
        seed: int | None = None,
        read_size: int | None = None,
        window: int | None = None,
        shuffle_block: int = 0,
    ) -> None:
        from ..arguments import check_flag, check_index

        self.shard_sizes = _sizes(shard_sizes)
        if not callable(read_shard):
            raise TypeError(f"read_shard must be callable (shard, offset) -> iterable of chunks, got "
                            f"{type(read_shard).__name__}")
        self.read_shard = read_shard
        self.dataset = None
        self.shuffle = check_flag("shuffle", shuffle)
        self.seed = None if seed is None else check_index("seed", seed, minimum=0)
        self.read_size = None if read_size is None else check_index("read_size", read_size)
        self.window = None if window is None else check_index("window", window)
        self.shuffle_block = check_index("shuffle_block", shuffle_block, minimum=0)
        if self.shuffle_block == 1:
            self.shuffle_block = 0  # a block of one sample is no shuffle

    def __repr__(self) -> str:
        return (
            f"ShardedSource({len(self.shard_sizes)} shards of {int(self.shard_sizes.sum())} samples, "
            f"{getattr(self.read_shard, '__qualname__', type(self.read_shard).__qualname__)}, "
            f"shuffle={self.shuffle}, seed={self.seed}, read_size={self.read_size}, window={self.window}, "
            f"shuffle_block={self.shuffle_block})"
        )

    def length(self, source: str) -> int:
        return int(self.shard_sizes.sum())

    def reader(self, source: str, n: int, seed: int, blob_names: Sequence[str], axes: Sequence[int]) -> "ShardedReader":
        return ShardedReader(source, self, n, seed, blob_names, axes)


class _Open:
    """A worker's open shard: the iterator, where it is, what it read past
    the last unit (arrays per blob, and their sample count)."""

    __slots__ = ("shard", "opened", "at", "it", "rest", "count")

    def __init__(
        self, shard: int, opened: int, at: int, it: Iterator[Any], rest: list[np.ndarray] | None, count: int,
    ) -> None:
        self.shard = shard
        #: the offset read_shard was called with
        self.opened = opened
        self.at = at
        self.it = it
        self.rest = rest
        self.count = count

    def close(self) -> None:
        close = getattr(self.it, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # a reader's own cleanup failing does not fail the stream
                logger.debug("closing a shard iterator raised", exc_info=True)


class ShardedReader(UnitReader):
    """The ``fetch_fun`` of a sharded source: takes the next read unit, reads
    it from its shard, returns it as one chunk stamped with the unit's
    number.  Raises StopIteration when no unit is left.

    Pickles without its unit source and its open shards.
    """

    def __init__(
        self, source: str, spec: ShardedSource, n: int, seed: int, blob_names: Sequence[str], axes: Sequence[int],
    ) -> None:
        self.source = source
        self.dataset = None
        self.read_shard = spec.read_shard
        self.sizes = spec.shard_sizes
        #: where each shard starts when the shards are in order (sample ids)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.block = spec.shuffle_block
        self.shuffle = spec.shuffle
        self.n = n
        self.seed = seed
        self.blob_names = tuple(blob_names)
        self.axes = tuple(axes)
        self.units: Any = None
        #: ((epoch, shard order, ends of the shards in that order), ...): see _epoch
        self._order: Any = None
        #: ((epoch, shard, block), its permutation): the last block drawn
        self._perm: Any = None
        #: worker id -> its open shard (threads share one reader)
        self._open: dict[int, _Open] = {}
        #: per worker: its last unit (arrays, shard, first sample, end) when
        #: its arrays are the chunk's own (not copied): blobfeed holds them
        #: on, and a read_shard that overwrites its buffer would change them
        #: (see _Held)
        self._lent: dict[int, tuple[list[np.ndarray], int, int, int]] = {}

    @property
    def fingerprint(self) -> tuple[int, str, int]:
        """What a later wiring call and a state must agree on: shard count,
        sizes' digest, shuffle_block."""
        return len(self.sizes), sizes_digest(self.sizes), self.block

    def __repr__(self) -> str:
        what = getattr(self.read_shard, "__qualname__", type(self.read_shard).__qualname__)
        return (f"<the reader of sharded source {self.source!r}: read_shard {what} over {len(self.sizes)} shards "
                f"of {self.n} samples>")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["units"] = None
        state["_order"] = None
        state["_perm"] = None
        state["_open"] = {}
        state["_lent"] = {}
        return state

    # -- the order ----------------------------------------------------------------
    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s shard order and where each shard ends in it.
        The last two epochs are kept (the dispenser makes units of the next
        epoch while the dealer checks those of this one): a tuple read and
        replaced at once, as threads share it."""
        cached = self._order or ()
        for entry in cached:
            if entry[0] == epoch:
                return entry[1], entry[2]
        k = len(self.sizes)
        if self.shuffle:
            order = np.random.default_rng((self.seed, epoch)).permutation(k).astype(np.int64)
        else:
            order = np.arange(k, dtype=np.int64)
        entry = (epoch, order, np.cumsum(self.sizes[order]))
        self._order = (entry,) + tuple(cached[:1])
        return entry[1], entry[2]

    def locate(self, g: int) -> tuple[int, int, int]:
        """Global position ``g``: its shard, its offset in the shard's
        order, and the global position where that shard ends."""
        epoch, p = divmod(g, self.n)
        order, ends = self._epoch(epoch)
        i = int(np.searchsorted(ends, p, side="right"))  # skips shards of no sample
        k = int(order[i])
        end = int(ends[i])
        return k, p - (end - int(self.sizes[k])), epoch * self.n + end

    def unit_end(self, g: int, read_size: int) -> int:
        """Where the unit that starts at ``g`` ends: ``read_size`` samples,
        never past its shard's end; with ``shuffle_block``, at a block's end."""
        k, off, end = self.locate(g)
        hi = min(g + read_size, end)
        b = self.block
        if b and hi < end:
            start = g - off  # the shard's first global position
            down = (hi - start) // b * b
            hi = start + down if start + down > g else min(start + (off // b + 1) * b, end)
        return hi

    def _block_perm(self, epoch: int, k: int, blk: int, size: int) -> np.ndarray:
        """The permutation of block ``blk`` of shard ``k`` in ``epoch`` (the
        last one drawn is kept: the units of a large block ask for it again)."""
        key = (epoch, k, blk)
        cached = self._perm
        if cached is not None and cached[0] == key:
            return cached[1]
        perm = np.random.default_rng((self.seed, epoch, k, blk)).permutation(size)
        self._perm = (key, perm)
        return perm

    def indexes(self, r: ReadUnit) -> list[int]:
        """The sample ids unit ``r`` reads (shard k's sample o is id
        ``sum(shard_sizes[:k]) + o``)."""
        k, lo, _ = self.locate(r.lo)
        hi = lo + (r.hi - r.lo)
        base = int(self.starts[k])
        if not self.block:
            return list(range(base + lo, base + hi))
        return [base + int(o) for o in self._in_blocks(r.lo // self.n, k, lo, hi)]

    def _in_blocks(self, epoch: int, k: int, lo: int, hi: int) -> np.ndarray:
        """The shard's samples at positions ``lo .. hi`` of its order (with shuffle_block)."""
        b = self.block
        size = int(self.sizes[k])
        first = lo // b
        parts = []
        for blk in range(first, (hi - 1) // b + 1):
            s = blk * b
            parts.append(s + self._block_perm(epoch, k, blk, min(b, size - s)))
        return np.concatenate(parts)[lo - first * b:hi - first * b]

    def _shard_of(self, sample_id: int) -> tuple[int, int]:
        """Sample id -> (shard, sample in it)."""
        k = int(np.searchsorted(self.starts, sample_id, side="right")) - 1  # the last shard starting there
        return k, sample_id - int(self.starts[k])

    def where(self, sample_id: int) -> str:
        return "shard {} sample {}".format(*self._shard_of(sample_id))

    def first_index(self, r: ReadUnit) -> int:
        """The first sample id unit ``r`` reads (one block's permutation
        with ``shuffle_block``, not the unit's list)."""
        k, lo, _ = self.locate(r.lo)
        base = int(self.starts[k])
        if not self.block:
            return base + lo
        return base + int(self._in_blocks(r.lo // self.n, k, lo, lo + 1)[0])

    def span(self, idx: Sequence[int]) -> str:
        k, o = self._shard_of(idx[0])
        if not self.block:
            return f"shard {k} samples {o}..{o + len(idx) - 1}"
        return f"shard {k} samples {_short([self._shard_of(i)[1] for i in idx])}"

    # -- reading ------------------------------------------------------------------
    def __call__(self, worker_id: int, batch_size: int) -> Stamped:
        r = self.units.take(worker_id)
        if r is None:
            self._close(worker_id)
            raise StopIteration
        k, lo, _ = self.locate(r.lo)
        hi = lo + (r.hi - r.lo)
        b = self.block
        if not b:
            arrays = self._take(worker_id, k, lo, hi)
            into = self._slot_for([(a.shape, a.dtype) for a in arrays], arrays)
            if into is not None:  # a worker process: copied once, into its slot
                for dst, a in zip(into, arrays):
                    np.copyto(dst, a, casting="no")
                return Stamped(into, r.unit)
            out = [_own(a) for a in arrays]
            for o, a in zip(out, arrays):
                if o is a:  # handed on as read: the next chunks must not overwrite it
                    self._lent[worker_id] = (out, k, lo, hi)
                    break
            return Stamped(out, r.unit)
        size = int(self.sizes[k])
        read_lo, read_hi = lo // b * b, min(-(-hi // b) * b, size)
        arrays = self._take(worker_id, k, read_lo, read_hi)
        sel = self._in_blocks(r.lo // self.n, k, lo, hi) - read_lo
        layout = [(a.shape[:ax] + (len(sel),) + a.shape[ax + 1:], a.dtype) for a, ax in zip(arrays, self.axes)]
        into = self._slot_for(layout, arrays)
        if into is not None:  # the selection taken straight into the worker's slot
            # mode="clip": with "raise" numpy buffers the output, a copy more (sel is in range)
            return Stamped([np.take(a, sel, axis=ax, out=o, mode="clip") for a, ax, o in zip(arrays, self.axes, into)],
                           r.unit)
        return Stamped([np.take(a, sel, axis=ax) for a, ax in zip(arrays, self.axes)], r.unit)

    def _slot_for(self, layout: list[tuple[tuple[int, ...], np.dtype]], arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        """Arrays of ``layout`` in the worker process's slot (see
        ``UnitReader.into``), when there is one and every array is plain
        (what a slot may hold: messages.plain_arrays)."""
        if self.into is None or plain_arrays(arrays) is None:
            return None
        return self.into(layout)

    def _close(self, worker_id: int) -> None:
        self._lent.pop(worker_id, None)
        was = self._open.pop(worker_id, None)
        if was is not None:
            was.close()

    def worker_ended(self, worker_id: int) -> None:
        """The worker stopped (a stop, a failure, its last unit): its open
        shard is closed, in its own thread."""
        self._close(worker_id)

    def _take(self, worker_id: int, k: int, lo: int, hi: int) -> list[np.ndarray]:
        """Samples ``lo .. hi-1`` of shard ``k``, one array per blob: from
        this worker's open iterator when it stands there, else from a new
        ``read_shard(k, lo)``."""
        size = int(self.sizes[k])
        cur = self._open.pop(worker_id, None)
        if cur is not None and (cur.shard != k or cur.at != lo):
            cur.close()
            cur = None
        if cur is None:
            try:
                it = iter(self.read_shard(k, lo))
            except Exception as exc:
                raise IndexedReadError(f"source {self.source!r}: read_shard({k}, {lo}) raised {safe_repr(exc)}") from exc
            cur = _Open(k, lo, lo, it, None, 0)
        try:
            out, rest, extra = self._read_from(cur, k, lo, hi, self._lent.pop(worker_id, None))
        except BaseException:
            cur.close()  # a failed read leaves no file open behind it
            raise
        if hi < size:
            self._open[worker_id] = _Open(k, cur.opened, hi, cur.it, rest, extra)
        else:
            cur.close()
        return out

    def _read_from(
        self, cur: _Open, k: int, lo: int, hi: int, lent: tuple[list[np.ndarray], int, int, int] | None = None,
    ) -> tuple[list[np.ndarray], list[np.ndarray] | None, int]:
        """Samples ``lo .. hi-1`` of shard ``k`` from ``cur``: the unit's
        arrays, what was read past it and how many samples that is.  At the
        shard's end, checks that nothing follows.  ``lent``: the worker's
        last unit, handed on as the chunk's own arrays, with its shard and
        samples: no new chunk may share memory with it (unless it reads
        those samples again), nor with the unit's earlier chunks."""
        size = int(self.sizes[k])
        want = hi - lo
        parts: list[list[np.ndarray]] = []
        have = 0
        empty = 0  # chunks of no sample in a row
        held = None  # made at the first chunk read (a unit read from what was left reads none)
        if cur.rest is not None:
            parts.append(cur.rest)
            have = cur.count
        while have < want:
            at = lo + have
            try:
                chunk = next(cur.it)
            except StopIteration:
                raise IndexedReadError(
                    f"source {self.source!r}: shard {k} ended at sample {at} (read_shard({k}, {cur.opened}) "
                    f"stopped); shard_sizes[{k}] = {size}: expected samples up to {size}"
                ) from None
            except Exception as exc:
                raise IndexedReadError(
                    f"source {self.source!r}: read_shard({k}, {cur.opened}) raised {safe_repr(exc)} reading shard "
                    f"{k} at sample {at}"
                ) from exc
            arrays, count = self._chunk(k, at, chunk)
            if held is None:
                held = _Held()
                # the last unit's memory may come again only for the same
                # samples (a new epoch reading that shard from an array in memory)
                if lent is not None and (lent[1] != k or lent[3] <= lo):
                    held.take(lent[0])
                if cur.rest is not None:
                    held.take(cur.rest)
            j = held.take(arrays)
            if j >= 0:
                raise IndexedReadError(
                    f"source {self.source!r}: shard {k}, the chunk read_shard gave at sample {at}, blob "
                    f"{self.blob_names[j]!r}: read_shard yielded an array that shares memory with one it yielded "
                    "before and blobfeed still holds (it overwrote its buffer?): yield a new array each time "
                    "(or .copy())"
                )
            if count:
                parts.append(arrays)
                have += count
                empty = 0
            else:
                empty = self._empty(empty, k, cur.opened, at, f"samples up to {size}")
        # the unit's arrays, and what was read past it
        out, rest = self._cut(k, lo, parts, want, have)
        extra = have - want
        if hi == size:
            # the shard's end: nothing may follow (a shard longer than its size)
            empty = 0
            try:
                while not extra:
                    extra = self._chunk(k, size, next(cur.it))[1]
                    if not extra:
                        empty = self._empty(empty, k, cur.opened, size, "its end")
            except StopIteration:
                pass
            except IndexedReadError:
                raise
            except Exception as exc:
                raise IndexedReadError(
                    f"source {self.source!r}: read_shard({k}, {cur.opened}) raised {safe_repr(exc)} after the "
                    f"shard's last sample ({size - 1})"
                ) from exc
            if extra:
                raise IndexedReadError(
                    f"source {self.source!r}: shard {k} has samples past its end: shard_sizes[{k}] = {size}, "
                    f"but read_shard({k}, {cur.opened}) gave more"
                )
        return out, rest, extra

    def _empty(self, run: int, k: int, opened: int, at: int, expected: str) -> int:
        """One more chunk of no sample in a row (``run`` before it): raises
        after :data:`MAX_EMPTY_CHUNKS` (a read_shard that gives empty chunks
        forever would hold its worker past any stop)."""
        run += 1
        if run >= MAX_EMPTY_CHUNKS:
            raise IndexedReadError(
                f"source {self.source!r}: read_shard({k}, {opened}) gave {run} chunks in a row without a sample "
                f"at sample {at} of shard {k} (shard_sizes[{k}] = {int(self.sizes[k])}: expected {expected})"
            )
        return run

    def _cut(
        self, k: int, lo: int, parts: list[list[np.ndarray]], want: int, have: int,
    ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """The first ``want`` samples of ``parts`` (one array per blob), and
        the rest (None: none); every part has the first one's dtype and
        per-sample shape."""
        axes = self.axes
        first = parts[0]
        for p, arrays in enumerate(parts[1:], 1):
            for j, (a, f, ax) in enumerate(zip(arrays, first, axes)):
                got, had = a.shape[:ax] + a.shape[ax + 1:], f.shape[:ax] + f.shape[ax + 1:]
                if got != had or a.dtype != f.dtype:
                    raise IndexedReadError(
                        f"source {self.source!r}: shard {k}, blob {self.blob_names[j]!r}: a chunk read for "
                        f"samples {lo}..{lo + want - 1} has dtype {a.dtype}, per-sample shape {got}; the one "
                        f"before it in the unit has dtype {f.dtype}, per-sample shape {had}"
                    )
        # what is read past the unit lies in the last part alone (reading
        # stops once the unit is whole): only its head joins the unit, its
        # tail stays a view for the next unit (no copy of a large chunk)
        rest = None
        if have > want:
            last = parts[-1]
            count = int(last[0].shape[axes[0]])
            cut = count - (have - want)
            rest = [_slice(a, ax, cut, count) for a, ax in zip(last, axes)]
            parts = parts[:-1] + [[_slice(a, ax, 0, cut) for a, ax in zip(last, axes)]]
        if len(parts) == 1:
            return parts[0], rest
        return [np.concatenate([p[j] for p in parts], axis=ax) for j, ax in enumerate(axes)], rest

    def _chunk(self, k: int, at: int, chunk: Any) -> tuple[list[np.ndarray], int]:
        """A chunk of shard ``k`` whose first sample is ``at``: one array per
        blob and their sample count, checked."""
        where = f"source {self.source!r}: shard {k}, the chunk read_shard gave at sample {at}"
        arrays = blob_arrays(where, self.blob_names, chunk, batched=True)
        count = None
        for b, a, ax in zip(self.blob_names, arrays, self.axes):
            if a.ndim <= ax:
                raise IndexedReadError(
                    f"{where}, blob {b!r}: shape {a.shape} has no batch axis {ax} (a chunk's arrays carry "
                    "the batch axis)"
                )
            if count is None:
                count = a.shape[ax]
            elif a.shape[ax] != count:
                raise IndexedReadError(
                    f"{where}, blob {b!r}: {a.shape[ax]} samples; the blob(s) before it have {count}"
                )
        return arrays, count or 0


class _Held:
    """The arrays a unit's read holds (chunks read for it, what the last
    unit left, the last unit itself when handed on as read), to tell a new
    chunk that shares memory with one of them: a read_shard that writes
    every chunk into the same buffer (``readinto``) would change them.

    Cheap: arrays are grouped by the object owning their memory (the root
    of their ``base`` chain); a new array whose owner holds nothing here
    (a reader making new arrays) costs a dict look-up.  One whose owner
    does (the same buffer again, or slices of one large array) is compared
    with that owner's held arrays (``np.may_share_memory``: bounds only,
    then ``np.shares_memory`` to rule out interleaved strides); past
    :data:`HELD_SCAN` of them, first against their span, by byte bounds
    (slices of one array, read on, lie beside it)."""

    __slots__ = ("by_owner",)

    def __init__(self) -> None:
        #: id(owner) -> [owner (kept: its id stays its), held arrays, span (lo, hi) or None]
        self.by_owner: dict[int, list[Any]] = {}

    def take(self, arrays: Sequence[np.ndarray]) -> int:
        """Holds ``arrays`` (one chunk's), unless one of them shares memory
        with an array held before: then its position, else -1."""
        by_owner = self.by_owner
        new = []
        for j, a in enumerate(arrays):
            if not a.nbytes:
                continue
            owner = _owner(a)
            entry = by_owner.get(id(owner))
            bounds = None
            if entry is not None:
                bounds = _overlaps(a, entry)
                if bounds is True:
                    return j
            new.append((a, owner, bounds))
        # held once the whole chunk passed: its own arrays may share memory
        for a, owner, bounds in new:
            entry = by_owner.get(id(owner))
            if entry is None:
                by_owner[id(owner)] = [owner, [a], None]
                continue
            entry[1].append(a)
            if entry[2] is not None:
                lo, hi = bounds if isinstance(bounds, tuple) else _bounds(a)
                entry[2] = (min(entry[2][0], lo), max(entry[2][1], hi))
        return -1


#: an owner's held arrays a new array is compared with one by one; past
#: this many, against their span first
HELD_SCAN = 4


def _overlaps(a: np.ndarray, entry: list[Any]) -> bool | tuple[int, int] | None:
    """True when ``a`` shares memory with an array of ``entry`` (an
    owner's), else its byte bounds if they were needed, else None."""
    held = entry[1]
    bounds = None
    if len(held) > HELD_SCAN:
        if entry[2] is None:
            spans = [_bounds(b) for b in held]
            entry[2] = (min(s[0] for s in spans), max(s[1] for s in spans))
        bounds = lo, hi = _bounds(a)
        if hi <= entry[2][0] or lo >= entry[2][1]:
            return bounds  # beside all of them (the next slice of a large array)
    for b in reversed(held):
        if np.may_share_memory(a, b) and _shares(a, b):
            return True
    return bounds


def _owner(a: np.ndarray) -> Any:
    """The object owning ``a``'s memory: the first array of its base chain
    that owns its data, or the buffer (a memoryview's object) under it."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    base = a.base
    if base is None:
        return a
    if type(base) is memoryview and base.obj is not None:
        return base.obj
    return base


def _bounds(a: np.ndarray) -> tuple[int, int]:
    """The bytes ``a`` spans: ``[lo, hi)`` addresses."""
    lo, hi = byte_bounds(a)
    return int(lo), int(hi)


def _shares(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` share a byte (bounds overlapping: strides
    may interleave); too hard to tell in a bounded time: not proven, False."""
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))  # type: ignore[arg-type]  # numpy's stub lists -1 and 0 only
    except TooHardError:
        return False


def _slice(a: np.ndarray, ax: int, lo: int, hi: int) -> np.ndarray:
    return a[(slice(None),) * ax + (slice(lo, hi),)]


def _held_bytes(a: np.ndarray) -> int:
    """The bytes of the memory ``a`` keeps alive: the array (or buffer) it views."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    held = a.nbytes
    if a.base is not None:
        try:
            with memoryview(a.base) as m:
                held = max(held, m.nbytes)
        except TypeError:
            pass
    return held


def _own(a: np.ndarray) -> np.ndarray:
    """``a``, copied when it views memory more than twice its size (a few
    samples cut from a large chunk): a unit waiting in the window must not
    keep its whole chunk alive."""
    if a.base is None or 2 * a.nbytes >= _held_bytes(a):
        return a
    return a.copy()
