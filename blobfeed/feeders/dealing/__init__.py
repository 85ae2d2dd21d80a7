"""How a source's chunks are dealt to its nets: one seam, sibling dealers.

* :class:`ArrivalDealer` -- arrival order (the default): one bounded queue,
  the next chunk to whichever net asks first.
* :class:`LaneDealer` -- a lane per worker, composed of the parts it is
  given: a turn policy (:mod:`.turns`: strict round robin for
  ``deterministic=True``, else first-ready), a stage (:mod:`.stages`:
  batches cut once per source, or a shuffle buffer), and how batches go
  out (:mod:`.rounds`: at once, or with ``equal=True`` in whole rounds, one
  batch per net), with a position per batch (:mod:`.positions`).

:func:`make_dealer` chooses the dealer and its parts from the wiring
arguments, once; nothing downstream asks which one a source has, and the
dealer does not ask which parts it has.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..shuffle import ShuffleBuffer
from .arrival import ArrivalDealer
from .base import Dealer, DealerStats, DealingOptions, DropCounter, Reader
from .indexed import INDEXED_STATE_VERSION, IndexedDealer
from .lanes import LaneDealer, NetOutbox, default_outbox_samples
from .positions import READABLE_VERSIONS, STATE_VERSION
from .rounds import Direct, EqualRounds
from .stages import Cut, Shuffled, Stage
from .turns import FirstReadyTurns, StrictTurns, Turns

__all__ = [
    "ArrivalDealer", "Cut", "Dealer", "DealerStats", "DealingOptions", "Direct", "DropCounter", "EqualRounds",
    "FirstReadyTurns", "INDEXED_STATE_VERSION", "IndexedDealer", "LaneDealer", "NetOutbox", "READABLE_VERSIONS", "Reader", "STATE_VERSION", "Shuffled",
    "Stage", "StrictTurns", "Turns", "default_outbox_samples", "make_dealer",
]


def make_dealer(
    source: str,
    options: DealingOptions,
    *,
    batch_size: int,
    axes: Sequence[int],
    capacity: int,
    shuffle_rng: Callable[[], np.random.Generator],
    on_error: Callable[[BaseException], None],
    on_error_in_order: Callable[[BaseException], None],
    on_dropped: DropCounter,
    max_bytes: int | None = None,
    outbox_samples: int | None = None,
    follow_need: bool = False,
) -> Dealer:
    """The dealer for a source wired with ``options``.

    Args:
        source: the source's name.
        options: what the wiring asked for.
        batch_size: the batch size of the first net (a lane dealer cuts
            batches once for every net, so it is the source's).
        axes: each blob's batch axis.
        capacity: the chunks it may hold (``max_buffered_batches``).
        shuffle_rng: makes the shuffle's generator (called only if it shuffles).
        on_error: fails the source at once (arrival order).
        on_error_in_order: fails the source at the error's place in the stream.
        on_dropped: ``(reason, samples)`` for samples thrown away on purpose.
        max_bytes: the bytes of chunks it may hold (``max_buffered_bytes``;
            None: unbounded).
        outbox_samples: a lane dealer's run-ahead per net, in samples
            (None: :func:`~.lanes.default_outbox_samples`, two batches, one
            with several nets and big batches).
        follow_need: ``max_buffered_bytes="auto"`` in arrival order: the
            queue's byte limit may change while it runs, within ``max_bytes``
            (:mod:`blobfeed.buffers`); ignored by the other dealers.
    """
    if options.in_arrival_order:
        return ArrivalDealer(source, capacity, on_error, max_bytes, follow_need)
    return LaneDealer(
        source, batch_size, axes, capacity=capacity, outbox_samples=outbox_samples,
        on_error=on_error_in_order, on_dropped=on_dropped, max_bytes=max_bytes,
        turns=StrictTurns() if options.deterministic else FirstReadyTurns(),
        stage=Shuffled(ShuffleBuffer(options.shuffle_buffer, axes, shuffle_rng())) if options.shuffle_buffer else Cut(),
        rounds=EqualRounds(options.drop_last) if options.equal else Direct(),
    )
