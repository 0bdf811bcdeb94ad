"""Probe (V4 rows, SM90): the plan's schedule against the others for the same call, end to end,
interleaved, with the default captured twice (the spread between two identical graphs).

* One partition per request <-> the split schedule: only the plan's window for one partition per
  request differs (``plan.PER_REQUEST_WAVES``, ``PER_REQUEST_HEADS``, ``PER_REQUEST_MAX_BLOCKS``,
  ``PER_REQUEST_TINY_MAX_WAVES``): opened, it forces one partition per request; shut, the split
  schedule.
* Rows whose plan deals whole requests (``plan.sm90_packed``, the balanced schedule): against the
  split schedule (``PACKED_MIN_WAVES`` out of reach).

    python -m benchmarks.v4_schedule_probe [--rows "b,h,extra;..."] [--rounds 5]
"""

from __future__ import annotations

from benchmarks import bench_v4 as v4b
from cute_mla.playground import bench

ROWS = ("1,64,0;1,128,0;32,64,0;32,128,0;1,128,512;128,64,1024;128,128,512;128,128,1024;512,64,512;"
        "512,64,1024")
FORCE = {"per_request": v4b.PER_REQUEST_SHUT, "device": v4b.PER_REQUEST_OPEN,
         "host": v4b.PER_REQUEST_OPEN}   # default -> the other
WHOLE = {"balanced": {"split": v4b.NO_PACKING}}


def capture(row, pools, constants):
    gr, (o, _), sched = v4b.capture_forced(row, pools, constants)
    p = sched.plan
    name = f"{p.schedule}/{p.variant}/ws {p.workspace_bytes / 2**20:.1f} MiB"
    return gr, o.float(), name, p.schedule, sched   # the graph reads sched's tensors: keep it


def main():
    args = v4b.probe_parser(ROWS).parse_args()
    g, pools = v4b.probe_inputs()
    for b, h, e, row in v4b.probe_rows(args.rows, g):
        default = capture(row, pools, {})
        again = capture(row, pools, {})
        forced = WHOLE.get(default[3], {"other": FORCE.get(default[3])})
        graphs = {"default": default, "again": again}
        graphs.update({k: capture(row, pools, c) for k, c in forced.items() if c is not None})
        med = bench.interleaved_median_us({k: c[0] for k, c in graphs.items()}, rounds=args.rounds)
        others = " | ".join(f"{k} ({graphs[k][2]}) {med[k]:.2f} us x{med['default'] / med[k]:.3f}"
                            f" max|diff| {(default[1] - graphs[k][1]).abs().max().item():.1e}"
                            for k in graphs if k not in ("default", "again"))
        print(f"V4 b={b} h={h} extra={e}: default ({default[2]}) {med['default']:.2f} / again {med['again']:.2f} us"
              f" | {others}", flush=True)


if __name__ == "__main__":
    main()
