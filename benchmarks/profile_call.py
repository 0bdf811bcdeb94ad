"""Where a call's time goes.

Default: per-kernel device time (torch.profiler / CUPTI) of cute-mla and FlashMLA under CUDA-graph
replay, on the latency rows; then the per-call replay time (a graph of ``--layers`` calls) of
cute-mla's whole call, of its decode kernel alone (``Launcher.main``) and of its combine alone
(``Launcher.combine`` on the decode kernel's workspace): the combine's share of the critical path.

``--launch``: the decode kernel's TVM-FFI launch taken apart on ``--row``: the launcher's call,
the compiled function called directly with the same arguments, those arguments through TVM-FFI's
no-op function (the argument conversion alone), and for scale a torch kernel launch
(``Tensor.zero_`` of 4 bytes) and a CUDA event record.

``--v4 ROWS``: the same per-kernel device times on V4 rows of ``bench_v4`` (``"b,h,extra;..."``):
the decode and combine kernels of each library's call, as a decode step's later calls run them
(the metadata object already holds the schedule). cute-mla's combine is launched with PDL, so its
span covers the decode kernel's and the printed sum counts that overlap twice.

``--ncu``: one public-API call of a row (warm-up outside), bracketed by cudaProfilerStart/Stop, for
Nsight Compute (decode kernel and, where the plan splits, the combine)::

    ncu --clock-control none --profile-from-start off --set full --import-source no \\
        -o OUT/rep python3 -m benchmarks.profile_call --ncu --row 1,1024,128 [--variant no_pf]
    ncu --import OUT/rep.ncu-rep --page details --csv        # per-kernel metrics
    ncu --import OUT/rep.ncu-rep --page source --csv --print-source sass   # per-SASS stall samples

``--host``: the eager call's host time, per call over ``--calls`` back-to-back calls (the GPU work
of a small call is shorter than its host work, so the calls do not queue), split into its parts
(the metadata's launcher, ``allocate_workspace``, ``Launcher.main`` / ``combine``), FlashMLA's call
beside it, then a cProfile of the public call. Keep ``--calls`` x 2 launches below the launch
queue's depth (~1000), or the host waits for the GPU.

    python -m benchmarks.profile_call [--rows "1,1,64;1,8,64"] [--layers 16]
    python -m benchmarks.profile_call --v4 "128,128,1024;512,128,1024"
    python -m benchmarks.profile_call --ncu [--row 1,1024,128] [--variant NAME] [--topk 2048] [--masked 0.2]
    python -m benchmarks.profile_call --host [--row 1,1,64] [--calls 400]
    python -m benchmarks.profile_call --launch [--row 1,1,64] [--calls 400]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import cute_mla
from cute_mla.formats import V32
from cute_mla.interface.launcher import allocate_workspace

from benchmarks.bench_sparse_decode import call, capture_graph, flashmla, make_inputs, parse_row, parse_rows, replay_median_us
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
        self.args = (q, cache.view(torch.uint8).squeeze(2), idx, None, None, self.sched.tile_scheduler_metadata,
                     self.sched.accum_offsets, self.out, self.lse, SCALE)
        self.workspace = self.main()         # a workspace the decode kernel wrote, for combine()
        torch.cuda.synchronize()

    @property
    def split(self):
        return self.launcher.plan.split

    def public(self):
        return call(cute_mla, self.sched, self.q, self.cache, self.idx)

    def launch(self):
        self.launcher(*self.args)

    def main(self):
        return self.launcher.main(*self.args)

    def combine(self):
        self.launcher.combine(self.workspace, self.sched.accum_offsets, None, self.out, self.lse,
                              self.sched.tile_scheduler_metadata)

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

    from cute_mla.kernels import DecodeTensors

    b, s_q, h = parse_row(args.row or HOST_ROW)
    q, cache, idx = make_inputs(b, s_q, h, 0.2, torch.Generator(device="cuda").manual_seed(0))
    p = Parts(q, cache, idx)
    launcher = p.launcher
    if launcher.plan.token_walk:
        raise SystemExit("--launch: a row without the token walk (small s_q)")
    o_acc, l_acc = p.workspace
    t = DecodeTensors(q, p.args[1], idx, None, None, p.sched.tile_scheduler_metadata, p.sched.accum_offsets, p.out,
                      p.lse, o_acc, l_acc, None, None, None)
    cfg = launcher.main_cfg
    fn_args = (t.q, t.kv, t.indices, None, None, t.tile_md, t.accum_offsets, t.out, t.lse,
               t.o_accum if cfg.split else None, t.lse_accum if cfg.split else None, None, None, None, None, SCALE)
    nop = tvm_ffi.get_global_func("testing.nop")
    tiny = torch.zeros(1, device="cuda")
    event = torch.cuda.Event()
    parts = {
        "launcher.main_mod.launch_sparse_decode": lambda: launcher.main_mod.launch_sparse_decode(
            launcher.main_compiled, cfg, t, SCALE),
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
    from benchmarks import bench_v4

    fm = flashmla()
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = (bench_v4.make_pool(g), bench_v4.make_pool(g))
    for b, h, extra in rows:
        row = bench_v4.make_row(b, h, extra, 0.0, g)
        for name, mod in (("cute-mla", cute_mla), ("FlashMLA", fm)):
            if mod is None:
                continue
            sched = mod.get_mla_metadata()[0]
            bench_v4.call(mod, sched, row, *pools)
            torch.cuda.synchronize()
            t = kernel_times(capture_graph(lambda: bench_v4.call(mod, sched, row, *pools))[0])
            total = sum(v[0] for v in t.values())
            parts = ", ".join(f"{k} {v[0]:.1f} us x{v[1]}" for k, v in sorted(t.items(), key=lambda kv: -kv[1][0]))
            plan = getattr(sched, "plan", None)
            label = f" ({plan.schedule}/{plan.variant})" if plan is not None else ""
            print(f"V4 b={b} h={h} extra={extra} {name}{label}: kernels {total:.1f} us = {parts}", flush=True)


def ncu_one_call(args):
    b, s_q, h = parse_row(args.row or NCU_ROW)
    tuning, nocomb = variant_of(args.variant)
    if nocomb:
        raise SystemExit("--variant: --ncu profiles a whole call (no +nocomb)")
    q, cache, idx = make_inputs(b, s_q, h, args.masked, torch.Generator(device="cuda").manual_seed(0), topk=args.topk)
    sched = filled(cute_mla, q, cache, idx, tuning)
    for _ in range(2):
        call(cute_mla, sched, q, cache, idx)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call(cute_mla, sched, q, cache, idx)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one call of b={b} s_q={s_q} h={h} top-k {args.topk} masked {args.masked} variant {args.variant}")


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
    from cute_mla.interface.launcher import cache_bytes, on_device_of
    from cute_mla.kernels import DecodeTensors

    sched, q, cache, idx, out, lse = p.sched, p.q, p.cache, p.idx, p.out, p.lse
    b, s_q, h, _ = q.shape
    key = api._tensor_key(q, cache, idx, None, None, None, V32.d_v, None, None, None)
    launcher = p.launcher
    kv = cache_bytes(cache)
    o_acc, l_acc = p.workspace
    walk = (q[0].unsqueeze(1), idx[0].unsqueeze(1), out[0].unsqueeze(1), lse[0].unsqueeze(1)) if launcher.plan.token_walk \
        else (q, idx, out, lse)
    t = DecodeTensors(walk[0], kv, walk[1], None, None, sched.tile_scheduler_metadata, sched.accum_offsets, walk[2],
                      walk[3], o_acc, l_acc, None, None, None)

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
        "DecodeTensors": lambda: DecodeTensors(q, kv, idx, None, None, sched.tile_scheduler_metadata,
                                               sched.accum_offsets, out, lse, o_acc, l_acc, None, None, None),
        "decode launch (compiled fn)": lambda: launcher.main_mod.launch_sparse_decode(launcher.main_compiled,
                                                                                      launcher.main_cfg, t, SCALE),
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=None, help="b,s_q,h;... (default: the latency rows)")
    ap.add_argument("--layers", type=int, default=16, help="calls per graph for the per-call replay times")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--row", default=None, help=f"b,s_q,h (--ncu: {NCU_ROW}, --host: {HOST_ROW})")
    ap.add_argument("--masked", type=float, default=0.2, help="--ncu")
    ap.add_argument("--topk", type=int, default=2048, help="--ncu")
    ap.add_argument("--variant", default="default", help="--ncu: a benchmarks.variants name")
    ap.add_argument("--calls", type=int, default=400, help="--host")
    ap.add_argument("--v4", default=None, help="V4 rows b,h,extra;... (per-kernel device times)")
    ap.add_argument("--launch", action="store_true", help="the decode launch taken apart (module docstring)")
    args = ap.parse_args()
    if args.launch:
        return launch_parts(args)
    if args.v4:
        from benchmarks.bench_v4 import parse_rows as v4_rows

        return per_kernel_v4(v4_rows(args.v4))
    if args.ncu:
        return ncu_one_call(args)
    if args.host:
        return host_parts(args)
    if args.layers < 1:
        raise SystemExit(f"--layers: got {args.layers}, accepted: >= 1")
    return per_kernel(parse_rows(args.rows) if args.rows else ROWS, args.layers)


if __name__ == "__main__":
    main()
