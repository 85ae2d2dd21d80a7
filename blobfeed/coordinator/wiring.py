"""The public ``init_*`` calls: their argument checks, the backend, and the
wiring of a net to a source.  Each call adds one group to a
:class:`GlobalCoordinator`; nothing runs until its ``start()``."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np

from ..arguments import check_flag, check_index, check_timeout
from ..autotune import AutoWorkers, as_auto
from ..feeders.reading import BatchReader
from ..feeders import (
    Feed,
    FetcherBackend,
    FetchFun,
    InputSource,
    ProcessBackend,
    DealingOptions,
    ThreadBackend,
)
from ..feeders.dealing import Direct, EqualRounds, IndexedDealer
from ..feeders.indexed import RandomAccessSource, UnitReader, is_random_access
from ..feeders.read_units import UnitDispenser
from ..feeders.sharded import ShardedReader
from ..feeders.transport import mem_available
from ..metrics import ExternalLogger
from ..net import Net
from ..worker_info import draw_base_seed, shuffle_rng
from .groups import DataInputCoordinator, WorkerCoordinator, _GenericCoordinator
from .lifecycle import GlobalCoordinator, _on_host, global_coordinator

logger = logging.getLogger("blobfeed.coordinator")

InitFun = Callable[[WorkerCoordinator, GlobalCoordinator], Any]

#: the default bound of a source's internal queue in bytes: 1 GiB, so 800
#: image chunks cannot hold 2 GB however large each is
DEFAULT_MAX_BUFFERED_BYTES = 1 << 30
#: max_buffered_bytes="auto": this share of the memory the process may still
#: take when the source is wired (MemAvailable, within its cgroup's limit),
#: never under AUTO_BUFFERED_BYTES_MIN; the fixed default when it is unknown
AUTO_BUFFERED_BYTES_SHARE = 8
AUTO_BUFFERED_BYTES_MIN = 64 << 20


def auto_buffered_bytes(source: str) -> int:
    """The byte budget ``max_buffered_bytes="auto"`` gives source ``source``."""
    free = mem_available()
    budget = DEFAULT_MAX_BUFFERED_BYTES if free is None else max(AUTO_BUFFERED_BYTES_MIN, free // AUTO_BUFFERED_BYTES_SHARE)
    logger.info(
        "source %r: max_buffered_bytes='auto' is %d MiB (%s)", source, budget >> 20,
        "the memory this process may take is unknown: the default" if free is None
        else f"1/{AUTO_BUFFERED_BYTES_SHARE} of the {free >> 20} MiB this process may still take",
    )
    return budget


# -- argument checks: at the public boundary, never assert ---------------------------------
def resolve_backend(backend: Any) -> FetcherBackend:
    """The backend object for ``backend=`` ("threads", "processes" or an object)."""
    if backend == "threads":
        return ThreadBackend()
    if backend == "processes":
        return ProcessBackend()
    if isinstance(backend, str) or not isinstance(backend, FetcherBackend):
        raise ValueError(
            f"backend must be 'threads', 'processes' or a backend object (such as "
            f"blobfeed.ProcessBackend(...) or blobfeed.ray.RayBackend(...)), got {backend!r}"
        )
    return backend


def _check_common(
    name: Any, init_fun: Any, external_loggers: Any, coordinator: Any
) -> tuple[GlobalCoordinator, list[ExternalLogger]]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"the source / worker name must be a non-empty str, got {name!r}")
    if init_fun is not None and not callable(init_fun):
        raise TypeError(f"init_fun must be callable, got {type(init_fun).__name__}")
    loggers = list(external_loggers or [])
    for ext in loggers:
        if not callable(getattr(ext, "log", None)):
            raise TypeError(f"external logger {ext!r} has no callable log(metrics) method")
    gc = global_coordinator if coordinator is None else coordinator
    if not isinstance(gc, GlobalCoordinator):
        raise TypeError(f"coordinator must be a GlobalCoordinator, got {type(coordinator).__name__}")
    return gc, loggers


def check_call(what: str, fun: Callable[..., Any], params: Sequence[str]) -> None:
    """Refuse, when it is wired, a function blobfeed will call with the
    positional arguments ``params`` but whose signature cannot take them:
    otherwise the ``TypeError`` comes from a worker, at the first ``run()``.

    A signature that cannot be read (a builtin, some C callables) is
    accepted: the call will tell.

    Raises:
        TypeError: naming the function, where it is defined, what it
            accepts and how blobfeed calls it.
    """
    try:
        sig = inspect.signature(fun)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*params)
    except TypeError as exc:
        inner = fun.func if isinstance(fun, functools.partial) else fun
        name = getattr(inner, "__qualname__", None) or type(inner).__qualname__
        if inner is not fun:
            name = f"functools.partial({name}, ...)"
        inner = inspect.unwrap(inner)
        code = getattr(inner, "__code__", None) if inspect.isfunction(inner) else None
        where = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        raise TypeError(
            f"{what} {name}{sig}{where} cannot be called as {what}({', '.join(params)}): {exc}. "
            f"blobfeed calls it with {len(params)} positional argument{'s' if len(params) != 1 else ''}"
            f" ({', '.join(params)})"
        ) from None


def init_workers(
    worker_fun: Callable[[int], Any],
    num_worker_threads: int = 2,
    worker_name: str = "train",
    init_fun: InitFun | None = None,
    external_loggers: Iterable[ExternalLogger] | None = None,
    shutdown_fun: Callable[[], Any] | None = None,
    *,
    coordinator: GlobalCoordinator | None = None,
) -> GlobalCoordinator:
    """Run ``worker_fun(worker_id)`` in a loop on ``num_worker_threads`` threads.

    Nothing runs until the returned coordinator's ``start()``.  A
    ``worker_fun`` that raises is logged with its traceback and stops its
    coordinator (``shutdown_fun()`` is then called once).

    Returns:
        The global coordinator (``coordinator`` if given).

    Raises:
        TypeError / ValueError: bad arguments, at once.
    """
    if not callable(worker_fun):
        raise TypeError(f"worker_fun must be callable, got {type(worker_fun).__name__}")
    if shutdown_fun is not None and not callable(shutdown_fun):
        raise TypeError(f"shutdown_fun must be callable, got {type(shutdown_fun).__name__}")
    num_worker_threads = check_index("num_worker_threads", num_worker_threads)
    gc, loggers = _check_common(worker_name, init_fun, external_loggers, coordinator)
    ids = gc._allocate(num_worker_threads)
    gc._add(_GenericCoordinator(worker_fun, gc, worker_name, ids, init_fun, shutdown_fun, loggers))
    return gc


def init_data_input_workers(
    net: Net,
    input_blob_names: Sequence[str],
    fetch_fun: FetchFun,
    batch_size: int,
    num_worker_threads: int | Literal["auto"] | AutoWorkers = 2,
    input_source_name: str = "train",
    max_buffered_batches: int = 800,
    init_fun: InitFun | None = None,
    external_loggers: Iterable[ExternalLogger] | None = None,
    dont_rebatch: bool = False,
    batch_columns: Sequence[int] | None = None,
    timeout: float = 600.0,
    *,
    device_queue_capacity: int = 4,
    drop_last: bool = False,
    on_error: Literal["raise", "skip"] = "raise",
    coordinator: GlobalCoordinator | None = None,
    seed: int | None = None,
    backend: Literal["threads", "processes"] | FetcherBackend = "threads",
    worker_init_fun: Callable[[int], Any] | None = None,
    deterministic: bool = False,
    shuffle_buffer: int = 0,
    epochs: int | None = 1,
    max_buffered_bytes: int | Literal["auto"] | None = DEFAULT_MAX_BUFFERED_BYTES,
    equal: bool = False,
) -> GlobalCoordinator:
    """Feed ``net``'s blobs ``input_blob_names`` from ``fetch_fun`` on worker threads.

    ``fetch_fun(worker_id, batch_size)`` returns a chunk: a list or tuple with
    one ``numpy.ndarray`` per blob name, all with the same number of samples
    along their batch axis (``batch_columns[i]``, default 0).  Any sample
    count works; ``batch_size`` is a hint.  Return ``None`` to skip, raise
    ``StopIteration`` when the worker has no more data.  The chunk belongs
    to blobfeed afterwards (a batch may be a view of it).

    Args:
        net: the :class:`~blobfeed.Net` to feed.
        input_blob_names: one name per array of a chunk.
        fetch_fun: the user's fetcher; or a random-access source, an object
            with ``__len__`` and ``__getitem__`` (torch's map-style
            ``Dataset``, grain's ``RandomAccessDataSource``) or a
            :class:`~blobfeed.RandomAccessSource`, or a
            :class:`~blobfeed.ShardedSource` (shards read sequentially):
            blobfeed draws its order and its batch stream does not depend
            on the workers or nets (docs/SOURCES.md).
        batch_size: samples per batch (the last batch of an ended source may be smaller).
        num_worker_threads: fetcher threads for this call; or ``"auto"``
            (or :class:`~blobfeed.AutoWorkers` with bounds): the source
            starts with one worker and the coordinator adds workers while
            the nets wait for input and one more raises the throughput, and
            removes them when they idle, within the CPUs this process may
            use, ``max_buffered_bytes`` and a hard cap (docs/TUNING.md).  On
            a ``fetch_fun`` source it needs arrival order (not
            ``deterministic``, no ``shuffle_buffer``, ``epochs=1``, not
            ``equal``), threads or processes, and a ``fetch_fun`` that does
            not split the data by worker (``get_worker_info().num_workers``
            changes while it runs).  Every call for one source agrees on it.
        input_source_name: calls with the same name share one internal queue
            (data parallel: every sample reaches exactly one net).
        max_buffered_batches: bound of the internal queue, in chunks (the first
            call for a source sets it).
        init_fun: ``init_fun(data_coordinator, global_coordinator)``, run once in
            ``start()`` before any thread starts.
        external_loggers: objects with ``log(metrics: dict)``.
        dont_rebatch: each chunk becomes one batch as it is.
        batch_columns: batch axis of each blob.
        timeout: seconds ``Net.run()`` waits for a batch before ``DequeueTimeout``.
        device_queue_capacity: batches buffered for the net.
        drop_last: drop the last, smaller batch of an ended source.
        on_error: ``"raise"``: a fetcher error stops the source and reaches
            ``Net.run()``; ``"skip"``: the chunk is dropped, logged, counted.
        coordinator: an isolated :class:`GlobalCoordinator`; default the global one.
        seed: base of the workers' seeds (``get_worker_info().seed`` / ``.rng``:
            one child of ``numpy.random.SeedSequence(seed)`` per worker id);
            ``None`` draws one and logs it.
        backend: what runs the workers: ``"threads"`` (this process),
            ``"processes"`` (one child process per worker, chunks through
            shared memory; ``fetch_fun`` must pickle), or a backend object
            (``blobfeed.ProcessBackend(...)`` with options,
            ``blobfeed.ray.RayBackend(...)``).
        worker_init_fun: ``worker_init_fun(worker_id)``, run in the worker
            (thread, process or actor) before its first fetch.
        deterministic: the source's chunks are taken in strict round robin
            by worker id and its batches dealt to its nets in turn, so the
            same ``fetch_fun``, ``seed``, worker count and batch size give the
            same batches to the same nets on every run and every backend;
            needed by :meth:`GlobalCoordinator.state_dict`.  Every call for
            one source must agree on it and on ``batch_size``.
        shuffle_buffer: samples pass through a buffer of this many samples
            and leave it in random order (blobs kept aligned; 0: off), drawn
            from ``seed``: with ``deterministic=True`` the order is the same
            on every run.  Every call for one source must agree on it.
        epochs: passes over the data (``None``: endless).  When a worker's
            ``fetch_fun`` raises StopIteration and another epoch follows, the
            worker starts the next epoch: ``get_worker_info().epoch`` (and
            its ``seed``/``rng``) change, ``worker_init_fun`` runs again, and
            ``fetch_fun`` is called again and must start over.  Each epoch
            ends with its own last (smaller) batch, after which ``Net.run()``
            raises :class:`~blobfeed.EndOfEpoch` once (``for out in net``
            runs one epoch); after the last epoch, ``EndOfInput``.  With a
            shuffle buffer, each epoch is shuffled on its own.  Every call
            for one source must agree on it.
        max_buffered_bytes: bound of the internal queue in bytes (its
            chunks' arrays; default 1 GiB; ``None``: no bound; ``"auto"``:
            a budget of an eighth of the memory this process may still
            take when the source is wired, at least 64 MiB, logged; in
            arrival order the queue holds at most a working limit under it
            that follows need, :mod:`blobfeed.buffers`), besides
            ``max_buffered_batches``: a fetcher waits while its chunk would
            pass it, but a chunk always enters an empty queue (with
            ``deterministic``, ``shuffle_buffer`` or ``epochs``: each worker's
            equal share, and an empty lane).  A random-access source on
            worker processes read by one net with prefetch is bounded by
            its read units instead (its enqueuer reads the workers' results
            as it needs them: docs/BACKENDS.md).  The first call for a
            source sets it.
        equal: every net on the source gets the same number of batches per
            epoch, so a data-parallel step never waits for a net that ran
            out first.  The batches are dealt in turn (batch *i* to the
            *i mod k*-th net wired, as with ``deterministic``, which still
            decides whether the workers' chunks are read in strict round
            robin) and go out in rounds of one batch per net, each once it is
            complete; an epoch's last, incomplete round (the end of the data
            ends the last epoch) is dropped, counted
            (``blobfeed_dropped_samples_total{reason="equal"}``) and logged.
            With ``drop_last`` the epoch's last partial batch is dropped
            before the round is judged.  Every call for one source must
            agree on it, and with it on ``drop_last``; not with
            ``dont_rebatch``.

    Returns:
        The global coordinator; call its ``start()``.

    Raises:
        TypeError / ValueError: bad arguments, at once, in the caller's thread;
            also a blob named like one of the model's outputs (the output would
            replace it in the workspace), and a net already fed from this source.
    """
    if not isinstance(net, Net):
        raise TypeError(f"net must be a blobfeed.Net, got {type(net).__name__}")
    gc, _ = _wire(
        net, net.name, input_blob_names, fetch_fun, batch_size, num_worker_threads, input_source_name, max_buffered_batches, init_fun, external_loggers, dont_rebatch, batch_columns, timeout,
        device_queue_capacity=device_queue_capacity, drop_last=drop_last, on_error=on_error, coordinator=coordinator, seed=seed, backend=backend, worker_init_fun=worker_init_fun, deterministic=deterministic, shuffle_buffer=shuffle_buffer, epochs=epochs, max_buffered_bytes=max_buffered_bytes, equal=equal,
    )
    return gc


def _wire(
    net: Net | None,
    reader_name: str,
    input_blob_names: Sequence[str],
    fetch_fun: FetchFun,
    batch_size: int,
    num_worker_threads: int | Literal["auto"] | AutoWorkers = 2,
    input_source_name: str = "train",
    max_buffered_batches: int = 800,
    init_fun: InitFun | None = None,
    external_loggers: Iterable[ExternalLogger] | None = None,
    dont_rebatch: bool = False,
    batch_columns: Sequence[int] | None = None,
    timeout: float = 600.0,
    *,
    device_queue_capacity: int = 4,
    drop_last: bool = False,
    on_error: Literal["raise", "skip"] = "raise",
    coordinator: GlobalCoordinator | None = None,
    seed: int | None = None,
    backend: Literal["threads", "processes"] | FetcherBackend = "threads",
    worker_init_fun: Callable[[int], Any] | None = None,
    deterministic: bool = False,
    shuffle_buffer: int = 0,
    epochs: int | None = 1,
    max_buffered_bytes: int | Literal["auto"] | None = DEFAULT_MAX_BUFFERED_BYTES,
    equal: bool = False,
    prefetch: bool = True,
) -> tuple[GlobalCoordinator, BatchReader]:
    """``init_data_input_workers`` for ``net``, or without a net (None): the
    source's workers and a feed named ``reader_name``."""
    if isinstance(input_blob_names, str) or not isinstance(input_blob_names, Sequence):
        raise TypeError(
            f"input_blob_names must be a list or tuple of str, got {type(input_blob_names).__name__}"
        )
    names = list(input_blob_names)
    if not names:
        raise ValueError("input_blob_names is empty: name at least one blob")
    for n in names:
        if not isinstance(n, str) or not n:
            raise ValueError(f"input_blob_names must be non-empty str, got {n!r}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"input_blob_names has duplicates: {dupes}")
    spec: RandomAccessSource | None = None
    if is_random_access(fetch_fun):
        spec = fetch_fun if isinstance(fetch_fun, RandomAccessSource) else RandomAccessSource(fetch_fun)
    elif not callable(fetch_fun):
        raise TypeError(
            f"fetch_fun must be callable, got {type(fetch_fun).__name__} (or a random-access source: "
            "an object with __len__ and __getitem__)"
        )
    else:
        check_call("fetch_fun", fetch_fun, ("worker_id", "batch_size"))
    batch_size = check_index("batch_size", batch_size)
    auto = as_auto(num_worker_threads)
    num_worker_threads = auto.start if auto is not None else check_index("num_worker_threads", num_worker_threads)
    max_buffered_batches = check_index("max_buffered_batches", max_buffered_batches)
    device_queue_capacity = check_index("device_queue_capacity", device_queue_capacity)
    if batch_columns is None:
        axes = [0] * len(names)
    else:
        if isinstance(batch_columns, np.ndarray):
            batch_columns = batch_columns.tolist()
        if isinstance(batch_columns, str) or not isinstance(batch_columns, Sequence):
            raise TypeError(f"batch_columns must be a list of ints, got {type(batch_columns).__name__}")
        if len(batch_columns) != len(names):
            raise ValueError(
                f"batch_columns has {len(batch_columns)} entries but there are {len(names)} blobs {names}"
            )
        axes = [check_index(f"batch_columns[{i}]", a, minimum=0) for i, a in enumerate(batch_columns)]
    timeout = check_timeout("timeout", timeout)
    dont_rebatch = check_flag("dont_rebatch", dont_rebatch)
    drop_last = check_flag("drop_last", drop_last)
    prefetch = check_flag("prefetch", prefetch)
    deterministic = check_flag("deterministic", deterministic)
    shuffle_buffer = check_index("shuffle_buffer", shuffle_buffer, minimum=0)
    if epochs is not None:
        epochs = check_index("epochs", epochs)
    # "auto": the budget, and (in arrival order) a working limit under it that follows need
    follow_need = max_buffered_bytes == "auto"
    if max_buffered_bytes == "auto":
        max_buffered_bytes = auto_buffered_bytes(input_source_name)
    elif isinstance(max_buffered_bytes, str):
        raise TypeError(f"max_buffered_bytes must be an int >= 1, None or 'auto', got {max_buffered_bytes!r}")
    elif max_buffered_bytes is not None:
        max_buffered_bytes = check_index("max_buffered_bytes", max_buffered_bytes)
    equal = check_flag("equal", equal)
    if equal and dont_rebatch:
        raise ValueError(
            "equal=True deals the source's batches in rounds, one per net, cut once for every net: "
            "it cannot be combined with dont_rebatch=True (each chunk its own batch)"
        )
    if (deterministic or shuffle_buffer or epochs != 1) and dont_rebatch:
        raise ValueError(
            "deterministic=True, shuffle_buffer and epochs re-batch the source's stream once: "
            "they cannot be combined with dont_rebatch=True"
        )
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if seed is not None:
        seed = check_index("seed", seed, minimum=0)
    if worker_init_fun is not None and not callable(worker_init_fun):
        raise TypeError(f"worker_init_fun must be callable, got {type(worker_init_fun).__name__}")
    if worker_init_fun is not None:
        check_call("worker_init_fun", worker_init_fun, ("worker_id",))
    runner = resolve_backend(backend)
    n_items = 0
    if spec is not None:
        n_items = spec.length(input_source_name)
        refused = [
            what for what, on in (
                ("dont_rebatch=True", dont_rebatch), (f"shuffle_buffer={shuffle_buffer}", shuffle_buffer),
                ("on_error='skip'", on_error == "skip"),
            ) if on
        ]
        if refused:
            raise ValueError(
                f"source {input_source_name!r} is a {spec.kind}: it cannot take {', '.join(refused)} "
                f"(its order is drawn by blobfeed: use {type(spec).__name__}(..., shuffle=True); every "
                "sample is read exactly once per epoch, so a failed read fails the source)"
            )
        if not getattr(runner, "random_access", False):
            raise ValueError(
                f"source {input_source_name!r} is a {spec.kind}: it runs on backend='threads', "
                f"'processes' or a RayBackend (a backend with random_access = True), not on {runner!r}"
            )
    if spec is None:
        runner.check(fetch_fun, worker_init_fun)
        if auto is not None:
            _check_auto_fetch_fun(input_source_name, runner, DealingOptions(
                deterministic, shuffle_buffer, epochs, equal, drop_last and equal, False,
            ))
    clash = sorted(set(names).intersection(net.output_names)) if net is not None else []
    if net is not None and clash:
        raise ValueError(
            f"net {net.name!r}: blobs {clash} have the names of model outputs "
            f"(outputs {list(net.output_names)}): run() would replace the fed values with the "
            "predictions in the workspace; feed them under other names"
        )
    gc, loggers = _check_common(input_source_name, init_fun, external_loggers, coordinator)
    # the nets of one source share its drawn seed: one "drew seed=" line, true for every call
    base_seed = seed if seed is not None else gc._known.seed_of(input_source_name)
    if base_seed is None:
        base_seed = draw_base_seed(input_source_name)
    if spec is not None:
        fetch_fun = spec.reader(
            input_source_name, n_items, spec.seed if spec.seed is not None else base_seed, names, axes,
        )
        runner.check(fetch_fun, worker_init_fun)
    # with equal=True the dealer drops an epoch's last partial batch itself
    # (see DealingOptions.drop_last), so every net must agree on drop_last
    dealing = DealingOptions(
        deterministic or spec is not None, shuffle_buffer, epochs, equal, drop_last and equal, spec is not None,
    )
    with gc._lock:
        # Every check first, so a refused call leaves nothing behind.
        source = gc._sources.get(input_source_name)
        if source is not None and source.stopped:
            # stopped, its threads not all ended yet (a stuck fetcher): the
            # name starts afresh; the old source ends on its own
            source = None
        if net is not None:
            net._check_attach(input_source_name, names)
        if source is not None:
            if (source.n_blobs, source.axes) != (len(names), tuple(axes)):
                raise ValueError(
                    f"source {input_source_name!r} carries {source.n_blobs} blobs with batch axes "
                    f"{list(source.axes)}; this call asks for {len(names)} with {axes}"
                )
            if max_buffered_batches != source.queue_capacity():
                logger.warning(
                    "source %r already has an internal queue of %d chunks; "
                    "max_buffered_batches=%d ignored",
                    input_source_name, source.queue_capacity(), max_buffered_batches,
                )
            if max_buffered_bytes != source.max_bytes:
                logger.warning(
                    "source %r already has an internal queue bound of %s bytes; "
                    "max_buffered_bytes=%s ignored",
                    input_source_name, source.max_bytes, max_buffered_bytes,
                )
            if any(f.net_name == reader_name for f in source.feeds):
                logger.warning(
                    "source %r already feeds a net named %r: their metrics share the label "
                    "net=%r; give each Net a distinct name to tell them apart",
                    input_source_name, reader_name, reader_name,
                )
            if source.dealing != dealing:
                raise ValueError(
                    f"source {input_source_name!r} was wired with {source.dealing.describe()}; "
                    f"this call asks for {dealing.describe()}: every call for one source must agree"
                )
            # a dealer that cuts batches once for every net has one batch size
            # and deals to the nets wired before start()
            fixed = source.dealer.batch_size
            if fixed is not None and fixed != batch_size:
                raise ValueError(
                    f"source {input_source_name!r} is re-batched once for all its nets (deterministic, "
                    f"shuffle_buffer, epochs or equal) with batch_size={fixed}; "
                    f"this call asks for {batch_size}: such a source has one batch size"
                )
            if fixed is not None and any(c.started for c in gc._coordinators if c.name == input_source_name):
                raise ValueError(
                    f"source {input_source_name!r} deals its batches to its nets in turn (deterministic, "
                    f"shuffle_buffer, epochs or equal) and already started: "
                    "wire every net before start()"
                )
            tuned = gc._autotune.tuned(input_source_name)
            if tuned != (auto is not None):
                raise ValueError(
                    f"source {input_source_name!r} was wired with num_worker_threads="
                    f"{'auto' if tuned else 'a number'}; this call asks for "
                    f"{num_worker_threads if auto is None else repr('auto')}: every call for one source "
                    "agrees on whether its worker count is tuned"
                )
            if spec is not None:
                assert isinstance(fetch_fun, UnitReader)
                _same_random_access(input_source_name, source, fetch_fun, spec)
                fetch_fun.units = source.dealer.units  # type: ignore[attr-defined]
            source.register_fetchers(num_worker_threads)  # atomic with the source's end
        elif spec is not None:
            assert isinstance(fetch_fun, UnitReader)
            source = _random_access_source(
                gc, input_source_name, fetch_fun, spec, dealing, batch_size, axes, len(names),
                max_buffered_batches, max_buffered_bytes,
            )
            source.register_fetchers(num_worker_threads)
        else:
            source = InputSource(
                input_source_name, max_buffered_batches, len(names), axes, gc._hub, gc._on_failure,
                dealing=dealing, batch_size=batch_size, shuffle_rng=functools.partial(shuffle_rng, base_seed),
                max_bytes=max_buffered_bytes, follow_need=follow_need,
            )
            source.register_fetchers(num_worker_threads)
            if follow_need and max_buffered_bytes is not None and dealing.in_arrival_order:
                gc._buffers.add(input_source_name, source, max_buffered_bytes)
        feed = Feed(
            source, reader_name, net._place if net is not None else _on_host, names, batch_size,
            timeout=timeout, device_queue_capacity=device_queue_capacity,
            dont_rebatch=dont_rebatch, drop_last=drop_last, hub=gc._hub,
            model_inputs=net.input_specs if net is not None else None,
            writable=net.writable if net is not None else False, prefetch=prefetch,
        )
        reader = BatchReader(feed)
        if net is not None:
            feed.cancel = net._cancel
            net._attach(reader)
        source.add_feed(feed)
        gc._sources[input_source_name] = source
        ids = gc._allocate(num_worker_threads)
        source.add_workers(ids)
        source.worker_count += num_worker_threads
        if auto is not None:
            gc._autotune.add(input_source_name, auto, num_worker_threads, source)
        gc._add(DataInputCoordinator(
            gc, source, net, feed, fetch_fun, ids, init_fun, loggers, on_error, base_seed,
            runner, worker_init_fun,
        ))
    return gc, reader


def _check_auto_fetch_fun(name: str, runner: FetcherBackend, dealing: DealingOptions) -> None:
    """Refuse ``num_worker_threads="auto"`` for a fetch_fun source whose
    worker count cannot change while it runs."""
    if not dealing.in_arrival_order:
        raise ValueError(
            f"source {name!r}: num_worker_threads='auto' changes the worker count while the source "
            f"runs, and this fetch_fun source keeps a lane per worker ({dealing.describe()}: only "
            "deterministic=False, shuffle_buffer=0, epochs=1, equal=False takes chunks as they come); use a fixed num_worker_threads, or a random-access source "
            "(an object with __len__ and __getitem__), whose stream does not depend on its workers"
        )
    if not getattr(runner, "elastic", False):
        raise ValueError(
            f"source {name!r}: num_worker_threads='auto' needs a backend that can add and remove "
            f"workers of a running fetch_fun source (threads, processes, Ray), not {runner!r}"
        )


def _read_size(spec: RandomAccessSource, batch_size: int) -> int | None:
    """The read size a wiring call asks for: ``spec.read_size``, the batch
    size for None, or None when the units are sized by bytes (read_size=None
    and a dataset with ``__getitems__``)."""
    if spec.read_size is not None:
        return spec.read_size
    return None if hasattr(type(spec.dataset), "__getitems__") else batch_size


def _random_access_source(
    gc: GlobalCoordinator, name: str, reader: UnitReader, spec: RandomAccessSource, dealing: DealingOptions,
    batch_size: int, axes: Sequence[int], n_blobs: int, capacity: int, max_bytes: int | None,
) -> InputSource:
    """The source of a random-access dataset: its read units and the dealer
    that puts them back in order."""
    units = UnitDispenser(name, reader.n, spec.read_size or batch_size, dealing.epochs, unit_end=reader.unit_end,
                          auto=_read_size(spec, batch_size) is None)
    reader.units = units
    units.describe = lambda r: reader.span(reader.indexes(r))
    hub = gc._hub

    def dealer(src: InputSource) -> IndexedDealer:
        return IndexedDealer(
            name, batch_size, axes, capacity, src.fail_in_order, units,
            on_dropped=lambda reason, n: hub.count_dropped(name, reason, n),
            rounds=EqualRounds(dealing.drop_last) if dealing.equal else Direct(),
            max_bytes=max_bytes, window=spec.window, reader=reader,
        )

    source = InputSource(
        name, capacity, n_blobs, axes, hub, gc._on_failure, dealing=dealing, batch_size=batch_size,
        max_bytes=max_bytes, dealer=dealer,
    )
    # its chunks' layouts are checked in stream order, by the dealer
    source.validator.per_chunk_only = True
    #: what a state of it records and checks: (length, seed, shuffle, read size (None: the default))
    source.random_access = (reader.n, reader.seed, reader.shuffle, _read_size(spec, batch_size))
    source.sharded = reader.fingerprint if isinstance(reader, ShardedReader) else None
    return source


def _same_random_access(name: str, source: InputSource, reader: UnitReader, spec: RandomAccessSource) -> None:
    """Refuse a later call for a random-access source that reads other data,
    or reads it otherwise (another read size or window)."""
    assert source.random_access is not None
    n, seed, shuffle, read_size = source.random_access
    dealer = source.dealer
    # a random-access source's (its dealing says so, checked before) is made by _random_access_source
    assert isinstance(dealer, IndexedDealer)
    had_shards, shards = source.sharded, reader.fingerprint if isinstance(reader, ShardedReader) else None
    if (had_shards is None) != (shards is None):
        raise ValueError(
            f"source {name!r} reads a {'sharded source' if had_shards else 'random-access dataset'}; this call "
            f"passes a {'sharded source' if shards else 'random-access dataset'}: every call for one source "
            "reads the same data, the same way"
        )
    if had_shards is not None and shards is not None:
        for what, had, asked in zip(("the shard count", "shard_sizes", "shuffle_block"), had_shards, shards):
            if had != asked:
                raise ValueError(
                    f"source {name!r} reads a sharded source with {what} {had!r}; this call passes one with "
                    f"{asked!r}: every call for one source reads the same data, the same way"
                )
    kind, length = ("sharded source", "sum(shard_sizes)") if shards is not None else ("random-access dataset",
                                                                                      "len(dataset)")
    for what, had, asked in ((length, n, reader.n), ("shuffle", shuffle, reader.shuffle),
                             ("seed", seed, reader.seed),
                             ("read_size", read_size, _read_size(spec, dealer.batch_size)),
                             ("window", dealer.window, spec.window)):
        if had != asked:
            raise ValueError(
                f"source {name!r} reads a {kind} with {what}={had!r}; this call "
                f"passes one with {what}={asked!r}: every call for one source reads the same data, "
                "the same way"
            )


def init_reader(
    input_blob_names: Sequence[str],
    fetch_fun: FetchFun,
    batch_size: int,
    num_worker_threads: int | Literal["auto"] | AutoWorkers = 2,
    input_source_name: str = "train",
    *,
    reader_name: str = "reader",
    coordinator: GlobalCoordinator | None = None,
    **wiring: Any,
) -> BatchReader:
    """``init_data_input_workers`` without a net: source ``input_source_name``
    with its workers, and a first reader of its batches (more with
    ``GlobalCoordinator.add_reader``; a net takes one with ``Net.add_reader``).

    ``wiring`` takes the keyword arguments of ``init_data_input_workers``
    (``timeout``, ``device_queue_capacity`` (batches assembled ahead of the
    reader), ``drop_last``, ``deterministic``, ``epochs``, ``equal``, ...);
    the reader's enqueuer thread is the coordinator's, as a net's is.
    ``prefetch=False``: no enqueuer thread and nothing assembled ahead: each
    ``read()`` assembles its batch in the reader's own thread (copies
    included), for a reader that runs in a thread of its own anyway (a
    server's sender): one thread hand-off less per batch.

    Raises:
        ValueError / TypeError: as ``init_data_input_workers``; a bad ``reader_name``.
    """
    if not isinstance(reader_name, str) or not reader_name:
        raise ValueError(f"reader_name must be a non-empty str, got {reader_name!r}")
    _, reader = _wire(
        None, reader_name, input_blob_names, fetch_fun, batch_size, num_worker_threads, input_source_name,
        coordinator=coordinator, **wiring,
    )
    return reader
