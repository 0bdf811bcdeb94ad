"""The oracle of every kernel test: sparse MLA decode in plain torch, fp32 math, and sparse MLA
prefill (FlashMLA's ``flash_mla_sparse_fwd``) in float64.

Independent of the kernels: it dequantizes the cache with its format's ``dequantize_cache``
(:mod:`cute_mla.formats`; any page-block stride), gathers each query token's top-k rows (and, for
V4, its extra pool's rows: one joint softmax over both lists), and computes softmax attention
directly (no online softmax, no splits). The prefill oracle gathers bf16 rows of a flat KV tensor
the same way (:func:`sparse_prefill_reference`).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .formats import detect_format


# The decode oracle's gathered keys per chunk of query tokens, at most (one token's keys if larger).
CHUNK_KEY_BYTES = 256 * 2**20


def key_chunk_rows(positions: int, d_qk: int, dtype: torch.dtype, budget: int = CHUNK_KEY_BYTES) -> int:
    """Query tokens whose gathered keys (``positions`` rows of ``d_qk`` in ``dtype`` each) fit in
    ``budget`` bytes; at least one."""
    return max(1, budget // (positions * d_qk * torch.finfo(dtype).bits // 8))


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
    chunk_rows: Optional[int] = None,
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
        chunk_rows: query tokens computed at once; None: as many as keep their gathered keys within
            CHUNK_KEY_BYTES (:func:`key_chunk_rows`; the suite runs many of these side by side on
            one GPU).
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
    if chunk_rows is None:
        chunk_rows = key_chunk_rows(valid.shape[1], d_qk, compute_dtype)
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


def sparse_prefill_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    chunk_bytes: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference sparse prefill (FlashMLA's ``flash_mla_sparse_fwd``, its ``tests/ref.py``), float64.

    Per query row ``i`` and head ``h``: slots ``j >= topk_length[i]`` (when given), indices ``< 0``
    and indices ``>= s_kv`` are invalid; ``P = sm_scale * q[i, h] . kv[idx]`` over the full d_qk,
    -inf at invalid slots; ``max_logits = max(P)``, ``lse = logsumexp(P)`` (natural units, no
    sink); ``out = exp(P - logaddexp(lse, attn_sink[h])) @ kv[idx][:, :d_v]``, i.e. softmax(P) @ V
    scaled by ``1 / (1 + exp(sink - lse))`` (+inf sink: 0; -inf sink: no effect). A row with no
    valid slot: out 0, max_logits -inf, lse +inf, whatever the sink.

    Computed on q's device in chunks of query rows (``chunk_bytes`` of temporaries each: by
    default a quarter of the free GPU memory up to 1 GiB, 256 MiB on the host). KV rows no valid
    slot reads are never part of the math (masked with ``torch.where``): NaN there does not reach
    the result. The rows' valid slots are packed to the front first (the softmax does not depend
    on their order), so lists with few valid slots cost what those slots cost.

    Args:
        q: (s_q, h_q, d_qk) queries (bf16 in production), any strides.
        kv: (s_kv, 1, d_qk) keys; the first ``d_v`` columns are V. Any strides.
        indices: (s_q, 1, topk) integer row indices into kv.
        sm_scale: multiplies q.k.
        d_v: V columns (512).
        attn_sink: (h_q,) fp32 or None.
        topk_length: (s_q,) integers or None; a negative length is an empty list.

    Returns:
        out (s_q, h_q, d_v), max_logits (s_q, h_q), lse (s_q, h_q), all fp32 (float64 math).
    """
    s_q, h_q, d_qk = q.shape
    s_kv = kv.shape[0]
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != d_qk:
        raise ValueError(f"sparse_prefill_reference: kv must be (s_kv, 1, {d_qk}), got {tuple(kv.shape)}")
    if indices.dim() != 3 or indices.shape[0] != s_q or indices.shape[1] != 1:
        raise ValueError(f"sparse_prefill_reference: indices must be ({s_q}, 1, topk), got {tuple(indices.shape)}")
    if not 0 < d_v <= d_qk:
        raise ValueError(f"sparse_prefill_reference: d_v must be in (0, {d_qk}], got {d_v}")
    dev = q.device
    f64 = torch.float64
    topk = indices.shape[-1]
    idx = indices[:, 0].to(dev, torch.int64)                             # (s_q, topk)
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        length = topk_length.to(dev, torch.int64).view(s_q, 1)
        valid &= torch.arange(topk, device=dev).view(1, topk) < length
    # valid slots first (a stable sort keeps their order), then only as many slots as the fullest row has
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    valid = torch.gather(valid, 1, order)
    idx = torch.gather(idx, 1, order)
    k_eff = max(int(valid.sum(dim=1).max()) if s_q else 0, 1)
    valid, idx = valid[:, :k_eff].contiguous(), idx[:, :k_eff]
    safe = torch.where(valid, idx, torch.zeros((), dtype=torch.int64, device=dev))

    kv_rows = kv[:, 0].to(dev)                                           # (s_kv, d_qk), kv's dtype
    if chunk_bytes is None:
        chunk_bytes = 256 << 20
        if dev.type == "cuda":
            chunk_bytes = max(64 << 20, min(1 << 30, torch.cuda.mem_get_info(dev)[0] // 4))
    # per query row: the gathered rows (kv's dtype, then float64), the logits and their exponentials
    # (float64, ~3 live copies), the row's q and out in float64
    row_bytes = k_eff * d_qk * (kv_rows.element_size() + 2 * 8) + 3 * h_q * k_eff * 8 + h_q * (d_qk + d_v) * 8
    chunk = max(1, chunk_bytes // row_bytes)

    sink = None if attn_sink is None else attn_sink.to(dev, f64).view(1, h_q)
    out = torch.empty(s_q, h_q, d_v, dtype=torch.float32, device=dev)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=dev)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=dev)
    zero = torch.zeros((), dtype=kv_rows.dtype, device=dev)
    for r0 in range(0, s_q, chunk):
        r1 = min(r0 + chunk, s_q)
        vr = valid[r0:r1]                                                # (rows, k_eff)
        k = kv_rows.index_select(0, safe[r0:r1].reshape(-1)).view(r1 - r0, k_eff, d_qk)
        k = torch.where(vr[:, :, None], k, zero).to(f64)                 # unread rows (NaN or not) are 0
        logits = torch.einsum("rhd,rkd->rhk", q[r0:r1].to(f64), k) * sm_scale
        logits = logits.masked_fill(~vr[:, None, :], -math.inf)
        l = torch.logsumexp(logits, dim=-1)                              # (rows, h_q); -inf: no valid slot
        m = logits.amax(dim=-1)
        empty = ~vr.any(dim=1, keepdim=True).expand(-1, h_q)
        lse_for_o = l if sink is None else torch.logaddexp(l, sink)     # +inf sink: +inf, so out 0
        lse_for_o = torch.where(empty, torch.full_like(l, math.inf), lse_for_o)
        p = torch.exp(logits - lse_for_o[..., None])
        o = torch.einsum("rhk,rkd->rhd", p, k[..., :d_v])
        out[r0:r1] = torch.where(empty[..., None], torch.zeros_like(o), o)
        max_logits[r0:r1] = torch.where(empty, torch.full_like(m, -math.inf), m)
        lse[r0:r1] = torch.where(empty, torch.full_like(l, math.inf), l)
    return out, max_logits, lse
