"""The SM90 sparse decode kernel's MMA roles on the swap-AB tile (``swapped.py``: a K tile's 64
rows on the wgmma's M side, h = 8, 16 or 32 heads on N; ``cfg.swapped``): one CTA does a query
token's h heads for one partition, so the MMAs do the heads' work only.

WG0 (``Role.SOFTMAX``): per request, Q by TMA (h x d_qk, after WG1's previous output left the
staging in the Q buffer); per K tile the QK S^T = K Q^T, the softmax over the tile's rows, P^T
and the heads' factors handed to WG1, PV of O^T's dims 0-255 with the next tile's QK behind it;
then the request's epilogue (the heads' sums, their factors to WG1, its half of out or o_accum,
lse or lse_accum). WG1 (``Role.PV_RIGHT``): per tile the heads' factors and PV of dims 256-511;
its half of the output with the final factors, then ``Q_FREE``.

What the 64-head kernel's roles do the same way: the request walk of the partition and its
split pieces (``cta.py``); the producer (``producer.py``, ``index_scan.py``) and its K pipeline:
tile n of the partition in buffer n % 2 with phase (n / 2) & 1, ``k_full[b]`` 128 arrivals,
``k_free[b]`` 256 (each MMA group once its PV of the tile retired), the tile's 64-bit validity
mask and its request's last-tile flag in ``tile_info``; ``finalize_row`` (sinks, empty rows, a
split piece's base-2 lse). MMA warp w holds tile rows 16 w .. 16 w + 15: bits 16 (w % 2) ..
of mask word w / 2.

Named barriers (:class:`~.config.Bar`): ``P_FREE`` (WG1 -> WG0: P^T and the factors read),
``P_READY`` (256 threads: per tile a sync of both groups, so it also orders WG0's own P^T writes
before its SS wgmma; at a request's end WG0 only arrives), ``Q_FREE`` (WG1 -> WG0: its staging
left the Q buffer), ``EPI_SOFTMAX`` (WG0: the max / sum exchange and its output chunks),
``EPI_PV_RIGHT`` (WG1's output chunks). No wgmma is left pending at a loop edge or branch merge.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...dsl import ptx
from .config import TILE, Bar, Sm90SparseDecodeConfig
from .cta import XCHG_BUFS, Cta, Gmem, Smem, request_id, request_range, split_piece, split_rows_of_partition
from .epilogue import finalize_row
from .mma import k_tensors_for_pv
from .swapped import (WARPS, SwappedOps, exchange, head_of, issue_qk_swapped, rows_sum, scale_heads, store_transposed,
                      swapped_softmax)

PAIR_THREADS = 2 * TILE.threads_per_wg   # the named barriers WG0 and WG1 share
SUM_BUF = 2                              # the exchange buffer of a request's sums (0 and 1: the tiles' max by K buffer)
OUT_CHUNKS = TILE.half_v // TILE.chunk   # 64-dim chunks of O^T per MMA warp group (4)
assert XCHG_BUFS == SUM_BUF + 1


def tile_word(info_base, buf, warp, lane):
    """This thread's rows' validity in K buffer ``buf``'s 64-bit mask: bit 0 row ``16 warp + lane /
    4``, bit 8 that row + 8. A plain function, inlined at trace time."""
    word = Uint32(ptx.ld_shared_i32(info_base + buf * (TILE.info_words * 4) + 4 * (warp // 2)))
    return word >> Uint32(16 * (warp % 2) + lane // 4)


def last_of(info_base, buf):
    """K buffer ``buf``'s tile is its request's last (the producer's flag). A plain function."""
    return ptx.ld_shared_i32(info_base + buf * (TILE.info_words * 4) + 8)


@cute.jit
def next_qk_behind_pv(cfg: Sm90SparseDecodeConfig, ops: SwappedOps, acc_s, tSrK, tSrQ, k_full, k_free, n: Int32, last):
    """After tile ``n``'s PV is committed: tile n+1's QK behind it (unless ``n`` is the request's
    last tile), tile n's K buffer released once its PV retired; every wgmma retired on both
    branches."""
    buf = n % TILE.k_bufs
    if last:
        warpgroup.wait_group(0)
        cute.arch.mbarrier_arrive(k_free + buf)
    else:
        nbuf = (n + 1) % TILE.k_bufs
        cute.arch.mbarrier_wait(k_full + nbuf, ((n + 1) // TILE.k_bufs) & 1)
        issue_qk_swapped(cfg.tile.d_qk, ops.qk, acc_s, tSrK, tSrQ, nbuf)
        warpgroup.wait_group(1)
        cute.arch.mbarrier_arrive(k_free + buf)
        warpgroup.wait_group(0)


@cute.jit
def store_out(cfg: Sm90SparseDecodeConfig, smem: Smem, ops: SwappedOps, tma: cute.CopyAtom, dst: cute.Tensor, acc_o,
              col_half: cutlass.Constexpr, s_idx, row, warp, lane, bar_id: cutlass.Constexpr):
    """This warp group's O^T (dims 256 col_half .., already scaled) as ``dst[row, s_idx, :, dims]``
    (out, or a split piece's o_accum row; ``dst`` viewed (h, d, s_q, rows)): each 64-dim chunk
    staged transposed (h x 64, :func:`~.swapped.store_transposed`) in the warp group's part of the
    Q buffer, then stored by one TMA box (warp 0), overlapping the next chunk's staging; warp 0
    waits for the reads at the end."""
    h = cfg.h_q
    block_elems = h * TILE.chunk
    stage_base = smem.storage.sQ.data_ptr().toint()
    g_o = cute.flat_divide(dst, (h, TILE.chunk))
    for k in cutlass.range_constexpr(OUT_CHUNKS):
        elem = (col_half * OUT_CHUNKS + k) * block_elems
        store_transposed(stage_base + elem * 2, acc_o, k * (h // 2), h, warp, lane)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=TILE.threads_per_wg)
        if warp == 0:
            staged = cute.make_tensor(cute.recast_ptr(smem.sQ.iterator + elem, ops.chunk_layout.inner, BFloat16),
                                      ops.chunk_layout.outer)
            t_s, t_g = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(staged, 0, 2),
                                             cute.group_modes(g_o, 0, 2))
            with cute.arch.elect_one():
                cute.copy(tma, t_s, t_g[None, 0, col_half * OUT_CHUNKS + k, s_idx, row])
                cute.arch.cp_async_bulk_commit_group()
    if warp == 0:
        with cute.arch.elect_one():
            cute.arch.cp_async_bulk_wait_group(0, read=True)
    cute.arch.sync_warp()


@cute.jit
def store_request(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, smem: Smem, ops: SwappedOps, acc_o,
                  col_half: cutlass.Constexpr, req, split_rows, warp, lane, bar_id: cutlass.Constexpr):
    """This warp group's half of request ``req``'s output: o_accum's row where the request is a
    split piece here, out otherwise."""
    is_split, acc_row = split_piece(cfg, cta, req, split_rows)
    if is_split:
        if cutlass.const_expr(cfg.split):
            store_out(cfg, smem, ops, g.tma_oacc, g.mOAcc, acc_o, col_half, cta.s_idx, acc_row, warp, lane, bar_id)
    else:
        store_out(cfg, smem, ops, g.tma_out, g.mOut, acc_o, col_half, cta.s_idx, request_id(cfg, g, req), warp, lane,
                  bar_id)


@cute.jit
def softmax_wg(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, smem: Smem, ops: SwappedOps, scale_log2: Float32):
    h = cfg.h_q
    begin_req, end_req, _, _ = cta.sched
    wtid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = cute.arch.make_warp_uniform(wtid // 32)
    lane = wtid % 32
    quad = lane % 4
    q_full = smem.storage.q_full.data_ptr()
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    info_base = smem.storage.tile_info.data_ptr().toint()
    p_base = smem.storage.sP.data_ptr().toint()
    s_scale = smem.storage.head_scale.get_tensor(cute.make_layout(h))
    s_x = smem.storage.exchange.get_tensor(cute.make_layout((h, WARPS, XCHG_BUFS)))

    gQ = cute.flat_divide(g.mQ, (h, cfg.tile.d_qk))
    tQsQ, tQgQ = cpasync.tma_partition(g.tma_q, 0, cute.make_layout(1), cute.group_modes(smem.sQ, 0, 2),
                                       cute.group_modes(gQ, 0, 2))
    ops.qk.set(warpgroup.Field.ACCUMULATE, True)
    ops.pv.set(warpgroup.Field.ACCUMULATE, True)
    thr_qk = ops.qk.get_slice(wtid)
    tSrK = thr_qk.make_fragment_A(thr_qk.partition_A(smem.sK))
    tSrQ = thr_qk.make_fragment_B(thr_qk.partition_B(smem.sQ))
    acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE.tokens, h)))
    thr_pv = ops.pv.get_slice(wtid)
    tOrV = thr_pv.make_fragment_A(thr_pv.partition_A(k_tensors_for_pv(cfg, smem.sK, 0)))
    tOrP = thr_pv.make_fragment_B(thr_pv.partition_B(smem.sP))
    acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE.half_v, h)))
    slots = h // 4
    m = cute.make_rmem_tensor(cute.make_layout(slots), Float32)
    l = cute.make_rmem_tensor(cute.make_layout(slots), Float32)
    sc = cute.make_rmem_tensor(cute.make_layout(slots), Float32)
    lse = cute.make_rmem_tensor(cute.make_layout(slots), Float32)

    split_rows = split_rows_of_partition(cfg, g, cta)
    n = Int32(0)    # the partition's tiles so far (the producer's count)
    rq = Int32(0)   # requests done
    for req in cutlass.range(begin_req, end_req + 1, unroll=1):
        start, stop, _, _, _ = request_range(cfg, g, cta, req)
        rid = request_id(cfg, g, req)
        if rq > 0:
            # WG1's output store of the previous request no longer reads its staging (in sQ).
            cute.arch.barrier(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(q_full, h * cfg.tile.d_qk * 2)
            cute.copy(g.tma_q, tQgQ[None, 0, 0, cta.s_idx, rid], tQsQ, tma_bar_ptr=q_full)
        m.fill(-1e30)
        l.fill(0.0)
        acc_o.fill(0.0)
        cute.arch.mbarrier_wait(q_full, rq & 1)
        if start < stop:
            cute.arch.mbarrier_wait(k_full + n % TILE.k_bufs, (n // TILE.k_bufs) & 1)
            issue_qk_swapped(cfg.tile.d_qk, ops.qk, acc_s, tSrK, tSrQ, n % TILE.k_bufs)
            warpgroup.wait_group(0)
        # Compacted tiles: a request has at most stop - start tiles; the producer flags its last.
        active = start < stop
        for _ in cutlass.range(start, stop, unroll=1):
            if active:
                buf = n % TILE.k_bufs
                last_word = last_of(info_base, buf)
                swapped_softmax(acc_s, tile_word(info_base, buf, warp, lane), scale_log2, m, l, sc, s_x, buf, warp,
                                lane, Bar.EPI_SOFTMAX)
                # P^T and the heads' factors to WG1 once it has read the last ones; the 256-thread
                # sync also orders every WG0 thread's P^T writes before WG0's own SS wgmma reads them.
                cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
                if (warp == 0) & (lane < 4):
                    for s in cutlass.range_constexpr(slots):
                        s_scale[head_of(s, quad)] = sc[s]
                store_transposed(p_base, acc_s, 0, h, warp, lane)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)

                scale_heads(acc_o, sc, h)
                warpgroup.fence()
                cute.gemm(ops.pv, acc_o, tOrV[None, None, None, buf], tOrP[None, None, None, 0], acc_o)
                warpgroup.commit_group()
                next_qk_behind_pv(cfg, ops, acc_s, tSrK, tSrQ, k_full, k_free, n, last_word != 0)
                n += 1
                active = last_word == 0

        # ---- epilogue: the heads' sums over the 64 rows' threads, factors to WG1, output, lse
        for s in cutlass.range_constexpr(slots):
            l[s] = rows_sum(l[s])
        exchange(l, s_x, SUM_BUF, warp, lane, False, Bar.EPI_SOFTMAX)
        is_split, acc_row = split_piece(cfg, cta, req, split_rows)
        for s in cutlass.range_constexpr(slots):
            o_scale, row_lse = finalize_row(cfg, g.mSink, l[s], m[s], is_split, head_of(s, quad))
            sc[s] = o_scale
            lse[s] = row_lse
        cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
        if (warp == 0) & (lane < 4):
            for s in cutlass.range_constexpr(slots):
                s_scale[head_of(s, quad)] = sc[s]
        cute.arch.barrier_arrive(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
        scale_heads(acc_o, sc, h)
        store_request(cfg, g, cta, smem, ops, acc_o, 0, req, split_rows, warp, lane, Bar.EPI_SOFTMAX)
        # The lse stores go after the output's (its staging fences the generic proxy).
        if (warp == 0) & (lane < 4):
            if is_split:
                if cutlass.const_expr(cfg.split):
                    for s in cutlass.range_constexpr(slots):
                        g.mLseAcc[acc_row, cta.s_idx, head_of(s, quad)] = lse[s]
            else:
                for s in cutlass.range_constexpr(slots):
                    g.mLse[rid, cta.s_idx, head_of(s, quad)] = lse[s]
        rq += 1
    # Balance the barriers WG1 arrived on once more than WG0 synced (a partition here has a request).
    cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
    cute.arch.barrier(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)


@cute.jit
def pv_right_wg(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, smem: Smem, ops: SwappedOps):
    h = cfg.h_q
    begin_req, end_req, _, _ = cta.sched
    wtid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = cute.arch.make_warp_uniform(wtid // 32)
    lane = wtid % 32
    quad = lane % 4
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    info_base = smem.storage.tile_info.data_ptr().toint()
    s_scale = smem.storage.head_scale.get_tensor(cute.make_layout(h))

    ops.pv.set(warpgroup.Field.ACCUMULATE, True)
    thr_pv = ops.pv.get_slice(wtid)
    tOrV = thr_pv.make_fragment_A(thr_pv.partition_A(k_tensors_for_pv(cfg, smem.sK, 1)))
    tOrP = thr_pv.make_fragment_B(thr_pv.partition_B(smem.sP))
    acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE.half_v, h)))
    slots = h // 4
    sc = cute.make_rmem_tensor(cute.make_layout(slots), Float32)

    split_rows = split_rows_of_partition(cfg, g, cta)
    # sP / head_scale start out free.
    cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
    n = Int32(0)
    for req in cutlass.range(begin_req, end_req + 1, unroll=1):
        start, stop, _, _, _ = request_range(cfg, g, cta, req)
        acc_o.fill(0.0)
        active = start < stop
        for _ in cutlass.range(start, stop, unroll=1):
            if active:
                buf = n % TILE.k_bufs
                cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
                for s in cutlass.range_constexpr(slots):
                    sc[s] = s_scale[head_of(s, quad)]
                # WG0 already waited for this buffer; waiting on the same phase gives WG1 its own
                # acquire of the producer's writes (the producer cannot refill it before WG1 releases).
                cute.arch.mbarrier_wait(k_full + buf, (n // TILE.k_bufs) & 1)
                last_word = last_of(info_base, buf)
                scale_heads(acc_o, sc, h)
                warpgroup.fence()
                cute.gemm(ops.pv, acc_o, tOrV[None, None, None, buf], tOrP[None, None, None, 0], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
                cute.arch.mbarrier_arrive(k_free + buf)
                n += 1
                active = last_word == 0

        cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
        for s in cutlass.range_constexpr(slots):
            sc[s] = s_scale[head_of(s, quad)]
        cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
        scale_heads(acc_o, sc, h)
        store_request(cfg, g, cta, smem, ops, acc_o, 1, req, split_rows, warp, lane, Bar.EPI_PV_RIGHT)
        # The staging (in sQ) is no longer read: WG0 may load the next request's Q.
        cute.arch.barrier_arrive(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)
