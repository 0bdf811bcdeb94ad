"""The MMA warp groups' shared pieces: their bundle of tiled MMAs and staging layouts, the QK
chain, the V operand view of the K tiles, and the accumulator helpers.

Each MMA warp group owns ``pv_cols`` output columns (256; 128 in the column pair, whose two CTAs
each own one half of the 512). O lives in registers: a 64 x pv_cols fp32 wgmma accumulator.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.cute.nvgpu import warpgroup

from ...dsl.compat import LayoutEnum, OperandMajorMode, sm90_utils
from .config import TILE, Sm90SparseDecodeConfig, Tile


class Ops(NamedTuple):
    """The tiled MMAs and the output staging layouts (compile-time objects made by the host)."""

    qk: cute.TiledMma          # S = Q K^T: SS wgmma 64x64x16, K-major Q and K
    pv_rs: cute.TiledMma       # WG0: O += P V with P in registers
    pv_ss: cute.TiledMma       # WG1: O += P V with P in shared memory
    chunk_layout: cute.ComposedLayout  # one 64 x 64 bf16 chunk of out / o_accum staged for its TMA store


def make_mmas(pv_cols: int):
    """The tiled MMAs of the two MMA warp groups (host side): QK (SS, K-major Q and K), and PV with
    P from registers (WG0) or shared memory (WG1); B of PV is V, the transposed (MN-major) view of
    the K tile."""
    qk = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                           (1, 1, 1), (TILE.heads, TILE.tokens))
    pv_rs = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                              (1, 1, 1), (TILE.heads, pv_cols), warpgroup.OperandSource.RMEM)
    pv_ss = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                              (1, 1, 1), (TILE.heads, pv_cols))
    return qk, pv_rs, pv_ss


def smem_layouts(tile: Tile):
    """(Q, K tiles, P) shared-memory layouts of a tile geometry (host side): SW128 K-major Q
    (64 heads x d_qk), ``k_bufs`` K tiles (64 tokens x d_qk) and P (64 heads x 64 tokens)."""
    q = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE.heads, TILE.tokens, tile.d_qk), BFloat16, 1)
    k = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE.heads, TILE.tokens, tile.d_qk), BFloat16,
                                      TILE.k_bufs)
    p = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE.heads, TILE.half_v, TILE.tokens), BFloat16, 1)
    # The shared-storage structs are sized from the tile geometry.
    assert cute.cosize(q) == tile.q_elems and cute.cosize(p) == TILE.p_elems
    assert cute.cosize(k) == TILE.k_bufs * tile.k_tile_elems
    return q, k, p


def issue_qk(cfg: Sm90SparseDecodeConfig, qk_mma, acc_s, tSrQ, tSrK, buf):
    """S = Q K^T: d_qk / 16 chained SS wgmma 64x64x16 (36 for V3.2's 576 dims, 32 for V4's 512)
    over K buffer ``buf`` (committed, not waited).

    ``qk_mma`` accumulates (ACCUMULATE set once, outside every staged region: a ``set`` inside a
    branch would leave the atom defined in that branch), so S is zeroed first.
    """
    tSrK_b = tSrK[None, None, None, buf]
    acc_s.fill(0.0)
    warpgroup.fence()
    for k in range(cfg.tile.d_qk // 16):  # plain function: a trace-time (unrolled) loop
        cute.gemm(qk_mma, acc_s, tSrQ[None, None, k, 0], tSrK_b[None, None, k], acc_s)
    warpgroup.commit_group()


@cute.jit
def scale_rows(acc: cute.Tensor, s0: Float32, s1: Float32):
    """acc *= s0 on this thread's first accumulator row, s1 on its second (row + 8)."""
    for v in cutlass.range_constexpr(cute.size(acc)):
        if cutlass.const_expr((v // 2) % 2 == 0):
            acc[v] = acc[v] * s0
        else:
            acc[v] = acc[v] * s1


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


def column_block(cfg: Sm90SparseDecodeConfig, wg_half: int):
    """This MMA warp group's block of ``pv_cols`` output columns: its half (0 = WG0, 1 = WG1),
    within this CTA's column half in the column pair."""
    if cfg.column_pair:
        return cute.arch.block_idx()[0] % cfg.n_cblk * 2 + wg_half
    return wg_half


def writes_lse(cfg: Sm90SparseDecodeConfig):
    """Whether this CTA writes lse / lse_accum (in the column pair both compute the same values:
    the first column half writes them)."""
    if cfg.column_pair:
        return cute.arch.block_idx()[0] % cfg.n_cblk == 0
    return cutlass.Boolean(True)


def k_tensors_for_pv(cfg: Sm90SparseDecodeConfig, sK: cute.Tensor, col_block):
    """V[:, w*col_block : w*(col_block+1)] (w = ``pv_cols``: 256, or 128 in the column pair) of
    both K buffers as an MN-major B operand.

    V is the transposed view of the K tile: dims are contiguous inside a 128-B swizzled row
    (64 dims), 64-dim chunks are 8 KiB apart, tokens 128 B apart, buffers one K tile apart (72 KiB for V3.2, 64 KiB for V4). This is
    the layout make_smem_layout_b(COL_MAJOR, (64, 512, 64)) prints, with the buffer stride of
    the K tiles (the helper's own stage stride would be 64 KiB).
    """
    chunks = cfg.pv_cols // TILE.chunk
    outer = cute.make_layout(
        ((TILE.chunk, chunks), (8, TILE.tokens // 8), TILE.k_bufs),
        stride=((1, TILE.chunk * TILE.tokens), (TILE.chunk, TILE.chunk * 8), cfg.tile.k_tile_elems),
    )
    base = sK.iterator + col_block * chunks * TILE.chunk * TILE.tokens
    return cute.make_tensor(base, outer)
