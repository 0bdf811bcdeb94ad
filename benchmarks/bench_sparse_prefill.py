"""cute-mla's ``flash_mla_sparse_fwd`` against FlashMLA's (as vLLM ships it) on FlashMLA's sparse
prefill performance cases, side by side in one process on the same inputs; ``--routes``: the two
ways an engine can run a prefill chunk on a V3.2 FP8 cache.

**Cases** (``s_q`` 4096, ``attn_sink`` given; FlashMLA's performance templates, the small-head
rows added), as ``d_qk/h_q/topk/s_kv``: 576/128/2048/{8192, 32768, 65536, 131072};
512/64/512/{8192, 32768, 65536}; 512/128/1024/{8192, 32768, 65536}; 576/{64, 32, 16}/2048/65536;
512/8/512/65536 (FlashMLA's s_kv 98304 and 49152 left out: a ``--cases`` selector naming all four
keys adds one). ``--quick``: the four rows in ``QUICK`` and 5 timed calls.

**Inputs** as FlashMLA's performance test makes them (its ``tests/lib.py``, ``generate_testcase``):
q and kv ``randn/10`` plus one random offset in [-0.05, 0.05) per tensor, clamped to +-10, bf16;
each query row's indices a random permutation of [0, s_kv) cut to ``topk`` (unique; rows padded
with -1 where s_kv < topk); ``attn_sink = randn(h_q)`` with about 31 % set to -inf and 31 % to
+inf; ``sm_scale`` 0.5; q, kv and indices strided as its ``non_contiguousify`` leaves them (a
buffer one larger in every dim and 128 larger in the last, sliced; ``--contiguous``: packed).
``--topk-length``: lengths ``randint(0, topk + 1)`` per row, as its feature cases.

**Work** by FlashMLA's count (``count_flop_and_mem_vol``): FLOPs = 2 * sum over rows of (topk, or
the row's topk_length) * h_q * (d_qk + d_v); bytes = valid (row, index) pairs * d_qk * 2 +
s_q * h_q * (d_qk + d_v) * 2 (each gathered row once per query row, plus q and out).

**Timing**: eager calls, CUDA events around each call, the libraries alternating call by call
(each call synchronized); ``--warmup`` calls of each first, then the median of ``--iters`` (also
the lowest and highest). Ratio = FlashMLA µs / cute-mla µs (above 1: cute-mla faster). This call
time starts on an idle GPU, so it holds the host's path to the launch: the host time of each call
(``perf_counter`` from the first event to the last one's record) is recorded beside it. Cases
mode also times each call again behind a GPU sleep of ``GPU_SLEEP_CYCLES``, so that the host's
path runs while the GPU is busy: the GPU time of the call alone (an iteration whose host time
outlasted its sleep is counted in ``<lib>_gpu_exposed``), with its own ratio table.
``--sustained S`` adds a third timing: each runner's calls back to back for about S seconds (no
sync between them, so the GPU never idles and its clock settles under the card's power cap, as
through an engine's prefill of many layers), the runners in turn, ``SUSTAINED_ROUNDS`` rounds
(each round starting one runner later, so that no runner always follows the same one): µs per
call, mJ per call (NVML's energy counter) and the SM clock, the median over the rounds.
The idle-GPU call above starts each call from the clock an idle card boosts to; a long sustained
run sits at the cap, where a call's time follows its energy.
**Transient**: ``testing.transient_bytes`` around one call, the decode benchmark's measure: the
peak bytes requested from torch's allocator during the call beyond those held before, less the
returned out, max_logits and lse. **Check**: ``--sample`` query rows of each library's out,
max_logits and lse against an fp32 reference (FlashMLA's ``ref.py``) with its prefill tolerances;
max |out difference| between the libraries over all rows. **Tuning**: the config each of cute-mla's
runners ran (the shape's rule resolved, ``<runner>_tuning``), said under the table.

**Routes** (``--routes``): a V3.2 FP8 cache (656 B/token, ``formats.quantize_v32``, page block
64) of ``s_kv`` 65536 tokens, one prefill chunk of ``s_q`` 4096 tokens, top-k 2048 (random
permutations, as above), h_q 128, 64 and 16 (a TP8 rank of V3.2), no sink, ``sm_scale`` = 576^-0.5:

* route (a), vLLM's prefill path for >= 32 heads: dequantize the whole context (s_kv rows) into a
  bf16 workspace (s_kv, 1, 576) with torch ops (standing in for vLLM's fused
  ``cp_gather_and_upconvert_fp8_kv_cache``; ``dequant floor``: the same bytes at the rate of a
  device-to-device copy measured in this process), then ``flash_mla_sparse_fwd`` on it, cute-mla's
  and FlashMLA's;
* route (b), vLLM's mixed-batch mode: ``flash_mla_with_kvcache`` on the FP8 cache with b = 1,
  s_q = tokens, the same indices, ``get_mla_metadata()`` (timed with the step's metadata object
  already used once: a step's later layers), cute-mla's and FlashMLA's (with 16 heads FlashMLA's
  decode kernel runs them padded to 64, as vLLM's < 32-head path calls it:
  ``playground.bench.PaddedHeads``; route (a) runs FlashMLA's own 16-head prefill kernel).

Per stage µs, bytes by FlashMLA's counts (dequant: s_kv * (656 + 1152); sparse_fwd: as above;
decode: its decode test's q + unique rows * 656 + out), transient MiB (route (b): a step's first
call, a fresh metadata object, as the decode benchmark measures it); each route's out is checked
on the sample rows against the fp32 reference on the dequantized keys.

**Runs**: one run's µs move by several per cent from machine to machine and from run to run on
one machine (FlashMLA's too, not always together), so a verdict takes several: ``--repeat N``
passes over the cases in one process, and a saved run of the same card and commit adds its runs
to each case's row. A row of several runs gives each µs as the median over its runs and the
ratio as the median of the runs' ratios, with their range.

``--save``: writes ``<card>-<commit>-sparse-prefill.json`` and ``.md`` (both modes' latest run: a
save keeps the other mode's section, and adds its rows, or its runs of a case, to a section of the
same card and commit)
into ``benchmarks/results``, removes older files of that kind and updates the index; ``--save DIR`` writes them into DIR only (the device machine's $OUT),
and ``--install DIR/FILE.json`` (any machine) then puts them into ``benchmarks/results``.

    python3 benchmarks/bench_sparse_prefill.py [--cases SEL] [--quick] [--iters 10] [--save [DIR]]
    python3 benchmarks/bench_sparse_prefill.py --routes [--cases h_q=64] [--save [DIR]]
    python3 benchmarks/bench_sparse_prefill.py --install OUT/h200-abc1234-sparse-prefill.json

``--cases``: all (default) or quick, or selectors ``key=value,...`` (keys d_qk, h_q, topk,
s_kv; a case matches when every key does) joined by ``;``; a selector naming all four keys that
matches no listed case adds that case (e.g. FlashMLA's ``d_qk=576,h_q=128,topk=2048,s_kv=98304``).

``--variant KEY=VALUE`` (repeatable; cases mode): a third runner, cute-mla's kernel compiled with
that ``Tuning`` (the public call's host path, ``interface.prefill.eager_call``, on the same
inputs: the two differ by the kernel and the tuning's lookup), checked on the sample rows and timed alternating with the two
libraries; a second table gives its µs against the default's (e.g. ``prefetch_rows=true``: the
row prefetch on shapes whose rule leaves it off; a field not given keeps the shape's rule).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import random
import re
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):   # run as a file: the repository root on the path, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import cute_mla
from cute_mla.formats import V32, dequantize_v32, quantize_v32
from cute_mla.playground.bench import import_flashmla, measured_copy_tbps, padded, variant_text, warm_up
from cute_mla.testing import check_allclose, check_out_lse, step_transient_bytes, transient_bytes

from benchmarks.bench_sparse_decode import commit_id

D_V = 512
S_Q = 4096
CASES = ([(576, 128, 2048, s) for s in (8192, 32768, 65536, 131072)]
         + [(512, 64, 512, s) for s in (8192, 32768, 65536)]
         + [(512, 128, 1024, s) for s in (8192, 32768, 65536)]
         + [(576, h, 2048, 65536) for h in (64, 32, 16)]
         + [(512, 8, 512, 65536)])
QUICK = [(576, 128, 2048, 65536), (512, 64, 512, 65536), (512, 128, 1024, 65536), (576, 16, 2048, 65536)]
ROUTE_CASES = [(576, 128, 2048, 65536), (576, 64, 2048, 65536), (576, 16, 2048, 65536)]
CASE_KEYS = ("d_qk", "h_q", "topk", "s_kv")
PERF_SM_SCALE = 0.5          # FlashMLA's test value
PAGE = 64                    # the routes' cache page block
SAMPLE_ROWS = 16
PREFILL_TOL = dict(out=(8e-4, 3.01 / 128, 7e-6), max_logits=(1e-6, 2.01 / 65536, None), lse=(1e-6, 2.01 / 65536, None))
LIBS = {"cute": "cute-mla", "flashmla": "FlashMLA"}
KIND = "sparse-prefill"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MIB = 2 ** 20
# The GPU sleep ahead of the "gpu" timing (alternating_us): it must outlast a call's host path, or
# the GPU idles inside the timed events again (such iterations are counted, not dropped)
GPU_SLEEP_CYCLES = 2_000_000
DEVICE = "cuda"             # where inputs are made (the helpers take another, e.g. for a CPU check of them)


# ---- cases ------------------------------------------------------------------------------------

def case_label(c) -> str:
    d_qk, h_q, topk, s_kv = c
    return f"{d_qk}/{h_q}/{topk}/{s_kv}"


def parse_selectors(text: str) -> List[Dict[str, int]]:
    """``"h_q=64,d_qk=576;topk=512"`` -> [{"h_q": 64, "d_qk": 576}, {"topk": 512}] (one-line errors)."""
    sels = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        sel = {}
        for kv in part.split(","):
            key, eq, val = kv.strip().partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in CASE_KEYS:
                raise ValueError(f"--cases: expected key=value with keys {', '.join(CASE_KEYS)}, got {kv.strip()!r}")
            try:
                sel[key] = int(val)
            except ValueError:
                raise ValueError(f"--cases: {key}: expected an int, got {val.strip()!r}") from None
        sels.append(sel)
    return sels


def select_cases(text: Optional[str], base: Sequence[tuple], quick: Sequence[tuple]) -> List[tuple]:
    """The cases ``--cases`` names, in ``base``'s order (custom ones after)."""
    if text in (None, "", "all"):
        return list(base)
    if text == "quick":
        return list(quick)
    sels = parse_selectors(text)
    chosen = [c for c in base if any(all(dict(zip(CASE_KEYS, c))[k] == v for k, v in s.items()) for s in sels)]
    for s in sels:
        if len(s) == len(CASE_KEYS):
            c = tuple(s[k] for k in CASE_KEYS)
            if c not in chosen:
                chosen.append(c)
    if not chosen:
        raise ValueError(f"--cases {text!r}: no case matches (cases: {', '.join(case_label(c) for c in base)}; "
                         "name all four keys for another case)")
    return chosen


