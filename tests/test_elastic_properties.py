"""Issue 26's guarantee as properties (hypothesis, bounded): for a
random-access source, the global batch sequence is a function of the data,
seed, epoch and batch size only -- the same with 1-6 workers, 1-5 nets, on
threads and on processes -- and a stop at any batch, resumed with any other
worker count, net count and backend, delivers exactly the rest of the
uninterrupted stream (each sample once per epoch over both runs; batch i
of the rest to net i mod k).  The fixed cases and the helpers are
tests/test_indexed.py's."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .test_indexed import (
    SEED, SRC, Items, Pipeline, assert_stream, batches_of, read_attached, reference, reference_tagged,
    tagged_from_start, tagged_to_end,
)

#: (workers, nets, backend): processes start a process per worker, so they are drawn less often
layouts = st.tuples(st.integers(1, 6), st.integers(1, 5), st.sampled_from(["threads", "threads", "processes"]))


# Each example starts a pipeline (processes: one per worker): a few seconds
# on a loaded machine.  The explicit examples are the distinct cases, each
# run every time: one sample, a batch and a read unit larger than the data,
# over three epochs (every batch the epoch's partial last), on one thread;
# the most workers and nets on threads, one-sample units, a partial last
# batch; worker processes, a unit spanning batches, a partial last batch and
# unit.  Four drawn examples on top, where ten were drawn (5.7 s alone).
@pytest.mark.timeout(180)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 40), bs=st.integers(1, 7), read_size=st.integers(1, 9), epochs=st.integers(1, 3),
       layout=layouts)
@example(n=1, bs=7, read_size=9, epochs=3, layout=(1, 1, "threads"))
@example(n=40, bs=3, read_size=1, epochs=2, layout=(6, 5, "threads"))
@example(n=29, bs=4, read_size=5, epochs=2, layout=(3, 2, "processes"))
def test_the_stream_is_the_same_for_any_workers_nets_and_backend(
    n: int, bs: int, read_size: int, epochs: int, layout: tuple[int, int, str],
) -> None:
    workers, nets, backend = layout
    with Pipeline(Items(n), nets, workers, bs=bs, epochs=epochs, read_size=read_size, backend=backend) as p:
        got = p.lockstep()
    assert_stream(got, reference(n, bs, epochs), f"{backend}, {workers} workers, {nets} nets")


# Each example starts two pipelines (processes: a process per worker, about a
# second on a loaded machine).  The explicit examples are the distinct cases,
# each run every time: the same nets after (each net goes on with its own
# batches) from threads to processes, stopped mid-epoch; other nets (the rest
# dealt anew) from processes to threads, stopped in a later epoch; a stop
# before the first batch; a stop past the end (nothing is left).  Four drawn
# examples on top, where ten were drawn (11-13 s; now 6-7 s).
@pytest.mark.timeout(180)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(5, 30), bs=st.integers(1, 6), read_size=st.integers(1, 7), epochs=st.integers(1, 3),
       before=layouts, after=layouts, stop=st.integers(0, 40))
@example(n=17, bs=3, read_size=2, epochs=2, before=(3, 2, "threads"), after=(2, 2, "processes"), stop=4)
@example(n=11, bs=4, read_size=5, epochs=3, before=(2, 1, "processes"), after=(5, 3, "threads"), stop=5)
@example(n=9, bs=2, read_size=1, epochs=1, before=(1, 3, "threads"), after=(4, 2, "threads"), stop=0)
@example(n=6, bs=5, read_size=3, epochs=1, before=(6, 1, "threads"), after=(1, 1, "threads"), stop=40)
def test_a_stop_anywhere_resumed_on_any_layout_gives_the_rest_exactly_once(
    n: int, bs: int, read_size: int, epochs: int, before: tuple[int, int, str], after: tuple[int, int, str],
    stop: int,
) -> None:
    kw: dict[str, Any] = {"bs": bs, "epochs": epochs, "read_size": read_size}
    with Pipeline(Items(n), before[1], before[0], backend=before[2], **kw) as p:
        first = p.lockstep(limit=stop)
        state = p.state()
    with Pipeline(Items(n), after[1], after[0], backend=after[2], **kw) as p:
        p.gc.load_state_dict(SRC, state)
        rest = p.lockstep()
    want = reference_tagged(n, bs, epochs)
    done = [t for events in first for t in tagged_from_start(events)]
    later = [tagged_to_end(events, epochs - 1) for events in rest]
    # each sample exactly once per epoch over both runs
    assert sorted(done + [t for net in later for t in net]) == sorted(want), state
    k = after[1]
    if k == before[1]:
        # the same nets: each goes on with its own batches of the uninterrupted stream
        whole = [batches_of(events) for events in uninterrupted(n, bs, epochs, k)]
        for j in range(k):
            assert batches_of(first[j]) + batches_of(rest[j]) == whole[j], (state, before, after)
    else:
        # the rest of the stream, in its order, dealt anew: batch i to net i mod k
        stream = [t for t in want if t not in done]
        for j in range(k):
            assert later[j] == stream[j::k], (state, before, after)


def uninterrupted(n: int, bs: int, epochs: int, nets: int, seed: int = SEED) -> list[list[Any]]:
    """Each net's events of the whole stream, from the reference (batch i to net i mod k)."""
    events = reference(n, bs, epochs, seed=seed)
    out: list[list[Any]] = [[] for _ in range(nets)]
    i = 0
    for e in events:
        if e[0] == "end":
            for net in out:
                net.append(e)
        else:
            out[i % nets].append(e)
            i += 1
    return out


@pytest.mark.timeout(180)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(n=st.integers(4, 24), bs=st.integers(1, 5), epochs=st.integers(1, 2), before=st.integers(1, 4),
       after=st.integers(1, 4), stop=st.integers(0, 12))
def test_a_served_source_stopped_anywhere_resumes_on_any_num_consumers_exactly(
    tmp_path_factory: pytest.TempPathFactory, n: int, bs: int, epochs: int, before: int, after: int, stop: int,
) -> None:
    """Through the feeding service: its state file, then ``--resume`` with
    another ``num_consumers``: the batches the first consumers got and what
    the new ones get are each sample once per epoch, and the new ones get the
    rest of the stream dealt anew."""
    import json

    from blobfeed import RandomAccessSource
    from blobfeed.service import FeedServer

    from .test_indexed import BLOBS

    state_file = tmp_path_factory.mktemp("served") / "state.json"

    def run(consumers: int, resume: bool, limit: int | None) -> list[list[Any]]:
        server = FeedServer(None, state_file=str(state_file), resume=resume)
        server.serve_source(SRC, BLOBS, RandomAccessSource(Items(n), shuffle=True, seed=3), bs, 2,
                            num_consumers=consumers, epochs=epochs)
        with server.start():
            return read_attached(server.address, consumers, bs, limit)

    first = run(before, False, stop)
    assert json.loads(state_file.read_text())["sources"][SRC]["inner"]["seed"] == 3
    rest = run(after, True, None)
    want = tagged_from_start(reference(n, bs, epochs, seed=3))
    done = [t for events in first for t in tagged_from_start(events)]
    later = [tagged_to_end(events, epochs - 1) for events in rest]
    assert sorted(done + [t for net in later for t in net]) == sorted(want)
    if after == before:
        whole = [batches_of(events) for events in uninterrupted(n, bs, epochs, after, seed=3)]
        for j in range(after):
            assert batches_of(first[j]) + batches_of(rest[j]) == whole[j], (before, after, stop)
    else:
        stream = [t for t in want if t not in done]
        for j in range(after):
            assert later[j] == stream[j::after], (before, after, stop)
