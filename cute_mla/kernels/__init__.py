"""The kernels: per-arch sparse decode (``sm90/``, ``sm100/``) and sparse prefill (``sm90/``), the
split-KV combine, and the tensor bundle each op's kernels take.

Each kernel module keeps the registry's protocol (``cute_mla.registry``): a frozen ``Config``,
``compile(cfg)`` (only a hashable config, so compiling is cached, needs no GPU and is testable per
arch) and ``launch``, which runs a compiled kernel on torch's current stream with no host
synchronization or allocation. Nothing here imports the API, the plan or the schedule: the
launcher (``cute_mla.interface``) turns a plan into kernel configs.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch


class SparseDecodeTensors(NamedTuple):
    """One sparse decode call's tensors and scale, end to end: the API makes it from the call's
    checked arguments, its schedule and its outputs, the launcher adds the workspace and the token
    walk's views (``_replace``), the custom op's schema and fake implementation are written from its
    input fields (:data:`SPARSE_DECODE_INPUTS`), and every arch's ``launch`` takes it whole (each
    kernel module lists once, in ``ENTRY``, which fields its compiled entry takes in which order).

    ``accum_offsets`` is the schedule's accumulator row prefix sum (request ``r``'s split pieces
    own rows ``[accum_offsets[r], accum_offsets[r+1])``); ``o_accum`` / ``lse_accum`` exist only
    for the split variant."""

    # the call's inputs (validated); the caches as the kernels read them (cache_bytes of the call's)
    q: torch.Tensor                                # (b, s_q, h_q, d_qk) bf16
    k_cache: torch.Tensor                          # (num_blocks, page_block_size, row bytes) uint8
    indices: torch.Tensor                          # (b, s_q, topk) int32
    topk_length: Optional[torch.Tensor] = None     # (b,) int32
    attn_sink: Optional[torch.Tensor] = None       # (h_q,) fp32
    extra_k_cache: Optional[torch.Tensor] = None   # the extra KV pool (V4): its cache,
    extra_indices: Optional[torch.Tensor] = None   # its (b, s_q, extra_topk) indices
    extra_topk_length: Optional[torch.Tensor] = None   # and their (b,) lengths
    # the outputs: out (b, s_q, h_q, d_v) bf16 (given or made by the API), lse (b, s_q, h_q) fp32
    out: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    # the schedule (plan.schedule.Schedule)
    tile_md: Optional[torch.Tensor] = None         # (partitions, 8) int32
    accum_offsets: Optional[torch.Tensor] = None   # (b+1,) int32
    # a schedule that orders whole requests (the balanced cut): (b,) int32, the request at each
    # position of the partitions' walk; None where partitions walk requests in order
    request_order: Optional[torch.Tensor] = None
    # the split-KV workspace (split plans only)
    o_accum: Optional[torch.Tensor] = None         # (rows, s_q, h_q, d_v), the plan's accum dtype
    lse_accum: Optional[torch.Tensor] = None       # (rows, s_q, h_q) fp32
    softmax_scale: float = 1.0


# The fields a call passes in, in order: the custom op's tensor arguments (interface.ops)
SPARSE_DECODE_INPUTS = ("q", "k_cache", "indices", "topk_length", "attn_sink", "extra_k_cache", "extra_indices",
                        "extra_topk_length")
# the optional ones: those the bundle defaults to None
SPARSE_DECODE_OPTIONAL = frozenset(n for n in SPARSE_DECODE_INPUTS if n in SparseDecodeTensors._field_defaults)


class SparsePrefillTensors(NamedTuple):
    """One sparse prefill call's tensors and scale: the API makes it from the call's checked
    arguments (heads padded to the kernel's) and its outputs; the custom op's schema is written
    from its input fields (:data:`SPARSE_PREFILL_INPUTS`); the kernel's ``ENTRY`` picks its fields."""

    q: torch.Tensor                                # (s_q, h, d_qk) bf16
    kv: torch.Tensor                               # (s_kv, 1, d_qk) bf16, as the call gives it
    indices: torch.Tensor                          # (s_q, 1, topk) int32, as the call gives it
    topk_length: Optional[torch.Tensor] = None     # (s_q,) int32
    attn_sink: Optional[torch.Tensor] = None       # (h,) fp32
    out: Optional[torch.Tensor] = None             # (s_q, h, d_v) bf16
    max_logits: Optional[torch.Tensor] = None      # (s_q, h) fp32
    lse: Optional[torch.Tensor] = None             # (s_q, h) fp32
    softmax_scale: float = 1.0


SPARSE_PREFILL_INPUTS = ("q", "kv", "indices", "topk_length", "attn_sink")
SPARSE_PREFILL_OPTIONAL = frozenset(n for n in SPARSE_PREFILL_INPUTS if n in SparsePrefillTensors._field_defaults)


def plan_config_for(kernel_config, accum_dtype: str, kernel: str):
    """A kernel module's ``config_for(plan, has_attn_sink, tuning=None)``: the sparse decode plan's
    choices (format, split, lists' lengths, extra pool, column pair, request order) as
    ``kernel_config`` keywords, for every arch alike; a split plan whose accumulators are not the
    ``accum_dtype`` the kernel writes is refused by name (``kernel``)."""

    def config_for(plan, has_attn_sink: bool, tuning=None):
        if plan.split and plan.accum_dtype != accum_dtype:
            raise ValueError(f"accum_dtype: got {plan.accum_dtype!r} from the plan, accepted: {accum_dtype!r} (what the "
                             f"{kernel} split kernel writes)")
        return kernel_config(h_q=plan.h_q, format=plan.format, split=plan.split, has_topk_length=plan.has_topk_length,
                             has_attn_sink=has_attn_sink, column_pair=plan.column_pair, tuning=tuning,
                             has_extra=plan.extra_topk > 0, has_extra_topk_length=plan.has_extra_topk_length,
                             request_order=plan.orders_requests)

    config_for.__doc__ = f"The config of the {kernel} kernel a sparse decode plan's calls compile (the launcher's call)."
    return config_for


def entry_getter(names, bundle=SparseDecodeTensors):
    """A function of a ``bundle`` (an op's tensor bundle type) that returns the fields ``names`` (a
    kernel module's ``ENTRY``), in order, as one tuple (an itemgetter: no per-field Python on the
    launch path)."""
    index = tuple(bundle._fields.index(n) for n in names)
    get = operator.itemgetter(*index)
    return (lambda t: (get(t),)) if len(index) == 1 else get


def fake_entry(names, fakes: dict) -> list:
    """A compile's fake arguments in ``ENTRY`` order: ``fakes`` maps the names the config takes to
    their fake tensors (None for the others); a name that is not an entry parameter is an error."""
    unknown = sorted(set(fakes) - set(names))
    if unknown:
        raise KeyError(f"fake arguments {unknown} are not entry parameters {tuple(names)}")
    return [fakes.get(n) for n in names]


def cache_bytes(k_cache: torch.Tensor) -> torch.Tensor:
    """A checked (num_blocks, page_block_size, 1, row bytes) cache as the kernels read it: uint8
    (num_blocks, page_block_size, row bytes), a view."""
    return k_cache.view(torch.uint8).squeeze(2) if k_cache.dtype != torch.uint8 else k_cache.squeeze(2)
