"""Stop and the accounts: ``stop()`` returns True within 2 s with a net
blocked in ``run()`` and fetchers blocked on full queues, leaving no thread
or process; after it ``run()`` raises ``EndOfInput``; and the identity
``fetched == delivered + dropped + buffered`` mid-run (data held in the
internal queue, the lanes, the shuffle buffer, the device queues) and after
``stop()`` (then nothing is buffered: every sample was delivered or dropped);
``blobfeed_internal_queue_depth`` shows the chunks not yet dealt.

docs/CONTRACT.md: ``GlobalCoordinator.stop()``, the metrics, "Fetcher backends" ("No
accepted sample is lost silently: it is delivered or counted as dropped").
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import blobfeed
from blobfeed import EndOfInput, Net

from .fetchers import Fetch, IdleFetch
from .util import (
    ALL_MODES, WAIT, accounts, assert_identity, blobfeed_threads, descendants, describe, live_ray_actors, matrix, metric,
    new_processes, wait_quiet, wait_until, wire,
)


def take(net: Net, n: int) -> None:
    for _ in range(n):
        net.run(timeout=WAIT)


def held_mid_run(gc: blobfeed.GlobalCoordinator, backend: Any, mode: str, **kw: Any) -> Net:
    """An endless source whose net took a few batches and then stopped
    reading: every queue, lane and buffer behind it fills, and the fetchers
    wait on them.  Returns the net."""
    fetch = Fetch(endless=True, big_at={(0, 1)})
    (net,), _ = wire(gc, backend, mode, fetch, max_buffered=4, device_queue_capacity=2, **kw)
    gc.start()
    take(net, 3)
    wait_quiet(gc)
    return net


@matrix(ALL_MODES, ray=("det-shuffle",))
def test_stop_within_2s_with_a_net_blocked_and_fetchers_blocked_leaves_nothing(
        gc: blobfeed.GlobalCoordinator, backend: Any, backend_name: str, mode: str) -> None:
    threads_before = set(blobfeed_threads())
    procs_before = descendants()
    # source "idle" never yields a sample: its net waits in run()
    (waiter,), _ = wire(gc, backend, mode, IdleFetch(), workers=(1,), source="idle")
    net = held_mid_run(gc, backend, mode)  # starts gc; source "train" is full, its fetchers blocked
    entered = threading.Event()
    ended: list[BaseException] = []

    def blocked() -> None:
        entered.set()
        try:
            waiter.run(timeout=WAIT * 3)
        except BaseException as exc:  # checked below
            ended.append(exc)

    t = threading.Thread(target=blocked, name="test-blocked-run")
    t.start()
    assert entered.wait(WAIT)
    assert metric(gc, "blobfeed_device_queue_depth", net=net.name) > 0, "the source should be full"
    t0 = time.monotonic()
    assert gc.stop(timeout=WAIT) is True
    took = time.monotonic() - t0
    assert took < 2.0, f"stop() took {took:.2f} s"
    t.join(WAIT)
    assert not t.is_alive(), "run() still blocked after stop()"
    assert len(ended) == 1 and isinstance(ended[0], EndOfInput), f"the blocked run() ended with {ended!r}"
    t0 = time.monotonic()
    with pytest.raises(EndOfInput, match="stopped"):
        net.run(timeout=WAIT)
    assert time.monotonic() - t0 < 0.5, "run() of a stopped source must raise EndOfInput at once"
    assert metric(gc, "blobfeed_workers_alive") == 0, "a stopped source's workers still count as alive"
    assert set(blobfeed_threads()) <= threads_before, f"threads left: {set(blobfeed_threads()) - threads_before}"
    left: set[int] = set()

    def no_process() -> bool:
        left.clear()
        left.update(new_processes(procs_before))
        return not left

    try:
        wait_until(no_process, "the workers' processes to be gone", 1.0)
    except AssertionError:
        raise AssertionError(f"processes left after stop(): {describe(left)}") from None
    if backend_name == "ray":
        wait_until(lambda: not live_ray_actors(), "every actor dead", 5.0)


@matrix(ALL_MODES, ray=("arrival",))
def test_identity_after_stop_nothing_neither_delivered_nor_dropped(
        gc: blobfeed.GlobalCoordinator, backend: Any, mode: str) -> None:
    held_mid_run(gc, backend, mode)
    before = accounts(gc)
    assert gc.stop(timeout=WAIT) is True
    a = accounts(gc)
    assert a["buffered"] == 0, f"a stopped source holds nothing: {a}"
    assert metric(gc, "blobfeed_dropped_samples_total", reason="stopped") > 0, (
        f"what was held inside at stop() is dropped as 'stopped': before {before}, after {a}")
    assert a["fetched"] == a["delivered"] + a["dropped"], (
        f"after stop(): fetched != delivered + dropped: {a} "
        f"(unaccounted {a['fetched'] - a['delivered'] - a['dropped']:+g}; before stop: {before})")


@matrix(ALL_MODES, ray=("shuffle",))
def test_identity_mid_run_with_data_held_inside(gc: blobfeed.GlobalCoordinator, backend: Any, mode: str) -> None:
    net = held_mid_run(gc, backend, mode)
    a = assert_identity(gc, "mid-run, the net not reading")
    assert a["buffered"] > 0, f"the test holds data inside blobfeed: {a}"
    take(net, 5)
    wait_quiet(gc)
    assert_identity(gc, "mid-run, after more batches")


@matrix(ALL_MODES)
def test_internal_queue_depth_shows_chunks_not_yet_dealt(
        gc: blobfeed.GlobalCoordinator, backend: Any, mode: str) -> None:
    held_mid_run(gc, backend, mode)
    depth = metric(gc, "blobfeed_internal_queue_depth")
    assert depth > 0, (f"blobfeed_internal_queue_depth is {depth} while the fetchers wait on a full stream "
                       f"(capacity {metric(gc, 'blobfeed_internal_queue_capacity')})")
