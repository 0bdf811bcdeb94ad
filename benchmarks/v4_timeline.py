"""Probe (V4 rows, SM90): where a request's cycles go when each CTA holds one request.

The decode kernel is compiled with ``Sm90Tuning(timeline=True)`` (``clock64`` stamps per phase,
``benchmarks/timeline.py``) and launched as the launcher would on a V4 row of ``bench_v4``
(top-k 128 and an extra list, lengths uniform, sinks), with the plan forced to one partition per
request (``plan.PER_REQUEST_WAVES`` and ``PER_REQUEST_MAX_BLOCKS`` opened), so that every CTA's stamps belong to one request whose tile
count is known: ``max(1, ceil((topk_length + extra_topk_length) / 64))`` (every index valid).
Per row it prints the phases' medians over the CTAs, then a least-squares line through
(tiles - 1, cycles from the first tile ready to the last PV done): the per-tile cost and what a
request pays before its first tile and after its last. ``--v32`` adds V3.2 rows for comparison:
one list of ``topk`` positions with ``topk_length`` uniform in [1, topk], sinks on, the same forced plan.

    python -m benchmarks.v4_timeline [--rows "b,h,extra;..."] [--v32 "b,h,topk;..."] [--replays 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from benchmarks import bench_sparse_decode as v32b
from benchmarks import bench_v4 as v4b
from cute_mla.archs import SM90, device_arch, device_num_sms
from cute_mla.formats import V4, V32
from cute_mla.interface.launcher import allocate_workspace, cache_bytes, kernel_module
from cute_mla.kernels import DecodeTensors
from cute_mla.kernels.sm90 import DEFAULT_TUNING
from cute_mla.kernels.sm90.config import Stamp
from cute_mla.plan import plan as plan_mod
from cute_mla.plan.schedule import make_schedule
from cute_mla.playground import bench
from cute_mla.scheduler import SchedField

ROWS = "128,64,512;128,64,1024;128,128,512;128,128,1024;512,64,1024"
PHASES = [Stamp.PROLOGUE, Stamp.METADATA, Stamp.SCAN, Stamp.Q_READY, Stamp.K_READY, Stamp.PV_DONE, Stamp.EPI_FINAL,
          Stamp.EPI_STAGED, Stamp.EPILOGUE, Stamp.WG1_EPILOGUE]
GHZ = 1.98


def v32_row(b, h, topk, g):
    """A V3.2 row shaped like ``bench_v4.make_row`` (one list, lengths uniform in [1, topk], sinks)
    and its cache."""
    q, cache, _ = bench.v32_inputs(b, 1, h, 0.0, g, topk=64)
    indices, topk_length = bench.index_list(b, 1, topk, 0.0, g)
    row = dict(q=q, indices=indices, topk_length=topk_length, extra_indices=None, extra_topk_length=None,
               attn_sink=torch.randn(h, device="cuda", generator=g))
    return row, (cache, None)


def per_request_plan(fmt, b, h, topk, extra):
    """The row's plan with one partition per request (the wave window opened for this call)."""
    window, most = plan_mod.PER_REQUEST_WAVES, plan_mod.PER_REQUEST_MAX_BLOCKS
    plan_mod.PER_REQUEST_WAVES, plan_mod.PER_REQUEST_MAX_BLOCKS = (0.0, 1e9), 1 << 30
    plan_mod.plan_sparse_decode.cache_clear()
    try:
        return plan_mod.plan_sparse_decode(b, 1, h, fmt.d_qk, topk, arch=SM90.name,
                                           num_sms=device_num_sms(torch.device("cuda")), has_topk_length=True,
                                           extra_topk=extra, has_extra_topk_length=extra > 0)
    finally:
        plan_mod.PER_REQUEST_WAVES, plan_mod.PER_REQUEST_MAX_BLOCKS = window, most
        plan_mod.plan_sparse_decode.cache_clear()


def stamped(row, pools, plan):
    """(launch, stamps, schedule) of the row's decode kernel with the timeline."""
    dev = row["q"].device
    schedule = make_schedule(plan, dev, row["topk_length"], row["extra_topk_length"])
    mod = kernel_module(plan.arch)
    extra = plan.extra_topk > 0
    cfg = mod.kernel_config(h_q=plan.h_q, d_qk=plan.d_qk, split=plan.split, has_topk_length=True, has_attn_sink=True,
                            column_pair=plan.column_pair, tuning=dataclasses.replace(DEFAULT_TUNING, timeline=True),
                            has_extra=extra, has_extra_topk_length=extra)
    compiled = mod.compile_sparse_decode(cfg)
    o_accum, lse_accum = allocate_workspace(plan, dev)
    b, s_q, h, _ = row["q"].shape
    out = torch.empty(b, s_q, h, plan.d_v, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=dev)
    stamps = torch.zeros(s_q * cfg.n_hblk * cfg.n_cblk, schedule.tile_md.shape[0], int(Stamp.SLOTS), dtype=torch.int64,
                         device=dev)
    t = DecodeTensors(row["q"], cache_bytes(pools[0]), row["indices"], row["topk_length"], row["attn_sink"],
                      schedule.tile_md, schedule.accum_offsets, out, lse, o_accum, lse_accum,
                      cache_bytes(pools[1]) if extra else None, row["extra_indices"], row["extra_topk_length"])

    def launch():
        schedule.ensure_ready()
        mod.launch_sparse_decode(compiled, cfg, t, plan.d_qk ** -0.5, timeline=stamps)

    return launch, stamps, schedule


