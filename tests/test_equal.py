"""Equal shares for nets in one process (``init_data_input_workers(..., equal=True)``).

Several nets on one source (data parallel in one process) get the same
number of batches per epoch: the batches go out in rounds, one per net, and
an epoch's last incomplete round is dropped, counted
(``blobfeed_dropped_samples_total{reason="equal"}``) and logged.  Every test
builds the stream it expects from the fetcher's pure data function: per
epoch, the workers' chunks in strict round robin, cut into batches, the
epoch's last batch smaller; with ``equal``, the first ``k * (m // k)`` of an
epoch's ``m`` batches, batch *i* of the epoch to net *i mod k*.  Every wait
is bounded.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from typing import Any, Sequence

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfEpoch, EndOfInput, Net, get_worker_info, init_data_input_workers
from blobfeed.feeders import Chunk, DealingOptions, LaneDealer, make_dealer

from .helpers import sample

SRC = "train"
BLOBS = ["ids", "feat"]
WAIT = 10.0
SEED = 5
#: chunks per worker in epoch 0 (epoch e has e more); sizes 1..9: epochs of
#: 13 to 17 batches of 5, so rounds of 2 and 3 nets are incomplete at their end
LENGTHS = {0: 3, 1: 2, 2: 4}

#: an event of a net: ("batch", ids) or ("end", epoch)
Event = tuple[Any, ...]


def size(e: int, wid: int, c: int) -> int:
    return random.Random(f"equal:{e}:{wid}:{c}").randint(1, 9)


def n_chunks(e: int, wid: int) -> int:
    return LENGTHS[wid] + e


def ids_of(e: int, wid: int, c: int, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) + e * 10_000_000 + wid * 100_000 + c * 1000


class Fetch:
    """A plain fetcher of the epoch's data (replayed on resume); worker
    ``wid`` returns ``n_chunks(e, wid)`` chunks in epoch ``e``."""

    def __init__(self) -> None:
        self.calls: dict[tuple[int, int], int] = {}

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        info = get_worker_info()
        assert info is not None
        e = info.epoch
        c = self.calls.get((wid, e), 0)
        if c >= n_chunks(e, wid):
            raise StopIteration
        self.calls[(wid, e)] = c + 1
        ids = ids_of(e, wid, c, size(e, wid, c))
        return [ids, ids.astype(np.float32) / 2]


def epoch_batches(e: int, bs: int, drop_last: bool = False) -> list[np.ndarray]:
    """Epoch ``e``'s batches (its workers' chunks in strict round robin, cut)."""
    parts = []
    for c in range(max(n_chunks(e, w) for w in LENGTHS)):
        for w in sorted(LENGTHS):
            if c < n_chunks(e, w):
                parts.append(ids_of(e, w, c, size(e, w, c)))
    ids = np.concatenate(parts)
    cut = [ids[lo:lo + bs] for lo in range(0, len(ids), bs)]
    if drop_last and len(cut[-1]) < bs:
        cut.pop()
    return cut


def expected(k: int, epochs: int, bs: int, drop_last: bool = False) -> tuple[list[list[Event]], int]:
    """Per net, the events it must see with ``equal=True``; and the samples
    the incomplete rounds drop."""
    per_net: list[list[Event]] = [[] for _ in range(k)]
    dropped = 0
    for e in range(epochs):
        batches = epoch_batches(e, bs, drop_last)
        whole = len(batches) - len(batches) % k
        for i, b in enumerate(batches[:whole]):
            per_net[i % k].append(("batch", b))
        dropped += sum(len(b) for b in batches[whole:])
        if e < epochs - 1:
            for events in per_net:
                events.append(("end", e))
    return per_net, dropped


def total_samples(epochs: int) -> int:
    return sum(sum(len(b) for b in epoch_batches(e, 5)) for e in range(epochs))


def next_event(net: Net) -> Event | None:
    """The net's next event; None at EndOfInput."""
    try:
        out = net.run(timeout=WAIT)
    except EndOfEpoch as end:
        return ("end", end.epoch)
    except EndOfInput:
        return None
    return ("batch", np.array(out["ids"]))


