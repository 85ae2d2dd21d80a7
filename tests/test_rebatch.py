"""Rebatcher and ChunkValidator as single-threaded units.

Sample ids make every check exact: blob ``ids`` holds the global sample
number, blob ``feat`` holds ``[id, -id]`` per sample, so order, exactly-once
delivery and cross-blob alignment are all visible in the output.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blobfeed
from blobfeed import ChunkError
from blobfeed.feeders import Batch, Chunk, ChunkValidator, Rebatcher


def make_chunk(lo: int, hi: int, *, feat_axis: int = 0, worker_id: int = 0) -> Chunk:
    """Samples ``lo..hi-1``: ``ids`` (n,) int64 on axis 0, ``feat`` float32 on ``feat_axis``.

    ``feat`` is (n, 2) for axis 0 and (2, n) for axis 1.
    """
    ids = np.arange(lo, hi, dtype=np.int64)
    feat = np.stack([ids.astype(np.float32), -ids.astype(np.float32)], axis=1 - feat_axis)
    return Chunk((ids, feat), hi - lo, worker_id)


def chunks_of(sizes: Sequence[int], *, feat_axis: int = 0) -> list[Chunk]:
    out, lo = [], 0
    for n in sizes:
        out.append(make_chunk(lo, lo + n, feat_axis=feat_axis))
        lo += n
    return out


def check_batch(batch: Batch, lo: int, hi: int, *, feat_axis: int = 0) -> None:
    """``batch`` holds exactly samples ``lo..hi-1``, aligned across blobs."""
    ids, feat = batch.arrays
    n = hi - lo
    assert batch.n == n
    assert ids.shape == (n,)
    assert feat.shape == ((n, 2) if feat_axis == 0 else (2, n))
    np.testing.assert_array_equal(ids, np.arange(lo, hi))
    rows = feat if feat_axis == 0 else feat.T
    np.testing.assert_array_equal(rows[:, 0], np.arange(lo, hi, dtype=np.float32))
    np.testing.assert_array_equal(rows[:, 1], -np.arange(lo, hi, dtype=np.float32))


def shares_any(batch: Batch, chunk: Chunk) -> bool:
    return any(np.shares_memory(b, c) for b, c in zip(batch.arrays, chunk.arrays))


def shares_all(batch: Batch, chunk: Chunk) -> bool:
    return all(np.shares_memory(b, c) for b, c in zip(batch.arrays, chunk.arrays))


def pop_all(rb: Rebatcher) -> list[Batch]:
    out = []
    while (batch := rb.pop()) is not None:
        out.append(batch)
    return out


# =========================================================================== Rebatcher


def test_exact_batch_sizes_and_order() -> None:
    rb = Rebatcher([0, 0], 4)
    for chunk in chunks_of([3, 7, 1, 5, 10]):  # 26 samples
        rb.push(chunk)
    batches = pop_all(rb)
    assert [b.n for b in batches] == [4] * 6
    for k, batch in enumerate(batches):
        check_batch(batch, 4 * k, 4 * k + 4)
    assert rb.pop() is None  # 2 left: not a full batch
    assert rb.pending == 2
    last = rb.pop_partial()
    assert last is not None
    check_batch(last, 24, 26)
    assert rb.pending == 0
    assert rb.pop() is None
    assert rb.pop_partial() is None


def test_empty_rebatcher_pops_nothing() -> None:
    rb = Rebatcher([0, 0], 3)
    assert rb.pending == 0
    assert rb.pop() is None
    assert rb.pop_partial() is None


def test_leftover_carried_into_next_batch() -> None:
    rb = Rebatcher([0, 0], 4)
    rb.push(make_chunk(0, 5))
    check_batch(rb.pop(), 0, 4)  # type: ignore[arg-type]
    assert rb.pop() is None  # sample 4 waits for more
    assert rb.pending == 1
    rb.push(make_chunk(5, 8))
    batch = rb.pop()
    assert batch is not None
    check_batch(batch, 4, 8)  # the leftover comes first, before the new chunk
    assert rb.pending == 0


def test_leftover_not_reordered_behind_later_chunks() -> None:
    rb = Rebatcher([0, 0], 6)
    first, second, third = chunks_of([4, 1, 9])
    rb.push(first)
    assert rb.pop() is None
    rb.push(second)
    assert rb.pop() is None
    rb.push(third)
    batches = pop_all(rb)
    assert len(batches) == 2
    check_batch(batches[0], 0, 6)
    check_batch(batches[1], 6, 12)
    check_batch(rb.pop_partial(), 12, 14)  # type: ignore[arg-type]


def test_pop_partial_returns_remainder() -> None:
    rb = Rebatcher([0, 0], 10)
    for chunk in chunks_of([3, 2, 2]):
        rb.push(chunk)
    assert rb.pop() is None
    assert rb.pending == 7
    rest = rb.pop_partial()
    assert rest is not None
    check_batch(rest, 0, 7)
    assert rb.pending == 0
    assert rb.pop_partial() is None


def test_pop_partial_after_full_batches() -> None:
    rb = Rebatcher([0, 0], 3)
    rb.push(make_chunk(0, 8))
    assert [b.n for b in pop_all(rb)] == [3, 3]
    rest = rb.pop_partial()
    assert rest is not None
    check_batch(rest, 6, 8)


def test_batch_inside_one_chunk_is_a_view() -> None:
    rb = Rebatcher([0, 0], 4)
    chunk = make_chunk(0, 10)
    rb.push(chunk)
    for k in range(2):
        batch = rb.pop()
        assert batch is not None
        check_batch(batch, 4 * k, 4 * k + 4)
        assert shares_all(batch, chunk), "a batch inside one chunk must be a view, not a copy"
        for b, c in zip(batch.arrays, chunk.arrays):
            assert b.base is c or b.base is c.base  # a slice of the chunk's array
    # The remainder of one chunk is a view too.
    rest = rb.pop_partial()
    assert rest is not None
    check_batch(rest, 8, 10)
    assert shares_all(rest, chunk)


def test_batch_exactly_one_whole_chunk_is_a_view() -> None:
    rb = Rebatcher([0, 0], 5)
    chunk = make_chunk(0, 5)
    rb.push(chunk)
    batch = rb.pop()
    assert batch is not None
    check_batch(batch, 0, 5)
    assert shares_all(batch, chunk)
    assert rb.pending == 0


def test_batch_spanning_chunks_is_a_fresh_array() -> None:
    rb = Rebatcher([0, 0], 4)
    first, second = chunks_of([3, 3])
    rb.push(first)
    rb.push(second)
    batch = rb.pop()
    assert batch is not None
    check_batch(batch, 0, 4)
    assert not shares_any(batch, first)
    assert not shares_any(batch, second)
    # Mutating the chunks afterwards does not change the assembled batch.
    for ch in (first, second):
        for arr in ch.arrays:
            arr[...] = 0
    check_batch(batch, 0, 4)
    # The remainder (samples 4, 5) lies inside the second chunk: a view again.
    rest = rb.pop_partial()
    assert rest is not None
    assert rest.n == 2
    assert shares_all(rest, second)


def test_partial_spanning_chunks_is_a_fresh_array() -> None:
    rb = Rebatcher([0, 0], 100)
    first, second = chunks_of([2, 3])
    rb.push(first)
    rb.push(second)
    rest = rb.pop_partial()
    assert rest is not None
    check_batch(rest, 0, 5)
    assert not shares_any(rest, first)
    assert not shares_any(rest, second)


def test_batch_axis_1_slices_and_concatenates_along_it() -> None:
    rb = Rebatcher(axes=[0, 1], batch_size=5)
    chunks = chunks_of([3, 4, 8], feat_axis=1)  # feat chunks are (2, n)
    for chunk in chunks:
        rb.push(chunk)
    batches = pop_all(rb)
    assert len(batches) == 3
    for k, batch in enumerate(batches):
        check_batch(batch, 5 * k, 5 * k + 5, feat_axis=1)
        assert batch.arrays[1].shape == (2, 5)
    # batch 0 spans chunks 0 and 1; batch 1 spans chunks 1 and 2: fresh arrays.
    assert not any(shares_any(batches[0], c) for c in chunks)
    assert not any(shares_any(batches[1], c) for c in chunks)
    # batch 2 (samples 10..14) lies inside chunk 2 (samples 7..14): views.
    assert shares_all(batches[2], chunks[2])
    assert rb.pop_partial() is None


def test_batch_axis_1_view_inside_one_chunk() -> None:
    rb = Rebatcher(axes=[0, 1], batch_size=4)
    chunk = make_chunk(0, 10, feat_axis=1)
    rb.push(chunk)
    first = rb.pop()
    assert first is not None
    check_batch(first, 0, 4, feat_axis=1)
    assert shares_all(first, chunk)
    np.testing.assert_array_equal(first.arrays[1], chunk.arrays[1][:, 0:4])
    second = rb.pop()
    assert second is not None
    check_batch(second, 4, 8, feat_axis=1)
    rest = rb.pop_partial()
    assert rest is not None
    check_batch(rest, 8, 10, feat_axis=1)


def test_batch_axis_2_of_a_3d_blob() -> None:
    rb = Rebatcher(axes=[2], batch_size=3)
    a = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    b = np.arange(100, 100 + 2 * 3 * 2).reshape(2, 3, 2)
    rb.push(Chunk((a,), 4, 0))
    rb.push(Chunk((b,), 2, 0))
    expected = np.concatenate([a, b], axis=2)
    first = rb.pop()
    assert first is not None
    np.testing.assert_array_equal(first.arrays[0], expected[:, :, 0:3])
    assert np.shares_memory(first.arrays[0], a)
    second = rb.pop()
    assert second is not None
    np.testing.assert_array_equal(second.arrays[0], expected[:, :, 3:6])
    assert not np.shares_memory(second.arrays[0], a)
    assert not np.shares_memory(second.arrays[0], b)


def test_changing_batch_size_takes_effect_for_next_pop() -> None:
    rb = Rebatcher([0, 0], 4)
    rb.push(make_chunk(0, 20))
    check_batch(rb.pop(), 0, 4)  # type: ignore[arg-type]
    rb.batch_size = 6
    check_batch(rb.pop(), 4, 10)  # type: ignore[arg-type]
    rb.batch_size = 3
    check_batch(rb.pop(), 10, 13)  # type: ignore[arg-type]
    rb.batch_size = 10
    assert rb.pop() is None  # 7 pending < 10
    assert rb.pending == 7
    rb.push(make_chunk(20, 23))
    batch = rb.pop()
    assert batch is not None
    check_batch(batch, 13, 23)
    assert rb.pending == 0


def test_shrinking_batch_size_with_pending_samples() -> None:
    rb = Rebatcher([0, 0], 8)
    for chunk in chunks_of([3, 2]):
        rb.push(chunk)
    assert rb.pop() is None
    rb.batch_size = 2
    batches = pop_all(rb)
    assert [b.n for b in batches] == [2, 2]
    check_batch(batches[0], 0, 2)
    check_batch(batches[1], 2, 4)
    check_batch(rb.pop_partial(), 4, 5)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=20), min_size=0, max_size=15),
    batch_size=st.integers(min_value=1, max_value=25),
    interleave=st.booleans(),
    feat_axis=st.sampled_from([0, 1]),
)
def test_property_every_sample_once_in_order_exact_sizes(
    sizes: list[int], batch_size: int, interleave: bool, feat_axis: int
) -> None:
    rb = Rebatcher([0, feat_axis], batch_size)
    chunks = chunks_of(sizes, feat_axis=feat_axis)
    batches: list[Batch] = []
    if interleave:  # as an enqueuer does: push one chunk, pop what is ready
        for chunk in chunks:
            rb.push(chunk)
            batches.extend(pop_all(rb))
    else:
        for chunk in chunks:
            rb.push(chunk)
        batches.extend(pop_all(rb))
    total = sum(sizes)
    assert rb.pending == total % batch_size
    last = rb.pop_partial()
    full = len(batches)
    if last is not None:
        batches.append(last)
    assert rb.pending == 0
    assert rb.pop_partial() is None

    # Sizes: exactly batch_size, except one final smaller batch.
    assert full == total // batch_size
    assert all(b.n == batch_size for b in batches[:full])
    if total % batch_size:
        assert batches[-1].n == total % batch_size
    else:
        assert last is None

    # Every sample exactly once, in order, aligned across blobs.
    lo = 0
    for batch in batches:
        check_batch(batch, lo, lo + batch.n, feat_axis=feat_axis)
        lo += batch.n
    assert lo == total

    # Zero copy exactly where a batch lies inside one chunk.
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    lo = 0
    for batch in batches:
        hi = lo + batch.n
        inside = [k for k, (a, b) in enumerate(bounds) if a <= lo and hi <= b]
        if inside:
            assert shares_all(batch, chunks[inside[0]])
        else:
            assert not any(shares_any(batch, c) for c in chunks)
        lo = hi


# =========================================================================== ChunkValidator

SOURCE = "src-train"
WORKER = 41


def validator(axes: Sequence[int] = (0, 0)) -> ChunkValidator:
    return ChunkValidator(SOURCE, ["data", "label"], list(axes))


def good(n: int = 4) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((n, 3), np.float32), np.arange(n, dtype=np.int64)


def all_of(*parts: str) -> str:
    """A regex matching a text that contains every part, in any order."""
    return "(?s)^" + "".join(f"(?=.*{re.escape(p)})" for p in parts)


def test_validator_accepts_a_good_chunk_without_copying() -> None:
    v = validator()
    raw = good(4)
    chunk = v.check(list(raw), WORKER)
    assert isinstance(chunk, Chunk)
    assert chunk.n == 4
    assert chunk.worker_id == WORKER
    assert len(chunk.arrays) == 2
    assert chunk.arrays[0] is raw[0] and chunk.arrays[1] is raw[1]
    # Later chunks of any sample count with the same layout are fine too.
    again = v.check(good(9), WORKER + 1)
    assert isinstance(again, Chunk) and again.n == 9


def test_validator_none_is_skipped() -> None:
    assert validator().check(None, WORKER) == "none"


def test_validator_zero_samples_is_empty() -> None:
    v = validator()
    assert v.check(good(0), WORKER) == "empty"
    assert v.check([np.zeros((0, 3), np.float32), np.zeros(0, np.int64)], WORKER) == "empty"


def test_validator_zero_samples_on_axis_1_is_empty() -> None:
    v = validator(axes=(0, 1))
    assert v.check([np.zeros((0, 3)), np.zeros((2, 0))], WORKER) == "empty"


# Each case: (raw chunk, message parts beyond source/worker/"got", cause type).
# The parts name the blob(s) and what was expected versus what came.
BAD_FIRST_CHUNKS: dict[str, tuple[Any, tuple[str, ...], type[Exception]]] = {
    "ndarray-not-list": (np.zeros((4, 3)), ("list or tuple of 2", "data", "label", "got ndarray"), TypeError),
    "dict-not-list": ({"data": np.zeros(4)}, ("list or tuple of 2", "data", "label", "got dict"), TypeError),
    "too-few-arrays": ((np.zeros((4, 3), np.float32),), ("expected 2", "got 1", "data", "label"), ValueError),
    "too-many-arrays": ((*good(4), np.zeros(4)), ("expected 2", "got 3", "data", "label"), ValueError),
    "not-an-ndarray": ((np.zeros((4, 3), np.float32), [0, 1, 2, 3]), ("label", "expected", "ndarray", "got list"), TypeError),
    "unequal-samples": ((np.zeros((4, 3), np.float32), np.arange(5)), ("label", "expected 4", "got 5"), ValueError),
    "zero-d-array": ((np.zeros((4, 3), np.float32), np.array(7)), ("label", "expected", "()"), ValueError),
    "zero-d-first-blob": ((np.array(1.0), np.arange(4)), ("data", "expected", "()"), ValueError),
}


@pytest.mark.parametrize("case", list(BAD_FIRST_CHUNKS))
def test_validator_rejects_malformed_chunk(case: str) -> None:
    raw, parts, cause = BAD_FIRST_CHUNKS[case]
    v = validator()
    with pytest.raises(ChunkError, match=all_of(SOURCE, str(WORKER), "got", *parts)) as info:
        v.check(raw, WORKER)
    exc = info.value
    assert isinstance(exc, ValueError)
    assert isinstance(exc, blobfeed.FetcherError)
    assert isinstance(exc, blobfeed.BlobfeedError)
    assert exc.__cause__ is not None
    assert isinstance(exc.__cause__, cause)
    # A rejected chunk does not poison the validator.
    assert isinstance(v.check(good(2), WORKER), Chunk)


@pytest.mark.parametrize(
    ("later", "parts"),
    [
        pytest.param(
            (np.zeros((4, 3), np.float64), np.arange(4, dtype=np.int64)),
            ("data", "float32", "float64"),
            id="dtype-first-blob",
        ),
        pytest.param(
            (np.zeros((4, 3), np.float32), np.arange(4, dtype=np.int32)),
            ("label", "int64", "int32"),
            id="dtype-second-blob",
        ),
        pytest.param(
            (np.zeros((4, 5), np.float32), np.arange(4, dtype=np.int64)),
            ("data", "(3,)", "(5,)"),
            id="trailing-shape",
        ),
        pytest.param(
            (np.zeros((4, 3, 1), np.float32), np.arange(4, dtype=np.int64)),
            ("data", "(3,)", "(3, 1)"),
            id="trailing-ndim",
        ),
        pytest.param(
            (np.zeros((4, 3), np.float32), np.zeros((4, 1), np.int64)),
            ("label", "()", "(1,)"),
            id="trailing-shape-second-blob",
        ),
    ],
)
def test_validator_rejects_layout_different_from_first_chunk(later: Any, parts: tuple[str, ...]) -> None:
    v = validator()
    assert isinstance(v.check(good(4), 0), Chunk)  # fixes dtype and per-sample shape
    with pytest.raises(ChunkError, match=all_of(SOURCE, str(WORKER), "expected", "got", *parts)) as info:
        v.check(list(later), WORKER)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value.__cause__, (TypeError, ValueError))
    # The first chunk's layout still stands.
    assert isinstance(v.check(good(7), WORKER), Chunk)


def test_validator_first_accepted_chunk_fixes_layout() -> None:
    v = validator()
    first = (np.zeros((2, 5), np.float64), np.arange(2, dtype=np.int32))
    assert isinstance(v.check(first, 0), Chunk)
    with pytest.raises(ChunkError, match=all_of(SOURCE, "data", "float64", "float32")):
        v.check(good(2), WORKER)


def test_validator_axis_1_layout() -> None:
    v = validator(axes=(0, 1))
    ok = v.check([np.zeros((4, 3), np.float32), np.zeros((2, 4), np.int64)], WORKER)
    assert isinstance(ok, Chunk) and ok.n == 4
    # Sample counts compare along each blob's own batch axis.
    with pytest.raises(ChunkError, match=all_of(SOURCE, str(WORKER), "label", "4", "5")):
        v.check([np.zeros((4, 3), np.float32), np.zeros((4, 5), np.int64)], WORKER)
    # Per-sample shape excludes the batch axis: (2,) for label.
    with pytest.raises(ChunkError, match=all_of(SOURCE, str(WORKER), "label", "(2,)", "(3,)")):
        v.check([np.zeros((4, 3), np.float32), np.zeros((3, 4), np.int64)], WORKER)
    # A 1-d blob has no axis 1.
    with pytest.raises(ChunkError, match=all_of(SOURCE, "label", "expected", "got")):
        v.check([np.zeros((4, 3), np.float32), np.zeros(4, np.int64)], WORKER)


def big_chunks(sizes: Sequence[int], row: int = 40_000) -> list[Chunk]:
    """Chunks whose batches are big enough (>= 1 MiB) to come from the buffer pool."""
    out, lo = [], 0
    for n in sizes:
        ids = np.arange(lo, lo + n, dtype=np.int64)
        data = np.repeat(ids.astype(np.float32)[:, None], row, axis=1)
        out.append(Chunk((ids, data), n, 0))
        lo += n
    return out


def test_big_spanning_batches_kept_by_the_user_are_never_overwritten() -> None:
    """A big batch assembled into a recycled buffer stays intact as long as
    the user holds it, however many batches follow."""
    rb = Rebatcher([0, 0], 8)
    kept = []
    for c in big_chunks([3, 7] * 40):
        rb.push(c)
        while (b := rb.pop()) is not None:
            assert b.arrays[1].nbytes >= 1 << 20
            kept.append((b, b.arrays[0].copy(), b.arrays[1][:, :5].copy()))
    assert len(kept) == 50
    for b, ids, head in kept:
        np.testing.assert_array_equal(b.arrays[0], ids)
        np.testing.assert_array_equal(b.arrays[1][:, :5], head)
        np.testing.assert_array_equal(b.arrays[1][:, 0], ids.astype(np.float32))
        assert type(b.arrays[1]) is np.ndarray


def _pipeline_faults_per_batch(**kw: Any) -> tuple[float, int]:
    """Page faults per batch of a W2-like pipeline (chunks of 1..16 images,
    batches of 64 spanning chunks), and the pages of one batch."""
    import resource

    images = np.random.default_rng(0).integers(0, 255, (16, 3, 224, 224), dtype=np.uint8)
    sizes = np.random.default_rng(1).integers(1, 17, 4096)
    pos = {0: 0, 1: 0}

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        i = pos[worker_id] = pos[worker_id] + 1
        n = int(sizes[(i + worker_id * 977) % len(sizes)])
        return [images[:n], np.arange(n)]

    gc = blobfeed.GlobalCoordinator()
    net = blobfeed.Net(name="n")
    blobfeed.init_data_input_workers(net, ["x", "y"], fetch, 64, coordinator=gc, seed=0, **kw)
    gc.start()
    try:
        for _ in range(50):
            net.run(timeout=10)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(200):
            net.run(timeout=10)
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    finally:
        assert gc.stop(timeout=10)
    return (f1 - f0) / 200, 64 * images[0].nbytes // 4096


def test_big_spanning_batches_reuse_warm_memory() -> None:
    """The point of the pool: a batch the net drops gives its memory back
    warm.  Without it, batches assembled and freed by different threads
    kept faulting in fresh pages (measured: 340-390 faults per 9.6 MB W2
    batch, and a third of the throughput)."""
    faults, pages = _pipeline_faults_per_batch()
    assert faults < pages * 0.05, f"{faults:.0f} page faults per batch of {pages} pages"


def test_a_size_class_pool_reuses_one_buffer_for_chunks_of_different_sizes() -> None:
    """Chunks copied out of a worker's slots (see slot_ring.SlotRing.hold) have a
    varying row count; into fresh pages that copy cost three times the copy
    (W2p: 6-13 % of the batches/s).  The receiver's pool rounds sizes up to
    a power of two, so chunks of 9 to 13 images share warm buffers."""
    from blobfeed.feeders.rebatch import BufferPool

    pool = BufferPool(size_classes=True)
    image = (3, 224, 224)
    seen = set()
    for n in [9, 13, 12, 10, 11] * 10:  # 1.35-1.96 MB: one class of 2 MiB
        arrays = pool.batch([((n, *image), np.dtype(np.uint8)), ((n,), np.dtype(np.int64))])
        assert arrays[0].shape == (n, *image) and arrays[1].shape == (n,)
        seen.add(arrays[0].__array_interface__["data"][0])
        del arrays  # the chunk was taken into a batch: its buffer comes back
    assert len(seen) == 1
    small = pool.batch([((3,), np.dtype(np.int64))])
    assert small[0].base.nbytes == 1 << 16  # the smallest class


def test_buffer_pool_lets_go_of_spares_a_window_never_needed() -> None:
    """A burst (the device queue filling while the net paused) needs many
    buffers at once; once it is over, the spares that sit idle for a whole
    window go back to the system instead of staying resident for the run."""
    from blobfeed.feeders.rebatch import POOL_WINDOW, BufferPool

    pool = BufferPool()
    layout = [((1 << 20,), np.dtype(np.uint8))]
    burst = [pool.batch(layout) for _ in range(7)]
    del burst  # all seven come back
    for _ in range(3 * POOL_WINDOW):
        held = pool.batch(layout)  # one batch at a time in steady state
        del held
    pool.batch(layout)
    spares = sum(len(v) for v in pool._free.values())
    assert spares <= 1, f"{spares} idle spare buffers kept after the burst"


def test_buffer_pool_keeps_the_buffers_steady_demand_uses() -> None:
    from blobfeed.feeders.rebatch import POOL_WINDOW, BufferPool

    pool = BufferPool()
    layout = [((1 << 20,), np.dtype(np.uint8))]
    live: list[Any] = []
    seen: set[int] = set()
    for i in range(4 * POOL_WINDOW):
        arrays = pool.batch(layout)
        if i >= POOL_WINDOW:  # warm: every buffer handed out is a recycled one
            seen.add(arrays[0].__array_interface__["data"][0])
        live.append(arrays)
        if len(live) > 3:  # the user, the device queue and the enqueuer hold four
            live.pop(0)
    assert len(seen) <= 5, f"{len(seen)} distinct buffers for a steady demand of 4"


def test_buffer_pool_drops_buffers_of_a_size_no_longer_asked_for() -> None:
    from blobfeed.feeders.rebatch import POOL_WINDOW, BufferPool

    pool = BufferPool()
    old = [pool.batch([((1 << 20,), np.dtype(np.uint8))]) for _ in range(4)]
    del old
    for _ in range(2 * POOL_WINDOW):  # the batch size was reset
        pool.batch([((1 << 21,), np.dtype(np.uint8))])
    assert (1 << 20) not in pool._free or not pool._free[1 << 20]


def test_shuffle_rest_at_the_end_leaves_as_room_allows() -> None:
    """When every worker ended, the shuffle buffer's rest goes to the nets a
    batch at a time as their outboxes have room, not all at once (that held
    a whole buffer of batches: 1.5 GB on W2 with 10 000 samples)."""
    from blobfeed.feeders.dealing import LaneDealer, Shuffled
    from blobfeed.feeders.shuffle import ShuffleBuffer

    stream = LaneDealer("s", 4, [0], capacity=64, outbox_samples=8, on_error=lambda e: None,
                        stage=Shuffled(ShuffleBuffer(1000, [0], np.random.default_rng(0))))
    stream.add_lanes([0])
    box = stream.add_net()
    stream.start()
    for k in range(25):
        assert stream.put(0, Chunk((np.arange(4 * k, 4 * k + 4),), 4, 0, k))
    stream.finish(0)
    ok, first = box.get_nowait()
    assert ok and first is not None
    assert box.samples <= 8, f"{box.samples} samples dealt ahead of the net at the end"
    seen = list(first.arrays[0])
    while True:
        try:
            ok, piece = box.get_nowait()
        except blobfeed.EndOfInput:
            break
        assert ok and piece is not None
        seen.extend(piece.arrays[0])
    assert sorted(seen) == list(range(100))


def big_chunks_axis(sizes: Sequence[int], feat_axis: int, row: int = 20_000) -> list[Chunk]:
    """big_chunks with ``feat`` on ``feat_axis`` (0: (n, row); 1: (row, n))."""
    out, lo = [], 0
    for n in sizes:
        ids = np.arange(lo, lo + n, dtype=np.int64)
        feat = np.repeat(ids.astype(np.float32)[:, None], row, axis=1)
        out.append(Chunk((ids, feat if feat_axis == 0 else feat.T), n, 0))
        lo += n
    return out


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=30), min_size=0, max_size=12),
    batch_size=st.integers(min_value=13, max_value=25),
    resize_at=st.one_of(st.none(), st.integers(min_value=0, max_value=11)),
    new_size=st.integers(min_value=13, max_value=25),
    feat_axis=st.sampled_from([0, 1]),
    pop_every=st.booleans(),
)
def test_property_big_batches_filled_as_chunks_arrive_are_exact(
    sizes: list[int], batch_size: int, resize_at: int | None, new_size: int, feat_axis: int, pop_every: bool
) -> None:
    """Big batches (here >= 13 rows of 80 kB: >= 1 MiB) are filled at push;
    every sample once, in order, aligned across blobs, exact sizes, views
    where a batch lies inside one chunk, also when the batch size changes
    half way (reset_data_input)."""
    rb = Rebatcher([0, feat_axis], batch_size)
    chunks = big_chunks_axis(sizes, feat_axis)
    out: list[Batch] = []
    bs = batch_size
    for k, chunk in enumerate(chunks):
        if k == resize_at:
            rb.batch_size = bs = new_size
        rb.push(chunk)
        while (pop_every or k == len(chunks) - 1) and (b := rb.pop()) is not None:
            assert b.n == bs
            out.append(b)
    last = rb.pop_partial()
    if last is not None:
        out.append(last)
    assert rb.pending == 0 and rb.pop_partial() is None
    lo = 0
    for b in out:
        ids, feat = b.arrays
        rows = feat if feat_axis == 0 else feat.T
        np.testing.assert_array_equal(ids, np.arange(lo, lo + b.n))
        np.testing.assert_array_equal(rows[:, 0], np.arange(lo, lo + b.n, dtype=np.float32))
        np.testing.assert_array_equal(rows[:, -1], np.arange(lo, lo + b.n, dtype=np.float32))
        assert not ids.flags.writeable and not feat.flags.writeable
        inside = [c for c in chunks if c.arrays[0][0] <= lo and lo + b.n <= c.arrays[0][-1] + 1]
        if inside and resize_at is None and b.n == batch_size:
            assert shares_all(b, inside[0])  # (an epoch's smaller last batch is filled like the others)
        lo += b.n
    assert lo == sum(sizes)


def test_a_chunk_a_big_batch_spans_is_let_go_at_push() -> None:
    """Its piece is copied into the batch as it arrives: the chunk (in a
    worker's shared-memory slot, with process workers) is not held until
    the batch is complete."""
    import weakref

    rb = Rebatcher([0, 0], 16)
    chunks = big_chunks([5, 6, 7])
    refs = [weakref.ref(c.arrays[1]) for c in chunks]
    for c in chunks[:2]:
        rb.push(c)
    del c
    chunks = chunks[2:]
    assert refs[0]() is None and refs[1]() is None  # copied: the rebatcher holds neither
    assert rb.pop() is None and rb.pending == 11
    rb.push(chunks[0])
    b = rb.pop()
    assert b is not None and list(b.arrays[0]) == list(range(16))
    assert refs[2]() is not None  # its last two rows wait for the next batch
    assert rb.pending == 2


def test_a_filled_batch_waiting_when_the_batch_size_grows_is_cut_again() -> None:
    """Found by review: a big batch filled and waiting (its fill ended on a
    chunk's end), then a larger batch size (reset_data_input) before it was
    handed out: the next push started a fill of the new size, and the
    waiting batch of 14 went out labelled 16, its samples counted twice and
    two later ones lost."""
    rb = Rebatcher([0, 0], 14)
    chunks = big_chunks_axis([7, 7, 7, 7, 7], 0)
    rb.push(chunks[0])
    rb.push(chunks[1])  # one batch of 14 filled, nothing being filled
    rb.batch_size = 16
    assert rb.pop() is None  # 14 pending
    out = []
    for c in chunks[2:]:
        rb.push(c)
        while (b := rb.pop()) is not None:
            out.append(b)
    last = rb.pop_partial()
    assert last is not None
    out.append(last)
    assert [b.n for b in out] == [16, 16, 3]
    assert [i for b in out for i in b.arrays[0]] == list(range(35))
    assert all(len(b.arrays[0]) == b.n == len(b.arrays[1]) for b in out)
