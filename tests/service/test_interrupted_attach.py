"""A Ctrl-C (``KeyboardInterrupt``) that lands inside ``attach_source()``
or ``Attachment.stop()``: nothing may stay behind, and the index is free
for the next attach.

The interrupt is raised at a chosen step (a patched call raises it), the
same exception a real SIGINT raises in the main thread at that bytecode.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import pytest

import blobfeed
from blobfeed.reader import Inlet
from blobfeed.service import FeedServer
from blobfeed.service import consumer as consumer_module
from blobfeed.service import served as served_module
from tests.helpers import fds_opened_since, interrupt_after, open_fds, wait_until

from . import feeds


@contextlib.contextmanager
def serving_one_consumer(**terms: Any) -> Iterator[FeedServer]:
    """A running service of one endless deterministic source ``train``
    (blobs id and x, batches of 8, 2 workers) for one consumer; ``terms``:
    more of ``serve_source``'s."""
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, epochs=None, deterministic=True,
                        num_consumers=1, **terms)
    server.start()
    try:
        yield server
    finally:
        assert server.stop()


@pytest.fixture
def server() -> Iterator[FeedServer]:
    with serving_one_consumer(grace_period=60) as server:
        yield server


def _attach(server: FeedServer) -> tuple[blobfeed.Net, Any]:
    net = blobfeed.Net(None)
    return net, blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, consumer_index=0,
                                       num_consumers=1, timeout=10)


def _attach_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("blobfeed-attach-")]


def _warm(server: FeedServer) -> None:
    """One whole attach and detach first: what a first attach opens for
    good (the metrics hub, imports) is not taken for a leak."""
    net, att = _attach(server)
    net.run(timeout=10)
    assert att.stop()


def _nothing_left(server: FeedServer, before: dict[str, str]) -> None:
    """The service saw the consumer leave, no thread of the attachment
    runs, no descriptor it opened is open, and index 0 attaches again."""
    wait_until(lambda: server.sources["train"].connected == 0, "the service to see the consumer leave", 10)
    wait_until(lambda: not _attach_threads(), "the attachment's threads to end", 10)
    wait_until(lambda: not fds_opened_since(before), f"the descriptors to close: {fds_opened_since(before)}", 10)
    net, att = _attach(server)
    assert net.run(timeout=10)["id"].size
    assert att.stop()


@pytest.mark.parametrize("where", ["bye", "sockets closed", "threads joined", "inlet closed"])
def test_a_stop_interrupted_is_finished_by_the_next_stop(
    server: FeedServer, monkeypatch: pytest.MonkeyPatch, where: str,
) -> None:
    _warm(server)
    before = open_fds()
    net, att = _attach(server)
    net.run(timeout=10)
    if where == "bye":
        send = att._send_waited

        def send_waited(record: dict[str, Any], deadline: Any) -> None:
            if record["t"] == "bye":
                raise KeyboardInterrupt  # before it is sent
            send(record, deadline)

        monkeypatch.setattr(att, "_send_waited", send_waited)
    elif where == "sockets closed":
        interrupt_after(monkeypatch, att, "_close_sockets")
    elif where == "threads joined":
        interrupt_after(monkeypatch, att._threads[-1], "join")
    else:
        interrupt_after(monkeypatch, att.inlet, "close")
    with pytest.raises(KeyboardInterrupt):
        att.stop()
    assert att.stop()  # the user's cleanup: it finishes the detach
    del net
    _nothing_left(server, before)


@pytest.mark.parametrize("where", ["the welcome read", "the inlet starting", "the receiver started"])
def test_an_attach_interrupted_after_the_welcome_leaves_nothing(
    server: FeedServer, monkeypatch: pytest.MonkeyPatch, where: str,
) -> None:
    """``attach_source`` raised, so its caller has no attachment to stop:
    what it had made is undone before the interrupt goes on."""
    _warm(server)
    before = open_fds()
    if where == "the welcome read":
        interrupt_after(monkeypatch, consumer_module, "BatchCheck")  # the first step after the welcome
    elif where == "the inlet starting":
        interrupt_after(monkeypatch, Inlet, "start")
    else:
        class Thread(threading.Thread):
            def start(self) -> None:
                super().start()
                if self.name.startswith("blobfeed-attach-recv"):
                    raise KeyboardInterrupt

        monkeypatch.setattr(threading, "Thread", Thread)
    net = blobfeed.Net(None)
    with pytest.raises(KeyboardInterrupt) as info:
        blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, consumer_index=0, num_consumers=1,
                               timeout=10)
    monkeypatch.undo()
    del net
    # the traceback kept, as a REPL or a notebook keeps the last one: it
    # holds the attachment's frames, so collecting it would not close the sockets
    _nothing_left(server, before)
    assert info.tb is not None


