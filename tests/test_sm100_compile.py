"""CPU-only checks of the SM100 (sm_100a) sparse decode kernel: it compiles in every variant, its PTX
has the Blackwell instructions the design relies on, its budgets fit, and every hand-written
shared-memory byte formula matches the CuTe layout the tensor core / TMA reads, element by element.

Nothing here runs the kernel: no Blackwell GPU was available. tests/test_sm100_gpu.py is the
numerical test (B200).
"""

import glob
import os
import re

import pytest

cute = pytest.importorskip("cutlass.cute")
import cutlass  # noqa: E402
from cutlass.cute.nvgpu import tcgen05  # noqa: E402

from cute_mla.dsl.compile import CompiledKernel, compile_options  # noqa: E402
from cute_mla.formats import V4, V32  # noqa: E402
from cute_mla.playground.inspect import find_tool, read_ptx, resource_usage, tensor_map_params  # noqa: E402
from cute_mla.kernels.sm100 import cta  # noqa: E402
from cute_mla.kernels.sm100 import sparse_decode as sd  # noqa: E402
from cute_mla.kernels.sm100.sparse_decode import (  # noqa: E402
    SMEM_LIMIT,
    STAGES,
    TILE,
    TMEM,
    Sm100SparseDecodeConfig,
    compile as compile_sparse_decode,
    smem_bytes,
    tmem_columns,
)

from _sm100_helpers import WAIT, check_tmem_teardown, cycles, has, ptx_cfg, waits_outside_loops  # noqa: E402

VARIANTS = [
    # (h_q, split, has_topk_length, has_attn_sink)
    (64, False, False, False),
    (64, True, False, False),
    (64, True, True, True),
    (128, False, True, True),
    (128, True, False, True),
]

_INSTR = [
    "tcgen05.mma", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.relinquish_alloc_permit", "tcgen05.ld", "tcgen05.st",
    "tcgen05.commit", "tcgen05.wait", "tcgen05.fence", "tile::gather4", "cp.async.bulk.tensor", "mbarrier.try_wait",
    "setmaxnreg", "elect.sync", "cvt.rn.f16x2.e4m3x2", "cvt.rn.bf16x2.f32", "ex2.approx", "st.shared::cta.v4",
    "ld.shared.v4", "fence.proxy.async", "bar.sync",
]


def _counts(ptx: str) -> dict:
    return {k: ptx.count(k) for k in _INSTR}


_COMPILED = {}


def _compile_cfg(key, cfg, tag, tmp_path_factory):
    """(cfg, compiled kernel, PTX, dump dir) of a config, compiled once per test session."""
    if key not in _COMPILED:
        d = str(tmp_path_factory.mktemp(tag))
        _COMPILED[key] = (cfg, compile_sparse_decode(cfg, dump_dir=d), read_ptx(d, "sm_100a"), d)
    return _COMPILED[key]


def _compile(variant, tmp_path_factory):
    h_q, split, tl, sink = variant
    cfg = Sm100SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=tl, has_attn_sink=sink)
    return _compile_cfg(variant, cfg, f"sm100_{h_q}_{int(split)}{int(tl)}{int(sink)}", tmp_path_factory)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"h{v[0]}-{'split' if v[1] else 'nosplit'}-tl{int(v[2])}-sink{int(v[3])}")
def test_compiles_with_blackwell_ptx(variant, tmp_path_factory):
    cfg, compiled, ptx, d = _compile(variant, tmp_path_factory)
    assert isinstance(compiled, CompiledKernel)
    c = _counts(ptx)
    print(f"\n{cfg}: smem {smem_bytes(cfg)} B, TMEM {tmem_columns(cfg)} columns ({TMEM.used(STAGES.s)} used), "
          f"{tensor_map_params(ptx)} tensor maps\n  " + ", ".join(f"{k} {v}" for k, v in c.items()))
    assert ".target sm_100a" in ptx
    assert ptx.count(".entry") == 1
    assert f".reqntid {sd.WARPS.threads}, 1, 1" in ptx
    # tcgen05: 36 QK MMAs (32 NoPE + 4 RoPE k-steps of 16) and 2 x (2 halves x 2 k-steps) PV MMAs
    # (PV of tile i-1 inside the loop, PV of the last tile after it).
    assert c["tcgen05.mma"] == TILE.d_qk // 16 + 2 * 2 * (TILE.tokens // 16)
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx
    assert c["tcgen05.alloc"] == 1 and c["tcgen05.dealloc"] == 1 and c["tcgen05.relinquish_alloc_permit"] == 1
    assert "tcgen05.ld.sync.aligned.32x32b.x32" in ptx and "tcgen05.st.sync.aligned.32x32b.x32" in ptx
    # Two gather4 streams (NoPE+scales, RoPE), 8 instructions of 4 rows each per 32-token tile.
    assert c["tile::gather4"] == 2 * TILE.tokens // 4
    assert "cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4.mbarrier::complete_tx::bytes" in ptx
    # The exact fp8 dequantization: e4m3x2 -> f16x2, f32 multiply by the fp32 scale, one rounding to bf16.
    assert c["cvt.rn.f16x2.e4m3x2"] == 2 * 32 and "mul.rn.f32" in ptx
    # every e4m3 pair: two fp32 multiplies by the scale, then its one rounding to bf16x2
    assert ptx.count("mul.rn.f32") >= 2 * c["cvt.rn.f16x2.e4m3x2"]
    assert ptx.count("cvt.rn.bf16x2.f32") >= c["cvt.rn.f16x2.e4m3x2"]
    assert re.search(rf"setmaxnreg.inc.sync.aligned.u32\s+{sd.REGS.softmax};", ptx)
    assert re.search(rf"setmaxnreg.inc.sync.aligned.u32\s+{sd.REGS.dequant};", ptx)
    assert re.search(rf"setmaxnreg.dec.sync.aligned.u32\s+{sd.REGS.producers};", ptx)
    # Every TMA (load or store) and every tcgen05.mma / commit is issued under elect.sync by a whole warp.
    assert c["elect.sync"] >= c["cp.async.bulk.tensor"] // 8


