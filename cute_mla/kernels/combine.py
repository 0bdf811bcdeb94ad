"""Split-KV combine for sparse MLA decode (FlashMLA's combine).

Each split of a request wrote ``o_accum[row] = O / L`` (fp32, or bf16 where the plan halves the
partials' bytes: ``CombineConfig.accum_dtype``; already normalised by its own softmax sum, no
sink) and ``lse_accum[row] = log2(L) + m`` (base 2, -inf for an empty split).
Request ``i`` owns rows ``[accum_offsets[i], accum_offsets[i+1])``. For every (request, query, head)
with more than one split this kernel writes::

    G       = log2(sum_i 2^lse_i)                      (+inf when every split is empty)
    lse     = G * ln 2                                 (natural log, sink excluded)
    G_sink  = G + log2(1 + 2^(sink*log2e - G))         (sink folded in once, here)
    out     = bf16( sum_i 2^(lse_i - G_sink) * o_accum_i )

A request with a single split is left alone: the decode kernel already wrote its out/lse.

Two layouts (``CombineConfig.warps_per_head``), both with 128-thread CTAs and x carrying b*s_q
because y/z stop at 65535:

- **4 warps per head** (few (token, head) pairs): grid ``(b*s_q, h_q)``, one CTA per (token,
  head), so even b = s_q = 1 spreads the partials over h_q SMs and each head's rows are read by
  128 lanes, 16 rows in flight each.
- **1 warp per head** (many pairs): grid ``(b*s_q, h_q/4)``, four heads per CTA. With more CTAs
  than fit on the GPU at once the pairs run in waves, and each CTA pays its start, its offset
  loads, its PDL wait and the lse reduction (done by every warp of a head); a warp per head does
  that work once per head and a quarter as many CTAs start (b=32, h_q=128: 1,024 CTAs, one wave,
  instead of 4,096). With more requests than
schedule partitions (``CombineConfig.by_partition``) x walks the partitions instead: at most one
request per partition is split *and starts there* (the partition whose last request is split and
whose piece of it begins at the request's block 0), so CTA ``(p, q, head)`` combines that request
or leaves at once, and the CTAs of the requests no split touched are never launched (at b = 512,
h_q = 128 on 66 partitions: 8,448 CTAs instead of 65,536, most of which only read their request's
two offsets and left). A head's 512 columns are 128
chunks of 4; the head's lanes own chunks round robin, so lane l of the head's warp w owns the
chunks ``l + 32*(w + warps_per_head*i)``: a split row's chunk is one 16-byte load per lane (512
contiguous bytes per warp; 8 bytes of bf16 partials, widened to fp32 before use) and the bf16
chunk leaves as one 8-byte store per lane.

Every warp reduces the split lses itself (redundantly with 4 warps per head: at most
``max_splits`` floats), which needs no shared memory or barrier. Memory-level parallelism is what
makes the kernel fast: the split rows are loaded ``VALUES_IN_FLIGHT / chunk values per lane`` at a
time (16 rows with 4 warps per head, 4 with 1), back to back, before any is accumulated, and
the first batch is issued before the lse reduction so that its latency overlaps the lse loads and
the reduction math. (32 rows in flight let a request of up to 32 splits wait one round trip for
its rows, not two, but measured no faster: docs/performance.md.)

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
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from ..archs import check_arch
from ..dsl.compile import CompiledKernel, compile_cached, compile_options
from ..scheduler.partition import SCHED_ROW_INTS, SchedField

# The template buckets: FlashMLA's {32, 64, 96, 128, 160} plus the fork's 256, minus 96/192/224
# (fewer compiled variants; a larger bucket only costs max_splits/32 registers per lane).
# 132 and 148 SMs (the SM90 and SM100 data-center parts) at s_q == 1 both land in 160.
MAX_SPLITS_BUCKETS = (32, 64, 128, 160, 256)

D_V = 512
WARP_THREADS = 32
WARPS_PER_CTA = 4
THREADS_PER_CTA = WARP_THREADS * WARPS_PER_CTA
WARPS_PER_HEAD = (4, 1)  # the two layouts (module docstring): a CTA per (token, head), or a warp per head
COLS_PER_LANE = 4  # contiguous columns of a chunk: one vector load per split row, one vector store
CHUNKS_PER_HEAD = D_V // COLS_PER_LANE  # 128
OUT_STORE_BYTES = COLS_PER_LANE * (BFloat16.width // 8)  # 8: one vector store per lane; out's base alignment
# o_accum element types (the split variants write them, this kernel reads them): fp32, or bf16 where
# the plan halves the partials' bytes (SparseDecodePlan.accum_dtype). Accumulation is fp32 either way.
ACCUM_DTYPES = ("float32", "bfloat16")
# Partial values per lane loaded back to back before any is accumulated (memory-level parallelism):
# 16 split rows of one chunk with 4 warps per head, 4 rows of four chunks with 1.
VALUES_IN_FLIGHT = 64
# Many (token, head) pairs: above this many (the grid's rows, requests or partitions, x s_q x h_q)
# a warp per head is used. It is about one wave of the 4-warps-per-head CTAs on 132 SMs (SM90's
# bf16 build takes 58-70 registers: 7-8 of them per SM, 924-1,056 on 132 SMs): within a wave four
# warps per head keep more of a head's rows in flight; past it the CTAs run in waves and a warp
# per head pays each CTA's start and lse reduction once per head (module docstring; measured,
# docs/performance.md).
WARP_PER_HEAD_ABOVE_PAIRS = 1024


def chunks_per_lane(warps_per_head: int) -> int:
    return CHUNKS_PER_HEAD // (WARP_THREADS * warps_per_head)


def rows_in_flight(warps_per_head: int) -> int:
    return VALUES_IN_FLIGHT // (COLS_PER_LANE * chunks_per_lane(warps_per_head))


def heads_per_cta(warps_per_head: int) -> int:
    return WARPS_PER_CTA // warps_per_head


ROWS_IN_FLIGHT = rows_in_flight(WARPS_PER_HEAD[0])  # with 4 warps per head (the latency layout)


# Each divides 32: a batch of rows never straddles two lse register slots, so its weights come from one slot.
assert all(WARP_THREADS % rows_in_flight(w) == 0 and chunks_per_lane(w) >= 1 for w in WARPS_PER_HEAD)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_ACCUM_TYPES = {"float32": Float32, "bfloat16": BFloat16}


def accum_type(accum_dtype: str):
    """The cutlass numeric type of an o_accum dtype name (ACCUM_DTYPES): the combine's and the
    split decode kernels' fake tensors."""
    return _ACCUM_TYPES[accum_dtype]


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
    accum_dtype: str = "float32"           # o_accum's element type (ACCUM_DTYPES)
    by_partition: bool = False             # grid x over the schedule's partitions (module docstring), tile_md given
    warps_per_head: int = 4                # WARPS_PER_HEAD: a CTA per (token, head), or a warp per head

    def __post_init__(self) -> None:
        check_arch(self.arch)
        if self.d_v != D_V:
            raise ValueError(f"combine: d_v must be {D_V}, got {self.d_v}")
        if self.max_splits not in MAX_SPLITS_BUCKETS:
            raise ValueError(f"combine: max_splits must be one of {MAX_SPLITS_BUCKETS}, got {self.max_splits}")
        if self.h_q < 1:
            raise ValueError(f"combine: h_q must be >= 1, got {self.h_q}")
        if self.warps_per_head not in WARPS_PER_HEAD:
            raise ValueError(f"combine: warps_per_head must be one of {WARPS_PER_HEAD}, got {self.warps_per_head}")
        if self.h_q % self.heads_per_cta:
            raise ValueError(f"combine: h_q must be a multiple of {self.heads_per_cta} with {self.warps_per_head} "
                             f"warp(s) per head, got {self.h_q}")
        if self.accum_dtype not in ACCUM_DTYPES:
            raise ValueError(f"combine: accum_dtype must be one of {ACCUM_DTYPES}, got {self.accum_dtype!r}")

    @property
    def cache_key(self):
        return ("combine", self.arch, self.h_q, self.has_attn_sink, self.max_splits, self.d_v, self.accum_dtype,
                self.by_partition, self.warps_per_head)

    @property
    def heads_per_cta(self) -> int:
        return heads_per_cta(self.warps_per_head)

    @property
    def accum_type(self):
        """o_accum's element type as a cutlass numeric type."""
        return accum_type(self.accum_dtype)


