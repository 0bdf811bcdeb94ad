"""The SM90 sparse decode kernel's configuration: what a compile depends on, and the facts every
role reads (tile geometry, warp-group roles, register budget, named barriers, timeline slots).

Plain Python (no DSL import): the launcher, the plan's tools and the tests read it on any machine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Optional

from ... import archs
from ...formats import V32, FormatGeometry, KVCacheFormat, format_named, kernel_format
from .. import plan_config_for


# o_accum's element type in the split variant: bf16 partials halve what split pieces store and the
# combine reads back; their rounding (2^-9 max|V|) is the bound the bf16 P of the PV MMA already puts
# on O. The plan reads it (its workspace), and config_for refuses a plan with another.
ACCUM_DTYPE = "bfloat16"
# Head counts the swap-AB tile takes (``swapped.py``): the heads on the wgmma's N side.
SWAPPED_HEADS = (8, 16, 32)
# Head counts the SM90 sparse decode kernel runs natively: the swap-AB tile's, and 64-head blocks.
DECODE_HEADS = SWAPPED_HEADS + (64, 128)
# The L2 eviction priorities a ``createpolicy`` cache policy can carry (``ptx.l2_policy``).
L2_POLICIES = ("evict_first", "evict_last", "evict_normal")
# The hint literals the row loads hand to ``cute.arch.load`` ("" = no hint): its L1 eviction
# priorities and L2 prefetch sizes (the DSL maps them to its enums by name).
LOAD_L1_HINTS = ("evict_first", "evict_last", "evict_no_allocate", "evict_normal", "evict_unchanged")
LOAD_L2_HINTS = ("size_64b", "size_128b", "size_256b")


@dataclass(frozen=True)
class Tile(FormatGeometry):
    """Tile geometry (all compile-time). The row layout comes from the cache format: a config's
    ``tile`` is its format's (:func:`tile_of`); the module's ``TILE`` holds the facts every format
    shares (heads, tokens, chunks, buffers, thread map) and is the V3.2 tile."""

    fmt: KVCacheFormat = V32
    heads: int = 64  # BLOCK_M: heads per CTA of the 64-head tile (the swap-AB tile puts 8-32 on N)
    tokens: int = 64  # tokens per K tile (one scheduler block of top-k positions)
    chunk: int = 64  # dims per 128-B swizzle row
    k_bufs: int = 2
    threads_per_wg: int = 128
    # Index compaction: the producer scans the top-k list in chunks of ``scan_chunk`` positions (one
    # per producer thread) and appends the valid token indices to a shared-memory ring of
    # ``ring_entries`` int32. In tile T's iteration a step starts while fewer than ``tiles_ahead``
    # tiles counting T are queued (tail < 64 T + 192) and writes at most 128 entries, padded at a
    # request end up to a tile boundary, so every write lands below 64 T + 320. The entries of T
    # itself were all read before that iteration's first scan barrier, so the oldest entry still to
    # be read is T+1's first, 64 T + 64: writes stay within 256 entries of it (power of two: the
    # ring position is a mask).
    scan_chunk: int = 128
    ring_entries: int = 256
    scan_count_words: int = 8  # the scan's warp counts: two slots (by parity) of one per producer warp
    tiles_ahead: int = 3  # tiles T, T+1 (rows loaded during T) and T+2 (L2 prefetch) must be queued
    info_words: int = 4  # per K buffer: valid mask (2 words), last-tile-of-request flag, pad
    mbar_bytes: int = 8  # one mbarrier: consecutive mbarriers of an array are this far apart
    rows_per_warp: int = 8  # producer thread map: a warp's 32 lanes cover 8 tokens x 4 16-B slices

    @property
    def nope_chunks(self) -> int:  # 64-dim column blocks of the quantized part
        return self.fmt.d_nope // self.chunk

    @property
    def chunks(self) -> int:  # 64-dim column blocks of a K tile: NoPE, then one of RoPE
        return self.d_qk // self.chunk

    @property
    def scale_reg(self) -> int:  # first register of the scales in a thread's row slots
        return 4 * self.nope_chunks

    @property
    def rope_reg(self) -> int:  # first register of the thread's 32 RoPE bytes
        return self.scale_reg + self.scale_words

    @property
    def slots_per_row(self) -> int:
        """i32 registers of one thread's slice of a row: 16 B of fp8 per NoPE chunk, the scales,
        2 x 16 B of RoPE (V3.2: 44, V4: 38)."""
        return self.rope_reg + 8

    @property
    def chunk_row_bytes(self) -> int:  # one token's row inside a 64-dim column block (SW128 row)
        return self.chunk * 2  # 128

    @property
    def k_tile_bytes(self) -> int:
        return self.tokens * self.d_qk * 2  # 73,728

    @property
    def k_tile_elems(self) -> int:
        return self.tokens * self.d_qk

    @property
    def chunk_bytes(self) -> int:  # one 64-dim column block of the K tile
        return self.tokens * self.chunk * 2  # 8,192

    @property
    def half_v(self) -> int:
        return self.d_v // 2  # 256 columns of O per MMA warp group

    @property
    def stage_bytes(self) -> int:  # output staging per MMA warp group (aliases sQ)
        return 32 * 1024

    @property
    def q_elems(self) -> int:
        return self.heads * self.d_qk

    @property
    def p_elems(self) -> int:
        return self.heads * self.tokens


TILE = Tile()


@functools.lru_cache(maxsize=None)
def tile_of(fmt: KVCacheFormat) -> Tile:
    """The tile geometry of a cache format (one per format)."""
    if fmt.d_rope != TILE.chunk or fmt.d_nope % TILE.chunk or fmt.d_v != TILE.half_v * 2:
        raise ValueError(f"{fmt.name}: the SM90 tile needs 64 RoPE dims, NoPE in 64-dim chunks and d_v 512")
    return Tile(fmt=fmt)


class Role(IntEnum):
    """Warp-group index -> role."""

    SOFTMAX = 0  # QK, online softmax, PV of O's left columns, the request's epilogue
    PV_RIGHT = 1  # PV of O's right columns and their epilogue
    PRODUCER = 2  # index scan, row gather, FP8 dequant into the K tiles (and 3 with two producers)


REGISTER_FILE = 65536   # 32-bit registers of an SM, all of them the CTA's


@dataclass(frozen=True)
class RegisterBudget:
    """The CTA's warp groups and their setmaxnreg targets: the two MMA warp groups and
    ``producers`` producer warp groups (1, or 2 on the swap-AB tile: each gathers and converts
    one half of every K tile, ``producer.py``). Every thread enters with :attr:`entry` registers;
    the targets must sum to at most ``entry`` times the warp groups.

    The 64-head tile: 216/160/128 compiles clean (no serialized wgmma, no spill) and measured
    fastest (docs/performance.md); 192/160/152 serializes every wgmma, 240/160/112 hangs.
    """

    softmax: int = 216
    pv_right: int = 160
    producer: int = 128
    producers: int = field(default=1, metadata={"variant_optional": True})

    @property
    def warp_groups(self) -> int:
        return 2 + self.producers

    @property
    def threads(self) -> int:
        return TILE.threads_per_wg * self.warp_groups

    @property
    def entry(self) -> int:
        """Registers per thread at entry: the register file over the threads, rounded down to a
        multiple of 8 (168 with three warp groups, 128 with four)."""
        return REGISTER_FILE // self.threads // 8 * 8

    def __post_init__(self):
        targets = (self.softmax, self.pv_right) + (self.producer,) * self.producers
        if self.producers not in (1, 2):
            raise ValueError(f"RegisterBudget: producers takes 1 or 2, got {self.producers}")
        if sum(targets) > self.entry * self.warp_groups or any(r % 8 or not 24 <= r <= 256 for r in targets):
            raise ValueError(f"RegisterBudget: targets must be multiples of 8 in [24, 256] summing to <= "
                             f"{self.entry * self.warp_groups} with {self.producers} producer warp group(s), got {self}")


# The swap-AB tile's budget: two producer warp groups, each thread holding one row of a tile (one
# producer group holding two rows a thread took 216 registers, beside MMA groups at 160 / 128,
# and measured slower: docs/performance.md); its MMA warp groups hold 2h fp32 of O^T and h / 2
# of S^T per thread (h <= 32).
TWO_PRODUCER_REGISTERS = RegisterBudget(softmax=144, pv_right=112, producer=128, producers=2)


def tile_registers(h_q: int) -> RegisterBudget:
    """The register budget a config with ``h_q`` heads takes unless its tuning names one."""
    return TWO_PRODUCER_REGISTERS if h_q in SWAPPED_HEADS else RegisterBudget()


def fill_unset(tuning, rule: dict):
    """``tuning`` (a frozen dataclass) with each field that is None set from ``rule`` ({field:
    value}): the shape's choice where the tuning names none."""
    given = {k: v for k, v in rule.items() if getattr(tuning, k) is None}
    return replace(tuning, **given) if given else tuning


