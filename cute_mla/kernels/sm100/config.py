"""The SM100 sparse decode kernel's configuration: what a compile depends on (the frozen config and
the protocol's ``kernel_config`` / ``config_for`` / ``tensor_maps``), and the facts every role
reads (warp roles, register budget, named barriers, the tile geometry of a format, pipeline
stages, the tensor-memory plan).

Plain Python (no DSL import): the plan, the launcher and the tests read it on any machine;
``sparse_decode.py`` holds the kernel, its compile and its launch.
"""

import functools
import math
from dataclasses import dataclass
from enum import IntEnum

from ... import archs
from ...formats import V32, FormatGeometry, KVCacheFormat, format_named, kernel_format
from ...scheduler.partition import BLOCK_TOPK
from .. import plan_config_for

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
SMEM_LIMIT = archs.SMEM_PER_CTA  # bytes of dynamic shared memory one CTA may use (the arch table's)
DECODE_HEADS = (64, 128)         # head counts the sparse decode kernel runs (64-head CTAs; no small-head tile)
TMEM_COLUMNS = 512


# --------------------------------------------------------------------------------------------------
# Static configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sm100SparseDecodeConfig:
    h_q: int  # 64, or 128 (two 64-head CTAs side by side in grid x)
    split: bool  # True: takes o_accum / lse_accum (+ their TMA map); False: no accumulator at all
    has_topk_length: bool
    has_attn_sink: bool
    format: str = V32.name  # the cache format's name (formats.format_named)
    arch: str = archs.SM100.name
    # The extra KV pool (V4): a second cache and index list attended jointly with the main one, each
    # request's main blocks first (the schedule's order), with its own tensor maps.
    has_extra: bool = False
    has_extra_topk_length: bool = False

    def __post_init__(self):
        if self.h_q not in DECODE_HEADS:
            raise ValueError(f"h_q: got {self.h_q}, accepted: {', '.join(map(str, DECODE_HEADS))}")
        # NotImplementedError for a known format not built yet; tile_of: one this kernel lays out
        tile_of(kernel_format(self.format, self.has_extra, self.has_extra_topk_length))
        if self.arch != archs.SM100.name:
            raise ValueError(f"arch: got {self.arch!r}, accepted: {archs.SM100.name!r}")

    @property
    def tile(self) -> "Tile":
        """The tile geometry of the config's cache format."""
        return tile_of(format_named(self.format))

    @property
    def d_qk(self) -> int:
        return self.tile.d_qk

    @property
    def d_v(self) -> int:
        return self.tile.d_v

    @property
    def head_groups(self) -> int:
        return self.h_q // TILE.heads

    @property
    def cache_key(self):
        return ("sm100_sparse_decode", self)


Config = Sm100SparseDecodeConfig   # the registry's protocol (cute_mla.registry)
Tuning = None                       # no variant knobs yet
ACCUM_DTYPE = "float32"             # o_accum's element type in the split variant


def kernel_config(*, h_q: int, format: str = V32.name, split: bool, has_topk_length: bool, has_attn_sink: bool,
                  column_pair: bool = False, tuning=None, has_extra: bool = False,
                  has_extra_topk_length: bool = False, request_order: bool = False) -> "Sm100SparseDecodeConfig":
    """Any valid config by keyword (the plan's choices spelled out). SM100 has no column pair, no
    request order and no variant knobs yet: each is refused by name."""
    if column_pair:
        raise ValueError("column_pair: got True, accepted: False (an SM90 plan's choice; the SM100 kernel has none)")
    if request_order:
        raise ValueError("request_order: got True, accepted: False (an SM90 plan's balanced schedule; the SM100 kernel "
                         "walks requests in order)")
    if tuning is not None:
        raise ValueError(f"tuning: got {tuning!r}, accepted: None (the SM100 kernel has no variant knobs yet)")
    return Sm100SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink,
                                   format=format, has_extra=has_extra, has_extra_topk_length=has_extra_topk_length)


config_for = plan_config_for(kernel_config, ACCUM_DTYPE, "SM100")


def tensor_maps(cfg: Sm100SparseDecodeConfig) -> tuple:
    """The TMA descriptors the kernel builds: Q, the gather4 tables of each pool, out, and o_accum
    in the split variant."""
    maps = ("q", "kv_nope", "kv_rope", "out") + (("o_accum",) if cfg.split else ())
    return maps + (("extra_nope", "extra_rope") if cfg.has_extra else ())


class Warp(IntEnum):
    """Warp index -> role. Warps 0-3 and 4-7 are whole warpgroups (TMEM lane slabs, setmaxnreg)."""

    SOFTMAX = 0  # warps 0..3
    DEQUANT = 4  # warps 4..7
    MMA = 8
    GATHER = 9
    INDEX = 10
    SPARE = 11


