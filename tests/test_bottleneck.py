"""Issue 27 item 3: the bottleneck verdict (GlobalCoordinator.bottleneck(),
blobfeed_bottleneck_info, a log line when it changes) on real small
pipelines, one per stage, each far from the thresholds (docs/TUNING.md)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfInput, Net, init_data_input_workers
from blobfeed.bottleneck import STAGES, Bottleneck

from .helpers import sample, wait_until

#: the verdict is judged over the last WINDOW_S (5 s); the tests read it
#: once it covers this much of a running pipeline
SETTLED_S = 3.0
#: bound on the whole wait for that (a loaded machine)
BOUND_S = 60.0


@contextlib.contextmanager
def consuming(net: Net, pause: float = 0.0) -> Iterator[None]:
    """A consumer thread calling net.run() in a loop (sleeping ``pause``
    after each: a slow model or consumer loop), ended at the exit."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                net.run(timeout=30)
                if pause:
                    stop.wait(pause)
        except EndOfInput:
            pass
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=loop, name="test-consumer", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=30)
        assert not t.is_alive(), "the consumer did not end"
        assert not errors, errors


def settled(gc: blobfeed.GlobalCoordinator, source: str = "train", net: str = "n") -> Bottleneck:
    """The verdict for (source, net) once its window covers SETTLED_S."""
    found: list[Bottleneck] = []

    def ready() -> bool:
        found[:] = [v for v in gc.bottleneck() if (v.source, v.net) == (source, net) and v.window_s >= SETTLED_S]
        return bool(found)

    wait_until(ready, f"a verdict for {source}/{net} over {SETTLED_S} s", timeout=BOUND_S)
    return found[0]


def run_pipeline(
    gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture, fetch: Callable[[int, int], Any], *,
    pause: float = 0.0, **kw: Any,
) -> Bottleneck:
    """The verdict on a running pipeline; checks the metric and the log line say it too."""
    caplog.set_level(logging.INFO, logger="blobfeed.bottleneck")
    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, kw.pop("batch_size", 32), coordinator=gc, **kw)
    gc.start()
    with consuming(net, pause):
        v = settled(gc)
        stages = {s: sample(gc, "blobfeed_bottleneck_info", source="train", net="n", stage=s) for s in STAGES}
        in_force = {x.stage for x in gc.bottleneck()}
        assert gc.stop()
    # the metric says the verdict in force (it may have moved on since v)
    assert sorted(stages.values()) == [0.0] * (len(STAGES) - 1) + [1.0], stages
    # every verdict that took force was logged, with its advice
    logged = [r.getMessage() for r in caplog.records if r.name == "blobfeed.bottleneck"]
    kind = v.advice.split(":")[0]  # "input-bound", "copy-bound", ...
    assert any(m.startswith(f"bottleneck of source 'train', net 'n': {v.stage}") and f": {kind}:" in m
               for m in logged), (v, logged)
    assert in_force and all(any(f"net 'n': {s}" in m for m in logged) for s in in_force), (in_force, logged)
    # a stopped source has no verdict, in the method or the metric
    assert gc.bottleneck() == []
    assert all(sample(gc, "blobfeed_bottleneck_info", source="train", net="n", stage=s) == 0 for s in STAGES)
    return v


def _python_loop(w: int, b: int) -> list[np.ndarray]:
    """A W4-like fetcher: pure Python, holding the GIL (about 1 ms a call)."""
    x = 0
    for i in range(10_000):
        x += i * i
    return [np.full((32, 1), x % 7, np.float32)]


def test_pure_python_fetchers_on_threads_hold_the_gil(gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture) -> None:
    v = run_pipeline(gc, caplog, _python_loop, num_worker_threads=2)
    assert v.stage == "gil", v
    assert "backend='processes'" in v.advice
    assert v.net_wait > 0.5 and v.fetch_busy is not None and v.fetch_busy > 0.6, v
    assert v.fetch_cpu is not None and v.fetch_cpu < 0.75 * v.fetch_busy, v


def _sleeper(w: int, b: int) -> list[np.ndarray]:
    """An I/O-bound fetcher: waits 5 ms, hardly any CPU."""
    time.sleep(0.005)
    return [np.zeros((32, 1), np.float32)]


def test_one_io_bound_worker_is_too_few(gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture) -> None:
    v = run_pipeline(gc, caplog, _sleeper, num_worker_threads=1)
    assert v.stage == "workers", v
    assert "add workers" in v.advice
    assert v.net_wait > 0.5 and v.fetch_busy is not None and v.fetch_busy > 0.6, v
    assert v.fetch_cpu is not None and v.fetch_cpu < 0.25, v


def _instant(w: int, b: int) -> list[np.ndarray]:
    return [np.zeros((32, 1), np.float32)]


def test_a_slow_consumer_is_model_bound(gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture) -> None:
    # 50 ms a batch in the consumer: the fetchers fill the queue and wait for room
    v = run_pipeline(gc, caplog, _instant, pause=0.05, num_worker_threads=2, max_buffered_batches=4)
    assert v.stage == "model", v
    assert "input is not the limit" in v.advice
    assert v.net_wait < 0.1, v
    assert v.queue_fill is not None and v.queue_fill > 0.8, v


_BIG = np.ones((1000, 1024), np.float32)  # 4 MB a chunk


def _big(w: int, b: int) -> list[np.ndarray]:
    """No work at all, 4 MB a chunk: moving it is all the time there is."""
    return [_BIG]


def test_big_chunks_are_copy_bound(gc: blobfeed.GlobalCoordinator, caplog: pytest.LogCaptureFixture) -> None:
    # 1500 rows a batch from 1000-row chunks: each batch is copied together
    # from two chunks.  The fetchers are instant and the queue stays full, yet
    # the net waits: moving the data to the net is the limit.  (Not a memory
    # bandwidth limit on every machine: a 6 MB copy can take 0.2 ms, and the
    # per-batch hand-over is then what costs.)
    v = run_pipeline(gc, caplog, _big, batch_size=1500, num_worker_threads=2, max_buffered_batches=4)
    assert v.stage == "copy", v
    assert v.net_wait > 0.5 and v.fetch_busy is not None and v.fetch_busy < 0.3, v
