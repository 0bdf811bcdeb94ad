"""Split-KV combine for sparse MLA decode (FlashMLA's combine, flashmla-sparse-decode.md §5.3).

Each split of a request wrote ``o_accum[row] = O / L`` (fp32, already normalised by its own
softmax sum, no sink) and ``lse_accum[row] = log2(L) + m`` (base 2, -inf for an empty split).
Request ``i`` owns rows ``[num_splits[i], num_splits[i+1])``. For every (request, query, head)
with more than one split this kernel writes::

    G       = log2(sum_i 2^lse_i)                      (+inf when every split is empty)
    lse     = G * ln 2                                 (natural log, sink excluded)
    G_sink  = G + log2(1 + 2^(sink*log2e - G))         (sink folded in once, here)
    out     = bf16( sum_i 2^(lse_i - G_sink) * o_accum_i )

A request with a single split is left alone: the decode kernel already wrote its out/lse.

Grid ``(b*s_q, ceil(h_q/8))`` with 256 threads: x carries b*s_q because y/z stop at 65535.
Warp w of a CTA owns head ``8*blockIdx.y + w``; lane l owns the 16 output columns
``[8l, 8l+8)`` and ``[256+8l, 256+8l+8)``, so each split row is read with 16-byte loads and
the bf16 row is written with 16-byte stores.

``max_splits`` (a bucket from :data:`MAX_SPLITS_BUCKETS`) sizes the per-lane register array
of split lses (``max_splits/32`` entries, loaded in one unrolled, fully overlapped pass). A
request may have at most ``max_splits`` splits; the scheduler never gives a request more splits
than there are SM parts, so ``max_splits = combine_max_splits(num_sm_parts)`` is always enough.
A request beyond the bucket gets NaN in out and lse (loud, rather than silently wrong).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from cute_mla.kernels.compile import CompiledKernel, check_arch, compile_cached, compile_options

# The template buckets: FlashMLA's {32, 64, 96, 128, 160} plus the fork's 256, minus 96/192/224
# (fewer compiled variants; a larger bucket only costs max_splits/32 registers per lane).
# 132 SMs (H100/H200) and 148 SMs (B200) at s_q == 1 both land in 160.
MAX_SPLITS_BUCKETS = (32, 64, 128, 160, 256)

D_V = 512
WARP_THREADS = 32
HEADS_PER_CTA = 8  # one warp per head
THREADS_PER_CTA = WARP_THREADS * HEADS_PER_CTA
VEC = 8  # bf16 elements in a 16-byte store; also fp32 elements per pair of 16-byte loads
CHUNKS_PER_LANE = D_V // (WARP_THREADS * VEC)  # 2: columns [8l, 8l+8) and [256+8l, 256+8l+8)
SPLITS_IN_FLIGHT = 4  # split rows loaded back to back before they are accumulated (ILP)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def combine_max_splits(max_splits_per_request: int) -> int:
    """The smallest bucket >= ``max_splits_per_request`` (pass num_sm_parts)."""
    for bucket in MAX_SPLITS_BUCKETS:
        if max_splits_per_request <= bucket:
            return bucket
    raise ValueError(
        f"combine: {max_splits_per_request} splits per request exceeds the largest bucket {MAX_SPLITS_BUCKETS[-1]}"
    )


@dataclass(frozen=True)
class CombineConfig:
    """Everything the compiled combine kernel depends on. b, s_q and the row count are runtime values."""

    h_q: int
    has_attn_sink: bool
    max_splits: int
    arch: str
    d_v: int = D_V

    def __post_init__(self) -> None:
        check_arch(self.arch)
        if self.d_v != D_V:
            raise ValueError(f"combine: d_v must be {D_V}, got {self.d_v}")
        if self.max_splits not in MAX_SPLITS_BUCKETS:
            raise ValueError(f"combine: max_splits must be one of {MAX_SPLITS_BUCKETS}, got {self.max_splits}")
        if self.h_q < 1:
            raise ValueError(f"combine: h_q must be >= 1, got {self.h_q}")

    @property
    def cache_key(self):
        return ("combine", self.arch, self.h_q, self.has_attn_sink, self.max_splits, self.d_v)


def combine_config(arch: str, h_q: int, has_attn_sink: bool, num_sm_parts: int) -> CombineConfig:
    """The config for a schedule with ``num_sm_parts`` partitions (a request has at most that many splits)."""
    return CombineConfig(h_q=h_q, has_attn_sink=has_attn_sink, max_splits=combine_max_splits(num_sm_parts), arch=arch)


def _exp2(x):
    # ex2.approx: exact for +-inf (2^-inf = 0), unlike fastmath, which assumes no infinities.
    return cute.math.exp2(x, approx=True)


def _log2(x):
    # lg2.approx: log2(0) = -inf, log2(+inf) = +inf.
    return cute.math.log2(x, approx=True)


@cute.jit
def _combine_host(
    lse_accum: cute.Tensor,  # (rows, s_q, h_q) fp32
    o_accum: cute.Tensor,  # (rows, s_q, h_q, 512) fp32
    num_splits: cute.Tensor,  # (b+1,) int32
    attn_sink: Optional[cute.Tensor],  # (h_q,) fp32, or None when compiled without a sink
    out: cute.Tensor,  # (b, s_q, h_q, 512) bf16
    lse: cute.Tensor,  # (b, s_q, h_q) fp32
    max_splits: cutlass.Constexpr[int],
    stream,
):
    h_q = out.shape[2]
    grid_x = out.shape[0] * out.shape[1]
    _combine_kernel(lse_accum, o_accum, num_splits, attn_sink, out, lse, max_splits).launch(
        grid=(grid_x, (h_q + HEADS_PER_CTA - 1) // HEADS_PER_CTA, 1),
        block=(THREADS_PER_CTA, 1, 1),
        stream=stream,
        # Programmatic dependent launch: the combine is launched while the decode kernel still
        # runs (its launch latency hides behind it); every warp that reads the accumulators
        # first waits in griddepcontrol.wait. A launched combine always has a split request, so
        # some of its warps wait and the combine cannot complete before the decode kernel.
        use_pdl=True,
    )


@cute.kernel
def _combine_kernel(
    lse_accum: cute.Tensor,
    o_accum: cute.Tensor,
    num_splits: cute.Tensor,
    attn_sink: Optional[cute.Tensor],
    out: cute.Tensor,
    lse: cute.Tensor,
    max_splits: cutlass.Constexpr[int],
):
    lse_slots = max_splits // WARP_THREADS  # splits lane, lane+32, ... held in registers
    h_q = out.shape[2]  # static

    bs, head_group, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()
    head = head_group * HEADS_PER_CTA + warp
    s_q = Int32(out.shape[1])
    req = bs // s_q
    q = bs - req * s_q

    row_begin = num_splits[req]
    n = num_splits[req + 1] - row_begin

    head_ok = True
    if cutlass.const_expr(h_q % HEADS_PER_CTA != 0):
        head_ok = head < h_q

    # Column tiles of this lane: VEC contiguous elements each, 16-byte aligned.
    out_row = out[req, q, head, None]
    if head_ok:
        if n > max_splits:
            # Not representable in this bucket: poison rather than return a wrong answer.
            nan_frag = cute.make_rmem_tensor((VEC,), BFloat16)
            nan_frag.fill(BFloat16(math.nan))
            for c in cutlass.range_constexpr(CHUNKS_PER_LANE):
                cute.autovec_copy(nan_frag, cute.local_tile(out_row, (VEC,), (lane + c * WARP_THREADS,)))
            if lane == 0:
                lse[req, q, head] = Float32(math.nan)
        elif n > 1:
            # PDL: the accumulators come from the decode kernel just before us.
            cute.arch.griddepcontrol_wait()

            # 1) The split lses, lane-strided, -inf past the end; one pass, all loads in flight.
            lse_reg = cute.make_rmem_tensor((lse_slots,), Float32)
            for t in cutlass.range_constexpr(lse_slots):
                split = t * WARP_THREADS + lane
                v = -Float32.inf
                if split < n:
                    v = lse_accum[row_begin + split, q, head]
                lse_reg[t] = v

            # 2) G = log2(sum 2^lse_i), shifted by the max for range (a -inf max is taken as 0).
            m = lse_reg[0]
            for t in cutlass.range_constexpr(1, lse_slots):
                m = cute.arch.fmax(m, lse_reg[t])
            m = cute.arch.warp_reduction_max(m)
            if m == -Float32.inf:
                m = Float32(0.0)
            s = Float32(0.0)
            for t in cutlass.range_constexpr(lse_slots):
                s += _exp2(lse_reg[t] - m)
            s = cute.arch.warp_reduction_sum(s)
            g = Float32.inf
            if s != Float32(0.0):
                g = _log2(s) + m
            if lane == 0:
                # Natural log; +inf for a row with no token at all. The sink is not part of lse.
                lse[req, q, head] = g * Float32(LN2)

            # 3) Fold the sink into the normaliser (only here: the splits never saw it).
            if cutlass.const_expr(attn_sink is not None):
                sink = attn_sink[head] * Float32(LOG2E)
                if g != Float32.inf:
                    g = g + _log2(Float32(1.0) + _exp2(sink - g))
                else:
                    g = sink
                    if sink == -Float32.inf:
                        g = Float32.inf

            # 4) out = sum_i 2^(lse_i - G) o_i. Lane l holds the weight of split 32t + l; a
            #    shuffle hands it to the warp. Past the end the lse is -inf, so the weight is 0
            #    and the (clamped, in-bounds) row it multiplies drops out: no tail branch.
            # Register tensors are column-major: VEC goes first so each 8-element run is contiguous.
            acc = cute.make_rmem_tensor((VEC, CHUNKS_PER_LANE), Float32)
            acc.fill(0.0)
            frags = cute.make_rmem_tensor((VEC, CHUNKS_PER_LANE, SPLITS_IN_FLIGHT), Float32)
            for t in cutlass.range_constexpr(lse_slots):
                slot_base = t * WARP_THREADS
                if slot_base < n:
                    w_lane = _exp2(lse_reg[t] - g)
                    last = cutlass.min(n - slot_base, WARP_THREADS) - 1
                    for j in cutlass.range(0, last + 1, SPLITS_IN_FLIGHT, unroll=1):
                        for u in cutlass.range_constexpr(SPLITS_IN_FLIGHT):
                            row = row_begin + slot_base + cutlass.min(j + u, last)
                            src_row = o_accum[row, q, head, None]
                            for c in cutlass.range_constexpr(CHUNKS_PER_LANE):
                                cute.autovec_copy(
                                    cute.local_tile(src_row, (VEC,), (lane + c * WARP_THREADS,)),
                                    frags[None, c, u],
                                )
                        for u in cutlass.range_constexpr(SPLITS_IN_FLIGHT):
                            w = cute.arch.shuffle_sync(w_lane, j + u)
                            for c in cutlass.range_constexpr(CHUNKS_PER_LANE):
                                for e in cutlass.range_constexpr(VEC):
                                    acc[e, c] += w * frags[e, c, u]

            # 5) bf16, 16-byte stores.
            out_frag = cute.make_rmem_tensor((VEC, CHUNKS_PER_LANE), BFloat16)
            out_frag.store(acc.load().to(BFloat16))
            for c in cutlass.range_constexpr(CHUNKS_PER_LANE):
                cute.autovec_copy(out_frag[None, c], cute.local_tile(out_row, (VEC,), (lane + c * WARP_THREADS,)))


def _fake_args(cfg: CombineConfig):
    rows, s_q, b, b_plus_1 = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    h = cfg.h_q
    lse_accum = make_fake_compact_tensor(Float32, (rows, s_q, h), stride_order=(2, 1, 0), assumed_align=4)
    o_accum = make_fake_compact_tensor(Float32, (rows, s_q, h, D_V), stride_order=(3, 2, 1, 0), assumed_align=16)
    num_splits = make_fake_compact_tensor(Int32, (b_plus_1,), assumed_align=4)
    attn_sink = make_fake_compact_tensor(Float32, (h,), assumed_align=4) if cfg.has_attn_sink else None
    # out may be a strided view (e.g. a slice of a larger buffer): only the last dim must be
    # contiguous, and every other stride a multiple of 8 elements so rows stay 16-byte aligned.
    out = make_fake_tensor(
        BFloat16,
        (b, s_q, h, D_V),
        stride=(cute.sym_int64(divisibility=VEC), cute.sym_int64(divisibility=VEC), cute.sym_int64(divisibility=VEC), 1),
        assumed_align=16,
    )
    lse = make_fake_compact_tensor(Float32, (b, s_q, h), stride_order=(2, 1, 0), assumed_align=4)
    return lse_accum, o_accum, num_splits, attn_sink, out, lse


def compile_combine(cfg: CombineConfig, dump_dir: Optional[str] = None) -> CompiledKernel:
    """Compile (once per config) the combine kernel. Needs no GPU."""

    def build(dump: Optional[str]):
        return cute.compile(
            _combine_host,
            *_fake_args(cfg),
            cfg.max_splits,
            make_fake_stream(use_tvm_ffi_env_stream=True),
            options=compile_options(cfg.arch, dump),
        )

    return compile_cached(cfg.cache_key, build, dump_dir)


def launch_combine(compiled: CompiledKernel, cfg: CombineConfig, lse_accum, o_accum, num_splits, attn_sink, out, lse) -> None:
    """Run the combine on torch's current stream. No sync, no allocation.

    Shapes, dtypes, devices and base alignment are checked by the compiled function itself
    (TVM-FFI names the bad argument). Checked here, from tensor metadata only, is what it does
    not validate: symbolic strides (the kernel assumes their divisibility), b+1 and the sink.
    """
    if cfg.has_attn_sink != (attn_sink is not None):
        raise ValueError(
            f"combine: compiled with has_attn_sink={cfg.has_attn_sink}, "
            f"got attn_sink={'a tensor' if attn_sink is not None else None}"
        )
    if num_splits.shape[0] != out.shape[0] + 1:
        raise ValueError(f"combine: num_splits must have b+1={out.shape[0] + 1} entries, got {num_splits.shape[0]}")
    for name, t in (("lse_accum", lse_accum), ("o_accum", o_accum), ("lse", lse)):
        if not t.is_contiguous():
            raise ValueError(f"combine: {name} must be contiguous, got strides {tuple(t.stride())}")
    if out.stride(-1) != 1 or any(st % VEC for st in out.stride()[:-1]):
        raise ValueError(f"combine: out needs stride(-1) == 1 and other strides % {VEC} == 0, got {tuple(out.stride())}")
    # A sink-less build keeps the parameter slot, typed None.
    compiled.fn(lse_accum, o_accum, num_splits, attn_sink, out, lse)
