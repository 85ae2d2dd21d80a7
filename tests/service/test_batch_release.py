"""A served batch's slot goes back to the service when the last view of
the batch dies, which is wherever the user drops it: often the main thread,
where Ctrl-C raises KeyboardInterrupt at any Python bytecode.  Python code
run there by the release would have the interrupt swallowed ("Exception
ignored in ...": the user's Ctrl-C lost) and the slot with it, so nothing
but C code runs in the dropping thread (found by review: 1 interrupt in
some 85 000 landed there in a stress run)."""

from __future__ import annotations

import threading
from typing import Iterator

import pytest

import blobfeed
from blobfeed.service import FeedServer
from tests.helpers import python_calls_during, wait_until

from .test_interrupted_attach import serving_one_consumer


@pytest.fixture
def server() -> Iterator[FeedServer]:
    with serving_one_consumer(slots=3) as server:
        yield server


def test_dropping_a_served_batch_runs_no_python_code_in_the_dropping_thread(server: FeedServer) -> None:
    net = blobfeed.Net(None)
    with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, consumer_index=0,
                                num_consumers=1, timeout=10):
        kept = [net.run(timeout=10)]
        net.run(timeout=10)  # the net's workspace lets go of it: the test's are its last views
        assert kept[0]["x"].base is not None  # a view of the service's memory
        calls = python_calls_during(kept.clear)
        assert not calls, f"Python code ran where the batch was dropped: {calls}"
        for _ in range(20):  # and its slot went back (three slots, all of them needed)
            net.run(timeout=5)


def test_batches_kept_and_dropped_elsewhere_go_back_while_the_user_s_loop_is_not_in_run(
    server: FeedServer,
) -> None:
    """Two batches the user kept, dropped in another thread while its loop
    is elsewhere (it sleeps, not in ``run()``): their slots go back to the
    service, which fills them, without a ``run()``.  (The first form of the
    release above kept them until the next ``run()``: the service could not
    prefetch meanwhile, and with several consumers on one dealer starved
    the others; found by review.)"""
    net = blobfeed.Net(None)
    with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, consumer_index=0,
                                num_consumers=1, timeout=10) as att:
        kept = [net.run(timeout=10) for _ in range(2)]  # views: two of the three slots
        net.run(timeout=10)  # a third (a copy: the hand-out keeps one slot circulating)
        dropper = threading.Thread(target=kept.clear)
        dropper.start()
        dropper.join(10)
        # the service fills every slot again: three batches wait for run()
        wait_until(lambda: att.inlet.reader.ready() >= 3, "the dropped batches' slots to go back and be filled", 5)


def test_an_attachment_whose_service_went_away_leaves_no_outbox_thread_without_a_stop() -> None:
    """The service stops and the user never calls ``stop()``: the outbox
    thread, which looks for released batches every 0.02 s, ends with the
    connection (it held the attachment and its mapped memory, and woke 50
    times a second, for the life of the process; found by review)."""
    net = blobfeed.Net(None)
    with serving_one_consumer(slots=3) as server:
        att = blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, consumer_index=0,
                                     num_consumers=1, timeout=10)
        net.run(timeout=10)
        outbox = [t for t in threading.enumerate() if t.name.startswith("blobfeed-attach-out-")]
        assert len(outbox) == 1
    outbox[0].join(10)
    assert not outbox[0].is_alive(), "the outbox thread outlived its connection"
    with pytest.raises(blobfeed.ServiceError):
        net.run(timeout=5)
    assert att.stop()  # (and stop() afterwards still returns)
