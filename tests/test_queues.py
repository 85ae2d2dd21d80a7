"""BlobsQueue: FIFO order, bounded blocking, timeouts and every close order.

Every wait is bounded: queue calls made from the test thread carry a timeout,
helper threads are daemons joined with a timeout and then checked dead.
Threads are named ``blobfeed-test-...`` so the autouse leak check in
conftest.py covers them too.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Any, Callable

import pytest

import blobfeed
from blobfeed import BlobsQueue, DequeueTimeout, EndOfInput

#: Upper bound of every wait; nothing should get near it.
WAIT = 5.0
#: A timeout meant to expire (kept short so the suite stays fast).
SHORT = 0.05


class Call:
    """Runs ``fn()`` on a named daemon thread and records how it ended."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.started = threading.Event()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self._fn = fn
        self.thread = threading.Thread(target=self._run, name=f"blobfeed-test-{name}", daemon=True)
        self.thread.start()
        assert self.started.wait(WAIT), f"{self.thread.name} never started"

    def _run(self) -> None:
        self.started.set()
        try:
            self.result = self._fn()
        except BaseException as exc:  # re-checked by the test
            self.error = exc
        finally:
            self.done.set()

    def join(self) -> None:
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), f"{self.thread.name} is still blocked"


def wait_until_parked(call: Call, method: str) -> None:
    """Return once ``call``'s thread is parked inside ``BlobsQueue.<method>``.

    Parked means: a ``BlobsQueue.<method>`` frame is on its stack and its
    innermost Python frame is a ``threading`` wait (Condition/Event).  This
    waits for an observable state, bounded by WAIT; the short sleep between
    looks is only a yield, never the synchronisation itself.  It makes the
    "wakes when ..." tests prove a wake-up instead of racing past the block.
    """
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        assert not call.done.is_set(), f"{call.thread.name} returned instead of blocking"
        frame = sys._current_frames().get(call.thread.ident)  # type: ignore[arg-type]
        innermost = frame
        in_method = False
        while frame is not None:
            code = frame.f_code
            if code.co_name == method and frame.f_globals.get("__name__") == "blobfeed.queues":
                in_method = True
                break
            frame = frame.f_back
        if in_method and innermost is not None and innermost.f_globals.get("__name__") == "threading":
            return
        time.sleep(0.001)
    raise AssertionError(f"{call.thread.name} never blocked in BlobsQueue.{method}")


def full_queue(capacity: int = 2) -> BlobsQueue[Any]:
    q: BlobsQueue[Any] = BlobsQueue(capacity, name="full")
    for i in range(capacity):
        assert q.put(i, timeout=WAIT)
    assert q.qsize() == capacity
    return q


def drain(q: BlobsQueue[Any]) -> list[Any]:
    """Everything a reader gets until EndOfInput (each get bounded)."""
    out = []
    while True:
        try:
            out.append(q.get(timeout=WAIT))
        except EndOfInput:
            return out


# --------------------------------------------------------------------------- basics


def test_fifo_order() -> None:
    q: BlobsQueue[Any] = BlobsQueue(10)
    items = [("a", 1), ("b", 2), None, 3.5, ("c", 4)]
    for item in items:
        assert q.put(item, timeout=WAIT) is True
    assert [q.get(timeout=WAIT) for _ in items] == items


def test_fifo_order_interleaved_puts_and_gets() -> None:
    q: BlobsQueue[int] = BlobsQueue(3)
    out = []
    nxt = 0
    for _ in range(20):
        while q.qsize() < q.capacity:
            assert q.put(nxt, timeout=WAIT)
            nxt += 1
        out.append(q.get(timeout=WAIT))
    while q.qsize():
        out.append(q.get(timeout=WAIT))
    assert out == list(range(nxt))


