"""What a worker process does with a result it cannot send, and with a
shard reader that hands the same buffer out twice (docs/SOURCES.md).

Datasets and readers are module-level: the worker processes import them.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfInput, FetcherError, Net, RandomAccessSource, init_data_input_workers

from .helpers import WAIT

BLOBS = ["ids", "x"]
SRC = "train"


class Gigantic:
    """Each unit stacked by the dataset: ``x`` claims 2**38 floats per sample
    (a broadcast of one value): pickling the unit runs out of memory."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[Any, np.ndarray]:  # pragma: no cover - __getitems__ is used
        return np.int64(i), np.zeros(3, np.float32)

    def __getitems__(self, idx: list[int]) -> dict[str, np.ndarray]:
        return {"ids": np.array(idx, np.int64), "x": np.broadcast_to(np.float32(1), (len(idx), 1 << 38))}


def test_a_unit_that_cannot_be_pickled_names_the_pickling_not_the_dataset(gc: blobfeed.GlobalCoordinator) -> None:
    """The dataset returned a valid unit; blobfeed's pickling of it to the
    parent failed (MemoryError): the error says so, with that cause, the
    source, the worker and the read unit (it said "fetch_fun must return a
    list or tuple ..., got Unsendable")."""
    net = Net()
    init_data_input_workers(net, BLOBS, RandomAccessSource(Gigantic(), read_size=4, shuffle=False), 4,
                            num_worker_threads=1, coordinator=gc, epochs=1, backend="processes")
    gc.start()
    with pytest.raises(FetcherError) as info:
        net.run(timeout=30)
    text = str(info.value)
    assert "could not be sent to the parent" in text and "pickl" in text, text
    assert "MemoryError" in text, text
    assert f"source {SRC!r}, worker 0" in text, text
    assert "read unit 0" in text, text
    assert "must return a list or tuple" not in text and "got Unsendable" not in text, text


class WithBad:
    """Small chunks (sent pickled, several to a message); the chunk of step
    ``bad`` holds something that cannot be pickled."""

    def __init__(self, steps: int, bad: int) -> None:
        self.steps, self.bad, self.step = steps, bad, 0

    def __call__(self, worker_id: int, batch_size: int) -> Any:
        step, self.step = self.step, self.step + 1
        if step >= self.steps:
            raise StopIteration
        ids = np.full(2, step, np.int64)
        if step == self.bad:
            return [ids, _Unpicklable()]
        return [ids, np.full((2, 3), step, np.float32)]


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("no pickling this one")


def test_one_unpicklable_result_among_good_ones(
    gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """The good results pickled with it arrive; the bad one is refused by the
    parent's validator with the pickling's cause (skipped: on_error='skip')."""
    net = Net()
    init_data_input_workers(net, BLOBS, WithBad(12, bad=5), 2, num_worker_threads=1, coordinator=gc,
                            epochs=1, backend="processes", on_error="skip")
    gc.start()
    got = []
    with caplog.at_level(logging.WARNING, logger="blobfeed"):
        while True:
            try:
                got.append(np.array(net.run(timeout=30)["ids"], copy=True))
            except EndOfInput:
                break
    assert sorted({int(i) for b in got for i in b}) == [s for s in range(12) if s != 5]
    refused = [r.getMessage() for r in caplog.records if "could not be sent to the parent" in r.getMessage()]
    assert len(refused) == 1, [r.getMessage() for r in caplog.records]
    assert "no pickling this one" in refused[0] and f"source {SRC!r}, worker 0" in refused[0], refused[0]
    assert "list" in refused[0]  # the type of what could not be sent
