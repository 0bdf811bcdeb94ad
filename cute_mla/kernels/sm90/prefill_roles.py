"""The SM90 sparse prefill kernel's warp-group roles and the bundles they take (the MMA warp
groups of the 64-head tile; 8, 16 and 32 heads run the swap-AB tile's, ``prefill_small_roles.py``,
with this producer).

A CTA is one query token x 64 heads. It walks its token's top-k list in 64-position K tiles
(``ceil(length / 64)`` of them, ``length`` = top-k or the token's clamped ``topk_length``; none for
an empty list) with the decode kernel's MMA side:

* WG0 ``Role.SOFTMAX``: QK, the online softmax (masked by the tile's validity bits), PV of O's left
  256 columns with the next tile's QK behind it, P and the row factors handed to WG1, the
  epilogue's lse and max_logits;
* WG1 ``Role.PV_RIGHT``: PV of O's right 256 columns from P in shared memory;
* WG2 ``Role.PRODUCER``: the row gather. Each position of a tile is gathered where it sits (no
  compaction: a prefill token's list is mostly valid), 16 B per ``cp.async`` straight into the
  swizzled K tile, zero-filled for an invalid position (negative, ``>= s_kv`` or past the length),
  whose bit in the tile's validity mask is clear.

Pipelines (producer -> consumers, arrive counts): ``q_full`` (WG0's TMA of Q, 1 + tx);
``k_full[2]``: 128 ``cp.async.mbarrier.arrive.noinc`` (each producer thread's copies landed) + 4
(one lane per producer warp, after storing its 16 bits of the tile's mask) -> WG0 and WG1;
``k_free[2]``: 256 (WG0 + WG1, once the tile's PVs retired) -> producer. Named barriers
``P_READY`` / ``P_FREE`` (WG0 <-> WG1, the decode kernel's) and each MMA warp group's ``EPI_*``.
"""

# No "from __future__ import annotations": cute.struct reads its field annotations as objects.
import functools
import math
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...dsl import ptx as common_ptx
from . import ptx
from .config import TILE, Bar, Tile
from .cta import Cta
from .epilogue import BlockStore, finalize_row, q_staging, store_block
from .mma import Ops, c_layout_to_a_layout, issue_qk, k_tensors_for_pv, scale_rows
from .prefill_config import Sm90SparsePrefillConfig
from .softmax import hand_p_over, load_q, next_qk_behind_pv, online_softmax

PAIR_THREADS = 2 * TILE.threads_per_wg   # the named barriers WG0 and WG1 share
TOKENS_PER_PASS = 4                      # rows a producer warp gathers per pass: 8 lanes x 16 B per 128-B chunk
PASSES = TILE.tokens // (4 * TOKENS_PER_PASS)   # passes per tile: 4 warps x 4 rows x 4 passes = 64 rows
MASK_BYTES = 16                          # per K buffer: one 32-bit word of mask bits per producer warp
K_FULL_ARRIVALS = TILE.threads_per_wg + TILE.threads_per_wg // 32
LN2 = math.log(2.0)
assert TILE.chunk_row_bytes == 8 * 16, "a K tile row of one 64-dim chunk is eight 16-B units, one per lane of a group"


class Gmem(NamedTuple):
    """The kernel's global tensors and the TMA atoms that read or write them."""

    tma_q: cute.CopyAtom
    mQ: cute.Tensor              # Q as (h, d_qk, s_q, 1): TMA boxes of 64 heads x d_qk dims
    tma_out: cute.CopyAtom
    mOut: cute.Tensor            # out as (h, d_v, s_q, 1): TMA boxes of 64 heads x 64 columns
    mKV: cute.Tensor             # (s_kv, d_qk) bf16
    mIdx: cute.Tensor            # (s_q, topk) int32
    mTopkLen: Optional[cute.Tensor]
    mSink: Optional[cute.Tensor]
    mMax: cute.Tensor            # (s_q, h) fp32
    mLse: cute.Tensor            # (s_q, h) fp32


class Work(NamedTuple):
    """One work item of a CTA: its token, 64-head block and K tiles."""

    s_idx: Int32
    hblk: Int32
    length: Int32      # valid positions are < length
    n_tiles: Int32


