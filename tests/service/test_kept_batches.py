"""A consumer that keeps the batches its run() returns: the service's slots
keep circulating (batches past what the slots allow are copied out of the
shared memory), as a local source's worker slots do.  Every wait bounded."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed.service import FeedServer

from . import feeds

SLOTS = 3


def _bs(fetch: Any) -> int:
    """BigFetch's batches of 32 are 2 MiB: assembled in the source's arena."""
    return 32 if isinstance(fetch, feeds.BigFetch) else 8


def _server(fetch: Any, listen: str | None, backend: str = "threads") -> FeedServer:
    server = FeedServer(listen)
    server.serve_source("train", ["id", "x"], fetch, _bs(fetch), 2, slots=SLOTS, epochs=None, backend=backend)
    return server.start()


def fail_the_first_copy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The attachment's first copy of a batch raises MemoryError (as a
    Ctrl-C or a full memory during a big copy would); the list counts the
    copies tried."""
    from blobfeed.service import consumer as consumer_module

    calls: list[int] = []

    class FailingOnce:
        def __getattr__(self, name: str) -> Any:
            return getattr(np, name)

        def array(self, a: Any, *args: Any, **kw: Any) -> np.ndarray:
            calls.append(1)
            if len(calls) == 1:
                raise MemoryError("the test's")
            return np.array(a, *args, **kw)

    monkeypatch.setattr(consumer_module, "np", FailingOnce())
    return calls


@pytest.mark.parametrize("listen, fetch, backend", [
    (None, feeds.Fetch(200), "threads"),            # the consumer's own slots
    (None, feeds.BigFetch(200), "threads"),         # big batches: references into the source's arena
    (None, feeds.BigFetch(200), "processes"),       # whole batches in the worker processes' slots
    ("tcp://127.0.0.1:0", feeds.Fetch(200), "threads"),
], ids=["unix", "unix-arena", "unix-worker-slots", "tcp"])
def test_a_consumer_that_keeps_every_batch_goes_on_getting_batches(listen: str | None, fetch: Any, backend: str,
                                                                    caplog: Any) -> None:
    """It got SLOTS batches, then none: each kept batch held its slot, the
    service had none left to send into, and run() raised DequeueTimeout
    after its whole timeout (600 s by default) without saying why."""
    caplog.set_level(logging.INFO, logger="blobfeed.service")
    with _server(fetch, listen, backend) as server:
        net = blobfeed.Net(None)
        kept: list[dict[str, np.ndarray]] = []
        with blobfeed.attach_source(net, ["id", "x"], _bs(fetch), "train", server.address, timeout=10):
            for _ in range(6 * SLOTS):
                kept.append(net.run(timeout=10))
            if isinstance(fetch, feeds.BigFetch) and backend == "threads":  # the case is what it says
                assert server.sources["train"].arena.region is not None
        ids = [int(i) for out in kept for i in out["id"]]
        assert len(ids) == len(set(ids)) == 6 * SLOTS * _bs(fetch), "a batch came twice, or changed under a kept view"
        # what is kept still reads as it was sent, and stays read-only
        for out in kept:
            np.testing.assert_array_equal(out["x"][:, 0], out["id"].astype(np.float32))
            assert not out["id"].flags.writeable and not out["x"].flags.writeable
        assert any("copied out of the shared memory" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]


def test_a_consumer_that_keeps_only_the_last_batch_gets_views_without_copies(caplog: Any) -> None:
    """``out = net.run()`` keeps one batch (the last) while run() waits for
    the next: the batches stay views of the slots, none is copied."""
    caplog.set_level(logging.INFO, logger="blobfeed.service")
    with _server(feeds.BigFetch(200), None) as server:
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 32, "train", server.address, timeout=10):
            out = None
            for _ in range(6 * SLOTS):
                out = net.run(timeout=10)
                assert out["x"].base is not None  # a view, not a copy of its own
            del out
    assert not any("copied out of the shared memory" in r.getMessage() for r in caplog.records)


def test_a_copy_that_fails_loses_no_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """run() failing while it copied a batch out (a MemoryError, a Ctrl-C
    during a big copy) lost that batch: off the queue, never handed out,
    yet counted as queued, so every acknowledgement after it was one batch
    off and the service ran out of slots.  Now the next run() hands it out."""
    calls = fail_the_first_copy(monkeypatch)
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, slots=SLOTS)
    ids: list[int] = []
    kept: list[dict[str, np.ndarray]] = []
    with server.start():
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, timeout=10):
            failed = 0
            while True:
                try:
                    out = net.run(timeout=10)
                except MemoryError:
                    failed += 1
                    continue
                except blobfeed.EndOfInput:
                    break
                ids.extend(out["id"].tolist())
                kept.append(out)
    assert failed == 1 and calls, (failed, len(calls))
    assert sorted(ids) == feeds.all_ids(2)


def test_a_batch_handed_out_again_is_not_counted_twice() -> None:
    """A batch given back (a net fed by several sources holds the one it
    took when another source times out) goes through the hand-out again:
    it was counted as a second kept batch, and with the slots nearly all
    kept it was copied for nothing."""
    with _server(feeds.Fetch(200), None) as server:
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, timeout=10) as attachment:
            first = net.run(timeout=10)  # kept: one of the SLOTS
            reader = attachment.reader
            again = reader.dequeue(10.0)  # a second one, as run() takes it
            assert attachment.copied == 0
            back = reader.hand_out(again)  # handed out again, as a held batch is
            assert back is again and attachment.copied == 0
            del first, again, back


def test_a_batch_whose_copy_failed_in_a_net_of_two_sources_is_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A net fed by two served sources takes a held batch itself: the batch
    whose copy failed went out as an unchecked view on the next run(), and
    with every other slot kept the stream stalled."""
    fail_the_first_copy(monkeypatch)
    server = FeedServer()
    server.serve_source("a", ["id", "x"], feeds.Fetch(200), 8, 2, slots=SLOTS, epochs=None)
    server.serve_source("b", ["id2", "x2"], feeds.Fetch(200), 8, 2, slots=SLOTS, epochs=None)
    kept, failed = [], 0
    with server.start():
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "a", server.address, timeout=10), \
                blobfeed.attach_source(net, ["id2", "x2"], 8, "b", server.address, timeout=10):
            while len(kept) < 4 * SLOTS:
                try:
                    kept.append(net.run(timeout=10))
                except MemoryError:
                    failed += 1
    assert failed == 1
    ids = [int(i) for out in kept for i in out["id"]]
    assert len(ids) == len(set(ids)) == 4 * SLOTS * 8


def test_a_batch_handed_out_again_with_slots_to_spare_is_counted_once() -> None:
    """Below the bound a batch handed out again was counted a second time,
    so the next batch was copied although a slot was free for it."""
    with _server(feeds.Fetch(200), None) as server:
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, timeout=10) as attachment:
            reader = attachment.reader
            kept = reader.dequeue(10.0)  # one kept: one slot of SLOTS
            assert reader.hand_out(kept) is kept  # handed out again, as a held batch is
            following = reader.dequeue(10.0)
            assert attachment.copied == 0 and following.arrays[1].base is not None
            del kept, following
