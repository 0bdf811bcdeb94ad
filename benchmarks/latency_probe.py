"""Where a small decode call's latency goes, from inputs alone (no kernel change): CUDA-graph
replay time and the kernels' own device time (CUPTI) of cute-mla calls that differ in one thing,
next to a graph of one trivial kernel (the replay floor).

Rows (b=1, s_q=1): top-k 64 (one tile, no split) with every index masked (no gather, no MMA
work: launch, prologue, epilogue) and with none masked (one full tile's chain); top-k 128 and
256 (more tiles, whatever the plan makes of them); top-k 2048 with every index masked (the split
pieces' skeleton and the combine) and 20 % masked (the benchmark row). Differences between rows
are the costs of the parts.

    python benchmarks/latency_probe.py [--heads 64,128] [--variants default,xover_off] [--topk 2048]

``--variants``: names of sm90_variants.VARIANTS (the dispatcher compiles with that Tuning), one
line per variant and case; ``--topk``: only the cases of that top-k; ``--combine-rows 16,32``:
each variant again per combine batch size (``CombineConfig.rows_in_flight``; a bucket that does
not take 32 keeps 16); ``--layers N``: N calls per graph, times per call (an engine replays one
graph of every layer, so the per-call time there has no graph launch of its own).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import cute_mla  # noqa: E402
from cute_mla.arch import device_arch, device_num_sms  # noqa: E402
from bench_sparse_decode import capture_graph, make_inputs  # noqa: E402
from profile_small import graph_of, kernel_times, replay_us  # noqa: E402
from sm90_variants import VARIANTS, use_combine, use_tuning  # noqa: E402


CASES = [(64, 1.0), (64, 0.0), (128, 0.0), (256, 0.0), (2048, 1.0), (2048, 0.2)]   # (top-k, masked fraction)


def floor_graph():
    x = torch.zeros(1, device="cuda")
    return capture_graph(lambda: x.add_(1))[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--combine-rows", default=None, help="e.g. 16,32")
    ap.add_argument("--layers", type=int, default=1,
                    help="calls per captured graph; replay and kernel times are per call")
    args = ap.parse_args()
    names = args.variants.split(",")
    combine_rows = [int(v) for v in args.combine_rows.split(",")] if args.combine_rows else [None]
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  graph replay of one trivial kernel: {replay_us(floor_graph()):.1f} us")
    print(f"{'h':>4} {'topk':>5} {'masked':>6} {'variant':<14} | {'plan':<34} | {'replay us':>9} | kernels (device us, per replay)")
    g = torch.Generator(device="cuda").manual_seed(0)
    for h in (int(v) for v in args.heads.split(",")):
        for topk, masked in CASES:
            if args.topk is not None and topk != args.topk:
                continue
            q, cache, idx = make_inputs(1, 1, h, masked, g, topk=topk)
            plan = cute_mla.plan_sparse_decode(1, 1, h, 576, topk, arch=device_arch(dev), num_sms=device_num_sms(dev))
            ns = plan.host_schedule.num_splits
            pieces = ns[-1] - ns[0]
            desc = f"{plan.variant}, {len(plan.host_schedule.rows)} parts, {pieces} pieces{', plan: pair' if plan.column_pair else ''}"
            for name in names:
                for rows in combine_rows:
                    with use_tuning(VARIANTS[name]), use_combine(**({} if rows is None else {"rows_in_flight": rows})):
                        graph = graph_of(cute_mla, q, cache, idx, args.layers)
                    t = kernel_times(graph)
                    ks = ", ".join(f"{k[:24]} {v[0] / args.layers:.1f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1][0]))
                    label = name if rows is None else f"{name} c{rows}"
                    print(f"{h:>4} {topk:>5} {masked:>6.1f} {label:<14} | {desc:<34} | {replay_us(graph) / args.layers:>9.1f} | {ks}",
                          flush=True)


if __name__ == "__main__":
    main()
