"""The one compile seam of cute-mla.

Every kernel is compiled through :func:`compile_cached`, keyed by a frozen, hashable configuration
(arch, dtypes, head counts, variant flags ...). Compiling happens against *fake* tensors with
symbolic dims, so it needs no GPU, and with ``--enable-tvm-ffi`` plus the TVM-FFI environment
stream, so the compiled function is called with plain torch tensors and follows torch's current
stream (CUDA graph capture included).

``cute.compile`` is not thread-safe (MLIR keeps thread-local state) and never memoises, so this
module keeps one process-wide cache guarded by one lock.

Compiled kernels also persist on disk, so a new process (an engine's worker, a restart) loads them
in milliseconds instead of compiling for seconds: each is exported as an object file
(``export_to_c``; the in-memory JIT path links the very same object bytes) named by a hash of its
key, in a directory named by the versions of cute-mla, the DSL and TVM-FFI and a fingerprint of
cute-mla's sources (an edited kernel is a different entry). ``CUTE_MLA_CACHE_DIR`` sets the
location (default: the user cache dir, ``$XDG_CACHE_HOME/cute-mla`` or ``~/.cache/cute-mla``);
``CUTE_MLA_CACHE_DIR=off`` disables it. Entries are written to a temporary file and renamed, so
processes warming one directory never see half an entry; an entry that does not load is deleted
and recompiled with one warning line.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Optional

from ..archs import check_arch

_lock = threading.RLock()
_cache: Dict[Hashable, "CompiledKernel"] = {}
CACHE_ENV = "CUTE_MLA_CACHE_DIR"
_EXPORTED = "cute_mla_kernel"   # the function name inside every cached object file
_counts = {"loaded": 0, "compiled": 0}   # this process's disk-cache loads and compiles (warmup's progress lines)


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
    """Return the compiled kernel for ``key``: from this process's cache, else from the disk cache,
    else compiled once with ``build(dump_dir)`` (and then stored on disk).

    ``build`` must return the object of ``cute.compile``. A request with ``dump_dir`` always
    recompiles (the caller wants the PTX/cubin on disk) and replaces no cached entry.
    """
    with _lock:
        if dump_dir is None:
            if key in _cache:
                return _cache[key]
            fn = _disk_load(key)
            if fn is not None:
                _counts["loaded"] += 1
                entry = _cache[key] = CompiledKernel(key=key, fn=fn)
                return entry
        compiled = build(dump_dir)
        _counts["compiled"] += 1
        fn = compiled.__tvm_ffi_object__() if hasattr(compiled, "__tvm_ffi_object__") else compiled
        entry = CompiledKernel(key=key, fn=fn, dump_dir=dump_dir)
        if dump_dir is None:
            _cache[key] = entry
            _disk_store(key, compiled)
        return entry


def compile_cached_state() -> Dict[str, int]:
    """How many kernels this process loaded from the disk cache and compiled (a copy)."""
    with _lock:
        return dict(_counts)


def cache_dir() -> Optional[pathlib.Path]:
    """The disk cache's directory for this cute-mla / DSL / TVM-FFI build and these sources, or None
    when ``CUTE_MLA_CACHE_DIR=off``."""
    root = os.environ.get(CACHE_ENV)
    if root is not None and root.strip().lower() == "off":
        return None
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "cute-mla")
    return pathlib.Path(root) / _build_tag()


@functools.lru_cache(maxsize=1)
def _build_tag() -> str:
    """Versions of cute-mla, the DSL and TVM-FFI, and a hash of cute-mla's Python sources."""
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "none"

    h = hashlib.sha256()
    pkg = pathlib.Path(__file__).resolve().parents[1]
    for path in sorted(pkg.rglob("*.py")):
        h.update(str(path.relative_to(pkg)).encode())
        h.update(path.read_bytes())
    return f"{version('cute-mla')}-dsl{version('nvidia-cutlass-dsl')}-ffi{version('apache-tvm-ffi')}-{h.hexdigest()[:16]}"


def _entry_path(key: Hashable) -> Optional[pathlib.Path]:
    d = cache_dir()
    if d is None:
        return None
    return d / (hashlib.sha256(repr(key).encode()).hexdigest()[:40] + ".o")


def _disk_load(key: Hashable):
    """The cached kernel's function, or None (no entry, cache off, or an entry that does not load:
    then it is removed, with one warning line, and the caller compiles)."""
    path = _entry_path(key)
    if path is None or not path.is_file():
        return None
    try:
        # An object file starts with the ELF magic; anything else is refused before the DSL's
        # loader sees it (a failed load there left the next compile of the process without a
        # callable function).
        with open(path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise ValueError("not an object file")
        from cutlass import runtime

        return getattr(runtime.load_module(str(path), enable_tvm_ffi=True), _EXPORTED)
    except Exception as e:  # noqa: BLE001  (any unreadable entry is recompiled)
        warnings.warn(f"cute-mla: compile cache entry {path} did not load ({type(e).__name__}); recompiling",
                      stacklevel=3)
        try:
            path.unlink()
        except OSError:
            pass
        return None


def _disk_store(key: Hashable, compiled) -> None:
    """Export ``compiled`` as the key's entry: a temporary file renamed into place (atomic). A cache
    that cannot be written is skipped with one warning line; the kernel is compiled either way."""
    path = _entry_path(key)
    if path is None or not hasattr(compiled, "export_to_c"):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        compiled.export_to_c(str(tmp), function_name=_EXPORTED)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"cute-mla: compile cache {path.parent} not written ({type(e).__name__}: {e})", stacklevel=3)
        try:
            tmp.unlink()
        except OSError:
            pass


def cached_keys():
    with _lock:
        return list(_cache)
