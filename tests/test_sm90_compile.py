"""CPU-only: the SM90 sparse decode kernel compiles for sm_90a; PTX and SASS sanity.

No GPU needed: the kernel is compiled against fake tensors and the artifacts are read back with
cuobjdump (from the nvidia-cuda-cuobjdump wheel; the SASS checks skip with a reason without it).
"""

from __future__ import annotations

import re

import pytest

from cute_mla import archs, plan_sparse_decode
from cute_mla.kernels import SparseDecodeTensors
from cute_mla.kernels.sm90 import RegisterBudget, Sm90SparseDecodeConfig, Sm90Tuning, kernel_config
from cute_mla.kernels.sm90.config import NS_SLOTS, Bar, Stamp
from cute_mla.kernels.sm90.prefill_config import Sm90PrefillTuning
from cute_mla.kernels.sm90.sparse_decode import compile as compile_sparse_decode, launch as launch_sparse_decode
from cute_mla.playground import inspect as ki
from _compile_helpers import compile_artifacts

ARCH = archs.SM90.name
REGS = RegisterBudget()   # the 64-head tile's budget (the default its configs resolve to)
N_CHAINS = 4


def n_wgmma(d_qk: int) -> int:
    """d_qk / 16 QK k-steps (SS) + 4 RS PV + 4 SS PV k-steps; the first QK of a request is issued
    from a prologue (later ones behind the previous tile's PV), so the QK chain appears twice."""
    return 2 * (d_qk // 16) + 8


# name: (h_q, split, has_topk_length, has_attn_sink, column_pair, tuning[, format, has_extra, has_extra_topk_length[,
# request_order]])
CONFIGS = {
    "nosplit": (64, False, False, False, False, None),
    "nosplit_tl_sink": (64, False, True, True, False, None),
    "split_tl_sink": (64, True, True, True, False, None),
    "split_h128": (128, True, False, True, False, None),        # a cluster of 2 (the crossover)
    "split_h128_no_cluster": (128, True, False, True, False, Sm90Tuning(h128_cluster=False)),
    "nosplit_h128": (128, False, True, False, False, None),
    "split_pair": (64, True, True, True, True, None),           # the column pair
    # V4 (d_qk 512): the extra pool with and without its lengths, each kernel shape once
    "v4_nosplit": (64, False, False, False, False, None, "V4", False, False),
    "v4_split_extra_tl": (64, True, True, True, False, None, "V4", True, True),
    "v4_split_h128_extra": (128, True, False, True, False, None, "V4", True, False),
    "v4_nosplit_h128_extra_tl": (128, False, True, True, False, None, "V4", True, True),
    "v4_split_pair_extra": (64, True, True, True, True, None, "V4", True, True),
    # the balanced cut's kernel: partitions walk positions of a request order
    "v4_nosplit_h128_extra_tl_order": (128, False, True, True, False, None, "V4", True, True, True),
}
V4_CONFIGS = [n for n in CONFIGS if n.startswith("v4_")]


def _config(name) -> Sm90SparseDecodeConfig:
    h_q, split, tl, sink, pair, tuning, *fmt = CONFIGS[name]
    fmt, extra, extra_tl, *order = fmt or ("V3.2", False, False)
    return kernel_config(h_q=h_q, format=fmt, split=split, has_topk_length=tl, has_attn_sink=sink, column_pair=pair,
                         tuning=tuning, has_extra=extra, has_extra_topk_length=extra_tl, request_order=bool(order))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Compile every config once; {name: (ptx text, cubin path)}."""
    return compile_artifacts(tmp_path_factory, CONFIGS, _config, compile_sparse_decode, ARCH)


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
    assert "cp.async.bulk.tensor" in ptx, "Q load (and output stores) by TMA"
    assert ptx.count("wgmma.mma_async") == n_wgmma(_config(name).d_qk)
    regs = ki.setmaxnreg(ptx)
    assert sorted(regs["inc"]) == [REGS.softmax]
    assert sorted(regs["dec"]) == sorted([REGS.pv_right, REGS.producer])
    assert f"ld.global.L1::{_config(name).tuning.gather_l1}.L2::256B.v4" in ptx, "128-bit gather loads with cache hints"
    assert "griddepcontrol.launch_dependents" in ptx, "PDL trigger for the combine"
    assert "griddepcontrol.wait" not in ptx, "the decode kernel waits for nothing before it"
    assert "popc.b32" in ptx and "%lanemask_lt" in ptx, "index compaction: ballot prefix counts"
    assert "mul.rn.bf16x2" in ptx, "FP8 -> bf16 bit trick (power-of-two scales)"
    assert "cvt.rn.f16x2.e4m3x2" in ptx, "exact fp32 dequant path (any other scale)"
    assert "prefetch.global.L2 [" in ptx, "L2 row prefetch of tile T+2"


def test_tensor_maps_are_what_the_plan_lists(artifacts):
    """No-split: Q load + out store; split: + the o_accum store; the column pair stores out from
    registers (no out map). The plan lists exactly the maps of the variant the launcher compiles."""
    maps = {name: ki.tensor_map_params(ptx) for name, (ptx, _) in artifacts.items()}
    assert maps["nosplit"] == maps["nosplit_tl_sink"] == maps["nosplit_h128"] == 2, maps
    assert maps["split_tl_sink"] == maps["split_h128"] == maps["split_h128_no_cluster"] == 3, maps
    assert maps["split_pair"] == 2, maps
    no_split = plan_sparse_decode(1, 8192, 64, 576, 2048, arch=ARCH, num_sms=132)
    split = plan_sparse_decode(1, 8, 64, 576, 2048, arch=ARCH, num_sms=132)
    pair = plan_sparse_decode(1, 1, 64, 576, 2048, arch=ARCH, num_sms=132)
    assert (no_split.split, split.split, split.column_pair, pair.column_pair) == (False, True, False, True)
    assert len(no_split.tensor_maps) == maps["nosplit"]
    assert len(split.tensor_maps) == maps["split_tl_sink"]
    assert pair.tensor_maps == ("q", "o_accum") and len(pair.tensor_maps) == maps["split_pair"]
    # V4 and its extra pool read the caches by address: the same maps as V3.2
    assert maps["v4_nosplit"] == maps["v4_nosplit_h128_extra_tl"] == 2, maps
    assert maps["v4_split_extra_tl"] == maps["v4_split_h128_extra"] == 3 and maps["v4_split_pair_extra"] == 2, maps
    v4 = plan_sparse_decode(1, 1, 128, 512, 128, arch=ARCH, num_sms=132, extra_topk=512, has_extra_topk_length=True)
    assert v4.split and len(v4.tensor_maps) == maps["v4_split_h128_extra"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_spills_no_stack(artifacts, name):
    """The streamed producer keeps two 44-register row sets, the next rows' addresses and the
    index-scan state in its 128 registers; any spill fails here."""
    _, cubin = artifacts[name]
    if ki.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not importable: pip install nvidia-cuda-cuobjdump")
    res = ki.resource_usage(cubin)
    print(name, res)
    assert res["STACK"] == 0 and res["LOCAL"] == 0, res
    assert ki.local_memory_ops(_sass_or_skip(cubin)) == 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_wgmma_chains_are_asynchronous(artifacts, name):
    """ptxas serializes wgmma under register pressure (gsb0 + DEPBAR after every HGMMA, 1.8x
    slower). Clean: only the last HGMMA of each chain (QK, RS PV, SS PV, + prologue QK) carries gsb0."""
    _, cubin = artifacts[name]
    st = ki.hgmma_stats(_sass_or_skip(cubin))
    print(name, st)
    assert st.total == n_wgmma(_config(name).d_qk), st
    assert not st.serialized, st
    assert st.with_gsb0 <= N_CHAINS, st


@pytest.mark.parametrize("name", V4_CONFIGS)
def test_v4_reads_scale_rows_and_the_extra_pool(artifacts, name):
    """V4: each row's 7 ue8m0 scales come from its 8-B scale row (one 64-bit load per thread and row,
    none in V3.2), the Q tile is 8 TMA boxes of 64 dims, and the extra pool's rows are named by
    the encoded ring entry (a select between the two pools' geometry)."""
    ptx, cubin = artifacts[name]
    cfg = _config(name)
    assert f"ld.global.L1::{cfg.tuning.gather_l1}.L2::256B.v2" in ptx, "the scale-row loads"
    assert "ld.global.L1::evict_last.L2::256B.v2" not in artifacts["nosplit"][0]
    assert cfg.tile.d_qk == 512 and cfg.tile.chunks == 8 and cfg.tile.slots_per_row == 38
    if cfg.has_extra:
        # the extra list's indices and, with them, its lengths are kernel parameters
        assert ptx.count(".param") > artifacts["nosplit"][0].count(".param")


def test_v4_shared_memory_is_the_smaller_tile(artifacts):
    """The shared-storage struct follows the format: V4's 512-dim Q and K tiles take 24 KiB less."""
    from cute_mla.kernels.sm90.cta import shared_storage
    v32 = shared_storage(_config("nosplit").tile).size_in_bytes()
    v4 = shared_storage(_config("v4_nosplit").tile).size_in_bytes()
    assert v32 - v4 == 3 * 64 * 64 * 2 and v32 <= archs.SMEM_PER_CTA


def test_config_validation():
    base = dict(h_q=64, split=False, has_topk_length=False, has_attn_sink=False)
    with pytest.raises(ValueError, match="h_q"):
        Sm90SparseDecodeConfig(**dict(base, h_q=96))
    with pytest.raises(ValueError, match="arch"):
        Sm90SparseDecodeConfig(**base, arch=archs.SM100.name)
    with pytest.raises(ValueError, match="format"):
        Sm90SparseDecodeConfig(**base, format="V5")
    with pytest.raises(ValueError, match="has_extra"):
        Sm90SparseDecodeConfig(**base, has_extra=True)          # V3.2 has no extra pool
    with pytest.raises(ValueError, match="has_extra_topk_length"):
        Sm90SparseDecodeConfig(**{**base, "format": "V4"}, has_extra_topk_length=True)
    for bad in (dict(h_q=128, split=True), dict(h_q=64, split=False)):
        with pytest.raises(ValueError, match="column_pair"):
            Sm90SparseDecodeConfig(**dict(base, **bad), column_pair=True)
    with pytest.raises(ValueError, match="tuning"):
        Sm90SparseDecodeConfig(**base, tuning=dict(prefetch_rows=False))
    with pytest.raises(ValueError, match="request_order"):
        Sm90SparseDecodeConfig(**dict(base, split=True), request_order=True)
    with pytest.raises(ValueError, match="RegisterBudget"):
        RegisterBudget(softmax=240, pv_right=160, producer=112 + 8)
    # two producer warp groups: four warp groups enter with 128 registers and share 512
    two = RegisterBudget(softmax=144, pv_right=112, producer=128, producers=2)
    assert (two.warp_groups, two.threads, two.entry) == (4, 512, 128)
    assert (REGS.warp_groups, REGS.threads, REGS.entry) == (3, 384, 168)
    with pytest.raises(ValueError, match="summing to <= 512 with 2 producer"):
        RegisterBudget(softmax=160, pv_right=128, producer=128, producers=2)
    with pytest.raises(ValueError, match="producers takes 1 or 2, got 3"):
        RegisterBudget(softmax=96, pv_right=96, producer=96, producers=3)
    with pytest.raises(ValueError, match="producers: two producer warp groups run on the swap-AB tile only"):
        kernel_config(**dict(base, h_q=64), tuning=Sm90Tuning(registers=two))
    assert kernel_config(**dict(base, h_q=16)).tuning.registers == two
    with pytest.raises(ValueError, match="registers.producers takes 1"):
        Sm90PrefillTuning(registers=two)
    for bad in (dict(gather_l1=1), dict(gather_l1="no_allocate"), dict(gather_l2="L2::256B")):
        (key, value), = bad.items()
        with pytest.raises(ValueError, match=f"{key} takes '' .*got {re.escape(repr(value))}"):
            Sm90Tuning(**bad)
    # the L1 gather hint is the tile's unless the tuning names one
    assert kernel_config(**dict(base, h_q=64)).tuning.gather_l1 == "evict_last"
    assert kernel_config(**dict(base, h_q=16)).tuning.gather_l1 == "evict_first"
    named = Sm90Tuning(gather_l1="evict_normal")
    assert kernel_config(**dict(base, h_q=16), tuning=named).tuning.gather_l1 == "evict_normal"


def test_launch_passes_the_bundle_in_entry_order():
    """The launch hands the compiled entry the bundle's ENTRY fields in order (None where absent:
    the API fills only what the plan's config takes), then the timeline slot and the scale."""
    seen = {}

    class Fake:
        def fn(self, *args):
            seen["args"] = args

    cfg = kernel_config(h_q=64, format="V3.2", split=False, has_topk_length=False, has_attn_sink=False)
    t = SparseDecodeTensors("q", "kv", "idx", out="out", lse="lse", tile_md="md", accum_offsets="off", softmax_scale=0.5)
    launch_sparse_decode(Fake(), cfg, t)
    assert seen["args"] == ("q", "kv", "idx", None, None, "md", "off", "out", "lse", None, None, None, None, None, None,
                            None, 0.5)
    cfg = kernel_config(h_q=64, format="V4", split=True, has_topk_length=True, has_attn_sink=False, has_extra=True)
    t4 = t._replace(topk_length="tl", o_accum="oa", lse_accum="la", extra_k_cache="xkv", extra_indices="xidx")
    launch_sparse_decode(Fake(), cfg, t4)
    assert seen["args"] == ("q", "kv", "idx", "tl", None, "md", "off", "out", "lse", "oa", "la", "xkv", "xidx",
                            None, None, None, 0.5)
    cfg = kernel_config(h_q=128, format="V4", split=False, has_topk_length=True, has_attn_sink=False, has_extra=True,
                        request_order=True)
    launch_sparse_decode(Fake(), cfg, t4._replace(o_accum=None, lse_accum=None, request_order="order"))
    assert seen["args"] == ("q", "kv", "idx", "tl", None, "md", "off", "out", "lse", None, None, "xkv", "xidx",
                            None, "order", None, 0.5)
    with pytest.raises(ValueError, match="^request_order: "):
        launch_sparse_decode(Fake(), cfg, t4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_row_prefetch_is_per_thread(artifacts, name):
    """The L2 row prefetch of tile T+2 is a per-thread ``prefetch.global.L2`` (SASS CCTL.E.PF2), not
    the bulk prefetch, whose uniform-register operands make ptxas loop over the warp's 16 rows
    (``BRA.U.ANY``; ~13 % of the producer's time)."""
    ptx, cubin = artifacts[name]
    assert "prefetch.global.L2 [" in ptx
    assert "cp.async.bulk.prefetch.L2" not in ptx
    sass = _sass_or_skip(cubin)
    assert "CCTL.E.PF2" in sass
    assert "UBLKPF" not in sass
    # A uniform-operand loop is allowed only around the cluster kernels' per-warp bulk copies (one
    # lane's addresses: ptxas wraps each copy in a one-trip BRA.U.ANY loop), never for a prefetch.
    assert sass.count("BRA.U.ANY") <= sass.count("UBLKCP")
    if not _config(name).cluster:
        assert "BRA.U.ANY" not in sass


@pytest.mark.parametrize("name", list(CONFIGS))
def test_partition_metadata_is_one_vector_load(artifacts, name):
    """A CTA reads its tile_md words 0-3 in one 16-B load (SASS ``LDG.E.128``), not in two dependent
    8-B loads; split kernels read words 4-7 (the split flags and offset) the same way, once per MMA
    warp group, before the first tile."""
    sass = _sass_or_skip(artifacts[name][1])
    plain = [ln for ln in sass.splitlines() if "LDG.E" in ln and ".EL" not in ln]
    assert not any("LDG.E.64 " in ln for ln in plain), "tile_md read in 8-B pieces"
    assert any("LDG.E.128 " in ln and "+0x10]" not in ln for ln in plain), "no 16-B load of tile_md words 0-3"
    if CONFIGS[name][1]:   # split
        assert sum("LDG.E.128 " in ln and "+0x10]" in ln for ln in plain) >= 2, "words 4-7 not read once per MMA warp group"


def _check_cluster_start(ptx: str, sass: str):
    """A cluster kernel's start: the cluster barrier after the mbarrier inits arrives relaxed (no
    MEMBAR before it: the default arrive's release compiles to MEMBAR.ALL.GPU, which would wait for
    the tile_md load), and the partition's tile_md words are loaded before it, so their round trip
    overlaps the barrier."""
    assert "barrier.cluster.arrive.relaxed" in ptx
    lines = sass.splitlines()
    first_arrive = next(i for i, ln in enumerate(lines) if "UCGABAR_ARV" in ln)
    assert not any("MEMBAR" in ln for ln in lines[:first_arrive]), "a memory barrier before the start-up cluster arrive"
    assert any("LDG.E.128 " in ln for ln in lines[:first_arrive]), "tile_md not loaded before the cluster barrier"


@pytest.mark.parametrize("name", ["split_h128", "split_pair", "v4_split_h128_extra", "v4_split_pair_extra"])
def test_cluster_kernels_share_the_gather(artifacts, name):
    """Cluster kernels (h=128; the column pair): the half tiles travel to the peer by bulk smem ->
    dsmem copies with complete_tx on the peer's k_full, cluster addresses from mapa, the producers
    relay buffer releases through release/acquire.cluster mbarriers and the pair meets at cluster
    barriers."""
    ptx, cubin = artifacts[name]
    assert "mapa.shared::cluster" in ptx
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert "mbarrier.arrive.release.cluster.shared::cluster" in ptx, "peer_free relay"
    assert "mbarrier.try_wait.parity.acquire.cluster" in ptx, "peer_free wait"
    assert "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes" in ptx
    assert "st.async" not in ptx
    assert "barrier.cluster" not in artifacts["split_h128_no_cluster"][0]
    _check_cluster_start(ptx, _sass_or_skip(cubin))


def test_column_pair_splits_the_output_columns(artifacts):
    """The column pair: PV in 64x128 N-tiles (each CTA of the pair computes 256 of the 512 columns),
    the bf16 partials staged and stored by TMA (Q and o_accum the tensor maps)."""
    ptx, cubin = artifacts["split_pair"]
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx, "the bf16 partials' TMA store"
    sass = _sass_or_skip(cubin)
    assert "HGMMA.64x128x16" in sass and "HGMMA.64x256x16" not in sass
    assert "HGMMA.64x256x16" in _sass_or_skip(artifacts["split_tl_sink"][1])


def test_chunked_epilogue_stmatrix(artifacts):
    """Each MMA warp group stages a bf16 block with 16 stmatrix.x4 per thread (4 per 64-column
    chunk) and stores it in 4 TMA boxes: the split kernel has two blocks per warp group (out,
    o_accum), the no-split kernel one; the column pair's out leaves from registers."""
    stm = "stmatrix.sync.aligned.m8n8.x4.shared.b16"
    store = "cp.async.bulk.tensor.4d.global.shared::cta"
    split, nosplit, pair = artifacts["split_tl_sink"][0], artifacts["nosplit"][0], artifacts["split_pair"][0]
    assert split.count(stm) == 2 * 2 * 16 and nosplit.count(stm) == 2 * 16
    assert split.count(store) == 2 * 2 * 4 and nosplit.count(store) == 2 * 4
    assert pair.count(stm) == 2 * 8 and pair.count(store) == 2 * 2


def test_named_barriers_are_the_roles(artifacts):
    """Every named barrier in the PTX is one of ``Bar``, with the thread count of the warp groups
    that meet there (docs/architecture.md's table)."""
    import re

    counts = {Bar.P_READY: 256, Bar.P_FREE: 256, Bar.Q_FREE: 256, Bar.EPI_SOFTMAX: 128, Bar.EPI_PV_RIGHT: 128,
              Bar.INDEX_SCAN: 128}
    for name, (ptx, _) in artifacts.items():
        used = {(int(i), int(n)) for i, n in re.findall(r"bar\.(?:sync|arrive)\s+(\d+),\s*(\d+)", ptx)}
        assert used and used <= {(int(b), n) for b, n in counts.items()}, (name, used)


def timeline_ptx(h_q, out):
    """(config, PTX) of the no-split V3.2 decode kernel at ``h_q`` compiled with the timeline."""
    cfg = kernel_config(h_q=h_q, format="V3.2", split=False, has_topk_length=False, has_attn_sink=False,
                        tuning=Sm90Tuning(timeline=True))
    compile_sparse_decode(cfg, dump_dir=str(out))
    return cfg, ki.read_ptx(str(out), ARCH)


def test_timeline_is_instrumentation_only(artifacts, tmp_path):
    """``Sm90Tuning.timeline`` (the profile tool's timeline mode) reads the SM clock once per Stamp slot and
    the global timer once per ``NS_SLOTS`` slot (in the no-split kernel: a split kernel stages
    o_accum at a second site per warp group), the swap-AB tile's too; the default kernels read
    neither."""
    for name, (ptx, _) in artifacts.items():
        assert "%clock64" not in ptx and "%globaltimer" not in ptx, f"{name}: a default kernel reads a clock"
    _, text = timeline_ptx(64, tmp_path / "h64")
    assert text.count("%clock64") == len([s for s in Stamp if s != Stamp.SLOTS and s not in NS_SLOTS])
    assert text.count("%globaltimer") == len(NS_SLOTS)
    # The swap-AB tile (two producer warp groups): every slot but the epilogue's staging pair and
    # HALF_A (Stamp's docstring), each at one site.
    cfg, text = timeline_ptx(16, tmp_path / "swapped")
    assert cfg.swapped and cfg.tuning.registers.producers == 2
    unwritten = {Stamp.EPI_STAGED, Stamp.WG1_EPI_STAGED, Stamp.HALF_A, Stamp.SLOTS}
    assert text.count("%clock64") == len([s for s in Stamp if s not in unwritten and s not in NS_SLOTS])
    assert text.count("%globaltimer") == len(NS_SLOTS)


def test_divisor_magic_divides_every_row_index():
    """The rule of ``dsl.ptx.divisor_magic`` (the extra-pool producer's block of a row), in Python
    ints: shift = 63 - clz32(d - 1), magic = ceil(2^shift / d) fits 32 bits and (n * magic) >> shift
    is n // d for n in [0, 2^31): every page_block_size up to 1100 and a few up to 2^31 - 1, at the
    indices where a quotient steps and at the range's ends."""
    import random

    def clz32(x):
        return 32 - x.bit_length()

    rnd = random.Random(5)
    divisors = list(range(1, 1101)) + [4093, 65536, 65537, 2**20 + 7, 2**30, 2**30 + 1, 2**31 - 1]
    for d in divisors:
        shift = 63 - clz32(d - 1)
        magic = ((1 << shift) + d - 1) // d
        assert 0 < magic < 2**32, d
        top = 2**31 - 1
        ns = {0, 1, d - 1, d, d + 1, top, top - top % d, top - top % d - 1}
        ns |= {q * d + r for q in (rnd.randrange(0, top // d + 1) for _ in range(8)) for r in (0, d - 1)}
        for n in ns:
            if 0 <= n <= top:
                assert (n * magic) >> shift == n // d, (d, n)
