"""Prometheus metrics, the ``/metrics`` HTTP endpoint and external loggers.

Nothing here is on the hot path: the counting happens in the single-writer
stats objects of :mod:`blobfeed.stats`; a custom collector reads the hub's
sums and the live queues' depths at scrape time.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import platform
import sys
from typing import Any, Iterator, Protocol, runtime_checkable

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .endpoint import MetricsServer, start_http_server
from .stats import DEFAULT_BUCKETS, FETCH_ERROR_KINDS, Hist, MetricsHub, SourceTotals

__all__ = [
    "ExternalLogger",
    "MetricsServer",
    "register_collector",
    "start_http_server",
]

logger = logging.getLogger("blobfeed.metrics")

@runtime_checkable
class ExternalLogger(Protocol):
    """What ``external_loggers`` must provide: ``log(metrics)``.

    ``metrics`` holds Caffe2's keys: ``inputs_per_sec``, ``queue_size``,
    ``time_elapsed``, ``fetcher_time``, ``fetcher_time_count``,
    ``enqueue_time``, ``enqueue_time_count``, plus ``source``.
    """

    def log(self, metrics: dict[str, Any]) -> None: ...


def register_collector(registry: CollectorRegistry, hub: MetricsHub) -> None:
    """Export ``hub``'s counters and its live sources' gauges from ``registry``.

    Raises:
        ValueError: the registry already exports blobfeed metrics.
    """
    try:
        registry.register(_Collector(hub))
    except ValueError as exc:
        raise ValueError(
            "this registry already holds blobfeed metrics (another "
            "GlobalCoordinator uses it); give each coordinator its own registry"
        ) from exc


_INF = float("inf")


@functools.lru_cache(maxsize=1)
def _build_labels() -> tuple[str, str, str]:
    """blobfeed's, Python's and onnxruntime's versions (read once: they do
    not change while the process runs)."""
    # the package's own __version__ (this module may not import its package:
    # tests/test_layers.py), which is loaded by the time anything scrapes
    version = getattr(sys.modules.get("blobfeed"), "__version__", None) or _dist_version("blobfeed")
    return version, platform.python_version(), _dist_version("onnxruntime", "onnxruntime-gpu")


def _dist_version(*dists: str) -> str:
    """The installed version of the first of ``dists`` found, else ``none``."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def _hist_buckets(h: Hist) -> list[tuple[str, float]]:
    out, acc = [], 0
    for bound, c in zip(DEFAULT_BUCKETS, h.counts):
        acc += c
        out.append(("+Inf" if bound == _INF else repr(float(bound)), float(acc)))
    return out


