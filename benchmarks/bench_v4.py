"""cute-mla vs FlashMLA (vLLM's build) on DeepSeek V4 decode shapes, side by side in one run.

V4 ("MODEL1") FP8 cache (d_qk 512, 584 B/token), page block 64, two pools of 131072 tokens (the
main cache and the extra cache), s_q = 1, main top-k 128 with ``topk_length`` uniform in [1, 128],
an extra list of ``extra_topk`` in {0, 512, 1024} with ``extra_topk_length`` uniform in [1,
extra_topk], ``attn_sink`` given; b in {1, 32, 128, 512}, h_q in {64, 128}.

A row is a shape; its lengths and indices are random, and its time depends on the draw (at b=128,
h=128, extra 1024 one draw measured 1.19x and three others 1.23-1.24x). So each row is measured
on ``--draws`` draws of its inputs, each from a generator seeded by (b, h, extra_topk, draw), the
same whatever else the run measures (a ``--rows`` rerun reproduces a grid row). Per draw:
cute-mla's output is checked against the fp32 reference on a sample of requests (FlashMLA's
tolerances; FlashMLA's output too, for information), then both libraries' CUDA graphs of one
call are replayed in turn, round by round (``bench.interleaved_median_us``: an order effect or a
clock drift falls on both), each library's time the median of per-replay events; ratio =
FlashMLA µs / cute-mla µs (above 1: cute-mla faster). The row reports the median over its draws
of each library's time and of the per-draw ratio, and the lowest and highest per-draw ratio.
Each library's transient memory (peak allocation during a decode step's first call beyond out
and lse: ``testing.step_transient_bytes``) is measured on the row's first draw.

    python -m benchmarks.bench_v4 [--rows all|quick|b,h,extra_topk;...] [--draws 5] [--cold-l2] [--out PATH.json]

``--cold-l2`` reads 256 MiB before every timed replay (outside its events), so neither library
finds the row's KV, q or its own workspace in L2: an engine's decode step reads each layer's KV
from HBM, where the default (every replay on the same inputs) keeps up to the whole working set
in L2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch

import cute_mla
from benchmarks.bench_sparse_decode import capture_graph, commit_id, flashmla, warm_up
from benchmarks.variants import variant_of
from cute_mla.formats import V4
from cute_mla.playground import bench
from cute_mla.reference import sparse_decode_reference
from cute_mla.testing import check_out_lse, step_transient_bytes

POOL, PAGE, TOPK = bench.POOL, bench.PAGE, bench.V4_TOPK   # the playground's pools and list (cute-mla bench --format v4)
BATCHES, HEADS, EXTRA_TOPKS = (1, 32, 128, 512), (64, 128), (0, 512, 1024)
GRID = [(b, h, e) for h in HEADS for e in EXTRA_TOPKS for b in BATCHES]
QUICK = [(1, 64, 512), (32, 64, 1024), (128, 128, 512), (512, 128, 1024)]
SCALE = V4.d_qk ** -0.5


def parse_rows(text):
    """"b,h,extra_topk;..." -> [(b, h, extra_topk), ...]."""
    return [tuple(int(v) for v in r.split(",")) for r in text.split(";") if r]


make_pool = bench.v4_pool   # a V4 cache of POOL tokens (the playground's, ``cute-mla bench --format v4``)


def make_row(b, h, extra_topk, masked, g):
    """One row's q, indices, lengths and sinks (s_q = 1); the extra list's are None without one."""
    q, indices, topk_length, extra_indices, extra_topk_length, sink = bench.v4_lists(b, 1, h, extra_topk, masked, g)
    return dict(q=q, indices=indices, topk_length=topk_length, extra_indices=extra_indices,
                extra_topk_length=extra_topk_length, attn_sink=sink)


def call(mod, sched, row, k_cache, extra_k_cache):
    extra = row["extra_indices"] is not None
    return mod.flash_mla_with_kvcache(
        row["q"], k_cache, None, None, V4.d_v, sched, softmax_scale=SCALE, is_fp8_kvcache=True,
        indices=row["indices"], attn_sink=row["attn_sink"], extra_k_cache=extra_k_cache if extra else None,
        extra_indices_in_kvcache=row["extra_indices"], topk_length=row["topk_length"],
        extra_topk_length=row["extra_topk_length"])


def check_sample(out, lse, row, k_cache, extra_k_cache, sample, g):
    """``None`` if (out, lse) of a sample of requests are within FlashMLA's tolerances of the fp32
    reference, else the failure's message."""
    b = row["q"].shape[0]
    req = torch.randperm(b, device="cuda", generator=g)[:sample]
    pick = lambda t: None if t is None else t[req]  # noqa: E731
    extra = row["extra_indices"] is not None
    ro, rl = sparse_decode_reference(row["q"][req], k_cache, row["indices"][req], SCALE, row["attn_sink"],
                                     row["topk_length"][req], extra_k_cache=extra_k_cache if extra else None,
                                     extra_indices=pick(row["extra_indices"]),
                                     extra_topk_length=pick(row["extra_topk_length"]))
    try:
        check_out_lse(out[req], lse[req], ro, rl)
    except AssertionError as e:
        return str(e)[:300]
    return None


