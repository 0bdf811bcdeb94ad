"""What reading the split partials back costs at least, per call in a layer graph (s_q = 8 rows).

The question it answers (benchmarks/NOTES.md, session 2026-12-03 j): 1x8x64 runs 15.0 µs per call
in a 16-call graph, 11.1 µs of it without the combine (``split_sweep.py --variants
default,default+nocomb``); 0.6x FlashMLA needs ~13.0 µs, so any split reduction, a separate kernel
or one fused into the decode kernel, has ~1.9 µs on the chain. Its floor is reading the partials
(8.4 MB of bf16 at 1x8x64) out of L2. This probe times, per call in a graph of ``--layers`` calls:

* ``empty``: a one-element torch add (the per-kernel boundary in a graph);
* ``combine``: cute-mla's combine alone on the plan's accumulator shape (bf16 partials);
* ``sum``: torch's sum over the splits of the same bf16 bytes (no weights: a lower bound of any
  combine that reads them);
* ``copy xN``: torch copies of N times the partial bytes (L2 read + write rate).

    python benchmarks/reduce_floor.py [--rows "1,8,64;1,8,128"] [--layers 16]
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
from cute_mla.kernels.combine import combine_config, compile_combine, launch_combine  # noqa: E402
from bench_sparse_decode import capture_graph, parse_rows  # noqa: E402
from combine_probe import random_partials  # noqa: E402
from profile_small import replay_us  # noqa: E402

TOPK = 2048


def per_call_us(fn, layers):
    gr, _ = capture_graph(fn, layers)
    return replay_us(gr) / layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64;1,8,128")
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    dev = torch.device("cuda")
    arch, sms = device_arch(dev), device_num_sms(dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  per call in a graph of {args.layers} calls")
    tiny = torch.zeros(1, device=dev)
    print(f"empty (1-element add): {per_call_us(lambda: tiny.add_(1), args.layers):.2f} us")
    for b, s_q, h in parse_rows(args.rows):
        plan = cute_mla.plan_sparse_decode(b, s_q, h, 576, TOPK, arch=arch, num_sms=sms)
        ns, lse_accum, o_accum = random_partials(plan, g)
        o_accum, rows = o_accum.to(getattr(torch, plan.accum_dtype)), plan.accum_rows
        cfg = combine_config(arch, h, False, plan.num_sm_parts, accum_dtype=plan.accum_dtype)
        fn = compile_combine(cfg)
        out = torch.zeros(b, s_q, h, 512, dtype=torch.bfloat16, device=dev)
        lse = torch.zeros(b, s_q, h, device=dev)
        comb = per_call_us(lambda: launch_combine(fn, cfg, lse_accum, o_accum, ns, None, out, lse, layout_checked=True),
                           args.layers)
        mb = o_accum.numel() * o_accum.element_size() / 1e6
        flat = o_accum.view(rows, -1)
        red = torch.empty(flat.shape[1], dtype=o_accum.dtype, device=dev)
        summ = per_call_us(lambda: torch.sum(flat, dim=0, out=red), args.layers)
        print(f"{b}x{s_q}x{h}: {rows} partials, {mb:.2f} MB {plan.accum_dtype} | combine {comb:.2f} us "
              f"({mb / comb:.2f} TB/s read) | torch sum over splits {summ:.2f} us ({mb / summ:.2f} TB/s)")
        for n in (1, 4):
            src = torch.randn(int(n * o_accum.numel()), device=dev, generator=g).to(o_accum.dtype)
            dst = torch.empty_like(src)
            t = per_call_us(lambda: dst.copy_(src), args.layers)
            print(f"    copy x{n} ({n * mb:.1f} MB read + written): {t:.2f} us ({n * mb / t:.2f} TB/s each way)")


if __name__ == "__main__":
    main()
