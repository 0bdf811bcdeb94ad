"""The public, FlashMLA-compatible sparse decode API.

``get_mla_metadata()`` returns an empty :class:`FlashMLASchedMeta`; the first
``flash_mla_with_kvcache`` call that uses it plans the call, makes the schedule (on the host when
the host knows it, else with the device scheduler kernel) and stores it there; later calls with the
same shapes reuse it (the caller promises the values of ``topk_length`` did not change either, as
with FlashMLA). The metadata tensors live in the object, at stable addresses, for CUDA graphs.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import torch

from ..formats import detect_format
from ..plan import SparseDecodePlan, SparseDecodePolicy, check_problem
from ..plan.schedule import Schedule, make_schedule
from . import ops
from ..kernels import SparseDecodeTensors, cache_bytes
from .launcher import Launcher, allocate_workspace, launcher_of, on_device_of
from .validate import (CACHE_BASE, FP32_MAX, KV_CACHE_DTYPES, call_key, check_aligned_strides, check_distinct_elements,
                       check_pointer, check_tensor, check_vector, known_call, remember)
from .validate import require_cuda as _require_cuda   # one name per module: the CPU tests stub it

_NO_WORKSPACE = (None, None)


@dataclass
class FlashMLASchedMeta:
    """Scheduler state of one decode step, filled by the first call that uses it (FlashMLA's layout).

    ``tile_scheduler_metadata`` (partitions, 8) int32 and ``num_splits`` (b+1,) int32 are
    FlashMLA's (under the plan's token walk the partitions' requests are the s_q tokens; under its
    balanced schedule the rows index positions in ``schedule.request_order``, not requests).
    ``accum_offsets`` (b+1,) int32 is cute-mla's compact prefix sum of accumulator rows (only
    split requests own rows); ``plan`` is the call's :class:`SparseDecodePlan`.

    ``tuning``: a kernel variant (the arch kernel module's tuning type, e.g.
    ``cute_mla.kernels.sm90.Sm90Tuning``) that every call with this object compiles and runs
    instead of the default; for benchmarks and kernel authors (:class:`~.launcher.Launcher`).

    ``policy``: the planner's rules (:class:`~cute_mla.plan.policy.SparseDecodePolicy`; None: the
    arch's default) for every eager call with this object: how a tool compares schedules through
    the public call. (A traced call plans under the default policy and runs the default kernels.)

    ``workspace``: the split-KV accumulators of a split plan (exactly ``plan.workspace_bytes``;
    (None, None) when nothing is split), allocated by the first call that uses the object and
    reused by the later ones: every layer of
    a decode step runs the same plan on one stream, one after the other, so they can share one
    set (two allocations per call would cost host time on every layer). They live as long as the object, like
    its schedule tensors; do not run calls with one object on two streams at once.
    """

    have_initialized: bool = False
    config: Optional[Tuple] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None
    accum_offsets: Optional[torch.Tensor] = None
    plan: Optional[SparseDecodePlan] = None
    tuning: Optional[object] = None
    policy: Optional[SparseDecodePolicy] = None
    schedule: Optional[Schedule] = field(default=None, repr=False, compare=False)
    workspace: Optional[Tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False, compare=False)
    # tensor signatures (_tensor_key) that passed _validate_tensors and _schedule -> ((b, s_q, h_q, topk,
    # extra_topk), the byte spans of out and the inputs or None, launcher) (checked_once): every layer
    # of a decode step calls with the same signatures, so only the first pays the checks and the plan
    _validated: dict = field(default_factory=dict, repr=False, compare=False)

    def launcher(self, has_attn_sink: bool) -> Launcher:
        """The filled object's launcher for calls with or without a sink (``launcher_of``: one per
        plan, sink and tuning in the process)."""
        return launcher_of(self.plan, has_attn_sink, self.tuning)


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """FlashMLA-compatible: ignores its arguments; the first decode call fills the returned object."""
    return FlashMLASchedMeta(), None


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode, FlashMLA's signature. Returns ``out`` (b, s_q, h_q, 512) bf16 and ``lse``
    (b, h_q, s_q) fp32 natural log (a transposed view, as FlashMLA's); a row with no valid token
    gets out 0 and lse +inf. ``block_table`` and ``cache_seqlens`` are ignored in sparse mode (the
    indices already address the cache).

    Accepted (every argument is checked before any launch; a bad one raises ``ValueError``,
    ``TypeError`` or ``NotImplementedError`` naming it, what was given and what is accepted):

    - ``q``: (b, s_q, h_q, d_qk) bf16 on a CUDA device, h_q 8, 16, 32, 64 or 128 (SM100: 64 or 128), d_qk 576 (V3.2) or 512 (V4).
    - ``k_cache``: (num_blocks, page_block_size, 1, row bytes of the format: ``formats.V32`` or
      ``formats.V4``), a uint8, int8 or float8_e4m3fn view of the FP8 cache; any ``stride(0)``
      that holds a page block (SM100 V4: a multiple of its 576-B data row).
    - ``head_dim_v`` 512; ``tile_scheduler_metadata`` from :func:`get_mla_metadata` (one per
      decode step, shared by its layers); ``num_splits`` None; ``causal`` False;
      ``is_fp8_kvcache`` True; ``softmax_scale`` a finite float (default ``d_qk ** -0.5``).
    - ``indices``: (b, s_q, topk) int32, topk a multiple of 64; -1, any other negative value or
      an index past the pool is an invalid entry.
    - ``attn_sink``: None or (h_q,) fp32 (+-inf allowed): out scaled by 1 / (1 + exp(sink - lse)),
      lse unchanged. ``topk_length``: None or (b,) int32, request i uses its first
      ``topk_length[i]`` indices.
    - V4 only: ``extra_k_cache`` (a second V4 cache, its own page block size),
      ``extra_indices_in_kvcache`` (b, s_q, extra_topk) int32 with extra_topk a multiple of 64,
      ``extra_topk_length`` None or (b,) int32; the softmax is taken over both lists jointly.
    - ``out``: None or a preallocated (b, s_q, h_q, 512) bf16 tensor whose elements do not overlap
      and whose bytes lie apart from every input's.

    Under ``torch.compile`` the call traces as the ``cute_mla::sparse_decode_schedule`` and
    ``cute_mla::sparse_decode`` ops (:mod:`.ops`), with the same checks; ``tile_scheduler_metadata``
    is then only type-checked (the graph makes each call's schedule)."""
    _check_arguments(tile_scheduler_metadata, num_splits, softmax_scale, causal, is_fp8_kvcache, indices,
                     extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
    extra = (extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
    if torch.compiler.is_compiling():
        b, s_q, h_q, topk, extra_topk = _validate_tensors(q, k_cache, head_dim_v, indices, attn_sink, topk_length, out,
                                                          extra)
        out, lse = ops.traced_call(
            SparseDecodeTensors(q, k_cache, indices, topk_length, attn_sink, *extra, out=out,
                                softmax_scale=_scale(softmax_scale, q)), topk, extra_topk, head_dim_v)
        return out, lse.transpose(1, 2)
    sched = tile_scheduler_metadata
    with on_device_of(q):
        (b, s_q, h_q, _, _), launcher = _checked_call(sched, q, k_cache, head_dim_v, indices, attn_sink, topk_length,
                                                      out, extra)
        scale = _scale(softmax_scale, q)
        if out is None:
            out = torch.empty(b, s_q, h_q, head_dim_v, dtype=torch.bfloat16, device=q.device)
        lse = torch.empty(b, s_q, h_q, dtype=torch.float32, device=q.device)
        # positional: the bundle is built on every call (the step's workspace in it, no _replace)
        launcher(SparseDecodeTensors(
            q, cache_bytes(k_cache), indices, topk_length, attn_sink,
            None if extra_k_cache is None else cache_bytes(extra_k_cache), extra_indices_in_kvcache, extra_topk_length,
            out, lse, sched.tile_scheduler_metadata, sched.accum_offsets, sched.schedule.request_order,
            *(sched.workspace or _NO_WORKSPACE), scale))
    return out, lse.transpose(1, 2)


def _scale(softmax_scale, q: torch.Tensor) -> float:
    """The call's softmax scale: the given one, or FlashMLA's default 1/sqrt(d_qk) (q checked)."""
    return float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5


def _schedule(sched: FlashMLASchedMeta, q: torch.Tensor, k_cache: torch.Tensor, dims: Tuple[int, ...],
              topk_length: Optional[torch.Tensor], has_attn_sink: bool = False,
              extra_topk_length: Optional[torch.Tensor] = None) -> Launcher:
    """The call's launcher; the first call of a FlashMLASchedMeta also plans and makes the schedule.
    ``dims``: (b, s_q, h_q, topk, extra_topk)."""
    b, s_q, h_q, topk, extra_topk = dims
    # the cache format: a V3.2 and a V4 call of the same shapes are other plans and kernels
    config = (b, s_q, h_q, ops.cache_format(q, k_cache), topk, extra_topk, topk_length is not None,
              extra_topk_length is not None, q.device)
    if sched.have_initialized:
        if sched.config != config:
            raise ValueError(
                "tile_scheduler_metadata: this FlashMLASchedMeta was filled for (b, s_q, h_q, format, topk, extra_topk, "
                f"has_topk_length, has_extra_topk_length, device)={sched.config}, got {config}; use a fresh "
                "get_mla_metadata() object per shape")
        sched.schedule.ensure_ready()
        return sched.launcher(has_attn_sink)
    plan = ops.call_plan(q, k_cache, topk, extra_topk, topk_length, extra_topk_length, *ops.device_facts(q.device),
                         policy=sched.policy)
    schedule = make_schedule(plan, q.device, topk_length, extra_topk_length)
    sched.tile_scheduler_metadata, sched.num_splits, sched.accum_offsets = schedule.tile_md, schedule.num_splits, schedule.accum_offsets
    sched.workspace = allocate_workspace(plan, q.device)   # the step's accumulators, for all its calls
    sched.schedule, sched.plan, sched.config, sched.have_initialized = schedule, plan, config, True
    return sched.launcher(has_attn_sink)


def check_extra_pool(extra_k_cache, extra_indices, extra_topk_length) -> None:
    """The extra KV pool is its cache and its indices, both or neither; its lengths need it (the API
    and the custom op check this before anything reads the pool)."""
    if (extra_k_cache is None) != (extra_indices is None):
        given, missing = (("extra_k_cache", "extra_indices_in_kvcache") if extra_indices is None
                          else ("extra_indices_in_kvcache", "extra_k_cache"))
        raise ValueError(f"{missing}: {given} was given without it; the extra KV pool takes both (or neither)")
    if extra_topk_length is not None and extra_indices is None:
        raise ValueError("extra_topk_length: given without an extra KV pool (extra_k_cache and extra_indices_in_kvcache)")


def _check_arguments(sched, num_splits, softmax_scale, causal, is_fp8_kvcache, indices, extra_k_cache, extra_indices,
                     extra_topk_length) -> None:
    """The checks of the call's non-tensor arguments and of what cute-mla does not implement; they
    run on every call."""
    if indices is None:
        raise NotImplementedError("indices: dense decode (indices=None) is not implemented; cute-mla implements sparse decode, pass indices (b, s_q, topk) int32")
    check_extra_pool(extra_k_cache, extra_indices, extra_topk_length)
    if not isinstance(sched, FlashMLASchedMeta):
        raise TypeError(f"tile_scheduler_metadata: expected the FlashMLASchedMeta returned by get_mla_metadata(), got {type(sched).__name__}")
    if num_splits is not None:
        raise ValueError(f"num_splits: must be None (the schedule lives in tile_scheduler_metadata), got {type(num_splits).__name__}")
    if causal:
        raise ValueError("causal: must be False with indices (sparse decode has no causal mask; causality comes from the indices)")
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache: must be True with indices (sparse decode reads the FP8 cache)")
    if softmax_scale is not None and (not isinstance(softmax_scale, numbers.Real)
                                      or not abs(float(softmax_scale)) <= FP32_MAX):
        raise ValueError(f"softmax_scale: expected a finite float (within float32's range, the kernels' type) or None, "
                         f"got {softmax_scale!r}")


def _checked_call(sched, q, k_cache, head_dim_v, indices, attn_sink, topk_length, out, extra=(None, None, None)):
    """((b, s_q, h_q, topk, extra_topk), launcher) of a call, its tensors checked and its schedule
    ready (``extra``: the extra pool's cache, indices and lengths; extra_topk is 0 without it).

    The tensor checks depend only on each tensor's type, layout, dtype, shape, strides, device,
    base-pointer alignment and neg bit (_tensor_key), and so does the plan: a signature that passed
    once for this FlashMLASchedMeta (the other layers of the decode step) costs the key, a dict
    lookup and the schedule's ready flag.
    """
    (dims, _, launcher), fresh = checked_once(
        sched._validated, _MAX_VALIDATED, (q, k_cache, head_dim_v, indices, attn_sink, topk_length, out, extra),
        lambda dims: _schedule(sched, q, k_cache, dims, topk_length, attn_sink is not None, extra[2]))
    if not fresh:
        sched.schedule.ensure_ready()
    return dims, launcher


def checked_once(cache: dict, limit: int, args, then: Callable):
    """((dims, spans, then(dims)), fresh) of a call's tensors ``args`` (q, k_cache, head_dim_v,
    indices, attn_sink, topk_length, out, extra): ``_validate_tensors`` once per signature
    (:func:`_tensor_key`; ``validate.known_call`` / ``remember``), ``then(dims)`` after it."""
    q, k_cache, head_dim_v, indices, attn_sink, topk_length, out, extra = args
    key = _tensor_key(q, k_cache, indices, attn_sink, topk_length, out, head_dim_v, *extra)
    inputs = None if out is None else _inputs(q, k_cache, indices, attn_sink, topk_length, extra)
    known = known_call(cache, key, out, inputs)
    if known is not None:
        return known, False
    dims = _validate_tensors(q, k_cache, head_dim_v, indices, attn_sink, topk_length, out, extra)
    return remember(cache, limit, key, dims, out, inputs, then), True


def _inputs(q, k_cache, indices, attn_sink, topk_length, extra):
    """(name, tensor or None) of everything a call reads, in one order."""
    return (("q", q), ("k_cache", k_cache), ("indices", indices), ("attn_sink", attn_sink),
            ("topk_length", topk_length), ("extra_k_cache", extra[0]), ("extra_indices_in_kvcache", extra[1]),
            ("extra_topk_length", extra[2]))


_MAX_VALIDATED = 16


def _tensor_key(q, k_cache, indices, attn_sink, topk_length, out, head_dim_v, extra_k_cache, extra_indices,
                extra_topk_length):
    """Everything _validate_tensors depends on (:func:`validate.call_key`)."""
    return call_key(head_dim_v, q, k_cache, indices, attn_sink, topk_length, out, extra_k_cache, extra_indices,
                    extra_topk_length)


def _validate_tensors(q, k_cache, head_dim_v, indices, attn_sink, topk_length, out, extra=(None, None, None)):
    """The tensor checks of :func:`_checked_call`; returns (b, s_q, h_q, topk, extra_topk). In a
    call being traced, the base pointers and neg bits are left to the ``cute_mla::sparse_decode``
    op, which sees the real tensors (``validate.check_deferred``)."""
    check_tensor("q", q, dtypes=(torch.bfloat16,), dim=4, shape_doc="(b, s_q, h_q, d_qk)")
    b, s_q, h_q, d_qk = q.shape
    if not isinstance(head_dim_v, numbers.Integral) or head_dim_v != 512:
        raise ValueError(f"head_dim_v: got {head_dim_v!r}, accepted: 512")
    check_tensor("indices", indices, dtypes=(torch.int32,), dim=3, shape=(b, s_q, None), device=q.device,
                 shape_doc="(b, s_q, topk)")
    topk = indices.shape[-1]
    extra_k_cache, extra_indices, extra_topk_length = extra
    extra_topk = 0
    if extra_indices is not None:
        check_tensor("extra_indices_in_kvcache", extra_indices, dtypes=(torch.int32,), dim=3, shape=(b, s_q, None),
                     device=q.device, shape_doc="(b, s_q, extra_topk)")
        extra_topk = extra_indices.shape[-1]
        if extra_topk < 1:
            raise ValueError(f"extra_topk: got {extra_topk} (extra_indices_in_kvcache's last dim), accepted: a positive "
                             "multiple of 64 (pass no extra pool instead of an empty one)")
        check_aligned_strides("extra_indices_in_kvcache", extra_indices)
    check_problem(b, s_q, h_q, d_qk, topk, extra_topk)
    check_aligned_strides("q", q, tma=True)
    check_aligned_strides("indices", indices)
    fmt = _check_cache("k_cache", k_cache, d_qk, q.device)
    if extra_k_cache is not None:
        extra_fmt = _check_cache("extra_k_cache", extra_k_cache, d_qk, q.device)
        if extra_fmt is not fmt:
            raise ValueError(f"extra_k_cache: the {extra_fmt.name} format ({extra_fmt.row_bytes} bytes/token) differs from "
                             f"k_cache's {fmt.name} ({fmt.row_bytes} bytes/token); the extra pool takes k_cache's format")
    check_vector("extra_topk_length", extra_topk_length, torch.int32, b, "b", q.device)
    check_vector("attn_sink", attn_sink, torch.float32, h_q, "h_q", q.device)
    check_vector("topk_length", topk_length, torch.int32, b, "b", q.device)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,), dim=4, shape=(b, s_q, h_q, fmt.d_v), device=q.device,
                     shape_doc=f"(b, s_q, h_q, {fmt.d_v})")
        check_distinct_elements("out", out)
        check_aligned_strides("out", out, tma=True)
    _require_cuda(q)
    return b, s_q, h_q, topk, extra_topk