def test_split_variant_has_one_more_tensor_map(tmp_path_factory):
    for h_q in (64, 128):
        base = (h_q, False, False, False) if h_q == 64 else (128, False, True, True)
        split = (64, True, False, False) if h_q == 64 else (128, True, False, True)
        _, _, p_no, _ = _compile(base, tmp_path_factory)
        _, _, p_sp, _ = _compile(split, tmp_path_factory)
        # q, kv_nope, kv_rope, out (+ o_accum): the no-split variant has no accumulator tensor map.
        assert tensor_map_params(p_no) == 4
        assert tensor_map_params(p_sp) == tensor_map_params(p_no) + 1
        # the plan lists exactly the tensor maps the compiled variant builds
        from cute_mla import plan_sparse_decode
        assert len(plan_sparse_decode(4, 1, h_q, 576, 512, arch="sm_100a", num_sms=148).tensor_maps) == tensor_map_params(p_no)
        assert len(plan_sparse_decode(4, 1, h_q, 576, 2048, arch="sm_100a", num_sms=148).tensor_maps) == tensor_map_params(p_sp)
        # TMA stores: out boxes (2 halves x 8 column chunks), plus the o_accum boxes in the split variant.
        assert p_no.count("cp.async.bulk.tensor.2d.global.shared::cta") + p_no.count("cp.async.bulk.tensor.4d.global.shared::cta") == 16
        assert p_sp.count("cp.async.bulk.tensor.4d.global.shared::cta") + p_sp.count("cp.async.bulk.tensor.2d.global.shared::cta") == 32


def test_budgets_from_the_kernels_own_sizes():
    for h_q, split, tl, sink in VARIANTS:
        cfg = Sm100SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=tl, has_attn_sink=sink)
        smem = smem_bytes(cfg)
        assert smem == sd._shared_storage().size_in_bytes()
        assert smem <= 227 * 1024 == SMEM_LIMIT, f"shared memory {smem} B"
        # The big pieces are really in the struct (a layout change shows up here).
        big = (TILE.q_elems * 2 + STAGES.kbuf * TILE.k_stage_elems * 2 + STAGES.gather * TILE.rope_stage_elems * 2
               + TILE.p_elems * 2 + TILE.epi_stage_bytes + STAGES.gather * TILE.raw_stage_bytes)
        assert big < smem < big + 4096
        assert tmem_columns(cfg) <= 512
        assert TMEM.used(STAGES.s) <= tmem_columns(cfg)
        assert tmem_columns(cfg) in (32, 64, 128, 256, 512), "tcgen05.alloc takes a power of two >= 32"
    print(f"\nshared memory {smem_bytes(cfg)} B of {SMEM_LIMIT}; TMEM {TMEM.used(STAGES.s)} of {tmem_columns(cfg)} columns")


def test_cubin_resources(tmp_path_factory):
    """Registers / stack / static shared memory from the cubin (cuobjdump from the nvidia wheels)."""
    _, _, _, d = _compile((64, True, True, True), tmp_path_factory)
    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    cubin = glob.glob(os.path.join(d, "*.cubin"))
    assert cubin
    usage = resource_usage(cubin[0])
    print(f"\n{usage}")
    # The static part is the 1 KiB the driver reserves; the kernel's memory is all dynamic.
    assert usage["SHARED"] <= 1024
    assert smem_bytes(None) + usage["SHARED"] <= 228 * 1024


# ------------------------------------------------------------------------------------------------
# Layout checks: the formulas the warps write with == the layouts the MMAs / TMAs read
# ------------------------------------------------------------------------------------------------


_LAYOUT_FACTS = {}


