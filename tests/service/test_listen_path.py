"""A service's Unix socket path: who may take it, and how its file is made."""

from __future__ import annotations

import contextlib
import re
import time
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

import blobfeed
from blobfeed.service import FeedServer, socket_path

from . import feeds

WAIT = 5.0


@pytest.fixture
def waiting_for_path(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a start waits for the service holding its path to let go."""
    waiting = threading.Event()
    real = time.sleep

    class Clock:
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            waiting.set()
            real(seconds)

    monkeypatch.setattr(socket_path, "time", Clock)
    return waiting


def _server(path: Path | str) -> FeedServer:
    server = FeedServer(listen=path)
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None)
    return server


def _stopping(server: FeedServer) -> None:
    """Put ``server`` where its stop() is when a new service starts: no
    longer listening, its path still held."""
    assert server._sock is not None
    server._sock.shutdown(socket.SHUT_RDWR)
    server._sock.close()


@contextlib.contextmanager
def _restart_while_stopping(path: str, waiting: threading.Event) -> Iterator[tuple[FeedServer, FeedServer,
                                                                                  threading.Thread, list[Any]]]:
    """A service on ``path`` where its stop() is (no longer listening, the
    path still held), and a new one's start() on it in a thread, waiting
    for the path: (old, new, that thread, what came of the start once it
    ended: "started", or the exception).  Both stopped after."""
    old = _server(path)
    old.start()
    new = _server(path)
    outcome: list[Any] = []

    def start() -> None:
        try:
            new.start()
            outcome.append("started")
        except BaseException as err:  # (the test asserts it)
            outcome.append(err)

    t = threading.Thread(target=start)
    try:
        _stopping(old)
        t.start()
        assert waiting.wait(WAIT), "the new service did not wait for the one still stopping"
        yield old, new, t, outcome
    finally:
        old.stop()
        new.stop()
        if t.ident is not None:
            t.join(WAIT)


def _one_batch(path: str) -> None:
    net = blobfeed.Net(None)
    with blobfeed.attach_source(net, ["id", "x"], 8, "train", path, timeout=10, connect_timeout=10):
        assert net.run(timeout=10)["id"].shape == (8,)


def test_two_services_started_at_once_on_a_stale_path_never_both_listen(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Both found the dead service's socket stale (each held until the other
    had looked too), both unlinked and bound: the second unlinked the
    first's new socket, and the first listened where no consumer could
    reach it, believing it served."""
    path = tmp_path / "feed.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(str(path))  # the file of a service that died: bound once, nobody listens
    dead.close()
    both_looked = threading.Barrier(2, timeout=1.0)
    real_alive = socket_path._alive

    def alive(p: str, bound_too: bool = True) -> Any:
        found = real_alive(p, bound_too)
        with contextlib.suppress(threading.BrokenBarrierError):
            both_looked.wait()  # (only one looks once the path is locked: then this waits 1 s)
        return found

    monkeypatch.setattr(socket_path, "_alive", alive)
    servers = [_server(path), _server(path)]
    outcome: list[Any] = [None, None]

    def start(i: int) -> None:
        try:
            servers[i].start()
            outcome[i] = "started"
        except ValueError as err:
            outcome[i] = err

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 3)
        assert sorted(o == "started" for o in outcome) == [False, True], outcome
        refused = next(o for o in outcome if o != "started")
        assert "another blobfeed service holds this path" in str(refused) and str(path) in str(refused)
        _one_batch(str(path))  # the one that started is reachable where it says it listens
    finally:
        for s in servers:
            s.stop()
    assert not path.exists() and not Path(str(path) + ".lock").exists(), "the stop left a file behind"


def test_a_service_restarted_while_the_last_one_stops_waits_for_it(tmp_path: Path,
                                                                  waiting_for_path: threading.Event) -> None:
    """The old service no longer listens but still stops (saving the state a
    restart resumes from): the new one waits for it rather than taking
    the path from under it, then serves there; the old one's stop removes
    none of the new one's files."""
    path = str(tmp_path / "feed.sock")
    with _restart_while_stopping(path, waiting_for_path) as (old, new, t, outcome):
        assert outcome == [], "the new service took the path of one still stopping"
        old.stop()
        t.join(WAIT * 3)
        assert outcome == ["started"], outcome
        assert os.path.exists(path), "the old service removed the new one's socket file"
        _one_batch(path)
    assert not os.path.exists(path)


