"""Smoke tests: every example runs to the end and says it succeeded."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"


def test_metrics_scrape_checks_every_metric_the_library_exports() -> None:
    """The example's count of metrics is read from the registry, not written
    in (it said "all 14" while blobfeed exported 19 to 21)."""
    import blobfeed

    exported = {f.name for f in blobfeed.GlobalCoordinator().registry.collect() if f.name.startswith("blobfeed_")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "metrics_scrape.py")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"lists all (\d+) metrics", proc.stdout)
    assert m, proc.stdout
    assert int(m.group(1)) == len(exported), (m.group(0), sorted(exported))
