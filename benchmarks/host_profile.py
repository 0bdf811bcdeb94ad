"""Where the eager launch path's host time goes (no CUDA graph): per-call host time of the public
API and of its parts, measured by timing N back-to-back calls on the host clock (the GPU work
of one call is shorter than its host work on the small rows, so the calls do not queue up), then a
cProfile of the same loop.

    python benchmarks/host_profile.py [--row 1,1,64] [--calls 400]

Keep --calls x 2 launches below the launch queue's depth (~1000), or the host waits for the GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import cute_mla  # noqa: E402
from cute_mla.interface import api  # noqa: E402
from bench_sparse_decode import call, flashmla, make_inputs, parse_row  # noqa: E402


def host_us(fn, n):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="1,1,64")
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    b, s_q, h = parse_row(args.row)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
    sched, _ = cute_mla.get_mla_metadata()
    call(cute_mla, sched, q, cache, idx)
    torch.cuda.synchronize()
    launcher = sched._launchers[False]
    kv = cache.view(torch.uint8).squeeze(2)
    out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device="cuda")
    scale = 576 ** -0.5
    parts = {
        "public call (eager)": lambda: call(cute_mla, sched, q, cache, idx),
        "_validate": lambda: api._validate(q, cache, 512, sched, None, scale, False, True, idx, None, None, None, None,
                                           None, None),
        "out + lse allocation": lambda: (torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device="cuda"),
                                         torch.empty(b, s_q, h, dtype=torch.float32, device="cuda")),
        "launcher (workspace + launches)": lambda: launcher(q, kv, idx, None, None, sched.tile_scheduler_metadata,
                                                            sched.accum_offsets, out, lse, scale),
        "torch.empty_like(out) alone": lambda: torch.empty_like(out),
    }
    from cute_mla.interface import dispatch
    oa, la = dispatch.allocate_workspace(launcher.plan, q.device)
    parts["workspace allocation"] = lambda: dispatch.allocate_workspace(launcher.plan, q.device)
    parts["main kernel launch alone"] = lambda: launcher.main_mod.launch_sparse_decode(
        launcher.main_compiled, launcher.main_cfg, q, kv, idx, None, None, sched.tile_scheduler_metadata,
        sched.accum_offsets, out, lse, oa, la, scale)
    if oa is not None:
        parts["combine launch alone"] = lambda: launcher.combine_mod.launch_combine(
            launcher.combine_compiled, launcher.combine_cfg, la, oa, sched.accum_offsets, None, out, lse,
            layout_checked=True)
    fm = flashmla()
    if fm is not None:
        fs, _ = fm.get_mla_metadata()
        call(fm, fs, q, cache, idx)
        parts["FlashMLA public call (eager)"] = lambda: call(fm, fs, q, cache, idx)
    print(f"{torch.cuda.get_device_name()}  row b={b} s_q={s_q} h={h}  host µs per call ({args.calls} calls)")
    for name, fn in parts.items():
        print(f"  {name:34} {host_us(fn, args.calls):7.1f}", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call(cute_mla, sched, q, cache, idx)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    print(s.getvalue())


if __name__ == "__main__":
    main()