def test_a_service_that_listens_is_refused_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "feed.sock")
    first = _server(path)
    first.start()
    try:
        with pytest.raises(ValueError, match="another blobfeed service holds this path .*and listens there"):
            _server(path).start()
        _one_batch(path)
    finally:
        first.stop()


def test_the_socket_file_is_made_0600_without_touching_the_umask(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The umask is the whole process's: set to 0177 around bind(), a file
    any other thread made meanwhile (the user's checkpoint, a log) got mode
    0600 too."""
    calls: list[int] = []
    real_umask = os.umask

    def umask(mask: int) -> int:
        calls.append(mask)
        return real_umask(mask)

    monkeypatch.setattr(os, "umask", umask)
    path = tmp_path / "feed.sock"
    for server in (_server(path), FeedServer()):
        if server.sources == {}:
            server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None)
        server.start()
        try:
            assert server.address is not None
            mode = os.stat(server.address).st_mode
            assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, oct(mode)
            assert calls == [], f"the umask was changed: {calls}"
            leftovers = [p.name for p in Path(server.address).parent.iterdir() if p.name.startswith(".blobfeed-bind")]
            assert leftovers == []
        finally:
            server.stop()


def test_a_lock_file_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    path = tmp_path / "feed.sock"
    os.symlink(target, str(path) + ".lock")
    with pytest.raises(OSError, match="its lock"):
        _server(path).start()
    assert not target.exists(), "a file was made where the planted link points"


def test_a_refused_start_leaves_the_running_service_s_state_file_alone(tmp_path: Path) -> None:
    """A second service started with the same path and state file was
    refused, and its stop then saved its fresh state (position 0, a new
    seed) over the running one's: a resume after a crash of the first
    would have started the data over (found by review)."""
    path, state = tmp_path / "feed.sock", tmp_path / "state.json"
    first = FeedServer(listen=path, state_file=state)
    first.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None, deterministic=True)
    first.start()
    try:
        _one_batch(str(path))
        assert first.save_state()
        saved = state.read_bytes()
        second = FeedServer(listen=path, state_file=state)
        second.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None, deterministic=True)
        with pytest.raises(ValueError, match="another blobfeed service holds this path"):
            second.start()
        assert second.stop()
        assert state.read_bytes() == saved, "the refused service wrote its state over the running one's"
    finally:
        first.stop()


def test_a_stop_requested_while_waiting_for_the_path_ends_the_wait(tmp_path: Path,
                                                                   waiting_for_path: threading.Event) -> None:
    """SIGTERM to a ``blobfeed serve`` waiting for the service that stops on
    its path was ignored for the whole wait (30 s), found by review."""
    with _restart_while_stopping(str(tmp_path / "feed.sock"), waiting_for_path) as (old, new, t, outcome):
        new.request_stop("SIGTERM")
        t.join(WAIT)
        assert not t.is_alive(), "the wait went on after the stop was requested"
        assert outcome and "a stop was requested" in str(outcome[0]), outcome


def test_paths_no_socket_can_have_are_refused_naming_why(tmp_path: Path) -> None:
    for path, why in [
        ("", "not empty, not a directory"), (str(tmp_path) + "/", "not empty, not a directory"),
        (str(tmp_path), "not empty, not a directory"), ("unix:", "not empty, not a directory"),
        (str(tmp_path / ("x" * 120)), "longer than a Unix socket's path may be (107)"),
    ]:
        server = FeedServer(listen=path) if path != "" else None
        if server is None:
            with pytest.raises(ValueError, match=re.escape(why)):
                socket_path.SocketPath("").take()
            continue
        server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None)
        with pytest.raises(ValueError, match=re.escape(why)):
            server.start()
        assert server.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refused path left a file"


def test_a_path_that_fits_is_served_however_long_its_directory(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket was bound under a private twin of its path, about 25
    bytes longer: paths of 83 to 107 bytes (a long TMPDIR, say) failed."""
    deep = tmp_path / ("d" * max(1, 100 - len(str(tmp_path)) - len("/feed.sock") - 1))
    deep.mkdir()
    path = str(deep / "feed.sock")
    assert 98 <= len(path) <= 107, len(path)
    # and the default: a private directory (blobfeed-XXXXXXXX, 17 bytes) in a TMPDIR of ~75 bytes
    tmpdir = tmp_path / ("t" * max(1, 75 - len(str(tmp_path)) - 1))
    tmpdir.mkdir()
    for server in (_server(path), FeedServer()):
        if not server.sources:
            monkeypatch.setattr("tempfile.tempdir", str(tmpdir))
            server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None)
        server.start()
        try:
            assert server.address is not None and stat.S_IMODE(os.stat(server.address).st_mode) == 0o600
            assert len(server.address) > 95, server.address
            _one_batch(server.address)
        finally:
            server.stop()


def test_another_program_s_lock_file_is_never_removed(tmp_path: Path) -> None:
    path = tmp_path / "data"
    theirs = Path(str(path) + ".lock")
    theirs.write_text("pid 1234\n")
    server = _server(path)
    server.start()
    server.stop()
    assert theirs.read_text() == "pid 1234\n"
    theirs.unlink()
    server = _server(path)
    server.start()
    assert theirs.exists()
    server.stop()
    assert not theirs.exists() and not path.exists(), "the service's own lock file was left"


def test_a_lock_shared_with_a_forked_child_is_let_go_at_release(tmp_path: Path) -> None:
    """A process the service's code forked shares the lock's open file: the
    lock lasted until that child exited, and a restart waited for it."""
    path = str(tmp_path / "feed.sock")
    # another program's lock file: never removed, so the restart locks the very file the child shares
    Path(path + ".lock").write_text("pid 1234\n")
    held = socket_path.SocketPath(path)
    sock = held.take()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: holds its copies until told, at most 10 s
        try:
            os.close(w)
            import select
            select.select([r], [], [], 10)
        finally:
            os._exit(0)
    os.close(r)
    try:
        sock.close()
        held.release()
        again = socket_path.SocketPath(path)
        t0 = time.monotonic()
        again.take().close()
        assert time.monotonic() - t0 < 2.0, "the restart waited for the forked child"
        again.release()
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def test_a_service_whose_socket_file_was_removed_is_not_waited_for(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket_path, "NO_FILE_S", 0.2)
    path = tmp_path / "feed.sock"
    first = _server(path)
    first.start()
    try:
        path.unlink()  # a tmp cleaner, an rm
        with pytest.raises(ValueError, match="its socket file is gone"):
            _server(path).start()
    finally:
        first.stop()


def test_the_default_address_under_a_long_tmpdir_names_tmpdir_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    deep = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None)
    with pytest.raises(ValueError, match="the default address is in a new directory of TMPDIR"):
        server.start()
    assert list(deep.iterdir()) == [], "the failed start left its private directory"
    assert server.stop()


