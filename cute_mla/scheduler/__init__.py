"""Split-KV scheduler: the partition count, FlashMLA's greedy partitioning, on the host or the device.

Nothing here imports a kernel module: the device scheduler (:mod:`.device`) compiles through the
DSL plumbing (``cute_mla.dsl``) like every kernel."""

from __future__ import annotations

from typing import Tuple

import torch

from .partition import (  # noqa: F401
    BLOCK_TOPK,
    FIXED_OVERHEAD,
    MIN_PIECE_BLOCKS,
    SCHED_ROW_INTS,
    HostSchedule,
    SchedField,
    accum_offsets,
    blocks_of_length,
    blocks_per_request,
    extra_blocks_of_length,
    fixed_overhead_blocks,
    longest_partition,
    max_accum_rows,
    num_sm_parts,
    per_request_rows,
    plan_splits_host,
    whole_request_rows,
)


def plan_splits(num_blocks: torch.Tensor, num_sm_parts: int, fixed_overhead: int = FIXED_OVERHEAD) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's scheduler on tensors: ``num_blocks`` (b,) int32 -> (tile_scheduler_metadata (P, 8), num_splits (b+1,)).

    On the CPU the host algorithm runs directly. On a GPU a one-warp CuTe DSL kernel (its lane 0 walks the
    greedy loop) runs it on the device, with no host synchronization (it is capturable in a CUDA graph).
    """
    if not isinstance(num_blocks, torch.Tensor) or num_blocks.dim() != 1 or num_blocks.dtype != torch.int32:
        got = f"{num_blocks.dtype} {tuple(num_blocks.shape)}" if isinstance(num_blocks, torch.Tensor) else type(num_blocks).__name__
        raise ValueError(f"num_blocks: expected a 1-D int32 tensor (b,), got {got}")
    if num_sm_parts < 1:
        raise ValueError(f"num_sm_parts: must be >= 1, got {num_sm_parts}")
    b = num_blocks.shape[0]
    if num_blocks.device.type == "cpu":
        s = plan_splits_host(num_blocks.tolist(), num_sm_parts, fixed_overhead)
        return (torch.tensor(s.rows, dtype=torch.int32, device=num_blocks.device).reshape(num_sm_parts, SCHED_ROW_INTS),
                torch.tensor(s.num_splits, dtype=torch.int32, device=num_blocks.device))
    from . import device
    from ..archs import device_arch

    tile_md = torch.empty(num_sm_parts, SCHED_ROW_INTS, dtype=torch.int32, device=num_blocks.device)
    num_splits = torch.empty(b + 1, dtype=torch.int32, device=num_blocks.device)
    cfg = device.Config(arch=device_arch(num_blocks.device))
    device.launch(device.compile(cfg), num_blocks, tile_md, num_splits, fixed_overhead)
    return tile_md, num_splits


def accum_offsets_device(num_splits: torch.Tensor) -> torch.Tensor:
    """:func:`accum_offsets` with torch ops on the tensor's device (no host synchronization)."""
    counts = num_splits[1:] - num_splits[:-1]
    rows = torch.where(counts > 1, counts, torch.zeros_like(counts))
    out = torch.zeros_like(num_splits)
    torch.cumsum(rows, dim=0, out=out[1:])
    return out
