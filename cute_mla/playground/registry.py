"""Kernels by name, for the ``cute-mla compile`` playground and the compile tests.

``compile_to_dir(name, arch, out_dir, ...)`` compiles one kernel for one arch on any machine (no
GPU), keeps its PTX and cubin in ``out_dir`` and returns a short report (files, registers, shared
memory, spills) read from the cubin with the cuobjdump of the ``nvidia-cuda-cuobjdump`` wheel.
The kernels are the ones the launcher runs: each arch's sparse decode kernel through its module's
``kernel_config``, and the split variants with the arch's o_accum dtype.
"""

from __future__ import annotations

import os
from typing import List

from .. import archs
from ..formats import V32
from ..interface.launcher import kernel_module
from . import inspect

KERNELS = ("sparse_decode", "combine", "scheduler")


def _compile(name: str, arch: str, out_dir: str, h_q: int, split: bool, has_topk_length: bool, has_attn_sink: bool,
             decode: dict):
    spec = archs.get(arch)
    if name == "sparse_decode":
        mod = kernel_module(arch)
        cfg = mod.kernel_config(h_q=h_q, split=split, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink,
                                **decode)
        return mod.compile_sparse_decode(cfg, dump_dir=out_dir)
    if name == "combine":
        from ..kernels import combine as mod
        cfg = mod.combine_config(arch=arch, h_q=h_q, has_attn_sink=has_attn_sink, num_sm_parts=spec.default_num_sms,
                                 accum_dtype=spec.accum_dtype)
        return mod.compile_combine(cfg, dump_dir=out_dir)
    if name == "scheduler":
        from ..scheduler import device as mod
        return mod.compile_scheduler(mod.SchedulerKernelConfig(arch=arch), dump_dir=out_dir)
    raise ValueError(f"kernel: got {name!r}, accepted: {', '.join(KERNELS)}")


def resource_lines(cubin: str) -> List[str]:
    """Registers, shared memory, stack and local memory of the cubin's kernel, as one line."""
    if inspect.find_tool("cuobjdump") is None:
        return ["(cuobjdump not found: pip install nvidia-cuda-cuobjdump for resource usage)"]
    u = inspect.resource_usage(cubin)
    return [f"registers {u.get('REG')}, shared {u.get('SHARED')} B (static), stack {u.get('STACK')} B, local {u.get('LOCAL')} B"]


def compile_to_dir(name: str, arch: str, out_dir: str, *, h_q: int = 64, split: bool = False,
                   has_topk_length: bool = False, has_attn_sink: bool = False, d_qk: int = V32.d_qk,
                   has_extra: bool = False, has_extra_topk_length: bool = False) -> List[str]:
    """``d_qk`` names the cache format (576: V3.2, 512: V4); ``has_extra`` / ``has_extra_topk_length``:
    the V4 extra pool (sparse_decode only)."""
    archs.check_arch(arch)
    if name not in KERNELS:
        raise ValueError(f"kernel: got {name!r}, accepted: {', '.join(KERNELS)}")
    os.makedirs(out_dir, exist_ok=True)
    _compile(name, arch, out_dir, h_q, split, has_topk_length, has_attn_sink,
             dict(d_qk=d_qk, has_extra=has_extra, has_extra_topk_length=has_extra_topk_length))
    ptx, cubin = inspect.find_artifacts(out_dir, arch)
    report = [f"ptx:   {ptx or '(none)'}", f"cubin: {cubin or '(none)'}"]
    if cubin:
        report += resource_lines(cubin)
    return report
