"""What a new user trips on first (issue 19): a process-worker script without
``if __name__ == "__main__":``, and a fetch_fun that returns None at the end
of its data.  README "Process workers" and docs/CONTRACT.md say what to expect.

Scripts run in a subprocess of their own (a child re-importing the main
module is the point), each with a bound.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import blobfeed
from blobfeed import DequeueTimeout, Net, init_data_input_workers

from .helpers import sample

ROOT = Path(__file__).resolve().parent.parent

#: docs/BACKENDS.md's process-workers snippet, pasted into a script with no guard
UNGUARDED = """\
import numpy as np
import blobfeed

def fetch_fun(worker_id, batch_size):
    return [np.zeros((batch_size, 3), np.float32)]

net = blobfeed.Net(name="n")
coordinator = blobfeed.init_data_input_workers(
    net, ["data"], fetch_fun, 8, num_worker_threads=2, timeout=60,
    backend=blobfeed.ProcessBackend(start_method={method!r}))
coordinator.start()
print(net.run()["data"].shape)
coordinator.stop()
"""


def _run_script(tmp_path: Path, text: str, name: str = "script.py") -> subprocess.CompletedProcess[str]:
    script = tmp_path / name
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("blobfeed.errors.FetcherError")]
    assert lines, stderr
    return lines[-1]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_unguarded_script_names_the_main_module_guard_in_one_line(tmp_path: Path, method: str) -> None:
    done = _run_script(tmp_path, UNGUARDED.format(method=method))
    assert done.returncode == 1, done.stderr
    line = _error_line(done.stderr)
    assert "died while importing the main module" in line, line
    assert "script.py" in line and "if __name__ == '__main__':" in line, line
    assert "blobfeed workers again" in line, line
    # one line per worker from the children, not multiprocessing's 75-line
    # traceback each
    assert len(done.stderr.splitlines()) < 30, done.stderr
    assert "bootstrapping phase" not in done.stderr


#: the same, the fetcher reading a module-level array of 1 MB (the usual
#: case): cloudpickle sends the array with the function, by value
UNGUARDED_BIG = """\
import os
import threading
import numpy as np
import blobfeed

DATA = np.zeros((1 << 18, 1), np.float32)  # 1 MiB

def fetch_fun(worker_id, batch_size):
    return [DATA[:batch_size]]

net = blobfeed.Net(name="n")
coordinator = blobfeed.init_data_input_workers(
    net, ["data"], fetch_fun, 8, num_worker_threads=2, timeout=60,
    backend=blobfeed.ProcessBackend(start_method={method!r}))
try:
    coordinator.start()
    print(net.run()["data"].shape)
finally:
    coordinator.stop()
    # what is left of the pipeline: blobfeed's threads, and worker processes
    # (descendants but the forkserver and the resource tracker themselves)
    print("threads:", sorted(t.name for t in threading.enumerate() if t.name.startswith("blobfeed")))
    kids = {{}}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{{pid}}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError):
            continue
        kids.setdefault(int(stat[1]), []).append((int(pid), stat[0], cmd))
    left, todo = [], [(os.getpid(), 0)]
    while todo:
        parent, depth = todo.pop()
        for pid, state, cmd in kids.get(parent, []):
            todo.append((pid, depth + 1))
            helper = b"forkserver" in cmd or b"resource_tracker" in cmd
            if not (helper and depth == 0 and state != "Z"):
                left.append((pid, state))
    print("processes:", left, flush=True)
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_unguarded_script_with_a_large_fetcher_names_the_guard(tmp_path: Path, method: str) -> None:
    # The payload of a worker (fetch_fun and its 1 MiB array) no longer
    # travels in multiprocessing's start-up pipe, which the worker stops
    # reading when the main module's import ends it: the parent's write
    # failed with a 34-line BrokenPipeError that said nothing of the guard.
    done = _run_script(tmp_path, UNGUARDED_BIG.format(method=method))
    assert done.returncode == 1, done.stderr
    assert "BrokenPipeError" not in done.stderr, done.stderr
    line = _error_line(done.stderr)
    assert "script.py" in line and "if __name__ == '__main__':" in line, line
    assert "threads: []" in done.stdout, done.stdout
    assert "processes: []" in done.stdout, done.stdout
    assert len(done.stderr.splitlines()) < 30, done.stderr


