"""What a worker tells its intake, as one small vocabulary for every backend.

A worker loop (:func:`~blobfeed.feeders.worker_loop.worker_events`) yields
these events; a thread hands them to its intake at once, a worker process
pickles them down its pipe, a Ray actor yields them in bundles.  They are
the whole protocol, as the three little item classes of CPython's
``concurrent.futures.process`` are for its pool:

* :class:`Result`: ``fetch_fun`` returned ``raw`` (with a stateful
  fetcher's state after the call);
* :class:`Raised`: ``fetch_fun`` raised (``fatal``: starting the worker
  failed instead: ``worker_init_fun`` raised, or it could not be loaded);
* :class:`EpochDone`: ``fetch_fun`` raised StopIteration and the next epoch
  begins;
* :class:`Exhausted`: ``fetch_fun`` raised StopIteration in the last epoch;
* :class:`Note`: something for the receiving side to log (once).

Across a process or a node a result's plain arrays may travel as
:class:`Arrays`, their bytes written once into a shared buffer (a slot of
shared memory, a Ray object) by :func:`write_arrays` and read back as views
by :func:`read_arrays`; an exception travels packed (``error`` its pickle,
``tb`` its traceback text: ``transport.pack_exception``).  Nothing here
pickles or unpickles: each transport does that its own way.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .chunks import Unsendable

__all__ = [
    "ALIGN", "Arrays", "EpochDone", "Exhausted", "Note", "Raised", "Result", "Unsendable", "align",
    "LayoutCache", "arrays_nbytes", "layout_nbytes", "packed_nbytes", "place_arrays", "plain_arrays", "read_arrays", "sendable",
    "unsendable", "without_layout", "write_arrays",
]

#: every array in a shared buffer starts at a multiple of this
ALIGN = 64


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Result(NamedTuple):
    """``fetch_fun`` returned ``raw`` after ``seconds``; ``state``: a
    stateful fetcher's ``state_dict()`` right after the call, else None."""

    seconds: float
    raw: Any
    state: Any = None
    #: a batch a worker process assembled from several calls
    #: (:mod:`.worker_batches`): the seconds of each call whose samples
    #: start in it (``seconds`` is their sum); None: one call
    calls: tuple[float, ...] | None = None


class Raised(NamedTuple):
    """``fetch_fun`` (or, ``fatal``, the worker's start) raised ``error``:
    the exception itself, or across a process or node its pickle, with
    ``tb`` its traceback text (``transport.pack_exception``)."""

    seconds: float
    error: Any
    fatal: bool = False
    tb: str | None = None


class EpochDone(NamedTuple):
    """``fetch_fun`` raised StopIteration; the worker goes on with the next epoch."""

    seconds: float
    #: a stateful fetcher's state after the StopIteration (the next epoch's start)
    state: Any = None


class Exhausted(NamedTuple):
    """``fetch_fun`` raised StopIteration in the last epoch: the worker is done."""

    seconds: float


class Note(NamedTuple):
    """Text for the receiving side to log as a warning."""

    text: str


class Arrays(NamedTuple):
    """A result's arrays in a shared buffer: ``(dtype, shape, offset)`` of
    each (the dtype itself: its ``.str`` loses a structured dtype's fields);
    ``where``: which buffer (a slot's index; 0 in a Ray bundle).  A worker
    process sends ``meta=None`` for "the layout of my last result in a
    slot" (see :class:`LayoutCache`)."""

    where: int
    meta: list[tuple[np.dtype, tuple[int, ...], int]] | None
    as_tuple: bool


#: what a worker can send: everything above
Event = Result | Raised | EpochDone | Exhausted | Note


def plain_arrays(raw: Any) -> list[np.ndarray] | None:
    """The arrays of a result that may be written into a shared buffer
    (plain ``numpy.ndarray``s, native byte order, no objects), else None."""
    if not isinstance(raw, (list, tuple)) or not raw:
        return None
    for a in raw:
        if type(a) is not np.ndarray or a.dtype.hasobject or not a.dtype.isnative:
            return None
    return list(raw)


def arrays_nbytes(arrays: Sequence[np.ndarray]) -> int:
    """Bytes ``arrays`` take in a shared buffer (each aligned)."""
    return sum(align(a.nbytes) for a in arrays)


def write_arrays(arrays: Sequence[np.ndarray], buf: Any, base: int, where: int, as_tuple: bool) -> Arrays:
    """Copy ``arrays`` once into ``buf`` (anything with the buffer protocol)
    from byte ``base`` on; what reads them back (:func:`read_arrays`)."""
    views, packed = place_arrays([(a.shape, a.dtype) for a in arrays], buf, base, where, as_tuple)
    for dst, a in zip(views, arrays):
        if a.nbytes:
            np.copyto(dst, a, casting="no")
    return packed


def layout_nbytes(layout: Sequence[tuple[tuple[int, ...], np.dtype]]) -> int:
    """Bytes arrays of these ``(shape, dtype)`` take in a shared buffer (each aligned)."""
    return sum(align(math.prod(shape) * dtype.itemsize) for shape, dtype in layout)


