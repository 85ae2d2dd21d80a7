"""What a peer sends is quoted back to it and logged in bounded pieces: a
hostile hello of 60 KiB of names makes neither a 60 KiB log line nor a
refusal too big to send, and refusals in a flood are logged a few at a
time, not one line each."""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any, Iterator

import pytest

from blobfeed.service import FeedServer
from blobfeed.service.wire import PROTOCOL

from tests.helpers import wait_until

from . import feeds

#: the longest log line or refusal text a hostile hello may cause
MOST = 1000
BIG = "n" * 60_000


@pytest.fixture
def server() -> Iterator[FeedServer]:
    s = FeedServer()
    s.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _hello(**change: Any) -> dict[str, Any]:
    hello = {"t": "hello", "protocol": PROTOCOL, "source": "train", "blobs": ["id", "x"], "batch_size": 8,
             "index": None, "num": None, "pid": os.getpid()}
    hello.update(change)
    return hello


def _answer(address: str, record: dict[str, Any]) -> dict[str, Any] | None:
    """Send ``record`` as the first record; the service's answer (None: it closed)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    try:
        s.connect(address)
        s.send(json.dumps(record).encode())
        data = s.recv(1 << 17)
        return json.loads(data) if data else None
    finally:
        s.close()


@pytest.mark.parametrize("what,record,named", [
    ("a source name", _hello(source=BIG), "no source"),
    ("blob names", _hello(blobs=[BIG[:100]] * 600), "carries blobs"),
    ("a record kind", {"t": BIG}, "record of kind"),
    ("field names", {**_hello(), **{f"f{i:05d}{'x' * 50}": 1 for i in range(1000)}}, "unknown fields"),
])
def test_a_hostile_hello_is_refused_and_logged_in_bounded_text(server: FeedServer, caplog: pytest.LogCaptureFixture,
                                                               what: str, record: dict[str, Any], named: str) -> None:
    caplog.set_level(logging.INFO, logger="blobfeed")
    answer = _answer(str(server.address), record)
    assert answer is None or answer["t"] == "refused", answer
    if answer is not None:
        assert named in answer["error"] and len(answer["error"]) <= MOST, (what, len(answer["error"]))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("blobfeed.service")]
    assert any(named in line for line in lines), (what, [line[:200] for line in lines])
    longest = max(len(line) for line in lines)
    assert longest <= MOST, f"{what}: a log line of {longest} characters"
    # the service goes on serving
    ok = _answer(str(server.address), _hello())
    assert ok is not None and ok["t"] == "welcome", ok


def test_refusals_in_a_flood_are_logged_a_few_at_a_time(server: FeedServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="blobfeed")
    for _ in range(200):
        answer = _answer(str(server.address), _hello(source="nope"))
        assert answer is not None and answer["t"] == "refused"
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refusals) <= 20, f"{len(refusals)} log lines for 200 refusals"
    # the rest are counted, and told (once) at the latest when the service stops
    server.stop()
    told = [r.getMessage() for r in caplog.records if "more consumers refused" in r.getMessage()]
    held = sum(int(line.split("service: ", 1)[1].split(" ", 1)[0]) for line in told)
    assert held + len(refusals) == 200, told
    assert all("no source 'nope'" in line for line in told)


def test_an_acknowledgement_of_nothing_closes_the_consumer(server: FeedServer,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """An ``ack`` that acknowledges nothing (``g`` -1) and frees no slot is
    never sent by a consumer of ours: a peer that sent them in a loop only
    made the service's receiver parse them, for ever (a review measured the
    CPU it takes).  Past 64 in a row the connection is closed, naming it;
    the others go on."""
    from .test_service import hand_hello

    caplog.set_level(logging.INFO, logger="blobfeed.service")
    s, fds = hand_hello(str(server.address))
    try:
        for fd in fds:
            os.close(fd)
        nothing = json.dumps({"t": "ack", "g": -1, "slots": [], "waited": 0.0}).encode()
        s.settimeout(10)
        try:
            for _ in range(1000):
                s.send(nothing)
        except OSError:
            pass  # closed on us meanwhile
        closed = False
        try:
            while True:
                data = s.recv(1 << 17)
                if not data:
                    closed = True
                    break
        except ConnectionResetError:
            closed = True
        assert closed
        assert any("acknowledged nothing and freed no slot 65 times in a row" in r.getMessage()
                   for r in caplog.records), \
            [r.getMessage()[:200] for r in caplog.records]
        ok = _answer(str(server.address), _hello())
        assert ok is not None and ok["t"] == "welcome", ok
    finally:
        s.close()


def test_refusals_held_back_are_told_once_their_window_is_over(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The count of the refusals past the first 10 waited for the next
    refusal, which might never come (found by review)."""
    from blobfeed import log_throttle
    from blobfeed.service import admission

    now = [1000.0]

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return now[0]

    monkeypatch.setattr(log_throttle, "time", Clock)
    caplog.set_level(logging.WARNING, logger="blobfeed.service")
    refusals = admission.RefusalLog()
    for i in range(15):
        refusals.refused(f"connection {i}", "no source 'x'")
    refusals.flush_due()
    assert len(caplog.records) == 10, "told before its window was over"
    now[0] += admission.REFUSAL_WINDOW_S
    refusals.flush_due()
    told = [r.getMessage() for r in caplog.records[10:]]
    assert len(told) == 1 and "5 more consumers refused" in told[0] and "connection 14" in told[0], told
    refusals.flush()
    assert len(caplog.records) == 11, "told twice"


