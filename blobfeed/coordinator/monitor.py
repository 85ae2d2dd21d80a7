"""The coordinator's monitor thread: about once a second it updates the
sources' rates, feeds the bottleneck verdict, calls the loggers every
``log_interval``, and, while a source's worker count is tuned
(``num_worker_threads="auto"``), ticks the tuner faster."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..autotune import TICK_S as AUTOTUNE_TICK_S
from ..bottleneck import fetcher_threads

__all__ = ["RATE_TICK_S", "monitor_loop"]

logger = logging.getLogger("blobfeed.coordinator")

#: Seconds between updates of ``blobfeed_inputs_per_second``.
RATE_TICK_S = 1.0


def monitor_loop(gc: Any, stop: threading.Event) -> None:
    """Body of the monitor thread of ``gc`` (a ``GlobalCoordinator``), until ``stop``."""
    tick = min(RATE_TICK_S, gc.log_interval)
    next_log = time.monotonic() + gc.log_interval
    next_rates = 0.0
    tuner = gc._autotune
    # Event.wait as a timer: a stop wakes it at once; faster while a
    # source's worker count is tuned (num_worker_threads="auto")
    while not stop.wait(min(tick, AUTOTUNE_TICK_S) if tuner.active else tick):
        try:
            now = time.monotonic()
            with gc._lock:
                coordinators = list(gc._coordinators)
            totals = None
            if tuner.active:
                totals = gc._hub.totals()
                try:
                    tuner.tick(now, totals, coordinators)
                except Exception:
                    logger.exception("blobfeed worker-count tuner tick failed")
            if now < next_rates:
                continue
            next_rates = now + tick * 0.9
            gc._hub.update_rates(now)
            totals = totals or gc._hub.totals()
            gc._bottleneck.observe(now, totals, fetcher_threads(coordinators))
            if gc._buffers.active:
                try:
                    gc._buffers.tick(now, totals)
                except Exception:
                    logger.exception("blobfeed buffer tuner tick failed")
            if now >= next_log:
                next_log = now + gc.log_interval
                for c in coordinators:
                    c._call_loggers()
        except Exception:
            logger.exception("blobfeed monitor tick failed")
