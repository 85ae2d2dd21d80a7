"""Scrape your own ``/metrics``, as Prometheus would.

blobfeed's metrics live in the global coordinator's registry (prometheus-
client's default one); ``blobfeed.metrics.start_http_server(0)`` serves them
on 127.0.0.1 at a free port.  The example runs a pipeline, reads
``/metrics`` over HTTP halfway through and again at the end, parses the text
with ``prometheus_client.parser.text_string_to_metric_families``, and checks
that the numbers tell the truth: every metric blobfeed exports (the families
its registry describes, so a metric added to the library is checked too) is
served, and the counters agree with what the consumer saw.

Run:  python examples/metrics_scrape.py
"""

from __future__ import annotations

import threading
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

import blobfeed
from blobfeed.metrics import start_http_server

N_SAMPLES = 20_000
BATCH = 200
HALF = N_SAMPLES // BATCH // 2
QUEUE_BOUND = 16


def exported_families(registry: object) -> list[str]:
    """The names of the metric families blobfeed exports from ``registry``.

    Read from the registry itself rather than listed here, so the check
    follows the library (a counter's family name drops the ``_total`` of its
    samples; a histogram's samples end in ``_bucket``, ``_sum`` and ``_count``).
    """
    return sorted({f.name for f in registry.collect() if f.name.startswith("blobfeed_")})


def scrape(url: str) -> tuple[set[str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """GET ``url``; returns blobfeed's family names and {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    families, values = set(), {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("blobfeed_"):
            families.add(family.name)  # a counter's family name drops the _total
            for s in family.samples:
                values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, values


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), float("nan"))


def main() -> None:
    rng = np.random.default_rng(3)
    data = rng.standard_normal((N_SAMPLES, 8)).astype(np.float32)
    cursor = {"pos": 0}
    lock = threading.Lock()

    def fetch_fun(worker_id: int, batch_size: int) -> list[np.ndarray]:
        n = int(np.random.default_rng().integers(1, 2 * batch_size))
        with lock:
            start = cursor["pos"]
            if start >= N_SAMPLES:
                raise StopIteration
            cursor["pos"] = start + n
        return [data[start : start + n]]

    net = blobfeed.Net(name="reader")  # no model: run() returns the batch
    coordinator = blobfeed.init_data_input_workers(  # the global coordinator
        net, ["data"], fetch_fun, batch_size=BATCH, max_buffered_batches=QUEUE_BOUND, timeout=10.0
    )
    server = start_http_server(0)
    exported = exported_families(coordinator.registry)
    failures: list[str] = []
    src, both = {"source": "train"}, {"source": "train", "net": "reader"}
    try:
        coordinator.start()
        for _ in range(HALF):
            net.run()
        families, mid = scrape(server.url)
        missing = [name for name in exported if name not in families]
        if missing:
            failures.append(f"metrics missing from /metrics: {missing}")
        if value(mid, "blobfeed_delivered_samples_total", **both) != HALF * BATCH:
            failures.append(f"halfway: delivered {value(mid, 'blobfeed_delivered_samples_total', **both)}")
        if not value(mid, "blobfeed_batches_total", **both) >= HALF:
            failures.append(f"halfway: batches_total {value(mid, 'blobfeed_batches_total', **both)} < {HALF}")
        if value(mid, "blobfeed_internal_queue_capacity", **src) != QUEUE_BOUND:
            failures.append(f"queue capacity {value(mid, 'blobfeed_internal_queue_capacity', **src)}")
        print(
            f"halfway, {server.url}: batches_total={value(mid, 'blobfeed_batches_total', **both):g} "
            f"fetched_samples_total={value(mid, 'blobfeed_fetched_samples_total', **src):g} "
            f"internal_queue_depth={value(mid, 'blobfeed_internal_queue_depth', **src):g}/{QUEUE_BOUND} "
            f"device_queue_depth={value(mid, 'blobfeed_device_queue_depth', **both):g}"
        )

        batches = HALF
        while True:
            try:
                net.run()
            except blobfeed.EndOfInput:
                break
            batches += 1
        _, end = scrape(server.url)
    finally:
        ok = coordinator.stop()
        server.close()

    expected_batches = -(-N_SAMPLES // BATCH)
    checks = {
        "blobfeed_fetched_samples_total": (value(end, "blobfeed_fetched_samples_total", **src), N_SAMPLES),
        "blobfeed_delivered_samples_total": (value(end, "blobfeed_delivered_samples_total", **both), N_SAMPLES),
        "blobfeed_batches_total": (value(end, "blobfeed_batches_total", **both), batches),
        "blobfeed_dequeue_timeouts_total": (value(end, "blobfeed_dequeue_timeouts_total", **both), 0),
        "blobfeed_fetch_errors_total": (
            sum(value(end, "blobfeed_fetch_errors_total", source="train", kind=k)
                for k in ("exception", "invalid", "none", "empty")), 0),
    }
    for name, (got, want) in checks.items():
        if got != want:
            failures.append(f"at the end {name} = {got:g}, expected {want:g}")
    if batches != expected_batches:
        failures.append(f"consumed {batches} batches, expected {expected_batches}")
    waits = value(end, "blobfeed_dequeue_wait_seconds_count", **both)
    if not waits >= batches:
        failures.append(f"dequeue_wait_seconds_count {waits:g} < {batches} batches")
    if not ok:
        failures.append("stop() left threads running")

    print("at the end: " + " ".join(f"{name}={got:g}" for name, (got, _) in checks.items()))
    if failures:
        print("FAILED: " + "; ".join(failures))
        raise SystemExit(1)
    print(f"/metrics lists all {len(exported)} metrics blobfeed exports and agrees with the consumer; clean stop")


if __name__ == "__main__":
    main()
