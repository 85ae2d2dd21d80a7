"""The dealing seam (blobfeed/feeders/dealing): how a source's chunks reach
its nets.

Two parts: the dealers on their own (the factory's choice, what each reports
it holds, close, load, a lock-free state), and, through the public API, the
defects an adversarial review found in the ordered modes (each of these
failed before the dealers owned their accounting): the accounting identity
mid-run, after a stop and after a resume; a shuffle buffer on worker
processes; loading a state twice; ``state_dict`` from a signal handler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfEpoch, EndOfInput, Net, init_data_input_workers
from blobfeed.feeders.chunks import Chunk
from blobfeed.feeders.dealing import (
    ArrivalDealer,
    DealingOptions,
    LaneDealer,
    make_dealer,
)
from blobfeed.feeders.shuffle import ShuffleBuffer

from .helpers import WAIT, drain, drain_in_threads, sample, wait_until

ROOT = Path(__file__).resolve().parent.parent
SRC = "train"


# ---------------------------------------------------------------------------------------------
# the dealers on their own
# ---------------------------------------------------------------------------------------------
def chunk(wid: int, seq: int, n: int) -> Chunk:
    ids = np.arange(n, dtype=np.int64) + 1000 * wid + 100 * seq
    return Chunk((ids,), n, wid, seq)


def make(options: DealingOptions, *, batch_size: int = 4, capacity: int = 64) -> Any:
    errors: list[BaseException] = []
    dropped: list[tuple[str, int]] = []
    dealer = make_dealer(
        "s", options, batch_size=batch_size, axes=[0], capacity=capacity,
        shuffle_rng=lambda: np.random.default_rng(0), on_error=errors.append,
        on_error_in_order=errors.append, on_dropped=lambda r, n: dropped.append((r, n)),
    )
    dealer.errors, dealer.dropped_log = errors, dropped
    return dealer


@pytest.mark.parametrize("options, kind", [
    (DealingOptions(), ArrivalDealer),
    (DealingOptions(deterministic=True), LaneDealer),
    (DealingOptions(shuffle_buffer=8), LaneDealer),
    (DealingOptions(epochs=2), LaneDealer),
    (DealingOptions(epochs=None), LaneDealer),
])
def test_the_factory_chooses_once_from_the_wiring_arguments(options: DealingOptions, kind: type) -> None:
    dealer = make(options)
    assert isinstance(dealer, kind)
    # what the rest of the pipeline may ask: a fixed batch size and resumability
    assert (dealer.batch_size is not None) == (kind is LaneDealer)
    assert dealer.resumable == options.deterministic


def test_the_turn_policies_differ_only_at_an_empty_lane() -> None:
    """Strict turns stop at the empty lane whose turn it is (that worker is
    waited for); first-ready turns pass it over to the next lane that has
    something.  Both pass over a lane that ended in this epoch."""
    from blobfeed.feeders.dealing import FirstReadyTurns, StrictTurns

    lanes: dict[int, Any] = {0: [], 1: ["chunk"], 2: ["chunk"]}
    for policy, expected in ((StrictTurns(), 0), (FirstReadyTurns(), 1)):
        for wid in lanes:
            policy.add(wid)
        assert policy.turn(lanes) == expected and policy.ready(lanes) == (expected == 1)
        policy.lane_ended(expected, for_good=False)
        assert policy.turn(lanes) in (1, 2) and not policy.all_ended()
        policy.next_epoch()
        assert policy.rr == 0 and not policy.ended


def test_an_equal_round_goes_out_whole_or_not_at_all() -> None:
    """EqualRounds alone: pieces wait until their round is complete; at an
    epoch's end an incomplete round is dropped and counted, and the batch
    count goes back to the round's start; one net gets no rounds at all."""
    from blobfeed.feeders.dealing import Direct, EqualRounds

    class Box:
        def __init__(self) -> None:
            self.pieces: list[Chunk] = []
            self.samples = self.skip_until = 0

    dropped: list[tuple[str, int]] = []
    assert type(EqualRounds().wire("s", [Box()], dropped.append)) is Direct
    boxes = [Box(), Box()]
    rounds = EqualRounds().wire("s", boxes, lambda reason, n: dropped.append((reason, n)))
    piece = Chunk((np.arange(2),), 2, 0, 0)
    for batch in range(3):
        rounds.deal(batch, piece)
        rounds.batch_done(batch + 1)
    assert [len(b.pieces) for b in boxes] == [1, 1] and rounds.held == 2
    notes: list[Any] = []
    assert rounds.settle(3, False, 0, notes) == 2
    assert dropped == [("equal", 2)] and rounds.held == 0 and len(notes) == 1


