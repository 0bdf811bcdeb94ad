"""DeepSeek V3.2's FP8 cache row: its layout, the host quantizer and dequantizer, and the device
dequant routine each arch's producer calls.

Row (token-interleaved, 656 bytes)::

    bytes   0..511  512 x float8_e4m3fn  NoPE latent, group g = values [128g, 128g+128)
    bytes 512..527    4 x fp32           scale of each NoPE group
    bytes 528..655   64 x bf16           RoPE, not quantized

Key ``k[j] = fp8[j] * scale[j // 128]`` for j < 512, ``k[512 + r] = rope[r]``; V is the first 512
dims (no RoPE). The kernels round each key to bf16 once: ``bf16(float(fp8) * scale)``.
"""

from __future__ import annotations

import torch

from .layout import FP8_E4M3_MAX, E4m3Dequant, KVCacheFormat, cache_bytes, padded_cache, pow2_scale

ROW_BYTES = 656
D_QK, D_V, D_NOPE, D_ROPE, GROUP = 576, 512, 512, 64, 128
SCALE_OFFSET = D_NOPE                    # 4 fp32 scales right after the NoPE bytes
ROPE_OFFSET = SCALE_OFFSET + 4 * (D_NOPE // GROUP)
assert ROPE_OFFSET + 2 * D_ROPE == ROW_BYTES


def quantize_v32(kv: torch.Tensor, power_of_two_scales: bool = True) -> torch.Tensor:
    """Quantize ``kv`` (N, 576) float to V3.2 rows (N, 656) uint8.

    ``power_of_two_scales=True`` is FlashMLA's recipe (scale = 2^ceil(log2(amax/448)), at least
    2^ceil(log2(1e-4))). ``False`` uses the exact amax/448 scale, which kernels must handle as well
    (writers in the wild emit such scales).
    """
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv: expected a torch.Tensor (N, {D_QK}), got {type(kv).__name__}")
    if kv.dim() != 2 or kv.shape[1] != D_QK:
        raise ValueError(f"kv: expected shape (N, {D_QK}), got {tuple(kv.shape)}")
    kv = kv.float()
    n = kv.shape[0]
    nope = kv[:, :D_NOPE].reshape(n, D_NOPE // GROUP, GROUP)
    rope = kv[:, D_NOPE:]
    amax = nope.abs().amax(dim=-1)
    if power_of_two_scales:
        scale = pow2_scale(amax)
    else:
        scale = torch.clamp(amax / FP8_E4M3_MAX, min=1e-4)
    fp8 = (nope / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(n, ROW_BYTES, dtype=torch.uint8, device=kv.device)
    out[:, :D_NOPE] = fp8.reshape(n, D_NOPE).view(torch.uint8)
    out[:, SCALE_OFFSET:ROPE_OFFSET] = scale.to(torch.float32).contiguous().view(torch.uint8).reshape(
        n, ROPE_OFFSET - SCALE_OFFSET)   # (explicit: N may be 0)
    out[:, ROPE_OFFSET:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 2 * D_ROPE)
    return out


def dequantize_v32(raw: torch.Tensor) -> torch.Tensor:
    """Dequantize V3.2 rows (..., 656) uint8 to (..., 576) float32: k[j] = fp8[j] * scale[j // 128]."""
    if raw.shape[-1] != ROW_BYTES:
        raise ValueError(f"raw: expected last dim {ROW_BYTES} (V3.2 bytes per token), got {raw.shape[-1]}")
    lead = raw.shape[:-1]
    r = raw.reshape(-1, ROW_BYTES).contiguous()
    if r.dtype != torch.uint8:
        r = r.view(torch.uint8)
    n = r.shape[0]
    fp8 = r[:, :D_NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(n, D_NOPE // GROUP, GROUP)
    scale = r[:, SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32).reshape(n, D_NOPE // GROUP, 1)
    rope = r[:, ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    out = torch.cat([(fp8 * scale).reshape(n, D_NOPE), rope], dim=1)
    return out.reshape(*lead, D_QK)


def quantize_cache_v32(kv: torch.Tensor, power_of_two_scales: bool = True, stride0: int | None = None) -> torch.Tensor:
    """``kv`` (num_blocks, page_block_size, 576) float -> a (num_blocks, page_block_size, 1, 656)
    uint8 view of a block-major buffer (page blocks ``stride0`` bytes apart, default packed)."""
    if kv.dim() != 3 or kv.shape[2] != D_QK:
        raise ValueError(f"kv: expected shape (num_blocks, page_block_size, {D_QK}), got {tuple(kv.shape)}")
    nb, page, _ = kv.shape
    rows = quantize_v32(kv.reshape(nb * page, D_QK), power_of_two_scales)
    return padded_cache(rows.reshape(nb, page * ROW_BYTES), page, ROW_BYTES, V32.quantizer_stride0(page, stride0))


def dequantize_cache_v32(k_cache: torch.Tensor) -> torch.Tensor:
    """A V3.2 cache (num_blocks, page_block_size[, 1], 656) -> (num_blocks, page_block_size, 576) float32."""
    raw = cache_bytes(k_cache, ROW_BYTES)
    return dequantize_v32(raw)


class Dequant(E4m3Dequant):
    """V3.2's scales: four fp32 per row, one per 128 NoPE dims, loaded as four words. Rounding the
    scale to bf16 first (FlashMLA's SM90 numerics) fails the cosine and lse tolerances with scales
    that are not powers of two, hence the exact path for those."""

    scale_words = 4
    packed_scales = False
    scale_group = GROUP

    @staticmethod
    def scale_bits(words, k: int):
        """The fp32 bits of scale ``k`` from a row's loaded scale words."""
        return words[k]


V32 = KVCacheFormat(
    name="V3.2", d_qk=D_QK, d_v=D_V, row_bytes=ROW_BYTES, d_nope=D_NOPE, d_rope=D_ROPE,
    nope_dtype="float8_e4m3fn", nope_offset=0, scale_dtype="float32", scale_offset=SCALE_OFFSET,
    group_size=GROUP, rope_offset=ROPE_OFFSET, v_includes_rope=False,
    data_row_bytes=ROW_BYTES, scales_in_row=True, scale_row_bytes=0, block_align=ROW_BYTES, extra_pool=False,
    quantize_cache=quantize_cache_v32, dequantize_cache=dequantize_cache_v32, dequant=Dequant,
)
