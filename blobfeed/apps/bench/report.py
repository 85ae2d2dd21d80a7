"""The report: the targets, each measurement's repetitions summarized,
the table, and the verdict (the exit status)."""

from __future__ import annotations

import statistics
from typing import Any

from .workloads import IN_PROCESS_PEERS, PROCESS_PEERS, WORKLOADS


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
]

#: W2p's memory target compares blobfeed's PSS with grain's (its process peers)
GRAIN_PEERS = ("grain2", "grain2b")

#: first batch after ``start()``, milliseconds
FIRST_BATCH_TARGETS = [("W1", 50.0), ("W1p", 500.0)]

#: (workload, threshold): blobfeed's batches/s in an ordered mode over its
#: batches/s on the workload's ``base`` (default mode) in the same run;
#: evaluated only when both ran.  Shuffling (W1s, W2s) may cost at most
#: half the default mode's rate.
MODE_TARGETS = [("W1d", 0.8), ("W2d", 0.8), ("W4pd", 0.9), ("W1s", 0.5), ("W2s", 0.5)]


#: the feeding service (S1, S2): (workload, description, numerator runner,
#: denominator runner, metric, comparison, threshold); "pipes" is one
#: independent pipeline per consumer process, "raysplit" Ray Data's
#: streaming_split (a peer: not evaluated where ray[data] is not installed)
SERVICE_TARGETS = [
    ("S1", "batches/s vs four independent pipelines", "service", "pipes", "batches_per_s", ">=", 1.0),
    ("S1", "total PSS vs four independent pipelines", "service", "pipes", "pss_mb", "<=", 0.6),
    ("S1", "GB/s vs the copy bound", "service", "copy", "gb_per_s", ">=", 0.5),
    ("S2", "batches/s vs four independent pipelines", "service", "pipes", "batches_per_s", ">=", 0.5),
    ("S1", "batches/s vs Ray Data streaming_split(4)", "service", "raysplit", "batches_per_s", ">=", 1.0),
    ("S2", "batches/s vs Ray Data streaming_split(4)", "service", "raysplit", "batches_per_s", ">=", 1.0),
]
#: the runners of S1, S2 and attach that are blobfeed (checked for lost samples)
SERVICE_RUNNERS = ("service", "pipes")
#: attach: from ``attach_source(...)`` to the first batch, milliseconds
ATTACH_LIMIT_MS = 500.0


def base_ratio(results: dict[str, dict[str, Any]], wl: str) -> float | None:
    """blobfeed's batches/s on ``wl`` over its batches/s on ``wl``'s base
    workload (W1d: W1), or None when ``wl`` has no base or either did not run."""
    w = WORKLOADS.get(wl)
    a = results.get(f"{wl}/blobfeed")
    b = results.get(f"{w.base}/blobfeed") if w is not None and w.base else None
    if a is None or b is None or not b["batches_per_s"]:
        return None
    return float(a["batches_per_s"] / b["batches_per_s"])


def _keys_in_all(results: list[dict[str, Any]]) -> list[str]:
    common = set(results[0]).intersection(*results[1:])
    return [k for k in results[0] if k in common]


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in results) for k in _keys_in_all(results)}


