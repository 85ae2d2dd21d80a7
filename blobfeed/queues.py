"""A bounded, closable, thread-safe queue of whole batches."""

from __future__ import annotations

import collections
import queue
import sys
import threading
from typing import Generic, Iterator, NoReturn, TypeVar

from .errors import DequeueTimeout, EndOfInput

__all__ = ["BlobsQueue", "WatermarkQueue"]

T = TypeVar("T")


class BlobsQueue(Generic[T]):
    """A bounded FIFO of whole batches that can be closed from either side.

    Thread-safe: any number of producers and consumers.  Blocked calls wake
    because something woke them (an item, a free slot, ``close``), never by
    polling.

    Closing semantics, as in Caffe2's ``BlobsQueue`` and trio's channels:

    * ``close()`` (end of stream): ``put`` fails fast (returns ``False``);
      readers still get what is queued, then :class:`EndOfInput`.
    * ``close(error)`` (abort): what is queued is discarded and every reader,
      now and later, gets ``error`` raised at once.

    Args:
        capacity: maximum number of queued items, at least 1.
        name: used in error messages and thread dumps.
        low_water: a producer blocked on a full queue is woken once the queue
            has drained to this many items (default ``capacity - 1``: at the
            first free slot).  A lower mark wakes producers less often, each
            time for more work: fewer thread hand-offs per item.
        max_bytes: also bound the bytes queued (each item's size as given to
            :meth:`put_sized`; ``sys.maxsize``: counted, not bounded).  An item
            larger than the bound still goes into an empty queue: a bound
            never refuses an item forever.  None: bytes are not counted.
            Producers blocked on it wake once the bytes drained to half of it
            (and the items to ``low_water``).
    """

    def __init__(
        self, capacity: int, *, name: str = "", low_water: int | None = None, max_bytes: int | None = None
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"BlobsQueue capacity must be an int, got {type(capacity).__name__}")
        if capacity < 1:
            raise ValueError(f"BlobsQueue capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        if low_water is None:
            low_water = capacity - 1
        if not 0 <= low_water < capacity:
            raise ValueError(f"low_water must be in [0, capacity), got {low_water} for capacity {capacity}")
        self._low_water = low_water
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"BlobsQueue max_bytes must be an int >= 1 or None, got {max_bytes!r}")
        self.name = name
        self._items: collections.deque[T] = collections.deque()
        #: with a byte bound: each queued item's bytes, in step with _items
        self._sizes: collections.deque[int] | None = None if max_bytes is None else collections.deque()
        self._bytes = 0
        self._max_bytes = sys.maxsize if max_bytes is None else max_bytes
        self._bytes_low = self._max_bytes // 2
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        # wait_for_item / wait_for_room take nothing, so they must not share
        # get's and put's notify(): one of them could swallow the wake-up a
        # blocked get() or put() needed.  Woken only when someone waits
        # there: all of them while one waits without a timeout (an enqueuer
        # thread); else one per item (the readers that pump, such as the
        # feeding service's senders, all of which wait with a timeout; a
        # watcher sleeps only on an empty queue, so each item put has its
        # own wake-up): a
        # wake-up per item for every waiter cost S1's four senders nine
        # context switches a batch.  One woken that does not take the item
        # (its deadline passed, its net closed) leaves it to the others'
        # next look, at most their timeout later.
        self._item_watch = threading.Condition(self._lock)
        self._room_watch = threading.Condition(self._lock)
        self._item_watchers = 0
        #: of those, the ones waiting without a timeout
        self._item_watchers_unbounded = 0
        self._room_watchers = 0
        self._closed = False
        self._error: BaseException | None = None
        #: raised instead of EndOfInput once drained (close(error, after_items=True))
        self._final: BaseException | None = None
        #: counted where a caller is about to wait anyway (never on the fast
        #: path): producers held back by the byte bound, readers that found
        #: the queue empty (WatermarkQueue's signals)
        self._held = 0
        self._empty = 0

    @property
    def capacity(self) -> int:
        """The bound given at construction."""
        return self._capacity

    @property
    def max_bytes(self) -> int | None:
        """The byte bound (``sys.maxsize``: counted, unbounded), or None."""
        return None if self._sizes is None else self._max_bytes

    def qbytes(self) -> int:
        """Bytes queued now (0 unless the queue counts bytes)."""
        return self._bytes

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def error(self) -> BaseException | None:
        """The error the queue was closed with, if any."""
        return self._error

    # Wait predicates, called with the lock held.
    def _room_or_closed(self) -> bool:
        return self._closed or len(self._items) < self._capacity

    def _item_or_closed(self) -> bool:
        return self._closed or bool(self._items)

    def qsize(self) -> int:
        """Number of items queued now (a snapshot)."""
        return len(self._items)

    def snapshot(self) -> list[T]:
        """A copy of the queued items, oldest first (for metrics and accounting)."""
        with self._lock:
            return list(self._items)

    def put(self, blobs: T, timeout: float | None = None) -> bool:
        """Queue ``blobs``, waiting for a free slot.

        Args:
            blobs: one whole batch (any object; blobfeed queues tuples of arrays).
            timeout: seconds to wait for a slot; ``None`` waits until one frees
                or the queue is closed.

        Returns:
            True once queued; False when the queue is closed (before or while
            waiting) or the timeout passed.
        """
        try:
            with self._not_full:
                if not self._room_or_closed() and not self._not_full.wait_for(self._room_or_closed, timeout):
                    return False
                if self._closed:
                    return False
                self._items.append(blobs)
                if self._sizes is not None:
                    self._sizes.append(0)
                self._not_empty.notify()
                if self._item_watchers:
                    self._wake_item_watchers()
                return True
        except RuntimeError as err:
            raise self._interrupted(err, self._not_full) from None

    def put_many(self, items: list[T]) -> bool:
        """:meth:`put` of each of ``items`` in order, waiting for room as
        each needs it, with one wake-up of a reader for those that went in
        together (not one each).  Returns False once the queue is closed
        (what went in before stays)."""
        not_full, queued, sizes = self._not_full, self._items, self._sizes
        new = 0  # queued since readers were last woken
        try:
            with not_full:
                try:
                    for blobs in items:
                        if len(queued) >= self._capacity and not self._closed:
                            if new:
                                self._wake_readers(new)  # they read what went in meanwhile
                                new = 0
                            not_full.wait_for(self._room_or_closed)
                        if self._closed:
                            return False
                        queued.append(blobs)
                        if sizes is not None:
                            sizes.append(0)
                        new += 1
                    return True
                finally:
                    if new:
                        self._wake_readers(new)
        except RuntimeError as err:
            raise self._interrupted(err, not_full) from None

    def _wake_readers(self, n: int) -> None:
        """(Under the lock.)  ``n`` items went in: wake as many readers."""
        self._not_empty.notify(n)
        if self._item_watchers:
            for _ in range(min(n, self._item_watchers)):
                self._wake_item_watchers()

    def put_sized(self, blobs: T, nbytes: int = 0) -> bool:
        """Queue ``blobs`` of ``nbytes`` bytes, waiting while the queue is full
        in items or would pass its byte bound (an empty queue takes any
        item).  The queue must count bytes (``max_bytes``).

        Returns:
            True once queued; False when the queue is closed (before or while waiting).
        """
        sizes = self._sizes
        if sizes is None:
            raise ValueError(f"queue {self.name!r} counts no bytes (max_bytes=None): use put()")
        with self._not_full:
            items = self._items
            while not self._closed and (
                len(items) >= self._capacity or (self._bytes and self._bytes + nbytes > self._max_bytes)
            ):
                if len(items) < self._capacity:
                    self._held += 1  # held back by the bytes, not the count
                self._not_full.wait()
            if self._closed:
                return False
            items.append(blobs)
            sizes.append(nbytes)
            self._bytes += nbytes
            self._not_empty.notify()
            if self._item_watchers:
                self._wake_item_watchers()
            return True

    def _wake_item_watchers(self) -> None:
        """(Under the lock; someone waits for an item.)  See ``__init__``."""
        if self._item_watchers_unbounded:
            self._item_watch.notify_all()
        else:
            self._item_watch.notify()

    def wait_for_room(self, timeout: float | None = None) -> bool:
        """Wait until a ``put`` would not block (the low-water mark was reached).

        For a producer that must not block while holding a lock of its own:
        try ``put(x, timeout=0)`` under the lock, and on a full queue release
        the lock and wait here.

        Returns:
            True when there is room; False when the queue is closed or the
            timeout passed.
        """
        try:
            with self._lock:
                self._room_watchers += 1
                try:
                    return self._room_watch.wait_for(self._room_or_closed, timeout) and not self._closed
                finally:
                    self._room_watchers -= 1
        except RuntimeError as err:
            raise self._interrupted(err, self._room_watch) from None

    def wait_for_item(self, timeout: float | None = None) -> bool:
        """Wait until an item is queued or the queue is closed, without taking it.

        For a consumer that must take items while holding a lock of its own:
        ``get_nowait()`` under the lock, and on an empty queue release the
        lock and wait here.

        Returns:
            True when an item is queued or the queue is closed (``get_nowait``
            then tells which); False when the timeout passed.
        """
        try:
            with self._lock:
                if not self._items and not self._closed:
                    self._empty += 1
                self._item_watchers += 1
                unbounded = timeout is None
                self._item_watchers_unbounded += unbounded
                try:
                    return self._item_watch.wait_for(self._item_or_closed, timeout)
                finally:
                    self._item_watchers -= 1
                    self._item_watchers_unbounded -= unbounded
        except RuntimeError as err:
            raise self._interrupted(err, self._item_watch) from None

    def get(self, timeout: float | None = None) -> T:
        """Dequeue the oldest batch, waiting for one.

        Args:
            timeout: seconds to wait; ``None`` waits until a batch comes or
                the queue is closed.

        Raises:
            DequeueTimeout: nothing came within ``timeout``.
            EndOfInput: the queue was closed and is drained.
            BaseException: the error given to ``close(error)``.
        """
        try:
            with self._not_empty:
                if not self._item_or_closed():
                    self._empty += 1
                    if not self._not_empty.wait_for(self._item_or_closed, timeout):
                        raise DequeueTimeout(f"queue {self.name!r}: no batch within {timeout:g} s")
                if self._error is not None:
                    # A fresh traceback per raise: the useful one is on __cause__.
                    raise self._error.with_traceback(None)
                if self._items:
                    return self._pop()
                self._raise_drained()
        except RuntimeError as err:
            raise self._interrupted(err, self._not_empty) from None

    def _interrupted(self, err: RuntimeError, cond: threading.Condition) -> BaseException:
        """What to raise for ``err``, escaped from a ``with`` around ``cond.wait``.

        A signal handler's exception (Ctrl-C's KeyboardInterrupt, a SIGTERM
        handler's SystemExit) can land inside ``Condition.wait`` after it
        released the lock and before it guards the re-acquire: the ``with``
        then releases an unlocked lock and Python reports that RuntimeError
        instead.  The program must get its interrupt; the waiter the wait left
        registered is woken, so it cannot swallow a later ``notify``.
        """
        cause = err.__context__
        if cause is None or "unlocked lock" not in str(err):
            return err
        with self._lock:
            cond.notify_all()
        return cause

    def _pop(self) -> T:
        """Take the oldest item (under the lock; there is one) and wake a
        producer once the queue drained to its marks."""
        item = self._items.popleft()
        if self._sizes is not None:
            self._bytes -= self._sizes.popleft()
        if len(self._items) <= self._low_water and self._bytes <= self._bytes_low:
            self._not_full.notify()
            if self._room_watchers:
                self._room_watch.notify_all()
        return item

    def _raise_drained(self) -> NoReturn:
        if self._final is not None:
            raise self._final.with_traceback(None)
        raise EndOfInput(f"queue {self.name!r} is closed and drained")

    def get_nowait(self) -> tuple[bool, T | None]:
        """Dequeue without waiting.

        Returns:
            ``(True, item)``, or ``(False, None)`` when the queue is empty and open.

        Raises:
            EndOfInput / the close error: as :meth:`get`.
        """
        with self._lock:
            if self._error is not None:
                raise self._error.with_traceback(None)
            if self._items:
                return True, self._pop()
            if self._closed:
                self._raise_drained()
            return False, None

    def close(self, error: BaseException | None = None, *, after_items: bool = False) -> list[T]:
        """Close the queue and wake every blocked caller.  Idempotent.

        Args:
            error: ``None`` for end of stream (readers drain, then get
                :class:`EndOfInput`); an exception to abort (queued items are
                discarded and readers get ``error``).  A queue closed without
                error can later be aborted; the first error stands.

        Returns:
            The items discarded by this call (empty unless ``error`` is given).
        """
        with self._lock:
            discarded: list[T] = []
            if after_items:
                if error is not None and self._final is None and self._error is None:
                    self._final = error
            elif error is not None and self._error is None:
                # an error already due after the items stands (a stop after it)
                self._error = self._final if self._final is not None else error
                discarded = list(self._items)
                self._items.clear()
                if self._sizes is not None:
                    self._sizes.clear()
                self._bytes = 0
            self._closed = True
            for cond in (self._not_empty, self._not_full, self._item_watch, self._room_watch):
                cond.notify_all()
            return discarded

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<BlobsQueue {self.name!r} {len(self._items)}/{self._capacity} {state}>"