def _collect_layout_facts(L, s_frag, o_frag, o_full_frag, tmem_thread_coords):
    """Plain Python (not traced): static crd2idx on static layouts returns ints."""
    f = {"tmem_thread_coords": tmem_thread_coords}
    k = L["k"].outer
    f["k"] = [
        (t, d, cute.crd2idx(((t, d % 16), 0, ((d // 16) % 4, d // 64), 0), k))
        for t in range(TILE.tokens) for d in range(TILE.d_nope)
    ]
    f["k_stage1"] = cute.crd2idx(((0, 0), 0, (0, 0), 1), k)
    v = L["v_outer"]
    f["v"] = [
        (h, d, t, cute.crd2idx((((d % 64, d // 64), t % 16), 0, t // 16, h, 0), v))
        for h in range(2) for d in range(0, TILE.half_v, 3) for t in range(TILE.tokens)
    ]
    f["v_stage1"] = cute.crd2idx((((0, 0), 0), 0, 0, 0, 1), v)
    f["rope_mma"] = [cute.crd2idx(((t, d % 16), 0, d // 16, 0), L["rope"].outer) for t in range(TILE.tokens) for d in range(TILE.d_rope)]
    f["rope_tma"] = [cute.crd2idx((t, d), L["rope_tma"].outer) for t in range(TILE.tokens) for d in range(TILE.d_rope)]
    f["p"] = [(r, tok, cute.crd2idx(((r, tok % 16), 0, tok // 16, 0), L["p"].outer))
              for r in range(TILE.heads) for tok in range(TILE.tokens)]
    f["out_box"] = [(r, c, cute.crd2idx((r, c), L["out_box"].outer)) for r in range(TILE.heads) for c in range(TILE.epi_cols)]
    f["oacc_box"] = [(r, c, cute.crd2idx((r, c), L["oacc_box"].outer)) for r in range(TILE.heads) for c in range(TILE.epi_cols)]
    f["swizzles"] = {n: str(L[n].inner) for n in ("q", "k", "rope", "p", "rope_tma", "out_box", "oacc_box")}
    f["v_swizzle"] = str(L["v_swizzle"])
    # TMEM accumulators: address = lane << 16 | column (units of 32-bit cells)
    f["s_tmem"] = [(r, c, cute.crd2idx(((r, c), 0, 0), s_frag)) for r in range(TILE.heads) for c in range(TILE.tokens)]
    f["o_tmem"] = [(r, c, cute.crd2idx(((r, c), 0, 0), o_frag)) for r in range(TILE.heads) for c in range(0, TILE.half_v, 5)]
    f["o_full_tmem"] = [(r, c, cute.crd2idx(((r, c % TILE.half_v), 0, c // TILE.half_v), o_full_frag))
                        for r in range(TILE.heads) for c in range(0, TILE.d_v, 7)]
    _LAYOUT_FACTS.update(f)


@cute.jit
def _trace_layouts():
    qk, pv = cta.tiled_mmas()
    L = sd.smem_layouts(qk, pv)
    s_frag = qk.make_fragment_C(qk.partition_shape_C((TILE.heads, TILE.tokens))).layout
    o_frag = pv.make_fragment_C(pv.partition_shape_C((TILE.heads, TILE.half_v))).layout
    o_full = pv.make_fragment_C(pv.partition_shape_C((TILE.heads, TILE.d_v))).layout
    # The softmax warpgroup's TMEM view and copy (the same construction as in softmax_role).
    ptr = cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem, assumed_align=16)
    view = cute.make_tensor(ptr, cute.make_layout((128, TILE.epi_cols), stride=(1 << 16, 1)))
    ld = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), cutlass.Float32), view)
    coords = {}
    for t in (0, 5, 16, 37, 80, 127):
        c = ld.get_slice(t).partition_D(cute.make_identity_tensor((128, TILE.epi_cols)))
        coords[t] = [c[j] for j in range(TILE.epi_cols)]
    _collect_layout_facts(L, s_frag, o_frag, o_full, coords)


def _traced_once(store: dict, trace) -> dict:
    """``store``, filled by compiling ``trace`` the first time. The trace builds tcgen05 atoms,
    which check the arch: compiled for sm_100a, whatever CUTE_DSL_ARCH the caller's environment
    holds (called directly, the trace took the environment's arch, and a shell with
    CUTE_DSL_ARCH=sm_90a errored here)."""
    if not store:
        cute.compile(trace, options=compile_options("sm_100a"))
    return store


@pytest.fixture(scope="module")
def facts():
    return _traced_once(_LAYOUT_FACTS, _trace_layouts)


def test_layout_swizzles(facts):
    sw = facts["swizzles"]
    for name in ("q", "k", "rope", "rope_tma", "oacc_box"):
        assert sw[name] == "S<3,4,3>", (name, sw[name])  # SW128
    for name in ("p", "out_box"):
        assert sw[name] == "S<2,4,3>", (name, sw[name])  # SW64
    assert facts["v_swizzle"] == "S<3,4,3>"


def test_k_tile_formula_matches_layout(facts):
    """Dequant warps write K[t, d] at k_tile_byte(t, d): the UMMA's K-major SW128 operand."""
    bad = [(t, d) for t, d, e in facts["k"]
           if cta.swizzle_bytes(2 * e, 3) != cta.k_tile_byte(t, d - d % 8) + 2 * (d % 8)]
    assert not bad, bad[:5]
    assert facts["k_stage1"] == TILE.k_stage_elems  # stage stride used for the dequant writes


def test_v_view_is_the_k_tile(facts):
    """PV reads V[t, 256 h + d] through the MN-major view: the same element as K[t, 256 h + d]."""
    k = {(t, d): e for t, d, e in facts["k"]}
    bad = [(h, d, t) for h, d, t, e in facts["v"] if e != k[(t, TILE.half_v * h + d)]]
    assert not bad, bad[:5]
    assert facts["v_stage1"] == TILE.k_stage_elems


def test_rope_tma_view_is_the_mma_tile(facts):
    assert facts["rope_tma"] == facts["rope_mma"]


def test_p_and_staging_formulas_match_layouts(facts):
    bad = [(r, t) for r, t, e in facts["p"] if cta.swizzle_bytes(2 * e, 2) != cta.p_tile_byte(r, t - t % 8) + 2 * (t % 8)]
    assert not bad, bad[:5]
    bad = [(r, c) for r, c, e in facts["out_box"] if cta.swizzle_bytes(2 * e, 2) != cta.out_box_byte(r, c - c % 8) + 2 * (c % 8)]
    assert not bad, bad[:5]
    bad = [(r, c) for r, c, e in facts["oacc_box"] if cta.swizzle_bytes(4 * e, 3) != sd.oacc_box_byte(r, c - c % 4) + 4 * (c % 4)]
    assert not bad, bad[:5]


def _tmem_lane_col(addr):
    return addr >> 16, addr & 0xFFFF


def test_tmem_accumulator_layouts(facts):
    """M=64 accumulators (data-path layout F): row r in lane 32 (r // 16) + r % 16; the softmax
    thread of TMEM lane 32 w + l (l < 16) therefore owns row 16 w + l of S and of O[:, 0:256]; the
    second N=256 half of O sits 16 lanes up in the same columns (the lanes l >= 16)."""
    for r, c, a in facts["s_tmem"]:
        assert _tmem_lane_col(a) == (32 * (r // 16) + r % 16, c)
    for r, c, a in facts["o_tmem"]:
        assert _tmem_lane_col(a) == (32 * (r // 16) + r % 16, c)
    for r, c, a in facts["o_full_tmem"]:
        half = c // TILE.half_v
        assert _tmem_lane_col(a) == (32 * (r // 16) + r % 16 + 16 * half, c % TILE.half_v)
    assert TMEM.o_upper_lane_offset == 16 << 16


def test_softmax_thread_owns_its_tmem_lane(facts):
    """tcgen05.ld 32x32b.x32 through the softmax view: thread t (warp t // 32) reads TMEM lane t,
    register j = column j (the P and output writes rely on this order)."""
    for t, coords in facts["tmem_thread_coords"].items():
        assert [tuple(int(x) for x in c) for c in coords] == [(t, j) for j in range(TILE.epi_cols)], t


def test_config_validation():
    with pytest.raises(ValueError, match="h_q"):
        Sm100SparseDecodeConfig(h_q=32, split=False, has_topk_length=False, has_attn_sink=False)
    with pytest.raises(ValueError, match="format"):
        Sm100SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False, format="V5")
    # the V4 cache (d_qk 512); the extra pool is V4's only, and its lengths need it
    assert Sm100SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False, format="V4").tile.fmt is V4
    with pytest.raises(ValueError, match="has_extra"):
        Sm100SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False, has_extra=True)
    with pytest.raises(ValueError, match="has_extra_topk_length"):
        Sm100SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False, format="V4",
                                has_extra_topk_length=True)
    with pytest.raises(ValueError, match="has_extra"):
        sd.kernel_config(h_q=64, format="V3.2", split=False, has_topk_length=False, has_attn_sink=False, has_extra=True)
    cfg = sd.kernel_config(h_q=128, format="V4", split=True, has_topk_length=True, has_attn_sink=False, has_extra=True,
                           has_extra_topk_length=True)
    assert cfg.has_extra and cfg.has_extra_topk_length and cfg.d_v == 512
    with pytest.raises(ValueError, match="column_pair"):
        sd.kernel_config(h_q=64, format="V3.2", split=True, has_topk_length=False, has_attn_sink=False, column_pair=True)
    with pytest.raises(ValueError, match="tuning"):
        sd.kernel_config(h_q=64, format="V3.2", split=True, has_topk_length=False, has_attn_sink=False, tuning=object())
    with pytest.raises(ValueError, match="arch"):
        Sm100SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False, arch="sm_90a")


def test_compile_is_cached():
    cfg = Sm100SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False)
    assert compile_sparse_decode(cfg) is compile_sparse_decode(cfg)


def test_register_budget_and_roles():
    r = sd.REGS
    assert r.softmax + r.dequant + r.producers <= 504
    assert sd.WARPS.threads == 384
    assert int(sd.Warp.DEQUANT) == 4 and int(sd.Warp.MMA) == 8, "warpgroups 0 and 1 are whole (TMEM lane slabs)"
    assert TILE.sched_block % TILE.tokens == 0 and TILE.raw_row_bytes * 4 % 128 == 0


def test_launcher_rejects_what_the_kernel_cannot_take():
    """Checks made in Python before the compiled function is called (CPU tensors suffice)."""
    import torch

    from cute_mla.kernels.sm100.sparse_decode import launch as launch_sparse_decode

    cfg = Sm100SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False)
    dummy = CompiledKernel(key="dummy", fn=lambda *a: pytest.fail("must not be called"))
    b, s_q, topk = 2, 1, 128
    q = torch.zeros(b, s_q, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 3, 656, dtype=torch.uint8)
    idx = torch.zeros(b, s_q, topk, dtype=torch.int32)
    tile_md = torch.zeros(b, 8, dtype=torch.int32)
    ns = torch.arange(b + 1, dtype=torch.int32)
    out = torch.zeros(b, s_q, 64, 512, dtype=torch.bfloat16)
    lse = torch.zeros(b, s_q, 64)

    def call(**kw):
        from cute_mla.kernels import SparseDecodeTensors

        a = dict(q=q, k_cache=kv, indices=idx, topk_length=None, attn_sink=None, tile_md=tile_md, accum_offsets=ns,
                 out=out, lse=lse, o_accum=None, lse_accum=None, softmax_scale=0.1)
        a.update(kw)
        launch_sparse_decode(dummy, cfg, SparseDecodeTensors(**a))

    with pytest.raises(ValueError, match="has_attn_sink"):
        call(attn_sink=torch.zeros(64))
    with pytest.raises(ValueError, match="has_topk_length"):
        call(topk_length=torch.zeros(b, dtype=torch.int32))
    with pytest.raises(ValueError, match="o_accum"):
        call(o_accum=torch.zeros(1, s_q, 64, 512), lse_accum=torch.zeros(1, s_q, 64))
    padded = torch.zeros(4, 3 * 656 + 8, dtype=torch.uint8)[:, : 3 * 656].view(4, 3, 656)
    with pytest.raises(ValueError, match="stride"):
        call(k_cache=padded)  # stride(0) not a multiple of 656: no 2-D table of rows for gather4
    with pytest.raises(ValueError, match="multiple of 64"):
        call(indices=torch.zeros(b, s_q, 96, dtype=torch.int32))
    with pytest.raises(ValueError, match="16-byte"):
        call(q=torch.zeros(b, s_q, 64, 580, dtype=torch.bfloat16)[..., :576])


# ------------------------------------------------------------------------------------------------
# V4 ("MODEL1", d_qk 512, 584 B/token): the format difference and the extra KV pool
# ------------------------------------------------------------------------------------------------

V4_TILE = sd.tile_of(V4)

V4_VARIANTS = [
    # (h_q, split, has_topk_length, has_attn_sink, has_extra, has_extra_topk_length)
    (64, False, False, False, False, False),
    (64, True, True, True, False, False),
    (128, False, True, True, False, False),
    (128, True, False, False, True, False),
    (64, False, False, True, True, True),
    (128, True, True, True, True, True),
]


def _v4_id(v):
    h_q, split, tl, sink, extra, etl = v
    return (f"h{h_q}-{'split' if split else 'nosplit'}-tl{int(tl)}-sink{int(sink)}"
            f"-extra{int(extra)}{'-etl' if etl else ''}")


def _v4_cfg(variant):
    h_q, split, tl, sink, extra, etl = variant
    return Sm100SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=tl, has_attn_sink=sink, format="V4",
                                   has_extra=extra, has_extra_topk_length=etl)


def _compile_v4(variant, tmp_path_factory):
    return _compile_cfg(("v4",) + variant, _v4_cfg(variant), "sm100_v4_" + _v4_id(variant).replace("-", "_"),
                        tmp_path_factory)


def test_v4_tile_geometry_from_the_format():
    """What differs between the formats is read from their specs (V3.2 values unchanged)."""
    t = V4_TILE
    assert (t.d_qk, t.d_v, t.d_nope, t.d_rope) == (512, 512, 448, 64)
    assert t.tma_row_bytes == V4.data_row_bytes == 576 and TILE.tma_row_bytes == V32.row_bytes
    assert t.raw_row_bytes == 448 and TILE.raw_row_bytes == 544     # NoPE only / NoPE + scales (+ 16 pad)
    assert t.rope_in_k and t.scales_in_index and not TILE.rope_in_k and not TILE.scales_in_index
    assert (t.nope_chunks, t.k_dims, t.qk_rope_steps) == (7, 512, 0) and (TILE.nope_chunks, TILE.qk_rope_steps) == (8, 4)
    # gather4 boxes of 4 rows land on whole 128-B lines; box rows fit the TMA's 256-element limit
    for tile in (t, TILE):
        assert (4 * tile.raw_row_bytes) % 128 == 0 and tile.raw_row_words <= 256
        assert tile.k_stage_elems == TILE.k_stage_elems and tile.half_v == TILE.half_v   # V = the K tile
    assert t.rope_offset == 448 and t.rope_offset % 16 == 0 and t.q_elems == 64 * 512
    assert sd.tile_of(V4) is t and Sm100SparseDecodeConfig(h_q=64, split=False, has_topk_length=False,
                                                            has_attn_sink=False, format="V4").tile is t
    import dataclasses
    with pytest.raises(ValueError, match="SM100 tile"):
        sd.tile_of(dataclasses.replace(V4, name="narrow rope", d_rope=32))


def test_v4_token_addresses_match_the_quantizer():
    """The addresses the kernel uses (the gather4 tables of 576-B data rows and the INDEX warp's
    scale-row address) read, on a quantized cache with padded page blocks, the bytes the format's
    quantizer wrote for each token: fp8 NoPE, bf16 RoPE, ue8m0 scales."""
    import torch

    from cute_mla.formats import quantize_v4

    g = torch.Generator().manual_seed(0)
    nb, page = 3, 5
    stride0 = V4.block_stride(page) + 2 * V4.data_row_bytes        # padded: still whole 576-B rows
    kv = (torch.randn(nb, page, 512, generator=g) / 10).clamp(-1, 1)
    cache = quantize_v4(kv, stride0=stride0)
    assert cache.stride(0) % V4_TILE.tma_row_bytes == 0
    flat = torch.as_strided(cache, (nb * stride0,), (1,))
    rows_per_block = stride0 // V4_TILE.tma_row_bytes
    for tok in range(nb * page):
        blk, row = tok // page, tok % page
        coord = blk * rows_per_block + row                         # the INDEX warp's coordinate
        data = flat[coord * V4_TILE.tma_row_bytes:(coord + 1) * V4_TILE.tma_row_bytes]
        scale_at = sd.scale_row_byte(V4_TILE, blk, row, page, stride0)    # the INDEX warp's address
        scales = flat[scale_at:scale_at + 4 * V4_TILE.scale_words]
        nope = data[:V4_TILE.raw_row_bytes].view(torch.float8_e4m3fn).float().view(7, 64)
        s = torch.pow(2.0, scales[:7].float() - 127.0)
        rope = data[V4_TILE.rope_offset:V4_TILE.rope_offset + 128].view(torch.bfloat16).float()
        want = V4.dequantize_cache(cache)[blk, row]
        assert torch.equal((nope * s[:, None]).flatten(), want[:448]), tok
        assert torch.equal(rope, want[448:]), tok


@pytest.mark.parametrize("variant", V4_VARIANTS, ids=_v4_id)
def test_v4_compiles_with_blackwell_ptx(variant, tmp_path_factory):
    cfg, compiled, ptx, d = _compile_v4(variant, tmp_path_factory)
    assert isinstance(compiled, CompiledKernel)
    c = _counts(ptx)
    print(f"\n{cfg}: smem {smem_bytes(cfg)} B, {tensor_map_params(ptx)} tensor maps\n  "
          + ", ".join(f"{k} {v}" for k, v in c.items()))
    assert ".target sm_100a" in ptx and ptx.count(".entry") == 1 and f".reqntid {sd.WARPS.threads}, 1, 1" in ptx
    # QK: 32 k-steps over the K tile alone (448 NoPE + 64 RoPE dims: no RoPE-tile steps); PV as V3.2.
    assert c["tcgen05.mma"] == V4_TILE.d_qk // 16 + 2 * 2 * (V4_TILE.tokens // 16) == 40
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx
    assert c["tcgen05.alloc"] == 1 and c["tcgen05.dealloc"] == 1 and c["tcgen05.relinquish_alloc_permit"] == 1
    assert "tcgen05.ld.sync.aligned.32x32b.x32" in ptx and "tcgen05.st.sync.aligned.32x32b.x32" in ptx
    # gather4: NoPE and RoPE streams, 8 instructions per 32-token tile each; the extra pool has its own pair.
    assert c["tile::gather4"] == 2 * (V4_TILE.tokens // 4) * (2 if cfg.has_extra else 1)
    assert "cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4.mbarrier::complete_tx::bytes" in ptx
    # The scale rows: one 8-byte load per token (the INDEX warp), none in the V3.2 kernel (scales in the row).
    assert ptx.count("ld.global.v2.b32") == 1
    # 7 NoPE column blocks of 64 dims per token: 4 + 3 warps x 2 blocks x 4 steps x 4 e4m3x4 words x 2 pairs
    assert c["cvt.rn.f16x2.e4m3x2"] == 2 * 32 and ptx.count("mul.rn.f32") >= 2 * c["cvt.rn.f16x2.e4m3x2"]
    assert ptx.count("cvt.rn.bf16x2.f32") >= c["cvt.rn.f16x2.e4m3x2"]
    for kind, n in (("inc", sd.REGS.softmax), ("inc", sd.REGS.dequant), ("dec", sd.REGS.producers)):
        assert re.search(rf"setmaxnreg.{kind}.sync.aligned.u32\s+{n};", ptx)
    assert c["elect.sync"] >= c["cp.async.bulk.tensor"] // 8


def test_v4_scale_row_loads_are_v4_only(tmp_path_factory):
    _, _, p32, _ = _compile((64, False, False, False), tmp_path_factory)
    _, _, p4, _ = _compile_v4(V4_VARIANTS[0], tmp_path_factory)
    assert "ld.global.v2.b32" not in p32 and "ld.global.v2.b32" in p4
    # the 576-B data rows give the V4 NoPE box 112 int32 words a row, V3.2's 136; Q is 8 boxes, not 9
    assert _counts(p32)["tcgen05.mma"] - _counts(p4)["tcgen05.mma"] == (576 - 512) // 16


@pytest.mark.parametrize("variant", V4_VARIANTS, ids=_v4_id)
def test_v4_tensor_maps_as_the_plan_says(variant, tmp_path_factory):
    """q, kv_nope, kv_rope, out (+ o_accum split) as the plan lists them; the extra pool adds its own
    two gather4 maps (extra_nope, extra_rope in the arch table)."""
    from cute_mla import plan_sparse_decode

    cfg, _, ptx, _ = _compile_v4(variant, tmp_path_factory)
    topk = 2048 if cfg.split else 128        # SM100: split above 640 positions (both lists)
    extra_topk = 512 if cfg.has_extra else 0
    plan = plan_sparse_decode(4, 1, cfg.h_q, 512, topk, arch="sm_100a", num_sms=148, extra_topk=extra_topk,
                              has_extra_topk_length=cfg.has_extra_topk_length)
    assert plan.split == cfg.split and plan.kernel == "sm100_sparse_decode"
    assert tensor_map_params(ptx) == len(plan.tensor_maps)
    assert ("extra_nope" in plan.tensor_maps) == cfg.has_extra
    stores = ptx.count("cp.async.bulk.tensor.2d.global.shared::cta") + ptx.count("cp.async.bulk.tensor.4d.global.shared::cta")
    assert stores == (32 if cfg.split else 16)


def test_v4_budgets():
    for variant in V4_VARIANTS:
        cfg = _v4_cfg(variant)
        t = cfg.tile
        smem = smem_bytes(cfg)
        assert smem == sd._shared_storage(t).size_in_bytes() <= SMEM_LIMIT == 227 * 1024
        scale_ring = STAGES.index * t.tokens * 4 * t.scale_words
        big = (t.q_elems * 2 + STAGES.kbuf * t.k_stage_elems * 2 + STAGES.gather * t.rope_stage_elems * 2
               + t.p_elems * 2 + t.epi_stage_bytes + STAGES.gather * t.raw_stage_bytes + scale_ring)
        assert big < smem < big + 4096
        # smaller than V3.2's: 64 KiB of Q instead of 72, 448-B raw rows instead of 544
        assert smem_bytes(None) - smem == (TILE.q_elems - t.q_elems) * 2 + STAGES.gather * (
            TILE.raw_stage_bytes - t.raw_stage_bytes) - scale_ring
        assert tmem_columns(cfg) == tmem_columns(None) == 512
    print(f"\nV4 shared memory {smem_bytes(_v4_cfg(V4_VARIANTS[0]))} B of {SMEM_LIMIT} (V3.2 {smem_bytes(None)} B)")


@pytest.mark.parametrize("variant", [V4_VARIANTS[0], V4_VARIANTS[-1]], ids=_v4_id)
def test_v4_cubin_resources(variant, tmp_path_factory):
    cfg, _, _, d = _compile_v4(variant, tmp_path_factory)
    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    usage = resource_usage(glob.glob(os.path.join(d, "*.cubin"))[0])
    print(f"\n{cfg}: {usage}")
    assert usage["SHARED"] <= 1024 and smem_bytes(cfg) + usage["SHARED"] <= 228 * 1024
    assert usage["REG"] <= sd.REGS.entry
    # no-split: no stack at all; the split variants spill a few softmax addresses (as V3.2's dequant's)
    assert usage["STACK"] <= (64 if cfg.split else 0)


_V4_LAYOUT_FACTS = {}


@cute.jit
def _trace_v4_layouts():
    t = V4_TILE
    qk, pv = cta.tiled_mmas()
    L = sd.smem_layouts(qk, pv, t)
    k = L["k"].outer
    _V4_LAYOUT_FACTS["k"] = [(tok, d, cute.crd2idx(((tok, d % 16), 0, ((d // 16) % 4, d // 64), 0), k))
                             for tok in range(t.tokens) for d in range(0, t.k_dims, 8)]
    v = L["v_outer"]
    _V4_LAYOUT_FACTS["v"] = [(h, d, tok, cute.crd2idx((((d % 64, d // 64), tok % 16), 0, tok // 16, h, 0), v))
                             for h in range(2) for d in range(0, t.half_v, 8) for tok in range(t.tokens)]
    _V4_LAYOUT_FACTS["rope_tma"] = [(tok, d, cute.crd2idx((tok, d), L["rope_tma"].outer))
                                    for tok in range(t.tokens) for d in range(0, t.d_rope, 8)]
    _V4_LAYOUT_FACTS["q_size"] = cute.cosize(L["q"].outer)
    _V4_LAYOUT_FACTS["swizzles"] = {n: str(L[n].inner) for n in ("q", "k", "rope_tma")}


@pytest.fixture(scope="module")
def v4_facts():
    return _traced_once(_V4_LAYOUT_FACTS, _trace_v4_layouts)


def test_v4_k_tile_and_v_view(v4_facts):
    """The V4 K tile (448 NoPE + 64 RoPE dims) is the same SW128 K-major operand as V3.2's, so the
    dequant writes (k_tile_byte) and the V view (PV reads all 512 dims, RoPE included) hold."""
    assert v4_facts["swizzles"] == {"q": "S<3,4,3>", "k": "S<3,4,3>", "rope_tma": "S<3,4,3>"}
    bad = [(t, d) for t, d, e in v4_facts["k"] if cta.swizzle_bytes(2 * e, 3) != cta.k_tile_byte(t, d)]
    assert not bad, bad[:5]
    k = {(t, d): e for t, d, e in v4_facts["k"]}
    bad = [(h, d, t) for h, d, t, e in v4_facts["v"] if e != k[(t, V4_TILE.half_v * h + d)]]
    assert not bad, bad[:5]
    assert v4_facts["q_size"] == V4_TILE.q_elems


def test_v4_rope_copy_lands_in_the_last_k_block(v4_facts):
    """The dequant warp copies the gathered RoPE tile row by row (128 B, unchanged) into the K
    tile's column block ``nope_chunks``: RoPE[t, d] must then be K[t, 448 + d], i.e. the RoPE TMA
    tile's byte of (t, d) plus the block offset is the K tile's byte of (t, 448 + d)."""
    assert sd.rope_row_byte(V4_TILE, 0) == 7 * 4096 and sd.rope_row_byte(V4_TILE, 0) % 1024 == 0
    # the copy moves row t's bytes [128 t, 128 t + 128) to rope_row_byte(t) + [0, 128), chunk by chunk
    bad = [(t, d) for t, d, e in v4_facts["rope_tma"]
           if cta.swizzle_bytes(2 * e, 3) - 128 * t + sd.rope_row_byte(V4_TILE, t) != cta.k_tile_byte(t, V4_TILE.d_nope + d)]
    assert not bad, bad[:5]
    assert all(128 * t <= cta.swizzle_bytes(2 * e, 3) < 128 * (t + 1) for t, _, e in v4_facts["rope_tma"])


def test_v4_launcher_rejects_what_the_kernel_cannot_take():
    import torch

    from cute_mla.formats import quantize_v4
    from cute_mla.kernels import SparseDecodeTensors
    from cute_mla.kernels.sm100.sparse_decode import launch as launch_sparse_decode

    b, s_q, topk = 2, 1, 128
    calls = []
    dummy = CompiledKernel(key="dummy", fn=lambda *a: calls.append(a))
    kv = quantize_v4(torch.zeros(4, 3, 512)).squeeze(2)       # stride(0) a multiple of 576
    base = dict(q=torch.zeros(b, s_q, 64, 512, dtype=torch.bfloat16), k_cache=kv, softmax_scale=0.1,
                indices=torch.zeros(b, s_q, topk, dtype=torch.int32), topk_length=None, attn_sink=None,
                tile_md=torch.zeros(b, 8, dtype=torch.int32), accum_offsets=torch.arange(b + 1, dtype=torch.int32),
                out=torch.zeros(b, s_q, 64, 512, dtype=torch.bfloat16), lse=torch.zeros(b, s_q, 64))
    extra = dict(extra_k_cache=quantize_v4(torch.zeros(2, 5, 512)).squeeze(2),
                 extra_indices=torch.zeros(b, s_q, 64, dtype=torch.int32))

    def call(cfg, **kw):
        a = dict(base)
        a.update(kw)
        launch_sparse_decode(dummy, cfg, SparseDecodeTensors(**a))

    plain = _v4_cfg((64, False, False, False, False, False))
    with_extra = _v4_cfg((64, False, False, False, True, False))
    call(plain)
    call(with_extra, **extra)
    # the extra pool's three tensors come after the outputs and the accumulators, before the softmax scale
    assert len(calls) == 2 and calls[0][9:] == (None, None, None, None, None, 0.1)
    assert calls[1][11] is extra["extra_k_cache"] and calls[1][12] is extra["extra_indices"] and calls[1][13] is None
    with pytest.raises(ValueError, match="has_extra"):
        call(plain, **extra)
    with pytest.raises(ValueError, match="has_extra"):
        call(with_extra)
    with pytest.raises(ValueError, match="has_extra_topk_length"):
        call(with_extra, extra_topk_length=torch.zeros(b, dtype=torch.int32), **extra)
    odd = torch.zeros(4 * (3 * 584 + 16), dtype=torch.uint8).as_strided((4, 3, 584), (3 * 584 + 16, 584, 1))
    with pytest.raises(ValueError, match="stride"):
        call(plain, k_cache=odd)                   # stride(0) 1768: not whole 576-B rows for gather4
    short = torch.zeros(4 * 1152 + 2 * 584, dtype=torch.uint8).as_strided((4, 3, 584), (1152, 584, 1))
    with pytest.raises(ValueError, match="page block"):
        call(plain, k_cache=short)                 # 1152 B cannot hold 3 data rows and their scale rows
    with pytest.raises(ValueError, match="stride"):
        call(with_extra, extra_k_cache=odd, extra_indices=extra["extra_indices"])
    with pytest.raises(ValueError, match="extra_indices"):
        call(with_extra, extra_k_cache=extra["extra_k_cache"], extra_indices=torch.zeros(b + 1, s_q, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="extra_topk"):
        call(with_extra, extra_k_cache=extra["extra_k_cache"], extra_indices=torch.zeros(b, s_q, 96, dtype=torch.int32))
    with pytest.raises(ValueError, match="stride"):
        call(with_extra, k_cache=quantize_v4(torch.zeros(4, 3, 512), stride0=3 * 584).squeeze(2), **extra)


def test_v4_compile_is_cached():
    cfg = _v4_cfg(V4_VARIANTS[0])
    assert compile_sparse_decode(cfg) is compile_sparse_decode(cfg)
    assert compile_sparse_decode(cfg) is not compile_sparse_decode(
        Sm100SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False))


# ------------------------------------------------------------------------------------------------
# Robustness: an empty request range is skipped by every role, the last tcgen05.commit arrivals
# are drained, TMEM is deallocated behind a tcgen05 fence pair. Checked on the PTX's control-flow
# graph: each guard is a branch, so "removing it" changes which cycles the graph has.
# ------------------------------------------------------------------------------------------------

_ZERO_ST = re.compile(r"tcgen05\.st\.sync\.aligned\.32x32b\.x32\.b32 \[%r\d+\], \{(%r\d+)(, \1){31}\};")
_Q_LOAD = "cp.async.bulk.tensor.4d.shared::cta.global.tile.mbarrier"   # Q's 9 (V4: 8) boxes
_OUT_STORE = ".global.shared::cta.tile.bulk_group"                        # the epilogue's TMA stores

ALL_VARIANTS = [("v32",) + v for v in VARIANTS] + [("v4",) + v for v in V4_VARIANTS]


def _any_ptx(key, tmp_path_factory):
    return (_compile(key[1:], tmp_path_factory) if key[0] == "v32" else _compile_v4(key[1:], tmp_path_factory))[2]


def _loop_skips(ptx: str, within, avoid, through=None) -> bool:
    """Whether the loop nest holding the blocks that contain ``within`` (a role's request loop) can
    go round without any block that contains ``avoid``, through a block that contains ``through``
    (if given)."""
    blocks, succ = ptx_cfg(ptx)
    everything = set(range(len(blocks)))
    nest = set().union(*[c for c in cycles(succ, everything) if any(has(blocks[v], within) for v in c)])
    assert nest, f"no loop holds {within!r}"
    rest = {v for v in nest if not has(blocks[v], avoid)}
    return any(through is None or any(has(blocks[v], through) for v in c) for c in cycles(succ, rest))


@pytest.mark.parametrize("key", ALL_VARIANTS, ids=lambda k: k[0] + "-" + "-".join(str(int(x)) for x in k[1:]))
def test_every_role_skips_an_empty_request_range(key, tmp_path_factory):
    """An empty range (a schedule that disagrees with the call) is skipped, not waited on. Each role's
    request loop has a way round that does what an empty request needs and nothing else:

    * MMA: no mbarrier wait at all (no Q, no K, no P: FlashMLA's hang was the final PV's P wait);
    * GATHER: no wait and no Q load (the MMA warp will not free it);
    * SOFTMAX: the epilogue without zeroing O (a request with tiles), and O is zeroed by 8 stores of
      one zero register (an empty request: its epilogue must not write the previous request's O).

    Without the guards each of these loops waits (or zeroes) on every round."""
    ptx = _any_ptx(key, tmp_path_factory)
    assert _loop_skips(ptx, "tcgen05.mma", WAIT), "the MMA warp waits in every request (Q / final PV)"
    assert _loop_skips(ptx, _Q_LOAD, WAIT), "the GATHER warp loads Q for every request"
    assert len(_ZERO_ST.findall(ptx)) == TMEM.o_cols // TILE.epi_cols, "the empty request's O is not zeroed"
    assert _loop_skips(ptx, _ZERO_ST, _ZERO_ST, _OUT_STORE), "O is zeroed for every request"
    # the INDEX and DEQUANT warps' tile loops are plain ranges: nothing to skip (no per-request wait)


@pytest.mark.parametrize("key", ALL_VARIANTS, ids=lambda k: k[0] + "-" + "-".join(str(int(x)) for x in k[1:]))
def test_tmem_teardown_fences_and_drained_commits(key, tmp_path_factory):
    """The MMA warp deallocates TMEM after the Bar.TMEM barrier with tcgen05.fence::after_thread_sync,
    the softmax warpgroup arrives there after tcgen05.fence::before_thread_sync; the producers of
    the pipelines whose empty barriers tcgen05.commit arrives on wait for the last arrivals before
    they exit (producer_tail): Q (1 stage), V3.2's RoPE (3) and K (2) stages. Those tail waits are
    the only mbarrier waits outside every loop."""
    ptx = _any_ptx(key, tmp_path_factory)
    check_tmem_teardown(ptx, sd.Bar.TMEM, sd.WARPS.softmax_threads + 32)
    v32 = key[0] == "v32"
    assert waits_outside_loops(ptx) == STAGES.q + (STAGES.gather if v32 else 0) + STAGES.kbuf
