"""Net on onnxruntime: model from a path or bytes, outputs, workspace."""

from __future__ import annotations

import numpy as np
import pytest

import blobfeed
from blobfeed import Net, init_data_input_workers
from blobfeed.apps.models import mlp_onnx, mlp_reference

from .helpers import WAIT, drain


def make_fetch(n_chunks: int, dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    chunks = [rng.standard_normal((int(rng.integers(1, 20)), dim)).astype(np.float32) for _ in range(n_chunks)]
    data = np.concatenate(chunks)
    pending = list(chunks)

    def fetch(w: int, b: int) -> list[np.ndarray]:
        if not pending:
            raise StopIteration
        return [pending.pop(0)]

    return fetch, data


@pytest.mark.parametrize("from_path", [False, True])
def test_model_outputs_match_numpy(gc: blobfeed.GlobalCoordinator, tmp_path, from_path: bool) -> None:
    model, weights = mlp_onnx([6, 16, 3], seed=1)
    if from_path:
        path = tmp_path / "mlp.onnx"
        path.write_bytes(model)
        net = Net(str(path), name="mlp")
    else:
        net = Net(model, name="mlp")
    assert net.input_names == ("data",) and net.output_names == ("logits",)
    fetch, data = make_fetch(30, 6)
    init_data_input_workers(net, ["data"], fetch, 8, num_worker_threads=1, coordinator=gc)
    gc.start()
    outs = drain(net)
    logits = np.concatenate([o["logits"] for o in outs])
    # one worker, one net: order is preserved end to end
    np.testing.assert_allclose(logits, mlp_reference(data, weights), rtol=1e-5, atol=1e-5)
    assert [len(o["logits"]) for o in outs[:-1]] == [8] * (len(outs) - 1)
    # the workspace holds the last batch's inputs and outputs
    ws = net.workspace
    assert ws.has_blob("data") and ws.has_blob("logits")
    np.testing.assert_allclose(ws.fetch_blob("logits"), outs[-1]["logits"])
    assert ws.blobs() == ["data", "logits"]


def test_model_input_from_the_workspace(gc: blobfeed.GlobalCoordinator) -> None:
    """A model input no source feeds may be fed by hand (Caffe2's FeedBlob)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "scale"], ["y"])], "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    net = Net(model.SerializeToString(), name="scale")
    init_data_input_workers(net, ["x"], lambda w, b: [np.ones((3, 2), np.float32)], 3, coordinator=gc)
    gc.start()
    with pytest.raises(ValueError, match=r"\['scale'\]"):
        net.run(timeout=WAIT)
    net.workspace.feed_blob("scale", np.array([2.0, 3.0], np.float32))
    out = net.run(timeout=WAIT)
    np.testing.assert_array_equal(out["y"], np.tile([2.0, 3.0], (3, 1)))


def test_workspace_errors() -> None:
    ws = Net(name="n").workspace
    with pytest.raises(KeyError, match="no blob 'nope'"):
        ws.fetch_blob("nope")
    with pytest.raises(ValueError):
        ws.feed_blob("", np.zeros(1))
    ws.feed_blob("a", np.zeros(1))
    assert ws.has_blob("a") and ws.blobs() == ["a"]


def test_cuda_device_needs_cuda_provider() -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA; the error path does not apply")
    model, _ = mlp_onnx([2, 2])
    with pytest.raises(ValueError, match="needs onnxruntime with CUDAExecutionProvider"):
        Net(model, device="cuda:0")
    with pytest.raises(ValueError, match="'cuda:1' needs onnxruntime with CUDAExecutionProvider"):
        Net(device="cuda:1")  # the enqueuer would place batches there
