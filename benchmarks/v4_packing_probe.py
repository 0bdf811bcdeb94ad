"""Probe (V4 rows, SM90): whole requests packed into the GPU's partitions, against the plan.

The schedule probed: ``--parts`` partitions (default: one wave, num_sms / (h_q / 64)) of
*contiguous whole* requests, cut where the running cost (blocks + ``--overhead`` per request)
crosses each partition's share, so nothing is split (no partials, no combine) while a CTA's
later requests overlap their index scan and gathers with the one before (the producer runs
ahead into the next request; one request per CTA pays ~6 µs before its first tile, see
``v4_timeline``). The rows are cut on the host from the lengths (a probe: the production schedule
would cut them on the device), then the no-split decode kernel runs them; its output is compared
with the default call's, and both are timed as one-call graph replays, interleaved.

    python -m benchmarks.v4_packing_probe [--rows "b,h,extra;..."] [--overhead 1] [--parts 0]
"""

from __future__ import annotations

import torch

import cute_mla
from benchmarks import bench_sparse_decode as v32b
from benchmarks import bench_v4 as v4b
from cute_mla.archs import SM90, device_num_sms
from cute_mla.formats import V4
from cute_mla.interface.launcher import cache_bytes, kernel_module
from cute_mla.kernels import DecodeTensors
from cute_mla.plan.schedule import device_num_blocks
from cute_mla.playground import bench

ROWS = "128,128,512;128,128,1024;512,128,512;512,128,1024;128,64,1024;512,64,1024"


def packed_rows(nb, parts, overhead):
    """tile_md rows of contiguous whole requests, balanced by blocks + ``overhead`` per request."""
    cost = [n + overhead for n in nb]
    share = sum(cost) / parts
    rows, start, acc = [], 0, 0.0
    for r, c in enumerate(cost):
        # close the partition before r when r would take it past its share by more than half of r
        if r > start and len(rows) < parts - 1 and acc + c / 2 > share * (len(rows) + 1):
            rows.append((start, r - 1, 0, nb[r - 1], 0, 0, 0, 0))
            start = r
        acc += c
    rows.append((start, len(nb) - 1, 0, nb[-1], 0, 0, 0, 0))
    return rows


def packed_launch(row, pools, parts, overhead):
    """(launch, out, partitions, blocks of the longest partition) of the packed schedule."""
    q = row["q"]
    b, s_q, h, _ = q.shape
    nb = device_num_blocks(row["topk_length"], v4b.TOPK, b, q.device, row["extra_indices"].shape[-1],
                           row["extra_topk_length"]).cpu().tolist()
    rows = packed_rows(nb, parts, overhead)
    mod = kernel_module(SM90.name)
    cfg = mod.kernel_config(h_q=h, d_qk=V4.d_qk, split=False, has_topk_length=True, has_attn_sink=True,
                            has_extra=True, has_extra_topk_length=True)
    compiled = mod.compile_sparse_decode(cfg)
    tile_md = torch.tensor(rows, dtype=torch.int32, device=q.device)
    offsets = torch.zeros(b + 1, dtype=torch.int32, device=q.device)
    out = torch.empty(b, s_q, h, V4.d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    t = DecodeTensors(q, cache_bytes(pools[0]), row["indices"], row["topk_length"], row["attn_sink"], tile_md, offsets,
                      out, lse, None, None, cache_bytes(pools[1]), row["extra_indices"], row["extra_topk_length"])
    longest = max(sum(nb[r0:r1 + 1]) for r0, r1, *_ in rows)
    return (lambda: mod.launch_sparse_decode(compiled, cfg, t, v4b.SCALE)), out, len(rows), longest


def main():
    ap = v4b.probe_parser(ROWS)
    ap.add_argument("--overhead", type=float, default=1.0, help="blocks charged per request when cutting")
    ap.add_argument("--parts", type=int, default=0, help="partitions (0: one wave, num_sms / (h_q / 64))")
    args = ap.parse_args()
    rows = v4b.parse_rows(args.rows)
    if any(e == 0 for _, _, e in rows):
        raise SystemExit("--rows: the packed kernel is the extra pool's: every row needs an extra list (extra > 0)")
    g, pools = v4b.probe_inputs()
    sms = device_num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}  V4 rows (s_q 1, top-k 128, lengths uniform, sinks on): one-call graph "
          f"replay µs, interleaved medians of {args.rounds} rounds; packed: whole requests, overhead {args.overhead}")
    for b, h, e in rows:
        row = v4b.make_row(b, h, e, 0.0, g)
        sched = cute_mla.get_mla_metadata()[0]
        g_default, (o_default, _) = v4b.capture_call(sched, row, pools)
        parts = args.parts or sms // (h // 64)
        launch, out, n_rows, longest = packed_launch(row, pools, parts, args.overhead)
        launch()
        torch.cuda.synchronize()
        g_packed, _ = v32b.capture_graph(launch)
        g_packed.replay()
        torch.cuda.synchronize()
        diff = (out.float() - o_default.float()).abs().max().item()
        med = bench.interleaved_median_us({"default": g_default, "packed": g_packed}, rounds=args.rounds)
        p = sched.plan
        print(f"b={b} h={h} extra={e}: default [{p.schedule}/{p.variant}/{p.num_sm_parts} parts] {med['default']:.2f} | "
              f"packed [{n_rows} partitions, longest {longest} blocks] {med['packed']:.2f} "
              f"(x{med['default'] / med['packed']:.3f}) | max|out - default| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
