"""The report: the targets, each measurement's repetitions summarized,
the table, and the verdict (the exit status)."""

from __future__ import annotations

import re

import statistics
from collections.abc import Callable
from typing import Any

from . import autobench
from .measure import STEP_CPU, STEP_CTX
from .workloads import IN_PROCESS_PEERS, PROCESS_PEERS, W7_PEER_WORKERS, W7_PEERS, WORKLOADS


TARGETS = [
    # (workload, description, numerator runner, denominator runner, metric, threshold);
    # denominator "ideal": the run's own ideal_ratio; "model": W5's interleaved model_ratio
    ("W1", "batches/s vs Caffe2", "blobfeed", "caffe2", "batches_per_s", 2.0),
    ("W2", "GB/s vs the copy bound", "blobfeed", "copy", "gb_per_s", 0.7),
    ("W2", "batches/s vs Caffe2", "blobfeed", "caffe2", "batches_per_s", 4.0),
    ("W3", "batches/s vs Caffe2", "blobfeed", "caffe2", "batches_per_s", 6.0),
    ("W4", "batches/s vs one core's ideal", "blobfeed", "ideal", "batches_per_s", 0.9),
    ("W5", "batches/s vs the model alone (interleaved)", "blobfeed", "model", "batches_per_s", 0.85),
    ("W4p", "batches/s vs the two-core ideal", "blobfeed", "ideal", "batches_per_s", 0.85),
    ("W6p", "batches/s vs the two-core ideal", "blobfeed", "ideal", "batches_per_s", 0.85),
    # W7: the global shuffle against the same source read in order (shuffle=False), in the same run
    ("W7", "batches/s shuffled vs its own sequential read", "blobfeed", "sequential", "batches_per_s", 0.8),
]

PEER_TARGETS = [
    # (workload, description, peers, threshold): blobfeed's batches/s over the best of the peers that ran
    ("W1", "batches/s vs the best in-process peer", IN_PROCESS_PEERS, 1.0),
    ("W2", "batches/s vs the best in-process peer", IN_PROCESS_PEERS, 1.0),
    ("W1p", "batches/s vs the best process peer", PROCESS_PEERS, 1.5),
    ("W2p", "batches/s vs the best process peer", PROCESS_PEERS, 2.0),
    ("W1", "batches/s vs Ray Data", ("raydata",), 1.0),
    ("W2", "batches/s vs Ray Data", ("raydata",), 1.0),
    ("W3", "batches/s vs Ray Data", ("raydata",), 1.0),
    ("W7", "batches/s vs torch's and grain's map-style loaders at their best worker count", W7_PEERS, 1.5),
]

#: (workload, runner): the work alone, with no pipeline, that the workload's
#: peer row is also set against in its detail (what any loader of that
#: layout can reach on this machine; see peers/work_bound.py)
PEER_CEILINGS = {"W7": "work2"}

#: W2p's memory target compares blobfeed's PSS with grain's (its process peers)
GRAIN_PEERS = ("grain2", "grain2b")

#: first batch after ``start()``, milliseconds
FIRST_BATCH_TARGETS = [("W1", 50.0), ("W1p", 500.0)]

#: (workload, threshold): blobfeed's batches/s in an ordered mode over its
#: batches/s on the workload's ``base`` (default mode) in the same run;
#: evaluated only when both ran.  Shuffling (W1s, W2s) may cost at most
#: half the default mode's rate.  The random-access sources (W1i, W2i: the
#: same data behind a map-style dataset) against the fetch_fun form: 0.9.
MODE_TARGETS = [("W1d", 0.8), ("W2d", 0.8), ("W4pd", 0.9), ("W1s", 0.5), ("W2s", 0.5), ("W1i", 0.9), ("W2i", 0.9)]
#: blobfeed's runners besides ``blobfeed`` that count their samples (their
#: lost column is judged): W7's own sequential read
COUNTED_RUNNERS = ("sequential", *autobench.RUNNERS)


#: the feeding service (S1, S2, S8): (workload, description, numerator
#: runner, denominator, metric, comparison, threshold); the denominator is a
#: runner of the same workload ("pipes": one independent pipeline per
#: consumer process; "raysplit": Ray Data's streaming_split, a peer, not
#: evaluated where ray[data] is not installed) or another workload's
#: measurement ("S1/service": not evaluated when S1 is not in the run)
SERVICE_TARGETS = [
    ("S1", "GB/s vs the copy bound", "service", "copy", "gb_per_s", ">=", 0.6),
    ("S1", "batches/s vs four independent process pipelines", "service", "pipes", "batches_per_s", ">=", 1.2),
    ("S1", "total PSS vs four independent process pipelines", "service", "pipes", "pss_mb", "<=", 0.5),
    ("S2", "batches/s vs four independent thread pipelines", "service", "pipes", "batches_per_s", ">=", 0.3),
    ("S8", "total batches/s vs S1's", "service", "S1/service", "batches_per_s", ">=", 0.9),
    ("S1", "batches/s vs Ray Data streaming_split(4)", "service", "raysplit", "batches_per_s", ">=", 5.0),
    ("S2", "batches/s vs Ray Data streaming_split(4)", "service", "raysplit", "batches_per_s", ">=", 5.0),
]
#: (workload, limit in microseconds): the service's and a consumer's CPU per
#: batch together, beyond what an independent pipeline spends per batch
#: (its process and its workers), in the same run
SERVICE_CPU_TARGETS = [("S2", 30.0)]
#: the runners of S1, S2, S8 and attach that are blobfeed (checked for lost samples)
SERVICE_RUNNERS = ("service", "pipes")
#: attach: from ``attach_source(...)`` to the first batch, milliseconds
ATTACH_LIMIT_MS = 50.0


