"""``blobfeed bench``'s command line: the options, the estimate of the
run's length, the verdict as exit status; and ``--child``, one
measurement in this process (how the runner starts each)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Collection

from ..argtypes import positive_float, positive_int
from .report import IDEAL_TOLERANCE, evaluate, format_report, verdict
from .runner import RUNNERS, W7_GENERATE_S, WARMUP_S, _packages, _plan, available_packages, estimate_seconds, run_all
from .autobench import AUTO_IDS
from .workloads import W7_BYTES, WORKLOADS, w6_corpus_dir, w7_records_dir


DEFAULT_WORKLOADS = "W1,W2,W3,W4,W5"
DEFAULT_SECONDS = 5.0
DEFAULT_REPEATS = 3


def parse_workloads(text: str) -> list[str]:
    """``W1,W2p`` (any case), ``all``, or ``auto`` (A4p, A6p, A2p, Aio) -> workload ids.

    Raises:
        ValueError: naming the unknown ones.
    """
    by_upper = {w.upper(): w for w in WORKLOADS}
    out: list[str] = []
    unknown = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if token.lower() == "all":
            out += [w for w in WORKLOADS if w not in out]
        elif token.lower() == "auto":  # the auto workloads (autobench.AUTO_IDS)
            out += [w for w in AUTO_IDS if w not in out]
        elif token.upper() in by_upper:
            if by_upper[token.upper()] not in out:
                out.append(by_upper[token.upper()])
        else:
            unknown.append(token)
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}, all or auto")
    return out


def _run_length(workloads: list[str], packages: Collection[str]) -> str:
    n = len(_plan(workloads, packages))
    est = estimate_seconds(workloads, DEFAULT_SECONDS, DEFAULT_REPEATS, packages)
    return f"{n * DEFAULT_REPEATS} measurements ({n} per repeat x {DEFAULT_REPEATS} repeats) and takes about {est:.0f} s ({est / 60:.1f} min)"


def build_parser() -> argparse.ArgumentParser:
    """The ``blobfeed bench`` command line; its epilog estimates the default run's length."""
    packages = available_packages()
    wls = DEFAULT_WORKLOADS.split(",")
    everything = list(WORKLOADS)
    missing = [p for p in ("torch", "grain") if p not in packages]
    if not missing:
        peer_note = "torch and grain are installed, so their rows are included"
    else:
        full = _packages(True)
        peer_note = (
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed, so "
            f"{'its' if len(missing) == 1 else 'their'} rows are skipped (with both: the default run "
            f"{_run_length(wls, full)}; --workloads all {_run_length(everything, full)})"
        )
    epilog = (
        f"The default invocation runs {_run_length(wls, packages)} on a 2-core machine; "
        f"--workloads all runs {_run_length(everything, packages)}; --workloads auto (the auto workloads, opt-in) "
        f"runs {_run_length(list(AUTO_IDS), packages)}; {peer_note}. The first run that "
        f"includes W6 or W6p also generates W6's JPEG corpus into {w6_corpus_dir()} (a few seconds); the "
        f"first run that includes W7 writes W7's record file, {W7_BYTES / 1e9:g} GB, into {w7_records_dir()} "
        f"(about {W7_GENERATE_S:.0f} s, not in the estimates; it is checked and reused after). "
        f"Each measurement is a child process: start-up, a {WARMUP_S:g} s warm-up, then the measured "
        f"window, and its runner's set-up, calibration and drain. Every run prints its own estimate "
        f"before it starts (from its --workloads, --seconds, --repeats and the runners installed), and "
        f"at the end how long it took. Exit status: 0 when every evaluated target is met; 1 when any target is missed, "
        f"including blobfeed losing a sample in any repetition (the missed targets are listed), or when "
        f"no target could be evaluated; 2 for a usage error, or when any measurement failed: crashed, "
        f"hung past its time limit (10 x --seconds + 120 s; killed with every process it started), or "
        f"gave a physically impossible figure (a ratio to an ideal above {IDEAL_TOLERANCE:g} x what "
        f"the cores can do). A failed measurement is a row of its own that says why; it is not "
        f"repeated, and the targets are judged on the other measurements, whose verdict is still "
        f"printed. A target whose peer is not installed is reported as not evaluated, neither met "
        f"nor missed."
    )
    p = argparse.ArgumentParser(
        prog="blobfeed bench",
        description="Run workloads W1-W6 and W1p-W6p (docs/BENCHMARKS.md) against blobfeed, its "
        "baselines and its peers, and blobfeed's ordered modes (W1d, W2d, W4pd: deterministic=True; "
        "W1s, W2s: with shuffle_buffer=10000) against its default mode, and the feeding service "
        "(S1, S2: one service and 4 consumer processes against 4 independent pipelines, with the CPU "
        "time and context switches per batch of the service and of the consumers; S8: S1 with 8 "
        "consumers; attach: the first batch after attach_source; opt-in: --workloads S1,S2,S8,attach), "
        "the random-access sources (W1i, W2i: W1's and W2's data behind a map-style dataset, against "
        "the fetch_fun form), and W7 (opt-in: a global shuffle over a 2 GB memory-mapped record file, "
        "against its own sequential read and torch's and grain's map-style loaders at 0, 1, 2 and 4 "
        "workers each), and the auto workloads (opt-in: --workloads auto: A4p, A6p, A2p, Aio, "
        "num_worker_threads='auto' against fixed counts 1, 2, 4, 8 (16 for Aio), before and after the "
        "fetch cost doubles); "
        "print one table and the targets, and exit with the verdict.",
        epilog=epilog,
    )
    p.add_argument(
        "--workloads", default=DEFAULT_WORKLOADS,
        help=f"comma-separated subset of {', '.join(WORKLOADS)}, or all, or auto (the auto workloads "
             f"{', '.join(AUTO_IDS)}) (default: {DEFAULT_WORKLOADS})",
    )
    p.add_argument(
        "--seconds", type=positive_float, default=DEFAULT_SECONDS,
        help=f"measured seconds per measurement, after a {WARMUP_S:g} s warm-up (default: {DEFAULT_SECONDS:g} s)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=DEFAULT_REPEATS,
        help=f"repetitions of every measurement; the median is reported (default: {DEFAULT_REPEATS})",
    )
    p.add_argument("--json", metavar="PATH", help="also write the raw results and the verdict here (default: none)")
    p.add_argument("--child", nargs=3, metavar=("WORKLOAD", "RUNNER", "SECONDS"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``blobfeed bench``; returns the exit status (see ``blobfeed.apps.bench``'s docstring)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.child:
        wl_id, runner, secs = args.child
        print(json.dumps(RUNNERS[runner](WORKLOADS[wl_id], float(secs))))
        return 0
    try:
        wls = parse_workloads(args.workloads)
    except ValueError as exc:
        p.error(str(exc))
    if not wls:
        p.error("no workload given")
    packages = available_packages()
    per = len(_plan(wls, packages))
    est = estimate_seconds(wls, args.seconds, args.repeats, packages)
    print(f"blobfeed bench: {per * args.repeats} measurements ({per} per repeat x {args.repeats}), about "
          f"{est:.0f} s ({est / 60:.1f} min): each a child process's start-up, a {WARMUP_S:g} s warm-up, a "
          f"{args.seconds:g} s window, and its runner's set-up and drain", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    # a measurement that crashes or hangs is a failed row of the report: the rest is still judged
    report = run_all(wls, args.seconds, args.repeats)
    took = time.monotonic() - t0
    report.update(estimated_s=est, took_s=took)
    rows = evaluate(report)
    status, why = verdict(rows)
    print(format_report(report))
    print()
    print("\n".join(why))
    # so that the estimate can be checked against the run
    print(f"blobfeed bench: took {took:.0f} s ({took / 60:.1f} min); estimated {est:.0f} s")
    if args.json:
        report["targets"] = rows
        report["passed"] = status == 0
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return status
