"""Random-access sources: a dataset with ``__len__`` and ``__getitem__``
(torch's map-style ``Dataset``, grain's ``RandomAccessDataSource``), read by
blobfeed in an order it draws itself.

The order of epoch *e* is ``range(n)``, or with ``shuffle=True`` the
permutation ``numpy.random.default_rng((seed, e)).permutation(n)``: a
global shuffle, not a buffer.  The positions of the whole run are numbered
globally, ``g = e * n + p`` (position *p* of epoch *e*'s order).  They are
handed to the workers as *read units*: ``read_size`` consecutive positions
(fewer at an epoch's end), numbered 0, 1, 2, ... in stream order.  A worker
takes the next unit when it is free (:class:`~blobfeed.feeders.read_units.UnitDispenser`), reads its
samples (``__getitems__`` when the dataset has it, else ``__getitem__`` per
index) and returns them as one chunk stamped with the unit's number; the
dealer (:mod:`.dealing.indexed`) puts the units back in order and cuts the
batches.  So the batches are a function of the data, the seed, the epoch and
the batch size only, whatever the workers and nets.
"""

from __future__ import annotations

import collections.abc
import itertools
import logging
import operator
from typing import Any, Callable, Mapping, Sequence, cast

import numpy as np

from .chunks import Stamped
from .read_units import ReadUnit

__all__ = ["IndexedReadError", "RandomAccessSource", "UnitReader", "is_random_access"]

logger = logging.getLogger("blobfeed.feeders")


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
            batches of at least :data:`~blobfeed.feeders.read_units.UNIT_BYTES` of samples (as many bytes
            as the first unit's samples take), at most
            :data:`~blobfeed.feeders.read_units.MAX_UNIT_BATCHES`.  The stream does not depend on it.
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


class IndexedReadError(Exception):
    """Reading a random-access source failed: names the source, the index and
    (when the sample is at fault) the blob."""


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
        if _is_mapping(samples):  # the unit already stacked
            return Stamped(self._stacked(idx, cast("Mapping[str, Any]", samples)), r.unit)
        return Stamped(self._stack(r.unit, idx, cast("Sequence[Any]", samples)), r.unit)

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
            if _is_mapping(samples):
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
        try:
            fast = self._stack_plain(samples)
        except MemoryError:
            raise self._too_big(unit, idx, samples) from None
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
            except MemoryError:
                raise self._too_big(unit, idx, samples) from None
            except Exception as exc:  # dtypes that do not stack, say
                raise IndexedReadError(
                    f"source {self.source!r}: blob {self.blob_names[k]!r}: the samples of indexes "
                    f"{_short(idx)} do not stack: {safe_repr(exc)}"
                ) from exc
        return out


    def _too_big(self, unit: int, idx: list[int], samples: Sequence[Any]) -> IndexedReadError:
        """The error for a unit whose stacked samples did not fit in memory:
        what each blob of its first sample claims (a view, a broadcast array,
        may claim far more than it holds), times the unit's samples."""
        claims = []
        try:
            for name, a in zip(self.blob_names, self._blobs(idx[0], samples[0])):
                claims.append(f"{name!r} {a.dtype} {a.shape} ({a.nbytes * len(idx)} bytes for the unit)")
        except Exception:  # a sample that is not one array per blob: the count alone
            pass
        return IndexedReadError(
            f"source {self.source!r}: read unit {unit} ({self.span(idx)}): its {len(idx)} samples stacked do not "
            f"fit in memory (MemoryError){': ' + ', '.join(claims) if claims else ''}; per sample, as "
            f"{self.where(idx[0])}"
        )

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
        scalars: list[bool] = []
        for ax, col in zip(self.axes, cols):
            types = set(map(type, col))
            scalar = len(types) == 1 and (t := next(iter(types))) in _SCALARS
            scalars.append(scalar)
            if scalar:
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
        for k, (ax, col, (shape, dtype), scalar) in enumerate(zip(self.axes, cols, layout, scalars)):
            try:
                if into is not None and scalar:
                    # numbers of one numpy type: one assignment, where np.stack
                    # makes an array of each (33 µs against 1.5 µs for 64)
                    into[k][...] = col
                    stacked = into[k]
                elif into is not None:
                    # straight into the worker's slot: no array of our own
                    # (its pages faulted in anew each unit) and no copy after
                    stacked = into[k]
                    first = col[0].shape
                    if ax == 0 and first and 0 not in first[1:] and stacked.flags.c_contiguous \
                            and len(set(map(_SHAPE, col))) == 1:
                        # along the first axis the samples lie one after the
                        # other: one concatenate into the slot's array seen
                        # flat along it, where np.stack makes a view of each
                        # sample first (W7: 12 µs of 180 a unit of 64)
                        np.concatenate(col, axis=0, out=stacked.reshape((-1,) + first[1:]))
                    else:
                        np.stack(col, axis=ax, out=stacked)
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
_SCALARS: dict[type, np.dtype] = {t: np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                     np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
                                     np.complex128, np.longlong, np.ulonglong, np.longdouble, np.clongdouble)}
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


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


def _is_mapping(value: Any) -> bool:
    """``isinstance(value, Mapping)``, a list (what ``__getitems__`` returns
    most) answered at once: typing's ``Mapping`` checks in Python, twice a
    read unit in the worker."""
    return type(value) is not list and isinstance(value, collections.abc.Mapping)
