"""Shared test set-up: GPU markers skip cleanly on machines without the right GPU."""

from __future__ import annotations

import os

import pytest
import torch


def _gpu_major():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()[0]


def pytest_collection_modifyitems(config, items):
    major = _gpu_major()
    for item in items:
        if "gpu" in item.keywords and major is None:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif "sm90" in item.keywords and major != 9:
            item.add_marker(pytest.mark.skip(reason="needs an SM90 (Hopper) GPU"))
        elif "sm100" in item.keywords and major != 10:
            item.add_marker(pytest.mark.skip(reason="needs an SM100 (Blackwell) GPU"))


@pytest.fixture
def seed():
    """A fresh seed per test run (printed, so a failure can be replayed with CUTE_MLA_SEED)."""
    s = int(os.environ.get("CUTE_MLA_SEED", torch.seed() % 2**31))
    torch.manual_seed(s)
    print(f"seed={s}")
    return s
