"""Precompile every kernel variant an op's plans can pick for an arch, into the disk compile cache
(``cute_mla.dsl.compile``), so that a new process loads kernels instead of compiling them. Needs no
GPU: an image or a wheel build can run it and ship the cache directory (``CUTE_MLA_CACHE_DIR``).

The variants come from the op's own rules (``registry.variants``: for sparse decode,
``plan.sparse_decode.kernel_variants``), so warmup compiles exactly what the planner can reach; the
kernels are found through the registry.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, List, Optional, Tuple

from . import archs, registry
from .dsl.compile import cache_dir, compile_cached_state

Variant = Tuple[str, object]   # (kernel name, config)
DECODE_ALIAS = "decode"        # what ``--kinds`` called the sparse decode kernel before ops had names


def kernel_names(op: str, kinds: Optional[Iterable[str]]) -> Tuple[str, ...]:
    """The op's kernel names ``kinds`` selects (None: all), ``decode`` naming the main kernel."""
    spec = registry.op(op)
    if kinds is None:
        return spec.kernel_names()
    names = tuple(spec.name if k == DECODE_ALIAS else k for k in kinds)
    unknown = [k for k in names if k not in spec.kernel_names()]
    if unknown:
        raise ValueError(f"--kinds: got {', '.join(unknown)}, accepted for op {spec.name}: "
                         f"{', '.join(spec.kernel_names())} ({DECODE_ALIAS}: the main kernel)")
    return names


def variants(arch: str, h_qs: Optional[Iterable[int]] = None, formats: Optional[Iterable[str]] = None,
             kinds: Optional[Iterable[str]] = None, op: str = registry.DEFAULT_OP) -> List[Variant]:
    """Every (kernel name, config) ``warmup`` compiles for ``op`` on ``arch`` (``h_qs`` None: every
    head count the op takes)."""
    archs.check_arch(arch)
    heads = {} if h_qs is None else {"h_qs": tuple(h_qs)}
    return registry.variants(op, arch, formats=None if formats is None else tuple(formats),
                             kernels=kernel_names(op, kinds), **heads)


def describe(variant: Variant) -> str:
    """A variant in one line: its kernel and the config fields that set it apart."""
    kernel, cfg = variant
    fields = getattr(cfg, "__dataclass_fields__", {})
    parts = []
    for name in fields:
        v = getattr(cfg, name)
        if name == "tuning" and dataclasses.is_dataclass(v):
            base = _default_tuning(cfg)
            changed = [f"{f.name}={getattr(v, f.name)!r}" for f in dataclasses.fields(v)
                       if getattr(v, f.name) != getattr(base, f.name)]
            if changed:     # a plan rule's knob (the shape's default tuning reads as nothing)
                parts.append(f"tuning({', '.join(changed)})")
            continue
        if name in ("arch",) or v is False or v is None:
            continue
        parts.append(name if v is True else f"{name}={v}")
    return " ".join([kernel] + parts)


def _default_tuning(cfg):
    """The tuning ``cfg`` would hold with a default one (a config may resolve its tuning's open
    fields for its shape when it is made)."""
    return dataclasses.replace(cfg, tuning=type(cfg.tuning)()).tuning


def compile_variant(variant: Variant, op: str = registry.DEFAULT_OP) -> Tuple[float, bool]:
    """Compile (or load) one variant; returns (seconds, whether it was loaded from the disk cache)."""
    kernel, cfg = variant
    mod = registry.kernel_module(op, cfg.arch, kernel)
    t0 = time.perf_counter()
    before = compile_cached_state()
    mod.compile(cfg)
    return time.perf_counter() - t0, compile_cached_state()["loaded"] > before["loaded"]


def check_cache_writable() -> str:
    """The disk cache's directory, created and written to once; a clear error when the cache is off
    or cannot be written (warmup would otherwise compile for minutes and keep nothing)."""
    where = cache_dir()
    if where is None:
        raise ValueError("the compile cache is off (CUTE_MLA_CACHE_DIR=off); nothing would be kept")
    try:
        os.makedirs(where, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"the compile cache {where} cannot be written ({e.strerror or e}); set "
                         "CUTE_MLA_CACHE_DIR to a writable directory") from None
    return str(where)


def warmup(arch: str, *, h_qs: Optional[Iterable[int]] = None, formats: Optional[Iterable[str]] = None,
           kinds: Optional[Iterable[str]] = None, jobs: int = 1, op: str = registry.DEFAULT_OP,
           progress: Optional[Callable[[str], None]] = None) -> int:
    """Compile every variant into the disk cache in ``jobs`` fresh worker processes (spawned: a
    variant this process already holds in memory would not be written to disk again; each entry is
    written atomically, so workers and other processes may share the directory). Returns the count.
    ``progress`` gets a line per variant: its kernel, what sets it apart, loaded or compiled."""
    check_cache_writable()
    todo = variants(arch, h_qs, formats, kinds, op)
    report = progress or (lambda line: None)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for i, (seconds, loaded) in enumerate(pool.map(compile_variant, todo, [op] * len(todo)), 1):
            report(f"[{i}/{len(todo)}] {describe(todo[i - 1])}: {'loaded' if loaded else 'compiled'} in {seconds:.1f} s")
    return len(todo)