def base_ratio(results: dict[str, dict[str, Any]], wl: str) -> float | None:
    """blobfeed's batches/s on ``wl`` over its batches/s on ``wl``'s base
    workload (W1d: W1), or None when ``wl`` has no base or either did not run."""
    w = WORKLOADS.get(wl)
    a = results.get(f"{wl}/blobfeed")
    b = results.get(f"{w.base}/blobfeed") if w is not None and w.base else None
    if a is None or b is None or "failed" in a or "failed" in b or not b["batches_per_s"]:
        return None
    return float(a["batches_per_s"] / b["batches_per_s"])


def _keys_in_all(results: list[dict[str, Any]]) -> list[str]:
    common = set(results[0]).intersection(*results[1:])
    return [k for k in results[0] if k in common]


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure; a list (auto's series) is kept per
    repetition, as a list of them."""
    return {
        k: [r[k] for r in results] if isinstance(results[0][k], list) else statistics.median(r[k] for r in results)
        for k in _keys_in_all(results)
    }


#: a ratio to an ideal may pass the cores' bound by this much (timing noise)
#: before it is impossible, so a failed measurement
IDEAL_TOLERANCE = 1.1


def ideal_bound(wl: str, cpus: int) -> tuple[float, str]:
    """The largest ratio to ``wl``'s ideal that is physically possible on
    ``cpus`` cores, and why: the ideal is what ``ideal_cores`` cores do with
    the pipeline costing nothing, so no runner passes it (W4's threads run
    pure-Python work: one core, whatever the machine), nor can the work use
    more cores than the machine has."""
    w = WORKLOADS[wl]
    cores = min(w.ideal_cores, cpus)
    if w.ideal_cores == 1:
        why = "its threads run pure-Python work under the GIL: one core at most"
    elif cores < w.ideal_cores:
        why = f"its {w.ideal_cores} workers share the machine's {cpus} cpus"
    else:
        why = f"its work runs on {w.ideal_cores} cores at most"
    return IDEAL_TOLERANCE * cores / w.ideal_cores, why


def implausible(wl: str, runner: str, result: dict[str, Any], cpus: int) -> str:
    """Why ``result`` is physically impossible ("" when it is not): a ratio
    to the ideal past :func:`ideal_bound`."""
    ratio = result.get("ideal_ratio")
    if ratio is None or wl not in WORKLOADS:
        return ""
    bound, why = ideal_bound(wl, cpus)
    if ratio <= bound:
        return ""
    cores = WORKLOADS[wl].ideal_cores
    return (f"{result['batches_per_s']:.0f} batches/s is {ratio:.2f} x the {cores}-core ideal "
            f"({result['ideal_batches_per_s']:.0f} batches/s), above the possible {bound:.2f} ({why})")


def summarize(raw: dict[tuple[str, str], list[dict[str, Any]]], failures: dict[tuple[str, str], str] | None = None,
              cpus: int | None = None) -> dict[str, dict[str, Any]]:
    """Every measurement's repetitions -> ``{"W1/blobfeed": {...}}``.

    Each figure is the median of the repetitions, except
    ``samples_lost_total``: the samples lost summed over all of them, so a
    loss in one repetition cannot hide behind the median (runners that do
    not count their samples have neither).  A workload with an ideal gets a
    ``W4/ideal`` row: blobfeed's yardstick.

    A measurement in ``failures`` (crashed, hung), or one of whose
    repetitions is physically impossible on ``cpus`` cores (see
    :func:`implausible`; not checked when ``cpus`` is None), is
    ``{"failed": why}`` and nothing else: no figure of it is used.
    """
    results: dict[str, dict[str, Any]] = {}
    failures = dict(failures or {})
    for (w, r), runs in raw.items():
        if cpus is not None and (w, r) not in failures:
            for rep, run in enumerate(runs, 1):
                why = implausible(w, r, run, cpus)
                if why:
                    failures[(w, r)] = f"repetition {rep}: {why}"
                    break
        if (w, r) in failures:
            continue
        if not runs:
            continue
        results[f"{w}/{r}"] = _median(runs)
        if all("samples_lost" in run for run in runs):
            results[f"{w}/{r}"]["samples_lost_total"] = int(sum(run["samples_lost"] for run in runs))
    for (w, r), why in failures.items():
        results[f"{w}/{r}"] = {"failed": why}
    for w in WORKLOADS:
        b = results.get(f"{w}/blobfeed")
        if b and "ideal_batches_per_s" in b:
            results[f"{w}/ideal"] = {"batches_per_s": b["ideal_batches_per_s"]}
        ratio = base_ratio(results, w)
        if b and ratio is not None:
            b["base_ratio"] = ratio
    return results


def _row(wl: str, target: str, ratio: Any, ok: bool | None, detail: str = "") -> dict[str, Any]:
    return {"workload": wl, "target": target, "ratio": ratio, "ok": ok, "detail": detail}


def _failed_row(key: str, why: str) -> dict[str, Any]:
    wl, runner = key.split("/", 1)
    return {**_row(wl, f"{runner} measured", None, False, f"measurement failed: {why}"), "failed": True,
            "runner": runner, "why": why}


def evaluate(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of the workloads the report holds, each with ``ok``:
    True (met), False (missed) or None (not evaluated: a peer it needs did
    not run, because its package is not installed, or its measurement
    failed).  First, one row per failed measurement (``failed``: True,
    ``ok`` False): a measurement that crashed, hung, or gave a physically
    impossible figure; the targets are evaluated on the others."""
    everything = report["results"]
    failed = {k: r["failed"] for k, r in everything.items() if "failed" in r}
    res = {k: r for k, r in everything.items() if "failed" not in r}
    rows = [_failed_row(k, why) for k, why in failed.items()]

    def failed_input(target: str, wl: str, *runners: str) -> bool:
        gone = [r for r in runners if f"{wl}/{r}" in failed]
        if gone:
            rows.append(_row(wl, target, None, None, f"measurement failed: {', '.join(f'{wl}/{r}' for r in gone)}"))
        return bool(gone)

    for wl, what, num, den, metric, threshold in TARGETS:
        a = res.get(f"{wl}/{num}")
        if failed_input(f"{what} >= {threshold}", wl, num, *([den] if den not in ("ideal", "model") else [])):
            continue
        if a is None:
            continue
        target = f"{what} >= {threshold}"
        # ideal: each run against the ideal measured in it; W5: against the
        # model alone in interleaved slices of the same run; then the median
        if den == "ideal":
            if "ideal_ratio" not in a:
                rows.append(_row(wl, target, None, None, "no CPU time recorded"))
                continue
            ratio = a["ideal_ratio"]
        elif den == "model":
            ratio = a["model_ratio"]
        else:
            b = res.get(f"{wl}/{den}")
            if b is None:
                continue
            ratio = a[metric] / b[metric]
        rows.append(_row(wl, target, ratio, ratio >= threshold))
    for wl, what, peers, threshold in PEER_TARGETS:
        a = res.get(f"{wl}/blobfeed")
        if a is None:
            continue
        target = f"{what} >= {threshold}"
        ran = [p for p in peers if f"{wl}/{p}" in res]
        broken = [p for p in peers if f"{wl}/{p}" in failed]
        missing = [p for p in peers if p not in ran and p not in broken]
        if not ran:
            if broken:
                rows.append(_row(wl, target, None, None, f"measurement failed: {', '.join(broken)}"
                                 + (f"; peer missing: {', '.join(missing)}" if missing else "")))
            else:
                rows.append(_row(wl, target, None, None, f"peer missing: {', '.join(missing)}"))
            continue
        best = max(ran, key=lambda p: res[f"{wl}/{p}"]["batches_per_s"])
        ratio = a["batches_per_s"] / res[f"{wl}/{best}"]["batches_per_s"]
        detail = (f"best: {best}" + (f"; not run: {', '.join(missing)}" if missing else "")
                  + (f"; measurement failed: {', '.join(broken)}" if broken else ""))
        ceiling = res.get(f"{wl}/{PEER_CEILINGS.get(wl)}")
        if ceiling is not None:
            detail += (f"; {PEER_CEILINGS[wl]}, the work alone with no pipeline: "
                       f"{ceiling['batches_per_s'] / res[f'{wl}/{best}']['batches_per_s']:.2f} x {best}, "
                       f"blobfeed {a['batches_per_s'] / ceiling['batches_per_s']:.2f} x it")
        rows.append(_row(wl, target, ratio, ratio >= threshold, detail))
    for wl, threshold in MODE_TARGETS:
        if f"{wl}/blobfeed" not in res:
            continue
        base = WORKLOADS[wl].base
        target = f"batches/s vs {base} >= {threshold}"
        ratio = base_ratio(res, wl)
        if ratio is None:
            why = f"measurement failed: {base}/blobfeed" if f"{base}/blobfeed" in failed else f"{base} not in this run"
            rows.append(_row(wl, target, None, None, why))
        else:
            rows.append(_row(wl, target, ratio, ratio >= threshold))
    for wl in WORKLOADS:
        a = res.get(f"{wl}/blobfeed")
        if a:
            lost = a.get("samples_lost_total", a["samples_lost"])
            rows.append(_row(wl, "samples lost == 0", lost, lost == 0))
        for runner in COUNTED_RUNNERS:
            a = res.get(f"{wl}/{runner}")
            if a:
                lost = a.get("samples_lost_total", a["samples_lost"])
                rows.append(_row(wl, f"samples lost == 0 ({runner})", lost, lost == 0))
    for wl in ("W2", "W3"):
        a, b = res.get(f"{wl}/blobfeed"), res.get(f"{wl}/caffe2")
        if a and b:
            rows.append(_row(wl, "peak RSS <= Caffe2's", a["peak_rss_mb"] / b["peak_rss_mb"],
                             a["peak_rss_mb"] <= b["peak_rss_mb"]))
    a = res.get("W2p/blobfeed")
    if a:
        target = "total PSS <= grain's"
        grains = [res[f"W2p/{p}"] for p in GRAIN_PEERS if f"W2p/{p}" in res]
        if not grains:
            broken = [p for p in GRAIN_PEERS if f"W2p/{p}" in failed]
            why = f"measurement failed: {', '.join(broken)}" if broken else f"peer missing: {', '.join(GRAIN_PEERS)}"
            rows.append(_row("W2p", target, None, None, why))
        else:
            least = min(g["pss_mb"] for g in grains)
            rows.append(_row("W2p", target, a["pss_mb"] / least, a["pss_mb"] <= least,
                             f"{a['pss_mb']:.0f} MiB against {least:.0f} MiB"))
    rows += _ray_scaling_rows(res)
    w5 = res.get("W5/blobfeed")
    if w5:
        rows.append(_row("W5", "model waits for input < 10 %", w5["wait_share"], w5["wait_share"] < 0.10))
    for wl, limit_ms in FIRST_BATCH_TARGETS:
        a = res.get(f"{wl}/blobfeed")
        if a:
            rows.append(_row(wl, f"first batch <= {limit_ms:g} ms", a["first_batch_ms"], a["first_batch_ms"] <= limit_ms))
    rows += _service_rows(report, res, failed_input)
    rows += autobench.auto_rows(res, _row)
    for wl, why in report.get("skipped", {}).items():
        rows.append(_row(wl, "every target", None, None, f"workload skipped: {why}"))
    return rows


def _service_rows(report: dict[str, Any], res: dict[str, dict[str, Any]],
                  failed_input: Callable[..., bool]) -> list[dict[str, Any]]:
    """The targets of S1, S2, S8 and attach (the feeding service), on the
    measurements ``res`` that did not fail (``failed_input`` adds a row for
    a target whose measurement failed, and says so)."""
    rows = []
    for wl, what, num, den, metric, op, threshold in SERVICE_TARGETS:
        a = res.get(f"{wl}/{num}")
        target = f"{what} {op} {threshold}"
        den_key = den if "/" in den else f"{wl}/{den}"
        if failed_input(target, wl, num, *([] if "/" in den else [den])):
            continue
        if a is None:
            continue
        b = res.get(den_key)
        if b is None:
            if den == "raysplit":
                why = "" if report.get("raydata") else " (ray[data] not installed)"
                rows.append(_row(wl, target, None, None, f"peer missing: {den}{why}"))
            elif "/" in den:
                why = (f"measurement failed: {den_key}" if den_key in report["results"]
                       else f"{den_key} not in this run")
                rows.append(_row(wl, target, None, None, why))
            continue
        if metric not in a or metric not in b or not b[metric]:
            rows.append(_row(wl, target, None, None, f"no {metric} measured"))
            continue
        ratio = a[metric] / b[metric]
        ok = ratio >= threshold if op == ">=" else ratio <= threshold
        detail = f"{a[metric]:.0f} MiB against {b[metric]:.0f} MiB" if metric == "pss_mb" else ""
        rows.append(_row(wl, target, ratio, ok, detail))
    for wl, limit_us in SERVICE_CPU_TARGETS:
        target = f"service+consumer CPU per batch beyond the pipelines' own <= {limit_us:g} us"
        if failed_input(target, wl, "service", "pipes"):
            continue
        a, b = res.get(f"{wl}/service"), res.get(f"{wl}/pipes")
        if a is None or b is None:
            continue
        spent = service_path_cpu_us(a)
        own = b.get("consumer_cpu_us_per_batch")
        if spent is None or own is None:
            rows.append(_row(wl, target, None, None, "no CPU per batch measured"))
            continue
        rows.append(_row(wl, target, spent - own, spent - own <= limit_us,
                         f"{spent:.0f} us against the pipelines' {own:.0f} us"))
    for wl, w in WORKLOADS.items():
        if not w.consumers:
            continue
        for runner in SERVICE_RUNNERS:
            a = res.get(f"{wl}/{runner}")
            if a:
                lost = a.get("samples_lost_total", a["samples_lost"])
                rows.append(_row(wl, f"samples lost == 0 ({runner})", lost, lost == 0))
    a = res.get("attach/service")
    if a:
        detail = f"slowest of {a['attach_cycles']:.0f}: {a['attach_ms_max']:.0f} ms" if "attach_ms_max" in a else ""
        rows.append(_row("attach", f"first batch after attach_source <= {ATTACH_LIMIT_MS:g} ms", a["first_batch_ms"],
                         a["first_batch_ms"] <= ATTACH_LIMIT_MS, detail))
    return rows


def service_path_cpu_us(result: dict[str, Any]) -> float | None:
    """The service's CPU per batch plus a consumer's, microseconds (None
    when either was not measured)."""
    if "service_cpu_us_per_batch" not in result or "consumer_cpu_us_per_batch" not in result:
        return None
    return float(result["service_cpu_us_per_batch"] + result["consumer_cpu_us_per_batch"])


#: R1: throughput on k nodes over k x the one-node throughput, up to the
#: driver's ingest limit (R1/ray2max)
RAY_SCALING_TARGET = 0.8


def _ray_scaling_rows(res: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    one = res.get("R1/ray1")
    limit = res.get("R1/ray2max")
    for k in (2, 4):
        a = res.get(f"R1/ray{k}")
        if a is None or one is None or not one["batches_per_s"]:
            continue
        target = f"scaling efficiency on {k} nodes >= {RAY_SCALING_TARGET}"
        want = k * one["batches_per_s"]
        eff = a["batches_per_s"] / want
        if limit is not None and want > 0.9 * limit["batches_per_s"]:
            rows.append(_row("R1", target, eff, None,
                             f"{want:.0f} batches/s is past the driver's ingest limit ({limit['batches_per_s']:.0f})"))
        else:
            rows.append(_row("R1", target, eff, eff >= RAY_SCALING_TARGET))
    return rows


def _measured(value: Any, target: str = "") -> str:
    """The measured ratio, to two decimals, or as many more (up to four) as
    keep it from reading as the target's own bound: 1.198 against ">= 1.2"
    missed, and "1.20 MISSED" said otherwise."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    bound = re.search(r"[<>=]=?\s*([0-9.]+)\s*$", target)
    for digits in (2, 3, 4):
        text = f"{value:.{digits}f}"
        if bound is None or float(text) != float(bound.group(1)) or value == float(bound.group(1)):
            return text
    return text


def _result_text(row: dict[str, Any]) -> str:
    if row.get("failed"):
        return "FAILED"
    if row["ok"] is None:
        if row.get("detail", "").startswith("measurement failed"):
            return "not evaluated (measurement failed)"
        return "not evaluated (peer missing)" if row.get("detail", "").startswith("peer missing") else "not evaluated"
    return "ok" if row["ok"] else "MISSED"


def verdict(rows: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """The exit status for the ``rows``, and the lines that say why.

    2 when any measurement failed (crashed, hung, or gave a physically
    impossible figure): its row is listed, and the verdict on the others
    is still given.  Otherwise 0 when every evaluated row is met; 1 when
    any is missed, or when no row was evaluated at all (nothing was
    checked: not a pass).  Rows not evaluated (a peer missing) neither pass
    nor fail; they are listed.
    """
    failed = [row for row in rows if row.get("failed")]
    rows = [row for row in rows if not row.get("failed")]
    evaluated = [row for row in rows if row["ok"] is not None]
    not_evaluated = [
        f"  not evaluated: {row['workload']} {row['target']} ({row.get('detail') or 'no data'})"
        for row in rows if row["ok"] is None
    ]
    failed_lines = [f"  {row['workload']}/{row['runner']}: {row['why']}" for row in failed]
    head = f"verdict: {len(failed)} measurement{'s' if len(failed) != 1 else ''} FAILED; on the rest: " if failed else "verdict: "
    if not evaluated:
        status, lines = 1, [f"{head}no target could be evaluated"]
    else:
        missed = [row for row in evaluated if not row["ok"]]
        if not missed:
            status, lines = 0, [f"{head}all {len(evaluated)} targets met"]
        else:
            status, lines = 1, [f"{head}MISSED {len(missed)} of {len(evaluated)} targets:"] + [
                f"  {row['workload']} {row['target']}: measured {_measured(row['ratio'], row['target'])}"
                + (f" ({row['detail']})" if row.get("detail") else "")
                for row in missed
            ]
    if failed:
        status = 2
        lines += ["failed measurements (exit status 2):"] + failed_lines
    return status, lines + not_evaluated


def _installed_text(report: dict[str, Any]) -> str:
    names = (("torch", "torch"), ("grain", "grain"), ("pillow", "Pillow"), ("raydata", "Ray Data"))
    return ", ".join(f"{shown} {'yes' if report.get(key) else 'not installed (skipped)'}" for key, shown in names)


#: The table's columns after ``workload/runner``: (header, width), each
#: right-aligned, at least two spaces wider than its header so no two
#: headers run together ("GB/s peak RSS MB" and "lost vs ideal" did).
COLUMNS = [
    ("batches/s", 12), ("GB/s", 7), ("peak RSS MB", 13), ("PSS MB", 8), ("first ms", 10),
    ("lost", 11), ("vs ideal", 10), ("vs base", 12),
]
#: the width of the ``workload/runner`` column (left-aligned)
KEY_WIDTH = 17


def _lost_cell(result: dict[str, Any]) -> str:
    """Samples lost, summed over the repetitions (as the verdict counts
    them); "-" for a runner that does not count its samples."""
    if "samples_lost_total" in result:
        return str(int(result["samples_lost_total"]))
    if "samples_lost" in result:  # a report saved before the sum was kept
        return str(int(result["samples_lost"]))
    return "-"


#: what each runner is, for the legend under the table (one line per runner that appears)
RUNNER_LEGEND = {
    "blobfeed": "blobfeed: a Net with no model (W5: the MLP), 2 fetcher threads (W*p: worker processes); W1i, W2i, "
                "W7: a RandomAccessSource over the map-style dataset (W7: shuffle=True, 2 worker processes), its "
                "lost column the delivered indexes that are not the source's order",
    "sequential": "blobfeed on W7's source with shuffle=False (its own sequential read), 2 worker processes",
    "work2": "W7's work alone, no pipeline: the dataset's __getitems__ and one np.stack into rotating shared "
             "memory per batch, in 2 processes at once, nothing handed on (what any loader that reads on two "
             "processes and shares each batch by one copy can reach here)",
    "hand2": "work2 with each batch handed to this process and no more: the slot's number down a pipe, the "
             "batch's views made here and dropped, the slot sent back (what handing batches over costs a lean "
             "Python pipeline: no order, no resume, no metrics, one thread)",
    **{f"torchmap{k}": f"torch DataLoader over W7's dataset, shuffle=True, num_workers={k} "
                       f"({'in this process' if not k else 'forked, persistent'}), __getitems__ per batch"
       for k in W7_PEER_WORKERS},
    **{f"grainmap{k}": f"grain DataLoader over W7's dataset, IndexSampler(shuffle=True), worker_count={k}, Batch"
       for k in W7_PEER_WORKERS},
    "caffe2": "Caffe2's original re-batching (np.append, np.split), written from its description; "
              "its lost column is the leftovers it drops, by design, when its queue is full",
    "copy": "the copy bound: each batch's bytes copied once with np.copyto, out of cache",
    "copy2": "the same in two threads at once: what the memory moves when both cores copy (a path that "
             "copies each byte twice, as S1's does with worker processes, reaches at most half of it)",
    "model": "the model alone: InferenceSession.run on batches made in advance",
    "grain0": "grain, no worker process: chunks re-batched by grain",
    "torch0": "torch DataLoader, num_workers=0, a map-style dataset of single samples",
    "torch0it": "torch DataLoader, num_workers=0, an iterable dataset of the chunks, re-batched in the loop",
    "grain2": "grain mp_prefetch, 2 worker processes, chunks re-batched in the parent",
    "grain2b": "grain mp_prefetch, 2 worker processes, exact batches made in the workers",
    "torch2": "torch DataLoader, num_workers=2, a map-style dataset of single samples",
    "torch2it": "torch DataLoader, num_workers=2, an iterable dataset of the chunks, re-batched in the parent",
    "pool": "multiprocessing.Pool(2).imap of the fetch function, re-batched in the parent (what one writes by hand)",
    "raydata": "Ray Data: map_batches blocks of the chunks, iter_batches to the exact batch, on a local cluster",
    "raysplit": "Ray Data's streaming_split(4) to 4 Ray actors",
    "service": "one feeding service (FeedServer, 2 workers) in the measuring process, dealing by index to the "
               "consumer processes",
    "pipes": "one independent pipeline (2 workers) in each consumer process",
    "bare": "S2's service written plainly, with nothing of blobfeed: a sender and a receiver thread per consumer "
            "process in the measuring process, one record of the batch's bytes (made in advance: no fetching, no "
            "re-batching, no ledger) per batch over a Unix socket, each acknowledged, 16 in flight: what the "
            "transport alone costs in one Python process",
    "direct": "S1's work on its shortest path, with nothing of blobfeed: 2 worker processes fill whole batches in "
              "shared memory and send each one's slot straight to a consumer process (one record each way, no "
              "process or thread in between, no checks, no ledger): what the machine allows for S1 (its "
              "'service' row is the 2 workers)",
    "ledger": "direct's path with the least the service's guarantees add to it: batch g to consumer g mod 4 (by "
              "index), a ledger (a thread of the measuring process) told of each batch before it goes and of "
              "its acknowledgement, consumers holding 2 batches (run()'s and one queued) before they acknowledge "
              "one and give its slot straight back to its worker: what a service off the batch's way could reach "
              "(its 'service' row: the 2 workers and the ledger's process)",
    "ray": "blobfeed's fetchers as Ray actors: 1 simulated node of 2 actors",
    "ray1": "blobfeed's fetchers as Ray actors: 1 simulated node of 2 actors",
    "ray2": "blobfeed's fetchers as Ray actors: 2 simulated nodes of 2 actors",
    "ray4": "blobfeed's fetchers as Ray actors: 4 simulated nodes of 2 actors",
    "ray2max": "ray2 with no wait in the fetchers: the driver's ingest limit",
    **{f"fixed{n}": f"auto workloads: num_worker_threads={n}, max_buffered_bytes='auto'" for n in autobench.FIXED_IO},
    **{f"fixed{n}x2": f"fixed{n} with every fetch costing twice as much" for n in autobench.FIXED_IO},
    "auto": f"num_worker_threads='auto', max_buffered_bytes='auto'; batches/s over the window after "
            f"{autobench.SETTLE_S:g} s",
    "autox2": f"auto whose fetch cost doubles after {autobench.SETTLE_S:g} s + the window; batches/s over the "
              f"window {autobench.SETTLE_S:g} s after the doubling",
    "ideal": "not a runner: the batches/s the cores could deliver if the pipeline cost nothing, from the CPU "
             "time of blobfeed's own fetches (vs ideal: a runner's batches/s over its own measurement's ideal)",
}


def _backends_text(results: dict[str, Any], runner: str) -> str:
    """The backend of the service's (or the pipelines') workers on each
    workload in ``results``, and why the service's is the one it is."""
    by: dict[str, list[str]] = {}
    for key in results:
        wl, r = key.split("/", 1)
        w = WORKLOADS.get(wl)
        if r != runner or w is None or not w.consumers:
            continue
        if runner == "service":
            by.setdefault(w.backend_why or w.backend, []).append(wl)
        else:
            by.setdefault({"processes": "worker processes", "threads": "worker threads"}.get(
                w.pipes_backend, w.pipes_backend), []).append(wl)
    if not by:
        return ""
    return "; its workers: " + "; ".join(f"{', '.join(wls)}: {what}" for what, wls in by.items())


def legend(report: dict[str, Any]) -> list[str]:
    """The lines under the table: what each runner in it is, and what the
    lost column counts."""
    results = report["results"]
    runners = list(dict.fromkeys(key.split("/", 1)[1] for key in results))
    width = max(len(r) for r in runners) + 2 if runners else 0
    lines = ["runners:"]
    for runner in runners:
        text = RUNNER_LEGEND.get(runner, "")
        if runner in ("service", "pipes"):
            text += _backends_text(results, runner)
        if runner == "caffe2":
            shares = [f"{key.split('/')[0]} {r['lost_share']:.0%}" for key, r in results.items()
                      if key.endswith("/caffe2") and "lost_share" in r]
            if shares:
                text += f" (here: {', '.join(shares)} of the samples fetched)"
        lines.append(f"  {runner:<{width}}{text}")
    repeats = report.get("repeats")
    over = ("in the one repetition" if repeats == 1 else
            f"summed over the {repeats} repetitions" if repeats else "summed over the repetitions")
    lines.append(f"lost: samples fetched and never delivered, {over} (blobfeed must lose none); "
                 "\"-\": the runner does not count its samples (the peers, the copy bound, the model alone), "
                 "or did not measure that column")
    if any(COST_KEYS[0][1] in r or COST_KEYS[1][1] in r for r in results.values()):
        lines.append("per batch: read from /proc at the window's two ends only; CPU is utime+stime, ctx switches "
                     "voluntary+involuntary summed over threads; service: the measuring process (the service's "
                     "threads) and its worker processes, over every batch; consumer: the consumer processes (for "
                     "pipes each with its pipeline's workers), over every batch they took: what one consumer "
                     "spends per batch it takes; the service's steps (indented): its threads by role (sender: "
                     "re-batching, the copy into the shared batch memory, sending; receiver: acknowledgements; "
                     "intake: a worker process's chunks into the dealer; fetchers: worker threads), and its worker "
                     "processes (the service's CPU time none of its threads spent; their switches are in the "
                     "service's total); pipes' steps (indented): a pipeline's worker processes (the forkserver's "
                     "children: fetching, the copy into their slots) and its net's process (intake, re-batching, "
                     "run()), which sum to its consumer row")
    if any(PROCESS_COST_KEYS[0][1] in r for r in results.values()):
        lines.append("per batch (W1i, W2i, W7, work2, hand2): read from /proc at the window's two ends, over the "
                     "batches taken in it, as above; this process: the runner's, every thread (the training loop; "
                     "blobfeed's enqueuer and slot returner; on threads, the fetchers too); worker processes: every "
                     "process below it that ran at the first batch, but the PSS sampler (no row where there is none)")
    return lines


#: the per-batch costs (S1, S2, S8): (who, CPU key, switches key)
COST_KEYS = [
    ("service", "service_cpu_us_per_batch", "service_ctx_per_batch"),
    ("consumer", "consumer_cpu_us_per_batch", "consumer_ctx_per_batch"),
]


#: the per-batch costs of a runner's own processes (W1i, W2i, W7, and
#: W7's work2 and hand2): (who, CPU key, switches key)
PROCESS_COST_KEYS = [
    ("this process", "parent_cpu_us_per_batch", "parent_ctx_per_batch"),
    ("worker processes", "children_cpu_us_per_batch", "children_ctx_per_batch"),
]


def cost_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """The table of hand-off costs per batch: for each measurement that
    read them, the service's and a consumer's context switches and CPU
    microseconds per batch, and their sum; for W1i, W2i, W7 and W7's work2
    and hand2, the runner's own process and its worker processes, and their
    sum; empty when none did."""
    rows: list[tuple[str, str, float | None, float]] = []
    for key, r in results.items():
        if "failed" in r:
            continue
        # the steps are the service's where there is one, else the consumer's (pipes: a pipeline's)
        steps_of = "service" if COST_KEYS[0][1] in r else "consumer"
        for who, cpu, ctx in COST_KEYS:
            if cpu in r:
                rows.append((key, who, r.get(ctx), r[cpu]))
            if who == steps_of:
                steps = sorted(((k[len(STEP_CPU):], v) for k, v in r.items() if k.startswith(STEP_CPU)),
                               key=lambda kv: -kv[1])
                rows += [(key, f"  {role}", r.get(STEP_CTX + role), cpu_us) for role, cpu_us in steps if cpu_us >= 0.05]
        if PROCESS_COST_KEYS[0][1] in r:
            spent = [(who, r.get(ctx), r[cpu]) for who, cpu, ctx in PROCESS_COST_KEYS if cpu in r]
            rows += [(key, who, switched, cpu_us) for who, switched, cpu_us in spent]
            switches = [switched for _, switched, _ in spent]
            rows.append((key, "all", None if None in switches else float(sum(s for s in switches if s is not None)),
                         sum(cpu_us for _, _, cpu_us in spent)))
        total = service_path_cpu_us(r)
        if total is not None:
            switches = [r.get(ctx) for _, _, ctx in COST_KEYS]
            rows.append((key, "service + consumer", None if None in switches else float(sum(s for s in switches if s is not None)), total))
    if not rows:
        return []
    lines = [f"{'per batch taken':<{KEY_WIDTH}}{'':<20}{'ctx switches/batch':>20}{'CPU us/batch':>14}"]
    for key, who, switched, cpu_us in rows:
        lines.append(f"{key:<{KEY_WIDTH}}{who:<20}{'-' if switched is None else format(switched, '.1f'):>20}{cpu_us:>14.1f}")
    return lines


def _cell(result: dict[str, Any], key: str, fmt: str) -> str:
    """A measured figure, or "-" where the runner did not measure it."""
    return format(result[key], fmt) if key in result else "-"


def _table_line(key: str, cells: list[str]) -> str:
    return (f"{key:<{KEY_WIDTH}}" + "".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS))).rstrip()


