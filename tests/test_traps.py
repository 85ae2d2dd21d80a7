"""What a new user trips on first (issue 19): a process-worker script without
``if __name__ == "__main__":``, and a fetch_fun that returns None at the end
of its data.  README "Process workers" and docs/CONTRACT.md say what to expect.

Scripts run in a subprocess of their own (a child re-importing the main
module is the point), each with a bound.
"""

from __future__ import annotations

import logging
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
    from blobfeed.feeders import source as source_mod

    clock = _Clock()
    monkeypatch.setattr(source_mod, "_clock", clock, raising=False)
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
