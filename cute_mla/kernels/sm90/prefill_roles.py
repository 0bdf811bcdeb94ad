"""The SM90 sparse prefill kernel's warp-group roles and the bundles they take: FlashMLA's
ping-pong of two MMA warp groups over pairs of K tiles (64 and 128 heads; 8, 16 and 32 heads run
the swap-AB tile's MMA warp groups, ``prefill_small_roles.py``, with this producer and its barriers).

A work item is one query token x 64 heads walking its token's top-k list in 64-position K tiles
(``ceil(length / 64)``, ``length`` = top-k or the token's clamped ``topk_length``; none for an
empty list), two at a time: tile 2i of the item in K buffer 0, tile 2i+1 (if any) in buffer 1.
O is split by columns: WG0 owns O[:, :256], WG1 O[:, 256:].

* WG0 (``Role.SOFTMAX``): per item Q by TMA; per pair S0 = Q K0^T, then ``QK_ORDER`` to WG1
  (below), mA = max(M, rowmax S0) to WG1, P0 = exp2(S0 - mA), the RS wgmma P0 V0[:, left] from
  registers; then mB from WG1, O_left, its row sums and P0 rescaled by exp2(mA - mB), bf16 P0 to
  WG1, the SS wgmma P1 V1[:, left] with WG1's P from shared memory; the item's lse and max_logits.
* WG1 (``Role.PV_RIGHT``): per pair S1 = Q K1^T (its late half once WG0's QK retired),
  mB = max(mA, rowmax S1) to WG0, O_right and its row sums rescaled by exp2(M - mB),
  P1 = exp2(S1 - mB), the RS wgmma P1 V1[:, right], bf16 P1 to WG0, the SS wgmma P0 V0[:, right].
* WG2 (``Role.PRODUCER``): the row gather with ``cp.async`` straight into the swizzled K tile
  (zero fill for an invalid position: negative, ``>= s_kv`` or past the length), the tile's
  validity mask, in half tiles with their own barriers (below).

The lazy running max (``Sm90PrefillTuning.lazy_max``). mA and mB move a row's base only when
the tile's max passes it by more than :data:`LAZY_MAX_STEP` (so P <= 2^8); the rows' true maxima
are kept apart for max_logits (WG1 publishes its tiles' in ``row_max[128:192]`` with mB). WG1
also writes one flag per warp, any of its rows moved in this pair (``row_max[192:196]``, before
``MAX_B``). Where no row moved (f = 1, the same for the whole group), WG0 hands P0 over as
computed right after ``MAX_B``, with no rescale, then retires its RS PV, releases buffer 0's
early half and waits for P1 (:func:`wg0_tail_lazy`); otherwise it takes the default's path.

The last pair of an item with an odd tile count has no odd tile: WG1 skips its QK, its P and its
RS PV (mB = mA), WG0 skips MAX_B, P1_READY and its SS PV, and buffer 1 is not filled. That pair
runs after the pair loop as its own straight-line code (``odd=False``): every dynamic loop
iteration and branch retires its wgmmas before it ends (ptxas serializes every wgmma of the
kernel otherwise).

Half tiles. A K buffer's 64-dim chunks split in an early half, the V columns its own tile's RS
PV reads (buffer 0: chunks 0-3, buffer 1: chunks 4-7), and a late half, the rest (V columns the
other warp group's SS PV reads, the RoPE chunk, and P of d_qk 576, below). The early half is free
once its owner's RS PV retired, mid-pair, so the producer gathers the next pair's early halves
while the current pair's SS PVs run; QK waits for the early half, issues its chunks, then waits
for the late half.

mbarriers (producer -> consumers; ``slot = 2 * buffer + half``):

========================  =========================================  ===================================
barrier                   arrivals per phase                         waited by
========================  =========================================  ===================================
``q_full``                1 + tx (WG0 warp 0's TMA of Q)             WG0 and WG1 (parity: items)
``k_full[b, early]``      128 ``cp.async...arrive.noinc``            the owner (QK); b = 0: WG0, 1: WG1
``k_full[b, late]``       128 noinc + 4 (lane 0 of each producer     both: the owner (QK, mask), the
                          warp after its mask word)                  other (its SS PV reads V there)
``k_free[b, early]``      128: the owner, its RS PV retired          producer
``k_free[b, late]``       256: the owner once its QK retired and     producer
                          its P stored, the other once its SS PV
                          retired
========================  =========================================  ===================================

(The swap-AB tile, ``prefill_small_roles.py``, counts 256 on both ``k_free`` halves and takes
the tiles whole, in order.)

Phases: buffer 0's barriers flip once per pair (``c0``), buffer 1's once per odd tile (``c1``),
counted across the CTA's items by every role.

Named barriers (:class:`~.prefill_config.PrefillBar`; 256 threads unless noted; per use one
side arrives and the other syncs, once each):

=============  ===========  =========================================================  ==============
id             direction    what it hands over                                         uses
=============  ===========  =========================================================  ==============
QK_ORDER (13)  WG0 -> WG1   QK0 retired: WG1 issues the late half of QK1               pairs with an odd tile
MAX_A (8)      WG0 -> WG1   mA in ``row_max[0:64]``                                    every pair
MAX_B (9)      WG1 -> WG0   mB in ``row_max[64:128]`` (``lazy_max``: + [128:196))      pairs with an odd tile
P0_READY (10)  WG0 -> WG1   bf16 P0 at mB in P buffer 0 (+ proxy fence)                every pair
P1_READY (11)  WG1 -> WG0   bf16 P1 in P buffer 1 (+ proxy fence)                      pairs with an odd tile
L_SUM (12)     both sync    the item's row sums in ``row_sum``                         every item
EPI_WG0/1      one WG, 128  a staged output chunk written (``put_chunk``)              per chunk
=============  ===========  =========================================================  ==============

The QKs of a pair are staggered (``QK_ORDER``): issued side by side, both would retire at the
end of the two and both softmaxes would then run with the tensor cores idle; with WG1's late
half behind QK0, WG0's softmax runs under it and WG1's under WG0's RS PV. WG1's early half still
goes in at once, so its chunks cover a late half still in flight.

No arrive can lap its sync: WG0 arrives MAX_A again only after syncing MAX_B (or, after an
item's last pair, L_SUM), which WG1 reaches only past its MAX_A sync; WG0 arrives QK_ORDER only
in a pair with an odd tile and then syncs MAX_B, which WG1 arrives only past its QK_ORDER sync;
WG1 arrives MAX_B / P1_READY again only after syncing MAX_A; WG0 arrives P0_READY again only
after waiting ``k_full[0, late]``, which WG1 released after its SS PV of the last P0. Buffer
reuse follows from the same chain: a P buffer is rewritten only after the ``k_full[b, late]``
phase that the reader's release opened, ``row_max`` halves only after the reader passed the next
barrier, ``row_sum`` only after ``q_full`` of the next item (or, with the "ring", ``L_SUM`` of
the item after: the sums are kept per item parity).
``tests/test_sparse_prefill_protocol.py`` runs a transcription of these operations under random
interleavings (deadlock, lapping and race checks; keep it in step with the roles).

P buffers: for d_qk 576 P of buffer b is the RoPE chunk of K buffer b (free once the tile's QK
retired; no room for a separate 16 KiB), for d_qk 512 a 2 x 8 KiB ``sP``.

Output staging (``Sm90PrefillTuning.staging``), both so that the next item's Q need not wait for
the output stores: "ring" (d_qk 512), in a ring of two 8 KiB chunks per group, its own P buffer
and its chunk of ``sO`` (:func:`store_ring`), so WG0 loads the next Q right after ``L_SUM``, when
both groups' QKs and SS PVs of the item have retired (the row sums then kept per item parity);
"q_reload", in Q, WG0 expecting the next Q's bytes and loading the chunks no output is staged in
right after ``L_SUM``, each group reloading its own four chunks as its stores read them
(:func:`store_q_reload`).
"""

