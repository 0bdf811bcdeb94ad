"""Shared test set-up: GPU markers skip cleanly on machines without the right GPU."""

from __future__ import annotations

import os

import pytest
import torch
from _trace_helpers import fake_sm90  # noqa: F401  (a fixture of the traced-op tests)


def _gpu_capability():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_collection_modifyitems(config, items):
    from cute_mla.archs import SM90, SM100

    cc = _gpu_capability()
    for item in items:
        if "gpu" in item.keywords and cc is None:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif "sm90" in item.keywords and cc != (SM90.major, SM90.minor):
            item.add_marker(pytest.mark.skip(reason="needs an SM90 (Hopper, 9.0) GPU"))
        elif "sm100" in item.keywords and cc != (SM100.major, SM100.minor):
            item.add_marker(pytest.mark.skip(reason="needs an SM100 (Blackwell, 10.0) GPU"))


@pytest.fixture
def seed():
    """A fresh seed per test run (printed, so a failure can be replayed with CUTE_MLA_SEED)."""
    s = int(os.environ.get("CUTE_MLA_SEED", torch.seed() % 2**31))
    torch.manual_seed(s)
    print(f"seed={s}")
    return s
