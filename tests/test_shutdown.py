"""stop() from every blocked state, stuck fetchers, generic workers, exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfInput, Net, init_data_input_workers, init_workers

from .helpers import WAIT, sample, wait_until


def chunk(n: int = 4) -> list[np.ndarray]:
    return [np.zeros((n, 3), np.float32)]


def test_stop_with_fetchers_blocked_on_full_internal_queue(gc: blobfeed.GlobalCoordinator) -> None:
    net = Net(name="n")
    # tiny queues and a consumer that never runs: fetchers block on put,
    # the enqueuer blocks on the full device queue
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, num_worker_threads=3,
                            max_buffered_batches=2, device_queue_capacity=1, coordinator=gc)
    gc.start()
    wait_until(lambda: sample(gc, "blobfeed_internal_queue_depth", source="train") == 2
               and sample(gc, "blobfeed_device_queue_depth", source="train", net="n") == 1, "full queues")
    t0 = time.monotonic()
    assert gc.stop() is True
    assert time.monotonic() - t0 < 2.0
    assert sample(gc, "blobfeed_workers_alive", source="train") == 0
    with pytest.raises(EndOfInput):
        net.run(timeout=WAIT)


def test_stop_wakes_a_net_blocked_in_run(gc: blobfeed.GlobalCoordinator) -> None:
    release = threading.Event()
    entered = threading.Event()

    def fetch(w: int, b: int) -> list[np.ndarray]:
        entered.set()
        release.wait(WAIT)
        raise StopIteration

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    got: dict[str, Any] = {}
    running = threading.Event()

    def consume() -> None:
        running.set()
        try:
            net.run()
        except BaseException as exc:
            got["exc"] = exc

    t = threading.Thread(target=consume)
    t.start()
    assert running.wait(WAIT) and entered.wait(WAIT)
    release.set()  # the fetcher ends, but its StopIteration races with stop(); either way run() must end
    t0 = time.monotonic()
    assert gc.stop() is True
    t.join(WAIT)
    assert not t.is_alive() and time.monotonic() - t0 < 2.0
    assert isinstance(got["exc"], EndOfInput)


def test_after_stop_queued_batches_are_discarded(gc: blobfeed.GlobalCoordinator) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    wait_until(lambda: sample(gc, "blobfeed_device_queue_depth", source="train", net="n") >= 1, "a queued batch")
    assert gc.stop()
    t0 = time.monotonic()
    with pytest.raises(EndOfInput, match="stopped"):
        net.run(timeout=WAIT)
    assert time.monotonic() - t0 < 0.1
    fetched = sample(gc, "blobfeed_fetched_samples_total", source="train")
    dropped = sample(gc, "blobfeed_dropped_samples_total", source="train", reason="stopped")
    delivered = sample(gc, "blobfeed_delivered_samples_total", source="train", net="n")
    assert delivered == 0 and fetched == dropped > 0, "every accepted sample is delivered or counted as dropped"


def test_stuck_fetcher_makes_stop_return_false_and_is_named(gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    entered = threading.Event()

    def fetch(w: int, b: int) -> list[np.ndarray]:
        entered.set()
        release.wait(30)  # stuck until the test lets go
        raise StopIteration

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, input_source_name="stuck", coordinator=gc)
    gc.start()
    assert entered.wait(WAIT)
    try:
        with caplog.at_level("ERROR", logger="blobfeed"):
            t0 = time.monotonic()
            assert gc.stop(timeout=0.3) is False
            assert 0.25 < time.monotonic() - t0 < 2.0
        assert "blobfeed-fetch-stuck-0" in caplog.text
    finally:
        release.set()


def test_a_stuck_thread_of_blobfeed_is_not_blamed_on_fetch_fun(
    gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """The stop log tells stuck threads that run user code (a fetcher) from
    blobfeed's own (a receiver): the latter is reported as blobfeed's bug,
    never as "a fetch_fun that never returns".  A stand-in group reports
    one of each as still running."""

    class StuckGroup:
        name = "src"
        source = None

        def _request_stop(self) -> None: ...
        def _shutdown(self) -> None: ...
        def _call_loggers(self, final: bool = False) -> None: ...
        def _join(self, deadline: float | None) -> list[str]:
            return ["blobfeed-fetch-src-0", "blobfeed-recv-src-1"]

        def _alive(self) -> list[str]:
            return self._join(None)

    with caplog.at_level("ERROR", logger="blobfeed"):
        assert gc._stop_coordinators([StuckGroup()], 0.01) is False  # type: ignore[list-item]
    users = [r.getMessage() for r in caplog.records if "blobfeed-fetch-src-0" in r.getMessage()]
    ours = [r.getMessage() for r in caplog.records if "blobfeed-recv-src-1" in r.getMessage()]
    assert users and all("fetch_fun" in m for m in users), caplog.text
    assert ours and all("fetch_fun" not in m and "blobfeed's own" in m for m in ours), caplog.text


def test_stop_coordinator_stops_only_that_name(gc: blobfeed.GlobalCoordinator) -> None:
    a, b = Net(name="a"), Net(name="b")
    init_data_input_workers(a, ["x"], lambda w, b_: chunk(), 4, input_source_name="sa", coordinator=gc)
    init_data_input_workers(b, ["x"], lambda w, b_: chunk(), 4, input_source_name="sb", coordinator=gc)
    gc.start()
    assert gc.stop_coordinator("sa") is True
    with pytest.raises(EndOfInput):
        a.run(timeout=WAIT)
    assert b.run(timeout=WAIT)["x"].shape == (4, 3)
    assert gc.get_worker_ids() == [0, 1, 2, 3]  # allocated ids stay listed, as in Caffe2
    assert gc.stop_coordinator("nothing-by-that-name") is True


def test_coordinator_is_reusable_and_a_context_manager() -> None:
    with blobfeed.GlobalCoordinator() as gc:
        for cycle in range(3):
            net = Net(name="n")
            init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, coordinator=gc)
            gc.start()
            assert net.run(timeout=WAIT)["x"].shape == (4, 3)
            assert gc.stop() is True
        # counters keep counting across restarts of a source
        assert sample(gc, "blobfeed_delivered_samples_total", source="train", net="n") == 12
        net = Net(name="n")
        init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, coordinator=gc)
        gc.start()
    with pytest.raises(EndOfInput):
        net.run(timeout=WAIT)  # __exit__ stopped it


def test_generic_workers_loop_and_shutdown_fun(gc: blobfeed.GlobalCoordinator) -> None:
    counts: dict[int, int] = {}
    lock = threading.Lock()
    enough = threading.Event()
    shutdowns: list[int] = []
    inits: list[Any] = []

    def work(worker_id: int) -> None:
        with lock:
            counts[worker_id] = counts.get(worker_id, 0) + 1
            if sum(counts.values()) >= 50:
                enough.set()
        time.sleep(0.0005)

    init_workers(work, num_worker_threads=2, worker_name="gen", init_fun=lambda c, g: inits.append((c.name, g)),
                 shutdown_fun=lambda: shutdowns.append(1), coordinator=gc)
    assert not counts
    gc.start()
    assert enough.wait(WAIT)
    assert inits == [("gen", gc)]
    assert gc.stop() is True
    assert set(counts) == {0, 1} and shutdowns == [1]
    assert gc.stop() is True and shutdowns == [1], "stop() is idempotent"


def test_generic_worker_that_raises_stops_its_coordinator(gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture) -> None:
    shut = threading.Event()

    def work(worker_id: int) -> None:
        raise RuntimeError("worker exploded")

    sibling_release = threading.Event()
    sibling_calls: list[int] = []

    def sibling(worker_id: int) -> None:
        # the failed coordinator's other worker: busy until released
        sibling_calls.append(worker_id)
        sibling_release.wait(WAIT)

    other = threading.Event()
    gen = init_workers(work, num_worker_threads=1, worker_name="bad", shutdown_fun=shut.set, coordinator=gc)
    init_workers(sibling, num_worker_threads=1, worker_name="bad", coordinator=gc)
    init_workers(lambda w: other.set() or time.sleep(0.001), num_worker_threads=1, worker_name="good", coordinator=gc)
    with caplog.at_level("ERROR", logger="blobfeed"):
        gc.start()
        assert shut.wait(WAIT), "shutdown_fun of the failed coordinator was not called"
    assert "worker exploded" in caplog.text and "Traceback" in caplog.text
    assert other.wait(WAIT), "the other coordinator must keep running"
    bad = [c for c in gen._coordinators if c.name == "bad"]
    assert not bad[0].is_active
    # stop() still joins every thread, including those of the failed coordinator
    wait_until(lambda: sibling_calls, "the sibling worker to be busy")
    threading.Timer(0.1, sibling_release.set).start()
    t0 = time.monotonic()
    assert gc.stop() is True
    assert time.monotonic() - t0 >= 0.05, "stop() returned before the busy worker ended"


def run_script(code: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout,
    )


def test_program_that_never_calls_stop_exits_at_once() -> None:
    proc = run_script("""
        import time, numpy as np, blobfeed
        net = blobfeed.Net(name="n")
        blobfeed.init_data_input_workers(net, ["x"], lambda w, b: [np.zeros((4, 2))], 4, max_buffered_batches=2)
        blobfeed.global_coordinator.start()
        net.run(timeout=5)
        print("done", time.monotonic(), flush=True)
    """)
    end = time.monotonic()
    assert proc.returncode == 0, proc.stderr
    printed = float(proc.stdout.split()[1])
    assert end - printed < 1.0, "the interpreter lingered after the script ended"


def test_stuck_fetcher_does_not_keep_the_interpreter_alive() -> None:
    t0 = time.monotonic()
    proc = run_script("""
        import threading, time, numpy as np, blobfeed
        entered = threading.Event()
        def fetch(w, b):
            entered.set()
            threading.Event().wait()  # stuck forever
        net = blobfeed.Net(name="n")
        blobfeed.init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1)
        blobfeed.global_coordinator.start()
        entered.wait(5)
        print("leaving", time.monotonic(), flush=True)
    """)
    end = time.monotonic()
    assert proc.returncode == 0, proc.stderr
    assert end - float(proc.stdout.split()[1]) < 1.5
