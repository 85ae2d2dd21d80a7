"""A random-access source's unit stacked straight into a worker process's
slot (feeders/unit_slots.py): the slot's arrays are the result, sent with no
copy; a unit that does not stack there gives its slot back; the stream on
worker processes is the same."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed import FetcherError, Net, RandomAccessSource, init_data_input_workers
from blobfeed.feeders.indexed import UnitReader
from blobfeed.feeders.messages import read_arrays
from blobfeed.feeders.unit_slots import UnitSlots

from .helpers import drain
from .test_indexed import SEED, reference

SLOT = 4096
WAIT = 30.0


class Area:
    """Three slots of SLOT bytes in one buffer, and the worker's free list."""

    def __init__(self) -> None:
        self.buf = bytearray(3 * SLOT)
        self.free = [0, 1, 2]
        self.flushes = 0

    def take(self) -> int:
        return self.free.pop()

    def flush(self) -> None:
        self.flushes += 1

    def slots(self, min_bytes: int = 64) -> UnitSlots:
        return UnitSlots(self.buf, lambda k: k * SLOT, SLOT, self.take, self.free.append, self.flush, min_bytes)


LAYOUT = [((4,), np.dtype(np.int64)), ((4, 3), np.dtype(np.float32))]


def test_a_slot_s_arrays_filled_are_claimed_as_the_slot_and_read_back_from_it() -> None:
    area = Area()
    slots = area.slots()
    ids, x = slots(LAYOUT)
    assert area.free == [0, 1] and area.flushes == 1, "one slot taken, what was pending sent before"
    ids[:] = [5, 6, 7, 8]
    x[:] = np.arange(12, dtype=np.float32).reshape(4, 3)
    packed = slots.claim([ids, x], as_tuple=True)
    assert packed is not None and packed.where == 2 and packed.as_tuple
    root = np.frombuffer(area.buf, np.uint8)[2 * SLOT:3 * SLOT]
    back = read_arrays(root, packed)
    assert isinstance(back, tuple)
    np.testing.assert_array_equal(back[0], [5, 6, 7, 8])
    np.testing.assert_array_equal(back[1], np.arange(12, dtype=np.float32).reshape(4, 3))
    assert area.free == [0, 1], "the claimed slot is the parent's now"


def test_a_slot_whose_arrays_are_not_the_result_goes_back() -> None:
    area = Area()
    slots = area.slots()
    taken = slots(LAYOUT)
    assert taken is not None
    assert slots.claim([np.zeros(4, np.int64), taken[1]], as_tuple=False) is None
    assert sorted(area.free) == [0, 1, 2]
    assert slots.claim(taken, as_tuple=False) is None, "nothing held any more"


def test_a_held_slot_goes_back_when_dropped_or_when_the_next_unit_takes_one() -> None:
    area = Area()
    slots = area.slots()
    slots(LAYOUT)
    slots.drop()
    assert sorted(area.free) == [0, 1, 2]
    slots(LAYOUT)
    slots(LAYOUT)  # the first unit fell back without a claim
    assert len(area.free) == 2, "one slot held at a time"


@pytest.mark.parametrize("layout", [[((2,), np.dtype(np.int8))], [((SLOT,), np.dtype(np.float32))]])
def test_units_under_the_minimum_or_over_a_slot_are_left_to_the_reader(layout: list) -> None:
    area = Area()
    assert area.slots(min_bytes=128)(layout) is None
    assert area.free == [0, 1, 2] and area.flushes == 0


class Rows:
    """Sample i: (i, a row of ``width`` floats, each i); sample ``bad``'s
    row has one more.  Module level: it pickles."""

    def __init__(self, n: int, bad: int = -1, width: int = 3) -> None:
        self.n, self.bad, self.width = n, bad, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, np.ndarray]:
        return np.int64(i), np.full(self.width + (i == self.bad), i, np.float32)


def _reader(dataset: Any) -> UnitReader:
    return UnitReader("train", RandomAccessSource(dataset), len(dataset), SEED, ["ids", "x"], [0, 0])


