"""``Net``: runs an ONNX model on batches dequeued from its input sources."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from .arguments import check_flag, check_timeout
from .errors import EndOfEpoch, EndOfInput
from .feeders import EpochEnd, FeedGroup, ModelInput
from .feeders.reading import BatchReader

if TYPE_CHECKING:
    import onnxruntime as ort

__all__ = ["Net", "Workspace"]

logger = logging.getLogger("blobfeed.net")


class Workspace:
    """Named blobs of one net: the last inputs and outputs of ``run()``, and
    anything fed by hand.  Thread-safe."""

    def __init__(self) -> None:
        self._blobs: dict[str, Any] = {}
        self._lock = threading.Lock()

    def feed_blob(self, name: str, array: Any) -> None:
        """Store ``array`` under ``name`` (a model input nothing else feeds may come from here)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"blob name must be a non-empty str, got {name!r}")
        with self._lock:
            self._blobs[name] = array

    def fetch_blob(self, name: str) -> Any:
        """The blob stored under ``name``.

        Raises:
            KeyError: no such blob; the message lists the blobs there are.
        """
        with self._lock:
            try:
                return self._blobs[name]
            except KeyError:
                raise KeyError(
                    f"no blob {name!r} in the workspace (has: {sorted(self._blobs)})"
                ) from None

    def has_blob(self, name: str) -> bool:
        with self._lock:
            return name in self._blobs

    def blobs(self) -> list[str]:
        """Names of the stored blobs, sorted."""
        with self._lock:
            return sorted(self._blobs)

    def _update(self, blobs: dict[str, Any]) -> None:
        with self._lock:
            self._blobs.update(blobs)


def _parse_device(device: str) -> tuple[str, int]:
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', got {type(device).__name__}")
    if device == "cpu":
        return "cpu", 0
    if device == "cuda":
        return "cuda", 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return "cuda", int(device[5:])
    raise ValueError(f"device must be 'cpu' or 'cuda:N', got {device!r}")


def _require_cuda(name: str, device: str) -> None:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise ValueError(
            f"Net {name!r}: device {device!r} needs onnxruntime with CUDAExecutionProvider "
            f"(pip install onnxruntime-gpu); this onnxruntime has {available}"
        )


