"""Check and time SM90 kernel variants against each other, in one device call.

A variant is an ``Sm90Tuning`` value run through the public seam: ``FlashMLASchedMeta(tuning=...)``
makes the public call compile and launch it (``cute_mla.interface.launcher``). Correctness gates
the timings:

1. edge cases (``cute_mla.testing`` inputs: non-power-of-two scales, topk_length, sinks, page block
   61, invalid / out-of-range indices, all-invalid rows), kernel launched directly: the default
   within FlashMLA's tolerances of the fp32 reference, every variant bit-identical to the default
   (the knobs only change how the same tiles are fetched);
2. on each benchmark row every variant gives the default's bits through the public call.

Then CUDA-graph replay times, the variants interleaved round by round, median per variant.

    python -m benchmarks.variants [--variants default,no_pf,...] [--rows "1,1,64;1,8,64"] [--layers 16]
                                  [--parts 0,32,16] [--json PATH] [--skip-edge]

``+nocomb`` after a name is a bound, not a variant: the call's decode kernel alone
(``Launcher.main``), without the combine (split outputs stay unwritten, so they are not checked).
``--parts``: re-plan each row as for a GPU whose SM count gives that many partitions (0: the plan
this GPU gets), through ``plan_sparse_decode`` / ``make_schedule`` / ``Launcher``; the outputs must
match the default's within FlashMLA's tolerances (other pieces sum in another order).
``--layers N`` captures N calls per graph and reports per-call times (an engine's graph holds
every layer of a step; a one-call graph's replay includes the host's graph launch).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import cute_mla
from cute_mla.archs import device_arch, device_num_sms
from cute_mla.interface.launcher import Launcher
from cute_mla.kernels.sm90 import DEFAULT_TUNING, RegisterBudget, Sm90Tuning, kernel_config
from cute_mla.plan.schedule import make_schedule
from cute_mla.reference import sparse_decode_reference
from cute_mla.testing import check_out_lse, make_inputs as test_inputs, run_kernel

from benchmarks.bench_sparse_decode import TOPK, capture_graph, make_inputs, parse_rows, warm_up

VARIANTS = {
    "default": DEFAULT_TUNING,
    "no_pf": Sm90Tuning(prefetch_rows=False),                 # no L2 prefetch of tile T+2's rows
    "l2_none": Sm90Tuning(gather_l2=""),                      # gather loads without the L2::256B prefetch hint
    "l2_128b": Sm90Tuning(gather_l2="size_128b"),
    "no_hints": Sm90Tuning(gather_l1="", gather_l2=""),
    "no_h128_cluster": Sm90Tuning(h128_cluster=False),        # h=128: two independent CTAs, each gathers every row
    "regs_208_168_128": Sm90Tuning(registers=RegisterBudget(208, 168, 128)),
}
ROWS = [(1, 1024, 64), (128, 2, 128), (1, 1024, 128), (1, 1, 64)]
SCALE = 576 ** -0.5


def variant_of(name):
    """(tuning, bound): a VARIANTS name with an optional ``+nocomb``."""
    base, nocomb = (name[: -len("+nocomb")], True) if name.endswith("+nocomb") else (name, False)
    if base not in VARIANTS:
        raise SystemExit(f"variant {base!r}: accepted {', '.join(VARIANTS)} (+nocomb)")
    return VARIANTS[base], nocomb


def edge_check(names):
    """The kernel launched directly on edge-case inputs: the default against the reference, every
    variant against the default's bits. Returns the names that differ."""
    g = torch.Generator().manual_seed(1234)
    inp = test_inputs(74, 2, 64, 576, num_tokens=4096, page_block_size=61, invalid_frac=0.15, out_of_range_frac=0.05,
                      with_topk_length=True, with_sink=True, power_of_two_scales=False, all_invalid_rows=3,
                      device="cuda", generator=g)
    parts = device_num_sms(inp.q.device) // 2
    runs = {}
    for name in dict.fromkeys(["default"] + [n.removesuffix("+nocomb") for n in names]):
        cfg = kernel_config(h_q=64, d_qk=576, split=True, has_topk_length=True, has_attn_sink=True,
                            tuning=VARIANTS[name])
        runs[name] = run_kernel(inp, cfg, parts)[:2]
    ref_out, ref_lse = sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale,
                                               attn_sink=inp.attn_sink, topk_length=inp.topk_length)
    check_out_lse(*runs["default"], ref_out, ref_lse)
    bad = [n for n, (o, l) in runs.items()
           if not (torch.equal(o, runs["default"][0]) and torch.equal(l.nan_to_num(7.0), runs["default"][1].nan_to_num(7.0)))]
    print(f"edge check (b=74 s_q=2 h=64 topk_length sink pbs=61 non-pow2 scales): default vs reference OK; "
          f"bit-identical to the default: {[n for n in runs if n not in bad]}; DIFFERENT: {bad}", flush=True)
    return set(bad)


