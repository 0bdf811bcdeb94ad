"""Where a call's time goes: per kernel, on the host, and per CTA phase (one tool, several modes).

Default: per-kernel device time (torch.profiler / CUPTI) of cute-mla and FlashMLA under CUDA-graph
replay, on the latency rows; then the per-call replay time (a graph of ``--layers`` calls) of
cute-mla's whole call, of its decode kernel alone (``Launcher.main``) and of its combine alone
(``Launcher.combine`` on the decode kernel's workspace): the combine's share of the critical path.

``--v4 ROWS``: the same per-kernel device times on V4 rows of ``bench_sparse_decode --v4`` (``"b,h,extra;..."``):
the decode and combine kernels of each library's call, as a decode step's later calls run them
(the metadata object already holds the schedule). cute-mla's combine is launched with PDL, so its
span covers the decode kernel's and the printed sum counts that overlap twice.

``--ncu``: one public-API call of a row (warm-up outside), bracketed by cudaProfilerStart/Stop, for
Nsight Compute (decode kernel and, where the plan splits, the combine)::

    ncu --clock-control none --profile-from-start off --set full --import-source no \\
        -o OUT/rep python3 -m benchmarks.profile --ncu --row 1,1024,128 [--variant no_pf]
    ncu --import OUT/rep.ncu-rep --page details --csv        # per-kernel metrics
    ncu --import OUT/rep.ncu-rep --page source --csv --print-source sass   # per-SASS stall samples

``--ncu-prefill D_QK,H_Q,TOPK,S_KV``: the same for one ``flash_mla_sparse_fwd`` call of that case of
``bench_sparse_prefill`` (s_q 4096, FlashMLA's strided inputs, sinks; cute-mla's, or ``--lib flashmla``
FlashMLA's), e.g. both libraries at 576,128,2048,32768 in two reports.

``--host``: the eager call's host time, per call over ``--calls`` back-to-back calls (the GPU work
of a small call is shorter than its host work, so the calls do not queue), split into its parts
(the metadata's launcher, ``allocate_workspace``, ``Launcher.main`` / ``combine``), FlashMLA's call
beside it, each step of the public call timed alone, then a cProfile of the public call. Keep
``--calls`` x 2 launches below the launch queue's depth (~1000), or the host waits for the GPU.

``--launch``: the decode kernel's TVM-FFI launch taken apart on ``--row``: the launcher's call,
the compiled function called directly with the same arguments, those arguments through TVM-FFI's
no-op function (the argument conversion alone), and for scale a torch kernel launch
(``Tensor.zero_`` of 4 bytes) and a CUDA event record.

``--timeline`` (SM90): where a CTA's cycles go. The decode kernel compiled with
``Sm90Tuning(timeline=True)`` writes a ``clock64`` stamp per phase and warp group
(``cute_mla.kernels.sm90.config.Stamp``); this prints, per phase, the cycles since kernel entry
(median over the CTAs with work and the graph replays, and the max over CTAs) on one request of
``--s-q`` tokens per top-k / masking case. The kernel is launched the way the launcher would (the
plan, its schedule, the plan's kernel config with the timeline added), alone: a split plan's
combine is not run (it does not change the decode kernel's stamps). Stamps of phases a CTA passes
once per tile hold the last tile's time.

``--spans ROWS`` (SM90): V4 rows (``"b,h,extra;..."``) under the plan their call takes, the
timeline build again: per CTA its span (kernel entry to its last store issued), its scheduler
blocks (``blocks_of_length`` then ``extra_blocks_of_length`` per request: the unit the
scheduler's charge is counted in) and its request pieces; a least-squares fit span = a + b x blocks
+ c x pieces; the spread of the spans; the same on the global timer (``Stamp.NS_SLOTS``: the spread
of the CTAs' entries, the longest CTA, first entry to last exit, which no per-SM clock rate skews);
and the decode kernel's own graph-replay time. ``--variants`` fits each kernel variant on the same
inputs. (A one-request-per-CTA form, which forced the plan, is ``benchmarks/v4_timeline.py`` at
0365cde.)

    python -m benchmarks.profile [--rows "1,1,64;1,8,64"] [--layers 16]
    python -m benchmarks.profile --v4 "128,128,1024;512,128,1024"
    python -m benchmarks.profile --ncu [--row 1,1024,128] [--variant NAME] [--topk 2048] [--masked 0.2]
    python -m benchmarks.profile --ncu --v4-row 512,8,512 [--variant NAME]
    python -m benchmarks.profile --ncu-prefill 576,128,2048,32768 [--lib flashmla]
    python -m benchmarks.profile --host [--row 1,1,64] [--calls 400]
    python -m benchmarks.profile --launch [--row 1,1,64] [--calls 400]
    python -m benchmarks.profile --timeline [--heads 64,128] [--s-q 1] [--topk 2048] [--replays 10] [--variant no_pf]
    python -m benchmarks.profile --spans "512,128,1024" [--variants default,no_pf] [--replays 5]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import io
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import cute_mla
from cute_mla.archs import SM90, device_arch, device_num_sms
from cute_mla.formats import V4, V32
from cute_mla import registry
from cute_mla.interface.launcher import allocate_workspace, launch_configs
from cute_mla.kernels import SparseDecodeTensors, cache_bytes
from cute_mla.kernels.sm90 import DEFAULT_TUNING
from cute_mla.kernels.sm90.config import Stamp
from cute_mla.plan.schedule import make_schedule
from cute_mla.playground.bench import padded
from cute_mla.scheduler import SchedField
from cute_mla.scheduler.partition import blocks_of_length, extra_blocks_of_length

from benchmarks.bench_sparse_decode import (V4_TOPK, call, capture_graph, flashmla, make_inputs, parse_row, parse_rows,
                                            replay_median_us, v4_call, v4_make_pool, v4_make_row, v4_parse_rows, warm_up)
from benchmarks.variants import variant_of

ROWS = [(1, 1, 64), (1, 8, 64), (1, 1, 128), (1, 8, 128), (128, 1, 64)]
NCU_ROW, HOST_ROW = "1,1024,128", "1,1,64"
SCALE = V32.d_qk ** -0.5


def filled(mod, q, cache, idx, tuning=None):
    """A metadata object filled by one call (plan, schedule, compiled kernels)."""
    sched = cute_mla.FlashMLASchedMeta(tuning=tuning) if mod is cute_mla else mod.get_mla_metadata()[0]
    call(mod, sched, q, cache, idx)
    torch.cuda.synchronize()
    return sched


class Parts:
    """cute-mla's call on one row taken apart through its filled metadata object: the public call,
    the launcher (``sched.launcher(False)``), its two steps and the workspace allocation, on
    preallocated out / lse."""

    def __init__(self, q, cache, idx):
        self.q, self.cache, self.idx = q, cache, idx
        self.sched = filled(cute_mla, q, cache, idx)
        self.launcher = self.sched.launcher(False)
        b, s_q, h, _ = q.shape
        self.out = torch.empty(b, s_q, h, V32.d_v, dtype=torch.bfloat16, device=q.device)
        self.lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
        o_accum, lse_accum = self.sched.workspace
        self.t = SparseDecodeTensors(q, cache_bytes(cache), idx, out=self.out, lse=self.lse,
                                     tile_md=self.sched.tile_scheduler_metadata,
                                     accum_offsets=self.sched.accum_offsets, o_accum=o_accum, lse_accum=lse_accum,
                                     softmax_scale=SCALE)
        self.launched = self.main()          # the bundle with the workspace the decode kernel wrote, for combine()
        self.workspace = (self.launched.o_accum, self.launched.lse_accum)
        torch.cuda.synchronize()

    @property
    def split(self):
        return self.launcher.plan.split

    def public(self):
        return call(cute_mla, self.sched, self.q, self.cache, self.idx)

    def launch(self):
        self.launcher(self.t)

    def main(self):
        return self.launcher.main(self.t)

    def combine(self):
        self.launcher.combine(self.launched)

    def workspace_allocation(self):
        return allocate_workspace(self.launcher.plan, self.q.device)


def kernel_times(g, reps=20):
    """{kernel name: (µs per replay, launches per replay)} of a graph's replays (CUPTI)."""
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    acc = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time > 0:
            acc[e.name[:48]].append(e.device_time)
    return {k: (sum(v) / reps, len(v) // reps) for k, v in acc.items()}


def per_kernel(rows, layers):
    fm = flashmla()
    g = torch.Generator(device="cuda").manual_seed(0)
    for (b, s_q, h) in rows:
        q, cache, idx = make_inputs(b, s_q, h, 0.2, g)
        for name, mod in (("cute-mla", cute_mla), ("FlashMLA", fm)):
            if mod is None:
                continue
            sched = filled(mod, q, cache, idx)
            t = kernel_times(capture_graph(lambda: call(mod, sched, q, cache, idx))[0])
            total = sum(v[0] for v in t.values())
            parts = ", ".join(f"{k} {v[0]:.1f} us x{v[1]}" for k, v in sorted(t.items(), key=lambda kv: -kv[1][0]))
            print(f"b={b} s_q={s_q} h={h} {name:8s}: kernels {total:.1f} us = {parts}", flush=True)
        p = Parts(q, cache, idx)
        steps = {"whole call": p.public, "decode kernel alone": p.main}
        if p.split:
            steps["combine alone"] = p.combine
        per_call = {k: replay_median_us(capture_graph(fn, layers)[0], 50) / layers for k, fn in steps.items()}
        print(f"b={b} s_q={s_q} h={h} cute-mla ({p.launcher.plan.variant}) per call in a {layers}-call graph: "
              + ", ".join(f"{k} {v:.2f} us" for k, v in per_call.items()), flush=True)


def launch_parts(args):
    import tvm_ffi

    b, s_q, h = parse_row(args.row or HOST_ROW)
    q, cache, idx = make_inputs(b, s_q, h, 0.2, torch.Generator(device="cuda").manual_seed(0))
    p = Parts(q, cache, idx)
    launcher = p.launcher
    if launcher.plan.token_walk:
        raise SystemExit("--launch: a row without the token walk (small s_q)")
    t = p.launched
    cfg = launcher.main_cfg
    fn_args = tuple(getattr(t, name) for name in launcher.main_mod.ENTRY) + (None, SCALE)
    nop = tvm_ffi.get_global_func("testing.nop")
    tiny = torch.zeros(1, device="cuda")
    event = torch.cuda.Event()
    parts = {
        "launcher.main_mod.launch": lambda: launcher.main_mod.launch(launcher.main_compiled, cfg, t),
        "compiled fn, same arguments": lambda: launcher.main_compiled.fn(*fn_args),
        "TVM-FFI no-op, same arguments": lambda: nop(*fn_args),
        "TVM-FFI no-op, no arguments": lambda: nop(),
        "torch launch (zero_ of 4 B)": tiny.zero_,
        "CUDA event record": event.record,
    }
    if p.split:
        parts["combine launch (Launcher.combine)"] = p.combine
    print(f"{torch.cuda.get_device_name()} b={b} s_q={s_q} h={h} ({launcher.plan.variant}): host µs per call "
          f"({args.calls} calls)")
    for name, fn in parts.items():
        print(f"  {name:40s} {host_us(fn, args.calls):7.2f}", flush=True)


def per_kernel_v4(rows):
    fm = padded(flashmla())   # FlashMLA on q padded to 64 heads below 64, as engines call it
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = (v4_make_pool(g), v4_make_pool(g))
    for b, h, extra in rows:
        row = v4_make_row(b, h, extra, 0.0, g)
        for name, mod in (("cute-mla", cute_mla), ("FlashMLA", fm)):
            if mod is None:
                continue
            sched = mod.get_mla_metadata()[0]
            v4_call(mod, sched, row, *pools)
            torch.cuda.synchronize()
            t = kernel_times(capture_graph(lambda: v4_call(mod, sched, row, *pools))[0])
            total = sum(v[0] for v in t.values())
            parts = ", ".join(f"{k} {v[0]:.1f} us x{v[1]}" for k, v in sorted(t.items(), key=lambda kv: -kv[1][0]))
            plan = getattr(sched, "plan", None)
            label = f" ({plan.schedule}/{plan.variant})" if plan is not None else ""
            print(f"V4 b={b} h={h} extra={extra} {name}{label}: kernels {total:.1f} us = {parts}", flush=True)


def profile_one(fn):
    """``fn()`` twice (compile, plan, schedule), then once between cudaProfilerStart / Stop."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def ncu_one_call(args):
    tuning, nocomb = variant_of(args.variant)
    if nocomb:
        raise SystemExit("--variant: --ncu profiles a whole call (no +nocomb)")
    if args.v4_row:
        return ncu_one_v4_call(args, tuning)
    b, s_q, h = parse_row(args.row or NCU_ROW)
    topk = args.topk or 2048
    q, cache, idx = make_inputs(b, s_q, h, args.masked, torch.Generator(device="cuda").manual_seed(0), topk=topk)
    sched = filled(cute_mla, q, cache, idx, tuning)
    profile_one(lambda: call(cute_mla, sched, q, cache, idx))
    print(f"profiled one call of b={b} s_q={s_q} h={h} top-k {topk} masked {args.masked} variant {args.variant}")


def ncu_one_prefill_call(args):
    """``--ncu-prefill d_qk,h_q,topk,s_kv``: one sparse prefill call of a ``bench_sparse_prefill``
    case on its inputs, cute-mla's or FlashMLA's (``--lib``)."""
    from benchmarks import bench_sparse_prefill as bsp

    try:
        case = tuple(int(v) for v in args.ncu_prefill.split(","))
    except ValueError:
        case = ()
    if len(case) != 4:
        raise SystemExit(f"--ncu-prefill: d_qk,h_q,topk,s_kv, got {args.ncu_prefill!r}")
    fn = bsp.sparse_fwd_of(cute_mla if args.lib == "cute" else flashmla())
    if fn is None:
        raise SystemExit(f"--lib {args.lib}: no flash_mla_sparse_fwd in this environment")
    x = bsp.make_case(case, bsp.S_Q, False, False)
    profile_one(lambda: bsp.fwd_call(fn, x))
    print(f"profiled one {args.lib} sparse prefill call of {bsp.case_label(case)} (s_q {bsp.S_Q})")


def ncu_one_v4_call(args, tuning):
    """``--ncu --v4-row b,h,extra``: one call of a ``bench_sparse_decode --v4`` row (its lengths, sinks
    and pools, draw 0) under the plan it takes, the step's metadata object used twice first."""
    rows = v4_parse_rows(args.v4_row)
    if len(rows) != 1:
        raise SystemExit(f"--v4-row: one row b,h,extra_topk, got {args.v4_row!r}")
    (b, h, extra), = rows
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = (v4_make_pool(g), v4_make_pool(g))
    row = v4_make_row(b, h, extra, 0.0, g)
    sched = cute_mla.FlashMLASchedMeta(tuning=tuning)
    profile_one(lambda: v4_call(cute_mla, sched, row, *pools))
    plan = sched.plan
    print(f"profiled one V4 call of b={b} h={h} extra {extra} ({plan.schedule}/{plan.variant}) variant {args.variant}")


def host_us(fn, calls):
    """Host µs per ``fn()`` over ``calls`` back-to-back calls (50 warm-up calls first)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return dt


def public_steps(p: Parts) -> dict:
    """The public call's steps up to and after the decode launch, each as one callable on the
    row's tensors, in the order the call takes them (``interface.api``)."""
    from cute_mla.interface import api
    from cute_mla.interface.launcher import on_device_of

    sched, q, cache, idx, out, lse = p.sched, p.q, p.cache, p.idx, p.out, p.lse
    b, s_q, h, _ = q.shape
    key = api._tensor_key(q, cache, idx, None, None, None, V32.d_v, None, None, None)
    launcher = p.launcher
    kv = cache_bytes(cache)
    t = p.launched

    def guard():
        with on_device_of(q):
            pass

    steps = {
        "argument checks": lambda: api._check_arguments(sched, None, SCALE, False, True, idx, None, None, None),
        "is_compiling": torch.compiler.is_compiling,
        "device guard": guard,
        "signature key": lambda: api._tensor_key(q, cache, idx, None, None, None, V32.d_v, None, None, None),
        "signature lookup + ready flag": lambda: (sched._validated.get(key), sched.schedule.ensure_ready()),
        "out allocation": lambda: torch.empty(b, s_q, h, V32.d_v, dtype=torch.bfloat16, device=q.device),
        "lse allocation": lambda: torch.empty(b, s_q, h, dtype=torch.float32, device=q.device),
        "  (out as q.new_empty)": lambda: q.new_empty((b, s_q, h, V32.d_v)),
        "  (lse as q.new_empty, fp32)": lambda: q.new_empty((b, s_q, h), dtype=torch.float32),
        "  (torch.empty_like(out))": lambda: torch.empty_like(out),
        "  (current device: torch.cuda)": torch.cuda.current_device,
        "  (current device: torch._C)": torch._C._cuda_getDevice,
        "cache view (cache_bytes)": lambda: cache_bytes(cache),
        "token walk: 4 x [0].unsqueeze(1)": lambda: (q[0].unsqueeze(1), idx[0].unsqueeze(1), out[0].unsqueeze(1),
                                                      lse[0].unsqueeze(1)),
        "token walk: 4 x transpose(0, 1)": lambda: (q.transpose(0, 1), idx.transpose(0, 1), out.transpose(0, 1),
                                                     lse.transpose(0, 1)),
        "SparseDecodeTensors": lambda: SparseDecodeTensors(q, kv, idx, None, None, None, None, None, out, lse,
                                                           sched.tile_scheduler_metadata, sched.accum_offsets,
                                                           softmax_scale=SCALE),
        "decode launch (compiled fn)": lambda: launcher.main_mod.launch(launcher.main_compiled, launcher.main_cfg, t),
    }
    if p.split:
        steps["combine launch"] = p.combine
    steps["lse.transpose(1, 2)"] = lambda: lse.transpose(1, 2)
    return steps


def host_parts(args):
    b, s_q, h = parse_row(args.row or HOST_ROW)
    q, cache, idx = make_inputs(b, s_q, h, 0.2, torch.Generator(device="cuda").manual_seed(0))
    p = Parts(q, cache, idx)
    parts = {
        "public call": p.public,
        "out + lse allocation": lambda: (torch.empty_like(p.out), torch.empty_like(p.lse)),
        "launcher (main + combine)": p.launch,
        "workspace allocation": p.workspace_allocation,
        "main (workspace + launch)": p.main,
    }
    if p.split:
        parts["combine launch"] = p.combine
    fm = flashmla()
    if fm is not None:
        fs = filled(fm, q, cache, idx)
        parts["FlashMLA public call"] = lambda: call(fm, fs, q, cache, idx)
    print(f"{torch.cuda.get_device_name()} b={b} s_q={s_q} h={h} ({p.launcher.plan.variant}): host µs per call "
          f"({args.calls} calls)")
    for name, fn in parts.items():
        print(f"  {name:28s} {host_us(fn, args.calls):7.1f}", flush=True)
    print("  steps of the public call, each alone (µs per step):")
    for name, fn in public_steps(p).items():
        print(f"    {name:36s} {host_us(fn, args.calls):7.2f}", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        p.public()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    print(s.getvalue())


# ---- --timeline and --spans: the SM90 decode kernel compiled with Sm90Tuning(timeline=True)

CASES = [(64, 1.0), (64, 0.0), (2048, 1.0), (2048, 0.2)]   # (top-k, masked fraction)
ORDER = [Stamp.PROLOGUE, Stamp.METADATA, Stamp.SCAN, Stamp.K_FREE, Stamp.HALF_A, Stamp.HANDED_OVER, Stamp.Q_READY,
         Stamp.K_READY, Stamp.QK_DONE, Stamp.P_READY, Stamp.WG1_P, Stamp.WG1_PV_DONE, Stamp.PV_DONE,
         Stamp.EPI_FINAL, Stamp.EPI_STAGED, Stamp.EPILOGUE, Stamp.WG1_EPI_STAGED, Stamp.WG1_EPILOGUE]
GHZ = 1.98   # the H200's SM clock under load: cycles -> µs (the global timer of --spans reads the true span)


def need_sm90():
    arch = device_arch(torch.device("cuda"))
    if arch != SM90.name:
        raise SystemExit(f"the timeline is the SM90 kernel's (Sm90Tuning.timeline): this GPU runs {arch}")


def stamped_kernel(plan, schedule, q, cache, idx, tuning=None, topk_length=None, attn_sink=None,
                   extra=(None, None, None)):
    """(launch, stamp buffer) of ``plan``'s decode kernel compiled with the timeline, launched the
    way the launcher would on ``schedule`` (``extra``: the extra pool's cache, indices, lengths)."""
    dev = q.device
    b, s_q, h, _ = q.shape
    extra_cache, extra_idx, extra_len = extra
    mod = registry.kernel_module(plan.op, plan.arch)
    cfg, _ = launch_configs(plan, attn_sink is not None, dataclasses.replace(tuning or DEFAULT_TUNING, timeline=True))
    compiled = mod.compile(cfg)
    o_accum, lse_accum = allocate_workspace(plan, dev)
    out = torch.empty(b, s_q, h, plan.d_v, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=dev)
    grid_x = s_q * cfg.n_hblk * cfg.n_cblk
    stamps = torch.zeros(grid_x, schedule.tile_md.shape[0], int(Stamp.SLOTS), dtype=torch.int64, device=dev)
    t = SparseDecodeTensors(q, cache_bytes(cache), idx, topk_length, attn_sink,
                            None if extra_cache is None else cache_bytes(extra_cache), extra_idx, extra_len, out, lse,
                            schedule.tile_md, schedule.accum_offsets, schedule.request_order, o_accum, lse_accum,
                            plan.d_qk ** -0.5)

    def launch():
        schedule.ensure_ready()
        mod.launch(compiled, cfg, t, timeline=stamps)

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


def timeline(args):
    """``--timeline``: the phases of one request of ``--s-q`` tokens per case of :data:`CASES`."""
    need_sm90()
    tuning, nocomb = variant_of(args.variant)
    if nocomb:
        raise SystemExit("--variant: the timeline stamps the decode kernel, which runs alone anyway (no +nocomb)")
    replays = args.replays or 10
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}: cycles since kernel entry, median over working CTAs and "
          f"{replays} graph replays [max over CTAs]; us at {GHZ} GHz")
    for h in (int(v) for v in args.heads.split(",")):
        for topk, masked in CASES:
            if args.topk is not None and topk != args.topk:
                continue
            q, cache, idx = make_inputs(1, args.s_q, h, masked, g, topk=topk)
            plan = cute_mla.plan_sparse_decode(1, args.s_q, h, q.shape[-1], topk, arch=SM90.name,
                                               num_sms=device_num_sms(dev))
            if plan.token_walk:
                raise SystemExit("--timeline takes the latency rows (no token walk): use a small --s-q")
            launch, stamps = stamped_kernel(plan, make_schedule(plan, dev, None), q, cache, idx, tuning)
            rows = {s: [] for s in ORDER}
            worst = {s: 0 for s in ORDER}
            for _, r in working_rows(stamped_graph(launch), stamps, replays):
                for s in ORDER:
                    if int(r[s]) != 0:
                        d = int(r[s]) - int(r[Stamp.ENTRY])
                        rows[s].append(d)
                        worst[s] = max(worst[s], d)
            ctas = len(rows[Stamp.METADATA]) // replays
            print(f"\ns_q={args.s_q} h={h} top-k {topk} masked {masked}: {plan.variant}"
                  f"{' (column pair)' if plan.column_pair else ''}, {ctas} CTAs with work")
            for s in ORDER:
                if rows[s]:
                    m = statistics.median(rows[s])
                    print(f"  {s.name:<14} {m:8.0f} cyc {m / GHZ / 1e3:6.2f} us   [{worst[s]:8d}]")


def request_blocks(row, plan):
    """Each request's scheduler blocks (its main list's, at least one, then its extra list's)."""
    main = [blocks_of_length(int(v), plan.topk)[1] for v in row["topk_length"].tolist()]
    if row["extra_topk_length"] is None:
        return main
    return [m + extra_blocks_of_length(int(v), plan.extra_topk)[1]
            for m, v in zip(main, row["extra_topk_length"].tolist())]


def partition_work(tile_md, blocks, order=None):
    """(blocks, pieces) of each partition row: the blocks it walks and the requests it touches
    (``order``: the schedule's request order, whose positions the rows index, where it has one)."""
    if order is not None:
        blocks = [blocks[r] for r in order.cpu().tolist()]
    work = []
    for r in tile_md.cpu().tolist():
        br, er, bb, eb = (r[int(f)] for f in (SchedField.BEGIN_REQ, SchedField.END_REQ, SchedField.BEGIN_BLOCK,
                                              SchedField.END_BLOCK))
        tiles = sum((eb if q == er else blocks[q]) - (bb if q == br else 0) for q in range(br, er + 1))
        work.append((tiles, max(er - br + 1, 0)))
    return work


def fit2(xs, zs, ys):
    """Least-squares (a, b, c) of y = a + b x + c z."""
    n = len(ys)
    mx, mz, my = sum(xs) / n, sum(zs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    szz = sum((z - mz) ** 2 for z in zs)
    sxz = sum((x - mx) * (z - mz) for x, z in zip(xs, zs))
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    szy = sum((z - mz) * (y - my) for z, y in zip(zs, ys))
    det = sxx * szz - sxz * sxz
    if not det:
        return my, 0.0, 0.0
    b, c = (sxy * szz - szy * sxz) / det, (szy * sxx - sxy * sxz) / det
    return my - b * mx - c * mz, b, c


def global_clock(ns, replays):
    """The CTAs' (entry, exit) ``%globaltimer`` stamps (``Stamp.NS_SLOTS``), replay after replay,
    as one line: medians over the replays of the spread of the CTAs' entries, of the longest CTA
    (entry to exit) and of the kernel's span (first entry to last exit), in µs on one clock."""
    per = len(ns) // replays
    entry, longest, kernel = [], [], []
    for k in range(replays):
        rows = ns[k * per:(k + 1) * per]
        first = min(e for e, _ in rows)
        entry.append((max(e for e, _ in rows) - first) / 1e3)
        longest.append(max(x - e for e, x in rows) / 1e3)
        kernel.append((max(x for _, x in rows) - first) / 1e3)
    med = statistics.median
    return (f"global timer: entries spread over {med(entry):.2f} us, longest CTA {med(longest):.2f} us, "
            f"first entry to last exit {med(kernel):.2f} us")


def spans(args):
    """``--spans``: each V4 row under the plan its call takes, once per kernel variant on the same
    inputs (module docstring)."""
    need_sm90()
    replays = args.replays or 5
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = (v4_make_pool(g), v4_make_pool(g))
    warm_up(2.0)
    for b, h, extra in v4_parse_rows(args.spans):
        row = v4_make_row(b, h, extra, 0.0, g)
        plan = cute_mla.plan_sparse_decode(b, 1, h, V4.d_qk, V4_TOPK, arch=SM90.name, num_sms=device_num_sms(dev),
                                           has_topk_length=True, extra_topk=extra, has_extra_topk_length=extra > 0)
        for name in (n for n in args.variants.split(",") if n):
            tuning, _ = variant_of(name)
            schedule = make_schedule(plan, dev, row["topk_length"], row["extra_topk_length"])
            xtra = (pools[1], row["extra_indices"], row["extra_topk_length"]) if plan.extra_topk else (None,) * 3
            launch, stamps = stamped_kernel(plan, schedule, row["q"], pools[0], row["indices"], tuning=tuning,
                                            topk_length=row["topk_length"], attn_sink=row["attn_sink"], extra=xtra)
            work = partition_work(schedule.tile_md, request_blocks(row, plan), schedule.request_order)
            blocks, pieces, span, ns = [], [], [], []
            graph = stamped_graph(launch)
            for part, r in working_rows(graph, stamps, replays):
                blocks.append(work[part][0])
                pieces.append(work[part][1])
                span.append((int(r[Stamp.EPILOGUE]) - int(r[Stamp.ENTRY])) / GHZ / 1e3)
                ns.append((int(r[Stamp.ENTRY_NS]), int(r[Stamp.EXIT_NS])))
            a, per_block, per_piece = fit2(blocks, pieces, span)
            kernel_us = replay_median_us(graph, 50)
            q10 = statistics.quantiles(span, n=10)
            print(f"\nV4 b={b} h={h} extra={extra} [{name}]: {plan.schedule}/{plan.variant}, {len(span) // replays} CTAs, "
                  f"blocks per CTA {min(blocks)}-{max(blocks)} (mean {sum(blocks) / len(blocks):.1f}), "
                  f"pieces {min(pieces)}-{max(pieces)} (mean {sum(pieces) / len(pieces):.2f})")
            print(f"  CTA span us: median {statistics.median(span):.2f}, p10 {q10[0]:.2f}, p90 {q10[-1]:.2f}, "
                  f"max {max(span):.2f}; decode kernel alone (graph replay) {kernel_us:.2f} us")
            print(f"  fit: span = {a:.2f} + {per_block:.3f} x blocks + {per_piece:.3f} x pieces (us)", flush=True)
            print("  " + global_clock(ns, replays), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--v4", default=None, help="V4 rows b,h,extra;... (per-kernel device times)")
    mode.add_argument("--ncu", action="store_true", help="one call bracketed for Nsight Compute")
    mode.add_argument("--ncu-prefill", default=None, metavar="D_QK,H_Q,TOPK,S_KV",
                      help="one sparse prefill call of a bench_sparse_prefill case for Nsight Compute")
    mode.add_argument("--host", action="store_true", help="the eager call's host time by part")
    mode.add_argument("--launch", action="store_true", help="the decode launch taken apart (module docstring)")
    mode.add_argument("--timeline", action="store_true", help="where a CTA's cycles go, per phase (SM90)")
    mode.add_argument("--spans", default=None, metavar="ROWS",
                      help="V4 rows b,h,extra;...: per-CTA spans and their fit under the row's plan (SM90)")
    ap.add_argument("--rows", default=None, help="b,s_q,h;... (default: the latency rows)")
    ap.add_argument("--layers", type=int, default=16, help="calls per graph for the per-call replay times")
    ap.add_argument("--row", default=None, help=f"b,s_q,h (--ncu: {NCU_ROW}, --host / --launch: {HOST_ROW})")
    ap.add_argument("--v4-row", default=None, metavar="B,H,EXTRA",
                    help="--ncu: one V4 row of bench_sparse_decode --v4 instead of a V3.2 row")
    ap.add_argument("--masked", type=float, default=0.2, help="--ncu")
    ap.add_argument("--topk", type=int, default=None, help="--ncu: the row's top-k (2048); --timeline: only its cases")
    ap.add_argument("--variant", default="default", help="--ncu, --timeline: a benchmarks.variants name")
    ap.add_argument("--lib", choices=("cute", "flashmla"), default="cute", help="--ncu-prefill: whose call")
    ap.add_argument("--calls", type=int, default=400, help="--host, --launch")
    ap.add_argument("--heads", default="64", help="--timeline: h_q values, e.g. 64,128")
    ap.add_argument("--s-q", type=int, default=1, help="--timeline: query tokens of the one request (small)")
    ap.add_argument("--replays", type=int, default=None, help="--timeline (10), --spans (5)")
    ap.add_argument("--variants", default="default", help="--spans: kernel variants fitted on the same inputs")
    args = ap.parse_args()
    if args.launch:
        return launch_parts(args)
    if args.v4:
        return per_kernel_v4(v4_parse_rows(args.v4))
    if args.ncu:
        return ncu_one_call(args)
    if args.ncu_prefill:
        return ncu_one_prefill_call(args)
    if args.host:
        return host_parts(args)
    if args.timeline:
        return timeline(args)
    if args.spans:
        return spans(args)
    if args.layers < 1:
        raise SystemExit(f"--layers: got {args.layers}, accepted: >= 1")
    return per_kernel(parse_rows(args.rows) if args.rows else ROWS, args.layers)


if __name__ == "__main__":
    main()
