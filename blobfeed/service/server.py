"""``FeedServer``: serves named sources to consumers in other processes.

One process runs the workers of each source once; trainers (one process
per GPU, torchrun-style) attach to it with :func:`blobfeed.attach_source`.
See docs/SERVICE.md for the guarantees and how they compare.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Literal, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..arguments import check_index, check_timeout
from ..coordinator import GlobalCoordinator, resolve_backend
from ..errors import BlobfeedError
from ..log_throttle import LogThrottle
from ..reader import init_reader
from .admission import ClosureLog, RefusalLog
from .connection import Connection, Refused
from .served import ARENA_CONSUMERS, DEFAULT_MAX_CONSUMERS, SLOTS_MIN, ServedSource, SourceTerms
from .socket_path import SocketPath, bind_in_own_directory
from .tcp import listen_tcp, parse_tcp
from .transport import RAY, TCP, UNIX, carrier_for
from .state_file import STATE_VERSION, field_name, read_state, savable
from .wire import MAX_SLOTS, shown

__all__ = ["FeedServer", "STATE_VERSION", "current_server", "serve_source", "serving"]

logger = logging.getLogger("blobfeed.service")
#: stops the service's coordinator as a user would (see coordinator.lifecycle.STOPS_AS_A_USER)
_blobfeed_stops_as_a_user = True

#: seconds stop() waits for consumers to close after being told
STOP_DRAIN_S = 1.0
#: seconds stop() waits, in all, for the connections' threads once closed
STOP_JOIN_S = 5.0
#: how long a stop() waits for another one under way (that one's own waits are bounded well within)
STOP_WAIT_S = 60.0
#: connections in their handshake at once (each has HANDSHAKE_S for its
#: hello); the next one is accepted when one of them is done
MAX_HANDSHAKES = 64
#: what wait() and /healthz say once every source ended
ENDED = "every source ended"

_current: list["FeedServer"] = []


def current_server() -> "FeedServer":
    """The server ``blobfeed serve`` is setting up (what :func:`serve_source` adds to).

    Raises:
        BlobfeedError: no server is being set up.
    """
    if not _current:
        raise BlobfeedError(
            "serve_source() adds a source to the server that `blobfeed serve MODULE:FUNCTION` is "
            "setting up (call it from FUNCTION); in Python, call FeedServer(...).serve_source(...)"
        )
    return _current[-1]


@contextlib.contextmanager
def serving(server: "FeedServer") -> Iterator["FeedServer"]:
    """While inside, :func:`serve_source` adds to ``server``."""
    _current.append(server)
    try:
        yield server
    finally:
        _current.remove(server)


#: serve_source's default max_buffered_batches: enough chunks to keep the
#: workers busy while every consumer's slots are full, not 800 (~1 GB of W2)
SERVED_BUFFERED_CHUNKS = 64


def serve_source(
    name: str, input_blob_names: Sequence[str], fetch_fun: Any, batch_size: int, num_worker_threads: int = 2,
    **kwargs: Any,
) -> None:
    """Serve a source from the server ``blobfeed serve`` is setting up;
    the arguments are :meth:`FeedServer.serve_source`'s.

    Raises:
        BlobfeedError: not called while a server is being set up.
    """
    current_server().serve_source(name, input_blob_names, fetch_fun, batch_size, num_worker_threads, **kwargs)


#: seconds between tries to accept after accept() failed (out of descriptors, say)
ACCEPT_RETRY_S = 0.05


class FeedServer:
    """Serves sources to consumers on a Unix socket, or over TCP if asked.

    Args:
        listen: the Unix socket's path (or ``unix:PATH``); default a new
            private directory (mode 0700) holding ``feed.sock`` (mode 0600),
            removed at stop.  ``tcp://HOST:PORT`` listens on TCP instead:
            port 0 picks a free port (:attr:`address` says which);
            ``tcp://:PORT`` is loopback (127.0.0.1).  TCP has no peer
            credentials and the service no authentication: an address
            that is not loopback is logged as a warning (docs/SERVICE.md).
        metrics_port: serve ``/metrics`` and ``/healthz`` on this loopback
            port (0: any free one; None: not at all).
        metrics_addr: the address for them (loopback unless you say otherwise).
        state_file: where :meth:`stop` and every ``save_every`` seconds save
            :meth:`state_dict` (written to a temporary file, then renamed).
        resume: continue from ``state_file`` (which must exist).
        save_every: seconds between periodic saves.
        log_interval: seconds between the throughput log lines.

    Context manager: ``with FeedServer() as server: ...`` stops it at the end.
    """

    def __init__(
        self,
        listen: str | os.PathLike[str] | None = None,
        *,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
        state_file: str | os.PathLike[str] | None = None,
        resume: bool = False,
        save_every: float = 60.0,
        log_interval: float = 60.0,
    ) -> None:
        if resume and state_file is None:
            raise ValueError("resume=True needs a state_file to resume from")
        if metrics_port is not None:
            metrics_port = check_index("metrics_port", metrics_port, minimum=0)
        self._listen = os.fspath(listen) if listen is not None else None
        self._metrics_port = metrics_port
        self._metrics_addr = metrics_addr
        self.state_file = os.fspath(state_file) if state_file is not None else None
        self._resume = resume
        self._save_every = check_timeout("save_every", save_every)
        self._log_interval = check_timeout("log_interval", log_interval)
        self.registry = CollectorRegistry(auto_describe=True)
        self.coordinator = GlobalCoordinator(self.registry, log_interval=log_interval)
        self.sources: dict[str, ServedSource] = {}
        self._lock = threading.Lock()
        self._connections: set[Connection] = set()
        self._numbers = itertools.count()
        self._sock: socket.socket | None = None
        self._private_dir: str | None = None
        #: where consumers attach: the socket's path, or ``tcp://HOST:PORT`` with the real port
        self.address: str | None = None
        #: how batches travel to its consumers, chosen once from the address (Unix socket or TCP)
        self._carrier = UNIX if self._listen is None else carrier_for(self._listen)
        if self._carrier is RAY:
            raise ValueError(f"listen={self._listen!r}: a FeedServer listens on a Unix socket's path or on "
                             "tcp://HOST:PORT; a ray:// address is a Ray service's (blobfeed.ray.serve_on_ray)")
        if self._carrier is TCP:
            assert self._listen is not None
            parse_tcp(self._listen)  # a malformed address fails here, not at start()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        #: request_stop()'s reason: a plain attribute, set in a signal handler
        self._stop_asked: str | None = None
        self._stopped = False
        #: set once the first stop() ended; ``_stop_clean`` is what it returned
        self._stop_done = threading.Event()
        self._stop_clean = False
        #: one save at a time; the last one failed to write (a full disk, say)
        self._save_lock = threading.Lock()
        self._save_failed = False
        #: consumers refused, logged a few at a time
        self._refusals = RefusalLog()
        #: connections closed for breaking the protocol, consumers leaving
        #: with batches: logged a few a window (its connections, socket or Ray, share it)
        self.closure_log = ClosureLog()
        #: accept() failing (out of descriptors, say): logged a few times a window, retried
        self._accept_errors = LogThrottle(
            logger, 3, 10.0, "service: %d more failures to accept a connection (retried each time); the last: %s")
        #: the Unix socket path it listens at (not its own private directory's), and holds
        self._path: SocketPath | None = None
        #: the thread the first stop() runs in
        self._stop_thread: int | None = None
        #: when the monitor thread last logged the throughput and saved the state
        self._last_log = self._last_save = 0.0
        self._started = False
        #: start() went through: it served (only then does a stop save its state,
        #: never a fresh one over the file of the service a refused start found there)
        self._serving = False
        self.stop_reason: str | None = None
        self._metrics: Any = None
        self.registry.register(_ServiceCollector(self))
        #: the state to resume from, read (and checked) now: its seeds wire the sources
        self._resume_state = read_state(self.state_file) if resume else None  # type: ignore[arg-type]

    # -- wiring ------------------------------------------------------------------------
    def setup(self, wire: Callable[[], Any]) -> "FeedServer":
        """Call ``wire()`` with :func:`blobfeed.serve_source` adding to this server.

        The Python form of ``blobfeed serve MODULE:FUNCTION``: the same wiring
        function serves from the command line, from Python and on Ray
        (``serve_on_ray(name, wire)``). Call it before :meth:`start`.

        Returns:
            This server, so that ``FeedServer().setup(wire).start()`` reads as one step.
        """
        if not callable(wire):
            raise TypeError(f"setup() takes the wiring function, got {type(wire).__name__}")
        with serving(self):
            wire()
        return self

    def serve_source(
        self,
        name: str,
        input_blob_names: Sequence[str],
        fetch_fun: Any,
        batch_size: int,
        num_worker_threads: int = 2,
        *,
        num_consumers: int | None = None,
        max_consumers: int | None = None,
        equal: bool = False,
        grace_period: float = 30.0,
        slots: int | None = None,
        max_buffered_batches: int = SERVED_BUFFERED_CHUNKS,
        timeout: float = 600.0,
        drop_last: bool = False,
        on_error: Literal["raise", "skip"] = "raise",
        seed: int | None = None,
        backend: Any = "threads",
        worker_init_fun: Callable[[int], Any] | None = None,
        deterministic: bool = False,
        shuffle_buffer: int = 0,
        epochs: int | None = 1,
    ) -> None:
        """Serve source ``name``: ``fetch_fun`` runs on the service's workers
        (as with ``init_data_input_workers``), batches of ``batch_size`` go to
        the consumers that attach to ``name``.

        Args:
            num_consumers: deal by index: each consumer index has a net of
                its own (what a consumer leaves unacknowledged waits for its
                index).  With ``deterministic=True`` batch *i* goes to the
                consumer with ``consumer_index == i % num_consumers``, the
                same on every run, exactly as ``num_consumers`` nets in one
                process; without it each index's net takes chunks as they
                come (a faster consumer gets more; ``equal=True`` evens the
                counts).  None: first come, first served.
            max_consumers: first come (no ``num_consumers``): consumers
                attached at once, at most; past it an attach is refused
                naming the bound.  None: :data:`DEFAULT_MAX_CONSUMERS`
                (128).  Each consumer holds two threads, a socket and its
                slots' memory here, and anyone who can attach may.
            equal: every consumer gets the same number of batches per epoch
                (the last incomplete round is dropped and counted; needs
                ``num_consumers``).  The source's dealer does it, as for
                nets in one process: batches go out in rounds, batch *i* of
                an epoch to consumer *i mod num_consumers*, every epoch
                starting at consumer 0.
            grace_period: seconds a consumer index may stay away (dealt by
                index) before the source fails.
            max_buffered_batches: chunks the source buffers ahead of its
                nets (default :data:`SERVED_BUFFERED_CHUNKS`, not
                init_data_input_workers' 800: each consumer's slots and
                queue already hold batches ahead, and the buffer is memory).
            slots: batches in flight per consumer (shared-memory slots, one
                batch each; at least 3).  None: enough for about 8 MiB of
                batches, 4 to 64 (``served.default_slots``; 4 on Ray).
                First come, a consumer holds at most its share of them
                unacknowledged (``SharedOutlet.share``).
            timeout: the workers' timeout, as for init_data_input_workers.
            backend: as for init_data_input_workers; ``"processes"`` gives
                each worker process slots enough for the batches the
                consumers hold (they read them in the worker's memory:
                ``ProcessBackend.slots_to_lend``, at least 8).  A ``ProcessBackend``
                you pass keeps its own ``slots``.

        The other arguments are those of ``init_data_input_workers``.

        Raises:
            ValueError: bad arguments, a name served twice, or after start().
        """
        if self._started:
            raise ValueError("serve_source() goes before start()")
        if not isinstance(name, str) or not name:
            raise ValueError(f"source name must be a non-empty str, got {name!r}")
        if name in self.sources:
            raise ValueError(f"source {name!r} is served already")
        if num_consumers is not None:
            num_consumers = check_index("num_consumers", num_consumers)
        if max_consumers is not None:
            max_consumers = check_index("max_consumers", max_consumers)
            if num_consumers is not None:
                raise ValueError(
                    f"source {name!r}: max_consumers bounds a first-come source; one dealt by index "
                    f"(num_consumers={num_consumers}) serves that many consumers at most"
                )
        elif num_consumers is None:
            max_consumers = DEFAULT_MAX_CONSUMERS
        if not isinstance(equal, bool):
            raise TypeError(f"equal must be a bool, got {type(equal).__name__}")
        if equal and num_consumers is None:
            raise ValueError(
                f"source {name!r}: equal=True needs num_consumers (the shares are equal among that many consumers)"
            )
        grace_period = check_timeout("grace_period", grace_period)
        if slots is not None:
            slots = check_index("slots", slots, minimum=3)
            if slots > MAX_SLOTS:
                # a consumer refuses a service that offers more (wire.MAX_SLOTS)
                raise ValueError(f"source {name!r}: slots={slots}, more than a consumer accepts ({MAX_SLOTS})")
        names = list(input_blob_names)
        batch_size = check_index("batch_size", batch_size)
        if seed is None and self._resume_state is not None:
            # the drawn seed of the run being resumed (what the user would pass)
            saved = self._resume_state["sources"].get(name, {}).get("inner", {}).get("seed")
            if isinstance(saved, list) and saved and type(saved[0]) is int:
                seed = saved[0]
            elif type(saved) is int:  # a random-access source's state: one seed
                seed = saved
        if backend == "processes" and type(num_worker_threads) is int and num_worker_threads > 0:
            # a batch a consumer holds keeps its worker's slot (it reads it
            # there): the slots are sized for what the consumers hold (each
            # its slots; first come, as many consumers as the arena is made
            # for), not for one net.  S8 (8 consumers on 2 workers) ran at
            # 0.68x S1's batches/s with the default 8 slots, 1.02x with 16.
            backend = resolve_backend(backend)
            held = (num_consumers or ARENA_CONSUMERS) * (slots or SLOTS_MIN)
            backend.slots = backend.slots_to_lend(-(-held // num_worker_threads))
        wiring = dict(
            max_buffered_batches=max_buffered_batches, timeout=timeout,
            drop_last=drop_last, on_error=on_error, seed=seed, backend=backend,
            worker_init_fun=worker_init_fun, deterministic=deterministic, shuffle_buffer=shuffle_buffer,
            epochs=epochs, equal=equal,
        )
        # one reader per consumer index (the first wires the workers), without
        # prefetch: each connection's sender assembles the batches it sends,
        # straight from the dealer (no enqueuer thread, no hand-off)
        readers = [init_reader(
            names, fetch_fun, batch_size, num_worker_threads, name, reader_name="consumer-0",
            coordinator=self.coordinator, prefetch=False, **wiring,
        )]
        readers += [
            self.coordinator.add_reader(
                name, f"consumer-{i}", batch_size=batch_size, timeout=timeout,
                drop_last=drop_last, prefetch=False,
            )
            for i in range(1, num_consumers or 1)
        ]
        terms = SourceTerms(name, tuple(names), batch_size, num_consumers, equal, grace_period, slots, max_consumers)
        self.sources[name] = ServedSource(terms, self.coordinator, readers)

    # -- running -----------------------------------------------------------------------
    def start(self) -> "FeedServer":
        """Start the workers and listen.  Returns self.

        Raises:
            ValueError: no source, or ``resume`` with a state that does not fit;
                the path is refused (see docs/SERVICE.md, "The socket path").
            StopRequested: (a ValueError) :meth:`request_stop` came while it
                waited for its path's last service to let go.
            OSError: the socket or the metrics port cannot be bound.
        """
        if self._stopped:
            when = "" if self._started else " before it started"
            raise ValueError(f"the server was stopped{when}: a FeedServer serves once, make another")
        if self._started:
            raise ValueError("the server started already")
        if not self.sources:
            raise ValueError("no source to serve: call serve_source() first")
        if self._resume_state is not None:
            self._load(self.state_file)  # type: ignore[arg-type]
        self._started = True
        try:
            self._bind()
            self.serve_metrics()
            self.coordinator.start()
            self._thread("accept", self._accept_loop)
            self._thread("monitor", self._monitor_loop)
        except BaseException:
            self.stop()
            raise
        self._serving = True
        logger.info("service: serving %s at %s", sorted(self.sources), self.address)
        return self

    def serve_metrics(self) -> str | None:
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``metrics_port``
        now, before anything is wired or started (``start()`` does it
        otherwise), so that a taken port fails before the workers start.
        Until ``start()``, ``/healthz`` answers 200 and ``/readyz`` 503, both ``starting``.  Idempotent.

        Returns:
            The metrics URL, or None without a ``metrics_port``.

        Raises:
            OSError: the port cannot be bound; the message names the address and port.
        """
        if self._metrics_port is None or self._metrics is not None:
            return self.metrics_url
        from ..metrics import start_http_server

        try:
            self._metrics = start_http_server(
                self._metrics_port, self._metrics_addr, self.registry, health=self.health, ready=self.ready
            )
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise OSError(exc.errno, f"cannot serve metrics on {self._metrics_addr}:{self._metrics_port}: "
                                     f"{reason}") from None
        return self.metrics_url

    def _thread(self, role: str, body: Callable[[], None]) -> threading.Thread:
        t = threading.Thread(target=body, name=f"blobfeed-service-{role}", daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _bind(self) -> None:
        if self._carrier is TCP:
            assert self._listen is not None
            self._sock, self.address = listen_tcp(self._listen)
            return
        if self._listen is None:
            self._private_dir = tempfile.mkdtemp(prefix="blobfeed-")  # mode 0700
            path = os.path.join(self._private_dir, "feed.sock")
            try:
                self._sock = bind_in_own_directory(path)
            except ValueError as err:
                raise ValueError(f"the default address is in a new directory of TMPDIR ({tempfile.gettempdir()!r}): "
                                 f"{err}; set TMPDIR to a shorter directory, or pass listen=PATH "
                                 "(--listen)") from None
        else:
            path = self._listen[5:] if self._listen.startswith("unix:") else self._listen
            self._path = SocketPath(path)
            self._sock = self._path.take(self._stop_requested)
        self.address = path

    def _accept_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        # at most MAX_HANDSHAKES connections in their handshake: peers that
        # connect and say nothing (or trickle) cannot each hold a thread and a
        # descriptor; the others wait in the listen backlog meanwhile
        handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        while not self._stop_requested():
            if not handshakes.acquire(timeout=0.1):
                continue
            try:
                conn_sock, origin = sock.accept()
            except OSError as err:
                handshakes.release()
                if self._stop_requested() or sock.fileno() < 0:
                    return  # closed by stop()
                # out of descriptors or memory (EMFILE, ENFILE, ENOBUFS,
                # ENOMEM; peers holding connections can cause it), or a peer
                # gone before it was taken: passing, and the service goes on
                self._accept_errors.event("service: accepting a connection at %s failed (%s); retried in %g s",
                                          self.address, str(err), ACCEPT_RETRY_S)
                self._stopping.wait(ACCEPT_RETRY_S)
                continue
            try:
                where = self._carrier.accepted(conn_sock, origin)
            except OSError:
                conn_sock.close()  # it went away at once
                handshakes.release()
                continue
            conn = Connection(
                conn_sock, next(self._numbers), self.source_for, self.state_dict, str(self.address),
                self._carrier, where, refusals=self._refusals, closures=self.closure_log,
            )
            conn.on_handshake_done = handshakes.release
            with self._lock:
                if self._stop_requested():
                    conn.tell_stopped(f"service at {self.address} is stopping")
                    conn_sock.close()
                    handshakes.release()
                    return
                self._connections.add(conn)
            t = threading.Thread(target=self._serve, args=(conn,), name=f"blobfeed-service-recv-{conn.number}", daemon=True)
            conn.receiver = t
            try:
                t.start()
            except RuntimeError as err:
                # no thread to be had (the process's limit): this connection
                # goes, the service and its other consumers stay
                logger.warning("service: %s closed: its thread could not start (%s)", conn.peer, err)
                with self._lock:
                    self._connections.discard(conn)
                conn.receiver = None
                conn.close()
                conn_sock.close()
                handshakes.release()

    def source_for(self, name: str) -> ServedSource:
        """The source a consumer asks for by ``name``.

        Raises:
            Refused: no such source (the message lists those served).
        """
        source = self.sources.get(name)
        if source is None:
            raise Refused(f"this service has no source {shown(name)}; it serves {shown(sorted(self.sources), 400)}")
        return source

    def _serve(self, conn: Connection) -> None:
        try:
            conn.serve()
        finally:
            with self._lock:
                self._connections.discard(conn)

    def _monitor_loop(self) -> None:
        # its one thread enforces the grace periods and saves the state: a
        # round that fails is logged, and the next one comes
        self._last_log = self._last_save = time.monotonic()
        delivered = {n: 0 for n in self.sources}
        while not self._stopping.wait(0.1):
            try:
                self._monitor_round(delivered)
            except Exception:
                logger.exception("service: a round of the monitor failed")

    def _monitor_round(self, delivered: dict[str, int]) -> None:
        """(:meth:`_monitor_loop`, its thread's alone.)  ``delivered``: each
        source's acknowledged batches at the last throughput line."""
        last_log = self._last_log
        self._refusals.flush_due()
        self.closure_log.flush_due()
        self._accept_errors.flush_due()
        for s in self.sources.values():
            s.check_grace()
            s.arena.reap()  # batches consumers that exited had kept
            failure = s.failure
            if failure is not None and self.stop_reason is None:
                self.stop_reason = f"source {s.name!r} failed: {failure}"
        now = time.monotonic()
        if now - last_log >= self._log_interval:
            for name, s in self.sources.items():
                total = s.counts.total_acknowledged()
                logger.info(
                    "service: source %r: %.1f batches/s over the last %.0f s, %d consumers attached",
                    name, (total - delivered[name]) / (now - last_log), now - last_log, s.connected,
                )
                delivered[name] = total
            self._last_log = now
        if self.state_file is not None and now - self._last_save >= self._save_every:
            self._last_save = now
            self.save_state()

    @property
    def metrics_url(self) -> str | None:
        """Where ``/metrics`` is served (``/healthz`` beside it), if it is."""
        return self._metrics.url if self._metrics is not None else None

    def health(self) -> tuple[bool, str]:
        """``/healthz`` (liveness): (healthy, what the service is doing).

        ``(True, "ok")`` while serving; ``(True, "starting")`` before
        :meth:`start` (alive, not ready); ``(True, "done: ...")`` once every
        source ended (a clean finish is not a failure: nothing to restart);
        False once stopping, or a source failed (a consumer index that did
        not come back, or a fetcher error), naming it and why.
        """
        if self._stop_requested():
            return False, "stopping"
        if not self._started:
            # alive, not ready: the wiring (the user's function) may take
            # long, and a liveness probe that failed would restart it
            return True, "starting"
        failed = [(n, s.failure) for n, s in self.sources.items() if s.failure is not None]
        if failed:
            return False, "; ".join(f"source {n!r} failed: {err}" for n, err in failed)
        if self._all_ended():
            return True, f"done: {ENDED}"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        """``/readyz`` (readiness): True only while serving (``"ok"``); once
        every source ended, stopping or failed, False with ``health()``'s text."""
        ok, text = self.health()
        return ok and text == "ok", text

    def _all_ended(self) -> bool:
        return self._started and all(s.ended for s in self.sources.values())

    # -- state -------------------------------------------------------------------------
    def state_dict(self, source: str | None = None) -> dict[str, Any]:
        """Every resumable source's position, as of the batches its consumers
        acknowledged.  Each source's state stands alone: one that is not
        resumable (not ``deterministic=True``) is left out, and starts
        afresh when the service is resumed.

        Args:
            source: the source that must be in it (a consumer of it asks).

        Raises:
            ValueError: ``source`` is not resumable; or, asked for none,
                no source is.
        """
        states: dict[str, Any] = {}
        refused: dict[str, ValueError] = {}
        for name, s in self.sources.items():
            try:
                states[name] = s.state_dict()
            except ValueError as err:
                refused[name] = err
        if source is not None and source in refused:
            raise refused[source]
        if not states and refused:
            raise ValueError("; ".join(str(err) for err in refused.values()))
        return {"version": STATE_VERSION, "sources": states}

    def save_state(self) -> bool:
        """Write :meth:`state_dict` to ``state_file`` atomically; False if it
        could not, or if a resume would refuse it (over
        :data:`MAX_STATE_FILE_BYTES` or :data:`MAX_ACKED_AFTER`: a warning
        says so, and the state saved last stays)."""
        if self.state_file is None:
            return False
        try:
            state = self.state_dict()
        except (ValueError, RuntimeError) as err:
            logger.warning("service: state not saved: %s", err)
            return False
        text = savable(state, self.state_file)
        if text is None:
            return False
        # One save at a time (the monitor's periodic one, stop()'s, the
        # user's): a state taken earlier must not replace a later one.  A
        # temporary file of its own (O_EXCL: no planted name or link is
        # written through), in the state file's directory (one rename).
        with self._save_lock:
            folder, name = os.path.split(os.path.abspath(self.state_file))
            tmp = None
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.state_file)
                tmp = None
            except OSError as err:
                # a full disk, a read-only directory: the state saved last stays
                logger.warning("service: state not saved to %s: %s (the state saved last stays)",
                               self.state_file, err.strerror or err)
                self._save_failed = True
                return False
            finally:
                if tmp is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
        self._save_failed = False
        logger.info("service: state saved to %s", self.state_file)
        return True

    def _load(self, path: str) -> None:
        state = self._resume_state
        assert state is not None
        # every resumable source must be in it; one that is not starts afresh
        resumable = {name for name, s in self.sources.items() if s.resumable}
        if not set(state["sources"]) <= set(self.sources) or not resumable <= set(state["sources"]):
            raise ValueError(
                f"resume: {path!r} holds sources {sorted(state['sources'])}; this service serves "
                f"{sorted(self.sources)}, of which {sorted(resumable)} are resumable (deterministic=True): "
                "the state must hold every resumable source, and no other"
            )
        for name in sorted(set(self.sources) - set(state["sources"])):
            logger.info("service: source %r is not resumable (not deterministic=True): it starts afresh", name)
        for name, s in state["sources"].items():
            if s.get("acked_after") and self.sources[name].shared is None:
                # a first-come service's: batches acknowledged past the
                # position, skipped when dealt again; a source dealt by
                # index has no way to skip them, and would deal them twice
                where = field_name(field_name("state['sources']", name), "acked_after")
                raise ValueError(
                    f"resume: {path!r}: {where} lists "
                    f"{len(s['acked_after'])} batches acknowledged past the saved position, which only a source "
                    f"served first come can skip; this service deals {name!r} by index (num_consumers=): resume it "
                    "first come (without num_consumers), or from a state saved by index"
                )
            try:
                self.coordinator.load_state_dict(name, s["inner"])
            except (ValueError, TypeError) as err:
                field = field_name(field_name("state['sources']", name), "inner")
                raise ValueError(f"resume: {path!r}: {field} (the source's position): {err}") from None
            served = self.sources[name]
            if served.shared is not None:
                served.shared.skip = set(s.get("acked_after", []))
        logger.info("service: resumed from %s", path)

    # -- stopping ----------------------------------------------------------------------
    def request_stop(self, reason: str = "stopped") -> None:
        """Ask :meth:`wait` to return.  ``reason`` becomes :attr:`stop_reason`
        unless a stop was requested already (a second signal does not rename
        it) or every source ended.

        Safe in a signal handler: it only sets attributes.  A lock taken here
        could be the one the interrupted code holds (an Event's, inside
        :meth:`wait`): the process would hang for good.  :meth:`wait`, the
        accept loop and a start waiting for its path look every 0.1 s."""
        if self._stop_asked is None:
            if not self._stopping.is_set() and self.stop_reason != ENDED:
                self.stop_reason = reason
            self._stop_asked = reason

    def _stop_requested(self) -> bool:
        """A stop was asked for (:meth:`request_stop`) or is under way."""
        return self._stop_asked is not None or self._stopping.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Until a stop is requested, or every source ended (its data dealt
        to the end, every batch acknowledged, every consumer gone); True if
        so (``stop_reason`` then says "every source ended").  A source that
        failed has not ended: the service stays up, its health failing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._stop_requested():
            if self._all_ended():
                if self.stop_reason is None:
                    self.stop_reason = ENDED
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._stopping.wait(0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic())))
        return True

    def stop(self, reason: str | None = None) -> bool:
        """Stop serving: save the state (``state_file``), tell every consumer,
        stop the workers, remove the socket (its file, for a Unix socket).  Idempotent.  Returns True when
        every thread ended.  A stop() called while another is under way (a
        signal handler's and the main thread's) waits for it, at most
        :data:`STOP_WAIT_S`, and returns what it returns; called from inside
        it (a signal handler that runs in the thread that is stopping), it
        returns False at once: that stop goes on when the handler returns."""
        with self._lock:
            first = not self._stopped
            self._stopped = True
            self._stopping.set()
            conns = list(self._connections)
            if first:
                self._stop_thread = threading.get_ident()
        if not first:
            if self._stop_thread == threading.get_ident() and not self._stop_done.is_set():
                return False  # waiting would wait for ourselves
            if not self._stop_done.wait(STOP_WAIT_S):
                logger.warning("service: stop() waited %.3g s for the stop under way; it has not ended", STOP_WAIT_S)
                return False
            return self._stop_clean
        try:
            self._stop_clean = self._stop(conns, reason)
        finally:
            self._stop_done.set()
        return self._stop_clean

    def _stop(self, conns: list[Connection], reason: str | None) -> bool:
        """(:meth:`stop`, once.)"""
        why = reason or self.stop_reason or "stopped"
        if self._serving:
            logger.info("service: stopping (%s): telling %d consumers", why, len(conns))
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        for s in self.sources.values():
            s.stopped = True
        # The saved state must count every batch a consumer's run() returned,
        # or a resume would deal it again.  Tell every consumer first (also
        # one that has the data's end and still returns batches): told, its
        # run() returns no more batches, and it says bye after its last
        # acknowledgement.  Then close every connection, so that no batch
        # is acknowledged after the save: the receivers still read what was
        # sent before (a consumer that did not answer in time), and on a
        # Unix socket a consumer's later acknowledgement fails, and its
        # run() raises instead of returning the batch.  Only then save.
        for conn in conns:
            conn.tell_stopped(f"service at {self.address} stopped ({why})")
        deadline = time.monotonic() + STOP_DRAIN_S
        for conn in conns:
            conn.closed.wait(max(0.0, deadline - time.monotonic()))
        for conn in conns:
            conn.close()
        # A consumer that was leaving hands back what it had not acknowledged
        # from its receiver thread: wait for that before letting go of what
        # is held, or the hand-back keeps its slots mapped after the stop.
        clean = True
        deadline = time.monotonic() + STOP_JOIN_S
        for conn in conns:
            if conn.receiver is not None and conn.receiver.ident is not None:  # (one that never started: nothing to join)
                conn.receiver.join(timeout=max(0.0, deadline - time.monotonic()))
                clean = clean and not conn.receiver.is_alive()
        if self._serving and self.state_file is not None:
            self.save_state()
            clean = clean and not self._save_failed  # (the warning said why; the state saved last stays)
        clean = self.coordinator.stop() and clean
        for s in self.sources.values():
            s.drop_held()  # what waited to be dealt again maps old slots
        for t in self._threads:
            t.join(timeout=5.0)
            clean = clean and not t.is_alive()
        if self._metrics is not None:
            self._metrics.close()
        if self._path is not None:
            self._path.release()  # its file, if still this service's, and its lock
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
        self._refusals.flush()
        self.closure_log.flush()
        self._accept_errors.flush()
        logger.info("service: stopped (%s)", why)
        return clean

    def __enter__(self) -> "FeedServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<FeedServer {sorted(self.sources)} at {self.address}>"


