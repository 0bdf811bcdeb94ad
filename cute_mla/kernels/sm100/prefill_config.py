"""The SM100 sparse prefill kernel's configuration: what a compile depends on (the frozen config and
the protocol's ``kernel_config`` / ``config_for`` / ``tensor_maps``) and the facts its roles read
(tile geometry, warp roles, pipeline stages; the tensor-memory plan, the warp counts' type and the
MMA side's geometry are the decode kernel's, read from ``config.py``).

A prefill CTA is the decode kernel's MMA side (``config.py``: M = 64 heads, tcgen05 accumulators in
tensor memory, lazy rescale) fed with bf16 rows: no dequant warps, the TMA gathers each K row
(``tile::gather4``) straight into the MMA's SW128 K-major tile. One query token per CTA, one walk
over its top-k list in 32-position tiles (the decode kernel's tile), no schedule, no split.

Plain Python (no DSL import): the plan, the launcher and the tests read it on any machine;
``sparse_prefill.py`` holds the kernel, its compile and its launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from ... import archs
from .config import TILE as DECODE_TILE
from .config import TMEM, TMEM_COLUMNS, WarpSchedule

HEADS = (64, 128)        # per call; 128 = the token's two 64-head CTAs side by side in grid x
WIDTHS = (576, 512)      # d_qk: 512 latent + 64 RoPE (V3.2), or the shared 512-wide K/V row (V4)
D_V = 512                # V = the first 512 dims of a row

# L2 eviction hints the gather may carry (the createpolicy values CUTLASS's TMA copies take;
# "" = none). The rows are re-read by the token's other head-half CTA and by neighbouring tokens
# whose top-k sets overlap, so they are kept by default (FlashMLA's SM100 prefill: EVICT_LAST).
GATHER_L2 = {"": None, "evict_normal": 0x1000000000000000, "evict_first": 0x12F0000000000000,
             "evict_last": 0x14F0000000000000}


@dataclass(frozen=True)
class Sm100PrefillTuning:
    """The prefill kernel's variant knobs (part of the compile key; none changes results)."""

    gather_l2: str = "evict_last"   # the gather4's L2 hint (a GATHER_L2 key)

    def __post_init__(self):
        if self.gather_l2 not in GATHER_L2:
            raise ValueError(f"Sm100PrefillTuning: gather_l2 takes {', '.join(repr(k) for k in GATHER_L2)}, "
                             f"got {self.gather_l2!r}")


DEFAULT_TUNING = Sm100PrefillTuning()


@dataclass(frozen=True)
class PrefillTile:
    """Tile geometry of a key width (all compile-time; :func:`tile_of_width`).

    The K tile is ``tokens`` gathered rows x ``d_qk`` bf16, K-major SW128: column block c (dims
    [64 c, 64 c + 64)) is ``tokens`` 128-B rows, one column of gather4 boxes (4 rows x 64 dims).
    QK reads all of it; PV reads its first 512 dims MN-major (V = K[:, :512]: no second copy).

    32 positions per tile (the decode kernel's): four K stages of 36 KiB fit next to Q, so three
    tiles' gathers are in flight while the tensor core works on the fourth (QK(i) is issued before
    PV(i - 1), so PV(i - 1) waits for gather(i), which needs the stage PV(i - 4) freed)."""

    d_qk: int
    # the decode kernel's MMA side (its tiled MMAs, P tile and output box): its tile's geometry
    heads: int = DECODE_TILE.heads          # M of both MMAs: query heads per CTA
    tokens: int = DECODE_TILE.tokens        # top-k positions per tile: N of QK, K of PV
    chunk: int = DECODE_TILE.chunk          # bf16 dims per 128-B swizzle row (a K column block, a gather4 box width)
    d_v: int = D_V
    epi_cols: int = DECODE_TILE.epi_cols    # output columns per epilogue box (one tcgen05.ld 32x32b.x32)

    @property
    def chunks(self) -> int:
        return self.d_qk // self.chunk          # 9 (576) or 8 (512) column blocks

    @property
    def k_dims(self) -> int:
        return self.d_qk                        # a K row is the whole gathered row (V: its first 512 dims)

    @property
    def qk_steps(self) -> int:
        return self.d_qk // 16                  # tcgen05.mma k-steps of QK

    @property
    def pv_steps(self) -> int:
        return self.tokens // 16                # k-steps of one PV half

    @property
    def half_v(self) -> int:
        return self.d_v // 2                    # N of one PV MMA (two halves of O)

    @property
    def q_elems(self) -> int:
        return self.heads * self.d_qk           # 36,864 bf16 = 72 KiB (576), 64 KiB (512)

    @property
    def k_block_elems(self) -> int:
        return self.tokens * self.chunk         # one column block: 2,048 bf16 = 4 KiB

    @property
    def k_stage_elems(self) -> int:
        return self.tokens * self.d_qk          # 18,432 bf16 = 36 KiB (576), 32 KiB (512)

    @property
    def k_stage_bytes(self) -> int:
        return 2 * self.k_stage_elems           # the K pipeline's tx bytes per stage (gather4, zero fill included)

    @property
    def p_elems(self) -> int:
        return self.heads * self.tokens         # 2,048 bf16 = 4 KiB

    @property
    def out_boxes(self) -> int:
        return self.d_v // self.epi_cols        # 16 boxes of 64 heads x 32 columns

    @property
    def out_box_bytes(self) -> int:
        return self.heads * self.epi_cols * 2   # 4 KiB (bf16, SW64)

    @property
    def out_staging_bytes(self) -> int:
        return self.out_boxes * self.out_box_bytes   # 64 KiB: all of O, staged in Q's bytes