@pytest.mark.parametrize("options", [
    DealingOptions(), DealingOptions(deterministic=True), DealingOptions(shuffle_buffer=6),
    DealingOptions(deterministic=True, shuffle_buffer=6),
], ids=["arrival", "lanes", "shuffle", "lanes+shuffle"])
def test_a_dealer_holds_what_it_took_until_a_reader_takes_it(options: DealingOptions) -> None:
    """held == put - taken at every step, and close() gives back exactly the rest."""
    dealer = make(options, batch_size=4)
    dealer.add_lanes([0, 1])
    reader = dealer.add_net()
    dealer.start()
    put = 0
    for seq in range(3):
        for wid in (0, 1):
            assert dealer.sink(wid)(chunk(wid, seq, 3))
            put += 3
    assert dealer.stats().held_samples == put
    assert dealer.stats().depth >= 1
    taken = 0
    for _ in range(2):
        ok, piece = reader.get_nowait()
        assert ok and piece is not None
        taken += piece.n
        assert dealer.stats().held_samples == put - taken
    lost = dealer.close(EndOfInput("stopped"))
    assert lost == put - taken
    assert dealer.stats().held_samples == 0
    assert dealer.close(EndOfInput("again")) == 0, "a second close discarded something again"
    with pytest.raises(EndOfInput):
        reader.get_nowait()


def test_lanes_count_a_half_dealt_head_chunk_once() -> None:
    """Two nets: the head chunk is cut; its dealt part is in an outbox, its
    rest in the lane: together exactly the chunk."""
    dealer = make(DealingOptions(deterministic=True), batch_size=4)
    dealer.add_lanes([0])
    a, b = dealer.add_net(), dealer.add_net()
    dealer.start()
    dealer.sink(0)(chunk(0, 0, 10))
    ok, piece = a.get_nowait()
    assert ok and piece.n == 4
    stats = dealer.stats()
    assert stats.held_samples == 6, stats
    assert dealer.close(EndOfInput("stopped")) == 6


def test_the_shuffle_stage_lets_go_of_shared_memory_when_it_takes_a_chunk() -> None:
    """A pinned chunk (a worker's shared-memory slot) is copied out when the
    shuffle stage takes it: rows that wait there must not hold the slot.
    Its rows are big (8 KiB: held by reference unless pinned), and the
    "slot" is overwritten by the worker right after: the batches must hold
    the values it had."""

    class Slot(blobfeed.feeders.Pin):
        pass

    dealer = make(DealingOptions(shuffle_buffer=100), batch_size=4)
    dealer.add_lanes([0])
    reader = dealer.add_net()
    dealer.start()
    backing = np.repeat(np.arange(8, dtype=np.int64)[:, None], 1024, axis=1)  # 8 KiB rows
    dealer.sink(0)(Chunk((backing,), 8, 0, 0, Slot()))
    assert reader.get_nowait() == (False, None)  # taken into the buffer, not ready
    backing[:] = -1  # the worker reuses its slot
    dealer.finish(0)
    rows = np.concatenate([p.arrays[0] for p in iter_pieces(reader)])
    assert sorted(rows[:, 0].tolist()) == list(range(8))
    assert (rows == rows[:, :1]).all()


def iter_pieces(reader: Any) -> Iterator[Chunk]:
    while True:
        try:
            ok, piece = reader.get_nowait()
        except EndOfInput:
            return
        assert ok, "the stream stalled"
        yield piece


def test_lane_state_needs_no_lock() -> None:
    """state() from the thread that holds the dealer's lock (a signal handler
    that interrupted run() there) returns instead of deadlocking."""
    dealer = make(DealingOptions(deterministic=True), batch_size=2)
    dealer.add_lanes([0])
    reader = dealer.add_net()
    dealer.start()
    for seq in range(3):
        dealer.sink(0)(chunk(0, seq, 2))
    reader.get_nowait()
    reader.returned()
    got: list[dict[str, Any]] = []

    def holder() -> None:
        with dealer._lock:
            got.append(dealer.state({}, ["net"]))

    t = threading.Thread(target=holder, name="test-holder", daemon=True)
    t.start()
    t.join(WAIT)
    assert not t.is_alive(), "state() waited for the lock its own thread holds"
    assert got[0]["nets"] == [["net", 1, 0]]
    assert got[0]["position"]["batches"] == 1


