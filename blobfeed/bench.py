"""``blobfeed bench``: workloads W1-W5 (docs/BENCHMARKS.md), blobfeed beside its baselines.

Every (workload, runner) measurement runs in a fresh child process so that
peak RSS belongs to that runner alone; repetitions are interleaved (A B A B
...) so slow drift of a shared machine hits every runner alike; the median
of the repetitions is reported, and ratios are taken between runners of the
same invocation.

Runners:

* ``blobfeed``   -- the library, a ``Net`` with no model (W5: the MLP).
* ``caffe2``     -- Caffe2's original re-batching, written from its
  description: ``np.append`` growth, ``np.split``, leftover put back with
  ``put(block=False)`` and dropped when the queue is full.  It counts the
  samples it drops.
* ``copy``       -- the copy bound (W2): one ``np.copyto`` per batch into
  buffers rotated through more memory than the last-level cache.
* ``model``      -- the model alone (W5): ``InferenceSession.run`` on pre-made batches.
* ``torch0`` / ``torch2`` -- torch's DataLoader with 0 / 2 workers, where torch is installed.

Exit status: 0 when every evaluated target is met; 1 when any is missed,
including blobfeed losing a sample in any repetition (the missed targets are
listed); 2 for a usage error or a measurement that crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

__all__ = ["build_parser", "estimate_seconds", "evaluate", "main", "summarize", "verdict"]

Fetch = Callable[[int, int], list]


# --------------------------------------------------------------------------- workloads
class Finite:
    """Wraps a fetch function: counts what it returns and ends on request."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self.finish = threading.Event()
        self._counts: dict[int, int] = {}

    def __call__(self, worker_id: int, batch_size: int) -> list:
        if self.finish.is_set():
            raise StopIteration
        chunk = self._fetch(worker_id, batch_size)
        # one writer per key: each worker thread counts its own samples
        self._counts[worker_id] = self._counts.get(worker_id, 0) + len(chunk[0])
        return chunk

    @property
    def fetched(self) -> int:
        return sum(self._counts.values())