def test_the_service_tells_what_its_refusal_log_held_back_without_a_stop(monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The monitor tells the held-back count once its window is over: the
    next refusal (or the stop) may be days away."""
    from blobfeed.service import admission

    monkeypatch.setattr(admission, "REFUSAL_WINDOW_S", 0.3)
    caplog.set_level(logging.WARNING, logger="blobfeed.service")
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None)
    server.start()
    try:
        for _ in range(15):
            assert _answer(str(server.address), _hello(source="nope"))["t"] == "refused"  # type: ignore[index]
        wait_until(lambda: any("more consumers refused" in r.getMessage() for r in caplog.records),
                   "the held-back refusals told while the service runs", timeout=10)
    finally:
        server.stop()


def test_peers_that_say_hello_then_break_the_protocol_are_logged_a_few_at_a_time(
    server: FeedServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """Refusals were throttled, but a peer that said a valid hello and then
    sent garbage was logged in full each time (2 000 of them: 7 389
    warnings): the connection's close and the batches it left are throttled
    as refusals are, and the rest counted in one line at the stop."""
    caplog.set_level(logging.WARNING, logger="blobfeed")
    n = 40
    for _ in range(n):
        _say(str(server.address), [(json.dumps(_hello()).encode(), []), (b"garbage", [])])
    wait_until(lambda: server.sources["train"].connected == 0, "the peers' connections closed", 20)
    server.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    import re

    closes = [w for w in warnings if w.endswith("connection closed")]
    departures = [w for w in warnings if w.endswith("dealt to the others")]
    # 10 a window each (closes and departures have budgets of their own), and a window may turn
    assert 0 < len(closes) <= 12 and len(departures) <= 12, (len(closes), len(departures))
    counted = sum(int(m.group(1)) for w in warnings for m in [re.match(r"service: (\d+) more connections closed", w)]
                  if m)
    # every peer's close is logged or counted (each may have left a batch too)
    assert len(closes) + counted >= n, warnings[-3:]
    assert len(warnings) <= 28, (len(warnings), warnings[:3])


def test_a_unix_peer_is_named_by_its_real_pid_not_the_one_its_hello_says(
    server: FeedServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """The log named a consumer by the pid its hello said: a peer could make
    it blame any process (an honest rank).  On the Unix socket the kernel
    says who it is (SO_PEERCRED); what the hello said is kept beside it."""
    caplog.set_level(logging.INFO, logger="blobfeed")
    answer = _answer(str(server.address), _hello(pid=4_000_000))
    assert answer is not None and answer["t"] == "welcome", answer
    wait_until(lambda: any("attached" in r.getMessage() for r in caplog.records), "the attach's log line", 10)
    attached = next(r.getMessage() for r in caplog.records if "attached" in r.getMessage())
    assert f"pid {os.getpid()}" in attached and "4000000" in attached, attached


def test_a_hello_with_too_many_descriptors_is_refused_saying_so(server: FeedServer,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A small hello carrying 5 descriptors was refused as "a record over
    65536 bytes (or too many descriptors)": the kernel's flags say it was the
    descriptors (too many, or this process out of them), not the size."""
    caplog.set_level(logging.INFO, logger="blobfeed")
    r, w = os.pipe()
    try:
        _say(str(server.address), [(json.dumps(_hello()).encode(), [r] * 5)])
    finally:
        os.close(r)
        os.close(w)
    wait_until(lambda: any("descriptors" in r.getMessage() for r in caplog.records), "the refusal's log line", 10)
    line = next(r.getMessage() for r in caplog.records if "descriptors" in r.getMessage())
    assert "could not all be taken: more than 4" in line and "65536" not in line, line


def _say(address: str, records: list[tuple[bytes, list[int]]]) -> None:
    """Connect, send ``records`` (each with its descriptors), and read what
    comes back until the service closes the connection."""
    import array

    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    try:
        s.connect(address)
        for data, fds in records:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
            s.sendmsg([data], ancillary)
        while s.recv(1 << 17):
            pass
    except OSError:
        pass
    finally:
        s.close()


def test_consumers_leaving_with_batches_do_not_crowd_out_protocol_closes(caplog: pytest.LogCaptureFixture) -> None:
    """Both went through one throttle: a window's budget spent on consumers
    that left holding batches (as every killed consumer does) held back the
    warning naming a peer that broke the protocol, and the reverse.  Each
    kind has its own budget now."""
    from blobfeed.service import admission

    caplog.set_level(logging.WARNING, logger="blobfeed.service")
    closures = admission.ClosureLog()
    for i in range(admission.REFUSALS_LOGGED):
        closures.departure("source %r: consumer %d left with %d batches unacknowledged", "train", i, 1)
    closures.event("service: %s; connection closed", "consumer 99 sent garbage")
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == admission.REFUSALS_LOGGED + 1 and "consumer 99 sent garbage" in told[-1], told
    closures.departure("source %r: consumer %d left with %d batches unacknowledged", "train", 100, 1)
    closures.flush()
    assert "1 more consumers left holding batches" in caplog.records[-1].getMessage(), caplog.records[-1]
