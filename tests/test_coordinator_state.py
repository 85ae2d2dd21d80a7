"""``load_state_dict`` takes a state as user input (a file on disk).

Every field is checked before anything is loaded: a wrong type, a value out
of range, a list of the wrong length or a missing key is a ``ValueError``
naming the field, never a silently wrong stream, an ``IndexError`` out of
``run()`` or a dead worker.  And a state only loads into a pipeline that
makes the same stream: ``shuffle_buffer`` and ``drop_last`` are part of the
layout.
"""

from __future__ import annotations

import copy
import json
import re
import time
from typing import Any, Callable

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfInput, Net, init_data_input_workers

SRC = "ckpt"
WAIT = 5.0


def make_fetch() -> Callable[[int, int], list[np.ndarray]]:
    """A fresh fetcher (its call counts are its own)."""

    def f(worker_id: int, batch_size: int) -> list[np.ndarray]:
        k = calls.setdefault(worker_id, 0)
        if k == 6:
            raise StopIteration
        calls[worker_id] = k + 1
        return [(worker_id * 1000 + 3 * k + np.arange(3)).astype(np.int64)]

    calls: dict[int, int] = {}
    return f


def wire(gc: blobfeed.GlobalCoordinator, *, nets: int = 1, workers: int = 2, bs: int = 4,
         shuffle_buffer: int = 0, drop_last: bool = False) -> list[Net]:
    out = []
    for j in range(nets):
        net = Net(name=f"n{j}")
        init_data_input_workers(
            net, ["ids"], make_fetch(), bs, num_worker_threads=workers, input_source_name=SRC,
            coordinator=gc, seed=11, deterministic=True, shuffle_buffer=shuffle_buffer,
            drop_last=drop_last, timeout=WAIT,
        )
        out.append(net)
    return out


def saved(*, take: int = 2, **kw: Any) -> dict[str, Any]:
    """A state saved after ``take`` batches of each net, through JSON."""
    gc = blobfeed.GlobalCoordinator()
    try:
        nets = wire(gc, **kw)
        gc.start()
        for _ in range(take):
            for net in nets:
                net.run(timeout=WAIT)
        return json.loads(json.dumps(gc.state_dict(SRC)))
    finally:
        assert gc.stop(timeout=WAIT)


def refused(state: Any, pattern: str, **kw: Any) -> str:
    """Load ``state`` into a fresh pipeline wired with ``kw``: a ValueError
    matching ``pattern``; the pipeline then still runs from its start."""
    gc = blobfeed.GlobalCoordinator()
    try:
        nets = wire(gc, **kw)
        with pytest.raises(ValueError, match=pattern) as info:
            gc.load_state_dict(SRC, state)
        assert SRC in str(info.value)
        gc.start()
        # nothing of the refused state was loaded: the stream starts at its start
        first = nets[0].run(timeout=WAIT)["ids"]
        if not kw.get("shuffle_buffer"):
            assert first[0] == 0, f"after a refused load the stream starts at {first[0]}"
        return str(info.value)
    finally:
        assert gc.stop(timeout=WAIT)


def loads(state: Any, **kw: Any) -> list[list[int]]:
    """Load ``state`` and return what each net gets to its end."""
    gc = blobfeed.GlobalCoordinator()
    try:
        nets = wire(gc, **kw)
        if state is not None:
            gc.load_state_dict(SRC, state)
        gc.start()
        # in dealing order (net 0, net 1, ...): one thread never waits on itself
        got: list[list[int]] = [[] for _ in nets]
        live = list(range(len(nets)))
        while live:
            for j in list(live):
                try:
                    got[j] += nets[j].run(timeout=WAIT)["ids"].tolist()
                except EndOfInput:
                    live.remove(j)
        return got
    finally:
        assert gc.stop(timeout=WAIT)


def field(path: str) -> str:
    """The regex of a message naming ``path`` (``"position.rr"`` -> state['position']['rr'])."""
    parts = "".join(f"[{p}]" if p.isdigit() else f"['{p}']" for p in path.split("."))
    return re.escape(f"state{parts}")