def items(cfg: Sm90SparsePrefillConfig, g: Gmem):
    """(begin, end, step) of the walk every role of a CTA takes: items ``blockIdx.x, + gridDim.x,
    ...`` of the s_q * h_q / 64 (token, 64-head block) items, a token's head blocks consecutive
    (so with an even grid the two head halves of h_q = 128 run side by side and the second one's
    rows come from L2)."""
    return cute.arch.block_idx()[0], g.mIdx.shape[0] * cfg.n_hblk, cute.arch.grid_dim()[0]


@cute.jit
def work_of(cfg: Sm90SparsePrefillConfig, g: Gmem, item: Int32) -> Work:
    s_idx = item // cfg.n_hblk
    length, n_tiles = tiles_of(cfg, g, s_idx)
    return Work(s_idx, item % cfg.n_hblk, length, n_tiles)


class Smem(NamedTuple):
    """The shared-memory struct and the tensors the MMAs read (the decode kernel's buffers)."""

    storage: object
    sQ: cute.Tensor
    sK: cute.Tensor
    sP: cute.Tensor


@functools.lru_cache(maxsize=None)
def shared_storage(tile: Tile):
    """The CTA's shared memory, one struct: Q (also the output staging), two K tiles, P, the
    barriers, the tiles' masks and the row factors (V3.2 widths: 229,888 B of 232,448)."""

    @cute.struct
    class SharedStorage:
        q_full: cute.struct.MemRange[Int64, 1]
        k_full: cute.struct.MemRange[Int64, TILE.k_bufs]
        k_free: cute.struct.MemRange[Int64, TILE.k_bufs]
        tile_mask: cute.struct.Align[cute.struct.MemRange[Uint32, MASK_BYTES // 4 * TILE.k_bufs], 16]
        row_scale: cute.struct.MemRange[Float32, TILE.heads]  # WG0 -> WG1 per-row O factor
        sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, tile.q_elems], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[BFloat16, tile.k_bufs * tile.k_tile_elems], 1024]
        sP: cute.struct.Align[cute.struct.MemRange[BFloat16, TILE.p_elems], 1024]

    return SharedStorage


@cute.jit
def tiles_of(cfg: Sm90SparsePrefillConfig, g: Gmem, s_idx: Int32):
    """(length, K tiles) of token ``s_idx``: top-k, or its ``topk_length`` clamped to [0, top-k];
    ``ceil(length / 64)`` tiles (none for an empty list)."""
    topk = g.mIdx.shape[1]
    length = topk
    if cutlass.const_expr(cfg.has_topk_length):
        length = cutlass.max(cutlass.min(g.mTopkLen[s_idx], topk), 0)
    return length, (length + (TILE.tokens - 1)) // TILE.tokens


# ------------------------------------------------------------------------------------- producer


