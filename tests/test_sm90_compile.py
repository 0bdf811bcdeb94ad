"""CPU-only: the SM90 sparse decode kernel compiles for sm_90a; PTX and SASS sanity.

No GPU needed: the kernel is compiled against fake tensors and the artifacts are read back with
cuobjdump (from the nvidia-cuda-cuobjdump wheel; the SASS checks skip with a reason without it).
"""

from __future__ import annotations

import pytest

from cute_mla.kernels import inspect as ki
from cute_mla.kernels.sm90.sparse_decode import (
    DEFAULT_TUNING,
    REGS,
    Crossover,
    Sm90SparseDecodeConfig,
    Streaming,
    Tuning,
    compile_sparse_decode,
    launch_sparse_decode,
)

# 36 QK k-steps (SS) + 4 RS PV + 4 SS PV k-steps; with the QK/PV overlap the first QK of a request
# is issued from a prologue, so the QK chain appears twice in the code.
N_WGMMA = 44 + (36 if DEFAULT_TUNING.overlap_qk_pv else 0)
N_CHAINS = 4 if DEFAULT_TUNING.overlap_qk_pv else 3

# (h_q, split, has_topk_length, has_attn_sink): both variants, both optional inputs on and off.
CONFIGS = {
    "nosplit": (64, False, False, False),
    "nosplit_tl_sink": (64, False, True, True),
    "split_tl_sink": (64, True, True, True),
    "split_h128": (128, True, False, True),           # the default: crossover (cluster of 2)
    "split_h128_no_xover": (128, True, False, True),  # Crossover.OFF: each CTA gathers every row
    "split_regs": (64, True, True, True),             # config oacc_from_registers: o_accum from registers
    "nosplit_out_direct": (128, False, False, True),  # out_direct_store=True: bf16 out from registers
    # bf16 partials (the SM90 plan's accum_dtype): staged + TMA, from registers, h=128 crossover
    "split_bf16": (64, True, True, True),
    "split_regs_bf16": (64, True, True, True),
    "split_h128_bf16": (128, True, False, True),
    # Tuning.help_second_tile: WG1 converts a two-tile partition's second tile (off by default)
    "split_help_second": (64, True, True, True),
    # Tuning.pdl_wait: launched with PDL, griddepcontrol.wait before any global access (off by default)
    "split_pdl": (64, True, True, True),
    # Tuning.chunked_epilogue=False: bf16 blocks staged by 4-B st.shared, one TMA store per warp group
    "split_bf16_unchunked": (64, True, True, True),
    "nosplit_unchunked": (64, False, True, True),
}
TUNINGS = {"split_h128_no_xover": dict(crossover=Crossover.OFF), "nosplit_out_direct": dict(out_direct_store=True),
           "split_help_second": dict(help_second_tile=True), "split_pdl": dict(pdl_wait=True),
           "split_bf16_unchunked": dict(chunked_epilogue=False), "nosplit_unchunked": dict(chunked_epilogue=False)}
