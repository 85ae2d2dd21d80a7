"""A worker process's shared area (feeders/transport.py's ``SlotArea``): its
header is written by one process while the other reads it."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from blobfeed.feeders.transport import SlotArea

#: reads the other process makes while this one keeps writing
READS = 400_000


def _read_header(fd: int, reads: int, conn: multiprocessing.connection.Connection) -> None:
    area = SlotArea(fd, 1, 4096)
    conn.send("ready")
    seen: dict[tuple[str, int], int] = {}
    for _ in range(reads):
        for name, value in (("hint", area.hint()), ("whole", area.whole()), ("viewed", area.viewed())):
            if value not in (64, 700):
                seen[(name, value)] = seen.get((name, value), 0) + 1
    conn.send(seen)
    area.close()


@pytest.mark.timeout(60)
def test_a_header_field_rewritten_with_its_own_value_never_reads_otherwise_in_the_worker() -> None:
    """The parent rewrites the batch-size hint and the whole-batch size at
    every message from a worker, with the values they already hold.  A
    worker reading them meanwhile must see those values: a write that went
    through zero (``struct.pack_into`` clears its bytes first) once made a
    worker send the batch it was filling early, as a smaller chunk, and
    every batch of the stream after it straddled two chunks (one copy each),
    and could hand a fetcher a batch size of 0."""
    area, fd = SlotArea.create("test-header", 1, 4096)
    try:
        area.set_hint(64)
        area.set_whole(64)
        area.set_viewed(700)  # a value of two bytes: a torn write or read would show
        ctx = multiprocessing.get_context("fork")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_read_header, args=(fd, READS, there), daemon=True)
        proc.start()
        try:
            assert here.poll(30) and here.recv() == "ready"
            deadline = time.monotonic() + 30
            while not here.poll() and proc.is_alive() and time.monotonic() < deadline:
                for _ in range(1000):
                    area.set_hint(64)
                    area.set_whole(64)
                    area.set_viewed(700)
            assert here.poll(5), f"the reader sent nothing (exit code {proc.exitcode})"
            seen = here.recv()
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        assert proc.exitcode == 0
        assert seen == {}, f"values the worker read that were never written: {seen}"
    finally:
        area.close()
        os.close(fd)
