"""h_q = 128 "crossover" producers (``Tuning.crossover``): a cluster of two CTAs shares each K tile.

The same producers serve ``Tuning.column_pair`` (h_q = 64 split): there the pair is the two
column-half CTAs of one 64-head piece instead of the two head halves; everything below holds as is.

The two 64-head CTAs of a query token (grid x neighbours, one cluster of 2) gather the same rows.
Without the crossover each gathers and dequantizes all 64 tokens of every tile. With it, CTA rank
``r`` gathers and dequantizes only tokens ``[32 r, 32 r + 32)`` into its own K buffer
(``st.shared``, ``fence.proxy.async``) and bulk-copies them (``cp.async.bulk`` shared::cta ->
shared::cluster, TMA unit) to the same place in its peer's buffer, with ``complete_tx`` on the
peer's ``k_full``: per half after a producer barrier (``Crossover.HALF_COPY``) or per warp and
column block right after writing it (``Crossover.WARP_COPIES``, ``WARP_COPIES_TWO_TILES``). Both
producers scan the whole top-k list (the scans depend only on inputs both CTAs share), so both
walk the same tiles and know every tile's mask and last-tile flag.

Per K buffer and use (tile T in buffer ``b = T % 2``), in each CTA (producer -> consumer, counts):

* ``k_full[b]``, count 129: the 128 local producer threads arrive after their stores and fences,
  plus producer thread 0's ``arrive.expect_tx`` of the peer's 36,864 bytes (32 rows x 1,152 B),
  which the peer's copies complete -> the local consumers (unchanged) wait on it.
* ``peer_free[b]``, count 1, peer producer -> local producer: "you may write tile T into my buffer
  b". After its own ``k_free[b]`` wait for T, producer thread 0 does the ``expect_tx`` above, then
  arrives (release, cluster scope) on the peer's ``peer_free[b]``; every producer thread waits on
  its own ``peer_free[b]`` (acquire, cluster scope; parity ``(T // 2) & 1``: every use is
  signalled, the first too) before writing anything of T. At most one phase can be ahead: the
  peer's signal for T + 2 needs its ``k_full`` for T, which needs this CTA's copies of T.
* The peer's ``complete_tx`` for T comes after the local ``expect_tx`` for T (thread 0 expects
  before it signals, the peer acquires the signal before copying), and never in T - 2's phase.
* A copy's source (this CTA's half of T in buffer b) is overwritten only for T + 2, after this
  CTA's ``peer_free[b]`` wait for T + 2; the peer signals that once its consumers have received
  all of T's bytes, so the copy has finished reading.

Cluster addresses: the peer's K buffers are ``mapa(sk_base, peer)`` plus the local offset inside
the same shared object (``PeerCopy.delta``; offsets within one object carry over to the peer's
copy of it), and its ``k_full`` array ``mapa(k_full, peer)`` plus ``b * 8``; computed once per CTA.
(98015aa mapped every address with its own ``mapa``; measured 4-6 % slower, b31fe34.) Both CTAs
leave through a cluster barrier, so neither exits while its peer may still copy into its shared
memory or arrive on its barriers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

from . import ptx
from .sparse_decode_common import TILE, Bar, Crossover
from .sparse_decode_producer import PeerCopy

HALF = TILE.tokens // 2  # rows each CTA of the pair gathers per tile
XOVER_TX_BYTES = HALF * TILE.d_qk * 2  # 36,864 (bf16): the peer's half of a K tile
PREFETCH_LINE_BYTES = 128  # L2 line: a 656-B row touches at most 6 (4 threads: 2 + 2 + 1 + 1)


class CrossoverMixin:
    @cute.jit
    def producer_crossover(self, mKV: cute.Tensor, mIdx: cute.Tensor, mTopkLen, sched, s_idx: Int32):
        """The streamed compacted producer (:meth:`producer_compacted`) over half tiles: this CTA's
        32 rows of each tile, stored locally and copied into the peer CTA (module docstring;
        ``Crossover.HALF_COPY`` or ``WARP_COPIES``)."""
        begin_req = sched[0]
        (warp, lane, sub, tok_in_half, swz, topk, topk_blocks, kv_base, stride0, page, num_tokens,
         sk_base, info_base, k_full, k_free) = self.producer_setup(mKV, mIdx)
        ring_base, counts_base = self.scan_smem()
        ptid = warp * 32 + lane
        rank = cute.arch.block_idx_in_cluster()
        peer = rank ^ 1
        mine = rank * HALF  # first token of this CTA's half in a tile
        other = HALF - mine
        # Cluster addresses for the per-warp copies: the peer's K buffers are ours plus ``delta``.
        delta = ptx.mapa_shared_cluster(sk_base, peer) - sk_base
        peer_k_full = ptx.mapa_shared_cluster(k_full.toint(), peer)

        reg = cute.make_rmem_tensor(cute.make_layout(44), Int32)

        # ---- prologue: scan until tile 0 is queued, then issue this CTA's rows of it
        scan = (mIdx, mTopkLen, sched, s_idx, topk, mKV)
        (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) = self.scan_until(
            self.scan_begin(begin_req, sched, mTopkLen, topk, mIdx, s_idx, ptid), TILE.tokens,
            ptid, lane, warp, ring_base, counts_base, *scan)
        idx, ok = self.ring_index(ring_base, mine + tok_in_half)
        _, ok_other = self.ring_index(ring_base, other + tok_in_half)
        if tail > 0:
            self.issue_row_loads(reg, kv_base, stride0, page, idx, sub)

        t = Int32(0)
        while t * TILE.tokens < tail:
            buf = t % TILE.k_bufs
            first = t * TILE.tokens
            (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) = self.scan_until(
                (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next),
                first + TILE.tiles_ahead * TILE.tokens, ptid, lane, warp, ring_base, counts_base, *scan)
            # Tile T+1's entries (tile T's were read an iteration ago: this iteration's scan steps
            # may already have overwritten them, the ring holds 256 entries).
            next_ok, n_ok_other, n_addr = self.half_tile_entries(
                ring_base, first + TILE.tokens, tail, mine, other, tok_in_half, kv_base, stride0, page)
            self.peer_handshake(t, ptid, k_full, k_free, peer)

            tile_base = sk_base + buf * TILE.k_tile_bytes
            half_base = tile_base + mine * TILE.chunk_row_bytes
            k_full_buf = k_full.toint() + buf * TILE.mbar_bytes
            if cutlass.const_expr(self.tuning.crossover == Crossover.WARP_COPIES):
                # Each warp copies its 8 rows of a column block as soon as it has written them.
                warp_base = half_base + warp * TILE.rows_per_warp * TILE.chunk_row_bytes
                self.convert_store_reload(reg, ok, half_base, tok_in_half, sub, swz, n_addr,
                                          PeerCopy(warp_base, delta, peer_k_full + buf * TILE.mbar_bytes, lane))
            else:  # HALF_COPY
                self.convert_store_reload(reg, ok, half_base, tok_in_half, sub, swz, n_addr)
                # The half is in shared memory and visible to the async proxy: one thread copies
                # its 9 column blocks (32 rows x 128 B each) into the peer's buffer.
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=Bar.XOVER_HALF, number_of_threads=TILE.threads_per_wg)
                if ptid == 0:
                    rmbar = ptx.mapa_shared_cluster(k_full_buf, peer)
                    for c in cutlass.range_constexpr(TILE.d_qk // TILE.chunk):
                        src = half_base + c * TILE.chunk_bytes
                        ptx.bulk_copy_to_peer(ptx.mapa_shared_cluster(src, peer), src, HALF * TILE.chunk_row_bytes, rmbar)

            ok_a, ok_b = self.tile_halves(rank, ok, ok_other)
            bit = Uint32(1) << Uint32(t % 32)
            self.hand_over_tile(ok_a, ok_b, lane, warp, info_base, buf, k_full, (ends & bit) != Uint32(0), fenced=True)
            ends = ends & ~bit
            # This CTA's rows of tile T+2 into L2 (the peer prefetches the other half).
            if cutlass.const_expr(self.tuning.prefetch_rows):
                if first + 2 * TILE.tokens < tail:
                    p_idx, p_ok = self.ring_index(ring_base, first + 2 * TILE.tokens + mine + tok_in_half)
                    if p_ok:
                        self.prefetch_half_row(self.row_address(kv_base, stride0, page, p_idx), sub)
            ok = next_ok
            ok_other = n_ok_other
            t += 1

    @cute.jit
    def half_tile_entries(self, ring_base: Int32, start: Int32, tail: Int32, mine: Int32, other: Int32,
                          tok_in_half: Int32, kv_base, stride0, page):
        """For the tile whose ring entries start at ``start`` (none if ``start >= tail``): whether
        this thread's token in this CTA's half is valid, whether its twin in the peer's half is, and
        the row address to load (row 0, never stored, when invalid)."""
        has = start < tail
        idx, ok = self.ring_index(ring_base, start + mine + tok_in_half)
        _, ok_other = self.ring_index(ring_base, start + other + tok_in_half)
        ok = ok & has
        return ok, ok_other & has, self.row_address(kv_base, stride0, page, ptx.select_i32(ok, idx, 0))

    @cute.jit
    def peer_handshake(self, t: Int32, ptid: Int32, k_full, k_free, peer: Int32):
        """Before writing tile ``t``: wait until this CTA's consumers freed its buffer, then thread 0
        expects the peer's bytes on ``k_full`` (one of the 129 arrivals, before the peer may send
        them) and tells the peer it may write into this CTA's buffer (``peer_free``, release,
        cluster scope); every thread then waits for the peer's same signal (acquire)."""
        buf = t % TILE.k_bufs
        storage = self.shared_storage(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024))
        peer_free = storage.peer_free.data_ptr().toint() + buf * TILE.mbar_bytes
        cute.arch.mbarrier_wait(k_free + buf, ((t // TILE.k_bufs) & 1) ^ 1)
        if ptid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(k_full + buf, XOVER_TX_BYTES)
            ptx.mbarrier_arrive_remote(ptx.mapa_shared_cluster(peer_free, peer))
        ptx.mbarrier_wait_acquire_cluster(peer_free, (t // TILE.k_bufs) & 1)

    def tile_halves(self, rank: Int32, ok, ok_other):
        """(half-A valid, half-B valid) of this thread's token pair: this CTA owns half ``rank``."""
        first = rank == 0
        return (first & ok) | ((rank != 0) & ok_other), (first & ok_other) | ((rank != 0) & ok)

    @cute.jit
    def prefetch_half_row(self, addr, sub: Int32):
        """The 128-B lines of one row into L2, spread over its 4 threads: ``sub`` s takes offsets
        128 s and, for s < 2, 512 + 128 s (0..640: every line a 656-B row can touch)."""
        line = PREFETCH_LINE_BYTES
        ptx.prefetch_l2_line(addr + cutlass.Int64(sub * line))
        if sub < 2:
            ptx.prefetch_l2_line(addr + cutlass.Int64(4 * line + sub * line))

    # ------------------------------------------------------------------ two tiles of rows in flight
    @cute.jit
    def producer_crossover2(self, mKV: cute.Tensor, mIdx: cute.Tensor, mTopkLen, sched, s_idx: Int32):
        """:meth:`producer_crossover` with per-warp copies and this CTA's rows of *two* tiles in
        flight (``Crossover.WARP_COPIES_TWO_TILES``): a half tile needs only one 44-register set, so
        tile T's set is re-loaded with tile T+2's rows while T is converted, and T+1's rows sit in
        the other set (loaded during T-1). Tiles alternate between the two sets, so the loop body
        handles two tiles. Rows of T+3 are prefetched into L2 when queued."""
        begin_req = sched[0]
        (warp, lane, sub, tok_in_half, swz, topk, topk_blocks, kv_base, stride0, page, num_tokens,
         sk_base, info_base, k_full, k_free) = self.producer_setup(mKV, mIdx)
        ring_base, counts_base = self.scan_smem()
        ptid = warp * 32 + lane
        mine = cute.arch.block_idx_in_cluster() * HALF
        other = HALF - mine

        reg_a = cute.make_rmem_tensor(cute.make_layout(44), Int32)
        reg_b = cute.make_rmem_tensor(cute.make_layout(44), Int32)

        # ---- prologue: scan until tiles 0 and 1 are queued, then issue this CTA's rows of both
        (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) = self.scan_until(
            self.scan_begin(begin_req, sched, mTopkLen, topk, mIdx, s_idx, ptid), 2 * TILE.tokens,
            ptid, lane, warp, ring_base, counts_base, mIdx, mTopkLen, sched, s_idx, topk, mKV)
        idx0, ok0 = self.ring_index(ring_base, mine + tok_in_half)
        _, oth0 = self.ring_index(ring_base, other + tok_in_half)
        has1 = TILE.tokens < tail
        idx1, ok1 = self.ring_index(ring_base, TILE.tokens + mine + tok_in_half)
        _, oth1 = self.ring_index(ring_base, TILE.tokens + other + tok_in_half)
        ok1 = ok1 & has1
        oth1 = oth1 & has1
        if tail > 0:
            self.issue_row_loads(reg_a, kv_base, stride0, page, idx0, sub)
            self.issue_row_loads(reg_b, kv_base, stride0, page, ptx.select_i32(ok1, idx1, 0), sub)

        t = Int32(0)
        while t * TILE.tokens < tail:
            (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next, ok0, oth0) = self.crossover_tile(
                reg_a, t, ok0, oth0, req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next,
                mIdx, mTopkLen, sched, s_idx, mKV)
            t += 1
            if t * TILE.tokens < tail:
                (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next, ok1, oth1) = self.crossover_tile(
                    reg_b, t, ok1, oth1, req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next,
                    mIdx, mTopkLen, sched, s_idx, mKV)
                t += 1

    @cute.jit
    def crossover_tile(self, reg: cute.Tensor, t: Int32, ok, oth, req, pos, end, has, r0, tail, ends, parity,
                       scanning, raw, raw_next, mIdx, mTopkLen, sched, s_idx, mKV):
        """One tile of :meth:`producer_crossover2`: keep the scan ``tiles_ahead`` tiles ahead,
        synchronise with the peer, convert this CTA's rows of tile T from ``reg`` (re-loading it
        with T+2's rows), copy them per warp to the peer, hand the tile over, prefetch T+3.
        Returns the scan state and (valid, peer half valid) of T+2 for this thread's token."""
        # Everything but the loop state is re-derived here from the thread index, the kernel
        # parameters and the shared-memory symbol: carried across the loop it spilled.
        (warp, lane, sub, tok_in_half, swz, topk, topk_blocks, kv_base, stride0, page, num_tokens,
         sk_base, info_base, k_full, k_free) = self.producer_setup(mKV, mIdx)
        ring_base, counts_base = self.scan_smem()
        ptid = warp * 32 + lane
        rank = cute.arch.block_idx_in_cluster()
        peer = rank ^ 1
        mine = rank * HALF
        other = HALF - mine
        buf = t % TILE.k_bufs
        first = t * TILE.tokens
        (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) = self.scan_until(
            (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next),
            first + TILE.tiles_ahead * TILE.tokens, ptid, lane, warp, ring_base, counts_base,
            mIdx, mTopkLen, sched, s_idx, topk, mKV)
        # Tile T+2's entries (queued: tiles_ahead = 3), read before the next iteration's scan steps.
        next_ok, n_oth, n_addr = self.half_tile_entries(
            ring_base, first + 2 * TILE.tokens, tail, mine, other, tok_in_half, kv_base, stride0, page)
        self.peer_handshake(t, ptid, k_full, k_free, peer)

        tile_base = sk_base + buf * TILE.k_tile_bytes
        self.convert_store_reload(reg, ok, tile_base + mine * TILE.chunk_row_bytes, tok_in_half, sub, swz, n_addr,
                                  k_full.toint() + buf * TILE.mbar_bytes)
        ok_a, ok_b = self.tile_halves(rank, ok, oth)
        bit = Uint32(1) << Uint32(t % 32)
        self.hand_over_tile(ok_a, ok_b, lane, warp, info_base, buf, k_full, (ends & bit) != Uint32(0), fenced=True)
        ends = ends & ~bit
        if cutlass.const_expr(self.tuning.prefetch_rows):
            if first + 3 * TILE.tokens < tail:
                p_idx, p_ok = self.ring_index(ring_base, first + 3 * TILE.tokens + mine + tok_in_half)
                if p_ok:
                    self.prefetch_half_row(self.row_address(kv_base, stride0, page, p_idx), sub)
        return req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next, next_ok, n_oth
