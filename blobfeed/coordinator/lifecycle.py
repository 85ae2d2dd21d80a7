"""The global coordinator: starts, stops and watches every group.

:class:`GlobalCoordinator` (start/stop/join/request_stop), the stopper and
monitor threads, the atexit and fork hooks, and :func:`_inside_blobfeed`,
which tells whether a stop may wait.  Every thread is a daemon: a program
that never calls ``stop()`` still exits.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence, overload

import prometheus_client
from prometheus_client import CollectorRegistry

from ..arguments import check_index, check_timeout, wait_bound
from ..autotune import AutoTuner
from ..buffers import BufferTuner
from ..bottleneck import Bottleneck, BottleneckTracker
from ..errors import EndOfInput
from ..feeders import Feed, InputSource
from ..feeders.backends import runs_user_code
from ..feeders.reading import BatchReader, Inlet, InletDealer, SourceInfo
from ..metrics import register_collector
from ..net import Net
from ..stats import MetricsHub
from . import checkpoint, elastic
from .groups import DataInputCoordinator, InletCoordinator, ReaderCoordinator, WorkerCoordinator, _on_host
from .monitor import monitor_loop
from .registry import Registry

logger = logging.getLogger("blobfeed.coordinator")

#: Default seconds ``stop()`` waits for threads to end.
DEFAULT_JOIN_TIMEOUT = 5.0
#: At interpreter exit nothing should hold the process for long.
ATEXIT_JOIN_TIMEOUT = 0.25


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
        #: told to end: what is posted after that is never carried out (a
        #: plain attribute: post() runs in signal handlers)
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="blobfeed-stopper", daemon=True)
        self.thread.start()

    @property
    def usable(self) -> bool:
        """Will a request posted now be carried out?"""
        return not self.closed and self.thread.is_alive()

    def post(self, name: str | None = None) -> None:
        self._todo.put(name)

    def close(self) -> None:
        self.closed = True
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
        self._bottleneck = BottleneckTracker(self._hub)
        #: the sources wired with num_worker_threads="auto" (blobfeed.autotune)
        self._autotune = AutoTuner(self)
        #: the sources wired with max_buffered_bytes="auto" in arrival order (blobfeed.buffers)
        self._buffers = BufferTuner(self)
        register_collector(self._registry, self._hub)
        self._make_locks()
        #: the groups, the sources by name, the worker ids (under _lock)
        self._known = Registry()
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

    @property
    def _coordinators(self) -> list[WorkerCoordinator]:
        """Every group not yet known to have ended (the registry's live list)."""
        return self._known.groups

    @property
    def _sources(self) -> dict[str, InputSource]:
        """The input sources by name (the registry's live dict)."""
        return self._known.sources

    def get_worker_ids(self) -> list[int]:
        """Every worker id allocated so far (0, 1, 2, ...), stopped workers included, as in Caffe2."""
        with self._lock:
            return self._known.worker_ids()

    # -- building ------------------------------------------------------------------
    def _allocate(self, n: int) -> list[int]:
        with self._lock:
            return self._known.allocate(n)

    def _add(self, coordinator: WorkerCoordinator) -> None:
        with self._lock:
            self._known.add(coordinator)

    # -- readers ---------------------------------------------------------------------
    def _live_source(self, name: str) -> InputSource:
        """The wired, not stopped source ``name`` (under ``_lock``)."""
        if not isinstance(name, str):
            raise TypeError(f"source name must be a str, got {type(name).__name__}")
        source = self._known.sources.get(name)
        if source is None or source.stopped:
            raise ValueError(
                f"no source {name!r} wired to this coordinator (sources: {sorted(self._known.sources)}); "
                "wire it with init_data_input_workers first"
            )
        return source

    def open_source(self, name: str) -> SourceInfo:
        """What source ``name`` is wired with, frozen at this call.

        Raises:
            ValueError: no such source, or it was stopped.
        """
        with self._lock:
            source = self._live_source(name)
            dealing = source.dealing
            feeds = list(source.feeds)
            return SourceInfo(
                name=name,
                blob_names=tuple(feeds[0].blob_names) if feeds else (),
                axes=tuple(source.axes),
                batch_size=source.dealer.batch_size,
                deterministic=dealing.deterministic,
                shuffle_buffer=dealing.shuffle_buffer,
                epochs=dealing.epochs,
                equal=dealing.equal,
                readers=tuple(f.net_name for f in feeds),
                num_workers=len(source.dealer.worker_ids),
                resumable=bool(source.dealer.resumable),
                started=any(c.started for c in self._known.named(name)),
                stopped=bool(source.stopped),
            )

    def add_reader(
        self,
        name: str,
        reader_name: str,
        *,
        batch_size: int | None = None,
        timeout: float = 600.0,
        capacity: int = 4,
        drop_last: bool = False,
        prefetch: bool = True,
    ) -> BatchReader:
        """One more consumer of source ``name``: a reader of its whole batches.

        The reader takes its share of the source as a net wired to it would
        (one more net, dealt in turn by a deterministic source).  Its
        enqueuer thread is this coordinator's: it starts with ``start()``
        and is stopped and joined with the source (``stop()``,
        ``stop_coordinator(name)``).  Give it to ``Net.add_reader`` to feed a
        net, or read it yourself.

        Args:
            name: the source (wired with ``init_data_input_workers``).
            reader_name: its ``net`` label in the metrics.
            batch_size: default the source's batch size (a source re-batched
                once for all its readers has one).
            timeout: seconds :meth:`BatchReader.read` waits by default.
            capacity: batches assembled ahead of the reader.
            drop_last: drop a last partial batch.
            prefetch: False: no enqueuer thread; :meth:`BatchReader.read`
                assembles each batch in the reader's thread (see ``init_reader``).

        Raises:
            ValueError: no such source; a batch size another than the
                source's one; the source deals in turn and started already;
                a ``drop_last`` that differs with ``equal``.
        """
        if not isinstance(reader_name, str) or not reader_name:
            raise ValueError(f"reader_name must be a non-empty str, got {reader_name!r}")
        timeout = check_timeout("timeout", timeout)
        capacity = check_index("capacity", capacity)
        with self._lock:
            source = self._live_source(name)
            feeds = list(source.feeds)
            fixed = source.dealer.batch_size
            if batch_size is None:
                batch_size = fixed if fixed is not None else feeds[0].batch_size
            batch_size = check_index("batch_size", batch_size)
            if fixed is not None and fixed != batch_size:
                raise ValueError(
                    f"source {name!r} is re-batched once for all its readers with batch_size={fixed}; "
                    f"reader {reader_name!r} asks for {batch_size}"
                )
            if fixed is not None and any(c.started for c in self._known.named(name)):
                raise ValueError(
                    f"source {name!r} deals its batches to its readers in turn and already started: "
                    f"add reader {reader_name!r} before start()"
                )
            if source.dealing.equal and bool(drop_last) != source.dealing.drop_last:
                raise ValueError(
                    f"source {name!r} deals equal shares with drop_last={source.dealing.drop_last}; "
                    f"reader {reader_name!r} asks for drop_last={bool(drop_last)}"
                )
            if any(f.net_name == reader_name for f in feeds):
                logger.warning(
                    "source %r already feeds a reader named %r: their metrics share the label", name, reader_name
                )
            feed = Feed(
                source, reader_name, _on_host, feeds[0].blob_names, batch_size, timeout=timeout,
                device_queue_capacity=capacity, dont_rebatch=False, drop_last=bool(drop_last), hub=self._hub,
                prefetch=bool(prefetch),
            )
            source.add_feed(feed)
            self._known.add(ReaderCoordinator(self, source, feed))
        return BatchReader(feed)

    def open_inlet(
        self,
        name: str,
        blob_names: Sequence[str],
        reader_name: str,
        *,
        batch_size: int,
        capacity: int,
        timeout: float,
        on_returned: Callable[[int], None],
    ) -> Inlet:
        """A source its caller feeds with whole batches (a remote consumer's
        end of a served source), and its one reader.  Not one of the sources
        by name (several may share ``name``).  No thread: the caller's
        :meth:`Inlet.put` queues each batch where the reader takes it.
        :meth:`Inlet.start` starts it, :meth:`Inlet.close` (or ``stop()``)
        stops it.  A failure of the inlet is its reader's, not this
        coordinator's (``should_stop`` does not see it).

        Args:
            name: the source's name (the metrics' ``source`` label).
            blob_names: the blobs of each batch, in order.
            reader_name: the reader's ``net`` label.
            batch_size: the batches' size (each is handed out whole).
            capacity: items queued ahead of the reader.
            timeout: seconds the reader waits by default.
            on_returned: called with the caller's number of each item the
                reader returned, in order, in the reader's thread (must not block).
        """
        names = tuple(blob_names)
        capacity = check_index("capacity", capacity)
        timeout = check_timeout("timeout", timeout)
        source = InputSource(
            name, capacity, len(names), [0] * len(names), self._hub,
            dealer=lambda src: InletDealer(name, capacity, src.fail, on_returned),
        )
        feed = Feed(
            source, reader_name, _on_host, names, batch_size, timeout=timeout, device_queue_capacity=capacity,
            dont_rebatch=True, drop_last=False, hub=self._hub, fed_by_caller=True,
        )
        source.add_feed(feed)
        group = InletCoordinator(self, source, feed)
        with self._lock:
            self._known.add(group)

        def start() -> None:
            with self._lock:
                if not group.started:
                    group._start()

        def close(timeout: float) -> bool:
            return self._stop_coordinators([group], timeout)

        return Inlet(source, BatchReader(feed), start, close)

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
                if self._stopper is None or not self._stopper.usable:
                    # a stopper told to end may still be finishing a stop
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
        """On the stopper thread: carry out a requested stop (of the groups
        named ``name``; None: all) to its end, as ``stop()`` would: their
        threads end, ``shutdown_fun`` runs once, the loggers get their final
        call, and the groups are retired.  Nobody else may be left to do it:
        the request came from a signal handler, from inside blobfeed (a
        ``worker_fun`` that stops its own coordinator), or from a user who
        will never call ``stop()``.  A thread stuck in user code past the
        bound stays listed for the next ``stop()``."""
        with self._lock:
            coordinators = self._known.named(name)
        try:
            if coordinators:
                self._stop_coordinators(coordinators, DEFAULT_JOIN_TIMEOUT)
        finally:
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
            self._request_stop_named(name)
            # a documented, correct use (TF's Looper stops its own coordinator): not an error
            logger.info(
                "stop_coordinator(%r) called from inside blobfeed (%s): requested, not waited for",
                name, inside,
            )
            return False
        with self._lock:
            victims = [c for c in self._coordinators if c.name == name]
        return self._stop_coordinators(victims, t)

    def request_stop_coordinator(self, name: str) -> None:
        """Ask the coordinators of source or worker name ``name`` to stop,
        and return at once: ``stop_coordinator(name)`` without the wait.
        The stop is carried out to its end by the stopper thread (by
        ``start()``, before the first one).  Safe from any thread; the other
        sources go on, and ``should_stop()`` does not turn True.

        Raises:
            TypeError: ``name`` is not a str.
        """
        if not isinstance(name, str):
            raise TypeError(f"request_stop_coordinator: name must be a str, got {type(name).__name__}")
        self._request_stop_named(name)

    def _request_stop_named(self, name: str) -> None:
        """Ask the coordinators named ``name`` to stop, and return at once:
        they stop at once (plain stores), the stopper thread carries the
        stop out to its end (``start()`` does, if it did not run yet)."""
        for c in list(self._coordinators):
            if c.name == name:
                c._halt()
        stopper = self._stopper
        if stopper is not None and not stopper.closed:
            stopper.post(name)
        else:  # before the first start(): start() carries it out
            self._pending_stops.append(name)

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
            # A resize (set_num_workers, the autotuner's) that passed its
            # checks before the stop may add workers after that join; they
            # stop at once (they see the stop), so join them too.  Each pass
            # joins what was added before it, and none is added once halted.
            for _ in range(3):
                if names or not c._alive():
                    break
                names = c._join(deadline)
            stuck += names
            if names:
                stuck_coordinators.append(c)
        with self._lock:
            for c in victims:
                self._known.retire(c)
            # one that start() started while we joined is still listed: not ended
            still = [c.name for c in victims if c in self._coordinators and c not in stuck_coordinators]
        waited = timeout if timeout is not None else float("inf")
        users = [n for n in stuck if runs_user_code(n)]
        ours = [n for n in stuck if not runs_user_code(n)]
        if users:
            logger.error(
                "stop: %d thread(s) still running after %.1f s: %s -- a fetch_fun, worker_fun "
                "or external logger that never returns cannot be interrupted; the threads are "
                "daemons and will not keep the process alive; stop() again to wait for them",
                len(users), waited, ", ".join(users),
            )
        if ours:
            # not user code: nothing of the user's holds these up
            logger.error(
                "stop: %d of blobfeed's own thread(s) still running after %.1f s: %s -- this is a "
                "bug in blobfeed, please report it; they are daemons and will not keep the "
                "process alive", len(ours), waited, ", ".join(ours),
            )
        if still and not stuck:
            logger.error("stop: coordinators %s started while stopping; stop() again", still)
        return not stuck and not still

    # -- resume ----------------------------------------------------------------------
    def state_dict(self, name: str) -> dict[str, Any]:
        """The position of deterministic source ``name`` after the last batch
        that each of its nets' ``run()`` returned (not what is prefetched).

        JSON-serialisable (a stateful ``fetch_fun``'s own state must be too).
        Give it to :meth:`load_state_dict` of a pipeline wired the same way
        to continue exactly there.

        After a stop the source's last position is still given, until its
        name is wired again.  Takes no lock of the coordinator's (it reads
        references only), so a signal handler that interrupted this process
        anywhere may call it.

        Raises:
            ValueError: no such source, or it is not deterministic.
        """
        known = self._known
        source = checkpoint.resumable_source(name, known.source(name))
        return checkpoint.state_dict(source, known.seeds_of(source))

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
        with self._lock:
            source = checkpoint.resumable_source(name, self._known.sources.get(name))
            seeds = self._known.seeds_of(source)
        checkpoint.check_state(name, state, source, seeds)
        with self._lock:
            # under the lock start() takes: no worker may launch between the
            # check and the load and start from the old position
            if any(c.started for c in self._known.named(name)):
                raise ValueError(f"source {name!r} already started: load_state_dict() goes before start()")
            checkpoint.load_state(source, state)

    #: ``set_num_workers(name, n)``: a running source's worker count (see elastic)
    set_num_workers = elastic.set_num_workers
    #: ``num_workers(name)``: the workers a source runs on now (see elastic)
    num_workers = elastic.num_workers

    @overload
    def reset_data_input(self, name: str, net: Net, batch_size: int) -> None: ...

    @overload
    def reset_data_input(self, namescope: str, name: str, net: Net, batch_size: int) -> None: ...

    def reset_data_input(self, *args: Any, **kwargs: Any) -> None:
        """Change the batch size of source ``name`` into ``net``.

        Two forms: ``reset_data_input(name, net, batch_size)`` and Caffe2's
        ``reset_data_input(namescope, name, net, batch_size)``.  In Caffe2
        the name scope (``scope.CurrentNameScope()``, such as ``"gpu_0/"``)
        prefixed the blobs of the feeder wired under it, and so told apart
        the per-device feeders of one source; a blobfeed feeder is told
        apart by its ``net``, so the name scope selects nothing more (it
        must be a str, and is named in the log line, ``gpu_0/train``, as
        Caffe2 named a feeder).

        Batches assembled after the call have ``batch_size`` samples (batches
        already queued keep theirs); fetchers get it as their hint.

        Raises:
            TypeError: arguments that fit neither form; ``net`` that is not a
                :class:`Net` (a net's name, say); a ``namescope`` that is not a str.
            ValueError: bad ``batch_size``, or ``net`` is not fed from ``name``.
        """
        namescope, name, net, batch_size = _reset_arguments(args, kwargs)
        batch_size = check_index("batch_size", batch_size)
        with self._lock:
            # only init_data_input_workers' groups feed a net (a reader's has none)
            found = [
                c for c in self._known.named(name)
                if isinstance(c, DataInputCoordinator) and c.net is net and not c.source.stopped
            ]
        if not found:
            raise ValueError(f"net {net.name!r} is not fed from source {name!r}")
        source = found[0].source
        if source.dealer.batch_size is not None:
            raise ValueError(
                f"source {name!r} is re-batched once for all its nets (deterministic=True, shuffle_buffer, "
                "epochs other than 1 or equal=True): its batch size is fixed"
            )
        for c in found:
            c.set_batch_size(batch_size)
        logger.info("reset data input %s%s of net %r: batch size %d", namescope, name, net.name, batch_size)

    # -- the monitor thread -----------------------------------------------------------------
    def _start_monitor(self) -> None:
        if self._monitor is not None and self._monitor.is_alive():
            return
        self._monitor_stop = threading.Event()
        self._monitor = threading.Thread(
            target=monitor_loop, args=(self, self._monitor_stop), name="blobfeed-monitor", daemon=True
        )
        self._monitor.start()

    def bottleneck(self) -> list[Bottleneck]:
        """What limits each net fed from each live source, judged about once a second over
        the last few seconds: one :class:`~blobfeed.bottleneck.Bottleneck` each (docs/TUNING.md)."""
        return list(self._bottleneck.verdicts())

    def _reset_after_fork(self) -> None:
        """In a child made by ``os.fork()``: the parent's threads do not exist
        here and any lock one of them held stays locked forever.  Forget the
        parent's pipelines (their nets refuse to run) and start clean."""
        self._known.forget_after_fork()
        self._make_locks()
        self._monitor = None
        self._stopper = None
        self._hub.reset_after_fork()
        self._bottleneck.forget()
        self._autotune.forget()
        self._buffers.forget()

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
#: Every module of ``blobfeed.apps`` is one; these are their former names.
_APPLICATIONS = frozenset({"blobfeed.bench", "blobfeed.cli", "blobfeed.demo", "blobfeed.models"})
#: A module of the library above the core that stops a coordinator as a
#: user would, never holding a lock of the pipeline (the feeding service's
#: server, outlets and Ray actor), sets this module-level name to True: the
#: core names no such module.
STOPS_AS_A_USER = "_blobfeed_stops_as_a_user"
_APPS_PACKAGE = "blobfeed.apps"


def _is_core(module: str) -> bool:
    """Is ``module`` (a ``__name__``) the library's own code, where a thread
    may hold a pipeline lock?  By module name, not file name: file names
    differ from ``co_filename`` in pyc-only and frozen installs."""
    if module in _APPLICATIONS or module == _APPS_PACKAGE or module.startswith(_APPS_PACKAGE + "."):
        return False
    return module == "blobfeed" or module.startswith("blobfeed.")


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
        if _is_core(module) and not f.f_globals.get(STOPS_AS_A_USER):
            return f"{f.f_code.co_name}() in {module}"
        f = f.f_back
    return None


global_coordinator = GlobalCoordinator(registry=prometheus_client.REGISTRY)


_RESET_FORMS = (("name", "net", "batch_size"), ("namescope", "name", "net", "batch_size"))


def _reset_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str, Net, int]:
    """``reset_data_input``'s arguments in either form, as (namescope, name, net, batch_size)."""
    four = "namescope" in kwargs or len(args) + len(kwargs) == 4
    form = _RESET_FORMS[four]
    usage = "reset_data_input(name, net, batch_size) or reset_data_input(namescope, name, net, batch_size)"
    if len(args) > len(form):
        raise TypeError(f"{usage}: got {len(args)} positional arguments")
    bound = dict(zip(form, args))
    for key, value in kwargs.items():
        if key not in form:
            raise TypeError(f"{usage}: unexpected keyword argument {key!r}")
        if key in bound:
            raise TypeError(f"{usage}: got multiple values for {key!r}")
        bound[key] = value
    missing = [p for p in form if p not in bound]
    if missing:
        raise TypeError(f"{usage}: missing {', '.join(missing)}")
    namescope = bound.get("namescope", "")
    if not isinstance(namescope, str):
        raise TypeError(f"reset_data_input: namescope must be a str (Caffe2's name scope, such as 'gpu_0/'), "
                        f"got {type(namescope).__name__}")
    name, net = bound["name"], bound["net"]
    if not isinstance(name, str):
        raise TypeError(f"reset_data_input: name must be the input source's name (a str), got {type(name).__name__}")
    if not isinstance(net, Net):
        raise TypeError(
            f"reset_data_input: net must be the blobfeed.Net passed to init_data_input_workers, got "
            f"{type(net).__name__} {net!r} (a net is not looked up by its name)"
        )
    return namescope, name, net, bound["batch_size"]
