"""Index compaction for the SM90 producer: K tiles of valid tokens only.

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
  ring (:class:`~.config.Tile`). Entries are read (:func:`ring_index`) only for tiles after T once
  T's iteration has run its scan steps (T+1's rows, T+2's prefetch): T's own entries may already
  be overwritten by then. The steps of T+1's iteration, which write further, come after its first
  barrier, which every thread reaches only after its reads of T's iteration.
* ``ends`` bit ``T % 32`` marks tile T as its request's last; the consumer warp groups read that
  flag beside the tile's mask (``tile_info``) to end their loop over the request.

The scan state, carried through the producer's loops as separate values (in this order):
``(req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next)``: the request being
scanned, its next chunk position and end, whether it has blocks here, the ring position its tiles
start at, the ring tail, the last-tile mask, the counts slot, whether a request is left, and this
thread's raw indices of the next two chunks of the request (loaded one and two steps earlier, so
steps that run back to back, as at a partition's start, do not wait an index round trip each).

The extra pool (V4): a request's piece is scanned as two segments, its main list's positions,
then its extra list's (the schedule's blocks come in that order), with no padding between them:
the two lists share the request's tiles. Extra positions are carried offset by ``EXTRA_BASE``
(``pos >= EXTRA_BASE`` is the extra segment; a chunk never spans both), and an extra token enters
the ring encoded as ``-2 - index`` (-1 stays the padding), which :func:`ring_index` hands to the
producer's ``row_address`` as is.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from ...dsl import ptx
from .config import TILE, Bar, Sm90SparseDecodeConfig
from .cta import Cta, Gmem, request_id, request_range

RING_MASK = TILE.ring_entries - 1
EXTRA_BASE = 1 << 30   # extra-segment positions are carried as EXTRA_BASE + position (module docstring)
assert TILE.ring_entries & RING_MASK == 0, "ring_entries must be a power of two"
assert TILE.scan_chunk == TILE.threads_per_wg, "one scanned position per producer thread"
# A step starts with tail < 64 (T + tiles_ahead) and writes below that + scan_chunk (a request end
# pads to <= that bound, rounded to a tile); entries from 64 (T + 1) on may still be read.
assert TILE.ring_entries >= (TILE.tiles_ahead - 1) * TILE.tokens + TILE.scan_chunk, "ring too small"
assert TILE.scan_chunk % TILE.tokens == 0, "a request end pads to a tile boundary inside one step"
assert TILE.scan_count_words == 2 * (TILE.threads_per_wg // 32), "two slots of one count per warp (a slot: one 16-B load)"
# The last-tile flag of tile T is read when T is handed over: T+1 must be queued by then (a request
# can end at T only once a later position is scanned), hence at least two tiles ahead.
assert TILE.tiles_ahead >= 2, "the last-tile flag needs tile T+1 queued"
# ``ends`` keeps one bit per queued tile (bit T % 32): the queued tiles plus one step's worth must
# not alias a bit still pending.
assert TILE.tiles_ahead + TILE.scan_chunk // TILE.tokens <= 32, "ends bits would alias"


class ScanThread(NamedTuple):
    """A producer thread's place in the scan: its position in a chunk, lane, warp, the shared
    addresses of the ring and of the two warp-count slots, and the named barrier of its warp
    group's scan."""

    ptid: Int32
    lane: Int32
    warp: Int32
    ring_base: Int32
    counts_base: Int32
    bar: object = int(Bar.INDEX_SCAN)


def scan_smem(storage, copy=0):
    """(ring base, warp-counts base) shared addresses of a shared-storage struct; ``copy``: the
    producer warp group's (two producers each run the scan on their own ring and counts)."""
    return (storage.ring.data_ptr().toint() + copy * (TILE.ring_entries * 4),
            storage.scan_counts.data_ptr().toint() + copy * (TILE.scan_count_words * 4))


assert Bar.INDEX_SCAN_B == Bar.INDEX_SCAN + 1, "the second producer's scan barrier follows the first's"


def scan_barrier(copy):
    """The named barrier of producer warp group ``copy``'s scan."""
    return Bar.INDEX_SCAN + copy


