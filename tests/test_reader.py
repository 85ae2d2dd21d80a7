"""The reader seam (``blobfeed.reader``): a source read without any net.

``init_reader`` wires a source's workers with a first reader,
``GlobalCoordinator.add_reader`` adds more, ``open_source`` describes the
wiring, ``Net.add_reader`` feeds a net from a reader.  Every reader's
enqueuer thread is the coordinator's: started by ``start()``, joined by
``stop()``.  Every wait is bounded.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed import DequeueTimeout, EndOfInput, Net
from blobfeed.reader import Batch, BatchReader, EpochEnd, SourceInfo, init_reader

from .helpers import sample

WAIT = 10.0


def counting(chunks: int, size: int = 3) -> Any:
    """Each worker returns ``chunks`` chunks of ``size`` ids per epoch
    (worker w's ids are w*1000 + k), then ends its epoch."""
    calls: dict[tuple[int, int], int] = {}
    lock = threading.Lock()

    def fetch(worker_id: int, batch_size: int) -> Any:
        info = blobfeed.get_worker_info()
        key = (worker_id, info.epoch if info is not None else 0)
        with lock:
            k = calls.get(key, 0)
            calls[key] = k + 1
        if k >= chunks:
            return "end"
        ids = np.arange(worker_id * 1000 + k * size, worker_id * 1000 + (k + 1) * size)
        return [ids, ids.astype(np.float32)]

    def fetch_fun(worker_id: int, batch_size: int) -> Any:
        got = fetch(worker_id, batch_size)
        if isinstance(got, str):
            raise StopIteration
        return got

    return fetch_fun


def read_all(reader: BatchReader) -> list[Any]:
    """Every item until the end: ids of each batch, or ("end", epoch)."""
    got: list[Any] = []
    while True:
        try:
            item = reader.read(WAIT)
        except EndOfInput:
            return got
        reader.returned(item)
        if type(item) is EpochEnd:
            got.append(("end", item.epoch))
        else:
            assert isinstance(item, Batch)
            got.append(item.arrays[0].tolist())


def read_all_at_once(readers: list[BatchReader]) -> dict[str, list[Any]]:
    """:func:`read_all` of each reader, each in a thread of its own (a
    source dealt in turn needs them read together), by reader name."""
    results: dict[str, list[Any]] = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r.name, read_all(r))) for r in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 3)
    assert not any(t.is_alive() for t in threads)
    return results


def test_a_source_is_read_through_a_reader_without_any_net() -> None:
    with blobfeed.GlobalCoordinator() as gc:
        reader = init_reader(["id", "x"], counting(4), 4, 2, "src", coordinator=gc, reader_name="r0")
        assert isinstance(reader, BatchReader)
        assert (reader.name, reader.source_name, reader.blob_names, reader.batch_size) == ("r0", "src", ("id", "x"), 4)
        assert not [t for t in threading.enumerate() if t.name.startswith("blobfeed-enqueue-src")]
        gc.start()
        # the reader's enqueuer is one of the coordinator's threads, started by start()
        assert [t for t in threading.enumerate() if t.name == "blobfeed-enqueue-src-r0"]
        got = read_all(reader)
        assert gc.stop(WAIT)
    assert not [t for t in threading.enumerate() if t.name.startswith("blobfeed-enqueue-src")]
    flat = sorted(i for b in got for i in b)
    assert flat == sorted([w * 1000 + i for w in (0, 1) for i in range(12)])
    # whole batches of 4, the last one the rest
    assert all(len(b) == 4 for b in got[:-1]) and 1 <= len(got[-1]) <= 4


