"""A worker process's batches assembled in its own slots (feeders/worker_batches.py),
without a process: the filler over a plain buffer."""

from __future__ import annotations

import numpy as np

from blobfeed.feeders.messages import read_arrays
from blobfeed.feeders.worker_batches import FILL_MAX_S, BatchFiller

SLOT = 1 << 16
HEADER = 64


def filler(slots: int = 4, min_bytes: int = 0) -> tuple[BatchFiller, bytearray, list[int]]:
    buf = bytearray(HEADER + slots * SLOT)
    free = list(range(slots))[::-1]
    return BatchFiller(buf, lambda s: HEADER + s * SLOT, SLOT, lambda: free.pop() if free else -1, min_bytes), buf, free


def chunk(first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.arange(first, first + n, dtype=np.int64)
    return ids, np.repeat((ids % 251).astype(np.uint8)[:, None], 100, axis=1)


def read(buf: bytearray, result) -> tuple[np.ndarray, ...]:
    packed = result.raw
    root = np.frombuffer(buf, np.uint8, offset=HEADER + packed.where * SLOT, count=SLOT)
    return tuple(read_arrays(root, packed))


def test_chunks_fill_batches_in_order_each_call_counted_where_it_starts() -> None:
    f, buf, _ = filler()
    out = []
    first = 0
    for n in (3, 5, 4, 7, 2):  # 21 samples: two batches of 8, 5 begun
        ids, x = chunk(first, n)
        assert f.takes([ids, x], True, 8, 1e-6)
        out += f.add(0.001 * n, [ids, x], True, 8)
        first += n
    assert [r.raw.meta[0][1] for r in out] == [(8,), (8,)]
    # 3 and 5 fill the first batch; 4 and 7 start in the second (7 straddles
    # into the third); 2 starts in the third, not sent yet
    assert [len(r.calls) for r in out] == [2, 2]
    assert out[0].seconds == sum(out[0].calls)
    got = [read(buf, r) for r in out]
    for k, (ids, x) in enumerate(got):
        assert ids.tolist() == list(range(8 * k, 8 * k + 8))
        assert (x == (ids % 251).astype(np.uint8)[:, None]).all()
    rest = f.flush()
    assert len(rest) == 1 and rest[0].raw.meta[1][1] == (5, 100) and len(rest[0].calls) == 1
    assert read(buf, rest[0])[0].tolist() == list(range(16, 21))
    assert f.flush() == [], "nothing begun after a flush"


def test_what_a_batch_cannot_take() -> None:
    f, _, _ = filler(min_bytes=500)
    ids, x = chunk(0, 4)
    assert not f.takes([ids, x], True, 4, 1e-6), "a batch or more: the parent cuts views of it"
    assert not f.takes([ids, x[:3]], True, 8, 1e-6), "blobs of different lengths: the parent's checks name it"
    assert not f.takes([np.int64(3)], True, 8, 1e-6), "no batch axis"
    assert not f.takes([ids[:1], x[:1]], True, 2, 1e-6), "a batch of 2 is under min_bytes"
    assert not f.takes([ids, np.zeros((4, SLOT), np.uint8)], True, 8, 1e-6), "a batch past the slot"
    assert f.takes([ids, x], True, 8, 1e-6)
    f.add(0.0, [ids, x], True, 8)
    assert f.matches([ids, x], True, 8)
    assert not f.matches([ids, x.astype(np.int16)], True, 8), "another dtype"
    assert not f.matches([ids, x[:, :50]], True, 8), "another per-sample shape"
    assert not f.matches((ids, x), False, 8), "a list, not a tuple"
    assert not f.matches([ids, x], True, 16), "another batch size"


def test_slow_calls_turn_it_off_and_fast_ones_back_on_below_half_the_bound() -> None:
    f, _, _ = filler()
    ids, x = chunk(0, 4)
    per_sample_slow = FILL_MAX_S / 8 * 2  # a batch of 8 would take twice the bound
    assert f.takes([ids, x], True, 8, 4 * FILL_MAX_S / 8 / 2), "fast: a batch within half the bound"
    for _ in range(20):
        on = f.takes([ids, x], True, 8, 4 * per_sample_slow)
    assert not on
    # just under the bound is not enough to turn it on again: under half
    for _ in range(20):
        on = f.takes([ids, x], True, 8, 4 * FILL_MAX_S / 8 * 0.9)
    assert not on
    for _ in range(20):
        on = f.takes([ids, x], True, 8, 4 * FILL_MAX_S / 8 * 0.4)
    assert on


def test_no_slot_left_sets_gone_and_writes_nothing() -> None:
    f, _, free = filler(slots=1)
    ids, x = chunk(0, 6)
    out = f.add(0.0, [ids, x], True, 4)  # fills slot 0, needs a second slot for the rest
    assert len(out) == 1 and f.gone
    assert free == []


def test_a_slow_first_call_does_not_turn_it_off_and_a_batch_begun_is_completed() -> None:
    f, _, _ = filler()
    ids, x = chunk(0, 2)
    slow = 2 * 10 * FILL_MAX_S  # a call of 2 samples: 10 x the bound for a batch of 8
    assert f.takes([ids, x], True, 8, slow), "a first call that warms up (imports, caches) is not the rule"
    f.add(slow, [ids, x], True, 8)
    for _ in range(3):
        assert f.takes([ids, x], True, 8, 1e-6)
        f.add(1e-6, [ids, x], True, 8)  # the batch of 8 is complete
    assert not f.filling
    for _ in range(8):  # slow from now on: off, once judged between batches
        on = f.takes([ids, x], True, 8, slow)
        if on:
            f.add(slow, [ids, x], True, 8)
    assert not on and not f.filling, "a batch begun is completed before it turns off"


# --------------------------------------------------------------------------- waking a worker
def _ring_and_area():
    import os

    from blobfeed.feeders.slot_ring import SlotRing
    from blobfeed.feeders.transport import SlotArea

    area, fd = SlotArea.create("test-wake", 4, 4096)
    os.close(fd)
    free_r, free_w = os.pipe()
    os.set_blocking(free_r, False)
    return SlotRing(4, free_w, area.set_viewed), area, free_r


def _pipe_records(fd: int) -> list[int]:
    import os

    from blobfeed.feeders.transport import SLOT_INDEX

    try:
        data = os.read(fd, 4096)
    except BlockingIOError:
        return []
    return [i for (i,) in SLOT_INDEX.iter_unpack(data)]


def test_a_batch_handed_out_wakes_a_worker_waiting_on_the_viewed_count_and_only_then() -> None:
    """A worker waits on the viewed count (its batches inside blobfeed)
    with its flag up; the parent then writes a wake-up on the free-slot
    pipe when a batch is handed out (viewed), where the worker looked again
    only every few milliseconds.  No flag, no token: nothing piles up."""
    import os

    from blobfeed.feeders.transport import WAKE

    ring, area, free_r = _ring_and_area()
    try:
        ring.hold(False)
        assert ring.grant_view(0)
        assert area.viewed() == 1 and _pipe_records(free_r) == [], "nobody waits: no token"
        area.set_waiting(True)
        ring.hold(False)
        assert ring.grant_view(1)
        assert area.viewed() == 2 and _pipe_records(free_r) == [WAKE]
        ring.release(0)  # a slot back wakes it by itself (its index)
        assert _pipe_records(free_r) == [0]
    finally:
        ring.close()
        os.close(free_r)
        area.close()
