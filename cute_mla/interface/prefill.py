"""The public, FlashMLA-compatible sparse prefill API (``flash_mla_sparse_fwd``), its checks, its
launches and its ``torch.library`` op.

Every bad argument is refused before any launch, naming it. A call plans (``plan_sparse_prefill``:
no schedule, no split, no workspace), pads 8, 16 or 32 heads to the kernel's 64 where the arch's
kernel has no small tile
(``SparsePrefillPlan.padded``), and launches the registry's kernel for the device's arch on the
current stream: no host synchronization, nothing read back, ``out`` at the caller's address when
given. Eager calls run :func:`eager_call` (the checks, the plan and the kernel's launcher once per
call signature, then :func:`_run`); a call being traced goes through
``cute_mla::sparse_prefill`` (the same :func:`_run`, padding included, inside one graph node),
whose fake implementation gives the outputs' shapes.
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch

from .. import registry
from ..kernels import SPARSE_PREFILL_INPUTS, SPARSE_PREFILL_OPTIONAL, SparsePrefillTensors
from ..plan.sparse_prefill import D_V, OP, SparsePrefillPlan, check_problem, plan_sparse_prefill
from .launcher import call_on_device_of, on_device_of
from . import ops
from .ops import NAMESPACE
from .validate import (FP32_MAX, call_key, check_aligned_strides, check_apart, check_deferred, check_distinct_elements,
                       check_not_neg, check_tensor, check_vector, known_call, remember)
from .validate import require_cuda as _require_cuda   # one name per module: the CPU tests stub it



# ------------------------------------------------------------------------------------- checks


def check_call(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out) -> Tuple[int, int, int, int]:
    """Every check of one argument's type, shape, strides and value; returns (s_q, h_q, d_qk,
    topk). out apart from the inputs (their addresses) and the device follow (:func:`checked_call`);
    base pointers and neg bits of a call being traced are checked by the op, on the real tensors."""
    check_tensor("q", q, dtypes=(torch.bfloat16,), dim=3, shape_doc="(s_q, h_q, d_qk)")
    s_q, h_q, d_qk = q.shape
    if not isinstance(d_v, numbers.Integral) or d_v != D_V:
        raise ValueError(f"d_v: got {d_v!r}, accepted: {D_V}")
    check_scale(sm_scale)
    check_tensor("kv", kv, dtypes=(torch.bfloat16,), dim=3, device=q.device, shape_doc="(s_kv, 1, d_qk)")
    if kv.shape[1] != 1 or kv.shape[2] != d_qk:
        raise ValueError(f"kv: expected shape (s_kv, 1, {d_qk}) (one latent KV head, q's d_qk), got {tuple(kv.shape)}")
    if kv.shape[0] < 1 or kv.shape[0] >= 2**31:
        raise ValueError(f"kv: got {kv.shape[0]} rows, accepted: 1 to 2^31 - 1 (indices are int32)")
    check_tensor("indices", indices, dtypes=(torch.int32,), dim=3, device=q.device, shape_doc="(s_q, 1, topk)")
    if indices.shape[0] != s_q or indices.shape[1] != 1:
        raise ValueError(f"indices: expected shape ({s_q}, 1, topk) (q's s_q, one KV head), got {tuple(indices.shape)}")
    topk = indices.shape[2]
    check_problem(s_q, h_q, d_qk, topk)
    # the kernels read q by TMA and kv rows in 16-B pieces (a call the arch pads reads a copy of
    # q, but the check does not depend on the arch)
    check_aligned_strides("q", q, tma=True)
    check_aligned_strides("kv", kv)
    check_vector("attn_sink", attn_sink, torch.float32, h_q, "h_q", q.device)
    check_vector("topk_length", topk_length, torch.int32, s_q, "s_q", q.device)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,), dim=3, shape=(s_q, h_q, D_V), device=q.device,
                     shape_doc=f"(s_q, h_q, {D_V})")
        check_distinct_elements("out", out)
        # written by TMA on SM90; checked on every arch, so the layouts a call takes do not depend on it
        check_aligned_strides("out", out, tma=True)
    return s_q, h_q, d_qk, topk


def check_scale(sm_scale) -> None:
    """The softmax scale reaches the kernels as a float32: a finite real number (not a bool)."""
    if type(sm_scale) is float and abs(sm_scale) <= FP32_MAX:    # the common case, without the ABC checks
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real) or not abs(float(sm_scale)) <= FP32_MAX:
        raise ValueError(f"sm_scale: got {sm_scale!r}, accepted: a finite float")


def check_out_apart_from_inputs(out, q, kv, indices, attn_sink, topk_length) -> None:
    """out shares no bytes with an input (the kernel reads them while it writes out)."""
    for name, t in _inputs(q, kv, indices, attn_sink, topk_length):
        check_apart("out", out, name, t)


def _inputs(q, kv, indices, attn_sink, topk_length):
    """(name, tensor or None) of everything a call reads, in one order."""
    return ("q", q), ("kv", kv), ("indices", indices), ("attn_sink", attn_sink), ("topk_length", topk_length)


# A prefill step's calls share a few signatures (one per chunk length), so a small table cleared
# when full holds them (validate.remember)
_MAX_CHECKED = 64
_checked: dict = {}


def checked_call(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, tuning=None):
    """(plan, launcher, launch) of a call, its arguments checked: :func:`check_call`, out apart from
    the inputs, the device check and what the signature fixes (:func:`_prepare`: the plan, the
    kernel and its launch bound to the signature) once per call signature and ``tuning``
    (``validate.known_call`` / ``remember``); the scale and out's addresses against the inputs' on
    every call."""
    key = call_key(d_v, q, kv, indices, attn_sink, topk_length, out)
    if tuning is not None and key is not None:
        key = key, tuning
    inputs = None if out is None else _inputs(q, kv, indices, attn_sink, topk_length)
    known = known_call(_checked, key, out, inputs)
    if known is not None:
        check_scale(sm_scale)
        return known[2]
    dims = check_call(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)
    return remember(_checked, _MAX_CHECKED, key, dims, out, inputs,
                    lambda dims: _prepare(q, kv.shape[0], dims, attn_sink is not None, topk_length is not None, tuning))[2]


def _prepare(q, kv_rows: int, dims, has_attn_sink: bool, has_topk_length: bool, tuning) -> tuple:
    """(plan, launcher, launch) of a checked call of ``dims`` (s_q, h_q, d_qk, topk) and kv's rows
    on q's device, after the device check: all of it follows from the call signature (the device is
    part of it). ``launch``: the launcher's kernel bound to the signature's s_q and device
    (:meth:`PrefillLauncher.bind`), None for s_q 0."""
    _require_cuda(q)
    s_q, h_q, d_qk, topk = dims
    arch, num_sms = ops.device_facts(q.device)
    plan = plan_sparse_prefill(s_q, h_q, d_qk, topk, arch=arch, has_topk_length=has_topk_length, s_kv=kv_rows)
    launcher = launcher_of(plan, has_attn_sink, tuning)
    return plan, launcher, launcher.bind(s_q, num_sms) if s_q else None


# ----------------------------------------------------------------------------------- launches


class PrefillLauncher:
    """A config's kernel resolved once (kernel module, compiled entry), so that a call only
    allocates its outputs and launches. A call whose scale the config does not take
    (``Config.takes_scale``) runs the launcher of its ``any_scale`` form, made on first use. A call
    signature keeps its launch bound (:meth:`bind`), so that a repeated call skips the bundle and the
    grid."""

    __slots__ = ("mod", "cfg", "compiled", "_any_scale")

    def __init__(self, cfg):
        self.cfg = cfg
        self.mod = registry.kernel_module(OP, cfg.arch)
        self.compiled = self.mod.compile(cfg)
        self._any_scale = None

    def __call__(self, t: SparsePrefillTensors) -> None:
        """The kernel on ``t`` (heads already the kernel's, s_q >= 1) on the current stream."""
        if self.cfg.takes_scale(t.softmax_scale):
            self.mod.launch(self.compiled, self.cfg, t)
        else:
            self.any_scale()(t)

    def bind(self, s_q: int, num_sms: int):
        """This config's launch for calls of ``s_q`` (>= 1) tokens on a device of ``num_sms`` SMs (the
        kernel module's ``bind``): a function of the entry's tensors and a scale the config takes."""
        return self.mod.bind(self.compiled, self.cfg, s_q, num_sms)

    def any_scale(self) -> "PrefillLauncher":
        """The launcher of this config's form for every scale (itself where that is this config)."""
        if self._any_scale is None:
            cfg = self.cfg.any_scale()
            self._any_scale = self if cfg == self.cfg else _launcher_of_config(cfg)
        return self._any_scale


_by_config: dict = {}   # (arch, config) -> PrefillLauncher
# (plan, sink, tuning) -> its config's launcher: a call's lookup without resolving the config
# again; a plan holds the call's lengths, so the table is cleared when full
_by_plan: dict = {}
_MAX_PLANS = 256


def launcher_of(plan: SparsePrefillPlan, has_attn_sink: bool, tuning=None) -> PrefillLauncher:
    """The process's one :class:`PrefillLauncher` for the config a plan's calls compile
    (``tuning``: the arch's tuning type, a variant; None: the shape's rule). Plans that differ only
    in what the config ignores (the lengths) share it, and a plan fact that a config rule reads
    (whether kv fits the L2) picks its own."""
    key = (plan, has_attn_sink, tuning)
    launcher = _by_plan.get(key)
    if launcher is None:
        launcher = _launcher_of_config(registry.config_module(plan.op, plan.arch).config_for(plan, has_attn_sink, tuning))
        if len(_by_plan) >= _MAX_PLANS:
            _by_plan.clear()
        _by_plan[key] = launcher
    return launcher


def _launcher_of_config(cfg) -> PrefillLauncher:
    launcher = _by_config.get((cfg.arch, cfg))
    if launcher is None:
        launcher = _by_config[cfg.arch, cfg] = PrefillLauncher(cfg)
    return launcher


def _run(plan: SparsePrefillPlan, launcher: PrefillLauncher, launch, q, kv, indices, softmax_scale: float, attn_sink,
         topk_length, out) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The call on checked tensors (kv and indices with their unit head dim), launched by
    ``launch`` (``launcher`` bound to the call signature; None: ``launcher`` on the call's bundle) or,
    for a scale the config does not take, by ``launcher``; returns (out, max_logits, lse), out
    allocated when not given. Heads padded where the plan says: q and the sink copied with zero /
    -inf heads, the kernel's out, max_logits and lse of the padded heads, the first h_q copied back."""
    s_q, h = plan.s_q, plan.kernel_h_q
    device = q.device
    if out is None:
        out = torch.empty((s_q, plan.h_q, plan.d_v), dtype=torch.bfloat16, device=device)
    max_logits = torch.empty((s_q, h), dtype=torch.float32, device=device)
    lse = torch.empty((s_q, h), dtype=torch.float32, device=device)
    if not s_q:
        return out, max_logits[:, :plan.h_q], lse[:, :plan.h_q]
    if launch is None or not launcher.cfg.takes_scale(softmax_scale):
        launch = _launch_bundle(launcher)
    if not plan.padded:
        launch(q, kv, indices, topk_length, attn_sink, out, max_logits, lse, softmax_scale)
        return out, max_logits, lse
    pad = h - plan.h_q
    q = torch.nn.functional.pad(q, (0, 0, 0, pad))        # zero heads: scores 0, harmless, dropped below
    sink = None if attn_sink is None else torch.nn.functional.pad(attn_sink, (0, pad), value=float("-inf"))
    out_k = torch.empty((s_q, h, plan.d_v), dtype=torch.bfloat16, device=device)
    launch(q, kv, indices, topk_length, sink, out_k, max_logits, lse, softmax_scale)
    out.copy_(out_k[:, :plan.h_q])
    return out, max_logits[:, :plan.h_q].contiguous(), lse[:, :plan.h_q].contiguous()


def _launch_bundle(launcher: PrefillLauncher):
    """``launcher`` as a bound launch (the entry's tensors and the scale): the call's bundle made
    and launched, the scale routed by the launcher."""
    return lambda *tensors_and_scale: launcher(SparsePrefillTensors(*tensors_and_scale))


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = D_V,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill, FlashMLA's ``flash_mla_sparse_fwd`` (the vLLM build's, with ``out``).

    q (s_q, h_q, d_qk) bf16, h_q in 8, 16, 32, 64, 128, d_qk 576 or 512, any strides with a unit
    last dim; kv (s_kv, 1, d_qk) bf16; indices (s_q, 1, topk) int32, topk a multiple of 64 (a
    position is invalid when negative, >= s_kv or past ``topk_length``); ``attn_sink`` (h_q,) fp32
    (out scaled by 1 / (1 + exp(sink - lse))); ``topk_length`` (s_q,) int32; ``out`` (s_q, h_q, 512)
    bf16 written in place. Returns (out, max_logits, lse): max_logits (s_q, h_q) fp32 = max over
    the valid positions of ``sm_scale * q.k``; lse (s_q, h_q) fp32, natural log, without the sink.
    A token with no valid position gets out 0, max_logits -inf, lse +inf.
    """
    if torch.compiler.is_compiling():
        s_q, h_q, _, _ = check_call(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)
        _require_cuda(q)
        if out is None:
            out = torch.empty(s_q, h_q, D_V, dtype=torch.bfloat16, device=q.device)
        t = SparsePrefillTensors(q, kv, indices, topk_length, attn_sink, out, softmax_scale=float(sm_scale))
        arch, _ = ops.device_facts(q.device)    # (the shapes were checked by check_call; the op plans)
        max_logits, lse = torch.ops.cute_mla.sparse_prefill(*t[:_N_INPUTS], out, t.softmax_scale, arch)
        return out, max_logits, lse
    return eager_call(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)


def eager_call(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, tuning=None):
    """:func:`flash_mla_sparse_fwd` outside a trace: checked, planned and its kernel resolved once
    per call signature, then launched on q's device. ``tuning``: the kernel's variant knobs (the
    arch's tuning type; None: the shape's rule), so that a benchmark's variant pays the same host
    path as the call."""
    plan, launcher, launch = checked_call(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, tuning)
    return call_on_device_of(q, _run, plan, launcher, launch, q, kv, indices, float(sm_scale), attn_sink, topk_length,
                             out)


# ------------------------------------------------------------------------------ the traced form


_N_INPUTS = len(SPARSE_PREFILL_INPUTS)
assert SparsePrefillTensors._fields[:_N_INPUTS] == SPARSE_PREFILL_INPUTS, "the op's inputs lead the bundle, in order"
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_lib.define("sparse_prefill(" + ", ".join(f"Tensor{'?' if n in SPARSE_PREFILL_OPTIONAL else ''} {n}"
                                          for n in SPARSE_PREFILL_INPUTS)
            + ", Tensor(a!) out, float softmax_scale, str arch) -> (Tensor, Tensor)")


def _op_impl(q, kv, indices, topk_length, attn_sink, out, softmax_scale, arch):
    # what a trace cannot check (neg bits, base pointers, out apart from the inputs), on the real
    # tensors (q's and out's TMA rules are checked on every arch, as check_call does)
    for name, t in (("indices", indices), ("topk_length", topk_length), ("attn_sink", attn_sink)):
        if t is not None:
            check_not_neg(name, t)
    check_deferred((("q", q), ("out", out), ("kv", kv)), ())      # their neg bits and base pointers
    check_out_apart_from_inputs(out, q, kv, indices, attn_sink, topk_length)
    s_q, h, d_qk = q.shape
    plan = plan_sparse_prefill(s_q, h, d_qk, indices.shape[-1], arch=arch, has_topk_length=topk_length is not None,
                               s_kv=kv.shape[0])
    with on_device_of(q):
        _, max_logits, lse = _run(plan, launcher_of(plan, attn_sink is not None), None, q, kv, indices, softmax_scale,
                                  attn_sink, topk_length, out)
    return max_logits, lse


def _op_fake(q, kv, indices, topk_length, attn_sink, out, softmax_scale, arch):
    s_q, h, _ = q.shape
    return q.new_empty(s_q, h, dtype=torch.float32), q.new_empty(s_q, h, dtype=torch.float32)


_lib.impl("sparse_prefill", _op_impl, "CUDA")
torch.library.register_fake(f"{NAMESPACE}::sparse_prefill", _op_fake, lib=_lib)

