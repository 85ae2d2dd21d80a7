"""The reader seam: one consumer's end of a source, whatever the consumer is.

A :class:`BatchReader` is the consumer half of a feed: it hands out a
source's whole batches in order, with the ends of epochs and the source's
errors at their place, and is told :meth:`BatchReader.returned` once the
consumer is done with each.  What assembles the batches (the feed's
enqueuer thread) belongs to the coordinator that made the reader: it is
started, stopped and joined with the source, never by the consumer.

A :class:`SourceInfo` is the frozen description of what a source is wired
with (``GlobalCoordinator.open_source``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

from .chunks import Batch, Chunk, EpochEnd, ModelInput
from .dealing import ArrivalDealer
from .enqueuer import Feed
from .source import InputSource

__all__ = ["BatchReader", "Inlet", "InletDealer", "SourceInfo"]


@dataclasses.dataclass(frozen=True)
class SourceInfo:
    """What a source is wired with, as ``GlobalCoordinator.open_source`` saw it.

    Attributes:
        name: the source's name (``input_source_name``).
        blob_names: the blobs of each batch, in order (those of its first wiring).
        axes: each blob's batch axis.
        batch_size: the one batch size of a source re-batched once for all its
            readers (``deterministic``, ``shuffle_buffer``, ``epochs`` or
            ``equal``); None when each reader cuts its own.
        deterministic, shuffle_buffer, epochs, equal: the dealing options.
        readers: the names of its readers (nets included), in wiring order.
        num_workers: fetchers wired to it.
        resumable: it has a position (``state_dict``): ``deterministic=True``.
        started: its workers were started.
        stopped: it was stopped, or ended with an error.
    """

    name: str
    blob_names: tuple[str, ...]
    axes: tuple[int, ...]
    batch_size: int | None
    deterministic: bool
    shuffle_buffer: int
    epochs: int | None
    equal: bool
    readers: tuple[str, ...]
    num_workers: int
    resumable: bool
    started: bool
    stopped: bool


class BatchReader:
    """One consumer's end of a source: whole batches, in order.

    Made by ``GlobalCoordinator.add_reader`` (a reader of its own) or by the
    wiring of a net (``Net.add_reader`` takes one).  Not thread-safe: one
    consumer thread reads it.

    The batches a reader hands out are read-only views (see ``Net``); the
    position of a deterministic source moves once :meth:`returned` is
    called, so a batch read and not returned is dealt again on resume.
    """

    __slots__ = ("_feed",)

    def __init__(self, feed: Feed) -> None:
        self._feed = feed

    # -- what it reads -------------------------------------------------------------
    @property
    def name(self) -> str:
        """The reader's name: the ``net`` label of its metrics."""
        return self._feed.net_name

    @property
    def source_name(self) -> str:
        return self._feed.source.name

    @property
    def blob_names(self) -> tuple[str, ...]:
        """The names of each batch's arrays, in order."""
        return self._feed.blob_names

    @property
    def batch_size(self) -> int:
        return self._feed.batch_size

    @property
    def stopped(self) -> bool:
        """Its source was stopped (or failed): it hands out nothing more."""
        return bool(self._feed.source.stopped)

    # -- reading ------------------------------------------------------------------
    def read(self, timeout: float | None = None) -> Batch | EpochEnd:
        """The next batch (``Batch(arrays, n)``), or the end of an epoch
        (``EpochEnd``) of a source with ``epochs``.

        Args:
            timeout: seconds to wait; default the source's ``timeout``.

        Raises:
            DequeueTimeout: no batch within ``timeout``.
            EndOfInput: the source is exhausted (its last batch was read) or stopped.
            FetcherError: a fetcher of the source failed (at its place in the stream).
            BlobfeedError: the coordinator was never started.
        """
        feed = self._feed
        held = feed.take_held()
        return held if held is not None else feed.dequeue(timeout)

    def returned(self, batch: Batch | EpochEnd) -> None:
        """The consumer is done with ``batch`` (or passed the epoch end): it
        counts as delivered, and the source's position moves past it."""
        self._feed.delivered(batch)

    def hold(self, batch: Batch) -> None:
        """Give back a batch read and not used: the next :meth:`read` hands it
        out again (dropped, and counted so, once the source stopped)."""
        self._feed.hold(batch)

    def ready(self) -> int:
        """Batches ready now, without waiting for the enqueuer."""
        return self._feed.device_queue_depth()

    def waited(self) -> float:
        """Seconds :meth:`read` has waited in all (never decreases)."""
        return float(self._feed.consume_stats.wait.total)

    @property
    def error(self) -> BaseException | None:
        """Why the source failed (a fetcher's error), None while it has not."""
        error = self._feed.source.error
        return error if isinstance(error, BaseException) else None

    def count_dropped(self, reason: str, samples: int) -> None:
        """Count ``samples`` the consumer discards as dropped for ``reason``
        (``blobfeed_dropped_samples_total{reason=...}`` of the source)."""
        source = self._feed.source
        source.hub.count_dropped(source.name, reason, samples)

    def use_memory(self, memory: Any) -> None:
        """Batches that span chunks are assembled in ``memory`` (an object
        with ``empty(shape, dtype)``), before the source starts."""
        self._feed.rebatcher.use_memory(memory)

    # -- the net that reads it (Net.add_reader) -------------------------------------
    def _bind(
        self, place: Callable[[tuple[Any, ...]], tuple[Any, ...]],
        model_inputs: dict[str, ModelInput], writable: bool, cancel: Callable[[], None],
    ) -> Feed:
        feed = self._feed
        feed.bind_consumer(place, model_inputs, writable, cancel)
        return feed

    def __repr__(self) -> str:
        return f"<BatchReader {self.name!r} of source {self.source_name!r}>"


