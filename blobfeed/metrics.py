"""Prometheus metrics, the ``/metrics`` HTTP endpoint and external loggers.

Design: the hot path never touches a prometheus-client object.  Every thread
that counts something owns a small stats object (:class:`FetchStats` for a
fetcher, :class:`AssembleStats` for whoever assembles batches,
:class:`ConsumeStats` for a net's consumer) and is its only writer, so plain
integer increments are safe without a lock.  A custom collector sums them at
scrape time, together with gauges read off the live queues.  Stats of threads
that have ended are folded into per-source totals so counters never go back
and stopped pipelines leave no objects behind.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from .feeders import InputSource

__all__ = [
    "ExternalLogger",
    "MetricsServer",
    "start_http_server",
]

logger = logging.getLogger("blobfeed.metrics")

FETCH_ERROR_KINDS = ("exception", "invalid", "none", "empty")
#: ``blobfeed_inputs_per_second`` is the rate over this many seconds.
RATE_WINDOW_S = 3.0
#: Reasons a sample that a fetcher returned may not reach a net.
DROP_REASONS = ("drop_last", "stopped", "error")

_INF = float("inf")
DEFAULT_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, _INF,
)


@runtime_checkable
class ExternalLogger(Protocol):
    """What ``external_loggers`` must provide: ``log(metrics)``.

    ``metrics`` holds Caffe2's keys: ``inputs_per_sec``, ``queue_size``,
    ``time_elapsed``, ``fetcher_time``, ``fetcher_time_count``,
    ``enqueue_time``, ``enqueue_time_count``, plus ``source``.
    """

    def log(self, metrics: dict[str, Any]) -> None: ...


class Hist:
    """A fixed-bucket histogram with a single writer (no lock)."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * len(DEFAULT_BUCKETS)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(DEFAULT_BUCKETS, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def add(self, other: "Hist") -> None:
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.total += other.total


class FetchStats:
    """Counts of one fetcher thread; that thread is the only writer."""

    __slots__ = ("chunks", "samples", "bytes", "fetch", "errors", "skipped_samples", "dropped")

    def __init__(self) -> None:
        self.chunks = 0
        self.samples = 0
        self.bytes = 0
        self.fetch = Hist()
        self.errors = dict.fromkeys(FETCH_ERROR_KINDS, 0)
        #: samples in chunks rejected as malformed and skipped (on_error="skip")
        self.skipped_samples = 0
        #: accepted samples that could not be queued because the source ended
        self.dropped = dict.fromkeys(DROP_REASONS, 0)

    def add(self, o: "FetchStats") -> None:
        self.chunks += o.chunks
        self.samples += o.samples
        self.bytes += o.bytes
        self.fetch.add(o.fetch)
        for k, v in o.errors.items():
            self.errors[k] += v
        self.skipped_samples += o.skipped_samples
        for k, v in o.dropped.items():
            self.dropped[k] += v


class AssembleStats:
    """Batches assembled for one (source, net) by one thread."""

    __slots__ = ("batches", "samples", "enqueue", "dropped")

    def __init__(self) -> None:
        self.batches = 0
        self.samples = 0
        self.enqueue = Hist()
        self.dropped = dict.fromkeys(DROP_REASONS, 0)

    def add(self, o: "AssembleStats") -> None:
        self.batches += o.batches
        self.samples += o.samples
        self.enqueue.add(o.enqueue)
        for k, v in o.dropped.items():
            self.dropped[k] += v


class ConsumeStats:
    """What one net's ``run()`` took from one source (the consumer thread writes)."""

    __slots__ = ("batches", "samples", "wait", "timeouts")

    def __init__(self) -> None:
        self.batches = 0
        self.samples = 0
        self.wait = Hist()
        self.timeouts = 0

    def add(self, o: "ConsumeStats") -> None:
        self.batches += o.batches
        self.samples += o.samples
        self.wait.add(o.wait)
        self.timeouts += o.timeouts


@dataclass
class _FeedEntry:
    assemble: list[AssembleStats] = field(default_factory=list)
    #: the subset of ``assemble`` written by the net's own thread
    direct: list[AssembleStats] = field(default_factory=list)
    direct_retired: int = 0
    consume: list[ConsumeStats] = field(default_factory=list)
    assemble_retired: AssembleStats = field(default_factory=AssembleStats)
    consume_retired: ConsumeStats = field(default_factory=ConsumeStats)

    def direct_batches(self) -> int:
        return self.direct_retired + sum(s.batches for s in list(self.direct))

    def totals(self) -> tuple[AssembleStats, ConsumeStats]:
        a, c = AssembleStats(), ConsumeStats()
        a.add(self.assemble_retired)
        c.add(self.consume_retired)
        for s in list(self.assemble):
            a.add(s)
        for s2 in list(self.consume):
            c.add(s2)
        return a, c


