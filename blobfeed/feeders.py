"""Fetcher workers, chunk validation, re-batching and enqueuers.

Data path for one input source (see docs/CONTRACT.md)::

    fetch_fun  --chunks-->  InputSource.queue  --Feed (one per net)-->  device queue  -->  Net.run

An :class:`InputSource` owns the bounded internal queue shared by every net
fed from that source name, so each chunk goes to exactly one net.  A
:class:`Feed` re-batches the chunks it takes into batches of exactly
``batch_size`` samples and puts them, placed on the net's device, on its
device queue.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Callable, Literal, NamedTuple, Sequence

import numpy as np

from .errors import BlobfeedError, ChunkError, DequeueTimeout, EndOfInput, FetcherError
from .metrics import AssembleStats, ConsumeStats, FetchStats, MetricsHub
from .queues import BlobsQueue
from .worker_info import WorkerInfo, set_worker_info

__all__ = [
    "Batch", "Chunk", "ChunkValidator", "Feed", "FeedGroup", "InputSource", "ModelInput", "Rebatcher",
]

logger = logging.getLogger("blobfeed.feeders")

OnError = Literal["raise", "skip"]
FetchFun = Callable[[int, int], Any]

#: Seconds a consumer waits with no data before "data input is slow".
SLOW_INPUT_WARN_S = 10.0
#: At most one "data loading lagging behind" per this many seconds.
LAGGING_WARN_S = 60.0


class Chunk(NamedTuple):
    """One validated fetcher result: an array per blob, ``n`` samples each."""

    arrays: tuple[np.ndarray, ...]
    n: int
    worker_id: int


class Batch(NamedTuple):
    """One whole batch: an array (or device value) per blob, ``n`` samples each."""

    arrays: tuple[Any, ...]
    n: int


class _SourceStopped(EndOfInput):
    """Internal: the source was stopped; enqueuers must not flush leftovers."""


def _slicer(axis: int) -> Callable[[np.ndarray, int, int], np.ndarray]:
    if axis == 0:
        return lambda a, lo, hi: a[lo:hi]
    lead = (slice(None),) * axis
    return lambda a, lo, hi: a[lead + (slice(lo, hi),)]


def _bad_chunk(where: str, detail: str, kind: type[Exception] = ValueError) -> ChunkError:
    """A ChunkError whose ``__cause__`` is the plain TypeError/ValueError of the check."""
    err = ChunkError(f"{where}: {detail}")
    err.__cause__ = kind(detail)
    return err


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
        raise _bad_chunk(where, f"expected a numpy.ndarray, got {type(arr).__name__}", TypeError)
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
_ONNX_DTYPES = {
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
                return (
                    f"the model's input is {self.onnx_type} (numpy {want}), "
                    f"the chunk's dtype is {arr.dtype}"
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

    def check(
        self,
        raw: Any,
        worker_id: int,
        blob_names: Sequence[str] | None = None,
        model_checks: Sequence[tuple[int, str, ModelInput]] | None = None,
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
        where = f"source {self.source!r}, worker {worker_id}"
        if not isinstance(raw, (list, tuple)):
            raise _bad_chunk(
                where,
                f"fetch_fun must return a list or tuple of {len(names)} numpy arrays "
                f"({', '.join(names)}), got {type(raw).__name__}",
                TypeError,
            )
        if len(raw) != len(names):
            raise _bad_chunk(
                where, f"expected {len(names)} arrays ({', '.join(names)}), got {len(raw)}"
            )
        n = -1
        arrays = list(raw)
        for i, arr in enumerate(arrays):
            if type(arr) is not np.ndarray or not arr.dtype.isnative:
                arr = arrays[i] = _plain(arr, f"{where}, blob {names[i]!r}")
            axis = self.axes[i]
            if arr.ndim <= axis:
                raise _bad_chunk(
                    f"{where}, blob {names[i]!r}",
                    f"expected an array with a batch axis {axis}, got shape {arr.shape}",
                )
            k = arr.shape[axis]
            if n < 0:
                n = k
            elif k != n:
                raise _bad_chunk(
                    f"{where}, blob {names[i]!r}",
                    f"expected {n} samples (as blob {names[0]!r}), got {k} (shape {arr.shape})",
                )
        if n == 0:
            return "empty"
        if model_checks:
            check_model_inputs(Chunk(tuple(arrays), n, worker_id), model_checks, self.axes, where)
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
                raise _bad_chunk(
                    f"{where}, blob {names[i]!r}",
                    f"expected dtype {dtype} and per-sample shape {sample_shape} (as earlier "
                    f"chunks), got dtype {arr.dtype} and per-sample shape "
                    f"{shape[:ax] + shape[ax + 1 :]} (array shape {shape})",
                )
        return Chunk(tuple(arrays), n, worker_id)


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


class Rebatcher:
    """Cuts a stream of chunks into batches of exactly ``batch_size`` samples.

    Not thread-safe: one owner at a time.  Guarantees (docs/CONTRACT.md): samples keep
    their order, a chunk's leftover goes first into the next batch, and each
    byte is copied at most once -- not at all when a batch lies inside one
    chunk (the batch is then a view of the chunk).
    """

    def __init__(self, axes: Sequence[int], batch_size: int, *, whole_chunks: bool = False) -> None:
        self.axes = tuple(axes)
        self.batch_size = batch_size
        #: dont_rebatch: every chunk is one batch, whatever its size
        self.whole_chunks = whole_chunks
        self._slicers = [_slicer(ax) for ax in self.axes]
        # (arrays, start) with start the first sample not yet handed out
        self._pieces: collections.deque[list[Any]] = collections.deque()
        self.pending = 0

    def push(self, chunk: Chunk) -> None:
        self._pieces.append([chunk.arrays, 0, chunk.n])
        self.pending += chunk.n

    def pop(self) -> Batch | None:
        """A full batch if enough samples are pending, else None."""
        if self.whole_chunks:
            if not self._pieces:
                return None
            arrays, start, n = self._pieces.popleft()
            self.pending -= n - start
            return Batch(arrays, n - start)
        bs = self.batch_size  # once: another thread may reset it (reset_data_input)
        if self.pending < bs:
            return None
        return self._take(bs)

    def pop_partial(self) -> Batch | None:
        """Everything pending as one (smaller) batch, or None when empty."""
        if self.pending == 0:
            return None
        return self._take(self.pending)

    def clear(self) -> int:
        """Discard everything pending without assembling it; returns the
        number of samples discarded."""
        n = self.pending
        self._pieces.clear()
        self.pending = 0
        return n

    def _take(self, bs: int) -> Batch:
        head = self._pieces[0]
        arrays, start, n = head
        self.pending -= bs
        if n - start >= bs:
            # The whole batch lies inside one chunk: views, no copy.
            out = tuple(sl(a, start, start + bs) for sl, a in zip(self._slicers, arrays))
            if n - start == bs:
                self._pieces.popleft()
            else:
                head[1] = start + bs
            return Batch(out, bs)
        parts: list[list[np.ndarray]] = [[] for _ in arrays]
        need = bs
        while need:
            head = self._pieces[0]
            arrays, start, n = head
            take = min(need, n - start)
            for i, (sl, a) in enumerate(zip(self._slicers, arrays)):
                parts[i].append(sl(a, start, start + take))
            need -= take
            if start + take == n:
                self._pieces.popleft()
            else:
                head[1] = start + take
        out = tuple(np.concatenate(p, axis=ax) for p, ax in zip(parts, self.axes))
        return Batch(out, bs)


class InputSource:
    """Everything behind one ``input_source_name``: the internal queue, the
    fetchers' lifecycle and the feeds (one per net) that share it.

    Thread-safe.
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        n_blobs: int,
        axes: Sequence[int],
        hub: MetricsHub,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.name = name
        #: told of the first fetcher error (the coordinator's should_stop/join)
        self._on_failure = on_failure
        # Fetchers blocked on a full queue sleep until it is half empty, then
        # refill it in a burst: far fewer wake-ups than one per chunk.
        self.queue: BlobsQueue[Chunk] = BlobsQueue(
            capacity, name=f"{name}/internal", low_water=capacity // 2
        )
        self.n_blobs = n_blobs
        self.axes = tuple(axes)
        self.validator = ChunkValidator(name, [f"#{i}" for i in range(n_blobs)], axes)
        self.feeds: list[Feed] = []
        #: fetchers stop fetching once this is True.  A plain attribute, not
        #: an Event: request_stop() sets it from a signal handler, where even
        #: an Event's internal lock could be held by the interrupted code.
        self.halted = False
        self.hub = hub
        self._lock = threading.Lock()
        self._fetchers_registered = 0
        self._fetchers_running = 0
        self._fetchers_finished = 0
        self.error: BaseException | None = None
        self.stopped = False
        #: samples a fetcher holds while blocked putting them (worker id -> n);
        #: each fetcher writes only its own key
        self.inflight: dict[int, int] = {}
        self.lagging_warned_at = time.monotonic()
        hub.attach_source(self)

    # -- fetcher lifecycle -------------------------------------------------
    def register_fetchers(self, n: int) -> None:
        """Count ``n`` more fetchers in; refuses a source that has ended.

        Raises:
            ValueError: the source ended (every fetcher finished), failed or was stopped.
        """
        with self._lock:
            if self.finished or self.error is not None or self.stopped or self.queue.closed:
                raise ValueError(
                    f"source {self.name!r} has ended; stop_coordinator({self.name!r}) "
                    "before feeding from that name again"
                )
            self._fetchers_registered += n

    def fetcher_started(self) -> None:
        with self._lock:
            self._fetchers_running += 1

    def fetcher_finished(self, exhausted: bool) -> None:
        """A fetcher thread ends; when the last one of the source raised
        StopIteration the stream ends after what is queued."""
        with self._lock:
            self._fetchers_running -= 1
            if exhausted:
                self._fetchers_finished += 1
            last = self._fetchers_finished == self._fetchers_registered
        if last and exhausted:
            logger.info("source %r: every fetcher finished; draining", self.name)
            self.queue.close()

    @property
    def finished(self) -> bool:
        """True once every fetcher raised StopIteration."""
        return self._fetchers_registered > 0 and self._fetchers_finished == self._fetchers_registered

    def workers_alive(self) -> int:
        return self._fetchers_running

    # -- ending --------------------------------------------------------------
    def fail(self, error: FetcherError) -> None:
        """on_error="raise": abort the source; every net gets ``error``."""
        with self._lock:
            if self.error is not None or self.stopped:
                return
            self.error = error
        logger.error("source %r stopped by a fetcher error: %s", self.name, error)
        self.halted = True
        lost = self._samples_in(self.queue.close(error))
        for feed in list(self.feeds):
            lost += feed.abort(error)
        self.hub.count_dropped(self.name, "error", lost)
        if self._on_failure is not None:
            self._on_failure(error)

    def stop(self) -> None:
        """Stop fetchers and enqueuers; queued data is discarded. Idempotent."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
        self.halted = True
        err = _SourceStopped(f"source {self.name!r} was stopped")
        lost = self._samples_in(self.queue.close(err))
        for feed in list(self.feeds):
            lost += feed.abort(EndOfInput(f"source {self.name!r} was stopped"))
        self.hub.count_dropped(self.name, "stopped", lost)

    def model_checks(self) -> list[tuple[int, str, ModelInput]]:
        """What a worker's first chunk is checked against: every model input
        that a blob of this source feeds, in every net the source feeds."""
        return [c for f in list(self.feeds) for c in f.model_checks]

    @property
    def lost_reason(self) -> str:
        """Why data still inside blobfeed will never reach a net now."""
        return "error" if self.error is not None else "stopped"

    @staticmethod
    def _samples_in(items: Sequence[Any]) -> int:
        return sum(item.n for item in items)

    # -- metrics -------------------------------------------------------------
    def device_queue_depths(self) -> list[tuple[str, int]]:
        return [(f.net_name, f.device_queue.qsize()) for f in list(self.feeds)]

    def buffered_samples(self) -> int:
        total = self._samples_in(self.queue.snapshot()) + sum(list(self.inflight.values()))
        for f in list(self.feeds):
            total += f.buffered_samples()
        return total


class FeedGroup:
    """The feeds of one net.

    A net fed by several sources waits on one at a time; when another of its
    sources fails, that error must still reach the waiting ``run()`` at once,
    so a failing feed aborts its siblings with the same error.  Holds no
    reference to the net (a cycle would keep its onnxruntime session alive).
    """

    def __init__(self) -> None:
        self.feeds: list[Feed] = []

    def failed(self, origin: "Feed", error: BaseException) -> None:
        for f in list(self.feeds):
            if f is not origin:
                lost = f.abort(error)
                if lost:
                    f.source.hub.count_dropped(f.source.name, "error", lost)


class Feed:
    """Re-batches one source's chunks for one net.

    Two threads assemble batches, under one lock (``_lock``) that guards the
    re-batcher and the order of batches:

    * the enqueuer thread (:meth:`run`) takes chunks from the internal queue
      and puts batches on the device queue, so that a net busy running its
      model finds the next batch ready;
    * the net's own thread (:meth:`dequeue`), finding the device queue empty,
      assembles the next batch itself instead of sleeping until the enqueuer
      has done it.  Every thread hand-off costs far more than assembling a
      small batch (a wake-up plus a GIL transfer), so when the consumer is
      faster than the enqueuer can be scheduled this path carries the feed.

    Order and exactly-once hold because everything that hands data out
    happens under the lock: chunks go from the internal queue into the
    re-batcher, a batch the enqueuer cannot yet put waits in ``_staged``, and
    the net's thread takes the device queue first, then ``_staged``, then a
    new batch.  Nobody holds the lock while waiting, so it is never held
    long.
    """

    def __init__(
        self,
        source: InputSource,
        net_name: str,
        place: Callable[[tuple[np.ndarray, ...]], tuple[Any, ...]],
        blob_names: Sequence[str],
        batch_size: int,
        *,
        timeout: float,
        device_queue_capacity: int,
        dont_rebatch: bool,
        drop_last: bool,
        hub: MetricsHub,
        model_inputs: dict[str, ModelInput] | None = None,
    ) -> None:
        self.source = source
        # No reference to the net itself: the net refers to its feeds, and a
        # cycle would keep a discarded net's onnxruntime session alive.
        self.net_name = net_name
        self.blob_names = tuple(blob_names)
        self.timeout = timeout
        self.dont_rebatch = dont_rebatch
        self.drop_last = drop_last
        self.rebatcher = Rebatcher(source.axes, batch_size, whole_chunks=dont_rebatch)
        # low_water=0: the enqueuer sleeps until the net has taken every
        # queued batch, then refills in one go -- one wake-up per
        # `capacity` batches instead of one per batch.
        self.device_queue: BlobsQueue[Batch] = BlobsQueue(
            device_queue_capacity, name=f"{source.name}/{net_name}", low_water=0
        )
        self._lock = threading.Lock()
        #: the enqueuer's next batch, waiting for room in the device queue
        self._staged: Batch | None = None
        #: a batch the net took while another of its sources failed or timed
        #: out; it is handed out first next time (see Net.run)
        self._held: Batch | None = None
        #: set by abort(): the source stopped or failed; nothing is handed out
        self._aborted = False
        #: why what this feed still holds is lost, once aborted
        self._lost_reason = "stopped"
        #: set when the coordinator starts the enqueuer: run() before that is a user error
        self._started = False
        self._group: FeedGroup | None = None
        #: (position, blob, model input) for each blob that feeds a model input
        self.model_checks: tuple[tuple[int, str, ModelInput], ...] = tuple(
            (i, b, model_inputs[b]) for i, b in enumerate(self.blob_names) if model_inputs and b in model_inputs
        )
        #: puts a batch on the net's device (the net's method; dropped by release_net)
        self._place = place
        #: set in a child made by os.fork(): the parent's threads and locks are not here
        self._forked_from: int | None = None
        self.stats: AssembleStats = hub.assemble_stats(source.name, net_name)
        #: batches the net's thread assembled itself (that thread writes them)
        self.direct_stats: AssembleStats = hub.assemble_stats(source.name, net_name, direct=True)
        self.consume_stats: ConsumeStats = hub.consume_stats(source.name, net_name)

    @property
    def batch_size(self) -> int:
        return self.rebatcher.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        # Read once per batch under the lock; an int store is atomic.
        self.rebatcher.batch_size = value

    def buffered_samples(self) -> int:
        staged, held = self._staged, self._held
        return (
            self.rebatcher.pending
            + (staged.n if staged is not None else 0)
            + (held.n if held is not None else 0)
            + sum(b.n for b in self.device_queue.snapshot())
        )

    def join_group(self, group: FeedGroup) -> None:
        """Become one of a net's feeds (called by the net when wired)."""
        self._group = group

    def mark_forked(self) -> None:
        """In a child made by ``os.fork()``: this feed belongs to the parent."""
        self._forked_from = os.getppid()

    def mark_started(self) -> None:
        """The enqueuer and the fetchers are starting."""
        self._started = True

    def abort(self, error: BaseException) -> int:
        """Close the device queue with ``error``; returns samples discarded.

        A fetcher error also aborts the net's other feeds, so a ``run()``
        waiting on another source sees it at once.  Idempotent.
        """
        with self._lock:  # never held while blocking, so this cannot wait long
            if self._aborted:
                return 0
            self._aborted = True
            self._lost_reason = "error" if isinstance(error, FetcherError) else "stopped"
            held, self._held = self._held, None
            lost = held.n if held is not None else 0
            lost += sum(b.n for b in self.device_queue.close(error))
        if isinstance(error, FetcherError) and self._group is not None:
            self._group.failed(self, error)
        return lost

    def hold(self, batch: Batch) -> None:
        """Keep a batch the net took for its next run (another source failed).

        After abort() the batch is counted as dropped instead: a stopped
        source hands nothing out.
        """
        with self._lock:
            if not self._aborted:
                self._held = batch
                return
        src = self.source
        src.hub.count_dropped(src.name, self._lost_reason, batch.n)

    def take_held(self) -> Batch | None:
        with self._lock:
            held, self._held = self._held, None
            return held

    def release_net(self) -> None:
        """Drop the references to the net once the enqueuer has ended, so a
        discarded Net (and its onnxruntime session) is freed at once rather
        than at the next garbage collection."""
        self._place = _unplaced

    def _assemble(self, stats: AssembleStats, *, partial: bool = False) -> Batch | None:
        """Pop one batch and place it on the device; None when none is complete.

        Under the lock.  ``stats`` belongs to the calling thread; ``partial``
        takes whatever is pending (the end of input).
        """
        t0 = time.perf_counter()
        b = self.rebatcher.pop_partial() if partial else self.rebatcher.pop()
        if b is None:
            return None
        batch = Batch(self._place(b.arrays), b.n)
        stats.enqueue.observe(time.perf_counter() - t0)
        stats.batches += 1
        stats.samples += b.n
        return batch

    # -- the enqueuer thread ---------------------------------------------------
    def run(self) -> None:
        """Body of the enqueuer thread."""
        src = self.source
        queue = src.queue
        try:
            while True:
                # Take and push under the lock, so chunks enter the re-batcher
                # in queue order whichever thread takes them; wait outside it.
                with self._lock:
                    try:
                        ok, chunk = queue.get_nowait()
                    except _SourceStopped:
                        self._lose_all()
                        return
                    except EndOfInput:
                        ok, chunk = False, None
                        ended = True
                    else:
                        ended = False
                        if ok and chunk is not None:
                            self.rebatcher.push(chunk)
                if ended:
                    self._finish()
                    return
                # Complete batches may be waiting even without a new chunk
                # (the net's thread pushed one it did not use up): prefetch them.
                if not self._drain():
                    return
                if not ok:
                    queue.wait_for_item()  # woken by a put or a close
        except FetcherError:
            # the source failed; fail() closed our queue with the error
            with self._lock:
                self._lose_all()
        except BaseException as exc:  # our bug or a device error: never hang the net
            logger.exception("enqueuer %s/%s failed", src.name, self.net_name)
            err = FetcherError(f"source {src.name!r}: enqueuer for net {self.net_name!r} failed: {exc!r}")
            err.__cause__ = exc
            with self._lock:
                self.stats.dropped["error"] += sum(b.n for b in self.device_queue.close(err))
                self._lose_all()

    def _drain(self, *, final: bool = False) -> bool:
        """Move every complete batch to the device queue; False once it is closed.

        Never blocks holding the lock: the batch waiting for room stays in
        ``_staged``, where the net's thread may take it.
        """
        dq = self.device_queue
        while True:
            with self._lock:
                if self._staged is None:
                    self._staged = self._assemble(self.stats)
                    if self._staged is None:
                        return True
                    if not final:  # an empty queue is expected while flushing the end
                        self._warn_if_lagging()
                if dq.put(self._staged, timeout=0):
                    self._staged = None
                    continue
                if dq.closed:
                    self._lose_all()
                    return False
            dq.wait_for_room()  # woken when the net has emptied the queue, or it closes

    def _lose_all(self) -> None:
        """The device queue is closed: count what this feed still holds as dropped.  Under the lock.

        Discarded, never assembled: a stop must not copy up to a batch only
        to throw it away.
        """
        reason = self._lost_reason if self._aborted else self.source.lost_reason
        n = self.rebatcher.clear() + (self._staged.n if self._staged is not None else 0)
        self._staged = None
        if n:
            self.stats.dropped[reason] += n

    def _warn_if_lagging(self) -> None:
        src = self.source
        now = time.monotonic()
        # once a minute per source; the first minute is warm-up
        if now - src.lagging_warned_at >= LAGGING_WARN_S and src.queue.qsize() < 2:
            src.lagging_warned_at = now
            logger.warning(
                "data loading lagging behind: source %r internal queue holds %d chunks (net %r)",
                src.name, src.queue.qsize(), self.net_name,
            )

    def _finish(self) -> None:
        """End of input: the leftover becomes one last batch, then the queue ends."""
        if not self._drain(final=True):
            return
        with self._lock:
            left = self.rebatcher.pending
            if left and self.drop_last:
                self.rebatcher.clear()
                self.stats.dropped["drop_last"] += left
                logger.info(
                    "source %r, net %r: dropped a last partial batch of %d samples (drop_last=True)",
                    self.source.name, self.net_name, left,
                )
            elif left:
                self._staged = self._assemble(self.stats, partial=True)
        if not self._drain(final=True):
            return
        self.device_queue.close()

    # -- the consumer side ---------------------------------------------------------
    def delivered(self, batch: Batch) -> None:
        """Count ``batch`` as handed to the user (the net's thread)."""
        self.consume_stats.batches += 1
        self.consume_stats.samples += batch.n

    def _assemble_here(self) -> Batch | None:
        """The net's thread takes or assembles the next batch, if it can without waiting for data.

        Order: what the device queue holds, then the enqueuer's staged batch,
        then new batches from the re-batcher.
        """
        # Blocking on the lock is cheap: nobody holds it across a wait.  Not
        # waiting would be wrong: the enqueuer may hold it only to find the
        # internal queue empty while complete batches the net's own thread
        # left sit in the re-batcher.  A `with` block, not acquire/try: a
        # Ctrl-C can land right after a call returns, and only `with`
        # guarantees the release.
        with self._lock:
            ok, batch = self.device_queue.get_nowait()
            if ok:
                return batch
            if self._staged is not None:
                batch, self._staged = self._staged, None
                return batch
            queue = self.source.queue
            while True:
                batch = self._assemble(self.direct_stats)
                if batch is not None:
                    return batch
                try:
                    ok, chunk = queue.get_nowait()
                except (EndOfInput, FetcherError):
                    # ended, stopped or failed: the enqueuer settles the end
                    # (last batch, or the error) through the device queue
                    return None
                if not ok or chunk is None:
                    return None
                self.rebatcher.push(chunk)

    def dequeue(self, timeout: float | None) -> Batch:
        """Take the next batch for ``Net.run`` (called in the net's thread)."""
        if self._forked_from is not None:
            raise BlobfeedError(
                f"source {self.source.name!r}, net {self.net_name!r}: this pipeline was built in "
                f"process {self._forked_from}; a child made by os.fork() cannot use it (its "
                "threads exist only in the parent): build a new pipeline in the child"
            )
        limit = self.timeout if timeout is None else timeout
        cs = self.consume_stats
        t0 = time.perf_counter()
        try:
            ok, batch = self.device_queue.get_nowait()
            if ok:
                return batch  # type: ignore[return-value]
            batch = self._assemble_here()
            if batch is not None:
                return batch
            if not self._started and not self._aborted:
                raise BlobfeedError(
                    f"source {self.source.name!r}, net {self.net_name!r}: the pipeline was never "
                    "started; call start() on the coordinator that init_data_input_workers "
                    "returned before Net.run()"
                )
            deadline = t0 + limit
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    cs.timeouts += 1
                    raise DequeueTimeout(
                        f"source {self.source.name!r}, net {self.net_name!r}: "
                        f"no batch within {limit:g} s"
                    ) from None
                try:
                    return self.device_queue.get(min(remaining, SLOW_INPUT_WARN_S))
                except DequeueTimeout:
                    waited = time.perf_counter() - t0
                    if waited >= SLOW_INPUT_WARN_S - 1e-3 and deadline - time.perf_counter() > 0:
                        logger.warning(
                            "data input is slow: net %r has waited %.0f s for source %r "
                            "(internal queue %d chunks, %d fetchers alive)",
                            self.net_name, waited, self.source.name,
                            self.source.queue.qsize(), self.source.workers_alive(),
                        )
        finally:
            cs.wait.observe(time.perf_counter() - t0)