# -- defect 5: every field of the position is checked ------------------------------------------
POSITION_BAD = [
    ("rr", 5), ("rr", 2), ("rr", -1), ("rr", True), ("rr", "0"), ("rr", 1.0), ("rr", None),
    ("offset", -1), ("offset", True), ("offset", "3"), ("offset", 2.5),
    ("calls", [-1, 0]), ("calls", [0]), ("calls", [0, 0, 0]), ("calls", "00"), ("calls", [True, 0]),
    ("calls", [0, 1.5]), ("calls", {"0": 1}),
    ("batches", -1), ("batches", 3), ("batches", 100), ("batches", True), ("batches", "2"),
    ("epoch", -1), ("epoch", True), ("epoch", "0"), ("epoch", 1),
    ("states", [None]), ("states", "xy"), ("states", None),
]


@pytest.mark.parametrize("key, value", POSITION_BAD, ids=[f"{k}={v!r}" for k, v in POSITION_BAD])
def test_a_bad_position_field_is_refused_by_name(key: str, value: Any) -> None:
    state = saved()
    state["position"][key] = value
    message = refused(state, field(f"position.{key}"))
    assert "expected" in message or "this pipeline runs epochs" in message, message


@pytest.mark.parametrize("key", ["batches", "rr", "offset", "calls", "states"])
def test_a_missing_position_key_is_a_value_error_naming_it(key: str) -> None:
    state = saved()
    del state["position"][key]
    refused(state, field(f"position.{key}") + ".*missing")


@pytest.mark.parametrize("position", [[], "0", None, 3])
def test_a_position_that_is_not_a_dict_is_refused(position: Any) -> None:
    state = saved()
    state["position"] = position
    refused(state, field("position"))


@pytest.mark.parametrize("key", ["version", "num_workers", "batch_size", "blobs", "axes", "position", "nets"])
def test_a_missing_top_level_key_is_a_value_error_naming_it(key: str) -> None:
    state = saved()
    del state[key]
    refused(state, re.escape(f"state['{key}']") + ".*missing")


NETS_BAD: list[tuple[str, Callable[[list[Any]], Any]]] = [
    ("next batch negative", lambda nets: nets[0].__setitem__(1, -2)),
    ("next batch of the wrong net", lambda nets: nets[0].__setitem__(1, nets[0][1] + 1)),
    ("next batch a bool", lambda nets: nets[0].__setitem__(1, True)),
    ("next batch a float", lambda nets: nets[1].__setitem__(1, float(nets[1][1]))),
    ("epoch negative", lambda nets: nets[1].__setitem__(2, -1)),
    ("epoch past the last", lambda nets: nets[1].__setitem__(2, 1)),
    ("epoch a bool", lambda nets: nets[1].__setitem__(2, False)),
    ("name not a str", lambda nets: nets[0].__setitem__(0, 3)),
    ("entry too long", lambda nets: nets[0].append(0)),
    ("entry too short", lambda nets: nets[0].pop()),
    ("entry not a list", lambda nets: nets.__setitem__(1, {"name": "n1"})),
]


@pytest.mark.parametrize("what, spoil", NETS_BAD, ids=[w for w, _ in NETS_BAD])
def test_a_bad_net_entry_is_refused_by_name(what: str, spoil: Callable[[list[Any]], Any]) -> None:
    state = saved(nets=2)
    spoil(state["nets"])
    refused(state, re.escape("state['nets'][") + "[01]" + re.escape("]"), nets=2)


def test_the_position_must_be_where_the_nets_are() -> None:
    """The position is the one after the slowest net's last batch: one
    further on would leave a gap in that net's batches."""
    state = saved(nets=2)
    low = min(n[1] for n in state["nets"])
    assert state["position"]["batches"] == low
    state["position"]["batches"] = low + 1
    refused(state, field("position.batches"), nets=2)


@pytest.mark.parametrize("key, value", [("version", True), ("num_workers", 2.0), ("batch_size", "4"),
                                        ("seed", [11.0, 11.0])])
def test_layout_values_compare_by_type_too(key: str, value: Any) -> None:
    """``True == 1`` and ``2.0 == 2`` in Python: a state's ints must be ints."""
    state = saved(nets=2)
    state[key] = value
    refused(state, re.escape(f"'{key}'") + "|" + key.replace("_", " ") + "|worker count|batch size", nets=2)


