"""The QK tile product on bf16 wgmma against e4m3 wgmma, every SM busy (issue 23's first GPU number).

Each CTA (one per SM, shared memory padded so that no second CTA fits) holds a 64-head x 512-dim
Q tile and a 64-token x 512-dim K tile in shared memory, K-major with the 128-B swizzle, as the
decode kernel's K buffers are, and computes S = Q K^T (64 x 64, fp32) ``iters`` times. One
iteration is the NoPE part of one K tile's QK in the production kernel: S zeroed, the chain
issued, committed and waited for (the softmax needs S in registers), so each iteration pays one
chain drain, as the kernel does per tile. Variants:

- ``bf16``: 32 chained wgmma 64x64x16 (today's kernel, whose V3.2 chain adds 4 for the RoPE dims);
- ``fp8``: 16 chained wgmma 64x64x32 on e4m3 operands, one accumulator: the ceiling, which only a
  cache with one scale per token (not V3.2's four) could use;
- ``fp8-grouped``: what V3.2's four scales per token force. Each 128-dim group is a chain of 4
  wgmma 64x64x32 into its own accumulator (two, alternating); while group g runs, group g-1 is
  waited for and folded into S with its per-token scale (read from shared memory) times q's scale:
  S += acc * k_scale[g, token] * q_scale. 32 more fp32 registers than ``fp8`` (a second
  accumulator, and S apart from it), one drain per group.

``--wgs 2`` runs two warp groups per CTA on the same tiles (two chains in flight per SM, as a GEMM's
consumers would; the decode kernel issues QK from one warp group). Reported per variant: µs per
iteration per CTA, TFLOP/s over all CTAs (2 x 64 x 64 x 512 per iteration and warp group) and the
ratio to ``bf16``; with ``--ceilings`` also torch's 8192^3 bf16 matmul and e4m3 ``_scaled_mm`` in
the same run. Correctness first: each variant's S after one call is checked against torch (the
fp32 product of the same bf16 / e4m3 values) before it is timed.

    python -m benchmarks.fp8_mma_probe --compile-only      # any machine: compile for sm_90a, registers, wgmma in PTX/SASS
    python -m benchmarks.fp8_mma_probe --ceilings          # an H100/H200: check, time (~30 s with the compiles)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Tuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint8
from cutlass.cute.nvgpu import warpgroup

from cute_mla.archs import SM90, device_num_sms
from cute_mla.dsl.compat import LayoutEnum, OperandMajorMode, SmemAllocator, sm90_utils
from cute_mla.dsl.compile import compile_options
from cute_mla.formats import V32

# ---------------------------------------------------------------------------------------- constants
HEADS = 64                   # M: one warp group's wgmma rows (a CTA's heads in the decode kernel)
TOKENS = 64                  # N: one K tile
DIMS = V32.d_nope            # 512: the part of d_qk that is e4m3 in the cache
GROUP = V32.group_size       # 128 dims share a cache scale
GROUPS = DIMS // GROUP       # 4
THREADS_PER_WG = 128
K_BUFS = 2                   # the decode kernel's K buffers: the scales are read from one per iteration
VEC_BYTES = 16               # the tile copy into shared memory moves 16 B at a time
CTA_SMEM_BYTES = 160 * 1024  # every variant pads its shared memory to this: one CTA per SM
VARIANTS: Tuple[str, ...] = ("bf16", "fp8", "fp8-grouped")


@dataclass(frozen=True)
class ProbeConfig:
    """One compiled variant: ``variant`` (see the module docstring) and warp groups per CTA."""

    variant: str
    wgs: int = 1

    def __post_init__(self):
        if self.variant not in VARIANTS or self.wgs not in (1, 2):
            raise ValueError(f"ProbeConfig: variant one of {VARIANTS}, wgs 1 or 2; got {self}")

    @property
    def fp8(self) -> bool:
        return self.variant != "bf16"

    @property
    def dtype(self):
        return Float8E4M3FN if self.fp8 else BFloat16

    @property
    def elem_bytes(self) -> int:
        return 1 if self.fp8 else 2

    @property
    def mma_k(self) -> int:  # K of one wgmma: 32 bytes of each operand row either way
        return 32 if self.fp8 else 16

    @property
    def pad_bytes(self) -> int:
        tiles = (HEADS + TOKENS) * DIMS * self.elem_bytes
        return CTA_SMEM_BYTES - tiles - K_BUFS * GROUPS * TOKENS * 4


def flops_per_iteration(cfg: ProbeConfig) -> int:
    return 2 * HEADS * TOKENS * DIMS * cfg.wgs


# ------------------------------------------------------------------------------------------- kernel
class QkProbe:
    def __init__(self, cfg: ProbeConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, k_scale: cute.Tensor, s_out: cute.Tensor, iters: Int32,
                 q_scale: Float32, ctas: Int32, stream):
        dt = self.cfg.dtype
        # Both operands K-major: the only form e4m3 wgmma accepts (MmaF8Op), and the decode kernel's
        # form for QK in bf16 as well.
        mma = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
                                                (HEADS, TOKENS))
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (HEADS, TOKENS, DIMS), dt, 1)
        k_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (HEADS, TOKENS, DIMS), dt, 1)
        self.kernel(mma, q, k, k_scale, s_out, iters, q_scale, q_layout, k_layout).launch(
            grid=(ctas, 1, 1), block=(THREADS_PER_WG * self.cfg.wgs, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mma: cute.TiledMma, mQ: cute.Tensor, mK: cute.Tensor, mScale: cute.Tensor, mS: cute.Tensor,
               iters: Int32, q_scale: Float32, q_layout: cute.ComposedLayout, k_layout: cute.ComposedLayout):
        cfg = self.cfg
        dt = cfg.dtype
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        wtid = tid % THREADS_PER_WG
        threads = THREADS_PER_WG * cfg.wgs

        smem = SmemAllocator()
        sQ = smem.allocate_tensor(dt, q_layout.outer, 1024, swizzle=q_layout.inner)[None, None, 0]
        sK = smem.allocate_tensor(dt, k_layout.outer, 1024, swizzle=k_layout.inner)[None, None, 0]
        # The scales of both K buffers (the same values twice): read per iteration from buffer
        # it % 2, as the kernel reads each tile's, so the compiler cannot keep them in registers.
        sScale = smem.allocate_tensor(Float32, cute.make_layout((K_BUFS, GROUPS, TOKENS),
                                                                stride=(GROUPS * TOKENS, TOKENS, 1)), 16)
        smem.allocate_tensor(Uint8, cute.make_layout(cfg.pad_bytes), 16)   # never touched: one CTA per SM

        # The tiles arrive as bytes (uint8 in torch, whatever the element type) and are copied into
        # the swizzled layouts 16 B at a time; the swizzle keeps each 16-B piece contiguous.
        vec = VEC_BYTES // cfg.elem_bytes
        chunks = DIMS // vec
        gQ = cute.recast_tensor(mQ, dt)
        gK = cute.recast_tensor(mK, dt)
        for i in cutlass.range(tid, HEADS * chunks, threads):
            chunk(sQ, i // chunks, i % chunks, vec).store(chunk(gQ, i // chunks, i % chunks, vec).load())
        for i in cutlass.range(tid, TOKENS * chunks, threads):
            chunk(sK, i // chunks, i % chunks, vec).store(chunk(gK, i // chunks, i % chunks, vec).load())
        for i in cutlass.range(tid, K_BUFS * GROUPS * TOKENS, threads):
            j = i % (GROUPS * TOKENS)
            sScale[i // (GROUPS * TOKENS), j // TOKENS, j % TOKENS] = mScale[j // TOKENS, j % TOKENS]
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

        thr = mma.get_slice(wtid)
        tSrQ = thr.make_fragment_A(thr.partition_A(sQ))          # (mma, m, k blocks)
        tSrK = thr.make_fragment_B(thr.partition_B(sK))          # (mma, n, k blocks)
        acc = thr.make_fragment_C(thr.partition_shape_C((HEADS, TOKENS)))
        mma.set(warpgroup.Field.ACCUMULATE, True)
        if cutlass.const_expr(cfg.variant == "fp8-grouped"):
            acc_b = thr.make_fragment_C(thr.partition_shape_C((HEADS, TOKENS)))
            s_tot = thr.make_fragment_C(thr.partition_shape_C((HEADS, TOKENS)))
            tScS = thr.partition_C(cute.make_identity_tensor((HEADS, TOKENS)))   # (head, token) of each value
            steps = GROUP // cfg.mma_k                                           # 4 wgmma per group
            for it in cutlass.range(iters, unroll=1):
                sScale_b = sScale[it % K_BUFS, None, None]
                s_tot.fill(0.0)
                for g in cutlass.range_constexpr(GROUPS):
                    cur = acc if g % 2 == 0 else acc_b
                    cur.fill(0.0)
                    warpgroup.fence()
                    for k in cutlass.range_constexpr(steps):
                        cute.gemm(mma, cur, tSrQ[None, None, g * steps + k], tSrK[None, None, g * steps + k], cur)
                    warpgroup.commit_group()
                    if cutlass.const_expr(g > 0):
                        warpgroup.wait_group(1)                          # group g-1 done, g in flight
                        fold_group(s_tot, acc_b if g % 2 == 0 else acc, tScS, sScale_b, g - 1, q_scale)
                warpgroup.wait_group(0)
                fold_group(s_tot, acc if (GROUPS - 1) % 2 == 0 else acc_b, tScS, sScale_b, GROUPS - 1, q_scale)
            result = s_tot
        else:
            for _ in cutlass.range(iters, unroll=1):
                acc.fill(0.0)
                warpgroup.fence()
                for k in cutlass.range_constexpr(DIMS // cfg.mma_k):
                    cute.gemm(mma, acc, tSrQ[None, None, k], tSrK[None, None, k], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
            result = acc
        # CTA 0's first warp group stores S (the check reads it; a store keeps the work observable).
        if bid == 0 and tid < THREADS_PER_WG:
            cute.autovec_copy(result, thr.partition_C(mS))


@cute.jit
def fold_group(s_tot: cute.Tensor, acc: cute.Tensor, tScS: cute.Tensor, sScale: cute.Tensor, g: cutlass.Constexpr,
               q_scale: Float32):
    """S += acc * k_scale[g, token] * q_scale over this thread's accumulator values."""
    for v in cutlass.range_constexpr(cute.size(acc)):
        s_tot[v] = s_tot[v] + acc[v] * (sScale[g, tScS[v][1]] * q_scale)


