"""Edges of stop(), join() and error delivery that a review of the hardening
found; each test failed on the code before its fix.

Every wait is bounded; scenarios that could hang run in a subprocess.
"""

from __future__ import annotations

import compileall
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfInput, FetcherError, GlobalCoordinator, Net, init_data_input_workers, init_workers

from .test_hardening import SIGNAL_CHILD, blobfeed_threads, chunk, last_json

WAIT = 5.0
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def gc() -> Iterator[GlobalCoordinator]:
    coordinator = GlobalCoordinator(log_interval=0.05)
    try:
        yield coordinator
    finally:
        coordinator.stop(timeout=WAIT)


def sample(gc: GlobalCoordinator, name: str, **labels: str) -> float | None:
    return gc.registry.get_sample_value(name, labels)


def test_signal_safe_stop_holds_in_a_pyc_only_install(tmp_path: Path) -> None:
    """Trap: blobfeed frames were recognised by file name, which differs from
    ``co_filename`` when only .pyc files are installed (compiled elsewhere)
    or the app is frozen: the signal-handler stop() deadlocked again."""
    dst = tmp_path / "site" / "blobfeed"
    shutil.copytree(REPO / "blobfeed", dst)
    assert compileall.compile_dir(str(dst), quiet=1, legacy=True, ddir="/build/elsewhere/blobfeed")
    for py in dst.rglob("*.py"):
        py.unlink()
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SIGNAL_CHILD), "stop", "4"],
        capture_output=True, text=True, timeout=40, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    got = last_json(proc)
    assert got["file"].startswith(str(tmp_path)), got["file"]
    assert all(r["end"] == "EndOfInput" and r["final_stop"] for r in got["rounds"]), got["rounds"]


def test_a_slow_shutdown_fun_does_not_hold_up_stop(gc: GlobalCoordinator) -> None:
    """Trap: shutdown_fun (user code) ran inside stop(): stop(timeout=1) took
    as long as it did, and returned True."""
    release = threading.Event()
    init_workers(lambda wid: release.wait(0.01), 1, "gen", shutdown_fun=lambda: release.wait(20), coordinator=gc)
    gc.start()
    t0 = time.monotonic()
    ok = gc.stop(timeout=0.5)
    took = time.monotonic() - t0
    assert ok is False and took < 1.5, (ok, took)
    assert "blobfeed-shutdown-gen" in blobfeed_threads()
    release.set()
    assert gc.stop(timeout=WAIT) is True
    assert blobfeed_threads() == []


def test_infinite_timeouts_wait_without_overflow(gc: GlobalCoordinator) -> None:
    """Trap: stop(timeout=inf) and join(timeout=inf) were accepted, then
    overflowed inside Thread.join halfway through the stop."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)
    gc.request_stop()
    assert gc.join(timeout=float("inf")) is True
    assert gc.stop(timeout=float("inf")) is True
    assert blobfeed_threads() == []


def test_inputs_per_second_is_zero_after_a_stop_cut_short() -> None:
    """Trap: after stop() returned False (a stuck fetcher), the monitor was
    gone and inputs_per_second kept its last value for ever.  (The default
    log interval: the monitor ticks once a second, so it cannot have set
    the rate to 0 during this test's short stop.)"""
    gc = GlobalCoordinator()
    stuck = threading.Event()

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        if blobfeed.get_worker_info().index == 1:
            stuck.wait(20)
            raise StopIteration
        stuck.wait(0.001)
        return chunk()

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=2, input_source_name="r", coordinator=gc)
    gc.start()
    tick = threading.Event()
    deadline = time.monotonic() + WAIT
    while (sample(gc, "blobfeed_inputs_per_second", source="r") or 0) <= 0 and time.monotonic() < deadline:
        net.run(timeout=WAIT)
        tick.wait(0.01)
    assert (sample(gc, "blobfeed_inputs_per_second", source="r") or 0) > 0
    try:
        assert gc.stop(timeout=0.02) is False
        assert (sample(gc, "blobfeed_inputs_per_second", source="r") or 0) == 0
    finally:
        stuck.set()
        gc.stop(timeout=WAIT)