Config = CombineConfig   # the registry's protocol (cute_mla.registry)


def combine_config(arch: str, h_q: int, has_attn_sink: bool, num_sm_parts: int,
                   accum_dtype: str = "float32", b: int = 0, s_q: int = 1) -> CombineConfig:
    """The config for a schedule with ``num_sm_parts`` partitions (a request has at most that many
    splits); ``accum_dtype``: the plan's (SparseDecodePlan.accum_dtype); ``b``: the requests (more
    than partitions: the grid walks the partitions); ``b`` and ``s_q`` pick the layout: a warp per
    head when the grid holds more than WARP_PER_HEAD_ABOVE_PAIRS (token, head) pairs."""
    by_partition = b > num_sm_parts
    pairs = (num_sm_parts if by_partition else b) * s_q * h_q
    per_head = 1 if pairs > WARP_PER_HEAD_ABOVE_PAIRS and h_q % WARPS_PER_CTA == 0 else 4
    return CombineConfig(h_q=h_q, has_attn_sink=has_attn_sink, max_splits=combine_max_splits(num_sm_parts), arch=arch,
                         accum_dtype=accum_dtype, by_partition=by_partition, warps_per_head=per_head)


def _exp2(x):
    # ex2.approx: exact for +-inf (2^-inf = 0), unlike fastmath, which assumes no infinities.
    return cute.math.exp2(x, approx=True)


