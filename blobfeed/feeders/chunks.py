"""What a worker hands over: chunks, their validation, and the model's input checks."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Sequence

import numpy as np

from ..errors import ChunkError

__all__ = [
    "Stamped", "Batch", "Chunk", "EpochEnd", "GrantPin", "ChunkValidator", "ModelInput", "Pin", "Unsendable",
    "check_model_inputs", "guess_samples",
]

#: at most this many characters of the pickling error an Unsendable carries
UNSENDABLE_CAUSE_CHARS = 500


class Pin:
    """Something a chunk's arrays keep busy while they live (a shared-memory
    slot of a worker process).  ``views_ok()`` says whether a batch may still
    be handed out as a view of it, or must be copied out so that batches the
    user keeps cannot stall the worker."""

    def views_ok(self) -> bool:
        return True


class GrantPin(Pin):
    """One buffer ``key`` of an owner that rations views of its buffers
    (a worker process's slots, a Ray worker's pinned objects): one per
    chunk, so the owner knows which buffer a batch would view."""

    __slots__ = ("_owner", "_key")

    def __init__(self, owner: Any, key: int) -> None:
        self._owner = owner
        self._key = key

    def views_ok(self) -> bool:
        return bool(self._owner.grant_view(self._key))


class Chunk(NamedTuple):
    """One validated fetcher result: an array per blob, ``n`` samples each."""

    arrays: tuple[np.ndarray, ...]
    n: int
    worker_id: int
    #: the index of the worker's fetch_fun call that returned it (0, 1, ...)
    seq: int = 0
    #: what the arrays keep busy, if anything (see Pin)
    pin: Pin | None = None
    #: a stateful fetch_fun's ``state_dict()`` right after this call (resume)
    state: Any = None


class StoppedWithState(StopIteration):
    """A stateful ``fetch_fun`` raised StopIteration; ``state`` is its
    ``state_dict()`` right after (the next epoch's start: a fetcher that
    starts over at the end of its data has reset itself by then)."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state


class Stamped(NamedTuple):
    """A result of a stateful ``fetch_fun`` with its state right after the
    call (deterministic mode): the state travels with its chunk, so a resume
    restores the fetcher to just after the last chunk the nets consumed."""

    raw: Any
    state: Any


class Batch(NamedTuple):
    """One whole batch: an array (or device value) per blob, ``n`` samples each."""

    arrays: tuple[Any, ...]
    n: int


class EpochEnd(NamedTuple):
    """Where epoch ``epoch`` of a source ends, in a net's share of the stream
    and then in its device queue, after that epoch's last batch: ``Net.run()``
    raises :class:`~blobfeed.EndOfEpoch` for it.  Holds no samples (``n``
    is 0, so whatever counts the samples of queued items counts it right)."""

    epoch: int
    n: int = 0
    arrays: tuple[Any, ...] = ()
    #: the net's batches of the epoch dropped right before it (``drop_last``)
    dropped: int = 0


class Unsendable:
    """Stands in for a result a worker could not pickle to send it to the
    parent (``messages.sendable``): ``type_name`` the result's type,
    ``cause`` the pickling error's repr (at most
    :data:`UNSENDABLE_CAUSE_CHARS`), ``unit`` the read unit it was (a
    random-access source), else None.  The parent's validator refuses it,
    saying so."""

    __slots__ = ("type_name", "cause", "unit")

    def __init__(self, type_name: str, cause: str = "", unit: int | None = None) -> None:
        self.type_name = type_name
        self.cause = cause[:UNSENDABLE_CAUSE_CHARS]
        self.unit = unit

    def __getstate__(self) -> tuple[str, str, int | None]:
        return self.type_name, self.cause, self.unit

    def __setstate__(self, state: tuple[str, str, int | None]) -> None:
        self.type_name, self.cause, self.unit = state

    def __repr__(self) -> str:
        return f"<unpicklable {self.type_name}>"

    def problem(self) -> str:
        """What the validator says of it (after the source and worker)."""
        unit = "" if self.unit is None else f" (read unit {self.unit})"
        return (
            f"the worker's result{unit}, a {self.type_name}, could not be sent to the parent: "
            f"pickling it raised {self.cause or 'an error'}"
        )


def _bad_chunk(where: str, detail: str, kind: type[Exception] = ValueError) -> ChunkError:
    """A ChunkError whose ``__cause__`` is the plain TypeError/ValueError of the check."""
    err = ChunkError(f"{where}: {detail}")
    err.__cause__ = kind(detail)
    return err


def _astype_hint(dtype: np.dtype | None) -> str:
    """How to convert a chunk's array to ``dtype`` (a number or bool type), or ""."""
    if dtype is None or dtype.kind not in "biufc":
        return ""
    return f"; convert it in fetch_fun: arr.astype(np.{'bool_' if dtype.kind == 'b' else dtype.name})"


