"""Random-access sources (issue 26): a dataset with ``__len__`` and
``__getitem__`` read in an order blobfeed draws, through read units taken by
whichever worker is free and put back in order.

What is checked:

* the global batch sequence is a function of the data, seed, epoch and batch
  size only: the same on threads and processes, with 1-4 workers and 1-3
  nets, batch *i* going to net *i mod n*; it is the reference computed here
  with numpy alone;
* a slow worker does not hold the others back, and nobody runs more than the
  window ahead of the oldest unit the stream waits for;
* elastic resume: a stop at some batch, then a resume with other worker and
  net counts (and another backend) gives the rest of the uninterrupted
  stream, each sample exactly once per epoch over both runs; the same layout
  gives each net exactly its uninterrupted batches;
* a state of another length, batch size, seed or shuffle is refused naming
  the field; bad datasets fail with the source, the index and the blob.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any, Sequence

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfEpoch, EndOfInput, FetcherError, Net, RandomAccessSource, init_data_input_workers

from .helpers import wait_until

SRC = "train"
BLOBS = ["ids", "x"]
WAIT = 30.0
SEED = 7

Event = Any  # a tuple of sample ids (a batch), or ("end", epoch)


class Items:
    """A map-style dataset: sample i is (i, [i, i, i]).  Module level: it pickles."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, np.ndarray]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.delay:
            time.sleep(random.random() * self.delay)
        return np.int64(i), np.full(3, i, np.float32)


class Batched(Items):
    """With ``__getitems__`` (torch >= 2.2): counts its batched reads."""

    calls = 0

    def __getitems__(self, idx: list[int]) -> list[dict[str, Any]]:
        type(self).calls += 1
        return [{"ids": np.int64(i), "x": np.full(3, i, np.float32)} for i in idx]


def reference(n: int, bs: int, epochs: int, shuffle: bool = True, seed: int = SEED) -> list[Event]:
    """The stream, from numpy alone: each epoch's order cut into batches,
    the end of every epoch but the last."""
    out: list[Event] = []
    for e in range(epochs):
        order = np.random.default_rng((seed, e)).permutation(n) if shuffle else np.arange(n)
        out += [tuple(int(i) for i in order[s:s + bs]) for s in range(0, n, bs)]
        if e < epochs - 1:
            out.append(("end", e))
    return out


def batches_of(events: Sequence[Event]) -> list[tuple[int, ...]]:
    return [e for e in events if e[0] != "end"]


class Pipeline:
    """A fresh coordinator; one net per call, each with ``workers`` workers."""

    def __init__(self, dataset: Any, nets: int, workers: int, *, bs: int = 4, epochs: int | None = 2,
                 backend: str = "threads", shuffle: bool = True, seed: int = SEED, read_size: int | None = 3,
                 window: int | None = None, **kw: Any) -> None:
        self.gc = blobfeed.GlobalCoordinator()
        self.started = False
        self.nets = [Net(name=f"net{j}") for j in range(nets)]
        spec = RandomAccessSource(dataset, shuffle=shuffle, seed=seed, read_size=read_size, window=window)
        for net in self.nets:
            init_data_input_workers(net, BLOBS, spec, bs, num_worker_threads=workers, coordinator=self.gc,
                                    epochs=epochs, backend=backend, **kw)

    def __enter__(self) -> "Pipeline":
        return self

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.gc.start()

    def __exit__(self, *exc: object) -> None:
        assert self.gc.stop(timeout=10.0), "a thread outlived stop()"

    def next_event(self, j: int) -> Event | None:
        self.start()
        try:
            out = self.nets[j].run(timeout=WAIT)
        except EndOfEpoch as end:
            return ("end", end.epoch)
        except EndOfInput:
            return None
        ids = out["ids"]
        np.testing.assert_array_equal(out["x"], np.repeat(ids.astype(np.float32)[:, None], 3, axis=1))
        return tuple(int(i) for i in ids)

    def lockstep(self, limit: int | None = None) -> list[list[Event]]:
        """Every net in turn until each ended, or ``limit`` events in all."""
        got: list[list[Event]] = [[] for _ in self.nets]
        live = list(range(len(self.nets)))
        steps = 0
        while live:
            for j in list(live):
                if limit is not None and steps >= limit:
                    return got
                ev = self.next_event(j)
                steps += 1
                if ev is None:
                    live.remove(j)
                else:
                    got[j].append(ev)
        return got

    def state(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.gc.state_dict(SRC)))