def _sizes(rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
    return rng.integers(lo, hi + 1, size=8192)


def _cycling(sizes: np.ndarray, make: Callable[[int, int], list]) -> Fetch:
    pos: dict[int, int] = {}

    def fetch(worker_id: int, batch_size: int) -> list:
        i = pos.get(worker_id, worker_id * 977) % len(sizes)
        pos[worker_id] = i + 1
        return make(worker_id, int(sizes[i]))

    return fetch


def make_w1() -> Fetch:
    rng = np.random.default_rng(1)
    pools = {}
    for w in range(8):
        data = np.repeat(np.arange(64, dtype=np.float64)[:, None] + w, 3, axis=1)
        pools[w] = (data, data[:, 0].copy())
    return _cycling(_sizes(rng, 1, 64), lambda w, n: [pools[w][0][:n], pools[w][1][:n]])


def make_w2() -> Fetch:
    rng = np.random.default_rng(2)
    images = rng.integers(0, 255, size=(16, 3, 224, 224), dtype=np.uint8)
    labels = np.arange(16, dtype=np.int64)
    return _cycling(_sizes(rng, 1, 16), lambda w, n: [images[:n], labels[:n]])


def make_w3() -> Fetch:
    rng = np.random.default_rng(3)
    data = rng.standard_normal((4096, 256)).astype(np.float32)
    labels = np.arange(4096, dtype=np.int64)
    return lambda w, b: [data, labels]


def _busy(iterations: int) -> int:
    acc = 0
    for i in range(iterations):
        acc += i * i % 7
    return acc


def calibrate_w4(target_s: float = 0.005) -> tuple[int, float]:
    """Iterations of pure-Python work taking ``target_s``, and the measured time."""
    n = 10_000
    while True:
        t0 = time.perf_counter()
        _busy(n)
        dt = time.perf_counter() - t0
        if dt > 0.002:
            break
        n *= 2
    n = int(n * target_s / dt)
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        _busy(n)
        times.append(time.perf_counter() - t0)
    return n, statistics.median(times)


class W4Fetch:
    """~5 ms of pure-Python work, then 32 samples.  Records the CPU time of
    each call (``time.thread_time``: GIL waits excluded) so one core's ideal
    comes from the very calls the pipeline made."""

    def __init__(self) -> None:
        self.iterations, _ = calibrate_w4()
        self.data = np.random.default_rng(4).standard_normal((32, 1024)).astype(np.float32)
        self.labels = np.arange(32, dtype=np.int64)
        self.cpu_times: list[float] = []  # list.append is atomic: threads share it safely

    def __call__(self, w: int, b: int) -> list:
        t0 = time.thread_time()
        _busy(self.iterations)
        self.cpu_times.append(time.thread_time() - t0)
        return [self.data, self.labels]

    def ideal(self) -> float:
        """Batches/s one core would give: 1 / the median CPU time of a fetch."""
        return 1.0 / statistics.median(self.cpu_times[len(self.cpu_times) // 4 :])


def make_w4() -> Fetch:
    return W4Fetch()


def make_w5() -> Fetch:
    rng = np.random.default_rng(5)
    data = rng.standard_normal((256, 784)).astype(np.float32)
    return _cycling(_sizes(rng, 1, 256), lambda w, n: [data[:n]])


@dataclass(frozen=True)
class Workload:
    id: str
    batch: int
    blobs: tuple[str, ...]
    make: Callable[[], Fetch]
    runners: tuple[str, ...]
    what: str


WORKLOADS = {
    "W1": Workload("W1", 32, ("data", "label"), make_w1, ("blobfeed", "caffe2", "torch0", "torch2"), "per-batch overhead"),
    "W2": Workload("W2", 64, ("data", "label"), make_w2, ("blobfeed", "caffe2", "copy", "torch0", "torch2"), "bandwidth"),
    "W3": Workload("W3", 32, ("data", "label"), make_w3, ("blobfeed", "caffe2"), "big chunks"),
    "W4": Workload("W4", 32, ("data", "label"), make_w4, ("blobfeed", "caffe2"), "CPU-bound fetchers"),
    "W5": Workload("W5", 128, ("data",), make_w5, ("blobfeed", "model"), "end to end with a model"),
}


def _mlp_bytes() -> bytes:
    from .models import mlp_onnx

    return mlp_onnx([784, 256, 10], seed=0)[0]


def _session_options() -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return so


# --------------------------------------------------------------------------- measurement
@dataclass
class Meter:
    """Counts batches in a timed window after a warm-up."""

    seconds: float
    warmup: float = 0.5
    batches: int = 0
    samples: int = 0
    nbytes: int = 0
    t_start: float = 0.0
    t_first: float | None = None
    t_window: float = 0.0
    t_end: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def begin(self) -> None:
        self.t_start = time.perf_counter()

    def tick(self, arrays: Any) -> bool:
        """Record one batch; False once the window is over."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            self.t_window = now + self.warmup
            return True
        if now < self.t_window:
            return True
        if self.batches == 0:
            self.t_window = now  # the window starts at the first batch after warm-up
        self.batches += 1
        self.samples += len(arrays[0])
        self.nbytes += sum(a.nbytes for a in arrays)
        self.t_end = now
        return now - self.t_window < self.seconds

    def result(self, **extra: Any) -> dict[str, Any]:
        dt = max(self.t_end - self.t_window, 1e-9)
        out = {
            "batches_per_s": self.batches / dt,
            "gb_per_s": self.nbytes / dt / 1e9,
            "first_batch_ms": ((self.t_first or self.t_start) - self.t_start) * 1e3,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        out.update(self.extra)
        out.update(extra)
        return out


def run_blobfeed(wl: Workload, seconds: float) -> dict[str, Any]:
    import blobfeed

    fetch = Finite(wl.make())
    model = _mlp_bytes() if wl.id == "W5" else None
    net = blobfeed.Net(model, name="bench", session_options=_session_options() if model else None)
    gc = blobfeed.GlobalCoordinator()
    blobfeed.init_data_input_workers(net, list(wl.blobs), fetch, wl.batch, num_worker_threads=2, coordinator=gc)
    m = Meter(seconds)
    wait_key = ("blobfeed_dequeue_wait_seconds_sum", {"source": "train", "net": "bench"})
    delivered = 0
    m.begin()
    gc.start()
    wait0 = 0.0
    while True:
        out = net.run(timeout=60)
        arrays = [out[n] for n in wl.blobs] if model is None else [net.workspace.fetch_blob("data")]
        delivered += len(arrays[0])
        before = m.batches
        going = m.tick(arrays)
        if before == 0 and m.batches == 1:
            wait0 = gc.registry.get_sample_value(*wait_key) or 0.0
        if not going:
            break
    waited = (gc.registry.get_sample_value(*wait_key) or 0.0) - wait0
    window = max(m.t_end - m.t_window, 1e-9)
    extra: dict[str, Any] = {}
    if model is not None:
        extra = _interleaved_model_ratio(net, model, wl, seconds)
        delivered += extra.pop("delivered")
    # Drain to the end: every fetched sample must come out exactly once.
    fetch.finish.set()
    while True:
        try:
            out = net.run(timeout=60)
        except blobfeed.EndOfInput:
            break
        delivered += len(out[wl.blobs[0]]) if model is None else len(net.workspace.fetch_blob("data"))
    gc.stop()
    if isinstance(fetch._fetch, W4Fetch):
        ideal = fetch._fetch.ideal()
        extra = {"ideal_batches_per_s": ideal, "ideal_ratio": m.result()["batches_per_s"] / ideal}
    return m.result(samples_lost=int(fetch.fetched - delivered), wait_share=waited / window, **extra)


def _interleaved_model_ratio(net: Any, model: bytes, wl: Workload, seconds: float) -> dict[str, Any]:
    """W5: alternate short slices of the fed net and of the model alone on
    pre-made batches, in this process, so that both see the same machine.

    While the model-alone slice runs, blobfeed's queues are full and its
    threads asleep: that slice is the model alone.
    """
    import onnxruntime as ort

    sess = ort.InferenceSession(model, sess_options=_session_options(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((wl.batch, 784)).astype(np.float32)
    fed = alone = 0
    t_fed = t_alone = 0.0
    delivered = 0
    slice_s = 0.25
    for _ in range(max(4, int(seconds / slice_s / 2))):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < slice_s:
            net.run(timeout=60)
            delivered += len(net.workspace.fetch_blob("data"))
            fed += 1
        t_fed += time.perf_counter() - t0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < slice_s:
            sess.run(None, {"data": x})
            alone += 1
        t_alone += time.perf_counter() - t0
    return {"model_ratio": (fed / t_fed) / (alone / t_alone), "delivered": delivered}


def _caffe2_pipeline(wl: Workload, fetch: Finite) -> tuple[Callable[[], list], Callable[[], dict[str, int]], Callable[[], None]]:
    """Caffe2's data_workers re-batching (see the module docstring)."""
    internal: queue.Queue = queue.Queue(800)
    device: queue.Queue = queue.Queue(4)
    stop = threading.Event()
    stats = {"dropped": 0, "held": 0}
    bs = wl.batch

    def fetcher(wid: int) -> None:
        while not stop.is_set():
            try:
                chunk = fetch(wid, bs)
            except StopIteration:
                return
            while True:
                try:
                    internal.put(chunk, timeout=0.1)
                    break
                except queue.Full:
                    if stop.is_set():
                        stats[f"held{wid}"] = len(chunk[0])  # not a loss of the algorithm
                        return

    def enqueuer() -> None:
        while not stop.is_set():
            cur: list | None = None
            while cur is None or len(cur[0]) < bs:
                try:
                    chunk = internal.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set():
                        stats["held"] = 0 if cur is None else len(cur[0])
                        return
                    continue
                if cur is None:
                    cur = [a.copy() for a in chunk]
                else:
                    cur = [np.append(c, a, axis=0) for c, a in zip(cur, chunk)]
            if len(cur[0]) > bs:
                parts = [np.split(c, [bs]) for c in cur]
                cur = [p[0] for p in parts]
                leftover = [p[1] for p in parts]
                try:
                    internal.put(leftover, block=False)
                except queue.Full:
                    stats["dropped"] += len(leftover[0])  # Caffe2 dropped these silently
            while True:
                try:
                    device.put(cur, timeout=0.1)
                    break
                except queue.Full:
                    if stop.is_set():
                        stats["held"] = len(cur[0])
                        return

    threads = [threading.Thread(target=fetcher, args=(w,), daemon=True) for w in range(2)]
    threads.append(threading.Thread(target=enqueuer, daemon=True))

    def start() -> None:
        for t in threads:
            t.start()

    def get() -> list:
        return device.get(timeout=60)

    def finish() -> dict[str, int]:
        stop.set()
        for t in threads:
            t.join(5)
        held = sum(len(item[0]) for item in list(internal.queue)) + sum(len(b[0]) for b in list(device.queue))
        return {"dropped": stats["dropped"], "held": held + sum(v for k, v in stats.items() if k.startswith("held"))}

    return get, finish, start


def run_caffe2(wl: Workload, seconds: float) -> dict[str, Any]:
    fetch = Finite(wl.make())
    get, finish, start = _caffe2_pipeline(wl, fetch)
    m = Meter(seconds)
    delivered = 0
    m.begin()
    start()
    while True:
        batch = get()
        delivered += len(batch[0])
        if not m.tick(batch):
            break
    fetch.finish.set()
    counts = finish()
    lost = fetch.fetched - delivered - counts["held"]
    extra = {"ideal_batches_per_s": fetch._fetch.ideal()} if isinstance(fetch._fetch, W4Fetch) else {}
    return m.result(samples_lost=int(lost), dropped_counted=counts["dropped"],
                    lost_share=lost / max(fetch.fetched, 1), **extra)


def run_copy(wl: Workload, seconds: float) -> dict[str, Any]:
    fetch = wl.make()
    chunk = fetch(0, wl.batch)
    batch_bytes = wl.batch * chunk[0][0].nbytes
    src = np.random.default_rng(0).integers(0, 255, size=batch_bytes, dtype=np.uint8)
    # rotate through 256 MiB of destinations: far more than any last-level cache
    n_buf = max(2, (256 << 20) // batch_bytes)
    bufs = [np.empty(batch_bytes, np.uint8) for _ in range(n_buf)]
    for b in bufs:
        b.fill(1)  # fault the pages in first: this bound is about copying
    m = Meter(seconds)
    m.begin()
    i = 0
    while True:
        dst = bufs[i % n_buf]
        np.copyto(dst, src)
        i += 1
        if not m.tick([dst]):
            break
    return m.result(samples_lost=0)


def run_model(wl: Workload, seconds: float) -> dict[str, Any]:
    import onnxruntime as ort

    sess = ort.InferenceSession(_mlp_bytes(), sess_options=_session_options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((wl.batch, 784)).astype(np.float32) for _ in range(8)]
    m = Meter(seconds)
    m.begin()
    i = 0
    while True:
        x = batches[i % len(batches)]
        sess.run(None, {"data": x})
        i += 1
        if not m.tick([x]):
            break
    return m.result(samples_lost=0)


def run_torch(wl: Workload, seconds: float, workers: int) -> dict[str, Any]:
    import torch.utils.data as tud

    fetch = wl.make()

    class Chunks(tud.Dataset):
        """Map-style: sample ``i`` is row ``i % len(pool)`` of a pool made of
        the workload's own chunks (at least a batch of them), so samples come
        from as much memory as blobfeed's fetchers read."""

        def __init__(self) -> None:
            chunks: list[list[np.ndarray]] = []
            while sum(int(len(c[0])) for c in chunks) < wl.batch:
                chunks.append(fetch(0, wl.batch))
            self.pool = [np.concatenate([c[k] for c in chunks]) for k in range(len(chunks[0]))]

        def __len__(self) -> int:
            return 10**9

        def __getitem__(self, i: int) -> tuple:
            j = i % len(self.pool[0])
            return tuple(a[j] for a in self.pool)

    loader = tud.DataLoader(Chunks(), batch_size=wl.batch, num_workers=workers, shuffle=False)
    m = Meter(seconds)
    m.begin()
    for batch in loader:
        if not m.tick([t.numpy() for t in batch]):
            break
    return m.result(samples_lost=0)


RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "blobfeed": run_blobfeed,
    "caffe2": run_caffe2,
    "copy": run_copy,
    "model": run_model,
    "torch0": lambda wl, s: run_torch(wl, s, 0),
    "torch2": lambda wl, s: run_torch(wl, s, 2),
}


def _torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


# --------------------------------------------------------------------------- the report
TARGETS = [
    # (workload, description, numerator runner, denominator runner or None, metric, threshold)
    ("W1", "batches/s vs Caffe2", "blobfeed", "caffe2", "batches_per_s", 2.0),
    ("W2", "GB/s vs the copy bound", "blobfeed", "copy", "gb_per_s", 0.7),
    ("W2", "batches/s vs Caffe2", "blobfeed", "caffe2", "batches_per_s", 4.0),
    ("W3", "batches/s vs Caffe2", "blobfeed", "caffe2", "batches_per_s", 6.0),
    ("W4", "batches/s vs one core's ideal", "blobfeed", "ideal", "batches_per_s", 0.9),
    ("W5", "batches/s vs the model alone (interleaved)", "blobfeed", "model", "batches_per_s", 0.85),
]


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    keys = results[0].keys()
    return {k: statistics.median(r[k] for r in results) for k in keys}


#: Meter's warm-up before each measured window, seconds.
WARMUP_S = Meter.warmup
#: Per-measurement cost beyond warm-up and window: a child's start-up, set-up
#: and drain.  With ``W5_SLICE_S``, ``COPY_SETUP_S`` and ``TORCH_EXTRA_S``
#: it makes ``estimate_seconds`` match the default run without torch on this
#: project's 2-core machine (about 212 s); ``TORCH_EXTRA_S`` is a guess.
CHILD_OVERHEAD_S = 0.4
#: W5/blobfeed's interleaved slices (see ``_interleaved_model_ratio``).
W5_SLICE_S = 0.25
#: W2/copy faults in 256 MiB of buffers first.
COPY_SETUP_S = 0.6
#: torch's import and, for torch2, its worker processes.
TORCH_EXTRA_S = 3.0


def _plan(workloads: list[str], torch: bool) -> list[tuple[str, str]]:
    """The (workload, runner) measurements of one repetition, in order."""
    return [(w, r) for w in workloads for r in WORKLOADS[w].runners if torch or not r.startswith("torch")]


def estimate_seconds(workloads: list[str], seconds: float, repeats: int, torch: bool) -> float:
    """Approximate wall time of a run: a model of it, not a measurement."""
    one = 0.0
    for w, r in _plan(workloads, torch):
        one += CHILD_OVERHEAD_S + WARMUP_S + seconds
        if (w, r) == ("W5", "blobfeed"):
            one += 2 * W5_SLICE_S * max(4, int(seconds / W5_SLICE_S / 2))
        elif r == "copy":
            one += COPY_SETUP_S
        elif r.startswith("torch"):
            one += TORCH_EXTRA_S
    return one * repeats


def _child(wl_id: str, runner: str, seconds: float) -> dict[str, Any]:
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "blobfeed.bench", "--child", wl_id, runner, str(seconds)],
        capture_output=True, text=True, timeout=seconds * 10 + 120, env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{wl_id}/{runner} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(raw: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every measurement's repetitions -> ``{"W1/blobfeed": {...}}``.

    Each figure is the median of the repetitions, except
    ``samples_lost_total``: the samples lost summed over all of them, so a
    loss in one repetition cannot hide behind the median.
    """
    results = {}
    for (w, r), runs in raw.items():
        results[f"{w}/{r}"] = _median(runs)
        results[f"{w}/{r}"]["samples_lost_total"] = int(sum(run["samples_lost"] for run in runs))
    if "W4/blobfeed" in results:
        results["W4/ideal"] = {"batches_per_s": results["W4/blobfeed"]["ideal_batches_per_s"]}
    return results


def run_all(workloads: list[str], seconds: float, repeats: int, progress: Any = sys.stderr) -> dict[str, Any]:
    torch_ok = _torch_available()
    plan = _plan(workloads, torch_ok)
    raw: dict[tuple[str, str], list[dict[str, Any]]] = {k: [] for k in plan}
    total = len(plan) * repeats
    done = 0
    t0 = time.monotonic()
    for rep in range(repeats):
        for w, r in plan:
            done += 1
            progress.write(f"\r[{done}/{total}] {w} {r:<9} rep {rep + 1}/{repeats}  {time.monotonic() - t0:5.0f} s elapsed ")
            progress.flush()
            raw[(w, r)].append(_child(w, r, seconds))
    progress.write("\n")
    results = summarize(raw)
    return {"seconds": seconds, "repeats": repeats, "torch": torch_ok, "results": results,
            "python": sys.version.split()[0], "cpus": os.cpu_count()}


def evaluate(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets that the report's results allow to evaluate, each with ``ok``."""
    res = report["results"]
    rows = []
    for wl, what, num, den, metric, threshold in TARGETS:
        a, b = res.get(f"{wl}/{num}"), res.get(f"{wl}/{den}")
        if a is None or b is None:
            continue
        # W4: each run against its own ideal; W5: against the model alone in
        # interleaved slices of the same run; then the median of the runs
        if den == "ideal":
            ratio = a["ideal_ratio"]
        elif den == "model":
            ratio = a["model_ratio"]
        else:
            ratio = a[metric] / b[metric]
        rows.append({"workload": wl, "target": f"{what} >= {threshold}", "ratio": ratio, "ok": ratio >= threshold})
    for wl in WORKLOADS:
        a = res.get(f"{wl}/blobfeed")
        if a:
            lost = a.get("samples_lost_total", a["samples_lost"])
            rows.append({"workload": wl, "target": "samples lost == 0", "ratio": lost, "ok": lost == 0})
    for wl in ("W2", "W3"):
        a, b = res.get(f"{wl}/blobfeed"), res.get(f"{wl}/caffe2")
        if a and b:
            rows.append({"workload": wl, "target": "peak RSS <= Caffe2's", "ratio": a["peak_rss_mb"] / b["peak_rss_mb"],
                         "ok": a["peak_rss_mb"] <= b["peak_rss_mb"]})
    w5 = res.get("W5/blobfeed")
    if w5:
        rows.append({"workload": "W5", "target": "model waits for input < 10 %", "ratio": w5["wait_share"],
                     "ok": w5["wait_share"] < 0.10})
    w1 = res.get("W1/blobfeed")
    if w1:
        rows.append({"workload": "W1", "target": "first batch <= 50 ms", "ratio": w1["first_batch_ms"],
                     "ok": w1["first_batch_ms"] <= 50})
    return rows


def _measured(value: Any) -> str:
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def verdict(rows: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """The exit status for the evaluated ``rows``, and the lines that say why.

    0 when every row is met; 1 when any is missed, or when there is no row
    at all (nothing was checked: not a pass).
    """
    if not rows:
        return 1, ["verdict: no target could be evaluated"]
    missed = [row for row in rows if not row["ok"]]
    if not missed:
        return 0, [f"verdict: all {len(rows)} targets met"]
    return 1, [f"verdict: MISSED {len(missed)} of {len(rows)} targets:"] + [
        f"  {row['workload']} {row['target']}: measured {_measured(row['ratio'])}" for row in missed
    ]


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"blobfeed bench: {report['seconds']:g} s per measurement, median of {report['repeats']}, "
        f"python {report['python']}, {report['cpus']} cpus, torch {'yes' if report['torch'] else 'not installed (skipped)'}",
        "",
        f"{'workload/runner':<18}{'batches/s':>12}{'GB/s':>9}{'peak RSS MB':>13}{'first ms':>10}{'lost':>10}",
    ]
    for key, r in report["results"].items():
        if key.endswith("/ideal"):
            lines.append(f"{key:<18}{r['batches_per_s']:>12.1f}{'':>9}{'':>13}{'':>10}{'':>10}")
            continue
        lines.append(
            f"{key:<18}{r['batches_per_s']:>12.1f}{r['gb_per_s']:>9.2f}{r['peak_rss_mb']:>13.0f}"
            f"{r['first_batch_ms']:>10.1f}{int(r['samples_lost']):>10d}"
        )
    lines += ["", f"{'target':<46}{'measured':>10}  result"]
    for row in evaluate(report):
        lines.append(
            f"{row['workload'] + ' ' + row['target']:<46}{_measured(row['ratio']):>10}  {'ok' if row['ok'] else 'MISSED'}"
        )
    return "\n".join(lines)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


DEFAULT_WORKLOADS = "W1,W2,W3,W4,W5"
DEFAULT_SECONDS = 5.0
DEFAULT_REPEATS = 3


def build_parser() -> argparse.ArgumentParser:
    """The ``blobfeed bench`` command line; its epilog estimates the default run's length."""
    torch_ok = _torch_available()
    wls = DEFAULT_WORKLOADS.split(",")
    per_repeat = len(_plan(wls, torch_ok))
    est = estimate_seconds(wls, DEFAULT_SECONDS, DEFAULT_REPEATS, torch_ok)
    if torch_ok:
        torch_note = "torch is installed, so its DataLoader rows are included"
    else:
        with_torch = estimate_seconds(wls, DEFAULT_SECONDS, DEFAULT_REPEATS, True)
        torch_note = (
            f"torch is not installed, so its DataLoader rows are skipped (with torch: "
            f"{len(_plan(wls, True)) * DEFAULT_REPEATS} measurements, about {with_torch / 60:.1f} min)"
        )
    epilog = (
        f"The default invocation runs {per_repeat * DEFAULT_REPEATS} measurements ({per_repeat} per "
        f"repeat x {DEFAULT_REPEATS} repeats) and takes about {est:.0f} s ({est / 60:.1f} min) on a "
        f"2-core machine; {torch_note}. Each measurement is a child process: start-up, a "
        f"{WARMUP_S:g} s warm-up, then the measured window. Exit status: 0 when every evaluated "
        f"target is met; 1 when any target is missed, including blobfeed losing a sample in any "
        f"repetition (the missed targets are listed); 2 for a usage error or a measurement that crashed."
    )
    p = argparse.ArgumentParser(
        prog="blobfeed bench",
        description="Run workloads W1-W5 (docs/BENCHMARKS.md) against blobfeed and its baselines, "
        "print one table and the targets, and exit with the verdict.",
        epilog=epilog,
    )
    p.add_argument(
        "--workloads", default=DEFAULT_WORKLOADS,
        help=f"comma-separated subset of W1..W5 (default: {DEFAULT_WORKLOADS})",
    )
    p.add_argument(
        "--seconds", type=_positive_float, default=DEFAULT_SECONDS,
        help=f"measured seconds per measurement, after a {WARMUP_S:g} s warm-up (default: {DEFAULT_SECONDS:g} s)",
    )
    p.add_argument(
        "--repeats", type=_positive_int, default=DEFAULT_REPEATS,
        help=f"repetitions of every measurement; the median is reported (default: {DEFAULT_REPEATS})",
    )
    p.add_argument("--json", metavar="PATH", help="also write the raw results and the verdict here (default: none)")
    p.add_argument("--child", nargs=3, metavar=("WORKLOAD", "RUNNER", "SECONDS"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``blobfeed bench``; returns the exit status (see the module docstring)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.child:
        wl_id, runner, secs = args.child
        print(json.dumps(RUNNERS[runner](WORKLOADS[wl_id], float(secs))))
        return 0
    wls = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in wls if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    torch_ok = _torch_available()
    n = len(_plan(wls, torch_ok)) * args.repeats
    est = estimate_seconds(wls, args.seconds, args.repeats, torch_ok)
    print(f"blobfeed bench: {n} measurements, about {est:.0f} s", file=sys.stderr, flush=True)
    try:
        report = run_all(wls, args.seconds, args.repeats)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:  # a child crashed or hung
        print(f"blobfeed bench: a measurement failed, no verdict: {exc}", file=sys.stderr)
        return 2
    rows = evaluate(report)
    status, why = verdict(rows)
    print(format_report(report))
    print()
    print("\n".join(why))
    if args.json:
        report["targets"] = rows
        report["passed"] = status == 0
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
