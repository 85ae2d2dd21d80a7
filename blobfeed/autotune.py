"""``num_worker_threads="auto"``: the pipeline picks its own worker count.

Hill climbing on measured throughput, as tf.data's AUTOTUNE raises a
parallelism one step at a time under a CPU budget, with Cachew's hysteresis
(a worker more stays while it raises the throughput by more than 7 %, a
worker less while the loss stays under 3 %):

* the tuner measures each source over windows of about a second (samples
  fetched per second, the nets' share of time waiting for input, the
  workers' share of time inside ``fetch_fun``, the CPU time of their
  threads or processes), from the counts blobfeed keeps anyway;
* while the nets wait for input it tries more workers (a step that doubles
  while each step pays, back to one after a step that did not), keeps them
  if the next window is faster by :data:`GROW_GAIN`, and goes back
  otherwise;
* now and then (whenever no failed trial holds it back) it tries one
  worker less, keeps the change if the throughput falls by less than
  :data:`SHRINK_LOSS` (and then tries one less again at once), and goes
  back otherwise; workers that idle (waiting for room in a full queue) or
  nets that do not wait never make it try more;
* a trial that failed is not repeated for :data:`HOLD_S` seconds, twice as
  long after each further failure (up to :data:`HOLD_MAX_S`);
* bounds: ``max_workers`` (a hard cap on the count), ``max_cpus`` (the
  cores the workers may use together: a step up is tried only if the
  workers' measured CPU use, scaled to the new count, fits; workers that
  mostly wait use little and may outnumber the cores), the byte budget
  (``max_buffered_bytes``: each worker may hold one chunk on top of what
  the queue holds), and threads that share one GIL do not grow.

:class:`Climber` is the decision logic alone (what tests pin with a fake
plant); :class:`AutoTuner` measures real sources and applies its decisions
with ``GlobalCoordinator.set_num_workers``.  docs/TUNING.md explains it for
users.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .bottleneck import (
    CPU_HUNGRY, GIL_CPU_RATIO, GIL_MAX_CORES, WAIT_BOUND, fair_share, fetcher_threads, thread_cpu,
)

if TYPE_CHECKING:
    from .stats import SourceTotals

__all__ = ["AutoWorkers", "Climber", "Window", "cpu_limit"]

logger = logging.getLogger("blobfeed.autotune")

#: a window is at least this long ...
MEASURE_S = 1.0
#: ... holds at least this many chunks, unless it reached MEASURE_MAX_S
MIN_CHUNKS = 20
MEASURE_MAX_S = 4.0
#: after a change, the counts of this long are not measured (new workers start)
SETTLE_S = 0.3
#: a worker more stays if the throughput grows by more than this share ...
GROW_GAIN = 0.07
#: ... a worker less if it falls by less than this share
SHRINK_LOSS = 0.03
#: a failed trial is not repeated for this long, doubled after each further
#: failure in the same direction, up to HOLD_MAX_S
HOLD_S = 4.0
HOLD_MAX_S = 30.0
#: workers inside fetch_fun less than this share of their time idle (they
#: wait for room): no worker more is tried
IDLE_BUSY = 0.5
#: after a step up that gained less than it added, the workers kept are
#: start * (1 + gain) times this
USEFUL_MARGIN = 1.2
#: threads that share one GIL use together at least this share of what one
#: busy thread gets on this machine now (and at most GIL_MAX_CORES cores)
GIL_SHARE = 0.8
#: the monitor ticks this often while a source is tuned
TICK_S = 0.25


def cpu_limit() -> float:
    """The cores this process may use: its CPU affinity, and the cgroup's
    CPU quota (``/sys/fs/cgroup/cpu.max`` on cgroup v2, ``cpu.cfs_quota_us``
    over ``cpu.cfs_period_us`` on v1) where one is set; at least 1."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = float(os.cpu_count() or 1)
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, quota)
    return max(1.0, cores)