# ---- inputs (FlashMLA's generate_testcase) -------------------------------------------------------

def strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a buffer one larger in every dim and 128 larger in the last, sliced back
    (FlashMLA's ``kernelkit.non_contiguousify``: the strides are not the packed ones, the last dim
    stays contiguous)."""
    big = torch.empty([d + 128 if i == t.dim() - 1 else d + 1 for i, d in enumerate(t.shape)], dtype=t.dtype,
                      device=t.device)
    view = big[tuple(slice(0, d) for d in t.shape)]
    view.copy_(t)
    return view


def random_indices(s_q: int, s_kv: int, topk: int, g: torch.Generator, device=DEVICE, chunk: int = 256) -> torch.Tensor:
    """(s_q, 1, topk) int32: each row a random permutation of [0, s_kv) cut to topk (unique), -1 past
    s_kv where s_kv < topk; made ``chunk`` rows at a time (the uniform draws of a chunk are its memory)."""
    out = torch.empty(s_q, topk, dtype=torch.int32, device=device)
    width = max(s_kv, topk)
    for r0 in range(0, s_q, chunk):
        n = min(chunk, s_q - r0)
        u = torch.rand(n, width, device=device, generator=g)
        u[:, s_kv:] = -math.inf          # positions past the context last
        idx = u.topk(topk, dim=-1, sorted=True).indices
        idx[idx >= s_kv] = -1
        out[r0:r0 + n] = idx.to(torch.int32)
    return out.view(s_q, 1, topk)


def attn_sinks(h_q: int, g: torch.Generator, device=DEVICE) -> torch.Tensor:
    sink = torch.randn(h_q, device=device, generator=g)
    mask = torch.randn(h_q, device=device, generator=g)
    sink[mask < -0.5] = -math.inf
    sink[mask > 0.5] = math.inf
    return sink


def case_seed(c, s_q: int) -> int:
    d_qk, h_q, topk, s_kv = c
    return (((d_qk * 1000 + h_q) * 10000 + topk) * 1000003 + s_kv) * 7 + s_q


def make_case(c, s_q: int, contiguous: bool, with_topk_length: bool, device=DEVICE) -> dict:
    """One case's q, kv, indices, attn_sink, topk_length and sm_scale, drawn from a generator seeded
    by the case (the same whatever else the run measures)."""
    d_qk, h_q, topk, s_kv = c
    seed = case_seed(c, s_q)
    g = torch.Generator(device=device).manual_seed(seed)
    offsets = random.Random(seed)

    def randn(*shape):
        x = torch.randn(*shape, device=device, generator=g) / 10 + (offsets.random() - 0.5) / 10
        return x.clamp_(-10, 10).to(torch.bfloat16)

    q, kv = randn(s_q, h_q, d_qk), randn(s_kv, 1, d_qk)
    indices = random_indices(s_q, s_kv, topk, g, device)
    sink = attn_sinks(h_q, g, device)
    length = None
    if with_topk_length:
        length = torch.randint(0, max(topk + 1, 64), (s_q,), device=device, generator=g, dtype=torch.int32).clamp_max(topk)
    if not contiguous:
        q, kv, indices = strided(q), strided(kv), strided(indices)
    return dict(q=q, kv=kv, indices=indices, attn_sink=sink, topk_length=length, sm_scale=PERF_SM_SCALE)


def prefill_work(x: dict) -> Tuple[float, float]:
    """(FLOPs, bytes) of a call by FlashMLA's count (module docstring)."""
    s_q, h_q, d_qk = x["q"].shape
    s_kv, topk = x["kv"].shape[0], x["indices"].shape[-1]
    idx, length = x["indices"][:, 0, :], x["topk_length"]
    valid = (idx >= 0) & (idx < s_kv)
    if length is None:
        attended = s_q * topk
    else:
        attended = int(length.to(torch.int64).sum().item())
        valid &= torch.arange(topk, device=idx.device).view(1, topk) < length.view(s_q, 1)
    flop = 2 * attended * h_q * (d_qk + D_V)
    nbytes = int(valid.sum().item()) * d_qk * 2 + s_q * h_q * (d_qk + D_V) * 2
    return float(flop), float(nbytes)


