"""Ray actors as workers (``blobfeed.ray.RayBackend``): docs/CONTRACT.md,
"Fetcher backends", on a real local Ray cluster of several simulated nodes.

The session's one cluster (``ray_cluster`` in tests/conftest.py,
``ray.cluster_utils.Cluster``: a head with no CPUs, so every actor runs on a
worker node, and two worker nodes of 2 CPUs, the first with a "spot"; a
third node is added and removed by the test that loses it).  Actors ask
for a quarter of a CPU: the fetchers here sleep or do little, and a 2-core
CI machine must hold them.  The simulated nodes share this machine, so the
fetchers signal the tests through files, as in tests/test_processes.py.

In CI (``CI=true``) a missing ``ray`` is a failure, not a skip.

Exactly once, exact batches, ``drop_last``, errors within a second, stop,
the accounts, the same batches as threads and resume run on Ray in
tests/contract (on the modes its tests name); here is what is Ray's own:
actors, nodes, restarts, bundles and the object store's views.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

if os.environ.get("CI") == "true":
    import ray  # the extra is installed by .ci/run: its absence is a failure
else:
    ray = pytest.importorskip("ray")

import blobfeed
from blobfeed import EndOfInput, FetcherError, Net, get_worker_info, init_data_input_workers
from blobfeed.ray import RayBackend

from . import test_determinism as det
from . import test_epochs as ep
from .helpers import drain, sample, wait_until
from .test_processes import (
    SHM_ROWS,
    WIDE,
    WORKER_SPAN,
    Dier,
    Endless,
    LockedFetcher,
    LockedInit,
    Plan,
    Raiser,
    Stuck,
    TwoArgError,
    accounts,
    assert_exactly_once_in_order,
    assert_identity_at_rest,
    check_batches,
    expected_chunks,
    info_fetch,
    make_chunk,
    notes_and_message,
    record_init,
    until_error,
    wait_file,
    worker_infos,
)

SRC = "train"
#: the bound of every wait here (an actor's first start on a loaded 2-core machine takes ~1-2 s)
WAIT = 20.0
#: what every test's actors ask for
ACTOR = {"num_cpus": 0.25}


def backend(**kw: Any) -> RayBackend:
    opts = dict(ACTOR)
    opts.update(kw.pop("actor_options", {}))
    return RayBackend(actor_options=opts, **kw)


@pytest.fixture
def cluster(ray_cluster: Any) -> Any:
    """The session's cluster (tests/conftest.py), its first actors already started."""
    return ray_cluster


@pytest.fixture
def gc(cluster: Any) -> Iterator[blobfeed.GlobalCoordinator]:
    coordinator = blobfeed.GlobalCoordinator(log_interval=0.05)
    try:
        yield coordinator
    finally:
        assert coordinator.stop(timeout=WAIT), "a thread outlived stop()"


def live_actors() -> list[dict[str, Any]]:
    """Actors of this job Ray does not count as dead."""
    from ray._private import state

    return [a for a in state.actors().values() if a.get("State") != "DEAD"]


def _all_references_held() -> dict[bytes, Any]:
    core = ray._private.worker.global_worker.core_worker
    return {k: v for k, v in core.get_all_reference_counts().items() if v.get("local") or v.get("submitted")}


#: what this process held when the running test started (see :func:`_references_before`)
_HELD_BEFORE: set[bytes] = set()


@pytest.fixture(autouse=True)
def _references_before() -> Iterator[None]:
    """The references held when a test starts: an earlier test's objects
    that wait for a garbage collection (a reference cycle in Ray's or the
    test's frames) are not this test's leak.  CI once failed this file's
    leak check on them, after the Ray tests of tests/service and
    tests/contract had run in the same process."""
    _HELD_BEFORE.clear()
    if ray.is_initialized():
        _HELD_BEFORE.update(_all_references_held())
    yield


