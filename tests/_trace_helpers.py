"""What the CPU tests of the traced ops share: a trace's device facts without a GPU (the
``fake_sm90`` fixture, which conftest.py registers), a dynamo backend that records the graphs, and
fake CUDA tensors."""

from __future__ import annotations

import pytest
import torch

from cute_mla.interface import ops


@torch.compiler.assume_constant_result
def _sm90_facts(device):
    return "sm_90a", 132


@pytest.fixture
def fake_sm90(monkeypatch):
    """A trace's device facts (an SM90 with 132 SMs) without a GPU; a fresh dynamo state per test."""
    monkeypatch.setattr(ops, "device_facts", _sm90_facts)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Recorder:
    """A dynamo backend that keeps the graphs and runs them as traced (on fake tensors: fake impls)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]


def fake_cuda(shape, dtype, mode):
    """An empty fake CUDA tensor of ``mode`` (a FakeTensorMode)."""
    with mode:
        return torch.empty(shape, dtype=dtype, device="cuda")
