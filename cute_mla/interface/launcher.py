"""From a plan to launches: the kernels a plan names, compiled once per config, and the workspace.

This is the only place that allocates the split-KV accumulators, and it allocates exactly
``plan.accum_rows`` rows, only for the split variant (the tests hold it to that).

The variant seam: a :class:`Launcher` built with a ``tuning`` (the arch kernel module's tuning
type, e.g. ``cute_mla.kernels.sm90.Sm90Tuning``) compiles and launches that kernel variant for the
plan's shapes; ``FlashMLASchedMeta(tuning=...)`` makes the public call use it. Benchmarks and the
playground run variants this way, and time the decode kernel alone with :meth:`Launcher.main`.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Optional, Tuple

import torch

from .. import archs
from ..kernels import DecodeTensors
from ..plan.plan import SparseDecodePlan

Workspace = Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
Extra = Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]
NO_EXTRA: Extra = (None, None, None)


def allocate_workspace(plan: SparseDecodePlan, device: torch.device) -> Workspace:
    """o_accum (rows, s_q, h_q, d_v) of the plan's accum_dtype and lse_accum (rows, s_q, h_q) fp32,
    or (None, None) when nothing is split."""
    if not plan.split:
        return None, None
    # two allocations: on the H200's host one torch.empty costs ~2 µs and each slice + view of a
    # shared buffer as much again (one buffer and two views measured 9.3 µs)
    shape = (plan.accum_rows, plan.s_q, plan.h_q)
    o_accum = torch.empty(shape + (plan.d_v,), dtype=getattr(torch, plan.accum_dtype), device=device)
    lse_accum = torch.empty(shape, dtype=torch.float32, device=device)
    return o_accum, lse_accum


def kernel_module(arch: str):
    """The sparse decode kernel module of an arch (``archs.ArchSpec.kernel_module``)."""
    return importlib.import_module(archs.get(arch).kernel_module)


def launch_configs(plan: SparseDecodePlan, has_attn_sink: bool, tuning=None):
    """(decode kernel config, combine config or None): what a plan's calls compile (``cute-mla
    warmup`` precompiles the same set)."""
    main_cfg = kernel_module(plan.arch).kernel_config(
        h_q=plan.h_q, d_qk=plan.d_qk, split=plan.split, has_topk_length=plan.has_topk_length,
        has_attn_sink=has_attn_sink, column_pair=plan.column_pair, tuning=tuning,
        has_extra=plan.extra_topk > 0, has_extra_topk_length=plan.has_extra_topk_length,
        request_order=plan.orders_requests)
    combine_cfg = None
    if plan.split:
        from ..kernels import combine

        combine_cfg = combine.combine_config(arch=plan.arch, h_q=plan.h_q, has_attn_sink=has_attn_sink,
                                             num_sm_parts=plan.num_sm_parts, accum_dtype=plan.accum_dtype, b=plan.b,
                                             s_q=plan.s_q)
    return main_cfg, combine_cfg


class Launcher:
    """Everything a plan's launches need, resolved once (kernel module, configs, compiled kernels).

    Made once per (plan, sink, tuning) by :func:`launcher_of`, so that every later call (every
    layer) only allocates its outputs and launches: the host work between the main kernel and the
    combine is one Python call.
    """

    __slots__ = ("plan", "main_mod", "main_cfg", "main_compiled", "combine_mod", "combine_cfg", "combine_compiled")

    def __init__(self, plan: SparseDecodePlan, has_attn_sink: bool, tuning=None):
        if plan.split and plan.token_walk:
            # the walk's num_splits is the call's one request, not the s_q requests the combine
            # would index (and its layout_checked launch relies on b + 1 entries)
            raise ValueError(f"plan: a token walk never splits, got split with token_walk ({plan})")
        self.plan = plan
        self.main_mod = kernel_module(plan.arch)
        self.main_cfg, self.combine_cfg = launch_configs(plan, has_attn_sink, tuning)
        self.main_compiled = self.main_mod.compile_sparse_decode(self.main_cfg)
        self.combine_mod = self.combine_compiled = None
        if self.combine_cfg is not None:
            from ..kernels import combine

            self.combine_mod = combine
            self.combine_compiled = combine.compile_combine(self.combine_cfg)

    def __call__(self, q, kv, indices, topk_length, attn_sink, tile_md, accum_offsets, out, lse,
                 softmax_scale: float, extra: Extra = NO_EXTRA, workspace: Optional[Workspace] = None,
                 request_order: Optional[torch.Tensor] = None) -> None:
        """Launch what the plan says: the main kernel, then the combine only for the split variant."""
        workspace = self.main(q, kv, indices, topk_length, attn_sink, tile_md, accum_offsets, out, lse, softmax_scale,
                              extra, workspace, request_order)
        self.combine(workspace, accum_offsets, attn_sink, out, lse, tile_md)

    def main(self, q, kv, indices, topk_length, attn_sink, tile_md, accum_offsets, out, lse,
             softmax_scale: float, extra: Extra = NO_EXTRA, workspace: Optional[Workspace] = None,
             request_order: Optional[torch.Tensor] = None) -> Workspace:
        """The decode kernel alone; returns the workspace it wrote ((None, None) when unsplit).
        Without :meth:`combine` a split call's outputs stay unwritten: benchmarks time that as
        the call's bound without the combine. ``extra``: the extra pool's (cache, indices,
        lengths) where the plan has one. ``workspace``: the accumulators to write (the API passes
        the ones its metadata object keeps for the step, :func:`allocate_workspace` of this plan);
        None allocates them for this call. ``request_order``: the schedule's (``Schedule.request_order``),
        required where the plan orders requests, whose rows index positions in it (the kernel's
        launch refuses a missing one)."""
        extra_kv, extra_indices, extra_topk_length = extra
        if self.plan.token_walk:
            # b == 1: the s_q tokens become s_q one-token requests (views, no copy; plan docstring)
            q, indices, out, lse = q[0].unsqueeze(1), indices[0].unsqueeze(1), out[0].unsqueeze(1), lse[0].unsqueeze(1)
            if extra_indices is not None:
                extra_indices = extra_indices[0].unsqueeze(1)
        o_accum, lse_accum = workspace if workspace is not None else allocate_workspace(self.plan, q.device)
        self.main_mod.launch_sparse_decode(
            self.main_compiled, self.main_cfg,
            DecodeTensors(q, kv, indices, topk_length, attn_sink, tile_md, accum_offsets, out, lse, o_accum, lse_accum,
                          extra_kv, extra_indices, extra_topk_length, request_order),
            softmax_scale)
        return o_accum, lse_accum

    def combine(self, workspace: Workspace, accum_offsets, attn_sink, out, lse, tile_md) -> None:
        """The split-KV combine of the pieces :meth:`main` wrote (nothing when unsplit); ``tile_md``:
        the schedule's rows, which the combine walks when the plan has more requests than
        partitions (``combine.CombineConfig.by_partition``)."""
        o_accum, lse_accum = workspace
        if o_accum is not None:
            # layout_checked: the accumulators and lse were allocated contiguous here and by the API,
            # accum_offsets has the plan's b+1 entries, the sink matches has_attn_sink (the combine
            # config), and the API's checks covered out (16-byte strides on every dim longer than 1;
            # a dim of length 1 is only indexed at 0)
            self.combine_mod.launch_combine(self.combine_compiled, self.combine_cfg, lse_accum, o_accum, accum_offsets,
                                            attn_sink, out, lse, layout_checked=True,
                                            tile_md=tile_md if self.combine_cfg.by_partition else None)


_launchers: dict = {}   # (plan, has_attn_sink, tuning) -> Launcher; plans and tunings are hashable values


def launcher_of(plan: SparseDecodePlan, has_attn_sink: bool, tuning=None) -> Launcher:
    """The process's one :class:`Launcher` for a plan's calls with or without a sink, of a kernel
    variant (``tuning``; None: the default)."""
    key = (plan, has_attn_sink, tuning)
    launcher = _launchers.get(key)
    if launcher is None:
        launcher = _launchers[key] = Launcher(plan, has_attn_sink, tuning)
    return launcher


_SAME_DEVICE = contextlib.nullcontext()


def on_device_of(q: torch.Tensor):
    """The kernels launch on the current device's stream and the schedule is made there: a call
    with tensors on another GPU switches to theirs for its duration (no sync)."""
    if isinstance(q, torch.Tensor):
        index = q.get_device()    # -1 off CUDA
        if index >= 0 and index != torch.cuda.current_device():
            return torch.cuda.device(index)
    return _SAME_DEVICE


def cache_bytes(k_cache: torch.Tensor) -> torch.Tensor:
    """A checked (num_blocks, page_block_size, 1, row bytes) cache as the kernels' uint8 (num_blocks,
    page_block_size, row bytes): the launch path's lean ``formats.layout.cache_bytes``."""
    return k_cache.view(torch.uint8).squeeze(2) if k_cache.dtype != torch.uint8 else k_cache.squeeze(2)