CONFIG_EXTRA = {"split_regs": dict(oacc_from_registers=True), "split_bf16": dict(accum_dtype="bfloat16"),
                "split_regs_bf16": dict(oacc_from_registers=True, accum_dtype="bfloat16"),
                "split_h128_bf16": dict(accum_dtype="bfloat16"), "split_pdl": dict(accum_dtype="bfloat16"),
                "split_bf16_unchunked": dict(accum_dtype="bfloat16")}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Compile every config once; {name: (ptx text, cubin path)}."""
    out = {}
    for name, (h_q, split, tl, sink) in CONFIGS.items():
        d = str(tmp_path_factory.mktemp(name))
        cfg = Sm90SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=tl, has_attn_sink=sink,
                                     **CONFIG_EXTRA.get(name, {}))
        compile_sparse_decode(cfg, dump_dir=d, tuning=Tuning(**TUNINGS.get(name, {})))
        ptx, cubin = ki.find_artifacts(d, "sm_90a")
        assert ptx and cubin, f"{name}: no PTX/cubin in {d}"
        with open(ptx) as f:
            out[name] = (f.read(), cubin)
    return out


def _sass_or_skip(cubin):
    if ki.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not importable: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    return ki.sass(cubin)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ptx_has_wgmma_tma_and_register_split(artifacts, name):
    ptx, _ = artifacts[name]
    assert ".target sm_90a" in ptx
    assert ptx.count(".entry") == 1
    assert ".reqntid 384, 1, 1" in ptx, "3 warp groups"
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx, "Q load (and output stores) by TMA"
    assert ptx.count("wgmma.mma_async") == N_WGMMA
    regs = ki.setmaxnreg(ptx)
    assert sorted(regs["inc"]) == [REGS.softmax]
    assert sorted(regs["dec"]) == sorted([REGS.pv_right, REGS.producer])
    assert REGS.softmax + REGS.pv_right + REGS.producer <= 504, "setmaxnreg targets must fit 3 x 168"
    l2 = {"": "", "size_256b": ".L2::256B", "size_128b": ".L2::128B", "size_64b": ".L2::64B"}[DEFAULT_TUNING.gather_l2]
    assert f"ld.global.L1::{DEFAULT_TUNING.gather_l1}{l2}.v4" in ptx, "128-bit gather loads with cache hints"
    assert "griddepcontrol.launch_dependents" in ptx, "PDL trigger for the combine"
    if DEFAULT_TUNING.compact_indices:
        assert "popc.b32" in ptx and "%lanemask_lt" in ptx, "index compaction: ballot prefix counts"
    assert "mul.rn.bf16x2" in ptx, "FP8 -> bf16 bit trick (power-of-two scales)"
    assert "cvt.rn.f16x2.e4m3x2" in ptx, "exact fp32 dequant path (any other scale)"
    pf = "prefetch.global.L2 [" if DEFAULT_TUNING.prefetch_lines else "cp.async.bulk.prefetch.L2.global"
    assert (pf in ptx) == DEFAULT_TUNING.prefetch_rows, "L2 row prefetch (Tuning knobs)"


def test_accumulator_tensor_map_only_in_split_variant(artifacts):
    maps = {name: ki.tensor_map_params(ptx) for name, (ptx, _) in artifacts.items()}
    # no-split: Q load + out store; split: + an o_accum store map, unless o_accum is stored from
    # registers (config oacc_from_registers, which the plan picks per shape)
    assert DEFAULT_TUNING.oacc_direct_store is None, "the config (the plan) decides"
    assert maps["nosplit"] == 2, maps
    assert maps["nosplit_tl_sink"] == 2, maps
    assert maps["split_tl_sink"] == maps["nosplit_tl_sink"] + 1, maps
    assert maps["split_regs"] == maps["nosplit_tl_sink"], maps
    assert maps["nosplit_out_direct"] == 1, maps  # Q only: out from registers
    assert maps["split_h128"] == maps["split_h128_no_xover"] == 3, maps
    # bf16 partials keep the same maps (o_accum's is a 64 x 256 bf16 box instead of 64 x 128 fp32)
    assert (maps["split_bf16"], maps["split_regs_bf16"], maps["split_h128_bf16"]) == \
        (maps["split_tl_sink"], maps["split_regs"], maps["split_h128"]), maps
    # ... and the plan lists exactly the tensor maps of the variant the dispatcher compiles for it
    from cute_mla import plan_sparse_decode
    no_split = plan_sparse_decode(1, 8192, 64, 576, 2048, arch="sm_90a", num_sms=132)
    split_tma = plan_sparse_decode(1, 8, 64, 576, 2048, arch="sm_90a", num_sms=132)
    few = plan_sparse_decode(2, 1, 64, 576, 2048, arch="sm_90a", num_sms=132)   # 64 busy CTAs: no column pair
    assert (no_split.split, split_tma.split, few.split) == (False, True, True)
    # bf16 partials are stored by TMA even where few CTAs store (fp32 ones came from registers there)
    assert (split_tma.accum_dtype, few.accum_dtype) == ("bfloat16", "bfloat16")
    assert (split_tma.oacc_from_registers, few.oacc_from_registers) == (False, False)
    assert len(no_split.tensor_maps) == maps["nosplit"]
    assert len(split_tma.tensor_maps) == len(few.tensor_maps) == maps["split_bf16"]


# The streamed producer over compacted tiles (the default) keeps two 44-register row sets, the next
# rows' addresses and the index-scan state in its 128 registers. With the bulk row prefetch (a loop
# over the warp's rows in uniform registers) ptxas spilled 40 B; with per-thread line prefetches
# and two index chunks in flight (the defaults) it spills nothing. Any spill fails here.
SPILL_BUDGET = (0, 0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_spills_no_stack(artifacts, name):
    _, cubin = artifacts[name]
    if ki.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not importable: pip install nvidia-cuda-cuobjdump")
    res = ki.resource_usage(cubin)
    print(name, res)
    stack_max, ops_max = SPILL_BUDGET
    assert res["STACK"] <= stack_max, res
    assert res["LOCAL"] == 0, res
    assert ki.local_memory_ops(_sass_or_skip(cubin)) <= ops_max


@pytest.mark.parametrize("name", list(CONFIGS))
def test_wgmma_chains_are_asynchronous(artifacts, name):
    """ptxas serializes wgmma under register pressure (gsb0 + DEPBAR after every HGMMA, 1.8x
    slower). Clean: only the last HGMMA of each chain (QK, RS PV, SS PV, + prologue QK) carries gsb0."""
    _, cubin = artifacts[name]
    st = ki.hgmma_stats(_sass_or_skip(cubin))
    print(name, st)
    assert st.total == N_WGMMA, st
    assert not st.serialized, st
    assert st.with_gsb0 <= N_CHAINS, st


def test_config_validation():
    with pytest.raises(ValueError):
        Sm90SparseDecodeConfig(h_q=96, split=False, has_topk_length=False, has_attn_sink=False)
    with pytest.raises(ValueError):
        Sm90SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False, arch="sm_100a")
    with pytest.raises(ValueError):
        Sm90SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False, d_qk=512)
    with pytest.raises(ValueError, match="oacc_from_registers"):
        Sm90SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False, oacc_from_registers=True)


def test_launcher_passes_none_for_absent_optionals():
    seen = {}

    class Fake:
        def fn(self, *args):
            seen["args"] = args

    cfg = Sm90SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False)
    launch_sparse_decode(Fake(), cfg, "q", "kv", "idx", "tl", "sink", "md", "ns", "out", "lse", "oa", "la", 0.5)
    assert seen["args"] == ("q", "kv", "idx", None, None, "md", "ns", "out", "lse", None, None, None, 0.5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_row_prefetch_is_per_thread(artifacts, name):
    """The L2 row prefetch of tile T+2 is a per-thread ``prefetch.global.L2`` (SASS CCTL.E.PF2), not
    the bulk prefetch, whose uniform-register operands make ptxas loop over the warp's 16 rows
    (``BRA.U.ANY``; ncu put that loop at ~13 % of the producer's time)."""
    if not DEFAULT_TUNING.prefetch_rows or not DEFAULT_TUNING.prefetch_lines:
        pytest.skip("default tuning does not use per-thread line prefetches")
    ptx, cubin = artifacts[name]
    assert "prefetch.global.L2 [" in ptx
    assert "cp.async.bulk.prefetch.L2" not in ptx
    sass = _sass_or_skip(cubin)
    assert "CCTL.E.PF2" in sass
    assert "UBLKPF" not in sass
    # A uniform-operand loop is allowed only around the h=128 crossover's per-warp bulk copies (one
    # lane's addresses: ptxas wraps each copy in a one-trip BRA.U.ANY loop), never for a prefetch.
    assert sass.count("BRA.U.ANY") <= sass.count("UBLKCP")
    crossover = CONFIGS[name][0] == 128 and TUNINGS.get(name, {}).get("crossover", DEFAULT_TUNING.crossover) != Crossover.OFF
    if not crossover:   # the kernels without the crossover: none at all
        assert "BRA.U.ANY" not in sass


@pytest.mark.parametrize("name", list(CONFIGS))
def test_partition_metadata_is_one_vector_load(artifacts, name):
    """``Tuning.early_metadata``: a CTA reads its tile_md words 0-3 in one 16-B load (SASS
    ``LDG.E.128``), not in two dependent 8-B loads (``LDG.E.64``, the second behind the
    empty-partition branch); split kernels read words 4-7 (the split flags and offset) the same
    way, once per MMA warp group, before the first tile."""
    if not DEFAULT_TUNING.early_metadata:
        pytest.skip("default tuning loads the partition metadata where it is used")
    sass = _sass_or_skip(artifacts[name][1])
    plain = [ln for ln in sass.splitlines() if "LDG.E" in ln and ".EL" not in ln]
    assert not any("LDG.E.64 " in ln for ln in plain), "tile_md read in 8-B pieces"
    assert any("LDG.E.128 " in ln and "+0x10]" not in ln for ln in plain), "no 16-B load of tile_md words 0-3"
    if CONFIGS[name][1]:   # split
        assert sum("LDG.E.128 " in ln and "+0x10]" in ln for ln in plain) >= 2, "words 4-7 not read once per MMA warp group"


@pytest.mark.parametrize("transport", ["HALF_COPY", "WARP_COPIES", "WARP_COPIES_TWO_TILES"])
def test_crossover_variant_compiles(tmp_path, transport):
    """Tuning.crossover (h=128, cluster of 2): the half tiles travel to the peer by bulk smem -> dsmem
    copies with complete_tx on the peer's k_full, cluster addresses from mapa, the producers
    relay buffer releases through release/acquire.cluster mbarriers and the pair meets at cluster
    barriers; wgmma stays asynchronous. HALF_COPY and WARP_COPIES spill nothing."""
    from cute_mla.kernels.sm90.sparse_decode import Crossover, Tuning

    cfg = Sm90SparseDecodeConfig(h_q=128, split=True, has_topk_length=True, has_attn_sink=True)
    compile_sparse_decode(cfg, tuning=Tuning(crossover=Crossover[transport]), dump_dir=str(tmp_path))
    ptx_path, cubin = ki.find_artifacts(str(tmp_path), "sm_90a")
    ptx = open(ptx_path).read()
    assert "mapa.shared::cluster" in ptx
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert "mbarrier.arrive.release.cluster.shared::cluster" in ptx, "peer_free relay"
    assert "mbarrier.try_wait.parity.acquire.cluster" in ptx, "peer_free wait"
    assert "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes" in ptx
    assert "st.async" not in ptx
    if ki.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not importable")
    res = ki.resource_usage(cubin)
    sass = ki.sass(cubin)
    st = ki.hgmma_stats(sass)
    assert not st.serialized, st
    _check_cluster_start(ptx, sass)
    if transport != "WARP_COPIES_TWO_TILES":
        assert res["STACK"] == 0 and res["LOCAL"] == 0, res


def test_crossover_tuning_validation():
    from cute_mla.kernels.sm90.sparse_decode import Crossover, Tuning

    with pytest.raises(ValueError, match="crossover"):
        Tuning(crossover=Crossover.WARP_COPIES, compact_indices=False, streaming=Streaming.OFF)
    with pytest.raises(ValueError, match="crossover"):
        Tuning(crossover=Crossover.WARP_COPIES, streaming=Streaming.OFF)
    with pytest.raises(ValueError, match="Crossover"):
        Tuning(crossover=True)


def test_timeline_probe_is_debug_only(artifacts, tmp_path):
    """``Tuning.timeline`` (benchmarks/timeline_probe.py) reads the SM clock once per Stamp slot;
    the default kernels read it nowhere."""
    from cute_mla.kernels.sm90.sparse_decode_common import Stamp

    for name, (ptx, _) in artifacts.items():
        assert "%clock64" not in ptx, f"{name}: a default kernel reads the clock"
    cfg = Sm90SparseDecodeConfig(h_q=64, split=True, has_topk_length=False, has_attn_sink=False, oacc_from_registers=True)
    compile_sparse_decode(cfg, dump_dir=str(tmp_path), tuning=Tuning(timeline=True))
    ptx, _ = ki.find_artifacts(str(tmp_path), "sm_90a")
    with open(ptx) as f:
        text = f.read()
    assert text.count("%clock64") == len([s for s in Stamp if s != Stamp.SLOTS])


def _check_cluster_start(ptx: str, sass: str):
    """A cluster kernel's start (``Tuning.relaxed_cluster_start``): the cluster barrier after the
    mbarrier inits arrives relaxed (no MEMBAR before it: the default arrive's release compiles to
    MEMBAR.ALL.GPU, which would wait for the tile_md load), and the partition's tile_md words are
    loaded before it, so their round trip overlaps the barrier."""
    assert "barrier.cluster.arrive.relaxed" in ptx
    lines = sass.splitlines()
    first_arrive = next(i for i, ln in enumerate(lines) if "UCGABAR_ARV" in ln)
    assert not any("MEMBAR" in ln for ln in lines[:first_arrive]), "a memory barrier before the start-up cluster arrive"
    assert any("LDG.E.128 " in ln for ln in lines[:first_arrive]), "tile_md not loaded before the cluster barrier"


def test_column_pair_variant_compiles(tmp_path):
    """The column pair (h=64 split; the plan picks it through the config's ``column_pair``, or
    ``Tuning.column_pair`` forces it): PV in 64x128 N-tiles (each CTA of the pair computes 256 of
    the 512 columns), the gather shared through the crossover's bulk copies to the peer, out stored
    from registers, the plan's bf16 partials staged and stored by TMA in 64 x 128 boxes (Q and
    o_accum the tensor maps, as the plan lists), no spills, the relaxed cluster start. A kernel
    without the split, or with h=128, ignores it."""
    from cute_mla import plan_sparse_decode
    from cute_mla.kernels.sm90.sparse_decode import Sm90SparseDecodeKernel

    plan = plan_sparse_decode(1, 1, 64, 576, 2048, arch="sm_90a", num_sms=132)
    assert plan.column_pair and not plan.oacc_from_registers and plan.accum_dtype == "bfloat16"
    cfg = Sm90SparseDecodeConfig(h_q=64, split=True, has_topk_length=True, has_attn_sink=True,
                                 oacc_from_registers=plan.oacc_from_registers, column_pair=True,
                                 accum_dtype=plan.accum_dtype)
    assert Sm90SparseDecodeKernel(cfg).cpair
    compile_sparse_decode(cfg, dump_dir=str(tmp_path))
    ptx, cubin = ki.find_artifacts(str(tmp_path), "sm_90a")
    with open(ptx) as f:
        text = f.read()
    assert "cp.async.bulk.shared::cluster.shared::cta" in text
    assert ki.tensor_map_params(text) == len(plan.tensor_maps) == 2   # Q and o_accum: out from registers
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in text, "the bf16 partials' TMA store"
    sass = _sass_or_skip(cubin)
    assert "HGMMA.64x128x16" in sass and "HGMMA.64x256x16" not in sass
    assert ki.local_memory_ops(sass) == 0
    _check_cluster_start(text, sass)
    # the Tuning's force, and where the pair does not apply
    assert Sm90SparseDecodeKernel(cfg.__class__(h_q=64, split=True, has_topk_length=False, has_attn_sink=False),
                                  Tuning(column_pair=True)).cpair
    assert not Sm90SparseDecodeKernel(Sm90SparseDecodeConfig(h_q=64, split=False, has_topk_length=False, has_attn_sink=False), Tuning(column_pair=True)).cpair
    assert not Sm90SparseDecodeKernel(Sm90SparseDecodeConfig(h_q=128, split=True, has_topk_length=False, has_attn_sink=False), Tuning(column_pair=True)).cpair
    # an experiment's Tuning without the crossover runs the plan's pair shapes as plain pieces
    assert not Sm90SparseDecodeKernel(cfg, Tuning(crossover=Crossover.OFF)).cpair
    with pytest.raises(ValueError, match="column_pair"):
        Tuning(column_pair=True, crossover=Crossover.OFF)
    for bad in (dict(h_q=128, split=True), dict(h_q=64, split=False)):
        with pytest.raises(ValueError, match="column_pair"):
            Sm90SparseDecodeConfig(has_topk_length=False, has_attn_sink=False, column_pair=True, **bad)


def test_bf16_partials_are_stored_as_bf16(artifacts):
    """fp32 o_accum from registers: 8-byte stores of two fp32 (the quad's 32 contiguous bytes);
    bf16: 4-byte stores of two bf16 and no 8-byte ones. Staged: the fp32 path stores each 64 x 256
    half in two 64 x 128 TMA passes, the bf16 path in one 64 x 256 box, as out."""
    regs32, regs16 = artifacts["split_regs"][0], artifacts["split_regs_bf16"][0]
    assert regs32.count("st.global.v2.b32") == 128 and "st.global.v2.b32" not in regs16
    assert regs16.count("st.global.b32") >= 128
    tma = "cp.async.bulk.tensor.4d.global.shared::cta"
    staged32, staged16 = artifacts["split_tl_sink"][0], artifacts["split_bf16"][0]
    # TMA store sites: out (one per MMA warp group) + o_accum (two passes per warp group in fp32)
    assert staged32.count(tma) - staged16.count(tma) == staged16.count(tma) - artifacts["nosplit_tl_sink"][0].count(tma)


def test_help_second_tile_handshake(artifacts):
    """Tuning.help_second_tile: the producer arrives on Bar.HELP (256 threads) once, WG1 syncs on it
    once, and WG1 issues its own 2 x 11 row loads; the default kernel has neither."""
    from cute_mla.kernels.sm90.sparse_decode_common import Bar

    help_ptx, plain = artifacts["split_help_second"][0], artifacts["split_tl_sink"][0]
    arrive, sync = f"bar.arrive {int(Bar.HELP)}, 256", f"bar.sync \t{int(Bar.HELP)}, 256"
    assert help_ptx.count(arrive) == 1 and help_ptx.count(sync) == 1
    assert arrive not in plain and sync not in plain
    load = "ld.global.L1::evict_last"
    assert help_ptx.count(load) - plain.count(load) == 22


def test_pdl_wait_precedes_global_access(artifacts):
    """Tuning.pdl_wait: one griddepcontrol.wait, before the kernel's first global load, store or
    TMA copy (the partition metadata's load included); the default kernel waits on nothing."""
    pdl, plain = artifacts["split_pdl"][0], artifacts["split_bf16"][0]
    assert pdl.count("griddepcontrol.wait") == 1 and "griddepcontrol.wait" not in plain
    body = pdl[pdl.index(".entry"):]
    wait = body.index("griddepcontrol.wait")
    first = min(i for i in (body.find(op) for op in ("ld.global", "st.global", "cp.async.bulk", "red.global",
                                                      "atom.global", "prefetch.global")) if i >= 0)
    assert wait < first


def test_chunked_epilogue_stmatrix(artifacts):
    """Tuning.chunked_epilogue (default): each MMA warp group stages a bf16 block with 16
    stmatrix.x4 per thread (4 per 64-column chunk) and stores it in 4 TMA boxes: the split kernel
    has two blocks per warp group (out, o_accum), the no-split kernel one; without the knob no
    stmatrix, and one TMA store instruction sequence per block."""
    stm = "stmatrix.sync.aligned.m8n8.x4.shared.b16"
    store = "cp.async.bulk.tensor.4d.global.shared::cta"
    split, nosplit = artifacts["split_bf16"][0], artifacts["nosplit"][0]
    assert split.count(stm) == 2 * 2 * 16 and nosplit.count(stm) == 2 * 16
    assert split.count(store) == 2 * 2 * 4 and nosplit.count(store) == 2 * 4
    assert stm not in artifacts["split_bf16_unchunked"][0] and stm not in artifacts["nosplit_unchunked"][0]
