"""Bringing a worker's ``fetch_fun`` to a saved position (deterministic mode).

A stateful ``fetch_fun`` (an object with ``state_dict()`` and
``load_state_dict(state)``) is restored from the state that travelled with
the last chunk the nets consumed; any other is replayed: the calls it made
before that position are made again and their results discarded.  Runs in
the worker (thread, process or actor), so the wrapper pickles with the
``fetch_fun`` it wraps.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Protocol, TypeGuard

from ..errors import FetcherError
from .chunks import Stamped, StoppedWithState

__all__ = ["REPLAYING", "ReplayMismatch", "Replayed", "is_stateful"]

#: calls replayed per call of the wrapper: between them the worker's loop
#: looks for a stop (a state may say a worker made billions of calls)
REPLAY_STEP = 256


class _Replaying:
    """What :class:`Replayed` returns while it replays: no data, no call of
    the worker's counted; the worker's loop calls it again (see worker_loop)."""

    def __repr__(self) -> str:
        return "REPLAYING"


REPLAYING = _Replaying()


class ReplayMismatch(FetcherError):
    """A replayed ``fetch_fun`` ended (StopIteration) before the calls the
    saved state says it made: the data or the fetcher changed since the
    state was saved, or the state is damaged.  Fatal, whatever ``on_error``."""


class _Stateful(Protocol):
    """A ``fetch_fun`` that saves and restores its own position."""

    def __call__(self, worker_id: int, batch_size: int) -> Any: ...

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def is_stateful(fetch_fun: Any) -> TypeGuard[_Stateful]:
    """True when ``fetch_fun`` can save and restore its own position."""
    return callable(getattr(fetch_fun, "state_dict", None)) and callable(getattr(fetch_fun, "load_state_dict", None))


class Replayed:
    """``fetch_fun`` as the deterministic stream calls it.

    ``start``: per worker id, ``(calls, state)``: the calls made before the
    position, and (stateful) the fetcher's state after the last of them.
    A stateful fetcher's results come back :class:`Stamped` with its state.
    Each worker gets its own copy of a stateful fetcher (as each worker
    process has): its state is then that worker's position alone.
    """

    def __init__(self, fetch_fun: Callable[[int, int], Any], start: dict[int, tuple[int, Any]]) -> None:
        self.fetch_fun = fetch_fun
        #: fetch_fun when it is stateful (the one each worker copies), else None
        self._stateful_fun: _Stateful | None = fetch_fun if is_stateful(fetch_fun) else None
        self.stateful = self._stateful_fun is not None
        self.start = dict(start)
        self._own: dict[int, _Stateful] = {}
        #: per worker id being replayed: the calls replayed so far
        self._replayed: dict[int, int] = {}

    def __call__(self, worker_id: int, batch_size: int) -> Any:
        begin = self.start.pop(worker_id, None)
        own: _Stateful | None = None  # this worker's copy of a stateful fetch_fun
        if self._stateful_fun is not None:
            own = self._own.get(worker_id)
            if own is None:
                own = self._own[worker_id] = copy.deepcopy(self._stateful_fun)
        fetch = self.fetch_fun if own is None else own
        if begin is not None:
            calls, state = begin
            if own is not None and state is not None:
                own.load_state_dict(state)
            elif calls:
                return self._replay(fetch, worker_id, batch_size, calls, state)
        try:
            raw = fetch(worker_id, batch_size)
        except StopIteration:
            if own is not None:
                # where the next epoch resumes from: the state after the end
                raise StoppedWithState(own.state_dict()) from None
            raise
        if own is not None:
            return Stamped(raw, own.state_dict())
        return raw

    def _replay(self, fetch: Callable[[int, int], Any], worker_id: int, batch_size: int, calls: int,
                state: Any) -> Any:
        """Make up to :data:`REPLAY_STEP` of the ``calls`` still to replay,
        discarding their results; :data:`REPLAYING` while some are left."""
        done = self._replayed.get(worker_id, 0)
        step = min(calls, REPLAY_STEP)
        for _ in range(step):
            try:
                fetch(worker_id, batch_size)
            except StopIteration:
                self._replayed.pop(worker_id, None)
                raise ReplayMismatch(
                    f"worker {worker_id}: the saved state says its fetch_fun had made {done + calls} calls "
                    f"before the saved position; made again, it ended after {done} (StopIteration): the data "
                    "or the fetcher changed since the state was saved, or the state is damaged"
                ) from None
            except Exception:  # skipped the first time too (on_error="skip")
                pass
            done += 1
            calls -= 1
        if calls:
            self.start[worker_id] = (calls, state)
            self._replayed[worker_id] = done
        else:
            self._replayed.pop(worker_id, None)
        return REPLAYING
