"""Kernels by name, for the ``cute-mla compile`` playground and the compile tests.

``compile_to_dir(kernel, arch, out_dir, op=..., ...)`` compiles one of an op's kernels (found in
``cute_mla.registry``) for one arch on any machine (no GPU), keeps its PTX and cubin in ``out_dir`` as ``<kernel>-<arch>-<variant>.{ptx,cubin}`` and
returns a short report (files, registers, static and dynamic shared memory, TMEM, spills, PTX
instruction counts) read from the cubin with the cuobjdump of the ``nvidia-cuda-cuobjdump`` wheel.
The kernels are the ones the launcher runs: each arch's main kernel through its module's
``kernel_config``, and the combine with the o_accum dtype the arch's split kernel writes.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import List, Optional, Sequence

from .. import archs, registry
from ..formats import V32, format_named
from . import inspect


def kernel_names(op: str = registry.DEFAULT_OP):
    """The kernels ``cute-mla compile --kernel`` takes for an op (the registry's)."""
    return registry.op(op).kernel_names()


def _compile(op: str, name: str, arch: str, out_dir: str, h_q: int, split: bool, has_topk_length: bool,
             has_attn_sink: bool, decode: dict, tuning=None):
    """Compile one kernel into ``out_dir``; returns (its module, its config)."""
    mod = registry.kernel_module(op, arch, name)
    if name == registry.SPARSE_PREFILL.name:
        # a prefill kernel takes the key width of the named format; it has no split or extra pool
        cfg = mod.kernel_config(h_q=h_q, d_qk=format_named(decode["format"]).d_qk, has_topk_length=has_topk_length,
                                has_attn_sink=has_attn_sink, tuning=tuning)
    elif name == registry.op(op).name:
        cfg = mod.kernel_config(h_q=h_q, split=split, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink,
                                tuning=tuning, **decode)
    elif name == "combine":
        cfg = mod.combine_config(arch=arch, h_q=h_q, has_attn_sink=has_attn_sink,
                                 num_sm_parts=archs.get(arch).default_num_sms,
                                 accum_dtype=registry.config_module(op, arch).ACCUM_DTYPE)
    else:
        cfg = mod.Config(arch=arch)
    mod.compile(cfg, dump_dir=out_dir)
    return mod, cfg


def variant_name(name: str, h_q: int, split: bool, has_topk_length: bool, has_attn_sink: bool, decode: dict,
                 variant: Sequence[str] = (), main: str = registry.DEFAULT_OP) -> str:
    """The file-name tag of a compiled variant: what sets it apart from the kernel's others
    (``variant``: the key=value pairs of a kernel variant, e.g. ``prefetch_rows=false``)."""
    if name == "scheduler":
        return "default"
    parts = [f"h{h_q}"]
    if name == registry.SPARSE_PREFILL.name:
        parts.append(f"d{format_named(decode.get('format', V32.name)).d_qk}")
        parts += ["tl"] if has_topk_length else []
    elif name == main:
        parts.append("split" if split else "nosplit")
        fmt = decode.get("format", V32.name)
        parts += [] if format_named(fmt) is V32 else [re.sub(r"[^A-Za-z0-9]+", "", fmt).lower()]
        parts += ["tl"] if has_topk_length else []
        parts += ["extra"] if decode.get("has_extra") else []
        parts += ["xtl"] if decode.get("has_extra_topk_length") else []
    parts += ["sink"] if has_attn_sink else []
    parts += [re.sub(r"[^A-Za-z0-9_.]+", "_", pair) for pair in variant]
    return "-".join(parts)


# PTX instruction families a reader looks for first (the compile tests check them per arch).
INSTRUCTIONS = (("wgmma", "wgmma.mma_async"), ("tcgen05.mma", "tcgen05.mma"), ("TMA", "cp.async.bulk.tensor"),
                ("gather4", "tile::gather4"), ("setmaxnreg", "setmaxnreg"), ("ld.global", "ld.global"))


def resource_lines(cubin: str, ptx: Optional[str] = None, smem_dynamic: Optional[int] = None,
                   tmem_columns: Optional[int] = None) -> List[str]:
    """Registers, shared memory (static from the cubin, dynamic from the kernel's struct), TMEM
    columns (SM100), stack and local memory (spills), and the instruction counts of the PTX."""
    lines = []
    if inspect.find_tool("cuobjdump") is None:
        lines.append("(cuobjdump not found: pip install nvidia-cuda-cuobjdump for resource usage)")
    else:
        u = inspect.resource_usage(cubin)
        lines.append(f"registers {u.get('REG')}, shared {u.get('SHARED')} B (static), stack {u.get('STACK')} B, "
                     f"local {u.get('LOCAL')} B")
    if smem_dynamic is not None:
        lines.append(f"dynamic shared memory {smem_dynamic} B (of {archs.SMEM_PER_CTA})"
                     + (f", TMEM {tmem_columns} columns" if tmem_columns is not None else ""))
    if ptx is not None:
        with open(ptx) as f:
            text = f.read()
        counts = [f"{label} {text.count(token)}" for label, token in INSTRUCTIONS if token in text]
        lines.append("PTX: " + ", ".join(counts))
    return lines


def compile_to_dir(name: str, arch: str, out_dir: str, *, op: str = registry.DEFAULT_OP, h_q: int = 64,
                   split: bool = False, has_topk_length: bool = False, has_attn_sink: bool = False,
                   format: str = V32.name, has_extra: bool = False, has_extra_topk_length: bool = False,
                   variant: Sequence[str] = ()) -> List[str]:
    """Compile one variant of an op's kernel and keep it as ``<kernel>-<arch>-<variant>.{ptx,cubin}``
    in ``out_dir`` (so variants compiled into one directory stay apart); returns the report lines.
    ``name``: the op's main kernel (its name) or a helper (``registry.OpSpec.kernel_names``).
    ``format`` names the cache format (V3.2, V4); ``has_extra`` / ``has_extra_topk_length``: the V4
    extra pool (main kernel only). ``variant``: key=value pairs of the kernel's ``Tuning`` (as
    ``cute-mla bench --variant`` takes them)."""
    archs.check_arch(arch)
    main = registry.op(op).name
    if name not in kernel_names(op):
        raise ValueError(f"--kernel: got {name!r}, accepted for op {op}: {', '.join(kernel_names(op))}")
    tuning = None
    if variant:
        if name != main:
            raise ValueError(f"--variant: kernel variants apply to --kernel {main}, got --kernel {name}")
        from .bench import parse_variant
        tuning = parse_variant(variant, arch=arch, op=op)
    os.makedirs(out_dir, exist_ok=True)
    decode = dict(format=format_named(format).name, has_extra=has_extra, has_extra_topk_length=has_extra_topk_length)
    tag = variant_name(name, h_q, split, has_topk_length, has_attn_sink, decode, variant, main)
    stem = os.path.join(out_dir, f"{name}-{arch}-{tag}")
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as build:
        mod, cfg = _compile(op, name, arch, build, h_q, split, has_topk_length, has_attn_sink, decode, tuning)
        found = inspect.find_artifacts(build, arch)
        kept = []
        for src, ext in zip(found, ("ptx", "cubin")):
            if src is not None:
                shutil.move(src, f"{stem}.{ext}")
                kept.append(f"{stem}.{ext}")
            else:
                kept.append(None)
    ptx, cubin = kept
    report = [f"ptx:   {ptx or '(none)'}", f"cubin: {cubin or '(none)'}"]
    if cubin:
        smem = mod.smem_bytes(cfg) if hasattr(mod, "smem_bytes") else None
        tmem = mod.tmem_columns(cfg) if hasattr(mod, "tmem_columns") else None
        report += resource_lines(cubin, ptx, smem, tmem)
    return report
