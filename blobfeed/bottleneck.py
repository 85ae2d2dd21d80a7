"""The bottleneck verdict: where a pipeline's time goes and what limits it.

Nothing new is counted for it: every monitor tick (about once a second) the
coordinator takes a snapshot of what the :class:`~blobfeed.stats.MetricsHub`
already sums (each net's wait for input, its model time and its own time
between waits; the fetchers' time inside ``fetch_fun``; the time spent
assembling batches; bytes and samples fetched), the live queue's fill, and
the CPU time of each fetcher thread (read from ``/proc``, Linux only).  The
verdict of each (source, net) compares the oldest and the newest snapshot
of the last :data:`WINDOW_S` seconds, so it follows a change within seconds
and forgets the start.  docs/TUNING.md explains the stages and thresholds
for users.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    from .stats import MetricsHub, SourceTotals

__all__ = ["Bottleneck", "BottleneckTracker", "STAGES", "WINDOW_S", "judge"]

logger = logging.getLogger("blobfeed.bottleneck")

#: the verdict compares snapshots over the last this many seconds ...
WINDOW_S = 5.0
#: ... and says nothing until its snapshots span at least this long
MIN_WINDOW_S = 1.0
#: a net that waited for input and ran (its model, its own loop) for less
#: than this share of the window is "idle": too little to judge
NET_ACTIVE_MIN = 0.25
#: a net waiting for input at least this share of its time is input-bound;
#: below, the model (or the consumer's own loop) is the limit
WAIT_BOUND = 0.25
#: an internal queue this full on average (by chunks or by bytes) has its
#: workers waiting for room: they are not the limit
QUEUE_FULL = 0.8
#: fetchers inside ``fetch_fun`` at least this share of their time are the limit
FETCH_BUSY = 0.6
#: fetcher threads that together run on a CPU at least this share of what
#: one busy thread gets on this machine now are CPU-bound (below: they wait,
#: on I/O or a sleep)
CPU_HUNGRY = 0.5
#: ... and, two or more threads together using at most this many cores
#: while each is on a CPU less than GIL_CPU_RATIO of its time in
#: ``fetch_fun``, share one GIL
GIL_MAX_CORES = 1.2
GIL_CPU_RATIO = 0.75
#: snapshots are kept at least this far apart (the newest replaces the
#: last while closer): a monitor ticking every 10 ms keeps ~25, not 500
STEP_S = 0.2
#: queue fills kept per source (one per tick)
FILL_SAMPLES = 128
#: a new stage replaces the current one after this many ticks in a row
#: (a pipeline near a threshold does not flap, nor log at every tick)
CONFIRM_TICKS = 2

#: every stage a verdict can name, the most specific first
STAGES = ("gil", "fetch", "workers", "copy", "model", "idle")


@dataclass(frozen=True)
class Bottleneck:
    """What limits one net fed from one source, over the last ``window_s`` seconds.

    ``stage`` is one of :data:`STAGES`:

    * ``gil``: input-bound; the fetcher threads share one GIL (use
      ``backend="processes"``);
    * ``fetch``: input-bound; ``fetch_fun`` keeps its workers on a CPU (add
      workers, if there are cores for them);
    * ``workers``: input-bound; the workers wait inside ``fetch_fun`` (I/O, a
      sleep), each busy nearly all the time (add workers);
    * ``copy``: input-bound, yet the fetchers are not: moving the data
      (assembling batches, copies, transport) is the limit;
    * ``model``: the net hardly waits: its model, or the consumer's own loop
      between ``run()`` calls, is the limit (input is not);
    * ``idle``: too little happened in the window to judge (the net took no
      batch, or no fetcher is running).

    The shares are of the window's wall time: ``net_wait``, ``model`` and
    ``consumer`` of the net's time (wait + the rest); ``fetch_busy`` of the
    workers' time (inside ``fetch_fun``); ``fetch_cpu`` of the workers' time
    on a CPU (None where unknown: worker processes, Ray, non-Linux);
    ``assemble`` of the wall time spent assembling this net's batches;
    ``queue_fill`` the internal queue's mean fill (None if unknown).
    """

    source: str
    net: str
    stage: str
    advice: str
    window_s: float
    net_wait: float
    model: float
    consumer: float
    fetch_busy: float | None
    fetch_cpu: float | None
    assemble: float
    queue_fill: float | None
    workers: float
    samples_per_second: float
    bytes_per_second: float


@dataclass(frozen=True)
class _NetPoint:
    wait: float
    busy: float
    model: float
    enqueue: float


@dataclass(frozen=True)
class _Point:
    t: float
    fetch_s: float
    samples: int
    nbytes: int
    workers: int
    fill: float | None
    #: native thread id -> CPU seconds of each fetcher thread; None: unknown
    cpu: Mapping[int, float] | None
    nets: Mapping[str, _NetPoint]


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def judge(
    source: str, net: str, first: _Point, last: _Point, fills: list[float], *,
    threads: bool, fair_share: float,
) -> Bottleneck:
    """The verdict for one (source, net) between two snapshots.

    ``fills``: the queue fills sampled in between; ``threads``: the workers
    are threads of this process (the GIL applies); ``fair_share``: the share
    of a core one busy thread gets on this machine now (at most 1).
    """
    dt = last.t - first.t
    a, b = first.nets.get(net), last.nets[net]
    a = a or _NetPoint(0.0, 0.0, 0.0, 0.0)
    wait, busy = max(0.0, b.wait - a.wait), max(0.0, b.busy - a.busy)
    model, enqueue = max(0.0, b.model - a.model), max(0.0, b.enqueue - a.enqueue)
    active = wait + busy
    net_wait = wait / active if active > 0 else 0.0
    model_share = min(1.0, model / active) if active > 0 else 0.0
    consumer = max(0.0, 1.0 - net_wait - model_share) if active > 0 else 0.0
    workers = (first.workers + last.workers) / 2
    fetch_busy = max(0.0, last.fetch_s - first.fetch_s) / (workers * dt) if workers > 0 else None
    fetch_busy = None if fetch_busy is None else min(1.0, fetch_busy)
    cores: float | None = None
    if first.cpu is not None and last.cpu is not None:
        common = [tid for tid in last.cpu if tid in first.cpu]
        if common:
            cores = sum(max(0.0, last.cpu[tid] - first.cpu[tid]) for tid in common) / dt
    fetch_cpu = None if cores is None or workers <= 0 else min(1.0, cores / workers)
    fill = sum(fills) / len(fills) if fills else None
    assemble = min(1.0, enqueue / dt)
    bytes_per_second = max(0, last.nbytes - first.nbytes) / dt
    common_args = dict(
        source=source, net=net, window_s=dt, net_wait=net_wait, model=model_share, consumer=consumer,
        fetch_busy=fetch_busy, fetch_cpu=fetch_cpu, assemble=assemble, queue_fill=fill,
        workers=workers, samples_per_second=max(0, last.samples - first.samples) / dt,
        bytes_per_second=bytes_per_second,
    )

    def verdict(stage: str, advice: str) -> Bottleneck:
        return Bottleneck(stage=stage, advice=advice, **common_args)  # type: ignore[arg-type]

    if active < NET_ACTIVE_MIN * dt:
        return verdict("idle", f"the net waited or ran only {_pct(active / dt)} of the last {dt:.0f} s: "
                               "too little to judge (no run() calls, or one wait or model run longer than that)")
    if net_wait < WAIT_BOUND:
        if model_share >= consumer:
            return verdict("model", f"model-bound: input is not the limit (the net waits {_pct(net_wait)} of its "
                                    f"time, its model runs {_pct(model_share)}); a faster model would help")
        return verdict("model", f"consumer-bound: input is not the limit (the net waits {_pct(net_wait)} of its "
                                f"time; the consumer's own work between run() calls takes {_pct(consumer)})")
    waits = f"the net waits {_pct(net_wait)} of its time"
    if workers <= 0 or fetch_busy is None:
        return verdict("idle", f"input-bound ({waits}) but no fetcher is running: the source has ended "
                               "or its workers died")
    if fill is not None and fill >= QUEUE_FULL:
        return verdict("copy", f"copy-bound: {waits} while the internal queue is {_pct(fill)} full: moving "
                               "chunks into batches and on to the net is the limit, not the fetchers (assembling "
                               f"takes {_pct(assemble)} of the time, "
                               f"{bytes_per_second / 1e6:.0f} MB/s fetched); larger chunks and "
                               "batches, or a batch size that is a multiple of the chunk size, move less per sample")
    if fetch_busy >= FETCH_BUSY:
        each = f"each of {workers:.0f} worker(s) is busy {_pct(fetch_busy)} of the time fetching"
        if cores is not None and cores >= CPU_HUNGRY * fair_share:
            if threads and workers >= 1.5 and cores <= GIL_MAX_CORES and (fetch_cpu or 0.0) < GIL_CPU_RATIO * fetch_busy:
                return verdict("gil", f"input-bound: the fetchers hold the GIL ({each} but on a CPU only "
                                      f"{_pct(fetch_cpu)}, {cores:.2f} cores together); use backend='processes'")
            hint = " (backend='processes' for Python code)" if threads else ""
            return verdict("fetch", f"input-bound: fetch CPU ({each}, on a CPU {_pct(fetch_cpu)}, {cores:.2f} "
                                    f"cores together); add workers{hint} if there are cores for them")
        cpu = "" if cores is None else f", on a CPU only {_pct(fetch_cpu)}"
        return verdict("workers", f"input-bound: too few workers ({each}{cpu}); add workers")
    return verdict("copy", f"copy-bound: {waits}, the workers spend only {_pct(fetch_busy)} of their time in "
                           f"fetch_fun and the queue has room ({_pct(fill)} full): handing chunks over (copies, "
                           "transport, deterministic turns) is the limit; larger chunks amortise it")


def fair_share() -> float:
    """The share of a core one busy thread gets on this machine now: the
    cores this process may use over the 1-minute load average, at most 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - no load average
        return 1.0
    return min(1.0, cores / max(1.0, load))


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


