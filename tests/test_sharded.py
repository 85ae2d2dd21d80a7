"""Sharded sources (issue 26): shards fixed by the data, each read
sequentially from a sample offset by ``read_shard(shard, offset)``; blobfeed
draws the order of the shards (and, with ``shuffle_block``, of the samples in
blocks of a shard) from the seed and the epoch.

What is checked:

* the global batch sequence is a function of the shards, seed, epoch and
  batch size only: the same on threads and processes, with 1-4 workers and
  1-3 nets, batch *i* going to net *i mod n*; it is the reference computed
  here with numpy alone; shuffle changes with the epoch and the seed;
* a worker keeps a shard open while it reads it on (one ``read_shard`` per
  shard and epoch with one worker);
* elastic resume: a stop at some batch, then a resume with other worker and
  net counts gives the rest of the uninterrupted stream, each sample exactly
  once per epoch; a state of another shard count, shard sizes, batch size,
  seed or shuffle_block is refused naming the field;
* a bad ``read_shard`` (raises, a short or long shard, wrong blobs) fails the
  source at its place naming the source, shard and sample;
* a killed worker process loses nothing; set_num_workers keeps the stream;
  the feeding service resumes a sharded source with another num_consumers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from typing import Any, Iterator, Sequence

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfEpoch, EndOfInput, FetcherError, Net, ShardedSource, init_data_input_workers

from .helpers import wait_until
from .test_indexed import read_attached

SRC = "train"
BLOBS = ["ids", "x"]
WAIT = 30.0
SEED = 11
SIZES = [5, 0, 7, 3, 9, 1, 6]  # 31 samples; an empty shard too

Event = Any  # a tuple of sample ids (a batch), or ("end", epoch)


def starts_of(sizes: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


class Shards:
    """``read_shard``: shard k's sample o is id ``sum(sizes[:k]) + o``, with
    blobs (id, [id, id, id]), in chunks of 1 + k % 3 samples.  Module level: it pickles."""

    def __init__(self, sizes: Sequence[int] = SIZES) -> None:
        self.sizes = list(sizes)
        self.starts = starts_of(sizes)

    def chunk(self, ids: np.ndarray) -> Any:
        return ids, np.repeat(ids.astype(np.float32)[:, None], 3, axis=1)

    def __call__(self, k: int, offset: int) -> Iterator[Any]:
        ids = np.arange(self.starts[k] + offset, self.starts[k] + self.sizes[k], dtype=np.int64)
        step = 1 + k % 3
        for i in range(0, len(ids), step):
            yield self.chunk(ids[i:i + step])


def sample_order(sizes: Sequence[int], e: int, shuffle: bool, seed: int, block: int = 0) -> list[int]:
    """Epoch ``e``'s sample ids, from numpy alone."""
    starts = starts_of(sizes)
    shards = np.random.default_rng((seed, e)).permutation(len(sizes)) if shuffle else range(len(sizes))
    out: list[int] = []
    for k in shards:
        k = int(k)
        if not block:
            out += range(int(starts[k]), int(starts[k]) + sizes[k])
            continue
        for b, s in enumerate(range(0, sizes[k], block)):
            perm = np.random.default_rng((seed, e, k, b)).permutation(min(block, sizes[k] - s))
            out += [int(starts[k]) + s + int(p) for p in perm]
    return out


def reference(bs: int, epochs: int, shuffle: bool = True, seed: int = SEED, sizes: Sequence[int] = SIZES,
              block: int = 0) -> list[Event]:
    out: list[Event] = []
    for e in range(epochs):
        order = sample_order(sizes, e, shuffle, seed, block)
        out += [tuple(order[s:s + bs]) for s in range(0, len(order), bs)]
        if e < epochs - 1:
            out.append(("end", e))
    return out


def batches_of(events: Sequence[Event]) -> list[tuple[int, ...]]:
    return [e for e in events if e[0] != "end"]


