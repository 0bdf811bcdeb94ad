"""The SM100 sparse prefill kernel's layouts, bundles and warp roles (``sparse_prefill.py`` holds the
host side, compile and launch).

A CTA is one query token x 64 heads. It walks its token's top-k list in 32-position tiles
(``ceil(length / 32)``, ``length`` = top-k or the token's ``topk_length`` clamped to [0, top-k];
none for an empty list). Four roles, each a loop over the same tiles:

* ``index_role`` (warp 6): per tile, the 32 positions' row coordinates (the index, or -1 for an
  invalid position: negative, ``>= s_kv`` or at / past ``length``) and a 32-bit validity word;
* ``gather_role`` (warp 5): Q once (TMA, ``d_qk / 64`` SW128 boxes), then per tile one
  ``tile::gather4`` per 4 rows and 64-dim column block straight into the K stage, the MMA's
  SW128 K-major operand (a coordinate of -1 is out of bounds: the TMA zero-fills that row, so an
  unread row's bytes, NaN or not, never reach the tile);
* ``mma_role`` (warp 4): QK (M = 64 heads, N = 32 positions, K = d_qk) into an S stage in TMEM,
  issued before PV of the previous tile; PV as two M = 64, N = 256 halves of O, V = the K stage's
  first 512 dims read MN-major;
* ``softmax_role`` (warps 0-3): S -> mask -> online softmax (log2 domain, FlashMLA's lazy rescale:
  O is rescaled in TMEM only when a row max grows by more than 2^6), bf16 P to shared memory; the
  epilogue (O / L with the sink, bf16 out by TMA stores staged in Q's bytes, lse, max_logits).

Pipelines (producer -> consumer, arrive counts per phase; CUTLASS pipeline objects):

* ``index`` (PipelineAsync, 6 stages): INDEX, 32 thread arrivals -> GATHER + SOFTMAX, 32 + 128;
* ``q`` (PipelineTmaUmma, 1 stage): GATHER, 1 arrive + d_qk * 128 tx bytes -> MMA (waits once; Q
  is loaded once per CTA and never released);
* ``k`` (PipelineTmaUmma, 4 stages): GATHER, 1 arrive + 32 * d_qk * 2 tx bytes (zero-filled rows
  count) -> MMA, ``tcgen05.commit`` after the tile's PV (QK reads K, PV reads it again as V);
* ``s`` (PipelineUmmaAsync, 2 stages, TMEM): MMA, ``tcgen05.commit`` after QK -> SOFTMAX, 128
  thread arrivals after ``tcgen05.wait::ld``;
* ``p`` (PipelineAsyncUmma, 1 stage): SOFTMAX, 128 arrivals (P in shared memory, O rescaled) ->
  MMA, ``tcgen05.commit`` after PV. Its empty phase doubles as "PV done": the softmax waits on it
  before it rescales O, before it rewrites P and before the epilogue reads O.

GATHER waits for the last ``k`` commits before it exits (``producer_tail``). Named barriers:
``Bar.TMEM`` (SOFTMAX + MMA, 160: TMEM address published; all TMEM use done before the dealloc),
``Bar.EPILOGUE`` (SOFTMAX, 128: O staged before the TMA stores).
"""

import functools
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync, tcgen05

from ...dsl.compat import tcgen05_fence_after_thread_sync, tcgen05_fence_before_thread_sync
from . import ptx
from .config import LAZY_RESCALE_LOG2, LN2, LOG2E, MAX_INIT, TMEM, Bar
# the decode kernel's MMA side: its operand layouts, P tile, output box and struct layout
from .cta import commit_p, cta_storage, operand_layouts, out_box_byte, smem_buffer, store_p_row
from .prefill_config import GATHER_L2, STAGES, TILE, WARPS, PrefillTile, Sm100SparsePrefillConfig, Warp

