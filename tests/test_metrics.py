"""Metrics: the contract's table (docs/CONTRACT.md), the HTTP endpoint, external loggers, log warnings."""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed import Net, init_data_input_workers
from blobfeed.feeders import enqueuer
from blobfeed.metrics import start_http_server

from .helpers import WAIT, ChunkPlan, drain, sample, wait_until

SPEC_METRICS = {
    # name: (type, labels)
    "blobfeed_fetched_chunks_total": ("counter", {"source"}),
    "blobfeed_fetched_samples_total": ("counter", {"source"}),
    "blobfeed_fetched_bytes_total": ("counter", {"source"}),
    "blobfeed_fetch_seconds": ("histogram", {"source"}),
    "blobfeed_fetch_errors_total": ("counter", {"source", "kind"}),
    "blobfeed_batches_total": ("counter", {"source", "net"}),
    "blobfeed_enqueue_seconds": ("histogram", {"source", "net"}),
    "blobfeed_internal_queue_depth": ("gauge", {"source"}),
    "blobfeed_internal_queue_capacity": ("gauge", {"source"}),
    "blobfeed_device_queue_depth": ("gauge", {"source", "net"}),
    "blobfeed_dequeue_wait_seconds": ("histogram", {"source", "net"}),
    "blobfeed_dequeue_timeouts_total": ("counter", {"source", "net"}),
    "blobfeed_workers_alive": ("gauge", {"source"}),
    "blobfeed_inputs_per_second": ("gauge", {"source"}),
    "blobfeed_build_info": ("gauge", {"version", "python", "onnxruntime"}),
    "blobfeed_first_batch_seconds": ("gauge", {"source", "net"}),
    "blobfeed_consumer_busy_seconds_total": ("counter", {"source", "net"}),
    "blobfeed_model_run_seconds": ("histogram", {"source", "net"}),
    # issue 27: the bottleneck verdict in force, info-style (always 1)
    "blobfeed_bottleneck_info": ("gauge", {"source", "net", "stage"}),
}
#: metrics with a sample only once a running pipeline has been judged (a second)
JUDGED = {"blobfeed_bottleneck_info"}


def families(gc: blobfeed.GlobalCoordinator) -> dict[str, Any]:
    out = {}
    for fam in gc.registry.collect():
        for s in fam.samples:
            out.setdefault(s.name, (fam.type, set(s.labels) - {"le"}))
    return out


def test_every_spec_metric_with_its_labels(gc: blobfeed.GlobalCoordinator) -> None:
    plan = ChunkPlan({0: [3, 5, 8], 1: [4]})  # 20 samples
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], plan, 4, coordinator=gc)
    gc.start()
    batches = drain(net)
    seen = families(gc)
    for name, (kind, labels) in SPEC_METRICS.items():
        if name in JUDGED:
            continue  # test_judged_spec_metrics_with_their_labels
        probe = name + "_count" if kind == "histogram" else name
        assert probe in seen, f"missing metric {name}"
        assert seen[probe] == (kind, labels), f"{name}: {seen[probe]} != {(kind, labels)}"
    assert sample(gc, "blobfeed_fetched_chunks_total", source="train") == 4
    assert sample(gc, "blobfeed_fetched_samples_total", source="train") == 20
    assert sample(gc, "blobfeed_fetched_bytes_total", source="train") == 20 * (8 + 8)
    assert sample(gc, "blobfeed_fetch_seconds_count", source="train") == 4 + 2  # + the two StopIterations
    assert sample(gc, "blobfeed_batches_total", source="train", net="n") == len(batches) == 5
    assert sample(gc, "blobfeed_enqueue_seconds_count", source="train", net="n") == 5
    assert sample(gc, "blobfeed_dequeue_wait_seconds_count", source="train", net="n") >= 5
    assert sample(gc, "blobfeed_internal_queue_capacity", source="train") == 800
    assert sample(gc, "blobfeed_internal_queue_depth", source="train") == 0
    assert sample(gc, "blobfeed_device_queue_depth", source="train", net="n") == 0
    assert sample(gc, "blobfeed_delivered_samples_total", source="train", net="n") == 20
    assert sample(gc, "blobfeed_buffered_samples", source="train") == 0


