"""The crossover transport of the cluster kernels: two CTAs share each K tile.

At h_q = 128 (``Sm90Tuning.h128_cluster``) the pair is the two head-half CTAs of a query token; in
the column pair (h_q = 64 split, the plan's ``column_pair``) it is the two column-half CTAs of one
64-head piece. Everything below holds for both.

The two 64-head CTAs of a query token (grid x neighbours, one cluster of 2) gather the same rows.
Without the crossover each gathers and dequantizes all 64 tokens of every tile. With it, CTA rank
``r`` gathers and dequantizes only tokens ``[32 r, 32 r + 32)`` into its own K buffer
(``st.shared``, ``fence.proxy.async``) and bulk-copies them (``cp.async.bulk`` shared::cta ->
shared::cluster, TMA unit) to the same place in its peer's buffer, with ``complete_tx`` on the
peer's ``k_full``, per warp and column block right after writing it (4 x 9 copies of 1 KB per
V3.2 tile, 4 x 8 per V4 tile; one copy per half after a producer barrier measured slower, that
barrier's latency landing on every tile, and so did per-thread ``st.async``: docs/performance.md). Both
producers scan the whole top-k list (the scans depend only on inputs both CTAs share), so both
walk the same tiles and know every tile's mask and last-tile flag.

Per K buffer and use (tile T in buffer ``b = T % 2``), in each CTA (producer -> consumer, counts):

* ``k_full[b]``, count 129: the 128 local producer threads arrive after their stores and fences,
  plus producer thread 0's ``arrive.expect_tx`` of the peer's half tile (32 rows x 2 d_qk bytes),
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
copy of it), and its ``k_full`` array ``mapa(k_full, peer)`` plus ``b * 8``; computed once per CTA
(mapping every address with its own ``mapa`` measured slower, docs/performance.md). Both CTAs
leave through a cluster barrier, so neither exits while its peer may still copy into its shared
memory or arrive on its barriers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

from ...dsl import ptx as common_ptx
from . import ptx
from .config import TILE, Sm90SparseDecodeConfig
from .cta import Cta, Gmem, dyn_storage
from .index_scan import ScanThread, ring_index, scan_begin, scan_smem, scan_until
from .producer import (PeerCopy, ProducerThread, convert_store_reload, data_address, hand_over_tile, issue_row_loads,
                       producer_setup, row_address)

HALF = TILE.tokens // 2  # rows each CTA of the pair gathers per tile
PREFETCH_LINE_BYTES = 128  # L2 line: a row touches at most 6 (4 threads: 2 + 2 + 1 + 1)


def xover_tx_bytes(cfg: Sm90SparseDecodeConfig) -> int:
    """The peer's half of a K tile in bf16 bytes (V3.2: 36,864; V4: 32,768)."""
    return HALF * cfg.tile.d_qk * 2


@cute.jit
def producer_crossover(cfg: Sm90SparseDecodeConfig, g: Gmem, cta: Cta):
    """The producer of the cluster kernels: the compacted, streamed producer (``producer.py``)
    over half tiles, this CTA's 32 rows of each tile stored locally and copied into the peer CTA
    per warp and column block."""
    pt = producer_setup(cfg, g)
    ring_base, counts_base = scan_smem(dyn_storage(cfg))
    ptid = pt.warp * 32 + pt.lane
    st = ScanThread(ptid, pt.lane, pt.warp, ring_base, counts_base)
    rank = cute.arch.block_idx_in_cluster()
    peer = rank ^ 1
    mine = rank * HALF  # first token of this CTA's half in a tile
    other = HALF - mine
    # Cluster addresses for the per-warp copies: the peer's K buffers are ours plus ``delta``.
    delta = ptx.mapa_shared_cluster(pt.sk_base, peer) - pt.sk_base
    peer_k_full = ptx.mapa_shared_cluster(pt.k_full.toint(), peer)

    reg = cute.make_rmem_tensor(cute.make_layout(cfg.tile.slots_per_row), Int32)

    # ---- prologue: scan until tile 0 is queued, then issue this CTA's rows of it
    (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) = scan_until(
        cfg, g, cta, st, scan_begin(cfg, g, cta, ptid), TILE.tokens)
    idx, ok = ring_index(cfg, ring_base, mine + pt.tok_in_half)
    _, ok_other = ring_index(cfg, ring_base, other + pt.tok_in_half)
    if tail > 0:
        issue_row_loads(cfg, pt, reg, idx)

    t = Int32(0)
    while t * TILE.tokens < tail:
        buf = t % TILE.k_bufs
        first = t * TILE.tokens
        (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next) = scan_until(
            cfg, g, cta, st, (req, pos, end, has, r0, tail, ends, parity, scanning, raw, raw_next),
            first + TILE.tiles_ahead * TILE.tokens)
        # Tile T+1's entries (tile T's were read an iteration ago: this iteration's scan steps
        # may already have overwritten them, the ring holds 256 entries).
        next_ok, n_ok_other, n_addr = half_tile_entries(cfg, pt, ring_base, first + TILE.tokens, tail, mine, other)
        peer_handshake(cfg, pt, t, ptid, peer)

        tile_base = pt.sk_base + buf * cfg.tile.k_tile_bytes
        half_base = tile_base + mine * TILE.chunk_row_bytes
        # Each warp copies its 8 rows of a column block as soon as it has written them.
        warp_base = half_base + pt.warp * TILE.rows_per_warp * TILE.chunk_row_bytes
        convert_store_reload(cfg, pt, reg, ok, half_base, n_addr,
                             PeerCopy(warp_base, delta, peer_k_full + buf * TILE.mbar_bytes, pt.lane))

        ok_a, ok_b = tile_halves(rank, ok, ok_other)
        bit = Uint32(1) << Uint32(t % 32)
        hand_over_tile(pt, ok_a, ok_b, buf, (ends & bit) != Uint32(0), fenced=True)
        ends = ends & ~bit
        # This CTA's rows of tile T+2 into L2 (the peer prefetches the other half).
        if cutlass.const_expr(cfg.tuning.prefetch_rows):
            if first + 2 * TILE.tokens < tail:
                p_idx, p_ok = ring_index(cfg, ring_base, first + 2 * TILE.tokens + mine + pt.tok_in_half)
                if p_ok:
                    prefetch_half_row(cfg, row_address(cfg, pt, p_idx), pt.sub)
        ok = next_ok
        ok_other = n_ok_other
        t += 1


