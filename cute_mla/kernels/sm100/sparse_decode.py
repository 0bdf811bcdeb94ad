"""SM100 (Blackwell, sm_100a) sparse MLA decode main kernel for the DeepSeek V3.2 and V4 FP8 caches.

NOT RUN ON HARDWARE. No Blackwell GPU was available while this was written: it is verified by CPU
compile tests (PTX checks, layout and budget asserts) only. ``tests/test_sm100_gpu.py`` is the test
to run first on an SM100 GPU; ``docs/sm100.md`` lists what to look at.

One CTA = 64 query heads of one query token for one scheduler partition (``tile_md`` row). It walks
the partition's requests and, inside each request, the 32-token tiles of its top-k list (one
64-token scheduler block = two tiles). h_q = 128 runs two 64-head CTAs side by side in grid x
(FlashMLA's head64x2, in one launch).

Warp roles (12 warps, 384 threads, one CTA per SM; in the spirit of FlashMLA's SM100 head64 kernel):

* warps 0-3 ``SOFTMAX`` (warpgroup 0): reads S from tensor memory, masks invalid tokens, online
  softmax in the log2 domain with FlashMLA's lazy rescale (O is rescaled in TMEM only when a row
  max grows by more than 2^6), writes bf16 P to shared memory, and runs the epilogue (O / L, sink,
  lse; bf16 ``out`` or fp32 ``o_accum`` through TMA stores).
* warps 4-7 ``DEQUANT`` (warpgroup 1): fp8 NoPE + fp32 scales (raw rows in shared memory) -> bf16
  K tile in the SW128 K-major UMMA layout, ``bf16(fp8 * scale)`` with the full fp32 scale.
* warp 8 ``MMA``: issues every tcgen05.mma (QK: M=64 heads, N=32 tokens, K=576; PV: two M=64
  N=256 K=32 halves of O) and the tcgen05.commits that release buffers. Also allocates TMEM.
* warp 9 ``GATHER``: TMA. Q (regular tiled TMA, 9 SW128 boxes) once per request; per tile two
  ``tile::gather4`` streams over the cache seen as a 2-D table of V3.2 rows: the raw NoPE+scale
  bytes (8 x 4 rows x 544 B) and the bf16 RoPE straight into its MMA-ready SW128 tile (8 x 4 x 128 B).
* warp 10 ``INDEX``: indices -> TMA row coordinates (``block * stride0/row_bytes + row``, -1 for an
  invalid token so the TMA zero-fills it) + a 32-bit valid mask per tile.
* warp 11: spare (keeps the three warpgroups whole for setmaxnreg).

The cache format is a config field (``format``, by name); what differs is read from the format spec through
the config's :class:`Tile` (``tile_of``). V4 ("MODEL1", d_qk 512): the gather4 tables
are of 576-byte data rows (448 fp8 NoPE, 64 bf16 RoPE), the NoPE box is 448 B (no scales in the
row); the INDEX warp loads each token's 8-byte scale row (7 ue8m0) into a scale ring next to the
coordinates (zeros for an invalid token), which the DEQUANT warps read (they are index-pipe
consumers too); V includes RoPE, so the dequant warp of the last column block copies the gathered
SW128 RoPE tile into the K tile's 8th column block, and QK (32 k-steps) and PV both read the K tile
alone (the MMA warp never touches the RoPE tile). Invalid tokens: TMA zero fill of NoPE and RoPE,
zero scales, so K = V = 0 there. The extra pool (V4): two more gather4 maps over the extra cache;
a request's tiles past its main blocks read the extra list and those maps (``_Sched.request_tiles``,
the scheduler's block rule).

Pipelines (producer -> consumer, arrive counts per phase); each is a CUTLASS pipeline object:

* ``index`` (PipelineAsync, 4 stages): INDEX (32 thread arrivals) -> GATHER + SOFTMAX
  (32 + 128 thread arrivals on empty; V4 + DEQUANT: lane 0 of each warp, 164).
* ``q`` (PipelineTmaUmma, 1 stage): GATHER (1 arrive + 73,728 tx bytes; V4 65,536) -> MMA
  (tcgen05.commit after the request's last QK).
* ``raw`` (PipelineTmaAsync, 3 stages): GATHER (1 arrive + 17,408 tx bytes; V4 14,336) -> DEQUANT
  (one arrive per warp after __syncwarp: 4).
* ``rope`` (PipelineTmaUmma, 3 stages, same stage index as raw): GATHER (1 arrive + 4,096 tx)
  -> MMA (tcgen05.commit after the tile's QK). V4: PipelineTmaAsync -> the dequant warp that
  copies it into the K tile (1 arrive, after the copy).
* ``kbuf`` (PipelineAsyncUmma, 2 stages): DEQUANT (128 thread arrivals after fence.proxy.async)
  -> MMA (tcgen05.commit after the tile's PV: K is read by QK and, as V, by PV).
* ``s`` (PipelineUmmaAsync, 2 stages, TMEM): MMA (tcgen05.commit after QK) -> SOFTMAX (128 thread
  arrivals after tcgen05.wait::ld).
* ``p`` (PipelineAsyncUmma, 1 stage): SOFTMAX (128 arrivals: P in smem, O rescaled in TMEM) -> MMA
  (tcgen05.commit after PV). Its empty phase doubles as "PV done": the softmax waits on it before
  it rescales O, before it rewrites P and before the epilogue reads O.

The producers of ``q``, ``rope`` (V3.2) and ``kbuf``, whose consumer arrivals are tcgen05.commits,
wait for the last ones before they exit (``producer_tail``). A request whose tile range is empty
(a schedule that disagrees with the call) is skipped by every role (``_Sched.request_tiles``).

Tensor memory (512 columns allocated, 320 used): O (64 x 512 fp32) is two M=64 N=256 accumulators
interleaved in lanes (tcgen05 data-path layout F: rows 16w..16w+15 of warp w's 32-lane slab; dims
0-255 in lanes 0-15, dims 256-511 in lanes 16-31), columns [0, 256). S stage j: columns
[256 + 32j, 288 + 32j), lanes 0-15 of each slab.

Shared memory (smem_bytes(cfg), asserted <= 227 KiB): Q 72 KiB, K 2 x 32 KiB, RoPE 3 x 4 KiB,
raw 3 x 17 KiB, P 4 KiB, output staging 16 KiB, index ring, barriers (225,280 B). V4: Q 64 KiB, raw
3 x 14 KiB, + a 1 KiB scale ring (208,896 B).
"""


import functools
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from ... import archs
from ...dsl.compat import (
    SmemAllocator,
    setmaxregister_decrease,
    setmaxregister_increase,
    tcgen05_fence_after_thread_sync,
    tcgen05_fence_before_thread_sync,
)
from ...dsl.compile import CompiledKernel, compile_cached, compile_options
from ...scheduler.partition import SCHED_ROW_INTS, SchedField, blocks_of_length, extra_blocks_of_length
from .. import SparseDecodeTensors, entry_getter, fake_entry
from . import ptx
from .cta import (  # the MMA side both SM100 kernels share
    allocate_tmem,
    commit_p,
    cta_storage,
    free_tmem,
    k_tile_byte,
    operand_layouts,
    out_box_byte,
    permuted,
    release_tmem,
    smem_buffer,
    store_p_row,
    take_tmem,
    tiled_mmas,
)
from .config import (  # noqa: F401  (the protocol and the facts the roles read)
    LOG2E,
    LN2,
    SMEM_LIMIT,
    TMEM_COLUMNS,
    Sm100SparseDecodeConfig,
    Config,
    Tuning,
    ACCUM_DTYPE,
    kernel_config,
    config_for,
    tensor_maps,
    Warp,
    WarpSchedule,
    RegisterBudget,
    Bar,
    Tile,
    tile_of,
    Stages,
    TmemPlan,
    TILE,
    STAGES,
    WARPS,
    REGS,
    TMEM,
    LAZY_RESCALE_LOG2,
    MAX_INIT,
)



# --------------------------------------------------------------------------------------------------
# Layouts: the decode kernel's own (the MMA side's layouts and byte formulas are in cta.py; the
# same swizzle rules, checked the same way by tests/test_sm100_compile.py).
# --------------------------------------------------------------------------------------------------


def rope_row_byte(tile: Tile, t):
    """Byte offset in one K stage of V4's RoPE row ``t`` (K dims [d_nope, d_nope + 64)): the K tile's
    last column block. The gathered SW128 RoPE tile's row t (bytes [128 t, 128 t + 128)) is copied
    there 16 B at a time, in place (same swizzle phase: both bases are 1024-B aligned)."""
    return tile.nope_chunks * tile.k_block_bytes + 2 * tile.chunk * t


def scale_row_byte(tile: Tile, blk, row, page, stride0):
    """Byte offset from a cache's base of the scale row of token ``row`` of page block ``blk`` when
    the scales are in scale rows (V4): after the block's ``page`` data rows. Python ints or DSL
    Int64 values."""
    return blk * stride0 + page * tile.data_row_bytes + row * tile.fmt.scale_row_bytes + tile.scale_offset


def oacc_box_byte(r, col):
    """Byte offset of fp32 o_accum[r, col] (col % 4 == 0) in one 64 x 32 SW128 staging box."""
    return 128 * r + 16 * ((col // 4) ^ (r % 8))


def smem_layouts(qk, pv, tile: Tile = TILE) -> dict:
    """Every shared-memory layout of the kernel for ``tile``'s format (call inside a DSL trace): the
    MMA side's (Q, the dequantized K stages, P, the V view over them (+8192 elements = the O half,
    +16384 the K stage), the out box), the RoPE tile, and the TMA views below."""
    L = operand_layouts(qk, pv, tile, STAGES, STAGES.kbuf)
    L["rope"] = sm100_utils.make_smem_layout_b(qk, (tile.heads, tile.tokens, tile.d_rope), BFloat16, STAGES.gather)
    # The 2-D (row, column) views the TMA copies see: RoPE tile (32 x 64 bf16, SW128), the fp32
    # SW128 o_accum box (64 heads x 32 dims; out's bf16 SW64 box is the MMA side's); raw rows (no swizzle).
    L["rope_tma"] = cute.tile_to_shape(
        tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, BFloat16), (tile.tokens, tile.d_rope), (0, 1)
    )
    L["oacc_box"] = cute.tile_to_shape(
        tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, Float32), (tile.heads, tile.epi_cols), (0, 1)
    )
    L["raw"] = cute.make_layout((tile.tokens, tile.raw_row_words), stride=(tile.raw_row_words, 1))
    return L


