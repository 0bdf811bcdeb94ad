"""The oracle of every kernel test: sparse MLA decode in plain torch, fp32 math.

Independent of the kernels: it dequantizes the cache with its format's ``dequantize_cache``
(:mod:`cute_mla.formats`; any page-block stride), gathers each query token's top-k rows (and, for
V4, its extra pool's rows: one joint softmax over both lists), and computes softmax attention
directly (no online softmax, no splits).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .formats import detect_format


def dequantized_pool(k_cache: torch.Tensor, d_qk: int, kv_as_bf16: bool = True,
                     compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A cache (num_blocks, page_block_size[, 1], bytes_per_token), any byte dtype and stride(0), as
    (num_blocks * page_block_size, d_qk) keys in ``compute_dtype`` (token ``i`` at row ``i``), its
    format detected from ``(d_qk, bytes_per_token)``; rounded to bf16 first when ``kv_as_bf16``."""
    fmt = detect_format(d_qk, k_cache.shape[-1])
    kv = fmt.dequantize_cache(k_cache)
    kv = kv.reshape(kv.shape[0] * kv.shape[1], fmt.d_qk)
    if kv_as_bf16:
        kv = kv.to(torch.bfloat16)
    return kv.to(compute_dtype)


def valid_positions(indices: torch.Tensor, num_tokens: int, length: Optional[torch.Tensor]) -> torch.Tensor:
    """(b, s_q, topk) bool: index >= 0, < num_tokens and at a position < ``length[b]`` (when given)."""
    b, _, topk = indices.shape
    idx = indices.to(torch.int64)
    valid = (idx >= 0) & (idx < num_tokens)
    if length is not None:
        pos = torch.arange(topk, device=idx.device)
        valid &= pos.view(1, 1, topk) < length.to(idx.device).view(b, 1, 1).to(torch.int64)
    return valid


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
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference sparse decode.

    Args:
        q: (b, s_q, h_q, d_qk) queries (any float dtype; bf16 in production). d_qk 576 is V3.2, 512 V4.
        k_cache: (num_blocks, page_block_size, 1, bytes_per_token) or (num_blocks, page_block_size,
            bytes_per_token) raw cache bytes (uint8 / int8 / float8 views all accepted, any
            stride(0)); the format is detected from (d_qk, bytes_per_token).
        indices: (b, s_q, topk) int32 token indices (block * page_block_size + row); -1, any
            negative value and any value past the cache's last token are invalid.
        softmax_scale: multiplies q.k.
        attn_sink: (h_q,) fp32 or None. Scales out by 1/(1 + exp(sink - lse)); lse unchanged.
        topk_length: (b,) int32 or None. Request i uses only its first topk_length[i] indices.
        kv_as_bf16: round the dequantized keys to bf16 before the math, as the kernels' MMAs see
            them (FlashMLA's test reference does the same). False keeps the fp32 dequantized values.
        compute_dtype: torch.float32 (default) or torch.float64.
        extra_k_cache, extra_indices, extra_topk_length: V4's extra pool (a second cache of the
            same format, its own page block size), its (b, s_q, extra_topk) indices and their (b,)
            lengths, validity as for the main list; the softmax is taken jointly over both lists.

    Returns:
        out (b, s_q, h_q, d_v) in compute_dtype (0 for a row with no valid token) and
        lse (b, h_q, s_q) in compute_dtype, natural log (+inf for a row with no valid token).
    """
    b, s_q, h_q, d_qk = q.shape
    if (extra_k_cache is None) != (extra_indices is None):
        raise ValueError("sparse_decode_reference: give extra_k_cache and extra_indices together")
    if extra_topk_length is not None and extra_k_cache is None:
        raise ValueError("sparse_decode_reference: extra_topk_length without an extra pool")
    pools = [(k_cache, indices, topk_length)]
    if extra_k_cache is not None:
        pools.append((extra_k_cache, extra_indices, extra_topk_length))
    kvs, safes, valids = [], [], []
    for cache, idx, length in pools:
        kv = dequantized_pool(cache, d_qk, kv_as_bf16, compute_dtype)
        valid = valid_positions(idx, kv.shape[0], length)
        safe = torch.where(valid, idx.to(torch.int64), torch.zeros((), dtype=torch.int64, device=idx.device))
        kvs.append(kv)
        safes.append(safe.reshape(b * s_q, -1))
        valids.append(valid.reshape(b * s_q, -1))

    qf = q.to(compute_dtype).reshape(b * s_q, h_q, d_qk)
    valid = torch.cat(valids, dim=1)
    out = torch.empty(b * s_q, h_q, d_v, dtype=compute_dtype, device=q.device)
    lse = torch.empty(b * s_q, h_q, dtype=compute_dtype, device=q.device)
    for r0 in range(0, b * s_q, chunk_rows):
        r1 = min(r0 + chunk_rows, b * s_q)
        k = torch.cat([kv[safe[r0:r1].to(kv.device)].to(q.device) for kv, safe in zip(kvs, safes)], dim=1)
        vr = valid[r0:r1].to(q.device)                                  # (rows, topk [+ extra_topk])
        k = torch.where(vr[:, :, None], k, torch.zeros((), dtype=k.dtype, device=k.device))
        logits = torch.einsum("rhd,rkd->rhk", qf[r0:r1], k) * softmax_scale
        logits = logits.masked_fill(~vr[:, None, :], float("-inf"))
        l = torch.logsumexp(logits, dim=-1)                            # -inf for empty rows
        empty = torch.isneginf(l)
        p = torch.exp(logits - torch.where(empty, torch.zeros_like(l), l)[..., None])
        o = torch.einsum("rhk,rkd->rhd", p, k[..., :d_v])
        o = torch.where(empty[..., None], torch.zeros_like(o), o)
        out[r0:r1] = o
        lse[r0:r1] = torch.where(empty, torch.full_like(l, math.inf), l)

    if attn_sink is not None:
        sink = attn_sink.to(compute_dtype).to(q.device).view(1, h_q)
        # out *= 1 / (1 + exp(sink - lse)); written as a sigmoid so that +-inf sinks behave:
        # sink = +inf -> 0, sink = -inf -> 1. Empty rows (lse = +inf) stay 0.
        factor = torch.sigmoid(lse - sink)
        factor = torch.where(torch.isposinf(lse), torch.zeros_like(factor), factor)
        out = out * factor[..., None]
    return out.reshape(b, s_q, h_q, d_v), lse.reshape(b, s_q, h_q).transpose(1, 2)
