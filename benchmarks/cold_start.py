"""Cold start of a new process: ``import cute_mla`` and the first call of each kernel variant,
with an empty compile cache (every kernel compiles) and with one that ``cute-mla warmup`` filled in
another process beforehand (every kernel loads).

Each measurement runs in a fresh interpreter (``--child``), so nothing of an earlier phase is in
memory: what an engine's new worker pays. A first call is timed from the call to the end of a
``torch.cuda.synchronize()`` (plan, schedule, compile or load, launch and run); the second call of
the same row is printed beside it as the warm floor.

    python -m benchmarks.cold_start [--out results/X.json] [--jobs 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# (name, b, s_q, h_q, topk, d_qk, extra_topk, with topk_length, with sink): the rows and a V4 row
ROWS = [
    ("1x1x64", 1, 1, 64, 2048, 576, 0, False, False),
    ("1x8x128", 1, 8, 128, 2048, 576, 0, False, False),
    ("1x1024x64", 1, 1024, 64, 2048, 576, 0, False, False),
    ("128x2x128", 128, 2, 128, 2048, 576, 0, False, False),
    ("v4 32x1x128 extra512", 32, 1, 128, 128, 512, 512, True, True),
]


def child() -> dict:
    t0 = time.perf_counter()
    import torch

    torch.cuda.init()
    t1 = time.perf_counter()
    import cute_mla
    from cute_mla.testing import make_inputs

    t2 = time.perf_counter()
    res = dict(import_torch_s=t1 - t0, import_cute_mla_s=t2 - t1, rows=[])
    for name, b, s_q, h_q, topk, d_qk, extra_topk, lengths, sink in ROWS:
        x = make_inputs(b, s_q, h_q, topk, num_tokens=8192, d_qk=d_qk, extra_topk=extra_topk, with_topk_length=lengths,
                        with_extra_topk_length=lengths and bool(extra_topk), with_sink=sink, device="cuda")
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            sched, _ = cute_mla.get_mla_metadata()
            cute_mla.flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, **x.call_kwargs())
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        res["rows"].append(dict(row=name, variant=sched.plan.variant, first_s=times[0], second_s=times[1]))
    return res


def run_child(cache_dir: str) -> dict:
    env = dict(os.environ, CUTE_MLA_CACHE_DIR=cache_dir)
    p = subprocess.run([sys.executable, "-m", "benchmarks.cold_start", "--child"], env=env, capture_output=True,
                       text=True, check=False)
    if p.returncode:
        raise SystemExit(f"cold_start: the child process failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="cute-mla warmup's processes")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child()))
        return 0
    import torch

    from benchmarks.bench_sparse_decode import commit_id
    from cute_mla.archs import device_arch

    arch = device_arch(torch.device("cuda"))
    with tempfile.TemporaryDirectory() as cold_dir, tempfile.TemporaryDirectory() as warm_dir:
        cold = run_child(cold_dir)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "cute_mla.cli", "warmup", "--arch", arch, "--jobs", str(args.jobs)],
                       env=dict(os.environ, CUTE_MLA_CACHE_DIR=warm_dir), check=True, capture_output=True)
        warmup_s = time.perf_counter() - t
        warm = run_child(warm_dir)
    commit = commit_id()
    print(f"{torch.cuda.get_device_name()}  commit {commit}  "
          f"cute-mla warmup --arch {arch} --jobs {args.jobs}: {warmup_s:.1f} s")
    print(f"{'':24} {'cold cache':>12} {'after warmup':>13}")
    print(f"{'import torch + CUDA init':24} {cold['import_torch_s']:>11.2f}s {warm['import_torch_s']:>12.2f}s")
    print(f"{'import cute_mla':24} {cold['import_cute_mla_s']:>11.2f}s {warm['import_cute_mla_s']:>12.2f}s")
    for c, w in zip(cold["rows"], warm["rows"]):
        print(f"{'first call ' + c['row']:24} {c['first_s']:>11.2f}s {w['first_s']:>12.3f}s   "
              f"(second call {w['second_s'] * 1e3:.2f} ms; {c['variant']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), commit=commit, arch=arch,
                           warmup_s=warmup_s, jobs=args.jobs, cold=cold, after_warmup=warm), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
