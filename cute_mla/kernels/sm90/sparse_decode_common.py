"""Static configuration, roles, barrier ids and the partition walk of the SM90 sparse decode kernel.

Split out of ``sparse_decode.py`` so each module stays readable; ``sparse_decode`` re-exports
:class:`Sm90SparseDecodeConfig` (the dispatcher's import).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..combine import ACCUM_DTYPES
from . import ptx


@dataclass(frozen=True)
class Sm90SparseDecodeConfig:
    h_q: int  # 64 or 128 (128 = two 64-head CTAs side by side in grid x)
    split: bool  # True: takes o_accum / lse_accum (+ their TMA map); False: no accumulator at all
    has_topk_length: bool
    has_attn_sink: bool
    # split variant: store o_accum from the accumulator registers, no o_accum tensor map (the plan
    # picks it: SparseDecodePlan.oacc_from_registers); False: staged in sQ, stored by TMA
    oacc_from_registers: bool = False
    # h_q = 64 split: each piece on a cluster of 2 CTAs that share the gather and split the 512
    # output columns (the plan picks it: SparseDecodePlan.column_pair, ``sm90_column_pair``; the
    # kernel as ``Tuning.column_pair`` describes it); out is stored from registers, o_accum from
    # registers when fp32 and by TMA (64 x 128 boxes) when bf16.
    column_pair: bool = False
    # split variant: dtype of the o_accum partials, "float32" or "bfloat16" (the plan picks it:
    # SparseDecodePlan.accum_dtype, ``sm90_accum_dtype``). bf16 halves the bytes every split piece
    # stores and the combine reads back; its rounding (2^-9 relative) is that of the bf16 P the
    # PV MMA already reads.
    accum_dtype: str = "float32"
    d_qk: int = 576
    d_v: int = 512
    arch: str = "sm_90a"

    def __post_init__(self):
        if self.oacc_from_registers and not self.split:
            raise ValueError("oacc_from_registers: only the split variant stores o_accum (got split=False)")
        if self.column_pair and not (self.split and self.h_q == 64):
            raise ValueError(f"column_pair: only the h_q=64 split variant runs column pairs (got h_q={self.h_q}, "
                             f"split={self.split})")
        if self.h_q not in (64, 128):
            raise ValueError(f"h_q: got {self.h_q}, accepted: 64, 128")
        if self.accum_dtype not in ACCUM_DTYPES:
            raise ValueError(f"accum_dtype: got {self.accum_dtype!r}, accepted: {', '.join(map(repr, ACCUM_DTYPES))}")
        if self.accum_dtype != "float32" and not self.split:
            raise ValueError(f"accum_dtype: only the split variant has accumulators (got {self.accum_dtype!r} with split=False)")
        if (self.d_qk, self.d_v) != (576, 512):
            raise ValueError(f"(d_qk, d_v): got {(self.d_qk, self.d_v)}, accepted: (576, 512) (V3.2 cache)")
        if self.arch != "sm_90a":
            raise ValueError(f"arch: got {self.arch!r}, accepted: 'sm_90a'")


class Role(IntEnum):
    """Warp-group index -> role."""

    SOFTMAX = 0
    PV_RIGHT = 1
    PRODUCER = 2


@dataclass(frozen=True)
class RegisterBudget:
    """setmaxnreg targets. 384 threads enter with 168 each; the targets must sum to <= 504.

    216/160/128 was measured clean (no serialized wgmma, no spill) and fastest; 192/160/152
    serializes every wgmma, 240/160/112 hangs (sm90-building-blocks.md §3.4).
    """

    softmax: int = 216
    pv_right: int = 160
    producer: int = 128

    def __post_init__(self):
        assert self.softmax + self.pv_right + self.producer <= 504


class Bar(IntEnum):
    """Named-barrier ids (0 is __syncthreads)."""

    P_READY = 1  # WG0 -> WG1, 256 threads
    P_FREE = 2  # WG1 -> WG0, 256 threads
    Q_FREE = 3  # WG1 -> WG0, 256 threads
    EPI_SOFTMAX = 4  # WG0 only, 128 threads
    EPI_PV_RIGHT = 5  # WG1 only, 128 threads
    INDEX_SCAN = 6  # WG2 only, 128 threads: index compaction (warp counts, then ring visibility)
    XOVER_HALF = 7  # WG2 only, 128 threads: crossover half tile written (before its bulk copy)
    HELP = 8  # WG2 -> WG1, 256 threads: Tuning.help_second_tile's flag written (producer arrives, WG1 syncs)


class Stamp(IntEnum):
    """``Tuning.timeline`` (a debug probe, never on in the library): slots of a CTA's row of 64-bit
    ``clock64`` stamps, each written by thread 0 of the warp group named (the last write wins, so
    a one-tile piece gives one pass through the chain; ``benchmarks/timeline_probe.py``)."""

    ENTRY = 0  # thread 0: kernel entry
    PROLOGUE = 1  # thread 0: barriers initialised, sync_threads passed
    METADATA = 2  # each warp group: the partition row's words 0-3 consumed (begin_req tested)
    SCAN = 3  # producer: tile 0's indices in the ring (first scan_until returned)
    K_FREE = 4  # producer: the tile's buffer free (conversion starts, waiting for its rows)
    HANDED_OVER = 5  # producer: k_full arrive of the tile
    Q_READY = 6  # WG0: q_full wait returned
    K_READY = 7  # WG0: k_full wait returned (first QK issued next)
    QK_DONE = 8  # WG0: S in registers
    P_READY = 9  # WG0: P and the row factors in shared memory, P_READY arrived
    PV_DONE = 10  # WG0: its PV of the request's last tile complete (epilogue starts)
    EPILOGUE = 11  # WG0: out / o_accum store issued and its shared-memory reads done
    WG1_P = 12  # WG1: P_READY passed
    WG1_PV_DONE = 13  # WG1: its PV complete
    WG1_EPILOGUE = 14  # WG1: its store done
    EPI_FINAL = 15  # WG0: row factors exchanged with WG1 (the epilogue's barrier pair passed)
    EPI_STAGED = 16  # WG0: bf16 block staged in sQ, the warp group's barrier passed (TMA store next)
    WG1_EPI_STAGED = 17  # WG1: the same
    HALF_A = 18  # producer: half A of the tile converted and stored (half B next)
    SLOTS = 20


@dataclass(frozen=True)
class Tile:
    """Tile geometry (all compile-time)."""

    heads: int = 64  # BLOCK_M: heads per CTA
    tokens: int = 64  # TOPK_BLOCK: tokens per K tile
    d_qk: int = 576
    d_v: int = 512
    chunk: int = 64  # dims per 128-B swizzle row
    k_bufs: int = 2
    row_bytes: int = 656  # V3.2 cache row
    nope_bytes: int = 512
    scale_offset: int = 512
    rope_offset: int = 528
    threads_per_wg: int = 128
    num_wgs: int = 3
    # Index compaction (Tuning.compact_indices): the producer scans the top-k list in chunks of
    # ``scan_chunk`` positions (one per producer thread) and appends the valid token indices to a
    # shared-memory ring of ``ring_entries`` int32. In tile T's iteration a step starts while fewer
    # than ``tiles_ahead`` tiles counting T are queued (tail < 64 T + 192) and writes at most 128
    # entries, padded at a request end up to a tile boundary, so every write lands below 64 T + 320.
    # The entries of T itself were all read before that iteration's first scan barrier, so the
    # oldest entry still to be read is T+1's first, 64 T + 64: writes stay within 256 entries of it
    # (power of two: the ring position is a mask).
    scan_chunk: int = 128
    ring_entries: int = 256
    tiles_ahead: int = 3  # tiles T, T+1 (rows loaded during T) and T+2 (L2 prefetch) must be queued
    info_words: int = 4  # per K buffer: valid mask (2 words), last-tile-of-request flag, pad
    mbar_bytes: int = 8  # one mbarrier: consecutive mbarriers of an array are this far apart
    rows_per_warp: int = 8  # producer thread map: a warp's 32 lanes cover 8 tokens x 4 16-B slices

    @property
    def chunk_row_bytes(self) -> int:  # one token's row inside a 64-dim column block (SW128 row)
        return self.chunk * 2  # 128

    @property
    def k_tile_bytes(self) -> int:
        return self.tokens * self.d_qk * 2  # 73,728

    @property
    def k_tile_elems(self) -> int:
        return self.tokens * self.d_qk

    @property
    def chunk_bytes(self) -> int:  # one 64-dim column block of the K tile
        return self.tokens * self.chunk * 2  # 8,192

    @property
    def half_v(self) -> int:
        return self.d_v // 2  # 256 columns of O per MMA warp group

    @property
    def stage_bytes(self) -> int:  # output staging per MMA warp group (aliases sQ)
        return 32 * 1024


class Streaming(IntEnum):
    """When the producer issues the row loads of the next tile (registers: one 44-word set per half).

    OFF: half-tile pipeline: B(n) at the top of tile n, A(n+1) once A(n) is converted.
    FIRST_HALF: each 16-B load of A(n+1) goes into the registers that A(n)'s conversion has just
    consumed (chunk by chunk); B(n) as in OFF.
    BOTH: the same for B(n+1) during B(n)'s conversion, so both halves of tile n+1 are in flight
    while tile n is converted.

    Measured on the H200 (benchmarks/NOTES.md): over one-tile-per-64-positions tiles FIRST_HALF
    was 1-3 % and BOTH 3-4.5 % *slower* than OFF; over compacted tiles (``compact_indices``) BOTH
    is 2.5-2.7 % *faster* than OFF, and it is the default.
    """

    OFF = 0
    FIRST_HALF = 1
    BOTH = 2


class Crossover(IntEnum):
    """h_q = 128: how the cluster of two head-half CTAs shares each K tile (sparse_decode_crossover.py).

    Each CTA gathers and dequantizes its 32 rows of every tile into its own K buffer; the rows
    reach the peer CTA's buffer by bulk shared -> distributed-shared copies (TMA unit), counted on
    the peer's ``k_full`` transaction bytes. h_q = 64 ignores it.

    OFF: no cluster; each CTA gathers all 64 rows (the second CTA's reads hit L2).
    HALF_COPY: after the whole half is written, a producer barrier, then one thread copies its 9
    column blocks (4 KB each). Measured 8 % slower than OFF: the copy's latency lands on every tile.
    WARP_COPIES: each warp copies its 8 rows (1 KB) of a column block right after writing them
    (36 copies per tile); the default. Against OFF (fccc5e1, one run): +0.5..1.7 % on the h=128
    throughput rows, +2.9 % on 1x1x128, -2.3 % on 1x8x128.
    WARP_COPIES_TWO_TILES: WARP_COPIES with this CTA's rows of two tiles in flight (two register
    sets); ptxas spills, measured slower than WARP_COPIES.
    (Per-thread st.async of every 16-B piece measured 21 % slower and was removed: st.async
    writes in the generic proxy, so wgmma readers would also need a proxy fence.)
    """

    OFF = 0
    HALF_COPY = 1
    WARP_COPIES = 2
    WARP_COPIES_TWO_TILES = 3


@dataclass(frozen=True)
class Tuning:
    """Schedule knobs that do not change results (part of the compile key)."""

    # WG0 issues tile n+1's QK right behind tile n's PV (waits for PV with wait_group(1)).
    overlap_qk_pv: bool = True
    # Producer: when the loads of tile n+1 are issued (see Streaming). BOTH over compacted tiles
    # measured +2.5 to +2.7 % over OFF on the H200 rows (NOTES.md, 2026-12-02 b).
    streaming: Streaming = Streaming.BOTH
    # Producer: bulk-prefetch the rows of tile n+2 into L2 once tile n is handed over (one
    # cp.async.bulk.prefetch.L2 of 656 B per row), so the loads issued a tile later hit L2.
    # Measured +4 to +6.5 % on the H200 benchmark rows (NOTES.md).
    prefetch_rows: bool = True
    # How: True = 3 per-thread ``prefetch.global.L2`` lines per thread, two threads per row (the
    # 6 128-B lines a 656-B row can touch); False = one cp.async.bulk.prefetch.L2 of 656 B per row,
    # whose operands are uniform registers, so ptxas loops over the warp's 16 distinct rows one at
    # a time (ncu: that loop was ~13 % of the producer's time). Lines measured +1.1..1.5 % on the
    # throughput rows (NOTES.md, session 2026-12-03). The h=128 crossover producer always prefetches
    # per line (its half rows) and takes no l2_hints there: both knobs apply to Crossover.OFF only.
    prefetch_lines: bool = True
    # Gather load hints: L1 eviction priority and L2 prefetch size (cute.arch.load literals, "" = none).
    # L1::no_allocate measured 35 % slower than evict_last.
    gather_l1: str = "evict_last"
    gather_l2: str = "size_256b"
    # Producer: build tiles from the *valid* indices only (masked -1 / out-of-range entries and
    # positions past topk_length are dropped while scanning the top-k list), so a request with
    # v valid tokens in this partition's blocks costs max(1, ceil(v/64)) tiles instead of its
    # blocks. Consumers learn each request's last tile from a flag the producer writes beside the
    # tile's mask. Streaming OFF or BOTH.
    compact_indices: bool = True
    # Index scan: keep the raw indices of the next two chunks of the request in flight instead of
    # one, so back-to-back steps (a partition's start) do not wait an index round trip each. Alone
    # within noise; with prefetch_lines +0.3..0.5 % more, and the producer then spills nothing.
    scan_two_ahead: bool = True
    # Where the generic -> async proxy fence of a K tile runs. False: each producer thread before
    # its k_full arrive (its SASS, MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S, may wait for that thread's
    # global loads still in flight: the next tile's rows). True: each consumer thread after its
    # k_full wait, before its wgmma reads the tile. The PTX memory model accepts the proxy fence
    # anywhere on the causality path from the st.shared to the async-proxy read (release arrive
    # -> acquire wait -> fence -> wgmma). (The uni-directional shared-only release fence compiles
    # to the same MEMBAR + FENCE.VIEW pair on sm_90a, so it is no alternative.)
    consumer_proxy_fence: bool = False
    # L2 eviction policies: Q loads and bf16 out stores (read / written once) evict_first, the KV
    # rows (gather loads + their bulk L2 prefetch) evict_last, so streaming q/out traffic does not
    # push the cache pool out of L2 (o_accum keeps the default: the combine reads it next).
    l2_hints: bool = False
    # Split pieces: write o_accum with per-thread stores from the accumulator registers instead of
    # staging 2 x 32 KiB per warp group in shared memory for a TMA store (no o_accum tensor map).
    # Measured bit-identical; 1-3 % faster where h=64 pieces are one block long, ~5 % slower on
    # 1x8x64 and the h=128 rows with ~128 CTAs storing at once (NOTES.md, session 2026-12-03 c).
    # None (default): the config decides (``oacc_from_registers``, picked by the plan per shape);
    # True / False force it (experiments).
    oacc_direct_store: Optional[bool] = None
    # A CTA that walks several requests (b > 1, or the plan's token walk): when it loads a
    # request's Q it also prefetches the next request's Q box into L2 (one TMA prefetch), so the
    # Q load between two requests, which the epilogue's staging in sQ serializes, hits L2.
    # Measured no gain (x0.990-1.000 against off on 1x1024x64, 1x8192x128, 128x2x128, 64x2x64,
    # 1x32768x64; session 2026-12-03 c): off.
    prefetch_next_q: bool = False
    # Whole requests: write the bf16 out half of each MMA warp group with per-thread stores from
    # registers instead of staging it in sQ for a TMA store (the staging, its barrier and the wait
    # for the store's read sit between one request's last PV and the next request's Q load, which
    # the token walk pays once per token). Off until measured.
    out_direct_store: bool = False
    # Partition metadata read where the latency chain of a one-tile piece does not wait for it:
    # the tile_md row's first four words in one 16-B load at the kernel's start (instead of two
    # dependent 8-B loads, the second behind the empty-partition branch), and a split piece's
    # o_accum row (num_splits[req] + begin_split_idx, and the split flags) loaded by the MMA warp
    # groups before their first tile instead of in their epilogue, where two dependent L2 round
    # trips sat between the last PV and the o_accum store. False: the loads where they are used.
    early_metadata: bool = True
    # Debug probe only (the dispatcher never passes the buffer it needs): each CTA writes clock64
    # stamps of its phases (Stamp) into a (grid x, grid y, Stamp.SLOTS) int64 tensor given as the
    # kernel's ``timeline`` argument.
    timeline: bool = False
    # h_q = 64 split kernels: a "column pair". Each piece runs on a cluster of 2 CTAs that share
    # the gather as the h=128 crossover does (each dequantizes half of every tile for both, the
    # Crossover transport) and split the 512 output columns: both run QK and the softmax for the
    # same 64 heads, each runs PV and the epilogue for its 256 columns (one 64x128 N-tile per MMA
    # warp group). Halves the per-SM conversion, PV and store bytes of the latency rows' one-tile
    # pieces (NOTES.md, session 2026-12-03 e, the timeline). out is stored from registers (it
    # overrides out_direct_store = False: its 64 x 128 blocks have no tensor map); fp32 partials
    # from registers too, bf16 ones staged and stored by TMA in 64 x 128 boxes.
    # True forces it on every h_q = 64 split kernel (experiments); the plan picks it per shape
    # through the config's ``column_pair`` (``sm90_column_pair``: few busy pieces, where the grid's
    # doubled CTAs still fit; NOTES.md, session 2026-12-03 f).
    column_pair: bool = False
    # h_q = 128: the token's two head-half CTAs run as a cluster of 2 and each gathers and
    # dequantizes half of every K tile for both (sparse_decode_crossover.py, Crossover; also the
    # transport of ``column_pair``'s two column-half CTAs). Needs the
    # streamed compacted producer: a Tuning that turns compaction or streaming off sets it OFF.
    crossover: Crossover = Crossover.WARP_COPIES
    # Cluster kernels (crossover, column pair): the start-up cluster barrier (the peer's mbarrier
    # inits visible before any remote arrive or copy) arrives with barrier.cluster.arrive.relaxed;
    # fence.mbarrier_init already releases the inits. False: the default arrive, whose release
    # semantics compile to a MEMBAR.ALL.GPU (the timeline's prologue: ~680 cycles more than a
    # kernel without a cluster).
    relaxed_cluster_start: bool = True
    # A partition that holds exactly two compacted tiles of one request (1x8x64's pieces: 128
    # positions, ~102 valid): WG1, idle until tile 0's P is ready and with its accumulators not
    # yet live, gathers and converts tile 1 into K buffer 1 while the producer does tile 0, so
    # both tiles are ready together (the timeline has tile 1 ~4,000 cycles behind tile 0). The
    # producer learns the count from its first scan (the ring holds 128 entries and the scan is
    # over) and tells WG1 through ``help_flag`` and Bar.HELP. One-CTA kernels with the compacted
    # producer only: ignored in cluster kernels (crossover, column pair). Measured on the H200
    # (NOTES.md, session 2026-12-03 h): 1x8x64 x0.962, 2x4x64 x0.983. Tile 0
    # comes later (8,393 against 7,182 cycles) and tile 1 no earlier: the two warp groups' loads
    # and conversions compete rather than overlap. Off.
    help_second_tile: bool = False
    # Programmatic dependent launch of the decode kernel itself: it is launched with the PDL
    # attribute and every thread runs griddepcontrol.wait right after the barrier inits, before
    # its first global read or write (the partition metadata included), so its launch and
    # prologue overlap the tail of the kernel before it in the stream (in an engine's decode
    # graph: the previous layer's kernels; in a graph of calls: the previous call's combine).
    pdl_wait: bool = False
    # bf16 blocks (out, and o_accum where the plan stores bf16 partials) staged with stmatrix (16 x
    # 4 matrices per thread instead of 64 4-byte st.shared) and stored by TMA in 64-column chunks:
    # chunk k's store is issued as soon as it is staged, so the stores overlap the staging of the
    # chunks after it. The timeline (NOTES.md, session 2026-12-03 h) has 1x8x64's epilogue at
    # ~1,850 cycles of staging, then ~2,700 of store. Measured +3.6 to +5.5 % per call on the
    # latency rows (1x1x64 .. 2x1x64), neutral on the throughput rows: on.
    chunked_epilogue: bool = True
    # WG0 stores lse / lse_accum before the O block (the order before session 2026-12-03 h) instead
    # of after it: the block's staging ends in a generic -> async proxy fence (MEMBAR.ALL.CTA +
    # FENCE.VIEW.ASYNC.S), which may wait for the lse stores still in flight. Measured x0.981-0.997
    # per call on the latency rows (NOTES.md, session 2026-12-03 i): off.
    store_lse_first: bool = False

    def __post_init__(self):
        if self.compact_indices and self.streaming == Streaming.FIRST_HALF:
            raise ValueError(f"Tuning: compact_indices takes streaming OFF or BOTH, got {self.streaming!r}")
        if not isinstance(self.crossover, Crossover):
            raise ValueError(f"Tuning: crossover takes a Crossover, got {self.crossover!r}")
        if self.crossover != Crossover.OFF and not (self.compact_indices and self.streaming == Streaming.BOTH):
            raise ValueError("Tuning: crossover runs the streamed compacted producer: it needs compact_indices=True "
                             f"and streaming=Streaming.BOTH, got {self.compact_indices}, {self.streaming!r}")
        if self.help_second_tile and not self.compact_indices:
            raise ValueError("Tuning: help_second_tile needs compact_indices=True (it reads the compacted ring)")
        if self.column_pair and self.crossover == Crossover.OFF:
            raise ValueError("Tuning: column_pair shares the gather through the crossover transport: it needs "
                             f"crossover != Crossover.OFF, got {self.crossover!r}")


TILE = Tile()
DEFAULT_TUNING = Tuning()
REGS = RegisterBudget()



class ScheduleMixin:
    """Walk of one ``tile_md`` partition, identical in the three warp groups.

    Partition row: [begin_req, end_req (incl), begin_block (of begin_req), end_block (excl, of
    end_req), begin_split_idx, is_first_req_splitted, is_last_req_splitted, pad]. A request has
    topk/64 blocks, or max(ceil(min(topk_length, topk)/64), 1) with ``topk_length``.
    """

    @cute.jit
    def request_blocks(self, req: Int32, mTopkLen: Optional[cute.Tensor], topk: Int32):
        """(number of 64-token blocks, effective top-k length) of request ``req``."""
        n_blocks = topk // TILE.tokens
        length = topk
        if cutlass.const_expr(self.cfg.has_topk_length):
            length = cutlass.min(mTopkLen[req], topk)
            n_blocks = cutlass.max((length + (TILE.tokens - 1)) // TILE.tokens, 1)
        return n_blocks, length

    @cute.jit
    def request_range(self, req: Int32, sched, mTopkLen: Optional[cute.Tensor], topk: Int32):
        """[start, stop) blocks of ``req`` in this partition and its effective top-k length."""
        begin_req, end_req, begin_block, end_block = sched
        n_blocks, length = self.request_blocks(req, mTopkLen, topk)
        start = Int32(0)
        stop = n_blocks
        if req == begin_req:
            start = begin_block
        if req == end_req:
            stop = end_block
        return start, stop, length

    @cute.jit
    def request_is_split(self, req: Int32, begin_req: Int32, end_req: Int32, mTileMd: cute.Tensor, part: Int32):
        """A request is a split piece in this partition iff it is the first request and
        is_first_req_splitted, or the last one and is_last_req_splitted. The no-split variant only
        runs on schedules without split pieces."""
        split = cutlass.Boolean(False)
        if cutlass.const_expr(self.cfg.split):
            split = ((req == begin_req) & (mTileMd[part, 5] != 0)) | ((req == end_req) & (mTileMd[part, 6] != 0))
        return split

    @cute.jit
    def split_row(self, req: Int32, begin_req: Int32, mTileMd: cute.Tensor, mNumSplits: cute.Tensor, part: Int32):
        row = mNumSplits[req]
        if req == begin_req:
            row = row + mTileMd[part, 4]
        return row

    @cute.jit
    def split_rows_of_partition(self, sched, mTileMd: cute.Tensor, mNumSplits: cute.Tensor, part: Int32):
        """``Tuning.early_metadata``: (first, last) = the o_accum rows of the partition's first and
        last request where that request is a split piece here, -1 where it is not (always -1 in
        the no-split variant). Only those two requests can be split pieces; the loads are issued
        once, before the first tile, and consumed in the epilogues (:meth:`split_piece`)."""
        first = Int32(-1)
        last = Int32(-1)
        if cutlass.const_expr(self.cfg.split):
            begin_req, end_req, _, _ = sched
            ns_first = mNumSplits[begin_req]
            ns_last = mNumSplits[end_req]
            offset = mTileMd[part, 4]
            first_split = mTileMd[part, 5] != 0
            last_split = mTileMd[part, 6] != 0
            # As split_row: the begin_split_idx offset applies whenever req == begin_req.
            row_last = ns_last + ptx.select_i32(end_req == begin_req, offset, 0)
            first = ptx.select_i32(first_split, ns_first + offset, -1)
            last = ptx.select_i32(last_split, row_last, -1)
        return first, last

    @cute.jit
    def split_piece(self, req: Int32, begin_req: Int32, end_req: Int32, rows, mTileMd: cute.Tensor,
                    mNumSplits: cute.Tensor, part: Int32):
        """(is a split piece, its o_accum row) of request ``req`` in this partition (row undefined
        when not split): from ``rows`` of :meth:`split_rows_of_partition` with
        ``Tuning.early_metadata``, else loaded here (:meth:`request_is_split`, :meth:`split_row`)."""
        is_split = cutlass.Boolean(False)
        row = Int32(0)
        if cutlass.const_expr(self.cfg.split):
            if cutlass.const_expr(self.tuning.early_metadata):
                first, last = rows
                as_first = (req == begin_req) & (first >= 0)
                is_split = as_first | ((req == end_req) & (last >= 0))
                row = ptx.select_i32(as_first, first, last)
            else:
                is_split = self.request_is_split(req, begin_req, end_req, mTileMd, part)
                if is_split:
                    row = self.split_row(req, begin_req, mTileMd, mNumSplits, part)
        return is_split, row

