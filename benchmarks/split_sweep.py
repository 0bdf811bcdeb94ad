"""Latency rows: CUDA-graph replay time against the scheduler's partition count (num_sm_parts).

The SM90 plan uses FlashMLA's count, num_sms // s_q // (h_q // 64): at b=1, s_q=1 that is 132
partitions and the 32-block top-k list is cut into 32 one-block pieces, each storing a 64 x 512
fp32 partial that the combine reads back. Fewer partitions mean longer pieces (more tiles per CTA)
and fewer partials. This script patches the count, re-plans, checks every output against the
default count's (fp32 sums in another order: close, not bit-identical) and times the replays,
counts interleaved round by round, median per count.

    python benchmarks/split_sweep.py [--rows "1,1,64;1,8,64"] [--parts "0,f5,16,8"] [--variants default,cpair] [--layers 16]
(part count 0 = the plan's default, f5 = the default count with FlashMLA's 5-block piece overhead).
``--variants``: names of sm90_variants.VARIANTS (+ "+ctrig": the combine triggers its dependents; + "+nocomb": no
combine launched, a bound whose split outputs are not checked), each count timed with each (the first variant
at the first count is the base); ``--layers N``: N calls per graph, times per call.
A numeric count goes through the plan's piece-charge rule (scheduler.partition.fixed_overhead_blocks);
the sweep recorded at b31fe34 (results/h200-b31fe34-split-sweep.json) predates that rule: its counts
always charged 5.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import cute_mla  # noqa: E402
from cute_mla.interface import plan as plan_mod  # noqa: E402
from bench_sparse_decode import call, make_inputs, parse_rows  # noqa: E402
from profile_small import graph_of, replay_us  # noqa: E402
from sm90_variants import use_variant  # noqa: E402

_DEFAULT_PARTS = plan_mod.sched.num_sm_parts
_DEFAULT_OVERHEAD = plan_mod.sched.fixed_overhead_blocks


def use_parts(parts):
    """Patch the plan's partition count (0: the default rule; "f5": the default count with
    FlashMLA's fixed overhead of 5 blocks per piece always) and drop cached plans."""
    ps = plan_mod.sched   # the partition module the plan calls
    ps.num_sm_parts = _DEFAULT_PARTS if parts in (0, "f5") else (lambda *a, **k: parts)
    ps.fixed_overhead_blocks = (lambda *a, **k: ps.FIXED_OVERHEAD) if parts == "f5" else _DEFAULT_OVERHEAD
    plan_mod.plan_sparse_decode.cache_clear()


class use_accum_dtype:
    """Make every SM90 split plan use o_accum of ``dtype`` ("float32" / "bfloat16"; None: the
    plan's rule, ``sm90_accum_dtype``), dropping cached plans on entry and exit."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.orig = plan_mod.sm90_accum_dtype
        if self.dtype is not None:
            plan_mod.sm90_accum_dtype = lambda arch: self.dtype if arch == "sm_90a" else self.orig(arch)
        plan_mod.plan_sparse_decode.cache_clear()

    def __exit__(self, *exc):
        plan_mod.sm90_accum_dtype = self.orig
        plan_mod.plan_sparse_decode.cache_clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,1,64;1,8,64;1,1,128;1,8,128")
    ap.add_argument("--parts", default="0,f5,32,16,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default="default")
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    names = args.variants.split(",")
    rows = parse_rows(args.rows)
    counts = [p if p == "f5" else int(p) for p in args.parts.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for (b, s_q, h) in rows:
        q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
        graphs, ref = {}, None
        for p in counts:
            for name in names:
                use_parts(p)
                try:
                    with use_variant(name):
                        s, _ = cute_mla.get_mla_metadata()
                        o, l = call(cute_mla, s, q, cache, idx)
                        torch.cuda.synchronize()
                        if ref is None:
                            ref = (o.float().clone(), l.clone())
                        err = (o.float() - ref[0]).abs().max().item()
                        lerr = (l - ref[1]).abs().max().item()
                        if not name.endswith("+nocomb"):   # the no-combine bound writes no split output
                            assert err < 2e-2 and lerr < 1e-3, f"parts={p} {name}: out differs by {err}, lse by {lerr}"
                        graphs[(p, name)] = (graph_of(cute_mla, q, cache, idx, args.layers), err)
                finally:
                    use_parts(0)
        times = {k: [] for k in graphs}
        for _ in range(args.rounds):
            for k, (gr, _) in graphs.items():
                times[k].append(replay_us(gr) / args.layers)
        base = statistics.median(times[(counts[0], names[0])])
        for (p, name) in graphs:
            t = statistics.median(times[(p, name)])
            print(f"{b:>4} {s_q:>5} {h:>4} parts={p!s:>4} {name:<10} {t:8.2f} us x{base / t:.3f}  "
                  f"max|out-out0|={graphs[(p, name)][1]:.2e}", flush=True)
            results.append(dict(b=b, s_q=s_q, h=h, parts=p, variant=name, layers=args.layers, us=t, speedup=base / t))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), results=results), f, indent=1)


if __name__ == "__main__":
    main()