def references_held() -> dict[bytes, Any]:
    """Objects this process (the owner of every object of the pipeline's
    streams) took references to during the running test and still holds:
    none, and Ray has freed them."""
    return {k: v for k, v in _all_references_held().items() if k not in _HELD_BEFORE}


def cluster_at_rest() -> bool:
    free, total = ray.available_resources(), ray.cluster_resources()
    return free.get("CPU") == total.get("CPU") and not live_actors()


def assert_nothing_left() -> None:
    wait_until(cluster_at_rest, "every actor gone and its CPUs free", WAIT)
    try:
        wait_until(lambda: not references_held(), "no object of the pipeline left referenced", WAIT)
    except AssertionError:
        held = references_held()
        import gc

        gc.collect()
        raise AssertionError(f"still referenced after {WAIT} s: {held}; after a garbage collection: "
                             f"{references_held()}") from None


# ---------------------------------------------------------------------------------------------
# fetchers (module level: the actors import them)
# ---------------------------------------------------------------------------------------------
class HintEcho:
    """Chunks of ``batch_size`` samples (the hint), ``calls`` of them."""

    def __init__(self, calls: int) -> None:
        self.calls = calls
        self.n = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if self.n >= self.calls:
            raise StopIteration
        self.n += 1
        return make_chunk(worker_id, self.n, batch_size, 2)


class Restartable:
    """Worker index 0 dies (``os._exit``) at call ``die_at``, once: the
    marker file says it already did.  ``stateful``: with
    ``state_dict``/``load_state_dict`` (its position), else replayed.
    ``calls`` chunks of ``rows`` samples per worker, then StopIteration."""

    def __init__(self, calls: int, rows: int, die_at: int, marker: str, loads: str) -> None:
        self.calls, self.rows, self.die_at, self.marker, self.loads = calls, rows, die_at, marker, loads
        self.n = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        info = get_worker_info()
        assert info is not None
        if self.n >= self.calls:
            raise StopIteration
        if info.index == 0 and self.n == self.die_at and not os.path.exists(self.marker):
            Path(self.marker).write_text(f"{time.time()!r} {os.getpid()}")
            os._exit(3)
        k, self.n = self.n, self.n + 1
        return make_chunk(worker_id, k, self.rows)


class StatefulRestartable(Restartable):
    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        with open(self.loads, "a") as f:
            f.write(f"{state['n']}\n")
        self.n = state["n"]


# ---------------------------------------------------------------------------------------------
# worker info, hint, read-only batches (exactly once, order: tests/contract)
# ---------------------------------------------------------------------------------------------
def test_worker_info_and_worker_init_fun_run_in_the_actor(cluster: Any) -> None:
    """The same WorkerInfo (seed, rng draws) as a thread; worker_init_fun ran
    in the actor's own process, which is not this one."""
    ours = worker_infos("threads")
    theirs = worker_infos(backend(), WAIT)
    np.testing.assert_array_equal(theirs[:, :7], ours[:, :7])
    assert (theirs[:, 8] == 1).all(), "worker_init_fun did not run in the actor that fetched"
    assert not (theirs[:, 9] == os.getpid()).any()


def test_the_batch_size_hint_reaches_the_actor(gc: blobfeed.GlobalCoordinator) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], HintEcho(5), 24, num_worker_threads=2, backend=backend(),
                            coordinator=gc)
    gc.start()
    batches = drain(net, WAIT)
    assert [len(b["ids"]) for b in batches] == [24] * 10


