"""The dealing seam: how a source's chunks reach its nets.

A *dealer* sits between a source's workers and the feeds (one per net) that
re-batch for the nets.  Workers hand it chunks (``sink``), errors
(``put_error``), the end of an epoch (``end_epoch``) and their end
(``finish``); each net reads its share through a :class:`Reader`.  Which
dealer a source has is chosen once, when it is wired (:func:`make_dealer`
in this package); nothing downstream asks which one it has.

A dealer owns everything it holds: it counts it (:class:`DealerStats`), it
gives it back as lost when it closes, and it reports what it threw away on
purpose (a resume's already-delivered prefix) through ``on_dropped``.  So
the accounting identity (fetched == delivered + dropped + buffered) holds by
construction, whatever the dealer does inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..chunks import Chunk

__all__ = ["Dealer", "DealerStats", "DealingOptions", "DropCounter", "Reader"]

#: ``on_dropped(reason, samples)``: samples the dealer threw away on purpose
DropCounter = Callable[[str, int], None]


@dataclass(frozen=True)
class DealerStats:
    """What a dealer holds right now (read at scrape time)."""

    #: accepted samples inside the dealer: queued, in lanes, in a shuffle
    #: buffer, or dealt to a net and not yet taken by its feed
    held_samples: int
    #: chunks waiting to be dealt (what ``capacity`` bounds)
    depth: int
    #: the bound on the chunks it holds (``max_buffered_batches``)
    capacity: int
    #: bytes of the chunks waiting to be dealt (what ``max_bytes`` bounds)
    queued_bytes: int = 0
    #: the bound on those bytes (``max_buffered_bytes``; None: unbounded)
    max_bytes: int | None = None


@dataclass(frozen=True)
class DealingOptions:
    """The wiring arguments that decide how a source's chunks are dealt.

    Every ``init_data_input_workers`` call for one source must agree on
    them; :func:`make_dealer` turns them into a dealer once.
    """

    #: strict round robin by worker id, batches dealt to nets in turn
    deterministic: bool = False
    #: samples in the shuffle buffer (0: no shuffle)
    shuffle_buffer: int = 0
    #: passes over the data (None: endless)
    epochs: int | None = 1
    #: every net gets the same number of batches per epoch: batches go out
    #: in rounds of one per net, an epoch's last incomplete round is dropped
    equal: bool = False
    #: with ``equal``: the epoch's last partial batch is dropped before the
    #: rounds are counted (the nets' ``drop_last``, which must agree); False
    #: without ``equal`` (each net's feed applies its own)
    drop_last: bool = False
    #: a random-access source: read units put back in order (see
    #: :mod:`.indexed`); the stream is a function of the data, seed and batch size
    random_access: bool = False

    @property
    def in_arrival_order(self) -> bool:
        """Chunks can be taken as they arrive, by whichever net asks first."""
        return (
            not self.deterministic and not self.shuffle_buffer and self.epochs == 1 and not self.equal
            and not self.random_access
        )

    def describe(self) -> str:
        text = (
            f"deterministic={self.deterministic}, shuffle_buffer={self.shuffle_buffer}, "
            f"epochs={self.epochs}, equal={self.equal}"
        )
        if self.random_access:
            text = f"a random-access source, epochs={self.epochs}, equal={self.equal}"
        return f"{text}, drop_last={self.drop_last}" if self.equal else text


class Reader(Protocol):
    """One net's end of a dealer: what its feed takes chunks from.

    The reading half of a queue (``get_nowait``, ``wait_for_item``,
    ``qsize``) and what the net tells the dealer back (``returned``,
    ``epoch_returned``), so a dealer that keeps positions knows where each
    net is.
    """

    def get_nowait(self) -> tuple[bool, Chunk | None]:
        """(True, item) or (False, None) when nothing is there yet.

        Raises:
            EndOfInput: the stream ended (or was stopped).
            FetcherError: the stream reached an error.
        """
        ...

    def wait_for_item(self, timeout: float | None = None) -> bool: ...
    def qsize(self) -> int: ...

    def returned(self) -> None:
        """``Net.run()`` returned this net's next batch."""
        ...

    def epoch_returned(self, dropped: int = 0) -> None:
        """``Net.run()`` reported the end of this net's epoch, after
        ``dropped`` batches of it its feed dropped (``drop_last``)."""
        ...


class Dealer(Protocol):
    """How a source's chunks reach its nets (see the module docstring).

    Thread-safe.  The worker side (``put``...) is called by one thread per
    worker; the reading side by the net's feeds; ``close`` by anyone.
    """

    @property
    def batch_size(self) -> int | None:
        """One batch size for every net (the dealer cuts batches), or None:
        each net's feed re-batches on its own and may change its batch size."""
        ...

    @property
    def resumable(self) -> bool:
        """``state``/``load`` work (the stream is a function of the wiring)."""
        ...

    @property
    def closed(self) -> bool: ...

    # -- wiring, before start
    def add_lanes(self, worker_ids: Sequence[int]) -> None: ...
    def add_net(self, prefetch: bool = True) -> Reader: ...
    def start(self) -> None: ...

    # -- workers
    def sink(self, worker_id: int) -> Callable[[Chunk, int], bool]:
        """Where ``worker_id``'s chunks go, bound once (called per chunk):
        ``sink(chunk, nbytes)`` hands one over (``nbytes``: its arrays'
        bytes), waiting while the dealer is full (in chunks, or in bytes:
        a chunk always enters where nothing waits), and returns False once
        it is closed."""
        ...

    def put_error(self, worker_id: int, error: BaseException) -> None:
        """The worker failed: the source fails (at once, or at the error's
        place in the stream)."""
        ...

    def finish(self, worker_id: int) -> None:
        """The worker raised StopIteration: its data is done."""
        ...

    def end_of_input(self) -> None:
        """Every worker of the source finished."""
        ...

    def end_epoch(self, worker_id: int, state: Any = None) -> bool:
        """The worker's epoch ended and it goes on; False: it must stop.
        ``state``: a stateful fetcher's state at the next epoch's start."""
        ...

    # -- ending
    def close(self, reason: BaseException | None, *, in_order: bool = False) -> int:
        """Stop or failure: wake everyone; readers then get ``reason``.
        ``in_order``: what was dealt to the nets is still handed out (the
        stream reached a worker's error).  Returns the samples discarded.
        Idempotent (a second call discards nothing more)."""
        ...

    # -- what it holds
    @property
    def capacity(self) -> int:
        """The bound on the chunks waiting in it (``max_buffered_batches``)."""
        ...

    def queued(self) -> int:
        """Chunks waiting to be dealt now (cheap: read per batch)."""
        ...

    def queued_bytes(self) -> int:
        """Bytes of the chunks waiting to be dealt now (cheap)."""
        ...

    def stats(self) -> DealerStats:
        """What it holds, counted (under its lock: for scrapes)."""
        ...

    # -- position
    @property
    def epoch(self) -> int:
        """The epoch the stream is in (after a load: the one it resumes in)."""
        ...

    @property
    def worker_ids(self) -> list[int]:
        """The workers it deals from, in their order."""
        ...

    def state(self, layout: dict[str, Any], nets: Sequence[str]) -> dict[str, Any]: ...
    def load(self, state: dict[str, Any]) -> list[tuple[int, Any]]: ...
