"""Several epochs over one wiring (``init_data_input_workers(..., epochs=N)``).

Every test builds the stream it expects itself, from the fetcher's pure data
function: per epoch, each worker's chunks in strict round robin, cut into
batches, the epoch's last batch smaller, then the end of the epoch
(``EndOfEpoch``), and ``EndOfInput`` after the last epoch.  The fetchers
make epochs of different lengths (epoch ``e`` has ``e`` more chunks per
worker), so a resume that shortened or dropped an epoch shows.
"""

from __future__ import annotations

import json
import random
import threading
from typing import Any, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blobfeed
from blobfeed import EndOfEpoch, EndOfInput, FetcherError, Net, get_worker_info, init_data_input_workers
from blobfeed.worker_info import for_epoch, worker_seeds

SRC = "train"
BLOBS = ["ids", "feat"]
WAIT = 10.0
SEED = 77
ESPAN = 10_000_000
WSPAN = 100_000
KSPAN = 1000

#: an event of a net: ("batch", ids, feat) or ("end", epoch)
Event = tuple[Any, ...]


def size(salt: int, e: int, wid: int, k: int) -> int:
    return random.Random(f"{salt}:{e}:{wid}:{k}").randint(1, 9)


def n_chunks(lengths: dict[int, int], wid: int, e: int) -> int:
    return lengths[wid] + e


def ids_of(e: int, wid: int, k: int, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) + e * ESPAN + wid * WSPAN + k * KSPAN


class EpochFetch:
    """A plain fetcher (replayed on resume); module level, so it pickles.

    In epoch ``e``, worker ``wid`` returns ``lengths[wid] + e`` chunks, then
    raises StopIteration; ``feat`` is drawn from the epoch's
    ``get_worker_info().rng``.  It counts its calls per (worker, epoch), as
    a fetcher that starts over in every epoch does.
    """

    def __init__(self, lengths: dict[int, int], salt: int = 0, fail_init_in: int | None = None) -> None:
        self.lengths = dict(lengths)
        self.salt = salt
        self.calls: dict[tuple[int, int], int] = {}
        self.fail_init_in = fail_init_in

    def init(self, wid: int) -> None:
        info = get_worker_info()
        assert info is not None and info.worker_id == wid
        if info.epoch == self.fail_init_in:
            raise RuntimeError(f"worker {wid}: no data for epoch {info.epoch}")

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        info = get_worker_info()
        assert info is not None
        e = info.epoch
        k = self.calls.get((wid, e), 0)
        if k >= n_chunks(self.lengths, wid, e):
            raise StopIteration
        self.calls[(wid, e)] = k + 1
        n = size(self.salt, e, wid, k)
        return [ids_of(e, wid, k, n), info.rng.random(n)]


class StatefulEpochFetch:
    """A stateful fetcher: restored from its state, never replayed.  Its
    ``feat`` is a function of the ids (a restored fetcher has a fresh rng)."""

    def __init__(self, lengths: dict[int, int], salt: int = 0) -> None:
        self.lengths = dict(lengths)
        self.salt = salt
        self.epoch = 0
        self.k = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "k": self.k}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.k = state["epoch"], state["k"]

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        info = get_worker_info()
        assert info is not None
        if info.epoch != self.epoch:  # a new epoch starts over
            self.epoch, self.k = info.epoch, 0
        if self.k >= n_chunks(self.lengths, wid, self.epoch):
            raise StopIteration
        k = self.k
        self.k += 1
        ids = ids_of(self.epoch, wid, k, size(self.salt, self.epoch, wid, k))
        return [ids, (ids % 101) / 101.0]


def expected(fetch: Any, workers: Sequence[int], bs: int, epochs: int, *, drop_last: bool = False) -> list[Event]:
    """The stream one net must see, built from the fetcher's data function."""
    events: list[Event] = []
    for e in range(epochs):
        rngs = {w: for_epoch(info0(w), e).rng for w in workers}
        ids_parts, feat_parts = [], []
        rounds = max(n_chunks(fetch.lengths, w, e) for w in workers)
        for k in range(rounds):
            for w in workers:
                if k < n_chunks(fetch.lengths, w, e):
                    n = size(fetch.salt, e, w, k)
                    ids = ids_of(e, w, k, n)
                    ids_parts.append(ids)
                    feat_parts.append(
                        rngs[w].random(n) if isinstance(fetch, EpochFetch) else (ids % 101) / 101.0
                    )
        ids_all, feat_all = np.concatenate(ids_parts), np.concatenate(feat_parts)
        for lo in range(0, len(ids_all), bs):
            if drop_last and lo + bs > len(ids_all):
                break
            events.append(("batch", ids_all[lo:lo + bs], feat_all[lo:lo + bs]))
        if e < epochs - 1:
            events.append(("end", e))
    return events


