"""examples/grafana_dashboard.json: importable, and it graphs metrics blobfeed really exports."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import blobfeed

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana_dashboard.json"
DS_UID = "${DS_PROMETHEUS}"
METRIC = re.compile(r"\bblobfeed_[a-z0-9_]+\b")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that draws something (rows and the panels nested in collapsed rows too)."""
    out = []
    for p in dashboard["panels"]:
        if p.get("type") == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def _queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL string: panel targets and template variable queries."""
    exprs = [t["expr"] for p in _panels(dashboard) for t in p["targets"]]
    for var in dashboard.get("templating", {}).get("list", []):
        q = var.get("query")
        exprs.append(q["query"] if isinstance(q, dict) else str(q or ""))
    return exprs


def _datasources(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict):
            yield ds
        for value in node.values():
            yield from _datasources(value)
    elif isinstance(node, list):
        for value in node:
            yield from _datasources(value)


#: the tests that read ``exported``: one test process takes both
#: (``--dist loadgroup``), so the pipeline runs once (a second's wait for its
#: first verdict) for the two
EXPORTED = pytest.mark.xdist_group("dashboard-exported")


@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    """{sample name: family type} from a live pipeline's registry (after a
    short run); the pipeline is stopped once its names are read."""
    gc = blobfeed.GlobalCoordinator(log_interval=0.05)
    try:
        return _exported(gc)
    finally:
        assert gc.stop(timeout=5.0), "a thread outlived stop()"


def _exported(gc: blobfeed.GlobalCoordinator) -> dict[str, str]:
    rng = np.random.default_rng(0)

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        n = int(rng.integers(1, 20))
        return [np.zeros((n, 3), np.float32), np.arange(n, dtype=np.int64)]

    net = blobfeed.Net(name="dash")
    blobfeed.init_data_input_workers(net, ["x", "y"], fetch, batch_size=8, coordinator=gc, timeout=5.0)
    gc.start()
    for _ in range(20):
        net.run()
    # ... and until the first bottleneck verdict (a second's window)
    deadline = time.monotonic() + 60
    while not gc.bottleneck():
        assert time.monotonic() < deadline, "no bottleneck verdict within 60 s"
        net.run()
    # Collected while the source is live: queue gauges exist only then.
    names = {s.name: family.type for family in gc.registry.collect() for s in family.samples}
    assert "blobfeed_batches_total" in names and "blobfeed_device_queue_depth" in names, sorted(names)
    return names


def test_is_an_importable_dashboard(dashboard: dict[str, Any]) -> None:
    assert isinstance(dashboard["schemaVersion"], int) and 36 <= dashboard["schemaVersion"] <= 45
    assert dashboard["title"] and dashboard["uid"]
    inputs = {i["name"]: i for i in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    assert dashboard.get("id") is None, "an exported dashboard carries no database id"
    # Every query goes to the imported Prometheus (the built-in annotation source aside).
    sources = [ds for ds in _datasources(dashboard) if ds.get("type") != "grafana"]
    assert sources and all(ds == {"type": "prometheus", "uid": DS_UID} for ds in sources), sources


def test_panels_have_layout_and_queries(dashboard: dict[str, Any]) -> None:
    panels = _panels(dashboard)
    assert len(panels) >= 6
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p["title"] and p["type"] in {"timeseries", "stat", "gauge", "bargauge", "table"}, p.get("title")
        grid = p["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert METRIC.search(t["expr"]), f"{p['title']!r}: {t['expr']!r} names no blobfeed metric"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_graphs_the_key_signals(dashboard: dict[str, Any]) -> None:
    exprs = "\n".join(_queries(dashboard))
    assert "rate(blobfeed_fetched_samples_total" in exprs or "blobfeed_inputs_per_second" in exprs
    for needle in (
        "blobfeed_internal_queue_depth",
        "blobfeed_internal_queue_capacity",
        "blobfeed_device_queue_depth",
        "rate(blobfeed_dequeue_wait_seconds_bucket",
        "rate(blobfeed_fetch_errors_total",
        "rate(blobfeed_dequeue_timeouts_total",
        "rate(blobfeed_dropped_samples_total",
        # issue 19 item 10: what users look for
        "rate(blobfeed_model_run_seconds_bucket",
        "blobfeed_first_batch_seconds",
        "blobfeed_build_info",
    ):
        assert needle in exprs, f"the dashboard has no query with {needle}"
    # the input-stall ratio, one PromQL line: wait / (wait + the consumer's own time)
    assert any(
        "rate(blobfeed_dequeue_wait_seconds_sum" in e and "rate(blobfeed_consumer_busy_seconds_total" in e and " / " in e
        for e in _queries(dashboard)
    ), "the dashboard has no input-stall ratio"
    assert re.search(r"by \([^)]*\bkind\b", exprs), "fetch errors should be split by kind"


@EXPORTED
def test_every_metric_in_the_dashboard_is_exported(dashboard: dict[str, Any], exported: dict[str, str]) -> None:
    referenced = {name for expr in _queries(dashboard) for name in METRIC.findall(expr)}
    unknown = sorted(referenced - set(exported))
    assert not unknown, f"the dashboard queries series blobfeed does not export: {unknown}"


@EXPORTED
def test_rates_and_quantiles_fit_the_metric_types(dashboard: dict[str, Any], exported: dict[str, str]) -> None:
    for expr in _queries(dashboard):
        for name in re.findall(r"\b(?:rate|irate|increase)\((blobfeed_[a-z0-9_]+)", expr):
            assert exported.get(name) in {"counter", "histogram"}, f"rate over a {exported.get(name)}: {expr}"
        if "histogram_quantile" in expr:
            assert "_bucket" in expr and re.search(r"by \([^)]*\ble\b", expr), f"quantile needs le buckets: {expr}"