def _cgroup_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The cgroup CPU quota in cores, or None (no quota, or not readable)."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class AutoWorkers:
    """``num_worker_threads=AutoWorkers(...)``: ``"auto"`` with bounds of
    your own.  ``"auto"`` is ``AutoWorkers()``.

    Args:
        start: workers each wiring call starts with.
        max_workers: a hard cap on the source's worker count (None:
            ``max(16, 4 * max_cpus)``, rounded down).
        max_cpus: cores the workers may use together (None: this process's
            CPU affinity and cgroup quota, :func:`cpu_limit`).  Measured,
            not counted: workers that mostly wait (I/O, sleeps) may
            outnumber the cores.
        min_workers: the tuner never goes below it.
    """

    start: int = 1
    max_workers: int | None = None
    max_cpus: float | None = None
    min_workers: int = 1

    def __post_init__(self) -> None:
        from .arguments import check_index

        check_index("AutoWorkers.start", self.start)
        check_index("AutoWorkers.min_workers", self.min_workers)
        if self.max_workers is not None:
            check_index("AutoWorkers.max_workers", self.max_workers)
            if self.max_workers < max(self.start, self.min_workers):
                raise ValueError(
                    f"AutoWorkers.max_workers={self.max_workers} is below start={self.start} or "
                    f"min_workers={self.min_workers}"
                )
        if self.max_cpus is not None and (
            isinstance(self.max_cpus, bool) or not isinstance(self.max_cpus, (int, float))
            or not math.isfinite(self.max_cpus) or self.max_cpus <= 0
        ):
            raise ValueError(f"AutoWorkers.max_cpus must be a number > 0, got {self.max_cpus!r}")

    def cpus(self) -> float:
        return float(self.max_cpus) if self.max_cpus is not None else cpu_limit()

    def cap(self) -> int:
        return self.max_workers if self.max_workers is not None else max(16, int(4 * self.cpus()))


def as_auto(value: Any) -> AutoWorkers | None:
    """The :class:`AutoWorkers` that ``num_worker_threads`` asks for, or None
    (a fixed count)."""
    if isinstance(value, AutoWorkers):
        return value
    if isinstance(value, str):
        if value == "auto":
            return AutoWorkers()
        raise ValueError(f"num_worker_threads must be an int >= 1, 'auto' or AutoWorkers(...), got {value!r}")
    return None


@dataclass(frozen=True)
class Window:
    """What the tuner measured over one window at one worker count."""

    seconds: float
    #: samples fetched per second
    rate: float
    #: the nets waited for input (some net's wait share >= WAIT_BOUND)
    input_bound: bool
    #: the workers' share of time inside fetch_fun (None: no worker)
    busy: float | None = None
    #: CPU cores the workers used together (None: unknown)
    cores: float | None = None
    #: threads of this process sharing one GIL
    gil: bool = False
    #: each worker computes (on a CPU at least half of what one busy thread
    #: gets on this machine now): more are added one at a time
    hungry: bool = False


@dataclass
class _Trial:
    start: int
    to: int
    base: float
    up: bool


