"""What an empty launch costs: CUPTI device time of an empty CuTe kernel in the decode kernel's
launch shapes (grid, threads, dynamic shared memory), next to the decode kernel's own skeleton
(top-k 64, every index masked: no gather, no MMA). If the empty kernel in the decode kernel's shape
is as slow as the skeleton, the time is the launch; if not, it is in the skeleton's code path.

    python benchmarks/skeleton_probe.py
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream  # noqa: E402

from cute_mla.kernels.compile import compile_cached, compile_options  # noqa: E402
from bench_sparse_decode import capture_graph  # noqa: E402
from profile_small import kernel_times  # noqa: E402

# (name, grid CTAs, threads per CTA, dynamic shared memory bytes)
SHAPES = [
    ("1 CTA x 128, no smem", 1, 128, 0),
    ("132 CTAs x 384, no smem", 132, 384, 0),
    ("132 CTAs x 384, 200 KiB smem", 132, 384, 200 * 1024),
    ("132 CTAs x 384, 227 KiB smem", 132, 384, 227 * 1024),
]


class EmptyKernel:
    def __init__(self, grid: int, threads: int, smem: int):
        self.grid, self.threads, self.smem = grid, threads, smem

    @cute.jit
    def __call__(self, flag: cute.Tensor, stream):
        self.kernel(flag).launch(grid=[self.grid, 1, 1], block=[self.threads, 1, 1], smem=self.smem, stream=stream)

    @cute.kernel
    def kernel(self, flag: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if tidx == 0:
            if bidx == 0:
                flag[0] = flag[0] + Int32(1)


def compile_empty(grid: int, threads: int, smem: int):
    fake = make_fake_compact_tensor(Int32, (1,), assumed_align=4)
    return compile_cached(("skeleton_probe", grid, threads, smem), lambda _: cute.compile(
        EmptyKernel(grid, threads, smem), fake, make_fake_stream(use_tvm_ffi_env_stream=True),
        options=compile_options("sm_90a"))).fn


def main():
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}  CUPTI device time per launch (mean of 20 graph replays)")
    for name, grid, threads, smem in SHAPES:
        fn = compile_empty(grid, threads, smem)
        t = kernel_times(capture_graph(lambda: fn(flag))[0])
        print(f"  empty kernel, {name:<30} {sum(v[0] for v in t.values()):6.2f} us")


if __name__ == "__main__":
    main()
