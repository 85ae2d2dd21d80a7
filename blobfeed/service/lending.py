"""What a connection lends its consumer of the memory its batches lie in.

On a Unix socket a batch that already lies in shared memory (a worker
process's slot, the source's arena: :data:`~blobfeed.reader.REGIONS`) is
not copied: the consumer is handed that memory once (an ``arena`` record
with its descriptor) and each such batch goes as a reference into it.
:class:`Lending` keeps what that takes, for one connection: the regions
handed over (at most :data:`~.slots.MAX_REGIONS`; past that a batch is
copied as any other), the batch each of the consumer's slots stands for
until the consumer says its views died (its arrays keep the region's slot
taken), the consumer's process (the region slots it leaves holding wait
for that process's end), and which regions went (the consumer is told to
let go of them).

Over TCP every batch's bytes travel on the stream: :class:`NoLending`
lends nothing.  The carrier picks one (:meth:`.Carrier.lending`); the
connection's sender asks it of every batch and never which carrier it has.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

from ..reader import REGIONS, SharedRegion
from .arena import consumer_pidfd
from .slots import MAX_REGIONS

__all__ = ["Lending", "Loan", "NoLending"]


class Loan(NamedTuple):
    """A batch that lies in a shared region, to be sent as a reference to it."""

    region: SharedRegion
    #: the batch's slot in the region
    slot: int
    #: its arrays' layout there, as the JSON text of a ``batches`` entry
    text: str
    #: a duplicate of the region's descriptor to hand over with it (its
    #: first batch for this consumer), else -1
    fd: int


class NoLending:
    """A carrier that shares no memory with the consumer: every batch is
    copied (into a slot, or onto the stream)."""

    def moved(self) -> bool:
        """Did regions go since :meth:`retire_gone` last looked?"""
        return False

    def retire_gone(self) -> None:
        """Tell the consumer to let go of the regions it was handed that went."""

    def loan(self, arrays: tuple[Any, ...]) -> Loan | None:
        """The region ``arrays`` lie in, if the consumer may be lent it; else
        None (the batch is copied)."""
        return None

    def lend(self, loan: Loan, g: int, slot: int, arrays: tuple[Any, ...]) -> str:
        """(Only for a :meth:`loan`.)"""
        raise AssertionError("nothing is lent over a carrier that shares no memory")

    def freed(self, slots: list[int]) -> None:
        """The consumer's views of what ``slots`` stand for died."""

    def leave(self, not_returned: set[int], park: Callable[[int, int, list[Any]], None] | None) -> None:
        """The consumer left (its run() never returned the items numbered in
        ``not_returned``)."""


class Lending(NoLending):
    """A Unix socket's connection: shared regions lent to its consumer.

    ``channel``: where the ``arena`` and ``retire`` records go (the sender's
    thread sends them, before the batches that need them); ``peer_pid``:
    the consumer's process, as the kernel says.  :meth:`freed` comes from
    the receiver's thread; a dict's single operations need no lock here.
    """

    def __init__(self, channel: Any, peer_pid: Callable[[], int]) -> None:
        self._channel = channel
        self._peer_pid_of = peer_pid
        #: per slot of the consumer's, the batch it stands for: (its number, its arrays)
        self._lent: dict[int, tuple[int, tuple[Any, ...]]] = {}
        #: the consumer's process, once it was handed a region
        self._peer_pid = 0
        self._pidfd = -1
        #: the regions the consumer was handed and not told to retire, by id
        self._sent: set[int] = set()
        #: REGIONS.version when they were last checked against it
        self._version = REGIONS.version

    def moved(self) -> bool:
        return REGIONS.version != self._version

    def retire_gone(self) -> None:
        """Batches of a region told to retire that the consumer still views
        keep their mapping until they die (the consumer's side)."""
        self._version = REGIONS.version  # before: a removal after it is seen next time
        live = REGIONS.live(list(self._sent))
        for gone in self._sent - live:
            self._sent.discard(gone)
            self._channel.send({"t": "retire", "id": gone})

    def loan(self, arrays: tuple[Any, ...]) -> Loan | None:
        located = REGIONS.locate(arrays)
        if located is None:
            return None
        region, r_slot, text = located
        if region.id in self._sent:
            return Loan(region, r_slot, text, -1)
        # as many regions as the consumer maps at once, past that copied
        fd = REGIONS.dup_fd(region) if len(self._sent) < MAX_REGIONS else None
        if fd is None:
            return None  # (or the region went meanwhile: copied as any batch)
        return Loan(region, r_slot, text, fd)

    def lend(self, loan: Loan, g: int, slot: int, arrays: tuple[Any, ...]) -> str:
        """Lend the loan's region for batch ``g`` in the consumer's ``slot``
        (handed over first if new; call it once the ledger recorded the
        batch: should the consumer be gone, the batch is unacknowledged,
        dealt again, not lost): the ``batches`` entry's arrays text.  The
        batch's arrays, kept until that slot is free, keep the region's slot taken."""
        self._lent[slot] = (g, arrays)
        if loan.fd >= 0:
            self._hand_over(loan.region, loan.fd)
        return f"{loan.text},{loan.slot},{loan.region.id}"  # the entry's region slot and region

    def _hand_over(self, region: SharedRegion, fd: int) -> None:
        """Hand the consumer a shared region (``fd``, a duplicate of its
        descriptor, closed here), and keep a handle on its process: slots it
        leaves holding stay taken until that process is gone (see
        :meth:`.SourceArena.park`)."""
        try:
            if not self._peer_pid:
                pid = self._peer_pid_of()
                self._peer_pid, self._pidfd = pid, consumer_pidfd(pid)
            self._channel.send({"t": "arena", "id": region.id, "offset": region.offset, "slots": region.slots,
                                "slot_bytes": region.slot_bytes}, fds=[fd])
            self._sent.add(region.id)
        finally:
            os.close(fd)

    def freed(self, slots: list[int]) -> None:
        lent = self._lent
        if lent:
            for slot in slots:
                lent.pop(slot, None)

    def leave(self, not_returned: set[int], park: Callable[[int, int, list[Any]], None] | None) -> None:
        """Batches its run() returned and it did not free yet: the user may
        still hold them (a net keeps its last batch), so their region slots
        wait for the consumer's process to end (``park(pid, pidfd, arrays)``,
        which takes the pidfd).  The others (sent, never returned) are dealt
        again with the region's bytes; their slots come back with the batch."""
        held = [arrays for g, arrays in self._lent.values() if g not in not_returned]
        self._lent = {}
        pidfd, self._pidfd = self._pidfd, -1
        if held and park is not None:
            park(self._peer_pid, pidfd, held)
        elif pidfd >= 0:
            os.close(pidfd)