# --------------------------------------------------------------------------------------------------
# Layouts. The MMAs (the decode kernel's: M = 64, N = 32 QK; M = 64, N = 256, K = 32 PV) and the TMAs
# read CuTe layouts; the softmax warps write P and the output staging with 16-B stores at the decode
# kernel's byte formulas (tests/test_sparse_prefill_sm100_compile.py checks them and the K stage
# against the CuTe layouts, element by element; every tile base is 1024-B aligned).
# --------------------------------------------------------------------------------------------------


def staging_box_byte(tile: PrefillTile, r, col):
    """Byte offset of bf16 out[r, col] (col % 8 == 0) in the output staging: 16 boxes of 64 x 32
    (SW64, the decode kernel's box), box ``col // 32`` at 4 KiB steps."""
    return (col // tile.epi_cols) * tile.out_box_bytes + out_box_byte(r, col % tile.epi_cols)


def smem_layouts(qk, pv, tile: PrefillTile = TILE) -> dict:
    """Every shared-memory layout of the kernel (call inside a DSL trace): the MMA side's (Q, the
    K stages of d_qk dims, P, the V view over the K stages' first 512 dims, the output box) and
    one gather4 destination (32 rows x 64 dims, SW128: a K column block)."""
    L = operand_layouts(qk, pv, tile, STAGES, STAGES.k)
    L["kv_box"] = cute.tile_to_shape(
        tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, BFloat16), (tile.tokens, tile.chunk), (0, 1))
    return L


def gather_coord_layout(tile: PrefillTile) -> cute.Layout:
    """The gather4's index tensor: mode 0 a tile's row indices (the coordinate ring), mode 1 a
    row's ``d_qk`` columns, broadcast. The TMA tensor spans this shape: its (32, 64) tiles
    (:func:`kv_tiles`) are the K column blocks, tile (0, c) at column 64 c."""
    return cute.make_layout((tile.tokens, tile.d_qk), stride=(1, 0))


def make_gather_atom(kv: cute.Tensor, coord_ptr, tile: PrefillTile, kv_box):
    """(gather4 atom, TMA tensor) over the (s_kv, d_qk) rows (called in the host trace; the index
    tensor is needed there for its layout only: the kernel points it at the coordinate ring)."""
    return cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensor2DGather4G2SOp(), kv, kv_box, (tile.tokens, tile.chunk),
        gmem_coord_tensor=cute.make_tensor(coord_ptr, gather_coord_layout(tile)))


def kv_tiles(t: cute.Tensor, tile: PrefillTile) -> cute.Tensor:
    """The gather's TMA tensor (or its index tensor) as ((32, 64) box, (1, d_qk / 64) column blocks)."""
    return cute.zipped_divide(t, (tile.tokens, tile.chunk))


@functools.lru_cache(maxsize=None)
def shared_storage(tile: PrefillTile = TILE):
    """The CTA's shared memory (:func:`cta_storage`): the barriers, the coordinate / validity ring,
    then Q (later O's staging), four K stages and P."""
    buffers = {"sQ": smem_buffer(BFloat16, tile.q_elems), "sK": smem_buffer(BFloat16, STAGES.k * tile.k_stage_elems),
               "sP": smem_buffer(BFloat16, tile.p_elems)}
    return cta_storage(dict(q=STAGES.q, index=STAGES.index, k=STAGES.k, s=STAGES.s, p=STAGES.p), STAGES.index, buffers)


# --------------------------------------------------------------------------------------------------
# Bundles (built once in the kernel entry; Python objects, inlined at trace time)
# --------------------------------------------------------------------------------------------------


