"""``deterministic=True``, ``GlobalCoordinator.state_dict`` / ``load_state_dict``.

What is checked (the feature of commit 745e383):

* the source's chunk stream is the workers' chunks in strict round robin by
  worker id (first chunk of worker 0, of worker 1, ..., then every worker's
  second; a worker that ended is skipped; a call that gives no chunk --
  ``None``, or a call skipped with ``on_error="skip"`` -- takes no turn),
  re-batched once per source into batches of exactly ``batch_size`` (the last
  may be smaller), global batch *i* going to the *i*-th net in wiring order,
  round robin;
* a worker's error surfaces at its place in that stream: every complete
  batch before it is delivered, then ``FetcherError``;
* ``state_dict`` / ``load_state_dict``: the batches after a resume are those
  of an uninterrupted run, for replayed (plain) and stateful fetchers, on
  either backend, and the refusals.

Every expected batch is computed here from a pure function of (worker id,
call index) -- and of the worker's ``get_worker_info().rng`` -- while the
fetchers sleep random small delays, so the timing differs on every run and
only the ordering rules can make the batches match.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blobfeed
from blobfeed import EndOfInput, FetcherError, Net, get_worker_info, init_data_input_workers
from blobfeed.worker_info import worker_seeds
from blobfeed.feeders import STATE_VERSION

SRC = "train"
BLOBS = ["ids", "feat"]
#: the bound of every wait in this file; nothing gets near it
WAIT = 10.0
SEED = 1234
#: sample id = worker_id * WSPAN + call index * KSPAN + row (a chunk has < KSPAN rows)
WSPAN = 100_000
KSPAN = 1000
MAX_CHUNK = 11

Batch = tuple[np.ndarray, np.ndarray]  # (ids, feat)


# ---------------------------------------------------------------------------------------------
# The data: a pure function of (worker id, call index, the worker's rng)
# ---------------------------------------------------------------------------------------------
def chunk_size(salt: int, wid: int, k: int) -> int:
    return random.Random(f"size:{salt}:{wid}:{k}").randint(1, MAX_CHUNK)


def make_chunk(wid: int, k: int, n: int, width: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    """ids int64 (n,); feat float32 (n, width): [:, 0] == ids, [:, 1] drawn from
    the worker's rng (or the worker id), the rest derived from the ids."""
    ids = np.arange(n, dtype=np.int64) + wid * WSPAN + k * KSPAN
    feat = np.empty((n, width), np.float32)
    feat[:, 0] = ids
    feat[:, 1] = rng.random(n) if rng is not None else wid
    if width > 2:
        feat[:, 2:] = (ids % 97)[:, None] + np.arange(width - 2, dtype=np.float32)
    return [ids, feat]


def new_delay_seed() -> int:
    """Every run perturbs the timing differently (the seed is in the messages)."""
    return random.SystemRandom().randrange(2**32)


class Fetch:
    """A plain fetcher (replayed on resume).  Module level: it pickles.

    Worker ``wid``'s call ``k`` (``k < lengths[wid]``) returns chunk (wid, k)
    of ``chunk_size(salt, wid, k)`` samples, or ``None`` when (wid, k) is in
    ``none_at``, raises ``ValueError`` in ``raise_at``, returns a malformed
    chunk in ``bad_at``; call ``lengths[wid]`` raises StopIteration.  Before
    each call it sleeps a small random delay drawn from ``delay_seed`` (so the
    timing is a function of the run, the data is not).  Per-worker state is
    keyed by worker id: in threads the object is shared, in processes each
    worker has a copy.
    """

    stateful = False

    def __init__(
        self,
        lengths: dict[int, int],
        *,
        salt: int = 0,
        delay_seed: int | None = None,
        max_delay: float = 0.002,
        none_at: Iterable[tuple[int, int]] = (),
        raise_at: Iterable[tuple[int, int]] = (),
        bad_at: Iterable[tuple[int, int]] = (),
        width: int = 2,
        use_rng: bool = True,
        fast: Iterable[int] = (),
        scale: int = 1,
    ) -> None:
        self.lengths = dict(lengths)
        #: chunk sizes are multiplied by this
        self.scale = scale
        self.salt = salt
        self.delay_seed = delay_seed
        self.max_delay = max_delay
        self.none_at = frozenset(none_at)
        self.raise_at = frozenset(raise_at)
        self.bad_at = frozenset(bad_at)
        self.width = width
        self.use_rng = use_rng
        #: workers that never sleep (their results arrive long before the others')
        self.fast = frozenset(fast)
        #: per worker id: calls made (each key is written by one worker only)
        self.invocations: dict[int, int] = {}

    def _delay(self, wid: int, k: int) -> None:
        if self.delay_seed is None or wid in self.fast:
            return
        r = random.Random(f"delay:{self.delay_seed}:{wid}:{k}")
        scale = (0.0, 1.0, 3.0)[(self.delay_seed + wid) % 3]
        d = r.random() ** 2 * self.max_delay * scale
        if d > 0:
            time.sleep(d)

    def _produce(self, wid: int, k: int) -> Any:
        self._delay(wid, k)
        if (wid, k) in self.raise_at:
            raise ValueError(f"worker {wid} fails at call {k}")
        if (wid, k) in self.none_at:
            return None
        if (wid, k) in self.bad_at:
            # blobs with different sample counts: a malformed chunk
            return [np.zeros(2, np.int64), np.zeros((3, self.width), np.float32)]
        info = get_worker_info()
        assert info is not None and info.worker_id == wid
        rng = info.rng if self.use_rng else None
        return make_chunk(wid, k, chunk_size(self.salt, wid, k) * self.scale, self.width, rng)

    def __call__(self, worker_id: int, batch_size: int) -> Any:
        self.invocations[worker_id] = self.invocations.get(worker_id, 0) + 1
        k = self.invocations[worker_id] - 1
        if k >= self.lengths.get(worker_id, 0):
            raise StopIteration
        return self._produce(worker_id, k)


#: what the copies of a StatefulFetch did, by its ``tally`` name (threads only)
TALLIES: dict[str, dict[str, dict[int, int]]] = {}
_TALLY_LOCK = threading.Lock()


def _count(tally: str | None, what: str, wid: int) -> None:
    if tally is None:
        return
    with _TALLY_LOCK:
        per = TALLIES.setdefault(tally, {}).setdefault(what, {})
        per[wid] = per.get(wid, 0) + 1


