"""Read units pushed to worker processes (``UnitDispenser.attach``): no thread
per worker process waits for units; whichever thread frees one (a
delivery, the stream taking a unit, a death, a stop) writes the next down
the child's pipe.  What a pulled ``take`` guarantees holds for pushed
holders too: ``ahead`` at most undelivered, the window, units read again
first, one end each, and a failed send is reported outside the lock."""

from __future__ import annotations

import threading
import numpy as np
import pytest

import blobfeed
from blobfeed import Net, RandomAccessSource, init_data_input_workers
from blobfeed.feeders.read_units import ReadUnit, UnitDispenser


class Holder:
    """A pushed holder's end: what it was sent, and its end."""

    def __init__(self, dispenser: UnitDispenser, raises: BaseException | None = None) -> None:
        self.dispenser = dispenser
        self.got: list[ReadUnit] = []
        self.ends = 0
        self.raises = raises
        self.failures: list[tuple[ReadUnit | None, BaseException, bool]] = []

    def send(self, r: ReadUnit | None) -> None:
        if r is None:
            self.ends += 1
            return
        if self.raises is not None:
            raise self.raises
        self.got.append(r)

    def failed(self, r: ReadUnit | None, exc: BaseException) -> None:
        # the dispenser's lock must be free here: a failure may stop the source
        free = self.dispenser._cond.acquire(blocking=False)
        if free:
            self.dispenser._cond.release()
        self.failures.append((r, exc, free))

    def units(self) -> list[int]:
        return [r.unit for r in self.got]


def dispenser(n: int = 64, read_size: int = 4, epochs: int | None = 1, window: int = 8) -> UnitDispenser:
    d = UnitDispenser("src", n, read_size, epochs)
    d.window = window
    return d


def test_a_pushed_holder_gets_ahead_units_and_one_more_per_delivery() -> None:
    d = dispenser()
    h = Holder(d)
    d.attach(0, 101, 2, h.send, h.failed)
    assert h.units() == [0, 1]
    assert d.delivered(101, 0)
    assert h.units() == [0, 1, 2]
    assert d.delivered(101, 2)  # out of order: still one less held
    assert h.units() == [0, 1, 2, 3]
    assert h.ends == 0


def test_pushed_holders_take_turns_and_the_window_holds_them_back() -> None:
    d = dispenser(window=4)
    a, b = Holder(d), Holder(d)
    d.attach(0, 1, 3, a.send, a.failed)
    d.attach(1, 2, 3, b.send, b.failed)
    # four units in the window: the first holder took three before the second came
    assert a.units() + b.units() == [0, 1, 2, 3]
    for u in (0, 1, 2):
        assert d.delivered(1, u)
    assert d.delivered(2, 3)
    assert a.units() + b.units() == [0, 1, 2, 3], "nothing past the window before the stream took a unit"
    d.consumed(0)
    d.consumed(1)
    # two more in the window, one each, in turn
    assert sorted(a.units()[3:] + b.units()[1:]) == [4, 5]
    assert a.units()[3:] and b.units()[1:]


def test_a_retired_holder_ends_and_its_replacement_reads_its_units_first() -> None:
    d = dispenser()
    old, new = Holder(d), Holder(d)
    d.attach(0, 1, 2, old.send, old.failed)
    assert old.units() == [0, 1]
    assert d.retire(1) == []
    assert old.ends == 1
    d.attach(0, 2, 2, new.send, new.failed)
    assert new.units() == [0, 1], "the dead process's units, read again by the one in its place"
    assert d.delivered(2, 0)
    assert new.units() == [0, 1, 2]


def test_the_data_end_and_a_close_end_each_holder_once() -> None:
    d = dispenser(n=8, read_size=4)
    a, b = Holder(d), Holder(d)
    d.attach(0, 1, 4, a.send, a.failed)
    d.attach(1, 2, 4, b.send, b.failed)
    assert a.units() == [0, 1] and a.ends == 1 and b.ends == 1  # two units in all: the data ended
    d.close()
    d.detach(1)
    assert (a.ends, b.ends) == (1, 1)
    c = Holder(d)
    d.attach(0, 3, 2, c.send, c.failed)
    assert c.got == [] and c.ends == 1  # attached after the close: ended at once


def test_a_detached_holder_gets_its_end_and_nothing_more() -> None:
    d = dispenser()
    h = Holder(d)
    d.attach(0, 1, 2, h.send, h.failed)
    d.detach(1)
    d.detach(1)
    assert h.ends == 1
    assert d.delivered(1, 0)
    assert h.units() == [0, 1]


@pytest.mark.parametrize("exc", [BrokenPipeError(32, "Broken pipe"), BlockingIOError(11, "full")])
def test_a_send_that_raises_detaches_the_holder_and_is_reported_outside_the_lock(exc: BaseException) -> None:
    d = dispenser()
    bad, good = Holder(d, raises=exc), Holder(d)
    d.attach(0, 1, 2, bad.send, bad.failed)
    assert [(r.unit if r else None, e, free) for r, e, free in bad.failures] == [(0, exc, True)]
    d.attach(1, 2, 2, good.send, good.failed)
    assert good.units() == [1, 2]
    assert d.delivered(2, 1)
    assert good.units() == [1, 2, 3] and len(bad.failures) == 1
    # the unit it was given stays its own: its death (retire), its worker
    # not replaced (release), hands it to another
    d.retire(1)
    d.release(0)
    assert d.delivered(2, 2)
    assert good.units()[3] == 0


class Arrays:
    """A small map-style dataset: sample i is (i * ones(4), i)."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple:
        return np.full(4, i, np.float32), np.int64(i)


def test_worker_processes_are_fed_with_no_thread_per_process() -> None:
    net = Net(None, name="push")
    gc = blobfeed.GlobalCoordinator()
    init_data_input_workers(net, ["x", "i"], RandomAccessSource(Arrays(), shuffle=True, seed=3), 8,
                            num_worker_threads=3, coordinator=gc, backend="processes", epochs=1)
    gc.start()
    try:
        got = []
        threads = set()
        while True:
            try:
                out = net.run(timeout=30)
            except blobfeed.EndOfInput:
                break
            got.extend(out["i"].tolist())
            threads.update(t.name for t in threading.enumerate())
    finally:
        gc.stop()
    assert got == np.random.default_rng((3, 0)).permutation(96).tolist()
    assert not [t for t in threads if t.startswith("blobfeed-units")], sorted(threads)
    assert [t for t in threads if t.startswith("blobfeed-recv-")], sorted(threads)