@cute.jit
def chunk(t: cute.Tensor, r, c, n: cutlass.Constexpr):
    """Chunk ``c`` (``n`` elements) of row ``r`` of the 2-D tensor ``t``."""
    return cute.local_tile(t, (1, n), (r, c))


# ---------------------------------------------------------------------------------------- compile
def compile_probe(cfg: ProbeConfig, dump_dir=None):
    """Compile for sm_90a against fake tensors (no GPU needed)."""
    rt = cute.runtime
    row_bytes = DIMS * cfg.elem_bytes
    q = rt.make_fake_compact_tensor(Uint8, (HEADS, row_bytes), stride_order=(1, 0), assumed_align=16)
    k = rt.make_fake_compact_tensor(Uint8, (TOKENS, row_bytes), stride_order=(1, 0), assumed_align=16)
    k_scale = rt.make_fake_compact_tensor(Float32, (GROUPS, TOKENS), stride_order=(1, 0), assumed_align=16)
    s_out = rt.make_fake_compact_tensor(Float32, (HEADS, TOKENS), stride_order=(1, 0), assumed_align=16)
    stream = rt.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(QkProbe(cfg), q, k, k_scale, s_out, Int32(1), Float32(1.0), Int32(1), stream,
                        options=compile_options(SM90.name, dump_dir))


