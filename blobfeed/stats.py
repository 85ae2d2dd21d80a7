"""Counting, by single writers, summed on demand: the accountant of a pipeline.

The hot path never touches a prometheus-client object.  Every thread that
counts something owns a small stats object (:class:`FetchStats` for a
fetcher, :class:`AssembleStats` for whoever assembles batches,
:class:`ConsumeStats` for a net's consumer) and is its only writer, so plain
integer increments are safe without a lock.  :class:`MetricsHub` registers
them, folds the stats of threads that have ended into per-source totals (so
counters never go back and stopped pipelines leave no objects behind), and
sums everything under its lock when asked; ``blobfeed.metrics`` turns those
sums into Prometheus metrics at scrape time.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

__all__ = [
    "AssembleStats", "ConsumeStats", "DEFAULT_BUCKETS", "DROP_REASONS", "FETCH_ERROR_KINDS",
    "FetchStats", "Hist", "LiveSource", "MetricsHub", "RATE_WINDOW_S", "SourceTotals",
]


class LiveSource(Protocol):
    """What the hub reads of a running source at scrape time (an ``InputSource``)."""

    name: str
    stopped: bool
    error: BaseException | None

    @property
    def finished(self) -> bool: ...
    def queue_depth(self) -> int: ...
    def queue_capacity(self) -> int: ...
    def queue_bytes(self) -> int: ...
    def workers_alive(self) -> int: ...
    def buffered_samples(self) -> int: ...
    def device_queue_depths(self) -> list[tuple[str, int]]: ...


FETCH_ERROR_KINDS = ("exception", "invalid", "none", "empty")
#: ``blobfeed_inputs_per_second`` is the rate over this many seconds.
RATE_WINDOW_S = 3.0
#: Reasons a sample that a fetcher returned may not reach a net.
DROP_REASONS = ("drop_last", "stopped", "error", "resume", "equal")

_INF = float("inf")
DEFAULT_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, _INF,
)



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
    """Counts of one worker; the thread that runs it (or receives from it) is
    the only writer."""

    __slots__ = (
        "chunks", "samples", "bytes", "fetch", "errors", "skipped_samples", "dropped",
        "deaths", "transport_bytes",
    )

    def __init__(self, backend: str | None = "threads") -> None:
        self.chunks = 0
        self.samples = 0
        self.bytes = 0
        self.fetch = Hist()
        self.errors = dict.fromkeys(FETCH_ERROR_KINDS, 0)
        #: samples in chunks rejected as malformed and skipped (on_error="skip")
        self.skipped_samples = 0
        #: accepted samples that could not be queued because the source ended
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        #: by backend: workers that died other than by returning
        self.deaths: dict[str, int] = {} if backend is None else {backend: 0}
        #: by backend: bytes moved from workers into this process
        self.transport_bytes: dict[str, int] = {} if backend is None else {backend: 0}

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
        for k, v in o.deaths.items():
            self.deaths[k] = self.deaths.get(k, 0) + v
        for k, v in o.transport_bytes.items():
            self.transport_bytes[k] = self.transport_bytes.get(k, 0) + v


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

    __slots__ = ("batches", "samples", "wait", "timeouts", "busy", "last_end", "model", "first_batch")

    def __init__(self) -> None:
        self.batches = 0
        self.samples = 0
        self.wait = Hist()
        self.timeouts = 0
        #: seconds the consumer spent between two waits for this source's
        #: batches (its own work, the model's run included): with ``wait``,
        #: the input-stall ratio is wait / (wait + busy)
        self.busy = 0.0
        #: ``perf_counter()`` when the last wait ended; 0.0 before the first
        self.last_end = 0.0
        #: seconds the net's model ran on batches of this source
        self.model = Hist()
        #: seconds from ``start()`` (or the first ``run()``, if later) to the
        #: first batch; None until then
        self.first_batch: float | None = None

    def add(self, o: "ConsumeStats") -> None:
        self.batches += o.batches
        self.samples += o.samples
        self.wait.add(o.wait)
        self.timeouts += o.timeouts
        self.busy += o.busy
        self.model.add(o.model)
        if o.first_batch is not None:
            # folded in order, retired runs first: the latest run's stands
            self.first_batch = o.first_batch


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
    fetch_retired: FetchStats = field(default_factory=lambda: FetchStats(None))
    feeds: dict[str, _FeedEntry] = field(default_factory=dict)
    #: samples discarded from queues when the source stopped or failed
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    inputs_per_second: float = 0.0
    #: (monotonic time, samples fetched) over the last RATE_WINDOW_S
    rate_points: "collections.deque[tuple[float, int]]" = field(default_factory=collections.deque)
    live: "LiveSource | None" = None

    def fetch_totals(self) -> FetchStats:
        t = FetchStats(None)
        t.add(self.fetch_retired)
        for s in list(self.fetch):
            t.add(s)
        return t


@dataclass
class SourceTotals:
    fetch: FetchStats
    feeds: dict[str, tuple[tuple[AssembleStats, ConsumeStats], int]]
    dropped: dict[str, int]
    inputs_per_second: float
    live: "LiveSource | None"


class MetricsHub:
    """Every counter of one :class:`~blobfeed.GlobalCoordinator`, by source.

    Thread-safe: registration and retirement take a lock; the counting itself
    happens in single-writer stats objects.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, _SourceEntry] = {}
        #: the bottleneck verdicts in force (objects with ``source``, ``net``
        #: and ``stage``), for ``blobfeed_bottleneck_info``; the coordinator
        #: that judges them sets it
        self.verdicts: Callable[[], Iterable[Any]] = tuple

    def _entry(self, source: str) -> _SourceEntry:
        entry = self._sources.get(source)
        if entry is None:
            entry = self._sources[source] = _SourceEntry()
        return entry

    def attach_source(self, source: LiveSource) -> None:
        with self._lock:
            entry = self._entry(source.name)
            entry.live = source
            entry.rate_points.clear()
            entry.rate_points.append((time.monotonic(), entry.fetch_totals().samples))

    def detach_source(self, source: LiveSource) -> None:
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

    def source_ended(self, source: str) -> None:
        """``source`` stopped or failed: nothing more comes, say so now
        (the monitor may not tick again)."""
        with self._lock:
            entry = self._entry(source)
            entry.inputs_per_second = 0.0
            entry.rate_points.clear()

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

    def fetch_stats(self, source: str, backend: str = "threads") -> FetchStats:
        s = FetchStats(backend)
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

    def is_live(self, source: str) -> bool:
        """Whether a running source of this name is attached."""
        with self._lock:
            entry = self._sources.get(source)
            return entry is not None and entry.live is not None

    def inputs_per_second(self, source: str) -> float:
        with self._lock:
            return self._entry(source).inputs_per_second

    def fetch_totals(self, source: str) -> FetchStats:
        with self._lock:
            return self._entry(source).fetch_totals()

    def totals(self) -> dict[str, "SourceTotals"]:
        """Every counter, summed under the lock: a scrape sees a stats object
        either live or retired, never neither (counters never go back)."""
        with self._lock:
            out = {}
            for name, entry in self._sources.items():
                feeds = {net: (fe.totals(), fe.direct_batches()) for net, fe in entry.feeds.items()}
                out[name] = SourceTotals(
                    entry.fetch_totals(), feeds, dict(entry.dropped), entry.inputs_per_second, entry.live
                )
            return out