def test_readers_added_to_a_deterministic_source_are_dealt_in_turn_and_described() -> None:
    with blobfeed.GlobalCoordinator() as gc:
        first = init_reader(
            ["id", "x"], counting(3), 3, 2, "det", coordinator=gc, reader_name="a", deterministic=True, epochs=2,
        )
        second = gc.add_reader("det", "b")
        info = gc.open_source("det")
        assert isinstance(info, SourceInfo)
        assert info.readers == ("a", "b") and info.blob_names == ("id", "x") and info.batch_size == 3
        assert info.deterministic and info.epochs == 2 and info.resumable and not info.started
        with pytest.raises(ValueError, match="batch_size=3"):
            gc.add_reader("det", "c", batch_size=5)
        with pytest.raises(dataclass_frozen()):
            info.name = "other"  # type: ignore[misc]
        gc.start()
        assert gc.open_source("det").started
        with pytest.raises(ValueError, match="before start"):
            gc.add_reader("det", "late")
        results = read_all_at_once([first, second])
        assert gc.stop(WAIT)
    a, b = results["a"], results["b"]
    # each epoch: both see its end; the batches of the epoch alternate a, b, a, ...
    assert ("end", 0) in a and ("end", 0) in b
    batches = [x for x in a + b if not (isinstance(x, tuple))]
    assert sorted(i for x in batches for i in x) == sorted(
        [w * 1000 + i for w in (0, 1) for i in range(9)] * 2
    )


def dataclass_frozen() -> type[BaseException]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_a_net_takes_a_reader_through_add_reader() -> None:
    with blobfeed.GlobalCoordinator() as gc:
        # dealt in turn: 3 batches of 2, one per reader, whichever is read first
        init_reader(["id", "x"], counting(2), 2, 1, "n", coordinator=gc, reader_name="first", deterministic=True)
        net = Net(None, name="reading-net")
        reader = gc.add_reader("n", "reading-net", drop_last=False)
        net.add_reader(reader)
        with pytest.raises(ValueError, match="already fed from source 'n'"):
            net.add_reader(gc.add_reader("n", "again"))
        with pytest.raises(TypeError, match="BatchReader"):
            net.add_reader("n")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="feeds net 'reading-net' already"):
            Net(None, name="other").add_reader(reader)
        late = gc.add_reader("n", "late")
        gc.start()
        with pytest.raises(ValueError, match="before the coordinator's start"):
            Net(None, name="late-net").add_reader(late)
        out = net.run(WAIT)
        assert set(out) == {"id", "x"} and out["id"].tolist() == [2, 3]
        assert gc.stop(WAIT)
        with pytest.raises(EndOfInput):
            net.run(WAIT)


def test_open_source_and_add_reader_refuse_an_unknown_source() -> None:
    with blobfeed.GlobalCoordinator() as gc:
        with pytest.raises(ValueError, match="no source 'nope'"):
            gc.open_source("nope")
        with pytest.raises(ValueError, match="no source 'nope'"):
            gc.add_reader("nope", "r")


def test_a_reader_before_start_says_so_and_times_out_bounded() -> None:
    with blobfeed.GlobalCoordinator() as gc:
        reader = init_reader(["id", "x"], counting(1), 2, 1, "early", coordinator=gc)
        with pytest.raises(blobfeed.BlobfeedError, match="never started"):
            reader.read(0.01)
        gc.start()
        read_all(reader)
        with pytest.raises((EndOfInput, DequeueTimeout)):
            reader.read(0.01)
        assert gc.stop(WAIT)


def test_an_inlet_is_fed_by_its_caller_and_its_enqueuer_is_the_coordinator_s() -> None:
    """A source fed with whole batches by its caller (a remote consumer's
    end): read in order, each item's number told back once returned, the
    end after what is queued; it has no enqueuer thread at all (its
    caller's put() queues each batch where the reader takes it), and
    close(), or the coordinator's stop(), leaves none behind."""
    returned: list[int] = []
    with blobfeed.GlobalCoordinator() as gc:
        inlet = gc.open_inlet("remote", ["id"], "r", batch_size=2, capacity=4, timeout=WAIT,
                              on_returned=returned.append)
        inlet.start()
        name = "blobfeed-enqueue-remote-r"
        assert not [t for t in threading.enumerate() if t.name == name]
        assert inlet.put([np.array([1, 2])], 2, 10)
        assert inlet.end_epoch(0, 0, 11)
        assert inlet.put([np.array([3])], 1, 12)
        inlet.finish()
        assert read_all(inlet.reader) == [[1, 2], ("end", 0), [3]]
        assert returned == [10, 11, 12] and inlet.unreturned() == 0
        assert inlet.close(WAIT)
        assert not [t for t in threading.enumerate() if t.name == name]
        # a second inlet, left open: the coordinator's stop() joins its enqueuer
        other = gc.open_inlet("remote", ["id"], "r2", batch_size=2, capacity=4, timeout=WAIT, on_returned=returned.append)
        other.start()
        assert gc.stop(WAIT)
        assert not [t for t in threading.enumerate() if t.name == "blobfeed-enqueue-remote-r2"]
        with pytest.raises(EndOfInput):
            other.reader.read(0.1)
        assert other.close(WAIT)