# No "from __future__ import annotations": cute.struct reads its field annotations as objects.
import functools
import math
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...dsl import ptx as common_ptx
from . import ptx
from .config import TILE, Tile
from .cta import Cta
from .epilogue import BlockStore, chunk_lane, finalize_row, put_chunk
from .mma import Ops, c_layout_to_a_layout, k_tensors_for_pv, scale_rows
from .prefill_config import PrefillBar, Sm90SparsePrefillConfig
from .softmax import exp_rows, load_q, masked_row_max

PAIR_THREADS = 2 * TILE.threads_per_wg   # the named barriers WG0 and WG1 share
TOKENS_PER_PASS = 4                      # rows a producer warp gathers per pass: 8 lanes x 16 B per 128-B chunk
PASSES = TILE.tokens // (4 * TOKENS_PER_PASS)   # passes per tile: 4 warps x 4 rows x 4 passes = 64 rows
RING_CHUNK = TILE.heads * TILE.chunk     # bf16 elements of one 64 x 64 chunk (staged out, or Q by chunk)
MASK_BYTES = 16                          # per K buffer: one 32-bit word of mask bits per producer warp
EARLY, LATE = 0, 1                       # the halves of a K buffer (module docstring)
HALVES = 2
V_CHUNKS_PER_WG = TILE.half_v // TILE.chunk   # 4: the 64-dim chunks of one warp group's O columns
# Arrivals per phase, indexed by half: k_full (the producer's noinc arrives, + one per warp after
# its mask word in the late half), k_free (the owner alone in the early half, both MMA groups late).
K_FULL_ARRIVALS = (TILE.threads_per_wg, TILE.threads_per_wg + TILE.threads_per_wg // 32)
K_FREE_ARRIVALS = (TILE.threads_per_wg, 2 * TILE.threads_per_wg)
LN2 = math.log(2.0)
# ``lazy_max``: a row's base moves only past this many log2 units (P <= 2^8 in bf16 and fp32).
LAZY_MAX_STEP = 8.0
# ``row_max``: mA at 0, mB at ``heads``; with ``lazy_max`` then WG1's true maxima and one
# moved-flag per WG1 warp.
ROW_TRUE_MAX = 2 * TILE.heads
ROW_MOVED = 3 * TILE.heads
WARPS_PER_WG = TILE.threads_per_wg // 32


def row_max_len(lazy_max: bool) -> int:
    """Floats in ``row_max``: the two groups' bases, and with ``lazy_max`` the true maxima and flags."""
    return ROW_MOVED + WARPS_PER_WG if lazy_max else ROW_TRUE_MAX
assert TILE.chunk_row_bytes == 8 * 16, "a K tile row of one 64-dim chunk is eight 16-B units, one per lane of a group"
assert TILE.k_bufs == 2, "tiles go in pairs: 2i in buffer 0, 2i+1 in buffer 1"


def slot(buf: int, half: int) -> int:
    """Index of K buffer ``buf``'s ``half`` in the k_full / k_free arrays."""
    return buf * HALVES + half


def half_chunks(tile: Tile, buf: int, half: int) -> tuple:
    """The 64-dim chunks of K buffer ``buf``'s ``half`` (compile time). Early: the V columns of the
    warp group whose tile sits in the buffer (buffer b's tile is WG b's, which owns O column block
    b); late: the other V columns, then the RoPE chunk (d_qk 576)."""
    own = tuple(range(buf * V_CHUNKS_PER_WG, (buf + 1) * V_CHUNKS_PER_WG))
    if half == EARLY:
        return own
    v_chunks = TILE.d_v // TILE.chunk
    return tuple(c for c in range(v_chunks) if c not in own) + tuple(range(v_chunks, tile.chunks))


def p_in_k(tile: Tile) -> bool:
    """Whether P of buffer b lives in K buffer b's RoPE chunk (d_qk 576: no room for 2 x 8 KiB
    more; the chunk is read only by the tile's QK, which retired before P is written)."""
    return tile.chunks > TILE.d_v // TILE.chunk


class Gmem(NamedTuple):
    """The kernel's global tensors and the TMA atoms that read or write them."""

    tma_q: cute.CopyAtom
    mQ: cute.Tensor              # Q as (h, d_qk, s_q, 1): TMA boxes of 64 heads x d_qk dims
    tma_out: cute.CopyAtom
    mOut: cute.Tensor            # out as (h, d_v, s_q, 1): TMA boxes of 64 heads x 64 columns
    mKV: cute.Tensor             # (s_kv, d_qk) bf16
    mIdx: cute.Tensor            # (s_q, topk) int32
    mTopkLen: Optional[cute.Tensor]
    mSink: Optional[cute.Tensor]
    mMax: cute.Tensor            # (s_q, h) fp32
    mLse: cute.Tensor            # (s_q, h) fp32


class Work(NamedTuple):
    """One work item of a CTA: its token, 64-head block and K tiles."""

    s_idx: Int32
    hblk: Int32
    length: Int32      # valid positions are < length
    n_tiles: Int32


def items(cfg: Sm90SparsePrefillConfig, g: Gmem):
    """(begin, end, step) of the walk every role of a CTA takes: items ``blockIdx.x, + gridDim.x,
    ...`` of the s_q * ceil(h_q / 64) (token, head block) items, a token's head blocks consecutive
    (so with an even grid the two head halves of h_q = 128 run side by side and the second one's
    rows come from L2)."""
    return cute.arch.block_idx()[0], g.mIdx.shape[0] * cfg.n_hblk, cute.arch.grid_dim()[0]


@cute.jit
def work_of(cfg: Sm90SparsePrefillConfig, g: Gmem, item: Int32) -> Work:
    s_idx = item // cfg.n_hblk
    length, n_tiles = tiles_of(cfg, g, s_idx)
    return Work(s_idx, item % cfg.n_hblk, length, n_tiles)


class RowStats(NamedTuple):
    """An item's statistics of a thread's two accumulator rows once the sums are whole: the
    running max (P's base), the row sums at it, and the rows' true maxima (max_logits)."""

    m0: Float32
    m1: Float32
    l0: Float32
    l1: Float32
    t0: Float32
    t1: Float32


class Smem(NamedTuple):
    """The shared-memory struct and the tensors the MMAs read: Q, the two K tiles, and the P
    buffers of K buffers 0 and 1 (:func:`p_tensors`)."""

    storage: object
    sQ: cute.Tensor
    sK: cute.Tensor
    sP0: cute.Tensor
    sP1: cute.Tensor


@functools.lru_cache(maxsize=None)
def shared_storage(tile: Tile, staging: str, lazy_max: bool = False):
    """The CTA's shared memory, one struct: the barriers, the tiles' masks, the row maxima and
    sums the MMA warp groups exchange, Q (also the output staging with "q_reload"), two K
    tiles, for d_qk 512 the two P buffers (d_qk 576 keeps P in the K tiles' RoPE chunks) and with
    the "ring" (``Sm90PrefillTuning.staging``) a 16 KiB ``sO``: 223,232 B for d_qk 576, 215,040 B
    for 512, 231,424 B with the ring, of 232,448. With the ring the row sums are kept per item
    parity: nothing else orders WG1's read of one item's sums before WG0's write of the next's
    (an item of one tile or none waits for nothing) but L_SUM of the item after ("q_reload" has
    the next Q's chunks WG1 reloads after its read)."""
    n_bar = TILE.k_bufs * HALVES
    in_k = p_in_k(tile)
    assert staging in ("ring", "q_reload"), "the ping-pong stages out in a ring or in Q reloaded behind its stores"
    assert staging == "q_reload" or not in_k, "the ring: no room at this d_qk"
    sums = 2 * TILE.heads * (2 if staging == "ring" else 1)

    @cute.struct
    class SharedStorage:
        q_full: cute.struct.MemRange[Int64, 1]
        k_full: cute.struct.MemRange[Int64, n_bar]
        k_free: cute.struct.MemRange[Int64, n_bar]
        tile_mask: cute.struct.Align[cute.struct.MemRange[Uint32, MASK_BYTES // 4 * TILE.k_bufs], 16]
        row_max: cute.struct.MemRange[Float32, row_max_len(lazy_max)]   # mA (WG0), mB (WG1), ...
        row_sum: cute.struct.MemRange[Float32, sums]             # an item's row sums of WG0, WG1
        sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, tile.q_elems], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[BFloat16, tile.k_bufs * tile.k_tile_elems], 1024]
        if not in_k:
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, TILE.k_bufs * TILE.p_elems], 1024]
        if staging == "ring":
            sO: cute.struct.Align[cute.struct.MemRange[BFloat16, 2 * RING_CHUNK], 1024]   # a chunk per MMA group

    return SharedStorage