class _ServiceCollector:
    """The service's own metrics (the sources' pipeline metrics are the coordinator's)."""

    def __init__(self, server: FeedServer) -> None:
        self._server = server

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        consumers = GaugeMetricFamily(
            "blobfeed_service_consumers", "Consumers attached to a served source", labels=["source"]
        )
        fams = {
            k: CounterMetricFamily(f"blobfeed_service_batches_{k}", help_, labels=["source", "consumer"])
            for k, help_ in (
                ("delivered", "Batches the service sent to a consumer"),
                ("acknowledged", "Batches a consumer's run() returned (acknowledged)"),
                ("redealt", "Batches a consumer left unacknowledged, dealt to another"),
            )
        }
        waited = CounterMetricFamily(
            "blobfeed_service_consumer_wait_seconds",
            "Seconds a consumer had room for a batch and the service had none for it",
            labels=["source", "consumer"],
        )
        run_waited = CounterMetricFamily(
            "blobfeed_service_consumer_run_wait_seconds",
            "Seconds the consumer's run() waited for a batch, as the consumer reported it with its acknowledgements",
            labels=["source", "consumer"],
        )
        for name, s in list(self._server.sources.items()):
            consumers.add_metric([name], s.connected)
            delivered, acknowledged, redealt, waits, run_waits = s.counts.snapshot()
            for k, pairs in (("delivered", delivered), ("acknowledged", acknowledged), ("redealt", redealt)):
                for label, v in pairs:
                    fams[k].add_metric([name, label], v)
            for label, secs in waits:
                waited.add_metric([name, label], secs)
            for label, secs in run_waits:
                run_waited.add_metric([name, label], secs)
        yield consumers
        yield from fams.values()
        yield waited
        yield run_waited
