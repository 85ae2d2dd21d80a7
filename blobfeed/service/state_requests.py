"""A consumer's ``state`` requests and the service's ``state_is`` answers.

Each request carries its number (1, 2, ...) and its answer names it, so
that a request interrupted before it went (a Ctrl-C) leaves a gap rather
than every later answer one call behind, and each call waiting (several
threads may ask at once) gets the answer to its own request.  The service
answers in order: an answer naming a request not asked, or one at or
before the last answered, is a lie of the service's and refused (it could
make ``state_dict()`` return it, and a flood of them would pile up).  Once
the service is gone, every call waiting and every later one gets why.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from .wire import WireError

__all__ = ["StateRequests"]

#: where one call's answer comes: the ``state_is`` record, or the service's end
Box = queue.SimpleQueue


class StateRequests:
    """The requests of one attachment (``service``: who answers, for messages)."""

    def __init__(self, service: str) -> None:
        #: who answers, for messages
        self.service = service
        self._lock = threading.Lock()
        #: the calls waiting, by number: a late answer to a call that gave up is dropped
        self._waiting: dict[int, Box[dict[str, Any]]] = {}
        #: the answer every call gets once the service is gone
        self._gone: dict[str, Any] | None = None
        #: the last request numbered, and the last one answered
        self._asked = 0
        self._heard = 0

    def ask(self, box: Box[dict[str, Any]]) -> int:
        """Number the next request (under the send lock: requests go out in
        the order of their numbers), whose answer goes to ``box``."""
        with self._lock:
            self._asked += 1
            number = self._asked
            self._waiting[number] = box
            if self._gone is not None:
                box.put(self._gone)
        return number

    def forget(self, box: Box[dict[str, Any]]) -> None:
        """The call whose answer goes to ``box`` waits no more (by its box:
        a call interrupted as :meth:`ask` returned never learnt its number).
        Without the lock: a signal handler's call landing here would wait
        for ever on a lock its own thread holds (and :meth:`gone` reads a
        copy of the table)."""
        for number, waiting in list(self._waiting.items()):
            if waiting is box:
                self._waiting.pop(number, None)

    def answered(self, record: dict[str, Any]) -> None:
        """(The receiver's thread.)  A ``state_is`` record, checked (its
        ``id`` an int), to the call that asked it.

        Raises:
            WireError: it answers no request asked, or is out of order.
        """
        number = record["id"]
        with self._lock:
            if number > self._asked:
                raise WireError(f"{self.service} sent a 'state_is' record nobody asked for (request {number}; "
                                f"{self._asked} asked)")
            if number <= self._heard:
                raise WireError(f"{self.service} sent a 'state_is' record out of order (request {number}; requests "
                                f"up to {self._heard} were answered, the service answers in order)")
            self._heard = number
            box = self._waiting.get(number)  # (none: a call that gave up waiting)
        if box is not None:
            box.put(record)

    def gone(self, why: str) -> None:
        """(The receiver's end.)  No answer comes from now on: ``why``."""
        with self._lock:
            self._gone = {"t": "state_is", "state": None, "error": why}
            for box in list(self._waiting.values()):  # (forget() takes no lock)
                box.put(self._gone)

    def is_gone(self, reply: dict[str, Any]) -> bool:
        """Is ``reply`` the service's end rather than its answer?"""
        return reply is self._gone
