"""The MMA warp groups' epilogue: a request's final softmax normalisation and its output stores.

A request whole in the partition writes bf16 ``out`` and the natural-log ``lse`` (the sink folded
in); a split piece writes its bf16 partial ``o_accum = O / L`` and the base-2 ``lse_accum`` for the
combine. A bf16 block is staged in this warp group's half of the Q buffer (free between a
request's last QK and the next request's Q load) in 64-column chunks, each stored by TMA as soon
as it is staged; the column pair's ``out`` blocks (64 x 128, no tensor map) go out from registers.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...dsl import ptx as common_ptx
from . import ptx
from .config import TILE, Bar, Sm90SparseDecodeConfig, Stamp
from .cta import Cta, stamp
from .mma import writes_lse

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


class BlockStore(NamedTuple):
    """Where an O block goes: its TMA atom (None when stored from registers), the destination
    tensor ((h, d, s_q, rows) for TMA; as given otherwise) and its 64-column staging layout."""

    tma: Optional[cute.CopyAtom]
    dst: cute.Tensor
    layout: cute.ComposedLayout
    policy: Optional[Int64] = None   # an L2 cache policy (``ptx.l2_policy``) the TMA stores carry, or None


def bf16_block_layout(cols: int):
    """A 64 x ``cols`` bf16 staging block in SW128 K-major atoms (rows of 128 B per 64 columns,
    64-column blocks 8 KiB apart), TMA-storable: with 64 columns one chunk and TMA box of the
    staged stores."""
    return cute.tile_to_shape(
        warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16), (TILE.heads, cols), (0, 1)
    )


@cute.jit
def finalize_row(cfg: Sm90SparseDecodeConfig, mSink: Optional[cute.Tensor], l_sum: Float32, m: Float32, is_split,
                 head: Int32):
    """(O factor, lse) of one row.

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
        if cutlass.const_expr(cfg.has_attn_sink):
            denom = l_sum + cute.math.exp2(mSink[head] * Float32(LOG2E) - m, fastmath=True)
        o_scale = Float32(cutlass.select_(empty, Float32(0.0), Float32(1.0) / denom))
        lse = Float32(cutlass.select_(empty, Float32.inf, log2_l * Float32(LN2)))
    return o_scale, lse


@cute.jit
def store_lse_rows(cfg: Sm90SparseDecodeConfig, mDst: cute.Tensor, row, s_idx, head0, lse0: Float32, lse1: Float32,
                   quad):
    """lse (or lse_accum) of this thread's two accumulator rows: one lane per quad, in the CTA
    that writes lse (:func:`~.mma.writes_lse`)."""
    if (quad == 0) & writes_lse(cfg):
        mDst[row, s_idx, head0] = lse0
        mDst[row, s_idx, head0 + 8] = lse1


