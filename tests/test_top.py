"""Issue 27 item 4: ``blobfeed top`` against a real pipeline serving /metrics
on a loopback port, and against endpoints that are not one."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfInput, Net, init_data_input_workers
from blobfeed.apps import cli, top
from blobfeed.metrics import start_http_server

from .helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
RUN_BOUND_S = 60.0


def _sleeper(w: int, b: int) -> list[np.ndarray]:
    time.sleep(0.005)
    return [np.zeros((8, 2), np.float32)]


#: the tests that read ``pipeline``: one test process takes them all
#: (``--dist loadgroup``), so the module's one pipeline serves the five
#: (each waited a second for its own first verdict)
PIPELINE = pytest.mark.xdist_group("top-pipeline")


@pytest.fixture(scope="module")
def pipeline() -> Iterator[str]:
    """A running pipeline (one I/O-bound worker, a consumer in a loop) serving
    /metrics on a loopback port, judged once; yields the /metrics URL.  The
    tests only read it (one scrape, two, a terminal's frames): one for the
    module, stopped after its last test (its threads end with stop())."""
    gc = blobfeed.GlobalCoordinator(log_interval=0.05)
    net = Net(name="n")
    init_data_input_workers(net, ["x"], _sleeper, 8, num_worker_threads=1, coordinator=gc)
    stop = threading.Event()

    def consume() -> None:
        try:
            while not stop.is_set():
                net.run(timeout=30)
        except EndOfInput:
            pass

    consumer = threading.Thread(target=consume, name="test-consumer", daemon=True)
    with start_http_server(0, registry=gc.registry) as server:
        gc.start()
        consumer.start()
        try:
            wait_until(lambda: bool(gc.bottleneck()), "a first verdict", timeout=RUN_BOUND_S)
            yield server.url
        finally:
            stop.set()
            stopped = gc.stop(timeout=30)
            consumer.join(timeout=30)
            assert not consumer.is_alive()
            assert stopped, "a thread outlived stop()"


def _run(*args: str, timeout: float = RUN_BOUND_S) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "blobfeed.apps.cli", "top", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@PIPELINE
def test_once_in_a_subprocess_shows_the_source_the_net_and_the_verdict(pipeline: str) -> None:
    proc = _run(pipeline, "--once")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "\x1b" not in out, "plain text when stdout is not a terminal"
    assert out.startswith(f"blobfeed top  {pipeline}  "), out
    assert "rates need two scrapes" in out
    lines = out.splitlines()
    src = next(line for line in lines if line.startswith("train "))
    assert src.split()[1] == "1", src  # one worker alive
    row = next(line for line in lines if line.startswith("train ") and " n " in line)
    cells = row.split()
    assert cells[:2] == ["train", "n"], row
    assert cells[2] == "-" and cells[3] == "-", "no rates from one scrape"
    assert cells[4].endswith("%") and int(cells[4][:-1]) > 50, f"the net waits for its one slow worker: {row}"
    # the verdict is the metric's (the fixture waited for one)
    assert cells[-1] in top.STAGE_ADVICE, row
    assert f"train/n: {top.STAGE_ADVICE[cells[-1]]}" in out


@PIPELINE
def test_two_scrapes_give_rates(pipeline: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["top", pipeline, "--iterations", "2", "--interval", "0.5"]) == 0
    out = capsys.readouterr().out
    first, second = out.split("\nblobfeed top  ")
    assert "rates need two scrapes" in first
    assert "rates over the last" in second
    row = next(line for line in second.splitlines() if line.startswith("train ") and " n " in line)
    batches_s, samples_s = (float(c.rstrip("k")) * (1000 if c.endswith("k") else 1) for c in row.split()[2:4])
    # one worker sleeping 5 ms per 8-sample batch: at most 200 batches/s
    assert 0 < batches_s <= 250, row
    assert samples_s == pytest.approx(8 * batches_s, rel=0.05), row


def test_an_unreachable_address_is_named_and_fails() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _run(f"127.0.0.1:{port}", "--once", "--timeout", "5")
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert f"blobfeed top: http://127.0.0.1:{port}/metrics: cannot scrape" in proc.stderr
    assert proc.stdout == ""


class _Garbage(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def garbage() -> Iterator[tuple[str, type[_Garbage]]]:
    handler = type("Handler", (_Garbage,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        t.join(timeout=10)


@pytest.mark.parametrize("body, expected", [
    (b"<html><body>hello</body></html>\n", "not Prometheus text"),
    (b"\xff\xfe\x00garbage", "not Prometheus text (not UTF-8"),
    (b"# TYPE other_total counter\nother_total 3\n", "no blobfeed metrics there"),
    (b"blobfeed_x 1\n" * 20_000, "larger than 65536 bytes"),
])
def test_garbage_is_named_and_fails(
    garbage: tuple[str, type[_Garbage]], body: bytes, expected: str, capsys: pytest.CaptureFixture[str],
) -> None:
    address, handler = garbage
    handler.body = body
    assert cli.main(["top", address, "--once", "--max-bytes", "65536"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"blobfeed top: http://{address}/metrics: "), err
    assert expected in err, err


def test_label_values_cannot_drive_the_terminal() -> None:
    """A scrape is untrusted: an escape sequence in a label is not shown as one."""
    text = 'blobfeed_workers_alive{source="\\u001b[2Jevil"} 1\nblobfeed_workers_alive{source="a\x1b[31mb"} 2\n'
    frame = top.render("http://h:1/metrics", top.parse("http://h:1/metrics", text, 0.0), None)
    assert "\x1b" not in frame, frame


def test_addresses() -> None:
    assert top.normalise_address("127.0.0.1:9100") == "http://127.0.0.1:9100/metrics"
    assert top.normalise_address("http://localhost:9100") == "http://localhost:9100/metrics"
    assert top.normalise_address("http://[::1]:9100/metrics") == "http://[::1]:9100/metrics"
    for bad in ("ftp://h:1/metrics", "http://:9100/metrics", "h:notaport"):
        with pytest.raises(ValueError, match="address"):
            top.normalise_address(bad)


@PIPELINE
@pytest.mark.parametrize("quit_by", ["q", "SIGINT", "SIGTERM"])
def test_on_a_terminal_it_redraws_in_place_and_restores_the_terminal(pipeline: str, quit_by: str) -> None:
    import pty
    import select
    import signal
    import termios

    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TERM="xterm")
    proc = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "top", pipeline, "--interval", "0.2"],
        cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=subprocess.PIPE,
    )
    out = b""
    try:
        deadline = time.monotonic() + RUN_BOUND_S
        while out.count(b"q or Ctrl-C to quit") < 2:  # two frames: it redraws
            assert time.monotonic() < deadline, f"no two frames within {RUN_BOUND_S} s: {out!r}"
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                out += os.read(master, 65536)
        if quit_by == "q":
            os.write(master, b"q")
        else:
            proc.send_signal(getattr(signal, quit_by))
        assert proc.wait(timeout=RUN_BOUND_S) == 0, proc.stderr.read() if proc.stderr else ""
        while select.select([master], [], [], 0.2)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            out += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if proc.stderr:
            proc.stderr.close()
        after = termios.tcgetattr(slave)
        os.close(master)
        os.close(slave)
    assert out.startswith(top._ALT_ON.encode() + top._HIDE.encode()), out[:40]
    assert out.count(top._HOME_CLEAR.encode()) >= 2, "each frame starts by clearing the screen"
    assert b"train" in out and b"VERDICT" in out
    assert out.rstrip(b"\r\n").endswith(top._SHOW.encode() + top._ALT_OFF.encode()), out[-40:]
    assert after == before, "the terminal's modes were not restored"


def test_once_against_a_feeding_service(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``blobfeed serve --metrics-port``: the source, its consumers column
    (none attached yet) and the net of consumer index 0, which ran nothing."""
    import re
    import signal

    env = {**os.environ, "PYTHONPATH": str(ROOT), "N": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "serve", "tests.service.feeds:wire_by_index",
         "--listen", str(tmp_path / "feed.sock"), "--metrics-port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()  # bounded: printed once listening, or the process exits
        m = re.match(r"blobfeed serve: metrics on (http://\S+)$", proc.stdout.readline().strip())
        assert m, "no metrics line"
        assert cli.main(["top", m.group(1), "--once"]) == 0
        out = capsys.readouterr().out
        header = next(line for line in out.splitlines() if line.startswith("SOURCE  WORKERS"))
        row = next(line for line in out.splitlines() if line.startswith("train "))
        assert row.split()[header.split().index("CONSUMERS")] == "0", out
        net = next(line for line in out.splitlines() if line.startswith("train ") and " consumer-0 " in line)
        assert net.split()[2:] == ["-", "-", "-", "-", "0", "-"], net  # no rates, shares or verdict yet
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=RUN_BOUND_S)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def test_a_scrape_naming_many_sources_shows_a_bounded_frame() -> None:
    text = "".join(f'blobfeed_batches_total{{source="s{i:05d}",net="n"}} 1\n' for i in range(5000))
    frame = top.render("http://h:1/metrics", top.parse("http://h:1/metrics", text, 0.0), None)
    assert f"... and {5000 - top.MAX_ROWS} more sources" in frame
    assert len(frame.splitlines()) < 3 * top.MAX_ROWS