def place_arrays(
    layout: Sequence[tuple[tuple[int, ...], np.dtype]], buf: Any, base: int, where: int, as_tuple: bool,
) -> tuple[list[np.ndarray], Arrays]:
    """Writable arrays of these ``(shape, dtype)`` in ``buf`` from byte
    ``base`` on, laid out as :func:`write_arrays` lays them, and the
    :class:`Arrays` that reads what is written into them back."""
    views = []
    meta = []
    off = 0
    for shape, dtype in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        views.append(np.ndarray(shape, dtype, buffer=buf, offset=base + off) if nbytes else np.empty(shape, dtype))
        meta.append((dtype, shape, off))
        off += align(nbytes)
    return views, Arrays(where, meta, as_tuple)


def read_arrays(root: np.ndarray | None, packed: Arrays) -> list[np.ndarray] | tuple[np.ndarray, ...]:
    """Views of ``root`` (a ``uint8`` array over the buffer, from where the
    arrays were written) for each array of ``packed``.  Every view's base is
    ``root`` (numpy collapses view chains), so ``root`` lives exactly as long
    as some view of it does."""
    arrays = []
    for dt, shape, off in _meta_of(packed):
        n = math.prod(shape) * np.dtype(dt).itemsize
        flat = root[off:off + n] if root is not None and n else np.empty(0, np.uint8)
        arrays.append(flat.view(dt).reshape(shape))
    return tuple(arrays) if packed.as_tuple else arrays


def packed_nbytes(packed: Arrays) -> int:
    """Bytes of the buffer the arrays of ``packed`` span."""
    # math.prod, not np.prod: a fifth of the parent's interpreter time per chunk went to np.prod's dispatch
    return max((off + math.prod(shape) * np.dtype(dt).itemsize for dt, shape, off in _meta_of(packed)), default=0)


def without_layout(event: Result, sent: list[Any]) -> Result:
    """``event`` (a result in a slot) as a worker process sends it: without
    its layout (``meta=None``) when it is the last one sent, ``sent[0]``,
    which it updates.  Pickling the dtypes cost a W7 worker 10-15 µs a
    message, with the caches cold from the unit's copies.

    Only a result whose state is None or an int (a read unit's number) is
    a judge of it: the parent may fail to unpickle another's (a stateful
    fetcher's state of a class it cannot import) and skip it
    (``on_error="skip"``), so such a result always carries its layout and
    leaves ``sent[0]`` as it was, the layout the parent's
    :class:`LayoutCache` holds."""
    raw = event.raw
    if event.state is not None and type(event.state) is not int:
        return event
    if raw.meta == sent[0]:
        return Result(event.seconds, Arrays(raw.where, None, raw.as_tuple), event.state, event.calls)
    sent[0] = raw.meta
    return event


def _meta_of(packed: Arrays) -> list[tuple[np.dtype, tuple[int, ...], int]]:
    if packed.meta is None:
        raise ValueError("a result sent as 'the last layout' is read through its worker's LayoutCache only")
    return packed.meta


class LayoutCache:
    """:func:`packed_nbytes` and :func:`read_arrays` for one worker's
    results, whose layout (the dtypes, shapes and offsets of a result's
    arrays) is mostly the same from one to the next: each array's size is
    worked out once per layout, not once per result (the parent's thread
    does this for every batch).  Not thread-safe: its worker's reader's."""

    __slots__ = ("_meta", "_spans", "nbytes")

    def __init__(self) -> None:
        self._meta: Any = None
        self._spans: list[tuple[Any, tuple[int, ...], int, int]] = []
        #: :func:`packed_nbytes` of the last result given to :meth:`nbytes_of`
        self.nbytes = 0

    def nbytes_of(self, packed: Arrays) -> int:
        """:func:`packed_nbytes` of ``packed``, which :meth:`read` reads next;
        a ``meta`` of None is the last layout seen (every result of the
        worker must be given here, in order, those dropped too).

        Raises:
            ValueError: ``meta`` is None and no layout came before.
        """
        meta = packed.meta
        if meta is None:
            if self._meta is None:
                raise ValueError("a result in a slot said its layout was the last one's, and none came before")
            return self.nbytes
        if meta != self._meta:
            self._spans = [(dt, shape, off, math.prod(shape) * np.dtype(dt).itemsize) for dt, shape, off in meta]
            self.nbytes = max((off + n for _, _, off, n in self._spans), default=0)
            self._meta = meta
        return self.nbytes

    def read(self, root: np.ndarray, packed: Arrays) -> list[np.ndarray] | tuple[np.ndarray, ...]:
        """:func:`read_arrays` of the result last given to :meth:`nbytes_of`."""
        arrays = []
        for dt, shape, off, n in self._spans:
            flat = root[off:off + n] if n else np.empty(0, np.uint8)
            arrays.append(flat.view(dt).reshape(shape))
        return tuple(arrays) if packed.as_tuple else arrays


def unsendable(raw: Any, exc: BaseException, unit: int | None = None) -> Unsendable:
    """The stand-in for ``raw``, which pickling refused with ``exc``."""
    try:
        cause = repr(exc)
    except Exception:  # a broken __repr__ of the error: its type at least
        cause = type(exc).__name__
    return Unsendable(f"{type(raw).__module__}.{type(raw).__qualname__}", cause, unit)


def sendable(raw: Any, dumps: Callable[[Any], Any]) -> Any:
    """``raw`` if ``dumps`` (the transport's pickler) takes it, else an
    :class:`Unsendable` carrying the pickling error (MemoryError included:
    a result too big to pickle is this result's fault, not the worker's)."""
    try:
        dumps(raw)
        return raw
    except Exception as exc:
        return unsendable(raw, exc)
