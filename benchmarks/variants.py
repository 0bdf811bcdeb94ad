"""Check and time SM90 kernel variants against each other, in one device call.

A variant is an ``Sm90Tuning`` value run through the public seam: a ``FlashMLASchedMeta(tuning=...)``
passed to ``cute_mla.flash_mla_with_kvcache`` makes the call compile and launch that kernel
(``cute_mla.interface.launcher``). Correctness gates the timings:

1. edge cases (``cute_mla.testing`` inputs: non-power-of-two scales, topk_length, sinks, page block
   61, invalid / out-of-range indices, all-invalid rows) through the public call: the default
   within FlashMLA's tolerances of the fp32 reference, every variant bit-identical to the default
   (the knobs only change how the same tiles are fetched); a variant that differs is not timed;
2. on each benchmark row every variant gives the default call's bits (one that does not is
   reported and not timed).

Then CUDA-graph replay times, the variants interleaved round by round, median per variant.

    python -m benchmarks.variants [--variants default,no_pf,...] [--rows "1,1,64;1,8,64"] [--layers 16]
                                  [--parts 0,32,16] [--json PATH] [--skip-edge]

``+nocomb`` after a name is a bound, not a variant: the call's decode kernel alone
(``Launcher.main`` of the filled metadata's launcher), without the combine (split outputs stay
unwritten, so they are not checked).

``--parts``: each count re-plans the row for that many scheduler partitions (0: the plan this GPU
gets): ``plan_sparse_decode`` for the SM count that gives that many, this GPU's column-pair rule,
the schedule from ``make_schedule`` and a ``Launcher`` of the variant; never a token walk (1 on a
long b=1 row is FlashMLA's grid). Other pieces sum in another order, so the outputs are checked
against the fp32 reference within FlashMLA's tolerances (two kernel outputs each carry their own
rounding: FlashMLA's cosine bound failed between the default and a 16-partition re-plan at 1x1x64).

``--layers N`` captures N calls per graph and reports per-call times (an engine's graph holds
every layer of a step; a one-call graph's replay includes the host's graph launch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

import cute_mla
from cute_mla.archs import SM90, device_arch, device_num_sms
from cute_mla.formats import V32
from cute_mla.interface.launcher import Launcher
from cute_mla.kernels.sm90 import DEFAULT_TUNING, RegisterBudget, Sm90Tuning
from cute_mla.kernels import SparseDecodeTensors, cache_bytes
from cute_mla.plan.policy import default_policy
from cute_mla.plan.sparse_decode import uses_column_pair
from cute_mla.plan.schedule import make_schedule
from cute_mla.scheduler.partition import head_blocks
from cute_mla.playground import bench
from cute_mla.reference import sparse_decode_reference
from cute_mla.testing import check_out_lse, make_inputs as test_inputs

from benchmarks.bench_sparse_decode import TOPK, call, capture_graph, make_inputs, parse_rows, warm_up

VARIANTS = {
    "default": DEFAULT_TUNING,
    "no_pf": Sm90Tuning(prefetch_rows=False),                 # no L2 prefetch of tile T+2's rows
    "l2_none": Sm90Tuning(gather_l2=""),                      # gather loads without the L2::256B prefetch hint
    "l2_128b": Sm90Tuning(gather_l2="size_128b"),
    "no_hints": Sm90Tuning(gather_l1="", gather_l2=""),       # no L1 evict_last either
    "no_h128_cluster": Sm90Tuning(h128_cluster=False),        # h=128: two independent CTAs, each gathers every row
    # 8 registers from the softmax warp group to PV_RIGHT (no serialized wgmma; the no-split variant with
    # topk_length and a sink keeps 24 B of stack: `cute-mla compile --topk-length --attn-sink --variant registers=208/168/128`)
    "regs_208_168_128": Sm90Tuning(registers=RegisterBudget(208, 168, 128)),
}
NOCOMB = "+nocomb"
ROWS = [(1, 1024, 64), (128, 2, 128), (1, 1024, 128), (1, 1, 64)]
SCALE = V32.d_qk ** -0.5
# edge-case call: more requests than a GPU's partitions and a top-k of 9 blocks
EDGE_SHAPE = dict(b=74, s_q=2, h_q=64, topk=9 * 64)


def variant_of(name):
    """(tuning, nocomb): a VARIANTS name with an optional ``+nocomb``; the tuning is None for
    ``default``."""
    base, nocomb = (name[: -len(NOCOMB)], True) if name.endswith(NOCOMB) else (name, False)
    if base not in VARIANTS:
        raise SystemExit(f"variant {base!r}: accepted {', '.join(VARIANTS)} (each optionally with {NOCOMB})")
    # the default is no tuning at all: the public call then compiles the arch's own default kernel
    # (an SM100 kernel takes no Sm90Tuning)
    return (None if base == "default" else VARIANTS[base]), nocomb


def same_bits(a, b):
    """(out, lse) pairs bit for bit (lse's NaN-free +inf rows included)."""
    return torch.equal(a[0], b[0]) and torch.equal(a[1].nan_to_num(7.0), b[1].nan_to_num(7.0))


def edge_check(names):
    """Edge-case inputs through the public call: the default against the fp32 reference, every
    variant against the default's bits. Returns the variant names that differ."""
    g = torch.Generator().manual_seed(1234)
    inp = test_inputs(*EDGE_SHAPE.values(), num_tokens=4096, page_block_size=61, invalid_frac=0.15,
                      out_of_range_frac=0.05, with_topk_length=True, with_sink=True, power_of_two_scales=False,
                      all_invalid_rows=3, device="cuda", generator=g)
    runs = {}
    for name in dict.fromkeys(["default"] + [n.removesuffix(NOCOMB) for n in names]):
        sched = cute_mla.FlashMLASchedMeta(tuning=VARIANTS[name])
        out, lse = cute_mla.flash_mla_with_kvcache(
            inp.q, inp.k_cache, None, None, V32.d_v, sched, softmax_scale=inp.softmax_scale, is_fp8_kvcache=True,
            indices=inp.indices, attn_sink=inp.attn_sink, topk_length=inp.topk_length)
        torch.cuda.synchronize()
        runs[name] = (out, lse)
    ref_out, ref_lse = sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale,
                                               attn_sink=inp.attn_sink, topk_length=inp.topk_length)
    check_out_lse(runs["default"][0].float(), runs["default"][1], ref_out, ref_lse)
    bad = [n for n in runs if not same_bits(runs[n], runs["default"])]
    shape = " ".join(f"{k}={v}" for k, v in EDGE_SHAPE.items())
    print(f"edge check ({shape}, topk_length, sinks, page block 61, non-pow2 scales; public call): default vs "
          f"reference OK; bit-identical to the default: {[n for n in runs if n not in bad]}; DIFFERENT: {bad}",
          flush=True)
    return set(bad)


