"""``blobfeed demo``'s models: the digits classifier (scikit-learn's bundled
digits, an MLP trained on the spot, exported to ONNX with ``onnx.helper`` and
checked against scikit-learn) and, for ``--model``, what a given ONNX
model's inputs are."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = [
    "DemoError", "InputSpec", "TEST_SIZE", "TrainedDigits", "decode_pixels", "digits_mlp_onnx",
    "inspect_model_inputs", "train_digits",
]

#: Share of the digits held out of training; the accuracy is measured on them.
TEST_SIZE = 0.25

_FLOAT_TYPES: dict[str, np.dtype[Any]] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(double)": np.dtype(np.float64),
    "tensor(float16)": np.dtype(np.float16),
}


class DemoError(Exception):
    """A problem the user can fix (bad model, missing package, busy port); exit status 2."""


# --------------------------------------------------------------------------- the data
def decode_pixels(raw: np.ndarray) -> np.ndarray:
    """Images stored as uint8 intensities 0..16 -> float32 ``[n, 64]`` in [0, 1].

    The fetchers, the training and the direct scoring all use this, so the
    model sees exactly the same numbers on every path.
    """
    return np.divide(raw.reshape(len(raw), -1), 16, dtype=np.float32)


# --------------------------------------------------------------------------- the model
def digits_mlp_onnx(coefs: Sequence[np.ndarray], intercepts: Sequence[np.ndarray]) -> bytes:
    """A ReLU MLP's weights as an ONNX model: ``pixels`` float32 ``[N, in]`` -> ``logits``.

    Args:
        coefs: weight matrices ``[in, out]`` per layer (scikit-learn's ``coefs_``).
        intercepts: bias vectors per layer (``intercepts_``).

    Returns:
        The serialized model: ``Gemm -> Relu -> ... -> Gemm``, opset 13.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if len(coefs) != len(intercepts) or not coefs:
        raise ValueError("need one intercept per weight matrix, and at least one layer")
    nodes, inits = [], []
    prev = "pixels"
    for i, (w, b) in enumerate(zip(coefs, intercepts)):
        inits += [
            numpy_helper.from_array(np.asarray(w, np.float32), f"W{i}"),
            numpy_helper.from_array(np.asarray(b, np.float32), f"B{i}"),
        ]
        last = i == len(coefs) - 1
        gemm_out = "logits" if last else f"g{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"W{i}", f"B{i}"], [gemm_out]))
        if not last:
            nodes.append(helper.make_node("Relu", [gemm_out], [f"h{i}"]))
            prev = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "digits_mlp",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["N", int(coefs[0].shape[0])])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", int(coefs[-1].shape[1])])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # readable by every onnxruntime >= 1.11
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


@dataclass(frozen=True)
class TrainedDigits:
    """The digits data and the classifier trained on it."""

    #: uint8 intensities 0..16, ``[1797, 8, 8]``: what the fetchers read
    raw: np.ndarray
    #: the true digit of each image
    labels: np.ndarray
    #: indices of the images held out from training
    test_idx: np.ndarray
    #: the ONNX model
    model: bytes
    #: e.g. ``"64-64-10"``
    layers: str
    train_seconds: float
    #: max |probability difference| between the ONNX model and scikit-learn
    max_prob_diff: float
    #: a note when training stopped before converging, else ""
    note: str