def assert_events(got: Sequence[Event], want: Sequence[Event], what: str) -> None:
    def summary(events: Sequence[Event]) -> list[Any]:
        return [e[1] if e[0] == "end" else len(e[1]) for e in events]

    assert [e[0] for e in got] == [e[0] for e in want], f"{what}: {summary(got)}, expected {summary(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g[0] == "end":
            assert g[1] == w[1], f"{what}: event {i} ends epoch {g[1]}, expected {w[1]}"
        else:
            np.testing.assert_array_equal(g[1], w[1], err_msg=f"{what}: ids of event {i}")


def per_epoch_counts(events: Sequence[Event]) -> list[int]:
    counts, n = [], 0
    for ev in events:
        if ev[0] == "end":
            counts.append(n)
            n = 0
        else:
            n += 1
    return counts + [n]


class Pipeline:
    """A fresh coordinator with one source feeding one net per entry of
    ``workers`` (that call's worker count)."""

    def __init__(self, workers: Sequence[int], *, epochs: int | None = 2, bs: int = 5,
                 deterministic: bool = True, **kw: Any) -> None:
        self.gc = blobfeed.GlobalCoordinator()
        self.nets = [Net(name=f"net{i}") for i in range(len(workers))]
        fetch = Fetch()
        for net, n in zip(self.nets, workers):
            init_data_input_workers(
                net, BLOBS, fetch, bs, num_worker_threads=n, coordinator=self.gc,
                deterministic=deterministic, seed=SEED, epochs=epochs, equal=True, max_buffered_batches=8,
                **kw,
            )

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.gc.stop(timeout=5.0), "a thread outlived stop()"

    def lockstep(self, limit: int | None = None) -> list[list[Event]]:
        """Run every net in turn, as one data-parallel step after another,
        until every net ended (or ``limit`` events per net)."""
        got: list[list[Event]] = [[] for _ in self.nets]
        live = list(range(len(self.nets)))
        while live and (limit is None or len(got[0]) < limit):
            for j in list(live):
                ev = next_event(self.nets[j])
                if ev is None:
                    live.remove(j)
                else:
                    got[j].append(ev)
        return got

    def threads(self) -> list[list[Event]]:
        """Every net on its own thread, to its end."""
        got: list[list[Event]] = [[] for _ in self.nets]
        errors: list[BaseException] = []

        def drain(j: int) -> None:
            try:
                while (ev := next_event(self.nets[j])) is not None:
                    got[j].append(ev)
            except BaseException as exc:  # reported in the test's thread
                errors.append(exc)

        ts = [threading.Thread(target=drain, args=(j,), name=f"test-net{j}") for j in range(len(self.nets))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert not any(t.is_alive() for t in ts), "a net hung"
        assert not errors, errors
        return got

    def dropped(self, reason: str = "equal") -> float:
        return sample(self.gc, "blobfeed_dropped_samples_total", source=SRC, reason=reason)

    def accounting(self) -> tuple[float, float]:
        """(fetched, delivered + dropped + buffered)."""
        fetched = sample(self.gc, "blobfeed_fetched_samples_total", source=SRC)
        delivered = sum(
            sample(self.gc, "blobfeed_delivered_samples_total", source=SRC, net=n.name) for n in self.nets
        )
        dropped = sum(self.dropped(r) for r in ("drop_last", "stopped", "error", "resume", "equal"))
        return fetched, delivered + dropped + sample(self.gc, "blobfeed_buffered_samples", source=SRC)


def wire(k: int, **kw: Any) -> Pipeline:
    """``k`` nets on one source with three workers in all (worker ids 0, 1,
    2 in round-robin order whatever ``k`` is: the same stream)."""
    return Pipeline({1: [3], 2: [2, 1], 3: [1, 1, 1]}[k], **kw)


# -------------------------------------------------------------------------------------------
# The dealer on its own
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True])
def test_equal_deals_through_lanes_in_rounds(deterministic: bool) -> None:
    """equal=True always deals in turn (first come cannot be equal without
    holding back); a round reaches the nets only once complete, and the
    end of the data drops an incomplete one."""
    dropped: list[tuple[str, int]] = []
    options = DealingOptions(deterministic=deterministic, equal=True)
    assert not options.in_arrival_order and "equal=True" in options.describe()
    dealer = make_dealer(
        SRC, options, batch_size=2, axes=[0], capacity=16, shuffle_rng=lambda: np.random.default_rng(0),
        on_error=pytest.fail, on_error_in_order=pytest.fail, on_dropped=lambda r, n: dropped.append((r, n)),
    )
    assert isinstance(dealer, LaneDealer) and dealer.strict == deterministic
    dealer.add_lanes([0])
    readers = [dealer.add_net() for _ in range(3)]
    dealer.start()
    put = dealer.sink(0)
    ids = np.arange(4, dtype=np.int64)
    assert put(Chunk((ids,), 4, 0, 0), ids.nbytes)  # batches 0 and 1 of round 0: held
    assert readers[0].get_nowait() == (False, None)
    assert dealer.stats().held_samples == 4
    more = np.arange(4, 10, dtype=np.int64)
    assert put(Chunk((more,), 6, 0, 1), more.nbytes)  # batch 2 completes round 0; batch 3, 4 of round 1
    got = [r.get_nowait() for r in readers]
    assert [g[0] for g in got] == [True] * 3
    assert [g[1].arrays[0].tolist() for g in got] == [[0, 1], [2, 3], [4, 5]]
    dealer.finish(0)
    dealer.end_of_input()
    for r in readers:
        with pytest.raises(EndOfInput):
            r.get_nowait()
    assert dropped == [("equal", 4)] and dealer.stats().held_samples == 0


