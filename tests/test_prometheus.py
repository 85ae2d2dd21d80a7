"""A real Prometheus server scrapes a running pipeline's /metrics.

Needs the ``prometheus`` binary (Debian: ``apt-get install prometheus``,
which ``.ci/run`` does).  Without it the tests skip locally and fail in CI
(``CI=true``), where they must run.  Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import blobfeed
from blobfeed.metrics import start_http_server

#: one test process takes both tests (``--dist loadgroup``): the module's
#: server (most of its 5-6 s is Prometheus's target discovery, which hands
#: a new target on after 5 s) is then started once, not once in each process
pytestmark = [pytest.mark.prometheus, pytest.mark.xdist_group("prometheus")]

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana_dashboard.json"
#: Upper bound for Prometheus to start, scrape and answer (it takes a few seconds).
DEADLINE = 60.0
WAIT = 5.0


def _prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        reason = "the prometheus server binary is not on PATH (Debian: apt-get install prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; in CI it must be installed (.ci/run does it)")
        pytest.skip(reason)
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Setup:
    api: str  # http://127.0.0.1:PORT/api/v1
    metrics_port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def query(self, promql: str) -> dict[str, Any] | None:
        """One instant query; None while Prometheus is not answering yet."""
        url = f"{self.api}/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=WAIT) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 400 for bad PromQL: the body says why
            return json.loads(exc.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    def diagnostics(self) -> str:
        try:
            with urllib.request.urlopen(f"{self.api}/targets", timeout=WAIT) as resp:
                targets = resp.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            targets = f"(targets unavailable: {exc})"
        log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        return f"exit code: {self.proc.poll()}\ntargets: {targets}\nprometheus log tail:\n{log}"

    def poll(self, promql: str, accept: Any, what: str) -> dict[str, Any]:
        """Repeat ``promql`` until ``accept(result)``; fails after DEADLINE with diagnostics."""
        deadline = time.monotonic() + DEADLINE
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited early\n{self.diagnostics()}")
            last = self.query(promql)
            if last is not None and last.get("status") == "success" and accept(last["data"]["result"]):
                return last
            time.sleep(0.25)  # polling an HTTP API, bounded by the deadline
        pytest.fail(f"no {what} within {DEADLINE:.0f} s; last answer: {last}\n{self.diagnostics()}")


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """A pipeline that keeps running, its /metrics endpoint, and Prometheus scraping it every 250 ms (the
    first scrape still waits for Prometheus's target discovery, which hands targets on every 5 s; the
    second follows a quarter of a second later, not a second)."""
    binary = _prometheus_binary()
    tmp = tmp_path_factory.mktemp("prometheus")
    coordinator = blobfeed.GlobalCoordinator(log_interval=0.5)
    net = blobfeed.Net(name="scraped")

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        return [np.ones((batch_size // 2 + 1, 4), np.float32)]

    blobfeed.init_data_input_workers(
        net, ["x"], fetch, batch_size=32, num_worker_threads=2, input_source_name="train",
        timeout=WAIT, coordinator=coordinator,
    )
    done = threading.Event()
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            while not done.is_set():
                net.run()
                done.wait(0.002)  # pace the consumer; Prometheus shares the CPUs
        except blobfeed.EndOfInput:
            pass  # stop() closes the source
        except BaseException as exc:
            errors.append(exc)

    server = start_http_server(0, addr="127.0.0.1", registry=coordinator.registry)
    consumer = threading.Thread(target=consume, name="test-prometheus-consumer", daemon=True)
    proc = None
    try:
        coordinator.start()
        consumer.start()
        web_port = _free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n"
            "  scrape_interval: 250ms\n"
            "  evaluation_interval: 250ms\n"
            "scrape_configs:\n"
            "  - job_name: blobfeed\n"
            "    static_configs:\n"
            f"      - targets: ['127.0.0.1:{server.port}']\n"
        )
        log = tmp / "prometheus.log"
        with log.open("wb") as log_file:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{web_port}",
                ],
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp,
            )
        yield Setup(f"http://127.0.0.1:{web_port}/api/v1", server.port, proc, log)
        assert not errors, f"the consumer failed: {errors[0]!r}"
    finally:
        if proc is not None:
            proc.kill()
            try:
                proc.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                pass  # reported below by the assert, never a hang
        done.set()
        stopped = coordinator.stop(timeout=WAIT)
        consumer.join(WAIT)
        server.close()
        assert proc is None or proc.returncode is not None, "prometheus did not exit after kill"
        assert stopped and not consumer.is_alive(), "the pipeline did not stop"


def test_prometheus_scrapes_blobfeed_batches_total(scraped: Setup) -> None:
    answer = scraped.poll(
        'blobfeed_batches_total{source="train", net="scraped"}',
        lambda result: any(float(r["value"][1]) > 0 for r in result),
        "blobfeed_batches_total > 0",
    )
    (series,) = answer["data"]["result"]
    assert series["metric"]["job"] == "blobfeed"
    assert series["metric"]["instance"] == f"127.0.0.1:{scraped.metrics_port}"
    assert float(series["value"][1]) > 0


def test_every_dashboard_query_is_valid_promql_with_data(scraped: Setup) -> None:
    # Two scrapes at least, so rate() has two points to work with.
    scraped.poll(
        'count_over_time(blobfeed_batches_total{net="scraped"}[1m])',
        lambda result: any(float(r["value"][1]) >= 2 for r in result),
        "two scrapes",
    )
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = [q for p in dashboard["panels"] for q in ([p] if p.get("type") != "row" else p.get("panels", []))]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert exprs
    for expr in exprs:
        promql = expr.replace("$source", ".*")  # what Grafana sends with "All" selected
        answer = scraped.query(promql)
        assert answer is not None and answer["status"] == "success", f"{promql}: {answer}"
        assert answer["data"]["result"], f"no series for the dashboard query {promql}"
