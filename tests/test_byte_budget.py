"""``max_buffered_bytes`` (issue 19 item 12): a source's internal queue is
bounded in bytes as well as in chunks, whatever the chunk size; the gauge
``blobfeed_internal_queue_bytes`` shows what it holds.  docs/CONTRACT.md,
"Feeding a net".
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed import Net, init_data_input_workers
from blobfeed.feeders.chunks import Chunk
from blobfeed.feeders.dealing import LaneDealer
from blobfeed.queues import BlobsQueue

from .helpers import WAIT, drain, sample, wait_until

MIB = 1 << 20
#: rows of 1 KiB: a chunk of 1024 rows is 1 MiB
ROW = 128  # float64s


def big_fetcher(chunks: int, rows: int = 1024):
    """Worker w returns ``chunks`` chunks of ``rows`` rows of 1 KiB, each row
    tagged with a unique id, then StopIteration."""
    calls = {}

    def fetch(worker_id: int, batch_size: int):
        k = calls.get(worker_id, 0)
        if k == chunks:
            raise StopIteration
        calls[worker_id] = k + 1
        x = np.empty((rows, ROW))
        x[:, 0] = worker_id * 1_000_000 + k * rows + np.arange(rows)
        return [x]

    return fetch


def _ids(batches) -> list[float]:
    return [v for b in batches for v in b["x"][:, 0]]


# -- the queue -------------------------------------------------------------------------


def test_queue_put_sized_waits_at_the_byte_bound_and_counts() -> None:
    q: BlobsQueue[str] = BlobsQueue(100, max_bytes=10, low_water=50)
    assert q.put_sized("a", 6) and q.put_sized("b", 4)
    assert q.qbytes() == 10
    put = threading.Event()

    def producer() -> None:
        q.put_sized("c", 3)
        put.set()

    t = threading.Thread(target=producer)
    t.start()
    try:
        assert not put.wait(0.1), "a put past the byte bound went through"
        assert q.get(WAIT) == "a"  # 4 bytes left: at most half the bound, the producer wakes
        assert put.wait(WAIT)
        assert q.qbytes() == 7 and q.qsize() == 2
    finally:
        q.close()
        t.join(WAIT)


def test_queue_takes_an_item_larger_than_the_bound_when_empty() -> None:
    q: BlobsQueue[str] = BlobsQueue(4, max_bytes=10)
    assert q.put_sized("huge", 1000)
    assert q.qbytes() == 1000
    assert q.get(WAIT) == "huge" and q.qbytes() == 0


def test_queue_close_wakes_a_producer_blocked_on_bytes() -> None:
    q: BlobsQueue[str] = BlobsQueue(4, max_bytes=10)
    q.put_sized("a", 10)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(q.put_sized("b", 1)))
    t.start()
    q.close(RuntimeError("stop"))
    t.join(WAIT)
    assert result == [False] and q.qbytes() == 0


def test_queue_byte_bound_is_checked() -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_bytes"):
            BlobsQueue(4, max_bytes=bad)
    with pytest.raises(ValueError, match="counts no bytes"):
        BlobsQueue(4).put_sized("a", 1)


# -- a source ------------------------------------------------------------------------------


@pytest.mark.parametrize("slow_first_batch", [False, True], ids=["", "slow-first-batch"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_fetcher_of_big_chunks_blocks_at_the_byte_budget(gc, deterministic: bool, slow_first_batch: bool) -> None:
    # 2 MiB chunks, a 4 MiB budget, 800 chunks allowed by count: the bytes
    # bound it.  A fetcher blocked on the budget is woken once the queue
    # drained to half of it (the low-water mark): with chunks of half the
    # budget, any chunk the net's side takes wakes it, and it fills the queue
    # back up to the budget.  (With 1 MiB chunks the queue stood at 3 MiB,
    # the fetcher asleep, whenever the net's side took its second chunk
    # after the fetcher blocked: a timeout under load.)
    net = Net(name="n")
    init_data_input_workers(net, ["x"], big_fetcher(20, rows=2048), 1024, num_worker_threads=1, coordinator=gc,
                            device_queue_capacity=1, max_buffered_bytes=4 * MIB, deterministic=deterministic)
    source = gc._sources["train"]
    two_placed = threading.Event()
    if slow_first_batch:
        # the net's side slow with its first batch (a loaded machine): the
        # fetcher fills the queue and blocks before the net's side takes more
        feed = source.feeds[0]
        place, placed = feed._place, []

        def slow_place(arrays):
            placed.append(1)
            if len(placed) == 1:
                time.sleep(0.3)
            elif len(placed) == 2:
                two_placed.set()
            return place(arrays)

        feed._place = slow_place
    else:
        two_placed.set()
    gc.start()
    assert two_placed.wait(WAIT)

    # at rest: the fetcher blocked handing over a third queued chunk, the net's side full
    def at_rest() -> bool:
        return (source.inflight.get(next(iter(source.dealer.worker_ids)), 0) > 0
                and sample(gc, "blobfeed_internal_queue_depth", source="train") == 2
                and sample(gc, "blobfeed_device_queue_depth", source="train", net="n") == 1)

    # bounded generously; the message says where it stood
    try:
        wait_until(at_rest, "the fetcher blocked on a full queue", timeout=30)
    except AssertionError as err:
        raise AssertionError(
            f"{err}: queue depth {sample(gc, 'blobfeed_internal_queue_depth', source='train')}, "
            f"bytes {sample(gc, 'blobfeed_internal_queue_bytes', source='train')}, "
            f"in flight {dict(source.inflight)}, device queue "
            f"{sample(gc, 'blobfeed_device_queue_depth', source='train', net='n')}") from None
    assert sample(gc, "blobfeed_internal_queue_bytes", source="train") == 4 * MIB
    assert source.dealer.stats().queued_bytes == 4 * MIB
    assert source.dealer.stats().max_bytes == 4 * MIB
    batches = drain(net)
    ids = _ids(batches)
    assert len(ids) == 40 * 1024 and ids == sorted(ids)
    assert sample(gc, "blobfeed_internal_queue_bytes", source="train") == 0


@pytest.mark.parametrize("mode", [{}, {"deterministic": True}, {"shuffle_buffer": 2048}])
def test_a_chunk_bigger_than_the_budget_still_passes(gc, mode) -> None:
    nets = [Net(name="a"), Net(name="b")]
    for net in nets:
        init_data_input_workers(net, ["x"], big_fetcher(6), 256, num_worker_threads=2, coordinator=gc,
                                max_buffered_bytes=1000, **mode)
    gc.start()
    seen = [v for batches in blobfeed_drain_all(nets) for v in _ids(batches)]
    assert len(seen) == 4 * 6 * 1024  # two calls of two workers each, every sample once
    assert len(set(seen)) == len(seen)


def blobfeed_drain_all(nets):
    from .helpers import drain_in_threads

    return list(drain_in_threads(nets).values())


def test_unbounded_counts_bytes(gc) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["x"], big_fetcher(10, rows=16), 16, num_worker_threads=1, coordinator=gc,
                            max_buffered_bytes=None, max_buffered_batches=2, device_queue_capacity=1)
    source = gc._sources["train"]
    assert source.dealer.stats().max_bytes is None
    gc.start()
    wait_until(lambda: sample(gc, "blobfeed_internal_queue_depth", source="train") == 2,
               "the queue full by count")
    assert sample(gc, "blobfeed_internal_queue_bytes", source="train") == 2 * 16 * ROW * 8
    assert len(drain(net)) == 10


def test_accounting_identity_holds_at_the_byte_budget(gc) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["x"], big_fetcher(1000, rows=64), 64, num_worker_threads=2,
                            coordinator=gc, device_queue_capacity=1, max_buffered_bytes=3 * 64 * ROW * 8)
    gc.start()
    for _ in range(3):
        net.run(timeout=WAIT)
    wait_until(lambda: sample(gc, "blobfeed_internal_queue_depth", source="train") == 3,
               "the queue full by bytes")

    def parts() -> tuple[float, float]:
        fetched = sample(gc, "blobfeed_fetched_samples_total", source="train")
        delivered = sample(gc, "blobfeed_delivered_samples_total", source="train", net="n")
        dropped = sum(sample(gc, "blobfeed_dropped_samples_total", source="train", reason=r)
                      for r in ("drop_last", "stopped", "error"))
        return fetched, delivered + dropped + sample(gc, "blobfeed_buffered_samples", source="train")

    # Each part is read at its own moment: while a fetcher still moves a
    # chunk in (the enqueuer may have taken one out of the full queue
    # after it filled), a chunk accepted between the reads counts in one
    # part only (512 against 640 once, under load).  Once the pipeline
    # stands still at its bounds, the identity is exact.
    def still() -> bool:
        full = (sample(gc, "blobfeed_internal_queue_depth", source="train") == 3
                and sample(gc, "blobfeed_device_queue_depth", source="train", net="n") == 1)
        return full and parts()[0] == parts()[0]
    wait_until(still, "the pipeline to stand still at its bounds")
    fetched, accounted = parts()
    assert fetched == accounted and fetched >= 3 * 64 + 3 * 64
    assert gc.stop()
    fetched, accounted = parts()
    assert fetched == accounted
    assert sample(gc, "blobfeed_internal_queue_bytes", source="train") == 0


def test_lane_dealer_bounds_each_lane_by_its_share() -> None:
    dealer = LaneDealer("s", 4, [0], capacity=100, outbox_samples=8, on_error=lambda e: None, max_bytes=10)
    dealer.add_lanes([0, 1])
    assert dealer.lane_bytes == 5
    dealer.add_net()
    dealer.start()

    def chunk(w: int, seq: int) -> Chunk:
        return Chunk((np.zeros(4),), 4, w, seq, None)

    # an empty lane takes any chunk; a lane with a chunk waits past its share
    assert dealer.sink(0)(chunk(0, 0), 4)
    assert dealer.sink(1)(chunk(1, 0), 100)
    assert dealer.queued_bytes() == 104
    done = threading.Event()
    t = threading.Thread(target=lambda: (dealer.sink(0)(chunk(0, 1), 4), done.set()))
    t.start()
    try:
        assert not done.wait(0.1), "a lane went past its byte share"
        box = dealer.outboxes[0]
        ok, piece = box.get_nowait()  # worker 0's first chunk is dealt
        assert ok and piece is not None and piece.worker_id == 0
        assert done.wait(WAIT)
        assert dealer.queued_bytes() == 104
    finally:
        dealer.close(None)
        t.join(WAIT)
    assert dealer.queued_bytes() == 0


# -- the argument ------------------------------------------------------------------------


def test_max_buffered_bytes_is_checked(gc) -> None:
    net = Net(name="n")
    f = big_fetcher(1)
    with pytest.raises(ValueError, match="max_buffered_bytes must be >= 1, got 0"):
        init_data_input_workers(net, ["x"], f, 4, coordinator=gc, max_buffered_bytes=0)
    with pytest.raises(TypeError, match="max_buffered_bytes must be an int"):
        init_data_input_workers(net, ["x"], f, 4, coordinator=gc, max_buffered_bytes="1GB")
    with pytest.raises(TypeError, match="max_buffered_bytes must be an int"):
        init_data_input_workers(net, ["x"], f, 4, coordinator=gc, max_buffered_bytes=True)
    assert not gc._sources


def test_default_is_one_gib(gc) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["x"], big_fetcher(1), 4, coordinator=gc)
    assert gc._sources["train"].dealer.stats().max_bytes == 1 << 30


def test_second_wiring_with_another_budget_warns_and_keeps_the_first(gc, caplog) -> None:
    a, b = Net(name="a"), Net(name="b")
    init_data_input_workers(a, ["x"], big_fetcher(1), 4, coordinator=gc, max_buffered_bytes=MIB)
    with caplog.at_level(logging.WARNING, logger="blobfeed"):
        init_data_input_workers(b, ["x"], big_fetcher(1), 4, coordinator=gc, max_buffered_bytes=2 * MIB)
    assert "max_buffered_bytes=2097152 ignored" in caplog.text
    assert gc._sources["train"].dealer.stats().max_bytes == MIB


@pytest.mark.parametrize("available, expected", [
    (16 << 30, 2 << 30),  # an eighth of what the process may still take
    (100 << 20, 64 << 20),  # never under 64 MiB
    (None, 1 << 30),  # unknown: the fixed default
])
def test_an_auto_byte_budget_is_a_share_of_the_memory_the_process_may_take(
    monkeypatch: pytest.MonkeyPatch, available: Any, expected: int,
) -> None:
    """max_buffered_bytes="auto": the bound is a share of the memory this
    process may still take when the source is wired (MemAvailable, within
    its cgroup's limit), and the log says what it chose."""
    from blobfeed.coordinator import wiring

    monkeypatch.setattr(wiring, "mem_available", lambda: available)
    with blobfeed.GlobalCoordinator() as gc:
        net = Net(None, name="auto-bytes")
        init_data_input_workers(net, ["x"], lambda w, b: [np.zeros((4, 2))], 4, 1, "auto-bytes",
                                coordinator=gc, max_buffered_bytes="auto")
        assert gc.open_source("auto-bytes") is not None
        assert gc._sources["auto-bytes"].max_bytes == expected
    with pytest.raises(TypeError, match=r"max_buffered_bytes must be an int >= 1, None or 'auto', got 'big'"):
        init_data_input_workers(Net(None), ["x"], lambda w, b: [np.zeros((4, 2))], 4, 1, "bad",
                                coordinator=blobfeed.GlobalCoordinator(), max_buffered_bytes="big")
