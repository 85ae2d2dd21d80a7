"""Shared memory another process may map: where a batch already lies.

A batch a process worker wrote lies in that worker's slots, a ``memfd`` the
parent maps; a batch the feeding service's re-batcher assembled lies in the
source's arena, another ``memfd``.  Each such mapping registers here as a
:class:`SharedRegion` while it may hold batches.  A consumer in another
process that was handed a region's descriptor once (and maps it read-only)
can then be sent a batch as a reference, ``(region, slot, offsets)``,
rather than its bytes: :meth:`RegionIndex.locate` says whether and where a
batch lies in one.

A region is cut into ``slots`` slots of ``slot_bytes`` after a header of
``offset`` bytes; a batch is located only when all its arrays lie in one
slot (contiguous).  Removing a region (its worker replaced, the source
closed) bumps :attr:`RegionIndex.version`, so whoever handed it out can
tell its peers to let go of it (:meth:`RegionIndex.live`).

The index does not keep batches alive, nor say when a slot is free again:
the slot's owner does that (a batch viewing a slot keeps it taken).  Its
descriptor is the region's own: :meth:`RegionIndex.dup_fd` hands out a
duplicate under the index's lock, so a region removed meanwhile never
lends a descriptor number that was closed (and maybe reused).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import threading
from typing import Sequence

import numpy as np

__all__ = ["REGIONS", "RegionIndex", "SharedRegion"]

_IDS = itertools.count(1)


class SharedRegion:
    """One mapping of a ``memfd`` that another process may map: ``fd``
    (owned by the region's owner, who removes it from the index before
    closing it), the mapping's address ``base``, and its layout."""

    __slots__ = ("id", "name", "fd", "base", "offset", "slots", "slot_bytes", "size")

    def __init__(self, name: str, fd: int, base: int, offset: int, slots: int, slot_bytes: int) -> None:
        #: unique in this process (never reused)
        self.id = next(_IDS)
        self.name = name
        self.fd = fd
        self.base = base
        self.offset = offset
        self.slots = slots
        self.slot_bytes = slot_bytes
        #: bytes to map: header and slots
        self.size = offset + slots * slot_bytes

    def __repr__(self) -> str:
        return f"SharedRegion({self.name!r}, id={self.id}, {self.slots} x {self.slot_bytes} after {self.offset})"


class RegionIndex:
    """The regions of this process, by address.  Thread-safe; ``locate`` is
    the hot path (one per batch sent) and takes no lock: it reads a tuple
    replaced whole on every change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (sorted start addresses of the slots, their regions): replaced, never changed
        self._table: tuple[list[int], list[SharedRegion]] = ([], [])
        self._live: dict[int, SharedRegion] = {}
        #: bumped on every removal
        self.version = 0
        #: (dtype, shape, offset) of each array -> the layout's JSON text
        self._layouts: dict[tuple[object, ...], str] = {}

    def add(self, region: SharedRegion) -> None:
        with self._lock:
            self._live[region.id] = region
            self._rebuild()

    def remove(self, region: SharedRegion) -> None:
        """Forget ``region`` (idempotent); its owner may close its descriptor after."""
        with self._lock:
            if self._live.pop(region.id, None) is not None:
                self.version += 1
                self._rebuild()

    def _rebuild(self) -> None:
        regions = sorted(self._live.values(), key=lambda r: r.base)
        self._table = ([r.base + r.offset for r in regions], regions)

    def live(self, ids: Sequence[int]) -> set[int]:
        """Which of ``ids`` are still registered."""
        with self._lock:
            return {i for i in ids if i in self._live}

    def dup_fd(self, region: SharedRegion) -> int | None:
        """A duplicate of ``region``'s descriptor (the caller closes it), or
        None once the region was removed."""
        with self._lock:
            if region.id not in self._live:
                return None
            return os.dup(region.fd)

    def locate(self, arrays: Sequence[np.ndarray]) -> tuple[SharedRegion, int, str] | None:
        """Where ``arrays`` lie when they are one batch in one slot of a
        registered region: (the region, the slot, their ``[dtype, shape,
        offset]`` list as JSON, offsets from the slot's start); else None."""
        starts, regions = self._table
        if not starts or not arrays:
            return None
        region: SharedRegion | None = None
        slot = -1
        key = []
        for a in arrays:
            if not a.flags.c_contiguous:
                return None
            addr = a.__array_interface__["data"][0]
            if region is None:
                i = bisect.bisect_right(starts, addr) - 1
                if i < 0:
                    return None
                region = regions[i]
            rel = addr - region.base - region.offset
            size = region.slot_bytes
            if not 0 <= rel < region.slots * size:
                return None
            s, off = divmod(rel, size)
            if slot < 0:
                slot = s
            if s != slot or off + a.nbytes > size:
                return None
            key.append((a.dtype.str, a.shape, off))
        assert region is not None
        k = tuple(key)
        text = self._layouts.get(k)
        if text is None:
            if len(self._layouts) >= 64:
                self._layouts.clear()
            text = self._layouts[k] = json.dumps([[d, list(s), o] for d, s, o in key], separators=(",", ":"))
        return region, slot, text


#: the process's regions
REGIONS = RegionIndex()
