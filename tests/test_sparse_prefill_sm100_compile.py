"""CPU-only checks of the SM100 (sm_100a) sparse prefill kernel: representative variants compile, the
PTX has the Blackwell instructions the design relies on (tcgen05, TMEM, ``tile::gather4``), the
budgets fit, there is no local memory, every shared-memory layout the warps and the gather write is
the one the tensor core reads, and ``cute-mla compile --op sparse_prefill --arch sm_100a`` works.

Nothing here runs the kernel: no Blackwell GPU was available. tests/test_sparse_prefill_sm100_gpu.py
is the numerical test (B200). The MMAs, the TMEM accumulator layouts and the P / output-box byte
formulas are the decode kernel's, also checked in tests/test_sm100_compile.py.
"""

import glob
import os
import subprocess
import sys

import pytest

cute = pytest.importorskip("cutlass.cute")
import cutlass  # noqa: E402

from cute_mla import registry  # noqa: E402
from cute_mla.dsl.compile import CompiledKernel, compile_options  # noqa: E402
from cute_mla.kernels import SparsePrefillTensors  # noqa: E402
from cute_mla.kernels.sm100 import prefill_config as pc  # noqa: E402
from cute_mla.kernels.sm100 import prefill_roles as pr  # noqa: E402
from cute_mla.kernels.sm100 import sparse_prefill as sp  # noqa: E402
from cute_mla.kernels.sm100.config import Bar  # noqa: E402
from cute_mla.kernels.sm100.cta import k_tile_byte, p_tile_byte, swizzle_bytes, tiled_mmas  # noqa: E402
from cute_mla.plan.sparse_prefill import kernel_variants, plan_sparse_prefill  # noqa: E402
from cute_mla.playground.inspect import (find_artifacts, find_tool, local_memory_ops, read_ptx,  # noqa: E402
                                         resource_usage, sass, tensor_map_params)

from _sm100_helpers import check_tmem_teardown, waits_outside_loops  # noqa: E402

ARCH = "sm_100a"
# A representative subset of kernel_variants("sm_100a") (16 configs; CI has 2 cores): every head
# count and key width, each flag on and off.
VARIANTS = [
    # (h_q, d_qk, has_topk_length, has_attn_sink)
    (64, 576, False, False),
    (128, 576, True, True),
    (64, 512, True, False),
    (128, 512, False, True),
]


def _id(v):
    return f"h{v[0]}-d{v[1]}-tl{int(v[2])}-sink{int(v[3])}"


def _cfg(v):
    h_q, d_qk, tl, sink = v
    return sp.kernel_config(h_q=h_q, d_qk=d_qk, has_topk_length=tl, has_attn_sink=sink)


_COMPILED = {}


def _compile(v, tmp_path_factory):
    """(cfg, compiled, PTX, dump dir) of a variant, compiled once per session."""
    if v not in _COMPILED:
        d = str(tmp_path_factory.mktemp("sm100_prefill_" + _id(v).replace("-", "_")))
        cfg = _cfg(v)
        _COMPILED[v] = (cfg, sp.compile(cfg, dump_dir=d), read_ptx(d, ARCH), d)
    return _COMPILED[v]


# ------------------------------------------------------------------------------------------------
# The variants: PTX, budgets, resources
# ------------------------------------------------------------------------------------------------


def test_the_variants_are_the_plans():
    """kernel_variants("sm_100a") is every (h, d_qk, topk_length, sink) config, all of this kernel,
    and the subset compiled here is among them."""
    variants = kernel_variants(ARCH)
    assert len(variants) == 16 and {name for name, _ in variants} == {"sparse_prefill"}
    cfgs = {cfg for _, cfg in variants}
    assert all(isinstance(c, sp.Config) for c in cfgs)
    assert {_cfg(v) for v in VARIANTS} <= cfgs
    assert registry.op("sparse_prefill").kernel(ARCH).name == "sm100_sparse_prefill"
    assert registry.kernel_module("sparse_prefill", ARCH) is sp
    assert registry.config_module("sparse_prefill", ARCH) is pc