def test_a_unit_reader_stacks_into_the_arrays_it_is_given() -> None:
    area = Area()
    reader = _reader(Rows(8))
    reader.into = area.slots()
    samples = [Rows(8)[i] for i in (3, 1, 4, 0)]
    out = reader._stack(0, [3, 1, 4, 0], samples)
    packed = reader.into.claim(out, as_tuple=False)
    assert packed is not None, "the stacked arrays are the slot's"
    np.testing.assert_array_equal(out[0], [3, 1, 4, 0])
    np.testing.assert_array_equal(out[1], np.repeat(np.array([3, 1, 4, 0], np.float32)[:, None], 3, axis=1))


@pytest.mark.parametrize("kind", [np.bool_, np.uint8, np.int32, np.float16, np.float64, np.complex64])
def test_numpy_scalars_of_any_numeric_type_land_in_the_slot_with_their_values(kind: type) -> None:
    # numbers are written into their slot array in one assignment (not
    # stacked one array each): their values and dtype must come out as stacked
    class Scalars:
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            return kind(i % 2 if kind is np.bool_ else i), np.full(3, i, np.float32)

    area = Area()
    reader = UnitReader("train", RandomAccessSource(Scalars()), 8, SEED, ["v", "x"], [0, 0])
    reader.into = area.slots()
    idx = [5, 2, 7, 0]
    out = reader._stack(0, idx, [Scalars()[i] for i in idx])
    assert reader.into.claim(out, as_tuple=False) is not None, "both blobs are the slot's arrays"
    want = np.stack([Scalars()[i][0] for i in idx])
    assert out[0].dtype == want.dtype == np.dtype(kind)
    np.testing.assert_array_equal(out[0], want)
    np.testing.assert_array_equal(out[1][:, 0], np.array(idx, np.float32))


def test_a_unit_that_does_not_stack_in_the_slot_names_its_sample_and_gives_the_slot_back() -> None:
    area = Area()
    reader = _reader(Rows(8, bad=4))
    reader.into = area.slots()
    samples = [Rows(8, bad=4)[i] for i in (3, 4)]
    with pytest.raises(Exception, match=r"dataset\[4\].*blob 'x'.*per-sample shape \(4,\)"):
        reader._stack(0, [3, 4], samples)
    reader.into.drop()  # what the worker does on the error's event
    assert sorted(area.free) == [0, 1, 2]


def wide(n: int, bad: int = -1) -> Rows:
    """Rows of 8 KiB: a unit of 4 is 32 KiB, one shared-memory slot's worth."""
    return Rows(n, bad, width=2048)


def _run(dataset: Any, workers: int) -> list[tuple[int, ...]]:
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "x"], RandomAccessSource(dataset, shuffle=True, seed=SEED, read_size=4),
                            4, num_worker_threads=workers, coordinator=gc, epochs=2, backend="processes")
    got: list[tuple[int, ...]] = []
    gc.start()
    try:
        for out in drain(net, epochs=True):
            ids = out["ids"]
            np.testing.assert_array_equal(out["x"], np.repeat(ids.astype(np.float32)[:, None], 2048, axis=1))
            got.append(tuple(int(i) for i in ids))
    finally:
        assert gc.stop(timeout=10.0)
    return got


@pytest.mark.parametrize("workers", [1, 3])
def test_units_stacked_in_worker_process_slots_give_the_reference_stream(workers: int) -> None:
    want = [b for b in reference(26, 4, 2) if b[0] != "end"]
    assert _run(wide(26), workers) == want


def test_a_sample_that_does_not_stack_fails_the_source_naming_it_on_processes() -> None:
    with pytest.raises(FetcherError) as err:
        _run(wide(26, bad=9), 2)
    text = str(err.value).splitlines()[0]
    assert "blob 'x'" in text and "dataset[9]" in text and "per-sample shape (2049,)" in text, text