def test_loading_a_state_twice_is_loading_it_once() -> None:
    dealer = make(DealingOptions(deterministic=True, epochs=2), batch_size=2)
    dealer.add_lanes([0])
    reader = dealer.add_net()
    state = {"position": {"batches": 3, "epoch": 1, "rr": 0, "offset": 0, "calls": [0], "states": [None]},
             "nets": [["net", 3, 0]]}
    first = dealer.load(state)
    assert dealer.load(state) == first
    ok, end = reader.get_nowait()
    assert ok and isinstance(end, blobfeed.feeders.EpochEnd) and end.epoch == 0
    assert reader.get_nowait() == (False, None), "the epoch's end was queued twice"


# ---------------------------------------------------------------------------------------------
# through the public API: the defects
# ---------------------------------------------------------------------------------------------
class Gated:
    """Worker w returns ``chunks`` chunks of ``n`` samples (ids unique), then
    waits on ``gate`` (bounded), then raises StopIteration.  ``parked``
    counts the workers waiting at the gate."""

    def __init__(self, chunks: int, n: int) -> None:
        self.chunks, self.n = chunks, n
        self.gate = threading.Event()
        self.parked = threading.Semaphore(0)
        self._calls: dict[int, int] = {}

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        k = self._calls.get(wid, 0)
        self._calls[wid] = k + 1
        if k == self.chunks:
            self.parked.release()
            self.gate.wait(WAIT)
            raise StopIteration
        if k > self.chunks:
            raise StopIteration
        ids = np.arange(self.n, dtype=np.int64) + wid * 1_000_000 + k * 1000
        return [ids, ids.astype(np.float32)[:, None] * np.ones((1, 2), np.float32)]


def accounts(gc: blobfeed.GlobalCoordinator) -> tuple[float, float, float, float]:
    fetched = sample(gc, "blobfeed_fetched_samples_total", source=SRC)
    delivered = sum(
        s.value for m in gc.registry.collect() if m.name == "blobfeed_delivered_samples"
        for s in m.samples if s.name.endswith("_total") and s.labels.get("source") == SRC
    )
    dropped = sum(
        s.value for m in gc.registry.collect() if m.name == "blobfeed_dropped_samples"
        for s in m.samples if s.name.endswith("_total") and s.labels.get("source") == SRC
    )
    buffered = sample(gc, "blobfeed_buffered_samples", source=SRC)
    return fetched, delivered, dropped, buffered


def balanced(gc: blobfeed.GlobalCoordinator) -> bool:
    fetched, delivered, dropped, buffered = accounts(gc)
    return fetched == delivered + dropped + buffered


MODES = {
    "deterministic": dict(deterministic=True),
    "shuffle": dict(shuffle_buffer=24),
    "deterministic+shuffle": dict(deterministic=True, shuffle_buffer=24),
    "epochs": dict(epochs=2),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_the_accounts_balance_mid_run_with_data_in_lanes_and_buffer(
    gc: blobfeed.GlobalCoordinator, mode: str
) -> None:
    """fetched == delivered + dropped + buffered while the lanes and the
    shuffle buffer hold samples (was off by what they held), and the
    internal queue depth shows the chunks in the lanes (read 0)."""
    fetch = Gated(chunks=30, n=4)
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], fetch, 4, num_worker_threads=2, coordinator=gc,
                            seed=3, **MODES[mode])
    gc.start()
    for _ in range(2):
        net.run(timeout=WAIT)
    for _ in range(2):
        assert fetch.parked.acquire(timeout=WAIT), "a worker did not reach its gate"
    # every sample is fetched; the pipeline settles (the enqueuer refills the
    # device queue only once the net emptied it, so that is no signal)
    wait_until(lambda: balanced(gc), f"the accounts to balance: {accounts(gc)}", timeout=2.0)
    fetched, delivered, dropped, buffered = accounts(gc)
    assert fetched == 240 and delivered == 8 and dropped == 0
    assert sample(gc, "blobfeed_internal_queue_depth", source=SRC) > 0
    fetch.gate.set()


