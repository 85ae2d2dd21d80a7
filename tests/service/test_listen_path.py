"""A service's Unix socket path: who may take it, and how its file is made."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

import blobfeed
from blobfeed.service import FeedServer, socket_path

from . import feeds

WAIT = 5.0


def _server(path: Path | str) -> FeedServer:
    server = FeedServer(listen=path)
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 1, epochs=None)
    return server


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

    def alive(p: str) -> Any:
        found = real_alive(p)
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


def test_a_service_restarted_while_the_last_one_stops_waits_for_it(tmp_path: Path) -> None:
    """The old service no longer listens but still stops (saving the state a
    restart resumes from): the new one waits for it rather than taking
    the path from under it, then serves there; the old one's stop removes
    none of the new one's files."""
    path = str(tmp_path / "feed.sock")
    old = _server(path)
    old.start()
    new = _server(path)
    started = threading.Event()
    failed: list[BaseException] = []

    def start_new() -> None:
        try:
            new.start()
            started.set()
        except BaseException as err:  # (reported below)
            failed.append(err)

    t = threading.Thread(target=start_new)
    try:
        assert old._sock is not None
        old._sock.shutdown(socket.SHUT_RDWR)  # where its stop() is when the new one starts
        old._sock.close()
        t.start()
        assert not started.wait(0.3), "the new service took the path of one still stopping"
        old.stop()
        t.join(WAIT * 3)
        assert not failed, failed
        assert started.is_set()
        assert os.path.exists(path), "the old service removed the new one's socket file"
        _one_batch(path)
    finally:
        old.stop()
        new.stop()
        t.join(WAIT)
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