def info0(wid: int) -> blobfeed.WorkerInfo:
    seed, rng = worker_seeds(SEED, wid)
    return blobfeed.WorkerInfo(wid, wid, 0, SRC, seed, rng)


def next_event(net: Net) -> Event | None:
    """The net's next event; None at EndOfInput."""
    try:
        out = net.run(timeout=WAIT)
    except EndOfEpoch as end:
        assert end.source == SRC
        return ("end", end.epoch)
    except EndOfInput:
        return None
    return ("batch", np.array(out["ids"]), np.array(out["feat"]))


def assert_events(got: list[Event], want: list[Event], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} events, expected {len(want)}: {summary(got)} vs {summary(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0], f"{what}: event {i} is {g[0]}, expected {w[0]}"
        if g[0] == "end":
            assert g[1] == w[1], f"{what}: event {i} ends epoch {g[1]}, expected {w[1]}"
        else:
            np.testing.assert_array_equal(g[1], w[1], err_msg=f"{what}: ids of event {i}")
            np.testing.assert_array_equal(g[2], w[2], err_msg=f"{what}: feat of event {i}")


def summary(events: list[Event]) -> list[Any]:
    return [e[1] if e[0] == "end" else len(e[1]) for e in events]


class Pipeline:
    """A fresh coordinator with one source feeding ``nets`` nets."""

    def __init__(
        self, fetch: Any, *, workers: int | Sequence[int] = 3, bs: int = 5, epochs: int | None = 3,
        deterministic: bool = True, backend: Any = "threads", **kw: Any,
    ) -> None:
        """``workers``: per net (one ``init_data_input_workers`` call each), its worker count."""
        self.gc = blobfeed.GlobalCoordinator()
        counts = [workers] if isinstance(workers, int) else list(workers)
        self.nets = [Net(name=f"net{i}") for i in range(len(counts))]
        init = getattr(fetch, "init", None)
        for net, n in zip(self.nets, counts):
            init_data_input_workers(
                net, BLOBS, fetch, bs, num_worker_threads=n, coordinator=self.gc,
                deterministic=deterministic, seed=SEED, epochs=epochs, backend=backend,
                worker_init_fun=init, max_buffered_batches=8, **kw,
            )

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.gc.stop(timeout=5.0), "a thread outlived stop()"

    def drain(self, net: int = 0, limit: int | None = None) -> list[Event]:
        events: list[Event] = []
        while limit is None or len(events) < limit:
            ev = next_event(self.nets[net])
            if ev is None:
                break
            events.append(ev)
        return events


LENGTHS = {0: 3, 1: 1, 2: 4}


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_epochs_give_each_epoch_exactly_with_its_end(backend: str) -> None:
    fetch = EpochFetch(LENGTHS, salt=1)
    with Pipeline(fetch, backend=backend, epochs=3) as p:
        p.gc.start()
        got = p.drain()
        with pytest.raises(EndOfInput) as after:
            p.nets[0].run(timeout=WAIT)
        assert not isinstance(after.value, EndOfEpoch)
    assert_events(got, expected(fetch, [0, 1, 2], 5, 3), backend)
    # the last batch of each epoch is its own, smaller one
    assert sum(1 for ev in got if ev[0] == "end") == 2


def test_worker_init_fun_runs_in_every_epoch_with_its_epoch() -> None:
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def init(wid: int) -> None:
        info = get_worker_info()
        assert info is not None
        with lock:
            seen.append((wid, info.epoch, info.seed))

    fetch = EpochFetch({0: 1, 1: 2})
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, BLOBS, fetch, 4, num_worker_threads=2, coordinator=gc, seed=SEED,
                            epochs=3, worker_init_fun=init)
    try:
        gc.start()
        ends = []
        for _ in range(200):
            try:
                net.run(timeout=WAIT)
            except EndOfEpoch as e:
                ends.append(e.epoch)
            except EndOfInput:
                break
    finally:
        assert gc.stop(timeout=5.0)
    assert ends == [0, 1]
    assert sorted((w, e) for w, e, _ in seen) == [(w, e) for w in (0, 1) for e in range(3)]
    # epoch 0 keeps the worker's own seed; each later epoch has another one
    for w, e, s in seen:
        assert s == for_epoch(info0(w), e).seed
        assert (s == worker_seeds(SEED, w)[0]) == (e == 0)
    assert len({s for _, _, s in seen}) == 6