@cute.jit
def half_tile_entries(cfg: Sm90SparseDecodeConfig, pt: ProducerThread, ring_base: Int32, start: Int32, tail: Int32,
                      mine: Int32, other: Int32):
    """For the tile whose ring entries start at ``start`` (none if ``start >= tail``): whether
    this thread's token in this CTA's half is valid, whether its twin in the peer's half is, and
    the row address to load (row 0, never stored, when invalid)."""
    has = start < tail
    idx, ok = ring_index(cfg, ring_base, start + mine + pt.tok_in_half)
    _, ok_other = ring_index(cfg, ring_base, start + other + pt.tok_in_half)
    ok = ok & has
    return ok, ok_other & has, row_address(cfg, pt, common_ptx.select_i32(ok, idx, 0))


@cute.jit
def peer_handshake(cfg: Sm90SparseDecodeConfig, pt: ProducerThread, t: Int32, ptid: Int32, peer: Int32):
    """Before writing tile ``t``: wait until this CTA's consumers freed its buffer, then thread 0
    expects the peer's bytes on ``k_full`` (one of the 129 arrivals, before the peer may send
    them) and tells the peer it may write into this CTA's buffer (``peer_free``, release,
    cluster scope); every thread then waits for the peer's same signal (acquire)."""
    buf = t % TILE.k_bufs
    peer_free = dyn_storage(cfg).peer_free.data_ptr().toint() + buf * TILE.mbar_bytes
    cute.arch.mbarrier_wait(pt.k_free + buf, ((t // TILE.k_bufs) & 1) ^ 1)
    if ptid == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(pt.k_full + buf, xover_tx_bytes(cfg))
        ptx.mbarrier_arrive_remote(ptx.mapa_shared_cluster(peer_free, peer))
    ptx.mbarrier_wait_acquire_cluster(peer_free, (t // TILE.k_bufs) & 1)


def tile_halves(rank: Int32, ok, ok_other):
    """(half-A valid, half-B valid) of this thread's token pair: this CTA owns half ``rank``."""
    first = rank == 0
    return (first & ok) | ((rank != 0) & ok_other), (first & ok_other) | ((rank != 0) & ok)


@cute.jit
def prefetch_half_row(cfg: Sm90SparseDecodeConfig, addr, sub: Int32):
    """The 128-B lines of one row into L2, spread over its 4 threads: ``sub`` s takes offsets
    128 s and, for s < 2, 512 + 128 s (0..640: every line a V3.2 row can touch; a V4 data row
    ends before 640, so there sub 1 takes the row's scale line instead)."""
    line = PREFETCH_LINE_BYTES
    data = data_address(addr)
    ptx.prefetch_l2_line(data + cutlass.Int64(sub * line))
    if cutlass.const_expr(cfg.tile.fmt.scales_in_row):
        if sub < 2:
            ptx.prefetch_l2_line(data + cutlass.Int64(4 * line + sub * line))
    else:
        if sub == 0:
            ptx.prefetch_l2_line(data + cutlass.Int64(4 * line))
        elif sub == 1:
            ptx.prefetch_l2_line(data + cutlass.Int64(addr[1]))