def test_an_inlet_hands_each_batch_straight_to_its_reader() -> None:
    """An inlet's put() hands the batch itself to the reader's queue (no
    thread, no re-batching, no copy of read-only arrays), which holds
    ``capacity`` items: one more put waits until the reader takes one.
    A net that writes its batches (writable=True) gets a copy."""
    before = {t.name for t in threading.enumerate()}
    with blobfeed.GlobalCoordinator() as gc:
        inlet = gc.open_inlet("remote", ["id"], "r", batch_size=2, capacity=2, timeout=WAIT,
                              on_returned=lambda g: None)
        inlet.start()
        assert {t.name for t in threading.enumerate()} == before
        a = np.array([1, 2])
        a.setflags(write=False)
        assert inlet.put([a], 2, 0)
        assert inlet.reader.ready() == 1  # at once: nobody else moves it
        assert inlet.put([np.array([3, 4])], 2, 1)
        third = threading.Thread(target=inlet.put, args=([np.array([5, 6])], 2, 2), daemon=True)
        third.start()
        third.join(0.3)
        assert third.is_alive(), "a put into a full inlet must wait for the reader"
        batch = inlet.reader.read(WAIT)
        assert isinstance(batch, Batch) and batch.arrays[0] is a
        inlet.reader.returned(batch)
        third.join(WAIT)
        assert not third.is_alive()
        got = inlet.reader.read(WAIT)
        assert isinstance(got, Batch) and not got.arrays[0].flags.writeable  # a writable array is handed out read-only
        assert inlet.close(WAIT)
    assert {t.name for t in threading.enumerate()} == before


def test_request_stop_coordinator_stops_one_source_without_waiting() -> None:
    """The feeding service fails one of its sources from its own threads:
    the named source stops (its readers see EndOfInput), the call returns
    at once, the other sources go on and the coordinator is not stopping."""
    import time

    with blobfeed.GlobalCoordinator() as gc:
        a = init_reader(["id", "x"], lambda w, b: [np.zeros(2), np.zeros(2)], 2, 1, "a", coordinator=gc, epochs=None)
        b = init_reader(["id", "x"], lambda w, b: [np.zeros(2), np.zeros(2)], 2, 1, "b", coordinator=gc, epochs=None)
        gc.start()
        a.returned(a.read(WAIT))
        t0 = time.monotonic()
        gc.request_stop_coordinator("a")
        assert time.monotonic() - t0 < 1.0
        deadline = time.monotonic() + WAIT
        with pytest.raises(EndOfInput):
            while time.monotonic() < deadline:
                a.returned(a.read(WAIT))
        for _ in range(5):
            b.returned(b.read(WAIT))
        assert not gc.should_stop()
        with pytest.raises(TypeError, match="str"):
            gc.request_stop_coordinator(3)  # type: ignore[arg-type]
        assert gc.stop(WAIT)


def test_a_batch_given_back_is_read_first_and_dropped_once_the_source_stopped() -> None:
    """hold(): the consumer half keeps a batch it was handed and did not use
    (as a net does when another of its sources fails); the next read()
    hands it out again; after a stop it is counted as dropped instead."""
    from .helpers import sample

    with blobfeed.GlobalCoordinator() as gc:
        reader = init_reader(["id", "x"], counting(3), 3, 1, "h", coordinator=gc, deterministic=True)
        gc.start()
        first = reader.read(WAIT)
        reader.hold(first)
        again = reader.read(WAIT)
        assert again is first
        reader.returned(again)
        second = reader.read(WAIT)
        assert gc.stop(WAIT)
        reader.hold(second)  # given back after the stop: dropped, not kept
        with pytest.raises(EndOfInput):
            reader.read(0.1)
        assert sample(gc, "blobfeed_dropped_samples_total", source="h", reason="stopped") >= second.n