# -- a source its caller feeds (a remote consumer's end) -------------------------------
class _InletReader:
    """The reader's end of an inlet's queue: the queue's methods, and each
    item's number to ``on_returned`` once the consumer returned it."""

    def __init__(self, dealer: "InletDealer") -> None:
        q = dealer.queue
        self.get_nowait = q.get_nowait
        self.wait_for_item = q.wait_for_item
        self.qsize = q.qsize
        self._dealer = dealer

    def returned(self) -> None:
        self._dealer.ack()

    def epoch_returned(self, dropped: int = 0) -> None:
        self._dealer.ack()


def _no_ack(number: int) -> None:
    pass


class InletDealer(ArrivalDealer):
    """The dealer of an :class:`Inlet`: one queue its caller fills, read by
    one reader; the caller's number of each item goes back to
    ``on_returned`` when the reader returns it, in order."""

    def __init__(
        self, source: str, capacity: int, fail: Callable[[BaseException], None], on_returned: Callable[[int], None],
    ) -> None:
        super().__init__(source, capacity, fail)
        #: the caller's numbers of the items queued for the reader, in order
        self.numbers: collections.deque[int] = collections.deque()
        self._on_returned = on_returned

    def add_net(self) -> _InletReader:  # type: ignore[override]
        return _InletReader(self)

    def detach(self) -> None:
        """Forget the caller (it stopped)."""
        self._on_returned = _no_ack

    def ack(self) -> None:
        try:
            number = self.numbers.popleft()
        except IndexError:
            return
        self._on_returned(number)


class Inlet:
    """A source fed by its caller instead of workers (a remote consumer's
    receiver), read through :attr:`reader`: whole batches in order, each with
    the caller's number, told back through ``on_returned`` once the reader
    returned it.  Made by ``GlobalCoordinator.open_inlet``; its reader's
    enqueuer is that coordinator's thread, started by :meth:`start`,
    stopped and joined by :meth:`close` (or the coordinator's ``stop()``).

    Feeding methods are for one thread (the caller's receiver).
    """

    def __init__(
        self, source: InputSource, reader: BatchReader,
        start: Callable[[], None], close: Callable[[float], bool],
    ) -> None:
        self._source = source
        self._dealer: InletDealer = source.dealer  # type: ignore[assignment]
        self._put = self._dealer.sink(0)
        self._seq = 0
        #: what the consumer reads (give it to ``Net.add_reader``)
        self.reader = reader
        self._start = start
        self._close = close

    @property
    def name(self) -> str:
        return self._source.name

    def start(self) -> None:
        """Start the reader's enqueuer (after ``Net.add_reader``)."""
        self._start()

    # -- the caller's side ---------------------------------------------------------
    def put(self, arrays: Sequence[Any], n: int, number: int) -> bool:
        """Queue one whole batch of ``n`` samples (read-only arrays, in blob
        order), numbered ``number``; waits while the queue is full.  False
        once the inlet is closed."""
        self._dealer.numbers.append(number)
        ok = self._put(Chunk(tuple(arrays), n, 0, self._seq), 0)
        self._seq += 1
        return ok

    def end_epoch(self, epoch: int, dropped: int, number: int) -> bool:
        """Queue the end of ``epoch`` (``dropped`` batches of it were
        dropped upstream), numbered ``number``.  False once closed."""
        self._dealer.numbers.append(number)
        return self._put(EpochEnd(epoch, dropped=dropped), 0)  # type: ignore[arg-type]

    def finish(self) -> None:
        """The data ends: what is queued, then ``EndOfInput``."""
        self._dealer.end_of_input()

    def end_with(self, error: BaseException) -> None:
        """The stream ends with ``error`` at this place: what is queued, then the error."""
        self._dealer.queue.close(error, after_items=True)

    def fail(self, error: BaseException) -> None:
        """The source fails now: the reader raises ``error`` (what is queued is dropped)."""
        self._source.fail(error)

    @property
    def error(self) -> BaseException | None:
        error = self._source.error
        return error if isinstance(error, BaseException) else None

    def unreturned(self) -> int:
        """Items queued or read and not yet returned."""
        return len(self._dealer.numbers)

    def stop(self) -> None:
        """Stop the source now (the reader raises ``EndOfInput``); never waits."""
        self._source.stop()

    def close(self, timeout: float = 10.0) -> bool:
        """Stop, join the reader's enqueuer (within ``timeout``) and forget
        the caller.  Idempotent; True when the thread ended."""
        self._source.stop()
        try:
            return self._close(timeout)
        finally:
            self._dealer.detach()