def planned_call(b, s_q, h, parts, tuning, q, cache, idx):
    """A call re-planned for ``parts`` partitions (0: this GPU's plan) through the public objects:
    (``run``, ``main_only``), each launching it and returning its (out, lse) buffers; ``main_only``
    leaves out the combine."""
    dev = q.device
    num_sms = device_num_sms(dev) if parts == 0 else parts * s_q * (h // 64)
    plan = cute_mla.plan_sparse_decode(b, s_q, h, q.shape[-1], idx.shape[-1], arch=device_arch(dev), num_sms=num_sms)
    schedule = make_schedule(plan, dev, None)
    launcher = Launcher(plan, False, False, tuning)
    out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=dev)
    kv = cache.view(torch.uint8).squeeze(2)
    args = (q, kv, idx, None, None, schedule.tile_md, schedule.accum_offsets, out, lse, SCALE)

    def run():
        schedule.ensure_ready()
        launcher(*args)
        return out, lse

    def main_only():
        schedule.ensure_ready()
        launcher.main(*args)
        return out, lse

    return run, main_only


def row_graphs(row, names, parts_list, layers, bad, g):
    """{(parts, name): (graph, max |out - default|)} for one row, every output checked."""
    b, s_q, h = row
    q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
    ref, graphs = None, {}
    for parts in parts_list:
        for name in names:
            if name.removesuffix("+nocomb") in bad:
                continue
            tuning, nocomb = variant_of(name)
            run, main_only = planned_call(b, s_q, h, parts, tuning, q, cache, idx)
            o, l = run()
            torch.cuda.synchronize()
            if ref is None:
                ref = (o.clone(), l.clone())
            err = (o.float() - ref[0].float()).abs().max().item()
            if parts == parts_list[0] and not nocomb:
                assert torch.equal(o, ref[0]) and torch.equal(l.nan_to_num(7.0), ref[1].nan_to_num(7.0)), \
                    f"{row} {name}: differs from the default's bits"
            elif not nocomb:
                check_out_lse(o.float(), l.transpose(1, 2), ref[0].float(), ref[1].transpose(1, 2))
            graphs[(parts, name)] = (capture_graph(main_only if nocomb else run, layers)[0], err)
    return graphs


def time_graphs(graphs, rounds, layers):
    for gr, _ in graphs.values():
        for _ in range(2):
            gr.replay()
    torch.cuda.synchronize()
    times = {k: [] for k in graphs}
    for _ in range(rounds):
        for k, (gr, _) in graphs.items():
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(6)]
            for a, e in ev:
                a.record()
                gr.replay()
                e.record()
            torch.cuda.synchronize()
            times[k] += [a.elapsed_time(e) * 1e3 / layers for a, e in ev]
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="default,no_pf,l2_none")
    ap.add_argument("--rows", default=None, help="b,s_q,h;b,s_q,h;... (default: ROWS)")
    ap.add_argument("--parts", default="0", help="partition counts; 0 = this GPU's plan")
    ap.add_argument("--layers", type=int, default=1, help="calls per captured graph; times are per call")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-edge", action="store_true")
    ap.add_argument("--warmup-s", type=float, default=2.0)
    args = ap.parse_args()
    if args.layers < 1:
        raise SystemExit(f"--layers: got {args.layers}, accepted: >= 1")
    names = [n for n in args.variants.split(",") if n]
    names = ["default"] + [n for n in names if n != "default"]
    for n in names:
        variant_of(n)
    parts_list = [int(p) for p in args.parts.split(",")]
    rows = parse_rows(args.rows) if args.rows else ROWS
    bad = set() if args.skip_edge else edge_check(names)
    warm_up(args.warmup_s)
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for row in rows:
        graphs = row_graphs(row, names, parts_list, args.layers, bad, g)
        times = time_graphs(graphs, args.rounds, args.layers)
        base = times[(parts_list[0], "default")]
        b, s_q, h = row
        flop = 2 * h * (576 + 512) * TOPK * b * s_q
        for (parts, name), us in times.items():
            r = dict(b=b, s_q=s_q, h_q=h, parts=parts, variant=name, layers=args.layers, us=us, tflops=flop / us * 1e-6,
                     speedup_vs_default=base / us, max_abs_diff=graphs[(parts, name)][1])
            results.append(r)
            print(f"  {b:>4} {s_q:>5} {h:>4} parts={parts:<4} {name:<22} {us:9.2f} us {r['tflops']:6.1f} TF/s "
                  f"x{r['speedup_vs_default']:.3f}", flush=True)
        del graphs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), variants={n: repr(variant_of(n)) for n in names},
                           edge_bad=sorted(bad), results=results), f, indent=1)


if __name__ == "__main__":
    main()
