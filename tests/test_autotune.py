"""Issue 27 item 1: a source's worker count chosen while it runs.

What is checked:

* ``set_num_workers`` on a running fetch_fun source in arrival order
  (threads and processes): 1 -> 4 -> 1 workers while it runs, every chunk a
  worker produced arrives exactly once, a removed worker's last chunk too,
  the source still ends when its remaining workers finish, nothing is left
  behind; sources whose stream depends on the worker count are refused;
* the tuner's decisions without a pipeline (a fake plant: throughput as a
  function of workers, with a knee and noise): it climbs to the knee, stops,
  follows the knee when it moves, never passes its bounds;
* ``num_worker_threads="auto"`` on real pipelines: an I/O-bound fetcher
  grows, a GIL-bound one does not, ``max_workers`` holds, incompatible
  wirings are refused.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfInput, Net, init_data_input_workers

from .helpers import sample, wait_until

SRC = "train"
BLOBS = ["ids", "x"]
WAIT = 30.0


class Counted:
    """A fetch_fun that does not split its data by worker: each worker
    returns chunks (worker id, its call number), and after each call writes
    how many it made to ``<marks>/<worker id>``; all raise StopIteration once
    ``<marks>/stop`` exists.  Module level: it pickles (processes)."""

    def __init__(self, marks: str, rows: int = 2, delay: float = 0.002) -> None:
        self.marks = marks
        self.rows = rows
        self.delay = delay
        self.calls: dict[int, int] = {}

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if os.path.exists(os.path.join(self.marks, "stop")):
            raise StopIteration
        time.sleep(self.delay)
        n = self.calls.get(worker_id, 0)
        self.calls[worker_id] = n + 1
        with open(os.path.join(self.marks, f"{worker_id}.tmp"), "w") as f:
            f.write(str(n + 1))
        os.replace(os.path.join(self.marks, f"{worker_id}.tmp"), os.path.join(self.marks, str(worker_id)))
        ids = np.full(self.rows, worker_id * 1_000_000 + n, np.int64)
        return [ids, np.arange(self.rows, dtype=np.float32)]


def _blobfeed_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("blobfeed-"))


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_fetch_fun_source_resized_while_running_loses_nothing(backend: str, tmp_path: Path) -> None:
    before = _blobfeed_threads()
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, BLOBS, Counted(str(tmp_path)), 4, num_worker_threads=1, coordinator=gc,
                            backend=backend, max_buffered_batches=8, seed=1)
    got: list[int] = []

    def take(k: int) -> None:
        for _ in range(k):
            got.extend(int(i) for i in net.run(timeout=WAIT)["ids"])

    try:
        gc.start()
        take(5)
        gc.set_num_workers(SRC, 4)
        assert gc.num_workers(SRC) == 4
        assert sample(gc, "blobfeed_workers", source=SRC) == 4
        deadline = time.monotonic() + WAIT
        while {i // 1_000_000 for i in got} != {0, 1, 2, 3}:
            assert time.monotonic() < deadline, f"the new workers' chunks never came: {sorted(set(got))[:20]}"
            take(1)
        gc.set_num_workers(SRC, 1)
        assert gc.num_workers(SRC) == 1
        # the removed workers end by themselves (each after its current call)
        wait_until(lambda: gc._sources[SRC].workers_alive() == 1, "the removed workers' end", timeout=WAIT)
        take(10)
        (tmp_path / "stop").touch()
        while True:
            try:
                take(1)
            except EndOfInput:
                break
    finally:
        assert gc.stop(timeout=10.0), "a thread outlived stop()"
    made = {int(p.name): int(p.read_text()) for p in tmp_path.iterdir() if p.name.isdigit()}
    assert set(made) == {0, 1, 2, 3}
    per_worker: dict[int, list[int]] = {}
    for i in got[::2]:  # two rows per chunk, the same id
        per_worker.setdefault(i // 1_000_000, []).append(i % 1_000_000)
    for wid, calls in made.items():
        # in arrival order each worker's chunks come in its own order: none lost, none twice
        assert per_worker.get(wid) == list(range(calls)), f"worker {wid}: made {calls} chunks"
    assert len(got) == 2 * sum(made.values())
    wait_until(lambda: _blobfeed_threads() == before, "no blobfeed thread left", timeout=WAIT)


def _nothing(worker_id: int, batch_size: int) -> list[np.ndarray]:
    raise StopIteration


@pytest.mark.parametrize("wiring", [dict(deterministic=True), dict(shuffle_buffer=8), dict(epochs=2)])
def test_set_num_workers_refuses_a_fetch_fun_stream_that_depends_on_the_worker_count(wiring: dict) -> None:
    gc = blobfeed.GlobalCoordinator()
    release = threading.Event()

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        release.wait(WAIT)
        raise StopIteration

    init_data_input_workers(Net(), BLOBS, fetch, 2, coordinator=gc, seed=1, **wiring)
    try:
        gc.start()
        with pytest.raises(ValueError, match=r"source 'train' reads a fetch_fun with .*depends on its worker count"):
            gc.set_num_workers(SRC, 2)
    finally:
        release.set()
        assert gc.stop(timeout=10.0)


# ---------------------------------------------------------------------------------------------
# the tuner's decisions, without a pipeline: a fake plant
# ---------------------------------------------------------------------------------------------
from collections import Counter  # noqa: E402

from blobfeed.autotune import AutoWorkers, Climber, Window, _cgroup_quota, cpu_limit  # noqa: E402


class Plant:
    """Throughput as a function of workers: linear up to ``knee``, flat
    after it, with +-``noise`` multiplicative noise.  ``cpu``: cores one
    worker uses; ``waits``: the nets wait for input (else the model limits
    and the workers idle)."""

    def __init__(self, knee: int, noise: float = 0.02, cpu: float = 0.05, waits: bool = True, seed: int = 0,
                 hungry: bool = False) -> None:
        self.knee = knee
        self.noise = noise
        self.cpu = cpu
        self.hungry = hungry
        self.waits = waits
        self.rng = np.random.default_rng(seed)

    def window(self, n: int, gil: bool = False) -> Window:
        rate = 100.0 * min(n, self.knee) * (1 + self.rng.uniform(-self.noise, self.noise))
        busy = 1.0 if self.waits else 0.3
        return Window(1.25, rate, self.waits, busy, self.cpu * n, gil, self.hungry)


def drive(c: Climber, plant: Plant, seconds: float, t0: float = 0.0, bound: int | None = None) -> list[int]:
    """The worker count after each window, ``seconds`` of simulated time."""
    counts = []
    t = t0
    while t < t0 + seconds:
        t += 1.25
        c.decide(t, plant.window(c.n), bound)
        counts.append(c.n)
    return counts


def mode(counts: list[int]) -> int:
    return Counter(counts).most_common(1)[0][0]


def test_the_climber_climbs_to_the_knee_and_stays() -> None:
    c = Climber(1, lo=1, hi=32, cpus=2.0)
    counts = drive(c, Plant(knee=8), 60.0)
    assert counts.index(8) <= 4, f"1 -> 2 -> 4 -> 8 in doubling steps: {counts}"
    assert max(counts) <= 16
    late = counts[16:]
    assert mode(late) == 8, counts
    # trials away from the knee are rare once there (the holds grow)
    assert sum(1 for k in late if k != 8) <= len(late) // 4, counts


def test_the_climber_follows_the_knee_when_it_moves() -> None:
    plant = Plant(knee=8, seed=1)
    c = Climber(1, lo=1, hi=32, cpus=2.0)
    drive(c, plant, 30.0)
    assert c.n == 8
    plant.knee = 4  # the best count moved down: it backs off
    counts = drive(c, plant, 60.0, t0=30.0)
    assert mode(counts[-20:]) == 4, counts
    plant.knee = 12  # and up: it climbs again
    counts = drive(c, plant, 90.0, t0=90.0)
    assert mode(counts[-20:]) in (12, 13), counts


def test_the_climber_keeps_its_bounds() -> None:
    # the hard cap
    assert max(drive(Climber(1, lo=1, hi=6, cpus=64.0), Plant(knee=20), 40.0)) <= 6
    # the byte budget, a bound of the moment
    assert max(drive(Climber(1, lo=1, hi=32, cpus=64.0), Plant(knee=20), 40.0, bound=3)) <= 3
    # a bound that comes down is followed
    c = Climber(8, lo=1, hi=32, cpus=64.0)
    c.decide(1.0, Plant(knee=20).window(8), bound=5)
    assert c.n == 5
    # the CPU budget: workers that each use a core stop at the cores (2)
    assert max(drive(Climber(1, lo=1, hi=32, cpus=2.0), Plant(knee=20, cpu=1.0), 40.0)) <= 2
    # ... even on a machine busy with other work, where each gets a third of a core
    assert max(drive(Climber(1, lo=1, hi=32, cpus=2.0), Plant(knee=20, cpu=0.3, hungry=True), 40.0)) <= 2
    # workers that mostly wait may outnumber the cores
    assert max(drive(Climber(1, lo=1, hi=32, cpus=2.0), Plant(knee=20, cpu=0.02), 40.0)) >= 16
    # min_workers
    assert min(drive(Climber(4, lo=3, hi=32, cpus=2.0), Plant(knee=1, waits=False), 40.0)) >= 3


def test_the_climber_removes_idle_workers_and_never_grows_on_a_shared_gil() -> None:
    counts = drive(Climber(8, lo=1, hi=32, cpus=2.0), Plant(knee=2, waits=False), 30.0)
    assert counts[-1] <= 3 and mode(counts[-10:]) == 2, counts
    c = Climber(1, lo=1, hi=32, cpus=2.0)
    t, seen = 0.0, []
    for _ in range(40):
        t += 1.25
        # one thread runs at a time: a second one adds nothing, and the window says so
        c.decide(t, Window(1.25, 100.0 * (1 + 0.5 * (c.n > 1)), True, 1.0, 1.0, c.n > 1))
        seen.append(c.n)
    assert max(seen) <= 2 and mode(seen) == 1, seen


def test_workers_that_compute_for_waiting_nets_are_neither_idle_nor_tried_fewer() -> None:
    """The auto bench: A4p and A6p (CPU-bound worker processes) ran at 2
    workers like their best fixed count, yet at 0.81-0.83 x its batches/s:
    every few seconds the tuner tried one worker less (half the throughput
    for a window) though the nets waited and each worker kept a core busy.
    A2p (a worker that also assembles batches outside fetch_fun: inside it
    less than half its time) read as idle: never grown, tried fewer, and
    ended at 1 worker (0.55 x).  Workers that compute (``hungry``) for nets
    that wait are not idle, and are not tried fewer up to the cores."""
    for busy in (1.0, 0.45):
        c = Climber(1, lo=1, hi=32, cpus=2.0)
        seen, t = [], 0.0
        for _ in range(60):
            t += 1.25
            n = c.n
            c.decide(t, Window(1.25, 100.0 * min(n, 2), True, busy, 1.0 * n, False, True))
            seen.append(c.n)
        assert seen[2:] == [2] * len(seen[2:]), (busy, seen)


def test_the_cpu_bound_reads_affinity_and_the_cgroup_quota(tmp_path: Path) -> None:
    assert 1 <= cpu_limit() <= len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert _cgroup_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _cgroup_quota(str(tmp_path)) is None
    assert AutoWorkers(max_cpus=3).cap() == 16
    assert AutoWorkers(max_cpus=8).cap() == 32
    for bad in (dict(start=0), dict(max_workers=0), dict(max_cpus=0), dict(max_cpus=float("nan")),
                dict(start=4, max_workers=2)):
        with pytest.raises(ValueError, match="AutoWorkers"):
            AutoWorkers(**bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# num_worker_threads="auto" on real pipelines
# ---------------------------------------------------------------------------------------------
def _sleepy(worker_id: int, batch_size: int) -> list[np.ndarray]:
    time.sleep(0.005)  # I/O: the worker waits, off the GIL
    return [np.zeros(4, np.int64), np.zeros(4, np.float32)]


def _busy(worker_id: int, batch_size: int) -> list[np.ndarray]:
    x = 0
    for i in range(20_000):  # Python code: holds the GIL
        x += i
    return [np.zeros(4, np.int64), np.zeros(4, np.float32)]


def _pipeline(fetch: Any, workers: Any, **kw: Any) -> tuple[blobfeed.GlobalCoordinator, Net]:
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, BLOBS, fetch, 4, num_worker_threads=workers, coordinator=gc, seed=1, **kw)
    assert gc.num_workers(SRC) == (1 if workers == "auto" or not isinstance(workers, int) else workers)
    gc.start()
    return gc, net


def test_auto_grows_an_io_bound_source_while_its_net_waits(caplog: Any) -> None:
    """A real pipeline whose fetcher waits (I/O) grows from one worker to
    many, says so in the metric and in the log.  How close its throughput
    comes to the best fixed count is measured by the bench's ``Aio``
    workload (``blobfeed bench --workloads auto``), side by side in one
    run: a throughput compared here read 0.53x on a loaded machine."""
    caplog.set_level("INFO", logger="blobfeed.autotune")
    gc, net = _pipeline(_sleepy, "auto")
    try:
        assert gc.num_workers(SRC) == 1
        deadline = time.monotonic() + 15.0
        while gc.num_workers(SRC) < 8:
            assert time.monotonic() < deadline, f"still {gc.num_workers(SRC)} workers after 15 s"
            net.run(timeout=WAIT)
        assert sample(gc, "blobfeed_workers", source=SRC) >= 8
    finally:
        assert gc.stop(timeout=10.0)
    assert any("source 'train': 2 workers (were 1): the nets wait for input" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_auto_does_not_grow_threads_that_share_the_gil() -> None:
    gc, net = _pipeline(_busy, "auto")
    seen = []
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 8.0:
            net.run(timeout=WAIT)
            seen.append(gc.num_workers(SRC))
    finally:
        assert gc.stop(timeout=10.0)
    assert max(seen) <= 3, f"GIL-bound threads grew to {max(seen)}"


def test_auto_keeps_max_workers() -> None:
    gc, net = _pipeline(_sleepy, blobfeed.AutoWorkers(max_workers=3))
    seen = []
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0:
            net.run(timeout=WAIT)
            seen.append(gc.num_workers(SRC))
    finally:
        assert gc.stop(timeout=10.0)
    assert max(seen) == 3, seen  # it grew, to the cap and no further


def test_auto_on_processes_grows_and_the_stream_still_ends(tmp_path: Path) -> None:
    """A non-sharding fetcher on worker processes: the tuner adds processes,
    and every chunk each one made arrives once, up to the end."""
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, BLOBS, Counted(str(tmp_path), delay=0.01), 4, num_worker_threads="auto",
                            coordinator=gc, backend="processes", seed=1)
    got: list[int] = []
    try:
        gc.start()
        deadline = time.monotonic() + 30.0
        while len({i // 1_000_000 for i in got}) < 2:
            assert time.monotonic() < deadline, "no second worker process's chunk within 30 s"
            got.extend(int(i) for i in net.run(timeout=WAIT)["ids"])
        (tmp_path / "stop").touch()
        while True:
            try:
                got.extend(int(i) for i in net.run(timeout=WAIT)["ids"])
            except EndOfInput:
                break
    finally:
        assert gc.stop(timeout=10.0)
    made = {int(p.name): int(p.read_text()) for p in tmp_path.iterdir() if p.name.isdigit()}
    per_worker: dict[int, list[int]] = {}
    for i in got[::2]:
        per_worker.setdefault(i // 1_000_000, []).append(i % 1_000_000)
    assert len(made) >= 2
    for wid, calls in made.items():
        assert per_worker.get(wid) == list(range(calls)), f"worker {wid}: made {calls} chunks"


class FixedBackend:
    """A backend that cannot add or remove workers of a running fetch_fun
    source: no ``elastic``."""

    name = "fixed"

    def check(self, fetch_fun: Any, worker_init_fun: Any) -> None:
        pass

    def launch(self, plan: Any) -> Any:  # pragma: no cover - never started
        raise AssertionError("not started")


@pytest.mark.parametrize("wiring, match", [
    (dict(deterministic=True), r"num_worker_threads='auto' changes the worker count.*deterministic=True"),
    (dict(shuffle_buffer=8), r"num_worker_threads='auto'.*shuffle_buffer=8"),
    (dict(epochs=None), r"num_worker_threads='auto'.*epochs=None"),
    (dict(backend="fixed"), r"num_worker_threads='auto' needs a backend that can add and remove workers"),
])
def test_auto_is_refused_where_the_stream_depends_on_the_worker_count(wiring: dict, match: str) -> None:
    if wiring.get("backend") == "fixed":
        wiring = dict(backend=FixedBackend())
    gc = blobfeed.GlobalCoordinator()
    with pytest.raises(ValueError, match=match):
        init_data_input_workers(Net(), BLOBS, _sleepy, 4, num_worker_threads="auto", coordinator=gc, **wiring)
    assert SRC not in gc._sources  # nothing left wired
    with pytest.raises(ValueError, match=r"num_worker_threads must be an int >= 1, 'auto' or AutoWorkers"):
        init_data_input_workers(Net(), BLOBS, _sleepy, 4, num_worker_threads="many", coordinator=gc)
    # every call for one source agrees
    init_data_input_workers(Net(name="a"), BLOBS, _sleepy, 4, num_worker_threads="auto", coordinator=gc)
    with pytest.raises(ValueError, match=r"source 'train' was wired with num_worker_threads=auto; this call asks for 2"):
        init_data_input_workers(Net(name="b"), BLOBS, _sleepy, 4, num_worker_threads=2, coordinator=gc)
    gc.stop(timeout=5.0)


class SlowItems:
    """A map-style dataset whose reads wait 2 ms (I/O): sample i is (i, [i])."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, np.ndarray]:
        time.sleep(0.002)
        return np.int64(i), np.full(1, i, np.float32)