class Gmem(NamedTuple):
    """The global tensors, the TMA atoms that read or write them, and the launch's scalar."""

    tma_q: cute.CopyAtom
    mQ: cute.Tensor              # TMA view of q: (h, d_qk, s_q)
    tma_kv: cute.CopyAtom        # gather4 of kv rows, 4 rows x 64 dims per box
    mKVt: cute.Tensor            # TMA view of kv: (s_kv, d_qk)
    tma_out: cute.CopyAtom
    mOut: cute.Tensor            # TMA view of out: (h, 512, s_q)
    mKV: cute.Tensor             # (s_kv, d_qk) bf16 (its row count bounds the valid indices)
    mIdx: cute.Tensor            # (s_q, topk) int32
    mTopkLen: Optional[cute.Tensor]
    mSink: Optional[cute.Tensor]
    mMax: cute.Tensor            # (s_q, h) fp32
    mLse: cute.Tensor            # (s_q, h) fp32
    scale_log2: Float32          # softmax_scale * log2(e)


class Work(NamedTuple):
    """This CTA's token, 64-head block and tiles."""

    s_idx: Int32
    hblk: Int32
    length: Int32      # positions < length may be valid
    n_tiles: Int32


class Smem(NamedTuple):
    """The shared-memory struct and the tensors over it."""

    storage: object
    sQ: cute.Tensor
    sK: cute.Tensor
    sP: cute.Tensor
    sV: cute.Tensor
    sCoord: cute.Tensor
    sValid: cute.Tensor
    kv_box: cute.ComposedLayout    # one gather4 destination (a K column block)
    out_box: cute.ComposedLayout   # one output staging box


class Pipes(NamedTuple):
    """The CTA's pipelines (table in the module docstring)."""

    index: object
    q: object
    k: object
    s: object
    p: object


def make_pipes(storage, tile: PrefillTile) -> Pipes:
    """The pipelines over the struct's barriers (initialised by one thread; the caller fences and
    synchronizes the CTA once, ``defer_sync``)."""
    thr = pipeline.Agent.Thread
    index = pipeline.PipelineAsync.create(
        num_stages=STAGES.index, producer_group=pipeline.CooperativeGroup(thr, 32),
        consumer_group=pipeline.CooperativeGroup(thr, 32 + WARPS.softmax_threads),
        barrier_storage=storage.index_bar.data_ptr(), defer_sync=True)
    q = pipeline.PipelineTmaUmma.create(
        num_stages=STAGES.q, producer_group=pipeline.CooperativeGroup(thr),
        consumer_group=pipeline.CooperativeGroup(thr), tx_count=tile.q_elems * 2,
        barrier_storage=storage.q_bar.data_ptr(), defer_sync=True)
    k = pipeline.PipelineTmaUmma.create(
        num_stages=STAGES.k, producer_group=pipeline.CooperativeGroup(thr),
        consumer_group=pipeline.CooperativeGroup(thr), tx_count=tile.k_stage_bytes,
        barrier_storage=storage.k_bar.data_ptr(), defer_sync=True)
    s = pipeline.PipelineUmmaAsync.create(
        num_stages=STAGES.s, producer_group=pipeline.CooperativeGroup(thr),
        consumer_group=pipeline.CooperativeGroup(thr, WARPS.softmax_threads),
        barrier_storage=storage.s_bar.data_ptr(), defer_sync=True)
    p = pipeline.PipelineAsyncUmma.create(
        num_stages=STAGES.p, producer_group=pipeline.CooperativeGroup(thr, WARPS.softmax_threads),
        consumer_group=pipeline.CooperativeGroup(thr),
        barrier_storage=storage.p_bar.data_ptr(), defer_sync=True)
    return Pipes(index, q, k, s, p)


@cute.jit
def tiles_of(cfg: Sm100SparsePrefillConfig, mIdx: cute.Tensor, mTopkLen: Optional[cute.Tensor], s_idx: Int32):
    """(length, tiles) of token ``s_idx``: top-k, or its ``topk_length`` clamped to [0, top-k];
    ``ceil(length / 32)`` tiles (none for an empty list). Every role walks exactly these."""
    topk = mIdx.shape[1]
    length = Int32(topk)
    if cutlass.const_expr(cfg.has_topk_length):
        length = cutlass.max(cutlass.min(mTopkLen[s_idx], Int32(topk)), Int32(0))
    return length, (length + (TILE.tokens - 1)) // TILE.tokens


