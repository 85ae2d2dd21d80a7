"""How far a lane dealer runs ahead of its nets: one batch per outbox with
several nets, two with one (what every piece in an outbox costs: its chunk,
with process workers one of the worker's shared-memory slots)."""

from __future__ import annotations

import numpy as np
import pytest

from blobfeed import Net, init_data_input_workers
from blobfeed.coordinator import GlobalCoordinator
from blobfeed.feeders.chunks import Chunk
from blobfeed.feeders.dealing import LaneDealer, default_outbox_samples
from blobfeed.feeders.dealing.lanes import BIG_BATCH_BYTES


class _Pin:
    """Stands for a worker's slot: the dealer passes it on with every piece."""


def _fill(dealer: LaneDealer, chunks: int, sample_bytes: int = BIG_BATCH_BYTES) -> list[_Pin]:
    """``chunks`` chunks of one sample, said to be ``sample_bytes`` bytes."""
    pins = [_Pin() for _ in range(chunks)]
    for seq, pin in enumerate(pins):
        assert dealer.put(0, Chunk((np.array([seq]),), 1, 0, seq, pin), sample_bytes)  # type: ignore[arg-type]
    return pins


def _take_all(box: object) -> list[int]:
    """What a net takes before the stream waits for another net."""
    got: list[int] = []
    while True:
        ok, piece = box.get_nowait()  # type: ignore[attr-defined]
        if piece is None:
            return got
        got.extend(int(x) for x in piece.arrays[0])


def test_several_nets_hold_one_batch_each_while_one_net_takes() -> None:
    """Net 0 takes, nets 1-3 do not: with big batches each of their outboxes
    holds one batch (the stream then waits for them), not two -- with 4 nets
    on 2 process workers, two batches each was every slot of both workers (S1)."""
    bs = 4
    dealer = LaneDealer("s", bs, [0], capacity=1000, outbox_samples=None, on_error=lambda e: None)
    dealer.add_lanes([0])
    boxes = [dealer.add_net() for _ in range(4)]
    dealer.start()
    _fill(dealer, 100)
    assert dealer.outbox_samples == bs
    got = _take_all(boxes[0])
    # batches 0 and 4; batch 5 waits for net 1, whose outbox is full
    assert got == [0, 1, 2, 3, 16, 17, 18, 19]
    for i, box in enumerate(boxes[1:], 1):
        assert box.samples == bs, f"net {i}'s outbox holds {box.samples} samples ahead of it"
        assert [int(p.arrays[0][0]) for p in box.pieces] == list(range(4 * i, 4 * i + 4))
    pinned = sum(1 for box in boxes for p in box.pieces if isinstance(p.pin, _Pin))
    assert pinned == 3 * bs
    # the others take theirs, in order, and the stream goes on: exactly once
    for i, box in enumerate(boxes[1:], 1):
        assert _take_all(box)[:4] == list(range(4 * i, 4 * i + 4))


def test_several_nets_with_small_batches_keep_two_batches_each() -> None:
    bs = 4
    dealer = LaneDealer("s", bs, [0], capacity=1000, outbox_samples=None, on_error=lambda e: None)
    dealer.add_lanes([0])
    boxes = [dealer.add_net() for _ in range(4)]
    dealer.start()
    _fill(dealer, 100, sample_bytes=BIG_BATCH_BYTES // bs - 1)
    assert dealer.outbox_samples == 2 * bs
    assert _take_all(boxes[0]) == [0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35]
    assert [box.samples for box in boxes[1:]] == [2 * bs] * 3


def test_one_net_runs_two_batches_ahead_as_before() -> None:
    bs = 4
    dealer = LaneDealer("s", bs, [0], capacity=1000, outbox_samples=None, on_error=lambda e: None)
    dealer.add_lanes([0])
    box = dealer.add_net()
    dealer.start()
    assert dealer.outbox_samples == 2 * bs == default_outbox_samples(bs, 1)
    _fill(dealer, 10)
    assert _take_all(box) == list(range(10))


def test_an_explicit_outbox_is_kept_with_several_nets() -> None:
    dealer = LaneDealer("s", 4, [0], capacity=1000, outbox_samples=12, on_error=lambda e: None)
    dealer.add_lanes([0])
    boxes = [dealer.add_net() for _ in range(2)]
    dealer.start()
    assert dealer.outbox_samples == 12
    _fill(dealer, 100)
    _take_all(boxes[0])
    assert boxes[1].samples == 12


@pytest.mark.parametrize("bad", [0, -4, 2.0, "8"])
def test_a_bad_outbox_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="outbox_samples"):
        LaneDealer("s", 4, [0], capacity=10, outbox_samples=bad, on_error=lambda e: None)  # type: ignore[arg-type]


@pytest.mark.parametrize("nets", [1, 4])
def test_wired_nets_get_the_default_for_their_number(nets: int) -> None:
    """init_data_input_workers: several nets on one deterministic source of
    big batches run one batch ahead each, one net two (its pipeline is
    unchanged)."""
    gc = GlobalCoordinator()
    group = [Net(None, name=f"n{i}") for i in range(nets)]

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        return [np.zeros((3, 1 << 16), np.float32)]  # 256 KiB a sample

    for net in group:
        init_data_input_workers(net, ["x"], fetch, 8, 1, coordinator=gc, deterministic=True,
                                input_source_name="src")
    try:
        gc.start()
        for net in group:
            assert net.run(timeout=30)["x"].shape == (8, 1 << 16)
        assert gc._sources["src"].dealer.outbox_samples == (16 if nets == 1 else 8)
    finally:
        assert gc.stop()
