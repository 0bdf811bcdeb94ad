"""What one CTA holds and walks: the bundles every role reads (global tensors, this CTA's work,
shared memory), the shared-memory struct, and the walk of one ``tile_md`` partition, identical in
the warp groups.

Partition row (``SchedField``): [begin_req, end_req (incl), begin_block (of begin_req), end_block
(excl, of end_req), begin_split_idx, is_first_req_splitted, is_last_req_splitted, pad]. A request
has topk / 64 blocks, or ``blocks_of_length(topk_length[req], topk)`` with ``topk_length`` (the
scheduler's rule, shared with the host and the device schedule); with the extra pool they are
followed by its extra_topk / 64 blocks (``extra_blocks_of_length`` with ``extra_topk_length``).
"""

# No "from __future__ import annotations": cute.struct reads its field annotations as objects.
import functools
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32

from ...dsl import ptx
from ...scheduler.partition import BLOCK_TOPK, SchedField, blocks_of_length, extra_blocks_of_length
from .config import NS_SLOTS, TILE, Sm90SparseDecodeConfig, Tile
from .swapped import WARPS, XCHG_BUFS

assert TILE.tokens == BLOCK_TOPK, "a K tile covers one scheduler block of positions"


class Gmem(NamedTuple):
    """The kernel's global tensors and the TMA atoms that read or write them."""

    tma_q: cute.CopyAtom
    mQ: cute.Tensor                      # Q as (h, d, s_q, b): TMA boxes of a CTA's heads (64, or 8-32) x d_qk dims
    tma_out: Optional[cute.CopyAtom]     # None where out is stored from registers
    mOut: cute.Tensor                    # out as (h, d, s_q, b) for TMA, or as given
    tma_oacc: Optional[cute.CopyAtom]    # split variant only
    mOAcc: Optional[cute.Tensor]
    mKV: cute.Tensor                     # (num_blocks, page_block_size, row bytes) uint8
    mIdx: cute.Tensor                    # (b, s_q, topk) int32
    mTopkLen: Optional[cute.Tensor]
    mSink: Optional[cute.Tensor]
    mTileMd: cute.Tensor
    mAccumOffsets: cute.Tensor           # (b+1,): request r's split pieces own rows [off[r], off[r+1])
    mLse: cute.Tensor
    mLseAcc: Optional[cute.Tensor]
    mExtraKV: Optional[cute.Tensor]      # the extra pool (V4): its cache,
    mExtraIdx: Optional[cute.Tensor]     # its (b, s_q, extra_topk) indices
    mExtraLen: Optional[cute.Tensor]     # and their (b,) lengths
    mOrder: Optional[cute.Tensor]        # (b,): the request at each walk position (cfg.request_order)


class Cta(NamedTuple):
    """Where this CTA works: its partition, query token and 64-head block, and the partition's
    request / block range ``sched`` = (begin_req, end_req, begin_block, end_block)."""

    part: Int32
    s_idx: Int32
    hblk: Int32       # 0 in the column pair (one 64-head block per piece)
    sched: tuple
    topk: Int32
    stamps: Optional[Int64]   # this CTA's timeline row (Sm90Tuning.timeline), else None


class Smem(NamedTuple):
    """The shared-memory struct and the tensors the MMAs read (swizzled views of its buffers)."""

    storage: object
    sQ: cute.Tensor     # Q (64 or h heads x d_qk), also the output staging between requests
    sK: cute.Tensor     # the K tiles (k_bufs x 64 tokens x d_qk), V is their transposed view
    sP: cute.Tensor     # P (64 heads x 64 tokens) handed from WG0 to WG1


# The producer's geometry table, per pool (``producer.write_pool``): base (2 words), stride(0) in
# bytes, page_block_size, its divisor magic and shift (``dsl.ptx.divisor_magic``), 2 words unused.
POOL_ENTRY_WORDS = 8


