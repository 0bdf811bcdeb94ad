"""SM90 sparse decode with 8, 16 and 32 heads on the swap-AB tile (``decode_small_roles.py``) against
the fp32 reference: the kernel launched directly (split and no-split variants, lengths, sinks,
invalid and all-invalid rows, NaN in every unreferenced cache slot, V3.2 and V4 with its extra
pool), and the public call, graph replay included."""

from __future__ import annotations

import pytest
import torch

import cute_mla
from cute_mla import archs
from cute_mla.kernels.sm90 import kernel_config
from cute_mla.plan.policy import default_policy
from cute_mla.testing import check_diagnosed, check_out_lse, make_inputs, run_kernel, v4_sweep_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

NUM_SMS = archs.SM90.default_num_sms
POLICY = default_policy(archs.SM90.name)

# name: (b, s_q, h_q, topk, page_block_size, split, topk_length, sink, all-invalid rows, out-of-range frac)
CASES = {
    "tiny_h16_nosplit": (1, 1, 16, 64, 64, False, False, False, 0, 0.0),
    "b4_h16_split_pbs2": (4, 1, 16, 1024, 2, True, False, True, 0, 0.05),
    "b4_s3_h8_nosplit_pbs61": (4, 3, 8, 576, 61, False, True, True, 1, 0.05),
    "b74_h32_split_pbs64": (74, 1, 32, 2048, 64, True, False, True, 0, 0.05),
    "b74_s3_h16_split_pbs576": (74, 3, 16, 2048, 576, True, True, False, 5, 0.05),
    "b4_s3_h32_split_invalid": (4, 3, 32, 576, 2, True, True, True, 4, 0.1),
    "b74_h8_nosplit_pbs64": (74, 1, 8, 576, 64, False, True, True, 3, 0.05),
    "b128_h16_nosplit_tl": (128, 1, 16, 2048, 64, False, True, True, 2, 0.05),
}


def _cfg(inp, split):
    return inp.kernel_config(kernel_config, split)


def _check(inp, out, lse, sched):
    ref_out, ref_lse = inp.reference()
    check_diagnosed(out, lse, ref_out, ref_lse, sched)


@pytest.mark.parametrize("name", list(CASES))
def test_small_heads_match_reference(name, seed):
    b, s_q, h_q, topk, page, split, tl, sink, all_invalid, oor = CASES[name]
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(b, s_q, h_q, topk, num_tokens=max(4096, 2 * topk), page_block_size=page, invalid_frac=0.15,
                      out_of_range_frac=oor, with_topk_length=tl, with_sink=sink, all_invalid_rows=all_invalid,
                      device="cuda", generator=g)
    parts = POLICY.num_sm_parts(NUM_SMS, s_q, h_q) if split else 1
    out, lse, sched = run_kernel(inp, _cfg(inp, split), parts)
    if split:
        assert sched.any_split, "the split case should exercise split pieces"
    _check(inp, out, lse, sched)


@pytest.mark.parametrize("h_q", [8, 16])
@pytest.mark.parametrize("split", [False, True])
def test_small_heads_v4_extra_pool(h_q, split, seed):
    inp = v4_sweep_inputs(seed, 8, 1, h_q, 128, extra_topk=512, with_topk_length=True, with_extra_topk_length=True)
    parts = POLICY.num_sm_parts(NUM_SMS, 1, h_q) if split else 1
    out, lse, sched = run_kernel(inp, _cfg(inp, split), parts)
    _check(inp, out, lse, sched)


@pytest.mark.parametrize("h_q", [8, 16, 32])
def test_public_call_and_graph_replay(h_q, seed):
    """``flash_mla_with_kvcache`` plans and runs small heads natively; a captured call replays equal."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(16, 2, h_q, 1024, num_tokens=8192, page_block_size=64, invalid_frac=0.1, with_sink=True,
                      with_topk_length=True, device="cuda", generator=g)
    md, _ = cute_mla.get_mla_metadata()
    out, lse = cute_mla.flash_mla_with_kvcache(inp.q, inp.k_cache, None, None, 512, md, None, **inp.call_kwargs())
    ref_out, ref_lse = inp.reference()
    check_out_lse(out, lse, ref_out, ref_lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = cute_mla.flash_mla_with_kvcache(inp.q, inp.k_cache, None, None, 512, md, None,
                                                       **inp.call_kwargs())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)
