"""States that resume wrongly or cost without bound: a resume saved again
before its stream moved on, a net said to be far ahead of the others, an
endless one-net source whose position is epochs past its net, more left-out
ranges in all than a state may hold.  Each was accepted before (a review
with hostile and edge-case states found them); each either resumes exactly
or is refused naming the field."""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed.coordinator import checkpoint

from .test_coordinator_state import SRC as FETCH_SRC
from .test_coordinator_state import refused, saved, wire_endless
from .test_indexed import SRC, WAIT, Items, Pipeline, batches_of


def _apart(n: int = 20, nets: int = 2) -> tuple[dict[str, Any], list[tuple[int, ...]]]:
    """A random-access state saved with net 0 two batches ahead of net 1,
    and the batches the nets had."""
    with Pipeline(Items(n), nets, 2, bs=2, epochs=1, read_size=2) as p:
        p.start()
        first = [[p.next_event(0) for _ in range(3)], [p.next_event(1)]]
        state = p.state()
    return state, [b for ev in first for b in batches_of([e for e in ev if e is not None])]


def _refused(state: dict[str, Any], match: str, nets: int = 2) -> None:
    """Loading ``state`` into a pipeline of ``nets`` nets over _apart's data is refused, quickly."""
    with Pipeline(Items(20), nets, 2, bs=2, epochs=1, read_size=2) as p:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=match):
            p.gc.load_state_dict(SRC, state)
        assert time.monotonic() - t0 < 5.0


def test_a_resume_saved_again_before_its_stream_moved_keeps_what_the_faster_nets_returned() -> None:
    s1, delivered = _apart()
    assert s1["returned"], "net 0's two batches past the position are in the state"
    with Pipeline(Items(20), 2, 1, bs=2, epochs=1, read_size=2) as p:
        p.gc.load_state_dict(SRC, s1)
        s2 = p.state()  # a checkpoint written at once (before start: the dealer dealt nothing yet)
    assert s2["returned"] == s1["returned"] and s2["position"] == s1["position"]
    # and resumed on another number of nets, every sample once
    with Pipeline(Items(20), 3, 1, bs=2, epochs=1, read_size=2) as p:
        p.gc.load_state_dict(SRC, s2)
        rest = [b for ev in p.lockstep() for b in batches_of(ev)]
    ids = [i for b in delivered + rest for i in b]
    twice = sorted(i for i, c in collections.Counter(ids).items() if c > 1)
    assert not twice and sorted(ids) == list(range(20)), f"delivered twice: {twice}"


def test_a_random_access_net_said_far_ahead_is_refused_naming_it() -> None:
    state, _ = _apart()
    state["nets"][0][1] += len(state["nets"]) * 10**12  # still one of net 0's batches
    _refused(state, r"state\['nets'\]\[0\]\[1\]: .*ahead")


def test_a_random_access_net_ahead_by_more_than_returned_holds_is_refused() -> None:
    state, _ = _apart()
    state["returned"] = []  # net 0 is two batches ahead, yet returned nothing past the position
    _refused(state, r"state\['returned'\]: .*ahead", nets=3)


def test_a_fetch_fun_net_said_far_ahead_is_refused_naming_it() -> None:
    state = saved(nets=2, take=2)
    state["nets"][0][1] += 2 * 10**12
    refused(state, r"state\['nets'\]\[0\]\[1\]: .*ahead", nets=2)


def test_an_endless_one_net_state_whose_position_is_epochs_past_its_net_is_refused() -> None:
    gc = blobfeed.GlobalCoordinator()
    try:
        (net,) = wire_endless(gc, nets=1)
        gc.start()
        net.run(timeout=WAIT)
        state = json.loads(json.dumps(gc.state_dict(FETCH_SRC)))
    finally:
        assert gc.stop(timeout=WAIT)
    state["position"]["epoch"] = 10**9  # one EpochEnd per epoch between told and here, before
    gc = blobfeed.GlobalCoordinator()
    try:
        wire_endless(gc, nets=1)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"state\['nets'\]\[0\]\[2\]: .*epoch"):
            gc.load_state_dict(FETCH_SRC, state)
        assert time.monotonic() - t0 < 5.0
    finally:
        assert gc.stop(timeout=WAIT)


