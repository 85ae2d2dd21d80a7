"""Worker lifecycle, the global coordinator and shared input sources.

One ``init_*`` call makes one coordinator (a group of threads with a name);
the :class:`GlobalCoordinator` starts and stops them all.  Every thread is a
daemon: a program that never calls ``stop()`` still exits.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import numpy as np
import prometheus_client
from prometheus_client import CollectorRegistry

from .arguments import check_flag, check_index, check_timeout, wait_bound
from .errors import EndOfInput
from .feeders import (
    Feed,
    FetcherBackend,
    FetchFun,
    InputSource,
    READABLE_VERSIONS,
    LaunchPlan,
    ProcessBackend,
    Replayed,
    ShuffleBuffer,
    ThreadBackend,
    WorkerGroup,
    WorkerIntake,
    WorkerPlan,
    is_stateful,
    thread_main,
)
from .metrics import ExternalLogger, register_collector
from .net import Net
from .stats import FetchStats, MetricsHub
from .worker_info import WorkerInfo, draw_base_seed, shuffle_rng, worker_seeds

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
#: Seconds between updates of ``blobfeed_inputs_per_second``.
RATE_TICK_S = 1.0


class _LogRunner:
    """Calls a coordinator's external loggers on a thread of their own.

    A logger is user code: one that is slow or hangs must never hold up the
    monitor, ``stop(timeout)`` or the interpreter's exit, so nobody else ever
    waits on it beyond a deadline.  ``None`` on the queue ends the thread.
    """

    def __init__(self, name: str, loggers: Sequence[ExternalLogger], on_exit: Callable[[], None]) -> None:
        self._loggers = list(loggers)
        # SimpleQueue: put() never blocks and is safe from any thread.
        self._todo: "queue.SimpleQueue[dict[str, Any] | None]" = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=thread_main, args=(name, self._loop, on_exit), name=name, daemon=True
        )

    def post(self, metrics: dict[str, Any] | None) -> None:
        self._todo.put(metrics)

    def _loop(self) -> None:
        while True:
            metrics = self._todo.get()
            if metrics is None:
                return
            for ext in self._loggers:
                try:
                    ext.log(dict(metrics))
                except Exception:
                    logger.exception("external logger %r of %r raised; ignored", ext, self.thread.name)


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
        #: workers started by a backend (data input), besides our own threads
        self._group: WorkerGroup | None = None
        self._log_runner: _LogRunner | None = None
        self._stop_event = threading.Event()
        #: set without a lock by request_stop (see InputSource.halted)
        self._halted = False
        self.started = False
        self._started_at = 0.0
        self._shutdown_done = False
        self._log_lock = threading.Lock()
        self._final_logged = False

    @property
    def is_active(self) -> bool:
        """True between ``start()`` and stop."""
        return self.started and not (self._halted or self._stop_event.is_set())

    def _targets(self) -> list[tuple[str, Callable[[], None]]]:
        raise NotImplementedError

    def _run_init(self) -> None:
        if not self._init_done and self._init_fun is not None:
            self._init_fun(self, self._gc)
            self._init_done = True

    def _start(self) -> None:
        self._started_at = time.monotonic()
        on_exit = self._gc._thread_ended
        # Workers first: a backend that cannot start (no room for its shared
        # memory, say) raises here, before any thread of ours runs.
        self._group = self._launch_workers()
        threads = [
            threading.Thread(target=thread_main, args=(name, fn, on_exit), name=name, daemon=True)
            for name, fn in self._targets()
        ]
        if self._loggers:
            self._log_runner = _LogRunner(f"blobfeed-log-{self.name}", self._loggers, on_exit)
            threads.append(self._log_runner.thread)
        self._threads = list(threads)
        self.started = True
        # our own list: a worker that fails at once appends its shutdown
        # thread to self._threads while we are still starting these
        for t in threads:
            t.start()

    def _launch_workers(self) -> WorkerGroup | None:
        return None

    def _halt(self) -> None:
        """Tell the workers to stop working, by plain stores only: safe from
        a signal handler.  Waking what blocks is :meth:`_request_stop`'s job."""
        self._halted = True

    def _request_stop(self) -> None:
        """Ask every thread to end and wake whatever blocks.  Idempotent,
        never waits for a thread."""
        self._halted = True
        self._stop_event.set()

    def _shutdown(self) -> None:
        """Call ``shutdown_fun`` once, if this coordinator was started.

        On a thread of its own, joined like the others: it is user code, and
        a slow one must not hold up ``stop(timeout)`` or the exit.
        """
        with self._log_lock:
            if self._shutdown_done or not self.started or self._shutdown_fun is None:
                return
            self._shutdown_done = True
        name = f"blobfeed-shutdown-{self.name}"
        t = threading.Thread(
            target=thread_main, args=(name, self._call_shutdown_fun, self._gc._thread_ended),
            name=name, daemon=True,
        )
        self._threads.append(t)
        t.start()

    def _call_shutdown_fun(self) -> None:
        assert self._shutdown_fun is not None
        try:
            self._shutdown_fun()
        except Exception:
            logger.exception("shutdown_fun of coordinator %r raised", self.name)

    def _join(self, deadline: float | None) -> list[str]:
        """Join our threads and workers until ``deadline`` (None: no bound);
        returns the names still alive."""
        me = threading.current_thread()
        stuck = [] if self._group is None else self._group.join(deadline)
        for t in self._threads:
            if t is me:
                stuck.append(t.name)
                continue
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                stuck.append(t.name)
        return stuck

    def _alive(self) -> list[str]:
        """Names of our threads and workers still running."""
        alive = [t.name for t in self._threads if t.is_alive()]
        return alive if self._group is None else alive + self._group.alive()

    def _log_metrics(self) -> dict[str, Any]:
        return {"worker_name": self.name, "time_elapsed": time.monotonic() - self._started_at}

    def _call_loggers(self, final: bool = False) -> None:
        """Per interval (monitor thread), and once more at the end (``final``).

        Never waits for the loggers: they run on their own thread, which the
        final call ends once they are done.
        """
        with self._log_lock:
            runner = self._log_runner
            if runner is None or self._final_logged:
                return
            self._final_logged = final
            metrics = self._log_metrics()
        runner.post(metrics)
        if final:
            runner.post(None)

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
        while not (self._halted or stop.is_set()):
            try:
                fun(worker_id)
            except Exception as exc:
                logger.exception(
                    "worker %d of %r raised; stopping coordinator %r", worker_id, self.name, self.name
                )
                # Stop, but stay registered: the global stop() still joins
                # the siblings and reports whether they ended.  join() raises it.
                self._gc._on_failure(exc)
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
        seed: int,
        backend: FetcherBackend,
        worker_init_fun: Callable[[int], Any] | None,
    ) -> None:
        super().__init__(global_coordinator, source.name, worker_ids, init_fun, None, external_loggers)
        self.backend = backend
        self._worker_init_fun = worker_init_fun
        self.source = source
        self.feed = feed
        self.net = net
        self.input_blob_names = feed.blob_names
        self._fetch_fun = fetch_fun
        self._on_error = on_error
        self.seed = seed
        self._fetch_stats: list[FetchStats] = []
        self._last_log: tuple[float, float, int, float, int] | None = None

    @property
    def batch_size(self) -> int:
        """The batch size of this net's batches, and the fetchers' hint."""
        return self.feed.batch_size

    @property
    def is_active(self) -> bool:
        return self.started and not self.source.halted

    def _halt(self) -> None:
        super()._halt()
        self.source.halted = True

    def _targets(self) -> list[tuple[str, Callable[[], None]]]:
        return [(f"blobfeed-enqueue-{self.name}-{self.net.name}", self._enqueue)]

    def _launch_workers(self) -> WorkerGroup:
        hub = self._hub
        backend = self.backend
        workers = []
        n = len(self.worker_ids)
        for index, wid in enumerate(self.worker_ids):
            stats = hub.fetch_stats(self.name, backend.name)
            self._fetch_stats.append(stats)
            seed, rng = worker_seeds(self.seed, wid)
            intake = WorkerIntake(self.source, wid, self.feed.blob_names, self._on_error, stats, backend.name)
            workers.append(WorkerPlan(wid, WorkerInfo(wid, index, n, self.name, seed, rng), intake))
        fetch_fun = self._fetch_fun
        if self.source.ordered is not None:
            start = {wid: self.source.resume_at.get(wid, (0, None)) for wid in self.worker_ids}
            for w in workers:
                w.intake.calls = start[w.worker_id][0]  # the seq of its next chunk
            if any(calls for calls, _ in start.values()) or is_stateful(fetch_fun):
                fetch_fun = Replayed(fetch_fun, start)
        ordered = self.source.ordered
        return backend.launch(LaunchPlan(
            self.name, fetch_fun, self._worker_init_fun, workers,
            self._batch_size_hint, self._gc._thread_ended,
            epochs=self.source.epochs, first_epoch=ordered.epoch if ordered is not None else 0,
        ))

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
        self.feed.mark_started()
        if self.source.ordered is not None:
            self.source.ordered.start()
        super()._start()

    def _request_stop(self) -> None:
        super()._request_stop()
        self.source.stop()
        if self._group is not None:
            self._group.request_stop()

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
        """Fold the counts into the source's totals; every thread has ended."""
        hub = self._hub
        hub.retire(self.name, self._fetch_stats)
        hub.retire(self.name, [self.feed.stats], net=self.net.name)
        self.feed.release_net()
        # A consumer may still call run() on the stopped net; what it records
        # after this point (the wait of a run that raises) is not counted.
        hub.retire(self.name, [self.feed.direct_stats, self.feed.consume_stats], net=self.net.name)
        hub.detach_source(self.source)