@functools.lru_cache(maxsize=None)
def shared_storage(tile: Tile = TILE, pools: int = 1):
    """The CTA's shared memory, one struct (its size is what the launch requests): 231,424 B of
    232,448 with the V3.2 tile's Q buffer, two K tiles and P (V4's 512-dim tiles: 206,848 B). The
    output staging (2 x 32 KiB) aliases the Q buffer, which is free between a request's last QK
    and the next request's Q load. ``pools``: 2 with the extra pool, whose kernels keep both
    pools' geometry in a small table (the producer's ``row_address``)."""
    assert 2 * tile.stage_bytes <= 2 * tile.q_elems, "the output staging must fit in the Q buffer"

    @cute.struct
    class SharedStorage:
        q_full: cute.struct.MemRange[Int64, 1]
        k_full: cute.struct.MemRange[Int64, TILE.k_bufs]
        k_free: cute.struct.MemRange[Int64, TILE.k_bufs]
        peer_free: cute.struct.MemRange[Int64, TILE.k_bufs]  # cluster kernels: the peer may write buffer b
        # Per K buffer: 64-bit token mask + last-tile-of-request flag (producer -> consumers).
        tile_info: cute.struct.Align[cute.struct.MemRange[Uint32, TILE.info_words * TILE.k_bufs], 16]
        scan_counts: cute.struct.Align[cute.struct.MemRange[Int32, TILE.scan_count_words], 16]
        row_scale: cute.struct.MemRange[Float32, TILE.heads]  # WG0 -> WG1 per-row O factor
        if pools > 1:
            pool_table: cute.struct.Align[cute.struct.MemRange[Int32, POOL_ENTRY_WORDS * pools], 16]
        ring: cute.struct.Align[cute.struct.MemRange[Int32, TILE.ring_entries], 16]  # compacted indices
        sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, tile.q_elems], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[BFloat16, tile.k_bufs * tile.k_tile_elems], 1024]
        sP: cute.struct.Align[cute.struct.MemRange[BFloat16, TILE.p_elems], 1024]

    return SharedStorage


@functools.lru_cache(maxsize=None)
def swapped_storage(tile: Tile, pools: int, h: int, producers: int = 1):
    """The CTA's shared memory with the swap-AB tile's h heads (``swapped.py``): the producer's
    fields as in :func:`shared_storage` (same names: the producer and the prologue read them; with
    two producer warp groups the scan's counts and ring and the pool table once for each), Q
    (h x d_qk, also the output staging: h x 512 bf16 fits), P^T (h x 64), the heads' O factors
    (WG0 -> WG1) and the cross-warp exchange buffers."""
    assert TILE.d_v <= tile.d_qk, "the output staging (h x d_v) must fit in the Q buffer (h x d_qk)"

    @cute.struct
    class SwappedStorage:
        q_full: cute.struct.MemRange[Int64, 1]
        k_full: cute.struct.MemRange[Int64, TILE.k_bufs]
        k_free: cute.struct.MemRange[Int64, TILE.k_bufs]
        peer_free: cute.struct.MemRange[Int64, TILE.k_bufs]   # (cluster kernels only; never initialised here)
        tile_info: cute.struct.Align[cute.struct.MemRange[Uint32, TILE.info_words * TILE.k_bufs], 16]
        scan_counts: cute.struct.Align[cute.struct.MemRange[Int32, TILE.scan_count_words * producers], 16]
        if pools > 1:
            pool_table: cute.struct.Align[cute.struct.MemRange[Int32, POOL_ENTRY_WORDS * pools * producers], 16]
        ring: cute.struct.Align[cute.struct.MemRange[Int32, TILE.ring_entries * producers], 16]
        sK: cute.struct.Align[cute.struct.MemRange[BFloat16, tile.k_bufs * tile.k_tile_elems], 1024]
        sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, h * tile.d_qk], 1024]
        sP: cute.struct.Align[cute.struct.MemRange[BFloat16, h * TILE.tokens], 1024]
        head_scale: cute.struct.Align[cute.struct.MemRange[Float32, h], 16]   # WG0 -> WG1 per-head O factor
        exchange: cute.struct.Align[cute.struct.MemRange[Float32, XCHG_BUFS * WARPS * h], 16]

    return SwappedStorage


def dyn_storage(cfg: Sm90SparseDecodeConfig):
    """The shared-storage struct rebuilt from the dynamic-smem symbol (the allocator put it at
    offset 0, 1024-aligned). The allocator's own base pointer is a warp shuffle, which ptxas can
    neither rematerialize nor keep in the producer's 128 registers, so it spilled it; the symbol
    address is a constant it can re-create anywhere."""
    return storage_of(cfg)(cute.arch.get_dyn_smem(Uint8, alignment=1024))


def pools(cfg: Sm90SparseDecodeConfig) -> int:
    """KV pools the kernel reads: the main one, and the extra one (V4)."""
    return 2 if cfg.has_extra else 1


def storage_of(cfg: Sm90SparseDecodeConfig):
    """The shared-storage struct of a config's kernel."""
    if cfg.swapped:
        return swapped_storage(cfg.tile, pools(cfg), cfg.h_q, cfg.tuning.registers.producers)
    return shared_storage(cfg.tile, pools(cfg))