def compile_report(cfg: ProbeConfig) -> dict:
    """Compile ``cfg`` into a temporary dump directory: registers, shared memory, wgmma in PTX and SASS."""
    from cute_mla.playground.inspect import find_artifacts, local_memory_ops, resource_usage, sass

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        compile_probe(cfg, d)
        took = time.perf_counter() - t0
        ptx, cubin = find_artifacts(d, SM90.name)
        with open(ptx) as f:
            ptx_text = f.read()
        wg_lines = [ln.strip() for ln in ptx_text.splitlines() if "wgmma.mma_async" in ln]
        rep = dict(variant=cfg.variant, wgs=cfg.wgs, compile_s=round(took, 2), ptx_wgmma=len(wg_lines),
                   ptx_wgmma_form=wg_lines[0].split()[0] if wg_lines else None)
        try:
            res = resource_usage(cubin)
            text = sass(cubin)
            # HGMMA is the 16-bit wgmma in SASS, QGMMA the 8-bit one; gsb0 marks an instruction the
            # warp group waits on (one per chain when clean, every one when ptxas serialized them).
            gmma = [ln for ln in text.splitlines() if re.search(r"\b[HQ]GMMA\.", ln)]
            rep.update(registers=res.get("REG"), stack=res.get("STACK", 0), sass_gmma=len(gmma),
                       sass_gmma_gsb0=sum("gsb0" in ln for ln in gmma),
                       sass_gmma_form=re.search(r"[HQ]GMMA\.\S+", gmma[0]).group(0) if gmma else None,
                       local_memory_ops=local_memory_ops(text), lds=len(re.findall(r"\bLDS\b", text)),
                       ffma=len(re.findall(r"\bFFMA\b", text)))
        except (FileNotFoundError, ValueError) as e:
            rep["sass"] = f"unavailable ({e})"
    return rep


