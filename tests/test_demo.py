"""``blobfeed demo``: the digits run, ``--model`` with synthetic data, and its errors."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

pytest.importorskip("sklearn")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from blobfeed.apps import cli, demo  # noqa: E402
from blobfeed.apps.models import mlp_onnx  # noqa: E402

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
    # The accuracy is the held-out split's, and says so; the training images'
    # figure is printed apart and labelled as such.
    acc = re.search(
        r"^accuracy    (\S+) on the 450 held-out test images \(25 % split, never seen in training\): "
        r"blobfeed (\d+)/900 over 2 passes, direct onnxruntime (\d+)/450$",
        out, re.M,
    )
    assert acc, out
    assert int(acc.group(2)) == 2 * int(acc.group(3))
    assert float(acc.group(1)) == pytest.approx(int(acc.group(3)) / 450, abs=1e-4)
    assert float(acc.group(1)) > 0.9  # a trained classifier, not chance
    train = re.search(
        r"^            (\S+) on the 1347 training images \(the model was fitted to them: "
        r"not a measure of accuracy\)$",
        out, re.M,
    )
    assert train, out
    assert "trained in" in out and "on 1347 images (450 held out for testing)" in out

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
        [sys.executable, "-m", "blobfeed.apps.cli", "demo", "--passes", "1", "--progress", "on"],
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


def test_help_names_serve_and_the_held_out_split(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--serve [SECONDS]" in out
    assert "Ctrl-C" in out and "SIGTERM" in out
    assert "held-out" in out and "never seen in training" in out and "the other 25 %, the held-out test images" in out


def _lines(stream: IO[str]) -> "queue.Queue[str | None]":
    """The lines of ``stream``, read by a daemon thread; None at EOF."""
    q: "queue.Queue[str | None]" = queue.Queue()

    def pump() -> None:
        for line in stream:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, name="test-demo-stdout", daemon=True).start()
    return q


def _read_until(q: "queue.Queue[str | None]", prefix: str, seen: list[str], deadline: float) -> str:
    """The first line starting with ``prefix``; every line read is appended to ``seen``."""
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {prefix!r} line in time:\n{''.join(seen)}"
        try:
            line = q.get(timeout=remaining)
        except queue.Empty:
            continue  # the assert above fails on the next turn
        assert line is not None, f"stdout closed before a {prefix!r} line:\n{''.join(seen)}"
        seen.append(line)
        if line.startswith(prefix):
            return line


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_keeps_the_metrics_up_after_the_run(stop_signal: signal.Signals) -> None:
    # --serve with a bound, so a broken signal path cannot hang the suite.
    proc = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "demo", "--passes", "2", "--progress", "off", "--serve", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        q = _lines(proc.stdout)  # type: ignore[arg-type]
        seen: list[str] = []
        deadline = time.monotonic() + 45
        url = _read_until(q, "metrics     ", seen, deadline).split()[1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        # The serving line comes after the whole report: the run is over.
        serving = _read_until(q, "serving     ", seen, deadline)
        assert any(line.startswith("clean stop  yes") for line in seen), "".join(seen)
        assert url in serving and "Ctrl-C" in serving and "SIGTERM" in serving, serving
        assert proc.poll() is None, "".join(seen)
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        assert _metric(text, "blobfeed_batches_total") >= 1
        assert _metric(text, "blobfeed_delivered_samples_total") == 2 * 1797

        proc.send_signal(stop_signal)
        rc = proc.wait(timeout=10)
        _read_until(q, "serving     stopped", seen, time.monotonic() + 5)
        err = proc.stderr.read()  # type: ignore[union-attr]
        # Stopping the serving is the documented way out: the run's status stands.
        assert rc == 0, "".join(seen) + err
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_serve_seconds_ends_by_itself(capsys: pytest.CaptureFixture[str]) -> None:
    rc = demo.main(["--passes", "1", "--serve", "0.1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"^serving     http://127\.0\.0\.1:\d+/metrics for 0\.1 s", out, re.M), out
    url = re.search(r"^metrics     (\S+)", out, re.M).group(1)  # type: ignore[union-attr]
    with pytest.raises(urllib.error.URLError):  # closed once serving ends
        urllib.request.urlopen(url, timeout=2)


def test_serve_is_rejected_when_negative(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--serve", "-1"]) == 2
    assert "--serve" in capsys.readouterr().err


def test_a_missing_package_names_the_install_that_works(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """blobfeed is not on the package index: the hint is the clone's form."""
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn -> ImportError
    assert demo.main(["--progress", "off"]) == 2
    err = capsys.readouterr().err
    assert "needs sklearn" in err, err
    assert "pip install -e '.[demo]'" in err, err
    assert "'blobfeed[" not in err, err