# --------------------------------------------------------------------------------------------------
# INDEX warp
# --------------------------------------------------------------------------------------------------


@cute.jit
def index_role(cfg: Sm100SparsePrefillConfig, g: Gmem, w: Work, smem: Smem, pipes: Pipes):
    """Per tile: lane l takes position l; coordinate = the index where valid, else -1 (zero fill);
    the validity word by ballot. The tile's index is loaded before its ring stage is waited for."""
    index_pipe = pipes.index
    tile = cfg.tile
    lane = cute.arch.lane_idx()
    s_kv = g.mKV.shape[0]
    idx_row = cute.make_tensor(g.mIdx.iterator + Int64(w.s_idx) * Int64(g.mIdx.stride[0]),
                               cute.make_layout(g.mIdx.shape[1]))
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.index)
    for t in cutlass.range(w.n_tiles, unroll=1):
        pos = t * tile.tokens + lane
        raw = idx_row[pos]     # positions < n_tiles * 32 <= top-k: in bounds
        ok = (pos < w.length) & (raw >= 0) & (raw < s_kv)
        index_pipe.producer_acquire(state)
        smem.sCoord[state.index * tile.tokens + lane] = cutlass.select_(ok, raw, Int32(-1))
        mask = cute.arch.vote_ballot_sync(ok)
        if lane == 0:
            smem.sValid[state.index] = Uint32(mask)
        index_pipe.producer_commit(state)
        state.advance()


# --------------------------------------------------------------------------------------------------
# GATHER warp
# --------------------------------------------------------------------------------------------------


@cute.jit
def gather_role(cfg: Sm100SparsePrefillConfig, g: Gmem, w: Work, smem: Smem, pipes: Pipes, qk_mma: cute.TiledMma):
    """Q once (none for an empty list: the MMA warp does not wait for it), then per tile one gather4
    per 4 rows and column block (``d_qk / 64`` column blocks x 8), coordinates from the ring."""
    index_pipe, q_pipe, k_pipe = pipes.index, pipes.q, pipes.k
    tile = cfg.tile
    if w.n_tiles > 0:
        thr_mma = qk_mma.get_slice(0)
        gQ = cute.local_tile(g.mQ[None, None, w.s_idx], (tile.heads, tile.d_qk), (w.hblk, 0))
        tQsQ, tQgQ = cpasync.tma_partition(g.tma_q, 0, cute.make_layout(1), cute.group_modes(smem.sQ, 0, 3),
                                           cute.group_modes(thr_mma.partition_A(gQ), 0, 3))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.q)
        q_pipe.producer_acquire(q_state)
        cute.copy(g.tma_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_pipe.producer_get_barrier(q_state))

    policy = GATHER_L2[cfg.tuning.gather_l2]
    coord_ptr = smem.storage.coord.data_ptr()
    k_ptr = smem.storage.sK.data_ptr()
    i_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.index)
    k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.k)
    for t in cutlass.range(w.n_tiles, unroll=1):
        index_pipe.consumer_wait(i_state)
        k_pipe.producer_acquire(k_state)
        bar = k_pipe.producer_get_barrier(k_state)
        gI = cute.make_tensor(coord_ptr + i_state.index * tile.tokens, gather_coord_layout(tile))
        for c in cutlass.range(tile.chunks, unroll=1):
            dst = cute.make_tensor(
                cute.recast_ptr(k_ptr + k_state.index * tile.k_stage_elems + c * tile.k_block_elems,
                                smem.kv_box.inner, dtype=BFloat16),
                smem.kv_box.outer)
            tS, tG, tI = cpasync.tma_partition(
                g.tma_kv, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                [kv_tiles(g.mKVt, tile), kv_tiles(gI, tile)])
            if cutlass.const_expr(policy is None):
                cute.copy(g.tma_kv, [tG[None, (0, c)], tI[None, 0]], tS, tma_bar_ptr=bar)
            else:
                cute.copy(g.tma_kv, [tG[None, (0, c)], tI[None, 0]], tS, tma_bar_ptr=bar, cache_policy=Int64(policy))
        # the issuing lane read the coordinates before this arrive
        index_pipe.consumer_release(i_state)
        i_state.advance()
        k_state.advance()
    # The MMA warp frees K stages with tcgen05.commit, an arrive that lands when the tensor core is
    # done: wait for the last ones, so that none reaches this CTA's shared memory after it exits.
    k_pipe.producer_tail(k_state)


