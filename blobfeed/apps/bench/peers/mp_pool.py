"""``pool``: ``multiprocessing.Pool(2).imap`` of the fetch function,
re-batched in the parent: what one writes by hand.  The standard
library's, so it always runs."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..measure import Meter
from ..workloads import Fetcher, Workload
from .base import _rebatched, feed, run_peer


_POOL_FETCHER: Fetcher | None = None
#: chunks asked of the pool and not yet taken: ``imap`` alone would queue
#: results without bound whenever the workers outrun the parent
POOL_IN_FLIGHT = 8


def _pool_init(fetcher: Fetcher) -> None:
    global _POOL_FETCHER
    _POOL_FETCHER = fetcher


def _pool_fetch(i: int) -> list:
    ident = multiprocessing.current_process()._identity
    assert _POOL_FETCHER is not None
    return _POOL_FETCHER.chunk(ident[-1] - 1 if ident else 0)


def run_pool(wl: Workload, seconds: float) -> dict[str, Any]:
    """``multiprocessing.Pool(2).imap`` of the fetch function, re-batched in
    this process: what one writes by hand.  ``forkserver``: with Linux's
    default ``fork`` the pool hung now and then (a worker forked while one of
    the parent's threads held a lock), which stalled a whole bench run."""

    def body(fetcher: Fetcher, m: Meter) -> None:
        in_flight = threading.Semaphore(POOL_IN_FLIGHT)
        stop = threading.Event()

        def tasks() -> Iterator[int]:
            i = 0
            while not stop.is_set():
                if in_flight.acquire(timeout=0.1):
                    yield i
                    i += 1

        m.begin()
        pool = multiprocessing.get_context("forkserver").Pool(2, initializer=_pool_init, initargs=(fetcher,))
        try:
            def chunks() -> Iterator[list]:
                for chunk in pool.imap(_pool_fetch, tasks()):
                    in_flight.release()
                    yield chunk

            feed(m, _rebatched(chunks(), wl.batch))
        finally:
            stop.set()
            pool.terminate()
            pool.join()

    return run_peer(wl, seconds, body)


#: this peer's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "pool": run_pool,
}
#: they need no optional package
NEEDS: dict[str, str] = {}