@pytest.mark.parametrize("mode", ["shuffle", "deterministic+shuffle"])
def test_a_stop_counts_the_shuffle_buffer_as_dropped(gc: blobfeed.GlobalCoordinator, mode: str) -> None:
    fetch = Gated(chunks=20, n=4)
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], fetch, 4, num_worker_threads=2, coordinator=gc,
                            seed=3, **MODES[mode])
    gc.start()
    net.run(timeout=WAIT)
    for _ in range(2):
        assert fetch.parked.acquire(timeout=WAIT)
    fetch.gate.set()
    assert gc.stop(timeout=WAIT)
    fetched, delivered, dropped, buffered = accounts(gc)
    assert buffered == 0
    assert fetched == delivered + dropped, (fetched, delivered, dropped)


class Counting:
    """Worker w: ``chunks`` chunks of sizes 3, 5, 7, ... (ids unique), then StopIteration."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self._calls: dict[int, int] = {}

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        k = self._calls.get(wid, 0)
        if k >= self.chunks:
            raise StopIteration
        self._calls[wid] = k + 1
        ids = np.arange(3 + 2 * (k % 4), dtype=np.int64) + wid * 1_000_000 + k * 1000
        return [ids]


def resume_case(nets: int, shuffle: int, cut: list[int]) -> tuple[blobfeed.GlobalCoordinator, list[Any]]:
    """Run ``cut[i]`` batches on net i, save, and resume in a new pipeline drained to its end."""

    def build() -> tuple[blobfeed.GlobalCoordinator, list[Net]]:
        gc = blobfeed.GlobalCoordinator()
        ns = [Net(name=f"n{i}") for i in range(nets)]
        for n in ns:
            init_data_input_workers(n, ["ids"], Counting(12), 4, num_worker_threads=2, coordinator=gc,
                                    deterministic=True, shuffle_buffer=shuffle, seed=5,
                                    max_buffered_batches=16)
        return gc, ns

    gc, ns = build()
    gc.start()
    # in turns: the stream runs only ~2 batches ahead of its slowest net
    for step in range(max(cut)):
        for n, k in zip(ns, cut):
            if step < k:
                n.run(timeout=WAIT)
    state = json.loads(json.dumps(gc.state_dict(SRC)))
    assert gc.stop(timeout=WAIT)
    gc2, ns2 = build()
    gc2.load_state_dict(SRC, state)
    gc2.start()
    got = [b for batches in drain_in_threads(ns2).values() for b in batches]
    return gc2, got


@pytest.mark.parametrize("nets, shuffle, cut", [
    (1, 0, [3]),          # the regenerated head chunk's prefix
    (2, 0, [3, 2]),       # batches another net had already
    (1, 16, [4]),         # a shuffled source replays from its start
], ids=["head-chunk-prefix", "other-nets-batches", "shuffled-prefix"])
def test_a_resume_counts_what_it_fetched_again_and_threw_away(nets: int, shuffle: int, cut: list[int]) -> None:
    gc, _ = resume_case(nets, shuffle, cut)
    try:
        assert gc.stop(timeout=WAIT)
        fetched, delivered, dropped, buffered = accounts(gc)
        assert sample(gc, "blobfeed_dropped_samples_total", source=SRC, reason="resume") > 0
        assert fetched == delivered + dropped + buffered, (fetched, delivered, dropped, buffered)
    finally:
        gc.stop(timeout=WAIT)


def test_loading_the_same_state_twice_gives_each_epoch_end_once() -> None:
    """A state saved after epoch 0's last batch but before its EndOfEpoch,
    loaded twice before start(): EndOfEpoch(0) once, then epoch 1."""

    def build() -> tuple[blobfeed.GlobalCoordinator, Net]:
        gc = blobfeed.GlobalCoordinator()
        net = Net(name="n")
        init_data_input_workers(net, ["ids"], Counting(3), 5, num_worker_threads=2, coordinator=gc,
                                deterministic=True, epochs=2, seed=5)
        return gc, net

    gc, net = build()
    gc.start()
    per_epoch = -(-sum(3 + 2 * k for k in range(3)) * 2 // 5)
    for _ in range(per_epoch):
        net.run(timeout=WAIT)
    wait_until(lambda: gc.state_dict(SRC)["position"]["epoch"] == 1, "the stream to pass the epoch's end")
    state = gc.state_dict(SRC)
    assert state["nets"][0][2] == 0, "the net was told of the end already"
    assert gc.stop(timeout=WAIT)
    gc2, net2 = build()
    gc2.load_state_dict(SRC, state)
    gc2.load_state_dict(SRC, state)
    gc2.start()
    try:
        with pytest.raises(EndOfEpoch):
            net2.run(timeout=WAIT)
        out = net2.run(timeout=WAIT)  # epoch 1's first batch, not a second end
        assert len(out["ids"]) == 5
    finally:
        assert gc2.stop(timeout=WAIT)


# -- shuffle buffers on worker processes -------------------------------------------------------
ROW = 256  # float32 values per sample: 1 KiB; a chunk of 40-64 samples takes a slot


class BigRows:
    """``chunks`` chunks of 40-64 samples of 1 KiB (40-64 KiB: each through a
    shared-memory slot), ids unique."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.k = 0

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        if self.k >= self.chunks:
            raise StopIteration
        k, self.k = self.k, self.k + 1
        n = 40 + (7 * k) % 25
        ids = np.arange(n, dtype=np.int64) + wid * 1_000_000 + k * 1000
        return [ids, np.repeat(ids.astype(np.float32)[:, None], ROW, axis=1)]


