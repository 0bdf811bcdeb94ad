"""The producer warp group (WG2) of the SM90 sparse decode kernel: gather + FP8 dequant into K tiles.

Thread map (FlashMLA's): warp w, lane l handles token ``half*32 + w*8 + l%8`` of a tile and the
16-dim slice ``l//8`` of every 64-dim chunk: 16 B of fp8 per NoPE chunk, the row's scales and
2 x 16 B of RoPE (V3.2: 8 + 16 B + 2, 44 registers; V4: 7 + the 8-B scale row + 2, 38 registers)
per row and half tile. Tiles hold the valid tokens only
(``index_scan.py``). The loads are streamed: each 16-B register slot of tile T is re-loaded with
tile T+1's row as soon as its value is converted (:func:`convert_store_reload`), so both halves of
tile T+1 are in flight while tile T is converted, and tile T+2's rows are prefetched into L2 once
tile T is handed over. Two K buffers; the consumers free one with ``k_free``.

Keys are bit-identical to bf16(float(fp8) * scale) (the format's dequant routine). The tile is
written K-major in SW128 atoms: the byte offset of 16-B chunk j of 64-dim column block c of token t
is ``c*8192 + t*128 + ((j ^ (t & 7)) << 4)`` (= make_smem_layout_b(ROW_MAJOR, (64, 64, d_qk))):
the NoPE chunks, then the RoPE chunk.

Where a row is (the format's spec): its data at ``block + row * data_row_bytes``, its scales in
the data row (V3.2) or in the block's scale rows (V4: ``block + page * data_row_bytes + row * 8``);
:func:`row_address` gives the data address, or (data, scales) for the latter. With the extra pool
a ring entry ``<= -2`` names a row of the extra cache (``index_scan``).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8, Uint32

from ...dsl import ptx as common_ptx
from . import ptx
from .config import TILE, Sm90SparseDecodeConfig, Stamp
from .cta import POOL_ENTRY_WORDS, Cta, Gmem, dyn_storage, pools, stamp
from .index_scan import ScanThread, ring_index, scan_barrier, scan_begin, scan_smem, scan_until


POOL_ENTRY_BYTES = 4 * POOL_ENTRY_WORDS


class ProducerThread(NamedTuple):
    """A producer thread's map, the cache geometry and the shared addresses it writes."""

    warp: Int32
    lane: Int32
    sub: Int32          # 16-dim slice of each 64-dim chunk
    tok_in_half: Int32  # token within a half tile
    swz: Int32          # SW128 XOR phase of this thread's rows (token & 7)
    kv_base: Int64
    stride0: Int64      # bytes between page blocks
    page: Int32         # page_block_size
    pools: object       # with the extra pool: the shared address of both pools' geometry table, else None
    sk_base: Int32
    info_base: Int32
    k_full: object      # mbarrier pointers
    k_free: object


class PeerCopy(NamedTuple):
    """Cluster kernels' per-warp copy addresses, carried through a tile's conversion: this warp's
    first row in the local K buffer, the peer's shared window minus ours, the peer's ``k_full`` of
    the buffer (cluster address), and the lane index (lane 0 issues)."""

    warp_base: Int32
    delta: Int32
    peer_k_full: Int32
    lane: Int32


@cute.jit
def producer_setup(cfg: Sm90SparseDecodeConfig, g: Gmem, copy=0) -> ProducerThread:
    """The producer's thread map, cache geometry and shared-memory addresses (``copy``: the
    producer warp group's index, whose pool table it reads)."""
    ptid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
    warp = ptid // 32
    lane = ptid % 32
    sub = lane // 8
    tok_in_half = warp * 8 + lane % 8
    swz = lane % 8
    kv_base = g.mKV.iterator.toint()
    stride0 = Int64(g.mKV.stride[0])
    page = Int32(g.mKV.shape[1])
    storage = dyn_storage(cfg)
    sk_base = storage.sK.data_ptr().toint()
    info_base = storage.tile_info.data_ptr().toint()
    table = None
    if cutlass.const_expr(cfg.has_extra):
        table = storage.pool_table.data_ptr().toint() + copy * (pools(cfg) * POOL_ENTRY_BYTES)
        if cute.arch.thread_idx()[0] % TILE.threads_per_wg == 0:
            # Read by row_address only after the first scan barrier (its group's INDEX_SCAN) every
            # producer thread of the group passes before it computes a row address.
            write_pool(table, g.mKV)
            write_pool(table + POOL_ENTRY_BYTES, g.mExtraKV)
    return ProducerThread(warp, lane, sub, tok_in_half, swz, kv_base, stride0, page, table, sk_base, info_base,
                          storage.k_full.data_ptr(), storage.k_free.data_ptr())


