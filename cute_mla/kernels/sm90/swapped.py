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
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...dsl import ptx as common_ptx
from ...dsl.compat import LayoutEnum, OperandMajorMode, sm90_utils
from . import ptx
from .config import SWAPPED_HEADS, TILE, Tile

WARPS = TILE.threads_per_wg // 32        # warps of an MMA warp group: 16 of the 64 rows each
XCHG_BUFS = 3                            # exchange buffers: the tiles' max (by the tile's K buffer), a walk's sums
SUM_BUF = 2                              # the exchange buffer of the sums
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
def exchange(vals: cute.Tensor, s_x: cute.Tensor, buf, warp, lane, is_max: cutlass.Constexpr,
             bar_id: cutlass.Constexpr):
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


# ------------------------------------------------------------ the MMA warp groups' steps (both kernels)


class Lane(NamedTuple):
    """An MMA warp group thread's place: its thread index in the group, warp, lane, lane % 4."""

    wtid: Int32
    warp: Int32
    lane: Int32
    quad: Int32


def lane_of() -> Lane:
    """This thread's :class:`Lane` (a plain function, traced inline)."""
    wtid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = cute.arch.make_warp_uniform(wtid // 32)
    lane = wtid % 32
    return Lane(wtid, warp, lane, lane % 4)


def q_partition(tma_q: cute.CopyAtom, mQ: cute.Tensor, sQ: cute.Tensor, h: int, d_qk: int):
    """(shared, global) sides of the Q load, one TMA box of h heads x d_qk (``mQ`` viewed (h, d,
    s_q, rows)); a plain function."""
    gQ = cute.flat_divide(mQ, (h, d_qk))
    return cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))


