"""The head counts the decode GPU sweeps run: every count the API takes, each skipped (with the
reason) on an arch whose kernel does not run it natively (SM100: 64 and 128)."""

import pytest
import torch

from cute_mla.archs import device_arch
from cute_mla.plan.sparse_decode import SUPPORTED_H_Q, arch_heads

DECODE_HEADS = SUPPORTED_H_Q


def require_heads(h_q: int) -> None:
    arch = device_arch(torch.device("cuda"))
    if h_q not in arch_heads(arch):
        pytest.skip(f"the {arch} sparse decode kernel runs {arch_heads(arch)} heads, not {h_q}")