def test_capacity_qsize_closed() -> None:
    q: BlobsQueue[int] = BlobsQueue(3, name="props")
    assert q.capacity == 3
    assert q.qsize() == 0
    assert q.closed is False
    q.put(1, timeout=WAIT)
    q.put(2, timeout=WAIT)
    assert q.qsize() == 2
    q.get(timeout=WAIT)
    assert q.qsize() == 1
    q.close()
    assert q.closed is True
    assert q.capacity == 3
    assert q.qsize() == 1  # close() keeps what is queued for the readers


def test_queue_is_exported() -> None:
    assert blobfeed.BlobsQueue is BlobsQueue


@pytest.mark.parametrize(
    ("capacity", "exc"),
    [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError), (None, TypeError)],
)
def test_bad_capacity(capacity: Any, exc: type[Exception]) -> None:
    with pytest.raises(exc, match="capacity"):
        BlobsQueue(capacity)


def test_capacity_one_is_valid() -> None:
    q: BlobsQueue[str] = BlobsQueue(1)
    assert q.put("x", timeout=WAIT)
    assert q.put("y", timeout=SHORT) is False
    assert q.get(timeout=WAIT) == "x"


# --------------------------------------------------------------------------- timeouts


def test_put_timeout_on_full_queue_returns_false() -> None:
    q = full_queue(2)
    t0 = time.monotonic()
    assert q.put("late", timeout=SHORT) is False
    elapsed = time.monotonic() - t0
    assert SHORT * 0.9 <= elapsed < WAIT
    assert q.qsize() == 2
    assert q.put("late", timeout=0) is False
    # Nothing of the failed puts got in.
    assert [q.get(timeout=WAIT), q.get(timeout=WAIT)] == [0, 1]
    with pytest.raises(DequeueTimeout):
        q.get(timeout=0)


def test_put_with_timeout_succeeds_when_room() -> None:
    q: BlobsQueue[int] = BlobsQueue(1)
    assert q.put(7, timeout=0) is True
    assert q.get(timeout=0) == 7


def test_get_timeout_raises_dequeue_timeout() -> None:
    q: BlobsQueue[Any] = BlobsQueue(2, name="slow")
    t0 = time.monotonic()
    with pytest.raises(DequeueTimeout) as info:
        q.get(timeout=SHORT)
    elapsed = time.monotonic() - t0
    assert SHORT * 0.9 <= elapsed < WAIT
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, blobfeed.BlobfeedError)
    with pytest.raises(TimeoutError):
        q.get(timeout=0)
    # A timeout leaves the queue usable.
    assert q.put("x", timeout=WAIT)
    assert q.get(timeout=WAIT) == "x"


# --------------------------------------------------------------------------- blocking put


@pytest.mark.parametrize("timeout", [None, WAIT], ids=["no-timeout", "with-timeout"])
def test_put_blocks_when_full_and_wakes_when_slot_frees(timeout: float | None) -> None:
    q = full_queue(2)
    call = Call(lambda: q.put("blocked", timeout=timeout), "put")
    try:
        wait_until_parked(call, "put")
        assert not call.done.is_set()
        assert q.qsize() == 2
        assert q.get(timeout=WAIT) == 0  # frees one slot
        assert call.done.wait(WAIT), "put did not wake when a slot freed"
        call.join()
        assert call.error is None
        assert call.result is True
        assert [q.get(timeout=WAIT), q.get(timeout=WAIT)] == [1, "blocked"]
    finally:
        q.close(RuntimeError("test cleanup"))  # releases the thread if an assert failed
        call.join()


def test_get_blocks_when_empty_and_wakes_on_put() -> None:
    q: BlobsQueue[str] = BlobsQueue(2)
    call = Call(lambda: q.get(timeout=WAIT), "get")
    try:
        wait_until_parked(call, "get")
        assert q.put("item", timeout=WAIT)
        assert call.done.wait(WAIT), "get did not wake on put"
        call.join()
        assert call.error is None
        assert call.result == "item"
        assert q.qsize() == 0
    finally:
        q.close(RuntimeError("test cleanup"))
        call.join()


