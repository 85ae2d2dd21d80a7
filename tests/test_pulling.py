"""Receiving in the enqueuer (blobfeed.feeders.pulling): a random-access
source on worker processes read by one net with prefetch has no receiver
thread per worker while its stream runs; the net's enqueuer reads the
workers' pipes itself.  Every ending (a death, the end of the data, a stop,
a message that cannot be taken) goes to the worker's own receiver thread,
started then, as before."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfEpoch, EndOfInput, FetcherError, Net, RandomAccessSource, init_data_input_workers
from blobfeed.reader import init_reader
from blobfeed.feeders import enqueuer, processes, pulling

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


class Big:
    """Samples of 8 MiB: a unit of 8 does not fit a 1 MiB slot, so it
    travels pickled down the pipe, a message of 64 MiB."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> tuple[Any, np.ndarray]:
        return np.int64(i), np.full(2 << 20, i, np.float32)


def _reading_mid_message() -> int | None:
    """The pid of a worker whose message a thread is reading, half read."""
    for frame in list(sys._current_frames().values()):
        mid = False
        while frame is not None:
            local = frame.f_locals
            if frame.f_code.co_name == "_read" and local.get("pos", 0) > 0 and local.get("n", 0) > 1 << 20:
                mid = True
            if mid and type(local.get("self")).__name__ == "_Worker":
                return int(local["self"].pid)
            frame = frame.f_back
    return None


def test_stop_ends_a_worker_stopped_in_the_middle_of_a_message() -> None:
    """A worker process stopped (SIGSTOP: a debugger, a frozen cgroup) with
    its message half read: stop() kills it and returns, as with receiver
    threads; the read must not hold what the stop needs (rev44)."""
    gc = blobfeed.GlobalCoordinator()
    net = Net(None, name="n0")
    init_data_input_workers(net, ["i", "x"], RandomAccessSource(Big(), shuffle=False, read_size=8), 8,
                            input_source_name=SRC, num_worker_threads=1, coordinator=gc,
                            backend=blobfeed.ProcessBackend(slot_bytes=1 << 20))
    gc.start()
    reading = threading.Event()

    def consume() -> None:
        try:
            while not reading.is_set():
                net.run(timeout=30)
        except Exception:  # stopped under it: what matters is stop() below
            pass

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    pid = None
    try:
        deadline = time.monotonic() + 30
        while pid is None:
            assert time.monotonic() < deadline, "no message was ever caught half read"
            pid = _reading_mid_message()
        os.kill(pid, signal.SIGSTOP)
        reading.set()
        result: list[Any] = []
        stopper = threading.Thread(target=lambda: result.append(gc.stop(timeout=5)), daemon=True)
        stopper.start()
        stopper.join(20)
        assert not stopper.is_alive(), "stop() did not return with a worker stopped mid-message"
        assert result == [True]
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        gc.stop(timeout=10)
        consumer.join(10)


class _Member:
    pipe_fd = -1
    sentinel = -1

    def hand_over(self, pending: Any) -> None:
        pass


def test_a_wake_up_never_lands_in_a_descriptor_opened_after_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wake-up byte is written under the puller's lock, and release()
    closes the pipe under it: a descriptor that reuses the pipe's number
    never gets it (rev44: a thread switch between reading the number and
    writing put it in a replacement worker's units pipe).  The switch is
    forced by a write that waits."""
    puller = pulling.Puller(SRC)
    member = _Member()
    puller.add(member)
    in_write, go = threading.Event(), threading.Event()
    real_write = os.write

    def slow_write(fd: int, data: bytes) -> int:
        if threading.current_thread().name == "hander":
            in_write.set()
            go.wait(5)
        return real_write(fd, data)

    monkeypatch.setattr(pulling.os, "write", slow_write)
    hander = threading.Thread(target=puller.hand_over, args=(member,), name="hander")
    hander.start()
    releaser = threading.Thread(target=puller.release)
    r = w = -1
    try:
        assert in_write.wait(5)
        releaser.start()
        releaser.join(0.3)  # (before the fix, the pipe was closed under the write here)
        r, w = os.pipe()  # what the program opens meanwhile
        os.set_blocking(r, False)
    finally:
        go.set()
        hander.join(5)
        releaser.join(5)
    try:
        with pytest.raises(BlockingIOError):
            os.read(r, 10)
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("slow", ["net", "workers"])
def test_lagging_behind_is_told_when_the_workers_are_behind_not_when_the_net_is(
    slow: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Received by the enqueuer, the results wait in the pipes until the net
    needs them, so the lanes look empty either way: "data loading lagging
    behind" goes by whether the enqueuer's reads waited for a worker (rev44:
    a net slower than its workers was told the data lagged)."""
    monkeypatch.setattr(enqueuer, "LAGGING_WARN_S", 0.5)  # once a minute, in the library
    gc, nets = pipeline(n=100000, delay=0.01 if slow == "workers" else 0.0)
    told = lagging_told(gc, nets, caplog, step=0.02 if slow == "net" else 0.0)
    assert bool(told) == (slow == "workers"), told


def lagging_told(gc: blobfeed.GlobalCoordinator, nets: list[Any], caplog: pytest.LogCaptureFixture,
                 step: float) -> list[str]:
    """Read for 3 s after the first batch, the net taking ``step`` s a batch
    (the workers run ahead meanwhile); the "lagging behind" warnings told."""
    caplog.set_level(logging.WARNING, logger="blobfeed")
    gc.start()
    try:
        ids(nets, 1)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            ids(nets, 1)
            if step:
                time.sleep(step)
    finally:
        assert gc.stop(timeout=10)
    return [r.getMessage() for r in caplog.records if "lagging behind" in r.getMessage()]


class SlowStart(Items):
    """The first read of each worker process takes ``start`` s (files to
    open, a cold cache); the others none."""

    def __init__(self, n: int, start: float) -> None:
        super().__init__(n)
        self.start = start
        self.started = False

    def __getitem__(self, i: int) -> tuple[Any, np.ndarray]:
        if not self.started:
            self.started = True
            time.sleep(self.start)
        return super().__getitem__(i)


def test_the_workers_start_up_is_not_a_lag(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The first look of the "lagging" check starts the count: the waits of
    the workers' start-up, before any batch, do not make a net-bound stream
    lagging (rev45: a slow start was told as lagging at the first look)."""
    monkeypatch.setattr(enqueuer, "LAGGING_WARN_S", 1.0)
    gc, nets = pipeline(n=100000, workers=1, dataset=SlowStart(100000, start=1.5))
    told = lagging_told(gc, nets, caplog, step=0.02)  # the net is the slow step once the worker runs
    assert not told, told
