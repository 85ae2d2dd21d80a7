"""Regression tests for the traps users of TF's Coordinator, of PyTorch's
DataLoader and of Caffe2's data_workers fall into (docs/CONTRACT.md, and
the stop()/exit guarantees it builds on).

Each test names the trap it guards.  Scenarios that hang on a broken
implementation run in a subprocess with a timeout, so a hang is a failed
test, never a stuck suite.  Every wait is bounded.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
import pytest

import blobfeed
from blobfeed import (
    BlobfeedError,
    ChunkError,
    EndOfInput,
    FetcherError,
    GlobalCoordinator,
    Net,
    init_data_input_workers,
)

from .helpers import WAIT, ChunkPlan, sample, wait_until


# -- fixtures and small helpers (the rest are at the bottom) --------------------------------


@pytest.fixture
def gc60() -> Iterator[GlobalCoordinator]:
    """An isolated coordinator with the default log interval (60 s)."""
    coordinator = GlobalCoordinator()
    try:
        yield coordinator
    finally:
        assert coordinator.stop(timeout=WAIT), "a thread outlived stop()"


def chunk(n: int = 4, d: int = 3) -> list[np.ndarray]:
    return [np.zeros((n, d), np.float32)]


def blobfeed_threads(prefix: str = "blobfeed-") -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive())


# =============================================================================================
# 1. stop() / request_stop() from a signal handler while the main thread is inside run()
# =============================================================================================

SIGNAL_CHILD = """
    import faulthandler, json, signal, sys, time
    import numpy as np
    import blobfeed
    from blobfeed import EndOfInput, GlobalCoordinator, Net, init_data_input_workers

    faulthandler.dump_traceback_later(10, exit=True)   # a deadlock shows its stacks, then fails
    mode, rounds = sys.argv[1], int(sys.argv[2])
    out = {"file": blobfeed.__file__, "rounds": []}

    def w1_fetch_for(rng):
        def fetch(worker_id, batch_size):      # W1: n ~ U[1, 64] rows of float64 (n, 3) + labels
            n = int(rng.integers(1, 65))
            x = np.arange(n * 3, dtype=np.float64).reshape(n, 3) + worker_id
            return [x, x[:, 0].copy()]
        return fetch

    for r in range(rounds):
        gc = GlobalCoordinator()
        net = Net(name="n")
        init_data_input_workers(net, ["data", "label"], w1_fetch_for(np.random.default_rng(r)), 32,
                                num_worker_threads=2, coordinator=gc)
        gc.start()
        state = {}

        def handler(signum, frame, gc=gc, state=state):
            if state:
                return          # act on the first signal only; later ones are no-ops
            state["fired"] = True
            t0 = time.monotonic()
            if mode == "stop":
                state["result"] = gc.stop(timeout=0.5)
            else:
                state["result"] = gc.request_stop()
            state["took"] = time.monotonic() - t0

        signal.signal(signal.SIGALRM, handler)
        for _ in range(200):
            net.run(timeout=10)
        signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)   # fire every ms while run() loops
        runs = 0
        try:
            while runs < 2_000_000:
                net.run(timeout=10)
                runs += 1
            end = "still running"
        except EndOfInput:
            end = "EndOfInput"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        rec = {"end": end, "runs": runs, "fired": state.get("fired", False), "took": state.get("took")}
        if mode == "request_stop":
            t0 = time.monotonic()
            rec["join"] = gc.join(timeout=5)
            rec["join_s"] = time.monotonic() - t0
        rec["final_stop"] = gc.stop(timeout=5)
        out["rounds"].append(rec)
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("mode", ["stop", "request_stop"])
def test_stop_from_a_signal_handler_during_run_does_not_deadlock(mode: str) -> None:
    """Trap: a SIGALRM/SIGTERM handler that calls stop() (or TF-style
    request_stop()) lands while the main thread is inside run() holding a
    blobfeed lock; a non-reentrant lock then deadlocks the process.  The loop
    must end with EndOfInput, request_stop() must return at once, join() is
    True, and the process exits 0.  Eight rounds: one interrupted round in
    two deadlocked on the old code."""
    proc = run_child(SIGNAL_CHILD, args=(mode, "8"), timeout=20)
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    got = last_json(proc)
    for i, rec in enumerate(got["rounds"]):
        assert rec["fired"], f"round {i}: the signal never reached the handler: {rec}"
        assert rec["end"] == "EndOfInput", f"round {i}: {rec}"
        assert rec["final_stop"] is True, f"round {i}: {rec}"
        if mode == "request_stop":
            assert rec["took"] < 0.2, f"round {i}: request_stop() took {rec['took']:.3f} s in the handler"
            assert rec["join"] is True and rec["join_s"] < 5, f"round {i}: {rec}"


# =============================================================================================
# 2, 3. stop() must never report success while a fetcher is still stuck
# =============================================================================================


def stuck_pipeline(gc: GlobalCoordinator, source: str = "stuck") -> tuple[Net, threading.Event]:
    """One fetcher stuck inside fetch_fun until the returned Event is set."""
    release, entered = threading.Event(), threading.Event()

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        entered.set()
        release.wait(30)
        raise StopIteration

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, input_source_name=source, coordinator=gc)
    gc.start()
    assert entered.wait(WAIT)
    return net, release


