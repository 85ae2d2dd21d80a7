"""A requested stop is carried out on its own (defect 13).

``stop_coordinator(name)`` called inside that coordinator's own
``worker_fun`` (TF's Looper pattern), ``stop()``/``join()`` called from
inside blobfeed (they only request), and a plain ``request_stop()``: the
stopper thread ends the group's threads, runs ``shutdown_fun`` once, gives
the loggers their final call and retires the group, with no later call by
the user.  Every wait is an event with a bound.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfInput, Net, init_data_input_workers, init_workers
from blobfeed.coordinator import registry as registry_mod

WAIT = 5.0


class Logger:
    """An external logger that tells when its final call came."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.called = threading.Event()

    def log(self, metrics: dict[str, Any]) -> None:
        self.calls.append(metrics)
        self.called.set()


@pytest.fixture
def retired(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, threading.Event]]:
    """name -> an event set when a group of that name is retired."""
    events: dict[str, threading.Event] = {}
    real = registry_mod.Registry.retire

    def retire(self: Any, group: Any) -> bool:
        done = real(self, group)
        if done:
            events.setdefault(group.name, threading.Event()).set()
        return done

    monkeypatch.setattr(registry_mod.Registry, "retire", retire)
    yield events


def wait_retired(events: dict[str, threading.Event], name: str) -> bool:
    ev = events.setdefault(name, threading.Event())
    return ev.wait(WAIT)


def listed(gc: blobfeed.GlobalCoordinator) -> list[str]:
    return [c.name for c in gc._coordinators]


def test_stop_coordinator_from_its_own_worker_fun_completes(
    gc: blobfeed.GlobalCoordinator, retired: dict[str, threading.Event]
) -> None:
    shut = threading.Event()
    shutdowns: list[int] = []
    ext = Logger()
    results: list[bool] = []

    def worker_fun(worker_id: int) -> None:
        if not results:
            results.append(gc.stop_coordinator("looper"))

    def shutdown_fun() -> None:
        shutdowns.append(1)
        shut.set()

    init_workers(worker_fun, num_worker_threads=2, worker_name="looper", shutdown_fun=shutdown_fun,
                 external_loggers=[ext], coordinator=gc)
    # a second group goes on: the stop is of "looper" only
    other = threading.Event()
    init_workers(lambda w: other.wait(0.01), num_worker_threads=1, worker_name="other", coordinator=gc)
    gc.start()
    assert shut.wait(WAIT), "shutdown_fun never ran after stop_coordinator() inside worker_fun"
    assert wait_retired(retired, "looper"), "the coordinator was never retired"
    assert results == [False]  # requested, not waited for
    assert shutdowns == [1]
    assert ext.called.is_set() and ext.calls, "the loggers got no final call"
    assert listed(gc) == ["other"]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("blobfeed-worker-looper")]
    # the other group was not asked to stop
    assert [c.is_active for c in gc._coordinators] == [True]


def test_stop_coordinator_from_its_own_worker_fun_is_logged_at_info_not_error(
    gc: blobfeed.GlobalCoordinator, retired: dict[str, threading.Event], caplog: pytest.LogCaptureFixture,
) -> None:
    """The Looper pattern is a documented, correct use ("requested, not
    waited for"): it was logged at ERROR level."""
    import logging

    results: list[bool] = []

    def worker_fun(worker_id: int) -> None:
        if not results:
            results.append(gc.stop_coordinator("looper"))

    caplog.set_level(logging.INFO, logger="blobfeed")
    init_workers(worker_fun, num_worker_threads=1, worker_name="looper", coordinator=gc)
    gc.start()
    assert wait_retired(retired, "looper"), "the coordinator was never retired"
    assert results == [False]
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "stop_coordinator('looper')" in r.getMessage()]
    assert said and all(level == logging.INFO for level, _ in said), said
    assert "requested, not waited for" in said[0][1]


