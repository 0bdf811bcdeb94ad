"""Probe: does walking several query tokens per CTA beat one CTA per query token on the long rows?

vLLM's mixed batch is b=1 with s_q = tokens: one partition, so the grid is one CTA per (token,
head half) and every CTA pays its own start (launch, barrier init, Q load, first index scan and
row gather with nothing to overlap) and end (O store, exit) for ~26 tiles of work. The same call
can be written as b' = s_q requests of one token each (views of q, indices, out, lse), and a
schedule that gives each CTA a contiguous range of whole requests (no split, no combine, no
workspace): then a CTA walks ~s_q / CTAs tokens, and the kernel's existing request walk overlaps
one token's end with the next token's rows.

Prints, per row: the public call's graph replay (A), the whole-request walk (B) for a few CTA
counts, B / A, and whether B's out/lse are bit-identical to A's (same tiles in the same order).

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
from bench_sparse_decode import TOPK, call, make_inputs, parse_rows  # noqa: E402
from profile_small import replay_us  # noqa: E402


def whole_request_rows(n_req: int, parts: int, blocks: int):
    """Partition p takes requests [p*n/P, (p+1)*n/P) whole (FlashMLA's 8-int row format)."""
    rows = []
    for p in range(parts):
        r0, r1 = p * n_req // parts, (p + 1) * n_req // parts
        if r1 > r0:
            rows.append([r0, r1 - 1, 0, blocks, 0, 0, 0, 0])
    return rows


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,1024,64;1,8192,64;1,32768,64;1,1024,128;1,8192,128")
    ap.add_argument("--ctas", default="132,264", help="CTAs of the walk (partitions x head halves)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  tuning {DEFAULT_TUNING}")
    for (b, s_q, h) in parse_rows(args.rows):
        assert b == 1
        q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
        sched, _ = cute_mla.get_mla_metadata()
        out_a, lse_a = call(cute_mla, sched, q, cache, idx)
        ga = graph_of(lambda: call(cute_mla, sched, q, cache, idx))
        t_a = replay_us(ga, reps=20)
        cfg = Sm90SparseDecodeConfig(h_q=h, split=False, has_topk_length=False, has_attn_sink=False)
        compiled = compile_sparse_decode(cfg, tuning=DEFAULT_TUNING)
        kv = cache.view(torch.uint8).squeeze(2)
        qv, iv = q.view(s_q, 1, h, 576), idx.view(s_q, 1, TOPK)
        out_b = torch.full((s_q, 1, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse_b = torch.full((s_q, 1, h), float("nan"), dtype=torch.float32, device="cuda")
        offsets = torch.zeros(s_q + 1, dtype=torch.int32, device="cuda")
        line = f"b={b} s_q={s_q} h={h}: public call {t_a:9.1f} us"
        for ctas in [int(c) for c in args.ctas.split(",")]:
            parts = ctas // (h // 64)
            tile_md = torch.tensor(whole_request_rows(s_q, parts, TOPK // 64), dtype=torch.int32,
                                   device="cuda")

            def walk():
                launch_sparse_decode(compiled, cfg, qv, kv, iv, None, None, tile_md, offsets, out_b, lse_b,
                                     None, None, 576 ** -0.5)

            walk()
            torch.cuda.synchronize()
            same = torch.equal(out_b.view_as(out_a), out_a) and torch.equal(
                lse_b.view(1, s_q, h).transpose(1, 2), lse_a)
            t_b = replay_us(graph_of(walk), reps=20)
            line += f" | walk {ctas} CTAs {t_b:9.1f} us x{t_a / t_b:.3f} {'bit-identical' if same else 'DIFFERENT'}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
