"""The shuffle buffer on its own (``shuffle_buffer=N``): every sample once,
blobs aligned, the order a function of the generator, at most one copy of
each byte, and chunks let go of as soon as their last row has left."""

from __future__ import annotations

import gc
import sys
import threading
import tracemalloc
import weakref

import numpy as np
import pytest

from blobfeed.feeders.chunks import Chunk, Pin
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


def image_chunk(k: int, n: int, side: int = 40) -> Chunk:
    """Chunk ``k`` of big rows (3 x side x side uint8 >= 4 KiB: held by
    reference) whose every byte is the sample's id mod 251, and the ids."""
    ids = np.arange(n, dtype=np.int64) + 1000 * k
    images = np.empty((n, 3, side, side), np.uint8)
    images[...] = (ids % 251).astype(np.uint8)[:, None, None, None]
    return Chunk((images, ids), n, 0, k)


@pytest.mark.parametrize("size", [10**12, sys.maxsize])
def test_a_buffer_larger_than_the_data_set_shuffles_everything(size: int) -> None:
    """Defect 9: ``shuffle_buffer`` larger than the data set ("shuffle
    everything", tf.data's ``shuffle(10**12)``) allocated index arrays for
    2 x size rows up front: MemoryError, or a ValueError for sys.maxsize.
    Storage now grows with the rows held; nothing leaves while input lasts,
    then everything leaves in random order."""
    tracemalloc.start()
    try:
        buf = ShuffleBuffer(size, [0, 0], np.random.default_rng(0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"an empty buffer allocated {peak} B"
    chunks = [chunk(k, 13) for k in range(100)]
    for c in chunks:
        buf.push(c)
        assert not buf.ready(32)
    assert len(buf) == 1300
    batches = drain(buf, [], 32)
    ids = np.concatenate([b.arrays[0] for b in batches]).tolist()
    want = np.concatenate([c.arrays[0] for c in chunks]).tolist()
    assert sorted(ids) == sorted(want)
    assert ids != want, "not shuffled"
    assert [b.n for b in batches] == [32] * 40 + [20]
    for b in batches:
        np.testing.assert_array_equal(b.arrays[1], np.repeat(b.arrays[0][:, None], 3, axis=1))


def test_storage_grows_with_the_rows_held_and_shrinks_as_they_leave() -> None:
    buf = ShuffleBuffer(10**9, [0, 0], np.random.default_rng(0))
    for k in range(200):
        buf.push(chunk(k, 50))
    assert len(buf) == 10_000
    assert 10_000 <= buf._cap <= 20_000, "grows geometrically, to what is held"
    while len(buf) > 100:
        buf.pop(64)
    assert buf._cap <= 1024, "a drained buffer keeps memory for what it held at its peak"


def test_clear_drops_every_row_and_lets_go_of_every_chunk() -> None:
    """The stream counts what clear() returns as dropped; the chunks (a
    worker's shared-memory slot, say) are let go of at once."""
    buf = ShuffleBuffer(100, [0, 0], np.random.default_rng(0))
    refs = []
    for k in range(10):
        c = image_chunk(k, 7)
        refs.append(weakref.ref(c.arrays[0]))
        buf.push(c)
    del c
    buf.pop(16)
    assert len(buf) == 54
    assert any(r() is not None for r in refs)
    assert buf.clear() == 54
    assert len(buf) == 0
    gc.collect()
    assert all(r() is None for r in refs), "a chunk outlived clear()"
    assert buf.clear() == 0
    # usable again, with the same guarantees
    batches = drain(buf, [image_chunk(k, 5) for k in range(20, 30)], 8)
    ids = np.concatenate([b.arrays[1] for b in batches])
    assert sorted(ids.tolist()) == sorted(k * 1000 + r for k in range(20, 30) for r in range(5))


def test_chunks_of_small_rows_are_let_go_of_at_push() -> None:
    """Small rows are copied into the buffer's own store: their chunk (a
    worker's shared-memory slot) need not wait for its last row to leave."""
    buf = ShuffleBuffer(1000, [0, 0], np.random.default_rng(0))
    c = chunk(0, 20)
    ref = weakref.ref(c.arrays[1])
    buf.push(c)
    del c
    gc.collect()
    assert ref() is None
    assert len(buf) == 20


def test_big_rows_stay_aligned_and_are_shuffled_on_any_batch_axis() -> None:
    """Images (big rows, by reference) with small labels (in the store),
    the images batched along axis 0 or 1."""
    for axis in (0, 1):
        chunks = []
        for k in range(12):
            c = image_chunk(k, 1 + k % 5)
            chunks.append(c if axis == 0 else Chunk((np.ascontiguousarray(np.moveaxis(c.arrays[0], 0, 1)), c.arrays[1]), c.n, 0, k))
        buf = ShuffleBuffer(10, [axis, 0], np.random.default_rng(5))
        batches = drain(buf, chunks, 4)
        for b in batches:
            images = b.arrays[0] if axis == 0 else np.moveaxis(b.arrays[0], 1, 0)
            assert b.arrays[0].flags.c_contiguous
            assert images.shape == (b.n, 3, 40, 40)
            np.testing.assert_array_equal(images, np.broadcast_to((b.arrays[1] % 251).astype(np.uint8)[:, None, None, None], images.shape))
        ids = np.concatenate([b.arrays[1] for b in batches]).tolist()
        want = np.concatenate([c.arrays[1] for c in chunks]).tolist()
        assert sorted(ids) == sorted(want) and ids != want
        assert not buf._chunks


def test_each_row_is_as_likely_to_leave_first() -> None:
    """The draw is uniform: over many buffers of 10 rows, each row is in
    the first batch of 3 about 3/10 of the time, and at each place of it
    about 1/10 (seeded: the counts are fixed, the bounds are ~4 sigma)."""
    rng = np.random.default_rng(11)
    counts = np.zeros((3, 10), int)
    for _ in range(3000):
        buf = ShuffleBuffer(0, [0, 0], rng)
        buf.push(chunk(0, 10))
        b = buf.pop(3)
        counts[np.arange(3), b.arrays[0]] += 1
    assert counts.sum() == 9000
    assert np.all(np.abs(counts - 300) < 70), counts


def test_a_chunk_unlike_the_first_is_refused() -> None:
    buf = ShuffleBuffer(10, [0, 0], np.random.default_rng(0))
    buf.push(chunk(0, 5))
    with pytest.raises(ValueError, match="blob 1 has dtype float32 and shape \\(5, 4\\)"):
        buf.push(chunk(1, 5, width=4))
    with pytest.raises(ValueError, match="size"):
        ShuffleBuffer(-1, [0], np.random.default_rng(0))
    with pytest.raises(TypeError, match="size"):
        ShuffleBuffer(1.5, [0], np.random.default_rng(0))  # type: ignore[arg-type]


def test_small_rows_go_through_without_letting_go_of_the_gil() -> None:
    """The buffer works under the lane dealer's lock, beside fetcher
    threads.  A numpy call that lets go of the GIL for a few bytes (a
    ``take``, a gather of rows of a 2-D array, a numpy ``Generator`` draw)
    lets another thread in, and getting the GIL back can cost a switch
    interval: W1s ran at 0.17 x W1.  With a long switch interval a spinning
    thread only runs when the buffer lets go of the GIL."""
    chunks = [chunk(k, 1 + k % 64) for k in range(400)]
    buf = ShuffleBuffer(2000, [0, 0], np.random.default_rng(0))
    for c in chunks[:100]:
        buf.push(c)
    buf.pop(32)  # warm: nothing first-time (an import, a cache) in the measured loop
    started, measuring, got_in, stop = (threading.Event() for _ in range(4))

    def spin() -> None:
        started.set()
        while not stop.is_set():
            if measuring.is_set():
                got_in.set()
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    spinner = threading.Thread(target=spin, daemon=True)
    try:
        spinner.start()
        assert started.wait(10)
        measuring.set()
        for c in chunks[100:]:
            buf.push(c)
            while buf.ready(32):
                buf.pop(32)
        measuring.clear()
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        spinner.join(10)
    assert not got_in.is_set(), "a push or pop of small rows let go of the GIL"


def test_big_batches_reuse_memory_of_dropped_batches_never_of_kept_ones() -> None:
    """Batches of big rows of 1 MiB or more are assembled in recycled memory
    (a copy into fresh pages ran at half the speed): a dropped batch's
    memory comes back, a kept batch is never overwritten."""
    buf = ShuffleBuffer(40, [0, 0], np.random.default_rng(0))
    chunks = [image_chunk(k, 16, side=64) for k in range(40)]  # 12 KiB rows, 96-row batches: 1.2 MB
    for c in chunks[:20]:
        buf.push(c)
    kept = buf.pop(96)
    dropped = buf.pop(96)
    assert dropped.n == 96
    address = dropped.arrays[0].__array_interface__["data"][0]
    del dropped
    reused = False
    for c in chunks[20:]:
        buf.push(c)
        while buf.ready(96):
            b = buf.pop(96)
            reused |= b.arrays[0].__array_interface__["data"][0] == address
            assert not np.shares_memory(b.arrays[0], kept.arrays[0])
            del b
    assert reused, "the memory of a dropped batch was not used again"
    images = kept.arrays[0]
    assert images.shape == (96, 3, 64, 64)
    np.testing.assert_array_equal(images, np.broadcast_to((kept.arrays[1] % 251).astype(np.uint8)[:, None, None, None], images.shape))


def test_a_pinned_chunk_is_let_go_of_at_push() -> None:
    """A chunk with a Pin views a worker's shared-memory slot (or a pinned
    object): rows wait in the buffer for long, so none of them may keep the
    chunk's memory, big rows included; the batches are the same."""
    plain = ShuffleBuffer(10, [0, 0], np.random.default_rng(3))
    pinned = ShuffleBuffer(10, [0, 0], np.random.default_rng(3))
    refs = []
    for k in range(8):
        c = image_chunk(k, 5)
        plain.push(c)
        slot = Chunk(tuple(a.copy() for a in c.arrays), c.n, 0, k, Pin())
        refs += [weakref.ref(a) for a in slot.arrays]
        pinned.push(slot)
        del slot
        gc.collect()
        assert all(r() is None for r in refs), "a pinned chunk's memory outlived its push"
    a, b = drain(plain, [], 4), drain(pinned, [], 4)
    assert [x.arrays[1].tolist() for x in a] == [x.arrays[1].tolist() for x in b]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.arrays[0], y.arrays[0])