@cute.jit
def write_pool(addr: Int32, kv: cute.Tensor):
    """One pool's entry of the geometry table (:data:`~.cta.POOL_ENTRY_WORDS`): base, stride(0)
    (the API bounds it below 2^31 bytes), page_block_size, then its divisor magic and shift."""
    base = kv.iterator.toint()
    page = Int32(kv.shape[1])
    magic, shift = common_ptx.divisor_magic(page)
    common_ptx.st_shared_v4(addr, Int32(base & 0xFFFFFFFF), Int32(base >> 32), Int32(kv.stride[0]), page)
    common_ptx.st_shared_v4(addr + 16, magic, shift, 0, 0)


@cute.jit
def hand_over_tile(pt: ProducerThread, ok_a, ok_b, buf: Int32, last, fenced: bool = False, copy=None):
    """Publish K buffer ``buf`` to the MMA warp groups.

    Writes the tile's ``tile_info`` (``info_words`` per buffer): its 64-bit validity mask (byte
    half*4 + warp, bit token & 7) and word 2 = ``last`` (the request's last tile; the consumers
    end their loop over the request on it). Then makes the generic-proxy ``st.shared`` data
    visible to the wgmma (async proxy) readers (unless ``fenced``: the crossover fenced each
    column block before copying it) and arrives on ``k_full[buf]`` (one of the 128 producer
    arrivals the consumers wait for; 129 with the crossover's expect_tx arrival; 256 with two
    producer warp groups). ``copy``: with two producers, this warp group's half (``ok_a`` its rows'
    validity, ``ok_b`` unused); its group 0 writes the flag.
    """
    one = copy is None
    bal_a = cute.arch.vote_ballot_sync(ok_a)
    bal_b = cute.arch.vote_ballot_sync(ok_b) if one else None
    info = pt.info_base + buf * (TILE.info_words * 4)
    writes_flag = pt.warp == 0
    if cutlass.const_expr(not one):
        writes_flag = writes_flag & (copy == 0)
    if pt.lane == 0:
        # byte half * 4 + warp: one group writes both halves' bytes, two groups their own half's
        vptr = cute.make_ptr(Uint8, info + 4 * (0 if one else copy) + pt.warp, cute.AddressSpace.smem,
                             assumed_align=1)
        cute.arch.store(vptr, Uint8(bal_a & 0xFF))
        if cutlass.const_expr(one):
            vptr_b = cute.make_ptr(Uint8, info + 4 + pt.warp, cute.AddressSpace.smem, assumed_align=1)
            cute.arch.store(vptr_b, Uint8(bal_b & 0xFF))
        if writes_flag:
            common_ptx.st_shared_i32(info + 8, common_ptx.select_i32(last, 1, 0))
    if cutlass.const_expr(not fenced):
        cute.arch.fence_view_async_shared()
    cute.arch.mbarrier_arrive(pt.k_full + buf)


