"""The call as ``torch.library`` ops: what ``torch.compile`` traces.

Two ops in the ``cute_mla`` namespace, each with a fake (meta) implementation that gives its
outputs' shapes and dtypes from the plan, so a traced graph holds them as opaque nodes:

* ``cute_mla::sparse_decode_schedule(q, k_cache, topk_length?, extra_topk_length?, topk, extra_topk,
  arch, num_sms) -> schedule``: the call's schedule, packed as one int32 tensor
  ``[tile_md (partitions x 8) | num_splits (n) | accum_offsets (n) (| request order (b))]``
  (``plan.schedule.schedule_views``, ``order_view`` where the plan orders requests);
* ``cute_mla::sparse_decode(<the bundle's inputs: q, k_cache, indices, topk_length?, attn_sink?,
  extra_k_cache?, extra_indices?, extra_topk_length?>, schedule, out!, softmax_scale, arch,
  num_sms) -> lse`` (its tensor parameters are ``kernels.SPARSE_DECODE_INPUTS``):
  the decode kernel and, where the plan splits, the combine; ``out`` (b, s_q, h_q, 512) bf16 is
  written in place (declared mutated), ``lse`` (b, s_q, h_q) fp32 is returned.

They are the traced form of :func:`~.api.flash_mla_with_kvcache`, whose trace runs the argument
checks: call the API, not the ops. The decode op also runs the API's tensor checks once per tensor
signature (a direct call would otherwise skip them), what a trace cannot check (base pointers, neg
bits, out apart from the inputs) on every call, and that the schedule is the plan's.

A traced :func:`~.api.flash_mla_with_kvcache` makes its schedule in the graph (both ops, per call)
instead of keeping it in the ``FlashMLASchedMeta``, which a graph cannot fill: under CUDA graphs the
schedule is then recomputed at each replay from the lengths the replay reads. Host-known schedules
are copied from their cached upload (one device copy, a stable source address). A device schedule
costs its torch ops on every traced call: a few dozen aten ops for the split one (with the
scheduler kernel) and for the balanced cut (two sorts among them; what does not depend on the
lengths is a cached upload per (b, partitions)); docs/performance.md has their cost.

Eager calls do not go through the dispatcher, whose host time per call (more for a
``torch.library.custom_op`` than for a ``Library.impl`` op) exceeds the decode kernel of a small
call (docs/performance.md): :func:`~.api.flash_mla_with_kvcache` runs the same code directly and
keeps the schedule in the metadata object, once per decode step. A traced call plans under the
arch's default policy and runs the default kernels: ``FlashMLASchedMeta``'s ``tuning`` and
``policy`` apply to eager calls.

The plan of a traced call is a function of the tensors' shapes and of (arch, num_sms), which the
trace reads from the device once (:func:`device_facts`) and passes to both ops.
"""

from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch

from ..archs import device_arch, device_num_sms
from ..formats import detect_format
from ..kernels import SPARSE_DECODE_INPUTS, SPARSE_DECODE_OPTIONAL, SparseDecodeTensors, cache_bytes
from ..plan import SparseDecodePlan, plan_sparse_decode
from ..plan.schedule import make_schedule, order_view, schedule_length, schedule_views
from .launcher import launcher_of, on_device_of
from .validate import check_deferred

NAMESPACE = "cute_mla"


def _tensor_params(names) -> str:
    """A schema's tensor parameters, from a bundle's input fields (optional ones ``Tensor?``)."""
    return ", ".join(f"Tensor{'?' if n in SPARSE_DECODE_OPTIONAL else ''} {n}" for n in names)


_lib = torch.library.Library(NAMESPACE, "DEF")
_lib.define(
    "sparse_decode_schedule(Tensor q, Tensor k_cache, Tensor? topk_length, Tensor? extra_topk_length, int topk, "
    "int extra_topk, str arch, int num_sms) -> Tensor")
_lib.define(
    f"sparse_decode({_tensor_params(SPARSE_DECODE_INPUTS)}, Tensor schedule, Tensor(a!) out, float softmax_scale, "
    "str arch, int num_sms) -> Tensor")