@dataclass
class Climber:
    """The decision logic: fed one :class:`Window` at a time, returns the
    worker count to run next.  No clock of its own (``now`` is passed), no
    pipeline: a fake plant drives it in tests."""

    n: int
    lo: int = 1
    hi: int = 16
    cpus: float = 1.0
    #: the step of the next trial up (doubles while steps pay)
    step: int = 1
    trial: _Trial | None = None
    hold_up: float = 0.0
    hold_down: float = 0.0
    _fails_up: int = 0
    _fails_down: int = 0
    #: the rate where the current run of steps down started
    _down_from: float = 0.0
    #: why the last change was made (for the log line)
    reason: str = ""

    def decide(self, now: float, w: Window, bound: int | None = None) -> int:
        """The worker count after window ``w`` (measured at ``self.n``, or
        at the trial's count); ``bound``: a further cap now (the byte budget)."""
        hi = self.hi if bound is None else max(self.lo, min(self.hi, bound))
        t = self.trial
        if t is not None:
            self.trial = None
            if t.up:
                ok = w.rate > t.base * (1 + GROW_GAIN) and not w.gil
                if ok:
                    self._fails_up = 0
                    # no step back down straight after a step up that paid
                    self.hold_down = max(self.hold_down, now + HOLD_S)
                    self.reason = f"{t.start} -> {t.to} workers raised the throughput {_pct(w.rate, t.base)}"
                    # workers do not each add more than they did before: a
                    # step that gained less than it added passed the knee,
                    # about start * (1 + gain) (with a margin; one less is
                    # tried later)
                    useful = math.ceil(t.start * (w.rate / t.base) * USEFUL_MARGIN)
                    if useful < t.to:
                        self.step = 1
                        self.n = max(t.start + 1, useful)
                        self.reason += f"; {self.n} of them are about as good"
                        return self.n
                    self.step = min(2 * (t.to - t.start), max(1, hi))
                    return self._then(now, w, hi)
                self.step = 1
                self._fails_up += 1
                self.hold_up = now + min(HOLD_MAX_S, HOLD_S * 2 ** (self._fails_up - 1))
                self.n = t.start
                self.reason = (
                    f"{t.start} -> {t.to} workers: the fetcher threads share one GIL (use backend='processes')"
                    if w.gil else f"{t.start} -> {t.to} workers changed the throughput only {_pct(w.rate, t.base)}"
                )
                return self.n
            # a run of steps down is judged against where it started, so
            # losses within the noise do not add up step after step
            ok = w.rate >= max(t.base, self._down_from) * (1 - SHRINK_LOSS)
            if ok:
                self._fails_down = 0
                self.reason = f"{t.start} -> {t.to} workers kept the throughput ({_pct(w.rate, t.base)})"
                return self._then(now, w, hi, down_again=True)
            self._down_from = 0.0
            self._fails_down += 1
            self.hold_down = now + min(HOLD_MAX_S, HOLD_S * 2 ** (self._fails_down - 1))
            self.n = t.start
            self.reason = f"{t.start} -> {t.to} workers lost throughput ({_pct(w.rate, t.base)})"
            return self.n
        return self._then(now, w, hi)

    def _then(self, now: float, w: Window, hi: int, down_again: bool = False) -> int:
        """From a window measured at ``self.n`` (no trial running): start
        the next trial, or stay."""
        n = self.n
        if n > hi:  # a bound came down (the byte budget): follow it
            self.n = hi
            self.reason = f"the bound is {hi} workers now"
            return hi
        # workers that compute are not idle, whatever share of their time
        # fetch_fun takes (a worker process also assembles batches: W2p)
        idle = w.busy is not None and w.busy < IDLE_BUSY and not w.hungry
        if w.input_bound and not idle and not w.gil and n < hi and now >= self.hold_up and not down_again:
            to = min(hi, n + (1 if w.hungry else max(1, self.step)))
            while to > n and not self._fits(w, n, to):
                to = n + (to - n) // 2
            if to > n:
                self.trial = _Trial(n, to, w.rate, True)
                self.n = to
                self.reason = f"the nets wait for input: trying {to} workers (were {n})"
                return to
        # after a step down that cost nothing, the next one comes at once;
        # else one less is tried whenever no failed trial holds it back --
        # but not of workers that each keep a core busy for nets that wait,
        # up to the cores: one less can only lose, and each try costs a
        # window at a fraction of the throughput (A4p: 0.81 x)
        computing = w.input_bound and w.hungry and n <= max(1, int(self.cpus))
        if n > self.lo and (down_again or (now >= self.hold_down and not computing)):
            if not down_again:
                self._down_from = w.rate
            to = n - 1
            self.trial = _Trial(n, to, w.rate, False)
            self.n = to
            self.reason = "the workers idle: trying one less" if idle else "trying one worker less"
            return to
        return n

    def _fits(self, w: Window, n: int, to: int) -> bool:
        """Whether ``to`` workers fit the CPU budget, from ``n``'s use:
        workers that compute each take a core when they can get one (on a
        machine busy with other work they get less, which must not make
        room for more of them)."""
        if w.cores is None:
            return True
        if w.hungry and to > max(1, int(self.cpus)):
            return False
        return w.cores * to / max(1, n) <= self.cpus + 0.25