def test_main_module_failing_in_the_worker_for_another_reason(tmp_path: Path) -> None:
    # guarded, but the module's own top-level code fails in the worker process
    # (a port the parent already holds, say): the child's own exception is
    # multiprocessing's to print, the error says where the worker died
    text = textwrap.dedent("""\
        import multiprocessing
        import numpy as np
        import blobfeed

        if multiprocessing.current_process().name != "MainProcess":
            raise OSError("[Errno 98] Address already in use")

        def fetch_fun(worker_id, batch_size):
            return [np.zeros((batch_size, 3), np.float32)]

        if __name__ == "__main__":
            net = blobfeed.Net(name="n")
            c = blobfeed.init_data_input_workers(net, ["data"], fetch_fun, 8, num_worker_threads=1,
                                                 timeout=60, backend="processes")
            c.start()
            net.run()
    """)
    done = _run_script(tmp_path, text)
    assert done.returncode == 1, done.stderr
    line = _error_line(done.stderr)
    assert "died while importing the main module" in line and "script.py" in line, line
    assert "exited with code 1" in line, line
    assert "OSError: [Errno 98] Address already in use" in done.stderr


def test_guarded_script_runs(tmp_path: Path) -> None:
    body = textwrap.indent(UNGUARDED.format(method="spawn").split("net = ", 1)[1], "    ")
    head = UNGUARDED.split("net = ", 1)[0]
    done = _run_script(tmp_path, head + "if __name__ == '__main__':\n    net = " + body.lstrip())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(8, 3)"


# -- a fetch_fun returning None ------------------------------------------------------