# -------------------------------------------------------------------------------------------
# Equal counts per epoch
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3])
def test_every_net_gets_the_same_batches_per_epoch_and_the_incomplete_round_is_dropped(k: int) -> None:
    want, dropped = expected(k, 2, 5)
    assert dropped > 0, "the data must leave an incomplete round in some epoch"
    with wire(k, epochs=2) as p:
        p.gc.start()
        got = p.threads()
        for j in range(k):
            assert_events(got[j], want[j], f"net {j} of {k}")
        assert p.dropped() == dropped
        fetched, accounted = p.accounting()
        assert fetched == total_samples(2) == accounted
    counts = [per_epoch_counts(g) for g in got]
    assert all(c == counts[0] for c in counts), counts


def test_equal_on_worker_processes_gives_the_same_streams() -> None:
    want, dropped = expected(3, 2, 5)
    with wire(3, epochs=2, backend="processes") as p:
        p.gc.start()
        got = p.threads()
        assert p.dropped() == dropped
    for j in range(3):
        assert_events(got[j], want[j], f"net {j} on processes")


@pytest.mark.parametrize("k", [2, 3])
def test_arrival_order_chunks_still_give_equal_counts_exactly_once(k: int) -> None:
    """Without deterministic=True the workers' chunks are read first-ready;
    the batches still go out in rounds, one per net."""
    with wire(k, epochs=2, deterministic=False) as p:
        p.gc.start()
        got = p.threads()
        dropped = p.dropped()
        fetched, accounted = p.accounting()
    counts = [per_epoch_counts(g) for g in got]
    assert all(c == counts[0] for c in counts), counts
    want, want_dropped = expected(k, 2, 5)
    assert counts[0] == per_epoch_counts(want[0])
    delivered = np.concatenate([ev[1] for g in got for ev in g if ev[0] == "batch"])
    assert len(np.unique(delivered)) == len(delivered), "a sample reached two nets"
    # the same number of samples dropped: full batches and the epoch's partial one, whatever their ids
    assert dropped == want_dropped
    assert len(delivered) + dropped == total_samples(2) == fetched == accounted


def test_one_net_drops_nothing() -> None:
    with wire(1, epochs=2) as p:
        p.gc.start()
        got = p.threads()
        assert p.dropped() == 0
    want = [ev for e in range(2) for ev in [("batch", b) for b in epoch_batches(e, 5)] + [("end", e)]][:-1]
    assert_events(got[0], want, "one net")


def test_a_round_completed_by_the_partial_batch_goes_out() -> None:
    """drop_last=False: the epoch's last, smaller batch is a batch of its
    round; when it completes the round, every net gets the same count and
    nothing is dropped in that epoch."""
    for bs in range(3, 12):
        counts = [len(epoch_batches(e, bs)) for e in range(2)]
        if counts[0] % 2 == 0 and len(epoch_batches(0, bs)[-1]) < bs:
            break
    else:
        pytest.skip("no batch size gives an even epoch ending in a partial batch")
    want, dropped = expected(2, 2, bs)
    with wire(2, epochs=2, bs=bs) as p:
        p.gc.start()
        got = p.threads()
        assert p.dropped() == dropped
    for j in range(2):
        assert_events(got[j], want[j], f"net {j}")
    assert len(got[1][per_epoch_counts(got[1])[0] - 1][1]) < bs  # net 1 got epoch 0's partial batch


