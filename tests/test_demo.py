"""``blobfeed demo``: the digits run, ``--model`` with synthetic data, and its errors."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from blobfeed import cli, demo  # noqa: E402
from blobfeed.models import mlp_onnx  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _metric(text: str, name: str) -> float:
    """The value of the sample ``name{net="demo",source="demo"}`` (or ``{source="demo"}``)."""
    m = re.search(rf'^{name}\{{[^}}]*source="demo"[^}}]*\}} (\S+)$', text, re.M)
    assert m, f"{name} not in the scraped metrics:\n{text}"
    return float(m.group(1))


def _save(tmp_path: Path, name: str, inputs: list, nodes: list, outputs: list) -> str:
    graph = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return str(path)


def test_digits_accuracy_matches_direct_and_metrics_are_served(capsys: pytest.CaptureFixture[str]) -> None:
    scraped: list[str] = []

    def on_running(url: str) -> None:
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url, timeout=5) as resp:
            scraped.append(resp.read().decode())

    rc = demo.main(
        ["--passes", "2", "--batch-size", "32", "--workers", "3", "--progress", "on"], on_running=on_running
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    total = 2 * 1797
    assert f"samples     {total}\n" in out
    assert f"predictions {total}/{total} identical to direct scoring: MATCH" in out
    acc = re.search(r"accuracy    blobfeed (\S+) \((\d+)/(\d+)\)  direct onnxruntime (\S+) \((\d+)/1797 x 2", out)
    assert acc, out
    assert acc.group(1) == acc.group(4) and int(acc.group(2)) == 2 * int(acc.group(5))
    assert float(acc.group(1)) > 0.9  # a trained classifier, not chance

    # The URL printed is the one that served blobfeed's metrics mid-run.
    url = re.search(r"^metrics     (\S+)", out, re.M).group(1)  # type: ignore[union-attr]
    assert len(scraped) == 1
    assert _metric(scraped[0], "blobfeed_batches_total") >= 1
    assert _metric(scraped[0], "blobfeed_delivered_samples_total") >= 1
    assert _metric(scraped[0], "blobfeed_internal_queue_capacity") > 0
    # ... and it is closed once the demo returns.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_digits_mismatch_fails(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Fetcher threads get blank images; the direct scoring does not.
    decode = demo.decode_pixels

    def skewed(raw: np.ndarray) -> np.ndarray:
        x = decode(raw)
        return np.zeros_like(x) if threading.current_thread().name.startswith("blobfeed-") else x

    monkeypatch.setattr(demo, "decode_pixels", skewed)
    rc = demo.main(["--passes", "1"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "MISMATCH" in out and "FAILED" in out


def test_cli_subprocess_runs_the_demo() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "blobfeed.cli", "demo", "--passes", "1", "--progress", "on"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1797/1797 identical to direct scoring: MATCH" in proc.stdout
    assert re.search(r"^metrics     http://127\.0\.0\.1:\d+/metrics", proc.stdout, re.M)
    assert re.search(r"^throughput  [\d,]+ samples/s$", proc.stdout, re.M)
    assert re.search(r"^model wait  \d+\.\d% of the run", proc.stdout, re.M)
    assert "1797/1797" in proc.stderr  # the progress bar reached the end


def test_cli_lists_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out


def test_model_with_synthetic_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mlp.onnx"
    path.write_bytes(mlp_onnx([16, 8, 4], seed=1)[0])
    rc = demo.main(["--model", str(path), "--samples", "300", "--passes", "2", "--batch-size", "32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "input       data: float32 [N, 16]" in out
    assert "samples     600\n" in out
    assert "batches     19\n" in out  # 18 of 32 and the last 24
    assert "output      logits: [32, 4] (first batch)" in out
    assert "accuracy" not in out


def test_model_with_fixed_batch_and_double_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _save(
        tmp_path, "fixed",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [8, 3]),
         helper.make_tensor_value_info("b", TensorProto.DOUBLE, [8, 3])],
        [helper.make_node("Cast", ["b"], ["bf"], to=TensorProto.FLOAT), helper.make_node("Add", ["a", "bf"], ["y"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 3])],
    )
    rc = demo.main(["--model", path, "--samples", "21", "--passes", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fixes the batch size at 8" in out
    assert "samples     16\n" in out and "dropped     5 samples" in out


def test_model_with_non_float_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _save(
        tmp_path, "ints",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4])],
        [helper.make_node("Cast", ["ids"], ["y"], to=TensorProto.FLOAT)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    assert demo.main(["--model", path]) == 2
    err = capsys.readouterr().err
    assert "model input 'ids' has type tensor(int64)" in err
    assert "must be float, double or float16" in err


def test_model_with_symbolic_inner_dim_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _save(
        tmp_path, "seq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", 4])],
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", 4])],
    )
    assert demo.main(["--model", path]) == 2
    assert "dimension 1 is 'T', not a number; only axis 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/nonexistent/model.onnx"], "no such file"),
        (["--samples", "10"], "--samples only applies with --model"),
        (["--batch-size", "0"], "must be at least 1"),
    ],
)
def test_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(argv) == 2
    assert message in capsys.readouterr().err