def _pct(rate: float, base: float) -> str:
    if base <= 0:
        return "from 0"
    return f"{100 * (rate / base - 1):+.0f}%"


def process_cpu(pids: Iterable[int]) -> dict[int, float]:
    """CPU seconds of each live process by pid (``/proc/<pid>/stat``); one
    that has ended, or that /proc cannot tell, is left out."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, float] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                text = f.read(4096)
            fields = text[text.rindex(b")") + 2:].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return out


@dataclass
class _Mark:
    t: float
    samples: int
    chunks: int
    fetch_s: float
    nets: dict[str, tuple[float, float]]
    cpu: dict[int, float] | None


@dataclass
class _Tuned:
    name: str
    spec: AutoWorkers
    climber: Climber
    run: int = 0
    mark: _Mark | None = None
    #: no window before this (new workers starting)
    settle_until: float = 0.0


class AutoTuner:
    """The sources of one coordinator wired with ``num_worker_threads="auto"``:
    a window each, a :class:`Climber` each, and the changes applied.  Its
    ``tick`` is called by one thread (the coordinator's monitor)."""

    def __init__(self, gc: Any) -> None:
        self._gc = gc
        self._tuned: dict[str, _Tuned] = {}

    def add(self, name: str, spec: AutoWorkers, started: int, source: Any) -> None:
        """Source ``name`` (just wired with ``started`` workers, under the
        coordinator's lock) is tuned."""
        t = self._tuned.get(name)
        if t is not None and t.run == id(source):
            t.climber.n += started  # another net wired to it
            return
        self._tuned[name] = _Tuned(
            name, spec, Climber(started, spec.min_workers, spec.cap(), spec.cpus()), run=id(source),
        )

    def tuned(self, name: str) -> bool:
        return name in self._tuned

    def spec(self, name: str) -> AutoWorkers | None:
        t = self._tuned.get(name)
        return None if t is None else t.spec

    def forget(self, name: str | None = None) -> None:
        if name is None:
            self._tuned.clear()
        else:
            self._tuned.pop(name, None)

    @property
    def active(self) -> bool:
        return bool(self._tuned)

    def tick(self, now: float, totals: Mapping[str, "SourceTotals"], groups: list[Any]) -> None:
        threads = fetcher_threads(groups) if self._tuned else {}
        for name, t in list(self._tuned.items()):
            src = self._gc._known.sources.get(name)
            if src is None or id(src) != t.run or src.stopped:
                self._tuned.pop(name, None)  # its run is over
                continue
            entry = totals.get(name)
            live = None if entry is None else entry.live
            if entry is None or live is not src or not any(g.name == name and g.started for g in groups):
                continue  # not started yet
            if live.stopped or live.finished or live.error is not None or live.halted:
                continue
            count = getattr(live, "worker_count", t.climber.n)
            if count != t.climber.n and t.climber.trial is None:
                # set_num_workers by hand: climb from there
                t.climber.n, t.mark = count, None
            if now < t.settle_until:
                continue
            mark = self._mark(now, entry, threads.get(name), [g for g in groups if g.name == name])
            if t.mark is None:
                t.mark = mark
                continue
            w = self._window(t.mark, mark, t.climber.n, threads.get(name) is not None)
            if w is None:
                continue
            t.mark = mark
            was = t.climber.n
            to = t.climber.decide(now, w, self._byte_bound(live, entry))
            if to != was:
                try:
                    self._gc.set_num_workers(name, to)
                except ValueError:
                    # the source ended or stopped meanwhile: nothing to tune
                    logger.debug("source %r: not resized to %d workers", name, to, exc_info=True)
                    t.climber.n, t.climber.trial = was, None
                    continue
                except Exception as exc:
                    # the backend could not start more (no room for a worker
                    # process's shared memory, say): stay where we are
                    logger.warning("source %r: the tuner could not run %d workers (%s); stays at %d",
                                   name, to, exc, was)
                    t.climber.n, t.climber.trial = was, None
                    t.climber.hi = max(t.climber.lo, min(t.climber.hi, was))
                    continue
                logger.info("source %r: %d workers (were %d): %s", name, to, was, t.climber.reason)
                t.settle_until = now + SETTLE_S
                t.mark = None

    def _mark(self, now: float, entry: "SourceTotals", tids: list[int] | None, groups: list[Any]) -> _Mark:
        f = entry.fetch
        nets = {net: (c.wait.total, c.busy) for net, ((_, c), _) in entry.feeds.items()}
        cpu: dict[int, float] | None = None
        if tids is not None:
            cpu = thread_cpu(tids)
        else:
            pids = _worker_pids(groups)
            cpu = process_cpu(pids) if pids else None
        return _Mark(now, f.samples, f.chunks, f.fetch.total, nets, cpu)

    def _window(self, a: _Mark, b: _Mark, n: int, threads: bool) -> Window | None:
        dt = b.t - a.t
        chunks = b.chunks - a.chunks
        if dt < MEASURE_S or (chunks < MIN_CHUNKS and dt < MEASURE_MAX_S):
            return None
        rate = max(0, b.samples - a.samples) / dt
        waits = []
        for net, (wait, ran) in b.nets.items():
            w0, r0 = a.nets.get(net, (0.0, 0.0))
            dw, db = max(0.0, wait - w0), max(0.0, ran - r0)
            if dw + db > 0:
                waits.append(dw / (dw + db))
        input_bound = bool(waits) and max(waits) >= WAIT_BOUND
        busy = min(1.0, max(0.0, b.fetch_s - a.fetch_s) / (n * dt)) if n > 0 else None
        cores: float | None = None
        if a.cpu is not None and b.cpu is not None:
            common = [k for k in b.cpu if k in a.cpu]
            if common:
                cores = sum(max(0.0, b.cpu[k] - a.cpu[k]) for k in common) / dt
        share = fair_share()
        # threads that together use about what one busy thread gets (not
        # threads that wait: they use far less), each on a CPU much less
        # than it is inside fetch_fun
        gil = bool(
            threads and n >= 2 and cores is not None and busy is not None and busy > 0
            and GIL_SHARE * share <= cores <= GIL_MAX_CORES and cores / n < GIL_CPU_RATIO * busy
        )
        hungry = cores is not None and n > 0 and cores / n >= CPU_HUNGRY * share
        return Window(dt, rate, input_bound, busy, cores, gil, hungry)

    @staticmethod
    def _byte_bound(live: Any, entry: "SourceTotals") -> int | None:
        """Workers the byte budget allows: each may hold one chunk (of the
        mean size so far) on top of the queue's."""
        max_bytes = getattr(live, "max_bytes", None)
        f = entry.fetch
        if max_bytes is None or f.chunks <= 0 or f.bytes <= 0:
            return None
        return max(1, int(max_bytes // (f.bytes / f.chunks)))


def _worker_pids(groups: list[Any]) -> list[int]:
    """The pids of the live worker processes of a source's groups."""
    pids = []
    for g in groups:
        for wg in [getattr(g, "_group", None), *getattr(g, "_more_groups", [])]:
            for wk in getattr(wg, "workers", None) or []:
                pid = getattr(wk, "pid", 0)
                if pid:
                    pids.append(pid)
    return pids
