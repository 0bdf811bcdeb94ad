"""Check and time Tuning variants of the SM90 sparse decode kernel against each other, in one device call.

Correctness comes first and gates the timings:
1. edge cases (cute_mla.testing inputs: non-power-of-two scales, topk_length, sink, page block 61,
   invalid / out-of-range indices, all-invalid rows): every variant must give out/lse bit-identical
   to the first variant of its *family* (same ``compact_indices``: compaction changes which tokens
   share a tile, hence the summation order), and each family's first variant must pass the
   fp32-reference tolerances;
2. on each benchmark row (bench_sparse_decode.py's inputs) every variant must match its family's
   first variant bit for bit (the variants only reschedule work, so any difference is a bug), and
   families must agree within FlashMLA's tolerances.
Then CUDA-graph replay times of the public API (main kernel, + combine where the plan splits), the
variants interleaved round by round, median per variant.

    python benchmarks/sm90_variants.py [--json PATH] [--variants a,b,...] [--skip-edge] [--layers N]

``--layers N`` captures N calls per graph and reports per-call times: on the latency rows a
replay of a one-call graph, timed right after a sync, may measure the host's submission more than
the GPU (NOTES.md, session 2026-12-03 f).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import cute_mla  # noqa: E402
from cute_mla.kernels import combine  # noqa: E402
from cute_mla.kernels.sm90 import sparse_decode as sd  # noqa: E402
from cute_mla.kernels.sm90.sparse_decode import DEFAULT_TUNING, Crossover, Streaming, Tuning  # noqa: E402

S = Streaming
X = Crossover
VARIANTS = {
    "default": DEFAULT_TUNING,
    "l2_none": Tuning(gather_l2=""),
    "no_compact": Tuning(compact_indices=False, streaming=S.OFF, crossover=X.OFF),  # one tile per 64 positions (the kernel before compaction)
    "no_compact_l2_none": Tuning(compact_indices=False, streaming=S.OFF, gather_l2="", crossover=X.OFF),
    "cfence": Tuning(consumer_proxy_fence=True),
    "late_md": Tuning(early_metadata=False),  # tile_md / num_splits read where used (the kernel before early_metadata)
    "late_md_cfence": Tuning(early_metadata=False, consumer_proxy_fence=True),
    "cpair": Tuning(column_pair=True),  # h=64 split: a cluster of 2 per piece splitting the 512 columns, forced (the plan picks it on few-piece shapes)
    "pdl": Tuning(pdl_wait=True),  # the decode kernel launched with PDL, griddepcontrol.wait after its barrier inits
    "unchunked": Tuning(chunked_epilogue=False),  # bf16 out / o_accum staged by 4-B st.shared, one TMA store per warp group (the default before 2026-12-03 h)
    "lse_first": Tuning(store_lse_first=True),  # lse stores before the O block's staging (the order before 2026-12-03 h)
    "help2": Tuning(help_second_tile=True),  # WG1 converts a two-tile partition's second tile (1x8x64's pieces)
    "strict_cstart": Tuning(relaxed_cluster_start=False),  # cluster kernels: the release arrive at the start (its MEMBAR.ALL.GPU also waits for the tile_md load issued before it; before 3a8c83d that load came after the barrier)
    "oacc_direct": Tuning(oacc_direct_store=True),  # o_accum from registers everywhere (no staging, no TMA store)
    "oacc_tma": Tuning(oacc_direct_store=False),  # o_accum by TMA everywhere (the plan picks registers on few-CTA h=64 shapes)
    "next_q_pf": Tuning(prefetch_next_q=True),  # L2 prefetch of the next request's Q (measured no gain)
    "out_direct": Tuning(out_direct_store=True),  # bf16 out from registers (no staging in sQ, no TMA store)
    "out_direct_nqpf": Tuning(out_direct_store=True, prefetch_next_q=True),
    "l2_hints": Tuning(l2_hints=True),
    "l2_hints_cfence": Tuning(l2_hints=True, consumer_proxy_fence=True),
    "half_pipelined": Tuning(streaming=S.OFF, crossover=X.OFF),  # the compacted default before streaming
    "cfence_off": Tuning(streaming=S.OFF, consumer_proxy_fence=True, crossover=X.OFF),
    "nc_stream_cfence": Tuning(compact_indices=False, streaming=S.BOTH, consumer_proxy_fence=True, crossover=X.OFF),
    "no_pf": Tuning(prefetch_rows=False),
    "pf_bulk": Tuning(prefetch_lines=False),  # bulk L2 row prefetch (a per-lane loop in SASS)
    "scan1": Tuning(scan_two_ahead=False),  # one index chunk in flight
    "af2f72e": Tuning(prefetch_lines=False, scan_two_ahead=False, crossover=X.OFF),  # the default before a1e56bd
    # h=128 crossover (cluster of 2, each CTA dequantizes half of every tile; Crossover docstring;
    # WARP_COPIES is the default)
    "xover_off": Tuning(crossover=X.OFF),  # each CTA gathers all 64 rows (the default before fccc5e1)
    "xover_half": Tuning(crossover=X.HALF_COPY),
    "xover2": Tuning(crossover=X.WARP_COPIES_TWO_TILES),
    "xover2_nopf": Tuning(crossover=X.WARP_COPIES_TWO_TILES, prefetch_rows=False),  # spills 16 B instead of 64
    "noov": Tuning(overlap_qk_pv=False),
    "l1_normal": Tuning(gather_l1="evict_normal"),
    # measured slower (NOTES.md), kept for re-tests
    "stream_a_pf": Tuning(streaming=S.FIRST_HALF, compact_indices=False, crossover=X.OFF),
    "stream_ab_pf": Tuning(streaming=S.BOTH, compact_indices=False, crossover=X.OFF),
    "pf_noalloc": Tuning(gather_l1="evict_no_allocate"),
}


def family(name):
    """The variant results must be bit-identical to: the first listed variant with the same compaction."""
    return next(n for n in VARIANTS if VARIANTS[n].compact_indices == VARIANTS[name].compact_indices)
ROWS = [(1, 1024, 64), (128, 2, 128), (1, 1024, 128), (1, 1, 64)]


class use_tuning:
    """Make the dispatcher compile with ``tuning`` (compile_sparse_decode's default argument)."""

    def __init__(self, tuning):
        self.tuning = tuning

    def __enter__(self):
        self.orig = sd.compile_sparse_decode
        sd.compile_sparse_decode = functools.partial(self.orig, tuning=self.tuning)

    def __exit__(self, *exc):
        sd.compile_sparse_decode = self.orig


class use_combine:
    """Make the dispatcher's combine configs take ``overrides`` (CombineConfig fields), where the
    config accepts them: a bucket that refuses one (a ValueError) keeps the plain config."""

    def __init__(self, **overrides):
        self.overrides = overrides

    def __enter__(self):
        self.orig = combine.combine_config

        def config(*args, **kw):
            cfg = self.orig(*args, **kw)
            try:
                return dataclasses.replace(cfg, **self.overrides)
            except ValueError:
                return cfg

        combine.combine_config = config

    def __exit__(self, *exc):
        combine.combine_config = self.orig


@contextlib.contextmanager
def skip_launch(module, name):
    """A bound, not a variant: ``module.name`` (a launch function the dispatcher calls) does nothing."""
    orig = getattr(module, name)
    setattr(module, name, lambda *a, **k: None)
    try:
        yield
    finally:
        setattr(module, name, orig)


def skip_combine():
    """The dispatcher launches no combine, so split outputs stay unwritten: what a call would take
    if the combine cost nothing (its kernel and its boundary)."""
    return skip_launch(combine, "launch_combine")


@contextlib.contextmanager
def use_variant(name):
    """``use_tuning`` of a variant name: a VARIANTS key, with "+ctrig" appended for the combine's
    ``trigger_dependents``, or "+nocomb" for the no-combine bound (``skip_combine``)."""
    nocomb = name.endswith("+nocomb")
    name = name[:-len("+nocomb")] if nocomb else name
    base, trig = (name[:-len("+ctrig")], True) if name.endswith("+ctrig") else (name, False)
    with use_tuning(VARIANTS[base]), use_combine(**({"trigger_dependents": True} if trig else {})), \
            (skip_combine() if nocomb else contextlib.nullcontext()):
        yield


def edge_check(names):
    from test_sm90_gpu import run_kernel
    from cute_mla.reference import sparse_decode_reference
    from cute_mla.testing import check_out_lse, make_inputs

    g = torch.Generator().manual_seed(1234)
    inp = make_inputs(74, 2, 64, 576, num_tokens=4096, page_block_size=61, invalid_frac=0.15, out_of_range_frac=0.05,
                      with_topk_length=True, with_sink=True, power_of_two_scales=False, all_invalid_rows=3,
                      device="cuda", generator=g)
    res = {}
    for name in names:
        with use_tuning(VARIANTS[name]):
            out, lse, _ = run_kernel(inp, False, 1)
        res[name] = (out, lse)
    ref_out, ref_lse = sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale,
                                               attn_sink=inp.attn_sink, topk_length=inp.topk_length)
    bad = []
    for name in names:
        o, l = res[name]
        fam = family(name)
        if fam == name:
            check_out_lse(o, l, ref_out, ref_lse)
            continue
        if fam not in res:
            raise SystemExit(f"variant {name}: its family's first variant {fam} must be run too")
        same = torch.equal(o, res[fam][0]) and torch.equal(l.nan_to_num(7.0), res[fam][1].nan_to_num(7.0))
        if not same:
            bad.append(name)
    print(f"edge check (b=74 s_q=2 h=64 topk_length sink pbs=61 non-pow2 scales): family heads vs reference OK; "
          f"bit-identical to their family head: {[n for n in names if n not in bad]}; DIFFERENT: {bad}", flush=True)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip-edge", action="store_true", help="only the bit-identity check on the benchmark rows")
    ap.add_argument("--rows", default=None, help="b,s_q,h;b,s_q,h;... (default: ROWS)")
    ap.add_argument("--layers", type=int, default=1,
                    help="calls per captured graph (an engine's graph holds every layer); times are per call")
    ap.add_argument("--warmup-s", type=float, default=2.0, help="GPU warm-up before timing (an idle H200 sits at 345 MHz)")
    args = ap.parse_args()
    if args.layers < 1:
        raise SystemExit(f"--layers: got {args.layers}, accepted: >= 1")
    names = [n for n in args.variants.split(",") if n]
    for n in ["default"] + list(names):
        if family(n) not in names:
            names.insert(0, family(n))
    if "default" in names:
        names.remove("default")
    names.insert(0, "default")
    from bench_sparse_decode import TOPK, call, capture_graph, make_inputs, parse_rows, warm_up

    t0 = time.time()
    bad = set() if args.skip_edge else set(edge_check(names))
    print(f"[{time.time() - t0:.0f} s]", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    rows = parse_rows(args.rows) if args.rows else ROWS
    warm_up(args.warmup_s)
    for (b, s_q, h) in rows:
        q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
        flop = 2 * h * (576 + 512) * TOPK * b * s_q
        graphs, outs = {}, {}
        for name in names:
            if name in bad:
                continue
            sched, _ = cute_mla.get_mla_metadata()
            with use_tuning(VARIANTS[name]):
                o, l = call(cute_mla, sched, q, cache, idx)   # compiles (cached per tuning) and plans
            torch.cuda.synchronize()
            outs[name] = (o.clone(), l.clone())
            graphs[name], _ = capture_graph(lambda: call(cute_mla, sched, q, cache, idx), args.layers)
        from cute_mla.testing import check_out_lse

        ok = []
        for n in graphs:
            fam = family(n)
            if fam == n:
                check_out_lse(outs[n][0].float(), outs[n][1], outs["default"][0].float(), outs["default"][1])
                ok.append(n)
            elif fam in outs and torch.equal(outs[n][0], outs[fam][0]) and torch.equal(outs[n][1], outs[fam][1]):
                ok.append(n)
        for n in list(graphs):
            if n not in ok:
                print(f"  b={b} s_q={s_q} h={h}: {n} DIFFERS from {family(n)}: max |d out| "
                      f"{(outs[n][0].float() - outs[family(n)][0].float()).abs().max().item():.3e}; not timed", flush=True)
                del graphs[n]
        for gr in graphs.values():
            for _ in range(2):
                gr.replay()
        torch.cuda.synchronize()
        one = None
        times = {n: [] for n in graphs}
        for r in range(args.rounds):
            for n, gr in graphs.items():
                k = 6
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(k)]
                for a, e in ev:
                    a.record(); gr.replay(); e.record()
                torch.cuda.synchronize()
                times[n] += [a.elapsed_time(e) * 1e3 / args.layers for a, e in ev]
        base_us = statistics.median(times["default"])
        for n in graphs:
            us = statistics.median(times[n])
            rr = dict(b=b, s_q=s_q, h_q=h, variant=n, us=us, tflops=flop / us * 1e-6, speedup_vs_default=base_us / us,
                      spread_us=statistics.pstdev(times[n]))
            results.append(rr)
            print(f"  {b:>4} {s_q:>5} {h:>4} {n:<22} {us:9.1f} us {rr['tflops']:6.1f} TF/s  x{rr['speedup_vs_default']:.3f}", flush=True)
        del q, cache, idx, graphs, outs
        torch.cuda.empty_cache()
        print(f"[{time.time() - t0:.0f} s]", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), variants={n: repr(VARIANTS[n]) for n in names},
                           edge_bad=sorted(bad), results=results), f, indent=1)
    print("\nvariant                  " + "  ".join(f"{b}x{s}x{h}".rjust(12) for b, s, h in rows))
    for n in names:
        cells = []
        for (b, s_q, h) in rows:
            m = [r for r in results if r["variant"] == n and (r["b"], r["s_q"], r["h_q"]) == (b, s_q, h)]
            cells.append(f"{m[0]['us']:7.1f} x{m[0]['speedup_vs_default']:.3f}" if m else "         -   ")
        print(f"{n:<24} " + "  ".join(c.rjust(12) for c in cells))


if __name__ == "__main__":
    main()