def summarize(raw: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every measurement's repetitions -> ``{"W1/blobfeed": {...}}``.

    Each figure is the median of the repetitions, except
    ``samples_lost_total``: the samples lost summed over all of them, so a
    loss in one repetition cannot hide behind the median.  A workload with
    an ideal gets a ``W4/ideal`` row: blobfeed's yardstick.
    """
    results = {}
    for (w, r), runs in raw.items():
        results[f"{w}/{r}"] = _median(runs)
        results[f"{w}/{r}"]["samples_lost_total"] = int(sum(run["samples_lost"] for run in runs))
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


def evaluate(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of the workloads the report holds, each with ``ok``:
    True (met), False (missed) or None (not evaluated: a peer it needs did
    not run, because its package is not installed)."""
    res = report["results"]
    rows = []
    for wl, what, num, den, metric, threshold in TARGETS:
        a = res.get(f"{wl}/{num}")
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
        missing = [p for p in peers if p not in ran]
        if not ran:
            rows.append(_row(wl, target, None, None, f"peer missing: {', '.join(missing)}"))
            continue
        best = max(ran, key=lambda p: res[f"{wl}/{p}"]["batches_per_s"])
        ratio = a["batches_per_s"] / res[f"{wl}/{best}"]["batches_per_s"]
        detail = f"best: {best}" + (f"; not run: {', '.join(missing)}" if missing else "")
        rows.append(_row(wl, target, ratio, ratio >= threshold, detail))
    for wl, threshold in MODE_TARGETS:
        if f"{wl}/blobfeed" not in res:
            continue
        base = WORKLOADS[wl].base
        target = f"batches/s vs {base} >= {threshold}"
        ratio = base_ratio(res, wl)
        if ratio is None:
            rows.append(_row(wl, target, None, None, f"{base} not in this run"))
        else:
            rows.append(_row(wl, target, ratio, ratio >= threshold))
    for wl in WORKLOADS:
        a = res.get(f"{wl}/blobfeed")
        if a:
            lost = a.get("samples_lost_total", a["samples_lost"])
            rows.append(_row(wl, "samples lost == 0", lost, lost == 0))
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
            rows.append(_row("W2p", target, None, None, f"peer missing: {', '.join(GRAIN_PEERS)}"))
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
    rows += _service_rows(report)
    for wl, why in report.get("skipped", {}).items():
        rows.append(_row(wl, "every target", None, None, f"workload skipped: {why}"))
    return rows


def _service_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of S1, S2 and attach (the feeding service)."""
    res = report["results"]
    rows = []
    for wl, what, num, den, metric, op, threshold in SERVICE_TARGETS:
        a = res.get(f"{wl}/{num}")
        if a is None:
            continue
        target = f"{what} {op} {threshold}"
        b = res.get(f"{wl}/{den}")
        if b is None:
            if den == "raysplit":
                why = "" if report.get("raydata") else " (ray[data] not installed)"
                rows.append(_row(wl, target, None, None, f"peer missing: {den}{why}"))
            continue
        if metric not in a or metric not in b or not b[metric]:
            rows.append(_row(wl, target, None, None, f"no {metric} measured"))
            continue
        ratio = a[metric] / b[metric]
        ok = ratio >= threshold if op == ">=" else ratio <= threshold
        detail = f"{a[metric]:.0f} MiB against {b[metric]:.0f} MiB" if metric == "pss_mb" else ""
        rows.append(_row(wl, target, ratio, ok, detail))
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


def _measured(value: Any) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def _result_text(row: dict[str, Any]) -> str:
    if row["ok"] is None:
        return "not evaluated (peer missing)" if row.get("detail", "").startswith("peer missing") else "not evaluated"
    return "ok" if row["ok"] else "MISSED"


def verdict(rows: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """The exit status for the ``rows``, and the lines that say why.

    0 when every evaluated row is met; 1 when any is missed, or when no row
    was evaluated at all (nothing was checked: not a pass).  Rows not
    evaluated (a peer missing) neither pass nor fail; they are listed.
    """
    evaluated = [row for row in rows if row["ok"] is not None]
    not_evaluated = [
        f"  not evaluated: {row['workload']} {row['target']} ({row.get('detail') or 'no data'})"
        for row in rows if row["ok"] is None
    ]
    if not evaluated:
        return 1, ["verdict: no target could be evaluated"] + not_evaluated
    missed = [row for row in evaluated if not row["ok"]]
    if not missed:
        return 0, [f"verdict: all {len(evaluated)} targets met"] + not_evaluated
    return 1, [f"verdict: MISSED {len(missed)} of {len(evaluated)} targets:"] + [
        f"  {row['workload']} {row['target']}: measured {_measured(row['ratio'])}"
        + (f" ({row['detail']})" if row.get("detail") else "")
        for row in missed
    ] + not_evaluated


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
            _cell(r, "pss_mb", ".0f"), _cell(r, "first_batch_ms", ".1f"), f"{int(r['samples_lost']):d}", ideal, vs_base,
        ]))
    for wl, why in report.get("skipped", {}).items():
        lines.append(f"{wl + '/*':<16} skipped: {why}")
    lines += ["", f"{'target':<56}{'measured':>10}  result"]
    for row in evaluate(report):
        text = f"{row['workload'] + ' ' + row['target']:<56}{_measured(row['ratio']):>10}  {_result_text(row)}"
        detail = row.get("detail", "")
        if row["ok"] is None and detail.startswith("peer missing: "):
            detail = detail[len("peer missing: "):]
        if detail and row["ok"] is not False:  # a missed row ends with MISSED; the verdict gives its detail
            text += f"  [{detail}]"
        lines.append(text)
    return "\n".join(lines)
