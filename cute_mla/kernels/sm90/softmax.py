"""WG0 (``Role.SOFTMAX``): S = Q K^T, the online softmax, P V into O's left columns, the epilogue.

Per request: Q is loaded by TMA (64 heads x d_qk dims, after WG1's previous output store has left
the staging that aliases the Q buffer). Per K tile: d_qk / 16 SS wgmma 64x64x16 (36 V3.2, 32 V4) give S, invalid tokens are
masked to -inf from the tile's mask, the online softmax runs in the log2 domain, bf16 P stays in
registers for the RS wgmma P V[:, left] and goes to shared memory with the per-row rescale for
WG1. The next tile's QK is issued right behind this tile's PV, so the tensor core gets the next
chain while this one drains.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...dsl import ptx
from .config import TILE, Bar, Sm90SparseDecodeConfig, Stamp
from .cta import Cta, Gmem, Smem, request_id, request_range, split_piece, split_rows_of_partition, stamp
from .epilogue import BlockStore, finalize_row, q_staging, store_block, store_lse_rows
from .mma import Ops, c_layout_to_a_layout, column_block, issue_qk, k_tensors_for_pv, scale_rows

PAIR_THREADS = 2 * TILE.threads_per_wg   # the named barriers WG0 and WG1 share


@cute.jit
def softmax_wg(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, smem: Smem, ops: Ops, scale_log2: Float32):
    begin_req, end_req, begin_block, end_block = cta.sched
    wtid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = cute.arch.make_warp_uniform(wtid // 32)
    lane = wtid % 32
    row0 = warp * 16 + lane // 4  # accumulator rows of this thread: row0 and row0 + 8
    q_full = smem.storage.q_full.data_ptr()
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    info_base = smem.storage.tile_info.data_ptr().toint()
    s_row_scale = smem.storage.row_scale.get_tensor(cute.make_layout(TILE.heads))

    # Q TMA partition: (h, d, s_q, b) -> (64, d_qk) boxes.
    gQ = cute.flat_divide(g.mQ, (TILE.heads, cfg.tile.d_qk))
    sQ0 = smem.sQ[None, None, 0]
    tQsQ, tQgQ = cpasync.tma_partition(g.tma_q, 0, cute.make_layout(1), cute.group_modes(sQ0, 0, 2), cute.group_modes(gQ, 0, 2))

    ops.qk.set(warpgroup.Field.ACCUMULATE, True)
    ops.pv_rs.set(warpgroup.Field.ACCUMULATE, True)
    thr_qk = ops.qk.get_slice(wtid)
    tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(smem.sQ))
    tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(smem.sK))
    thr_pv = ops.pv_rs.get_slice(wtid)
    col = column_block(cfg, 0)
    sV = k_tensors_for_pv(cfg, smem.sK, col)
    tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
    acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE.heads, cfg.pv_cols)))
    acc_s_shape = thr_qk.partition_shape_C((TILE.heads, TILE.tokens))
    # P (bf16) in the A-operand register layout of the RS wgmma, viewed with the accumulator layout.
    acc_s = thr_qk.make_fragment_C(acc_s_shape)
    tOrP = cute.make_rmem_tensor(c_layout_to_a_layout(acc_s.layout, ops.pv_rs.tv_layout_A.shape[1]), BFloat16)
    tOrP_as_c = cute.make_tensor(tOrP.iterator, acc_s.layout)
    tSsP = thr_qk.partition_C(smem.sP[None, None, 0])

    quad = lane % 4
    split_rows = split_rows_of_partition(cfg, g, cta)
    n = Int32(0)
    rq = Int32(0)
    for req in cutlass.range(begin_req, end_req + 1, unroll=1):
        start, stop, _, _, _ = request_range(cfg, g, cta, req)
        if rq > 0:
            # WG1's output store of the previous request no longer reads the staging (= sQ).
            cute.arch.barrier(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)
        load_q(cfg, g, cta, q_full, tQgQ, tQsQ, warp, request_id(cfg, g, req))
        m0 = Float32(-1e30)
        m1 = Float32(-1e30)
        l0 = Float32(0.0)
        l1 = Float32(0.0)
        acc_o.fill(0.0)
        cute.arch.mbarrier_wait(q_full, rq & 1)
        stamp(cta, Stamp.Q_READY, wtid == 0)

        if start < stop:
            cute.arch.mbarrier_wait(k_full + n % TILE.k_bufs, (n // TILE.k_bufs) & 1)
            stamp(cta, Stamp.K_READY, wtid == 0)
            issue_qk(cfg, ops.qk, acc_s, tSrQ, tSrK, n % TILE.k_bufs)
            warpgroup.wait_group(0)
            stamp(cta, Stamp.QK_DONE, wtid == 0)
        # Compacted tiles: a request has at most stop - start tiles; the producer flags its last.
        active = start < stop
        for blk in cutlass.range(start, stop, unroll=1):
            if active:
                buf = n % TILE.k_bufs
                info = ptx.ld_shared_v4(info_base + buf * (TILE.info_words * 4))
                last_word = ptx.vec_elem(info, 2)
                last = last_word != 0
                m0, m1, l0, l1, sc0, sc1 = online_softmax(acc_s, ptx.vec_elem(info, 0), ptx.vec_elem(info, 1), quad,
                                                          scale_log2, m0, m1, l0, l1)
                tOrP_as_c.store(acc_s.load().to(BFloat16))

                hand_p_over(s_row_scale, row0, quad, sc0, sc1, tOrP_as_c, tSsP)
                stamp(cta, Stamp.P_READY, wtid == 0)

                # ---- O_left = O_left * sc + P V[:, left], then the next tile's QK behind it
                scale_rows(acc_o, sc0, sc1)
                warpgroup.fence()
                cute.gemm(ops.pv_rs, acc_o, tOrP, tOrV[None, None, None, buf], acc_o)
                warpgroup.commit_group()
                next_qk_behind_pv(lambda b: issue_qk(cfg, ops.qk, acc_s, tSrQ, tSrK, b), k_full, k_free, n, last)
                n += 1
                active = last_word == 0

        # ---- epilogue of this request
        stamp(cta, Stamp.PV_DONE, wtid == 0)
        l0 += cute.arch.shuffle_sync_bfly(l0, offset=1)
        l0 += cute.arch.shuffle_sync_bfly(l0, offset=2)
        l1 += cute.arch.shuffle_sync_bfly(l1, offset=1)
        l1 += cute.arch.shuffle_sync_bfly(l1, offset=2)
        is_split, acc_row = split_piece(cfg, cta, req, split_rows)
        o_scale0, lse0 = finalize_row(cfg, g.mSink, l0, m0, is_split, cta.hblk * TILE.heads + row0)
        o_scale1, lse1 = finalize_row(cfg, g.mSink, l1, m1, is_split, cta.hblk * TILE.heads + row0 + 8)
        cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
        if quad == 0:
            s_row_scale[row0] = o_scale0
            s_row_scale[row0 + 8] = o_scale1
        cute.arch.barrier_arrive(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
        stamp(cta, Stamp.EPI_FINAL, wtid == 0)
        scale_rows(acc_o, o_scale0, o_scale1)
        head0 = cta.hblk * TILE.heads + row0
        # The lse stores go after the O block's: the block's staging fences the generic proxy,
        # which may wait for this thread's global stores still in flight (lse first measured
        # slower, docs/performance.md).
        if is_split:
            if cutlass.const_expr(cfg.split):
                store_o(cfg, cta, smem, acc_o, thr_pv, BlockStore(g.tma_oacc, g.mOAcc, ops.chunk_layout), col, warp,
                        acc_row, False)
                store_lse_rows(cfg, g.mLseAcc, acc_row, cta.s_idx, head0, lse0, lse1, quad)
        else:
            rid = request_id(cfg, g, req)
            store_o(cfg, cta, smem, acc_o, thr_pv, BlockStore(g.tma_out, g.mOut, ops.chunk_layout), col, warp, rid,
                    cfg.out_from_registers)
            store_lse_rows(cfg, g.mLse, rid, cta.s_idx, head0, lse0, lse1, quad)
        stamp(cta, Stamp.EPILOGUE, wtid == 0)
        rq += 1

    # Balance the barriers WG1 arrived on once more than WG0 synced.
    cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
    cute.arch.barrier(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)
    stamp(cta, Stamp.EXIT_NS, wtid == 0)


@cute.jit
def hand_p_over(s_row_scale, row0, quad, sc0: Float32, sc1: Float32, tOrP_as_c, tSsP):
    """P (bf16, this thread's fragment) and the rows' O factors to WG1 (``Role.PV_RIGHT``): once
    WG1 has freed the buffers (``P_FREE``), written and fenced for its SS wgmma, then ``P_READY``."""
    cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
    if quad == 0:
        s_row_scale[row0] = sc0
        s_row_scale[row0 + 8] = sc1
    cute.autovec_copy(tOrP_as_c, tSsP)
    cute.arch.fence_view_async_shared()
    cute.arch.barrier_arrive(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)


@cute.jit
def load_q(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, q_full, tQgQ, tQsQ, warp, req: Int32, policy=None):
    """Request ``req``'s Q (64 heads x d_qk) into the Q buffer by TMA, completing on ``q_full``
    (``policy``: an L2 cache policy, ``ptx.l2_policy``, the load carries, or None)."""
    if warp == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(q_full, TILE.heads * cfg.tile.d_qk * 2)
        if cutlass.const_expr(policy is None):
            cute.copy(g.tma_q, tQgQ[None, cta.hblk, 0, cta.s_idx, req], tQsQ, tma_bar_ptr=q_full)
        else:
            cute.copy(g.tma_q, tQgQ[None, cta.hblk, 0, cta.s_idx, req], tQsQ, tma_bar_ptr=q_full, cache_policy=policy)


@cute.jit
def store_o(cfg: Sm90SparseDecodeConfig, cta: Cta, smem: Smem, acc_o, thr_pv, to: BlockStore, col, warp, row,
            direct: cutlass.Constexpr):
    """WG0's O block: staged in its half of the Q buffer and stored (:func:`~.epilogue.store_block`),
    or from registers where ``direct``."""
    store_block(cfg, cta, acc_o, thr_pv, to, None if direct else q_staging(cfg, smem.sQ, col), col, warp, row,
                Bar.EPI_SOFTMAX, direct)


@cute.jit
def masked_row_max(acc_s: cute.Tensor, mask_lo, mask_hi, quad, scale_log2: Float32):
    """S -> S * scale_log2 in place, -inf where the tile's 64-bit validity mask (``mask_lo``:
    tokens 0-31, ``mask_hi``: 32-63) is clear; returns the row maxima of this thread's two rows
    (reduced over the quad)."""
    w_lo = Uint32(mask_lo) >> Uint32(2 * quad)
    w_hi = Uint32(mask_hi) >> Uint32(2 * quad)
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
    return mx0, mx1


@cute.jit
def exp_rows(acc_s: cute.Tensor, m0: Float32, m1: Float32, scale_log2=None):
    """P = exp2(S - m) in place (S already scaled and masked); with ``scale_log2``, P =
    exp2(fma(S, scale_log2, -m)) (S raw and masked, m in log2 units: the scale folded into one FFMA
    an element). Returns this thread's partial row sums of its two rows (fp32 P)."""
    if cutlass.const_expr(scale_log2 is not None):
        m0, m1 = -m0, -m1      # the FFMA's addends
    sum0 = Float32(0.0)
    sum1 = Float32(0.0)
    for v in cutlass.range_constexpr(cute.size(acc_s)):
        first = (v // 2) % 2 == 0      # the thread's two rows alternate by pairs of elements
        m = m0 if first else m1
        if cutlass.const_expr(scale_log2 is None):
            p = cute.math.exp2(acc_s[v] - m, fastmath=True)
        else:
            p = cute.math.exp2(cute.math.fma(acc_s[v], scale_log2, m), fastmath=True)
        if cutlass.const_expr(first):
            sum0 += p
        else:
            sum1 += p
        acc_s[v] = p
    return sum0, sum1


@cute.jit
def online_softmax(acc_s, mask_lo, mask_hi, quad, scale_log2: Float32, m0: Float32, m1: Float32, l0: Float32,
                   l1: Float32):
    """Mask S with the tile's 64-bit validity mask (``mask_lo``: tokens 0-31, ``mask_hi``: 32-63,
    bit j = token j), then one online-softmax step in the log2 domain over this thread's two rows:
    S becomes P in place. Returns the new (m0, m1, l0, l1) and the rows' rescale factors (sc0, sc1)
    for O."""
    mx0, mx1 = masked_row_max(acc_s, mask_lo, mask_hi, quad, scale_log2)
    new_m0 = cute.arch.fmax(m0, mx0)
    new_m1 = cute.arch.fmax(m1, mx1)
    sc0 = cute.math.exp2(m0 - new_m0, fastmath=True)
    sc1 = cute.math.exp2(m1 - new_m1, fastmath=True)
    sum0, sum1 = exp_rows(acc_s, new_m0, new_m1)
    return new_m0, new_m1, l0 * sc0 + sum0, l1 * sc1 + sum1, sc0, sc1


@cute.jit
def next_qk_behind_pv(issue_qk_into, k_full, k_free, n: Int32, last):
    """After tile ``n``'s PV is committed: issue tile n+1's QK behind it (``issue_qk_into(buffer)``,
    a trace-time callable: the 64-head tile's or the swap-AB tile's QK) unless ``n`` is the
    request's last tile, then release tile n's K buffer once its PV has retired. P and S are
    distinct registers, so both chains can be in flight."""
    buf = n % TILE.k_bufs
    if last:
        warpgroup.wait_group(0)
        cute.arch.mbarrier_arrive(k_free + buf)
    else:
        nbuf = (n + 1) % TILE.k_bufs
        cute.arch.mbarrier_wait(k_full + nbuf, ((n + 1) // TILE.k_bufs) & 1)
        issue_qk_into(nbuf)
        warpgroup.wait_group(1)
        cute.arch.mbarrier_arrive(k_free + buf)
        warpgroup.wait_group(0)
