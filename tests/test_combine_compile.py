"""CPU-only: the split-KV combine compiles for both archs; PTX/SASS sanity; config and launcher checks."""

import re

import pytest
import torch

from cute_mla.kernels.combine import (
    MAX_SPLITS_BUCKETS,
    ROWS_IN_FLIGHT,
    THREADS_PER_CTA,
    VALUES_IN_FLIGHT,
    WARP_PER_HEAD_ABOVE_PAIRS,
    WARPS_PER_HEAD,
    chunks_per_lane,
    rows_in_flight,
    CombineConfig,
    combine_config,
    combine_max_splits,
    compile as compile_combine,
    launch as launch_combine,
)
from cute_mla.dsl.compile import CompiledKernel
from cute_mla.playground.inspect import find_artifacts, find_tool, local_memory_ops, read_ptx, resource_usage, sass

ARCHS = ("sm_90a", "sm_100a")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("has_attn_sink", [False, True])
@pytest.mark.parametrize("warps_per_head", WARPS_PER_HEAD)
def test_compiles_with_expected_ptx(arch, h_q, has_attn_sink, warps_per_head, tmp_path):
    cfg = CombineConfig(h_q=h_q, has_attn_sink=has_attn_sink, max_splits=160, arch=arch, warps_per_head=warps_per_head)
    compile_combine(cfg, dump_dir=str(tmp_path))
    ptx = read_ptx(str(tmp_path))
    chunks = chunks_per_lane(warps_per_head)
    assert f".target {arch}" in ptx
    assert ptx.count(".entry") == 1
    assert f".reqntid {THREADS_PER_CTA}, 1, 1" in ptx, "4 warps: a CTA per (token, head) or four heads"
    assert "griddepcontrol.wait" in ptx, "PDL wait before the accumulators are read"
    # Split rows come in as 16-byte loads, one per lane, chunk and row, rows_in_flight per batch,
    # from one copy of the batch code; plain (not .nc) loads, since .nc and PDL do not mix.
    assert ptx.count("ld.global.v4") == rows_in_flight(warps_per_head) * chunks and "ld.global.nc" not in ptx
    assert rows_in_flight(warps_per_head) * chunks * 4 == VALUES_IN_FLIGHT
    # Each bf16 chunk leaves as one 8-byte store per lane (and again in the NaN-poison path).
    assert ptx.count("st.global.v2.b32") == 2 * chunks
    assert "st.global.b16" not in ptx and "st.global.v4" not in ptx, "no scalar or 16-byte bf16 stores"
    # exp2/log2 are the approx instructions, which keep +-inf exact.
    assert "ex2.approx.f32" in ptx and "lg2.approx.f32" in ptx and "ex2.approx.ftz" not in ptx
    assert "shfl.sync.idx" in ptx, "split weights are broadcast by shuffles"
    # The sink is read only when compiled with one: the kernel has 6 tensor params either way.
    assert ptx.count("0f3FB8AA3B") == (1 if has_attn_sink else 0), "log2(e) multiply of the sink"


@pytest.mark.parametrize("max_splits", [32, 256])
def test_compiles_every_bucket_edge(max_splits, tmp_path):
    compile_combine(CombineConfig(h_q=64, has_attn_sink=True, max_splits=max_splits, arch="sm_90a"), dump_dir=str(tmp_path))
    ptx = read_ptx(str(tmp_path))
    # One lse load per register slot (max_splits / 32 per lane), besides accum_offsets and the sink.
    assert ptx.count("ld.global.b32") == max_splits // 32 + 2 + 1


def _sass_or_skip(cubin):
    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not importable: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    return sass(cubin)


# (warps per head 4) every bucket with fp32 partials (SM100's), with and without a sink; bf16
# partials (SM90's) at both ends of the bucket range; (warps per head 1) both dtypes at both ends
SPILL_CASES = [(ms, sink, "float32", 4) for ms in MAX_SPLITS_BUCKETS for sink in (False, True)] + [
    (ms, True, "bfloat16", 4) for ms in (32, 160, 256)] + [
    (ms, True, dt, 1) for ms in (32, 256) for dt in ("float32", "bfloat16")]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("max_splits,has_attn_sink,accum_dtype,warps_per_head", SPILL_CASES)
