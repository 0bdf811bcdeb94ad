"""WG1 (``Role.PV_RIGHT``): P V into O's right columns and their epilogue.

Per K tile it waits for WG0's P and row factors (``P_READY``), rescales its O, runs the SS wgmma
P V[:, right] from shared memory and frees P (``P_FREE``) and the K buffer (``k_free``). At a
request's end it takes the final row factors from WG0 the same way and stores its half of O.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import warpgroup

from ...dsl import ptx
from . import ptx as sm90_ptx
from .config import TILE, Bar, Sm90SparseDecodeConfig, Stamp
from .cta import Cta, Gmem, Smem, request_id, request_lengths, request_span, split_piece, split_rows_of_partition, stamp
from .epilogue import (BlockStore, issue_chunk_stores, k_staging, q_staging, release_stored_buffer, stages_in_k,
                       store_block, store_chunked, wait_peer_got)
from .mma import Ops, column_block, k_tensors_for_pv, scale_rows

PAIR_THREADS = 2 * TILE.threads_per_wg   # the named barriers WG0 and WG1 share


@cute.jit
def pv_right_wg(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, smem: Smem, ops: Ops):
    begin_req, end_req, begin_block, end_block = cta.sched
    wtid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = cute.arch.make_warp_uniform(wtid // 32)
    lane = wtid % 32
    row0 = warp * 16 + lane // 4
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    info_base = smem.storage.tile_info.data_ptr().toint()
    s_row_scale = smem.storage.row_scale.get_tensor(cute.make_layout(TILE.heads))

    ops.pv_ss.set(warpgroup.Field.ACCUMULATE, True)
    thr_pv = ops.pv_ss.get_slice(wtid)
    tOrP = thr_pv.make_fragment_A(thr_pv.partition_A(smem.sP))
    col = column_block(cfg, 1)
    sV = k_tensors_for_pv(cfg, smem.sK, col)
    tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
    acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE.heads, cfg.pv_cols)))

    split_rows = split_rows_of_partition(cfg, g, cta)
    peer_got = peer_got_of_peer(cfg, smem)
    # sP / row_scale start out free.
    cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
    n = Int32(0)
    pending = cutlass.Boolean(False)   # the previous request's O was staged in K buffer (n - 1) % 2: its k_free is held
    ahead = request_lengths(cfg, g, begin_req)   # the lengths request_span reads (stage_in_k)
    for req in cutlass.range(begin_req, end_req + 1, unroll=1):
        start, stop, ahead = request_span(cfg, g, cta, req, ahead)
        in_k = stages_in_k(cfg, start, stop, req, end_req, split_piece(cfg, cta, req, split_rows)[0])
        if cutlass.const_expr(cfg.tuning.stage_in_k):
            # The previous request's O was staged in its last tile's buffer: its k_free arrival
            # is given as soon as the stores have read it (WG1 has nothing to do before WG0's
            # first P of this request), so the producer refills it for tile n + 1 without a wait.
            release_stored_buffer(k_free, (n - 1) % TILE.k_bufs, warp, pending)
        acc_o.fill(0.0)
        # Compacted tiles: a request has at most stop - start tiles; the producer flags its last.
        active = start < stop
        for blk in cutlass.range(start, stop, unroll=1):
            if active:
                buf = n % TILE.k_bufs
                cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
                stamp(cta, Stamp.WG1_P, wtid == 0)
                sc0 = s_row_scale[row0]
                sc1 = s_row_scale[row0 + 8]
                # WG0 already waited for this buffer; waiting on the same phase here gives WG1 its own
                # acquire of the producer's writes (the producer cannot refill it before WG1 releases).
                cute.arch.mbarrier_wait(k_full + buf, (n // TILE.k_bufs) & 1)
                signal_peer_got(cfg, peer_got, buf, wtid)
                last_word = ptx.ld_shared_i32(info_base + buf * (TILE.info_words * 4) + 8)
                scale_rows(acc_o, sc0, sc1)
                warpgroup.fence()
                cute.gemm(ops.pv_ss, acc_o, tOrP[None, None, None, 0], tOrV[None, None, None, buf], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                stamp(cta, Stamp.WG1_PV_DONE, wtid == 0)
                cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
                # A last tile's buffer is held where the request's O is staged in it.
                if not ((last_word != 0) & in_k):
                    cute.arch.mbarrier_arrive(k_free + buf)
                n += 1
                active = last_word == 0

        cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
        o_scale0 = s_row_scale[row0]
        o_scale1 = s_row_scale[row0 + 8]
        cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
        scale_rows(acc_o, o_scale0, o_scale1)
        # The partition's last request is always staged in Q, so no held arrival outlives the loop.
        pending = in_k
        is_split, acc_row = split_piece(cfg, cta, req, split_rows)
        if is_split:
            if cutlass.const_expr(cfg.split):
                store_o_right(cfg, cta, smem, acc_o, thr_pv, BlockStore(g.tma_oacc, g.mOAcc, ops.chunk_layout), col,
                              warp, acc_row, False, in_k, n)
        else:
            store_o_right(cfg, cta, smem, acc_o, thr_pv, BlockStore(g.tma_out, g.mOut, ops.chunk_layout), col, warp,
                          request_id(cfg, g, req), cfg.out_from_registers, in_k, n)
        stamp(cta, Stamp.WG1_EPILOGUE, wtid == 0)
        # The staging in sQ (not where the O went to the K buffer) is no longer read: WG0 may
        # load the next Q.
        if not in_k:
            cute.arch.barrier_arrive(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)


@cute.jit
def store_o_right(cfg: Sm90SparseDecodeConfig, cta: Cta, smem: Smem, acc_o, thr_pv, to: BlockStore, col, warp, row,
                  direct: cutlass.Constexpr, in_k, n: Int32):
    """WG1's O block, staged in its half of the Q buffer and stored (the caller then signals
    ``Q_FREE``: WG0 may load the next Q); or, where ``in_k`` (``Sm90Tuning.stage_in_k``), staged
    in the K buffer of the request's last tile (n - 1) and stored from there, with WG0's block,
    which WG0 staged beside it (``Bar.O_STAGED``); the stores' reads are waited for at the next
    request's start (:func:`~.epilogue.release_stored_buffer`)."""
    if cutlass.const_expr(direct):   # no tensor map to store from a staging (never in_k: stages_in_k)
        store_block(cfg, cta, acc_o, thr_pv, to, None, col, warp, row, Bar.EPI_PV_RIGHT, True)
    elif in_k:
        buf = (n - 1) % TILE.k_bufs
        wait_peer_got(cfg, smem.storage, n - 1)
        store_chunked(cfg, cta, acc_o, to, k_staging(cfg, smem.sK, buf, col), col, warp, row, Bar.EPI_PV_RIGHT,
                      True, False)
        cute.arch.barrier(barrier_id=Bar.O_STAGED, number_of_threads=PAIR_THREADS)
        left = column_block(cfg, 0)
        issue_chunk_stores(cfg, cta, to, k_staging(cfg, smem.sK, buf, left), left, warp, row)
    else:
        store_block(cfg, cta, acc_o, thr_pv, to, q_staging(cfg, smem.sQ, col), col, warp, row, Bar.EPI_PV_RIGHT,
                    False)