def test_two_nets_each_see_every_epoch_end_and_batches_are_dealt_in_turn() -> None:
    fetch = EpochFetch(LENGTHS, salt=4)
    results: list[list[Event]] = [[], []]
    errors: list[BaseException] = []
    with Pipeline(fetch, workers=(2, 1), epochs=3, bs=3) as p:
        p.gc.start()

        def consume(j: int) -> None:
            try:
                results[j] = p.drain(j)
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=consume, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a consumer hung"
    assert not errors, errors
    # global batch i goes to net i mod 2, across epochs; each net gets every epoch's end
    want = expected(fetch, [0, 1, 2], 3, 3)
    per_net: list[list[Event]] = [[], []]
    i = 0
    for ev in want:
        if ev[0] == "end":
            for j in range(2):
                per_net[j].append(ev)
        else:
            per_net[i % 2].append(ev)
            i += 1
    for j in range(2):
        assert_events(results[j], per_net[j], f"net {j}")


def test_endless_epochs_until_stopped() -> None:
    fetch = EpochFetch({0: 1, 1: 1})
    with Pipeline(fetch, workers=2, epochs=None, bs=64) as p:
        p.gc.start()
        got = p.drain(limit=20)
    assert_events(got, expected(fetch, [0, 1], 64, 30)[:20], "endless")
    assert sum(ev[0] == "end" for ev in got) >= 5


def test_drop_last_drops_each_epochs_partial_batch() -> None:
    fetch = EpochFetch(LENGTHS, salt=5)
    with Pipeline(fetch, epochs=3, bs=4, drop_last=True) as p:
        p.gc.start()
        got = p.drain()
    assert_events(got, expected(fetch, [0, 1, 2], 4, 3, drop_last=True), "drop_last")


def test_shuffle_is_fresh_in_every_epoch_and_the_same_every_run() -> None:
    lengths = {0: 6, 1: 6}

    def run() -> list[Event]:
        with Pipeline(EpochFetch(lengths, salt=6), workers=2, epochs=3, bs=4, shuffle_buffer=16) as p:
            p.gc.start()
            return p.drain()

    first, second = run(), run()
    assert_events(second, first, "second run")
    orders: list[list[int]] = [[]]
    for ev in first:
        if ev[0] == "end":
            orders.append([])
        else:
            orders[-1].extend((ev[1] % ESPAN).tolist())  # the same sample across epochs
    assert len(orders) == 3
    plain = expected(EpochFetch(lengths, salt=6), [0, 1], 4, 3)
    unshuffled: list[list[int]] = [[]]
    for ev in plain:
        if ev[0] == "end":
            unshuffled.append([])
        else:
            unshuffled[-1].extend((ev[1] % ESPAN).tolist())
    for e in range(3):
        assert sorted(orders[e]) == sorted(unshuffled[e]), f"epoch {e} holds other samples"
        assert orders[e] != unshuffled[e], f"epoch {e} was not shuffled"
    common = set(orders[0]) & set(orders[1])
    assert [x for x in orders[0] if x in common] != [x for x in orders[1] if x in common], \
        "two epochs were shuffled alike"