@cute.jit
def stamp(cta: Cta, slot: cutlass.Constexpr, leader):
    """``Sm90Tuning.timeline``: ``leader`` writes clock64 (``%globaltimer`` for the ``NS_SLOTS``)
    into this CTA's slot ``slot`` (nothing otherwise)."""
    if cutlass.const_expr(cta.stamps is not None):
        if leader:
            p = cute.make_ptr(Int64, cta.stamps + int(slot) * 8, cute.AddressSpace.gmem, assumed_align=8)
            if cutlass.const_expr(slot in NS_SLOTS):
                cute.arch.store(p, cute.arch.globaltimer())
            else:
                cute.arch.store(p, cute.arch.clock64())


@cute.jit
def request_id(cfg: Sm90SparseDecodeConfig, g: Gmem, req: Int32):
    """The request (batch row of q, the lists, out and lse) at walk position ``req``: the
    partition rows and the roles' loops count positions, which name requests through the
    schedule's order where it has one (``cfg.request_order``), else are the requests."""
    rid = req
    if cutlass.const_expr(cfg.request_order):
        rid = g.mOrder[req]
    return rid


@cute.jit
def request_blocks(cfg: Sm90SparseDecodeConfig, g: Gmem, req: Int32, topk: Int32):
    """(64-token blocks, blocks of the main list, effective main length, effective extra length)
    of the request at position ``req``: the main list's blocks come first, then the extra list's (none without
    the extra pool)."""
    n_main = topk // BLOCK_TOPK
    length = topk
    if cutlass.const_expr(cfg.has_topk_length):
        raw = g.mTopkLen[request_id(cfg, g, req)]
        length, n_main = blocks_of_length(raw, topk, cutlass.min, cutlass.max)
    n_blocks = n_main
    extra_length = Int32(0)
    if cutlass.const_expr(cfg.has_extra):
        extra_topk = g.mExtraIdx.shape[2]
        extra_length = extra_topk
        n_extra = extra_topk // BLOCK_TOPK
        if cutlass.const_expr(cfg.has_extra_topk_length):
            raw_extra = g.mExtraLen[request_id(cfg, g, req)]
            extra_length, n_extra = extra_blocks_of_length(raw_extra, extra_topk, cutlass.min, cutlass.max)
        n_blocks = n_main + n_extra
    return n_blocks, n_main, length, extra_length


@cute.jit
def request_range(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, req: Int32):
    """[start, stop) blocks of ``req`` in this partition, its main list's blocks and the two
    lists' effective lengths (:func:`request_blocks`)."""
    begin_req, end_req, begin_block, end_block = cta.sched
    n_blocks, n_main, length, extra_length = request_blocks(cfg, g, req, cta.topk)
    start = Int32(0)
    stop = n_blocks
    if req == begin_req:
        start = begin_block
    if req == end_req:
        stop = end_block
    return start, stop, n_main, length, extra_length


@cute.jit
def split_rows_of_partition(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta):
    """(first, last) = the o_accum rows of the partition's first and last request where that
    request is a split piece here, -1 where it is not (always -1 in the no-split variant). Only
    those two requests can be split pieces; the loads are issued once, before the first tile, and
    consumed in the epilogues (:func:`split_piece`): in the epilogue they would put two dependent
    L2 round trips between the last PV and the o_accum store."""
    first = Int32(-1)
    last = Int32(-1)
    if cutlass.const_expr(cfg.split):
        begin_req, end_req, _, _ = cta.sched
        ns_first = g.mAccumOffsets[begin_req]
        ns_last = g.mAccumOffsets[end_req]
        offset = g.mTileMd[cta.part, SchedField.BEGIN_SPLIT]
        first_split = g.mTileMd[cta.part, SchedField.FIRST_REQ_SPLIT] != 0
        last_split = g.mTileMd[cta.part, SchedField.LAST_REQ_SPLIT] != 0
        # The begin_split_idx offset applies whenever req == begin_req.
        row_last = ns_last + ptx.select_i32(end_req == begin_req, offset, 0)
        first = ptx.select_i32(first_split, ns_first + offset, -1)
        last = ptx.select_i32(last_split, row_last, -1)
    return first, last


@cute.jit
def split_piece(cfg: Sm90SparseDecodeConfig, cta: Cta, req: Int32, rows):
    """(is a split piece, its o_accum row) of request ``req`` in this partition (row undefined when
    not split), from ``rows`` of :func:`split_rows_of_partition`."""
    is_split = cutlass.Boolean(False)
    row = Int32(0)
    if cutlass.const_expr(cfg.split):
        begin_req, end_req, _, _ = cta.sched
        first, last = rows
        as_first = (req == begin_req) & (first >= 0)
        is_split = as_first | ((req == end_req) & (last >= 0))
        row = ptx.select_i32(as_first, first, last)
    return is_split, row
