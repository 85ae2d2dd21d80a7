"""The ``/metrics`` HTTP endpoint (``blobfeed.metrics.start_http_server``).

Whoever can reach the port is a client, and not necessarily a scraper: a
port scanner, a health checker that connects and waits, a browser, a
client that resets.  So the endpoint serves a bounded number of clients at
once (:data:`MAX_CLIENTS`, the others refused and logged), gives each
:data:`REQUEST_TIMEOUT_S` in all to send its request and take the answer, answers
only its own paths, logs what goes wrong with a client rather than
printing it, and on ``close()`` cuts every client off and joins its
thread: nothing of it outlives ``close()``.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
from prometheus_client import CollectorRegistry

from .log_throttle import LogThrottle

__all__ = ["MetricsServer", "start_http_server"]

logger = logging.getLogger("blobfeed.metrics")

#: seconds a client has to send its request and take the answer, in all
#: (a scrape takes milliseconds; each read and write has as long)
REQUEST_TIMEOUT_S = 10.0
#: clients served at once, a thread each; a connection past them is closed
#: at once (a scraper retries at its next interval)
MAX_CLIENTS = 16
#: at most one warning of refused clients per this many seconds
REFUSAL_LOG_S = 10.0
#: seconds close() waits for the client threads it cut off
CLOSE_JOIN_S = 5.0
#: How often the server loop looks for ``close()``.  socketserver's loop can
#: only poll; prometheus-client's 0.5 s made every close() take half a second.
_SHUTDOWN_POLL_S = 0.02


class MetricsServer:
    """A running ``/metrics`` endpoint; ``close()`` stops it.  Context manager."""

    def __init__(self, httpd: "_Server", thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self._closed = False
        self.port: int = httpd.server_address[1]
        self.addr: str = str(httpd.server_address[0])

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, cut off the clients still connected, and release
        the port; returns once the endpoint's threads ended (each waited for
        at most a few seconds).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=CLOSE_JOIN_S)
        self._httpd.cut_off_clients(CLOSE_JOIN_S)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LogStream:
    """Where wsgiref writes what fails while it serves a request (a
    traceback, a bad status): to the log, never to the process's stderr."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    def write(self, text: str) -> int:
        self._parts.append(text)
        return len(text)

    def flush(self) -> None:
        text, self._parts = "".join(self._parts).rstrip(), []
        if text:
            logger.warning("metrics endpoint: %s", text)


class _Handler(WSGIRequestHandler):
    def setup(self) -> None:
        super().setup()
        # the module's value when the client came (a test, or an operator, may change it)
        self.connection.settimeout(REQUEST_TIMEOUT_S)

    def get_stderr(self) -> Any:
        return _LogStream()

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""