def _busy_port() -> "tuple[Any, int]":
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_a_busy_metrics_port_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """An operator's --metrics-port that is taken: exit 2 and one line naming
    the port, no traceback; the library's own error names it too."""
    from blobfeed.metrics import start_http_server

    sock, port = _busy_port()
    with sock:
        assert demo.main(["--passes", "1", "--progress", "off", "--metrics-port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"127.0.0.1:{port}" in err and "Traceback" not in err, err
        with pytest.raises(OSError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}") as info:
            start_http_server(port)
        assert info.value.errno is not None


@pytest.mark.parametrize("extra", [[], ["--model", "/nonexistent/model.onnx"]])
def test_a_busy_metrics_port_fails_first_with_one_line(
    extra: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24: the message said the port twice ("cannot serve metrics on
    127.0.0.1:P: [Errno 98] cannot serve metrics on 127.0.0.1:P: ..."), and
    came after the model was trained (or loaded): the port is bound first."""
    def no_training(seed: int) -> None:
        raise AssertionError("trained before the port was checked")

    monkeypatch.setattr(demo, "train_digits", no_training)
    sock, port = _busy_port()
    with sock:
        assert demo.main(["--passes", "1", "--progress", "off", "--metrics-port", str(port), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran: no dataset, model or feeding line
    lines = captured.err.splitlines()
    assert lines == [f"blobfeed demo: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use; "
                     "choose another --metrics-port, or 0 for any free port"], lines


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import blobfeed

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"blobfeed {blobfeed.__version__}\n"
    assert "--version" in cli.usage()


def test_sigterm_mid_run_says_so_and_exits_as_ctrl_c_does() -> None:
    """kill (or a container stop) during the run: a line on stderr, the
    threads stopped, exit 143, no traceback (it died silently with 143)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "demo", "--passes", "100000", "--progress", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        q = _lines(proc.stdout)  # type: ignore[arg-type]
        seen: list[str] = []
        _read_until(q, "metrics     ", seen, time.monotonic() + 45)  # the feed is wired, its handler set
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
        err = proc.stderr.read()  # type: ignore[union-attr]
        assert rc == 143, (rc, "".join(seen), err)
        assert "blobfeed demo: terminated (SIGTERM)" in err, err
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_coverage_holds_only_the_passes_in_flight() -> None:
    """The demo's memory must not grow with --passes (964 MB at 10 000: it
    kept arrays of n * passes).  Its check of "every position exactly once"
    holds a pass's counts only while the pass is in flight: 2 000 passes,
    delivered in batches that interleave three passes at a time, never hold
    more than four passes' counts, and the set of closed passes stays small."""
    n, passes, window, batch = 97, 2000, 3, 16
    cover = demo.Coverage(n, passes)
    rng = np.random.default_rng(0)
    most_open = most_bytes = most_closed = 0
    # positions in order, shuffled within windows of three passes, cut into batches
    for w0 in range(0, passes, window):
        block = np.arange(w0 * n, min(w0 + window, passes) * n)
        rng.shuffle(block)
        for i in range(0, len(block), batch):
            cover.add(block[i : i + batch])
            most_open = max(most_open, cover.open_passes)
            most_bytes = max(most_bytes, cover.held_bytes())
            most_closed = max(most_closed, len(cover._closed))
    assert cover.exact() and cover.problem() == ""
    assert most_open <= window + 1 and most_bytes <= (window + 1) * n * 4, (most_open, most_bytes)
    assert most_closed <= window + 1, most_closed
    assert cover.open_passes == 0 and cover.held_bytes() == 0


def test_coverage_counts_missing_and_repeated_positions() -> None:
    cover = demo.Coverage(10, 3)
    cover.add(np.arange(0, 10))  # pass 0 complete: closed
    cover.add(np.array([3, 3]))  # pass 0 again: one position, repeated
    cover.add(np.arange(10, 19))  # pass 1 lacks position 19
    cover.add(np.array([25, 25, 26, 31, -1]))  # pass 2: 25 twice; two out of range
    assert not cover.exact()
    assert cover.missing() == 1 + 8  # 19, and pass 2's all but 25 and 26
    assert cover.repeated == 2  # 3 (a closed pass) and 25
    assert cover.out_of_range == 2
    assert cover.problem() == "9 samples never scored, 2 scored more than once, 2 positions out of range"
    with pytest.raises(ValueError, match="passes >= 1"):
        demo.Coverage(10, 0)


def test_blocks_hand_on_concatenated_batches_and_hold_a_bounded_number() -> None:
    got: list[tuple[np.ndarray, np.ndarray]] = []
    blocks = demo.Blocks(3, lambda a, b: got.append((a, b)))
    for i in range(7):
        blocks.add(np.array([i, i]), np.array([10 * i]))
        assert len(blocks._held) < 3
    blocks.flush()
    assert [a.tolist() for a, _ in got] == [[0, 0, 1, 1, 2, 2], [3, 3, 4, 4, 5, 5], [6, 6]]
    assert [b.tolist() for _, b in got] == [[0, 10, 20], [30, 40, 50], [60]]
