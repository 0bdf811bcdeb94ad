"""Precompile every kernel variant the dispatcher can pick for an arch, into the disk compile cache
(``cute_mla.dsl.compile``), so that a new process loads kernels instead of compiling them. Needs no
GPU: an image or a wheel build can run it and ship the cache directory (``CUTE_MLA_CACHE_DIR``).

The variants are the launcher's configs for every plan: the sparse decode kernel for each head
count, format, split / no-split, topk_length, sink, extra pool (V4) and, on SM90, the column pair
and the request order of the balanced cut;
the combine for each head count, sink, split-count bucket and grid walk; the device scheduler.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, List, Optional, Tuple

from . import archs
from .formats import format_for_d_qk, supported_formats
from .plan.plan import PACKED_H_Q, SUPPORTED_H_Q
from .scheduler import partition as sched

KINDS = ("decode", "combine", "scheduler")
Variant = Tuple[str, object]   # (kind, config)


def decode_variants(arch: str, h_qs: Iterable[int], d_qks: Iterable[int]) -> List[Variant]:
    """The sparse decode configs the launcher can build for ``arch``."""
    from .interface.launcher import kernel_module

    mod = kernel_module(arch)
    out = []
    for d_qk, h_q, split, tl, sink in itertools.product(d_qks, h_qs, (False, True), (False, True), (False, True)):
        extras = [(False, False)] + ([(True, False), (True, True)] if format_for_d_qk(d_qk).extra_pool else [])
        for (extra, extra_tl) in extras:
            # the column pair: SM90 h_q = 64 split plans with a host schedule (no lengths; sm90_column_pair)
            pair_possible = arch == archs.SM90.name and h_q == 64 and split and not tl and not extra_tl
            for pair in ([False, True] if pair_possible else [False]):
                out.append(("decode", mod.kernel_config(h_q=h_q, d_qk=d_qk, split=split, has_topk_length=tl,
                                                        has_attn_sink=sink, column_pair=pair, has_extra=extra,
                                                        has_extra_topk_length=extra_tl)))
            # the balanced cut of whole requests: SM90 V4 with an extra list and lengths (sm90_packed)
            if arch == archs.SM90.name and h_q == PACKED_H_Q and extra and not split and (tl or extra_tl):
                out.append(("decode", mod.kernel_config(h_q=h_q, d_qk=d_qk, split=False, has_topk_length=tl,
                                                        has_attn_sink=sink, has_extra=True,
                                                        has_extra_topk_length=extra_tl, request_order=True)))
    return out


def combine_variants(arch: str, h_qs: Iterable[int]) -> List[Variant]:
    """The combine configs the launcher can build: one per split-count bucket that some s_q reaches
    on the arch's default SM count, with and without a sink, over requests or over partitions."""
    from .kernels.combine import combine_config

    spec = archs.get(arch)
    out = []
    seen = set()
    for h_q in h_qs:
        for s_q in range(1, spec.default_num_sms + 1):
            p = sched.num_sm_parts(arch, spec.default_num_sms, s_q, h_q)
            # with a sink or not; the fewest and the most requests of a grid over requests (its
            # layout follows b * s_q * h_q), and a grid over partitions
            for sink, b in itertools.product((False, True), (1, p, p + 1)):
                cfg = combine_config(arch, h_q, sink, p, spec.accum_dtype, b=b, s_q=s_q)
                if cfg.cache_key not in seen:
                    seen.add(cfg.cache_key)
                    out.append(("combine", cfg))
    return out


def variants(arch: str, h_qs: Iterable[int] = SUPPORTED_H_Q, d_qks: Optional[Iterable[int]] = None,
             kinds: Iterable[str] = KINDS) -> List[Variant]:
    """Every (kind, config) ``warmup`` compiles."""
    archs.check_arch(arch)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"kinds: got {sorted(unknown)}, accepted: {', '.join(KINDS)}")
    d_qks = tuple(f.d_qk for f in supported_formats()) if d_qks is None else tuple(d_qks)
    h_qs = tuple(h_qs)
    out: List[Variant] = []
    if "decode" in kinds:
        out += decode_variants(arch, h_qs, d_qks)
    if "combine" in kinds:
        out += combine_variants(arch, h_qs)
    if "scheduler" in kinds:
        from .scheduler.device import SchedulerKernelConfig
        out.append(("scheduler", SchedulerKernelConfig(arch=arch)))
    return out


def compile_variant(variant: Variant) -> float:
    """Compile (or load) one variant; returns the seconds it took."""
    kind, cfg = variant
    t0 = time.perf_counter()
    if kind == "decode":
        from .interface.launcher import kernel_module
        kernel_module(cfg.arch).compile_sparse_decode(cfg)
    elif kind == "combine":
        from .kernels.combine import compile_combine
        compile_combine(cfg)
    else:
        from .scheduler.device import compile_scheduler
        compile_scheduler(cfg)
    return time.perf_counter() - t0


def warmup(arch: str, *, h_qs: Iterable[int] = SUPPORTED_H_Q, d_qks: Optional[Iterable[int]] = None,
           kinds: Iterable[str] = KINDS, jobs: int = 1, progress: Optional[Callable[[str], None]] = None) -> int:
    """Compile every variant into the disk cache in ``jobs`` fresh worker processes (spawned: a
    variant this process already holds in memory would not be written to disk again; each entry is
    written atomically, so workers and other processes may share the directory). Returns the count."""
    todo = variants(arch, h_qs, d_qks, kinds)
    report = progress or (lambda line: None)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for i, seconds in enumerate(pool.map(compile_variant, todo), 1):
            report(f"[{i}/{len(todo)}] {todo[i - 1][0]} {seconds:.1f} s")
    return len(todo)

