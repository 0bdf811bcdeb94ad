"""The split-KV scheduler: how many partitions, and which partition does which blocks.

This module is the host half (plain Python on ints) and the single definition of the algorithm; the
device half (:mod:`cute_mla.scheduler.device`) runs the same greedy loop in a one-thread CuTe DSL
kernel so that a GPU call never synchronizes with the host. Both produce FlashMLA's
``DecodingSchedMeta`` rows and ``num_splits`` prefix sum, entry by entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import List, Sequence, Tuple

BLOCK_TOPK = 64          # tokens per scheduling block (the kernels' top-k tile)
MIN_PIECE_BLOCKS = 2     # SM90 zero-charge rule: blocks per partition on average at least this
FIXED_OVERHEAD = 5       # virtual blocks charged per request piece for its prologue/epilogue (FlashMLA's)


class SchedField(IntEnum):
    """Columns of one int32 (num_sm_parts, 8) scheduler row (FlashMLA's ``DecodingSchedMeta``)."""

    BEGIN_REQ = 0            # first request of the partition; == b for an empty trailing partition
    END_REQ = 1              # last request, inclusive
    BEGIN_BLOCK = 2          # first block of BEGIN_REQ
    END_BLOCK = 3            # one past the last block of END_REQ
    BEGIN_SPLIT = 4          # split index of BEGIN_REQ's piece (0 for the others)
    FIRST_REQ_SPLIT = 5      # BEGIN_REQ is split (its piece here is partial)
    LAST_REQ_SPLIT = 6       # END_REQ is split
    PAD = 7


SCHED_ROW_INTS = 8


def head_blocks(h_q: int) -> int:
    """CTAs a query token's heads take on an arch that runs heads in blocks of 64: ceil(h_q / 64)
    (8, 16 or 32 heads: one, on SM90's swap-AB tile)."""
    return -(-h_q // 64)


def num_sm_parts(num_sms: int, s_q: int, h_q: int, *, per_head_block: bool) -> int:
    """Number of scheduler partitions: the grid is sized so that CTAs ~ num_sms (FlashMLA's count;
    ``per_head_block``: each token's 64-head blocks are CTAs of their own, as on SM90; the arch's
    policy says, ``plan.policy.SparseDecodePolicy.num_sm_parts``)."""
    if num_sms <= 0 or s_q <= 0 or h_q <= 0:
        raise ValueError(f"num_sm_parts: num_sms, s_q and h_q must be positive, got {num_sms}, {s_q}, {h_q}")
    per_token = head_blocks(h_q) if per_head_block else 1
    return max(num_sms // s_q // per_token, 1)


def fixed_overhead_blocks(*, b: int, parts: int, blocks: int, zero_rule: bool) -> int:
    """Virtual blocks the greedy partitioner charges per request piece (``blocks``: top-k blocks
    per request, an upper bound where ``topk_length`` may shorten them).

    FlashMLA charges ``FIXED_OVERHEAD``. Under ``zero_rule`` (SM90's policy), with fewer requests than partitions the charge is
    0 when that leaves at least ``MIN_PIECE_BLOCKS`` blocks per partition on average *and*
    shortens the most loaded partition. FlashMLA's charge makes the pieces longer than the
    partitions allow, so partitions, hence SMs, stay empty: at b=1, s_q=8 it cuts 11 pieces of 3
    blocks for 16 partitions (h=64), 7 pieces of 5 for 8 (h=128); charging 0 fills them (16
    pieces of 2, 8 of 4), measured faster (docs/performance.md). One-block pieces are where it
    lost (4x1x64: 128 one-block pieces instead of 64 two-block ones; each piece stores a partial
    that the combine reads back), hence the average
    floor; a charge that does not shorten the longest partition only adds pieces, hence the second
    condition. Individual pieces may still be one block long (the greedy cuts where budgets end).
    A policy's ``device_piece_charges`` override this charge for device schedules
    (``plan.policy.SparseDecodePolicy``).
    """
    if zero_rule and b < parts and b * blocks >= MIN_PIECE_BLOCKS * parts:
        zero = plan_splits_host([blocks] * b, parts, 0)
        flashmla = plan_splits_host([blocks] * b, parts, FIXED_OVERHEAD)
        if longest_partition(zero.rows, blocks) < longest_partition(flashmla.rows, blocks):
            return 0
    return FIXED_OVERHEAD


def longest_partition(rows: Sequence[Sequence[int]], blocks: int) -> int:
    """Blocks of the most loaded scheduler row when every request has ``blocks`` blocks."""
    def work(r):
        if r[SchedField.BEGIN_REQ] > r[SchedField.END_REQ]:
            return 0
        if r[SchedField.BEGIN_REQ] == r[SchedField.END_REQ]:
            return r[SchedField.END_BLOCK] - r[SchedField.BEGIN_BLOCK]
        middle = r[SchedField.END_REQ] - r[SchedField.BEGIN_REQ] - 1
        return blocks - r[SchedField.BEGIN_BLOCK] + middle * blocks + r[SchedField.END_BLOCK]
    return max(work(r) for r in rows)


def blocks_of_length(length, topk, minimum=min, maximum=max):
    """FlashMLA's rule for a request with ``topk_length``: its effective length ``min(length,
    topk)`` (a position at or past it is invalid) and its 64-token blocks, ``ceil(length / 64)``
    but at least one (a zero or negative length still takes one block). Without ``topk_length`` a
    request has ``topk // BLOCK_TOPK`` blocks (top-k is a multiple of 64).

    The one definition of the rule for every place that applies it: the host plan (Python ints,
    the default ``minimum`` / ``maximum``), the device schedule (torch tensors) and the kernels
    (DSL integers): each passes its own min and max."""
    length = minimum(length, topk)
    return length, maximum((length + (BLOCK_TOPK - 1)) // BLOCK_TOPK, 1)


def extra_blocks_of_length(length, extra_topk, minimum=min, maximum=max):
    """The extra list's rule (``extra_topk_length``): its effective length ``min(length,
    extra_topk)``, at least 0, and its 64-token blocks ``ceil(length / 64)``, possibly none. A
    request's blocks are its main list's (:func:`blocks_of_length`, at least one) followed by
    these (FlashMLA: ``roundup(main, 64) + extra``)."""
    length = maximum(minimum(length, extra_topk), 0)
    return length, (length + (BLOCK_TOPK - 1)) // BLOCK_TOPK


def blocks_per_request(topk: int, topk_length: Sequence[int] | None = None, b: int | None = None,
                       extra_topk: int = 0, extra_topk_length: Sequence[int] | None = None) -> List[int]:
    """64-token blocks of each request's top-k list plus its extra list (:func:`blocks_of_length`,
    :func:`extra_blocks_of_length`)."""
    if b is None:
        lengths = topk_length if topk_length is not None else extra_topk_length
        if lengths is None:
            raise ValueError("blocks_per_request: give b when no length tensor is given")
        b = len(lengths)
    main = ([topk // BLOCK_TOPK] * b if topk_length is None
            else [blocks_of_length(int(n), topk)[1] for n in topk_length])
    extra = ([extra_topk // BLOCK_TOPK] * b if extra_topk_length is None
             else [extra_blocks_of_length(int(n), extra_topk)[1] for n in extra_topk_length])
    return [m + e for m, e in zip(main, extra)]


@dataclass(frozen=True)
class HostSchedule:
    """A schedule computed on the host: the rows, the prefix sum and what they imply."""

    rows: Tuple[Tuple[int, ...], ...]   # (num_sm_parts, 8)
    num_splits: Tuple[int, ...]         # (b + 1,)

    @property
    def split_rows(self) -> int:
        """Accumulator rows the split kernel writes: one per piece of every split request."""
        n = self.num_splits
        return sum(n[i + 1] - n[i] for i in range(len(n) - 1) if n[i + 1] - n[i] > 1)

    @property
    def any_split(self) -> bool:
        n = self.num_splits
        return any(n[i + 1] - n[i] > 1 for i in range(len(n) - 1))


def plan_splits_host(num_blocks: Sequence[int], num_sm_parts: int, fixed_overhead: int = FIXED_OVERHEAD) -> HostSchedule:
    """FlashMLA's greedy partitioning, in plain Python.

    Every request costs its blocks plus ``fixed_overhead`` virtual blocks; each partition gets a
    budget of ``ceil(total / P) + fixed_overhead``. A request is cut only where it crosses a budget
    boundary; each cut piece pays the overhead again.
    """
    b = len(num_blocks)
    if b == 0:
        raise ValueError("num_blocks: at least one request is needed")
    if num_sm_parts < 1:
        raise ValueError(f"num_sm_parts: must be >= 1, got {num_sm_parts}")
    nb = [int(x) for x in num_blocks]
    if min(nb) < 1:
        raise ValueError(f"num_blocks: every request has at least one block, got min {min(nb)}")
    total = sum(n + fixed_overhead for n in nb)
    payload = -(-total // num_sm_parts) + fixed_overhead

    req, block, n_split, cum = 0, 0, 0, 0
    num_splits = [0] * (b + 1)
    rows = []
    for _ in range(num_sm_parts):
        begin_req, begin_block, begin_split = req, block, n_split
        first_split = block != 0
        budget = payload
        while req < b:
            remain = nb[req] - block
            if budget >= remain + fixed_overhead:
                cum += n_split + 1
                num_splits[req + 1] = cum
                budget -= remain + fixed_overhead
                req, block, n_split = req + 1, 0, 0
            else:
                if budget - fixed_overhead > 0:
                    block += budget - fixed_overhead
                    n_split += 1
                    budget = 0
                break
        end_req = req if block > 0 else req - 1
        end_block = block if block > 0 else nb[req - 1]
        last_split = end_block != nb[end_req]
        if begin_req == end_req:
            first_split = last_split = first_split or last_split
        rows.append((begin_req, end_req, begin_block, end_block, begin_split, int(first_split), int(last_split), 0))
    assert req == b and block == 0 and n_split == 0, "scheduler: not every request was consumed"
    return HostSchedule(rows=tuple(rows), num_splits=tuple(num_splits))


def accum_offsets(num_splits: Sequence[int]) -> Tuple[int, ...]:
    """Compact accumulator row offsets (b + 1,): only split requests own rows.

    FlashMLA indexes ``o_accum`` with ``num_splits`` itself, so every request owns a row whether it
    is split or not, and ``b + num_sm_parts`` rows are allocated. cute-mla hands the kernels this
    prefix sum instead: request i owns rows ``[off[i], off[i+1])``, an empty range when it is not
    split. The kernels' row formula (``off[r] + split_idx``) is unchanged, the combine skips any
    request with fewer than two rows, and the total is the real number of split pieces, at most
    ``2 * (num_sm_parts - 1)`` (each cut adds one piece and makes at most one more request split).
    """
    out = [0]
    for i in range(len(num_splits) - 1):
        n = num_splits[i + 1] - num_splits[i]
        out.append(out[-1] + (n if n > 1 else 0))
    return tuple(out)


def per_request_rows(num_blocks: Sequence[int]) -> Tuple[Tuple[int, ...], ...]:
    """One partition per request, nothing split (SM100's no-split schedule for short top-k lists)."""
    return tuple((i, i, 0, int(n), 0, 0, 0, 0) for i, n in enumerate(num_blocks))


def whole_request_rows(n: int, blocks: int, parts: int) -> Tuple[Tuple[int, ...], ...]:
    """``parts`` partitions of contiguous *whole* requests of ``blocks`` blocks each, nothing split
    (SM90 token walk).

    Requests are dealt by count (partition p takes ``[p*n//P, (p+1)*n//P)``), so no partition
    holds more than one request above the average. Partitions left without a request get
    FlashMLA's empty-row form (``begin_req == b``).
    """
    if parts < 1 or n < 1 or blocks < 1:
        raise ValueError(f"whole_request_rows: needs n, blocks and parts >= 1, got {n}, {blocks}, {parts}")
    rows = []
    for p in range(parts):
        r0, r1 = p * n // parts, (p + 1) * n // parts
        if r1 > r0:
            rows.append((r0, r1 - 1, 0, blocks, 0, 0, 0, 0))
        else:
            rows.append((n, n - 1, 0, 0, 0, 0, 0, 0))
    return tuple(rows)


def max_accum_rows(num_sm_parts: int, b: int) -> int:
    """Upper bound of the compact accumulator rows for any lengths (used when the host can't know).

    Every cut adds one piece and makes at most one more request split, so split pieces are at most
    ``2 * (P - 1)``; they are also at most all pieces, ``b + P - 1``.
    """
    return min(2 * (num_sm_parts - 1), b + num_sm_parts - 1)
