"""Fetcher backends: what runs the workers of a source.

A backend is a plug-in of one seam.  :func:`init_data_input_workers` builds a
:class:`LaunchPlan` (the source's name, ``fetch_fun``, and for each worker its
id, :class:`~blobfeed.WorkerInfo` and :class:`WorkerIntake`); the backend's
``launch`` starts the workers and returns a :class:`WorkerGroup` the
coordinator stops and joins.  Whatever the backend, a worker hands every
result of ``fetch_fun`` to its intake, which validates, counts and queues it,
so the contract (exact batches, errors, accounting, metrics) lives in one
place and a backend only moves data.

Backends: :class:`ThreadBackend` (``"threads"``, here), ``ProcessBackend``
(``"processes"``, :mod:`blobfeed.feeders.processes`), and any object with the
same two methods (``blobfeed.ray.RayBackend``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, NamedTuple, Protocol, Sequence, runtime_checkable

from ..worker_info import WorkerInfo
from .source import WorkerIntake
from .worker_loop import deliver, worker_events

__all__ = [
    "FetchFun", "FetcherBackend", "LaunchPlan", "ThreadBackend", "WorkerGroup", "WorkerPlan", "runs_user_code",
]

logger = logging.getLogger("blobfeed.feeders")

FetchFun = Callable[[int, int], Any]
WorkerInitFun = Callable[[int], Any]


class WorkerPlan(NamedTuple):
    """One worker to start."""

    worker_id: int
    info: WorkerInfo
    intake: WorkerIntake


class LaunchPlan(NamedTuple):
    """Everything a backend needs to start the workers of one ``init`` call."""

    source: str
    fetch_fun: FetchFun
    worker_init_fun: WorkerInitFun | None
    workers: Sequence[WorkerPlan]
    #: the current batch size, the fetchers' hint (reset_data_input changes it)
    batch_size_hint: Callable[[], int]
    #: to be called by every thread the backend starts, when it ends
    on_thread_exit: Callable[[], None]
    #: passes over the data (None: endless).  A worker whose ``fetch_fun``
    #: raised StopIteration while another epoch follows tells its intake
    #: (``epoch_ended``), in order with its results, and starts that epoch:
    #: its WorkerInfo (``for_epoch``) set, ``worker_init_fun`` run again
    epochs: int | None = 1
    #: the epoch the workers start in (a resumed run: the saved one)
    first_epoch: int = 0
    #: a random-access source's read units
    #: (:class:`~blobfeed.feeders.indexed.UnitDispenser`): a thread worker's
    #: ``fetch_fun`` takes them itself; a process worker gets them down a pipe
    units: Any = None
    #: a fetch_fun source whose worker count may change while it runs
    #: (``set_num_workers``, ``num_worker_threads="auto"``): its workers can
    #: be told one by one to stop (:meth:`WorkerGroup.retire`)
    elastic: bool = False
    #: worker processes: the dealer's puller, through which the thread that
    #: waits for chunks receives their messages (see blobfeed.feeders.pulling),
    #: asked for at the group's start; None from it: receiver threads
    pulled_by: Callable[[], Any] | None = None


class WorkerGroup(Protocol):
    """Running workers, as the coordinator sees them.  Thread-safe."""

    def request_stop(self) -> None:
        """Make every worker end soon and wake what blocks; never waits."""

    def join(self, deadline: float | None) -> list[str]:
        """Wait for the workers until ``deadline`` (``time.monotonic()``;
        None: no bound).  Returns the names of those still running (see
        :func:`runs_user_code` for which of them run user code)."""

    def alive(self) -> list[str]:
        """Names of the workers (and helper threads) still running."""

    def retire(self, worker_ids: Sequence[int]) -> None:
        """Make the workers ``worker_ids`` (their intakes' ``retired`` set
        already) make no further call once their current one returned;
        never waits.  Backends that do not have it cannot shrink a running
        fetch_fun source."""


@runtime_checkable
class FetcherBackend(Protocol):
    """A way to run workers: ``"threads"``, ``"processes"``, a Ray cluster."""

    #: the ``backend`` label of its metrics
    name: str

    def check(self, fetch_fun: FetchFun, worker_init_fun: WorkerInitFun | None) -> None:
        """Refuse, at ``init_data_input_workers`` time, what this backend
        cannot run (``TypeError`` naming what does not pickle, say)."""

    def launch(self, plan: LaunchPlan) -> WorkerGroup:
        """Start the workers of ``plan``."""


def run_worker(
    intake: WorkerIntake,
    fetch_fun: FetchFun,
    worker_init_fun: WorkerInitFun | None,
    hint: Callable[[], int],
    info: WorkerInfo | None,
    epochs: int | None = 1,
    first_epoch: int = 0,
    elastic: bool = False,
) -> None:
    """One worker's loop (:func:`~blobfeed.feeders.worker_loop.worker_events`)
    in the thread that runs it, each event handed to the intake at once,
    until the last StopIteration, an error, or a stop."""
    exhausted = False
    intake.started()
    # asked before every call: a C-level partial, no Python frame per chunk
    # (a worker of a source whose worker count may change asks its intake,
    # which also knows whether set_num_workers removed it)
    halted = intake.stop_asked if elastic else functools.partial(getattr, intake.source, "halted")
    events = worker_events(
        fetch_fun, worker_init_fun, intake.worker_id, info, hint, halted, epochs, first_epoch,
    )
    try:
        for event in events:
            go = deliver(intake, event)
            if not go:
                exhausted = go is None
                break
    finally:
        events.close()  # the loop's own finally: the thread's WorkerInfo unset
        intake.finished(exhausted)


#: names of the threads (and worker processes, Ray actors) that run user
#: code: a fetch_fun, worker_fun, init_fun, external logger or shutdown_fun
USER_CODE_PREFIXES = ("blobfeed-fetch-", "blobfeed-worker-", "blobfeed-log-", "blobfeed-shutdown-", "ray-actor-")


def runs_user_code(name: str) -> bool:
    """Whether ``name``, one a :meth:`WorkerGroup.join` returned, runs user
    code, which blobfeed cannot interrupt.  Any other (a receiver, a watcher,
    an enqueuer) is one of blobfeed's own threads: still running past a stop
    is a bug of blobfeed's, never to be blamed on a ``fetch_fun``."""
    return name.startswith(USER_CODE_PREFIXES)


