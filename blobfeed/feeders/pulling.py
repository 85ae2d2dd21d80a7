"""Receiving in the reader's thread: worker processes whose messages are read
by the thread that waits for them, not by a receiver thread each.

A random-access source on worker processes read by one net with prefetch
(the default) hands every batch across four threads of the parent: the
worker's receiver, the net's enqueuer, the net's thread and the slot
returner.  Each hand-off is a wake-up and a turn on the interpreter lock;
on W7 (a global shuffle of big records on two worker processes) the
parent's threads spent about 165 µs of CPU a batch, the work handed over by
a plain single-threaded loop 20.  A :class:`Puller` takes the receivers'
place while the stream runs: the net's enqueuer, when the dealer has
nothing for it, waits on every worker's pipe at once and hands over what
arrives itself.  Only the enqueuer pulls (a blobfeed thread: no Ctrl-C lands
in the middle of a message), and only while nothing unusual happens: a
worker that ends, dies, is retired or is told to stop is *handed over* to
its own receiver thread, started then, which reads what is left and
reports the end exactly as it always did.  So every ending keeps one path.

A worker is pulled or handed over, never both: messages are read under the
puller's lock, and a hand-over takes it.  The wait itself is outside the
lock, on a snapshot of the members, with a wake-up pipe that every change
(a hand-over, a member added, the stream's close) writes to.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from typing import Any, Protocol

__all__ = ["ENDED", "POLL_S", "Puller", "Pullable"]

logger = logging.getLogger("blobfeed.feeders")

#: the longest a pull waits before the enqueuer looks at its stream again
#: (a close of the stream wakes it at once; this bounds what nothing wakes)
POLL_S = 0.1


class _Ended:
    def __repr__(self) -> str:
        return "ENDED"


#: what :meth:`Pullable.receive_one` returns once the worker's messages ended
ENDED: Any = _Ended()


class Pullable(Protocol):
    """A worker process as the puller sees it (``processes._Worker``)."""

    #: its pipe's descriptor (readable: a message), and its process's sentinel (readable: it ended)
    pipe_fd: int
    sentinel: int

    def receive_one(self) -> Any:
        """Read one message and hand it over: True to go on, False (the
        source stopped: drain), None (the worker is done), :data:`ENDED`
        (no message will come any more).  May raise: the message could not
        be taken."""

    def hand_over(self, pending: Any) -> None:
        """Start the worker's receiver thread, which acts on ``pending``
        (what :meth:`receive_one` last returned, True for nothing) first."""


class Puller:
    """The worker processes of one group whose messages the reader's thread
    reads (see the module docstring).  Thread-safe."""

    def __init__(self, source: str) -> None:
        self.source = source
        #: held while messages are read, and to add or hand over a member
        self._lock = threading.RLock()
        #: one thread pulls at a time; another waits on the dealer instead
        self._pulling = threading.Lock()
        self._members: list[Pullable] = []
        self._version = 0
        self._snapshot: tuple[int, Any, dict[int, Pullable]] = (-1, None, {})
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: every member was handed over for good (a stop): nothing more is pulled
        self.closed = False

    @property
    def members(self) -> int:
        """Workers pulled now."""
        return len(self._members)

    def add(self, wk: Pullable) -> bool:
        """Pull ``wk`` from now on; False once closed (start its thread instead)."""
        with self._lock:
            if self.closed:
                return False
            self._members.append(wk)
            self._version += 1
        self.wake()
        return True

    def hand_over(self, wk: Pullable, pending: Any = True) -> None:
        """``wk``'s receiver thread takes over (see :meth:`Pullable.hand_over`);
        nothing if it was handed over already."""
        with self._lock:
            if wk not in self._members:
                return
            self._members.remove(wk)
            self._version += 1
            wk.hand_over(pending)
        self.wake()

    def close(self) -> None:
        """Hand every member over, for good (a stop, or the stream no longer
        pulled): idempotent.  The wake-up pipe stays until :meth:`release`."""
        with self._lock:
            self.closed = True
            members, self._members = self._members, []
            self._version += 1
            for wk in members:
                wk.hand_over(True)
        self.wake()

    def release(self) -> None:
        """Close the wake-up pipe (the group's end, after every thread ended)."""
        with self._lock:
            self.close()
            if self._wake_w >= 0:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def wake(self) -> None:
        """Wake a pull waiting now (never blocks)."""
        fd = self._wake_w
        if fd < 0:
            return
        try:
            os.write(fd, b"w")
        except (BlockingIOError, OSError):
            pass  # full (a wake-up is pending anyway) or closed meanwhile

    def pull(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` s (None: :data:`POLL_S`) for messages of
        the members and hand over what arrived.  False: nothing to pull
        (every member was handed over), or another thread pulls now: the
        caller waits on the dealer instead."""
        if not self._pulling.acquire(blocking=False):
            return False
        try:
            with self._lock:
                if not self._members or self._wake_r < 0:
                    return False
                version, poller, by_fd = self._snapshot
                if version != self._version:
                    poller = select.poll()
                    poller.register(self._wake_r, select.POLLIN)
                    by_fd = {}
                    for wk in self._members:
                        for fd in (wk.pipe_fd, wk.sentinel):
                            poller.register(fd, select.POLLIN)
                            by_fd[fd] = wk
                    self._snapshot = (self._version, poller, by_fd)
            wait = POLL_S if timeout is None else max(0.0, min(timeout, POLL_S))
            ready = poller.poll(int(wait * 1000))
            if ready:
                self._take(ready, by_fd)
            return True
        finally:
            self._pulling.release()

    def _take(self, ready: list[tuple[int, int]], by_fd: dict[int, Pullable]) -> None:
        with self._lock:
            for fd, _ in ready:
                if fd == self._wake_r:
                    try:
                        os.read(fd, 4096)
                    except (BlockingIOError, OSError):
                        pass
                    continue
                wk = by_fd.get(fd)
                if wk is None or wk not in self._members:
                    continue  # handed over since the snapshot
                if fd == wk.sentinel:
                    # its process ended: its thread reads what is left and says how
                    self.hand_over(wk)
                    continue
                try:
                    go = wk.receive_one()
                except Exception as exc:
                    # its thread fails the source, as it would for a message it cannot take
                    self.hand_over(wk, exc)
                    continue
                if go is not True:
                    self.hand_over(wk, go)
