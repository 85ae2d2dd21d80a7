"""The shuffle buffer on its own (``shuffle_buffer=N``): every sample once,
blobs aligned, the order a function of the generator, at most one copy of
each byte, and chunks let go of as soon as their last row has left."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from blobfeed.feeders.chunks import Chunk
from blobfeed.feeders.shuffle import ShuffleBuffer


def chunk(k: int, n: int, width: int = 3) -> Chunk:
    """Chunk ``k``: ids k*1000 + row; ``feat`` rows hold the id in every column."""
    ids = np.arange(n, dtype=np.int64) + 1000 * k
    return Chunk((ids, np.repeat(ids[:, None], width, axis=1).astype(np.float32)), n, 0, k)


def drain(buf: ShuffleBuffer, chunks: list[Chunk], bs: int) -> list[Chunk]:
    """Push every chunk, popping whole batches while the buffer is over its size; then the rest."""
    out = []
    for c in chunks:
        buf.push(c)
        while buf.ready(bs):
            out.append(buf.pop(bs))
    while len(buf):
        out.append(buf.pop(bs))
    return out


@pytest.mark.parametrize("size,bs,n_chunks", [(0, 4, 40), (5, 4, 40), (50, 8, 40), (1000, 32, 40), (100, 300, 200)])
def test_every_sample_leaves_once_with_its_blobs_aligned(size: int, bs: int, n_chunks: int) -> None:
    """(bs 300: small rows of big batches are gathered chunk by chunk, the others row by row.)"""
    rng = np.random.default_rng(0)
    chunks = [chunk(k, int(rng.integers(1, 20))) for k in range(n_chunks)]
    buf = ShuffleBuffer(size, [0, 0], np.random.default_rng(1))
    batches = drain(buf, chunks, bs)
    ids = np.concatenate([b.arrays[0] for b in batches])
    want = np.concatenate([c.arrays[0] for c in chunks])
    assert sorted(ids.tolist()) == sorted(want.tolist())
    for b in batches:
        assert b.n == len(b.arrays[0]) == len(b.arrays[1])
        np.testing.assert_array_equal(b.arrays[1], np.repeat(b.arrays[0][:, None], 3, axis=1))
    assert all(b.n == bs for b in batches[:-1])
    if size >= 50:
        assert ids.tolist() != want.tolist(), "not shuffled"
    assert not buf._chunks, "chunks kept after their last row left"


def test_order_is_a_function_of_the_generator() -> None:
    chunks = [chunk(k, 7) for k in range(30)]
    runs = [drain(ShuffleBuffer(64, [0, 0], np.random.default_rng(s)), chunks, 8) for s in (3, 3, 4)]
    a, b, c = ([x.tolist() for bt in r for x in [bt.arrays[0]]] for r in runs)
    assert a == b
    assert a != c


def test_while_input_lasts_the_buffer_keeps_its_size() -> None:
    buf = ShuffleBuffer(100, [0, 0], np.random.default_rng(0))
    for k in range(30):
        buf.push(chunk(k, 9))
        while buf.ready(16):
            buf.pop(16)
            assert len(buf) >= 100


def test_other_batch_axes() -> None:
    """A blob batched along axis 1: its columns are the samples."""
    buf = ShuffleBuffer(10, [0, 1], np.random.default_rng(0))
    chunks = []
    for k in range(6):
        ids = np.arange(5, dtype=np.int64) + 1000 * k
        chunks.append(Chunk((ids, np.stack([ids, -ids]).astype(np.int64)), 5, 0, k))
    batches = drain(buf, chunks, 4)
    for b in batches:
        np.testing.assert_array_equal(b.arrays[1], np.stack([b.arrays[0], -b.arrays[0]]))
    assert sorted(np.concatenate([b.arrays[0] for b in batches]).tolist()) == sorted(
        np.concatenate([c.arrays[0] for c in chunks]).tolist())


def test_a_batch_of_big_rows_is_copied_once() -> None:
    """Images (37 KB a row): popping a batch allocates the batch and little
    more, however many of its rows come from one chunk: no temporary copy
    of the rows on the way (a gather then a scatter copies each byte twice)."""
    buf = ShuffleBuffer(8, [0, 0], np.random.default_rng(0))
    for k in range(2):
        rows = np.repeat(np.arange(16, dtype=np.uint8)[:, None, None, None] + 16 * k, 3 * 112 * 112).reshape(16, 3, 112, 112)
        buf.push(Chunk((rows, rows[:, 0, 0, 0].astype(np.int64)), 16, 0, k))
    batch_bytes = 16 * 3 * 112 * 112
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        b = buf.pop(16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert b.n == 16
    np.testing.assert_array_equal(b.arrays[0][:, 0, 0, 0], b.arrays[1])
    assert peak < 1.25 * batch_bytes, f"popping a {batch_bytes} B batch allocated {peak} B at its peak"