# --------------------------------------------------------------------------- the child's loop, by hand
class Child:
    """A worker process's loop (``child._work``) in a thread of this
    process, with this test as its parent: units down its units pipe,
    slots back on its free pipe, its messages read off its out pipe."""

    def __init__(self, dataset: Any, slots: int = 2) -> None:
        import os
        import pickle
        import threading

        from blobfeed.feeders import child
        from blobfeed.feeders.transport import SlotArea
        from blobfeed.worker_info import WorkerInfo

        self.area, fd = SlotArea.create("test-unit-slots", slots, 1 << 20)
        os.close(fd)
        self.free_r, self.free_w = os.pipe()
        self.units_r, self.units_w = os.pipe()
        self.out_r, out_w = os.pipe()
        # the reader's sentinel: a process's end in the backend, never ready here
        self.sentinel_r, self.sentinel_w = os.pipe()
        reader = _reader(dataset)
        payload = pickle.dumps((reader, None))
        info = WorkerInfo(0, 0, 1, "train", 0, np.random.default_rng(0))
        self.messages: list[Any] = []

        def work() -> None:
            try:
                child._work(info, payload, "raise", self.area, self.free_r, out_w, os.getppid(), 1, 0, self.units_r)
            finally:
                os.close(out_w)

        def receive() -> None:
            from blobfeed.feeders.transport import MessageReader

            reader = MessageReader(self.out_r, self.sentinel_r)
            while (data := reader.recv()) is not None:
                self.messages.extend(pickle.loads(data))

        self.worker = threading.Thread(target=work, daemon=True)
        self.receiver = threading.Thread(target=receive, daemon=True)
        self.worker.start()
        self.receiver.start()

    def unit(self, u: int, lo: int, hi: int) -> None:
        import os

        from blobfeed.feeders.read_units import UNIT_RECORD

        os.write(self.units_w, UNIT_RECORD.pack(u, lo, hi))

    def give(self, index: int) -> None:
        import os

        from blobfeed.feeders.transport import SLOT_INDEX

        os.write(self.free_w, SLOT_INDEX.pack(index))

    def results(self) -> list[Any]:
        from blobfeed.feeders.messages import Result

        return [m for m in self.messages if type(m) is Result]

    def close(self) -> None:
        import os

        self.area.set_stop()
        for fd in (self.free_w, self.units_w):
            os.close(fd)
        self.worker.join(WAIT)
        self.receiver.join(WAIT)
        for fd in (self.free_r, self.units_r, self.out_r, self.sentinel_r, self.sentinel_w):
            os.close(fd)
        self.area.close()
        assert not self.worker.is_alive() and not self.receiver.is_alive()


def test_a_stop_while_a_reader_waits_for_a_slot_ends_the_worker() -> None:
    """Found by review: the stop (-1 on the free pipe) reached the slot the
    reader waited for, which then stacked elsewhere; the worker's own wait
    for a slot after it never saw the stop and blocked until a slot came
    back (a user keeping batches: never; a stop then killed the worker)."""
    from .helpers import wait_until

    c = Child(wide(64), slots=2)
    try:
        for u in range(3):
            c.unit(u, 4 * u, 4 * u + 4)  # 32 KiB units: each one a slot
        wait_until(lambda: len(c.results()) == 2, "both slots sent")
        c.area.set_stop()
        c.give(-1)  # what the parent's stop writes
        c.worker.join(WAIT)
        assert not c.worker.is_alive(), "the worker waits for a slot after the stop"
        assert len(c.results()) == 2
    finally:
        c.close()


def test_waiting_for_a_slot_is_not_counted_as_the_fetch_s_time() -> None:
    """Found by review: the wait for a free slot (every slot the parent's)
    happens inside the reader's call, and counted as fetch time: a full
    ring read as a slow fetcher (the fetch metric, bottleneck, autotune)."""
    import time

    from .helpers import wait_until

    c = Child(wide(64), slots=2)
    try:
        for u in range(3):
            c.unit(u, 4 * u, 4 * u + 4)
        wait_until(lambda: len(c.results()) == 2, "both slots sent")
        time.sleep(0.3)  # the wait under test: the third unit has no slot for this long
        c.give(0)
        wait_until(lambda: len(c.results()) == 3, "the third unit")
        third = c.results()[2]
        assert third.state == 2 and third.seconds < 0.15, third.seconds
    finally:
        c.close()


