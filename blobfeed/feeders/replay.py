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
from typing import Any, Callable

from .chunks import Stamped, StoppedWithState

__all__ = ["Replayed", "is_stateful"]


def is_stateful(fetch_fun: Any) -> bool:
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
        self.stateful = is_stateful(fetch_fun)
        self.start = dict(start)
        self._own: dict[int, Any] = {}

    def __call__(self, worker_id: int, batch_size: int) -> Any:
        begin = self.start.pop(worker_id, None)
        fetch = self._own.get(worker_id) if self.stateful else self.fetch_fun
        if fetch is None:
            fetch = self._own[worker_id] = copy.deepcopy(self.fetch_fun)
        if begin is not None:
            calls, state = begin
            if self.stateful and state is not None:
                fetch.load_state_dict(state)  # type: ignore[attr-defined]
            else:
                for _ in range(calls):
                    try:
                        fetch(worker_id, batch_size)
                    except StopIteration:
                        raise
                    except Exception:  # skipped the first time too (on_error="skip")
                        pass
        try:
            raw = fetch(worker_id, batch_size)
        except StopIteration:
            if self.stateful:
                # where the next epoch resumes from: the state after the end
                raise StoppedWithState(fetch.state_dict()) from None  # type: ignore[attr-defined]
            raise
        if self.stateful:
            return Stamped(raw, fetch.state_dict())  # type: ignore[attr-defined]
        return raw
