"""One public-API call of a benchmark row, bracketed by cudaProfilerStart/Stop, for Nsight Compute.

Warms up (compile, schedule) outside the profiled range, then profiles one call (decode kernel and,
where the plan splits, the combine). Inputs are bench_sparse_decode.py's.

    ncu --clock-control none --profile-from-start off --set full --import-source no \\
        -o OUT/rep python3 benchmarks/ncu_profile.py --row 1,1024,128
    ncu --import OUT/rep.ncu-rep --page details --csv        # per-kernel metrics
    ncu --import OUT/rep.ncu-rep --page source --csv --print-source sass   # per-SASS stall samples
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
from bench_sparse_decode import call, make_inputs, parse_row  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="1,1024,128", help="b,s_q,h")
    ap.add_argument("--masked", type=float, default=0.2)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--variant", default="default", help="a name of sm90_variants.VARIANTS")
    args = ap.parse_args()
    from sm90_variants import VARIANTS, use_tuning
    with use_tuning(VARIANTS[args.variant]):
        profile(args)


def profile(args):
    b, s_q, h = parse_row(args.row)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, cache, idx = make_inputs(b, s_q, h, args.masked, g, topk=args.topk)
    sched, _ = cute_mla.get_mla_metadata()
    for _ in range(3):
        call(cute_mla, sched, q, cache, idx)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call(cute_mla, sched, q, cache, idx)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one call of b={b} s_q={s_q} h={h} top-k {args.topk} masked {args.masked} variant {args.variant}")


if __name__ == "__main__":
    main()
