"""A consumer's acknowledgements on a stream of their own (Unix socket,
protocol 7): what the service takes as that stream, and what it does with
what comes on it (untrusted, like every record)."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from typing import Any

import pytest

from blobfeed.service import FeedServer
from blobfeed.service.wire import PROTOCOL
from tests.helpers import fds_opened_since, open_fds, wait_until

from . import feeds
from .test_service import _records


def _serve(**kw: Any) -> FeedServer:
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(feeds.CALLS), 8, 2, **kw)
    return server.start()


def _hello(address: str, fds: list[int], index: int | None = 0) -> socket.socket:
    """Say hello (as consumer ``index``) with ``fds``: the socket, before its answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(address)
    hello = {"t": "hello", "protocol": PROTOCOL, "source": "train", "blobs": ["id", "x"], "batch_size": 8,
             "index": index, "num": None, "pid": os.getpid()}
    s.sendmsg([json.dumps(hello).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds))])
    return s


@pytest.mark.parametrize("what", [
    "a pipe", "a datagram socket", "a seqpacket socket", "two streams", "an unconnected stream",
    "a listening stream",
])
def test_a_hello_whose_descriptor_is_not_one_stream_socket_is_refused_naming_it(
    what: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="blobfeed.service")
    before = open_fds()
    mine: list[Any] = []
    if what == "a pipe":
        r, w = os.pipe()
        fds = [r]
        mine = [r, w]
        expected = "not a socket"
    elif what in ("an unconnected stream", "a listening stream"):
        lone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if what == "a listening stream":
            lone.bind(f"\0blobfeed-test-{os.getpid()}")  # (abstract: no file to remove)
            lone.listen()
        fds = [lone.fileno()]
        mine = [lone]
        expected = "that is not connected"
    elif what == "two streams":
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
        fds = [p[1].fileno() for p in pairs]
        mine = [s for p in pairs for s in p]
        expected = "2 descriptors with its hello"
    else:
        kind = socket.SOCK_DGRAM if what == "a datagram socket" else socket.SOCK_SEQPACKET
        a, b = socket.socketpair(socket.AF_UNIX, kind)
        fds = [b.fileno()]
        mine = [a, b]
        expected = "not a Unix stream socket"
    server = _serve(num_consumers=1)
    try:
        s = _hello(server.address, fds)
        reply = next(_records(s))
        s.close()
        assert reply["t"] == "refused" and expected in reply["error"], reply
        # the index was not taken: a consumer may have it
        assert server.sources["train"].outlets[0].holder is None
    finally:
        server.stop()
        for m in mine:
            m.close() if isinstance(m, socket.socket) else os.close(m)
    assert any(expected in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
    # what the hello carried was closed: nothing of it is left behind
    wait_until(lambda: not fds_opened_since(before), "every descriptor closed", 10)


def _attached(
    server: FeedServer, count: int, index: int | None = 0,
) -> tuple[socket.socket, socket.socket, list[list[Any]]]:
    """A hand-made consumer of ``index`` (None: first come) with an
    acknowledgement stream, and the first ``count`` batch entries it was sent."""
    acks, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with theirs:
        s = _hello(server.address, [theirs.fileno()], index)
    records = _records(s)
    held: list[list[Any]] = []
    while len(held) < count:
        record = next(records)
        assert record["t"] != "refused", record
        if record["t"] == "batches":
            held += record["items"]
    return s, acks, held


def _ack(g: int, slots: list[int], waited: float = 0.0) -> bytes:
    return b'{"t":"ack","g":%d,"slots":[%s],"waited":%r}\n' % (g, ",".join(map(str, slots)).encode(), waited)


@pytest.mark.parametrize("garbage, why", [
    (b"not json\n", "not JSON"),
    (b'{"t":"bye","waited":0.0}\n', "record of kind 'bye' here"),
    (b"x" * (70 * 1024), "acknowledgement line of over"),
    (b'{"t":"ack","g":1,"slots":[],"wait', "in the middle of one"),
])
def test_garbage_on_the_acknowledgement_stream_ends_the_connection_after_what_came_before_counts(
    garbage: bytes, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="blobfeed.service")
    server = _serve(num_consumers=1, slots=16)
    try:
        s, acks, held = _attached(server, 4)
        source = server.sources["train"]
        acks.sendall(_ack(held[0][0], [held[0][1]]) + _ack(held[1][0], [held[1][1]]) + garbage)
        if why == "in the middle of one":
            acks.close()  # the line is cut short by the stream's end
        wait_until(lambda: source.connected == 0, "the consumer disconnected", 10)
        assert source.counts.acknowledged["0"] == 2
        s.close()
        acks.close()
    finally:
        server.stop()
    warned = [r.getMessage() for r in caplog.records]
    # named as the consumer it attached as (it was "connection 0", its name before the hello)
    assert any(why in m and "connection closed" in m and "consumer 0 of source 'train'" in m for m in warned), warned


def test_an_acknowledgement_on_the_connection_s_socket_is_refused_once_there_is_a_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One place for a consumer's acknowledgements: two would have no order between them."""
    caplog.set_level(logging.WARNING, logger="blobfeed.service")
    server = _serve(num_consumers=1, slots=16)
    try:
        s, acks, held = _attached(server, 1)
        s.send(_ack(held[0][0], [held[0][1]]).rstrip(b"\n"))
        wait_until(lambda: server.sources["train"].connected == 0, "the consumer disconnected", 10)
        assert server.sources["train"].counts.acknowledged["0"] == 0
        s.close()
        acks.close()
    finally:
        server.stop()
    assert any("record of kind 'ack' here" in r.getMessage() for r in caplog.records)


def test_a_stopping_service_shuts_the_stream_so_no_later_acknowledgement_is_taken_for_counted() -> None:
    """Once the service closed the connection (a stop), a consumer's send on
    its acknowledgement stream fails: its run() raises rather than return a
    batch the saved state misses.  What it sent before still counts."""
    server = _serve(num_consumers=1, slots=16)
    stopped = False
    try:
        s, acks, held = _attached(server, 2)
        source = server.sources["train"]
        acks.sendall(_ack(held[0][0], [held[0][1]]))
        wait_until(lambda: source.counts.acknowledged["0"] == 1, "the first acknowledgement counted", 10)
        server.stop()
        stopped = True
        with pytest.raises(BrokenPipeError):
            acks.sendall(_ack(held[1][0], [held[1][1]]))
        assert source.counts.acknowledged["0"] == 1
        s.close()
        acks.close()
    finally:
        if not stopped:
            server.stop()


@pytest.mark.parametrize("lie", ["never sent", "stranger slot"])
def test_acknowledgements_read_together_with_a_lie_the_ledger_catches_still_count(
    lie: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A burst's acknowledgements are counted as one; a lie among them that
    only the ledger catches (an item never sent; a slot the consumer does
    not hold) took the good ones before it along: their batches, which its
    run() returned, were dealt again.  Each g is now checked against the
    ledger as it is read."""
    caplog.set_level(logging.WARNING, logger="blobfeed.service")
    server = _serve(num_consumers=1, slots=16)
    try:
        s, acks, held = _attached(server, 4)
        source = server.sources["train"]
        bad = _ack(10**9, []) if lie == "never sent" else _ack(held[2][0], [9999])
        # one write: the three are read (and merged) together
        acks.sendall(_ack(held[0][0], [held[0][1]]) + _ack(held[1][0], [held[1][1]]) + bad)
        wait_until(lambda: source.connected == 0, "the consumer disconnected", 10)
        # the first two count; the third's g counts too where only its slot lied (as when taken one by one)
        assert source.counts.acknowledged["0"] == (2 if lie == "never sent" else 3)
        s.close()
        acks.close()
    finally:
        server.stop()
    warned = [r.getMessage() for r in caplog.records]
    why = "acknowledged items up to 1000000000" if lie == "never sent" else "freed slot 9999"
    assert any(why in m and "connection closed" in m for m in warned), warned


def _stop_server(tmp_path: Any) -> FeedServer:
    server = FeedServer(state_file=tmp_path / "state.json")
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, deterministic=True, slots=4, num_consumers=1)
    return server.start()


def test_a_stalled_consumer_s_acknowledgement_after_the_save_fails_on_its_stream(tmp_path: Any) -> None:
    """A consumer that does not answer the stop (stalled) and acknowledges
    once the service saved its state: the send fails (the stream was shut),
    so its run() returns no batch the saved state misses."""
    server = _stop_server(tmp_path)
    s, acks, held = _attached(server, 1)
    save = server.save_state
    after: list[BaseException | None] = []

    def save_then_ack() -> bool:
        saved = save()
        try:
            acks.sendall(_ack(held[0][0], []))
            after.append(None)
        except OSError as err:
            after.append(err)
        return saved

    _stop_saving_with(server, save_then_ack, s, acks)
    assert after and isinstance(after[0], BrokenPipeError), after
    assert sum(server.sources["train"].counts.acknowledged.values()) == 0


def _stop_saving_with(server: Any, save: Any, *socks: socket.socket) -> None:
    """Stop ``server`` with ``save`` as its save_state; ``socks`` closed after."""
    server.save_state = save
    try:
        server.stop()
    finally:
        for sock in socks:
            sock.close()


def test_a_stalled_consumer_s_acknowledgements_before_the_stop_are_in_the_saved_state(tmp_path: Any) -> None:
    """Acknowledged on the stream, then silent (no bye): the saved state counts them."""
    server = _stop_server(tmp_path)
    s, acks, held = _attached(server, 2)
    acks.sendall(_ack(held[0][0], [held[0][1]]) + _ack(held[1][0], [held[1][1]]))
    counted_at_save: list[int] = []
    save = server.save_state

    def save_counting() -> bool:
        counted_at_save.append(sum(server.sources["train"].counts.acknowledged.values()))
        return save()

    _stop_saving_with(server, save_counting, s, acks)
    assert counted_at_save == [2]


def test_a_consumer_that_makes_its_stream_blocking_does_not_stall_the_receiver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The consumer holds the other end of the stream's descriptor and may
    clear O_NONBLOCK on it (shared by both ends' copies of the file): after
    a read of exactly 64 KiB the receiver's next read waited for more, and
    the consumer's other records (a state request) went unanswered."""
    import fcntl

    from blobfeed.service import connection

    # 64 KiB of acknowledgements of nothing are the filler here, not the lie under test
    monkeypatch.setattr(connection, "MAX_IDLE_ACKS", 1 << 20)
    server = _serve(num_consumers=1, slots=16)
    acks, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s = _hello(server.address, [theirs.fileno()])  # `theirs` kept: the same file as the service's end
        records = _records(s)
        while next(records)["t"] != "batches":
            pass
        fcntl.fcntl(theirs.fileno(), fcntl.F_SETFL, fcntl.fcntl(theirs.fileno(), fcntl.F_GETFL) & ~os.O_NONBLOCK)
        line = _ack(-1, [], 0.0)
        n = 65536 // len(line)
        first = _ack(-1, [], 0.0)[:-2] + b"0" * (65536 - n * len(line)) + b"}\n"  # the padding in its wait's digits
        data = first + line * (n - 1)
        assert len(data) == 65536
        acks.sendall(data)
        s.send(json.dumps({"t": "state", "id": 1}).encode())
        while True:
            record = next(records)  # (the socket's 10 s timeout bounds the wait)
            if record["t"] == "state_is":
                break
        s.close()
    finally:
        server.stop()
        acks.close()
        theirs.close()


def test_a_run_that_races_the_consumer_s_stop_hands_out_no_batch_it_cannot_acknowledge() -> None:
    """stop() marks the attachment closed, then sends its bye.  A run() in
    another thread that returned a batch in between sent no acknowledgement
    (it was skipped once closed) and handed the batch out: the service took
    it back at the bye and dealt it again.  Now that run() raises."""
    import blobfeed

    server = _serve(num_consumers=1, slots=16)
    try:
        net = blobfeed.Net(None)
        att = blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, consumer_index=0,
                                     num_consumers=1, timeout=10)
        try:
            net.run(timeout=10)  # attached, batches flowing
            att._closed = True  # where stop() stands right before its bye (the run() thread does not know)
            with pytest.raises(blobfeed.ServiceError, match="detached"):
                net.run(timeout=10)
        finally:
            att._closed = False
            att.stop()
    finally:
        server.stop()


def test_a_consumer_that_closes_only_its_acknowledgement_stream_is_disconnected_after_what_it_acknowledged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """blobfeed's consumer closes its stream after its connection, or with
    it: one that keeps the connection open could never acknowledge the
    batches it holds, which would stall the others at the data's end."""
    caplog.set_level(logging.WARNING, logger="blobfeed.service")
    server = _serve(slots=16)  # first come: what it held goes to the others
    try:
        s, acks, held = _attached(server, 4, index=None)
        source = server.sources["train"]
        acks.sendall(_ack(held[0][0], [held[0][1]]))
        acks.close()
        wait_until(lambda: source.connected == 0, "the consumer disconnected", 10)
        assert sum(source.counts.acknowledged.values()) == 1
        s.close()
    finally:
        server.stop()
    warned = [r.getMessage() for r in caplog.records]
    assert any("closed its acknowledgement stream but kept its connection open" in m and "connection closed" in m
               for m in warned), warned
    assert any("batches unacknowledged: dealt to the others" in m for m in warned), warned  # what it held