def peer_got_of_peer(cfg: Sm90SparseDecodeConfig, smem: Smem):
    """The peer CTA's ``peer_got`` array as a cluster address (``Sm90SparseDecodeConfig.peer_got``),
    else None. A plain function, inlined at trace time."""
    if not cfg.peer_got:
        return None
    peer = cute.arch.block_idx_in_cluster() ^ 1
    return sm90_ptx.mapa_shared_cluster(smem.storage.peer_got.data_ptr().toint(), peer)


@cute.jit
def signal_peer_got(cfg: Sm90SparseDecodeConfig, peer_got, buf, wtid):
    """Cluster kernels with ``stage_in_k``: every tile, once this CTA has received it whole
    (``k_full``), thread 0 tells the peer its half has arrived, so its copies' source may be
    overwritten (:func:`~.epilogue.wait_peer_got`)."""
    if cutlass.const_expr(cfg.peer_got):
        if wtid == 0:
            # Relaxed: it reports this CTA's k_full phase (the peer's copies have landed, so they
            # have read their source) and orders no memory operation of this thread; the release
            # form put a MEMBAR.ALL.GPU in front of WG1's P V on every tile.
            sm90_ptx.mbarrier_arrive_remote(peer_got + buf * TILE.mbar_bytes, relaxed=True)
