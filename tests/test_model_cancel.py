"""A stop cancels the model (issue 19, item 11): ``request_stop()`` / ``stop()``
end a ``run()`` that is inside a long onnxruntime call through
``RunOptions.terminate``, instead of waiting for the model to finish."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfInput, Net, init_data_input_workers

from .helpers import WAIT, sample

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

K = 64
#: trips that take far longer than any bound here (some µs each)
LONG = 10**9


def _loop_model() -> bytes:
    """``y = x @ I`` repeated ``n`` times (``n``: an int64 input), in a Loop op:
    onnxruntime checks the terminate flag at every iteration."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("MatMul", ["v_in", "w"], ["v_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [None, K]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [None, K]),
        ],
        [numpy_helper.from_array(np.eye(K, dtype=np.float32), "w")],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "cond", "x"], ["y"], body=body)],
        "long",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K]),
         helper.make_tensor_value_info("n", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, K])],
        [numpy_helper.from_array(np.array(True), "cond")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def _fetch(w: int, b: int) -> list[np.ndarray]:
    return [np.ones((4, K), np.float32)]


class _Entered:
    """Wraps a net's session: says when the model has been entered."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self.entered = threading.Event()

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        return self._session.run(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


def _net_in_a_long_run(gc: blobfeed.GlobalCoordinator) -> tuple[Net, _Entered, list[BaseException], threading.Event]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    net = Net(_loop_model(), name="long", session_options=options)
    net.workspace.feed_blob("n", np.array(LONG, np.int64))
    spy = _Entered(net._session)
    net._session = spy
    init_data_input_workers(net, ["x"], _fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    raised: list[BaseException] = []
    done = threading.Event()

    def consume() -> None:
        try:
            net.run(timeout=WAIT)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test
            raised.append(exc)
        finally:
            done.set()

    threading.Thread(target=consume, name="test-consumer", daemon=True).start()
    assert spy.entered.wait(WAIT), "run() never reached the model"
    return net, spy, raised, done


@pytest.mark.parametrize("how", ["stop", "request_stop"])
def test_a_stop_cancels_a_long_model_run(gc: blobfeed.GlobalCoordinator, how: str) -> None:
    net, _, raised, done = _net_in_a_long_run(gc)
    t0 = time.monotonic()
    if how == "stop":
        assert gc.stop(timeout=WAIT)
    else:
        gc.request_stop()
    # without the cancel, the run would take minutes
    assert done.wait(WAIT), "run() still inside the model after the stop"
    assert time.monotonic() - t0 < WAIT
    assert len(raised) == 1 and isinstance(raised[0], EndOfInput), raised
    assert "cancelled" in str(raised[0]) and "'long'" in str(raised[0])
    assert gc.stop(timeout=WAIT)
    # the batch the model never finished is not delivered: it was dropped by the stop
    assert sample(gc, "blobfeed_delivered_samples_total", source="train", net="long") == 0
    fetched = sample(gc, "blobfeed_fetched_samples_total", source="train")
    dropped = sum(
        sample(gc, "blobfeed_dropped_samples_total", source="train", reason=r)
        for r in ("drop_last", "stopped", "error", "resume")
    )
    assert fetched == dropped > 0
    # the net runs again once re-wired: a stop cancels only the run it met
    net.workspace.feed_blob("n", np.array(1, np.int64))
    init_data_input_workers(net, ["x"], _fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    assert net.run(timeout=WAIT)["y"].shape == (4, K)


def test_stopping_another_source_does_not_cancel_the_model(gc: blobfeed.GlobalCoordinator) -> None:
    """Only a stop of a source that feeds the net cancels its run."""
    net = Net(_loop_model(), name="short")
    net.workspace.feed_blob("n", np.array(3, np.int64))
    init_data_input_workers(net, ["x"], _fetch, 4, num_worker_threads=1, coordinator=gc)
    other = Net(name="other")
    init_data_input_workers(other, ["z"], _fetch, 4, num_worker_threads=1, input_source_name="other",
                            coordinator=gc)
    gc.start()
    assert gc.stop_coordinator("other", timeout=WAIT)
    assert net.run(timeout=WAIT)["y"].shape == (4, K)
