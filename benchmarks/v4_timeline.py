"""Probe (V4 rows, SM90): where a request's cycles go when each CTA holds one request.

The decode kernel is compiled with ``Sm90Tuning(timeline=True)`` (``clock64`` stamps per phase,
``benchmarks/timeline.py``) and launched as the launcher would on a V4 row of ``bench_v4``
(top-k 128 and an extra list, lengths uniform, sinks), with the plan forced to one partition per
request (``bench_v4.plan_constants``), so that every CTA's stamps belong to one request whose tile
count is known: ``max(1, ceil((topk_length + extra_topk_length) / 64))`` (every index valid).
Per row it prints the phases' medians over the CTAs, then a least-squares line through
(tiles - 1, cycles from the first tile ready to the last PV done): the per-tile cost and what a
request pays before its first tile and after its last. ``--v32`` adds V3.2 rows for comparison:
one list of ``topk`` positions with ``topk_length`` uniform in [1, topk], sinks on, the same forced plan.

``--spans``: the rows under the plan the call would take (split, packed, ...), where a CTA holds
several requests or pieces: per CTA its span (kernel entry to its last store issued), its
scheduler blocks (``blocks_of_length`` then ``extra_blocks_of_length`` per request: the unit the
scheduler's charge is counted in; the kernel's compacted tiles may be fewer) and its pieces; a
least-squares fit span = a + b x blocks + c x pieces; the spread of the spans; the same on the
global timer (``Stamp.NS_SLOTS``: the spread of the CTAs' entries, the longest CTA, first entry to
last exit, which no per-SM clock rate skews); and the decode kernel's own graph-replay time,
against which they show what the launch, the tail and the imbalance cost.

    python -m benchmarks.v4_timeline [--rows "b,h,extra;..."] [--v32 "b,h,topk;..."] [--replays 5]
    python -m benchmarks.v4_timeline --spans [--rows "b,h,extra;..."] [--variants default,stage_in_k]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks import bench_sparse_decode as v32b
from benchmarks import bench_v4 as v4b
from benchmarks.timeline import GHZ, print_phases, stamped_graph, stamped_kernel, working_rows
from benchmarks.variants import variant_of
from cute_mla.archs import SM90, device_arch, device_num_sms
from cute_mla.formats import V4, V32
from cute_mla.kernels.sm90.config import Stamp
from cute_mla.plan import plan as plan_mod
from cute_mla.plan.schedule import make_schedule
from cute_mla.playground import bench
from cute_mla.scheduler import SchedField
from cute_mla.scheduler.partition import blocks_of_length, extra_blocks_of_length

ROWS = "128,64,512;128,64,1024;128,128,512;128,128,1024;512,64,1024"
PHASES = [Stamp.PROLOGUE, Stamp.METADATA, Stamp.SCAN, Stamp.Q_READY, Stamp.K_READY, Stamp.PV_DONE, Stamp.EPI_FINAL,
          Stamp.EPI_STAGED, Stamp.EPILOGUE, Stamp.WG1_EPILOGUE]


def v32_row(b, h, topk, g):
    """A V3.2 row shaped like ``bench_v4.make_row`` (one list, lengths uniform in [1, topk], sinks)
    and its cache."""
    q, cache, _ = bench.v32_inputs(b, 1, h, 0.0, g, topk=64)
    indices, topk_length = bench.index_list(b, 1, topk, 0.0, g)
    row = dict(q=q, indices=indices, topk_length=topk_length, extra_indices=None, extra_topk_length=None,
               attn_sink=torch.randn(h, device="cuda", generator=g))
    return row, (cache, None)


def row_plan(fmt, b, h, topk, extra):
    """The plan of a row's call (s_q = 1, lengths given) on this GPU."""
    return plan_mod.plan_sparse_decode(b, 1, h, fmt.d_qk, topk, arch=SM90.name,
                                       num_sms=device_num_sms(torch.device("cuda")), has_topk_length=True,
                                       extra_topk=extra, has_extra_topk_length=extra > 0)


def per_request_plan(fmt, b, h, topk, extra):
    """The row's plan with one partition per request (the wave window and the list-length limit
    opened, whole-request packing shut for this call)."""
    with v4b.plan_constants(**v4b.PER_REQUEST_OPEN, **v4b.NO_PACKING):
        plan = row_plan(fmt, b, h, topk, extra)
    if plan.schedule != "per_request":
        raise SystemExit(f"b={b} h={h}: the plan could not be forced to one partition per request ({plan.schedule})")
    return plan