class _Collector:
    """Reads every blobfeed metric at scrape time."""

    def __init__(self, hub: MetricsHub) -> None:
        self._hub = hub

    def describe(self) -> list[Metric]:
        # Describing with no samples lets the registry catch duplicate names
        # at registration without walking live state.
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        return self._families(self._hub.totals())

    def _families(self, sources: dict[str, SourceTotals] | None = None) -> Iterator[Metric]:
        S, SN = ["source"], ["source", "net"]
        chunks = CounterMetricFamily("blobfeed_fetched_chunks", "Chunks accepted from fetchers.", labels=S)
        samples = CounterMetricFamily("blobfeed_fetched_samples", "Samples accepted from fetchers.", labels=S)
        nbytes = CounterMetricFamily("blobfeed_fetched_bytes", "Bytes accepted from fetchers.", labels=S)
        fetch_s = HistogramMetricFamily("blobfeed_fetch_seconds", "Time inside fetch_fun.", labels=S)
        errors = CounterMetricFamily(
            "blobfeed_fetch_errors",
            "Chunks not accepted from fetchers, by kind (exception, invalid, none, empty).",
            labels=["source", "kind"],
        )
        batches = CounterMetricFamily(
            "blobfeed_batches", "Batches assembled for a net (put on its device queue or taken by it).", labels=SN
        )
        direct = CounterMetricFamily(
            "blobfeed_consumer_assembled_batches",
            "Of blobfeed_batches_total: assembled by the net's own thread, which found its device queue empty.",
            labels=SN,
        )
        enqueue_s = HistogramMetricFamily(
            "blobfeed_enqueue_seconds", "Time to assemble and place one batch.", labels=SN
        )
        iq_depth = GaugeMetricFamily("blobfeed_internal_queue_depth", "Chunks waiting in the internal queue.", labels=S)
        iq_cap = GaugeMetricFamily("blobfeed_internal_queue_capacity", "Bound of the internal queue, in chunks.", labels=S)
        iq_bytes = GaugeMetricFamily(
            "blobfeed_internal_queue_bytes",
            "Bytes of the chunks waiting in the internal queue (max_buffered_bytes bounds them).", labels=S,
        )
        iq_limit = GaugeMetricFamily(
            "blobfeed_internal_queue_limit_bytes",
            "Bound of the internal queue in bytes in force now: max_buffered_bytes, or with "
            "max_buffered_bytes='auto' the working limit under it that follows need.", labels=S,
        )
        dq_depth = GaugeMetricFamily("blobfeed_device_queue_depth", "Batches waiting for the net.", labels=SN)
        wait_s = HistogramMetricFamily(
            "blobfeed_dequeue_wait_seconds", "Time Net.run() waited for input.", labels=SN
        )
        timeouts = CounterMetricFamily("blobfeed_dequeue_timeouts", "DequeueTimeouts raised.", labels=SN)
        alive = GaugeMetricFamily("blobfeed_workers_alive", "Fetcher threads running.", labels=S)
        workers = GaugeMetricFamily(
            "blobfeed_workers",
            "Workers the source runs on now: its wiring's count, or the last set_num_workers' "
            "(num_worker_threads='auto': the tuner's choice).",
            labels=S,
        )
        ips = GaugeMetricFamily(
            "blobfeed_inputs_per_second",
            "Samples/s fetched over the last few seconds (Caffe2's inputs_per_sec, as a gauge).",
            labels=S,
        )
        build = GaugeMetricFamily(
            "blobfeed_build_info", "Always 1; the labels say which blobfeed, Python and onnxruntime run.",
            labels=["version", "python", "onnxruntime"],
        )
        first = GaugeMetricFamily(
            "blobfeed_first_batch_seconds",
            "Seconds from start() (or the net's first run(), if later) to its first batch from the source.",
            labels=SN,
        )
        busy = CounterMetricFamily(
            "blobfeed_consumer_busy_seconds",
            "Seconds the consumer spent between its waits for this source's batches (its own work and the "
            "model's run): input-stall ratio = wait / (wait + busy).",
            labels=SN,
        )
        model_s = HistogramMetricFamily(
            "blobfeed_model_run_seconds", "Time the net's model ran on a batch (Net.run with a model).", labels=SN
        )
        delivered = CounterMetricFamily(
            "blobfeed_delivered_samples", "Samples returned by Net.run().", labels=SN
        )
        dropped = CounterMetricFamily(
            "blobfeed_dropped_samples",
            "Accepted samples that no net received, by reason (drop_last, stopped, error, resume).",
            labels=["source", "reason"],
        )
        skipped = CounterMetricFamily(
            "blobfeed_skipped_samples",
            "Samples in malformed chunks dropped with on_error='skip' (never accepted).",
            labels=S,
        )
        deaths = CounterMetricFamily(
            "blobfeed_worker_deaths",
            "Workers that died other than by returning (killed, crashed, node lost).",
            labels=["source", "backend"],
        )
        transport = CounterMetricFamily(
            "blobfeed_transport_bytes",
            "Bytes moved from workers into this process.",
            labels=["source", "backend"],
        )
        buffered = GaugeMetricFamily(
            "blobfeed_buffered_samples",
            "Accepted samples inside blobfeed now: internal queue, re-batching, device queues.",
            labels=S,
        )
        bottleneck = GaugeMetricFamily(
            "blobfeed_bottleneck_info",
            "Always 1: the stage that limits this net fed from this source now (gil, fetch, workers, copy, "
            "model, idle), judged over the last few seconds (docs/TUNING.md).",
            labels=["source", "net", "stage"],
        )
        for name, entry in sorted((sources or {}).items()):
            f = entry.fetch
            chunks.add_metric([name], f.chunks)
            samples.add_metric([name], f.samples)
            nbytes.add_metric([name], f.bytes)
            fetch_s.add_metric([name], _hist_buckets(f.fetch), f.fetch.total)
            for kind in FETCH_ERROR_KINDS:
                errors.add_metric([name, kind], f.errors[kind])
            skipped.add_metric([name], f.skipped_samples)
            for bk, v in sorted(f.deaths.items()):
                deaths.add_metric([name, bk], v)
            for bk, v in sorted(f.transport_bytes.items()):
                transport.add_metric([name, bk], v)
            drops = dict(entry.dropped)
            for k, v in f.dropped.items():
                drops[k] += v
            for net, ((a, c), n_direct) in sorted(entry.feeds.items()):
                batches.add_metric([name, net], a.batches)
                direct.add_metric([name, net], n_direct)
                enqueue_s.add_metric([name, net], _hist_buckets(a.enqueue), a.enqueue.total)
                wait_s.add_metric([name, net], _hist_buckets(c.wait), c.wait.total)
                busy.add_metric([name, net], c.busy)
                model_s.add_metric([name, net], _hist_buckets(c.model), c.model.total)
                if c.first_batch is not None:
                    first.add_metric([name, net], c.first_batch)
                timeouts.add_metric([name, net], c.timeouts)
                delivered.add_metric([name, net], c.samples)
                for k, v in a.dropped.items():
                    drops[k] += v
            for k, v in drops.items():
                dropped.add_metric([name, k], v)
            ips.add_metric([name], entry.inputs_per_second)
            live = entry.live
            if live is not None:
                iq_depth.add_metric([name], live.queue_depth())
                iq_cap.add_metric([name], live.queue_capacity())
                iq_bytes.add_metric([name], live.queue_bytes())
                limit_of = getattr(live, "queue_byte_limit", None)
                limit = limit_of() if limit_of is not None else None
                if limit is not None:
                    iq_limit.add_metric([name], limit)
                alive.add_metric([name], live.workers_alive())
                count = getattr(live, "worker_count", None)
                if count is not None:
                    workers.add_metric([name], count)
                buffered.add_metric([name], live.buffered_samples())
                depths: dict[str, int] = {}
                for net, depth in live.device_queue_depths():
                    # nets that share a name share the label: sum them
                    depths[net] = depths.get(net, 0) + depth
                for net, depth in sorted(depths.items()):
                    dq_depth.add_metric([name, net], depth)
            else:
                alive.add_metric([name], 0)
                buffered.add_metric([name], 0)
        if sources is not None:  # a scrape (describe() wants no samples)
            build.add_metric(list(_build_labels()), 1)
            for v in self._hub.verdicts():
                bottleneck.add_metric([v.source, v.net, v.stage], 1)
        yield from (
            chunks, samples, nbytes, fetch_s, errors, batches, direct, enqueue_s, iq_depth, iq_cap, iq_bytes, iq_limit,
            dq_depth, wait_s, timeouts, alive, workers, ips, delivered, dropped, skipped, buffered, deaths, transport,
            build, first, busy, model_s, bottleneck,
        )