class _Clock:
    """The intakes' clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_none_warning_is_rate_limited_and_counted(gc, caplog, monkeypatch) -> None:
    from blobfeed.feeders import source as source_mod, worker_loop

    clock = _Clock()
    monkeypatch.setattr(source_mod, "_clock", clock, raising=False)
    monkeypatch.setattr(worker_loop, "_sleep", lambda s: None)  # 2 500 None at full speed
    calls = 0

    def fetch_fun(worker_id: int, batch_size: int):
        nonlocal calls
        calls += 1
        if calls == 2001:
            clock.now += 11.0  # past the interval: the next None warns again
        if calls > 2500:
            raise StopIteration
        return None

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch_fun, 4, num_worker_threads=1, coordinator=gc)
    with caplog.at_level(logging.WARNING, logger="blobfeed"):
        gc.start()
        with pytest.raises(blobfeed.EndOfInput):
            net.run(timeout=20)
    warned = [r.getMessage() for r in caplog.records if "returned None" in r.getMessage()]
    # one at the first None, one once 10 s passed: not 2 500
    assert len(warned) == 2, warned
    assert "StopIteration" in warned[0] and "1 such call" in warned[0], warned[0]
    assert "2000 such calls since the last warning" in warned[1], warned[1]
    assert sample(gc, "blobfeed_fetch_errors_total", source="train", kind="none") == 2500


def test_dequeue_timeout_says_the_fetchers_returned_only_none(gc) -> None:
    returned = threading.Event()

    def fetch_fun(worker_id: int, batch_size: int):
        returned.set()
        return None

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch_fun, 4, num_worker_threads=2, coordinator=gc)
    gc.start()
    assert returned.wait(5)
    with pytest.raises(DequeueTimeout) as err:
        net.run(timeout=0.3)
    msg = str(err.value)
    assert "returned None" in msg and "StopIteration" in msg, msg


def test_dequeue_timeout_of_a_slow_fetcher_says_nothing_of_none(gc) -> None:
    release = threading.Event()

    def fetch_fun(worker_id: int, batch_size: int):
        release.wait(5)
        raise StopIteration

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch_fun, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    try:
        with pytest.raises(DequeueTimeout) as err:
            net.run(timeout=0.2)
        assert "None" not in str(err.value)
    finally:
        release.set()


# -- a fetch_fun returning None at the end of its data: backoff, a visible warning ------------


def test_fetcher_returning_only_none_backs_off(gc) -> None:
    # It spun: 3.5 million calls per 10 s per worker, 100 % of a core each,
    # until the 600 s timeout.  Consecutive None are met with a growing
    # pause, bounded by worker_loop.EMPTY_BACKOFF_MAX_S.
    calls = {0: 0, 1: 0}

    def fetch_fun(worker_id: int, batch_size: int):
        calls[worker_id] += 1
        return None

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch_fun, 4, num_worker_threads=2, coordinator=gc)
    gc.start()
    with pytest.raises(DequeueTimeout):
        net.run(timeout=1.0)
    # ~12 quick calls, then about 10 per second each
    assert 0 < calls[0] < 60 and 0 < calls[1] < 60, calls


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_fetcher_failing_every_call_with_on_error_skip_backs_off(gc, backend: str) -> None:
    """A fetcher that raises at every call, with on_error="skip", gives no
    data either: it spun a core per worker as one returning None did
    (issue 24, found while fixing None); it backs off the same way."""
    net = Net(name="n")
    init_data_input_workers(net, ["x"], _always_fails, 4, num_worker_threads=1, coordinator=gc,
                            on_error="skip", backend=backend)
    gc.start()
    with pytest.raises(DequeueTimeout):
        net.run(timeout=1.5)
    errors = _counter(gc, "blobfeed_fetch_errors_total", kind="exception")
    assert 0 < errors < 60, errors


def _always_fails(worker_id: int, batch_size: int):
    raise OSError("the share is not mounted")


def _counter(gc, name: str, **labels: str) -> float:
    total = 0.0
    for family in gc.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_fetcher_returning_none_now_and_then_is_not_slowed(gc, monkeypatch) -> None:
    from blobfeed.feeders import worker_loop

    slept: list[float] = []
    monkeypatch.setattr(worker_loop, "_sleep", slept.append)
    calls = 0

    def fetch_fun(worker_id: int, batch_size: int):
        nonlocal calls
        calls += 1
        if calls > 3000:
            raise StopIteration
        if calls % 4:  # three None in a row, then a chunk
            return None
        return [np.full(4, calls, np.int64)]

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch_fun, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    n = 0
    with pytest.raises(blobfeed.EndOfInput):
        while True:
            net.run(timeout=20)
            n += 1
    assert n == 750
    assert slept == []


def test_backoff_of_a_long_run_of_none_is_reset_by_a_chunk(gc, monkeypatch) -> None:
    from blobfeed.feeders import worker_loop

    slept: list[float] = []
    monkeypatch.setattr(worker_loop, "_sleep", slept.append)
    calls = 0

    def fetch_fun(worker_id: int, batch_size: int):
        nonlocal calls
        calls += 1
        if calls in (41, 82):
            return [np.zeros(4, np.int64)]
        if calls > 82:
            raise StopIteration
        return None

    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch_fun, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    net.run(timeout=20)
    net.run(timeout=20)
    with pytest.raises(blobfeed.EndOfInput):
        net.run(timeout=20)
    # two runs of 40 None: the same pauses in each, growing, bounded
    assert len(slept) % 2 == 0 and slept[: len(slept) // 2] == slept[len(slept) // 2:], slept
    first = slept[: len(slept) // 2]
    assert first == sorted(first) and 0 < first[0] <= 0.002, first
    assert max(first) == worker_loop.EMPTY_BACKOFF_MAX_S <= 0.5, first


FETCH_NONE_AT_END = """\
import numpy as np
import blobfeed

def fetch_fun(worker_id, batch_size):
    return None  # "the end of my data"

net = blobfeed.Net(name="n")
c = blobfeed.init_data_input_workers(net, ["data"], fetch_fun, 8, num_worker_threads=2, timeout=1)
c.start()
try:
    net.run()
except blobfeed.DequeueTimeout as exc:
    print("timeout:", exc)
