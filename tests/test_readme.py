"""The README's five-minute tutorial and docs/RESUME.md's examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
RESUME = README.parent / "docs" / "RESUME.md"


def tutorial_code() -> str:
    text = README.read_text()
    section = text.split("## Five-minute tutorial", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 5, "the tutorial lost its code blocks"
    # a free port instead of the documented 9100, which may be taken here
    return "\n".join(blocks).replace("start_http_server(9100)", "start_http_server(0)")


def test_tutorial_runs() -> None:
    code = tutorial_code() + "\nassert seen == 10_000, seen\nprint('tutorial ok', seen)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tutorial ok 10000" in proc.stdout


def test_reproducibility_example_runs() -> None:
    """docs/RESUME.md's checkpoint-and-resume examples: stopped after batch 25,
    resumed from its checkpoint at batch 20, it gives the batches of an
    uninterrupted run; with epochs, resumed from a checkpoint at an epoch's
    last batch, the same batches and epoch ends (the examples assert it)."""
    section = RESUME.read_text()
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the reproducibility section lost its example"
    proc = subprocess.run([sys.executable, "-c", "\n".join(blocks)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"resumed run gave the same (\d+) batches", proc.stdout)
    assert int(re.search(r"the same (\d+) batches", proc.stdout).group(1)) > 25
    # the epochs example: 3 epochs of 7 batches and 2 epoch ends, resumed at an epoch's end
    assert "resumed epochs gave the same 23 batches and epoch ends" in proc.stdout


def test_the_dataset_example_runs() -> None:
    """The README's random-access dataset example (issue 26) runs as written."""
    section = README.read_text().split("## A dataset instead of a fetcher", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the dataset section lost its example"
    proc = subprocess.run([sys.executable, "-c", blocks[0] + "\nprint('dataset ok')\n"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "dataset ok" in proc.stdout


def test_tutorial_runs_epochs_on_one_wiring() -> None:
    """The tutorial's second pass is ``epochs=2`` on the same workers, not a
    second wiring (issue 19: the tutorial showed only re-wiring)."""
    code = tutorial_code()
    assert "epochs=2" in code
    assert code.count("init_data_input_workers(") == 1, "the tutorial wires the source more than once"
    assert "info.epoch" in code, "the tutorial's fetcher does not start over at a new epoch"


#: a stand-in for torch with what the README's loop calls: ``from_numpy``
#: warns, as torch does, at an array that is not writable
FAKE_TORCH = '''
import sys, types, warnings
torch = types.ModuleType("torch")
def from_numpy(a):
    if not a.flags.writeable:
        warnings.warn("The given NumPy array is not writable", UserWarning)
    return a
torch.from_numpy = from_numpy
sys.modules["torch"] = torch
'''


def test_the_torch_loop_runs_without_a_warning_per_batch() -> None:
    """The README's PyTorch loop (issue 24: torch users got a warning on
    every batch) runs after the tutorial, with a stand-in for torch that
    warns as torch does; the warnings are errors."""
    section = README.read_text().split("## With PyTorch", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the PyTorch section lost its loop"
    loop = blocks[0].replace("        ...  ", "        seen_torch += len(y)  ")
    code = "\n".join([
        FAKE_TORCH, tutorial_code(), "iters.clear()", "seen_torch = 0",
        "import warnings", "warnings.simplefilter('error')", loop,
        "assert seen_torch == 2 * 10_000, seen_torch", "print('torch loop ok')",
    ])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "torch loop ok" in proc.stdout