def p_tensors(tile: Tile, storage, p_layout: cute.ComposedLayout):
    """(P of buffer 0, P of buffer 1): 64 heads x 64 tokens bf16 in the SW128 K-major layout of
    ``p_layout``, at the RoPE chunk of each K tile (d_qk 576; chunk-aligned, so 1 KiB aligned) or
    in ``sP``. A plain function, traced inline."""
    out = []
    for b in range(TILE.k_bufs):
        if p_in_k(tile):
            base = storage.sK.data_ptr() + (b * tile.k_tile_elems + (tile.chunks - 1) * TILE.tokens * TILE.chunk)
        else:
            base = storage.sP.data_ptr() + b * TILE.p_elems
        out.append(cute.make_tensor(cute.recast_ptr(base, p_layout.inner, dtype=BFloat16), p_layout.outer))
    return tuple(out)


@cute.jit
def tiles_of(cfg: Sm90SparsePrefillConfig, g: Gmem, s_idx: Int32):
    """(length, K tiles) of token ``s_idx``: top-k, or its ``topk_length`` clamped to [0, top-k];
    ``ceil(length / 64)`` tiles (none for an empty list)."""
    topk = g.mIdx.shape[1]
    length = topk
    if cutlass.const_expr(cfg.has_topk_length):
        length = cutlass.max(cutlass.min(g.mTopkLen[s_idx], topk), 0)
    return length, (length + (TILE.tokens - 1)) // TILE.tokens


# ------------------------------------------------------------------------------------- producer


class GatherLane(NamedTuple):
    """A producer thread's fixed part of the gather (see :func:`producer`)."""

    warp: Int32
    lane: Int32
    unit: Int32         # its 16-B unit of a 128-B chunk row
    first_row: Int32    # its tile row in pass 0
    s_kv: Int32
    kv_base: Int64      # kv's address + this lane's unit offset
    row_bytes: Int64    # kv's row stride in bytes
    sk_base: Int32      # shared address of K buffer 0
    mask_base: Int32    # shared address of the tiles' mask words


@cute.jit
def load_tile_indices(gl: GatherLane, idx_row: cute.Tensor, dst: cute.Tensor, first: cutlass.Constexpr, t: Int32,
                      n_tiles: Int32):
    """Tile ``t``'s indices of this lane's rows into ``dst[first:first + PASSES]`` (where the
    tile exists)."""
    if t < n_tiles:
        for i in cutlass.range_constexpr(PASSES):
            dst[first + i] = idx_row[t * TILE.tokens + gl.first_row + i * TOKENS_PER_PASS]


@cute.jit
def gather_half(cfg: Sm90SparsePrefillConfig, gl: GatherLane, cur: cute.Tensor, first: cutlass.Constexpr, t: Int32,
                length: Int32, k_full, k_free, phase, buf: cutlass.Constexpr, half: cutlass.Constexpr):
    """Tile ``t`` (indices ``cur[first:first + PASSES]``) into ``half`` of K buffer ``buf``:
    wait for the half to be free, one ``cp.async`` of 16 B per pass and chunk of the half (zero
    fill for an invalid position), then the noinc arrive on its ``k_full``; the late half also
    stores the warp's 16 mask bits and arrives once more from lane 0."""
    tile = cfg.tile
    cute.arch.mbarrier_wait(k_free + slot(buf, half), phase ^ 1)
    tile_base = gl.sk_base + buf * tile.k_tile_bytes
    chunks = half_chunks(tile, buf, half)
    bits = Uint32(0)
    for i in cutlass.range_constexpr(PASSES):
        row = gl.first_row + i * TOKENS_PER_PASS
        idx = cur[first + i]
        ok = (t * TILE.tokens + row < length) & (idx >= 0) & (idx < gl.s_kv)
        src = gl.kv_base + Int64(common_ptx.select_i32(ok, idx, 0)) * gl.row_bytes
        dst = tile_base + row * TILE.chunk_row_bytes + ((gl.unit ^ (row % 8)) << 4)
        n_bytes = common_ptx.select_i32(ok, 16, 0)
        for j in cutlass.range_constexpr(len(chunks)):
            c = chunks[j]
            ptx.cp_async_16(dst + c * tile.chunk_bytes, src + c * TILE.chunk_row_bytes, n_bytes, cfg.tuning.gather_l2)
        if cutlass.const_expr(half == LATE):
            ballot = Uint32(cute.arch.vote_ballot_sync(ok))
            for j in cutlass.range_constexpr(TOKENS_PER_PASS):
                bits = bits | (((ballot >> Uint32(8 * j)) & Uint32(1)) << Uint32(i * TOKENS_PER_PASS + j))
    ptx.cp_async_arrive_noinc((k_full + slot(buf, half)).toint())
    if cutlass.const_expr(half == LATE):
        if gl.lane == 0:
            common_ptx.st_shared_i32(gl.mask_base + buf * MASK_BYTES + gl.warp * 4, bits)
            cute.arch.mbarrier_arrive(k_full + slot(buf, half))


@cute.jit
def prefetch_tile_rows(gl: GatherLane, nxt: cute.Tensor, first: cutlass.Constexpr, t: Int32, w: Work,
                       chunks: cutlass.Constexpr):
    """Tile ``t``'s rows of this lane into L2 (where the tile exists): lane ``unit`` takes the
    row's 128-B line ``unit`` (and lane 0 the ninth of a 576-wide row)."""
    if t < w.n_tiles:
        for i in cutlass.range_constexpr(PASSES):
            idx = nxt[first + i]
            pos = t * TILE.tokens + gl.first_row + i * TOKENS_PER_PASS
            if (pos < w.length) & (idx >= 0) & (idx < gl.s_kv):
                line = gl.kv_base + Int64(idx) * gl.row_bytes + Int64(gl.unit * (TILE.chunk_row_bytes - 16))
                ptx.prefetch_l2_line(line)
                if cutlass.const_expr(chunks > 8):
                    if gl.unit == 0:
                        ptx.prefetch_l2_line(line + 8 * TILE.chunk_row_bytes)


