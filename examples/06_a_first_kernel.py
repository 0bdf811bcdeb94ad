"""A first CuTe DSL kernel: gather 64 rows of a V3.2 FP8 cache, dequantize them, one wgmma QK tile.

The smallest piece of a sparse MLA decode kernel, written to be read and then grown, not for
speed (the production kernel, ``cute_mla/kernels/sm90``, does the same steps with a pipelined
producer warp group, TMA, and two MMA warp groups). One CTA of one warp group (128 threads):

1. copies q (64 heads x 576 dims, bf16) into shared memory;
2. gathers the 64 cache rows that ``indices`` names (656 bytes each: 512 e4m3 NoPE values, 4 fp32
   scales, 64 bf16 RoPE values), dequantizes the NoPE part to bf16 and writes the 64 x 576 key
   tile into shared memory;
3. runs S = Q K^T (64 x 64, fp32) as 36 chained wgmma 64x64x16 and writes S to global memory.

The script checks S against torch, ``q.float() @ K[indices].T`` with K the dequantized cache
rounded to bf16 (as the MMA sees it): max abs error at most 1e-3, else exit status 1.

    python examples/06_a_first_kernel.py --compile-only   # any machine: compile for sm_90a, print resources
    python examples/06_a_first_kernel.py                  # an H100/H200: compile, run, check

Where to grow it from here: load q by TMA; gather with 16-byte loads and 4 threads per row (the
production producer); skip invalid (-1) indices and mask their scores; add the online softmax and
the P V wgmma; then pipeline the gather of the next tile under the MMAs of this one.

Needs: GPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint8
from cutlass.cute.nvgpu import warpgroup

from cute_mla.archs import SM90
from cute_mla.dsl.compat import LayoutEnum, OperandMajorMode, SmemAllocator, sm90_utils
from cute_mla.dsl.compile import compile_options
from cute_mla.formats import V32
from cute_mla.playground import require_gpu

# ---------------------------------------------------------------------------------------- constants
# The cache row's layout is the format's (cute_mla/formats/v32.py); the tile shape is one wgmma's.
HEADS = 64                 # M of the wgmma: one warp group's MMA covers 64 rows
TOKENS = 64                # N: the 64 gathered keys
D_QK, D_NOPE, D_ROPE = V32.d_qk, V32.d_nope, V32.d_rope      # 576 = 512 + 64
THREADS = 128              # one warp group: wgmma is issued by 4 warps together
MMA_K = 16                 # K of one bf16 wgmma: S takes D_QK / 16 = 36 of them
NOPE_CHUNK = 16            # e4m3 values a thread dequantizes at a time (16 bytes of the row)
BF16_CHUNK = 8             # bf16 values copied at a time (16 bytes)
TOLERANCE = 1e-3           # max |S - torch| (fp32 sums of 576 products, in a different order)


# ------------------------------------------------------------------------------------------- kernel
class FirstKernel:
    """``cute.compile`` takes an object with a ``@cute.jit`` host method (runs at compile time on
    the host: builds layouts and MMA objects, launches) and a ``@cute.kernel`` device method."""

    @cute.jit
    def __call__(self, q: cute.Tensor, cache: cute.Tensor, indices: cute.Tensor, scores: cute.Tensor, stream):
        # The MMA: bf16 x bf16 -> fp32, both operands K-major (dims contiguous), tile 64 x 64.
        mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K,
                                                Float32, (1, 1, 1), (HEADS, TOKENS))
        # Shared-memory layouts wgmma can read: 128-byte swizzled rows (a 64-dim row of bf16 is
        # 128 B; the swizzle permutes its 16-B pieces by row so that 8 rows hit 8 different
        # bank groups). The helpers pick the swizzle; the last argument is the stage count.
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (HEADS, TOKENS, D_QK), BFloat16, 1)
        k_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (HEADS, TOKENS, D_QK), BFloat16, 1)
        self.kernel(mma, q, cache, indices, scores, q_layout, k_layout).launch(
            grid=(1, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mma: cute.TiledMma, mQ: cute.Tensor, mCache: cute.Tensor, mIdx: cute.Tensor,
               mS: cute.Tensor, q_layout: cute.ComposedLayout, k_layout: cute.ComposedLayout):
        tid, _, _ = cute.arch.thread_idx()

        # Shared memory: a swizzled layout is (swizzle o offset o plain layout); the allocator
        # takes the plain part and the swizzle. [None, None, 0]: drop the stage mode.
        smem = SmemAllocator()
        sQ = smem.allocate_tensor(BFloat16, q_layout.outer, 1024, swizzle=q_layout.inner)[None, None, 0]
        sK = smem.allocate_tensor(BFloat16, k_layout.outer, 1024, swizzle=k_layout.inner)[None, None, 0]

        # Step 1: q -> shared memory, 8 bf16 (16 B) per copy, the 128 threads striding over the
        # 64 x 72 chunks. local_tile(t, (1, n), (r, c)) is the n-element chunk c of row r; the
        # swizzle keeps every 16-B piece contiguous, so a chunk of 8 stays one vector.
        q_chunks = D_QK // BF16_CHUNK
        for i in cutlass.range(tid, HEADS * q_chunks, THREADS):
            h, c = i // q_chunks, i % q_chunks
            chunk(sQ, h, c, BF16_CHUNK).store(chunk(mQ, h, c, BF16_CHUNK).load())

        # Step 2: the gather. The cache is a (tokens, 656) byte matrix; its three parts are the
        # same bytes seen as other element types (recast_tensor: 656 B = 656 e4m3 = 164 fp32 = 328
        # bf16 per row), so each part is plain indexing at the format's offsets.
        nope = cute.recast_tensor(mCache, Float8E4M3FN)
        scales = cute.recast_tensor(mCache, Float32)
        rope = cute.recast_tensor(mCache, BFloat16)
        nope_chunks = D_NOPE // NOPE_CHUNK                       # 32 per row
        per_scale = V32.group_size // NOPE_CHUNK                 # 8 chunks share one scale
        for i in cutlass.range(tid, TOKENS * nope_chunks, THREADS):
            t, c = i // nope_chunks, i % nope_chunks
            row = mIdx[t]                                        # the token this key comes from
            scale = scales[row, V32.scale_offset // 4 + c // per_scale]
            # TensorSSA math: 16 e4m3 -> fp32, times the scale, rounded once to bf16 (the
            # reference's bf16(float(fp8) * scale), bit for bit).
            keys = chunk(nope, row, c, NOPE_CHUNK).load().to(Float32) * scale
            chunk(sK, t, c, NOPE_CHUNK).store(keys.to(BFloat16))
        rope_chunks = D_ROPE // BF16_CHUNK                       # 8 per row, copied as they are
        for i in cutlass.range(tid, TOKENS * rope_chunks, THREADS):
            t, c = i // rope_chunks, i % rope_chunks
            src = chunk(rope, mIdx[t], V32.rope_offset // (2 * BF16_CHUNK) + c, BF16_CHUNK)
            chunk(sK, t, D_NOPE // BF16_CHUNK + c, BF16_CHUNK).store(src.load())

        # The tile was written by ordinary stores (the "generic proxy"); wgmma reads shared
        # memory through the "async proxy". Each thread fences its own writes over to it, then
        # the barrier makes every thread's writes complete before any thread issues the MMA.
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

        # Step 3: S = Q K^T. The tiled MMA tells each thread which part of the operands and of
        # the accumulator is its own; the A / B "fragments" of shared-memory operands are wgmma
        # descriptors (no data moves to registers), the C fragment is this thread's 32 fp32 of S.
        thr = mma.get_slice(tid)
        tSrQ = thr.make_fragment_A(thr.partition_A(sQ))          # (mma, m, k blocks of 16)
        tSrK = thr.make_fragment_B(thr.partition_B(sK))          # (mma, n, k blocks of 16)
        acc = thr.make_fragment_C(thr.partition_shape_C((HEADS, TOKENS)))
        acc.fill(0.0)
        mma.set(warpgroup.Field.ACCUMULATE, True)                # every wgmma adds to acc
        warpgroup.fence()                                        # acc's registers are ready for wgmma
        for k in cutlass.range_constexpr(D_QK // MMA_K):         # unrolled at trace time: 36 wgmma
            cute.gemm(mma, acc, tSrQ[None, None, k], tSrK[None, None, k], acc)
        warpgroup.commit_group()                                 # wgmma is asynchronous:
        warpgroup.wait_group(0)                                  # wait for the whole chain

        # Each thread stores its part of S (the same partition as its accumulator).
        cute.autovec_copy(acc, thr.partition_C(mS))


@cute.jit
def chunk(t: cute.Tensor, r, c, n: cutlass.Constexpr):
    """Chunk ``c`` (``n`` elements) of row ``r`` of the 2-D tensor ``t``."""
    return cute.local_tile(t, (1, n), (r, c))


# ---------------------------------------------------------------------------------------- compile
def compile_kernel(dump_dir: str):
    """Compile for sm_90a against fake tensors (shapes and strides, no data: no GPU needed). The
    cache's token count is symbolic, so one compile serves any cache; its rows are 656 B apart
    and 16-B aligned, which lets the compiler use 16-B loads."""
    rt = cute.runtime
    q = rt.make_fake_compact_tensor(BFloat16, (HEADS, D_QK), stride_order=(1, 0), assumed_align=16)
    cache = rt.make_fake_tensor(Uint8, (cute.sym_int(), V32.row_bytes), stride=(V32.row_bytes, 1), assumed_align=16)
    indices = rt.make_fake_compact_tensor(Int32, (TOKENS,), assumed_align=4)
    scores = rt.make_fake_compact_tensor(Float32, (HEADS, TOKENS), stride_order=(1, 0), assumed_align=16)
    # --enable-tvm-ffi (in compile_options): the compiled function takes torch tensors and runs
    # on torch's current stream, which the fake stream stands for.
    stream = rt.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(FirstKernel(), q, cache, indices, scores, stream,
                        options=compile_options(SM90.name, dump_dir))


def report(dump_dir: str) -> None:
    """Registers and shared memory of the compiled kernel, read from its cubin."""
    from cute_mla.playground.inspect import find_artifacts, resource_usage

    ptx, cubin = find_artifacts(dump_dir, SM90.name)
    try:
        if ptx is None or cubin is None:
            raise FileNotFoundError(f"no PTX / cubin in {dump_dir}")
        res = resource_usage(cubin)
    except (FileNotFoundError, ValueError) as e:
        print(f"compiled for {SM90.name}; no resource report ({e})")
        return
    with open(ptx) as f:
        wgmma = f.read().count("wgmma.mma_async")
    tiles = (HEADS + TOKENS) * D_QK * 2      # the q and K tiles (bf16), allocated at launch
    print(f"compiled for {SM90.name}: {res.get('REG')} registers per thread, shared memory {res.get('SHARED', 0)} B static "
          f"+ {tiles} B dynamic (q and K tiles), {wgmma} wgmma.mma_async in the PTX")


# -------------------------------------------------------------------------------------------- run
def run_and_check(fn) -> int:
    import torch

    from cute_mla.formats import dequantize_v32, quantize_v32

    g = torch.Generator().manual_seed(0)
    pool = 4096
    kv = (torch.randn(pool, D_QK, generator=g) / 10).clamp(-1, 1)
    cache = quantize_v32(kv).cuda()       # (pool, 656): the rows of a cache whose page blocks are packed
    q = torch.randn(HEADS, D_QK, generator=g).clamp(-1, 1).to(torch.bfloat16).cuda()
    indices = torch.randperm(pool, generator=g)[:TOKENS].to(torch.int32).cuda()
    scores = torch.full((HEADS, TOKENS), float("nan"), device="cuda")   # NaN shows what the kernel leaves unwritten
    fn(q, cache, indices, scores)
    torch.cuda.synchronize()

    keys = dequantize_v32(cache)[indices.long()].to(torch.bfloat16).float()   # as the MMA sees them
    ref = q.float() @ keys.T
    err = (scores - ref).abs().max().item()
    ok = err <= TOLERANCE          # NaN compares False: an unwritten score fails too
    print(f"S = Q K^T ({HEADS} x {TOKENS}): max abs error {err:.2e} against torch (tolerance {TOLERANCE:g}): "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a and print its resources (no GPU)")
    args = ap.parse_args()
    if not args.compile_only:
        hint = "`python examples/06_a_first_kernel.py --compile-only` compiles it here"
        require_gpu(__file__, hint=hint)
        from cute_mla.archs import device_arch, gpu_summary

        if device_arch("cuda") != SM90.name:     # wgmma is Hopper's; SM100 has tcgen05 instead
            sys.exit(f"06_a_first_kernel.py runs its wgmma on an SM90 GPU only; this one is {gpu_summary()}; {hint}")
    with tempfile.TemporaryDirectory() as dump_dir:
        fn = compile_kernel(dump_dir)
        report(dump_dir)
        return 0 if args.compile_only else run_and_check(fn)


if __name__ == "__main__":
    sys.exit(main())
