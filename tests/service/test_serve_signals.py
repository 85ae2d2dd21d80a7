"""`blobfeed serve` and the signals an operator or a supervisor sends: at any
moment of its life, a SIGTERM or SIGINT (or SIGHUP, a closed terminal) is a
clean stop: the state saved, the socket removed, one "stopped" line, no
traceback, and an exit status that says how it went."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

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
    """SIGINT, then SIGTERM while the first stop runs: one stop, to its end,
    with its status and its line (the second signal used to find the
    default handler back, and kill the process with -15)."""
    p, sock, gate = _serve(tmp_path)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "wiring"
        gate.touch()
        assert "listening on" in p.stdout.readline()
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait(10)
    assert p.returncode == 0, (p.returncode, out, err)
    assert "blobfeed serve: stopped (SIGINT)" in out, out
    assert "Traceback" not in err, err
    assert not sock.exists()


def test_under_nohup_a_hangup_does_not_stop_the_service(tmp_path: Path) -> None:
    """SIGHUP ignored when the service starts (``nohup``) stays ignored: the
    service outlives its terminal, and stops at a SIGTERM as ever."""
    (tmp_path / "slow_wire.py").write_text(WIRE)
    gate = tmp_path / "gate"
    gate.touch()
    p = subprocess.Popen(
        ["nohup", sys.executable, "-m", "blobfeed.apps.cli", "serve", str(tmp_path / "slow_wire.py:wire"),
         "--listen", str(tmp_path / "feed.sock")],
        env={**ENV, "GATE": str(gate)}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "wiring"
        assert "listening on" in p.stdout.readline()
        p.send_signal(signal.SIGHUP)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait(10)
    assert p.returncode == 0, (p.returncode, out, err)
    assert "blobfeed serve: stopped (SIGTERM)" in out, out
