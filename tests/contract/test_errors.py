"""Errors: a fetcher's exception reaches ``Net.run()`` as ``FetcherError``
within one second with the original exception as ``__cause__``; a malformed
chunk is a ``ChunkError``; ``on_error="skip"`` carries on and counts.

docs/CONTRACT.md: ``init_data_input_workers`` (fetch_fun raising, a malformed chunk,
on_error), "Fetcher backends" (failures of a worker that is not a thread).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import blobfeed
from blobfeed import ChunkError, DequeueTimeout, EndOfEpoch, EndOfInput, FetcherError, Net

from .fetchers import Boom, Fetch, chunk_size
from .util import (
    ALL_MODES, BS, ORDERED_CONTENT, SRC, WAIT, assert_identity, by_epoch, check_batches, check_chunks_kept_together,
    check_exactly_once, drain_all, epochs_of, ids_of, matrix, metric, wire,
)

LENGTHS = (5, 6, 4)
#: worker index 1's third call
AT = (1, 2)


def until_error(net: Net) -> tuple[BaseException, float, int]:
    """run() until it raises an error; the error, the time it was raised
    (time.time(), comparable with the fetcher's, in any process of this
    machine) and the batches before it."""
    n = 0
    deadline = time.monotonic() + WAIT * 2
    while True:
        assert time.monotonic() < deadline, f"no error from run() after {n} batches"
        try:
            net.run(timeout=WAIT)
        except EndOfEpoch:
            continue
        except (FetcherError, EndOfInput, DequeueTimeout) as err:
            return err, time.time(), n
        n += 1


@matrix(ALL_MODES, ray=("arrival",))
def test_fetcher_exception_reaches_run_as_fetcher_error_within_1s(
        gc: blobfeed.GlobalCoordinator, backend: Any, mode: str) -> None:
    fetch = Fetch(LENGTHS, salt=3, raise_at={AT})
    (net,), (workers,) = wire(gc, backend, mode, fetch)
    wid = next(w for w, i in workers.items() if i == AT[0])
    gc.start()
    err, seen_at, _ = until_error(net)
    assert type(err) is FetcherError, f"run() raised {err!r}, expected FetcherError"
    cause = err.__cause__
    assert type(cause) is Boom, f"__cause__ is {cause!r}, expected the fetcher's Boom"
    assert cause.args[:3] == ("boom", wid, AT[1]), cause.args
    took = seen_at - cause.args[3]
    assert took < 1.0, f"the error reached run() {took:.2f} s after the fetcher raised it"
    assert SRC in str(err) and str(wid) in str(err), f"the message names neither source nor worker: {err}"
    assert str(cause) in str(err), f"the message does not say what the fetcher raised: {err}"
    assert metric(gc, "blobfeed_fetch_errors_total", kind="exception") == 1
    # the source stays failed: the next run() raises the same error, at once
    t0 = time.monotonic()
    with pytest.raises(FetcherError) as again:
        net.run(timeout=WAIT)
    assert time.monotonic() - t0 < 0.5 and type(again.value.__cause__) is Boom, again.value
    assert again.value.__cause__.args == cause.args
    assert_identity(gc, "after the error")


@matrix(ALL_MODES)
def test_a_run_waiting_on_a_failing_source_wakes_within_1s(
        gc: blobfeed.GlobalCoordinator, backend: Any, mode: str) -> None:
    """The only worker's first call raises after a pause: the net waits in
    run() with its default timeout (600 s: nothing but the error can end
    that wait) when it does."""
    fetch = Fetch((3,), salt=6, raise_at={(0, 0)}, pace=0.3)
    (net,), _ = wire(gc, backend, mode, fetch, workers=(1,))
    gc.start()
    entered = threading.Event()
    ended: list[tuple[BaseException, float]] = []

    def waiting() -> None:
        entered.set()
        try:
            net.run()
        except BaseException as exc:  # checked below
            ended.append((exc, time.time()))

    t = threading.Thread(target=waiting, name="test-waiting-run")
    t0 = time.time()
    t.start()
    assert entered.wait(WAIT)
    t.join(WAIT)  # on failure, the fixture's stop() ends the wait
    assert not t.is_alive(), "run() still waits on a source whose only worker raised"
    ((err, seen_at),) = ended
    assert type(err) is FetcherError, f"run() raised {err!r}, expected FetcherError"
    cause = err.__cause__
    assert type(cause) is Boom, f"__cause__ is {cause!r}"
    assert t0 < cause.args[3], "run() was not called yet when the fetcher raised: the test proves nothing"
    took = seen_at - cause.args[3]
    assert took < 1.0, f"the waiting run() woke {took:.2f} s after the fetcher raised"
    assert str(cause) in str(err), err


@matrix(ALL_MODES)
def test_malformed_chunk_is_a_chunk_error_naming_the_blob(
        gc: blobfeed.GlobalCoordinator, backend: Any, mode: str) -> None:
    fetch = Fetch(LENGTHS, salt=4, bad_at={AT})
    (net,), (workers,) = wire(gc, backend, mode, fetch)
    wid = next(w for w, i in workers.items() if i == AT[0])
    gc.start()
    err, _, _ = until_error(net)
    assert isinstance(err, ChunkError), f"run() raised {err!r}, expected ChunkError"
    assert isinstance(err, ValueError)
    msg = str(err)
    assert SRC in msg and str(wid) in msg and "feat" in msg, f"the message does not name source, worker, blob: {msg}"
    rows = chunk_size(4, 0, wid, AT[1])
    assert f"expected {rows} samples" in msg and f"got {rows - 1}" in msg, f"the message does not say what came: {msg}"
    assert metric(gc, "blobfeed_fetch_errors_total", kind="invalid") == 1
    assert_identity(gc, "after the error")


@matrix(ALL_MODES)
def test_on_error_skip_carries_on_and_counts(gc: blobfeed.GlobalCoordinator, backend: Any, mode: str) -> None:
    """Two raising calls of one worker and a malformed chunk, skipped: every
    other sample is delivered exactly once (a worker's chunks in order where
    the mode keeps them), and each is counted, in every epoch."""
    bad = (2, 1)
    fetch = Fetch(LENGTHS, salt=5, raise_at={AT, (AT[0], AT[1] + 2)}, bad_at={bad})
    (net,), (workers,) = wire(gc, backend, mode, fetch, on_error="skip")
    gc.start()
    (events,) = drain_all([net])
    epochs = epochs_of(mode)
    check_batches(events, BS, drop_last=False)
    for e, got in enumerate(by_epoch(events, epochs)):
        chunks = fetch.chunks(workers, e, skipped=True)
        check_exactly_once(ids_of(got), chunks)
        if mode in ORDERED_CONTENT:
            check_chunks_kept_together(ids_of(got), chunks)
    assert metric(gc, "blobfeed_fetch_errors_total", kind="exception") == 2 * epochs
    assert metric(gc, "blobfeed_fetch_errors_total", kind="invalid") == epochs
    bad_wid = next(w for w, i in workers.items() if i == bad[0])
    bad_rows = sum(chunk_size(5, e, bad_wid, bad[1]) for e in range(epochs))
    assert metric(gc, "blobfeed_skipped_samples_total") == bad_rows
    a = assert_identity(gc, "at the end")
    assert a["buffered"] == 0 and a["dropped"] == 0, a
