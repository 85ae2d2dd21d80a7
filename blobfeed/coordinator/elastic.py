"""Changing a running random-access source's worker count
(``GlobalCoordinator.set_num_workers``): its stream does not depend on it."""

from __future__ import annotations

import logging
from typing import Any

from ..arguments import check_index
from .groups import DataInputCoordinator

__all__ = ["set_num_workers"]

logger = logging.getLogger("blobfeed.coordinator")


def set_num_workers(gc: Any, name: str, num_workers: int) -> None:
    """Run random-access source ``name`` on ``num_workers`` workers from now
    on, while it runs; its stream does not change.  (``GlobalCoordinator``'s
    method ``set_num_workers(name, num_workers)``; ``gc`` is the coordinator.)

    More workers start on the backend of the source's first wiring call
    (``worker_init_fun`` runs in each); fewer: the workers with the highest
    ids take no more read units and end once they delivered those they hold.

    Raises:
        ValueError: no such source, not a random-access source, not running
            (before ``start()``, after its end or stop), or ``num_workers``
            is not an int >= 1.
    """
    num_workers = check_index("num_workers", num_workers)
    with gc._lock:
        source = gc._live_source(name)
        if not source.dealing.random_access:
            raise ValueError(
                f"source {name!r} reads a fetch_fun: its stream depends on its worker count, which "
                "cannot change while it runs (set_num_workers is for random-access sources)"
            )
        groups = [c for c in gc._known.named(name) if isinstance(c, DataInputCoordinator)]
        if not groups or not all(c.started for c in groups) or source.halted or source.finished:
            raise ValueError(f"source {name!r} is not running: set_num_workers() goes after start()")
        units = source.dealer.units  # type: ignore[attr-defined]
        active = units.active(source.dealer.worker_ids)
        if num_workers > len(active):
            ids = gc._allocate(num_workers - len(active))
            source.register_fetchers(len(ids))
            source.add_workers(ids)
            groups[0].add_workers(ids)
        elif num_workers < len(active):
            units.stop_workers(active[num_workers:])
        if getattr(source.dealer, "window", None) is None:
            units.window = max(8, 4 * num_workers)  # the default window follows the worker count
        logger.info("source %r: %d workers now (were %d)", name, num_workers, len(active))
