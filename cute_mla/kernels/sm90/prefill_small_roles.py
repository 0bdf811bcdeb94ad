"""The SM90 sparse prefill kernel's roles on the swap-AB tile (``swapped.py``: the 64 top-k rows
of a K tile on the wgmma's M side, 8, 16 or 32 heads on N; ``cfg.swapped``).

WG0 does every QK (S^T = K Q^T), the softmax over the rows and P^T, and PV of O^T's dims 0-255
(4 chunks x 4 k-steps = 16 wgmma m64nhk16); WG1 PV of dims 256-511 (16 more): 2h fp32 of O^T
per thread (16 / 32 / 64). WG1 reads the heads' factors from shared memory. The row sums stay
per thread (over its two rows) until the item's end, where they are reduced like the max. Masks:
MMA warp w reads producer warp w's word (rows 16 w .. 16 w + 15). Log2 domain, running max from
-1e30, lse / max_logits / sink / empty rows by the 64-head tile's rules (``finalize_row``,
``max_logit``). Output: O^T's 8 x 8 blocks leave by ``stmatrix.trans`` as rows of out (heads x
64 dims, SW128) into the Q buffer (free after the item's last QK), one TMA store of h x 64 per
chunk.

Pipelines: the 64-head tile's producer (``prefill_roles.py``) and its K barriers, per K buffer b
an early and a late half: ``k_full[b, early]`` 128 noinc arrives, ``k_full[b, late]`` 128 + 4
(the mask words); tile 2i in buffer 0, 2i+1 in buffer 1, phases counted per buffer (``c0``,
``c1``, :func:`tile_slot`). Two differences from the 64-head tile: the producer gathers whole
tiles in order (the producer's ``cfg.swapped`` branch: WG0 waits for all of tile t+1, its QK
behind tile t's PV, before it releases tile t), and ``k_free`` counts 256 on both halves
(:data:`K_FREE_ARRIVALS_SWAPPED`: each MMA group releases both once its PV of the tile retired).
``q_full``: 1 + tx (h x d_qk bf16), waited by WG0 only (WG1's reads of the Q buffer, its output
staging, follow ``PT_READY``). Named barriers (:class:`~.prefill_config.PrefillBar`): ``PT_FREE``
(WG1 -> WG0: P^T and the factors read), ``PT_READY`` (256: a sync for both groups per tile, so it
also orders WG0's own P^T writes before its SS wgmma; WG0 arrives only at an item's end),
``Q_FREE`` (WG1 -> WG0: its staging left the Q buffer), ``EPI_WG0`` (WG0: the max / sum exchange
and its output chunks), ``EPI_WG1`` (WG1's output chunks). No wgmma is left pending at a loop
edge or branch merge.
"""

# No "from __future__ import annotations": cute.struct reads its field annotations as objects.
import functools

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import warpgroup

from ...dsl import ptx as common_ptx
from .config import TILE, Tile
from .mma import k_tensors_for_pv
from .prefill_config import PrefillBar, Sm90SparsePrefillConfig
from .prefill_roles import (EARLY, HALVES, LATE, MASK_BYTES, PAIR_THREADS, Gmem, Smem, items, max_logit, qo_policy,
                            slot, work_of)
from .swapped import (SUM_BUF, WARPS, XCHG_BUFS, SwappedOps, final_factors, get_factors, hand_over_tile, head_of,
                      head_sums, issue_pv, issue_qk_swapped, lane_of, start_walk, store_out, swapped_softmax,
                      take_final, wg0_state, wg1_state)

# The producer's K buffer halves (``prefill_roles.py``) are released together here: each MMA warp
# group arrives on both halves of a tile's buffer once its PV of the tile retired (QK reads every
# chunk, the two PVs half of the V columns each).
K_FREE_ARRIVALS_SWAPPED = (2 * TILE.threads_per_wg,) * HALVES
assert TILE.tokens == WARPS * 16, "an MMA warp holds 16 of the tile's rows (the producer's mask word of its warp)"


@functools.lru_cache(maxsize=None)
def swapped_storage(tile: Tile, h: int):
    """The CTA's shared memory in the swap-AB tile: Q (h x d_qk, also the output staging: h x 512
    bf16 fits), the 64-head tile's two K tiles and barriers / masks (the producer's), P^T, the
    heads' O factors (WG0 -> WG1) and the exchange buffers (V3.2 widths, h = 32: 190,464 B)."""

    @cute.struct
    class SwappedStorage:
        q_full: cute.struct.MemRange[Int64, 1]
        k_full: cute.struct.MemRange[Int64, TILE.k_bufs * HALVES]
        k_free: cute.struct.MemRange[Int64, TILE.k_bufs * HALVES]
        tile_mask: cute.struct.Align[cute.struct.MemRange[Uint32, MASK_BYTES // 4 * TILE.k_bufs], 16]
        head_scale: cute.struct.Align[cute.struct.MemRange[Float32, h], 16]
        exchange: cute.struct.Align[cute.struct.MemRange[Float32, XCHG_BUFS * WARPS * h], 16]
        sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, h * tile.d_qk], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[BFloat16, tile.k_bufs * tile.k_tile_elems], 1024]
        sP: cute.struct.Align[cute.struct.MemRange[BFloat16, h * TILE.tokens], 1024]

    return SwappedStorage