@cute.jit
def scan_request(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, req: Int32):
    """(first position, end position, has blocks) of ``req``'s first segment in this partition:
    its main list's positions, or its extra list's where the piece starts past the main blocks."""
    start, stop, n_main, length, extra_length = request_range(cfg, g, cta, req)
    pos = start * TILE.tokens
    if cutlass.const_expr(cfg.has_extra):
        end = cutlass.max(cutlass.min(cutlass.min(stop, n_main) * TILE.tokens, length), pos)
        if start >= n_main:
            pos, end = extra_segment(start, stop, n_main, extra_length)
    else:
        end = cutlass.max(cutlass.min(stop * TILE.tokens, length), pos)
    return pos, end, start < stop


@cute.jit
def extra_segment(start: Int32, stop: Int32, n_main: Int32, extra_length: Int32):
    """(first, end) offset positions (``EXTRA_BASE``) of the extra blocks of ``[start, stop)``."""
    first = (cutlass.max(start, n_main) - n_main) * TILE.tokens
    end = cutlass.max(cutlass.min((stop - n_main) * TILE.tokens, extra_length), first)
    return first + EXTRA_BASE, end + EXTRA_BASE


@cute.jit
def scan_fetch(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, req: Int32, pos: Int32, end: Int32, ptid: Int32,
               scanning):
    """This thread's raw index of the chunk at ``pos`` of the request at position ``req`` (-1 past
    ``end`` or once the scan is over).
    The load is only issued here; the next :func:`scan_step` consumes it."""
    raw = Int32(-1)
    if scanning & (pos + ptid < end):
        rid = request_id(cfg, g, req)
        if cutlass.const_expr(cfg.has_extra):
            if pos >= EXTRA_BASE:
                raw = g.mExtraIdx[rid, cta.s_idx, pos - EXTRA_BASE + ptid]
            else:
                raw = g.mIdx[rid, cta.s_idx, pos + ptid]
        else:
            raw = g.mIdx[rid, cta.s_idx, pos + ptid]
    return raw


@cute.jit
def pool_tokens(g: Gmem, extra):
    """Tokens of the pool a segment reads (``extra``: the extra pool's)."""
    num_tokens = Int64(g.mKV.shape[0]) * Int64(g.mKV.shape[1])
    if extra:
        num_tokens = Int64(g.mExtraKV.shape[0]) * Int64(g.mExtraKV.shape[1])
    return num_tokens