def row_seed(b, h, extra_topk, draw):
    """The seed of one draw of a row's inputs: the row and the draw only (b < 10^6, extra_topk <
    10^4, draw < 100 give distinct seeds)."""
    return ((b * 1000 + h) * 10000 + extra_topk) * 100 + draw


def row_generator(b, h, extra_topk, draw):
    return torch.Generator(device="cuda").manual_seed(row_seed(b, h, extra_topk, draw))


class VariantLibrary:
    """cute_mla's two calls with every metadata object made for one kernel variant (``tuning``,
    the public seam ``FlashMLASchedMeta(tuning=...)``): ``--variant``."""

    def __init__(self, tuning):
        self.tuning = tuning
        self.flash_mla_with_kvcache = cute_mla.flash_mla_with_kvcache

    def get_mla_metadata(self, *args, **kwargs):
        return cute_mla.FlashMLASchedMeta(tuning=self.tuning), None


def prepare(mod, row, k_cache, extra_k_cache, check):
    """(graph of one call on ``row``, the out its replays write, the metadata object it reads: keep
    it, the check's result and the plan's fields): an eager call first (compile, plan, schedule),
    checked (``check(out, lse)``, cute-mla's gate)."""
    sched, _ = mod.get_mla_metadata()
    out, lse = call(mod, sched, row, k_cache, extra_k_cache)
    torch.cuda.synchronize()
    res = dict(check=check(out, lse) or "ok")
    del out, lse
    gr, (go, _) = capture_graph(lambda: call(mod, sched, row, k_cache, extra_k_cache))
    plan = getattr(sched, "plan", None)
    if plan is not None:
        res.update(variant=plan.variant, schedule=plan.schedule, workspace_mib=plan.workspace_bytes / 2**20)
    return gr, go, sched, res


def transient_mib(mod, row, k_cache, extra_k_cache):
    _, transient = step_transient_bytes(lambda: mod.get_mla_metadata()[0], lambda s: call(mod, s, row, k_cache, extra_k_cache))
    return transient / 2**20


def run_draw(b, h, extra_topk, draw, pools, libs, args):
    """One draw of a row: {lib: {check, us, ...}} and the largest |out difference| between them."""
    row = make_row(b, h, extra_topk, args.masked, row_generator(b, h, extra_topk, draw))
    k_cache, extra_k_cache = pools

    def check(out, lse):   # the same sample of requests for both libraries
        sample_gen = torch.Generator(device="cuda").manual_seed(b * 1000 + h + extra_topk)
        return check_sample(out, lse, row, k_cache, extra_k_cache, args.sample, sample_gen)

    res, graphs, outs, keep = {}, {}, {}, []
    for name, mod in libs.items():
        try:
            graphs[name], outs[name], sched, res[name] = prepare(mod, row, k_cache, extra_k_cache, check)
            keep.append(sched)
            if draw == 0:
                res[name]["transient_mib"] = transient_mib(mod, row, k_cache, extra_k_cache)
        except Exception as e:  # noqa: BLE001
            res[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
    try:
        for name, us in (bench.interleaved_median_us(graphs, before=args.flush) if graphs else {}).items():
            res[name]["us"] = us
    except Exception as e:  # noqa: BLE001
        for name in graphs:
            res[name] = dict(error=f"timing: {type(e).__name__}: {e}"[:300])
        outs = {}
    torch.cuda.synchronize()   # (the outs: the graphs' last replays)
    diff = (outs["cute"].float() - outs["flashmla"].float()).abs().max().item() if len(outs) == 2 else None
    return res, diff


def run_row(b, h, extra_topk, pools, cute, fm, args):
    """A row over ``args.draws`` draws: the medians of each library's time and of the ratio, the
    ratio's range, the first failing check (or ok), the first draw's memory, and every draw
    (``cute``: cute_mla, or a :class:`VariantLibrary`)."""
    libs = dict(cute=cute) if fm is None else dict(cute=cute, flashmla=fm)
    r = dict(b=b, s_q=1, h_q=h, topk=TOPK, extra_topk=extra_topk, draws=[])
    for d in range(args.draws):
        res, diff = run_draw(b, h, extra_topk, d, pools, libs, args)
        per = {f"{lib}_{k}": v for lib, kv in res.items() for k, v in kv.items()}
        if "cute_us" in per and "flashmla_us" in per:
            per["ratio"] = per["flashmla_us"] / per["cute_us"]
        if diff is not None:
            per["max_abs_diff_vs_flashmla"] = diff
        r["draws"].append(per)
    first, draws = r["draws"][0], r["draws"]
    for lib in libs:
        errors = [f"draw {d}: {x[f'{lib}_error']}" for d, x in enumerate(draws) if f"{lib}_error" in x]
        if errors:   # a row with a failed draw has no time: its medians would be over other draws
            r[f"{lib}_error"] = errors[0]
            continue
        checks = [x[f"{lib}_check"] for x in draws]
        r[f"{lib}_check"] = next((c for c in checks if c != "ok"), "ok")
        r[f"{lib}_us"] = statistics.median(x[f"{lib}_us"] for x in draws)
        for k in ("transient_mib", "variant", "schedule", "workspace_mib"):
            if f"{lib}_{k}" in first:
                r[f"{lib}_{k}"] = first[f"{lib}_{k}"]
    ratios = [x["ratio"] for x in draws if "ratio" in x] if not any(f"{lib}_error" in r for lib in libs) else []
    if ratios:
        r.update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                 max_abs_diff_vs_flashmla=max(x["max_abs_diff_vs_flashmla"] for x in draws
                                              if "max_abs_diff_vs_flashmla" in x))
    return r


