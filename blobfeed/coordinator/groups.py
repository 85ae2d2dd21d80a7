"""One group of workers each: the threads of one ``init_*`` call.

:class:`WorkerCoordinator` is what every group has (start, stop request,
``shutdown_fun``, external loggers, join); :class:`_GenericCoordinator` runs
``init_workers``' ``worker_fun`` and :class:`DataInputCoordinator` one
``init_data_input_workers`` call's fetchers and enqueuer.  The lifecycle
asks a group through these methods only, never by its class.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from typing import Any, Callable, Literal, Protocol, Sequence

from ..feeders import (
    Feed,
    FetcherBackend,
    FetchFun,
    InputSource,
    LaunchPlan,
    Replayed,
    WorkerGroup,
    WorkerIntake,
    WorkerPlan,
    is_stateful,
    thread_main,
)
from ..feeders.indexed import UnitReader
from ..feeders.dealing import IndexedDealer
from ..metrics import ExternalLogger
from ..net import Net
from ..stats import FetchStats, MetricsHub
from ..worker_info import WorkerInfo, worker_seeds

logger = logging.getLogger("blobfeed.coordinator")

InitFun = Callable[["WorkerCoordinator", Any], Any]


def _on_host(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """A reader read as it is: its batches stay on the host."""
    return arrays


class ActiveFlag:
    """What ``is_active`` reads: a truth value (``if dc.is_active:``, as
    blobfeed documented it) that can also be called (``dc.is_active()``, as
    Caffe2's ``WorkerCoordinator.is_active`` is a method and Caffe2 code
    calls it).  Compares equal to the bool it stands for; a snapshot taken
    when the attribute was read."""

    __slots__ = ("_value",)

    def __init__(self, value: bool) -> None:
        self._value = bool(value)

    def __call__(self) -> bool:
        return self._value

    def __bool__(self) -> bool:
        return self._value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ActiveFlag):
            return self._value == other._value
        if isinstance(other, (bool, int)):
            return self._value == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return repr(self._value)


class Owner(Protocol):
    """What a group needs of the :class:`GlobalCoordinator` that owns it
    (named here so this module does not import the lifecycle above it)."""

    _hub: MetricsHub

    def _thread_ended(self) -> None: ...

    def _on_failure(self, error: BaseException) -> None: ...


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

    #: the input source this group feeds from; None for generic workers
    source: InputSource | None = None
    #: the net this group feeds; None for generic workers
    net: Net | None = None
    #: the base seed of this group's workers; None for generic workers
    seed: int | None = None

    def __init__(
        self,
        global_coordinator: Owner,
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
        #: init_fun is running: the group counts as active there, as in Caffe2
        self._in_init = False
        self._shutdown_fun = shutdown_fun
        self._loggers = list(external_loggers)
        self._hub = global_coordinator._hub
        self._threads: list[threading.Thread] = []
        #: workers started by a backend (data input), besides our own threads
        self._group: WorkerGroup | None = None
        #: workers added while it runs (set_num_workers), each call's group
        self._more_groups: list[WorkerGroup] = []
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
    def is_active(self) -> ActiveFlag:
        """True from ``start()`` (inside ``init_fun`` too) until the stop.

        A truth value that can also be called, ``is_active()``, as Caffe2's
        method is (see :class:`ActiveFlag`).
        """
        return ActiveFlag((self.started or self._in_init) and not (self._halted or self._stop_event.is_set()))

    def _targets(self) -> list[tuple[str, Callable[[], None]]]:
        raise NotImplementedError

    def _run_init(self) -> None:
        if not self._init_done and self._init_fun is not None:
            self._in_init = True
            try:
                self._init_fun(self, self._gc)
            finally:
                self._in_init = False
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
        for g in list(self._more_groups):
            stuck += g.join(deadline)
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
        for g in list(self._more_groups):
            alive += g.alive()
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
        """Every thread has ended: fold what is left into the totals."""

    def mark_forked(self) -> None:
        """In a child made by ``os.fork()``: this group's threads do not exist
        here.  Plain stores only: a lock may be held by a thread that is gone."""


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
        global_coordinator: Owner,
        source: InputSource,
        net: Net | None,
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
        self.source: InputSource = source
        self.feed = feed
        #: None for a source wired without a net (``init_reader``)
        self.net: Net | None = net
        self.input_blob_names = feed.blob_names
        self._fetch_fun = fetch_fun
        self._on_error = on_error
        self.seed: int = seed
        self._fetch_stats: list[FetchStats] = []
        self._last_log: tuple[float, float, int, float, int] | None = None
        #: every worker's intake by worker id (set_num_workers retires them)
        self._intakes: dict[int, WorkerIntake] = {}
        #: the fetch_fun the workers were launched with (a Replayed one
        #: wraps the user's): workers added later run the same
        self._launched: FetchFun = fetch_fun
        #: a fetch_fun source in arrival order: its worker count can change
        #: while it runs (set_num_workers, num_worker_threads="auto")
        self.elastic = source.dealing.in_arrival_order and not isinstance(fetch_fun, UnitReader)

    @property
    def batch_size(self) -> int:
        """The batch size of this net's batches, and the fetchers' hint."""
        return self.feed.batch_size

    @property
    def is_active(self) -> ActiveFlag:
        """True from ``start()`` (inside ``init_fun`` too) until its source
        stops; callable too, ``is_active()``, as in Caffe2."""
        return ActiveFlag((self.started or self._in_init) and not self.source.halted)

    def _halt(self) -> None:
        super()._halt()
        self.source.halted = True
        # a run() inside the model ends now rather than when the model does
        self.feed.cancel()

    def _targets(self) -> list[tuple[str, Callable[[], None]]]:
        if not self.feed.prefetch:
            # its reader's thread does the enqueuer's work (Feed.pump)
            self.feed.on_end = self._ended_by_itself
            return []
        return [(f"blobfeed-enqueue-{self.name}-{self.feed.net_name}", self._enqueue)]

    def add_workers(self, worker_ids: list[int], num_workers: int | None = None) -> LaunchPlan:
        """The plan of more workers of a running random-access source, or of
        a fetch_fun source in arrival order (their ids allocated, registered
        with the source and their lanes wired already; under the
        coordinator's lock); ``num_workers``: the source's worker count from
        now on (their WorkerInfo's).  :meth:`launch_more` starts them."""
        first = len(self.worker_ids)
        self.worker_ids.extend(worker_ids)
        workers = self._plans(worker_ids, first, num_workers)
        fetch_fun = self._launched
        if isinstance(fetch_fun, UnitReader):
            dealer = self.source.dealer
            return LaunchPlan(
                self.name, fetch_fun, self._worker_init_fun, workers,
                self._batch_size_hint, self._gc._thread_ended, units=fetch_fun.units,
                pulled_by=dealer.use_puller if isinstance(dealer, IndexedDealer) else None,
            )
        return LaunchPlan(
            self.name, fetch_fun, self._worker_init_fun, workers,
            self._batch_size_hint, self._gc._thread_ended,
            epochs=self.source.epochs, first_epoch=self.source.dealer.epoch, elastic=self.elastic,
        )

    def launch_more(self, plan: LaunchPlan, timeout: float | None) -> bool:
        """Start the workers of ``plan`` (outside the coordinator's lock: it
        pickles the fetcher or dataset and starts processes).  False when
        this coordinator was stopped meanwhile: they are stopped again
        (within ``timeout``), since the stop may not have seen them.

        Raises:
            Exception: what the backend raised; the workers never ran and
                the source does not wait for their end.
        """
        try:
            group = self.backend.launch(plan)
        except BaseException:
            for w in plan.workers:
                self.source.fetcher_started()
                w.intake.retired = True
                w.intake.finished(False)
            raise
        self._more_groups.append(group)  # before the check: a stop after it sees the group
        if not self._halted:
            return True
        group.request_stop()
        stuck = group.join(None if timeout is None else time.monotonic() + timeout)
        if stuck:
            logger.warning("source %r: workers started while it stopped did not end: %s", self.name, stuck)
        return False

    def retire_workers(self, worker_ids: list[int]) -> None:
        """Make the workers ``worker_ids`` of this group (a running fetch_fun
        source in arrival order) finish their current call, hand over what
        it gave and end, without counting as exhausted.  Never waits."""
        mine = [wid for wid in worker_ids if wid in self._intakes]
        for wid in mine:
            self._intakes[wid].retired = True
        for g in [self._group, *self._more_groups]:
            if g is not None and mine:
                g.retire(mine)

    def active_workers(self) -> list[int]:
        """This group's worker ids not removed by set_num_workers."""
        return [wid for wid in self.worker_ids if wid in self._intakes and not self._intakes[wid].retired]

    def _plans(self, worker_ids: list[int], first: int = 0, num_workers: int | None = None) -> list[WorkerPlan]:
        hub = self._hub
        backend = self.backend
        workers = []
        n = len(self.worker_ids) if num_workers is None else num_workers
        for index, wid in enumerate(worker_ids, first):
            stats = hub.fetch_stats(self.name, backend.name)
            self._fetch_stats.append(stats)
            seed, rng = worker_seeds(self.seed, wid)
            intake = WorkerIntake(self.source, wid, self.feed.blob_names, self._on_error, stats, backend.name)
            self._intakes[wid] = intake
            workers.append(WorkerPlan(wid, WorkerInfo(wid, index, n, self.name, seed, rng), intake))
        return workers

    def _launch_workers(self) -> WorkerGroup:
        backend = self.backend
        workers = self._plans(self.worker_ids)
        fetch_fun = self._fetch_fun
        if isinstance(fetch_fun, UnitReader):
            # a random-access source: the workers take read units, whatever
            # the epoch (the dealer knows where epochs end)
            dealer = self.source.dealer
            return backend.launch(LaunchPlan(
                self.name, fetch_fun, self._worker_init_fun, workers,
                self._batch_size_hint, self._gc._thread_ended, units=fetch_fun.units,
                pulled_by=dealer.use_puller if isinstance(dealer, IndexedDealer) else None,
            ))
        start = {wid: self.source.resume_at.get(wid, (0, None)) for wid in self.worker_ids}
        for w in workers:
            w.intake.calls = start[w.worker_id][0]  # the seq of its next chunk
        # A stateful fetcher is copied per worker (its state is then that
        # worker's position, as in a worker process) and its state travels
        # with each chunk, whatever the dealer does with it.
        if any(calls for calls, _ in start.values()) or is_stateful(fetch_fun):
            fetch_fun = Replayed(fetch_fun, start)
        self._launched = fetch_fun
        return backend.launch(LaunchPlan(
            self.name, fetch_fun, self._worker_init_fun, workers,
            self._batch_size_hint, self._gc._thread_ended,
            epochs=self.source.epochs, first_epoch=self.source.dealer.epoch, elastic=self.elastic,
        ))

    def _enqueue(self) -> None:
        try:
            self.feed.run()
        finally:
            self._ended_by_itself()

    def _ended_by_itself(self) -> None:
        if self.source.finished or self.source.error is not None:
            # the source ended by itself: the loggers' last call is now
            self._call_loggers(final=True)

    def _batch_size_hint(self) -> int:
        return self.feed.batch_size

    def set_batch_size(self, batch_size: int) -> None:
        """Batches assembled from now on have ``batch_size`` samples."""
        self.feed.batch_size = batch_size

    def _start(self) -> None:
        self._last_log = (time.monotonic(), 0.0, 0, 0.0, 0)
        self.feed.mark_started()
        self.source.dealer.start()
        super()._start()

    def _request_stop(self) -> None:
        super()._request_stop()
        self.feed.cancel()
        self.source.stop()
        if self._group is not None:
            self._group.request_stop()
        for g in list(self._more_groups):
            g.request_stop()

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
            "queue_size": self.source.queue_depth(),
            "time_elapsed": now - self._started_at,
            "fetcher_time": fetch_time - prev[1],
            "fetcher_time_count": fetch_count - prev[2],
            "enqueue_time": enq.total - prev[3],
            "enqueue_time_count": enq.count - prev[4],
        }

    def _retire(self) -> None:
        """Fold the counts into the source's totals; every thread has ended."""
        self._hub.retire(self.name, self._fetch_stats)
        _retire_feed(self._hub, self.name, self.feed, self.source)

    def mark_forked(self) -> None:
        _forked(self.feed, self.source)


def _retire_feed(hub: MetricsHub, name: str, feed: Feed, source: InputSource) -> None:
    """Fold a feed's counts into its source's totals and let the source go."""
    feed.let_go()  # (counted before the fold)
    hub.retire(name, [feed.stats], net=feed.net_name)
    feed.release_net()
    # A consumer may still call run() on the stopped net; what it records
    # after this point (the wait of a run that raises) is not counted.
    hub.retire(name, [feed.direct_stats, feed.consume_stats], net=feed.net_name)
    hub.detach_source(source)


def _forked(feed: Feed, source: InputSource) -> None:
    feed.mark_forked()
    # plain stores (its lock may be held): the net can be re-wired
    source.stopped = source.halted = True


class ReaderCoordinator(WorkerCoordinator):
    """The enqueuer of one reader added to a source by
    ``GlobalCoordinator.add_reader``: started with the coordinator, stopped
    and joined with its source (it carries the source's name, so
    ``stop_coordinator(name)`` stops it too)."""

    def __init__(self, global_coordinator: Owner, source: InputSource, feed: Feed) -> None:
        super().__init__(global_coordinator, source.name, [], None, None, ())
        self.source: InputSource = source
        self.feed = feed

    def _targets(self) -> list[tuple[str, Callable[[], None]]]:
        if not self.feed.prefetch:
            return []  # its reader's thread does the enqueuer's work (Feed.pump)
        return [(f"blobfeed-enqueue-{self.name}-{self.feed.net_name}", self.feed.run)]

    def _start(self) -> None:
        self.feed.mark_started()
        super()._start()

    def _halt(self) -> None:
        super()._halt()
        self.source.halted = True
        # a run() inside its net's model ends now rather than when the model does
        self.feed.cancel()

    def _request_stop(self) -> None:
        super()._request_stop()
        self.feed.cancel()
        self.source.stop()

    def _retire(self) -> None:
        _retire_feed(self._hub, self.name, self.feed, self.source)

    def mark_forked(self) -> None:
        _forked(self.feed, self.source)


class InletCoordinator(ReaderCoordinator):
    """The one reader of an inlet (``GlobalCoordinator.open_inlet``): no
    thread, its caller puts whole batches where the reader takes them;
    started, stopped and retired with the rest of the lifecycle."""

    def _targets(self) -> list[tuple[str, Callable[[], None]]]:
        return []
