"""Kernels by name, for the ``cute-mla compile`` playground and the compile tests.

``compile_to_dir(name, arch, out_dir, ...)`` compiles one kernel for one arch on any machine (no
GPU), keeps its PTX and cubin in ``out_dir`` and returns a short report (files, registers, shared
memory, spills) read from the cubin with the cuobjdump of the ``nvidia-cuda-cuobjdump`` wheel.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from typing import List, Optional

KERNELS = ("sparse_decode", "combine", "scheduler")


def _compile(name: str, arch: str, out_dir: str, h_q: int, split: bool, has_topk_length: bool, has_attn_sink: bool):
    if name == "sparse_decode":
        if arch == "sm_90a":
            from .sm90 import sparse_decode as mod
            cfg = mod.Sm90SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink)
        else:
            from .sm100 import sparse_decode as mod
            cfg = mod.Sm100SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink)
        return mod.compile_sparse_decode(cfg, dump_dir=out_dir)
    if name == "combine":
        from . import combine as mod
        return mod.compile_combine(mod.combine_config(arch=arch, h_q=h_q, has_attn_sink=has_attn_sink, num_sm_parts=132), dump_dir=out_dir)
    if name == "scheduler":
        from ..scheduler import device as mod
        return mod.compile_scheduler(mod.SchedulerKernelConfig(arch=arch), dump_dir=out_dir)
    raise ValueError(f"kernel: got {name!r}, accepted: {', '.join(KERNELS)}")


def find_tool(name: str) -> Optional[str]:
    """cuobjdump / nvdisasm: on PATH, or from the nvidia-cuda-* wheels."""
    path = shutil.which(name)
    if path:
        return path
    try:
        import nvidia
        for root in nvidia.__path__:
            hits = glob.glob(os.path.join(root, "*", "bin", name))
            if hits:
                return hits[0]
    except ImportError:
        pass
    return None


def resource_usage(cubin: str) -> List[str]:
    """One line per kernel: registers, shared memory, stack and spills (cuobjdump --dump-resource-usage)."""
    tool = find_tool("cuobjdump")
    if tool is None:
        return ["(cuobjdump not found: pip install nvidia-cuda-cuobjdump for resource usage)"]
    txt = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
    lines, fn = [], None
    for line in txt.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            fn = m.group(1)
        elif "REG:" in line and fn:
            kv = dict(re.findall(r"(\w+):(\S+)", line))
            lines.append(f"{fn[:60]}: registers {kv.get('REG')}, shared {kv.get('SHARED')} B, stack {kv.get('STACK')} B, "
                         f"local {kv.get('LOCAL')} B")
    return lines or [txt.strip()[:500]]


def compile_to_dir(name: str, arch: str, out_dir: str, *, h_q: int = 64, split: bool = False,
                   has_topk_length: bool = False, has_attn_sink: bool = False) -> List[str]:
    from .compile import check_arch

    check_arch(arch)
    if name not in KERNELS:
        raise ValueError(f"kernel: got {name!r}, accepted: {', '.join(KERNELS)}")
    os.makedirs(out_dir, exist_ok=True)
    _compile(name, arch, out_dir, h_q, split, has_topk_length, has_attn_sink)
    ptx = sorted(glob.glob(os.path.join(out_dir, f"*.{arch}.ptx")), key=os.path.getmtime)
    cubin = sorted(glob.glob(os.path.join(out_dir, f"*.{arch}.cubin")), key=os.path.getmtime)
    report = [f"ptx:   {ptx[-1] if ptx else '(none)'}", f"cubin: {cubin[-1] if cubin else '(none)'}"]
    if cubin:
        report += resource_usage(cubin[-1])
    return report
