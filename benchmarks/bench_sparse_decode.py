"""cute-mla vs FlashMLA (vLLM's build) on the H200 benchmark grid, side by side in one run.

Inputs: V3.2 FP8 cache, page block 64, a pool of 131072 tokens, top-k 2048 with 20% of the indices
-1. FLOPs = 2*h*(576+512)*topk per query token.
Times: CUDA graph replay (median of per-replay events) and eager (median of events around a call).
On the latency rows (b * s_q <= 8) also ``layer_us``: the per-call time in one graph of
LAYER_CALLS calls (an engine captures every layer of a decode step in one graph, so a call there
pays no graph launch of its own; a one-call graph's replay includes the host's graph launch, 10-17
µs for a graph of one trivial kernel on the H200). Transient = peak allocation during a decode
step's first call (a fresh metadata object) beyond out and lse: cute-mla's split workspace, which
the step's later calls reuse, or FlashMLA's per-call accumulators (``testing.step_transient_bytes``).

    python -m benchmarks.bench_sparse_decode [--rows all|quick|h128|b,s_q,h;...] [--json PATH] [--masked 0.2]
    python -m benchmarks.bench_sparse_decode --sustained 1,32768,64 [--seconds 4] [--variants default,no_pf]

``--sustained ROW``: each library runs the row back to back (eager calls) for ``--seconds``
(twice, alternating), with nvidia-smi's SM clock, power and temperature sampled every 100 ms, and
the time per call: on the long rows both libraries sit at the card's power cap, where the one-shot
grid's ratio depends on where each burst lands on the clock ramp. ``--variants`` (names of
``benchmarks.variants.VARIANTS``) runs each cute-mla kernel variant in turn: at the power cap a
variant that spends less energy per call runs at a higher clock.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

import cute_mla
from cute_mla.formats import V32
from cute_mla.playground.bench import PAGE, POOL, V32_MASKED, V32_TOPK as TOPK, capture_graph, import_flashmla as flashmla
from cute_mla.playground.bench import replay_median_us, v32_inputs as make_inputs, warm_up, work
from cute_mla.testing import step_transient_bytes

GRID = [(1, 1, 64), (1, 8, 64), (1, 128, 64), (1, 1024, 64), (1, 8192, 64), (1, 32768, 64),
        (1, 1, 128), (1, 8, 128), (1, 128, 128), (1, 1024, 128), (1, 8192, 128),
        (128, 2, 128), (64, 2, 64), (128, 1, 64)]
QUICK = [(1, 1, 64), (1, 8, 64), (1, 1024, 64), (1, 8192, 64), (1, 1024, 128), (128, 2, 128), (64, 2, 64), (128, 1, 64)]
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
    fm = flashmla()
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="all", help="all | quick | h128 | b,s_q,h;b,s_q,h;...")
    ap.add_argument("--masked", type=float, default=V32_MASKED)
    ap.add_argument("--json", default=None)
    ap.add_argument("--warmup-s", type=float, default=2.0,
                    help="seconds of bf16 matmuls first, so the first row is not timed while the clocks ramp up")
    ap.add_argument("--sustained", default=None, metavar="ROW", help="b,s_q,h: the power-cap probe instead of the grid")
    ap.add_argument("--seconds", type=float, default=4.0, help="--sustained: seconds per library and round")
    ap.add_argument("--variants", default="default",
                    help="--sustained: cute-mla kernel variants (names of benchmarks.variants.VARIANTS)")
    args = ap.parse_args()
    if args.sustained:
        warm_up(args.warmup_s)
        return sustained(args.sustained, args.seconds, args.masked, [v for v in args.variants.split(",") if v])
    fm = flashmla()
    g = torch.Generator(device="cuda").manual_seed(0)
    named = {"all": GRID, "quick": QUICK, "h128": [r for r in GRID if r[2] == 128]}
    rows = named[args.rows] if args.rows in named else parse_rows(args.rows)
    warm_up(args.warmup_s)
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
            r["cute_tflops"] = flop / ours["us"] * 1e-6
        except Exception as e:  # noqa: BLE001
            r["cute_error"] = f"{type(e).__name__}: {e}"[:300]
            oo = None
        if fm is not None:
            theirs, (fo, fl) = time_one(fm, q, cache, idx)
            r.update({f"flashmla_{k}": v for k, v in theirs.items()})
            r["flashmla_tflops"] = flop / theirs["us"] * 1e-6
            if oo is not None:
                r["ratio"] = theirs["us"] / ours["us"]
                if "layer_us" in ours:
                    r["layer_ratio"] = theirs["layer_us"] / ours["layer_us"]
                r["max_abs_diff_vs_flashmla"] = (oo.float() - fo.float()).abs().max().item()
                fin = torch.isfinite(fl)
                r["lse_max_abs_diff_vs_flashmla"] = (ol[fin] - fl[fin]).abs().max().item() if fin.any() else 0.0
        results.append(r)
        print(json.dumps(r), flush=True)
        del q, cache, idx
        torch.cuda.empty_cache()

    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=commit_id(), torch=torch.__version__, masked=args.masked, pool=POOL, page_block_size=PAGE, topk=TOPK,
                command="python -m benchmarks.bench_sparse_decode " + " ".join(sys.argv[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    print(f"\n{meta['gpu']}  commit {meta['commit']}  masked {args.masked}")
    print(f"{'b':>4} {'s_q':>6} {'h':>4} | {'cute us':>9} {'eager':>8} {'TF/s':>6} {'MiB':>7} | {'FlashMLA us':>11} {'eager':>8} {'TF/s':>6} {'MiB':>8} | {'ratio':>6} {'maxdiff':>8}"
          f" | per call in a {LAYER_CALLS}-call graph: cute / FlashMLA us, time ratio")
    for r in results:
        if "cute_error" in r:
            print(f"{r['b']:>4} {r['s_q']:>6} {r['h_q']:>4} | ERROR {r['cute_error'][:90]}")
            continue
        fl = lambda k, f: (f % r[k]) if k in r else "-"
        print(f"{r['b']:>4} {r['s_q']:>6} {r['h_q']:>4} | {r['cute_us']:>9.1f} {r['cute_eager_us']:>8.1f} {r['cute_tflops']:>6.1f} {r['cute_transient_mib']:>7.2f} | "
              f"{fl('flashmla_us', '%11.1f')} {fl('flashmla_eager_us', '%8.1f')} {fl('flashmla_tflops', '%6.1f')} {fl('flashmla_transient_mib', '%8.1f')} | "
              f"{fl('ratio', '%6.2f')} {fl('max_abs_diff_vs_flashmla', '%8.1e')}"
              + (f" | {r['cute_layer_us']:.1f} / {fl('flashmla_layer_us', '%.1f')}"
                 + (f", {r['cute_layer_us'] / r['flashmla_layer_us']:.3f}x" if 'flashmla_layer_us' in r else "")
                 if "cute_layer_us" in r else ""))


if __name__ == "__main__":
    main()
