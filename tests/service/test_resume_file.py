"""The service's ``--resume`` state file is untrusted input: what it is
(a regular file, not a FIFO or a device), how big it is, how long its
``acked_after`` lists are and what its saved seeds are, each checked
before anything is wired, with a ``ValueError`` naming the file and what
was wrong (found by review: a FIFO blocked ``FeedServer()`` forever,
``/dev/zero`` ended in an unwrapped ``MemoryError``, a 210 MB file was
read whole, a saved seed of -1 surfaced from ``serve_source`` naming
neither the file nor the field).  Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from blobfeed.service import FeedServer
from blobfeed.service import state_file as server_module

#: the documented limits (docs/SERVICE.md)
STATE_FILE_CAP = 256 << 20
ACKED_AFTER_CAP = 1 << 20


def minimal(**source: Any) -> dict[str, Any]:
    """A state of the right shape for read_state: one source, ``source`` its fields."""
    return {"version": 1, "sources": {"train": {"inner": {}, **source}}}


def write(tmp_path: Path, state: Any, pad: int = 0) -> Path:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state) + " " * pad)
    return path


def refused(path: Path | str) -> str:
    """The message of the ValueError ``FeedServer(resume=True)`` raises for ``path``."""
    with pytest.raises(ValueError) as err:
        FeedServer(state_file=path, resume=True)
    message = str(err.value)
    assert repr(str(path)) in message, message  # it names the file
    return message


def test_the_limits_are_the_documented_ones() -> None:
    assert server_module.MAX_STATE_FILE_BYTES == STATE_FILE_CAP
    assert server_module.MAX_ACKED_AFTER == ACKED_AFTER_CAP


def test_a_fifo_is_refused_at_once_and_does_not_block(tmp_path: Path) -> None:
    """open() of a FIFO with no writer blocked FeedServer.__init__ forever."""
    fifo = tmp_path / "state.json"
    os.mkfifo(fifo)
    got: list[BaseException | None] = []

    def resume() -> None:
        try:
            FeedServer(state_file=fifo, resume=True)
            got.append(None)
        except BaseException as err:
            got.append(err)

    t = threading.Thread(target=resume, daemon=True)
    t.start()
    t.join(timeout=20)
    if t.is_alive():
        # the old code: blocked in open(); a writer that opens and closes
        # lets it go on (EOF), so that the test leaves no thread behind
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(timeout=20)
        pytest.fail("FeedServer(state_file=<a FIFO>, resume=True) blocked (more than 20 s)")
    assert got and isinstance(got[0], ValueError), got
    message = str(got[0])
    assert repr(str(fifo)) in message and "is a FIFO, not a regular file" in message, message


def test_a_character_device_is_refused_as_such() -> None:
    """/dev/zero was read until memory ran out; /dev/null (the same path,
    without the danger) is refused for what it is, before reading."""
    message = refused("/dev/null")
    assert "is a character device, not a regular file" in message, message


def test_a_socket_file_is_refused_as_such(tmp_path: Path) -> None:
    path = tmp_path / "state"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        message = refused(path)
    finally:
        sock.close()
    assert "is a socket, not a regular file" in message, message


@pytest.mark.parametrize("case", ["missing", "directory", "invalid utf-8", "nested too deeply", "not json"])
def test_what_was_refused_cleanly_before_still_is(tmp_path: Path, case: str) -> None:
    path = tmp_path / "state.json"
    if case == "directory":
        path.mkdir()
    elif case == "invalid utf-8":
        path.write_bytes(b'{"version": 1, "sources": {"\xff\xfe": {}}}')
    elif case == "nested too deeply":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "not json":
        path.write_text("{")
    message = refused(path)
    expected = {
        "missing": "no state file", "directory": "is a directory, not a regular file",
        "invalid utf-8": "is not a service state", "nested too deeply": "nested too deeply",
        "not json": "is not a service state",
    }[case]
    assert expected in message, message


def test_a_file_over_the_cap_is_refused_naming_its_size_and_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A well-shaped 210 MB file was read whole (819 MB resident); the cap
    is lowered here so that the test writes 5000 bytes, not 256 MiB."""
    monkeypatch.setattr(server_module, "MAX_STATE_FILE_BYTES", 4096)
    state = minimal()
    path = write(tmp_path, state, pad=5000 - len(json.dumps(state)))
    assert path.stat().st_size == 5000
    message = refused(path)
    assert "5000 bytes" in message and "4096" in message and "MAX_STATE_FILE_BYTES" in message, message
    # at the cap exactly: read
    write(tmp_path, state, pad=4096 - len(json.dumps(state)))
    FeedServer(state_file=path, resume=True).stop()


