"""CPU: every example says what it needs; CPU examples run to the end in under two minutes; GPU
examples, on a machine without a GPU, exit with one clear line (no traceback).

Each example's module docstring has a line exactly ``Needs: CPU`` or ``Needs: GPU`` ("CPU compile,
GPU run" counts as GPU). The examples run as a user runs them (``python examples/NAME.py``, no
arguments) from a fresh directory, so whatever they write lands there, with a fresh compile cache
(CI is a clean clone) and this checkout first on the import path.
"""

import ast
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NEEDS = ("Needs: CPU", "Needs: GPU")
CPU_LIMIT_S = 120  # the acceptance: each CPU example exits 0 in under 2 minutes


def docstring(path: pathlib.Path):
    return ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))


def needs_lines(path: pathlib.Path):
    """The example's docstring lines that start with ``Needs:``."""
    return [ln.strip() for ln in (docstring(path) or "").splitlines() if ln.strip().startswith("Needs:")]


def needs(path: pathlib.Path):
    """The example's ``Needs:`` line, or None."""
    lines = needs_lines(path)
    return lines[0] if len(lines) == 1 else None


def run(path: pathlib.Path, cwd: pathlib.Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               CUTE_MLA_CACHE_DIR=str(cwd / ".cute-mla-cache"))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env)


def by_need(need: str):
    return [p for p in EXAMPLES if needs(p) == need]


CPU_EXAMPLES, GPU_EXAMPLES = by_need("Needs: CPU"), by_need("Needs: GPU")


def test_there_are_examples():
    assert EXAMPLES and CPU_EXAMPLES, EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_has_docstring_and_needs_line(path):
    doc = docstring(path) or ""
    lines = needs_lines(path)
    assert len(lines) == 1 and lines[0] in NEEDS, f"{path.name}: one line exactly {' or '.join(NEEDS)}, got {lines}"
    assert len([ln for ln in doc.splitlines() if ln.strip()]) > 1, \
        f"{path.name}: the docstring says what the example shows and how to run it, besides what it needs"


@pytest.mark.parametrize("path", CPU_EXAMPLES, ids=[p.name for p in CPU_EXAMPLES])
def test_cpu_example_runs(path, tmp_path):
    t0 = time.time()
    try:
        r = run(path, tmp_path, CPU_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{path.name} ran past {CPU_LIMIT_S} s")
    took = time.time() - t0
    print(f"{path.name}: {took:.1f} s")
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stdout.strip(), f"{path.name} printed nothing"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=[p.name for p in GPU_EXAMPLES])
def test_gpu_example_without_gpu_says_so(path, tmp_path):
    r = run(path, tmp_path, 300)
    lines = [ln for ln in r.stderr.splitlines() if "Warning" not in ln and ln.strip() and not ln.startswith("  ")]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and "needs an SM90 or SM100 GPU" in lines[0], lines
