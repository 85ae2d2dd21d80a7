"""Receiving in the enqueuer (blobfeed.feeders.pulling): a random-access
source on worker processes read by one net with prefetch has no receiver
thread per worker while its stream runs; the net's enqueuer reads the
workers' pipes itself.  Every ending (a death, the end of the data, a stop,
a message that cannot be taken) goes to the worker's own receiver thread,
started then, as before."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfEpoch, EndOfInput, FetcherError, Net, RandomAccessSource, init_data_input_workers
from blobfeed.reader import init_reader
from blobfeed.feeders import processes

from .helpers import wait_until
from .test_indexed import Items, Killer

SRC = "train"
WAIT = 30.0


def order(n: int, seed: int, epochs: int) -> list[int]:
    return [int(i) for e in range(epochs) for i in np.random.default_rng((seed, e)).permutation(n)]


def receivers() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("blobfeed-recv-"))


def pipeline(n: int = 400, workers: int = 2, nets: int = 1, prefetch: bool = True, delay: float = 0.0,
             epochs: int | None = None, dataset: Any = None) -> tuple[blobfeed.GlobalCoordinator, list[Any]]:
    """A random-access source on worker processes, read by ``nets`` nets
    (or, without prefetch, by one reader read in this thread)."""
    gc = blobfeed.GlobalCoordinator()
    source: Any = RandomAccessSource(Items(n, delay) if dataset is None else dataset, shuffle=True, seed=5)
    wiring: dict[str, Any] = dict(num_worker_threads=workers, coordinator=gc, backend="processes", epochs=epochs)
    if not prefetch:
        return gc, [init_reader(["i", "x"], source, 8, input_source_name=SRC, prefetch=False, **wiring)]
    out = [Net(None, name=f"n{k}") for k in range(nets)]
    for net in out:  # (each call adds its workers to the one source)
        init_data_input_workers(net, ["i", "x"], source, 8, input_source_name=SRC, **wiring)
    return gc, out


def ids(nets: list[Net], count: int) -> list[int]:
    got: list[int] = []
    for k in range(count):
        got += net_ids(nets[k % len(nets)])
    return got


def net_ids(net: Any) -> list[int]:
    """The sample ids of the next batch (an epoch's end is passed)."""
    if isinstance(net, Net):
        while True:
            try:
                return [int(i) for i in net.run(timeout=WAIT)["i"]]
            except EndOfEpoch:
                continue
    batch = net.read(timeout=WAIT)  # a reader
    out = [int(i) for i in batch.arrays[0]]
    net.returned(batch)
    return out


def test_no_receiver_thread_runs_while_the_enqueuer_receives() -> None:
    gc, nets = pipeline()
    gc.start()
    try:
        seen: set[str] = set()
        got = []
        for _ in range(60):  # an epoch is 50 batches: across its end
            got += ids(nets, 1)
            seen.update(receivers())
        assert got == order(400, 5, 2)[:480], "the stream is the one the source's order says"
        assert not seen, f"receiver threads ran while the stream ran: {seen}"
        names = {t.name for t in threading.enumerate()}
        assert f"blobfeed-enqueue-{SRC}-n0" in names, sorted(names)
    finally:
        assert gc.stop(timeout=10)


@pytest.mark.parametrize("how", ["two nets", "no prefetch"])
def test_receiver_threads_where_the_enqueuer_cannot_receive(how: str) -> None:
    """Two nets (two enqueuers wait on the stream) or no enqueuer (the net's
    own thread, where Ctrl-C lands, would read the pipes): a receiver thread
    per worker process, as before."""
    gc, nets = pipeline(workers=1 if how == "two nets" else 2, nets=2 if how == "two nets" else 1,
                        prefetch=how != "no prefetch")
    gc.start()
    try:
        got = ids(nets, 4)
        assert got == order(400, 5, 1)[:32]
        assert receivers() == [f"blobfeed-recv-{SRC}-0", f"blobfeed-recv-{SRC}-1"]
    finally:
        assert gc.stop(timeout=10)


def test_a_worker_killed_while_pulled_is_replaced_and_nothing_is_lost(tmp_path: Any) -> None:
    """The dead worker's thread reads what it left and reports the death;
    its replacement is pulled like it."""
    gc, nets = pipeline(n=304, dataset=Killer(304, at=int(order(304, 5, 1)[100]), marks=str(tmp_path), times=1))
    gc.start()
    try:
        got = ids(nets, 60)  # past the epoch's end: 38 batches an epoch
        assert len(os.listdir(tmp_path)) == 1, "the worker reading the sample was killed"
        assert got == order(304, 5, 2)[:480]
        # the replacement is pulled too: once the dead one's thread ended, no receiver runs
        wait_until(lambda: not receivers(), what=f"no receiver thread: {receivers()}", timeout=10)
        got += ids(nets, 2)
        assert not receivers()
        assert gc.registry.get_sample_value("blobfeed_worker_deaths_total", {"source": SRC, "backend": "processes"}) == 1
    finally:
        assert gc.stop(timeout=10)


def test_stop_wakes_the_enqueuer_waiting_on_the_pipes() -> None:
    """The enqueuer waits on the workers' pipes, not on the dealer's
    condition: a stop must wake it there."""
    gc, nets = pipeline(delay=0.5)  # a batch of 8 takes a worker 4 s
    gc.start()
    with pytest.raises(blobfeed.DequeueTimeout):
        nets[0].run(timeout=0.2)
    t0 = time.monotonic()
    assert gc.stop(timeout=10)
    # (the workers are in user code: they are stopped within the grace period)
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(EndOfInput):
        nets[0].run(timeout=1)


def test_workers_added_while_pulled_are_pulled_too() -> None:
    gc, nets = pipeline(n=304, workers=1)  # 38 whole batches an epoch
    gc.start()
    try:
        got = ids(nets, 3)
        gc.set_num_workers(SRC, 3)
        got += ids(nets, 40)
        assert got == order(304, 5, 2)[:344]
        wait_until(lambda: not receivers(), what=f"no receiver thread: {receivers()}", timeout=10)
        gc.set_num_workers(SRC, 1)
        got += ids(nets, 40)
        assert got == order(304, 5, 3)[:664]
    finally:
        assert gc.stop(timeout=10)


def test_a_message_the_enqueuer_cannot_take_fails_the_source_with_its_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = processes._Worker._handle
    calls = {"n": 0}

    def handle(self: Any, data: bytearray) -> Any:
        calls["n"] += 1
        if calls["n"] == 6:
            raise ValueError("a message this test makes untakeable")
        return real(self, data)

    monkeypatch.setattr(processes._Worker, "_handle", handle)
    gc, nets = pipeline(epochs=1)
    gc.start()
    try:
        with pytest.raises(FetcherError, match="cannot take its messages: ValueError"):
            for _ in range(60):
                nets[0].run(timeout=WAIT)
    finally:
        gc.stop(timeout=10)