@cute.jit
def scan_step(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, st: ScanThread, state):
    """Append the valid indices of one chunk to the ring; close the request when its range ends.
    Takes and returns the scan state (module docstring); the next chunks' index loads are in
    flight when it returns."""
    req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next = state
    end_req = cta.sched[1]
    # Re-derived from the kernel parameters here rather than carried: the producer's 128
    # registers are tight around the streamed conversion.
    in_extra = cutlass.Boolean(False)
    if cutlass.const_expr(cfg.has_extra):
        in_extra = pos >= EXTRA_BASE
        num_tokens = pool_tokens(g, in_extra)
    else:
        num_tokens = Int64(g.mKV.shape[0]) * Int64(g.mKV.shape[1])
    ok = (pos + st.ptid < end) & (raw >= 0) & (Int64(raw) < num_tokens)
    ballot = cute.arch.vote_ballot_sync(ok)
    below = cute.arch.popc(ballot & cute.arch.lanemask_lt())
    slot = st.counts_base + parity * (TILE.scan_count_words // 2 * 4)
    if st.lane == 0:
        ptx.st_shared_i32(slot + st.warp * 4, cute.arch.popc(ballot))
    cute.arch.barrier(barrier_id=st.bar, number_of_threads=TILE.threads_per_wg)
    c = ptx.ld_shared_v4(slot)
    c0 = ptx.vec_elem(c, 0)
    c1 = ptx.vec_elem(c, 1)
    c2 = ptx.vec_elem(c, 2)
    c3 = ptx.vec_elem(c, 3)
    lower = ptx.select_i32(st.warp > 0, c0, 0) + ptx.select_i32(st.warp > 1, c1, 0) + ptx.select_i32(st.warp > 2, c2, 0)
    if ok:
        entry = raw
        if cutlass.const_expr(cfg.has_extra):
            entry = ptx.select_i32(in_extra, -2 - raw, raw)
        ptx.st_shared_i32(st.ring_base + ((tail + lower + Int32(below)) & RING_MASK) * 4, entry)
    tail = tail + c0 + c1 + c2 + c3
    parity = parity ^ 1
    pos = pos + TILE.scan_chunk
    scanning = cutlass.Boolean(True)
    changed = cutlass.Boolean(False)
    if cutlass.const_expr(cfg.has_extra):
        to_extra = cutlass.Boolean(False)
        if (pos >= end) & (pos < EXTRA_BASE):
            # The main segment is done: the piece's extra blocks (if any) come next, same request.
            start, stop, n_main, _, extra_length = request_range(cfg, g, cta, req)
            if stop > n_main:
                to_extra = cutlass.Boolean(True)
                changed = cutlass.Boolean(True)
                pos, end = extra_segment(start, stop, n_main, extra_length)
        closes = (pos >= end) & ~to_extra
    else:
        closes = pos >= end
    if closes:
        changed = cutlass.Boolean(True)
        if has:
            # Close the request: pad to a whole tile, and give an empty one its one tile.
            closed = cutlass.max((tail + (TILE.tokens - 1)) // TILE.tokens * TILE.tokens, r0 + TILE.tokens)
            if st.ptid < closed - tail:
                ptx.st_shared_i32(st.ring_base + ((tail + st.ptid) & RING_MASK) * 4, -1)
            ends = ends | (Uint32(1) << Uint32((closed // TILE.tokens - 1) % 32))
            tail = closed
        req = req + 1
        r0 = tail
        if req > end_req:
            scanning = cutlass.Boolean(False)
        else:
            pos, end, has = scan_request(cfg, g, cta, req)
    # raw_next holds the chunk now at ``pos`` unless the request changed.
    raw = raw_next
    if changed:
        raw = scan_fetch(cfg, g, cta, req, pos, end, st.ptid, scanning)
    raw_next = scan_fetch(cfg, g, cta, req, pos + TILE.scan_chunk, end, st.ptid, scanning)
    return req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next


@cute.jit
def scan_begin(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, ptid: Int32):
    """The scan state at the start of a partition, its first index loads issued."""
    begin_req = cta.sched[0]
    pos, end, has = scan_request(cfg, g, cta, begin_req)
    scanning = cutlass.Boolean(True)
    raw = scan_fetch(cfg, g, cta, begin_req, pos, end, ptid, scanning)
    raw_next = scan_fetch(cfg, g, cta, begin_req, pos + TILE.scan_chunk, end, ptid, scanning)
    return begin_req, pos, end, has, Int32(0), Int32(0), Uint32(0), Int32(0), scanning, raw, raw_next


@cute.jit
def scan_until(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta, st: ScanThread, state, target: Int32):
    """Run scan steps until ``target`` ring entries are queued or the partition is scanned,
    then the ``INDEX_SCAN`` barrier that makes the ring writes visible. Returns the new state."""
    req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next = state
    while scanning & (tail < target):
        req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next = scan_step(
            cfg, g, cta, st, (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next))
    cute.arch.barrier(barrier_id=st.bar, number_of_threads=TILE.threads_per_wg)
    return req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next


@cute.jit
def ring_index(cfg: Sm90SparseDecodeConfig, ring_base: Int32, p: Int32):
    """(token entry, valid) of ring entry ``p``: the padding (-1) reads as row 0 of the main
    pool; with the extra pool an entry ``<= -2`` is extra token ``-2 - entry`` (the producer's
    ``row_address`` decodes it)."""
    v = ptx.ld_shared_i32(ring_base + (p & RING_MASK) * 4)
    if cutlass.const_expr(cfg.has_extra):
        return ptx.select_i32(v == -1, 0, v), v != -1
    return cutlass.max(v, 0), v >= 0