# --------------------------------------------------------------------------------------------------
# MMA warp
# --------------------------------------------------------------------------------------------------


@cute.jit
def mma_role(cfg: Sm100SparsePrefillConfig, w: Work, smem: Smem, pipes: Pipes, qk_mma: cute.TiledMma,
             pv_mma: cute.TiledMma, tmem_ptr):
    """QK(i) is issued before PV(i - 1): the tensor core computes the next S while the softmax
    works on the current one (two S stages). Nothing at all for an empty list."""
    tile = cfg.tile
    tCrQ = qk_mma.make_fragment_A(smem.sQ)    # (MMA, 1, d_qk / 16, 1)
    tCrK = qk_mma.make_fragment_B(smem.sK)    # (MMA, 1, d_qk / 16, k stages)
    tOrP = pv_mma.make_fragment_A(smem.sP)    # (MMA, 1, 2, 1)
    tOrV = pv_mma.make_fragment_B(smem.sV)    # (MMA, 1, 2, half, k stages)
    s_layout = qk_mma.make_fragment_C(qk_mma.partition_shape_C((tile.heads, tile.tokens))).layout
    o_layout = pv_mma.make_fragment_C(pv_mma.partition_shape_C((tile.heads, tile.half_v))).layout

    if w.n_tiles > 0:
        mma_tiles(tile, w.n_tiles, pipes, qk_mma, pv_mma, (tCrQ, tCrK, tOrP, tOrV), s_layout, o_layout, tmem_ptr)


@cute.jit
def mma_tiles(tile: PrefillTile, n: Int32, pipes: Pipes, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, frags,
              s_layout: cute.Layout, o_layout: cute.Layout, tmem_ptr):
    """The MMA warp's walk over ``n`` > 0 tiles (Q waited for once, never released)."""
    tCrQ, tCrK, tOrP, tOrV = frags
    q_pipe, k_pipe, s_pipe = pipes.q, pipes.k, pipes.s
    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.q)
    kq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.k)
    kp_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.k)
    s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.s)
    p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.p)
    q_pipe.consumer_wait(q_state)
    for i in cutlass.range(n, unroll=1):
        # ---- S = Q K^T for tile i
        k_pipe.consumer_wait(kq_state)
        s_pipe.producer_acquire(s_state)
        tcgen05_fence_after_thread_sync()   # the softmax's tcgen05.ld of this stage is ordered before
        tStS = cute.make_tensor(tmem_ptr + TMEM.s_col + s_state.index * TMEM.s_cols, s_layout)
        for kb in cutlass.range_constexpr(tile.qk_steps):
            qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
            cute.gemm(qk_mma, tStS, tCrQ[None, None, kb, 0], tCrK[None, None, kb, kq_state.index], tStS)
        s_pipe.producer_commit(s_state)
        s_state.advance()
        kq_state.advance()
        # ---- O += P V for tile i - 1
        if i > 0:
            pv_mma = issue_pv(pv_mma, tOrP, tOrV, tmem_ptr, o_layout, i > 1, kp_state, p_state, pipes)
            kp_state.advance()
            p_state.advance()
    issue_pv(pv_mma, tOrP, tOrV, tmem_ptr, o_layout, n > 1, kp_state, p_state, pipes)


