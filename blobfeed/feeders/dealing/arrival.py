"""Arrival order (the default): one bounded queue per source, every net's
feed takes the next chunk from it, whichever net asks first.

This is Caffe2's internal queue.  Its reader is the queue itself (bound
methods, no wrapper on the hot path); a worker's error fails the source at
once.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

from ...queues import BlobsQueue, WatermarkQueue
from ..chunks import Chunk
from .base import DealerStats

__all__ = ["ArrivalDealer"]


class _QueueReader:
    """A net's end of the shared queue: the queue's own methods."""

    __slots__ = ("get_nowait", "wait_for_item", "qsize")  # the queue's, bound once

    def __init__(self, queue: BlobsQueue[Chunk]) -> None:
        self.get_nowait = queue.get_nowait
        self.wait_for_item = queue.wait_for_item
        self.qsize = queue.qsize

    def returned(self) -> None:
        """Arrival order keeps no positions."""

    def epoch_returned(self, dropped: int = 0) -> None:
        raise AssertionError("an arrival-order source has no epochs")


class ArrivalDealer:
    """Chunks in the order they arrive.  Thread-safe (the queue's lock).

    Args:
        source: the source's name.
        capacity: bound of the queue, in chunks (``max_buffered_batches``).
        fail: the source's failure (``InputSource.fail``), for a worker's error.
        max_bytes: bound of the queue, in bytes (``max_buffered_bytes``; None:
            counted, not bounded); a chunk larger than it enters an empty queue.
        follow_need: ``max_buffered_bytes="auto"``: the queue's byte limit
            may change while it runs, within ``max_bytes``
            (:mod:`blobfeed.buffers` changes it); False: it is fixed.
    """

    batch_size = None
    resumable = False

    def __init__(
        self, source: str, capacity: int, fail: Callable[[BaseException], None], max_bytes: int | None = None,
        follow_need: bool = False,
    ) -> None:
        # Fetchers blocked on a full queue sleep until it is half empty, then
        # refill it in a burst: far fewer wake-ups than one per chunk.
        make = WatermarkQueue if follow_need and max_bytes is not None else BlobsQueue
        self.queue: BlobsQueue[Chunk] = make(
            capacity, name=f"{source}/internal", low_water=capacity // 2,
            max_bytes=sys.maxsize if max_bytes is None else max_bytes,
        )
        self.max_bytes = max_bytes
        self._fail = fail
        self._workers: list[int] = []

    @property
    def closed(self) -> bool:
        return self.queue.closed

    @property
    def epoch(self) -> int:
        return 0

    @property
    def worker_ids(self) -> list[int]:
        return list(self._workers)

    def add_lanes(self, worker_ids: Sequence[int]) -> None:
        self._workers.extend(worker_ids)

    def add_net(self, prefetch: bool = True) -> _QueueReader:
        return _QueueReader(self.queue)

    def start(self) -> None:
        pass

    def sink(self, worker_id: int) -> Callable[[Chunk, int], bool]:
        return self.queue.put_sized  # no frame of ours per chunk

    def put_error(self, worker_id: int, error: BaseException) -> None:
        self._fail(error)

    def finish(self, worker_id: int) -> None:
        pass

    def end_of_input(self) -> None:
        self.queue.close()

    def end_epoch(self, worker_id: int, state: Any = None) -> bool:
        raise AssertionError("an arrival-order source has no epochs (make_dealer chooses lanes for epochs)")

    def close(self, reason: BaseException | None, *, in_order: bool = False) -> int:
        return sum(c.n for c in self.queue.close(reason))

    @property
    def capacity(self) -> int:
        return self.queue.capacity

    def queued(self) -> int:
        return self.queue.qsize()

    def queued_bytes(self) -> int:
        return self.queue.qbytes()

    def byte_limit(self) -> int | None:
        """The bound on the bytes queued in force now (``max_buffered_bytes``,
        or the working limit under it with ``"auto"``); None: unbounded."""
        return None if self.max_bytes is None else self.queue.max_bytes

    def stats(self) -> DealerStats:
        items = self.queue.snapshot()
        return DealerStats(sum(c.n for c in items), len(items), self.queue.capacity, self.queue.qbytes(), self.max_bytes)

    def state(self, layout: dict[str, Any], nets: Sequence[str]) -> dict[str, Any]:
        raise ValueError("not resumable")  # the coordinator checks `resumable` first

    def load(self, state: dict[str, Any]) -> list[tuple[int, Any]]:
        raise ValueError("not resumable")