def _log2(x):
    # lg2.approx: log2(0) = -inf, log2(+inf) = +inf.
    return cute.math.log2(x, approx=True)


@cute.jit
def _combine_host(
    lse_accum: cute.Tensor,  # (rows, s_q, h_q) fp32
    o_accum: cute.Tensor,  # (rows, s_q, h_q, 512) fp32 or bf16 (CombineConfig.accum_dtype)
    accum_offsets: cute.Tensor,  # (b+1,) int32
    attn_sink: Optional[cute.Tensor],  # (h_q,) fp32, or None when compiled without a sink
    out: cute.Tensor,  # (b, s_q, h_q, 512) bf16
    lse: cute.Tensor,  # (b, s_q, h_q) fp32
    tile_md: Optional[cute.Tensor],  # (partitions, 8) int32 when by_partition, else None
    max_splits: cutlass.Constexpr[int],
    warps_per_head: cutlass.Constexpr[int],
    stream,
):
    grid_x = out.shape[0] * out.shape[1]
    if cutlass.const_expr(tile_md is not None):
        grid_x = tile_md.shape[0] * out.shape[1]
    _combine_kernel(lse_accum, o_accum, accum_offsets, attn_sink, out, lse, tile_md, max_splits, warps_per_head).launch(
        grid=(grid_x, out.shape[2] // heads_per_cta(warps_per_head), 1),
        block=(THREADS_PER_CTA, 1, 1),
        stream=stream,
        # Programmatic dependent launch: the combine is launched while the decode kernel still
        # runs (its launch latency hides behind it); every warp that reads the accumulators
        # first waits in griddepcontrol.wait. A launched combine always has a split request, so
        # some of its warps wait and the combine cannot complete before the decode kernel.
        use_pdl=True,
    )


@cute.jit
def _load_rows(frags, lane_addr: Int64, chunk_bytes: cutlass.Constexpr[int], row_bytes: Int64, first: Int32,
               last: Int32):
    """Issue the loads of split rows ``first .. first+rows-1`` (clamped to ``last``) into ``frags``
    (``(COLS_PER_LANE, chunks, rows)``).

    ``lane_addr`` is this lane's first chunk of the request's first split row, ``chunk_bytes``
    the distance to its next chunk and ``row_bytes`` the distance between split rows. The row
    number is non-negative, so it is widened unsigned: an address costs one 32x64-bit
    multiply-add. All loads go out back to back; nothing here waits on them. A clamped row is
    in bounds and gets weight 0 (its split lse is -inf), so no tail branch is needed.
    """
    align = COLS_PER_LANE * frags.element_type.width // 8   # one vector load per chunk: 16 B fp32, 8 B bf16
    for u in cutlass.range_constexpr(cute.size(frags, mode=[2])):
        row_addr = lane_addr + Int64(Uint32(cutlass.min(first + u, last))) * row_bytes
        for c in cutlass.range_constexpr(cute.size(frags, mode=[1])):
            ptr = cute.make_ptr(frags.element_type, row_addr + c * chunk_bytes, cute.AddressSpace.gmem,
                                assumed_align=align)
            cute.autovec_copy(cute.make_tensor(ptr, cute.make_layout(COLS_PER_LANE)), frags[None, c, u])


def _out_cols(out: cute.Tensor, req, q, head, chunk):
    """Output chunk ``chunk`` (COLS_PER_LANE columns) of (req, q, head)."""
    return cute.local_tile(out[req, q, head, None], (COLS_PER_LANE,), (chunk,))


@cute.jit
def _accumulate(acc, frags, w_slot: Float32, src_lane: Int32):
    """``acc += w * frags[:, :, u]`` for the batch in ``frags`` (bf16 rows widened to fp32 first);
    row u's weight sits in lane ``src_lane + u`` of ``w_slot``."""
    vals = frags
    if cutlass.const_expr(frags.element_type != Float32):
        vals = cute.make_rmem_tensor(frags.layout, Float32)
        vals.store(frags.load().to(Float32))
    for u in cutlass.range_constexpr(cute.size(frags, mode=[2])):
        w = cute.arch.shuffle_sync(w_slot, src_lane + u)
        for c in cutlass.range_constexpr(cute.size(frags, mode=[1])):
            for e in cutlass.range_constexpr(COLS_PER_LANE):
                acc[e, c] += w * vals[e, c, u]


@cute.jit
def _split_weights(lse_reg, sink: Float32, has_sink: cutlass.Constexpr[bool]) -> Float32:
    """Turn the split lses in ``lse_reg`` (base 2, -inf past the end) into weights ``2^(lse_i - G_sink)``, in place.

    Every warp does this for itself (at most max_splits floats). Returns the natural-log lse
    of the (token, head): ``G * ln 2``, +inf when every split is empty; the sink is not part of it.
    """
    lse_slots = cute.size(lse_reg)
    # G = log2(sum 2^lse_i), shifted by the max for range (a -inf max is taken as 0).
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
    lse_nat = g * Float32(LN2)

    # Fold the sink into the normaliser (only here: the splits never saw it).
    if cutlass.const_expr(has_sink):
        if g != Float32.inf:
            g = g + _log2(Float32(1.0) + _exp2(sink - g))
        else:
            g = sink
            if sink == -Float32.inf:
                g = Float32.inf

    # Past the end (and for empty splits) the lse is -inf, so the weight is 0.
    for t in cutlass.range_constexpr(lse_slots):
        lse_reg[t] = _exp2(lse_reg[t] - g)
    return lse_nat


@cute.jit
def _owned_request(tile_md: cute.Tensor, part: Int32, b: Int32) -> Int32:
    """The split request partition ``part`` combines, or -1: its last request when that is split
    and its piece here starts at the request's block 0 (the request's first piece; later pieces
    begin mid-request). FlashMLA's flags: with one request in the partition both flags are the OR
    of the two, so a first piece shows as ``begin_block == 0`` with the flag set. An empty
    trailing partition (``begin_req == b``) owns nothing."""
    begin_req = tile_md[part, SchedField.BEGIN_REQ]
    end_req = tile_md[part, SchedField.END_REQ]
    begin_block = tile_md[part, SchedField.BEGIN_BLOCK]
    last_split = tile_md[part, SchedField.LAST_REQ_SPLIT]
    owns = (last_split != 0) & (begin_req < b) & ((begin_req < end_req) | (begin_block == 0))
    req = Int32(-1)
    if owns:
        req = end_req
    return req


@cute.kernel
def _combine_kernel(
    lse_accum: cute.Tensor,
    o_accum: cute.Tensor,
    accum_offsets: cute.Tensor,
    attn_sink: Optional[cute.Tensor],
    out: cute.Tensor,
    lse: cute.Tensor,
    tile_md: Optional[cute.Tensor],
    max_splits: cutlass.Constexpr[int],
    warps_per_head: cutlass.Constexpr[int],
):
    lse_slots = max_splits // WARP_THREADS  # splits lane, lane+32, ... held in registers
    chunks = chunks_per_lane(warps_per_head)
    chunk_step = WARP_THREADS * warps_per_head  # between a lane's chunks

    bs, head_block, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()
    head = head_block * heads_per_cta(warps_per_head) + warp // warps_per_head
    warp_in_head = warp % warps_per_head
    chunk0 = warp_in_head * WARP_THREADS + lane  # this lane's chunks: chunk0 + chunk_step * i
    s_q = Int32(out.shape[1])
    req = bs // s_q
    q = bs - req * s_q
    if cutlass.const_expr(tile_md is not None):
        req = _owned_request(tile_md, req, Int32(out.shape[0]))

    row_begin = Int32(0)
    n = Int32(0)
    if req >= 0:
        row_begin = accum_offsets[req]
        n = accum_offsets[req + 1] - row_begin

    if n > max_splits:
        # Not representable in this bucket: poison rather than return a wrong answer.
        nan_frag = cute.make_rmem_tensor((COLS_PER_LANE,), BFloat16)
        nan_frag.fill(BFloat16(math.nan))
        for c in cutlass.range_constexpr(chunks):
            cute.autovec_copy(nan_frag, _out_cols(out, req, q, head, chunk0 + c * chunk_step))
        if warp_in_head == 0:
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
        sink = Float32(0.0)
        if cutlass.const_expr(attn_sink is not None):
            sink = attn_sink[head] * Float32(LOG2E)

        # 2) out = sum_i w_i o_i, rows_in_flight(warps_per_head) split rows per batch, loaded back
        #    to back before any is used. Split i's weight is in lane i % 32 of register slot
        #    i // 32; a batch lies in one slot (its size divides 32) and a shuffle hands the
        #    weights out.
        #    The first iteration turns the lses into weights after issuing its row loads: the
        #    loads end a basic block and the reduction starts the next one, so ptxas cannot
        #    schedule the reduction (which waits for the lses) ahead of them, and the row
        #    latency overlaps the lse latency and the reduction. (In one straight-line block
        #    ptxas issues the loads just ahead of their use, a few at a time.)
        last = n - 1
        batch = rows_in_flight(warps_per_head)
        lane_addr = cute.local_tile(o_accum[row_begin, q, head, None], (COLS_PER_LANE,), (chunk0,)).iterator.toint()
        chunk_bytes = chunk_step * COLS_PER_LANE * o_accum.element_type.width // 8
        row_bytes = Int64(o_accum.stride[0]) * (o_accum.element_type.width // 8)
        # Register tensors are column-major: COLS_PER_LANE goes first so each chunk's run is contiguous.
        frags = cute.make_rmem_tensor((COLS_PER_LANE, chunks, batch), o_accum.element_type)
        acc = cute.make_rmem_tensor((COLS_PER_LANE, chunks), Float32)
        acc.fill(0.0)
        lse_nat = Float32(0.0)
        for first in cutlass.range(0, n, batch, unroll=1):
            _load_rows(frags, lane_addr, chunk_bytes, row_bytes, first, last)
            if first == 0:
                lse_nat = _split_weights(lse_reg, sink, attn_sink is not None)
            slot = first // WARP_THREADS
            w_slot = lse_reg[0]
            for t in cutlass.range_constexpr(1, lse_slots):
                if slot == t:
                    w_slot = lse_reg[t]
            _accumulate(acc, frags, w_slot, first - slot * WARP_THREADS)

        # 3) bf16, one 8-byte store per lane, and the lse, once per (token, head). Both addresses
        #    are formed here, not before the loop, where they would hold registers (or get
        #    spilled) across it.
        out_frag = cute.make_rmem_tensor((COLS_PER_LANE, chunks), BFloat16)
        out_frag.store(acc.load().to(BFloat16))
        for c in cutlass.range_constexpr(chunks):
            cute.autovec_copy(out_frag[None, c], _out_cols(out, req, q, head, chunk0 + c * chunk_step))
        if warp_in_head == 0:
            if lane == 0:
                lse[req, q, head] = lse_nat


def _fake_args(cfg: CombineConfig):
    rows, s_q, b, b_plus_1 = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    h = cfg.h_q
    lse_accum = make_fake_compact_tensor(Float32, (rows, s_q, h), stride_order=(2, 1, 0), assumed_align=4)
    o_accum = make_fake_compact_tensor(cfg.accum_type, (rows, s_q, h, D_V), stride_order=(3, 2, 1, 0), assumed_align=16)
    accum_offsets = make_fake_compact_tensor(Int32, (b_plus_1,), assumed_align=4)
    attn_sink = make_fake_compact_tensor(Float32, (h,), assumed_align=4) if cfg.has_attn_sink else None
    # out may be a strided view (e.g. a slice of a larger buffer): only the last dim must be
    # contiguous, and every other stride a multiple of COLS_PER_LANE (4) elements so each lane's
    # 8-byte store stays aligned.
    out_stride = [cute.sym_int64(divisibility=COLS_PER_LANE) for _ in range(3)]
    out = make_fake_tensor(BFloat16, (b, s_q, h, D_V), stride=(*out_stride, 1), assumed_align=OUT_STORE_BYTES)
    lse = make_fake_compact_tensor(Float32, (b, s_q, h), stride_order=(2, 1, 0), assumed_align=4)
    tile_md = None
    if cfg.by_partition:
        tile_md = make_fake_compact_tensor(Int32, (cute.sym_int(), SCHED_ROW_INTS), stride_order=(1, 0), assumed_align=16)
    return lse_accum, o_accum, accum_offsets, attn_sink, out, lse, tile_md


def compile(cfg: CombineConfig, dump_dir: Optional[str] = None) -> CompiledKernel:
    """Compile (once per config) the combine kernel. Needs no GPU."""

    def build(dump: Optional[str]):
        return cute.compile(
            _combine_host,
            *_fake_args(cfg),
            cfg.max_splits,
            cfg.warps_per_head,
            make_fake_stream(use_tvm_ffi_env_stream=True),
            options=compile_options(cfg.arch, dump),
        )

    return compile_cached(cfg.cache_key, build, dump_dir)


def launch(compiled: CompiledKernel, cfg: CombineConfig, lse_accum, o_accum, accum_offsets, attn_sink, out, lse,
                   layout_checked: bool = False, tile_md=None) -> None:
    """Run the combine on torch's current stream. No sync, no allocation.

    Shapes, dtypes, devices and base alignment are checked by the compiled function itself
    (TVM-FFI names the bad argument). Checked here, from tensor metadata only, is what it does
    not validate: symbolic strides (the kernel assumes their divisibility), b+1 and the sink.
    ``layout_checked``: the caller guarantees those (the launcher: it allocated the accumulators
    and lse itself, accum_offsets is its plan's schedule's, and the API checked ``out``),
    so these host checks (about a dozen tensor-metadata calls) are skipped on the launch path.
    ``tile_md``: the schedule's (partitions, 8) rows, which a ``by_partition`` config walks (and
    only that one takes).
    """
    if not layout_checked:
        _check_layout(cfg, lse_accum, o_accum, accum_offsets, attn_sink, out, lse)
        if cfg.by_partition != (tile_md is not None):
            raise ValueError(f"combine: compiled with by_partition={cfg.by_partition}, got tile_md="
                             f"{'a tensor' if tile_md is not None else None}")
    # A sink-less build keeps the parameter slot, typed None (tile_md too).
    compiled.fn(lse_accum, o_accum, accum_offsets, attn_sink, out, lse, tile_md)


def _check_layout(cfg: CombineConfig, lse_accum, o_accum, accum_offsets, attn_sink, out, lse) -> None:
    if cfg.has_attn_sink != (attn_sink is not None):
        raise ValueError(
            f"combine: compiled with has_attn_sink={cfg.has_attn_sink}, "
            f"got attn_sink={'a tensor' if attn_sink is not None else None}"
        )
    if accum_offsets.shape[0] != out.shape[0] + 1:
        raise ValueError(f"combine: accum_offsets must have b+1={out.shape[0] + 1} entries, got {accum_offsets.shape[0]}")
    for name, t in (("lse_accum", lse_accum), ("o_accum", o_accum), ("lse", lse)):
        if not t.is_contiguous():
            raise ValueError(f"combine: {name} must be contiguous, got strides {tuple(t.stride())}")
    if out.stride(-1) != 1 or any(st % COLS_PER_LANE for st in out.stride()[:-1]):
        raise ValueError(
            f"combine: out needs stride(-1) == 1 and other strides % {COLS_PER_LANE} == 0, got {tuple(out.stride())}"
        )
