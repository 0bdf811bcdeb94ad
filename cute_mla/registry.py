"""The op registry: which kernel module runs each (op, arch), and the protocol a kernel module keeps.

An *op* is one public entry point with its own API and validation, tensor bundle and plan
(``sparse_decode``: ``flash_mla_with_kvcache``, :class:`~cute_mla.kernels.SparseDecodeTensors`,
:func:`~cute_mla.plan.plan_sparse_decode`). Its main kernel differs per arch; its helper kernels
(the split-KV combine, the device scheduler) are compiled for any arch from one module. The
launcher, the custom ops, ``cute-mla warmup``, the playground and the CLI find kernels here and
nowhere else; ``docs/architecture.md`` ("Adding an op") says what a new op adds.

Every module named here keeps one protocol (checked by ``tests/test_registry.py``):

* ``Config``: its frozen, hashable compile configuration (shapes are runtime values);
* ``compile(cfg, dump_dir=None) -> CompiledKernel``: compiled once per config, in the process and
  in the disk cache, against fake tensors, so it needs no GPU;
* ``launch(compiled, cfg, ...)``: runs on torch's current stream, no host synchronization, no
  allocation (a main kernel takes the op's tensor bundle);
* a main kernel also has ``Kernel`` (the object compiled: its ``__call__`` is the host entry, whose
  tensor parameters are ``ENTRY``, the bundle fields in order, then kernel-only ones), and a
  plain-Python config module (no DSL import; the kernel module re-exports it) with ``Config``,
  ``Tuning`` (its variant-knob type, or None), ``kernel_config(**fields)`` (any valid config by
  keyword: tests, tools), ``config_for(plan, has_attn_sink, tuning=None) -> Config`` (the config a
  plan's calls compile), ``tensor_maps(cfg)`` (the TMA descriptors it builds) and, for an op with a
  split-KV workspace, ``ACCUM_DTYPE`` (what its split variant writes). A sparse prefill ``Config``
  also says which scales it is exact at (``takes_scale(softmax_scale)``) and gives the form of
  itself that takes every scale (``any_scale()``), which the launcher runs for the others; its
  kernel module also binds a launch to a call signature (``bind(compiled, cfg, s_q, num_sms)``: a
  function of the ``ENTRY`` tensors and the scale, its grid fixed), which the API keeps per
  signature.

Nothing here imports a kernel module until asked (:func:`kernel_module`), and plans read only the
config modules (:func:`config_module`): ``import cute_mla`` stays cheap and plans work without the
DSL loaded.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, Iterator, Mapping, Tuple

from . import archs


@dataclass(frozen=True)
class KernelRef:
    """A kernel: its name in plans, reports and file names, the module that keeps the protocol, and
    (main kernels) its plain-Python config module."""

    name: str
    module: str
    config: str = ""


@dataclass(frozen=True)
class OpSpec:
    """One op: its name, what it computes, where its plan and its kernels live."""

    name: str
    summary: str
    api: Tuple[str, ...]           # the public functions that call it
    bundle: str                    # "module:Name" of its tensor bundle (a NamedTuple: inputs first)
    plan: str                      # "module:function" that plans one call
    variants: str                  # "module:function" (arch) -> every (kernel, config) its plans can reach
    kernels: Mapping[str, KernelRef]   # arch name -> the main kernel
    helpers: Mapping[str, KernelRef]   # helper kernels, by name (one module for every arch)

    def kernel_names(self) -> Tuple[str, ...]:
        """The names ``cute-mla compile --kernel`` takes for this op: its main kernel, then helpers."""
        return (self.name,) + tuple(self.helpers)

    def kernel(self, arch: str) -> KernelRef:
        """The main kernel on ``arch``, or a ValueError naming the archs it has one for."""
        ref = self.kernels.get(arch)
        if ref is None:
            pending = PENDING.get((self.name, arch))
            why = f" ({pending})" if pending else ""
            raise ValueError(f"arch: the {self.name} op has no kernel for {arch!r}{why}; registered: "
                             f"{', '.join(self.kernels)}")
        return ref


SPARSE_DECODE = OpSpec(
    name="sparse_decode",
    summary="sparse MLA decode over a paged FP8 cache (FlashMLA's flash_mla_with_kvcache with indices)",
    api=("get_mla_metadata", "flash_mla_with_kvcache"),
    bundle="cute_mla.kernels:SparseDecodeTensors",
    plan="cute_mla.plan.sparse_decode:plan_sparse_decode",
    variants="cute_mla.plan.sparse_decode:kernel_variants",
    kernels={archs.SM90.name: KernelRef("sm90_sparse_decode", "cute_mla.kernels.sm90.sparse_decode",
                                        "cute_mla.kernels.sm90.config"),
             archs.SM100.name: KernelRef("sm100_sparse_decode", "cute_mla.kernels.sm100.sparse_decode",
                                         "cute_mla.kernels.sm100.config")},
    helpers={"combine": KernelRef("combine", "cute_mla.kernels.combine"),
             "scheduler": KernelRef("scheduler", "cute_mla.scheduler.device")},
)

SPARSE_PREFILL = OpSpec(
    name="sparse_prefill",
    summary="sparse MLA prefill over bf16 rows (FlashMLA's flash_mla_sparse_fwd)",
    api=("flash_mla_sparse_fwd",),
    bundle="cute_mla.kernels:SparsePrefillTensors",
    plan="cute_mla.plan.sparse_prefill:plan_sparse_prefill",
    variants="cute_mla.plan.sparse_prefill:kernel_variants",
    kernels={archs.SM90.name: KernelRef("sm90_sparse_prefill", "cute_mla.kernels.sm90.sparse_prefill",
                                        "cute_mla.kernels.sm90.prefill_config"),
             archs.SM100.name: KernelRef("sm100_sparse_prefill", "cute_mla.kernels.sm100.sparse_prefill",
                                         "cute_mla.kernels.sm100.prefill_config")},
    helpers={},
)

OPS: Dict[str, OpSpec] = {op.name: op for op in (SPARSE_DECODE, SPARSE_PREFILL)}
# (op, arch) pairs with no kernel yet, and why: every other pair of OPS x archs has one
# (tests/test_registry.py holds the registry to that).
PENDING: Dict[Tuple[str, str], str] = {}
DEFAULT_OP = SPARSE_DECODE.name


def op(name: str) -> OpSpec:
    """The spec of an op name, or a ValueError naming the registered ones."""
    spec = OPS.get(name)
    if spec is None:
        raise ValueError(f"op: got {name!r}, accepted: {', '.join(OPS)}")
    return spec


def entries() -> Iterator[Tuple[str, str]]:
    """Every registered (op, arch) pair."""
    for spec in OPS.values():
        for arch in spec.kernels:
            yield spec.name, arch


def kernel_module(op_name: str, arch: str, kernel: str = None) -> ModuleType:
    """The module of an op's kernel on an arch: its main kernel (``kernel`` None or the op's
    name), or one of its helpers (``"combine"``, ``"scheduler"``)."""
    spec = op(op_name)
    archs.get(arch)
    if kernel is None or kernel == spec.name:
        ref = spec.kernel(arch)
    else:
        ref = spec.helpers.get(kernel)
        if ref is None:
            raise ValueError(f"kernel: got {kernel!r}, accepted for op {spec.name}: {', '.join(spec.kernel_names())}")
    return importlib.import_module(ref.module)


def config_module(op_name: str, arch: str) -> ModuleType:
    """The plain-Python config module of an op's main kernel on an arch (``Config``, ``config_for``,
    ``tensor_maps``, ...): what plans and warmup read without loading the DSL."""
    archs.get(arch)
    return importlib.import_module(op(op_name).kernel(arch).config)


def _resolve(ref: str):
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def bundle_type(op_name: str):
    """The op's tensor bundle (``OpSpec.bundle``)."""
    return _resolve(op(op_name).bundle)


def plan_function(op_name: str):
    """The op's planner (``OpSpec.plan``)."""
    return _resolve(op(op_name).plan)


def variants(op_name: str, arch: str, **selection):
    """Every (kernel name, config) the op's plans can reach on ``arch`` (``OpSpec.variants``; its
    keyword ``selection`` narrows them: ``h_qs``, ``formats``, ``kernels``): what ``cute-mla warmup``
    compiles and the registry's compile tests cover."""
    archs.get(arch)
    return _resolve(op(op_name).variants)(arch, **selection)


def describe() -> str:
    """The registry as ``cute-mla ops`` prints it."""
    lines = []
    for spec in OPS.values():
        lines.append(f"{spec.name}: {spec.summary}")
        lines.append(f"  api      {', '.join(spec.api)}")
        lines.append(f"  plan     {spec.plan}")
        for arch, ref in spec.kernels.items():
            lines.append(f"  {arch:<9} {ref.name:<20} {ref.module}")
        for (name, arch), why in PENDING.items():
            if name == spec.name:
                lines.append(f"  {arch:<9} {'(none)':<20} {why}")
        for name, ref in spec.helpers.items():
            lines.append(f"  {'any arch':<9} {name:<20} {ref.module}")
    return "\n".join(lines)
