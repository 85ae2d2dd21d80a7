"""``blobfeed bench``: its --help, and the exit status CI can gate on.

Nothing here runs the full benchmark: the verdict is tested on synthetic
results, and the real runs are a fraction of a second per measurement.
No assertion is about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import json
import multiprocessing
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blobfeed.apps.bench import autobench, cli, direct, measure, report, runner, service, workloads
from blobfeed.apps.bench.peers import base, ray_data
from tests.helpers import fds_opened_since, open_fds

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = cli.DEFAULT_WORKLOADS.split(",")


def _result(**extra: Any) -> dict[str, Any]:
    r = {"batches_per_s": 100.0, "gb_per_s": 1.0, "first_batch_ms": 5.0, "peak_rss_mb": 50.0, "samples_lost": 0}
    r.update(extra)
    return r


def _costs(**who: tuple[float, float]) -> dict[str, float]:
    """Per-batch costs as the service's runners report them: ``who``, service
    or consumer, spent (CPU us, context switches) per batch."""
    out = {}
    for name, (cpu, ctx) in who.items():
        out[f"{name}_cpu_us_per_batch"] = cpu
        out[f"{name}_ctx_per_batch"] = ctx
    return out


def _passing_results() -> dict[str, dict[str, Any]]:
    """Per-(workload/runner) results of W1-W5, as run_all reports them, that
    meet every target; no peer ran (as where torch and grain are missing)."""
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


def _peer_results() -> dict[str, dict[str, Any]]:
    """The new workloads and every peer, meeting every target."""
    procs = {"batches_per_s": 100.0, "pss_mb": 300.0}
    return {
        "W1/grain0": _result(batches_per_s=250.0),
        "W1/torch0": _result(batches_per_s=50.0),
        "W1/torch0it": _result(batches_per_s=290.0),
        "W2/grain0": _result(batches_per_s=450.0),
        "W2/torch0": _result(batches_per_s=400.0),
        "W2/torch0it": _result(batches_per_s=480.0),
        # Ray Data, against W1/blobfeed (300), W2/blobfeed (500), W3/blobfeed (700)
        "W1/raydata": _result(batches_per_s=30.0, pss_mb=1500.0),
        "W2/raydata": _result(batches_per_s=60.0, pss_mb=3000.0),
        "W3/raydata": _result(batches_per_s=35.0, pss_mb=1800.0),
        "W6/blobfeed": _result(ideal_ratio=0.9, ideal_batches_per_s=30.0),
        **{f"{w}/blobfeed": _result(batches_per_s=1000.0, pss_mb=200.0, first_batch_ms=300.0,
                                    ideal_ratio=0.9, ideal_batches_per_s=500.0)
           for w in ("W1p", "W2p", "W4p", "W6p")},
        **{f"{w}/{p}": _result(**procs) for w in ("W1p", "W2p", "W4p", "W6p") for p in workloads.PROCESS_PEERS},
        # the ordered modes, against W1/blobfeed (300), W2/blobfeed (500) and W4p/blobfeed (1000)
        "W1d/blobfeed": _result(batches_per_s=270.0),
        "W2d/blobfeed": _result(batches_per_s=450.0),
        "W4pd/blobfeed": _result(batches_per_s=950.0, pss_mb=200.0, ideal_ratio=0.85, ideal_batches_per_s=500.0),
        "W1s/blobfeed": _result(batches_per_s=180.0),
        "W2s/blobfeed": _result(batches_per_s=250.0),  # 0.5 x W2: the target's edge, met
        # the feeding service: S1 1.3 x the pipelines, half their PSS, 0.65 x the copy bound, 6.5 x Ray
        # Data; S2 0.6 x, 6 x Ray Data, 20 us of CPU per batch beyond the pipelines'; S8 0.92 x S1
        "S1/service": _result(batches_per_s=130.0, gb_per_s=1.3, pss_mb=300.0, first_batch_ms=900.0,
                              **_costs(service=(2000.0, 70.0), consumer=(300.0, 3.0))),
        "S1/pipes": _result(batches_per_s=100.0, gb_per_s=1.0, pss_mb=600.0, first_batch_ms=2000.0,
                            **_costs(consumer=(2100.0, 12.0)),
                            **service.pipeline_steps({"consumer0": measure.Usage(0.06, 800),
                                                      "consumer0 workers": measure.Usage(0.15, 400)}, 100)),
        "S1/copy": _result(batches_per_s=200.0, gb_per_s=2.0),
        "S1/raysplit": _result(batches_per_s=20.0, pss_mb=2400.0),
        "S2/service": _result(batches_per_s=600.0, pss_mb=200.0, **_costs(service=(100.0, 2.5), consumer=(60.0, 1.5))),
        "S2/pipes": _result(batches_per_s=1000.0, pss_mb=150.0, **_costs(consumer=(140.0, 0.5))),
        "S2/raysplit": _result(batches_per_s=100.0, pss_mb=2200.0),
        "S8/service": _result(batches_per_s=120.0, gb_per_s=1.2, pss_mb=400.0,
                              **_costs(service=(2200.0, 80.0), consumer=(320.0, 3.0))),
        "attach/service": {"first_batch_ms": 12.0, "attach_ms_max": 20.0, "attach_cycles": 5, "peak_rss_mb": 300.0,
                           "samples_lost": 0},
        # random-access sources: W1i 0.93 x W1 (300), W2i 0.94 x W2 (500); W7 shuffled 0.91 x its
        # sequential read, 1.67 x the best of its peers (grainmap2, 120)
        "W1i/blobfeed": _result(batches_per_s=280.0),
        "W2i/blobfeed": _result(batches_per_s=470.0),
        "W7/blobfeed": _result(batches_per_s=200.0, pss_mb=2100.0),
        "W7/sequential": _result(batches_per_s=220.0, pss_mb=2100.0),
        # the work alone, no pipeline: 2.5 x the best peer; blobfeed 0.67 x it
        "W7/work2": {k: v for k, v in _result(batches_per_s=300.0, pss_mb=2000.0).items() if k != "samples_lost"},
        **{f"W7/{p}": {k: v for k, v in _result(batches_per_s=120.0 if p == "grainmap2" else 60.0 + 5 * i,
                                                pss_mb=2000.0).items() if k != "samples_lost"}
           for i, p in enumerate(workloads.W7_PEERS)},
    }


def _report(results: dict[str, dict[str, Any]], **extra: Any) -> dict[str, Any]:
    report = {"seconds": 5.0, "repeats": 3, "torch": False, "results": results, "python": "3.x", "cpus": 2}
    report.update(extra)
    return report


def _run_main(monkeypatch: pytest.MonkeyPatch, results: dict[str, dict[str, Any]], *argv: str, **extra: Any) -> int:
    """``cli.main`` with ``run_all`` replaced by canned results."""
    monkeypatch.setattr(cli, "run_all", lambda *a, **k: _report(copy.deepcopy(results), **extra))
    return cli.main(["--workloads", "all", *argv])


def _evaluated(results: dict[str, dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    return [row for row in report.evaluate(_report(results, **extra)) if row["ok"] is not None]


def _row(rows: list[dict[str, Any]], workload: str, target_start: str) -> dict[str, Any]:
    found = [r for r in rows if r["workload"] == workload and r["target"].startswith(target_start)]
    assert len(found) == 1, (workload, target_start, rows)
    return found[0]


# --------------------------------------------------------------------------- --help
def test_help_shows_every_default_and_the_total_time() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "blobfeed.apps.cli", "bench", "--help"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())  # argparse wraps lines
    assert "(default: W1,W2,W3,W4,W5)" in out
    assert "(default: 5 s)" in out
    assert "(default: 3)" in out
    assert "(default: none)" in out  # --json
    assert f"{', '.join(workloads.WORKLOADS)}, or all" in out  # every workload, and the whole set
    assert "W7, A4p," in out
    # the auto workloads are opt-in, by name
    assert "or all, or auto (the auto workloads A4p, A6p, A2p, Aio)" in out
    m = re.search(r"--workloads auto \(the auto workloads, opt-in\) runs (\d+) measurements .*? about (\d+) s", out)
    assert m and int(m.group(2)) == round(runner.estimate_seconds(list(autobench.AUTO_IDS), 5.0, 3,
                                                                   runner.available_packages()))
    # W7 is opt-in, and the help says its first run writes a 2 GB file, and where
    assert "W7" not in DEFAULT
    assert "the first run that includes W7 writes W7's record file, 2 GB, into" in out
    assert workloads.W7_VERSION in out
    # The default invocation's length, before anyone starts it ...
    m = re.search(r"The default invocation runs (\d+) measurements \((\d+) per repeat x 3 repeats\) "
                  r"and takes about (\d+) s \(([\d.]+) min\)", out)
    assert m, out
    assert int(m.group(1)) == 3 * int(m.group(2))
    packages = runner.available_packages()
    assert int(m.group(3)) == round(runner.estimate_seconds(DEFAULT, 5.0, 3, packages))
    # ... and that of --workloads all.
    m = re.search(r"--workloads all runs (\d+) measurements \((\d+) per repeat x 3 repeats\) "
                  r"and takes about (\d+) s", out)
    assert m, out
    assert int(m.group(3)) == round(runner.estimate_seconds(list(workloads.WORKLOADS), 5.0, 3, packages))
    # ... and the exit status.
    assert "Exit status: 0 when every evaluated target is met" in out
    assert "1 when any target is missed" in out
    assert "not evaluated" in out


def test_every_option_states_its_default() -> None:
    parser = cli.build_parser()
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction):
            continue
        assert "(default:" in action.help, action.option_strings


def test_estimate_matches_the_measured_default_run() -> None:
    # A model of the run's length, not a measurement: the default invocation
    # without torch and grain took about 212 s on this project's 2-core machine.
    est = runner.estimate_seconds(DEFAULT, 5.0, 3, {"PIL"})
    assert 180 <= est <= 250
    assert runner.estimate_seconds(["W1"], 5.0, 3, {"PIL"}) < est
    with_peers = runner.estimate_seconds(DEFAULT, 5.0, 3, {"PIL", "torch", "grain"})
    assert with_peers > est
    assert runner.estimate_seconds(list(workloads.WORKLOADS), 5.0, 3, {"PIL", "torch", "grain"}) > with_peers
    assert runner.estimate_seconds(DEFAULT, 5.0, 1, {"PIL"}) == pytest.approx(est / 3)


def test_the_plan_skips_what_is_not_installed() -> None:
    plan = runner._plan(["W1", "W1p", "W6"], {"PIL"})
    assert ("W1p", "pool") in plan  # the standard library's Pool always runs
    assert not [r for _, r in plan if r.startswith(("torch", "grain"))]
    assert ("W6", "blobfeed") in plan
    assert ("W6", "blobfeed") not in runner._plan(["W6"], set())  # no Pillow: no W6
    assert runner._skipped_workloads(["W1", "W6", "W6p"], set()) == {
        "W6": "PIL not installed", "W6p": "PIL not installed",
    }
    everything = runner._plan(list(workloads.WORKLOADS), {"PIL", "torch", "grain"})
    for w in ("W1p", "W2p", "W4p", "W6p"):
        assert {r for x, r in everything if x == w} == {"blobfeed", *workloads.PROCESS_PEERS}


def test_ray_data_is_a_peer_of_w1_w2_w3_only_where_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    # no Ray started: the plan and the check of what is installed
    for w in ("W1", "W2", "W3"):
        assert (w, "raydata") in runner._plan([w], {"PIL", "ray", "ray.data"})
        assert (w, "raydata") not in runner._plan([w], {"PIL", "ray"})  # Ray without ray[data]
    assert not [p for p in runner._plan(list(workloads.WORKLOADS), {"PIL", "ray", "ray.data"})
                if p[1] == "raydata" and p[0] not in ("W1", "W2", "W3")]
    with_it = runner.estimate_seconds(["W1", "W2", "W3"], 2.0, 3, {"PIL", "ray", "ray.data"})
    assert with_it == pytest.approx(runner.estimate_seconds(["W1", "W2", "W3"], 2.0, 3, {"PIL"})
                                    + 3 * 3 * (runner.CHILD_OVERHEAD_S + runner.WARMUP_S + 2.0 + runner.RAYDATA_EXTRA_S))
    # find_spec("ray.data") succeeds without pandas and pyarrow, the import does not
    monkeypatch.setattr(runner, "installed", lambda m: m in ("ray", "ray.data", "fsspec"))
    assert "ray.data" not in runner.available_packages()
    monkeypatch.setattr(runner, "installed", lambda m: m in ray_data.RAYDATA_NEEDS)
    assert "ray.data" in runner.available_packages()


def test_workloads_parse_by_name_in_any_case_or_all() -> None:
    assert cli.parse_workloads("w1p, W2") == ["W1p", "W2"]
    assert cli.parse_workloads("all") == list(workloads.WORKLOADS)
    assert cli.parse_workloads("W6p,all") == ["W6p"] + [w for w in workloads.WORKLOADS if w != "W6p"]
    with pytest.raises(ValueError, match="W9"):
        cli.parse_workloads("W1,W9")


def test_an_unknown_workload_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--workloads", "W1,W9"])
    assert exc.value.code == 2
    assert "W9" in capsys.readouterr().err


# --------------------------------------------------------------------------- the verdict
def test_all_targets_met_exits_0(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    results = {**_passing_results(), **_peer_results()}
    assert _run_main(monkeypatch, results) == 0
    out = capsys.readouterr().out
    assert "MISSED" not in out
    assert "not evaluated" not in out
    n = len(_evaluated(results))
    assert n == len(report.evaluate(_report(results)))
    assert re.search(rf"^verdict: all {n} targets met$", out, re.M), out


def test_a_missed_target_exits_1_and_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    results = _passing_results()
    results["W1/blobfeed"]["batches_per_s"] = 150.0  # 1.5x Caffe2, target 2x
    results["W5/blobfeed"]["wait_share"] = 0.2
    assert _run_main(monkeypatch, results) == 1
    out = capsys.readouterr().out
    n = len(_evaluated(results))
    assert re.search(rf"^verdict: MISSED 2 of {n} targets:$", out, re.M), out
    assert re.search(r"^  W1 batches/s vs Caffe2 >= 2\.0: measured 1\.50$", out, re.M), out
    assert re.search(r"^  W5 model waits for input < 10 %: measured 0\.20$", out, re.M), out


@pytest.mark.parametrize("workload", ["W1", "W2", "W3", "W4", "W5", "W6", "W1p", "W2p", "W4p", "W6p",
                                      "W1d", "W2d", "W4pd", "W1s", "W2s", "W1i", "W2i", "W7"])
def test_a_lost_sample_exits_1(
    workload: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {**_passing_results(), **_peer_results()}
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
    results = report.summarize(raw)
    assert results["W1/blobfeed"]["samples_lost"] == 0  # the median
    assert results["W1/blobfeed"]["samples_lost_total"] == 7
    status, lines = report.verdict(report.evaluate(_report(results)))
    assert status == 1
    assert "  W1 samples lost == 0: measured 7" in lines


def test_summarize_adds_the_ideal_rows() -> None:
    raw = {("W6p", "blobfeed"): [_result(ideal_batches_per_s=v, ideal_ratio=0.9) for v in (20.0, 30.0, 25.0)]}
    assert report.summarize(raw)["W6p/ideal"] == {"batches_per_s": 25.0}


def test_nothing_evaluated_is_not_a_pass() -> None:
    status, lines = report.verdict([])
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
    missed = [t for t in saved["targets"] if t["ok"] is False]
    assert [(t["workload"], t["target"]) for t in missed] == [("W3", "peak RSS <= Caffe2's")]
    # the in-process peers did not run: those targets are recorded, not evaluated
    assert {(t["workload"], t["ok"]) for t in saved["targets"] if "in-process peer" in t["target"]} == {
        ("W1", None), ("W2", None),
    }


# --------------------------------------------------------------------------- peers: missing, partial, missed
def test_a_target_whose_peer_is_missing_is_not_evaluated_not_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {**_passing_results(), **_peer_results()}
    for key in [k for k in results if k.split("/")[1] in workloads.PROCESS_PEERS + workloads.IN_PROCESS_PEERS]:
        del results[key]  # neither grain, nor torch, nor even the Pool
    rows = report.evaluate(_report(results))
    for wl, target in [("W1", "batches/s vs the best in-process peer"), ("W2", "batches/s vs the best in-process peer"),
                       ("W1p", "batches/s vs the best process peer"), ("W2p", "batches/s vs the best process peer"),
                       ("W2p", "total PSS <= grain's")]:
        row = _row(rows, wl, target)
        assert row["ok"] is None and row["ratio"] is None
        assert row["detail"].startswith("peer missing: ")
    assert _run_main(monkeypatch, results) == 0
    out = capsys.readouterr().out
    n = len(_evaluated(results))
    assert re.search(rf"^verdict: all {n} targets met$", out, re.M), out
    assert re.search(r"^W2p total PSS <= grain's +- +not evaluated \(peer missing\)  \[grain2, grain2b\]$", out, re.M), out
    assert re.search(r"^  not evaluated: W1p batches/s vs the best process peer >= 1\.5 \(peer missing: ", out, re.M), out
    assert "MISSED" not in out


def test_only_missing_peers_is_not_a_pass(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [report._row("W2p", "total PSS <= grain's", None, None, "peer missing: grain2, grain2b")]
    status, lines = report.verdict(rows)
    assert status == 1
    assert lines[0] == "verdict: no target could be evaluated"


def test_a_peer_target_uses_the_best_peer_that_ran_and_names_the_missing() -> None:
    results = {**_passing_results(), **_peer_results()}
    for key in [k for k in results if "/grain" in k]:
        del results[key]  # torch and the Pool ran, grain did not
    results["W1p/pool"]["batches_per_s"] = 400.0
    row = _row(report.evaluate(_report(results)), "W1p", "batches/s vs the best process peer")
    assert row["ok"] is True
    assert row["ratio"] == pytest.approx(1000.0 / 400.0)
    assert row["detail"] == "best: pool; not run: grain2, grain2b"
    pss = _row(report.evaluate(_report(results)), "W2p", "total PSS")
    assert pss["ok"] is None  # the memory target compares with grain only


@pytest.mark.parametrize(
    ("change", "line"),
    [
        (("W1p/pool", "batches_per_s", 800.0), r"  W1p batches/s vs the best process peer >= 1\.5: measured 1\.25 \(best: pool\)"),
        (("W2p/torch2", "batches_per_s", 600.0), r"  W2p batches/s vs the best process peer >= 2\.0: measured 1\.67 \(best: torch2\)"),
        (("W1/torch0it", "batches_per_s", 400.0), r"  W1 batches/s vs the best in-process peer >= 1\.0: measured 0\.75 \(best: torch0it\)"),
        (("W2/grain0", "batches_per_s", 1000.0), r"  W2 batches/s vs the best in-process peer >= 1\.0: measured 0\.50 \(best: grain0\)"),
        (("W3/raydata", "batches_per_s", 1400.0), r"  W3 batches/s vs Ray Data >= 1\.0: measured 0\.50 \(best: raydata\)"),
        (("W2p/blobfeed", "pss_mb", 400.0), r"  W2p total PSS <= grain's: measured 1\.33 \(400 MiB against 300 MiB\)"),
        (("W4p/blobfeed", "ideal_ratio", 0.8), r"  W4p batches/s vs the two-core ideal >= 0\.85: measured 0\.80"),
        (("W6p/blobfeed", "ideal_ratio", 0.5), r"  W6p batches/s vs the two-core ideal >= 0\.85: measured 0\.50"),
        (("W1p/blobfeed", "first_batch_ms", 650.0), r"  W1p first batch <= 500 ms: measured 650\.00"),
        (("W1d/blobfeed", "batches_per_s", 210.0), r"  W1d batches/s vs W1 >= 0\.8: measured 0\.70"),
        (("W2d/blobfeed", "batches_per_s", 350.0), r"  W2d batches/s vs W2 >= 0\.8: measured 0\.70"),
        (("W4pd/blobfeed", "batches_per_s", 850.0), r"  W4pd batches/s vs W4p >= 0\.9: measured 0\.85"),
        (("W1s/blobfeed", "batches_per_s", 120.0), r"  W1s batches/s vs W1 >= 0\.5: measured 0\.40"),
        (("W2s/blobfeed", "batches_per_s", 245.0), r"  W2s batches/s vs W2 >= 0\.5: measured 0\.49"),
        (("S1/pipes", "batches_per_s", 120.0),
         r"  S1 batches/s vs four independent process pipelines >= 1\.2: measured 1\.08"),
        (("S1/service", "pss_mb", 420.0),
         r"  S1 total PSS vs four independent process pipelines <= 0\.5: measured 0\.70 \(420 MiB against 600 MiB\)"),
        (("S1/copy", "gb_per_s", 2.6), r"  S1 GB/s vs the copy bound >= 0\.6: measured 0\.50"),
        (("S2/pipes", "batches_per_s", 2400.0),
         r"  S2 batches/s vs four independent thread pipelines >= 0\.3: measured 0\.25"),
        (("S2/raysplit", "batches_per_s", 150.0),
         r"  S2 batches/s vs Ray Data streaming_split\(4\) >= 5\.0: measured 4\.00"),
        (("S1/raysplit", "batches_per_s", 30.0),
         r"  S1 batches/s vs Ray Data streaming_split\(4\) >= 5\.0: measured 4\.33"),
        (("S8/service", "batches_per_s", 110.0), r"  S8 total batches/s vs S1's >= 0\.9: measured 0\.85"),
        (("S2/service", "consumer_cpu_us_per_batch", 71.0),
         r"  S2 service\+consumer CPU per batch beyond the pipelines' own <= 30 us: measured 31\.00 "
         r"\(171 us against the pipelines' 140 us\)"),
        (("attach/service", "first_batch_ms", 65.0),
         r"  attach first batch after attach_source <= 50 ms: measured 65\.00 \(slowest of 5: 20 ms\)"),
        (("W1i/blobfeed", "batches_per_s", 240.0), r"  W1i batches/s vs W1 >= 0\.9: measured 0\.80"),
        (("W2i/blobfeed", "batches_per_s", 440.0), r"  W2i batches/s vs W2 >= 0\.9: measured 0\.88"),
        (("W7/sequential", "batches_per_s", 400.0),
         r"  W7 batches/s shuffled vs its own sequential read >= 0\.8: measured 0\.50"),
        (("W7/torchmap4", "batches_per_s", 160.0),
         r"  W7 batches/s vs torch's and grain's map-style loaders at their best worker count >= 1\.5: "
         r"measured 1\.25 \(best: torchmap4; work2, the work alone with no pipeline: 1\.88 x torchmap4, "
         r"blobfeed 0\.67 x it\)"),
    ],
)
def test_a_missed_new_target_exits_1(
    change: tuple[str, str, float], line: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {**_passing_results(), **_peer_results()}
    key, metric, value = change
    results[key][metric] = value
    assert _run_main(monkeypatch, results) == 1
    out = capsys.readouterr().out
    n = len(_evaluated(results))
    assert re.search(rf"^verdict: MISSED 1 of {n} targets:$", out, re.M), out
    assert re.search(rf"^{line}$", out, re.M), out
    assert len(re.findall(r"  MISSED$", out, re.M)) == 1, out


def test_ordered_modes_are_set_against_their_default_mode_in_the_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {**_passing_results(), **_peer_results()}
    assert _run_main(monkeypatch, results) == 0
    out = capsys.readouterr().out
    assert re.search(r"^W1d/blobfeed +.* 0\.90 x W1$", out, re.M), out
    assert re.search(r"^W1s/blobfeed +.* 0\.60 x W1$", out, re.M), out
    assert re.search(r"^W2s/blobfeed +.* 0\.50 x W2$", out, re.M), out
    assert re.search(r"^W4pd/blobfeed +.* 0\.95 x W4p$", out, re.M), out
    assert re.search(r"^W1d batches/s vs W1 >= 0\.8 +0\.90  ok$", out, re.M), out
    # shuffling's targets: half the default mode's rate, in the same run
    assert re.search(r"^W1s batches/s vs W1 >= 0\.5 +0\.60  ok$", out, re.M), out
    assert re.search(r"^W2s batches/s vs W2 >= 0\.5 +0\.50  ok$", out, re.M), out
    summarized = report.summarize({("W1", "blobfeed"): [_result(batches_per_s=200.0)],
                                  ("W1s", "blobfeed"): [_result(batches_per_s=50.0)]})
    assert summarized["W1s/blobfeed"]["base_ratio"] == 0.25  # in --json too


def test_an_ordered_mode_without_its_default_mode_is_not_evaluated() -> None:
    results = {**_passing_results(), **_peer_results()}
    del results["W4p/blobfeed"]
    row = _row(report.evaluate(_report(results)), "W4pd", "batches/s vs W4p")
    assert row["ok"] is None and row["detail"] == "W4p not in this run"
    del results["W2/blobfeed"]
    row = _row(report.evaluate(_report(results)), "W2s", "batches/s vs W2")
    assert row["ok"] is None and row["detail"] == "W2 not in this run"
    assert "base_ratio" not in report.summarize({("W2d", "blobfeed"): [_result()]})["W2d/blobfeed"]


def test_a_workload_skipped_for_want_of_pillow_is_not_evaluated(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {k: v for k, v in {**_passing_results(), **_peer_results()}.items() if not k.startswith("W6")}
    skipped = {"W6": "PIL not installed", "W6p": "PIL not installed"}
    assert _run_main(monkeypatch, results, skipped=skipped) == 0
    out = capsys.readouterr().out
    assert re.search(r"^W6p/\* +skipped: PIL not installed$", out, re.M), out
    assert "  not evaluated: W6p every target (workload skipped: PIL not installed)" in out


# --------------------------------------------------------------------------- the feeding service: S1, S2, S8, attach
@pytest.mark.parametrize(("workload", "runner_"), [
    ("S1", "service"), ("S1", "pipes"), ("S2", "service"), ("S2", "pipes"), ("attach", "service"),
])
def test_a_sample_lost_by_the_service_or_a_pipeline_exits_1(
    workload: str, runner_: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {**_passing_results(), **_peer_results()}
    results[f"{workload}/{runner_}"]["samples_lost"] = 1
    assert _run_main(monkeypatch, results) == 1
    assert re.search(rf"^  {workload} samples lost == 0 \({runner_}\): measured 1$", capsys.readouterr().out, re.M)


def test_the_service_targets_and_the_attach_row(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_main(monkeypatch, {**_passing_results(), **_peer_results()}) == 0
    out = capsys.readouterr().out
    for line in [
        r"S1 GB/s vs the copy bound >= 0\.6 +0\.65  ok",
        r"S1 batches/s vs four independent process pipelines >= 1\.2 +1\.30  ok",
        r"S1 total PSS vs four independent process pipelines <= 0\.5 +0\.50  ok  \[300 MiB against 600 MiB\]",
        r"S2 batches/s vs four independent thread pipelines >= 0\.3 +0\.60  ok",
        r"S8 total batches/s vs S1's >= 0\.9 +0\.92  ok",
        r"S1 batches/s vs Ray Data streaming_split\(4\) >= 5\.0 +6\.50  ok",
        r"S2 batches/s vs Ray Data streaming_split\(4\) >= 5\.0 +6\.00  ok",
        r"S2 service\+consumer CPU per batch beyond the pipelines' own <= 30 us +20\.00  ok  "
        r"\[160 us against the pipelines' 140 us\]",
        r"attach first batch after attach_source <= 50 ms +12\.00  ok  \[slowest of 5: 20 ms\]",
        r"S1 samples lost == 0 \(pipes\) +0  ok",
        r"S8 samples lost == 0 \(service\) +0  ok",
    ]:
        assert re.search(rf"^{line}$", out, re.M), (line, out)
    lines = out.splitlines()
    top = lines.index(next(line for line in lines if line.startswith("workload/runner")))
    cells = {r["workload/runner"]: r for r in _column_cells(lines[top: lines.index("", top)])}
    # attach times attaching, not a rate: its other cells say "not measured"
    assert cells["attach/service"] == {
        "workload/runner": "attach/service", "batches/s": "-", "GB/s": "-", "peak RSS MB": "300", "PSS MB": "-",
        "first ms": "12.0", "lost": "0", "vs ideal": "", "vs base": "",
    }
    assert cells["S1/service"]["PSS MB"] == "300"


def test_without_ray_data_the_streaming_split_targets_say_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {k: v for k, v in {**_passing_results(), **_peer_results()}.items() if not k.endswith("/raysplit")}
    rows = report.evaluate(_report(results))
    for wl in ("S1", "S2"):
        row = _row(rows, wl, "batches/s vs Ray Data streaming_split(4)")
        assert row["ok"] is None and row["ratio"] is None
        assert row["detail"] == "peer missing: raysplit (ray[data] not installed)"
    # installed, yet it did not run (the run was cut short): no reason is made up
    row = _row(report.evaluate(_report(results, raydata=True)), "S1", "batches/s vs Ray Data")
    assert row["detail"] == "peer missing: raysplit"
    assert _run_main(monkeypatch, results) == 0
    out = capsys.readouterr().out
    assert re.search(r"^S1 batches/s vs Ray Data streaming_split\(4\) >= 5\.0 +- +not evaluated \(peer missing\)  "
                     r"\[raysplit \(ray\[data\] not installed\)\]$", out, re.M), out


def test_the_service_workloads_are_opt_in_and_named_like_the_others() -> None:
    service_wls = ["S1", "S2", "attach"]
    assert not set(DEFAULT) & set(service_wls)  # 4 consumer processes each: not in the default run
    assert cli.parse_workloads("s1,ATTACH") == ["S1", "attach"]
    assert cli.build_parser().parse_args(["--workload", "S1"]).workloads == "S1"  # argparse takes the prefix
    assert runner._plan(service_wls, {"PIL"}) == [
        ("S1", "service"), ("S1", "pipes"), ("S1", "direct"), ("S1", "ledger"), ("S1", "copy"), ("S1", "copy2"),
        ("S2", "service"),
        ("S2", "pipes"),
        ("S2", "bare"), ("attach", "service"),
    ]
    with_ray = runner._plan(service_wls, {"PIL", "ray", "ray.data"})
    assert [p for p in with_ray if p[1] == "raysplit"] == [("S1", "raysplit"), ("S2", "raysplit")]
    one = runner.CHILD_OVERHEAD_S + runner.WARMUP_S + 5.0
    assert runner.estimate_seconds(service_wls, 5.0, 3, {"PIL", "ray", "ray.data"}) == pytest.approx(
        runner.estimate_seconds(service_wls, 5.0, 3, {"PIL"}) + 3 * 2 * (one + runner.RAYSPLIT_EXTRA_S))
    assert runner.estimate_seconds(["S1"], 5.0, 1, {"PIL"}) > 3 * one  # four consumers' start on top


def test_s2_serves_from_threads_and_s8_is_s1_with_eight_consumers() -> None:
    """Issue 25 item 4: the service uses the backend a user would pick (threads
    for W1's trivial fetcher), and S8 shows one service past 4 consumers."""
    wls = workloads.WORKLOADS
    assert (wls["S2"].backend, wls["S2"].pipes_backend) == ("threads", "threads")
    assert (wls["S1"].backend, wls["S1"].pipes_backend) == ("processes", "processes")
    s1, s8 = wls["S1"], wls["S8"]
    assert (s8.consumers, s1.consumers) == (8, 4)
    assert (s8.fetcher, s8.batch, s8.blobs, s8.backend) == (s1.fetcher, s1.batch, s1.blobs, s1.backend)
    assert runner._plan(["S8"], {"PIL", "ray", "ray.data"}) == [("S8", "service")]
    assert runner.measurement_seconds("S8", "service", 5.0) > runner.measurement_seconds("S1", "service", 5.0)
    assert runner.measurement_seconds("S2", "service", 5.0) < runner.measurement_seconds("S1", "service", 5.0)
    assert not {"S8"} & set(DEFAULT)


def test_s8_against_s1_is_not_evaluated_without_s1() -> None:
    results = {**_passing_results(), **_peer_results()}
    row = _row(report.evaluate(_report(results)), "S8", "total batches/s vs S1's")
    assert row["ok"] is True and row["ratio"] == pytest.approx(120 / 130)
    del results["S1/service"]
    row = _row(report.evaluate(_report(results)), "S8", "total batches/s vs S1's")
    assert row["ok"] is None and row["detail"] == "S1/service not in this run"
    results["S1/service"] = {"failed": "repetition 1: exited with status 1: boom"}
    row = _row(report.evaluate(_report(results)), "S8", "total batches/s vs S1's")
    assert row["ok"] is None and row["detail"] == "measurement failed: S1/service"


def test_the_cpu_target_needs_both_sides_costs() -> None:
    results = {**_passing_results(), **_peer_results()}
    del results["S2/pipes"]["consumer_cpu_us_per_batch"]  # a report saved before the costs were read
    row = _row(report.evaluate(_report(results)), "S2", "service+consumer CPU per batch")
    assert row["ok"] is None and row["detail"] == "no CPU per batch measured"
    results = {**_passing_results(), **_peer_results()}
    results["S2/pipes"] = {"failed": "repetition 1: timed out after 130 s (killed)"}
    row = _row(report.evaluate(_report(results)), "S2", "service+consumer CPU per batch")
    assert row["ok"] is None and row["detail"] == "measurement failed: S2/pipes"


def test_the_table_shows_the_costs_per_batch_and_each_services_backend() -> None:
    """Issue 25 item 2: ctx switches and CPU us per batch, service and
    consumers; item 4: which backend each service's workers use, and why."""
    text = report.format_report(_report({**_passing_results(), **_peer_results()}))
    lines = text.splitlines()
    top = lines.index(next(line for line in lines if line.startswith("per batch taken")))
    assert re.search(r"ctx switches/batch +CPU us/batch$", lines[top]), lines[top]
    costs = {tuple(re.split(r" {2,}", line.strip())[:2]): re.split(r" {2,}", line.strip())[2:]
             for line in lines[top + 1: lines.index("", top)]}
    assert costs == {
        ("S1/service", "service"): ["70.0", "2000.0"], ("S1/service", "consumer"): ["3.0", "300.0"],
        ("S1/service", "service + consumer"): ["73.0", "2300.0"],
        ("S1/pipes", "consumer"): ["12.0", "2100.0"],
        # a pipeline's steps, under its consumer row: the worker processes first (the costlier)
        ("S1/pipes", "worker processes"): ["4.0", "1500.0"], ("S1/pipes", "net's process"): ["8.0", "600.0"],
        ("S2/service", "service"): ["2.5", "100.0"], ("S2/service", "consumer"): ["1.5", "60.0"],
        ("S2/service", "service + consumer"): ["4.0", "160.0"],
        ("S2/pipes", "consumer"): ["0.5", "140.0"],
        ("S8/service", "service"): ["80.0", "2200.0"], ("S8/service", "consumer"): ["3.0", "320.0"],
        ("S8/service", "service + consumer"): ["83.0", "2520.0"],
    }
    served = next(line for line in lines if line.startswith("  service "))
    assert ("its workers: S1, S8, attach: processes: W2's fetcher stands for loading images" in served
            and "; S2: threads: W1's fetcher is trivial" in served), served
    pipes = next(line for line in lines if line.startswith("  pipes "))
    assert pipes.endswith("its workers: S1: worker processes; S2: worker threads"), pipes
    assert any(line.startswith("per batch: read from /proc at the window's two ends only") for line in lines)
    # without S1, S2, S8 there is no such table
    assert "per batch taken" not in report.format_report(_report(_passing_results()))


def test_per_batch_costs_are_the_windows_usage_over_its_batches() -> None:
    usage = {"service": measure.Usage(0.5, 7000), "consumer0": measure.Usage(0.1, 100),
             "consumer1": measure.Usage(0.3, 300)}
    got = service.per_batch_costs(usage, 1000)
    assert got == pytest.approx({"service_cpu_us_per_batch": 500.0, "service_ctx_per_batch": 7.0,
                                 "consumer_cpu_us_per_batch": 400.0, "consumer_ctx_per_batch": 0.4})
    assert service.per_batch_costs({"consumer0": measure.Usage(0.1, 5)}, 10) == pytest.approx(
        {"consumer_cpu_us_per_batch": 10_000.0, "consumer_ctx_per_batch": 0.5})  # pipes: no service
    assert service.per_batch_costs(usage, 0) == {}


def test_a_pipelines_cost_is_split_between_its_worker_processes_and_its_nets_process() -> None:
    """pipes' per-batch CPU, split where it goes: S1's 1.2x is read beside
    what the pipelines' workers (the same copy as the service's) and their
    nets' processes spend."""
    usage = {"consumer0": measure.Usage(0.1, 100), "consumer0 workers": measure.Usage(0.5, 40),
             "consumer1": measure.Usage(0.3, 300), "consumer1 workers": measure.Usage(0.7, 60)}
    steps = service.pipeline_steps(usage, 1000)
    assert steps == pytest.approx({
        measure.STEP_CPU + "worker processes": 1200.0, measure.STEP_CTX + "worker processes": 0.1,
        measure.STEP_CPU + "net's process": 400.0, measure.STEP_CTX + "net's process": 0.4})
    # the consumer row is still the whole of each pipeline: both steps
    costs = service.per_batch_costs(usage, 1000)
    assert costs["consumer_cpu_us_per_batch"] == pytest.approx(1600.0)
    assert costs["consumer_ctx_per_batch"] == pytest.approx(0.5)
    # the service's runners have no workers group: no such steps
    assert service.pipeline_steps({"service": measure.Usage(0.5, 10), "consumer0": measure.Usage(0.1, 5)}, 10) == {}
    assert service.pipeline_steps(usage, 0) == {}


def test_the_usage_is_read_at_the_windows_two_ends_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling must not disturb the window: /proc is read once as it opens
    and once as it closes, and the groups are what was asked for."""
    counts = measure.Tally()
    stop = threading.Event()
    reads: list[float] = []
    real = measure.read_procs

    def read(pids: list[int]) -> measure.ProcReading:
        reads.append(time.perf_counter())
        return real(pids)

    monkeypatch.setattr(measure, "read_procs", read)

    def consumer() -> None:
        while not stop.is_set():
            counts.add(0, 1)
            time.sleep(0.001)

    t = threading.Thread(target=consumer)
    try:
        t.start()
        w = measure.watch_consumers(counts, 1, 0.3, time.perf_counter(), lambda: None, warmup=0.05,
                                    usage={"me": [os.getpid()]})
        assert len(reads) == 2 and reads[1] - reads[0] >= 0.3, reads
        assert set(w.usage) == {"me"} and w.usage["me"].switches > 0  # the consumer thread's sleeps
    finally:
        stop.set()
        t.join(10)
        counts.close()


def test_watch_consumers_times_every_consumers_window_and_names_a_missing_one() -> None:
    counts = measure.Tally()
    stop = threading.Event()

    def consumer(k: int) -> None:
        while not stop.is_set():
            counts.add(k, 1)
            time.sleep(0.001)  # pacing, as a consumer's work would

    threads = [threading.Thread(target=consumer, args=(k,)) for k in range(2)]
    try:
        for t in threads:
            t.start()
        w = measure.watch_consumers(counts, 2, 0.2, time.perf_counter(), lambda: None, warmup=0.05, pss=False)
        assert len(w.batches) == 2 and all(b > 0 for b in w.batches)
        assert w.seconds >= 0.2 and w.first_batch_s >= 0
        with pytest.raises(TimeoutError, match=r"consumers \[2\] had no batch"):
            measure.watch_consumers(counts, 3, 0.1, time.perf_counter(), lambda: None, start_timeout=0.1, pss=False)

        def died() -> None:
            raise RuntimeError("consumer 2 exited with 1")

        with pytest.raises(RuntimeError, match="consumer 2 exited"):
            measure.watch_consumers(counts, 3, 0.1, time.perf_counter(), died, pss=False)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        counts.close()


# --------------------------------------------------------------------------- the pieces the runners share
def test_rebatching_makes_exact_batches_and_loses_nothing() -> None:
    rng = np.random.default_rng(0)
    chunks = []
    start = 0
    for n in rng.integers(1, 80, size=200):
        a = np.arange(start, start + n)
        chunks.append([a, -a])
        start += n
    batches = list(base._rebatched(chunks, 32))
    assert all(len(b[0]) == 32 for b in batches)
    got = np.concatenate([b[0] for b in batches])
    assert np.array_equal(got, np.arange(len(got)))  # in order, none twice
    assert start - len(got) < 32  # only the last partial batch is left
    assert all(np.array_equal(b[1], -b[0]) for b in batches)


def _count_in_a_child(tally: measure.Tally) -> None:
    fetch = workloads.W1Fetch(tally)
    for _ in range(10):
        fetch(3, 32)
    tally.cpu(3, 0.25)
    tally.finish()
    try:
        fetch(3, 32)
    except StopIteration:
        return
    raise AssertionError("fetch went on after finish()")


def test_the_tally_works_across_processes() -> None:
    tally = measure.Tally()
    try:
        proc = multiprocessing.get_context("spawn").Process(target=_count_in_a_child, args=(tally,))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        assert tally.stopping
        same = workloads.W1Fetch(None)  # the same chunks, counted here
        assert tally.fetched() == sum(len(same.chunk(3)[0]) for _ in range(10))
        assert tally.cpu_median() == 0.25
    finally:
        tally.close()
    assert not Path(tally.path).exists()


def test_w6_images_are_jpegs_of_the_documented_kind(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    from PIL import Image

    rng = np.random.default_rng(6)
    sizes = []
    for i in range(3):
        path = tmp_path / f"{i}.jpg"
        Image.fromarray(workloads._w6_image(rng), "RGB").save(path, "JPEG", quality=workloads.W6_QUALITY)
        sizes.append(path.stat().st_size)
        with Image.open(path) as im:
            assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (500, 375))
        decoded = np.asarray(workloads._decode(str(path)))
        assert decoded.shape == (224, 224, 3) and decoded.dtype == np.uint8
    assert all(25_000 < n < 60_000 for n in sizes), sizes  # about 42 kB each


def test_tree_pss_counts_the_children() -> None:
    alone = measure.tree_pss_mb()
    child = subprocess.Popen([sys.executable, "-c", "import time, numpy; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while measure._pss_kb(child.pid) < 5000 and time.monotonic() < deadline:  # until numpy is in
            time.sleep(0.05)
        assert child.pid in measure._descendants(os.getpid())
        assert measure.tree_pss_mb() > alone
    finally:
        child.kill()
        child.wait(timeout=10)


#: A process that, told "go" on stdin, spins SPIN_S of CPU time in its main
#: thread while a thread of its own sleeps 1 ms SLEEPS times (each sleep is
#: a voluntary context switch), and has a child of its own spin CHILD_S;
#: then prints the CPU time both spun, and waits for its stdin to close.
#: Its own text is its last argument (its child runs it too).
BUSY = r"""
import subprocess, sys, threading, time

def spin(seconds):
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass
    return time.thread_time() - t0

if sys.argv[1] == "child":
    sys.stdin.readline()
    print(spin(float(sys.argv[2])), flush=True)
    sys.stdin.read()
    sys.exit(0)
spin_s, sleeps, child_s = float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
child = subprocess.Popen([sys.executable, "-c", sys.argv[5], "child", str(child_s)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print(child.pid, flush=True)
sys.stdin.readline()
child.stdin.write("go\n"); child.stdin.flush()
sleeper = threading.Thread(target=lambda: [time.sleep(0.001) for _ in range(sleeps)])
sleeper.start()
mine = spin(spin_s)
sleeper.join()
theirs = float(child.stdout.readline())
print(mine, theirs, flush=True)
sys.stdin.read()
child.stdin.close()
child.wait(30)
"""


def test_the_usage_probe_reads_what_a_busy_process_and_its_child_spent() -> None:
    """Per-batch costs (issue 25): the CPU time (utime + stime, summed over a
    process and its children) and context switches (summed over threads)
    between two /proc readings, on a process that spins known CPU time."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY, "parent", "0.3", "50", "0.2", BUSY],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())  # both started, waiting
        whole = measure.UsageProbe({"tree": [proc.pid]})
        split = measure.UsageProbe({"parent": [proc.pid], "child": [child]})
        # the child named as what is below the parent, unknown to the caller
        below = measure.UsageProbe({"parent": [proc.pid]}, below={"below": [proc.pid]})
        assert sorted(whole.groups["tree"]) == sorted([proc.pid, child])
        assert split.groups == {"parent": [proc.pid], "child": [child]}  # another group's root is not the parent's
        assert below.groups == {"parent": [proc.pid], "below": [child]}
        whole.start()
        split.start()
        below.start()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        mine, theirs = map(float, proc.stdout.readline().split())  # what each spun, by its own clock
        tree, parts, under = whole.stop(), split.stop(), below.stop()
        # each reading truncates utime and stime to a clock tick each: two ticks a process
        tick = 2 / measure.CLK_TCK
        assert tree["tree"].cpu_s > mine + theirs - 2 * tick, (tree, mine, theirs)
        assert parts["parent"].cpu_s > mine - tick and parts["child"].cpu_s > theirs - tick, (parts, mine, theirs)
        assert parts["parent"].cpu_s < mine + theirs - 2 * tick  # the child's time is the child's alone
        assert tree["tree"].switches >= 50 and parts["parent"].switches >= 50, (tree, parts)  # the sleeper's
        assert tree["tree"].switches == pytest.approx(parts["parent"].switches + parts["child"].switches, abs=2)
        assert under["below"].cpu_s > theirs - tick and under["parent"].cpu_s < mine + theirs - 2 * tick, under
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()
    with pytest.raises(RuntimeError, match="before start"):
        measure.UsageProbe({"none": []}).stop()


def test_the_meter_reads_what_it_and_its_worker_processes_spent_in_the_window() -> None:
    """W7's per-batch costs (issue 26): a meter with ``cpu=True`` reads its
    own process and the processes below it at the window's two ends; what
    a child spun inside the window is the children's, not the parent's."""
    child = subprocess.Popen([sys.executable, "-c", BUSY, "child", "0.3"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        m = measure.Meter(0.35, warmup=0.0, pss=False, cpu=True)
        one = [np.zeros(4)]
        m.begin()
        assert m.tick(one) and m.tick(one)  # the first batch, then the window opens (warm-up 0)
        child.stdin.write("go\n")
        child.stdin.flush()
        spun = float(child.stdout.readline())  # its spin ended inside the window
        while m.tick(one):
            pass
        r = m.result()
        late = m.tick(one)  # a runner that ticks on for what its last poll brought (hand2)
        assert not late and m.result()["children_cpu_us_per_batch"] == r["children_cpu_us_per_batch"]
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()
    tick = 2 / measure.CLK_TCK  # /proc truncates utime and stime to a clock tick each
    children_s = r["children_cpu_us_per_batch"] * m.batches / 1e6
    parent_s = r["parent_cpu_us_per_batch"] * m.batches / 1e6
    assert children_s > spun - tick, (r, spun)
    assert parent_s < spun / 2, (r, spun)  # the parent waited on the child's line: its spin is not ours
    assert r["children_ctx_per_batch"] >= 0 and r["parent_ctx_per_batch"] >= 0
    assert "parent_cpu_us_per_batch" not in measure.Meter(0.1, pss=False).result()  # only when asked


def test_the_table_shows_what_each_w7_runners_processes_spent_a_batch() -> None:
    results = {**_passing_results(),
               "W7/blobfeed": _result(parent_cpu_us_per_batch=120.0, parent_ctx_per_batch=3.5,
                                      children_cpu_us_per_batch=500.0, children_ctx_per_batch=2.0),
               "W7/hand2": _result(parent_cpu_us_per_batch=25.0, parent_ctx_per_batch=1.0,
                                   children_cpu_us_per_batch=430.0, children_ctx_per_batch=1.0)}
    lines = report.format_report(_report(results)).splitlines()
    top = lines.index(next(line for line in lines if line.startswith("per batch taken")))
    costs = {tuple(re.split(r" {2,}", line.strip())[:2]): re.split(r" {2,}", line.strip())[2:]
             for line in lines[top + 1: lines.index("", top)]}
    assert costs == {
        ("W7/blobfeed", "this process"): ["3.5", "120.0"], ("W7/blobfeed", "worker processes"): ["2.0", "500.0"],
        ("W7/blobfeed", "all"): ["5.5", "620.0"],
        ("W7/hand2", "this process"): ["1.0", "25.0"], ("W7/hand2", "worker processes"): ["1.0", "430.0"],
        ("W7/hand2", "all"): ["2.0", "455.0"],
    }
    assert any(line.startswith("per batch (W1i, W2i, W7, work2, hand2):") for line in lines)


# --------------------------------------------------------------------------- real runs
def _check_real_run(proc: subprocess.CompletedProcess[str], workload: str, runner_: str = "blobfeed") -> str:
    out = proc.stdout
    assert re.search(rf"^{workload}/{runner_} ", out, re.M), out + proc.stderr
    m = re.search(r"^verdict: (all \d+ targets met|MISSED (\d+) of \d+ targets:)$", out, re.M)
    assert m, out + proc.stderr
    missed_rows = re.findall(r"  MISSED$", out, re.M)
    if m.group(1).startswith("all"):
        assert proc.returncode == 0 and not missed_rows, out
    else:
        assert proc.returncode == 1, out
        assert len(missed_rows) == int(m.group(2)), out
    assert "about" in proc.stderr  # the estimate, printed before the run
    return out


#: the tests that read w1_family_run: one test process takes them all
#: (``--dist loadgroup``), and the fixture (most of a minute of real runs)
#: lives for its session: a module's fixture is set up again each time the
#: process comes back to the module, and test processes interleave modules
W1_FAMILY = pytest.mark.xdist_group("w1-family")


def _bench_without(*packages: str) -> list[str]:
    """The command line of ``blobfeed bench`` run as if ``packages`` (of
    torch, grain, ray.data) were not installed, as on a machine without
    them (CI has none of them): their peers are left out of the plan, the
    estimate and the verdict.  For the real runs whose tests read none of
    those peers' rows: each peer's run is seconds (torch's import, grain's
    spawned workers, Ray Data's cluster) and asserts nothing here."""
    return [sys.executable, "-c",
            "import sys; import blobfeed.apps.bench.runner as r, blobfeed.apps.bench.cli as c; "
            f"have = r.available_packages() - {set(packages)!r}; "
            "r.available_packages = c.available_packages = lambda: have; "
            "from blobfeed.apps.cli import main; sys.exit(main(sys.argv[1:]))", "bench"]


@pytest.fixture(scope="session")
def w1_family_run() -> subprocess.CompletedProcess[str]:
    """One tiny real run of W1, its ordered modes, its process workers
    (W1p) and the random-access sources W1i and W2i (W2i without W2), which
    the tests below read: one CLI, one estimate, one verdict over all six,
    0.3 s a measurement.  Without torch's, grain's and Ray Data's peers:
    the tests read none of their rows (W1p's best process peer is then the
    standard library's pool, which always runs), and they were three
    quarters of the run (38 s estimated with them, 12 s without)."""
    return subprocess.run(
        [*_bench_without("torch", "grain", "ray.data"), "--workloads", "W1,W1d,W1s,W1p,W1i,W2i", "--seconds", "0.3",
         "--repeats", "1"],
        capture_output=True, text=True, timeout=200, cwd=ROOT,
    )


@pytest.mark.timeout(240)
@W1_FAMILY
def test_a_tiny_real_run_exits_as_its_verdict_says(w1_family_run: subprocess.CompletedProcess[str]) -> None:
    _check_real_run(w1_family_run, "W1")


@pytest.mark.timeout(240)
@W1_FAMILY
def test_a_tiny_real_run_of_process_workers_exits_as_its_verdict_says(
    w1_family_run: subprocess.CompletedProcess[str],
) -> None:
    out = _check_real_run(w1_family_run, "W1p")
    assert re.search(r"^W1p/pool ", out, re.M), out  # the standard library's peer always runs
    assert re.search(r"^W1p first batch <= 500 ms ", out, re.M), out
    assert re.search(r"^W1p batches/s vs the best process peer >= 1\.5 ", out, re.M), out
    assert re.search(r"^W1p/blobfeed +\S+ +\S+ +\S+ +\d+ ", out, re.M), out  # its PSS column is filled


@pytest.mark.timeout(240)
@W1_FAMILY
def test_a_tiny_real_run_of_the_ordered_modes_exits_as_its_verdict_says(
    w1_family_run: subprocess.CompletedProcess[str],
) -> None:
    out = _check_real_run(w1_family_run, "W1d")
    assert re.search(r"^W1s/blobfeed +.* x W1$", out, re.M), out  # shuffling's cost, beside W1
    assert re.search(r"^W1d batches/s vs W1 >= 0\.8 ", out, re.M), out
    assert re.search(r"^W1s batches/s vs W1 >= 0\.5 ", out, re.M), out
    assert re.search(r"^W1s samples lost == 0 +0  ok$", out, re.M), out


@pytest.mark.timeout(120)
def test_a_measurement_child_runs_from_the_folder_that_holds_the_clone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``blobfeed bench`` run from the clone's parent folder: the folder's
    ``blobfeed/`` (the clone, no ``__init__.py``) must not be taken for the
    package in the children (it was: "module 'blobfeed' has no attribute
    'Net'", issue 19).  The runner's own child-spawn path, one tiny W1."""
    (tmp_path / "blobfeed").symlink_to(ROOT, target_is_directory=True)  # the parent of a clone named blobfeed
    monkeypatch.chdir(tmp_path)
    got = runner._child("W1", "blobfeed", 0.05)
    assert got["samples_lost"] == 0 and got["batches_per_s"] > 0, got


@pytest.mark.timeout(300)
def test_a_tiny_real_run_of_the_service_workloads_reports_every_row() -> None:
    """S1, S2, S8 and attach for real, at 0.3 s a measurement: consumer
    processes, a service, four pipelines each; what they report (the rows,
    the per-batch costs read from /proc), not their speed.  Ray Data's peer
    is left out (this test reads none of its rows; starting Ray twice was
    a third of the test's time): the bench run as if ``ray[data]`` were
    not installed, as on a machine without it."""
    proc = subprocess.run(
        [*_bench_without("ray.data"), "--workloads", "S1,S2,S8,attach", "--seconds", "0.3",
         "--repeats", "1"],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )
    out = _check_real_run(proc, "S1", "service")
    lines = out.splitlines()
    top = lines.index(next(line for line in lines if line.startswith("workload/runner")))
    cells = {r["workload/runner"]: r for r in _column_cells(lines[top: lines.index("", top)])}
    for key in ("S1/service", "S1/pipes", "S2/service", "S2/pipes", "S8/service"):
        assert float(cells[key]["batches/s"]) > 0 and int(cells[key]["PSS MB"]) > 0, cells[key]
        assert cells[key]["lost"] == "0", cells[key]
    assert float(cells["S1/copy"]["GB/s"]) > 0 and float(cells["S1/copy2"]["GB/s"]) > 0
    # the transport alone: its consumers took batches, and it counts no samples
    assert float(cells["S2/bare"]["batches/s"]) > 0 and cells["S2/bare"]["lost"] == "-", cells["S2/bare"]
    # S1's shortest path: its consumers took batches, and it counts no samples
    assert float(cells["S1/direct"]["batches/s"]) > 0 and cells["S1/direct"]["lost"] == "-", cells["S1/direct"]
    # and with the least bookkeeping the service's guarantees need
    assert float(cells["S1/ledger"]["batches/s"]) > 0 and cells["S1/ledger"]["lost"] == "-", cells["S1/ledger"]
    assert cells["attach/service"]["batches/s"] == "-" and float(cells["attach/service"]["first ms"]) > 0
    # the hand-offs: every process's CPU and context switches in the window, per batch
    top = lines.index(next(line for line in lines if line.startswith("per batch taken")))
    rows = lines[top + 1: lines.index("", top)]
    # the service's steps are indented under it: its threads by role, its worker processes
    KEY = report.KEY_WIDTH
    steps = {(line[:KEY].strip(), line[KEY:].split("  ")[1].strip()): line.split()[-1]
             for line in rows if line[KEY:].startswith("  ")}
    # CPU time is read in clock ticks (10 ms a thread): in a tiny window only
    # the busiest step is sure to show; a step under 0.05 us a batch is left out
    assert {role for k, role in steps} <= {"sender", "receiver", "intake", "fetchers", "slot returner",
                                           "worker processes", "other threads", "net's process"}, steps
    # which step is the busiest depends on the machine (S1's sender read 0
    # in a fresh clone's CI, where its worker processes led): each service
    # row shows at least one step, and a step shown has cost something
    for k in ("S1/service", "S2/service", "S2/bare"):
        shown = [float(cpu) for (key, _), cpu in steps.items() if key == k]
        assert shown and max(shown) > 0, (k, steps)
    costs = {tuple(re.split(r" {2,}", line.strip())[:2]): [float(x) for x in re.split(r" {2,}", line.strip())[2:]]
             for line in rows if not line[KEY:].startswith("  ")}
    assert set(costs) == {(k, who) for k in ("S1/service", "S2/service", "S8/service", "S2/bare", "S1/direct",
                                             "S1/ledger")
                          for who in ("service", "consumer", "service + consumer")} | {
        ("S1/pipes", "consumer"), ("S2/pipes", "consumer")}, costs
    for (key, who), (ctx, cpu) in costs.items():
        # every batch costs CPU somewhere; CPU is read in clock ticks (10 ms
        # a process), so a served consumer that spends a few tens of us a
        # batch may read 0 in a tiny window (S1's direct consumers did, on a
        # loaded machine): its row with the service's is never 0
        cheap = who == "consumer" and not key.endswith("/pipes")
        assert cpu >= 0 if cheap else cpu > 0, (key, who, ctx, cpu)
        # the service's threads wait for acks and for batches; a consumer
        # (served, or a pipeline of its own) may take a tiny window's batches
        # with under 0.05 switches a batch, printed 0.0 (its hot path waits on
        # nothing when the next batch is there: S2's service read 0.0 on a
        # fresh clone, and S2's pipes on a faster machine)
        assert ctx > 0 if "consumer" not in who else ctx >= 0, (key, who, ctx, cpu)
    for line in [r"S1 batches/s vs four independent process pipelines >= 1\.2 ",
                 r"S1 total PSS vs four independent process pipelines <= 0\.5 ",
                 r"S1 GB/s vs the copy bound >= 0\.6 ", r"S2 batches/s vs four independent thread pipelines >= 0\.3 ",
                 r"S8 total batches/s vs S1's >= 0\.9 ", r"S8 samples lost == 0 \(service\) +0  ok",
                 r"S2 service\+consumer CPU per batch beyond the pipelines' own <= 30 us +-?\d",
                 r"S1 batches/s vs Ray Data streaming_split\(4\) >= 5\.0 ", r"S2 samples lost == 0 \(service\) +0  ok",
                 r"attach samples lost == 0 \(service\) +0  ok", r"attach first batch after attach_source <= 50 ms "]:
        assert re.search(rf"^{line}", out, re.M), (line, out)


@pytest.mark.timeout(120)
def test_the_service_consumers_run_from_the_folder_that_holds_the_clone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer processes drop the current directory from sys.path, as
    the measuring children do (a clone named blobfeed in it is not the package)."""
    (tmp_path / "blobfeed").symlink_to(ROOT, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    got = runner._child("attach", "service", 0.05)
    assert got["samples_lost"] == 0 and got["attach_cycles"] >= 3 and got["first_batch_ms"] > 0, got


def _column_cells(table: list[str]) -> list[dict[str, str]]:
    """Each line of a report's table (header first) cut into cells under the
    header's columns: the first column left-aligned, the others right-aligned,
    each ending where its header ends."""
    header = table[0]
    names = re.split(r" {2,}", header.strip())
    ends = [header.index(names[0]) + len(names[0])]
    for name in names[1:]:
        ends.append(header.index(name, ends[-1]) + len(name))
    rows = []
    for line in table[1:]:
        cells, start = {names[0]: line[: ends[0]].strip()}, ends[0]
        for name, end in zip(names[1:], ends[1:]):
            cells[name] = line[start:end].strip()
            start = end
        rows.append(cells)
    return rows


def test_the_table_separates_its_headers_and_fills_every_pss_cell() -> None:
    """Issue 19: two headers ran together ("GB/s peak RSS MB", "lost vs
    ideal") and the PSS column was blank for every thread workload."""
    results = _passing_results()
    results["W3/caffe2"]["samples_lost"] = 123_657_152  # the widest cell the bench has printed
    results["W2/blobfeed"]["pss_mb"] = 108.4  # the others have none, as in a report saved before
    report_ = {"seconds": 1.0, "repeats": 1, "python": "3.11", "cpus": 2, "results": results}
    text = report.format_report(report_)
    lines = text.splitlines()
    top = lines.index(next(line for line in lines if line.startswith("workload/runner")))
    table = lines[top: lines.index("", top)]
    header_names = re.split(r" {2,}", table[0].strip())
    assert header_names == ["workload/runner"] + [name for name, _ in report.COLUMNS], table[0]
    rows = _column_cells(table)
    measured = [r for r in rows if not r["workload/runner"].endswith("/ideal")]
    assert measured and all(r["PSS MB"] for r in measured), table
    assert next(r for r in rows if r["workload/runner"] == "W2/blobfeed")["PSS MB"] == "108"
    assert next(r for r in rows if r["workload/runner"] == "W3/caffe2")["lost"] == "123657152"
    assert {r["PSS MB"] for r in measured} == {"108", "-"}


def test_every_measurement_reads_its_pss() -> None:
    m = measure.Meter(0.05, warmup=0.0)
    m.begin()
    batch = [np.zeros((4, 2), np.float32)]
    while m.tick(batch):
        pass
    assert m.result()["pss_mb"] > 0  # threads too, not only worker processes


def test_a_killed_runs_tallies_are_deleted_by_the_next_run() -> None:
    """A run killed (SIGKILL, a timeout) cannot delete its shared-memory
    tallies; they stayed in /dev/shm for good (seven found on the machine)."""
    code = "from blobfeed.apps.bench import measure; t = measure.Tally(); print(t.path, flush=True); import time; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        left = Path(proc.stdout.readline().strip())
        assert left.exists()
    finally:
        proc.kill()
        proc.wait(10)
    assert left.exists()  # its owner could not clean up
    tally = measure.Tally()
    try:
        assert not left.exists()
        assert Path(tally.path).exists()
    finally:
        tally.close()


# --------------------------------------------------------------------------- failed measurements (issue 24)
def _canned(w: str, r: str, seconds: float) -> dict[str, Any]:
    """A stand-in for a measurement's child: the canned passing results."""
    return copy.deepcopy({**_passing_results(), **_peer_results()}[f"{w}/{r}"])


def _only_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench sees Pillow and no optional peer, whatever this machine has:
    in the runner (what it measures) and in the CLI (what it estimates;
    it imported the function by name)."""
    for module in (runner, cli):
        monkeypatch.setattr(module, "available_packages", lambda: frozenset({"PIL"}))


def test_a_timed_out_peer_is_a_failed_row_and_the_rest_is_judged(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24: one peer's timeout (pool on W4p) ended the run with "a
    measurement failed, no verdict", throwing every other result away."""
    asked: list[tuple[str, str]] = []

    def measure(w: str, r: str, seconds: float) -> dict[str, Any]:
        asked.append((w, r))
        if (w, r) == ("W4p", "pool"):
            raise runner.MeasurementFailed("timed out after 170 s (killed)")
        return _canned(w, r, seconds)

    monkeypatch.setattr(runner, "measure_one", measure)
    _only_pillow(monkeypatch)
    status = cli.main(["--workloads", "W1,W4p", "--repeats", "2", "--seconds", "0.1"])
    captured = capsys.readouterr()
    out = captured.out
    assert status == 2, out  # a failed row: not a pass, whatever the rest says
    assert asked.count(("W4p", "pool")) == 1  # not tried again in repetition 2
    assert asked.count(("W4p", "blobfeed")) == 2 and asked.count(("W1", "caffe2")) == 2
    assert re.search(r"^W4p/pool +measurement failed: repetition 1: timed out after 170 s \(killed\)$", out, re.M), out
    assert re.search(r"^W1/blobfeed +\d", out, re.M), out  # the other rows are all there
    # the verdict on the rest, then the failure
    assert re.search(r"^verdict: 1 measurement FAILED; on the rest: all \d+ targets met$", out, re.M), out
    assert re.search(r"^failed measurements \(exit status 2\):\n  W4p/pool: repetition 1: timed out", out, re.M), out
    assert re.search(r"^W4p batches/s vs the two-core ideal >= 0\.85 +0\.90  ok$", out, re.M), out
    assert "W4p/pool failed in repetition 1: timed out" in captured.err


def test_a_target_whose_measurement_failed_is_not_judged_on_it() -> None:
    results = {**_passing_results(), **_peer_results()}
    results["W1/caffe2"] = {"failed": "repetition 2: exited with status 1: MemoryError"}
    results["W2p/pool"] = {"failed": "repetition 1: timed out after 170 s (killed)"}
    rows = report.evaluate(_report(results))
    failed = [r for r in rows if r.get("failed")]
    assert {(r["workload"], r["runner"]) for r in failed} == {("W1", "caffe2"), ("W2p", "pool")}
    row = _row(rows, "W1", "batches/s vs Caffe2")
    assert row["ok"] is None and row["detail"] == "measurement failed: W1/caffe2"
    row = _row(rows, "W2p", "batches/s vs the best process peer")
    assert row["ok"] is True and "measurement failed: pool" in row["detail"]  # judged on the peers that ran
    status, lines = report.verdict(rows)
    assert status == 2
    assert lines[0].startswith("verdict: 2 measurements FAILED; on the rest: all ")


def test_a_ratio_past_the_physical_bound_is_a_failed_measurement(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 24: W4 printed "3.57 ok": 690 batches/s against one core's
    ideal of 193, from threads running pure-Python work on a 2-core machine."""
    impossible = _result(batches_per_s=690.0, ideal_batches_per_s=193.0, ideal_ratio=690.0 / 193.0, wait_share=0.5)
    raw = {("W4", "blobfeed"): [_result(batches_per_s=180.0, ideal_batches_per_s=193.0, ideal_ratio=0.93), impossible],
           ("W4", "caffe2"): [_result(batches_per_s=110.0, ideal_batches_per_s=190.0, ideal_ratio=0.58)] * 2,
           ("W4p", "blobfeed"): [_result(batches_per_s=400.0, ideal_batches_per_s=450.0, ideal_ratio=0.89)],
           ("W4p", "pool"): [_result(batches_per_s=900.0, ideal_batches_per_s=450.0, ideal_ratio=2.0)]}
    results = report.summarize(raw, cpus=2)
    why = results["W4/blobfeed"]["failed"]
    assert why == ("repetition 2: 690 batches/s is 3.58 x the 1-core ideal (193 batches/s), above the possible 1.10 "
                   "(its threads run pure-Python work under the GIL: one core at most)"), why
    assert "above the possible 1.10 (its work runs on 2 cores at most)" in results["W4p/pool"]["failed"]
    assert "W4/ideal" not in results and "failed" not in results["W4/caffe2"]
    assert report.summarize(raw, cpus=1)["W4p/blobfeed"]["failed"].endswith(
        "above the possible 0.55 (its 2 workers share the machine's 1 cpus)")
    rows = report.evaluate(_report(results))
    row = _row(rows, "W4", "batches/s vs one core's ideal")
    assert row["ok"] is None and row["detail"] == "measurement failed: W4/blobfeed"
    status, lines = report.verdict(rows)
    assert status == 2
    text = report.format_report(_report(results))
    assert re.search(r"^W4/blobfeed +measurement failed: repetition 2: 690 batches/s is 3\.58 x", text, re.M), text
    assert re.search(r"^W4 batches/s vs one core's ideal >= 0\.9 +- +not evaluated \(measurement failed\)", text, re.M)
    assert not re.search(r"^W4 batches/s vs one core's ideal.* ok", text, re.M)


#: the tests that sweep /dev/shm's semaphores, and one that leaves an orphan
#: there on purpose: in one test process, so no sweep takes another's
SHM_SWEEP = pytest.mark.xdist_group("shm-sweep")


@SHM_SWEEP
def test_a_semaphore_a_live_process_made_is_not_taken_for_a_killed_measurements() -> None:
    """The sweep after a killed measurement unlinks the semaphores nobody
    maps.  A process that makes one maps it under the temporary name
    ``sem_open`` made it as (``/dev/shm/sem.XXXXXX (deleted)``), not its
    own: by name the sweep took it for an orphan and unlinked it, and the
    processes spawned to share it failed (the other test process's work2,
    "exited with code 1": FileNotFoundError in SemLock._rebuild)."""
    import _multiprocessing

    before = runner._semaphores()
    # made as multiprocessing makes one for a spawned child (its name kept),
    # named here: an imported library (joblib's loky) may rename theirs
    name = f"/mp-live-{os.getpid()}"
    lock = _multiprocessing.SemLock(1, 1, 1, name, False)  # kind 1: a semaphore; not unlinked at once
    live = "sem." + name[1:]
    orphan = f"sem.mp-orphan-{os.getpid()}"
    with open(os.path.join(runner.SHM, orphan), "wb") as f:
        f.write(b"\0" * 32)  # what a killed process leaves: a name nobody maps
    try:
        assert {live, orphan} <= runner._semaphores() - before
        runner._unlink_orphan_semaphores(before, group=2**22 + 1)  # no process is in that group
        assert os.path.exists(os.path.join(runner.SHM, live)), "a live process's semaphore was unlinked"
        assert not os.path.exists(os.path.join(runner.SHM, orphan)), "the orphan was left"
    finally:
        for leftover in (live, orphan):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(runner.SHM, leftover))
        del lock


@SHM_SWEEP
@pytest.mark.timeout(120)
def test_a_hung_measurement_is_killed_with_every_process_it_started() -> None:
    """The child and the Pool's workers it forked: none is left behind, nor
    the named semaphores of the Pool, which no killed process could unlink
    (six stayed in /dev/shm for every run of this test)."""
    semaphores = runner._semaphores()
    t0 = time.monotonic()
    with pytest.raises(runner.MeasurementFailed, match=r"^timed out after 4 s \(killed\)$"):
        runner._child("W1p", "pool", 60.0, timeout=4.0)
    # New ones that some process maps are the other test process's
    # (multiprocessing's semaphores live as long as their objects): only one
    # nobody maps any more was left behind.
    mapped = runner._mapped_shm_files()
    left = []
    for name in runner._semaphores() - semaphores:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(os.path.join(runner.SHM, name))
            if (st.st_dev, st.st_ino) not in mapped:
                left.append(name)
    assert not left, left
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("blobfeed-bench-") and not os.path.exists(
        "/proc/" + n.split("-")[2])], "a killed measurement's tally was left behind"
    assert time.monotonic() - t0 < 60

    def left() -> list[int]:
        pids = []
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if b"--child\0W1p\0pool\0" in f.read():
                        pids.append(int(name))
            except (OSError, ValueError):
                continue
        return pids

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:  # SIGKILL is delivered at once; their reaping is not ours
        time.sleep(0.1)
    assert not left()


def test_a_slow_pss_reading_is_not_taken_out_of_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24: W4 reported 3.57 x one core's ideal.  The PSS reading ran in
    the consumer's thread and its time was taken out of the window; under
    W4's pure-Python fetcher threads one reading took seconds (each file read
    waits a GIL switch interval), while the fetchers went on filling the
    queue.  Here a producer makes up to 200 items/s and a reading takes
    0.4 s: the meter must still say what the producer made."""
    def slow_reading(root: int | None = None) -> float:
        time.sleep(0.4)  # what one reading cost under W4's threads, shortened
        return 1.0

    monkeypatch.setattr(measure, "tree_pss_mb", slow_reading)
    items: "queue.Queue[list[np.ndarray]]" = queue.Queue()
    stop = threading.Event()
    batch = [np.zeros((1, 1))]

    put_at: list[float] = []

    def producer() -> None:
        next_at = time.perf_counter()
        while not stop.is_set():
            put_at.append(time.perf_counter())
            items.put(batch)
            # pacing: the producer's speed; one held back (a loaded machine)
            # does not catch up in a burst, which would read as over 200/s
            next_at = max(next_at + 1 / 200, time.perf_counter())
            time.sleep(max(0.0, next_at - time.perf_counter()))

    t = threading.Thread(target=producer)
    t.start()
    try:
        m = measure.Meter(1.5, warmup=0.2)
        m.begin()
        while m.tick(items.get(timeout=10)):
            pass
        rate = m.result()["batches_per_s"]
    finally:
        stop.set()
        t.join(10)
    # against what the producer really made in the window (a loaded machine
    # may hold it back well under 200/s): the defect read far above it
    window = m.t_end - m.t_window
    made = sum(1 for t in put_at if m.t_window <= t <= m.t_end) / window
    assert 0.75 * made < rate < 1.1 * made, (rate, made)
    assert m.result()["pss_mb"] > 1.0  # read by the sampler process, not the patched function


@pytest.mark.parametrize("reading_cpu_s,readings_in_window", [(0.0, True), (0.02, False)])
def test_the_pss_sampler_spends_at_most_a_share_of_a_core_on_its_readings(
    monkeypatch: pytest.MonkeyPatch, reading_cpu_s: float, readings_in_window: bool,
) -> None:
    """A reading walks the page tables of the processes it reads (31-33 ms
    of CPU for a W7 worker process): after one as it starts, the sampler
    reads every interval or a hundred times as long as a reading took,
    whichever is longer, the first that long after the window opened, and
    once more at the stop.  Cheap readings come every interval (0.05 s
    here); readings of 20 ms come 2 s apart, so none falls in the 0.4 s
    the test waits."""
    reads: list[float] = []
    first, some = threading.Event(), threading.Event()

    def fake_pss_kb(pid: int) -> int:
        t0 = time.process_time()
        while time.process_time() - t0 < reading_cpu_s:
            pass
        reads.append(time.monotonic())
        first.set()
        if len(reads) >= 3:
            some.set()
        return 2048

    monkeypatch.setattr(measure, "_descendants", lambda root: [root])
    monkeypatch.setattr(measure, "_pss_kb", fake_pss_kb)
    r, w = os.pipe()
    stdin = os.fdopen(r, "r")
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setattr(sys, "stdout", out)
    # (the root: another process, as the sampler leaves its own PSS out)
    sampler = threading.Thread(target=measure._sampler_main, args=(os.getppid(), 0.05), daemon=True)
    sampler.start()
    try:
        assert first.wait(10)  # the reading as it starts
        assert len(reads) == 1
        went = time.monotonic()  # (before the "go": the sampler's own clock starts after it)
        os.write(w, b"go\n")
        if readings_in_window:
            assert some.wait(10), reads
            assert reads[1] - went >= 0.04, "the window's first reading an interval after it opened"
        else:
            assert not some.wait(0.4) and len(reads) == 1, reads
        os.write(w, b"stop\n")
        sampler.join(10)
        assert not sampler.is_alive()
    finally:
        os.close(w)
        stdin.close()
    assert out.getvalue().strip() == "2.000"


def test_the_pss_sampler_reads_a_tree_and_leaves_nothing_behind() -> None:
    sampler = measure.PssSampler(interval=0.05)
    pid = sampler._proc.pid
    sampler.go()
    child = subprocess.Popen([sys.executable, "-c", "import time, numpy; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while measure._pss_kb(child.pid) < 5000 and time.monotonic() < deadline:  # until numpy is in
            time.sleep(0.05)
        alone = measure._pss_kb(os.getpid()) / 1024
        peak = sampler.stop()
        assert peak > alone + 4, (peak, alone)  # the child counted, the sampler itself not
    finally:
        child.kill()
        child.wait(10)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    other = measure.PssSampler()
    other.close()
    assert other._proc is None and other.stop() == 0.0


# --------------------------------------------------------------------------- the legend and the lost column (issue 24)
def test_the_table_has_a_legend_of_the_runners_it_shows() -> None:
    """Issue 24: torch0, torch0it, W4/ideal had no legend, and W3/caffe2's
    lost (147550048) was unexplained."""
    results = {**_passing_results(), "W1/torch0it": _result(batches_per_s=290.0)}
    results["W3/caffe2"].update(samples_lost=147_550_048, lost_share=0.88)
    results["W2/caffe2"].update(lost_share=0.05)
    text = report.format_report(_report(results))
    lines = text.splitlines()
    top = lines.index("runners:")
    end = lines.index("", top)
    shown = {line.split()[0] for line in lines[top + 1: end] if line.startswith("  ")}
    assert shown == {"blobfeed", "caffe2", "copy", "model", "torch0it", "ideal"}, lines[top:end]
    caffe2 = next(line for line in lines[top:end] if line.startswith("  caffe2 "))
    assert "drops, by design, when its queue is full" in caffe2 and "(here: W2 5%, W3 88% of the samples fetched)" in caffe2
    lost = next(line for line in lines[top:end] if line.startswith("lost: "))
    assert "summed over the 3 repetitions" in lost and '"-": the runner does not count its samples' in lost
    # every runner the bench has is in the legend
    assert set(runner.RUNNERS) <= set(report.RUNNER_LEGEND)


def test_lost_means_the_same_on_every_row() -> None:
    """The column showed the median of the repetitions (the verdict their
    sum), and 0 for peers that do not count: now the sum for every runner
    that counts, and "-" for those that do not."""
    raw = {
        ("W1", "blobfeed"): [_result(), _result(samples_lost=7), _result()],
        ("W1", "caffe2"): [_result(samples_lost=n) for n in (10, 20, 30)],
        ("W1", "torch0it"): [{k: v for k, v in _result().items() if k != "samples_lost"}] * 3,
    }
    results = report.summarize(raw)
    lines = report.format_report(_report(results)).splitlines()
    top = lines.index(next(line for line in lines if line.startswith("workload/runner")))
    cells = {r["workload/runner"]: r for r in _column_cells(lines[top: lines.index("", top)])}
    assert cells["W1/blobfeed"]["lost"] == "7"
    assert cells["W1/caffe2"]["lost"] == "60"
    assert cells["W1/torch0it"]["lost"] == "-"


def test_a_peer_reports_no_lost_count() -> None:
    def body(fetcher: workloads.Fetcher, m: measure.Meter) -> None:
        m.begin()
        base.feed(m, (fetcher.chunk(0) for _ in iter(int, 1)))

    got = base.run_peer(workloads.WORKLOADS["W1"], 0.05, body, pss=False)
    assert got["batches_per_s"] > 0 and "samples_lost" not in got


# --------------------------------------------------------------------------- the estimate (issue 24)
def test_the_estimate_is_computed_from_the_options_and_checked_at_the_end(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """298 s were said and 361 s taken: the estimate printed before the run
    comes from the options and the runners it will run, and the run says
    at the end how long it took."""
    monkeypatch.setattr(runner, "measure_one", _canned)
    _only_pillow(monkeypatch)  # the CLI's own name too: with ray[data] installed it counted Ray Data's measurements
    said = {}
    for argv in (["--workloads", "W1", "--seconds", "1", "--repeats", "1"],
                 ["--workloads", "W1", "--seconds", "4", "--repeats", "1"],
                 ["--workloads", "W1", "--seconds", "1", "--repeats", "3"],
                 ["--workloads", "W1,W4", "--seconds", "1", "--repeats", "1"]):
        cli.main(argv)
        captured = capsys.readouterr()
        m = re.search(r"^blobfeed bench: (\d+) measurements \((\d+) per repeat x (\d+)\), about (\d+) s ", captured.err, re.M)
        assert m, captured.err
        wls, secs, reps = argv[1].split(","), float(argv[3]), int(argv[5])
        est = runner.estimate_seconds(wls, secs, reps, {"PIL"})
        assert int(m.group(4)) == round(est)
        assert int(m.group(1)) == reps * len(runner._plan(wls, {"PIL"}))
        assert re.search(rf"^blobfeed bench: took \d+ s \([\d.]+ min\); estimated {round(est)} s$", captured.out, re.M)
        said[tuple(argv)] = est
    one, longer, repeated, with_w4 = said.values()
    assert longer == pytest.approx(one + 2 * 3.0)  # two measurements, 3 s more each
    assert repeated == pytest.approx(3 * one)
    # W4's runners calibrate their loop: more than two more W1-like measurements
    assert with_w4 - one == pytest.approx(runner.measurement_seconds("W4", "blobfeed", 1.0)
                                          + runner.measurement_seconds("W4", "caffe2", 1.0))
    assert runner.measurement_seconds("W4", "blobfeed", 1.0) > runner.measurement_seconds("W1", "blobfeed", 1.0)


def test_each_runner_has_its_own_overheads() -> None:
    base = runner.CHILD_OVERHEAD_S + runner.WARMUP_S + 5.0
    assert runner.measurement_seconds("W1", "blobfeed", 5.0) == pytest.approx(base)
    assert runner.measurement_seconds("W1p", "pool", 5.0) == pytest.approx(base + runner.POOL_EXTRA_S)
    assert runner.measurement_seconds("W4p", "blobfeed", 5.0) == pytest.approx(
        base + runner.PROCESSES_EXTRA_S + runner.CALIBRATION_S + runner.CPU_PROCESSES_DRAIN_S)
    assert runner.measurement_seconds("W5", "blobfeed", 5.0) > base + 5.0  # the interleaved slices


@pytest.mark.parametrize("value,target,shown", [
    (1.198, "S1 batches/s vs four independent process pipelines >= 1.2", "1.198"),  # printed "1.20 MISSED"
    (1.2, "S1 batches/s vs four independent process pipelines >= 1.2", "1.20"),
    (0.28, "S1 GB/s vs the copy bound >= 0.6", "0.28"),
    (0.50004, "S1 total PSS vs four independent pipelines <= 0.5", "0.5000"),
])
def test_a_ratio_never_reads_as_its_targets_bound_when_it_is_not(value: float, target: str, shown: str) -> None:
    from blobfeed.apps.bench.report import _measured

    assert _measured(value, target) == shown


# --------------------------------------------------------------------------- random-access sources: W1i, W2i, W7 (issue 26)
def test_the_random_access_targets_met_in_the_table_and_the_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    results = {**_passing_results(), **_peer_results()}
    out_json = tmp_path / "r.json"
    assert _run_main(monkeypatch, results, "--json", str(out_json)) == 0
    out = capsys.readouterr().out
    # W1i and W2i beside their fetch_fun form, as the ordered modes beside theirs
    assert re.search(r"^W1i/blobfeed +.* 0\.93 x W1$", out, re.M), out
    assert re.search(r"^W2i/blobfeed +.* 0\.94 x W2$", out, re.M), out
    assert re.search(r"^W1i batches/s vs W1 >= 0\.9 +0\.93  ok$", out, re.M), out
    assert re.search(r"^W2i batches/s vs W2 >= 0\.9 +0\.94  ok$", out, re.M), out
    assert re.search(r"^W7 batches/s shuffled vs its own sequential read >= 0\.8 +0\.91  ok$", out, re.M), out
    assert re.search(r"^W7 batches/s vs torch's and grain's map-style loaders at their best worker count >= 1\.5 "
                     r"+1\.67  ok  \[best: grainmap2; work2, the work alone with no pipeline: 2\.50 x grainmap2, "
                     r"blobfeed 0\.67 x it\]$", out, re.M), out
    assert re.search(r"^W7 samples lost == 0 \(sequential\) +0  ok$", out, re.M), out
    # every runner of the sweep is a row, and has its legend line
    for p in workloads.W7_PEERS:
        assert re.search(rf"^W7/{p} ", out, re.M), out
        assert re.search(rf"^  {p} +\S", out, re.M), out
    assert re.search(r"^  sequential +blobfeed on W7's source with shuffle=False", out, re.M), out
    assert re.search(r"^  work2 +W7's work alone, no pipeline", out, re.M), out
    saved = json.loads(out_json.read_text())
    rows = {(t["workload"], t["target"]): t for t in saved["targets"]}
    assert rows[("W1i", "batches/s vs W1 >= 0.9")]["ratio"] == pytest.approx(280 / 300)
    summarized = report.summarize({("W2", "blobfeed"): [_result(batches_per_s=500.0)],
                                  ("W2i", "blobfeed"): [_result(batches_per_s=470.0)]})
    assert summarized["W2i/blobfeed"]["base_ratio"] == pytest.approx(0.94)  # in --json too
    assert rows[("W7", "batches/s vs torch's and grain's map-style loaders at their best worker count >= 1.5")][
        "detail"] == "best: grainmap2; work2, the work alone with no pipeline: 2.50 x grainmap2, blobfeed 0.67 x it"


def test_the_random_access_targets_without_their_peers_or_their_base(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {**_passing_results(), **_peer_results()}
    target = "batches/s vs torch's and grain's map-style loaders"
    # grain not installed: judged against torch's sweep, and says so
    no_grain = {k: v for k, v in results.items() if "/grainmap" not in k}
    row = _row(report.evaluate(_report(no_grain)), "W7", target)
    assert row["ok"] is True and row["ratio"] == pytest.approx(200 / 75)
    assert row["detail"] == ("best: torchmap4; not run: grainmap0, grainmap1, grainmap2, grainmap4; work2, the work "
                             "alone with no pipeline: 4.00 x torchmap4, blobfeed 0.67 x it")
    # neither installed: not evaluated (peer missing), not a failure
    neither = {k: v for k, v in results.items() if "map" not in k.split("/")[1]}
    row = _row(report.evaluate(_report(neither)), "W7", target)
    assert row["ok"] is None and row["ratio"] is None
    assert row["detail"] == f"peer missing: {', '.join(workloads.W7_PEERS)}"
    # W1i, W2i without W1, W2 in the run: not evaluated
    alone = {k: v for k, v in neither.items() if not k.startswith(("W1/", "W2/"))}
    rows = report.evaluate(_report(alone))
    assert _row(rows, "W1i", "batches/s vs W1")["detail"] == "W1 not in this run"
    assert _row(rows, "W2i", "batches/s vs W2")["ok"] is None
    assert _run_main(monkeypatch, neither) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^W7 {target} at their best worker count >= 1\.5 +- +not evaluated \(peer missing\)  "
                     r"\[torchmap0, ", out, re.M), out
    assert re.search(r"^verdict: all \d+ targets met$", out, re.M), out


def test_a_sample_lost_by_w7s_sequential_read_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {**_passing_results(), **_peer_results()}
    results["W7/sequential"]["samples_lost"] = 3
    assert _run_main(monkeypatch, results) == 1
    assert re.search(r"^  W7 samples lost == 0 \(sequential\): measured 3$", capsys.readouterr().out, re.M)


def test_the_plan_and_the_estimate_of_the_random_access_workloads() -> None:
    assert not {"W1i", "W2i", "W7"} & set(DEFAULT)
    assert "W7" in cli.parse_workloads("all")  # opt-in, like S1: not in the default run, in all
    assert runner._plan(["W1i", "W2i", "W7"], {"PIL"}) == [
        ("W1i", "blobfeed"), ("W2i", "blobfeed"), ("W7", "blobfeed"), ("W7", "sequential"), ("W7", "work2"),
        ("W7", "hand2"),
    ]
    full = runner._plan(["W7"], {"PIL", "torch", "grain"})
    assert full == [("W7", "blobfeed"), ("W7", "sequential"), ("W7", "work2"), ("W7", "hand2"),
                    *(("W7", p) for p in workloads.W7_PEERS)]
    assert [p for _, p in runner._plan(["W7"], {"PIL", "torch"})][4:] == [f"torchmap{k}" for k in (0, 1, 2, 4)]
    one = runner.CHILD_OVERHEAD_S + runner.WARMUP_S + 3.0
    assert runner.measurement_seconds("W1i", "blobfeed", 3.0) == pytest.approx(one)  # threads, as W1
    assert runner.measurement_seconds("W7", "blobfeed", 3.0) == pytest.approx(
        one + runner.PROCESSES_EXTRA_S + runner.W7_EXTRA_S)
    assert runner.measurement_seconds("W7", "sequential", 3.0) == runner.measurement_seconds("W7", "blobfeed", 3.0)
    assert runner.measurement_seconds("W7", "work2", 3.0) == pytest.approx(one + runner.WORK2_EXTRA_S)
    assert runner.measurement_seconds("W7", "hand2", 3.0) == runner.measurement_seconds("W7", "work2", 3.0)
    assert runner.measurement_seconds("W7", "torchmap4", 3.0) == pytest.approx(
        one + runner.TORCH_EXTRA_S + runner.TORCH_MAP_EXTRA_S + 4 * runner.TORCH_MAP_WORKER_S)
    assert runner.measurement_seconds("W7", "grainmap0", 3.0) == pytest.approx(
        one + runner.GRAIN_EXTRA_S + runner.GRAIN_MAP_EXTRA_S)
    assert runner.measurement_seconds("W7", "grainmap4", 3.0) > runner.measurement_seconds("W7", "grainmap2", 3.0)
    sweep = sum(runner.measurement_seconds("W7", p, 3.0) for p in workloads.W7_PEERS)
    assert runner.estimate_seconds(["W1i", "W2i", "W7"], 3.0, 1, {"PIL", "torch", "grain"}) == pytest.approx(
        runner.estimate_seconds(["W1i", "W2i", "W7"], 3.0, 1, {"PIL"}) + sweep)
    assert runner.estimate_seconds(["W7"], 3.0, 2, {"PIL"}) == pytest.approx(
        2 * (2 * runner.measurement_seconds("W7", "blobfeed", 3.0) + 2 * runner.measurement_seconds("W7", "work2", 3.0)))


def test_w1i_and_w2i_read_w1s_and_w2s_arrays_by_index() -> None:
    w1, w2 = workloads.w1_dataset(), workloads.w2_dataset()
    assert len(w1) % workloads.WORKLOADS["W1i"].batch == 0 and len(w2) % workloads.WORKLOADS["W2i"].batch == 0
    pools = workloads.W1Fetch().build()[1]
    for i in (0, 63, 64, 511, 512, len(w1) - 1):
        data, label = w1[i]
        np.testing.assert_array_equal(data, pools[(i // 64) % 8][0][i % 64])  # W1's own rows
        assert label == i and label.dtype == np.float64
    # W1i reads a unit at once, stacked: the same rows and labels as one by one
    unit = w1.__getitems__([5, 700, 64, len(w1) - 1])
    assert sorted(unit) == ["data", "label"]
    np.testing.assert_array_equal(unit["data"], np.stack([w1[i][0] for i in (5, 700, 64, len(w1) - 1)]))
    np.testing.assert_array_equal(unit["label"], np.array([5, 700, 64, len(w1) - 1], dtype=np.float64))
    images = workloads.W2Fetch().build()[1]
    many = w2.__getitems__([3, 19, 1023])
    assert [int(lab) for _, lab in many] == [3, 19, 1023]
    for (img, _), i in zip(many, (3, 19, 1023)):
        assert np.shares_memory(img, w2._arrays[0])  # a view: no copy before blobfeed's
        np.testing.assert_array_equal(img, images[i % 16])
    import pickle

    assert pickle.loads(pickle.dumps(w2))._arrays is None  # its arrays are built where it is read


def test_w7s_record_file_is_generated_once_checked_and_read_whole(tmp_path: Path) -> None:
    import io
    import pickle

    folder = tmp_path / "w7"
    said = io.StringIO()
    size = 3 << 20  # a few MB: the real file is 2 GB
    assert workloads.ensure_w7_records(folder, size=size, progress=said) == folder
    assert "generating W7's record file" in said.getvalue()
    offsets = np.load(folder / workloads.W7_INDEX)
    sizes = np.diff(offsets)
    n = len(sizes)
    assert n > 0 and n % workloads.W7_BATCH == 0
    assert sizes.min() >= 4096 and sizes.max() <= 65536
    assert os.path.getsize(folder / workloads.W7_DATA) == offsets[-1] <= size
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    raw = (folder / workloads.W7_DATA).read_bytes()
    ds = workloads.W7Records(folder)
    assert len(ds) == n
    for i in (0, 1, n - 1):
        data, length, index = ds[i]
        assert data.shape == (65536,) and data.dtype == np.uint8
        assert int(length) == sizes[i] and int(index) == i
        assert data[: sizes[i]].tobytes() == raw[offsets[i]: offsets[i + 1]]  # every byte of the record
        assert not data[sizes[i]:].any()  # then zeros
    for (d1, l1, i1), i in zip(ds.__getitems__([n - 1, 0, 5]), (n - 1, 0, 5)):
        d0, l0, i0 = ds[i]
        np.testing.assert_array_equal(d1, d0)
        assert (l1, i1) == (l0, i0)
    assert pickle.loads(pickle.dumps(ds))._map is None  # a worker maps the file itself
    with pytest.raises(IndexError, match=f"W7 has {n} records"):
        ds[n]
    # reused as it is; written again (the same bytes) when it fails the size check
    mtime = os.stat(folder / workloads.W7_DATA).st_mtime_ns
    workloads.ensure_w7_records(folder, size=size, progress=io.StringIO())
    assert os.stat(folder / workloads.W7_DATA).st_mtime_ns == mtime
    with open(folder / workloads.W7_DATA, "r+b") as f:
        f.truncate(1000)
    assert not workloads.w7_records_ok(folder, size)
    workloads.ensure_w7_records(folder, size=size)
    assert workloads.w7_records_ok(folder, size)
    assert (folder / workloads.W7_DATA).read_bytes() == raw
    assert not workloads.w7_records_ok(folder, 2 * size)  # another size: another index
    with pytest.raises(ValueError, match="hold no 64 records"):
        workloads.w7_offsets(100_000)


@pytest.fixture(scope="module")
def small_w7(tmp_path_factory: pytest.TempPathFactory) -> workloads.Workload:
    """W7 over a 3 MB record file (64 records) in a temporary folder."""
    import dataclasses

    folder = workloads.ensure_w7_records(tmp_path_factory.mktemp("w7") / "w7", size=3 << 20)
    return dataclasses.replace(workloads.WORKLOADS["W7"], dataset=functools.partial(workloads.W7Records, folder))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shuffle", [True, False])
def test_w7s_runner_checks_the_global_shuffle_on_process_workers(small_w7: workloads.Workload, shuffle: bool) -> None:
    from blobfeed.apps.bench import library

    got = library.run_indexed(small_w7, 0.2, shuffle=shuffle)
    assert got["samples_lost"] == 0, got
    assert got["batches_per_s"] > 0 and got["samples_checked"] > got["dataset_length"] == 64  # past an epoch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["work2", "hand2"])
def test_w7s_work_alone_reads_on_two_processes_and_leaves_none(small_w7: workloads.Workload, name: str) -> None:
    import multiprocessing

    from blobfeed.apps.bench import peers

    peers.RUNNERS[name](small_w7, 0.2)  # what a first run starts for good (multiprocessing's resource tracker)
    fds = open_fds()
    got = peers.RUNNERS[name](small_w7, 0.2)
    assert got["batches_per_s"] > 0 and got["workers"] == 2 and "samples_lost" not in got
    # 64 records of 64 KiB, their sizes and indexes per batch: the meter counted W7's batches
    assert got["gb_per_s"] == pytest.approx(got["batches_per_s"] * 64 * (65536 + 16) / 1e9, rel=1e-6)
    assert not multiprocessing.active_children()
    assert not fds_opened_since(fds)  # its pipes, queue and shared memory closed


class _OneOutOfPlace(workloads.IndexedArrays):
    """W1i's dataset with samples 5 and 6 of every epoch swapped."""

    def __getitems__(self, indices: list[int]) -> list[tuple]:
        swap = {5: 6, 6: 5}
        return super().__getitems__([swap.get(i, i) for i in indices])


@pytest.mark.timeout(60)
def test_the_random_access_runner_counts_samples_out_of_place() -> None:
    import dataclasses

    from blobfeed.apps.bench import library

    wl = dataclasses.replace(workloads.WORKLOADS["W1i"], dataset=lambda: _OneOutOfPlace("W1", 64))
    got = library.run_indexed(wl, 0.1)
    assert got["samples_lost"] >= 2 and got["samples_lost"] % 2 == 0, got  # two positions per epoch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("peer", ["torchmap0", "grainmap0"])
def test_w7s_peers_read_the_same_dataset(small_w7: workloads.Workload, peer: str) -> None:
    pytest.importorskip(peer[:-4])
    from blobfeed.apps.bench import peers

    got = peers.RUNNERS[peer](small_w7, 0.2)
    assert got["batches_per_s"] > 0 and "samples_lost" not in got and got["workers"] == 0


@pytest.mark.timeout(240)
@W1_FAMILY
def test_a_tiny_real_run_of_w1i_and_w2i_reports_their_rows_and_loses_nothing(
    w1_family_run: subprocess.CompletedProcess[str],
) -> None:
    out = _check_real_run(w1_family_run, "W1i")
    for w in ("W1i", "W2i"):
        assert re.search(rf"^{w}/blobfeed +[\d.]+ +[\d.]+ +\d+ +\d+ +[\d.]+ +0\b", out, re.M), out
        assert re.search(rf"^{w} samples lost == 0 +0  ok$", out, re.M), out
    # W1i beside W1, which ran: its target is judged; W2 did not run: W2i's is not
    assert re.search(r"^W1i/blobfeed +.* [\d.]+ x W1$", out, re.M), out
    assert re.search(r"^W1i batches/s vs W1 >= 0\.9 +[\d.]+  (ok|MISSED)$", out, re.M), out
    assert re.search(r"^W2i batches/s vs W2 >= 0\.9 +- +not evaluated  \[W2 not in this run\]$", out, re.M), out


# --------------------------------------------------------------------------- the auto workloads (issue 27)
def _series(rate_bps: float, batch: int, until: float, reach_at: float, start_bps: float = 0.0,
            step: float = 0.25, t0: float = 0.0, samples0: int = 0) -> list[list[float]]:
    """An auto run's series: ``start_bps`` until ``reach_at``, then ``rate_bps``."""
    out, samples, t = [], float(samples0), t0
    while t <= until + 1e-9:
        out.append([round(t, 3), int(samples), 2, 1 << 20])
        samples += (start_bps if t < reach_at else rate_bps) * batch * step
        t += step
    return out


def _auto_results(auto_bps: float = 98.0, reach_at: float = 3.0, recover_at: float = 2.0,
                  peak_mb: float = 5.0) -> dict[str, dict[str, Any]]:
    """Aio's rows as run_all reports them: fixed counts (best: fixed8, 100
    batches/s; at the doubled cost fixed16x2, 60), auto and autox2."""
    res = {f"Aio/fixed{n}": _result(batches_per_s=bps, workers=float(n), peak_queue_mb=1.0, budget_mb=512.0,
                                    batch=32)
           for n, bps in ((1, 20.0), (2, 40.0), (4, 75.0), (8, 100.0), (16, 99.0))}
    res.update({f"Aio/fixed{n}x2": _result(batches_per_s=bps, workers=float(n), peak_queue_mb=1.0,
                                           budget_mb=512.0, batch=32)
                for n, bps in ((1, 10.0), (2, 20.0), (4, 38.0), (8, 55.0), (16, 60.0))})
    res["Aio/auto"] = _result(batches_per_s=auto_bps, workers=8.0, peak_queue_mb=peak_mb, budget_mb=512.0, batch=32,
                              series=[_series(auto_bps, 32, 15.0, reach_at, start_bps=20.0)] * 3)
    first = _series(100.0, 32, 15.0, 1.0, start_bps=20.0)
    after = _series(60.0, 32, 30.0, 15.0 + recover_at, start_bps=30.0, t0=15.25, samples0=first[-1][1] + 800)
    res["Aio/autox2"] = _result(batches_per_s=59.0, workers=16.0, peak_queue_mb=peak_mb, budget_mb=512.0,
                                batch=32, doubled_at_s=15.0, series=[first + after] * 3)
    return res


def test_the_auto_workloads_are_opt_in_and_named_auto() -> None:
    assert cli.parse_workloads("auto") == ["A4p", "A6p", "A2p", "Aio"]
    assert not set(cli.parse_workloads(cli.DEFAULT_WORKLOADS)) & set(cli.parse_workloads("auto"))
    assert runner._plan(["Aio"], {"PIL"})[:6] == [("Aio", f"fixed{n}") for n in (1, 2, 4, 8, 16)] + [("Aio", "auto")]
    assert [r for _, r in runner._plan(["A4p"], {"PIL"})] == [
        "fixed1", "fixed2", "fixed4", "fixed8", "auto", "fixed1x2", "fixed2x2", "fixed4x2", "fixed8x2", "autox2"]
    # the estimate counts auto's settling (and autox2's twice), not a plain warm-up
    assert runner.measurement_seconds("Aio", "auto", 5.0) == pytest.approx(runner.CHILD_OVERHEAD_S + 15.0)
    assert runner.measurement_seconds("Aio", "autox2", 5.0) == pytest.approx(runner.CHILD_OVERHEAD_S + 30.0)
    assert runner.measurement_seconds("A4p", "fixed8", 5.0) > runner.measurement_seconds("Aio", "fixed8", 5.0)
    assert "--workloads auto" in cli.build_parser().format_help()


def test_the_time_to_reach_a_rate_is_read_from_the_series() -> None:
    s = _series(100.0, 32, 15.0, 4.0, start_bps=20.0)
    t = autobench.time_to(s, 32, 95.0)
    assert t is not None and 4.0 < t <= 4.0 + autobench.RATE_SPAN_S + 0.25
    assert autobench.time_to(s, 32, 101.0) is None
    # counted from the doubling, over spans after it only
    assert autobench.time_to(s, 32, 95.0, after=10.0) == pytest.approx(0.75 * autobench.RATE_SPAN_S)


def test_the_auto_targets_met_in_the_table_and_the_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    rows = report.evaluate(_report(_auto_results()))
    auto = [r for r in rows if r["workload"] == "Aio"]
    assert {r["target"].split(" >=")[0].split(" within")[0] for r in auto} >= {
        "auto's batches/s after 10 s vs the best fixed count", "auto reaches 0.95 x the best fixed count",
        "after the fetch cost doubles, auto reaches 0.9 x the new best", "auto: peak buffered bytes <= the budget",
        "autox2: peak buffered bytes <= the budget", "samples lost == 0 (auto)"}
    assert all(r["ok"] for r in auto), [r for r in auto if not r["ok"]]
    assert _row(rows, "Aio", "auto's batches/s")["ratio"] == pytest.approx(0.98)
    assert "best: fixed8" in _row(rows, "Aio", "auto's batches/s")["detail"]
    assert "new best: fixed16x2" in _row(rows, "Aio", "after the fetch cost doubles")["detail"]
    text = report.format_report(_report(_auto_results()))
    assert re.search(r"^Aio/auto +98\.0 batches/s \(0\.98 x fixed8\), 8 workers at the end, 0\.95 x reached: "
                     r"[\d.]+ s; peak queue 5\.0 MiB of a 512 MiB budget$", text, re.M), text
    assert re.search(r"^Aio/autox2 .* 0\.9 x reached: [\d.]+ s after the doubling", text, re.M), text
    assert re.search(r"^  autox2 +auto whose fetch cost doubles", text, re.M)
    monkeypatch.setattr(cli, "run_all", lambda *a, **k: _report(_auto_results()))
    assert cli.main(["--workloads", "auto", "--json", str(tmp_path / "auto.json")]) == 0
    saved = json.loads((tmp_path / "auto.json").read_text())
    assert any(t["workload"] == "Aio" and t["target"].startswith("auto reaches") and t["ok"] for t in saved["targets"])


@pytest.mark.parametrize("kw, missed", [
    (dict(auto_bps=90.0), "auto's batches/s after 10 s"),
    (dict(reach_at=12.0), "auto reaches 0.95 x"),
    (dict(recover_at=11.0), "after the fetch cost doubles"),
    (dict(peak_mb=600.0), "auto: peak buffered bytes"),
])
def test_the_auto_targets_missed(kw: dict, missed: str) -> None:
    rows = report.evaluate(_report(_auto_results(**kw)))
    assert _row(rows, "Aio", missed)["ok"] is False
    status, lines = report.verdict(rows)
    assert status == 1 and any(missed in line for line in lines)


def test_the_auto_median_keeps_each_repetitions_series() -> None:
    runs = [_result(batches_per_s=b, series=[[0.0, 0, 1, 0]]) for b in (1.0, 3.0, 2.0)]
    out = report.summarize({("Aio", "auto"): runs})
    assert out["Aio/auto"]["batches_per_s"] == 2.0 and len(out["Aio/auto"]["series"]) == 3


def test_a_tiny_real_run_of_the_auto_runners(monkeypatch: pytest.MonkeyPatch) -> None:
    """The I/O workload's auto and autox2 at 0.3 s windows after 0.3 s of
    settling, in this process: a series, the worker count, the budget,
    nothing lost."""
    monkeypatch.setattr(autobench, "SETTLE_S", 0.3)
    wl = workloads.WORKLOADS["Aio"]
    fixed = autobench.RUNNERS["fixed2x2"](wl, 0.3)
    assert fixed["samples_lost"] == 0 and fixed["workers"] == 2 and fixed["batches_per_s"] > 0
    for name in ("auto", "autox2"):
        out = autobench.RUNNERS[name](wl, 0.3)
        assert out["samples_lost"] == 0, out
        assert out["series"] and out["workers"] >= 1 and out["budget_mb"] > 0
        assert out["peak_queue_mb"] <= out["budget_mb"]
    assert out["doubled_at_s"] == pytest.approx(0.6)
    assert out["series"][-1][0] > out["doubled_at_s"] + 0.3  # it ran on after the doubling


def test_a_slow_workloads_reach_time_is_read_over_enough_batches() -> None:
    """At a few batches/s a second holds a handful: one batch early must not read as reached."""
    s = _series(10.0, 32, 30.0, 20.0, start_bps=5.0)
    s[8][1] += 32 * 6  # six batches at once, at 2 s
    t = autobench.time_to(s, 32, 9.5)
    assert t is not None and t > 20.0, t


def test_the_bare_runner_fails_cleanly_leaving_no_thread_or_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """S2's ``bare`` runner whose window fails (a consumer died, say): the
    error comes out at once; its threads (a receiver blocked in ``recv``
    included) and its consumer processes are gone."""
    started: list[subprocess.Popen[bytes]] = []
    real_start = service._Consumers.start

    def start(self: Any, *args: str) -> None:
        real_start(self, *args)
        started.append(self.procs[-1][0])

    def failing_window(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("the window failed")

    monkeypatch.setattr(service._Consumers, "start", start)
    monkeypatch.setattr(service, "_window_result", failing_window)
    before = set(threading.enumerate())
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the window failed"):
        service.run_bare(workloads.WORKLOADS["S2"], 1.0)
    assert time.monotonic() - t0 < 30.0
    assert len(started) == workloads.WORKLOADS["S2"].consumers
    assert all(p.poll() is not None for p in started), [p.pid for p in started]
    assert set(threading.enumerate()) <= before, set(threading.enumerate()) - before


def test_a_bare_consumer_that_dies_at_its_start_is_an_error_with_its_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer process of the ``bare`` runner that exits before it
    connects: the runner says so at once, with the process's exit code and
    stderr, instead of waiting for connections that never come."""
    monkeypatch.setattr(service, "consumer_command", lambda *args: [
        sys.executable, "-c", "import sys; sys.stderr.write('no such thing\\n'); sys.exit(3)"])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)exited with 3.*no such thing"):
        service.run_bare(workloads.WORKLOADS["S2"], 1.0)
    assert time.monotonic() - t0 < 10.0


def test_the_direct_runner_deals_every_batch_to_a_consumer_and_leaves_nothing_behind() -> None:
    """S1's ``direct`` runner for real, briefly: its consumers took whole
    batches from both workers (each counted in the window), and its worker
    and consumer processes and their files are gone after it."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    started: list[subprocess.Popen[bytes]] = []
    real_start = service._Consumers.start

    def start(self: Any, *args: str) -> None:
        real_start(self, *args)
        started.append(self.procs[-1][0])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service._Consumers, "start", start)
        out = direct.run_direct(workloads.WORKLOADS["S1"], 0.3)
    assert out["batches_per_s"] > 0 and out["delivered"] > 0, out
    assert out["delivered"] % workloads.WORKLOADS["S1"].batch == 0, out  # whole batches only
    # CPU is read in clock ticks (10 ms a process): the consumers' few tens
    # of us a batch may read 0 in a 0.3 s window on a loaded machine (they
    # did); the workers' copies never do
    assert out["service_cpu_us_per_batch"] > 0 and out["consumer_cpu_us_per_batch"] >= 0, out
    assert out["consumer_ctx_per_batch"] > 0, out  # each consumer waited for its batches
    assert len(started) == direct.SERVICE_WORKERS + workloads.WORKLOADS["S1"].consumers
    assert all(p.poll() is not None for p in started), [p.pid for p in started]
    if os.path.isdir("/dev/shm"):
        assert not {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("blobfeed-direct-")}


def test_a_direct_process_that_dies_at_its_start_is_an_error_with_its_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker or consumer process of the ``direct`` runner that exits at
    its start: the runner says so at once, with its exit code and stderr,
    and leaves no process behind."""
    monkeypatch.setattr(direct, "DIRECT_MAIN", "import sys; sys.stderr.write('no such thing\\n'); sys.exit(3)")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)exited with 3.*no such thing"):
        direct.run_direct(workloads.WORKLOADS["S1"], 1.0)
    assert time.monotonic() - t0 < 30.0


def test_w7_runners_run_with_glibc_keeping_freed_memory_unless_the_caller_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """W7's children get ``KEEP_FREED_MEMORY`` (torch's loader otherwise runs
    at one of two speeds from run to run); a value the caller set wins, and
    another workload's children get the caller's environment unchanged."""
    printing = [sys.executable, "-c", "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
                "if k.startswith('MALLOC_')}))"]
    monkeypatch.setattr(runner, "child_command", lambda *args: printing)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")
    want = dict(workloads.KEEP_FREED_MEMORY)
    assert runner._child("W7", "torchmap0", 0.05) == {"MALLOC_MMAP_THRESHOLD_": want["MALLOC_MMAP_THRESHOLD_"],
                                                     "MALLOC_TRIM_THRESHOLD_": "123"}
    assert runner._child("W1", "blobfeed", 0.05) == {"MALLOC_TRIM_THRESHOLD_": "123"}


def test_the_ledger_runner_accounts_for_every_batch_and_leaves_nothing_behind() -> None:
    """The ``ledger`` runner for real, briefly, with S8's eight consumers
    (S1's four run in the tiny real run): every batch a worker sent was
    acknowledged to the ledger or is one of the two each consumer holds at
    its end, none acknowledged unannounced; its processes and files are
    gone after it.  (A worker had as many slots as its four consumers held,
    and the run hung, found by review.)"""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    wl = workloads.WORKLOADS["S8"]
    out = direct.run_ledger(wl, 0.3)
    assert out["batches_per_s"] > 0 and out["delivered"] > 0, out
    assert out["delivered"] == wl.batch * (out["acknowledged"] + out["in_flight"]), out
    assert out["in_flight"] == wl.consumers * direct.LEDGER_HOLD and out["unknown"] == 0, out
    assert out["service_cpu_us_per_batch"] > 0, out  # the workers' copies, and the ledger's process
    if os.path.isdir("/dev/shm"):
        assert not {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("blobfeed-direct-")}
