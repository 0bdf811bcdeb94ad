"""The SM90 swap-AB tile: a K tile's 64 rows on the wgmma's M side and h = 8, 16 or 32 query heads
on N, so the MMAs do the heads' work only (a 64-head tile pads M: 8x / 4x / 2x the work). The
tile-level pieces every kernel built on it shares (the sparse prefill's ``prefill_small_roles.py``):
its tiled MMAs and shared-memory layouts, the online softmax over M with its cross-warp exchange,
and the transposed bf16 stores of an m64nh fragment.

Per K tile, with d_qk 576 (512):

* QK: S^T (64 rows x h) = K (64 x d_qk) Q^T: d_qk / 16 SS wgmma m64nhk16, A = the K buffer
  (K-major, the 64-head tile's K tile unchanged), B = Q (h x d_qk, K-major SW128).
* PV: O^T (512 x h) = V^T (512 x 64 rows) P^T (64 rows x h): A = V^T, the K buffer read MN-major
  (d on M; bf16 in shared memory allows it), in 64-dim chunks; B = P^T (h x 64 rows, K-major
  SW128), written from the S^T fragment by ``stmatrix.trans`` (:func:`store_transposed`).
* Softmax over M (:func:`swapped_softmax`): a thread holds rows ``16 warp + lane / 4`` and ``+ 8``
  of heads ``8 j + 2 (lane % 4) + c`` (h / 4 heads: its *slots*); a head's tile max is its two
  rows, then lanes XOR 4, 8, 16, then the four warps through a shared-memory exchange
  (:func:`exchange`). O^T's fragment holds the same heads per thread as S^T's (both are m64nh
  accumulators with the heads on N), so O^T is rescaled from registers (:func:`scale_heads`).
"""

# No "from __future__ import annotations": the DSL reads annotations as objects.
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32
from cutlass.cute.nvgpu import warpgroup

from ...dsl import ptx as common_ptx
from ...dsl.compat import LayoutEnum, OperandMajorMode, sm90_utils
from . import ptx
from .config import SWAPPED_HEADS, TILE, Tile

WARPS = TILE.threads_per_wg // 32        # warps of an MMA warp group: 16 of the 64 rows each
assert TILE.tokens == WARPS * 16, "an MMA warp holds 16 of the tile's rows"


class SwappedOps(NamedTuple):
    """The swap-AB tile's tiled MMAs and its output chunk layout (compile-time objects)."""

    qk: cute.TiledMma               # S^T = K Q^T: SS m64nhk16, K-major K tile and Q
    pv: cute.TiledMma               # O^T += V^T P^T: SS m64nhk16, MN-major V^T (the K tile), K-major P^T
    chunk_layout: cute.ComposedLayout   # h heads x 64 dims of out, SW128 rows (one TMA box)


def make_swapped_mmas(h: int):
    """(QK, PV of WG0, PV of WG1) tiled MMAs of the swap-AB tile (host side). The two PVs are the
    same op as two objects: each warp group sets its own ACCUMULATE field (a field set inside one
    role's branch would not dominate the other role's use)."""
    assert h in SWAPPED_HEADS
    qk = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                           (1, 1, 1), (TILE.tokens, h))
    pv = [sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.MN, OperandMajorMode.K, Float32,
                                            (1, 1, 1), (TILE.chunk, h)) for _ in range(2)]
    return qk, pv[0], pv[1]