@pytest.mark.parametrize("v", VARIANTS, ids=_id)
def test_compiles_with_blackwell_ptx(v, tmp_path_factory):
    cfg, compiled, ptx, d = _compile(v, tmp_path_factory)
    tile = cfg.tile
    assert isinstance(compiled, CompiledKernel)
    counts = {k: ptx.count(k) for k in ("tcgen05.mma", "tile::gather4", "cp.async.bulk.tensor", "tcgen05.ld",
                                        "tcgen05.st", "tcgen05.commit", "mbarrier.try_wait")}
    print(f"\n{cfg}: smem {sp.smem_bytes(cfg)} B, TMEM {sp.tmem_columns(cfg)} columns, "
          f"{tensor_map_params(ptx)} tensor maps; " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    assert ".target sm_100a" in ptx and ptx.count(".entry") == 1
    assert f".reqntid {pc.WARPS.threads}, 1, 1" in ptx
    # QK: d_qk / 16 k-steps (M = 64, N = 32); PV: 2 halves x 2 k-steps (N = 256, K = 32), in the
    # loop (tile i - 1) and after it (the last tile)
    assert counts["tcgen05.mma"] == tile.qk_steps + 2 * 2 * tile.pv_steps
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx
    for op in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.relinquish_alloc_permit"):
        assert ptx.count(op) == 1, op
    assert "tcgen05.ld.sync.aligned.32x32b.x32" in ptx and "tcgen05.st.sync.aligned.32x32b.x32" in ptx
    # the row gather: one column block of 8 gather4 (4 rows each) in a loop over the d_qk / 64 blocks,
    # with the tuning's L2 hint; Q's d_qk / 64 boxes; the 16 output boxes
    assert counts["tile::gather4"] == tile.tokens // 4
    gathers = [ln for ln in ptx.splitlines() if "tile::gather4" in ln]
    assert all("cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4.mbarrier::complete_tx::bytes" in ln
               for ln in gathers)
    assert f"{pc.GATHER_L2[cfg.tuning.gather_l2]};" in ptx
    assert ptx.count("cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier") == tile.chunks
    assert ptx.count("cp.async.bulk.tensor.3d.global.shared::cta") == tile.out_boxes
    assert tensor_map_params(ptx) == len(sp.tensor_maps(cfg)) == 3
    # no register reconfiguration (224 threads: every thread may hold 255 registers), no dequant
    assert "setmaxnreg" not in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("v", VARIANTS[:2], ids=_id)
def test_no_local_memory_in_the_cubin(v, tmp_path_factory):
    """Registers / stack / local memory from the cubin, spills from the SASS (cuobjdump of the
    nvidia-cuda-cuobjdump wheel)."""
    cfg, _, _, d = _compile(v, tmp_path_factory)
    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    _, cubin = find_artifacts(d, ARCH)
    usage = resource_usage(cubin)
    print(f"\n{cfg}: {usage}")
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0
    assert local_memory_ops(sass(cubin)) == 0
    assert usage["REG"] <= 255
    # the static part is the 1 KiB the driver reserves; the kernel's memory is all dynamic
    assert usage["SHARED"] <= 1024 and sp.smem_bytes(cfg) + usage["SHARED"] <= 228 * 1024


def test_budgets_from_the_kernels_own_sizes():
    for d_qk in pc.WIDTHS:
        cfg = sp.kernel_config(h_q=64, d_qk=d_qk, has_topk_length=False, has_attn_sink=False)
        tile = cfg.tile
        smem = sp.smem_bytes(cfg)
        assert smem == pr.shared_storage(tile).size_in_bytes()
        assert smem <= sp.SMEM_LIMIT == 227 * 1024
        # the big pieces are really in the struct: Q, the K stages, P (O's staging fits in Q)
        big = 2 * (tile.q_elems + pc.STAGES.k * tile.k_stage_elems + tile.p_elems)
        assert big < smem <= big + 2048
        assert tile.out_staging_bytes <= 2 * tile.q_elems
        print(f"\nd_qk {d_qk}: shared memory {smem} B of {sp.SMEM_LIMIT}")
    assert sp.smem_bytes(None) == sp.smem_bytes(sp.kernel_config(h_q=128, d_qk=576, has_topk_length=True,
                                                                   has_attn_sink=True))
    cols = sp.tmem_columns(None)
    assert cols in (32, 64, 128, 256, 512), "tcgen05.alloc takes a power of two >= 32"
    assert pc.TMEM.used(pc.STAGES.s) == 320 <= cols <= 512
    # O's halves share columns [0, 256) (lanes 0-15 / 16-31); the S stages follow, one tile wide
    assert pc.TMEM.o_cols == pc.TILE.half_v and pc.TMEM.s_cols == pc.TILE.tokens


# ------------------------------------------------------------------------------------------------
# Layouts: what the gather and the warps write == what the MMAs read
# ------------------------------------------------------------------------------------------------


_FACTS = {}


@cute.jit
def _trace_layouts():
    qk, pv = tiled_mmas()
    for d_qk in pc.WIDTHS:
        tile = pc.tile_of_width(d_qk)
        L = pr.smem_layouts(qk, pv, tile)
        k = L["k"].outer
        f = _FACTS.setdefault(d_qk, {})
        f["k"] = [(t, d, cute.crd2idx(((t, d % 16), 0, ((d // 16) % 4, d // 64), 0), k))
                  for t in range(tile.tokens) for d in range(d_qk)]
        f["k_stage1"] = cute.crd2idx(((0, 0), 0, (0, 0), 1), k)
        f["box"] = [(t, d, cute.crd2idx((t, d), L["kv_box"].outer))
                    for t in range(tile.tokens) for d in range(tile.chunk)]
        v = L["v_outer"]
        f["v"] = [(h, d, t, cute.crd2idx((((d % 64, d // 64), t % 16), 0, t // 16, h, 0), v))
                  for h in range(2) for d in range(0, tile.half_v, 3) for t in range(tile.tokens)]
        f["v_stage1"] = cute.crd2idx((((0, 0), 0), 0, 0, 0, 1), v)
        f["p"] = [(r, tok, cute.crd2idx(((r, tok % 16), 0, tok // 16, 0), L["p"].outer))
                  for r in range(tile.heads) for tok in range(tile.tokens)]
        f["out_box"] = [(r, c, cute.crd2idx((r, c), L["out_box"].outer))
                        for r in range(tile.heads) for c in range(tile.epi_cols)]
        f["swizzles"] = {n: str(L[n].inner) for n in ("q", "k", "p", "kv_box", "out_box")}
        f["v_swizzle"] = str(L["v_swizzle"])
        f["q_size"] = cute.cosize(L["q"].outer)
        # The gather's TMA tensor over a (rows, d_qk) table, built and divided by the kernel's helpers:
        # the tile coordinate (0, c) must start at column 64 c (column block c of the K stage).
        kv = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.gmem, assumed_align=16),
                              cute.make_layout((1000, d_qk), stride=(d_qk + 8, 1)))
        _, kvt = pr.make_gather_atom(kv, cute.make_ptr(cutlass.Int32, 0, cute.AddressSpace.gmem, assumed_align=16),
                                     tile, L["kv_box"])
        tiles = pr.kv_tiles(kvt, tile)
        f["gather_cols"] = [str(tiles[(0, 0), (0, c)]) for c in range(tile.chunks)]


@pytest.fixture(scope="module")
def facts():
    if not _FACTS:
        # tcgen05 atoms check the arch: compiled for sm_100a whatever CUTE_DSL_ARCH says
        cute.compile(_trace_layouts, options=compile_options(ARCH))
    return _FACTS


def test_layout_swizzles(facts):
    for d_qk in pc.WIDTHS:
        assert facts[d_qk]["swizzles"] == {"q": "S<3,4,3>", "k": "S<3,4,3>", "p": "S<2,4,3>", "kv_box": "S<3,4,3>",
                                           "out_box": "S<2,4,3>"}
        assert facts[d_qk]["v_swizzle"] == "S<3,4,3>"
        assert facts[d_qk]["q_size"] == pc.tile_of_width(d_qk).q_elems


@pytest.mark.parametrize("d_qk", pc.WIDTHS)
def test_k_stage_is_the_decode_kernels_k_tile(facts, d_qk):
    """The MMA's K stage (QK's B operand): K[t, d] at k_tile_byte(t, d), its 64-dim column blocks
    4 KiB apart (32 rows of 128 B), SW128 K-major, RoPE dims 512-575 in block 8."""
    f, tile = facts[d_qk], pc.tile_of_width(d_qk)
    bad = [(t, d) for t, d, e in f["k"] if swizzle_bytes(2 * e, 3) != k_tile_byte(t, d - d % 8) + 2 * (d % 8)]
    assert not bad, bad[:5]
    assert f["k_stage1"] == tile.k_stage_elems


@pytest.mark.parametrize("d_qk", pc.WIDTHS)
def test_the_gather_writes_the_k_stage(facts, d_qk):
    """gather4 of column block c writes rows t, dims [64 c, 64 c + 64) into the 32 x 64 SW128 box at
    element c * 2048 of the stage (the kernel's destination) = K[t, 64 c + d] of the MMA's layout,
    and its TMA coordinates start at column 64 c (the row coordinates are the ring's)."""
    f, tile = facts[d_qk], pc.tile_of_width(d_qk)
    k = {(t, d): e for t, d, e in f["k"]}
    bad = [(c, t, d) for c in range(tile.chunks) for t, d, e in f["box"]
           if swizzle_bytes(2 * (e + c * tile.k_block_elems), 3) != swizzle_bytes(2 * k[(t, 64 * c + d)], 3)]
    assert not bad, bad[:5]
    # every byte of the stage is written once
    assert tile.chunks * len(f["box"]) == tile.k_stage_elems
    assert f["gather_cols"] == [f"({64 * c}, 0)" for c in range(tile.chunks)]


@pytest.mark.parametrize("d_qk", pc.WIDTHS)
def test_v_view_is_the_k_stage(facts, d_qk):
    """PV reads V[t, 256 h + d] through the MN-major view: the same element as K[t, 256 h + d]
    (V = the first 512 dims of the gathered rows, no copy)."""
    f, tile = facts[d_qk], pc.tile_of_width(d_qk)
    k = {(t, d): e for t, d, e in f["k"]}
    bad = [(h, d, t) for h, d, t, e in f["v"] if e != k[(t, tile.half_v * h + d)]]
    assert not bad, bad[:5]
    assert f["v_stage1"] == tile.k_stage_elems


def test_p_and_staging_formulas_match_layouts(facts):
    f = facts[576]
    bad = [(r, t) for r, t, e in f["p"] if swizzle_bytes(2 * e, 2) != p_tile_byte(r, t - t % 8) + 2 * (t % 8)]
    assert not bad, bad[:5]
    tile = pc.TILE
    for b in range(tile.out_boxes):   # box b of the staging holds out columns [32 b, 32 b + 32)
        bad = [(r, c) for r, c, e in f["out_box"]
               if b * tile.out_box_bytes + swizzle_bytes(2 * e, 2)
               != pr.staging_box_byte(tile, r, 32 * b + c - c % 8) + 2 * (c % 8)]
        assert not bad, (b, bad[:5])


# ------------------------------------------------------------------------------------------------
# Control flow: producer tail, TMEM teardown (on the PTX's control-flow graph)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", VARIANTS[:2], ids=_id)
def test_producer_tail_and_tmem_teardown(v, tmp_path_factory):
    """GATHER waits for the last K-stage commits before it exits (producer_tail: one wait per K
    stage after its loop; the other waits outside every loop are the four once-per-CTA ones: GATHER's
    acquire of the Q slot, the MMA warp's wait for Q and for the last P, the softmax's wait for the
    last PV before the epilogue); the MMA warp deallocates TMEM after the Bar.TMEM barrier with
    tcgen05.fence::after_thread_sync as the only tcgen05 instruction between them, and the softmax
    warpgroup's last instruction before that barrier is tcgen05.fence::before_thread_sync."""
    _, _, ptx, _ = _compile(v, tmp_path_factory)
    assert waits_outside_loops(ptx) == pc.STAGES.k + 4
    check_tmem_teardown(ptx, Bar.TMEM, pc.WARPS.softmax_threads + 32)


# ------------------------------------------------------------------------------------------------
# The protocol's host side: configs, plans, cache, launch
# ------------------------------------------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="h_q"):
        sp.kernel_config(h_q=32, d_qk=576, has_topk_length=False, has_attn_sink=False)
    with pytest.raises(ValueError, match="d_qk"):
        sp.kernel_config(h_q=64, d_qk=656, has_topk_length=False, has_attn_sink=False)
    with pytest.raises(ValueError, match="tuning"):
        sp.kernel_config(h_q=64, d_qk=576, has_topk_length=False, has_attn_sink=False, tuning=object())
    with pytest.raises(ValueError, match="gather_l2"):
        pc.Sm100PrefillTuning(gather_l2="evict_sometimes")
    with pytest.raises(ValueError, match="arch"):
        sp.Sm100SparsePrefillConfig(h_q=64, d_qk=576, has_topk_length=False, has_attn_sink=False, arch="sm_90a")
    cfg = sp.kernel_config(h_q=128, d_qk=512, has_topk_length=True, has_attn_sink=False,
                           tuning=pc.Sm100PrefillTuning(gather_l2=""))
    assert cfg.n_hblk == 2 and cfg.tile.chunks == 8 and hash(cfg) == hash(pc.Config(**vars(cfg)))
    assert cfg.tuning != pc.DEFAULT_TUNING


def test_plans_map_to_configs():
    for h_q, kernel_h in ((8, 64), (32, 64), (64, 64), (128, 128)):
        for d_qk in (576, 512):
            plan = plan_sparse_prefill(4096, h_q, d_qk, 2048, arch=ARCH, has_topk_length=True)
            assert plan.kernel == "sm100_sparse_prefill"
            cfg = pc.config_for(plan, has_attn_sink=True)
            assert (cfg.h_q, cfg.d_qk, cfg.has_topk_length, cfg.has_attn_sink) == (kernel_h, d_qk, True, True)
            assert plan.tensor_maps == pc.tensor_maps(cfg) == ("q", "kv", "out")


def test_compile_is_cached():
    cfg = _cfg(VARIANTS[0])
    assert sp.compile(cfg) is sp.compile(cfg)


def test_launch_passes_entry_order_and_a_one_row_kv():
    """launch calls the compiled function with the bundle's ENTRY fields, then the scale (CPU
    tensors suffice: the function is a stand-in); a one-row kv, whose stride torch leaves free, gets
    the 16-B multiple the gather4 tensor map takes."""
    import torch

    calls = []
    dummy = CompiledKernel(key="dummy", fn=lambda *a: calls.append(a))
    s_q, h, topk = 3, 64, 128
    q = torch.zeros(s_q, h, 576, dtype=torch.bfloat16)
    idx = torch.zeros(s_q, 1, topk, dtype=torch.int32)
    out = torch.zeros(s_q, h, 512, dtype=torch.bfloat16)
    ml, lse = torch.zeros(s_q, h), torch.zeros(s_q, h)
    cfg = _cfg(VARIANTS[0])
    kv = torch.zeros(10, 1, 576, dtype=torch.bfloat16)
    sp.launch(dummy, cfg, SparsePrefillTensors(q, kv, idx, None, None, out, ml, lse, softmax_scale=0.25))
    assert calls[0] == (q, kv, idx, None, None, out, ml, lse, 0.25)
    one = torch.zeros(1, 600, dtype=torch.bfloat16)[:, :576].as_strided((1, 1, 576), (3, 5, 1))
    sp.launch(dummy, cfg, SparsePrefillTensors(q, one, idx, None, None, out, ml, lse, softmax_scale=0.25))
    fixed = calls[1][1]
    assert fixed.stride() == (576, 576, 1) and fixed.data_ptr() == one.data_ptr() and torch.equal(fixed, one)


def test_cli_compiles_the_prefill_kernel(tmp_path):
    """``python -m cute_mla.cli compile --op sparse_prefill --arch sm_100a --d-qk 576 --h-q 128``:
    PTX and cubin named by the variant, the report's resource lines."""
    env = dict(os.environ, CUTE_MLA_CACHE_DIR="off")
    r = subprocess.run([sys.executable, "-m", "cute_mla.cli", "compile", "--op", "sparse_prefill", "--arch", ARCH,
                        "--d-qk", "576", "--h-q", "128", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    print(r.stdout)
    names = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*")))
    assert names == ["sparse_prefill-sm_100a-h128-d576.cubin", "sparse_prefill-sm_100a-h128-d576.ptx"]
    assert "compiled sparse_prefill for sm_100a" in r.stdout
    assert "TMEM 512 columns" in r.stdout and f"dynamic shared memory {sp.smem_bytes(None)} B" in r.stdout
    assert "tcgen05.mma 44" in r.stdout and "gather4 8" in r.stdout