class _Server(WSGIServer):
    """A thread per client, at most :data:`MAX_CLIENTS`, each known by its
    socket so that ``close()`` can cut it off and join it (socketserver's
    ThreadingMixIn lets a daemon client thread run on after the server
    closed, for as long as its client keeps the connection)."""

    # a burst of connections waits in the backlog rather than in SYN retries
    request_queue_size = 64

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._clients_lock = threading.Lock()
        #: each client's socket: its thread, and when it came (monotonic)
        self._clients: dict[socket.socket, tuple[threading.Thread, float]] = {}
        self._closing = False
        super().__init__(*args, **kwargs)
        where = f"{str(self.server_address[0])}:{self.server_address[1]}".replace("%", "%%")  # (an IPv6 scope)
        self._refusals = LogThrottle(
            logger, 1, REFUSAL_LOG_S,
            f"metrics endpoint {where}: refused %d more connection(s) ({MAX_CLIENTS} clients at once already), "
            "the last: %s",
        )

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._clients_lock:
            full = self._closing or len(self._clients) >= MAX_CLIENTS
            if not full:
                thread = threading.Thread(
                    target=self._serve_client, args=(request, client_address),
                    name=f"blobfeed-metrics-client-{self.server_address[1]}", daemon=True,
                )
                self._clients[request] = (thread, time.monotonic())
        if full:
            self._refuse(request, client_address)
            return
        try:
            thread.start()
        except BaseException:
            with self._clients_lock:
                self._clients.pop(request, None)
            self.shutdown_request(request)
            raise

    def _refuse(self, request: Any, client_address: Any) -> None:
        self.shutdown_request(request)
        self._refusals.event("metrics endpoint %s:%d: %d clients at once already (the most it serves); refused "
                             "a connection from %s", self.server_address[0], self.server_address[1], MAX_CLIENTS,
                             _peer(client_address))

    def _serve_client(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            with self._clients_lock:
                self._clients.pop(request, None)
            self.shutdown_request(request)

    def service_actions(self) -> None:
        """(The serving loop's, every poll.)  Cut off the clients that have
        been served for longer than :data:`REQUEST_TIMEOUT_S` in all: a
        client that sends or reads a byte at a time resets each read's and
        write's timeout, and held its thread for ever.  And tell the
        refusals a window held back once it is over."""
        self._refusals.flush_due()
        now = time.monotonic()
        with self._clients_lock:
            late = [sock for sock, (_, came) in self._clients.items() if now - came > REQUEST_TIMEOUT_S]
        for sock in late:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # it ended meanwhile

    def handle_error(self, request: Any, client_address: Any) -> None:
        """What went wrong with one client: logged (socketserver prints a
        traceback to stderr); a client that reset or went quiet is routine."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            logger.debug("metrics endpoint: client %s: %r", _peer(client_address), exc)
        else:
            logger.warning("metrics endpoint: serving client %s failed", _peer(client_address), exc_info=True)

    def cut_off_clients(self, timeout: float) -> None:
        """Shut every client's connection (its thread's read or write
        returns at once) and wait up to ``timeout`` for their threads."""
        with self._clients_lock:
            self._closing = True
            clients = list(self._clients.items())
        self._refusals.flush()
        for sock, _ in clients:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the client went meanwhile
        deadline = time.monotonic() + timeout
        for _, (thread, _came) in clients:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("metrics endpoint: a client's thread did not end within %.0f s of close()", timeout)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _peer(client_address: Any) -> str:
    if isinstance(client_address, tuple) and len(client_address) >= 2:
        return f"{client_address[0]}:{client_address[1]}"
    return repr(client_address)[:100]


def start_http_server(
    port: int,
    addr: str = "127.0.0.1",
    registry: CollectorRegistry | None = None,
    *,
    health: Callable[[], tuple[bool, str]] | None = None,
    ready: Callable[[], tuple[bool, str]] | None = None,
) -> MetricsServer:
    """Serve the metrics at ``http://addr:port/metrics`` from a daemon thread.

    Only ``/metrics`` (a query string is allowed: ``?name[]=...``), the
    probes given and an index at ``/`` answer; any other path is 404 (a
    probe pointed at a path this endpoint does not serve fails, rather than
    passing on a page of metrics).  At most :data:`MAX_CLIENTS` clients are
    served at once, each for at most :data:`REQUEST_TIMEOUT_S` in all.

    Args:
        port: TCP port; 0 picks a free one (read it back from ``.port``).
        addr: address to bind.  Loopback by default: name another address
            explicitly to expose the metrics beyond this machine.
        registry: what to serve; default prometheus-client's default
            registry, where ``blobfeed.global_coordinator`` puts its metrics.
        health: also serve ``/healthz``: 200 with the text while it returns
            (True, text), 503 otherwise (a feeding service's liveness).
        ready: likewise ``/readyz`` (a feeding service's readiness).

    Returns:
        A :class:`MetricsServer` with ``port``, ``url`` and ``close()``.

    Raises:
        OSError: the address cannot be bound (a busy port, say); the message
            names the address and port, the ``errno`` is the socket's.
    """
    from prometheus_client import make_wsgi_app

    if registry is None:
        # blobfeed.global_coordinator's registry
        registry = prometheus_client.REGISTRY
    server_class = _Server6 if ":" in addr else _Server
    checks = {path: f for path, f in (("/healthz", health), ("/readyz", ready)) if f is not None}
    app = _routes(make_wsgi_app(registry), checks)
    try:
        httpd = make_server(addr, port, app, server_class, handler_class=_Handler)
    except OSError as exc:
        # the socket's own error says "Address already in use", not which address
        raise OSError(exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from exc
    assert isinstance(httpd, _Server)
    thread = threading.Thread(
        target=httpd.serve_forever,
        kwargs={"poll_interval": _SHUTDOWN_POLL_S},
        name=f"blobfeed-metrics-http-{httpd.server_address[1]}",
        daemon=True,
    )
    thread.start()
    return MetricsServer(httpd, thread)


def _routes(metrics_app: Any, checks: dict[str, Callable[[], tuple[bool, str]]]) -> Any:
    """The endpoint's paths: ``/metrics``, the probes, an index; else 404."""
    index = ("blobfeed metrics endpoint: " + " ".join(["/metrics", *checks]) + "\n").encode()

    def wsgi(environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        check = checks.get(path)
        if check is not None:
            ok, text = check()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [text.encode() + b"\n"]
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [index]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: this endpoint serves " + index.split(b": ", 1)[1]]

    return wsgi