@pytest.mark.parametrize("address", [None, "tcp://127.0.0.1:0"])
@pytest.mark.parametrize("index", [0, None])
def test_an_index_detached_is_attached_again_at_once_while_the_service_still_lets_go_of_it(
    monkeypatch: pytest.MonkeyPatch, address: str | None, index: int | None,
) -> None:
    """stop() returns once the service closed the connection; letting go of
    the consumer (its unacknowledged batches taken back) comes just after.
    An attach of the same index meanwhile (the same process, at once) waits
    for that; it was refused as attached already (or, with the lowest free
    index asked for, as all attached)."""
    release = served_module.ServedSource.release

    def slow_release(self: Any, *args: Any) -> None:
        time.sleep(0.3)  # (the service's own pace, made slow: what the attach must wait for)
        release(self, *args)

    monkeypatch.setattr(served_module.ServedSource, "release", slow_release)
    server = FeedServer(address)
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, epochs=None, deterministic=True,
                        num_consumers=1, grace_period=60)
    server.start()
    try:
        for _ in range(3):
            net = blobfeed.Net(None)
            with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, consumer_index=index,
                                        num_consumers=1, timeout=10) as att:
                net.run(timeout=10)
            assert att.consumer == 0
    finally:
        assert server.stop()


def _interrupt_state_request(monkeypatch: pytest.MonkeyPatch, att: Any, *, after_it_went: bool) -> None:
    """The attachment's next ``state`` request is interrupted by a Ctrl-C,
    before its record went or right after; later sends are the channel's own."""
    channel = att._channel
    real = channel.send

    def send(record: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if record.get("t") != "state":
            return real(record, *args, **kwargs)
        monkeypatch.setattr(channel, "send", real)
        if after_it_went:
            real(record, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(channel, "send", send)


@pytest.mark.parametrize("after_it_went", [False, True], ids=["before-it-went", "after-it-went"])
def test_a_state_request_interrupted_leaves_the_next_ones_answered(
    server: FeedServer, monkeypatch: pytest.MonkeyPatch, after_it_went: bool
) -> None:
    """A Ctrl-C in ``state_dict()`` around its request's send: the next
    calls get their own answers, and the attachment goes on.  Before, a
    request interrupted before it went still took its number: the service's
    answers were matched to the calls one behind from then on, and every
    later ``state_dict()`` waited out its timeout."""
    net, att = _attach(server)
    try:
        net.run(timeout=10)
        _interrupt_state_request(monkeypatch, att, after_it_went=after_it_went)
        with pytest.raises(KeyboardInterrupt):
            att.state_dict(timeout=10)
        for _ in range(3):
            state = att.state_dict(timeout=5)
            assert "train" in state["sources"], state
            net.run(timeout=10)
    finally:
        assert att.stop()


class _InterruptedAfterAcquire:
    """An attachment's send lock whose next acquire() in the test's thread
    takes the lock and is then interrupted, as a Ctrl-C landing when the
    call returns (before its caller's ``try``) is."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self._thread = threading.get_ident()
        self.armed = True

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        got = self._lock.acquire(*args, **kwargs)
        if got and self.armed and threading.get_ident() == self._thread:
            self.armed = False
            raise KeyboardInterrupt
        return got

    def release(self) -> None:
        self._lock.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()


@pytest.mark.parametrize("where", ["state_dict", "run"])
def test_a_ctrl_c_right_after_the_send_lock_was_taken_leaves_it_free(
    server: FeedServer, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The send lock taken, then a Ctrl-C before the call that took it
    returned: before, nothing released it, and every later send waited out
    its time (the next state_dict() failed, run() waited 10 s and ended the
    attachment as if the service no longer read)."""
    net, att = _attach(server)
    try:
        net.run(timeout=10)
        lock = _InterruptedAfterAcquire(att._send_lock)
        monkeypatch.setattr(att, "_send_lock", lock)
        with pytest.raises(KeyboardInterrupt):
            if where == "state_dict":
                att.state_dict(timeout=5)
            else:
                net.run(timeout=10)
        assert not lock.armed
        t0 = time.monotonic()
        assert "train" in att.state_dict(timeout=3)["sources"]
        net.run(timeout=3)
        assert time.monotonic() - t0 < 3
    finally:
        assert att.stop()


def test_a_state_dict_called_inside_another_s_last_step_returns(server: FeedServer) -> None:
    """A signal handler's state_dict() landing in the last step of another
    (its cleanup): before, that step held the state lock, which the
    handler's call then waited for in the same thread, for ever."""
    net, att = _attach(server)
    try:
        net.run(timeout=10)
        nested: list[Any] = []

        class Waiting(dict):
            def pop(self, *args: Any) -> Any:
                out = super().pop(*args)
                if not nested:
                    nested.append(None)  # (once: the nested call's own last step passes here too)
                    nested[0] = att.state_dict(timeout=5)  # as a handler's call landing here would
                return out

        att._states._waiting = Waiting()
        done: list[Any] = []
        t = threading.Thread(target=lambda: done.append(att.state_dict(timeout=5)), daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "state_dict() hung"
        assert "train" in done[0]["sources"] and "train" in nested[0]["sources"]
    finally:
        assert att.stop()