c.stop()
"""


def test_first_none_is_shown_without_logging_configured(tmp_path: Path) -> None:
    # The warning went only to logging, and the "blobfeed" logger has a
    # NullHandler: an application that configured no logging saw nothing.
    done = _run_script(tmp_path, FETCH_NONE_AT_END)
    assert done.returncode == 0, done.stderr
    shown = [ln for ln in done.stderr.splitlines() if "BlobfeedWarning" in ln]
    # once for the source, not per worker nor per call
    assert len(shown) == 1, done.stderr
    assert "source 'train'" in shown[0] and "returned None" in shown[0], shown[0]
    assert "raise StopIteration" in shown[0], shown[0]
    assert "timeout:" in done.stdout and "StopIteration" in done.stdout, done.stdout


def test_none_warning_made_an_error_by_the_filters_fails_the_source(tmp_path: Path) -> None:
    # "-W error" (a test suite's filterwarnings = error): the warning raises
    # inside blobfeed's intake, and fails the source as a FetcherError
    # (not a dead receiver or fetcher thread, and a run() waiting its timeout)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""\
            import warnings
            import blobfeed
            warnings.filterwarnings("error", category=blobfeed.BlobfeedWarning)
            net = blobfeed.Net(name="n")
            c = blobfeed.init_data_input_workers(net, ["x"], lambda w, b: None, 4, num_worker_threads=1)
            c.start()
            try:
                net.run(timeout=20)
            except blobfeed.FetcherError as exc:
                print("error:", type(exc.__cause__).__name__, exc)
            print("stopped:", c.stop(timeout=5))
        """)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "error: BlobfeedWarning source 'train', worker 0: " in done.stdout, done.stdout
    assert "stopped: True" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr


# -- deterministic nets drained one after the other from one thread ----------------------------


def _two_dealt_nets(gc, n_chunks: int = 40):
    calls = {0: 0, 1: 0}

    def fetch_fun(worker_id: int, batch_size: int):
        calls[worker_id] += 1
        if calls[worker_id] > n_chunks:
            raise StopIteration
        return [np.full(4, calls[worker_id], np.int64)]

    nets = [Net(name=f"r{i}") for i in range(2)]
    for net in nets:
        init_data_input_workers(net, ["x"], fetch_fun, 4, num_worker_threads=1, coordinator=gc,
                                deterministic=True, device_queue_capacity=2)
    return nets


def test_a_net_waiting_for_its_sibling_says_so(gc) -> None:
    # Draining r0 to its end, then r1, from one thread: r0 waited out its
    # timeout with "data input is slow ... 0 fetchers alive" while its
    # sibling r1 held the next batch; nothing said so.
    r0, r1 = _two_dealt_nets(gc)
    gc.start()
    took = 0
    with pytest.raises(DequeueTimeout) as err:
        for _ in range(80):
            r0.run(timeout=1.0)
            took += 1
    assert 0 < took < 40
    msg = str(err.value)
    assert "net 'r1'" in msg and "in turn" in msg and "own thread" in msg, msg
    # ... and it is true: once r1 took what it holds, r0 goes on
    held = int(re.search(r"which holds (\d+) batch", msg).group(1))
    assert held >= 1, msg
    for _ in range(held):
        r1.run(timeout=5)
    r0.run(timeout=5)


def test_slow_input_warning_names_the_sibling(gc, caplog, monkeypatch) -> None:
    from blobfeed.feeders import enqueuer

    monkeypatch.setattr(enqueuer, "SLOW_INPUT_WARN_S", 0.2)
    r0, _ = _two_dealt_nets(gc)
    gc.start()
    with caplog.at_level(logging.WARNING, logger="blobfeed"):
        with pytest.raises(DequeueTimeout):
            for _ in range(80):
                r0.run(timeout=0.7)
    slow = [r.getMessage() for r in caplog.records if "data input is slow" in r.getMessage()]
    assert slow and all("net 'r1'" in m and "own thread" in m for m in slow), slow


def test_a_slow_fetcher_on_a_dealt_source_names_no_sibling(gc) -> None:
    release = threading.Event()

    def fetch_fun(worker_id: int, batch_size: int):
        release.wait(5)
        raise StopIteration

    nets = [Net(name=f"r{i}") for i in range(2)]
    for net in nets:
        init_data_input_workers(net, ["x"], fetch_fun, 4, num_worker_threads=1, coordinator=gc, deterministic=True)
    gc.start()
    try:
        with pytest.raises(DequeueTimeout) as err:
            nets[0].run(timeout=0.2)
        assert "r1" not in str(err.value), err.value
    finally:
        release.set()
