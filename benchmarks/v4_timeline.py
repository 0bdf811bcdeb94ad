"""Probe (V4 rows, SM90): where a request's cycles go when each CTA holds one request.

The decode kernel is compiled with ``Sm90Tuning(timeline=True)`` (``clock64`` stamps per phase,
``benchmarks/timeline.py``) and launched as the launcher would on a V4 row of ``bench_v4``
(top-k 128 and an extra list, lengths uniform, sinks), with the plan forced to one partition per
request (``plan.PER_REQUEST_WAVES`` and ``PER_REQUEST_MAX_BLOCKS`` opened), so that every CTA's stamps belong to one request whose tile
count is known: ``max(1, ceil((topk_length + extra_topk_length) / 64))`` (every index valid).
Per row it prints the phases' medians over the CTAs, then a least-squares line through
(tiles - 1, cycles from the first tile ready to the last PV done): the per-tile cost and what a
request pays before its first tile and after its last.

    python -m benchmarks.v4_timeline [--rows "b,h,extra;..."] [--replays 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from benchmarks import bench_sparse_decode as v32b
from benchmarks import bench_v4 as v4b
from cute_mla.archs import SM90, device_arch, device_num_sms
from cute_mla.formats import V4
from cute_mla.interface.launcher import allocate_workspace, cache_bytes, kernel_module
from cute_mla.kernels import DecodeTensors
from cute_mla.kernels.sm90 import DEFAULT_TUNING
from cute_mla.kernels.sm90.config import Stamp
from cute_mla.plan import plan as plan_mod
from cute_mla.plan.schedule import make_schedule
from cute_mla.scheduler import SchedField

ROWS = "128,64,512;128,64,1024;128,128,512;128,128,1024;512,64,1024"
PHASES = [Stamp.PROLOGUE, Stamp.METADATA, Stamp.SCAN, Stamp.Q_READY, Stamp.K_READY, Stamp.PV_DONE, Stamp.EPI_FINAL,
          Stamp.EPI_STAGED, Stamp.EPILOGUE, Stamp.WG1_EPILOGUE]
GHZ = 1.98


def per_request_plan(b, h, extra):
    """The row's plan with one partition per request (the wave window opened for this call)."""
    window, most = plan_mod.PER_REQUEST_WAVES, plan_mod.PER_REQUEST_MAX_BLOCKS
    plan_mod.PER_REQUEST_WAVES, plan_mod.PER_REQUEST_MAX_BLOCKS = (0.0, 1e9), 1 << 30
    plan_mod.plan_sparse_decode.cache_clear()
    try:
        return plan_mod.plan_sparse_decode(b, 1, h, V4.d_qk, v4b.TOPK, arch=SM90.name,
                                           num_sms=device_num_sms(torch.device("cuda")), has_topk_length=True,
                                           extra_topk=extra, has_extra_topk_length=True)
    finally:
        plan_mod.PER_REQUEST_WAVES, plan_mod.PER_REQUEST_MAX_BLOCKS = window, most
        plan_mod.plan_sparse_decode.cache_clear()


def stamped(row, pools, plan):
    """(launch, stamps, schedule) of the row's decode kernel with the timeline."""
    dev = row["q"].device
    schedule = make_schedule(plan, dev, row["topk_length"], row["extra_topk_length"])
    mod = kernel_module(plan.arch)
    cfg = mod.kernel_config(h_q=plan.h_q, d_qk=V4.d_qk, split=plan.split, has_topk_length=True, has_attn_sink=True,
                            column_pair=plan.column_pair, tuning=dataclasses.replace(DEFAULT_TUNING, timeline=True),
                            has_extra=True, has_extra_topk_length=True)
    compiled = mod.compile_sparse_decode(cfg)
    o_accum, lse_accum = allocate_workspace(plan, dev)
    b, s_q, h, _ = row["q"].shape
    out = torch.empty(b, s_q, h, V4.d_v, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=dev)
    stamps = torch.zeros(s_q * cfg.n_hblk * cfg.n_cblk, schedule.tile_md.shape[0], int(Stamp.SLOTS), dtype=torch.int64,
                         device=dev)
    t = DecodeTensors(row["q"], cache_bytes(pools[0]), row["indices"], row["topk_length"], row["attn_sink"],
                      schedule.tile_md, schedule.accum_offsets, out, lse, o_accum, lse_accum, cache_bytes(pools[1]),
                      row["extra_indices"], row["extra_topk_length"])

    def launch():
        schedule.ensure_ready()
        mod.launch_sparse_decode(compiled, cfg, t, V4.d_qk ** -0.5, timeline=stamps)

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
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--replays", type=int, default=5)
    args = ap.parse_args()
    arch = device_arch(torch.device("cuda"))
    if arch != SM90.name:
        raise SystemExit(f"the timeline is the SM90 kernel's: this GPU runs {arch}")
    g = torch.Generator(device="cuda").manual_seed(0)
    v32b.warm_up(2.0)
    pools = (v4b.make_pool(g), v4b.make_pool(g))
    print(f"{torch.cuda.get_device_name()}: V4 rows, one request per CTA; cycles since kernel entry, median over the "
          f"CTAs and {args.replays} graph replays; µs at {GHZ} GHz")
    for b, h, e in v4b.parse_rows(args.rows):
        row = v4b.make_row(b, h, e, 0.0, g)
        plan = per_request_plan(b, h, e)
        launch, stamps, schedule = stamped(row, pools, plan)
        for _ in range(3):
            launch()
        torch.cuda.synchronize()
        graph, _ = v32b.capture_graph(launch)
        req_of_part = schedule.tile_md[:, int(SchedField.BEGIN_REQ)].cpu().tolist()
        lengths = (row["topk_length"] + row["extra_topk_length"]).cpu().tolist()
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
        print(f"\nb={b} h={h} extra={e}: {plan.schedule}/{plan.variant}, {len(xs) // args.replays} CTAs, "
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