def test_stop_from_inside_a_fetch_fun_completes_on_its_own(
    gc: blobfeed.GlobalCoordinator, retired: dict[str, threading.Event]
) -> None:
    answers: list[bool] = []
    ext = Logger()

    def fetch(worker_id: int, batch_size: int) -> list[np.ndarray]:
        if not answers:
            answers.append(gc.stop(timeout=WAIT))
        return [np.zeros((4, 2), np.float32)]

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, input_source_name="s",
                            external_loggers=[ext], coordinator=gc)
    gc.start()
    assert wait_retired(retired, "s"), "a stop() from inside a fetch_fun was never carried out"
    assert answers == [False]
    assert ext.called.is_set(), "the loggers got no final call"
    assert listed(gc) == []
    with pytest.raises(EndOfInput):
        while True:
            net.run(timeout=WAIT)


def test_join_from_inside_a_worker_fun_completes_on_its_own(
    gc: blobfeed.GlobalCoordinator, retired: dict[str, threading.Event]
) -> None:
    shut = threading.Event()
    answers: list[bool] = []

    def worker_fun(worker_id: int) -> None:
        if not answers:
            answers.append(gc.join(timeout=WAIT))

    init_workers(worker_fun, num_worker_threads=1, worker_name="w", shutdown_fun=shut.set, coordinator=gc)
    gc.start()
    assert shut.wait(WAIT), "shutdown_fun never ran after join() inside worker_fun"
    assert wait_retired(retired, "w")
    assert answers == [False]
    assert gc.should_stop()


def test_request_stop_alone_runs_shutdown_fun_and_retires(
    gc: blobfeed.GlobalCoordinator, retired: dict[str, threading.Event]
) -> None:
    shut = threading.Event()
    ran = threading.Event()
    init_workers(lambda w: ran.set(), num_worker_threads=2, worker_name="w", shutdown_fun=shut.set,
                 coordinator=gc)
    gc.start()
    assert ran.wait(WAIT)
    gc.request_stop()
    assert shut.wait(WAIT), "shutdown_fun never ran after request_stop()"
    assert wait_retired(retired, "w")
    assert listed(gc) == []
    assert gc.join(timeout=WAIT) is True


def test_state_dict_still_answers_after_a_requested_stop(
    gc: blobfeed.GlobalCoordinator, retired: dict[str, threading.Event]
) -> None:
    """The checkpoint-on-SIGTERM pattern: request_stop(), then save. The
    stopper may have retired the source by then; its position stays readable."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [np.zeros((4, 2), np.float32)], 4,
                            num_worker_threads=1, input_source_name="d", coordinator=gc,
                            deterministic=True, seed=3)
    gc.start()
    net.run(timeout=WAIT)
    before = gc.state_dict("d")
    gc.request_stop()
    assert wait_retired(retired, "d")
    assert gc.state_dict("d") == before


class _LateGroup:
    """Workers a resize (the autotuner's set_num_workers) started and
    appended to the source's groups just after stop() had joined them."""

    def __init__(self) -> None:
        self.running = True

    def alive(self) -> list[str]:
        return ["blobfeed-worker-train-late"] if self.running else []

    def request_stop(self) -> None:
        pass

    def join(self, deadline: float | None) -> list[str]:
        self.running = False
        return []


def test_workers_a_resize_started_while_stop_joined_are_joined_too() -> None:
    """A resize that had passed its checks before the stop appended its
    workers after the stop's join: the stop found them alive, returned
    False and logged "started while stopping; stop() again" (a CI run of
    the autotune test hit it), although they end as soon as they are
    joined."""
    gc = blobfeed.GlobalCoordinator()
    net = Net(None, name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [np.zeros(4, np.float32)], 4, coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)
    (c,) = [c for c in gc._coordinators if c.name == "train"]
    real_join, late = c._join, _LateGroup()

    def join_then_a_late_group(deadline: float | None) -> list[str]:
        names = real_join(deadline)
        if late.running and late not in c._more_groups:
            c._more_groups.append(late)
        return names

    c._join = join_then_a_late_group  # type: ignore[method-assign]
    assert gc.stop(timeout=WAIT)
    assert not late.running
