"""``max_buffered_bytes="auto"`` (issue 27 item 2, its second half): the
internal queue's byte limit follows need, within the budget
(``blobfeed.buffers``, docs/TUNING.md "The byte budget").

What is checked:

* the policy alone, driven by a fake plant: a queue the net drains slower
  than the workers fill it halves down to its floor and stays there; bursts
  the limit cannot cover double it until it covers them, never past the
  budget, and it does not flap; workers that are the limit (never held back
  by the bytes) never make it grow;
* the queue: a new limit applies at once (a higher one wakes the held-back
  producers), the lowest fill and the waits are counted;
* real pipelines: the memory held falls when the consumer is the limit, and
  grows when bursts starve the net, never past the budget; a fixed
  ``max_buffered_bytes`` keeps the plain queue.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import blobfeed
from blobfeed import Net, buffers, init_data_input_workers
from blobfeed.buffers import Fill, Watermarks
from blobfeed.coordinator import wiring
from blobfeed.queues import BlobsQueue, WatermarkQueue

from .helpers import sample, wait_until

MIB = 1 << 20
SRC = "train"


# -- the policy, with a fake plant -----------------------------------------------------------
def run_plant(policy: Watermarks, need: int | None, windows: int, t0: float = 0.0) -> list[int]:
    """Windows of one second of a plant whose workers fill the queue faster
    than the net drains it, except in bursts that take ``need`` bytes out of
    it (None: no bursts, the net is the limit).  Returns the limit after
    each window."""
    out = []
    for i in range(windows):
        L = policy.limit
        if need is None:  # the net is the limit: the queue stays between half full and full
            fill = Fill(1.0, starved=False, held=50, empty=0, low=L // 2)
        elif L < need:  # a burst empties it: the net waits, the workers had been held back
            fill = Fill(1.0, starved=True, held=50, empty=3, low=0)
        else:
            fill = Fill(1.0, starved=False, held=50, empty=0, low=L - need)
        out.append(policy.decide(t0 + i, fill))
    return out


def test_a_queue_the_net_drains_slowly_halves_to_its_floor_and_stays() -> None:
    p = Watermarks.start(budget=64 * MIB, start=8 * MIB, floor=1 * MIB)
    limits = run_plant(p, None, 10)
    assert limits[:4] == [4 * MIB, 2 * MIB, 1 * MIB, 1 * MIB]
    assert set(limits[3:]) == {1 * MIB}


def test_bursts_double_the_limit_until_it_covers_them_within_the_budget_without_flapping() -> None:
    p = Watermarks.start(budget=64 * MIB, start=1 * MIB, floor=1 * MIB)
    limits = run_plant(p, 5 * MIB, 120)
    assert limits[:3] == [2 * MIB, 4 * MIB, 8 * MIB]
    small = [a < 5 * MIB for a in [1 * MIB, *limits[:-1]]]  # the windows the net went short
    # it tries half now and then (8 -> 4 MiB: too small, back to 8), each
    # time after a longer hold (4, 8, 16, then every 30 s)
    assert sum(small) <= 8, limits
    assert sum(small[60:]) <= 2, limits
    assert limits[-1] >= 5 * MIB and max(limits) <= 64 * MIB
    # a budget below the need: it stops there
    q = Watermarks.start(budget=3 * MIB, start=1 * MIB, floor=1 * MIB)
    assert max(run_plant(q, 5 * MIB, 20)) == 3 * MIB


def test_workers_that_are_the_limit_never_make_it_grow() -> None:
    p = Watermarks.start(budget=64 * MIB, start=2 * MIB, floor=1 * MIB)
    for i in range(20):
        # the net waits on an empty queue, but no worker was ever held back by the bytes
        assert p.decide(float(i), Fill(1.0, starved=True, held=0, empty=40, low=0)) == 2 * MIB


def test_the_limit_never_goes_below_a_few_of_the_sources_batches() -> None:
    """A2p (9.6 MB batches, whole in each worker's slot): the queue started
    at 8 MiB, less than one batch, so a second worker process could queue
    nothing, and the worker tuner read 'a second worker does not pay' and
    went back to one (0.5 x the best fixed count).  The limit's floor rises
    to a few batches of the source's samples, within the budget."""
    p = Watermarks.start(budget=64 * MIB, start=8 * MIB, floor=1 * MIB)
    assert p.fit_batches(10 * MIB) == 4 * 10 * MIB > 8 * MIB, "raised at once"
    assert p.limit == 40 * MIB
    assert set(run_plant(p, None, 10)) == {40 * MIB}, "never halved below it"
    q = Watermarks.start(budget=24 * MIB, start=8 * MIB, floor=1 * MIB)
    assert q.fit_batches(10 * MIB) == 24 * MIB, "within the budget"
    r = Watermarks.start(budget=64 * MIB, start=8 * MIB, floor=1 * MIB)
    assert r.fit_batches(1 * MIB) == 8 * MIB and r.floor == 4 * MIB, "small batches: nothing to raise"


# -- the queue -------------------------------------------------------------------------------
def test_the_watermark_queue_applies_a_new_limit_and_counts_its_marks() -> None:
    q: WatermarkQueue[str] = WatermarkQueue(100, max_bytes=10, low_water=50)
    assert q.put_sized("a", 6) and q.put_sized("b", 4)
    put = threading.Event()

    def producer() -> None:
        q.put_sized("c", 5)
        put.set()

    t = threading.Thread(target=producer)
    t.start()
    assert not put.wait(0.2), "15 bytes passed a bound of 10"
    q.set_byte_limit(20)  # a higher limit wakes it at once
    assert put.wait(5.0)
    t.join(5.0)
    held, empty, _ = q.take_marks()
    assert held >= 1 and empty == 0
    for _ in range(3):
        q.get_nowait()
    assert not q.wait_for_item(0.01)
    held, empty, low = q.take_marks()
    assert empty == 1 and low == 0
    q.put_sized("d", 7)
    assert q.take_marks()[2] == 0  # it was empty in this span
    assert q.take_marks()[2] == 7  # the next span starts at what it holds
    q.set_byte_limit(3)
    assert q.qbytes() == 7  # what it holds above a lower limit drains as it is taken
    with pytest.raises(ValueError, match=r"byte limit must be an int >= 1, got 0"):
        q.set_byte_limit(0)
    q.close()


# -- real pipelines --------------------------------------------------------------------------
CHUNK_ROWS = 64  # rows of 1 KiB: a chunk is 64 KiB


def _chunk(k: int) -> list[np.ndarray]:
    x = np.empty((CHUNK_ROWS, 128))
    x[:, 0] = k
    return [x]


class Fast:
    """Chunks of 64 KiB as fast as it can."""

    def __init__(self) -> None:
        self.k = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        self.k += 1
        return _chunk(self.k)


class Bursty:
    """Chunks of 64 KiB at once, but every ``every``-th call takes ``stall`` s."""

    def __init__(self, every: int, stall: float) -> None:
        self.k = 0
        self.every = every
        self.stall = stall

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        self.k += 1
        if self.k % self.every == 0:
            time.sleep(self.stall)
        return _chunk(self.k)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of 0.3 s, a budget of 8 MiB ("auto" would take an eighth of memory)."""
    monkeypatch.setattr(buffers, "WINDOW_S", 0.3)
    monkeypatch.setattr(wiring, "auto_buffered_bytes", lambda name: 8 * MIB)


def _limit(gc: blobfeed.GlobalCoordinator) -> float:
    return sample(gc, "blobfeed_internal_queue_limit_bytes", source=SRC)


def test_the_memory_held_falls_when_the_net_is_the_limit(quick: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buffers, "START_BYTES", 4 * MIB)
    monkeypatch.setattr(buffers, "FLOOR_BYTES", 512 << 10)
    gc = blobfeed.GlobalCoordinator(log_interval=0.1)
    net = Net(name="n")
    init_data_input_workers(net, ["x"], Fast(), CHUNK_ROWS, 1, coordinator=gc, max_buffered_bytes="auto")
    try:
        gc.start()
        assert _limit(gc) == 4 * MIB
        net.run(timeout=30)
        wait_until(lambda: gc._sources[SRC].queue_bytes() >= 3 * MIB, "the queue filled to its start", 30)
        deadline = time.monotonic() + 30
        while _limit(gc) > 512 << 10:  # the net takes a batch every 20 ms: it is the limit
            assert time.monotonic() < deadline, f"the limit stayed at {_limit(gc)}"
            net.run(timeout=30)
            time.sleep(0.02)
        for _ in range(20):
            net.run(timeout=30)
            time.sleep(0.02)
        # the chunks above the new limit drained: what it holds now is at most the floor and a chunk
        assert gc._sources[SRC].queue_bytes() <= (512 << 10) + CHUNK_ROWS * 1024
    finally:
        assert gc.stop(timeout=10.0)


def test_the_memory_held_grows_when_bursts_starve_the_net_within_the_budget(
    quick: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(buffers, "START_BYTES", 256 << 10)
    monkeypatch.setattr(buffers, "FLOOR_BYTES", 256 << 10)
    gc = blobfeed.GlobalCoordinator(log_interval=0.1)
    net = Net(name="n")
    # 100 chunks at once, then 0.2 s of nothing; the net takes one every 4 ms: 50 chunks (3.2 MiB) per stall
    init_data_input_workers(net, ["x"], Bursty(100, 0.2), CHUNK_ROWS, 1, coordinator=gc, max_buffered_bytes="auto")
    peak = 0
    try:
        gc.start()
        deadline = time.monotonic() + 30
        while _limit(gc) < 2 * MIB:
            assert time.monotonic() < deadline, f"the limit stayed at {_limit(gc)}"
            net.run(timeout=30)
            peak = max(peak, gc._sources[SRC].queue_bytes())
            time.sleep(0.004)
        for _ in range(200):
            net.run(timeout=30)
            peak = max(peak, gc._sources[SRC].queue_bytes())
            assert _limit(gc) <= 8 * MIB
            time.sleep(0.004)
    finally:
        assert gc.stop(timeout=10.0)
    assert peak <= 8 * MIB


def test_a_fixed_budget_keeps_the_plain_queue(quick: None) -> None:
    gc = blobfeed.GlobalCoordinator()
    init_data_input_workers(Net(name="a"), ["x"], Fast(), 4, 1, "fixed", coordinator=gc, max_buffered_bytes=MIB)
    init_data_input_workers(Net(name="b"), ["x"], Fast(), 4, 1, "auto", coordinator=gc, max_buffered_bytes="auto")
    assert type(gc._sources["fixed"].dealer.queue) is BlobsQueue
    assert type(gc._sources["auto"].dealer.queue) is WatermarkQueue
    assert "fixed" not in gc._buffers._followed and "auto" in gc._buffers._followed
    gc.stop(timeout=5.0)