class StatefulFetch(Fetch):
    """A fetcher that saves and restores its own position: its state is a
    JSON dict of per-worker counters, ``{"next": {str(worker id): next call}}``,
    saved and restored whole (blobfeed gives each worker a copy of a stateful
    fetcher, so a copy's state is its worker's position).  It does not use the
    rng: the rng's state is not part of its state.  ``tally``: count calls and
    loads in ``TALLIES[tally]`` (the copies are blobfeed's).
    """

    stateful = True

    def __init__(self, lengths: dict[int, int], *, tally: str | None = None, **kw: Any) -> None:
        kw.setdefault("use_rng", False)
        super().__init__(lengths, **kw)
        self.next: dict[str, int] = {}
        self.tally = tally

    def __call__(self, worker_id: int, batch_size: int) -> Any:
        _count(self.tally, "calls", worker_id)
        key = str(worker_id)
        k = self.next.get(key, 0)
        if k >= self.lengths.get(worker_id, 0):
            raise StopIteration
        self.next[key] = k + 1
        return self._produce(worker_id, k)

    def state_dict(self) -> dict[str, Any]:
        return {"next": dict(self.next)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        info = get_worker_info()
        assert info is not None, "load_state_dict is called in the worker"
        _count(self.tally, "loads", info.worker_id)
        self.next = {str(w): int(k) for w, k in state["next"].items()}


class CountingFetch(Fetch):
    """A plain fetcher that sets ``reached`` once ``target`` calls were made in
    all (threads only: the event lives in this process)."""

    def __init__(self, lengths: dict[int, int], target: int, **kw: Any) -> None:
        super().__init__(lengths, **kw)
        self.target = target
        self.reached = threading.Event()
        self._lock = threading.Lock()
        self.total = 0

    def __call__(self, worker_id: int, batch_size: int) -> Any:
        with self._lock:
            self.total += 1
            if self.total >= self.target:
                self.reached.set()
        return super().__call__(worker_id, batch_size)


# ---------------------------------------------------------------------------------------------
# The expected stream, computed from the rules alone
# ---------------------------------------------------------------------------------------------
ERROR = "error"


def lanes_of(fetch: Fetch, worker_ids: Sequence[int], seed: int, *, skip: bool) -> list[list[Any]]:
    """Per worker, its chunks in call order (holes removed); a lane that fails
    ends with ERROR (``skip``: exceptions and malformed chunks are holes)."""
    lanes = []
    for wid in worker_ids:
        rng = np.random.default_rng(worker_seeds(seed, wid)[0]) if fetch.use_rng else None
        lane: list[Any] = []
        for k in range(fetch.lengths.get(wid, 0)):
            if (wid, k) in fetch.raise_at or (wid, k) in fetch.bad_at:
                if skip:
                    continue
                lane.append(ERROR)
                break
            if (wid, k) in fetch.none_at:
                continue
            lane.append(make_chunk(wid, k, chunk_size(fetch.salt, wid, k) * fetch.scale, fetch.width, rng))
        lanes.append(lane)
    return lanes


def round_robin(lanes: Sequence[Sequence[Any]]) -> list[Any]:
    """First item of every lane, then every lane's second, ...; an ERROR ends the stream."""
    stream: list[Any] = []
    depth = max((len(lane) for lane in lanes), default=0)
    for i in range(depth):
        for lane in lanes:
            if i < len(lane):
                stream.append(lane[i])
                if lane[i] is ERROR:
                    return stream
    return stream


def cut(stream: Sequence[Any], bs: int, *, drop_last: bool, width: int) -> tuple[list[Batch], bool]:
    """The batches of ``stream``; True when the stream ends with an error
    (then only the complete batches before it)."""
    failed = bool(stream) and stream[-1] is ERROR
    chunks = [c for c in stream if c is not ERROR]
    if chunks:
        ids = np.concatenate([c[0] for c in chunks])
        feat = np.concatenate([c[1] for c in chunks])
    else:
        ids, feat = np.empty(0, np.int64), np.empty((0, width), np.float32)
    n = len(ids)
    out = [(ids[i:i + bs], feat[i:i + bs]) for i in range(0, n - n % bs, bs)]
    if n % bs and not drop_last and not failed:
        out.append((ids[n - n % bs:], feat[n - n % bs:]))
    return out, failed


def expected(
    fetch: Fetch, n_workers: int, bs: int, *, seed: int = SEED, drop_last: bool = False, skip: bool = False,
) -> tuple[list[Batch], bool]:
    return cut(round_robin(lanes_of(fetch, range(n_workers), seed, skip=skip)), bs,
               drop_last=drop_last, width=fetch.width)


def split(batches: Sequence[Batch], k: int) -> list[list[Batch]]:
    """Global batch i goes to net i mod k."""
    return [list(batches[j::k]) for j in range(k)]


def assert_batches(got: Sequence[Batch], want: Sequence[Batch], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0].shape == w[0].shape, (
            f"{what}: batch {i} has {len(g[0])} samples, expected {len(w[0])}\n"
            f"got ids {g[0].tolist()}\nwant ids {w[0].tolist()}"
        )
        assert np.array_equal(g[0], w[0]), f"{what}: batch {i}\ngot ids  {g[0].tolist()}\nwant ids {w[0].tolist()}"
        assert g[1].dtype == w[1].dtype and np.array_equal(g[1], w[1]), f"{what}: batch {i}: feat differs"
    assert len(got) == len(want), (
        f"{what}: {len(got)} batches, expected {len(want)} "
        f"(sizes got {[len(b[0]) for b in got]}, want {[len(b[0]) for b in want]})"
    )


# ---------------------------------------------------------------------------------------------
# Running a pipeline
# ---------------------------------------------------------------------------------------------
def wire(
    gc: blobfeed.GlobalCoordinator,
    fetch: Fetch,
    *,
    workers: Sequence[int] = (3,),
    bs: int = 8,
    seed: int = SEED,
    backend: Any = "threads",
    drop_last: bool = False,
    on_error: Any = "raise",
    max_buffered: int = 8,
    names: Sequence[str] | None = None,
    blobs: Sequence[str] = BLOBS,
) -> list[Net]:
    """One ``init_data_input_workers`` call per entry of ``workers`` (its worker
    count), each feeding a net of its own from source SRC."""
    nets = []
    for i, n in enumerate(workers):
        net = Net(name=names[i] if names is not None else f"net{i}")
        init_data_input_workers(
            net, list(blobs), fetch, bs, num_worker_threads=n, coordinator=gc, deterministic=True,
            seed=seed, backend=backend, drop_last=drop_last, on_error=on_error,
            max_buffered_batches=max_buffered,
        )
        nets.append(net)
    return nets


def take_one(net: Net) -> Batch:
    out = net.run(timeout=WAIT)
    return np.array(out[BLOBS[0]]), np.array(out[BLOBS[1]])


def consume(nets: Sequence[Net], limit: int | None = None) -> tuple[list[list[Batch]], list[BaseException | None]]:
    """Run the nets in the order the stream deals (global batch i from net
    i mod k) until each raised EndOfInput or FetcherError, or ``limit``
    batches were taken in all.  Returns the batches per net and what ended each."""
    k = len(nets)
    got: list[list[Batch]] = [[] for _ in nets]
    ends: list[BaseException | None] = [None] * k
    i = taken = 0
    while any(e is None for e in ends) and (limit is None or taken < limit):
        j = i % k
        i += 1
        if ends[j] is not None:
            continue
        try:
            got[j].append(take_one(nets[j]))
        except (EndOfInput, FetcherError) as exc:
            ends[j] = exc
            continue
        taken += 1
    return got, ends


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint file gives back."""
    return json.loads(json.dumps(state))


class Run:
    """One pipeline's outcome."""

    def __init__(self, got: list[list[Batch]], ends: list[BaseException | None], state: dict[str, Any] | None) -> None:
        self.got, self.ends, self.state = got, ends, state
        #: the state saved right after start(), before any run() (save_before_run)
        self.early: dict[str, Any] | None = None

    @property
    def flat(self) -> list[Batch]:
        """The batches in global order (as dealt: net i mod k)."""
        out: list[Batch] = []
        its = [iter(g) for g in self.got]
        k = len(its)
        i = 0
        left = sum(len(g) for g in self.got)
        while left:
            b = next(its[i % k], None)
            if b is not None:
                out.append(b)
                left -= 1
            i += 1
        return out


def pipeline(
    fetch: Fetch,
    *,
    load: dict[str, Any] | None = None,
    take: int | None = None,
    extra: int = 0,
    save: bool = False,
    wait: Callable[[], None] | None = None,
    save_before_run: bool = False,
    **kw: Any,
) -> Run:
    """A fresh coordinator: wire, load ``load``, start, run the nets (all, or
    ``take`` batches in stream order then ``extra`` more from net 0), save."""
    gc = blobfeed.GlobalCoordinator()
    try:
        nets = wire(gc, fetch, **kw)
        if load is not None:
            gc.load_state_dict(SRC, load)
        gc.start()
        early = roundtrip(gc.state_dict(SRC)) if save_before_run else None
        got, ends = consume(nets, take)
        for _ in range(extra):
            if ends[0] is not None:
                break
            try:
                got[0].append(take_one(nets[0]))
            except EndOfInput as exc:
                ends[0] = exc
        if wait is not None:
            wait()
        state = roundtrip(gc.state_dict(SRC)) if save else None
        run = Run(got, ends, state)
        run.early = early
        return run
    finally:
        assert gc.stop(timeout=5.0), "a thread outlived stop()"


def assert_ended(run: Run, what: str) -> None:
    for j, e in enumerate(run.ends):
        assert isinstance(e, EndOfInput), f"{what}: net {j} ended with {e!r}, expected EndOfInput"


# ---------------------------------------------------------------------------------------------
# 1. The exact stream
# ---------------------------------------------------------------------------------------------
#: uneven workers: one with no data at all, one far longer than the others
LENGTHS = {0: 7, 1: 3, 2: 0, 3: 11}
HOLES = {(0, 1), (3, 0), (3, 5), (1, 2)}


@pytest.mark.parametrize("bs", [1, 5, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_stream_is_strict_round_robin_rebatched(bs: int, drop_last: bool) -> None:
    delay_seed = new_delay_seed()
    fetch = Fetch(LENGTHS, salt=bs, delay_seed=delay_seed, none_at=HOLES)
    want, failed = expected(fetch, 4, bs, drop_last=drop_last)
    assert not failed
    whole = sum(len(b[0]) for b in expected(fetch, 4, bs)[0])
    assert bs == 1 or whole % bs, "the plan should end with a partial batch"
    if drop_last:
        assert sum(len(b[0]) for b in want) == whole - whole % bs
    run = pipeline(fetch, workers=(4,), bs=bs, drop_last=drop_last)
    assert_ended(run, f"delay_seed={delay_seed}")
    assert_batches(run.got[0], want, f"bs={bs} drop_last={drop_last} delay_seed={delay_seed}")
    for b in run.got[0][:-1]:
        assert len(b[0]) == bs


def test_stream_matches_when_each_worker_is_slow_in_turn() -> None:
    """A worker whose chunks arrive last still comes first in the stream."""
    for slow in range(3):
        fetch = Fetch({0: 6, 1: 6, 2: 6}, salt=slow, delay_seed=new_delay_seed(), max_delay=0.004,
                      fast=[w for w in range(3) if w != slow])
        want, _ = expected(fetch, 3, 7)
        run = pipeline(fetch, workers=(3,), bs=7)
        assert_ended(run, f"slow={slow}")
        assert_batches(run.got[0], want, f"slow worker {slow}")


def test_skipped_calls_take_no_turn() -> None:
    """None, an exception and a malformed chunk, all with on_error='skip':
    the worker's next chunk takes its turn."""
    delay_seed = new_delay_seed()
    fetch = Fetch({0: 6, 1: 6, 2: 5}, salt=3, delay_seed=delay_seed,
                  none_at={(0, 0), (2, 3)}, raise_at={(1, 1), (1, 2)}, bad_at={(0, 4), (2, 0)})
    want, failed = expected(fetch, 3, 6, skip=True)
    assert not failed
    run = pipeline(fetch, workers=(3,), bs=6, on_error="skip")
    assert_ended(run, f"delay_seed={delay_seed}")
    assert_batches(run.got[0], want, f"holes skipped, delay_seed={delay_seed}")


# ---------------------------------------------------------------------------------------------
# 2. Run to run, backend to backend
# ---------------------------------------------------------------------------------------------
def test_two_runs_give_identical_batches() -> None:
    runs = []
    for _ in range(2):
        fetch = Fetch(LENGTHS, salt=11, delay_seed=new_delay_seed(), none_at=HOLES)
        runs.append(pipeline(fetch, workers=(4,), bs=6))
    want, _ = expected(Fetch(LENGTHS, salt=11, none_at=HOLES), 4, 6)
    assert_batches(runs[0].got[0], runs[1].got[0], "second run against the first")
    assert_batches(runs[0].got[0], want, "first run against the rules")


def test_another_seed_gives_other_rng_values_same_ids() -> None:
    """The seed reaches the workers' rng; the ids (the chunk order) do not depend on it."""
    a = pipeline(Fetch({0: 3, 1: 3}), workers=(2,), bs=4, seed=1)
    b = pipeline(Fetch({0: 3, 1: 3}), workers=(2,), bs=4, seed=2)
    assert [x[0].tolist() for x in a.got[0]] == [x[0].tolist() for x in b.got[0]]
    assert not all(np.array_equal(x[1], y[1]) for x, y in zip(a.got[0], b.got[0]))
    assert_batches(a.got[0], expected(Fetch({0: 3, 1: 3}), 2, 4, seed=1)[0], "seed 1")


def test_big_batches_keep_the_order() -> None:
    """Batches of 1 MiB or more are assembled outside the feed's lock (into
    recycled buffers); chunks of 40 to 440 wide rows, two nets."""
    delay_seed = new_delay_seed()

    def make() -> Fetch:
        return Fetch({0: 4, 1: 3, 2: 5}, salt=71, delay_seed=delay_seed, width=1024, scale=40)

    bs = 300  # 300 x 4104 B: a big batch
    want, _ = expected(make(), 3, bs)
    assert len(want) >= 6
    run = pipeline(make(), workers=(2, 1), bs=bs)
    assert_ended(run, "big batches")
    for j, part in enumerate(split(want, 2)):
        assert_batches(run.got[j], part, f"big batches, net{j}, delay_seed={delay_seed}")
    resume_and_check(make, want, take=3, workers=(2, 1), bs=bs, what="big batches, resumed")


# ---------------------------------------------------------------------------------------------
# 3. Several nets on one source
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [False, True])
def test_several_nets_get_global_batches_in_turn(drop_last: bool) -> None:
    """Three calls of 2, 1 and 2 workers: lanes 0..4 in that order; batch i to net i mod 3."""
    delay_seed = new_delay_seed()
    lengths = {0: 4, 1: 6, 2: 3, 3: 0, 4: 7}
    fetch = Fetch(lengths, salt=21, delay_seed=delay_seed, none_at={(4, 2)})
    want, _ = expected(fetch, 5, 5, drop_last=drop_last)
    run = pipeline(fetch, workers=(2, 1, 2), bs=5, drop_last=drop_last)
    assert_ended(run, f"delay_seed={delay_seed}")
    for j, part in enumerate(split(want, 3)):
        assert_batches(run.got[j], part, f"net{j}, drop_last={drop_last}, delay_seed={delay_seed}")


def test_several_nets_consumed_from_their_own_threads() -> None:
    """The deal does not depend on who asks first: each net drains in a thread of its own."""
    delay_seed = new_delay_seed()
    fetch = Fetch({0: 8, 1: 5, 2: 9}, salt=8, delay_seed=delay_seed)
    want, _ = expected(fetch, 3, 4)
    gc = blobfeed.GlobalCoordinator()
    results: dict[int, Any] = {}
    try:
        nets = wire(gc, fetch, workers=(1, 1, 1), bs=4)
        gc.start()

        def drain(j: int) -> None:
            try:
                results[j] = consume([nets[j]])
            except BaseException as exc:  # reported below
                results[j] = exc

        threads = [threading.Thread(target=drain, args=(j,), name=f"test-consumer-{j}") for j in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3 * WAIT)
        assert not any(t.is_alive() for t in threads), "a consumer hangs"
    finally:
        assert gc.stop(timeout=5.0)
    for j, part in enumerate(split(want, 3)):
        assert not isinstance(results.get(j), BaseException), f"net{j}'s consumer raised {results[j]!r}"
        got, ends = results[j]
        assert isinstance(ends[0], EndOfInput), ends
        assert_batches(got[0], part, f"net{j} (own thread), delay_seed={delay_seed}")


# ---------------------------------------------------------------------------------------------
# 4. Errors at their place in the stream
# ---------------------------------------------------------------------------------------------
ERR_LENGTHS = {0: 8, 1: 8, 2: 8}
ERR_AT = {(1, 2)}  # worker 1's 3rd call


def check_error_run(run: Run, want: list[Batch], what: str) -> None:
    assert_batches(run.flat, want, what)
    for j, e in enumerate(run.ends):
        assert isinstance(e, FetcherError), f"{what}: net {j} ended with {e!r}, expected FetcherError"
        assert isinstance(e.__cause__, ValueError) and "worker 1 fails at call 2" in str(e.__cause__), e.__cause__


def test_error_surfaces_after_the_batches_before_it_every_run() -> None:
    """Worker 1 fails at once, before the others have fetched much: the nets
    still get every complete batch the stream holds before the error."""
    bs = 5
    want, failed = expected(Fetch(ERR_LENGTHS, salt=2, raise_at=ERR_AT), 3, bs)
    assert failed
    stream = round_robin(lanes_of(Fetch(ERR_LENGTHS, salt=2, raise_at=ERR_AT), range(3), SEED, skip=False))
    before = sum(len(c[0]) for c in stream[:-1])
    assert before % bs, "the error should fall inside a batch (the incomplete batch is dropped)"
    assert len(want) == before // bs >= 2
    counts = []
    for _ in range(3):
        delay_seed = new_delay_seed()
        # the failing worker never sleeps: its error is there long before the others' chunks
        fetch = Fetch(ERR_LENGTHS, salt=2, raise_at=ERR_AT, delay_seed=delay_seed, max_delay=0.004, fast=[1])
        run = pipeline(fetch, workers=(3,), bs=bs)
        check_error_run(run, want, f"delay_seed={delay_seed}")
        counts.append(len(run.got[0]))
    assert len(set(counts)) == 1, counts


@pytest.mark.parametrize("kind", ["raise", "bad"])
def test_error_kinds_surface_at_their_place(kind: str) -> None:
    """An exception (FetcherError) and a malformed chunk (ChunkError) alike."""
    spot: dict[str, Any] = {"raise_at": ERR_AT} if kind == "raise" else {"bad_at": ERR_AT}
    delay_seed = new_delay_seed()
    fetch = Fetch(ERR_LENGTHS, salt=9, delay_seed=delay_seed, fast=[1], **spot)
    want, failed = expected(fetch, 3, 4)
    assert failed and want
    run = pipeline(fetch, workers=(3,), bs=4)
    assert_batches(run.got[0], want, f"{kind}, delay_seed={delay_seed}")
    err = run.ends[0]
    assert isinstance(err, blobfeed.ChunkError if kind == "bad" else FetcherError), repr(err)
    assert "worker 1" in str(err)


@pytest.mark.parametrize("where", ["before", "after"])
def test_resume_meets_the_error_at_the_same_place(where: str) -> None:
    """A state saved before the error resumes to the rest of the batches, then
    the same error; one saved after it resumes to the error at once."""

    def make() -> Fetch:
        return Fetch(ERR_LENGTHS, salt=2, raise_at=ERR_AT, delay_seed=new_delay_seed(), fast=[1])

    want, _ = expected(make(), 3, 5)
    first = pipeline(make(), take=1 if where == "before" else None, save=True, workers=(3,), bs=5)
    if where == "after":
        assert isinstance(first.ends[0], FetcherError)
    second = pipeline(make(), load=first.state, workers=(3,), bs=5)
    assert_batches(first.got[0] + second.got[0], want, f"resumed {where} the error")
    assert isinstance(second.ends[0], FetcherError), repr(second.ends[0])


def test_error_is_sticky_after_the_stream_reached_it() -> None:
    """docs/CONTRACT.md, "Timing and stickiness": once a source has failed,
    every later run() of its nets raises that FetcherError, even after stop()."""
    fetch = Fetch(ERR_LENGTHS, salt=2, raise_at=ERR_AT, delay_seed=new_delay_seed())
    want, _ = expected(fetch, 3, 5)
    gc = blobfeed.GlobalCoordinator()
    try:
        (net,) = wire(gc, fetch, workers=(3,), bs=5)
        gc.start()
        got, ends = consume([net])
        assert_batches(got[0], want, "before the error")
        assert isinstance(ends[0], FetcherError)
        with pytest.raises(FetcherError):
            net.run(timeout=WAIT)
        assert gc.should_stop()
    finally:
        assert gc.stop(timeout=5.0)
    with pytest.raises(FetcherError):
        net.run(timeout=WAIT)


def test_error_accounting_every_fetched_sample_delivered_or_dropped() -> None:
    """The incomplete batch before the error is dropped and counted (reason
    "error"); after stop(), fetched == delivered + dropped."""
    bs = 5
    fetch = Fetch(ERR_LENGTHS, salt=2, raise_at=ERR_AT, delay_seed=new_delay_seed(), fast=[1])
    want, _ = expected(fetch, 3, bs)
    stream = round_robin(lanes_of(fetch, range(3), SEED, skip=False))
    incomplete = sum(len(c[0]) for c in stream[:-1]) % bs
    assert incomplete
    gc = blobfeed.GlobalCoordinator()
    try:
        (net,) = wire(gc, fetch, workers=(3,), bs=bs)
        gc.start()
        got, ends = consume([net])
        assert isinstance(ends[0], FetcherError)
        assert_batches(got[0], want, "before the error")
    finally:
        assert gc.stop(timeout=5.0)

    def value(name: str, **labels: str) -> float:
        v = gc.registry.get_sample_value(name, {"source": SRC, **labels})
        return 0.0 if v is None else v

    fetched = value("blobfeed_fetched_samples_total")
    delivered = value("blobfeed_delivered_samples_total", net="net0")
    dropped = {r: value("blobfeed_dropped_samples_total", reason=r) for r in ("error", "stopped", "drop_last")}
    assert delivered == sum(len(b[0]) for b in want)
    assert dropped["error"] >= incomplete, dropped
    assert fetched == delivered + sum(dropped.values()), (fetched, delivered, dropped)


def test_error_with_two_nets_reaches_both_after_their_batches() -> None:
    delay_seed = new_delay_seed()
    fetch = Fetch(ERR_LENGTHS, salt=2, raise_at=ERR_AT, delay_seed=delay_seed, fast=[1])
    want, _ = expected(fetch, 3, 3)
    run = pipeline(fetch, workers=(2, 1), bs=3)
    check_error_run(run, want, f"two nets, delay_seed={delay_seed}")


def test_error_in_a_worker_process_at_the_same_place() -> None:
    fetch = Fetch(ERR_LENGTHS, salt=2, raise_at=ERR_AT, delay_seed=new_delay_seed(), fast=[1])
    want, _ = expected(fetch, 3, 5)
    run = pipeline(fetch, workers=(3,), bs=5, backend="processes")
    check_error_run(run, want, "processes")


# ---------------------------------------------------------------------------------------------
# 5. state_dict / load_state_dict
# ---------------------------------------------------------------------------------------------
def resume_and_check(
    make: Callable[[], Fetch],
    want: list[Batch],
    *,
    take: int,
    extra: int = 0,
    workers: Sequence[int],
    bs: int,
    what: str,
    backends: tuple[str, str] = ("threads", "threads"),
    **kw: Any,
) -> tuple[Run, Run]:
    """Run ``take`` (+ ``extra`` on net 0) batches, save, resume in a new
    pipeline: per net, before + after == the uninterrupted batches."""
    k = len(workers)
    first = pipeline(make(), take=take, extra=extra, save=True, workers=workers, bs=bs, backend=backends[0], **kw)
    state = first.state
    assert state is not None
    second = pipeline(make(), load=state, workers=workers, bs=bs, backend=backends[1], **kw)
    assert_ended(second, what)
    for j, part in enumerate(split(want, k)):
        assert_batches(first.got[j] + second.got[j], part, f"{what}: net{j} (state {json.dumps(state)})")
    return first, second


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(0, 8), min_size=1, max_size=4),
    bs=st.integers(1, 9),
    salt=st.integers(0, 10**6),
    where=st.floats(0.0, 1.0),
    n_nets=st.integers(1, 3),
    extra=st.integers(0, 2),
    stateful=st.booleans(),
    holes=st.sets(st.tuples(st.integers(0, 3), st.integers(0, 7), st.sampled_from(["none", "raise", "bad"])),
                  max_size=4),
    drop_last=st.booleans(),
)
def test_resume_anywhere_gives_the_uninterrupted_batches(
    lengths: list[int], bs: int, salt: int, where: float, n_nets: int, extra: int, stateful: bool,
    holes: set[tuple[int, int, str]], drop_last: bool,
) -> None:
    n_workers = len(lengths)
    n_nets = min(n_nets, n_workers)
    # one init call per net, the workers shared out (the first calls get one more)
    workers = [n_workers // n_nets + (i < n_workers % n_nets) for i in range(n_nets)]
    plan = {w: n for w, n in enumerate(lengths)}
    spots = {kind: {(w, k) for w, k, x in holes if x == kind} for kind in ("none", "raise", "bad")}
    cls = StatefulFetch if stateful else Fetch

    def make() -> Fetch:
        return cls(plan, salt=salt, delay_seed=new_delay_seed(), none_at=spots["none"],
                   raise_at=spots["raise"], bad_at=spots["bad"])

    want, _ = expected(make(), n_workers, bs, drop_last=drop_last, skip=True)
    what = f"lengths={lengths} bs={bs} nets={n_nets} stateful={stateful} holes={sorted(holes)}"
    # the uninterrupted run is the stream the rules give
    whole = pipeline(make(), workers=workers, bs=bs, on_error="skip", drop_last=drop_last)
    assert_ended(whole, what)
    for j, part in enumerate(split(want, n_nets)):
        assert_batches(whole.got[j], part, f"{what}: uninterrupted, net{j}")
    take = round(where * len(want))
    resume_and_check(make, want, take=take, extra=extra if n_nets > 1 else 0, workers=workers, bs=bs,
                     what=f"{what} take={take} extra={extra}", on_error="skip", drop_last=drop_last)


@pytest.mark.parametrize("stateful", [False, True])
@pytest.mark.parametrize("take", [0, 1, 4, 9])
def test_resume_at_fixed_points(stateful: bool, take: int) -> None:
    plan = {0: 6, 1: 4, 2: 7}
    cls = StatefulFetch if stateful else Fetch

    def make() -> Fetch:
        return cls(plan, salt=99, delay_seed=new_delay_seed(), none_at={(1, 1)})

    want, _ = expected(make(), 3, 4)
    assert len(want) > 9
    resume_and_check(make, want, take=take, workers=(3,), bs=4, what=f"stateful={stateful} take={take}")


def test_resume_twice_in_a_row() -> None:
    """A state saved by a resumed pipeline resumes as well."""
    plan = {0: 6, 1: 4, 2: 7}

    def make() -> Fetch:
        return Fetch(plan, salt=7, delay_seed=new_delay_seed())

    want, _ = expected(make(), 3, 5)
    a = pipeline(make(), take=3, save=True, workers=(3,), bs=5)
    b = pipeline(make(), load=a.state, take=4, save=True, workers=(3,), bs=5)
    c = pipeline(make(), load=b.state, workers=(3,), bs=5)
    assert_ended(c, "third pipeline")
    assert_batches(a.got[0] + b.got[0] + c.got[0], want, "three pipelines")


def test_stateful_fetcher_is_restored_not_replayed() -> None:
    """A stateful fetch_fun gets load_state_dict() once per worker and makes
    no call for the chunks before the position; a plain one is replayed."""
    plan = {0: 8, 1: 8}
    calls_whole = sum(plan.values()) + len(plan)  # each worker's last call raises StopIteration
    # stateful: counted in TALLIES (blobfeed calls copies of it)
    want, _ = expected(StatefulFetch(plan, salt=4), 2, 4)
    tally = f"restored-{new_delay_seed()}"
    first = pipeline(StatefulFetch(plan, salt=4), take=len(want) // 2, save=True, workers=(2,), bs=4)
    second = pipeline(StatefulFetch(plan, salt=4, tally=tally), load=first.state, workers=(2,), bs=4)
    assert_batches(first.got[0] + second.got[0], want, "stateful")
    counts = TALLIES.pop(tally)
    assert counts.get("loads") == {0: 1, 1: 1}, counts
    made = sum(counts["calls"].values())
    assert made < calls_whole - 4, f"the restored fetcher made {made} calls of {calls_whole}"
    # plain: replayed, so the resumed pipeline makes every call again
    want, _ = expected(Fetch(plan, salt=4), 2, 4)
    first = pipeline(Fetch(plan, salt=4), take=len(want) // 2, save=True, workers=(2,), bs=4)
    fetch = Fetch(plan, salt=4)
    second = pipeline(fetch, load=first.state, workers=(2,), bs=4)
    assert_batches(first.got[0] + second.got[0], want, "plain")
    made = sum(fetch.invocations.values())
    assert made == calls_whole, f"the replayed fetcher made {made} calls, expected {calls_whole}"


def test_saving_does_not_disturb_the_run() -> None:
    """state_dict() in the middle of a run: the run goes on unchanged, and the
    state resumes to its rest."""
    plan = {0: 7, 1: 5, 2: 6}

    def make() -> Fetch:
        return Fetch(plan, salt=37, delay_seed=new_delay_seed())

    want, _ = expected(make(), 3, 4)
    gc = blobfeed.GlobalCoordinator()
    try:
        (net,) = wire(gc, make(), workers=(3,), bs=4)
        gc.start()
        head, _ = consume([net], 3)
        states = [roundtrip(gc.state_dict(SRC)) for _ in range(3)]
        assert states[0] == states[1] == states[2], "state_dict() twice at one position differs"
        tail, ends = consume([net])
        assert isinstance(ends[0], EndOfInput)
    finally:
        assert gc.stop(timeout=5.0)
    assert_batches(head[0] + tail[0], want, "a run with a save in the middle")
    resumed = pipeline(make(), load=states[0], workers=(3,), bs=4)
    assert_batches(head[0] + resumed.got[0], want, "resumed from the middle")


def test_save_right_after_load_is_the_loaded_position() -> None:
    """load, start, state_dict before any run(): the same position, and resuming
    from it gives the continuation."""
    plan = {0: 6, 1: 5, 2: 6}

    def make() -> Fetch:
        return Fetch(plan, salt=13, delay_seed=new_delay_seed(), none_at={(0, 2)})

    want, _ = expected(make(), 3, 4)
    per_net = split(want, 2)
    # two nets, net 0 one batch ahead: the position is the slower net's
    a = pipeline(make(), take=5, extra=1, save=True, workers=(1, 2), bs=4)
    b = pipeline(make(), load=a.state, take=0, save=True, save_before_run=True, workers=(1, 2), bs=4)
    assert b.early == a.state, f"saved right after load:\n{b.early}\nloaded:\n{a.state}"
    assert b.state == a.state
    c = pipeline(make(), load=b.early, workers=(1, 2), bs=4)
    assert_ended(c, "resumed from the state saved right after a load")
    for j in range(2):
        assert_batches(a.got[j] + c.got[j], per_net[j], f"net{j}")


def test_save_at_the_end() -> None:
    plan = {0: 5, 1: 3}

    def make() -> Fetch:
        return Fetch(plan, salt=17, delay_seed=new_delay_seed())

    want, _ = expected(make(), 2, 6)
    a = pipeline(make(), save=True, workers=(2,), bs=6)
    assert_ended(a, "first run")
    assert_batches(a.got[0], want, "first run")
    b = pipeline(make(), load=a.state, save=True, workers=(2,), bs=6)
    assert_ended(b, "resumed at the end")
    assert b.got == [[]], "a pipeline resumed at the end delivers nothing"
    assert b.state == a.state


def test_save_before_start_and_before_any_run_is_the_start() -> None:
    plan = {0: 4, 1: 4}

    def make() -> Fetch:
        return Fetch(plan, salt=3, delay_seed=new_delay_seed())

    want, _ = expected(make(), 2, 3)
    gc = blobfeed.GlobalCoordinator()
    try:
        wire(gc, make(), workers=(2,), bs=3)
        before = roundtrip(gc.state_dict(SRC))
    finally:
        assert gc.stop(timeout=5.0)
    run = pipeline(make(), load=before, workers=(2,), bs=3)
    assert_batches(run.got[0], want, "resumed from a state saved before start()")


def test_save_while_workers_are_far_ahead() -> None:
    """The workers fetched far more than the nets consumed: the state is the
    nets' position, and what was prefetched is fetched again on resume."""
    plan = {0: 30, 1: 30, 2: 30}
    delay_seed = new_delay_seed()
    target = 45  # more than 3 x 15 chunks: well past what 2 batches of 5 consume
    fetch = CountingFetch(plan, target, salt=31)
    want, _ = expected(fetch, 3, 5)

    def wait_far_ahead() -> None:
        assert fetch.reached.wait(WAIT), f"the workers made only {fetch.total} calls"

    a = pipeline(fetch, take=2, save=True, wait=wait_far_ahead, workers=(3,), bs=5, max_buffered=800)
    assert fetch.total >= target
    b = pipeline(Fetch(plan, salt=31, delay_seed=delay_seed), load=a.state, workers=(3,), bs=5)
    assert_ended(b, "resumed")
    assert_batches(a.got[0] + b.got[0], want, "saved with the workers far ahead")


def test_resume_across_backends_plain_threads_to_processes() -> None:
    plan = {0: 6, 1: 3, 2: 5}

    def make() -> Fetch:
        return Fetch(plan, salt=41, delay_seed=new_delay_seed(), none_at={(2, 0)}, width=1024)

    want, _ = expected(make(), 3, 7)
    resume_and_check(make, want, take=3, workers=(3,), bs=7, what="threads -> processes",
                     backends=("threads", "processes"))


def test_resume_across_backends_stateful_processes_to_threads() -> None:
    plan = {0: 6, 1: 3, 2: 5}

    def make() -> Fetch:
        return StatefulFetch(plan, salt=43, delay_seed=new_delay_seed())

    want, _ = expected(make(), 3, 4)
    resume_and_check(make, want, take=4, workers=(3,), bs=4, what="stateful processes -> threads",
                     backends=("processes", "threads"))


def test_state_is_json_and_names_its_layout() -> None:
    run = pipeline(Fetch({0: 3, 1: 3}, salt=1), take=1, save=True, workers=(2,), bs=4)
    state = run.state
    assert state is not None
    assert json.loads(json.dumps(state)) == state
    assert state["num_workers"] == 2 and state["batch_size"] == 4 and state["version"] == STATE_VERSION


def test_state_dict_with_two_nets_sharing_a_name() -> None:
    """The contract lets nets of one source share a name (a warning); their
    positions must still be saved and restored, one per net."""
    plan = {0: 6, 1: 6}

    def make() -> Fetch:
        return Fetch(plan, salt=51, delay_seed=new_delay_seed())

    want, _ = expected(make(), 2, 3)
    resume_and_check(make, want, take=3, extra=1, workers=(1, 1), bs=3, names=("same", "same"),
                     what="nets sharing a name")


# ---------------------------------------------------------------------------------------------
# 6. Refusals
# ---------------------------------------------------------------------------------------------
def saved_state(**kw: Any) -> dict[str, Any]:
    kw.setdefault("workers", (3,))
    kw.setdefault("bs", 4)
    run = pipeline(Fetch({0: 4, 1: 4, 2: 4, 3: 4}, salt=1), take=1, save=True, **kw)
    assert run.state is not None
    return run.state


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(workers=(4,)), r"worker count"),
        (dict(bs=5), r"batch size"),
        (dict(blobs=["ids", "other"]), r"blob layout"),
        # 3 workers in all, fed to two nets instead of one
        (dict(workers=(1, 2)), r"\bnets?\b"),
    ],
    ids=["workers", "batch_size", "blobs", "nets"],
)
def test_load_refuses_another_layout(change: dict[str, Any], pattern: str) -> None:
    state = saved_state()
    fetch = Fetch({0: 4, 1: 4, 2: 4, 3: 4}, salt=1)
    gc = blobfeed.GlobalCoordinator()
    try:
        kw: dict[str, Any] = dict(workers=(3,), bs=4)
        kw.update(change)
        nets = wire(gc, fetch, **kw)
        with pytest.raises(ValueError, match=pattern) as info:
            gc.load_state_dict(SRC, state)
        assert SRC in str(info.value)
        # the refused state left no trace: the pipeline runs from the start
        gc.start()
        if "blobs" not in change:
            got, ends = consume(nets)
            n = sum(kw["workers"])
            want, _ = expected(Fetch({0: 4, 1: 4, 2: 4, 3: 4}, salt=1), n, kw["bs"])
            for j, part in enumerate(split(want, len(nets))):
                assert_batches(got[j], part, f"after a refused load ({change})")
    finally:
        assert gc.stop(timeout=5.0)


