"""Producer warp group (WG2) of the SM90 sparse decode kernel: gather + FP8 dequant into K tiles."""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8, Uint32

from . import ptx
from .sparse_decode_common import TILE, Crossover, Streaming


class PeerCopy(NamedTuple):
    """Crossover per-warp copy addresses, carried through a tile's conversion: this warp's first
    row in the local K buffer, the peer's shared window minus ours, the peer's ``k_full`` of the
    buffer (cluster address), and the lane index (lane 0 issues)."""
    warp_base: Int32
    delta: Int32
    peer_k_full: Int32
    lane: Int32


class ProducerMixin:
    @cute.jit
    def producer_setup(self, mKV: cute.Tensor, mIdx: cute.Tensor):
        """The producer's thread map, cache geometry and shared-memory addresses (every producer variant).

        Thread map (FlashMLA's): warp w, lane l handles token ``half*32 + w*8 + l%8`` and the 16-dim
        slice ``l//8``; ``swz = token & 7`` is the SW128 XOR phase of this thread's rows.
        """
        ptid = cute.arch.thread_idx()[0] % TILE.threads_per_wg
        warp = ptid // 32
        lane = ptid % 32
        sub = lane // 8
        tok_in_half = warp * 8 + lane % 8
        swz = lane % 8

        topk = mIdx.shape[2]
        topk_blocks = topk // TILE.tokens
        kv_base = mKV.iterator.toint()
        stride0 = Int64(mKV.stride[0])
        page = Int32(mKV.shape[1])
        num_tokens = Int64(mKV.shape[0]) * Int64(page)
        # The shared-storage struct rebuilt from the dynamic-smem symbol (the allocator put it at
        # offset 0, 1024-aligned). The allocator's own base pointer is a warp shuffle, which ptxas
        # can neither rematerialize nor keep in this 128-register warp group, so it spilled it;
        # the symbol address is a constant it can re-create anywhere.
        storage = self.shared_storage(cute.arch.get_dyn_smem(Uint8, alignment=1024))
        sk_base = storage.sK.data_ptr().toint()
        info_base = storage.tile_info.data_ptr().toint()
        k_full = storage.k_full.data_ptr()
        k_free = storage.k_free.data_ptr()
        return (warp, lane, sub, tok_in_half, swz, topk, topk_blocks, kv_base, stride0, page, num_tokens,
                sk_base, info_base, k_full, k_free)

    @cute.jit
    def hand_over_tile(self, ok_a, ok_b, lane: Int32, warp: Int32, info_base: Int32, buf: Int32, k_full, last,
                       fenced: bool = False):
        """Publish K buffer ``buf`` to the MMA warp groups (every producer).

        Writes the tile's ``tile_info`` (``info_words`` per buffer): its 64-bit validity mask (byte
        half*4 + warp, bit token & 7) and word 2 = ``last`` (the request's last tile; the consumers
        end their loop over the request on it). Then makes the generic-proxy ``st.shared`` data
        visible to the wgmma (async proxy) readers (unless ``fenced``: the crossover fenced each
        column block before copying it) and arrives on ``k_full[buf]`` (one of the 128 producer
        arrivals the consumers wait for; 129 with the crossover's expect_tx arrival).
        """
        bal_a = cute.arch.vote_ballot_sync(ok_a)
        bal_b = cute.arch.vote_ballot_sync(ok_b)
        info = info_base + buf * (TILE.info_words * 4)
        if lane == 0:
            vptr = cute.make_ptr(Uint8, info + warp, cute.AddressSpace.smem, assumed_align=1)
            cute.arch.store(vptr, Uint8(bal_a & 0xFF))
            vptr_b = cute.make_ptr(Uint8, info + 4 + warp, cute.AddressSpace.smem, assumed_align=1)
            cute.arch.store(vptr_b, Uint8(bal_b & 0xFF))
            if warp == 0:
                ptx.st_shared_i32(info + 8, ptx.select_i32(last, 1, 0))
        if cutlass.const_expr(not self.tuning.consumer_proxy_fence and not fenced):
            cute.arch.fence_view_async_shared()
        cute.arch.mbarrier_arrive(k_full + buf)

    @cute.jit
    def convert_second_tile(self, mKV: cute.Tensor, mIdx: cute.Tensor):
        """``Tuning.help_second_tile``, run by WG1 in a partition of exactly two compacted tiles:
        tile 1 (ring entries 64-127, which the producer's scan never overwrites once the partition
        is scanned) into K buffer 1, handed over as the producer hands over a tile: its validity
        mask, the last-tile flag (tile 1 is the request's last) and the 128 ``k_full`` arrivals the
        consumers wait for. The thread map is the producer's (thread index mod 128); buffer 1's
        first use, so its ``k_free`` wait passes at once.
        """
        (warp, lane, sub, tok_in_half, swz, topk, topk_blocks, kv_base, stride0, page, num_tokens,
         sk_base, info_base, k_full, k_free) = self.producer_setup(mKV, mIdx)
        ring_base, _ = self.scan_smem()
        half_b = TILE.tokens // 2
        reg_a = cute.make_rmem_tensor(cute.make_layout(44), Int32)
        reg_b = cute.make_rmem_tensor(cute.make_layout(44), Int32)
        idx_a, ok_a = self.ring_index(ring_base, TILE.tokens + tok_in_half)
        idx_b, ok_b = self.ring_index(ring_base, TILE.tokens + half_b + tok_in_half)
        self.issue_row_loads(reg_a, kv_base, stride0, page, idx_a, sub)
        self.issue_row_loads(reg_b, kv_base, stride0, page, idx_b, sub)
        buf = 1
        cute.arch.mbarrier_wait(k_free + buf, 1)
        tile_base = sk_base + buf * TILE.k_tile_bytes
        self.convert_and_store(reg_a, ok_a, tile_base, tok_in_half, sub, swz)
        self.convert_and_store(reg_b, ok_b, tile_base + half_b * 128, tok_in_half, sub, swz)
        self.hand_over_tile(ok_a, ok_b, lane, warp, info_base, buf, k_full, cutlass.Boolean(True))

    @cute.jit
    def fetch_first_tiles(self, begin_req: Int32, end_req: Int32, sched, mTopkLen, mIdx: cute.Tensor, s_idx: Int32,
                          tok_in_half: Int32, topk: Int32, topk_blocks: Int32):
        """Prologue of the uncompacted producers: raw indices of the partition's first tile and of the tile after it.

        Returns (raw_a, pos_a, raw_b, pos_b) of tile 0, then (req, blk, has, raw_a, pos_a, raw_b, pos_b)
        of tile 1 (raw -1 / pos False when there is none).
        """
        start0, stop0, len0 = self.request_range(begin_req, sched, mTopkLen, topk)
        raw_a, pos_a = self.fetch_index(mIdx, begin_req, s_idx, start0, 0, tok_in_half, len0, topk_blocks)
        raw_b, pos_b = self.fetch_index(mIdx, begin_req, s_idx, start0, 1, tok_in_half, len0, topk_blocks)
        la_req, la_blk, la_has = self.next_tile(begin_req, start0, stop0, end_req)
        la_raw_a = Int32(-1)
        la_pos_a = cutlass.Boolean(False)
        la_raw_b = Int32(-1)
        la_pos_b = cutlass.Boolean(False)
        if la_has:
            _, la_len = self.request_blocks(la_req, mTopkLen, topk)
            la_raw_a, la_pos_a = self.fetch_index(mIdx, la_req, s_idx, la_blk, 0, tok_in_half, la_len, topk_blocks)
            la_raw_b, la_pos_b = self.fetch_index(mIdx, la_req, s_idx, la_blk, 1, tok_in_half, la_len, topk_blocks)
        return raw_a, pos_a, raw_b, pos_b, la_req, la_blk, la_has, la_raw_a, la_pos_a, la_raw_b, la_pos_b

    @cute.jit
    def fetch_tile_after(self, has: cutlass.Boolean, req: Int32, blk: Int32, sched, mTopkLen, mIdx: cute.Tensor,
                         s_idx: Int32, tok_in_half: Int32, topk: Int32, topk_blocks: Int32, end_req: Int32):
        """The tile after (req, blk) when ``has`` (else none) and its two halves' raw indices.

        Returns (req, blk, has, raw_a, pos_a, raw_b, pos_b); raw -1 / pos False when there is none.
        """
        f_req = Int32(0)
        f_blk = Int32(0)
        f_has = cutlass.Boolean(False)
        f_raw_a = Int32(-1)
        f_pos_a = cutlass.Boolean(False)
        f_raw_b = Int32(-1)
        f_pos_b = cutlass.Boolean(False)
        if has:
            _, stop, _ = self.request_range(req, sched, mTopkLen, topk)
            f_req, f_blk, f_has = self.next_tile(req, blk, stop, end_req)
            if f_has:
                _, f_len = self.request_blocks(f_req, mTopkLen, topk)
                f_raw_a, f_pos_a = self.fetch_index(mIdx, f_req, s_idx, f_blk, 0, tok_in_half, f_len, topk_blocks)
                f_raw_b, f_pos_b = self.fetch_index(mIdx, f_req, s_idx, f_blk, 1, tok_in_half, f_len, topk_blocks)
        return f_req, f_blk, f_has, f_raw_a, f_pos_a, f_raw_b, f_pos_b

    @cute.jit
    def producer(self, mKV: cute.Tensor, mIdx: cute.Tensor, mTopkLen, sched, s_idx: Int32):
        """Gather + dequantize 64-token K tiles into the two K buffers.

        With ``Tuning.compact_indices`` (default) the tiles hold the valid tokens only
        (:class:`~.sparse_decode_scan.IndexScanMixin`, streamed or half-tile pipelined); otherwise
        tile n is block n of the request (:meth:`producer_half_pipelined` or :meth:`producer_streamed`).

        Thread map (FlashMLA's): warp w, lane l handles token ``half*32 + w*8 + l%8`` and the 16-dim
        slice ``l//8`` of every 64-dim chunk: 8 x 16 B of fp8, 16 B of scales, 2 x 16 B of RoPE
        = 11 x 16-B loads per half tile. Loads of the next tile are in flight while the current
        one is converted and stored (half by half, or slot by slot when streamed).
        """
        if cutlass.const_expr(self.xover and self.tuning.crossover == Crossover.WARP_COPIES_TWO_TILES):
            self.producer_crossover2(mKV, mIdx, mTopkLen, sched, s_idx)
        elif cutlass.const_expr(self.xover):
            self.producer_crossover(mKV, mIdx, mTopkLen, sched, s_idx)
        elif cutlass.const_expr(self.tuning.compact_indices):  # OFF or BOTH
            self.producer_compacted(mKV, mIdx, mTopkLen, sched, s_idx)
        elif cutlass.const_expr(self.tuning.streaming != Streaming.OFF):
            self.producer_streamed(mKV, mIdx, mTopkLen, sched, s_idx)
        else:
            self.producer_half_pipelined(mKV, mIdx, mTopkLen, sched, s_idx)

    @cute.jit
    def producer_half_pipelined(self, mKV: cute.Tensor, mIdx: cute.Tensor, mTopkLen, sched, s_idx: Int32):
        """The half-tile software pipeline (``Streaming.OFF``): see :meth:`producer`."""
        begin_req, end_req, begin_block, end_block = sched
        (warp, lane, sub, tok_in_half, swz, topk, topk_blocks, kv_base, stride0, page, num_tokens,
         sk_base, info_base, k_full, k_free) = self.producer_setup(mKV, mIdx)

        reg_a = cute.make_rmem_tensor(cute.make_layout(44), Int32)
        reg_b = cute.make_rmem_tensor(cute.make_layout(44), Int32)

        # ---- prologue: indices of tiles 0 and 1, loads of tile 0's first half
        (raw_a, pos_a, raw_b, pos_b, la_req, la_blk, la_has, la_raw_a, la_pos_a, la_raw_b, la_pos_b) = self.fetch_first_tiles(
            begin_req, end_req, sched, mTopkLen, mIdx, s_idx, tok_in_half, topk, topk_blocks)
        idx0, _ = self.resolve_index(raw_a, pos_a, num_tokens)
        self.issue_row_loads(reg_a, kv_base, stride0, page, idx0, sub)
        self.prefetch_tile_rows(la_raw_a, la_pos_a, la_raw_b, la_pos_b, sub, kv_base, stride0, page, num_tokens)

        n = Int32(0)
        for req in cutlass.range(begin_req, end_req + 1, unroll=1):
            start, stop, length = self.request_range(req, sched, mTopkLen, topk)
            for blk in cutlass.range(start, stop, unroll=1):
                buf = n % TILE.k_bufs
                # Raw indices are carried and checked only where they are used: the check is the
                # first consumer of the index load, so checking at fetch time would stall the warp
                # for the whole index round trip right here (as the SASS showed).
                idx_b, ok_b = self.resolve_index(raw_b, pos_b, num_tokens)
                _, ok_a = self.resolve_index(raw_a, pos_a, num_tokens)
                # Indices of tile n+2: their round trip is hidden behind a whole tile of work.
                f_req, f_blk, f_has, f_raw_a, f_pos_a, f_raw_b, f_pos_b = self.fetch_tile_after(
                    la_has, la_req, la_blk, sched, mTopkLen, mIdx, s_idx, tok_in_half, topk, topk_blocks, end_req)

                self.issue_row_loads(reg_b, kv_base, stride0, page, idx_b, sub)
                # Wait for both MMA warp groups to release this buffer (first use passes).
                cute.arch.mbarrier_wait(k_free + buf, ((n // TILE.k_bufs) & 1) ^ 1)
                tile_base = sk_base + buf * TILE.k_tile_bytes
                self.convert_and_store(reg_a, ok_a, tile_base, tok_in_half, sub, swz)
                if la_has:
                    la_idx_a, _ = self.resolve_index(la_raw_a, la_pos_a, num_tokens)
                    self.issue_row_loads(reg_a, kv_base, stride0, page, la_idx_a, sub)
                self.convert_and_store(reg_b, ok_b, tile_base + 32 * 128, tok_in_half, sub, swz)

                self.hand_over_tile(ok_a, ok_b, lane, warp, info_base, buf, k_full, blk + 1 >= stop)
                # Rows of tile n+2 (their indices were fetched a whole tile ago).
                self.prefetch_tile_rows(f_raw_a, f_pos_a, f_raw_b, f_pos_b, sub, kv_base, stride0, page, num_tokens)

                raw_a = la_raw_a
                pos_a = la_pos_a
                raw_b = la_raw_b
                pos_b = la_pos_b
                la_req = f_req
                la_blk = f_blk
                la_has = f_has
                la_raw_a = f_raw_a
                la_pos_a = f_pos_a
                la_raw_b = f_raw_b
                la_pos_b = f_pos_b
                n += 1

    @cute.jit
    def producer_streamed(self, mKV: cute.Tensor, mIdx: cute.Tensor, mTopkLen, sched, s_idx: Int32):
        """Gather + dequantize with the loads streamed (``Streaming.FIRST_HALF`` / ``BOTH``).

        Same thread map, index look-ahead and hand-off as the half-tile pipeline, but half A (and
        with BOTH half B) of tile n+1 is loaded *while* the same half of tile n is converted: each
        16-B load goes into the registers the conversion has just consumed
        (:meth:`convert_store_reload`), so those 44 registers are in flight almost all the time
        instead of idling through a half tile's conversion. With FIRST_HALF, B(n) is issued at the
        top of tile n as in the half-tile pipeline. A thread with no next tile re-reads row 0 (a
        legal row, never stored).
        """
        both = self.tuning.streaming == Streaming.BOTH
        begin_req, end_req, begin_block, end_block = sched
        (warp, lane, sub, tok_in_half, swz, topk, topk_blocks, kv_base, stride0, page, num_tokens,
         sk_base, info_base, k_full, k_free) = self.producer_setup(mKV, mIdx)

        reg_a = cute.make_rmem_tensor(cute.make_layout(44), Int32)
        reg_b = cute.make_rmem_tensor(cute.make_layout(44), Int32)

        # ---- prologue: indices of tiles 0 and 1, both halves of tile 0 in flight
        (raw_a, pos_a, raw_b, pos_b, la_req, la_blk, la_has, la_raw_a, la_pos_a, la_raw_b, la_pos_b) = self.fetch_first_tiles(
            begin_req, end_req, sched, mTopkLen, mIdx, s_idx, tok_in_half, topk, topk_blocks)
        idx0_a, _ = self.resolve_index(raw_a, pos_a, num_tokens)
        self.issue_row_loads(reg_a, kv_base, stride0, page, idx0_a, sub)
        if cutlass.const_expr(both):
            idx0_b, _ = self.resolve_index(raw_b, pos_b, num_tokens)
            self.issue_row_loads(reg_b, kv_base, stride0, page, idx0_b, sub)
        self.prefetch_tile_rows(la_raw_a, la_pos_a, la_raw_b, la_pos_b, sub, kv_base, stride0, page, num_tokens)

        n = Int32(0)
        for req in cutlass.range(begin_req, end_req + 1, unroll=1):
            start, stop, length = self.request_range(req, sched, mTopkLen, topk)
            for blk in cutlass.range(start, stop, unroll=1):
                buf = n % TILE.k_bufs
                _, ok_a = self.resolve_index(raw_a, pos_a, num_tokens)
                idx_b, ok_b = self.resolve_index(raw_b, pos_b, num_tokens)
                # Rows of tile n+1 (fetched one tile ago; -1 / not a position -> row 0 when none).
                nidx_a, _ = self.resolve_index(la_raw_a, la_pos_a, num_tokens)
                naddr_a = self.row_address(kv_base, stride0, page, nidx_a)
                naddr_b = naddr_a
                if cutlass.const_expr(both):
                    nidx_b, _ = self.resolve_index(la_raw_b, la_pos_b, num_tokens)
                    naddr_b = self.row_address(kv_base, stride0, page, nidx_b)
                # Indices of tile n+2: their round trip is hidden behind a whole tile of work.
                f_req, f_blk, f_has, f_raw_a, f_pos_a, f_raw_b, f_pos_b = self.fetch_tile_after(
                    la_has, la_req, la_blk, sched, mTopkLen, mIdx, s_idx, tok_in_half, topk, topk_blocks, end_req)

                if cutlass.const_expr(not both):
                    self.issue_row_loads(reg_b, kv_base, stride0, page, idx_b, sub)
                # Wait for both MMA warp groups to release this buffer (first use passes).
                cute.arch.mbarrier_wait(k_free + buf, ((n // TILE.k_bufs) & 1) ^ 1)
                tile_base = sk_base + buf * TILE.k_tile_bytes
                self.convert_store_reload(reg_a, ok_a, tile_base, tok_in_half, sub, swz, naddr_a)
                if cutlass.const_expr(both):
                    self.convert_store_reload(reg_b, ok_b, tile_base + 32 * 128, tok_in_half, sub, swz, naddr_b)
                else:
                    self.convert_and_store(reg_b, ok_b, tile_base + 32 * 128, tok_in_half, sub, swz)

                self.hand_over_tile(ok_a, ok_b, lane, warp, info_base, buf, k_full, blk + 1 >= stop)
                # Rows of tile n+2 (their indices were fetched a whole tile ago).
                self.prefetch_tile_rows(f_raw_a, f_pos_a, f_raw_b, f_pos_b, sub, kv_base, stride0, page, num_tokens)

                raw_a = la_raw_a
                pos_a = la_pos_a
                raw_b = la_raw_b
                pos_b = la_pos_b
                la_req = f_req
                la_blk = f_blk
                la_has = f_has
                la_raw_a = f_raw_a
                la_pos_a = f_pos_a
                la_raw_b = f_raw_b
                la_pos_b = f_pos_b
                n += 1

    @cute.jit
    def chunk_to_peer(self, c: cutlass.Constexpr, copy, half_base: Int32, tok_in_half: Int32):
        """Crossover, per-warp transport: once this warp's 8 rows of column block ``c`` are written,
        lane 0 copies their 1 KB to the same place in the peer CTA (each thread's
        ``fence.proxy.async`` + warp sync first: the copy reads in the async proxy), completing on
        the peer's ``k_full``. ``copy``: None (no copy); a :class:`PeerCopy` built once per tile
        from values computed before the tile loop (``Crossover.WARP_COPIES``: the addresses stay in
        registers through the conversion; re-deriving them at each of the 9 copies measured 4-6 %
        slower on the h=128 rows); or the local address of this buffer's ``k_full``
        (``WARP_COPIES_TWO_TILES``: addresses re-derived here with ``mapa``, carried they spill
        there)."""
        if cutlass.const_expr(copy is not None):
            cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()
            size = TILE.rows_per_warp * TILE.chunk_row_bytes
            if cutlass.const_expr(isinstance(copy, PeerCopy)):
                src = copy.warp_base + c * TILE.chunk_bytes
                if copy.lane == 0:
                    ptx.bulk_copy_to_peer(src + copy.delta, src, size, copy.peer_k_full)
            else:
                warp_row0 = tok_in_half - tok_in_half % TILE.rows_per_warp
                src = half_base + warp_row0 * TILE.chunk_row_bytes + c * TILE.chunk_bytes
                if cute.arch.lane_idx() == 0:
                    peer = cute.arch.block_idx_in_cluster() ^ 1
                    ptx.bulk_copy_to_peer(ptx.mapa_shared_cluster(src, peer), src, size,
                                          ptx.mapa_shared_cluster(copy, peer))

    @cute.jit
    def convert_store_reload(
        self, regs: cute.Tensor, ok, half_base: Int32, tok_in_half: Int32, sub: Int32, swz: Int32, next_addr: Int64,
        copy=None,
    ):
        """:meth:`convert_and_store`, re-loading each 16-B slot from the row at ``next_addr`` as
        soon as its registers are consumed: RoPE first (stored as is), then the scales (once read),
        then each fp8 chunk right after its conversion. Same bytes in shared memory. With ``copy``
        (crossover) each warp sends every column block to the peer CTA once written
        (:meth:`chunk_to_peer`)."""
        row_base = half_base + tok_in_half * 128
        off0 = ((2 * sub) ^ swz) << 4
        off1 = ((2 * sub + 1) ^ swz) << 4
        rbase = row_base + 8 * TILE.chunk_bytes
        r = [Int32(0)] * 8
        for e in cutlass.range_constexpr(8):
            r[e] = ptx.select_i32(ok, regs[36 + e], 0)
        ptx.st_shared_v4(rbase + off0, r[0], r[1], r[2], r[3])
        ptx.st_shared_v4(rbase + off1, r[4], r[5], r[6], r[7])
        self.chunk_to_peer(8, copy, half_base, tok_in_half)
        for q in cutlass.range_constexpr(2):
            self.load_slot(regs, 9 + q, next_addr, sub)
        sc = [Int32(0)] * 4
        fast = cutlass.Boolean(True)
        for k in cutlass.range_constexpr(4):
            sc[k] = ptx.select_i32(ok, regs[32 + k], 0)
            fast = fast & ptx.is_fast_scale(sc[k])
        all_fast = cute.arch.vote_all_sync(fast)
        s2 = [Int32(0)] * 4
        for k in cutlass.range_constexpr(4):
            s2[k] = ptx.scale_to_bf16x2_times_2pow120(sc[k])
        self.load_slot(regs, 8, next_addr, sub)
        # Warp-uniform choice, as in convert_and_store.
        if all_fast:
            for c in cutlass.range_constexpr(8):
                o = [Int32(0)] * 8
                for e in cutlass.range_constexpr(4):
                    o[2 * e], o[2 * e + 1] = ptx.fp8x4_to_bf16x4_pow2(regs[c * 4 + e], s2[c // 2])
                self.load_slot(regs, c, next_addr, sub)
                cbase = row_base + c * TILE.chunk_bytes
                ptx.st_shared_v4(cbase + off0, o[0], o[1], o[2], o[3])
                ptx.st_shared_v4(cbase + off1, o[4], o[5], o[6], o[7])
                self.chunk_to_peer(c, copy, half_base, tok_in_half)
        else:
            for c in cutlass.range_constexpr(8):
                o = [Int32(0)] * 8
                for e in cutlass.range_constexpr(4):
                    w = ptx.select_i32(ok, regs[c * 4 + e], 0)
                    o[2 * e], o[2 * e + 1] = ptx.fp8x4_to_bf16x4_exact(w, sc[c // 2])
                self.load_slot(regs, c, next_addr, sub)
                cbase = row_base + c * TILE.chunk_bytes
                ptx.st_shared_v4(cbase + off0, o[0], o[1], o[2], o[3])
                ptx.st_shared_v4(cbase + off1, o[4], o[5], o[6], o[7])
                self.chunk_to_peer(c, copy, half_base, tok_in_half)

    @cute.jit
    def prefetch_tile_rows(self, raw_a: Int32, pos_a, raw_b: Int32, pos_b, sub: Int32, kv_base: Int64, stride0: Int64,
                           page: Int32, num_tokens: Int64):
        """L2 prefetch of one tile's rows (``Tuning.prefetch_rows``), each thread its share as
        :meth:`prefetch_row_owner` / :meth:`prefetch_row` say; invalid tokens none."""
        if cutlass.const_expr(self.tuning.prefetch_rows):
            idx_a, ok_a = self.resolve_index(raw_a, pos_a, num_tokens)
            idx_b, ok_b = self.resolve_index(raw_b, pos_b, num_tokens)
            if cutlass.const_expr(self.tuning.prefetch_lines):
                first = sub < 2
                idx = ptx.select_i32(first, idx_a, idx_b)
                ok = (first & ok_a) | ((sub >= 2) & ok_b)
            else:
                first = sub == 0
                idx = ptx.select_i32(first, idx_a, idx_b)
                ok = (first & ok_a) | ((sub == 1) & ok_b)
            if ok:
                self.prefetch_row(self.row_address(kv_base, stride0, page, idx), sub)

    def prefetch_row_owner(self, sub: Int32):
        """Which half's row a thread prefetches: half B when true. Bulk: ``sub`` 0 -> A, 1 -> B
        (2, 3 none); lines: ``sub`` 0, 1 -> A, 2, 3 -> B."""
        if self.tuning.prefetch_lines:
            return sub >= 2
        return sub == 1

    def prefetch_row(self, addr: Int64, sub: Int32):
        """This thread's share of one cache row into L2 (``Tuning.prefetch_rows``).

        Bulk (``prefetch_lines`` off): the whole 656-B row, evict_last with ``Tuning.l2_hints``.
        Lines: the row's 128-B lines at offsets ``(sub % 2) * 128 + {0, 256, 512}`` (the two
        threads of a row cover offsets 0..640, every line the row can touch).
        """
        if self.tuning.prefetch_lines:
            base = addr + Int64((sub % 2) * 128)
            for k in range(3):
                ptx.prefetch_l2_line(base + k * 256)
        elif self.tuning.l2_hints:
            ptx.prefetch_l2_bulk_policy(addr, TILE.row_bytes, ptx.l2_policy("evict_last"))
        else:
            ptx.prefetch_l2_bulk(addr, TILE.row_bytes)

    @cute.jit
    def next_tile(self, req: Int32, blk: Int32, stop: Int32, end_req: Int32):
        """The tile after (req, blk): (req, blk+1), else block 0 of the next request, else none."""
        nreq = req
        nblk = blk + 1
        has = cutlass.Boolean(True)
        if blk + 1 >= stop:
            nreq = req + 1
            nblk = Int32(0)
            has = req + 1 <= end_req
        return nreq, nblk, has

    @cute.jit
    def fetch_index(
        self, mIdx: cute.Tensor, req: Int32, s_idx: Int32, blk: Int32, half: int, tok_in_half: Int32,
        length: Int32, topk_blocks: Int32,
    ):
        """(raw index, position valid) of this thread's token in block ``blk`` of ``req``.

        The load is issued here; nothing consumes it until :meth:`resolve_index`. A position past
        the request's top-k length (or past topk) is invalid and is not loaded.
        """
        kpos = blk * TILE.tokens + half * 32 + tok_in_half
        raw = Int32(-1)
        if blk < topk_blocks:
            raw = mIdx[req, s_idx, kpos]
        return raw, (kpos < length) & (blk < topk_blocks)

    @cute.jit
    def resolve_index(self, raw: Int32, pos_ok, num_tokens: Int64):
        """(clamped token index, valid): -1 or any index outside [0, num_blocks*page_block_size) is
        invalid, like a position past the top-k length; invalid tokens read token 0 (a legal row)."""
        ok = pos_ok & (raw >= 0) & (Int64(raw) < num_tokens)
        return ptx.select_i32(ok, raw, 0), ok

    @cute.jit
    def issue_row_loads(self, regs: cute.Tensor, kv_base: Int64, stride0: Int64, page: Int32, idx: Int32, sub: Int32):
        """11 x 128-bit loads of this thread's slice of one 656-B row into ``regs`` (44 x i32)."""
        addr = self.row_address(kv_base, stride0, page, idx)
        for c in cutlass.range_constexpr(8):
            self.load_slot(regs, c, addr, sub)
        self.load_slot(regs, 8, addr, sub)
        for r in cutlass.range_constexpr(2):
            self.load_slot(regs, 9 + r, addr, sub)

    @cute.jit
    def row_address(self, kv_base: Int64, stride0: Int64, page: Int32, idx: Int32):
        """Global byte address of cache row ``idx`` (token index, already clamped to a legal row)."""
        blk = Uint32(idx) // Uint32(page)
        row = Uint32(idx) - blk * Uint32(page)
        return kv_base + Int64(blk) * stride0 + Int64(row) * TILE.row_bytes

    def load_slot(self, regs: cute.Tensor, slot: int, addr: Int64, sub: Int32):
        """One 16-B load of this thread's slice of the row at ``addr`` into ``regs``.

        slot 0-7: fp8 bytes ``[64*slot + 16*sub, +16)`` -> regs[4*slot, +4); slot 8: the 4 scales
        -> regs[32, +4); slot 9/10: RoPE bytes ``[528 + 32*sub + 16*(slot-9), +16)`` -> regs[36 + 4*(slot-9), +4).
        (A plain function: inlined at trace time, ``slot`` is a Python int.)
        """
        if slot < 8:
            off = slot * TILE.chunk + sub * 16
            base = slot * 4
        elif slot == 8:
            off = TILE.scale_offset
            base = 32
        else:
            off = TILE.rope_offset + sub * 32 + (slot - 9) * 16
            base = 36 + (slot - 9) * 4
        if self.tuning.l2_hints:
            # The policy register is made once per load site: createpolicy is a single ALU op.
            v = ptx.ld_global_v4_policy(addr + off, ptx.l2_policy("evict_last"), self.tuning.gather_l1, self.tuning.gather_l2)
        else:
            v = ptx.ld_global_v4(addr + off, self.tuning.gather_l1, self.tuning.gather_l2)
        for e in range(4):
            regs[base + e] = ptx.vec_elem(v, e)

    @cute.jit
    def convert_and_store(self, regs: cute.Tensor, ok, half_base: Int32, tok_in_half: Int32, sub: Int32, swz: Int32):
        """Dequantize one thread's slice of a row and write it into the SW128 K-major tile.

        Byte offset of 16-B chunk j of 64-dim column block c of token t:
        ``c*8192 + t*128 + ((j ^ (t & 7)) << 4)`` (= make_smem_layout_b(ROW_MAJOR, (64, 64, 576))).
        Invalid rows get zero scales and zero RoPE (the bit trick never makes NaN/Inf, so fp8 NaN
        bytes times 0 are 0; the exact path zeroes the fp8 words too), so their V rows are zero and
        cannot poison P V. Both paths give bf16(float(fp8) * scale) bit for bit, as the reference.
        """
        row_base = half_base + tok_in_half * 128
        off0 = ((2 * sub) ^ swz) << 4
        off1 = ((2 * sub + 1) ^ swz) << 4
        sc = [Int32(0)] * 4
        fast = cutlass.Boolean(True)
        for k in cutlass.range_constexpr(4):
            sc[k] = ptx.select_i32(ok, regs[32 + k], 0)
            fast = fast & ptx.is_fast_scale(sc[k])
        # Warp-uniform choice: caches written with FlashMLA's recipe (power-of-two scales) take the
        # 4-op bit trick; any other scale takes the exact fp32 path (6 ops) for the whole warp.
        if cute.arch.vote_all_sync(fast):
            s2 = [Int32(0)] * 4
            for k in cutlass.range_constexpr(4):
                s2[k] = ptx.scale_to_bf16x2_times_2pow120(sc[k])
            for c in cutlass.range_constexpr(8):
                o = [Int32(0)] * 8
                for e in cutlass.range_constexpr(4):
                    o[2 * e], o[2 * e + 1] = ptx.fp8x4_to_bf16x4_pow2(regs[c * 4 + e], s2[c // 2])
                cbase = row_base + c * TILE.chunk_bytes
                ptx.st_shared_v4(cbase + off0, o[0], o[1], o[2], o[3])
                ptx.st_shared_v4(cbase + off1, o[4], o[5], o[6], o[7])
        else:
            for c in cutlass.range_constexpr(8):
                o = [Int32(0)] * 8
                for e in cutlass.range_constexpr(4):
                    # fp8 NaN bytes of an invalid (clamped) row would survive a zero scale here.
                    w = ptx.select_i32(ok, regs[c * 4 + e], 0)
                    o[2 * e], o[2 * e + 1] = ptx.fp8x4_to_bf16x4_exact(w, sc[c // 2])
                cbase = row_base + c * TILE.chunk_bytes
                ptx.st_shared_v4(cbase + off0, o[0], o[1], o[2], o[3])
                ptx.st_shared_v4(cbase + off1, o[4], o[5], o[6], o[7])
        rbase = row_base + 8 * TILE.chunk_bytes
        r = [Int32(0)] * 8
        for e in cutlass.range_constexpr(8):
            r[e] = ptx.select_i32(ok, regs[36 + e], 0)
        ptx.st_shared_v4(rbase + off0, r[0], r[1], r[2], r[3])
        ptx.st_shared_v4(rbase + off1, r[4], r[5], r[6], r[7])