def test_worker_init_fun_failing_in_a_later_epoch_is_an_error_after_the_earlier_batches() -> None:
    fetch = EpochFetch(LENGTHS, salt=7, fail_init_in=1)
    with Pipeline(fetch, epochs=3) as p:
        p.gc.start()
        got: list[Event] = []
        with pytest.raises(FetcherError, match="no data for epoch 1") as err:
            for _ in range(100):
                ev = next_event(p.nets[0])
                assert ev is not None
                got.append(ev)
    assert isinstance(err.value.__cause__, RuntimeError)
    want = expected(fetch, [0, 1, 2], 5, 3)
    first_end = next(i for i, ev in enumerate(want) if ev[0] == "end")
    # deterministic: every batch of epoch 0, and its end, come before the error
    assert_events(got[:first_end + 1], want[:first_end + 1], "before the error")
    assert all(ev[0] == "batch" and ev[1][0] // ESPAN == 0 for ev in got[:first_end])


# -------------------------------------------------------------------------------------------
# Resume across epochs
# -------------------------------------------------------------------------------------------
def resumed(fetch_factory: Any, cut: int, *, backend: str = "threads", epochs: int = 3, bs: int = 5,
            **kw: Any) -> tuple[list[Event], list[Event]]:
    """Run ``cut`` events, save, stop; a new pipeline loads the state and runs
    to the end.  Returns (events before, events after)."""
    with Pipeline(fetch_factory(), epochs=epochs, bs=bs, backend=backend, **kw) as p:
        p.gc.start()
        before = p.drain(limit=cut)
        state = json.loads(json.dumps(p.gc.state_dict(SRC)))
    with Pipeline(fetch_factory(), epochs=epochs, bs=bs, backend=backend, **kw) as p:
        p.gc.load_state_dict(SRC, state)
        p.gc.start()
        after = p.drain()
    return before, after


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(0, 30), stateful=st.booleans())
def test_resume_at_any_event_gives_the_uninterrupted_stream(cut: int, stateful: bool) -> None:
    """Around every epoch end too: saved before or after run() reported it."""
    factory = (lambda: StatefulEpochFetch(LENGTHS, salt=8)) if stateful else (lambda: EpochFetch(LENGTHS, salt=8))
    want = expected(factory(), [0, 1, 2], 5, 3)
    before, after = resumed(factory, min(cut, len(want)))
    assert_events(before + after, want, f"cut={cut} stateful={stateful}")


@pytest.mark.parametrize("stateful", [False, True])
def test_resume_on_processes_across_an_epoch_end(stateful: bool) -> None:
    factory = (lambda: StatefulEpochFetch(LENGTHS, salt=9)) if stateful else (lambda: EpochFetch(LENGTHS, salt=9))
    want = expected(factory(), [0, 1, 2], 5, 3)
    cut = next(i for i, ev in enumerate(want) if ev[0] == "end")  # just before the end
    for at in (cut, cut + 1):
        before, after = resumed(factory, at, backend="processes")
        assert_events(before + after, want, f"processes stateful={stateful} cut={at}")


def test_state_names_the_epoch_and_refuses_one_past_the_last() -> None:
    fetch = EpochFetch(LENGTHS, salt=10)
    want = expected(fetch, [0, 1, 2], 5, 3)
    past_first_end = next(i for i, ev in enumerate(want) if ev[0] == "end") + 2
    with Pipeline(EpochFetch(LENGTHS, salt=10), epochs=3) as p:
        p.gc.start()
        p.drain(limit=past_first_end)
        state = p.gc.state_dict(SRC)
    assert state["position"]["epoch"] == 1
    assert state["nets"][0][2] == 1  # the net was told epoch 0 ended
    with Pipeline(EpochFetch(LENGTHS, salt=10), epochs=1) as p:
        with pytest.raises(ValueError, match="epoch 1.*epochs=1"):
            p.gc.load_state_dict(SRC, state)


def test_resume_refuses_another_seed() -> None:
    with Pipeline(EpochFetch(LENGTHS), epochs=2) as p:
        state = p.gc.state_dict(SRC)
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="net0")
    init_data_input_workers(net, BLOBS, EpochFetch(LENGTHS), 5, num_worker_threads=3, coordinator=gc,
                            deterministic=True, seed=SEED + 1, epochs=2)
    try:
        with pytest.raises(ValueError, match=r"seed \[77\].*\[78\].*pass seed="):
            gc.load_state_dict(SRC, state)
    finally:
        assert gc.stop(timeout=5.0)


@pytest.mark.parametrize("epochs", [0, -1, 1.5, "2"])
def test_bad_epochs_are_refused(epochs: Any) -> None:
    gc = blobfeed.GlobalCoordinator()
    with pytest.raises((TypeError, ValueError), match="epochs"):
        init_data_input_workers(Net(name="n"), BLOBS, EpochFetch(LENGTHS), 4, coordinator=gc, epochs=epochs)
    assert gc.stop(timeout=5.0)


