"""The feeding service over TCP (issue 18: "TCP only when asked, loopback
unless an address is given"), with real processes and real sockets.

Batches travel inline on the stream (blobfeed/service/tcp.py); the same
acknowledgements, slots and dealing as on the Unix socket, so the streams
must be the same.  Every wait is bounded.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed.service import FeedServer
from blobfeed.service import admission as admission_mod
from blobfeed.service import connection as connection_mod
from blobfeed.service.tcp import MAGIC, PREFIX, parse_tcp
from blobfeed.service.wire import PROTOCOL

from ..test_security import listening
from . import feeds
from .test_service import (
    ENV, ROOT, _fds, attach_run_detach, batches, consumer, consumers_learn_of_the_end, finish, lines, local_streams,
    resume_is_exact, wait_for,
)

LOOPBACK = "tcp://127.0.0.1:0"


def served(listen: str | None = LOOPBACK, workers: int = 2, name: str = "train", **kw: Any) -> FeedServer:
    server = FeedServer(listen)
    server.serve_source(name, ["id", "x"], feeds.Fetch(), 8, workers, **kw)
    return server.start()


def by_index(server: FeedServer, tmp_path: Path, tag: str, n: int) -> list[list[list[int]]]:
    outs = [tmp_path / f"{tag}{i}.jsonl" for i in range(n)]
    procs = [consumer(str(server.address), outs[i], "--index", str(i), "--num", str(n)) for i in range(n)]
    assert finish(procs) == [0] * n
    assert all(lines(o)[-1] == {"end": "input"} for o in outs)
    return [batches(o) for o in outs]


# -- addresses ---------------------------------------------------------------------------


@pytest.mark.parametrize("address, expected", [
    ("tcp://127.0.0.1:0", ("127.0.0.1", 0)),
    ("tcp://:5000", ("127.0.0.1", 5000)),
    ("tcp://[::1]:5000", ("::1", 5000)),
    ("tcp://localhost:65535", ("localhost", 65535)),
    ("tcp://0.0.0.0:7", ("0.0.0.0", 7)),
])
def test_tcp_addresses(address: str, expected: tuple[str, int]) -> None:
    assert parse_tcp(address) == expected


@pytest.mark.parametrize("address, message", [
    ("tcp://127.0.0.1", "expected tcp://HOST:PORT"),
    ("tcp://127.0.0.1:65536", "port from 0 to 65535"),
    ("tcp://127.0.0.1:-1", "port from 0 to 65535"),
    ("tcp://::1:5000", "IPv6 address goes in brackets"),
    ("tcp://host/path:5000", "expected tcp://HOST:PORT"),
])
def test_a_malformed_tcp_address_is_a_value_error_naming_it(address: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        FeedServer(address)
    with pytest.raises(ValueError, match=re.escape(message)):
        blobfeed.attach_source(blobfeed.Net(None), ["id", "x"], 8, "train", address)


def test_loopback_by_default_the_real_port_and_a_warning_for_any_other_address(caplog) -> None:
    caplog.set_level(logging.WARNING, "blobfeed.service")
    with served("tcp://:0") as server:
        host, port = parse_tcp(str(server.address))
        assert host == "127.0.0.1" and port > 0
        assert listening(port) == ["127.0.0.1"]
    assert not [r for r in caplog.records if "not a loopback address" in r.getMessage()]
    with served("tcp://0.0.0.0:0") as server:
        port = parse_tcp(str(server.address))[1]
        assert listening(port) == ["0.0.0.0"]
    warned = [r.getMessage() for r in caplog.records if "not a loopback address" in r.getMessage()]
    assert len(warned) == 1 and "anyone who can reach this port can attach and read the served data" in warned[0]


def test_ipv6_loopback() -> None:
    try:
        probe = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as err:
        pytest.skip(f"no IPv6 loopback here: {err}")
    probe.close()
    with served("tcp://[::1]:0", epochs=None) as server:
        assert re.fullmatch(r"tcp://\[::1\]:\d+", str(server.address))
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address):
            assert net.run(timeout=10)["id"].shape == (8,)


def test_attach_port_0_or_nobody_there_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="port 0 is for listening"):
        blobfeed.attach_source(blobfeed.Net(None), ["id", "x"], 8, "train", "tcp://127.0.0.1:0")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    free = s.getsockname()[1]
    s.close()  # nobody listens there now
    with pytest.raises(blobfeed.ServiceError, match=f"no service at tcp://127.0.0.1:{free}"):
        blobfeed.attach_source(blobfeed.Net(None), ["id", "x"], 8, "train", f"tcp://127.0.0.1:{free}")


# -- exactly once, the same streams as on the Unix socket --------------------------------


def test_by_index_over_tcp_is_exactly_once_and_the_unix_socket_s_stream(tmp_path: Path) -> None:
    with served(workers=4, deterministic=True, num_consumers=4) as server:
        assert str(server.address).startswith("tcp://127.0.0.1:")
        over_tcp = by_index(server, tmp_path, "tcp", 4)
    with served(None, workers=4, deterministic=True, num_consumers=4) as server:
        over_unix = by_index(server, tmp_path, "unix", 4)
    flat = sorted(i for s in over_tcp for b in s for i in b)
    assert flat == feeds.all_ids(4)
    assert over_tcp == over_unix
    assert over_tcp == local_streams(4, 1, deterministic=True)


def test_first_come_over_tcp_is_exactly_once_across_three_consumers(tmp_path: Path) -> None:
    with served() as server:
        outs = [tmp_path / f"c{i}.jsonl" for i in range(3)]
        assert finish([consumer(str(server.address), o) for o in outs]) == [0] * 3
        counts = server.sources["train"].counts
        assert sum(counts.acknowledged.values()) == sum(len(batches(o)) for o in outs)
    flat = sorted(i for o in outs for b in batches(o) for i in b)
    assert flat == feeds.all_ids(2)


def test_a_killed_tcp_consumer_s_batches_go_to_the_others(tmp_path: Path) -> None:
    with served() as server:
        outs = [tmp_path / f"c{i}.jsonl" for i in range(3)]
        dying = consumer(str(server.address), outs[0], "--die-after", "3")
        assert finish([dying]) == [-signal.SIGKILL]
        assert finish([consumer(str(server.address), o) for o in outs[1:]]) == [0, 0]
        redealt = sum(server.sources["train"].counts.redealt.values())
    flat = sorted(i for o in outs for b in batches(o) for i in b)
    assert flat == feeds.all_ids(2)
    assert redealt > 0


def test_the_address_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with served(epochs=None) as server:
        monkeypatch.setenv("BLOBFEED_SERVICE", str(server.address))
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train") as att:
            got = net.run(timeout=10)
            assert att.address == server.address
            assert got["id"].shape == (8,) and not got["x"].flags.writeable
            assert (got["x"][:, 0] == got["id"]).all()
            del got


# -- the command line; the service's end --------------------------------------------------


def _serve_tcp(*extra: str, env: dict | None = None) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "serve", "tests.service.feeds:wire_by_index",
         "--listen", LOOPBACK, *extra],
        env={**ENV, **(env or {})}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()  # bounded: printed once listening, or the process exits
    m = re.fullmatch(r"blobfeed serve: listening on (tcp://127\.0\.0\.1:(\d+))\n", line)
    assert m, (line, p.stderr.read() if p.poll() is not None else "")
    assert int(m[2]) > 0
    return p, m[1]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_serve_prints_the_real_port_and_consumers_learn_within_a_second_that_it_ended(
    tmp_path: Path, sig: int
) -> None:
    p, address = _serve_tcp(env={"N": "2", "BLOBFEED_TEST_CALLS": "100000"})
    try:
        assert listening(parse_tcp(address)[1]) == ["127.0.0.1"]
    except BaseException:
        p.kill()
        p.wait(10)
        raise
    consumers_learn_of_the_end(p, address, tmp_path, sig)


def test_sigterm_and_resume_over_tcp_continue_exactly(tmp_path: Path) -> None:
    resume_is_exact(tmp_path, lambda *flags: _serve_tcp(*flags, env={"N": "2", "EPOCHS": "2"}))


# -- strangers and liars -------------------------------------------------------------------


def frame(record: Any, payload: bytes = b"", announced: int | None = None, size: int | None = None) -> bytes:
    data = record if isinstance(record, bytes) else json.dumps(record).encode()
    return PREFIX.pack(MAGIC, len(data) if size is None else size,
                       len(payload) if announced is None else announced) + data + payload


HELLO = {"t": "hello", "protocol": PROTOCOL, "source": "train", "blobs": ["id", "x"], "batch_size": 8,
         "index": None, "num": None, "pid": 1}


def _closed_on_us(s: socket.socket) -> bool:
    """The service closed the connection (a reset if it left our bytes unread)."""
    try:
        while True:
            if s.recv(1 << 16) == b"":
                return True
    except ConnectionResetError:
        return True


def test_a_stranger_on_the_tcp_port_is_refused_and_the_service_keeps_serving(
    caplog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, "blobfeed.service")
    monkeypatch.setattr(connection_mod, "HANDSHAKE_S", 0.5)
    monkeypatch.setattr(admission_mod, "REFUSALS_LOGGED", 100)  # each one's line, to read what it names
    garbage = [
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "not a blobfeed peer"),
        (os.urandom(4096), "not a blobfeed peer"),
        (frame(b"{" * 10, size=70_000), "a record of 70000 bytes, over 65536"),
        (frame(HELLO, announced=1 << 40), "announced 1099511627776 bytes of payload"),
        (frame(HELLO, payload=b"\0" * 64), "announced 64 bytes of payload after a record; at most 0 here"),
        (frame(b"\x00\xff not json"), "not JSON"),
        (frame([1, 2, 3]), "without a kind"),
        (frame(b"[" * 60_000), "nested deeper than 64"),
        (frame({**HELLO, "batch_size": True}), "'batch_size' is bool"),
        (frame({**HELLO, "extra": 1}), "unknown fields ['extra']"),
        (frame({"t": "ack", "g": 0}), "kind 'ack' here"),
        (frame(HELLO)[:30], "inside a record"),
        (frame(HELLO)[:9], "inside a frame"),
        (b"", "said nothing within"),  # and then silence past the handshake's limit
    ]
    # 4 slots: a liar is not sent a whole epoch before its lie is read
    with served(epochs=None, slots=4) as server:
        host, port = parse_tcp(str(server.address))
        for data, _ in garbage:
            with socket.create_connection((host, port), timeout=10) as s:
                try:
                    s.sendall(data)
                    if data and len(data) < 40:
                        s.shutdown(socket.SHUT_WR)  # a frame cut short
                except OSError:
                    pass
                assert _closed_on_us(s)
        # after a valid hello: a frame with payload, an acknowledgement of
        # nothing sent, a slot it does not hold, a record cut short
        lies = [
            (frame({"t": "ack", "g": -1, "slots": [0], "waited": 0.0}, payload=b"x" * 64),
             "announced 64 bytes of payload"),
            (frame({"t": "ack", "g": 12345, "slots": [], "waited": 0.0}), "acknowledged items up to 12345"),
            (frame({"t": "ack", "g": -1, "slots": [99], "waited": 0.0}), "freed slot 99, which it does not hold"),
            (frame({"t": "ack", "g": -1, "slots": ["0"], "waited": 0.0}), "slots are not a list of at most"),
            (frame({"t": "ack", "g": -1, "slots": [0], "waited": 0.0}, size=1000), "inside a record"),
        ]
        for data, expected in lies:
            net = blobfeed.Net(None)
            with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address) as att:
                sock = att._channel.sock
                sock.sendall(data)
                if "inside" in expected:
                    sock.shutdown(socket.SHUT_WR)
                with pytest.raises(blobfeed.ServiceError):
                    for _i in range(10_000):
                        net.run(timeout=10)
            del net, att
        # the service still serves everything to a well-behaved consumer
        out = tmp_path / "good.jsonl"
        p = consumer(str(server.address), out)
        wait_for(lambda: out.exists() and len(batches(out)) >= 20, 30, "a good consumer's batches")
        p.kill()
        finish([p])
    warned = [r.getMessage() for r in caplog.records if r.name == "blobfeed.service" and r.levelno >= logging.WARNING]
    for _, expected in garbage + lies:
        assert any(expected in m for m in warned), (expected, warned)
    # each names where it came from
    assert all(re.search(r"from 127\.0\.0\.1:\d+", m) for m in warned if "connection" in m and "refused" not in m)
    caplog.clear()  # its records' errors hold frames that held the liars' batches


class FakeService:
    """A TCP 'service' that welcomes one consumer and then says what a test tells it."""

    def __init__(
        self, frames: list[bytes], slots: int = 3, slot_bytes: int = 1024, hang_up: bool = True,
        welcome: bytes | None = None, hang_up_after: threading.Event | None = None,
    ) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.frames = frames
        #: close its side after the frames (False: stay, as a real service
        #: does until its consumer leaves)
        self.hang_up = hang_up
        #: set by the test: only then does it hang up (after its frames)
        self.hang_up_after = hang_up_after
        self.welcome = frame({"t": "welcome", "consumer": 0, "slots": slots, "epoch": 0, "service": self.address})
        self.welcome += frame({"t": "slots", "slots": slots, "slot_bytes": slot_bytes})
        if welcome is not None:
            self.welcome = welcome
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.sock.settimeout(10)
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(10)
            conn.recv(1 << 16)  # its hello
            conn.sendall(self.welcome)
            for f in self.frames:
                conn.sendall(f)
            # then the end of the stream; what the consumer says is read (and
            # dropped) until it leaves: a close with unread bytes would reset
            # the connection, and a reset may overtake the frames sent
            if self.hang_up:
                if self.hang_up_after is not None:
                    self.hang_up_after.wait(10)
                try:
                    conn.shutdown(socket.SHUT_WR)
                except OSError:
                    return  # the consumer left already (it refused what we sent)
            conn.settimeout(0.1)
            while not self.done.is_set():
                try:
                    data = conn.recv(1 << 16)
                    if not data or b'"bye"' in data:
                        return  # as a service answers a bye: it closes (the consumer's stop() waits for that)
                except TimeoutError:
                    continue
                except OSError:
                    return

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.sock.close()


def batch_frame(ids: np.ndarray, slot: int = 0, g: int = 0, x: np.ndarray | None = None, **lie: Any) -> bytes:
    """A ``batch`` frame as the service sends it for blobs id (int64) and x (float32, 3 per sample)."""
    x = np.stack([ids.astype(np.float32)] * 3, axis=1) if x is None else x
    n = len(ids)
    off_x = -(-ids.nbytes // 64) * 64
    arrays = [["<i8", [n], 0], [x.dtype.str, list(x.shape), off_x]]
    payload = ids.tobytes() + bytes(off_x - ids.nbytes) + x.tobytes()
    payload += bytes(-len(payload) % 64)
    record = {"t": "batch", "g": g, "slot": slot, "n": n, "arrays": arrays}
    record.update(lie.pop("record", {}))
    payload = lie.pop("payload", payload)
    return frame(record, payload=payload, **lie)


IDS = np.arange(8, dtype=np.int64)


@pytest.mark.parametrize("frames, expected", [
    ([batch_frame(IDS, payload=b"\0" * 320)], "320 bytes of payload for arrays that take 192"),
    ([batch_frame(IDS, record={"arrays": [["<i8", [8], 0], ["<f4", [8, 3], 128]]})],
     "array 1: at offset 128; packed after the arrays before it, it starts at 64"),
    ([batch_frame(IDS, record={"n": 7})], "array 0: bad shape [8] for 7 samples"),
    # empty, so 0 bytes, but no array numpy can make: numpy's bare ValueError came out, unnamed
    ([batch_frame(IDS, record={"arrays": [["<i8", [8], 0], ["<f4", [8, 0, 2**39, 2**39], 64]]})],
     "array 1: bad shape [8, 0, 549755813888, 549755813888] for 8 samples"),
    ([batch_frame(np.arange(9, dtype=np.int64))], "a batch of 9 samples; this consumer attached with batch_size=8"),
    ([batch_frame(IDS, slot=3)], "batch in slot 3, of 3"),
    ([batch_frame(IDS, record={"arrays": [["<i8", [8], 0]]})], "a batch of 1 arrays; the consumer attached with 2 blobs"),
    ([batch_frame(IDS, record={"arrays": [["|O", [8], 0], ["<f4", [8, 3], 64]]})], "not a plain number type"),
    ([batch_frame(IDS, record={"arrays": [["<i8", [8], 0], ["<f4", [8, 300], 64]]})],
     "array 1: the arrays take 9664 bytes or more, over the slot's 1024"),
    ([batch_frame(IDS, announced=2048)], "announced 2048 bytes of payload after a record; at most 1024"),
    ([batch_frame(IDS), batch_frame(IDS, g=1)], "batch in slot 0, whose last batch the consumer has not freed"),
    ([batch_frame(IDS), batch_frame(IDS, slot=1, g=1, x=np.zeros((8, 4), np.float32))],
     "the first batch had [(<i8, ()), (<f4, (3,))]"),
    ([frame({"t": "epoch_end", "g": 0, "epoch": 0, "dropped": 0}, payload=b"\0" * 64)],
     "64 bytes of payload after a 'epoch_end' record"),
    ([batch_frame(IDS)[:-10]], "closed the connection 10 bytes before a payload's end"),
])
def test_a_lying_service_fails_the_consumer_naming_the_lie(frames: list[bytes], expected: str) -> None:
    fake = FakeService(frames)
    net = blobfeed.Net(None)
    try:
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", fake.address, timeout=10):
            with pytest.raises(blobfeed.ServiceError) as info:
                held = [net.run(timeout=10) for _ in range(len(frames) + 1)]
                del held
            assert expected in str(info.value.__cause__ or info.value), str(info.value)
            assert fake.address in str(info.value)
    finally:
        fake.close()


def test_a_batch_read_off_the_stream_is_the_service_s_bytes_read_only() -> None:
    ids = np.array([5, 6, 7], dtype=np.int64)
    x = np.arange(9, dtype=np.float32).reshape(3, 3)
    fake = FakeService([batch_frame(ids, x=x), frame({"t": "end", "error": None, "kind": "end"})], hang_up=False)
    net = blobfeed.Net(None)
    try:
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", fake.address, timeout=10):
            got = net.run(timeout=10)
            assert got["id"].tolist() == [5, 6, 7] and np.array_equal(got["x"], x)
            assert not got["id"].flags.writeable and not got["x"].flags.writeable
            with pytest.raises(ValueError):
                got["x"][0, 0] = 1.0
            del got
            with pytest.raises(blobfeed.EndOfInput):
                net.run(timeout=10)
    finally:
        fake.close()


class _SlowFailure(logging.Handler):
    """Holds the thread that fails a source for ``delay`` seconds at its
    "stopped by a fetcher error" log line: after the source's error is set,
    before its nets' device queues are aborted (a loaded machine)."""

    def __init__(self, delay: float) -> None:
        super().__init__(logging.ERROR)
        self.delay = delay

    def emit(self, record: logging.LogRecord) -> None:
        if "stopped by a fetcher error" in record.getMessage():
            time.sleep(self.delay)


