"""Probe (V4 rows, SM90): the split schedule's charge per request piece.

The greedy scheduler charges every request piece some virtual blocks for its start and end
(FlashMLA: 5; the plan's V4 device schedules: ``plan.V4_DEVICE_PIECE_CHARGE``), and cuts so that
every partition holds the same blocks + charges. On the H200 a piece costs about one block's time
at h = 128 and less at h = 64 (``v4_timeline --spans``): a larger charge gives the partitions that
hold more pieces fewer blocks than they could take, and the trailing ones none. This probe times
each row's call under its plan and under the split schedule with each charge of ``--charges``,
end to end (scheduler, decode kernel, combine), interleaved, and checks the outputs against the
plan's.

    python -m benchmarks.v4_charge_probe [--rows "b,h,extra;..."] [--charges 0,1,2,5] [--rounds 5]
"""

from __future__ import annotations

from benchmarks import bench_v4 as v4b
from cute_mla.playground import bench

ROWS = ("32,64,512;32,64,1024;32,128,512;32,128,1024;128,64,512;128,64,1024;128,128,512;128,128,1024;"
        "512,64,512;512,64,1024;512,128,512;512,128,1024")
SPLIT = dict(v4b.PER_REQUEST_SHUT, **v4b.NO_PACKING)   # the split schedule everywhere


def capture(row, pools, constants):
    gr, (o, _), sched = v4b.capture_forced(row, pools, constants)
    p = sched.plan
    return gr, o.float(), f"{p.schedule}/fo {p.fixed_overhead}", sched   # the graph reads sched's tensors


def main():
    ap = v4b.probe_parser(ROWS)
    ap.add_argument("--charges", default="0,1,2,5")
    args = ap.parse_args()
    g, pools = v4b.probe_inputs()
    charges = [int(v) for v in args.charges.split(",")]
    for b, h, e, row in v4b.probe_rows(args.rows, g):
        graphs = {"plan": capture(row, pools, {})}
        for c in charges:
            graphs[f"split fo {c}"] = capture(row, pools, dict(SPLIT, V4_DEVICE_PIECE_CHARGE=c))
        med = bench.interleaved_median_us({k: v[0] for k, v in graphs.items()}, rounds=args.rounds)
        base = graphs["plan"]
        cells = " | ".join(f"{k} {med[k]:.1f} (x{med['plan'] / med[k]:.3f}, diff {(v[1] - base[1]).abs().max().item():.0e})"
                           for k, v in graphs.items() if k != "plan")
        print(f"V4 b={b} h={h} extra={e}: plan ({base[2]}) {med['plan']:.1f} us | {cells}", flush=True)


if __name__ == "__main__":
    main()
