"""The metrics endpoint against clients that misbehave: idle connections,
floods of them, resets, and paths it does not serve.  It must answer
scrapes, hold a bounded number of threads and sockets, print nothing, and
leave nothing behind once closed."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from typing import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from blobfeed import endpoint
from blobfeed.metrics import start_http_server

from .helpers import WAIT, wait_until


def client_threads(port: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"blobfeed-metrics-client-{port}"]


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("blobfeed_probe_total", "a sample for the test to find", registry=reg).inc()
    return reg


@pytest.fixture
def idle() -> Iterator[list[socket.socket]]:
    """Client sockets a test opens and never writes to; closed after it."""
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def connect_idle(port: int, socks: list[socket.socket]) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    socks.append(s)
    return s


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=WAIT) as resp:
        assert resp.status == 200
        return resp.read().decode()


def test_an_idle_client_is_cut_off_by_close_and_leaves_no_thread(registry: CollectorRegistry,
                                                                  idle: list[socket.socket]) -> None:
    server = start_http_server(0, registry=registry)
    try:
        s = connect_idle(server.port, idle)
        wait_until(lambda: len(client_threads(server.port)) == 1, "a thread serving the idle client")
    finally:
        server.close()
    assert client_threads(server.port) == [], "a client's thread outlived close()"
    assert s.recv(1) == b"", "close() left the idle client's connection open"


def test_an_idle_client_is_dropped_after_the_request_timeout(registry: CollectorRegistry,
                                                             idle: list[socket.socket],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint, "REQUEST_TIMEOUT_S", 0.2)
    with start_http_server(0, registry=registry) as server:
        s = connect_idle(server.port, idle)
        assert s.recv(1) == b"", "the endpoint kept a client that sent nothing"
        wait_until(lambda: client_threads(server.port) == [], "the idle client's thread to end")


def test_a_flood_of_idle_clients_holds_a_bounded_number_of_threads_and_scrapes_go_on(
    registry: CollectorRegistry, idle: list[socket.socket], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(endpoint, "MAX_CLIENTS", 4)
    monkeypatch.setattr(endpoint, "REQUEST_TIMEOUT_S", 60.0)  # (none of the four is dropped for its time here)
    caplog.set_level(logging.WARNING, logger="blobfeed.metrics")
    with start_http_server(0, registry=registry) as server:
        for _ in range(12):
            connect_idle(server.port, idle)
        wait_until(lambda: len(client_threads(server.port)) == 4, "the first four clients served")
        # the others are refused at once: their connection closes; the four stay open
        assert [s.recv(1) for s in idle[4:]] == [b""] * 8
        for s in idle[:4]:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
        assert len(client_threads(server.port)) == 4
        assert any("clients at once" in r.getMessage() for r in caplog.records), "the refusals were not logged"
        # once the idle ones go, a scrape is served
        for s in idle[:4]:
            s.close()
        wait_until(lambda: client_threads(server.port) == [], "the idle clients' threads to end")
        assert "blobfeed_probe_total" in scrape(server.url)
    # one line each for the first of a window, the others counted in one (told at close() at the latest)
    lines = [r.getMessage() for r in caplog.records]
    told = sum(1 for m in lines if "refused a connection" in m and "more connection(s)" not in m) + sum(
        int(m.split("refused ", 1)[1].split(" ", 1)[0]) for m in lines if "more connection(s)" in m)
    assert told == 8, ("refusals counted and never told", lines)


def test_a_client_that_trickles_is_cut_off_after_the_request_timeout_in_all(
    registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A byte every little while reset each read's timeout: two such clients
    held the endpoint's two places for ever and every scrape failed (found
    by review)."""
    monkeypatch.setattr(endpoint, "MAX_CLIENTS", 2)
    monkeypatch.setattr(endpoint, "REQUEST_TIMEOUT_S", 0.5)
    with start_http_server(0, registry=registry) as server:
        slow = [socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) for _ in range(2)]
        try:
            for s in slow:
                s.sendall(b"GET /metrics HTTP/1.1\r\n")
            cut = [False, False]
            t0 = time.monotonic()
            while not all(cut):
                assert time.monotonic() - t0 < WAIT, "a trickling client was never cut off"
                for i, s in enumerate(slow):
                    if cut[i]:
                        continue
                    try:
                        s.sendall(b"X-Slow: 1\r\n")  # one header line at a time, never the end
                        s.setblocking(False)
                        cut[i] = s.recv(1) == b""
                    except BlockingIOError:
                        pass
                    except OSError:
                        cut[i] = True
                time.sleep(0.05)  # the client's own pace (what makes it slow), not a wait for the server
            wait_until(lambda: client_threads(server.port) == [], "the slow clients' threads to end")
            assert "blobfeed_probe_total" in scrape(server.url)
        finally:
            for s in slow:
                s.close()


def test_a_failing_probe_is_logged_not_printed(registry: CollectorRegistry, capfd: pytest.CaptureFixture[str],
                                               caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("the probe broke")

    caplog.set_level(logging.WARNING, logger="blobfeed.metrics")
    with start_http_server(0, registry=registry, health=broken) as server:
        with pytest.raises(urllib.error.HTTPError) as err:
            scrape(f"http://127.0.0.1:{server.port}/healthz")
        assert err.value.code == 500
        assert "blobfeed_probe_total" in scrape(server.url)
    _, printed = capfd.readouterr()
    assert "Traceback" not in printed and "the probe broke" not in printed, printed
    assert any("the probe broke" in r.getMessage() for r in caplog.records), "the failure was not logged"


def test_a_client_that_resets_prints_nothing(registry: CollectorRegistry, capfd: pytest.CaptureFixture[str],
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="blobfeed.metrics")
    with start_http_server(0, registry=registry) as server:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no end of headers: the server reads on
        wait_until(lambda: len(client_threads(server.port)) == 1, "a thread serving the client")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset
        wait_until(lambda: client_threads(server.port) == [], "the client's thread to end")
        assert "blobfeed_probe_total" in scrape(server.url)
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "Exception" not in err, f"the endpoint printed: {err!r}"
    assert any("reset" in r.getMessage().lower() or "ConnectionReset" in r.getMessage()
               for r in caplog.records), "the reset was not logged"


def test_only_the_endpoints_paths_answer(registry: CollectorRegistry) -> None:
    ok = (True, "ok")
    with start_http_server(0, registry=registry, health=lambda: ok) as server:
        base = f"http://127.0.0.1:{server.port}"
        assert "blobfeed_probe_total" in scrape(f"{base}/metrics")
        assert "blobfeed_probe_total" in scrape(f"{base}/metrics?name[]=blobfeed_probe_total")
        assert scrape(f"{base}/healthz").strip() == "ok"
        assert "/metrics" in scrape(f"{base}/"), "the index names the metrics path"
        for path in ("/metricz", "/readyz", "/favicon.ico", "/metrics/x", "/x"):
            with pytest.raises(urllib.error.HTTPError) as err:
                scrape(f"{base}{path}")
            assert err.value.code == 404, path
