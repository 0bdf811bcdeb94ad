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
# (plan, device) -> UploadedSchedule. Never evicted: a captured CUDA graph keeps reading the
# tensors (and, for an upload made during capture, the pinned source) it was captured with, while
# engines (vLLM) make a new FlashMLASchedMeta per step and do not keep the capture's. Each entry
# is O(partitions) ints (token-walk plans too: plan.py), one per distinct plan.
_host_schedules: dict = {}


class UploadedSchedule:
    """One plan's schedule on one device: a pinned host copy and the device copy kernels read.

    The device copy is filled by an asynchronous upload, in one of two ways:

    * outside a graph capture (eager): the upload runs now, on the current stream, so launches on
      that stream are ordered after it; a launch on another stream waits for its event until the
      event has been seen complete (then the entry is ``ready`` and costs one flag test per call);
    * during a capture: the upload is a node of the graph being captured and runs only at that
      graph's replays. Until an eager upload has been issued, each capture that reads the entry
      gets its own upload node (once per capture, not per layer: captures are told apart by
      their CUDA capture id), so neither an eager call nor another graph ever reads the device
      copy before it holds the schedule. (A capture begun after an eager upload reads the
      uploaded data: ``torch.cuda.graph`` synchronizes the device before it captures.)
    """

    __slots__ = ("host", "dev", "views", "ready", "event", "captures")

    def __init__(self, host: torch.Tensor, dev: torch.Tensor, views: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        self.host, self.dev = host, dev
        self.views = views            # (tile_md, num_splits, accum_offsets): views of dev
        self.ready = False            # an eager upload is known complete
        self.event = None             # the eager upload's event until it is seen complete
        self.captures = set()         # ids of the captures that hold an upload node

    def ensure_uploaded(self) -> None:
        """Called before every launch that reads the schedule; once ``ready``, a flag test."""
        if self.ready:
            return
        with _lock:
            device = self.dev.device
            if device.type != "cuda":
                self.dev.copy_(self.host)
                self.ready = True
                return
            with torch.cuda.device(device):
                self._upload_or_wait(_capture_id(device))

    def _upload_or_wait(self, capture: Optional[int]) -> None:
        """The upload state machine (current device = the entry's): ``capture`` as :func:`_capture_id`."""
        if capture is not None:
            if self.event is None and (capture < 0 or capture not in self.captures):
                self.dev.copy_(self.host, non_blocking=True)
                self.captures.add(capture)
        elif self.event is None:
            self.dev.copy_(self.host, non_blocking=True)
            self.event = _record_event()
        elif _event_done(self.event):
            self.ready, self.event = True, None
        else:
            _wait_event(self.event)


def _record_event():
    ev = torch.cuda.Event()
    ev.record()
    return ev


def _event_done(ev) -> bool:
    return ev.query()


def _wait_event(ev) -> None:
    torch.cuda.current_stream().wait_event(ev)


def _capture_id(device: torch.device) -> Optional[int]:
    """None when work issued now on ``device`` runs; else the id of the CUDA-graph capture that
    records it (-1 when the driver query is unavailable: such a capture is never deduplicated)."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return None
    try:
        from cuda.bindings import driver

        res = driver.cuStreamGetCaptureInfo(torch.cuda.current_stream(device).cuda_stream)
        if res[0] == driver.CUresult.CUDA_SUCCESS:
            return int(res[2])
    except Exception:  # noqa: BLE001  (bindings missing or of another signature: upload every time)
        pass
    return -1


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """``host`` in pinned memory. During a global-mode capture the pinned allocator's driver calls
    (cudaHostAlloc, event queries) are not permitted, so they run in relaxed capture mode for
    this thread (the allocation is not a stream operation: nothing is captured)."""
    if not torch.cuda.is_current_stream_capturing():
        return host.pin_memory()
    try:
        from cuda.bindings import driver

        err, previous = driver.cuThreadExchangeStreamCaptureMode(driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    except Exception:  # noqa: BLE001
        return host.pin_memory()
    try:
        return host.pin_memory()
    finally:
        if err == driver.CUresult.CUDA_SUCCESS:
            driver.cuThreadExchangeStreamCaptureMode(previous)


def uploaded_schedule(plan: SparseDecodePlan, device: torch.device) -> UploadedSchedule:
    """The plan's host schedule on ``device``: ``.views`` = (tile_md, num_splits, accum_offsets).

    Cached per (plan, device): every call with the same shapes reads the same, stable addresses
    (CUDA graphs bake them in). Callers that keep an entry call its ``ensure_uploaded()`` before
    each launch (:class:`UploadedSchedule`: uploads made during a capture run only at replays).
    """
    key = (plan, str(device))
    with _lock:
        entry = _host_schedules.get(key)
        if entry is None:
            s = plan.host_schedule
            host = torch.tensor([v for row in s.rows for v in row] + list(s.num_splits) + list(accum_offsets(s.num_splits)),
                                dtype=torch.int32)
            if device.type == "cuda":
                host = _pinned(host)
            dev = torch.empty_like(host, device=device)
            p, b = len(s.rows), len(s.num_splits) - 1
            tile_md = dev[: p * SCHED_ROW_INTS].view(p, SCHED_ROW_INTS)
            num_splits = dev[p * SCHED_ROW_INTS: p * SCHED_ROW_INTS + b + 1]
            offsets = dev[p * SCHED_ROW_INTS + b + 1:]
            entry = _host_schedules[key] = UploadedSchedule(host, dev, (tile_md, num_splits, offsets))
    entry.ensure_uploaded()
    return entry


def _main_kernel(plan: SparseDecodePlan, has_topk_length: bool, has_attn_sink: bool):
    if plan.arch == "sm_90a":
        from ..kernels.sm90 import sparse_decode as mod
        cfg = mod.Sm90SparseDecodeConfig(h_q=plan.h_q, split=plan.split, has_topk_length=has_topk_length,
                                         has_attn_sink=has_attn_sink, oacc_from_registers=plan.oacc_from_registers,
                                         column_pair=plan.column_pair, accum_dtype=plan.accum_dtype)
    else:
        from ..kernels.sm100 import sparse_decode as mod
        cfg = mod.Sm100SparseDecodeConfig(h_q=plan.h_q, split=plan.split, has_topk_length=has_topk_length,
                                          has_attn_sink=has_attn_sink)
    return mod, cfg, mod.compile_sparse_decode(cfg)


def _combine_kernel(plan: SparseDecodePlan, has_attn_sink: bool):
    from ..kernels import combine as mod
    cfg = mod.combine_config(arch=plan.arch, h_q=plan.h_q, has_attn_sink=has_attn_sink, num_sm_parts=plan.num_sm_parts,
                             accum_dtype=plan.accum_dtype)
    return mod, cfg, mod.compile_combine(cfg)


def allocate_workspace(plan: SparseDecodePlan, device: torch.device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """o_accum (rows, s_q, h_q, d_v) of the plan's accum_dtype and lse_accum (rows, s_q, h_q) fp32,
    or (None, None) when nothing is split."""
    if not plan.split:
        return None, None
    # two allocations: on the H200's host one torch.empty costs ~2 µs and each slice + view of a
    # shared buffer as much again (host_profile.py measured 9.3 µs for one buffer and two views)
    shape = (plan.accum_rows, plan.s_q, plan.h_q)
    o_accum = torch.empty(shape + (plan.d_v,), dtype=getattr(torch, plan.accum_dtype), device=device)
    lse_accum = torch.empty(shape, dtype=torch.float32, device=device)
    return o_accum, lse_accum


class Launcher:
    """Everything a plan's launches need, resolved once (modules, configs, compiled kernels).

    Built by the first call of a decode step and kept in its ``FlashMLASchedMeta``, so that every
    later call (every layer) only allocates its outputs and launches: the host work between the
    main kernel and the combine is one Python call.
    """

    __slots__ = ("plan", "main_mod", "main_cfg", "main_compiled", "combine_mod", "combine_cfg", "combine_compiled")

    def __init__(self, plan: SparseDecodePlan, has_topk_length: bool, has_attn_sink: bool):
        if plan.split and plan.token_walk:
            # the walk's num_splits is the call's one request, not the s_q requests the combine
            # would index (and its layout_checked launch relies on b + 1 entries)
            raise ValueError(f"plan: a token walk never splits, got split with token_walk ({plan})")
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
            # layout_checked: the accumulators and lse were allocated contiguous here and by the API,
            # offsets has the plan's b+1 entries, the sink matches has_attn_sink (the combine config),
            # and the API's _validate checked out (16-byte strides on every dim longer than 1; a
            # dim of length 1 is only indexed at 0)
            self.combine_mod.launch_combine(self.combine_compiled, self.combine_cfg, lse_accum, o_accum, offsets,
                                            attn_sink, out, lse, layout_checked=True)