def big_rows_ids(chunks: int) -> list[int]:
    return sorted(w * 1_000_000 + k * 1000 + i for w in (0, 1) for k in range(chunks) for i in range(40 + (7 * k) % 25))


@pytest.mark.parametrize("buffer", [64, 2000])
def test_a_shuffle_buffer_on_worker_processes_never_starves_the_slots(buffer: int) -> None:
    """Rows held by the shuffle buffer used to keep their chunks' slots:
    with 2000 the old code stalled before the first batch, every time; with
    64 it stalled only now and then (when the rows left behind happened to
    sit in every slot's chunk), so that case guards rather than reproduces."""
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], BigRows(40), 16, num_worker_threads=2, coordinator=gc,
                            backend="processes", shuffle_buffer=buffer, seed=1)
    gc.start()
    try:
        batches = drain(net, timeout=WAIT)
        got = np.concatenate([b["ids"] for b in batches])
        assert sorted(got.tolist()) == big_rows_ids(40)
        for b in batches:
            np.testing.assert_array_equal(b["feat"][:, -1], b["ids"].astype(np.float32))
    finally:
        assert gc.stop(timeout=WAIT)


def memfd_maps() -> int:
    return sum("memfd:" in line for line in Path("/proc/self/maps").read_text().splitlines())


def memfd_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return n


def test_a_stopped_shuffled_process_source_keeps_no_shared_memory_while_its_net_lives() -> None:
    before = (memfd_maps(), memfd_fds())
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, ["ids", "feat"], BigRows(400), 8, num_worker_threads=2, coordinator=gc,
                            backend="processes", shuffle_buffer=64, seed=1)
    gc.start()
    for _ in range(3):
        net.run(timeout=WAIT)
    assert gc.stop(timeout=WAIT)
    assert (memfd_maps(), memfd_fds()) == before, "shared memory kept after stop()"
    del net


# -- state_dict from a signal handler ------------------------------------------------------------
SIGNAL_SCRIPT = textwrap.dedent("""
    import signal, sys, threading
    import numpy as np
    import blobfeed
    from blobfeed import Net, init_data_input_workers

    def fetch(wid, bs):
        return [np.arange(3, dtype=np.int64)]

    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, ["ids"], fetch, 4, coordinator=gc, deterministic=True, seed=1)
    saved = []
    signal.signal(signal.SIGTERM, lambda *a: saved.append(gc.state_dict("train")))
    dealer = gc._sources["train"].dealer
    record = dealer._record
    def record_then_signal(batches):
        # the stream's lock is held here, in the main thread (run() assembling)
        record(batches)
        if not saved and threading.current_thread() is threading.main_thread():
            signal.raise_signal(signal.SIGTERM)
    dealer._record = record_then_signal
    gc.start()
    for _ in range(20000):
        net.run(timeout=5)
        if saved:
            break
    assert saved, "the handler never ran"
    print("saved", saved[0]["position"]["batches"], flush=True)
    assert gc.stop(timeout=5)
""")


