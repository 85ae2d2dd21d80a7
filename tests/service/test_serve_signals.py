"""`blobfeed serve` and the signals an operator or a supervisor sends: at any
moment of its life, a SIGTERM or SIGINT (or SIGHUP, a closed terminal) is a
clean stop: the state saved, the socket removed, one "stopped" line, no
traceback, and an exit status that says how it went."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import wait_until

from .test_service import ENV, ROOT

WIRE = """
import os, time, blobfeed
import numpy as np

def fetch(worker_id, batch_size):
    return [np.zeros((batch_size, 2), np.float32)]

def wire():
    blobfeed.serve_source('train', ['x'], fetch, 4, 1)
    print('wiring', flush=True)
    # held here (bounded) until the test has sent its signal
    gate = os.environ['GATE']
    deadline = time.monotonic() + 20
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
"""


def _serve(tmp_path: Path) -> tuple[subprocess.Popen[str], Path, Path]:
    (tmp_path / "slow_wire.py").write_text(WIRE)
    sock, gate = tmp_path / "feed.sock", tmp_path / "gate"
    p = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "serve", str(tmp_path / "slow_wire.py:wire"),
         "--listen", str(sock), "--state-file", str(tmp_path / "state.json")],
        env={**ENV, "GATE": str(gate)}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return p, sock, gate


def _serve_module(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """``blobfeed serve`` of a wiring module made of ``source`` (its ``wire``), to its end."""
    (tmp_path / "wiring.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "blobfeed.apps.cli", "serve", str(tmp_path / "wiring.py:wire"),
         "--listen", str(tmp_path / "feed.sock")],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_during_start_up_stops_the_service_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    """The signal lands while the wiring function runs (the target imported,
    a source wired, its workers not started): it used to kill the process
    at once (SIGTERM, SIGHUP: the default action, exit -15 or -1, the socket
    file and a half-made service left) or raise KeyboardInterrupt through the
    wiring (SIGINT: a traceback)."""
    p, sock, gate = _serve(tmp_path)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "wiring"
        p.send_signal(sig)
        gate.touch()
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait(10)
    assert p.returncode == 0, (p.returncode, out, err)
    assert f"blobfeed serve: stopped ({sig.name})" in out, out
    assert "listening on" not in out, "a service stopped during its start-up must not say it listens"
    assert "Traceback" not in err, err
    assert not sock.exists(), "the socket file was left behind"


def test_a_second_signal_while_stopping_does_not_cut_the_stop_short(tmp_path: Path) -> None:
    """SIGINT, then SIGTERM while the first stop runs (it logs its start,
    and a consumer that never answers its "stopped" holds it up to 1 s): one stop, to
    its end, with its status and its line.  A second signal must not find
    the default handler back and kill the process (-15)."""
    import json
    import os
    import socket

    from blobfeed.service.wire import PROTOCOL

    (tmp_path / "slow_wire.py").write_text(WIRE)
    sock, gate = tmp_path / "feed.sock", tmp_path / "gate"
    gate.touch()
    p = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "serve", str(tmp_path / "slow_wire.py:wire"),
         "--listen", str(sock)],
        env={**ENV, "GATE": str(gate)}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "wiring"
        assert "listening on" in p.stdout.readline()
        silent.settimeout(10)
        silent.connect(str(sock))
        silent.send(json.dumps({"t": "hello", "protocol": PROTOCOL, "source": "train", "blobs": ["x"],
                                "batch_size": 4, "index": None, "num": None, "pid": os.getpid()}).encode())
        assert json.loads(silent.recv(1 << 16))["t"] == "welcome"
        p.send_signal(signal.SIGINT)
        assert p.stderr is not None
        heard = ""
        while "service: stopping (SIGINT)" not in heard:  # (bounded: the stop ends, and stderr with it)
            heard = p.stderr.readline()
            assert heard, "the process ended without its stop's first line"
        p.send_signal(signal.SIGTERM)  # while the stop waits (up to 1 s) for the silent consumer
        out, err = p.communicate(timeout=30)
    finally:
        silent.close()
        p.kill()
        p.wait(10)
    assert p.returncode == 0, (p.returncode, out, err)
    assert "blobfeed serve: stopped (SIGINT)" in out, out
    assert "Traceback" not in err, err
    assert not sock.exists()


def test_a_second_signal_during_a_start_up_that_hangs_ends_the_process(tmp_path: Path) -> None:
    """The wiring function never returns: the first SIGTERM only asks for a
    stop, which it never reaches; the second is the default action (it was
    ignored, and only SIGKILL ended the process: found by review)."""
    p, sock, gate = _serve(tmp_path)  # the gate is never opened: the wiring waits its 20 s
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "wiring"
        p.send_signal(signal.SIGTERM)
        assert p.stderr is not None
        heard = ""
        while "stopping once the start-up ends" not in heard:  # (bounded: the wiring gives up after 20 s)
            heard = p.stderr.readline()
            assert heard, "the process ended without saying it heard the first signal"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=10)
    finally:
        p.kill()
        p.wait(10)
    assert p.returncode == -signal.SIGTERM, (p.returncode, out, err)
    assert "a second SIGTERM during start-up: ending at once" in err, err


def test_a_launcher_that_closes_the_pipe_after_the_address_gets_a_clean_stop(tmp_path: Path) -> None:
    """The documented use: read the "listening on" line, close the pipe.  The
    stop was clean but its "stopped" line raised BrokenPipeError: a
    traceback and exit 1 (found by review)."""
    p, sock, gate = _serve(tmp_path)
    gate.touch()
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "wiring"
        assert "listening on" in p.stdout.readline()
        p.stdout.close()
        p.send_signal(signal.SIGTERM)
        assert p.stderr is not None
        err = p.stderr.read()
        p.wait(30)
    finally:
        p.kill()
        p.wait(10)
    assert p.returncode == 0, (p.returncode, err)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert not sock.exists()


@pytest.mark.parametrize("code,named", [("'config FOO missing'", "config FOO missing"), ("0", "sys.exit(0)")])
def test_a_wiring_function_that_exits_is_a_failed_start(tmp_path: Path, code: str, named: str) -> None:
    """``sys.exit(...)`` in the wiring: exit 2 naming it (its message was
    swallowed, and ``sys.exit(0)`` exited 0 with no "stopped" line: a
    supervisor saw success for a service that never served)."""
    p = _serve_module(tmp_path, f"import sys\ndef wire():\n    sys.exit({code})\n")
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "exited during start-up" in p.stderr and named in p.stderr, p.stderr
    assert not (tmp_path / "feed.sock").exists() and not (tmp_path / "feed.sock.lock").exists()


def test_a_signal_while_the_start_waits_for_the_path_is_a_clean_stop(tmp_path: Path) -> None:
    """A service still stopping holds the path: the new one waits for it.
    A SIGTERM then ended the start with exit 2 and an error, as if the path
    were refused (found by review); it is a stop like any other."""
    import fcntl
    import os
    import socket

    sock = tmp_path / "feed.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(str(sock))  # the stopping service's file, no longer listening
    dead.close()
    lock = open(str(sock) + ".lock", "a+")
    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # held, as by the service that stops
    (tmp_path / "slow_wire.py").write_text(WIRE)
    gate = tmp_path / "gate"
    gate.touch()
    p = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "serve", str(tmp_path / "slow_wire.py:wire"),
         "--listen", str(sock)],
        env={**ENV, "GATE": str(gate)}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "wiring"

        def has_the_lock_open() -> bool:
            try:
                fds = os.listdir(f"/proc/{p.pid}/fd")
            except OSError:
                return False
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{p.pid}/fd/{fd}") == str(sock) + ".lock":
                        return True
                except OSError:
                    continue
            return False
        wait_until(has_the_lock_open, "the start to wait on the path's lock", timeout=20)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
        assert sock.exists() and Path(str(sock) + ".lock").exists(), "it took the files of the service it waited for"
    finally:
        p.kill()
        p.wait(10)
        lock.close()
    assert p.returncode == 0, (p.returncode, out, err)
    assert "blobfeed serve: stopped (SIGTERM)" in out, (out, err)
    assert "listening on" not in out
    # the wait ended at the signal, not at its own 30 s bound
    assert took < 10 and "stopping for more than" not in err, (took, err)


def test_a_wiring_function_that_raises_is_a_failed_start_named(tmp_path: Path) -> None:
    p = _serve_module(tmp_path, "def wire():\n    raise KeyError('the config has no TRAIN')\n")
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "failed during start-up" in p.stderr and "the config has no TRAIN" in p.stderr, p.stderr
    assert not (tmp_path / "feed.sock").exists() and not (tmp_path / "feed.sock.lock").exists()


def test_request_stop_takes_no_lock_a_signal_could_land_inside() -> None:
    """request_stop() in a signal handler set an Event: its lock is the one
    the interrupted thread holds for a moment in every Event.wait(), and a
    signal landing there hung the process for good (a review's timer signal
    every 0.2 ms hung it after 439 signals).  Run in a child, bounded."""
    script = """
