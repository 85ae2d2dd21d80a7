"""Read units pushed to worker processes (``UnitDispenser.attach``): no thread
per worker process waits for units; whichever thread frees one (a
delivery, the stream taking a unit, a death, a stop) writes the next down
the child's pipe.  What a pulled ``take`` guarantees holds for pushed
holders too: ``ahead`` at most undelivered, the window, units read again
first, one end each, and a failed send is reported outside the lock."""

from __future__ import annotations

import struct
import threading
import numpy as np
import pytest

import blobfeed
from blobfeed import Net, RandomAccessSource, init_data_input_workers
from blobfeed.feeders import processes
from blobfeed.feeders.read_units import UNIT_RECORD, ReadUnit, UnitDispenser


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
    d.set_window(window)
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


def test_a_full_holder_is_not_ended_at_the_data_end_and_reads_a_dead_worker_s_unit() -> None:
    # A holds units 0 and 1 (full) when B, delivering, finds the data ended.
    # B's worker is then stopped and its process dies holding unit 3: A, at
    # its next delivery, reads it (a pulling thread of A's would have).
    d = dispenser(n=16, read_size=4)
    a, b = Holder(d), Holder(d)
    d.attach(0, 1, 2, a.send, a.failed)
    d.attach(1, 2, 2, b.send, b.failed)
    assert (a.units(), b.units()) == ([0, 1], [2, 3])
    assert d.delivered(2, 2)
    assert (a.ends, b.ends) == (0, 1)
    d.stop_workers([1])
    d.retire(2)
    assert d.delivered(1, 0)
    assert a.units() == [0, 1, 3] and a.ends == 0
    assert d.delivered(1, 1) and d.delivered(1, 3)
    assert a.ends == 1


def test_a_stopped_worker_s_dead_process_leaves_its_units_to_its_replacement() -> None:
    # B found the data's end; A's worker is then stopped (set_num_workers)
    # and its process dies holding units 0 and 1.  Every other holder has
    # ended: the process that replaces A reads them, then ends.
    d = dispenser(n=16, read_size=4)
    a, b = Holder(d), Holder(d)
    d.attach(0, 1, 2, a.send, a.failed)
    d.attach(1, 2, 2, b.send, b.failed)
    assert d.delivered(2, 2)
    d.stop_workers([0])
    assert (a.ends, b.ends) == (1, 1)
    d.retire(1)
    again = Holder(d)
    d.attach(0, 3, 2, again.send, again.failed)
    # its two units, then its pipe's end (nothing more for a stopped worker)
    assert again.units() == [0, 1] and again.ends == 1
    assert d.delivered(3, 0) and d.delivered(3, 1)
    assert not d._redo and d.owner(0) == 0 and d.owner(1) == 0


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
    assert bad.ends == 1, "ended (its pipe closed) by the dispenser, under its lock"
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
    """A small map-style dataset: sample i is (i * ones(width), i)."""

    def __init__(self, width: int = 4) -> None:
        self.width = width

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple:
        return np.full(self.width, i, np.float32), np.int64(i)


def test_worker_processes_are_fed_with_no_thread_per_process() -> None:
    net = Net(None, name="push")
    gc = blobfeed.GlobalCoordinator()
    init_data_input_workers(net, ["x", "i"], RandomAccessSource(Arrays(), shuffle=True, seed=3), 8,
                            num_worker_threads=3, coordinator=gc, backend="processes", epochs=1)
    gc.start()
    try:
        got = []
        # (from the start: on a fast machine every unit may be read, and the
        # receivers ended, before the first run() returns)
        threads = {t.name for t in threading.enumerate()}
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
    # (the threads were sampled: the net's enqueuer, which receives the
    # workers' messages itself, see tests/test_pulling.py)
    assert "blobfeed-enqueue-train-push" in threads, sorted(threads)


class _PacksUpToUnit0:
    """UNIT_RECORD in the parent, failing from unit 1 on (not a broken pipe)."""

    size = UNIT_RECORD.size

    def pack(self, unit: int, lo: int, hi: int) -> bytes:
        if unit >= 1:
            raise struct.error(f"cannot pack unit {unit}")
        return UNIT_RECORD.pack(unit, lo, hi)