def test_judged_spec_metrics_with_their_labels(gc: blobfeed.GlobalCoordinator) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [np.zeros((4, 1))], 4, coordinator=gc)
    gc.start()
    deadline = time.monotonic() + 60
    while not any(s.startswith("blobfeed_bottleneck_info") for s in families(gc)):
        assert time.monotonic() < deadline, "no bottleneck verdict within 60 s"
        net.run(timeout=WAIT)
    seen = families(gc)
    for name in JUDGED:
        assert seen[name] == SPEC_METRICS[name], f"{name}: {seen[name]} != {SPEC_METRICS[name]}"
    assert sum(sample(gc, "blobfeed_bottleneck_info", source="train", net="n", stage=v.stage)
               for v in gc.bottleneck()) == 1


def test_queue_depth_and_workers_alive_are_live(gc: blobfeed.GlobalCoordinator) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [np.zeros(2)], 4, num_worker_threads=2,
                            max_buffered_batches=3, device_queue_capacity=2, coordinator=gc)
    gc.start()
    wait_until(lambda: sample(gc, "blobfeed_internal_queue_depth", source="train") == 3
               and sample(gc, "blobfeed_device_queue_depth", source="train", net="n") == 2, "full queues")
    assert sample(gc, "blobfeed_workers_alive", source="train") == 2
    # 3 chunks queued + 2 batches of 4 + what the enqueuer holds
    assert sample(gc, "blobfeed_buffered_samples", source="train") >= 3 * 2 + 2 * 4


def test_inputs_per_second_and_external_loggers(gc: blobfeed.GlobalCoordinator) -> None:
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[dict[str, Any]] = []
            self.twice = threading.Event()

        def log(self, metrics: dict[str, Any]) -> None:
            self.calls.append(metrics)
            if len(self.calls) >= 2:
                self.twice.set()

    class Broken:
        def log(self, metrics: dict[str, Any]) -> None:
            raise RuntimeError("logger down")

    rec = Recorder()
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [np.zeros(4)], 4, external_loggers=[Broken(), rec], coordinator=gc)
    gc.start()
    stop_consuming = threading.Event()

    def consume() -> None:
        while not stop_consuming.is_set():
            net.run(timeout=WAIT)

    t = threading.Thread(target=consume)
    t.start()
    try:
        assert rec.twice.wait(WAIT), "external loggers were not called per interval"
        assert sample(gc, "blobfeed_inputs_per_second", source="train") > 0
    finally:
        stop_consuming.set()
        t.join(WAIT)
    n_before = len(rec.calls)
    assert gc.stop()
    assert len(rec.calls) == n_before + 1, "loggers are called once more at stop"
    keys = {"inputs_per_sec", "queue_size", "time_elapsed", "fetcher_time", "fetcher_time_count",
            "enqueue_time", "enqueue_time_count"}
    for call in rec.calls:
        assert keys <= set(call)
    assert any(c["fetcher_time_count"] > 0 for c in rec.calls)
    assert any(c["inputs_per_sec"] > 0 for c in rec.calls)


def test_http_endpoint_on_loopback(gc: blobfeed.GlobalCoordinator) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [np.zeros(4)], 4, coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)
    with start_http_server(0, registry=gc.registry) as server:
        assert server.addr == "127.0.0.1" and server.port > 0
        with urllib.request.urlopen(server.url, timeout=WAIT) as resp:
            body = resp.read().decode()
    assert 'blobfeed_batches_total{net="n",source="train"}' in body
    assert "blobfeed_internal_queue_capacity" in body
    server.close()  # idempotent


def test_default_endpoint_serves_the_global_registry() -> None:
    with start_http_server(0) as server:
        with urllib.request.urlopen(server.url, timeout=WAIT) as resp:
            assert resp.status == 200
            # families are described even before any source exists
            assert "# TYPE blobfeed_fetched_chunks_total counter" in resp.read().decode()


def test_registry_shared_by_two_coordinators_is_refused() -> None:
    reg = blobfeed.GlobalCoordinator().registry
    with pytest.raises(ValueError, match="already holds blobfeed metrics"):
        blobfeed.GlobalCoordinator(registry=reg)


