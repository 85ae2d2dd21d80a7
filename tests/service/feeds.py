"""Fetchers and wiring functions the service tests serve (importable by
the service's worker processes and by ``blobfeed serve``)."""

from __future__ import annotations

import os

import numpy as np

import blobfeed

#: samples per worker: the tests' expected ids come from here
CALLS = int(os.environ.get("BLOBFEED_TEST_CALLS", "40"))


def ids_of(worker: int, call: int) -> np.ndarray:
    n = 3 + (worker + call) % 5
    return worker * 100_000 + call * 10 + np.arange(n, dtype=np.int64)


def all_ids(workers: int, calls: int = CALLS) -> list[int]:
    return sorted(int(i) for w in range(workers) for c in range(calls) for i in ids_of(w, c))


class Fetch:
    """A worker's calls, counted per worker (stateful: resumable exactly)."""

    def __init__(self, calls: int = CALLS) -> None:
        self.calls = calls
        self.c = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if self.c >= self.calls:
            self.c = 0  # the next epoch starts over
            raise StopIteration
        ids = ids_of(worker_id, self.c)
        self.c += 1
        return [ids, np.stack([ids.astype(np.float32)] * 3, axis=1)]

    def state_dict(self) -> dict[str, int]:
        return {"c": self.c}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.c = state["c"]


def wire_by_index() -> None:
    """What the CLI tests serve: 2 workers, 4 consumers by index, deterministic, 2 epochs."""
    blobfeed.serve_source(
        "train", ["id", "x"], Fetch(), 8, 2, deterministic=True, num_consumers=int(os.environ.get("N", "4")),
        epochs=int(os.environ.get("EPOCHS", "1")), grace_period=float(os.environ.get("GRACE", "30")),
    )


def wire_first_come() -> None:
    blobfeed.serve_source("train", ["id", "x"], Fetch(), 8, 2, deterministic=True)


#: samples of BigFetch: 64 KiB of float32 each, so a batch of 32 is 2 MiB
BIG_ROW = 16 * 1024


class BigFetch(Fetch):
    """Fetch's ids with 64 KiB rows: batches big enough to be assembled in
    the source's arena (2 MiB for 32 samples)."""

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        ids, _ = super().__call__(worker_id, batch_size)
        return [ids, np.repeat(ids.astype(np.float32)[:, None], BIG_ROW, axis=1)]


class EpochSizes:
    """One worker's epochs of ``sizes[e]`` calls of 8 samples each (the
    last size repeats); ids unique across epochs.  Blobs as :class:`Fetch`'s
    (id int64, x float32 of 3 per sample: 192 bytes a batch of 8)."""

    def __init__(self, sizes: list[int], first_delay: float = 0.0) -> None:
        self.sizes = list(sizes)
        self.first_delay = first_delay
        self.e = self.c = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if self.first_delay:
            import time

            time.sleep(self.first_delay)  # a source slow to start (the test's point)
            self.first_delay = 0.0
        if self.c >= self.sizes[min(self.e, len(self.sizes) - 1)]:
            self.c = 0
            self.e += 1
            raise StopIteration
        ids = self.e * 1000 + self.c * 8 + np.arange(8, dtype=np.int64)
        self.c += 1
        return [ids, np.stack([ids.astype(np.float32)] * 3, axis=1)]

    def state_dict(self) -> dict[str, int]:
        return {"e": self.e, "c": self.c}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.e, self.c = state["e"], state["c"]


class WholeBatches:
    """``calls`` calls per epoch of exactly ``rows`` samples of BIG_ROW
    floats (each a whole batch of that size: it lies in one slot of the
    worker process that wrote it); ids unique per worker and call."""

    def __init__(self, rows: int, calls: int = CALLS) -> None:
        self.rows = rows
        self.calls = calls
        self.c = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if self.c >= self.calls:
            self.c = 0
            raise StopIteration
        ids = worker_id * 100_000 + self.c * self.rows + np.arange(self.rows, dtype=np.int64)
        self.c += 1
        return [ids, np.repeat(ids.astype(np.float32)[:, None], BIG_ROW, axis=1)]
