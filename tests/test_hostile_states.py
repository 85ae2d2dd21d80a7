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

import pytest

import blobfeed
from blobfeed import Net, init_data_input_workers
from blobfeed.coordinator import checkpoint

from .test_coordinator_state import make_fetch, refused, saved
from .test_indexed import SRC, WAIT, Items, Pipeline, batches_of


def _apart(n: int = 20, nets: int = 2) -> dict[str, Any]:
    """A random-access state saved with net 0 two batches ahead of net 1."""
    with Pipeline(Items(n), nets, 2, bs=2, epochs=1, read_size=2) as p:
        p.start()
        first = [[p.next_event(0) for _ in range(3)], [p.next_event(1)]]
        state = p.state()
    state["_delivered"] = [b for ev in first for b in batches_of([e for e in ev if e is not None])]
    return state


def test_a_resume_saved_again_before_its_stream_moved_keeps_what_the_faster_nets_returned() -> None:
    s1 = _apart()
    delivered = s1.pop("_delivered")
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
    state = _apart()
    state.pop("_delivered")
    k = len(state["nets"])
    state["nets"][0][1] += k * 10**12  # still one of net 0's batches
    with Pipeline(Items(20), 2, 2, bs=2, epochs=1, read_size=2) as p:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"state\['nets'\]\[0\]\[1\]: .*ahead"):
            p.gc.load_state_dict(SRC, state)
        assert time.monotonic() - t0 < 5.0


def test_a_random_access_net_ahead_by_more_than_returned_holds_is_refused() -> None:
    state = _apart()
    state.pop("_delivered")
    state["returned"] = []  # net 0 is two batches ahead, yet returned nothing past the position
    with Pipeline(Items(20), 3, 2, bs=2, epochs=1, read_size=2) as p:
        with pytest.raises(ValueError, match=r"state\['returned'\]: .*ahead"):
            p.gc.load_state_dict(SRC, state)


def test_a_fetch_fun_net_said_far_ahead_is_refused_naming_it() -> None:
    state = saved(nets=2, take=2)
    state["nets"][0][1] += 2 * 10**12
    refused(state, r"state\['nets'\]\[0\]\[1\]: .*ahead", nets=2)


def test_an_endless_one_net_state_whose_position_is_epochs_past_its_net_is_refused() -> None:
    def wire(gc: blobfeed.GlobalCoordinator) -> Net:
        net = Net(name="n0")
        init_data_input_workers(net, ["ids"], make_fetch(), 4, num_worker_threads=2, input_source_name=SRC,
                                coordinator=gc, seed=11, deterministic=True, epochs=None, timeout=WAIT)
        return net

    gc = blobfeed.GlobalCoordinator()
    try:
        net = wire(gc)
        gc.start()
        net.run(timeout=WAIT)
        state = json.loads(json.dumps(gc.state_dict(SRC)))
    finally:
        assert gc.stop(timeout=WAIT)
    state["position"]["epoch"] = 10**9  # one EpochEnd per epoch between told and here, before
    gc = blobfeed.GlobalCoordinator()
    try:
        wire(gc)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"state\['nets'\]\[0\]\[2\]: .*epoch"):
            gc.load_state_dict(SRC, state)
        assert time.monotonic() - t0 < 5.0
    finally:
        assert gc.stop(timeout=WAIT)


def test_skip_and_returned_together_stay_under_the_bound_a_resaved_state_must_meet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an elastic resume writes both lists into "skip": each under the bound
    # alone could make a state blobfeed itself refuses on the next load
    monkeypatch.setattr(checkpoint, "MAX_SKIP_ENTRIES", 3)
    state = _apart(n=40)
    state.pop("_delivered")
    state["skip"] = [[0, 30, 1], [0, 32, 1]]
    state["returned"] = [[0, 34, 1], [0, 36, 1]]
    with Pipeline(Items(40), 2, 2, bs=2, epochs=1, read_size=2) as p:
        with pytest.raises(ValueError, match=r"state\['skip'\] and state\['returned'\]: at most 3 .* got 4"):
            p.gc.load_state_dict(SRC, state)


def test_a_random_access_state_of_an_unknown_version_says_so() -> None:
    state = _apart()
    state.pop("_delivered")
    state["version"] = 99
    with Pipeline(Items(20), 2, 2, bs=2, epochs=1, read_size=2) as p:
        with pytest.raises(ValueError, match=r"version 99.*(newer|unknown)"):
            p.gc.load_state_dict(SRC, state)


def test_a_random_access_state_s_source_name_is_checked_and_another_one_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = _apart()
    state.pop("_delivered")
    state["source"] = 7
    with Pipeline(Items(20), 2, 2, bs=2, epochs=1, read_size=2) as p:
        with pytest.raises(ValueError, match=r"state\['source'\]: expected the source's name \(a str\), got 7"):
            p.gc.load_state_dict(SRC, state)
    state["source"] = "eval"
    with Pipeline(Items(20), 2, 2, bs=2, epochs=1, read_size=2) as p, caplog.at_level("WARNING", "blobfeed"):
        p.gc.load_state_dict(SRC, state)
    assert "loading a state saved by source 'eval'" in caplog.text