@pytest.mark.parametrize("k", [2, 3])
def test_drop_last_drops_the_partial_batch_before_the_round_is_judged(k: int) -> None:
    want, dropped = expected(k, 2, 5, drop_last=True)
    partial = sum(len(b) for e in range(2) for b in epoch_batches(e, 5)[-1:] if len(b) < 5)
    with wire(k, epochs=2, drop_last=True) as p:
        p.gc.start()
        got = p.threads()
        assert p.dropped() == dropped
        assert p.dropped("drop_last") == partial > 0
        fetched, accounted = p.accounting()
        assert fetched == accounted
    for j in range(k):
        assert_events(got[j], want[j], f"net {j} of {k}")
        assert all(len(ev[1]) == 5 for ev in got[j] if ev[0] == "batch")


def test_end_of_input_drops_the_last_round_and_every_net_ends() -> None:
    """epochs=1: the end of the data ends the epoch; its incomplete round is
    dropped and logged, then every net gets EndOfInput, also on its next run()."""
    want, dropped = expected(3, 1, 5)
    assert dropped > 0
    with wire(3, epochs=1) as p:
        p.gc.start()
        got = p.lockstep()
        for j in range(3):
            assert_events(got[j], want[j], f"net {j}")
            with pytest.raises(EndOfInput):
                p.nets[j].run(timeout=WAIT)
        assert p.dropped() == dropped


def test_the_drop_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="blobfeed"):
        with wire(3, epochs=1) as p:
            p.gc.start()
            p.lockstep()
    lines = [r.getMessage() for r in caplog.records if "incomplete last round" in r.getMessage()]
    assert len(lines) == 1 and "equal=True" in lines[0] and "'train'" in lines[0], lines


def test_endless_epochs_are_each_equal() -> None:
    with wire(3, epochs=None) as p:
        p.gc.start()
        got = p.lockstep(limit=40)
    counts = [per_epoch_counts(g)[:-1] for g in got]  # the last epoch is cut short by the limit
    assert len(counts[0]) >= 3 and all(c == counts[0] for c in counts), counts
    want, _ = expected(3, len(counts[0]), 5)
    for j in range(3):
        assert_events(got[j][:len(want[j])], want[j], f"net {j}")


def test_a_stop_mid_round_counts_the_held_round() -> None:
    """What a round holds while it waits for its last batch is buffered, and
    dropped as 'stopped' by a stop: the accounting still adds up."""
    with wire(3, epochs=None) as p:
        p.gc.start()
        p.lockstep(limit=4)
        fetched, accounted = p.accounting()
        p.gc.stop()
        fetched, accounted = p.accounting()
        assert fetched == accounted > 0


# -------------------------------------------------------------------------------------------
# Resume
# -------------------------------------------------------------------------------------------
def resumed(k: int, cut: int, **kw: Any) -> tuple[list[list[Event]], list[list[Event]], float]:
    """Every net runs ``cut`` events in lockstep; save, stop; a new pipeline
    loads the state and runs to the end.  Returns (before, after, what the
    second run dropped for equal shares)."""
    with wire(k, **kw) as p:
        p.gc.start()
        before = p.lockstep(limit=cut)
        state = json.loads(json.dumps(p.gc.state_dict(SRC)))
    assert state["equal"] is True
    with wire(k, **kw) as p:
        p.gc.load_state_dict(SRC, state)
        p.gc.start()
        after = p.lockstep()
        dropped = p.dropped()
    return before, after, dropped


@pytest.mark.parametrize("k", [2, 3])
def test_resume_around_the_dropped_round_is_exact(k: int) -> None:
    """Saved after every event (before the epoch's last round, after it,
    after EndOfEpoch, at the end): the nets' streams are the uninterrupted
    ones, and no net ever gets a batch of a dropped round."""
    want, _ = expected(k, 2, 5)
    end = next(i for i, ev in enumerate(want[0]) if ev[0] == "end")
    for cut in range(len(want[0]) + 1):
        before, after, dropped = resumed(k, cut, epochs=2)
        for j in range(k):
            assert_events(before[j] + after[j], want[j], f"k={k} cut={cut} net {j}")
        last_epoch = expected(k, 2, 5)[1] - expected(k, 1, 5)[1]
        if end < cut < len(want[0]):
            # saved past epoch 0's end: its dropped round is not dealt (nor dropped) again
            assert dropped == last_epoch, (cut, dropped)
        elif cut == len(want[0]):
            # saved at the end: the stream's end if the dealer had reached it,
            # else the last round's start (the round is fetched and dropped again)
            assert dropped in (0, last_epoch), (cut, dropped)


