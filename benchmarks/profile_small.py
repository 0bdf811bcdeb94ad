"""Where the time of a small decode call goes: per-kernel device time (torch profiler / CUPTI) of
cute-mla and FlashMLA under CUDA graph replay, for the latency rows of the performance issue.

    python benchmarks/profile_small.py [--parts]

``--parts``: CUDA-graph replay time (median of events) of cute-mla's whole call, of the call with
the combine launch skipped, and with the decode launch skipped (the combine alone), to see what
the combine adds to the critical path (with PDL it should add less than its own time).
"""

from __future__ import annotations

import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import cute_mla  # noqa: E402
from bench_sparse_decode import call, capture_graph, flashmla, make_inputs  # noqa: E402

ROWS = [(1, 1, 64), (1, 8, 64), (1, 1, 128), (1, 8, 128), (128, 1, 64)]


def graph_of(mod, q, cache, idx, layers=1):
    """A CUDA graph of ``layers`` back-to-back calls (an engine's graph holds every layer)."""
    sched, _ = mod.get_mla_metadata()
    call(mod, sched, q, cache, idx)
    torch.cuda.synchronize()
    return capture_graph(lambda: call(mod, sched, q, cache, idx), layers)[0]


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
        a.record(); g.replay(); e.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(e) * 1e3 for a, e in ev)[reps // 2]


def launch_parts():
    """Replay times of the whole call and of each launch alone (the other one skipped)."""
    import contextlib

    from cute_mla.kernels.sm90 import sparse_decode as sd
    from sm90_variants import skip_combine, skip_launch

    parts = {"whole": contextlib.nullcontext, "decode only": skip_combine,
             "combine only": lambda: skip_launch(sd, "launch_sparse_decode")}
    g = torch.Generator(device="cuda").manual_seed(0)
    for (b, s_q, h) in ROWS[:4]:
        q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
        res = {}
        for name, skipping in parts.items():
            with skipping():
                res[name] = replay_us(graph_of(cute_mla, q, cache, idx))
        print(f"b={b} s_q={s_q} h={h} replay us: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)


def main():
    if "--parts" in sys.argv:
        return launch_parts()
    fm = flashmla()
    g = torch.Generator(device="cuda").manual_seed(0)
    for (b, s_q, h) in ROWS:
        q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
        for name, mod in (("cute-mla", cute_mla), ("FlashMLA", fm)):
            if mod is None:
                continue
            t = kernel_times(graph_of(mod, q, cache, idx))
            total = sum(v[0] for v in t.values())
            parts = ", ".join(f"{k} {v[0]:.1f} us x{v[1]}" for k, v in sorted(t.items(), key=lambda kv: -kv[1][0]))
            print(f"b={b} s_q={s_q} h={h} {name:8s}: kernels {total:.1f} us = {parts}", flush=True)


if __name__ == "__main__":
    main()