def _wire_epochs(gc: blobfeed.GlobalCoordinator, epochs: int, nets: int = 2) -> list[blobfeed.Net]:
    """``nets`` nets of one source of ``epochs`` epochs (the fetcher of test_coordinator_state)."""
    from .test_coordinator_state import make_fetch

    out = [blobfeed.Net(name=f"n{j}") for j in range(nets)]
    fetch = make_fetch()
    for net in out:
        blobfeed.init_data_input_workers(net, ["ids"], fetch, 4, num_worker_threads=2, input_source_name=FETCH_SRC,
                                         coordinator=gc, seed=11, deterministic=True, epochs=epochs, timeout=WAIT)
    return out


def _saved_epochs(epochs: int) -> dict[str, Any]:
    """The state of two nets of an ``epochs``-epoch source, before either ran."""
    gc = blobfeed.GlobalCoordinator()
    try:
        _wire_epochs(gc, epochs)
        return json.loads(json.dumps(gc.state_dict(FETCH_SRC)))
    finally:
        assert gc.stop(timeout=WAIT)


def _refused_epochs(state: dict[str, Any], epochs: int, pattern: str) -> None:
    gc = blobfeed.GlobalCoordinator()
    try:
        _wire_epochs(gc, epochs)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=pattern):
            gc.load_state_dict(FETCH_SRC, state)
        assert time.monotonic() - t0 < 5.0
    finally:
        assert gc.stop(timeout=WAIT)


def test_several_nets_of_finite_epochs_said_told_of_no_end_far_into_the_run_are_refused() -> None:
    """Two nets, ``epochs`` finite but large: a position millions of epochs
    on, with nets told of no epoch end, had load_state_dict queue an
    EpochEnd per epoch between them for each net (memory in proportion to
    a number the state chose: 700 MB for 3 million).  Refused, as for one
    net and for endless sources."""
    epochs = 10**9
    state = _saved_epochs(epochs)
    state["position"]["epoch"] = 3_000_000
    for entry in state["nets"]:
        entry[2] = 0
    _refused_epochs(state, epochs, r"state\['nets'\]\[0\]\[2\]: .*epoch")


def test_a_net_at_the_position_said_told_of_later_epoch_ends_is_refused() -> None:
    """The net whose next batch is the position's cannot have been told the
    end of an epoch the position has not reached: such a state loaded, and
    that net never raised EndOfEpoch for those epochs (a wrong stream)."""
    state = _saved_epochs(3)
    assert state["position"]["batches"] == state["nets"][0][1] == 0
    state["nets"][0][2] = 2
    _refused_epochs(state, 3, r"state\['nets'\]\[0\]\[2\]: .*at most 0")


def test_skip_and_returned_together_stay_under_the_bound_a_resaved_state_must_meet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an elastic resume writes both lists into "skip": each under the bound
    # alone could make a state blobfeed itself refuses on the next load
    monkeypatch.setattr(checkpoint, "MAX_SKIP_ENTRIES", 3)
    state, _ = _apart(n=40)
    state["skip"] = [[0, 30, 1], [0, 32, 1]]
    state["returned"] = [[0, 34, 1], [0, 36, 1]]
    with Pipeline(Items(40), 2, 2, bs=2, epochs=1, read_size=2) as p:
        with pytest.raises(ValueError, match=r"state\['skip'\] and state\['returned'\]: at most 3 .* got 4"):
            p.gc.load_state_dict(SRC, state)


def test_a_random_access_state_of_an_unknown_version_says_so() -> None:
    state, _ = _apart()
    state["version"] = 99
    _refused(state, r"version 99.*(newer|unknown)")