def test_a_consumer_that_comes_after_request_stop_is_not_served() -> None:
    """The accept loop checked the stop under way, not the stop asked for: a
    consumer attaching between request_stop() and stop() was welcomed and
    served while /healthz said "stopping" (found by review)."""
    import json

    from blobfeed.service.wire import PROTOCOL

    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None)
    server.start()
    try:
        server.request_stop("test")
        assert server.health() == (False, "stopping")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(WAIT)
        try:
            s.connect(str(server.address))
            s.send(json.dumps({"t": "hello", "protocol": PROTOCOL, "source": "train", "blobs": ["id", "x"],
                               "batch_size": 8, "index": None, "num": None, "pid": os.getpid()}).encode())
            answer = s.recv(1 << 16)
        except OSError:
            answer = b""  # closed on us (a reset): not served either
        finally:
            s.close()
        assert not answer or json.loads(answer)["t"] != "welcome", answer
    finally:
        assert server.stop()


def test_a_server_stopped_before_it_started_does_not_start(tmp_path: Path) -> None:
    server = _server(tmp_path / "feed.sock")
    assert server.stop()
    with pytest.raises(ValueError, match="stopped before it started"):
        server.start()
    assert list(tmp_path.iterdir()) == []


def test_a_ray_address_is_refused_by_a_feed_server_naming_where_it_belongs() -> None:
    """A ``ray://`` address names a Ray service: FeedServer refuses it at
    once rather than binding a Unix socket at a path called ``ray:/...``."""
    with pytest.raises(ValueError, match=r"listen='ray://feeds/train': .*blobfeed\.ray\.serve_on_ray"):
        FeedServer(listen="ray://feeds/train")