def _unplaced(arrays: tuple[np.ndarray, ...]) -> tuple[Any, ...]:
    raise RuntimeError("this feed's enqueuer has ended")


def fetcher_loop(
    source: InputSource,
    worker_id: int,
    fetch_fun: FetchFun,
    blob_names: Sequence[str],
    get_batch_size: Callable[[], int],
    on_error: OnError,
    stats: FetchStats,
    info: WorkerInfo | None = None,
) -> None:
    """The body of one fetcher thread."""
    set_worker_info(info)
    queue = source.queue
    validator = source.validator
    perf = time.perf_counter
    fetch_hist = stats.fetch
    inflight = source.inflight
    exhausted = False
    model_checked = False
    source.fetcher_started()
    try:
        while not source.halted:
            t0 = perf()
            try:
                raw = fetch_fun(worker_id, get_batch_size())
            except StopIteration:
                fetch_hist.observe(perf() - t0)
                exhausted = True
                logger.debug("source %r, worker %d: StopIteration", source.name, worker_id)
                return
            except BaseException as exc:
                # BaseException too: a fetcher dying silently would leave the
                # consumer waiting for its timeout instead of seeing the cause.
                fetch_hist.observe(perf() - t0)
                stats.errors["exception"] += 1
                if source.halted:
                    return
                err = FetcherError(
                    f"source {source.name!r}, worker {worker_id}: fetch_fun raised {exc!r}"
                )
                err.__cause__ = exc
                if on_error == "skip" and isinstance(exc, Exception):
                    logger.warning("%s; skipped (on_error='skip')", err, exc_info=exc)
                    continue
                source.fail(err)
                return
            fetch_hist.observe(perf() - t0)
            try:
                # The first chunk of each worker is checked against the
                # model; later ones must match the source's layout, so one
                # check covers them.
                chunk = validator.check(
                    raw, worker_id, blob_names, None if model_checked else source.model_checks()
                )
                model_checked = model_checked or isinstance(chunk, Chunk)
            except ChunkError as err:
                stats.errors["invalid"] += 1
                if on_error == "skip":
                    stats.skipped_samples += _guess_samples(raw, source.axes)
                    logger.warning("%s; chunk skipped (on_error='skip')", err)
                    continue
                source.fail(err)
                return
            if isinstance(chunk, str):
                stats.errors[chunk] += 1
                logger.warning(
                    "source %r, worker %d: fetch_fun returned %s; skipped",
                    source.name, worker_id, "None" if chunk == "none" else "a chunk with no samples",
                )
                continue
            assert isinstance(chunk, Chunk)
            stats.chunks += 1
            stats.samples += chunk.n
            stats.bytes += sum(a.nbytes for a in chunk.arrays)
            inflight[worker_id] = chunk.n
            ok = queue.put(chunk)
            inflight[worker_id] = 0
            if not ok:
                stats.dropped[source.lost_reason] += chunk.n
                return
    finally:
        inflight.pop(worker_id, None)
        set_worker_info(None)
        source.fetcher_finished(exhausted)


def _guess_samples(raw: Any, axes: Sequence[int]) -> int:
    """Best-effort sample count of a malformed chunk, for the skip counter."""
    try:
        first = raw[0]
        return int(first.shape[axes[0]])
    except Exception:
        return 0
