"""Is a long row clock- or power-limited? SM clock, power and temperature while each library runs one
shape back to back for a few seconds (nvidia-smi sampled every 100 ms), with the time per call.

    python benchmarks/clock_probe.py [--row 1,32768,64] [--seconds 4] [--variants default,no_pf]

``--variants`` (sm90_variants.py's names) runs each cute-mla Tuning variant in turn, FlashMLA after
each round: at the power cap a variant that spends less energy per call runs at a higher clock.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import cute_mla  # noqa: E402
from bench_sparse_decode import call, flashmla, make_inputs, parse_row  # noqa: E402
from sm90_variants import use_variant  # noqa: E402


def run_for(mod, q, cache, idx, seconds):
    sched, _ = mod.get_mla_metadata()
    call(mod, sched, q, cache, idx)
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    n, t0 = 0, time.time()
    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    while time.time() - t0 < seconds:
        for _ in range(5):
            call(mod, sched, q, cache, idx)
        n += 5
        torch.cuda.synchronize()
    e.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [[float(v) for v in line.split(",")] for line in smi.stdout.read().splitlines() if line.strip()]
    rows = rows[len(rows) // 4:]   # the ramp-up quarter left out
    clk, pwr, tmp = (statistics.mean(r[i] for r in rows) for i in range(3))
    return a.elapsed_time(e) * 1e3 / n, clk, pwr, tmp, min(r[0] for r in rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="1,32768,64")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--variants", default="default", help="cute-mla Tuning variants (sm90_variants.py names)")
    args = ap.parse_args()
    b, s_q, h = parse_row(args.row)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
    variants = args.variants.split(",")
    fm = flashmla()
    mods = [(f"cute:{v}" if v != "default" else "cute-mla", cute_mla, v) for v in variants]
    mods += [("FlashMLA", fm, None)] if fm else []
    print(f"{torch.cuda.get_device_name()}  row b={b} s_q={s_q} h={h}")
    print(f"{'library':18} {'us/call':>10} {'SM MHz':>8} {'min MHz':>8} {'W':>6} {'C':>4}")
    for _ in range(2):   # twice, alternating, so neither library always runs on a hotter card
        for name, mod, variant in mods:
            with use_variant(variant) if variant else contextlib.nullcontext():
                us, clk, pwr, tmp, cmin = run_for(mod, q, cache, idx, args.seconds)
            print(f"{name:18} {us:10.1f} {clk:8.0f} {cmin:8.0f} {pwr:6.0f} {tmp:4.0f}", flush=True)


if __name__ == "__main__":
    main()