def test_a_unit_that_cannot_be_sent_while_the_stream_takes_one_fails_the_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # window=1: unit 1 is pushed when the stream takes unit 0, in the thread
    # that holds the dealer's and the feed's locks; failing the source there
    # took them again (a deadlock: run() never returned, whatever its timeout)
    monkeypatch.setattr(processes, "UNIT_RECORD", _PacksUpToUnit0())
    net = Net(None, name="fail")
    gc = blobfeed.GlobalCoordinator()
    source = RandomAccessSource(Arrays(), shuffle=False, read_size=8, window=1)
    init_data_input_workers(net, ["x", "i"], source, 8, num_worker_threads=1, coordinator=gc,
                            backend="processes", epochs=1)
    outcome: list[BaseException | str] = []

    def consume() -> None:
        try:
            for _ in range(20):
                net.run(timeout=10)
            outcome.append("no error")
        except BaseException as exc:  # what run() raised: the test's to judge
            outcome.append(exc)

    gc.start()
    t = threading.Thread(target=consume, name="test-consume", daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "run() hung: the source was failed under the locks it takes"
    assert gc.stop(timeout=10)
    assert len(outcome) == 1 and isinstance(outcome[0], blobfeed.FetcherError), outcome
    assert "could not send read unit 1" in str(outcome[0]) and "cannot pack unit 1" in str(outcome[0])


def test_a_death_counts_a_try_against_the_unit_being_read_alone() -> None:
    d = dispenser()
    readers = [Holder(d) for _ in range(4)]
    # three processes die holding units 0 and 1; the first while reading
    # 0, the others while reading 1: unit 0 has one try, unit 1 two
    for k, reading in enumerate((0, 1, 1)):
        d.attach(0, k + 1, 2, readers[k].send, readers[k].failed)
        assert readers[k].units() == [0, 1]
        assert d.retire(k + 1, reading) == []
    assert d._tries == {0: 1, 1: 2}
    # a process that had taken no unit yet (-1) costs no try; one whose
    # reading is not said is counted against the oldest unit it held
    d.attach(0, 10, 2, readers[3].send, readers[3].failed)
    assert d.retire(10, -1) == []
    last = Holder(d)
    d.attach(0, 11, 2, last.send, last.failed)
    assert d.retire(11) == []
    assert d._tries == {0: 2, 1: 2}
    final = Holder(d)
    d.attach(0, 12, 2, final.send, final.failed)
    assert d.retire(12, 1) == [(1, 3)], "the third death reading unit 1 fails the source"


def test_a_worker_process_says_it_reads_no_unit_while_it_waits_for_one() -> None:
    # A process killed while it waits for its next unit (the OOM killer, a
    # user) was reading none: its last unit, read and sent, must not be
    # charged a try, so its header says none while it waits.
    import os

    from blobfeed.feeders.read_units import PipeUnits

    r, w = os.pipe()
    try:
        said: list[int] = []
        units = PipeUnits(r, before_wait=lambda: os.write(w, UNIT_RECORD.pack(5, 10, 12)), reading=said.append)
        os.write(w, UNIT_RECORD.pack(3, 6, 8))
        assert units.take(0) == (3, 6, 8)
        assert units.take(0) == (5, 10, 12)  # the pipe was empty: before_wait, then the wait
        assert said == [3, -1, 5]
    finally:
        os.close(r)
        os.close(w)


# ---------------------------------------------------------------------------------------------
# How far ahead a worker process reads: half its slots, as the units' bytes allow
# ---------------------------------------------------------------------------------------------
def test_a_holder_is_sent_four_units_ahead_until_a_unit_s_bytes_are_known_then_as_they_allow() -> None:
    from blobfeed.feeders.read_units import AHEAD_BYTES, MIN_AHEAD, UNIT_BYTES

    d = UnitDispenser("src", 10_000, 4, 1)
    h = Holder(d)
    d.attach(0, 101, 12, h.send, h.failed)
    assert h.units() == list(range(MIN_AHEAD)), "before the first unit was seen: MIN_AHEAD"
    # a unit of 4 samples of 1 MiB: AHEAD_BYTES hold 16 of them, the holder's own bound 12
    d.sized(2**20)
    assert h.units() == list(range(12))
    d.detach(101)

    big = UnitDispenser("src", 10_000, 4, 1)
    g = Holder(big)
    big.attach(0, 102, 12, g.send, g.failed)
    big.sized(AHEAD_BYTES // 4 // 6)  # six units hold AHEAD_BYTES
    assert g.units() == list(range(6))
    assert big.delivered(102, 0)
    assert g.units() == list(range(7)), "one more per delivery, never more than six held"
    # never fewer than MIN_AHEAD, however big a unit
    huge = UnitDispenser("src", 10_000, 4, 1)
    k = Holder(huge)
    huge.attach(0, 103, 12, k.send, k.failed)
    huge.sized(AHEAD_BYTES)
    assert k.units() == list(range(MIN_AHEAD))
    # nor more for units too small to go to the parent one by one (a
    # process bundles them: a death would lose every one it held)
    tiny = UnitDispenser("src", 10_000, 4, 1)
    t = Holder(tiny)
    tiny.attach(0, 104, 12, t.send, t.failed)
    tiny.sized(UNIT_BYTES // 4 - 1)
    assert t.units() == list(range(MIN_AHEAD))


def test_the_fitted_window_holds_twice_what_the_worker_processes_are_sent_ahead() -> None:
    d = UnitDispenser("src", 10_000, 4, 1)
    d.set_window(workers=2)
    assert d.window == 8, "4 per worker, at least 8"
    a, b = Holder(d), Holder(d)
    d.attach(0, 1, 12, a.send, a.failed)
    d.attach(1, 2, 12, b.send, b.failed)
    assert d.window == 8, "four ahead: the default, 4 per worker"
    d.sized(2**20)  # twelve ahead each, now
    assert d.window == 2 * 12 * 2
    assert len(a.units()) == len(b.units()) == 12
    d.set_window(workers=5)  # set_num_workers: 4 x 5 is less
    assert d.window == 48
    # a window the user set is kept as it is
    fixed = UnitDispenser("src", 10_000, 4, 1)
    fixed.set_window(6)
    c = Holder(fixed)
    fixed.attach(0, 3, 12, c.send, c.failed)
    fixed.sized(2**20)
    fixed.set_window(workers=4)
    assert fixed.window == 6
    assert c.units() == list(range(6))


def test_a_random_access_source_s_worker_processes_get_24_slots_where_memory_allows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from blobfeed.feeders.backends import LaunchPlan

    def plan(units: object, workers: int = 2) -> LaunchPlan:
        return LaunchPlan("src", lambda w, b: None, None, [object()] * workers, lambda: 4, lambda: None, units=units)

    backend = blobfeed.ProcessBackend()
    slot = backend.slot_bytes
    monkeypatch.setattr(processes, "mem_available", lambda: None)
    assert backend.slots_for(plan(None)) == 8, "a fetch_fun source's workers: 8"
    assert backend.slots_for(plan(object())) == 24
    assert blobfeed.ProcessBackend(slots=5).slots_for(plan(object())) == 5, "the user's count"
    # at most half the available memory is reserved, never fewer than 8
    monkeypatch.setattr(processes, "mem_available", lambda: 2 * 2 * 16 * slot)
    assert backend.slots_for(plan(object())) == 16
    monkeypatch.setattr(processes, "mem_available", lambda: 2 * 2 * 3 * slot)
    assert backend.slots_for(plan(object())) == 8
    assert backend.slots_to_lend(1) == 8
    assert repr(backend).startswith("ProcessBackend(slots=None,")


def test_worker_processes_of_a_random_access_source_read_twelve_units_ahead_by_default() -> None:
    net = Net(None, name="ahead")
    gc = blobfeed.GlobalCoordinator()
    # units of 2 samples of 64 KiB: each goes to the parent as it is read
    init_data_input_workers(net, ["x", "i"], RandomAccessSource(Arrays(16384), read_size=2), 2,
                            num_worker_threads=2, coordinator=gc, backend="processes", epochs=1)
    gc.start()
    try:
        got = [net.run(timeout=30)["i"].tolist() for _ in range(3)]
        units = gc._sources["train"].dealer.units
        ahead = sorted(e.ahead for e in units._pushed.values())
        fitted = (units.ahead_limit >= 12, units.window)
        groups = [c._group for c in gc._coordinators if c._group is not None]
        slots = [(g.slots, [wk.area.slots for wk in g.workers]) for g in groups]  # type: ignore[attr-defined]
    finally:
        assert gc.stop()
    assert sum(got, []) == list(range(6))
    assert ahead == [12, 12], "half of 24 slots each"
    assert fitted == (True, 48), "twice twelve ahead for each of two worker processes"
    assert slots == [(24, [24, 24])]


def test_sizing_the_units_never_calls_back_the_dealer_it_runs_under() -> None:
    """``sized`` runs under the dealer's lock (the stream's first unit is
    checked there): a unit to read again it lets out goes without
    ``on_redo_taken`` (which takes that lock: a self-deadlock), and the
    caller is told, to wake the workers itself."""
    d = UnitDispenser("src", 100_000, 1000, 1)
    a, b = Holder(d), Holder(d)
    d.attach(0, 1, 12, a.send, a.failed)
    d.attach(1, 2, 12, b.send, b.failed)
    assert len(a.units()) == len(b.units()) == 4
    called: list[str] = []
    d.on_redo_taken = lambda: called.append("redo")
    d.stop_workers([1])
    assert d.retire(2) == []  # worker 1's process dies: its units are anyone's
    del called[:]
    assert d.sized(100) is True, "a unit to read again went out"  # (units of 100 kB: twelve ahead)
    assert called == [], "on_redo_taken from inside sized()"
    assert len(a.units()) == 12


def test_the_fitted_window_of_units_four_ahead_is_the_default_of_4_per_worker() -> None:
    """Units too big (or too small) to send more than four ahead leave the
    window at 4 per worker: twice four per worker process would hold
    twice the memory for nothing."""
    from blobfeed.feeders.read_units import AHEAD_BYTES

    d = UnitDispenser("src", 10_000, 4, 1)
    d.set_window(workers=4)
    holders = [Holder(d) for _ in range(4)]
    for w, h in enumerate(holders):
        d.attach(w, 10 + w, 12, h.send, h.failed)
    d.sized(AHEAD_BYTES // 4)  # a unit of AHEAD_BYTES: four ahead
    assert d.window == 16
