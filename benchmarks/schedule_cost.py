"""Probe (V4 rows, SM90): what a device schedule costs to make, per plan: the API makes it once per
decode step (the metadata object's first call), a traced call (``torch.compile``,
``cute_mla.interface.ops``) on every call. For each row, under the plan's schedule and under the
split one (``bench_v4.NO_PACKING``): the schedule's ops alone as a CUDA-graph replay (µs, the
interleaved median), and made eagerly, host and device, synchronized (µs, median of 50).

    python -m benchmarks.schedule_cost [--rows "b,h,extra;..."] [--rounds 5]
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks import bench_v4 as v4b
from cute_mla.interface.ops import call_plan, device_facts
from cute_mla.playground import bench
from cute_mla.plan.schedule import make_schedule

ROWS = "512,128,1024;512,128,512;1024,128,1024;256,128,1024"


def schedule_fn(row, extra, constants):
    """(make the row's schedule, the plan's schedule name) under ``plan_constants(**constants)``."""
    q, lens, extra_lens = row["q"], row["topk_length"], row["extra_topk_length"]
    with v4b.plan_constants(**constants):
        plan = call_plan(q, v4b.TOPK, extra, lens, extra_lens, *device_facts(q.device))
    return (lambda: make_schedule(plan, q.device, lens, extra_lens)), plan.schedule


def eager_us(fn, n=50):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main():
    args = v4b.probe_parser(ROWS).parse_args()
    g, _ = v4b.probe_inputs()
    for b, h, extra, row in v4b.probe_rows(args.rows, g):
        fns = {"plan": schedule_fn(row, extra, {}), "split": schedule_fn(row, extra, v4b.NO_PACKING)}
        graphs = {k: bench.capture_graph(fn)[0] for k, (fn, _) in fns.items()}
        med = bench.interleaved_median_us(graphs, rounds=args.rounds)
        print(f"V4 b={b} h={h} extra={extra}: " + " | ".join(
            f"{k} ({name}) graph {med[k]:.1f} us, eager {eager_us(fn):.1f} us" for k, (fn, name) in fns.items()),
            flush=True)


if __name__ == "__main__":
    main()