@pytest.mark.parametrize("runs", [(5, 3, 4), (1, 0, 0), (4, 4, 3), (6, 5, 6)])
def test_resume_with_the_nets_apart_inside_a_round_is_exact(runs: tuple[int, int, int]) -> None:
    """Saved while the nets are apart (net 0 ahead of net 1 inside one
    round): the state's position is the slowest net's, inside a round that
    went out; each net goes on with exactly its own next event."""
    want, _ = expected(3, 2, 5)
    with wire(3, epochs=2) as p:
        p.gc.start()
        before = [[next_event(p.nets[j]) for _ in range(n)] for j, n in enumerate(runs)]
        state = json.loads(json.dumps(p.gc.state_dict(SRC)))
    with wire(3, epochs=2) as p:
        p.gc.load_state_dict(SRC, state)
        p.gc.start()
        after = p.threads()
    for j in range(3):
        assert_events(before[j] + after[j], want[j], f"runs={runs} net {j}")


def test_resume_with_drop_last_is_exact() -> None:
    want, _ = expected(2, 3, 5, drop_last=True)
    for cut in (3, 8, 12):
        before, after, _ = resumed(2, cut, epochs=3, drop_last=True)
        for j in range(2):
            assert_events(before[j] + after[j], want[j], f"cut={cut} net {j}")


def test_a_state_saved_without_equal_is_refused_with_equal() -> None:
    gc = blobfeed.GlobalCoordinator()
    nets = [Net(name=f"net{i}") for i in range(2)]
    for net, n in zip(nets, (2, 1)):
        init_data_input_workers(net, BLOBS, Fetch(), 5, n, coordinator=gc, deterministic=True, seed=SEED, epochs=2)
    state = gc.state_dict(SRC)
    assert state["equal"] is False
    with wire(2, epochs=2) as p:
        with pytest.raises(ValueError, match="equal False"):
            p.gc.load_state_dict(SRC, state)
        del state["equal"]  # a state from before equal was saved: it implies equal=False
        with pytest.raises(ValueError, match="predates equal"):
            p.gc.load_state_dict(SRC, state)


# -------------------------------------------------------------------------------------------
# Refusals
# -------------------------------------------------------------------------------------------
def two_calls(first: dict[str, Any], second: dict[str, Any]) -> None:
    gc = blobfeed.GlobalCoordinator()
    a, b = Net(name="a"), Net(name="b")
    init_data_input_workers(a, BLOBS, Fetch(), 5, 1, coordinator=gc, seed=SEED, **first)
    init_data_input_workers(b, BLOBS, Fetch(), 5, 1, coordinator=gc, seed=SEED, **second)


@pytest.mark.parametrize("first, second", [(True, False), (False, True)])
def test_nets_that_disagree_on_equal_are_refused_naming_both(first: bool, second: bool) -> None:
    with pytest.raises(ValueError) as err:
        two_calls({"equal": first}, {"equal": second})
    msg = str(err.value)
    assert f"equal={first}" in msg and f"equal={second}" in msg and "'train'" in msg, msg


def test_equal_nets_that_disagree_on_drop_last_are_refused_naming_both() -> None:
    with pytest.raises(ValueError) as err:
        two_calls({"equal": True}, {"equal": True, "drop_last": True})
    msg = str(err.value)
    assert "drop_last=False" in msg and "drop_last=True" in msg, msg
    # without equal, drop_last stays each net's own
    two_calls({"drop_last": True}, {})


def test_equal_refuses_dont_rebatch_naming_both() -> None:
    with pytest.raises(ValueError, match=r"equal=True.*dont_rebatch=True"):
        init_data_input_workers(Net(), BLOBS, Fetch(), 5, coordinator=blobfeed.GlobalCoordinator(),
                                equal=True, dont_rebatch=True)


def test_equal_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="equal must be a bool"):
        init_data_input_workers(Net(), BLOBS, Fetch(), 5, coordinator=blobfeed.GlobalCoordinator(), equal="yes")


