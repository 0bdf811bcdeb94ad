"""Index compaction for the SM90 producer (``Tuning.compact_indices``): tiles of valid tokens only.

A top-k list with masked (-1) entries, out-of-range indices or positions past ``topk_length``
would otherwise cost a full 64-token tile per 64 positions, whatever is valid in it. Here the
producer warp group scans each request's positions of its partition in chunks of 128 (one
position per producer thread), keeps the valid token indices in order of position and appends
them to a shared-memory ring; tiles are cut from the ring 64 entries at a time. A request's last
tile is padded with -1 (invalid: zero row, masked logit), and a request whose range holds no valid
token still gets one all-invalid tile, so every request in the partition gets
``max(1, ceil(valid / 64))`` tiles (none when its block range is empty), never more than its blocks.

Softmax is order independent, so dropping invalid tokens and packing the rest changes nothing
but the rounding order of the sums.

Ring protocol (producer only; all 128 threads run every step together, so the scan state
``tail``, the request cursor and the ``ends`` mask are identical in every thread):

* a step: ballot of "valid" per warp -> each warp's lane 0 writes its count to
  ``scan_counts[parity][warp]`` -> named barrier ``INDEX_SCAN`` (128) -> every thread reads the four
  counts, writes its index at ``tail + (counts of lower warps) + (valid lanes below it)`` and adds
  the total to ``tail``. The counts alternate between two slots (``parity``): a fast thread's next
  write cannot hit a slot a slow thread has yet to read, the barrier in between orders them.
* after the steps of one tile, a second ``INDEX_SCAN`` barrier makes the ring writes visible to
  the threads that read them (each reads other threads' entries).
* tile T is complete once ``tail >= 64 (T + 1)``: requests end on a multiple of 64 (padding), and a
  step runs only while fewer than ``tiles_ahead`` tiles counting T are queued, which bounds the
  ring (:class:`Tile`). Entries are read (``ring_index``) only for tiles after T once T's
  iteration has run its scan steps (T+1's rows, T+2's prefetch; in the half-tile pipeline B(T)'s
  indices before the steps): T's own entries may already be overwritten by then. The steps of
  T+1's iteration, which write further, come after its first barrier, which every thread reaches
  only after its reads of T's iteration.
* ``ends`` bit ``T % 32`` marks tile T as its request's last; the consumer warp groups read that
  flag beside the tile's mask (``tile_info``) to end their loop over the request.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from . import ptx
from .sparse_decode_common import TILE, Bar, Stamp, Streaming

RING_MASK = TILE.ring_entries - 1
assert TILE.ring_entries & RING_MASK == 0, "ring_entries must be a power of two"
assert TILE.scan_chunk == TILE.threads_per_wg, "one scanned position per producer thread"
# A step starts with tail < 64 (T + tiles_ahead) and writes below that + scan_chunk (a request end
# pads to <= that bound, rounded to a tile); entries from 64 (T + 1) on may still be read.
assert TILE.ring_entries >= (TILE.tiles_ahead - 1) * TILE.tokens + TILE.scan_chunk, "ring too small"
assert TILE.scan_chunk % TILE.tokens == 0, "a request end pads to a tile boundary inside one step"
# The last-tile flag of tile T is read when T is handed over: T+1 must be queued by then (a request
# can end at T only once a later position is scanned), hence at least two tiles ahead.
assert TILE.tiles_ahead >= 2, "the last-tile flag needs tile T+1 queued"
# ``ends`` keeps one bit per queued tile (bit T % 32): the queued tiles plus one step's worth must
# not alias a bit still pending.
assert TILE.tiles_ahead + TILE.scan_chunk // TILE.tokens <= 32, "ends bits would alias"


class IndexScanMixin:
    @cute.jit
    def scan_request(self, req: Int32, sched, mTopkLen, topk: Int32):
        """(first position, end position, has blocks) of ``req``'s positions in this partition."""
        start, stop, length = self.request_range(req, sched, mTopkLen, topk)
        pos = start * TILE.tokens
        end = cutlass.max(cutlass.min(stop * TILE.tokens, length), pos)
        return pos, end, start < stop

    @cute.jit
    def scan_fetch(self, mIdx: cute.Tensor, req: Int32, s_idx: Int32, pos: Int32, end: Int32, ptid: Int32, scanning):
        """This thread's raw index of the chunk at ``pos`` (-1 past ``end`` or once the scan is over).
        The load is only issued here; the next :meth:`scan_step` consumes it."""
        raw = Int32(-1)
        if scanning & (pos + ptid < end):
            raw = mIdx[req, s_idx, pos + ptid]
        return raw

    @cute.jit
    def scan_step(self, req: Int32, pos: Int32, end: Int32, has, r0: Int32, tail: Int32, ends: Uint32, parity: Int32,
                  raw: Int32, raw_next: Int32, ptid: Int32, lane: Int32, warp: Int32, ring_base: Int32,
                  counts_base: Int32, mIdx: cute.Tensor, mTopkLen, sched, s_idx: Int32, topk: Int32,
                  mKV: cute.Tensor):
        """Append the valid indices of one chunk to the ring; close the request when its range ends.

        Scan state: the request being scanned (``req``), its next chunk position and end, whether
        it has blocks here, the ring position its tiles start at (``r0``), the ring ``tail``, the
        last-tile mask ``ends`` and the counts slot ``parity``; ``raw`` is this thread's index of
        the chunk at ``pos`` (loaded one step earlier) and, with ``Tuning.scan_two_ahead``,
        ``raw_next`` that of the chunk after it in the same request (loaded two steps earlier, so
        steps that run back to back, as at a partition's start, do not wait a load each). Returns
        the new state, ``scanning`` (a request is left) and the next chunks' raw indices (their
        loads in flight).
        """
        end_req = sched[1]
        # Re-derived from the kernel parameters here rather than carried: the producer's 128
        # registers are tight around the streamed conversion.
        num_tokens = Int64(mKV.shape[0]) * Int64(mKV.shape[1])
        ok = (pos + ptid < end) & (raw >= 0) & (Int64(raw) < num_tokens)
        ballot = cute.arch.vote_ballot_sync(ok)
        below = cute.arch.popc(ballot & cute.arch.lanemask_lt())
        slot = counts_base + parity * 16
        if lane == 0:
            ptx.st_shared_i32(slot + warp * 4, cute.arch.popc(ballot))
        cute.arch.barrier(barrier_id=Bar.INDEX_SCAN, number_of_threads=TILE.threads_per_wg)
        c = ptx.ld_shared_v4(slot)
        c0 = ptx.vec_elem(c, 0)
        c1 = ptx.vec_elem(c, 1)
        c2 = ptx.vec_elem(c, 2)
        c3 = ptx.vec_elem(c, 3)
        lower = ptx.select_i32(warp > 0, c0, 0) + ptx.select_i32(warp > 1, c1, 0) + ptx.select_i32(warp > 2, c2, 0)
        if ok:
            ptx.st_shared_i32(ring_base + ((tail + lower + Int32(below)) & RING_MASK) * 4, raw)
        tail = tail + c0 + c1 + c2 + c3
        parity = parity ^ 1
        pos = pos + TILE.scan_chunk
        scanning = cutlass.Boolean(True)
        changed = cutlass.Boolean(False)
        if pos >= end:
            changed = cutlass.Boolean(True)
            if has:
                # Close the request: pad to a whole tile, and give an empty one its one tile.
                closed = cutlass.max((tail + (TILE.tokens - 1)) // TILE.tokens * TILE.tokens, r0 + TILE.tokens)
                if ptid < closed - tail:
                    ptx.st_shared_i32(ring_base + ((tail + ptid) & RING_MASK) * 4, -1)
                ends = ends | (Uint32(1) << Uint32((closed // TILE.tokens - 1) % 32))
                tail = closed
            req = req + 1
            r0 = tail
            if req > end_req:
                scanning = cutlass.Boolean(False)
            else:
                pos, end, has = self.scan_request(req, sched, mTopkLen, topk)
        if cutlass.const_expr(self.tuning.scan_two_ahead):
            # raw_next holds the chunk now at ``pos`` unless the request changed.
            raw = raw_next
            if changed:
                raw = self.scan_fetch(mIdx, req, s_idx, pos, end, ptid, scanning)
            raw_next = self.scan_fetch(mIdx, req, s_idx, pos + TILE.scan_chunk, end, ptid, scanning)
        else:
            raw = self.scan_fetch(mIdx, req, s_idx, pos, end, ptid, scanning)
        return req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next

    def scan_smem(self):
        """(ring base, warp-counts base) shared addresses, rebuilt from the dynamic-smem symbol
        (a constant ptxas can re-create anywhere; see producer_setup)."""
        storage = self.shared_storage(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024))
        return storage.ring.data_ptr().toint(), storage.scan_counts.data_ptr().toint()

    @cute.jit
    def scan_begin(self, begin_req: Int32, sched, mTopkLen, topk: Int32, mIdx: cute.Tensor, s_idx: Int32, ptid: Int32):
        """The scan state at the start of a partition, its first index loads issued:
        (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) (see :meth:`scan_step`)."""
        pos, end, has = self.scan_request(begin_req, sched, mTopkLen, topk)
        scanning = cutlass.Boolean(True)
        raw = self.scan_fetch(mIdx, begin_req, s_idx, pos, end, ptid, scanning)
        raw_next = Int32(-1)
        if cutlass.const_expr(self.tuning.scan_two_ahead):
            raw_next = self.scan_fetch(mIdx, begin_req, s_idx, pos + TILE.scan_chunk, end, ptid, scanning)
        return begin_req, pos, end, has, Int32(0), Int32(0), Uint32(0), Int32(0), scanning, raw, raw_next

    @cute.jit
    def scan_until(self, state, target: Int32, ptid: Int32, lane: Int32, warp: Int32, ring_base: Int32,
                   counts_base: Int32, mIdx: cute.Tensor, mTopkLen, sched, s_idx: Int32, topk: Int32,
                   mKV: cute.Tensor):
        """Run scan steps until ``target`` ring entries are queued or the partition is scanned,
        then the ``INDEX_SCAN`` barrier that makes the ring writes visible. Returns the new state."""
        req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next = state
        while scanning & (tail < target):
            req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next = self.scan_step(
                req, pos, end, has, r0, tail, ends, parity, raw, raw_next, ptid, lane, warp, ring_base,
                counts_base, mIdx, mTopkLen, sched, s_idx, topk, mKV)
        cute.arch.barrier(barrier_id=Bar.INDEX_SCAN, number_of_threads=TILE.threads_per_wg)
        return req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next

    @cute.jit
    def ring_index(self, ring_base: Int32, p: Int32):
        """(token index clamped to a legal row, valid) of ring entry ``p``."""
        v = ptx.ld_shared_i32(ring_base + (p & RING_MASK) * 4)
        return cutlass.max(v, 0), v >= 0

    def converts_tile(self, t, tail, my_tiles):
        """Whether the producer converts tile ``t``: it is queued (``tail`` entries), and within
        ``my_tiles`` (None: no limit; Tuning.help_second_tile's partitions: 1). A plain function,
        inlined at trace time: without the knob the kernel keeps its one comparison."""
        queued = t * TILE.tokens < tail
        if my_tiles is None:
            return queued
        return queued & (t < my_tiles)

    @cute.jit
    def producer_compacted(self, mKV: cute.Tensor, mIdx: cute.Tensor, mTopkLen, sched, s_idx: Int32):
        """The half-tile software pipeline of :meth:`producer_half_pipelined` over compacted tiles.

        Tile T: B(T)'s loads are issued first, then the scan runs until ``tiles_ahead`` tiles past
        T are queued (or the partition is scanned), then A(T) is converted, A(T+1)'s loads issued,
        B(T) converted, the tile handed over with its last-tile flag, and tile T+2's rows
        bulk-prefetched into L2. With ``Streaming.BOTH`` both halves of tile T+1 are loaded slot by
        slot while tile T is converted (:meth:`convert_store_reload`) instead.
        """
        streamed = self.tuning.streaming == Streaming.BOTH
        begin_req = sched[0]
        (warp, lane, sub, tok_in_half, swz, topk, topk_blocks, kv_base, stride0, page, num_tokens,
         sk_base, info_base, k_full, k_free) = self.producer_setup(mKV, mIdx)
        ring_base, counts_base = self.scan_smem()
        ptid = warp * 32 + lane
        half_b = TILE.tokens // 2

        reg_a = cute.make_rmem_tensor(cute.make_layout(44), Int32)
        reg_b = cute.make_rmem_tensor(cute.make_layout(44), Int32)

        # ---- prologue: scan until tile 0 is queued, then issue its half-A loads
        scan = (mIdx, mTopkLen, sched, s_idx, topk, mKV)
        (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) = self.scan_until(
            self.scan_begin(begin_req, sched, mTopkLen, topk, mIdx, s_idx, ptid), TILE.tokens,
            ptid, lane, warp, ring_base, counts_base, *scan)
        self.stamp(Stamp.SCAN, ptid == 0)
        # Tuning.help_second_tile: a partition of exactly two tiles (128 entries queued, nothing
        # left to scan; the scan state is the same in every producer thread) leaves tile 1 to WG1.
        my_tiles = None   # tiles this warp group converts: all (None), or 1 when WG1 takes tile 1
        if cutlass.const_expr(self.help_second):
            help_second = (tail == 2 * TILE.tokens) & (not scanning)
            if ptid == 0:
                ptx.st_shared_i32(self.shared_storage(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024))
                                  .help_flag.data_ptr().toint(), ptx.select_i32(help_second, 1, 0))
            cute.arch.barrier_arrive(barrier_id=Bar.HELP, number_of_threads=2 * TILE.threads_per_wg)
            my_tiles = ptx.select_i32(help_second, 1, 0x7FFFFFFF)
        idx_a, ok_a = self.ring_index(ring_base, tok_in_half)
        idx_b, ok_b = self.ring_index(ring_base, half_b + tok_in_half)
        if tail > 0:
            self.issue_row_loads(reg_a, kv_base, stride0, page, idx_a, sub)
            if cutlass.const_expr(streamed):
                self.issue_row_loads(reg_b, kv_base, stride0, page, idx_b, sub)

        t = Int32(0)
        while self.converts_tile(t, tail, my_tiles):
            buf = t % TILE.k_bufs
            first = t * TILE.tokens
            if cutlass.const_expr(not streamed):
                idx_b, ok_b = self.ring_index(ring_base, first + half_b + tok_in_half)
                self.issue_row_loads(reg_b, kv_base, stride0, page, idx_b, sub)
            # Keep tiles T+1 and T+2 queued (loads of tile T are in flight meanwhile).
            (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) = self.scan_until(
                (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next),
                first + TILE.tiles_ahead * TILE.tokens, ptid, lane, warp, ring_base, counts_base, *scan)
            has_next = first + TILE.tokens < tail
            if cutlass.const_expr(my_tiles is not None):
                has_next = has_next & (t + 1 < my_tiles)

            cute.arch.mbarrier_wait(k_free + buf, ((t // TILE.k_bufs) & 1) ^ 1)
            self.stamp(Stamp.K_FREE, ptid == 0)
            tile_base = sk_base + buf * TILE.k_tile_bytes
            next_ok_a = cutlass.Boolean(False)
            next_ok_b = cutlass.Boolean(False)
            if cutlass.const_expr(streamed):
                # Each 16-B slot of tile T is re-loaded with tile T+1's row as soon as it is
                # converted (row 0, never stored, when there is no tile T+1).
                na_idx, na_ok = self.ring_index(ring_base, first + TILE.tokens + tok_in_half)
                nb_idx, nb_ok = self.ring_index(ring_base, first + TILE.tokens + half_b + tok_in_half)
                next_ok_a = na_ok & has_next
                next_ok_b = nb_ok & has_next
                na_addr = self.row_address(kv_base, stride0, page, ptx.select_i32(next_ok_a, na_idx, 0))
                nb_addr = self.row_address(kv_base, stride0, page, ptx.select_i32(next_ok_b, nb_idx, 0))
                self.convert_store_reload(reg_a, ok_a, tile_base, tok_in_half, sub, swz, na_addr)
                self.stamp(Stamp.HALF_A, ptid == 0)
                self.convert_store_reload(reg_b, ok_b, tile_base + half_b * 128, tok_in_half, sub, swz, nb_addr)
            else:
                self.convert_and_store(reg_a, ok_a, tile_base, tok_in_half, sub, swz)
                if has_next:
                    next_idx_a, next_ok_a = self.ring_index(ring_base, first + TILE.tokens + tok_in_half)
                    self.issue_row_loads(reg_a, kv_base, stride0, page, next_idx_a, sub)
                self.convert_and_store(reg_b, ok_b, tile_base + half_b * 128, tok_in_half, sub, swz)

            bit = Uint32(1) << Uint32(t % 32)
            self.hand_over_tile(ok_a, ok_b, lane, warp, info_base, buf, k_full, (ends & bit) != Uint32(0))
            self.stamp(Stamp.HANDED_OVER, ptid == 0)
            ends = ends & ~bit
            # Rows of tile T+2 into L2 (this thread's share: prefetch_row_owner / prefetch_row).
            if cutlass.const_expr(self.tuning.prefetch_rows):
                if first + 2 * TILE.tokens < tail:
                    in_b = self.prefetch_row_owner(sub)
                    p_idx, p_ok = self.ring_index(
                        ring_base, first + 2 * TILE.tokens + ptx.select_i32(in_b, half_b, 0) + tok_in_half)
                    takes = in_b | (sub == 0)
                    if cutlass.const_expr(self.tuning.prefetch_lines):
                        takes = cutlass.Boolean(True)
                    if p_ok & takes:
                        self.prefetch_row(self.row_address(kv_base, stride0, page, p_idx), sub)
            ok_a = next_ok_a
            if cutlass.const_expr(streamed):
                ok_b = next_ok_b
            t += 1