# ---- the reference and the check ------------------------------------------------------------------

def reference_rows(x: dict, rows: torch.Tensor):
    """FlashMLA's ``ref.py`` in fp32 on query rows ``rows``: out (n, h_q, 512), max_logits and lse
    (n, h_q), natural log; a row with no valid index: out 0, max_logits -inf, lse +inf."""
    q, kv, indices, sink, length = x["q"], x["kv"], x["indices"], x["attn_sink"], x["topk_length"]
    s_kv, topk = kv.shape[0], indices.shape[-1]
    idx = indices[rows, 0, :].to(torch.int64)
    valid = (idx >= 0) & (idx < s_kv)
    if length is not None:
        valid &= torch.arange(topk, device=idx.device).view(1, topk) < length[rows].to(torch.int64).view(-1, 1)
    k = kv[:, 0, :][idx.clamp(0, s_kv - 1)].float()                        # (n, topk, d_qk)
    p = torch.einsum("nhd,ntd->nht", q[rows].float(), k) * x["sm_scale"]
    p = p.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(p, dim=-1)
    max_logits = p.max(dim=-1).values
    lse_o = lse if sink is None else torch.logaddexp(lse, sink.float().view(1, -1))
    lse_o = torch.where(torch.isneginf(lse_o), torch.full_like(lse_o, math.inf), lse_o)
    out = torch.einsum("nht,ntd->nhd", torch.exp(p - lse_o[..., None]), k[..., :D_V])
    return out, max_logits, torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


def sample_rows(s_q: int, n: int, device) -> torch.Tensor:
    return torch.linspace(0, s_q - 1, max(1, min(n, s_q)), device=device).round().long().unique()


def one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def check_prefill(res, ref, rows) -> str:
    """"ok" or why not: a sparse_fwd's (out, max_logits, lse) on ``rows`` against ``ref``."""
    try:
        for name, got, want in zip(("out", "max_logits", "lse"), res, ref):
            abs_tol, rel_tol, cos = PREFILL_TOL[name]
            check_allclose(name, got[rows].float(), want, abs_tol=abs_tol, rel_tol=rel_tol, cos_diff_tol=cos)
    except AssertionError as e:
        return " ".join(str(e).split())[:300]
    return "ok"


# ---- the libraries -------------------------------------------------------------------------------

def sparse_fwd_of(mod) -> Optional[Callable]:
    return getattr(mod, "flash_mla_sparse_fwd", None) if mod is not None else None


def libraries(fm) -> Dict[str, Callable]:
    """{key: flash_mla_sparse_fwd} of cute-mla and FlashMLA; a library without one is left out
    (said once)."""
    libs = {}
    for key, mod in (("cute", cute_mla), ("flashmla", fm)):
        fn = sparse_fwd_of(mod)
        if fn is not None:
            libs[key] = fn
        elif mod is not None:
            print(f"{LIBS[key]} has no flash_mla_sparse_fwd: left out", flush=True)
    return libs


def fwd_call(fn, x: dict, kv: Optional[torch.Tensor] = None):
    """One ``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink=, topk_length=)`` (both
    libraries' signature)."""
    return fn(x["q"], x["kv"] if kv is None else kv, x["indices"], x["sm_scale"], D_V,
              attn_sink=x["attn_sink"], topk_length=x["topk_length"])


def timed_or_errors(runners: Dict[str, List[Tuple[str, Callable]]], args, row: dict) -> Dict[str, dict]:
    """:func:`alternating_us` of ``runners`` (none: {}); a failure is written into ``row`` as each
    runner's ``<name>_error`` and gives {}."""
    try:
        return alternating_us(runners, args.iters, args.warmup, gpu=not args.routes) if runners else {}
    except Exception as e:  # noqa: BLE001
        for name in runners:
            row[f"{name}_error"] = "timing: " + one_line(e)
        return {}


def alternating_us(runners: Dict[str, List[Tuple[str, Callable]]], iters: int, warmup: int,
                   gpu: bool = False) -> Dict[str, dict]:
    """Each runner is a list of stages (name, fn); per iteration every runner in turn, an event before
    and after each stage, synchronized after each runner. Returns {runner: {stage: [µs...], "total": [µs...],
    "host": [µs...]}}: "host" is the host's time from the first event to the last one's record, the runner's
    Python and launch path, which an idle GPU waits through inside "total". ``gpu``: the stages are timed
    again behind a GPU sleep of ``GPU_SLEEP_CYCLES`` (the host's path then runs while the GPU is busy), "gpu"
    [µs...] the GPU's time of the call alone and "gpu_exposed" [bool...] whether that iteration's host path
    outlasted its sleep (then the GPU waited inside "gpu" too)."""
    for _ in range(warmup):
        for stages in runners.values():
            for _, fn in stages:
                fn()
    torch.cuda.synchronize()
    keys = ("total", "host") + (("gpu", "gpu_exposed") if gpu else ())
    times = {k: {name: [] for name, _ in stages} | {key: [] for key in keys} for k, stages in runners.items()}
    for _ in range(iters):
        for k, stages in runners.items():
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
            t0 = time.perf_counter()
            ev[0].record()
            for (_, fn), e in zip(stages, ev[1:]):
                fn()
                e.record()
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            times[k]["host"].append(host * 1e6)
            for (name, _), a, b in zip(stages, ev, ev[1:]):
                times[k][name].append(a.elapsed_time(b) * 1e3)
            times[k]["total"].append(ev[0].elapsed_time(ev[-1]) * 1e3)
            if not gpu:
                continue
            slept = torch.cuda.Event(enable_timing=True)
            slept.record()
            torch.cuda._sleep(GPU_SLEEP_CYCLES)
            t0 = time.perf_counter()
            ev[0].record()
            for _, fn in stages:
                fn()
            ev[-1].record()
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            times[k]["gpu"].append(ev[0].elapsed_time(ev[-1]) * 1e3)
            times[k]["gpu_exposed"].append(host * 1e3 > slept.elapsed_time(ev[0]))
    return times


SUSTAINED_ROUNDS = 3