def tile_gather_l1(h_q: int) -> str:
    """The L1 hint of the producer's row loads for ``h_q`` heads unless the tuning names one. The
    64-head tile's rows are read again by the token's other head-half CTA and their 256-B
    neighbours by sibling threads: ``evict_last``. The swap-AB tile's CTA is the only one that
    reads its token's rows, and letting them leave L1 first measured faster there
    (docs/performance.md)."""
    return "evict_first" if h_q in SWAPPED_HEADS else "evict_last"


class Bar(IntEnum):
    """Named-barrier ids (0 is __syncthreads)."""

    P_READY = 1  # WG0 -> WG1, 256 threads
    P_FREE = 2  # WG1 -> WG0, 256 threads
    Q_FREE = 3  # WG1 -> WG0, 256 threads
    EPI_SOFTMAX = 4  # WG0 only, 128 threads
    EPI_PV_RIGHT = 5  # WG1 only, 128 threads
    INDEX_SCAN = 6  # WG2 only, 128 threads: index compaction (warp counts, then ring visibility)
    INDEX_SCAN_B = 7  # WG3 only (two producers), 128 threads: its own copy of the compaction


class Stamp(IntEnum):
    """``Sm90Tuning.timeline`` (instrumentation, never on in the library): slots of a CTA's row of
    64-bit ``clock64`` stamps, each written by thread 0 of the warp group named (the last write
    wins, so a one-tile piece gives one pass through the chain). The
    ``_NS`` slots hold ``%globaltimer`` instead (nanoseconds on one clock for every SM, where
    ``clock64`` counts per SM at its own frequency): where the CTAs' spans lie within the
    kernel's (``NS_SLOTS``). The swap-AB tile's roles write the same slots but the epilogue's
    staging pair (``EPI_STAGED``, ``WG1_EPI_STAGED``) and, with two producer warp groups, ``HALF_A``
    (each group converts one half); there group 0 writes the producer's slots."""

    ENTRY = 0  # thread 0: kernel entry
    PROLOGUE = 1  # thread 0: barriers initialised, sync_threads passed
    METADATA = 2  # each warp group: the partition row's words 0-3 consumed (begin_req tested)
    SCAN = 3  # producer: tile 0's indices in the ring (first scan_until returned)
    K_FREE = 4  # producer: the tile's buffer free (conversion starts, waiting for its rows)
    HANDED_OVER = 5  # producer: k_full arrive of the tile
    Q_READY = 6  # WG0: q_full wait returned
    K_READY = 7  # WG0: k_full wait returned (first QK issued next)
    QK_DONE = 8  # WG0: S in registers
    P_READY = 9  # WG0: P and the row factors in shared memory, P_READY arrived
    PV_DONE = 10  # WG0: its PV of the request's last tile complete (epilogue starts)
    EPILOGUE = 11  # WG0: out / o_accum store issued and its shared-memory reads done
    WG1_P = 12  # WG1: P_READY passed
    WG1_PV_DONE = 13  # WG1: its PV complete
    WG1_EPILOGUE = 14  # WG1: its store done
    EPI_FINAL = 15  # WG0: row factors exchanged with WG1 (the epilogue's barrier pair passed)
    EPI_STAGED = 16  # WG0: bf16 block staged in sQ, the warp group's barrier passed (TMA store next)
    WG1_EPI_STAGED = 17  # WG1: the same
    HALF_A = 18  # producer: half A of the tile converted and stored (half B next)
    ENTRY_NS = 19  # thread 0: kernel entry, %globaltimer
    EXIT_NS = 20  # WG0: its last store issued and its barriers balanced (the role's end), %globaltimer
    SLOTS = 21


