"""Small ONNX models for examples, tests and benchmarks.

Needs the ``onnx`` package (``pip install -e '.[examples]'`` in the clone, or
``pip install onnx``); blobfeed itself only needs onnxruntime to run models.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["mlp_onnx", "mlp_reference"]


def mlp_onnx(
    layer_sizes: Sequence[int], *, seed: int = 0, input_name: str = "data", output_name: str = "logits"
) -> tuple[bytes, list[tuple[np.ndarray, np.ndarray]]]:
    """A float32 MLP ``Gemm -> Relu -> ... -> Gemm`` as ONNX bytes.

    Args:
        layer_sizes: e.g. ``[784, 256, 10]``.
        seed: weights are drawn from ``numpy.random.default_rng(seed)``.

    Returns:
        ``(model_bytes, [(W, b), ...])``: the weights, so callers can check
        outputs against :func:`mlp_reference`.
    """
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("building ONNX models needs the onnx package: pip install onnx") from exc
    if len(layer_sizes) < 2:
        raise ValueError(f"an MLP needs at least 2 layer sizes, got {list(layer_sizes)}")
    rng = np.random.default_rng(seed)
    weights, nodes, inits = [], [], []
    prev = input_name
    for i, (a, b) in enumerate(zip(layer_sizes[:-1], layer_sizes[1:])):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        bias = (rng.standard_normal(b) * 0.1).astype(np.float32)
        weights.append((w, bias))
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(bias, f"B{i}")]
        last = i == len(layer_sizes) - 2
        out = output_name if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"W{i}", f"B{i}"], [out if last else f"g{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"g{i}"], [out]))
        prev = out
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["N", layer_sizes[0]])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["N", layer_sizes[-1]])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # readable by every onnxruntime >= 1.11
    onnx.checker.check_model(model)
    return model.SerializeToString(), weights


def mlp_reference(x: np.ndarray, weights: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """What :func:`mlp_onnx`'s model computes, in numpy."""
    h = x.astype(np.float32)
    for i, (w, b) in enumerate(weights):
        h = h @ w + b
        if i < len(weights) - 1:
            h = np.maximum(h, 0)
    return h