def sustained_us(runners: Dict[str, List[Tuple[str, Callable]]], seconds: float,
                 call_us: Dict[str, float]) -> Dict[str, dict]:
    """Each runner's calls back to back (the module docstring's sustained timing): about
    ``seconds`` of them (``call_us``: a runner's µs a call, to count them), the runners in turn,
    ``SUSTAINED_ROUNDS`` rounds. Returns {runner: {"us": [...], "mj": [...], "mhz": [...]}}, one
    entry per round (mJ and MHz empty without NVML)."""
    meter = _nvml_meter()
    out = {k: {"us": [], "mj": [], "mhz": []} for k in runners}
    for r in range(SUSTAINED_ROUNDS):
        for k in rotated(list(runners), r):
            stages = runners[k]
            n = max(10, int(seconds / (call_us[k] * 1e-6)))
            for _, fn in stages:
                fn()
            torch.cuda.synchronize()
            start = meter() if meter else None
            step, clocks = max(1, n // 8), []
            t0 = time.perf_counter()
            for i in range(n):
                for _, fn in stages:
                    fn()
                if meter and i % step == step // 2:      # the clock while the queue runs
                    clocks.append(meter()[1])
            torch.cuda.synchronize()
            out[k]["us"].append((time.perf_counter() - t0) / n * 1e6)
            if meter:
                out[k]["mj"].append((meter()[0] - start[0]) / n)
                out[k]["mhz"].append(statistics.mean(clocks))
    return out


def rotated(keys: list, r: int) -> list:
    """``keys`` from the ``r``-th on (cyclically): round r of the sustained timing starts with a
    different runner, so that a runner's place in the round (the clock and heat the one before
    left) is not the same in every round."""
    r %= max(1, len(keys))
    return keys[r:] + keys[:r]


def _nvml_meter() -> Optional[Callable[[], Tuple[float, float]]]:
    """A function of () -> (the current GPU's energy counter in mJ, its SM clock in MHz) through
    NVML, or None where pynvml or the device's NVML index is not available."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(torch.cuda.current_device()))
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception:  # noqa: BLE001 -- no meter: the sustained µs alone
        return None
    return lambda: (float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)),
                    float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)))


def summary(samples: List[float]) -> dict:
    return dict(us=statistics.median(samples), us_min=min(samples), us_max=max(samples))


# ---- the cases mode --------------------------------------------------------------------------------

def variant_fwd(tuning) -> Callable:
    """A ``flash_mla_sparse_fwd``-like call (the signature :func:`fwd_call` uses) of cute-mla's
    kernel compiled with ``tuning``, through the public call's own host path (checks, plan,
    launch), so that its time differs from the default's by the kernel (and the tuning's lookup)."""
    from cute_mla.interface import prefill as api

    def fwd(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None):
        return api.eager_call(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, None, tuning)

    fwd.tuning = tuning
    return fwd


def resolved_tuning(fn: Callable, x: dict) -> str:
    """The tuning of the config cute-mla's call ``fn`` (the public call, or a :func:`variant_fwd`)
    runs on ``x``, the rule's choices filled in, as ``key=value`` text."""
    from cute_mla.interface import prefill as api
    _, launcher, _ = api.checked_call(x["q"], x["kv"], x["indices"], x["sm_scale"], D_V, x["attn_sink"],
                                   x["topk_length"], None, getattr(fn, "tuning", None))
    return variant_text(launcher.cfg.tuning)


def run_case(c, libs: Dict[str, Callable], args) -> dict:
    d_qk, h_q, topk, s_kv = c
    x = make_case(c, args.s_q, args.contiguous, args.topk_length, DEVICE)
    flop, nbytes = prefill_work(x)
    row = dict(case=case_label(c), d_qk=d_qk, h_q=h_q, topk=topk, s_kv=s_kv, s_q=args.s_q, flop=flop, bytes=nbytes)
    rows = sample_rows(args.s_q, args.sample, x["q"].device)
    ref = reference_rows(x, rows) if args.sample else None
    runners, outs = {}, {}
    for key, fn in libs.items():
        try:
            res = fwd_call(fn, x)                          # compile (or load)
            torch.cuda.synchronize()
            row[f"{key}_check"] = check_prefill(res, ref, rows) if ref is not None else "not checked"
            if key != "flashmla":
                row[f"{key}_tuning"] = resolved_tuning(fn, x)
            outs[key] = res
            del res
            _, transient = transient_bytes(lambda: fwd_call(fn, x))
            row[f"{key}_transient_mib"] = transient / MIB
            runners[key] = [("call", lambda fn=fn: fwd_call(fn, x))]
        except Exception as e:  # noqa: BLE001 -- a library's failure is a result of the case
            row[f"{key}_error"] = one_line(e)
    if "cute" in outs and "variant" in outs:
        row["variant_max_abs_diff_out"] = (outs["cute"][0].float() - outs["variant"][0].float()).abs().max().item()
    if "cute" in outs and "flashmla" in outs:
        (oc, mc, lc), (of, mf, lf) = outs["cute"], outs["flashmla"]
        row["max_abs_diff_out"] = (oc.float() - of.float()).abs().max().item()
        fin = torch.isfinite(lf) & torch.isfinite(lc)
        row["max_abs_diff_lse"] = (lc[fin] - lf[fin]).abs().max().item() if fin.any() else 0.0
        fin = torch.isfinite(mf) & torch.isfinite(mc)
        row["max_abs_diff_max_logits"] = (mc[fin] - mf[fin]).abs().max().item() if fin.any() else 0.0
    del outs
    times = timed_or_errors(runners, args, row)
    for key, t in times.items():
        s = summary(t["call"])
        row.update({f"{key}_{k}": v for k, v in s.items()})
        row[f"{key}_host_us"] = statistics.median(t["host"])
        if t.get("gpu"):
            row[f"{key}_gpu_us"] = statistics.median(t["gpu"])
            row[f"{key}_gpu_exposed"] = sum(t["gpu_exposed"])
        row[f"{key}_tflops"] = flop / s["us"] * 1e-6
        row[f"{key}_tbps"] = nbytes / s["us"] * 1e-6
    if getattr(args, "sustained", 0) and times:
        timed = {k: v for k, v in runners.items() if k in times}
        try:
            sus = sustained_us(timed, args.sustained, {k: row[f"{k}_us"] for k in timed})
        except Exception as e:  # noqa: BLE001
            row["sustained_error"] = one_line(e)
            sus = {}
        for key, t in sus.items():
            row[f"{key}_sus_us"] = statistics.median(t["us"])
            if t["mj"]:
                row[f"{key}_sus_mj"] = statistics.median(t["mj"])
                row[f"{key}_sus_mhz"] = statistics.median(t["mhz"])
    for name, timing, lib in RATIO_DEFS:
        if f"cute_{timing}" in row and f"{lib}_{timing}" in row:
            row[name] = row[f"{lib}_{timing}"] / row[f"cute_{timing}"]
    row["runs"] = [run_of(row)]
    return row


# a runner's figures (per run and in the row), dropped with its time when it fails in a run
LIB_RUN_KEYS = ("us", "host_us", "gpu_us", "sus_us", "sus_mj", "sus_mhz")
# a row's ratios: (key, the timing it divides, the runner whose time is over cute-mla's)
RATIO_DEFS = (("ratio", "us", "flashmla"), ("variant_speedup", "us", "variant"),
              ("gpu_ratio", "gpu_us", "flashmla"), ("variant_gpu_speedup", "gpu_us", "variant"),
              ("sus_ratio", "sus_us", "flashmla"), ("variant_sus_speedup", "sus_us", "variant"))
RUN_KEYS = (tuple(f"{lib}_{k}" for k in LIB_RUN_KEYS for lib in ("cute", "flashmla", "variant"))
            + tuple(name for name, _, _ in RATIO_DEFS))
# the ratios a runner's failure drops
RATIOS = {key: tuple(name for name, _, lib in RATIO_DEFS if key in ("cute", lib)) for key in ("cute", "flashmla", "variant")}


def run_of(row: dict) -> dict:
    """One run's figures of a case row (its medians and ratios)."""
    return {k: row[k] for k in RUN_KEYS if k in row}


TUNINGS_SEP = " / "     # between the tunings of a row's runs, where they differ