def test_load_refuses_another_version() -> None:
    state = saved_state()
    state["version"] = state["version"] + 1
    gc = blobfeed.GlobalCoordinator()
    try:
        wire(gc, Fetch({0: 4, 1: 4, 2: 4}), workers=(3,), bs=4)
        with pytest.raises(ValueError, match="version"):
            gc.load_state_dict(SRC, state)
    finally:
        assert gc.stop(timeout=5.0)


def test_load_refuses_after_start() -> None:
    state = saved_state()
    fetch = Fetch({0: 4, 1: 4, 2: 4, 3: 4}, salt=1)
    want, _ = expected(fetch, 3, 4)
    gc = blobfeed.GlobalCoordinator()
    try:
        (net,) = wire(gc, fetch, workers=(3,), bs=4)
        gc.start()
        with pytest.raises(ValueError, match="start"):
            gc.load_state_dict(SRC, state)
        got, ends = consume([net])
        assert isinstance(ends[0], EndOfInput)
        assert_batches(got[0], want, "after a refused load")
    finally:
        assert gc.stop(timeout=5.0)


def test_state_dict_and_load_refuse_a_source_that_is_not_deterministic() -> None:
    state = saved_state()
    gc = blobfeed.GlobalCoordinator()
    try:
        net = Net(name="n")
        init_data_input_workers(net, BLOBS, Fetch({0: 2}), 4, num_worker_threads=1, coordinator=gc)
        with pytest.raises(ValueError, match="not deterministic"):
            gc.state_dict(SRC)
        with pytest.raises(ValueError, match="not deterministic"):
            gc.load_state_dict(SRC, state)
        with pytest.raises(ValueError, match="no input source"):
            gc.state_dict("elsewhere")
    finally:
        assert gc.stop(timeout=5.0)


