"""The one compile seam of cute-mla.

Every kernel is compiled through :func:`compile_cached`, keyed by a frozen, hashable configuration
(arch, dtypes, head counts, variant flags ...). Compiling happens against *fake* tensors with
symbolic dims, so it needs no GPU, and with ``--enable-tvm-ffi`` plus the TVM-FFI environment
stream, so the compiled function is called with plain torch tensors and follows torch's current
stream (CUDA graph capture included).

``cute.compile`` is not thread-safe (MLIR keeps thread-local state) and never memoises, so this
module keeps one process-wide cache guarded by one lock.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Optional

from ..archs import check_arch

_lock = threading.RLock()
_cache: Dict[Hashable, "CompiledKernel"] = {}


@dataclass(frozen=True)
class CompiledKernel:
    """A compiled kernel: the callable TVM-FFI function and where its artifacts went (if kept)."""

    key: Hashable
    fn: Any  # tvm_ffi.Function: call it with torch tensors and Python scalars
    dump_dir: Optional[str] = None


def compile_options(arch: str, dump_dir: Optional[str] = None, extra: str = "") -> str:
    """The option string every cute-mla kernel is compiled with."""
    opts = f"--enable-tvm-ffi --gpu-arch {check_arch(arch)}"
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        opts += f" --keep-ptx --keep-cubin --dump-dir={dump_dir}"
    if extra:
        opts += " " + extra
    return opts


def compile_cached(key: Hashable, build: Callable[[Optional[str]], Any], dump_dir: Optional[str] = None) -> CompiledKernel:
    """Return the compiled kernel for ``key``, compiling it once with ``build(dump_dir)``.

    ``build`` must return the object of ``cute.compile``. A request with ``dump_dir`` always
    recompiles (the caller wants the PTX/cubin on disk) and does not replace the cached entry.
    """
    with _lock:
        if dump_dir is None and key in _cache:
            return _cache[key]
        compiled = build(dump_dir)
        fn = compiled.__tvm_ffi_object__() if hasattr(compiled, "__tvm_ffi_object__") else compiled
        entry = CompiledKernel(key=key, fn=fn, dump_dir=dump_dir)
        if dump_dir is None:
            _cache[key] = entry
        return entry


def cached_keys():
    with _lock:
        return list(_cache)