NS_SLOTS = (Stamp.ENTRY_NS, Stamp.EXIT_NS)   # the Stamp slots that hold %globaltimer


@dataclass(frozen=True)
class Sm90Tuning:
    """The kernel's variant knobs: none changes results, each is part of the compile key.

    The defaults are the production kernel. The variant seam runs any other value through the
    public API (``FlashMLASchedMeta(tuning=...)``) or the launcher; levers measured and rejected
    live in git history and docs/performance.md, not here.
    """

    # Gather load hints (``cute.arch.load`` literals, "" = none). L1: None is the tile's hint
    # (:func:`tile_gather_l1`), set when a config is made.
    gather_l1: Optional[str] = None
    gather_l2: str = "size_256b"
    # L2 prefetch of tile T+2's rows (per-thread prefetch.global.L2 of the 128-B lines a row can
    # touch) once tile T is handed over, so the loads issued a tile later hit L2 (measured faster,
    # docs/performance.md).
    prefetch_rows: bool = True
    # h_q = 128: the token's two head-half CTAs run as a cluster of 2 and each gathers and
    # dequantizes half of every K tile for both (crossover.py). False: each gathers all 64 rows
    # (the second CTA's reads hit L2). Halving each CTA's gather and conversion outweighs the
    # per-tile exchange with the peer on most h=128 shapes, not on all (docs/performance.md).
    h128_cluster: bool = True
    # None: the tile's budget (the 64-head tile's RegisterBudget(), or TWO_PRODUCER_REGISTERS), set
    # when a config is made.
    registers: Optional[RegisterBudget] = None
    # Instrumentation: each CTA writes clock64 stamps of its phases (Stamp; %globaltimer in
    # NS_SLOTS) into a (grid x, grid y, Stamp.SLOTS) int64 tensor passed as the launch's
    # ``timeline``.
    timeline: bool = False

    def __post_init__(self):
        for name, accepted in (("gather_l1", LOAD_L1_HINTS), ("gather_l2", LOAD_L2_HINTS)):
            value = getattr(self, name)
            if value not in ("",) + accepted and not (name == "gather_l1" and value is None):
                raise ValueError(f"Sm90Tuning: {name} takes '' (no hint) or one of {', '.join(accepted)}, got {value!r}")
        if self.registers is not None and not isinstance(self.registers, RegisterBudget):
            raise ValueError(f"Sm90Tuning: registers takes a RegisterBudget, got {self.registers!r}")


