"""Process workers met by a careful adversary: a malformed chunk that comes
through shared memory, a helper process forked by ``fetch_fun`` under every
start method, and a corrupt frame on a worker's pipe.  Each of these hung
the source or ``stop()`` before its fix."""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import blobfeed
from blobfeed import ChunkError, FetcherError, Net, ProcessBackend, init_data_input_workers

from .helpers import wait_until

WAIT = 5.0


def flat_wide(worker_id: int, batch_size: int) -> list[np.ndarray]:
    """Malformed for batch_columns=[1]: a 1-D array (80 KB: it travels through a slot)."""
    return [np.zeros(20_000, np.float32)]


def test_a_malformed_chunk_in_shared_memory_is_a_chunk_error_not_a_hang() -> None:
    """The receiver read the chunk's batch axis (to decide whether to copy it
    out of its slot) before the intake validated it: an IndexError killed the
    receiver and the source waited for its timeout."""
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, ["x"], flat_wide, 4, num_worker_threads=1, batch_columns=[1],
                            backend="processes", coordinator=gc, timeout=WAIT)
    gc.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ChunkError, match="batch axis 1"):
            net.run(timeout=WAIT)
        assert time.monotonic() - t0 < 1.5
    finally:
        assert gc.stop(timeout=WAIT)


class ForksAHelper:
    """Each worker forks a long-lived helper on its first call (which inherits
    whatever the worker holds), then returns small chunks for ever."""

    def __init__(self, pidfile: str) -> None:
        self.pidfile = pidfile
        self.forked = False

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if not self.forked:
            self.forked = True
            pid = os.fork()
            if pid == 0:  # the helper: sleeps until killed, holding every inherited fd
                try:
                    time.sleep(60)
                finally:
                    os._exit(0)
            with open(f"{self.pidfile}.{worker_id}", "w") as f:
                f.write(str(pid))
        return [np.arange(8, dtype=np.int64)]


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_helper_forked_by_fetch_fun_does_not_hold_up_stop_with_any_start_method(
    tmp_path: Path, start_method: str
) -> None:
    """With spawn, the worker inherits the write end of the pipe its
    sentinel reads, so a helper it forks kept the sentinel from ever firing:
    stop() returned False after 5 s, blobfeed's receiver, watcher and slot
    threads still running."""
    pidfile = str(tmp_path / "helper")
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    helpers: list[int] = []
    try:
        init_data_input_workers(net, ["x"], ForksAHelper(pidfile), 4, num_worker_threads=1,
                                backend=ProcessBackend(start_method=start_method), coordinator=gc)
        gc.start()
        for _ in range(5):
            net.run(timeout=WAIT)
        # the helper is forked in the worker process: its pid file is the signal
        wait_until(lambda: any(p.name.startswith("helper.") for p in tmp_path.iterdir()),
                   "the worker to fork its helper")
        helpers = [int(p.read_text() or 0) for p in tmp_path.iterdir() if p.name.startswith("helper.")]
        t0 = time.monotonic()
        ok = gc.stop(timeout=WAIT)
        took = time.monotonic() - t0
        assert ok is True and took < 2.0, f"stop() -> {ok} after {took:.2f} s"
    finally:
        for pid in helpers:
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass


def test_a_frame_claiming_more_than_ever_arrives_is_the_worker_ending_not_a_memory_error() -> None:
    """A worker's pipe is untrusted input (a helper fetch_fun forked holds
    its write end): a length of 2**62 in a frame made the receiver allocate
    it up front (MemoryError, the receiver dead, the source hanging).  Now
    the message grows with what arrives, and the worker's end (its
    sentinel) ends the stream."""
    from blobfeed.feeders.transport import MessageReader

    data_r, data_w = os.pipe()
    end_r, end_w = os.pipe()
    try:
        reader = MessageReader(data_r, end_r)
        os.write(data_w, struct.pack("<Q", 1 << 62) + b"only a little")
        os.close(end_w)  # the worker process ended
        end_w = -1
        assert reader.recv() is None
    finally:
        for fd in (data_r, data_w, end_r, end_w):
            if fd >= 0:
                os.close(fd)


def test_the_reader_takes_messages_whole_however_the_pipe_cuts_them() -> None:
    """The parent reads a worker's pipe as whole messages:
    messages that came in one write, one cut over several writes, one
    longer than the pipe holds after short ones, and a last one cut short
    by the worker's end, each as it was sent (the last: the stream's end)."""
    from blobfeed.feeders.transport import MessageReader

    def frame(body: bytes) -> bytes:
        return struct.pack("<Q", len(body)) + body

    data_r, data_w = os.pipe()
    end_r, end_w = os.pipe()
    long_body = bytes(range(256)) * 800  # 200 KiB: more than a pipe holds
    got: list[bytes] = []
    writer: threading.Thread | None = None

    def message() -> bytes:
        m = reader.recv()
        assert m is not None, "the stream ended early"
        return bytes(m)

    try:
        reader = MessageReader(data_r, end_r)
        os.write(data_w, frame(b"a") + frame(b"") + frame(b"bcd"))
        assert [message() for _ in range(3)] == [b"a", b"", b"bcd"]
        split = frame(b"0123456789")
        os.write(data_w, split[:3])
        os.write(data_w, split[3:11])
        os.write(data_w, split[11:] + frame(b"x")[:5])
        assert message() == b"0123456789"
        stream = frame(b"x")[5:] + frame(long_body) + frame(b"after")

        def write_all() -> None:
            with open(data_w, "wb", closefd=False) as f:
                f.write(stream)

        writer = threading.Thread(target=write_all)  # longer than the pipe's buffer
        writer.start()
        for _ in range(3):
            got.append(message())
        writer.join(WAIT)
        assert got[0] == b"x" and got[1] == long_body and got[2] == b"after"
        os.write(data_w, frame(b"cut short")[:-2])
        os.close(end_w)  # the worker process ended
        end_w = -1
        assert reader.recv() is None
    finally:
        if writer is not None:
            writer.join(WAIT)
        for fd in (data_r, data_w, end_r, end_w):
            if fd >= 0:
                os.close(fd)


def test_a_message_the_receiver_cannot_take_fails_the_source_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever goes wrong while the receiver takes a worker's message (a
    message it cannot make sense of, or a bug of blobfeed's) fails the source
    with a FetcherError naming the worker, never a dead receiver and a
    consumer waiting for its timeout."""
    from blobfeed.feeders import processes

    def broken(self: object, data: bytearray) -> None:
        raise RuntimeError("a message this receiver cannot take")

    monkeypatch.setattr(processes._Worker, "_handle", broken)
    gc = blobfeed.GlobalCoordinator()
    net = Net(name="n")
    init_data_input_workers(net, ["x"], flat_wide, 4, num_worker_threads=1, backend="processes",
                            coordinator=gc, timeout=WAIT)
    gc.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(FetcherError, match="worker 0.*cannot take"):
            net.run(timeout=WAIT)
        assert time.monotonic() - t0 < 1.5
    finally:
        assert gc.stop(timeout=WAIT)
