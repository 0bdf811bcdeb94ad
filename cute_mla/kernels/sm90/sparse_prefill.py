"""SM90 (Hopper, sm_90a) sparse MLA prefill over bf16 rows (``flash_mla_sparse_fwd``): the kernel's
host side, its entry, compile and launch.

A work item = one query token's block of 64 heads (8, 16 or 32 heads: all of them), walking its
token's whole top-k list (no
schedule, no split). The grid is persistent: one CTA per SM walks items ``blockIdx.x + k *
gridDim.x`` (a token's head blocks consecutive, so the two head halves of h_q = 128 run side by
side and the second one's rows come from L2), and the producer gathers the next item's first
tiles while the MMA warp groups finish an item. The MMA side of 64 and 128 heads is FlashMLA's
ping-pong: the two MMA warp groups take the even and odd tiles of a pair, each owns half of O's
columns and they exchange the running max and P. Roles, pipelines, barriers and arrive counts:
``prefill_roles.py``; 8, 16 and 32 heads (``cfg.swapped``) run the swap-AB tile, whose MMA warp
groups are ``prefill_small_roles.py`` (the same producer and item walk; the producer gathers whole
tiles in order for it, and its K buffers are released by both groups).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...dsl.compat import SmemAllocator, setmaxregister_decrease, setmaxregister_increase
from ...archs import device_num_sms
from ...dsl.compile import CompiledKernel, compile_cached, compile_options
from .. import SparsePrefillTensors, prefill_entry
from .config import TILE, Role
from .epilogue import LOG2E, bf16_block_layout
from .mma import Ops, make_mmas, smem_layouts
from .prefill_config import (DEFAULT_TUNING, Config, Sm90PrefillTuning, Sm90SparsePrefillConfig,  # noqa: F401
                             Tuning, config_for, kernel_config, tensor_maps)
from .prefill_roles import (HALVES, K_FREE_ARRIVALS, K_FULL_ARRIVALS, Gmem, Smem, mma_wg0, mma_wg1, p_tensors, producer,
                            shared_storage, slot)
from . import prefill_small_roles as small
from . import swapped

__all__ = ["Config", "Tuning", "Kernel", "Sm90SparsePrefillConfig", "Sm90PrefillTuning", "DEFAULT_TUNING",
           "kernel_config", "config_for", "tensor_maps", "compile", "launch", "ENTRY"]


def heads_dims_tokens_rows(t: cute.Tensor) -> cute.Tensor:
    """q or out (s_q, h, d) as the decode kernel's (h, d, s_q, b) with one request (its Q load
    and output stores take them so): the TMA boxes tile heads x dims."""
    return cute.make_tensor(t.iterator, cute.make_layout((t.shape[1], t.shape[2], t.shape[0], 1),
                                                         stride=(t.stride[1], t.stride[2], t.stride[0], t.stride[0])))


class Sm90SparsePrefill:
    """The kernel object given to ``cute.compile``: host ``__call__`` (layouts, TMA atoms, grid)
    and the device entry ``kernel``, which hands each warp group its role."""

    def __init__(self, cfg: Sm90SparsePrefillConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        ctas: Int32,               # the persistent grid: at most the items, even (head halves side by side)
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
        cfg = self.cfg
        tile = cfg.tile
        kv, indices = prefill_entry.without_head_dim(kv), prefill_entry.without_head_dim(indices)
        heads = TILE.heads   # rows of the Q and out TMA boxes
        if cutlass.const_expr(cfg.swapped):
            # The swap-AB tile: QK and PV with the heads on N (both groups' PV is SS: WG0 takes
            # the first PV object, WG1 the second).
            heads = cfg.h_q
            qk_mma, pv_rs_mma, pv_ss_mma = swapped.make_swapped_mmas(cfg.h_q)
            q_layout, k_layout, p_layout = swapped.swapped_smem_layouts(tile, cfg.h_q)
            chunk_layout = swapped.out_chunk_layout(cfg.h_q)
        else:
            qk_mma, pv_rs_mma, pv_ss_mma = make_mmas(cfg.pv_cols)
            q_layout, k_layout, p_layout = smem_layouts(tile)
            chunk_layout = bf16_block_layout(TILE.chunk)

        if cutlass.const_expr(cfg.tuning.staging == "q_reload"):   # Q by 64-dim chunk (``load_q_chunk``)
            tma_q, q_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), heads_dims_tokens_rows(q), chunk_layout, (heads, TILE.chunk)
            )
        else:
            tma_q, q_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), heads_dims_tokens_rows(q),
                q_layout if cfg.swapped else cute.slice_(q_layout, (None, None, 0)), (heads, tile.d_qk)
            )
        tma_out, out_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), heads_dims_tokens_rows(out), chunk_layout, (heads, TILE.chunk)
        )
        scale_log2 = softmax_scale * Float32(LOG2E)
        grid = (ctas, 1, 1)
        self.kernel(
            qk_mma, pv_rs_mma, pv_ss_mma, tma_q, q_tma, tma_out, out_tma, kv, indices, topk_length, attn_sink,
            max_logits, lse, scale_log2, q_layout, k_layout, p_layout, chunk_layout,
        ).launch(grid=grid, block=[cfg.tuning.registers.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_rs_mma: cute.TiledMma,
        pv_ss_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
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
        chunk_layout: cute.ComposedLayout,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        wg = cute.arch.make_warp_uniform(tidx // TILE.threads_per_wg)

        storage = SmemAllocator().allocate(storage_struct(cfg))
        k_free_arrivals = small.K_FREE_ARRIVALS_SWAPPED if cfg.swapped else K_FREE_ARRIVALS
        if tidx == 0:
            cute.arch.mbarrier_init(storage.q_full.data_ptr(), 1)
            for b in cutlass.range_constexpr(TILE.k_bufs):
                for h in cutlass.range_constexpr(HALVES):
                    cute.arch.mbarrier_init(storage.k_full.data_ptr() + slot(b, h), K_FULL_ARRIVALS[h])
                    cute.arch.mbarrier_init(storage.k_free.data_ptr() + slot(b, h), k_free_arrivals[h])
        cute.arch.mbarrier_init_fence()
        if tidx < 32:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_out)
        cute.arch.sync_threads()

        if cutlass.const_expr(cfg.swapped):   # one P^T buffer (h x 64), read by both groups' PV
            sP0 = sP1 = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        else:
            sP0, sP1 = p_tensors(cfg.tile, storage, p_layout)
        smem = Smem(storage, storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner),
                    storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner), sP0, sP1)
        g = Gmem(tma_q, mQ, tma_out, mOut, mKV, mIdx, mTopkLen, mSink, mMax, mLse)
        # Every wgmma accumulates (S is zeroed before its QK); set here, above the role branches,
        # since both MMA warp groups issue all three.
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_rs_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_ss_mma.set(warpgroup.Field.ACCUMULATE, True)
        regs = cfg.tuning.registers   # softmax: WG0, pv_right: WG1
        if wg == Role.PRODUCER:
            setmaxregister_decrease(regs.producer)
            producer(cfg, g, smem)
        elif wg == Role.SOFTMAX:
            setmaxregister_increase(regs.softmax)
            if cutlass.const_expr(cfg.swapped):
                small.softmax_wg(cfg, g, smem, swapped.SwappedOps(qk_mma, pv_rs_mma, chunk_layout), scale_log2)
            else:
                mma_wg0(cfg, g, smem, Ops(qk_mma, pv_rs_mma, pv_ss_mma, chunk_layout), scale_log2)
        else:
            setmaxregister_increase(regs.pv_right)
            if cutlass.const_expr(cfg.swapped):
                small.pv_right_wg(cfg, g, smem, swapped.SwappedOps(qk_mma, pv_ss_mma, chunk_layout))
            else:
                mma_wg1(cfg, g, smem, Ops(qk_mma, pv_rs_mma, pv_ss_mma, chunk_layout), scale_log2)


# --------------------------------------------------------------------------------------------------
# Compile + launch (the launcher's contract)
# --------------------------------------------------------------------------------------------------

Kernel = Sm90SparsePrefill   # the registry's protocol: the object compiled, whose __call__ is the host entry

# The compiled entry's tensor parameters (SparsePrefillTensors fields), in order, then the grid.
ENTRY = prefill_entry.ENTRY


def _fake_arguments(cfg: Sm90SparsePrefillConfig) -> list:
    """The compile's arguments: the grid, the entry's fake tensors, the scale and the stream (the grid
    first, so that :func:`bind` fixes it with no frame of its own)."""
    return ([Int32(1)] + prefill_entry.fake_tensors(cfg.h_q, cfg.tile.d_qk, TILE.d_v, cfg.has_topk_length,
                                                     cfg.has_attn_sink)
            + [Float32(1.0), prefill_entry.fake_stream()])


def storage_struct(cfg: Sm90SparsePrefillConfig):
    """The shared-memory struct of the config's tile (swap-AB or ping-pong, with its staging)."""
    if cfg.swapped:
        return small.swapped_storage(cfg.tile, cfg.h_q)
    return shared_storage(cfg.tile, cfg.tuning.staging, cfg.tuning.lazy_max)


