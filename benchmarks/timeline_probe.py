"""Where a latency-row decode CTA spends its time: the phase timeline of ``Tuning.timeline``.

The SM90 kernel compiled with ``Tuning(timeline=True)`` writes ``clock64`` stamps of its phases
(``Stamp`` in ``sparse_decode_common.py``) into a per-CTA row; this script runs b=1, s_q=1 calls
through the public API under CUDA graph replay (the dispatcher's kernel launch is wrapped to pass
the stamp buffer), and prints, for the CTAs that had work, each phase's cycles since kernel entry
(median over CTAs and replays; max over CTAs in brackets).

    python benchmarks/timeline_probe.py [--heads 64] [--replays 10] [--variant cpair] [--s-q 8 --topk 2048]

``--s-q``: query tokens of the one request (default 1); ``--topk``: only the cases of that top-k.
Stamps of phases a CTA passes once per tile hold the last tile's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import cute_mla  # noqa: E402
from cute_mla.kernels.sm90 import sparse_decode as sd  # noqa: E402
from cute_mla.kernels.sm90.sparse_decode_common import Stamp  # noqa: E402
from bench_sparse_decode import call, capture_graph, make_inputs  # noqa: E402
from sm90_variants import VARIANTS, use_tuning  # noqa: E402

CASES = [(64, 1.0), (64, 0.0), (2048, 1.0), (2048, 0.2)]   # (top-k, masked fraction)
ORDER = [Stamp.PROLOGUE, Stamp.METADATA, Stamp.SCAN, Stamp.K_FREE, Stamp.HALF_A, Stamp.HANDED_OVER, Stamp.Q_READY,
         Stamp.K_READY, Stamp.QK_DONE, Stamp.P_READY, Stamp.WG1_P, Stamp.WG1_PV_DONE, Stamp.PV_DONE,
         Stamp.EPI_FINAL, Stamp.EPI_STAGED, Stamp.EPILOGUE, Stamp.WG1_EPI_STAGED, Stamp.WG1_EPILOGUE]


class with_timeline:
    """Wrap the dispatcher's kernel launch so that it passes a stamp buffer (one per grid shape)."""

    def __init__(self):
        self.buffers = {}
        self.last = None

    def __enter__(self):
        self.orig = sd.launch_sparse_decode

        def launch(compiled, cfg, q, kv, indices, topk_length, attn_sink, tile_md, num_splits, out, lse, o_accum,
                   lse_accum, softmax_scale, timeline=None):
            gx = q.shape[1] * (cfg.h_q // 64) * 2   # room for Tuning.column_pair's doubled grid
            key = (gx, tile_md.shape[0])
            if key not in self.buffers:
                self.buffers[key] = torch.zeros(gx, tile_md.shape[0], int(Stamp.SLOTS), dtype=torch.int64, device=q.device)
            self.last = self.buffers[key]
            self.orig(compiled, cfg, q, kv, indices, topk_length, attn_sink, tile_md, num_splits, out, lse, o_accum,
                      lse_accum, softmax_scale, timeline=self.last)

        sd.launch_sparse_decode = launch
        return self

    def __exit__(self, *exc):
        sd.launch_sparse_decode = self.orig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="64")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--variant", default="default", help="a name of sm90_variants.VARIANTS, timeline added")
    ap.add_argument("--s-q", type=int, default=1)
    ap.add_argument("--topk", type=int, default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: cycles since kernel entry, median over working CTAs and "
          f"{args.replays} graph replays [max over CTAs]; us at 1.98 GHz")
    for h in (int(v) for v in args.heads.split(",")):
        for topk, masked in CASES:
            if args.topk is not None and topk != args.topk:
                continue
            q, cache, idx = make_inputs(1, args.s_q, h, masked, g, topk=topk)
            with use_tuning(dataclasses.replace(VARIANTS[args.variant], timeline=True)), with_timeline() as tl:
                sched, _ = cute_mla.get_mla_metadata()
                for _ in range(3):
                    call(cute_mla, sched, q, cache, idx)
                torch.cuda.synchronize()
                graph, _ = capture_graph(lambda: call(cute_mla, sched, q, cache, idx))
                rows = {s: [] for s in ORDER}
                worst = {s: 0 for s in ORDER}
                for _ in range(args.replays):
                    tl.last.zero_()
                    graph.replay()
                    torch.cuda.synchronize()
                    st = tl.last.reshape(-1, int(Stamp.SLOTS)).cpu()
                    for r in st:
                        if int(r[Stamp.METADATA]) == 0:
                            continue   # a CTA without work
                        for s in ORDER:
                            if int(r[s]) != 0:
                                d = int(r[s]) - int(r[Stamp.ENTRY])
                                rows[s].append(d)
                                worst[s] = max(worst[s], d)
            ctas = len(rows[Stamp.METADATA]) // args.replays
            print(f"\ns_q={args.s_q} h={h} top-k {topk} masked {masked}: {sched.plan.variant}, {ctas} CTAs with work")
            for s in ORDER:
                if rows[s]:
                    m = statistics.median(rows[s])
                    print(f"  {s.name:<14} {m:8.0f} cyc {m / 1980:6.2f} us   [{worst[s]:8d}]")


if __name__ == "__main__":
    main()