def issue_pv(pv_mma: cute.TiledMma, tOrP: cute.Tensor, tOrV: cute.Tensor, tmem_ptr, o_layout: cute.Layout, accumulate,
             kp_state, p_state, pipes: Pipes):
    """Both O halves (N = 256 each, lanes 0-15 / 16-31 of each slab) += P V, then release P and the
    K stage. ``accumulate`` is False for the first tile: O starts from P V (no zeroing pass)."""
    pipes.p.consumer_wait(p_state)
    tcgen05_fence_after_thread_sync()   # O may have been rescaled by the softmax warps (tcgen05.st)
    for h in range(2):
        tOtO = cute.make_tensor(tmem_ptr + TMEM.o_col + h * TMEM.o_upper_lane_offset, o_layout)
        for kb in range(TILE.pv_steps):
            pv_mma.set(tcgen05.Field.ACCUMULATE, accumulate if kb == 0 else True)
            cute.gemm(pv_mma, tOtO, tOrP[None, None, kb, 0], tOrV[None, None, kb, h, kp_state.index], tOtO)
    pipes.p.consumer_release(p_state)
    pipes.k.consumer_release(kp_state)
    # returned so the caller rebinds it: the ACCUMULATE field is state the loop carries
    return pv_mma


# --------------------------------------------------------------------------------------------------
# SOFTMAX warpgroup
# --------------------------------------------------------------------------------------------------


class TmemIO(NamedTuple):
    """The softmax warpgroup's TMEM access: 32x32b.x32 copies (thread t <-> TMEM lane t, register j
    = column j), the thread's partitions and its register tiles."""

    ld: object
    st: object
    tL: cute.Tensor       # source view of a load (add a column offset to its iterator)
    tSt: cute.Tensor      # destination view of a store
    cS: cute.Tensor       # (lane, column) of each register
    rS: cute.Tensor       # the tile's 32 S values
    rO: cute.Tensor       # 32 O columns

    def load(self, col, dst):
        cute.copy(self.ld, cute.make_tensor(self.tL.iterator + col, self.tL.layout), dst)

    def store(self, src, col):
        cute.copy(self.st, src, cute.make_tensor(self.tSt.iterator + col, self.tSt.layout))


@cute.jit
def tmem_io(tmem_ptr) -> TmemIO:
    tidx, _, _ = cute.arch.thread_idx()
    view = cute.make_tensor(tmem_ptr, cute.make_layout((128, TILE.epi_cols), stride=(1 << 16, 1)))
    ld = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32), view)
    st = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition.x32), Float32), view)
    thr_ld = ld.get_slice(tidx)
    cS = thr_ld.partition_D(cute.make_identity_tensor((128, TILE.epi_cols)))
    return TmemIO(ld, st, thr_ld.partition_S(view), st.get_slice(tidx).partition_D(view), cS,
                  cute.make_rmem_tensor(cS.shape, Float32), cute.make_rmem_tensor(cS.shape, Float32))


@cute.jit
def mask_and_max(io: TmemIO, r: cute.Tensor, valid: Uint32, scale_log2: Float32, m_tile: Float32):
    """``r`` (the tile's 32 positions) -> scaled logits (log2 units), -inf where ``valid``'s bit is
    clear; returns the tile max."""
    for j in cutlass.range_constexpr(cute.size(r)):
        ok = ((valid >> Uint32(io.cS[j][1])) & Uint32(1)) != Uint32(0)
        x = cutlass.select_(ok, r[j] * scale_log2, -Float32.inf)
        r[j] = x
        m_tile = cute.arch.fmax(m_tile, x)
    return m_tile


@cute.jit
def exp_and_sum(r: cute.Tensor, m_new: Float32, row_sum: Float32):
    for j in cutlass.range_constexpr(cute.size(r)):
        p = cute.math.exp2(r[j] - m_new, fastmath=True)
        r[j] = p
        row_sum += p
    return row_sum


