"""The bundles of one Ray actor held as views of Ray's object store, counted
(see :mod:`.ray_backend`: at most ``max_pinned`` per worker)."""

from __future__ import annotations

import queue
import threading
import weakref

import numpy as np

__all__ = ["_PinTracker"]


class _PinTracker:
    """Bundles of one worker held as views of Ray's object store.

    A bundle counts from its arrival until its root array (every chunk and
    batch viewing it keeps the root alive) dies.  The death is heard through
    a weak reference whose callback is C code (``SimpleQueue.put``: no
    Python runs in whatever thread drops the last batch) and counted lazily.
    """

    __slots__ = ("limit", "_lock", "_live", "_viewed", "_dead")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._live: dict[int, weakref.ref[np.ndarray]] = {}
        self._viewed: set[int] = set()
        self._dead: queue.SimpleQueue[weakref.ref[np.ndarray]] = queue.SimpleQueue()

    def _reap(self) -> None:
        while True:
            try:
                ref = self._dead.get_nowait()
            except queue.Empty:
                return
            key = id(ref)
            self._live.pop(key, None)
            self._viewed.discard(key)

    def hold(self, root: np.ndarray) -> int | None:
        """Count ``root`` in; None when ``limit`` bundles are held already
        (then its chunks must be copied out)."""
        with self._lock:
            self._reap()
            if len(self._live) >= self.limit:
                return None
            ref = weakref.ref(root, self._dead.put)
            key = id(ref)
            self._live[key] = ref
            return key

    def grant_view(self, key: int) -> bool:
        """May a batch be a view of bundle ``key``?  At most ``limit - 2`` at once."""
        with self._lock:
            self._reap()
            if key in self._viewed:
                return True
            if len(self._viewed) >= max(1, self.limit - 2):
                return False
            self._viewed.add(key)
            return True

    def held(self) -> int:
        with self._lock:
            self._reap()
            return len(self._live)