def test_an_enqueuer_crash_reaches_a_run_waiting_on_another_source(
    gc: GlobalCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trap: an enqueuer that crashed (a MemoryError, a device error) closed
    its own queue only: a run() waiting on the net's other, starved source
    waited out its timeout, and should_stop()/join() never heard of it."""
    from blobfeed.feeders import Feed

    real = Feed._assemble

    def crashing(self: Feed, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("blobfeed-enqueue-A-"):
            raise MemoryError("planted: no memory for a batch")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Feed, "_assemble", crashing)
    never = threading.Event()
    net = Net(name="n")
    init_data_input_workers(net, ["b"], lambda w, bs: (never.wait(20), chunk())[1], 4,
                            input_source_name="B", num_worker_threads=1, coordinator=gc)
    init_data_input_workers(net, ["a"], lambda w, bs: chunk(), 4,
                            input_source_name="A", num_worker_threads=1, coordinator=gc)
    gc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(FetcherError, match="enqueuer") as info:
            net.run(timeout=20)
        assert time.monotonic() - t0 < 2.0
        assert isinstance(info.value.__cause__, MemoryError)
        assert gc.should_stop() is True
    finally:
        never.set()


def test_stop_coordinator_from_an_init_fun_is_carried_out(gc: GlobalCoordinator) -> None:
    """Trap: stop_coordinator() called from inside blobfeed before the first
    start() had no stopper thread to post to: the request was dropped."""
    net = Net(name="n")

    def init_fun(data_coordinator: Any, global_coordinator: GlobalCoordinator) -> None:
        assert global_coordinator.stop_coordinator("train", timeout=0.1) is False

    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, init_fun=init_fun, coordinator=gc)
    gc.start()
    t0 = time.monotonic()
    with pytest.raises(EndOfInput):
        for _ in range(100_000):
            net.run(timeout=WAIT)
    assert time.monotonic() - t0 < 2.0


class _BlockingHandler(logging.Handler):
    def __init__(self, release: threading.Event) -> None:
        super().__init__(logging.INFO)
        self.gate = release
        self.entered = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "drop_last" in record.getMessage():
            self.entered.set()
            self.gate.wait(10)


def test_a_slow_log_handler_does_not_hold_up_run_or_stop(gc: GlobalCoordinator) -> None:
    """Trap: the enqueuer logged while holding the feed's lock: a slow log
    handler made run(timeout=0.5) and stop(timeout=0.5) wait for it."""
    release = threading.Event()
    handler = _BlockingHandler(release)
    log = logging.getLogger("blobfeed.feeders")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    counts = {0: 0}

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        if counts[0] >= 3:
            raise StopIteration
        counts[0] += 1
        return chunk(3)

    try:
        net = Net(name="n")
        init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, drop_last=True, coordinator=gc)
        gc.start()
        net.run(timeout=WAIT)  # 9 samples: two batches of 4, then 1 dropped
        net.run(timeout=WAIT)
        assert handler.entered.wait(WAIT)
        t0 = time.monotonic()
        with pytest.raises((blobfeed.DequeueTimeout, EndOfInput)):
            net.run(timeout=0.5)
        assert time.monotonic() - t0 < 1.5
        t0 = time.monotonic()
        assert gc.stop(timeout=0.5) is False  # the enqueuer is inside the handler
        assert time.monotonic() - t0 < 1.5
    finally:
        release.set()
        log.removeHandler(handler)
        log.setLevel(old_level)


def test_stop_during_a_slow_init_fun(gc: GlobalCoordinator) -> None:
    """Trap: stop() while start() ran a slow init_fun returned True; start()
    then reset should_stop() and left the monitor and stopper running."""
    entered, release = threading.Event(), threading.Event()

    def init_fun(*_: Any) -> None:
        entered.set()
        release.wait(WAIT)

    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, init_fun=init_fun, coordinator=gc)
    starter = threading.Thread(target=gc.start, name="test-start")
    starter.start()
    assert entered.wait(WAIT)
    assert gc.stop(timeout=WAIT) is True
    release.set()
    starter.join(WAIT)
    assert not starter.is_alive()
    assert gc.should_stop() is True
    assert blobfeed_threads() == []


def test_ctrl_c_at_the_end_of_stop_does_not_orphan_the_stopper(
    gc: GlobalCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trap: a second Ctrl-C after stop() forgot its helper threads but
    before it ended them: every later stop() returned True while the stopper
    ran for ever."""
    from blobfeed import coordinator as coord_mod

    real_close = coord_mod._Stopper.close
    fired = []

    def interrupted(self: Any) -> None:
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        real_close(self)

    monkeypatch.setattr(coord_mod._Stopper, "close", interrupted)
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)
    with pytest.raises(KeyboardInterrupt):
        gc.stop(timeout=WAIT)
    assert fired
    assert gc.stop(timeout=WAIT) is True
    assert blobfeed_threads() == []