def test_a_random_access_state_s_source_name_is_checked_and_another_one_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state, _ = _apart()
    state["source"] = 7
    _refused(state, r"state\['source'\]: expected the source's name \(a str\), got 7")
    state["source"] = "eval"
    with Pipeline(Items(20), 2, 2, bs=2, epochs=1, read_size=2) as p, caplog.at_level("WARNING", "blobfeed"):
        p.gc.load_state_dict(SRC, state)
    assert "loading a state saved by source 'eval'" in caplog.text


@pytest.mark.parametrize("field", ["nets", "blobs", "position"])
def test_a_refusal_quotes_a_bounded_part_of_what_the_state_said(field: str) -> None:
    """A refused state's message quotes what it said, cut short: a list of a
    million entries made a message of 13 million characters, and a value
    nested 100 000 deep a RecursionError instead of the ValueError naming
    the field."""
    state = saved(nets=1, take=1)
    state[field] = [["n", 0, 0]] * 1_000_000
    with pytest.raises(ValueError) as info:
        refused_quietly(state)
    assert len(str(info.value)) < 2000, len(str(info.value))
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    state[field] = deep
    with pytest.raises(ValueError, match={"nets": "nets", "blobs": "blob layout", "position": "position"}[field]) as info:
        refused_quietly(state)
    assert len(str(info.value)) < 2000, len(str(info.value))


def refused_quietly(state: dict[str, Any]) -> None:
    """Load ``state`` into a fresh pipeline (one net); what it raises."""
    gc = blobfeed.GlobalCoordinator()
    try:
        from .test_coordinator_state import wire

        wire(gc)
        gc.load_state_dict(FETCH_SRC, state)
    finally:
        assert gc.stop(timeout=WAIT)


@pytest.mark.parametrize("epochs", [10, None])
def test_a_shuffled_net_told_of_many_epoch_ends_resumes(monkeypatch: pytest.MonkeyPatch, epochs: int | None) -> None:
    """A shuffled source's position stays at its start while its nets are
    told of epoch ends: a state saved past MAX_UNTOLD_EPOCHS epochs was
    refused (the bound on how far a net's told epochs lie past the
    position), though such a net costs nothing to load.  Only epochs
    before the position are bounded."""
    monkeypatch.setattr(checkpoint, "MAX_UNTOLD_EPOCHS", 2)

    def fetch_of() -> Any:
        calls: dict[int, int] = {}

        def f(worker_id: int, batch_size: int) -> list[Any]:
            k = calls.setdefault(worker_id, 0)
            if k == 2:
                calls[worker_id] = 0
                raise StopIteration
            calls[worker_id] = k + 1
            return [(worker_id * 1000 + 3 * k + np.arange(3)).astype(np.int64)]

        return f

    def wired(gc: blobfeed.GlobalCoordinator) -> blobfeed.Net:
        net = blobfeed.Net(name="n0")
        blobfeed.init_data_input_workers(net, ["ids"], fetch_of(), 4, num_worker_threads=2, input_source_name="s",
                                         coordinator=gc, seed=11, deterministic=True, shuffle_buffer=8,
                                         epochs=epochs, timeout=WAIT)
        return net

    gc = blobfeed.GlobalCoordinator()
    try:
        net = wired(gc)
        gc.start()
        ends = 0
        while ends < 4:
            try:
                net.run(timeout=WAIT)
            except blobfeed.EndOfEpoch:
                ends += 1
        state = json.loads(json.dumps(gc.state_dict("s")))
    finally:
        assert gc.stop(timeout=WAIT)
    assert state["position"]["epoch"] == 0 and state["nets"][0][2] == 4
    gc = blobfeed.GlobalCoordinator()
    try:
        wired(gc)
        gc.load_state_dict("s", state)
    finally:
        assert gc.stop(timeout=WAIT)
