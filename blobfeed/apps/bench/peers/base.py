"""What the peers share: running one in a measurement, feeding the meter,
and the plain re-batching loop they use where the peer has none of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from ..measure import Meter, Tally
from ..workloads import Fetcher, Workload


def run_peer(wl: Workload, seconds: float, body: Callable[[Fetcher, Meter], Any], pss: bool | None = None) -> dict[str, Any]:
    """Runs a peer: ``body(fetcher, meter)`` feeds the meter until it says
    stop; then the result, with the ideal where the workload has one.  Peers
    do not count samples: they are not checked for losses.  ``pss``: read
    the process tree's PSS (default: always, as the Meter does)."""
    tally = Tally()
    try:
        fetcher = wl.fetcher(tally)
        m = Meter(seconds) if pss is None else Meter(seconds, pss=pss)
        body(fetcher, m)
        # no samples_lost: a peer does not count what it loses (the table shows "-")
        return m.result(**wl.ideal(tally, m.result()["batches_per_s"]))
    finally:
        tally.close()


def feed(m: Meter, batches: Iterable[Any]) -> None:
    """Ticks the meter with ``batches`` until its window is over."""
    for batch in batches:
        if not m.tick(batch):
            return


def _rebatched(chunks: Iterable[Any], batch: int) -> Iterator[list[np.ndarray]]:
    """Exact batches of ``batch`` samples from chunks of any size, in one
    plain loop: a batch inside one chunk is a view of it, one that spans
    chunks is one ``np.concatenate`` of the pieces."""
    parts: list[list[np.ndarray]] = []
    have = 0
    for chunk in chunks:
        m = len(chunk[0])
        start = 0
        while have + m - start >= batch:
            take = batch - have
            piece = [a[start : start + take] for a in chunk]
            if parts:
                parts.append(piece)
                yield [np.concatenate(col) for col in zip(*parts)]
                parts = []
            else:
                yield piece
            have = 0
            start += take
        if start < m:
            parts.append([a[start:] for a in chunk] if start else list(chunk))
            have += m - start