@cute.jit
def producer(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, copy=None):
    """Gather + dequantize the partition's compacted tiles into the two K buffers (one-CTA kernels).

    Tile T: the scan runs until ``tiles_ahead`` tiles past T are queued (or the partition is
    scanned) while T's rows are in flight; then each half of T is converted slot by slot with
    tile T+1's rows re-loaded behind it, the tile handed over with its last-tile flag, and tile
    T+2's rows prefetched into L2.

    ``copy``: None with one producer warp group (a thread holds a row of each half); with two,
    this warp group's index (an Int32, 0 or 1), which converts half ``copy`` of every tile (a
    thread holds one row) and runs the whole scan on its own ring: the two scans are the same
    steps, so both groups agree on every tile and flag without talking to each other.
    """
    two = copy is not None
    group = copy if two else 0   # the warp group's ring, counts, pool table and scan barrier
    pt = producer_setup(cfg, g, group)
    ring_base, counts_base = scan_smem(dyn_storage(cfg), group)
    ptid = pt.warp * 32 + pt.lane
    leader = ptid == 0   # writes the timeline's producer stamps (group 0's with two groups)
    if cutlass.const_expr(two):
        leader = leader & (group == 0)
    st = ScanThread(ptid, pt.lane, pt.warp, ring_base, counts_base, scan_barrier(group))
    half_b = TILE.tokens // 2
    # The tile row of this thread's (first) row: half A's, or this warp group's half.
    own = pt.tok_in_half + group * half_b

    reg_a = cute.make_rmem_tensor(cute.make_layout(cfg.tile.slots_per_row), Int32)
    reg_b = None if two else cute.make_rmem_tensor(cute.make_layout(cfg.tile.slots_per_row), Int32)

    # ---- prologue: scan until tile 0 is queued, then issue this thread's rows' loads
    (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) = scan_until(
        cfg, g, cta, st, scan_begin(cfg, g, cta, ptid), TILE.tokens)
    stamp(cta, Stamp.SCAN, leader)
    idx_a, ok_a = ring_index(cfg, ring_base, own)
    ok_b = ok_a   # (two producers: no second row; carried through the loop unused)
    if cutlass.const_expr(not two):
        idx_b, ok_b = ring_index(cfg, ring_base, half_b + pt.tok_in_half)
    if tail > 0:
        issue_row_loads(cfg, pt, reg_a, idx_a)
        if cutlass.const_expr(not two):
            issue_row_loads(cfg, pt, reg_b, idx_b)

    t = Int32(0)
    while t * TILE.tokens < tail:
        buf = t % TILE.k_bufs
        first = t * TILE.tokens
        # Keep tiles T+1 and T+2 queued (loads of tile T are in flight meanwhile).
        (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) = scan_until(
            cfg, g, cta, st, (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next),
            first + TILE.tiles_ahead * TILE.tokens)
        has_next = first + TILE.tokens < tail

        cute.arch.mbarrier_wait(pt.k_free + buf, ((t // TILE.k_bufs) & 1) ^ 1)
        stamp(cta, Stamp.K_FREE, leader)
        tile_base = pt.sk_base + buf * cfg.tile.k_tile_bytes
        # Each 16-B slot of tile T is re-loaded with tile T+1's row as soon as it is converted
        # (row 0, never stored, when there is no tile T+1).
        na_idx, na_ok = ring_index(cfg, ring_base, first + TILE.tokens + own)
        next_ok_a = na_ok & has_next
        next_ok_b = next_ok_a
        na_addr = row_address(cfg, pt, common_ptx.select_i32(next_ok_a, na_idx, 0))
        if cutlass.const_expr(two):
            convert_store_reload(cfg, pt, reg_a, ok_a, tile_base + group * (half_b * TILE.chunk_row_bytes), na_addr)
        else:
            nb_idx, nb_ok = ring_index(cfg, ring_base, first + TILE.tokens + half_b + pt.tok_in_half)
            next_ok_b = nb_ok & has_next
            nb_addr = row_address(cfg, pt, common_ptx.select_i32(next_ok_b, nb_idx, 0))
            convert_store_reload(cfg, pt, reg_a, ok_a, tile_base, na_addr)
            stamp(cta, Stamp.HALF_A, leader)
            convert_store_reload(cfg, pt, reg_b, ok_b, tile_base + half_b * TILE.chunk_row_bytes, nb_addr)

        bit = Uint32(1) << Uint32(t % 32)
        hand_over_tile(pt, ok_a, ok_b, buf, (ends & bit) != Uint32(0), copy=copy)
        stamp(cta, Stamp.HANDED_OVER, leader)
        ends = ends & ~bit
        # Rows of tile T+2 into L2, a row's lines by two of its four threads (``prefetch_row``):
        # with one producer, threads with sub 0, 1 take half A's row, 2, 3 half B's; with two,
        # sub 0, 1 take the thread's own row.
        if cutlass.const_expr(cfg.tuning.prefetch_rows):
            if first + 2 * TILE.tokens < tail:
                if cutlass.const_expr(two):
                    p_idx, p_ok = ring_index(cfg, ring_base, first + 2 * TILE.tokens + own)
                    p_ok = p_ok & (pt.sub < 2)
                else:
                    in_b = pt.sub >= 2
                    p_idx, p_ok = ring_index(
                        cfg, ring_base,
                        first + 2 * TILE.tokens + common_ptx.select_i32(in_b, half_b, 0) + pt.tok_in_half)
                if p_ok:
                    prefetch_row(cfg, row_address(cfg, pt, p_idx), pt.sub)
        ok_b = next_ok_b
        ok_a = next_ok_a
        t += 1


@cute.jit
def chunk_to_peer(c: cutlass.Constexpr, copy):
    """Cluster kernels' transport: once this warp's 8 rows of column block ``c`` are written, lane 0
    copies their 1 KB to the same place in the peer CTA (each thread's ``fence.proxy.async`` +
    warp sync first: the copy reads in the async proxy), completing on the peer's ``k_full``.
    ``copy``: None (one-CTA kernels: no copy) or the :class:`PeerCopy` built once per tile from
    values computed before the tile loop (they stay in registers through the conversion;
    re-deriving them at each of the 9 copies measured slower, docs/performance.md)."""
    if cutlass.const_expr(copy is not None):
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        src = copy.warp_base + c * TILE.chunk_bytes
        if copy.lane == 0:
            ptx.bulk_copy_to_peer(src + copy.delta, src, TILE.rows_per_warp * TILE.chunk_row_bytes, copy.peer_k_full)


def dequant(cfg: Sm90SparseDecodeConfig):
    """The device dequant routine of the config's cache format (its format module's)."""
    return cfg.tile.fmt.dequant


@cute.jit
def convert_store_reload(cfg: Sm90SparseDecodeConfig, pt: ProducerThread, regs: cute.Tensor, ok, half_base: Int32,
                         next_addr, copy=None):
    """Dequantize this thread's slice of one row (``regs``) into the SW128 K-major tile at
    ``half_base``, re-loading each slot from the row at ``next_addr`` (:func:`row_address`) as soon
    as its registers are consumed: RoPE first (stored as is), then the scales (once read), then
    each fp8 chunk right after its conversion. With ``copy`` (cluster kernels) each warp sends
    every column block to the peer CTA once written (:func:`chunk_to_peer`).

    Invalid rows (``ok`` false) get zero scales and zero RoPE (the fast path never makes NaN/Inf,
    so fp8 NaN bytes times 0 are 0; the exact path zeroes the fp8 words too), so their V rows are
    zero and cannot poison P V (V4's V includes the RoPE chunk).
    """
    row_base = half_base + pt.tok_in_half * TILE.chunk_row_bytes
    off0 = ((2 * pt.sub) ^ pt.swz) << 4
    off1 = ((2 * pt.sub + 1) ^ pt.swz) << 4
    rbase = row_base + cfg.tile.nope_chunks * TILE.chunk_bytes
    r = [Int32(0)] * 8
    for e in cutlass.range_constexpr(8):
        r[e] = common_ptx.select_i32(ok, regs[cfg.tile.rope_reg + e], 0)
    common_ptx.st_shared_v4(rbase + off0, r[0], r[1], r[2], r[3])
    common_ptx.st_shared_v4(rbase + off1, r[4], r[5], r[6], r[7])
    chunk_to_peer(cfg.tile.nope_chunks, copy)
    for q in cutlass.range_constexpr(2):
        load_slot(cfg, regs, cfg.tile.nope_chunks + 1 + q, next_addr, pt.sub)
    words = [Int32(0)] * cfg.tile.scale_words
    for k in cutlass.range_constexpr(cfg.tile.scale_words):
        words[k] = common_ptx.select_i32(ok, regs[cfg.tile.scale_reg + k], 0)
    sc, s2, fast = row_scales(cfg, words)
    # Warp-uniform choice: caches written with FlashMLA's recipe (power-of-two scales) take the
    # 4-op path; any other scale takes the exact fp32 path (6 ops) for the whole warp.
    all_fast = cute.arch.vote_all_sync(fast)
    if cutlass.const_expr(not dequant(cfg).packed_scales):
        for k in cutlass.range_constexpr(cfg.tile.fmt.num_groups):
            s2[k] = dequant(cfg).fast_multiplier(sc[k])
    load_slot(cfg, regs, cfg.tile.nope_chunks, next_addr, pt.sub)
    if all_fast:
        for c in cutlass.range_constexpr(cfg.tile.nope_chunks):
            o = [Int32(0)] * 8
            m = chunk_scale(cfg, words, s2, c, True)
            for e in cutlass.range_constexpr(4):
                o[2 * e], o[2 * e + 1] = dequant(cfg).fast(regs[c * 4 + e], m)
            load_slot(cfg, regs, c, next_addr, pt.sub)
            cbase = row_base + c * TILE.chunk_bytes
            common_ptx.st_shared_v4(cbase + off0, o[0], o[1], o[2], o[3])
            common_ptx.st_shared_v4(cbase + off1, o[4], o[5], o[6], o[7])
            chunk_to_peer(c, copy)
    else:
        for c in cutlass.range_constexpr(cfg.tile.nope_chunks):
            o = [Int32(0)] * 8
            for e in cutlass.range_constexpr(4):
                # fp8 NaN bytes of an invalid (clamped) row would survive a zero scale here.
                w = common_ptx.select_i32(ok, regs[c * 4 + e], 0)
                o[2 * e], o[2 * e + 1] = dequant(cfg).exact(w, chunk_scale(cfg, words, sc, c, False))
            load_slot(cfg, regs, c, next_addr, pt.sub)
            cbase = row_base + c * TILE.chunk_bytes
            common_ptx.st_shared_v4(cbase + off0, o[0], o[1], o[2], o[3])
            common_ptx.st_shared_v4(cbase + off1, o[4], o[5], o[6], o[7])
            chunk_to_peer(c, copy)


def row_scales(cfg: Sm90SparseDecodeConfig, words):
    """(A plain function, inlined at trace time.) (fp32 scale bits, fast multipliers to fill, whether every scale takes the fast path) of a
    row's loaded scale ``words``. Formats that pack several scales per register (V4's ue8m0 bytes)
    keep only the words: each chunk derives its scale where it is used (:func:`chunk_scale`), since
    seven live multipliers next to the row sets spilled the producer's 128 registers."""
    n_scales = cfg.tile.fmt.num_groups
    fast = cutlass.Boolean(True)
    if dequant(cfg).packed_scales:
        for k in range(n_scales):
            fast = fast & dequant(cfg).packed_takes_fast_path(words, k)
        return None, None, fast
    sc = [Int32(0)] * n_scales
    for k in range(n_scales):
        sc[k] = dequant(cfg).scale_bits(words, k)
        fast = fast & dequant(cfg).scale_takes_fast_path(sc[k])
    return sc, [Int32(0)] * n_scales, fast


def chunk_scale(cfg: Sm90SparseDecodeConfig, words, made, c: int, fast: bool):
    """The scale operand of NoPE chunk ``c``: the fast path's multiplier or the exact path's fp32
    bits, taken from ``made`` (:func:`row_scales`) or, for packed scales, derived from the words."""
    k = dequant(cfg).scale_index(c * TILE.chunk)
    if not dequant(cfg).packed_scales:
        return made[k]
    if fast:
        return dequant(cfg).packed_multiplier(words, k)
    return dequant(cfg).scale_bits(words, k)


def data_address(addr):
    """The data-row address of a :func:`row_address` result."""
    return addr if not isinstance(addr, tuple) else addr[0]


def prefetch_row(cfg: Sm90SparseDecodeConfig, addr, sub: Int32):
    """This thread's share of one cache row into L2: the row's 128-B lines at offsets
    ``(sub % 2) * 128 + {0, 256, 512}`` (the two threads of a row cover offsets 0..640, every line a
    V3.2 row can touch; a V4 data row ends before 640, so there the line at 640 gives way to
    the row's scale line). Per-thread ``prefetch.global.L2``: a bulk prefetch of the row takes uniform
    operands, which ptxas loops over per distinct row (:func:`~.ptx.prefetch_l2_line`)."""
    base = data_address(addr) + Int64((sub % 2) * 128)
    for k in range(2):
        ptx.prefetch_l2_line(base + k * 256)
    if cutlass.const_expr(cfg.tile.fmt.scales_in_row):
        ptx.prefetch_l2_line(base + 512)
    else:
        data = data_address(addr)
        ptx.prefetch_l2_line(data + Int64(common_ptx.select_i32(sub % 2 == 0, 512, addr[1])))


@cute.jit
def issue_row_loads(cfg: Sm90SparseDecodeConfig, pt: ProducerThread, regs: cute.Tensor, idx: Int32):
    """This thread's slice of one row into ``regs`` (``slots_per_row`` i32)."""
    tile = cfg.tile
    addr = row_address(cfg, pt, idx)
    for c in cutlass.range_constexpr(tile.nope_chunks + 3):
        load_slot(cfg, regs, c, addr, pt.sub)


@cute.jit
def row_address(cfg: Sm90SparseDecodeConfig, pt: ProducerThread, idx: Int32):
    """Global byte address of cache row ``idx`` (a ring entry, already clamped to a legal row):
    its data row's, or (data row, the scale row's offset from it: int32, the API bounds a page
    block below 2^31 bytes) for a format with block-major scales (an Int64 scale address per
    row in flight spilled the one-CTA producer with the extra pool)."""
    kv_base, stride0, page = pt.kv_base, pt.stride0, pt.page
    fmt = cfg.tile.fmt
    if cutlass.const_expr(cfg.has_extra):
        # The pool's geometry from the shared table, loaded where it is used: both pools' values
        # held in registers for a select spilled the one-CTA producer.
        is_extra = idx < 0
        idx = common_ptx.select_i32(is_extra, -2 - idx, idx)
        entry = pt.pools + common_ptx.select_i32(is_extra, POOL_ENTRY_BYTES, 0)
        v = common_ptx.ld_shared_v4(entry)
        w = common_ptx.ld_shared_v4(entry + 16)
        kv_base = (Int64(Uint32(common_ptx.vec_elem(v, 1))) << 32) | Int64(Uint32(common_ptx.vec_elem(v, 0)))
        stride0 = Int64(common_ptx.vec_elem(v, 2))
        page = common_ptx.vec_elem(v, 3)
        # The block by the pool's divisor magic: a division by the loaded page_block_size would
        # recompute its reciprocal for every row, a chain of dependent instructions before the load.
        blk = common_ptx.divide_by_magic(idx, common_ptx.vec_elem(w, 0), common_ptx.vec_elem(w, 1))
    else:
        blk = Uint32(idx) // Uint32(page)
    row = Uint32(idx) - blk * Uint32(page)
    data = kv_base + Int64(blk) * stride0 + Int64(row) * fmt.data_row_bytes
    if cutlass.const_expr(fmt.scales_in_row):
        return data
    return data, Int32(page - Int32(row)) * fmt.data_row_bytes + Int32(row) * fmt.scale_row_bytes


def load_slot(cfg: Sm90SparseDecodeConfig, regs: cute.Tensor, slot: int, addr, sub: Int32):
    """One load of this thread's slice of the row at ``addr`` (:func:`row_address`) into ``regs``.

    With ``n`` NoPE chunks: slot < n: fp8 bytes ``[64*slot + 16*sub, +16)`` -> regs[4*slot, +4);
    slot n: the scales -> regs[scale_reg, +scale_words) (16 B in the data row, or the 8-B scale
    row); slot n+1 / n+2: RoPE bytes ``[rope + 32*sub + 16*(slot-n-1), +16)`` -> regs[rope_reg + ...].
    (A plain function: inlined at trace time, ``slot`` is a Python int.)
    """
    tile = cfg.tile
    n = tile.nope_chunks
    src = data_address(addr)
    words = 4
    if slot < n:
        off = slot * TILE.chunk + sub * 16
        base = slot * 4
    elif slot == n:
        base = tile.scale_reg
        words = tile.scale_words
        if tile.fmt.scales_in_row:
            off = tile.scale_offset
        else:
            src, off = addr[0] + Int64(addr[1]), tile.scale_offset
    else:
        off = tile.rope_offset + sub * 32 + (slot - n - 1) * 16
        base = tile.rope_reg + (slot - n - 1) * 4
    v = ptx.ld_global_vec(src + off, words, cfg.tuning.gather_l1, cfg.tuning.gather_l2)
    for e in range(words):
        regs[base + e] = common_ptx.vec_elem(v, e)
