"""Worker lifecycle, the global coordinator and shared input sources.

One ``init_*`` call makes one coordinator (a group of threads with a name);
the :class:`GlobalCoordinator` starts and stops them all.  Every thread is a
daemon: a program that never calls ``stop()`` still exits.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Literal, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry

from .feeders import Feed, FetchFun, InputSource, fetcher_loop
from .metrics import ExternalLogger, FetchStats, MetricsHub
from .net import Net

__all__ = [
    "DataInputCoordinator",
    "GlobalCoordinator",
    "WorkerCoordinator",
    "global_coordinator",
    "init_data_input_workers",
    "init_workers",
]

logger = logging.getLogger("blobfeed.coordinator")

InitFun = Callable[["WorkerCoordinator", "GlobalCoordinator"], Any]

#: Default seconds ``stop()`` waits for threads to end.
DEFAULT_JOIN_TIMEOUT = 5.0
#: At interpreter exit nothing should hold the process for long.
ATEXIT_JOIN_TIMEOUT = 0.25


class WorkerCoordinator:
    """The threads of one ``init_workers`` call (generic workers).

    Created by :func:`init_workers`; users see it as the first argument of
    ``init_fun`` and read ``name``, ``worker_ids`` and ``is_active``.
    """

    def __init__(
        self,
        global_coordinator: "GlobalCoordinator",
        name: str,
        worker_ids: list[int],
        init_fun: InitFun | None,
        shutdown_fun: Callable[[], Any] | None,
        external_loggers: Sequence[ExternalLogger],
    ) -> None:
        self.name = name
        self.worker_ids = list(worker_ids)
        self._gc = global_coordinator
        self._init_fun = init_fun
        self._init_done = init_fun is None
        self._shutdown_fun = shutdown_fun
        self._loggers = list(external_loggers)
        self._hub = global_coordinator._hub
        self._threads: list[threading.Thread] = []
        self._stop_event = threading.Event()
        self.started = False
        self._started_at = 0.0
        self._shutdown_done = False
        self._log_lock = threading.Lock()
        self._final_logged = False

    @property
    def is_active(self) -> bool:
        """True between ``start()`` and stop."""
        return self.started and not self._stop_event.is_set()

    def _targets(self) -> list[tuple[str, Callable[[], None]]]:
        raise NotImplementedError

    def _run_init(self) -> None:
        if not self._init_done and self._init_fun is not None:
            self._init_fun(self, self._gc)
            self._init_done = True

    def _start(self) -> None:
        self._started_at = time.monotonic()
        self._threads = [
            threading.Thread(target=_thread_main, args=(name, fn), name=name, daemon=True)
            for name, fn in self._targets()
        ]
        self.started = True
        for t in self._threads:
            t.start()

    def _request_stop(self) -> None:
        self._stop_event.set()

    def _shutdown(self) -> None:
        """Call ``shutdown_fun`` once, if this coordinator was started."""
        with self._log_lock:
            if self._shutdown_done or not self.started:
                return
            self._shutdown_done = True
        if self._shutdown_fun is not None:
            try:
                self._shutdown_fun()
            except Exception:
                logger.exception("shutdown_fun of coordinator %r raised", self.name)

    def _join(self, deadline: float) -> list[str]:
        """Join our threads until ``deadline``; returns the names still alive."""
        me = threading.current_thread()
        stuck = []
        for t in self._threads:
            if t is me:
                continue
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                stuck.append(t.name)
        return stuck

    def _log_metrics(self) -> dict[str, Any]:
        return {"worker_name": self.name, "time_elapsed": time.monotonic() - self._started_at}

    def _call_loggers(self, final: bool = False) -> None:
        """Per interval (monitor thread), and once more at the end (``final``)."""
        with self._log_lock:
            if not self._loggers or not self.started or self._final_logged:
                return
            self._final_logged = final
            metrics = self._log_metrics()
        for ext in self._loggers:
            try:
                ext.log(dict(metrics))
            except Exception:
                logger.exception("external logger %r of %r raised; ignored", ext, self.name)

    def _retire(self) -> None:
        pass


class _GenericCoordinator(WorkerCoordinator):
    def __init__(self, worker_fun: Callable[[int], Any], *args: Any) -> None:
        super().__init__(*args)
        self._worker_fun = worker_fun

    def _targets(self) -> list[tuple[str, Callable[[], None]]]:
        return [
            (f"blobfeed-worker-{self.name}-{wid}", functools.partial(self._loop, wid))
            for wid in self.worker_ids
        ]

    def _loop(self, worker_id: int) -> None:
        stop = self._stop_event
        fun = self._worker_fun
        while not stop.is_set():
            try:
                fun(worker_id)
            except Exception:
                logger.exception(
                    "worker %d of %r raised; stopping coordinator %r", worker_id, self.name, self.name
                )
                # Stop, but stay registered: the global stop() still joins
                # the siblings and reports whether they ended.
                stop.set()
                self._shutdown()
                self._call_loggers(final=True)
                return


class DataInputCoordinator(WorkerCoordinator):
    """The fetchers and the enqueuer of one ``init_data_input_workers`` call.

    Users meet it as the first argument of ``init_fun``: ``name`` (the input
    source name), ``worker_ids``, ``net``, ``input_blob_names`` and
    ``batch_size`` are public and read-only.
    """

    def __init__(
        self,
        global_coordinator: "GlobalCoordinator",
        source: InputSource,
        net: Net,
        feed: Feed,
        fetch_fun: FetchFun,
        worker_ids: list[int],
        init_fun: InitFun | None,
        external_loggers: Sequence[ExternalLogger],
        on_error: Literal["raise", "skip"],
    ) -> None:
        super().__init__(global_coordinator, source.name, worker_ids, init_fun, None, external_loggers)
        self.source = source
        self.feed = feed
        self.net = net
        self.input_blob_names = feed.blob_names
        self._fetch_fun = fetch_fun
        self._on_error = on_error
        self._fetch_stats: list[FetchStats] = []
        self._last_log: tuple[float, float, int, float, int] | None = None

    @property
    def batch_size(self) -> int:
        """The batch size of this net's batches, and the fetchers' hint."""
        return self.feed.batch_size

    @property
    def is_active(self) -> bool:
        return self.started and not self.source.stop_event.is_set()

    def _targets(self) -> list[tuple[str, Callable[[], None]]]:
        hub = self._hub
        out: list[tuple[str, Callable[[], None]]] = []
        for wid in self.worker_ids:
            stats = hub.fetch_stats(self.name)
            self._fetch_stats.append(stats)
            out.append((
                f"blobfeed-fetch-{self.name}-{wid}",
                functools.partial(
                    fetcher_loop, self.source, wid, self._fetch_fun, self.feed.blob_names,
                    self._batch_size_hint, self._on_error, stats,
                ),
            ))
        out.append((f"blobfeed-enqueue-{self.name}-{self.net.name}", self._enqueue))
        return out

    def _enqueue(self) -> None:
        try:
            self.feed.run()
        finally:
            if self.source.finished or self.source.error is not None:
                # the source ended by itself: the loggers' last call is now
                self._call_loggers(final=True)

    def _batch_size_hint(self) -> int:
        return self.feed.batch_size

    def _start(self) -> None:
        self._last_log = (time.monotonic(), 0.0, 0, 0.0, 0)
        super()._start()

    def _request_stop(self) -> None:
        super()._request_stop()
        self.source.stop()

    def _log_metrics(self) -> dict[str, Any]:
        now = time.monotonic()
        fetch_time = sum(s.fetch.total for s in self._fetch_stats)
        fetch_count = sum(s.fetch.count for s in self._fetch_stats)
        enq = self.feed.stats.enqueue
        prev = self._last_log or (now, 0.0, 0, 0.0, 0)
        self._last_log = (now, fetch_time, fetch_count, enq.total, enq.count)
        return {
            "source": self.name,
            "inputs_per_sec": self._hub.inputs_per_second(self.name),
            "queue_size": self.source.queue.qsize(),
            "time_elapsed": now - self._started_at,
            "fetcher_time": fetch_time - prev[1],
            "fetcher_time_count": fetch_count - prev[2],
            "enqueue_time": enq.total - prev[3],
            "enqueue_time_count": enq.count - prev[4],
        }

    def _retire(self) -> None:
        hub = self._hub
        ended = [s for s, t in zip(self._fetch_stats, self._threads) if not t.is_alive()]
        hub.retire(self.name, ended)
        if self._threads and not self._threads[-1].is_alive():
            hub.retire(self.name, [self.feed.stats], net=self.net.name)
            self.feed.release_net()
        # A consumer may still call run() on the stopped net; what it records
        # after this point (the wait of a run that raises) is not counted.
        hub.retire(self.name, [self.feed.direct_stats, self.feed.consume_stats], net=self.net.name)
        hub.detach_source(self.source)


def _thread_main(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except BaseException:
        logger.exception("blobfeed thread %s died", name)


_live_coordinators: "weakref.WeakSet[GlobalCoordinator]" = weakref.WeakSet()


class GlobalCoordinator:
    """Starts, stops and watches every coordinator; owns the metrics.

    Args:
        registry: the ``prometheus_client.CollectorRegistry`` to put metrics
            in; default a fresh one (the module-level
            ``blobfeed.global_coordinator`` uses prometheus-client's default
            registry).
        log_interval: seconds between ``inputs_per_second`` updates and
            external logger calls.

    Thread-safe.  Reusable: after ``stop()`` new workers can be added and
    started.  A context manager: ``with GlobalCoordinator() as gc:`` stops it
    on exit.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, log_interval: float = 60.0) -> None:
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise TypeError(f"registry must be a CollectorRegistry, got {type(registry).__name__}")
        if not log_interval > 0:
            raise ValueError(f"log_interval must be > 0, got {log_interval!r}")
        self._registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._hub = MetricsHub(self._registry)
        self.log_interval = float(log_interval)
        self._lock = threading.RLock()
        self._start_lock = threading.RLock()  # serialises start(); init_funs run under it, not under _lock
        self._coordinators: list[WorkerCoordinator] = []
        self._sources: dict[str, InputSource] = {}
        self._next_worker_id = 0
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()

    @property
    def registry(self) -> CollectorRegistry:
        """Where this coordinator's metrics live."""
        return self._registry

    def get_worker_ids(self) -> list[int]:
        """Every worker id allocated so far (0, 1, 2, ...), stopped workers included, as in Caffe2."""
        with self._lock:
            return list(range(self._next_worker_id))

    # -- building ------------------------------------------------------------------
    def _allocate(self, n: int) -> list[int]:
        with self._lock:
            ids = list(range(self._next_worker_id, self._next_worker_id + n))
            self._next_worker_id += n
            return ids

    def _add(self, coordinator: WorkerCoordinator) -> None:
        with self._lock:
            self._coordinators.append(coordinator)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Run every pending ``init_fun`` serially, then start every thread.

        Coordinators added since the last ``start()`` start now; calling it
        again with nothing pending is harmless.

        Raises:
            Exception: whatever an ``init_fun`` raised; then no thread starts.
        """
        with self._start_lock:
            with self._lock:
                pending = [c for c in self._coordinators if not c.started]
            # init_funs run outside _lock: one may wait on a thread that
            # calls into this coordinator.
            for c in pending:
                c._run_init()
            with self._lock:
                for c in pending:
                    if c in self._coordinators:  # not stopped meanwhile
                        c._start()
                if pending:
                    _live_coordinators.add(self)
                    self._start_monitor()

    def stop(self, timeout: float = DEFAULT_JOIN_TIMEOUT) -> bool:
        """Stop every coordinator and join its threads.  Idempotent.

        Queues are closed and what they hold is discarded; a net waiting in
        ``run()`` and every later ``run()`` raise ``EndOfInput``.

        Args:
            timeout: seconds to wait for the threads, in all.

        Returns:
            True when every thread ended; False when some did not (a
            ``fetch_fun`` that never returns cannot be interrupted), which
            are named in the log.
        """
        with self._lock:
            victims = list(self._coordinators)
        ok = self._stop_coordinators(victims, timeout)
        with self._lock:
            monitor = self._monitor if not self._coordinators else None
            if monitor is not None:
                self._monitor_stop.set()
                self._monitor = None
        # joined outside the lock: a tick in progress may be waiting for it
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=max(timeout, 0.1))
            ok = ok and not monitor.is_alive()
        return ok

    def stop_coordinator(self, name: str, timeout: float = DEFAULT_JOIN_TIMEOUT) -> bool:
        """Stop the coordinators named ``name`` only (a source or worker name).

        Returns:
            As :meth:`stop`; True also when no coordinator has that name.
        """
        with self._lock:
            victims = [c for c in self._coordinators if c.name == name]
        return self._stop_coordinators(victims, timeout)

    def _stop_coordinators(self, victims: Sequence[WorkerCoordinator], timeout: float) -> bool:
        with self._lock:
            victims = [c for c in victims if c in self._coordinators]
            for c in victims:
                self._coordinators.remove(c)
                if isinstance(c, DataInputCoordinator) and self._sources.get(c.name) is c.source:
                    del self._sources[c.name]
        for c in victims:
            c._request_stop()
        for c in victims:
            c._shutdown()
        deadline = time.monotonic() + timeout
        stuck: list[str] = []
        for c in victims:
            stuck += c._join(deadline)
        for c in victims:
            c._call_loggers(final=True)
            c._retire()
        if stuck:
            logger.error(
                "stop: %d thread(s) still running after %.1f s: %s -- a fetch_fun or "
                "worker_fun that never returns cannot be interrupted; the threads are "
                "daemons and will not keep the process alive",
                len(stuck), timeout, ", ".join(stuck),
            )
        return not stuck

    def reset_data_input(self, name: str, net: Net, batch_size: int) -> None:
        """Change the batch size of source ``name`` into ``net``.

        Batches assembled after the call have ``batch_size`` samples (batches
        already queued keep theirs); fetchers get it as their hint.

        Raises:
            ValueError: bad ``batch_size``, or ``net`` is not fed from ``name``.
        """
        _check_positive_int("batch_size", batch_size)
        with self._lock:
            found = [
                c for c in self._coordinators
                if isinstance(c, DataInputCoordinator) and c.name == name and c.net is net
            ]
        if not found:
            raise ValueError(f"net {getattr(net, 'name', net)!r} is not fed from source {name!r}")
        for c in found:
            c.feed.batch_size = batch_size

    # -- the monitor thread -----------------------------------------------------------------
    def _start_monitor(self) -> None:
        if self._monitor is not None and self._monitor.is_alive():
            return
        self._monitor_stop = threading.Event()
        self._monitor = threading.Thread(
            target=self._monitor_loop, args=(self._monitor_stop,), name="blobfeed-monitor", daemon=True
        )
        self._monitor.start()

    def _monitor_loop(self, stop: threading.Event) -> None:
        last: dict[str, tuple[float, int]] = {}
        # Event.wait as a timer: a stop wakes it at once.
        while not stop.wait(self.log_interval):
            try:
                self._tick(last)
            except Exception:
                logger.exception("blobfeed monitor tick failed")

    def _tick(self, last: dict[str, tuple[float, int]]) -> None:
        now = time.monotonic()
        with self._lock:
            sources = [n for n, src in self._sources.items() if not (src.finished or src.stopped)]
            coordinators = list(self._coordinators)
        for name in sources:
            samples = self._hub.fetch_totals(name).samples
            t0, s0 = last.get(name, (now - self.log_interval, 0))
            rate = (samples - s0) / max(now - t0, 1e-9)
            last[name] = (now, samples)
            self._hub.set_inputs_per_second(name, rate)
        for c in coordinators:
            c._call_loggers()

    def __enter__(self) -> "GlobalCoordinator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<GlobalCoordinator {len(self._coordinators)} coordinator(s), sources {sorted(self._sources)}>"


@atexit.register
def _stop_all_at_exit() -> None:
    for gc in list(_live_coordinators):
        try:
            gc.stop(timeout=ATEXIT_JOIN_TIMEOUT)
        except Exception:
            logger.exception("stopping %r at exit failed", gc)


global_coordinator = GlobalCoordinator(registry=prometheus_client.REGISTRY)


# -- argument checks: at the public boundary, never assert ---------------------------------
def _check_positive_int(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")


def _check_common(
    num_worker_threads: Any, name: Any, init_fun: Any, external_loggers: Any, coordinator: Any
) -> tuple[GlobalCoordinator, list[ExternalLogger]]:
    _check_positive_int("num_worker_threads", num_worker_threads)
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
    gc, loggers = _check_common(num_worker_threads, worker_name, init_fun, external_loggers, coordinator)
    ids = gc._allocate(num_worker_threads)
    gc._add(_GenericCoordinator(worker_fun, gc, worker_name, ids, init_fun, shutdown_fun, loggers))
    return gc


def init_data_input_workers(
    net: Net,
    input_blob_names: Sequence[str],
    fetch_fun: FetchFun,
    batch_size: int,
    num_worker_threads: int = 2,
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
        fetch_fun: the user's fetcher.
        batch_size: samples per batch (the last batch of an ended source may be smaller).
        num_worker_threads: fetcher threads for this call.
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

    Returns:
        The global coordinator; call its ``start()``.

    Raises:
        TypeError / ValueError: bad arguments, at once, in the caller's thread.
    """
    if not isinstance(net, Net):
        raise TypeError(f"net must be a blobfeed.Net, got {type(net).__name__}")
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
    if not callable(fetch_fun):
        raise TypeError(f"fetch_fun must be callable, got {type(fetch_fun).__name__}")
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("max_buffered_batches", max_buffered_batches)
    _check_positive_int("device_queue_capacity", device_queue_capacity)
    if batch_columns is None:
        axes = [0] * len(names)
    else:
        axes = list(batch_columns)
        if len(axes) != len(names):
            raise ValueError(
                f"batch_columns has {len(axes)} entries but there are {len(names)} blobs {names}"
            )
        for a in axes:
            if isinstance(a, bool) or not isinstance(a, int) or a < 0:
                raise ValueError(f"batch_columns entries must be ints >= 0, got {batch_columns!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    gc, loggers = _check_common(
        num_worker_threads, input_source_name, init_fun, external_loggers, coordinator
    )
    with gc._lock:
        # Every check first, so a refused call leaves nothing behind.
        source = gc._sources.get(input_source_name)
        net._check_attach(input_source_name, names)
        if source is not None:
            if (source.n_blobs, source.axes) != (len(names), tuple(axes)):
                raise ValueError(
                    f"source {input_source_name!r} carries {source.n_blobs} blobs with batch axes "
                    f"{list(source.axes)}; this call asks for {len(names)} with {axes}"
                )
            if max_buffered_batches != source.queue.capacity:
                logger.warning(
                    "source %r already has an internal queue of %d chunks; "
                    "max_buffered_batches=%d ignored",
                    input_source_name, source.queue.capacity, max_buffered_batches,
                )
            if any(f.net_name == net.name for f in source.feeds):
                logger.warning(
                    "source %r already feeds a net named %r: their metrics share the label "
                    "net=%r; give each Net a distinct name to tell them apart",
                    input_source_name, net.name, net.name,
                )
            source.register_fetchers(num_worker_threads)  # atomic with the source's end
        else:
            source = InputSource(input_source_name, max_buffered_batches, len(names), axes, gc._hub)
            source.register_fetchers(num_worker_threads)
        feed = Feed(
            source, net, names, batch_size,
            timeout=float(timeout), device_queue_capacity=device_queue_capacity,
            dont_rebatch=bool(dont_rebatch), drop_last=bool(drop_last), hub=gc._hub,
        )
        net._attach(feed)
        source.feeds.append(feed)
        gc._sources[input_source_name] = source
        ids = gc._allocate(num_worker_threads)
        gc._add(DataInputCoordinator(gc, source, net, feed, fetch_fun, ids, init_fun, loggers, on_error))
    return gc