def test_data_input_is_slow_warning(gc: blobfeed.GlobalCoordinator, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(enqueuer, "SLOW_INPUT_WARN_S", 0.05)
    release = threading.Event()

    def fetch(w: int, b: int) -> list[np.ndarray]:
        release.wait(WAIT)
        raise StopIteration

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    try:
        with caplog.at_level("WARNING", logger="blobfeed"), pytest.raises(blobfeed.DequeueTimeout):
            t0 = time.monotonic()
            net.run(timeout=0.5)
        waited = time.monotonic() - t0
    finally:
        release.set()
    slow = [r for r in caplog.records if "data input is slow" in r.getMessage()]
    # once per 0.05 s of waiting, no more (a loaded machine may wake the
    # waiting thread less often: a wait of 0.5 s, not 0.18, still shows two)
    assert 2 <= len(slow) <= waited / 0.05 + 1, [r.getMessage() for r in slow]
    assert "net 'n'" in slow[0].getMessage() and "source 'train'" in slow[0].getMessage()


def test_lagging_behind_warning_is_rate_limited(gc: blobfeed.GlobalCoordinator, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(enqueuer, "LAGGING_WARN_S", 0.0)
    plan = ChunkPlan({0: [4] * 5})
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], plan, 4, num_worker_threads=1, coordinator=gc)
    with caplog.at_level("WARNING", logger="blobfeed"):
        gc.start()
        # The enqueuer checks when it assembles a batch; the net's thread, which
        # assembles one itself when it finds none (a loaded machine, the
        # enqueuer not yet scheduled), does not.  So the enqueuer fills the
        # device queue first: at its fourth batch at most one of the five
        # chunks is left in the internal queue.
        wait_until(lambda: sample(gc, "blobfeed_device_queue_depth", source="train", net="n") == 4,
                   "the enqueuer filled the device queue")
        drain(net)
    lagging = [r for r in caplog.records if "data loading lagging behind" in r.getMessage()]
    assert lagging and "source 'train'" in lagging[0].getMessage()
    monkeypatch.setattr(enqueuer, "LAGGING_WARN_S", 3600.0)
    caplog.clear()
    gc.stop()
    net2 = Net(name="m")
    init_data_input_workers(net2, ["ids", "feat"], ChunkPlan({1: [4] * 5}), 4, num_worker_threads=1, coordinator=gc)
    with caplog.at_level("WARNING", logger="blobfeed"):
        gc.start()
        drain(net2)
    assert not [r for r in caplog.records if "lagging" in r.getMessage()], "not more than once per interval"


def test_lagging_behind_is_told_for_batches_assembled_outside_the_lock(
        gc: blobfeed.GlobalCoordinator, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Big batches (1 MiB and more: cut under the feed's lock, joined
    outside it) get the "lagging behind" check too: it was made only where
    small ones are assembled, so a stream of images never heard it."""
    monkeypatch.setattr(enqueuer, "LAGGING_WARN_S", 0.0)
    calls = iter(range(6))

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        i = next(calls, None)
        if i is None:
            raise StopIteration
        return [np.full(4, i, np.int64), np.zeros((4, 128 * 1024), np.float32)]  # 2 MiB a batch of 4

    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], fetch, 4, num_worker_threads=1, coordinator=gc)
    with caplog.at_level("WARNING", logger="blobfeed"):
        gc.start()
        got = drain(net)
    assert [int(b["ids"][0]) for b in got] == list(range(6))
    lagging = [r for r in caplog.records if "data loading lagging behind" in r.getMessage()]
    assert lagging and "source 'train'" in lagging[0].getMessage()


def test_loggers_get_a_last_call_when_the_source_ends_by_itself() -> None:
    calls: list[dict[str, Any]] = []
    done = threading.Event()

    class Recorder:
        def log(self, metrics: dict[str, Any]) -> None:
            calls.append(metrics)
            done.set()

    gc = blobfeed.GlobalCoordinator(log_interval=3600)  # no periodic call in this test
    try:
        net = Net(name="n")
        init_data_input_workers(net, ["ids", "feat"], ChunkPlan({0: [3, 3]}), 4, num_worker_threads=1,
                                external_loggers=[Recorder()], coordinator=gc)
        gc.start()
        drain(net)
        assert done.wait(WAIT)
        assert calls[-1]["fetcher_time_count"] == 3  # two chunks + StopIteration
    finally:
        assert gc.stop()
    assert len(calls) == 1, "the end-of-source call is the last one; stop() adds none"


def test_accounting_identity_holds_under_backpressure(gc: blobfeed.GlobalCoordinator) -> None:
    """fetched = delivered + dropped + buffered, while fetchers and the
    enqueuer are blocked on full queues."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [np.zeros(7)], 5, num_worker_threads=2,
                            max_buffered_batches=2, device_queue_capacity=1, coordinator=gc)
    gc.start()
    for _ in range(3):
        net.run(timeout=WAIT)
    # at rest: the internal queue full, so both fetchers and the enqueuer are blocked
    wait_until(lambda: sample(gc, "blobfeed_internal_queue_depth", source="train") == 2
               and sample(gc, "blobfeed_device_queue_depth", source="train", net="n") == 1
               and sample(gc, "blobfeed_fetched_samples_total", source="train") >= 3 * 5 + 2 * 7 + 2 * 7,
               "every thread blocked on a full queue")

    def parts() -> tuple[float, float]:
        fetched = sample(gc, "blobfeed_fetched_samples_total", source="train")
        delivered = sample(gc, "blobfeed_delivered_samples_total", source="train", net="n")
        dropped = sum(sample(gc, "blobfeed_dropped_samples_total", source="train", reason=r)
                      for r in ("drop_last", "stopped", "error"))
        buffered = sample(gc, "blobfeed_buffered_samples", source="train")
        return fetched, delivered + dropped + buffered

    fetched, accounted = parts()
    assert fetched == accounted and fetched > 15
    assert gc.stop()
    fetched, accounted = parts()
    assert fetched == accounted
    assert sample(gc, "blobfeed_dropped_samples_total", source="train", reason="stopped") > 0


