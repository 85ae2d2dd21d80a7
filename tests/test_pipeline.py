"""Re-batching guarantees through the whole pipeline (docs/CONTRACT.md).

Exact batch sizes, exactly once, the last partial batch, ``drop_last`` and
its count, on every backend and mode, are in tests/contract/test_delivery.py;
here: random shapes, views, batch columns, ``dont_rebatch``, the enqueuer and
the consumer's own assembly, several sources."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blobfeed
from blobfeed import EndOfInput, Net, init_data_input_workers

from .helpers import WAIT, ChunkPlan, drain, drain_in_threads, sample


def check_batches(batches: list[dict[str, np.ndarray]], batch_size: int, *, last_may_be_short: bool = True) -> np.ndarray:
    """Asserts sizes and cross-blob alignment; returns the ids in delivery order."""
    for i, b in enumerate(batches):
        n = len(b["ids"])
        if i < len(batches) - 1 or not last_may_be_short:
            assert n == batch_size, f"batch {i} has {n} samples, expected {batch_size}"
        else:
            assert 0 < n <= batch_size
        assert b["feat"].shape == (n, 2)
        np.testing.assert_array_equal(b["feat"][:, 0], b["ids"].astype(np.float32))
    return np.concatenate([b["ids"] for b in batches]) if batches else np.empty(0, np.int64)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.lists(st.integers(1, 40), min_size=0, max_size=12), min_size=1, max_size=4),
    batch_size=st.integers(1, 33),
    n_nets=st.integers(1, 3),
)
def test_every_sample_exactly_once_across_nets(sizes: list[list[int]], batch_size: int, n_nets: int) -> None:
    """Random chunk sizes, batch sizes, worker counts, and 1-3 nets sharing a source."""
    gc = blobfeed.GlobalCoordinator()
    try:
        nets = [Net(name=f"net{i}") for i in range(n_nets)]
        # the workers are split across the init calls, one call per net
        per_call = [list(range(len(sizes)))[i::n_nets] for i in range(n_nets)]
        plan_sizes: dict[int, list[int]] = {}
        for i, net in enumerate(nets):
            n_workers = max(1, len(per_call[i]))
            ids_before = len(gc.get_worker_ids())
            for k in range(n_workers):
                src = per_call[i][k] if k < len(per_call[i]) else None
                plan_sizes[ids_before + k] = sizes[src] if src is not None else []
            init_data_input_workers(
                net, ["ids", "feat"], lambda w, b: plan(w, b), batch_size,
                num_worker_threads=n_workers, coordinator=gc,
            )
        plan = ChunkPlan(plan_sizes)
        gc.start()
        results = drain_in_threads(nets)
        all_ids = []
        for net in nets:
            all_ids.append(check_batches(results[net.name], batch_size))
        ids = np.concatenate(all_ids)
        assert len(ids) == plan.total
        assert len(np.unique(ids)) == len(ids)
        if plan.issued:
            np.testing.assert_array_equal(np.sort(ids), np.sort(np.concatenate(plan.issued)))
        fetched = sample(gc, "blobfeed_fetched_samples_total", source="train")
        delivered = sum(sample(gc, "blobfeed_delivered_samples_total", source="train", net=n.name) for n in nets)
        assert fetched == delivered == plan.total
    finally:
        assert gc.stop(timeout=WAIT)


def test_batch_inside_one_chunk_is_a_view(gc: blobfeed.GlobalCoordinator) -> None:
    big = np.arange(100, dtype=np.int64)
    feat = np.zeros((100, 2), np.float32)
    chunks = [[big, feat]]

    def fetch(w: int, b: int) -> list[np.ndarray]:
        if not chunks:
            raise StopIteration
        return chunks.pop()

    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], fetch, 10, num_worker_threads=1, coordinator=gc)
    gc.start()
    first = net.run(timeout=WAIT)
    assert np.shares_memory(first["ids"], big), "a batch inside one chunk was copied"
    np.testing.assert_array_equal(first["ids"], np.arange(10))


def test_batch_columns_rebatch_along_the_given_axis(gc: blobfeed.GlobalCoordinator) -> None:
    state = {"k": 0}

    def fetch(w: int, b: int) -> list[np.ndarray]:
        if state["k"] >= 6:
            raise StopIteration
        k, state["k"] = state["k"], state["k"] + 1
        n = 3 + k % 2  # 3, 4, 3, 4, 3, 4 samples -> 21
        ids = np.arange(10 * k, 10 * k + n)
        # time-major blob: batch axis 1
        seq = np.broadcast_to(ids, (2, n)).astype(np.float64).copy()
        return [ids, seq]

    net = Net(name="n")
    init_data_input_workers(net, ["ids", "seq"], fetch, 5, num_worker_threads=1, batch_columns=[0, 1], coordinator=gc)
    gc.start()
    batches = drain(net)
    assert [b["ids"].shape for b in batches] == [(5,)] * 4 + [(1,)]
    for b in batches:
        assert b["seq"].shape == (2, len(b["ids"]))
        np.testing.assert_array_equal(b["seq"][1], b["ids"])


def test_dont_rebatch_delivers_chunks_as_they_are(gc: blobfeed.GlobalCoordinator) -> None:
    plan = ChunkPlan({0: [3, 17, 1, 9]})
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], plan, 8, num_worker_threads=1, dont_rebatch=True, coordinator=gc)
    gc.start()
    batches = drain(net)
    assert [len(b["ids"]) for b in batches] == [3, 17, 1, 9]


def test_reset_data_input_changes_later_batches_and_the_hint(gc: blobfeed.GlobalCoordinator) -> None:
    hints: list[int] = []
    new_hint = threading.Event()

    def fetch(w: int, b: int) -> list[np.ndarray]:
        hints.append(b)
        if b == 6:
            new_hint.set()
        return [np.zeros(2, np.int64), np.zeros((2, 2), np.float32)]

    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], fetch, 4, num_worker_threads=1, device_queue_capacity=1,
                            max_buffered_batches=2, coordinator=gc)
    gc.start()
    assert len(net.run(timeout=WAIT)["ids"]) == 4
    gc.reset_data_input("train", net, 6)
    sizes = [len(net.run(timeout=WAIT)["ids"]) for _ in range(6)]
    # at most the device queue (1) plus the batch the enqueuer holds keep the old size
    assert sizes[-1] == 6 and sizes[-2] == 6, sizes
    assert set(sizes) <= {4, 6}
    assert new_hint.wait(WAIT), "fetchers never got the new batch size as their hint"
    with pytest.raises(ValueError, match="not fed from source 'other'"):
        gc.reset_data_input("other", net, 6)
    with pytest.raises(ValueError, match="batch_size"):
        gc.reset_data_input("train", net, 0)


def test_different_sources_never_mix(gc: blobfeed.GlobalCoordinator) -> None:
    def const(value: int, n_chunks: int):
        left = [n_chunks]

        def fetch(w: int, b: int) -> list[np.ndarray]:
            if left[0] == 0:
                raise StopIteration
            left[0] -= 1
            return [np.full(3, value, np.int64), np.full((3, 2), value, np.float32)]

        return fetch

    a, b = Net(name="a"), Net(name="b")
    init_data_input_workers(a, ["ids", "feat"], const(1, 20), 4, num_worker_threads=1, input_source_name="sa", coordinator=gc)
    init_data_input_workers(b, ["ids", "feat"], const(2, 20), 4, num_worker_threads=1, input_source_name="sb", coordinator=gc)
    gc.start()
    res = drain_in_threads([a, b])
    assert sum(len(x["ids"]) for x in res["a"]) == 60
    assert all((x["ids"] == 1).all() for x in res["a"])
    assert all((x["ids"] == 2).all() for x in res["b"])


def test_one_net_two_sources_runs_both(gc: blobfeed.GlobalCoordinator) -> None:
    def fetch_x(w: int, b: int) -> list[np.ndarray]:
        return [np.ones((3, 4), np.float32)]

    def fetch_y(w: int, b: int) -> list[np.ndarray]:
        return [np.zeros(5, np.int64)]

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch_x, 6, input_source_name="xs", coordinator=gc)
    init_data_input_workers(net, ["y"], fetch_y, 6, input_source_name="ys", coordinator=gc)
    gc.start()
    out = net.run(timeout=WAIT)
    assert out["x"].shape == (6, 4) and out["y"].shape == (6,)
    assert sorted(net.workspace.blobs()) == ["x", "y"]


def test_worker_ids_come_from_the_global_sequence(gc: blobfeed.GlobalCoordinator) -> None:
    seen: set[int] = set()

    def fetch(w: int, b: int) -> list[np.ndarray]:
        seen.add(w)
        raise StopIteration

    a, b = Net(name="a"), Net(name="b")
    init_data_input_workers(a, ["x"], fetch, 2, num_worker_threads=2, coordinator=gc)
    init_data_input_workers(b, ["x"], fetch, 2, num_worker_threads=3, input_source_name="s2", coordinator=gc)
    assert gc.get_worker_ids() == [0, 1, 2, 3, 4]
    gc.start()
    drain_in_threads([a, b])
    assert seen == {0, 1, 2, 3, 4}


def test_init_fun_runs_once_before_any_thread(gc: blobfeed.GlobalCoordinator) -> None:
    import threading

    calls: list[tuple[object, object, list[str]]] = []

    def init_fun(dc: blobfeed.DataInputCoordinator, g: blobfeed.GlobalCoordinator) -> None:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("blobfeed-fetch")]
        calls.append((dc, g, alive))

    net = Net(name="n")
    returned = init_data_input_workers(net, ["ids", "feat"], ChunkPlan({0: [2], 1: [2]}), 2, init_fun=init_fun, coordinator=gc)
    net2 = Net(name="m")
    init_data_input_workers(net2, ["ids", "feat"], ChunkPlan({2: [2], 3: [2]}), 2, input_source_name="o", init_fun=init_fun, coordinator=gc)
    assert returned is gc and not calls, "init_fun must wait for start()"
    gc.start()
    gc.start()  # harmless
    assert len(calls) == 2
    assert all(alive == [] for _, _, alive in calls), "a fetcher started before every init_fun ran"
    assert calls[0][1] is gc and calls[0][0].net is net and calls[0][0].name == "train"
    drain_in_threads([net, net2])


def test_default_global_coordinator_is_returned() -> None:
    net = Net(name="global-test")
    gc = init_data_input_workers(net, ["x"], lambda w, b: [np.zeros(1)], 1)
    try:
        assert gc is blobfeed.global_coordinator
        gc.start()
        assert net.run(timeout=WAIT)["x"].shape == (1,)
    finally:
        assert blobfeed.global_coordinator.stop(timeout=WAIT)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_strict_order_whoever_assembles(gc: blobfeed.GlobalCoordinator, seed: int) -> None:
    """One fetcher, one net: samples come out in exactly the order fetched,
    whether the enqueuer or the net's own thread assembled each batch, and
    across the enqueuer's staged batch.  The consumer alternates bursts of
    fast runs (it assembles itself) with pauses (the enqueuer fills the
    device queue and stages its next batch)."""
    rng = np.random.default_rng(seed)
    sizes = [int(x) for x in rng.integers(1, 30, size=300)]
    plan = ChunkPlan({0: sizes})
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], plan, 16, num_worker_threads=1,
                            device_queue_capacity=2, max_buffered_batches=8, coordinator=gc)
    gc.start()
    pause = threading.Event()  # never set: a bounded pause, not synchronisation
    got = []
    while True:
        try:
            got.append(net.run(timeout=WAIT)["ids"].copy())
        except EndOfInput:
            break
        if rng.random() < 0.05:
            pause.wait(0.003)
    ids = np.concatenate(got)
    np.testing.assert_array_equal(ids, np.concatenate(plan.issued))
    assert [len(g) for g in got[:-1]] == [16] * (len(got) - 1)
    assert sample(gc, "blobfeed_batches_total", source="train", net="n") == len(got)
    direct = sample(gc, "blobfeed_consumer_assembled_batches_total", source="train", net="n")
    assert 0 < direct < len(got), "both the enqueuer and the net's thread should have assembled batches"


def test_batches_the_user_holds_are_never_overwritten(gc: blobfeed.GlobalCoordinator) -> None:
    """No buffer reuse may alias a batch still referenced by the caller,
    whichever thread assembled it."""
    rng = np.random.default_rng(7)
    plan = ChunkPlan({0: [int(x) for x in rng.integers(1, 40, size=200)], 1: [int(x) for x in rng.integers(1, 40, size=200)]})
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], plan, 24, device_queue_capacity=2, coordinator=gc)
    gc.start()
    held, snapshots = [], []
    while True:
        try:
            out = net.run(timeout=WAIT)
        except EndOfInput:
            break
        held.append(out)  # no copy: the very arrays blobfeed handed out
        snapshots.append({k: v.copy() for k, v in out.items()})
    for kept, snap in zip(held, snapshots):
        np.testing.assert_array_equal(kept["ids"], snap["ids"])
        np.testing.assert_array_equal(kept["feat"], snap["feat"])
    ids = np.concatenate([h["ids"] for h in held])
    assert len(ids) == plan.total == len(np.unique(ids))


def test_big_batches_assembled_outside_the_lock_keep_order_and_accounting() -> None:
    """Batches of >= 1 MiB are copied by the enqueuer outside the feed's lock
    (so the net never waits a whole copy for the lock): they still come in
    order, exactly once, and a stop at any point loses no sample from the
    accounting."""
    from tests.helpers import sample

    row = 20_000  # float32: 80 kB per sample, 2.5 MB per batch of 32
    for stop_after in (0, 1, 3, 7):
        gc = blobfeed.GlobalCoordinator()
        counter = {0: 0, 1: 0}

        def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
            i = counter[worker_id] = counter[worker_id] + 1
            n = 5 + (i * 7 + worker_id) % 20
            ids = (np.arange(n, dtype=np.int64) + i * 1000) * 10 + worker_id
            return [ids, np.repeat(ids.astype(np.float32)[:, None], row, axis=1)]

        net = blobfeed.Net(name="n")
        blobfeed.init_data_input_workers(net, ["ids", "data"], fetch, 32, coordinator=gc)
        gc.start()
        seen: dict[int, int] = {}
        for _ in range(stop_after):
            out = net.run(timeout=10)
            ids = out["ids"]
            assert len(ids) == 32
            np.testing.assert_array_equal(out["data"][:, 0], ids.astype(np.float32))
            np.testing.assert_array_equal(out["data"][:, -1], ids.astype(np.float32))
            for v in ids:  # within a worker, ids only grow
                w = int(v) % 10
                assert seen.get(w, -1) < int(v), (w, v)
                seen[w] = int(v)
        assert gc.stop(timeout=10) is True
        fetched = sample(gc, "blobfeed_fetched_samples_total", source="train")
        delivered = sample(gc, "blobfeed_delivered_samples_total", source="train", net="n")
        dropped = sum(
            sample(gc, "blobfeed_dropped_samples_total", source="train", reason=r)
            for r in ("drop_last", "stopped", "error")
        )
        assert delivered == 32 * stop_after
        assert fetched == delivered + dropped, (stop_after, fetched, delivered, dropped)


def test_dont_rebatch_holds_for_big_batches() -> None:
    """Trap (review): batches of >= 1 MiB took the enqueuer's outside-the-lock
    path, which cut batch_size samples whatever dont_rebatch said."""
    sizes = iter([100, 30, 100, 7])

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        n = next(sizes)  # StopIteration ends the worker
        return [np.zeros((n, 4096), np.float32)]  # 16 KiB per sample

    gc = blobfeed.GlobalCoordinator()
    net = blobfeed.Net(name="n")
    blobfeed.init_data_input_workers(net, ["x"], fetch, 64, num_worker_threads=1,
                                     dont_rebatch=True, coordinator=gc)
    gc.start()
    got = []
    try:
        while True:
            try:
                got.append(len(net.run(timeout=10)["x"]))
            except blobfeed.EndOfInput:
                break
    finally:
        assert gc.stop(timeout=10) is True
    assert got == [100, 30, 100, 7]
