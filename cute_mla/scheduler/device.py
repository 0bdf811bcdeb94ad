"""The decode scheduler ("tile scheduler metadata") as a one-warp CuTe DSL kernel.

It runs FlashMLA's greedy partitioning on the GPU, so building
the metadata needs no device-to-host copy and can be captured in a CUDA graph. The result is,
entry by entry, what the host version ``cute_mla.scheduler.partition.plan_splits_host`` returns
for the same ``num_blocks``, ``num_sm_parts`` and ``fixed_overhead``.

Inputs and outputs (all int32, on the GPU)::

    num_blocks (b,)    64-token blocks of each request's top-k list, >= 1 each
    tile_md    (P, 8)  one DecodingSchedMeta row per SM part (P = num_sm_parts = tile_md.shape[0]):
                       [begin_req, end_req (incl), begin_block (incl), end_block (excl),
                        begin_split_idx, is_first_req_splitted, is_last_req_splitted, 0]
    num_splits (b+1,)  exclusive prefix sum of the per-request split counts

A partition that gets no work (it can only be a trailing one) reads
``[b, b-1, 0, num_blocks[b-1], 0, 0, 0, 0]``: ``begin_req == b`` tells the decode kernels to
return at once, and the other fields are what FlashMLA's loop leaves in them.

Kernel shape: one CTA of one warp. The 32 lanes sum the per-request costs (the only O(b) pass
that parallelises); lane 0 then runs the serial greedy walk, which is O(b + P) and reads
``num_blocks`` straight from global memory (the lanes' first pass has just pulled it into L1),
so no shared memory is sized by b and any batch size works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from ..archs import check_arch
from ..dsl.compile import CompiledKernel, compile_cached, compile_options
from .partition import SCHED_ROW_INTS, SchedField


WARP_THREADS = 32


@dataclass(frozen=True)
class SchedulerKernelConfig:
    """Everything the compiled scheduler depends on. b, P and the overhead are runtime values."""

    arch: str

    def __post_init__(self) -> None:
        check_arch(self.arch)

    @property
    def cache_key(self):
        return ("decode_scheduler", self.arch)

Config = SchedulerKernelConfig   # the registry's protocol (cute_mla.registry)


@cute.jit
def _scheduler_host(
    num_blocks: cute.Tensor,  # (b,) int32
    tile_md: cute.Tensor,  # (P, 8) int32, row-major
    num_splits: cute.Tensor,  # (b+1,) int32
    fixed_overhead: Int32,
    stream,
):
    # A single warp: the work is a serial walk, and one CTA keeps it free of grid-wide sync.
    _scheduler_kernel(num_blocks, tile_md, num_splits, fixed_overhead).launch(
        grid=(1, 1, 1), block=(WARP_THREADS, 1, 1), stream=stream
    )


@cute.kernel
def _scheduler_kernel(
    num_blocks: cute.Tensor,
    tile_md: cute.Tensor,
    num_splits: cute.Tensor,
    fixed_overhead: Int32,
):
    lane = cute.arch.lane_idx()
    b = Int32(num_blocks.shape[0])
    n_parts = Int32(tile_md.shape[0])
    F = fixed_overhead

    # total = sum_i (num_blocks_i + F): strided over the lanes, then a butterfly sum.
    part = Int32(0)
    for i in cutlass.range(lane, b, WARP_THREADS, unroll=1):
        part += num_blocks[i] + F
    total = cute.arch.warp_reduction_sum(part)

    if lane == 0:
        # ceil(total / P) + F: every partition can make progress, since payload - F >= 1.
        payload = (total + n_parts - 1) // n_parts + F
        num_splits[0] = Int32(0)

        # Cursor of the greedy walk: request, first unassigned block in it, and how many
        # pieces of it earlier partitions already took.
        now_req = Int32(0)
        now_block = Int32(0)
        now_split = Int32(0)
        cum_splits = Int32(0)
        for p in cutlass.range(n_parts, unroll=1):
            begin_req = now_req
            begin_block = now_block
            begin_split = now_split
            first_splitted = now_block != 0
            remain = payload
            more = now_req < b
            # The DSL has no `break`: `more` carries the loop exit instead.
            while more:
                need = num_blocks[now_req] - now_block + F
                if remain >= need:
                    # The request ends inside this partition.
                    cum_splits += now_split + 1
                    num_splits[now_req + 1] = cum_splits
                    remain -= need
                    now_req += 1
                    now_block = Int32(0)
                    now_split = Int32(0)
                    more = now_req < b
                else:
                    # Cut it here, unless what is left would not even cover the overhead.
                    if remain - F > 0:
                        now_block += remain - F
                        now_split += 1
                        remain = Int32(0)
                    more = Boolean(False)

            cut = now_block > 0
            end_req = now_req - 1
            if cut:
                end_req = now_req
            # end_req >= 0 always holds for b >= 1 (the first partition always takes something);
            # the clamp only keeps a b == 0 launch from reading out of bounds.
            end_req_blocks = Int32(0)
            if end_req >= 0:
                end_req_blocks = num_blocks[end_req]
            end_block = end_req_blocks
            if cut:
                end_block = now_block
            last_splitted = end_block != end_req_blocks
            if begin_req == end_req:
                # One request only: it is either whole here or a piece of a split request.
                either = first_splitted or last_splitted
                first_splitted = either
                last_splitted = either

            tile_md[p, SchedField.BEGIN_REQ] = begin_req
            tile_md[p, SchedField.END_REQ] = end_req
            tile_md[p, SchedField.BEGIN_BLOCK] = begin_block
            tile_md[p, SchedField.END_BLOCK] = end_block
            tile_md[p, SchedField.BEGIN_SPLIT] = begin_split
            tile_md[p, SchedField.FIRST_REQ_SPLIT] = Int32(first_splitted)
            tile_md[p, SchedField.LAST_REQ_SPLIT] = Int32(last_splitted)
            tile_md[p, SchedField.PAD] = Int32(0)


def _fake_args():
    b = cute.sym_int()
    n_parts = cute.sym_int()
    b_plus_1 = cute.sym_int()  # b + 1 cannot be spelled with one symbol; the launcher checks it
    num_blocks = make_fake_compact_tensor(cutlass.Int32, (b,), assumed_align=4)
    # A row is 32 bytes, written as two 16-byte stores.
    tile_md = make_fake_compact_tensor(
        cutlass.Int32, (n_parts, SCHED_ROW_INTS), stride_order=(1, 0), assumed_align=16
    )
    num_splits = make_fake_compact_tensor(cutlass.Int32, (b_plus_1,), assumed_align=4)
    return num_blocks, tile_md, num_splits


def compile(cfg: SchedulerKernelConfig, dump_dir: Optional[str] = None) -> CompiledKernel:
    """Compile (once per config) the scheduler kernel. Needs no GPU."""

    def build(dump: Optional[str]):
        num_blocks, tile_md, num_splits = _fake_args()
        return cute.compile(
            _scheduler_host,
            num_blocks,
            tile_md,
            num_splits,
            Int32(5),
            make_fake_stream(use_tvm_ffi_env_stream=True),
            options=compile_options(cfg.arch, dump),
        )

    return compile_cached(cfg.cache_key, build, dump_dir)


def launch(compiled: CompiledKernel, num_blocks, tile_md, num_splits, fixed_overhead: int) -> None:
    """Fill ``tile_md`` and ``num_splits`` on torch's current stream. No sync, no allocation.

    Checks only what the host knows without touching GPU memory (shapes, dtypes); the
    values of ``num_blocks`` must be >= 1 (the caller's rule, as in FlashMLA).
    """
    b = num_blocks.shape[0]
    if num_blocks.ndim != 1 or b < 1:
        raise ValueError(f"num_blocks: expected shape (b,) with b >= 1, got {tuple(num_blocks.shape)}")
    if tile_md.ndim != 2 or tile_md.shape[1] != SCHED_ROW_INTS or tile_md.shape[0] < 1:
        raise ValueError(f"tile_md: expected shape (num_sm_parts, 8), got {tuple(tile_md.shape)}")
    if tuple(num_splits.shape) != (b + 1,):
        raise ValueError(f"num_splits: expected shape ({b + 1},), got {tuple(num_splits.shape)}")
    if fixed_overhead < 0:
        raise ValueError(f"fixed_overhead: expected >= 0, got {fixed_overhead}")
    compiled.fn(num_blocks, tile_md, num_splits, int(fixed_overhead))