# --------------------------------------------------------------------------- close()


def test_close_put_returns_false() -> None:
    q: BlobsQueue[int] = BlobsQueue(3)
    q.put(1, timeout=WAIT)
    assert q.close() == []
    assert q.put(2, timeout=WAIT) is False
    assert q.put(2, timeout=None) is False  # fails fast, does not block
    assert q.put(2, timeout=0) is False
    assert q.qsize() == 1


@pytest.mark.parametrize("timeout", [None, WAIT], ids=["no-timeout", "with-timeout"])
def test_close_wakes_every_blocked_put_with_false(timeout: float | None) -> None:
    q = full_queue(2)
    calls = [Call(lambda i=i: q.put(f"blocked{i}", timeout=timeout), f"put{i}") for i in range(3)]
    try:
        for call in calls:
            wait_until_parked(call, "put")
        q.close()
        for call in calls:
            assert call.done.wait(WAIT), "a put blocked on a full queue did not wake on close()"
            call.join()
            assert call.error is None
            assert call.result is False
        # The blocked items never got in; the queued ones are still readable.
        assert drain(q) == [0, 1]
    finally:
        q.close(RuntimeError("test cleanup"))
        for call in calls:
            call.join()


def test_close_readers_drain_then_end_of_input() -> None:
    q: BlobsQueue[str] = BlobsQueue(5, name="drain")
    for item in "abc":
        q.put(item, timeout=WAIT)
    q.close()
    assert q.get(timeout=WAIT) == "a"
    assert q.get(timeout=0) == "b"
    assert q.get(timeout=None) == "c"  # closed: never blocks
    for timeout in (WAIT, 0, None):  # no hang after exhaustion, every time
        with pytest.raises(EndOfInput):
            q.get(timeout=timeout)


def test_end_of_input_is_not_a_timeout() -> None:
    q: BlobsQueue[int] = BlobsQueue(1)
    q.close()
    with pytest.raises(EndOfInput) as info:
        q.get(timeout=WAIT)
    assert not isinstance(info.value, TimeoutError)
    assert isinstance(info.value, blobfeed.BlobfeedError)


@pytest.mark.parametrize("timeout", [None, WAIT], ids=["no-timeout", "with-timeout"])
def test_close_wakes_blocked_readers_with_end_of_input(timeout: float | None) -> None:
    q: BlobsQueue[Any] = BlobsQueue(2)
    calls = [Call(lambda: q.get(timeout=timeout), f"get{i}") for i in range(3)]
    try:
        for call in calls:
            wait_until_parked(call, "get")
        t0 = time.monotonic()
        q.close()
        for call in calls:
            assert call.done.wait(WAIT), "a reader blocked in get() did not wake on close()"
            call.join()
            assert isinstance(call.error, EndOfInput), call.error
        assert time.monotonic() - t0 < WAIT / 2  # woken by close, not by its own timeout
    finally:
        q.close(RuntimeError("test cleanup"))
        for call in calls:
            call.join()


def test_close_is_idempotent() -> None:
    q: BlobsQueue[int] = BlobsQueue(3)
    q.put(1, timeout=WAIT)
    q.put(2, timeout=WAIT)
    assert q.close() == []
    assert q.close() == []
    assert q.closed
    assert drain(q) == [1, 2]
    assert q.close() == []
    with pytest.raises(EndOfInput):
        q.get(timeout=WAIT)


# --------------------------------------------------------------------------- close(error)


def test_close_error_discards_queued_and_returns_them() -> None:
    q: BlobsQueue[str] = BlobsQueue(5)
    for item in "abc":
        q.put(item, timeout=WAIT)
    err = RuntimeError("boom")
    assert q.close(err) == ["a", "b", "c"]
    assert q.closed
    assert q.qsize() == 0
    assert q.put("d", timeout=WAIT) is False
    for timeout in (WAIT, 0, None):  # raised at once, every time
        with pytest.raises(RuntimeError, match="boom") as info:
            q.get(timeout=timeout)
        assert info.value is err


