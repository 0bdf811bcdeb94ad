"""Where a call's time goes.

Default: per-kernel device time (torch.profiler / CUPTI) of cute-mla and FlashMLA under CUDA-graph
replay, on the latency rows, and the replay time of cute-mla's whole call against its decode kernel
alone (``Launcher.main``: the combine's share of the critical path).

``--ncu``: one public-API call of a row (warm-up outside), bracketed by cudaProfilerStart/Stop, for
Nsight Compute::

    ncu --clock-control none --profile-from-start off --set full --import-source no \\
        -o OUT/rep python3 -m benchmarks.profile_call --ncu --row 1,1024,128 [--variant no_pf]
    ncu --import OUT/rep.ncu-rep --page details --csv        # per-kernel metrics
    ncu --import OUT/rep.ncu-rep --page source --csv --print-source sass   # per-SASS stall samples

``--host``: the eager call's host time, per call over N back-to-back calls (the GPU work of a small
call is shorter than its host work, so the calls do not queue), split into its parts.

    python -m benchmarks.profile_call [--rows "1,1,64;1,8,64"] | --ncu --row B,S,H | --host --row B,S,H [--calls 400]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

import cute_mla
from cute_mla.interface.launcher import allocate_workspace

from benchmarks.bench_sparse_decode import call, capture_graph, flashmla, make_inputs, parse_row, parse_rows
from benchmarks.variants import VARIANTS

ROWS = [(1, 1, 64), (1, 8, 64), (1, 1, 128), (1, 8, 128), (128, 1, 64)]


def filled(mod, q, cache, idx, tuning=None):
    """A metadata object filled by one call (plan, schedule, compiled kernels)."""
    sched = cute_mla.FlashMLASchedMeta(tuning=tuning) if mod is cute_mla else mod.get_mla_metadata()[0]
    call(mod, sched, q, cache, idx)
    torch.cuda.synchronize()
    return sched


def graph_of(mod, q, cache, idx, layers=1):
    """A CUDA graph of ``layers`` back-to-back calls (an engine's graph holds every layer)."""
    sched = filled(mod, q, cache, idx)
    return capture_graph(lambda: call(mod, sched, q, cache, idx), layers)[0]


def decode_only_graph(q, cache, idx):
    """A graph of cute-mla's decode kernel alone (the launcher's main step, no combine)."""
    sched = filled(cute_mla, q, cache, idx)
    launcher = sched.launcher(False)
    b, s_q, h, _ = q.shape
    out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    kv = cache.view(torch.uint8).squeeze(2)
    return capture_graph(lambda: launcher.main(q, kv, idx, None, None, sched.tile_scheduler_metadata,
                                               sched.accum_offsets, out, lse, 576 ** -0.5))[0]


def kernel_times(g, reps=20):
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    acc = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time > 0:
            acc[e.name[:48]].append(e.device_time)
    return {k: (sum(v) / reps, len(v) // reps) for k, v in acc.items()}


def replay_us(g, reps=50):
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, e in ev:
        a.record()
        g.replay()
        e.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(e) * 1e3 for a, e in ev)[reps // 2]


def per_kernel(rows):
    fm = flashmla()
    g = torch.Generator(device="cuda").manual_seed(0)
    for (b, s_q, h) in rows:
        q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
        for name, mod in (("cute-mla", cute_mla), ("FlashMLA", fm)):
            if mod is None:
                continue
            t = kernel_times(graph_of(mod, q, cache, idx))
            total = sum(v[0] for v in t.values())
            parts = ", ".join(f"{k} {v[0]:.1f} us x{v[1]}" for k, v in sorted(t.items(), key=lambda kv: -kv[1][0]))
            print(f"b={b} s_q={s_q} h={h} {name:8s}: kernels {total:.1f} us = {parts}", flush=True)
        whole, alone = replay_us(graph_of(cute_mla, q, cache, idx)), replay_us(decode_only_graph(q, cache, idx))
        print(f"b={b} s_q={s_q} h={h} cute-mla replay: whole call {whole:.1f} us, decode kernel alone {alone:.1f} us",
              flush=True)


def ncu_one_call(args):
    b, s_q, h = parse_row(args.row)
    q, cache, idx = make_inputs(b, s_q, h, args.masked, torch.Generator(device="cuda").manual_seed(0), topk=args.topk)
    sched = filled(cute_mla, q, cache, idx, VARIANTS[args.variant])
    for _ in range(2):
        call(cute_mla, sched, q, cache, idx)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call(cute_mla, sched, q, cache, idx)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one call of b={b} s_q={s_q} h={h} top-k {args.topk} masked {args.masked} variant {args.variant}")


def host_parts(args):
    """Per-call host µs of the public call and of its parts (keep --calls x 2 launches below the
    launch queue's depth, ~1000, or the host waits for the GPU)."""
    b, s_q, h = parse_row(args.row)
    q, cache, idx = make_inputs(b, s_q, h, 0.2, torch.Generator(device="cuda").manual_seed(0))
    sched = filled(cute_mla, q, cache, idx)
    launcher = sched.launcher(False)
    kv = cache.view(torch.uint8).squeeze(2)
    out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    ws = launcher.main(q, kv, idx, None, None, sched.tile_scheduler_metadata, sched.accum_offsets, out, lse, 0.05)
    parts = {
        "public call": lambda: call(cute_mla, sched, q, cache, idx),
        "launcher (main + combine)": lambda: launcher(q, kv, idx, None, None, sched.tile_scheduler_metadata,
                                                      sched.accum_offsets, out, lse, 0.05),
        "workspace allocation": lambda: allocate_workspace(launcher.plan, q.device),
        "main kernel launch": lambda: launcher.main(q, kv, idx, None, None, sched.tile_scheduler_metadata,
                                                    sched.accum_offsets, out, lse, 0.05),
        "combine launch": lambda: launcher.combine(ws, sched.accum_offsets, None, out, lse),
    }
    print(f"{torch.cuda.get_device_name()} b={b} s_q={s_q} h={h} ({launcher.plan.variant}): host µs per call")
    for name, fn in parts.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        dt = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
        print(f"  {name:28s} {dt:7.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=None, help="b,s_q,h;... (default: the latency rows)")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--row", default="1,1024,128", help="--ncu / --host: b,s_q,h")
    ap.add_argument("--masked", type=float, default=0.2)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--variant", default="default", help="--ncu: a benchmarks.variants name")
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    if args.ncu:
        return ncu_one_call(args)
    if args.host:
        return host_parts(args)
    return per_kernel(parse_rows(args.rows) if args.rows else ROWS)


if __name__ == "__main__":
    main()
