"""The plan of one sparse prefill call (``flash_mla_sparse_fwd``): which kernel, with how many heads,
and what memory beyond the outputs it needs.

A prefill work item is one query token x 64 heads walking its token's whole top-k list: there is
no schedule and no split, so no workspace. 8, 16 or 32 heads: on SM90 natively in the swap-AB tile
(the top-k rows on the MMA's M side, the heads on N: the MMAs do the heads' work only; the config
module's ``kernel_tile``), on an arch whose kernel takes 64 or 128 only on a copy of q padded with
zero heads (and a padded out, max_logits and lse, whose first h_q heads are copied back): the plan
names those transient bytes. The plan also says whether the call's kv rows fit the arch's L2
(``kv_fits_l2``): a config rule reads it (on SM90, whether the gather prefetches rows into L2).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Optional

from .. import archs, registry

OP = "sparse_prefill"
KERNEL_H_Q = (64, 128)              # heads every arch's kernel runs natively
SMALL_H_Q = (8, 16, 32)             # native on SM90, padded to 64 where the arch's kernel has no small tile
SUPPORTED_H_Q = SMALL_H_Q + KERNEL_H_Q
SUPPORTED_D_QK = (576, 512)
D_V = 512
BLOCK_TOPK = 64                     # top-k positions per K tile
MAX_TOPK = 2**31 - BLOCK_TOPK       # list positions are int32
MAX_ITEMS = 2**31 - 1               # s_q * ceil(h_q / 64) work items, s_q * h_q lse entries: int32 indices


@dataclass(frozen=True)
class SparsePrefillPlan:
    """What one call will do (:func:`plan_sparse_prefill`); ``cute-mla plan --op sparse_prefill``
    prints it."""

    arch: str
    s_q: int
    h_q: int
    d_qk: int
    topk: int
    has_topk_length: bool
    kernel_h_q: int             # heads the kernel runs: h_q, or 64 where the arch pads 8/16/32 (config module's kernel_heads)
    kernel: str                 # the arch's kernel name (registry.OpSpec.kernels)
    tile: str = "heads on M"    # the MMA tile (config module's kernel_tile): "heads on N (swap-AB)" for SM90's 8/16/32
    s_kv: Optional[int] = None  # kv rows (None: not known, planned as rows past the L2)
    d_v: int = D_V
    op: str = OP

    @property
    def kv_fits_l2(self) -> bool:
        """The call's kv rows fit the arch's L2 (``archs.ArchSpec.l2_bytes``), so the walks find
        them there; False where either is unknown."""
        l2 = archs.get(self.arch).l2_bytes
        return self.s_kv is not None and l2 is not None and self.s_kv * self.d_qk * 2 <= l2

    @property
    def padded(self) -> bool:
        return self.kernel_h_q != self.h_q

    @property
    def split(self) -> bool:
        """A prefill CTA walks its token's whole list: never split."""
        return False

    @property
    def workspace_bytes(self) -> int:
        """Device memory beyond the outputs: none."""
        return 0

    @property
    def padding_bytes(self) -> int:
        """Transient bytes of a padded call: q, out, max_logits and lse with the kernel's heads."""
        if not self.padded:
            return 0
        return self.s_q * self.kernel_h_q * (self.d_qk * 2 + self.d_v * 2 + 4 + 4)

    @property
    def items(self) -> int:
        """Work items: (query token, 64-head block) pairs, walked by a persistent grid."""
        return self.s_q * -(-self.kernel_h_q // 64)

    @property
    def tensor_maps(self) -> tuple:
        return registry.config_module(self.op, self.arch).tensor_maps(None)

    def describe(self) -> str:
        pad = (f"; {self.h_q} heads run as {self.kernel_h_q} (zero heads padded: {self.padding_bytes / 2**20:.1f} MiB "
               "transient)") if self.padded else ""
        heads = min(self.kernel_h_q, 64)
        kv = "" if self.s_kv is None else f" s_kv={self.s_kv} (rows {'in' if self.kv_fits_l2 else 'past'} L2)"
        tile = (f"; MMA tile: the {self.h_q} heads on N, the top-k rows on M (swap-AB)"
                if self.tile != SparsePrefillPlan.tile else "")
        return (f"{self.kernel} on {self.arch}: s_q={self.s_q} h_q={self.h_q} d_qk={self.d_qk} topk={self.topk}"
                f"{' with topk_length' if self.has_topk_length else ''}"
                f"{kv}; {self.items} work items (one query token x "
                f"{heads} heads each, its whole list of {self.topk // BLOCK_TOPK} K tiles), no split, workspace 0 "
                f"bytes{pad}{tile}")


def check_problem(s_q: int, h_q: int, d_qk: int, topk: int) -> None:
    """The shapes a call may have, each refused by name."""
    if h_q not in SUPPORTED_H_Q:
        raise ValueError(f"h_q: got {h_q}, accepted: {', '.join(map(str, SUPPORTED_H_Q))} (pad other head counts to one "
                         "of these)")
    if d_qk not in SUPPORTED_D_QK:
        raise ValueError(f"d_qk: got {d_qk}, accepted: 576 (V3.2: 512 latent + 64 RoPE) or 512 (V4)")
    if topk <= 0 or topk % BLOCK_TOPK or topk > MAX_TOPK:
        raise ValueError(f"topk: got {topk}, accepted: a positive multiple of {BLOCK_TOPK} up to {MAX_TOPK}")
    if s_q < 0:
        raise ValueError(f"s_q: got {s_q}, accepted: >= 0")
    blocks = -(-h_q // 64)
    if s_q * blocks > MAX_ITEMS or s_q * h_q > MAX_ITEMS:
        raise ValueError(f"s_q: got {s_q}, accepted: at most {MAX_ITEMS // max(blocks, h_q)} tokens per call at "
                         f"h_q={h_q} (work items and lse / max_logits entries are int32-indexed); split the call")


@functools.lru_cache(maxsize=4096)
def plan_sparse_prefill(s_q: int, h_q: int, d_qk: int, topk: int, *, arch: str, has_topk_length: bool = False,
                        s_kv: Optional[int] = None, policy=None) -> SparsePrefillPlan:
    """The plan of a call (``s_kv``: kv's rows, where known). ``policy``: none yet (the op has one
    rule); taken for the registry's planner signature."""
    archs.get(arch)
    check_problem(s_q, h_q, d_qk, topk)
    if s_kv is not None and (not isinstance(s_kv, int) or s_kv < 1):
        raise ValueError(f"s_kv: got {s_kv!r}, accepted: a positive int (kv's rows) or None")
    kernel = registry.op(OP).kernel(arch).name
    mod = registry.config_module(OP, arch)
    return SparsePrefillPlan(arch=arch, s_q=s_q, h_q=h_q, d_qk=d_qk, topk=topk, has_topk_length=has_topk_length,
                             kernel_h_q=mod.kernel_heads(h_q), kernel=kernel, tile=mod.kernel_tile(h_q), s_kv=s_kv)


def kernel_variants(arch: str, h_qs=SUPPORTED_H_Q, formats=None, kernels=None):
    """Every (kernel name, config) a sparse prefill plan on ``arch`` can compile: the plans of each
    of ``h_qs``, each key width (``formats``: format names whose key width to take, default both),
    with and without ``topk_length``, kv rows in and past the L2, each with and without a sink
    (the arch's ``config_for``; plans of one config listed once)."""
    from ..formats import format_named
    spec = registry.op(OP)
    if kernels is not None and spec.name not in kernels:
        return []
    widths = SUPPORTED_D_QK if formats is None else tuple(dict.fromkeys(format_named(f).d_qk for f in formats))
    mod = registry.config_module(OP, arch)
    configs = {}
    for h, d, tl, s_kv in itertools.product(h_qs, widths, (False, True), (1, None)):
        plan = plan_sparse_prefill(1, h, d, BLOCK_TOPK, arch=arch, has_topk_length=tl, s_kv=s_kv)
        for sink in (False, True):
            configs.setdefault(mod.config_for(plan, sink), None)
    return [(spec.name, cfg) for cfg in configs]
