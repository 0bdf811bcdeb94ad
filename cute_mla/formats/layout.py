"""What every cache format module declares: its row layout as a frozen spec, read by the host
(validation, plan, quantizers, reference) and by each arch's producer (through the spec's numbers
and the format module's device dequant routine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class KVCacheFormat:
    """One cache row format. A format is identified by ``(d_qk, row_bytes)``.

    Key ``k`` of a token is ``d_nope`` quantized values (``nope_dtype``, one scale per
    ``group_size`` of them) followed by ``d_rope`` RoPE values stored as bf16; the value vector is
    the first ``d_v`` dims of the key (``v_includes_rope``: whether they reach into the RoPE part).
    """

    name: str
    d_qk: int                  # key width (NoPE + RoPE)
    d_v: int                   # value width: the first d_v dims of the key
    row_bytes: int             # bytes per token in the cache (the last dim of k_cache)
    d_nope: int
    d_rope: int
    nope_dtype: str            # element type of the quantized NoPE part
    nope_offset: int           # byte offset of the NoPE values in a row
    scale_dtype: str           # element type of a scale
    scale_offset: int          # byte offset of the scales in a row
    group_size: int            # NoPE values per scale
    rope_offset: int           # byte offset of the bf16 RoPE values in a row
    v_includes_rope: bool
    quantize: Callable[..., torch.Tensor]     # (N, d_qk) float -> (N, row_bytes) uint8
    dequantize: Callable[..., torch.Tensor]   # (..., row_bytes) -> (..., d_qk) float32
    dequant: type              # the device dequant routine each arch's producer calls (the format module's)

    @property
    def num_groups(self) -> int:
        return self.d_nope // self.group_size

    @property
    def bytes_per_token(self) -> int:
        return self.row_bytes


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """FlashMLA's recipe: the smallest power of two that maps ``amax`` into e4m3's range, at least
    2^ceil(log2(1e-4))."""
    return torch.pow(2.0, torch.ceil(torch.log2(torch.clamp(amax / FP8_E4M3_MAX, min=1e-4))))


@dataclass(frozen=True)
class FormatGeometry:
    """The part of a kernel's tile geometry the cache format decides; each arch's ``Tile`` extends
    it with its own numbers and names its format in ``fmt``."""

    fmt: KVCacheFormat

    @property
    def d_qk(self) -> int:
        return self.fmt.d_qk

    @property
    def d_v(self) -> int:
        return self.fmt.d_v

    @property
    def d_nope(self) -> int:
        return self.fmt.d_nope

    @property
    def d_rope(self) -> int:
        return self.fmt.d_rope

    @property
    def row_bytes(self) -> int:
        return self.fmt.row_bytes

    @property
    def scale_offset(self) -> int:
        return self.fmt.scale_offset

    @property
    def rope_offset(self) -> int:
        return self.fmt.rope_offset
