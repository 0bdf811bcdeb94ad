"""Probe (V4 rows, SM90): kernel variants (``benchmarks.variants.VARIANTS``) against the default
through the public seam (``FlashMLASchedMeta(tuning=...)``), end to end, CUDA-graph replay of one
call, interleaved round by round, the default captured twice (the spread between two identical
graphs). Each variant's output must be the default's bits, or it is reported and not timed.

    python -m benchmarks.v4_variants [--variants no_pf,...] [--rows "b,h,extra;..."] [--rounds 5]
"""

from __future__ import annotations

import torch

from benchmarks import bench_v4 as v4b
from benchmarks.variants import same_bits, variant_of
from cute_mla.playground import bench

ROWS = "32,64,1024;128,64,1024;512,64,512;512,64,1024;32,128,512;128,128,512;128,128,1024;512,128,512;512,128,1024"


def capture(row, pools, tuning):
    """(graph, (out, lse) copies, plan text, the metadata object the graph reads) of one call."""
    gr, outs, sched = v4b.capture_forced(row, pools, tuning=tuning)
    p = sched.plan
    return gr, outs, f"{p.schedule}/{p.variant}/{p.num_sm_parts} parts", sched


def main():
    ap = v4b.probe_parser(ROWS)
    ap.add_argument("--variants", default="no_pf")
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]
    tunings = {n: variant_of(n) for n in names}   # (tuning, nocomb); raises on an unknown name
    for n, (tuning, nocomb) in tunings.items():
        if tuning is None or nocomb:
            raise SystemExit(f"--variants: {n!r}: a kernel variant to time against the default (no default, no "
                             "+nocomb)")
    g, pools = v4b.probe_inputs()
    print(f"{torch.cuda.get_device_name()}  V4 rows (s_q 1, top-k 128, lengths uniform, sinks on): µs per graph replay "
          f"of one call, interleaved medians of {args.rounds} rounds", flush=True)
    for b, h, e, row in v4b.probe_rows(args.rows, g):
        caps = {"default": capture(row, pools, None), "again": capture(row, pools, None)}
        for n in names:
            caps[n] = capture(row, pools, tunings[n][0])
        differ = [n for n in names if not same_bits(caps[n][1], caps["default"][1])]
        timed = {k: c[0] for k, c in caps.items() if k not in differ}
        med = bench.interleaved_median_us(timed, rounds=args.rounds)
        parts = [f"default {med['default']:.2f} / again {med['again']:.2f}"]
        parts += [f"{n} {med[n]:.2f} (x{med['default'] / med[n]:.3f})" for n in names if n not in differ]
        parts += [f"{n} DIFFERENT BITS (not timed)" for n in differ]
        print(f"b={b} h={h} extra={e} [{caps['default'][2]}]: " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
