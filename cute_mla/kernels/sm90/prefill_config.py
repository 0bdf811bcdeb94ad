"""The SM90 sparse prefill kernel's configuration: what a compile depends on and the facts its roles
read. The K tile and the MMA atoms are the sparse decode kernel's (``config.py``); the MMA side is
FlashMLA's ping-pong (``prefill_roles.py``): its named barriers are :class:`PrefillBar` and its
register split :data:`PINGPONG_REGISTERS` (both MMA warp groups do QK, softmax and PV).

Plain Python (no DSL import): the API, the plan and the tests read it on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Optional

from ... import archs
from ...formats import V4, V32
from .config import L2_POLICIES, SWAPPED_HEADS, TILE, Bar, RegisterBudget, Tile, fill_unset, tile_of

# Key widths the kernel takes (bf16 rows, V = the first 512 dims): 576 = 512 latent + 64 RoPE
# (V3.2), 512 = the shared K/V row (V4). The K tile of a width is the decode tile of the cache
# format with that key width: same smem geometry, only the gather differs.
WIDTHS = {V32.d_qk: V32, V4.d_qk: V4}
HEADS = (8, 16, 32, 64, 128)
STAGINGS = ("q", "ring", "q_reload")   # ``Sm90PrefillTuning.staging``
SMALL_HEADS = SWAPPED_HEADS   # the head counts that run on the swap-AB tile (``prefill_small_roles.py``)


def tile_of_width(d_qk: int) -> Tile:
    """The K tile geometry of a key width (a :data:`WIDTHS` key)."""
    fmt = WIDTHS.get(d_qk)
    if fmt is None:
        raise ValueError(f"d_qk: got {d_qk}, accepted: {', '.join(map(str, WIDTHS))}")
    return tile_of(fmt)


class PrefillBar(IntEnum):
    """Named-barrier ids of the prefill kernel (0 is __syncthreads; 16 ids in all).

    ``Q_FREE`` and the two epilogue ids are :class:`~.config.Bar`'s, with the same use; the
    ping-pong's own ids follow the last one of ``Bar`` (``INDEX_SCAN_B``, the decode producers'), so
    no id of the sm90 package means two things; the swap-AB tile's two reuse the ids of the decode
    kernel's P hand-over. Each is a 256-thread barrier between WG0 and WG1 (one side
    ``bar.arrive``, the other ``bar.sync``, once each per use) but ``L_SUM`` and ``PT_READY``
    (both groups sync; WG0 only arrives at an item's end) and the epilogue ids (one warp group,
    128 threads). ``prefill_roles.py`` has the ping-pong's table, ``prefill_small_roles.py`` the
    swap-AB tile's protocol.
    """

    Q_FREE = Bar.Q_FREE              # (swap-AB) WG1 -> WG0, per item: its output staging (in sQ) read
    EPI_WG0 = Bar.EPI_SOFTMAX        # WG0 only: a staged output chunk written (swap-AB: also its exchange)
    EPI_WG1 = Bar.EPI_PV_RIGHT       # WG1 only: the same
    MAX_A = max(Bar) + 1             # WG0 -> WG1, per pair: mA = max(M, rowmax S0) in s_max[0]
    MAX_B = max(Bar) + 2             # WG1 -> WG0, per pair with an odd tile: mB in s_max[1]
    P0_READY = max(Bar) + 3          # WG0 -> WG1, per pair: bf16 P0 (at mB) in its P buffer
    P1_READY = max(Bar) + 4          # WG1 -> WG0, per pair with an odd tile: bf16 P1 in its P buffer
    L_SUM = max(Bar) + 5             # WG0 <-> WG1 (both sync), per item: the row sums exchanged
    QK_ORDER = max(Bar) + 6          # WG0 -> WG1, per pair with an odd tile: QK0 retired (WG1's late half waits)
    # the swap-AB tile (8, 16, 32 heads; ``prefill_small_roles.py``):
    PT_FREE = Bar.P_FREE             # WG1 -> WG0, per tile: P^T and the heads' factors read
    PT_READY = Bar.P_READY           # WG0 -> WG1 (both sync per tile), P^T and the factors written


assert max(PrefillBar) < 16 and len({int(b) for b in PrefillBar}) == len(PrefillBar)

# setmaxnreg targets (FlashMLA's): WG0 (``RegisterBudget.softmax``) and WG1 (``.pv_right``) each hold a
# 64 x 256 fp32 O, S / P of a tile and its bf16 copy; the producer only addresses and indices.
PINGPONG_REGISTERS = RegisterBudget(softmax=216, pv_right=216, producer=72)

# The least scale ``ffma_exp`` takes: the smallest normal fp32, so that the kernel's scale in log2
# units is a positive normal number (below it a masked -inf times the scale could be NaN).
MIN_FFMA_SCALE = 2.0 ** -126


@dataclass(frozen=True)
class Sm90PrefillTuning:
    """The prefill kernel's variant knobs (part of the compile key; none changes results beyond
    fp32 rounding). A field left None takes the shape's rule (:func:`resolve_tuning`) when a
    config is made."""

    registers: RegisterBudget = PINGPONG_REGISTERS
    # L2 hint of the cp.async row gather ("" = none).
    gather_l2: Optional[str] = None
    # Each producer lane prefetches the next tiles' rows into L2 once this tile's copies are
    # issued, a tile ahead of their cp.async; of a token's head blocks only the first prefetches.
    prefetch_rows: Optional[bool] = None
    # L2 cache policy of the Q loads and out stores ("" = none, or a ``config.L2_POLICIES`` kind):
    # each byte of them is touched once, and without a hint they take L2 lines from the gathered
    # rows, which the other tokens' walks read again.
    qo_policy: Optional[str] = None
    # Where out is staged for its TMA stores. The ping-pong (64 and 128 heads), so that the next
    # item's Q need not wait for the stores: "ring", outside Q (per group a ring of its P buffer and
    # a 16 KiB ``sO`` chunk, d_qk 512 only: d_qk 576 has no room), the next Q right after the row
    # sums are exchanged; "q_reload", in the Q buffer, each Q chunk reloaded as soon as its store
    # read it (the RoPE chunk right after the sums). The swap-AB tile: "q", in its Q buffer, the
    # next Q once WG1's stores read it (``Q_FREE``).
    staging: Optional[str] = None
    # The ping-pong's running max kept lazily: a row's base moves only when a tile's max passes
    # it by more than ``LAZY_MAX_STEP`` (log2 units), so P <= 2^step. Where no row of the pair's
    # tiles moved it (most pairs once the rows' maxima settle), WG0 hands P0 over as computed,
    # with no rescale, before it retires its own tile's PV; the pair's bookkeeping (true maxima
    # for max_logits, WG1's moved flags) is paid on every pair.
    lazy_max: Optional[bool] = None
    # Each MMA warp skips rescaling its O rows where none of them moved its base in this tile
    # (every factor exactly 1, so out is bit-identical): with ``lazy_max`` that is most tiles.
    skip_unit_scale: Optional[bool] = None
    # The ping-pong's softmax takes the row max of the raw scores and forms each P as
    # exp2(fma(S, scale_log2, -m)): one FFMA an element where scaling S in place (FMUL) and
    # subtracting the max (FADD) take two. Exact only for a scale that stays a positive normal
    # fp32 number (the max of scaled scores is then the scaled max, and a masked -inf times it
    # stays -inf): the config's ``takes_scale``; other scales run its ``any_scale`` form.
    ffma_exp: Optional[bool] = None

    def __post_init__(self):
        if not isinstance(self.registers, RegisterBudget):
            raise ValueError(f"Sm90PrefillTuning: registers takes a RegisterBudget, got {self.registers!r}")
        if self.registers.producers != 1:
            raise ValueError(f"Sm90PrefillTuning: registers.producers takes 1 (one producer warp group), "
                             f"got {self.registers.producers}")
        if self.gather_l2 not in (None, "", "L2::64B", "L2::128B", "L2::256B"):
            raise ValueError(f"Sm90PrefillTuning: gather_l2 takes '', 'L2::64B', 'L2::128B' or 'L2::256B', "
                             f"got {self.gather_l2!r}")
        if self.prefetch_rows is not None and not isinstance(self.prefetch_rows, bool):
            raise ValueError(f"Sm90PrefillTuning: prefetch_rows takes a bool, got {self.prefetch_rows!r}")
        if self.lazy_max is not None and not isinstance(self.lazy_max, bool):
            raise ValueError(f"Sm90PrefillTuning: lazy_max takes a bool, got {self.lazy_max!r}")
        if self.skip_unit_scale is not None and not isinstance(self.skip_unit_scale, bool):
            raise ValueError(f"Sm90PrefillTuning: skip_unit_scale takes a bool, got {self.skip_unit_scale!r}")
        if self.ffma_exp is not None and not isinstance(self.ffma_exp, bool):
            raise ValueError(f"Sm90PrefillTuning: ffma_exp takes a bool, got {self.ffma_exp!r}")
        if self.staging not in (None,) + STAGINGS:
            raise ValueError(f"Sm90PrefillTuning: staging takes one of {', '.join(STAGINGS)}, got {self.staging!r}")
        if self.qo_policy not in (None, "") + L2_POLICIES:
            raise ValueError(f"Sm90PrefillTuning: qo_policy takes '' or one of {', '.join(L2_POLICIES)}, "
                             f"got {self.qo_policy!r}")


def resolve_tuning(tuning: Sm90PrefillTuning, h_q: int, d_qk: int, kv_fits_l2: bool = False) -> Sm90PrefillTuning:
    """``tuning`` with its None fields set by the shape's rule (the plan's; docs/performance.md,
    section 8, has the measurements). 128 heads: a row is read by the token's two head blocks side by
    side, so the gather keeps the 256-B L2 fill (the second block's copy hits the whole line) and,
    at d_qk 576 (eighteen 64-B sectors a row, the MMA side longest) with kv rows past the L2
    (``kv_fits_l2`` False: the plan's), the next tiles' rows are prefetched into L2 (by the first
    block: ``producer``) to keep HBM busy through the ping-pong's steps; where the rows fit the L2
    the walks find them there, and the prefetches only add L2 requests and power. Fewer heads: each row is read once, the walk is bound by the gather itself, and both
    hints only add L2 traffic. The ping-pong tile (64 and 128 heads) loads Q and stores out
    evict_first, which keeps more of the rows in L2 where the walk is bound by HBM; the swap-AB
    tile's Q and out are a small share of its traffic and go without a policy. At d_qk 512 the
    ping-pong stages out outside Q (``staging`` "ring"), so the next item's Q loads under the
    output stores; d_qk 576 has no room for it and reloads each Q chunk as its output store frees
    it ("q_reload"). The swap-AB tile stages in its Q buffer ("q"). The ping-pong keeps its
    running max lazily and skips O's rescale in a warp where no row moved: together they save
    WG0's drain before P0's hand-over and most of O's rescales, for the pair's bookkeeping (true
    maxima, WG1's flags, a vote and a branch). Its softmax forms P with one FFMA an element
    (``ffma_exp``; a call whose scale it cannot take runs the config's ``any_scale`` form)."""
    pair = h_q > TILE.heads
    pingpong = h_q not in SMALL_HEADS
    rule = {"gather_l2": "L2::256B" if pair else "", "prefetch_rows": pair and d_qk == V32.d_qk and not kv_fits_l2,
            "qo_policy": "evict_first" if pingpong else "",
            "staging": ("ring" if d_qk == V4.d_qk else "q_reload") if pingpong else "q",
            "lazy_max": pingpong, "skip_unit_scale": pingpong, "ffma_exp": pingpong}
    return fill_unset(tuning, rule)


DEFAULT_TUNING = Sm90PrefillTuning()


@dataclass(frozen=True)
class Sm90SparsePrefillConfig:
    """Everything a compiled SM90 sparse prefill kernel depends on; shapes are runtime values.

    The tuning is resolved for the shape when the config is made (:func:`resolve_tuning`), so a
    config made with ``dataclasses.replace(cfg, h_q=...)`` keeps the old shape's knobs: make
    configs with :func:`kernel_config` or :func:`config_for`.
    """

    h_q: int   # 8, 16 or 32 (the swap-AB tile), 64 (one 64-head block) or 128 (two)
    d_qk: int  # 576 or 512
    has_topk_length: bool
    has_attn_sink: bool
    tuning: Sm90PrefillTuning = DEFAULT_TUNING
    arch: str = archs.SM90.name

    # Output columns per MMA warp group, as the decode helpers the prefill kernel reuses
    # (``mma.k_tensors_for_pv``, ``epilogue.store_block``) read them.
    pv_cols = TILE.half_v

    def __post_init__(self):
        if self.h_q not in HEADS:
            raise ValueError(f"h_q: got {self.h_q}, accepted: {', '.join(map(str, HEADS))}")
        tile_of_width(self.d_qk)
        if not isinstance(self.tuning, Sm90PrefillTuning):
            raise ValueError(f"tuning: expected an Sm90PrefillTuning, got {type(self.tuning).__name__}")
        # a config compiles concrete knobs: the shape's rule fills what the tuning left open
        object.__setattr__(self, "tuning", resolve_tuning(self.tuning, self.h_q, self.d_qk))
        if self.tuning.staging != "q" and self.swapped:
            raise ValueError(f"staging: the swap-AB tile ({self.h_q} heads) stages out in its Q buffer ('q'), "
                             f"got {self.tuning.staging!r}")
        if self.tuning.staging == "q" and not self.swapped:
            raise ValueError(f"staging: the ping-pong tile ({self.h_q} heads) stages out in a 'ring' (d_qk "
                             f"{V4.d_qk}) or in Q reloaded behind its stores ('q_reload'), got 'q'")
        if self.tuning.skip_unit_scale and self.swapped:
            raise ValueError(f"skip_unit_scale: a knob of the ping-pong tile (64 and 128 heads), got h_q {self.h_q}")
        if self.tuning.lazy_max and self.swapped:
            raise ValueError(f"lazy_max: a knob of the ping-pong tile (64 and 128 heads), got h_q {self.h_q}")
        if self.tuning.ffma_exp and self.swapped:
            raise ValueError(f"ffma_exp: a knob of the ping-pong tile (64 and 128 heads), got h_q {self.h_q}")
        if self.tuning.staging == "ring" and self.d_qk != V4.d_qk:
            raise ValueError(f"staging: the 'ring' is built for d_qk {V4.d_qk} (no room in shared memory "
                             f"otherwise), got h_q {self.h_q}, d_qk {self.d_qk}")
        if self.arch != archs.SM90.name:
            raise ValueError(f"arch: got {self.arch!r}, accepted: {archs.SM90.name!r}")

    @property
    def tile(self) -> Tile:
        return tile_of_width(self.d_qk)

    @property
    def n_hblk(self) -> int:
        """64-head blocks per token (one for 8, 16, 32 or 64 heads)."""
        return -(-self.h_q // TILE.heads)

    @property
    def swapped(self) -> bool:
        """The swap-AB tile (:func:`kernel_tile`): 8, 16 or 32 heads on the MMA's N side."""
        return self.h_q in SMALL_HEADS

    def takes_scale(self, softmax_scale: float) -> bool:
        """Whether this kernel is exact at ``softmax_scale``: every scale, except with ``ffma_exp``
        only a scale of at least :data:`MIN_FFMA_SCALE`."""
        return not self.tuning.ffma_exp or softmax_scale >= MIN_FFMA_SCALE

    def any_scale(self) -> "Sm90SparsePrefillConfig":
        """This config in the form that takes every scale (``ffma_exp`` off)."""
        return replace(self, tuning=replace(self.tuning, ffma_exp=False)) if self.tuning.ffma_exp else self


Config = Sm90SparsePrefillConfig   # the registry's protocol (cute_mla.registry)


def kernel_heads(h_q: int) -> int:
    """The heads a call's kernel runs: every supported count natively (no padded copies)."""
    return h_q


def kernel_tile(h_q: int) -> str:
    """The MMA tile a head count takes (the plan's rule): 8, 16 and 32
    heads the swap-AB tile (``"heads on N (swap-AB)"``: a K tile's 64 top-k rows on the wgmma's M
    side, the heads on N), 64 and 128 the 64-head tile (``"heads on M"``, one per 64-head block)."""
    return "heads on N (swap-AB)" if h_q in SMALL_HEADS else "heads on M"


Tuning = Sm90PrefillTuning


def kernel_config(*, h_q: int, d_qk: int, has_topk_length: bool, has_attn_sink: bool, tuning=None,
                  kv_fits_l2: bool = False) -> Sm90SparsePrefillConfig:
    """Any valid config by keyword; ``tuning`` None is the default, its open knobs set by the
    shape's rule (:func:`resolve_tuning`, with ``kv_fits_l2``)."""
    tuning = DEFAULT_TUNING if tuning is None else tuning
    if isinstance(tuning, Sm90PrefillTuning):     # (the config refuses any other, by name)
        tuning = resolve_tuning(tuning, h_q, d_qk, kv_fits_l2)
    return Sm90SparsePrefillConfig(h_q=h_q, d_qk=d_qk, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink,
                                   tuning=tuning)


def config_for(plan, has_attn_sink: bool, tuning=None) -> Sm90SparsePrefillConfig:
    """The config a sparse prefill plan's calls compile (the launcher's call)."""
    return kernel_config(h_q=plan.kernel_h_q, d_qk=plan.d_qk, has_topk_length=plan.has_topk_length,
                         has_attn_sink=has_attn_sink, tuning=tuning, kv_fits_l2=plan.kv_fits_l2)


def tensor_maps(cfg: Sm90SparsePrefillConfig) -> tuple:
    """The TMA descriptors the kernel builds: Q and out (rows are gathered by cp.async)."""
    return ("q", "out")