import signal, threading
from blobfeed.service import FeedServer
server = FeedServer()
calls = [0]
def handler(signum, frame):
    calls[0] += 1
    server.request_stop("SIGALRM")
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
while calls[0] < 5000:
    server._stopping.wait(0)  # what wait() does between its looks, in the main thread
signal.setitimer(signal.ITIMER_REAL, 0)
assert server.stop_reason == "SIGALRM"
print("ok", calls[0])
"""
    p = subprocess.run([sys.executable, "-c", script], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("ok"), (p.returncode, p.stdout, p.stderr)


def test_a_wiring_error_after_a_signal_is_still_named(tmp_path: Path) -> None:
    """A stop signal came first, then the wiring failed: the failure is the
    news (it exited 0 with "stopped (SIGTERM)" and the error nowhere: found
    by review)."""
    p = _serve_module(tmp_path, "import os, signal\ndef wire():\n    os.kill(os.getpid(), signal.SIGTERM)\n"
                                "    raise ValueError('the config names no TRAIN dir')\n")
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "the config names no TRAIN dir" in p.stderr, p.stderr


@pytest.mark.parametrize("ignored", [signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_ignored_at_start_stays_ignored(tmp_path: Path, ignored: signal.Signals) -> None:
    """A signal ignored when the service starts stays ignored, as Python
    keeps SIGINT: SIGHUP under ``nohup`` (the service outlives its
    terminal), SIGINT in a shell's background job (a Ctrl-C is for the
    foreground job; it was caught whatever its disposition).  SIGTERM
    stops it as ever."""
    (tmp_path / "slow_wire.py").write_text(WIRE)
    gate = tmp_path / "gate"
    gate.touch()
    p = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "serve", str(tmp_path / "slow_wire.py:wire"),
         "--listen", str(tmp_path / "feed.sock")],
        env={**ENV, "GATE": str(gate)}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(ignored, signal.SIG_IGN),  # what nohup, or a shell's &, does
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "wiring"
        assert "listening on" in p.stdout.readline()
        p.send_signal(ignored)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait(10)
    assert p.returncode == 0, (p.returncode, out, err)
    assert "blobfeed serve: stopped (SIGTERM)" in out, out
    assert not (tmp_path / "feed.sock").exists()