def test_a_state_saved_on_threads_resumes_on_ray(cluster: Any) -> None:
    """A stateful fetcher's state, saved with threads, loaded in the actors:
    the uninterrupted batches.  (Saved and resumed on Ray, replayed and
    stateful: tests/contract/test_det_resume.py.)"""
    plan = {0: 6, 1: 3, 2: 5}

    def make() -> det.Fetch:
        return det.StatefulFetch(plan, salt=41, delay_seed=det.new_delay_seed(), none_at={(2, 0)}, width=256)

    want, _ = det.expected(make(), 3, 7)
    first = det.pipeline(make(), take=3, save=True, workers=(3,), bs=7, backend="threads")
    assert first.state is not None
    second = det.pipeline(make(), load=first.state, workers=(3,), bs=7, backend=backend())
    det.assert_ended(second, "resumed on ray")
    det.assert_batches(first.got[0] + second.got[0], want, "threads -> ray, stateful")


def test_epochs_on_ray_are_the_rules_stream(cluster: Any) -> None:
    fetch = ep.EpochFetch(ep.LENGTHS, salt=1)
    with ep.Pipeline(fetch, backend=backend(), epochs=3) as p:
        p.gc.start()
        got = p.drain()
    ep.assert_events(got, ep.expected(fetch, [0, 1, 2], 5, 3), "ray")


@pytest.mark.parametrize("stateful", [False, True], ids=["replayed", "stateful"])
def test_resume_on_ray_across_an_epoch_end(cluster: Any, stateful: bool) -> None:
    def factory() -> Any:
        return ep.StatefulEpochFetch(ep.LENGTHS, salt=9) if stateful else ep.EpochFetch(ep.LENGTHS, salt=9)

    want = ep.expected(factory(), [0, 1, 2], 5, 3)
    cut = next(i for i, ev in enumerate(want) if ev[0] == "end")  # just before the end
    before, after = ep.resumed(factory, cut + 1, backend=backend())
    ep.assert_events(before + after, want, f"ray stateful={stateful}")