@dataclass(frozen=True)
class WarpSchedule:
    """Warps per role (the prefill kernel's schedule is one too, with no dequant warps)."""

    softmax_warps: int = 4
    dequant_warps: int = 4
    num_warps: int = 12

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def softmax_threads(self) -> int:
        return 32 * self.softmax_warps

    @property
    def dequant_threads(self) -> int:
        return 32 * self.dequant_warps


@dataclass(frozen=True)
class RegisterBudget:
    """setmaxnreg targets per warpgroup. 384 threads enter with 168 registers each; the targets must
    sum to <= 3 x 168 = 504 or an increase waits forever (measured on SM90; the same register-pool
    rule holds on SM100). Chosen from the cubin (cuobjdump --dump-resource-usage, no GPU): the MMA
    warp keeps ~40 live smem descriptors (128 spilled them), ptxas converts a whole 128-value
    dequant slice at once (it wants > 168), the softmax warpgroup holds 32 S + 32 O values. With
    176/184/144 the no-split variant has no stack at all; the split variant keeps 56 B of stack
    (dequant addresses). Re-tune on hardware (docs/sm100.md)."""

    softmax: int = 176
    dequant: int = 184
    producers: int = 144

    entry: int = 168  # what every thread starts with: 65,536 / 384 rounded down to a multiple of 8

    def __post_init__(self):
        assert self.softmax + self.dequant + self.producers <= 3 * self.entry
        assert all(r % 8 == 0 and 24 <= r <= 256 for r in (self.softmax, self.dequant, self.producers))


class Bar(IntEnum):
    """Named-barrier ids (0 is __syncthreads)."""

    TMEM = 1  # SOFTMAX + MMA (160 threads): TMEM address published / all TMEM use done before dealloc
    EPILOGUE = 2  # SOFTMAX (128): output staging written / previous TMA store has read it