def q_staging(cfg: Sm90SparseDecodeConfig, sQ: cute.Tensor, col_half):
    """This warp group's staging in the Q buffer (its 32 KiB half), as (buffer start, bf16
    elements from it). A plain function, inlined at trace time."""
    return sQ.iterator, (col_half % 2) * (TILE.stage_bytes // 2)


@cute.jit
def store_block(cfg: Sm90SparseDecodeConfig, cta: Cta, acc_o, thr_pv, to: BlockStore, stage, col_half: int, warp, row,
                bar_id: int, direct: bool):
    """An O block (64 x ``pv_cols``, fp32 registers, already scaled) as bf16 -> dst[row, s, heads,
    cols]: staged at ``stage`` (:func:`q_staging`) and stored by TMA in 64-column chunks
    (:func:`store_chunked`), or (``direct``) per-thread stores from the registers (``col_half``
    counts ``pv_cols`` blocks: 0-3 in the column pair)."""
    if cutlass.const_expr(direct):
        r_o = cute.make_rmem_tensor(acc_o.layout, BFloat16)
        r_o.store(acc_o.load().to(BFloat16))
        tile = cute.local_tile(to.dst[row, cta.s_idx, None, None], (TILE.heads, cfg.pv_cols), (cta.hblk, col_half))
        cute.autovec_copy(r_o, thr_pv.partition_C(tile))
    else:
        store_chunked(cfg, cta, acc_o, to, stage, col_half, warp, row, bar_id)


def stamp_staged(cta: Cta, bar_id: int):
    """``Sm90Tuning.timeline``: this warp group's block staged (the warp group is named by its
    epilogue barrier). A plain function, inlined at trace time."""
    stamp(cta, Stamp.EPI_STAGED if bar_id == Bar.EPI_SOFTMAX else Stamp.WG1_EPI_STAGED,
          cute.arch.thread_idx()[0] % TILE.threads_per_wg == 0)


@cute.jit
def store_chunked(cfg: Sm90SparseDecodeConfig, cta: Cta, acc_o, to: BlockStore, stage, col_half: int, warp, row,
                  bar_id: int):
    """:func:`store_block`'s staged path: the O block's ``pv_cols / 64`` chunks are staged one
    after the other from ``stage`` (chunk k at +8 KiB k, ``to.layout``: 64 x 64 in SW128 rows of
    128 B), each with four ``stmatrix.x4`` per thread, and chunk k's TMA store (one 64 x 64 box)
    is issued by warp 0 once the warp group has staged it, so the store of chunk k overlaps the
    staging of chunk k+1. Warp 0 waits for the reads of all of them at the end.

    Accumulator fragment entry v = c + 2 r + 4 j of a thread (lane l of warp w) holds row
    16 w + l // 4 + 8 r, column 8 j + 2 (l % 4) + c. One stmatrix.x4 covers the 8-column
    groups j0 and j0 + 1 of both row halves: matrix m is (j0 + m // 2, r = m % 2), and lane l
    addresses row l % 8 of matrix l // 8, whose 16 bytes sit at 16-byte unit
    ``(j % 8) ^ (row % 8)`` of its 128-byte row (the SW128 swizzle; the staging is 1 KiB aligned).
    """
    n_chunks = cfg.pv_cols // TILE.chunk
    start, offset = stage
    base = start.toint() + offset * 2
    cl = chunk_lane(warp)
    row_addr = base + cl.row_off
    for k in cutlass.range_constexpr(n_chunks):
        put_chunk(cfg, cta, to, acc_o, start + offset + k * (TILE.chunk_bytes // 2), row_addr + k * TILE.chunk_bytes,
                  cl, k, col_half * n_chunks + k, row, warp, bar_id)
    stamp_staged(cta, bar_id)
    if warp == 0:
        with cute.arch.elect_one():
            cute.arch.cp_async_bulk_wait_group(0, read=True)
    cute.arch.sync_warp()


class ChunkLane(NamedTuple):
    """This thread's place in a 64 x 64 SW128 staging chunk (:func:`store_chunked` has the
    arithmetic): the stmatrix matrix ``m`` and row ``r`` its lane addresses, and the byte offset of
    that row in the chunk."""

    m: Int32
    r: Int32
    row_off: Int32


def chunk_lane(warp) -> ChunkLane:
    """This thread's :class:`ChunkLane` (``warp``: its warp in the MMA warp group); a plain function."""
    lane = cute.arch.lane_idx()
    m = lane // 8
    r = lane % 8
    return ChunkLane(m, r, (warp * 16 + 8 * (m % 2) + r) * TILE.chunk_row_bytes)


@cute.jit
def put_chunk(cfg: Sm90SparseDecodeConfig, cta: Cta, to: BlockStore, acc_o, at, chunk_row: Int32, cl: ChunkLane,
              k: cutlass.Constexpr, col: cutlass.Constexpr, row, warp, bar_id: cutlass.Constexpr):
    """Columns 64 k .. of an O block staged at ``at`` (a 1 KiB aligned bf16 shared pointer; this
    thread's row there at shared address ``chunk_row``) and, once the warp group has staged them
    (``bar_id``), stored by warp 0 as the block's output columns 64 col .. (one TMA box, committed
    as its own bulk group)."""
    stage_chunk(acc_o, chunk_row, k, cl.m, cl.r)
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=TILE.threads_per_wg)
    if warp == 0:
        src, dst = chunk_tma(cfg, cta, to, at, col, row)
        store_chunk(to, src, dst)


def stage_chunk(acc_o, chunk_row: Int32, k: int, m, r):
    """Columns 64 k .. 64 k + 63 of an O block's accumulator fragment as bf16 into a 64 x 64 SW128
    staging chunk (:func:`store_chunked` has the fragment and swizzle arithmetic): four
    ``stmatrix.x4``; ``chunk_row``: this thread's row address in the chunk, ``m`` / ``r``: its lane's
    matrix and row. A plain function, inlined at trace time."""
    for jp in range(TILE.chunk // 16):
        j0 = k * (TILE.chunk // 8) + 2 * jp
        regs = []
        for mm in range(4):
            v = 4 * (j0 + mm // 2) + 2 * (mm % 2)
            regs.append(common_ptx.pack_bf16x2(acc_o[v], acc_o[v + 1]))
        unit = (2 * jp + m // 2) ^ r
        ptx.stmatrix_x4(chunk_row + unit * 16, regs[0], regs[1], regs[2], regs[3])


def store_chunk(to: BlockStore, src, dst):
    """One elected lane issues a staged chunk's TMA store (with ``to.policy`` where given) and
    commits it as its own bulk group. A plain function, inlined at trace time."""
    with cute.arch.elect_one():
        if cutlass.const_expr(to.policy is None):
            cute.copy(to.tma, src, dst)
        else:
            cute.copy(to.tma, src, dst, cache_policy=to.policy)
        cute.arch.cp_async_bulk_commit_group()


def chunk_tma(cfg: Sm90SparseDecodeConfig, cta: Cta, to: BlockStore, staged_at, col: int, row):
    """(source, destination) of one 64 x 64 TMA store box: the chunk staged at ``staged_at`` (a bf16
    shared-memory pointer, 1 KiB aligned) to the block's output columns 64 col .. 64 col + 63. A
    plain function, inlined at trace time."""
    g_o = cute.flat_divide(to.dst, (TILE.heads, TILE.chunk))
    staged = cute.make_tensor(cute.recast_ptr(staged_at, to.layout.inner, BFloat16), to.layout.outer)
    t_s, t_g = cpasync.tma_partition(to.tma, 0, cute.make_layout(1), cute.group_modes(staged, 0, 2),
                                     cute.group_modes(g_o, 0, 2))
    return t_s, t_g[None, cta.hblk, col, cta.s_idx, row]