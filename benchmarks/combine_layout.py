"""A/B of the combine's two layouts (``CombineConfig.warps_per_head``: a CTA per (token, head),
or a warp per head) on split rows, end to end: the same call, its launcher's combine swapped.

Each layout's output must equal the other's bit for bit (the rows are summed in the same order);
then CUDA-graph replays of one call, and on the small rows per call in a 16-call graph, the two
layouts interleaved round by round, median per layout.

    python -m benchmarks.combine_layout [--v4 "b,h,extra;..."] [--v32 "b,s_q,h;..."] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import cute_mla
from benchmarks import bench_sparse_decode as v32b
from benchmarks import bench_v4 as v4b
from benchmarks.variants import same_bits
from cute_mla.kernels.combine import WARPS_PER_HEAD, compile_combine
from cute_mla.playground import bench

V4_ROWS = "1,64,512;1,128,1024;32,64,0;32,64,512;32,64,1024;32,128,0;32,128,512;32,128,1024;512,64,1024;512,128,512;512,128,1024"
V32_ROWS = "1,1,64;1,8,64;1,1,128;1,8,128;4,1,64;16,1,128;32,1,128;64,1,64"


def ab(name, fn, sched, has_sink, rounds, layers):
    fn()
    torch.cuda.synchronize()
    plan = sched.plan
    if not plan.split:
        print(f"{name}: {plan.variant} / {plan.schedule}: not split, no combine")
        return None
    launcher = sched.launcher(has_sink)
    base = launcher.combine_cfg
    graphs, outs = {}, {}
    try:
        for w in WARPS_PER_HEAD:
            launcher.combine_cfg = dataclasses.replace(base, warps_per_head=w)
            launcher.combine_compiled = compile_combine(launcher.combine_cfg)
            g1, (o, lse) = v32b.capture_graph(fn)
            g1.replay()
            torch.cuda.synchronize()
            outs[w] = (o.clone(), lse.clone())
            gl = v32b.capture_graph(fn, layers)[0] if layers else None
            graphs[w] = (g1, gl)
    finally:
        launcher.combine_cfg = base
        launcher.combine_compiled = compile_combine(base)
    same = same_bits(outs[4], outs[1])
    timed = {(w, kind): gr for w, pair in graphs.items() for kind, gr in zip(("one", "layers"), pair) if gr is not None}
    us = bench.interleaved_median_us(timed, rounds=rounds)
    med = {w: us[(w, "one")] for w in graphs}
    line = (f"{name}: parts {plan.num_sm_parts} rows {plan.accum_rows} by_partition {base.by_partition} "
            f"default {base.warps_per_head} | one-call us 4w {med[4]:.2f} 1w {med[1]:.2f} (1w x{med[4] / med[1]:.3f})")
    if layers:
        pl = {w: us[(w, "layers")] / layers for w in graphs}
        line += f" | per call in {layers} 4w {pl[4]:.2f} 1w {pl[1]:.2f} (x{pl[4] / pl[1]:.3f})"
    print(line + ("" if same else "  OUTPUTS DIFFER"), flush=True)
    return med


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--v4", default=V4_ROWS)
    ap.add_argument("--v32", default=V32_ROWS)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    v32b.warm_up(2.0)
    if args.v4:
        pools = (v4b.make_pool(g), v4b.make_pool(g))
        for b, h, e in v4b.parse_rows(args.v4):
            row = v4b.make_row(b, h, e, 0.0, g)
            sched, _ = cute_mla.get_mla_metadata()
            ab(f"V4 b={b} h={h} extra={e}", lambda: v4b.call(cute_mla, sched, row, *pools), sched, True,
               args.rounds, 0)
        del pools
        torch.cuda.empty_cache()
    for b, s_q, h in v4b.parse_rows(args.v32):
        q, cache, idx = v32b.make_inputs(b, s_q, h, 0.2, g)
        sched, _ = cute_mla.get_mla_metadata()
        ab(f"V3.2 {b}x{s_q}x{h}", lambda: v32b.call(cute_mla, sched, q, cache, idx), sched, False, args.rounds,
           16 if b * s_q <= 8 else 0)


if __name__ == "__main__":
    main()
