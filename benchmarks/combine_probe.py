"""The split-KV combine alone on the latency rows' accumulator shapes, per batch size of row loads.

For each shape (the split counts the plan gives b=1, s_q in {1, 8}, h in {64, 128} at top-k 2048)
random partials are combined by a CUDA graph holding one combine launch (no decode kernel before
it, so its PDL wait returns at once): the graph replay time and the kernel's CUPTI device time,
per ``rows_in_flight`` and o_accum dtype (fp32, and bf16 as the SM90 plan picks); every batch
size must give the bits of the first one with the same dtype.

    python benchmarks/combine_probe.py
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import cute_mla  # noqa: E402
from cute_mla.arch import device_arch, device_num_sms  # noqa: E402
from cute_mla.scheduler import accum_offsets  # noqa: E402
from cute_mla.kernels.combine import ROWS_IN_FLIGHT_CHOICES, combine_config, compile_combine, launch_combine  # noqa: E402
from bench_sparse_decode import capture_graph  # noqa: E402
from profile_small import kernel_times, replay_us  # noqa: E402

SHAPES = [(1, 1, 64), (1, 8, 64), (1, 1, 128), (1, 8, 128)]
TOPK = 2048


def random_partials(plan, g):
    """A split plan's combine inputs with random values: the accumulator row offsets the dispatcher
    passes (only split requests own rows), lse_accum (rows, s_q, h) fp32 and o_accum
    (rows, s_q, h, 512) fp32 (callers cast it to the dtype they time), on the generator's device."""
    dev = g.device
    ns = torch.tensor(accum_offsets(plan.host_schedule.num_splits), dtype=torch.int32, device=dev)
    shape = (plan.accum_rows, plan.s_q, plan.h_q)
    lse_accum = torch.rand(shape, device=dev, generator=g) * 8 - 4
    o_accum = torch.randn(shape + (plan.d_v,), device=dev, generator=g)
    return ns, lse_accum, o_accum


def main():
    dev = torch.device("cuda")
    arch, sms = device_arch(dev), device_num_sms(dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  combine alone (graph of one launch)")
    variants = [(r, "float32") for r in ROWS_IN_FLIGHT_CHOICES] + [(ROWS_IN_FLIGHT_CHOICES[0], "bfloat16")]
    print(f"{'b':>3} {'s_q':>4} {'h':>4} {'splits':>6} | "
          + " | ".join(f"{f'rows {r} {dt[:4]}: replay / kernel us':>31}" for r, dt in variants))
    for b, s_q, h in SHAPES:
        plan = cute_mla.plan_sparse_decode(b, s_q, h, 576, TOPK, arch=arch, num_sms=sms)
        ns, lse_accum, o_accum32 = random_partials(plan, g)
        sink = torch.randn(h, device=dev, generator=g)
        cells, first = [], {}
        for r, dt in variants:
            o_accum = o_accum32.to(getattr(torch, dt))
            try:
                cfg = combine_config(arch, h, True, plan.num_sm_parts, rows_in_flight=r, accum_dtype=dt)
            except ValueError:   # a batch size this bucket does not take
                cells.append("-")
                continue
            fn = compile_combine(cfg)
            out = torch.zeros(b, s_q, h, 512, dtype=torch.bfloat16, device=dev)
            lse = torch.zeros(b, s_q, h, device=dev)
            args = (lse_accum, o_accum, ns, sink, out, lse)
            launch_combine(fn, cfg, *args)
            torch.cuda.synchronize()
            ref = first.setdefault(dt, (out.clone(), lse.clone()))
            same = torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
            gr, _ = capture_graph(lambda: launch_combine(fn, cfg, *args, layout_checked=True))
            kt = sum(v[0] for v in kernel_times(gr).values())
            cells.append(f"{replay_us(gr):6.1f} / {kt:5.1f}{'' if same else ' DIFFERS'}")
        splits = ns[1].item() - ns[0].item()
        print(f"{b:>3} {s_q:>4} {h:>4} {splits:>6} | " + " | ".join(f"{c:>31}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