@pytest.mark.parametrize("slow_failure", [False, True], ids=["", "slow-failure"])
def test_batches_held_when_the_service_goes_away_after_the_end_are_not_handed_out(slow_failure: bool) -> None:
    """The stream's end came with a batch still unacknowledged, then the
    service went away: its acknowledgement could not be counted, so the
    consumer must not return it (a resumed service deals it again).  It
    used to stop reading at the end and hand it out.  ``slow_failure``: the
    failure takes a while to reach the net after the source's error is set
    (what made this test see "DID NOT RAISE" once under load, when it waited
    for the error only)."""
    ids = np.array([5, 6, 7], dtype=np.int64)
    fake = FakeService([batch_frame(ids), frame({"t": "end", "error": None, "kind": "end"})])
    net = blobfeed.Net(None)
    slow = _SlowFailure(0.5)
    if slow_failure:
        logging.getLogger("blobfeed.feeders").addHandler(slow)
    try:
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", fake.address, timeout=10) as att:
            wait_for(lambda: att.inlet.error is not None, 10, "the consumer to see the service go")
            with pytest.raises(blobfeed.ServiceError, match="acknowledged the 1 items"):
                net.run(timeout=10)
    finally:
        logging.getLogger("blobfeed.feeders").removeHandler(slow)
        fake.close()