class _Uneven:
    """Worker 0 has many chunks of a whole batch each; the others one."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.calls = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        self.calls += 1
        if self.calls > (40 if worker_id == 0 else 1):
            raise StopIteration
        return [np.full((batch_size, self.rows), worker_id, np.float32)]


def test_a_round_held_back_never_holds_a_workers_shared_memory() -> None:
    """A round's pieces wait until its last batch is cut.  On worker
    processes they were views of a worker's shared-memory slots: once the
    other workers' data ended, one worker had to fill whole rounds of 9 nets
    with 8 slots, waited for a slot the round held, and every net timed out.
    The pieces are copied out now, as the shuffle buffer does."""
    from blobfeed.feeders.processes import ProcessBackend

    k, bs = 9, 64
    gc = blobfeed.GlobalCoordinator()
    nets = [Net(name=f"n{i}") for i in range(k)]
    for net in nets:
        # 64 rows of 4 KiB: a chunk big enough to travel in a slot
        init_data_input_workers(net, ["x"], _Uneven(1024), bs, num_worker_threads=1, coordinator=gc,
                                deterministic=True, seed=1, equal=True, timeout=WAIT,
                                backend=ProcessBackend(slots=8, slot_bytes=1 << 20))
    gc.start()
    try:
        for _ in range(4):  # rounds 2-4 come from worker 0 alone
            for net in nets:
                assert net.run()["x"].shape == (bs, 1024)
    finally:
        assert gc.stop(timeout=WAIT)


def test_equal_with_a_shuffle_buffer_and_drop_last_keeps_the_counts_equal() -> None:
    """The shuffle stage cuts the epoch's last, partial batch itself; the
    dealer did not see it as partial and dealt it in a round, then the net
    it reached dropped it (its own drop_last): that net had a batch fewer
    in every epoch ([[2, 2], [1, 1]])."""
    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        info = get_worker_info()
        c = calls.get((worker_id, info.epoch), 0)
        if c * 4 >= 7:
            raise StopIteration
        calls[(worker_id, info.epoch)] = c + 1
        return [np.arange(c * 4, min(7, c * 4 + 4), dtype=np.int64) + worker_id * 100 + info.epoch * 1000]

    calls: dict[tuple[int, int], int] = {}
    gc = blobfeed.GlobalCoordinator()
    nets = [Net(name=f"n{i}") for i in range(2)]
    for net in nets:
        # one worker a call: 2 workers, 14 samples an epoch
        init_data_input_workers(net, ["ids"], fetch, 4, num_worker_threads=1, coordinator=gc, deterministic=True,
                                seed=1, epochs=2, equal=True, drop_last=True, shuffle_buffer=1000, timeout=WAIT)
    gc.start()
    counts: list[list[int]] = [[0], [0]]
    sizes: list[set[int]] = [set(), set()]
    live = [0, 1]
    try:
        while live:
            for j in list(live):
                try:
                    sizes[j].add(len(nets[j].run()["ids"]))
                    counts[j][-1] += 1
                except EndOfEpoch:
                    counts[j].append(0)
                except EndOfInput:
                    live.remove(j)
    finally:
        assert gc.stop(timeout=WAIT)
    # 14 samples an epoch: 3 whole batches and 2 samples; the partial one
    # dropped (drop_last), then the incomplete round (equal)
    assert counts == [[1, 1], [1, 1]] and sizes == [{4}, {4}], (counts, sizes)


@pytest.mark.parametrize("kw, named", [({"equal": True}, "equal"), ({"epochs": 2}, "epochs")])
def test_reset_data_input_refused_names_what_fixes_the_batch_size(kw: dict, named: str) -> None:
    """reset_data_input on an equal source was refused as re-batched for
    "deterministic, shuffle_buffer or epochs", which named none of the
    user's arguments."""
    gc = blobfeed.GlobalCoordinator()
    net = blobfeed.Net(None, name="n0")
    blobfeed.init_data_input_workers(net, ["x"], lambda w, b: [np.zeros(4, np.float32)], 4,
                                     input_source_name="train", coordinator=gc, **kw)
    try:
        with pytest.raises(ValueError, match=rf"batch size is fixed") as err:
            gc.reset_data_input("train", net, 8)
        assert named in str(err.value), err.value
    finally:
        assert gc.stop(timeout=5.0)