def test_batches_from_ray_are_read_only_views_and_bounded(gc: blobfeed.GlobalCoordinator) -> None:
    """A batch inside a big chunk is a read-only view of the object store
    (writing raises numpy's read-only error); kept batches never stall the
    workers nor pin more than ``max_pinned - 2`` bundles each; and through
    these views each worker's samples come exactly once, in the order it
    returned them."""
    rows, batch_size = 999, 128  # 999 x 264 B = 258 KiB a chunk: zero-copy (rows < STEP_SPAN: ids unique)
    be = backend(max_pinned=4, bundle_bytes=64 * 1024)
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], Endless(rows), batch_size, num_worker_threads=2,
                            backend=be, max_buffered_batches=4, coordinator=gc)
    gc.start()
    b = net.run(timeout=WAIT)
    assert not b["feat"].flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        b["feat"][0, 0] = 1.0
    delivered = [np.array(b["ids"])]
    kept: collections.deque[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = collections.deque(maxlen=40)
    views = 0
    deadline = time.monotonic() + WAIT
    for i in range(200):
        assert time.monotonic() < deadline, f"the feed stalled after {i} batches with {len(kept)} kept"
        b = net.run(timeout=WAIT)
        views += not b["feat"].flags.owndata and b["feat"].base is not None and b["feat"].base.nbytes >= rows * 8
        kept.append((b, {k: np.array(v) for k, v in b.items()}))
        delivered.append(np.array(b["ids"]))
    for got, copy in kept:
        for k in copy:
            np.testing.assert_array_equal(got[k], copy[k])
    assert views > 0, "no batch was a view of a chunk: the test proves nothing"
    check_batches([c for _, c in kept], batch_size, partial_last=False)
    # per worker, what came is a prefix of what it returned: none twice, none lost, in order
    ids = np.concatenate(delivered)
    for wid in gc.get_worker_ids():
        mine = ids[ids // WORKER_SPAN == wid]
        if not len(mine):
            continue  # a worker whose actor started late may have given none of these batches: a prefix too
        steps = -(-len(mine) // rows)
        want = np.concatenate([make_chunk(wid, step, rows, 2)[0] for step in range(steps)])[:len(mine)]
        np.testing.assert_array_equal(mine, want, err_msg=f"worker {wid}'s samples through zero-copy views")


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def test_unpicklable_fetch_fun_is_a_type_error_before_anything_starts(gc: blobfeed.GlobalCoordinator) -> None:
    net = Net(name="n")
    with pytest.raises(TypeError, match=r"fetch_fun .*LockedFetcher.*Ray actor") as info:
        init_data_input_workers(net, ["ids", "feat"], LockedFetcher(), 4, backend=backend(), coordinator=gc)
    assert "lock" in str(info.value)
    with pytest.raises(TypeError, match=r"worker_init_fun .*Ray actor"):
        init_data_input_workers(net, ["ids", "feat"], Endless(4, 2), 4, backend=backend(), coordinator=gc,
                                worker_init_fun=LockedInit())
    assert gc.get_worker_ids() == []


def test_exception_reaches_run_as_the_original_object(gc: blobfeed.GlobalCoordinator, tmp_path: Path) -> None:
    stamp = tmp_path / "stamp"
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], Raiser("two-arg", 3, str(stamp)), 4, num_worker_threads=1,
                            backend=backend(), coordinator=gc)
    gc.start()
    err, _ = until_error(net, time.monotonic() + WAIT)
    delay = time.time() - float(wait_file(stamp))
    assert isinstance(err, FetcherError), err
    assert delay < 1.0, f"the error reached run() {delay:.2f} s after it was raised"
    cause = err.__cause__
    assert type(cause) is TwoArgError and (cause.path, cause.code) == ("/data/shard-7", 7)
    text = notes_and_message(err)
    assert "traceback in the worker (ray)" in text and "in __call__" in text and "raise TwoArgError" in text, text


def test_a_bundle_the_receiver_cannot_take_fails_the_source_at_once(
    gc: blobfeed.GlobalCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever goes wrong while the receiver takes a bundle (one it cannot
    make sense of, or a bug of blobfeed's) fails the source with a
    FetcherError naming the worker, never a dead receiver and a consumer
    waiting for its timeout."""
    from blobfeed.feeders import ray_backend

    def broken(self: Any, bundle: Any) -> None:
        raise RuntimeError("a bundle this receiver cannot take")

    monkeypatch.setattr(ray_backend._Worker, "_handle", broken)
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], Endless(4, 2), 4, num_worker_threads=1, backend=backend(),
                            coordinator=gc, timeout=WAIT)
    gc.start()
    err, _ = until_error(net, time.monotonic() + WAIT)
    assert isinstance(err, FetcherError) and "cannot take" in str(err), err
    assert "worker" in str(err)
    # the error the caller keeps (and its cause, with its traceback) keeps
    # none of the stream's objects alive
    assert gc.stop(timeout=WAIT)
    del net
    assert_nothing_left()
    assert "a bundle this receiver cannot take" in "".join(traceback.format_exception(err.__cause__))


def test_a_worker_init_fun_error_is_fatal(gc: blobfeed.GlobalCoordinator) -> None:
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], Endless(4, 2), 4, num_worker_threads=1, backend=backend(),
                            coordinator=gc, worker_init_fun=failing_init, on_error="skip")
    gc.start()
    err, _ = until_error(net, time.monotonic() + WAIT)
    assert isinstance(err, FetcherError) and "starting the worker failed" in str(err)
    assert isinstance(err.__cause__, ZeroDivisionError)


def failing_init(worker_id: int) -> None:
    1 / 0


# ---------------------------------------------------------------------------------------------
# deaths, lost nodes, restarts
# ---------------------------------------------------------------------------------------------
def test_a_dead_actor_is_a_fetcher_error_naming_worker_and_node(gc: blobfeed.GlobalCoordinator,
                                                                tmp_path: Path) -> None:
    stamp = tmp_path / "stamp"
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat", "pid"], Dier("exit3", 4, str(stamp), rows=8), 8,
                            num_worker_threads=2, backend=backend(), coordinator=gc)
    gc.start()
    w0 = gc.get_worker_ids()[0]
    err, _ = until_error(net, time.monotonic() + WAIT, pace=0.01)
    died_at, pid = wait_file(stamp).split()
    delay = time.time() - float(died_at)
    assert isinstance(err, FetcherError), err
    assert delay < 1.0, f"the death reached run() after {delay:.2f} s"
    text = str(err)
    assert f"worker {w0} died" in text and f"pid {pid}" in text and "on node " in text, text
    assert sample(gc, "blobfeed_worker_deaths_total", source=SRC, backend="ray") == 1
    assert_identity_at_rest(gc, [net])


def test_a_lost_node_is_a_fetcher_error_within_5_s_the_others_flowing(cluster: Any, tmp_path: Path) -> None:
    """Two actors, one per node that has a "spot": the node of worker 0 is
    removed mid-stream.  Until then, and while it goes, the other worker's
    batches keep coming; the error names the worker and the lost node."""
    node = cluster.add_node(num_cpus=1, resources={"spot": 1})
    cluster.wait_for_nodes()
    gc = blobfeed.GlobalCoordinator()
    try:
        net = Net(name="n")
        init_data_input_workers(net, ["ids", "feat", "pid"], PidRows(), 4, num_worker_threads=2,
                                backend=backend(actor_options={"resources": {"spot": 1}}), coordinator=gc)
        gc.start()
        seen: dict[int, int] = collections.Counter()
        deadline = time.monotonic() + WAIT
        while len(seen) < 2:
            assert time.monotonic() < deadline, f"both workers never delivered: {seen}"
            seen.update(net.run(timeout=WAIT)["pid"].tolist())
        lost = node.node_id
        t0 = time.monotonic()
        cluster.remove_node(node)
        err, n = until_error(net, time.monotonic() + WAIT)
        took = time.monotonic() - t0
        assert isinstance(err, FetcherError), err
        assert took < 5.0, f"the lost node reached run() after {took:.2f} s"
        text = str(err)
        assert "died" in text and lost[:12] in text, text
        assert sample(gc, "blobfeed_worker_deaths_total", source=SRC, backend="ray") == 1
        assert_identity_at_rest(gc, [net])
    finally:
        assert gc.stop(timeout=WAIT)
    del net  # its workspace keeps the last batch
    try:
        assert_nothing_left()
    except AssertionError:
        raise AssertionError(f"still referenced: {references_held()}") from None


class PidRows:
    """Chunks of 4 samples every 5 ms, with the pid (a third blob)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        time.sleep(0.005)
        self.n += 1
        return [*make_chunk(worker_id, self.n % 1000, 4, 2), np.full(4, os.getpid(), np.int64)]


def test_a_stuck_actor_does_not_hold_up_the_others(gc: blobfeed.GlobalCoordinator, tmp_path: Path) -> None:
    """Worker 0 never returns from fetch_fun: worker 1's batches still flow."""
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], Stuck(str(tmp_path / "pid")), 4, num_worker_threads=2,
                            backend=backend(), coordinator=gc, max_buffered_batches=2)
    gc.start()
    w1 = gc.get_worker_ids()[1]
    wait_file(tmp_path / "pid", WAIT)
    for _ in range(50):
        b = net.run(timeout=WAIT)
        assert (b["feat"][:, 1] == w1).all()


@pytest.mark.parametrize("cls", [StatefulRestartable, Restartable], ids=["stateful", "replayed"])
def test_a_restarted_actor_resumes_exactly_once(gc: blobfeed.GlobalCoordinator, tmp_path: Path,
                                                cls: type[Restartable]) -> None:
    marker, loads = tmp_path / "died", tmp_path / "loads"
    calls, rows, die_at = 30, 50, 12
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], cls(calls, rows, die_at, str(marker), str(loads)), 16,
                            num_worker_threads=2, backend=backend(max_restarts=1, bundle_bytes=16 * 1024),
                            coordinator=gc, max_buffered_batches=2)
    gc.start()
    batches = drain(net, WAIT)
    assert marker.exists(), "the worker never died: the test proves nothing"
    ids = check_batches(batches, 16, partial_last=True)
    sizes = [[rows] * calls, [rows] * calls]
    assert_exactly_once_in_order(ids, expected_chunks(sizes, gc.get_worker_ids()))
    assert sample(gc, "blobfeed_worker_deaths_total", source=SRC, backend="ray") == 1
    if cls is StatefulRestartable:
        # restored from the state of the last chunk delivered, not replayed
        restored = [int(x) for x in loads.read_text().split()]
        assert len(restored) == 1 and 0 < restored[0] <= die_at, restored
    assert_identity_at_rest(gc, [net])


