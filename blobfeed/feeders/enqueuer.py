"""The enqueuer: re-batches one source's chunks for one net and hands the
batches to it, on its own thread or the net's."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import EndOfInput, FetcherError
from ..queues import BlobsQueue
from ..stats import AssembleStats, ConsumeStats, MetricsHub
from .chunks import Batch, EpochEnd, ModelInput
from .dealing import Reader
from .rebatch import Rebatcher
from .source import InputSource, SourceStopped

__all__ = ["Feed", "FeedGroup"]

logger = logging.getLogger("blobfeed.feeders")

#: Seconds a consumer waits with no data before "data input is slow".
SLOW_INPUT_WARN_S = 10.0
#: At most one "data loading lagging behind" per this many seconds.
LAGGING_WARN_S = 60.0


class FeedGroup:
    """The feeds of one net.

    A net fed by several sources waits on one at a time; when another of its
    sources fails, that error must still reach the waiting ``run()`` at once,
    so a failing feed aborts its siblings with the same error.  Holds no
    reference to the net (a cycle would keep its onnxruntime session alive).
    """

    def __init__(self) -> None:
        self.feeds: list[Feed] = []

    def failed(self, origin: "Feed", error: BaseException) -> None:
        for f in list(self.feeds):
            if f is not origin:
                lost = f.abort(error)
                if lost:
                    f.source.hub.count_dropped(f.source.name, "error", lost)


class Feed:
    """Re-batches one source's chunks for one net.

    Two threads assemble batches, under one lock (``_lock``) that guards the
    re-batcher and the order of batches:

    * the enqueuer thread (:meth:`run`) takes chunks from the internal queue
      and puts batches on the device queue, so that a net busy running its
      model finds the next batch ready;
    * the net's own thread (:meth:`dequeue`), finding the device queue empty,
      assembles the next batch itself instead of sleeping until the enqueuer
      has done it.  Every thread hand-off costs far more than assembling a
      small batch (a wake-up plus a GIL transfer), so when the consumer is
      faster than the enqueuer can be scheduled this path carries the feed.

    Order and exactly-once hold because everything that hands data out
    happens under the lock: chunks go from the internal queue into the
    re-batcher, a batch the enqueuer cannot yet put waits in ``_staged``, and
    the net's thread takes the device queue first, then ``_staged``, then a
    new batch.  Nobody holds the lock while waiting, so it is never held
    long.
    """

    def __init__(
        self,
        source: InputSource,
        net_name: str,
        place: Callable[[tuple[np.ndarray, ...]], tuple[Any, ...]],
        blob_names: Sequence[str],
        batch_size: int,
        *,
        timeout: float,
        device_queue_capacity: int,
        dont_rebatch: bool,
        drop_last: bool,
        hub: MetricsHub,
        model_inputs: dict[str, ModelInput] | None = None,
        writable: bool = False,
        fed_by_caller: bool = False,
        prefetch: bool = True,
    ) -> None:
        self.source = source
        #: this net's end of the source's dealer: where chunks come from
        self._input: Reader = source.add_reader(prefetch)
        # No reference to the net itself: the net refers to its feeds, and a
        # cycle would keep a discarded net's onnxruntime session alive.
        self.net_name = net_name
        self.blob_names = tuple(blob_names)
        self.timeout = timeout
        self.dont_rebatch = dont_rebatch
        self.drop_last = drop_last
        self.rebatcher = Rebatcher(source.axes, batch_size, whole_chunks=dont_rebatch, writable=writable)
        #: False: no enqueuer thread; the reader's thread does its work when
        #: it reads (:meth:`pump`)
        self.prefetch = prefetch
        # Without an enqueuer the queue is never waited on for room: the
        # reader pumps only when it is empty, and one pump queues what one
        # chunk completes (a bound the chunk's own memory sets), never more.
        if not prefetch:
            device_queue_capacity = sys.maxsize
        # low_water=0: the enqueuer sleeps until the net has taken every
        # queued batch, then refills in one go -- one wake-up per
        # `capacity` batches instead of one per batch.
        self.device_queue: BlobsQueue[Batch] = BlobsQueue(
            device_queue_capacity, name=f"{source.name}/{net_name}",
            low_water=device_queue_capacity // 2 if fed_by_caller else 0,
        )
        #: the enqueuer's work is done (the queue was closed by it): pump() does nothing more
        self._pumped_out = False
        #: held by the thread that pumps (see pump)
        self._pump_lock = threading.Lock()
        #: called once when a reader-driven feed's stream ended by itself (its end or error queued)
        self.on_end: Callable[[], None] = _no_cancel
        #: no enqueuer: the caller puts whole, placed batches on the device
        #: queue itself (an Inlet's receiver); the reader only takes them
        self.fed_by_caller = fed_by_caller
        self._lock = threading.Lock()
        #: the enqueuer's next batch, waiting for room in the device queue
        self._staged: Batch | None = None
        #: samples of a big batch the enqueuer is copying outside the lock
        self._joining = 0
        #: the consumer half (a BatchReader, which sets it): what it holds
        #: counts as buffered, and an abort drops its held batch
        self.reader: Any = None
        #: the end of an epoch taken from the reader: what the re-batcher
        #: holds is that epoch's rest; nothing more is taken until it and
        #: then the end itself were handed on
        self._boundary: EpochEnd | None = None
        #: set by abort(): the source stopped or failed; nothing is handed out
        self._aborted = False
        #: why what this feed still holds is lost, once aborted
        self._lost_reason = "stopped"
        #: set when the coordinator starts the enqueuer: run() before that is a user error
        self._started = False
        #: perf_counter() at the start: the time to the first batch counts
        #: from it, or from the consumer's first ask if later
        self._started_at = 0.0
        self._group: FeedGroup | None = None
        #: (position, blob, model input) for each blob that feeds a model input
        self.model_checks: tuple[tuple[int, str, ModelInput], ...] = tuple(
            (i, b, model_inputs[b]) for i, b in enumerate(self.blob_names) if model_inputs and b in model_inputs
        )
        #: puts a batch on the net's device (the net's method; dropped by release_net)
        self._place = place
        #: cancels the run inside the consumer's model (a stop; see Net._cancel)
        self.cancel: Callable[[], None] = _no_cancel
        #: set in a child made by os.fork(): the parent's threads and locks are not here
        self._forked_from: int | None = None
        self.stats: AssembleStats = hub.assemble_stats(source.name, net_name)
        #: batches the net's thread assembled itself (that thread writes them)
        self.direct_stats: AssembleStats = hub.assemble_stats(source.name, net_name, direct=True)
        self.consume_stats: ConsumeStats = hub.consume_stats(source.name, net_name)

    @property
    def batch_size(self) -> int:
        return self.rebatcher.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        # Read once per batch under the lock; an int store is atomic.
        self.rebatcher.batch_size = value

    def device_queue_depth(self) -> int:
        return self.device_queue.qsize()

    @property
    def cuts_batches(self) -> bool:
        """Batches of ``batch_size`` are cut from the chunks (not ``dont_rebatch``)."""
        return not self.rebatcher.whole_chunks

    def absorbs(self, sample_bytes: int) -> bool:
        """Whether this feed copies every piece of a chunk of samples of
        ``sample_bytes`` into its batch at once, keeping no view of it."""
        return self.rebatcher.absorbs(sample_bytes)

    def buffered_samples(self) -> int:
        reader = self.reader
        staged = self._staged
        held, in_model = (reader._held, reader._in_model) if reader is not None else (None, None)
        return (
            self.rebatcher.pending
            + self._joining
            + (staged.n if staged is not None else 0)
            + (held.n if held is not None else 0)
            + (in_model.n if in_model is not None else 0)
            + (reader.lent if reader is not None else 0)
            + sum(b.n for b in self.device_queue.snapshot())
        )

    def join_group(self, group: FeedGroup) -> None:
        """Become one of a net's feeds (called by the net when wired)."""
        self._group = group

    def mark_forked(self) -> None:
        """In a child made by ``os.fork()``: this feed belongs to the parent."""
        self._forked_from = os.getppid()

    def mark_started(self) -> None:
        """The enqueuer and the fetchers are starting."""
        self._started_at = time.perf_counter()
        self._started = True

    def abort(self, error: BaseException) -> int:
        """Close the device queue with ``error``; returns samples discarded.

        A fetcher error also aborts the net's other feeds, so a ``run()``
        waiting on another source sees it at once.  Idempotent.
        """
        with self._lock:  # never held while blocking, so this cannot wait long
            if self._aborted:
                return 0
            self._aborted = True
            self._lost_reason = "error" if isinstance(error, FetcherError) else "stopped"
            reader = self.reader
            held = reader._held if reader is not None else None
            if held is not None:
                reader._held = None
            lost = held.n if held is not None else 0
            lost += sum(b.n for b in self.device_queue.close(error))
        if isinstance(error, FetcherError) and self._group is not None:
            self._group.failed(self, error)
        return lost

    def bind_consumer(
        self, place: Callable[[tuple[np.ndarray, ...]], tuple[Any, ...]],
        model_inputs: dict[str, ModelInput] | None, writable: bool,
        cancel: Callable[[], None] | None = None,
    ) -> None:
        """The net that takes this feed's batches (``Net.add_reader``): where
        batches are placed, the model inputs the first batch is checked
        against, whether batches are the caller's to write, and how a stop
        cancels a run inside its model.  Before start."""
        self._place = place
        self.cancel = cancel if cancel is not None else _no_cancel
        self.rebatcher.writable = writable
        self.model_checks = tuple(
            (i, b, model_inputs[b]) for i, b in enumerate(self.blob_names) if model_inputs and b in model_inputs
        )
        self.source.checks_version += 1

    def let_go(self) -> None:
        """The source stopped for good: what the re-batcher still holds (and a
        batch staged for the device queue) is counted as lost and let go.

        An enqueuer thread does this itself when it sees the stop; a feed
        without one (``prefetch=False``) is pumped by its reader's thread,
        which may never call again after a stop, and would keep a big
        batch's buffer (a served source's arena) for as long as the feed
        lives.  Idempotent."""
        with self._lock:
            self._lose_all()

    def release_net(self) -> None:
        """Drop the references to the net once the enqueuer has ended, so a
        discarded Net (and its onnxruntime session) is freed at once rather
        than at the next garbage collection."""
        self._place = _unplaced
        self.cancel = _no_cancel

    def _assemble(self, stats: AssembleStats, *, partial: bool = False) -> Batch | None:
        """Pop one batch and place it on the device; None when none is complete.

        Under the lock.  ``stats`` belongs to the calling thread; ``partial``
        takes whatever is pending (the end of input).
        """
        if not partial and self._boundary is not None and self.rebatcher.pending < self.rebatcher.batch_size:
            return self._epoch_rest(stats)
        t0 = time.perf_counter()
        b = self.rebatcher.pop_partial() if partial else self.rebatcher.pop()
        if b is None:
            return None
        batch = Batch(self._place(b.arrays), b.n)
        stats.enqueue.observe(time.perf_counter() - t0)
        stats.batches += 1
        stats.samples += b.n
        return batch

    def _take(self, queue: Any) -> tuple[bool, bool]:
        """The next chunk from ``queue`` into the re-batcher (under the lock);
        an epoch's end is kept aside instead (see ``_boundary``).  Returns
        (the queue answered, it gave a chunk or an end).

        The chunk itself is not returned: a caller's frame would hold it, and
        a source's stored end or error raised later through that frame keeps
        the frame, and so the chunk (a view of shared memory, maybe), for as
        long as the source lives.
        """
        if self._boundary is not None:
            return False, False
        ok, chunk = queue.get_nowait()
        if ok and chunk is not None:
            if type(chunk) is EpochEnd:
                self._boundary = chunk
            else:
                self.rebatcher.push(chunk)
            return True, True
        return ok, False

    def _epoch_rest(self, stats: AssembleStats) -> Batch | None:
        """At an epoch's end (under the lock): the epoch's last, smaller
        batch, then the end itself."""
        end = self._boundary
        assert end is not None
        left = self.rebatcher.pending
        if left and self.drop_last:
            self.rebatcher.clear()
            self.stats.dropped["drop_last"] += left
            # the net's position passes that batch when run() reports the end
            end = end._replace(dropped=end.dropped + 1)
            logger.info(
                "source %r, net %r: dropped the last partial batch of epoch %d, %d samples (drop_last=True)",
                self.source.name, self.net_name, end.epoch, left,
            )
        elif left:
            return self._assemble(stats, partial=True)
        self._boundary = None
        return end  # type: ignore[return-value]

    # -- the enqueuer thread ---------------------------------------------------
    def run(self) -> None:
        """Body of the enqueuer thread."""
        self._step(None)

    def pump(self, timeout: float) -> None:
        """A feed without an enqueuer (``prefetch=False``): do the enqueuer's
        work in the reader's thread until a batch, the end or an error is on
        the device queue, waiting at most ``timeout`` for the source's next
        chunk (0: never waits).  Never waits for room (see ``__init__``)."""
        deadline = time.monotonic() + timeout
        # One pump at a time: it assembles big batches outside the feed's
        # lock, in order only if nobody else does meanwhile (a consumer that
        # re-attached to an index while its predecessor's sender still reads).
        if not self._pump_lock.acquire(timeout=max(0.0, timeout)):
            return
        try:
            dq = self.device_queue
            while not self._pumped_out and not dq.qsize() and not dq.closed:
                took = self._step(max(0.0, deadline - time.monotonic()), once=True)
                if took is None:
                    self._pumped_out = True
                    self.on_end()
                    return
                if not took and time.monotonic() >= deadline:
                    return
        finally:
            self._pump_lock.release()

    def _step(self, wait: float | None, once: bool = False) -> bool | None:
        """The enqueuer's rounds: take a chunk, queue what it completes, and
        wait up to ``wait`` (None: for ever) when there was none; until the
        feed's stream is over (ended, stopped or failed: returns None), or
        with ``once`` after one round (returns whether it took a chunk).
        ``once``: in the reader's thread (see :meth:`pump`): its own
        interrupts (Ctrl-C) go to it rather than failing the source.
        (One loop here, not a call per round: the enqueuer of a small-batch
        source makes many rounds a second.)"""
        src = self.source
        queue = self._input
        try:
            while True:
                # Take and push under the lock, so chunks enter the re-batcher
                # in queue order whichever thread takes them; wait outside it.
                with self._lock:
                    try:
                        ok, _ = self._take(queue)
                    except SourceStopped as stop:
                        _forget_frames(stop)
                        self._lose_all()
                        return None
                    except EndOfInput as end:
                        _forget_frames(end)
                        ok = False
                        ended = True
                    else:
                        ended = False
                if ended:
                    self._finish()
                    return None
                # Complete batches may be waiting even without a new chunk
                # (the net's thread pushed one it did not use up): prefetch them.
                if not self._drain():
                    return None
                if not ok and not (once and self.device_queue.qsize()):
                    queue.wait_for_item(wait)  # woken by a put or a close
                if once:
                    return ok
        except FetcherError as err:
            _forget_frames(err)
            if not self._aborted:
                # the dealer raised the error at its place in the stream
                # (the source did not abort this feed): what came before it
                # is still handed out
                self._end_with(err)
                return None
            # the source failed; fail() closed our queue with the error
            with self._lock:
                self._lose_all()
            return None
        except (Exception if once else BaseException) as exc:  # our bug or a device error: never hang the net
            logger.exception("enqueuer %s/%s failed", src.name, self.net_name)
            failure = FetcherError(f"source {src.name!r}: enqueuer for net {self.net_name!r} failed: {exc!r}")
            failure.__cause__ = exc
            # As a fetcher error would: the net's other sources and the
            # coordinator (should_stop, join) hear of it.
            lost = self.abort(failure)
            with self._lock:
                # a big batch whose copy raised: its samples are lost too
                lost += self._joining
                self._joining = 0
                self.stats.dropped["error"] += lost
                self._lose_all()
            src.report_failure(failure)
            return None

    def _drain(self, *, final: bool = False) -> bool:
        """Move every complete batch to the device queue; False once it is closed.

        Never blocks holding the lock: the batch waiting for room stays in
        ``_staged``, where the net's thread may take it.
        """
        dq = self.device_queue
        while True:
            cut = None
            with self._lock:
                if self._staged is None:
                    if self.rebatcher.big and (
                        self._boundary is None or self.rebatcher.pending >= self.rebatcher.batch_size
                    ):
                        # A big batch is assembled outside the lock (below):
                        # the net's thread never waits for its copy (a view
                        # copied for Net(writable=True), or placed on a GPU);
                        # only this thread assembles big batches: in order.
                        cut = self.rebatcher.cut()
                        if cut is None:
                            return True
                        self._joining = cut.n
                    else:
                        self._staged = self._assemble(self.stats)
                        if self._staged is None:
                            return True
                        # (an empty queue is expected while flushing the end)
                        if not final and (lagging := self._lagging()) is not None:
                            break
                if cut is None:
                    # staged above, or left by the last pass and not taken
                    # since: never None here (the net takes it under this lock)
                    assert self._staged is not None
                    if dq.put(self._staged, timeout=0):
                        self._staged = None
                        continue
                    if dq.closed:
                        self._lose_all()
                        return False
            if cut is not None:
                t0 = time.perf_counter()
                b = self.rebatcher.join(cut)
                batch = Batch(self._place(b.arrays), b.n)
                self.stats.enqueue.observe(time.perf_counter() - t0)
                self.stats.batches += 1
                self.stats.samples += b.n
                with self._lock:
                    self._joining = 0
                    if self._aborted:
                        self.stats.dropped[self._lost_reason] += b.n
                        self._lose_all()  # and what the rebatcher still holds
                        return False
                    self._staged = batch
                    if not final and (lagging := self._lagging()) is not None:
                        break
                continue
            dq.wait_for_room()  # woken when the net has emptied the queue, or it closes
        # never log holding the lock: a slow handler would hold up the net
        logger.warning(
            "data loading lagging behind: source %r internal queue holds %d chunks (net %r)",
            self.source.name, lagging, self.net_name,
        )
        return self._drain(final=final)

    def _end_with(self, error: FetcherError) -> None:
        """The dealer reached ``error`` in the stream: the complete batches before
        it go to the net, then the error; the incomplete one is dropped."""
        if not self._drain(final=True):
            return
        with self._lock:
            left = self.rebatcher.clear()
            if left:
                self.stats.dropped["error"] += left
            self.device_queue.close(error, after_items=True)

    def _lose_all(self) -> None:
        """The device queue is closed: count what this feed still holds as dropped.  Under the lock.

        Discarded, never assembled: a stop must not copy up to a batch only
        to throw it away.
        """
        reason = self._lost_reason if self._aborted else self.source.lost_reason
        n = self.rebatcher.clear() + (self._staged.n if self._staged is not None else 0)
        self._staged = None
        if n:
            self.stats.dropped[reason] += n

    def _lagging(self) -> int | None:
        """The internal queue's depth when "data loading lagging behind" is
        due (at most once a minute per source; the first minute is warm-up)."""
        src = self.source
        now = time.monotonic()
        if now - src.lagging_warned_at < LAGGING_WARN_S:
            return None
        depth = self._input.qsize()
        if getattr(self._input, "pulled", False):
            # A stream this enqueuer reads from the workers' pipes as it
            # needs them (feeders/pulling) has its results there, not
            # queued: lagging when it spent most of the last minute waiting
            # for a worker (the first look starts the count).
            src.lagging_warned_at = now
            share = self._input.starved_share()  # type: ignore[attr-defined]
            return depth if share is not None and share > 0.5 else None
        if depth < 2:
            src.lagging_warned_at = now
            return depth
        return None

    def _finish(self) -> None:
        """End of input: the leftover becomes one last batch, then the queue ends."""
        if not self._drain(final=True):
            return
        with self._lock:
            left = self.rebatcher.pending
            dropped = bool(left and self.drop_last)
            if dropped:
                self.rebatcher.clear()
                self.stats.dropped["drop_last"] += left
            elif left:
                self._staged = self._assemble(self.stats, partial=True)
        if dropped:
            logger.info(
                "source %r, net %r: dropped a last partial batch of %d samples (drop_last=True)",
                self.source.name, self.net_name, left,
            )
        if not self._drain(final=True):
            return
        self.device_queue.close()

def _forget_frames(err: BaseException) -> None:
    """Drop the traceback a queue's stored end or error got on its way here.

    The instance is the queue's, kept as long as the source is (its
    coordinator keeps it for the metrics' totals); its traceback would keep
    this thread's frames, and through them the feed, the net and its last
    batch (a shared-memory view, maybe).  Whoever it reaches next gets a
    traceback of their own.
    """
    err.__traceback__ = None


def _unplaced(arrays: tuple[np.ndarray, ...]) -> tuple[Any, ...]:
    raise RuntimeError("this feed's enqueuer has ended")


def _no_cancel() -> None:
    pass