def test_twenty_tcp_attach_detach_cycles_leave_nothing_behind() -> None:
    before = len(_fds())
    with served(name="tcpcycles", epochs=None) as server:
        def cycle() -> None:
            attach_run_detach(server.address, "tcpcycles")

        cycle()
        fds, threads = len(_fds()), threading.active_count()
        for _ in range(20):
            cycle()
        wait_for(lambda: len(_fds()) <= fds and threading.active_count() <= threads, 10, "cleanup")
        wait_for(lambda: server.sources["tcpcycles"].connected == 0, 10, "the service to see them leave")
    gc.collect()
    wait_for(lambda: len(_fds()) <= before, 10, "the service's sockets closed")


def test_a_hello_for_no_such_source_is_refused_in_one_frame_then_closed() -> None:
    with served() as server:
        host, port = parse_tcp(str(server.address))
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(frame({**HELLO, "source": "nope"}))
            got = b""
            while True:
                part = s.recv(1 << 16)
                if not part:
                    break
                got += part
    magic, size, payload = PREFIX.unpack(got[:PREFIX.size])
    assert (magic, payload, len(got)) == (MAGIC, 0, PREFIX.size + size)
    assert json.loads(got[PREFIX.size:]) == {
        "t": "refused", "error": "this service has no source 'nope'; it serves ['train']", "kind": "value"}