def test_epochs_refuse_dont_rebatch_and_disagreeing_calls() -> None:
    gc = blobfeed.GlobalCoordinator()
    try:
        with pytest.raises(ValueError, match="dont_rebatch"):
            init_data_input_workers(Net(name="a"), BLOBS, EpochFetch(LENGTHS), 4, coordinator=gc,
                                    epochs=2, dont_rebatch=True)
        init_data_input_workers(Net(name="a"), BLOBS, EpochFetch(LENGTHS), 4, coordinator=gc, epochs=2)
        with pytest.raises(ValueError, match="epochs=2.*epochs=3"):
            init_data_input_workers(Net(name="b"), BLOBS, EpochFetch(LENGTHS), 4, coordinator=gc, epochs=3)
    finally:
        assert gc.stop(timeout=5.0)


def test_a_net_fed_by_two_sources_keeps_the_others_batch_at_an_epoch_end() -> None:
    """One source's epoch ends: run() raises EndOfEpoch and the other
    source's batch, already taken, is the next run()'s: nothing shifts."""
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, ["a"], _Counter(3), 2, num_worker_threads=1, coordinator=gc,
                            input_source_name="short", epochs=2, seed=SEED, deterministic=True)
    init_data_input_workers(net, ["b"], _Counter(1000), 2, num_worker_threads=1, coordinator=gc,
                            input_source_name="long", seed=SEED, deterministic=True)
    try:
        gc.start()
        bs: list[int] = []
        for _ in range(3):  # the short source's epoch: 3 chunks of 2
            out = net.run(timeout=WAIT)
            bs.extend(out["b"].tolist())
        with pytest.raises(EndOfEpoch) as end:
            net.run(timeout=WAIT)
        assert end.value.source == "short" and end.value.epoch == 0
        out = net.run(timeout=WAIT)
        bs.extend(out["b"].tolist())
        assert bs == list(range(8)), "the long source's batch was lost or shifted at the epoch end"
        assert out["a"].tolist() == [0, 1]
    finally:
        assert gc.stop(timeout=5.0)


class _Counter:
    """Per epoch, ``n`` chunks of 2 samples numbered from 0."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.k: dict[int, int] = {}

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        info = get_worker_info()
        assert info is not None
        k = self.k.get(info.epoch, 0)
        if k >= self.n:
            raise StopIteration
        self.k[info.epoch] = k + 1
        return [np.arange(2 * k, 2 * k + 2, dtype=np.int64)]


class WideStatefulFetch(StatefulEpochFetch):
    """As StatefulEpochFetch, with rows of 16 KiB: most chunks of a worker
    process travel through its shared memory, with the state beside them."""

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        ids, feat = super().__call__(wid, bs)
        return [ids, np.repeat(feat[:, None], 2048, axis=1)]


def test_stateful_fetcher_resumes_through_shared_memory_on_processes() -> None:
    factory = lambda: WideStatefulFetch(LENGTHS, salt=11)  # noqa: E731
    narrow = expected(StatefulEpochFetch(LENGTHS, salt=11), [0, 1, 2], 5, 2)
    want = [ev if ev[0] == "end" else (ev[0], ev[1], np.repeat(ev[2][:, None], 2048, axis=1)) for ev in narrow]
    before, after = resumed(factory, 4, backend="processes", epochs=2)
    assert_events(before + after, want, "wide stateful chunks on processes")


def test_resume_after_a_dropped_partial_batch_neither_repeats_nor_skips() -> None:
    """drop_last: the dropped last batch of an epoch still moves the net's
    position, or a state saved later would give a batch twice."""
    factory = lambda: EpochFetch(LENGTHS, salt=12)  # noqa: E731
    want = expected(factory(), [0, 1, 2], 4, 3, drop_last=True)
    whole = sum(len(ev[1]) for ev in expected(factory(), [0, 1, 2], 4, 3) if ev[0] == "batch")
    assert whole > sum(len(ev[1]) for ev in want if ev[0] == "batch"), "a partial batch should be dropped"
    # epoch 1 ends with a partial batch (57 samples); the others do not
    assert [sum(len(ev[1]) for ev in expected(factory(), [0, 1, 2], 4, 3)
                if ev[0] == "batch" and ev[1][0] // ESPAN == e) % 4 for e in range(3)] == [0, 1, 0]
    end_1 = [i for i, ev in enumerate(want) if ev[0] == "end"][1]
    for cut in range(end_1 - 1, end_1 + 4):
        before, after = resumed(factory, cut, bs=4, drop_last=True)
        assert_events(before + after, want, f"drop_last cut={cut}")