def tile_of_width(d_qk: int) -> PrefillTile:
    """The tile of a key width (a :data:`WIDTHS` value), or a ValueError naming the accepted ones."""
    if d_qk not in WIDTHS:
        raise ValueError(f"d_qk: got {d_qk}, accepted: {', '.join(map(str, WIDTHS))}")
    t = PrefillTile(d_qk=d_qk)
    # O's staging reuses Q's bytes (Q is dead once the last QK has retired)
    assert t.out_staging_bytes <= 2 * t.q_elems and t.d_qk % t.chunk == 0 and t.d_v % t.chunk == 0
    return t


class Warp(IntEnum):
    """Warp index -> role (7 warps, 224 threads, no register reconfiguration: 65,536 / 224 leaves
    every thread the 255-register maximum)."""

    SOFTMAX = 0   # warps 0..3: a whole warpgroup (each warp reads its own 32 TMEM lanes)
    MMA = 4
    GATHER = 5
    INDEX = 6


@dataclass(frozen=True)
class Stages:
    index: int = 6   # coordinate / validity-mask ring (tiles; deeper than k, so INDEX runs ahead)
    k: int = 4       # gathered K tiles (36 KiB each at d_qk 576: four fit next to Q)
    s: int = 2       # S accumulators in TMEM (QK of tile i + 1 overlaps the softmax of tile i)
    p: int = 1
    q: int = 1


TILE = tile_of_width(576)
STAGES = Stages()
WARPS = WarpSchedule(dequant_warps=0, num_warps=7)
assert TMEM.used(STAGES.s) <= TMEM.alloc <= TMEM_COLUMNS and TMEM.s_cols == TILE.tokens


@dataclass(frozen=True)
class Sm100SparsePrefillConfig:
    """Everything a compiled SM100 sparse prefill kernel depends on; shapes are runtime values."""

    h_q: int   # 64 or 128 (128 = the token's two 64-head CTAs side by side in grid x)
    d_qk: int  # 576 or 512
    has_topk_length: bool
    has_attn_sink: bool
    tuning: Sm100PrefillTuning = field(default=DEFAULT_TUNING)
    arch: str = archs.SM100.name

    def __post_init__(self):
        if self.h_q not in HEADS:
            raise ValueError(f"h_q: got {self.h_q}, accepted: {', '.join(map(str, HEADS))}")
        tile_of_width(self.d_qk)
        if not isinstance(self.tuning, Sm100PrefillTuning):
            raise ValueError(f"tuning: expected an Sm100PrefillTuning, got {type(self.tuning).__name__}")
        if self.arch != archs.SM100.name:
            raise ValueError(f"arch: got {self.arch!r}, accepted: {archs.SM100.name!r}")

    @property
    def tile(self) -> PrefillTile:
        return tile_of_width(self.d_qk)

    @property
    def n_hblk(self) -> int:
        """64-head CTAs per token."""
        return self.h_q // TILE.heads

    @property
    def cache_key(self):
        return ("sm100_sparse_prefill", self)

    def takes_scale(self, softmax_scale: float) -> bool:
        """Every scale: the softmax scales S before its row max."""
        return True

    def any_scale(self) -> "Sm100SparsePrefillConfig":
        return self


Config = Sm100SparsePrefillConfig   # the registry's protocol (cute_mla.registry)
Tuning = Sm100PrefillTuning


def kernel_heads(h_q: int) -> int:
    """The heads a call's kernel runs: 64 or 128 (the API pads 8, 16 and 32 heads to 64)."""
    return max(h_q, 64)


def kernel_tile(h_q: int) -> str:
    """The MMA tile a head count takes (the plan's rule): the heads on the MMA's M side for every
    count (no swap-AB tile on SM100 yet)."""
    return "heads on M"


def kernel_config(*, h_q: int, d_qk: int, has_topk_length: bool, has_attn_sink: bool,
                  tuning=None) -> Sm100SparsePrefillConfig:
    """Any valid config by keyword; ``tuning`` None is the default."""
    return Sm100SparsePrefillConfig(h_q=h_q, d_qk=d_qk, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink,
                                    tuning=DEFAULT_TUNING if tuning is None else tuning)


def config_for(plan, has_attn_sink: bool, tuning=None) -> Sm100SparsePrefillConfig:
    """The config a sparse prefill plan's calls compile (the launcher's call)."""
    return kernel_config(h_q=plan.kernel_h_q, d_qk=plan.d_qk, has_topk_length=plan.has_topk_length,
                         has_attn_sink=has_attn_sink, tuning=tuning)


def tensor_maps(cfg) -> tuple:
    """The TMA descriptors the kernel builds (the same for every config; ``cfg`` may be None): Q,
    the gather4 table of kv rows, and out."""
    return ("q", "kv", "out")
