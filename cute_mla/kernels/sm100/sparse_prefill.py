"""SM100 (Blackwell, sm_100a) sparse MLA prefill over bf16 rows (``flash_mla_sparse_fwd``): the
kernel's host side, its entry, compile and launch.

NOT RUN ON HARDWARE. No Blackwell GPU was available while this was written: it is verified by CPU
compile tests (PTX checks, layout and budget checks) only. ``tests/test_sparse_prefill_sm100_gpu.py``
is the test to run first on an SM100 GPU; ``docs/sm100.md`` ("Sparse prefill") lists what to look at.

One CTA = 64 query heads of one query token; grid x = s_q * h_q / 64 (the token's two head-half
CTAs of h_q = 128 are neighbours, so the second one's gathers hit L2). No schedule, no split, no
workspace: a CTA walks its token's whole top-k list in 32-position tiles. 7 warps (224 threads, one
CTA per SM): SOFTMAX (warps 0-3), MMA (4), GATHER (5), INDEX (6); roles, pipelines and arrive
counts in ``prefill_roles.py``.

Tensor memory (512 columns allocated, 320 used): O (64 x 512 fp32) in columns [0, 256) as two
interleaved M = 64 N = 256 halves (lanes 0-15 / 16-31 of each slab), S stage j in columns
[256 + 32 j, 288 + 32 j): the decode kernel's plan. Shared memory (``smem_bytes``): Q (O's staging
at the end), 4 K stages of 32 x d_qk bf16, P 4 KiB, barriers and the coordinate ring: 226,304 B
of 232,448 at d_qk 576 (Q 72 KiB, K 4 x 36 KiB), 201,728 B at 512.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.cute.nvgpu import cpasync, tcgen05

from ...dsl.compat import SmemAllocator
from ...dsl.compile import CompiledKernel, compile_cached, compile_options
from .. import SparsePrefillTensors, prefill_entry
from .config import LOG2E, SMEM_LIMIT, TMEM, TMEM_COLUMNS
# the decode kernel's MMAs (M = 64, N = 32 QK; M = 64, N = 256, K = 32 PV) and TMEM hand-over
from .cta import allocate_tmem, free_tmem, permuted, release_tmem, take_tmem, tiled_mmas
from .prefill_config import (DEFAULT_TUNING, STAGES, TILE, WARPS, Config, PrefillTile, Sm100PrefillTuning,
                             Sm100SparsePrefillConfig, Tuning, Warp, config_for, kernel_config, tensor_maps,
                             tile_of_width)
from .prefill_roles import (Gmem, Smem, Work, gather_role, index_role, make_gather_atom, make_pipes, mma_role,
                            shared_storage, smem_layouts, softmax_role, tiles_of)

__all__ = ["Config", "Tuning", "Kernel", "Sm100SparsePrefillConfig", "Sm100PrefillTuning", "DEFAULT_TUNING",
           "PrefillTile", "TILE", "tile_of_width", "kernel_config", "config_for", "tensor_maps", "compile", "launch",
           "ENTRY", "smem_bytes", "tmem_columns"]


class Sm100SparsePrefill:
    """The kernel object given to ``cute.compile``: host ``__call__`` (layouts, TMA atoms, grid)
    and the device entry ``kernel``, which hands each warp its role."""

    def __init__(self, cfg: Sm100SparsePrefillConfig):
        self.cfg = cfg
        self.tile = cfg.tile

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,            # (s_q, h_q, d_qk) bf16
        kv: cute.Tensor,           # (s_kv, 1, d_qk) bf16
        indices: cute.Tensor,      # (s_q, 1, topk) int32
        topk_length: Optional[cute.Tensor],  # (s_q,) int32
        attn_sink: Optional[cute.Tensor],    # (h_q,) fp32
        out: cute.Tensor,          # (s_q, h_q, 512) bf16
        max_logits: cute.Tensor,   # (s_q, h_q) fp32
        lse: cute.Tensor,          # (s_q, h_q) fp32
        softmax_scale: Float32,
        stream,
    ):
        tile = self.tile
        kv, indices = prefill_entry.without_head_dim(kv), prefill_entry.without_head_dim(indices)
        qk_mma, pv_mma = tiled_mmas()
        L = smem_layouts(qk_mma, pv_mma, tile)

        # ---- TMA atoms (tensor maps): q, kv (gather4), out
        tma_q, q_tma = cute.nvgpu.make_tiled_tma_atom_A(
            cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE), permuted(q, (1, 2, 0)),
            cute.select(L["q"], mode=[0, 1, 2]), (tile.heads, tile.tokens, tile.d_qk), qk_mma,
        )
        tma_kv, kv_tma = make_gather_atom(kv, indices.iterator, tile, L["kv_box"])
        tma_out, out_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), permuted(out, (1, 2, 0)), L["out_box"], (tile.heads, tile.epi_cols)
        )
        scale_log2 = softmax_scale * Float32(LOG2E)
        grid = (q.shape[0] * self.cfg.n_hblk, 1, 1)
        self.kernel(
            qk_mma, pv_mma, tma_q, q_tma, tma_kv, kv_tma, tma_out, out_tma, kv, indices, topk_length, attn_sink,
            max_logits, lse, scale_log2, L["q"], L["k"], L["p"], L["v_outer"], L["v_swizzle"], L["kv_box"],
            L["out_box"],
        ).launch(grid=grid, block=[WARPS.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_kv: cute.CopyAtom,
        mKVt: cute.Tensor,
        tma_out: cute.CopyAtom,
        mOut: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],
        mMax: cute.Tensor,
        mLse: cute.Tensor,
        scale_log2: Float32,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        p_layout: cute.ComposedLayout,
        v_outer: cute.Layout,
        v_swizzle,
        kv_box: cute.ComposedLayout,
        out_box: cute.ComposedLayout,
    ):
        cfg = self.cfg
        tile = self.tile
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        s_idx = bidx // cfg.n_hblk
        hblk = bidx % cfg.n_hblk

        storage = SmemAllocator().allocate(shared_storage(tile))
        pipes = make_pipes(storage, tile)
        if warp == Warp.GATHER:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_kv)
        if warp == Warp.SOFTMAX:
            cpasync.prefetch_descriptor(tma_out)
        tmem = allocate_tmem(storage, Warp.MMA)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        smem = Smem(storage, storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner),
                    storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner),
                    storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner),
                    cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), v_swizzle, dtype=BFloat16), v_outer),
                    storage.coord.get_tensor(cute.make_layout(STAGES.index * tile.tokens)),
                    storage.valid.get_tensor(cute.make_layout(2 * STAGES.index)),
                    kv_box, out_box)
        g = Gmem(tma_q, mQ, tma_kv, mKVt, tma_out, mOut, mKV, mIdx, mTopkLen, mSink, mMax, mLse, scale_log2)
        length, n_tiles = tiles_of(cfg, mIdx, mTopkLen, s_idx)
        w = Work(s_idx, hblk, length, n_tiles)

        if warp == Warp.MMA:
            tmem_ptr = take_tmem(tmem, allocator=True)
            mma_role(cfg, w, smem, pipes, qk_mma, pv_mma, tmem_ptr)
            free_tmem(tmem, tmem_ptr)
        if warp == Warp.GATHER:
            gather_role(cfg, g, w, smem, pipes, qk_mma)
        if warp == Warp.INDEX:
            index_role(cfg, g, w, smem, pipes)
        if warp < Warp.MMA:
            tmem_ptr = take_tmem(tmem, allocator=False)
            softmax_role(cfg, g, w, smem, pipes, tmem_ptr)
            release_tmem()


# --------------------------------------------------------------------------------------------------
# Compile + launch (the launcher's contract)
# --------------------------------------------------------------------------------------------------

Kernel = Sm100SparsePrefill   # the registry's protocol: the object compiled, whose __call__ is the host entry

# The compiled entry's tensor parameters (SparsePrefillTensors fields), in order.
ENTRY = prefill_entry.ENTRY


def _fake_arguments(cfg: Sm100SparsePrefillConfig) -> list:
    """The compile's arguments: the entry's fake tensors, the scale and the stream."""
    return (prefill_entry.fake_tensors(cfg.h_q, cfg.tile.d_qk, cfg.tile.d_v, cfg.has_topk_length, cfg.has_attn_sink)
            + [Float32(1.0), prefill_entry.fake_stream()])


def smem_bytes(cfg: Optional[Sm100SparsePrefillConfig]) -> int:
    """Dynamic shared memory of one CTA, from the kernel's own struct (``None``: the d_qk 576 kernel's)."""
    return shared_storage(TILE if cfg is None else cfg.tile).size_in_bytes()


def tmem_columns(cfg: Optional[Sm100SparsePrefillConfig]) -> int:
    """Tensor-memory columns the kernel allocates (a power of two >= what its accumulators use)."""
    del cfg
    return TMEM.alloc


def compile(cfg: Sm100SparsePrefillConfig, dump_dir: Optional[str] = None) -> CompiledKernel:
    """Compile (once per ``cfg``) the SM100 sparse prefill kernel against fake tensors; needs no GPU."""
    assert smem_bytes(cfg) <= SMEM_LIMIT, f"shared memory {smem_bytes(cfg)} B > {SMEM_LIMIT} B"
    assert TMEM.used(STAGES.s) <= tmem_columns(cfg) <= TMEM_COLUMNS

    def build(dd):
        return cute.compile(Sm100SparsePrefill(cfg), *_fake_arguments(cfg), options=compile_options(cfg.arch, dd))

    return compile_cached(cfg.cache_key, build, dump_dir)


def _go(fn, q, kv, indices, topk_length, attn_sink, out, max_logits, lse, softmax_scale: float) -> None:
    if kv.shape[0] == 1 and kv.stride(0) % 8:
        # one row: its stride is free to the caller, but the gather4 tensor map takes it (16-B multiple)
        kv = kv.as_strided(tuple(kv.shape), (kv.shape[2], kv.shape[2], 1))
    fn(q, kv, indices, topk_length, attn_sink, out, max_logits, lse, softmax_scale)


assert tuple(inspect.signature(_go).parameters)[1:-1] == prefill_entry.ENTRY, "_go takes the entry's tensors in order"


def bind(compiled: CompiledKernel, cfg: Sm100SparsePrefillConfig, s_q: int, num_sms: int) -> Callable:
    """The launch of calls of ``s_q`` (>= 1) tokens on a device of ``num_sms`` SMs (a call
    signature's): a function of the entry's tensors (``ENTRY``, in order) and the softmax scale (a
    float) that launches on torch's current stream. Its grid (x = s_q * h_q / 64) follows from the
    tensors, so nothing is fixed here. No host sync, no allocation."""
    return functools.partial(_go, compiled.fn)


def launch(compiled: CompiledKernel, cfg: Sm100SparsePrefillConfig, t: SparsePrefillTensors) -> None:
    """Launch on torch's current stream: no host sync, no allocation. ``t``: the call's
    :class:`~cute_mla.kernels.SparsePrefillTensors` (heads already the kernel's), its optional
    fields None exactly where the config takes none (:func:`bind` for one call)."""
    bind(compiled, cfg, t.q.shape[0], 0)(*prefill_entry.entry_of(t), float(t.softmax_scale))
