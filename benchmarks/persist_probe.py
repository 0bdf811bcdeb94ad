"""Probe: does walking several query tokens per CTA beat one CTA per query token on the long rows?

vLLM's mixed batch is b=1 with s_q = tokens: one partition, so the grid is one CTA per (token,
head half) and every CTA pays its own start (launch, barrier init, Q load, first index scan and
row gather with nothing to overlap) and end (O store, exit) for ~26 tiles of work. The same call
can be written as b' = s_q requests of one token each (views of q, indices, out, lse), and a
schedule that gives each CTA a contiguous range of whole requests (no split, no combine, no
workspace): then a CTA walks ~s_q / CTAs tokens, and the kernel's existing request walk overlaps
one token's end with the next token's rows.

Prints, per row, graph replays of: FlashMLA's grid launched directly (A), the public call (the
plan's token walk since it adopted this), the probe's own walks over a few CTA counts; their
speedups over A and whether their out/lse are bit-identical to A's (same tiles, same order).
First run (before the plan adopted the walk, 246f663): results/h200-246f663-persist-probe.log.

    python benchmarks/persist_probe.py [--rows "1,8192,64;1,8192,128"]
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
from cute_mla.kernels.sm90.sparse_decode import (  # noqa: E402
    DEFAULT_TUNING, Sm90SparseDecodeConfig, compile_sparse_decode, launch_sparse_decode)
from bench_sparse_decode import TOPK, call, capture_graph, make_inputs, parse_rows  # noqa: E402
from profile_small import replay_us  # noqa: E402


def whole_request_rows(n_req: int, parts: int, blocks: int):
    """Partition p takes requests [p*n/P, (p+1)*n/P) whole (FlashMLA's 8-int row format)."""
    rows = []
    for p in range(parts):
        r0, r1 = p * n_req // parts, (p + 1) * n_req // parts
        if r1 > r0:
            rows.append([r0, r1 - 1, 0, blocks, 0, 0, 0, 0])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,1024,64;1,8192,64;1,32768,64;1,1024,128;1,8192,128")
    ap.add_argument("--ctas", default="132,264", help="CTAs of the probe's own walks (partitions x head halves)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  tuning {DEFAULT_TUNING}")
    for (b, s_q, h) in parse_rows(args.rows):
        assert b == 1
        q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
        cfg = Sm90SparseDecodeConfig(h_q=h, split=False, has_topk_length=False, has_attn_sink=False)
        compiled = compile_sparse_decode(cfg, tuning=DEFAULT_TUNING)
        kv = cache.view(torch.uint8).squeeze(2)

        def launcher(qv, iv, out, lse, tile_md):
            offsets = torch.zeros(qv.shape[0] + 1, dtype=torch.int32, device="cuda")
            return lambda: launch_sparse_decode(compiled, cfg, qv, kv, iv, None, None, tile_md, offsets, out, lse,
                                                None, None, 576 ** -0.5)

        # A: FlashMLA's grid, one CTA per (token, head half): one partition row, launched directly
        out_a = torch.full((1, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse_a = torch.full((1, s_q, h), float("nan"), dtype=torch.float32, device="cuda")
        one = torch.tensor([[0, 0, 0, TOPK // 64, 0, 0, 0, 0]], dtype=torch.int32, device="cuda")
        run_a = launcher(q, idx, out_a, lse_a, one)
        run_a()
        t_a = replay_us(capture_graph(run_a)[0], reps=20)
        line = f"b={b} s_q={s_q} h={h}: one CTA per token {t_a:9.1f} us"
        # the public call (the plan's token walk where it applies)
        sched, _ = cute_mla.get_mla_metadata()
        o, l = call(cute_mla, sched, q, cache, idx)
        same = torch.equal(o, out_a) and torch.equal(l, lse_a.transpose(1, 2))
        t_p = replay_us(capture_graph(lambda: call(cute_mla, sched, q, cache, idx))[0], reps=20)
        line += (f" | public call ({'token walk' if sched.plan.token_walk else 'no walk'}) {t_p:9.1f} us "
                 f"x{t_a / t_p:.3f} {'bit-identical' if same else 'DIFFERENT'}")
        # the probe's own walks over other CTA counts
        qv, iv = q.view(s_q, 1, h, 576), idx.view(s_q, 1, TOPK)
        out_b = torch.full((s_q, 1, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse_b = torch.full((s_q, 1, h), float("nan"), dtype=torch.float32, device="cuda")
        for ctas in [int(c) for c in args.ctas.split(",") if c]:
            parts = ctas // (h // 64)
            tile_md = torch.tensor(whole_request_rows(s_q, parts, TOPK // 64), dtype=torch.int32, device="cuda")
            walk = launcher(qv, iv, out_b, lse_b, tile_md)
            walk()
            torch.cuda.synchronize()
            same = torch.equal(out_b.view_as(out_a), out_a) and torch.equal(lse_b.view_as(lse_a), lse_a)
            t_b = replay_us(capture_graph(walk)[0], reps=20)
            line += f" | walk {ctas} CTAs {t_b:9.1f} us x{t_a / t_b:.3f} {'bit-identical' if same else 'DIFFERENT'}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