def test_a_bool_worker_count_is_not_one_worker() -> None:
    state = saved(workers=1)
    assert state["num_workers"] == 1
    state["num_workers"] = True
    refused(state, "worker count|num_workers", workers=1)


def test_a_valid_state_still_resumes_exactly() -> None:
    """The checks refuse nothing a real state_dict() produces: two nets,
    saved after two batches each, resume to exactly the rest of the stream."""
    (whole,) = loads(None, nets=1, workers=4)  # 4 workers x 6 calls x 3 samples
    assert len(whole) == 72
    state = saved(nets=2, take=2)  # 2 calls of 2 workers: the same 4 worker ids
    rest = loads(copy.deepcopy(state), nets=2)
    # batches 0-3 were had; net 0 gets 4, 6, ..., net 1 gets 5, 7, ...
    batches = [whole[i:i + 4] for i in range(0, 72, 4)]
    assert rest[0] == sum(batches[4::2], []), rest[0]
    assert rest[1] == sum(batches[5::2], []), rest[1]


# -- defect 6: the shuffle buffer and drop_last are part of the layout --------------------------
def test_a_state_of_another_shuffle_buffer_is_refused() -> None:
    state = saved(shuffle_buffer=8)
    assert state["shuffle_buffer"] == 8
    msg = refused(state, "shuffle_buffer")
    assert "8" in msg and "0" in msg
    refused(state, "shuffle_buffer", shuffle_buffer=16)
    assert sum(len(r) for r in loads(state, shuffle_buffer=8)) == 36 - 2 * 4


def test_a_state_without_a_shuffle_buffer_is_refused_by_a_shuffled_pipeline() -> None:
    refused(saved(), "shuffle_buffer", shuffle_buffer=8)


def test_a_state_of_another_drop_last_is_refused() -> None:
    state = saved(drop_last=True)
    assert state["drop_last"] == [True]
    refused(state, "drop_last")
    refused(saved(), "drop_last", drop_last=True)


def test_a_state_from_before_the_shuffle_key_loads_only_where_it_implied_no_shuffle() -> None:
    """States saved before shuffle_buffer/drop_last were recorded: they
    imply shuffle_buffer=0, drop_last=False; another pipeline is refused."""
    state = saved()
    del state["shuffle_buffer"]
    del state["drop_last"]
    assert sum(len(r) for r in loads(copy.deepcopy(state))) == 36 - 2 * 4
    msg = refused(copy.deepcopy(state), "shuffle_buffer", shuffle_buffer=8)
    assert "predates" in msg
    msg = refused(copy.deepcopy(state), "drop_last", drop_last=True)
    assert "predates" in msg


# -- defect 8 (the coordinator's part): state_dict takes no lock of the coordinator's ------------
def test_state_dict_answers_while_another_thread_holds_the_coordinators_lock() -> None:
    """A SIGTERM handler saving a checkpoint must not wait on a lock some
    other thread of the pipeline holds (or the interrupted code itself)."""
    import threading

    gc = blobfeed.GlobalCoordinator()
    try:
        (net,) = wire(gc)
        gc.start()
        net.run(timeout=WAIT)
        want = gc.state_dict(SRC)
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with gc._lock:
                held.set()
                release.wait(WAIT)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert held.wait(WAIT)
            got: list[dict[str, Any]] = []
            saver = threading.Thread(target=lambda: got.append(gc.state_dict(SRC)), daemon=True)
            saver.start()
            saver.join(WAIT / 2)
            assert got == [want], "state_dict() waited for the coordinator's lock"
        finally:
            release.set()
            holder.join(WAIT)
    finally:
        assert gc.stop(timeout=WAIT)


def test_a_float_version_is_refused() -> None:
    """``2.0 in (1, 2)`` is True in Python: a version must be an int."""
    state = saved(nets=2)
    state["version"] = float(state["version"])
    refused(state, "version", nets=2)


