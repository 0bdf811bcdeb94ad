"""How many clusters of C CTAs can be resident at once with the decode kernel's footprint (one CTA
per SM: 384 threads, ~216 KiB of dynamic shared memory)? A design input for an in-kernel split
reduction over a cluster of a token's pieces (NOTES.md, session 2026-12-03 i): the clusters of
one launch must all be resident together, or the launch runs in waves.

Each CTA's thread 0 records its SM id and ``%globaltimer`` at entry, spins ~``--spin-us`` µs,
records the time again. CTAs that start within half a spin of the first one ran in the first
wave; the rest waited for an SM.

    python benchmarks/cluster_probe.py [--grid 128] [--sizes 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream  # noqa: E402
from cutlass.cutlass_dsl import T  # noqa: E402

from cute_mla.kernels.compile import compile_cached, compile_options  # noqa: E402

THREADS = 384
SMEM = 216 * 1024


def _special_u32(name: str) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [], f"mov.u32 $0, %{name};", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _globaltimer() -> Int64:
    return Int64(llvm.inline_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


class ResidencyKernel:
    """Three words of ``out`` per CTA: SM id, entry ns, exit ns."""

    def __init__(self, grid: int, cluster: int, spin_ns: int):
        self.grid, self.cluster, self.spin_ns = grid, cluster, spin_ns

    @cute.jit
    def __call__(self, out: cute.Tensor, stream):
        self.kernel(out).launch(grid=[self.grid, 1, 1], block=[THREADS, 1, 1], cluster=[self.cluster, 1, 1],
                                smem=SMEM, stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if tidx == 0:
            t0 = _globaltimer()
            out[bidx * 3] = Int64(_special_u32("smid"))
            out[bidx * 3 + 1] = t0
            t = t0
            while t - t0 < Int64(self.spin_ns):
                t = _globaltimer()
            out[bidx * 3 + 2] = t


def compile_probe(grid: int, cluster: int, spin_ns: int):
    fake = make_fake_compact_tensor(Int64, (grid * 3,), assumed_align=8)
    return compile_cached(("cluster_probe", grid, cluster, spin_ns), lambda _: cute.compile(
        ResidencyKernel(grid, cluster, spin_ns), fake, make_fake_stream(use_tvm_ffi_env_stream=True),
        options=compile_options("sm_90a"))).fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", type=int, default=128)
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--spin-us", type=float, default=30.0)
    args = ap.parse_args()
    spin_ns = int(args.spin_us * 1000)
    print(f"{torch.cuda.get_device_name()}  {torch.cuda.get_device_properties(0).multi_processor_count} SMs; "
          f"grid {args.grid} CTAs x {THREADS} threads, {SMEM // 1024} KiB smem each, spin {args.spin_us} us")
    print(f"{'cluster':>8} | {'first wave CTAs':>15} | {'clusters in it':>14} | {'span us':>8} | distinct SMs")
    for c in (int(x) for x in args.sizes.split(",")):
        if args.grid % c:
            print(f"{c:>8} | grid not a multiple of the cluster size")
            continue
        out = torch.zeros(args.grid * 3, dtype=torch.int64, device="cuda")
        try:
            fn = compile_probe(args.grid, c, spin_ns)
            fn(out)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"{c:>8} | launch failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        r = out.cpu().view(-1, 3)
        start = r[:, 1] - r[:, 1].min()
        first = int((start < spin_ns // 2).sum())
        span = (r[:, 2].max() - r[:, 1].min()).item() / 1e3
        print(f"{c:>8} | {first:>15} | {first // c:>14} | {span:8.1f} | {len(set(r[:, 0].tolist()))}", flush=True)


if __name__ == "__main__":
    main()
