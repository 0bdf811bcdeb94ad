"""CPU-only: the split-KV combine compiles for both archs; PTX sanity; config and launcher checks."""


import pytest
import torch

from cute_mla.kernels.combine import (
    MAX_SPLITS_BUCKETS,
    CombineConfig,
    combine_config,
    combine_max_splits,
    compile_combine,
    launch_combine,
)
from cute_mla.kernels.compile import CompiledKernel
from cute_mla.kernels.inspect import read_ptx

ARCHS = ("sm_90a", "sm_100a")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("has_attn_sink", [False, True])
def test_compiles_with_expected_ptx(arch, h_q, has_attn_sink, tmp_path):
    cfg = CombineConfig(h_q=h_q, has_attn_sink=has_attn_sink, max_splits=160, arch=arch)
    compile_combine(cfg, dump_dir=str(tmp_path))
    ptx = read_ptx(str(tmp_path))
    assert f".target {arch}" in ptx
    assert ptx.count(".entry") == 1
    assert ".reqntid 256, 1, 1" in ptx, "8 warps, one head each"
    assert "griddepcontrol.wait" in ptx, "PDL wait before the accumulators are read"
    # Split rows come in as 16-byte loads; plain (not .nc) loads, since .nc and PDL do not mix.
    assert "ld.global.v4" in ptx and "ld.global.nc" not in ptx
    # The bf16 row leaves as 16-byte stores (2 per lane, plus 2 for the NaN-poison path).
    assert ptx.count("st.global.v4.b32") == 4
    assert "st.global.b16" not in ptx, "no scalar bf16 stores"
    # exp2/log2 are the approx instructions, which keep +-inf exact.
    assert "ex2.approx.f32" in ptx and "lg2.approx.f32" in ptx and "ex2.approx.ftz" not in ptx
    assert "shfl.sync.idx" in ptx, "split weights are broadcast by shuffles"
    # The sink is read only when compiled with one: the kernel has 6 tensor params either way.
    assert ptx.count("0f3FB8AA3B") == (1 if has_attn_sink else 0), "log2(e) multiply of the sink"


@pytest.mark.parametrize("max_splits", [32, 256])
def test_compiles_every_bucket_edge(max_splits, tmp_path):
    compile_combine(CombineConfig(h_q=64, has_attn_sink=True, max_splits=max_splits, arch="sm_90a"), dump_dir=str(tmp_path))
    ptx = read_ptx(str(tmp_path))
    # One lse load per register slot (max_splits / 32 per lane), besides num_splits and the sink.
    assert ptx.count("ld.global.b32") == max_splits // 32 + 2 + 1


def test_compile_is_cached():
    cfg = CombineConfig(h_q=64, has_attn_sink=False, max_splits=32, arch="sm_100a")
    assert compile_combine(cfg) is compile_combine(cfg)


def test_buckets():
    assert combine_max_splits(1) == 32
    assert combine_max_splits(32) == 32
    assert combine_max_splits(33) == 64
    assert combine_max_splits(66) == 128
    assert combine_max_splits(132) == 160  # H100/H200, s_q = 1, h_q = 64
    assert combine_max_splits(148) == 160  # B200, s_q = 1
    assert combine_max_splits(256) == 256
    with pytest.raises(ValueError, match="bucket"):
        combine_max_splits(257)
    assert all(b % 32 == 0 for b in MAX_SPLITS_BUCKETS)
    cfg = combine_config(arch="sm_90a", h_q=128, has_attn_sink=True, num_sm_parts=66)
    assert (cfg.max_splits, cfg.h_q, cfg.has_attn_sink, cfg.arch) == (128, 128, True, "sm_90a")


def test_config_validation():
    with pytest.raises(ValueError, match="arch"):
        CombineConfig(h_q=64, has_attn_sink=False, max_splits=32, arch="sm_80")
    with pytest.raises(ValueError, match="max_splits"):
        CombineConfig(h_q=64, has_attn_sink=False, max_splits=48, arch="sm_90a")
    with pytest.raises(ValueError, match="d_v"):
        CombineConfig(h_q=64, has_attn_sink=False, max_splits=32, arch="sm_90a", d_v=256)
    with pytest.raises(ValueError, match="h_q"):
        CombineConfig(h_q=0, has_attn_sink=False, max_splits=32, arch="sm_90a")


def test_launcher_checks_before_launch():
    dummy = CompiledKernel(key="never-called", fn=None)  # the checks must fire before fn is used
    b, s_q, h, rows = 3, 2, 64, 5
    f32 = torch.float32
    lse_accum = torch.empty(rows, s_q, h, dtype=f32)
    o_accum = torch.empty(rows, s_q, h, 512, dtype=f32)
    ns = torch.zeros(b + 1, dtype=torch.int32)
    sink = torch.zeros(h, dtype=f32)
    out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16)
    lse = torch.empty(b, s_q, h, dtype=f32)
    no_sink = CombineConfig(h_q=h, has_attn_sink=False, max_splits=32, arch="sm_90a")
    with_sink = CombineConfig(h_q=h, has_attn_sink=True, max_splits=32, arch="sm_90a")
    with pytest.raises(ValueError, match="has_attn_sink"):
        launch_combine(dummy, no_sink, lse_accum, o_accum, ns, sink, out, lse)
    with pytest.raises(ValueError, match="has_attn_sink"):
        launch_combine(dummy, with_sink, lse_accum, o_accum, ns, None, out, lse)
    with pytest.raises(ValueError, match="b\\+1"):
        launch_combine(dummy, no_sink, lse_accum, o_accum, ns[:-1], None, out, lse)
    with pytest.raises(ValueError, match="o_accum"):
        launch_combine(dummy, no_sink, lse_accum, o_accum.transpose(1, 2), ns, None, out, lse)
    with pytest.raises(ValueError, match="out"):
        wide = torch.empty(b, s_q, h, 516, dtype=torch.bfloat16)[..., :512]  # row stride 516: not 16-byte aligned
        launch_combine(dummy, no_sink, lse_accum, o_accum, ns, None, wide, lse)
