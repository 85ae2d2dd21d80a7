"""README's torchrun-style example runs: a service and four rank processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent.parent


def test_the_torchrun_style_example_gives_every_rank_an_equal_share() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "service_torchrun.py")],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # the ranks share one stdout: their lines may run together
    shares = sorted(f"rank {r}: {n} samples" for r, n in re.findall(r"rank (\d+): (\d+) samples", run.stdout))
    # 2 workers x 20 chunks x 50 samples = 2000 a pass, 63 batches of 32 (the last of 16): 15 rounds of 4
    # per epoch go out (the 16th, incomplete, is dropped): 2 epochs x 15 x 32 = 960 each
    assert shares == [f"rank {r}: 960 samples" for r in range(4)]