def head_rows(h: int):
    """WG0's per-head registers, one value per slot of this thread (h / 4): the running max (log2
    units), its share of the running sum, the step's O factor, the lse (a plain function)."""
    return tuple(cute.make_rmem_tensor(cute.make_layout(h // 4), Float32) for _ in range(4))


def qk_fragments(qk_mma, sK: cute.Tensor, sQ: cute.Tensor, h: int, wtid):
    """(A = the K buffers, B = Q, the S^T accumulator) of this thread's QK (a plain function)."""
    thr = qk_mma.get_slice(wtid)
    return (thr.make_fragment_A(thr.partition_A(sK)), thr.make_fragment_B(thr.partition_B(sQ)),
            thr.make_fragment_C(thr.partition_shape_C((TILE.tokens, h))))


def pv_fragments(pv_mma, sV: cute.Tensor, sP: cute.Tensor, h: int, wtid):
    """(A = V^T of this warp group's 256 dims in both K buffers, B = P^T, the O^T accumulator) of
    this thread's PV (a plain function)."""
    thr = pv_mma.get_slice(wtid)
    return (thr.make_fragment_A(thr.partition_A(sV)), thr.make_fragment_B(thr.partition_B(sP)),
            thr.make_fragment_C(thr.partition_shape_C((TILE.half_v, h))))


class Wg0(NamedTuple):
    """WG0's fixed state on the swap-AB tile (both kernels): P^T's address, the heads' factors and
    exchange buffers in shared memory, the Q load's partition, its MMAs' fragments and its per-head
    registers (:func:`head_rows`)."""

    p_base: Int32
    s_scale: cute.Tensor
    s_x: cute.Tensor
    tQsQ: cute.Tensor
    tQgQ: cute.Tensor
    tSrK: cute.Tensor
    tSrQ: cute.Tensor
    acc_s: cute.Tensor
    tOrV: cute.Tensor
    tOrP: cute.Tensor
    acc_o: cute.Tensor
    m: cute.Tensor
    l: cute.Tensor
    sc: cute.Tensor
    lse: cute.Tensor


def wg0_state(ops: SwappedOps, storage, tma_q: cute.CopyAtom, mQ: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor,
              sV: cute.Tensor, sP: cute.Tensor, h: int, d_qk: int, ln: Lane) -> Wg0:
    """:class:`Wg0` from the CTA's storage (its ``sP``, ``head_scale`` and ``exchange``) and tensors
    (``sV``: V^T of WG0's 256 dims, ``sP``: P^T) for this thread (``ln``); sets both MMAs to
    accumulate. A plain function."""
    p_base = storage.sP.data_ptr().toint()
    s_scale = storage.head_scale.get_tensor(cute.make_layout(h))
    s_x = storage.exchange.get_tensor(cute.make_layout((h, WARPS, XCHG_BUFS)))
    tQsQ, tQgQ = q_partition(tma_q, mQ, sQ, h, d_qk)
    ops.qk.set(warpgroup.Field.ACCUMULATE, True)
    ops.pv.set(warpgroup.Field.ACCUMULATE, True)
    tSrK, tSrQ, acc_s = qk_fragments(ops.qk, sK, sQ, h, ln.wtid)
    tOrV, tOrP, acc_o = pv_fragments(ops.pv, sV, sP, h, ln.wtid)
    m, l, sc, lse = head_rows(h)
    return Wg0(p_base, s_scale, s_x, tQsQ, tQgQ, tSrK, tSrQ, acc_s, tOrV, tOrP, acc_o, m, l, sc, lse)


class Wg1(NamedTuple):
    """WG1's fixed state on the swap-AB tile: the heads' factors in shared memory, its PV's
    fragments and its factors' registers."""

    s_scale: cute.Tensor
    tOrV: cute.Tensor
    tOrP: cute.Tensor
    acc_o: cute.Tensor
    sc: cute.Tensor


def wg1_state(ops: SwappedOps, storage, sV: cute.Tensor, sP: cute.Tensor, h: int, ln: Lane) -> Wg1:
    """:class:`Wg1` (``sV``: V^T of WG1's 256 dims); sets its PV to accumulate. A plain function."""
    s_scale = storage.head_scale.get_tensor(cute.make_layout(h))
    ops.pv.set(warpgroup.Field.ACCUMULATE, True)
    tOrV, tOrP, acc_o = pv_fragments(ops.pv, sV, sP, h, ln.wtid)
    return Wg1(s_scale, tOrV, tOrP, acc_o, cute.make_rmem_tensor(cute.make_layout(h // 4), Float32))


@cute.jit
def put_factors(s_scale: cute.Tensor, sc: cute.Tensor, ln: Lane):
    """The heads' O factors into ``s_scale`` (lanes 0-3 of warp 0 hold every head between them)."""
    if (ln.warp == 0) & (ln.lane < 4):
        for s in cutlass.range_constexpr(cute.size(sc)):
            s_scale[head_of(s, ln.quad)] = sc[s]


@cute.jit
def get_factors(s_scale: cute.Tensor, sc: cute.Tensor, quad):
    """This thread's heads' O factors from ``s_scale``."""
    for s in cutlass.range_constexpr(cute.size(sc)):
        sc[s] = s_scale[head_of(s, quad)]


@cute.jit
def hand_over_tile(s_scale: cute.Tensor, sc: cute.Tensor, p_base: Int32, acc_s: cute.Tensor, h: cutlass.Constexpr,
                   ln: Lane, free_bar: cutlass.Constexpr, ready_bar: cutlass.Constexpr):
    """WG0, per tile: P^T (bf16, from the S^T fragment) and the heads' factors to WG1 once it has
    read the last ones (``free_bar``); then ``ready_bar``, a 256-thread sync, so it also orders
    every WG0 thread's P^T writes before WG0's own SS wgmma reads them."""
    cute.arch.barrier(barrier_id=free_bar, number_of_threads=2 * TILE.threads_per_wg)
    put_factors(s_scale, sc, ln)
    store_transposed(p_base, acc_s, 0, h, ln.warp, ln.lane)
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=ready_bar, number_of_threads=2 * TILE.threads_per_wg)


@cute.jit
def hand_over_final(s_scale: cute.Tensor, sc: cute.Tensor, ln: Lane, free_bar: cutlass.Constexpr,
                    ready_bar: cutlass.Constexpr):
    """WG0, at the end of a walk (item or request): the heads' final factors to WG1 (``free_bar``
    synced, ``ready_bar`` arrived: WG0 does not wait for WG1 here)."""
    cute.arch.barrier(barrier_id=free_bar, number_of_threads=2 * TILE.threads_per_wg)
    put_factors(s_scale, sc, ln)
    cute.arch.barrier_arrive(barrier_id=ready_bar, number_of_threads=2 * TILE.threads_per_wg)


@cute.jit
def take_final(st: Wg1, ln: Lane, h: cutlass.Constexpr, free_bar: cutlass.Constexpr, ready_bar: cutlass.Constexpr):
    """WG1, at the end of a walk: the heads' final factors from WG0 (the other side of
    :func:`hand_over_final`), then its O^T scaled by them."""
    cute.arch.barrier(barrier_id=ready_bar, number_of_threads=2 * TILE.threads_per_wg)
    get_factors(st.s_scale, st.sc, ln.quad)
    cute.arch.barrier_arrive(barrier_id=free_bar, number_of_threads=2 * TILE.threads_per_wg)
    scale_heads(st.acc_o, st.sc, h)


@cute.jit
def start_walk(st: Wg0, tma_q: cute.CopyAtom, q_full, q_bytes: cutlass.Constexpr, token, row, rq, ln: Lane,
               q_free_bar: cutlass.Constexpr, policy: cutlass.Constexpr = ""):
    """WG0, at the start of a walk (item or request) ``rq`` of the CTA: from the second on, once
    WG1's output left the staging in sQ (``q_free_bar`` synced), Q of (``token``, ``row``) by TMA
    on ``q_full`` (warp 0; ``policy``: an L2 cache policy kind for the load, or ""), the running
    maxima, sums and O^T reset, then Q waited for."""
    if rq > 0:
        cute.arch.barrier(barrier_id=q_free_bar, number_of_threads=2 * TILE.threads_per_wg)
    if ln.warp == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(q_full, q_bytes)
        if cutlass.const_expr(policy):
            cute.copy(tma_q, st.tQgQ[None, 0, 0, token, row], st.tQsQ, tma_bar_ptr=q_full,
                      cache_policy=ptx.l2_policy(policy))
        else:
            cute.copy(tma_q, st.tQgQ[None, 0, 0, token, row], st.tQsQ, tma_bar_ptr=q_full)
    st.m.fill(-1e30)
    st.l.fill(0.0)
    st.acc_o.fill(0.0)
    cute.arch.mbarrier_wait(q_full, rq & 1)


def final_factors(cfg, st: Wg0, mSink, is_split, ln: Lane, h: int, free_bar: int, ready_bar: int):
    """WG0, at the end of a walk, its sums whole: each head's O factor and lse (``finalize_row``:
    the sink, empty rows, a split piece's base-2 lse) into ``st.sc`` / ``st.lse``, the factors to
    WG1 (:func:`hand_over_final`), then its own O^T scaled by them. A plain function, inlined at
    trace time."""
    # Imported here: epilogue.py needs cta.py, which builds the swap-AB storage from this module.
    from .epilogue import finalize_row

    for s in range(h // 4):
        o_scale, row_lse = finalize_row(cfg, mSink, st.l[s], st.m[s], is_split, head_of(s, ln.quad))
        st.sc[s] = o_scale
        st.lse[s] = row_lse
    hand_over_final(st.s_scale, st.sc, ln, free_bar, ready_bar)
    scale_heads(st.acc_o, st.sc, h)


def issue_pv(pv_mma, acc_o: cute.Tensor, tOrV_buf, tOrP, sc: cute.Tensor, h: int):
    """O^T = O^T * the heads' factors + V^T P^T of one tile: 16 SS wgmma m64nhk16, committed, not
    waited (a plain function)."""
    scale_heads(acc_o, sc, h)
    warpgroup.fence()
    cute.gemm(pv_mma, acc_o, tOrV_buf, tOrP[None, None, None, 0], acc_o)
    warpgroup.commit_group()


@cute.jit
def head_sums(l: cute.Tensor, s_x: cute.Tensor, buf: cutlass.Constexpr, ln: Lane, bar_id: cutlass.Constexpr):
    """The heads' softmax sums over all 64 rows: each thread's share (its two rows) over the warp's
    rows, then over the four warps (:func:`exchange` in buffer ``buf``)."""
    for s in cutlass.range_constexpr(cute.size(l)):
        l[s] = rows_sum(l[s])
    exchange(l, s_x, buf, ln.warp, ln.lane, False, bar_id)


@cute.jit
def store_out(sQ: cute.Tensor, chunk_layout: cute.ComposedLayout, tma: cute.CopyAtom, dst: cute.Tensor, acc_o,
              h: cutlass.Constexpr, col_half: cutlass.Constexpr, s_idx, row, ln: Lane, bar_id: cutlass.Constexpr,
              policy=None):
    """This warp group's O^T (dims 256 col_half .., already scaled) as ``dst[row, s_idx, :, dims]``
    (``dst`` viewed (h, d, s_q, rows)): each 64-dim chunk staged transposed (h x 64,
    :func:`store_transposed`) in the warp group's part of the Q buffer ``sQ``, then stored by one
    TMA box (warp 0, with the L2 cache ``policy`` where given), overlapping the next chunk's
    staging; warp 0 waits for the reads at the end."""
    chunks = TILE.half_v // TILE.chunk
    block_elems = h * TILE.chunk
    stage_base = sQ.iterator.toint()
    g_o = cute.flat_divide(dst, (h, TILE.chunk))
    for k in cutlass.range_constexpr(chunks):
        elem = (col_half * chunks + k) * block_elems
        store_transposed(stage_base + elem * 2, acc_o, k * (h // 2), h, ln.warp, ln.lane)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=TILE.threads_per_wg)
        if ln.warp == 0:
            staged = cute.make_tensor(cute.recast_ptr(sQ.iterator + elem, chunk_layout.inner, BFloat16),
                                      chunk_layout.outer)
            t_s, t_g = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(staged, 0, 2),
                                             cute.group_modes(g_o, 0, 2))
            with cute.arch.elect_one():
                if cutlass.const_expr(policy is None):
                    cute.copy(tma, t_s, t_g[None, 0, col_half * chunks + k, s_idx, row])
                else:
                    cute.copy(tma, t_s, t_g[None, 0, col_half * chunks + k, s_idx, row], cache_policy=policy)
                cute.arch.cp_async_bulk_commit_group()
    if ln.warp == 0:
        with cute.arch.elect_one():
            cute.arch.cp_async_bulk_wait_group(0, read=True)
    cute.arch.sync_warp()
