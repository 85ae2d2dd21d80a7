"""The feeding service's sources, health, state and stop (issue 24):
each source lives and ends on its own, ``/healthz`` and ``/readyz`` say
what the service is doing, a state file is checked at every level, and
``--listen`` refuses what is not its own.  Every wait is bounded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

import blobfeed
from blobfeed.service import FeedServer

from . import feeds
from .test_service import wait_for


def run_batches(net: blobfeed.Net, n: int) -> list[list[int]]:
    """``n`` batches of ``net`` (epoch ends skipped), each run() bounded."""
    got = []
    while len(got) < n:
        try:
            got.append(net.run(timeout=20)["id"].tolist())
        except blobfeed.EndOfEpoch:
            continue
    return got


def test_one_source_failing_its_grace_period_leaves_the_others_serving() -> None:
    """ServedSource.fail stopped the coordinator every source of the
    service shares: a consumer of an unrelated endless source got
    EndOfInput a moment later, with no error."""
    server = FeedServer()
    server.serve_source("a", ["id", "x"], feeds.Fetch(), 8, 2, deterministic=True, num_consumers=2,
                        grace_period=0.3, epochs=None)
    server.serve_source("b", ["id", "x"], feeds.Fetch(), 8, 2, epochs=None)
    server.start()
    try:
        b_net = blobfeed.Net(None, name="b")
        with blobfeed.attach_source(b_net, ["id", "x"], 8, "b", server.address):
            run_batches(b_net, 3)
            a_net = blobfeed.Net(None, name="a")
            with blobfeed.attach_source(a_net, ["id", "x"], 8, "a", server.address, consumer_index=1):
                run_batches(a_net, 1)
            # index 1 left and does not come back: "a" fails after 0.3 s
            a_inner = server.sources["a"].feeds[0].source
            wait_for(lambda: server.sources["a"].error is not None and a_inner.stopped, 20, "'a' failed and stopped")
            assert "consumer 1 left and did not come back" in str(server.sources["a"].error)
            # "b" goes on: far more batches than its consumer's slots and queues held
            assert len(run_batches(b_net, 200)) == 200
            assert server.sources["b"].error is None and not server.sources["b"].feeds[0].source.stopped
    finally:
        assert server.stop()