class _Big:
    """8 MB batches: four in flight fill any socket's buffers."""

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        return [np.zeros((8, 1_000_000), np.uint8)]


def test_stop_does_not_wait_for_a_consumer_that_stopped_reading() -> None:
    """A consumer that attached and then read nothing (a hung trainer, a
    peer behind a full window) leaves the service's sender blocked in a
    send that holds the connection; telling that consumer the service stops
    blocked stop() for as long (for ever, here)."""
    server = FeedServer(LOOPBACK)
    server.serve_source("big", ["x"], _Big(), 8, 1, epochs=None)
    server.start()
    host, port = parse_tcp(str(server.address))
    mute = socket.create_connection((host, port), timeout=10)
    try:
        mute.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        mute.sendall(frame({**HELLO, "source": "big", "blobs": ["x"]}))
        wait_for(lambda: server.sources["big"].connected >= 1, 30, "the mute consumer attached")
        # its first 8 MB batch fills the buffers at once; the sender then
        # blocks in its send (nothing to wait on: that it is stuck is the point)
        time.sleep(0.5)
        stopper = threading.Thread(target=server.stop, daemon=True)
        t0 = time.monotonic()
        stopper.start()
        stopper.join(15)
        assert not stopper.is_alive(), "stop() hung on a consumer that does not read"
        assert time.monotonic() - t0 < 5
    finally:
        mute.close()
        server.stop()


