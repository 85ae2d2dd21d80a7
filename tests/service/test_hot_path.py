"""The feeding service's per-batch path (issue 25, S2: small batches):
what each batch costs in wake-ups and records, on the consumer and on the
service, beside what it must still do (every batch once, acknowledged
before run() returns it, its slot back to the service)."""

from __future__ import annotations

import re
import threading
from typing import Any

import blobfeed
from blobfeed.service import FeedServer

from . import feeds


def _switches(thread: threading.Thread) -> int:
    """Context switches of ``thread`` so far (each time it slept and woke, or was preempted)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        return sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)


def _serve(calls: int, **kw: Any) -> FeedServer:
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(calls), 8, 2, **kw)
    return server.start()


def test_a_batch_the_net_lets_go_of_wakes_no_other_thread_of_the_consumer() -> None:
    """Each run() replaces the workspace's last batch, so that batch's views
    die inside run(), in the net's own thread: its slot went to the outbox
    thread, woken once per batch to find, nearly always, that the next
    acknowledgement had taken the slot already (S2: a fifth of a consumer's
    CPU, half its context switches).  Now the slot waits for the net's next
    acknowledgement, or its next wait: the outbox thread sleeps."""
    with _serve(300) as server:
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, timeout=30) as att:
            outbox = att._threads[1]
            assert outbox.name.startswith("blobfeed-attach-out")
            for _ in range(3):
                net.run(timeout=30)
            before = _switches(outbox)
            runs = 60
            for _ in range(runs):
                net.run(timeout=30)
            woke = _switches(outbox) - before
    assert woke < runs // 6, f"the outbox thread woke {woke} times in {runs} runs"


def test_slots_the_net_let_go_of_come_back_before_it_waits() -> None:
    """The slots kept for the next acknowledgement come back before the
    net waits when the service may be short of them: a user keeping its
    last two batches holds two of 3 slots, the third is kept back, and the
    service has none to send the next batch in (without the return before
    the wait, run() would time out).  Every batch once, to the end."""
    with _serve(feeds.CALLS, slots=3) as server:
        net = blobfeed.Net(None)
        got, last = [], []
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, timeout=10):
            while True:
                try:
                    out = net.run(timeout=10)
                except blobfeed.EndOfEpoch:
                    continue
                except blobfeed.EndOfInput:
                    break
                got.extend(int(i) for i in out["id"])
                last = [out, *last][:2]  # the user keeps its last two batches
                del out
    assert sorted(got) == feeds.all_ids(2)


def test_a_batch_laid_out_as_the_last_is_still_checked_for_its_slot(tmp_path: Any) -> None:
    """A consumer checks a batch's layout once and compares the next
    batches' with it (most share it): the slot each names is still checked,
    and a layout that differs in anything is checked afresh."""
    import pytest

    from .test_service import ID8, X8, FakeUnixService, batches_record

    cases = [
        (batches_record([0, 0, 8, [ID8, X8]], [1, 7, 8, [ID8, X8]]), "batch in slot 7, of 3"),
        (batches_record([0, 0, 8, [ID8, X8]], [1, 1, 8, [ID8, ["<f4", [8, 3], 1000]]]), "do not fit a slot of 1024"),
        (batches_record([0, 0, 8, [ID8, X8]], [1, 1, 7, [ID8, X8]]), "bad shape"),
        # equal to the last layout as Python compares, not as JSON wrote it
        (batches_record([0, 0, 8, [ID8, X8]], [1, 1, 8, [ID8, ["<f4", [8, 3], 64.0]]]), "must be [dtype, shape, offset]"),
        (batches_record([0, 0, 8, [ID8, X8]], [1, 1, 8, [ID8, ["<f4", [8, 3.0], 64]]]), "bad shape"),
    ]
    for k, (record, expected) in enumerate(cases):
        fake = FakeUnixService(tmp_path / f"fake{k}.sock", [record])
        try:
            net = blobfeed.Net(None)
            with blobfeed.attach_source(net, ["id", "x"], 8, "train", fake.address, timeout=10):
                with pytest.raises(blobfeed.ServiceError, match=re.escape(expected)):
                    for _ in range(2):  # the first batch is good: the second fails the record
                        net.run(timeout=10)
        finally:
            fake.close()


def test_a_consumer_with_every_slot_in_use_gets_its_freed_slots_refilled_together() -> None:
    """A consumer slower than the service has every slot in use (its queue
    full); it frees one per batch its run() returns.  The service sent one
    record per freed slot: a batch, a record and a wake-up on both sides
    each.  Now, while the consumer still has half its slots' batches to
    return, the service waits for a quarter of the slots (at most 0.1 s)
    and sends those batches in one record."""
    import json
    import os
    import time

    from .test_service import _records, hand_hello

    server = _serve(feeds.CALLS, slots=16, num_consumers=1)
    try:
        s, fds = hand_hello(server.address, index=0)
        for fd in fds:
            os.close(fd)
        s.settimeout(10)
        records = _records(s)
        held = []
        while len(held) < 16:
            record = next(records)
            if record["t"] == "batches":
                held += record["items"]
        assert len(held) == 16  # every slot in use: nothing more until one is freed
        for g, slot, *_ in held[:4]:
            # the consumer's pace: one returned every 10 ms (well within the 0.1 s bound)
            s.send(json.dumps({"t": "ack", "g": g, "slots": [slot], "waited": 0.0}).encode())
            time.sleep(0.01)
        record = next(records)
        assert record["t"] == "batches" and len(record["items"]) == 4, record
        s.close()
    finally:
        server.stop()
