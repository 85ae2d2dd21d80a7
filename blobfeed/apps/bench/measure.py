"""What one measurement records, in the child process that runs it: the
tally its workers report to (samples fetched, CPU time of their work, the
stop flag), the meter of the timed window, and the memory (PSS) of a
process tree."""

from __future__ import annotations

import mmap
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
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
        _sweep(folder)
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


def _sweep(folder: str) -> None:
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


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (children of children too: the
    forkserver's workers, grain's and torch's), from /proc."""
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
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_pss_mb(root: int | None = None) -> float:
    """Total PSS of ``root`` (default this process) and its descendants, MiB:
    shared pages (shared memory, the forkserver's) are counted once in all."""
    return sum(_pss_kb(pid) for pid in _descendants(os.getpid() if root is None else root)) / 1024


@dataclass
class Meter:
    """Counts batches in a timed window after a warm-up.

    With ``pss`` (the default), the total PSS of this process and its
    descendants is read about once a second inside the window (the time it
    takes, some 3 ms here, is left out of the window) and its maximum is
    reported: for every runner, so the report's PSS column is never blank.
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
    t_pss: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def begin(self) -> None:
        self.t_start = time.perf_counter()

    def tick(self, arrays: Any) -> bool:
        """Record one batch; False once the window is over."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            self.t_window = now + self.warmup
            return True
        if now < self.t_window:
            return True
        if self.batches == 0:
            self.t_window = now  # the window starts at the first batch after warm-up
            self.t_pss = now
        self.batches += 1
        self.samples += len(arrays[0])
        self.nbytes += sum(a.nbytes for a in arrays)
        self.t_end = now
        going = now - self.t_window < self.seconds
        if self.pss and (now >= self.t_pss or not going):
            self.pss_mb = max(self.pss_mb, tree_pss_mb())
            if going:
                spent = time.perf_counter() - now
                self.t_window += spent  # not the pipeline's time
                self.t_pss = now + spent + 1.0
        return going

    def result(self, **extra: Any) -> dict[str, Any]:
        dt = max(self.t_end - self.t_window, 1e-9)
        out = {
            "batches_per_s": self.batches / dt,
            "gb_per_s": self.nbytes / dt / 1e9,
            "first_batch_ms": ((self.t_first or self.t_start) - self.t_start) * 1e3,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.pss:
            out["pss_mb"] = self.pss_mb
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
) -> ConsumerWindow:
    """Batches/s of consumers in other processes, measured from outside.

    Consumer ``k`` adds 1 to slot ``k`` of ``counts`` for each batch it
    takes.  This waits until every consumer has had a batch (calling
    ``check`` between looks: it raises when a consumer died), lets
    ``warmup`` pass, then counts what all of them take over ``seconds`` of
    wall time: the window every consumer runs in.  The counters are read
    every ``poll_s``, a batch or two of each consumer at its edges.  The
    total PSS of this process and its descendants (the consumers are among
    them) is read about once a second in the window and at its end; a
    reading is not taken out of the window (the consumers do not wait for
    it), and costs this process a few ms.

    Raises:
        TimeoutError: a consumer had no batch within ``start_timeout``.
    """
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
    while time.perf_counter() < t_all + warmup:
        check()
        time.sleep(poll_s)
    t0 = time.perf_counter()
    c0 = [counts.count(k) for k in range(consumers)]
    peak = 0.0
    next_pss = t0
    while True:
        now = time.perf_counter()
        if now >= t0 + seconds:
            break
        if pss and now >= next_pss:
            peak = max(peak, tree_pss_mb())
            next_pss = now + 1.0
        check()
        time.sleep(min(poll_s, max(0.0, t0 + seconds - time.perf_counter())))
    t1 = time.perf_counter()
    c1 = [counts.count(k) for k in range(consumers)]
    if pss:
        peak = max(peak, tree_pss_mb())
    return ConsumerWindow([b - a for a, b in zip(c0, c1)], t1 - t0, t_all - t_start, peak)
