import pytest
import torch

from cute_mla.formats import V32, detect_format, dequantize_v32, quantize_v32


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
    with pytest.raises(NotImplementedError, match="V4 format"):
        detect_format(512, 584)
    with pytest.raises(ValueError, match="unknown cache format for d_qk=576 with 600 bytes"):
        detect_format(576, 600)


def test_quantize_rejects_bad_shape():
    with pytest.raises(ValueError, match=r"kv: expected shape \(N, 576\)"):
        quantize_v32(torch.zeros(4, 512))
    with pytest.raises(ValueError, match="raw: expected last dim 656"):
        dequantize_v32(torch.zeros(4, 600, dtype=torch.uint8))
