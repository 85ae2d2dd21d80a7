"""Changing a running source's worker count (``GlobalCoordinator.set_num_workers``).

A random-access source's stream does not depend on it.  A ``fetch_fun``
source in arrival order (not ``deterministic``, no ``shuffle_buffer``,
``epochs=1``, not ``equal``) can change too, on threads, processes or Ray actors: its
stream is the chunks in the order they arrive anyway, but its fetcher must
not split the data by worker (``get_worker_info().num_workers`` changes).
"""

from __future__ import annotations

import logging
from typing import Any

from ..arguments import check_index
from ..feeders import InputSource
from .groups import DataInputCoordinator

__all__ = ["set_num_workers", "num_workers"]

logger = logging.getLogger("blobfeed.coordinator")

#: how long new workers started while their source stopped may take to end
STOP_NEW_WORKERS_S = 10.0


def _groups(gc: Any, name: str) -> list[DataInputCoordinator]:
    return [c for c in gc._known.named(name) if isinstance(c, DataInputCoordinator)]


def elastic_refusal(source: InputSource, groups: list[DataInputCoordinator]) -> str | None:
    """Why the worker count of ``source`` cannot change while it runs; None when it can."""
    if source.dealing.random_access:
        return None
    if not source.dealing.in_arrival_order:
        return (
            f"source {source.name!r} reads a fetch_fun with {source.dealing.describe()}: its stream "
            "depends on its worker count (the chunks are taken by worker id), which cannot change "
            "while it runs; only a fetch_fun source in arrival order (deterministic=False, "
            "shuffle_buffer=0, epochs=1, equal=False) or a random-access source can"
        )
    slow = [repr(c.backend) for c in groups if not getattr(c.backend, "elastic", False)]
    if slow:
        return (
            f"source {source.name!r} reads a fetch_fun on {', '.join(slow)}: that backend cannot add or "
            "remove workers of a running fetch_fun source (threads, processes and Ray can)"
        )
    return None


def num_workers(gc: Any, name: str) -> int:
    """The workers source ``name`` runs on now: its wiring calls' count,
    then the last ``set_num_workers``' (a removed worker may still be
    finishing its last call).  ``GlobalCoordinator.num_workers(name)``.

    Raises:
        ValueError: no such source.
    """
    with gc._lock:
        return gc._live_source(name).worker_count


def set_num_workers(gc: Any, name: str, num_workers: int) -> None:
    """Run source ``name`` on ``num_workers`` workers from now on, while it
    runs.  (``GlobalCoordinator``'s method ``set_num_workers(name,
    num_workers)``; ``gc`` is the coordinator.)

    A random-access source's stream does not change.  A ``fetch_fun``
    source in arrival order (threads, processes, Ray actors) gets new worker ids; its
    ``fetch_fun`` must not split the data by worker, since
    ``get_worker_info().num_workers`` differs between its workers.

    More workers start on the backend of the source's first wiring call
    (``worker_init_fun`` runs in each); fewer: the workers with the highest
    ids take no more read units (random-access) or make no further
    ``fetch_fun`` call (fetch_fun), hand over what they hold and end; the
    source still ends when every remaining worker has finished.

    Raises:
        ValueError: no such source; one whose stream depends on its worker
            count (a fetch_fun source with ``deterministic``,
            ``shuffle_buffer``, ``epochs`` other than 1 or ``equal``); a
            backend without ``elastic`` (one of your own), for a fetch_fun
            source; not running
            (before ``start()``, after its end or stop, or stopped while
            the new workers started: they are stopped too); or
            ``num_workers`` is not an int >= 1.
    """
    num_workers = check_index("num_workers", num_workers)
    more = None
    with gc._lock:
        source = gc._live_source(name)
        groups = _groups(gc, name)
        why = elastic_refusal(source, groups)
        if why is not None:
            raise ValueError(why + " (set_num_workers)")
        if not groups or not all(c.started for c in groups) or source.halted or source.finished:
            raise ValueError(f"source {name!r} is not running: set_num_workers() goes after start()")
        if source.dealing.random_access:
            units = source.dealer.units
            active = units.active(source.dealer.worker_ids)
            was = len(active)
            if num_workers > len(active):
                ids = gc._allocate(num_workers - len(active))
                source.register_fetchers(len(ids))
                source.add_workers(ids)
                more = groups[0].add_workers(ids, num_workers)
            elif num_workers < len(active):
                units.stop_workers(active[num_workers:])
            units.set_window(workers=num_workers)  # a fitted window follows the worker count
        else:
            mine = sorted((wid, c) for c in groups for wid in c.active_workers())
            was = len(mine)
            if num_workers > was:
                ids = gc._allocate(num_workers - was)
                source.register_fetchers(len(ids))  # refuses a source that ended meanwhile
                source.add_workers(ids)
                more = groups[0].add_workers(ids, num_workers)
            elif num_workers < was:
                for wid, c in mine[num_workers:]:
                    c.retire_workers([wid])
        source.worker_count = num_workers
    # started outside the lock (pickling the fetcher or dataset, starting processes is slow)
    try:
        started = more is None or groups[0].launch_more(more, STOP_NEW_WORKERS_S)
    except BaseException:
        with gc._lock:
            source.worker_count = was  # they never ran
        raise
    if not started:
        raise ValueError(f"source {name!r} stopped while set_num_workers() started its new workers")
    if num_workers != was:
        logger.info("source %r: %d workers now (were %d)", name, num_workers, was)