def test_rows_in_flight_without_spills(arch, max_splits, has_attn_sink, accum_dtype, warps_per_head, tmp_path):
    """No local memory (no spill, no stack), and the batch of row loads issued back to back.

    In the SASS the batch's row loads (VALUES_IN_FLIGHT / 4 per lane: 16 bytes each for fp32
    partials, 8 for bf16) form one run with nothing in between that uses a row (FFMA), waits on
    the lse loads (SHFL, MUFU of the reduction) or ends the block (BRA), and the run ends its
    basic block, so ptxas cannot schedule the lse reduction ahead of it.
    """
    loads_per_batch = VALUES_IN_FLIGHT // 4
    assert ROWS_IN_FLIGHT == loads_per_batch
    cfg = CombineConfig(h_q=64, has_attn_sink=has_attn_sink, max_splits=max_splits, arch=arch, accum_dtype=accum_dtype,
                        warps_per_head=warps_per_head)
    compile_combine(cfg, dump_dir=str(tmp_path))
    bf16 = accum_dtype == "bfloat16"
    ptx = read_ptx(str(tmp_path))
    assert ptx.count("ld.global.v2.b32" if bf16 else "ld.global.v4") == loads_per_batch
    assert "ld.global.v4" not in ptx or not bf16
    _, cubin = find_artifacts(str(tmp_path), arch)
    text = _sass_or_skip(cubin)
    res = resource_usage(cubin)
    print(arch, max_splits, has_attn_sink, accum_dtype, res)
    assert res["STACK"] == 0 and res["LOCAL"] == 0, res
    assert local_memory_ops(text) == 0
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG.E.64" if bf16 else "LDG.E.128")]
    assert len(loads) == loads_per_batch, ops
    between = ops[loads[0] : loads[-1]]
    assert not [op for op in between if op.startswith(("SHFL", "FFMA", "BRA", "MUFU"))], between
    after = ops[loads[-1] + 1 :]
    branch = next(i for i, op in enumerate(after) if op.startswith("BRA"))
    assert not [op for op in after[:branch] if op.startswith(("SHFL", "FFMA", "MUFU"))], after[:branch]


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
    with pytest.raises(ValueError, match="accum_dtype"):
        CombineConfig(h_q=64, has_attn_sink=False, max_splits=32, arch="sm_90a", accum_dtype="float16")
    a, b = (CombineConfig(h_q=64, has_attn_sink=False, max_splits=64, arch="sm_90a", accum_dtype=d)
            for d in ("float32", "bfloat16"))
    assert a.cache_key != b.cache_key, "one compiled kernel per partial dtype"
    with pytest.raises(ValueError, match="warps_per_head"):
        CombineConfig(h_q=64, has_attn_sink=False, max_splits=32, arch="sm_90a", warps_per_head=2)
    with pytest.raises(ValueError, match="multiple of 4"):
        CombineConfig(h_q=66, has_attn_sink=False, max_splits=32, arch="sm_90a", warps_per_head=1)
    a, b = (CombineConfig(h_q=64, has_attn_sink=False, max_splits=64, arch="sm_90a", warps_per_head=w)
            for w in WARPS_PER_HEAD)
    assert a.cache_key != b.cache_key, "one compiled kernel per layout"


