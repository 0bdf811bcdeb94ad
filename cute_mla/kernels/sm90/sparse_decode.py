"""SM90 (Hopper, sm_90a) sparse MLA decode main kernel for the DeepSeek V3.2 FP8 cache (656-B rows).

One CTA = 64 query heads of one query token for one scheduler partition. It walks the partition's
requests (``tile_md`` row) and, inside each request, 64-token K tiles. With
``Tuning.compact_indices`` (default) a tile holds 64 *valid* tokens of the request's positions in
this partition (masked -1, out-of-range and past-``topk_length`` entries are dropped by the
producer's index scan, ``sparse_decode_scan.py``), so a request costs ``max(1, ceil(valid/64))``
tiles, never more than its 64-position blocks; otherwise tile n is block n.

Warp-group roles (384 threads, FlashMLA's SM90 split; see shared/reference/sm90-building-blocks.md):

* WG0 ``SOFTMAX``: S = Q K^T with 36 SS wgmma 64x64x16 (K-major Q and K tiles, 576 dims), masks
  invalid tokens to -inf, online softmax in the log2 domain, keeps bf16 P in registers for the RS
  wgmma P V[:, 0:256] into its half of O, and hands P + the per-row rescale to WG1 through smem.
* WG1 ``PV_RIGHT``: SS wgmma P V[:, 256:512] into the other half of O.
* WG2 ``PRODUCER``: scans the top-k list into a ring of valid indices, gathers the 656-B rows with
  128-bit ``ld.global`` (``Streaming.BOTH``, default: each 16-B register slot is re-loaded with
  tile T+1's row as soon as tile T's value in it is converted; the rows of tile T+2 are
  prefetched into L2 line by line, ``prefetch.global.L2``, once tile T is handed over), dequantizes
  e4m3 -> bf16 and writes the SW128
  K-major K tile (the V tile is a transposed view of the same bytes). Two K buffers.
  Keys are bit-identical to bf16(float(fp8) * scale): power-of-two scales (FlashMLA's recipe) take
  the 4-op bit trick, any other fp32 scale the exact fp32 path (warp-uniform choice). Rounding the
  scale to bf16 instead (FlashMLA SM90) failed the cosine and lse tolerances with such scales.

Synchronisation (producer -> consumer, arrive counts):

* ``q_full`` mbarrier, count 1: WG0 warp 0 (arrive + expect_tx 73,728 B) -> TMA -> WG0.
* ``k_full[2]`` mbarriers, count 128: the 128 producer threads arrive after writing a K buffer and
  its ``tile_info`` (64-bit token mask + last-tile-of-request flag) and ``fence.proxy.async``
  (``Tuning.consumer_proxy_fence`` moves that fence behind the consumers' wait) -> WG0 and WG1
  wait (same phase), read ``tile_info`` and end the request's loop on the last-tile flag.
* ``k_free[2]`` mbarriers, count 256: every WG0 and WG1 thread arrives once its last wgmma reading the
  buffer has retired (and it has read the buffer's ``tile_info``) -> the producer waits before
  overwriting either (first use passes: parity starts at 1).
* named barrier ``INDEX_SCAN`` (128, producer only): the index scan's warp counts and ring writes.
* h_q = 128 with ``Tuning.crossover``, or h_q = 64 split in a column pair (cluster of 2,
  ``sparse_decode_crossover.py``): ``k_full``
  count 129 (+ producer thread 0's ``arrive.expect_tx`` of the peer's 36,864 B, completed by the
  peer's bulk copies); ``peer_free[2]`` mbarriers, count 1, peer producer -> local producer ("you
  may write into my buffer b"); named barrier ``XOVER_HALF`` (128, producer only, HALF_COPY); cluster
  barriers after the mbarrier init (relaxed arrive: ``fence.mbarrier_init`` releases the inits) and
  before exit.
* named barrier ``P_READY`` (256): WG0 arrives after writing sP / row_scale (+ fence) -> WG1 syncs.
* named barrier ``P_FREE`` (256): WG1 arrives once it no longer reads sP / row_scale -> WG0 syncs
  before overwriting them. WG1 arrives once up front; WG0 syncs once more at the very end.
* named barrier ``Q_FREE`` (256): WG1 arrives when its output TMA store has finished reading the
  staging area (which aliases sQ) -> WG0 syncs before loading the next request's Q. WG0 syncs
  once more at the end.
* named barriers ``EPI_SOFTMAX`` / ``EPI_PV_RIGHT`` (128): staging written -> TMA store issued by the
  warp group's first warp, and store read done -> staging reusable.

Shared memory: barriers, tile_info, scan counts, row factors and the 1 KiB index ring 2 KiB + Q
72 KiB + 2 K buffers 144 KiB + P 8 KiB = 231,424 B of 232,448. The output staging (bf16 64x256,
64x128 in the column pair, or fp32 64x128 per warp group at a time) aliases the Q buffer, which is
free between the last QK of a request and the next request's Q load.
Outputs: bf16 ``out`` by TMA store (+ natural-log ``lse``) for requests whole in the partition;
``o_accum`` = O/L (fp32, or bf16 as the plan's ``accum_dtype`` picks on SM90: staged and stored as
out is) by TMA store (the split variant's extra tensor map; or straight from registers where the
plan picks ``oacc_from_registers``) + base-2 fp32 ``lse_accum`` for split pieces. Every CTA
signals ``griddepcontrol.launch_dependents`` at its start, so the combine (launched with PDL)
is scheduled early and waits for this grid in ``griddepcontrol.wait``.

Measured on one H200 (CUDA-graph replay of the public API at af2f72e, 20 % of the indices -1,
benchmarks/results/h200-af2f72e.*): b=1, s_q=8192, h=64, topk=2048: 5,401 us (FlashMLA 6,919 us);
b=128, s_q=2, h=128: 333.3 us (FlashMLA 408.9 us). History and the measured knobs:
benchmarks/NOTES.md.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..combine import accum_type
from ..compat import LayoutEnum, OperandMajorMode, SmemAllocator, setmaxregister_decrease, setmaxregister_increase
from ..compat import sm90_utils
from ..compile import CompiledKernel, compile_cached, compile_options
from . import ptx
from .sparse_decode_common import (DEFAULT_TUNING, REGS, TILE, Bar, Crossover, Role, ScheduleMixin, Sm90SparseDecodeConfig,
                                   Stamp, Streaming, Tuning)
from .sparse_decode_crossover import CrossoverMixin
from .sparse_decode_epilogue import LOG2E, EpilogueMixin
from .sparse_decode_producer import ProducerMixin
from .sparse_decode_scan import IndexScanMixin

__all__ = ["Sm90SparseDecodeConfig", "Sm90SparseDecodeKernel", "Crossover", "Streaming", "Tuning", "DEFAULT_TUNING", "REGS", "compile_sparse_decode",
           "launch_sparse_decode"]


class Sm90SparseDecodeKernel(ScheduleMixin, ProducerMixin, IndexScanMixin, CrossoverMixin, EpilogueMixin):
    """The kernel object given to ``cute.compile``: host ``__call__`` (layouts, TMA atoms, grid) and device ``kernel``."""

    def __init__(self, cfg: Sm90SparseDecodeConfig, tuning: Tuning = DEFAULT_TUNING):
        self.cfg = cfg
        self.tuning = tuning
        self.n_hblk = cfg.h_q // TILE.heads
        # h_q = 128 with Tuning.crossover: the two head-half CTAs of a token form a cluster of 2 and
        # each dequantizes half of every K tile for both (sparse_decode_crossover.py).
        # h_q = 64 split with the config's (the plan's) or the Tuning's column_pair: the two
        # column-half CTAs of a piece form a cluster of 2, share the gather through the crossover
        # transport and each computes 256 of the 512 output columns. An experiment's Tuning with
        # the crossover OFF runs the plan's pair shapes as plain pieces (Tuning.column_pair itself
        # refuses crossover OFF).
        self.cpair = ((cfg.column_pair and tuning.crossover != Crossover.OFF) or tuning.column_pair) \
            and self.n_hblk == 1 and cfg.split
        self.n_cblk = 2 if self.cpair else 1  # column-half CTAs per (token, 64 heads)
        self.pv_cols = TILE.half_v // self.n_cblk  # output columns per MMA warp group
        self.xover = (tuning.crossover != Crossover.OFF and self.n_hblk == 2) or self.cpair
        # split pieces store o_accum from registers: the config's (the plan's) choice unless the
        # Tuning forces one; the column pair always does with fp32 partials. bf16 partials (the
        # config's, i.e. the plan's accum_dtype) are staged and stored by TMA as out is, in the
        # column pair too: from registers each thread's 4-byte bf16 stores fill half sectors, as
        # many as the fp32 stores fill whole (measured slower on 1x1x64, NOTES.md session
        # 2026-12-03 g)
        self.accum_bf16 = cfg.split and cfg.accum_dtype == "bfloat16"
        direct = cfg.oacc_from_registers if tuning.oacc_direct_store is None else tuning.oacc_direct_store
        self.oacc_direct = cfg.split and (direct or (self.cpair and not self.accum_bf16))
        self.out_direct = tuning.out_direct_store or self.cpair
        # WG1 converts a two-tile partition's second tile (one-CTA kernels, compacted producer)
        self.help_second = tuning.help_second_tile and tuning.compact_indices and not self.xover
        # bf16 out / o_accum blocks staged by stmatrix and stored in 64-column TMA chunks
        self.chunked = tuning.chunked_epilogue

    def consumer_fence(self):
        """With ``Tuning.consumer_proxy_fence``: the proxy fence between the producer's st.shared of a
        K tile and this thread's wgmma reads of it, right after the k_full wait (else the producer
        fenced before arriving). A plain function, inlined at trace time."""
        if self.tuning.consumer_proxy_fence:
            cute.arch.fence_view_async_shared()

    @cute.jit
    def stamp(self, slot: cutlass.Constexpr, leader):
        """``Tuning.timeline``: ``leader`` writes clock64 into this CTA's slot ``slot`` (nothing otherwise)."""
        if cutlass.const_expr(self.tuning.timeline):
            if leader:
                p = cute.make_ptr(Int64, self._stamps + int(slot) * 8, cute.AddressSpace.gmem, assumed_align=8)
                cute.arch.store(p, cute.arch.clock64())

    @cute.jit
    def store_lse_rows(self, mDst: cute.Tensor, row, s_idx, head0, lse0: Float32, lse1: Float32, quad):
        """lse (or lse_accum) of this thread's two accumulator rows: one lane per quad, in the CTA
        that writes lse (:meth:`writes_lse`)."""
        if (quad == 0) & self.writes_lse():
            mDst[row, s_idx, head0] = lse0
            mDst[row, s_idx, head0 + 8] = lse1

    @staticmethod
    def bf16_block_layout(cols: int):
        """A 64 x ``cols`` bf16 staging block in SW128 K-major atoms (rows of 128 B per 64 columns,
        64-column blocks 8 KiB apart), TMA-storable: out / bf16 o_accum staging, and with 64
        columns one chunk and TMA box of ``Tuning.chunked_epilogue``."""
        return cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16), (TILE.heads, cols), (0, 1)
        )

    def column_block(self, wg_half: int):
        """This MMA warp group's block of ``pv_cols`` output columns: its half (0 = WG0, 1 = WG1),
        within this CTA's column half in the column pair."""
        if self.cpair:
            return cute.arch.block_idx()[0] % self.n_cblk * 2 + wg_half
        return wg_half

    def writes_lse(self):
        """Whether this CTA writes lse / lse_accum (in the column pair both compute the same
        values: the first column half writes them)."""
        if self.cpair:
            return cute.arch.block_idx()[0] % self.n_cblk == 0
        return cutlass.Boolean(True)

    @staticmethod
    def heads_dims_first(t: cute.Tensor) -> cute.Tensor:
        """A (b, s_q, h, d) tensor viewed as (h, d, s_q, b): the TMA boxes tile heads x dims."""
        return cute.make_tensor(
            t.iterator,
            cute.make_layout((t.shape[2], t.shape[3], t.shape[1], t.shape[0]),
                             stride=(t.stride[2], t.stride[3], t.stride[1], t.stride[0])),
        )

    @staticmethod
    def issue_qk(qk_mma, acc_s, tSrQ, tSrK, buf):
        """S = Q K^T: 36 chained SS wgmma 64x64x16 over the 576 dims of K buffer ``buf`` (committed, not waited).

        ``qk_mma`` accumulates (ACCUMULATE set once, outside every staged region: a ``set`` inside a
        branch would leave the atom defined in that branch), so S is zeroed first.
        """
        tSrK_b = tSrK[None, None, None, buf]
        acc_s.fill(0.0)
        warpgroup.fence()
        for k in range(TILE.d_qk // 16):  # plain function: a trace-time (unrolled) loop
            cute.gemm(qk_mma, acc_s, tSrQ[None, None, k, 0], tSrK_b[None, None, k], acc_s)
        warpgroup.commit_group()

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,  # (b, s_q, h_q, 576) bf16
        kv: cute.Tensor,  # (num_blocks, page_block_size, 656) uint8
        indices: cute.Tensor,  # (b, s_q, topk) int32
        topk_length: Optional[cute.Tensor],  # (b,) int32
        attn_sink: Optional[cute.Tensor],  # (h_q,) fp32
        tile_md: cute.Tensor,  # (P, 8) int32
        num_splits: cute.Tensor,  # (b+1,) int32
        out: cute.Tensor,  # (b, s_q, h_q, 512) bf16
        lse: cute.Tensor,  # (b, s_q, h_q) fp32
        o_accum: Optional[cute.Tensor],  # (rows, s_q, h_q, 512) fp32 or bf16 (cfg.accum_dtype)
        lse_accum: Optional[cute.Tensor],  # (rows, s_q, h_q) fp32
        timeline: Optional[cute.Tensor],  # (grid x, grid y, Stamp.SLOTS) int64, Tuning.timeline only
        softmax_scale: Float32,
        stream,
    ):
        cfg = self.cfg
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), (TILE.heads, TILE.tokens)
        )
        # P V: A = P (heads x tokens, K-major), B = V = transposed view of the K tile (MN-major).
        pv_rs_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1),
            (TILE.heads, self.pv_cols), warpgroup.OperandSource.RMEM,
        )
        pv_ss_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1),
            (TILE.heads, self.pv_cols),
        )

        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE.heads, TILE.tokens, TILE.d_qk), BFloat16, 1)
        k_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (TILE.heads, TILE.tokens, TILE.d_qk), BFloat16, TILE.k_bufs
        )
        p_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE.heads, TILE.half_v, TILE.tokens), BFloat16, 1)
        # Output staging tiles (SW128 K-major atoms, TMA-storable): bf16 64x256, fp32 64x128.
        o_layout = self.bf16_block_layout(TILE.half_v)
        oacc_layout = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, Float32), (TILE.heads, TILE.half_v // 2), (0, 1)
        )
        oacc_box = (TILE.heads, TILE.half_v // 2)
        if cutlass.const_expr(self.accum_bf16):
            # bf16 partials are staged and stored as out is: one 64 x pv_cols box per warp group
            # (64 x 256; 64 x 128 in the column pair)
            oacc_box = (TILE.heads, self.pv_cols)
            oacc_layout = self.bf16_block_layout(self.pv_cols)

        # Q, out and o_accum as (h, d, s_q, b|rows) for TMA box grids of 64 heads: Q in 9 boxes of
        # 64x64 (SW128), out / o_accum in 64-head x 256 / 128-column boxes.
        tma_q, q_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), self.heads_dims_first(q), cute.slice_(q_layout, (None, None, 0)),
            (TILE.heads, TILE.d_qk)
        )
        o_box = (TILE.heads, TILE.half_v)
        if cutlass.const_expr(self.chunked):
            # Tuning.chunked_epilogue: bf16 blocks go out in 64 x 64 boxes, one per staged chunk
            o_box = (TILE.heads, TILE.chunk)
            o_layout = self.bf16_block_layout(TILE.chunk)
            if cutlass.const_expr(self.accum_bf16):
                oacc_box, oacc_layout = o_box, o_layout
        tma_out = None
        out_tma = out  # out_direct: stored from the accumulator registers, no tensor map
        if cutlass.const_expr(not self.out_direct):
            tma_out, out_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), self.heads_dims_first(out), o_layout, o_box
            )
        tma_oacc = None
        oacc_tma = None
        if cutlass.const_expr(self.oacc_direct):
            oacc_tma = o_accum  # stored straight from the accumulator registers: no tensor map
        elif cutlass.const_expr(cfg.split):
            # The accumulator tensor map exists only in the split variant.
            tma_oacc, oacc_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), self.heads_dims_first(o_accum), oacc_layout, oacc_box
            )

        @cute.struct
        class SharedStorage:
            q_full: cute.struct.MemRange[Int64, 1]
            k_full: cute.struct.MemRange[Int64, TILE.k_bufs]
            k_free: cute.struct.MemRange[Int64, TILE.k_bufs]
            peer_free: cute.struct.MemRange[Int64, TILE.k_bufs]  # crossover only: peer may write buffer b
            # Per K buffer: 64-bit token mask + last-tile-of-request flag (producer -> consumers).
            tile_info: cute.struct.Align[cute.struct.MemRange[Uint32, TILE.info_words * TILE.k_bufs], 16]
            scan_counts: cute.struct.Align[cute.struct.MemRange[Int32, 8], 16]  # producer: 2 x 4 warp counts
            help_flag: cute.struct.MemRange[Int32, 1]  # producer -> WG1: Tuning.help_second_tile applies
            row_scale: cute.struct.MemRange[Float32, TILE.heads]  # WG0 -> WG1 per-row O factor
            ring: cute.struct.Align[cute.struct.MemRange[Int32, TILE.ring_entries], 16]  # compacted indices
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(k_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(p_layout)], 1024]

        self.shared_storage = SharedStorage

        scale_log2 = softmax_scale * Float32(LOG2E)
        grid = (q.shape[1] * self.n_hblk * self.n_cblk, tile_md.shape[0], 1)
        self.kernel(
            qk_mma, pv_rs_mma, pv_ss_mma,
            tma_q, q_tma, tma_out, out_tma, tma_oacc, oacc_tma,
            kv, indices, topk_length, attn_sink, tile_md, num_splits, lse, lse_accum, timeline,
            scale_log2,
            q_layout, k_layout, p_layout, o_layout, oacc_layout,
        ).launch(grid=grid, block=[TILE.threads_per_wg * TILE.num_wgs, 1, 1], stream=stream, min_blocks_per_mp=1,
                 cluster=[2, 1, 1] if self.xover else None, use_pdl=self.tuning.pdl_wait)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_rs_mma: cute.TiledMma,
        pv_ss_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_out: cute.CopyAtom,
        mOut: cute.Tensor,
        tma_oacc: Optional[cute.CopyAtom],
        mOAcc: Optional[cute.Tensor],
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],
        mTileMd: cute.Tensor,
        mNumSplits: cute.Tensor,
        mLse: cute.Tensor,
        mLseAcc: Optional[cute.Tensor],
        mTimeline: Optional[cute.Tensor],
        scale_log2: Float32,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        p_layout: cute.ComposedLayout,
        o_layout: cute.ComposedLayout,
        oacc_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, part, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // TILE.threads_per_wg)
        s_idx = bidx // (self.n_hblk * self.n_cblk)
        hblk = bidx % self.n_hblk  # (0 in the column pair: n_hblk = 1)
        if cutlass.const_expr(self.tuning.timeline):
            # This CTA's row of stamps (a trace-time attribute: every warp group's code is inlined here).
            self._stamps = mTimeline.iterator.toint() + Int64(bidx * mTimeline.shape[1] + part) * Int64(8 * Stamp.SLOTS)
        self.stamp(Stamp.ENTRY, tidx == 0)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        q_full = storage.q_full.data_ptr()
        k_full = storage.k_full.data_ptr()
        k_free = storage.k_free.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(q_full, 1)
            for i in cutlass.range_constexpr(TILE.k_bufs):
                # Crossover: + 1 arrive.expect_tx for the bytes of the peer's bulk copies.
                cute.arch.mbarrier_init(k_full + i, TILE.threads_per_wg + (1 if self.xover else 0))
                cute.arch.mbarrier_init(k_free + i, 2 * TILE.threads_per_wg)
                if cutlass.const_expr(self.xover):
                    cute.arch.mbarrier_init(storage.peer_free.data_ptr() + i, 1)
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.tuning.pdl_wait):
            # Launched with PDL: nothing global is read or written before the kernel before us in
            # the stream has completed and flushed (the metadata load below included).
            cute.arch.griddepcontrol_wait()
        md = None
        if cutlass.const_expr(self.tuning.early_metadata):
            # Words 0-3 of the partition's row in one 16-B load (rows are 32 B, 16-B aligned),
            # issued before the prologue's barriers so its L2 round trip overlaps them (in a
            # cluster the start-up cluster barrier alone took ~680 cycles: timeline, NOTES.md).
            md = ptx.ld_global_v4(mTileMd.iterator.toint() + Int64(part) * Int64(4 * mTileMd.stride[0]), "", "")
        if cutlass.const_expr(self.xover):
            # The peer's barriers are initialised before any remote arrive / st.async reaches them:
            # fence.mbarrier_init (above) releases the inits to the cluster, so the arrive may be
            # relaxed (PTX ISA, mbarrier init visibility); the default arrive's release costs a
            # MEMBAR.ALL.GPU, which waits for the tile_md load just issued.
            if cutlass.const_expr(self.tuning.relaxed_cluster_start):
                cute.arch.cluster_arrive_relaxed()
            else:
                cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        # Programmatic dependent launch: the combine (launched with PDL after this kernel in the
        # split case) may be scheduled right away; it reads nothing before its griddepcontrol.wait,
        # which waits for this whole grid to complete and flush. Its CTAs can only take SMs this
        # grid leaves idle (a CTA here holds the whole register file), so they never delay us.
        cute.arch.griddepcontrol_launch_dependents()
        if tidx < 32:
            cpasync.prefetch_descriptor(tma_q)
            if cutlass.const_expr(not self.out_direct):
                cpasync.prefetch_descriptor(tma_out)
            if cutlass.const_expr(self.cfg.split and not self.oacc_direct):
                cpasync.prefetch_descriptor(tma_oacc)
        cute.arch.sync_threads()
        self.stamp(Stamp.PROLOGUE, tidx == 0)

        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)

        batch = mIdx.shape[0]
        topk = mIdx.shape[2]
        if cutlass.const_expr(self.tuning.early_metadata):
            begin_req = ptx.vec_elem(md, 0)
            end_req = ptx.vec_elem(md, 1)
            first_blocks = (ptx.vec_elem(md, 2), ptx.vec_elem(md, 3))   # begin_block, end_block
        else:
            begin_req = mTileMd[part, 0]
            end_req = mTileMd[part, 1]
        # An empty trailing partition has begin_req == b: nothing to do. (begin_req > end_req is
        # never emitted by the schedulers; skipping it keeps a malformed row from hanging the
        # producer's scan, which would wait for a tile that never comes.)
        if (begin_req < batch) & (begin_req <= end_req):
            self.stamp(Stamp.METADATA, tidx % TILE.threads_per_wg == 0)
            if cutlass.const_expr(self.tuning.early_metadata):
                begin_block, end_block = first_blocks
            else:
                begin_block, end_block = mTileMd[part, 2], mTileMd[part, 3]
            # begin_block: of begin_req; end_block: of end_req, exclusive; end_req: inclusive
            sched = (begin_req, end_req, begin_block, end_block)
            if wg == Role.PRODUCER:
                setmaxregister_decrease(REGS.producer)
                self.producer(mKV, mIdx, mTopkLen, sched, s_idx)
            elif wg == Role.SOFTMAX:
                setmaxregister_increase(REGS.softmax)
                self.softmax_wg(
                    qk_mma, pv_rs_mma, tma_q, mQ, tma_out, mOut, tma_oacc, mOAcc, mTopkLen, mSink,
                    mTileMd, mNumSplits, mLse, mLseAcc, scale_log2, sched, topk, s_idx, hblk, part,
                    sQ, sK, sP, o_layout, oacc_layout, storage,
                )
            else:
                setmaxregister_decrease(REGS.pv_right)
                self.pv_right_wg(
                    pv_ss_mma, tma_out, mOut, tma_oacc, mOAcc, mTopkLen, mTileMd, mNumSplits, sched, topk, s_idx, hblk, part,
                    sQ, sK, sP, o_layout, oacc_layout, storage, mKV, mIdx,
                )
        if cutlass.const_expr(self.xover):
            # Neither CTA of the pair exits while its peer may still write into its shared memory
            # or arrive on its barriers.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def k_tensors_for_pv(self, sK: cute.Tensor, col_block):
        """V[:, w*col_block : w*(col_block+1)] (w = ``pv_cols``: 256, or 128 in the column pair) of
        both K buffers as an MN-major B operand.

        V is the transposed view of the K tile: dims are contiguous inside a 128-B swizzled row
        (64 dims), 64-dim chunks are 8 KiB apart, tokens 128 B apart, buffers 72 KiB apart. This is
        the layout make_smem_layout_b(COL_MAJOR, (64, 512, 64)) prints, with the buffer stride of
        the K tiles (the helper's own stage stride would be 64 KiB).
        """
        chunks = self.pv_cols // TILE.chunk
        outer = cute.make_layout(
            ((TILE.chunk, chunks), (8, TILE.tokens // 8), TILE.k_bufs),
            stride=((1, TILE.chunk * TILE.tokens), (TILE.chunk, TILE.chunk * 8), TILE.k_tile_elems),
        )
        base = sK.iterator + col_block * chunks * TILE.chunk * TILE.tokens
        return cute.make_tensor(base, outer)

    # ---------------------------------------------------------------- WG0: QK + softmax + PV left
    @cute.jit
    def softmax_wg(
        self, qk_mma, pv_rs_mma, tma_q, mQ, tma_out, mOut, tma_oacc, mOAcc, mTopkLen, mSink,
        mTileMd, mNumSplits, mLse, mLseAcc, scale_log2: Float32, sched, topk, s_idx, hblk, part,
        sQ, sK, sP, o_layout, oacc_layout, storage,
    ):
        begin_req, end_req, begin_block, end_block = sched
        wtid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
        warp = cute.arch.make_warp_uniform(wtid // 32)
        lane = wtid % 32
        row0 = warp * 16 + lane // 4  # accumulator rows of this thread: row0 and row0 + 8
        q_full = storage.q_full.data_ptr()
        k_full = storage.k_full.data_ptr()
        k_free = storage.k_free.data_ptr()
        info_base = storage.tile_info.data_ptr().toint()
        s_row_scale = storage.row_scale.get_tensor(cute.make_layout(TILE.heads))

        # Q TMA partition: (h, d, s_q, b) -> (64, 576) boxes.
        gQ = cute.flat_divide(mQ, (TILE.heads, TILE.d_qk))
        sQ0 = sQ[None, None, 0]
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ0, 0, 2), cute.group_modes(gQ, 0, 2))

        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_rs_mma.set(warpgroup.Field.ACCUMULATE, True)
        thr_qk = qk_mma.get_slice(wtid)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        thr_pv = pv_rs_mma.get_slice(wtid)
        col = self.column_block(0)
        sV = self.k_tensors_for_pv(sK, col)
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE.heads, self.pv_cols)))
        acc_s_shape = thr_qk.partition_shape_C((TILE.heads, TILE.tokens))
        # P (bf16) in the A-operand register layout of the RS wgmma, viewed with the accumulator layout.
        acc_s = thr_qk.make_fragment_C(acc_s_shape)
        tOrP = cute.make_rmem_tensor(self.c_layout_to_a_layout(acc_s.layout, pv_rs_mma.tv_layout_A.shape[1]), BFloat16)
        tOrP_as_c = cute.make_tensor(tOrP.iterator, acc_s.layout)
        tSsP = thr_qk.partition_C(sP[None, None, 0])

        quad = lane % 4
        split_rows = (Int32(-1), Int32(-1))
        if cutlass.const_expr(self.tuning.early_metadata):
            split_rows = self.split_rows_of_partition(sched, mTileMd, mNumSplits, part)
        n = Int32(0)
        rq = Int32(0)
        for req in cutlass.range(begin_req, end_req + 1, unroll=1):
            start, stop, length = self.request_range(req, sched, mTopkLen, topk)
            if rq > 0:
                # WG1's output store of the previous request no longer reads the staging (= sQ).
                cute.arch.barrier(barrier_id=Bar.Q_FREE, number_of_threads=2 * TILE.threads_per_wg)
            if warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(q_full, TILE.heads * TILE.d_qk * 2)
                if cutlass.const_expr(self.tuning.l2_hints):
                    cute.copy(tma_q, tQgQ[None, hblk, 0, s_idx, req], tQsQ, tma_bar_ptr=q_full,
                              cache_policy=ptx.l2_policy("evict_first"))
                else:
                    cute.copy(tma_q, tQgQ[None, hblk, 0, s_idx, req], tQsQ, tma_bar_ptr=q_full)
                if cutlass.const_expr(self.tuning.prefetch_next_q):
                    if req < end_req:
                        with cute.arch.elect_one():  # (the TMA loads elect a lane themselves, prefetches do not)
                            cute.prefetch(tma_q, tQgQ[None, hblk, 0, s_idx, req + 1])
            m0 = Float32(-1e30)
            m1 = Float32(-1e30)
            l0 = Float32(0.0)
            l1 = Float32(0.0)
            acc_o.fill(0.0)
            cute.arch.mbarrier_wait(q_full, rq & 1)
            self.stamp(Stamp.Q_READY, wtid == 0)

            if cutlass.const_expr(self.tuning.overlap_qk_pv):
                if start < stop:
                    cute.arch.mbarrier_wait(k_full + n % TILE.k_bufs, (n // TILE.k_bufs) & 1)
                    self.stamp(Stamp.K_READY, wtid == 0)
                    self.consumer_fence()
                    self.issue_qk(qk_mma, acc_s, tSrQ, tSrK, n % TILE.k_bufs)
                    warpgroup.wait_group(0)
                    self.stamp(Stamp.QK_DONE, wtid == 0)
            # Compacted tiles: a request has at most stop - start tiles; the producer flags its last.
            active = start < stop
            for blk in cutlass.range(start, stop, unroll=1):
                if active:
                    buf = n % TILE.k_bufs
                    if cutlass.const_expr(not self.tuning.overlap_qk_pv):
                        cute.arch.mbarrier_wait(k_full + buf, (n // TILE.k_bufs) & 1)
                        self.consumer_fence()
                        self.issue_qk(qk_mma, acc_s, tSrQ, tSrK, buf)
                        warpgroup.wait_group(0)

                    # ---- mask + online softmax (log2 domain)
                    info = ptx.ld_shared_v4(info_base + buf * (TILE.info_words * 4))
                    w_lo = Uint32(ptx.vec_elem(info, 0)) >> Uint32(2 * quad)
                    w_hi = Uint32(ptx.vec_elem(info, 1)) >> Uint32(2 * quad)
                    last_word = ptx.vec_elem(info, 2)
                    last = last_word != 0
                    mx0 = -Float32.inf
                    mx1 = -Float32.inf
                    for v in cutlass.range_constexpr(cute.size(acc_s)):
                        group = v // 4  # 8-column group
                        bit = (v % 2) + 8 * (group % 4)
                        word = w_lo if group < 4 else w_hi
                        ok = ((word >> bit) & Uint32(1)) != Uint32(0)
                        t = Float32(cutlass.select_(ok, acc_s[v] * scale_log2, -Float32.inf))
                        acc_s[v] = t
                        if cutlass.const_expr((v // 2) % 2 == 0):
                            mx0 = cute.arch.fmax(mx0, t)
                        else:
                            mx1 = cute.arch.fmax(mx1, t)
                    mx0 = cute.arch.fmax(mx0, cute.arch.shuffle_sync_bfly(mx0, offset=1))
                    mx0 = cute.arch.fmax(mx0, cute.arch.shuffle_sync_bfly(mx0, offset=2))
                    mx1 = cute.arch.fmax(mx1, cute.arch.shuffle_sync_bfly(mx1, offset=1))
                    mx1 = cute.arch.fmax(mx1, cute.arch.shuffle_sync_bfly(mx1, offset=2))
                    new_m0 = cute.arch.fmax(m0, mx0)
                    new_m1 = cute.arch.fmax(m1, mx1)
                    sc0 = cute.math.exp2(m0 - new_m0, fastmath=True)
                    sc1 = cute.math.exp2(m1 - new_m1, fastmath=True)
                    m0 = new_m0
                    m1 = new_m1
                    sum0 = Float32(0.0)
                    sum1 = Float32(0.0)
                    for v in cutlass.range_constexpr(cute.size(acc_s)):
                        if cutlass.const_expr((v // 2) % 2 == 0):
                            p = cute.math.exp2(acc_s[v] - new_m0, fastmath=True)
                            sum0 += p
                            acc_s[v] = p
                        else:
                            p = cute.math.exp2(acc_s[v] - new_m1, fastmath=True)
                            sum1 += p
                            acc_s[v] = p
                    l0 = l0 * sc0 + sum0
                    l1 = l1 * sc1 + sum1
                    tOrP_as_c.store(acc_s.load().to(BFloat16))

                    # ---- hand P and the row factors to WG1
                    cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=2 * TILE.threads_per_wg)
                    if quad == 0:
                        s_row_scale[row0] = sc0
                        s_row_scale[row0 + 8] = sc1
                    cute.autovec_copy(tOrP_as_c, tSsP)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier_arrive(barrier_id=Bar.P_READY, number_of_threads=2 * TILE.threads_per_wg)
                    self.stamp(Stamp.P_READY, wtid == 0)

                    # ---- O_left = O_left * sc + P V[:, :256]
                    self.scale_rows(acc_o, sc0, sc1)
                    warpgroup.fence()
                    cute.gemm(pv_rs_mma, acc_o, tOrP, tOrV[None, None, None, buf], acc_o)
                    warpgroup.commit_group()
                    if cutlass.const_expr(self.tuning.overlap_qk_pv):
                        # Issue the next tile's QK behind this PV: the tensor core gets the next chain
                        # while this one drains; P (registers) and S (acc_s) are distinct registers.
                        if last:
                            warpgroup.wait_group(0)
                            cute.arch.mbarrier_arrive(k_free + buf)
                        else:
                            nbuf = (n + 1) % TILE.k_bufs
                            cute.arch.mbarrier_wait(k_full + nbuf, ((n + 1) // TILE.k_bufs) & 1)
                            self.consumer_fence()
                            self.issue_qk(qk_mma, acc_s, tSrQ, tSrK, nbuf)
                            warpgroup.wait_group(1)
                            cute.arch.mbarrier_arrive(k_free + buf)
                            warpgroup.wait_group(0)
                    else:
                        warpgroup.wait_group(0)
                        cute.arch.mbarrier_arrive(k_free + buf)
                    n += 1
                    active = last_word == 0

            # ---- epilogue of this request
            self.stamp(Stamp.PV_DONE, wtid == 0)
            l0 += cute.arch.shuffle_sync_bfly(l0, offset=1)
            l0 += cute.arch.shuffle_sync_bfly(l0, offset=2)
            l1 += cute.arch.shuffle_sync_bfly(l1, offset=1)
            l1 += cute.arch.shuffle_sync_bfly(l1, offset=2)
            is_split, acc_row = self.split_piece(req, begin_req, end_req, split_rows, mTileMd, mNumSplits, part)
            o_scale0, lse0 = self.finalize_row(l0, m0, is_split, mSink, hblk * TILE.heads + row0)
            o_scale1, lse1 = self.finalize_row(l1, m1, is_split, mSink, hblk * TILE.heads + row0 + 8)
            cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=2 * TILE.threads_per_wg)
            if quad == 0:
                s_row_scale[row0] = o_scale0
                s_row_scale[row0 + 8] = o_scale1
            cute.arch.barrier_arrive(barrier_id=Bar.P_READY, number_of_threads=2 * TILE.threads_per_wg)
            self.stamp(Stamp.EPI_FINAL, wtid == 0)
            self.scale_rows(acc_o, o_scale0, o_scale1)
            head0 = hblk * TILE.heads + row0
            # The lse stores go after the O block's (Tuning.store_lse_first: before): the block's
            # staging fences the generic proxy, which may wait for this thread's global stores.
            lse_first = self.tuning.store_lse_first
            if is_split:
                if cutlass.const_expr(self.cfg.split):
                    if cutlass.const_expr(lse_first):
                        self.store_lse_rows(mLseAcc, acc_row, s_idx, head0, lse0, lse1, quad)
                    self.store_o_accum(acc_o, thr_pv, tma_oacc, mOAcc, sQ, oacc_layout, col, warp, hblk, s_idx, acc_row, Bar.EPI_SOFTMAX)
                    if cutlass.const_expr(not lse_first):
                        self.store_lse_rows(mLseAcc, acc_row, s_idx, head0, lse0, lse1, quad)
            else:
                if cutlass.const_expr(lse_first):
                    self.store_lse_rows(mLse, req, s_idx, head0, lse0, lse1, quad)
                self.store_out(acc_o, thr_pv, tma_out, mOut, sQ, o_layout, col, warp, hblk, s_idx, req, Bar.EPI_SOFTMAX)
                if cutlass.const_expr(not lse_first):
                    self.store_lse_rows(mLse, req, s_idx, head0, lse0, lse1, quad)
            self.stamp(Stamp.EPILOGUE, wtid == 0)
            rq += 1

        # Balance the barriers WG1 arrived on once more than WG0 synced.
        cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=2 * TILE.threads_per_wg)
        cute.arch.barrier(barrier_id=Bar.Q_FREE, number_of_threads=2 * TILE.threads_per_wg)

    # ---------------------------------------------------------------- WG1: PV right
    @cute.jit
    def pv_right_wg(
        self, pv_ss_mma, tma_out, mOut, tma_oacc, mOAcc, mTopkLen, mTileMd, mNumSplits, sched, topk, s_idx, hblk, part,
        sQ, sK, sP, o_layout, oacc_layout, storage, mKV, mIdx,
    ):
        begin_req, end_req, begin_block, end_block = sched
        wtid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
        warp = cute.arch.make_warp_uniform(wtid // 32)
        lane = wtid % 32
        row0 = warp * 16 + lane // 4
        k_full = storage.k_full.data_ptr()
        k_free = storage.k_free.data_ptr()
        info_base = storage.tile_info.data_ptr().toint()
        s_row_scale = storage.row_scale.get_tensor(cute.make_layout(TILE.heads))

        pv_ss_mma.set(warpgroup.Field.ACCUMULATE, True)
        thr_pv = pv_ss_mma.get_slice(wtid)
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_A(sP))
        col = self.column_block(1)
        sV = self.k_tensors_for_pv(sK, col)
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE.heads, self.pv_cols)))

        split_rows = (Int32(-1), Int32(-1))
        if cutlass.const_expr(self.tuning.early_metadata):
            split_rows = self.split_rows_of_partition(sched, mTileMd, mNumSplits, part)
        # sP / row_scale start out free.
        cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=2 * TILE.threads_per_wg)
        if cutlass.const_expr(self.help_second):
            # Tuning.help_second_tile: the producer's first scan tells whether this partition is
            # exactly two tiles; then tile 1 is ours (before acc_o is live).
            cute.arch.barrier(barrier_id=Bar.HELP, number_of_threads=2 * TILE.threads_per_wg)
            if ptx.ld_shared_i32(storage.help_flag.data_ptr().toint()) != 0:
                self.convert_second_tile(mKV, mIdx)
        n = Int32(0)
        for req in cutlass.range(begin_req, end_req + 1, unroll=1):
            start, stop, length = self.request_range(req, sched, mTopkLen, topk)
            acc_o.fill(0.0)
            # Compacted tiles: a request has at most stop - start tiles; the producer flags its last.
            active = start < stop
            for blk in cutlass.range(start, stop, unroll=1):
                if active:
                    buf = n % TILE.k_bufs
                    cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=2 * TILE.threads_per_wg)
                    self.stamp(Stamp.WG1_P, wtid == 0)
                    sc0 = s_row_scale[row0]
                    sc1 = s_row_scale[row0 + 8]
                    # WG0 already waited for this buffer; waiting on the same phase here gives WG1 its own
                    # acquire of the producer's writes (the producer cannot refill it before WG1 releases).
                    cute.arch.mbarrier_wait(k_full + buf, (n // TILE.k_bufs) & 1)
                    last_word = ptx.ld_shared_i32(info_base + buf * (TILE.info_words * 4) + 8)
                    self.consumer_fence()
                    self.scale_rows(acc_o, sc0, sc1)
                    warpgroup.fence()
                    cute.gemm(pv_ss_mma, acc_o, tOrP[None, None, None, 0], tOrV[None, None, None, buf], acc_o)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    self.stamp(Stamp.WG1_PV_DONE, wtid == 0)
                    cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=2 * TILE.threads_per_wg)
                    cute.arch.mbarrier_arrive(k_free + buf)
                    n += 1
                    active = last_word == 0

            cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=2 * TILE.threads_per_wg)
            o_scale0 = s_row_scale[row0]
            o_scale1 = s_row_scale[row0 + 8]
            cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=2 * TILE.threads_per_wg)
            self.scale_rows(acc_o, o_scale0, o_scale1)
            is_split, acc_row = self.split_piece(req, begin_req, end_req, split_rows, mTileMd, mNumSplits, part)
            if is_split:
                if cutlass.const_expr(self.cfg.split):
                    self.store_o_accum(acc_o, thr_pv, tma_oacc, mOAcc, sQ, oacc_layout, col, warp, hblk, s_idx, acc_row, Bar.EPI_PV_RIGHT)
            else:
                self.store_out(acc_o, thr_pv, tma_out, mOut, sQ, o_layout, col, warp, hblk, s_idx, req, Bar.EPI_PV_RIGHT)
            self.stamp(Stamp.WG1_EPILOGUE, wtid == 0)
            # The staging (aliasing sQ) is no longer read: WG0 may load the next Q.
            cute.arch.barrier_arrive(barrier_id=Bar.Q_FREE, number_of_threads=2 * TILE.threads_per_wg)

# --------------------------------------------------------------------------------------------------
# Compile + launch (the dispatcher's contract)
# --------------------------------------------------------------------------------------------------


def _fake_arguments(cfg: Sm90SparseDecodeConfig, tuning: Tuning = DEFAULT_TUNING):
    """Fake tensors with symbolic dims/strides so one compile serves every shape (no GPU needed)."""
    rt = cute.runtime
    b, s_q = cute.sym_int(), cute.sym_int()
    topk = cute.sym_int(divisibility=64)
    num_blocks, page = cute.sym_int(), cute.sym_int()
    parts, b1, rows = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def s64(div):
        return cute.sym_int64(divisibility=div)

    q = rt.make_fake_tensor(BFloat16, (b, s_q, cfg.h_q, cfg.d_qk), stride=(s64(8), s64(8), s64(8), 1), assumed_align=16)
    kv = rt.make_fake_tensor(Uint8, (num_blocks, page, TILE.row_bytes), stride=(s64(16), TILE.row_bytes, 1), assumed_align=16)
    indices = rt.make_fake_tensor(Int32, (b, s_q, topk), stride=(s64(1), s64(1), 1), assumed_align=4)
    topk_length = rt.make_fake_compact_tensor(Int32, (b,), assumed_align=4) if cfg.has_topk_length else None
    attn_sink = rt.make_fake_compact_tensor(Float32, (cfg.h_q,), assumed_align=4) if cfg.has_attn_sink else None
    tile_md = rt.make_fake_compact_tensor(Int32, (parts, 8), stride_order=(1, 0), assumed_align=16)
    num_splits = rt.make_fake_compact_tensor(Int32, (b1,), assumed_align=4)
    out = rt.make_fake_tensor(BFloat16, (b, s_q, cfg.h_q, cfg.d_v), stride=(s64(8), s64(8), s64(8), 1), assumed_align=16)
    lse = rt.make_fake_compact_tensor(Float32, (b, s_q, cfg.h_q), stride_order=(2, 1, 0), assumed_align=4)
    o_accum = lse_accum = None
    if cfg.split:
        o_accum = rt.make_fake_compact_tensor(accum_type(cfg.accum_dtype), (rows, s_q, cfg.h_q, cfg.d_v),
                                              stride_order=(3, 2, 1, 0), assumed_align=16)
        lse_accum = rt.make_fake_compact_tensor(Float32, (rows, s_q, cfg.h_q), stride_order=(2, 1, 0), assumed_align=4)
    timeline = None
    if tuning.timeline:
        timeline = rt.make_fake_compact_tensor(Int64, (cute.sym_int(), parts, int(Stamp.SLOTS)), stride_order=(2, 1, 0), assumed_align=8)
    stream = rt.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (q, kv, indices, topk_length, attn_sink, tile_md, num_splits, out, lse, o_accum, lse_accum, timeline, Float32(1.0), stream)


def compile_sparse_decode(cfg: Sm90SparseDecodeConfig, dump_dir: Optional[str] = None,
                          tuning: Tuning = DEFAULT_TUNING) -> CompiledKernel:
    """Compile (once per ``cfg``, ``tuning``) the SM90 sparse decode kernel against fake tensors."""

    def build(dd):
        return cute.compile(Sm90SparseDecodeKernel(cfg, tuning), *_fake_arguments(cfg, tuning), options=compile_options(cfg.arch, dd))

    return compile_cached(("sm90_sparse_decode", cfg, tuning), build, dump_dir)


def launch_sparse_decode(
    compiled: CompiledKernel, cfg: Sm90SparseDecodeConfig, q, kv, indices, topk_length, attn_sink, tile_md, num_splits,
    out, lse, o_accum, lse_accum, softmax_scale: float, timeline=None,
) -> None:
    """Launch on torch's current stream. No host sync, no allocation.

    Absent optionals are passed as None (the compiled signature keeps a None slot for them).
    ``timeline``: the stamp buffer of a kernel compiled with ``Tuning.timeline`` (probes only).
    Grid: x = s_q * (h_q // 64) (x 2 in the column pair), y = tile_md.shape[0] (one CTA per
    64 heads x token x partition, per column half in the column pair).
    """
    compiled.fn(
        q, kv, indices,
        topk_length if cfg.has_topk_length else None,
        attn_sink if cfg.has_attn_sink else None,
        tile_md, num_splits, out, lse,
        o_accum if cfg.split else None,
        lse_accum if cfg.split else None,
        timeline,
        float(softmax_scale),
    )