def test_a_file_past_the_real_cap_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A sparse file one byte over the cap: refused from its size (reading
    it would take 256 MiB and seconds)."""
    path = tmp_path / "state.json"
    with open(path, "wb") as f:
        f.truncate(STATE_FILE_CAP + 1)
    message = refused(path)
    assert f"{STATE_FILE_CAP + 1} bytes" in message and str(STATE_FILE_CAP) in message, message


def test_a_file_that_grows_while_it_is_read_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most the cap and one byte are read, whatever fstat said: a file
    that grows after fstat (here: fstat says it is small) is refused."""
    monkeypatch.setattr(server_module, "MAX_STATE_FILE_BYTES", 4096)
    state = minimal()
    path = write(tmp_path, state, pad=5000 - len(json.dumps(state)))
    real_fstat = os.fstat

    def small_fstat(fd: int) -> os.stat_result:
        st = list(real_fstat(fd))
        st[6] = 100  # st_size
        return os.stat_result(st)

    with monkeypatch.context() as m:
        m.setattr(os, "fstat", small_fstat)
        message = refused(path)
    assert "more than" in message and "4096" in message, message


def test_running_out_of_memory_while_reading_is_a_value_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/dev/zero (under a ulimit) ended in a MemoryError, unwrapped."""
    path = write(tmp_path, minimal())

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError

    with monkeypatch.context() as m:
        m.setattr(json, "load", no_memory)
        m.setattr(json, "loads", no_memory)
        message = refused(path)
    assert "out of memory" in message, message


def test_acked_after_is_bounded_naming_the_field(tmp_path: Path) -> None:
    """Each item was checked, not the list's length: a file of 15 million
    entries was read whole and kept as a set."""
    path = write(tmp_path, minimal(acked_after=[0] * (ACKED_AFTER_CAP + 1)))
    message = refused(path)
    assert "state['sources']['train']['acked_after']" in message, message
    assert f"at most {ACKED_AFTER_CAP}" in message and f"{ACKED_AFTER_CAP + 1}" in message, message
    write(tmp_path, minimal(acked_after=list(range(ACKED_AFTER_CAP))))
    FeedServer(state_file=path, resume=True).stop()


@pytest.mark.parametrize("seed", [-1, [-1], [3, -1], "x", 1.5, True, [True], [], None, ["7"]])
def test_a_saved_seed_is_checked_with_the_state_naming_the_file_and_field(tmp_path: Path, seed: Any) -> None:
    """The seed a resumed source is wired with came from the state before
    it was checked: -1 surfaced from serve_source as "seed must be >= 0,
    got -1", naming neither the file nor the field."""
    path = write(tmp_path, minimal(inner={"seed": seed}))
    message = refused(path)
    assert "state['sources']['train']['inner']['seed']" in message, message
    assert re.search(r"expected an int >= 0 or a non-empty list of them", message), message


@pytest.mark.parametrize("seed", [0, 7, 2**64, [5], [5, 6]])
def test_a_good_saved_seed_is_read(tmp_path: Path, seed: Any) -> None:
    path = write(tmp_path, minimal(inner={"seed": seed}))
    FeedServer(state_file=path, resume=True).stop()


def test_a_state_a_resume_would_refuse_is_not_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """save_state wrote whatever state_dict() gave: a state over the limits
    a resume reads was written over the last good one, and the resume
    then refused it.  Now it is not written (a warning says why), and the
    file keeps the last state a resume can read."""
    from . import feeds

    path = tmp_path / "state.json"
    server = FeedServer(state_file=path)
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, deterministic=True)
    server.start()
    try:
        assert server.save_state()
        good = path.read_bytes()
        with monkeypatch.context() as m, caplog.at_level("WARNING", logger="blobfeed.service"):
            m.setattr(server_module, "MAX_STATE_FILE_BYTES", len(good) - 1)
            assert not server.save_state()
            assert path.read_bytes() == good
            assert f"{len(good)} bytes" in caplog.text and "MAX_STATE_FILE_BYTES" in caplog.text, caplog.text
            caplog.clear()
            m.setattr(server_module, "MAX_STATE_FILE_BYTES", 1 << 28)
            m.setattr(server_module, "MAX_ACKED_AFTER", 2)
            saved = json.loads(good)
            saved["sources"]["train"]["acked_after"] = [0, 1, 2]
            m.setattr(server, "state_dict", lambda source=None: saved)
            assert not server.save_state()
            assert path.read_bytes() == good
            assert "state['sources']['train']['acked_after']" in caplog.text and "3" in caplog.text, caplog.text
    finally:
        assert server.stop()
    FeedServer(state_file=path, resume=True).stop()  # the file left is one a resume reads


