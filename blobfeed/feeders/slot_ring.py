"""The parent's side of one worker process's shared-memory slots
(:class:`SlotRing`): which slots batches view, when a chunk must be copied
out of its slot, and the pipe that gives free slots back to the child."""

from __future__ import annotations

import os
import queue
import threading
import weakref
from typing import Callable

import numpy as np

from .transport import SLOT_INDEX, WAKE

__all__ = ["SlotReturns", "SlotRing", "lendable"]


def lendable(slots: int) -> int:
    """How many of a worker's ``slots`` batches handed out may view at once
    (see :meth:`SlotRing.grant_view`): all but a quarter, and two stay
    unviewed (a batch straddling two chunks needs both)."""
    return slots - max(2, slots // 4)


class SlotRing:
    """The parent's side of one worker's slots: which ones batches view, and
    the pipe that gives free ones back to the child.

    It refers to nothing else on purpose: the finalizer of every chunk that
    views a slot holds it, and a finalizer keeps what it holds alive.  Were
    it the worker (and through it the coordinator, the net and the net's
    workspace, which keeps the last batch), the batch would keep itself
    alive forever, with its mapping, descriptors and net.
    """

    __slots__ = ("slots", "_lock", "_free_w", "_closed", "_viewed", "_held", "_tell_viewed")

    def __init__(self, slots: int, free_w: int, tell_viewed: Callable[[int], bool] | None = None) -> None:
        self.slots = slots
        self._free_w = free_w
        #: tells the child how many of its slots batches handed out view
        #: (the worker's shared header: see worker_batches); True when the
        #: child waits for that count to grow
        self._tell_viewed = tell_viewed
        self._lock = threading.Lock()
        self._closed = False
        #: slots some batch was handed out as a view of, until they are free again
        self._viewed: set[int] = set()
        #: slots the child announced and that are not free again yet
        self._held = 0

    def hold(self, small: bool) -> bool:
        """Count a slot the child just announced; ``small``: its chunk holds
        fewer samples than a batch.  Returns True when the chunk must be
        copied out at once and the slot given back:

        * it took the child's last free slot and is smaller than a batch: a
          batch may need more such chunks than there are slots, and would
          wait for the child while the child waits for a slot;
        * every other slot is viewed by batches (which the user may keep for
          ever: only with two slots, see :meth:`grant_view`): the rest of a
          chunk waiting in this one for the next chunk would hold the last
          circulating slot.
        """
        with self._lock:
            self._held += 1
            return (small and self._held >= self.slots) or len(self._viewed) >= self.slots - 1

    def grant_view(self, slot: int) -> bool:
        """May a batch be handed out as a view of ``slot``?  (The re-batcher
        asks, for a batch that lies inside one chunk.)

        A batch the user keeps holds its slot for as long as it lives, so at
        most ``slots - max(2, slots // 4)`` slots may be viewed by batches at
        once: the others keep circulating, and the worker never waits for a
        batch somebody keeps.  Past that bound a batch is copied out of its
        chunk instead.  Chunks that are merely queued or being re-batched do
        not count: blobfeed lets go of them by itself.

        With two slots (the minimum) one may be viewed, but only while the
        other is free: whatever arrives in it while the view lives is then
        copied out at once (:meth:`hold`), so it keeps circulating whatever
        the user keeps.
        """
        with self._lock:
            viewed = self._viewed
            if slot in viewed:
                return True
            if len(viewed) >= lendable(self.slots) and not (self.slots == 2 and not viewed and self._held == 1):
                return False
            viewed.add(slot)
            if self._tell_viewed is not None and self._tell_viewed(len(viewed)):
                self._send(WAKE)  # it waits for this: no slot comes back to wake it
            return True

    def release(self, slot: int) -> None:
        """Give ``slot`` back to the child: nothing views it any more (on the
        group's returner thread).  Never blocks."""
        with self._lock:
            viewed = self._viewed
            if slot in viewed:
                viewed.discard(slot)
                if self._tell_viewed is not None:
                    self._tell_viewed(len(viewed))
            self._held -= 1
            self._send(slot)

    def stop(self) -> None:
        """Tell the child to stop (it may be waiting for a free slot)."""
        with self._lock:
            self._send(-1)

    def _send(self, index: int) -> None:
        if self._closed:
            return
        try:
            os.write(self._free_w, SLOT_INDEX.pack(index))
        except OSError:
            pass  # the child is gone (or the pipe is full: it is not reading)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._free_w)
            # The ring outlives its worker (the finalizer of every chunk
            # that views a slot holds it); the header writer holds the
            # worker's area, whose mapping must go with the last view.
            self._tell_viewed = None


class SlotReturns:
    """The slots batches handed out view, given back to their workers as the
    batches die: :meth:`run` is the body of a worker group's returner thread."""

    def __init__(self) -> None:
        #: weak references to the chunks viewing slots, by id, with their
        #: slots; their callback puts them on `_returned`
        self._outstanding: dict[int, tuple[weakref.ref[np.ndarray], SlotRing, int]] = {}
        self._returned: queue.SimpleQueue[weakref.ref[np.ndarray] | None] = queue.SimpleQueue()

    def watch(self, root: np.ndarray, ring: SlotRing, slot: int) -> None:
        """Give ``slot`` back to its worker once ``root`` (which every view of
        the chunk in it keeps alive) dies."""
        # The last view dies wherever the user drops a batch: often the main
        # thread, where Ctrl-C raises KeyboardInterrupt at any Python
        # bytecode.  A Python finalizer would have it swallowed ("Exception
        # ignored") and the slot lost with it.  So the callback is C code
        # (SimpleQueue.put: no bytecode, nothing to interrupt), and the slot
        # goes back from the returner thread, where no signal lands.
        ref = weakref.ref(root, self._returned.put)
        self._outstanding[id(ref)] = (ref, ring, slot)

    def run(self) -> None:
        """Give back each slot as its chunk dies, until :meth:`end`."""
        get = self._returned.get
        outstanding = self._outstanding
        while True:
            ref = get()
            if ref is None:
                return
            entry = outstanding.pop(id(ref), None)
            if entry is not None:
                entry[1].release(entry[2])

    def end(self) -> None:
        """:meth:`run` returns (no worker needs a slot back any more)."""
        self._returned.put(None)

    def clear(self) -> None:
        """Forget the slots still viewed: batches the user keeps outlive the workers."""
        self._outstanding.clear()
