"""Fetchers of the contract suite.  Module level, so they pickle by
reference for the process and Ray backends (the child and the actor import
this module).

The data is a pure function of (epoch, worker id, call index): a sample's id
says where it came from, so a consumer can check exactly-once delivery per
epoch, chunk order, blob alignment and, across backends, identical batches.
Per-worker state is keyed by worker id: with threads one object serves every
worker, with processes and Ray each worker has its own copy.
"""

from __future__ import annotations

import random
import time
from typing import Any, Iterable

import numpy as np

from blobfeed import get_worker_info

#: sample id = epoch * ESPAN + worker id * WSPAN + call index * KSPAN + row
ESPAN = 1_000_000_000
WSPAN = 10_000_000
KSPAN = 2_000
#: rows of a "big" chunk: 1500 x 24 B = 36 KiB, past the 32 KiB from which a
#: worker process hands a chunk over in shared memory rather than pickled
BIG = 1500


class Boom(RuntimeError):
    """What a fetcher raises: its args carry (worker id, call, time.time()),
    so the test sees the original object and when it was raised, across
    processes."""


def chunk_size(salt: int, epoch: int, wid: int, k: int) -> int:
    return random.Random(f"{salt}:{epoch}:{wid}:{k}").randint(2, 11)


def make_chunk(epoch: int, wid: int, k: int, n: int) -> list[np.ndarray]:
    """``ids`` int64 (n,); ``feat`` float64 (n, 2) with ``feat[:, 0] == ids``
    (alignment) and ``feat[:, 1] == wid``."""
    ids = np.arange(n, dtype=np.int64) + epoch * ESPAN + wid * WSPAN + k * KSPAN
    feat = np.empty((n, 2), np.float64)
    feat[:, 0] = ids
    feat[:, 1] = wid
    return [ids, feat]


class Fetch:
    """Worker ``index`` makes ``lengths[index]`` calls per epoch that return
    chunks (then StopIteration); ``lengths`` shorter than the workers: the
    last length repeats.  ``endless``: never StopIteration.

    ``raise_at`` / ``bad_at`` / ``big_at`` / ``none_at``: (worker index,
    call) pairs where the call raises :class:`Boom`, returns a chunk whose
    ``feat`` has one row too few, returns a :data:`BIG` chunk, or returns
    ``None`` (no chunk: skipped even with ``on_error="raise"``, it takes no
    turn in the deterministic modes).  ``use_rng``: ``feat[:, 1]`` is the
    worker id plus a draw in [0, 0.5) from its ``get_worker_info().rng`` (the
    same on every backend for a seed), not the worker id alone.  ``pace``: seconds slept before
    each call (pacing so a test's own thread gets the CPU; never used to
    synchronise).
    """

    def __init__(self, lengths: Iterable[int] = (6, 3, 8), *, salt: int = 0, endless: bool = False,
                 raise_at: Iterable[tuple[int, int]] = (), bad_at: Iterable[tuple[int, int]] = (),
                 big_at: Iterable[tuple[int, int]] = (), none_at: Iterable[tuple[int, int]] = (),
                 use_rng: bool = False, pace: float = 0.0) -> None:
        self.lengths = list(lengths)
        self.salt = salt
        self.endless = endless
        self.raise_at = frozenset(raise_at)
        self.bad_at = frozenset(bad_at)
        self.big_at = frozenset(big_at)
        self.none_at = frozenset(none_at)
        self.use_rng = use_rng
        self.pace = pace
        self.calls: dict[tuple[int, int], int] = {}

    def length(self, index: int) -> int:
        return self.lengths[min(index, len(self.lengths) - 1)]

    def size(self, index: int, epoch: int, wid: int, k: int) -> int:
        return BIG if (index, k) in self.big_at else chunk_size(self.salt, epoch, wid, k)

    def __call__(self, wid: int, batch_size: int) -> list[np.ndarray]:
        info = get_worker_info()
        assert info is not None and info.worker_id == wid
        epoch = info.epoch
        k = self.calls.get((wid, epoch), 0)
        if not self.endless and k >= self.length(info.index):
            raise StopIteration
        self.calls[(wid, epoch)] = k + 1
        if self.pace:
            time.sleep(self.pace)
        if (info.index, k) in self.raise_at:
            raise Boom("boom", wid, k, time.time())
        if (info.index, k) in self.none_at:
            return None  # type: ignore[return-value]
        chunk = make_chunk(epoch, wid, k, self.size(info.index, epoch, wid, k))
        if self.use_rng:
            chunk[1][:, 1] += info.rng.random(len(chunk[0])) / 2
        if (info.index, k) in self.bad_at:
            chunk[1] = chunk[1][:-1]
        return chunk

    # -- what a run must deliver -----------------------------------------------------------
    def chunks(self, workers: dict[int, int], epoch: int = 0, *, skipped: bool = True) -> list[np.ndarray]:
        """The ids of every chunk the workers ``{worker id: index}`` return
        in ``epoch`` (a finite fetcher), in call order per worker, without
        the calls that return None, nor those that raise or are malformed
        when ``skipped``."""
        out = []
        for wid, index in workers.items():
            for k in range(self.length(index)):
                if (index, k) in self.none_at:
                    continue
                if skipped and ((index, k) in self.raise_at or (index, k) in self.bad_at):
                    continue
                out.append(make_chunk(epoch, wid, k, self.size(index, epoch, wid, k))[0])
        return out


class IdleFetch:
    """A source that never yields a sample: every call returns an empty
    chunk (skipped by blobfeed) after ``pace`` seconds, so a net fed by it
    waits in ``run()`` while the worker is never stuck inside ``fetch_fun``."""

    def __init__(self, pace: float = 0.02) -> None:
        self.pace = pace

    def __call__(self, wid: int, batch_size: int) -> list[np.ndarray]:
        time.sleep(self.pace)
        return [np.empty(0, np.int64), np.empty((0, 2), np.float64)]


class StatefulFetch(Fetch):
    """A fetcher restored from its state on resume (never replayed)."""

    def state_dict(self) -> dict[str, Any]:
        return {"calls": [[w, e, k] for (w, e), k in self.calls.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = {(w, e): k for w, e, k in state["calls"]}