def test_layout_follows_pairs():
    """A CTA per (token, head) while the grid is small; a warp per head once it holds more than
    WARP_PER_HEAD_ABOVE_PAIRS (token, head) pairs; always a warp per head when the grid walks the
    partitions (at least 66 rows of h_q >= 64 pairs)."""
    def wph(h_q, parts, b, s_q=1):
        return combine_config("sm_90a", h_q, False, parts, "bfloat16", b=b, s_q=s_q).warps_per_head

    t = WARP_PER_HEAD_ABOVE_PAIRS
    assert wph(64, 132, 1) == 4 and wph(128, 8, 1, s_q=8) == 4 and wph(64, 16, 1, s_q=8) == 4
    assert wph(64, 132, t // 64) == 4 and wph(64, 132, t // 64 + 1) == 1
    assert wph(128, 66, 32) == 1 and wph(128, 66, 16) == 1
    assert wph(64, 132, 133) == 1 and combine_config("sm_90a", 64, False, 132, b=133).by_partition
    assert wph(128, 66, 67) == 1


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
        wide = torch.empty(b, s_q, h, 514, dtype=torch.bfloat16)[..., :512]  # row stride 514: not 8-byte aligned
        launch_combine(dummy, no_sink, lse_accum, o_accum, ns, None, wide, lse)
    with pytest.raises(ValueError, match="out"):
        launch_combine(dummy, no_sink, lse_accum, o_accum, ns, None, out.transpose(2, 3), lse)


def test_launcher_accepts_8_byte_aligned_out_view():
    """out rows only need 8-byte alignment (one 8-byte store per lane): a stride of 516 passes."""
    calls = []
    recorder = CompiledKernel(key="recorder", fn=lambda *args: calls.append(args))
    b, s_q, h, rows = 3, 2, 64, 5
    f32 = torch.float32
    cfg = CombineConfig(h_q=h, has_attn_sink=False, max_splits=32, arch="sm_90a")
    wide = torch.empty(b, s_q, h, 516, dtype=torch.bfloat16)[..., :512]
    args = (torch.empty(rows, s_q, h, dtype=f32), torch.empty(rows, s_q, h, 512, dtype=f32),
            torch.zeros(b + 1, dtype=torch.int32), None, wide, torch.empty(b, s_q, h, dtype=f32))
    launch_combine(recorder, cfg, *args)
    assert len(calls) == 1 and calls[0][4] is wide


def _owned(row, b):
    """The combine's partition-ownership rule (``combine._owned_request``), on a host schedule row."""
    begin_req, end_req, begin_block, _, _, _, last_split, _ = row
    owns = last_split and begin_req < b and (begin_req < end_req or begin_block == 0)
    return end_req if owns else None


@pytest.mark.parametrize("parts", [3, 16, 66, 132])
@pytest.mark.parametrize("seed", range(4))
def test_partition_owners_are_the_split_requests_once(parts, seed):
    """by_partition: every split request is combined by exactly one partition, and no other request."""
    from cute_mla.scheduler import FIXED_OVERHEAD, plan_splits_host

    gen = torch.Generator().manual_seed(seed)
    for b in (parts + 1, 2 * parts, 8 * parts):
        blocks = torch.randint(1, 19, (b,), generator=gen).tolist()
        for overhead in (0, FIXED_OVERHEAD):
            s = plan_splits_host(blocks, parts, overhead)
            owners = [r for r in (_owned(row, b) for row in s.rows) if r is not None]
            split = [i for i in range(b) if s.num_splits[i + 1] - s.num_splits[i] > 1]
            assert sorted(owners) == split and len(set(owners)) == len(owners)


def test_by_partition_config_compiles_and_takes_tile_md(tmp_path):
    """More requests than partitions: the grid walks the schedule rows (a tile_md parameter)."""
    cfg = combine_config("sm_90a", 128, True, 66, "bfloat16", b=512)
    assert cfg.by_partition and not combine_config("sm_90a", 128, True, 66, "bfloat16", b=66).by_partition
    compile_combine(cfg, dump_dir=str(tmp_path))
    ptx = read_ptx(str(tmp_path))
    assert ptx.count(".param") > 0 and "griddepcontrol.wait" in ptx
    calls = []
    recorder = CompiledKernel(key="recorder", fn=lambda *args: calls.append(args))
    b, s_q, h, rows = 512, 1, 128, 5
    f32 = torch.float32
    args = (torch.empty(rows, s_q, h, dtype=f32), torch.empty(rows, s_q, h, 512, dtype=torch.bfloat16),
            torch.zeros(b + 1, dtype=torch.int32), torch.zeros(h), torch.empty(b, s_q, h, 512, dtype=torch.bfloat16),
            torch.empty(b, s_q, h, dtype=f32))
    with pytest.raises(ValueError, match="by_partition"):
        launch_combine(recorder, cfg, *args)
    md = torch.zeros(66, 8, dtype=torch.int32)
    launch_combine(recorder, cfg, *args, tile_md=md)
    assert calls[0][-1] is md