@functools.lru_cache(maxsize=None)
def _shared_storage(tile: Tile = TILE):
    """The CTA's shared memory (:func:`cta_storage`): the pipelines' barriers, the index ring, then
    Q, the K stages, RoPE, P, the output staging and the raw rows. V4 adds the per-token scale ring
    the INDEX warp fills (one scale row per token and index stage) at the end."""
    buffers = {
        "sQ": smem_buffer(BFloat16, tile.q_elems),
        "sK": smem_buffer(BFloat16, STAGES.kbuf * tile.k_stage_elems),
        "sRope": smem_buffer(BFloat16, STAGES.gather * tile.rope_stage_elems),
        "sP": smem_buffer(BFloat16, tile.p_elems),
        "sEpi": smem_buffer(Uint8, tile.epi_stage_bytes),
        "sRaw": smem_buffer(Int32, STAGES.gather * tile.raw_stage_bytes // 4, 128),
    }
    if tile.scales_in_index:
        buffers["scales"] = smem_buffer(Int32, STAGES.index * tile.tokens * tile.scale_words, 16)
    pipelines = dict(q=STAGES.q, index=STAGES.index, raw=STAGES.gather, rope=STAGES.gather, kbuf=STAGES.kbuf,
                     s=STAGES.s, p=STAGES.p)
    return cta_storage(pipelines, STAGES.index, buffers)


def smem_bytes(cfg: Optional[Sm100SparseDecodeConfig]) -> int:
    """Dynamic shared memory of one CTA, from the kernel's own struct (same for both variants and
    with or without the extra pool; ``None``: the V3.2 kernel's)."""
    return _shared_storage(TILE if cfg is None else cfg.tile).size_in_bytes()


def tmem_columns(cfg: Sm100SparseDecodeConfig) -> int:
    """Tensor-memory columns the kernel allocates (a power of two >= what its accumulators use)."""
    del cfg
    return TMEM.alloc


# --------------------------------------------------------------------------------------------------
# The bundles the roles take (built once in the kernel entry; Python objects, inlined at trace time)
# --------------------------------------------------------------------------------------------------


class Gmem(NamedTuple):
    """Global tensors and the TMA atoms that read or write them, and the launch's scalars."""

    tma_q: cute.CopyAtom
    mQ: cute.Tensor
    tma_nope: cute.CopyAtom        # gather4 of the raw NoPE + scale bytes of a row
    mNope: cute.Tensor
    tma_rope: cute.CopyAtom        # gather4 of the bf16 RoPE of a row, straight into its MMA tile
    mRope: cute.Tensor
    tma_out: cute.CopyAtom
    mOut: cute.Tensor
    tma_oacc: Optional[cute.CopyAtom]
    mOAcc: Optional[cute.Tensor]
    mKV: cute.Tensor
    mIdx: cute.Tensor
    mTopkLen: Optional[cute.Tensor]
    mSink: Optional[cute.Tensor]
    mAccumOffsets: cute.Tensor     # (b+1,): request r's split pieces own rows [off[r], off[r+1])
    mLse: cute.Tensor
    mLseAcc: Optional[cute.Tensor]
    rows_per_block: Int32          # stride(0) / data row bytes: the cache seen as a table of rows
    scale_log2: Float32
    # The extra pool (V4): its two gather4 maps, its cache, (b, s_q, extra_topk) indices and lengths.
    tma_enope: Optional[cute.CopyAtom]
    mENope: Optional[cute.Tensor]
    tma_erope: Optional[cute.CopyAtom]
    mERope: Optional[cute.Tensor]
    mExtraKV: Optional[cute.Tensor]
    mExtraIdx: Optional[cute.Tensor]
    mExtraLen: Optional[cute.Tensor]


class Smem(NamedTuple):
    """The shared-storage struct and the tensors over it."""

    storage: object
    sQ: cute.Tensor
    sK: cute.Tensor
    sRope: cute.Tensor
    sP: cute.Tensor
    sV: cute.Tensor
    sCoord: cute.Tensor
    sValid: cute.Tensor


class Pipes(NamedTuple):
    """The CTA's pipelines (producer -> consumer tables in the module docstring)."""

    index: object
    q: object
    raw: object
    rope: object
    kbuf: object
    s: object
    p: object


class Boxes(NamedTuple):
    """The shared-memory views the TMA copies see."""

    raw_layout: cute.Layout
    rope_tma_layout: cute.ComposedLayout
    out_box_layout: cute.ComposedLayout
    oacc_box_layout: cute.ComposedLayout


class Cta(NamedTuple):
    """This CTA's partition row, query token and head group."""

    sched: object      # _Sched
    s_idx: Int32
    hg: Int32


def _gather_maps(tile: Tile, kv: cute.Tensor, indices: cute.Tensor, raw_layout: cute.Layout,
                 rope_tma_layout: cute.ComposedLayout):
    """(nope atom, nope tensor, rope atom, rope tensor): the two gather4 tensor maps of one cache (called
    in the host trace). The cache is a 2-D table of data rows: row = block * (stride0 / data row
    bytes) + row_in_block (V3.2 whole rows, V4 576-B data rows). NoPE map: the first ``raw_row_bytes``
    of a row as int32 words, no swizzle (V3.2 with its scales); RoPE map: the 64 bf16 at the
    format's ``rope_offset``, SW128 (the MMA's K-major tile)."""
    rows_per_block = Int32(kv.stride[0] // tile.tma_row_bytes)
    num_rows = kv.shape[0] * rows_per_block
    nope_t = cute.make_tensor(
        cute.recast_ptr(kv.iterator, dtype=Int32),
        cute.make_layout((num_rows, tile.raw_row_words), stride=(tile.tma_row_bytes // 4, 1)),
    )
    rope_t = cute.make_tensor(
        cute.recast_ptr(kv.iterator + tile.rope_offset, dtype=BFloat16),
        cute.make_layout((num_rows, tile.d_rope), stride=(tile.tma_row_bytes // 2, 1)),
    )
    # gather4 needs an index tensor only for its layout here: mode 0 carries the row indices,
    # mode 1 (the row's columns) is broadcast. The kernel points it at the shared coordinate ring.
    nope_coord = cute.make_tensor(indices.iterator, cute.make_layout((tile.tokens, tile.raw_row_words), stride=(1, 0)))
    rope_coord = cute.make_tensor(indices.iterator, cute.make_layout((tile.tokens, tile.d_rope), stride=(1, 0)))
    tma_nope, nope_tma = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensor2DGather4G2SOp(), nope_t, raw_layout, (tile.tokens, tile.raw_row_words),
        gmem_coord_tensor=nope_coord,
    )
    tma_rope, rope_tma = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensor2DGather4G2SOp(), rope_t, rope_tma_layout, (tile.tokens, tile.d_rope),
        gmem_coord_tensor=rope_coord,
    )
    return tma_nope, nope_tma, tma_rope, rope_tma


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


class Sm100SparseDecodeKernel:
    def __init__(self, cfg: Sm100SparseDecodeConfig):
        self.cfg = cfg
        self.tile = cfg.tile
        self.n_hg = cfg.head_groups

    # ------------------------------------------------------------------------------ host side
    # The compiled entry: its tensor parameters are ENTRY, in order (None for an absent optional one).
    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,  # (b, s_q, h_q, d_qk) bf16
        k_cache: cute.Tensor,  # (num_blocks, page_block_size, row bytes) uint8, stride(0) a multiple of the data row bytes
        indices: cute.Tensor,  # (b, s_q, topk) int32
        topk_length: Optional[cute.Tensor],  # (b,) int32
        attn_sink: Optional[cute.Tensor],  # (h_q,) fp32
        tile_md: cute.Tensor,  # (P, 8) int32
        accum_offsets: cute.Tensor,  # (b+1,) int32: accumulator row offsets
        out: cute.Tensor,  # (b, s_q, h_q, 512) bf16
        lse: cute.Tensor,  # (b, s_q, h_q) fp32
        o_accum: Optional[cute.Tensor],  # (rows, s_q, h_q, 512) fp32, split variant only
        lse_accum: Optional[cute.Tensor],  # (rows, s_q, h_q) fp32, split variant only
        extra_k_cache: Optional[cute.Tensor],  # the extra pool (V4): (num_blocks_e, page_e, row bytes) uint8
        extra_indices: Optional[cute.Tensor],  # (b, s_q, extra_topk) int32
        extra_topk_length: Optional[cute.Tensor],  # (b,) int32
        softmax_scale: Float32,
        stream,
    ):
        cfg = self.cfg
        tile = self.tile
        cta = tcgen05.CtaGroup.ONE
        qk_mma, pv_mma = tiled_mmas()
        L = smem_layouts(qk_mma, pv_mma, tile)
        q_layout, k_layout, rope_layout, p_layout = L["q"], L["k"], L["rope"], L["p"]
        rope_tma_layout, out_box_layout, oacc_box_layout, raw_layout = L["rope_tma"], L["out_box"], L["oacc_box"], L["raw"]

        # ---- TMA atoms (tensor maps): q, kv_nope, kv_rope, out (+ o_accum in the split variant)
        # (+ extra_nope, extra_rope with the extra pool)
        tma_q, q_tma = cute.nvgpu.make_tiled_tma_atom_A(
            cpasync.CopyBulkTensorTileG2SOp(cta), permuted(q, (2, 3, 1, 0)), cute.select(q_layout, mode=[0, 1, 2]),
            (tile.heads, tile.tokens, tile.d_qk), qk_mma,
        )
        rows_per_block = Int32(k_cache.stride[0] // tile.tma_row_bytes)
        tma_nope, nope_tma, tma_rope, rope_tma = _gather_maps(tile, k_cache, indices, raw_layout, rope_tma_layout)
        tma_enope = enope_tma = tma_erope = erope_tma = None
        if cutlass.const_expr(cfg.has_extra):
            tma_enope, enope_tma, tma_erope, erope_tma = _gather_maps(tile, extra_k_cache, extra_indices, raw_layout,
                                                                      rope_tma_layout)
        tma_out, out_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), permuted(out, (2, 3, 1, 0)), out_box_layout, (tile.heads, tile.epi_cols)
        )
        tma_oacc = None
        oacc_tma = None
        if cutlass.const_expr(cfg.split):
            # The accumulator tensor map exists only in the split variant.
            tma_oacc, oacc_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), permuted(o_accum, (2, 3, 1, 0)), oacc_box_layout,
                (tile.heads, tile.epi_cols),
            )

        scale_log2 = softmax_scale * Float32(LOG2E)
        grid = (q.shape[1] * self.n_hg, tile_md.shape[0], 1)
        self.kernel(
            qk_mma, pv_mma,
            tma_q, q_tma, tma_nope, nope_tma, tma_rope, rope_tma, tma_out, out_tma, tma_oacc, oacc_tma,
            k_cache, indices, topk_length, attn_sink, tile_md, accum_offsets, lse, lse_accum,
            rows_per_block, scale_log2,
            q_layout, k_layout, rope_layout, p_layout, L["v_outer"], L["v_swizzle"], rope_tma_layout, out_box_layout,
            oacc_box_layout, raw_layout,
            tma_enope, enope_tma, tma_erope, erope_tma, extra_k_cache, extra_indices, extra_topk_length,
        ).launch(grid=grid, block=[WARPS.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_nope: cute.CopyAtom,
        mNope: cute.Tensor,
        tma_rope: cute.CopyAtom,
        mRope: cute.Tensor,
        tma_out: cute.CopyAtom,
        mOut: cute.Tensor,
        tma_oacc: Optional[cute.CopyAtom],
        mOAcc: Optional[cute.Tensor],
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],
        mTileMd: cute.Tensor,
        mAccumOffsets: cute.Tensor,
        mLse: cute.Tensor,
        mLseAcc: Optional[cute.Tensor],
        rows_per_block: Int32,
        scale_log2: Float32,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        rope_layout: cute.ComposedLayout,
        p_layout: cute.ComposedLayout,
        v_outer: cute.Layout,
        v_swizzle,
        rope_tma_layout: cute.ComposedLayout,
        out_box_layout: cute.ComposedLayout,
        oacc_box_layout: cute.ComposedLayout,
        raw_layout: cute.Layout,
        tma_enope: Optional[cute.CopyAtom],
        mENope: Optional[cute.Tensor],
        tma_erope: Optional[cute.CopyAtom],
        mERope: Optional[cute.Tensor],
        mExtraKV: Optional[cute.Tensor],
        mExtraIdx: Optional[cute.Tensor],
        mExtraLen: Optional[cute.Tensor],
    ):
        tile = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        bidx, part, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        s_idx = bidx // self.n_hg
        hg = bidx % self.n_hg

        smem = SmemAllocator()
        storage = smem.allocate(_shared_storage(tile))

        # ---- pipelines (mbarriers initialised by warp 0, one fence + CTA sync below)
        thr = pipeline.Agent.Thread
        # V4: the dequant warps read the stage's scale rows too (lane 0 of each warp arrives).
        idx_consumers = 32 + WARPS.softmax_threads + (WARPS.dequant_warps if tile.scales_in_index else 0)
        idx_pipe = pipeline.PipelineAsync.create(
            num_stages=STAGES.index,
            producer_group=pipeline.CooperativeGroup(thr, 32),
            consumer_group=pipeline.CooperativeGroup(thr, idx_consumers),
            barrier_storage=storage.index_bar.data_ptr(),
            defer_sync=True,
        )
        q_pipe = pipeline.PipelineTmaUmma.create(
            num_stages=STAGES.q,
            producer_group=pipeline.CooperativeGroup(thr),
            consumer_group=pipeline.CooperativeGroup(thr),
            tx_count=tile.q_elems * 2,
            barrier_storage=storage.q_bar.data_ptr(),
            defer_sync=True,
        )
        raw_pipe = pipeline.PipelineTmaAsync.create(
            num_stages=STAGES.gather,
            producer_group=pipeline.CooperativeGroup(thr),
            consumer_group=pipeline.CooperativeGroup(thr, WARPS.dequant_warps),
            tx_count=tile.raw_stage_bytes,
            barrier_storage=storage.raw_bar.data_ptr(),
            defer_sync=True,
        )
        # V3.2: QK reads the RoPE tile (the MMA warp frees it); V4: the dequant warp that copies it
        # into the K tile frees it (PipelineTmaAsync: lane 0 of that one warp arrives).
        rope_pipe_cls = pipeline.PipelineTmaAsync if tile.rope_in_k else pipeline.PipelineTmaUmma
        rope_pipe = rope_pipe_cls.create(
            num_stages=STAGES.gather,
            producer_group=pipeline.CooperativeGroup(thr),
            consumer_group=pipeline.CooperativeGroup(thr),
            tx_count=tile.rope_stage_elems * 2,
            barrier_storage=storage.rope_bar.data_ptr(),
            defer_sync=True,
        )
        k_pipe = pipeline.PipelineAsyncUmma.create(
            num_stages=STAGES.kbuf,
            producer_group=pipeline.CooperativeGroup(thr, WARPS.dequant_threads),
            consumer_group=pipeline.CooperativeGroup(thr),
            barrier_storage=storage.kbuf_bar.data_ptr(),
            defer_sync=True,
        )
        s_pipe = pipeline.PipelineUmmaAsync.create(
            num_stages=STAGES.s,
            producer_group=pipeline.CooperativeGroup(thr),
            consumer_group=pipeline.CooperativeGroup(thr, WARPS.softmax_threads),
            barrier_storage=storage.s_bar.data_ptr(),
            defer_sync=True,
        )
        p_pipe = pipeline.PipelineAsyncUmma.create(
            num_stages=STAGES.p,
            producer_group=pipeline.CooperativeGroup(thr, WARPS.softmax_threads),
            consumer_group=pipeline.CooperativeGroup(thr),
            barrier_storage=storage.p_bar.data_ptr(),
            defer_sync=True,
        )

        if warp == Warp.GATHER:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_nope)
            cpasync.prefetch_descriptor(tma_rope)
            if cutlass.const_expr(self.cfg.has_extra):
                cpasync.prefetch_descriptor(tma_enope)
                cpasync.prefetch_descriptor(tma_erope)
        if warp == Warp.SOFTMAX:
            cpasync.prefetch_descriptor(tma_out)
            if cutlass.const_expr(self.cfg.split):
                cpasync.prefetch_descriptor(tma_oacc)

        tmem = allocate_tmem(storage, Warp.MMA)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # ---- shared-memory tensors
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sRope = storage.sRope.get_tensor(rope_layout.outer, swizzle=rope_layout.inner)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), v_swizzle, dtype=BFloat16), v_outer)
        sCoord = storage.coord.get_tensor(cute.make_layout(STAGES.index * tile.tokens))
        sValid = storage.valid.get_tensor(cute.make_layout(STAGES.index))

        g = Gmem(tma_q, mQ, tma_nope, mNope, tma_rope, mRope, tma_out, mOut, tma_oacc, mOAcc, mKV, mIdx, mTopkLen, mSink,
                 mAccumOffsets, mLse, mLseAcc, rows_per_block, scale_log2,
                 tma_enope, mENope, tma_erope, mERope, mExtraKV, mExtraIdx, mExtraLen)
        sm = Smem(storage, sQ, sK, sRope, sP, sV, sCoord, sValid)
        pipes = Pipes(idx_pipe, q_pipe, raw_pipe, rope_pipe, k_pipe, s_pipe, p_pipe)
        boxes = Boxes(raw_layout, rope_tma_layout, out_box_layout, oacc_box_layout)

        # The partition (scheduler row) is read by each role after its setmaxnreg, so that nothing
        # computed here stays live across the register reconfiguration (ptxas would spill it).
        if warp >= Warp.MMA:
            setmaxregister_decrease(REGS.producers)
            cta = Cta(_Sched.load(mTileMd, part, mIdx.shape[0], mIdx.shape[2]), s_idx, hg)
            if warp == Warp.MMA:
                tmem_ptr = take_tmem(tmem, allocator=True)
                self.mma_role(cta, g, sm, pipes, qk_mma, pv_mma, tmem_ptr)
                free_tmem(tmem, tmem_ptr)
            if warp == Warp.GATHER:
                self.gather_role(cta, g, sm, pipes, qk_mma, boxes)
            if warp == Warp.INDEX:
                self.index_role(cta, g, sm, pipes)
        elif warp >= Warp.DEQUANT:
            if cutlass.const_expr(REGS.dequant > REGS.entry):
                setmaxregister_increase(REGS.dequant)
            if cutlass.const_expr(REGS.dequant < REGS.entry):
                setmaxregister_decrease(REGS.dequant)
            cta = Cta(_Sched.load(mTileMd, part, mIdx.shape[0], mIdx.shape[2]), s_idx, hg)
            if cutlass.const_expr(tile.rope_in_k):
                self.dequant_role_rope_in_k(cta, g, sm, pipes)
            else:
                self.dequant_role(cta, g, sm, pipes)
        else:
            setmaxregister_increase(REGS.softmax)
            cta = Cta(_Sched.load(mTileMd, part, mIdx.shape[0], mIdx.shape[2]), s_idx, hg)
            tmem_ptr = take_tmem(tmem, allocator=False)
            self.softmax_role(cta, g, sm, pipes, boxes, tmem_ptr)
            release_tmem()

    # ------------------------------------------------------------------------------ INDEX warp
    @cute.jit
    def index_role(self, cta: "Cta", g: "Gmem", smem: "Smem", pipes: "Pipes"):
        """indices -> TMA row coordinates (-1 = zero-fill) and a 32-bit valid mask, one tile per stage;
        V4: and each token's scale row (zeros for an invalid token). With the extra pool a tile past
        the request's main blocks reads the extra list and the extra cache's geometry."""
        tile = self.tile
        sched, s_idx, _ = cta
        mIdx, mKV, rows_per_block = g.mIdx, g.mKV, g.rows_per_block
        sCoord, sValid, idx_pipe = smem.sCoord, smem.sValid, pipes.index
        lane = cute.arch.lane_idx()
        page = mKV.shape[1]
        num_tokens = mKV.shape[0] * page
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.index)
        for req in cutlass.range(sched.begin_req, sched.end_req + 1, unroll=1):
            t0, t1, topk_len, t_extra, extra_len = sched.request_tiles(req, g)
            for t in cutlass.range(t0, t1, unroll=1):
                idx_pipe.producer_acquire(state)
                if cutlass.const_expr(not self.cfg.has_extra and not tile.scales_in_index):
                    pos = t * TILE.tokens + lane
                    raw = mIdx[req, s_idx, pos]
                    ok = (raw >= 0) & (raw < num_tokens) & (pos < topk_len)
                    blk = raw // page
                    coord = blk * rows_per_block + (raw - blk * page)
                else:
                    ok, coord = self.token_coord(cta, g, smem, req, t, (topk_len, t_extra, extra_len), state.index)
                sCoord[state.index * TILE.tokens + lane] = cutlass.select_(ok, coord, Int32(-1))
                mask = cute.arch.vote_ballot_sync(ok)
                if lane == 0:
                    sValid[state.index] = Uint32(mask)
                idx_pipe.producer_commit(state)
                state.advance()

    @cute.jit
    def token_coord(self, cta: "Cta", g: "Gmem", smem: "Smem", req: Int32, t: Int32, lengths, stage: Int32):
        """(valid, TMA row coordinate) of this lane's token of tile ``t`` in either pool (``lengths``:
        the main list's valid length, the first extra tile, the extra list's valid length); V4 also
        stores the token's scale row in the index stage (:meth:`store_scales`)."""
        tile = self.tile
        topk_len, t_extra, extra_len = lengths
        lane = cute.arch.lane_idx()
        mKV = g.mKV
        in_extra = cutlass.Boolean(False)
        pos = t * TILE.tokens + lane
        length = topk_len
        if cutlass.const_expr(self.cfg.has_extra):
            in_extra = t >= t_extra
            if in_extra:
                pos = (t - t_extra) * TILE.tokens + lane
                length = extra_len
        # A position at or past its list's valid length is invalid and not read: with a schedule
        # that disagrees with the call, a tile can lie past the end of the extra list.
        raw = Int32(-1)
        if pos < length:
            if cutlass.const_expr(self.cfg.has_extra):
                if in_extra:
                    raw = g.mExtraIdx[req, cta.s_idx, pos]
                else:
                    raw = g.mIdx[req, cta.s_idx, pos]
            else:
                raw = g.mIdx[req, cta.s_idx, pos]
        page = Int32(mKV.shape[1])
        blocks = Int32(mKV.shape[0])
        rows_per_block = g.rows_per_block
        base = mKV.iterator.toint()
        stride0 = Int64(mKV.stride[0])
        if cutlass.const_expr(self.cfg.has_extra):
            eKV = g.mExtraKV
            page = cutlass.select_(in_extra, Int32(eKV.shape[1]), page)
            blocks = cutlass.select_(in_extra, Int32(eKV.shape[0]), blocks)
            rows_per_block = cutlass.select_(in_extra, Int32(eKV.stride[0] // tile.tma_row_bytes), rows_per_block)
            base = cutlass.select_(in_extra, eKV.iterator.toint(), base)
            stride0 = cutlass.select_(in_extra, Int64(eKV.stride[0]), stride0)
        ok = (raw >= 0) & (raw < blocks * page) & (pos < length)
        blk = raw // page
        row = raw - blk * page
        coord = blk * rows_per_block + row
        if cutlass.const_expr(tile.scales_in_index):
            # the block's scale rows follow its page data rows
            addr = base + scale_row_byte(tile, Int64(blk), Int64(row), Int64(page), stride0)
            self.store_scales(smem, stage, ok, addr)
        return ok, coord

    @cute.jit
    def store_scales(self, smem: "Smem", stage: Int32, ok, addr: Int64):
        """This lane's token's scale row (``scale_words`` i32 from global ``addr``, zeros when the
        token is invalid: no load) -> its slot of the index stage's scale ring."""
        tile = self.tile
        lane = cute.arch.lane_idx()
        slot = ptx.smem_addr(smem.storage.scales.data_ptr()) + (stage * TILE.tokens + lane) * (4 * tile.scale_words)
        w0 = Int32(0)
        w1 = Int32(0)
        if ok:
            v = ptx.ld_global_v2(addr)
            w0 = ptx.vec_elem(v, 0)
            w1 = ptx.vec_elem(v, 1)
        ptx.st_shared_i32(slot, w0)
        ptx.st_shared_i32(slot + 4, w1)

    # ------------------------------------------------------------------------------ GATHER warp
    @cute.jit
    def gather_role(self, cta: "Cta", g: "Gmem", smem: "Smem", pipes: "Pipes", qk_mma: cute.TiledMma,
                    boxes: "Boxes"):
        """TMA: Q once per request; per tile the raw NoPE(+scale) rows and the RoPE rows by gather4
        (through the extra pool's maps for a tile past the request's main blocks)."""
        tile = self.tile
        sched, s_idx, hg = cta
        tma_q, mQ, tma_nope, mNope, tma_rope, mRope = g.tma_q, g.mQ, g.tma_nope, g.mNope, g.tma_rope, g.mRope
        sQ, storage, raw_layout, rope_tma_layout = smem.sQ, smem.storage, boxes.raw_layout, boxes.rope_tma_layout
        q_pipe, idx_pipe, raw_pipe, rope_pipe = pipes.q, pipes.index, pipes.raw, pipes.rope
        thr_mma = qk_mma.get_slice(0)
        coord_ptr = storage.coord.data_ptr()
        raw_ptr = storage.sRaw.data_ptr()
        rope_ptr = storage.sRope.data_ptr()
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.q)
        g_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.gather)
        i_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.index)
        for req in cutlass.range(sched.begin_req, sched.end_req + 1, unroll=1):
            t0, t1, topk_len, t_extra, extra_len = sched.request_tiles(req, g)
            # Q (64 heads x d_qk) of this request: waits until the previous request's last QK is done.
            # A request with an empty range gets none: the MMA warp neither waits for it nor frees it.
            if t1 > t0:
                gQ = cute.local_tile(mQ[None, None, s_idx, req], (tile.heads, tile.d_qk), (hg, 0))
                tQsQ, tQgQ = cpasync.tma_partition(
                    tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                    cute.group_modes(thr_mma.partition_A(gQ), 0, 3),
                )
                q_pipe.producer_acquire(q_state)
                cute.copy(tma_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
                q_state.advance()
            for t in cutlass.range(t0, t1, unroll=1):
                idx_pipe.consumer_wait(i_state)
                coords = coord_ptr + i_state.index * TILE.tokens
                in_extra = cutlass.Boolean(False)
                if cutlass.const_expr(self.cfg.has_extra):
                    in_extra = t >= t_extra
                raw_pipe.producer_acquire(g_state)
                sRawStage = cute.make_tensor(raw_ptr + g_state.index * (tile.raw_stage_bytes // 4), raw_layout)
                self.gather_either(tma_nope, mNope, g.tma_enope, g.mENope, in_extra, coords, sRawStage,
                                   tile.raw_row_words, raw_pipe.producer_get_barrier(g_state))
                rope_pipe.producer_acquire(g_state)
                sRopeStage = cute.make_tensor(
                    cute.recast_ptr(rope_ptr + g_state.index * tile.rope_stage_elems, rope_tma_layout.inner,
                                    dtype=BFloat16),
                    rope_tma_layout.outer,
                )
                self.gather_either(tma_rope, mRope, g.tma_erope, g.mERope, in_extra, coords, sRopeStage,
                                   tile.d_rope, rope_pipe.producer_get_barrier(g_state))
                # The coordinates were read (by the lane that issued the copies) before this arrive.
                idx_pipe.consumer_release(i_state)
                i_state.advance()
                g_state.advance()
        # The MMA warp frees Q and (V3.2) the RoPE stages with tcgen05.commit, an arrive that lands
        # when the tensor core is done, after the MMA warp has moved on: wait for the last ones, so
        # that no arrive reaches this CTA's shared memory after it has exited (CUTLASS's producer
        # tail). The raw stages and V4's RoPE stages are freed by thread arrives, which cannot
        # outlive the CTA.
        q_pipe.producer_tail(q_state)
        if cutlass.const_expr(not tile.rope_in_k):
            rope_pipe.producer_tail(g_state)

    @cute.jit
    def gather_either(self, atom: cute.CopyAtom, mData: cute.Tensor, extra_atom: Optional[cute.CopyAtom],
                      mExtraData: Optional[cute.Tensor], in_extra, coords, sDst: cute.Tensor, cols: cutlass.Constexpr,
                      bar):
        """:meth:`issue_gather4` through the main cache's map, or the extra pool's where ``in_extra``
        (a warp-uniform branch; no branch without the extra pool)."""
        if cutlass.const_expr(extra_atom is None):
            self.issue_gather4(atom, mData, coords, sDst, cols, bar)
        else:
            if in_extra:
                self.issue_gather4(extra_atom, mExtraData, coords, sDst, cols, bar)
            else:
                self.issue_gather4(atom, mData, coords, sDst, cols, bar)

    @cute.jit
    def issue_gather4(self, atom: cute.CopyAtom, mData: cute.Tensor, coords, sDst: cute.Tensor, cols: cutlass.Constexpr,
                      bar):
        """8 x ``tile::gather4`` (4 rows each) of one 32-token tile; coordinates read from shared memory."""
        gI = cute.make_tensor(coords, cute.make_layout((TILE.tokens, cols), stride=(1, 0)))
        tS, tG, tI = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(sDst, 0, 2),
            [cute.zipped_divide(mData, (TILE.tokens, cols)), cute.zipped_divide(gI, (TILE.tokens, cols))],
        )
        cute.copy(atom, [tG[None, 0], tI[None, 0]], tS, tma_bar_ptr=bar)

    # ------------------------------------------------------------------------------ DEQUANT warpgroup
    @cute.jit
    def dequant_role(self, cta: "Cta", g: "Gmem", smem: "Smem", pipes: "Pipes"):
        """Raw fp8 rows -> bf16 K tile. Lane = token, warp w of the group = dims [128 w, 128 w + 128)
        (V3.2: exactly one fp32 scale from the row; V4: :meth:`dequant_role_rope_in_k`). Reads are
        conflict-free 16-B loads; writes follow SW128."""
        tile = self.tile
        sched, storage, raw_pipe, k_pipe = cta.sched, smem.storage, pipes.raw, pipes.kbuf
        lane = cute.arch.lane_idx()
        dw = cute.arch.make_warp_uniform(cute.arch.warp_idx()) - Warp.DEQUANT
        raw_base = ptx.smem_addr(storage.sRaw.data_ptr())
        k_base = ptx.smem_addr(storage.sK.data_ptr())
        g_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.gather)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.kbuf)
        for req in cutlass.range(sched.begin_req, sched.end_req + 1, unroll=1):
            t0, t1, topk_len, _, _ = sched.request_tiles(req, g)
            for t in cutlass.range(t0, t1, unroll=1):
                raw_pipe.consumer_wait(g_state)
                row = raw_base + g_state.index * tile.raw_stage_bytes + lane * tile.raw_row_bytes
                words = cute.make_rmem_tensor(cute.make_layout(32), Int32)
                for k in cutlass.range_constexpr(8):
                    self.load_words(words, k, row + dw * 128 + k * 16)
                scale_bits = ptx.ld_shared_i32(row + tile.scale_offset + dw * 4)
                # Invalid tokens were zero-filled by the TMA (coordinate -1): scale 0, fp8 0 -> K = 0.
                cute.arch.sync_warp()
                raw_pipe.consumer_release(g_state)
                g_state.advance()

                k_pipe.producer_acquire(k_state)
                k_stage = k_base + k_state.index * (tile.k_stage_elems * 2)
                for k in cutlass.range_constexpr(8):  # 16 dims = 4 words = two 16-B chunks per step
                    self.dequant_store(tile.fmt.dequant, words, k, scale_bits, k_stage, lane, 128 * dw + 16 * k)
                # Generic-proxy writes -> visible to the tensor core (async proxy) before the arrive.
                cute.arch.fence_view_async_shared()
                k_pipe.producer_commit(k_state)
                k_state.advance()
        # The MMA warp frees K stages with tcgen05.commit after PV: wait for the last arrives (see gather_role).
        k_pipe.producer_tail(k_state)

    @cute.jit
    def dequant_role_rope_in_k(self, cta: "Cta", g: "Gmem", smem: "Smem", pipes: "Pipes"):
        """V4 (V includes RoPE, scales in scale rows): warp w writes K column blocks 2w and 2w + 1,
        each 64 NoPE dims with one ue8m0 scale, except the last block (w = 3, the second one), which
        is the tile's RoPE: the gathered SW128 RoPE rows copied verbatim (both tiles are 128-B SW128
        rows over 1024-B aligned bases, so row t's 128 bytes keep their places). Scales come from the
        index stage the INDEX warp filled (zeros for an invalid token, whose fp8 and RoPE bytes the
        TMA zero-filled: K = V = 0)."""
        tile = self.tile
        dq = tile.fmt.dequant
        sched, storage = cta.sched, smem.storage
        raw_pipe, rope_pipe, idx_pipe, k_pipe = pipes.raw, pipes.rope, pipes.index, pipes.kbuf
        lane = cute.arch.lane_idx()
        dw = cute.arch.make_warp_uniform(cute.arch.warp_idx()) - Warp.DEQUANT
        rope_warp = dw == tile.nope_chunks // 2  # its second column block is the RoPE block
        two_nope_blocks = dw < tile.nope_chunks // 2
        raw_base = ptx.smem_addr(storage.sRaw.data_ptr())
        rope_base = ptx.smem_addr(storage.sRope.data_ptr())
        scale_base = ptx.smem_addr(storage.scales.data_ptr()) + lane * (4 * tile.scale_words)
        k_base = ptx.smem_addr(storage.sK.data_ptr())
        g_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.gather)
        i_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.index)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.kbuf)
        for req in cutlass.range(sched.begin_req, sched.end_req + 1, unroll=1):
            t0, t1, _, _, _ = sched.request_tiles(req, g)
            for t in cutlass.range(t0, t1, unroll=1):
                idx_pipe.consumer_wait(i_state)
                sw = [ptx.ld_shared_i32(scale_base + i_state.index * (TILE.tokens * 4 * tile.scale_words) + 4 * j)
                      for j in range(tile.scale_words)]
                raw_pipe.consumer_wait(g_state)
                row = raw_base + g_state.index * tile.raw_stage_bytes + lane * tile.raw_row_bytes
                words = cute.make_rmem_tensor(cute.make_layout(32), Int32)
                for k in cutlass.range_constexpr(8):  # the warp's 128 fp8 bytes (64 on the RoPE warp)
                    if cutlass.const_expr(k < 4):
                        self.load_words(words, k, row + dw * 128 + k * 16)
                    else:
                        if two_nope_blocks:
                            self.load_words(words, k, row + dw * 128 + k * 16)
                cute.arch.sync_warp()
                raw_pipe.consumer_release(g_state)
                if lane == 0:
                    idx_pipe.consumer_release(i_state)
                i_state.advance()
                s0, s1 = self.warp_scales(dq, sw, dw)

                k_pipe.producer_acquire(k_state)
                k_stage = k_base + k_state.index * (tile.k_stage_elems * 2)
                for k in cutlass.range_constexpr(4):  # first column block: 4 steps of 16 dims
                    self.dequant_store(dq, words, k, s0, k_stage, lane, 128 * dw + 16 * k)
                if rope_warp:
                    # RoPE row ``lane`` (128 B) -> the K tile's last column block, 16 B at a time
                    rope_pipe.consumer_wait(g_state)
                    src = rope_base + g_state.index * (tile.rope_stage_elems * 2) + lane * (tile.chunk * 2)
                    dst = k_stage + rope_row_byte(tile, lane)
                    for k in cutlass.range_constexpr(8):
                        v = ptx.ld_shared_v4(src + k * 16)
                        ptx.st_shared_v4(dst + k * 16, ptx.vec_elem(v, 0), ptx.vec_elem(v, 1), ptx.vec_elem(v, 2),
                                         ptx.vec_elem(v, 3))
                    cute.arch.sync_warp()
                    rope_pipe.consumer_release(g_state)
                else:
                    for k in cutlass.range_constexpr(4, 8):
                        self.dequant_store(dq, words, k, s1, k_stage, lane, 128 * dw + 16 * k)
                g_state.advance()
                # Generic-proxy writes -> visible to the tensor core (async proxy) before the arrive.
                cute.arch.fence_view_async_shared()
                k_pipe.producer_commit(k_state)
                k_state.advance()
        # The MMA warp frees K stages with tcgen05.commit after PV: wait for the last arrives (see gather_role).
        k_pipe.producer_tail(k_state)

    @cute.jit
    def warp_scales(self, dq, sw, dw: Int32):
        """(scale bits of column block 2 dw, of block 2 dw + 1) from a token's loaded scale words
        (the format's ``scale_bits``; the second is unused on the RoPE warp)."""
        tile = self.tile
        bits = [dq.scale_bits(sw, k) for k in range(tile.fmt.num_groups)]
        s0 = Int32(0)
        s1 = Int32(0)
        for w in cutlass.range_constexpr(WARPS.dequant_warps):
            s0 = ptx.select_i32(dw == w, bits[dq.scale_index(2 * w * tile.chunk)], s0)
            if cutlass.const_expr(2 * w + 1 < tile.nope_chunks):
                s1 = ptx.select_i32(dw == w, bits[dq.scale_index((2 * w + 1) * tile.chunk)], s1)
        return s0, s1

    @cute.jit
    def load_words(self, words, k: cutlass.Constexpr, addr: Int32):
        """``words[4 k : 4 k + 4]`` <- the 16 fp8 bytes at shared address ``addr`` (one 16-B load)."""
        v = ptx.ld_shared_v4(addr)
        for e in cutlass.range_constexpr(4):
            words[4 * k + e] = ptx.vec_elem(v, e)

    @cute.jit
    def dequant_store(self, dq, words, k: cutlass.Constexpr, scale_bits: Int32, k_stage: Int32, lane: Int32, d: Int32):
        """16 dims (``words[4 k : 4 k + 4]``, fp8) -> bf16(fp8 * scale) at K[lane, d : d + 16]."""
        out = []
        for e in cutlass.range_constexpr(4):
            lo, hi = dq.exact(words[4 * k + e], scale_bits)
            out.append(lo)
            out.append(hi)
        ptx.st_shared_v4(k_stage + k_tile_byte(lane, d), out[0], out[1], out[2], out[3])
        ptx.st_shared_v4(k_stage + k_tile_byte(lane, d + 8), out[4], out[5], out[6], out[7])

    # ------------------------------------------------------------------------------ MMA warp
    @cute.jit
    def mma_role(self, cta: "Cta", g: "Gmem", smem: "Smem", pipes: "Pipes", qk_mma: cute.TiledMma,
                 pv_mma: cute.TiledMma, tmem_ptr):
        """QK(i) is issued before PV(i-1), so the tensor core computes the next S while the softmax
        warpgroup works on the current one (two S stages in TMEM)."""
        sched = cta.sched
        sQ, sK, sRope, sP, sV = smem.sQ, smem.sK, smem.sRope, smem.sP, smem.sV
        q_pipe, rope_pipe, k_pipe, s_pipe, p_pipe = pipes.q, pipes.rope, pipes.kbuf, pipes.s, pipes.p
        tCrQ = qk_mma.make_fragment_A(sQ)  # (MMA, 1, 36, 1)
        tCrK = qk_mma.make_fragment_B(sK)  # (MMA, 1, 32, kbuf)
        tCrR = qk_mma.make_fragment_B(sRope)  # (MMA, 1, 4, gather)
        tOrP = pv_mma.make_fragment_A(sP)  # (MMA, 1, 2, 1)
        tOrV = pv_mma.make_fragment_B(sV)  # (MMA, 1, 2, half, kbuf)
        s_layout = qk_mma.make_fragment_C(qk_mma.partition_shape_C((TILE.heads, TILE.tokens))).layout
        o_layout = pv_mma.make_fragment_C(pv_mma.partition_shape_C((TILE.heads, TILE.half_v))).layout
        rope_tile = not self.tile.rope_in_k  # V3.2: QK reads the RoPE tile; V4: RoPE is in the K tile
        n_nope_k = self.tile.k_dims // 16  # k-steps over the K tile (V4: its last 4 are RoPE)
        n_rope_k = self.tile.qk_rope_steps

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.q)
        g_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.gather)
        kq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.kbuf)
        kp_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.kbuf)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.s)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.p)
        for req in cutlass.range(sched.begin_req, sched.end_req + 1, unroll=1):
            t0, t1, topk_len, _, _ = sched.request_tiles(req, g)
            n = t1 - t0
            # An empty range (possible only with a schedule that disagrees with the call) gets no Q,
            # no tile and no PV here, as in every other role (_Sched.request_tiles).
            if n > 0:
                q_pipe.consumer_wait(q_state)
                for i in cutlass.range(n, unroll=1):
                    # ---- S = Q K^T for tile i
                    k_pipe.consumer_wait(kq_state)
                    if cutlass.const_expr(rope_tile):
                        rope_pipe.consumer_wait(g_state)
                    s_pipe.producer_acquire(s_state)
                    tcgen05_fence_after_thread_sync()  # the softmax's tcgen05.ld of this stage is ordered before
                    tStS = cute.make_tensor(tmem_ptr + TMEM.s_col + s_state.index * TMEM.s_cols, s_layout)
                    for kb in cutlass.range_constexpr(n_nope_k):
                        qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                        cute.gemm(qk_mma, tStS, tCrQ[None, None, kb, 0], tCrK[None, None, kb, kq_state.index], tStS)
                    for kb in cutlass.range_constexpr(n_rope_k):
                        qk_mma.set(tcgen05.Field.ACCUMULATE, True)
                        cute.gemm(qk_mma, tStS, tCrQ[None, None, n_nope_k + kb, 0], tCrR[None, None, kb, g_state.index],
                                  tStS)
                    s_pipe.producer_commit(s_state)
                    if cutlass.const_expr(rope_tile):
                        rope_pipe.consumer_release(g_state)
                    if i == n - 1:
                        q_pipe.consumer_release(q_state)
                    s_state.advance()
                    g_state.advance()
                    kq_state.advance()
                    # ---- O += P V for tile i - 1
                    if i > 0:
                        pv_mma = self.issue_pv(pv_mma, tOrP, tOrV, tmem_ptr, o_layout, i > 1, kp_state, p_state, k_pipe,
                                               p_pipe)
                        kp_state.advance()
                        p_state.advance()
                pv_mma = self.issue_pv(pv_mma, tOrP, tOrV, tmem_ptr, o_layout, n > 1, kp_state, p_state, k_pipe,
                                       p_pipe)
                kp_state.advance()
                p_state.advance()
                q_state.advance()

    @cute.jit
    def issue_pv(self, pv_mma: cute.TiledMma, tOrP: cute.Tensor, tOrV: cute.Tensor, tmem_ptr, o_layout: cute.Layout,
                 accumulate, kp_state, p_state, k_pipe, p_pipe):
        """Both O halves (N=256 each, lanes 0-15 / 16-31 of each slab) += P V; then release P and K.
        ``accumulate`` is False for the request's first tile: O starts from P V (no zeroing pass, and
        the previous request's O, already read by the epilogue, is overwritten)."""
        p_pipe.consumer_wait(p_state)
        tcgen05_fence_after_thread_sync()  # O may have been rescaled by the softmax warps (tcgen05.st)
        for h in cutlass.range_constexpr(2):
            tOtO = cute.make_tensor(tmem_ptr + TMEM.o_col + h * TMEM.o_upper_lane_offset, o_layout)
            for kb in cutlass.range_constexpr(TILE.tokens // 16):
                if cutlass.const_expr(kb == 0):
                    pv_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
                else:
                    pv_mma.set(tcgen05.Field.ACCUMULATE, True)
                cute.gemm(pv_mma, tOtO, tOrP[None, None, kb, 0], tOrV[None, None, kb, h, kp_state.index], tOtO)
        p_pipe.consumer_release(p_state)
        k_pipe.consumer_release(kp_state)
        # Returned so the caller rebinds it: the ACCUMULATE field is state the loop must carry.
        return pv_mma

    # ------------------------------------------------------------------------------ SOFTMAX warpgroup
    @cute.jit
    def softmax_role(self, cta: "Cta", g: "Gmem", smem: "Smem", pipes: "Pipes", boxes: "Boxes", tmem_ptr):
        """Thread (warp w, lane l) owns TMEM lane 32 w + l: row r = 16 w + l % 16 of S (lanes < 16)
        and of O, dims 256 (l // 16) + [0, 256). Row statistics live in lane l % 16; lanes >= 16
        fetch them by shuffle."""
        sched, s_idx, hg = cta
        scale_log2 = g.scale_log2
        sValid, storage = smem.sValid, smem.storage
        idx_pipe, s_pipe, p_pipe = pipes.index, pipes.s, pipes.p
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        wq = tidx // 32
        row = 16 * wq + lane % 16
        upper = lane >= 16
        src_lane = lane % 16

        # TMEM <-> registers: 32x32b.x32 = one TMEM lane per thread, 32 consecutive columns.
        view = cute.make_tensor(tmem_ptr, cute.make_layout((128, TILE.epi_cols), stride=(1 << 16, 1)))
        ld_copy = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32), view)
        st_copy = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition.x32), Float32), view)
        thr_ld = ld_copy.get_slice(tidx)
        thr_st = st_copy.get_slice(tidx)
        tL = thr_ld.partition_S(view)
        tSt = thr_st.partition_D(view)
        cS = thr_ld.partition_D(cute.make_identity_tensor((128, TILE.epi_cols)))
        rS = cute.make_rmem_tensor(cS.shape, Float32)
        rO = cute.make_rmem_tensor(cS.shape, Float32)

        p_base = ptx.smem_addr(storage.sP.data_ptr())
        epi_base = ptx.smem_addr(storage.sEpi.data_ptr())

        i_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.index)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.s)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.p)
        for req in cutlass.range(sched.begin_req, sched.end_req + 1, unroll=1):
            t0, t1, topk_len, _, _ = sched.request_tiles(req, g)
            m_run = Float32(MAX_INIT)
            l_run = Float32(0.0)
            for i in cutlass.range(t1 - t0, unroll=1):
                # ---- S tile -> registers, release the TMEM stage
                s_pipe.consumer_wait(s_state)
                tcgen05_fence_after_thread_sync()
                cute.copy(ld_copy, cute.make_tensor(tL.iterator + TMEM.s_col + s_state.index * TMEM.s_cols, tL.layout), rS)
                cute.arch.fence_view_async_tmem_load()
                tcgen05_fence_before_thread_sync()
                s_pipe.consumer_release(s_state)
                s_state.advance()
                idx_pipe.consumer_wait(i_state)
                valid = sValid[i_state.index]
                idx_pipe.consumer_release(i_state)
                i_state.advance()

                # ---- mask, scale to log2 units, row max (a thread holds its whole row)
                m_tile = -Float32.inf
                for j in cutlass.range_constexpr(cute.size(rS)):
                    col = cS[j][1]
                    ok = ((valid >> Uint32(col)) & Uint32(1)) != Uint32(0)
                    t = cutlass.select_(ok, rS[j] * scale_log2, -Float32.inf)
                    rS[j] = t
                    m_tile = cute.arch.fmax(m_tile, t)
                # Lazy rescale: keep the running max unless the tile max exceeds it by > 2^6.
                need = m_tile > m_run + Float32(LAZY_RESCALE_LOG2)
                m_new = cutlass.select_(need, m_tile, m_run)
                factor = cute.math.exp2(m_run - m_new, fastmath=True)
                row_sum = Float32(0.0)
                for j in cutlass.range_constexpr(cute.size(rS)):
                    p = cute.math.exp2(rS[j] - m_new, fastmath=True)
                    rS[j] = p
                    row_sum += p
                l_run = l_run * factor + row_sum
                m_run = m_new
                need_any = cute.arch.vote_any_sync(need & (lane < 16))
                factor_row = cute.arch.shuffle_sync(factor, src_lane)

                # ---- wait for PV(i-1): P buffer free and O stable
                p_pipe.producer_acquire(p_state)
                tcgen05_fence_after_thread_sync()
                if need_any & (i > 0):
                    for c in cutlass.range_constexpr(TMEM.o_cols // TILE.epi_cols):
                        cute.copy(ld_copy, cute.make_tensor(tL.iterator + TMEM.o_col + c * TILE.epi_cols, tL.layout), rO)
                        cute.arch.fence_view_async_tmem_load()
                        for j in cutlass.range_constexpr(cute.size(rO)):
                            rO[j] = rO[j] * factor_row
                        cute.copy(st_copy, rO, cute.make_tensor(tSt.iterator + TMEM.o_col + c * TILE.epi_cols, tSt.layout))
                    cute.arch.fence_view_async_tmem_store()
                # ---- P (bf16) -> sP row r (SW64 K-major), to the MMA warp
                if lane < 16:
                    store_p_row(p_base, row, rS)
                commit_p(p_pipe, p_state)
                p_state.advance()

            # ---- epilogue: wait for the last PV (same phase the next request's first P waits on)
            p_pipe.producer_acquire(p_state)
            tcgen05_fence_after_thread_sync()
            if t1 <= t0:
                # An empty range had no PV: O still holds the previous request's values (or was never
                # written). Zero it so that the epilogue writes what an all-invalid request gives
                # (L = 0: out 0, lse +inf; split: o_accum 0, lse_accum -inf). The next request's
                # first PV overwrites O (ACCUMULATE false).
                rO.fill(0.0)
                for c in cutlass.range_constexpr(TMEM.o_cols // TILE.epi_cols):
                    cute.copy(st_copy, rO, cute.make_tensor(tSt.iterator + TMEM.o_col + c * TILE.epi_cols, tSt.layout))
                cute.arch.fence_view_async_tmem_store()
            self.epilogue(cta, g, smem, boxes, req, row, upper, src_lane, m_run, l_run, (ld_copy, tL, rO), epi_base)

    @cute.jit
    def epilogue(self, cta: "Cta", g: "Gmem", smem: "Smem", boxes: "Boxes", req: Int32, row: Int32, upper,
                 src_lane: Int32, m_run: Float32, l_run: Float32, tmem_io, epi_base: Int32):
        """O / L (+ sink) -> bf16 ``out`` and natural-log ``lse``, or (split piece) fp32 O / L ->
        ``o_accum`` and base-2 ``lse_accum``. O leaves through TMA stores of 64 x 32 boxes."""
        sched, s_idx, hg = cta
        ld_copy, tL, rO = tmem_io
        tma_out, mOut, tma_oacc, mOAcc = g.tma_out, g.mOut, g.tma_oacc, g.mOAcc
        mAccumOffsets, mLse, mLseAcc, mSink = g.mAccumOffsets, g.mLse, g.mLseAcc, g.mSink
        out_box_layout, oacc_box_layout, storage = boxes.out_box_layout, boxes.oacc_box_layout, smem.storage
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp0 = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == Warp.SOFTMAX
        head = hg * TILE.heads + row
        l_row = cute.arch.shuffle_sync(l_run, src_lane)
        m_row = cute.arch.shuffle_sync(m_run, src_lane)
        is_split = sched.request_is_split(req)
        if cutlass.const_expr(not self.cfg.split):
            is_split = False
        empty = l_row == Float32(0.0)
        nonempty = l_row != Float32(0.0)

        o_scale = Float32(0.0)
        lse_val = Float32(0.0)
        if is_split:
            if nonempty:
                o_scale = Float32(1.0) / l_row
            lse_val = cutlass.select_(empty, -Float32.inf, cute.math.log2(l_row, fastmath=True) + m_row)
        else:
            if nonempty:
                denom = l_row
                if cutlass.const_expr(self.cfg.has_attn_sink):
                    # The sink is a logit with no value: it only enlarges the denominator.
                    denom = l_row + cute.math.exp2(mSink[head] * Float32(LOG2E) - m_row, fastmath=True)
                o_scale = Float32(1.0) / denom
            lse_val = cutlass.select_(empty, Float32.inf, (cute.math.log2(l_row, fastmath=True) + m_row) * Float32(LN2))

        half = cutlass.select_(upper, Int32(1), Int32(0))
        for c in cutlass.range_constexpr(TMEM.o_cols // TILE.epi_cols):
            cute.copy(ld_copy, cute.make_tensor(tL.iterator + TMEM.o_col + c * TILE.epi_cols, tL.layout), rO)
            cute.arch.fence_view_async_tmem_load()
            # The staging boxes are free once the previous TMA store has read them (thread 0 waited).
            cute.arch.barrier(barrier_id=Bar.EPILOGUE, number_of_threads=WARPS.softmax_threads)
            if is_split:
                # fp32 box (SW128), one per O half.
                box = epi_base + half * (TILE.heads * TILE.epi_cols * 4)
                for j in cutlass.range_constexpr(TILE.epi_cols // 4):
                    ptx.st_shared_v4(box + oacc_box_byte(row, 4 * j), ptx.f32_bits(rO[4 * j] * o_scale), ptx.f32_bits(rO[4 * j + 1] * o_scale),
                                     ptx.f32_bits(rO[4 * j + 2] * o_scale), ptx.f32_bits(rO[4 * j + 3] * o_scale))
            else:
                # bf16 box (SW64), one per O half.
                box = epi_base + half * (TILE.heads * TILE.epi_cols * 2)
                for j in cutlass.range_constexpr(TILE.epi_cols // 8):
                    w = [ptx.pack_bf16x2(rO[8 * j + 2 * e] * o_scale, rO[8 * j + 2 * e + 1] * o_scale) for e in range(4)]
                    ptx.st_shared_v4(box + out_box_byte(row, 8 * j), w[0], w[1], w[2], w[3])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=Bar.EPILOGUE, number_of_threads=WARPS.softmax_threads)
            # Warp 0 issues the two box stores (cute.copy elects one lane: elect.sync needs the whole
            # warp, so the branch is warp-uniform), then waits until the TMA has read the staging.
            if warp0:
                for h in cutlass.range_constexpr(2):
                    dchunk = (h * TILE.half_v) // TILE.epi_cols + c
                    if is_split:
                        if cutlass.const_expr(self.cfg.split):
                            acc_row = sched.split_row(req, mAccumOffsets)
                            sBox = cute.make_tensor(
                                cute.recast_ptr(storage.sEpi.data_ptr() + h * (TILE.heads * TILE.epi_cols * 4),
                                                oacc_box_layout.inner, dtype=Float32),
                                oacc_box_layout.outer,
                            )
                            gBox = cute.local_tile(mOAcc[None, None, s_idx, acc_row], (TILE.heads, TILE.epi_cols),
                                                   (hg, dchunk))
                            tS, tG = cpasync.tma_partition(tma_oacc, 0, cute.make_layout(1),
                                                           cute.group_modes(sBox, 0, 2), cute.group_modes(gBox, 0, 2))
                            cute.copy(tma_oacc, tS, tG)
                    else:
                        sBox = cute.make_tensor(
                            cute.recast_ptr(storage.sEpi.data_ptr() + h * (TILE.heads * TILE.epi_cols * 2),
                                            out_box_layout.inner, dtype=BFloat16),
                            out_box_layout.outer,
                        )
                        gBox = cute.local_tile(mOut[None, None, s_idx, req], (TILE.heads, TILE.epi_cols), (hg, dchunk))
                        tS, tG = cpasync.tma_partition(tma_out, 0, cute.make_layout(1),
                                                       cute.group_modes(sBox, 0, 2), cute.group_modes(gBox, 0, 2))
                        cute.copy(tma_out, tS, tG)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)

        if lane < 16:
            if is_split:
                if cutlass.const_expr(self.cfg.split):
                    mLseAcc[sched.split_row(req, mAccumOffsets), s_idx, head] = lse_val
            else:
                mLse[req, s_idx, head] = lse_val


class _Sched:
    """One scheduler row (``SchedField``) and the per-request tile ranges every role walks identically.

    A plain bag of Int32 values that the DSL can carry through dynamic loops; the length tensors
    come with the kernel's ``Gmem`` (:meth:`request_tiles`).
    """

    _FIELDS = ("batch", "topk", "begin_req", "end_req", "begin_blk", "end_blk", "begin_split", "first_split",
               "last_split")

    def __init__(self, *values):
        for name, v in zip(self._FIELDS, values):
            setattr(self, name, v)

    @staticmethod
    def load(mTileMd: cute.Tensor, part, batch, topk) -> "_Sched":
        F = SchedField
        begin = mTileMd[part, F.BEGIN_REQ]
        # An empty trailing partition has begin_req == b: give it an empty request range.
        end = cutlass.select_(begin < batch, mTileMd[part, F.END_REQ], begin - 1)
        return _Sched(Int32(batch), Int32(topk), begin, end, mTileMd[part, F.BEGIN_BLOCK], mTileMd[part, F.END_BLOCK],
                      mTileMd[part, F.BEGIN_SPLIT], mTileMd[part, F.FIRST_REQ_SPLIT], mTileMd[part, F.LAST_REQ_SPLIT])

    def __extract_mlir_values__(self):
        return [Int32(getattr(self, n)).ir_value() for n in self._FIELDS]

    def __new_from_mlir_values__(self, values):
        return _Sched(*[Int32(v) for v in values])

    @cute.jit
    def request_tiles(self, req: Int32, g: "Gmem"):
        """(first tile, end tile, valid top-k length, first extra tile, valid extra length) of ``req``
        in this partition. A request's blocks are its main list's (``blocks_of_length``), then its
        extra list's (``extra_blocks_of_length``; none without the extra pool): tile t reads main
        positions [32 t, 32 t + 32) below the first extra tile, extra positions from 32 (t - first
        extra tile) at and past it.

        An empty range (end tile <= first tile) never comes from the scheduler (every piece it cuts
        holds at least one block); it comes from a schedule that disagrees with the call: the
        first request's first block and the last request's end block are the schedule's, every
        other end is the request's block count from this call's ``topk_length``. Every role then skips the request the same way: no Q
        (GATHER), no tile (INDEX, GATHER, DEQUANT), no QK or PV (MMA), and the SOFTMAX warpgroup
        writes it as an all-invalid request (out 0, lse +inf; a split piece o_accum 0, lse_accum
        -inf), which is also what the SM90 kernel writes for such a range. Skipped rather than
        trapped (FlashMLA's MMA warp traps): a trap leaves the CUDA context unusable for every later
        call of the process, and it would flag only the empty case of a disagreeing schedule, not a
        range that is merely wrong; that check needs the schedule's lengths, on the host."""
        mTopkLen, mExtraIdx, mExtraLen = g.mTopkLen, g.mExtraIdx, g.mExtraLen
        topk_len = self.topk
        nblk = self.topk // TILE.sched_block
        if cutlass.const_expr(mTopkLen is not None):
            # positions at or past topk_len are invalid (a negative length: all of them)
            topk_len, nblk = blocks_of_length(mTopkLen[req], self.topk, cutlass.min, cutlass.max)
        n_main = nblk
        extra_len = Int32(0)
        if cutlass.const_expr(mExtraIdx is not None):
            extra_topk = Int32(mExtraIdx.shape[2])
            extra_len = extra_topk
            n_extra = extra_topk // TILE.sched_block
            if cutlass.const_expr(mExtraLen is not None):
                extra_len, n_extra = extra_blocks_of_length(mExtraLen[req], extra_topk, cutlass.min, cutlass.max)
            nblk = n_main + n_extra
        start = cutlass.select_(req == self.begin_req, self.begin_blk, Int32(0))
        stop = cutlass.select_(req == self.end_req, self.end_blk, nblk)
        return (start * TILE.tiles_per_block, stop * TILE.tiles_per_block, topk_len, n_main * TILE.tiles_per_block,
                extra_len)

    @cute.jit
    def request_is_split(self, req: Int32):
        return ((req == self.begin_req) & (self.first_split != 0)) | ((req == self.end_req) & (self.last_split != 0))

    @cute.jit
    def split_row(self, req: Int32, mAccumOffsets: cute.Tensor):
        return mAccumOffsets[req] + cutlass.select_(req == self.begin_req, self.begin_split, Int32(0))


# --------------------------------------------------------------------------------------------------
# Compile and launch
# --------------------------------------------------------------------------------------------------


Kernel = Sm100SparseDecodeKernel   # the registry's protocol: the object compiled, whose __call__ is the host entry

# The compiled entry's tensor parameters (SparseDecodeTensors fields), in order: the host entry's
# signature, the fake arguments and the launch all follow it (tests/test_registry.py checks the first).
ENTRY = ("q", "k_cache", "indices", "topk_length", "attn_sink", "tile_md", "accum_offsets", "out", "lse", "o_accum",
         "lse_accum", "extra_k_cache", "extra_indices", "extra_topk_length")
_entry_of = entry_getter(ENTRY)


def _fake_args(cfg: Sm100SparseDecodeConfig) -> list:
    """Fake tensors with symbolic dims (shared where the launch must agree) for the CPU compile, in
    ``ENTRY`` order (None for an absent optional one)."""
    b, s_q, topk, nblk, page, parts, b1, rows = (cute.sym_int() for _ in range(8))
    h = cfg.h_q
    tile = cfg.tile
    i64 = lambda d: cute.sym_int64(divisibility=d)  # noqa: E731
    f = {}
    f["q"] = make_fake_tensor(BFloat16, (b, s_q, h, cfg.d_qk), stride=(i64(8), i64(8), i64(8), 1), assumed_align=16)
    f["k_cache"] = make_fake_tensor(Uint8, (nblk, page, tile.row_bytes), stride=(i64(16), tile.row_bytes, 1),
                                    assumed_align=16)
    f["indices"] = make_fake_tensor(Int32, (b, s_q, topk), stride=(i64(1), i64(1), 1), assumed_align=4)
    if cfg.has_topk_length:
        f["topk_length"] = make_fake_tensor(Int32, (b,), stride=(1,), assumed_align=4)
    if cfg.has_attn_sink:
        f["attn_sink"] = make_fake_tensor(Float32, (h,), stride=(1,), assumed_align=4)
    f["tile_md"] = make_fake_tensor(Int32, (parts, SCHED_ROW_INTS), stride=(SCHED_ROW_INTS, 1), assumed_align=16)
    f["accum_offsets"] = make_fake_tensor(Int32, (b1,), stride=(1,), assumed_align=4)
    f["out"] = make_fake_tensor(BFloat16, (b, s_q, h, cfg.d_v), stride=(i64(8), i64(8), i64(8), 1), assumed_align=16)
    f["lse"] = make_fake_tensor(Float32, (b, s_q, h), stride=(i64(1), i64(1), 1), assumed_align=4)
    if cfg.split:
        f["o_accum"] = make_fake_tensor(Float32, (rows, s_q, h, cfg.d_v), stride=(i64(4), i64(4), i64(4), 1),
                                        assumed_align=16)
        f["lse_accum"] = make_fake_tensor(Float32, (rows, s_q, h), stride=(i64(1), i64(1), 1), assumed_align=4)
    if cfg.has_extra:
        # its own blocks, page size and stride(0); the requests and tokens are the call's
        nblk_e, page_e, topk_e = (cute.sym_int() for _ in range(3))
        f["extra_k_cache"] = make_fake_tensor(Uint8, (nblk_e, page_e, tile.row_bytes),
                                              stride=(i64(16), tile.row_bytes, 1), assumed_align=16)
        f["extra_indices"] = make_fake_tensor(Int32, (b, s_q, topk_e), stride=(i64(1), i64(1), 1), assumed_align=4)
        if cfg.has_extra_topk_length:
            f["extra_topk_length"] = make_fake_tensor(Int32, (b,), stride=(1,), assumed_align=4)
    return fake_entry(ENTRY, f)


def compile(cfg: Sm100SparseDecodeConfig, dump_dir: Optional[str] = None) -> CompiledKernel:
    """Compile (once per config) the SM100 sparse decode kernel. Needs no GPU."""
    assert smem_bytes(cfg) <= SMEM_LIMIT, f"shared memory {smem_bytes(cfg)} B > {SMEM_LIMIT} B"
    assert tmem_columns(cfg) <= TMEM_COLUMNS

    def build(dump: Optional[str]):
        return cute.compile(Sm100SparseDecodeKernel(cfg), *_fake_args(cfg), Float32(1.0),
                            make_fake_stream(use_tvm_ffi_env_stream=True), options=compile_options(cfg.arch, dump))

    return compile_cached(cfg.cache_key, build, dump_dir)


def launch(compiled: CompiledKernel, cfg: Sm100SparseDecodeConfig, t: SparseDecodeTensors) -> None:
    """Run the kernel on torch's current stream. No sync, no allocation.

    ``t``: the call's :class:`~cute_mla.kernels.SparseDecodeTensors`; ``t.accum_offsets`` is the
    accumulator row prefix sum (split row = ``accum_offsets[r] + begin_split_idx`` for the
    partition's first request). Shapes, dtypes, devices and base alignment are checked by the
    compiled function itself (TVM-FFI names a bad argument); checked here is what it cannot see.
    """
    _check_launch(cfg, t)
    compiled.fn(*_entry_of(t), float(t.softmax_scale))


def _check_launch(cfg: Sm100SparseDecodeConfig, t: SparseDecodeTensors) -> None:
    what = "sm100 sparse decode"
    if cfg.has_topk_length != (t.topk_length is not None):
        raise ValueError(f"{what}: compiled with has_topk_length={cfg.has_topk_length}, "
                         f"got topk_length={'a tensor' if t.topk_length is not None else None}")
    if cfg.has_attn_sink != (t.attn_sink is not None):
        raise ValueError(f"{what}: compiled with has_attn_sink={cfg.has_attn_sink}, "
                         f"got attn_sink={'a tensor' if t.attn_sink is not None else None}")
    if cfg.split != (t.o_accum is not None) or cfg.split != (t.lse_accum is not None):
        raise ValueError(f"{what}: the {'split' if cfg.split else 'no-split'} variant "
                         f"{'needs' if cfg.split else 'takes no'} o_accum / lse_accum")
    _check_cache(what, "k_cache", t.k_cache, cfg.tile)
    if t.indices.shape[-1] % TILE.sched_block:
        raise ValueError(f"{what}: topk must be a multiple of {TILE.sched_block}, got {t.indices.shape[-1]}")
    _check_extra(what, cfg, t)
    md = t.tile_md
    if md.dim() != 2 or md.shape[1] != SCHED_ROW_INTS or not md.is_contiguous():
        raise ValueError(f"{what}: tile_md must be a contiguous (P, {SCHED_ROW_INTS}) int32 tensor, got {tuple(md.shape)}")
    if md.shape[0] > archs.MAX_GRID_Y:
        raise ValueError(f"{what}: {md.shape[0]} partitions exceed grid.y ({archs.MAX_GRID_Y})")
    for name, x in (("q", t.q), ("out", t.out)):
        if x.stride(-1) != 1 or any(st % 8 for st in x.stride()[:-1]):
            raise ValueError(f"{what}: {name} needs stride(-1) == 1 and other strides % 8 == 0 "
                             f"(16-byte TMA strides), got {tuple(x.stride())}")
    if t.lse.stride(-1) != 1 or t.indices.stride(-1) != 1:
        raise ValueError(f"{what}: lse and indices need a contiguous last dim")
    if cfg.split and (t.o_accum.stride(-1) != 1 or any(st % 4 for st in t.o_accum.stride()[:-1])
                      or t.lse_accum.stride(-1) != 1):
        raise ValueError(f"{what}: o_accum needs stride(-1) == 1 and 16-byte strides; lse_accum a contiguous last dim")


def _check_cache(what: str, name: str, kv, tile: Tile) -> None:
    """A cache the gather4 maps can see as a 2-D table of data rows (``tma_row_bytes`` apart)."""
    row, pitch = tile.row_bytes, tile.tma_row_bytes
    if kv.dim() != 3 or kv.stride(1) != row or kv.stride(2) != 1 or kv.stride(0) % pitch:
        raise ValueError(f"{what}: {name} must be (num_blocks, page_block_size, {row}) uint8 with stride(1) == {row} "
                         f"and stride(0) % {pitch} == 0 (a 2-D table of rows for the gather4 TMA), got strides {tuple(kv.stride())}")
    if tile.scales_in_index and kv.stride(0) < kv.shape[1] * row:
        raise ValueError(f"{what}: {name} stride(0) {kv.stride(0)} does not hold a page block "
                         f"({kv.shape[1]} x {row} bytes: data rows, then scale rows)")
    if kv.shape[0] * (kv.stride(0) // pitch) >= 2**31:
        raise ValueError(f"{what}: {name} has more than 2^31 - 1 rows of {pitch} bytes (TMA coordinates are int32)")


def _check_extra(what: str, cfg: Sm100SparseDecodeConfig, t: SparseDecodeTensors) -> None:
    """The extra pool's tensors against the compiled variant."""
    given = t.extra_k_cache is not None and t.extra_indices is not None
    if cfg.has_extra != given or (not cfg.has_extra and t.extra_topk_length is not None):
        raise ValueError(f"{what}: compiled with has_extra={cfg.has_extra}, got extra_k_cache / extra_indices="
                         f"{'tensors' if given else 'None'}")
    if cfg.has_extra_topk_length != (t.extra_topk_length is not None):
        raise ValueError(f"{what}: compiled with has_extra_topk_length={cfg.has_extra_topk_length}, "
                         f"got extra_topk_length={'a tensor' if t.extra_topk_length is not None else None}")
    if not cfg.has_extra:
        return
    _check_cache(what, "extra_k_cache", t.extra_k_cache, cfg.tile)
    ei = t.extra_indices
    if ei.dim() != 3 or tuple(ei.shape[:2]) != tuple(t.indices.shape[:2]) or ei.stride(-1) != 1:
        raise ValueError(f"{what}: extra_indices must be (b, s_q, extra_topk) like indices with a contiguous last dim, "
                         f"got shape {tuple(ei.shape)}, strides {tuple(ei.stride())}")
    if ei.shape[-1] % TILE.sched_block:
        raise ValueError(f"{what}: extra_topk must be a multiple of {TILE.sched_block}, got {ei.shape[-1]}")