def thread_main(name: str, fn: Callable[[], None], on_exit: Callable[[], None]) -> None:
    """The body of every thread blobfeed starts: nothing escapes unlogged,
    and the coordinator hears of the end (``join()`` waits on it)."""
    try:
        fn()
    except BaseException:
        logger.exception("blobfeed thread %s died", name)
    finally:
        on_exit()


class _ThreadGroup:
    def __init__(self, threads: list[threading.Thread]) -> None:
        self._threads = threads

    def request_stop(self) -> None:
        # The source's halt and the closing of its queue already end them:
        # a thread cannot be interrupted inside fetch_fun.
        pass

    def join(self, deadline: float | None) -> list[str]:
        me = threading.current_thread()
        stuck = []
        for t in self._threads:
            if t is not me:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                stuck.append(t.name)
        return stuck

    def alive(self) -> list[str]:
        return [t.name for t in self._threads if t.is_alive()]

    def retire(self, worker_ids: Sequence[int]) -> None:
        pass  # each thread asks its intake before every call (run_worker)


class ThreadBackend:
    """Workers are daemon threads of this process (``backend="threads"``).

    Nothing is copied or pickled; a ``fetch_fun`` that holds the GIL gets one
    core however many workers it has.
    """

    #: runs random-access sources (gives its workers read units: LaunchPlan.units)
    random_access = True
    #: can add and remove workers of a running fetch_fun source (LaunchPlan.elastic, WorkerGroup.retire)
    elastic = True
    name = "threads"

    def check(self, fetch_fun: FetchFun, worker_init_fun: WorkerInitFun | None) -> None:
        pass

    def launch(self, plan: LaunchPlan) -> WorkerGroup:
        threads = []
        for w in plan.workers:
            name = f"blobfeed-fetch-{plan.source}-{w.worker_id}"
            body = functools.partial(
                run_worker, w.intake, plan.fetch_fun, plan.worker_init_fun, plan.batch_size_hint, w.info,
                plan.epochs, plan.first_epoch, plan.elastic,
            )
            threads.append(threading.Thread(
                target=thread_main, args=(name, body, plan.on_thread_exit), name=name, daemon=True
            ))
        for t in threads:
            t.start()
        return _ThreadGroup(threads)

    def __repr__(self) -> str:
        return "ThreadBackend()"