def fit(xs, ys):
    """Least-squares (slope, intercept)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=ROWS, help="V4 rows b,h,extra_topk;...")
    ap.add_argument("--v32", default="", help="V3.2 rows b,h,topk;... (topk a multiple of 64)")
    ap.add_argument("--replays", type=int, default=5)
    args = ap.parse_args()
    arch = device_arch(torch.device("cuda"))
    if arch != SM90.name:
        raise SystemExit(f"the timeline is the SM90 kernel's: this GPU runs {arch}")
    g = torch.Generator(device="cuda").manual_seed(0)
    v32b.warm_up(2.0)
    pools = (v4b.make_pool(g), v4b.make_pool(g))
    print(f"{torch.cuda.get_device_name()}: one request per CTA; cycles since kernel entry, median over the "
          f"CTAs and {args.replays} graph replays; µs at {GHZ} GHz")
    cases = ([(V4, b, h, e) for b, h, e in v4b.parse_rows(args.rows)]
             + [(V32, b, h, k) for b, h, k in v4b.parse_rows(args.v32)])
    for fmt, b, h, n in cases:
        if fmt is V4:
            row, row_pools, plan = v4b.make_row(b, h, n, 0.0, g), pools, per_request_plan(V4, b, h, v4b.TOPK, n)
            label = f"V4 b={b} h={h} extra={n}"
        else:
            (row, row_pools), plan = v32_row(b, h, n, g), per_request_plan(V32, b, h, n, 0)
            label = f"V3.2 b={b} h={h} topk={n}"
        launch, stamps, schedule = stamped(row, row_pools, plan)
        for _ in range(3):
            launch()
        torch.cuda.synchronize()
        graph, _ = v32b.capture_graph(launch)
        req_of_part = schedule.tile_md[:, int(SchedField.BEGIN_REQ)].cpu().tolist()
        lengths = row["topk_length"] if row["extra_topk_length"] is None else row["topk_length"] + row["extra_topk_length"]
        lengths = lengths.cpu().tolist()
        phases = {s: [] for s in PHASES}
        xs, ys, total = [], [], []
        for _ in range(args.replays):
            stamps.zero_()
            graph.replay()
            torch.cuda.synchronize()
            st = stamps.cpu()
            for x in range(st.shape[0]):
                for part in range(st.shape[1]):
                    r = st[x, part]
                    if int(r[Stamp.METADATA]) == 0:
                        continue   # a CTA without work
                    entry = int(r[Stamp.ENTRY])
                    for s in PHASES:
                        if int(r[s]):
                            phases[s].append(int(r[s]) - entry)
                    tiles = max(1, -(-lengths[req_of_part[part]] // 64))
                    xs.append(tiles - 1)
                    ys.append(int(r[Stamp.PV_DONE]) - int(r[Stamp.K_READY]))
                    total.append(int(r[Stamp.EPILOGUE]) - entry)
        slope, icpt = fit(xs, ys)
        k_ready = statistics.median(phases[Stamp.K_READY])
        epi = statistics.median(e_ - p for e_, p in zip(phases[Stamp.EPILOGUE], phases[Stamp.PV_DONE]))
        print(f"\n{label}: {plan.schedule}/{plan.variant}, {len(xs) // args.replays} CTAs, "
              f"tiles per request {min(xs) + 1}-{max(xs) + 1} (mean {sum(xs) / len(xs) + 1:.1f})")
        for s in PHASES:
            if phases[s]:
                m = statistics.median(phases[s])
                print(f"  {s.name:<14} {m:8.0f} cyc {m / GHZ / 1e3:6.2f} us")
        print(f"  per tile (K_READY -> PV_DONE over tiles - 1): {slope:7.0f} cyc ({slope / GHZ / 1e3:.2f} us), "
              f"+ {icpt:.0f} cyc for the first tile")
        print(f"  before the first tile: {k_ready:.0f} cyc ({k_ready / GHZ / 1e3:.2f} us); last PV -> epilogue done: "
              f"{epi:.0f} cyc ({epi / GHZ / 1e3:.2f} us); whole CTA median {statistics.median(total) / GHZ / 1e3:.2f} us, "
              f"max {max(total) / GHZ / 1e3:.2f} us", flush=True)


if __name__ == "__main__":
    main()