def test_a_net_told_of_an_epoch_end_the_position_has_not_reached_is_refused() -> None:
    """A net's epoch count says which epoch ends it was told of: never more
    than the position has passed (here: in epoch 0 of 3, a net claims two)."""

    def build() -> tuple[blobfeed.GlobalCoordinator, Net]:
        gc = blobfeed.GlobalCoordinator()
        net = Net(name="n0")
        init_data_input_workers(net, ["ids"], make_fetch(), 4, num_worker_threads=2, input_source_name=SRC,
                                coordinator=gc, seed=11, deterministic=True, epochs=3, timeout=WAIT)
        return gc, net

    gc, net = build()
    try:
        gc.start()
        net.run(timeout=WAIT)
        state = json.loads(json.dumps(gc.state_dict(SRC)))
    finally:
        assert gc.stop(timeout=WAIT)
    assert state["position"]["epoch"] == 0
    state["nets"][0][2] = 2
    gc, net = build()
    try:
        with pytest.raises(ValueError, match=field("nets.0.2")):
            gc.load_state_dict(SRC, state)
    finally:
        assert gc.stop(timeout=WAIT)


def test_a_shuffled_source_saved_after_an_epoch_end_resumes_exactly() -> None:
    """A shuffled source's position stays at its start (it replays and drops
    what each net had), so a net may have been told of more epoch ends than
    the position has passed: the check refused such a state ("expected an
    int in [0, 1), got 1") that the same version had just written."""
    class Epochs:
        def __init__(self) -> None:
            self.calls: dict[int, int] = {}

        def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
            c = self.calls.get(worker_id, 0)
            if c >= 6:
                self.calls[worker_id] = 0  # the next epoch starts over
                raise StopIteration
            self.calls[worker_id] = c + 1
            return [np.arange(4, dtype=np.int64) + worker_id * 1000 + c * 4]

    def pipeline() -> tuple[blobfeed.GlobalCoordinator, Net]:
        gc = blobfeed.GlobalCoordinator()
        net = Net(None, name="n")
        init_data_input_workers(net, ["x"], Epochs(), 4, 2, coordinator=gc, deterministic=True,
                                shuffle_buffer=8, epochs=2, seed=1, timeout=WAIT)
        return gc, net

    def rest(net: Net) -> list[list[int]]:
        out = []
        while True:
            try:
                out.append(net.run()["x"].tolist())
            except blobfeed.EndOfEpoch:
                continue
            except blobfeed.EndOfInput:
                return out

    gc, net = pipeline()
    gc.start()
    first = 0
    try:
        while True:
            net.run()
            first += 1
    except blobfeed.EndOfEpoch:
        state = gc.state_dict("train")
    expected = rest(net)
    gc.stop()
    assert first == 12 and len(expected) == 12
    gc2, net2 = pipeline()
    gc2.load_state_dict("train", state)
    gc2.start()
    try:
        assert rest(net2) == expected
    finally:
        gc2.stop()


class _Resetting:
    """A stateful fetcher that starts over at each StopIteration (as a
    dataset iterator does): its state after the StopIteration is the next
    epoch's start."""

    def __init__(self) -> None:
        self.c = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if self.c >= 5:
            self.c = 0
            raise StopIteration
        self.c += 1
        return [np.arange(4, dtype=np.int64) + worker_id * 1000 + self.c * 10]

    def state_dict(self) -> dict[str, int]:
        return {"c": self.c}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.c = state["c"]


class _ResettingStateless:
    """The same data, counted per worker by the fetcher itself, no state_dict:
    a resume replays the calls."""

    def __init__(self) -> None:
        self.c: dict[int, int] = {}

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        c = self.c.get(worker_id, 0)
        if c >= 5:
            self.c[worker_id] = 0
            raise StopIteration
        self.c[worker_id] = c + 1
        return [np.arange(4, dtype=np.int64) + worker_id * 1000 + (c + 1) * 10]


def _epochs_pipeline(nets: int, fetch: Any) -> tuple[blobfeed.GlobalCoordinator, list[Net]]:
    gc = blobfeed.GlobalCoordinator()
    out = []
    for j in range(nets):
        net = Net(None, name=f"n{j}")
        init_data_input_workers(net, ["x"], fetch, 4, 2, coordinator=gc, deterministic=True, epochs=2,
                                seed=3, timeout=WAIT)
        out.append(net)
    return gc, out