_live_coordinators: "weakref.WeakSet[GlobalCoordinator]" = weakref.WeakSet()


class _Stopper:
    """A thread that carries out ``request_stop()``.

    ``request_stop`` may run in a signal handler that interrupted this very
    process while it held one of blobfeed's locks (inside ``run()``, say): it
    must not take a lock itself, so it only puts a token on a
    ``queue.SimpleQueue`` (whose ``put`` is safe there) and this thread, which
    holds nothing, does the closing.
    """

    def __init__(self, work: Callable[[str | None], None]) -> None:
        #: a source or worker name to stop, None for all, False to end
        self._todo: "queue.SimpleQueue[str | None | bool]" = queue.SimpleQueue()
        self._work = work
        self.thread = threading.Thread(target=self._loop, name="blobfeed-stopper", daemon=True)
        self.thread.start()

    def post(self, name: str | None = None) -> None:
        self._todo.put(name)

    def close(self) -> None:
        self._todo.put(False)

    def _loop(self) -> None:
        while True:
            name = self._todo.get()
            if name is False:
                return
            try:
                self._work(name)  # type: ignore[arg-type]
            except Exception:
                logger.exception("blobfeed: carrying out request_stop() failed")


class GlobalCoordinator:
    """Starts, stops and watches every coordinator; owns the metrics.

    Args:
        registry: the ``prometheus_client.CollectorRegistry`` to put metrics
            in; default a fresh one (the module-level
            ``blobfeed.global_coordinator`` uses prometheus-client's default
            registry).
        log_interval: seconds between external logger calls.

    Thread-safe.  Reusable: after ``stop()`` new workers can be added and
    started.  A context manager: ``with GlobalCoordinator() as gc:`` stops it
    on exit.  TF's ``Coordinator`` vocabulary works too: ``request_stop``,
    ``should_stop``, ``join``, ``stop_on_exception``.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, log_interval: float = 60.0) -> None:
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise TypeError(f"registry must be a CollectorRegistry, got {type(registry).__name__}")
        self.log_interval = check_timeout("log_interval", log_interval)
        self._registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._hub = MetricsHub()
        register_collector(self._registry, self._hub)
        self._make_locks()
        #: every coordinator not yet known to have ended: pending, running,
        #: or stopped with threads still alive.  A coordinator leaves this list
        #: only once all its threads have ended, so a stop that was cut short
        #: (a timeout, a Ctrl-C) is finished by the next one.
        self._coordinators: list[WorkerCoordinator] = []
        self._sources: dict[str, InputSource] = {}
        self._next_worker_id = 0
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()
        self._stopper: _Stopper | None = None
        # Plain attributes, written without a lock: request_stop() must be
        # safe in a signal handler, and a store of a reference is atomic.
        self._stop_requested = False
        self._stop_exc: BaseException | None = None
        self._first_error: BaseException | None = None
        #: a stop() ended every thread: the run is over until the next start()
        self._run_ended = False
        #: stop_coordinator() names asked for from inside blobfeed before start()
        self._pending_stops: list[str] = []

    def _make_locks(self) -> None:
        self._lock = threading.RLock()
        self._start_lock = threading.RLock()  # serialises start(); init_funs run under it, not under _lock
        #: notified when a thread ends, a stop was requested or a source failed (join waits on it)
        self._changed = threading.Condition(threading.Lock())

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
        again with nothing pending is harmless.  A ``request_stop()`` made
        before ``start()`` applies: what starts is stopped at once.

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
                # not stopped meanwhile (a stop() during a slow init_fun)
                pending = [c for c in pending if c in self._coordinators and not c._stop_event.is_set()]
                if not pending:
                    return
                if self._run_ended:
                    # the previous run was stopped for good: a new one begins
                    self._run_ended = False
                    self._stop_requested = False
                    self._stop_exc = self._first_error = None
                if self._stopper is None or not self._stopper.thread.is_alive():
                    self._stopper = _Stopper(self._stop_requested_work)
                for c in pending:
                    c._start()
                _live_coordinators.add(self)
                self._start_monitor()
                if self._stop_requested:
                    self._stopper.post()
                for name in self._pending_stops:
                    self._stopper.post(name)
                self._pending_stops.clear()

    def request_stop(self, exc: BaseException | None = None) -> None:
        """Ask every coordinator to stop, and return at once without joining.

        Safe from a signal handler, a fetcher, any thread, at any moment (also
        while ``run()`` is in progress in the calling thread): the closing is
        done by a helper thread.  Nets waiting in ``run()`` then raise
        ``EndOfInput``.  Use :meth:`join` or :meth:`stop` to wait for the
        threads.

        Args:
            exc: an exception for :meth:`join` to raise once everything ended
                (the first one given stands).
        """
        if exc is not None and self._stop_exc is None:
            self._stop_exc = exc
        self._stop_requested = True
        # Fetchers stop at once (plain stores); the stopper thread then wakes
        # whatever blocks, which needs locks.
        for c in list(self._coordinators):
            c._halt()
        stopper = self._stopper
        if stopper is not None:
            stopper.post()

    def should_stop(self) -> bool:
        """True once a stop was requested or done, or a source failed; a
        ``start()`` after a completed stop begins a new run (False again)."""
        return self._stop_requested or self._first_error is not None or self._run_ended

    def join(self, timeout: float | None = None) -> bool:
        """Wait until a stop is requested (or every thread ended by itself),
        then stop everything and wait for every thread.

        Args:
            timeout: seconds in all; ``None`` waits as long as it takes.

        Returns:
            True when every thread ended; False on timeout (the threads
            still running are named in the log).

        Raises:
            BaseException: once everything ended, the ``exc`` given to
                :meth:`request_stop`, else the first fetcher error of any
                source (``FetcherError``).
        """
        t = None if timeout is None else wait_bound(check_timeout("timeout", timeout, allow_zero=True))
        inside = _inside_blobfeed()
        if inside is not None:
            # waiting here could wait for this very thread
            return self._stop(t, "join")
        deadline = None if t is None else time.monotonic() + t
        with self._changed:
            woke = self._changed.wait_for(lambda: self.should_stop() or not self._alive_threads(), t)
        if not woke:
            logger.error(
                "join: no stop was requested within %.1f s; still running: %s",
                t, ", ".join(self._alive_threads()),
            )
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._stop(left, "join"):
            return False
        exc = self._stop_exc if self._stop_exc is not None else self._first_error
        if exc is not None:
            raise exc
        return True

    @contextlib.contextmanager
    def stop_on_exception(self) -> Iterator[None]:
        """A context manager: an exception raised inside it requests a stop
        with that exception (which :meth:`join` then raises) and propagates;
        it is never swallowed."""
        try:
            yield
        except EndOfInput:
            # the input ended: a clean stop, as TF's OutOfRangeError is
            self.request_stop()
            raise
        except BaseException as exc:
            self.request_stop(exc)
            raise

    def _stop_requested_work(self, name: str | None) -> None:
        """On the stopper thread: close everything (of ``name``) so its threads end."""
        with self._lock:
            coordinators = [c for c in self._coordinators if name is None or c.name == name]
        for c in coordinators:
            c._request_stop()
        self._thread_ended()  # wake join()

    def _on_failure(self, error: BaseException) -> None:
        """A source failed or a generic worker raised: join() raises the first."""
        if self._first_error is None:
            self._first_error = error
        self._thread_ended()

    def _thread_ended(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _alive_threads(self) -> list[str]:
        return [name for c in list(self._coordinators) for name in c._alive()]

    def stop(self, timeout: float = DEFAULT_JOIN_TIMEOUT) -> bool:
        """Stop every coordinator and join its threads.  Idempotent.

        Queues are closed and what they hold is discarded; a net waiting in
        ``run()`` and every later ``run()`` raise ``EndOfInput``.  A stop cut
        short (timeout, Ctrl-C) leaves the coordinators listed: the next
        ``stop()`` finishes it.

        Called from inside blobfeed's own code (a ``fetch_fun``, an
        ``init_fun``, an external logger, or a signal handler that
        interrupted ``run()``), it cannot wait without risking a deadlock on
        the lock the interrupted code holds: it then does what
        :meth:`request_stop` does and returns False at once.

        Args:
            timeout: seconds to wait for the threads, in all (>= 0).

        Returns:
            True only when every thread ended; False when some did not (a
            ``fetch_fun`` that never returns cannot be interrupted), which
            are named in the log.
        """
        return self._stop(wait_bound(check_timeout("timeout", timeout, allow_zero=True)), "stop")

    def _stop(self, timeout: float | None, what: str) -> bool:
        inside = _inside_blobfeed()
        if inside is not None:
            self.request_stop()
            logger.error(
                "%s() called from inside blobfeed (%s: a fetch_fun, init_fun or logger, or a "
                "signal handler that interrupted blobfeed): it cannot wait here; the stop was "
                "requested and proceeds in the background. Call join() or stop() from the "
                "main program to wait for it, or request_stop() in a signal handler.",
                what, inside,
            )
            return False
        self._stop_requested = True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            victims = list(self._coordinators)
        ok = self._stop_coordinators(victims, timeout)
        with self._lock:
            if any(c not in victims for c in self._coordinators):
                return ok  # added meanwhile: theirs is a new run
            # What is still listed has threads stuck in user code: they end by
            # themselves (or never); the helpers have nothing left to do.
            self._run_ended = True
            monitor, stopper = self._monitor, self._stopper
            self._monitor_stop.set()
        if stopper is not None:
            stopper.close()
        # Joined outside the lock (a tick in progress may be waiting for it),
        # and forgotten only once ended: a Ctrl-C in between leaves them for
        # the next stop() to finish.
        for t in (monitor, stopper.thread if stopper is not None else None):
            if t is not None and t is not threading.current_thread():
                # they end at once when told: a moment past the deadline is theirs
                t.join(None if deadline is None else max(0.05, deadline - time.monotonic()))
                ok = ok and not t.is_alive()
        with self._lock:
            if self._monitor is monitor and (monitor is None or not monitor.is_alive()):
                self._monitor = None
            if self._stopper is stopper and (stopper is None or not stopper.thread.is_alive()):
                self._stopper = None
        return ok

    def stop_coordinator(self, name: str, timeout: float = DEFAULT_JOIN_TIMEOUT) -> bool:
        """Stop the coordinators named ``name`` only (a source or worker name).

        Returns:
            As :meth:`stop`; True also when no coordinator has that name.
        """
        t = wait_bound(check_timeout("timeout", timeout, allow_zero=True))
        inside = _inside_blobfeed()
        if inside is not None:
            for c in list(self._coordinators):
                if c.name == name:
                    c._halt()
            stopper = self._stopper
            if stopper is not None:
                stopper.post(name)
            else:  # before the first start(): start() carries it out
                self._pending_stops.append(name)
            logger.error(
                "stop_coordinator(%r) called from inside blobfeed (%s): requested, not waited for",
                name, inside,
            )
            return False
        with self._lock:
            victims = [c for c in self._coordinators if c.name == name]
        return self._stop_coordinators(victims, t)

    def _stop_coordinators(self, victims: Sequence[WorkerCoordinator], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for c in victims:
            c._request_stop()
        for c in victims:
            c._shutdown()
        for c in victims:
            c._call_loggers(final=True)
        stuck: list[str] = []
        stuck_coordinators = []
        for c in victims:
            names = c._join(deadline)
            stuck += names
            if names:
                stuck_coordinators.append(c)
        with self._lock:
            for c in victims:
                if c in self._coordinators and not c._alive():
                    self._coordinators.remove(c)
                    if isinstance(c, DataInputCoordinator) and self._sources.get(c.name) is c.source:
                        if not any(getattr(o, "source", None) is c.source for o in self._coordinators):
                            del self._sources[c.name]
                    c._retire()
            # one that start() started while we joined is still listed: not ended
            still = [c.name for c in victims if c in self._coordinators and c not in stuck_coordinators]
        if stuck:
            logger.error(
                "stop: %d thread(s) still running after %.1f s: %s -- a fetch_fun, worker_fun "
                "or external logger that never returns cannot be interrupted; the threads are "
                "daemons and will not keep the process alive; stop() again to wait for them",
                len(stuck), timeout if timeout is not None else float("inf"), ", ".join(stuck),
            )
        elif still:
            logger.error("stop: coordinators %s started while stopping; stop() again", still)
        return not stuck and not still

    # -- resume ----------------------------------------------------------------------
    def _ordered_source(self, name: str) -> InputSource:
        with self._lock:
            source = self._sources.get(name)
        if source is None:
            raise ValueError(f"no input source named {name!r}")
        if source.ordered is None or not source.ordered.strict:
            raise ValueError(
                f"source {name!r} is not deterministic: state_dict/load_state_dict need "
                "init_data_input_workers(..., deterministic=True)"
            )
        return source

    def _layout(self, source: InputSource) -> dict[str, Any]:
        ordered = source.ordered
        assert ordered is not None
        with self._lock:
            seeds = [c.seed for c in self._coordinators if isinstance(c, DataInputCoordinator) and c.source is source]
        return {
            "num_workers": len(ordered.worker_ids),
            "batch_size": ordered.batch_size,
            "blobs": [list(f.blob_names) for f in source.feeds],
            "axes": list(source.axes),
            # per init_data_input_workers call, in wiring order
            "seed": seeds,
        }

    def state_dict(self, name: str) -> dict[str, Any]:
        """The position of deterministic source ``name`` after the last batch
        that each of its nets' ``run()`` returned (not what is prefetched).

        JSON-serialisable (a stateful ``fetch_fun``'s own state must be too).
        Give it to :meth:`load_state_dict` of a pipeline wired the same way
        to continue exactly there.

        Raises:
            ValueError: no such source, or it is not deterministic.
        """
        source = self._ordered_source(name)
        assert source.ordered is not None
        return source.ordered.state(self._layout(source), [f.net_name for f in source.feeds])

    def load_state_dict(self, name: str, state: dict[str, Any]) -> None:
        """Continue deterministic source ``name`` from ``state`` (from
        :meth:`state_dict`); call it after wiring, before :meth:`start`.

        The batches that follow are those an uninterrupted run would have
        given each net.  A stateful ``fetch_fun`` (with ``state_dict`` and
        ``load_state_dict`` methods) is restored from its saved state; any
        other is replayed: each worker makes its recorded calls again and
        their results are discarded.

        Raises:
            ValueError: no such source, not deterministic, already started,
                or ``state`` is of another version, worker count, batch size,
                blob layout or number of nets (the message says which).
        """
        source = self._ordered_source(name)
        ordered = source.ordered
        assert ordered is not None
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        if state.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"source {name!r}: state has version {state.get('version')!r}; this blobfeed reads "
                f"versions {', '.join(map(str, READABLE_VERSIONS))}"
            )
        nets = state.get("nets")
        if not isinstance(nets, list) or len(nets) != len(source.feeds):
            raise ValueError(
                f"source {name!r}: the state was saved for {len(nets) if isinstance(nets, list) else '?'} "
                f"nets {nets!r}; this pipeline feeds {len(source.feeds)}: "
                f"{[f.net_name for f in source.feeds]}"
            )
        layout = self._layout(source)
        for key, what in (("num_workers", "worker count"), ("batch_size", "batch size"),
                          ("blobs", "blob layout"), ("axes", "blob layout (batch axes)"), ("seed", "seed")):
            if key not in state and key == "seed":
                continue  # version 1 did not record it
            if state.get(key) != layout[key]:
                hint = " (pass seed= with the saved value)" if key == "seed" else ""
                raise ValueError(
                    f"source {name!r}: the state was saved with {what} {state.get(key)!r}; "
                    f"this pipeline has {layout[key]!r}{hint}"
                )
        epoch = state.get("position", {}).get("epoch", 0)
        if source.epochs is not None and epoch >= source.epochs:
            raise ValueError(
                f"source {name!r}: the state was saved in epoch {epoch}; this pipeline runs "
                f"epochs={source.epochs} (epochs 0 to {source.epochs - 1})"
            )
        with self._lock:
            if any(c.started for c in self._coordinators if c.name == name):
                raise ValueError(f"source {name!r} already started: load_state_dict() goes before start()")
        starts = ordered.load(state)
        source.resume_at = dict(zip(ordered.worker_ids, starts))

    def reset_data_input(self, name: str, net: Net, batch_size: int) -> None:
        """Change the batch size of source ``name`` into ``net``.

        Batches assembled after the call have ``batch_size`` samples (batches
        already queued keep theirs); fetchers get it as their hint.

        Raises:
            ValueError: bad ``batch_size``, or ``net`` is not fed from ``name``.
        """
        batch_size = check_index("batch_size", batch_size)
        with self._lock:
            found = [
                c for c in self._coordinators
                if isinstance(c, DataInputCoordinator) and c.name == name and c.net is net
                and not c.source.stopped
            ]
        if not found:
            raise ValueError(f"net {getattr(net, 'name', net)!r} is not fed from source {name!r}")
        if found[0].source.ordered is not None:
            raise ValueError(
                f"source {name!r} is re-batched once for all its nets (deterministic, shuffle_buffer "
                "or epochs): its batch size is fixed"
            )
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
        tick = min(RATE_TICK_S, self.log_interval)
        next_log = time.monotonic() + self.log_interval
        # Event.wait as a timer: a stop wakes it at once.
        while not stop.wait(tick):
            try:
                now = time.monotonic()
                self._hub.update_rates(now)
                if now >= next_log:
                    next_log = now + self.log_interval
                    with self._lock:
                        coordinators = list(self._coordinators)
                    for c in coordinators:
                        c._call_loggers()
            except Exception:
                logger.exception("blobfeed monitor tick failed")

    def _reset_after_fork(self) -> None:
        """In a child made by ``os.fork()``: the parent's threads do not exist
        here and any lock one of them held stays locked forever.  Forget the
        parent's pipelines (their nets refuse to run) and start clean."""
        for c in self._coordinators:
            if isinstance(c, DataInputCoordinator):
                c.feed.mark_forked()
                # plain stores (its lock may be held): the net can be re-wired
                c.source.stopped = c.source.halted = True
        self._make_locks()
        self._coordinators = []
        self._sources = {}
        self._monitor = None
        self._stopper = None
        self._hub.reset_after_fork()

    def __enter__(self) -> "GlobalCoordinator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<GlobalCoordinator {len(self._coordinators)} coordinator(s), sources {sorted(self._sources)}>"


def _stop_all_at_exit() -> None:
    for gc in list(_live_coordinators):
        try:
            gc.stop(timeout=ATEXIT_JOIN_TIMEOUT)
        except Exception:
            logger.exception("stopping %r at exit failed", gc)


atexit.register(_stop_all_at_exit)


def _forget_parent_pipelines() -> None:
    global _live_coordinators
    for gc in list(_live_coordinators):
        gc._reset_after_fork()
    _live_coordinators = weakref.WeakSet()


os.register_at_fork(after_in_child=_forget_parent_pipelines)

#: The ways into a stop: the frames on top of the stack when one was called
#: from user code (they hold no lock of the pipeline at that point).
_STOP_ENTRIES = frozenset({
    GlobalCoordinator.stop.__code__,
    GlobalCoordinator._stop.__code__,
    GlobalCoordinator.stop_coordinator.__code__,
    GlobalCoordinator.join.__code__,
    GlobalCoordinator.__exit__.__code__,
    _stop_all_at_exit.__code__,
})
#: The applications call stop() like any user: they hold no pipeline lock.
_APPLICATIONS = frozenset({"blobfeed.bench", "blobfeed.cli", "blobfeed.demo", "blobfeed.models"})


def _is_core(module: str) -> bool:
    """Is ``module`` (a ``__name__``) the library's own code, where a thread
    may hold a pipeline lock?  By module name, not file name: file names
    differ from ``co_filename`` in pyc-only and frozen installs."""
    return (module == "blobfeed" or module.startswith("blobfeed.")) and module not in _APPLICATIONS


def _inside_blobfeed() -> str | None:
    """Where, if anywhere, the calling thread is inside blobfeed's own code.

    A signal handler runs on top of the frame it interrupted, so a handler
    that called ``stop()`` while ``run()`` held a feed's lock shows that
    frame below it; so does a ``fetch_fun``, an ``init_fun`` or a logger.
    """
    f: Any = sys._getframe(1)
    while f is not None and f.f_code in _STOP_ENTRIES:
        f = f.f_back
    while f is not None:
        module = f.f_globals.get("__name__", "")
        if _is_core(module):
            return f"{f.f_code.co_name}() in {module}"
        f = f.f_back
    return None


global_coordinator = GlobalCoordinator(registry=prometheus_client.REGISTRY)


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
    seed: int | None = None,
    backend: Literal["threads", "processes"] | FetcherBackend = "threads",
    worker_init_fun: Callable[[int], Any] | None = None,
    deterministic: bool = False,
    shuffle_buffer: int = 0,
    epochs: int | None = 1,
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

    Returns:
        The global coordinator; call its ``start()``.

    Raises:
        TypeError / ValueError: bad arguments, at once, in the caller's thread;
            also a blob named like one of the model's outputs (the output would
            replace it in the workspace), and a net already fed from this source.
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
    batch_size = check_index("batch_size", batch_size)
    num_worker_threads = check_index("num_worker_threads", num_worker_threads)
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
    deterministic = check_flag("deterministic", deterministic)
    shuffle_buffer = check_index("shuffle_buffer", shuffle_buffer, minimum=0)
    if epochs is not None:
        epochs = check_index("epochs", epochs)
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
    runner = resolve_backend(backend)
    runner.check(fetch_fun, worker_init_fun)
    clash = sorted(set(names).intersection(net.output_names))
    if clash:
        raise ValueError(
            f"net {net.name!r}: blobs {clash} have the names of model outputs "
            f"(outputs {list(net.output_names)}): run() would replace the fed values with the "
            "predictions in the workspace; feed them under other names"
        )
    gc, loggers = _check_common(input_source_name, init_fun, external_loggers, coordinator)
    base_seed = draw_base_seed(input_source_name) if seed is None else seed
    with gc._lock:
        # Every check first, so a refused call leaves nothing behind.
        source = gc._sources.get(input_source_name)
        if source is not None and source.stopped:
            # stopped, its threads not all ended yet (a stuck fetcher): the
            # name starts afresh; the old source ends on its own
            source = None
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
            ordered = source.ordered
            was = (ordered is not None and ordered.strict,
                   ordered.shuffle.size if ordered is not None and ordered.shuffle is not None else 0)
            if was != (deterministic, shuffle_buffer) or source.epochs != epochs:
                raise ValueError(
                    f"source {input_source_name!r} was wired with deterministic={was[0]}, "
                    f"shuffle_buffer={was[1]}, epochs={source.epochs}; this call asks for "
                    f"deterministic={deterministic}, shuffle_buffer={shuffle_buffer}, epochs={epochs}: "
                    "every call for one source must agree"
                )
            if ordered is not None and ordered.batch_size != batch_size:
                raise ValueError(
                    f"source {input_source_name!r} is re-batched once for all its nets (deterministic, "
                    f"shuffle_buffer or epochs) with batch_size={ordered.batch_size}; "
                    f"this call asks for {batch_size}: such a source has one batch size"
                )
            if ordered is not None and any(c.started for c in gc._coordinators if c.name == input_source_name):
                raise ValueError(
                    f"source {input_source_name!r} is deterministic and already started: "
                    "wire every net before start()"
                )
            source.register_fetchers(num_worker_threads)  # atomic with the source's end
        else:
            source = InputSource(
                input_source_name, max_buffered_batches, len(names), axes, gc._hub, gc._on_failure
            )
            source.register_fetchers(num_worker_threads)
            source.epochs = epochs
            if deterministic or shuffle_buffer or epochs != 1:
                # epochs: the stream must know where each worker's epoch ends
                shuffle = ShuffleBuffer(shuffle_buffer, axes, shuffle_rng(base_seed)) if shuffle_buffer else None
                source.make_ordered(batch_size, strict=deterministic, shuffle=shuffle)
        feed = Feed(
            source, net.name, net._place, names, batch_size,
            timeout=timeout, device_queue_capacity=device_queue_capacity,
            dont_rebatch=dont_rebatch, drop_last=drop_last, hub=gc._hub,
            model_inputs=net.input_specs,
            outbox=source.ordered.add_net() if source.ordered is not None else None,
        )
        net._attach(feed)
        source.add_feed(feed)
        gc._sources[input_source_name] = source
        ids = gc._allocate(num_worker_threads)
        if source.ordered is not None:
            source.ordered.add_lanes(ids)
        gc._add(DataInputCoordinator(
            gc, source, net, feed, fetch_fun, ids, init_fun, loggers, on_error, base_seed,
            runner, worker_init_fun,
        ))
    return gc