@cute.jit
def softmax_role(cfg: Sm100SparsePrefillConfig, g: Gmem, w: Work, smem: Smem, pipes: Pipes, tmem_ptr):
    """Thread (warp w, lane l) owns TMEM lane 32 w + l: head row r = 16 w + l % 16 of S (lanes < 16)
    and of O, dims 256 (l // 16) + [0, 256). Row statistics live in lane l % 16; lanes >= 16 take
    them by shuffle. The running max ``m_run`` is lazy (it trails the true max by < 2^6); ``m_real``
    is the true one, for max_logits."""
    index_pipe, s_pipe, p_pipe = pipes.index, pipes.s, pipes.p
    lane = cute.arch.lane_idx()
    io = tmem_io(tmem_ptr)
    p_base = ptx.smem_addr(smem.storage.sP.data_ptr())
    scale_log2 = g.scale_log2

    i_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.index)
    s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES.s)
    p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES.p)
    m_run = Float32(MAX_INIT)   # finite: a fully masked tile never gives (-inf) - (-inf)
    m_real = -Float32.inf
    l_run = Float32(0.0)
    for i in cutlass.range(w.n_tiles, unroll=1):
        # ---- S tile -> registers, release the TMEM stage
        s_pipe.consumer_wait(s_state)
        tcgen05_fence_after_thread_sync()
        io.load(TMEM.s_col + s_state.index * TMEM.s_cols, io.rS)
        cute.arch.fence_view_async_tmem_load()
        tcgen05_fence_before_thread_sync()
        s_pipe.consumer_release(s_state)
        s_state.advance()
        index_pipe.consumer_wait(i_state)
        valid = smem.sValid[i_state.index]
        index_pipe.consumer_release(i_state)
        i_state.advance()

        # ---- mask, scale to log2 units, row max (a thread holds its whole row)
        m_tile = mask_and_max(io, io.rS, valid, scale_log2, -Float32.inf)
        m_real = cute.arch.fmax(m_real, m_tile)
        # Lazy rescale: keep the running max unless the tile max exceeds it by > 2^6.
        need = m_tile > m_run + Float32(LAZY_RESCALE_LOG2)
        m_new = cutlass.select_(need, m_tile, m_run)
        factor = cute.math.exp2(m_run - m_new, fastmath=True)
        row_sum = exp_and_sum(io.rS, m_new, Float32(0.0))
        l_run = l_run * factor + row_sum
        m_run = m_new
        need_any = cute.arch.vote_any_sync(need & (lane < 16))
        factor_row = cute.arch.shuffle_sync(factor, lane % 16)

        # ---- wait for PV(i - 1): P buffer free and O stable
        p_pipe.producer_acquire(p_state)
        tcgen05_fence_after_thread_sync()
        if need_any & (i > 0):
            for c in cutlass.range_constexpr(TMEM.o_cols // TILE.epi_cols):
                io.load(TMEM.o_col + c * TILE.epi_cols, io.rO)
                cute.arch.fence_view_async_tmem_load()
                for j in cutlass.range_constexpr(cute.size(io.rO)):
                    io.rO[j] = io.rO[j] * factor_row
                io.store(io.rO, TMEM.o_col + c * TILE.epi_cols)
            cute.arch.fence_view_async_tmem_store()
        # ---- P (bf16) -> sP row r (SW64 K-major), to the MMA warp
        if lane < 16:
            store_p_row(p_base, 16 * (cute.arch.thread_idx()[0] // 32) + lane, io.rS)
        commit_p(p_pipe, p_state)
        p_state.advance()

    # ---- the last PV: the phase the next P would wait on (an empty list: passes at once)
    p_pipe.producer_acquire(p_state)
    tcgen05_fence_after_thread_sync()
    epilogue(cfg, g, w, smem, io, m_run, m_real, l_run)


@cute.jit
def epilogue(cfg: Sm100SparsePrefillConfig, g: Gmem, w: Work, smem: Smem, io: TmemIO, m_run: Float32,
             m_real: Float32, l_run: Float32):
    """O / (L + 2^(sink log2e - m)) -> bf16, all 16 boxes staged at once in Q's bytes (every QK
    has retired), then 16 TMA stores by warp 0; lse = ln L + m ln 2 and max_logits = m_real ln 2
    by the row owners. An empty list never wrote O: its rows are written as zeros (L = 0: out 0,
    lse +inf, max_logits -inf). A list whose positions are all invalid ran PV with P = 0 on
    zero-filled rows: O = 0 exactly, and L = 0 gives the same."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    row = 16 * (tidx // 32) + lane % 16
    head = w.hblk * TILE.heads + row
    l_row = cute.arch.shuffle_sync(l_run, lane % 16)
    m_row = cute.arch.shuffle_sync(m_run, lane % 16)
    m_real_row = cute.arch.shuffle_sync(m_real, lane % 16)
    nonempty = l_row != Float32(0.0)

    o_scale = Float32(0.0)
    if nonempty:
        denom = l_row
        if cutlass.const_expr(cfg.has_attn_sink):
            # the sink is a logit with no value: it only enlarges the denominator (+inf: out 0)
            denom = l_row + cute.math.exp2(g.mSink[head] * Float32(LOG2E) - m_row, fastmath=True)
        o_scale = Float32(1.0) / denom
    lse = cutlass.select_(nonempty, (cute.math.log2(l_row, fastmath=True) + m_row) * Float32(LN2), Float32.inf)
    max_logit = cutlass.select_(nonempty, m_real_row * Float32(LN2), -Float32.inf)

    staging = ptx.smem_addr(smem.storage.sQ.data_ptr())
    col0 = cutlass.select_(lane >= 16, Int32(TILE.half_v), Int32(0))   # this thread's half of O
    io.rO.fill(0.0)
    for c in cutlass.range_constexpr(TMEM.o_cols // TILE.epi_cols):
        if w.n_tiles > 0:
            io.load(TMEM.o_col + c * TILE.epi_cols, io.rO)
            cute.arch.fence_view_async_tmem_load()
        for j in cutlass.range_constexpr(TILE.epi_cols // 8):
            v = [ptx.pack_bf16x2(io.rO[8 * j + 2 * e] * o_scale, io.rO[8 * j + 2 * e + 1] * o_scale) for e in range(4)]
            ptx.st_shared_v4(staging + staging_box_byte(TILE, row, col0 + c * TILE.epi_cols + 8 * j),
                             v[0], v[1], v[2], v[3])
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=Bar.EPILOGUE, number_of_threads=WARPS.softmax_threads)
    # Warp 0 issues the stores (cute.copy elects one lane: a warp-uniform branch), then waits until
    # the TMA has read the staging (the CTA's shared memory must outlive the reads).
    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == Warp.SOFTMAX:
        for b in cutlass.range_constexpr(TILE.out_boxes):
            sBox = cute.make_tensor(
                cute.recast_ptr(smem.storage.sQ.data_ptr() + b * (TILE.out_box_bytes // 2), smem.out_box.inner,
                                dtype=BFloat16),
                smem.out_box.outer)
            gBox = cute.local_tile(g.mOut[None, None, w.s_idx], (TILE.heads, TILE.epi_cols), (w.hblk, b))
            tS, tG = cpasync.tma_partition(g.tma_out, 0, cute.make_layout(1), cute.group_modes(sBox, 0, 2),
                                           cute.group_modes(gBox, 0, 2))
            cute.copy(g.tma_out, tS, tG)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)
    if lane < 16:
        g.mLse[w.s_idx, head] = lse
        g.mMax[w.s_idx, head] = max_logit