def _in_turn(nets: list[Net]) -> list[list[Any]]:
    """What each net gets to its end, taken in dealing order (net 0, net 1, ...)."""
    got: list[list[Any]] = [[] for _ in nets]
    live = list(range(len(nets)))
    while live:
        for j in list(live):
            try:
                got[j].append(nets[j].run()["x"].tolist())
            except blobfeed.EndOfEpoch as end:
                got[j].append(("end", end.epoch))
            except EndOfInput:
                live.remove(j)
    return got


def _to_the_end(net: Net) -> list[Any]:
    out: list[Any] = []
    while True:
        try:
            out.append(net.run()["x"].tolist())
        except blobfeed.EndOfEpoch as end:
            out.append(("end", end.epoch))
        except EndOfInput:
            return out


@pytest.mark.parametrize("fetch", [_ResettingStateless, _Resetting], ids=["stateless", "stateful"])
def test_a_state_saved_with_one_net_an_epoch_ahead_resumes_exactly(fetch: Callable[[], Any]) -> None:
    """Net 0 told of epoch 0's end while net 1 was still in it: the check
    bounded the ends a net was told of by the position's epoch (the slowest
    net's) and refused the state the same version had written (seen under
    load in the service's SIGTERM + --resume test)."""
    gc, (a, b) = _epochs_pipeline(2, fetch())
    gc.start()
    try:
        ahead = taken_b = 0
        while True:  # net 1 two batches behind, until net 0 is told of the end
            try:
                a.run()
            except blobfeed.EndOfEpoch:
                break
            ahead += 1
            if ahead - taken_b > 2:
                b.run()
                taken_b += 1
        state = json.loads(json.dumps(gc.state_dict("train")))
        expected = _in_turn([b, a])[::-1]  # net 1 first: it is behind
    finally:
        gc.stop(timeout=WAIT)
    assert ahead > 0 and state["nets"][0][2] == 1 and state["nets"][1][2] == 0
    gc, nets = _epochs_pipeline(2, fetch())
    gc.load_state_dict("train", state)
    gc.start()
    try:
        got = _in_turn(nets[::-1])[::-1]
    finally:
        gc.stop(timeout=WAIT)
    assert got == expected


def _to_the_end_of_epoch(net: Net) -> int:
    n = 0
    while True:
        try:
            net.run()
            n += 1
        except blobfeed.EndOfEpoch:
            return n


def test_a_stateful_fetcher_saved_at_an_epoch_boundary_resumes_into_the_next_epoch() -> None:
    """The state recorded for a worker at the next epoch's start was its
    fetcher's state before the StopIteration (its last call of the epoch),
    so the resumed fetcher raised StopIteration at once and the epoch came
    out empty."""
    gc, (net,) = _epochs_pipeline(1, _Resetting())
    gc.start()
    try:
        first = _to_the_end_of_epoch(net)
        state = json.loads(json.dumps(gc.state_dict("train")))
        expected = _to_the_end(net)
    finally:
        gc.stop(timeout=WAIT)
    assert first == 10 and len([x for x in expected if not isinstance(x, tuple)]) == 10
    gc, (net,) = _epochs_pipeline(1, _Resetting())
    gc.load_state_dict("train", state)
    gc.start()
    try:
        assert _to_the_end(net) == expected
    finally:
        gc.stop(timeout=WAIT)


def wire_endless(gc: blobfeed.GlobalCoordinator, nets: int = 2) -> list[Net]:
    """``nets`` nets of one endless source (``epochs=None``)."""
    out = [Net(name=f"n{j}") for j in range(nets)]
    for net in out:
        init_data_input_workers(net, ["ids"], make_fetch(), 4, num_worker_threads=2, input_source_name=SRC,
                                coordinator=gc, seed=11, deterministic=True, epochs=None, timeout=WAIT)
    return out


