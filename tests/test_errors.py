"""Error paths: fetcher failures, malformed chunks, timeouts, bad arguments."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed import ChunkError, DequeueTimeout, EndOfInput, FetcherError, Net, init_data_input_workers

from .helpers import WAIT, sample, wait_until


class Boom(RuntimeError):
    pass


def good(n: int = 4) -> list[np.ndarray]:
    return [np.zeros((n, 3), np.float32), np.zeros(n, np.int64)]


@pytest.mark.parametrize(
    "bad, match",
    [
        ("not a list", r"worker 0: fetch_fun must return a list or tuple of 2 numpy arrays \(x, y\), got str"),
        ([np.zeros((4, 3), np.float32)], r"expected 2 arrays \(x, y\), got 1"),
        ([np.zeros((4, 3), np.float32), [1, 2, 3, 4]], r"blob 'y': expected a numpy.ndarray, got list"),
        ([np.zeros((4, 3), np.float32), np.zeros(5, np.int64)], r"blob 'y': expected 4 samples \(as blob 'x'\), got 5"),
        ([np.zeros((4, 3), np.float64), np.zeros(4, np.int64)], r"blob 'x': expected dtype float32 .* got dtype float64"),
        ([np.zeros((4, 5), np.float32), np.zeros(4, np.int64)], r"blob 'x': expected dtype float32 and per-sample shape \(3,\).* per-sample shape \(5,\)"),
        ([np.zeros((4, 3), np.float32), np.array(7)], r"blob 'y': expected an array with a batch axis 0, got shape \(\)"),
    ],
)
def test_malformed_chunk_raises_chunk_error_in_run(gc: blobfeed.GlobalCoordinator, bad: Any, match: str) -> None:
    calls = [good(), bad]  # the first, good chunk fixes dtypes and shapes

    def fetch(w: int, b: int) -> Any:
        return calls.pop(0) if calls else good()

    net = Net(name="n")
    init_data_input_workers(net, ["x", "y"], fetch, 8, num_worker_threads=1, coordinator=gc)
    gc.start()
    with pytest.raises(ChunkError, match=match) as info:
        net.run(timeout=WAIT)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, FetcherError)
    assert "source 'train'" in str(err)
    assert isinstance(err.__cause__, (TypeError, ValueError))
    assert sample(gc, "blobfeed_fetch_errors_total", source="train", kind="invalid") == 1


def test_on_error_skip_drops_logs_counts_and_carries_on(gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture) -> None:
    script: list[Any] = [good(2), Boom("flaky"), None, good(0), [np.zeros((2, 3)), np.zeros(2, np.int64)], good(2), StopIteration]

    def fetch(w: int, b: int) -> Any:
        item = script.pop(0)
        if isinstance(item, BaseException) or item is StopIteration:
            raise item
        return item

    net = Net(name="n")
    init_data_input_workers(net, ["x", "y"], fetch, 4, num_worker_threads=1, on_error="skip", coordinator=gc)
    with caplog.at_level("WARNING", logger="blobfeed"):
        gc.start()
        batch = net.run(timeout=WAIT)
        assert batch["x"].shape == (4, 3)
        with pytest.raises(EndOfInput):
            net.run(timeout=WAIT)
    for kind, n in [("exception", 1), ("none", 1), ("empty", 1), ("invalid", 1)]:
        assert sample(gc, "blobfeed_fetch_errors_total", source="train", kind=kind) == n, kind
    assert sample(gc, "blobfeed_skipped_samples_total", source="train") == 2
    text = caplog.text
    assert "flaky" in text and "returned None" in text and "no samples" in text and "float64" in text


def test_none_and_empty_are_skipped_even_with_raise(gc: blobfeed.GlobalCoordinator) -> None:
    script: list[Any] = [None, good(0), good(3), StopIteration]

    def fetch(w: int, b: int) -> Any:
        item = script.pop(0)
        if item is StopIteration:
            raise StopIteration
        return item

    net = Net(name="n")
    init_data_input_workers(net, ["x", "y"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    assert net.run(timeout=WAIT)["x"].shape == (3, 3)
    assert sample(gc, "blobfeed_fetch_errors_total", source="train", kind="none") == 1
    assert sample(gc, "blobfeed_fetch_errors_total", source="train", kind="empty") == 1


def test_dequeue_timeout_is_raised_and_counted(gc: blobfeed.GlobalCoordinator) -> None:
    release = threading.Event()

    def fetch(w: int, b: int) -> Any:
        release.wait(WAIT)
        raise StopIteration

    net = Net(name="n")
    init_data_input_workers(net, ["x", "y"], fetch, 4, num_worker_threads=1, timeout=0.05, coordinator=gc)
    gc.start()
    try:
        with pytest.raises(DequeueTimeout, match=r"source 'train', net 'n': no batch within 0.05 s"):
            net.run()
        with pytest.raises(TimeoutError):
            net.run(timeout=0.01)
        assert sample(gc, "blobfeed_dequeue_timeouts_total", source="train", net="n") == 2
    finally:
        release.set()


def test_model_input_nothing_feeds_is_named() -> None:
    from blobfeed.apps.models import mlp_onnx

    model, _ = mlp_onnx([3, 2], input_name="pixels")
    net = Net(model, name="m")
    with pytest.raises(ValueError, match=r"model inputs \['pixels'\] are fed by no input source"):
        net.run(timeout=0.1)


def test_net_without_model_or_source() -> None:
    with pytest.raises(ValueError, match="no model and no input source"):
        Net(name="empty").run(timeout=0.1)


def fetch_ok(w: int, b: int) -> list[np.ndarray]:
    return good()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
        ({"batch_size": 2.5}, TypeError, "batch_size must be an int"),
        ({"input_blob_names": []}, ValueError, "input_blob_names is empty"),
        ({"input_blob_names": ["x", "x"]}, ValueError, r"duplicates: \['x'\]"),
        ({"input_blob_names": "xy"}, TypeError, "input_blob_names must be a list or tuple"),
        ({"batch_columns": [0]}, ValueError, "batch_columns has 1 entries but there are 2 blobs"),
        ({"batch_columns": [0, -1]}, ValueError, r"batch_columns\[1\] must be >= 0"),
        ({"timeout": 0}, ValueError, "timeout must be a number of seconds > 0, got 0"),
        ({"timeout": -1.0}, ValueError, "timeout must be"),
        ({"fetch_fun": 42}, TypeError, "fetch_fun must be callable, got int"),
        ({"net": "net"}, TypeError, "net must be a blobfeed.Net, got str"),
        ({"num_worker_threads": 0}, ValueError, "num_worker_threads must be >= 1"),
        ({"max_buffered_batches": 0}, ValueError, "max_buffered_batches must be >= 1"),
        ({"device_queue_capacity": 0}, ValueError, "device_queue_capacity must be >= 1"),
        ({"on_error": "ignore"}, ValueError, "on_error must be 'raise' or 'skip'"),
        ({"init_fun": 3}, TypeError, "init_fun must be callable"),
        ({"external_loggers": [object()]}, TypeError, r"has no callable log\(metrics\) method"),
        ({"coordinator": object()}, TypeError, "coordinator must be a GlobalCoordinator"),
        ({"input_source_name": ""}, ValueError, "name must be a non-empty str"),
    ],
)
def test_bad_arguments_fail_at_once(gc: blobfeed.GlobalCoordinator, kwargs: dict[str, Any], exc: type, match: str) -> None:
    args: dict[str, Any] = {
        "net": Net(name="n"), "input_blob_names": ["x", "y"], "fetch_fun": fetch_ok,
        "batch_size": 4, "coordinator": gc,
    }
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        init_data_input_workers(**args)
    assert gc.get_worker_ids() == [], "a failed call must not allocate worker ids"


def test_shared_source_mismatch_and_same_net_twice(gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["x", "y"], fetch_ok, 4, coordinator=gc)
    with pytest.raises(ValueError, match="net 'n' is already fed from source 'train'"):
        init_data_input_workers(net, ["x", "y"], fetch_ok, 4, coordinator=gc)
    with pytest.raises(ValueError, match=r"blobs \['y'\] are already fed by another source"):
        init_data_input_workers(net, ["y"], fetch_ok, 4, input_source_name="val", coordinator=gc)
    # the refused call left nothing behind: no source "val" in the metrics
    assert gc.registry.get_sample_value("blobfeed_internal_queue_capacity", {"source": "val"}) is None
    with pytest.raises(ValueError, match="carries 2 blobs"):
        init_data_input_workers(Net(name="m"), ["x"], fetch_ok, 4, coordinator=gc)
    with caplog.at_level("WARNING", logger="blobfeed"):
        init_data_input_workers(Net(name="k"), ["x", "y"], fetch_ok, 4, max_buffered_batches=7, coordinator=gc)
        # data parallel with default-named nets works; the metrics share a label
        init_data_input_workers(Net(name="k"), ["x", "y"], fetch_ok, 4, coordinator=gc)
    assert "max_buffered_batches=7 ignored" in caplog.text
    assert "already feeds a net named 'k'" in caplog.text
    assert sample(gc, "blobfeed_internal_queue_capacity", source="train") == 800
    assert gc.get_worker_ids() == [0, 1, 2, 3, 4, 5]


def test_fetch_fun_raising_base_exception_fails_the_source(gc: blobfeed.GlobalCoordinator) -> None:
    def fetch(w: int, b: int) -> list[np.ndarray]:
        raise KeyboardInterrupt("interrupted inside fetch_fun")

    net = Net(name="n")
    init_data_input_workers(net, ["x", "y"], fetch, 4, num_worker_threads=1, on_error="skip", coordinator=gc)
    gc.start()
    t0 = time.monotonic()
    with pytest.raises(FetcherError, match="KeyboardInterrupt") as info:
        net.run(timeout=WAIT)
    assert time.monotonic() - t0 < 1.0
    assert isinstance(info.value.__cause__, KeyboardInterrupt)


def test_two_sources_stay_aligned_when_one_times_out(gc: blobfeed.GlobalCoordinator) -> None:
    counters = {"a": 0, "b": 0}
    gate = threading.Event()

    def make(key: str):
        def fetch(w: int, b: int) -> list[np.ndarray]:
            if key == "b" and counters["b"] >= 1:
                gate.wait(WAIT)
            counters[key] += 1
            return [np.array([counters[key]], np.int64)]
        return fetch

    net = Net(name="n")
    init_data_input_workers(net, ["a"], make("a"), 1, num_worker_threads=1, input_source_name="sa", coordinator=gc)
    init_data_input_workers(net, ["b"], make("b"), 1, num_worker_threads=1, input_source_name="sb", coordinator=gc)
    gc.start()
    first = net.run(timeout=WAIT)
    assert (first["a"][0], first["b"][0]) == (1, 1)
    with pytest.raises(DequeueTimeout):
        net.run(timeout=0.05)  # "a" had its second batch; "b" had none
    gate.set()
    second = net.run(timeout=WAIT)
    assert (second["a"][0], second["b"][0]) == (2, 2), "sources shifted against each other"
    assert sample(gc, "blobfeed_delivered_samples_total", source="sa", net="n") == 2


def test_feeding_a_source_that_has_ended_is_refused(gc: blobfeed.GlobalCoordinator) -> None:
    def ended(w: int, b: int) -> list[np.ndarray]:
        raise StopIteration

    net = Net(name="n")
    init_data_input_workers(net, ["x"], ended, 4, coordinator=gc)
    gc.start()
    with pytest.raises(EndOfInput):
        net.run(timeout=WAIT)
    with pytest.raises(ValueError, match="source 'train' has ended; stop_coordinator"):
        init_data_input_workers(Net(name="m"), ["x"], fetch_ok, 4, coordinator=gc)
    assert gc.stop_coordinator("train")
    init_data_input_workers(Net(name="m"), ["x", "y"], fetch_ok, 4, coordinator=gc)


def test_bad_generic_worker_arguments() -> None:
    with pytest.raises(TypeError, match="worker_fun must be callable"):
        blobfeed.init_workers(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shutdown_fun must be callable"):
        blobfeed.init_workers(lambda w: None, shutdown_fun=1)  # type: ignore[arg-type]


def test_bad_net_arguments() -> None:
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda:N'"):
        Net(device="tpu")
    with pytest.raises(TypeError, match="model must be a path, bytes or None"):
        Net(model=123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not exist"):
        Net(model="/nonexistent/model.onnx")


def test_a_stopped_source_hands_out_nothing_not_even_a_held_batch(gc: blobfeed.GlobalCoordinator) -> None:
    """A two-source net took A's batch and waits on B; A is stopped meanwhile,
    then B times out.  A's batch must not come back from a later run(), and
    must be counted as dropped (the accounting identity holds)."""
    b_may_start = threading.Event()
    entered_b = threading.Event()

    def fetch_a(w: int, b: int) -> list[np.ndarray]:
        return [np.arange(8, dtype=np.int64)]

    def fetch_b(w: int, b: int) -> list[np.ndarray]:
        entered_b.set()
        b_may_start.wait(WAIT)
        return [np.arange(8, dtype=np.int64) + 1000]

    net = Net(name="n")
    init_data_input_workers(net, ["a"], fetch_a, 8, num_worker_threads=1, input_source_name="A",
                            max_buffered_batches=2, device_queue_capacity=1, coordinator=gc)
    init_data_input_workers(net, ["b"], fetch_b, 8, num_worker_threads=1, input_source_name="B", coordinator=gc)
    gc.start()
    assert entered_b.wait(WAIT)
    outcome: dict[str, BaseException] = {}
    waiting_on_b = threading.Event()

    def consume() -> None:
        waiting_on_b.set()
        try:
            net.run(timeout=1.0)  # takes A's batch, then waits on B until the timeout
        except BaseException as exc:
            outcome["exc"] = exc

    t = threading.Thread(target=consume)
    t.start()
    assert waiting_on_b.wait(WAIT)
    # A's batch is taken almost at once; the consumer then waits on B
    wait_until(lambda: sample(gc, "blobfeed_dequeue_wait_seconds_count", source="A", net="n") >= 1, "A dequeued")
    assert gc.stop_coordinator("A", timeout=WAIT)
    t.join(WAIT)
    assert not t.is_alive() and isinstance(outcome.get("exc"), DequeueTimeout)
    b_may_start.set()
    with pytest.raises(EndOfInput, match="source 'A' was stopped"):
        net.run(timeout=WAIT)
    fetched = sample(gc, "blobfeed_fetched_samples_total", source="A")
    delivered = sample(gc, "blobfeed_delivered_samples_total", source="A", net="n")
    dropped = sum(sample(gc, "blobfeed_dropped_samples_total", source="A", reason=r) for r in ("drop_last", "stopped", "error"))
    assert delivered == 0 and fetched == dropped > 0, (fetched, delivered, dropped)


# -- errors that name the fix (issue 24) ------------------------------------------------------------


def test_dtype_not_the_models_names_the_astype(gc: blobfeed.GlobalCoordinator) -> None:
    pytest.importorskip("onnx")
    from blobfeed.apps.models import mlp_onnx

    model, _ = mlp_onnx([3, 2], input_name="x")
    net = Net(model, name="m")
    # numpy's default float64 into a float32 model
    init_data_input_workers(net, ["x"], lambda w, b: [np.zeros((4, 3))], 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    with pytest.raises(ChunkError) as err:
        net.run(timeout=WAIT)
    assert "tensor(float)" in str(err.value) and "float64" in str(err.value), err.value
    assert ".astype(np.float32)" in str(err.value), err.value


def test_dtype_not_as_earlier_chunks_names_the_astype(gc: blobfeed.GlobalCoordinator) -> None:
    calls = [[np.zeros((4, 3), np.float32)], [np.zeros((4, 3), np.float64)]]
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: calls.pop(0) if calls else None, 8, num_worker_threads=1,
                            coordinator=gc)
    gc.start()
    with pytest.raises(ChunkError) as err:
        net.run(timeout=WAIT)
    assert ".astype(np.float32)" in str(err.value), err.value


class Tensor:
    """Looks like a torch.Tensor to blobfeed (torch is not installed here)."""

    __module__ = "torch"

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def numpy(self) -> np.ndarray:
        return self._a


@pytest.mark.parametrize("whole", [False, True], ids=["in-a-list", "alone"])
def test_a_torch_tensor_names_numpy(gc: blobfeed.GlobalCoordinator, whole: bool) -> None:
    t = Tensor(np.zeros((4, 3), np.float32))
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: t if whole else [t], 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    with pytest.raises(ChunkError) as err:
        net.run(timeout=WAIT)
    msg = str(err.value)
    assert "torch.Tensor" in msg and ".numpy()" in msg, msg


def test_an_array_like_names_asarray(gc: blobfeed.GlobalCoordinator) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["x", "y"], lambda w, b: [np.zeros(4), [1, 2, 3, 4]], 4, num_worker_threads=1,
                            coordinator=gc)
    gc.start()
    with pytest.raises(ChunkError, match=r"np\.asarray"):
        net.run(timeout=WAIT)


def fetch_one_arg(batch_size):
    return None


def fetch_three_args(worker_id, batch_size, extra):
    return None


def fetch_keyword_only(*, worker_id, batch_size):
    return None


@pytest.mark.parametrize("fun, what", [
    (fetch_one_arg, "fetch_one_arg(batch_size)"),
    (fetch_three_args, "fetch_three_args(worker_id, batch_size, extra)"),
    (fetch_keyword_only, "fetch_keyword_only(*, worker_id, batch_size)"),
    (lambda: None, "<lambda>()"),
])
def test_fetch_fun_of_the_wrong_signature_is_refused_when_wired(gc: blobfeed.GlobalCoordinator, fun, what) -> None:
    # it was found only in the worker, at the first run(): a FetcherError
    with pytest.raises(TypeError) as err:
        init_data_input_workers(Net(name="n"), ["x"], fun, 4, coordinator=gc)
    msg = str(err.value)
    assert what in msg and "fetch_fun(worker_id, batch_size)" in msg, msg
    assert "test_errors.py" in msg, msg  # where it is defined
    assert gc.get_worker_ids() == []


class CallableFetcher:
    def __call__(self, worker_id, batch_size):
        raise StopIteration


def test_fetch_funs_of_any_fitting_kind_are_accepted(gc: blobfeed.GlobalCoordinator) -> None:
    import functools

    def three(prefix, worker_id, batch_size):
        raise StopIteration

    def varargs(*args, **kwargs):
        raise StopIteration

    def defaults(worker_id, batch_size, extra=1):
        raise StopIteration

    # partials, callable objects, *args, defaults, and builtins whose
    # signature cannot be read
    for i, fun in enumerate([functools.partial(three, "p"), CallableFetcher(), varargs, defaults, max, print]):
        init_data_input_workers(Net(name=f"n{i}"), ["x"], fun, 4, input_source_name=f"s{i}", coordinator=gc)
    with pytest.raises(TypeError, match="worker_init_fun"):
        init_data_input_workers(Net(name="w"), ["x"], varargs, 4, input_source_name="w", coordinator=gc,
                                worker_init_fun=lambda: None)


def test_caffe2_module_name() -> None:
    # a Caffe2 port: `from caffe2.python import data_workers` becomes this
    from blobfeed import data_workers

    assert data_workers.init_data_input_workers is blobfeed.init_data_input_workers
    assert data_workers.global_coordinator is blobfeed.global_coordinator
    assert data_workers.GlobalCoordinator is blobfeed.GlobalCoordinator
    assert data_workers.get_worker_ids(3) == [0, 1, 2]
    assert set(data_workers.__all__) <= set(dir(data_workers))


def test_release_frames_lets_go_of_what_a_kept_error_s_frames_held() -> None:
    """An error blobfeed hands out and the caller keeps: what the frames of
    its traceback held (and of the error it was raised from) is freed,
    and the traceback still names where it came from."""
    import traceback
    import weakref

    from blobfeed.errors import release_frames

    class Held:
        pass

    def inner(obj: Held) -> None:
        raise KeyError("inner")

    refs: list[weakref.ref[Held]] = []

    def outer() -> None:
        held = Held()
        refs.append(weakref.ref(held))
        try:
            inner(held)
        except KeyError as err:
            raise blobfeed.FetcherError("outer") from err

    try:
        outer()
    except blobfeed.FetcherError as err:
        kept = err
    ref = refs[0]
    assert ref() is not None  # the traceback's frames hold it
    assert release_frames(kept) is kept
    assert ref() is None
    text = "".join(traceback.format_exception(kept))
    assert "in outer" in text and "in inner" in text and "KeyError: 'inner'" in text


def test_release_frames_leaves_the_callers_own_exception_alone() -> None:
    """blobfeed raises its error while the caller handles an exception of
    its own (the error's context): that exception's frames are the
    caller's, left as they are (``keep``), and a generator suspended in
    them is not closed."""
    import weakref

    from blobfeed.errors import release_frames

    class Held:
        pass

    refs: list[weakref.ref[Held]] = []

    def user() -> None:
        precious = Held()
        refs.append(weakref.ref(precious))
        raise KeyError("the caller's")

    def fetches() -> Any:
        for i in range(4):
            try:
                if i == 1:
                    raise ValueError("a bad record")
            except ValueError as e:
                yield e  # handed out, the generator goes on
                continue
            yield i

    got, kept = [], []
    gen = fetches()
    for x in gen:
        try:
            if isinstance(x, Exception):
                raise x
            if x == 2:
                user()
            got.append(x)
        except (KeyError, ValueError) as outer:
            try:
                raise blobfeed.ServiceError("blobfeed's")  # its context: the caller's exception
            except blobfeed.ServiceError as err:
                kept.append(release_frames(err, keep=outer))
    assert got == [0, 3], got  # the generator ran on after the error it handed out
    assert refs[0]() is not None  # the caller's frame keeps its variables
    assert all(isinstance(e.__context__, (KeyError, ValueError)) for e in kept)
