"""The ``auto`` workloads (opt-in: ``--workloads auto``): blobfeed's
``num_worker_threads="auto"`` against a sweep of fixed worker counts on the
same fetcher, in the same run (docs/BENCHMARKS.md, "The auto workloads").

* ``A4p`` -- W4's CPU-bound fetcher (~5 ms of pure Python per chunk) in
  worker processes;
* ``A6p`` -- W6's JPEG decoding in worker processes (needs Pillow);
* ``A2p`` -- W2's images in worker processes, each chunk copied once in
  the fetcher (as an image loader writes its output);
* ``Aio`` -- an I/O-bound fetcher in threads: 5 ms of waiting, then 32
  samples.

Every row uses ``max_buffered_bytes="auto"`` (the same budget and working
limit, blobfeed.buffers); only the worker count differs.  Runners:

* ``fixedN`` -- ``num_worker_threads=N`` (1, 2, 4, 8; Aio also 16);
* ``auto`` -- ``num_worker_threads="auto"`` for :data:`SETTLE_S` + the
  window: its batches/s is over the window after :data:`SETTLE_S`; it
  records a series (every :data:`STEP_S`: samples delivered, workers,
  queue bytes) from which the report reads the time it took to reach
  0.95 x the best fixed count's batches/s;
* ``fixedNx2`` -- the fixed counts with every fetch costing twice as much
  (its work done twice);
* ``autox2`` -- ``auto`` whose fetch cost doubles after :data:`SETTLE_S` +
  the window, then runs :data:`SETTLE_S` + the window more: the report
  reads the time it took after the doubling to reach 0.9 x the best
  ``fixedNx2``.

The doubling is a point in time (``time.monotonic()``, one clock for every
process of the machine), so worker processes need no message to follow it.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .measure import Tally
from .workloads import WORKLOADS, Fetcher, W2Fetch, W4Fetch, W6Fetch, Workload

#: auto's time to find its count: its batches/s is measured after this
SETTLE_S = 10.0
#: a fixed count's warm-up after its first batch, seconds
WARMUP_S = 0.5
#: the series' step, seconds
STEP_S = 0.25
#: the trailing span the series' rates are taken over (reach and recovery
#: times): at least this long, and long enough to hold SPAN_BATCHES at the
#: rate sought (A6p's few batches/s would otherwise be read off a handful)
RATE_SPAN_S = 1.0
SPAN_BATCHES = 50
#: the fixed counts of the sweep; the I/O-bound workload also 16
FIXED = (1, 2, 4, 8)
FIXED_IO = (*FIXED, 16)
#: the targets: auto after SETTLE_S vs the best fixed count; the time to
#: reach REACH of it; after the doubling, the time to reach RECOVER of the
#: new best; within LIMIT_S each
REACH = 0.95
RECOVER = 0.9
LIMIT_S = 10.0
#: the I/O-bound fetcher's wait per chunk, seconds
IO_WAIT_S = 0.005


class ManyTally(Tally):
    """A :class:`Tally` with a slot for each of many worker ids: "auto"
    gives each worker it adds a new id (never reused), and two live workers
    must not share a slot (each slot has one writer).  No CPU rings."""

    WORKERS = 1024
    RING = 1
    _NTIMES = 1 + WORKERS
    _HEADER = 2 + 2 * WORKERS
    SIZE = 8 * (_HEADER + WORKERS * RING)


class IOFetch(Fetcher):
    """Waits :data:`IO_WAIT_S` (a read from a disk or the network), then 32
    samples of float32 (32, 256) and their labels."""

    def build(self) -> Any:
        self._data = (np.random.default_rng(9).standard_normal((32, 256)).astype(np.float32),
                      np.arange(32, dtype=np.int64))
        return self._data

    def chunk(self, worker_id: int) -> list:
        data, labels = self._data or self.build()
        time.sleep(IO_WAIT_S)
        return [data, labels]


class W2CopyFetch(W2Fetch):
    """W2's images, each chunk copied once (the loader writes its output):
    a fetch cost of its own, which the doubling doubles."""

    def chunk(self, worker_id: int) -> list:
        return [np.array(a) for a in super().chunk(worker_id)]


class Costly(Fetcher):
    """A workload's fetcher whose cost can double: from ``double_at``
    (``time.monotonic()``; 0: from the start, None: never) each chunk is
    made twice (the first thrown away), so the work per chunk doubles."""

    def __init__(self, tally: Tally | None, inner: Fetcher, double_at: float | None = None) -> None:
        super().__init__(tally)
        self.inner = inner
        self.double_at = double_at

    def chunk(self, worker_id: int) -> list:
        at = self.double_at
        if at is not None and time.monotonic() >= at:
            self.inner.chunk(worker_id)
        return self.inner.chunk(worker_id)


def auto_workloads() -> dict[str, Workload]:
    """The auto workloads, for the workload table."""
    def runners(counts: tuple[int, ...]) -> tuple[str, ...]:
        return (*(f"fixed{n}" for n in counts), "auto", *(f"fixed{n}x2" for n in counts), "autox2")

    return {
        "A4p": Workload("A4p", 32, ("data", "label"), W4Fetch, runners(FIXED),
                        "auto vs fixed counts: W4's CPU-bound fetcher, processes", backend="processes"),
        "A6p": Workload("A6p", 32, ("data", "label"), W6Fetch, runners(FIXED),
                        "auto vs fixed counts: W6's JPEG decoding, processes", backend="processes", needs=("PIL",)),
        "A2p": Workload("A2p", 64, ("data", "label"), W2CopyFetch, runners(FIXED),
                        "auto vs fixed counts: W2's images copied once, processes", backend="processes"),
        "Aio": Workload("Aio", 32, ("data", "label"), IOFetch, runners(FIXED_IO),
                        "auto vs fixed counts: 5 ms of I/O per chunk, threads"),
    }


#: ``--workloads auto``
AUTO_IDS = ("A4p", "A6p", "A2p", "Aio")
# in the workload table (runner, report and cli import this module)
WORKLOADS.update(auto_workloads())


def run_counted(wl: Workload, seconds: float, workers: Any, doubled: bool = False,
                double_after: float | None = None, settle: float = 0.0) -> dict[str, Any]:
    """``wl`` on ``workers`` (a count or "auto"), ``max_buffered_bytes="auto"``.

    A fixed count: a warm-up of :data:`WARMUP_S` after its first batch,
    then the window.  ``settle``: the
    window starts that long after ``start()`` (auto's time to find its
    count).  ``doubled``: every fetch costs twice from the start;
    ``double_after``: from that long after ``start()``, after which it runs
    ``settle`` + ``seconds`` more, the window being the last ``seconds``.
    Every sample fetched must come out (``samples_lost``)."""
    import blobfeed

    tally = ManyTally()
    try:
        inner = wl.fetcher(None)
        fetch = Costly(tally, inner, 0.0 if doubled else None)
        gc = blobfeed.GlobalCoordinator()
        net = blobfeed.Net(None, name="bench")
        kwargs: dict[str, Any] = {} if wl.backend == "threads" else {"backend": wl.backend}
        blobfeed.init_data_input_workers(net, list(wl.blobs), fetch, wl.batch, num_worker_threads=workers,
                                         coordinator=gc, max_buffered_bytes="auto", **kwargs)
        source = gc._sources["train"]
        budget = source.max_bytes
        # a fixed count: the window starts WARMUP_S after the first batch (worker
        # processes take a while to start); auto: at settle after start(),
        # its own start counted in the time it takes
        total = settle + seconds if double_after is None else double_after + settle + seconds
        delivered = 0
        batches_in = samples_in = 0
        nbytes = 0
        series: list[list[float]] = []
        peak = 0
        t0 = time.monotonic()
        if double_after is not None:
            fetch.double_at = t0 + double_after  # pickled with it to the worker processes at start()
        gc.start()
        next_step = t0
        win_start = total - seconds
        t_first: float | None = None
        while True:
            out = net.run(timeout=60)
            now = time.monotonic()
            n = len(out[wl.blobs[0]])
            delivered += n
            if t_first is None:
                t_first = now - t0
                if settle == 0.0 and double_after is None:
                    win_start = t_first + WARMUP_S
                    total = win_start + seconds
            if now - t0 >= win_start:
                batches_in += 1
                samples_in += n
                nbytes += sum(out[b].nbytes for b in wl.blobs)
            if now >= next_step:
                q = source.queue_bytes()
                peak = max(peak, q)
                series.append([round(now - t0, 3), delivered, gc.num_workers("train"), q])
                next_step = now + STEP_S
            if now - t0 >= total:
                break
        window = max(1e-9, (time.monotonic() - t0) - win_start)
        workers_end = gc.num_workers("train")
        tally.finish()
        while True:
            try:
                out = net.run(timeout=60)
            except blobfeed.EndOfInput:
                break
            delivered += len(out[wl.blobs[0]])
        gc.stop()
        result: dict[str, Any] = {
            "batches_per_s": batches_in / window, "gb_per_s": nbytes / window / 1e9,
            "first_batch_ms": (t_first or 0.0) * 1e3, "samples_lost": int(tally.fetched() - delivered),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "workers": float(workers_end), "peak_queue_mb": peak / (1 << 20), "budget_mb": (budget or 0) / (1 << 20),
            "batch": wl.batch,
        }
        if workers == "auto":
            result["series"] = series
            if double_after is not None:
                result["doubled_at_s"] = double_after
        return result
    finally:
        tally.close()


def _fixed(n: int, doubled: bool) -> Callable[[Workload, float], dict[str, Any]]:
    return lambda wl, s: run_counted(wl, s, n, doubled=doubled)


#: the auto workloads' runners, by name
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    **{f"fixed{n}": _fixed(n, False) for n in FIXED_IO},
    **{f"fixed{n}x2": _fixed(n, True) for n in FIXED_IO},
    "auto": lambda wl, s: run_counted(wl, s, "auto", settle=SETTLE_S),
    "autox2": lambda wl, s: run_counted(wl, s, "auto", double_after=SETTLE_S + s, settle=SETTLE_S),
}


def measurement_seconds(runner: str, seconds: float) -> float:
    """The wall time of one auto-workload measurement beyond a child's
    start-up: fixed counts a warm-up and the window; auto its
    settling and the window; autox2 both twice."""
    if runner == "auto":
        return SETTLE_S + seconds
    if runner == "autox2":
        return 2 * (SETTLE_S + seconds)
    return WARMUP_S + seconds


def workers_of(runner: str) -> int:
    """Worker processes a runner starts beyond two (for the estimate):
    fixedN N - 2; auto about 8 in all over its trials."""
    if runner.startswith("fixed"):
        return max(0, int(runner[len("fixed"):].removesuffix("x2")) - 2)
    return 8 if runner == "auto" else 16


# -- the report ------------------------------------------------------------------------------
def time_to(series: list[list[float]], batch: int, rate: float, after: float = 0.0) -> float | None:
    """The first time (seconds from ``start()``, counted from ``after``) at
    which the batches/s over the trailing span (:data:`RATE_SPAN_S`, or the
    time :data:`SPAN_BATCHES` take at ``rate`` if longer; a span that starts
    at ``after`` or later) reached ``rate``; None: never."""
    span = max(RATE_SPAN_S, SPAN_BATCHES / rate) if rate > 0 else RATE_SPAN_S
    pts = [p for p in series if p[0] >= after]
    j = 0
    for i, (t, samples, *_rest) in enumerate(pts):
        while j < i and t - pts[j][0] > span:
            j += 1
        # the longest span back within `span`, at least most of it
        t0, s0 = pts[j][0], pts[j][1]
        if t - t0 >= 0.75 * span and (samples - s0) / batch / (t - t0) >= rate:
            return t - after
    return None


def _best(res: dict[str, dict[str, Any]], wl: str, suffix: str) -> tuple[str, float] | None:
    rows = [(k.split("/", 1)[1], r["batches_per_s"]) for k, r in res.items()
            if k.startswith(f"{wl}/fixed") and k.endswith(suffix) and "failed" not in r
            and (suffix or not k.endswith("x2"))]
    return max(rows, key=lambda kv: kv[1]) if rows else None


def _median_time(runs: Any, batch: int, rate: float, after: float) -> float | None:
    """The median over the repetitions' series (None counts as never: +inf)."""
    import statistics

    series_runs = runs if runs and isinstance(runs[0][0], list) else [runs]
    times = [time_to(s, batch, rate, after) for s in series_runs if s]
    if not times:
        return None
    med = statistics.median(float("inf") if t is None else t for t in times)
    return None if med == float("inf") else med