# -------------------------------------------------------------------------------------------- run
def tiles(cfg: ProbeConfig, gen):
    """Random Q and K tiles (bytes) of the variant's element type and unit K scales; FP8 values from
    N(0,1) rounded to e4m3, bf16 from N(0,1) (realistic bit patterns: the tensor cores' power depends
    on the data, and the card runs at its power cap)."""
    import torch

    dtype = torch.float8_e4m3fn if cfg.fp8 else torch.bfloat16
    q = torch.randn(HEADS, DIMS, generator=gen).to(dtype)
    k = torch.randn(TOKENS, DIMS, generator=gen).to(dtype)
    return q, k


def check(fn, cfg: ProbeConfig) -> float:
    """Max |S - exact| relative to max |S| after one iteration and after three (the same S), the
    exact S being the float64 product of the same bf16 / e4m3 values. For e4m3 this measures the
    tensor core's FP8 accumulation (reported to keep ~14 significant bits on Hopper)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    q, k = tiles(cfg, gen)
    scale = torch.ones(GROUPS, TOKENS, device="cuda")
    ref = (q.double() @ k.double().T).float()
    worst = 0.0
    for iters in (1, 3):
        s = torch.full((HEADS, TOKENS), float("nan"), device="cuda")
        fn(q.view(torch.uint8).cuda(), k.view(torch.uint8).cuda(), scale, s, iters, 1.0, 1)
        torch.cuda.synchronize()
        worst = max(worst, ((s.cpu() - ref).abs().max() / ref.abs().max()).item())   # NaN propagates
    return worst


def time_variant(fn, cfg: ProbeConfig, ctas: int, iters: int, reps: int = 5) -> float:
    """Median µs of one call of ``iters`` iterations on ``ctas`` CTAs (CUDA events)."""
    import torch

    from cute_mla.testing import median_event_us

    gen = torch.Generator().manual_seed(2)
    q, k = (t.view(torch.uint8).cuda() for t in tiles(cfg, gen))
    scale = torch.ones(GROUPS, TOKENS, device="cuda")
    s = torch.empty(HEADS, TOKENS, device="cuda")
    return median_event_us(lambda: fn(q, k, scale, s, iters, 1.0, ctas), iters=reps, warmup=1)


def ceilings() -> dict:
    """torch's 8192^3 bf16 matmul and e4m3 _scaled_mm (bf16 out), TFLOP/s, in this run."""
    import torch

    n = 8192
    out = {}
    a = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda").to(torch.bfloat16)

    def tf(fn):
        fn()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            fn()
        e1.record()
        torch.cuda.synchronize()
        return round(2 * n ** 3 * 10 / (e0.elapsed_time(e1) * 1e-3) / 1e12, 1)

    out["torch_bf16_matmul_tflops"] = tf(lambda: a @ b)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).T.contiguous().T
    one = torch.ones((), device="cuda")
    for fast in (False, True):
        try:
            out[f"torch_scaled_mm_e4m3_fast_accum_{fast}_tflops"] = tf(
                lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast))
        except (RuntimeError, TypeError) as e:   # the API moved between torch releases
            out[f"torch_scaled_mm_e4m3_fast_accum_{fast}_tflops"] = f"unavailable ({str(e)[:80]})"
    return out


