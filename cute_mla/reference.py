"""The oracle of every kernel test: sparse MLA decode in plain torch, fp32 math.

Independent of the kernels: it dequantizes the cache with :mod:`cute_mla.formats`, gathers each
query token's top-k rows, and computes softmax attention directly (no online softmax, no splits).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .formats import detect_format


def sparse_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    d_v: int = 512,
    kv_as_bf16: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    chunk_rows: int = 256,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference sparse decode.

    Args:
        q: (b, s_q, h_q, d_qk) queries (any float dtype; bf16 in production).
        k_cache: (num_blocks, page_block_size, 1, bytes_per_token) or (num_blocks, page_block_size,
            bytes_per_token) raw cache bytes (uint8 / int8 / float8 views all accepted).
        indices: (b, s_q, topk) int32 token indices (block * page_block_size + row); -1, any
            negative value and any value past the cache's last token are invalid.
        softmax_scale: multiplies q.k.
        attn_sink: (h_q,) fp32 or None. Scales out by 1/(1 + exp(sink - lse)); lse unchanged.
        topk_length: (b,) int32 or None. Request i uses only its first topk_length[i] indices.
        kv_as_bf16: round the dequantized keys to bf16 before the math, as the kernels' MMAs see
            them (FlashMLA's test reference does the same). False keeps the fp32 dequantized values.
        compute_dtype: torch.float32 (default) or torch.float64.

    Returns:
        out (b, s_q, h_q, d_v) in compute_dtype (0 for a row with no valid token) and
        lse (b, h_q, s_q) in compute_dtype, natural log (+inf for a row with no valid token).
    """
    b, s_q, h_q, d_qk = q.shape
    raw = k_cache.reshape(k_cache.shape[0], k_cache.shape[1], k_cache.shape[-1])
    num_blocks, page_block_size, bytes_per_token = raw.shape
    fmt = detect_format(d_qk, bytes_per_token)
    if raw.dtype != torch.uint8:
        raw = raw.view(torch.uint8)
    kv = fmt.dequantize(raw.reshape(num_blocks * page_block_size, bytes_per_token))
    if kv_as_bf16:
        kv = kv.to(torch.bfloat16)
    kv = kv.to(compute_dtype)
    num_tokens = kv.shape[0]
    topk = indices.shape[-1]

    idx = indices.to(torch.int64)
    valid = (idx >= 0) & (idx < num_tokens)
    if topk_length is not None:
        pos = torch.arange(topk, device=idx.device)
        valid &= pos.view(1, 1, topk) < topk_length.to(idx.device).view(b, 1, 1).to(torch.int64)
    safe = torch.where(valid, idx, torch.zeros_like(idx))

    qf = q.to(compute_dtype).reshape(b * s_q, h_q, d_qk)
    safe = safe.reshape(b * s_q, topk)
    valid = valid.reshape(b * s_q, topk)
    out = torch.empty(b * s_q, h_q, d_v, dtype=compute_dtype, device=q.device)
    lse = torch.empty(b * s_q, h_q, dtype=compute_dtype, device=q.device)
    for r0 in range(0, b * s_q, chunk_rows):
        r1 = min(r0 + chunk_rows, b * s_q)
        k = kv[safe[r0:r1].to(kv.device)].to(q.device)                  # (rows, topk, d_qk)
        k = torch.where(valid[r0:r1, :, None], k, torch.zeros((), dtype=k.dtype, device=k.device))
        logits = torch.einsum("rhd,rkd->rhk", qf[r0:r1], k) * softmax_scale
        logits = logits.masked_fill(~valid[r0:r1, None, :], float("-inf"))
        l = torch.logsumexp(logits, dim=-1)                            # -inf for empty rows
        empty = torch.isneginf(l)
        p = torch.exp(logits - torch.where(empty, torch.zeros_like(l), l)[..., None])
        o = torch.einsum("rhk,rkd->rhd", p, k[..., :d_v])
        o = torch.where(empty[..., None], torch.zeros_like(o), o)
        out[r0:r1] = o
        lse[r0:r1] = torch.where(empty, torch.full_like(l, math.inf), l)

    if attn_sink is not None:
        sink = attn_sink.to(compute_dtype).view(1, h_q)
        # out *= 1 / (1 + exp(sink - lse)); written as a sigmoid so that +-inf sinks behave:
        # sink = +inf -> 0, sink = -inf -> 1. Empty rows (lse = +inf) stay 0.
        factor = torch.sigmoid(lse - sink)
        factor = torch.where(torch.isposinf(lse), torch.zeros_like(factor), factor)
        out = out * factor[..., None]
    return out.reshape(b, s_q, h_q, d_v), lse.reshape(b, s_q, h_q).transpose(1, 2)