# -- prefetch=False: the reader's thread does the enqueuer's work ---------------------
class Counting:
    """``counting`` that pickles (for worker processes): each (worker,
    epoch) key is only ever touched by its one worker."""

    def __init__(self, chunks: int, size: int) -> None:
        self.chunks, self.size = chunks, size
        self.calls: dict[tuple[int, int], int] = {}

    def __call__(self, worker_id: int, batch_size: int) -> Any:
        info = blobfeed.get_worker_info()
        key = (worker_id, info.epoch if info is not None else 0)
        k = self.calls.get(key, 0)
        self.calls[key] = k + 1
        if k >= self.chunks:
            raise StopIteration
        ids = np.arange(worker_id * 1000 + k * self.size, worker_id * 1000 + (k + 1) * self.size)
        return [ids, ids.astype(np.float32)]


def enqueuers(source: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(f"blobfeed-enqueue-{source}")]


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_a_reader_without_prefetch_assembles_in_its_own_thread_the_same_stream(backend: str) -> None:
    """Deterministic, two epochs, dealt to two readers: the stream each
    reader gets is the one prefetching readers get, and no enqueuer thread
    runs for a reader without prefetch."""
    streams = []
    for prefetch in (True, False):
        with blobfeed.GlobalCoordinator() as gc:
            first = init_reader(
                ["id", "x"], Counting(5, 3), 4, 2, "pf", coordinator=gc, reader_name="a",
                deterministic=True, epochs=2, backend=backend, prefetch=prefetch,
            )
            second = gc.add_reader("pf", "b", prefetch=prefetch)
            gc.start()
            assert len(enqueuers("pf")) == (2 if prefetch else 0)
            results = read_all_at_once([first, second])
            assert gc.stop(WAIT)
        streams.append(results)
    assert streams[0] == streams[1]
    got = [i for r in streams[1].values() for b in r if not isinstance(b, tuple) for i in b]
    assert sorted(got) == sorted([w * 1000 + i for w in (0, 1) for i in range(15)] * 2)


def test_a_reader_without_prefetch_reads_ready_batches_without_waiting_and_in_order() -> None:
    """read_ready(): the next batch if the source's queued chunks complete
    it now (assembled in the caller's thread, never put on the device queue
    and taken back), else None at once; the stream is the one read() gives,
    epoch ends included, and its end comes from read() (the service's
    senders gather batches for one record this way)."""
    def stream(use_ready: bool) -> list[Any]:
        with blobfeed.GlobalCoordinator() as gc:
            reader = init_reader(["id", "x"], Counting(6, 3), 4, 2, "rr", coordinator=gc,
                                 deterministic=True, epochs=2, prefetch=False)
            assert reader.read_ready() is None  # not started: nothing, and no error
            gc.start()
            got: list[Any] = []
            ready = 0
            while True:
                b = reader.read_ready() if use_ready else None
                if b is None:
                    try:
                        b = reader.read(WAIT)
                    except EndOfInput:
                        break
                else:
                    ready += 1
                got.append(("end", b.epoch) if isinstance(b, EpochEnd) else b.arrays[0].tolist())
                reader.returned(b)
            assert reader.lent == 0
            assert gc.stop(WAIT)
        if use_ready:
            assert ready > 0, "read_ready() never had a batch ready"
        return got

    assert stream(True) == stream(False)


def test_a_reader_without_prefetch_times_out_stops_and_ends_bounded() -> None:
    release = threading.Event()

    def slow(worker_id: int, batch_size: int) -> Any:
        if not release.wait(WAIT):
            raise StopIteration
        release.clear()
        ids = np.arange(2)
        return [ids, ids.astype(np.float32)]

    with blobfeed.GlobalCoordinator() as gc:
        reader = init_reader(["id", "x"], slow, 2, 1, "slow", coordinator=gc, prefetch=False)
        with pytest.raises(blobfeed.BlobfeedError, match="never started"):
            reader.read(0.05)
        gc.start()
        with pytest.raises(DequeueTimeout, match="'slow'"):
            reader.read(0.05)
        assert reader.ready() == 0
        release.set()
        batch = reader.read(WAIT)
        assert isinstance(batch, Batch) and batch.arrays[0].tolist() == [0, 1]
        reader.returned(batch)
        # a stop from another thread ends a read waiting in the reader's thread
        stopper = threading.Timer(0.05, gc.request_stop)
        stopper.start()
        with pytest.raises(EndOfInput):
            reader.read(WAIT)
        release.set()  # the fetcher, waiting in fetch_fun, returns: stop() need not wait out its WAIT
        stopper.join(WAIT)
        assert not stopper.is_alive()
        assert gc.stop(WAIT)
    assert not enqueuers("slow")


