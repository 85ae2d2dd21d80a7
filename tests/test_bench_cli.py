"""``blobfeed bench``: its --help, and the exit status CI can gate on.

Nothing here runs the full benchmark: the verdict is tested on synthetic
results, and the one real run is a fraction of a second per measurement.
No assertion is about speed.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from blobfeed import bench

ROOT = Path(__file__).resolve().parent.parent


def _result(**extra: Any) -> dict[str, Any]:
    r = {"batches_per_s": 100.0, "gb_per_s": 1.0, "first_batch_ms": 5.0, "peak_rss_mb": 50.0, "samples_lost": 0}
    r.update(extra)
    return r


def _passing_results() -> dict[str, dict[str, Any]]:
    """Per-(workload/runner) results, as run_all reports them, that meet every target."""
    return {
        "W1/blobfeed": _result(batches_per_s=300.0, wait_share=0.5),
        "W1/caffe2": _result(batches_per_s=100.0),
        "W2/blobfeed": _result(batches_per_s=500.0, gb_per_s=9.0, peak_rss_mb=40.0, wait_share=0.5),
        "W2/caffe2": _result(batches_per_s=100.0, peak_rss_mb=60.0, samples_lost=9000),
        "W2/copy": _result(gb_per_s=10.0),
        "W3/blobfeed": _result(batches_per_s=700.0, peak_rss_mb=40.0, wait_share=0.5),
        "W3/caffe2": _result(batches_per_s=100.0, peak_rss_mb=60.0, samples_lost=123),
        "W4/blobfeed": _result(ideal_ratio=0.95, ideal_batches_per_s=200.0, wait_share=0.5),
        "W4/caffe2": _result(),
        "W5/blobfeed": _result(model_ratio=0.95, wait_share=0.05),
        "W5/model": _result(),
        "W4/ideal": {"batches_per_s": 200.0},
    }


def _report(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"seconds": 5.0, "repeats": 3, "torch": False, "results": results, "python": "3.x", "cpus": 2}


def _run_main(monkeypatch: pytest.MonkeyPatch, results: dict[str, dict[str, Any]], *argv: str) -> int:
    """``bench.main`` with ``run_all`` replaced by canned results."""
    monkeypatch.setattr(bench, "run_all", lambda *a, **k: _report(copy.deepcopy(results)))
    return bench.main(["--workloads", "W1,W2,W3,W4,W5", *argv])


# --------------------------------------------------------------------------- --help
def test_help_shows_every_default_and_the_total_time() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "blobfeed.cli", "bench", "--help"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())  # argparse wraps lines
    assert "(default: W1,W2,W3,W4,W5)" in out
    assert "(default: 5 s)" in out
    assert "(default: 3)" in out
    assert "(default: none)" in out  # --json
    # The default invocation's length, before anyone starts it.
    m = re.search(r"The default invocation runs (\d+) measurements \((\d+) per repeat x 3 repeats\) "
                  r"and takes about (\d+) s \(([\d.]+) min\)", out)
    assert m, out
    assert int(m.group(1)) == 3 * int(m.group(2))
    assert int(m.group(3)) == round(bench.estimate_seconds(list(bench.WORKLOADS), 5.0, 3, bench._torch_available()))
    # ... and the exit status.
    assert "Exit status: 0 when every evaluated target is met" in out
    assert "1 when any target is missed" in out


def test_every_option_states_its_default() -> None:
    parser = bench.build_parser()
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction):
            continue
        assert "(default:" in action.help, action.option_strings


def test_estimate_matches_the_measured_default_run() -> None:
    # A model of the run's length, not a measurement: the default invocation
    # without torch took about 212 s on this project's 2-core machine.
    est = bench.estimate_seconds(list(bench.WORKLOADS), 5.0, 3, torch=False)
    assert 180 <= est <= 250
    assert bench.estimate_seconds(["W1"], 5.0, 3, torch=False) < est
    assert bench.estimate_seconds(list(bench.WORKLOADS), 5.0, 3, torch=True) > est
    assert bench.estimate_seconds(list(bench.WORKLOADS), 5.0, 1, torch=False) == pytest.approx(est / 3)


# --------------------------------------------------------------------------- the verdict
def test_all_targets_met_exits_0(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_main(monkeypatch, _passing_results()) == 0
    out = capsys.readouterr().out
    assert "MISSED" not in out
    n = len(bench.evaluate(_report(_passing_results())))
    assert re.search(rf"^verdict: all {n} targets met$", out, re.M), out


def test_a_missed_target_exits_1_and_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    results = _passing_results()
    results["W1/blobfeed"]["batches_per_s"] = 150.0  # 1.5x Caffe2, target 2x
    results["W5/blobfeed"]["wait_share"] = 0.2
    assert _run_main(monkeypatch, results) == 1
    out = capsys.readouterr().out
    n = len(bench.evaluate(_report(results)))
    assert re.search(rf"^verdict: MISSED 2 of {n} targets:$", out, re.M), out
    assert re.search(r"^  W1 batches/s vs Caffe2 >= 2\.0: measured 1\.50$", out, re.M), out
    assert re.search(r"^  W5 model waits for input < 10 %: measured 0\.20$", out, re.M), out


@pytest.mark.parametrize("workload", ["W1", "W2", "W3", "W4", "W5"])
def test_a_lost_sample_exits_1(
    workload: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = _passing_results()
    results[f"{workload}/blobfeed"]["samples_lost"] = 1
    assert _run_main(monkeypatch, results) == 1
    assert re.search(rf"^  {workload} samples lost == 0: measured 1$", capsys.readouterr().out, re.M)


def test_a_sample_lost_in_one_repeat_is_not_hidden_by_the_median() -> None:
    ok = _result(wait_share=0.5)
    lossy = _result(wait_share=0.5, samples_lost=7)
    raw = {
        ("W1", "blobfeed"): [ok, lossy, ok],
        ("W1", "caffe2"): [_result(batches_per_s=10.0)] * 3,
    }
    results = bench.summarize(raw)
    assert results["W1/blobfeed"]["samples_lost"] == 0  # the median
    assert results["W1/blobfeed"]["samples_lost_total"] == 7
    status, lines = bench.verdict(bench.evaluate(_report(results)))
    assert status == 1
    assert "  W1 samples lost == 0: measured 7" in lines


def test_nothing_evaluated_is_not_a_pass() -> None:
    status, lines = bench.verdict([])
    assert status == 1 and "no target" in lines[0]


def test_json_records_the_verdict(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = _passing_results()
    results["W3/blobfeed"]["peak_rss_mb"] = 80.0  # more than Caffe2's 60
    path = tmp_path / "bench.json"
    assert _run_main(monkeypatch, results, "--json", str(path)) == 1
    saved = json.loads(path.read_text())
    assert saved["passed"] is False
    missed = [t for t in saved["targets"] if not t["ok"]]
    assert [(t["workload"], t["target"]) for t in missed] == [("W3", "peak RSS <= Caffe2's")]


# --------------------------------------------------------------------------- one real run
def test_a_tiny_real_run_exits_as_its_verdict_says() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "blobfeed.cli", "bench", "--workloads", "W1", "--seconds", "0.2", "--repeats", "1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    out = proc.stdout
    assert re.search(r"^W1/blobfeed ", out, re.M), out + proc.stderr
    m = re.search(r"^verdict: (all \d+ targets met|MISSED (\d+) of \d+ targets:)$", out, re.M)
    assert m, out + proc.stderr
    missed_rows = re.findall(r"  MISSED$", out, re.M)
    if m.group(1).startswith("all"):
        assert proc.returncode == 0 and not missed_rows, out
    else:
        assert proc.returncode == 1, out
        assert len(missed_rows) == int(m.group(2)), out
    assert "about" in proc.stderr  # the estimate, printed before the run