def swapped_smem_layouts(tile: Tile, h: int):
    """(Q, K tiles, P^T) shared-memory layouts (host side): Q as QK's B operand (h x d_qk, K-major
    SW128: one 128-B row per head and 64-dim chunk, chunks h x 128 B apart), the two K tiles of the
    64-head tile (64 rows x d_qk, K-major SW128), P^T as PV's B operand (h x 64 rows, K-major SW128:
    head n's 16-B unit u of rows 8u .. 8u + 7 at ``n * 128 + ((u ^ (n % 8)) << 4)``)."""
    # Q without a stage mode (as (h, d_qk)): make_smem_layout_b's staged layout for h = 8, d_qk 576
    # ((8,1),(64,9),(1,1)) aborts the DSL's slice of its stage (4.8.1); this is its first stage.
    q = cute.tile_to_shape(warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16),
                           (h, tile.d_qk), (0, 1))
    k = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE.heads, TILE.tokens, tile.d_qk), BFloat16,
                                      TILE.k_bufs)
    p = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE.chunk, h, TILE.tokens), BFloat16, 1)
    assert cute.cosize(q) == h * tile.d_qk and cute.cosize(p) == h * TILE.tokens
    assert cute.cosize(k) == TILE.k_bufs * tile.k_tile_elems
    return q, k, p


def out_chunk_layout(h: int):
    """h heads x 64 dims of out, bf16 in SW128 K-major atoms (one 128-B row per head): the staging
    of one output chunk and its TMA box."""
    return cute.tile_to_shape(warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16),
                              (h, TILE.chunk), (0, 1))


# --------------------------------------------------------------- the fragment's heads (trace time)


