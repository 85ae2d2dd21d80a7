"""An input source: the dealer shared by every net fed from one source name
(how chunks reach the nets), the lifecycle of its workers, and each
worker's intake."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Any, Callable, Literal, Protocol, Sequence

import numpy as np

from ..errors import BlobfeedWarning, ChunkError, EndOfInput, FetcherError
from ..stats import FetchStats, MetricsHub
from .chunks import Chunk, ChunkValidator, ModelInput, Pin, Stamped, guess_samples
from .dealing import Dealer, DealingOptions, Reader, make_dealer
from .replay import ReplayMismatch


class FeedEnd(Protocol):
    """What a source needs of each feed (one per net) that takes its chunks."""

    net_name: str
    blob_names: tuple[str, ...]
    drop_last: bool
    model_checks: tuple[tuple[int, str, ModelInput], ...]

    @property
    def batch_size(self) -> int: ...
    def abort(self, error: BaseException) -> int: ...
    def buffered_samples(self) -> int: ...
    def device_queue_depth(self) -> int: ...
    def absorbs(self, sample_bytes: int) -> bool: ...
    @property
    def cuts_batches(self) -> bool: ...

__all__ = ["FeedEnd", "InputSource", "OnError", "SourceStopped", "WorkerIntake"]

logger = logging.getLogger("blobfeed.feeders")

OnError = Literal["raise", "skip"]

#: seconds between two warnings of one worker about calls that gave no chunk
#: (``None``, no samples): one per call was ~25 000 lines a second
SKIP_WARN_INTERVAL_S = 10.0
#: the clock of those warnings (a test moves it by hand)
_clock = time.monotonic


class SourceStopped(EndOfInput):
    """Internal: the source was stopped; enqueuers must not flush leftovers."""


class InputSource:
    """Everything behind one ``input_source_name``: its dealer (how chunks
    reach the nets), the fetchers' lifecycle and the feeds (one per net)
    that share it.

    Args:
        name: the source's name.
        capacity: chunks its dealer may hold (``max_buffered_batches``).
        n_blobs: arrays per chunk.
        axes: each blob's batch axis.
        hub: the metrics hub.
        on_failure: told of the first fetcher error (the coordinator's
            ``should_stop``/``join``).
        dealing: how chunks are dealt (chosen once, here).
        batch_size: the first net's batch size (the source's own, when its
            dealer cuts batches once for every net).
        shuffle_rng: makes the shuffle buffer's generator, if there is one.
        max_bytes: bytes of chunks its dealer may hold (``max_buffered_bytes``;
            None: unbounded).
        dealer: makes the source's dealer instead of ``dealing`` (called
            with the source; a feeding service's consumer end).
        follow_need: ``max_buffered_bytes="auto"``: an arrival-order
            queue's byte limit may change while it runs, within ``max_bytes``.

    Thread-safe.
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        n_blobs: int,
        axes: Sequence[int],
        hub: MetricsHub,
        on_failure: Callable[[BaseException], None] | None = None,
        *,
        dealing: DealingOptions = DealingOptions(),
        batch_size: int = 1,
        shuffle_rng: Callable[[], np.random.Generator] = np.random.default_rng,
        max_bytes: int | None = None,
        dealer: Callable[["InputSource"], Dealer] | None = None,
        follow_need: bool = False,
    ) -> None:
        self.name = name
        self._on_failure = on_failure
        self.dealing = dealing
        # `dealer`: a dealer made elsewhere (a feeding service's consumer end)
        self.dealer: Dealer = dealer(self) if dealer is not None else make_dealer(
            name, dealing, batch_size=batch_size, axes=axes, capacity=capacity,
            shuffle_rng=shuffle_rng, on_error=self.fail, on_error_in_order=self.fail_in_order,
            on_dropped=lambda reason, n: hub.count_dropped(name, reason, n), max_bytes=max_bytes,
            follow_need=follow_need,
        )
        self.max_bytes = max_bytes
        self.n_blobs = n_blobs
        self.axes = tuple(axes)
        self.validator = ChunkValidator(name, [f"#{i}" for i in range(n_blobs)], axes)
        self.feeds: list[FeedEnd] = []
        #: bumped when a feed is added: workers check their next chunk against
        #: the model of a net wired after their first one
        self.checks_version = 0
        #: fetchers stop fetching once this is True.  A plain attribute, not
        #: an Event: request_stop() sets it from a signal handler, where even
        #: an Event's internal lock could be held by the interrupted code.
        self.halted = False
        self.hub = hub
        self._lock = threading.Lock()
        self._fetchers_registered = 0
        #: the workers the source runs on (its wiring calls', then the last
        #: set_num_workers'): the gauge blobfeed_workers
        self.worker_count = 0
        self._fetchers_running = 0
        self._fetchers_finished = 0
        self.error: BaseException | None = None
        self.stopped = False
        #: samples a fetcher holds while blocked putting them (worker id -> n);
        #: each fetcher writes only its own key
        self.inflight: dict[int, int] = {}
        self.lagging_warned_at = time.monotonic()
        #: per worker id, where load_state_dict() says it starts: (calls, state)
        self.resume_at: dict[int, tuple[int, Any]] = {}
        #: per worker id, its calls since its last chunk that returned None or
        #: no samples (each intake writes only its own key; gone once it ends)
        self.empty_runs: dict[int, int] = {}
        #: a BlobfeedWarning said that a fetcher returned None (or no samples)
        self.empty_warned = False
        #: a random-access source's (length, seed, shuffle, read size; None: by bytes): what
        #: its state records and checks; None for a fetch_fun source
        self.random_access: tuple[int, int, bool, int | None] | None = None
        #: a sharded source's (shard count, sizes' digest, shuffle_block); None otherwise
        self.sharded: tuple[int, str, int] | None = None
        hub.attach_source(self)

    @property
    def epochs(self) -> int | None:
        """Passes over the data (None: endless)."""
        return self.dealing.epochs

    def add_workers(self, worker_ids: Sequence[int]) -> None:
        """Wire workers in (before start): ``register_fetchers`` counted them."""
        self.dealer.add_lanes(worker_ids)

    def add_reader(self, prefetch: bool = True) -> Reader:
        """A new net's end of the dealer (before start); ``prefetch``: its
        feed assembles batches ahead of it."""
        return self.dealer.add_net(prefetch)

    # -- fetcher lifecycle -------------------------------------------------
    def register_fetchers(self, n: int) -> None:
        """Count ``n`` more fetchers in; refuses a source that has ended.

        Raises:
            ValueError: the source ended (every fetcher finished), failed or was stopped.
        """
        with self._lock:
            if self.finished or self.error is not None or self.stopped or self.dealer.closed:
                raise ValueError(
                    f"source {self.name!r} has ended; stop_coordinator({self.name!r}) "
                    "before feeding from that name again"
                )
            self._fetchers_registered += n

    def fetcher_started(self) -> None:
        with self._lock:
            self._fetchers_running += 1

    def fetcher_finished(self, exhausted: bool) -> None:
        """A fetcher thread ends; when the last one of the source raised
        StopIteration the stream ends after what is queued."""
        with self._lock:
            self._fetchers_running -= 1
            if exhausted:
                self._fetchers_finished += 1
            last = self._fetchers_finished == self._fetchers_registered
        if last and exhausted:
            logger.info("source %r: every fetcher finished; draining", self.name)
            self.dealer.end_of_input()

    def fetcher_left(self) -> None:
        """A fetcher removed while the source runs (``set_num_workers``)
        ended without StopIteration: it no longer counts among those whose
        end the source waits for; when every other one has finished already,
        the stream ends after what is queued."""
        with self._lock:
            self._fetchers_running -= 1
            self._fetchers_registered -= 1
            last = 0 < self._fetchers_finished == self._fetchers_registered
        if last:
            logger.info("source %r: every fetcher finished; draining", self.name)
            self.dealer.end_of_input()

    @property
    def finished(self) -> bool:
        """True once every fetcher raised StopIteration."""
        return self._fetchers_registered > 0 and self._fetchers_finished == self._fetchers_registered

    def workers_alive(self) -> int:
        return self._fetchers_running

    def queue_depth(self) -> int:
        return self.dealer.queued()

    def queue_capacity(self) -> int:
        return self.dealer.capacity

    def queue_bytes(self) -> int:
        """Bytes of the chunks waiting in the dealer (``max_buffered_bytes`` bounds them)."""
        return self.dealer.queued_bytes()

    def queue_byte_limit(self) -> int | None:
        """The bound on those bytes in force now: ``max_buffered_bytes``, or
        under ``"auto"`` in arrival order the working limit (:mod:`blobfeed.buffers`)."""
        limit = getattr(self.dealer, "byte_limit", None)
        return limit() if limit is not None else self.max_bytes

    # -- ending --------------------------------------------------------------
    def fail(self, error: BaseException, *, in_order: bool = False) -> None:
        """on_error="raise": abort the source; every net gets ``error``.

        ``in_order`` (deterministic=True: the stream reached a worker's
        error): the batches before it are still handed out, then the error;
        only what the workers fetched past it is dropped.
        """
        with self._lock:
            if self.error is not None or self.stopped:
                return
            self.error = error
        # the text, not the error: a kept log record (a memory handler) would
        # keep the error, and with it the frames of every run() that raised
        # it (the net, its last batch: a served source's shared memory)
        logger.error("source %r stopped by a fetcher error: %s", self.name, str(error))
        self.halted = True
        lost = 0
        if not in_order:
            # the feeds first: once the dealer raises the error, a feed must
            # find itself aborted, not take it for an error at its place in
            # the stream (and hand out what it holds before it)
            for feed in list(self.feeds):
                lost += feed.abort(error)
        lost += self.dealer.close(error, in_order=in_order)
        self.hub.count_dropped(self.name, "error", lost)
        self.hub.source_ended(self.name)
        if self._on_failure is not None:
            self._on_failure(error)

    def fail_in_order(self, error: BaseException) -> None:
        """The lane dealer's callback: ``fail(error, in_order=True)``."""
        self.fail(error, in_order=True)

    def stop(self) -> None:
        """Stop fetchers and enqueuers; queued data is discarded. Idempotent."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
        self.halted = True
        lost = self.dealer.close(SourceStopped(f"source {self.name!r} was stopped"))
        for feed in list(self.feeds):
            lost += feed.abort(EndOfInput(f"source {self.name!r} was stopped"))
        self.hub.count_dropped(self.name, "stopped", lost)
        self.hub.source_ended(self.name)

    def add_feed(self, feed: FeedEnd) -> None:
        """A net starts taking this source's chunks."""
        self.feeds.append(feed)
        self.checks_version += 1

    def lets_go_at_once(self, sample_bytes: int) -> bool:
        """Whether a chunk of samples of ``sample_bytes`` is let go as soon as
        a reader takes it, whatever the other chunks do: the dealer hands
        chunks out as they come (nothing waits for one worker's next chunk)
        and every feed copies each piece into a big batch at once.  A worker
        process's chunk then need not be copied out of its slot to keep the
        worker going (see ``slot_ring.SlotRing.hold``)."""
        feeds = list(self.feeds)
        return (
            bool(feeds) and self.dealing.in_arrival_order
            and all(f.absorbs(sample_bytes) for f in feeds)
        )

    def whole_batch_size(self) -> int:
        """The size of the batches a worker process may assemble from its
        own chunks (see ``worker_batches``), 0 when it may not: the dealer
        hands chunks out as they come (so which samples share a batch was
        never promised), and every feed cuts batches of that one size along
        axis 0."""
        feeds = list(self.feeds)
        if not feeds or not self.dealing.in_arrival_order or any(self.axes):
            return 0
        size = feeds[0].batch_size
        for f in feeds:
            if f.batch_size != size or not f.cuts_batches:
                return 0
        return size

    def report_failure(self, error: BaseException) -> None:
        """Tell the coordinator (``should_stop``/``join``) of an error that
        ended a feed of this source without failing the source."""
        if self._on_failure is not None:
            self._on_failure(error)

    def model_checks(self) -> list[tuple[int, str, ModelInput]]:
        """What a worker's first chunk is checked against: every model input
        that a blob of this source feeds, in every net the source feeds."""
        return [c for f in list(self.feeds) for c in f.model_checks]

    @property
    def lost_reason(self) -> str:
        """Why data still inside blobfeed will never reach a net now."""
        return "error" if self.error is not None else "stopped"

    def starved_hint(self) -> str:
        """What a ``DequeueTimeout`` adds when every worker still fetching
        has only returned ``None`` (or chunks with no samples) since its last
        chunk, "" otherwise: a user with logging off learns why nothing came."""
        runs = list(self.empty_runs.values())
        if not runs or not all(runs):
            return ""
        return (
            f"; its fetchers' last {sum(runs)} calls returned None (or no samples), which only "
            "skips a call: a fetch_fun ends its worker by raising StopIteration"
        )

    def sibling_hint(self, reader: Reader) -> str:
        """What a ``DequeueTimeout`` (and the "data input is slow" warning)
        adds when the net of ``reader`` waits because a sibling net has not
        taken its batches: a source that deals its batches to its nets in
        turn cannot go on past a net's batch until that net runs, so nets
        drained one after the other from one thread wait for ever.  "" when
        that is not why."""
        stalled_by = getattr(self.dealer, "stalled_by", None)
        stalled = None if stalled_by is None else stalled_by(reader)
        if stalled is None:
            return ""
        index, dealt = stalled
        feeds = list(self.feeds)
        if index >= len(feeds):  # pragma: no cover - a feed is wired with its outbox
            return ""
        # outboxes are made in wiring order, as the feeds are added
        holder = feeds[index]
        names = [f.net_name for f in feeds]
        batch = self.dealer.batch_size or 1
        ready = holder.device_queue_depth() + -(-dealt // batch)
        return (
            f"; the data is there: source {self.name!r} deals its batches to its {len(feeds)} nets "
            f"{names} in turn (batch i to net i mod {len(feeds)}: deterministic, shuffle_buffer, "
            f"epochs or equal), and its next batch goes to net {holder.net_name!r}, which holds "
            f"{ready} batch{'' if ready == 1 else 'es'} its run() has not taken. Take the nets' "
            "batches in turn (one run() of each net per step), or run each net from its own thread"
        )

    # -- metrics -------------------------------------------------------------
    def device_queue_depths(self) -> list[tuple[str, int]]:
        return [(f.net_name, f.device_queue_depth()) for f in list(self.feeds)]

    def buffered_samples(self) -> int:
        total = self.dealer.stats().held_samples + sum(list(self.inflight.values()))
        for f in list(self.feeds):
            total += f.buffered_samples()
        return total


class WorkerIntake:
    """The source's end of one worker, whatever runs it (thread, process, actor).

    Every backend hands what the worker's ``fetch_fun`` produced to its
    intake: a result is validated, counted and queued (blocking while the
    internal queue is full: that is the backpressure); an exception or a
    malformed chunk fails the source or is skipped, as ``on_error`` says.
    One writer: the thread that runs the worker, or that receives from it.
    """

    def __init__(
        self,
        source: InputSource,
        worker_id: int,
        blob_names: Sequence[str],
        on_error: OnError,
        stats: FetchStats,
        backend: str,
    ) -> None:
        self.source = source
        self.worker_id = worker_id
        self.blob_names = tuple(blob_names)
        self.on_error = on_error
        self.stats = stats
        self.backend = backend
        #: index of the next fetch_fun call (the ``seq`` of its chunk)
        self.calls = 0
        #: set (a plain store) when ``set_num_workers`` removes this worker
        #: from a running fetch_fun source: it makes no further call, hands
        #: over what it holds and leaves without ending the source's data
        self.retired = False
        #: where this worker's chunks go (the dealer's, chosen per worker once)
        self._put = source.dealer.sink(worker_id)
        #: the source's checks_version this worker's chunks were checked at
        self._checked_at = -1
        #: calls since the last chunk that gave none (None, no samples)
        self._empty_run = 0
        #: per kind ("none", "empty"): such calls not yet told in a warning,
        #: and when the next warning may be
        self._unwarned = {"none": 0, "empty": 0}
        self._warn_at = {"none": 0.0, "empty": 0.0}
        self._where = f"source {source.name!r}, worker {worker_id}"

    @property
    def halted(self) -> bool:
        """True once the source stopped or failed: the worker should stop fetching."""
        return self.source.halted

    def started(self) -> None:
        self.source.fetcher_started()

    def epoch_ended(self, state: Any = None) -> bool:
        """The worker's ``fetch_fun`` raised StopIteration and it goes on with
        the next epoch (its calls count from 0 again; ``state``: a stateful
        fetcher's state after the StopIteration).  Returns False when the
        worker must stop instead."""
        self.calls = 0
        return self.source.dealer.end_epoch(self.worker_id, state)

    def stop_asked(self) -> bool:
        """Whether the worker should make no further call: the source
        stopped or failed, or this worker was removed (:attr:`retired`)."""
        return self.retired or self.source.halted

    def finished(self, exhausted: bool) -> None:
        """The worker ended; ``exhausted``: by StopIteration (its data is done)."""
        self.source.inflight.pop(self.worker_id, None)
        self.source.empty_runs.pop(self.worker_id, None)
        if exhausted:
            self.source.dealer.finish(self.worker_id)
        if self.retired and not exhausted:
            self.source.fetcher_left()
        else:
            self.source.fetcher_finished(exhausted)

    def result(self, raw: Any, pin: Pin | None = None, transport_bytes: int = 0, calls: int = 1) -> bool:
        """One value ``fetch_fun`` returned (or, ``calls`` other than 1, a
        batch a worker process assembled from the values of that many
        calls).  Returns False when the worker must stop."""
        src = self.source
        stats = self.stats
        seq = self.calls
        self.calls = seq + calls
        state = None
        if type(raw) is Stamped:
            raw, state = raw
        if transport_bytes:
            stats.transport_bytes[self.backend] += transport_bytes
        try:
            # The first chunk of each worker is checked against the model;
            # later ones must match the source's layout, so one check covers them.
            chunk = src.validator.check(
                raw, self.worker_id, self.blob_names,
                None if self._checked_at == src.checks_version else src.model_checks(), seq, pin,
            )
        except ChunkError as err:
            stats.errors["invalid"] += 1
            if self.on_error == "skip":
                stats.skipped_samples += guess_samples(raw, src.axes)
                logger.warning("%s; chunk skipped (on_error='skip')", err)
                return True
            src.dealer.put_error(self.worker_id, err)
            return False
        if isinstance(chunk, str):
            stats.errors[chunk] += 1
            return self._skipped_empty(chunk)
        if self._empty_run:
            self._empty_run = 0
            src.empty_runs[self.worker_id] = 0
        self._checked_at = src.checks_version
        stats.chunks += calls
        stats.samples += chunk.n
        nbytes = 0
        for a in chunk.arrays:  # a loop, not sum(genexpr): no frame per chunk
            nbytes += a.nbytes
        stats.bytes += nbytes
        inflight = src.inflight
        inflight[self.worker_id] = chunk.n
        if state is not None:  # (not _replace: twice the calls, per chunk)
            chunk = Chunk(chunk.arrays, chunk.n, chunk.worker_id, chunk.seq, chunk.pin, state)
        ok = self._put(chunk, nbytes)
        inflight[self.worker_id] = 0
        if not ok:
            stats.dropped[src.lost_reason] += chunk.n
        return ok

    def _skipped_empty(self, kind: str) -> bool:
        """A call returned ``None`` or no samples (``kind``): skipped, and
        warned of at most once per kind per ``SKIP_WARN_INTERVAL_S``, with
        the count.  Returns False when the worker must stop (the program's
        warning filters turned the warning into an error)."""
        self._empty_run += 1
        src = self.source
        src.empty_runs[self.worker_id] = self._empty_run
        if not src.empty_warned and not self._warn_once(kind):
            return False
        self._unwarned[kind] += 1
        now = _clock()
        if now < self._warn_at[kind]:
            return True
        self._warn_at[kind] = now + SKIP_WARN_INTERVAL_S
        n, self._unwarned[kind] = self._unwarned[kind], 0
        logger.warning(
            "%s: fetch_fun returned %s; skipped (%d such call%s since the last warning, %d since "
            "the last chunk; at most one warning per %.0f s). Returning None only skips a call: "
            "raise StopIteration to end the worker",
            self._where, "None" if kind == "none" else "a chunk with no samples", n,
            "" if n == 1 else "s", self._empty_run, SKIP_WARN_INTERVAL_S,
        )
        return True

    def _warn_once(self, kind: str) -> bool:
        """The first call of the source's fetchers that gave no chunk: a
        :class:`~blobfeed.BlobfeedWarning`, shown on stderr even when the
        program set up no logging (the ``blobfeed`` logger has only a
        NullHandler), because a fetch_fun that returns None at the end of its
        data otherwise waits out the consumer's timeout without a word."""
        src = self.source
        with src._lock:
            if src.empty_warned:
                return True
            src.empty_warned = True
        what = "None" if kind == "none" else "a chunk with no samples"
        try:
            warnings.warn(
                f"{self._where}: fetch_fun returned {what}, which only skips the call: the worker "
                "calls it again (slowed down while it returns no data). If its data is done, raise "
                "StopIteration to end the worker. (Said once per source; later such calls are "
                "logged under the 'blobfeed' logger, and counted in "
                f"blobfeed_fetch_errors_total{{kind=\"{kind}\"}})",
                BlobfeedWarning, stacklevel=2,
            )
        except Exception as exc:  # the program's filters made it an error ("-W error")
            err = FetcherError(f"{self._where}: {exc}")
            err.__cause__ = exc
            src.dealer.put_error(self.worker_id, err)
            return False
        return True

    def exception(self, exc: BaseException, *, fatal: bool = False, remote_tb: str | None = None) -> bool:
        """``fetch_fun`` raised ``exc`` (``fatal``: starting the worker failed:
        ``worker_init_fun`` raised, or a worker process could not load ``fetch_fun``)
        (in another process: ``remote_tb`` is its traceback there).

        Returns True when the worker carries on (``on_error="skip"``).
        """
        self.calls += 1
        self.stats.errors["exception"] += 1
        if self.halted:
            return False
        what = ("resuming the worker at the saved position failed" if isinstance(exc, ReplayMismatch)
                else "starting the worker failed" if fatal else "fetch_fun raised")
        err = FetcherError(f"{self._where}: {what}: {exc!r}")
        err.__cause__ = exc
        if remote_tb is not None:
            note = f"traceback in the worker ({self.backend}):\n{remote_tb.rstrip()}"
            if hasattr(err, "add_note"):
                err.add_note(note)
            else:  # Python 3.10
                err.args = (f"{err.args[0]}\n{note}",)
        # BaseException too: a worker dying silently would leave the consumer
        # waiting for its timeout instead of seeing the cause.
        if self.on_error == "skip" and not fatal and isinstance(exc, Exception):
            logger.warning("%s; skipped (on_error='skip')", err, exc_info=exc)
            return True
        # the dealer fails the source at once, or where the error has its
        # place in the stream (after the batches before it)
        self.source.dealer.put_error(self.worker_id, err)
        return False

    def died(self, detail: str, when: str = "") -> None:
        """The worker ended other than by returning (killed, crashed, lost):
        always an error of the source, whatever ``on_error`` says.  ``when``
        (" while importing ...") follows "died" in the message."""
        self.stats.deaths[self.backend] += 1
        if self.halted:
            return
        self.source.fail(FetcherError(f"{self._where} died{when}: {detail}"))
