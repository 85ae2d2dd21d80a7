"""What one measurement records, in the child process that runs it: the
tally its workers report to (samples fetched, CPU time of their work, the
stop flag), the meter of the timed window, and the memory (PSS) of a
process tree."""

from __future__ import annotations

import mmap
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any


class Tally:
    """What the workers of one measurement report to its runner, through a
    small shared file mapping, so that worker processes report as threads do:

    * a stop flag: blobfeed's and Caffe2's fetchers raise ``StopIteration``
      once it is set;
    * per worker slot, the samples fetched (each slot has one writer);
    * per worker slot, a ring of CPU times, in seconds per sample, of the
      work a fetch did (W4's loop, W6's decodes), from ``time.thread_time``
      in whichever thread or process did it.

    It pickles as its path: a worker process maps the same file on first use.
    """

    WORKERS = 16
    RING = 16384
    _COUNTS = 1  # int64 words: [0] stop flag, [1..16] samples, [17..32] CPU times recorded
    _NTIMES = 1 + WORKERS
    _HEADER = 40  # words before the rings (float64)
    SIZE = 8 * (_HEADER + WORKERS * RING)

    def __init__(self) -> None:
        shm = "/dev/shm"
        folder = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
        # A run that was killed could not delete its tallies: the name
        # carries the owner's pid, so the next run deletes those of the dead.
        sweep_tallies(folder)
        fd, self.path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=folder)
        os.ftruncate(fd, self.SIZE)
        os.close(fd)
        self._owner = os.getpid()
        self._q: Any = None  # memoryview of int64
        self._d: Any = None  # memoryview of float64

    @classmethod
    def attach(cls, path: str) -> "Tally":
        """The tally another process made, at ``path`` (it stays that process's to delete)."""
        tally = cls.__new__(cls)
        tally.__setstate__({"path": path})
        return tally

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._owner = -1
        self._q = self._d = None

    def _open(self) -> tuple[Any, Any]:
        if self._q is None or self._d is None:
            with open(self.path, "r+b") as f:
                mm = mmap.mmap(f.fileno(), self.SIZE)
            self._q = memoryview(mm).cast("q")
            self._d = memoryview(mm)[8 * self._HEADER :].cast("d")
        return self._q, self._d

    # workers
    @property
    def stopping(self) -> bool:
        q = self._q if self._q is not None else self._open()[0]
        return q[0] != 0

    def add(self, worker: int, samples: int) -> None:
        q = self._q if self._q is not None else self._open()[0]
        q[self._COUNTS + worker % self.WORKERS] += samples

    def cpu(self, worker: int, seconds_per_sample: float) -> None:
        q, d = self._open() if self._q is None or self._d is None else (self._q, self._d)
        w = worker % self.WORKERS
        n = q[self._NTIMES + w]
        d[w * self.RING + n % self.RING] = seconds_per_sample
        q[self._NTIMES + w] = n + 1

    # the runner
    def finish(self) -> None:
        self._open()[0][0] = 1

    def count(self, worker: int) -> int:
        """What slot ``worker`` counted (``add``)."""
        return int(self._open()[0][self._COUNTS + worker % self.WORKERS])

    def fetched(self) -> int:
        q = self._open()[0]
        return sum(q[self._COUNTS + w] for w in range(self.WORKERS))

    def cpu_median(self) -> float | None:
        """The median CPU time per sample over every worker, skipping each
        worker's first quarter (warm-up) while its ring has not wrapped."""
        q, d = self._open()
        values: list[float] = []
        for w in range(self.WORKERS):
            n = q[self._NTIMES + w]
            if n == 0:
                continue
            ring = d[w * self.RING : w * self.RING + min(n, self.RING)].tolist()
            values += ring[n // 4 :] if n <= self.RING else ring
        return statistics.median(values) if values else None

    def close(self) -> None:
        if self._owner == os.getpid():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


_PREFIX = "blobfeed-bench-"


def sweep_tallies(folder: str) -> None:
    """Delete the tallies in ``folder`` whose owner process is gone."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX):].partition("-")[0]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue  # not ours to judge, or its owner lives
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:  # gone meanwhile, or no such file on this kernel
        pass
    return 0


def _children() -> dict[int, list[int]]:
    """Every process's children, by parent pid, from one scan of /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    return children


def _subtree(children: dict[int, list[int]], root: int, prune: frozenset[int] | set[int] = frozenset()) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in prune:
            continue
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _descendants(root: int, prune: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """``root`` and every process below it (children of children too: the
    forkserver's workers, grain's and torch's), from /proc; the processes
    in ``prune`` and everything below them left out."""
    return _subtree(_children(), root, prune)


def tree_pss_mb(root: int | None = None) -> float:
    """Total PSS of ``root`` (default this process) and its descendants, MiB:
    shared pages (shared memory, the forkserver's) are counted once in all."""
    return sum(_pss_kb(pid) for pid in _descendants(os.getpid() if root is None else root)) / 1024


# --------------------------------------------------------------------------- CPU time and context switches
#: /proc/PID/stat's utime and stime are in these ticks per second
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_ticks(pid: int) -> int | None:
    """utime + stime of process ``pid`` (all its threads, the dead ones
    included), in clock ticks; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted from the state (3)


def _thread_switches(pid: int) -> dict[int, int]:
    """Voluntary + involuntary context switches of each live thread of
    process ``pid``, by thread id (empty when it is gone)."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        n = 0
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        n += int(line.split()[1])
        except OSError:
            continue  # the thread ended meanwhile
        out[int(tid)] = n
    return out


@dataclass(frozen=True)
class ProcReading:
    """One reading of some processes from /proc: each one's CPU time
    (ticks) and each of its threads' context switches."""

    cpu_ticks: dict[int, int]
    switches: dict[tuple[int, int], int]  # (pid, tid) -> voluntary + involuntary


def read_procs(pids: list[int]) -> ProcReading:
    """Reads ``pids``' CPU time and their threads' context switches."""
    cpu: dict[int, int] = {}
    switches: dict[tuple[int, int], int] = {}
    for pid in pids:
        ticks = _cpu_ticks(pid)
        if ticks is None:
            continue
        cpu[pid] = ticks
        for tid, n in _thread_switches(pid).items():
            switches[(pid, tid)] = n
    return ProcReading(cpu, switches)


#: the keys of the service's steps in a result (``service.service_steps``):
#: STEP_CPU + role, STEP_CTX + role
STEP_CPU = "step_cpu_us_per_batch:"
STEP_CTX = "step_ctx_per_batch:"


def read_threads(role: Callable[[int], str]) -> dict[str, tuple[int, int]]:
    """This process's live threads, grouped by ``role(tid)``: (CPU ticks,
    context switches) per role."""
    out: dict[str, tuple[int, int]] = {}
    me = os.getpid()
    for tid, switches in _thread_switches(me).items():
        try:
            with open(f"/proc/{me}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()
        ticks, n = out.get(role(tid), (0, 0))
        out[role(tid)] = (ticks + int(fields[11]) + int(fields[12]), n + switches)
    return out


def threads_between(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> dict[str, "Usage"]:
    """What each role's threads spent from reading ``a`` to reading ``b``
    (a thread that ended in between is left out: not readable any more)."""
    return {
        role: Usage((ticks - a.get(role, (0, 0))[0]) / CLK_TCK, n - a.get(role, (0, 0))[1])
        for role, (ticks, n) in b.items()
    }


@dataclass(frozen=True)
class Usage:
    """What a group of processes spent between two readings."""

    #: utime + stime, seconds (to two clock ticks per process: /proc
    #: truncates each of the two to a tick)
    cpu_s: float
    #: voluntary + involuntary context switches, summed over the threads
    switches: int


def usage_between(a: ProcReading, b: ProcReading, pids: list[int]) -> Usage:
    """What ``pids`` spent from reading ``a`` to reading ``b``.  A process
    gone by ``b`` is left out (what it spent cannot be read any more); a
    thread born after ``a`` counts all its switches, one that ended before
    ``b`` loses those it made in between (not readable either)."""
    ticks = sum(b.cpu_ticks[p] - a.cpu_ticks[p] for p in pids if p in a.cpu_ticks and p in b.cpu_ticks)
    want = set(pids)
    switches = sum(n - a.switches.get(key, 0) for key, n in b.switches.items() if key[0] in want)
    return Usage(ticks / CLK_TCK, switches)


class UsageProbe:
    """CPU time and context switches of named groups of processes over a
    window, read from /proc at its two ends only (nothing in between, so
    the window is not disturbed; a reading takes a few milliseconds).

    ``groups`` maps a name to the processes at the root of the group: each
    group is its roots and everything below them, except the other groups'
    roots (and what is below those) and ``exclude`` (and what is below).
    ``below`` maps a name to processes whose children (not themselves) are
    that group's roots: a consumer's worker processes apart from the
    consumer, which need not have started when the caller names the
    consumer.  The groups are resolved once, by one scan of /proc, when the
    probe is made: make it before the window, once the processes have started.
    """

    def __init__(self, groups: dict[str, list[int]], exclude: Collection[int] = (),
                 children: dict[int, list[int]] | None = None, below: dict[str, list[int]] | None = None) -> None:
        # ``children``: a scan the caller chose its roots from, so that a
        # process born after it is in no group rather than in the wrong one
        children = _children() if children is None else children
        if below:
            groups = {**groups, **{name: [c for p in pids for c in children.get(p, ())]
                                   for name, pids in below.items()}}
        roots = {pid for pids in groups.values() for pid in pids}
        self.groups: dict[str, list[int]] = {}
        for name, pids in groups.items():
            members: list[int] = []
            for root in pids:
                members += _subtree(children, root, (roots - {root}) | set(exclude))
            self.groups[name] = members
        self._pids = [pid for members in self.groups.values() for pid in members]
        self._start: ProcReading | None = None

    def start(self) -> None:
        """The reading at the window's start."""
        self._start = read_procs(self._pids)

    def stop(self) -> dict[str, Usage]:
        """The reading at the window's end: what each group spent since :meth:`start`."""
        if self._start is None:
            raise RuntimeError("UsageProbe.stop() before start()")
        end = read_procs(self._pids)
        return {name: usage_between(self._start, end, members) for name, members in self.groups.items()}


#: the share of one core the PSS sampler's readings may take (see PssSampler)
PSS_SHARE = 0.01


class PssSampler:
    """The largest total PSS of a process tree, read about once a second by
    a process of its own (this file run as a script: the standard library
    only, no numpy, no blobfeed).

    Read in the measuring process, the PSS cost the window dearly: the
    reading opens two files per process on the machine, and each read
    gives up the GIL; with W4's fetcher threads running pure-Python work,
    taking it back waits a switch interval (5 ms) every time, so one reading
    took up to 3.8 s on a busy machine.  That time was taken out of the
    window while the fetchers went on filling the queues, so the batches
    they made in it were counted against a window that did not include it:
    W4 reported 3.57 x one core's ideal.  From another process the reading
    takes nothing from the measured one, and the window is its wall time.

    A reading walks the page tables of every process it reads: a W7 worker
    process (a 2 GB file and its slots mapped) cost 31-33 ms of CPU a
    reading, so once a second two of them took about 3 % of a 2-core
    machine from a runner that uses both cores, and nothing from one that
    leaves a core idle (torch's loader in one process).  So the sampler
    spends at most about 1 % of a core (:data:`PSS_SHARE`): it reads once
    as it starts (in the warm-up), and then every ``interval`` (1 s) or a
    hundred times as long as its last reading took, whichever is longer,
    from that long after the window opened, and at its end.  A W7 window of
    3 s is read once in it, a second in (the reading in the warm-up, before
    the workers touched much, was cheap), then not again; the pipelines of
    S1, whose readings take milliseconds, once a second.

    ``go()`` starts the readings (the window opens), ``stop()`` takes one
    more and returns the largest, MiB.  The sampler leaves its own PSS out,
    and exits when its stdin closes (this process gone) or the root is gone.
    """

    def __init__(self, root: int | None = None, interval: float = 1.0) -> None:
        import subprocess

        self.root = os.getpid() if root is None else root
        # -I: no PYTHON* variables, no user site, and not this file's folder on sys.path
        self._proc: Any = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), "--pss-sampler", str(self.root), str(interval)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    @property
    def pid(self) -> int:
        """The sampler's process id (-1 once stopped)."""
        return self._proc.pid if self._proc is not None else -1

    def go(self) -> None:
        """Begin the readings (the window opened)."""
        if self._proc is not None:
            self._send_to(self._proc, "go\n")

    def stop(self, timeout: float = 60.0) -> float:
        """One last reading; the largest of them all, MiB (0.0 if it failed)."""
        if self._proc is None:
            return 0.0
        proc, self._proc = self._proc, None
        self._send_to(proc, "stop\n")
        try:
            out, _ = proc.communicate(timeout=timeout)
        except Exception:
            proc.kill()
            proc.communicate()
            return 0.0
        try:
            return float(out.strip() or 0.0)
        except ValueError:
            return 0.0

    @staticmethod
    def _send_to(proc: Any, line: str) -> None:
        try:
            proc.stdin.write(line)
            proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # it died: stop() returns 0.0

    def close(self) -> None:
        """Stop it without a reading (idempotent)."""
        if self._proc is not None:
            proc, self._proc = self._proc, None
            proc.kill()
            proc.communicate()


def _sampler_main(root: int, interval: float) -> None:
    """The sampler's loop (see :class:`PssSampler`)."""
    import select

    me = os.getpid()

    cost = 0.0

    def reading() -> float:
        nonlocal cost
        t0 = time.process_time()
        mib = sum(_pss_kb(pid) for pid in _descendants(root) if pid != me) / 1024
        cost = time.process_time() - t0
        return mib

    def gap() -> float:
        # each reading costs the processes it reads as much again (see PssSampler)
        return max(interval, cost / PSS_SHARE)

    peak, going = reading(), False  # (in the warm-up: it also tells what a reading costs)
    next_at = 0.0
    while True:
        wait = max(0.0, next_at - time.monotonic()) if going else None
        ready, _, _ = select.select([sys.stdin], [], [], wait)
        if ready:
            line = sys.stdin.readline()
            if line.strip() == "go":
                # the first reading a gap into the window, not at its start
                going, next_at = True, time.monotonic() + gap()
                continue
            if line.strip() == "stop":
                peak = max(peak, reading())
                print(f"{peak:.3f}", flush=True)
            return  # "stop", or EOF: the measuring process is gone
        if not os.path.exists(f"/proc/{root}"):
            return
        peak = max(peak, reading())
        next_at = time.monotonic() + gap()


@dataclass
class Meter:
    """Counts batches in a timed window after a warm-up.

    With ``pss`` (the default), the total PSS of this process and its
    descendants is read once in the warm-up, about once a second inside
    the window (less often where a reading is costly), and at its end, by
    a :class:`PssSampler` (a process of its own, started at the
    first batch, during the warm-up), and its maximum is reported: for
    every runner, so the report's PSS column is never blank.  Nothing is
    taken out of the window: it is the wall time from its first batch to
    its last.
    """

    seconds: float
    warmup: float = 0.5
    pss: bool = True
    batches: int = 0
    samples: int = 0
    nbytes: int = 0
    t_start: float = 0.0
    t_first: float | None = None
    t_window: float = 0.0
    t_end: float = 0.0
    pss_mb: float = 0.0
    #: read the CPU time and context switches of this process and of the
    #: processes below it (the worker processes) at the window's two ends:
    #: the result's ``parent_cpu_us_per_batch``, ``parent_ctx_per_batch``,
    #: ``children_cpu_us_per_batch`` and ``children_ctx_per_batch``
    cpu: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    _sampler: PssSampler | None = None
    _probe: UsageProbe | None = None
    _usage: dict[str, Usage] | None = None
    _usage_batches: int = 0

    def begin(self) -> None:
        self.t_start = time.perf_counter()

    def tick(self, arrays: Any) -> bool:
        """Record one batch; False once the window is over."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            self.t_window = now + self.warmup
            if self.pss:
                self._sampler = PssSampler()  # its start-up falls in the warm-up
            if self.cpu:
                self._probe = self._usage_probe()  # its scan of /proc too
            return True
        if now < self.t_window:
            return True
        if self.batches == 0:
            self.t_window = now  # the window starts at the first batch after warm-up
            if self._sampler is not None:
                self._sampler.go()
            if self._probe is not None:
                self._probe.start()
        self.batches += 1
        self.samples += len(arrays[0])
        self.nbytes += sum(a.nbytes for a in arrays)
        self.t_end = now
        going = now - self.t_window < self.seconds
        if not going:
            self._read_cpu()
            self._stop_sampler()
        return going

    def _usage_probe(self) -> UsageProbe:
        """A probe of this process (every thread) and of the processes below
        it (the worker processes), the PSS sampler's apart: it measures, it
        is not measured.  Made at the first batch: processes started after
        it are not in it."""
        me = os.getpid()
        prune = {self._sampler.pid} if self._sampler is not None else set()
        scan = _children()
        below = [pid for pid in scan.get(me, []) if pid not in prune]
        groups = {"parent": [me], "children": below} if below else {"parent": [me]}  # (threads: no row of 0)
        return UsageProbe(groups, exclude=prune, children=scan)

    def _read_cpu(self) -> None:
        """The window's end: what this process and the processes below it
        spent since its start, over the batches counted so far (a runner
        may tick on after the window closed: those are not in the reading)."""
        probe, self._probe = self._probe, None
        if probe is not None:
            self._usage = probe.stop()
            self._usage_batches = self.batches

    def _stop_sampler(self) -> None:
        if self._sampler is not None:
            sampler, self._sampler = self._sampler, None
            self.pss_mb = max(self.pss_mb, sampler.stop())

    def result(self, **extra: Any) -> dict[str, Any]:
        self._stop_sampler()  # a window cut short (an exception, the end of input)
        dt = max(self.t_end - self.t_window, 1e-9)
        out = {
            "batches_per_s": self.batches / dt,
            "gb_per_s": self.nbytes / dt / 1e9,
            "first_batch_ms": ((self.t_first or self.t_start) - self.t_start) * 1e3,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.pss:
            out["pss_mb"] = self.pss_mb
        if self._usage is not None and self._usage_batches:
            for who, usage in self._usage.items():
                out[f"{who}_cpu_us_per_batch"] = usage.cpu_s / self._usage_batches * 1e6
                out[f"{who}_ctx_per_batch"] = usage.switches / self._usage_batches
        out.update(self.extra)
        out.update(extra)
        return out


@dataclass
class ConsumerWindow:
    """What :func:`watch_consumers` measured."""

    #: batches each consumer took inside the window
    batches: list[int]
    #: the window's length, seconds
    seconds: float
    #: from ``t_start`` until every consumer had its first batch, seconds
    first_batch_s: float
    #: the largest total PSS of this process's tree read in the window, MiB
    pss_mb: float
    #: what each group of processes spent in the window (``watch_consumers``'s ``usage``)
    usage: dict[str, Usage] = field(default_factory=dict)
    #: what this process's threads spent in the window, by role (``thread_roles``)
    threads: dict[str, Usage] = field(default_factory=dict)


def watch_consumers(
    counts: Tally,
    consumers: int,
    seconds: float,
    t_start: float,
    check: Callable[[], None],
    *,
    warmup: float = Meter.warmup,
    start_timeout: float = 120.0,
    poll_s: float = 0.01,
    pss: bool = True,
    usage: dict[str, list[int]] | None = None,
    thread_roles: Callable[[int], str] | None = None,
    usage_below: dict[str, list[int]] | None = None,
) -> ConsumerWindow:
    """Batches/s of consumers in other processes, measured from outside.

    Consumer ``k`` adds 1 to slot ``k`` of ``counts`` for each batch it
    takes.  This waits until every consumer has had a batch (calling
    ``check`` between looks: it raises when a consumer died), lets
    ``warmup`` pass, then counts what all of them take over ``seconds`` of
    wall time: the window every consumer runs in.  The counters are read
    every ``poll_s``, a batch or two of each consumer at its edges.  The
    total PSS of this process and its descendants (the consumers are among
    them) is read about once a second in the window and at its end, by a
    :class:`PssSampler`: another process, so the reading takes nothing from
    this one (the service's threads run here).

    ``usage``: groups of processes (a name and the pids at the group's
    root, see :class:`UsageProbe`) whose CPU time and context switches are
    read at the window's start and end; the PSS sampler is in none of them.
    ``usage_below``: more groups, each rooted at the children of its
    processes (``UsageProbe``'s ``below``), resolved in the warm-up.
    ``thread_roles``: names the role of each of this process's threads (by
    thread id); what each role's threads spent is read at the same two moments.

    Raises:
        TimeoutError: a consumer had no batch within ``start_timeout``.
    """
    sampler = PssSampler() if pss else None
    try:
        return _watch(counts, consumers, seconds, t_start, check, warmup, start_timeout, poll_s, sampler, usage,
                      thread_roles, usage_below)
    finally:
        if sampler is not None:
            sampler.close()  # a consumer died, or the start timed out


def _watch(counts: Tally, consumers: int, seconds: float, t_start: float, check: Callable[[], None], warmup: float,
           start_timeout: float, poll_s: float, sampler: PssSampler | None,
           usage: dict[str, list[int]] | None = None,
           thread_roles: Callable[[int], str] | None = None,
           usage_below: dict[str, list[int]] | None = None) -> ConsumerWindow:
    first: list[float | None] = [None] * consumers
    deadline = time.perf_counter() + start_timeout
    while True:
        now = time.perf_counter()
        for k in range(consumers):
            if first[k] is None and counts.count(k) > 0:
                first[k] = now
        if all(t is not None for t in first):
            break
        check()
        if now > deadline:
            waiting = [k for k, t in enumerate(first) if t is None]
            raise TimeoutError(f"consumers {waiting} had no batch within {start_timeout:g} s")
        time.sleep(poll_s)
    t_all = max(t for t in first if t is not None)
    # the groups, resolved in the warm-up (every process has started by now)
    probe = None
    if usage is not None:
        probe = UsageProbe(usage, exclude=[sampler._proc.pid] if sampler is not None and sampler._proc else [],
                           below=usage_below)
    while time.perf_counter() < t_all + warmup:
        check()
        time.sleep(poll_s)
    if probe is not None:
        probe.start()
    threads0 = read_threads(thread_roles) if thread_roles is not None else {}
    t0 = time.perf_counter()
    c0 = [counts.count(k) for k in range(consumers)]
    if sampler is not None:
        sampler.go()
    while True:
        now = time.perf_counter()
        if now >= t0 + seconds:
            break
        check()
        time.sleep(min(poll_s, max(0.0, t0 + seconds - time.perf_counter())))
    t1 = time.perf_counter()
    c1 = [counts.count(k) for k in range(consumers)]
    spent = probe.stop() if probe is not None else {}
    threads = threads_between(threads0, read_threads(thread_roles)) if thread_roles is not None else {}
    peak = sampler.stop() if sampler is not None else 0.0
    return ConsumerWindow([b - a for a, b in zip(c0, c1)], t1 - t0, t_all - t_start, peak, spent, threads)


if __name__ == "__main__" and sys.argv[1:2] == ["--pss-sampler"]:
    _sampler_main(int(sys.argv[2]), float(sys.argv[3]))