def test_stop_tells_many_consumers_that_stopped_reading_within_one_drain() -> None:
    """Telling a consumer whose sender is stuck in a send waited NO_WAIT_S
    (0.5 s) for the connection, one consumer after another: stop() took
    1 s plus 0.5 s per such consumer before it saved the state (a review
    measured 16 s with 30).  The stuck sender tells it after its frame, and
    the drain's close frees it: nothing needs the wait."""
    from blobfeed.service.server import STOP_DRAIN_S

    server = FeedServer(LOOPBACK)
    server.serve_source("big", ["x"], _Big(), 8, 1, epochs=None)
    server.start()
    host, port = parse_tcp(str(server.address))
    mutes = []
    try:
        for _ in range(8):
            mute = socket.create_connection((host, port), timeout=10)
            mute.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            mute.sendall(frame({**HELLO, "source": "big", "blobs": ["x"]}))
            mutes.append(mute)
        wait_for(lambda: server.sources["big"].connected >= 8, 30, "the mute consumers attached")
        # each sender stuck in the send of its first 8 MB batch, holding its connection
        wait_for(lambda: sum(_taken(c.channel._send_lock) for c in list(server._connections)) >= 8, 60,
                 "every sender stuck in a send")
        t0 = time.monotonic()
        assert server.stop()
        took = time.monotonic() - t0
        assert took < STOP_DRAIN_S + 2, f"stop() took {took:.2f} s with 8 consumers that do not read"
    finally:
        for mute in mutes:
            mute.close()
        server.stop()


