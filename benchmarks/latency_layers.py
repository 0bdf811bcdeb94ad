"""Single-token latency of cute-mla and FlashMLA, timed three ways in one run, per call.

1. ``one``: a CUDA graph of one call, events around each replay (the benchmark's method). An idle
   stream waits for the host's graph launch, so this includes the launch's latency: a graph of
   one trivial kernel replays in ~10 µs on our H200 (``latency_probe.py``'s floor line).
2. ``layers``: one graph of N calls back to back, replay time / N. An engine captures every layer
   of a decode step in one graph, so a call there pays no graph launch of its own. Neither
   library's first kernel is launched with PDL, so call i+1 starts after call i ends.
3. ``layers+op``: as 2, with one small dependent torch kernel between calls (q += 0 * out, a
   stand-in for the layer's other kernels); the op's own per-layer time, timed alone in a graph
   of N ops, is printed and subtracted in the ``net`` column.

Also the kernels' device time per call (CUPTI), as FlashMLA's ``bench_kineto`` reports it.
``--accum float32``: cute-mla once more with every SM90 split plan's o_accum of that dtype
(``cute-float32``), for an A/B against the plan's own choice in the same run.

    python benchmarks/latency_layers.py [--rows "1,1,64;1,8,64;1,1,128;1,8,128"] [--layers 16] [--accum float32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import cute_mla  # noqa: E402
from bench_sparse_decode import call, capture_graph, flashmla, make_inputs, parse_rows, warm_up  # noqa: E402
from profile_small import kernel_times, replay_us  # noqa: E402
from split_sweep import use_accum_dtype  # noqa: E402


def stand_in_op(q, out):
    """A dependent elementwise kernel: reads this layer's output, writes the next layer's q
    (adds zero, so q keeps its values)."""
    q[..., :512].add_(out, alpha=0.0)


def measure(mod, q, cache, idx, n):
    sched, _ = mod.get_mla_metadata()
    call(mod, sched, q, cache, idx)   # plans and compiles outside the captures
    torch.cuda.synchronize()
    one, _ = capture_graph(lambda: call(mod, sched, q, cache, idx), 1)
    layers, _ = capture_graph(lambda: call(mod, sched, q, cache, idx), n)

    def with_op():
        o, _ = call(mod, sched, q, cache, idx)
        stand_in_op(q, o)

    layers_op, _ = capture_graph(with_op, n)
    dev = kernel_times(layers)
    return dict(one_us=replay_us(one), layers_us=replay_us(layers) / n,
                layers_op_us=replay_us(layers_op) / n,
                device_us=sum(v[0] for v in dev.values()) / n,
                kernels={k: round(v[0] / n, 2) for k, v in dev.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,1,64;1,8,64;1,1,128;1,8,128")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--masked", type=float, default=0.2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--accum", default=None, help="also time cute-mla with this SM90 o_accum dtype")
    args = ap.parse_args()
    fm = flashmla()
    libs = [("cute-mla", cute_mla, None)] + ([(f"cute-{args.accum}", cute_mla, args.accum)] if args.accum else []) \
        + ([("FlashMLA", fm, None)] if fm is not None else [])
    g = torch.Generator(device="cuda").manual_seed(0)
    warm_up(2.0)
    n = args.layers
    print(f"{torch.cuda.get_device_name()}, {n} calls per layer graph, commit {os.environ.get('CUTE_MLA_COMMIT', '?')}")
    results = []
    for (b, s_q, h) in parse_rows(args.rows):
        q, cache, idx = make_inputs(b, s_q, h, args.masked, g)
        out = torch.zeros(b, s_q, h, 512, device="cuda", dtype=torch.bfloat16)
        op, _ = capture_graph(lambda: stand_in_op(q, out), n)
        op_us = replay_us(op) / n
        row = dict(b=b, s_q=s_q, h=h, op_us=op_us)
        for name, mod, accum in libs:
            with use_accum_dtype(accum):
                r = measure(mod, q, cache, idx, n)
            r["net_us"] = r["layers_op_us"] - op_us
            row[name] = r
        results.append(row)
        print(f"\nb={b} s_q={s_q} h={h}   stand-in op alone: {op_us:.2f} us per layer")
        print(f"  {'library':<12} | {'one-call graph':>14} | {'per layer':>9} | {'layer+op':>8} | {'net':>6} | {'device':>6} | kernels (device us per call)")
        for name, _, _ in libs:
            r = row[name]
            ks = ", ".join(f"{k[:28]} {v:.1f}" for k, v in sorted(r["kernels"].items(), key=lambda kv: -kv[1]))
            print(f"  {name:<12} | {r['one_us']:>14.1f} | {r['layers_us']:>9.1f} | {r['layers_op_us']:>8.1f} | "
                  f"{r['net_us']:>6.1f} | {r['device_us']:>6.1f} | {ks}")
        if fm is not None:
            c, f = row["cute-mla"], row["FlashMLA"]
            print("  cute/FlashMLA time: " + ", ".join(
                f"{k} {c[k] / f[k]:.3f}x" for k in ("one_us", "layers_us", "layers_op_us", "net_us", "device_us")))
        del q, cache, idx, out
    if args.json:
        meta = dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("CUTE_MLA_COMMIT"), layers=n,
                    masked=args.masked, command=" ".join(sys.argv))
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, rows=results), fh, indent=1)


if __name__ == "__main__":
    main()