def _check_cache(name: str, k_cache, d_qk: int, device: torch.device):
    """The checks of one paged cache (``k_cache`` or ``extra_k_cache``); returns its format."""
    check_tensor(name, k_cache, dtypes=KV_CACHE_DTYPES, dim=4, device=device,
                 shape_doc="(num_blocks, page_block_size, 1, bytes_per_token)")
    num_blocks, page_block_size, h_k, bytes_per_token = k_cache.shape
    if num_blocks < 1 or page_block_size < 1:
        raise ValueError(f"{name}: got {num_blocks} page blocks of {page_block_size} tokens, accepted: at least one "
                         "page block of at least one token (every request reads its list's first row, valid or not)")
    if h_k != 1:
        raise ValueError(f"{name}: h_k (dim 2) must be 1 (MLA has one latent KV head), got {h_k}")
    try:
        fmt = detect_format(d_qk, bytes_per_token)
    except (ValueError, NotImplementedError) as e:
        raise type(e)(str(e).replace("k_cache:", f"{name}:", 1)) from None
    if k_cache.stride(1) != bytes_per_token:
        raise ValueError(f"{name}: rows inside a page block must be packed: stride(1) must be {bytes_per_token} "
                         f"(bytes per token), got {k_cache.stride(1)}")
    if num_blocks * page_block_size >= 2**31:
        raise ValueError(f"{name}: {num_blocks}x{page_block_size} tokens do not fit int32 indices")
    stride0 = k_cache.stride(0) * k_cache.element_size()   # bytes (the kernels read it as uint8)
    if stride0 % 16:
        raise ValueError(f"{name}: {CACHE_BASE} must be 16-byte aligned, got stride(0)={stride0}")
    if not torch.compiler.is_compiling():   # a trace has no data pointer: check_deferred checks it in the op
        check_pointer(name, k_cache, what=CACHE_BASE)
    if stride0 >= 2**31:
        raise ValueError(f"{name}: stride(0) of {stride0} bytes, accepted: below 2^31 bytes per page block")
    if stride0 < page_block_size * bytes_per_token:   # one block too: the kernels size their row tables by it
        raise ValueError(f"{name}: stride(0) of {stride0} bytes does not hold a page block of {page_block_size} x "
                         f"{bytes_per_token} bytes")
    return fmt