def slot_of(v: int) -> int:
    """The head slot of value ``v`` of an m64nh accumulator fragment (v = c + 2 r + 4 j: column
    8 j + 2 (lane % 4) + c, row + 8 r): 2 j + c."""
    return 2 * (v // 4) + v % 2


def head_of(slot: int, quad):
    """The head of a thread's slot (``quad`` = lane % 4)."""
    return 8 * (slot // 2) + 2 * quad + slot % 2


def scale_heads(acc: cute.Tensor, factors: cute.Tensor, h: int):
    """acc *= the factor of each value's head (``factors``: one per slot); acc is one or more
    m64nh fragments back to back (h / 2 values each)."""
    for i in range(cute.size(acc)):
        acc[i] = acc[i] * factors[slot_of(i % (h // 2))]


def rows_max(x: Float32) -> Float32:
    """Max over the 8 lanes of a warp that hold the same heads (lanes XOR 4, 8, 16)."""
    for off in (4, 8, 16):
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=off))
    return x


def rows_sum(x: Float32) -> Float32:
    """Sum over the 8 lanes of a warp that hold the same heads (lanes XOR 4, 8, 16)."""
    for off in (4, 8, 16):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=off)
    return x


@cute.jit
def exchange(vals: cute.Tensor, s_x: cute.Tensor, buf, warp, lane, is_max: cutlass.Constexpr, bar_id: cutlass.Constexpr):
    """Each slot of ``vals`` (already reduced over the warp's rows) reduced over the warp group's
    four warps: lanes 0-3 of each warp write their heads' values into exchange buffer ``buf``,
    the warp group syncs on named barrier ``bar_id`` (128 threads), every thread combines the four
    for its heads. Buffer b is written again only after another exchange's barrier, which every
    thread passes after reading b (the caller's order of buffers keeps that true)."""
    quad = lane % 4
    if lane < 4:
        for s in cutlass.range_constexpr(cute.size(vals)):
            s_x[head_of(s, quad), warp, buf] = vals[s]
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=TILE.threads_per_wg)
    for s in cutlass.range_constexpr(cute.size(vals)):
        head = head_of(s, quad)
        x = s_x[head, 0, buf]
        for w in cutlass.range_constexpr(1, WARPS):
            if cutlass.const_expr(is_max):
                x = cute.arch.fmax(x, s_x[head, w, buf])
            else:
                x = x + s_x[head, w, buf]
        vals[s] = x


@cute.jit
def swapped_softmax(acc_s: cute.Tensor, word: Uint32, scale_log2: Float32, m: cute.Tensor, l: cute.Tensor,
                    sc: cute.Tensor, s_x: cute.Tensor, buf, warp, lane, bar_id: cutlass.Constexpr):
    """One online-softmax step over the M axis of S^T (in place: S^T becomes P^T, fp32). ``word``:
    this thread's rows' validity (bit 0: row ``16 warp + lane / 4``, bit 8: that row + 8). Per slot:
    ``m`` the running max (log2 units, from -1e30), ``l`` this thread's share of the running sum
    (its two rows), ``sc`` the step's O factor; the max is exchanged in buffer ``buf`` on ``bar_id``."""
    mx = cute.make_rmem_tensor(cute.make_layout(cute.size(m)), Float32)
    for v in cutlass.range_constexpr(cute.size(acc_s)):
        r = (v // 2) % 2
        ok = ((word >> Uint32(8 * r)) & Uint32(1)) != Uint32(0)
        t = Float32(cutlass.select_(ok, acc_s[v] * scale_log2, -Float32.inf))
        acc_s[v] = t
        if cutlass.const_expr(r == 0):
            mx[slot_of(v)] = t
        else:
            mx[slot_of(v)] = cute.arch.fmax(mx[slot_of(v)], t)
    for s in cutlass.range_constexpr(cute.size(m)):
        mx[s] = rows_max(mx[s])
    exchange(mx, s_x, buf, warp, lane, True, bar_id)
    for s in cutlass.range_constexpr(cute.size(m)):
        new_m = cute.arch.fmax(m[s], mx[s])
        sc[s] = cute.math.exp2(m[s] - new_m, fastmath=True)
        m[s] = new_m
    sums = cute.make_rmem_tensor(cute.make_layout(cute.size(m)), Float32)
    for v in cutlass.range_constexpr(cute.size(acc_s)):
        p = cute.math.exp2(acc_s[v] - m[slot_of(v)], fastmath=True)
        acc_s[v] = p
        if cutlass.const_expr((v // 2) % 2 == 0):
            sums[slot_of(v)] = p
        else:
            sums[slot_of(v)] = sums[slot_of(v)] + p
    for s in cutlass.range_constexpr(cute.size(m)):
        l[s] = l[s] * sc[s] + sums[s]


def store_transposed(base: Int32, acc: cute.Tensor, first: int, h: int, warp, lane):
    """One m64nh fragment (``acc[first : first + h / 2]``: 64 rows x h heads, fp32) as bf16 into an
    h x 64 K-major SW128 block at shared address ``base`` (1024-B aligned): head n's rows 8u ..
    8u + 7 at ``base + n * 128 + ((u ^ (n % 8)) << 4)``. The fragment's 8 x 8 blocks (r, j) (rows
    16 warp + 8 r .., heads 8 j ..) leave by ``stmatrix.trans``, four (two at h = 8) per
    instruction: matrix i of group g is block (r, j) = (i % 2, 2 g + i // 2); lane l addresses
    memory row l % 8 (head 8 j + l % 8) of matrix l // 8. A plain function, inlined at trace time."""
    blocks = h // 4                    # 8x8 blocks in a warp's 16 rows x h heads
    per = min(4, blocks)               # matrices per stmatrix
    b = lane % 8
    mm = (lane // 8) % per
    for g in range(blocks // per):
        regs = []
        for i in range(per):
            v = first + 4 * (per * g // 2 + i // 2) + 2 * (i % 2)
            regs.append(common_ptx.pack_bf16x2(acc[v], acc[v + 1]))
        head = 8 * (per * g // 2 + mm // 2) + b
        unit = 2 * warp + mm % 2
        ptx.stmatrix_trans(base + head * TILE.chunk_row_bytes + ((unit ^ b) << 4), regs)


def issue_qk_swapped(d_qk: int, qk_mma, acc_s, tSrK, tSrQ, buf):
    """S^T = K Q^T over K buffer ``buf``: d_qk / 16 chained SS wgmma m64nhk16 (committed, not
    waited). ``qk_mma`` accumulates (set once, outside every staged region), so S^T is zeroed."""
    tSrK_b = tSrK[None, None, None, buf]
    acc_s.fill(0.0)
    warpgroup.fence()
    for k in range(d_qk // 16):  # plain function: a trace-time (unrolled) loop
        cute.gemm(qk_mma, acc_s, tSrK_b[None, None, k], tSrQ[None, None, k], acc_s)
    warpgroup.commit_group()