def interleave(per_net: Sequence[Sequence[Event]]) -> list[tuple[int, ...]]:
    """The global batch sequence from each net's batches: batch i is net i mod k's."""
    k = len(per_net)
    own = [batches_of(e) for e in per_net]
    out = []
    for i in range(sum(map(len, own))):
        out.append(own[i % k][i // k])
    return out


def assert_stream(per_net: Sequence[Sequence[Event]], want: Sequence[Event], what: str) -> None:
    assert interleave(per_net) == batches_of(want), what
    ends = [e for e in want if e[0] == "end"]
    for j, events in enumerate(per_net):
        assert [e for e in events if e[0] == "end"] == ends, f"{what}: net {j}'s epoch ends"


# ---------------------------------------------------------------------------------------------
# 1. The stream is a function of the data, seed, epoch and batch size only
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nets", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_same_stream_on_threads_for_any_workers_and_nets(workers: int, nets: int) -> None:
    want = reference(29, 4, 2)
    with Pipeline(Items(29, delay=0.002), nets, workers) as p:
        got = p.lockstep()
    assert_stream(got, want, f"threads, {workers} workers, {nets} nets")


@pytest.mark.parametrize("workers,nets", [(1, 2), (2, 3), (3, 1), (4, 2)])
def test_same_stream_on_processes(workers: int, nets: int) -> None:
    want = reference(29, 4, 2)
    with Pipeline(Items(29, delay=0.002), nets, workers, backend="processes") as p:
        got = p.lockstep()
    assert_stream(got, want, f"processes, {workers} workers, {nets} nets")


def test_sequential_order_and_batched_reads_of_dict_samples() -> None:
    Batched.calls = 0
    with Pipeline(Batched(10), 1, 2, bs=3, epochs=1, shuffle=False, read_size=4) as p:
        got = p.lockstep()
    assert got == [[(0, 1, 2), (3, 4, 5), (6, 7, 8), (9,)]]
    assert Batched.calls == 3, "one __getitems__ per read unit of 4 positions (4, 4, 2)"


def test_a_plain_dataset_is_a_random_access_source_and_equal_shares_hold() -> None:
    gc = blobfeed.GlobalCoordinator()
    nets = [Net(name="a"), Net(name="b")]
    for net in nets:
        init_data_input_workers(net, BLOBS, Items(9), 2, num_worker_threads=2, coordinator=gc, seed=SEED,
                                equal=True)
    gc.start()
    try:
        got: list[list[tuple[int, ...]]] = [[], []]
        for j in (0, 1, 0, 1):
            got[j].append(tuple(int(i) for i in nets[j].run(timeout=WAIT)["ids"]))
        for net in nets:
            with pytest.raises(EndOfInput):
                net.run(timeout=WAIT)
    finally:
        assert gc.stop(timeout=10.0)
    # in order (no shuffle by default); 5 batches of 2, the last round ((8,) alone) dropped
    assert got == [[(0, 1), (4, 5)], [(2, 3), (6, 7)]]


class Gate(Items):
    """Index ``slow`` waits for ``release``; every read is logged in ``reads``."""

    def __init__(self, n: int, slow: int, release: threading.Event) -> None:
        super().__init__(n)
        self.slow = slow
        self.release = release
        self.reads: list[int] = []

    def __getitem__(self, i: int) -> tuple[Any, np.ndarray]:
        if i == self.slow:
            assert self.release.wait(WAIT), "the test never released the slow read"
        self.reads.append(i)
        return super().__getitem__(i)


def test_a_slow_worker_does_not_hold_the_others_back_beyond_the_window() -> None:
    release = threading.Event()
    ds = Gate(200, slow=3, release=release)  # unit 1 (positions 2-3) is slow
    with Pipeline(ds, 1, 3, bs=2, epochs=1, shuffle=False, read_size=2, window=6) as p:
        p.start()
        # the others read on, up to 6 units past the oldest missing one (unit 1): units 2..6
        wait_until(lambda: len(ds.reads) >= 2 + 5 * 2, "the free workers read ahead")
        time.sleep(0.2)  # they could read further, were it not for the window
        assert max(ds.reads) < 2 * (1 + 6), f"read {max(ds.reads)}: past the window"
        release.set()
        got = p.lockstep()
    assert batches_of(got[0]) == [(i, i + 1) for i in range(0, 200, 2)]


# ---------------------------------------------------------------------------------------------
# 2. Elastic resume
# ---------------------------------------------------------------------------------------------
RESUMES = [
    # (stop after events, workers/nets before, workers/nets after, backend after)
    (1, (2, 1), (3, 2), "threads"),
    (5, (2, 2), (1, 1), "threads"),
    (7, (3, 3), (2, 2), "threads"),
    (9, (1, 2), (4, 3), "threads"),
    (12, (2, 3), (2, 1), "threads"),
    (16, (4, 2), (2, 2), "threads"),
    (6, (2, 2), (2, 3), "processes"),
]


@pytest.mark.parametrize("stop,before,after,backend", RESUMES)
def test_resume_with_other_counts_gives_the_rest_of_the_stream(
    stop: int, before: tuple[int, int], after: tuple[int, int], backend: str
) -> None:
    n, bs, epochs = 23, 4, 2
    want = batches_of(reference(n, bs, epochs))
    with Pipeline(Items(n), before[1], before[0], bs=bs, epochs=epochs) as p:
        p.start()
        first = p.lockstep(limit=stop)
        state = p.state()
    with Pipeline(Items(n), after[1], after[0], bs=bs, epochs=epochs, backend=backend) as p:
        p.gc.load_state_dict(SRC, state)
        p.start()
        rest = p.lockstep()
    what = f"stop after {stop}, {before} -> {after} on {backend}, state {state}"
    got = [b for events in first + rest for b in batches_of(events)]
    assert sorted(got) == sorted(want), what
    for e in range(epochs):
        # each sample exactly once per epoch over both runs
        per_epoch = [i for b in got if b in reference_epoch(n, bs, e) for i in b]
        assert sorted(per_epoch) == list(range(n)), f"{what}: epoch {e}"
    # the resumed run deals the rest of the stream in order: batch i to net i mod k
    done = set(got[:0])
    before_batches = {b for events in first for b in batches_of(events)}
    rest_stream = [b for b in want if b not in before_batches]
    assert interleave(rest) == rest_stream, what
    del done


def reference_epoch(n: int, bs: int, e: int) -> set[tuple[int, ...]]:
    order = np.random.default_rng((SEED, e)).permutation(n)
    return {tuple(int(i) for i in order[s:s + bs]) for s in range(0, n, bs)}


def test_resume_with_the_same_nets_gives_each_net_its_own_batches() -> None:
    n, bs = 30, 3
    with Pipeline(Items(n), 2, 2, bs=bs) as p:
        full = p.lockstep()
    with Pipeline(Items(n), 2, 2, bs=bs) as p:
        p.start()
        # net 0 three batches ahead of net 1
        first = [[p.next_event(0) for _ in range(5)], [p.next_event(1) for _ in range(2)]]
        state = p.state()
    with Pipeline(Items(n), 2, 3, bs=bs, backend="threads") as p:
        p.gc.load_state_dict(SRC, state)
        p.start()
        rest = p.lockstep()
    for j in (0, 1):
        assert first[j] + rest[j] == full[j], f"net {j}"


def test_resume_twice_through_elastic_states() -> None:
    n, bs, epochs = 17, 2, 3
    want = batches_of(reference(n, bs, epochs))
    got: list[tuple[int, ...]] = []
    state = None
    for nets, workers, limit in ((2, 2, 5), (3, 1, 7), (1, 3, None)):
        with Pipeline(Items(n), nets, workers, bs=bs, epochs=epochs) as p:
            if state is not None:
                p.gc.load_state_dict(SRC, state)
            p.start()
            events = p.lockstep(limit=limit)
            got += [b for e in events for b in batches_of(e)]
            state = p.state()
    assert sorted(got) == sorted(want)


@pytest.mark.parametrize("field,change", [
    ("length", {"dataset": Items(24)}),
    ("batch_size", {"bs": 5}),
    ("seed", {"seed": SEED + 1}),
    ("shuffle", {"shuffle": False}),
])
def test_a_state_of_other_data_is_refused_naming_the_field(field: str, change: dict[str, Any]) -> None:
    with Pipeline(Items(23), 1, 1) as p:
        p.start()
        p.lockstep(limit=2)
        state = p.state()
    kw: dict[str, Any] = {"bs": 4, "seed": SEED, "shuffle": True}
    dataset = change.pop("dataset", Items(23))
    kw.update(change)
    with Pipeline(dataset, 2, 2, **kw) as p:
        with pytest.raises(ValueError, match=rf"state\['{field}'\]: saved .*, this pipeline has "):
            p.gc.load_state_dict(SRC, state)


def test_a_damaged_state_is_refused_naming_the_field() -> None:
    with Pipeline(Items(23), 1, 1) as p:
        p.start()
        p.lockstep(limit=2)
        state = p.state()
    for path, value, match in [
        (("position", "offset"), 99, r"state\['position'\]\['offset'\]: expected an int in \[0, 24\)"),
        (("returned",), [[0, 5, 100]], r"state\['returned'\]\[0\]\[2\]"),
        (("nets",), "x", r"state\['nets'\]"),
    ]:
        bad = json.loads(json.dumps(state))
        where = bad
        for key in path[:-1]:
            where = where[key]
        where[path[-1]] = value
        with Pipeline(Items(23), 1, 1) as p:
            with pytest.raises(ValueError, match=match):
                p.gc.load_state_dict(SRC, bad)


# ---------------------------------------------------------------------------------------------
# 3. Bad datasets
# ---------------------------------------------------------------------------------------------
class NoLen:
    def __getitem__(self, i: int) -> Any:
        return (np.int64(i), np.zeros(3, np.float32))


class Raises(Items):
    def __getitem__(self, i: int) -> Any:
        if i == 5:
            raise KeyError("no such record")
        return super().__getitem__(i)


class WrongCount(Items):
    def __getitem__(self, i: int) -> Any:
        return (np.int64(i),) if i == 5 else super().__getitem__(i)


class WrongShape(Items):
    def __getitem__(self, i: int) -> Any:
        return (np.int64(i), np.full(4 if i == 5 else 3, i, np.float32))


def test_a_dataset_without_len_is_refused() -> None:
    with pytest.raises(TypeError, match="__len__ and __getitem__"):
        RandomAccessSource(NoLen())
    with pytest.raises(TypeError, match=r"got NoLen \(or a random-access source: an object with __len__ and __getitem__\)"):
        init_data_input_workers(Net(), BLOBS, NoLen(), 4, coordinator=blobfeed.GlobalCoordinator())


@pytest.mark.parametrize("dataset,match", [
    (Raises(12), r"source 'train': dataset\[5\] raised KeyError\('no such record'\)"),
    (WrongCount(12), r"source 'train': dataset\[5\] has 1 arrays; expected 2, one per blob \['ids', 'x'\]"),
    (WrongShape(12), r"source 'train': dataset\[5\], blob 'x': shape \(4,\); the samples read before have \(3,\)"),
])
@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_a_bad_sample_fails_the_source_naming_source_index_and_blob(dataset: Any, match: str, backend: str) -> None:
    with Pipeline(dataset, 1, 2, bs=2, epochs=1, shuffle=False, read_size=2, backend=backend) as p:
        p.start()
        got = []
        with pytest.raises(FetcherError, match=match):
            while True:
                got.append(p.next_event(0))
    # the error surfaces at its place: every batch before its unit came first
    assert got == [(0, 1), (2, 3)]


def test_refused_wirings() -> None:
    for kw, match in [
        ({"shuffle_buffer": 8}, "shuffle_buffer=8"),
        ({"on_error": "skip"}, "on_error='skip'"),
        ({"dont_rebatch": True}, "dont_rebatch=True"),
    ]:
        with pytest.raises(ValueError, match=match):
            init_data_input_workers(Net(), BLOBS, Items(5), 2, coordinator=blobfeed.GlobalCoordinator(), **kw)
    class Elsewhere:
        name = "elsewhere"

        def check(self, fetch_fun: Any, worker_init_fun: Any) -> None:
            pass

        def launch(self, plan: Any) -> Any:
            raise AssertionError("not launched")

    with pytest.raises(ValueError, match="runs on backend='threads', 'processes' or a RayBackend"):
        init_data_input_workers(Net(), BLOBS, Items(5), 2, coordinator=blobfeed.GlobalCoordinator(),
                                backend=Elsewhere())
    gc = blobfeed.GlobalCoordinator()
    init_data_input_workers(Net(), BLOBS, Items(5), 2, coordinator=gc, seed=1)
    with pytest.raises(ValueError, match=r"len\(dataset\)=5; this call passes one with len\(dataset\)=6"):
        init_data_input_workers(Net(), BLOBS, Items(6), 2, coordinator=gc, seed=1)
    gc.stop(timeout=5.0)


# ---------------------------------------------------------------------------------------------
# 4. The feeding service: --resume with another num_consumers
# ---------------------------------------------------------------------------------------------
def test_a_served_random_access_source_resumes_with_another_num_consumers(tmp_path: Any) -> None:
    from blobfeed.service import FeedServer

    n, bs, epochs = 21, 4, 2
    want = batches_of(reference(n, bs, epochs))
    state_file = tmp_path / "state.json"

    def serve(consumers: int, resume: bool) -> Any:
        server = FeedServer(None, state_file=str(state_file), resume=resume)
        # seed=None: the resumed service takes the saved one
        server.serve_source(SRC, BLOBS, RandomAccessSource(Items(n), shuffle=True), bs, 2,
                            num_consumers=consumers, epochs=epochs)
        return server.start()

    def read(nets: list[Net], limit: int | None) -> list[list[Event]]:
        got: list[list[Event]] = [[] for _ in nets]
        live = list(range(len(nets)))
        steps = 0
        while live and (limit is None or steps < limit):
            for j in list(live):
                if limit is not None and steps >= limit:
                    break
                steps += 1
                try:
                    got[j].append(tuple(int(i) for i in nets[j].run(timeout=WAIT)["ids"]))
                except EndOfEpoch as end:
                    got[j].append(("end", end.epoch))
                except EndOfInput:
                    live.remove(j)
        return got

    def run(consumers: int, resume: bool, limit: int | None) -> list[list[Event]]:
        with serve(consumers, resume) as server:
            nets = [Net(name=f"rank{i}") for i in range(consumers)]
            atts = [blobfeed.attach_source(nets[i], BLOBS, bs, SRC, server.address, consumer_index=i)
                    for i in range(consumers)]
            try:
                return read(nets, limit)
            finally:
                for a in atts:
                    a.stop()

    seed = None
    first = run(2, False, 5)
    seed = json.loads(state_file.read_text())["sources"][SRC]["inner"]["seed"]
    want = batches_of(reference(n, bs, epochs, seed=seed))
    rest = run(3, True, None)
    got = [b for events in first + rest for b in batches_of(events)]
    assert sorted(got) == sorted(want)
    before = {b for events in first for b in batches_of(events)}
    assert interleave(rest) == [b for b in want if b not in before]


# ---------------------------------------------------------------------------------------------
# 5. Worker processes that die
# ---------------------------------------------------------------------------------------------
class Killer(Items):
    """Reading index ``at`` SIGKILLs the process that reads it: the first
    ``times`` times (counted in files under ``marks``; None: every time)."""

    def __init__(self, n: int, at: int, marks: str, times: int | None = 1) -> None:
        super().__init__(n)
        self.at = at
        self.marks = marks
        self.times = times

    def __getitem__(self, i: int) -> tuple[Any, np.ndarray]:
        if i == self.at:
            import os
            import signal

            done = len(os.listdir(self.marks))
            if self.times is None or done < self.times:
                open(os.path.join(self.marks, f"{os.getpid()}"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


@pytest.mark.parametrize("nets", [1, 2])
def test_a_killed_worker_process_is_replaced_and_its_units_read_again(tmp_path: Any, nets: int) -> None:
    n, bs = 40, 4
    want = reference(n, bs, 2)
    with Pipeline(Killer(n, at=int(np.random.default_rng((SEED, 0)).permutation(n)[13]), marks=str(tmp_path)),
                  nets, 2, bs=bs, backend="processes") as p:
        got = p.lockstep()
        deaths = p.gc.registry.get_sample_value("blobfeed_worker_deaths_total",
                                                {"source": SRC, "backend": "processes"})
    assert deaths == 1
    assert len(list(tmp_path.iterdir())) == 1, "one worker process was killed"
    assert_stream(got, want, f"{nets} nets, a worker killed at the sample of position 13")


def test_a_unit_that_kills_every_reader_fails_the_source_after_three_tries(tmp_path: Any) -> None:
    with Pipeline(Killer(20, at=9, marks=str(tmp_path), times=None), 1, 2, bs=2, epochs=1, shuffle=False,
                  read_size=2, backend="processes") as p:
        got = []
        with pytest.raises(FetcherError, match=r"read unit 4 died 3 times"):
            while True:
                got.append(p.next_event(0))
    assert got == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert len(list(tmp_path.iterdir())) == 3


# ---------------------------------------------------------------------------------------------
# 6. set_num_workers while it runs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_set_num_workers_while_running_keeps_the_stream(backend: str) -> None:
    n, bs = 60, 3
    want = reference(n, bs, 2)
    with Pipeline(Items(n, delay=0.001), 2, 1, bs=bs, backend=backend) as p:
        got = p.lockstep(limit=6)
        p.gc.set_num_workers(SRC, 4)
        assert len(p.gc._sources[SRC].dealer.worker_ids) == 4
        more = p.lockstep(limit=10)
        p.gc.set_num_workers(SRC, 1)
        rest = p.lockstep()
    for j in range(2):
        got[j] += more[j] + rest[j]
    assert_stream(got, want, f"{backend}: 1 -> 4 -> 1 workers")


def test_set_num_workers_is_refused_where_it_cannot_apply() -> None:
    with Pipeline(Items(10), 1, 1) as p:
        with pytest.raises(ValueError, match="not running"):
            p.gc.set_num_workers(SRC, 2)
        p.start()
        with pytest.raises(ValueError, match="num_workers"):
            p.gc.set_num_workers(SRC, 0)
    gc = blobfeed.GlobalCoordinator()
    # a fetch_fun source whose stream depends on its worker count (test_autotune: the others)
    init_data_input_workers(Net(), BLOBS, lambda w, b: None, 2, coordinator=gc, seed=1, deterministic=True)
    with pytest.raises(ValueError, match="depends on its worker count"):
        gc.set_num_workers(SRC, 2)
    gc.stop(timeout=5.0)


def test_nothing_left_behind_after_replaced_and_resized_workers(tmp_path: Any) -> None:
    """A killed worker process replaced, workers added and removed: after
    stop(), no descriptor or blobfeed thread more than before."""
    import gc as pygc
    import os

    def cycle(i: int) -> None:
        marks = tmp_path / f"marks{i}"
        marks.mkdir()
        with Pipeline(Killer(30, at=7, marks=str(marks)), 1, 2, bs=3, epochs=1, shuffle=False,
                      backend="processes") as p:
            got = p.lockstep(limit=2)
            p.gc.set_num_workers(SRC, 3)
            got += p.lockstep(limit=2)
            p.gc.set_num_workers(SRC, 1)
            got += p.lockstep()
        assert [b for events in got for b in batches_of(events)] == [tuple(range(s, s + 3)) for s in range(0, 30, 3)]
        assert len(list(marks.iterdir())) == 1, "a worker process was killed"

    def threads() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("blobfeed-"))

    cycle(0)  # warm up: the forkserver is made once
    pygc.collect()
    fds = set(os.listdir("/proc/self/fd"))
    before = threads()
    for i in range(1, 3):
        cycle(i)
    pygc.collect()
    assert threads() == before
    left = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in set(os.listdir("/proc/self/fd")) - fds
            if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not left, f"descriptors left open: {left}"


class Unpicklable(Items):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = threading.Lock()


def test_an_unpicklable_dataset_on_processes_is_refused_when_wired() -> None:
    with pytest.raises(TypeError, match=r"random-access source 'train': Unpicklable of 5> cannot be sent to a "
                                        r"worker process.*cannot pickle"):
        init_data_input_workers(Net(), BLOBS, Unpicklable(5), 2, backend="processes",
                                coordinator=blobfeed.GlobalCoordinator())


def test_batch_columns_and_drop_last() -> None:
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, BLOBS, RandomAccessSource(Items(7), read_size=2), 3, num_worker_threads=2,
                            coordinator=gc, batch_columns=[0, 1], drop_last=True)
    gc.start()
    try:
        outs = [net.run(timeout=WAIT) for _ in range(2)]
        with pytest.raises(EndOfInput):
            net.run(timeout=WAIT)
    finally:
        assert gc.stop(timeout=10.0)
    assert [o["ids"].tolist() for o in outs] == [[0, 1, 2], [3, 4, 5]]  # (6,) dropped
    assert outs[1]["x"].shape == (3, 3)
    np.testing.assert_array_equal(outs[1]["x"], np.repeat(np.arange(3, 6, dtype=np.float32)[None, :], 3, axis=0))


# ---------------------------------------------------------------------------------------------
# 7. Any stop, any layout before and after (hypothesis, bounded)
# ---------------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def tagged_from_start(events: Sequence[Event]) -> list[tuple[int, tuple[int, ...]]]:
    """A net's batches of a run from epoch 0, each with its epoch (the ends seen before it)."""
    out, epoch = [], 0
    for e in events:
        if e[0] == "end":
            epoch = e[1] + 1
        else:
            out.append((epoch, e))
    return out


def tagged_to_end(events: Sequence[Event], last: int) -> list[tuple[int, tuple[int, ...]]]:
    """A net's batches of a run to the end of the data, each with its epoch
    (the end that follows it; the last epoch has none)."""
    out, pending = [], []
    for e in events:
        if e[0] == "end":
            out += [(e[1], b) for b in pending]
            pending = []
        else:
            pending.append(e)
    return out + [(last, b) for b in pending]


def reference_tagged(n: int, bs: int, epochs: int) -> list[tuple[int, tuple[int, ...]]]:
    return tagged_from_start(reference(n, bs, epochs))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(5, 30), bs=st.integers(1, 6), read_size=st.integers(1, 7), epochs=st.integers(1, 3),
    before=st.tuples(st.integers(1, 4), st.integers(1, 3)), after=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    stop=st.integers(0, 40),
)
def test_any_stop_then_any_layout_gives_the_rest_exactly_once(
    n: int, bs: int, read_size: int, epochs: int, before: tuple[int, int], after: tuple[int, int], stop: int,
) -> None:
    kw: dict[str, Any] = {"bs": bs, "epochs": epochs, "read_size": read_size}
    with Pipeline(Items(n), before[1], before[0], **kw) as p:
        whole = p.lockstep()
    with Pipeline(Items(n), before[1], before[0], **kw) as p:
        first = p.lockstep(limit=stop)
        state = p.state()
    with Pipeline(Items(n), after[1], after[0], **kw) as p:
        p.gc.load_state_dict(SRC, state)
        rest = p.lockstep()
    want = reference_tagged(n, bs, epochs)
    assert interleave(whole) == [b for _, b in want]
    done = [t for events in first for t in tagged_from_start(events)]
    later = [tagged_to_end(events, epochs - 1) for events in rest]
    # each sample exactly once per epoch over both runs
    assert sorted(done + [t for net in later for t in net]) == sorted(want), state
    if after[1] == before[1]:
        # the same nets: each gets exactly its batches of the uninterrupted run
        for j in range(after[1]):
            assert batches_of(first[j]) + batches_of(rest[j]) == batches_of(whole[j]), state
    else:
        # the rest of the stream, in its order, dealt anew: batch i to net i mod k
        k = after[1]
        stream = [t for t in want if t not in done]
        assert [len(net) for net in later] == [len(stream[j::k]) for j in range(k)], state
        for j in range(k):
            assert later[j] == stream[j::k], state


def failing_init(worker_id: int) -> None:
    if worker_id == 2:
        raise RuntimeError("no GPU for worker 2")


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_a_worker_init_fun_error_fails_the_source_though_its_worker_held_no_unit(backend: str) -> None:
    with Pipeline(Items(400), 1, 3, bs=2, epochs=1, backend=backend, worker_init_fun=failing_init) as p:
        with pytest.raises(FetcherError, match=r"worker 2: starting the worker failed: RuntimeError\('no GPU"):
            for _ in range(400):
                p.next_event(0)