def run(cfgs, iters: int, rounds: int, with_ceilings: bool) -> dict:
    import torch

    from cute_mla.archs import device_arch, gpu_summary

    if device_arch("cuda") != SM90.name:
        sys.exit(f"fp8_mma_probe runs wgmma on SM90 only; this GPU is {gpu_summary()}")
    ctas = device_num_sms(torch.device("cuda"))
    fns, errors = {}, {}
    for cfg in cfgs:
        # One variant failing (compile or check) is reported and left out; the others still run.
        t0 = time.perf_counter()
        try:
            fn = compile_probe(cfg)
            err = check(fn, cfg)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            print(f"{cfg.variant} x{cfg.wgs} WG: FAILED ({type(e).__name__}: {str(e)[:300]}); not timed", flush=True)
            continue
        print(f"{cfg.variant} x{cfg.wgs} WG: compiled in {time.perf_counter() - t0:.1f} s; S max error vs the exact "
              f"product {err:.1e} of max |S|", flush=True)
        # fp32 sums of 512 products: ~1e-7; an FP8 accumulator of ~14 bits: ~1e-4; a wrong layout
        # or operand: O(1) (NaN: S left unwritten).
        if not err < (4e-3 if cfg.fp8 else 1e-5):
            print(f"{cfg.variant} x{cfg.wgs} WG: S does not match the exact product; not timed", flush=True)
            continue
        fns[cfg], errors[cfg] = fn, err
    cfgs = list(fns)
    from cute_mla.playground.bench import warm_up   # torch and CUDA only where the probe runs

    warm_up(2.0)
    samples = {cfg: [] for cfg in cfgs}
    for _ in range(rounds):   # interleaved: the clock under the power cap drifts between rounds
        for cfg in cfgs:
            samples[cfg].append(time_variant(fns[cfg], cfg, ctas, iters))
    rows = []
    base = {}
    for cfg in cfgs:
        us = statistics.median(samples[cfg])
        per_iter = us / iters
        tflops = flops_per_iteration(cfg) * ctas * iters / (us * 1e-6) / 1e12
        if cfg.variant == "bf16":
            base[cfg.wgs] = tflops
        rows.append(dict(variant=cfg.variant, wgs=cfg.wgs, ctas=ctas, iters=iters, call_us=round(us, 1),
                         us_per_iteration=round(per_iter, 4), cycles_per_iteration_at_1980MHz=round(per_iter * 1980),
                         tflops=round(tflops, 1), s_max_rel_error=errors[cfg]))
    for r in rows:
        b = base.get(r["wgs"])
        r["ratio_to_bf16"] = round(r["tflops"] / b, 3) if b else None
        print(f"{r['variant']:12s} x{r['wgs']} WG: {r['us_per_iteration'] * 1e3:8.1f} ns/iteration/CTA "
              f"(~{r['cycles_per_iteration_at_1980MHz']} cycles at 1.98 GHz)  {r['tflops']:7.1f} TFLOP/s  "
              f"x{r['ratio_to_bf16']} bf16", flush=True)
    out = dict(device=torch.cuda.get_device_name(0), rows=rows)
    if with_ceilings:
        out["ceilings"] = ceilings()
        print(f"ceilings in this run: {out['ceilings']}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a and report (no GPU)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--wgs", default="1,2", help="warp groups per CTA to run (1, 2 or 1,2)")
    ap.add_argument("--iters", type=int, default=20000, help="iterations per call (~10 ms at bf16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ceilings", action="store_true", help="also time torch's bf16 matmul and e4m3 _scaled_mm")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    cfgs = [ProbeConfig(v, int(w)) for w in args.wgs.split(",") for v in args.variants.split(",")]
    if args.compile_only:
        out = dict(compile=[compile_report(c) for c in cfgs])
        for r in out["compile"]:
            print(json.dumps(r))
    else:
        out = run(cfgs, args.iters, args.rounds, args.ceilings)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