def _serving_deterministic(path: Path, **kw: Any) -> FeedServer:
    from . import feeds

    server = FeedServer(state_file=path, **kw)
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, deterministic=True)
    server.start()
    return server


def test_a_state_that_cannot_be_written_is_a_warning_and_the_stop_cleans_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A save that failed (a full disk, a read-only directory) raised out of
    save_state: from stop() it skipped everything after the save (the
    coordinator's stop, the threads' joins, the socket's removal), and from
    the monitor thread it ended that thread (no periodic save, no grace
    period enforced after it; a review found both).  Now it is a warning
    naming the file and the cause; the state saved last stays, and stop()
    says False but cleans up."""
    path = tmp_path / "state.json"
    server = _serving_deterministic(path)
    assert server.save_state()
    good = path.read_bytes()
    address = str(server.address)

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the disk is full
    with caplog.at_level("WARNING", logger="blobfeed.service"):
        assert server.save_state() is False
        assert "state not saved to" in caplog.text and str(path) in caplog.text, caplog.text
        assert "No space left on device" in caplog.text
        assert server.stop() is False  # its state could not be saved
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["state.json"]  # no temporary file left
    assert not os.path.exists(address)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("blobfeed-")]


def test_two_saves_at_once_both_write_a_whole_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save wrote through one temporary name: a save during another
    (the monitor's periodic one and stop()'s, or the user's) found the file
    renamed away under it and raised."""
    path = tmp_path / "state.json"
    server = _serving_deterministic(path)
    # both saves at once meet here within milliseconds; one at a time (the
    # fix) the first waits this long alone, then both go on
    inside = threading.Barrier(2, timeout=2)
    fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        try:
            inside.wait()  # both saves between their write and their rename
        except threading.BrokenBarrierError:
            pass
        fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    got: list[Any] = []

    def save() -> None:
        try:
            got.append(server.save_state())
        except Exception as exc:  # the defect: one of them raised
            got.append(exc)

    savers = [threading.Thread(target=save) for _ in range(2)]
    try:
        for t in savers:
            t.start()
        for t in savers:
            t.join(20)
        assert got == [True, True], got
        json.loads(path.read_text())
    finally:
        monkeypatch.setattr(os, "fsync", fsync)
        assert server.stop()
    assert not [p for p in os.listdir(tmp_path) if p != "state.json"]


def test_a_file_of_many_small_values_is_refused_before_it_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A state file under the size cap cost about 25 times its size once
    parsed (a list of `{}`: 3 bytes each, 72 parsed): at the cap, several
    GB.  The JSON values a file holds are counted before it is parsed
    (MAX_STATE_VALUES), and a state past it is neither read nor saved."""
    path = tmp_path / "state.json"
    monkeypatch.setattr(server_module, "MAX_STATE_VALUES", 10_000)
    text = '{"version": 1, "sources": {}, "junk": [' + ",".join(["{}"] * 20_000) + "]}"
    path.write_text(text)
    counted = text.count(",") + text.count("[") + text.count("{")
    parsed = []
    real_loads = server_module.json.loads
    monkeypatch.setattr(server_module.json, "loads", lambda text: parsed.append(1) or real_loads(text))
    message = refused(path)
    assert not parsed, "parsed before it was refused"
    assert "MAX_STATE_VALUES" in message and "10000" in message and str(counted) in message, message
    monkeypatch.setattr(server_module.json, "loads", real_loads)
    server = _serving_deterministic(tmp_path / "saved.json")
    try:
        assert server.save_state()
        good = (tmp_path / "saved.json").read_bytes()
        monkeypatch.setattr(server_module, "MAX_STATE_VALUES", 3)
        with caplog.at_level("WARNING", logger="blobfeed.service"):
            assert not server.save_state()
        assert (tmp_path / "saved.json").read_bytes() == good
        assert "MAX_STATE_VALUES" in caplog.text, caplog.text
    finally:
        assert server.stop()
