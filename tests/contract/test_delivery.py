"""Delivery: every sample exactly once, in batches of exactly ``batch_size``
(an epoch's last one smaller, or dropped with ``drop_last``), blobs aligned;
several nets on one source; and the accounting identity at the end.

docs/CONTRACT.md: "Re-batching guarantees", "Shared input sources", "Fetcher backends,
order and resume", the metrics ``blobfeed_*_samples``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import blobfeed
from blobfeed import EndOfEpoch, EndOfInput

from .fetchers import Fetch
from .util import (
    ALL_MODES, BS, ORDERED_CONTENT, WAIT, assert_identity, by_epoch, check_batches,
    check_chunks_kept_together, check_exactly_once, drain_all, epochs_of, ids_of, matrix, metric, wire,
)

#: uneven workers (one far longer), a big chunk from two of them (shared
#: memory for a worker process, its own object for Ray)
LENGTHS = (6, 2, 9)
BIG_AT = {(0, 1), (2, 4)}


@matrix(ALL_MODES, extra=("drop_last", {"last-partial": False, "drop-last": True}),
        ray=[("arrival", "last-partial"), ("arrival", "drop-last"), ("det-shuffle", "drop-last")])
def test_every_sample_exactly_once_in_exact_batches(gc: blobfeed.GlobalCoordinator, backend: Any,
                                                    backend_name: str, mode: str, drop_last: bool) -> None:
    fetch = Fetch(LENGTHS, salt=1, big_at=BIG_AT)
    (net,), (workers,) = wire(gc, backend, mode, fetch, drop_last=drop_last)
    gc.start()
    (events,) = drain_all([net])
    # the end is for good: run() raises EndOfInput (not an epoch's end) again, at once
    t0 = time.monotonic()
    with pytest.raises(EndOfInput) as again:
        net.run(timeout=WAIT)
    assert not isinstance(again.value, EndOfEpoch), f"another epoch end after the last: {again.value!r}"
    assert time.monotonic() - t0 < 0.5, "run() of an ended source must raise EndOfInput at once"
    epochs = epochs_of(mode)
    check_batches(events, BS, drop_last=drop_last)
    dropped = 0
    for e, got in enumerate(by_epoch(events, epochs)):
        chunks = fetch.chunks(workers, e)
        total = sum(map(len, chunks))
        ids = ids_of(got)
        check_exactly_once(ids, chunks, complete=not drop_last)
        if drop_last:
            assert len(ids) == total - total % BS, f"epoch {e}: {len(ids)} of {total} delivered with drop_last"
            dropped += total % BS
        if mode in ORDERED_CONTENT:
            check_chunks_kept_together(ids, chunks)
    a = assert_identity(gc, "at the end")
    assert a["buffered"] == 0, f"nothing is left inside blobfeed at the end: {a}"
    assert a["dropped"] == dropped, f"only the partial batches are dropped: {a}"
    assert metric(gc, "blobfeed_dropped_samples_total", reason="drop_last") == dropped, "dropped, but not as drop_last"
    assert metric(gc, "blobfeed_delivered_samples_total", net=net.name) == a["delivered"] == len(ids_of(events))
    assert a["fetched"] == sum(sum(map(len, fetch.chunks(workers, e))) for e in range(epochs))
    assert metric(gc, "blobfeed_worker_deaths_total") == 0
    if backend_name != "threads":  # what crossed from the workers' processes
        assert metric(gc, "blobfeed_transport_bytes_total", backend=backend_name) > 0


@matrix(ALL_MODES)
def test_several_nets_on_one_source_each_sample_to_exactly_one_net(
        gc: blobfeed.GlobalCoordinator, backend: Any, mode: str) -> None:
    fetch = Fetch(LENGTHS, salt=2, big_at=BIG_AT)
    nets, calls = wire(gc, backend, mode, fetch, workers=(2, 2))
    gc.start()
    per_net = drain_all(nets)
    epochs = epochs_of(mode)
    for events in per_net:
        check_batches(events, BS, drop_last=False)
    workers = {w: i for c in calls for w, i in c.items()}
    for e in range(epochs):
        got = [by_epoch(events, epochs)[e] for events in per_net]
        assert all(got), f"epoch {e}: a net got no batch: {[len(g) for g in got]}"
        ids = ids_of([b for g in got for b in g])
        check_exactly_once(ids, fetch.chunks(workers, e))
        if mode in ORDERED_CONTENT:  # within each net, what it got of a chunk is together and in order
            for g in got:
                check_chunks_kept_together(ids_of(g), fetch.chunks(workers, e))
    a = assert_identity(gc, "at the end")
    assert a["buffered"] == 0 and a["dropped"] == 0, a
    assert sum(metric(gc, "blobfeed_delivered_samples_total", net=n.name) for n in nets) == a["fetched"]