def train_digits(seed: int) -> TrainedDigits:
    """Train a small MLP on scikit-learn's bundled digits and export it to ONNX.

    Raises:
        DemoError: the exported model does not reproduce scikit-learn.
    """
    import onnxruntime as ort
    from sklearn.datasets import load_digits
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier
    from threadpoolctl import threadpool_limits  # a scikit-learn dependency

    digits = load_digits()  # bundled in the wheel: no download
    raw = digits.images.astype(np.uint8)
    labels = digits.target.astype(np.int64)
    x = decode_pixels(raw)
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)), test_size=TEST_SIZE, random_state=seed, stratify=labels
    )
    clf = MLPClassifier(hidden_layer_sizes=(64,), tol=1e-3, max_iter=500, random_state=seed)
    t0 = time.perf_counter()
    # One BLAS thread: these matrices are tiny, and multi-threaded BLAS on a
    # busy machine spends more time spinning than computing (4x slower here).
    with threadpool_limits(1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        clf.fit(x[train_idx], labels[train_idx])
    train_seconds = time.perf_counter() - t0
    note = "" if not any(issubclass(w.category, ConvergenceWarning) for w in caught) else (
        f"training stopped after {clf.n_iter_} iterations before converging"
    )
    model = digits_mlp_onnx(clf.coefs_, clf.intercepts_)

    # The exported model must reproduce scikit-learn on every image.
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    logits = sess.run(["logits"], {"pixels": x})[0]
    diff = float(np.abs(_softmax(logits) - clf.predict_proba(x)).max())
    disagree = int((clf.classes_[logits.argmax(axis=1)] != clf.predict(x)).sum())
    if diff > 1e-4 or disagree:
        raise DemoError(
            f"the exported ONNX model does not reproduce scikit-learn: max probability "
            f"difference {diff:.2g}, {disagree} of {len(x)} predictions differ"
        )
    if not np.array_equal(clf.classes_, np.arange(len(clf.classes_))):
        raise DemoError(f"unexpected classes {clf.classes_}")  # argmax == class relies on it
    layers = "-".join(str(n) for n in [x.shape[1], *clf.hidden_layer_sizes, len(clf.classes_)])
    return TrainedDigits(raw, labels, np.sort(test_idx), model, layers, train_seconds, diff, note)


# --------------------------------------------------------------------------- --model
@dataclass(frozen=True)
class InputSpec:
    """One model input the demo feeds with synthetic data."""

    #: the input's name (also the blob's name)
    name: str
    #: numpy dtype of the data
    dtype: np.dtype
    #: shape of one sample (the input's shape without the batch axis)
    sample_shape: tuple[int, ...]
    #: the input's first dimension when the model fixes it, else None
    fixed_batch: int | None


def inspect_model_inputs(session: Any) -> list[InputSpec]:
    """What to feed an onnxruntime ``InferenceSession``: one :class:`InputSpec` per input.

    Axis 0 is the batch axis: symbolic or unknown there, any batch size
    works; a number there fixes the batch size.  Every other dimension must
    be a number.

    Raises:
        DemoError: an input is not float, float16 or double, is a scalar, or
            has a symbolic dimension past axis 0; or the model has no inputs.
    """
    specs = []
    inputs = session.get_inputs()
    if not inputs:
        raise DemoError("the model has no inputs to feed")
    for arg in inputs:
        dtype = _FLOAT_TYPES.get(arg.type)
        if dtype is None:
            raise DemoError(
                f"model input {arg.name!r} has type {arg.type}: --model feeds synthetic float "
                f"data, so every input must be float, double or float16"
            )
        shape = list(arg.shape) if arg.shape is not None else None
        if not shape:
            raise DemoError(
                f"model input {arg.name!r} is a scalar or has no known rank: the demo needs "
                f"a batch axis at position 0"
            )
        for axis, dim in enumerate(shape[1:], start=1):
            if not (isinstance(dim, int) and dim >= 0):
                raise DemoError(
                    f"model input {arg.name!r} has shape {shape}: dimension {axis} is "
                    f"{dim!r}, not a number; only axis 0 (the batch axis) may be symbolic. "
                    f"Fix the other dimensions first (e.g. python -m "
                    f"onnxruntime.tools.make_dynamic_shape_fixed)"
                )
        d0 = shape[0]
        fixed = d0 if isinstance(d0, int) and d0 > 0 else None
        specs.append(InputSpec(arg.name, dtype, tuple(int(d) for d in shape[1:]), fixed))
    fixed_sizes = {s.fixed_batch for s in specs if s.fixed_batch is not None}
    if len(fixed_sizes) > 1:
        raise DemoError(
            f"the model's inputs fix different batch sizes {sorted(fixed_sizes)} on axis 0"
        )
    return specs