def _constant_for_dynamo(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo`` (a second of
    import time) in a process that never traces: the marker it sets (``tests/test_custom_op.py``
    checks that the public function still sets exactly this)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_constant_for_dynamo
def device_facts(device: torch.device) -> Tuple[str, int]:
    """(arch name, SM count) of the call's device: constants of a traced call (read once, at trace time)."""
    return device_arch(device), device_num_sms(device)


def cache_format(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """The name of a checked call's cache format, from (d_qk, bytes per token): the API's one
    mapping from a cache to its format (``formats.detect_format``)."""
    return detect_format(int(q.shape[-1]), int(k_cache.shape[-1]) * k_cache.element_size()).name


def call_plan(q: torch.Tensor, k_cache: torch.Tensor, topk: int, extra_topk: int, topk_length: Optional[torch.Tensor],
              extra_topk_length: Optional[torch.Tensor], arch: str, num_sms: int, policy=None) -> SparseDecodePlan:
    """The plan of a call (cached: ``plan_sparse_decode``). The plan (a partition count, a kernel
    variant) is a function of the shapes: a trace with symbolic sizes specializes on them here
    (``int()`` guards each value) rather than carrying symbols into the plan."""
    b, s_q, h_q, d_qk = (int(v) for v in q.shape)
    return plan_sparse_decode(b, s_q, h_q, d_qk, int(topk), arch=arch, num_sms=num_sms,
                              has_topk_length=topk_length is not None, extra_topk=int(extra_topk),
                              has_extra_topk_length=extra_topk_length is not None,
                              format=cache_format(q, k_cache), policy=policy)


# ------------------------------------------------------------------------------- the schedule op


def _schedule_impl(q, k_cache, topk_length, extra_topk_length, topk, extra_topk, arch, num_sms):
    plan = call_plan(q, k_cache, topk, extra_topk, topk_length, extra_topk_length, arch, num_sms)
    with on_device_of(q):
        s = make_schedule(plan, q.device, topk_length, extra_topk_length)
        if s.upload is not None:       # make_schedule already ensured the upload
            return s.upload.dev.clone()      # the op's output must not alias the cache's entry
        parts = (s.tile_md.flatten(), s.num_splits, s.accum_offsets)
        return torch.cat(parts if s.request_order is None else parts + (s.request_order,))


def _schedule_fake(q, k_cache, topk_length, extra_topk_length, topk, extra_topk, arch, num_sms):
    plan = call_plan(q, k_cache, topk, extra_topk, topk_length, extra_topk_length, arch, num_sms)
    return q.new_empty(schedule_length(plan), dtype=torch.int32)


# --------------------------------------------------------------------------------- the decode op


_SIGNATURES: dict = {}   # tensor signatures the op has checked (api.checked_once)
_MAX_SIGNATURES = 64


_N_INPUTS = len(SPARSE_DECODE_INPUTS)
assert SparseDecodeTensors._fields[:_N_INPUTS] == SPARSE_DECODE_INPUTS, "the op's inputs lead the bundle, in order"


def _call_inputs(args) -> SparseDecodeTensors:
    """The op's tensor arguments (its schema's leading ``SPARSE_DECODE_INPUTS``) as the call's bundle."""
    return SparseDecodeTensors(*args[:_N_INPUTS])


def _decode_impl(*args):
    t = _call_inputs(args)
    schedule, out, softmax_scale, arch, num_sms = args[_N_INPUTS:]
    # a trace cannot read data pointers or neg bits: their checks run here, on the real tensors, before the launch
    check_deferred((("q", t.q), ("indices", t.indices), ("topk_length", t.topk_length), ("attn_sink", t.attn_sink),
                    ("out", out), ("extra_indices_in_kvcache", t.extra_indices),
                    ("extra_topk_length", t.extra_topk_length)),
                   (("k_cache", t.k_cache), ("extra_k_cache", t.extra_k_cache)))
    # the API's tensor checks too, once per signature: a direct call of the op would skip them
    from .api import check_extra_pool, checked_once   # (api imports this module)
    check_extra_pool(t.extra_k_cache, t.extra_indices, t.extra_topk_length)
    extra = (t.extra_k_cache, t.extra_indices, t.extra_topk_length)
    checked_once(_SIGNATURES, _MAX_SIGNATURES, (t.q, t.k_cache, out.shape[-1], t.indices, t.attn_sink, t.topk_length,
                                                out, extra), lambda dims: None)
    plan = call_plan(t.q, t.k_cache, t.indices.shape[-1], 0 if t.extra_indices is None else t.extra_indices.shape[-1],
                     t.topk_length, t.extra_topk_length, arch, num_sms)
    length = schedule_length(plan)
    if schedule.dtype != torch.int32 or schedule.shape != (length,) or schedule.device != t.q.device:
        # the kernels index tile_md and accum_offsets without bounds: only this plan's schedule will do
        raise ValueError(f"schedule: expected this call's packed schedule, ({length},) int32 on "
                         f"{t.q.device} (cute_mla::sparse_decode_schedule), got {schedule.dtype} "
                         f"{tuple(schedule.shape)} on {schedule.device}")
    tile_md, _, accum_offsets = schedule_views(plan, schedule)
    b, s_q, h_q, _ = t.q.shape
    with on_device_of(t.q):
        lse = torch.empty(b, s_q, h_q, dtype=torch.float32, device=t.q.device)
        launcher_of(plan, t.attn_sink is not None)(t._replace(
            k_cache=cache_bytes(t.k_cache),
            extra_k_cache=None if t.extra_k_cache is None else cache_bytes(t.extra_k_cache),
            out=out, lse=lse, tile_md=tile_md, accum_offsets=accum_offsets, request_order=order_view(plan, schedule),
            softmax_scale=softmax_scale))
    return lse


def _decode_fake(*args):
    b, s_q, h_q, _ = _call_inputs(args).q.shape
    return args[0].new_empty(b, s_q, h_q, dtype=torch.float32)


_lib.impl("sparse_decode_schedule", _schedule_impl, "CUDA")
_lib.impl("sparse_decode", _decode_impl, "CUDA")
torch.library.register_fake(f"{NAMESPACE}::sparse_decode_schedule", _schedule_fake, lib=_lib)
torch.library.register_fake(f"{NAMESPACE}::sparse_decode", _decode_fake, lib=_lib)


def traced_call(t: SparseDecodeTensors, topk: int, extra_topk: int, d_v: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The body of a call being traced (``torch.compiler.is_compiling()``), its checks done: (out,
    lse (b, s_q, h_q)) through the two ops. ``t``: the call's inputs as given, ``out`` (or None)
    and the scale."""
    arch, num_sms = device_facts(t.q.device)
    b, s_q, h_q, _ = t.q.shape
    schedule = torch.ops.cute_mla.sparse_decode_schedule(t.q, t.k_cache, t.topk_length, t.extra_topk_length, topk,
                                                         extra_topk, arch, num_sms)
    out = t.out
    if out is None:
        out = torch.empty(b, s_q, h_q, d_v, dtype=torch.bfloat16, device=t.q.device)
    lse = torch.ops.cute_mla.sparse_decode(*t[:_N_INPUTS], schedule, out, t.softmax_scale, arch, num_sms)
    return out, lse