class WatermarkQueue(BlobsQueue[T]):
    """A :class:`BlobsQueue` with a byte bound that may change while it
    runs (:meth:`set_byte_limit`), and what a policy needs to change it
    (:meth:`take_marks`): ``max_buffered_bytes="auto"``
    (:mod:`blobfeed.buffers`).  A plain ``BlobsQueue`` where the bound is
    fixed: the one step more per item (the lowest fill) is paid only here."""

    def __init__(self, capacity: int, *, name: str = "", low_water: int | None = None, max_bytes: int) -> None:
        super().__init__(capacity, name=name, low_water=low_water, max_bytes=max_bytes)
        #: the fewest bytes queued since the last take_marks()
        self._low_bytes = 0

    def set_byte_limit(self, max_bytes: int) -> None:
        """Bound the bytes queued by ``max_bytes`` from now on (what it holds
        above a lower bound drains as it is taken; a higher one wakes the
        producers it held back)."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"queue {self.name!r}: byte limit must be an int >= 1, got {max_bytes!r}")
        with self._lock:
            grew = max_bytes > self._max_bytes
            self._max_bytes = max_bytes
            self._bytes_low = max_bytes // 2
            if grew:
                self._not_full.notify_all()
                if self._room_watchers:
                    self._room_watch.notify_all()

    def take_marks(self) -> tuple[int, int, int]:
        """``(held, empty, low)``: the producers held back by the byte bound
        and the readers that found it empty, counted since it was made, and
        the fewest bytes it held since the last call (which starts the next
        such span at what it holds now)."""
        with self._lock:
            low, self._low_bytes = self._low_bytes, self._bytes
            return self._held, self._empty, low

    def _pop(self) -> T:
        item = super()._pop()
        if self._bytes < self._low_bytes:
            self._low_bytes = self._bytes
        return item


def drained(q: "queue.SimpleQueue[T]") -> Iterator[T]:
    """What ``q`` holds now, taken without waiting (weakref callbacks put
    the references of what died there: a buffer pool, the service's arena)."""
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return