def auto_rows(res: dict[str, dict[str, Any]], row: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of the auto workloads in ``res`` (measurements that did
    not fail); ``row(workload, target, ratio, ok, detail)`` makes a row."""
    out = []
    for wl in AUTO_IDS:
        a = res.get(f"{wl}/auto")
        best = _best(res, wl, "")
        if a is not None and best is not None:
            name, bps = best
            ratio = a["batches_per_s"] / bps if bps else 0.0
            out.append(row(wl, f"auto's batches/s after {SETTLE_S:g} s vs the best fixed count >= {REACH}", ratio,
                           ratio >= REACH, f"best: {name} {bps:.1f}; auto ran {a['workers']:.0f} workers"))
            reach = _median_time(a.get("series"), int(a.get("batch", 1)), REACH * bps, 0.0)
            out.append(row(wl, f"auto reaches {REACH} x the best fixed count within {LIMIT_S:g} s (s)",
                           reach, reach is not None and reach <= LIMIT_S,
                           "never" if reach is None else f"{reach:.1f} s"))
        d = res.get(f"{wl}/autox2")
        best2 = _best(res, wl, "x2")
        if d is not None and best2 is not None:
            name, bps = best2
            after = float(d.get("doubled_at_s", 0.0))
            rec = _median_time(d.get("series"), int(d.get("batch", 1)), RECOVER * bps, after)
            out.append(row(wl, f"after the fetch cost doubles, auto reaches {RECOVER} x the new best within "
                               f"{LIMIT_S:g} s (s)", rec, rec is not None and rec <= LIMIT_S,
                           f"new best: {name} {bps:.1f}; " + ("never" if rec is None else f"{rec:.1f} s")))
        for runner in ("auto", "autox2"):
            r = res.get(f"{wl}/{runner}")
            if r is not None and r.get("budget_mb"):
                share = r["peak_queue_mb"] / r["budget_mb"]
                out.append(row(wl, f"{runner}: peak buffered bytes <= the budget", share, share <= 1.0,
                               f"{r['peak_queue_mb']:.1f} MiB of {r['budget_mb']:.0f} MiB"))
    return out


def auto_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Under the table: per auto workload, auto's worker count, time to
    reach the best fixed count, peak buffered bytes; empty without one."""
    lines = []
    for wl in AUTO_IDS:
        for runner, suffix, share, after_key in (("auto", "", REACH, None), ("autox2", "x2", RECOVER, "doubled_at_s")):
            r = results.get(f"{wl}/{runner}")
            best = _best(results, wl, suffix)
            if r is None or "failed" in r or best is None:
                continue
            after = float(r.get(after_key, 0.0)) if after_key else 0.0
            t = _median_time(r.get("series"), int(r.get("batch", 1)), share * best[1], after)
            when = "never" if t is None else f"{t:.1f} s" + (" after the doubling" if after_key else "")
            lines.append(
                f"{wl + '/' + runner:<17}{r['batches_per_s']:.1f} batches/s ({r['batches_per_s'] / best[1]:.2f} x "
                f"{best[0]}), {r['workers']:.0f} workers at the end, {share} x reached: {when}; "
                f"peak queue {r['peak_queue_mb']:.1f} MiB of a {r['budget_mb']:.0f} MiB budget"
            )
    return lines