def _taken(lock: Any) -> bool:
    """Does another thread hold ``lock`` (an RLock: no ``locked()``)?"""
    if lock.acquire(blocking=False):
        lock.release()
        return False
    return True


def test_an_acknowledgement_sent_just_before_a_tcp_consumer_died_with_batches_unread_counts() -> None:
    """As on the Unix socket: a consumer gone with batches unread resets the
    connection; what it sent last (its acknowledgement) must still count.
    (TCP hands over the bytes received before a reset; this guards that path.
    The sender hearing of the reset first and shutting the socket before the
    receiver read the acknowledgement, seen once in a full run of the killed
    TCP consumer's test, is not reproduced here: the sender no longer closes
    the socket on a reset.)"""

    def read_exactly(s: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = s.recv(n - len(buf))
            assert got, "the service closed the connection"
            buf += got
        return buf

    def read_frame(s: socket.socket) -> dict[str, Any]:
        _, size, payload = PREFIX.unpack(read_exactly(s, PREFIX.size))
        record = json.loads(read_exactly(s, size))
        read_exactly(s, payload)
        return record

    with served(slots=4) as server:
        host, port = parse_tcp(str(server.address))
        s = socket.create_connection((host, port), timeout=10)
        s.sendall(frame({**HELLO, "pid": os.getpid()}))
        assert read_frame(s)["t"] == "welcome"
        assert read_frame(s)["t"] == "slots"  # before the first batch, sized by it
        first = read_frame(s)
        assert first["t"] == "batch"
        wait_for(lambda: sum(server.sources["train"].counts.delivered.values()) >= 4, 10, "the slots filled")
        s.sendall(frame({"t": "ack", "g": first["g"], "slots": [], "waited": 0.0}))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, as a death
        s.close()
        wait_for(lambda: server.sources["train"].connected == 0, 10, "the consumer's end seen")
        assert sum(server.sources["train"].counts.acknowledged.values()) == 1


WELCOME = {"t": "welcome", "consumer": 0, "slots": 3, "epoch": 0, "service": "x"}


@pytest.mark.parametrize("said, expected", [
    (frame({**WELCOME, "slots": 1025}), "said it will offer 1025 slots (3 to 1024)"),
    (frame(b'{"t":"welcome","x":' + b"[" * 60_000), "nested deeper than 64"),
    (frame({**WELCOME, "slots": [[[[[]]]]]}), "'slots' is list"),
])
def test_a_welcome_that_lies_is_a_service_error_at_attach(said: bytes, expected: str) -> None:
    """A welcome nested 60 000 deep escaped attach_source as RecursionError;
    one out of range as a WireError: both are the service's fault, a
    ServiceError naming it."""
    fake = FakeService([], welcome=said)
    try:
        with pytest.raises(blobfeed.ServiceError, match=re.escape(expected)) as info:
            blobfeed.attach_source(blobfeed.Net(None), ["id", "x"], 8, "train", fake.address, connect_timeout=10)
        assert fake.address in str(info.value)
    finally:
        fake.close()


@pytest.mark.parametrize("slots, slot_bytes, expected", [
    (1024, 1 << 40, "offered 1024 slots (3 to 3, as its welcome said)"),
    (3, 1 << 40, "offered slots of 1099511627776 bytes (64 to 8589934720: at most 1073741824 bytes a sample"),
    (3, 8 << 30, "offered 3 slots of 8589934592 bytes: 25769803776 bytes in all, over 68719476736"),
    (3, 32, "offered slots of 32 bytes (64 to"),
])
def test_slots_a_service_offers_are_bounded_by_the_consumer_s_batch(
    slots: int, slot_bytes: int, expected: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A welcome offering 1 024 slots of 1 TiB ended attach_source in a bare
    OSError (Cannot allocate memory).  A consumer maps or reserves only what
    its batch can need: a slot of at most 1 GiB per sample of its
    batch_size (64 bytes more per blob), 64 GiB in all, as many slots as
    the welcome said, and memory only as batches arrive."""
    from blobfeed.service import wire

    if "in all" in expected:
        monkeypatch.setattr(wire, "MAX_SLOT_AREA", 16 << 30)
        expected = expected.replace("68719476736", str(16 << 30))
    welcome = frame(WELCOME) + frame({"t": "slots", "slots": slots, "slot_bytes": slot_bytes})
    fake = FakeService([batch_frame(IDS)], welcome=welcome)
    net = blobfeed.Net(None)
    try:
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", fake.address, timeout=10):
            with pytest.raises(blobfeed.ServiceError, match=re.escape(expected)) as info:
                net.run(timeout=10)
            assert fake.address in str(info.value)
    finally:
        fake.close()


def test_offered_slots_cost_memory_only_as_batches_arrive() -> None:
    """3 slots of 8 GiB offered (batches of 8 samples of up to 1 GiB): a
    batch of 192 bytes takes a buffer of its size, not 8 GiB."""
    welcome = frame(WELCOME) + frame({"t": "slots", "slots": 3, "slot_bytes": 8 << 30})
    fake = FakeService([batch_frame(IDS), frame({"t": "end", "error": None, "kind": "end"})], welcome=welcome,
                       hang_up=False)
    net = blobfeed.Net(None)
    try:
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", fake.address, timeout=10) as att:
            got = net.run(timeout=10)
            assert got["id"].tolist() == IDS.tolist()
            assert got["id"].base.nbytes < 4096
            del got
            with pytest.raises(blobfeed.EndOfInput):
                net.run(timeout=10)
            del att
    finally:
        fake.close()


# -- the handshake is bounded as a whole, and in number (issue 24, item 5) -----------------


def test_a_hello_sent_a_byte_at_a_time_is_dropped_when_the_handshake_s_time_is_up(
    caplog, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer sending a valid hello one byte every 0.4 s was still connected
    after 9 s: the limit applied to each read, not to the handshake, so each
    such peer held a thread and a descriptor for as long as it liked."""
    monkeypatch.setattr(connection_mod, "HANDSHAKE_S", 1.0)
    with served() as server:
        host, port = parse_tcp(str(server.address))
        with socket.create_connection((host, port), timeout=10) as s:
            t0 = time.monotonic()
            closed = False
            for b in frame(HELLO):
                try:
                    s.send(bytes([b]))
                except OSError:
                    closed = True
                    break
                readable, _, _ = select.select([s], [], [], 0.2)  # a byte every 0.2 s, or the service's close
                if readable:
                    closed = _closed_on_us(s)
                    break
            assert closed and time.monotonic() - t0 < 4.0
    assert any("did not finish its hello within 1 s" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("listen", [None, LOOPBACK])
def test_at_most_so_many_connections_are_in_their_handshake_at_once(
    listen: str | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Silent peers each held a thread in its handshake, as many as they
    opened.  At most MAX_HANDSHAKES are in their handshake at once; the
    next connection waits (in the listen backlog) until one ends, and an
    honest consumer still attaches once the silent ones are dropped."""
    from blobfeed.service import server as server_mod

    monkeypatch.setattr(connection_mod, "HANDSHAKE_S", 1.5)
    monkeypatch.setattr(server_mod, "MAX_HANDSHAKES", 2)
    with served(listen) as server:
        def connect() -> socket.socket:
            if listen is None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.settimeout(10)
                s.connect(str(server.address))
                return s
            host, port = parse_tcp(str(server.address))
            return socket.create_connection((host, port), timeout=10)

        silent = [connect() for _ in range(3)]  # one past the two: it waits, and the honest one behind it
        try:
            wait_for(lambda: len(server._connections) >= 2, 10, "two silent peers in their handshake")
            for _ in range(5):  # while they are, the others are not taken in
                assert len(server._connections) == 2
                time.sleep(0.1)
            net = blobfeed.Net(None)
            with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, connect_timeout=20):
                assert net.run(timeout=20)["id"].shape == (8,)
        finally:
            for s in silent:
                s.close()


def test_a_full_listen_backlog_is_waited_out_within_connect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a Unix socket a connect() to a service whose listen backlog is full
    fails at once (EAGAIN), whatever the socket's timeout: attach_source
    said "no service" in 0.3 s although connect_timeout was 30 (a review
    filled the backlog with silent peers).  It tries again until then."""
    from blobfeed.service import server as server_mod

    monkeypatch.setattr(server_mod, "MAX_HANDSHAKES", 1)
    with served(None) as server:
        silent: list[socket.socket] = []
        try:
            for _ in range(1000):  # until the backlog is full (64, and one in its handshake)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.setblocking(False)
                try:
                    s.connect(str(server.address))
                except BlockingIOError:
                    s.close()
                    break
                silent.append(s)
            else:
                pytest.fail("the listen backlog never filled")
            # the busy spell ends a moment after the consumer started to attach
            ends = threading.Timer(1.0, lambda: [s.close() for s in silent])
            ends.start()
            net = blobfeed.Net(None)
            t0 = time.monotonic()
            with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, connect_timeout=20):
                assert net.run(timeout=20)["id"].shape == (8,)
            assert time.monotonic() - t0 >= 0.5  # it did wait for room
            ends.join(5)
        finally:
            for s in silent:
                s.close()


def test_the_wire_layout_is_the_service_s_own_not_the_process_backend_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot and TCP frame layout is part of the service's protocol: a
    change to the process backend's alignment (feeders.messages.ALIGN) must
    not move an array on the wire (it would, without a new protocol number)."""
    from blobfeed.feeders import messages
    from blobfeed.service import slots as slots_mod
    from blobfeed.service.tcp import StreamChannel

    arrays = [np.arange(3, dtype=np.int8), np.ones((3, 5), np.float32), np.zeros((3, 1), np.int64)]

    def wire() -> tuple[Any, int, int, bytes]:
        meta, size = slots_mod.layout(arrays)
        a, b = socket.socketpair()
        try:
            StreamChannel(a, "test").send({"t": "batch"}, payload=arrays)
            a.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := b.recv(1 << 16):
                data += chunk
        finally:
            a.close()
            b.close()
        return meta, size, slots_mod.batch_nbytes(arrays), data

    before = wire()
    assert [m[2] for m in before[0]] == [0, 64, 128] and before[1] == 192
    monkeypatch.setattr(messages, "ALIGN", 4096)
    assert messages.align(3) == 4096  # the backend's layout did change
    assert wire() == before


def test_a_batch_queued_when_the_service_goes_away_after_the_end_is_not_handed_out() -> None:
    """test_batches_held_when_the_service_goes_away_after_the_end_are_not_handed_out
    with the batch pinned in the net's device queue and the end already in
    when the service goes away (that test failed once under load with "DID
    NOT RAISE"; not reproduced here): run() raises, and no acknowledgement
    goes into a connection the consumer saw close (TCP would accept it)."""
    gate = threading.Event()
    fake = FakeService([batch_frame(np.array([5, 6, 7], dtype=np.int64)),
                        frame({"t": "end", "error": None, "kind": "end"})], hang_up_after=gate)
    net = blobfeed.Net(None)
    try:
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", fake.address, timeout=10) as att:
            wait_for(lambda: att.reader.ready() >= 1, 10, "the batch in the device queue")
            gate.set()
            wait_for(lambda: att.inlet.error is not None, 10, "the consumer to see the service go")
            with pytest.raises(blobfeed.ServiceError, match="acknowledged the 1 items"):
                net.run(timeout=10)
    finally:
        gate.set()
        fake.close()


@pytest.mark.parametrize("how", ["deadline", "no deadline", "no wait"])
def test_a_ctrl_c_right_after_the_channel_s_send_lock_was_taken_leaves_it_free(how: str) -> None:
    """A TCP channel's frame lock taken, then a Ctrl-C before the call that
    took it returned: before, nothing released it, and every later send
    (an acknowledgement, a state request, the bye) waited out its time and
    failed as if the peer did not read (found by review with real SIGINTs:
    3 runs of 4)."""
    from blobfeed.service.tcp import StreamChannel

    from .test_interrupted_attach import _InterruptedAfterAcquire

    mine, theirs = socket.socketpair()
    try:
        channel = StreamChannel(mine, "peer")
        lock = _InterruptedAfterAcquire(channel._send_lock)
        channel._send_lock = lock  # type: ignore[assignment]
        kwargs: dict[str, Any] = {"deadline": time.monotonic() + 5} if how == "deadline" else (
            {} if how == "no deadline" else {"wait": False})
        with pytest.raises(KeyboardInterrupt):
            channel.send({"t": "x"}, **kwargs)
        assert not lock.armed
        channel.send({"t": "y"}, deadline=time.monotonic() + 1)  # the lock is free: at once
    finally:
        mine.close()
        theirs.close()