# ---------------------------------------------------------------------------------------------
# stop, and nothing left behind
# ---------------------------------------------------------------------------------------------
def test_stop_with_an_actor_stuck_in_fetch_fun_leaves_nothing(cluster: Any, tmp_path: Path) -> None:
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], Stuck(str(tmp_path / "pid")), 4, num_worker_threads=2,
                            backend=backend(), coordinator=gc)
    # and a second source whose big chunks (object-store objects) sit in its queues
    big = Net(name="big")
    init_data_input_workers(big, ["ids", "feat"], Endless(SHM_ROWS * 8, WIDE), 32, num_worker_threads=1,
                            input_source_name="big", backend=backend(), coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)  # the other worker delivers
    big.run(timeout=WAIT)
    wait_file(tmp_path / "pid", WAIT)
    t0 = time.monotonic()
    assert gc.stop(timeout=WAIT) is True
    took = time.monotonic() - t0
    assert took < 2.0, f"stop() took {took:.2f} s"
    assert sample(gc, "blobfeed_worker_deaths_total", source=SRC, backend="ray") == 0
    del net, big
    assert_nothing_left()


def test_a_finished_source_releases_its_actors(gc: blobfeed.GlobalCoordinator) -> None:
    """Actors that are done are killed at once, not at stop(): their CPUs return."""
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], Plan([[3, 2], [4]], 2), 4, num_worker_threads=2,
                            backend=backend(), coordinator=gc)
    gc.start()
    assert sum(len(b["ids"]) for b in drain(net, WAIT)) == 9
    wait_until(cluster_at_rest, "the actors of a finished source to be gone", WAIT)


