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
import logging
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import BlobfeedError, DequeueTimeout, EndOfInput, FetcherError
from ..stats import ConsumeStats
from . import enqueuer
from .chunks import Batch, Chunk, EpochEnd, ModelInput, check_model_inputs
from .dealing import ArrivalDealer
from .enqueuer import Feed, _forget_frames
from .rebatch import _read_only, _writable_copy
from .source import InputSource

__all__ = ["BatchReader", "Inlet", "InletDealer", "SourceInfo"]

logger = logging.getLogger("blobfeed.feeders")


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

    The consumer half of a feed: the feed (``enqueuer.Feed``, its enqueuer
    half) re-batches the source's chunks on its enqueuer thread and puts
    batches on its device queue; the reader takes them, or assembles the
    next batch itself under the feed's lock when the queue is empty (a
    thread hand-off costs more than a small batch), and counts what its
    consumer was handed and returned.  Made by ``init_reader``,
    ``GlobalCoordinator.add_reader`` and ``open_inlet``, and by
    ``init_data_input_workers`` for its net; ``Net.add_reader`` takes one.
    Not thread-safe: one consumer thread reads it.

    The batches a reader hands out are read-only views (see ``Net``); the
    position of a deterministic source moves once :meth:`returned` is
    called, so a batch read and not returned is dealt again on resume.
    """

    def __init__(self, feed: Feed) -> None:
        if feed.reader is not None:
            raise ValueError(f"feed {feed.source.name!r}/{feed.net_name!r} has a reader already")
        self._feed = feed
        feed.reader = self
        # the feed's, never replaced: read per batch
        self._device_queue = feed.device_queue
        self._input = feed._input
        self.source = feed.source
        self.blob_names: tuple[str, ...] = feed.blob_names
        #: the counts of what the consumer took (blobfeed_dequeue_wait_seconds, ...)
        self.consume_stats: ConsumeStats = feed.consume_stats
        #: a batch taken while another source of the consumer failed or timed
        #: out; it is handed out first next time (see Net.run); under the feed's lock
        self._held: Batch | None = None
        #: the batch inside the consumer's model now (see to_model)
        self._in_model: Batch | None = None
        #: perf_counter() at the consumer's first ask (see check_first)
        self._first_ask = 0.0
        #: the first batch handed out was checked against the consumer's model
        self._first_checked = False
        #: the name of the net it feeds (Net.add_reader), None for none
        self.net: str | None = None
        #: samples read() handed out and not yet returned or held: still the
        #: source's (buffered), wherever the consumer keeps them
        self.lent = 0
        #: called in the consumer's thread when :meth:`dequeue` is about to
        #: wait for a batch (none is ready), with :attr:`waiting` set already:
        #: a remote consumer's attachment frees the slots it kept back then
        self.before_wait: Callable[[], None] | None = None
        #: called in the consumer's thread with each batch :meth:`dequeue`
        #: hands out; returns the batch to hand out instead (a remote
        #: consumer's attachment copies one out of shared memory when the
        #: batches its user keeps would hold every slot)
        self.hand_out: Callable[[Batch], Batch] | None = None
        #: the consumer's thread waits in :meth:`dequeue` for a batch now
        self.waiting = False
        #: (``time.perf_counter()``) when the wait of the last dequeue would
        #: end: what sending its acknowledgement may take (see Attachment._ack)
        self.asked_until = 0.0

    # -- what it reads -------------------------------------------------------------
    @property
    def name(self) -> str:
        """The reader's name: the ``net`` label of its metrics."""
        return self._feed.net_name

    @property
    def source_name(self) -> str:
        return self.source.name

    @property
    def batch_size(self) -> int:
        return self._feed.batch_size

    @property
    def started(self) -> bool:
        """Its enqueuer started (the coordinator's ``start()``)."""
        return bool(self._feed._started)

    @property
    def stopped(self) -> bool:
        """Its source was stopped (or failed): it hands out nothing more."""
        return bool(self.source.stopped)

    @property
    def error(self) -> BaseException | None:
        """Why the source failed (a fetcher's error), None while it has not."""
        error = self.source.error
        return error if isinstance(error, BaseException) else None

    # -- reading ------------------------------------------------------------------
    def read(self, timeout: float | None = None) -> Batch | EpochEnd:
        """The next batch (``Batch(arrays, n)``), or the end of an epoch
        (``EpochEnd``) of a source with ``epochs``; a batch given back with
        :meth:`hold` first.

        Args:
            timeout: seconds to wait; default the source's ``timeout``.

        Raises:
            DequeueTimeout: no batch within ``timeout``.
            EndOfInput: the source is exhausted (its last batch was read) or stopped.
            FetcherError: a fetcher of the source failed (at its place in the stream).
            BlobfeedError: the coordinator was never started.
        """
        held = self.take_held()
        item = held if held is not None else self.dequeue(timeout)
        if type(item) is Batch:
            self.lent += item.n
        return item

    def read_ready(self) -> Batch | EpochEnd | None:
        """:meth:`read` without waiting: the next batch if it is ready now
        (queued, or assembled in this thread from the chunks the source has
        queued, in one pass under the feed's lock), else None.  A reader
        without prefetch settles its stream's end in :meth:`read`, not
        here: None then, and the caller's next :meth:`read` raises.

        Raises:
            EndOfInput, FetcherError: as :meth:`read`, for what is settled already.
        """
        held = self.take_held()
        if held is not None:
            if type(held) is Batch:
                self.lent += held.n
            return held
        feed = self._feed
        if feed.prefetch or feed.fed_by_caller or feed.rebatcher.big or not feed._started:
            # the device queue's way: big batches are assembled outside the lock (Feed._drain)
            return self.read() if self.ready() else None
        cs = self.consume_stats
        t0 = time.perf_counter()
        item = self._assemble_here()  # (the device queue first, under the feed's lock)
        if item is None:
            return None
        # counted as read() counts a batch it did not wait for
        if cs.last_end:
            cs.busy += t0 - cs.last_end
        else:
            self._first_ask = t0
        t1 = cs.last_end = time.perf_counter()
        cs.wait.observe(t1 - t0)
        if type(item) is Batch:
            self.lent += item.n
        return item

    def returned(self, batch: Batch | EpochEnd) -> None:
        """The consumer is done with ``batch`` (or passed the epoch end): it
        counts as delivered, and the source's position moves past it."""
        if type(batch) is Batch:
            self.lent = max(0, self.lent - batch.n)
        self.delivered(batch)

    def ready(self) -> int:
        """Batches ready now, without waiting (a reader without prefetch
        assembles what the source's queued chunks complete first)."""
        feed = self._feed
        if not feed.prefetch and feed._started:
            feed.pump(0.0)
        return feed.device_queue.qsize()

    def waited(self) -> float:
        """Seconds :meth:`read` has waited in all (never decreases)."""
        return float(self.consume_stats.wait.total)

    def count_dropped(self, reason: str, samples: int) -> None:
        """Count ``samples`` the consumer discards as dropped for ``reason``
        (``blobfeed_dropped_samples_total{reason=...}`` of the source)."""
        source = self.source
        source.hub.count_dropped(source.name, reason, samples)

    def use_memory(self, memory: Any) -> None:
        """Batches that span chunks are assembled in ``memory`` (an object
        with ``empty(shape, dtype)``), before the source starts."""
        self._feed.rebatcher.use_memory(memory)

    # -- the consumer's side (a net's run(), in its thread) --------------------------
    def hold(self, batch: Batch) -> None:
        """Give back a batch read and not used (another source of the net
        failed, or a stop cancelled its model): the next read hands it out
        first.  After the source stopped it is counted as dropped instead: a
        stopped source hands nothing out."""
        with self._feed._lock:
            self._in_model = None
            self.lent = max(0, self.lent - batch.n)
        self._give_back(batch)

    def take_held(self) -> Batch | None:
        """The batch given back with :meth:`hold`, handed out (through
        :attr:`hand_out`) and no longer held; None when there is none."""
        if self._held is None:
            return None  # (set only by the consumer's own thread: hold(), so no race with it here)
        with self._feed._lock:
            held, self._held = self._held, None
        return None if held is None else self._handing(held)

    def _handing(self, item: Batch) -> Batch:
        """``item`` as the consumer gets it: through :attr:`hand_out`, if
        set.  Should that fail (a MemoryError, a Ctrl-C during a copy), the
        batch is given back, to be handed out first next time: never lost
        (the dealer counts it as queued)."""
        hook = self.hand_out
        if hook is None or type(item) is not Batch:
            return item
        try:
            return hook(item)
        except BaseException:
            self._give_back(item)
            raise

    def _give_back(self, batch: Batch) -> None:
        """A batch taken and not handed out: next in line again (counted as
        dropped once the source stopped).  One call: what it sets, lent
        included, is set together."""
        feed = self._feed
        with feed._lock:
            if not feed._aborted:
                self._held = batch
                return
        src = self.source
        src.hub.count_dropped(src.name, feed._lost_reason, batch.n)

    def delivered(self, batch: Batch | EpochEnd) -> None:
        """Count ``batch`` as handed to the user (the consumer's thread).

        The first batch is checked against the net's model too: chunks
        queued before this net was wired to a shared source were checked
        against the models of the nets wired then.

        Raises:
            ChunkError: that batch does not fit the model.
        """
        if type(batch) is EpochEnd:
            self._input.epoch_returned(batch.dropped)
            return
        if not self._first_checked:
            self.check_first(batch)  # type: ignore[arg-type]
        cs = self.consume_stats
        cs.batches += 1
        cs.samples += batch.n
        self._in_model = None
        self._input.returned()

    def to_model(self, batch: Batch) -> None:
        """``batch`` goes into the net's model (the net's thread): it counts as
        buffered until :meth:`delivered` (the model returned) or :meth:`hold`
        (a stop cancelled the model), so no scrape misses it meanwhile.

        Raises:
            ChunkError: the first batch does not fit the model.
        """
        if not self._first_checked:
            self.check_first(batch)
        self._in_model = batch

    def check_first(self, batch: Batch) -> None:
        """Check the first batch handed out against the net's model (once;
        see :meth:`delivered`), before the model sees it.

        Raises:
            ChunkError: that batch does not fit the model.
        """
        if self._first_checked:
            return
        self._first_checked = True
        feed = self._feed
        if feed.model_checks and all(isinstance(a, np.ndarray) for a in batch.arrays):
            check_model_inputs(
                Chunk(batch.arrays, batch.n, -1), feed.model_checks, self.source.axes,
                f"source {self.source.name!r}, net {feed.net_name!r} (a chunk queued before the net was wired)",
            )
        # blobfeed_first_batch_seconds: a consumer that asks late does not count against the pipeline
        self.consume_stats.first_batch = time.perf_counter() - max(feed._started_at, self._first_ask)

    def _assemble_here(self) -> Batch | None:
        """The consumer's thread takes or assembles the next batch, if it can
        without waiting for data.

        Order: what the device queue holds, then the enqueuer's staged batch,
        then new batches from the re-batcher.
        """
        feed = self._feed
        # Blocking on the lock is cheap: nobody holds it across a wait.  Not
        # waiting would be wrong: the enqueuer may hold it only to find the
        # internal queue empty while complete batches the net's own thread
        # left sit in the re-batcher.  A `with` block, not acquire/try: a
        # Ctrl-C can land right after a call returns, and only `with`
        # guarantees the release.
        with feed._lock:
            ok, batch = feed.device_queue.get_nowait()
            if ok:
                return batch
            if feed._staged is not None:
                batch, feed._staged = feed._staged, None
                return batch
            if feed.rebatcher.big or feed._joining:
                # the enqueuer assembles big batches, outside the lock (see
                # Feed._drain); while it does, nobody else may hand out a later one
                return None
            queue = feed._input
            while True:
                batch = feed._assemble(feed.direct_stats)
                if batch is not None:
                    return batch
                try:
                    ok, took = feed._take(queue)
                except (EndOfInput, FetcherError) as end:
                    _forget_frames(end)
                    # ended, stopped or failed: the enqueuer settles the end
                    # (last batch, or the error) through the device queue
                    return None
                if not ok or not took:
                    return None

    def dequeue(self, timeout: float | None) -> Batch:
        """Take the next batch for ``Net.run`` (called in the consumer's thread)."""
        held = self.take_held()  # (run() of a net without a model looks here only)
        if held is not None:
            return held
        return self._handing(self._dequeue(timeout))

    def _dequeue(self, timeout: float | None) -> Batch:
        feed = self._feed
        if feed._forked_from is not None:
            raise BlobfeedError(
                f"source {self.source.name!r}, net {feed.net_name!r}: this pipeline was built in "
                f"process {feed._forked_from}; a child made by os.fork() cannot use it (its "
                "threads exist only in the parent): build a new pipeline in the child"
            )
        limit = feed.timeout if timeout is None else timeout
        cs = self.consume_stats
        t0 = time.perf_counter()
        self.asked_until = t0 + limit
        if cs.last_end:
            # the consumer's own time since its last wait (the stall ratio's other half)
            cs.busy += t0 - cs.last_end
        else:
            self._first_ask = t0
        try:
            ok, batch = self._device_queue.get_nowait()
            if ok:
                return batch  # type: ignore[return-value]
            if not feed.fed_by_caller:
                # without prefetch too: one pass under the feed's lock takes
                # the chunks a small batch needs, where pump() would make a
                # step (lock, drain, queue) of each chunk
                batch = self._assemble_here()
                if batch is not None:
                    return batch
            if not feed._started and not feed._aborted:
                raise BlobfeedError(
                    f"source {self.source.name!r}, net {feed.net_name!r}: the pipeline was never "
                    "started; call start() on the coordinator that init_data_input_workers "
                    "returned before Net.run()"
                )
            deadline = t0 + limit
            hook = self.before_wait
            if hook is not None:
                self.waiting = True  # before the hook: see Attachment._outbox
                try:
                    hook()
                    return self._wait_until(deadline, limit, t0)
                finally:
                    self.waiting = False
            return self._wait_until(deadline, limit, t0)
        finally:
            t1 = cs.last_end = time.perf_counter()
            cs.wait.observe(t1 - t0)

    def _wait_until(self, deadline: float, limit: float, t0: float) -> Batch:
        """(:meth:`dequeue`.)  Wait for the next batch until ``deadline``."""
        feed = self._feed
        cs = self.consume_stats
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                cs.timeouts += 1
                raise DequeueTimeout(
                    f"source {self.source.name!r}, net {feed.net_name!r}: "
                    f"no batch within {limit:.3g} s{self.source.starved_hint()}"
                    f"{self.source.sibling_hint(feed._input)}"
                ) from None
            try:
                return self._wait_get(min(remaining, enqueuer.SLOW_INPUT_WARN_S))
            except DequeueTimeout:
                waited = time.perf_counter() - t0
                if waited >= enqueuer.SLOW_INPUT_WARN_S - 1e-3 and deadline - time.perf_counter() > 0:
                    logger.warning(
                        "data input is slow: net %r has waited %.0f s for source %r "
                        "(internal queue %d chunks, %d fetchers alive)%s",
                        feed.net_name, waited, self.source.name,
                        self.source.queue_depth(), self.source.workers_alive(),
                        self.source.sibling_hint(feed._input),
                    )

    def _wait_get(self, timeout: float) -> Batch:
        """The next batch within ``timeout``: from the enqueuer, or without
        one (``prefetch=False``) assembled here.

        Raises:
            DequeueTimeout: none came in time.
        """
        feed = self._feed
        if feed.prefetch:
            return feed.device_queue.get(timeout)
        feed.pump(timeout)
        ok, batch = feed.device_queue.get_nowait()
        if ok and batch is not None:
            return batch
        raise DequeueTimeout(f"no batch within {timeout:.3g} s")

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

    def add_net(self, prefetch: bool = True) -> _InletReader:  # type: ignore[override]
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
    returned it.  Made by ``GlobalCoordinator.open_inlet``.

    No thread of its own and no re-batching: :meth:`put` places each batch
    (the net's ``device``, a copy for ``Net(writable=True)``) in the
    caller's thread and queues it where the reader takes it, a queue as deep
    as the inlet's ``capacity`` (:meth:`put` waits while it is full).
    :meth:`start` marks it started; :meth:`close` (or the coordinator's
    ``stop()``) stops it.

    Feeding methods are for one thread (the caller's receiver).
    """

    def __init__(
        self, source: InputSource, reader: BatchReader,
        start: Callable[[], None], close: Callable[[float], bool],
    ) -> None:
        self._source = source
        self._dealer: InletDealer = source.dealer  # type: ignore[assignment]
        feed = reader._feed
        if not feed.fed_by_caller:
            raise ValueError(f"source {source.name!r}: an inlet's feed is fed by its caller")
        self._feed = feed
        self._queue = feed.device_queue
        self._numbers = self._dealer.numbers
        #: what the consumer reads (give it to ``Net.add_reader``)
        self.reader = reader
        self._start = start
        self._close = close

    @property
    def name(self) -> str:
        return self._source.name

    def start(self) -> None:
        """The reader may read from now on (after ``Net.add_reader``)."""
        self._start()

    # -- the caller's side ---------------------------------------------------------
    def put(self, arrays: Sequence[Any], n: int, number: int) -> bool:
        """Queue one whole batch of ``n`` samples (arrays in blob order),
        numbered ``number``, placed where the reader's net wants it; waits
        while the queue is full.  False once the inlet is stopped or failed.

        Raises:
            Exception: what the net's placement raised (a device error).
        """
        return self.put_many([(arrays, n, number)])

    def put_many(self, batches: list[tuple[Sequence[Any], int, int]]) -> bool:
        """:meth:`put` of each ``(arrays, n, number)`` in order, with one
        wake-up of the reader for them all.  False once the inlet is stopped
        or failed (what went in before stays)."""
        feed = self._feed
        if self._source.halted:
            return False
        t0 = time.perf_counter()
        writable = feed.rebatcher.writable
        place = feed._place
        out = []
        samples = 0
        for arrays, n, number in batches:
            if writable:
                arrays = tuple([_writable_copy(a) for a in arrays])
            else:
                for a in arrays:
                    if a.flags.writeable:
                        arrays = _read_only(tuple([a.view() for a in arrays]))
                        break
                else:
                    arrays = tuple(arrays)
            out.append(Batch(place(arrays), n))
            samples += n
        stats = feed.stats
        stats.enqueue.observe(time.perf_counter() - t0)
        stats.batches += len(out)
        stats.samples += samples
        self._numbers.extend([number for _, _, number in batches])
        return self._queue.put_many(out)

    def end_epoch(self, epoch: int, dropped: int, number: int) -> bool:
        """Queue the end of ``epoch`` (``dropped`` batches of it were
        dropped upstream), numbered ``number``.  False once stopped."""
        if self._source.halted:
            return False
        self._numbers.append(number)
        return self._queue.put(EpochEnd(epoch, dropped=dropped))  # type: ignore[arg-type]

    def finish(self) -> None:
        """The data ends: what is queued, then ``EndOfInput``."""
        self._queue.close()

    def end_with(self, error: BaseException) -> None:
        """The stream ends with ``error`` at this place: what is queued, then the error."""
        self._queue.close(error, after_items=True)

    def fail(self, error: BaseException) -> None:
        """The source fails now: the reader raises ``error`` (what is queued is dropped)."""
        self._source.fail(error)

    @property
    def error(self) -> BaseException | None:
        error = self._source.error
        return error if isinstance(error, BaseException) else None

    def unreturned(self) -> int:
        """Items queued or read and not yet returned."""
        return len(self._numbers)

    def stop(self) -> None:
        """Stop the source now (the reader raises ``EndOfInput``); never waits."""
        self._source.stop()

    def close(self, timeout: float = 10.0) -> bool:
        """Stop, retire its metrics (within ``timeout``) and forget the
        caller.  Idempotent; True when done."""
        self._source.stop()
        try:
            return self._close(timeout)
        finally:
            self._dealer.detach()
