"""Read what a compile left in its dump directory: PTX, cubin, SASS, resources, wgmma issue pattern.

Used by the CPU compile tests and reusable by the CLI. Nothing here needs a GPU; SASS and resource
usage come from the ``cuobjdump`` / ``nvdisasm`` of the ``nvidia-cuda-cuobjdump`` /
``nvidia-cuda-nvdisasm`` wheels (or the ones on PATH).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Dict, Optional, Tuple


def find_artifacts(dump_dir: str, arch: str) -> Tuple[Optional[str], Optional[str]]:
    """(ptx, cubin) paths of the newest compile in ``dump_dir`` (None where missing)."""

    def newest(ext):
        files = sorted(glob.glob(os.path.join(dump_dir, f"*.{arch}.{ext}")), key=os.path.getmtime)
        return files[-1] if files else None

    return newest("ptx"), newest("cubin")


def read_ptx(dump_dir: str, arch: str = "*") -> str:
    """Text of the one PTX file a single compile left in ``dump_dir`` (error if there is not exactly one)."""
    files = glob.glob(os.path.join(dump_dir, f"*.{arch}.ptx"))
    if len(files) != 1:
        raise ValueError(f"expected one {arch} PTX file in {dump_dir}, found {files}")
    with open(files[0]) as f:
        return f.read()


def find_tool(name: str) -> Optional[str]:
    """``cuobjdump`` / ``nvdisasm``: on PATH, else from the nvidia-cuda-* wheels (nvidia/*/bin)."""
    path = shutil.which(name)
    if path:
        return path
    try:
        import nvidia  # namespace package of the NVIDIA wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        hits = sorted(glob.glob(os.path.join(root, "*", "bin", name)))
        if hits:
            return hits[0]
    return None


def sass(cubin: str) -> str:
    """SASS text of a cubin (``cuobjdump -sass``). Raises FileNotFoundError without cuobjdump."""
    tool = find_tool("cuobjdump")
    if tool is None:
        raise FileNotFoundError("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    return subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: str) -> Dict[str, int]:
    """REG / STACK / SHARED / LOCAL ... of the (single) kernel in ``cubin`` as ints."""
    tool = find_tool("cuobjdump")
    if tool is None:
        raise FileNotFoundError("cuobjdump not found: pip install nvidia-cuda-cuobjdump")
    txt = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    for line in txt.splitlines():
        if "REG:" in line:
            return {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)}
    raise ValueError(f"no resource line in cuobjdump output: {txt[:300]!r}")


@dataclass(frozen=True)
class HgmmaStats:
    total: int  # HGMMA instructions
    with_gsb0: int  # ... that carry the gsb0 scoreboard (the last of a chain, or all if serialized)
    depbar_gsb0: int  # WARPGROUP.DEPBAR.LE gsb0 waits

    @property
    def serialized(self) -> bool:
        """ptxas serialized the chains: every HGMMA waits on its own result."""
        return self.total > 0 and self.with_gsb0 == self.total


def hgmma_stats(sass_text: str) -> HgmmaStats:
    lines = [ln for ln in sass_text.splitlines() if "HGMMA" in ln]
    return HgmmaStats(
        total=len(lines),
        with_gsb0=sum("gsb0" in ln for ln in lines),
        depbar_gsb0=len(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0", sass_text)),
    )


def local_memory_ops(sass_text: str) -> int:
    """Spill traffic: LDL/STL instructions."""
    return len(re.findall(r"\b(?:LDL|STL)(?:\.\w+)*\b", sass_text))


def tensor_map_params(ptx: str) -> int:
    """Kernel parameters that are TMA descriptors: 128-byte, 64-byte aligned ``.param`` blobs."""
    return len(re.findall(r"\.param\s+\.align\s+64\s+\.b8\s+\S+\[128\]", ptx))


def setmaxnreg(ptx: str) -> Dict[str, list]:
    """setmaxnreg targets in program order: {'inc': [...], 'dec': [...]}."""
    out: Dict[str, list] = {"inc": [], "dec": []}
    for kind, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx):
        out[kind].append(int(n))
    return out
