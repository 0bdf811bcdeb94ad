"""The benchmark core of ``cute-mla bench``: per shape, the inputs of the benchmark grid, a check of
every library against the fp32 reference on a sample of query tokens, then cute-mla, a kernel
variant and FlashMLA timed side by side (CUDA graph replay, interleaved), and the table, the JSON
and the figure of the results.

Inputs, as the V3.2 and V4 side-by-side benchmarks build them (a pool
of ``POOL`` tokens in page blocks of ``PAGE``, KV ~ N(0,1)/10 clamped, q ~ N(0,1) clamped):

* V3.2: top-k 2048, 20 % of the indices -1, no ``topk_length``;
* V4: top-k 128 with ``topk_length`` uniform in [1, 128], an extra pool (512 by default) with
  ``extra_topk_length`` uniform in [1, extra], sinks given.

Work per query token (docs/performance.md, section 2): the positions a call is given (its whole
index list, -1 entries included, or its first ``topk_length`` positions; the extra list's too),
``2 h (d_qk + d_v)`` FLOPs each, and bytes: each position's cache row (no reuse) and int32 index,
plus the token's bf16 q and out and fp32 lse. The same accounting makes the roofline figure from
the committed results.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import typing
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import registry
from ..archs import SM90
from ..formats import V4, V32
from ..reference import valid_positions

# The ceilings the figures draw (docs/performance.md, "The ceilings": an 8192^3 bf16 matmul and a
# device-to-device copy on the card named here); every figure and roof in this project reads them from here.
CEILINGS_GPU = "H200"
BF16_MMA_TFLOPS = 785.0
COPY_TBPS = 4.26

POOL, PAGE = 131072, 64          # tokens per cache pool, page block size
V32_TOPK, V32_MASKED = 2048, 0.2
V4_TOPK, V4_EXTRA_TOPK = 128, 512
SAMPLE_TOKENS = 16               # query tokens checked against the fp32 reference per shape
ROUNDS = 7                       # interleaved timing rounds
TIMED_S = 0.25                   # replay seconds per library and shape, over all rounds
WARMUP_S = 2.0                   # seconds of bf16 matmuls before the first shape (warm_up)
L2_FLUSH_MIB = 256               # bytes read between cold-L2 replays (l2_flusher): several times any L2

# JSON key prefixes of a row (the benchmarks' convention: cute_us, flashmla_us, ...) and their labels
LIBRARIES = {"cute": "cute-mla", "variant": "variant", "flashmla": "FlashMLA"}
# Tuning fields that are not variants of a call: instrumentation that needs its own buffer
NOT_VARIANTS = {"timeline": "instrumentation: the profile tool's timeline mode passes its stamp buffer"}


def format_named(name: str):
    """``--format`` (V3.2, V4; ``v32`` / ``v4`` too) -> the cache format."""
    from ..formats import format_named as named

    try:
        return named(name)
    except (ValueError, NotImplementedError) as e:
        raise type(e)(str(e).replace("format:", "--format:", 1)) from None


@dataclass(frozen=True)
class Shape:
    b: int
    s_q: int
    h_q: int

    def __str__(self) -> str:
        return f"{self.b}x{self.s_q}x{self.h_q}"


def parse_shape(text: str, fmt, extra_topk: int = 0) -> Shape:
    """``"1x8192x128"`` (b x s_q x h_q) -> Shape, checked by the library's own shape rules."""
    from ..plan import check_problem

    parts = text.lower().split("x")
    try:
        b, s_q, h_q = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--shape: expected B x S_Q x H_Q like 1x8192x128, got {text!r}") from None
    try:
        check_problem(b, s_q, h_q, fmt.d_qk, topk_of(fmt), extra_topk)
    except ValueError as e:
        raise ValueError(f"--shape {text}: {e}") from None
    return Shape(b, s_q, h_q)


def check_extra_topk(extra_topk: int) -> int:
    """``--extra-topk``: the V4 extra list's length, by the library's rules."""
    from ..plan import check_problem

    try:
        check_problem(1, 1, 64, V4.d_qk, V4_TOPK, extra_topk)
    except ValueError as e:
        raise ValueError(f"--extra-topk: {e}") from None
    return extra_topk