def test_object_and_foreign_byte_order_dtypes_never_go_into_a_slot() -> None:
    """Found by review: a structured dtype with an object field passed the
    reader's check (its kind is 'V'); numpy wrote object pointers into
    shared memory and the worker crashed."""
    area = Area()
    for dtype in (np.dtype([("v", np.float64, (64,)), ("o", object)]), np.dtype(">f8")):
        assert area.slots()([((8, 64), dtype)]) is None, dtype
    assert area.free == [0, 1, 2], "no slot taken"


class Claims(Rows):
    """Samples whose blob 'x' is a broadcast view claiming ``2**40`` floats
    (4 TiB; 4 bytes held): stacking a unit of them cannot be allocated."""

    def __getitem__(self, i: int) -> tuple[Any, np.ndarray]:
        return np.int64(i), np.broadcast_to(np.float32(i), (1 << 40,))


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_a_unit_too_big_for_memory_is_an_error_naming_it_and_what_its_samples_claim(backend: str) -> None:
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "x"], RandomAccessSource(Claims(8), read_size=2), 2,
                            num_worker_threads=1, coordinator=gc, epochs=1, backend=backend)
    gc.start()
    try:
        with pytest.raises(FetcherError, match=r"read unit 0 \(indexes \[0, 1\]\): its 2 samples stacked do not fit "
                                               r"in memory \(MemoryError\): .*'x' float32 \(1099511627776,\)"):
            net.run(timeout=WAIT)
    finally:
        assert gc.stop(timeout=10.0)


def test_a_layout_cache_reads_what_read_arrays_reads_as_the_layout_changes() -> None:
    """The parent works out a worker's result layout once while it stays
    the same: whatever the order of layouts, each result reads as
    read_arrays and packed_nbytes say (a stale layout would hand out
    arrays of the last one's shapes)."""
    from blobfeed.feeders.messages import LayoutCache, packed_nbytes, read_arrays, write_arrays

    buf = bytearray(1 << 16)
    cache = LayoutCache()
    rng = np.random.default_rng(0)
    layouts = [[(np.float32, (4, 3)), (np.int64, (4,))], [(np.uint8, (8, 5))], [(np.float32, (4, 3)), (np.int64, (4,))],
               [(np.float64, (0, 2)), (np.int16, (2,))], [(np.float32, (4, 3)), (np.int64, (4,))]]
    for k, layout in enumerate(layouts):
        arrays = [(rng.random(shape) * 100).astype(dt) for dt, shape in layout]
        packed = write_arrays(arrays, buf, 0, k, as_tuple=bool(k % 2))
        root = np.frombuffer(buf, np.uint8, count=packed_nbytes(packed))
        assert cache.nbytes_of(packed) == packed_nbytes(packed)
        got, want = cache.read(root, packed), read_arrays(root, packed)
        assert type(got) is type(want) and len(got) == len(want) == len(arrays)
        for g, w, a in zip(got, want, arrays):
            assert g.dtype == w.dtype == a.dtype and g.shape == w.shape == a.shape and np.array_equal(g, a)
            assert g.base is root or g.size == 0


