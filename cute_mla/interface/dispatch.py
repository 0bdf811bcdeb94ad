"""From a plan to launches: the kernels a plan names, compiled once per config, and the workspace.

This is the only place that allocates the split-KV accumulators, and it allocates exactly
``plan.accum_rows`` rows, only for the split variant (the tests hold it to that).
"""

from __future__ import annotations

import threading
from typing import Optional, Tuple

import torch

from ..scheduler import SCHED_ROW_INTS, accum_offsets
from .plan import SparseDecodePlan

_lock = threading.Lock()
# (plan, device) -> device schedule tensors. Never evicted: a captured CUDA graph keeps reading
# the tensors (and, for an upload made during capture, the pinned source) it was captured with,
# while engines (vLLM) make a new FlashMLASchedMeta per step and do not keep the capture's. Each
# entry is O(partitions) ints (token-walk plans too: plan.py), one per distinct plan.
_host_schedules: dict = {}


def host_schedule_tensors(plan: SparseDecodePlan, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan's host schedule as device tensors (tile_md, num_splits, accum_offsets).

    Cached per (plan, device): every call with the same shapes reads the same, stable addresses
    (CUDA graphs bake them in). The upload is an asynchronous copy from pinned memory, which is
    legal inside a graph capture (a captured upload runs again at every replay); the pinned source
    is kept alive with the cache entry.
    """
    key = (plan, str(device))
    with _lock:
        hit = _host_schedules.get(key)
        if hit is not None:
            return hit[:3]
        s = plan.host_schedule
        host = torch.tensor([v for row in s.rows for v in row] + list(s.num_splits) + list(accum_offsets(s.num_splits)),
                            dtype=torch.int32)
        if device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        p, b = len(s.rows), len(s.num_splits) - 1
        tile_md = dev[: p * SCHED_ROW_INTS].view(p, SCHED_ROW_INTS)
        num_splits = dev[p * SCHED_ROW_INTS: p * SCHED_ROW_INTS + b + 1]
        offsets = dev[p * SCHED_ROW_INTS + b + 1:]
        _host_schedules[key] = (tile_md, num_splits, offsets, host)
        return tile_md, num_splits, offsets


def _main_kernel(plan: SparseDecodePlan, has_topk_length: bool, has_attn_sink: bool):
    if plan.arch == "sm_90a":
        from ..kernels.sm90 import sparse_decode as mod
        cfg = mod.Sm90SparseDecodeConfig(h_q=plan.h_q, split=plan.split, has_topk_length=has_topk_length,
                                         has_attn_sink=has_attn_sink, oacc_from_registers=plan.oacc_from_registers)
    else:
        from ..kernels.sm100 import sparse_decode as mod
        cfg = mod.Sm100SparseDecodeConfig(h_q=plan.h_q, split=plan.split, has_topk_length=has_topk_length,
                                          has_attn_sink=has_attn_sink)
    return mod, cfg, mod.compile_sparse_decode(cfg)


def _combine_kernel(plan: SparseDecodePlan, has_attn_sink: bool):
    from ..kernels import combine as mod
    cfg = mod.combine_config(arch=plan.arch, h_q=plan.h_q, has_attn_sink=has_attn_sink, num_sm_parts=plan.num_sm_parts)
    return mod, cfg, mod.compile_combine(cfg)


def allocate_workspace(plan: SparseDecodePlan, device: torch.device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """o_accum (rows, s_q, h_q, d_v) and lse_accum (rows, s_q, h_q) fp32, or (None, None) when nothing is split."""
    if not plan.split:
        return None, None
    # one allocation for both (fewer allocator calls on the launch path); o_accum first, so both
    # views stay 16-byte aligned
    rows_heads = plan.accum_rows * plan.s_q * plan.h_q
    buf = torch.empty(rows_heads * (plan.d_v + 1), dtype=torch.float32, device=device)
    o_accum = buf[: rows_heads * plan.d_v].view(plan.accum_rows, plan.s_q, plan.h_q, plan.d_v)
    lse_accum = buf[rows_heads * plan.d_v:].view(plan.accum_rows, plan.s_q, plan.h_q)
    return o_accum, lse_accum


class Launcher:
    """Everything a plan's launches need, resolved once (modules, configs, compiled kernels).

    Built by the first call of a decode step and kept in its ``FlashMLASchedMeta``, so that every
    later call (every layer) only allocates its outputs and launches: the host work between the
    main kernel and the combine is one Python call.
    """

    __slots__ = ("plan", "main_mod", "main_cfg", "main_compiled", "combine_mod", "combine_cfg", "combine_compiled")

    def __init__(self, plan: SparseDecodePlan, has_topk_length: bool, has_attn_sink: bool):
        self.plan = plan
        self.main_mod, self.main_cfg, self.main_compiled = _main_kernel(plan, has_topk_length, has_attn_sink)
        self.combine_mod = self.combine_cfg = self.combine_compiled = None
        if plan.split:
            self.combine_mod, self.combine_cfg, self.combine_compiled = _combine_kernel(plan, has_attn_sink)

    def __call__(self, q, kv, indices, topk_length, attn_sink, tile_md, offsets, out, lse, softmax_scale: float) -> None:
        """Launch what the plan says: the main kernel, then the combine only for the split variant."""
        if self.plan.token_walk:
            # b == 1: the s_q tokens become s_q one-token requests (views, no copy; plan docstring)
            q, indices, out, lse = q[0].unsqueeze(1), indices[0].unsqueeze(1), out[0].unsqueeze(1), lse[0].unsqueeze(1)
        o_accum, lse_accum = allocate_workspace(self.plan, q.device)
        self.main_mod.launch_sparse_decode(self.main_compiled, self.main_cfg, q, kv, indices, topk_length, attn_sink,
                                           tile_md, offsets, out, lse, o_accum, lse_accum, softmax_scale)
        if o_accum is not None:
            self.combine_mod.launch_combine(self.combine_compiled, self.combine_cfg, lse_accum, o_accum, offsets,
                                            attn_sink, out, lse)
