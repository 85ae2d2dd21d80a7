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

A worker is pulled or handed over, never both.  The puller marks the
worker it reads (under its lock) and reads outside the lock: a message cut
short by a worker that stopped (a debugger, a frozen cgroup) must not hold
up a stop, which releases the puller, or the watcher, which hands a dead
worker over.  A hand-over asked for the worker being read is done by the
puller once that read ends (the stop's kill ends it at the latest), and
the group waits for it before joining the worker's thread.  The wait
itself is outside the lock too, on a snapshot of the members, with a
wake-up pipe that every change (a hand-over, a member added, the stream's
close) writes to, under the lock (the pipe is closed under it).
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Any, Protocol

__all__ = ["ENDED", "POLL_S", "Puller", "Pullable"]

#: the longest a pull waits before the enqueuer looks at its stream again
#: (a close of the stream wakes it at once; this bounds what nothing wakes)
POLL_S = 0.1


class _Ended:
    def __repr__(self) -> str:
        return "ENDED"


#: what :meth:`Pullable.receive_one` returns once the worker's messages ended
ENDED: Any = _Ended()
#: no hand-over was asked for the worker being read
_NOT_ASKED: Any = object()


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
        #: the member whose message is being read now (outside the lock)
        self._reading: Pullable | None = None
        #: its hand-over was asked for meanwhile: the pending to use once the
        #: read ends (None is a pending: the worker is done)
        self._deferred: Any = _NOT_ASKED
        #: the members' pipes, for :meth:`waiting` (a tuple: replaced, never changed)
        self._pipes: tuple[int, ...] = ()
        self._version = 0
        self._snapshot: tuple[int, Any, dict[int, Pullable]] = (-1, None, {})
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: every member was handed over for good (a stop): nothing more is pulled
        self.closed = False
        #: seconds the pulls waited for a worker's message (read by the
        #: "lagging behind" check: see starved_share)
        self.waited = 0.0
        self._since: tuple[float, float] | None = None

    def starved_share(self) -> float | None:
        """The share of the time since the last call that the pulls spent
        waiting for a worker's message (None at the first call, which
        starts the count: the workers' start-up is not a lag).  What the
        internal queue's depth says of a stream read from the workers'
        pipes only as it needs them: whether the workers are behind.
        Called by the pulling thread alone."""
        now, waited = time.perf_counter(), self.waited
        since, self._since = self._since, (now, waited)
        if since is None or now <= since[0]:
            return None
        return (waited - since[1]) / (now - since[0])

    def add(self, wk: Pullable) -> bool:
        """Pull ``wk`` from now on; False once closed (start its thread instead)."""
        with self._lock:
            if self.closed:
                return False
            self._members.append(wk)
            self._changed()
        return True

    def hand_over(self, wk: Pullable, pending: Any = True) -> None:
        """``wk``'s receiver thread takes over (see :meth:`Pullable.hand_over`);
        nothing if it was handed over already.  The worker being read is
        handed over by the puller once its read ends."""
        with self._lock:
            if wk not in self._members:
                return
            if wk is self._reading:
                self._deferred = pending
                return
            self._members.remove(wk)
            self._changed()
            wk.hand_over(pending)

    def close(self) -> None:
        """Hand every member over, for good (a stop, or the stream no longer
        pulled): idempotent; the worker being read, once its read ends.
        The wake-up pipe stays until :meth:`release`."""
        with self._lock:
            self.closed = True
            for wk in list(self._members):
                self.hand_over(wk)

    def release(self) -> None:
        """:meth:`close`, and the wake-up pipe closed (the stream's end)."""
        with self._lock:
            self.close()
            if self._wake_w >= 0:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def _changed(self) -> None:
        """The members changed (under the lock): a pull waiting now on the
        old ones wakes and takes the new ones."""
        self._version += 1
        self._pipes = tuple(wk.pipe_fd for wk in self._members)
        if self._wake_w >= 0:  # (written under the lock: release closes it under it)
            try:
                os.write(self._wake_w, b"w")
            except OSError:
                pass  # full: a wake-up is pending anyway

    def waiting(self) -> int:
        """Members with a message waiting in their pipe now (what the
        internal queue's depth counts of a stream received here: the
        results wait in the pipes, not in the lanes).  Never blocks."""
        pipes = self._pipes
        if not pipes:
            return 0
        poller = select.poll()  # (not select(): a descriptor past 1023 is out of its range)
        for fd in pipes:
            poller.register(fd, select.POLLIN)
        # a pipe closed meanwhile (its worker handed over and ended) reads POLLNVAL: not counted
        return sum(1 for _, events in poller.poll(0) if events & select.POLLIN)

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
            ready = poller.poll(0)
            if not ready and wait > 0:
                # nothing was ready: the stream waits for its workers (timed)
                t0 = time.perf_counter()
                ready = poller.poll(int(wait * 1000))
                self.waited += time.perf_counter() - t0
            if ready:
                self._take(ready, by_fd)
            return True
        finally:
            self._pulling.release()

    def _take(self, ready: list[tuple[int, int]], by_fd: dict[int, Pullable]) -> None:
        for fd, _ in ready:
            with self._lock:
                if fd == self._wake_r:
                    try:
                        os.read(fd, 4096)
                    except OSError:
                        pass
                    continue
                wk = by_fd.get(fd)
                if wk is None or wk not in self._members:
                    continue  # handed over since the snapshot
                if fd == wk.sentinel:
                    # its process ended: its thread reads what is left and says how
                    self.hand_over(wk)
                    continue
                self._reading = wk
            go: Any = True
            try:
                go = wk.receive_one()  # (outside the lock: see the module docstring)
            except Exception as exc:
                # its thread fails the source, as it would for a message it cannot take
                go = exc
            finally:
                with self._lock:
                    self._reading = None
                    deferred, self._deferred = self._deferred, _NOT_ASKED
                    if go is True and deferred is not _NOT_ASKED:
                        go = deferred
                    if go is not True or deferred is not _NOT_ASKED:
                        self.hand_over(wk, go)
