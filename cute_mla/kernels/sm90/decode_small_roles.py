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
tile n of the partition in buffer n % 2 with phase (n / 2) & 1, ``k_full[b]`` 128 arrivals a
producer warp group (this tile runs two, each converting one half of every tile),
``k_free[b]`` 256 (each MMA group once its PV of the tile retired), the tile's 64-bit validity
mask and its request's last-tile flag in ``tile_info``; ``finalize_row`` (sinks, empty rows, a
split piece's base-2 lse). MMA warp w holds tile rows 16 w .. 16 w + 15: bits 16 (w % 2) ..
of mask word w / 2.

Named barriers (:class:`~.config.Bar`): ``P_FREE`` (WG1 -> WG0: P^T and the factors read),
``P_READY`` (256 threads: per tile a sync of both groups, so it also orders WG0's own P^T writes
before its SS wgmma; at a request's end WG0 only arrives), ``Q_FREE`` (WG1 -> WG0: its staging
left the Q buffer), ``EPI_SOFTMAX`` (WG0: the max / sum exchange and its output chunks),
``EPI_PV_RIGHT`` (WG1's output chunks). No wgmma is left pending at a loop edge or branch merge.
``tests/test_sparse_decode_small_protocol.py`` runs a transcription of these operations under
random interleavings (keep it in step with the roles).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import warpgroup

from ...dsl import ptx
from .config import TILE, Bar, Sm90SparseDecodeConfig, Stamp
from .cta import Cta, Gmem, Smem, request_id, request_range, split_piece, split_rows_of_partition, stamp
from .mma import k_tensors_for_pv
from .softmax import next_qk_behind_pv
from .swapped import (SUM_BUF, Lane, SwappedOps, final_factors, get_factors, hand_over_tile, head_of, head_sums,
                      issue_pv, issue_qk_swapped, lane_of, start_walk, store_out, swapped_softmax, take_final,
                      wg0_state, wg1_state)

PAIR_THREADS = 2 * TILE.threads_per_wg   # the named barriers WG0 and WG1 share


def tile_word(info_base, buf, warp, lane):
    """This thread's rows' validity in K buffer ``buf``'s 64-bit mask: bit 0 row ``16 warp + lane /
    4``, bit 8 that row + 8. A plain function, inlined at trace time."""
    word = Uint32(ptx.ld_shared_i32(info_base + buf * (TILE.info_words * 4) + 4 * (warp // 2)))
    return word >> Uint32(16 * (warp % 2) + lane // 4)


def last_of(info_base, buf):
    """K buffer ``buf``'s tile is its request's last (the producer's flag). A plain function."""
    return ptx.ld_shared_i32(info_base + buf * (TILE.info_words * 4) + 8)


@cute.jit
def store_request(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, smem: Smem, ops: SwappedOps, acc_o,
                  col_half: cutlass.Constexpr, req, split_rows, ln: Lane, bar_id: cutlass.Constexpr):
    """This warp group's half of request ``req``'s output (:func:`~.swapped.store_out`): o_accum's
    row where the request is a split piece here, out otherwise."""
    is_split, acc_row = split_piece(cfg, cta, req, split_rows)
    if is_split:
        if cutlass.const_expr(cfg.split):
            store_out(smem.sQ, ops.chunk_layout, g.tma_oacc, g.mOAcc, acc_o, cfg.h_q, col_half, cta.s_idx, acc_row, ln,
                      bar_id)
    else:
        store_out(smem.sQ, ops.chunk_layout, g.tma_out, g.mOut, acc_o, cfg.h_q, col_half, cta.s_idx,
                  request_id(cfg, g, req), ln, bar_id)


@cute.jit
def softmax_wg(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, smem: Smem, ops: SwappedOps, scale_log2: Float32):
    h = cfg.h_q
    begin_req, end_req, _, _ = cta.sched
    ln = lane_of()
    q_full = smem.storage.q_full.data_ptr()
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    info_base = smem.storage.tile_info.data_ptr().toint()
    st = wg0_state(ops, smem.storage, g.tma_q, g.mQ, smem.sQ, smem.sK, k_tensors_for_pv(cfg, smem.sK, 0), smem.sP, h,
                   cfg.tile.d_qk, ln)
    slots = h // 4

    split_rows = split_rows_of_partition(cfg, g, cta)
    n = Int32(0)    # the partition's tiles so far (the producer's count)
    rq = Int32(0)   # requests done
    for req in cutlass.range(begin_req, end_req + 1, unroll=1):
        start, stop, _, _, _ = request_range(cfg, g, cta, req)
        rid = request_id(cfg, g, req)
        start_walk(st, g.tma_q, q_full, h * cfg.tile.d_qk * 2, cta.s_idx, rid, rq, ln, Bar.Q_FREE)
        stamp(cta, Stamp.Q_READY, ln.wtid == 0)
        if start < stop:
            cute.arch.mbarrier_wait(k_full + n % TILE.k_bufs, (n // TILE.k_bufs) & 1)
            stamp(cta, Stamp.K_READY, ln.wtid == 0)
            issue_qk_swapped(cfg.tile.d_qk, ops.qk, st.acc_s, st.tSrK, st.tSrQ, n % TILE.k_bufs)
            warpgroup.wait_group(0)
            stamp(cta, Stamp.QK_DONE, ln.wtid == 0)
        # Compacted tiles: a request has at most stop - start tiles; the producer flags its last.
        active = start < stop
        for _ in cutlass.range(start, stop, unroll=1):
            if active:
                buf = n % TILE.k_bufs
                last_word = last_of(info_base, buf)
                swapped_softmax(st.acc_s, tile_word(info_base, buf, ln.warp, ln.lane), scale_log2, st.m, st.l, st.sc,
                                st.s_x, buf, ln.warp, ln.lane, Bar.EPI_SOFTMAX)
                hand_over_tile(st.s_scale, st.sc, st.p_base, st.acc_s, h, ln, Bar.P_FREE, Bar.P_READY)
                stamp(cta, Stamp.P_READY, ln.wtid == 0)
                issue_pv(ops.pv, st.acc_o, st.tOrV[None, None, None, buf], st.tOrP, st.sc, h)
                next_qk_behind_pv(lambda b: issue_qk_swapped(cfg.tile.d_qk, ops.qk, st.acc_s, st.tSrK, st.tSrQ, b),
                                  k_full, k_free, n, last_word != 0)
                n += 1
                active = last_word == 0

        # ---- epilogue: the heads' sums over the 64 rows' threads, factors to WG1, output, st.lse
        stamp(cta, Stamp.PV_DONE, ln.wtid == 0)
        head_sums(st.l, st.s_x, SUM_BUF, ln, Bar.EPI_SOFTMAX)
        is_split, acc_row = split_piece(cfg, cta, req, split_rows)
        final_factors(cfg, st, g.mSink, is_split, ln, h, Bar.P_FREE, Bar.P_READY)
        stamp(cta, Stamp.EPI_FINAL, ln.wtid == 0)
        store_request(cfg, g, cta, smem, ops, st.acc_o, 0, req, split_rows, ln, Bar.EPI_SOFTMAX)
        stamp(cta, Stamp.EPILOGUE, ln.wtid == 0)
        # The st.lse stores go after the output's (its staging fences the generic proxy).
        if (ln.warp == 0) & (ln.lane < 4):
            if is_split:
                if cutlass.const_expr(cfg.split):
                    for s in cutlass.range_constexpr(slots):
                        g.mLseAcc[acc_row, cta.s_idx, head_of(s, ln.quad)] = st.lse[s]
            else:
                for s in cutlass.range_constexpr(slots):
                    g.mLse[rid, cta.s_idx, head_of(s, ln.quad)] = st.lse[s]
        rq += 1
    # Balance the barriers WG1 arrived on once more than WG0 synced (a partition here has a request).
    cute.arch.barrier(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
    cute.arch.barrier(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)
    stamp(cta, Stamp.EXIT_NS, ln.wtid == 0)


@cute.jit
def pv_right_wg(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, smem: Smem, ops: SwappedOps):
    h = cfg.h_q
    begin_req, end_req, _, _ = cta.sched
    ln = lane_of()
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    info_base = smem.storage.tile_info.data_ptr().toint()
    st = wg1_state(ops, smem.storage, k_tensors_for_pv(cfg, smem.sK, 1), smem.sP, h, ln)

    split_rows = split_rows_of_partition(cfg, g, cta)
    # sP / head_scale start out free.
    cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
    n = Int32(0)
    for req in cutlass.range(begin_req, end_req + 1, unroll=1):
        start, stop, _, _, _ = request_range(cfg, g, cta, req)
        st.acc_o.fill(0.0)
        active = start < stop
        for _ in cutlass.range(start, stop, unroll=1):
            if active:
                buf = n % TILE.k_bufs
                cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
                stamp(cta, Stamp.WG1_P, ln.wtid == 0)
                get_factors(st.s_scale, st.sc, ln.quad)
                # WG0 already waited for this buffer; waiting on the same phase gives WG1 its own
                # acquire of the producer's writes (the producer cannot refill it before WG1 releases).
                cute.arch.mbarrier_wait(k_full + buf, (n // TILE.k_bufs) & 1)
                last_word = last_of(info_base, buf)
                issue_pv(ops.pv, st.acc_o, st.tOrV[None, None, None, buf], st.tOrP, st.sc, h)
                warpgroup.wait_group(0)
                stamp(cta, Stamp.WG1_PV_DONE, ln.wtid == 0)
                cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
                cute.arch.mbarrier_arrive(k_free + buf)
                n += 1
                active = last_word == 0

        take_final(st, ln, h, Bar.P_FREE, Bar.P_READY)
        store_request(cfg, g, cta, smem, ops, st.acc_o, 1, req, split_rows, ln, Bar.EPI_PV_RIGHT)
        stamp(cta, Stamp.WG1_EPILOGUE, ln.wtid == 0)
        # The staging (in sQ) is no longer read: WG0 may load the next request's Q.
        cute.arch.barrier_arrive(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)
