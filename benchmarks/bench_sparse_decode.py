"""cute-mla vs FlashMLA (vLLM's build) side by side in one run: the V3.2 grid, or with ``--v4``
DeepSeek V4 decode shapes.

**V3.2** (default). Inputs: V3.2 FP8 cache, page block 64, a pool of 131072 tokens, top-k 2048 with
20% of the indices -1. FLOPs = 2*h*(576+512)*topk per query token.
Times: CUDA graph replay (median of per-replay events) and eager (median of events around a call).
On the latency rows (b * s_q <= 8) also ``layer_us``: the per-call time in one graph of
LAYER_CALLS calls (an engine captures every layer of a decode step in one graph, so a call there
pays no graph launch of its own; a one-call graph's replay includes the host's graph launch, 10-17
µs for a graph of one trivial kernel on the H200). Transient = peak allocation during a decode
step's first call (a fresh metadata object) beyond out and lse: cute-mla's split workspace, which
the step's later calls reuse, or FlashMLA's per-call accumulators (``testing.step_transient_bytes``).
Rates (both modes): TF/s of the real heads' work (FlashMLA's padded heads are not counted), and
cute-mla's ``rows TB/s``, the cache rows it gathers (valid indices; V4: within the lengths) in
bytes per second, with its share of the card's device-to-device copy rate measured at the start
of the run (``playground.bench.measured_copy_tbps``).

    python -m benchmarks.bench_sparse_decode [--rows all|quick|h128|small|b,s_q,h;...] [--json PATH] [--masked 0.2]
    python -m benchmarks.bench_sparse_decode --sustained 1,32768,64 [--seconds 4] [--variants default,no_pf]

``--sustained ROW``: each library runs the row back to back (eager calls) for ``--seconds``
(twice, alternating), with nvidia-smi's SM clock, power and temperature sampled every 100 ms, and
the time per call: on the long rows both libraries sit at the card's power cap, where the one-shot
grid's ratio depends on where each burst lands on the clock ramp. ``--variants`` (names of
``benchmarks.variants.VARIANTS``) runs each cute-mla kernel variant in turn: at the power cap a
variant that spends less energy per call runs at a higher clock.

**V4** (``--v4``): V4 ("MODEL1") FP8 cache (d_qk 512, 584 B/token), page block 64, two pools of
131072 tokens (the main cache and the extra cache), s_q = 1, main top-k 128 with ``topk_length``
uniform in [1, 128], an extra list of ``extra_topk`` in {0, 512, 1024} with ``extra_topk_length``
uniform in [1, extra_topk], ``attn_sink`` given; b in {1, 32, 128, 512}, h_q in {64, 128}
(``--rows small``: issue 43's rows, h_q 8 and 16 at b 128 and 512 with an extra list of 512).

**Fewer than 64 heads** (``--rows small`` in either mode, or any row with h_q 8, 16 or 32):
cute-mla runs the heads natively; FlashMLA, whose decode kernel takes 64 or 128, runs them as
engines call it, on q (and the sinks) zero-padded to 64 heads (``playground.bench.PaddedHeads``: the
padded copy made once, outside the timed calls), its out and lse cut back to the real heads for the
checks.

A row is a shape; its lengths and indices are random, and its time depends on the draw (at b=128,
h=128, extra 1024 one draw measured 1.19x and three others 1.23-1.24x). So each row is measured
on ``--draws`` draws of its inputs, each from a generator seeded by (b, h, extra_topk, draw), the
same whatever else the run measures (a ``--rows`` rerun reproduces a grid row). Per draw:
cute-mla's output is checked against the fp32 reference on a sample of requests (FlashMLA's
tolerances; FlashMLA's output too, for information), then both libraries' CUDA graphs of one
call are replayed in turn, round by round (``bench.interleaved_median_us``: an order effect or a
clock drift falls on both), each library's time the median of per-replay events; ratio =
FlashMLA µs / cute-mla µs (above 1: cute-mla faster). The row reports the median over its draws
of each library's time and of the per-draw ratio, and the lowest and highest per-draw ratio.
With ``--layers`` each draw also times both libraries' graphs of LAYER_CALLS calls the same way
(the per-call time an engine's decode step sees: no graph launch of its own) and the row reports
that ratio's median and range too.
Each library's transient memory (peak allocation during a decode step's first call beyond out
and lse: ``testing.step_transient_bytes``) is measured on the row's first draw.

    python -m benchmarks.bench_sparse_decode --v4 [--rows all|quick|small|b,h,extra_topk;...] [--draws 5] [--cold-l2] [--out PATH.json]
        [--variant NAME] [--sample 32] [--masked 0]

``--cold-l2`` reads 256 MiB before every timed replay (outside its events), so neither library
finds the row's KV, q or its own workspace in L2: an engine's decode step reads each layer's KV
from HBM, where the default (every replay on the same inputs) keeps up to the whole working set
in L2. ``--out`` and ``--json`` are one option (either mode).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

import cute_mla
from cute_mla.formats import V4, V32
from cute_mla.playground import bench
from cute_mla.playground.bench import PAGE, POOL, V32_MASKED, V32_TOPK as TOPK, capture_graph, import_flashmla as flashmla
from cute_mla.playground.bench import padded
from cute_mla.playground.bench import replay_median_us, v32_inputs as make_inputs, warm_up, work
from cute_mla.reference import sparse_decode_reference
from cute_mla.testing import check_out_lse, step_transient_bytes

GRID = [(1, 1, 64), (1, 8, 64), (1, 128, 64), (1, 1024, 64), (1, 8192, 64), (1, 32768, 64),
        (1, 1, 128), (1, 8, 128), (1, 128, 128), (1, 1024, 128), (1, 8192, 128),
        (128, 2, 128), (64, 2, 64), (128, 1, 64)]
QUICK = [(1, 1, 64), (1, 8, 64), (1, 1024, 64), (1, 8192, 64), (1, 1024, 128), (128, 2, 128), (64, 2, 64), (128, 1, 64)]
SMALL = [(128, 1, 16), (128, 1, 32)]   # issue 43's V3.2 rows: a TP8 rank's heads (FlashMLA padded to 64)
LAYER_CALLS = 16           # calls per graph for layer_us
LATENCY_ROW_TOKENS = 8     # rows with b * s_q at most this get layer_us


def parse_row(text):
    """"b,s_q,h" -> (b, s_q, h)."""
    b, s_q, h = (int(v) for v in text.split(","))
    return b, s_q, h


def parse_rows(text):
    """"b,s_q,h;b,s_q,h;..." -> [(b, s_q, h), ...]."""
    return [parse_row(r) for r in text.split(";")]


def call(mod, sched, q, cache, idx):
    return mod.flash_mla_with_kvcache(q, cache, None, None, V32.d_v, sched, softmax_scale=V32.d_qk ** -0.5,
                                      is_fp8_kvcache=True, indices=idx)


def time_one(mod, q, cache, idx, target_s=0.25):
    sched, _ = mod.get_mla_metadata()
    out = call(mod, sched, q, cache, idx)          # warm-up: compile, schedule
    torch.cuda.synchronize()
    # a step's memory beyond its outputs: a fresh metadata object's first call
    del out
    _, transient = step_transient_bytes(lambda: mod.get_mla_metadata()[0], lambda s: call(mod, s, q, cache, idx))
    # eager
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(15)]
    for a, b_ in ev:
        a.record(); call(mod, sched, q, cache, idx); b_.record()
    torch.cuda.synchronize()
    eager = statistics.median(a.elapsed_time(b_) * 1e3 for a, b_ in ev)
    # graph replay
    gr, (go, gl) = capture_calls(mod, sched, q, cache, idx, 1)
    n = max(5, min(200, int(target_s / max(eager * 1e-6, 1e-6))))
    res = dict(us=replay_median_us(gr, n), eager_us=eager, transient_mib=transient / 2**20)
    if q.shape[0] * q.shape[1] <= LATENCY_ROW_TOKENS:
        layers, _ = capture_calls(mod, sched, q, cache, idx, LAYER_CALLS)
        res["layer_us"] = replay_median_us(layers, 50) / LAYER_CALLS
    return res, (go, gl)


def commit_id() -> str:
    """The commit the results belong to. The device machine's copy of the tree may carry a stale
    .git: the caller's CUTE_MLA_COMMIT wins."""
    return os.environ.get("CUTE_MLA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"


def capture_calls(mod, sched, q, cache, idx, n):
    """A CUDA graph of ``n`` back-to-back calls and the last captured call's outputs."""
    return capture_graph(lambda: call(mod, sched, q, cache, idx), n)


def run_for(mod, sched, q, cache, idx, seconds):
    """(µs per call, mean SM MHz, mean W, mean C, min SM MHz) of ``mod`` running the row back to back
    with the metadata object ``sched`` (the clock columns None without nvidia-smi)."""
    call(mod, sched, q, cache, idx)
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True) if shutil.which("nvidia-smi") else None
    n, t0 = 0, time.time()
    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    while time.time() - t0 < seconds:
        for _ in range(5):
            call(mod, sched, q, cache, idx)
        n += 5
        torch.cuda.synchronize()
    e.record()
    torch.cuda.synchronize()
    us = a.elapsed_time(e) * 1e3 / n
    if smi is None:
        return us, None, None, None, None
    smi.terminate()
    samples = [[float(v) for v in line.split(",")] for line in smi.stdout.read().splitlines() if line.strip()]
    samples = samples[len(samples) // 4:]   # the ramp-up quarter left out
    if not samples:
        return us, None, None, None, None
    clk, pwr, tmp = (statistics.mean(r[i] for r in samples) for i in range(3))
    return us, clk, pwr, tmp, min(r[0] for r in samples)


def sustained(row, seconds, masked, variants):
    """The power-cap probe (module docstring): cute-mla's variants, then FlashMLA, twice."""
    from benchmarks.variants import variant_of   # (that module imports this one)

    tunings = {v: variant_of(v) for v in variants}
    if any(nocomb for _, nocomb in tunings.values()):
        raise SystemExit("--variants: --sustained runs whole calls (no +nocomb)")
    b, s_q, h = parse_row(row)
    q, cache, idx = make_inputs(b, s_q, h, masked, torch.Generator(device="cuda").manual_seed(0))
    fm = padded(flashmla())
    runs = [(f"cute:{v}" if v != "default" else "cute-mla", cute_mla,
             lambda v=v: cute_mla.FlashMLASchedMeta(tuning=tunings[v][0])) for v in variants]
    if fm is not None:
        runs.append(("FlashMLA", fm, lambda: fm.get_mla_metadata()[0]))
    if shutil.which("nvidia-smi") is None:
        print("nvidia-smi not found: time per call only")
    print(f"{torch.cuda.get_device_name()}  row b={b} s_q={s_q} h={h}  masked {masked}")
    print(f"{'library':22} {'us/call':>10} {'SM MHz':>8} {'min MHz':>8} {'W':>6} {'C':>4}")
    cell = lambda v, w: f"{v:{w}.0f}" if v is not None else "-".rjust(w)   # noqa: E731
    for _ in range(2):   # twice, alternating, so neither library always runs on a hotter card
        for name, mod, new_sched in runs:
            us, clk, pwr, tmp, cmin = run_for(mod, new_sched(), q, cache, idx, seconds)
            print(f"{name:22} {us:10.1f} {cell(clk, 8)} {cell(cmin, 8)} {cell(pwr, 6)} {cell(tmp, 4)}", flush=True)


# ---- V4 (--v4)

V4_TOPK = bench.V4_TOPK   # the playground's list (cute-mla bench --format v4); its pools: POOL tokens, page PAGE
BATCHES, HEADS, EXTRA_TOPKS = (1, 32, 128, 512), (64, 128), (0, 512, 1024)
V4_GRID = [(b, h, e) for h in HEADS for e in EXTRA_TOPKS for b in BATCHES]
V4_QUICK = [(1, 64, 512), (32, 64, 1024), (128, 128, 512), (512, 128, 1024)]
V4_SMALL = [(b, h, 512) for h in (8, 16) for b in (128, 512)]   # issue 43's V4 rows (FlashMLA padded to 64)
V4_SCALE = V4.d_qk ** -0.5


def v4_parse_rows(text):
    """"b,h,extra_topk;..." -> [(b, h, extra_topk), ...]."""
    return [tuple(int(v) for v in r.split(",")) for r in text.split(";") if r]


v4_make_pool = bench.v4_pool   # a V4 cache of POOL tokens (the playground's, ``cute-mla bench --format v4``)


def v4_make_row(b, h, extra_topk, masked, g):
    """One row's q, indices, lengths and sinks (s_q = 1); the extra list's are None without one."""
    q, indices, topk_length, extra_indices, extra_topk_length, sink = bench.v4_lists(b, 1, h, extra_topk, masked, g)
    return dict(q=q, indices=indices, topk_length=topk_length, extra_indices=extra_indices,
                extra_topk_length=extra_topk_length, attn_sink=sink)


def v4_call(mod, sched, row, k_cache, extra_k_cache):
    extra = row["extra_indices"] is not None
    return mod.flash_mla_with_kvcache(
        row["q"], k_cache, None, None, V4.d_v, sched, softmax_scale=V4_SCALE, is_fp8_kvcache=True,
        indices=row["indices"], attn_sink=row["attn_sink"], extra_k_cache=extra_k_cache if extra else None,
        extra_indices_in_kvcache=row["extra_indices"], topk_length=row["topk_length"],
        extra_topk_length=row["extra_topk_length"])


def v4_check_sample(out, lse, row, k_cache, extra_k_cache, sample, g):
    """``None`` if (out, lse) of a sample of requests are within FlashMLA's tolerances of the fp32
    reference, else the failure's message."""
    b = row["q"].shape[0]
    req = torch.randperm(b, device="cuda", generator=g)[:sample]
    pick = lambda t: None if t is None else t[req]  # noqa: E731
    extra = row["extra_indices"] is not None
    ro, rl = sparse_decode_reference(row["q"][req], k_cache, row["indices"][req], V4_SCALE, row["attn_sink"],
                                     row["topk_length"][req], extra_k_cache=extra_k_cache if extra else None,
                                     extra_indices=pick(row["extra_indices"]),
                                     extra_topk_length=pick(row["extra_topk_length"]))
    try:
        check_out_lse(out[req], lse[req], ro, rl)
    except AssertionError as e:
        return str(e)[:300]
    return None


def v4_row_seed(b, h, extra_topk, draw):
    """The seed of one draw of a row's inputs: the row and the draw only (b < 10^6, extra_topk <
    10^4, draw < 100 give distinct seeds)."""
    return ((b * 1000 + h) * 10000 + extra_topk) * 100 + draw


def v4_row_generator(b, h, extra_topk, draw):
    return torch.Generator(device="cuda").manual_seed(v4_row_seed(b, h, extra_topk, draw))


SMALL_HEADS = (8, 16, 32)


def achieved(fmt, rows, flop, times, copy_tbps):
    """A call's achieved rates from the cache ``rows`` it gathers, its ``flop`` (``bench.work`` at
    the real head count) and each library's ``{lib}_us`` in ``times``: ``{lib}_tflops``, and
    cute-mla's rows' bytes per second, ``cute_tbps``, with its share of ``copy_tbps``; with
    ``rows_bytes``."""
    out = dict(rows_bytes=rows * fmt.row_bytes)
    for lib in ("cute", "flashmla"):
        if f"{lib}_us" in times:
            out[f"{lib}_tflops"] = flop / times[f"{lib}_us"] * 1e-6
    if "cute_us" in times:
        out["cute_tbps"] = out["rows_bytes"] / times["cute_us"] * 1e-6
        out["cute_copy_share"] = out["cute_tbps"] / copy_tbps
    return out


class VariantLibrary:
    """cute_mla's two calls with every metadata object made for one kernel variant (``tuning``,
    the public seam ``FlashMLASchedMeta(tuning=...)``): ``--variant``."""

    def __init__(self, tuning):
        self.tuning = tuning
        self.flash_mla_with_kvcache = cute_mla.flash_mla_with_kvcache

    def get_mla_metadata(self, *args, **kwargs):
        return cute_mla.FlashMLASchedMeta(tuning=self.tuning), None


def v4_prepare(mod, row, k_cache, extra_k_cache, check, layer_calls=False):
    """(graph of one call on ``row``, with ``layer_calls`` a graph of LAYER_CALLS calls (else None),
    the out the one-call graph's replays write, the metadata object they read: keep it, the check's
    result and the plan's fields): an eager call first (compile, plan, schedule), checked
    (``check(out, lse)``, cute-mla's gate)."""
    sched, _ = mod.get_mla_metadata()
    out, lse = v4_call(mod, sched, row, k_cache, extra_k_cache)
    torch.cuda.synchronize()
    res = dict(check=check(out, lse) or "ok")
    del out, lse
    one_call = functools.partial(v4_call, mod, sched, row, k_cache, extra_k_cache)
    gr, (go, _) = capture_graph(one_call)
    layers = capture_graph(one_call, LAYER_CALLS)[0] if layer_calls else None
    plan = getattr(sched, "plan", None)
    if plan is not None:
        res.update(variant=plan.variant, schedule=plan.schedule, workspace_mib=plan.workspace_bytes / 2**20)
    return gr, layers, go, sched, res


def v4_transient_mib(mod, row, k_cache, extra_k_cache):
    _, transient = step_transient_bytes(lambda: mod.get_mla_metadata()[0], lambda s: v4_call(mod, s, row, k_cache, extra_k_cache))
    return transient / 2**20


def v4_run_draw(b, h, extra_topk, draw, pools, libs, args):
    """One draw of a row: {lib: {check, us, ...}}, the largest |out difference| between them and
    the cache rows the call gathers (valid positions within the lengths)."""
    row = v4_make_row(b, h, extra_topk, args.masked, v4_row_generator(b, h, extra_topk, draw))
    k_cache, extra_k_cache = pools

    def check(out, lse):   # the same sample of requests for both libraries
        sample_gen = torch.Generator(device="cuda").manual_seed(b * 1000 + h + extra_topk)
        return v4_check_sample(out, lse, row, k_cache, extra_k_cache, args.sample, sample_gen)

    res, graphs, layer_graphs, outs, keep = {}, {}, {}, {}, []
    for name, mod in libs.items():
        try:
            graphs[name], layers, outs[name], sched, res[name] = v4_prepare(mod, row, k_cache, extra_k_cache, check,
                                                                            args.layers)
            if layers is not None:
                layer_graphs[name] = layers
            keep.append(sched)
            if draw == 0:
                res[name]["transient_mib"] = v4_transient_mib(mod, row, k_cache, extra_k_cache)
        except Exception as e:  # noqa: BLE001
            res[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
    try:
        for name, us in (bench.interleaved_median_us(graphs, before=args.flush) if graphs else {}).items():
            res[name]["us"] = us
        for name, us in (bench.interleaved_median_us(layer_graphs) if layer_graphs else {}).items():
            res[name]["layer_us"] = us / LAYER_CALLS
    except Exception as e:  # noqa: BLE001
        for name in graphs:
            res[name] = dict(error=f"timing: {type(e).__name__}: {e}"[:300])
        outs = {}
    torch.cuda.synchronize()   # (the outs: the graphs' last replays)
    diff = (outs["cute"].float() - outs["flashmla"].float()).abs().max().item() if len(outs) == 2 else None
    rows = bench.gathered_rows(row["indices"], row["topk_length"])
    if row["extra_indices"] is not None:
        rows += bench.gathered_rows(row["extra_indices"], row["extra_topk_length"])
    return res, diff, rows


# (per-draw ratio, the time it divides): the one-call graph's, then the LAYER_CALLS-call graph's per call
RATIOS = (("ratio", "us"), ("layer_ratio", "layer_us"))


def v4_run_row(b, h, extra_topk, pools, cute, fm, args):
    """A row over ``args.draws`` draws: the medians of each library's time and of the ratio, the
    ratio's range, the first failing check (or ok), the first draw's memory, and every draw
    (``cute``: cute_mla, or a :class:`VariantLibrary`)."""
    libs = dict(cute=cute) if fm is None else dict(cute=cute, flashmla=fm)
    r = dict(b=b, s_q=1, h_q=h, topk=V4_TOPK, extra_topk=extra_topk, draws=[])
    for d in range(args.draws):
        res, diff, rows = v4_run_draw(b, h, extra_topk, d, pools, libs, args)
        per = {f"{lib}_{k}": v for lib, kv in res.items() for k, v in kv.items()}
        per.update(achieved(V4, rows, work(V4, h, b, rows)[0], per, args.copy_tbps))
        for ratio, us in RATIOS:
            if f"cute_{us}" in per and f"flashmla_{us}" in per:
                per[ratio] = per[f"flashmla_{us}"] / per[f"cute_{us}"]
        if diff is not None:
            per["max_abs_diff_vs_flashmla"] = diff
        r["draws"].append(per)
    first, draws = r["draws"][0], r["draws"]
    for lib in libs:
        errors = [f"draw {d}: {x[f'{lib}_error']}" for d, x in enumerate(draws) if f"{lib}_error" in x]
        if errors:   # a row with a failed draw has no time: its medians would be over other draws
            r[f"{lib}_error"] = errors[0]
            continue
        checks = [x[f"{lib}_check"] for x in draws]
        r[f"{lib}_check"] = next((c for c in checks if c != "ok"), "ok")
        for k in ("us", "layer_us", "tflops", "tbps", "copy_share"):
            if f"{lib}_{k}" in first:
                r[f"{lib}_{k}"] = statistics.median(x[f"{lib}_{k}"] for x in draws)
        for k in ("transient_mib", "variant", "schedule", "workspace_mib"):
            if f"{lib}_{k}" in first:
                r[f"{lib}_{k}"] = first[f"{lib}_{k}"]
    if any(f"{lib}_error" in r for lib in libs):
        return r
    for ratio, _ in RATIOS:   # the one-call ratio first: the many-call one is reported only beside it
        values = [x[ratio] for x in draws if ratio in x]
        if not values:
            break
        r.update({ratio: statistics.median(values), f"{ratio}_min": min(values), f"{ratio}_max": max(values)})
    if "ratio" in r:
        r["max_abs_diff_vs_flashmla"] = max(x["max_abs_diff_vs_flashmla"] for x in draws
                                            if "max_abs_diff_vs_flashmla" in x)
    return r


def v4_print_table(results, meta):
    variant = "" if meta.get("variant", "default") == "default" else f"  cute-mla variant {meta['variant']}"
    print(f"\n{meta['gpu']}  commit {meta['commit']}{variant}  V4 cache, pools of {POOL} tokens, page block {PAGE}, "
          f"s_q 1, top-k {V4_TOPK}, lengths uniform, sinks on")
    print(f"(µs and ratio: medians over each row's {meta['draws']} draws of its inputs; range: the lowest and "
          "highest per-draw ratio" + ("; L2 flushed before every timed replay" if meta["cold_l2"] else "") +
          f"; TF/s: the real heads' work; rows TB/s: the gathered rows' bytes, against the copy rate "
          f"{meta['copy_tbps']:.2f} TB/s)")
    print(f"{'b':>4} {'h':>4} {'extra':>6} | {'cute us':>8} {'TF/s':>6} {'rows TB/s':>12} {'MiB':>7} {'check':>6} | "
          f"{'FlashMLA us':>11} {'TF/s':>6} {'MiB':>7} {'check':>6} | {'ratio':>6} {'range':>11} {'maxdiff':>8}"
          + (f" | per call in a {LAYER_CALLS}-call graph: cute / FlashMLA us, ratio (range)" if meta.get("layers") else ""))
    for r in results:
        head = f"{r['b']:>4} {r['h_q']:>4} {r['extra_topk']:>6} | "
        if "cute_error" in r:
            ours = f"ERROR {r['cute_error'][:60]}"
        else:
            rate = f"{r['cute_tbps']:.2f} ({100 * r['cute_copy_share']:.0f}%)"
            ours = (f"{r['cute_us']:>8.1f} {r['cute_tflops']:>6.1f} {rate:>12} {r['cute_transient_mib']:>7.2f} "
                    f"{_ok(r['cute_check']):>6}")
        if "flashmla_us" in r:
            theirs = (f"{r['flashmla_us']:>11.1f} {r['flashmla_tflops']:>6.1f} {r['flashmla_transient_mib']:>7.2f} "
                      f"{_ok(r['flashmla_check']):>6}")
        else:
            theirs = f"{'-':>11} {'-':>6} {'-':>7} {'-':>6}" if "flashmla_error" not in r else f"ERROR {r['flashmla_error'][:40]}"
        tail = (f"{r['ratio']:>6.2f} {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} {r['max_abs_diff_vs_flashmla']:>8.1e}"
                if "ratio" in r else f"{'-':>6} {'-':>11} {'-':>8}")
        if "layer_ratio" in r:
            tail += (f" | {r['cute_layer_us']:.1f} / {r['flashmla_layer_us']:.1f}, {r['layer_ratio']:.2f} "
                     f"({r['layer_ratio_min']:.2f}-{r['layer_ratio_max']:.2f})")
        print(head + ours + " | " + theirs + " | " + tail)
    failed = [r for r in results if r.get("cute_check", "ok") != "ok"]
    for r in failed:
        print(f"cute-mla b={r['b']} h={r['h_q']} extra={r['extra_topk']}: {r['cute_check']}")


def _ok(check):
    return "ok" if check == "ok" else "FAIL"


def v4_main(args):
    """``--v4``: the V4 rows (module docstring)."""
    from benchmarks.variants import variant_of   # (that module imports this one)

    named = {"all": V4_GRID, "quick": V4_QUICK, "small": V4_SMALL}
    rows = named[args.rows] if args.rows in named else v4_parse_rows(args.rows)
    for b, h, e in rows:
        if h not in HEADS + SMALL_HEADS or e % 64 or b < 1:
            raise SystemExit(f"--rows: bad row b={b} h={h} extra_topk={e} (h 8, 16, 32, 64 or 128, extra_topk a "
                             "multiple of 64)")
    if not 1 <= args.draws < 100:
        raise SystemExit(f"--draws: got {args.draws}, accepted: 1 to 99")
    cute = cute_mla if args.variant == "default" else VariantLibrary(variant_of(args.variant)[0])
    fm = padded(flashmla())
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = (v4_make_pool(g), v4_make_pool(g))
    args.flush = bench.l2_flusher() if args.cold_l2 else None
    warm_up(args.warmup_s)
    args.copy_tbps = bench.measured_copy_tbps()
    results = []
    for b, h, e in rows:
        r = v4_run_row(b, h, e, pools, cute, fm, args)
        results.append(r)
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), commit=commit_id(), torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                pool=POOL, page_block_size=PAGE, topk=V4_TOPK, masked=args.masked, sample=args.sample, draws=args.draws,
                cold_l2=args.cold_l2, variant=args.variant, copy_tbps=args.copy_tbps, layers=args.layers,
                flashmla=fm is not None, command="python -m benchmarks.bench_sparse_decode " + " ".join(sys.argv[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    v4_print_table(results, meta)


V4_ONLY = {"draws": 5, "cold_l2": False, "sample": 32, "variant": "default", "layers": False}   # V4-only options, their defaults


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--v4", action="store_true", help="the V4 rows (two pools, lengths, sinks) instead of the V3.2 grid")
    ap.add_argument("--rows", default="all",
                    help="all | quick | h128 | small | b,s_q,h;b,s_q,h;... (--v4: all | quick | small | b,h,extra_topk;...)")
    ap.add_argument("--masked", type=float, default=None,
                    help=f"fraction of the indices set to -1 (default {V32_MASKED}; --v4: 0)")
    ap.add_argument("--json", "--out", dest="json", default=None, metavar="PATH",
                    help="write every row (and the run's metadata) to this JSON file")
    ap.add_argument("--warmup-s", type=float, default=2.0,
                    help="seconds of bf16 matmuls first, so the first row is not timed while the clocks ramp up")
    ap.add_argument("--sustained", default=None, metavar="ROW", help="b,s_q,h: the power-cap probe instead of the grid")
    ap.add_argument("--seconds", type=float, default=4.0, help="--sustained: seconds per library and round")
    ap.add_argument("--variants", default="default",
                    help="--sustained: cute-mla kernel variants (names of benchmarks.variants.VARIANTS)")
    v4 = ap.add_argument_group("--v4 only")
    v4.add_argument("--draws", type=int, default=None, help="draws of each row's inputs (the row: their medians; default 5)")
    v4.add_argument("--cold-l2", action="store_true", default=None,
                    help=f"read {bench.L2_FLUSH_MIB} MiB before every timed replay: no input in L2, as an engine's layer")
    v4.add_argument("--sample", type=int, default=None, help="requests of each draw checked against the reference (default 32)")
    v4.add_argument("--layers", action="store_true", default=None,
                    help=f"also each call's time in one graph of {LAYER_CALLS} calls, both libraries interleaved "
                         "(an engine's decode step: no graph launch of its own)")
    v4.add_argument("--variant", default=None,
                    help="cute-mla's kernel variant (a benchmarks.variants name, through FlashMLASchedMeta(tuning=...))")
    args = ap.parse_args(argv)
    given = [k for k in V4_ONLY if getattr(args, k) is not None]
    if given and not args.v4:
        hint = " (V3.2 rows' kernel variants: python -m benchmarks.variants --variants NAME,...)" if "variant" in given else ""
        ap.error(f"--{given[0].replace('_', '-')} is a --v4 option{hint}")
    if args.v4 and args.sustained:
        ap.error("--sustained runs a V3.2 row (no --v4)")
    for k, default in V4_ONLY.items():
        if getattr(args, k) is None:
            setattr(args, k, default)
    if args.masked is None:
        args.masked = 0.0 if args.v4 else V32_MASKED
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.v4:
        return v4_main(args)
    if args.sustained:
        warm_up(args.warmup_s)
        return sustained(args.sustained, args.seconds, args.masked, [v for v in args.variants.split(",") if v])
    fm = padded(flashmla())
    g = torch.Generator(device="cuda").manual_seed(0)
    named = {"all": GRID, "quick": QUICK, "h128": [r for r in GRID if r[2] == 128], "small": SMALL}
    rows = named[args.rows] if args.rows in named else parse_rows(args.rows)
    warm_up(args.warmup_s)
    copy_rate = bench.measured_copy_tbps()
    # cute-mla's first row timed in a process measured slow (b=1 s_q=1 h=64 graph replay:
    # 19-32 µs where later rows or other scripts measured 15-16 µs; cause not found): time it
    # once for both libraries and throw the results away.
    b0, s0, h0 = rows[0]
    q, cache, idx = make_inputs(b0, s0, h0, args.masked, g)
    time_one(cute_mla, q, cache, idx)
    if fm is not None:
        time_one(fm, q, cache, idx)
    del q, cache, idx
    results = []
    for (b, s_q, h) in rows:
        q, cache, idx = make_inputs(b, s_q, h, args.masked, g)
        flop, _ = work(V32, h, b * s_q, b * s_q * TOPK)
        r = dict(b=b, s_q=s_q, h_q=h)
        try:
            ours, (oo, ol) = time_one(cute_mla, q, cache, idx)
            r.update({f"cute_{k}": v for k, v in ours.items()})
        except Exception as e:  # noqa: BLE001
            r["cute_error"] = f"{type(e).__name__}: {e}"[:300]
            oo = None
        if fm is not None:
            theirs, (fo, fl) = time_one(fm, q, cache, idx)
            r.update({f"flashmla_{k}": v for k, v in theirs.items()})
            if oo is not None:
                r["ratio"] = theirs["us"] / ours["us"]
                if "layer_us" in ours:
                    r["layer_ratio"] = theirs["layer_us"] / ours["layer_us"]
                r["max_abs_diff_vs_flashmla"] = (oo.float() - fo.float()).abs().max().item()
                fin = torch.isfinite(fl)
                r["lse_max_abs_diff_vs_flashmla"] = (ol[fin] - fl[fin]).abs().max().item() if fin.any() else 0.0
        r.update(achieved(V32, bench.gathered_rows(idx), flop, r, copy_rate))
        results.append(r)
        print(json.dumps(r), flush=True)
        del q, cache, idx
        torch.cuda.empty_cache()

    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=commit_id(), torch=torch.__version__, masked=args.masked, pool=POOL, page_block_size=PAGE, topk=TOPK,
                copy_tbps=copy_rate,
                command="python -m benchmarks.bench_sparse_decode " + " ".join(sys.argv[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    print(f"\n{meta['gpu']}  commit {meta['commit']}  masked {args.masked}  (rows TB/s: the gathered rows' bytes, "
          f"against the copy rate {copy_rate:.2f} TB/s)")
    print(f"{'b':>4} {'s_q':>6} {'h':>4} | {'cute us':>9} {'eager':>8} {'TF/s':>6} {'rows TB/s':>12} {'MiB':>7} | {'FlashMLA us':>11} {'eager':>8} {'TF/s':>6} {'MiB':>8} | {'ratio':>6} {'maxdiff':>8}"
          f" | per call in a {LAYER_CALLS}-call graph: cute / FlashMLA us, time ratio")
    for r in results:
        if "cute_error" in r:
            print(f"{r['b']:>4} {r['s_q']:>6} {r['h_q']:>4} | ERROR {r['cute_error'][:90]}")
            continue
        fl = lambda k, f: (f % r[k]) if k in r else "-"
        rate = f"{r['cute_tbps']:.2f} ({100 * r['cute_copy_share']:.0f}%)"
        print(f"{r['b']:>4} {r['s_q']:>6} {r['h_q']:>4} | {r['cute_us']:>9.1f} {r['cute_eager_us']:>8.1f} {r['cute_tflops']:>6.1f} {rate:>12} {r['cute_transient_mib']:>7.2f} | "
              f"{fl('flashmla_us', '%11.1f')} {fl('flashmla_eager_us', '%8.1f')} {fl('flashmla_tflops', '%6.1f')} {fl('flashmla_transient_mib', '%8.1f')} | "
              f"{fl('ratio', '%6.2f')} {fl('max_abs_diff_vs_flashmla', '%8.1e')}"
              + (f" | {r['cute_layer_us']:.1f} / {fl('flashmla_layer_us', '%.1f')}"
                 + (f", {r['cute_layer_us'] / r['flashmla_layer_us']:.3f}x" if 'flashmla_layer_us' in r else "")
                 if "cute_layer_us" in r else ""))


if __name__ == "__main__":
    main()