def thread_cpu(native_ids: Iterable[int]) -> dict[int, float] | None:
    """CPU seconds of each thread of this process by native id (from
    ``/proc/self/task``, to 1/CLK_TCK); None where /proc cannot tell
    (not Linux).  A thread that has ended is left out."""
    out: dict[int, float] = {}
    for tid in native_ids:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                text = f.read(4096)
        except FileNotFoundError:
            continue
        except OSError:
            return None
        try:
            fields = text[text.rindex(b")") + 2:].split()
            out[tid] = (int(fields[11]) + int(fields[12])) / _TICK
        except (ValueError, IndexError):
            return None
    return out


def fetcher_threads(groups: Iterable[object]) -> dict[str, list[int] | None]:
    """The native ids of the live fetcher threads of each source, from the
    coordinator's groups (those with a ``backend``: ``init_data_input_workers``'s);
    None for a source whose workers are not threads of this process (their
    CPU time is not ours to read)."""
    names: dict[str, str] = {}
    out: dict[str, list[int] | None] = {}
    for g in groups:
        backend = getattr(g, "backend", None)
        if backend is None:
            continue
        source = getattr(g, "name")
        if getattr(backend, "name", None) != "threads" or out.get(source, []) is None:
            out[source] = None
            continue
        out.setdefault(source, [])
        for wid in getattr(g, "worker_ids"):
            # the names blobfeed.feeders.backends.ThreadBackend gives its threads
            names[f"blobfeed-fetch-{source}-{wid}"] = source
    for t in threading.enumerate():
        owner = names.get(t.name)
        ids = None if owner is None else out.get(owner)
        if ids is not None and t.native_id is not None and t.is_alive():
            ids.append(t.native_id)
    return out