def test_reset_data_input_refused_on_a_deterministic_source() -> None:
    gc = blobfeed.GlobalCoordinator()
    try:
        (net,) = wire(gc, Fetch({0: 2}), workers=(1,), bs=4)
        with pytest.raises(ValueError, match="deterministic"):
            gc.reset_data_input(SRC, net, 8)
    finally:
        assert gc.stop(timeout=5.0)


def test_deterministic_with_dont_rebatch_refused() -> None:
    gc = blobfeed.GlobalCoordinator()
    try:
        with pytest.raises(ValueError, match="dont_rebatch"):
            init_data_input_workers(Net(name="n"), BLOBS, Fetch({0: 2}), 4, coordinator=gc,
                                    deterministic=True, dont_rebatch=True)
        assert gc.get_worker_ids() == []
    finally:
        assert gc.stop(timeout=5.0)


@pytest.mark.parametrize(
    "first, second, pattern",
    [
        (dict(deterministic=True), dict(deterministic=False), r"deterministic"),
        (dict(deterministic=False), dict(deterministic=True), r"deterministic"),
        (dict(deterministic=True), dict(deterministic=True, batch_size=5), r"batch_size"),
    ],
    ids=["det-then-not", "not-then-det", "batch-size"],
)
def test_calls_for_one_source_must_agree(first: dict[str, Any], second: dict[str, Any], pattern: str) -> None:
    lengths = {0: 5, 1: 5}
    fetch = Fetch(lengths, salt=2)
    gc = blobfeed.GlobalCoordinator()
    try:
        net = Net(name="a")
        init_data_input_workers(net, BLOBS, fetch, first.pop("batch_size", 4), num_worker_threads=2,
                                coordinator=gc, seed=SEED, **first)
        with pytest.raises(ValueError, match=pattern):
            init_data_input_workers(Net(name="b"), BLOBS, fetch, second.pop("batch_size", 4),
                                    num_worker_threads=1, coordinator=gc, seed=SEED, **second)
        assert gc.get_worker_ids() == [0, 1], "a refused call allocated worker ids"
        gc.start()
        got, ends = consume([net])
        assert isinstance(ends[0], EndOfInput)
        if first.get("deterministic"):
            assert_batches(got[0], expected(Fetch(lengths, salt=2), 2, 4)[0], "after a refused call")
    finally:
        assert gc.stop(timeout=5.0)