def row_kernel(plan, row, pools, tuning=None):
    """(launch, stamps, schedule) of the row's decode kernel (``tuning``: a kernel variant) with the
    timeline, on the schedule its plan makes (``pools``: the main and extra caches)."""
    schedule = make_schedule(plan, row["q"].device, row["topk_length"], row["extra_topk_length"])
    extra = (pools[1], row["extra_indices"], row["extra_topk_length"]) if plan.extra_topk else (None,) * 3
    launch, stamps = stamped_kernel(plan, schedule, row["q"], pools[0], row["indices"], tuning=tuning,
                                    topk_length=row["topk_length"], attn_sink=row["attn_sink"], extra=extra)
    return launch, stamps, schedule


def request_blocks(row, plan):
    """Each request's scheduler blocks (its main list's, at least one, then its extra list's)."""
    main = [blocks_of_length(int(v), plan.topk)[1] for v in row["topk_length"].tolist()]
    if row["extra_topk_length"] is None:
        return main
    return [m + extra_blocks_of_length(int(v), plan.extra_topk)[1]
            for m, v in zip(main, row["extra_topk_length"].tolist())]


def partition_work(tile_md, blocks, order=None):
    """(tiles, pieces) of each partition row: the blocks it walks and the requests it touches
    (``order``: the schedule's request order, whose positions the rows index, where it has one)."""
    if order is not None:
        blocks = [blocks[r] for r in order.cpu().tolist()]
    work = []
    for r in tile_md.cpu().tolist():
        br, er, bb, eb = (r[int(f)] for f in (SchedField.BEGIN_REQ, SchedField.END_REQ, SchedField.BEGIN_BLOCK,
                                              SchedField.END_BLOCK))
        tiles = sum((eb if q == er else blocks[q]) - (bb if q == br else 0) for q in range(br, er + 1))
        work.append((tiles, max(er - br + 1, 0)))
    return work


