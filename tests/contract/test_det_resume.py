"""Deterministic modes: the same batches to the same nets on every backend,
and ``state_dict`` / ``load_state_dict`` resume giving exactly the
uninterrupted stream, with the resumed run's accounts balanced (what it
fetched again and threw away counts).

docs/CONTRACT.md: "Order, shuffling and resume".
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

import blobfeed

from .fetchers import Fetch, StatefulFetch
from .util import (
    DET_MODES, SRC, WAIT, Event, assert_identity, drain, drain_all, matrix, next_event, wait_quiet, wire,
)

LENGTHS = (6, 2, 9)
BIG_AT = {(0, 1), (2, 4)}
#: calls that return None: no chunk, and no turn in the deal
NONE_AT = {(2, 1), (0, 3)}


def assert_same(got: Sequence[Event], want: Sequence[Event], what: str) -> None:
    sizes = lambda evs: [len(e[1]) if e[0] == "batch" else f"end{e[1]}" for e in evs]  # noqa: E731
    assert len(got) == len(want), f"{what}: {len(got)} events, expected {len(want)}: {sizes(got)} vs {sizes(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0], f"{what}: event {i} is {g[0]}, expected {w[0]}"
        if g[0] == "end":
            assert g[1] == w[1], f"{what}: event {i}"
        else:
            np.testing.assert_array_equal(g[1], w[1], err_msg=f"{what}: ids of batch {i}")
            np.testing.assert_array_equal(g[2], w[2], err_msg=f"{what}: feat of batch {i}")


def full_run(backend: Any, mode: str, fetch: Any, workers: Sequence[int]) -> list[list[Event]]:
    gc = blobfeed.GlobalCoordinator()
    try:
        nets, _ = wire(gc, backend, mode, fetch, workers=workers)
        gc.start()
        return drain_all(nets)
    finally:
        assert gc.stop(timeout=WAIT)


@matrix(DET_MODES, backends=("processes",), ray=DET_MODES)
def test_same_batches_to_the_same_nets_as_threads(backend: Any, mode: str) -> None:
    workers = (2, 2)
    # feat drawn from each worker's rng too: the same WorkerInfo on every backend
    want = full_run("threads", mode, Fetch(LENGTHS, salt=7, big_at=BIG_AT, none_at=NONE_AT, use_rng=True), workers)
    got = full_run(backend, mode, Fetch(LENGTHS, salt=7, big_at=BIG_AT, none_at=NONE_AT, use_rng=True), workers)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"net {i} against threads")


@matrix(DET_MODES, extra=("stateful", {"replayed": False, "stateful": True}), ray=[("det", "replayed")])
def test_resume_gives_exactly_the_uninterrupted_stream(backend: Any, mode: str, stateful: bool) -> None:
    cls = StatefulFetch if stateful else Fetch
    cut = 3

    def make() -> Fetch:
        return cls(LENGTHS, salt=8, big_at=BIG_AT, none_at=NONE_AT)

    (want,) = full_run("threads", mode, make(), (3,))
    assert len(want) > cut + 2, "the test needs batches after the cut"

    first = blobfeed.GlobalCoordinator()
    try:
        (net,), _ = wire(first, backend, mode, make())
        first.start()
        before = [next_event(net) for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict(SRC)))
    finally:
        assert first.stop(timeout=WAIT)

    second = blobfeed.GlobalCoordinator()
    try:
        (net,), _ = wire(second, backend, mode, make())
        second.load_state_dict(SRC, state)
        second.start()
        after = [e for e in [next_event(net)] if e is not None]
        # mid-run of the resumed run: what it fetched again and threw away
        # (a replayed call, the delivered head of a chunk) counts as dropped
        wait_quiet(second)
        assert_identity(second, "mid-run of the resumed run")
        after += drain(net)
        assert_same([e for e in before if e is not None] + after, want, f"resumed after {cut} batches")
        a = assert_identity(second, "at the end of the resumed run")
        assert a["buffered"] == 0, a
    finally:
        assert second.stop(timeout=WAIT)
