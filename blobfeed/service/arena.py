"""Where a served source assembles its big batches: memory every consumer maps.

A batch that spans chunks is copied once, by the re-batcher, into a buffer
of its pool (:class:`~blobfeed.feeders.rebatch.BufferPool`).  For a served
source that buffer is a slot of this arena: one sealed ``memfd`` per source
(:func:`.slots.sealed_memfd`), whose descriptor each consumer on the Unix
socket receives once (an ``arena`` record, before the first batch that lies
in it) and maps read-only.  Such a batch then goes out as a reference
(arena slot, offsets) and the consumer's views read the very bytes the
re-batcher wrote: one copy in all, where writing it into the consumer's own
slots made two.  Batches that are views of one chunk, small ones, and any
batch when the arena is full still go through the consumer's slots.

A slot is free again when nothing in the service refers to its batch any
more (a weak reference to the slot's root array says so, as in the pool).
Each connection refers to the batches it lent until its consumer says
their views died (the ``ack`` that frees its slot).  A consumer that left
while still holding some may be alive (detached, the user keeping a batch):
those slots stay out of circulation until its process has exited (a
``pidfd`` says so), so no batch changes under a view a user kept.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import weakref
from typing import Any, Callable

import numpy as np

from ..queues import drained
from ..reader import REGIONS, SharedRegion
from .slots import sealed_memfd

__all__ = ["SourceArena", "consumer_pidfd"]



logger = logging.getLogger("blobfeed.service")

#: slots start on page boundaries
_PAGE = 4096
#: at most this many slots, and this many bytes of address space, per source
MAX_SLOTS = 512
MAX_BYTES = 1 << 36


class SourceArena:
    """The batch memory of one served source.  Thread-safe.

    Made on the first :meth:`take`: its slots are as large as that request
    (a whole batch of the source's layout), and ``slots_for(slot_bytes)``
    says how many.
    """

    def __init__(self, name: str, slots_for: Callable[[int], int]) -> None:
        self.name = name
        self._slots_for = slots_for
        self._lock = threading.Lock()
        self.fd = -1
        self.slots = 0
        self.slot_bytes = 0
        self._mm: Any = None
        self._free: list[int] = []
        #: weak references to slots' roots that died (put by their callbacks: C code)
        self._returned: "queue.SimpleQueue[weakref.ref[np.ndarray]]" = queue.SimpleQueue()
        #: id(weakref) -> (weakref, slot)
        self._out: dict[int, tuple["weakref.ref[np.ndarray]", int]] = {}
        #: per consumer process that left viewing batches: [its pidfd, those
        #: batches], kept until it exits (one pidfd per process, however
        #: often it attached)
        self._parked: dict[int, list[Any]] = {}
        #: the arena as a shared region, once made
        self.region: SharedRegion | None = None
        self._closed = False
        self._failed = False

    # -- the re-batcher's side -----------------------------------------------------------
    def take(self, nbytes: int) -> np.ndarray | None:
        """A free slot of at least ``nbytes``, as a uint8 array that frees the
        slot when it (and every view of it) dies; None when the arena is
        full, closed, or its slots are too small (the caller uses memory of
        its own)."""
        with self._lock:
            if self._closed or self._failed:
                return None
            if self._mm is None and not self._create(nbytes):
                return None
            if nbytes > self.slot_bytes:
                return None
            if self._parked:
                self._reap()  # (rare: a consumer left holding batches)
            self._collect()
            if not self._free:
                return None
            slot = self._free.pop()  # the warmest: freed last
            # over the mapping itself: numpy stops at a base that is not an
            # array, so every view of a batch keeps `root` alive
            root = np.frombuffer(self._mm, np.uint8, count=self.slot_bytes, offset=slot * self.slot_bytes)
            ref = weakref.ref(root, self._returned.put)
            self._out[id(ref)] = (ref, slot)
            return root

    def _create(self, nbytes: int) -> bool:
        slot_bytes = -(-nbytes // _PAGE) * _PAGE
        slots = max(1, min(MAX_SLOTS, self._slots_for(slot_bytes), MAX_BYTES // slot_bytes))
        try:
            self.fd, self._mm = sealed_memfd(f"blobfeed-{self.name}-batches", slots * slot_bytes)
        except OSError as err:
            # no shared memory to be had: batches go through each consumer's slots
            logger.warning("source %r: no shared batch memory (%s); batches are copied for each consumer",
                           self.name, err)
            self._failed = True
            return False
        self.slots, self.slot_bytes = slots, slot_bytes
        self._free = list(range(slots - 1, -1, -1))
        base = np.frombuffer(self._mm, np.uint8, count=1).__array_interface__["data"][0]
        # where senders find its batches (REGIONS.locate)
        self.region = SharedRegion(f"blobfeed-{self.name}-batches", self.fd, base, 0, slots, slot_bytes)
        REGIONS.add(self.region)
        return True

    def _collect(self) -> None:
        for ref in drained(self._returned):
            entry = self._out.pop(id(ref), None)
            if entry is not None:
                self._free.append(entry[1])

    def park(self, pid: int, pidfd: int, lent: list[Any]) -> None:
        """A consumer left while it may still view ``lent`` (batches of this
        arena its ``run()`` returned): they stay taken until its process
        ``pid`` (``pidfd``; -1: none could be had: until the arena closes;
        -2: it exited already) has exited.  Owns ``pidfd`` from here."""
        with self._lock:
            if self._closed or pidfd == -2:
                if pidfd >= 0:
                    os.close(pidfd)
                return
            parked = self._parked.get(pid)
            if parked is None:
                self._parked[pid] = [pidfd, lent]
                return
            if pidfd >= 0:
                if parked[0] < 0:
                    parked[0] = pidfd
                else:
                    os.close(pidfd)  # the process's first one serves
            parked[1].extend(lent)

    def parked(self) -> int:
        """Batches kept for consumers that left and whose process may live."""
        with self._lock:
            return sum(len(lent) for _, lent in self._parked.values())

    def reap(self) -> None:
        """Let go of what consumers that exited since had kept (the service's
        monitor calls this often: batches of worker slots never come through
        :meth:`take`, which reaps too)."""
        with self._lock:
            if self._parked:
                self._reap()

    def _reap(self) -> None:
        """Let go of what consumers that exited since had kept (under the lock)."""
        poller = select.poll()  # not select(): descriptors may pass 1023
        for pidfd, _ in self._parked.values():
            if pidfd >= 0:
                poller.register(pidfd, select.POLLIN)
        gone = {fd for fd, _ in poller.poll(0)}
        for pid, (pidfd, _) in list(self._parked.items()):
            if pidfd in gone:
                os.close(pidfd)  # it exited: its mappings went with it
                del self._parked[pid]

    def close(self) -> None:
        """No more slots are handed out; the memory goes with the last batch that views it."""
        with self._lock:
            self._closed = True
            parked, self._parked = self._parked, {}
            fd, self.fd = self.fd, -1
        for pidfd, _ in parked.values():
            if pidfd >= 0:
                os.close(pidfd)
        if self.region is not None:
            REGIONS.remove(self.region)  # before its descriptor closes
        if fd >= 0:
            os.close(fd)
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # Batches still view it.  Each view keeps the mmap object alive
                # (their root's base), so without our reference it is unmapped,
                # and its own descriptor closed, when the last one dies.
                pass


def consumer_pidfd(pid: int) -> int:
    """A ``pidfd`` of the consumer process ``pid`` (from the socket's peer
    credentials); -2 when it has exited already, -1 when none can be had
    (it then counts as alive)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -2  # exited already
    except (OSError, AttributeError):
        return -1
