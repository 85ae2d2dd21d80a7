"""What a lane dealer does with the chunk at the head of the lane whose turn
it is: the stage between the lanes and the nets' outboxes.

* :class:`Cut` (no shuffle) -- the chunk is cut at batch boundaries into
  views (no copy); the pieces of batch *i* go to net *i mod k*, so every
  net's re-batcher receives exactly one batch's worth of pieces per batch
  and makes the same batches a single re-batcher would.  With one net the
  rest of the chunk goes to it uncut (its feed's re-batcher cuts it, as in
  arrival order): the stage only counts where the batches end in it.
* :class:`Shuffled` (``shuffle_buffer=N``) -- the chunk goes whole into a
  :class:`~blobfeed.feeders.shuffle.ShuffleBuffer`; whole batches leave it
  as soon as it holds enough, and its rest once every lane ended, a batch
  at a time as the outboxes have room.

A stage also says what a position is (:attr:`Stage.positions`): a cut stream
records one per batch; a shuffled one resumes from its start.  A stage owns
what it holds and is called under the dealer's lock; it moves the stream's
count of batches (the dealer's) and records positions through the dealer it
is bound to.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol, Sequence

from ..chunks import Chunk
from ..shuffle import ShuffleBuffer
from .positions import Positions, StartPositions
from .rounds import Direct

__all__ = ["Cut", "Shuffled", "Stage", "Stream"]


class Stream(Protocol):
    """What a stage uses of the dealer it is bound to (under its lock)."""

    batch_size: int
    axes: tuple[int, ...]
    outboxes: list[Any]
    #: batches completed in the stream; samples of the head chunk already dealt
    _batch: int
    _offset: int
    _rounds: Direct

    def _record(self, batches: int) -> None: ...
    def _consumed(self, wid: int, chunk: Chunk, lane: collections.deque[Any]) -> None: ...
    def _outbox_has_room(self) -> bool: ...


class Stage:
    """What every stage does; the defaults are a stage that holds nothing."""

    #: what a position of a stream through this stage is
    positions: type[Positions] = Positions

    def __init__(self) -> None:
        #: the dealer it works for (a :class:`Stream`; typed Any, as its
        #: private members are read per piece)
        self._s: Any = None

    def bind(self, stream: Stream) -> None:
        """The dealer this stage works for (at its construction)."""
        self._s = stream

    def held(self) -> int:
        """Samples held by the stage (dealt neither to a net nor back to a lane)."""
        return 0

    def feed(self, wid: int, chunk: Chunk, lane: collections.deque[Any]) -> bool:
        """Deal what ``chunk``, the head of ``wid``'s lane, allows (the
        outbox whose turn it is has room)."""
        raise NotImplementedError

    def drain(self) -> bool | None:
        """Every lane ended: deal what the stage still holds (only called
        while :meth:`held`); None: wait for room."""
        return None

    def end_batch(self, record: bool) -> bool:
        """The end of an epoch (or of the data): the epoch's last batch is
        complete (its position recorded if ``record``).  Returns whether it
        was partial."""
        return False

    def reset(self) -> None:
        """A load: the stream starts at a batch boundary."""

    def clear(self) -> int:
        """The stream stops: what is held is dropped; returns its samples."""
        return 0


class Cut(Stage):
    """No shuffle: batches cut from the chunks as views (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        #: samples in the batch being filled
        self.filled = 0

    def feed(self, wid: int, chunk: Chunk, lane: collections.deque[Any]) -> bool:
        s = self._s
        boxes = s.outboxes
        if len(boxes) == 1 and s._batch >= boxes[0].skip_until:
            return self._feed_whole(s, wid, chunk, lane)
        bs = s.batch_size
        offset = s._offset
        take = min(chunk.n - offset, bs - self.filled)
        s._rounds.deal(s._batch, self.piece(chunk, offset, take))
        offset = s._offset = offset + take
        self.filled += take
        if offset == chunk.n:
            lane.popleft()
            s._offset = 0
            s._consumed(wid, chunk, lane)
        if self.filled == bs:
            batches = s._batch = s._batch + 1
            self.filled = 0
            s._record(batches)
            s._rounds.batch_done(batches)
        return True

    def _feed_whole(self, s: Any, wid: int, chunk: Chunk, lane: collections.deque[Any]) -> bool:
        """One net: the rest of the head chunk goes to it uncut; the stream
        only counts where the batches end in it, and records the position there."""
        start = s._offset
        left = chunk.n - start
        box = s.outboxes[0]
        box.pieces.append(chunk if start == 0 else self.piece(chunk, start, left))
        box.samples += left
        bs = s.batch_size
        while left >= bs - self.filled:  # a batch ends inside this chunk
            room = bs - self.filled
            left -= room
            self.filled = 0
            s._batch += 1
            if not left:
                break  # at the chunk's end: recorded after it is consumed
            s._offset += room
            s._record(s._batch)
        else:
            self.filled += left
        lane.popleft()
        s._offset = 0
        s._consumed(wid, chunk, lane)
        if not self.filled:
            s._record(s._batch)
        return True

    def piece(self, chunk: Chunk, lo: int, n: int) -> Chunk:
        """Samples ``lo .. lo + n`` of ``chunk``: views of its arrays."""
        if lo == 0 and n == chunk.n:
            return chunk
        axes: Sequence[int] = self._s.axes
        arrays = tuple(
            a[lo:lo + n] if ax == 0 else a[(slice(None),) * ax + (slice(lo, lo + n),)]
            for a, ax in zip(chunk.arrays, axes)
        )
        return Chunk(arrays, n, chunk.worker_id, chunk.seq, chunk.pin, chunk.state)

    def end_batch(self, record: bool) -> bool:
        # the batch being filled is the epoch's last, partial one: counted
        if not self.filled:
            return False
        s = self._s
        s._batch += 1
        self.filled = 0
        if record:
            s._record(s._batch)
        return True

    def reset(self) -> None:
        self.filled = 0


class Shuffled(Stage):
    """The shuffle stage (see the module docstring).

    Args:
        buffer: the shuffle buffer (its generator is the source's).
    """

    positions = StartPositions

    def __init__(self, buffer: ShuffleBuffer) -> None:
        super().__init__()
        self.buffer = buffer
        #: the stage's last batch was partial (the epoch's last)
        self.partial = False

    def held(self) -> int:
        return len(self.buffer)

    def feed(self, wid: int, chunk: Chunk, lane: collections.deque[Any]) -> bool:
        s = self._s
        lane.popleft()
        s._consumed(wid, chunk, lane)
        # (the buffer copies what a pinned chunk holds out of the worker's
        # memory: rows wait there for long, and must not starve the worker
        # of its slots)
        buffer = self.buffer
        buffer.push(chunk)
        bs = s.batch_size
        while buffer.ready(bs):
            self._deal_batch(s, buffer.pop(bs))
        return True

    def drain(self) -> bool | None:
        # the buffer's rest, a batch at a time as room allows: all at once
        # would hold the whole buffer as batches
        s = self._s
        if not s._outbox_has_room():
            return None
        self._deal_batch(s, self.buffer.pop(s.batch_size))
        return True

    def _deal_batch(self, s: Any, batch: Chunk) -> None:
        """A whole batch out of the buffer (the epoch's last may be partial)."""
        self.partial = batch.n < s.batch_size
        s._rounds.deal(s._batch, batch)
        batches = s._batch = s._batch + 1
        s._record(batches)
        if not self.partial:
            # (a partial one is the epoch's last: the epoch's end settles its round)
            s._rounds.batch_done(batches)

    def end_batch(self, record: bool) -> bool:
        partial = self.partial
        self.partial = False
        return partial

    def clear(self) -> int:
        # its chunks may hold a worker's shared memory: let go now
        return self.buffer.clear()