DEFAULT_TUNING = Sm90Tuning()


@dataclass(frozen=True)
class Sm90SparseDecodeConfig:
    """Everything a compiled SM90 sparse decode kernel depends on; shapes are runtime values.

    The plan picks every field but ``tuning`` (the launcher's :func:`kernel_config`). Roles read
    the derived facts below, compile-time constants of the traced kernel. A tuning without a
    register budget or an L1 gather hint takes the head count's (:func:`tile_registers`,
    :func:`tile_gather_l1`) when the config is made, so ``dataclasses.replace(cfg, h_q=...)``
    keeps the old head count's: make configs with :func:`kernel_config`.
    """

    h_q: int  # 8, 16 or 32 (the swap-AB tile, ``swapped.py``), 64, or 128 (two 64-head CTAs side by side in grid x)
    split: bool  # True: takes o_accum / lse_accum (bf16 partials, their TMA map); False: no accumulator
    has_topk_length: bool
    has_attn_sink: bool
    # h_q = 64 split: each piece on a cluster of 2 CTAs that share the gather and split the 512
    # output columns (the policy's ``column_pair_max_busy_ctas``); out is stored from registers, o_accum by
    # TMA in 64 x 64 boxes.
    column_pair: bool = False
    format: str = V32.name  # the cache format's name (formats.format_named)
    tuning: Sm90Tuning = DEFAULT_TUNING
    arch: str = archs.SM90.name
    # The extra KV pool (V4): a second cache and index list attended jointly with the main one,
    # each request's main positions first (the schedule's blocks: main, then extra).
    has_extra: bool = False
    has_extra_topk_length: bool = False
    # The schedule orders whole requests (the plan's balanced cut): a partition's row holds
    # positions in the launch's ``request_order``, which names the request at each position.
    # No-split kernels only: a split piece's accumulator rows are found by request position.
    request_order: bool = False

    def __post_init__(self):
        if self.h_q not in DECODE_HEADS:
            raise ValueError(f"h_q: got {self.h_q}, accepted: {', '.join(map(str, DECODE_HEADS))}")
        if self.request_order and (self.split or self.column_pair):
            raise ValueError(f"request_order: only the no-split variant walks ordered requests (got split={self.split}, "
                             f"column_pair={self.column_pair})")
        if self.column_pair and not (self.split and self.h_q == 64):
            raise ValueError(f"column_pair: only the h_q=64 split variant runs column pairs (got h_q={self.h_q}, "
                             f"split={self.split})")
        kernel_format(self.format, self.has_extra, self.has_extra_topk_length)
        if not isinstance(self.tuning, Sm90Tuning):
            raise ValueError(f"tuning: expected an Sm90Tuning, got {type(self.tuning).__name__}")
        # a config compiles concrete knobs: the tile's where the tuning names none
        object.__setattr__(self, "tuning", fill_unset(self.tuning, {"registers": tile_registers(self.h_q),
                                                                     "gather_l1": tile_gather_l1(self.h_q)}))
        if self.tuning.registers.producers != 1 and not self.swapped:
            raise ValueError(f"tuning.registers.producers: two producer warp groups run on the swap-AB tile only "
                             f"(8, 16 or 32 heads), got h_q={self.h_q}")
        if self.arch != archs.SM90.name:
            raise ValueError(f"arch: got {self.arch!r}, accepted: {archs.SM90.name!r}")

    @property
    def tile(self) -> Tile:
        """The tile geometry of the config's cache format."""
        return tile_of(format_named(self.format))

    @property
    def d_qk(self) -> int:
        """The format's key width."""
        return self.tile.d_qk

    @property
    def accum_dtype(self) -> str:
        """o_accum's element type in the split variant (the arch's)."""
        return ACCUM_DTYPE

    @property
    def swapped(self) -> bool:
        """8, 16 or 32 heads: the swap-AB tile (``decode_small_roles.py``), one CTA per token."""
        return self.h_q in SWAPPED_HEADS

    @property
    def n_hblk(self) -> int:
        """CTAs per token: 64-head blocks, one for the swap-AB tile's heads."""
        return -(-self.h_q // TILE.heads)

    @property
    def n_cblk(self) -> int:
        """Column-half CTAs per (token, 64 heads): 2 in the column pair."""
        return 2 if self.column_pair else 1

    @property
    def pv_cols(self) -> int:
        """Output columns per MMA warp group: 256, or 128 in the column pair."""
        return TILE.half_v // self.n_cblk

    @property
    def cluster(self) -> bool:
        """Two CTAs share each K tile through the crossover transport (h=128 head halves, or the
        column pair's column halves)."""
        return (self.h_q == 128 and self.tuning.h128_cluster) or self.column_pair

    @property
    def out_from_registers(self) -> bool:
        """out is stored with per-thread stores (the column pair: its 64 x 128 blocks have no tensor map)."""
        return self.column_pair


Config = Sm90SparseDecodeConfig   # the registry's protocol (cute_mla.registry)
Tuning = Sm90Tuning


def kernel_config(*, h_q: int, format: str = V32.name, split: bool, has_topk_length: bool, has_attn_sink: bool,
                  column_pair: bool = False, tuning=None, has_extra: bool = False,
                  has_extra_topk_length: bool = False, request_order: bool = False) -> Sm90SparseDecodeConfig:
    """Any valid config by keyword (the plan's choices spelled out); ``tuning`` None is the default."""
    return Sm90SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink,
                                  column_pair=column_pair, format=format,
                                  tuning=DEFAULT_TUNING if tuning is None else tuning,
                                  has_extra=has_extra, has_extra_topk_length=has_extra_topk_length,
                                  request_order=request_order)


config_for = plan_config_for(kernel_config, ACCUM_DTYPE, "SM90")


def tensor_maps(cfg: Sm90SparseDecodeConfig) -> tuple:
    """The TMA descriptors the kernel builds: Q, out (not in the column pair, which stores out from
    registers), and o_accum in the split variant; the extra pool's rows are gathered, not mapped."""
    return ("q",) + (() if cfg.out_from_registers else ("out",)) + (("o_accum",) if cfg.split else ())