FORK_REWIRE_CHILD = """
    import json, os, time
    import numpy as np
    import blobfeed
    from blobfeed import Net, init_data_input_workers

    gc = blobfeed.global_coordinator
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [np.ones((4, 2), np.float32)], 4)
    gc.start()
    net.run(timeout=5)
    pid = os.fork()
    if pid == 0:
        out = {}
        try:
            net.run(timeout=1)
        except blobfeed.BlobfeedError as exc:
            out["inherited"] = type(exc).__name__
        init_data_input_workers(net, ["x"], lambda w, b: [np.full((4, 2), 7, np.float32)], 4)
        gc.start()
        out["value"] = float(net.run(timeout=5)["x"][0, 0])
        out["stop"] = gc.stop(timeout=5)
        print(json.dumps(out), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"parent_stop": gc.stop(timeout=5), "child_rc": os.waitstatus_to_exitcode(status)}))
"""


def test_a_forked_child_can_rewire_the_net_it_inherited() -> None:
    """Trap: in a forked child the inherited net refused to run (right) but
    could not be re-wired either: its old source was never marked ended."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(FORK_REWIRE_CHILD)],
                          capture_output=True, text=True, timeout=40)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    child = next(ln for ln in lines if "value" in ln)
    parent = next(ln for ln in lines if "parent_stop" in ln)
    assert child == {"inherited": "BlobfeedError", "value": 7.0, "stop": True}, child
    assert parent == {"parent_stop": True, "child_rc": 0}, parent


def test_end_of_input_inside_stop_on_exception_is_a_clean_stop(gc: GlobalCoordinator) -> None:
    """Trap: the normal end of the input inside stop_on_exception() made
    join() raise EndOfInput; TF treats the end of input as a clean stop."""
    left = {0: 3}

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        if left[0] == 0:
            raise StopIteration
        left[0] -= 1
        return chunk()

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    with pytest.raises(EndOfInput), gc.stop_on_exception():
        while True:
            net.run(timeout=WAIT)
    assert gc.should_stop() is True
    assert gc.join(timeout=WAIT) is True


def test_a_generic_worker_that_raises_reaches_join(gc: GlobalCoordinator) -> None:
    """Trap: a worker_fun that raised stopped its coordinator but neither
    should_stop() nor join() heard of it."""

    def worker(worker_id: int) -> None:
        raise ValueError("planted", worker_id)

    init_workers(worker, 1, "gen", coordinator=gc)
    gc.start()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="planted"):
        gc.join(timeout=WAIT)
    assert time.monotonic() - t0 < 2.0


def test_join_from_a_fetcher_does_not_wait_for_itself(gc: GlobalCoordinator) -> None:
    """Trap: join() called in a fetch_fun waited, possibly for ever, for the
    very thread it ran in."""
    results: list[bool] = []

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        if not results:
            results.append(gc.join(timeout=None))
        return chunk()

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    with pytest.raises(EndOfInput):
        for _ in range(100_000):
            net.run(timeout=WAIT)
    assert results == [False]


def test_batch_columns_from_a_numpy_array(gc: GlobalCoordinator) -> None:
    """Trap: batch axes computed with numpy (an array) were refused."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [np.zeros((2, 5), np.float32)], 5,
                            batch_columns=np.array([1]), coordinator=gc)
    gc.start()
    assert net.run(timeout=WAIT)["x"].shape == (2, 5)


def test_a_net_wired_later_to_a_shared_source_is_checked(gc: GlobalCoordinator) -> None:
    """Trap: workers that had passed their first chunk never checked a chunk
    against the model of a net wired to their source afterwards."""
    pytest.importorskip("onnx")
    from blobfeed.apps.models import mlp_onnx

    model, _ = mlp_onnx([3, 4, 2], input_name="x")   # float32 input "x" [N, 3]
    plain = Net(name="plain")
    init_data_input_workers(plain, ["x"], lambda w, b: [np.zeros((4, 3), np.float64)], 4,
                            num_worker_threads=1, input_source_name="s", coordinator=gc)
    gc.start()
    plain.run(timeout=WAIT)
    modelled = Net(model, name="modelled")

    def no_data(worker_id: int, batch_size: int) -> list[np.ndarray]:
        raise StopIteration  # only the first call's worker feeds the source

    init_data_input_workers(modelled, ["x"], no_data, 4,
                            num_worker_threads=1, input_source_name="s", coordinator=gc)
    gc.start()
    with pytest.raises(blobfeed.ChunkError, match="float64"):
        for _ in range(10_000):
            modelled.run(timeout=WAIT)