def test_concurrent_stops_do_not_report_success_while_a_fetcher_is_stuck(gc: GlobalCoordinator) -> None:
    """Trap: two threads (a signal handler and a finally block, say) call
    stop() at once; the one that finds the coordinators already unlisted
    returned True at once although a fetcher was still stuck in fetch_fun."""
    net, release = stuck_pipeline(gc)
    barrier = threading.Barrier(2)
    results: dict[int, tuple[Any, list[str], float]] = {}

    def stopper(i: int) -> None:
        barrier.wait(WAIT)
        t0 = time.monotonic()
        ok = gc.stop(timeout=0.3)
        results[i] = (ok, blobfeed_threads("blobfeed-fetch-"), time.monotonic() - t0)

    threads = [threading.Thread(target=stopper, args=(i,), name=f"test-stopper-{i}") for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert not any(t.is_alive() for t in threads), "a stop(timeout=0.3) did not return"
        for i, (ok, alive, took) in results.items():
            assert alive, "test bug: the fetcher should still be stuck"
            assert ok is False, f"stop() #{i} returned {ok!r} after {took:.3f} s while {alive} was alive"
            assert took < 2.0
    finally:
        release.set()
    assert gc.stop(timeout=WAIT) is True


def test_repeated_stop_is_false_until_the_stuck_fetcher_ends(gc: GlobalCoordinator) -> None:
    """Trap: a retry loop `while not gc.stop(timeout=...)` ended at its second
    call (True) because the first call had unlisted everything, although the
    stuck fetcher had not ended; stop_coordinator(name) likewise."""
    net, release = stuck_pipeline(gc, "stuck")
    try:
        assert gc.stop(timeout=0.2) is False
        assert blobfeed_threads("blobfeed-fetch-"), "test bug: the fetcher should still be stuck"
        assert gc.stop(timeout=0.2) is False, "a second stop() must still see the stuck fetcher"
        assert gc.stop_coordinator("stuck", timeout=0.2) is False
    finally:
        release.set()
    assert gc.stop(timeout=WAIT) is True
    assert not blobfeed_threads("blobfeed-fetch-")


# =============================================================================================
# 4. A KeyboardInterrupt inside stop() must not orphan the pipeline
# =============================================================================================


def test_keyboard_interrupt_inside_stop_does_not_orphan_the_pipeline(
    gc: GlobalCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trap: Ctrl-C lands inside stop() after the coordinators were taken off
    its list but before they were told to stop; the next stop() found
    nothing to stop and returned True while every fetcher ran on."""
    from blobfeed import coordinator as coord_mod
    from blobfeed import feeders as feeders_mod

    kill = threading.Event()

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        if kill.is_set():
            raise StopIteration
        return chunk()

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=2, input_source_name="ki",
                            max_buffered_batches=2, device_queue_capacity=1, coordinator=gc)
    before = set(blobfeed_threads())
    gc.start()
    net.run(timeout=WAIT)

    # the seam: the per-coordinator stop request (or the source's stop it calls)
    seams = [(coord_mod.DataInputCoordinator, "_request_stop"), (feeders_mod.InputSource, "stop")]
    seams = [(cls, name) for cls, name in seams if hasattr(cls, name)]
    assert seams, "neither DataInputCoordinator._request_stop nor InputSource.stop exists: update this test's seam"
    fired: list[str] = []
    for cls, name in seams:
        original = getattr(cls, name)

        def interrupted(self: Any, *args: Any, _orig: Callable[..., Any] = original, _name: str = name, **kw: Any) -> Any:
            if not fired:
                fired.append(_name)
                raise KeyboardInterrupt
            return _orig(self, *args, **kw)

        monkeypatch.setattr(cls, name, interrupted)
    try:
        try:
            gc.stop(timeout=WAIT)
        except KeyboardInterrupt:
            pass
        assert fired, "the KeyboardInterrupt seam was never reached by stop()"
        assert gc.stop(timeout=WAIT) is True
        alive = sorted(set(blobfeed_threads()) - before)
        assert not alive, f"threads still running after a successful stop(): {alive}"
        with pytest.raises(EndOfInput):
            net.run(timeout=1)
    finally:
        monkeypatch.undo()
        kill.set()
        drain_quietly(net)  # only matters on a broken stop: lets orphaned threads end


# =============================================================================================
# 5. os.fork() while a feed runs
# =============================================================================================

FORK_CHILD = """
    import json, os, sys, threading, time
    import numpy as np
    import blobfeed
    from blobfeed import EndOfInput, GlobalCoordinator, Net, init_data_input_workers

    gc = GlobalCoordinator()
    net = Net(name="n")
    rng = np.random.default_rng(0)
    def fetch(worker_id, batch_size):
        return [np.zeros((int(rng.integers(1, 65)), 3), np.float32)]
    init_data_input_workers(net, ["x"], fetch, 32, num_worker_threads=2, coordinator=gc)
    gc.start()
    runs = [0]
    def consume():                     # data flowing: every blobfeed thread busy, locks taken
        try:
            while True:
                net.run(timeout=10)
                runs[0] += 1
        except EndOfInput:
            pass
    t = threading.Thread(target=consume, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while runs[0] < 200 and time.monotonic() < deadline:
        time.sleep(0.001)
    children = []
    for _ in range(5):
        pid = os.fork()
        if pid == 0:
            sys.exit(0)                # a normal exit: atexit hooks run in the child
        t0 = time.monotonic()
        status = None
        while time.monotonic() - t0 < 10:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
                break
            time.sleep(0.005)
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        children.append({"status": status, "s": round(time.monotonic() - t0, 3)})
        if status is None:
            break
    r0 = runs[0]
    while runs[0] < r0 + 50 and time.monotonic() < deadline + 10:
        time.sleep(0.001)
    flowing = runs[0] >= r0 + 50
    ok = gc.stop(timeout=5)
    t.join(5)
    print(json.dumps({"children": children, "parent_flowing": flowing, "stop": ok,
                      "consumer_ended": not t.is_alive()}), flush=True)
"""


def test_forked_child_exits_normally_while_the_parent_feeds() -> None:
    """Trap: os.fork() (multiprocessing's default start method on Linux)
    while fetchers hold blobfeed's locks; the child's atexit hook tried to
    stop the parent's pipeline and hung on a lock no thread will release."""
    proc = run_child(FORK_CHILD, timeout=45)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = last_json(proc)
    for i, child in enumerate(got["children"]):
        assert child["status"] == 0, f"fork #{i}: the child did not exit within 10 s: {got}"
    assert len(got["children"]) == 5
    assert got["parent_flowing"] and got["stop"] is True and got["consumer_ended"], got


# =============================================================================================
# 6. An external logger that blocks
# =============================================================================================


def test_blocking_external_logger_does_not_hold_up_stop(gc60: GlobalCoordinator) -> None:
    """Trap: an external logger whose log() blocks (a dead metrics server, a
    full pipe) made stop() block with it, whatever its timeout."""
    release, called = threading.Event(), threading.Event()

    class StuckLogger:
        def log(self, metrics: dict[str, Any]) -> None:
            called.set()
            release.wait(30)

    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, external_loggers=[StuckLogger()], coordinator=gc60)
    gc60.start()
    net.run(timeout=WAIT)
    result: list[Any] = []
    stopper = threading.Thread(target=lambda: result.append(gc60.stop(timeout=1)), name="test-stopper")
    try:
        t0 = time.monotonic()
        stopper.start()
        stopper.join(3)
        took = time.monotonic() - t0
        assert not stopper.is_alive(), "stop(timeout=1) was still blocked by the logger after 3 s"
        assert took < 2.0, f"stop(timeout=1) took {took:.2f} s"
        assert called.wait(2), "the logger's final call at stop never came"
    finally:
        release.set()
        stopper.join(WAIT)


NEVER_STOPS_WITH_STUCK_LOGGER = """
    import threading, time
    import numpy as np
    import blobfeed

    class StuckLogger:
        def log(self, metrics):
            threading.Event().wait()     # blocks forever

    net = blobfeed.Net(name="n")
    blobfeed.init_data_input_workers(net, ["x"], lambda w, b: [np.zeros((4, 2), np.float32)], 4,
                                     external_loggers=[StuckLogger()])
    blobfeed.global_coordinator.start()
    net.run(timeout=5)
    print("leaving", time.monotonic(), flush=True)
"""


def test_program_with_a_blocking_logger_that_never_calls_stop_exits() -> None:
    """Trap: the atexit hook's final logger call blocked forever, so a script
    that forgot stop() never exited."""
    proc = run_child(NEVER_STOPS_WITH_STUCK_LOGGER, timeout=20)
    end = time.monotonic()
    assert proc.returncode == 0, proc.stderr[-3000:]
    left = float(proc.stdout.split()[1])
    assert end - left < 10, f"the interpreter lingered {end - left:.1f} s after the script ended"


# =============================================================================================
# 7. stop() drops what the re-batcher holds without assembling it
# =============================================================================================


def test_stop_does_not_concatenate_the_pending_samples(gc: GlobalCoordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trap: stop() (or Ctrl-C) with a huge batch_size half filled assembled
    the pending samples into one big array just to throw it away: a copy of
    up to a whole batch, at the worst moment.  They are dropped and counted
    (dropped{reason="stopped"}) instead."""
    calls = {"n": 0}
    entered_idle = threading.Event()
    idle = threading.Event()  # never set: a bounded pause

    def fetch(worker_id: int, batch_size: int) -> Any:
        calls["n"] += 1
        if calls["n"] <= 3:
            return [np.full((100, 8), calls["n"], np.float32)]
        entered_idle.set()
        idle.wait(0.02)
        return None  # no more data for now

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 10_000, num_worker_threads=1, coordinator=gc)
    gc.start()
    assert entered_idle.wait(WAIT)
    wait_until(lambda: sample(gc, "blobfeed_fetched_samples_total", source="train") == 300
               and sample(gc, "blobfeed_internal_queue_depth", source="train") == 0,
               "the three chunks to reach the re-batcher")

    recorded: list[list[tuple[int, ...]]] = []
    recording = threading.Event()
    real_concatenate = np.concatenate

    def spy(arrays: Any, *args: Any, **kwargs: Any) -> Any:
        if recording.is_set():
            recorded.append([tuple(np.shape(a)) for a in arrays])
        return real_concatenate(arrays, *args, **kwargs)

    monkeypatch.setattr(np, "concatenate", spy)
    from blobfeed import feeders as feeders_mod
    monkeypatch.setattr(feeders_mod, "concatenate", spy, raising=False)
    recording.set()
    try:
        assert gc.stop(timeout=WAIT) is True
    finally:
        recording.clear()
    assert not recorded, f"stop() concatenated the pending samples: {recorded}"
    assert sample(gc, "blobfeed_dropped_samples_total", source="train", reason="stopped") == 300
    with pytest.raises(EndOfInput):
        net.run(timeout=1)


# =============================================================================================
# 8, 9. run() must not sit out its timeout when it cannot get data
# =============================================================================================


def test_failure_of_one_source_reaches_a_run_waiting_on_another(gc: GlobalCoordinator) -> None:
    """Trap: a net fed by two sources waits on the starved one (B) while the
    other (A) has failed; run() sat out its whole timeout instead of raising
    A's FetcherError within a second."""
    release = threading.Event()
    boom = RuntimeError("source A broke")
    calls = {"a": 0}

    def fetch_b(worker_id: int, batch_size: int) -> list[np.ndarray]:
        release.wait(30)  # starved until the test ends
        raise StopIteration

    def fetch_a(worker_id: int, batch_size: int) -> list[np.ndarray]:
        calls["a"] += 1
        if calls["a"] == 1:
            return [np.zeros((4, 2), np.float32)]
        raise boom

    net = Net(name="n")
    # B first: run() dequeues the sources in wiring order, so it waits on B
    init_data_input_workers(net, ["b"], fetch_b, 4, num_worker_threads=1, input_source_name="src_b", coordinator=gc)
    init_data_input_workers(net, ["a"], fetch_a, 4, num_worker_threads=1, input_source_name="src_a", coordinator=gc)
    gc.start()
    try:
        exc, took = run_bounded(net, timeout=20, bound=3)
        assert exc is not None, f"run() was still waiting after {took:.1f} s"
        assert isinstance(exc, FetcherError), repr(exc)
        assert took < 2.0, f"the FetcherError came after {took:.2f} s"
        assert exc.__cause__ is boom
        assert "src_a" in str(exc)
    finally:
        release.set()


def test_run_before_start_raises_at_once(gc: GlobalCoordinator) -> None:
    """Trap: forgetting start(); run() waited out its whole timeout (600 s by
    default) and then blamed the data with DequeueTimeout."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, coordinator=gc)
    exc, took = run_bounded(net, timeout=30, bound=3)
    assert exc is not None, f"run() was still waiting after {took:.1f} s"
    assert isinstance(exc, BlobfeedError), repr(exc)
    assert took < 1.0, f"took {took:.2f} s"
    assert "start()" in str(exc), str(exc)


# =============================================================================================
# 10, 11, 12. Chunks against the model
# =============================================================================================


@pytest.fixture(scope="module")
def mlp() -> tuple[bytes, Any]:
    pytest.importorskip("onnx")
    from blobfeed.apps.models import mlp_onnx

    return mlp_onnx([4, 8, 3])  # input "data" float [N, 4], output "logits" float [N, 3]


def test_feeding_a_blob_named_like_a_model_output_is_refused(gc: GlobalCoordinator, mlp: tuple[bytes, Any]) -> None:
    """Trap: a fed blob named like a model output (say "logits" as the
    labels) is overwritten in the workspace by the model's output; the user
    then scores the model against itself."""
    net = Net(mlp[0], name="n")
    with pytest.raises(ValueError) as err:
        init_data_input_workers(net, ["data", "logits"], lambda w, b: chunk(4, 4) * 2, 4, coordinator=gc)
    msg = str(err.value)
    assert "logits" in msg and "output" in msg, msg


BAD_CHUNKS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "float64": lambda x: x.astype(np.float64),
    "rank": lambda x: x[:, :, None],
    "object": lambda x: x.astype(object),
}


def pad_worker_ids(gc: GlobalCoordinator, n: int) -> None:
    """Allocate ``n`` worker ids on a source that ends at once, so the next
    call's workers get distinctive ids."""

    def finished(worker_id: int, batch_size: int) -> list[np.ndarray]:
        raise StopIteration

    init_data_input_workers(Net(name="pad"), ["p"], finished, 4, num_worker_threads=n,
                            input_source_name="pad", coordinator=gc)


@pytest.mark.parametrize("kind", list(BAD_CHUNKS))
def test_chunk_not_matching_the_model_is_a_chunk_error(gc: GlobalCoordinator, mlp: tuple[bytes, Any], kind: str) -> None:
    """Trap: float64 data (numpy's default) into a float32 model, a missing
    or extra axis, or an object array reached onnxruntime, whose error names
    none of source, worker or blob, or never came at all."""
    pad_worker_ids(gc, 2)  # the fetcher below is worker 2
    x = np.ones((4, 4), np.float32)
    net = Net(mlp[0], name="n")
    init_data_input_workers(net, ["data"], lambda w, b: [BAD_CHUNKS[kind](x)], 4, num_worker_threads=1,
                            input_source_name="feats", coordinator=gc)
    gc.start()
    with pytest.raises(ChunkError) as err:
        net.run(timeout=WAIT)
    assert isinstance(err.value, BlobfeedError)
    msg = str(err.value)
    assert "feats" in msg and "data" in msg, msg
    assert re.search(r"worker\D{0,6}2\b", msg), f"the worker id 2 is not named: {msg}"
    if kind == "float64":
        assert "float64" in msg, msg
        assert re.search(r"float32|tensor\(float\)|\bfloat\b", msg), f"the model's type is not named: {msg}"


def test_on_error_skip_skips_chunks_not_matching_the_model(gc: GlobalCoordinator, mlp: tuple[bytes, Any]) -> None:
    """Trap: the first chunk of a source fixed its dtype, so one worker's bad
    float64 chunk made every good float32 chunk after it "invalid".  Chunks
    are checked against the model: the bad ones are skipped and counted, the
    good worker's data flows."""
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    kinds = list(BAD_CHUNKS)
    all_bad_done = threading.Event()
    count = {"done": 0}
    lock = threading.Lock()
    returned: dict[int, int] = {}

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        if worker_id < len(kinds):  # one bad chunk, then this worker is finished
            returned[worker_id] = returned.get(worker_id, 0) + 1
            if returned[worker_id] == 1:
                return [BAD_CHUNKS[kinds[worker_id]](x)]
            with lock:
                count["done"] += 1
                if count["done"] == len(kinds):
                    all_bad_done.set()
            raise StopIteration
        all_bad_done.wait(WAIT)  # the good worker starts after every bad chunk was judged
        return [x.copy()]

    net = Net(mlp[0], name="n")
    init_data_input_workers(net, ["data"], fetch, 4, num_worker_threads=len(kinds) + 1, on_error="skip",
                            max_buffered_batches=4, coordinator=gc)
    gc.start()
    assert all_bad_done.wait(WAIT)
    import onnxruntime as ort

    expected = ort.InferenceSession(mlp[0], providers=["CPUExecutionProvider"]).run(None, {"data": x})[0]
    for _ in range(3):
        out = net.run(timeout=2)["logits"]
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    wait_until(lambda: sample(gc, "blobfeed_fetch_errors_total", source="train", kind="invalid") == len(kinds),
               "the skipped chunks to be counted", timeout=2)


def test_big_endian_chunks_give_the_right_numbers(gc: GlobalCoordinator, mlp: tuple[bytes, Any]) -> None:
    """Trap: data read from a big-endian file ('>f4') passed to onnxruntime
    as raw bytes: outputs of 1e37, inf or nan, without an error."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    native = rng.standard_normal((5 * 8, 4)).astype(np.float32)
    it = iter(range(0, len(native), 8))

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        start = next(it)
        return [native[start:start + 8].astype(">f4")]

    net = Net(mlp[0], name="n")
    init_data_input_workers(net, ["data"], fetch, 8, num_worker_threads=1, coordinator=gc)
    gc.start()
    session = ort.InferenceSession(mlp[0], providers=["CPUExecutionProvider"])
    for i in range(5):
        out = net.run(timeout=WAIT)["logits"]
        assert np.isfinite(out).all(), f"batch {i}: {out}"
        expected = session.run(None, {"data": native[i * 8:(i + 1) * 8]})[0]
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6, err_msg=f"batch {i}")
    with pytest.raises(EndOfInput):
        net.run(timeout=WAIT)


def test_masked_array_chunks_are_refused(gc: GlobalCoordinator) -> None:
    """Trap: a np.ma.masked_array's mask cannot reach a model; its masked
    values would be fed as if they were data.  Refused with ChunkError."""
    data = np.arange(8, dtype=np.float32).reshape(4, 2)
    masked = np.ma.masked_array(data, mask=[[False, True]] * 4)
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [masked], 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    with pytest.raises(ChunkError):
        net.run(timeout=WAIT)


class _Sub(np.ndarray):
    """A user's ndarray subclass (as pandas, astropy or xarray carry)."""


def _as_recarray(a: np.ndarray) -> np.ndarray:
    return np.rec.fromarrays([a[:, 0], a[:, 1]], names="u,v")


def _as_subclass(a: np.ndarray) -> np.ndarray:
    return a.view(_Sub)


@pytest.mark.parametrize("make", [_as_recarray, _as_subclass], ids=["recarray", "subclass"])
def test_batches_of_subclass_chunks_are_plain_ndarrays(gc: GlobalCoordinator, make: Callable[[np.ndarray], np.ndarray]) -> None:
    """Trap: a batch inside one chunk was a view of the user's subclass (a
    recarray, a matrix-like class) and behaved differently from a batch
    spanning chunks; every batch is exactly numpy.ndarray."""
    base = np.arange(24, dtype=np.float32).reshape(12, 2)
    chunks = [make(base[:6]), make(base[6:])]
    pending = list(chunks)

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        if not pending:
            raise StopIteration
        return [pending.pop(0)]

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    plain = np.concatenate([np.asarray(c) for c in chunks]).view(np.ndarray)
    # batch 0 lies inside chunk 0, batch 1 spans both chunks, batch 2 lies inside chunk 1
    for i in range(3):
        batch = net.run(timeout=WAIT)["x"]
        assert type(batch) is np.ndarray, f"batch {i} is a {type(batch).__name__}"
        assert batch.tolist() == plain[i * 4:(i + 1) * 4].tolist(), f"batch {i}"
    with pytest.raises(EndOfInput):
        net.run(timeout=WAIT)


# =============================================================================================
# 13, 14, 15. Arguments: numpy integers, flags, timeouts
# =============================================================================================

NUMPY_ARGS = {
    "batch_size": dict(batch_size=np.int64(4)),
    "num_worker_threads": dict(num_worker_threads=np.int32(2)),
    "max_buffered_batches": dict(max_buffered_batches=np.int64(8)),
    "device_queue_capacity": dict(device_queue_capacity=np.int64(2)),
    "batch_columns": dict(batch_columns=[np.int64(0)]),
    "timeout": dict(timeout=np.float32(5)),
}


@pytest.mark.parametrize("arg", list(NUMPY_ARGS))
def test_numpy_numbers_are_accepted(gc: GlobalCoordinator, arg: str) -> None:
    """Trap: sizes computed with numpy (`len(x) // k`, `np.int64` from a
    config array) were refused with TypeError; any integral type works
    (operator.index), any real number for a timeout."""
    net = Net(name="n")
    kwargs: dict[str, Any] = {"batch_size": 4, **NUMPY_ARGS[arg]}
    init_data_input_workers(net, ["x"], lambda w, b: chunk(3, 2), num_worker_threads=kwargs.pop("num_worker_threads", 1),
                            coordinator=gc, **kwargs)
    gc.start()
    for _ in range(3):
        assert net.run(timeout=WAIT)["x"].shape == (4, 2)


def test_numpy_numbers_everywhere_at_once(gc: GlobalCoordinator) -> None:
    """The same, all together, plus reset_data_input and run(timeout)."""
    net = Net(name="n")
    kwargs: dict[str, Any] = {}
    for d in NUMPY_ARGS.values():
        kwargs.update(d)
    init_data_input_workers(net, ["x"], lambda w, b: chunk(3, 2), coordinator=gc, **kwargs)
    gc.start()
    assert net.run(timeout=np.float32(5))["x"].shape == (4, 2)
    gc.reset_data_input("train", net, np.int64(2))
    sizes = [net.run(timeout=np.float64(5))["x"].shape[0] for _ in range(12)]
    assert sizes[-1] == 2, sizes


@pytest.mark.parametrize("flag", ["drop_last", "dont_rebatch"])
def test_string_flags_are_refused(gc: GlobalCoordinator, flag: str) -> None:
    """Trap: a flag read from a config file or the command line as the
    string "False" is truthy, so it silently meant True."""
    with pytest.raises(TypeError):
        init_data_input_workers(Net(name="n"), ["x"], lambda w, b: chunk(), 4, coordinator=gc, **{flag: "False"})
    assert gc.get_worker_ids() == []


def test_run_timeout_is_validated(gc: GlobalCoordinator) -> None:
    """Trap: run(timeout=-1) (meaning "forever" elsewhere) or a timeout read
    as a string was accepted whenever a batch happened to be ready, and
    failed oddly otherwise."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)
    wait_until(lambda: sample(gc, "blobfeed_device_queue_depth", source="train", net="n") >= 1, "a queued batch")
    with pytest.raises(ValueError):
        net.run(timeout=-1)
    with pytest.raises(TypeError):
        net.run(timeout="5")  # type: ignore[arg-type]
    assert net.run(timeout=WAIT)["x"].shape == (4, 3)


@pytest.mark.parametrize("value, error", [(-1, ValueError), ("1", TypeError)], ids=["negative", "string"])
def test_stop_timeout_is_validated_before_anything_stops(gc: GlobalCoordinator, value: Any, error: type) -> None:
    """Trap: stop(timeout=-1) was taken as "don't wait", and stop("1") raised
    only after the pipeline had been half torn down.  A bad timeout is
    refused before anything stops."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)
    with pytest.raises(error):
        gc.stop(timeout=value)
    assert net.run(timeout=WAIT)["x"].shape == (4, 3), "a refused stop() must leave the pipeline running"
    assert gc.stop(timeout=WAIT) is True


# =============================================================================================
# 16, 17. Worker info; wiring a net twice
# =============================================================================================


def test_get_worker_info(gc: GlobalCoordinator) -> None:
    """Trap (DataLoader's get_worker_info): a fetch_fun shared by several
    init calls must know its position within its own call (to shard data)
    and get a per-worker seed and generator (not the same random stream in
    every worker)."""
    assert blobfeed.get_worker_info() is None
    infos: dict[int, Any] = {}
    lock = threading.Lock()
    all_seen = threading.Event()

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        info = blobfeed.get_worker_info()
        with lock:
            infos.setdefault(worker_id, info)
            if len(infos) == 4:
                all_seen.set()
        return chunk(2, 1)

    for source in ("first", "second"):
        init_data_input_workers(Net(name=f"n-{source}"), ["x"], fetch, 4, num_worker_threads=2,
                                input_source_name=source, max_buffered_batches=2, coordinator=gc)
    gc.start()
    assert all_seen.wait(WAIT)
    assert sorted(infos) == [0, 1, 2, 3]
    for wid, info in infos.items():
        assert info is not None, f"worker {wid}: get_worker_info() is None inside fetch_fun"
        assert info.worker_id == wid
        assert info.index == wid % 2, f"worker {wid}: index {info.index}"
        assert info.num_workers == 2
        assert info.source == ("first" if wid < 2 else "second")
        assert isinstance(info.seed, int) and not isinstance(info.seed, bool)
        assert isinstance(info.rng, np.random.Generator)
    assert len({info.seed for info in infos.values()}) == 4, "workers share a seed"
    with pytest.raises((AttributeError, TypeError)):
        infos[0].index = 7
    assert blobfeed.get_worker_info() is None


def test_rewiring_a_net_to_a_wired_source_says_how(gc: GlobalCoordinator) -> None:
    """Trap: the next epoch re-wires the same net to the same source name
    while the first wiring is still live; the refusal must say what to do
    (stop_coordinator(name) first)."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, input_source_name="epoch", coordinator=gc)
    gc.start()
    with pytest.raises(ValueError, match="stop_coordinator"):
        init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, input_source_name="epoch", coordinator=gc)


# =============================================================================================
# 18. inputs_per_second is live with the default log interval
# =============================================================================================


@pytest.mark.parametrize("ending", ["ended", "stopped"])
def test_inputs_per_second_is_live_with_the_default_log_interval(gc60: GlobalCoordinator, ending: str) -> None:
    """Trap: inputs_per_second was only computed once per log interval
    (60 s by default): a dashboard showed 0 for the first minute of a
    healthy run, and kept the last rate for ever after the source ended."""
    finish = threading.Event()
    pace = threading.Event()  # never set: a bounded pause between chunks

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        if finish.is_set():
            raise StopIteration
        pace.wait(0.001)
        return chunk(8, 2)

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 8, num_worker_threads=2, input_source_name="rate", coordinator=gc60)
    gc60.start()
    consumer = threading.Thread(target=drain_quietly, args=(net, 10_000_000), name="test-consumer")
    consumer.start()
    tick = threading.Event()  # never set: the polling delay
    try:
        rate = poll(lambda: sample(gc60, "blobfeed_inputs_per_second", source="rate"), lambda v: v > 0, 3.0, tick)
        assert rate > 0, "inputs_per_second still 0 after 3 s of data flowing"
        if ending == "ended":
            finish.set()
        else:
            assert gc60.stop_coordinator("rate", timeout=WAIT) is True
        rate = poll(lambda: sample(gc60, "blobfeed_inputs_per_second", source="rate"), lambda v: v == 0, 5.0, tick)
        assert rate == 0, f"inputs_per_second still {rate} 5 s after the source {ending}"
    finally:
        finish.set()
        gc60.stop(timeout=WAIT)
        consumer.join(WAIT)


# =============================================================================================
# 20. Logging: a NullHandler, never the "last resort" on stderr
# =============================================================================================

WARNING_CHILD = """
    import json, logging
    import numpy as np
    import blobfeed

    calls = [0]
    def fetch(worker_id, batch_size):
        calls[0] += 1
        return None if calls[0] == 1 else [np.zeros((4, 2), np.float32)]   # None: a logged warning

    gc = blobfeed.GlobalCoordinator()
    net = blobfeed.Net(name="n")
    blobfeed.init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    net.run(timeout=5)
    skipped = gc.registry.get_sample_value("blobfeed_fetch_errors_total", {"source": "train", "kind": "none"})
    ok = gc.stop(timeout=5)
    handlers = logging.getLogger("blobfeed").handlers
    print(json.dumps({"skipped": skipped, "stop": ok, "root_handlers": len(logging.getLogger().handlers),
                      "null_handler": any(isinstance(h, logging.NullHandler) for h in handlers)}), flush=True)
"""


def test_library_warnings_do_not_reach_stderr_without_logging_config() -> None:
    """Trap: a library without a NullHandler has its warnings printed by
    logging's "last resort" handler to stderr of a program that never
    configured logging (and a CLI's stderr is not blobfeed's to write)."""
    proc = run_child(WARNING_CHILD, timeout=20)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = last_json(proc)
    assert got["skipped"] == 1 and got["stop"] is True and got["root_handlers"] == 0, got
    assert got["null_handler"], "the 'blobfeed' logger has no logging.NullHandler"
    # The one thing on stderr: the first None's BlobfeedWarning, said once
    # through the warnings module on purpose (a fetch_fun returning None at
    # the end of its data otherwise waits out the timeout without a word);
    # the program's warning filters rule it, not logging's last resort.
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and "BlobfeedWarning: source 'train', worker 0: fetch_fun returned None" in lines[0], (
        f"blobfeed wrote to stderr:\n{proc.stderr[-2000:]}"
    )


# =============================================================================================
# 23. TF Coordinator and DataLoader idioms
# =============================================================================================


def test_net_is_iterable_until_end_of_input(gc: GlobalCoordinator) -> None:
    """Trap (DataLoader's `for batch in loader`): iterating a Net; it yields
    one output dict per batch, stops at EndOfInput, and loses no sample.
    Its input and output names are the model's, public."""
    pytest.importorskip("onnx")
    from blobfeed.apps.models import mlp_onnx

    model, _ = mlp_onnx([2, 3], input_name="feat")
    plan = ChunkPlan({0: [5, 7, 3], 1: [4, 9]})
    net = Net(model, name="n")
    assert list(net.input_names) == ["feat"] and list(net.output_names) == ["logits"]
    init_data_input_workers(net, ["ids", "feat"], plan, 8, num_worker_threads=2, timeout=WAIT, coordinator=gc)
    gc.start()
    seen, batches = 0, 0
    for outputs in net:
        assert set(outputs) == set(net.output_names)
        seen += outputs["logits"].shape[0]
        batches += 1
        assert batches <= 10, "iteration did not stop"
    assert seen == plan.total == 28 and batches == 4


def test_request_stop_should_stop_and_join_reraise(gc: GlobalCoordinator) -> None:
    """Trap (TF Coordinator): request_stop(exc) returns at once, should_stop()
    turns True, join() waits for the threads and re-raises exc."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)
    assert gc.should_stop() is False
    exc = RuntimeError("the training loop gave up")
    t0 = time.monotonic()
    gc.request_stop(exc)
    assert time.monotonic() - t0 < 0.2, "request_stop() must not join"
    assert gc.should_stop() is True
    with pytest.raises(RuntimeError) as err:
        gc.join(timeout=5)
    assert err.value is exc
    assert not blobfeed_threads("blobfeed-fetch-") and not blobfeed_threads("blobfeed-enqueue-"), \
        "join() re-raised before the threads ended"
    with pytest.raises(EndOfInput):
        net.run(timeout=1)


def test_fetcher_error_sets_should_stop_and_join_reraises_it(gc: GlobalCoordinator) -> None:
    """Trap (TF Coordinator): a worker's exception must request a stop
    (should_stop() True) and be re-raised by join(), not only by run()."""
    boom = RuntimeError("disk gone")

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        raise boom

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    with pytest.raises(FetcherError):
        net.run(timeout=WAIT)
    assert gc.should_stop() is True
    with pytest.raises(FetcherError) as err:
        gc.join(timeout=5)
    assert err.value.__cause__ is boom


def test_stop_on_exception_requests_a_stop_and_does_not_swallow(gc: GlobalCoordinator) -> None:
    """Trap (TF Coordinator.stop_on_exception): an exception inside it must
    request a stop with that exception, propagate, and come back from join()."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: chunk(), 4, coordinator=gc)
    gc.start()
    with pytest.raises(ValueError) as raised:
        with gc.stop_on_exception():
            net.run(timeout=WAIT)
            raise ValueError("bad labels")
    assert gc.should_stop() is True
    with pytest.raises(ValueError) as rejoined:
        gc.join(timeout=5)
    assert rejoined.value is raised.value
    with pytest.raises(EndOfInput):
        net.run(timeout=1)


def test_request_stop_from_a_fetcher(gc: GlobalCoordinator) -> None:
    """Trap: request_stop() called from inside a fetch_fun (a worker that
    decides training is over) joined its own thread or deadlocked."""
    calls = {"n": 0}

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        calls["n"] += 1
        if calls["n"] == 5:
            gc.request_stop()
        return chunk()

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    runs = 0
    with pytest.raises(EndOfInput):
        while runs < 1000:
            net.run(timeout=WAIT)
            runs += 1
    assert gc.should_stop() is True
    assert gc.join(timeout=5) is True


# =============================================================================================
# helpers
# =============================================================================================


def run_child(code: str, *, args: tuple[str, ...] = (), timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; a hang is a test failure, with what it printed."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"the child hung (killed after {timeout} s)\nstdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}")


def last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON from the child (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def run_bounded(net: Net, timeout: float, bound: float) -> tuple[BaseException | None, float]:
    """``net.run(timeout)`` in a helper thread, waited for at most ``bound``
    seconds.  Returns what it raised (None if it returned or still runs) and
    the seconds it took (or ``bound``)."""
    got: list[BaseException | None] = []
    done = threading.Event()

    def target() -> None:
        try:
            net.run(timeout=timeout)
            got.append(None)
        except BaseException as exc:
            got.append(exc)
        finally:
            done.set()

    t0 = time.monotonic()
    threading.Thread(target=target, name="test-run", daemon=True).start()
    finished = done.wait(bound)
    took = time.monotonic() - t0
    return (got[0] if finished else None), took


def drain_quietly(net: Net, limit: int = 10_000) -> None:
    """Run ``net`` until it raises (EndOfInput, or anything), at most ``limit`` times."""
    for _ in range(limit):
        try:
            net.run(timeout=1)
        except BaseException:
            return


def poll(read: Callable[[], float], done: Callable[[float], bool], within: float, tick: threading.Event) -> float:
    """Read a gauge until ``done(value)`` or ``within`` seconds passed; returns the last value."""
    deadline = time.monotonic() + within
    value = read()
    while not done(value) and time.monotonic() < deadline:
        tick.wait(0.05)
        value = read()
    return value

