"""DeepSeek V4's FP8 cache ("MODEL1", 584 bytes per token): its layout, the host quantizer and
dequantizer, and the device dequant routine each arch's producer calls.

Page-block-major: a block of ``page`` tokens holds ``page`` data rows, then ``page`` scale rows::

    data row  (576 B, at row * 576)             448 x float8_e4m3fn NoPE, then 64 x bf16 RoPE
    scale row (8 B, at page * 576 + row * 8)    7 x ue8m0 (one per 64 NoPE dims), 1 pad byte

and a quantizer pads each block to a multiple of 576 bytes. Key ``k[j] = e4m3[j] *
2^(e8m0[j // 64] - 127)`` for j < 448, ``k[448 + r] = rope[r]``; V is all 512 dims, RoPE
included, so an invalid token's RoPE must read as zero as well.
"""

from __future__ import annotations

import torch

from .layout import FP8_E4M3_MAX, E4m3Dequant, KVCacheFormat, block_bytes, padded_cache, pow2_scale

ROW_BYTES = 584
D_QK, D_V, D_NOPE, D_ROPE, GROUP = 512, 512, 448, 64, 64
DATA_ROW_BYTES = D_NOPE + 2 * D_ROPE    # 576
ROPE_OFFSET = D_NOPE
NUM_SCALES = D_NOPE // GROUP            # 7
SCALE_ROW_BYTES = 8                     # the 7 scales and a pad byte
BLOCK_ALIGN = DATA_ROW_BYTES
assert DATA_ROW_BYTES + SCALE_ROW_BYTES == ROW_BYTES and NUM_SCALES < SCALE_ROW_BYTES


def quantize_v4(kv: torch.Tensor, stride0: int | None = None) -> torch.Tensor:
    """``kv`` (num_blocks, page_block_size, 512) float -> a (num_blocks, page_block_size, 1, 584)
    uint8 view of a block-major buffer whose blocks are ``stride0`` bytes apart (default: padded
    to a multiple of 576 B, as FlashMLA's quantizer). Scales are ``2^ceil(log2(max(amax/448,
    1e-4)))`` per 64-dim group, stored as ue8m0."""
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv: expected a torch.Tensor (num_blocks, page_block_size, {D_QK}), got {type(kv).__name__}")
    if kv.dim() != 3 or kv.shape[2] != D_QK:
        raise ValueError(f"kv: expected shape (num_blocks, page_block_size, {D_QK}), got {tuple(kv.shape)}")
    nb, page, _ = kv.shape
    stride0 = V4.quantizer_stride0(page, stride0)
    kv = kv.float()
    nope = kv[..., :D_NOPE].reshape(nb, page, NUM_SCALES, GROUP)
    scale = pow2_scale(nope.abs().amax(dim=-1))                                  # (nb, page, 7)
    fp8 = (nope / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    data = torch.empty(nb, page, DATA_ROW_BYTES, dtype=torch.uint8, device=kv.device)
    data[..., :D_NOPE] = fp8.reshape(nb, page, D_NOPE).view(torch.uint8)
    data[..., ROPE_OFFSET:] = kv[..., D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(nb, page, SCALE_ROW_BYTES, dtype=torch.uint8, device=kv.device)
    scales[..., :NUM_SCALES] = (torch.log2(scale).round().to(torch.int32) + 127).to(torch.uint8)
    blocks = torch.cat([data.reshape(nb, page * DATA_ROW_BYTES), scales.reshape(nb, page * SCALE_ROW_BYTES)], dim=1)
    return padded_cache(blocks, page, ROW_BYTES, stride0)


def dequantize_v4(k_cache: torch.Tensor) -> torch.Tensor:
    """A V4 cache (num_blocks, page_block_size[, 1], 584), any stride(0) -> (num_blocks,
    page_block_size, 512) float32."""
    blocks = block_bytes(k_cache, ROW_BYTES)
    nb = blocks.shape[0]
    page = blocks.shape[1] // ROW_BYTES
    data = blocks[:, :page * DATA_ROW_BYTES].reshape(nb, page, DATA_ROW_BYTES)
    scales = blocks[:, page * DATA_ROW_BYTES:].reshape(nb, page, SCALE_ROW_BYTES)[..., :NUM_SCALES]
    fp8 = data[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(nb, page, NUM_SCALES, GROUP)
    scale = torch.pow(2.0, scales.to(torch.float32) - 127.0).unsqueeze(-1)
    rope = data[..., ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(fp8 * scale).reshape(nb, page, D_NOPE), rope], dim=-1)


class Dequant(E4m3Dequant):
    """The device dequant routine of V4 rows: the e4m3 conversions of every format, V4's scales.

    A row's scales are loaded as two i32 words (its 8-byte scale row), four ue8m0 bytes per word
    (``packed_scales``: a producer derives each chunk's scale from the words where it uses it).
    :meth:`scale_bits` turns byte ``k`` into the fp32 bits of 2^(e - 127) for the exact path (byte 0
    reads as the fp32 denormal 2^-127); :meth:`packed_multiplier` makes the fast path's bf16x2
    multiplier 2^(e - 7) straight from the byte, exact for 1 <= e <= 134
    (:meth:`packed_takes_fast_path`), the range :meth:`scale_takes_fast_path` accepts.
    """

    scale_words = 2
    packed_scales = True
    scale_group = GROUP

    @staticmethod
    def scale_bits(words, k: int):
        from ..dsl import ptx
        return ptx.ue8m0_to_f32_bits(words[k // 4], k % 4)

    @staticmethod
    def packed_takes_fast_path(words, k: int):
        from ..dsl import ptx
        return ptx.ue8m0_takes_fast_path(words[k // 4], k % 4)

    @staticmethod
    def packed_multiplier(words, k: int):
        from ..dsl import ptx
        return ptx.ue8m0_pow2_multiplier(words[k // 4], k % 4)


V4 = KVCacheFormat(
    name="V4", d_qk=D_QK, d_v=D_V, row_bytes=ROW_BYTES, d_nope=D_NOPE, d_rope=D_ROPE,
    nope_dtype="float8_e4m3fn", nope_offset=0, scale_dtype="float8_e8m0fnu", scale_offset=0,
    group_size=GROUP, rope_offset=ROPE_OFFSET, v_includes_rope=True,
    data_row_bytes=DATA_ROW_BYTES, scales_in_row=False, scale_row_bytes=SCALE_ROW_BYTES, block_align=BLOCK_ALIGN, extra_pool=True,
    quantize_cache=quantize_v4, dequantize_cache=dequantize_v4, dequant=Dequant,
)
