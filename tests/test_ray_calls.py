"""Calls to a threaded Ray actor, put back in the order they were made
(blobfeed/feeders/ray_calls.py), and the fetch actor that relies on it.

Ray runs one caller's calls to a threaded actor in any order.  A fetch
actor of a random-access source was told "no more units" in one call after
the call with its last unit; when the end ran first, the actor ended its
data without reading that unit, and the stream waited for it for ever with
every fetcher gone ("no batch within 30 s ... 0 fetchers alive" in a CI run
of tests/test_sharded.py's Ray test)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from blobfeed.feeders.ray_calls import MAX_EARLY, GivenUnits, InOrder, Newest
from blobfeed.feeders.read_units import ReadUnit


def test_items_that_come_early_wait_for_the_ones_before_them() -> None:
    got: list[Any] = []
    order = InOrder(got.append, "test")
    order.put(7, 2, "c")
    order.put(7, 1, "b")
    assert got == []
    order.put(7, 0, "a")
    assert got == ["a", "b", "c"]
    order.put(7, 3, "d")
    assert got == ["a", "b", "c", "d"]


def test_each_sender_counts_on_its_own() -> None:
    got: list[Any] = []
    order = InOrder(got.append, "test")
    order.put(1, 1, "1b")
    order.put(2, 0, "2a")
    order.put(1, 0, "1a")
    order.put(2, 1, "2b")
    assert got == ["2a", "1a", "1b", "2b"]


def test_a_call_that_comes_twice_is_an_error_naming_it() -> None:
    order = InOrder(lambda item: None, "read units of source 'train', worker 3")
    order.put(4, 0, "a")
    with pytest.raises(ValueError, match=r"source 'train', worker 3: call 0 of sender 4 came twice"):
        order.put(4, 0, "a")
    order.put(4, 2, "c")
    with pytest.raises(ValueError, match="call 2 of sender 4 came twice"):
        order.put(4, 2, "c")


def test_calls_held_back_are_bounded() -> None:
    order = InOrder(lambda item: None, "test")
    for seq in range(1, MAX_EARLY + 1):
        order.put(0, seq, seq)
    with pytest.raises(ValueError, match=rf"{MAX_EARLY} calls of sender 0 wait for call 0, which never came"):
        order.put(0, MAX_EARLY + 1, "one too many")


def test_items_cross_threads_in_order() -> None:
    got: list[int] = []
    order = InOrder(got.append, "test")
    seqs = list(range(MAX_EARLY))  # at most that many wait: a shuffled share never holds more back
    rng = np.random.default_rng(0)
    # each thread puts its share in a shuffled order; together, every number once
    shares = [list(rng.permutation(seqs[i::4])) for i in range(4)]
    threads = [threading.Thread(target=lambda s=s: [order.put(0, int(q), int(q)) for q in s]) for s in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
        assert not t.is_alive()
    assert got == seqs


def test_an_overtaken_value_changes_nothing() -> None:
    hint: Newest[int] = Newest(1)
    assert hint.set(1, 32)
    assert not hint.set(0, 8)  # made before the call of 32: older
    assert hint.value == 32
    assert hint.set(5, 16)
    assert hint.value == 16


def test_given_units_are_taken_in_the_order_given_the_end_last() -> None:
    stop = threading.Event()
    units = GivenUnits("source 's', worker 0", stop.is_set, 0.01)
    units.give(3, 1, [None])  # the end, run before the call with the last unit
    units.give(3, 0, [(5, 15, 18)])
    units.start(3)
    assert units.take(0) == ReadUnit(5, 15, 18)
    assert units.take(0) is None


def test_a_stop_ends_the_wait_for_a_unit() -> None:
    stop = threading.Event()
    units = GivenUnits("source 's', worker 0", stop.is_set, 0.01)
    units.start(3)
    units.give(3, 1, [(1, 3, 6)])  # call 0 never comes
    stop.set()
    assert units.take(0) is None


def test_a_replaced_holder_s_late_calls_do_not_reach_the_new_stream() -> None:
    """The actor restarted (the driver's holder 3 became 5): a call of
    holder 3's feeder that comes late, its end or a unit it had taken
    before the restart, is not read by the new stream (its units are read
    again as holder 5's; its end would end the stream before them)."""
    stop = threading.Event()
    units = GivenUnits("source 's', worker 0", stop.is_set, 0.01)
    units.give(3, 0, [(0, 0, 3)])
    units.start(3)
    assert units.take(0) == ReadUnit(0, 0, 3)
    units.give(5, 0, [(1, 3, 6)])  # the new holder's first call, before its stream starts
    units.start(5)
    units.give(3, 1, [None])  # the old feeder's end, late
    units.give(3, 2, [(2, 6, 9)])
    units.give(5, 1, [None])
    assert units.take(0) == ReadUnit(1, 3, 6)
    assert units.take(0) is None


class _Rows:
    """Sample ``i`` is ``(i, [i, i])``."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        return (np.int64(i), np.full(2, i, np.float32))


def test_a_fetch_actor_reads_its_last_unit_when_the_end_overtook_it(ray_cluster: Any) -> None:
    # the actor object itself, in this process: its calls made in the order Ray may run them
    import ray

    from blobfeed.feeders.indexed import RandomAccessSource, UnitReader
    from blobfeed.feeders.messages import Exhausted, Result
    from blobfeed.feeders.ray_backend import _FetchActor

    reader = UnitReader("rows", RandomAccessSource(_Rows(), shuffle=False), 12, 0, ("ids", "x"), (0, 0))
    actor = _FetchActor([ray.put((reader, None))], 0, 0, 1, "rows", 0, "raise", False)
    actor.give_units(9, 2, [None])
    actor.give_units(9, 1, [(1, 3, 6)])
    actor.give_units(9, 0, [(0, 0, 3)])
    events = []
    for items, _buf in actor.run((0, 3), 9, 0, 1, None, 1, 0.0):
        events.extend(items)
    results = [e for e in events if type(e) is Result]
    assert [e.state for e in results] == [0, 1]
    assert type(events[-1]) is Exhausted
