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


def test_a_stop_from_another_thread_ends_a_run_that_waits_for_a_batch() -> None:
    """run() waiting for a batch that does not come: the attachment's
    stop() from another thread ends it with EndOfInput, within a bounded time."""
    import queue
    import time

    import pytest

    from tests.helpers import wait_until

    server = FeedServer()
    started = threading.Event()
    release = threading.Event()

    def stuck(worker_id: int, batch_size: int) -> Any:
        started.set()
        release.wait(30)  # no batch until the test lets go (bounded)
        raise StopIteration

    server.serve_source("train", ["id", "x"], stuck, 8, 1)
    server.start()
    try:
        net = blobfeed.Net(None)
        att = blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, timeout=60)
        outcome: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

        def consume() -> None:
            try:
                net.run(timeout=60)
                outcome.put(None)
            except BaseException as exc:  # the outcome is the assertion
                outcome.put(exc)

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        assert started.wait(30), "the fetcher never ran"
        wait_until(lambda: att.reader.waiting, "run() waiting for a batch", 30)
        t0 = time.monotonic()
        assert att.stop(timeout=10)
        err = outcome.get(timeout=10)
        assert time.monotonic() - t0 < 5
        t.join(10)
        assert not t.is_alive()
        with pytest.raises(blobfeed.EndOfInput):
            raise err if err is not None else AssertionError("run() returned a batch after stop()")
    finally:
        release.set()
        server.stop()


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


def _held_batches(server: FeedServer, count: int) -> tuple[Any, list[list[Any]]]:
    """A hand-made consumer of index 0 and the first ``count`` batch entries it was sent."""
    import os

    from .test_service import _records, hand_hello

    s, fds = hand_hello(server.address, index=0)
    for fd in fds:
        os.close(fd)
    s.settimeout(10)
    records = _records(s)
    held: list[list[Any]] = []
    while len(held) < count:
        record = next(records)
        if record["t"] == "batches":
            held += record["items"]
    return s, held


def _ack(g: int, slots: list[int], waited: float = 0.0) -> bytes:
    return b'{"t":"ack","g":%d,"slots":[%s],"waited":%r}' % (g, ",".join(map(str, slots)).encode(), waited)


def test_acknowledgements_that_arrive_together_count_together_each_checked(caplog: Any) -> None:
    """The service's receiver reads a consumer's records in bursts and counts
    a burst's acknowledgements at once (one settling, one wake-up of the
    sender): every one of them counts, with its wait and its freed slot,
    and one that goes back behind the one before it still breaks the
    protocol (the ones before it count)."""
    import json
    import logging

    import pytest

    from tests.helpers import wait_until

    caplog.set_level(logging.WARNING, logger="blobfeed.service")
    server = _serve(feeds.CALLS, slots=16, num_consumers=1)
    try:
        s, held = _held_batches(server, 16)
        counts = server.sources["train"].counts
        for g, slot, *_ in held[:8]:  # sent back to back: read in one burst or a few
            s.send(_ack(g, [slot], 0.1 * g))
        wait_until(lambda: counts.acknowledged["0"] == 8, "the 8 acknowledgements counted", 10)
        assert counts.run_waited["0"] == pytest.approx(0.1 * held[7][0])
        # their 8 slots came back: 8 more batches come
        more: list[Any] = []
        while len(more) < 8:
            data = s.recv(1 << 16)
            assert data, "the service closed the connection"
            record = json.loads(data)
            if record["t"] == "batches":
                more += record["items"]
        assert [e[0] for e in more] == [e[0] + 8 for e in held[8:16]]
        # two at once, the second behind the first: the first counts, the second is a lie
        s.send(_ack(held[9][0], [], 1.0))
        s.send(_ack(held[8][0], [], 1.0))
        wait_until(lambda: server.sources["train"].connected == 0, "the liar disconnected", 10)
        assert counts.acknowledged["0"] == 10
        s.close()
    finally:
        server.stop()
    warned = [r.getMessage() for r in caplog.records]
    assert any(f"acknowledged items up to {held[8][0]}" in m and "connection closed" in m for m in warned), warned


def test_acknowledgements_before_a_broken_record_count() -> None:
    """A consumer whose acknowledgements are followed by a record that breaks
    the protocol is disconnected; what it acknowledged before counts (its
    run() returned those batches), and only the rest is dealt again."""
    from tests.helpers import wait_until

    server = _serve(feeds.CALLS, slots=16, num_consumers=1)
    try:
        s, held = _held_batches(server, 16)
        source = server.sources["train"]
        s.send(_ack(held[0][0], [held[0][1]]))
        s.send(_ack(held[1][0], [held[1][1]]))
        s.send(b"not a record")
        wait_until(lambda: source.connected == 0, "the consumer disconnected", 10)
        assert source.counts.acknowledged["0"] == 2
        s.close()
    finally:
        server.stop()