@cute.jit
def producer(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem):
    """The row gather (WG2). Lane ``l`` of warp ``p`` copies 16-B unit ``l % 8`` of every 64-dim
    chunk of tile rows ``16 p + 4 i + l // 8`` (pass i); a row's unit j of chunk c lands at
    ``c * 8192 + row * 128 + ((j ^ (row & 7)) << 4)`` (the K tile's SW128 layout). The next
    tile's indices are loaded before this tile's buffer is waited for; the tiles of the CTA's
    items follow each other through the two buffers, so the next item's first tiles are gathered
    while the MMA warp groups finish the last one."""
    tile = cfg.tile
    ptid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = cute.arch.make_warp_uniform(ptid // 32)
    lane = ptid % 32
    sub = lane // 8
    unit = lane % 8
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    mask_base = smem.storage.tile_mask.data_ptr().toint()
    sk_base = smem.storage.sK.data_ptr().toint()
    s_kv = g.mKV.shape[0]
    kv_base = g.mKV.iterator.toint() + Int64(unit * 16)
    row_bytes = Int64(g.mKV.stride[0]) * Int64(2)
    first_row = warp * (TILE.tokens // 4) + sub   # this lane's row in pass 0

    n = Int32(0)   # tiles handed over so far: buffer n % 2, phase n // 2
    begin, end, step = items(cfg, g)
    for item in cutlass.range(begin, end, step, unroll=1):
        w = work_of(cfg, g, item)
        idx_row = cute.make_tensor(g.mIdx.iterator + Int64(w.s_idx) * Int64(g.mIdx.stride[0]),
                                   cute.make_layout(g.mIdx.shape[1]))
        nxt = cute.make_rmem_tensor(cute.make_layout(PASSES), Int32)
        for i in cutlass.range_constexpr(PASSES):
            if w.n_tiles > 0:
                nxt[i] = idx_row[first_row + i * TOKENS_PER_PASS]
        for t in cutlass.range(0, w.n_tiles, unroll=1):
            buf = n % TILE.k_bufs
            cur = cute.make_rmem_tensor(cute.make_layout(PASSES), Int32)
            cur.store(nxt.load())
            if t + 1 < w.n_tiles:
                for i in cutlass.range_constexpr(PASSES):
                    nxt[i] = idx_row[(t + 1) * TILE.tokens + first_row + i * TOKENS_PER_PASS]
            cute.arch.mbarrier_wait(k_free + buf, ((n // TILE.k_bufs) & 1) ^ 1)
            tile_base = sk_base + buf * tile.k_tile_bytes
            bits = Uint32(0)
            for i in cutlass.range_constexpr(PASSES):
                row = first_row + i * TOKENS_PER_PASS
                idx = cur[i]
                ok = (t * TILE.tokens + row < w.length) & (idx >= 0) & (idx < s_kv)
                src = kv_base + Int64(common_ptx.select_i32(ok, idx, 0)) * row_bytes
                dst = tile_base + row * TILE.chunk_row_bytes + ((unit ^ (row % 8)) << 4)
                n_bytes = common_ptx.select_i32(ok, 16, 0)
                for c in cutlass.range_constexpr(tile.chunks):
                    ptx.cp_async_16(dst + c * tile.chunk_bytes, src + c * TILE.chunk_row_bytes, n_bytes,
                                    cfg.tuning.gather_l2)
                ballot = Uint32(cute.arch.vote_ballot_sync(ok))
                for j in cutlass.range_constexpr(TOKENS_PER_PASS):
                    bits = bits | (((ballot >> Uint32(8 * j)) & Uint32(1)) << Uint32(i * TOKENS_PER_PASS + j))
            ptx.cp_async_arrive_noinc((k_full + buf).toint())
            if lane == 0:
                common_ptx.st_shared_i32(mask_base + buf * MASK_BYTES + warp * 4, bits)
                cute.arch.mbarrier_arrive(k_full + buf)
            if cutlass.const_expr(cfg.tuning.prefetch_rows):
                # Tile t+1's rows into L2 while this lane waits for its buffer: lane ``unit`` takes
                # the row's 128-B line ``unit`` (and lane 0 the ninth of a 576-wide row).
                if t + 1 < w.n_tiles:
                    for i in cutlass.range_constexpr(PASSES):
                        idx = nxt[i]
                        pos = (t + 1) * TILE.tokens + first_row + i * TOKENS_PER_PASS
                        if (pos < w.length) & (idx >= 0) & (idx < s_kv):
                            line = kv_base + Int64(idx) * row_bytes + Int64(unit * (TILE.chunk_row_bytes - 16))
                            ptx.prefetch_l2_line(line)
                            if cutlass.const_expr(tile.chunks > 8):
                                if unit == 0:
                                    ptx.prefetch_l2_line(line + 8 * TILE.chunk_row_bytes)
            n += 1


@cute.jit
def tile_mask(mask_base: Int32, buf):
    """(tokens 0-31, tokens 32-63) validity words of K buffer ``buf``: producer warp p wrote rows
    16 p .. 16 p + 15 as bits 0-15 of its word."""
    words = common_ptx.ld_shared_v4(mask_base + buf * MASK_BYTES)
    lo = Uint32(common_ptx.vec_elem(words, 0)) | (Uint32(common_ptx.vec_elem(words, 1)) << Uint32(16))
    hi = Uint32(common_ptx.vec_elem(words, 2)) | (Uint32(common_ptx.vec_elem(words, 3)) << Uint32(16))
    return lo, hi


# ------------------------------------------------------------------------------ the MMA warp groups


@cute.jit
def softmax_wg(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem, ops: Ops, scale_log2: Float32):
    """WG0, per item: Q by TMA (once WG1's previous output left the staging in sQ), then per
    tile QK, the masked online softmax, P and the row factors to WG1, PV of the left columns with
    the next tile's QK issued behind it (the decode kernel's ``next_qk_behind_pv``: the next
    tile's rows get this tile's softmax to land); then the epilogue."""
    wtid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = cute.arch.make_warp_uniform(wtid // 32)
    lane = wtid % 32
    quad = lane % 4
    row0 = warp * 16 + lane // 4  # accumulator rows of this thread: row0 and row0 + 8
    q_full = smem.storage.q_full.data_ptr()
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    mask_base = smem.storage.tile_mask.data_ptr().toint()
    s_row_scale = smem.storage.row_scale.get_tensor(cute.make_layout(TILE.heads))

    gQ = cute.flat_divide(g.mQ, (TILE.heads, cfg.tile.d_qk))
    tQsQ, tQgQ = cpasync.tma_partition(g.tma_q, 0, cute.make_layout(1), cute.group_modes(smem.sQ[None, None, 0], 0, 2),
                                       cute.group_modes(gQ, 0, 2))
    ops.qk.set(warpgroup.Field.ACCUMULATE, True)
    ops.pv_rs.set(warpgroup.Field.ACCUMULATE, True)
    thr_qk = ops.qk.get_slice(wtid)
    tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(smem.sQ))
    tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(smem.sK))
    thr_pv = ops.pv_rs.get_slice(wtid)
    tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(k_tensors_for_pv(cfg, smem.sK, 0)))
    acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE.heads, cfg.pv_cols)))
    acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE.heads, TILE.tokens)))
    # P (bf16) in the A-operand register layout of the RS wgmma, viewed with the accumulator layout.
    tOrP = cute.make_rmem_tensor(c_layout_to_a_layout(acc_s.layout, ops.pv_rs.tv_layout_A.shape[1]), BFloat16)
    tOrP_as_c = cute.make_tensor(tOrP.iterator, acc_s.layout)
    tSsP = thr_qk.partition_C(smem.sP[None, None, 0])

    n = Int32(0)    # tiles consumed so far (the producer's count)
    rq = Int32(0)   # items done so far
    begin, end, step = items(cfg, g)
    for item in cutlass.range(begin, end, step, unroll=1):
        w = work_of(cfg, g, item)
        if rq > 0:
            # WG1's output store of the previous item no longer reads its staging (in sQ).
            cute.arch.barrier(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)
        load_q(cfg, g, cta_of(w), q_full, tQgQ, tQsQ, warp, 0)
        m0 = Float32(-1e30)
        m1 = Float32(-1e30)
        l0 = Float32(0.0)
        l1 = Float32(0.0)
        acc_o.fill(0.0)
        cute.arch.mbarrier_wait(q_full, rq & 1)
        if w.n_tiles > 0:
            cute.arch.mbarrier_wait(k_full + n % TILE.k_bufs, (n // TILE.k_bufs) & 1)
            issue_qk(cfg, ops.qk, acc_s, tSrQ, tSrK, n % TILE.k_bufs)
            warpgroup.wait_group(0)
        for t in cutlass.range(0, w.n_tiles, unroll=1):
            buf = n % TILE.k_bufs
            lo, hi = tile_mask(mask_base, buf)
            m0, m1, l0, l1, sc0, sc1 = online_softmax(acc_s, lo, hi, quad, scale_log2, m0, m1, l0, l1)
            tOrP_as_c.store(acc_s.load().to(BFloat16))

            hand_p_over(s_row_scale, row0, quad, sc0, sc1, tOrP_as_c, tSsP)

            scale_rows(acc_o, sc0, sc1)
            warpgroup.fence()
            cute.gemm(ops.pv_rs, acc_o, tOrP, tOrV[None, None, None, buf], acc_o)
            warpgroup.commit_group()
            next_qk_behind_pv(cfg, ops, acc_s, tSrQ, tSrK, k_full, k_free, n, t + 1 == w.n_tiles)
            n += 1

        # ---- epilogue: row sums over the quad, factors to WG1, O, lse and max_logits
        l0 += cute.arch.shuffle_sync_bfly(l0, offset=1)
        l0 += cute.arch.shuffle_sync_bfly(l0, offset=2)
        l1 += cute.arch.shuffle_sync_bfly(l1, offset=1)
        l1 += cute.arch.shuffle_sync_bfly(l1, offset=2)
        head0 = w.hblk * TILE.heads + row0
        # rows past a small head count (8, 16, 32) are the tile's padding: the sink of a real head
        # (never used), no lse or max_logits, no out (TMA clips them)
        o_scale0, lse0 = finalize_row(cfg, g.mSink, l0, m0, False, cutlass.min(head0, cfg.h_q - 1))
        o_scale1, lse1 = finalize_row(cfg, g.mSink, l1, m1, False, cutlass.min(head0 + 8, cfg.h_q - 1))
        cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
        if quad == 0:
            s_row_scale[row0] = o_scale0
            s_row_scale[row0 + 8] = o_scale1
        cute.arch.barrier_arrive(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
        scale_rows(acc_o, o_scale0, o_scale1)
        store_block(cfg, cta_of(w), acc_o, thr_pv, BlockStore(g.tma_out, g.mOut, ops.chunk_layout),
                    q_staging(cfg, smem.sQ, 0), 0, warp, 0, Bar.EPI_SOFTMAX, False)
        if (quad == 0) & (head0 < cfg.h_q):
            g.mLse[w.s_idx, head0] = lse0
            g.mMax[w.s_idx, head0] = max_logit(l0, m0)
        if (quad == 0) & (head0 + 8 < cfg.h_q):
            g.mLse[w.s_idx, head0 + 8] = lse1
            g.mMax[w.s_idx, head0 + 8] = max_logit(l1, m1)
        rq += 1
    # Balance the barriers WG1 arrived on once more than WG0 synced.
    cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
    if rq > 0:
        cute.arch.barrier(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)


@cute.jit
def pv_right_wg(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem, ops: Ops):
    """WG1: per tile, P and the row factors from WG0, then the SS wgmma P V[:, right]; per item,
    its half of O with the final factors, then ``Q_FREE`` (its staging in sQ is free)."""
    wtid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = cute.arch.make_warp_uniform(wtid // 32)
    lane = wtid % 32
    row0 = warp * 16 + lane // 4
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    s_row_scale = smem.storage.row_scale.get_tensor(cute.make_layout(TILE.heads))

    ops.pv_ss.set(warpgroup.Field.ACCUMULATE, True)
    thr_pv = ops.pv_ss.get_slice(wtid)
    tOrP = thr_pv.make_fragment_A(thr_pv.partition_A(smem.sP))
    tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(k_tensors_for_pv(cfg, smem.sK, 1)))
    acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE.heads, cfg.pv_cols)))
    # sP / row_scale start out free.
    cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
    n = Int32(0)
    begin, end, step = items(cfg, g)
    for item in cutlass.range(begin, end, step, unroll=1):
        w = work_of(cfg, g, item)
        acc_o.fill(0.0)
        for t in cutlass.range(0, w.n_tiles, unroll=1):
            buf = n % TILE.k_bufs
            cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
            sc0 = s_row_scale[row0]
            sc1 = s_row_scale[row0 + 8]
            # WG0 already waited for this buffer; waiting on the same phase gives WG1 its own acquire
            # of the gathered rows (the producer cannot refill the buffer before WG1 releases it).
            cute.arch.mbarrier_wait(k_full + buf, (n // TILE.k_bufs) & 1)
            scale_rows(acc_o, sc0, sc1)
            warpgroup.fence()
            cute.gemm(ops.pv_ss, acc_o, tOrP[None, None, None, 0], tOrV[None, None, None, buf], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
            cute.arch.mbarrier_arrive(k_free + buf)
            n += 1

        cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
        o_scale0 = s_row_scale[row0]
        o_scale1 = s_row_scale[row0 + 8]
        cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
        scale_rows(acc_o, o_scale0, o_scale1)
        store_block(cfg, cta_of(w), acc_o, thr_pv, BlockStore(g.tma_out, g.mOut, ops.chunk_layout),
                    q_staging(cfg, smem.sQ, 1), 1, warp, 0, Bar.EPI_PV_RIGHT, False)
        # The staging (in sQ) is no longer read: WG0 may load the next item's Q.
        cute.arch.barrier_arrive(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)


def cta_of(w: Work) -> Cta:
    """The decode epilogue's view of this CTA (its token and head block; no schedule, no timeline)."""
    return Cta(Int32(0), w.s_idx, w.hblk, None, None, None)


@cute.jit
def max_logit(l_sum: Float32, m: Float32):
    """max_logits of a row in natural units (the running max is in log2 units of the scaled
    logits): -inf for a row with no valid position."""
    return Float32(cutlass.select_(l_sum == Float32(0.0), -Float32.inf, m * Float32(LN2)))