def test_auto_on_a_random_access_source_grows_and_keeps_the_stream() -> None:
    n = 3000
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, BLOBS, blobfeed.RandomAccessSource(SlowItems(n), shuffle=False), 4,
                            num_worker_threads="auto", coordinator=gc)
    got: list[int] = []
    seen = 1
    try:
        gc.start()
        while True:
            try:
                got.extend(int(i) for i in net.run(timeout=WAIT)["ids"])
            except EndOfInput:
                break
            seen = max(seen, gc.num_workers(SRC))
    finally:
        assert gc.stop(timeout=10.0)
    assert seen >= 2, "the tuner never added a worker"
    assert got == list(range(n)), "the stream of a random-access source does not depend on its workers"


class FullBackend(blobfeed.ThreadBackend):
    """Threads that cannot start more workers once running (as a process
    backend without room for more shared memory)."""

    launches = 0

    def launch(self, plan: Any) -> Any:
        self.launches += 1
        if self.launches > 1:
            raise blobfeed.BlobfeedError(f"source {plan.source!r}: no room for {len(plan.workers)} more workers")
        return super().launch(plan)


def test_auto_stays_where_it_is_when_the_backend_cannot_start_more(caplog: Any, tmp_path: Path) -> None:
    caplog.set_level("WARNING", logger="blobfeed.autotune")
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, BLOBS, Counted(str(tmp_path), delay=0.005), 4, num_worker_threads="auto",
                            coordinator=gc, backend=FullBackend(), seed=1)
    got: list[int] = []
    try:
        gc.start()
        deadline = time.monotonic() + WAIT
        while not any("could not run 2 workers" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the tuner never tried a second worker"
            got.extend(int(i) for i in net.run(timeout=WAIT)["ids"])
        assert gc.num_workers(SRC) == 1
        (tmp_path / "stop").touch()
        while True:  # the workers that never started are not waited for
            try:
                got.extend(int(i) for i in net.run(timeout=WAIT)["ids"])
            except EndOfInput:
                break
    finally:
        assert gc.stop(timeout=10.0)
    assert got[::2] == list(range(int((tmp_path / "0").read_text())))