def test_close_error_custom_exception_type_reaches_reader() -> None:
    class Custom(Exception):
        pass

    q: BlobsQueue[int] = BlobsQueue(1)
    q.put(1, timeout=WAIT)
    err = Custom("source 'train' failed")
    q.close(err)
    with pytest.raises(Custom, match="source 'train' failed") as info:
        q.get(timeout=WAIT)
    assert info.value is err


@pytest.mark.parametrize("timeout", [None, WAIT], ids=["no-timeout", "with-timeout"])
def test_close_error_wakes_every_blocked_reader_with_it(timeout: float | None) -> None:
    q: BlobsQueue[Any] = BlobsQueue(2)
    calls = [Call(lambda: q.get(timeout=timeout), f"get{i}") for i in range(3)]
    err = ValueError("fetcher exploded")
    try:
        for call in calls:
            wait_until_parked(call, "get")
        assert q.close(err) == []
        for call in calls:
            assert call.done.wait(WAIT), "a reader blocked in get() did not wake on close(error)"
            call.join()
            assert call.error is err
        # Later readers get it too, at once.
        with pytest.raises(ValueError, match="fetcher exploded"):
            q.get(timeout=WAIT)
    finally:
        q.close(RuntimeError("test cleanup"))
        for call in calls:
            call.join()


def test_close_error_wakes_blocked_put_with_false() -> None:
    q = full_queue(1)
    call = Call(lambda: q.put("blocked", timeout=None), "put")
    try:
        wait_until_parked(call, "put")
        assert q.close(RuntimeError("abort")) == [0]
        assert call.done.wait(WAIT)
        call.join()
        assert call.error is None
        assert call.result is False
        assert q.qsize() == 0
    finally:
        q.close(RuntimeError("test cleanup"))
        call.join()


def test_first_error_stands() -> None:
    q: BlobsQueue[int] = BlobsQueue(3)
    q.put(1, timeout=WAIT)
    first, second = RuntimeError("first"), RuntimeError("second")
    assert q.close(first) == [1]
    assert q.close(second) == []
    assert q.close() == []
    with pytest.raises(RuntimeError, match="first") as info:
        q.get(timeout=WAIT)
    assert info.value is first


def test_close_then_close_error_aborts_and_discards() -> None:
    """Documented: a queue closed without error can later be aborted."""
    q: BlobsQueue[int] = BlobsQueue(3)
    q.put(1, timeout=WAIT)
    q.put(2, timeout=WAIT)
    assert q.close() == []
    err = RuntimeError("stopped")
    assert q.close(err) == [1, 2]
    with pytest.raises(RuntimeError, match="stopped"):
        q.get(timeout=WAIT)


# --------------------------------------------------------------------------- contention


def test_many_producers_and_consumers_deliver_every_item_exactly_once() -> None:
    n_producers, per_producer, n_consumers = 4, 2000, 3
    q: BlobsQueue[tuple[int, int]] = BlobsQueue(8, name="contention")
    start = threading.Barrier(n_producers + n_consumers, timeout=WAIT)
    got: list[list[tuple[int, int]]] = [[] for _ in range(n_consumers)]
    rejected: list[tuple[int, int]] = []

    def produce(p: int) -> None:
        start.wait()
        for i in range(per_producer):
            if not q.put((p, i), timeout=WAIT):
                rejected.append((p, i))

    def consume(c: int) -> None:
        start.wait()
        while True:
            try:
                got[c].append(q.get(timeout=WAIT))
            except EndOfInput:
                return

    producers = [Call(lambda p=p: produce(p), f"producer{p}") for p in range(n_producers)]
    consumers = [Call(lambda c=c: consume(c), f"consumer{c}") for c in range(n_consumers)]
    try:
        for call in producers:
            call.join()
            assert call.error is None, call.error
        q.close()  # end of stream once every producer is done
        for call in consumers:
            call.join()
            assert call.error is None, call.error
    finally:
        q.close(RuntimeError("test cleanup"))
        for call in producers + consumers:
            call.join()

    assert rejected == []
    everything = [item for items in got for item in items]
    counts = collections.Counter(everything)
    expected = {(p, i) for p in range(n_producers) for i in range(per_producer)}
    assert set(counts) == expected, "items lost"
    assert max(counts.values()) == 1, "items duplicated"
    assert len(everything) == n_producers * per_producer
    # FIFO: what one consumer sees of one producer comes in production order.
    for items in got:
        for p in range(n_producers):
            seq = [i for (pp, i) in items if pp == p]
            assert seq == sorted(seq)
    assert q.qsize() == 0


