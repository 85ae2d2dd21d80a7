"""A lane dealer's positions: where the stream is after each batch, kept
until every net has returned past it (what ``state_dict`` saves).

A position is ``(batches, epoch, rr, offset, calls, states)``: the batches
dealt, the epoch, whose turn it is, the samples of that lane's head chunk
already dealt, and per worker the calls whose chunk is wholly dealt and its
stateful fetcher's state after the last of them.  It is recorded as an
immutable tuple per batch (the dict is made only when a state is asked for)
and an entry is never removed at or above the lowest net's next batch, so a
state can be read without the dealer's lock (from a signal handler that
interrupted a thread holding it).

* :class:`Positions` keeps one per batch (a plain stream);
* :class:`StartPositions` keeps only the start: a shuffled stream's buffer
  is not a position in the workers' streams, so it resumes by running again
  from its start and dropping the batches each net had (replayed, never
  copied twice).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["READABLE_VERSIONS", "STATE_VERSION", "Position", "Positions", "StartPositions", "as_dict"]

#: the layout version of ``state_dict``; a state of another version is refused
#: (version 1, before epochs, is read as a state in epoch 0)
STATE_VERSION = 2
READABLE_VERSIONS = (1, 2)

#: (batches, epoch, rr, offset, calls, states)
Position = tuple[int, int, int, int, tuple[int, ...], tuple[Any, ...]]


def start_position(lanes: int) -> Position:
    return (0, 0, 0, 0, (0,) * lanes, (None,) * lanes)


def as_dict(pos: Position) -> dict[str, Any]:
    """A position as ``state_dict`` saves it."""
    batches, epoch, rr, offset, calls, states = pos
    return {"batches": batches, "epoch": epoch, "rr": rr, "offset": offset,
            "calls": list(calls), "states": list(states)}


class Positions:
    """The position after every batch (see the module docstring).

    Args:
        now: the stream's position now, ``batches`` dealt (under the
            dealer's lock).
        boxes: the nets' outboxes (the dealer's list; ``next_batch``: each
            net's next batch that ``run()`` has not returned).
    """

    def __init__(self, now: Callable[[int], Position], boxes: Sequence[Any]) -> None:
        self._now = now
        self._boxes = boxes
        #: batches completed -> the position after them
        self.kept: dict[int, Position] = {0: start_position(0)}
        #: no position below this batch number is kept
        self.kept_from = 0

    def reset(self, lanes: int) -> None:
        """The lanes changed before the stream started: only the start."""
        self.kept = {0: start_position(lanes)}

    def record(self, batches: int) -> None:
        """The position after ``batches`` batches (under the dealer's lock);
        the positions every net has returned past are dropped."""
        kept = self.kept
        boxes = self._boxes
        low = boxes[0].next_batch if len(boxes) == 1 else min([b.next_batch for b in boxes], default=0)
        while self.kept_from < low:
            kept.pop(self.kept_from, None)
            self.kept_from += 1
        kept[batches] = self._now(batches)

    def forget(self, after: int, upto: int) -> None:
        """Batches ``after + 1 .. upto`` were never reached by any net (an
        equal share's dropped round): their positions go, so a state cannot
        find one."""
        for b in range(after + 1, upto + 1):
            self.kept.pop(b, None)

    def restart(self, batches: int, lanes: int) -> None:
        """A load: the stream goes on after ``batches`` batches; the
        dealer records the position there next."""
        self.kept = {}
        self.kept_from = batches

    def key(self, low: int) -> int:
        """The batch whose position is saved when the lowest net's next batch is ``low``."""
        return low

    def find(self, nets: Sequence[str], source: str) -> tuple[Position, list[list[Any]]]:
        """The position after the last batch each net returned, and per net
        (``nets``: their names) ``[name, next batch, epoch]`` read with it.

        Lock-free: entries are immutable tuples, never removed at or above
        the lowest net's next batch, and each net's next batch is an int
        only its own thread writes.
        """
        kept_now = self.kept
        boxes = list(self._boxes)
        nets_at: list[list[Any]] = []
        for _ in range(1000):
            nets_at = [[name, b.next_batch, b.epoch] for name, b in zip(nets, boxes)]
            low = min((n[1] for n in nets_at), default=0)
            pos = kept_now.get(self.key(low))
            if pos is not None:
                return pos, nets_at
            kept = list(kept_now)  # a C-level copy: atomic under the GIL
            if kept and low > max(kept):
                # a net's next batch is past the end (the stream ended there)
                pos = kept_now.get(max(kept))
                if pos is not None:
                    return pos, nets_at
            # else the positions were pruned past our reading of the nets
            # by another thread meanwhile: read the nets again
        raise RuntimeError(f"source {source!r}: no consistent position found")


class StartPositions(Positions):
    """Only the start is kept (a shuffled stream resumes by replaying)."""

    def record(self, batches: int) -> None:
        pass

    def restart(self, batches: int, lanes: int) -> None:
        self.kept = {0: start_position(lanes)}
        self.kept_from = batches

    def key(self, low: int) -> int:
        return 0