def _not_an_array(arr: Any) -> str:
    """What a blob that is not a numpy array is, and how to make it one:
    a tensor of torch (or anything with ``.numpy()``, such as TensorFlow's)
    names ``.numpy()``; anything numpy can convert names ``np.asarray``.
    Duck-typed: torch is never imported."""
    kind = type(arr)
    module = getattr(kind, "__module__", "") or ""
    name = f"{module.split('.')[0]}.{kind.__name__}" if module and module != "builtins" else kind.__name__
    if callable(getattr(arr, "numpy", None)):
        if module.split(".")[0] == "torch":
            return (
                f"got a {name}: return tensor.numpy() instead (tensor.detach().cpu().numpy() for "
                "one that requires grad or lives on a GPU); blobfeed carries numpy arrays"
            )
        return f"got a {name}: return its .numpy() instead; blobfeed carries numpy arrays"
    if hasattr(arr, "__array__") or isinstance(arr, (list, tuple, int, float, bool)):
        return f"expected a numpy.ndarray, got {name}: convert it with np.asarray(...)"
    return f"expected a numpy.ndarray, got {name}"


def _plain(arr: Any, where: str) -> np.ndarray:
    """The one rule for what a blob may be: a plain ``numpy.ndarray`` in
    native byte order.

    A masked array is refused: its mask cannot reach a model, and a batch cut
    from several chunks would come back unmasked.  Any other ndarray subclass
    (recarray, memmap, matrix) is taken as a plain view of the same memory, so
    every batch is a plain ndarray whether it is a view of one chunk or a
    concatenation.  Non-native byte order (a ``'>f4'`` file) is converted:
    passed on as is, onnxruntime would read wrong numbers.
    """
    if not isinstance(arr, np.ndarray):
        raise _bad_chunk(where, _not_an_array(arr), TypeError)
    if isinstance(arr, np.ma.MaskedArray):
        raise _bad_chunk(
            where,
            "got a numpy.ma.MaskedArray: masks are not carried to the model; fill it "
            "(arr.filled(value)) and pass the mask as a blob of its own if the model needs it",
            TypeError,
        )
    arr = arr.view(np.ndarray) if type(arr) is not np.ndarray else arr
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr


#: ONNX tensor element types and the numpy dtype a chunk must have for them.
_ONNX_DTYPES: dict[str, np.dtype] = {
    "tensor(float)": np.dtype(np.float32), "tensor(double)": np.dtype(np.float64),
    "tensor(float16)": np.dtype(np.float16), "tensor(bool)": np.dtype(np.bool_),
    "tensor(int8)": np.dtype(np.int8), "tensor(int16)": np.dtype(np.int16),
    "tensor(int32)": np.dtype(np.int32), "tensor(int64)": np.dtype(np.int64),
    "tensor(uint8)": np.dtype(np.uint8), "tensor(uint16)": np.dtype(np.uint16),
    "tensor(uint32)": np.dtype(np.uint32), "tensor(uint64)": np.dtype(np.uint64),
}


class ModelInput(NamedTuple):
    """What a model declares for one of its inputs (from ``Net.input_specs``)."""

    name: str
    #: e.g. ``"tensor(float)"``
    onnx_type: str
    #: the declared dimensions: an int where fixed, None or a name where free
    shape: tuple[Any, ...] | None

    def check(self, arr: np.ndarray, axis: int) -> str | None:
        """What is wrong with feeding chunks like ``arr`` to this input, or None."""
        if self.onnx_type == "tensor(string)":
            if arr.dtype.kind not in "OUS":
                return f"the model's input is {self.onnx_type}, the chunk's dtype is {arr.dtype}"
        else:
            want = _ONNX_DTYPES.get(self.onnx_type)
            if arr.dtype.kind == "O" or (want is not None and arr.dtype != want):
                fix = _astype_hint(want)
                default = " (numpy's default)" if arr.dtype == np.float64 else ""
                return (
                    f"the model's input is {self.onnx_type} (numpy {want}), "
                    f"the chunk's dtype is {arr.dtype}{default}{fix}"
                )
        if self.shape is not None:
            if arr.ndim != len(self.shape):
                return (
                    f"the model's input has rank {len(self.shape)} {list(self.shape)}, "
                    f"the chunk has rank {arr.ndim} (shape {arr.shape})"
                )
            for d, (want_d, got_d) in enumerate(zip(self.shape, arr.shape)):
                if d != axis and isinstance(want_d, int) and want_d > 0 and want_d != got_d:
                    return (
                        f"the model's input has shape {list(self.shape)}, the chunk has "
                        f"{arr.shape} (axis {d}: {got_d} instead of {want_d})"
                    )
        return None