class Net:
    """A model fed by blobfeed input sources.

    Args:
        model: path to an ``.onnx`` file, the model's bytes, or ``None`` for a
            net that only dequeues (``run()`` then returns the input blobs).
        name: the ``net`` label of its metrics; distinct per source.
        device: ``"cpu"``, or ``"cuda:N"`` to have the enqueuer place batches
            on GPU N as onnxruntime ``OrtValue`` s bound with IO binding
            (needs onnxruntime with the CUDA execution provider).
        providers: onnxruntime execution providers; default from ``device``.
        session_options: an ``onnxruntime.SessionOptions``.
        writable: batches are the caller's to write, as ``torch.from_numpy``
            expects (it warns "The given NumPy array is not writable" once
            per process at a read-only array, and a tensor made of one must
            never be written).  A batch that views memory blobfeed does not
            own (a fetcher's array, a worker process's shared memory, Ray's
            object store) is copied once, on the enqueuer thread, ahead of
            ``run()``; a batch blobfeed copied already (it spans chunks) is
            handed out as it is.  Costs at most one copy per byte; default
            ``False``: every array is read-only and nothing is copied.  Set
            when the net is wired to its sources.

    ``run()`` is meant for one thread at a time (one consumer per net, as in
    Caffe2); the workspace itself is thread-safe.  ``for outputs in net:``
    calls ``run()`` until the input ends.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes | None = None,
        *,
        name: str = "net",
        device: str = "cpu",
        providers: Sequence[Any] | None = None,
        session_options: "ort.SessionOptions | None" = None,
        writable: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Net name must be a non-empty str, got {name!r}")
        self.name = name
        #: the batches are the caller's to write (see the class docstring)
        self.writable = check_flag("writable", writable)
        self.device = device
        self._device_type, self._device_id = _parse_device(device)
        if self._device_type == "cuda":
            _require_cuda(name, device)
        self.workspace = Workspace()
        self._group = FeedGroup()
        #: the group's list itself (an attribute: run() reads it per batch)
        #: the readers of its sources, one each (the consumer halves; the
        #: group holds their feeds, the enqueuer halves)
        self._feeds: list[BatchReader] = []
        self._session: ort.InferenceSession | None = None
        self._input_specs: dict[str, ModelInput] = {}
        self._output_names: tuple[str, ...] = ()
        if model is not None:
            self._session = self._load(model, providers, session_options)
            self._input_specs = {
                i.name: ModelInput(i.name, i.type, tuple(i.shape) if i.shape is not None else None)
                for i in self._session.get_inputs()
            }
            self._output_names = tuple(o.name for o in self._session.get_outputs())
            import onnxruntime as ort

            #: one per run() with the model, so a stop can cancel that run alone
            self._new_run_options = ort.RunOptions
        self._unfed: list[str] = list(self._input_specs)
        #: the RunOptions of the run() inside the model now (see _cancel)
        self._run_options: ort.RunOptions | None = None

    @property
    def input_names(self) -> tuple[str, ...]:
        """The model's input names, in the model's order (empty without a model)."""
        return tuple(self._input_specs)

    @property
    def output_names(self) -> tuple[str, ...]:
        """The model's output names, in the model's order (empty without a model)."""
        return self._output_names

    @property
    def input_specs(self) -> dict[str, ModelInput]:
        """What the model declares for each input: ONNX type and shape."""
        return dict(self._input_specs)


    def _load(
        self, model: Any, providers: Sequence[Any] | None, options: Any
    ) -> "ort.InferenceSession":
        import onnxruntime as ort

        if not isinstance(model, (str, bytes, os.PathLike)):
            raise TypeError(
                f"Net model must be a path, bytes or None, got {type(model).__name__}"
            )
        if isinstance(model, (str, os.PathLike)) and not os.path.exists(model):
            raise ValueError(f"Net {self.name!r}: model file {os.fspath(model)!r} does not exist")
        if providers is None:
            if self._device_type == "cuda":
                providers = [
                    ("CUDAExecutionProvider", {"device_id": self._device_id}),
                    "CPUExecutionProvider",
                ]
            else:
                providers = ["CPUExecutionProvider"]
        return ort.InferenceSession(
            os.fspath(model) if not isinstance(model, bytes) else model,
            sess_options=options,
            providers=list(providers),
        )

    # Called by the enqueuer thread: puts a batch on this net's device, so
    # the copy to the GPU overlaps with the model running the previous batch.
    def _place(self, arrays: tuple[np.ndarray, ...]) -> tuple[Any, ...]:
        if self._device_type == "cpu":
            return arrays
        import onnxruntime as ort

        return tuple(
            ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), "cuda", self._device_id)
            for a in arrays
        )

    def _check_attach(self, source_name: str, blob_names: Sequence[str]) -> None:
        """Raise ValueError if a feed from ``source_name`` of ``blob_names`` cannot attach."""
        live = [f for f in self._feeds if not f.source.stopped]
        if any(f.source.name == source_name for f in live):
            raise ValueError(
                f"net {self.name!r} is already fed from source {source_name!r}; to feed it again "
                f"(a new epoch, a new fetcher), first call stop_coordinator({source_name!r}) on the "
                "coordinator, then init_data_input_workers again"
            )
        clash = {n for f in live for n in f.blob_names}.intersection(blob_names)
        if clash:
            raise ValueError(
                f"net {self.name!r}: blobs {sorted(clash)} are already fed by another source"
            )

    def add_reader(self, reader: BatchReader) -> None:
        """Feed this net from ``reader`` (``GlobalCoordinator.add_reader``):
        ``run()`` takes one batch from it per call, with the net's other
        sources; batches are placed on the net's device and checked against
        its model as with ``init_data_input_workers``.  Before the source starts.

        Raises:
            TypeError: not a ``BatchReader``.
            ValueError: the net is fed from that source already, or another
                source feeds one of the reader's blobs; the reader feeds a
                net already, or its source started.
        """
        if not isinstance(reader, BatchReader):
            raise TypeError(f"Net.add_reader takes a BatchReader, got {type(reader).__name__}")
        if reader.net is not None:
            raise ValueError(
                f"net {self.name!r}: reader {reader.name!r} of source {reader.source_name!r} feeds net "
                f"{reader.net!r} already (one consumer per reader; add_reader makes another)"
            )
        if reader.started:
            raise ValueError(
                f"net {self.name!r}: reader {reader.name!r} of source {reader.source_name!r} started "
                "already; give a net its reader before the coordinator's start()"
            )
        self._check_attach(reader.source_name, reader.blob_names)
        reader._bind(self._place, self._input_specs, self.writable, self._cancel)
        self._attach(reader)

    def check_reader(self, source_name: str, blob_names: Sequence[str]) -> None:
        """Raise ``ValueError`` if a reader of ``blob_names`` from source
        ``source_name`` could not feed this net (see :meth:`add_reader`)."""
        self._check_attach(source_name, blob_names)

    def _attach(self, reader: BatchReader) -> None:
        # readers of stopped sources go: their run() would only raise EndOfInput
        for old in [f for f in self._feeds if f.source.stopped]:
            self._feeds.remove(old)
            self._group.feeds.remove(old._feed)
        self._feeds.append(reader)
        reader.net = self.name
        self._group.feeds.append(reader._feed)
        reader._feed.join_group(self._group)
        fed = {n for f in self._feeds for n in f.blob_names}
        self._unfed = [n for n in self.input_names if n not in fed]

    def run(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Dequeue one batch from every source feeding this net and run the model.

        Args:
            timeout: seconds to wait for each source's batch; default the
                ``timeout`` given to ``init_data_input_workers``.

        Returns:
            The model's outputs by name (onnxruntime's fresh arrays, the
            caller's to write), or the dequeued blobs when the net has no
            model.  Inputs and outputs are also stored in ``workspace``.
            Every array of a batch is read-only, on every backend: it may be
            a view of the fetcher's own array; ``np.array(x)`` copies it,
            and ``Net(writable=True)`` hands out batches the caller may write.

        Raises:
            DequeueTimeout: a source had no batch within the timeout.
            EndOfInput: a source is exhausted (its last batch was consumed) or
                stopped; or a stop of a source feeding this net cancelled the
                model while it ran (``RunOptions.terminate``; the message says
                "cancelled", and the batch counts as dropped, not delivered).
            EndOfEpoch: an epoch of a source with ``epochs`` ended and the next
                follows (a kind of EndOfInput); the next call returns its first batch.
            FetcherError / ChunkError: a fetcher of a source failed (``on_error="raise"``).
            ValueError: a model input is fed by no source and not in the workspace,
                or the net has no model and no source; a negative ``timeout``.
            TypeError: a ``timeout`` that is not a number.
            BlobfeedError: the coordinator of a source was never started.
        """
        # the full check only off the common path: run() is per batch
        if timeout is not None and not (type(timeout) in (float, int) and timeout >= 0):
            timeout = check_timeout("timeout", timeout, allow_zero=True)
        feeds = self._feeds
        session = self._session
        if session is not None:
            return self._run_model(session, feeds, timeout)
        if not feeds:
            raise ValueError(f"net {self.name!r} has no model and no input source to dequeue from")
        if len(feeds) == 1:
            feed = feeds[0]
            batch = feed.dequeue(timeout)
            feed.delivered(batch)
            if type(batch) is EpochEnd:
                raise EndOfEpoch(feed.source.name, batch.epoch)
            blobs = dict(zip(feed.blob_names, batch.arrays))
        else:
            blobs = {}
            for feed, got in zip(feeds, self._take_all(feeds, timeout)):
                feed.delivered(got)
                blobs.update(zip(feed.blob_names, got.arrays))
        self.workspace._update(blobs)
        return blobs

    def _take_all(self, feeds: list[BatchReader], timeout: float | None) -> list[Any]:
        """One batch from each of several sources, under one deadline.

        A batch taken from one source while another fails or times out is
        held by its feed and handed out first next time, so sources never
        shift against each other.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        taken: list[Any] = []
        try:
            for feed in feeds:
                got = feed.take_held()
                if got is None:
                    left = None if deadline is None else max(deadline - time.monotonic(), 1e-6)
                    got = feed.dequeue(left)
                taken.append(got)
        except BaseException:
            for feed, got in zip(feeds, taken):
                feed.hold(got)
            raise
        ends = [(feed, got) for feed, got in zip(feeds, taken) if type(got) is EpochEnd]
        if ends:
            # a source's epoch ended: the others' batches wait for the next run()
            for feed, got in zip(feeds, taken):
                if type(got) is EpochEnd:
                    feed.delivered(got)
                else:
                    feed.hold(got)
            raise EndOfEpoch(ends[0][0].source.name, ends[0][1].epoch)
        return taken

    def _run_model(
        self, session: "ort.InferenceSession", feeds: list[BatchReader], timeout: float | None
    ) -> dict[str, np.ndarray]:
        """``run()`` with a model: the batches are delivered once the model
        returned; a stop meanwhile cancels it (see :meth:`_cancel`)."""
        # inputs no source feeds must come from the workspace (the list is
        # kept up to date by _attach, off the per-batch path)
        missing = [n for n in self._unfed if not self.workspace.has_blob(n)]
        if missing:
            fed = sorted({n for f in feeds for n in f.blob_names})
            raise ValueError(
                f"net {self.name!r}: model inputs {missing} are fed by no input source "
                f"(sources feed {fed}) and are not in the workspace"
            )
        # Made before any batch is taken, so a stop from here on cancels
        # this run: at once if it comes before the model starts.
        options = self._run_options = self._new_run_options()
        try:
            if len(feeds) == 1:
                feed = feeds[0]
                # a batch a cancelled run took goes first
                batch = feed.take_held()
                if batch is None:
                    batch = feed.dequeue(timeout)
                if type(batch) is EpochEnd:
                    feed.delivered(batch)
                    raise EndOfEpoch(feed.source.name, batch.epoch)
                taken = [(feed, batch)]
            else:
                taken = list(zip(feeds, self._take_all(feeds, timeout)))
            blobs: dict[str, Any] = {}
            for feed, batch in taken:
                feed.to_model(batch)
                blobs.update(zip(feed.blob_names, batch.arrays))
            inputs = {n: blobs[n] if n in blobs else self.workspace.fetch_blob(n) for n in self.input_names}
            t0 = time.perf_counter()
            try:
                if self._device_type == "cpu":
                    outputs = dict(zip(self.output_names, session.run(self.output_names, inputs, options)))
                else:
                    outputs = self._run_bound(session, inputs, options)
            except Exception as exc:
                if not options.terminate:
                    for feed, batch in taken:
                        feed.delivered(batch)
                    raise
                # Cancelled by a stop: the batches were not consumed.  A
                # stopped source's feed counts its batch as dropped; another
                # source's batch is handed out first by the next run().
                for feed, batch in taken:
                    feed.hold(batch)
                raise EndOfInput(
                    f"net {self.name!r}: run() cancelled: a source feeding it was stopped while "
                    "the model ran (onnxruntime's RunOptions.terminate)"
                ) from exc
        finally:
            self._run_options = None
        took = time.perf_counter() - t0
        for feed, batch in taken:
            feed.consume_stats.model.observe(took)  # blobfeed_model_run_seconds
            feed.delivered(batch)
        blobs.update(outputs)
        self.workspace._update(blobs)
        return outputs

    def _cancel(self) -> None:
        """End the run that is inside the model now, if any, through its
        ``RunOptions.terminate``; the run raises ``EndOfInput``.  Called when a
        source feeding this net stops.  One store into onnxruntime, no lock:
        ``request_stop`` may call it from a signal handler."""
        options = self._run_options
        if options is not None:
            options.terminate = True

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """Yield what each ``run()`` returns until the input ends (``EndOfInput``),
        or the epoch ends (``EndOfEpoch``: iterate again for the next one).

        Errors other than the end (``FetcherError``, ``DequeueTimeout``)
        propagate.
        """
        while True:
            try:
                out = self.run()
            except EndOfInput:
                return
            yield out

    def _run_bound(
        self, session: "ort.InferenceSession", inputs: dict[str, Any], options: "ort.RunOptions | None" = None
    ) -> dict[str, np.ndarray]:
        import onnxruntime as ort

        binding = session.io_binding()
        for name, value in inputs.items():
            if not isinstance(value, ort.OrtValue):
                value = ort.OrtValue.ortvalue_from_numpy(
                    np.ascontiguousarray(value), "cuda", self._device_id
                )
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, "cuda", self._device_id)
        session.run_with_iobinding(binding, options)
        return dict(zip(self.output_names, binding.copy_outputs_to_cpu()))

    def __repr__(self) -> str:
        model = "no model" if self._session is None else f"inputs {self.input_names}"
        return f"<Net {self.name!r} {self.device} {model}, {len(self._feeds)} source(s)>"
