"""How a lane dealer's batches go out to the nets: batch *i* to net *i mod k*.

* :class:`Direct` -- every piece goes to its net's outbox as it is cut;
* :class:`EqualRounds` (``equal=True``, several nets) -- every net gets the
  same number of batches per epoch.  The batches go out in rounds, batches
  *r k* ... *r k + k - 1* for the *k* nets; the pieces of a round wait here
  until its last batch is complete, then go to the outboxes together.  At
  the end of an epoch (or of the data) a round that is not complete is
  dropped, counted (reason ``"equal"``) and logged, and its batch numbers
  are dealt again from the next epoch on: every epoch starts a round, at
  net 0.  No net ever sees a batch of a dropped round, so no net's position
  passes one, and a state never points into one.  With ``drop_last`` the
  epoch's last partial batch is dropped here (not by the nets' feeds)
  before the round is judged, so it cannot leave one net a batch short.

Either way a piece of a batch before its net's resumed position (a resume:
the net had it already) is thrown away and counted (reason ``"resume"``).
A part owns what it holds; the dealer calls it under its lock.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..chunks import Chunk
from .base import DropCounter

__all__ = ["Direct", "EqualRounds"]


class Direct:
    """Every batch goes out at once (one net, or no ``equal``)."""

    #: samples held back (none)
    held = 0

    def __init__(self) -> None:
        self.source = ""
        #: the nets' outboxes (the dealer's list)
        self.boxes: Sequence[Any] = ()
        self._on_dropped: DropCounter | None = None

    def wire(self, source: str, boxes: Sequence[Any], on_dropped: DropCounter | None) -> Direct:
        """The part that deals to ``boxes`` (at the dealer's start, once its
        nets are known; before, every part deals directly)."""
        self.source = source
        self.boxes = boxes
        self._on_dropped = on_dropped
        return self

    def deal(self, batch: int, piece: Chunk) -> None:
        """A piece of batch number ``batch``."""
        boxes = self.boxes
        box = boxes[batch % len(boxes)]
        if batch < box.skip_until:
            self._resumed(piece.n)  # before this net's resumed position: it had it already
            return
        box.pieces.append(piece)
        box.samples += piece.n

    def _resumed(self, n: int) -> None:
        """Samples a resume fetched again and throws away: counted at once,
        under the dealer's lock, so no scrape sees them neither held nor
        dropped (the hub's lock is taken after the dealer's, never before)."""
        if self._on_dropped is not None:
            self._on_dropped("resume", n)

    def batch_done(self, batches: int) -> None:
        """Batch ``batches - 1`` is complete (and not the epoch's last partial one)."""

    def settle(self, batches: int, partial: bool, epoch: int, notes: list[tuple[Any, ...]]) -> int | None:
        """The end of an epoch (or of the data): see :meth:`EqualRounds.settle`.
        None: there are no rounds (nothing changes)."""
        return None

    def clear(self) -> int:
        """The stream stops: what is held back is dropped; returns its samples."""
        return 0


class EqualRounds(Direct):
    """Equal shares: batches go out in whole rounds (see the module docstring).

    Args:
        drop_last: the epoch's last partial batch is dropped before its
            round is judged (``on_dropped("drop_last", n)``).
    """

    def __init__(self, drop_last: bool = False) -> None:
        super().__init__()
        self.drop_last = drop_last
        #: the nets per round
        self.k = 0
        #: the pieces of the round being filled, (batch, outbox, piece), and their samples
        self.pieces: list[tuple[int, Any, Chunk]] = []
        self.held = 0

    def wire(self, source: str, boxes: Sequence[Any], on_dropped: DropCounter | None) -> Direct:
        if len(boxes) < 2:
            # one net gets every round whole: nothing to hold back
            return Direct().wire(source, boxes, on_dropped)
        super().wire(source, boxes, on_dropped)
        self.k = len(boxes)
        return self

    def deal(self, batch: int, piece: Chunk) -> None:
        boxes = self.boxes
        box = boxes[batch % len(boxes)]
        if batch < box.skip_until:
            self._resumed(piece.n)
            return
        # it waits for the rest of its round.  A piece in a worker's shared
        # memory is copied out: the round may need more of that worker's
        # chunks than it has slots, and would wait for them forever
        if piece.pin is not None:
            piece = Chunk(tuple(np.array(a) for a in piece.arrays), piece.n, piece.worker_id, piece.seq,
                          None, piece.state)
        self.pieces.append((batch, box, piece))
        self.held += piece.n

    def batch_done(self, batches: int) -> None:
        if not batches % self.k:
            self._release()

    def _release(self) -> None:
        """The round being filled is complete: its pieces go to their nets."""
        for _, box, piece in self.pieces:
            box.pieces.append(piece)
            box.samples += piece.n
        self.pieces.clear()
        self.held = 0

    def settle(self, batches: int, partial: bool, epoch: int, notes: list[tuple[Any, ...]]) -> int | None:
        """The end of epoch ``epoch`` (or of the data), with ``batches``
        batches dealt, the last of them partial if ``partial``: a complete
        last round goes out; an incomplete one is dropped and counted, and
        its batch numbers are dealt again from the next epoch on, so every
        epoch starts a round at net 0.  Returns the batches dealt then (the
        positions past them were never reached by any net); log lines go
        to ``notes`` (written once the dealer's lock is released)."""
        k = self.k
        if partial and self.drop_last:
            # dropped here rather than by one net's feed, which would leave
            # that net a batch short of the others
            last = batches - 1
            n = 0
            while self.pieces and self.pieces[-1][0] == last:
                n += self.pieces.pop()[2].n
            self.held -= n
            batches = last
            if n:
                if self._on_dropped is not None:
                    self._on_dropped("drop_last", n)
                notes.append((
                    "source %r: dropped the last partial batch of epoch %d, %d samples (drop_last=True)",
                    self.source, epoch, n,
                ))
        if batches % k:
            start = batches - batches % k
            n = self.clear()
            if n and self._on_dropped is not None:
                self._on_dropped("equal", n)
            notes.append((
                "source %r: dropped the incomplete last round of epoch %d: %d batches (%d samples) for "
                "%d of its %d nets (equal=True: every net gets the same number of batches per epoch)",
                self.source, epoch, batches - start, n, batches - start, k,
            ))
            return start
        self._release()
        return batches

    def clear(self) -> int:
        n = self.held
        self.pieces.clear()
        self.held = 0
        return n
