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
        folder = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
        fd, self.path = tempfile.mkstemp(prefix="blobfeed-bench-", dir=folder)
        os.ftruncate(fd, self.SIZE)
        os.close(fd)
        self._owner = os.getpid()
        self._q: Any = None  # memoryview of int64
        self._d: Any = None  # memoryview of float64

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