def public_call(tuning, q, cache, idx):
    """(run, main_only) of the row through the public seam: ``run`` is the public call with a
    ``FlashMLASchedMeta(tuning=...)`` (filled by a first call here), ``main_only`` its launcher's
    decode kernel alone; each returns (out, lse (b, h, s_q))."""
    sched = cute_mla.FlashMLASchedMeta(tuning=tuning)
    call(cute_mla, sched, q, cache, idx)
    launcher = sched.launcher(False)
    b, s_q, h, _ = q.shape
    out = torch.empty(b, s_q, h, V32.d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    o_accum, lse_accum = sched.workspace
    t = SparseDecodeTensors(q, cache_bytes(cache), idx, out=out, lse=lse, tile_md=sched.tile_scheduler_metadata,
                            accum_offsets=sched.accum_offsets, o_accum=o_accum, lse_accum=lse_accum,
                            softmax_scale=SCALE)

    def main_only():
        sched.schedule.ensure_ready()
        launcher.main(t)
        return out, lse.transpose(1, 2)

    return (lambda: call(cute_mla, sched, q, cache, idx)), main_only


def plan_with_parts(b, s_q, h, topk, parts, dev):
    """The row's plan over ``parts`` scheduler partitions: the plan for the SM count that gives that
    many, with the column-pair rule of this GPU's SM count."""
    num_sms = device_num_sms(dev)
    plan = cute_mla.plan_sparse_decode(b, s_q, h, V32.d_qk, topk, arch=SM90.name, num_sms=parts * s_q * head_blocks(h))
    if plan.num_sm_parts != parts:
        raise SystemExit(f"--parts {parts}: the plan for b={b} s_q={s_q} h={h} has {plan.num_sm_parts} partitions")
    if plan.split:
        plan = dataclasses.replace(plan, column_pair=uses_column_pair(default_policy(plan.arch), b, s_q, h, num_sms,
                                                                      plan.host_schedule))
    return plan


def planned_call(parts, tuning, q, cache, idx):
    """(run, main_only) of the row re-planned over ``parts`` partitions, through the public objects
    (plan, ``make_schedule``, ``Launcher``); each returns (out, lse (b, h, s_q))."""
    b, s_q, h, _ = q.shape
    dev = q.device
    plan = plan_with_parts(b, s_q, h, idx.shape[-1], parts, dev)
    schedule = make_schedule(plan, dev, None)
    launcher = Launcher(plan, False, tuning)
    out = torch.empty(b, s_q, h, V32.d_v, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=dev)
    t = SparseDecodeTensors(q, cache_bytes(cache), idx, out=out, lse=lse, tile_md=schedule.tile_md,
                            accum_offsets=schedule.accum_offsets, softmax_scale=SCALE)

    def run():
        schedule.ensure_ready()
        launcher(t)
        return out, lse.transpose(1, 2)

    def main_only():
        schedule.ensure_ready()
        launcher.main(t)
        return out, lse.transpose(1, 2)

    return run, main_only


def checked(parts, got, ref, oracle):
    """None if ``got`` passes (at the GPU's plan: the default call's bits; re-planned: FlashMLA's
    tolerances of the fp32 reference ``oracle()``), else why not."""
    if parts == 0:
        if same_bits(got, ref):
            return None
        return f"differs from the default's bits (max |d out| {(got[0].float() - ref[0].float()).abs().max().item():.3e})"
    try:
        check_out_lse(got[0].float(), got[1], *oracle())
    except AssertionError as e:
        return f"out of FlashMLA's tolerances of the fp32 reference: {e}"
    return None


def row_graphs(row, names, parts_list, layers, bad, g):
    """{(parts, name): (graph, max |out - default|, the captured function)} for one row, every
    output checked first. The function holds what the graph reads and writes (inputs, metadata,
    out / lse buffers): a replay after those are freed reads and writes freed memory."""
    b, s_q, h = row
    q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
    o, l = call(cute_mla, cute_mla.FlashMLASchedMeta(), q, cache, idx)   # the default public call
    torch.cuda.synchronize()
    ref = (o.clone(), l.clone())
    fp32 = []

    def oracle():
        if not fp32:
            fp32.extend(sparse_decode_reference(q, cache, idx, SCALE))
        return fp32

    graphs = {}
    for parts in parts_list:
        for name in names:
            if name.removesuffix(NOCOMB) in bad:
                continue
            tuning, nocomb = variant_of(name)
            run, main_only = public_call(tuning, q, cache, idx) if parts == 0 else planned_call(parts, tuning, q, cache, idx)
            err = None
            if not nocomb:
                got = run()
                torch.cuda.synchronize()
                why = checked(parts, got, ref, oracle)
                if why:
                    print(f"  b={b} s_q={s_q} h={h} parts={parts} {name}: {why}; not timed", flush=True)
                    continue
                err = (got[0].float() - ref[0].float()).abs().max().item()
            fn = main_only if nocomb else run
            graphs[(parts, name)] = (capture_graph(fn, layers)[0], err, fn)
    return graphs


def time_graphs(graphs, rounds, layers):
    """{key: (median, spread) µs per call}: every graph replayed 6 times a round, round by round."""
    for gr, *_ in graphs.values():
        for _ in range(2):
            gr.replay()
    torch.cuda.synchronize()
    times = {k: [] for k in graphs}
    for _ in range(rounds):
        for k, (gr, *_) in graphs.items():
            times[k] += [t / layers for t in bench.replay_times_us(gr, 6)]
    return {k: (statistics.median(v), statistics.pstdev(v)) for k, v in times.items()}


def summary(results, rows):
    """One line per (parts, variant): µs per call and speed-up against the row's first default, one column per row."""
    keys = list(dict.fromkeys((r["parts"], r["variant"]) for r in results))
    cells = {(r["parts"], r["variant"], r["b"], r["s_q"], r["h_q"]): r for r in results}
    print("\nparts variant                 " + "  ".join(f"{b}x{s}x{h}".rjust(15) for b, s, h in rows))
    for parts, name in keys:
        line = []
        for (b, s_q, h) in rows:
            r = cells.get((parts, name, b, s_q, h))
            line.append(f"{r['us']:8.2f} x{r['speedup_vs_default']:.3f}" if r else "-")
        print(f"{parts:>5} {name:<24} " + "  ".join(c.rjust(15) for c in line))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="default,no_pf,l2_none",
                    help=f"names of VARIANTS ({', '.join(VARIANTS)}), each optionally with {NOCOMB}")
    ap.add_argument("--rows", default=None, help="b,s_q,h;b,s_q,h;... (default: ROWS)")
    ap.add_argument("--parts", default="0", help="partition counts; 0 = this GPU's plan")
    ap.add_argument("--layers", type=int, default=1, help="calls per captured graph; times are per call")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-edge", action="store_true", help="only the checks on the benchmark rows")
    ap.add_argument("--warmup-s", type=float, default=2.0, help="GPU warm-up before timing (an idle H200 sits at 345 MHz)")
    args = ap.parse_args()
    if args.layers < 1:
        raise SystemExit(f"--layers: got {args.layers}, accepted: >= 1")
    names = [n for n in args.variants.split(",") if n]
    names = ["default"] + [n for n in dict.fromkeys(names) if n != "default"]
    for n in names:
        variant_of(n)
    parts_list = [int(p) for p in args.parts.split(",")]
    if any(p < 0 for p in parts_list):
        raise SystemExit(f"--parts: got {args.parts}, accepted: counts >= 1, or 0 for this GPU's plan")
    if device_arch(torch.device("cuda")) != SM90.name:
        raise SystemExit(f"the variants are Sm90Tuning values: this GPU runs {device_arch(torch.device('cuda'))}")
    rows = parse_rows(args.rows) if args.rows else ROWS
    bad = set() if args.skip_edge else edge_check(names)
    warm_up(args.warmup_s)
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for row in rows:
        graphs = row_graphs(row, names, parts_list, args.layers, bad, g)
        if not graphs:
            continue
        times = time_graphs(graphs, args.rounds, args.layers)
        base = times[next(iter(times))][0]   # the first count's default (or the first that passed)
        b, s_q, h = row
        flop = 2 * h * (V32.d_qk + V32.d_v) * TOPK * b * s_q
        for (parts, name), (us, spread) in times.items():
            r = dict(b=b, s_q=s_q, h_q=h, parts=parts, variant=name, layers=args.layers, us=us, spread_us=spread,
                     tflops=flop / us * 1e-6, speedup_vs_default=base / us, max_abs_diff=graphs[(parts, name)][1])
            results.append(r)
            print(f"  {b:>4} {s_q:>5} {h:>4} parts={parts:<4} {name:<24} {us:9.2f} us {r['tflops']:6.1f} TF/s "
                  f"x{r['speedup_vs_default']:.3f}", flush=True)
        del graphs
        torch.cuda.empty_cache()
    summary(results, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), variants={n: repr(variant_of(n)[0]) for n in names},
                           edge_bad=sorted(bad), results=results), f, indent=1)


if __name__ == "__main__":
    main()