def test_state_dict_in_a_sigterm_handler_that_interrupted_run_does_not_deadlock(tmp_path: Path) -> None:
    script = tmp_path / "checkpoint_on_sigterm.py"
    script.write_text(SIGNAL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("state_dict() in a SIGTERM handler deadlocked (the run() it interrupted held the stream's lock)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("saved ")


class OneStalls:
    """Worker 0 waits on ``release`` (bounded) before its first chunk;
    the others wait for ``go``, then return 8-sample chunks for ever."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.go = threading.Event()

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        self.go.wait(WAIT)
        if wid == 0:
            self.release.wait(WAIT)
        return [np.arange(8, dtype=np.int64) + 1000 * wid]


@pytest.mark.parametrize("mode", [dict(epochs=2), dict(shuffle_buffer=16)], ids=["epochs", "shuffle"])
def test_first_ready_lanes_wake_the_enqueuer_for_any_lane(gc: blobfeed.GlobalCoordinator, mode: dict) -> None:
    """Without ``deterministic``, lanes are read first-ready: a stalled worker
    must not stall the others.  The enqueuer's wait looked only at the lane
    whose turn it was, so with that worker stalled it slept and the device
    queue was filled only by run() itself (some 1 000 batches/s instead of
    80 000).  Here the enqueuer alone must fill it, before any run()."""
    fetch = OneStalls()
    net = Net(name="n")
    init_data_input_workers(net, ["ids"], fetch, 4, num_worker_threads=2, coordinator=gc, seed=1, **mode)
    gc.start()
    try:
        # the enqueuer waits for data first (both lanes empty), then worker 1's come
        dealer = gc._sources[SRC].dealer
        wait_until(lambda: bool(dealer._items._waiters), "the enqueuer to wait for data")
        fetch.go.set()
        wait_until(lambda: sample(gc, "blobfeed_device_queue_depth", source=SRC, net="n") == 4,
                   "the enqueuer to fill the device queue from the worker that is not stalled")
    finally:
        fetch.go.set()
        fetch.release.set()


class Fives:
    """Worker w returns ``chunks[w]`` chunks of 5 samples, then StopIteration."""

    def __init__(self, chunks: dict[int, int]) -> None:
        self.chunks = chunks
        self._calls: dict[int, int] = {}

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        k = self._calls.get(wid, 0)
        if k >= self.chunks[wid]:
            raise StopIteration
        self._calls[wid] = k + 1
        return [np.arange(5, dtype=np.int64) + 1000 * wid + 10 * k]


def test_a_resume_offset_into_a_chunk_that_is_gone_is_an_error_not_another_workers_samples() -> None:
    """The saved position points 3 samples into worker 1's first chunk; the
    resumed fetch_fun gives worker 1 no data any more.  The offset was then
    applied to the next lane's chunk (worker 0's): 3 of its samples silently
    gone.  Now the stream fails, naming the offset."""

    def build(fetch: Fives) -> tuple[blobfeed.GlobalCoordinator, Net]:
        gc = blobfeed.GlobalCoordinator()
        net = Net(name="n")
        init_data_input_workers(net, ["ids"], fetch, 4, num_worker_threads=2, coordinator=gc,
                                deterministic=True, seed=5)
        return gc, net

    gc, net = build(Fives({0: 3, 1: 3}))
    gc.start()
    for _ in range(2):  # [w0c0 0-3], [w0c0 4, w1c0 0-2]: the position is 3 into w1c0
        net.run(timeout=WAIT)
    state = gc.state_dict(SRC)
    assert gc.stop(timeout=WAIT)
    assert state["position"]["offset"] == 3 and state["position"]["rr"] == 1, state["position"]
    gc2, net2 = build(Fives({0: 3, 1: 0}))
    gc2.load_state_dict(SRC, state)
    gc2.start()
    try:
        with pytest.raises(blobfeed.FetcherError, match="offset"):
            while True:
                net2.run(timeout=WAIT)
    finally:
        assert gc2.stop(timeout=WAIT)


class CountsItsCalls:
    """A stateful fetcher: returns [worker id, its own call count], 3 times."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]

    def __call__(self, wid: int, bs: int) -> list[np.ndarray]:
        if self.calls == 3:
            raise StopIteration
        self.calls += 1
        return [np.array([[wid, self.calls]], np.int64)]


@pytest.mark.parametrize("mode", [{}, dict(deterministic=True)], ids=["arrival", "deterministic"])
def test_a_stateful_fetcher_is_each_workers_own_in_every_mode(gc: blobfeed.GlobalCoordinator, mode: dict) -> None:
    """The wiring does not ask the mode: each worker has its own copy of a
    stateful fetch_fun, so each counts its own calls 1, 2, 3."""
    net = Net(name="n")
    init_data_input_workers(net, ["pair"], CountsItsCalls(), 1, num_worker_threads=2, coordinator=gc,
                            seed=1, **mode)
    gc.start()
    rows = np.concatenate([b["pair"] for b in drain(net)])
    for wid in (0, 1):
        assert sorted(rows[rows[:, 0] == wid, 1].tolist()) == [1, 2, 3]