def merge_runs(prev: dict, new: dict) -> dict:
    """A case measured again (``--repeat``, or a saved run of the same settings): ``new`` over
    ``prev`` with the runs of both, its µs the median over the runs of each run's median, its ratios
    the median of the runs' ratios (``ratio_min`` / ``ratio_max`` the range), a failed check kept;
    a library that failed in either has its error and no time."""
    runs = prev.get("runs", [run_of(prev)]) + new.get("runs", [run_of(new)])
    row = {**prev, **new, "runs": runs}
    for key, ratios in RATIOS.items():
        error = new.get(f"{key}_error", prev.get(f"{key}_error"))
        if error is not None:
            row[f"{key}_error"] = error
            for r in runs:
                for k in tuple(f"{key}_{f}" for f in LIB_RUN_KEYS) + ratios:
                    r.pop(k, None)
            for k in ("us_min", "us_max", "tflops", "tbps", "gpu_exposed"):
                row.pop(f"{key}_{k}", None)
    for k in RUN_KEYS + ("ratio_min", "ratio_max"):
        row.pop(k, None)
    for k in RUN_KEYS:
        vals = [r[k] for r in runs if k in r]
        if vals:
            row[k] = statistics.median(vals)
    for key in ("cute", "flashmla", "variant"):
        if f"{key}_us" in row:
            row[f"{key}_tflops"] = row["flop"] / row[f"{key}_us"] * 1e-6
            row[f"{key}_tbps"] = row["bytes"] / row[f"{key}_us"] * 1e-6
        if prev.get(f"{key}_check", "ok") not in ("ok", "not checked"):
            row[f"{key}_check"] = prev[f"{key}_check"]
        tunings = [t for r in (prev, new) if f"{key}_tuning" in r for t in r[f"{key}_tuning"].split(TUNINGS_SEP)]
        if tunings:                                 # runs of one case on different configs: each said
            row[f"{key}_tuning"] = TUNINGS_SEP.join(dict.fromkeys(tunings))
    ratios = [r["ratio"] for r in runs if "ratio" in r]
    if ratios:
        row["ratio_min"], row["ratio_max"] = min(ratios), max(ratios)
    return row


def runs_span(row: dict, key: str) -> str:
    """" (lowest-highest, runs)" of a ratio over a row's runs, or "" for one run."""
    runs = [x[key] for x in row.get("runs", ()) if key in x]
    return f" ({min(runs):.3f}-{max(runs):.3f}, {len(runs)})" if len(runs) > 1 else ""