def test_ray_missing_in_ci_is_a_failure_not_a_skip() -> None:
    """The module imports ray unconditionally when CI=true (see its top)."""
    if os.environ.get("CI") == "true":
        assert "ray" in sys.modules


# ---------------------------------------------------------------------------------------------
# random-access sources (issue 26): the same stream on actors, an actor restarted by Ray
# ---------------------------------------------------------------------------------------------
def test_a_random_access_source_on_ray_gives_the_stream_of_threads(cluster: Any) -> None:
    from . import test_indexed as ix

    want = ix.reference(29, 4, 2)
    with ix.Pipeline(ix.Items(29), 2, 3, backend=backend()) as p:
        got = p.lockstep()
    ix.assert_stream(got, want, "ray, 3 actors, 2 nets")


def test_a_restarted_actor_of_a_random_access_source_reads_its_units_again(cluster: Any, tmp_path: Path) -> None:
    from . import test_indexed as ix

    n, bs = 40, 4
    want = ix.reference(n, bs, 2)
    at = int(np.random.default_rng((ix.SEED, 0)).permutation(n)[13])
    with ix.Pipeline(ix.Killer(n, at=at, marks=str(tmp_path)), 1, 2, bs=bs,
                     backend=backend(max_restarts=1)) as p:
        got = p.lockstep()
        assert sample(p.gc, "blobfeed_worker_deaths_total", source=SRC, backend="ray") == 1
    assert len(list(tmp_path.iterdir())) == 1, "one actor was killed"
    ix.assert_stream(got, want, "ray, an actor killed and restarted")


