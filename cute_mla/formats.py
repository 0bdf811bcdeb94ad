"""KV-cache formats of the sparse decode path (spec §2).

A format is identified by ``(d_qk, bytes_per_token)``. Today only DeepSeek V3.2's FP8 row exists
(656 bytes, d_qk 576); V4 (584 bytes, d_qk 512, page-block-major scales) can be registered beside it
without touching callers: everything goes through :class:`KVCacheFormat` and :func:`detect_format`.

V3.2 row (token-interleaved, 656 bytes)::

    bytes   0..511  512 x float8_e4m3fn  NoPE latent, group g = values [128g, 128g+128)
    bytes 512..527    4 x fp32           scale of each NoPE group
    bytes 528..655   64 x bf16           RoPE, not quantized
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class KVCacheFormat:
    """What a kernel and the host need to know about one cache row format."""

    name: str
    d_qk: int            # key width (NoPE + RoPE)
    d_v: int             # value width (the first d_v dims of the key)
    bytes_per_token: int
    d_nope: int
    d_rope: int
    group_size: int      # NoPE values per scale
    quantize: Callable[..., torch.Tensor]
    dequantize: Callable[..., torch.Tensor]

    @property
    def num_groups(self) -> int:
        return self.d_nope // self.group_size


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    # FlashMLA's recipe: the smallest power of two that maps amax into e4m3's range.
    return torch.pow(2.0, torch.ceil(torch.log2(torch.clamp(amax / FP8_E4M3_MAX, min=1e-4))))


def quantize_v32(kv: torch.Tensor, power_of_two_scales: bool = True) -> torch.Tensor:
    """Quantize ``kv`` (N, 576) float to V3.2 rows (N, 656) uint8.

    ``power_of_two_scales=True`` is FlashMLA's recipe (scale = 2^ceil(log2(amax/448)), at least
    2^ceil(log2(1e-4))). ``False`` uses the exact amax/448 scale, which kernels must handle as well
    (writers in the wild emit such scales).
    """
    if kv.dim() != 2 or kv.shape[1] != 576:
        raise ValueError(f"kv: expected shape (N, 576), got {tuple(kv.shape)}")
    kv = kv.float()
    n = kv.shape[0]
    nope = kv[:, :512].reshape(n, 4, 128)
    rope = kv[:, 512:]
    amax = nope.abs().amax(dim=-1)
    if power_of_two_scales:
        scale = _pow2_scale(amax)
    else:
        scale = torch.clamp(amax / FP8_E4M3_MAX, min=1e-4)
    fp8 = (nope / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(n, 656, dtype=torch.uint8, device=kv.device)
    out[:, :512] = fp8.reshape(n, 512).view(torch.uint8)
    out[:, 512:528] = scale.to(torch.float32).contiguous().view(torch.uint8).reshape(n, 16)
    out[:, 528:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 128)
    return out


def dequantize_v32(raw: torch.Tensor) -> torch.Tensor:
    """Dequantize V3.2 rows (..., 656) uint8 to (..., 576) float32: k[j] = fp8[j] * scale[j // 128]."""
    if raw.shape[-1] != 656:
        raise ValueError(f"raw: expected last dim 656 (V3.2 bytes per token), got {raw.shape[-1]}")
    lead = raw.shape[:-1]
    r = raw.reshape(-1, 656).contiguous()
    if r.dtype != torch.uint8:
        r = r.view(torch.uint8)
    n = r.shape[0]
    fp8 = r[:, :512].contiguous().view(torch.float8_e4m3fn).float().reshape(n, 4, 128)
    scale = r[:, 512:528].contiguous().view(torch.float32).reshape(n, 4, 1)
    rope = r[:, 528:].contiguous().view(torch.bfloat16).float()
    out = torch.cat([(fp8 * scale).reshape(n, 512), rope], dim=1)
    return out.reshape(*lead, 576)


V32 = KVCacheFormat(
    name="V32", d_qk=576, d_v=512, bytes_per_token=656, d_nope=512, d_rope=64, group_size=128,
    quantize=quantize_v32, dequantize=dequantize_v32,
)

# (d_qk, bytes_per_token) -> format. V4 (512, 584), V4.1 (512, 528) ... go here when implemented.
_FORMATS: Dict[Tuple[int, int], KVCacheFormat] = {(V32.d_qk, V32.bytes_per_token): V32}

# Formats FlashMLA knows but cute-mla does not implement yet: a clear NotImplementedError for them.
_KNOWN_UNIMPLEMENTED = {(576, 352): "V32_NVFP4_FP8ROPE", (512, 584): "V4", (512, 528): "V41", (512, 288): "V41_FP4"}


def supported_formats() -> Tuple[KVCacheFormat, ...]:
    return tuple(_FORMATS.values())


def detect_format(d_qk: int, bytes_per_token: int) -> KVCacheFormat:
    """The cache format of a ``(d_qk, bytes_per_token)`` pair, or a clear error."""
    fmt = _FORMATS.get((int(d_qk), int(bytes_per_token)))
    if fmt is not None:
        return fmt
    accepted = ", ".join(f"{f.name} (d_qk={f.d_qk}, {f.bytes_per_token} bytes/token)" for f in _FORMATS.values())
    name = _KNOWN_UNIMPLEMENTED.get((int(d_qk), int(bytes_per_token)))
    if name is not None:
        raise NotImplementedError(
            f"k_cache: the {name} format (d_qk={d_qk}, {bytes_per_token} bytes/token) is not implemented yet; accepted: {accepted}")
    raise ValueError(
        f"k_cache: unknown cache format for d_qk={d_qk} with {bytes_per_token} bytes per token; accepted: {accepted}")