def test_a_reader_without_prefetch_gets_a_fetcher_error_at_its_place() -> None:
    def failing(worker_id: int, batch_size: int) -> Any:
        failing.calls += 1  # type: ignore[attr-defined]
        if failing.calls > 3:  # type: ignore[attr-defined]
            raise RuntimeError("disk on fire")
        ids = np.arange(4) + 4 * (failing.calls - 1)  # type: ignore[attr-defined]
        return [ids, ids.astype(np.float32)]

    failing.calls = 0  # type: ignore[attr-defined]
    with blobfeed.GlobalCoordinator() as gc:
        reader = init_reader(["id", "x"], failing, 4, 1, "err", coordinator=gc, prefetch=False, deterministic=True)
        gc.start()
        got = []
        with pytest.raises(blobfeed.FetcherError, match="disk on fire"):
            for _ in range(10):
                b = reader.read(WAIT)
                got.append(b.arrays[0].tolist())
                reader.returned(b)
        assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        gc.stop(WAIT)


@pytest.mark.parametrize("prefetch", [True, False])
def test_batches_a_reader_holds_unreturned_count_as_buffered(prefetch: bool) -> None:
    """A reader may read several batches before it returns them (the
    service's sender does, up to a consumer's slots): until returned they
    are the source's, buffered, so fetched == delivered + dropped + buffered
    holds in every scrape (it missed them: the service's /metrics broke the
    identity by the batches out at its consumers)."""
    from .contract.util import accounts, balanced
    from .helpers import wait_until

    with blobfeed.GlobalCoordinator() as gc:
        reader = init_reader(["id", "x"], Counting(4, 3), 4, 1, "held", coordinator=gc, prefetch=prefetch)
        gc.start()
        out = [reader.read(WAIT) for _ in range(2)]
        # the worker ends (4 chunks of 3); then the scrape is at rest
        wait_until(lambda: accounts(gc, "held")["fetched"] == 12, "the worker's 12 samples", WAIT)
        a = accounts(gc, "held")
        assert balanced(a) and a["buffered"] == 12 and a["delivered"] == 0, a
        for b in out:
            reader.returned(b)
        a = accounts(gc, "held")
        assert balanced(a) and a["delivered"] == 8 and a["buffered"] == 4, a
        assert gc.stop(WAIT)


def test_a_reader_without_prefetch_stopped_mid_batch_counts_what_its_re_batcher_held() -> None:
    """Nothing pumps a reader without prefetch after a stop: the samples
    its re-batcher held were counted nowhere (fetched != delivered +
    dropped), and its buffers lived on with the feed (a served source's
    arena stayed mapped after the service's stop)."""
    gc = blobfeed.GlobalCoordinator()
    reader = init_reader(["id", "x"], Counting(50, 3), 4, 1, "mid", coordinator=gc, prefetch=False, seed=1)
    gc.start()
    for _ in range(2):  # 8 samples of 3-sample chunks: one taken in part, its rest held
        batch = reader.read(timeout=WAIT)
        reader.returned(batch)
    assert gc.stop(WAIT)
    fetched = sample(gc, "blobfeed_fetched_samples_total", source="mid")
    delivered = sample(gc, "blobfeed_delivered_samples_total", source="mid", net="reader")
    dropped = sample(gc, "blobfeed_dropped_samples_total", source="mid", reason="stopped")
    assert delivered == 8, delivered
    assert fetched == delivered + dropped and fetched > 8, (fetched, delivered, dropped)
    assert sample(gc, "blobfeed_buffered_samples", source="mid") == 0