def test_a_result_of_the_last_layout_is_read_with_it_and_a_first_one_without_a_layout_is_refused() -> None:
    """A worker process sends a slot result's layout once while it stays the
    same (``meta=None`` after it): the parent's cache reads it with the
    last layout it was given, and refuses one that has none before it."""
    from blobfeed.feeders.messages import Arrays, LayoutCache, packed_nbytes, read_arrays, write_arrays

    buf = bytearray(1 << 16)
    cache = LayoutCache()
    with pytest.raises(ValueError, match="none came before"):
        cache.nbytes_of(Arrays(0, None, True))
    first = write_arrays([np.arange(12, dtype=np.float32).reshape(4, 3), np.arange(4)], buf, 0, 0, True)
    cache.nbytes_of(first)
    again = write_arrays([np.full((4, 3), 7, np.float32), np.arange(4, 8)], buf, 0, 1, True)
    assert again.meta == first.meta
    short = again._replace(meta=None)
    root = np.frombuffer(buf, np.uint8, count=packed_nbytes(again))
    assert cache.nbytes_of(short) == packed_nbytes(again)
    got = cache.read(root, short)
    assert [a.tolist() for a in got] == [a.tolist() for a in read_arrays(root, again)]
    with pytest.raises(ValueError, match="LayoutCache"):
        read_arrays(root, short)


def test_worker_processes_send_a_slot_result_s_layout_once_while_it_stays_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the parent receives from a worker process whose results keep
    one layout, then change it (an epoch's shorter last unit, then the next
    epoch's first): the layout with the first result and with the first
    after each change, None (the last one's) with the others; the batches
    are whole and right all the same."""
    import pickle

    from blobfeed.feeders import processes
    from blobfeed.feeders.messages import Arrays, Result

    seen: list[object] = []
    handle = processes._Worker._handle

    def spy(self: object, data: bytearray) -> object:
        for ev in pickle.loads(data):
            if type(ev) is Result and type(ev.raw) is Arrays:
                seen.append(None if ev.raw.meta is None else [shape for _, shape, _ in ev.raw.meta])
        return handle(self, data)  # type: ignore[arg-type]

    monkeypatch.setattr(processes._Worker, "_handle", spy)
    net = Net(None, name="layouts")
    gc = blobfeed.GlobalCoordinator()
    # 46 samples of 32 KiB in units of 4: eleven units of 4, then one of 2
    init_data_input_workers(net, ["x", "i"], RandomAccessSource(Wide(46), read_size=4), 4,
                            num_worker_threads=1, coordinator=gc, epochs=2, backend="processes")
    gc.start()
    got = []
    try:
        for out in drain(net, epochs=True):
            assert out["x"].shape == (len(out["i"]), 8192) and (out["x"][:, 0] == out["i"]).all()
            got.extend(out["i"].tolist())
    finally:
        assert gc.stop(timeout=10.0)
    assert got == list(range(46)) * 2
    epoch = [[(4, 8192), (4,)]] + [None] * 10 + [[(2, 8192), (2,)]]
    assert seen == epoch * 2, seen


class Wide:
    """Samples of 32 KiB (8192 float32s) and their index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        return np.full(8192, i, np.float32), np.int64(i)


def test_a_result_with_a_state_of_its_own_always_carries_its_layout() -> None:
    """A stateful fetcher's state may not unpickle in the parent, which
    then skips the message (``on_error="skip"``) and never sees its layout:
    such a result carries its layout and is not the last one sent, so a
    result after it without a layout is read with one the parent holds."""
    from blobfeed.feeders.messages import Arrays, LayoutCache, Result, without_layout, write_arrays

    buf = bytearray(1 << 16)
    small = write_arrays([np.zeros((2, 3), np.float32)], buf, 0, 0, True)
    big = write_arrays([np.zeros((4, 3), np.float32)], buf, 0, 1, True)
    sent: list[object] = [None]
    first = without_layout(Result(0.1, small, 7), sent)  # a read unit's number: judged
    again = without_layout(Result(0.1, small, 8), sent)
    stateful = without_layout(Result(0.1, big, {"cursor": 3}), sent)
    after = without_layout(Result(0.1, small, None), sent)
    assert first.raw.meta == small.meta and again.raw.meta is None
    assert stateful.raw.meta == big.meta and sent[0] == small.meta, "the stateful one is no judge"
    assert after.raw.meta is None
    cache = LayoutCache()  # the parent, which lost the stateful message
    for r in (first, again, after):
        assert cache.nbytes_of(r.raw) == 2 * 3 * 4
    assert isinstance(after.raw, Arrays)