def topk_of(fmt) -> int:
    return V4_TOPK if fmt.extra_pool else V32_TOPK


# --- variants: a kernel's Tuning values from key=value pairs -------------------------------------

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def tuning_type(arch: str = SM90.name, op: str = registry.DEFAULT_OP):
    """The variant-knob type of an op's kernel on an arch (its module's ``Tuning``), or a ValueError
    where the kernel has none."""
    tp = registry.config_module(op, arch).Tuning
    if tp is None:
        raise ValueError(f"--variant: the {registry.op(op).kernel(arch).name} kernel ({arch}) has no variant knobs")
    return tp


def variant_fields(arch: str = SM90.name, op: str = registry.DEFAULT_OP) -> Dict[str, type]:
    """The tuning fields a variant may set, with their types."""
    tp = tuning_type(arch, op)
    hints = typing.get_type_hints(tp)
    return {f.name: _plain(hints[f.name]) for f in dataclasses.fields(tp) if f.name not in NOT_VARIANTS}


def _plain(tp):
    """``Optional[X]`` -> ``X`` (a knob whose None default means "the shape's rule")."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def _spelling(tp) -> str:
    if tp is bool:
        return "true|false"
    if dataclasses.is_dataclass(tp):
        fs = dataclasses.fields(tp)
        need = _required(tp)
        return "/".join(f.name.upper() for f in fs[:need]) + "".join(f"[/{f.name.upper()}]" for f in fs[need:])
    return tp.__name__.upper()


def _required(tp) -> int:
    """Fields of a dataclass variant value that a spelling must give: all but its trailing ones
    marked ``metadata={"variant_optional": True}`` (which keep their defaults when left out)."""
    fs = dataclasses.fields(tp)
    n = len(fs)
    while n and fs[n - 1].metadata.get("variant_optional"):
        n -= 1
    return n


def variant_keys_help(arch: str = SM90.name, op: str = registry.DEFAULT_OP) -> str:
    """``key=VALUE (default ...)`` for every variant key: the help's and the errors' list."""
    default = tuning_type(arch, op)()

    def shown(v):
        if v is None:
            return "per shape"
        if dataclasses.is_dataclass(v):
            return "/".join(str(getattr(v, f.name)) for f in dataclasses.fields(v))
        return repr(v) if isinstance(v, str) else str(v).lower()

    return ", ".join(f"{k}={_spelling(tp)} (default {shown(getattr(default, k))})"
                     for k, tp in variant_fields(arch, op).items())


def _value(tp, text: str):
    if tp is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"expected true or false, got {text!r}")
    if dataclasses.is_dataclass(tp):
        parts = text.replace(",", "/").split("/")
        fs = dataclasses.fields(tp)
        if not _required(tp) <= len(parts) <= len(fs):
            raise ValueError(f"expected {_spelling(tp)}, got {text!r}")
        hints = typing.get_type_hints(tp)
        return tp(*(_value(hints[f.name], p) for f, p in zip(fs, parts)))
    try:
        return tp(text)
    except ValueError:
        raise ValueError(f"expected {_spelling(tp)}, got {text!r}") from None


def parse_variant(pairs: Sequence[str], arch: str = SM90.name, op: str = registry.DEFAULT_OP):
    """``["prefetch_rows=false", ...]`` -> a value of the kernel's ``Tuning`` (None for no pairs);
    a bad pair is a one-line ValueError that lists the valid keys."""
    if not pairs:
        return None
    tp = tuning_type(arch, op)
    kinds, values = variant_fields(arch, op), {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        try:
            if not eq:
                raise ValueError("expected KEY=VALUE")
            if key in NOT_VARIANTS:
                raise ValueError(f"{key} is {NOT_VARIANTS[key]}")
            if key not in kinds:
                raise ValueError(f"unknown key {key!r}")
            if key in values:
                raise ValueError(f"{key} given twice")
            values[key] = _value(kinds[key], text.strip())
        except ValueError as e:
            raise ValueError(f"--variant {pair!r}: {e}; valid keys: {variant_keys_help(arch, op)}") from None
    try:
        return tp(**values)
    except ValueError as e:
        raise ValueError(f"--variant: {e}") from None


def variant_text(tuning) -> str:
    """The fields of ``tuning`` that differ from the default, as key=value."""
    default = type(tuning)()
    return " ".join(f"{f.name}={getattr(tuning, f.name)}" for f in dataclasses.fields(tuning)
                    if getattr(tuning, f.name) != getattr(default, f.name)) or "(the default)"


# --- work per call and the roof ---------------------------------------------------------------

def work(fmt, h_q: int, query_tokens: int, positions: float) -> Tuple[float, float]:
    """(FLOPs, bytes) of a call: ``positions`` index-list positions over all its ``query_tokens``
    (module docstring)."""
    bf16, fp32, idx = (t.itemsize for t in (torch.bfloat16, torch.float32, torch.int32))
    flop = 2 * h_q * (fmt.d_qk + fmt.d_v) * positions
    nbytes = positions * (fmt.row_bytes + idx) + query_tokens * h_q * ((fmt.d_qk + fmt.d_v) * bf16 + fp32)
    return flop, nbytes


def roof_tflops(intensity: float) -> float:
    """The ceiling at ``intensity`` FLOP/B: the bf16 MMA rate or the copy rate, whichever is lower."""
    return min(BF16_MMA_TFLOPS, intensity * COPY_TBPS)


def row_work(row: dict, meta: dict) -> Tuple[float, float]:
    """(FLOPs, bytes) of a results row: its own (``cute-mla bench``) or, for the committed results
    of the benchmarks, from their inputs: ``bench_sparse_decode --v4`` rows (an ``extra_topk`` column) give both
    lists uniform lengths in [1, k] (expected (k + 1) / 2 positions each), ``bench_sparse_decode``
    rows the whole V3.2 list of ``meta["topk"]``."""
    if "flop" in row:
        return row["flop"], row["bytes"]
    tokens = row["b"] * row["s_q"]
    if "extra_topk" in row:
        lists = (row["topk"] + 1) / 2 + ((row["extra_topk"] + 1) / 2 if row["extra_topk"] else 0)
        return work(V4, row["h_q"], tokens, tokens * lists)
    return work(V32, row["h_q"], tokens, tokens * meta.get("topk", V32_TOPK))


def row_format(row: dict) -> str:
    return row.get("format") or ("V4" if "extra_topk" in row else "V3.2")


def row_label(row: dict, sep: Optional[str] = " ") -> str:
    """``1x8192x128 V3.2``, ``128x1x128 V4 +512`` (the extra list's length); ``sep`` None: no format."""
    extra = f" +{row['extra_topk']}" if row.get("extra_topk") else ""
    shape = f"{row['b']}x{row['s_q']}x{row['h_q']}"
    return shape + extra if sep is None else f"{shape}{sep}{row_format(row)}{extra}"


# --- inputs ---------------------------------------------------------------------------------

def v32_inputs(b: int, s_q: int, h: int, masked: float, g: torch.Generator, topk: int = V32_TOPK):
    """(q, cache, indices) of the V3.2 grid on the GPU, drawn from ``g``."""
    from ..formats import quantize_v32

    kv = (torch.randn(POOL, V32.d_qk, device="cuda", generator=g) / 10).clamp(-1, 1)
    cache = quantize_v32(kv).view(POOL // PAGE, PAGE, 1, V32.row_bytes)
    q = torch.randn(b, s_q, h, V32.d_qk, device="cuda", generator=g).clamp(-1, 1).to(torch.bfloat16)
    idx = torch.randint(0, POOL, (b, s_q, topk), device="cuda", generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, device="cuda", generator=g) < masked] = -1
    return q, cache, idx


def v4_pool(g: torch.Generator) -> torch.Tensor:
    """A V4 cache of POOL tokens on the GPU (FlashMLA's quantizer: blocks padded to 576 B)."""
    from ..formats import quantize_v4

    return quantize_v4((torch.randn(POOL // PAGE, PAGE, V4.d_qk, device="cuda", generator=g) / 10).clamp(-1, 1))


def index_list(b: int, s_q: int, k: int, masked: float, g: torch.Generator):
    """(b, s_q, k) indices into a pool and (b,) lengths uniform in [1, k]."""
    idx = torch.randint(0, POOL, (b, s_q, k), device="cuda", generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, device="cuda", generator=g) < masked] = -1
    return idx, torch.randint(1, k + 1, (b,), device="cuda", generator=g, dtype=torch.int32)


def make_case(fmt, shape: Shape, extra_topk: int, g: torch.Generator, pools=None):
    """One shape's inputs as :class:`cute_mla.testing.SparseDecodeInputs` (V4: ``pools``, the
    main and the extra cache, shared by every shape of a run)."""
    from ..testing import SparseDecodeInputs

    scale = fmt.d_qk ** -0.5
    if not fmt.extra_pool:
        q, cache, idx = v32_inputs(shape.b, shape.s_q, shape.h_q, V32_MASKED, g)
        return SparseDecodeInputs(q=q, k_cache=cache, indices=idx, topk_length=None, attn_sink=None, softmax_scale=scale)
    q, idx, length, extra_idx, extra_length, sink = v4_lists(shape.b, shape.s_q, shape.h_q, extra_topk, 0.0, g)
    return SparseDecodeInputs(q=q, k_cache=pools[0], indices=idx, topk_length=length, attn_sink=sink,
                              softmax_scale=scale, extra_k_cache=pools[1] if extra_topk else None, extra_indices=extra_idx,
                              extra_topk_length=extra_length)


def v4_lists(b: int, s_q: int, h: int, extra_topk: int, masked: float, g: torch.Generator):
    """A V4 call's tensors besides the caches, drawn from ``g`` in this order: q (b, s_q, h, 512),
    the main list of V4_TOPK and its lengths, the extra list and its lengths (None, None without
    one), the (h,) sinks."""
    q = torch.randn(b, s_q, h, V4.d_qk, device="cuda", generator=g).clamp(-1, 1).to(torch.bfloat16)
    idx, length = index_list(b, s_q, V4_TOPK, masked, g)
    extra_idx, extra_length = index_list(b, s_q, extra_topk, masked, g) if extra_topk else (None, None)
    return q, idx, length, extra_idx, extra_length, torch.randn(h, device="cuda", generator=g)


def case_work(fmt, x) -> Tuple[float, float]:
    """(FLOPs, bytes) of a call on inputs ``x``: the positions it is given."""
    b, s_q, h_q, _ = x.q.shape
    per_request = torch.zeros(b, dtype=torch.int64, device=x.q.device)
    for idx, length in ((x.indices, x.topk_length), (x.extra_indices, x.extra_topk_length)):
        if idx is not None:
            per_request += idx.shape[-1] if length is None else length.to(torch.int64)
    return work(fmt, h_q, b * s_q, int(per_request.sum().item()) * s_q)


def call(mod, sched, fmt, x):
    """One sparse decode call of ``mod`` (cute_mla or FlashMLA's interface, the same API)."""
    kwargs = {k: v for k, v in x.call_kwargs().items() if v is not None}
    return mod.flash_mla_with_kvcache(x.q, x.k_cache, None, None, fmt.d_v, sched, **kwargs)


def sample_check(x, sample: int) -> Callable:
    """``check(out, lse)``: None if the outputs of ``sample`` query tokens spread over the call are
    within FlashMLA's tolerances of the fp32 reference, else why not (one line). The reference runs
    once, on those tokens alone."""
    from ..testing import check_out_lse

    b, s_q = x.q.shape[:2]
    flat = torch.linspace(0, b * s_q - 1, min(sample, b * s_q), device=x.q.device).round().long().unique()
    bi, si = flat // s_q, flat % s_q

    def one_token(t):
        return None if t is None else t[bi, si].unsqueeze(1)

    def per_request(t):
        return None if t is None else t[bi]

    sub = dataclasses.replace(x, q=one_token(x.q), indices=one_token(x.indices), topk_length=per_request(x.topk_length),
                              extra_indices=one_token(x.extra_indices),
                              extra_topk_length=per_request(x.extra_topk_length))
    ref = []

    def check(out, lse):
        if not ref:
            ref.extend(sub.reference())
        try:
            check_out_lse(out[bi, si].unsqueeze(1), lse[bi, :, si].unsqueeze(-1), *ref)
        except AssertionError as e:
            return " ".join(str(e).split())[:300]
        return None

    return check


# --- timing ---------------------------------------------------------------------------------

def import_flashmla(file=None):
    """FlashMLA's interface module as vLLM ships it, or None (said in one line on ``file``, default
    stdout)."""
    try:
        from vllm.third_party.flashmla import flash_mla_interface as fm
        return fm
    except Exception as e:  # noqa: BLE001 -- any failure to import means "not here"
        print(f"FlashMLA not importable ({type(e).__name__}: {e}); cute-mla only", file=file)
        return None


PADDED_HEADS = 64


class PaddedHeads:
    """FlashMLA as an engine calls it with 8, 16 or 32 heads, which its decode kernel does not take:
    on q (and attn_sink) zero-padded to 64 heads, out and lse cut back to the call's heads (views).
    The padded copy is made once per input (by address, shape and version), outside the timed
    calls: FlashMLA is charged only its own kernels, as if the engine's q projection wrote the padded
    layout (the anchor most favourable to FlashMLA). 64 or 128 heads pass through."""

    def __init__(self, mod):
        self.mod = mod
        self.get_mla_metadata = mod.get_mla_metadata
        self._padded = {}

    def _pad(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t._version, dim)
        if key not in self._padded:
            shape = list(t.shape)
            shape[dim] = PADDED_HEADS
            p = t.new_zeros(shape)
            p.narrow(dim, 0, t.shape[dim]).copy_(t)
            # The entry keeps its source alive: while it is cached, no new input can take the
            # source's address and be mistaken for it.
            self._padded = {key: (t, p)} | {k: v for k, v in self._padded.items() if k[4] != dim}
        return self._padded[key][1]

    def flash_mla_with_kvcache(self, q, *args, attn_sink=None, **kwargs):
        h = q.shape[2]
        if h >= PADDED_HEADS:
            return self.mod.flash_mla_with_kvcache(q, *args, attn_sink=attn_sink, **kwargs)
        sink = None if attn_sink is None else self._pad(attn_sink, 0)
        out, lse = self.mod.flash_mla_with_kvcache(self._pad(q, 2), *args, attn_sink=sink, **kwargs)
        return out[:, :, :h], lse[:, :h]


def padded(fm):
    """FlashMLA (or None) wrapped in :class:`PaddedHeads`."""
    return None if fm is None else PaddedHeads(fm)


def capture_graph(fn, n=1):
    """A CUDA graph of ``n`` back-to-back ``fn()`` (one warm-up ``fn()`` on a side stream first, as
    torch requires) and what the last captured ``fn()`` returned."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(n):
            res = fn()
    return gr, res


def event_times_us(fn: Callable[[], None], n: int, before: Optional[Callable[[], None]] = None) -> List[float]:
    """µs of each of ``n`` calls of ``fn`` (work queued on the current stream), each between two
    events (``before()`` queued ahead of each, outside them: e.g. :func:`l2_flusher`'s)."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, e in ev:
        if before is not None:
            before()
        a.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(e) * 1e3 for a, e in ev]


def replay_times_us(gr, n: int, before: Optional[Callable[[], None]] = None) -> List[float]:
    """µs of each of ``n`` replays of ``gr`` (:func:`event_times_us`)."""
    return event_times_us(gr.replay, n, before)


def median_us(fn: Callable[[], None], n: int) -> float:
    """Median µs of ``n`` calls of ``fn``, each between two events (3 warm-up calls first)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_times_us(fn, n))


def measured_copy_tbps(nbytes: int = 512 * 2**20, iters: int = 10) -> float:
    """The card's device-to-device copy rate now (read + write bytes per second / 1e12): the
    median of ``iters`` eager ``copy_`` calls of ``nbytes``, each between two events. Eager, not a
    graph replay: a captured copy becomes a memcpy node, which measured slower than the eager
    copy. What a row's achieved byte rate is set against (the ``COPY_TBPS`` figures are one
    card's, for the committed plots)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * nbytes / median_us(lambda: b.copy_(a), iters) * 1e-6


def gathered_rows(indices: torch.Tensor, length: Optional[torch.Tensor] = None, pool: int = POOL) -> int:
    """The cache rows a call gathers from one index list: its valid indices (in [0, ``pool``)),
    within each request's first ``length`` positions where a length is given ((b,), s_q 1 or each
    of a request's query tokens alike)."""
    return int(valid_positions(indices, pool, length).sum().item())


def l2_flusher(mib: int = L2_FLUSH_MIB) -> Callable[[], None]:
    """A callable that queues a read of a ``mib`` MiB buffer (several times a GPU's L2), so
    the next kernel finds none of its inputs in L2, as a layer of an engine's decode step finds its
    own KV rows. A read, not a write: the lines it leaves are clean, so no write-back lands in the
    timed kernel."""
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    return lambda: torch.sum(buf, dim=0, out=sink)


def replay_median_us(gr, n: int) -> float:
    """Median µs of ``n`` replays, each between two events (3 warm-up replays first)."""
    return median_us(gr.replay, n)


def interleaved_median_us(graphs: Dict[str, object], rounds: int = ROUNDS, seconds: float = TIMED_S,
                          before: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """Median µs per replay of each graph, replayed round by round in turn (a clock drift or a
    neighbour's load then falls on every graph alike); ~``seconds`` of replays per graph;
    ``before()`` ahead of every timed replay (:func:`replay_times_us`)."""
    reps = {k: max(3, min(50, int(seconds / rounds / (replay_median_us(gr, 3) * 1e-6)))) for k, gr in graphs.items()}
    times = {k: [] for k in graphs}
    for _ in range(rounds):
        for k, gr in graphs.items():
            times[k] += replay_times_us(gr, reps[k], before)
    return {k: statistics.median(v) for k, v in times.items()}


def warm_up(seconds: float) -> None:
    """bf16 matmuls for ``seconds``: an idle GPU sits at a low clock, and a row timed right after
    that reads slow (docs/performance.md, method)."""
    import time

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


# --- one shape, a run -----------------------------------------------------------------------

def one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def bench_shape(fmt, shape: Shape, runs: Dict[str, Tuple[object, Callable]], extra_topk: int, sample: int,
                g: torch.Generator, pools=None) -> dict:
    """One results row: each of ``runs`` ({key: (module, new metadata object)}) checked on a sample
    (a cute-mla kernel that fails is not timed), its transient memory, then all timed interleaved."""
    from ..testing import step_transient_bytes

    x = make_case(fmt, shape, extra_topk, g, pools)
    flop, nbytes = case_work(fmt, x)
    row = dict(b=shape.b, s_q=shape.s_q, h_q=shape.h_q, format=fmt.name, topk=x.indices.shape[-1],
               extra_topk=extra_topk if fmt.extra_pool else 0, flop=flop, bytes=nbytes)
    check = sample_check(x, sample)
    graphs, keep = {}, []
    for key, (mod, new_sched) in runs.items():
        sched = new_sched()
        try:
            out, lse = call(mod, sched, fmt, x)            # compile (or load), schedule
            torch.cuda.synchronize()
            row[f"{key}_check"] = check(out, lse) or "ok"
            if row[f"{key}_check"] != "ok" and key != "flashmla":
                continue
            del out, lse
            one_call = functools.partial(call, mod, sched, fmt, x)
            _, transient = step_transient_bytes(new_sched, lambda s: call(mod, s, fmt, x))
            graphs[key], _ = capture_graph(one_call)
        except Exception as e:  # noqa: BLE001 -- a library's failure is a result of the row
            row[f"{key}_error"] = one_line(e)
            continue
        row[f"{key}_transient_mib"] = transient / 2**20
        keep.append(one_call)   # a replay reads and writes what the call's objects hold
    for key, us in interleaved_median_us(graphs).items():
        row[f"{key}_us"] = us
        row[f"{key}_tflops"] = flop / us * 1e-6
    for key in runs:
        if f"{key}_us" in row:
            for base, name in (("flashmla", "vs_flashmla"), ("cute", "vs_default")):
                if f"{base}_us" in row:
                    row[f"{key}_{name}"] = row[f"{base}_us"] / row[f"{key}_us"]
    del graphs, keep
    torch.cuda.empty_cache()
    return row


def run(shapes: Sequence[Shape], fmt, tuning=None, vs_flashmla: bool = False, extra_topk: int = V4_EXTRA_TOPK,
        sample: int = SAMPLE_TOKENS, warmup_s: float = WARMUP_S, progress: Optional[Callable[[str], None]] = None):
    """Benchmark ``shapes`` in cache format ``fmt``: cute-mla's default, the kernel variant
    ``tuning`` (an Sm90Tuning) when given, FlashMLA with ``vs_flashmla`` when importable.
    Returns (meta, rows)."""
    import cute_mla

    from ..archs import device_arch

    runs = {"cute": (cute_mla, lambda: cute_mla.FlashMLASchedMeta())}
    if tuning is not None:
        arch = device_arch(torch.device("cuda"))
        if not isinstance(tuning, tuning_type(arch)):
            raise ValueError(f"--variant: the variant is a {type(tuning).__name__}; this GPU runs {arch}, whose kernel "
                             f"takes {tuning_type(arch).__name__}")
        runs["variant"] = (cute_mla, lambda: cute_mla.FlashMLASchedMeta(tuning=tuning))
    fm = padded(import_flashmla(sys.stderr)) if vs_flashmla else None
    if fm is not None:
        runs["flashmla"] = (fm, lambda: fm.get_mla_metadata()[0])
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = (v4_pool(g), v4_pool(g)) if fmt.extra_pool else None
    warm_up(warmup_s)
    rows = []
    for i, shape in enumerate(shapes):
        if progress:
            progress(f"[{i + 1}/{len(shapes)}] {shape} {fmt.name}: check on {min(sample, shape.b * shape.s_q)} "
                     f"tokens, then {', '.join(LIBRARIES[k] for k in runs)} timed")
        rows.append(bench_shape(fmt, shape, runs, extra_topk, sample, g, pools))
    meta = dict(tool="cute-mla bench", gpu=torch.cuda.get_device_name(), cute_mla=cute_mla.__version__,
                torch=torch.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                format=fmt.name, pool=POOL, page_block_size=PAGE, topk=topk_of(fmt),
                extra_topk=extra_topk if fmt.extra_pool else 0, masked=0.0 if fmt.extra_pool else V32_MASKED,
                sample=sample, variant=variant_text(tuning) if tuning is not None else None, flashmla=fm is not None,
                ceilings=dict(gpu=CEILINGS_GPU, bf16_mma_tflops=BF16_MMA_TFLOPS, copy_tbps=COPY_TBPS))
    return meta, rows


def failed(rows: Sequence[dict]) -> List[str]:
    """One line per cute-mla kernel (default or variant) that failed its check or its call."""
    out = []
    for r in rows:
        for key in ("cute", "variant"):
            why = r.get(f"{key}_error") or (r.get(f"{key}_check") if r.get(f"{key}_check", "ok") != "ok" else None)
            if why:
                out.append(f"{LIBRARIES[key]} {r['b']}x{r['s_q']}x{r['h_q']}: {why}")
    return out


# --- table, JSON, figure ----------------------------------------------------------------------

def describe(meta: dict) -> str:
    """The run's inputs in one line."""
    if meta.get("format") == "V4":
        lists = f"top-k {meta['topk']} + extra {meta['extra_topk']}, lengths uniform, sinks on"
    else:
        lists = f"top-k {meta['topk']} ({meta['masked']:.0%} -1)"
    return (f"{meta['gpu']}  {meta['format']} cache, pools of {meta['pool']} tokens, page block "
            f"{meta['page_block_size']}, {lists}; CUDA graph replay of one call, libraries interleaved")


def table(meta: dict, rows: Sequence[dict]) -> str:
    """The results as text: per shape and library µs, TFLOP/s, speed-up against FlashMLA and
    against cute-mla's default (above 1: faster), transient MiB, the reference check."""
    lines = [describe(meta)]
    if meta.get("variant"):
        lines.append(f"variant: {meta['variant']}")
    lines.append(f"{'shape':>12} {'library':>9} {'µs':>10} {'TFLOP/s':>8} {'x FlashMLA':>10} {'x default':>9} "
                 f"{'MiB':>8}  check")
    for r in rows:
        head = f"{r['b']}x{r['s_q']}x{r['h_q']}"
        for key, label in LIBRARIES.items():
            if not any(k.startswith(key + "_") for k in r):
                continue
            cell = lambda name, f: f % r[f"{key}_{name}"] if f"{key}_{name}" in r else "-"  # noqa: E731
            check = r.get(f"{key}_error") or r.get(f"{key}_check", "-")
            lines.append(f"{head:>12} {label:>9} {cell('us', '%10.1f'):>10} {cell('tflops', '%8.1f'):>8} "
                         f"{cell('vs_flashmla', '%9.2fx'):>10} {cell('vs_default', '%8.3fx'):>9} "
                         f"{cell('transient_mib', '%8.2f'):>8}  {check if check == 'ok' else 'FAIL: ' + check}")
            head = ""
    return "\n".join(lines)


def save(path: str, meta: dict, rows: Sequence[dict]) -> None:
    with open(path, "w") as f:
        json.dump(dict(meta=meta, results=list(rows)), f, indent=1)


def load(path: str) -> Tuple[dict, List[dict]]:
    """(meta, rows) of a results JSON: ``cute-mla bench --json``'s or the benchmarks' (one-line
    errors for anything else)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--replot {path}: {one_line(e)}") from None
    rows = d.get("results") if isinstance(d, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"b", "s_q", "h_q"} <= set(r) for r in rows):
        raise ValueError(f"--replot {path}: not a results file (a 'results' list of rows with b, s_q, h_q)")
    return d.get("meta") or {}, rows


def companion_json(plot_path: str) -> str:
    """Where the results go when a figure cannot be drawn here: next to it, ``.json``."""
    return os.path.splitext(plot_path)[0] + ".json"


def plot(meta: dict, rows: Sequence[dict], path: str) -> None:
    """TFLOP/s per shape, one bar per library, each shape's roof (min of the bf16 MMA ceiling and
    the copy ceiling times its FLOP/B) marked above its bars. Needs matplotlib (ImportError)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in LIBRARIES if any(f"{k}_us" in r for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.2))
    width = 0.8 / max(1, len(keys))
    for j, key in enumerate(keys):
        label = LIBRARIES[key] + (f" ({meta['variant']})" if key == "variant" and meta.get("variant") else "")
        xs, ys = [], []
        for i, r in enumerate(rows):
            if f"{key}_us" in r:
                flop, _ = row_work(r, meta)
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(flop / r[f"{key}_us"] * 1e-6)
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    for i, r in enumerate(rows):
        flop, nbytes = row_work(r, meta)
        ax.hlines(roof_tflops(flop / nbytes), i - 0.45, i + 0.45, colors="k", linestyles="--", linewidth=1,
                  label="the shape's roof" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [row_label(r, "\n") for r in rows], fontsize=8)
    ax.set_xlabel("shape (b x s_q x h_q)")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(0, BF16_MMA_TFLOPS * 1.35)      # room for the legend above the roof
    ax.set_title(f"sparse MLA decode, {meta.get('gpu', '?')}" + (f", {meta['date'][:10]}" if meta.get("date") else "")
                 + f"\nroof: min({BF16_MMA_TFLOPS:.0f} TFLOP/s bf16 MMA, {COPY_TBPS} TB/s copy x FLOP/B), the "
                 f"{CEILINGS_GPU}'s measured ceilings", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", ncol=2 if len(rows) < 4 else 4)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
