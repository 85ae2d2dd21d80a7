"""The worker loop, once for every backend: call ``fetch_fun``, epoch after
epoch, and say what happened as events (:mod:`~blobfeed.feeders.messages`).

:func:`worker_events` is a generator, like the producer loop of grain's
``prefetch.py``: a thread worker hands each event to its intake at once
(:func:`deliver`), a worker process pickles them down its pipe, a Ray actor
yields them in bundles.  What differs per backend is only how an event
travels; the loop (``worker_init_fun`` and the :class:`WorkerInfo` of each
epoch, StopIteration, exceptions, halting) is this one.

Whoever iterates decides what an event means for the loop: it stops
iterating (and closes the generator) when the worker must stop -- after an
error ``on_error`` does not skip, or when its intake says so.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Generator

import numpy as np

from ..worker_info import WorkerInfo, for_epoch, is_last_epoch, set_worker_info
from .chunks import Pin, Stamped, StoppedWithState
from .indexed import UnitReader
from .messages import EpochDone, Exhausted, Raised, Result
from .replay import REPLAYING, ReplayMismatch

if TYPE_CHECKING:
    from .source import WorkerIntake

__all__ = ["EMPTY_BACKOFF_MAX_S", "deliver", "skips", "worker_events"]

#: consecutive calls that gave no data (``None``, arrays with no element,
#: or an exception ``on_error="skip"`` skips) a worker makes at full speed;
#: each further one waits first ...
EMPTY_FREE_CALLS = 3
#: ... twice as long as the one before, from this ...
EMPTY_BACKOFF_MIN_S = 0.001
#: ... up to this: a fetcher that only returns None is called about ten
#: times a second instead of spinning a core
EMPTY_BACKOFF_MAX_S = 0.1
_sleep = time.sleep
logger = logging.getLogger("blobfeed.feeders")


def _no_data(raw: Any) -> bool:
    """Whether a value ``fetch_fun`` returned carries no data: ``None``, or a
    list or tuple of arrays without one element (the chunk of no samples)."""
    if raw is None:
        return True
    if type(raw) is not list and type(raw) is not tuple or not raw:
        return False
    for a in raw:
        if not isinstance(a, np.ndarray) or a.size:
            return False
    return True


def _back_off(run: int, halted: Callable[[], bool]) -> None:
    """Wait before the next call of a worker whose last ``run`` calls gave no
    data (at most :data:`EMPTY_BACKOFF_MAX_S`: a stop waits no longer)."""
    if run > EMPTY_FREE_CALLS and not halted():
        _sleep(min(EMPTY_BACKOFF_MAX_S, EMPTY_BACKOFF_MIN_S * 2.0 ** min(run - EMPTY_FREE_CALLS - 1, 30)))


def worker_events(
    fetch_fun: Callable[[int, int], Any],
    worker_init_fun: Callable[[int], Any] | None,
    worker_id: int,
    info: WorkerInfo | None,
    hint: Callable[[], int],
    halted: Callable[[], bool],
    epochs: int | None = 1,
    epoch: int = 0,
) -> Generator[Result | Raised | EpochDone | Exhausted, None, None]:
    """One worker's loop, run in the thread that iterates it.

    Yields a :class:`Result` per value ``fetch_fun`` returns (its state split
    off a stateful fetcher's :class:`Stamped`), a :class:`Raised` per
    exception (``fatal`` when ``worker_init_fun`` raised: the loop ends), an
    :class:`EpochDone` at each StopIteration but the last epoch's, and
    :class:`Exhausted` at that one.  Ends, yielding nothing more, once
    ``halted()`` before a call.  ``info`` (epoch 0's) gives the
    :class:`WorkerInfo` of each epoch, bound to the thread while it runs.
    """
    perf = time.perf_counter
    try:
        while True:
            set_worker_info(None if info is None else for_epoch(info, epoch))
            if worker_init_fun is not None:
                try:
                    worker_init_fun(worker_id)
                except BaseException as exc:
                    yield Raised(0.0, exc, True)
                    return
            seconds = 0.0
            empty_run = 0  # consecutive calls that gave no data
            while not halted():
                t0 = perf()
                try:
                    raw = fetch_fun(worker_id, hint())
                except StopIteration as stop:
                    seconds = perf() - t0
                    after = stop.state if type(stop) is StoppedWithState else None
                    break
                except ReplayMismatch as exc:
                    yield Raised(perf() - t0, exc, True)  # the resume cannot go on, whatever on_error says
                    return
                except BaseException as exc:
                    yield Raised(perf() - t0, exc)
                    # skipped (on_error="skip"), or the loop is closed: a
                    # fetcher failing at every call gives no data either
                    empty_run += 1
                    _back_off(empty_run, halted)
                    continue
                seconds = perf() - t0
                if raw is REPLAYING:
                    continue  # a resume replays the calls before its position (halted() looked at between)
                if type(raw) is Stamped:  # a stateful fetch_fun's state travels with its result
                    yield Result(seconds, raw.raw, raw.state)
                    raw = raw.raw
                else:
                    yield Result(seconds, raw)
                # a fetcher that returns None at the end of its data must not
                # spin a core until the consumer's timeout: back off
                if _no_data(raw):
                    empty_run += 1
                    _back_off(empty_run, halted)
                else:
                    empty_run = 0
            else:
                return  # halted
            if is_last_epoch(epochs, epoch):
                yield Exhausted(seconds)
                return
            yield EpochDone(seconds, after)
            epoch += 1
    finally:
        # the loop makes no further call: a random-access reader frees what
        # it holds for this worker (a sharded source's open shard), in this
        # thread, after a stop or a failure as after the last unit
        if isinstance(fetch_fun, UnitReader):
            try:
                fetch_fun.worker_ended(worker_id)
            except Exception:
                logger.warning("source reader %r: ending worker %d raised", fetch_fun, worker_id, exc_info=True)
        set_worker_info(None)


def skips(on_error: str, event: Raised) -> bool:
    """Whether a worker goes on after ``event`` (``on_error="skip"``, a
    non-fatal ``Exception``), as its intake will decide; where the intake is
    in another process the worker decides by itself, the same way."""
    return on_error == "skip" and not event.fatal and isinstance(event.error, Exception)


def deliver(intake: "WorkerIntake", event: Any, pin: Pin | None = None, transport_bytes: int = 0) -> bool | None:
    """Hand one event to ``intake``, wherever it came from (exceptions
    already unpacked: ``remote`` tracebacks in ``event.tb``).  Returns True
    to go on, False when the worker must stop, None when it is done
    (:class:`Exhausted`)."""
    if type(event) is Result:
        if event.calls is None:
            intake.stats.fetch.observe(event.seconds)
            raw = event.raw if event.state is None else Stamped(event.raw, event.state)
            return intake.result(raw, pin, transport_bytes)
        for seconds in event.calls:
            intake.stats.fetch.observe(seconds)
        return intake.result(event.raw, pin, transport_bytes, len(event.calls))
    if type(event) is Raised:
        if not event.fatal:
            intake.stats.fetch.observe(event.seconds)
        return intake.exception(event.error, fatal=event.fatal, remote_tb=event.tb)
    if type(event) is EpochDone:
        intake.stats.fetch.observe(event.seconds)
        return intake.epoch_ended(event.state)
    if type(event) is Exhausted:
        intake.stats.fetch.observe(event.seconds)
        return None
    raise AssertionError(f"not a worker event: {event!r}")  # pragma: no cover - a bug
