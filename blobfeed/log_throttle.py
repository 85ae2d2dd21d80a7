"""A log line for events a stranger can cause as often as it likes.

A refused connection is worth a warning; ten thousand of them are not ten
thousand lines.  :class:`LogThrottle` logs the first few events of each
window one by one, counts the others, and tells that count in one line
(with the last of them) once the window is over: at the next event, at
:meth:`~LogThrottle.flush_due` (the owner's periodic thread calls it: the
next event may never come), or at :meth:`~LogThrottle.flush` (its stop).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

__all__ = ["LogThrottle"]


class LogThrottle:
    """The first ``per_window`` events of each ``window_s`` seconds logged
    as warnings one by one; the rest counted, and told in one warning made
    of ``held`` (``%d``: how many; ``%s``: the last of them).  Thread-safe;
    never logs under its lock (a slow handler would hold up every caller).
    """

    def __init__(self, logger: logging.Logger, per_window: int, window_s: float, held: str) -> None:
        self._logger = logger
        self.per_window = per_window
        self.window_s = window_s
        self._held_text = held
        self._lock = threading.Lock()
        self._window = -window_s
        self._logged = 0
        self._held = 0
        self._last = ""

    def event(self, msg: str, *args: Any) -> None:
        """One event: ``msg % args`` logged, or counted (its text kept as the
        last) past the window's share."""
        now = time.monotonic()
        with self._lock:
            held, last = 0, ""
            if now - self._window >= self.window_s:  # a new window: tell what the last one held back
                held, last = self._take_held()
                self._window, self._logged = now, 0
            log_it = self._logged < self.per_window
            if log_it:
                self._logged += 1
            else:
                self._held += 1
                self._last = msg % args
        if held:
            self._logger.warning(self._held_text, held, last)
        if log_it:
            self._logger.warning(msg, *args)

    def flush_due(self) -> None:
        """Tell what a window held back once that window is over."""
        now = time.monotonic()
        with self._lock:
            if not self._held or now - self._window < self.window_s:
                return
            held, last = self._take_held()
        self._logger.warning(self._held_text, held, last)

    def flush(self) -> None:
        """Tell what is held back now, whatever the window (the owner stops)."""
        with self._lock:
            held, last = self._take_held()
        if held:
            self._logger.warning(self._held_text, held, last)

    def _take_held(self) -> tuple[int, str]:
        held, last = self._held, self._last
        self._held, self._last = 0, ""
        return held, last