def fit2(xs, zs, ys):
    """Least-squares (a, b, c) of y = a + b x + c z."""
    n = len(ys)
    mx, mz, my = sum(xs) / n, sum(zs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    szz = sum((z - mz) ** 2 for z in zs)
    sxz = sum((x - mx) * (z - mz) for x, z in zip(xs, zs))
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    szy = sum((z - mz) * (y - my) for z, y in zip(zs, ys))
    det = sxx * szz - sxz * sxz
    if not det:
        return my, 0.0, 0.0
    b, c = (sxy * szz - szy * sxz) / det, (szy * sxx - sxy * sxz) / det
    return my - b * mx - c * mz, b, c


def spans(rows, replays, pools, g, variants=("default",)):
    """``--spans``: each row under the plan its call would take (module docstring), once per kernel
    variant (``benchmarks.variants.VARIANTS`` names) on the same inputs."""
    for b, h, extra in rows:
        row = v4b.make_row(b, h, extra, 0.0, g)
        plan = row_plan(V4, b, h, v4b.TOPK, extra)
        for name in variants:
            tuning, _ = variant_of(name)
            launch, stamps, schedule = row_kernel(plan, row, pools, tuning)
            work = partition_work(schedule.tile_md, request_blocks(row, plan), schedule.request_order)
            tiles, pieces, span, ns = [], [], [], []
            graph = stamped_graph(launch)
            for part, r in working_rows(graph, stamps, replays):
                tiles.append(work[part][0])
                pieces.append(work[part][1])
                span.append((int(r[Stamp.EPILOGUE]) - int(r[Stamp.ENTRY])) / GHZ / 1e3)
                ns.append((int(r[Stamp.ENTRY_NS]), int(r[Stamp.EXIT_NS])))
            a, per_tile, per_piece = fit2(tiles, pieces, span)
            kernel_us = v32b.replay_median_us(graph, 50)
            q = statistics.quantiles(span, n=10)
            print(f"\nV4 b={b} h={h} extra={extra} [{name}]: {plan.schedule}/{plan.variant}, {len(span) // replays} CTAs, "
                  f"tiles per CTA {min(tiles)}-{max(tiles)} (mean {sum(tiles) / len(tiles):.1f}), "
                  f"pieces {min(pieces)}-{max(pieces)} (mean {sum(pieces) / len(pieces):.2f})")
            print(f"  CTA span us: median {statistics.median(span):.2f}, p10 {q[0]:.2f}, p90 {q[-1]:.2f}, "
                  f"max {max(span):.2f}; decode kernel alone (graph replay) {kernel_us:.2f} us")
            print(f"  fit: span = {a:.2f} + {per_tile:.3f} x tiles + {per_piece:.3f} x pieces (us)", flush=True)
            print("  " + global_clock(ns, replays), flush=True)


def global_clock(ns, replays):
    """The CTAs' (entry, exit) ``%globaltimer`` stamps (``Stamp.NS_SLOTS``), replay after replay,
    as one line: medians over the replays of the spread of the CTAs' entries, of the longest CTA
    (entry to exit) and of the kernel's span (first entry to last exit), in µs on one clock."""
    per = len(ns) // replays
    entry, longest, kernel = [], [], []
    for k in range(replays):
        rows = ns[k * per:(k + 1) * per]
        first = min(e for e, _ in rows)
        entry.append((max(e for e, _ in rows) - first) / 1e3)
        longest.append(max(x - e for e, x in rows) / 1e3)
        kernel.append((max(x for _, x in rows) - first) / 1e3)
    med = statistics.median
    return (f"global timer: entries spread over {med(entry):.2f} us, longest CTA {med(longest):.2f} us, "
            f"first entry to last exit {med(kernel):.2f} us")


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
    ap.add_argument("--spans", action="store_true", help="the rows under their own plans (module docstring)")
    ap.add_argument("--variants", default="default",
                    help="--spans: kernel variants (benchmarks.variants names) fitted on the same inputs")
    args = ap.parse_args()
    arch = device_arch(torch.device("cuda"))
    if arch != SM90.name:
        raise SystemExit(f"the timeline is the SM90 kernel's: this GPU runs {arch}")
    g, pools = v4b.probe_inputs()
    if args.spans:
        return spans(v4b.parse_rows(args.rows), args.replays, pools, g, [n for n in args.variants.split(",") if n])
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
        launch, stamps, schedule = row_kernel(plan, row, row_pools)
        req_of_part = schedule.tile_md[:, int(SchedField.BEGIN_REQ)].cpu().tolist()
        lengths = row["topk_length"] if row["extra_topk_length"] is None else row["topk_length"] + row["extra_topk_length"]
        lengths = lengths.cpu().tolist()
        phases = {s: [] for s in PHASES}
        xs, ys, total, epi = [], [], [], []
        for part, r in working_rows(stamped_graph(launch), stamps, args.replays):
            entry = int(r[Stamp.ENTRY])
            for s in PHASES:
                if int(r[s]):
                    phases[s].append(int(r[s]) - entry)
            tiles = max(1, -(-lengths[req_of_part[part]] // 64))
            xs.append(tiles - 1)
            ys.append(int(r[Stamp.PV_DONE]) - int(r[Stamp.K_READY]))
            total.append(int(r[Stamp.EPILOGUE]) - entry)
            epi.append(int(r[Stamp.EPILOGUE]) - int(r[Stamp.PV_DONE]))
        slope, icpt = fit(xs, ys)
        k_ready = statistics.median(phases[Stamp.K_READY])
        epi = statistics.median(epi)
        print(f"\n{label}: {plan.schedule}/{plan.variant}, {len(xs) // args.replays} CTAs, "
              f"tiles per request {min(xs) + 1}-{max(xs) + 1} (mean {sum(xs) / len(xs) + 1:.1f})")
        print_phases(PHASES, phases)
        print(f"  per tile (K_READY -> PV_DONE over tiles - 1): {slope:7.0f} cyc ({slope / GHZ / 1e3:.2f} us), "
              f"+ {icpt:.0f} cyc for the first tile")
        print(f"  before the first tile: {k_ready:.0f} cyc ({k_ready / GHZ / 1e3:.2f} us); last PV -> epilogue done: "
              f"{epi:.0f} cyc ({epi / GHZ / 1e3:.2f} us); whole CTA median {statistics.median(total) / GHZ / 1e3:.2f} us, "
              f"max {max(total) / GHZ / 1e3:.2f} us", flush=True)


if __name__ == "__main__":
    main()