def interleave(per_net: Sequence[Sequence[Event]]) -> list[tuple[int, ...]]:
    k = len(per_net)
    own = [batches_of(e) for e in per_net]
    return [own[i % k][i // k] for i in range(sum(map(len, own)))]


def assert_stream(per_net: Sequence[Sequence[Event]], want: Sequence[Event], what: str) -> None:
    assert interleave(per_net) == batches_of(want), what
    ends = [e for e in want if e[0] == "end"]
    for j, events in enumerate(per_net):
        assert [e for e in events if e[0] == "end"] == ends, f"{what}: net {j}'s epoch ends"


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
    """A net's batches of a run to the end of the data, each with its epoch (the end that follows it)."""
    out, pending = [], []
    for e in events:
        if e[0] == "end":
            out += [(e[1], b) for b in pending]
            pending = []
        else:
            pending.append(e)
    return out + [(last, b) for b in pending]


def assert_rest(first: Sequence[Sequence[Event]], rest: Sequence[Sequence[Event]], want: Sequence[Event],
                epochs: int, what: str) -> None:
    """The resumed run (another number of nets) deals the rest of the stream
    in its order, batch i to net i mod k (batches told apart by their epoch:
    a shard read in order gives the same batch in two epochs)."""
    done = {t for events in first for t in tagged_from_start(events)}
    stream = [t for t in tagged_from_start(want) if t not in done]
    later = [tagged_to_end(events, epochs - 1) for events in rest]
    k = len(rest)
    assert [len(net) for net in later] == [len(stream[j::k]) for j in range(k)], what
    for j in range(k):
        assert later[j] == stream[j::k], what


class Pipeline:
    """A fresh coordinator; one net per call, each with ``workers`` workers."""

    def __init__(self, read_shard: Any, nets: int, workers: int, *, bs: int = 4, epochs: int | None = 2,
                 backend: str = "threads", shuffle: bool = True, seed: int = SEED, read_size: int | None = 3,
                 sizes: Sequence[int] = SIZES, block: int = 0, **kw: Any) -> None:
        self.gc = blobfeed.GlobalCoordinator()
        self.started = False
        self.nets = [Net(name=f"net{j}") for j in range(nets)]
        spec = ShardedSource(sizes, read_shard, shuffle=shuffle, seed=seed, read_size=read_size,
                             shuffle_block=block)
        for net in self.nets:
            init_data_input_workers(net, BLOBS, spec, bs, num_worker_threads=workers, coordinator=self.gc,
                                    epochs=epochs, backend=backend, **kw)

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.gc.stop(timeout=10.0), "a thread outlived stop()"

    def next_event(self, j: int) -> Event | None:
        if not self.started:
            self.started = True
            self.gc.start()
        try:
            out = self.nets[j].run(timeout=WAIT)
        except EndOfEpoch as end:
            return ("end", end.epoch)
        except EndOfInput:
            return None
        ids = out["ids"]
        x = out["x"]
        np.testing.assert_array_equal(x, np.repeat(ids.astype(np.float32)[:, None], x.shape[1], axis=1))
        return tuple(int(i) for i in ids)

    def lockstep(self, limit: int | None = None) -> list[list[Event]]:
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


# ---------------------------------------------------------------------------------------------
# 1. The stream is a function of the shards, seed, epoch and batch size only
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nets", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_same_stream_on_threads_for_any_workers_and_nets(workers: int, nets: int) -> None:
    with Pipeline(Shards(), nets, workers) as p:
        got = p.lockstep()
    assert_stream(got, reference(4, 2), f"threads, {workers} workers, {nets} nets")


@pytest.mark.parametrize("workers,nets", [(1, 2), (2, 3), (3, 1), (4, 2)])
def test_same_stream_on_processes(workers: int, nets: int) -> None:
    with Pipeline(Shards(), nets, workers, backend="processes", block=4) as p:
        got = p.lockstep()
    assert_stream(got, reference(4, 2, block=4), f"processes, {workers} workers, {nets} nets, shuffle_block=4")


class WideShards(Shards):
    """Shards' samples with rows of 4096 floats: a unit of 4 is 64 KiB,
    stacked straight into a worker process's slot."""

    def chunk(self, ids: np.ndarray) -> Any:
        return ids, np.repeat(ids.astype(np.float32)[:, None], 4096, axis=1)


@pytest.mark.parametrize("block", [0, 4])
def test_wide_units_taken_into_worker_process_slots_give_the_reference_stream(block: int) -> None:
    with Pipeline(WideShards(), 2, 2, backend="processes", block=block) as p:
        got = p.lockstep()
    assert_stream(got, reference(4, 2, block=block), f"processes, wide samples, shuffle_block={block}")


def test_shuffle_changes_with_epoch_and_seed_and_blocks_permute_inside_shards() -> None:
    def order(seed: int, block: int, shuffle: bool = True) -> list[list[int]]:
        with Pipeline(Shards(), 1, 2, bs=5, epochs=2, seed=seed, block=block, shuffle=shuffle) as p:
            got = p.lockstep()
        assert_stream(got, reference(5, 2, seed=seed, block=block, shuffle=shuffle), f"seed {seed}, block {block}")
        epochs: list[list[int]] = [[]]
        for e in got[0]:
            if e[0] == "end":
                epochs.append([])
            else:
                epochs[-1] += e
        return epochs

    plain = order(SEED, 0, shuffle=False)
    assert plain == [list(range(31))] * 2, "without shuffle: the shards and their samples in order"
    a = order(SEED, 0)
    assert a[0] != a[1], "each epoch its own order of shards"
    assert order(SEED + 1, 0) != a, "another seed, another order"
    for e in a:
        assert sorted(e) == list(range(31))
    # the samples of a shard stay in order: each shard's run is consecutive ids
    runs = [i for i in range(1, 31) if a[0][i] != a[0][i - 1] + 1]
    assert len(runs) <= len(SIZES) - 2, a[0]
    blocked = order(SEED, 3)
    assert sorted(blocked[0]) == list(range(31)) and blocked[0] != a[0]
    # blocks stay in place: sample i is within its block of 3 of its shard
    assert order(SEED, 3, shuffle=False) == [sample_order(SIZES, e, False, SEED, 3) for e in (0, 1)]


class Counted(Shards):
    """Counts its opens in a list the test holds (threads only)."""

    def __init__(self, opens: list[tuple[int, int]]) -> None:
        super().__init__()
        self.opens = opens

    def __call__(self, k: int, offset: int) -> Iterator[Any]:
        self.opens.append((k, offset))
        return super().__call__(k, offset)


def test_one_worker_reads_each_shard_with_one_read_shard_call() -> None:
    opens: list[tuple[int, int]] = []
    with Pipeline(Counted(opens), 1, 1, bs=4, epochs=2, read_size=2) as p:
        got = p.lockstep()
    assert_stream(got, reference(4, 2), "1 worker")
    nonempty = [k for k, s in enumerate(SIZES) if s]
    assert sorted(opens) == sorted((k, 0) for k in nonempty for _ in range(2)), opens


class Tracked(Shards):
    """Records each iterator's open and close (threads only); shard 3's
    chunk at sample 1 has one array when ``bad``."""

    def __init__(self, log: list[tuple[str, int, int]], bad: bool = False) -> None:
        super().__init__()
        self.log = log
        self.bad = bad

    def __call__(self, k: int, offset: int) -> Iterator[Any]:
        self.log.append(("open", k, offset))
        try:
            for o, c in enumerate(super().__call__(k, offset), offset):
                yield c[:1] if self.bad and (k, o) == (3, 1) else c
        finally:
            self.log.append(("close", k, offset))


def test_every_shard_iterator_is_closed_and_a_failed_one_at_once() -> None:
    log: list[tuple[str, int, int]] = []
    with Pipeline(Tracked(log), 2, 3, bs=4, epochs=2, read_size=2) as p:
        got = p.lockstep()
        assert_stream(got, reference(4, 2), "3 workers")
        # the data ended: every worker closes what it had open (in its own
        # thread, as it ends: maybe just after the nets saw the end)
        def all_closed() -> bool:
            events = list(log)
            return sorted(e[1:] for e in events if e[0] == "open") == sorted(e[1:] for e in events if e[0] == "close")

        wait_until(all_closed, "every shard iterator closed at the data's end")
    log.clear()
    with Pipeline(Tracked(log, bad=True), 1, 1, bs=4, epochs=1, shuffle=False, read_size=4) as p:
        with pytest.raises(FetcherError, match="has 1 arrays"):
            while p.next_event(0) is not None:
                pass
        assert ("close", 3, 0) in log, f"the failed shard's iterator is still open: {log}"



class Endless(Tracked):
    """Tracked over shards of 100 samples; shard 3 (chunks of one sample) raises at sample 50 when ``fail``."""

    def __init__(self, log: list[tuple[str, int, int]], fail: bool = False) -> None:
        super().__init__(log)
        self.sizes = [100] * 4
        self.starts = starts_of(self.sizes)
        self.fail = fail

    def __call__(self, k: int, offset: int) -> Iterator[Any]:
        for o, c in enumerate(super().__call__(k, offset), offset):
            if self.fail and (k, o) == (3, 50):
                raise ValueError("corrupt record")
            yield c


@pytest.mark.parametrize("how", ["stop", "failure"])
def test_every_shard_iterator_is_closed_when_its_worker_stops_mid_stream(how: str) -> None:
    """A worker that sees the source stopped (or failed) makes no further
    call: its open iterator is closed all the same, in its own thread."""
    log: list[tuple[str, int, int]] = []
    p = Pipeline(Endless(log, fail=how == "failure"), 1, 3, bs=4, epochs=1, shuffle=False, read_size=4,
                 sizes=[100] * 4, max_buffered_batches=1)
    try:
        p.next_event(0)
        if how == "stop":
            # a worker holds a shard open, waiting on the full queue (how
            # many of the three got there first is timing's: any will do)
            def held_open() -> bool:
                events = list(log)
                return len([e for e in events if e[0] == "open"]) > len([e for e in events if e[0] == "close"])

            wait_until(held_open, "a shard held open mid-stream")
        else:
            with pytest.raises(FetcherError, match="corrupt record"):
                while p.next_event(0) is not None:
                    pass
    finally:
        assert p.gc.stop(timeout=10.0), "a thread outlived stop()"
    opens = [e[1:] for e in log if e[0] == "open"]
    closes = [e[1:] for e in log if e[0] == "close"]
    assert opens and sorted(opens) == sorted(closes), f"still open after stop(): {sorted(set(opens) - set(closes))}"



class ListUnits:
    """Hands a reader the given read units, then None (a dispenser's ``take``)."""

    def __init__(self, units: Sequence[tuple[int, int, int]]) -> None:
        from blobfeed.feeders.read_units import ReadUnit

        self.left = [ReadUnit(*u) for u in units]

    def take(self, worker_id: int, ahead: int | None = None) -> Any:
        return self.left.pop(0) if self.left else None


def held_bytes(a: np.ndarray) -> int:
    """The bytes the memory that ``a`` keeps alive holds (the array it views, and so on)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.nbytes


def test_a_small_unit_does_not_keep_its_large_chunk_alive() -> None:
    """A unit of 16 samples cut from a chunk of 1000 (a shard read at once)
    holds its own 16 samples, not the chunk: the units in the window would
    otherwise each pin a different large chunk.  What the worker keeps for
    its next unit stays a view of the last chunk (no copy of it)."""
    chunks: list[Any] = []

    def read_shard(k: int, offset: int) -> Iterator[Any]:
        for lo in range(offset, 1000, 1000 if offset else 40):  # 40 samples, then the rest at once
            ids = np.arange(lo, min(lo + (1000 if lo else 40), 1000), dtype=np.int64)
            chunks.append((ids, np.ones((len(ids), 64), np.float32)))
            yield chunks[-1]

    reader = ShardedSource([1000], read_shard, read_size=16).reader(SRC, 1000, 0, BLOBS, (0, 0))
    reader.units = ListUnits([(0, 0, 16), (1, 16, 32), (2, 32, 48), (3, 48, 64), (4, 500, 516)])
    for lo in (0, 16, 32, 48, 500):
        out = reader(0, 16).raw
        np.testing.assert_array_equal(out[0], np.arange(lo, lo + 16))
        for a in out:
            assert held_bytes(a) <= 2 * a.nbytes, f"unit at {lo}: {a.nbytes} bytes keep {held_bytes(a)} alive"
        if lo == 32:
            # the unit straddles the chunks 0..39 and 40..999: the rest is a view of the second
            rest = reader._open[0].rest
            assert rest is not None and all(np.shares_memory(r, c) for r, c in zip(rest, chunks[1]))
    reader.worker_ended(0)


# ---------------------------------------------------------------------------------------------
# 2. Elastic resume
# ---------------------------------------------------------------------------------------------
def _resume_cases() -> list[tuple[int, tuple[int, int], tuple[int, int], int, int]]:
    rng = random.Random(26)
    cases = []
    for _ in range(6):
        cases.append((rng.randrange(0, 20), (rng.randint(1, 4), rng.randint(1, 3)),
                      (rng.randint(1, 4), rng.randint(1, 3)), rng.randint(1, 5), rng.choice([0, 0, 3])))
    # shuffle_block: a stop inside a block, the same nets and other nets
    return cases + [(7, (2, 2), (3, 2), 2, 4), (5, (3, 1), (2, 3), 5, 4)]


@pytest.mark.parametrize("stop,before,after,read_size,block", _resume_cases())
def test_resume_with_other_counts_gives_the_rest_of_the_stream(
    stop: int, before: tuple[int, int], after: tuple[int, int], read_size: int, block: int,
) -> None:
    bs, epochs = 3, 2
    kw: dict[str, Any] = {"bs": bs, "epochs": epochs, "read_size": read_size, "block": block}
    want = reference(bs, epochs, block=block)
    with Pipeline(Shards(), before[1], before[0], **kw) as p:
        first = p.lockstep(limit=stop)
        state = p.state()
    assert state["kind"] == "sharded" and state["shards"] == len(SIZES)
    # the resumed run reads in units of another size: the stream does not depend on it
    with Pipeline(Shards(), after[1], after[0], **{**kw, "read_size": read_size % 5 + 1}) as p:
        p.gc.load_state_dict(SRC, state)
        rest = p.lockstep()
    what = (f"stop after {stop}, {before} -> {after}, read_size {read_size} -> {read_size % 5 + 1}, "
            f"block {block}: {state}")
    done = [b for events in first for b in batches_of(events)]
    got = done + [b for events in rest for b in batches_of(events)]
    assert sorted(got) == sorted(batches_of(want)), what
    # each sample exactly once per epoch over both runs (a batch tagged with its epoch)
    tagged = [t for events in first for t in tagged_from_start(events)]
    tagged += [t for events in rest for t in tagged_to_end(events, epochs - 1)]
    for e in range(epochs):
        assert sorted(i for te, b in tagged if te == e for i in b) == list(range(31)), f"{what}: epoch {e}"
    if after[1] == before[1]:
        with Pipeline(Shards(), before[1], before[0], **kw) as p:
            whole = p.lockstep()
        for j in range(after[1]):
            assert batches_of(first[j]) + batches_of(rest[j]) == batches_of(whole[j]), what
    else:
        assert_rest(first, rest, want, epochs, what)


def test_a_resume_on_processes_gives_the_rest_of_the_stream() -> None:
    with Pipeline(Shards(), 2, 2) as p:
        first = p.lockstep(limit=7)
        state = p.state()
    with Pipeline(Shards(), 3, 2, backend="processes") as p:
        p.gc.load_state_dict(SRC, state)
        rest = p.lockstep()
    assert_rest(first, rest, reference(4, 2), 2, "2 nets on threads -> 3 on processes")


@pytest.mark.parametrize("field,change", [
    ("shards", {"sizes": SIZES + [2]}),
    ("shard_sizes", {"sizes": [6, 0, 6, 3, 9, 1, 6]}),
    ("batch_size", {"bs": 5}),
    ("seed", {"seed": SEED + 1}),
    ("shuffle_block", {"block": 2}),
    ("shuffle", {"shuffle": False}),
])
def test_a_state_of_other_data_is_refused_naming_the_field(field: str, change: dict[str, Any]) -> None:
    with Pipeline(Shards(), 1, 1) as p:
        p.lockstep(limit=2)
        state = p.state()
    kw: dict[str, Any] = {"bs": 4, "seed": SEED, "shuffle": True}
    kw.update(change)
    sizes = kw.get("sizes", SIZES)
    with Pipeline(Shards(sizes), 2, 2, **kw) as p:
        with pytest.raises(ValueError, match=rf"state\['{field}'\]: saved .*, this pipeline has "):
            p.gc.load_state_dict(SRC, state)


def test_a_random_access_state_is_refused_by_a_sharded_source_and_back() -> None:
    class Items:
        def __len__(self) -> int:
            return 31

        def __getitem__(self, i: int) -> Any:
            return np.int64(i), np.full(3, i, np.float32)

    gc = blobfeed.GlobalCoordinator()
    init_data_input_workers(Net(), BLOBS, Items(), 4, coordinator=gc, seed=SEED)
    ra_state = json.loads(json.dumps(gc.state_dict(SRC)))
    gc.stop(timeout=10.0)
    with Pipeline(Shards(), 1, 1) as p:
        with pytest.raises(ValueError, match=r"state\['kind'\]: expected 'sharded'.*got 'random_access'"):
            p.gc.load_state_dict(SRC, ra_state)
        sharded_state = p.state()
    gc = blobfeed.GlobalCoordinator()
    init_data_input_workers(Net(), BLOBS, Items(), 4, coordinator=gc, seed=SEED)
    with pytest.raises(ValueError, match=r"state\['kind'\]: expected 'random_access'.*got 'sharded'"):
        gc.load_state_dict(SRC, sharded_state)
    gc.stop(timeout=10.0)


def test_later_wiring_calls_must_read_the_same_shards() -> None:
    gc = blobfeed.GlobalCoordinator()
    init_data_input_workers(Net(), BLOBS, ShardedSource(SIZES, Shards()), 2, coordinator=gc, seed=1)
    with pytest.raises(ValueError, match=r"shard_sizes 'sha256:.*'; this call passes one with 'sha256:"):
        init_data_input_workers(Net(), BLOBS, ShardedSource([6] + SIZES[1:], Shards()), 2, coordinator=gc, seed=1)
    with pytest.raises(ValueError, match=r"shuffle_block 0; this call passes one with 4"):
        init_data_input_workers(Net(), BLOBS, ShardedSource(SIZES, Shards(), shuffle_block=4), 2, coordinator=gc,
                                seed=1)
    with pytest.raises(ValueError, match="shuffle_buffer=8"):
        init_data_input_workers(Net(), BLOBS, ShardedSource(SIZES, Shards()), 2, coordinator=gc, seed=1,
                                shuffle_buffer=8)
    for kw, match in [({"seed": 2}, "seed=1; this call passes one with seed=2"),
                      ({"read_size": 3}, "read_size=2; this call passes one with read_size=3")]:
        with pytest.raises(ValueError, match=rf"source 'train' reads a sharded source with {match}"):
            init_data_input_workers(Net(), BLOBS, ShardedSource(SIZES, Shards(), **kw), 2, coordinator=gc, seed=1)
    gc.stop(timeout=10.0)
    for bad, match in [([], "shard_sizes is empty"), ([3, -1], r"shard_sizes\[1\] must be an int >= 0"),
                       ([0, 0], "has no sample"), ("12", "shard_sizes must be a list of ints")]:
        with pytest.raises((TypeError, ValueError), match=match):
            ShardedSource(bad, Shards())


@pytest.mark.parametrize("sizes,match", [
    ([2**62] * 5, r"shard_sizes\[0\] = 4611686018427387904: at most 4611686018427387903 samples"),
    ([3, 2**63], r"shard_sizes\[1\] = 9223372036854775808: at most 4611686018427387903 samples"),
    ([3, 2**64], r"shard_sizes\[1\] = 18446744073709551616: at most"),
    (np.array([5, 2**62], np.uint64), r"shard_sizes\[1\] = 4611686018427387904: at most"),
    ([2**61, 2**61 - 1, 2], r"shard_sizes sum to 4611686018427387905 samples \(from shard_sizes\[2\] on\); "
                            r"at most 4611686018427387903"),
    (np.full(1 << 20, 2**42, np.int64), r"shard_sizes sum to 4611686018427387904 samples \(from "
                                         r"shard_sizes\[1048575\] on\)"),
    ([True, 1], r"shard_sizes\[0\] must be an int >= 0 \(samples in shard 0\), got True"),
    ([1, 2.0], r"shard_sizes\[1\] must be an int >= 0 \(samples in shard 1\), got 2.0"),
    (np.array([4, -1]), r"shard_sizes\[1\] must be an int >= 0 \(samples in shard 1\), got -1"),
])
def test_shard_sizes_past_the_positions_blobfeed_counts_are_refused_naming_the_shard(sizes: Any, match: str) -> None:
    """The sizes and their sum stay below MAX_POSITION (global positions are
    signed 64-bit): a ValueError naming the shard, never a wrapped sum or an
    OverflowError."""
    from blobfeed.coordinator.checkpoint import MAX_POSITION
    from blobfeed.feeders import sharded

    assert sharded.MAX_POSITION == MAX_POSITION
    with pytest.raises(ValueError, match=match):
        ShardedSource(sizes, Shards())
    ok = ShardedSource(np.array([2**61, 2**61 - 1], np.uint64), Shards())
    assert ok.length(SRC) == MAX_POSITION - 1 and ok.shard_sizes.dtype == np.int64


@pytest.mark.parametrize("block", [0, 4])
def test_the_dealer_does_not_list_a_units_samples_to_check_its_layout(block: int) -> None:
    """The dealer checks each unit's layout against the first sample's under
    its lock: it asks the reader for the unit's first sample id only; the
    full list (a million ids for a unit of a million samples) is built for
    an error message alone."""
    from blobfeed.feeders.sharded import ShardedReader

    calls: list[int] = []

    class Listing(ShardedReader):
        def indexes(self, r: Any) -> list[int]:
            calls.append(r.unit)
            return super().indexes(r)

    class Source(ShardedSource):
        def reader(self, source: str, n: int, seed: int, blob_names: Sequence[str], axes: Sequence[int]) -> Any:
            return Listing(source, self, n, seed, blob_names, axes)

    gc = blobfeed.GlobalCoordinator()
    net = Net(name="net0")
    init_data_input_workers(net, BLOBS, Source(SIZES, Shards(), shuffle=True, seed=SEED, read_size=3,
                                               shuffle_block=block), 4,
                            num_worker_threads=2, coordinator=gc, epochs=2)
    p = Pipeline.__new__(Pipeline)
    p.gc, p.nets, p.started = gc, [net], False
    with p:
        got = p.lockstep()
    assert_stream(got, reference(4, 2, block=block), f"shuffle_block={block}")
    assert calls == [], f"the sample ids of units {calls[:10]} were listed"


class Unpicklable(Shards):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def test_a_read_shard_that_does_not_pickle_is_refused_on_processes_when_wired() -> None:
    with pytest.raises(TypeError, match=r"sharded source 'train': read_shard Unpicklable over 7 shards of 31 "
                                        r"samples> cannot be sent to a worker process.*cannot pickle"):
        init_data_input_workers(Net(), BLOBS, ShardedSource(SIZES, Unpicklable()), 2, backend="processes",
                                coordinator=blobfeed.GlobalCoordinator())


# ---------------------------------------------------------------------------------------------
# 3. A bad read_shard
# ---------------------------------------------------------------------------------------------
class Bad(Shards):
    """Shard 3 (ids 12..14, read in chunks of one) goes wrong as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def __call__(self, k: int, offset: int) -> Iterator[Any]:
        if k != 3:
            return super().__call__(k, offset)
        if self.how == "open":
            raise OSError("no such file: part-3.tar")
        return self._bad(k, offset)

    def _bad(self, k: int, offset: int) -> Iterator[Any]:
        for o, c in enumerate(super().__call__(k, offset), offset):
            if o == 1:
                if self.how == "raises":
                    raise ValueError("corrupt record")
                if self.how == "short":
                    return
                if self.how == "blobs":
                    yield c[:1]
                    continue
                if self.how == "counts":
                    yield c[0], np.zeros((2, 3), np.float32)
                    continue
                if self.how == "dtype":
                    yield c[0], c[1].astype(np.float64)
                    continue
            yield c
        if self.how == "long":
            yield self.chunk(np.array([99], np.int64))


BAD_READS = [
    ("open", r"source 'train': read_shard\(3, 0\) raised OSError\('no such file: part-3.tar'\)"),
    ("raises", r"source 'train': read_shard\(3, 0\) raised ValueError\('corrupt record'\) reading shard 3 at "
               r"sample 1"),
    ("short", r"source 'train': shard 3 ended at sample 1 \(read_shard\(3, 0\) stopped\); shard_sizes\[3\] = 3"),
    ("long", r"source 'train': shard 3 has samples past its end: shard_sizes\[3\] = 3"),
    ("blobs", r"source 'train': shard 3, the chunk read_shard gave at sample 1 has 1 arrays; expected 2, one per "
              r"blob \['ids', 'x'\]"),
    ("counts", r"shard 3, the chunk read_shard gave at sample 1, blob 'x': 2 samples; the blob\(s\) before it have 1"),
    ("dtype", r"shard 3, blob 'x': a chunk read for samples 0..2 has dtype float64, per-sample shape \(3,\); the "
              r"one before it in the unit has dtype float32"),
]


# every case on threads; two on processes (the same code runs in the worker process)
@pytest.mark.parametrize("how,match,backend", [(h, m, "threads") for h, m in BAD_READS]
                         + [(h, m, "processes") for h, m in BAD_READS if h in ("raises", "short")])
def test_a_bad_read_shard_fails_the_source_at_its_place_naming_the_shard(how: str, match: str, backend: str) -> None:
    with Pipeline(Bad(how), 1, 2, bs=4, epochs=1, shuffle=False, read_size=4, backend=backend) as p:
        got = []
        with pytest.raises(FetcherError, match=match):
            while True:
                got.append(p.next_event(0))
    # the batches before shard 3 (ids 0..11) came first
    assert got == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]


class Reused(Shards):
    """Shard 4 (ids 15..23) read the ``readinto`` way: every chunk of
    ``step`` samples written into the same two arrays (the other shards as
    Shards reads them: ids as adjacent slices of one array, which is fine)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def __call__(self, k: int, offset: int) -> Iterator[Any]:
        if k != 4:
            yield from super().__call__(k, offset)
            return
        ids = np.zeros(self.step, np.int64)
        x = np.zeros((self.step, 3), np.float32)
        for o in range(offset, self.sizes[k], self.step):
            n = min(self.step, self.sizes[k] - o)
            ids[:n] = np.arange(o, o + n) + self.starts[k]
            x[:n] = ids[:n, None]
            yield ids[:n], x[:n]


REUSE = r"source 'train': shard 4, the chunk read_shard gave at sample {}, blob 'ids': read_shard yielded an " \
        r"array that shares memory with one it yielded before and blobfeed still holds \(it overwrote its " \
        r"buffer\?\): yield a new array each time \(or \.copy\(\)\)"


# parts: the unit's earlier chunk; rest: the part of a chunk read past the
# last unit; lent: the last unit, handed on as the chunk's own arrays
@pytest.mark.parametrize("case,read_size,step,at,backend", [
    ("parts", 4, 1, 1, "threads"), ("rest", 3, 4, 4, "threads"), ("lent", 2, 2, 2, "threads"),
    ("parts", 4, 1, 1, "processes"), ("lent", 2, 2, 2, "processes"),
])
def test_a_read_shard_reusing_its_buffer_fails_naming_shard_and_sample(
    case: str, read_size: int, step: int, at: int, backend: str,
) -> None:
    """It corrupted the stream silently (blobfeed kept the chunk's arrays
    while the reader overwrote them with the next one)."""
    with Pipeline(Reused(step), 1, 1, bs=5, epochs=1, shuffle=False, read_size=read_size, backend=backend) as p:
        got = []
        with pytest.raises(FetcherError, match=REUSE.format(at)):
            while (event := p.next_event(0)) is not None:
                got.append(event)
    # the batches before shard 4 (ids 0..14) came first, uncorrupted (next_event checks x)
    assert got == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12, 13, 14)]


class InMemory(Shards):
    """Every chunk a view of one array in memory (adjacent slices, the same
    ones again in the next epoch): memory shared with no chunk blobfeed
    holds unless it is the same samples."""

    def __init__(self, sizes: Sequence[int], step: int) -> None:
        super().__init__(sizes)
        self.step = step
        self.ids = np.arange(sum(sizes), dtype=np.int64)
        self.x = np.repeat(self.ids.astype(np.float32)[:, None], 3, axis=1)

    def __call__(self, k: int, offset: int) -> Iterator[Any]:
        start, end = int(self.starts[k]), int(self.starts[k]) + self.sizes[k]
        for i in range(start + offset, end, self.step):
            yield self.ids[i:min(i + self.step, end)], self.x[i:min(i + self.step, end)]


@pytest.mark.parametrize("sizes,read_size,step", [([2], 2, 2), ([6], 2, 2), ([6], 3, 2), (SIZES, 4, 1), (SIZES, 2, 3)])
def test_chunks_that_are_views_of_one_array_are_not_taken_for_a_reused_buffer(
    sizes: list[int], read_size: int, step: int,
) -> None:
    with Pipeline(InMemory(sizes, step), 1, 1, bs=2, epochs=2, shuffle=False, read_size=read_size,
                  sizes=sizes) as p:
        (got,) = p.lockstep()
    assert got == reference(2, 2, shuffle=False, sizes=sizes)


class Empties(Shards):
    """Shard 3 gives chunks of no sample forever from sample 1 on (``at="middle"``) or after its last one (``"end"``)."""

    def __init__(self, at: str) -> None:
        super().__init__()
        self.at = at

    def __call__(self, k: int, offset: int) -> Iterator[Any]:
        for o, c in enumerate(super().__call__(k, offset), offset):
            if k == 3 and o == 1 and self.at == "middle":
                break
            yield c
        while k == 3:
            yield np.zeros(0, np.int64), np.zeros((0, 3), np.float32)


@pytest.mark.parametrize("at,match", [
    ("middle", r"source 'train': read_shard\(3, 0\) gave 1000 chunks in a row without a sample at sample 1 of "
               r"shard 3 \(shard_sizes\[3\] = 3: expected samples up to 3\)"),
    ("end", r"source 'train': read_shard\(3, 0\) gave 1000 chunks in a row without a sample at sample 3 of "
            r"shard 3 \(shard_sizes\[3\] = 3: expected its end\)"),
])
def test_a_read_shard_giving_empty_chunks_forever_fails_naming_the_shard(at: str, match: str) -> None:
    with Pipeline(Empties(at), 1, 2, bs=4, epochs=1, shuffle=False, read_size=4) as p:
        got = []
        with pytest.raises(FetcherError, match=match):
            while True:
                got.append(p.next_event(0))
    assert got == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]


class NoRepr(Exception):
    """An exception whose repr raises."""

    def __repr__(self) -> str:
        raise RuntimeError("repr failed")

    __str__ = __repr__


class NoReprShards(Shards):
    def __init__(self, when: str) -> None:
        super().__init__()
        self.when = when

    def __call__(self, k: int, offset: int) -> Iterator[Any]:
        if k == 3 and self.when == "open":
            raise NoRepr()
        return self._read(k, offset)

    def _read(self, k: int, offset: int) -> Iterator[Any]:
        for c in super().__call__(k, offset):
            if k == 3:
                raise NoRepr()
            yield c


class NoReprDataset:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        if i == 5:
            raise NoRepr()
        return np.int64(i), np.full(3, i, np.float32)


@pytest.mark.parametrize("how,match", [
    ("open", r"source 'train': read_shard\(3, 0\) raised NoRepr \(its repr raised RuntimeError\)"),
    ("iterate", r"source 'train': read_shard\(3, 0\) raised NoRepr \(its repr raised RuntimeError\) reading "
                r"shard 3 at sample 0"),
    ("dataset", r"source 'train': dataset\[5\] raised NoRepr \(its repr raised RuntimeError\)"),
])
def test_an_exception_whose_repr_fails_still_names_source_and_shard(how: str, match: str) -> None:
    if how == "dataset":
        gc = blobfeed.GlobalCoordinator()
        net = Net(name="net0")
        init_data_input_workers(net, BLOBS, blobfeed.RandomAccessSource(NoReprDataset(), read_size=1), 2,
                                num_worker_threads=1, coordinator=gc, epochs=1)
        gc.start()
        try:
            with pytest.raises(FetcherError, match=match):
                for _ in range(4):
                    net.run(timeout=WAIT)
        finally:
            assert gc.stop(timeout=10.0)
        return
    with Pipeline(NoReprShards(how), 1, 1, bs=4, epochs=1, shuffle=False, read_size=4) as p:
        with pytest.raises(FetcherError, match=match):
            while True:
                p.next_event(0)


def test_a_unit_of_another_layout_fails_naming_shard_and_sample() -> None:
    class Wide(Shards):
        def chunk(self, ids: np.ndarray) -> Any:
            width = 4 if ids[0] >= 15 else 3  # shard 4 (ids 15..23) is wider
            return ids, np.repeat(ids.astype(np.float32)[:, None], width, axis=1)

    with Pipeline(Wide(), 1, 3, bs=5, epochs=1, shuffle=False, read_size=5) as p:
        got = []
        with pytest.raises(FetcherError, match=r"source 'train': shard 4 sample 0 \(read unit 4: shard 4 samples "
                                               r"0..4\), blob 'x': dtype float32, per-sample shape \(4,\); the "
                                               r"stream's samples before it have dtype float32, per-sample shape "
                                               r"\(3,\) \(as shard 0 sample 0\)"):
            while True:
                got.append(p.next_event(0))
    assert got == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12, 13, 14)]


# ---------------------------------------------------------------------------------------------
# 4. Worker processes that die, set_num_workers
# ---------------------------------------------------------------------------------------------
class Killer(Shards):
    """Reading sample ``at`` of shard ``shard`` SIGKILLs the process the first time (a file in ``marks``)."""

    def __init__(self, shard: int, at: int, marks: str) -> None:
        super().__init__()
        self.shard, self.at, self.marks = shard, at, marks

    def __call__(self, k: int, offset: int) -> Iterator[Any]:
        o = offset  # (the sample the next chunk starts at: a chunk holds 1 + k % 3)
        for c in super().__call__(k, offset):
            if k == self.shard and o <= self.at < o + len(c[0]) and not os.listdir(self.marks):
                open(os.path.join(self.marks, str(os.getpid())), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            o += len(c[0])
            yield c


@pytest.mark.parametrize("nets", [1, 2])
def test_a_killed_worker_process_loses_nothing(tmp_path: Any, nets: int) -> None:
    with Pipeline(Killer(4, 5, str(tmp_path)), nets, 2, backend="processes") as p:
        got = p.lockstep()
        deaths = p.gc.registry.get_sample_value("blobfeed_worker_deaths_total",
                                                {"source": SRC, "backend": "processes"})
    assert deaths == 1 and len(list(tmp_path.iterdir())) == 1
    assert_stream(got, reference(4, 2), f"{nets} nets, a worker killed inside shard 4")


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_set_num_workers_while_running_keeps_the_stream(backend: str) -> None:
    sizes = [13, 20, 7, 17, 3]
    with Pipeline(Shards(sizes), 2, 1, bs=3, backend=backend, sizes=sizes) as p:
        got = p.lockstep(limit=6)
        p.gc.set_num_workers(SRC, 3)
        more = p.lockstep(limit=8)
        p.gc.set_num_workers(SRC, 1)
        rest = p.lockstep()
    for j in range(2):
        got[j] += more[j] + rest[j]
    assert_stream(got, reference(3, 2, sizes=sizes), f"{backend}: 1 -> 3 -> 1 workers")


# ---------------------------------------------------------------------------------------------
# 5. The feeding service: --resume with another num_consumers
# ---------------------------------------------------------------------------------------------
def test_a_served_sharded_source_resumes_with_another_num_consumers(tmp_path: Any) -> None:
    from blobfeed.service import FeedServer

    bs, epochs = 4, 2
    state_file = tmp_path / "state.json"

    def run(consumers: int, resume: bool, limit: int | None) -> list[list[Event]]:
        server = FeedServer(None, state_file=str(state_file), resume=resume)
        # seed=None: the resumed service takes the saved one
        server.serve_source(SRC, BLOBS, ShardedSource(SIZES, Shards(), shuffle=True), bs, 2,
                            num_consumers=consumers, epochs=epochs)
        with server.start():
            return read_attached(server.address, consumers, bs, limit)

    first = run(2, False, 5)
    seed = json.loads(state_file.read_text())["sources"][SRC]["inner"]["seed"]
    want = reference(bs, epochs, seed=seed)
    rest = run(3, True, None)
    got = [b for events in first + rest for b in batches_of(events)]
    assert sorted(got) == sorted(batches_of(want))
    assert_rest(first, rest, want, epochs, "2 consumers -> 3")


# ---------------------------------------------------------------------------------------------
# 6. Ray: the random-access path of RayBackend runs a sharded source as it is
# ---------------------------------------------------------------------------------------------
def test_a_sharded_source_on_ray_gives_the_stream_of_threads(ray_cluster: Any) -> None:
    # the session's cluster as a parameter: the test joins the Ray group (tests/conftest.py)
    from . import test_ray as rt

    with Pipeline(Shards(), 2, 3, backend=rt.backend(), block=3) as p:
        got = p.lockstep()
    assert_stream(got, reference(4, 2, block=3), "ray, 3 actors, 2 nets, shuffle_block=3")