@dataclass
class _SourceEntry:
    fetch: list[FetchStats] = field(default_factory=list)
    fetch_retired: FetchStats = field(default_factory=FetchStats)
    feeds: dict[str, _FeedEntry] = field(default_factory=dict)
    #: samples discarded from queues when the source stopped or failed
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    inputs_per_second: float = 0.0
    #: (monotonic time, samples fetched) over the last RATE_WINDOW_S
    rate_points: "collections.deque[tuple[float, int]]" = field(default_factory=collections.deque)
    live: "InputSource | None" = None

    def fetch_totals(self) -> FetchStats:
        t = FetchStats()
        t.add(self.fetch_retired)
        for s in list(self.fetch):
            t.add(s)
        return t


@dataclass
class _SourceTotals:
    fetch: FetchStats
    feeds: dict[str, tuple[tuple[AssembleStats, ConsumeStats], int]]
    dropped: dict[str, int]
    inputs_per_second: float
    live: "InputSource | None"


class MetricsHub:
    """Every counter of one :class:`~blobfeed.GlobalCoordinator`, by source.

    Thread-safe: registration and retirement take a lock; the counting itself
    happens in single-writer stats objects.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, _SourceEntry] = {}
        try:
            registry.register(_Collector(self))
        except ValueError as exc:
            raise ValueError(
                "this registry already holds blobfeed metrics (another "
                "GlobalCoordinator uses it); give each coordinator its own registry"
            ) from exc

    def _entry(self, source: str) -> _SourceEntry:
        entry = self._sources.get(source)
        if entry is None:
            entry = self._sources[source] = _SourceEntry()
        return entry

    def attach_source(self, source: "InputSource") -> None:
        with self._lock:
            entry = self._entry(source.name)
            entry.live = source
            entry.rate_points.clear()
            entry.rate_points.append((time.monotonic(), entry.fetch_totals().samples))

    def detach_source(self, source: "InputSource") -> None:
        with self._lock:
            entry = self._entry(source.name)
            if entry.live is source:
                entry.live = None
                entry.inputs_per_second = 0.0
                entry.rate_points.clear()

    def update_rates(self, now: float) -> None:
        """Recompute ``inputs_per_second`` of every live source: samples
        fetched over the last :data:`RATE_WINDOW_S` (less right after the
        start), so a dashboard sees a change, a stall or an end within
        seconds.  Called about once a second by the monitor thread."""
        with self._lock:
            for entry in self._sources.values():
                live = entry.live
                if live is None or live.finished or live.stopped or live.error is not None:
                    # no fetcher will add a sample: say so now, not a window later
                    entry.inputs_per_second = 0.0
                    continue
                samples = entry.fetch_totals().samples
                pts = entry.rate_points
                pts.append((now, samples))
                while len(pts) > 2 and now - pts[1][0] >= RATE_WINDOW_S:
                    pts.popleft()
                t0, s0 = pts[0]
                entry.inputs_per_second = (samples - s0) / (now - t0) if now > t0 else 0.0

    def reset_after_fork(self) -> None:
        """In a child made by ``os.fork()``: the parent's sources live on in
        the parent only; a parent thread may have held the lock."""
        self._lock = threading.Lock()
        for entry in self._sources.values():
            entry.live = None
            entry.inputs_per_second = 0.0
            entry.rate_points.clear()

    def count_dropped(self, source: str, reason: str, samples: int) -> None:
        with self._lock:
            self._entry(source).dropped[reason] += samples

    def fetch_stats(self, source: str) -> FetchStats:
        s = FetchStats()
        with self._lock:
            self._entry(source).fetch.append(s)
        return s

    def assemble_stats(self, source: str, net: str, *, direct: bool = False) -> AssembleStats:
        """Stats for one thread assembling batches; ``direct`` for the net's own thread."""
        s = AssembleStats()
        with self._lock:
            fe = self._entry(source).feeds.setdefault(net, _FeedEntry())
            fe.assemble.append(s)
            if direct:
                fe.direct.append(s)
        return s

    def consume_stats(self, source: str, net: str) -> ConsumeStats:
        s = ConsumeStats()
        with self._lock:
            self._entry(source).feeds.setdefault(net, _FeedEntry()).consume.append(s)
        return s

    def retire(self, source: str, stats: Iterable[object], net: str | None = None) -> None:
        """Fold stats whose writer thread has ended into the running totals."""
        with self._lock:
            entry = self._entry(source)
            for s in stats:
                if isinstance(s, FetchStats):
                    entry.fetch.remove(s)
                    entry.fetch_retired.add(s)
                elif isinstance(s, AssembleStats) and net is not None:
                    fe = entry.feeds[net]
                    fe.assemble.remove(s)
                    fe.assemble_retired.add(s)
                    if s in fe.direct:
                        fe.direct.remove(s)
                        fe.direct_retired += s.batches
                elif isinstance(s, ConsumeStats) and net is not None:
                    fe = entry.feeds[net]
                    fe.consume.remove(s)
                    fe.consume_retired.add(s)

    def inputs_per_second(self, source: str) -> float:
        with self._lock:
            return self._entry(source).inputs_per_second

    def fetch_totals(self, source: str) -> FetchStats:
        with self._lock:
            return self._entry(source).fetch_totals()

    def totals(self) -> dict[str, "_SourceTotals"]:
        """Every counter, summed under the lock: a scrape sees a stats object
        either live or retired, never neither (counters never go back)."""
        with self._lock:
            out = {}
            for name, entry in self._sources.items():
                feeds = {net: (fe.totals(), fe.direct_batches()) for net, fe in entry.feeds.items()}
                out[name] = _SourceTotals(
                    entry.fetch_totals(), feeds, dict(entry.dropped), entry.inputs_per_second, entry.live
                )
            return out


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

    def _families(self, sources: dict[str, _SourceTotals] | None = None) -> Iterator[Metric]:
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
        dq_depth = GaugeMetricFamily("blobfeed_device_queue_depth", "Batches waiting for the net.", labels=SN)
        wait_s = HistogramMetricFamily(
            "blobfeed_dequeue_wait_seconds", "Time Net.run() waited for input.", labels=SN
        )
        timeouts = CounterMetricFamily("blobfeed_dequeue_timeouts", "DequeueTimeouts raised.", labels=SN)
        alive = GaugeMetricFamily("blobfeed_workers_alive", "Fetcher threads running.", labels=S)
        ips = GaugeMetricFamily(
            "blobfeed_inputs_per_second", "Samples/s fetched over the last few seconds.", labels=S
        )
        delivered = CounterMetricFamily(
            "blobfeed_delivered_samples", "Samples returned by Net.run().", labels=SN
        )
        dropped = CounterMetricFamily(
            "blobfeed_dropped_samples",
            "Accepted samples that no net received, by reason (drop_last, stopped, error).",
            labels=["source", "reason"],
        )
        skipped = CounterMetricFamily(
            "blobfeed_skipped_samples",
            "Samples in malformed chunks dropped with on_error='skip' (never accepted).",
            labels=S,
        )
        buffered = GaugeMetricFamily(
            "blobfeed_buffered_samples",
            "Accepted samples inside blobfeed now: internal queue, re-batching, device queues.",
            labels=S,
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
            drops = dict(entry.dropped)
            for k, v in f.dropped.items():
                drops[k] += v
            for net, ((a, c), n_direct) in sorted(entry.feeds.items()):
                batches.add_metric([name, net], a.batches)
                direct.add_metric([name, net], n_direct)
                enqueue_s.add_metric([name, net], _hist_buckets(a.enqueue), a.enqueue.total)
                wait_s.add_metric([name, net], _hist_buckets(c.wait), c.wait.total)
                timeouts.add_metric([name, net], c.timeouts)
                delivered.add_metric([name, net], c.samples)
                for k, v in a.dropped.items():
                    drops[k] += v
            for k, v in drops.items():
                dropped.add_metric([name, k], v)
            ips.add_metric([name], entry.inputs_per_second)
            live = entry.live
            if live is not None:
                iq_depth.add_metric([name], live.queue.qsize())
                iq_cap.add_metric([name], live.queue.capacity)
                alive.add_metric([name], live.workers_alive())
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
        yield from (
            chunks, samples, nbytes, fetch_s, errors, batches, direct, enqueue_s, iq_depth, iq_cap,
            dq_depth, wait_s, timeouts, alive, ips, delivered, dropped, skipped, buffered,
        )


class MetricsServer:
    """A running ``/metrics`` endpoint; ``close()`` stops it.  Context manager."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self._closed = False
        self.port: int = httpd.server_address[1]
        self.addr: str = httpd.server_address[0]

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


#: How often the server loop looks for ``close()``.  socketserver's loop can
#: only poll; prometheus-client's 0.5 s made every close() take half a second.
_SHUTDOWN_POLL_S = 0.02


def start_http_server(
    port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> MetricsServer:
    """Serve the metrics at ``http://addr:port/metrics`` from a daemon thread.

    Args:
        port: TCP port; 0 picks a free one (read it back from ``.port``).
        addr: address to bind.  Loopback by default: name another address
            explicitly to expose the metrics beyond this machine.
        registry: what to serve; default the registry of
            ``blobfeed.global_coordinator`` (prometheus-client's default one).

    Returns:
        A :class:`MetricsServer` with ``port``, ``url`` and ``close()``.
    """
    from prometheus_client import make_wsgi_app

    if registry is None:
        from .coordinator import global_coordinator

        registry = global_coordinator.registry
    server_class = _ThreadingWSGIServer6 if ":" in addr else _ThreadingWSGIServer
    httpd = make_server(addr, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    thread = threading.Thread(
        target=httpd.serve_forever,
        kwargs={"poll_interval": _SHUTDOWN_POLL_S},
        name=f"blobfeed-metrics-http-{httpd.server_address[1]}",
        daemon=True,
    )
    thread.start()
    return MetricsServer(httpd, thread)