@dataclass(frozen=True)
class Tile(FormatGeometry):
    """Tile geometry (all compile-time). The row layout comes from the cache format: a config's
    ``tile`` is its format's (:func:`tile_of`); the module's ``TILE`` is the V3.2 tile and holds the
    facts every format shares (heads, tokens, blocks, epilogue).

    The K tile holds exactly V's ``d_v`` dims in 64-dim SW128 column blocks: V3.2's 512 NoPE dims
    (RoPE is its own tile, read by QK only), or V4's 448 NoPE dims and, in the last column block,
    its 64 RoPE dims (``rope_in_k``: V includes RoPE; the dequant warps copy the gathered RoPE tile
    there), so the V operand is the K tile in both formats."""

    fmt: KVCacheFormat = V32
    heads: int = 64  # M of both MMAs: query heads per CTA
    tokens: int = 32  # tokens per K tile: N of QK, K of PV
    sched_block: int = BLOCK_TOPK  # tokens per scheduler block: two tiles
    chunk: int = 64  # bf16 dims per 128-B swizzle row (one K column block)
    epi_cols: int = 32  # O columns per thread per epilogue step (one tcgen05.ld 32x32b.x32)

    @property
    def tiles_per_block(self) -> int:
        return self.sched_block // self.tokens

    @property
    def rope_in_k(self) -> bool:
        """V includes RoPE: the RoPE tile is copied into the K tile's last column block."""
        return self.fmt.v_includes_rope

    @property
    def k_dims(self) -> int:
        return self.d_v  # 512: NoPE (V3.2) or NoPE + RoPE (V4)

    @property
    def nope_chunks(self) -> int:
        return self.d_nope // self.chunk  # 8 (V3.2), 7 (V4)

    @property
    def qk_rope_steps(self) -> int:
        """QK k-steps read from the RoPE tile (V4 reads its RoPE in the K tile)."""
        return 0 if self.rope_in_k else self.d_rope // 16

    @property
    def tma_row_bytes(self) -> int:
        """Pitch of the 2-D table of rows the gather4 maps see: a data row (V3.2: its whole row; V4: 576 B)."""
        return self.data_row_bytes

    @property
    def scales_in_index(self) -> bool:
        """The scales are in per-block scale rows (V4): the INDEX warp loads each token's scale row
        into the index stage (no TMA map can address 8-byte rows: global strides are 16-B multiples)."""
        return not self.fmt.scales_in_row

    @property
    def raw_row_bytes(self) -> int:
        """Gathered raw bytes per token, rounded up so a gather4 box (4 rows) is whole 128-B lines:
        V3.2 512 fp8 + 16 scale bytes + 16 RoPE bytes nobody reads = 544, V4 448 fp8."""
        f = self.fmt
        end = f.scale_offset + 4 * self.scale_words if f.scales_in_row else f.nope_offset + self.d_nope
        return -(-end // 32) * 32

    @property
    def raw_row_words(self) -> int:
        return self.raw_row_bytes // 4

    @property
    def raw_stage_bytes(self) -> int:
        return self.tokens * self.raw_row_bytes  # 17,408 (V3.2), 14,336 (V4)

    @property
    def k_stage_elems(self) -> int:
        return self.tokens * self.k_dims  # 16,384 bf16 = 32 KiB

    @property
    def k_block_bytes(self) -> int:
        return self.tokens * self.chunk * 2  # one 64-dim column block of a K stage: 4 KiB

    @property
    def rope_stage_elems(self) -> int:
        return self.tokens * self.d_rope  # 2,048 bf16 = 4 KiB

    @property
    def q_elems(self) -> int:
        return self.heads * self.d_qk  # 36,864 bf16 = 72 KiB (V3.2), 32,768 = 64 KiB (V4)

    @property
    def p_elems(self) -> int:
        return self.heads * self.tokens  # 2,048 bf16 = 4 KiB

    @property
    def half_v(self) -> int:
        return self.d_v // 2  # N of one PV MMA

    @property
    def epi_stage_bytes(self) -> int:
        return 2 * self.heads * self.epi_cols * 4  # two fp32 64x32 boxes (one per O half) = 16 KiB


@functools.lru_cache(maxsize=None)
def tile_of(fmt: KVCacheFormat) -> Tile:
    """The tile geometry of a cache format (one per format), or a ValueError for a format this
    kernel's tile cannot hold."""
    t = Tile(fmt=fmt)
    ok = (fmt.nope_dtype == "float8_e4m3fn" and fmt.d_rope == t.chunk and fmt.d_nope % t.chunk == 0
          and t.half_v == TmemPlan.o_cols and t.k_dims == fmt.d_nope + (fmt.d_rope if t.rope_in_k else 0)
          and t.raw_row_bytes <= t.tma_row_bytes and t.tma_row_bytes % 16 == 0 and fmt.rope_offset % 16 == 0
          and t.raw_row_words <= 256 and (not t.rope_in_k or t.nope_chunks == t.k_dims // t.chunk - 1)
          and (not t.scales_in_index or t.scale_words == 2) and t.rope_in_k == t.scales_in_index
          and t.k_dims == 2 * WarpSchedule.dequant_warps * t.chunk)
    if not ok:
        raise ValueError(f"{fmt.name}: the SM100 tile needs e4m3 NoPE in 64-dim chunks, 64 RoPE dims, d_v 512 "
                         "and 16-B aligned rows")
    return t


@dataclass(frozen=True)
class Stages:
    index: int = 4  # coordinate / valid-mask ring (tiles)
    gather: int = 3  # raw NoPE+scale and RoPE ring (tiles in flight from global memory)
    kbuf: int = 2  # dequantized bf16 K tiles (read by QK and, transposed, by PV)
    s: int = 2  # S accumulators in TMEM (QK of tile i+1 overlaps the softmax of tile i)
    p: int = 1
    q: int = 1


@dataclass(frozen=True)
class TmemPlan:
    """Tensor-memory columns (32-bit cells, 128 lanes), the decode and the prefill kernel's: O (64 x
    512 fp32) as two M = 64, N = 256 accumulators sharing columns [0, 256) in the two 16-lane halves
    of each 32-lane slab, then the S stages of 32 columns (lanes 0-15 of each slab)."""

    o_col: int = 0
    o_cols: int = 256  # 64 x 512 fp32 = two M=64 N=256 accumulators sharing columns (lane halves)
    s_col: int = 256
    s_cols: int = 32  # one 64 x 32 fp32 S tile (M=64 layout: lanes 0-15 of each slab)
    alloc: int = TMEM_COLUMNS

    def used(self, s_stages: int) -> int:
        return self.s_col + s_stages * self.s_cols

    @property
    def o_upper_lane_offset(self) -> int:
        return 16 << 16  # TMEM address of lane +16 (address = lane << 16 | column)


TILE = tile_of(V32)
STAGES = Stages()
WARPS = WarpSchedule()
REGS = RegisterBudget()
TMEM = TmemPlan()
LAZY_RESCALE_LOG2 = 6.0  # FlashMLA's threshold: P may grow to 2^6 in bf16 before O is rescaled
MAX_INIT = -1.0e30  # finite running-max start: never (-inf) - (-inf)

assert TMEM.used(STAGES.s) <= TMEM.alloc <= TMEM_COLUMNS
# V3.2's gathered raw row reaches past its RoPE offset (tile_of checks the rest for every format)
assert TILE.rope_offset <= TILE.raw_row_bytes