# ---------------------------------------------------------------------------------------------
# the worker count changed while it runs (issue 27): actors added and removed
# ---------------------------------------------------------------------------------------------
def test_actors_are_added_and_removed_while_a_fetch_fun_source_runs(cluster: Any, tmp_path: Path) -> None:
    """set_num_workers on Ray, 1 -> 3 -> 1 actors of a fetch_fun source in
    arrival order: every chunk an actor made arrives exactly once (a removed
    actor's last ones too), the removed actors are gone, the source still
    ends when the remaining one finishes; ``num_worker_threads="auto"`` is
    accepted on Ray."""
    from .test_autotune import Counted

    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "x"], Counted(str(tmp_path), delay=0.01), 4, num_worker_threads=1,
                            coordinator=gc, backend=backend(), max_buffered_batches=8, seed=1)
    got: list[int] = []

    def take(k: int) -> None:
        for _ in range(k):
            got.extend(int(i) for i in net.run(timeout=WAIT)["ids"])

    try:
        gc.start()
        take(3)
        gc.set_num_workers(SRC, 3)
        assert gc.num_workers(SRC) == 3
        deadline = time.monotonic() + WAIT
        while {i // 1_000_000 for i in got} != {0, 1, 2}:
            assert time.monotonic() < deadline, f"the new actors' chunks never came: {sorted(set(got))[:20]}"
            take(1)
        gc.set_num_workers(SRC, 1)
        wait_until(lambda: gc._sources[SRC].workers_alive() == 1, "the removed actors' end", timeout=WAIT)
        take(5)
        (tmp_path / "stop").touch()
        while True:
            try:
                take(1)
            except EndOfInput:
                break
    finally:
        assert gc.stop(timeout=WAIT), "a thread outlived stop()"
    made = {int(p.name): int(p.read_text()) for p in tmp_path.iterdir() if p.name.isdigit()}
    assert set(made) == {0, 1, 2}
    per_worker: dict[int, list[int]] = {}
    for i in got[::2]:  # two rows per chunk, the same id
        per_worker.setdefault(i // 1_000_000, []).append(i % 1_000_000)
    for wid, calls in made.items():
        assert per_worker.get(wid) == list(range(calls)), f"actor {wid}: made {calls} chunks"
    assert_nothing_left()
    # the tuner runs there too: actors that wait (10 ms a call) are added while the net waits
    (tmp_path / "stop").unlink()
    gc2 = blobfeed.GlobalCoordinator()
    net2 = Net(name="a")
    init_data_input_workers(net2, ["ids", "x"], Counted(str(tmp_path), delay=0.01), 4, num_worker_threads="auto",
                            coordinator=gc2, backend=backend())
    try:
        gc2.start()
        deadline = time.monotonic() + WAIT
        while gc2.num_workers(SRC) < 2:
            assert time.monotonic() < deadline, "the tuner added no actor"
            net2.run(timeout=WAIT)
    finally:
        assert gc2.stop(timeout=WAIT), "a thread outlived stop()"
    assert_nothing_left()


def test_actors_of_a_random_access_source_are_added_and_removed_keeping_the_stream(cluster: Any) -> None:
    from . import test_indexed as ix

    n, bs = 60, 3
    want = ix.reference(n, bs, 2)
    with ix.Pipeline(ix.Items(n, delay=0.001), 2, 1, bs=bs, backend=backend()) as p:
        got = p.lockstep(limit=6)
        p.gc.set_num_workers(SRC, 3)
        more = p.lockstep(limit=10)
        p.gc.set_num_workers(SRC, 1)
        rest = p.lockstep()
    for j in range(2):
        got[j] += more[j] + rest[j]
    ix.assert_stream(got, want, "ray: 1 -> 3 -> 1 actors")
    assert_nothing_left()
