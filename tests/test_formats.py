import pytest
import torch

import math

from cute_mla.formats import (V4, V32, dequantize_cache_v32, dequantize_v4, dequantize_v32, detect_format,
                              quantize_cache_v32, quantize_v4, quantize_v32)


@pytest.mark.parametrize("pow2", [True, False])
def test_v32_round_trip(seed, pow2):
    kv = (torch.randn(300, 576) / 10).clamp(-1, 1)
    kv[7] = 0.0                       # an all-zero token: scale floor, values exactly 0
    raw = quantize_v32(kv, power_of_two_scales=pow2)
    assert raw.dtype == torch.uint8 and raw.shape == (300, 656)
    back = dequantize_v32(raw)
    assert back.shape == (300, 576)
    # RoPE is stored as bf16: exact up to bf16 rounding
    torch.testing.assert_close(back[:, 512:], kv[:, 512:].to(torch.bfloat16).float(), rtol=0, atol=0)
    # NoPE: e4m3 has 3 mantissa bits -> relative error <= 2^-4 of each group's amax scale
    err = (back[:, :512] - kv[:, :512]).abs().reshape(300, 4, 128)
    amax = kv[:, :512].abs().reshape(300, 4, 128).amax(-1, keepdim=True)
    assert (err <= amax * 2**-4 + 1e-6).all()
    assert (back[7] == 0).all()
    scales = raw[:, 512:528].contiguous().view(torch.float32)
    if pow2:
        m, _ = torch.frexp(scales)
        assert (m == 0.5).all(), "FlashMLA's recipe gives power-of-two scales"
    else:
        assert ((torch.frexp(scales)[0] != 0.5).float().mean() > 0.9)


def test_v32_layout_bytes():
    kv = torch.zeros(1, 576)
    kv[0, 0] = 1.0          # group 0 amax 1 -> pow2 scale 2^ceil(log2(1/448)) = 2^-8
    kv[0, 512] = 2.0
    raw = quantize_v32(kv)
    assert raw[0, 512:516].view(torch.float32).item() == 2.0 ** -8
    assert raw[0, :1].view(torch.float8_e4m3fn).float().item() == 256.0
    assert raw[0, 528:530].view(torch.bfloat16).float().item() == 2.0


def test_detect_format():
    assert detect_format(576, 656) is V32
    assert detect_format(512, 584) is V4
    with pytest.raises(NotImplementedError, match="V41 format"):
        detect_format(512, 528)
    with pytest.raises(ValueError, match="unknown cache format for d_qk=512 with 656 bytes"):
        detect_format(512, 656)
    with pytest.raises(ValueError, match="unknown cache format for d_qk=576 with 600 bytes"):
        detect_format(576, 600)