def test_wait_helpers_never_swallow_a_wakeup_meant_for_get_or_put() -> None:
    """wait_for_item()/wait_for_room() take nothing; a blocked get() or put()
    must still wake when an item or a slot arrives while one of them waits."""
    q: BlobsQueue[str] = BlobsQueue(1, name="mixed")
    watch = Call(lambda: q.wait_for_item(timeout=WAIT), "watch-item")
    wait_until_parked(watch, "wait_for_item")
    getter = Call(lambda: q.get(timeout=WAIT), "get")
    wait_until_parked(getter, "get")
    assert q.put("item", timeout=WAIT)
    getter.join()
    assert (getter.error, getter.result) == (None, "item")
    # the getter took the item, so the watcher rightly waits on; a close releases it
    q.close()
    watch.join()
    assert watch.result is True

    full: BlobsQueue[str] = BlobsQueue(1, name="full")
    assert full.put("x")
    room = Call(lambda: full.wait_for_room(timeout=WAIT), "watch-room")
    wait_until_parked(room, "wait_for_room")
    putter = Call(lambda: full.put("y", timeout=WAIT), "put")
    wait_until_parked(putter, "put")
    assert full.get(timeout=WAIT) == "x"
    putter.join()
    assert (putter.error, putter.result) == (None, True)
    # the put took the slot, so the watcher waits on until the next get frees one
    assert full.get(timeout=WAIT) == "y"
    room.join()
    assert room.result is True


@pytest.mark.parametrize("wait", ["get", "put", "wait_for_item", "wait_for_room"])
def test_ctrl_c_between_a_wait_releasing_the_lock_and_waiting_is_a_keyboard_interrupt(wait: str) -> None:
    """Ctrl-C lands in the main thread between any two bytecodes, also inside
    Condition.wait after it released the lock and before its ``try``: the
    ``with`` block then releases an unlocked lock, and the program got
    "RuntimeError: release unlocked lock" instead of its KeyboardInterrupt
    (seen in CI, test_processes.py::test_ctrl_c_is_the_parents_to_handle)."""
    q: BlobsQueue[int] = BlobsQueue(1, name="q")
    if wait in ("put", "wait_for_room"):
        q.put(0)
    cond = {"get": q._not_empty, "put": q._not_full,
            "wait_for_item": q._item_watch, "wait_for_room": q._room_watch}[wait]

    def release_then_interrupted() -> None:
        q._lock.release()
        raise KeyboardInterrupt

    cond._release_save = release_then_interrupted  # type: ignore[attr-defined]
    with pytest.raises(KeyboardInterrupt):
        if wait == "put":
            q.put(1, timeout=1)
        else:
            getattr(q, wait)(timeout=1)
    # the queue works on: its lock is free and a waiter left behind cannot swallow a wake-up
    del cond._release_save  # type: ignore[attr-defined]
    assert q._lock.acquire(timeout=1)
    q._lock.release()
    if wait in ("put", "wait_for_room"):
        assert q.get(timeout=1) == 0
    q.put(2, timeout=1)
    assert q.get(timeout=1) == 2


