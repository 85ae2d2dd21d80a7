"""A service that stops reading what its consumer sends: the consumer's
``run(timeout)``, ``state_dict(timeout)`` and ``stop(timeout)`` keep their
timeouts.  Every send of the consumer waits for room in its socket until a
deadline; before, one waited for ever once the socket's buffer was full, and
``stop()`` then waited for ever for the lock that send held.

The consumer runs in a thread of its own, joined with a bound: on the old
code it hung, and the test fails instead of hanging.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import blobfeed
from blobfeed.service import consumer

from .test_service import ID8, X8, FakeUnixService, batches_record

#: batches the fake sends: more acknowledgements than a Unix stream's buffer
#: holds unread (about 280 of them)
SENT = 1024


def _flood() -> list[bytes]:
    return [batches_record(*[[g, g % 3, 8, [ID8, X8]] for g in range(k, k + 64)]) for k in range(0, SENT, 64)]


def _bounded(body: Callable[[], Any], within: float) -> Any:
    """``body()`` in a thread: what it returned or raised, which must come within ``within`` s."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = body()
        except BaseException as err:  # (what the test asserts on)
            out["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    assert not t.is_alive(), f"still waiting after {within} s"
    return out


def _while_another_send_holds_the_socket(att: Any, body: Callable[[], Any]) -> Any:
    """:func:`_bounded` ``body()`` while a thread holds the attachment's
    send lock, as a send waiting for room in the socket holds it."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with att._send_lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    try:
        return _bounded(body, 10)
    finally:
        release.set()
        holder.join(10)


def test_run_and_stop_keep_their_timeouts_when_the_service_reads_no_acknowledgement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(consumer, "ACK_SEND_S", 1.0)  # (10 s: the test would wait that long)
    service = FakeUnixService(tmp_path / "fake.sock", _flood())
    try:
        net = blobfeed.Net(None)
        att = blobfeed.attach_source(net, ["id", "x"], 8, "train", service.address, timeout=10)

        def run_until_it_fails() -> int:
            for i in range(SENT):
                try:
                    out = net.run(timeout=1.0)
                except blobfeed.ServiceError as err:
                    assert "does not read" in str(err), err
                    return i
                del out
            raise AssertionError("every batch was acknowledged: nothing filled the buffer")

        got = _bounded(run_until_it_fails, 30)
        assert "error" not in got, got
        assert 0 < got["value"] < SENT
        # and so does every later run(), at once: the stream may be cut mid-record
        later = _bounded(lambda: net.run(timeout=1.0), 5)
        assert isinstance(later.get("error"), blobfeed.ServiceError), later
        t0 = time.monotonic()
        stopped = _bounded(lambda: att.stop(timeout=3.0), 10)
        assert "error" not in stopped, stopped
        assert time.monotonic() - t0 < 5.0
    finally:
        service.close()


class _NotReading(FakeUnixService):
    """Reads the consumer's first record on the connection, then nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.release = threading.Event()
        super().__init__(*args, **kwargs)

    def heard(self, conn: Any, data: bytes) -> None:
        self.release.wait(30)

    def close(self) -> None:
        self.release.set()
        super().close()


def test_state_dict_keeps_its_timeout_when_the_service_reads_no_request(tmp_path: Path) -> None:
    service = _NotReading(tmp_path / "fake.sock", [])
    try:
        net = blobfeed.Net(None)
        att = blobfeed.attach_source(net, ["id", "x"], 8, "train", service.address, timeout=10)

        def ask_until_it_fails() -> str:
            for _ in range(SENT):
                try:
                    att.state_dict(timeout=0.001)
                except blobfeed.ServiceError as err:
                    if "did not answer" in str(err):
                        continue  # (sent, and not answered: the buffer fills)
                    return str(err)
            raise AssertionError("every request was sent: nothing filled the buffer")

        got = _bounded(ask_until_it_fails, 30)
        assert "does not read" in got.get("value", ""), got
        stopped = _bounded(lambda: att.stop(timeout=3.0), 10)
        assert "error" not in stopped, stopped
    finally:
        service.close()


def test_an_acknowledgement_that_cannot_have_the_send_lock_in_time_ends_the_attachment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another send (the outbox thread's, waiting for room) held the lock
    past run()'s deadline: run() raised, and the next run() returned the
    next batch, whose cumulative acknowledgement counted the one never
    returned.  Now the first failure ends the attachment."""
    monkeypatch.setattr(consumer, "ACK_SEND_S", 0.2)
    service = FakeUnixService(tmp_path / "fake.sock", _flood()[:1])
    try:
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", service.address, timeout=10) as att:
            net.run(timeout=5)
            first = _while_another_send_holds_the_socket(att, lambda: net.run(timeout=0.2))
            assert isinstance(first.get("error"), blobfeed.ServiceError), first
            after = _bounded(lambda: net.run(timeout=2), 10)
            assert isinstance(after.get("error"), blobfeed.ServiceError), after  # no batch past the lost one
    finally:
        service.close()


def test_a_state_request_that_waits_for_the_send_lock_past_its_timeout_fails_alone() -> None:
    """Only an acknowledgement that cannot go ends the attachment: a
    state_dict() whose short timeout passed while another send held the
    socket (a moment, on a busy host) fails, and run() goes on.  The first
    version ended the attachment (a review's loop of state_dict(0.01) beside
    run() did within 0.2 s)."""
    from blobfeed.service import FeedServer

    from . import feeds

    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, epochs=None)
    server.start()
    try:
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, timeout=10) as att:
            net.run(timeout=10)
            asked = _while_another_send_holds_the_socket(att, lambda: att.state_dict(timeout=0.05))
            assert "took no state request within 0.05 s" in str(asked.get("error")), asked
            assert net.run(timeout=10)["id"].size  # the attachment goes on
            with pytest.raises(ValueError, match="not resumable|deterministic"):
                att.state_dict(timeout=10)  # and answers (this source's state is refused, by the service)
    finally:
        assert server.stop()