class BottleneckTracker:
    """Snapshots over a sliding window, a verdict per (source, net), and a
    log line when one changes.  ``observe`` is called by one thread (the
    coordinator's monitor); ``verdicts`` from any."""

    def __init__(self, hub: "MetricsHub", window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._hub = hub
        hub.verdicts = self.verdicts  # blobfeed_bottleneck_info
        self._points: dict[str, collections.deque[_Point]] = {}
        self._fills: dict[str, collections.deque[tuple[float, float]]] = {}
        #: id() of the live source each source's snapshots are of (a source
        #: stopped and started again between two ticks starts afresh)
        self._run: dict[str, int] = {}
        #: (source, net) -> the verdict in force; (source, net) -> (candidate stage, ticks seen)
        self._current: dict[tuple[str, str], Bottleneck] = {}
        self._pending: dict[tuple[str, str], tuple[str, int]] = {}
        self._lock = threading.Lock()

    def verdicts(self) -> tuple[Bottleneck, ...]:
        """The verdicts in force, sorted; none for a source stopped since."""
        with self._lock:
            current = sorted(self._current.items())
        return tuple(v for _, v in current if self._hub.is_live(v.source))

    def observe(
        self, now: float, totals: Mapping[str, "SourceTotals"], fetcher_threads: Mapping[str, list[int] | None],
        share: float | None = None,
    ) -> None:
        """Take a snapshot of every live source and judge each of its nets.

        ``fetcher_threads``: the native ids of each source's fetcher threads;
        None for a source whose workers are not threads of this process."""
        share = fair_share() if share is None else share
        verdicts: dict[tuple[str, str], Bottleneck] = {}
        threads_of = dict(fetcher_threads)
        for name, entry in totals.items():
            live = entry.live
            if live is None or self._run.get(name) != id(live):
                self._points.pop(name, None)
                self._fills.pop(name, None)
                self._run.pop(name, None)
                if live is None:
                    continue
                self._run[name] = id(live)
            tids = threads_of.get(name)
            cpu = None if tids is None else thread_cpu(tids)
            try:
                cap, depth = live.queue_capacity(), live.queue_depth()
                fill: float | None = depth / cap if cap > 0 else None
                workers = live.workers_alive()
            except Exception:  # a source stopping under us: judge it next tick, if it is still there
                logger.debug("reading source %r for the bottleneck verdict failed", name, exc_info=True)
                continue
            nets = {
                net: _NetPoint(c.wait.total, c.busy, c.model.total, a.enqueue.total)
                for net, ((a, c), _) in entry.feeds.items()
            }
            f = entry.fetch
            point = _Point(now, f.fetch.total, f.samples, f.bytes, workers, fill, cpu, nets)
            pts = self._points.setdefault(name, collections.deque())
            fills = self._fills.setdefault(name, collections.deque(maxlen=FILL_SAMPLES))
            if len(pts) >= 2 and now - pts[-2].t < STEP_S:
                pts[-1] = point
            else:
                pts.append(point)
            if fill is not None:
                fills.append((now, fill))
            while len(pts) > 2 and now - pts[1].t >= self.window_s:
                pts.popleft()
            while fills and now - fills[0][0] > self.window_s:
                fills.popleft()
            first = pts[0]
            if now - first.t < MIN_WINDOW_S:
                continue
            window_fills = [v for t, v in fills if t >= first.t]
            for net in nets:
                verdicts[(name, net)] = judge(
                    name, net, first, point, window_fills, threads=tids is not None, fair_share=share,
                )
        self._settle(verdicts)

    def _settle(self, verdicts: dict[tuple[str, str], Bottleneck]) -> None:
        changes: list[tuple[str | None, Bottleneck]] = []
        with self._lock:
            for key in [k for k in self._current if k not in verdicts]:
                del self._current[key]
                self._pending.pop(key, None)
            for key, v in verdicts.items():
                old = self._current.get(key)
                if old is None or old.stage == v.stage:
                    self._pending.pop(key, None)
                    self._current[key] = v
                    if old is None:
                        changes.append((None, v))
                    continue
                stage, seen = self._pending.get(key, (v.stage, 0))
                seen = seen + 1 if stage == v.stage else 1
                if seen >= CONFIRM_TICKS:
                    self._pending.pop(key, None)
                    self._current[key] = v
                    changes.append((old.stage, v))
                else:
                    # the verdict in force stands until the new stage is confirmed
                    self._pending[key] = (v.stage, seen)
        for was, v in changes:
            logger.info(
                "bottleneck of source %r, net %r: %s%s: %s", v.source, v.net, v.stage,
                "" if was is None else f" (was {was})", v.advice,
            )

    def forget(self) -> None:
        """Drop every snapshot and verdict: in a child made by ``os.fork()``
        (a parent thread may have held the lock)."""
        self._lock = threading.Lock()
        self._current.clear()
        self._pending.clear()
        self._points.clear()
        self._fills.clear()
        self._run.clear()