# -- waiting for an item without taking it ----------------------------------------------
class _CountingCondition(threading.Condition):
    """A condition that counts how its waiters are woken."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.calls: collections.Counter[str] = collections.Counter()

    def notify(self, n: int = 1) -> None:
        self.calls["notify"] += 1
        super().notify(n)

    def notify_all(self) -> None:
        self.calls["notify_all"] += 1
        super().notify_all()


def _watchers(q: BlobsQueue[Any], timeouts: list[float | None], taken: list[Any]) -> list[threading.Thread]:
    """Threads that wait for an item (each with its timeout), then take one if any is there."""

    def watch(timeout: float | None) -> None:
        if q.wait_for_item(timeout):
            try:
                ok, item = q.get_nowait()
            except EndOfInput:
                return  # woken by the close
            if ok:
                taken.append(item)

    threads = [threading.Thread(target=watch, args=(t,), daemon=True) for t in timeouts]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while q._item_watchers < len(timeouts):
        assert time.monotonic() < deadline, "the watchers never waited"
        time.sleep(0.001)
    return threads


def test_an_item_wakes_one_of_the_watchers_that_wait_with_a_timeout() -> None:
    """Readers that pump (the feeding service's senders) all wait for the
    shared queue's next chunk with a timeout: each chunk woke all of them,
    nine context switches a batch for S1's four senders.  One is woken per
    item."""
    q: BlobsQueue[int] = BlobsQueue(8)
    q._item_watch = cond = _CountingCondition(q._lock)
    taken: list[int] = []
    threads = _watchers(q, [10.0, 10.0, 10.0], taken)
    q.put(1)
    q.put(2)
    deadline = time.monotonic() + 10
    while len(taken) < 2:
        assert time.monotonic() < deadline, f"took {taken}"
        time.sleep(0.001)
    assert sorted(taken) == [1, 2]
    assert cond.calls["notify_all"] == 0 and cond.calls["notify"] >= 2
    q.close()  # the third wakes: the queue is closed
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()


def test_an_item_wakes_every_watcher_while_one_waits_without_a_timeout() -> None:
    """An enqueuer thread waits for ever: were it woken alone and did not
    take the item (its net closed), the item would wait for good."""
    q: BlobsQueue[int] = BlobsQueue(8)
    q._item_watch = cond = _CountingCondition(q._lock)
    taken: list[int] = []
    threads = _watchers(q, [None, 10.0, 10.0], taken)
    q.put(1)
    deadline = time.monotonic() + 10
    while not taken:
        assert time.monotonic() < deadline, "nobody took the item"
        time.sleep(0.001)
    assert taken == [1] and cond.calls["notify_all"] == 1
    q.close()  # (the others looked, found it gone and wait again: the close ends them)
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()


def test_put_many_queues_in_order_waits_for_room_and_stops_at_a_close() -> None:
    """put_many: each item in order, waiting for room as each needs it (a
    reader drains meanwhile); False once the queue is closed, with what
    went in before still there to read."""
    import threading

    q: BlobsQueue[int] = BlobsQueue(3)
    got: list[int] = []

    def read() -> None:
        for _ in range(7):
            got.append(q.get(10))

    reader = threading.Thread(target=read)
    reader.start()
    assert q.put_many(list(range(7)))
    reader.join(10)
    assert not reader.is_alive() and got == list(range(7))
    assert q.put_many([7, 8, 9])  # room for all three: no wait
    full = threading.Event()

    def close_when_blocked() -> None:
        full.wait(10)
        q.close()

    closer = threading.Thread(target=close_when_blocked)
    closer.start()
    full.set()
    assert q.put_many([10]) is False  # full: waits, then the close
    closer.join(10)
    assert [q.get(1) for _ in range(3)] == [7, 8, 9]