def test_quantize_rejects_bad_shape():
    with pytest.raises(ValueError, match=r"kv: expected shape \(N, 576\)"):
        quantize_v32(torch.zeros(4, 512))
    with pytest.raises(ValueError, match="raw: expected last dim 656"):
        dequantize_v32(torch.zeros(4, 600, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------- V4


def _v4_kv(nb, page, zero_token=None):
    kv = (torch.randn(nb, page, 512) / 10).clamp(-1, 1)
    kv[..., :448] *= torch.logspace(-3, 1, 7).repeat_interleave(64)   # groups of very different ranges
    if zero_token is not None:
        kv[zero_token] = 0.0
    return kv


def _storage(cache):
    """The whole buffer behind a cache view, as a flat uint8 tensor (padding included)."""
    return torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage())


def test_v4_spec():
    assert (V4.d_qk, V4.d_v, V4.row_bytes, V4.d_nope, V4.d_rope, V4.group_size) == (512, 512, 584, 448, 64, 64)
    assert V4.data_row_bytes == 576 and V4.scale_row_bytes == 8 and not V4.scales_in_row
    assert V4.v_includes_rope and V4.extra_pool and not V32.extra_pool
    assert V4.quantize_cache is quantize_v4 and V4.dequantize_cache is dequantize_v4
    assert V32.quantize_cache is quantize_cache_v32 and V32.dequantize_cache is dequantize_cache_v32


@pytest.mark.parametrize("page", [1, 2, 53, 61, 64])
def test_v4_round_trip(seed, page):
    nb = 3
    kv = _v4_kv(nb, page, zero_token=(1, page - 1))
    cache = quantize_v4(kv)
    assert cache.dtype == torch.uint8 and cache.shape == (nb, page, 1, 584)
    assert cache.stride() == (V4.block_stride(page), 584, 584, 1)
    back = dequantize_v4(cache)
    assert back.shape == (nb, page, 512) and back.dtype == torch.float32
    # RoPE is stored as bf16: exact up to bf16 rounding
    assert torch.equal(back[..., 448:], kv[..., 448:].to(torch.bfloat16).float())
    # NoPE: e4m3 has 3 mantissa bits -> error <= 2^-4 of each 64-dim group's amax (power-of-two scales)
    err = (back[..., :448] - kv[..., :448]).abs().reshape(nb, page, 7, 64)
    amax = kv[..., :448].abs().reshape(nb, page, 7, 64).amax(-1, keepdim=True)
    assert (err <= amax * 2**-4 + 1e-7).all()
    assert (back[1, page - 1] == 0).all()       # an all-zero token: the scale floor, values exactly 0
    # every dequantized key is exact in bf16 (e4m3 times a power of two): what the kernels' MMAs see
    assert torch.equal(back.to(torch.bfloat16).float(), back)
    # the 4-d view and a 3-d (no h_k dim) view of the same bytes, and other byte dtypes, read the same
    assert torch.equal(dequantize_v4(cache.squeeze(2)), back)
    assert torch.equal(dequantize_v4(cache.view(torch.float8_e4m3fn)), back)
    assert torch.equal(dequantize_v4(cache.view(torch.int8)), back)


@pytest.mark.parametrize("page", [1, 2, 53, 61, 64, 256])
def test_v4_block_stride_is_a_multiple_of_576(page):
    kv = torch.zeros(2, page, 512)
    cache = quantize_v4(kv)
    want = math.ceil(page * 584 / 576) * 576
    assert V4.block_stride(page) == want and cache.stride(0) == want
    assert _storage(cache).numel() == 2 * want


@pytest.mark.parametrize("page", [2, 53, 64])
def test_v4_byte_layout(page):
    """Data row of token (blk, row) at blk * stride(0) + row * 576: 448 e4m3 then 64 bf16 RoPE; its
    scale row at blk * stride(0) + page * 576 + row * 8: 7 ue8m0 bytes and a zero pad byte."""
    nb, blk, row = 3, 2, page - 1
    kv = torch.zeros(nb, page, 512)
    kv[blk, row, 0] = 1.0        # group 0: amax 1 -> scale 2^ceil(log2(1/448)) = 2^-8 (ue8m0 119), e4m3 256
    kv[blk, row, 65] = -0.3      # group 1: 2^ceil(log2(0.3/448)) = 2^-10 (117); -0.3 * 1024 = -307.2 -> e4m3 -320
    kv[blk, row, 447] = 100.0    # group 6: 2^ceil(log2(100/448)) = 2^-2 (125); 400 -> e4m3 384 (spacing 32 above 256)
    kv[blk, row, 448] = 2.0      # RoPE 0
    kv[blk, row, 511] = -1.5     # RoPE 63
    cache = quantize_v4(kv)
    flat = _storage(cache)
    stride0 = cache.stride(0)
    data = flat[blk * stride0 + row * 576: blk * stride0 + row * 576 + 576]
    scales = flat[blk * stride0 + page * 576 + row * 8: blk * stride0 + page * 576 + row * 8 + 8]
    e4m3 = data[:448].view(torch.float8_e4m3fn).float()
    assert e4m3[0].item() == 256.0 and e4m3[65].item() == -320.0 and e4m3[447].item() == 384.0
    assert (e4m3[1:65] == 0).all() and (e4m3[66:447] == 0).all()
    rope = data[448:].view(torch.bfloat16).float()
    assert rope[0].item() == 2.0 and rope[63].item() == -1.5 and (rope[1:63] == 0).all()
    floor = 127 + math.ceil(math.log2(1e-4))       # an all-zero group: 2^ceil(log2(1e-4)) = 2^-13
    assert scales.tolist() == [119, 117, floor, floor, floor, floor, 125, 0]
    # another token's scale row (all zero: the floor) and the bytes between the block's end and the next block
    other = flat[blk * stride0 + page * 576: blk * stride0 + page * 576 + 8]
    if page > 1:
        assert other.tolist() == [floor] * 7 + [0]
    assert (flat[blk * stride0 + page * 584: (blk + 1) * stride0] == 0).all()
    back = dequantize_v4(cache)
    assert back[blk, row, 0].item() == 1.0 and back[blk, row, 65].item() == -320 * 2**-10
    assert back[blk, row, 447].item() == 96.0 and back[blk, row, 448].item() == 2.0


def test_v4_scales_follow_flashmla_recipe(seed):
    nb, page = 4, 16
    kv = _v4_kv(nb, page, zero_token=(0, 3))
    kv[1, 2, :64] = 1e-9                           # below the floor
    cache = quantize_v4(kv)
    flat = _storage(cache)
    stride0 = cache.stride(0)
    got = torch.stack([flat[b * stride0 + page * 576: b * stride0 + page * 584].view(page, 8) for b in range(nb)])
    amax = kv[..., :448].abs().reshape(nb, page, 7, 64).amax(-1).double()
    want = torch.ceil(torch.log2(torch.clamp(amax / 448, min=1e-4))).to(torch.int64) + 127
    assert torch.equal(got[..., :7].to(torch.int64), want)
    assert (got[..., 7] == 0).all()                 # the pad byte


@pytest.mark.parametrize("page", [2, 53, 64])
def test_v4_dequantize_with_custom_stride(seed, page):
    kv = _v4_kv(3, page)
    ref = dequantize_v4(quantize_v4(kv))
    pad = -(-page * 584 // 16) * 16 + 48           # 16-B aligned, not a multiple of 576
    cache = quantize_v4(kv, stride0=pad)
    assert cache.stride(0) == pad
    assert torch.equal(dequantize_v4(cache), ref)
    # the blocks copied by hand into a buffer twice as wide, 16 B in (a view with a storage offset)
    wide = 2 * V4.block_stride(page)
    buf = torch.full((16 + 3 * wide,), 0xFF, dtype=torch.uint8)
    view = torch.as_strided(buf, (3, page, 1, 584), (wide, 584, 584, 1), 16)
    src = quantize_v4(kv)
    for b in range(3):
        n = page * 584
        buf[16 + b * wide: 16 + b * wide + n] = _storage(src)[b * src.stride(0): b * src.stride(0) + n]
    assert torch.equal(dequantize_v4(view), ref)


def test_v4_rejects_bad_input():
    with pytest.raises(ValueError, match=r"kv: expected shape \(num_blocks, page_block_size, 512\)"):
        quantize_v4(torch.zeros(4, 512))
    with pytest.raises(ValueError, match="stride0"):
        quantize_v4(torch.zeros(2, 4, 512), stride0=4 * 584 - 16)
    with pytest.raises(ValueError, match="stride0"):
        quantize_v4(torch.zeros(2, 4, 512), stride0=4 * 584 + 8)
    with pytest.raises(ValueError, match="k_cache"):
        dequantize_v4(torch.zeros(2, 4, 1, 656, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rows inside a page block must be packed"):
        dequantize_v4(torch.zeros(2, 4, 600, dtype=torch.uint8)[..., :584])


@pytest.mark.parametrize("pow2", [True, False])
def test_v32_cache_level_round_trip(seed, pow2):
    kv = (torch.randn(3, 53, 576) / 10).clamp(-1, 1)
    packed = quantize_cache_v32(kv, power_of_two_scales=pow2)
    assert packed.shape == (3, 53, 1, 656) and packed.stride(0) == 53 * 656
    padded = quantize_cache_v32(kv, power_of_two_scales=pow2, stride0=54 * 656)
    assert padded.stride(0) == 54 * 656
    rows = dequantize_v32(quantize_v32(kv.reshape(-1, 576), power_of_two_scales=pow2)).reshape(3, 53, 576)
    assert torch.equal(dequantize_cache_v32(packed), rows) and torch.equal(dequantize_cache_v32(padded), rows)


def test_quantizers_take_zero_rows_and_name_a_non_tensor():
    """Zero rows quantize to zero rows (no reshape error); an array that is not a torch tensor is
    refused by its type, not printed."""
    import numpy as np

    from cute_mla.formats import dequantize_v4, quantize_v4

    assert quantize_v32(torch.randn(0, 576)).shape == (0, 656)
    assert dequantize_v32(quantize_v32(torch.randn(0, 576))).shape == (0, 576)
    assert dequantize_v4(quantize_v4(torch.zeros(0, 64, 512))).shape == (0, 64, 512)
    with pytest.raises(TypeError, match=r"^kv: expected a torch.Tensor \(N, 576\), got ndarray$"):
        quantize_v32(np.zeros((3, 576)))
    with pytest.raises(TypeError, match="kv: expected a torch.Tensor"):
        quantize_v4(np.zeros((1, 64, 512)))


def test_formats_by_name():
    from cute_mla.formats import V4, format_named

    assert format_named("V3.2") is V32 and format_named("v32") is V32 and format_named("V4") is V4
    with pytest.raises(NotImplementedError, match="V41 is not implemented yet"):
        format_named("V41")
    with pytest.raises(ValueError, match="format: got 'V5', accepted: V3.2, V4"):
        format_named("V5")