def smem_bytes(cfg: Sm90SparsePrefillConfig) -> int:
    """Dynamic shared memory of one CTA."""
    return storage_struct(cfg).size_in_bytes()


def compile(cfg: Sm90SparsePrefillConfig, dump_dir: Optional[str] = None) -> CompiledKernel:
    """Compile (once per ``cfg``) the SM90 sparse prefill kernel against fake tensors; needs no GPU."""

    def build(dd):
        return cute.compile(Sm90SparsePrefill(cfg), *_fake_arguments(cfg), options=compile_options(cfg.arch, dd))

    return compile_cached(("sm90_sparse_prefill", cfg), build, dump_dir)


def grid_ctas(cfg: Sm90SparsePrefillConfig, s_q: int, num_sms: int) -> int:
    """The persistent grid: one CTA per SM (its shared memory allows one), an even count so the
    head halves of a token run side by side, never more than the s_q * ceil(h_q / 64) items."""
    return max(1, min(s_q * cfg.n_hblk, num_sms // 2 * 2))


def bind(compiled: CompiledKernel, cfg: Sm90SparsePrefillConfig, s_q: int, num_sms: int) -> Callable:
    """The launch of calls of ``s_q`` (>= 1) tokens on a device of ``num_sms`` SMs, both fixed by a
    call signature: a function of the entry's tensors (``ENTRY``, in order) and the softmax scale
    (a float) that launches on torch's current stream, its grid (:func:`grid_ctas`) computed here,
    so that a call pays the compiled entry alone. No host sync, no allocation."""
    return functools.partial(compiled.fn, grid_ctas(cfg, s_q, num_sms))


def launch(compiled: CompiledKernel, cfg: Sm90SparsePrefillConfig, t: SparsePrefillTensors) -> None:
    """Launch on torch's current stream: no host sync, no allocation. ``t``: the call's
    :class:`~cute_mla.kernels.SparsePrefillTensors` (s_q >= 1), its optional fields None exactly
    where the config takes none (:func:`bind` for one call)."""
    bind(compiled, cfg, t.q.shape[0], device_num_sms(t.q.device))(*prefill_entry.entry_of(t), float(t.softmax_scale))
