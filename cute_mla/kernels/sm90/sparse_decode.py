"""SM90 (Hopper, sm_90a) sparse MLA decode: the kernel's host side, its entry, compile and launch.

One CTA = 64 query heads of one query token for one scheduler partition (``tile_md`` row). It walks
the partition's requests and, inside each request, 64-token K tiles of *valid* tokens (masked,
out-of-range and past-``topk_length`` positions are dropped by the producer's index scan), so a
request costs ``max(1, ceil(valid / 64))`` tiles, never more than its 64-position blocks.

Roles (384 threads, three warp groups; the swap-AB tile's 8-32 heads take 512, four, with two
producers: ``RegisterBudget.producers``; each role is a module that takes the config and the
bundles of ``cta.py``):

* WG0 ``Role.SOFTMAX`` (``softmax.py``): QK, the online softmax, PV of O's left columns, and the
  request's final normalisation; it hands P and the row factors to WG1.
* WG1 ``Role.PV_RIGHT`` (``pv.py``): PV of O's right columns.
* WG2 ``Role.PRODUCER`` (``producer.py``, ``index_scan.py``; ``crossover.py`` in cluster
  kernels): index compaction, row gather, FP8 dequant into the two K buffers. With two producers
  WG2 and WG3 each run the whole compaction and convert one half of every K tile.
* Both MMA warp groups store their half of O (``epilogue.py``).

The pipelines, named barriers and arrive counts are tabled in docs/architecture.md; in short:
``q_full`` (TMA -> WG0), ``k_full[2]`` (producers, 128 arrivals each, + 1 expect_tx in cluster kernels ->
WG0 and WG1), ``k_free[2]`` (WG0 + WG1, 256 arrivals -> producer), ``peer_free[2]`` (cluster
kernels: peer producer -> producer), named barriers ``P_READY`` / ``P_FREE`` / ``Q_FREE`` (WG0 <->
WG1), ``EPI_*`` (within an MMA warp group) and ``INDEX_SCAN`` (producer; ``INDEX_SCAN_B`` the
second one's).

h_q = 128 runs the token's two 64-head CTAs side by side in grid x, as a cluster of 2 that shares
each K tile (``Sm90Tuning.h128_cluster``); the plan's column pair runs an h_q = 64 split piece on a
cluster of 2 CTAs that each own 256 of the 512 output columns. Every CTA signals
``griddepcontrol.launch_dependents`` at its start, so the combine (launched with PDL) is scheduled
early and waits for this grid in ``griddepcontrol.wait``.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8
from cutlass.cute.nvgpu import cpasync

from ...dsl.compat import SmemAllocator, setmaxregister_decrease, setmaxregister_increase
from ...dsl.compile import CompiledKernel, compile_cached, compile_options
from ...dsl import ptx as common_ptx
from ...scheduler.partition import SCHED_ROW_INTS, SchedField
from ..combine import accum_type
from . import ptx
from .config import (ACCUM_DTYPE, DEFAULT_TUNING, TILE, Config, RegisterBudget, Role, Sm90SparseDecodeConfig,  # noqa: F401
                     Sm90Tuning, Stamp, Tuning, config_for, kernel_config, tensor_maps)
from .. import SparseDecodeTensors, entry_getter, fake_entry
from .crossover import producer_crossover
from .cta import Cta, Gmem, Smem, stamp, storage_of
from .epilogue import LOG2E, bf16_block_layout
from .mma import Ops, make_mmas, smem_layouts
from . import decode_small_roles as small
from . import swapped
from .producer import producer
from .pv import pv_right_wg
from .softmax import softmax_wg

assert max(SchedField.BEGIN_REQ, SchedField.END_REQ, SchedField.BEGIN_BLOCK, SchedField.END_BLOCK) < 4, \
    "the prologue reads a partition's request and block range in one 16-B load"

__all__ = ["Config", "Tuning", "Kernel", "Sm90SparseDecodeConfig", "Sm90Tuning", "DEFAULT_TUNING", "kernel_config", "config_for",
           "tensor_maps", "compile", "launch", "ENTRY"]


def heads_dims_first(t: cute.Tensor) -> cute.Tensor:
    """A (b, s_q, h, d) tensor viewed as (h, d, s_q, b): the TMA boxes tile heads x dims."""
    return cute.make_tensor(
        t.iterator,
        cute.make_layout((t.shape[2], t.shape[3], t.shape[1], t.shape[0]),
                         stride=(t.stride[2], t.stride[3], t.stride[1], t.stride[0])),
    )


def set_registers(budget: RegisterBudget, target: int) -> None:
    """``setmaxnreg`` of this warp group to ``target`` from the count every thread enters with
    (``budget.entry``): an increase above it, a decrease below. A plain function."""
    if target > budget.entry:
        setmaxregister_increase(target)
    elif target < budget.entry:
        setmaxregister_decrease(target)


class Sm90SparseDecode:
    """The kernel object given to ``cute.compile``: host ``__call__`` (layouts, TMA atoms, grid)
    and the device entry ``kernel``, which hands each warp group its role."""

    def __init__(self, cfg: Sm90SparseDecodeConfig):
        self.cfg = cfg

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,  # (b, s_q, h_q, d_qk) bf16
        k_cache: cute.Tensor,  # (num_blocks, page_block_size, row bytes) uint8
        indices: cute.Tensor,  # (b, s_q, topk) int32
        topk_length: Optional[cute.Tensor],  # (b,) int32
        attn_sink: Optional[cute.Tensor],  # (h_q,) fp32
        tile_md: cute.Tensor,  # (P, 8) int32
        accum_offsets: cute.Tensor,  # (b+1,) int32
        out: cute.Tensor,  # (b, s_q, h_q, 512) bf16
        lse: cute.Tensor,  # (b, s_q, h_q) fp32
        o_accum: Optional[cute.Tensor],  # (rows, s_q, h_q, 512) bf16
        lse_accum: Optional[cute.Tensor],  # (rows, s_q, h_q) fp32
        extra_k_cache: Optional[cute.Tensor],  # the extra pool (V4): (num_blocks', page', row bytes) uint8
        extra_indices: Optional[cute.Tensor],  # (b, s_q, extra_topk) int32
        extra_topk_length: Optional[cute.Tensor],  # (b,) int32
        request_order: Optional[cute.Tensor],  # (b,) int32, cfg.request_order only
        timeline: Optional[cute.Tensor],  # (grid x, grid y, Stamp.SLOTS) int64, Sm90Tuning.timeline only
        softmax_scale: Float32,
        stream,
    ):
        cfg = self.cfg
        tile = cfg.tile
        if cutlass.const_expr(cfg.swapped):   # the swap-AB tile: h heads on N (decode_small_roles.py)
            heads = cfg.h_q
            qk_mma, pv_rs_mma, pv_ss_mma = swapped.make_swapped_mmas(heads)
            q_layout, k_layout, p_layout = swapped.swapped_smem_layouts(tile, heads)
            chunk_layout = swapped.out_chunk_layout(heads)
            q_smem = q_layout
        else:
            heads = TILE.heads
            qk_mma, pv_rs_mma, pv_ss_mma = make_mmas(cfg.pv_cols)
            q_layout, k_layout, p_layout = smem_layouts(tile)
            # bf16 out / o_accum blocks are staged in 64 x 64 chunks (SW128 K-major atoms) and
            # stored by TMA one chunk (box) at a time.
            chunk_layout = bf16_block_layout(TILE.chunk)
            q_smem = cute.slice_(q_layout, (None, None, 0))
        chunk_box = (heads, TILE.chunk)

        # Q, out and o_accum as (h, d, s_q, b|rows) for TMA box grids of the CTA's heads: Q in
        # d_qk / 64 boxes of heads x 64 (SW128), out / o_accum in heads x 64-column boxes.
        tma_q, q_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), heads_dims_first(q), q_smem, (heads, tile.d_qk)
        )
        tma_out = None
        out_tma = out  # stored from the accumulator registers: no tensor map
        if cutlass.const_expr(not cfg.out_from_registers):
            tma_out, out_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), heads_dims_first(out), chunk_layout, chunk_box
            )
        tma_oacc = None
        oacc_tma = None
        if cutlass.const_expr(cfg.split):
            # The accumulator tensor map exists only in the split variant.
            tma_oacc, oacc_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), heads_dims_first(o_accum), chunk_layout, chunk_box
            )

        scale_log2 = softmax_scale * Float32(LOG2E)
        grid = (q.shape[1] * cfg.n_hblk * cfg.n_cblk, tile_md.shape[0], 1)
        self.kernel(
            qk_mma, pv_rs_mma, pv_ss_mma,
            tma_q, q_tma, tma_out, out_tma, tma_oacc, oacc_tma,
            k_cache, indices, topk_length, attn_sink, tile_md, accum_offsets, lse, lse_accum, timeline,
            extra_k_cache, extra_indices, extra_topk_length, request_order,
            scale_log2,
            q_layout, k_layout, p_layout, chunk_layout,
        ).launch(grid=grid, block=[cfg.tuning.registers.threads, 1, 1], stream=stream, min_blocks_per_mp=1,
                 cluster=[2, 1, 1] if cfg.cluster else None)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_rs_mma: cute.TiledMma,
        pv_ss_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_out: Optional[cute.CopyAtom],
        mOut: cute.Tensor,
        tma_oacc: Optional[cute.CopyAtom],
        mOAcc: Optional[cute.Tensor],
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],
        mTileMd: cute.Tensor,
        mAccumOffsets: cute.Tensor,
        mLse: cute.Tensor,
        mLseAcc: Optional[cute.Tensor],
        mTimeline: Optional[cute.Tensor],
        mExtraKV: Optional[cute.Tensor],
        mExtraIdx: Optional[cute.Tensor],
        mExtraLen: Optional[cute.Tensor],
        mOrder: Optional[cute.Tensor],
        scale_log2: Float32,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        p_layout: cute.ComposedLayout,
        chunk_layout: cute.ComposedLayout,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, part, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // TILE.threads_per_wg)
        s_idx = bidx // (cfg.n_hblk * cfg.n_cblk)
        hblk = bidx % cfg.n_hblk  # (0 in the column pair: n_hblk = 1)
        stamps = None
        if cutlass.const_expr(cfg.tuning.timeline):
            # This CTA's row of stamps.
            stamps = mTimeline.iterator.toint() + Int64(bidx * mTimeline.shape[1] + part) * Int64(8 * Stamp.SLOTS)
        early = Cta(part, s_idx, hblk, None, None, stamps)
        stamp(early, Stamp.ENTRY, tidx == 0)
        stamp(early, Stamp.ENTRY_NS, tidx == 0)

        smem = SmemAllocator()
        storage = smem.allocate(storage_of(cfg))
        md = self.prologue(storage, mTileMd, part, (tma_q, tma_out, tma_oacc))
        stamp(early, Stamp.PROLOGUE, tidx == 0)

        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)

        batch = mIdx.shape[0]
        topk = mIdx.shape[2]
        begin_req = common_ptx.vec_elem(md, SchedField.BEGIN_REQ)
        end_req = common_ptx.vec_elem(md, SchedField.END_REQ)
        first_blocks = (common_ptx.vec_elem(md, SchedField.BEGIN_BLOCK), common_ptx.vec_elem(md, SchedField.END_BLOCK))
        # An empty trailing partition has begin_req == b: nothing to do. (begin_req > end_req is
        # never emitted by the schedulers; skipping it keeps a malformed row from hanging the
        # producer's scan, which would wait for a tile that never comes.)
        if (begin_req < batch) & (begin_req <= end_req):
            stamp(early, Stamp.METADATA, tidx % TILE.threads_per_wg == 0)
            begin_block, end_block = first_blocks
            # begin_block: of begin_req; end_block: of end_req, exclusive; end_req: inclusive
            cta = Cta(part, s_idx, hblk, (begin_req, end_req, begin_block, end_block), topk, stamps)
            g = Gmem(tma_q, mQ, tma_out, mOut, tma_oacc, mOAcc, mKV, mIdx, mTopkLen, mSink, mTileMd, mAccumOffsets,
                     mLse, mLseAcc, mExtraKV, mExtraIdx, mExtraLen, mOrder)
            regs = cfg.tuning.registers
            if wg >= Role.PRODUCER:
                set_registers(regs, regs.producer)
                if cutlass.const_expr(cfg.cluster):
                    producer_crossover(cfg, g, cta)
                elif cutlass.const_expr(regs.producers == 2):
                    producer(cfg, g, cta, wg - Role.PRODUCER)
                else:
                    producer(cfg, g, cta)
            elif wg == Role.SOFTMAX:
                set_registers(regs, regs.softmax)
                if cutlass.const_expr(cfg.swapped):
                    small.softmax_wg(cfg, g, cta, Smem(storage, sQ, sK, sP),
                                     swapped.SwappedOps(qk_mma, pv_rs_mma, chunk_layout), scale_log2)
                else:
                    softmax_wg(cfg, g, cta, Smem(storage, sQ, sK, sP),
                               Ops(qk_mma, pv_rs_mma, pv_ss_mma, chunk_layout), scale_log2)
            else:
                set_registers(regs, regs.pv_right)
                if cutlass.const_expr(cfg.swapped):
                    small.pv_right_wg(cfg, g, cta, Smem(storage, sQ, sK, sP),
                                      swapped.SwappedOps(qk_mma, pv_ss_mma, chunk_layout))
                else:
                    pv_right_wg(cfg, g, cta, Smem(storage, sQ, sK, sP),
                                Ops(qk_mma, pv_rs_mma, pv_ss_mma, chunk_layout))
        if cutlass.const_expr(cfg.cluster):
            # Neither CTA of the pair exits while its peer may still write into its shared memory
            # or arrive on its barriers.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def prologue(self, storage, mTileMd: cute.Tensor, part: Int32, tmas):
        """Barrier inits, the partition row's first four words (returned as one vector), the
        cluster start, the PDL trigger and the prefetch of the TMA descriptors ``tmas`` (Q, out,
        o_accum; None where absent), then one CTA barrier."""
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        q_full = storage.q_full.data_ptr()
        k_full = storage.k_full.data_ptr()
        k_free = storage.k_free.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(q_full, 1)
            for i in cutlass.range_constexpr(TILE.k_bufs):
                # Cluster kernels: + 1 arrive.expect_tx for the bytes of the peer's bulk copies.
                cute.arch.mbarrier_init(k_full + i, TILE.threads_per_wg * cfg.tuning.registers.producers
                                        + (1 if cfg.cluster else 0))
                cute.arch.mbarrier_init(k_free + i, 2 * TILE.threads_per_wg)
                if cutlass.const_expr(cfg.cluster):
                    cute.arch.mbarrier_init(storage.peer_free.data_ptr() + i, 1)
        cute.arch.mbarrier_init_fence()
        # Words 0-3 (SchedField BEGIN_REQ .. END_BLOCK) of the partition's row in one 16-B load (rows are 32 B, 16-B aligned), issued
        # before the prologue's barriers so its L2 round trip overlaps them (in a cluster they
        # include the start-up cluster barrier, which waits for the peer CTA).
        md = ptx.ld_global_v4(mTileMd.iterator.toint() + Int64(part) * Int64(4 * mTileMd.stride[0]), "", "")
        if cutlass.const_expr(cfg.cluster):
            # The peer's barriers are initialised before any remote arrive / copy reaches them:
            # fence.mbarrier_init (above) releases the inits to the cluster, so the arrive may be
            # relaxed (PTX ISA, mbarrier init visibility); the default arrive's release costs a
            # MEMBAR.ALL.GPU, which waits for the tile_md load just issued.
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        # Programmatic dependent launch: the combine (launched with PDL after this kernel in the
        # split case) may be scheduled right away; it reads nothing before its griddepcontrol.wait,
        # which waits for this whole grid to complete and flush. Its CTAs can only take SMs this
        # grid leaves idle (a CTA here holds the whole register file), so they never delay us.
        cute.arch.griddepcontrol_launch_dependents()
        if tidx < 32:
            tma_q, tma_out, tma_oacc = tmas
            cpasync.prefetch_descriptor(tma_q)
            if cutlass.const_expr(tma_out is not None):
                cpasync.prefetch_descriptor(tma_out)
            if cutlass.const_expr(tma_oacc is not None):
                cpasync.prefetch_descriptor(tma_oacc)
        cute.arch.sync_threads()
        return md


# --------------------------------------------------------------------------------------------------
# Compile + launch (the launcher's contract)
# --------------------------------------------------------------------------------------------------


Kernel = Sm90SparseDecode   # the registry's protocol: the object compiled, whose __call__ is the host entry

# The compiled entry's tensor parameters (SparseDecodeTensors fields, then the instrumentation's
# ``timeline``), in order: the host entry's signature, the fake arguments and the launch follow it
# (tests/test_registry.py checks the first).
ENTRY = ("q", "k_cache", "indices", "topk_length", "attn_sink", "tile_md", "accum_offsets", "out", "lse", "o_accum",
         "lse_accum", "extra_k_cache", "extra_indices", "extra_topk_length", "request_order")
_entry_of = entry_getter(ENTRY)


def _fake_arguments(cfg: Sm90SparseDecodeConfig) -> list:
    """Fake tensors with symbolic dims/strides so one compile serves every shape (no GPU needed),
    in ``ENTRY`` order, then the timeline, the scale and the stream."""
    rt = cute.runtime
    b, s_q = cute.sym_int(), cute.sym_int()
    topk = cute.sym_int(divisibility=64)
    num_blocks, page = cute.sym_int(), cute.sym_int()
    parts, b1, rows = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def s64(div):
        return cute.sym_int64(divisibility=div)

    tile = cfg.tile
    f = {}
    f["q"] = rt.make_fake_tensor(BFloat16, (b, s_q, cfg.h_q, tile.d_qk), stride=(s64(8), s64(8), s64(8), 1),
                                 assumed_align=16)
    f["k_cache"] = rt.make_fake_tensor(Uint8, (num_blocks, page, tile.row_bytes), stride=(s64(16), tile.row_bytes, 1),
                                       assumed_align=16)
    f["indices"] = rt.make_fake_tensor(Int32, (b, s_q, topk), stride=(s64(1), s64(1), 1), assumed_align=4)
    if cfg.has_topk_length:
        f["topk_length"] = rt.make_fake_compact_tensor(Int32, (b,), assumed_align=4)
    if cfg.has_attn_sink:
        f["attn_sink"] = rt.make_fake_compact_tensor(Float32, (cfg.h_q,), assumed_align=4)
    f["tile_md"] = rt.make_fake_compact_tensor(Int32, (parts, SCHED_ROW_INTS), stride_order=(1, 0), assumed_align=16)
    f["accum_offsets"] = rt.make_fake_compact_tensor(Int32, (b1,), assumed_align=4)
    f["out"] = rt.make_fake_tensor(BFloat16, (b, s_q, cfg.h_q, TILE.d_v), stride=(s64(8), s64(8), s64(8), 1),
                                   assumed_align=16)
    f["lse"] = rt.make_fake_compact_tensor(Float32, (b, s_q, cfg.h_q), stride_order=(2, 1, 0), assumed_align=4)
    if cfg.split:
        f["o_accum"] = rt.make_fake_compact_tensor(accum_type(cfg.accum_dtype), (rows, s_q, cfg.h_q, TILE.d_v),
                                                   stride_order=(3, 2, 1, 0), assumed_align=16)
        f["lse_accum"] = rt.make_fake_compact_tensor(Float32, (rows, s_q, cfg.h_q), stride_order=(2, 1, 0),
                                                     assumed_align=4)
    timeline = None
    if cfg.tuning.timeline:
        timeline = rt.make_fake_compact_tensor(Int64, (cute.sym_int(), parts, int(Stamp.SLOTS)), stride_order=(2, 1, 0),
                                               assumed_align=8)
    if cfg.has_extra:
        f["extra_k_cache"] = rt.make_fake_tensor(Uint8, (cute.sym_int(), cute.sym_int(), tile.row_bytes),
                                                 stride=(s64(16), tile.row_bytes, 1), assumed_align=16)
        f["extra_indices"] = rt.make_fake_tensor(Int32, (b, s_q, cute.sym_int(divisibility=64)),
                                                 stride=(s64(1), s64(1), 1), assumed_align=4)
        if cfg.has_extra_topk_length:
            f["extra_topk_length"] = rt.make_fake_compact_tensor(Int32, (b,), assumed_align=4)
    if cfg.request_order:
        f["request_order"] = rt.make_fake_compact_tensor(Int32, (b,), assumed_align=4)
    stream = rt.make_fake_stream(use_tvm_ffi_env_stream=True)
    return fake_entry(ENTRY, f) + [timeline, Float32(1.0), stream]


def smem_bytes(cfg: Sm90SparseDecodeConfig) -> int:
    """Dynamic shared memory of one CTA: the kernel's shared-storage struct for the config's format
    (and pools)."""
    return storage_of(cfg).size_in_bytes()


def compile(cfg: Sm90SparseDecodeConfig, dump_dir: Optional[str] = None) -> CompiledKernel:
    """Compile (once per ``cfg``) the SM90 sparse decode kernel against fake tensors. Needs no GPU;
    any valid config compiles, ``cfg.tuning`` included (the variant seam)."""

    def build(dd):
        return cute.compile(Sm90SparseDecode(cfg), *_fake_arguments(cfg), options=compile_options(cfg.arch, dd))

    return compile_cached(("sm90_sparse_decode", cfg), build, dump_dir)


def launch(compiled: CompiledKernel, cfg: Sm90SparseDecodeConfig, t: SparseDecodeTensors, timeline=None) -> None:
    """Launch on torch's current stream. No host sync, no allocation.

    ``t``: the call's :class:`~cute_mla.kernels.SparseDecodeTensors`, its optional fields None
    exactly where the config takes none (the compiled signature keeps a None slot for them).
    ``timeline``: the stamp buffer of a kernel compiled with ``Sm90Tuning.timeline``
    (instrumentation only). Grid: x = s_q * ceil(h_q / 64) (x 2 in the column pair), y =
    tile_md.shape[0] (one CTA per 64 heads, or the swap-AB tile's 8-32, x token x partition, per
    column half in the column pair). A ``request_order`` kernel needs ``t.request_order``: its partition rows index positions in it.
    """
    if cfg.request_order and t.request_order is None:
        raise ValueError("request_order: this kernel's partition rows index positions in a request order (the plan's "
                         "balanced schedule); pass the schedule's request_order, got None")
    compiled.fn(*_entry_of(t), timeline, float(t.softmax_scale))