def format_report(report: dict[str, Any]) -> str:
    """The report as text: the run, the table of every measurement, the targets."""
    lines = [
        (f"blobfeed bench: {report['seconds']:g} s per measurement, median of {report['repeats']}, "
         f"python {report['python']}, {report['cpus']} cpus, {_installed_text(report)}"),
        "",
        _table_line("workload/runner", [name for name, _ in COLUMNS]),
    ]
    results = report["results"]
    for key, r in results.items():
        if "failed" in r:
            lines.append(f"{key:<{KEY_WIDTH}}measurement failed: {r['failed']}")
            continue
        if key.endswith("/ideal"):
            lines.append(_table_line(key, [f"{r['batches_per_s']:.1f}"]))
            continue
        # "-": not measured (a report saved before every run read its PSS;
        # attach times attaching, not a rate)
        ideal = f"{r['ideal_ratio']:.2f}" if "ideal_ratio" in r else ""
        wl, runner = key.split("/", 1)
        ratio = base_ratio(results, wl) if runner == "blobfeed" else None
        vs_base = f"{ratio:.2f} x {WORKLOADS[wl].base}" if ratio is not None else ""
        lines.append(_table_line(key, [
            _cell(r, "batches_per_s", ".1f"), _cell(r, "gb_per_s", ".2f"), _cell(r, "peak_rss_mb", ".0f"),
            _cell(r, "pss_mb", ".0f"), _cell(r, "first_batch_ms", ".1f"), _lost_cell(r), ideal, vs_base,
        ]))
    for wl, why in report.get("skipped", {}).items():
        lines.append(f"{wl + '/*':<16} skipped: {why}")
    costs = cost_lines(results)
    if costs:
        lines += ["", *costs]
    auto = autobench.auto_lines(results)
    if auto:
        lines += ["", "auto workloads (the report's reading of auto's series; docs/BENCHMARKS.md):", *auto]
    lines += ["", *legend(report)]
    rows = evaluate(report)
    width = max([56] + [len(f"{row['workload']} {row['target']}") + 2 for row in rows if not row.get("failed")])
    lines += ["", f"{'target':<{width}}{'measured':>10}  result"]
    for row in rows:
        if row.get("failed"):
            continue  # in the table above, and in the verdict
        text = f"{row['workload'] + ' ' + row['target']:<{width}}{_measured(row['ratio'], row['target']):>10}  {_result_text(row)}"
        detail = row.get("detail", "")
        if row["ok"] is None and detail.startswith("peer missing: "):
            detail = detail[len("peer missing: "):]
        if detail and row["ok"] is not False:  # a missed row ends with MISSED; the verdict gives its detail
            text += f"  [{detail}]"
        lines.append(text)
    return "\n".join(lines)
