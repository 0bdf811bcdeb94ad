"""The kernels: per-arch sparse decode (``sm90/``, ``sm100/``) and the split-KV combine.

Each kernel module reads as config -> kernel -> compile -> launch: ``compile_*`` takes only a
hashable config (so compiling is cached, needs no GPU and is testable per arch) and ``launch_*``
runs a compiled kernel on torch's current stream with no host synchronization or allocation.
Nothing here imports the API, the plan or the schedule: the launcher (``cute_mla.interface``)
turns a plan into kernel configs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class DecodeTensors(NamedTuple):
    """The tensors of one sparse decode launch, as every arch's ``launch_sparse_decode`` takes them.

    ``accum_offsets`` is the schedule's accumulator row prefix sum (request ``r``'s split pieces
    own rows ``[accum_offsets[r], accum_offsets[r+1])``); ``o_accum`` / ``lse_accum`` exist only
    for the split variant."""

    q: torch.Tensor                        # (b, s_q, h_q, d_qk) bf16
    kv: torch.Tensor                       # (num_blocks, page_block_size, row bytes) uint8
    indices: torch.Tensor                  # (b, s_q, topk) int32
    topk_length: Optional[torch.Tensor]    # (b,) int32
    attn_sink: Optional[torch.Tensor]      # (h_q,) fp32
    tile_md: torch.Tensor                  # (partitions, 8) int32
    accum_offsets: torch.Tensor            # (b+1,) int32
    out: torch.Tensor                      # (b, s_q, h_q, d_v) bf16
    lse: torch.Tensor                      # (b, s_q, h_q) fp32
    o_accum: Optional[torch.Tensor] = None     # (rows, s_q, h_q, d_v), the arch's accum dtype
    lse_accum: Optional[torch.Tensor] = None   # (rows, s_q, h_q) fp32
    # The extra KV pool (V4): its cache, its (b, s_q, extra_topk) indices and their (b,) lengths.
    extra_kv: Optional[torch.Tensor] = None
    extra_indices: Optional[torch.Tensor] = None
    extra_topk_length: Optional[torch.Tensor] = None
    # A schedule that orders whole requests (SM90 ``request_order`` kernels): (b,) int32, the
    # request at each position of the partitions' walk; None where partitions walk requests in order.
    request_order: Optional[torch.Tensor] = None