def test_an_endless_state_far_from_its_nets_told_epochs_is_refused() -> None:
    """An untrusted state of an endless source (epochs=None) whose position
    is epochs away from the epoch ends its nets were told of: each epoch
    between them is a piece a net is handed on load, so it could make the
    load allocate without bound; it is refused naming the field."""
    gc = blobfeed.GlobalCoordinator()
    try:
        nets = wire_endless(gc)
        gc.start()
        for net in nets:
            net.run(timeout=WAIT)
        state = json.loads(json.dumps(gc.state_dict(SRC)))
    finally:
        assert gc.stop(timeout=WAIT)
    state["position"]["epoch"] = 200_000
    gc = blobfeed.GlobalCoordinator()
    try:
        wire_endless(gc)
        with pytest.raises(ValueError, match=r"state\['nets'\]\[0\]\[2\]: .*epoch"):
            gc.load_state_dict(SRC, state)
    finally:
        assert gc.stop(timeout=WAIT)


def test_a_state_whose_worker_made_more_calls_than_its_data_holds_fails_the_resume() -> None:
    """A plain fetcher is replayed on resume: the calls the state says a
    worker made are made again.  One that ends (StopIteration) before them
    was taken for the data's end: the rest of that worker's data was lost
    without an error.  Now the resumed run fails, naming the worker and
    the counts."""
    state = saved(take=1)
    state["position"]["calls"][0] = 99  # the fetcher ends after 6
    _resumed_run_fails(state, r"worker 0: resuming the worker at the saved position failed.*99 calls.*ended after 6")


def _resumed_run_fails(state: dict[str, Any], pattern: str, **kw: Any) -> None:
    """Load ``state`` into a fresh pipeline wired with ``kw`` and run it:
    a FetcherError matching ``pattern`` within a hundred batches, and the
    source failed with it (not only the net that met it)."""
    gc = blobfeed.GlobalCoordinator()
    try:
        (net,) = wire(gc, **kw)
        gc.load_state_dict(SRC, state)
        gc.start()
        with pytest.raises(blobfeed.FetcherError, match=pattern):
            for _ in range(100):
                net.run(timeout=WAIT)
        assert re.search(pattern, str(gc._known.sources[SRC].error)), gc._known.sources[SRC].error
    finally:
        assert gc.stop(timeout=WAIT)


def test_a_resume_replaying_a_huge_number_of_calls_stops_when_asked() -> None:
    """A state that says a worker made 10**12 calls of an endless plain
    fetcher: the replay makes them again, and stop() could not end it (the
    threads spun on, and stop() returned False)."""

    def endless(worker_id: int, batch_size: int) -> list[np.ndarray]:
        return [np.arange(3, dtype=np.int64)]

    def wired(gc: blobfeed.GlobalCoordinator) -> Net:
        net = Net(name="n0")
        init_data_input_workers(net, ["ids"], endless, 4, num_worker_threads=2, input_source_name=SRC,
                                coordinator=gc, seed=11, deterministic=True, epochs=None, timeout=WAIT)
        return net

    gc = blobfeed.GlobalCoordinator()
    try:
        net = wired(gc)
        gc.start()
        net.run(timeout=WAIT)
        state = json.loads(json.dumps(gc.state_dict(SRC)))
    finally:
        assert gc.stop(timeout=WAIT)
    state["position"]["calls"] = [10**12, 10**12]
    gc = blobfeed.GlobalCoordinator()
    net = wired(gc)
    gc.load_state_dict(SRC, state)
    gc.start()
    with pytest.raises(blobfeed.DequeueTimeout):
        net.run(timeout=0.5)
    t0 = time.monotonic()
    assert gc.stop(timeout=WAIT)
    assert time.monotonic() - t0 < 3.0


def test_a_net_said_past_the_end_of_the_data_fails_the_resume() -> None:
    """A shuffled source resumes from its start and drops the batches each
    net had.  A state that says its net had more batches than the data
    holds had the resumed run drop everything and end, with no batch and
    no error.  Now the end is an error naming the net and both counts."""
    state = saved(take=1, shuffle_buffer=8)
    state["nets"][0][1] = 10**6
    _resumed_run_fails(state, r"net 0: .*1000000.*ended after \d+ batches", shuffle_buffer=8)
