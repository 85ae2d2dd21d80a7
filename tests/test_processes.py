"""Process workers (``backend="processes"``): docs/CONTRACT.md, "Fetcher
backends", for worker processes (and docs/BACKENDS.md, "Process workers").

Fetchers are module-level (they pickle by reference: each child imports this
module) unless a test is about what cloudpickle does.  Per-worker state lives
in the fetcher object, of which each child has its own copy.  Everything that
could hang runs with a bound; what needs a process of its own (a parent killed
with SIGKILL, what a program prints at exit) runs in a subprocess.

What every backend owes alike (exactly once, exact batches, several nets,
errors and their timing, ``on_error="skip"``, stop, the accounts, the same
batches as threads, resume) is in tests/contract, which runs it on worker
processes too; here is what is the process backend's own: slots and shared
memory, pickling, deaths and signals, start methods, nothing left behind.
"""

from __future__ import annotations

import collections
import ctypes
import gc as pygc
import json
import logging
import mmap
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Any, Iterator, Sequence

import cloudpickle
import numpy as np
import pytest

import blobfeed
from blobfeed import (
    BlobfeedError,
    ChunkError,
    DequeueTimeout,
    EndOfInput,
    FetcherError,
    Net,
    ProcessBackend,
    get_worker_info,
    init_data_input_workers,
)
from blobfeed.feeders import processes
from blobfeed.feeders.child import SHM_MIN_BYTES

from .helpers import WAIT, drain, python_calls_during, sample, wait_until

