"""Row scaling, final softmax normalisation and output stores of the SM90 sparse decode kernel."""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync

from . import ptx
from .sparse_decode_common import TILE, Bar, Stamp

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


class EpilogueMixin:
    @staticmethod
    def c_layout_to_a_layout(c_layout, a_value_shape):
        """Register layout of a 64xK accumulator re-read as the A operand of an RS wgmma (16-bit).

        The accumulator value mode is (2 cols, 2 rows, K/8 column groups); the A operand of one
        k-block (16 columns) is (2, 2, 2): the same registers, two column groups per k-block. For
        16-bit P no lane shuffle is needed (only 8-bit A operands need one).
        """
        return cute.make_layout(
            (a_value_shape, c_layout.shape[1], (c_layout.shape[2], cute.size(c_layout, mode=[0]) // cute.size(a_value_shape))),
            stride=(
                c_layout.stride[0],
                c_layout.stride[1],
                (c_layout.stride[2], cute.size(a_value_shape, mode=[2]) * c_layout.stride[0][2]),
            ),
        )

    @cute.jit
    def scale_rows(self, acc: cute.Tensor, s0: Float32, s1: Float32):
        """acc *= s0 on this thread's first accumulator row, s1 on its second (row + 8)."""
        for v in cutlass.range_constexpr(cute.size(acc)):
            if cutlass.const_expr((v // 2) % 2 == 0):
                acc[v] = acc[v] * s0
            else:
                acc[v] = acc[v] * s1

    @cute.jit
    def finalize_row(self, l_sum: Float32, m: Float32, is_split, mSink: Optional[cute.Tensor], head: Int32):
        """(O factor, lse) of one row (spec §3.3).

        Split piece: O/L and log2(L) + m (base 2, no sink; -inf if L == 0).
        Otherwise:   O/(L + 2^(sink*log2e - m)) and ln(L) + m*ln2 (+inf if L == 0; sink not in lse).
        """
        empty = l_sum == Float32(0.0)
        log2_l = cute.math.log2(cutlass.select_(empty, Float32(1.0), l_sum)) + m
        o_scale = Float32(0.0)
        lse = Float32(0.0)
        if is_split:
            o_scale = Float32(cutlass.select_(empty, Float32(0.0), Float32(1.0) / l_sum))
            lse = Float32(cutlass.select_(empty, -Float32.inf, log2_l))
        else:
            denom = l_sum
            if cutlass.const_expr(self.cfg.has_attn_sink):
                denom = l_sum + cute.math.exp2(mSink[head] * Float32(LOG2E) - m, fastmath=True)
            o_scale = Float32(cutlass.select_(empty, Float32(0.0), Float32(1.0) / denom))
            lse = Float32(cutlass.select_(empty, Float32.inf, log2_l * Float32(LN2)))
        return o_scale, lse

    @cute.jit
    def store_out(self, acc_o, thr_pv, tma_out, mOut, sQ, o_layout, col_half: int, warp, hblk, s_idx, req, bar_id: int):
        """bf16 O block (64 x ``pv_cols``: 256, 128 in the column pair; already scaled) -> out[req, s, heads, cols]
        (:meth:`store_bf16_block`; from registers with ``out_direct``: ``Tuning.out_direct_store`` or the column pair)."""
        self.store_bf16_block(acc_o, thr_pv, tma_out, mOut, sQ, o_layout, col_half, warp, hblk, s_idx, req, bar_id,
                              self.out_direct, self.tuning.l2_hints)

    def stamp_staged(self, bar_id: int):
        """``Tuning.timeline``: this warp group's block staged (the warp group is named by its
        epilogue barrier). A plain function, inlined at trace time."""
        self.stamp(Stamp.EPI_STAGED if bar_id == Bar.EPI_SOFTMAX else Stamp.WG1_EPI_STAGED,
                   cute.arch.thread_idx()[0] % TILE.threads_per_wg == 0)

    @cute.jit
    def store_bf16_block(self, acc_o, thr_pv, tma, mDst, sQ, o_layout, col_half: int, warp, hblk, s_idx, row,
                         bar_id: int, direct: bool, evict_first: bool):
        """An O block (64 x ``pv_cols``, fp32 registers) as bf16 -> mDst[row, s, heads, cols]: staged in
        this warp group's half of sQ (``o_layout``: 64 x ``pv_cols``) and stored by TMA (a 64 x
        ``pv_cols`` box; ``col_half`` counts such blocks, 0-3 in the column pair), or (``direct``)
        per-thread stores from the registers, no staging. ``evict_first``: the TMA store's L2 hint
        (out with ``Tuning.l2_hints``; never for o_accum, which the combine reads back)."""
        if cutlass.const_expr(self.chunked and not direct):
            self.store_bf16_chunked(acc_o, tma, mDst, sQ, o_layout, col_half, warp, hblk, s_idx, row, bar_id, evict_first)
            return
        r_o = cute.make_rmem_tensor(acc_o.layout, BFloat16)
        r_o.store(acc_o.load().to(BFloat16))
        if cutlass.const_expr(direct):
            tile = cute.local_tile(mDst[row, s_idx, None, None], (TILE.heads, self.pv_cols), (hblk, col_half))
            cute.autovec_copy(r_o, thr_pv.partition_C(tile))
            return
        # the warp group's staging slot: its half of sQ (col_half % 2 is the warp group in the pair too)
        stage = cute.make_tensor(
            cute.recast_ptr(sQ.iterator + (col_half % 2) * (TILE.stage_bytes // 2), o_layout.inner, BFloat16), o_layout.outer
        )
        cute.autovec_copy(r_o, thr_pv.partition_C(stage))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=TILE.threads_per_wg)
        self.stamp_staged(bar_id)
        if warp == 0:
            g_o = cute.flat_divide(mDst, (TILE.heads, self.pv_cols))
            t_s, t_g = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(stage, 0, 2), cute.group_modes(g_o, 0, 2))
            # TMA stores are not elected by cute.copy (loads are): one lane issues, commits and waits.
            with cute.arch.elect_one():
                if cutlass.const_expr(evict_first):
                    cute.copy(tma, t_s, t_g[None, hblk, col_half, s_idx, row], cache_policy=ptx.l2_policy("evict_first"))
                else:
                    cute.copy(tma, t_s, t_g[None, hblk, col_half, s_idx, row])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()

    @cute.jit
    def store_bf16_chunked(self, acc_o, tma, mDst, sQ, chunk_layout, col_half: int, warp, hblk, s_idx, row, bar_id: int,
                           evict_first: bool):
        """``Tuning.chunked_epilogue``: :meth:`store_bf16_block`'s staged path in 64-column chunks.

        The O block's ``pv_cols / 64`` chunks are staged one after the other in this warp group's
        half of sQ (chunk k at +8 KiB k, ``chunk_layout``: 64 x 64 in SW128 rows of 128 B), each
        with four ``stmatrix.x4`` per thread, and chunk k's TMA store (one 64 x 64 box) is issued
        by warp 0 once the warp group has staged it, so the store of chunk k overlaps the staging
        of chunk k+1. Warp 0 waits for the reads of all of them at the end.

        Accumulator fragment entry v = c + 2 r + 4 j of a thread (lane l of warp w) holds row
        16 w + l // 4 + 8 r, column 8 j + 2 (l % 4) + c. One stmatrix.x4 covers the 8-column
        groups j0 and j0 + 1 of both row halves: matrix m is (j0 + m // 2, r = m % 2), and lane l
        addresses row l % 8 of matrix l // 8, whose 16 bytes sit at 16-byte unit
        ``(j % 8) ^ (row % 8)`` of its 128-byte row (the SW128 swizzle; the staging is 1 KiB aligned).
        """
        lane = cute.arch.lane_idx()
        n_chunks = self.pv_cols // TILE.chunk
        half_elems = (col_half % 2) * (TILE.stage_bytes // 2)   # bf16 elements: this warp group's staging slot
        base = sQ.iterator.toint() + half_elems * 2
        m = lane // 8
        r = lane % 8
        row_addr = base + (warp * 16 + 8 * (m % 2) + r) * TILE.chunk_row_bytes
        g_o = cute.flat_divide(mDst, (TILE.heads, TILE.chunk))
        for k in cutlass.range_constexpr(n_chunks):
            for jp in cutlass.range_constexpr(TILE.chunk // 16):
                j0 = k * (TILE.chunk // 8) + 2 * jp
                regs = []
                for mm in cutlass.range_constexpr(4):
                    v = 4 * (j0 + mm // 2) + 2 * (mm % 2)
                    regs.append(ptx.bf16x2_pack(acc_o[v], acc_o[v + 1]))
                unit = (2 * jp + m // 2) ^ r
                ptx.stmatrix_x4(row_addr + k * TILE.chunk_bytes + unit * 16, regs[0], regs[1], regs[2], regs[3])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=TILE.threads_per_wg)
            if cutlass.const_expr(k == n_chunks - 1):
                self.stamp_staged(bar_id)
            if warp == 0:
                stage = cute.make_tensor(
                    cute.recast_ptr(sQ.iterator + half_elems + k * (TILE.chunk_bytes // 2), chunk_layout.inner, BFloat16),
                    chunk_layout.outer,
                )
                t_s, t_g = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(stage, 0, 2),
                                                 cute.group_modes(g_o, 0, 2))
                with cute.arch.elect_one():
                    dst = t_g[None, hblk, col_half * n_chunks + k, s_idx, row]
                    if cutlass.const_expr(evict_first):
                        cute.copy(tma, t_s, dst, cache_policy=ptx.l2_policy("evict_first"))
                    else:
                        cute.copy(tma, t_s, dst)
                    cute.arch.cp_async_bulk_commit_group()
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()

    @cute.jit
    def store_o_accum(self, acc_o, thr_pv, tma_oacc, mOAcc, sQ, oacc_layout, col_half: int, warp, hblk, s_idx, acc_row, bar_id: int):
        """The O block (already divided by L) -> o_accum[acc_row, s, heads, cols].

        bf16 o_accum (``accum_bf16``): as out (:meth:`store_bf16_block`; ``oacc_layout`` is then
        the bf16 64 x ``pv_cols`` staging layout). fp32: from registers (``oacc_direct``) or in two 64x128
        TMA passes (:meth:`store_o_accum_staged`).
        """
        if cutlass.const_expr(self.accum_bf16):
            self.store_bf16_block(acc_o, thr_pv, tma_oacc, mOAcc, sQ, oacc_layout, col_half, warp, hblk, s_idx, acc_row,
                                  bar_id, self.oacc_direct, False)
        elif cutlass.const_expr(self.oacc_direct):
            self.store_o_accum_direct(acc_o, thr_pv, mOAcc, col_half, hblk, s_idx, acc_row)
        else:
            self.store_o_accum_staged(acc_o, thr_pv, tma_oacc, mOAcc, sQ, oacc_layout, col_half, warp, hblk, s_idx,
                                      acc_row, bar_id)

    @cute.jit
    def store_o_accum_direct(self, acc_o, thr_pv, mOAcc, col_half: int, hblk, s_idx, acc_row):
        """``oacc_direct`` (config ``oacc_from_registers``, or ``Tuning.oacc_direct_store`` forcing
        it): each thread stores its accumulator fragment straight to
        o_accum (8-byte stores; the 4 threads of a quad fill 32 contiguous bytes of a row): no
        staging, barrier or TMA round trip before the CTA may finish."""
        rows = mOAcc[acc_row, s_idx, None, None]  # (h_q, 512)
        tile = cute.local_tile(rows, (TILE.heads, self.pv_cols), (hblk, col_half))
        cute.autovec_copy(acc_o, thr_pv.partition_C(tile))

    @cute.jit
    def store_o_accum_staged(self, acc_o, thr_pv, tma_oacc, mOAcc, sQ, oacc_layout, col_half: int, warp, hblk, s_idx,
                             acc_row, bar_id: int):
        """The fp32 TMA path of :meth:`store_o_accum`.

        A pass stages 32 KiB (fp32 64x128, SW128) in this warp group's half of sQ; the view below
        maps accumulator columns c and c+128 onto the same staging element, so pass p copies the
        fragment entries of columns [128p, 128p+128) (fragment entries [64p, 64p+64)).
        """
        stage_ptr = cute.recast_ptr(sQ.iterator + col_half * (TILE.stage_bytes // 2), oacc_layout.inner, Float32)
        stage = cute.make_tensor(stage_ptr, oacc_layout.outer)
        aliased = cute.make_tensor(
            stage_ptr,
            cute.composition(
                oacc_layout.outer,
                cute.make_layout((TILE.heads, (TILE.half_v // 2, 2)), stride=(1, (TILE.heads, 0))),
            ),
        )
        t_stage = thr_pv.partition_C(aliased)
        g_o = cute.flat_divide(mOAcc, (TILE.heads, TILE.half_v // 2))
        per_pass = cute.size(acc_o) // 2
        for p in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(per_pass):
                t_stage[p * per_pass + i] = acc_o[p * per_pass + i]
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=TILE.threads_per_wg)
            if warp == 0:
                t_s, t_g = cpasync.tma_partition(
                    tma_oacc, 0, cute.make_layout(1), cute.group_modes(stage, 0, 2), cute.group_modes(g_o, 0, 2)
                )
                with cute.arch.elect_one():
                    cute.copy(tma_oacc, t_s, t_g[None, hblk, 2 * col_half + p, s_idx, acc_row])
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()
            if cutlass.const_expr(p == 0):
                # Pass 1 overwrites the staging: wait until the pass-0 store has read it.
                cute.arch.barrier(barrier_id=bar_id, number_of_threads=TILE.threads_per_wg)


