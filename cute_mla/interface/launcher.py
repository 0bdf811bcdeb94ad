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
from typing import Optional, Tuple

import torch

from .. import registry
from ..kernels import SparseDecodeTensors
from ..plan.sparse_decode import SparseDecodePlan

Workspace = Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]


def allocate_workspace(plan: SparseDecodePlan, device: torch.device) -> Workspace:
    """o_accum (rows, s_q, h_q, d_v) of the plan's accum_dtype and lse_accum (rows, s_q, h_q) fp32,
    or (None, None) when nothing is split."""
    if not plan.split:
        return None, None
    # two allocations: one torch.empty costs a few µs of host time, and each slice + view of a
    # shared buffer as much again
    shape = (plan.accum_rows, plan.s_q, plan.h_q)
    o_accum = torch.empty(shape + (plan.d_v,), dtype=getattr(torch, plan.accum_dtype), device=device)
    lse_accum = torch.empty(shape, dtype=torch.float32, device=device)
    return o_accum, lse_accum


def launch_configs(plan: SparseDecodePlan, has_attn_sink: bool, tuning=None):
    """(main kernel config, combine config or None): what a plan's calls compile (``cute-mla
    warmup`` precompiles the same set, from the plan's rules)."""
    main_cfg = registry.config_module(plan.op, plan.arch).config_for(plan, has_attn_sink, tuning)
    combine_cfg = None
    if plan.split:
        combine = registry.kernel_module(plan.op, plan.arch, "combine")
        combine_cfg = combine.combine_config(arch=plan.arch, h_q=plan.h_q, has_attn_sink=has_attn_sink,
                                             num_sm_parts=plan.num_sm_parts, accum_dtype=plan.accum_dtype, b=plan.b,
                                             s_q=plan.s_q)
    return main_cfg, combine_cfg


class Launcher:
    """Everything a plan's launches need, resolved once (kernel modules, configs, compiled kernels).

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
        self.main_mod = registry.kernel_module(plan.op, plan.arch)
        self.main_cfg, self.combine_cfg = launch_configs(plan, has_attn_sink, tuning)
        self.main_compiled = self.main_mod.compile(self.main_cfg)
        self.combine_mod = self.combine_compiled = None
        if self.combine_cfg is not None:
            self.combine_mod = registry.kernel_module(plan.op, plan.arch, "combine")
            self.combine_compiled = self.combine_mod.compile(self.combine_cfg)

    def __call__(self, t: SparseDecodeTensors) -> None:
        """Launch what the plan says: the main kernel, then the combine only for the split variant."""
        self.combine(self.main(t))

    def main(self, t: SparseDecodeTensors) -> SparseDecodeTensors:
        """The main kernel alone; returns the bundle it launched with (its workspace: (None, None)
        when unsplit). Without :meth:`combine` a split call's outputs stay unwritten: benchmarks
        time that as the call's bound without the combine. ``t``: the call's bundle with its
        schedule, ``out`` and ``lse`` (``request_order`` required where the plan orders
        requests: the kernel's launch refuses a missing one) and, for a split plan, its
        accumulators (the API passes the ones its metadata object keeps for the step,
        :func:`allocate_workspace` of this plan); a split plan's bundle without them gets its own
        for this call."""
        if self.plan.split and t.o_accum is None:
            o_accum, lse_accum = allocate_workspace(self.plan, t.q.device)
            t = t._replace(o_accum=o_accum, lse_accum=lse_accum)
        if self.plan.token_walk:
            # b == 1: the s_q tokens become s_q one-token requests (views, no copy; the policy's token_walk)
            t = t._replace(q=t.q[0].unsqueeze(1), indices=t.indices[0].unsqueeze(1), out=t.out[0].unsqueeze(1),
                           lse=t.lse[0].unsqueeze(1),
                           extra_indices=None if t.extra_indices is None else t.extra_indices[0].unsqueeze(1))
        self.main_mod.launch(self.main_compiled, self.main_cfg, t)
        return t

    def combine(self, t: SparseDecodeTensors) -> None:
        """The split-KV combine of the pieces :meth:`main` wrote into ``t``'s workspace (nothing when
        unsplit); it walks the schedule's rows (``t.tile_md``) when the plan has more requests than
        partitions (``combine.CombineConfig.by_partition``)."""
        if t.o_accum is not None:
            # layout_checked: the accumulators and lse were allocated contiguous here and by the API,
            # accum_offsets has the plan's b+1 entries, the sink matches has_attn_sink (the combine
            # config), and the API's checks covered out (16-byte strides on every dim longer than 1;
            # a dim of length 1 is only indexed at 0)
            self.combine_mod.launch(self.combine_compiled, self.combine_cfg, t.lse_accum, t.o_accum, t.accum_offsets,
                                    t.attn_sink, t.out, t.lse, layout_checked=True,
                                    tile_md=t.tile_md if self.combine_cfg.by_partition else None)


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
# The current CUDA device from torch's C binding (what torch.cuda.current_device returns after its
# Python-side lazy init, which a call holding CUDA tensors no longer needs; the binding initializes
# CUDA itself); a CPU-only torch has no binding and no CUDA tensors reach it.
_current_cuda_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _device_to_switch(q) -> Optional[int]:
    """q's CUDA device index where a call has to switch to it (not the current device); None for
    the current device or a tensor off CUDA."""
    index = q.get_device()    # -1 off CUDA
    return index if index >= 0 and index != _current_cuda_device() else None


def on_device_of(q: torch.Tensor):
    """The kernels launch on the current device's stream and the schedule is made there: a call
    with tensors on another GPU switches to theirs for its duration (no sync)."""
    index = _device_to_switch(q) if isinstance(q, torch.Tensor) else None
    return _SAME_DEVICE if index is None else torch.cuda.device(index)


def call_on_device_of(q: torch.Tensor, fn, *args):
    """``fn(*args)`` on q's device (:func:`on_device_of`), for a call whose launch is all it runs
    there: on the current device it pays no context manager's frames."""
    index = _device_to_switch(q)
    if index is None:
        return fn(*args)
    with torch.cuda.device(index):
        return fn(*args)