def test_wiring_a_net_after_start_refused() -> None:
    gc = blobfeed.GlobalCoordinator()
    try:
        wire(gc, Fetch({0: 3}), workers=(1,), bs=4)
        gc.start()
        with pytest.raises(ValueError, match="before start"):
            wire(gc, Fetch({0: 3}), workers=(1,), bs=4, names=["late"])
    finally:
        assert gc.stop(timeout=5.0)


# ---------------------------------------------------------------------------------------------
# 7. Under load
# ---------------------------------------------------------------------------------------------
def test_stream_matches_with_busy_threads_beside_the_pipeline() -> None:
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    spinners = [threading.Thread(target=spin, name=f"test-spin-{i}", daemon=True) for i in range(2)]
    for t in spinners:
        t.start()
    try:
        plan = {0: 9, 1: 5, 2: 8}
        delay_seed = new_delay_seed()
        fetch = Fetch(plan, salt=61, delay_seed=delay_seed, none_at={(1, 3)})
        want, _ = expected(fetch, 3, 6)
        run = pipeline(fetch, workers=(2, 1), bs=6)
        assert_ended(run, "under load")
        for j, part in enumerate(split(want, 2)):
            assert_batches(run.got[j], part, f"under load, net{j}, delay_seed={delay_seed}")
        # and a resume under load
        resume_and_check(lambda: Fetch(plan, salt=61, delay_seed=new_delay_seed(), none_at={(1, 3)}),
                         want, take=3, workers=(2, 1), bs=6, what="resume under load")
    finally:
        stop.set()
        for t in spinners:
            t.join(WAIT)