def cases_table(meta: dict, rows: Sequence[dict]) -> str:
    lines = [f"{meta['gpu']}  commit {meta['commit']}  {meta['date']}",
             f"sparse prefill, s_q {meta['s_q']}, sinks on, {meta['layout']} q/kv/indices, "
             f"topk_length {'random' if meta['topk_length'] else 'none'}; median of {meta['iters']} eager calls "
             "(libraries alternating); ratio = FlashMLA us / cute-mla us"
             + ("; a row of several runs: each µs the median over its runs, the ratio the median of the runs' "
                "ratios, (lowest-highest, runs)" if any(len(r.get("runs", ())) > 1 for r in rows) else ""), "",
             "| d_qk/h_q/topk/s_kv | cute-mla µs | TFLOP/s | MiB | check | FlashMLA µs | TFLOP/s | MiB | check | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["case"]]
        for key in LIBS:
            if f"{key}_us" in r:
                cells += [f"{r[f'{key}_us']:.1f}", f"{r[f'{key}_tflops']:.1f}", f"{r[f'{key}_transient_mib']:.2f}",
                          r.get(f"{key}_check", "-") if r.get(f"{key}_check") in ("ok", "not checked")
                          else f"FAIL: {r.get(f'{key}_check', '-')}"]
            elif f"{key}_error" in r:
                cells += [f"error: {r[f'{key}_error']}".replace("|", "/"), "-", "-", "-"]
            else:
                cells += ["-"] * 4
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        if "ratio" in r and len(r.get("runs", ())) > 1:
            ratio += f" ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}, {len(r['runs'])})"
        cells.append(ratio)
        lines.append("| " + " | ".join(cells) + " |")
    names = {**LIBS, "variant": "the variant"}
    if any("cute_tuning" in r for r in rows):
        lines += ["", "The tuning each row's kernel ran (the shape's rule resolved; the fields apart from the "
                  "default): " + "; ".join(f"{r['case']} {r['cute_tuning']}"
                                            + (f" (the variant: {r['variant_tuning']})" if "variant_tuning" in r else "")
                                            for r in rows if "cute_tuning" in r)]
    hosts = {key: [r[f"{key}_host_us"] for r in rows if f"{key}_host_us" in r] for key in names}
    if any(hosts.values()):
        lines += ["", "Host time of a call (its Python and launch path, which the idle GPU waits through inside "
                  "each µs above), median over the rows' medians: "
                  + ", ".join(f"{names[k]} {statistics.median(v):.1f} µs" for k, v in hosts.items() if v)]
    if any("gpu_ratio" in r for r in rows):
        lines += ["", "GPU time of a call (the same call behind a GPU sleep, so the host's path runs while the GPU "
                  "is busy; median of the runs' medians, the ratio the median of the runs' ratios):", "",
                  "| d_qk/h_q/topk/s_kv | cute-mla GPU µs | FlashMLA GPU µs | ratio |", "|---|---|---|---|"]
        for r in rows:
            if "gpu_ratio" in r:
                span = runs_span(r, "gpu_ratio")
                exposed = sum(r.get(f"{k}_gpu_exposed", 0) for k in LIBS)
                lines.append(f"| {r['case']} | {r['cute_gpu_us']:.1f} | {r['flashmla_gpu_us']:.1f} | "
                             f"{r['gpu_ratio']:.3f}{span}{f'; {exposed} iterations not hidden' if exposed else ''} |")
    if any("sus_ratio" in r for r in rows):
        lines += ["", f"Sustained time of a call (the calls back to back for about {meta.get('sustained', 0):g} s "
                  f"per library, {SUSTAINED_ROUNDS} rounds alternating: the GPU at its power cap; µs and mJ per "
                  "call, the SM clock; medians of the runs' medians, the ratio the median of the runs' ratios):", "",
                  "| d_qk/h_q/topk/s_kv | cute-mla µs | mJ | MHz | FlashMLA µs | mJ | MHz | ratio |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "sus_ratio" in r:
                span = runs_span(r, "sus_ratio")
                cells = [f"{r[f'{k}_sus_us']:.1f} | " + " | ".join(
                    f"{r[f'{k}_sus_{m}']:.0f}" if f"{k}_sus_{m}" in r else "-" for m in ("mj", "mhz"))
                    for k in LIBS]
                lines.append(f"| {r['case']} | {' | '.join(cells)} | {r['sus_ratio']:.3f}{span} |")
    if meta.get("variant"):
        sustained = any("variant_sus_speedup" in r for r in rows)
        lines += ["", f"cute-mla's default kernel against the variant `{meta['variant']}` (same run, same inputs); "
                  "speedup = variant µs / default µs", "",
                  "| d_qk/h_q/topk/s_kv | default µs | variant µs | TFLOP/s | check | speedup | GPU time speedup |"
                  + (" sustained speedup |" if sustained else ""),
                  "|---|---|---|---|---|---|---|" + ("---|" if sustained else "")]
        for r in rows:
            if "variant_us" in r:
                check = r.get("variant_check", "-")
                lines.append(f"| {r['case']} | {r.get('cute_us', float('nan')):.1f} | {r['variant_us']:.1f} | "
                             f"{r['variant_tflops']:.1f} | {check if check in ('ok', 'not checked') else 'FAIL: ' + check} | "
                             f"{r.get('variant_speedup', float('nan')):.3f} | {r.get('variant_gpu_speedup', float('nan')):.3f} |"
                             + (f" {r['variant_sus_speedup']:.3f} |" if "variant_sus_speedup" in r else ""))
            else:
                lines.append(f"| {r['case']} | - | error: {r.get('variant_error', '-')} | - | - | - | - |".replace("\n", " "))
    return "\n".join(lines)


def cases_main(args) -> dict:
    cases = args.case_list
    fm = import_flashmla()
    libs = libraries(fm)
    if not libs:
        raise SystemExit("bench_sparse_prefill: neither cute_mla nor FlashMLA has flash_mla_sparse_fwd")
    variant = None
    if args.variant:
        from cute_mla.archs import device_arch
        from cute_mla.playground.bench import parse_variant
        tuning = parse_variant(args.variant, arch=device_arch(torch.device("cuda")), op="sparse_prefill")
        libs["variant"] = variant_fwd(tuning)
        variant = variant_text(tuning)
    warm_up(args.warmup_s)
    results = {}
    for rep in range(args.repeat):
        for i, c in enumerate(cases):
            print(f"[{rep + 1}/{args.repeat}: {i + 1}/{len(cases)}] {case_label(c)}", flush=True)
            r = run_case(c, libs, args)
            torch.cuda.empty_cache()        # (the case's inputs, freed with its frame)
            results[c] = merge_runs(results[c], r) if c in results else r
            print(json.dumps(r), flush=True)
    results = list(results.values())
    meta = run_meta(args, mode="cases", s_q=args.s_q, layout="packed" if args.contiguous else "strided (FlashMLA's)",
                    topk_length=args.topk_length, sm_scale=PERF_SM_SCALE, flashmla=fm is not None, variant=variant,
                    sustained=args.sustained)
    print()
    print(cases_table(meta, results))
    return dict(meta=meta, results=results)


# ---- the routes mode ---------------------------------------------------------------------------------

def v32_cache(s_kv: int, g: torch.Generator, device=DEVICE) -> torch.Tensor:
    """A V3.2 FP8 cache of ``s_kv`` tokens (s_kv / 64 page blocks of 64, (blocks, 64, 1, 656) uint8),
    the decode benchmark's keys: N(0, 1)/10 clamped to +-1."""
    kv = (torch.randn(s_kv, V32.d_qk, device=device, generator=g) / 10).clamp(-1, 1)
    return quantize_v32(kv).view(s_kv // PAGE, PAGE, 1, V32.row_bytes)


def dequant_context(cache: torch.Tensor, ws: torch.Tensor) -> None:
    """Route (a)'s first stage in torch ops: every row of ``cache`` (V3.2, 656 B) dequantized into the
    bf16 workspace ``ws`` (s_kv, 1, 576): bf16(fp8 * scale) for the 512 NoPE dims, the bf16 RoPE copied."""
    raw = cache.view(-1, V32.row_bytes)
    n = raw.shape[0]
    fp8 = raw[:, :512].view(torch.float8_e4m3fn).view(n, 4, 128)
    scale = raw[:, 512:528].view(torch.float32).view(n, 4, 1)
    ws[:, 0, :512].view(n, 4, 128).copy_(fp8.float() * scale)
    ws[:, 0, 512:].copy_(raw[:, 528:].view(torch.bfloat16))


def decode_call(mod, sched, xb: dict):
    return mod.flash_mla_with_kvcache(xb["q"], xb["cache"], None, None, D_V, sched, softmax_scale=xb["sm_scale"],
                                      is_fp8_kvcache=True, indices=xb["indices"])


def run_route_case(c, fm, args) -> dict:
    d_qk, h_q, topk, s_kv = c
    if d_qk != V32.d_qk or s_kv % PAGE:
        raise SystemExit(f"--routes: the V3.2 cache takes d_qk {V32.d_qk} and s_kv a multiple of {PAGE}; got {case_label(c)}")
    s_q = args.s_q
    g = torch.Generator(device=DEVICE).manual_seed(case_seed(c, s_q))
    cache = v32_cache(s_kv, g, DEVICE)
    ws = torch.empty(s_kv, 1, d_qk, dtype=torch.bfloat16, device=DEVICE)
    q = (torch.randn(s_q, h_q, d_qk, device=DEVICE, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
    indices = random_indices(s_q, s_kv, topk, g, DEVICE)
    length = torch.full((s_q,), topk, dtype=torch.int32, device=DEVICE) if args.topk_length else None
    xa = dict(q=q, kv=ws, indices=indices, attn_sink=None, topk_length=length, sm_scale=d_qk ** -0.5)
    xb = dict(q=q.unsqueeze(0), cache=cache, indices=indices.view(1, s_q, topk), sm_scale=d_qk ** -0.5)
    flop, fwd_bytes = prefill_work(xa)
    unique = int(torch.unique(indices[(indices >= 0) & (indices < s_kv)]).numel())
    dequant_bytes = s_kv * (V32.row_bytes + 2 * d_qk)
    rate = measured_copy_tbps()
    row = dict(case=case_label(c), d_qk=d_qk, h_q=h_q, topk=topk, s_kv=s_kv, s_q=s_q, flop=flop,
               workspace_mib=ws.nbytes / MIB, cache_mib=cache.nbytes / MIB, copy_tbps=rate,
               dequant_bytes=dequant_bytes, dequant_floor_us=dequant_bytes / rate * 1e-6, fwd_bytes=fwd_bytes,
               decode_bytes=2 * s_q * h_q * (d_qk + D_V) + unique * V32.row_bytes, unique_rows=unique)
    # the dequant stage once: against the library's own dequantizer on a slice, and its memory beyond the workspace
    dequant_context(cache, ws)
    torch.cuda.synchronize()
    some = torch.randperm(s_kv, device=DEVICE, generator=g)[:256]
    want = dequantize_v32(cache.view(-1, V32.row_bytes)[some]).to(torch.bfloat16)
    row["dequant_check"] = "ok" if torch.equal(ws[some, 0], want) else "FAIL: differs from formats.dequantize_v32"
    _, t = transient_bytes(lambda: dequant_context(cache, ws))
    row["dequant_transient_mib"] = t / MIB
    rows = sample_rows(s_q, args.sample, q.device)
    ref = reference_rows(xa, rows) if args.sample else None
    runners = {}
    # route (a): dequant, then each library's sparse_fwd on the workspace
    for key, fn in (("cute", sparse_fwd_of(cute_mla)), ("flashmla", sparse_fwd_of(fm))):
        name = f"{key}_a"
        if fn is None:
            if key == "cute" or fm is not None:
                row[f"{name}_error"] = f"{LIBS[key]} has no flash_mla_sparse_fwd"
            continue
        try:
            res = fwd_call(fn, xa)
            torch.cuda.synchronize()
            row[f"{name}_check"] = check_prefill(res, ref, rows) if ref is not None else "not checked"
            row[f"{name}_out"] = res[0]   # (dropped before the JSON) for the route (b) comparison
            del res
            _, t = transient_bytes(lambda fn=fn: fwd_call(fn, xa))
            row[f"{name}_fwd_transient_mib"] = t / MIB
            runners[name] = [("dequant", lambda: dequant_context(cache, ws)), ("sparse_fwd", lambda fn=fn: fwd_call(fn, xa))]
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = one_line(e)
    # route (b): each library's FP8 decode kernel, the mixed-batch layout
    scheds = {}
    for key, mod in (("cute", cute_mla), ("flashmla", padded(fm))):
        if mod is None:
            continue
        name = f"{key}_b"
        try:
            sched = mod.get_mla_metadata()[0]
            out, lse = decode_call(mod, sched, xb)       # compile (or load), schedule
            torch.cuda.synchronize()
            if ref is not None:
                try:
                    check_out_lse(out[0, rows], lse[0][:, rows].transpose(0, 1), ref[0], ref[2])
                    row[f"{name}_check"] = "ok"
                except AssertionError as e:
                    row[f"{name}_check"] = " ".join(str(e).split())[:300]
            else:
                row[f"{name}_check"] = "not checked"
            if f"{key}_a_out" in row:
                row[f"{key}_b_vs_a_max_abs_diff"] = (out[0].float() - row[f"{key}_a_out"].float()).abs().max().item()
            del out, lse
            _, t = step_transient_bytes(lambda mod=mod: mod.get_mla_metadata()[0], lambda s, mod=mod: decode_call(mod, s, xb))
            row[f"{name}_transient_mib"] = t / MIB
            scheds[name] = sched
            runners[name] = [("decode", lambda mod=mod, sched=sched: decode_call(mod, sched, xb))]
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = one_line(e)
    if "cute_a_out" in row and "flashmla_a_out" in row:
        row["a_max_abs_diff_cute_vs_flashmla"] = (row["cute_a_out"].float() - row["flashmla_a_out"].float()).abs().max().item()
    for k in [k for k in row if k.endswith("_a_out")]:
        del row[k]
    torch.cuda.empty_cache()
    times = timed_or_errors(runners, args, row)
    for name, t in times.items():
        for stage, samples in t.items():
            s = summary(samples)
            row.update({f"{name}_{stage}_{k}": v for k, v in s.items()})
        row[f"{name}_tflops"] = flop / row[f"{name}_total_us"] * 1e-6
    for lib in LIBS:
        if f"{lib}_a_total_us" in row and f"{lib}_b_total_us" in row:
            row[f"{lib}_a_over_b"] = row[f"{lib}_a_total_us"] / row[f"{lib}_b_total_us"]
    return row


def routes_table(meta: dict, rows: Sequence[dict]) -> str:
    lines = [f"{meta['gpu']}  commit {meta['commit']}  {meta['date']}",
             f"V3.2 FP8 cache (656 B/token, page block {PAGE}), one prefill chunk of s_q {meta['s_q']}, no sink, "
             f"topk_length {'given (all topk)' if meta['topk_length'] else 'none'}; median of {meta['iters']} eager runs "
             "(routes and libraries alternating); route (a): torch dequant of the whole context into a bf16 workspace + "
             "flash_mla_sparse_fwd; route (b): flash_mla_with_kvcache on the FP8 cache, b=1, s_q=tokens", ""]
    for r in rows:
        lines += [f"**{r['case']}** (d_qk/h_q/topk/s_kv): workspace {r['workspace_mib']:.1f} MiB, FP8 cache "
                  f"{r['cache_mib']:.1f} MiB; dequant {r['dequant_bytes'] / 1e6:.1f} MB moved, floor "
                  f"{r['dequant_floor_us']:.1f} µs at the copy rate {r['copy_tbps']:.2f} TB/s, its temporaries "
                  f"{r['dequant_transient_mib']:.1f} MiB, check {r['dequant_check']}; sparse_fwd "
                  f"{r['fwd_bytes'] / 1e6:.1f} MB, decode {r['decode_bytes'] / 1e6:.1f} MB by FlashMLA's counts", "",
                  "| route | library | dequant µs | attention µs | total µs | TFLOP/s | transient MiB | check | total (a) / total (b) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for route in ("a", "b"):
            for lib, label in LIBS.items():
                n = f"{lib}_{route}"
                if f"{n}_total_us" in r:
                    deq = f"{r[f'{n}_dequant_us']:.1f}" if route == "a" else "-"
                    att = r[f"{n}_sparse_fwd_us"] if route == "a" else r[f"{n}_decode_us"]
                    mib = r[f"{n}_fwd_transient_mib"] if route == "a" else r[f"{n}_transient_mib"]
                    chk = r.get(f"{n}_check", "-")
                    cells = [deq, f"{att:.1f}", f"{r[f'{n}_total_us']:.1f}", f"{r[f'{n}_tflops']:.1f}", f"{mib:.2f}",
                             chk if chk in ("ok", "not checked") else f"FAIL: {chk}",
                             f"{r[f'{lib}_a_over_b']:.3f}" if f"{lib}_a_over_b" in r and route == "a" else "-"]
                elif f"{n}_error" in r:
                    cells = [f"error: {r[f'{n}_error']}".replace("|", "/")] + ["-"] * 6
                else:
                    continue
                lines.append(f"| ({route}) | {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def routes_main(args) -> dict:
    cases = args.case_list
    fm = import_flashmla()
    warm_up(args.warmup_s)
    results = []
    for i, c in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] routes {case_label(c)}", flush=True)
        r = run_route_case(c, fm, args)
        torch.cuda.empty_cache()
        results.append(r)
        print(json.dumps(r), flush=True)
    meta = run_meta(args, mode="routes", s_q=args.s_q, topk_length=args.topk_length, page_block_size=PAGE,
                    flashmla=fm is not None)
    print()
    print(routes_table(meta, results))
    return dict(meta=meta, results=results)


# ---- saving ------------------------------------------------------------------------------------------

def run_meta(args, **kw) -> dict:
    return dict(gpu=torch.cuda.get_device_name(), commit=commit_id(), torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                iters=args.iters, warmup=args.warmup, sample=args.sample,
                command="python3 benchmarks/bench_sparse_prefill.py " + " ".join(sys.argv[1:]), **kw)


def card_tag(gpu: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100`` (the results' card prefix)."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,3})\b", gpu)
    return (m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "", gpu)[:12] or "gpu").lower()


def markdown(doc: dict) -> str:
    parts = ["# Sparse prefill: cute-mla against FlashMLA (`benchmarks/bench_sparse_prefill.py`)", ""]
    for mode, title, table in (("cases", "FlashMLA's performance cases", cases_table),
                               ("routes", "The FP8 cache's two prefill routes (`--routes`)", routes_table)):
        if mode in doc:
            sec = doc[mode]
            cmds = sec["meta"].get("commands", [sec["meta"]["command"]])
            ran = f"`{cmds[-1]}`" + (f" (the last of {len(cmds)} saved runs merged here; the JSON lists their commands)"
                                     if len(cmds) > 1 else "")
            parts += [f"## {title}", "", ran, "", table(sec["meta"], sec["results"]), ""]
    return "\n".join(parts)


def section_summary(doc: dict) -> str:
    bits = []
    if "cases" in doc:
        ratios = [r["ratio"] for r in doc["cases"]["results"] if "ratio" in r]
        bits.append(f"{len(doc['cases']['results'])} of FlashMLA's cases" + (f", ratio {min(ratios):.2f}-{max(ratios):.2f}x"
                                                                         if ratios else ""))
    if "routes" in doc:
        bits.append("the FP8 routes (a) dequant + sparse_fwd, (b) FP8 decode kernel")
    return "; ".join(bits)


# What must match for a saved run to add to another's section rather than replace it.
SAME_RUN_KEYS = ("gpu", "commit", "s_q", "layout", "topk_length", "variant", "iters")


def save(doc_part: Dict[str, dict], directory: str) -> List[str]:
    """Write ``doc_part`` ({mode: {meta, results}}) as ``<card>-<commit>-sparse-prefill.json`` and
    ``.md`` into ``directory``, keeping the other mode's section of the newest file of the kind there
    and removing the older files; in ``benchmarks/results``, the index's row too. Returns the paths."""
    os.makedirs(directory, exist_ok=True)
    old = sorted(glob.glob(os.path.join(directory, f"*-{KIND}.json")), key=os.path.getmtime)
    doc = {}
    if old:
        try:
            with open(old[-1]) as f:
                doc = {k: v for k, v in json.load(f).items() if k in ("cases", "routes")}
        except (OSError, json.JSONDecodeError):
            doc = {}
    for mode, sec in doc_part.items():
        prev = doc.get(mode)
        if prev and all(prev["meta"].get(k) == sec["meta"].get(k) for k in SAME_RUN_KEYS):
            # the same card, commit and settings: a run of other cases adds its rows; in the cases mode
            # a case run again adds its runs (:func:`merge_runs`), in the routes mode it replaces its row
            meta = dict(sec["meta"], commands=prev["meta"].get("commands", [prev["meta"]["command"]]) + [sec["meta"]["command"]])
            new = {r["case"]: r for r in sec["results"]}
            rows = [merge_runs(r, new.pop(r["case"])) if mode == "cases" and r["case"] in new else new.pop(r["case"], r)
                    for r in prev["results"]]
            sec = dict(meta=meta, results=rows + list(new.values()))
        doc[mode] = sec
    meta = next(iter(doc_part.values()))["meta"]
    stem = os.path.join(directory, f"{card_tag(meta['gpu'])}-{meta['commit']}-{KIND}")
    for p in old + sorted(glob.glob(os.path.join(directory, f"*-{KIND}.md"))):
        if os.path.splitext(p)[0] != stem:
            os.remove(p)
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(doc))
    paths = [stem + ".json", stem + ".md"]
    if os.path.realpath(directory) == os.path.realpath(RESULTS):
        update_index(os.path.basename(stem), doc, meta)
        n = len(os.listdir(RESULTS))
        if n > 30:
            print(f"benchmarks/results holds {n} files, over the 30 tests/test_structure.py allows: retire "
                  f"{n - 30} older result(s) (git keeps them) and their rows in the index", file=sys.stderr)
    else:
        print(f"saved {paths[0]}; on the repository's machine: python3 benchmarks/bench_sparse_prefill.py --install "
              f"{paths[0]}", flush=True)
    return paths


def update_index(name: str, doc: dict, meta: dict) -> None:
    """The index row of the kind (``results/README.md``), replaced or added after the table's last row."""
    path = os.path.join(RESULTS, "README.md")
    with open(path) as f:
        lines = f.read().split("\n")
    gpus = sorted({card_tag(s["meta"]["gpu"]).upper() for s in doc.values()})
    commits = sorted({s["meta"]["commit"] for s in doc.values()})
    row = (f"| `{name}.json`, `.md` | sparse prefill: cute-mla's `flash_mla_sparse_fwd` against FlashMLA's, "
           f"{section_summary(doc)} | `python3 benchmarks/bench_sparse_prefill.py --save` (`--routes --save`) | "
           f"{', '.join(commits)} | {', '.join(gpus)} |")
    hit = [i for i, ln in enumerate(lines) if ln.startswith("| `") and f"-{KIND}.json`" in ln]
    if hit:
        lines[hit[0]] = row
        for i in reversed(hit[1:]):
            del lines[i]
    else:
        last = max(i for i, ln in enumerate(lines) if ln.startswith("| `"))
        lines.insert(last + 1, row)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def install(path: str) -> None:
    """``--install FILE.json``: a saved run (``--save DIR`` elsewhere) into ``benchmarks/results``."""
    try:
        with open(path) as f:
            doc = {k: v for k, v in json.load(f).items() if k in ("cases", "routes")}
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"--install {path}: {one_line(e)}") from None
    if not doc:
        raise SystemExit(f"--install {path}: not a {KIND} results file (no 'cases' or 'routes' section)")
    # the newest section's meta names the files: put that section last
    order = sorted(doc, key=lambda k: doc[k]["meta"].get("date", ""))
    for paths in (save({k: doc[k]}, RESULTS) for k in order):
        print("installed: " + ", ".join(paths))


# ---- main ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="cases: " + ", ".join(case_label(c) for c in CASES)
                                 + "\n(d_qk/h_q/topk/s_kv); quick: " + ", ".join(case_label(c) for c in QUICK))
    ap.add_argument("--routes", action="store_true",
                    help="the FP8 cache's two prefill routes (h_q 128, 64 and 16, s_kv 65536, topk 2048) instead of the cases")
    ap.add_argument("--cases", default=None, help="all | quick | key=value,...;... (keys d_qk, h_q, topk, s_kv)")
    ap.add_argument("--quick", action="store_true",
                    help="the quick cases (--routes: h_q 128 only) and 5 timed calls unless --iters is given")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per library (median; default 10)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="cases mode: passes over the cases (each row: the median over its runs, the ratios' range)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per library first")
    ap.add_argument("--s-q", type=int, default=S_Q, help="query rows per call (FlashMLA's cases: 4096)")
    ap.add_argument("--sample", type=int, default=SAMPLE_ROWS, help="query rows checked against the fp32 reference (0: none)")
    ap.add_argument("--contiguous", action="store_true", help="packed q, kv and indices (default: FlashMLA's strided ones)")
    ap.add_argument("--topk-length", action="store_true",
                    help="pass topk_length (cases: random per row, as FlashMLA's feature tests; routes: all topk, as vLLM)")
    ap.add_argument("--warmup-s", type=float, default=2.0, help="seconds of bf16 matmuls first (clocks up)")
    ap.add_argument("--save", nargs="?", const=RESULTS, default=None, metavar="DIR",
                    help="write JSON and markdown into benchmarks/results (the index updated), or into DIR")
    ap.add_argument("--sustained", type=float, default=0.0, metavar="S",
                    help="cases mode: also time each library's calls back to back for about S seconds (0: not)")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                    help="cases mode: also time cute-mla's kernel with this Tuning field (repeatable), e.g. prefetch_rows=true")
    ap.add_argument("--install", default=None, metavar="FILE.json",
                    help="put a run saved elsewhere (--save DIR) into benchmarks/results and its index (no GPU)")
    args = ap.parse_args(argv)
    if args.iters is None:
        args.iters = 5 if args.quick else 10
    if args.iters < 1 or args.repeat < 1 or args.warmup < 0 or args.s_q < 1 or args.sample < 0:
        ap.error("--iters, --repeat and --s-q take a positive int, --warmup and --sample a non-negative one")
    if args.repeat > 1 and args.routes:
        ap.error("--repeat: cases mode only")
    if args.variant and args.routes:
        ap.error("--variant: cases mode only")
    quick = ROUTE_CASES[:1] if args.routes else QUICK
    base = quick if args.quick else (ROUTE_CASES if args.routes else CASES)
    try:
        args.case_list = select_cases(args.cases, base, quick)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.install:
        return install(args.install)
    if not torch.cuda.is_available():
        raise SystemExit("bench_sparse_prefill: needs a CUDA GPU (SM90 or SM100) and none is visible "
                         "(torch.cuda.is_available() is False); --help and --install run anywhere")
    doc = {"routes": routes_main(args)} if args.routes else {"cases": cases_main(args)}
    if args.save:
        save(doc, args.save)


if __name__ == "__main__":
    main()
