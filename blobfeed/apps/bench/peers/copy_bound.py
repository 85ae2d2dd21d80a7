"""``copy``: the copy bound of W2, one ``np.copyto`` per batch into
buffers rotated through more memory than the last-level cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..measure import Meter
from ..workloads import Workload


def run_copy(wl: Workload, seconds: float) -> dict[str, Any]:
    chunk = wl.fetcher(None).chunk(0)
    batch_bytes = wl.batch * chunk[0][0].nbytes
    src = np.random.default_rng(0).integers(0, 255, size=batch_bytes, dtype=np.uint8)
    # rotate through 256 MiB of destinations: far more than any last-level cache
    n_buf = max(2, (256 << 20) // batch_bytes)
    bufs = [np.empty(batch_bytes, np.uint8) for _ in range(n_buf)]
    for b in bufs:
        b.fill(1)  # fault the pages in first: this bound is about copying
    m = Meter(seconds)
    m.begin()
    i = 0
    while True:
        dst = bufs[i % n_buf]
        np.copyto(dst, src)
        i += 1
        if not m.tick([dst]):
            break
    return m.result()  # copies, loses nothing to count: no samples_lost ("-" in the table)


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "copy": run_copy,
}
#: they need no optional package
NEEDS: dict[str, str] = {}
