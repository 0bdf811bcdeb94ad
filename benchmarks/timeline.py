"""Where a CTA's cycles go: the SM90 kernel compiled with ``Sm90Tuning(timeline=True)`` writes a
clock64 stamp per phase and warp group (``cute_mla.kernels.sm90.config.Stamp``) into a buffer;
this prints, per phase, the cycles since kernel entry (median over the CTAs with work and the
graph replays, and the max over CTAs).

The kernel is launched the way the launcher would (the plan, its schedule, the plan's kernel
config with the timeline variant), alone: a split plan's combine is not run (it does not change
the decode kernel's stamps). Stamps of phases a CTA passes once per tile hold the last tile's time.

    python -m benchmarks.timeline [--heads 64,128] [--s-q 1] [--topk 2048] [--replays 10] [--variant no_pf]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import cute_mla
from cute_mla.archs import SM90, device_arch, device_num_sms
from cute_mla.kernels.sm90 import DEFAULT_TUNING
from cute_mla.interface.launcher import allocate_workspace, cache_bytes, kernel_module, launch_configs
from cute_mla.kernels import DecodeTensors
from cute_mla.kernels.sm90.config import Stamp
from cute_mla.plan.schedule import make_schedule

from benchmarks.bench_sparse_decode import capture_graph, make_inputs
from benchmarks.variants import variant_of

CASES = [(64, 1.0), (64, 0.0), (2048, 1.0), (2048, 0.2)]   # (top-k, masked fraction)
ORDER = [Stamp.PROLOGUE, Stamp.METADATA, Stamp.SCAN, Stamp.K_FREE, Stamp.HALF_A, Stamp.HANDED_OVER, Stamp.Q_READY,
         Stamp.K_READY, Stamp.QK_DONE, Stamp.P_READY, Stamp.WG1_P, Stamp.WG1_PV_DONE, Stamp.PV_DONE,
         Stamp.EPI_FINAL, Stamp.EPI_STAGED, Stamp.EPILOGUE, Stamp.WG1_EPI_STAGED, Stamp.WG1_EPILOGUE]


GHZ = 1.98   # the H200's SM clock under load: cycles -> µs


def stamped_launch(q, cache, idx, tuning):
    """(launch, stamp buffer, plan) of one call's decode kernel compiled with the timeline."""
    b, s_q, h, d_qk = q.shape
    dev = q.device
    if device_arch(dev) != SM90.name:
        raise SystemExit(f"the timeline is the SM90 kernel's (Sm90Tuning.timeline): this GPU runs {device_arch(dev)}")
    plan = cute_mla.plan_sparse_decode(b, s_q, h, d_qk, idx.shape[-1], arch=SM90.name, num_sms=device_num_sms(dev))
    if plan.token_walk:
        raise SystemExit("the timeline takes the latency rows (no token walk): use a small s_q")
    launch, stamps = stamped_kernel(plan, make_schedule(plan, dev, None), q, cache, idx, tuning)
    return launch, stamps, plan


def stamped_kernel(plan, schedule, q, cache, idx, tuning=None, topk_length=None, attn_sink=None,
                   extra=(None, None, None)):
    """(launch, stamp buffer) of ``plan``'s decode kernel compiled with the timeline, launched the
    way the launcher would on ``schedule`` (``extra``: the extra pool's cache, indices, lengths)."""
    dev = q.device
    b, s_q, h, _ = q.shape
    extra_cache, extra_idx, extra_len = extra
    mod = kernel_module(plan.arch)
    cfg, _ = launch_configs(plan, attn_sink is not None, dataclasses.replace(tuning or DEFAULT_TUNING, timeline=True))
    compiled = mod.compile_sparse_decode(cfg)
    o_accum, lse_accum = allocate_workspace(plan, dev)
    out = torch.empty(b, s_q, h, plan.d_v, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=dev)
    grid_x = s_q * cfg.n_hblk * cfg.n_cblk
    stamps = torch.zeros(grid_x, schedule.tile_md.shape[0], int(Stamp.SLOTS), dtype=torch.int64, device=dev)
    t = DecodeTensors(q, cache_bytes(cache), idx, topk_length, attn_sink, schedule.tile_md, schedule.accum_offsets,
                      out, lse, o_accum, lse_accum, None if extra_cache is None else cache_bytes(extra_cache),
                      extra_idx, extra_len, schedule.request_order)

    def launch():
        schedule.ensure_ready()
        mod.launch_sparse_decode(compiled, cfg, t, plan.d_qk ** -0.5, timeline=stamps)

    return launch, stamps


def stamped_graph(launch):
    """A CUDA graph of ``launch`` (a :func:`stamped_kernel` launch), after three warm-up launches."""
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    return capture_graph(launch)[0]


def working_rows(graph, stamps, replays):
    """(partition, stamp row) of every CTA with work, over ``replays`` replays of ``graph``
    (:func:`stamped_graph`); the stamps are zeroed before each replay."""
    for _ in range(replays):
        stamps.zero_()
        graph.replay()
        torch.cuda.synchronize()
        st = stamps.cpu()
        for x in range(st.shape[0]):
            for part in range(st.shape[1]):
                if int(st[x, part, Stamp.METADATA]) != 0:   # else a CTA without work
                    yield part, st[x, part]


def print_phases(order, rows, worst=None):
    """One line per phase of ``order`` with samples in ``rows`` (cycles since entry): the median,
    in cycles and µs, and the max over CTAs where ``worst`` is given."""
    for s in order:
        if rows[s]:
            m = statistics.median(rows[s])
            tail = f"   [{worst[s]:8d}]" if worst is not None else ""
            print(f"  {s.name:<14} {m:8.0f} cyc {m / GHZ / 1e3:6.2f} us{tail}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="64", help="h_q values, e.g. 64,128")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--variant", default="default", help="a benchmarks.variants name, timeline added")
    ap.add_argument("--s-q", type=int, default=1, help="query tokens of the one request (no token walk: small)")
    ap.add_argument("--topk", type=int, default=None, help="only the cases of this top-k (64 or 2048)")
    args = ap.parse_args()
    tuning, nocomb = variant_of(args.variant)
    if nocomb:
        raise SystemExit("--variant: the timeline stamps the decode kernel, which runs alone anyway (no +nocomb)")
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: cycles since kernel entry, median over working CTAs and "
          f"{args.replays} graph replays [max over CTAs]; us at {GHZ} GHz")
    for h in (int(v) for v in args.heads.split(",")):
        for topk, masked in CASES:
            if args.topk is not None and topk != args.topk:
                continue
            q, cache, idx = make_inputs(1, args.s_q, h, masked, g, topk=topk)
            launch, stamps, plan = stamped_launch(q, cache, idx, tuning)
            rows = {s: [] for s in ORDER}
            worst = {s: 0 for s in ORDER}
            for _, r in working_rows(stamped_graph(launch), stamps, args.replays):
                for s in ORDER:
                    if int(r[s]) != 0:
                        d = int(r[s]) - int(r[Stamp.ENTRY])
                        rows[s].append(d)
                        worst[s] = max(worst[s], d)
            ctas = len(rows[Stamp.METADATA]) // args.replays
            print(f"\ns_q={args.s_q} h={h} top-k {topk} masked {masked}: {plan.variant}"
                  f"{' (column pair)' if plan.column_pair else ''}, {ctas} CTAs with work")
            print_phases(ORDER, rows, worst)


if __name__ == "__main__":
    main()