def test_build_info_names_the_versions(gc: blobfeed.GlobalCoordinator) -> None:
    import importlib.metadata
    import platform

    labels = {"version": blobfeed.__version__, "python": platform.python_version(),
              "onnxruntime": importlib.metadata.version("onnxruntime")}
    assert sample(gc, "blobfeed_build_info", **labels) == 1


def test_time_to_first_batch_stall_ratio_and_model_seconds(gc: blobfeed.GlobalCoordinator) -> None:
    """The input-stall ratio is one line, wait / (wait + busy): here the
    consumer works WORK seconds after each batch and input never lacks, so
    busy is at least that work and the ratio is small."""
    from blobfeed.apps.models import mlp_onnx

    pytest.importorskip("onnx")
    model, _ = mlp_onnx([3, 4, 2])
    net = Net(model, name="m")
    init_data_input_workers(net, ["data"], lambda w, b: [np.zeros((4, 3), np.float32)], 4,
                            num_worker_threads=1, coordinator=gc)
    gc.start()
    runs, work = 6, 0.02
    for _ in range(runs):
        net.run(timeout=WAIT)
        time.sleep(work)  # the consumer's own work between run() calls: what is measured
    labels = {"source": "train", "net": "m"}
    first = sample(gc, "blobfeed_first_batch_seconds", **labels)
    assert 0 < first < WAIT
    assert sample(gc, "blobfeed_model_run_seconds_count", **labels) == runs
    assert sample(gc, "blobfeed_model_run_seconds_sum", **labels) > 0
    busy = sample(gc, "blobfeed_consumer_busy_seconds_total", **labels)
    wait = sample(gc, "blobfeed_dequeue_wait_seconds_sum", **labels)
    # five gaps between six run() calls, each the work (and the model's run)
    assert busy >= (runs - 1) * work
    assert wait / (wait + busy) < 0.5
    assert gc.stop(timeout=WAIT)
    # retired with the source: the counters keep their values
    assert sample(gc, "blobfeed_consumer_busy_seconds_total", **labels) == busy
    assert sample(gc, "blobfeed_first_batch_seconds", **labels) == first


def test_first_batch_counts_from_a_late_first_run(gc: blobfeed.GlobalCoordinator) -> None:
    """A consumer that asks late does not count against the pipeline: the
    time runs from the later of start() and the first run()."""
    ready = threading.Event()

    def fetch(w: int, b: int) -> list[np.ndarray]:
        ready.set()
        return [np.zeros(4)]

    net = Net(name="late")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    assert ready.wait(WAIT)
    wait_until(lambda: sample(gc, "blobfeed_device_queue_depth", source="train", net="late") > 0,
               "a batch ready before the first run()")
    before = time.perf_counter()
    net.run(timeout=WAIT)
    took = time.perf_counter() - before
    assert 0 < sample(gc, "blobfeed_first_batch_seconds", source="train", net="late") <= took
