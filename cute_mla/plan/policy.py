"""The sparse decode planner's policy: its schedule rules as one frozen value per arch.

:func:`~cute_mla.plan.plan_sparse_decode` takes a :class:`SparseDecodePolicy` (default: the arch's,
:func:`default_policy`). A rule that is ``None`` is off. Each rule's docstring says what it does
and why; what each was measured at lives in ``docs/performance.md``. A tool that wants another
schedule passes another policy (``dataclasses.replace(default_policy(arch), packed=None)``): no
code assigns into this module.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

from .. import archs
from ..scheduler import partition as sched


@dataclass(frozen=True)
class PerRequestRule:
    """One partition per request (no split, no accumulators, no combine) where per-request lengths
    make the schedule a device one and the lists are short: the (request, head block) CTAs start
    as SMs free up and the call takes as long as its longest request or its waves of CTA starts,
    while the split schedule balances the blocks but pays the partials and the combine.

    Lists of at most ``tiny_blocks`` blocks take it up to ``tiny_max_waves`` waves of CTAs; lists
    of at most ``max_blocks`` blocks between ``waves[0]`` and ``waves[1]`` waves, at the head
    counts of ``heads`` where the split schedule charges pieces at cost (elsewhere at any head
    count). Below half a wave the GPU idles; longer lists lose to the longest request."""

    max_blocks: int = 10
    heads: Tuple[int, ...] = (64,)
    waves: Tuple[float, float] = (0.5, 2.0)
    tiny_blocks: int = 2
    tiny_max_waves: float = 4.0

    def applies(self, b: int, h_q: int, blocks: int, num_sms: int, pieces_at_cost: bool) -> bool:
        if b > archs.MAX_GRID_Y:
            return False
        waves = b * sched.head_blocks(h_q) / num_sms
        if blocks <= self.tiny_blocks:
            return waves <= self.tiny_max_waves
        return (blocks <= self.max_blocks and (h_q in self.heads or not pieces_at_cost)
                and self.waves[0] <= waves <= self.waves[1])


@dataclass(frozen=True)
class PackedRule:
    """Whole requests dealt by cost into one wave of partitions (the "balanced" schedule, made on
    the device; the kernel walks the schedule's request order), nothing split. A CTA's later
    requests overlap their index scan and first gathers with the request before, which one
    partition per request cannot, and no partials are written or combined. It needs many requests
    per partition to balance them: ``min_waves`` of (request, head block) CTAs, per head count it
    was measured at (a partition holds a head block of its requests, so this counts requests per
    partition). It is taken with one query token per request, an extra list, and lists of
    (``min_blocks``, ``max_blocks``] blocks (the shapes it was measured on). The cut weighs a
    request by the rows inside its lengths (``schedule.device_blocks_and_rows``), which its compacted
    tiles follow, not by its blocks; it charges nothing per request."""

    min_waves: Tuple[Tuple[int, float], ...] = ((8, 3.0), (16, 3.0), (128, 6.0))
    min_blocks: int = 2
    max_blocks: int = 18

    def waves_at(self, h_q: int) -> Optional[float]:
        """The minimum waves at ``h_q``, or None where the rule was not measured."""
        return dict(self.min_waves).get(h_q)

    def takes(self, h_q: int, has_extra: bool) -> bool:
        """The kernels it can reach: its head counts, with an extra list (what warmup compiles)."""
        return self.waves_at(h_q) is not None and has_extra

    def applies(self, b: int, s_q: int, h_q: int, blocks: int, extra_topk: int, num_sms: int) -> bool:
        if s_q != 1 or not self.takes(h_q, bool(extra_topk)):
            return False
        waves = b * sched.head_blocks(h_q) / num_sms
        return self.min_blocks < blocks <= self.max_blocks and waves >= self.waves_at(h_q)


@dataclass(frozen=True)
class SparseDecodePolicy:
    """How the sparse decode planner decides for one arch. Every field is a rule or a fact the plan
    reads; ``None`` turns a rule off."""

    # partitions = num_sms // s_q, divided by the token's 64-head CTAs where each is a CTA of its own
    parts_per_head_block: bool = False
    # the per-piece charge may drop to 0 on few-request shapes (scheduler.partition.fixed_overhead_blocks)
    zero_overhead_rule: bool = False
    # FlashMLA's SM100 rule: lists of at most this many positions (main + extra) run one partition
    # per request, unsplit, whatever the lengths
    no_split_max_topk: Optional[int] = None
    # the column pair (h_q = 64 split pieces of a host schedule on a cluster of 2 CTAs that each own
    # 256 of the 512 output columns) while at most this many CTAs, and num_sms / 4, have work without
    # it: it shortens a piece's chain where few pieces leave most SMs idle, and loses once the
    # doubled CTAs crowd the GPU (device schedules keep one CTA per piece: their partitions are unknown)
    column_pair_max_busy_ctas: Optional[int] = None
    per_request: Optional[PerRequestRule] = None
    packed: Optional[PackedRule] = None
    # blocks a device split schedule charges per request piece, per format name: about what a piece
    # costs (its Q load, its first gathers, its store) rather than the scheduler's rule, whose larger
    # charge takes blocks from the partitions with more pieces and leaves trailing ones empty
    device_piece_charges: Tuple[Tuple[str, int], ...] = ()
    # b == 1 without lengths, one partition, more (token, head block) CTAs than SMs (a mixed batch):
    # the s_q tokens run as s_q one-token requests over num_sms // (h_q / 64) partitions of whole
    # tokens, so each CTA overlaps one token's end with the next one's rows (it assumes the whole
    # GPU: with fewer SMs free the leftover partitions wait for a whole one)
    token_walk: bool = False

    def column_pair_takes(self, h_q: int) -> bool:
        """Whether the column pair can run at ``h_q`` under this policy (it pairs one 64-head block)."""
        return self.column_pair_max_busy_ctas is not None and h_q == 64

    def num_sm_parts(self, num_sms: int, s_q: int, h_q: int) -> int:
        """FlashMLA's partition count under this policy (:func:`cute_mla.scheduler.partition.num_sm_parts`)."""
        return sched.num_sm_parts(num_sms, s_q, h_q, per_head_block=self.parts_per_head_block)

    def fixed_overhead(self, b: int, parts: int, blocks: int) -> int:
        """The scheduler's per-piece charge under this policy."""
        return sched.fixed_overhead_blocks(b=b, parts=parts, blocks=blocks, zero_rule=self.zero_overhead_rule)

    def device_charge(self, format_name: str) -> Optional[int]:
        """The charge of a device split schedule for a format, or None (the scheduler's rule)."""
        return dict(self.device_piece_charges).get(format_name)


POLICIES = {
    archs.SM90.name: SparseDecodePolicy(
        parts_per_head_block=True, zero_overhead_rule=True,
        column_pair_max_busy_ctas=32, per_request=PerRequestRule(), packed=PackedRule(),
        device_piece_charges=(("V4", 1),), token_walk=True),
    archs.SM100.name: SparseDecodePolicy(no_split_max_topk=640),
}


@functools.lru_cache(maxsize=None)
def default_policy(arch: str) -> SparseDecodePolicy:
    """The arch's sparse decode policy (a ValueError names the accepted archs)."""
    archs.get(arch)
    return POLICIES[arch]