ROOT = Path(__file__).resolve().parent.parent
SRC = "train"
#: ids: worker_id * WORKER_SPAN + step * STEP_SPAN + i (a chunk has < STEP_SPAN samples)
WORKER_SPAN = 1_000_000
STEP_SPAN = 1000
#: float32 columns per sample in ``feat``: 64 -> 256 B + 8 B of ids per sample
WIDE = 64
#: samples of a WIDE chunk from which it travels through shared memory
SHM_ROWS = -(-SHM_MIN_BYTES // (WIDE * 4 + 8)) + 1


# ---------------------------------------------------------------------------------------------
# fetchers (module level: they pickle by reference)
# ---------------------------------------------------------------------------------------------
def make_chunk(worker_id: int, step: int, n: int, width: int = WIDE) -> list[np.ndarray]:
    """ids int64 (n,), feat float32 (n, width): feat[:, 0] == ids, feat[:, 1] == worker."""
    ids = np.arange(n, dtype=np.int64) + worker_id * WORKER_SPAN + step * STEP_SPAN
    feat = np.empty((n, width), np.float32)
    feat[:, 0] = ids
    feat[:, 1] = worker_id
    if width > 2:
        feat[:, 2:] = (ids % 97)[:, None]
    return [ids, feat]


def chunk_bytes(n: int, width: int = WIDE) -> int:
    """Bytes a make_chunk() chunk of ``n`` samples takes in a slot (arrays 64-byte aligned)."""
    return sum(-(-b // 64) * 64 for b in (n * 8, n * width * 4))


def expected_chunks(sizes: Sequence[Sequence[int]], worker_ids: Sequence[int]) -> list[np.ndarray]:
    return [
        np.arange(n, dtype=np.int64) + wid * WORKER_SPAN + step * STEP_SPAN
        for wid, plan in zip(worker_ids, sizes) for step, n in enumerate(plan)
    ]


class Plan:
    """Worker ``index`` returns chunks of ``sizes[index]`` samples, then StopIteration."""

    def __init__(self, sizes: Sequence[Sequence[int]], width: int = WIDE, delay: float = 0.0) -> None:
        self.sizes = [list(s) for s in sizes]
        self.width = width
        self.delay = delay
        self.step = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        info = get_worker_info()
        assert info is not None
        plan = self.sizes[info.index]
        if self.step >= len(plan):
            raise StopIteration
        if self.delay:
            time.sleep(self.delay)
        step, self.step = self.step, self.step + 1
        return make_chunk(worker_id, step, plan[step], self.width)


class Endless:
    """Chunks of ``n`` samples forever (``delay`` seconds each)."""

    def __init__(self, n: int, width: int = WIDE, delay: float = 0.0) -> None:
        self.n, self.width, self.delay = n, width, delay
        self.step = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if self.delay:
            time.sleep(self.delay)
        step, self.step = self.step, self.step + 1
        return make_chunk(worker_id, step % 1000, self.n, self.width)


_INIT: dict[int, int] = {}
_SENT: set[int] = set()


def record_init(worker_id: int) -> None:
    _INIT[worker_id] = os.getpid()


def info_fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
    """One chunk per worker describing its WorkerInfo, then StopIteration."""
    if worker_id in _SENT:
        raise StopIteration
    _SENT.add(worker_id)
    info = get_worker_info()
    assert info is not None
    draws = info.rng.integers(0, 2**62, size=3)
    row = [worker_id, info.index, info.num_workers, info.seed, *draws,
           int(info.source == SRC), int(_INIT.get(worker_id) == os.getpid()), os.getpid()]
    return [np.array([row], dtype=np.uint64)]


class TwoArgError(Exception):
    """__init__ takes (path, code), args is one message: type(exc)(*args) fails
    (torch issues 30147, 34130)."""

    def __init__(self, path: str, code: int) -> None:
        super().__init__(f"{path} failed with code {code}")
        self.path = path
        self.code = code


class DefaultArgError(Exception):
    """type(exc)(*args) even succeeds, silently giving other args and attributes."""

    def __init__(self, path: str, code: int = 0) -> None:
        super().__init__(f"{path}:{code}")
        self.path = path
        self.code = code


class LockedError(Exception):
    """Cannot be pickled at all: it holds a lock."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.lock = threading.Lock()


class Raiser:
    """Small chunks; on call number ``at`` (and every ``every`` calls after,
    when set) raises an exception of ``kind``, after writing the time to
    ``stamp``; StopIteration after ``calls`` calls (when set)."""

    def __init__(self, kind: str, at: int, stamp: str, every: int = 0, calls: int = 0,
                 rows: int = 5) -> None:
        self.kind, self.at, self.stamp, self.every, self.calls, self.rows = kind, at, stamp, every, calls, rows
        self.n = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        i, self.n = self.n, self.n + 1
        if self.calls and i >= self.calls:
            raise StopIteration
        if i == self.at or (self.every and i > self.at and (i - self.at) % self.every == 0):
            Path(self.stamp).write_text(repr(time.time()))
            if self.kind == "value":
                raise ValueError("boom", worker_id, i)
            if self.kind == "two-arg":
                raise TwoArgError("/data/shard-7", 7)
            if self.kind == "default-arg":
                raise DefaultArgError("/data/x", 5)
            if self.kind == "locked":
                raise LockedError(f"locked boom {worker_id}")
            raise AssertionError(self.kind)
        return make_chunk(worker_id, i, self.rows, 2)


class Malformed:
    """Good chunks, then on call ``at`` one whose blob ``feat`` has a wrong row count."""

    def __init__(self, rows: int, at: int = 1) -> None:
        self.rows, self.at = rows, at
        self.n = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        i, self.n = self.n, self.n + 1
        ids, feat = make_chunk(worker_id, i, self.rows)
        if i == self.at:
            feat = feat[:-1]
        return [ids, feat]


def with_pid(chunk: list[np.ndarray]) -> list[np.ndarray]:
    return [*chunk, np.full(len(chunk[0]), os.getpid(), np.int64)]


class Dier:
    """Worker index 0 returns ``good`` chunks (with its pid), then dies by
    ``how`` (writing the time to ``stamp`` first); ``"hang"`` blocks forever
    instead (the test kills it).  Other workers return chunks forever."""

    def __init__(self, how: str, good: int, stamp: str, rows: int = SHM_ROWS) -> None:
        self.how, self.good, self.stamp, self.rows = how, good, stamp, rows
        self.n = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        i, self.n = self.n, self.n + 1
        info = get_worker_info()
        assert info is not None
        if info.index == 0 and i >= self.good:
            Path(self.stamp).write_text(f"{time.time()!r} {os.getpid()}")
            if self.how == "exit3":
                os._exit(3)
            if self.how == "exit0":
                os._exit(0)
            if self.how == "segv":
                ctypes.string_at(0)
            if self.how == "hang":
                time.sleep(3600)
            raise AssertionError(self.how)
        return with_pid(make_chunk(worker_id, i % 1000, self.rows))


class Stuck:
    """Worker index 0 writes its pid to ``pidfile`` and sleeps forever inside
    fetch_fun; the others return chunks forever."""

    def __init__(self, pidfile: str) -> None:
        self.pidfile = pidfile
        self.n = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        info = get_worker_info()
        assert info is not None
        if info.index == 0:
            Path(self.pidfile).write_text(str(os.getpid()))
            time.sleep(3600)
        self.n += 1
        return make_chunk(worker_id, self.n % 1000, 8, 2)


class PidChunks:
    """Chunks of ``rows`` samples forever, with the worker's pid."""

    def __init__(self, rows: int, width: int = WIDE) -> None:
        self.rows, self.width = rows, width
        self.n = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        self.n += 1
        return with_pid(make_chunk(worker_id, self.n % 1000, self.rows, self.width))


class FailFirst:
    """Worker index 0 raises at once; the others return chunks (with their pid) forever."""

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        info = get_worker_info()
        assert info is not None
        if info.index == 0:
            time.sleep(0.2)
            raise ValueError("first")
        return with_pid(make_chunk(worker_id, 0, 8, 2))


class SlowAfterFirst:
    """A chunk of ``rows`` samples at once, then one every ``delay`` seconds."""

    def __init__(self, rows: int, delay: float) -> None:
        self.rows, self.delay = rows, delay
        self.n = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if self.n:
            time.sleep(self.delay)
        self.n += 1
        return make_chunk(worker_id, self.n % 1000, self.rows)


class LockedFetcher:
    """Cannot be sent to a worker process: it holds a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        return make_chunk(worker_id, 0, 4, 2)


class LockedInit:
    """A worker_init_fun that cannot be sent to a worker process: it holds a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, worker_id: int) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def check_batches(batches: list[dict[str, np.ndarray]], batch_size: int, *, partial_last: bool) -> np.ndarray:
    """Exact sizes, blobs aligned; returns the ids in delivery order."""
    for i, b in enumerate(batches):
        n = len(b["ids"])
        if i < len(batches) - 1 or not partial_last:
            assert n == batch_size, f"batch {i} has {n} samples, expected {batch_size}"
        else:
            assert 0 < n <= batch_size
        assert b["feat"].shape[0] == n
        np.testing.assert_array_equal(b["feat"][:, 0], b["ids"].astype(np.float32))
        np.testing.assert_array_equal(b["feat"][:, 1], (b["ids"] // WORKER_SPAN).astype(np.float32))
        if b["feat"].shape[1] > 2:
            np.testing.assert_array_equal(b["feat"][:, 2], (b["ids"] % 97).astype(np.float32))
    return np.concatenate([b["ids"] for b in batches]) if batches else np.empty(0, np.int64)


def assert_exactly_once_in_order(ids: np.ndarray, chunks: list[np.ndarray], *, complete: bool = True) -> None:
    """Each sample at most (complete: exactly) once, a chunk's samples together
    and in order, and a worker's chunks in the order it fetched them."""
    assert len(np.unique(ids)) == len(ids), "a sample was delivered twice"
    want = np.concatenate(chunks) if chunks else np.empty(0, np.int64)
    if complete:
        np.testing.assert_array_equal(np.sort(ids), np.sort(want))
    else:
        assert np.isin(ids, want).all(), "a sample no fetcher returned"
    order = {int(i): p for p, i in enumerate(ids)}
    for chunk in chunks:
        pos = [order[int(i)] for i in chunk if int(i) in order]
        if complete:
            assert len(pos) == len(chunk)
        assert all(b - a == 1 for a, b in zip(pos, pos[1:])), "a chunk's samples were split or reordered"
    by_worker: dict[int, list[int]] = collections.defaultdict(list)
    for i in ids:
        if i % STEP_SPAN == 0:
            by_worker[int(i) // WORKER_SPAN].append(int(i))
    for w, firsts in by_worker.items():
        assert firsts == sorted(firsts), f"worker {w}'s chunks were delivered out of order"


class PathCounter:
    """Counts the chunks that arrived through shared-memory slots."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.slots = 0
        original = processes._Worker._slot_result

        def views(wk: Any, *args: Any) -> Any:
            self.slots += 1
            return original(wk, *args)

        monkeypatch.setattr(processes._Worker, "_slot_result", views)


def accounts(gc: blobfeed.GlobalCoordinator, nets: Sequence[Net], source: str = SRC) -> dict[str, float]:
    """fetched, delivered, dropped, buffered from one scrape (as tests/test_stress.py)."""
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in gc.registry.collect() for s in fam.samples}

    def get(name: str, **labels: str) -> float:
        return values.get((name, tuple(sorted(labels.items()))), 0.0)

    return {
        "fetched": get("blobfeed_fetched_samples_total", source=source),
        "delivered": sum(get("blobfeed_delivered_samples_total", source=source, net=n.name) for n in nets),
        "dropped": sum(get("blobfeed_dropped_samples_total", source=source, reason=r)
                       for r in ("drop_last", "stopped", "error")),
        "buffered": get("blobfeed_buffered_samples", source=source),
    }


def assert_identity_at_rest(gc: blobfeed.GlobalCoordinator, nets: Sequence[Net], source: str = SRC) -> dict[str, float]:
    seen: list[dict[str, float]] = []

    def exact() -> bool:
        a = accounts(gc, nets, source)
        seen.append(a)
        return a["fetched"] == a["delivered"] + a["dropped"] + a["buffered"]

    try:
        wait_until(exact, "the accounting identity at rest")
    except AssertionError:
        raise AssertionError(f"fetched != delivered + dropped + buffered: {seen[-1]}") from None
    return seen[-1]


def wait_file(path: Path, timeout: float = WAIT) -> str:
    wait_until(lambda: path.exists() and path.read_text() != "", f"{path} to be written", timeout)
    return path.read_text()


def gone(pid: int) -> bool:
    """The process no longer runs (reaped, or a zombie nobody reaps)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def children_of(pid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.add(int(d))
    return out


def descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        kids = children_of(todo.pop())
        todo.extend(kids - out)
        out |= kids
    return out


def dev_shm() -> set[str]:
    """What /dev/shm holds, but for what `blobfeed bench` (another program of
    this repository, which may run meanwhile) makes there."""
    return {n for n in os.listdir("/dev/shm") if not n.startswith("blobfeed-bench")}


def no_new_shm(before: set[str]) -> None:
    """/dev/shm holds nothing more than ``before``.  It is the machine's:
    other programs (a benchmark's multiprocessing semaphores, say) pass
    through it meanwhile, so only what stays counts."""
    seen: list[set[str]] = []

    def settled() -> bool:
        seen.append(dev_shm() - before)
        return not seen[-1]

    try:
        wait_until(settled, "/dev/shm to hold nothing new")
    except AssertionError:
        raise AssertionError(f"left in /dev/shm: {sorted(seen[-1])}") from None


def shm_mappings(pid: int) -> list[str]:
    """The /dev/shm files process ``pid`` maps (memfds show as /memfd:...)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [ln.split(None, 5)[-1].strip() for ln in f if "/dev/shm/" in ln]
    except OSError:
        return []


def blobfeed_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("blobfeed-")}


def views_shared_memory(a: np.ndarray) -> bool:
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return isinstance(base, mmap.mmap)


def run_child(code: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, cwd=str(ROOT))


def until_error(net: Net, deadline: float, pace: float = 0.0) -> tuple[BaseException, int]:
    """run() until it raises (bounded by ``deadline``); the error and the batches before it."""
    n = 0
    while True:
        assert time.monotonic() < deadline, f"no error from run() after {n} batches"
        try:
            net.run(timeout=max(0.01, deadline - time.monotonic()))
        except (FetcherError, EndOfInput, DequeueTimeout) as err:
            return err, n
        n += 1
        if pace:
            time.sleep(pace)


def new_net(name: str = "n") -> Net:
    return Net(name=name)


# ---------------------------------------------------------------------------------------------
# exactly once, order, exact batches
# ---------------------------------------------------------------------------------------------
SHM_SIZES = [[SHM_ROWS, 300, 999, SHM_ROWS + 7], [500, SHM_ROWS, 777]]
PIPE_SIZES = [[1, 7, 3, 40, 2, 9, 13, 1, 1, 5], [4, 4, 4, 31, 2]]
# small (pipe), large (slots) and larger than a slot (pipe again) from one worker, in order
MIXED_SIZES = [[3, SHM_ROWS, 5, 900, 1, 1, SHM_ROWS + 1, 17], [SHM_ROWS, 2, 600, 40, SHM_ROWS]]


@pytest.mark.parametrize("drop_last", [False, True], ids=["last-partial", "drop-last"])
@pytest.mark.parametrize("path, sizes", [("shm", SHM_SIZES), ("pipe", PIPE_SIZES), ("mixed", MIXED_SIZES)])
def test_exactly_once_and_in_order(gc: blobfeed.GlobalCoordinator, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture, path: str, sizes: list[list[int]],
                                   drop_last: bool) -> None:
    caplog.set_level(logging.WARNING, logger="blobfeed")
    counter = PathCounter(monkeypatch)
    batch_size = 64
    net = new_net()
    # slots of 128 KiB: the 900- and 999-sample chunks (~230 KiB) go through the pipe
    backend = ProcessBackend(slots=3, slot_bytes=128 * 1024)
    init_data_input_workers(net, ["ids", "feat"], Plan(sizes), batch_size, backend=backend,
                            drop_last=drop_last, max_buffered_batches=4, coordinator=gc, seed=1)
    gc.start()
    batches = drain(net)
    total = sum(map(sum, sizes))
    chunks = expected_chunks(sizes, gc.get_worker_ids())
    ids = check_batches(batches, batch_size, partial_last=not drop_last)
    if drop_last:
        assert len(ids) == total - total % batch_size
        assert sample(gc, "blobfeed_dropped_samples_total", source=SRC, reason="drop_last") == total % batch_size
    else:
        assert len(ids) == total
        assert len(batches[-1]["ids"]) == (total % batch_size or batch_size)
    assert_exactly_once_in_order(ids, chunks, complete=not drop_last)
    with pytest.raises(EndOfInput):
        net.run(timeout=WAIT)
    shm = sum(1 for plan in sizes for n in plan if SHM_MIN_BYTES <= chunk_bytes(n) <= 128 * 1024)
    assert counter.slots == shm, f"{counter.slots} chunks came through slots, expected {shm}"
    # a chunk too big for a slot travels pickled, and says so once per worker
    big = sum(1 for plan in sizes if any(chunk_bytes(n) > 128 * 1024 for n in plan))
    notes = [r for r in caplog.records if "larger than a shared-memory slot" in r.getMessage()]
    assert len(notes) == big, [r.getMessage() for r in notes]
    assert sample(gc, "blobfeed_fetched_samples_total", source=SRC) == total
    assert sample(gc, "blobfeed_transport_bytes_total", source=SRC, backend="processes") > 0
    assert_identity_at_rest(gc, [net])


def test_lambda_and_closure_travel_by_cloudpickle(gc: blobfeed.GlobalCoordinator) -> None:
    rows = 6
    left = {"calls": 3}  # captured: each child gets its own copy

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        if left["calls"] == 0:
            raise StopIteration
        left["calls"] -= 1
        return make_chunk(worker_id, 3 - left["calls"] - 1, rows, 2)

    net = new_net()
    init_data_input_workers(net, ["ids", "feat"], fetch, 4, backend="processes", coordinator=gc,
                            worker_init_fun=lambda wid: None)
    gc.start()
    ids = check_batches(drain(net), 4, partial_last=True)
    assert_exactly_once_in_order(ids, expected_chunks([[rows] * 3] * 2, gc.get_worker_ids()))


# ---------------------------------------------------------------------------------------------
# get_worker_info, worker_init_fun
# ---------------------------------------------------------------------------------------------
def worker_infos(backend: Any, timeout: float = WAIT) -> np.ndarray:
    _SENT.clear()
    _INIT.clear()
    gc = blobfeed.GlobalCoordinator()
    try:
        net = new_net()
        init_data_input_workers(net, ["info"], info_fetch, 1, num_worker_threads=3, backend=backend,
                                worker_init_fun=record_init, coordinator=gc, seed=20240607)
        gc.start()
        rows = np.concatenate([b["info"] for b in drain(net, timeout)])
    finally:
        assert gc.stop(timeout=WAIT)
    return rows[np.argsort(rows[:, 0])]


def test_worker_info_in_the_child_equals_the_threads() -> None:
    threads = worker_infos("threads")
    procs = worker_infos("processes")
    # worker_id, index, num_workers, seed, three rng draws, source ok, init ran here
    np.testing.assert_array_equal(procs[:, :9], threads[:, :9])
    np.testing.assert_array_equal(procs[:, :3], [[0, 0, 3], [1, 1, 3], [2, 2, 3]])
    assert (procs[:, 7] == 1).all(), "get_worker_info().source in the child"
    assert (procs[:, 8] == 1).all(), "worker_init_fun did not run in the child before its first fetch"
    pids = {int(p) for p in procs[:, 9]}
    assert len(pids) == 3 and os.getpid() not in pids, "each worker is a process of its own"
    assert (threads[:, 9] == os.getpid()).all()
    assert get_worker_info() is None


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def fetcher_error(gc: blobfeed.GlobalCoordinator, fetch: Any, stamp: Path, **kw: Any) -> tuple[FetcherError, float]:
    """Run until run() raises; the error and its delay after ``stamp``'s time."""
    net = new_net()
    init_data_input_workers(net, ["ids", "feat"], fetch, 4, backend="processes", coordinator=gc, **kw)
    gc.start()
    err, _ = until_error(net, time.monotonic() + WAIT)
    seen = time.time()
    assert isinstance(err, FetcherError), err
    return err, seen - float(wait_file(stamp))


def notes_and_message(err: BaseException) -> str:
    return "\n".join([str(err), *getattr(err, "__notes__", [])])


@pytest.mark.parametrize("kind", ["value", "two-arg", "default-arg", "locked"])
def test_exception_reaches_run_as_the_original_object(gc: blobfeed.GlobalCoordinator, tmp_path: Path,
                                                      kind: str) -> None:
    stamp = tmp_path / "stamp"
    err, delay = fetcher_error(gc, Raiser(kind, 3, str(stamp)), stamp, num_worker_threads=1)
    assert delay < 1.0, f"the error reached run() {delay:.2f} s after the raise"
    cause = err.__cause__
    wid = gc.get_worker_ids()[0]
    if kind == "value":
        assert type(cause) is ValueError and cause.args == ("boom", wid, 3)
    elif kind == "two-arg":
        assert type(cause) is TwoArgError, repr(cause)
        assert cause.args == ("/data/shard-7 failed with code 7",)
        assert (cause.path, cause.code) == ("/data/shard-7", 7)
    elif kind == "default-arg":
        assert type(cause) is DefaultArgError, repr(cause)
        assert cause.args == ("/data/x:5",) and (cause.path, cause.code) == ("/data/x", 5)
    else:
        assert type(cause) is RuntimeError, repr(cause)
        assert "LockedError" in str(cause) and f"locked boom {wid}" in str(cause)
    text = notes_and_message(err)
    assert f"source {SRC!r}, worker {wid}" in text
    assert "Traceback" in text and "in __call__" in text and "test_processes.py" in text, text


def test_malformed_chunk_is_a_chunk_error_through_shared_memory(gc: blobfeed.GlobalCoordinator) -> None:
    """A small one (pickled): tests/contract/test_errors.py."""
    rows = SHM_ROWS + 3
    net = new_net()
    init_data_input_workers(net, ["ids", "feat"], Malformed(rows), 4, num_worker_threads=1,
                            backend="processes", coordinator=gc)
    gc.start()
    err, _ = until_error(net, time.monotonic() + WAIT)
    assert isinstance(err, ChunkError), err
    wid = gc.get_worker_ids()[0]
    assert f"source {SRC!r}, worker {wid}, blob 'feat'" in str(err)
    assert f"expected {rows} samples" in str(err) and f"got {rows - 1}" in str(err)
    assert_identity_at_rest(gc, [net])


def test_a_failed_source_ends_its_other_workers(gc: blobfeed.GlobalCoordinator) -> None:
    """on_error="raise": the source stops, and so do its other workers (as
    threads do), by themselves and without being counted as deaths."""
    net = new_net()
    init_data_input_workers(net, ["ids", "feat", "pid"], FailFirst(), 4, num_worker_threads=2,
                            backend="processes", coordinator=gc)
    gc.start()
    pid = int(net.run(timeout=WAIT)["pid"][0])
    err, _ = until_error(net, time.monotonic() + WAIT)
    assert isinstance(err, FetcherError) and isinstance(err.__cause__, ValueError)
    wait_until(lambda: gone(pid), "the healthy worker of the failed source to end", 2.0)
    assert sample(gc, "blobfeed_worker_deaths_total", source=SRC, backend="processes") == 0
    assert_identity_at_rest(gc, [net])


def test_a_fetch_fun_the_worker_cannot_load_is_a_fetcher_error(gc: blobfeed.GlobalCoordinator) -> None:
    """fetch_fun pickled by reference to a module the worker cannot import
    (made at run time here; a notebook's or a path-imported module in life)."""
    ghost = types.ModuleType("blobfeed_test_ghost_module")
    exec("def fetch(worker_id, batch_size):\n    raise StopIteration\n", ghost.__dict__)
    sys.modules[ghost.__name__] = ghost
    try:
        net = new_net()
        init_data_input_workers(net, ["ids", "feat"], ghost.fetch, 4, num_worker_threads=1,
                                backend="processes", coordinator=gc)
        gc.start()
        err, _ = until_error(net, time.monotonic() + WAIT)
    finally:
        del sys.modules[ghost.__name__]
    assert isinstance(err, FetcherError), err
    text = notes_and_message(err)
    assert "blobfeed_test_ghost_module" in text and "ModuleNotFoundError" in text, text
    assert "died" not in text, text


# ---------------------------------------------------------------------------------------------
# deaths
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("consumer", ["slow", "idle"])
@pytest.mark.parametrize("how, says", [
    ("kill", "SIGKILL"), ("exit3", "code 3"), ("exit0", "code 0"), ("segv", "SIGSEGV"),
])
def test_a_dead_worker_is_a_fetcher_error_within_a_second(gc: blobfeed.GlobalCoordinator, tmp_path: Path,
                                                          how: str, says: str, consumer: str) -> None:
    """A backlog waits in the queues (the consumer is slow, or idle for a
    second): the death must still reach run() within a second, and no
    accepted sample is lost silently."""
    stamp = tmp_path / "stamp"
    net = new_net()
    # As many chunks as slots, each of four batches, and small queues: when
    # the worker dies, its last chunks are still on their way (its receiver
    # waits for room in the internal queue, one more waits in the pipe).
    dier = Dier("hang" if how == "kill" else how, 4, str(stamp))
    init_data_input_workers(net, ["ids", "feat", "pid"], dier, 32, num_worker_threads=1,
                            backend=ProcessBackend(slots=4, slot_bytes=128 * 1024),
                            max_buffered_batches=1, device_queue_capacity=1, coordinator=gc)
    gc.start()
    w0 = gc.get_worker_ids()[0]
    stamped, pid_text = wait_file(stamp).split()
    pid = int(pid_text)
    if how == "kill":
        time.sleep(0.1)  # inside fetch_fun for good, with a backlog behind it
        died_at = time.time()
        os.kill(pid, signal.SIGKILL)
    else:
        died_at = float(stamped)
    if consumer == "idle":
        # the error is there before a second is out: the next run() raises it
        time.sleep(max(0.0, died_at + 0.8 - time.time()))
        asked = time.time()
        err, n = until_error(net, time.monotonic() + WAIT)
        assert n == 0, f"run() returned {n} batches of a source whose worker died {asked - died_at:.2f} s ago"
        delay = asked - died_at
    else:  # 20 batches/s
        err, n = until_error(net, time.monotonic() + WAIT, pace=0.05)
        delay = time.time() - died_at
    assert isinstance(err, FetcherError), err
    assert delay < 1.0, f"the death reached run() after {delay:.2f} s and {n} batches"
    text = str(err)
    assert f"worker {w0}" in text and says in text, text
    assert f"pid {pid}" in text
    assert sample(gc, "blobfeed_worker_deaths_total", source=SRC, backend="processes") == 1
    acc = assert_identity_at_rest(gc, [net])
    assert acc["fetched"] > 0


@pytest.mark.parametrize("start_method, tries", [("forkserver", 8), ("spawn", 3)])
def test_the_exit_code_is_exact_every_time(gc: blobfeed.GlobalCoordinator, tmp_path: Path,
                                           start_method: str, tries: int) -> None:
    """The watcher and the receiver both learn of a death at once: they must
    not race to read the exit status (the loser of that race in
    multiprocessing sees EOF and makes it 255); and a spawned child's
    sentinel says "ended" a moment before it can be reaped."""
    for i in range(tries):
        coord = blobfeed.GlobalCoordinator()
        net = new_net(f"n{i}")
        init_data_input_workers(net, ["ids", "feat", "pid"], Dier("exit3", 1, str(tmp_path / f"s{i}"), rows=4),
                                4, num_worker_threads=1, backend=ProcessBackend(start_method=start_method),
                                coordinator=coord)
        try:
            coord.start()
            err, _ = until_error(net, time.monotonic() + WAIT)
        finally:
            assert coord.stop(timeout=WAIT)
        assert isinstance(err, FetcherError) and "exited with code 3" in str(err), f"try {i}: {err}"


def test_workers_outlive_the_thread_that_started_them(gc: blobfeed.GlobalCoordinator) -> None:
    """PR_SET_PDEATHSIG fires when the parent *thread* ends: with "spawn" the
    workers' parent thread is whichever called start()."""
    net = new_net()
    init_data_input_workers(net, ["ids", "feat", "pid"], PidChunks(8, 2), 8, num_worker_threads=1,
                            backend=ProcessBackend(start_method="spawn"), coordinator=gc)

    def starter() -> None:
        gc.start()
        net.run(timeout=30)  # the worker runs (its start-up is done)

    t = threading.Thread(target=starter, name="test-starter")
    t.start()
    t.join(40)
    assert not t.is_alive()
    time.sleep(0.2)
    for _ in range(20):
        net.run(timeout=WAIT)
    assert sample(gc, "blobfeed_worker_deaths_total", source=SRC, backend="processes") == 0


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_stop_with_a_worker_stuck_in_fetch_fun(tmp_path: Path, start_method: str) -> None:
    gc = blobfeed.GlobalCoordinator()
    pidfile = tmp_path / "pid"
    net = new_net()
    init_data_input_workers(net, ["ids", "feat"], Stuck(str(pidfile)), 4, num_worker_threads=2,
                            backend=ProcessBackend(start_method=start_method), coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)  # the other worker delivers
    pid = int(wait_file(pidfile))
    t0 = time.monotonic()
    assert gc.stop(timeout=WAIT) is True
    took = time.monotonic() - t0
    assert took < 2.0, f"stop() took {took:.2f} s"
    wait_until(lambda: gone(pid), f"the stuck worker {pid} to be gone", 2.0)
    assert not multiprocessing.active_children()
    assert not blobfeed_threads()
    # the death it took to stop it is no death
    assert sample(gc, "blobfeed_worker_deaths_total", source=SRC, backend="processes") == 0


# ---------------------------------------------------------------------------------------------
# nothing left behind
# ---------------------------------------------------------------------------------------------
def one_cycle(tmp_path: Path, i: int) -> None:
    gc = blobfeed.GlobalCoordinator()
    net = new_net()
    fetch: Any = PidChunks(SHM_ROWS) if i % 2 else Stuck(str(tmp_path / f"pid{i}"))
    init_data_input_workers(net, ["ids", "feat"] + (["pid"] if i % 2 else []), fetch, 16,
                            num_worker_threads=2, backend="processes", coordinator=gc)
    gc.start()
    kept = net.run(timeout=WAIT)  # a batch the user keeps past stop()
    assert gc.stop(timeout=WAIT)
    assert kept["ids"].shape == (16,)


@pytest.fixture
def fetchers_by_value() -> Iterator[None]:
    """This module's fetchers travel by value (as a notebook's do), so that
    a worker does not import this module (and pytest) to start: a cycle then
    costs a fork, not 0.3 s of imports."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_nothing_left_behind_over_many_cycles(tmp_path: Path, fetchers_by_value: None) -> None:
    """10 start/stop cycles, half of them with a worker stuck in fetch_fun
    (killed), each keeping a batch past stop(): no process, thread,
    descriptor or /dev/shm entry more than before.  The sets must come back
    exactly, so one process, thread, descriptor or segment left behind per
    cycle fails at the first; ten (five of each kind) also catch one left
    by a cycle in every few."""
    one_cycle(tmp_path, 1)  # warm up: the forkserver and its pipes are made once
    pygc.collect()  # what earlier tests left to the collector goes now, not during the cycles
    me = os.getpid()
    fds = set(os.listdir("/proc/self/fd"))
    shm = dev_shm()
    procs = descendants(me)
    threads = blobfeed_threads()
    pygc.disable()  # nothing may wait for the collector (reference cycles) to be let go of
    try:
        for i in range(10):
            one_cycle(tmp_path, i)
    finally:
        pygc.enable()
    assert not multiprocessing.active_children()
    wait_until(lambda: descendants(me) == procs, "the worker processes to be gone")
    assert blobfeed_threads() == threads
    left = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in set(os.listdir("/proc/self/fd")) - fds
            if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not left, f"descriptors left open: {left}"
    no_new_shm(shm)


PARENT = """
    import json, os, sys, time
    import numpy as np
    import blobfeed

    def fetch(worker_id, batch_size):
        n = 200
        return [np.zeros((n, 64), np.float32), np.full(n, os.getpid(), np.int64)]

    if __name__ == "__main__":
        net = blobfeed.Net(name="n")
        blobfeed.init_data_input_workers(net, ["x", "pid"], fetch, 50, num_worker_threads=3,
                                         backend=blobfeed.ProcessBackend(start_method=sys.argv[1]))
        blobfeed.global_coordinator.start()
        pids = set()
        while len(pids) < 3:
            pids.add(int(net.run(timeout=10)["pid"][0]))
        print(json.dumps(sorted(pids)), flush=True)
        time.sleep(60)
"""


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_parent_killed_with_sigkill_leaves_nothing(start_method: str) -> None:
    shm = dev_shm()
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PARENT), start_method], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        line = ""
        deadline = time.monotonic() + 20
        assert proc.stdout is not None
        while not line.startswith("[") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith("["), f"no pids from the parent: {line!r} {proc.stderr.read() if proc.stderr else ''}"
        workers = set(json.loads(line))
        tree = descendants(proc.pid)  # the workers, the forkserver, the resource tracker
        assert workers <= tree
        assert not [m for p in {proc.pid, *tree} for m in shm_mappings(p)], "a named segment"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        wait_until(lambda: all(gone(p) for p in tree), "every child of the killed parent to die", 5.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    no_new_shm(shm)


@pytest.mark.parametrize("ending", ["stop", "atexit", "end-of-input"])
def test_no_stderr_output_at_a_normal_exit(ending: str) -> None:
    proc = run_child(f"""
        import os, numpy as np
        import blobfeed

        def fetch(worker_id, batch_size, state={{"n": 0}}):
            state["n"] += 1
            if state["n"] > 30:
                raise StopIteration
            return [np.ones((300, 64), np.float32) * worker_id]

        gc = blobfeed.GlobalCoordinator()
        net = blobfeed.Net(name="n")
        blobfeed.init_data_input_workers(net, ["x"], fetch, 64, backend="processes", coordinator=gc)
        gc.start()
        for _ in range(5):
            net.run(timeout=10)
        if {ending!r} == "end-of-input":
            for _ in net:
                pass
        if {ending!r} != "atexit":
            assert gc.stop(timeout=5)
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert proc.stderr == "", proc.stderr


CTRL_C = """
    import numpy as np
    import blobfeed

    def fetch(worker_id, batch_size):
        return [np.ones((300, 64), np.float32)]

    gc = blobfeed.GlobalCoordinator()
    net = blobfeed.Net(name="n")
    blobfeed.init_data_input_workers(net, ["x"], fetch, 64, backend="processes", coordinator=gc)
    gc.start()
    try:
        for i, _ in enumerate(net):
            if i == 5:
                print("ready", flush=True)
    except KeyboardInterrupt:
        print("interrupted", gc.stop(timeout=5), flush=True)
"""


def test_ctrl_c_is_the_parents_to_handle() -> None:
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process
    group, workers included: they must leave it to the program (which gets
    its KeyboardInterrupt and stops), not die of it with a traceback each
    and turn the interrupt into a FetcherError."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CTRL_C)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(ROOT), start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", line
        time.sleep(0.2)  # the workers are blocked waiting for room (slots, the pipe)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    assert (proc.returncode, out.strip(), err) == (0, "interrupted True", "")


# ---------------------------------------------------------------------------------------------
# refused at once
# ---------------------------------------------------------------------------------------------
def test_unpicklable_fetch_fun_is_a_type_error_before_anything_starts(gc: blobfeed.GlobalCoordinator) -> None:
    before = descendants(os.getpid())
    net = new_net()
    with pytest.raises(TypeError, match=r"fetch_fun .*LockedFetcher.*(lock|pickle)") as info:
        init_data_input_workers(net, ["ids", "feat"], LockedFetcher(), 4, backend="processes", coordinator=gc)
    assert "_thread.lock" in str(info.value)
    with pytest.raises(TypeError, match=r"worker_init_fun .*(lock|pickle)"):
        init_data_input_workers(net, ["ids", "feat"], Endless(4, 2), 4, backend="processes", coordinator=gc,
                                worker_init_fun=LockedInit())
    assert gc.get_worker_ids() == []
    gc.start()  # nothing to start
    assert not multiprocessing.active_children() and descendants(os.getpid()) <= before
    # the net can still be fed
    init_data_input_workers(net, ["ids", "feat"], Plan([[3]], 2), 4, num_worker_threads=1,
                            backend="processes", coordinator=gc)
    gc.start()
    assert len(drain(net)) == 1


def test_a_shared_memory_area_too_large_is_a_clear_error_at_start(gc: blobfeed.GlobalCoordinator) -> None:
    slot_bytes = 2**40
    net = new_net()
    init_data_input_workers(net, ["ids", "feat"], Endless(4, 2), 4, num_worker_threads=2,
                            backend=ProcessBackend(slots=4, slot_bytes=slot_bytes), coordinator=gc)
    before = descendants(os.getpid())
    with pytest.raises(BlobfeedError) as info:
        gc.start()
    text = str(info.value)
    need_mib = 2 * 4 * slot_bytes // 2**20
    assert f"{need_mib} MiB" in text and "available" in text, text
    assert not multiprocessing.active_children() and descendants(os.getpid()) <= before


def test_the_room_for_shared_memory_is_within_the_cgroup_limit(tmp_path: Path) -> None:
    """In a container the machine's MemAvailable is not what this process may
    use: its memfd pages count against its cgroup's limit (an OOM kill later
    otherwise)."""
    from blobfeed.feeders.transport import mem_available

    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    (tmp_path / "cgroup").write_text("0::/a/b\n")
    for d, limit, used in (("a", "max", "0"), ("a/b", str(2**30), str(2**28))):
        (tmp_path / "root" / d).mkdir(parents=True)
        (tmp_path / "root" / d / "memory.max").write_text(limit + "\n")
        (tmp_path / "root" / d / "memory.current").write_text(used + "\n")
    paths = dict(meminfo=str(tmp_path / "meminfo"), cgroup=str(tmp_path / "cgroup"),
                 cgroup_root=str(tmp_path / "root"))
    assert mem_available(**paths) == 2**30 - 2**28
    (tmp_path / "root" / "a" / "memory.max").write_text(str(2**29) + "\n")  # a tighter parent
    assert mem_available(**paths) == 2**29
    (tmp_path / "cgroup").write_text("0::/\n")  # no limit: the machine's
    assert mem_available(**paths) == 8388608 * 1024
    # cgroup v1, the mount showing the container's own cgroup at its root
    (tmp_path / "cgroup").write_text("4:memory:/docker/0123abc\n0::/\n")
    (tmp_path / "root" / "memory").mkdir()
    (tmp_path / "root" / "memory" / "memory.limit_in_bytes").write_text(str(2**31) + "\n")
    (tmp_path / "root" / "memory" / "memory.usage_in_bytes").write_text(str(2**30) + "\n")
    assert mem_available(**paths) == 2**30
    assert mem_available() is not None  # this machine


# ---------------------------------------------------------------------------------------------
# batches the user keeps
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_rows, batch_size", [(1024, 128), (SHM_ROWS, SHM_ROWS)],
                         ids=["batches-inside-chunks", "batch-is-a-chunk"])
def test_kept_batches_are_never_overwritten_and_do_not_stall(gc: blobfeed.GlobalCoordinator,
                                                             chunk_rows: int, batch_size: int) -> None:
    slots = 4
    keep = 2 * slots
    net = new_net()
    init_data_input_workers(net, ["ids", "feat"], Endless(chunk_rows), batch_size, num_worker_threads=2,
                            backend=ProcessBackend(slots=slots, slot_bytes=chunk_rows * (WIDE * 4 + 8) + 4096),
                            max_buffered_batches=4, coordinator=gc)
    gc.start()
    kept: collections.deque[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = collections.deque(maxlen=keep)
    views = 0
    deadline = time.monotonic() + WAIT
    for i in range(300):
        assert time.monotonic() < deadline, f"the feed stalled after {i} batches with {keep} kept"
        b = net.run(timeout=2.0)
        views += views_shared_memory(b["feat"])
        kept.append((b, {k: np.array(v) for k, v in b.items()}))
        for got, copy in kept:
            for k in copy:
                np.testing.assert_array_equal(got[k], copy[k], err_msg=f"a kept batch was overwritten ({k})")
    assert views > 0, "no batch was a view of shared memory: the test proves nothing"
    check_batches([c for _, c in kept], batch_size, partial_last=False)


def test_a_kept_view_does_not_stall_a_small_ring(gc: blobfeed.GlobalCoordinator) -> None:
    """Two slots, the first batch (a view of one) kept: the other slot must
    keep circulating; nothing in blobfeed may hold a chunk it is done with."""
    net = new_net()
    init_data_input_workers(net, ["ids", "feat"], SlowAfterFirst(SHM_ROWS, 0.1), SHM_ROWS, num_worker_threads=1,
                            backend=ProcessBackend(slots=2, slot_bytes=64 * 1024), coordinator=gc)
    gc.start()
    first = net.run(timeout=WAIT)
    assert views_shared_memory(first["feat"])
    copy = {k: np.array(v) for k, v in first.items()}
    for i in range(6):
        try:
            net.run(timeout=2.0)
        except DequeueTimeout:
            raise AssertionError(f"the feed stalled after {i + 1} batches with one kept") from None
    for k in copy:
        np.testing.assert_array_equal(first[k], copy[k])


def test_batches_inside_a_chunk_are_views_with_a_slow_consumer(gc: blobfeed.GlobalCoordinator) -> None:
    """The workers are ahead (every slot written, the queue full), as when the
    model is the bottleneck: a batch that lies inside one chunk is still a
    view of its slot, not a copy (SPEC: the parent copies a byte at most once
    more, when a batch spans chunks)."""
    rows, batch_size = 1024, 128
    net = new_net()
    init_data_input_workers(net, ["ids", "feat"], Endless(rows), batch_size, num_worker_threads=2,
                            backend=ProcessBackend(slots=4, slot_bytes=rows * (WIDE * 4 + 8) + 4096),
                            coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)
    time.sleep(0.2)  # let the workers fill their slots
    views = 0
    for _ in range(200):
        views += views_shared_memory(net.run(timeout=WAIT)["feat"])
        time.sleep(0.002)
    assert views >= 180, f"only {views} of 200 batches lying inside one chunk were views"


def test_dropping_a_batch_runs_no_python_code_in_the_dropping_thread(gc: blobfeed.GlobalCoordinator) -> None:
    """A slot goes back to its worker when the last view of it dies, which is
    wherever the user drops a batch: often the main thread, where Ctrl-C
    raises KeyboardInterrupt at any Python bytecode.  Python code run there
    by a finalizer would have the interrupt swallowed ("Exception ignored")
    and the slot lost, so the release must run elsewhere."""
    net = new_net()
    init_data_input_workers(net, ["ids", "feat"], Endless(SHM_ROWS), SHM_ROWS, num_worker_threads=1,
                            backend=ProcessBackend(slots=4, slot_bytes=64 * 1024), coordinator=gc)
    gc.start()
    for _ in range(20):
        kept = [net.run(timeout=WAIT)]  # a whole chunk: the only views of its slot
        net.run(timeout=WAIT)  # the net's workspace lets go of it
        if views_shared_memory(kept[0]["feat"]):
            break
    else:
        raise AssertionError("no batch was a view of shared memory")
    calls = python_calls_during(kept.clear)
    assert not calls, f"Python code ran where the batch was dropped: {calls}"
    for _ in range(20):  # and the slot did go back (four slots, all of them needed)
        net.run(timeout=2.0)


# -- found in review: slots, dont_rebatch, structured dtypes ------------------------------


def one_big_sample(worker_id: int, batch_size: int) -> list[np.ndarray]:
    """One sample of 64 KiB per call: each chunk takes a slot of its own."""
    info = blobfeed.get_worker_info()
    one_big_sample.calls = getattr(one_big_sample, "calls", 0) + 1  # type: ignore[attr-defined]
    ident = info.index * 1_000_000 + one_big_sample.calls  # type: ignore[attr-defined]
    return [np.full((1, 16 * 1024), ident, np.float32)]


def test_a_batch_needing_more_chunks_than_there_are_slots_does_not_hang() -> None:
    """Trap (review): every big chunk held a slot until its samples left the
    re-batcher, so a batch spanning more chunks than all workers' slots
    waited for the child while the child waited for a slot: the usual
    one-image-per-call fetcher with batch 32 and 2 x 8 slots hung."""
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    blobfeed.init_data_input_workers(net, ["x"], one_big_sample, 32, num_worker_threads=2,
                                     backend="processes", coordinator=gc)
    gc.start()
    try:
        for _ in range(5):
            out = net.run(timeout=10)
            assert out["x"].shape == (32, 16 * 1024)
    finally:
        assert gc.stop(timeout=WAIT) is True


def thousand_rows(worker_id: int, batch_size: int) -> list[np.ndarray]:
    return [np.ones((1000, 64), np.float32)]


def test_keeping_the_last_batches_with_a_small_ring_does_not_stall() -> None:
    """Trap (review): with 4 slots and the user keeping the last 24 batches,
    the feed stalled after about 85 batches."""
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    blobfeed.init_data_input_workers(net, ["x"], thousand_rows, 128, num_worker_threads=1,
                                     backend=blobfeed.ProcessBackend(slots=4), coordinator=gc)
    gc.start()
    kept: collections.deque[np.ndarray] = collections.deque(maxlen=24)
    try:
        for _ in range(300):
            kept.append(net.run(timeout=10)["x"])
    finally:
        assert gc.stop(timeout=WAIT) is True


def structured(worker_id: int, batch_size: int) -> list[np.ndarray]:
    n = 8 if blobfeed.get_worker_info().index == 0 else 20_000  # a pipe chunk and a slot chunk
    a = np.zeros(n, dtype=[("a", "<f4"), ("b", "<i4")])
    a["a"] = 1.5
    a["b"] = 7
    return [a]


def test_structured_dtypes_keep_their_fields_through_a_slot() -> None:
    """Trap (review): a chunk through shared memory carried only `dtype.str`
    ('|V8'), losing a structured dtype's fields; mixed with a pipe chunk the
    source then failed."""
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    blobfeed.init_data_input_workers(net, ["x"], structured, 64, num_worker_threads=2,
                                     backend="processes", coordinator=gc)
    gc.start()
    try:
        for _ in range(20):
            x = net.run(timeout=10)["x"]
            assert x.dtype.names == ("a", "b")
            assert (x["a"] == 1.5).all() and (x["b"] == 7).all()
    finally:
        assert gc.stop(timeout=WAIT) is True


def test_two_slots_and_a_kept_view_never_stall(gc: blobfeed.GlobalCoordinator) -> None:
    """Defect (issue 17): with ``slots=2`` (the minimum) a batch could view
    one of the two slots; the user keeping it left one slot circulating, and
    a chunk of 1.5 batches whose rest waited there for the next chunk held
    it: the worker waited for a slot, the batch for the worker.  Any chunk
    that lands in the only slot no batch views is now copied out at once."""
    batch = SHM_ROWS
    rows = batch * 3 // 2  # every other batch spans two chunks
    net = new_net()
    # after the first chunk the worker is slower than the net: its other slot is free
    init_data_input_workers(net, ["ids", "feat"], SlowAfterFirst(rows, 0.02), batch, num_worker_threads=1,
                            backend=ProcessBackend(slots=2, slot_bytes=chunk_bytes(rows) + 4096),
                            coordinator=gc)
    gc.start()
    for _ in range(20):  # keep the first batch that is a view of a slot
        first = net.run(timeout=WAIT)
        if views_shared_memory(first["feat"]):
            break
    else:
        raise AssertionError("no batch was a view of shared memory: the test proves nothing")
    copy = {k: np.array(v) for k, v in first.items()}
    got = []
    for i in range(12):
        try:
            got.append({k: np.array(v) for k, v in net.run(timeout=2.0).items()})
        except DequeueTimeout:
            raise AssertionError(f"the feed stalled after {i} batches with one of two slots kept") from None
    for k in copy:
        np.testing.assert_array_equal(first[k], copy[k], err_msg="the kept batch was overwritten")
    check_batches(got, batch, partial_last=False)


class ForksAHelper:
    """Worker index 0 forks a long-lived helper process on its first call
    (it inherits the worker's end of the pipe, and whatever the worker
    maps), writing the helper's pid to ``pidfile``; chunks forever."""

    def __init__(self, pidfile: str, rows: int = SHM_ROWS) -> None:
        self.pidfile, self.rows = pidfile, rows
        self.n = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        info = get_worker_info()
        assert info is not None
        if info.index == 0 and self.n == 0:
            pid = os.fork()
            if pid == 0:  # the helper: lives on, touches nothing
                try:
                    time.sleep(60)
                finally:
                    os._exit(0)
            Path(self.pidfile).write_text(str(pid))
        self.n += 1
        return make_chunk(worker_id, self.n % 1000, self.rows)


def test_a_helper_forked_by_fetch_fun_does_not_hold_up_stop(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Defect (issue 17): the helper kept the worker's pipe open, so the
    receiver waited for an EOF that never came; stop() returned False after
    5 s and the log blamed "a fetch_fun that never returns" for blobfeed's
    own receiver.  A worker's end no longer depends on every inheritor of its
    pipe closing: stop() returns True at once and leaves nothing behind (the
    helper, the user's, lives on without blobfeed's shared memory)."""
    pidfile = tmp_path / "helper"
    one_cycle(tmp_path, 1)  # the forkserver and its pipes are made once
    pygc.collect()
    fds = set(os.listdir("/proc/self/fd"))
    gc = blobfeed.GlobalCoordinator()
    net = new_net()
    helper = 0
    try:
        init_data_input_workers(net, ["ids", "feat"], ForksAHelper(str(pidfile)), 16, num_worker_threads=2,
                                backend=ProcessBackend(slots=4, slot_bytes=64 * 1024), coordinator=gc)
        gc.start()
        for _ in range(10):
            net.run(timeout=WAIT)
        helper = int(wait_file(pidfile))
        assert not gone(helper)
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="blobfeed"):
            ok = gc.stop(timeout=WAIT)
        took = time.monotonic() - t0
        assert ok is True, f"stop() returned False: {[r.getMessage() for r in caplog.records]}"
        assert took < 2.0, f"stop() took {took:.2f} s"
        assert not any("never returns" in r.getMessage() for r in caplog.records)
        assert not blobfeed_threads()
        assert not multiprocessing.active_children()
        del net  # its workspace's last batch views a slot: the mapping goes with it
        pygc.collect()
        left = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in set(os.listdir("/proc/self/fd")) - fds
                if os.path.exists(f"/proc/self/fd/{fd}")}
        assert not left, f"descriptors left open: {left}"
        assert not gone(helper), "the helper is the user's: blobfeed does not kill it"
        maps = Path(f"/proc/{helper}/maps").read_text()
        assert "memfd:blobfeed" not in maps, "the helper still maps the worker's shared memory"
    finally:
        if helper:
            os.kill(helper, signal.SIGKILL)


# -- the worker loop every backend runs ---------------------------------------------------------
def test_the_worker_loop_says_everything_as_events() -> None:
    """worker_events, the loop threads, worker processes and Ray actors all
    iterate: results with their time, exceptions (the loop goes on if the
    consumer does), epoch ends with each epoch's WorkerInfo, the last end,
    a fatal worker_init_fun, and a halt before a call."""
    from blobfeed.feeders.messages import EpochDone, Exhausted, Raised, Result
    from blobfeed.feeders.worker_loop import worker_events
    from blobfeed.worker_info import WorkerInfo

    calls = {"n": 0}
    seen: list[int] = []

    def fetch(worker_id: int, batch_size: int) -> Any:
        calls["n"] += 1
        info = get_worker_info()
        assert info is not None
        seen.append(info.epoch)
        if calls["n"] % 3 == 2:
            raise ValueError(calls["n"])
        if calls["n"] % 3 == 0:
            raise StopIteration
        return [np.full(batch_size, worker_id)]

    info = WorkerInfo(7, 0, 1, SRC, 42, np.random.default_rng(42))
    events = list(worker_events(fetch, None, 7, info, lambda: 4, lambda: False, epochs=2))
    assert [type(e) for e in events] == [Result, Raised, EpochDone, Result, Raised, Exhausted]
    assert events[0].raw[0].tolist() == [7] * 4 and events[0].seconds >= 0
    assert isinstance(events[1].error, ValueError) and not events[1].fatal
    assert seen == [0, 0, 0, 1, 1, 1] and get_worker_info() is None

    def bad_init(worker_id: int) -> None:
        raise KeyError("init")

    (only,) = worker_events(fetch, bad_init, 7, info, lambda: 4, lambda: False)
    assert type(only) is Raised and only.fatal and isinstance(only.error, KeyError)
    assert list(worker_events(fetch, None, 7, info, lambda: 4, lambda: True)) == []


class SmallChunksOfBigSamples:
    """Chunks of 1-4 samples of 64 KiB (so a batch of 32 is 2 MiB: big)."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.k = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if self.k >= self.chunks:
            raise StopIteration
        n = 1 + self.k % 4
        ids = np.arange(n) + worker_id * 100_000 + self.k * 10
        self.k += 1
        return [ids, np.zeros((n, 64 * 1024), np.uint8)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_small_chunks_of_big_batches_are_copied_once_even_when_the_queue_is_full(
    monkeypatch: pytest.MonkeyPatch, deterministic: bool,
) -> None:
    """A chunk smaller than a batch that takes its worker's last free slot
    was copied out of it (a second copy: the re-batcher copies it again).
    Needed when a batch would wait for chunks the re-batcher holds; but a
    big batch takes each piece at once, and chunks dealt in arrival order
    go to whichever reader comes first: nothing holds a slot waiting for
    the worker, so the chunk stays in its slot until the re-batcher copies
    it.  (Dealt in turn, lanes and outboxes may wait for one worker: still
    copied out then.)"""
    from blobfeed.feeders import processes

    copies = []

    class CountingPool(processes.BufferPool):
        def batch(self, layout: Any) -> Any:
            copies.append(len(layout))
            return super().batch(layout)

    monkeypatch.setattr(processes, "BufferPool", CountingPool)
    with blobfeed.GlobalCoordinator() as gc:
        reader = blobfeed.reader.init_reader(
            ["id", "x"], SmallChunksOfBigSamples(60), 32, 2, "big", coordinator=gc,
            backend=ProcessBackend(slots=4, slot_bytes=1 << 20), max_buffered_batches=40,
            deterministic=deterministic, prefetch=False,  # nothing takes chunks until the test reads
        )
        gc.start()
        # nobody reads until the workers filled their 2 x 4 slots (with the
        # copies out, the queue went on filling past them)
        wait_until(lambda: reader.source.queue_depth() >= 8, "the workers' slots to fill", timeout=60.0)
        got = []
        while True:
            try:
                batch = reader.read(WAIT)
            except EndOfInput:
                break
            got.extend(batch.arrays[0].tolist())
            reader.returned(batch)
        assert gc.stop(WAIT)
    expected = [w * 100_000 + k * 10 + i for w in (0, 1) for k in range(60) for i in range(1 + k % 4)]
    assert sorted(got) == sorted(expected)
    if deterministic:
        assert copies, "dealt in turn, a full ring still copies small chunks out"
    else:
        assert copies == [], f"{len(copies)} chunks copied out of their slots"


class SmallChunksOfMidSamples:
    """Chunks of 1-7 samples of 64 KiB (a batch of 32 is 2 MiB: big, and it
    fits a slot of 4 MiB), ``calls`` calls, then the end."""

    def __init__(self, calls: int) -> None:
        self.calls = calls
        self.k = 0

    def __call__(self, worker_id: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        if self.k >= self.calls:
            raise StopIteration
        n = 1 + self.k % 7
        ids = np.arange(n) + worker_id * 100_000 + self.k * 10
        self.k += 1
        return ids, np.repeat(ids[:, None] % 251, 64 * 1024, axis=1).astype(np.uint8)


@pytest.mark.parametrize("deterministic", [False, True])
def test_worker_processes_assemble_whole_batches_the_parent_copies_none(
    monkeypatch: pytest.MonkeyPatch, deterministic: bool,
) -> None:
    """Each chunk of a worker process was copied twice: into the worker's
    slot, then by the parent's re-batcher into a batch (and each chunk was a
    message of its own).  Dealt in arrival order, a worker copies its chunks
    straight into batch-sized slots, and the parent hands each slot out as a
    batch: no copy in the parent but for the last batch, made of the rest of
    each worker.  Every call still counts as a chunk, every sample comes
    once, with its own data.  (Dealt in turn, chunks go as they came.)"""
    from blobfeed.feeders import rebatch

    copies = []
    batch_of = rebatch.BufferPool.batch

    def counting(self: Any, layout: Any) -> Any:  # every copy in the parent takes its memory here
        copies.append(len(layout))
        return batch_of(self, layout)

    monkeypatch.setattr(rebatch.BufferPool, "batch", counting)
    calls = 56  # 7 batches of 32 from each worker: no smaller batch at a worker's end
    with blobfeed.GlobalCoordinator() as gc:
        reader = blobfeed.reader.init_reader(
            ["id", "x"], SmallChunksOfMidSamples(calls), 32, 2, "mid", coordinator=gc,
            backend=ProcessBackend(slots=8, slot_bytes=4 << 20), deterministic=deterministic,
        )
        gc.start()
        got = []
        batches = 0
        while True:
            try:
                batch = reader.read(WAIT)
            except EndOfInput:
                break
            ids, x = batch.arrays
            assert (x == (ids % 251).astype(np.uint8)[:, None]).all()
            got.extend(ids.tolist())
            batches += 1
            reader.returned(batch)
        assert sample(gc, "blobfeed_fetched_chunks_total", source="mid") == 2 * calls
        assert gc.stop(WAIT)
    expected = [w * 100_000 + k * 10 + i for w in (0, 1) for k in range(calls) for i in range(1 + k % 7)]
    assert sorted(got) == sorted(expected)
    if deterministic:
        assert len(copies) >= batches - 1, "dealt in turn, chunks go as they came"
    else:
        assert copies == [], f"the parent copied {len(copies)} of {batches} batches"


def test_batches_a_worker_assembled_that_the_user_keeps_never_stall_it_nor_change() -> None:
    """A worker that assembles whole batches waits while two of its batches
    are inside blobfeed; batches handed out do not count, so keeping every
    batch read (more than the worker has slots) never stalls it, and none
    changes under the user's hands."""
    calls = 8 * 28  # 56 batches of 32 per worker: far more than its 8 slots
    with blobfeed.GlobalCoordinator() as gc:
        reader = blobfeed.reader.init_reader(
            ["id", "x"], SmallChunksOfMidSamples(calls), 32, 2, "kept", coordinator=gc,
            backend=ProcessBackend(slots=8, slot_bytes=4 << 20),
        )
        gc.start()
        kept = []
        while True:
            try:
                batch = reader.read(WAIT)
            except EndOfInput:
                break
            kept.append(batch)
            reader.returned(batch)
        assert gc.stop(WAIT)
    ids = np.concatenate([b.arrays[0] for b in kept])
    for b in kept:  # each as it was handed out
        assert (b.arrays[1] == (b.arrays[0] % 251).astype(np.uint8)[:, None]).all()
    expected = [w * 100_000 + k * 10 + i for w in (0, 1) for k in range(calls) for i in range(1 + k % 7)]
    assert sorted(ids.tolist()) == sorted(expected)


def test_a_retired_worker_s_memory_is_unmapped_once_the_last_batch_viewing_it_dies(
    gc: blobfeed.GlobalCoordinator,
) -> None:
    """Found with the served path's references into worker memory: a
    worker retired while a batch viewed its slots kept its whole area mapped
    after that batch died too (its slot ring, which outlives it, held the
    area through the header writer)."""
    from blobfeed.reader import REGIONS

    from .service.feeds import WholeBatches

    net = blobfeed.Net(None)
    init_data_input_workers(net, ["id", "x"], WholeBatches(8, calls=10**6), 8, num_worker_threads=2,
                            backend=blobfeed.ProcessBackend(slots=4, slot_bytes=1 << 20), coordinator=gc,
                            input_source_name="retired")
    gc.start()

    def mapped(worker: int) -> bool:
        with open("/proc/self/maps") as f:
            return f"memfd:blobfeed-fetch-retired-{worker} " in f.read()

    kept = None
    for _ in range(200):
        out = net.run(timeout=WAIT)
        if out["id"][0] >= 100_000:  # worker 1's: kept past its retirement
            kept = out
            break
    assert kept is not None, "no batch of worker 1 in 200"
    gc.set_num_workers("retired", 1)

    def worker_1_closed() -> bool:
        net.run(timeout=WAIT)
        return not any(r.name == "blobfeed-fetch-retired-1" for r in REGIONS._table[1])

    wait_until(worker_1_closed, "worker 1 to end and be closed")
    assert mapped(1)  # `kept` views it
    del kept, out

    def unmapped() -> bool:
        net.run(timeout=WAIT)  # the net's workspace lets go of its last batch of worker 1
        return not mapped(1)

    wait_until(unmapped, "worker 1's memory to be unmapped")
    assert mapped(0)


def test_a_worker_area_is_not_shared_where_new_writable_mappings_cannot_be_sealed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: before Linux 5.1 (no F_SEAL_FUTURE_WRITE) a worker's
    area was still handed to consumers, who could map it writable and
    change its header (stop flags, counts) and other consumers' batches."""
    from blobfeed.feeders import transport

    area, fd = transport.SlotArea.create("seal-test", 2, 4096)
    try:
        monkeypatch.setattr(transport, "F_SEAL_FUTURE_WRITE", 1 << 20)  # a seal this kernel refuses
        assert area.shared_region("seal-test", fd) is None
        monkeypatch.undo()
        region = area.shared_region("seal-test", fd)
        assert region is not None and (region.offset, region.slots, region.slot_bytes) == (64, 2, 4096)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, region.size)
    finally:
        area.close()
        os.close(fd)


def test_an_unknown_start_method_is_refused_not_taken_for_forkserver() -> None:
    from blobfeed.feeders.starting import process_context

    assert process_context("spawn").get_start_method() == "spawn"
    assert process_context("forkserver").get_start_method() == "forkserver"
    with pytest.raises(ValueError, match="start_method must be 'forkserver' or 'spawn', got 'fork'"):
        process_context("fork")


def test_a_worker_s_exit_status_is_read_once_whoever_else_polls_the_process(
    gc: blobfeed.GlobalCoordinator, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """multiprocessing polls every child it knows itself: in
    ``active_children()`` and in every ``Process.start()`` (another
    source's worker starting).  A forkserver child's exit status can be
    read once: the poller that lost the race read EOF and multiprocessing
    made it 255, so a worker that had finished was reported dead ("exited
    with code 255": CI, tests/contract/test_det_resume.py).  The read is
    slowed here, and polled from this thread while the workers end."""
    from multiprocessing import forkserver

    read = forkserver.read_signed

    def slow_read(fd: int) -> int:
        time.sleep(0.05)  # the window in which another poller may read too
        return read(fd)

    monkeypatch.setattr(forkserver, "read_signed", slow_read)
    from blobfeed.feeders import processes

    codes: list[int] = []
    real_poll = processes._Worker.poll

    def poll(self: Any) -> int | None:
        code = real_poll(self)
        if code is not None:
            codes.append(code)
        return code

    monkeypatch.setattr(processes._Worker, "poll", poll)
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], Plan([[4] * 3] * 4), 4, num_worker_threads=4,
                            backend=ProcessBackend(start_method="forkserver"), coordinator=gc)
    done = threading.Event()

    def poll_children() -> None:
        while not done.is_set():
            multiprocessing.active_children()

    poller = threading.Thread(target=poll_children, daemon=True)
    gc.start()
    poller.start()
    try:
        n = 0
        while True:
            try:
                n += len(net.run(timeout=WAIT)["ids"])
            except EndOfInput:
                break
        assert n == 4 * 3 * 4
        assert gc.stop(timeout=WAIT)
        assert codes and set(codes) == {0}, codes  # every worker returned; none read as 255
    finally:
        done.set()
        poller.join(WAIT)
