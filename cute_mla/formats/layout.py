"""What every cache format module declares: its row layout as a frozen spec, read by the host
(validation, plan, quantizers, reference) and by each arch's producer (through the spec's numbers
and the format module's device dequant routine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class KVCacheFormat:
    """One cache format. A format is identified by ``(d_qk, row_bytes)``.

    Key ``k`` of a token is ``d_nope`` quantized values (``nope_dtype``, one scale per
    ``group_size`` of them) followed by ``d_rope`` RoPE values stored as bf16; the value vector is
    the first ``d_v`` dims of the key (``v_includes_rope``: whether they reach into the RoPE part).

    Where a token's bytes are inside a page block (``page`` tokens, ``stride(0)`` bytes apart):

    * its data (NoPE, RoPE and, token-interleaved, the scales) at ``row * data_row_bytes``;
    * its scales at ``row * data_row_bytes + scale_offset`` when ``scales_in_row``, else in the
      block's scale rows after the data rows: ``page * data_row_bytes + row * scale_row_bytes +
      scale_offset``.
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
    rope_offset: int           # byte offset of the bf16 RoPE values in a data row
    v_includes_rope: bool
    data_row_bytes: int        # pitch of the data rows in a page block
    scales_in_row: bool        # scales inside the data row (token-interleaved) or in scale rows after them
    scale_row_bytes: int       # pitch of the scale rows (0 when scales_in_row)
    block_align: int           # a quantizer's page blocks are padded to a multiple of this many bytes
    extra_pool: bool           # calls may attend a second (extra) cache of this format too (V4's compressed pool)
    # (num_blocks, page_block_size, d_qk) float -> (num_blocks, page_block_size, 1, row_bytes) uint8
    # view of a padded block-major buffer
    quantize_cache: Callable[..., torch.Tensor]
    # (num_blocks, page_block_size[, 1], row_bytes) raw bytes (any stride(0)) -> (num_blocks,
    # page_block_size, d_qk) float32
    dequantize_cache: Callable[..., torch.Tensor]
    dequant: type              # the device dequant routine each arch's producer calls (the format module's)

    @property
    def num_groups(self) -> int:
        return self.d_nope // self.group_size

    @property
    def bytes_per_token(self) -> int:
        return self.row_bytes

    def block_stride(self, page_block_size: int) -> int:
        """stride(0) in bytes of a quantizer's page block: its bytes padded to ``block_align``
        (kernels accept any stride(0) that holds a block and is 16-byte aligned)."""
        return -(-page_block_size * self.row_bytes // self.block_align) * self.block_align

    def quantizer_stride0(self, page_block_size: int, stride0: Optional[int] = None) -> int:
        """A quantizer's stride(0): :meth:`block_stride` by default, else ``stride0`` checked (it
        holds a block and is 16-byte aligned, as the kernels need)."""
        if stride0 is None:
            return self.block_stride(page_block_size)
        if stride0 < page_block_size * self.row_bytes or stride0 % 16:
            raise ValueError(f"stride0: must hold a block ({page_block_size * self.row_bytes} B) and be 16-B aligned, "
                             f"got {stride0}")
        return stride0


class E4m3Dequant:
    """The device conversions every e4m3 format shares (plain functions that emit IR when a kernel
    calls them at trace time). A format's ``Dequant`` subclasses it and says how its scales are
    stored: ``scale_words`` (i32 registers of a row's scales as loaded), ``packed_scales`` (several
    scales per register: a producer derives each where it uses it), ``scale_group`` (NoPE dims per
    scale) and ``scale_bits(words, k)`` (the fp32 bits of scale k).

    A producer hands over one 32-bit word of four e4m3 values and its scale and stores the two
    bf16x2 words it gets back; both paths give bf16(float(fp8) * scale) bit for bit, as the
    reference does.
    """

    scale_words: int
    packed_scales: bool
    scale_group: int

    @classmethod
    def scale_index(cls, dim: int) -> int:
        """Which of a row's scales multiplies NoPE dim ``dim``."""
        return dim // cls.scale_group

    @staticmethod
    def scale_takes_fast_path(scale_bits):
        """Whether :meth:`fast` is exact for this scale: a power of two (or zero) below 2^8, as
        FlashMLA's recipe writes. A producer takes the fast path for a whole warp when every
        lane's scales allow it, and :meth:`exact` otherwise."""
        from ..dsl import ptx
        return ptx.is_pow2_scale(scale_bits)

    @staticmethod
    def fast_multiplier(scale_bits):
        """The bf16x2 multiplier :meth:`fast` takes, made once per scale."""
        from ..dsl import ptx
        return ptx.pow2_scale_multiplier(scale_bits)

    @staticmethod
    def fast(word, multiplier):
        """Four e4m3 values -> two bf16x2 words: 4 ALU ops per pair (bit moves, one bf16x2 multiply)."""
        from ..dsl import ptx
        return ptx.fp8x4_to_bf16x4_pow2(word, multiplier)

    @staticmethod
    def exact(word, scale_bits):
        """Four e4m3 values -> two bf16x2 words with any fp32 scale: 6 ops per pair. An invalid
        row's fp8 bytes must be zeroed by the caller (NaN bytes times a zero scale stay NaN)."""
        from ..dsl import ptx
        return ptx.fp8x4_to_bf16x4_exact(word, scale_bits)


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

    @property
    def data_row_bytes(self) -> int:
        return self.fmt.data_row_bytes

    @property
    def scale_words(self) -> int:
        """i32 words of one row's scales as loaded (4 V3.2, 2 V4)."""
        return self.fmt.dequant.scale_words


def cache_bytes(k_cache: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``k_cache`` (num_blocks, page_block_size[, 1], row_bytes) of any byte dtype as a uint8
    (num_blocks, page_block_size, row_bytes) view (its strides kept)."""
    if k_cache.dim() == 4:
        if k_cache.shape[2] != 1:
            raise ValueError(f"k_cache: dim 2 must be 1, got shape {tuple(k_cache.shape)}")
        k_cache = k_cache.squeeze(2)
    if k_cache.dim() != 3 or k_cache.shape[-1] != row_bytes:
        raise ValueError(f"k_cache: expected (num_blocks, page_block_size[, 1], {row_bytes}), got {tuple(k_cache.shape)}")
    return k_cache if k_cache.dtype == torch.uint8 else k_cache.view(torch.uint8)


def block_bytes(k_cache: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """The page blocks of a cache as (num_blocks, page_block_size * row_bytes) uint8: each
    block's bytes, whatever its stride(0) (the padding after them dropped)."""
    raw = cache_bytes(k_cache, row_bytes)
    nb, page, _ = raw.shape
    if raw.stride(1) != row_bytes or raw.stride(2) != 1:
        raise ValueError(f"k_cache: rows inside a page block must be packed (stride(1) = {row_bytes}), got {raw.stride()}")
    return torch.as_strided(raw, (nb, page * row_bytes), (raw.stride(0), 1))


def padded_cache(blocks: torch.Tensor, page_block_size: int, row_bytes: int, stride0: int) -> torch.Tensor:
    """(num_blocks, page_block_size * row_bytes) uint8 block bytes -> a (num_blocks,
    page_block_size, 1, row_bytes) view of a fresh zeroed buffer whose blocks are ``stride0``
    bytes apart."""
    nb = blocks.shape[0]
    buf = torch.zeros(nb * stride0, dtype=torch.uint8, device=blocks.device)
    view = torch.as_strided(buf, (nb, page_block_size * row_bytes), (stride0, 1))
    view.copy_(blocks)
    return torch.as_strided(buf, (nb, page_block_size, 1, row_bytes), (stride0, row_bytes, row_bytes, 1))
