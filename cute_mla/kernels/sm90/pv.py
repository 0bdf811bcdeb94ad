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
from .config import TILE, Bar, Sm90SparseDecodeConfig, Stamp
from .cta import Cta, Gmem, Smem, request_id, request_range, split_piece, split_rows_of_partition, stamp
from .epilogue import BlockStore, q_staging, store_block
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
    # sP / row_scale start out free.
    cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
    n = Int32(0)
    for req in cutlass.range(begin_req, end_req + 1, unroll=1):
        start, stop, _, _, _ = request_range(cfg, g, cta, req)
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
                last_word = ptx.ld_shared_i32(info_base + buf * (TILE.info_words * 4) + 8)
                scale_rows(acc_o, sc0, sc1)
                warpgroup.fence()
                cute.gemm(ops.pv_ss, acc_o, tOrP[None, None, None, 0], tOrV[None, None, None, buf], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                stamp(cta, Stamp.WG1_PV_DONE, wtid == 0)
                cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
                cute.arch.mbarrier_arrive(k_free + buf)
                n += 1
                active = last_word == 0

        cute.arch.barrier(barrier_id=Bar.P_READY, number_of_threads=PAIR_THREADS)
        o_scale0 = s_row_scale[row0]
        o_scale1 = s_row_scale[row0 + 8]
        cute.arch.barrier_arrive(barrier_id=Bar.P_FREE, number_of_threads=PAIR_THREADS)
        scale_rows(acc_o, o_scale0, o_scale1)
        is_split, acc_row = split_piece(cfg, cta, req, split_rows)
        if is_split:
            if cutlass.const_expr(cfg.split):
                store_o_right(cfg, cta, smem, acc_o, thr_pv, BlockStore(g.tma_oacc, g.mOAcc, ops.chunk_layout), col,
                              warp, acc_row, False)
        else:
            store_o_right(cfg, cta, smem, acc_o, thr_pv, BlockStore(g.tma_out, g.mOut, ops.chunk_layout), col, warp,
                          request_id(cfg, g, req), cfg.out_from_registers)
        stamp(cta, Stamp.WG1_EPILOGUE, wtid == 0)
        # The staging (aliasing sQ) is no longer read: WG0 may load the next Q.
        cute.arch.barrier_arrive(barrier_id=Bar.Q_FREE, number_of_threads=PAIR_THREADS)


@cute.jit
def store_o_right(cfg: Sm90SparseDecodeConfig, cta: Cta, smem: Smem, acc_o, thr_pv, to: BlockStore, col, warp, row,
                  direct: cutlass.Constexpr):
    """WG1's O block, staged in its half of the Q buffer and stored (the caller then signals
    ``Q_FREE``: WG0 may load the next Q), or from registers where ``direct``."""
    if cutlass.const_expr(direct):   # no tensor map to store from a staging
        store_block(cfg, cta, acc_o, thr_pv, to, None, col, warp, row, Bar.EPI_PV_RIGHT, True)
    else:
        store_block(cfg, cta, acc_o, thr_pv, to, q_staging(cfg, smem.sQ, col), col, warp, row, Bar.EPI_PV_RIGHT,
                    False)