@cute.jit
def producer(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem):
    """The row gather (WG2), a pair of tiles at a time. Lane ``l`` of warp ``p`` copies 16-B unit
    ``l % 8`` of the 64-dim chunks of tile rows ``16 p + 4 i + l // 8`` (pass i); a row's unit j
    of chunk c lands at ``c * 8192 + row * 128 + ((j ^ (row & 7)) << 4)`` (the K tile's SW128
    layout). Per pair: tile 2i's early half (buffer 0), tile 2i+1's early half (buffer 1), then
    the late halves in the same order (the early halves are released mid-pair, the late ones at
    its end), or for the swap-AB tile whole tiles in order; the next pair's indices are loaded
    first and, with ``prefetch_rows``, its rows prefetched into L2 after (by a token's first head
    block).
    The pairs of the CTA's items follow each other through the buffers, so the next item's first
    tiles are gathered while the MMA warp groups finish an item."""
    tile = cfg.tile
    ptid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = cute.arch.make_warp_uniform(ptid // 32)
    lane = ptid % 32
    unit = lane % 8
    k_full = smem.storage.k_full.data_ptr()
    k_free = smem.storage.k_free.data_ptr()
    gl = GatherLane(warp, lane, unit, warp * (TILE.tokens // 4) + lane // 8, g.mKV.shape[0],
                    g.mKV.iterator.toint() + Int64(unit * 16), Int64(g.mKV.stride[0]) * Int64(2),
                    smem.storage.sK.data_ptr().toint(), smem.storage.tile_mask.data_ptr().toint())

    c0 = Int32(0)   # pairs handed over: buffer 0's phase
    c1 = Int32(0)   # odd tiles handed over: buffer 1's phase
    begin, end, step = items(cfg, g)
    for item in cutlass.range(begin, end, step, unroll=1):
        w = work_of(cfg, g, item)
        idx_row = cute.make_tensor(g.mIdx.iterator + Int64(w.s_idx) * Int64(g.mIdx.stride[0]),
                                   cute.make_layout(g.mIdx.shape[1]))
        nxt = cute.make_rmem_tensor(cute.make_layout(2 * PASSES), Int32)   # a pair's indices: tile 2i, then 2i+1
        load_tile_indices(gl, idx_row, nxt, 0, Int32(0), w.n_tiles)
        load_tile_indices(gl, idx_row, nxt, PASSES, Int32(1), w.n_tiles)
        for pr in cutlass.range(0, (w.n_tiles + 1) // 2, unroll=1):
            t0 = 2 * pr
            has_odd = t0 + 1 < w.n_tiles
            cur = cute.make_rmem_tensor(cute.make_layout(2 * PASSES), Int32)
            cur.store(nxt.load())
            load_tile_indices(gl, idx_row, nxt, 0, t0 + 2, w.n_tiles)
            load_tile_indices(gl, idx_row, nxt, PASSES, t0 + 3, w.n_tiles)
            ph0 = c0 & 1
            ph1 = c1 & 1
            if cutlass.const_expr(cfg.swapped):
                # Whole tiles in order: the swap-AB tile's WG0 waits for all of tile t+1 (its QK
                # behind tile t's PV) before it releases tile t's buffer, so tile 2i+1's early half
                # cannot come before tile 2i's late half.
                gather_half(cfg, gl, cur, 0, t0, w.length, k_full, k_free, ph0, 0, EARLY)
                gather_half(cfg, gl, cur, 0, t0, w.length, k_full, k_free, ph0, 0, LATE)
                if has_odd:
                    gather_half(cfg, gl, cur, PASSES, t0 + 1, w.length, k_full, k_free, ph1, 1, EARLY)
                    gather_half(cfg, gl, cur, PASSES, t0 + 1, w.length, k_full, k_free, ph1, 1, LATE)
                    c1 += 1
            else:
                gather_half(cfg, gl, cur, 0, t0, w.length, k_full, k_free, ph0, 0, EARLY)
                if has_odd:
                    gather_half(cfg, gl, cur, PASSES, t0 + 1, w.length, k_full, k_free, ph1, 1, EARLY)
                gather_half(cfg, gl, cur, 0, t0, w.length, k_full, k_free, ph0, 0, LATE)
                if has_odd:
                    gather_half(cfg, gl, cur, PASSES, t0 + 1, w.length, k_full, k_free, ph1, 1, LATE)
                    c1 += 1
            c0 += 1
            if cutlass.const_expr(cfg.tuning.prefetch_rows):
                # The next pair's rows into L2 while this lane waits for the next free half, from a
                # token's first head block only: its second block walks the same rows beside it, and
                # a second prefetch of a line only adds a request to L2.
                if w.hblk == 0:
                    prefetch_tile_rows(gl, nxt, 0, t0 + 2, w, tile.chunks)
                    prefetch_tile_rows(gl, nxt, PASSES, t0 + 3, w, tile.chunks)


@cute.jit
def tile_mask(mask_base: Int32, buf):
    """(tokens 0-31, tokens 32-63) validity words of K buffer ``buf``: producer warp p wrote rows
    16 p .. 16 p + 15 as bits 0-15 of its word."""
    words = common_ptx.ld_shared_v4(mask_base + buf * MASK_BYTES)
    lo = Uint32(common_ptx.vec_elem(words, 0)) | (Uint32(common_ptx.vec_elem(words, 1)) << Uint32(16))
    hi = Uint32(common_ptx.vec_elem(words, 2)) | (Uint32(common_ptx.vec_elem(words, 3)) << Uint32(16))
    return lo, hi


# ------------------------------------------------------------------------------ the MMA warp groups


class MmaWg(NamedTuple):
    """An MMA warp group's fixed state: its thread's rows, the barriers, and the MMA fragments
    (``wg`` = 0 or 1: O column block ``wg``, own tiles in K buffer ``wg``)."""

    warp: Int32
    quad: Int32
    row0: Int32               # accumulator rows of this thread: row0 and row0 + 8
    k_full: object
    k_free: object
    mask_base: Int32
    s_max: cute.Tensor        # row_max: [0, 64) mA, [64, 128) mB (``lazy_max``: then WG1's true maxima, its flags)
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrV_rs: cute.Tensor      # V[:, own columns] of both buffers, B of the RS PV
    tOrV_ss: cute.Tensor      # the same, B of the SS PV
    acc_o: cute.Tensor        # 64 x 256 fp32
    acc_s: cute.Tensor        # 64 x 64 fp32: S, then P
    tOrP: cute.Tensor         # bf16 P as the RS PV's A operand
    tOrP_as_c: cute.Tensor    # the same registers in the accumulator layout
    rP: cute.Tensor           # a second bf16 P (accumulator layout): stored while the RS PV reads tOrP
    tSsP_own: cute.Tensor     # P buffer ``wg`` in the accumulator layout (stores)
    tOrP_other: cute.Tensor   # P buffer ``1 - wg`` as the SS PV's A operand
    thr_pv: object            # the RS PV's thread slice (the epilogue's partition of O)


def mma_wg(cfg: Sm90SparsePrefillConfig, smem: Smem, ops: Ops, wg: int) -> MmaWg:
    """The fixed state of MMA warp group ``wg`` (a plain function, traced inline)."""
    wtid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = cute.arch.make_warp_uniform(wtid // 32)
    lane = wtid % 32
    thr_qk = ops.qk.get_slice(wtid)
    thr_rs = ops.pv_rs.get_slice(wtid)
    thr_ss = ops.pv_ss.get_slice(wtid)
    sV = k_tensors_for_pv(cfg, smem.sK, wg)
    acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE.heads, TILE.tokens)))
    tOrP = cute.make_rmem_tensor(c_layout_to_a_layout(acc_s.layout, ops.pv_rs.tv_layout_A.shape[1]), BFloat16)
    own, other = (smem.sP0, smem.sP1) if wg == 0 else (smem.sP1, smem.sP0)
    return MmaWg(
        warp, lane % 4, warp * 16 + lane // 4,
        smem.storage.k_full.data_ptr(), smem.storage.k_free.data_ptr(), smem.storage.tile_mask.data_ptr().toint(),
        smem.storage.row_max.get_tensor(cute.make_layout(row_max_len(cfg.tuning.lazy_max))),
        thr_qk.make_fragment_A(thr_qk.partition_A(smem.sQ)), thr_qk.make_fragment_B(thr_qk.partition_B(smem.sK)),
        thr_rs.make_fragment_B(thr_rs.partition_B(sV)), thr_ss.make_fragment_B(thr_ss.partition_B(sV)),
        thr_rs.make_fragment_C(thr_rs.partition_shape_C((TILE.heads, cfg.pv_cols))), acc_s,
        tOrP, cute.make_tensor(tOrP.iterator, acc_s.layout), cute.make_rmem_tensor(acc_s.layout, BFloat16),
        thr_qk.partition_C(own[None, None, 0]), thr_ss.make_fragment_A(thr_ss.partition_A(other)), thr_rs)


def qk_tile(cfg: Sm90SparsePrefillConfig, ops: Ops, v: MmaWg, buf: int, phase, after_qk0: bool = False):
    """S = Q K^T over K buffer ``buf``: the early half's chunks once that half landed, then the
    late half's (d_qk / 16 SS wgmma 64x64x16 in all), retired before it returns; ``after_qk0``
    (WG1): the late half's only once WG0's QK retired (``QK_ORDER``). A plain function: its loops
    unroll at trace time."""
    tSrK_b = v.tSrK[None, None, None, buf]
    v.acc_s.fill(0.0)
    for half in range(HALVES):
        cute.arch.mbarrier_wait(v.k_full + slot(buf, half), phase)
        if half == EARLY:
            warpgroup.fence()
        if after_qk0 and half == LATE:
            cute.arch.barrier(barrier_id=PrefillBar.QK_ORDER, number_of_threads=PAIR_THREADS)
        for c in half_chunks(cfg.tile, buf, half):
            for k in range(c * (TILE.chunk // 16), (c + 1) * (TILE.chunk // 16)):
                cute.gemm(ops.qk, v.acc_s, v.tSrQ[None, None, k, 0], tSrK_b[None, None, k], v.acc_s)
        warpgroup.commit_group()
    warpgroup.wait_group(0)


@cute.jit
def put_rows(s: cute.Tensor, base: cutlass.Constexpr, row0, quad, v0: Float32, v1: Float32):
    """``s[base + row0] = v0``, ``s[base + row0 + 8] = v1`` from one lane of the quad."""
    if quad == 0:
        s[base + row0] = v0
        s[base + row0 + 8] = v1


def exp2(x):
    return cute.math.exp2(x, fastmath=True)


def tile_row_max(cfg: Sm90SparsePrefillConfig, v: "MmaWg", lo, hi, scale_log2: Float32):
    """This thread's two rows' maxima of the tile (masked, scaled by ``scale_log2``). With
    ``ffma_exp`` S stays raw (masked) and only the maxima are scaled, for :func:`tile_exp`."""
    if cfg.tuning.ffma_exp:
        mx0, mx1 = masked_row_max(v.acc_s, lo, hi, v.quad, Float32(1.0))
        return mx0 * scale_log2, mx1 * scale_log2
    return masked_row_max(v.acc_s, lo, hi, v.quad, scale_log2)


def tile_exp(cfg: Sm90SparsePrefillConfig, v: "MmaWg", scale_log2: Float32, m0: Float32, m1: Float32):
    """P = exp2(S * scale_log2 - m) in place after :func:`tile_row_max` (one FFMA an element with
    ``ffma_exp``, where S is raw); returns this thread's partial row sums."""
    return exp_rows(v.acc_s, m0, m1, scale_log2 if cfg.tuning.ffma_exp else None)


def new_base(cfg: Sm90SparsePrefillConfig, m, x):
    """A row's running max (its P's base) after a tile whose max is ``x``: max(m, x), or with
    ``lazy_max`` m until x passes it by more than :data:`LAZY_MAX_STEP`."""
    if cfg.tuning.lazy_max:
        return Float32(cutlass.select_(x - m > Float32(LAZY_MAX_STEP), x, m))
    return cute.arch.fmax(m, x)


@cute.jit
def put_moved(v: MmaWg, moved):
    """WG1 (``lazy_max``): this warp's flag (any of its rows' base moved in this pair) after the
    true maxima in ``row_max``."""
    ballot = Uint32(cute.arch.vote_ballot_sync(moved))
    if cute.arch.lane_idx() == 0:
        v.s_max[ROW_MOVED + v.warp] = Float32(cutlass.select_(ballot != Uint32(0), Float32(1.0), Float32(0.0)))


def any_moved(v: MmaWg):
    """WG0 (``lazy_max``), after ``MAX_B``: whether any row of the pair moved its base (the same
    value in every thread of the group)."""
    f = v.s_max[ROW_MOVED]
    for w in range(1, WARPS_PER_WG):
        f = f + v.s_max[ROW_MOVED + w]
    return f > Float32(0.0)


def scale_o(cfg: Sm90SparsePrefillConfig, v: MmaWg, sc0: Float32, sc1: Float32, moved):
    """O's two rows of this thread times ``sc0``, ``sc1``, the factors from the rows' old base to
    their new one (``skip_unit_scale``: only in a warp where some row's base ``moved``,
    :func:`scale_o_if_moved`)."""
    if cfg.tuning.skip_unit_scale:
        scale_o_if_moved(v, sc0, sc1, moved)
    else:
        scale_rows(v.acc_o, sc0, sc1)


@cute.jit
def scale_o_if_moved(v: MmaWg, sc0: Float32, sc1: Float32, moved):
    """:func:`scale_o` in a warp where a row's base moved; elsewhere every factor is exp2(0) and
    O stays as it is. No wgmma is in flight here, so the branch merges with nothing pending."""
    if cute.arch.vote_any_sync(moved):
        scale_rows(v.acc_o, sc0, sc1)


def hand_p(src: cute.Tensor, v: MmaWg, bar: int):
    """bf16 ``src`` (this thread's P fragment, accumulator layout) into this warp group's P
    buffer, fenced for the other group's SS wgmma, then ``bar`` arrived."""
    cute.autovec_copy(src, v.tSsP_own)
    cute.arch.fence_view_async_shared()
    cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=PAIR_THREADS)


def wg0_pair(cfg: Sm90SparsePrefillConfig, ops: Ops, v: MmaWg, scale_log2: Float32, ph0, ph1, m0, m1, l0, l1, t0, t1,
             odd: bool):
    """WG0's part of one pair (``odd``: the pair has tile 2i+1). Straight-line code (a plain
    function: ``odd`` is a trace-time flag) that retires its wgmmas before it returns. Returns
    the rows' new running max (mB, or mA without an odd tile), WG0's row sums at that max and
    (``lazy_max``, where the running max is P's base, not the rows' max) their true maxima
    ``t0``, ``t1`` so far."""
    lazy = cfg.tuning.lazy_max
    qk_tile(cfg, ops, v, 0, ph0)
    if odd:
        # QK1's late half goes in now: WG0's softmax runs under it, not beside WG1's.
        cute.arch.barrier_arrive(barrier_id=PrefillBar.QK_ORDER, number_of_threads=PAIR_THREADS)
    lo, hi = tile_mask(v.mask_base, 0)
    mx0, mx1 = tile_row_max(cfg, v, lo, hi, scale_log2)
    ma0 = new_base(cfg, m0, mx0)
    ma1 = new_base(cfg, m1, mx1)
    if lazy:
        t0 = cute.arch.fmax(t0, mx0)
        t1 = cute.arch.fmax(t1, mx1)
    put_rows(v.s_max, 0, v.row0, v.quad, ma0, ma1)
    cute.arch.barrier_arrive(barrier_id=PrefillBar.MAX_A, number_of_threads=PAIR_THREADS)
    sc0 = exp2(m0 - ma0)
    sc1 = exp2(m1 - ma1)
    s0, s1 = tile_exp(cfg, v, scale_log2, ma0, ma1)
    l0 = l0 * sc0 + s0
    l1 = l1 * sc1 + s1
    scale_o(cfg, v, sc0, sc1, (ma0 != m0) | (ma1 != m1))
    v.tOrP_as_c.store(v.acc_s.load().to(BFloat16))
    if not odd:
        # mB = mA: P0 is final; handed over before the RS PV reads its registers.
        hand_p(v.tOrP_as_c, v, PrefillBar.P0_READY)
    if odd and lazy:
        # P0 to hand over after MAX_B. The compiler may merge this copy with tOrP: the store then
        # reads the RS PV's operand registers while it runs, as WG1's hand-over of P1 does.
        v.rP.store(v.acc_s.load().to(BFloat16))
    warpgroup.fence()
    cute.gemm(ops.pv_rs, v.acc_o, v.tOrP, v.tOrV_rs[None, None, None, 0], v.acc_o)
    warpgroup.commit_group()
    if not odd:
        warpgroup.wait_group(0)
        cute.arch.mbarrier_arrive(v.k_free + slot(0, EARLY))
        cute.arch.mbarrier_arrive(v.k_free + slot(0, LATE))
        return ma0, ma1, l0, l1, (t0 if lazy else ma0), (t1 if lazy else ma1)

    cute.arch.barrier(barrier_id=PrefillBar.MAX_B, number_of_threads=PAIR_THREADS)
    mb0 = v.s_max[TILE.heads + v.row0]
    mb1 = v.s_max[TILE.heads + v.row0 + 8]
    f0 = exp2(ma0 - mb0)
    f1 = exp2(ma1 - mb1)
    if lazy:
        t0 = cute.arch.fmax(t0, v.s_max[ROW_TRUE_MAX + v.row0])
        t1 = cute.arch.fmax(t1, v.s_max[ROW_TRUE_MAX + v.row0 + 8])
        wg0_tail_lazy(ops, v, ph1, f0, f1, any_moved(v))
        return mb0, mb1, l0 * f0, l1 * f1, t0, t1
    wg0_rescaled_p0(ops, v, ph1, f0, f1, v.tOrP_as_c)
    cute.arch.mbarrier_arrive(v.k_free + slot(1, LATE))    # V1[:, left] and P1 read
    return mb0, mb1, l0 * f0, l1 * f1, mb0, mb1


def wg0_rescaled_p0(ops: Ops, v: MmaWg, ph1, f0: Float32, f1: Float32, p_regs: cute.Tensor):
    """WG0 after ``MAX_B`` where a row's base moved: the RS PV of P0 retired, O_left and P0
    rescaled to mB, P0 handed over from ``p_regs``, then the SS PV of P1 issued and retired. A
    plain function, traced inline."""
    warpgroup.wait_group(0)
    cute.arch.mbarrier_arrive(v.k_free + slot(0, EARLY))   # V0[:, left] read
    scale_rows(v.acc_o, f0, f1)
    scale_rows(v.acc_s, f0, f1)
    p_regs.store(v.acc_s.load().to(BFloat16))
    hand_p(p_regs, v, PrefillBar.P0_READY)
    cute.arch.mbarrier_arrive(v.k_free + slot(0, LATE))    # QK0 retired, P0 written
    wg0_pv_p1(ops, v, ph1)
    warpgroup.wait_group(0)


def wg0_pv_p1(ops: Ops, v: MmaWg, ph1):
    """WG0: once WG1's P1 is in its P buffer and buffer 1's late half landed, the SS wgmma
    P1 V1[:, left] issued and committed (not retired). A plain function, traced inline."""
    cute.arch.barrier(barrier_id=PrefillBar.P1_READY, number_of_threads=PAIR_THREADS)
    cute.arch.mbarrier_wait(v.k_full + slot(1, LATE), ph1)
    warpgroup.fence()
    cute.gemm(ops.pv_ss, v.acc_o, v.tOrP_other[None, None, None, 0], v.tOrV_ss[None, None, None, 1], v.acc_o)
    warpgroup.commit_group()


@cute.jit
def wg0_tail_lazy(ops: Ops, v: MmaWg, ph1, f0: Float32, f1: Float32, moved):
    """WG0's pair after ``MAX_B`` with ``lazy_max`` (the RS PV of P0 in flight; ``moved`` is the
    same in the whole group). No row moved its base (``f`` = 1): P0 as computed handed over at
    once, then the RS PV retired and buffer 0's early half released before the wait for P1.
    Otherwise the default's order: the RS PV retired, O_left and P0 rescaled, P0 handed over.
    Both paths then issue the SS PV of P1 and retire every wgmma before they merge."""
    if moved:
        wg0_rescaled_p0(ops, v, ph1, f0, f1, v.rP)
    else:
        hand_p(v.rP, v, PrefillBar.P0_READY)
        cute.arch.mbarrier_arrive(v.k_free + slot(0, LATE))    # QK0 retired, P0 written
        warpgroup.wait_group(0)
        cute.arch.mbarrier_arrive(v.k_free + slot(0, EARLY))   # V0[:, left] read
        wg0_pv_p1(ops, v, ph1)
        warpgroup.wait_group(0)
    cute.arch.mbarrier_arrive(v.k_free + slot(1, LATE))        # V1[:, left] and P1 read


def wg1_pair(cfg: Sm90SparsePrefillConfig, ops: Ops, v: MmaWg, scale_log2: Float32, ph0, ph1, m0, m1, l0, l1, t0, t1,
             odd: bool):
    """WG1's part of one pair (``odd``: the pair has tile 2i+1, else no QK, no P, no RS PV, and
    mB = mA). Straight-line code that retires its wgmmas before it returns. Returns the rows' new
    running max, WG1's row sums at that max and (``lazy_max``) the true maxima of its tiles, which
    it publishes with mB for WG0's max_logits."""
    lazy = cfg.tuning.lazy_max
    mx0 = -Float32.inf
    mx1 = -Float32.inf
    if odd:
        qk_tile(cfg, ops, v, 1, ph1, after_qk0=True)
        lo, hi = tile_mask(v.mask_base, 1)
        mx0, mx1 = tile_row_max(cfg, v, lo, hi, scale_log2)
    cute.arch.barrier(barrier_id=PrefillBar.MAX_A, number_of_threads=PAIR_THREADS)
    mb0 = v.s_max[v.row0]
    mb1 = v.s_max[v.row0 + 8]
    if odd:
        ma0 = mb0
        ma1 = mb1
        mb0 = new_base(cfg, ma0, mx0)
        mb1 = new_base(cfg, ma1, mx1)
        put_rows(v.s_max, TILE.heads, v.row0, v.quad, mb0, mb1)
        if lazy:
            t0 = cute.arch.fmax(t0, mx0)
            t1 = cute.arch.fmax(t1, mx1)
            put_rows(v.s_max, ROW_TRUE_MAX, v.row0, v.quad, t0, t1)
            put_moved(v, (mb0 != ma0) | (mb1 != ma1))
        cute.arch.barrier_arrive(barrier_id=PrefillBar.MAX_B, number_of_threads=PAIR_THREADS)
    sc0 = exp2(m0 - mb0)
    sc1 = exp2(m1 - mb1)
    scale_o(cfg, v, sc0, sc1, (mb0 != m0) | (mb1 != m1))
    l0 = l0 * sc0
    l1 = l1 * sc1
    if odd:
        s0, s1 = tile_exp(cfg, v, scale_log2, mb0, mb1)
        l0 = l0 + s0
        l1 = l1 + s1
        v.tOrP_as_c.store(v.acc_s.load().to(BFloat16))
        warpgroup.fence()
        cute.gemm(ops.pv_rs, v.acc_o, v.tOrP, v.tOrV_rs[None, None, None, 1], v.acc_o)
        warpgroup.commit_group()
        v.rP.store(v.acc_s.load().to(BFloat16))
        hand_p(v.rP, v, PrefillBar.P1_READY)
    cute.arch.barrier(barrier_id=PrefillBar.P0_READY, number_of_threads=PAIR_THREADS)
    cute.arch.mbarrier_wait(v.k_full + slot(0, LATE), ph0)
    warpgroup.fence()
    cute.gemm(ops.pv_ss, v.acc_o, v.tOrP_other[None, None, None, 0], v.tOrV_ss[None, None, None, 0], v.acc_o)
    warpgroup.commit_group()
    if odd:
        warpgroup.wait_group(1)
        cute.arch.mbarrier_arrive(v.k_free + slot(1, EARLY))   # V1[:, right] read
    warpgroup.wait_group(0)
    cute.arch.mbarrier_arrive(v.k_free + slot(0, LATE))       # V0[:, right] and P0 read
    if odd:
        cute.arch.mbarrier_arrive(v.k_free + slot(1, LATE))   # QK1 retired, P1 written
    return mb0, mb1, l0, l1, (t0 if lazy else mb0), (t1 if lazy else mb1)


@cute.jit
def item_sums(cfg: Sm90SparsePrefillConfig, smem: Smem, v: MmaWg, wg: cutlass.Constexpr, rq: Int32, l0: Float32,
              l1: Float32):
    """An item's row sums in MMA warp group ``wg``: summed over the quad, this group's put in
    ``row_sum`` (with the "ring" staging, the half of item ``rq``'s parity), ``L_SUM``, the other
    group's added. After it neither group reads Q or a P buffer again for this item."""
    l0 += cute.arch.shuffle_sync_bfly(l0, offset=1)
    l0 += cute.arch.shuffle_sync_bfly(l0, offset=2)
    l1 += cute.arch.shuffle_sync_bfly(l1, offset=1)
    l1 += cute.arch.shuffle_sync_bfly(l1, offset=2)
    base = smem.storage.row_sum.data_ptr()
    if cutlass.const_expr(cfg.tuning.staging == "ring"):
        base = base + (rq % 2) * (2 * TILE.heads)
    s_sum = cute.make_tensor(base, cute.make_layout(2 * TILE.heads))
    put_rows(s_sum, wg * TILE.heads, v.row0, v.quad, l0, l1)
    cute.arch.barrier(barrier_id=PrefillBar.L_SUM, number_of_threads=PAIR_THREADS)
    l0 = l0 + s_sum[(1 - wg) * TILE.heads + v.row0]
    l1 = l1 + s_sum[(1 - wg) * TILE.heads + v.row0 + 8]
    return l0, l1


@cute.jit
def item_out(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem, ops: Ops, v: MmaWg, w: Work,
             wg: cutlass.Constexpr, r: RowStats, nxt: Cta, has_next):
    """An item's output in MMA warp group ``wg`` once the sums are whole: the final factors (the
    sink folded in), this group's O half staged and stored by TMA as ``staging`` says (in its ring,
    :func:`store_ring`; in sQ with the next item ``nxt``'s Q chunks reloaded behind the stores,
    :func:`store_q_reload`); WG0 also writes lse and max_logits."""
    head0 = w.hblk * TILE.heads + v.row0
    o_scale0, lse0 = finalize_row(cfg, g.mSink, r.l0, r.m0, False, head0)
    o_scale1, lse1 = finalize_row(cfg, g.mSink, r.l1, r.m1, False, head0 + 8)
    scale_rows(v.acc_o, o_scale0, o_scale1)
    to = BlockStore(g.tma_out, g.mOut, ops.chunk_layout, qo_policy(cfg))
    bar_id = PrefillBar.EPI_WG1 if wg else PrefillBar.EPI_WG0
    if cutlass.const_expr(cfg.tuning.staging == "ring"):
        store_ring(cfg, smem, cta_of(w), v, to, wg, bar_id)
    else:
        store_q_reload(cfg, g, smem, ops, cta_of(w), v, to, wg, bar_id, nxt, has_next)
    if cutlass.const_expr(wg == 0):
        if v.quad == 0:
            g.mLse[w.s_idx, head0] = lse0
            g.mLse[w.s_idx, head0 + 8] = lse1
            g.mMax[w.s_idx, head0] = max_logit(r.l0, r.t0)
            g.mMax[w.s_idx, head0 + 8] = max_logit(r.l1, r.t1)


@cute.jit
def store_q_reload(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem, ops: Ops, cta: Cta, v: MmaWg, to: BlockStore,
                   wg: cutlass.Constexpr, bar_id: cutlass.Constexpr, nxt: Cta, has_next):
    """``staging`` "q_reload": this group's O half staged in its four chunks of sQ and stored chunk
    by chunk; then warp 0 waits for each store's read in order and loads the next item's Q chunk
    into the place it freed (completing on ``q_full``, whose bytes WG0 expected after the sums)."""
    n_chunks = cfg.pv_cols // TILE.chunk
    cl = chunk_lane(v.warp)
    for k in cutlass.range_constexpr(n_chunks):
        at = smem.sQ.iterator + (wg * n_chunks + k) * RING_CHUNK
        put_chunk(cfg, cta, to, v.acc_o, at, at.toint() + cl.row_off, cl, k, wg * n_chunks + k, 0, v.warp, bar_id)
    if v.warp == 0:
        for k in cutlass.range_constexpr(n_chunks):
            with cute.arch.elect_one():
                cute.arch.cp_async_bulk_wait_group(n_chunks - 1 - k, read=True)
            cute.arch.sync_warp()
            if has_next:
                load_q_chunk(cfg, g, smem, ops, nxt, wg * n_chunks + k)


@cute.jit
def load_q_chunk(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem, ops: Ops, cta: Cta, c: cutlass.Constexpr):
    """Q chunk ``c`` (64 heads x 64 dims) of the item ``cta`` into its place in sQ by one TMA box,
    completing on ``q_full`` (warp 0 of a group calls it; the bytes are expected by WG0)."""
    gQ = cute.flat_divide(g.mQ, (TILE.heads, TILE.chunk))
    at = cute.make_tensor(cute.recast_ptr(smem.sQ.iterator + c * RING_CHUNK, ops.chunk_layout.inner, BFloat16),
                          ops.chunk_layout.outer)
    t_s, t_g = cpasync.tma_partition(g.tma_q, 0, cute.make_layout(1), cute.group_modes(at, 0, 2),
                                     cute.group_modes(gQ, 0, 2))
    policy = qo_policy(cfg)
    q_full = smem.storage.q_full.data_ptr()
    if cutlass.const_expr(policy is None):
        cute.copy(g.tma_q, t_g[None, cta.hblk, c, cta.s_idx, 0], t_s, tma_bar_ptr=q_full)
    else:
        cute.copy(g.tma_q, t_g[None, cta.hblk, c, cta.s_idx, 0], t_s, tma_bar_ptr=q_full, cache_policy=policy)


@cute.jit
def expect_q(cfg: Sm90SparsePrefillConfig, smem: Smem):
    """WG0 warp 0: one arrival on ``q_full`` expecting a whole Q's bytes (its chunks' loads may be
    issued by either group, before or after it)."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(smem.storage.q_full.data_ptr(), TILE.heads * cfg.tile.d_qk * 2)


@cute.jit
def store_ring(cfg: Sm90SparsePrefillConfig, smem: Smem, cta: Cta, v: MmaWg, to: BlockStore, wg: cutlass.Constexpr,
               bar_id: cutlass.Constexpr):
    """``staging`` "ring": this group's O half (64 x 256, scaled) -> out by TMA in four 64-column
    chunks staged through a ring of two 8 KiB slots, its own P buffer (only this group writes it,
    and the other group's SS PV of it retired before ``L_SUM``) and its chunk of ``sO``. Chunk k
    >= 2 reuses the slot of chunk k - 2 once warp 0 saw that store read it (the group syncs on
    ``bar_id``). At the end warp 0 waits for the last reads and the group syncs again: the next
    item's P is written to the same slot by every warp."""
    n_chunks = cfg.pv_cols // TILE.chunk
    own_p = smem.storage.sP.data_ptr() + wg * TILE.p_elems
    own_o = smem.storage.sO.data_ptr() + wg * RING_CHUNK
    cl = chunk_lane(v.warp)
    for k in cutlass.range_constexpr(n_chunks):
        if cutlass.const_expr(k >= 2):
            if v.warp == 0:
                with cute.arch.elect_one():
                    cute.arch.cp_async_bulk_wait_group(1, read=True)
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=TILE.threads_per_wg)
        at = own_p if k % 2 == 0 else own_o
        put_chunk(cfg, cta, to, v.acc_o, at, at.toint() + cl.row_off, cl, k, wg * n_chunks + k, 0, v.warp, bar_id)
    if v.warp == 0:
        with cute.arch.elect_one():
            cute.arch.cp_async_bulk_wait_group(0, read=True)
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=TILE.threads_per_wg)


@cute.jit
def item_tiles(cfg: Sm90SparsePrefillConfig, ops: Ops, v: MmaWg, wg: cutlass.Constexpr, scale_log2: Float32,
               n_tiles: Int32, c0: Int32, c1: Int32):
    """MMA warp group ``wg``'s part of an item's tiles: its full pairs, then the last tile alone
    where the count is odd (straight-line code after the loop, module docstring). ``c0`` / ``c1``:
    buffer 0's / 1's phase counts, returned advanced with the item's running max and row sums."""
    pair = wg0_pair if cutlass.const_expr(wg == 0) else wg1_pair
    m0 = Float32(-1e30)
    m1 = Float32(-1e30)
    l0 = Float32(0.0)
    l1 = Float32(0.0)
    # the rows' true maxima: apart from the running max (P's base) with ``lazy_max``, else it
    t0 = -Float32.inf if cfg.tuning.lazy_max else m0
    t1 = -Float32.inf if cfg.tuning.lazy_max else m1
    for _ in cutlass.range(0, n_tiles // 2, unroll=1):
        m0, m1, l0, l1, t0, t1 = pair(cfg, ops, v, scale_log2, c0 & 1, c1 & 1, m0, m1, l0, l1, t0, t1, True)
        c0 += 1
        c1 += 1
    if n_tiles % 2 == 1:
        m0, m1, l0, l1, t0, t1 = pair(cfg, ops, v, scale_log2, c0 & 1, c1 & 1, m0, m1, l0, l1, t0, t1, False)
        c0 += 1
    return m0, m1, l0, l1, t0, t1, c0, c1


@cute.jit
def mma_wg0(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem, ops: Ops, scale_log2: Float32):
    """WG0, per item: Q by TMA, the item's full pairs, then its last tile alone where the count is
    odd, then the epilogue. The first item's Q is loaded up front, each next one right after the
    sums are exchanged (both groups' QKs of the item retired before ``L_SUM``): the whole Q
    ("ring"), or its expected bytes and the chunks no output is staged in ("q_reload"; the groups
    reload the others behind their stores)."""
    v = mma_wg(cfg, smem, ops, 0)
    q_full = smem.storage.q_full.data_ptr()
    tQsQ = tQgQ = None   # the whole-Q TMA's partition ("q_reload" loads by chunk, ``load_q_chunk``)
    if cutlass.const_expr(cfg.tuning.staging != "q_reload"):
        gQ = cute.flat_divide(g.mQ, (TILE.heads, cfg.tile.d_qk))
        tQsQ, tQgQ = cpasync.tma_partition(g.tma_q, 0, cute.make_layout(1),
                                           cute.group_modes(smem.sQ[None, None, 0], 0, 2), cute.group_modes(gQ, 0, 2))
    c0 = Int32(0)   # pairs consumed: buffer 0's phase
    c1 = Int32(0)   # odd tiles consumed: buffer 1's phase
    rq = Int32(0)   # items done
    begin, end, step = items(cfg, g)
    if begin < end:
        first = item_cta(cfg, begin)
        if cutlass.const_expr(cfg.tuning.staging == "q_reload"):
            if v.warp == 0:
                expect_q(cfg, smem)
                for c in cutlass.range_constexpr(cfg.tile.chunks):
                    load_q_chunk(cfg, g, smem, ops, first, c)
        else:
            load_q(cfg, g, first, q_full, tQgQ, tQsQ, v.warp, 0, qo_policy(cfg))
    for item in cutlass.range(begin, end, step, unroll=1):
        w = work_of(cfg, g, item)
        v.acc_o.fill(0.0)
        cute.arch.mbarrier_wait(q_full, rq & 1)
        m0, m1, l0, l1, t0, t1, c0, c1 = item_tiles(cfg, ops, v, 0, scale_log2, w.n_tiles, c0, c1)
        l0, l1 = item_sums(cfg, smem, v, 0, rq, l0, l1)
        has_next = item + step < end
        nxt = item_cta(cfg, item + step)
        if cutlass.const_expr(cfg.tuning.staging == "ring"):
            if has_next:
                load_q(cfg, g, nxt, q_full, tQgQ, tQsQ, v.warp, 0, qo_policy(cfg))
        if cutlass.const_expr(cfg.tuning.staging == "q_reload"):
            if has_next:
                if v.warp == 0:
                    expect_q(cfg, smem)
                    for c in cutlass.range_constexpr(2 * V_CHUNKS_PER_WG, cfg.tile.chunks):
                        load_q_chunk(cfg, g, smem, ops, nxt, c)
        item_out(cfg, g, smem, ops, v, w, 0, RowStats(m0, m1, l0, l1, t0, t1), nxt, has_next)
        rq += 1


@cute.jit
def mma_wg1(cfg: Sm90SparsePrefillConfig, g: Gmem, smem: Smem, ops: Ops, scale_log2: Float32):
    """WG1, per item: Q landed (``q_full``), the item's full pairs, its last tile's PV where the
    count is odd, the epilogue (with ``staging`` "q_reload", the next item's Q chunks of its
    staging reloaded behind its stores)."""
    v = mma_wg(cfg, smem, ops, 1)
    q_full = smem.storage.q_full.data_ptr()
    c0 = Int32(0)
    c1 = Int32(0)
    rq = Int32(0)
    begin, end, step = items(cfg, g)
    for item in cutlass.range(begin, end, step, unroll=1):
        w = work_of(cfg, g, item)
        v.acc_o.fill(0.0)
        # Q landed: this group's QKs read it, and its staging (which may alias Q) waits for it.
        cute.arch.mbarrier_wait(q_full, rq & 1)
        m0, m1, l0, l1, t0, t1, c0, c1 = item_tiles(cfg, ops, v, 1, scale_log2, w.n_tiles, c0, c1)
        l0, l1 = item_sums(cfg, smem, v, 1, rq, l0, l1)
        item_out(cfg, g, smem, ops, v, w, 1, RowStats(m0, m1, l0, l1, t0, t1), item_cta(cfg, item + step),
                 item + step < end)
        rq += 1


def qo_policy(cfg: Sm90SparsePrefillConfig):
    """The L2 cache policy of the Q loads and out stores (``Sm90PrefillTuning.qo_policy``), or None.
    A plain function, inlined at trace time."""
    return ptx.l2_policy(cfg.tuning.qo_policy) if cfg.tuning.qo_policy else None


def item_cta(cfg: Sm90SparsePrefillConfig, item: Int32) -> Cta:
    """The epilogue's view of item ``item`` (its token and head block) without reading its list."""
    return Cta(Int32(0), item // cfg.n_hblk, item % cfg.n_hblk, None, None, None)


def cta_of(w: Work) -> Cta:
    """The decode epilogue's view of this CTA (its token and head block; no schedule, no timeline)."""
    return Cta(Int32(0), w.s_idx, w.hblk, None, None, None)


@cute.jit
def max_logit(l_sum: Float32, m: Float32):
    """max_logits of a row in natural units (the running max is in log2 units of the scaled
    logits): -inf for a row with no valid position."""
    return Float32(cutlass.select_(l_sum == Float32(0.0), -Float32.inf, m * Float32(LN2)))