@cute.jit
def tile_slot(c0: Int32, c1: Int32, t: Int32):
    """(K buffer, phase) of an item's tile ``t``: the producer puts tile 2i in buffer 0 and 2i+1
    in buffer 1; ``c0`` / ``c1`` are the tiles each buffer held before the item."""
    buf = t % TILE.k_bufs
    return buf, (c0 + (c1 - c0) * buf + t // TILE.k_bufs) & 1


@cute.jit
def wait_tile(k_full, buf, phase):
    """Both halves of K buffer ``buf`` gathered (the late one also carries the tile's mask)."""
    cute.arch.mbarrier_wait(k_full + slot(buf, EARLY), phase)
    cute.arch.mbarrier_wait(k_full + slot(buf, LATE), phase)


@cute.jit
def release_tile(k_free, buf):
    """This warp group is done with K buffer ``buf``: both halves (:data:`K_FREE_ARRIVALS_SWAPPED`)."""
    cute.arch.mbarrier_arrive(k_free + slot(buf, EARLY))
    cute.arch.mbarrier_arrive(k_free + slot(buf, LATE))


@cute.jit
def next_qk_behind_pv(cfg: Sm90SparsePrefillConfig, ops: SwappedOps, acc_s, tSrK, tSrQ, k_full, k_free, c0: Int32,
                      c1: Int32, t: Int32, last):
    """After tile ``t``'s PV is committed: tile t+1's QK behind it (unless ``t`` is the item's last
    tile), tile t's K buffer released once its PV retired; every wgmma retired on both branches."""
    buf, _ = tile_slot(c0, c1, t)
    if last:
        warpgroup.wait_group(0)
        release_tile(k_free, buf)
    else:
        nbuf, nphase = tile_slot(c0, c1, t + 1)
        wait_tile(k_full, nbuf, nphase)
        issue_qk_swapped(cfg.tile.d_qk, ops.qk, acc_s, tSrK, tSrQ, nbuf)
        warpgroup.wait_group(1)
        release_tile(k_free, buf)
        warpgroup.wait_group(0)


# ------------------------------------------------------------------------------ the MMA warp groups


@cute.jit
def softmax_wg(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem, ops: SwappedOps, scale_log2: Float32):
    """WG0 of the swap-AB tile, per item: Q by TMA (after WG1's previous output left the staging),
    then per tile QK, the softmax over the rows, P^T and the heads' factors handed over, PV of
    O^T's dims 0-255 with the next tile's QK behind it; then the epilogue (sums, factors to WG1,
    its half of out, lse and max_logits of the h heads)."""
    h = cfg.h_q
    ln = lane_of()
    q_full = smem.storage.q_full.data_ptr()
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    mask_base = smem.storage.tile_mask.data_ptr().toint()
    st = wg0_state(ops, smem.storage, g.tma_q, g.mQ, smem.sQ, smem.sK, k_tensors_for_pv(cfg, smem.sK, 0), smem.sP0, h,
                   cfg.tile.d_qk, ln)
    slots = h // 4

    c0 = Int32(0)   # tiles K buffer 0 held so far (the producer's count)
    c1 = Int32(0)   # the same for buffer 1
    rq = Int32(0)   # items done so far
    begin, end, step = items(cfg, g)
    for item in cutlass.range(begin, end, step, unroll=1):
        w = work_of(cfg, g, item)
        start_walk(st, g.tma_q, q_full, h * cfg.tile.d_qk * 2, w.s_idx, 0, rq, ln, PrefillBar.Q_FREE,
                   cfg.tuning.qo_policy)
        if w.n_tiles > 0:
            wait_tile(k_full, 0, c0 & 1)
            issue_qk_swapped(cfg.tile.d_qk, ops.qk, st.acc_s, st.tSrK, st.tSrQ, 0)
            warpgroup.wait_group(0)
        for t in cutlass.range(0, w.n_tiles, unroll=1):
            buf, _ = tile_slot(c0, c1, t)
            # Producer warp `warp` wrote this warp's 16 rows as bits 0-15 of its word.
            word = Uint32(common_ptx.ld_shared_i32(mask_base + buf * MASK_BYTES + ln.warp * 4)) >> Uint32(ln.lane // 4)
            swapped_softmax(st.acc_s, word, scale_log2, st.m, st.l, st.sc, st.s_x, buf, ln.warp, ln.lane,
                            PrefillBar.EPI_WG0)
            hand_over_tile(st.s_scale, st.sc, st.p_base, st.acc_s, h, ln, PrefillBar.PT_FREE, PrefillBar.PT_READY)
            issue_pv(ops.pv, st.acc_o, st.tOrV[None, None, None, buf], st.tOrP, st.sc, h)
            next_qk_behind_pv(cfg, ops, st.acc_s, st.tSrK, st.tSrQ, k_full, k_free, c0, c1, t, t + 1 == w.n_tiles)
        c0 += (w.n_tiles + 1) // TILE.k_bufs
        c1 += w.n_tiles // TILE.k_bufs

        # ---- epilogue: the heads' sums over the 64 rows' threads, factors to WG1, out, lse, max_logits
        head_sums(st.l, st.s_x, SUM_BUF, ln, PrefillBar.EPI_WG0)
        final_factors(cfg, st, g.mSink, False, ln, h, PrefillBar.PT_FREE, PrefillBar.PT_READY)
        store_out(smem.sQ, ops.chunk_layout, g.tma_out, g.mOut, st.acc_o, h, 0, w.s_idx, 0, ln, PrefillBar.EPI_WG0,
                  qo_policy(cfg))
        if (ln.warp == 0) & (ln.lane < 4):
            for s in cutlass.range_constexpr(slots):
                g.mLse[w.s_idx, head_of(s, ln.quad)] = st.lse[s]
                g.mMax[w.s_idx, head_of(s, ln.quad)] = max_logit(st.l[s], st.m[s])
        rq += 1
    # Balance the barriers WG1 arrived on once more than WG0 synced.
    cute.arch.barrier(barrier_id=PrefillBar.PT_FREE, number_of_threads=PAIR_THREADS)
    if rq > 0:
        cute.arch.barrier(barrier_id=PrefillBar.Q_FREE, number_of_threads=PAIR_THREADS)


@cute.jit
def pv_right_wg(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem, ops: SwappedOps):
    """WG1 of the swap-AB tile: per tile, P^T and the heads' factors from WG0, then the SS wgmma
    O^T[256:] += V^T[256:] P^T; per item, its half of out with the final factors, then ``Q_FREE``."""
    h = cfg.h_q
    ln = lane_of()
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    st = wg1_state(ops, smem.storage, k_tensors_for_pv(cfg, smem.sK, 1), smem.sP0, h, ln)
    # sP / head_scale start out free.
    cute.arch.barrier_arrive(barrier_id=PrefillBar.PT_FREE, number_of_threads=PAIR_THREADS)
    c0 = Int32(0)   # tiles K buffers 0 and 1 held so far
    c1 = Int32(0)
    begin, end, step = items(cfg, g)
    for item in cutlass.range(begin, end, step, unroll=1):
        w = work_of(cfg, g, item)
        st.acc_o.fill(0.0)
        for t in cutlass.range(0, w.n_tiles, unroll=1):
            buf, phase = tile_slot(c0, c1, t)
            cute.arch.barrier(barrier_id=PrefillBar.PT_READY, number_of_threads=PAIR_THREADS)
            get_factors(st.s_scale, st.sc, ln.quad)
            # WG0 already waited for this buffer; waiting on the same phase gives WG1 its own acquire
            # of the gathered rows (the producer cannot refill the buffer before WG1 releases it).
            wait_tile(k_full, buf, phase)
            issue_pv(ops.pv, st.acc_o, st.tOrV[None, None, None, buf], st.tOrP, st.sc, h)
            warpgroup.wait_group(0)
            cute.arch.barrier_arrive(barrier_id=PrefillBar.PT_FREE, number_of_threads=PAIR_THREADS)
            release_tile(k_free, buf)
        c0 += (w.n_tiles + 1) // TILE.k_bufs
        c1 += w.n_tiles // TILE.k_bufs

        take_final(st, ln, h, PrefillBar.PT_FREE, PrefillBar.PT_READY)
        store_out(smem.sQ, ops.chunk_layout, g.tma_out, g.mOut, st.acc_o, h, 1, w.s_idx, 0, ln, PrefillBar.EPI_WG1,
                  qo_policy(cfg))
        # The staging (in sQ) is no longer read: WG0 may load the next item's Q.
        cute.arch.barrier_arrive(barrier_id=PrefillBar.Q_FREE, number_of_threads=PAIR_THREADS)
