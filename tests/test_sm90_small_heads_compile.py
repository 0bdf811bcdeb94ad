"""CPU-only: the SM90 sparse decode kernel's swap-AB tile (8, 16 and 32 heads, ``decode_small_roles.py``)
compiles for sm_90a; PTX and SASS sanity (the SASS checks skip with a reason without cuobjdump)."""

from __future__ import annotations

import re

import pytest

from cute_mla import archs, plan_sparse_decode
from cute_mla.kernels.sm90 import kernel_config
from cute_mla.kernels.sm90.config import TWO_PRODUCER_REGISTERS, Bar
from cute_mla.kernels.sm90.sparse_decode import compile as compile_sparse_decode, smem_bytes
from cute_mla.playground import inspect as ki
from _compile_helpers import compile_artifacts

ARCH = archs.SM90.name

# name: (h_q, format, split, has_topk_length, has_attn_sink, has_extra, has_extra_topk_length[, request_order])
CONFIGS = {
    "h8_split_tl_sink": (8, "V3.2", True, True, True, False, False),
    "h16_nosplit": (16, "V3.2", False, False, False, False, False),
    "h32_split_tl_sink": (32, "V3.2", True, True, True, False, False),
    "v4_h16_split_extra_tl": (16, "V4", True, True, True, True, True),
    "v4_h8_nosplit_extra": (8, "V4", False, False, True, True, False),
    "v4_h32_nosplit": (32, "V4", False, True, False, False, False),
    # the balanced cut's kernel (the plan's packed rule at 8 and 16 heads): partitions walk a request order
    "v4_h8_nosplit_extra_tl_order": (8, "V4", False, True, True, True, True, True),
}


def _config(name):
    h_q, fmt, split, tl, sink, extra, extra_tl, *order = CONFIGS[name]
    return kernel_config(h_q=h_q, format=fmt, split=split, has_topk_length=tl, has_attn_sink=sink, has_extra=extra,
                         has_extra_topk_length=extra_tl, request_order=bool(order))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Compile every config once; {name: (ptx text, cubin path)}."""
    return compile_artifacts(tmp_path_factory, CONFIGS, _config, compile_sparse_decode, ARCH)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ptx_is_the_swap_ab_tile(artifacts, name):
    """QK as m64n{h}k16 (d_qk / 16 k-steps, issued twice: a request's first tile and behind each
    PV) and 16 PV k-steps per MMA warp group, both with the heads on N; P^T and the output leave by
    stmatrix.trans; the register budget gives the producer the most."""
    ptx, _ = artifacts[name]
    cfg = _config(name)
    h = cfg.h_q
    mma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)
    assert set(mma) == {str(h)} and len(mma) == 2 * (cfg.d_qk // 16) + 2 * 16, (len(mma), set(mma))
    assert "stmatrix.sync.aligned.m8n8" in ptx and ".trans" in ptx
    regs = ki.setmaxnreg(ptx)
    budget = cfg.tuning.registers
    assert budget == TWO_PRODUCER_REGISTERS and budget.producers == 2
    targets = (budget.softmax, budget.pv_right, budget.producer)
    assert sorted(regs["inc"]) == sorted(r for r in targets if r > budget.entry)
    assert sorted(regs["dec"]) == sorted(r for r in targets if r < budget.entry)
    assert ki.tensor_map_params(ptx) == (3 if cfg.split else 2)
    used = {(int(i), int(n)) for i, n in re.findall(r"bar\.(?:sync|arrive)\s+(\d+),\s*(\d+)", ptx)}
    allowed = {(Bar.P_READY, 256), (Bar.P_FREE, 256), (Bar.Q_FREE, 256), (Bar.EPI_SOFTMAX, 128),
               (Bar.EPI_PV_RIGHT, 128), (Bar.INDEX_SCAN, 128), (Bar.INDEX_SCAN_B, 128)}
    assert used <= {(int(b), n) for b, n in allowed}, used


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_spills_and_asynchronous_wgmma(artifacts, name):
    _, cubin = artifacts[name]
    if ki.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not importable: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    sass = ki.sass(cubin)
    assert ki.local_memory_ops(sass) == 0
    st = ki.hgmma_stats(sass)
    assert not st.serialized and st.with_gsb0 <= 4, st


def test_shared_memory_and_plan():
    """The tile's storage fits (and is smaller than the 64-head tile's); the plan of a small-head
    call names the tile and needs no padding; SM100 refuses the heads by name."""
    for name in CONFIGS:
        assert smem_bytes(_config(name)) < smem_bytes(kernel_config(h_q=64, format=CONFIGS[name][1], split=False,
                                                                    has_topk_length=False, has_attn_sink=False))
    p = plan_sparse_decode(128, 1, 16, 576, 2048, arch=ARCH, num_sms=132)
    assert "the 16 heads on N" in p.describe() and p.h_q == 16
    with pytest.raises(ValueError, match="h_q: got 16, the sm_100a sparse decode kernel takes 64, 128"):
        plan_sparse_decode(128, 1, 16, 576, 2048, arch="sm_100a", num_sms=148)
