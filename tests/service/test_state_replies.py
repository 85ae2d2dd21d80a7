"""A consumer's ``state_dict()`` against what the service answers: a
``state_is`` nobody asked for is refused (it could be handed to a later
call, and a flood of them piled up in the consumer), and the late answer to
a call that gave up waiting is not the next call's (a review of the
consumer against a hostile service found both)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

import blobfeed

from .test_service import FakeUnixService, fake_service_error


def _state_is(state: dict, asked: int) -> bytes:
    return json.dumps({"t": "state_is", "id": asked, "state": state, "error": None}).encode()


def test_a_state_is_nobody_asked_for_fails_the_attachment(tmp_path: Path) -> None:
    fake_service_error(tmp_path, [_state_is({"forged": True}, 1)], "'state_is' record nobody asked for")


class SlowFirstAnswer(FakeUnixService):
    """Answers each 'state' request with {"answer": k}, the first one only
    after ``late`` is set (once its asker gave up)."""

    def __init__(self, path: Path) -> None:
        self.late = threading.Event()
        self.asked = 0
        super().__init__(path, [])

    def heard(self, conn: socket.socket, data: bytes) -> None:
        record = json.loads(data)
        if record.get("t") != "state":
            return
        self.asked += 1
        if self.asked == 1:
            assert self.late.wait(10)
        conn.send(_state_is({"answer": self.asked}, record["id"]))


def test_the_late_answer_to_a_call_that_gave_up_is_not_the_next_call_s(tmp_path: Path) -> None:
    fake = SlowFirstAnswer(tmp_path / "fake.sock")
    net = blobfeed.Net(None)
    try:
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", fake.address, timeout=10) as att:
            with pytest.raises(blobfeed.ServiceError, match="did not answer for its state"):
                att.state_dict(timeout=0.3)
            fake.late.set()
            assert att.state_dict(timeout=10) == {"answer": 2}
    finally:
        fake.late.set()
        fake.close()


@pytest.mark.parametrize("record, match", [
    ({"t": "epoch_end", "g": -7, "epoch": -5, "dropped": 0}, r"'epoch_end' record with a negative number: epoch -5"),
    ({"t": "batches", "items": [[0, 0, 8, [["f8,(", [8], 0], ["<f4", [8, 3], 64]]]]}, r"unknown dtype 'f8,\('"),
])
def test_an_impossible_epoch_end_or_dtype_is_a_service_error_naming_it(
    tmp_path: Path, record: dict, match: str
) -> None:
    err = fake_service_error(tmp_path, [json.dumps(record).encode()], match)
    assert "the receiver failed" not in str(err)


class SameNumberAlways(FakeUnixService):
    """Answers every 'state' request as if it were the first one asked."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, [])

    def heard(self, conn: socket.socket, data: bytes) -> None:
        if json.loads(data).get("t") == "state":
            conn.send(_state_is({"answer": 1}, 1))


def test_an_answer_naming_a_request_answered_already_fails_the_attachment(tmp_path: Path) -> None:
    fake = SameNumberAlways(tmp_path / "fake.sock")
    net = blobfeed.Net(None)
    try:
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", fake.address, timeout=10) as att:
            assert att.state_dict(timeout=10) == {"answer": 1}
            with pytest.raises(blobfeed.ServiceError, match="sent a 'state_is' record out of order"):
                att.state_dict(timeout=10)
            with pytest.raises(blobfeed.ServiceError, match=r"out of order \(request 1; requests up to 1 were answered"):
                net.run(timeout=10)
    finally:
        fake.close()


def test_state_dict_from_two_threads_at_once_gets_each_call_its_own_answer() -> None:
    """Each call waits for the answer naming its own request: before, the
    calls shared one queue of answers, and a call that took the other's
    answer (a later one) left its own to be dropped as late, and the other
    call waited out its timeout."""
    from blobfeed.service import FeedServer

    from . import feeds

    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, epochs=None, deterministic=True,
                        num_consumers=1)
    with server.start():
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, consumer_index=0,
                                    num_consumers=1, timeout=10) as att:
            net.run(timeout=10)
            failed: list[BaseException] = []

            def ask() -> None:
                try:
                    for _ in range(40):
                        assert "train" in att.state_dict(timeout=5)["sources"]
                except BaseException as err:  # (what the test asserts on)
                    failed.append(err)

            threads = [threading.Thread(target=ask) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads)
            assert not failed, failed


def test_calls_that_stop_waiting_while_the_service_s_end_is_told_all_hear_it() -> None:
    """A caller woken by the service's end forgets its request at once, in
    its own thread, while the receiver still tells the others: the telling
    went over the table being changed, and raised (found by review: 49 of
    50 trials, and the callers not told waited out their timeouts)."""
    import queue

    from blobfeed.service.state_requests import StateRequests

    requests = StateRequests("service at x")

    class Leaving(queue.SimpleQueue):  # type: ignore[type-arg]
        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            super().put(item, block, timeout)
            requests.forget(self)  # as the woken caller does, at once

    boxes = [Leaving(), queue.SimpleQueue(), Leaving(), queue.SimpleQueue()]
    for box in boxes:
        requests.ask(box)
    requests.gone("service at x is gone: it broke the protocol")
    assert [box.get_nowait()["error"] for box in boxes] == ["service at x is gone: it broke the protocol"] * 4
    for box in boxes:  # a call forgets its request by its box (it may not have learnt its number)
        requests.forget(box)
    assert not requests._waiting
