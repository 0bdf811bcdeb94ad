"""CPU: every GPU example exits with one clear line on a machine without a GPU (no traceback)."""

import pathlib
import subprocess
import sys

import pytest
import torch

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_gpu_example_without_gpu_says_so(path):
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                       cwd=path.parents[1])
    lines = [ln for ln in r.stderr.splitlines() if "Warning" not in ln and ln.strip() and not ln.startswith("  ")]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and "needs an SM90 or SM100 GPU" in lines[0], lines