class ChunkValidator:
    """Checks fetcher results against the blobs' layout; thread-safe.

    The first accepted chunk fixes each blob's dtype and per-sample shape for
    the whole source; later chunks must match.
    """

    def __init__(self, source: str, blob_names: Sequence[str], axes: Sequence[int]) -> None:
        self.source = source
        self.blob_names = tuple(blob_names)
        self.axes = tuple(axes)
        self._expected: tuple[tuple[np.dtype, tuple[int, ...]], ...] | None = None
        self._lock = threading.Lock()
        #: the chunks are not checked against each other here (a random-access
        #: source's dealer does it in stream order, not in arrival order)
        self.per_chunk_only = False

    def _where(self, worker_id: int) -> str:
        """How errors name where a chunk came from (made only for an error:
        check runs once a chunk)."""
        return f"source {self.source!r}, worker {worker_id}"

    def check(
        self,
        raw: Any,
        worker_id: int,
        blob_names: Sequence[str] | None = None,
        model_checks: Sequence[tuple[int, str, ModelInput]] | None = None,
        seq: int = 0,
        pin: Pin | None = None,
    ) -> Chunk | str:
        """Validate one fetcher result.

        ``model_checks``: model inputs to check the chunk against too, before
        its layout can become the source's.

        Returns:
            A :class:`Chunk`, or ``"none"`` / ``"empty"`` for a result to skip.

        Raises:
            ChunkError: the result is malformed; the message says where and how.
        """
        names = self.blob_names if blob_names is None else tuple(blob_names)
        if raw is None:
            return "none"
        if not isinstance(raw, (list, tuple)):
            if type(raw) is Unsendable:
                # the fetcher's result was fine as far as it goes: our own
                # pickling of it (to the parent) failed
                raise _bad_chunk(self._where(worker_id), raw.problem())
            hint = ""
            if not isinstance(raw, np.ndarray) and callable(getattr(raw, "numpy", None)):
                hint = f" ({_not_an_array(raw)}, in a list: [tensor.numpy()])"
            elif isinstance(raw, np.ndarray) and len(names) == 1:
                hint = " (one array: return [arr])"
            raise _bad_chunk(
                self._where(worker_id),
                f"fetch_fun must return a list or tuple of {len(names)} numpy arrays "
                f"({', '.join(names)}), got {type(raw).__name__}{hint}",
                TypeError,
            )
        if len(raw) != len(names):
            raise _bad_chunk(
                self._where(worker_id), f"expected {len(names)} arrays ({', '.join(names)}), got {len(raw)}"
            )
        n = -1
        arrays = list(raw)
        for i, arr in enumerate(arrays):
            if type(arr) is not np.ndarray or not arr.dtype.isnative:
                arr = arrays[i] = _plain(arr, f"{self._where(worker_id)}, blob {names[i]!r}")
            axis = self.axes[i]
            if arr.ndim <= axis:
                raise _bad_chunk(
                    f"{self._where(worker_id)}, blob {names[i]!r}",
                    f"expected an array with a batch axis {axis}, got shape {arr.shape}",
                )
            k = arr.shape[axis]
            if n < 0:
                n = k
            elif k != n:
                raise _bad_chunk(
                    f"{self._where(worker_id)}, blob {names[i]!r}",
                    f"expected {n} samples (as blob {names[0]!r}), got {k} (shape {arr.shape})",
                )
        if n == 0:
            return "empty"
        if model_checks:
            check_model_inputs(Chunk(tuple(arrays), n, worker_id), model_checks, self.axes, self._where(worker_id))
        if self.per_chunk_only:
            return Chunk(tuple(arrays), n, worker_id, seq, pin)
        expected = self._expected
        if expected is None:
            with self._lock:
                if self._expected is None:
                    self._expected = tuple(
                        (a.dtype, a.shape[:ax] + a.shape[ax + 1 :]) for a, ax in zip(arrays, self.axes)
                    )
                expected = self._expected
        for i, arr in enumerate(arrays):
            dtype, sample_shape = expected[i]
            ax = self.axes[i]
            shape = arr.shape
            if arr.dtype != dtype or shape[:ax] + shape[ax + 1 :] != sample_shape:
                fix = _astype_hint(dtype) if arr.dtype != dtype else ""
                raise _bad_chunk(
                    f"{self._where(worker_id)}, blob {names[i]!r}",
                    f"expected dtype {dtype} and per-sample shape {sample_shape} (as earlier "
                    f"chunks), got dtype {arr.dtype} and per-sample shape "
                    f"{shape[:ax] + shape[ax + 1 :]} (array shape {shape}){fix}",
                )
        return Chunk(tuple(arrays), n, worker_id, seq, pin)


def check_model_inputs(chunk: Chunk, checks: Sequence[tuple[int, str, ModelInput]], axes: Sequence[int], where: str) -> None:
    """Check one chunk against the model inputs its blobs feed.

    Args:
        checks: ``(position in the chunk, blob name, model input)``.

    Raises:
        ChunkError: naming the blob, the model's type and the chunk's dtype.
    """
    for pos, blob, spec in checks:
        problem = spec.check(chunk.arrays[pos], axes[pos])
        if problem is not None:
            raise _bad_chunk(f"{where}, blob {blob!r}", f"does not fit the model: {problem}")


def guess_samples(raw: Any, axes: Sequence[int]) -> int:
    """Best-effort sample count of a malformed chunk, for the skip counter."""
    try:
        first = raw[0]
        return int(first.shape[axes[0]])
    except Exception:
        return 0
