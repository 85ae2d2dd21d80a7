"""Figures of the stress, leak and exit tests, for docs/RELIABILITY.md.

The tests call :func:`record` / :func:`add` with what they measured.  Nothing
is written unless ``BLOBFEED_STRESS_REPORT`` names a JSON file, so a normal
``python -m pytest`` run (and ``-s`` or not) is unaffected.

To refresh the figures in docs/RELIABILITY.md::

    python -m tests.stress_report            # runs the four files, prints Markdown

Replaying one stress case: every case prints its seed and puts it in its
assertion messages; ``BLOBFEED_STRESS_SEEDS=1234,99 python -m pytest
tests/test_stress.py`` runs the randomized tests with those seeds only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ENV = "BLOBFEED_STRESS_REPORT"
_lock = threading.Lock()


def _update(fn: Any) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    with _lock:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
        fn(data)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def record(section: str, **figures: Any) -> None:
    """Set ``figures`` under ``section`` (last write wins)."""
    _update(lambda d: d.setdefault(section, {}).update(figures))


def add(section: str, **counts: float) -> None:
    """Add ``counts`` to the running totals under ``section``."""

    def apply(d: dict[str, Any]) -> None:
        sec = d.setdefault(section, {})
        for k, v in counts.items():
            sec[k] = sec.get(k, 0) + v

    _update(apply)


def maximum(section: str, **values: float) -> None:
    """Keep the largest value seen for each of ``values`` under ``section``."""

    def apply(d: dict[str, Any]) -> None:
        sec = d.setdefault(section, {})
        for k, v in values.items():
            sec[k] = max(sec.get(k, v), v)

    _update(apply)


def _markdown(data: dict[str, Any], seconds: float, outcome: str) -> str:
    lines = [f"Run of {time.strftime('%Y-%m-%d %H:%M')} ({seconds:.1f} s wall, {os.cpu_count()} CPUs, "
             f"Python {sys.version.split()[0]}): {outcome}", ""]
    for section in sorted(data):
        lines.append(f"### {section}")
        lines.append("")
        lines.append("| figure | value |")
        lines.append("| --- | --- |")
        for k, v in sorted(data[section].items()):
            if isinstance(v, float):
                v = f"{v:.4g}"
            lines.append(f"| {k} | {v} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the reliability tests with reporting on; print the figures as Markdown."""
    args = list(sys.argv[1:] if argv is None else argv)
    files = ["tests/test_stress.py", "tests/test_leaks.py", "tests/test_exits.py", "tests/test_security.py"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        env = dict(os.environ, **{ENV: path})
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, *args],
            env=env, capture_output=True, text=True,
        )
        seconds = time.monotonic() - t0
        outcome = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"exit {proc.returncode}"
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError:
            data = {}
    print(_markdown(data, seconds, outcome))
    if proc.returncode != 0:
        print(proc.stdout[-4000:], file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