def print_table(results, meta):
    variant = "" if meta.get("variant", "default") == "default" else f"  cute-mla variant {meta['variant']}"
    print(f"\n{meta['gpu']}  commit {meta['commit']}{variant}  V4 cache, pools of {POOL} tokens, page block {PAGE}, "
          f"s_q 1, top-k {TOPK}, lengths uniform, sinks on")
    print(f"(µs and ratio: medians over each row's {meta['draws']} draws of its inputs; range: the lowest and "
          "highest per-draw ratio" + ("; L2 flushed before every timed replay)" if meta["cold_l2"] else ")"))
    print(f"{'b':>4} {'h':>4} {'extra':>6} | {'cute us':>8} {'MiB':>7} {'check':>6} | {'FlashMLA us':>11} {'MiB':>7} "
          f"{'check':>6} | {'ratio':>6} {'range':>11} {'maxdiff':>8}")
    for r in results:
        head = f"{r['b']:>4} {r['h_q']:>4} {r['extra_topk']:>6} | "
        if "cute_error" in r:
            ours = f"ERROR {r['cute_error'][:60]}"
        else:
            ours = f"{r['cute_us']:>8.1f} {r['cute_transient_mib']:>7.2f} {_ok(r['cute_check']):>6}"
        if "flashmla_us" in r:
            theirs = f"{r['flashmla_us']:>11.1f} {r['flashmla_transient_mib']:>7.2f} {_ok(r['flashmla_check']):>6}"
        else:
            theirs = f"{'-':>11} {'-':>7} {'-':>6}" if "flashmla_error" not in r else f"ERROR {r['flashmla_error'][:40]}"
        tail = (f"{r['ratio']:>6.2f} {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} {r['max_abs_diff_vs_flashmla']:>8.1e}"
                if "ratio" in r else f"{'-':>6} {'-':>11} {'-':>8}")
        print(head + ours + " | " + theirs + " | " + tail)
    failed = [r for r in results if r.get("cute_check", "ok") != "ok"]
    for r in failed:
        print(f"cute-mla b={r['b']} h={r['h_q']} extra={r['extra_topk']}: {r['cute_check']}")


def _ok(check):
    return "ok" if check == "ok" else "FAIL"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="all", help="all | quick | b,h,extra_topk;b,h,extra_topk;...")
    ap.add_argument("--out", default=None, help="write every row (and the run's metadata) to this JSON file")
    ap.add_argument("--draws", type=int, default=5, help="draws of each row's inputs (the row: their medians)")
    ap.add_argument("--cold-l2", action="store_true",
                    help=f"read {bench.L2_FLUSH_MIB} MiB before every timed replay: no input in L2, as an engine's layer")
    ap.add_argument("--sample", type=int, default=32, help="requests of each draw checked against the reference")
    ap.add_argument("--masked", type=float, default=0.0, help="fraction of the indices set to -1")
    ap.add_argument("--warmup-s", type=float, default=2.0, help="seconds of bf16 matmuls first (clocks up)")
    ap.add_argument("--variant", default="default",
                    help="cute-mla's kernel variant (a benchmarks.variants name, through FlashMLASchedMeta(tuning=...))")
    args = ap.parse_args()
    named = {"all": GRID, "quick": QUICK}
    rows = named[args.rows] if args.rows in named else parse_rows(args.rows)
    for b, h, e in rows:
        if h not in HEADS or e % 64 or b < 1:
            raise SystemExit(f"--rows: bad row b={b} h={h} extra_topk={e} (h 64 or 128, extra_topk a multiple of 64)")
    if not 1 <= args.draws < 100:
        raise SystemExit(f"--draws: got {args.draws}, accepted: 1 to 99")
    cute = cute_mla if args.variant == "default" else VariantLibrary(variant_of(args.variant)[0])
    fm = flashmla()
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = (make_pool(g), make_pool(g))
    args.flush = bench.l2_flusher() if args.cold_l2 else None
    warm_up(args.warmup_s)
    results = []
    for b, h, e in rows:
        r = run_row(b, h, e, pools, cute, fm, args)
        results.append(r)
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), commit=commit_id(), torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                pool=POOL, page_block_size=PAGE, topk=TOPK, masked=args.masked, sample=args.sample, draws=args.draws,
                cold_l2=args.cold_l2, variant=args.variant,
                flashmla=fm is not None, command="python -m benchmarks.bench_v4 " + " ".join(sys.argv[1:]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    print_table(results, meta)


if __name__ == "__main__":
    main()
