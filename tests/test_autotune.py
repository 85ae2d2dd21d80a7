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
