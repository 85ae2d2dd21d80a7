"""How ``blobfeed demo`` checks a run: the positions the fetchers hand out
(every sample once per pass), how often each was delivered (exactly once),
the checks run on blocks of batches, and the fetchers' chunk sizes."""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

__all__ = ["Blocks", "Coverage", "PositionReader", "chunk_sizes"]


class PositionReader:
    """Hands out spans of a run of ``passes`` passes over ``n`` samples.

    A position ``p`` in ``[0, passes * n)`` is sample ``p % n`` of pass
    ``p // n``.  Each call to :meth:`take` returns the next span, never
    crossing a pass boundary, so every sample is read exactly once per pass.
    Thread-safe: the fetcher threads share one reader.
    """

    def __init__(self, n: int, passes: int) -> None:
        self.n = n
        self.total = n * passes
        self._next = 0
        self._lock = threading.Lock()

    def take(self, count: int) -> tuple[int, int] | None:
        """The next span ``(start, stop)`` of at most ``count`` positions, or None at the end."""
        with self._lock:
            start = self._next
            if start >= self.total:
                return None
            stop = min(start + count, (start // self.n + 1) * self.n, self.total)
            self._next = stop
        return start, stop


class Coverage:
    """How often each position of a run of ``passes`` passes over ``n``
    samples was delivered, holding only the passes still open.

    A pass's counts (``n`` small ints) exist from its first delivered
    position until all ``n`` were delivered exactly once; then only the fact
    that it closed is kept.  So the memory is ``n`` times the passes in
    flight (those the queues hold part of), whatever ``passes`` is: the
    demo's ``--passes 10000`` used to hold several arrays of ``n * passes``
    (964 MB).  Positions delivered more than once (in a closed pass too) and
    positions never delivered are still counted exactly.  A few microseconds
    a batch: the demo's consumer calls it once per batch.
    """

    def __init__(self, n: int, passes: int) -> None:
        if n < 1 or passes < 1:
            raise ValueError(f"Coverage needs n >= 1 and passes >= 1, got n={n}, passes={passes}")
        self.n = n
        self.passes = passes
        #: open pass -> delivery count per sample of the pass
        self._open: dict[int, np.ndarray] = {}
        #: every pass below this one closed; the closed passes at or above it
        self._closed_below = 0
        self._closed: set[int] = set()
        self._repeated_closed = 0
        #: positions outside ``[0, n * passes)``
        self.out_of_range = 0

    def add(self, positions: np.ndarray) -> None:
        """Count one batch's positions."""
        pos = np.asarray(positions).ravel()
        if not len(pos):
            return
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0 or hi >= self.n * self.passes:
            bad = (pos < 0) | (pos >= self.n * self.passes)
            self.out_of_range += int(bad.sum())
            self.add(pos[~bad])
            return
        k_lo, k_hi = lo // self.n, hi // self.n
        if k_lo == k_hi:  # the common case: the batch lies in one pass
            self._add_pass(k_lo, pos - k_lo * self.n)
            return
        which = pos // self.n
        for k in range(k_lo, k_hi + 1):
            samples = pos[which == k]
            if len(samples):
                self._add_pass(k, samples - k * self.n)

    def _add_pass(self, k: int, samples: np.ndarray) -> None:
        if k < self._closed_below or k in self._closed:  # each of its samples came before
            self._repeated_closed += len(np.unique(samples))
            return
        counts = self._open.get(k)
        if counts is None:
            counts = self._open[k] = np.zeros(self.n, np.int32)
        np.add.at(counts, samples, 1)
        if np.count_nonzero(counts) == self.n and counts.max() == 1:
            del self._open[k]  # complete, each sample once: forget its counts
            self._closed.add(k)
            while self._closed_below in self._closed:
                self._closed.discard(self._closed_below)
                self._closed_below += 1

    @property
    def open_passes(self) -> int:
        """Passes begun and not yet complete (or spoilt by a repeat)."""
        return len(self._open)

    def held_bytes(self) -> int:
        """Bytes of the per-pass counts held now."""
        return sum(c.nbytes for c in self._open.values())

    @property
    def repeated(self) -> int:
        """Positions delivered more than once (each counted once)."""
        return self._repeated_closed + sum(int((c > 1).sum()) for c in self._open.values())

    def missing(self) -> int:
        """Positions never delivered."""
        begun = self._closed_below + len(self._closed) + len(self._open)
        return (self.passes - begun) * self.n + sum(self.n - int(np.count_nonzero(c)) for c in self._open.values())

    def exact(self) -> bool:
        """Was every position delivered exactly once?"""
        return not self._open and self._closed_below == self.passes and self.out_of_range == 0 \
            and self._repeated_closed == 0

    def problem(self) -> str:
        """What went wrong, in words ("" when every position came exactly once)."""
        if self.exact():
            return ""
        return (f"{self.missing()} samples never scored, {self.repeated} scored more than once"
                + (f", {self.out_of_range} positions out of range" if self.out_of_range else ""))


class Blocks:
    """Collects per-batch arrays and hands them on in blocks of ``every``
    batches, concatenated: a check that costs a few numpy calls then runs
    once per block, not per batch (the consumer's thread competes with the
    fetchers for the GIL: per-batch checks slowed the demo by a third).
    Holds at most ``every`` batches' arrays."""

    def __init__(self, every: int, on_block: Callable[..., None]) -> None:
        self.every = every
        self.on_block = on_block
        self._held: list[tuple[np.ndarray, ...]] = []

    def add(self, *arrays: np.ndarray) -> None:
        """One batch's arrays (the same number every time)."""
        self._held.append(arrays)
        if len(self._held) >= self.every:
            self.flush()

    def flush(self) -> None:
        """Hand on what is held (the end of the run calls it)."""
        if self._held:
            held, self._held = self._held, []
            self.on_block(*(np.concatenate(column) for column in zip(*held)))


def chunk_sizes(seed: int, worker_id: int, batch_size: int) -> Callable[[], int]:
    """Chunk sizes for one worker: uniform in 1 .. 2 * batch_size, seeded per worker."""
    rng = np.random.default_rng([seed, worker_id])
    hi = 2 * batch_size

    def next_size() -> int:
        return int(rng.integers(1, hi + 1))

    return next_size

