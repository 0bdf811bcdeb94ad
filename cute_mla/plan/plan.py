"""The plan of one sparse decode call: which kernel, which variant, and what memory it needs.

The plan is the single source of truth for the workspace rule of cute-mla: the split-KV
accumulators (``o_accum``, ``lse_accum``) are allocated, their TMA tensor map built and the combine
launched **only when at least one request is split**.

- num_sm_parts == 1: the scheduler never splits (the budget covers every request), so the
  no-split kernel runs and the workspace is 0 bytes, whatever topk_length holds.
- No topk_length: every request has topk/64 blocks, so the host knows the schedule. It runs the
  scheduler itself; if nothing is split the no-split kernel runs with 0 bytes of workspace, else the
  accumulators have exactly the real split rows (only split requests own rows, see
  :func:`cute_mla.scheduler.accum_offsets`).
- topk_length given (device values the host must not read): the schedule is made on the device and
  the accumulators are sized for the worst case, ``min(2 * (num_sm_parts - 1), b + num_sm_parts - 1)``
  rows (:func:`cute_mla.scheduler.partition.max_accum_rows`), still below FlashMLA's ``b + num_sm_parts``.
- SM100 with topk + extra_topk <= 640 (FlashMLA's rule): one partition per request, never split, 0 bytes.
- SM90 with lengths and short lists (``sm90_per_request``): one partition per request as well;
  V4 at h_q = 128 and s_q = 1 from ``PACKED_MIN_WAVES`` waves of CTAs up (``sm90_packed``): one
  wave of partitions of whole requests dealt by cost on the device (the "balanced" schedule, whose
  rows index a request order), never split. Other V4 device schedules
  charge a request piece what it costs (``sm90_device_charge``).

Token walk (SM90, b == 1, no topk_length, one partition, more CTAs than SMs: vLLM's mixed batch):
FlashMLA's grid would start one CTA per token and head half, each paying its own start and end
for ~26 tiles of work. The plan instead treats the s_q tokens as s_q requests of one token
(the launcher passes views: no copy; ``host_schedule.rows`` index tokens, its ``num_splits`` is the
call's one request, unsplit) and gives each of ``num_sms // (h_q/64)`` partitions a contiguous
range of whole tokens, nothing split: each CTA walks ~s_q/num_sms tokens and overlaps
one token's end with the next one's rows (measured 1.02-1.04x against FlashMLA's grid on
1x1024..1x32768, h = 64 and 128, bit-identical outputs). It assumes the whole GPU: with fewer SMs
free (MPS, green contexts, a concurrent kernel) the partitions left over wait for a whole one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

from .. import archs
from ..formats import V4, KVCacheFormat, format_for_d_qk, supported_formats
from ..scheduler import partition as sched

SUPPORTED_H_Q = (64, 128)
MAX_QUERY_ROWS = 2**31 - 1   # b * s_q: the combine's grid x and int32 row indices
MAX_REQUESTS = 2**20         # b: the host scheduler and the plan walk every request in Python
BLOCK_TOPK = sched.BLOCK_TOPK
# topk, extra_topk: list positions are int32, and the SM90 kernels carry the extra list's positions
# offset by 2^30 (kernels/sm90/index_scan.EXTRA_BASE), so each list is shorter than that.
MAX_TOPK = 2**30 - BLOCK_TOPK
ACCUM_ITEM_BYTES = {"float32": 4, "bfloat16": 2}   # o_accum element sizes (SparseDecodePlan.accum_dtype)
LSE_ACCUM_BYTES = 4                    # one fp32 lse_accum entry per (row, token, head)
FLASHMLA_ACCUM_BYTES_PER_HEAD = 512 * 4 + LSE_ACCUM_BYTES   # FlashMLA's fp32 o_accum row of d_v=512 and its lse
# The column pair pays off while its doubled CTAs leave the GPU mostly idle: measured faster up to
# 32 pieces with work on the H200 (1x1x64 .. 2x1x64), slower beyond (sm90_column_pair).
COLUMN_PAIR_MAX_BUSY_CTAS = 32
# SM90 one partition per request (sm90_per_request): lists of at most PER_REQUEST_MAX_BLOCKS blocks
# (V4's 128 + 512 positions) between half a wave and two waves of CTAs (where pieces are charged
# at cost, only at an h_q of PER_REQUEST_HEADS), or of at most PER_REQUEST_TINY_BLOCKS (V4's 128
# without an extra list) up to four waves.
PER_REQUEST_MAX_BLOCKS = 10
PER_REQUEST_HEADS = (64,)
PER_REQUEST_WAVES = (0.5, 2)
PER_REQUEST_TINY_BLOCKS = 2
PER_REQUEST_TINY_MAX_WAVES = 4
# SM90 whole requests dealt into one wave of partitions (sm90_packed): h_q = 128, s_q = 1, an
# extra list, (PER_REQUEST_TINY_BLOCKS, PACKED_MAX_BLOCKS] blocks per request, at least
# PACKED_MIN_WAVES waves of (request, head block) CTAs; the cut charges nothing per request
# (schedule.balanced_schedule_device: a charge would not change it).
PACKED_H_Q = 128
PACKED_MIN_WAVES = 6.0
PACKED_MAX_BLOCKS = 18
# SM90 split schedules made on the device for the V4 format charge a request piece
# V4_DEVICE_PIECE_CHARGE blocks, not the scheduler's rule (sm90_device_charge).
V4_DEVICE_PIECE_CHARGE = 1


@dataclass(frozen=True)
class SparseDecodePlan:
    """What one call will do, decided before it runs (:func:`plan_sparse_decode`): the kernel and
    its variant, the schedule's source and partitions, and the accumulator rows the workspace
    holds (0 when nothing is split). ``cute-mla plan`` prints it."""

    arch: str
    b: int
    s_q: int
    h_q: int
    d_qk: int
    d_v: int
    topk: int
    has_topk_length: bool               # the call passes topk_length (per-request lengths on the device)
    num_sm_parts: int
    fixed_overhead: int                 # blocks the cut charges per request piece (0 for the balanced cut)
    kernel: str                         # the arch's kernel name (archs.ArchSpec.kernel)
    split: bool                         # the split variant (takes accumulators) runs
    schedule: str                       # "host" (computed here) | "device" (scheduler kernel) | "per_request" | "balanced"
    accum_rows: int                     # rows of o_accum / lse_accum (0 when nothing is split)
    host_schedule: Optional[sched.HostSchedule]
    token_walk: bool = False            # the s_q tokens run as s_q one-token requests (module docstring)
    column_pair: bool = False           # SM90 h=64 split: a cluster of 2 CTAs per piece (sm90_column_pair)
    accum_dtype: str = "float32"        # o_accum's element type when split (the arch's); lse_accum is fp32
    extra_topk: int = 0                 # the extra pool's list length (0: no extra pool)
    has_extra_topk_length: bool = False # the call passes extra_topk_length

    @property
    def lengths_on_device(self) -> bool:
        """Per-request lengths the host must not read: the schedule is made on the device."""
        return self.has_topk_length or self.has_extra_topk_length

    @property
    def blocks_per_request(self) -> int:
        """64-token blocks of a request without lengths (an upper bound with them): its main list's,
        then its extra list's."""
        return (self.topk + self.extra_topk) // BLOCK_TOPK

    @property
    def orders_requests(self) -> bool:
        """The schedule's rows index positions in a request order (the balanced cut of whole
        requests, ``schedule.balanced_schedule_device``), not requests."""
        return self.schedule == "balanced"

    @property
    def variant(self) -> str:
        return "split" if self.split else "no_split"

    @property
    def workspace_bytes(self) -> int:
        return self.accum_rows * self.s_q * self.h_q * (self.d_v * ACCUM_ITEM_BYTES[self.accum_dtype] + LSE_ACCUM_BYTES)

    @property
    def tensor_maps(self) -> Tuple[str, ...]:
        maps = archs.get(self.arch).tensor_maps(self.split, self.extra_topk > 0)
        # the column pair stores out from registers: its 64 x 128 column blocks have no tensor map
        return tuple(m for m in maps if not (self.column_pair and m == "out"))

    @property
    def launches(self) -> Tuple[str, ...]:
        out = ("scheduler",) if self.schedule == "device" else ()
        out += (self.kernel,)
        return out + (("combine",) if self.split else ())

    @property
    def flashmla_workspace_bytes(self) -> int:
        """What FlashMLA (vLLM's fork) allocates for the same call: (b + num_sm_parts) rows whenever
        split-KV is on, i.e. always on SM90 and above top-k 640 on SM100."""
        no_split_max = archs.get(self.arch).no_split_max_topk
        if no_split_max is not None and self.topk + self.extra_topk <= no_split_max:
            return 0
        return (self.b + self.num_sm_parts) * self.s_q * self.h_q * FLASHMLA_ACCUM_BYTES_PER_HEAD

    def describe(self) -> str:
        lines = [
            f"arch {self.arch}  b={self.b} s_q={self.s_q} h_q={self.h_q} d_qk={self.d_qk} topk={self.topk}"
            f"{f' extra_topk={self.extra_topk}' if self.extra_topk else ''}"
            f"{' topk_length' if self.has_topk_length else ''}{' extra_topk_length' if self.has_extra_topk_length else ''}",
            f"kernel {self.kernel} ({self.variant})  num_sm_parts={self.num_sm_parts}  schedule on {self.schedule}",
        ]
        if self.token_walk:
            lines.append(f"token walk: {self.s_q} one-token requests over {len(self.host_schedule.rows)} partitions "
                         "of whole tokens")
        if self.column_pair:
            lines.append("column pair: each piece on a cluster of 2 CTAs, 256 of the 512 output columns each")
        if self.orders_requests:
            lines.append(f"balanced: whole requests dealt by cost into {self.num_sm_parts} partitions; the rows index "
                         "positions in the schedule's request order")
        lines += [
            f"launches: {', '.join(self.launches)}",
            f"accumulator rows: {self.accum_rows}{f' ({self.accum_dtype} o_accum)' if self.split else ''}  "
            f"workspace: {self.workspace_bytes} bytes ({self.workspace_bytes / 2**20:.2f} MiB)",
            f"tensor maps: {', '.join(self.tensor_maps)}",
            f"FlashMLA would allocate: {self.flashmla_workspace_bytes / 2**20:.2f} MiB",
        ]
        return "\n".join(lines)


def check_problem(b: int, s_q: int, h_q: int, d_qk: int, topk: int, extra_topk: int = 0) -> KVCacheFormat:
    """Shape rules shared by the plan and the API; returns the cache format of ``d_qk``."""
    for name, v in (("b", b), ("s_q", s_q), ("topk", topk)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be a positive int, got {v!r}")
    if h_q not in SUPPORTED_H_Q:
        raise ValueError(f"h_q: got {h_q}, accepted: 64 or 128 (pad the heads, as vLLM and SGLang do)")
    if b > MAX_REQUESTS or b * s_q > MAX_QUERY_ROWS:
        raise ValueError(f"b, s_q: got b={b}, s_q={s_q}, accepted: b <= {MAX_REQUESTS} and b * s_q <= {MAX_QUERY_ROWS} "
                         "(the combine's grid and the kernels' row indices are int32; the host scheduler walks "
                         "every request)")
    if topk % BLOCK_TOPK or topk > MAX_TOPK:
        raise ValueError(f"topk: got {topk}, accepted: a positive multiple of {BLOCK_TOPK} up to {MAX_TOPK}")
    if not isinstance(extra_topk, int) or extra_topk < 0 or extra_topk % BLOCK_TOPK or extra_topk > MAX_TOPK:
        raise ValueError(f"extra_topk: got {extra_topk!r}, accepted: 0 (no extra pool) or a positive multiple of "
                         f"{BLOCK_TOPK} up to {MAX_TOPK}")
    fmt = format_for_d_qk(d_qk)
    if extra_topk and not fmt.extra_pool:
        pools = ", ".join(f"{f.name} (d_qk={f.d_qk})" for f in supported_formats() if f.extra_pool)
        raise ValueError(f"extra_k_cache: the {fmt.name} format (d_qk={d_qk}) has no extra KV pool; formats with one: {pools}")
    return fmt


@functools.lru_cache(maxsize=1024)
def plan_sparse_decode(b: int, s_q: int, h_q: int, d_qk: int, topk: int, *, arch: str, num_sms: int,
                       has_topk_length: bool = False, d_v: int = 512, extra_topk: int = 0,
                       has_extra_topk_length: bool = False) -> SparseDecodePlan:
    """Plan one sparse decode call (cached: a plan depends only on its arguments).

    Accepted (:func:`check_problem`; anything else raises ``ValueError`` naming the argument):
    ``b``, ``s_q`` positive (``b <= MAX_REQUESTS``, ``b * s_q <= MAX_QUERY_ROWS``); ``h_q`` 64 or
    128; ``d_qk`` 576 (V3.2) or 512 (V4), and ``d_v`` 512; ``topk`` a positive multiple of 64 up to
    ``MAX_TOPK``; ``arch`` ``"sm_90a"`` or ``"sm_100a"`` with the device's ``num_sms``.
    ``extra_topk``: the extra pool's list length (V4 only; a multiple of 64), 0 without one.
    ``has_topk_length`` / ``has_extra_topk_length``: the call passes that list's per-request
    lengths (device values: the schedule is then made on the device)."""
    fmt = check_problem(b, s_q, h_q, d_qk, topk, extra_topk)
    if has_extra_topk_length and not extra_topk:
        raise ValueError("extra_topk_length: given without an extra pool (extra_topk=0)")
    lengths = has_topk_length or has_extra_topk_length
    if d_v != fmt.d_v:
        raise ValueError(f"head_dim_v: got {d_v}, accepted: {fmt.d_v}")
    spec = archs.get(arch)
    parts = sched.num_sm_parts(arch, num_sms, s_q, h_q)
    blocks = (topk + extra_topk) // BLOCK_TOPK   # per request without lengths (check_problem: multiples of 64)
    overhead = sched.fixed_overhead_blocks(arch, b=b, parts=parts, blocks=blocks)
    host_schedule, token_walk = None, False
    short_lists = (spec.no_split_max_topk is not None and topk + extra_topk <= spec.no_split_max_topk
                   and b <= archs.MAX_GRID_Y)
    if lengths and sm90_packed(arch, b, s_q, h_q, blocks, extra_topk, num_sms):
        schedule, accum_rows, overhead = "balanced", 0, 0
    elif short_lists or (lengths and sm90_per_request(arch, b, h_q, blocks, num_sms,
                                                      sm90_pieces_at_cost(arch, fmt))):
        schedule, parts, accum_rows = "per_request", b, 0
        if not lengths:
            nb = sched.blocks_per_request(topk, b=b, extra_topk=extra_topk)
            host_schedule = sched.HostSchedule(rows=sched.per_request_rows(nb), num_splits=tuple(range(b + 1)))
    elif lengths:
        schedule = "device"
        overhead = sm90_device_charge(arch, fmt, overhead)
        accum_rows = 0 if parts == 1 else sched.max_accum_rows(parts, b)
    elif uses_token_walk(arch, b, s_q, h_q, parts, num_sms):
        schedule, accum_rows, token_walk = "host", 0, True
        rows = sched.whole_request_rows(s_q, blocks, num_sms // (h_q // 64))
        # The rows index tokens (one-token requests); num_splits keeps the call's one request, not
        # split (the no-split kernel never reads it): the plan stays O(partitions), not O(s_q),
        # for every s_q an engine's steps bring (plans and their device copies are cached).
        host_schedule = sched.HostSchedule(rows=rows, num_splits=(0, 1))
    else:
        schedule = "host"
        host_schedule = sched.plan_splits_host(sched.blocks_per_request(topk, b=b, extra_topk=extra_topk), parts, overhead)
        accum_rows = host_schedule.split_rows
    split = accum_rows > 0
    return SparseDecodePlan(
        arch=arch, b=b, s_q=s_q, h_q=h_q, d_qk=d_qk, d_v=d_v, topk=topk, has_topk_length=has_topk_length,
        num_sm_parts=parts, fixed_overhead=overhead, kernel=spec.kernel, split=split,
        schedule=schedule, accum_rows=accum_rows, host_schedule=host_schedule, token_walk=token_walk,
        column_pair=split and sm90_column_pair(arch, b, s_q, h_q, num_sms, host_schedule),
        accum_dtype=spec.accum_dtype if split else "float32", extra_topk=extra_topk,
        has_extra_topk_length=has_extra_topk_length)


def _busy_partitions(b: int, host_schedule: sched.HostSchedule) -> int:
    """Partitions of a host schedule with a piece of work (an empty trailing one has begin_req == b)."""
    return sum(1 for r in host_schedule.rows if r[sched.SchedField.BEGIN_REQ] < b
               and r[sched.SchedField.BEGIN_REQ] <= r[sched.SchedField.END_REQ])


def sm90_column_pair(arch: str, b: int, s_q: int, h_q: int, num_sms: int,
                     host_schedule: Optional[sched.HostSchedule]) -> bool:
    """SM90 split variant at h_q = 64: run each piece on a column pair (a cluster of 2 CTAs that
    share the gather and each compute and store 256 of the 512 output columns) when at most
    ``COLUMN_PAIR_MAX_BUSY_CTAS`` CTAs, and at most num_sms / 4, would have work without it
    (partitions with a piece x s_q).

    The pair doubles the CTAs with work: it shortens a piece's chain (conversion, PV and the
    o_accum store bytes halved per SM) where few pieces leave most SMs idle, and loses once the
    doubled CTAs crowd the GPU. Device schedules (topk_length) keep one CTA per piece: their
    partitions are not known here."""
    if arch != archs.SM90.name or h_q != 64 or host_schedule is None:
        return False
    return _busy_partitions(b, host_schedule) * s_q <= min(COLUMN_PAIR_MAX_BUSY_CTAS, num_sms // 4)


def sm90_per_request(arch: str, b: int, h_q: int, blocks: int, num_sms: int, pieces_at_cost: bool) -> bool:
    """SM90 with per-request lengths (a device schedule) and short lists: one partition per request,
    nothing split, no accumulators, no combine. The (request, head block) CTAs then start as SMs
    free up, and the call takes as long as its longest request or its waves of CTA starts; the
    split schedule balances the blocks but pays the pieces' partials and the combine.

    Measured on the H200 (V4 rows: top-k 128 + extra 0 / 512 / 1024, lengths uniform), one
    partition per request against the split schedule with the warp-per-head combine:
    - lists of <= 2 blocks win at any b up to four waves (b = 32: x1.06 at h = 64, x1.02 at
      h = 128; b = 1: even; b = 128, 512 at h = 64 already did);
    - lists of <= 10 blocks (extra 512) at h = 64 win in half a wave to two waves (b = 128:
      38.5 against 53.8 µs with the older combine; x0.99-1.03 in two runs against the split
      schedule once it charged a piece about what it costs, ``sm90_device_charge``) and lose
      beyond (b = 512: x0.97); below half a wave the GPU idles (b = 1, h = 128: x0.63). At
      h = 128 they won x1.02 at b = 128 against FlashMLA's charge of 5, and lost x0.91 at
      b = 128 (x1.00 at b = 64) against a charge of 1 (``benchmarks/v4_schedule_probe.py``):
      where the split schedule charges pieces at cost (``pieces_at_cost``), only the h_q of
      ``PER_REQUEST_HEADS`` take them (measured with 10-block lists at s_q = 1; shorter lists
      of 3-9 blocks and s_q > 1 follow the same rule unmeasured);
    - lists of 18 blocks (extra 1024) lose: x0.85 at b = 128, h = 128, x0.90 at b = 128 and 512,
      h = 64 (the longest request, or a CTA that draws two long ones, sets the time)."""
    if arch != archs.SM90.name or b > archs.MAX_GRID_Y:
        return False
    waves = b * (h_q // 64) / num_sms
    if blocks <= PER_REQUEST_TINY_BLOCKS:
        return waves <= PER_REQUEST_TINY_MAX_WAVES
    return (blocks <= PER_REQUEST_MAX_BLOCKS and (h_q in PER_REQUEST_HEADS or not pieces_at_cost)
            and PER_REQUEST_WAVES[0] <= waves <= PER_REQUEST_WAVES[1])


def sm90_pieces_at_cost(arch: str, fmt: KVCacheFormat) -> bool:
    """Whether a device split schedule charges a request piece what it costs
    (``V4_DEVICE_PIECE_CHARGE``, :func:`sm90_device_charge`): the V4 format on SM90, where it
    was measured."""
    return arch == archs.SM90.name and fmt is V4


def sm90_device_charge(arch: str, fmt: KVCacheFormat, overhead: int) -> int:
    """The blocks a device split schedule charges per request piece: ``V4_DEVICE_PIECE_CHARGE``
    where :func:`sm90_pieces_at_cost`, else ``overhead`` (``scheduler.partition.fixed_overhead_blocks``).

    The greedy cut gives every partition the same blocks + charges, so a charge above what a
    piece costs takes blocks from the partitions that hold more pieces and leaves the trailing
    ones empty. On the H200 a V4 piece (its Q load, its first gathers not hidden by the piece
    before, its store) costs about one block at h = 128 (~2.3 µs against 2.6 µs per block) and
    less at h = 64 (``benchmarks/v4_timeline.py --spans``: under FlashMLA's 5 the CTAs of b = 128,
    h = 128, extra 1024 held 16-26 blocks and 126 of 132 had work). Charging 1 instead, end to
    end on the V4 rows with an extra list (``benchmarks/v4_charge_probe.py``): x1.06-1.22 at
    b = 128 and 512 where the split schedule ran, x1.01-1.08 at b = 32 (which charged 0), and
    against whole-request packing at h = 128, extra 512: x1.10-1.18 at b = 128, x1.05 at 256,
    x1.00-1.02 at 512 and 1024. Measured at s_q = 1 with extra lists of 512 and 1024 (and b =
    512, h = 128 without one: even); the same charge serves V4's other device schedules (s_q > 1,
    other list lengths, and few requests, where SM90's zero-charge rule applied before) without
    a measurement of its own. V3.2's device schedules keep the scheduler's rule (not measured)."""
    return V4_DEVICE_PIECE_CHARGE if sm90_pieces_at_cost(arch, fmt) else overhead


def sm90_packed(arch: str, b: int, s_q: int, h_q: int, blocks: int, extra_topk: int, num_sms: int) -> bool:
    """SM90 with per-request lengths, h_q = 128, s_q = 1 and short lists with an extra list (V4's
    128 + 512 or 1024), from ``PACKED_MIN_WAVES`` waves of CTAs up: the partitions of one wave
    (``num_sm_parts``) each take *whole* requests, dealt by cost so that the partitions cost about
    the same (``schedule.balanced_schedule_device``, on the device; the kernel walks them through
    the schedule's request order). Nothing is split (no accumulators, no combine), and a CTA's
    later requests overlap their index scan and first gathers with the request before it, which
    one partition per request cannot: a request alone on a CTA spends ~6 µs before its first tile
    and 1.7 µs after its last (``benchmarks/v4_timeline.py``).

    Measured (``benchmarks/v4_schedule_probe.py``, end to end, interleaved; docs/performance.md,
    section 3): on an H100, against the split schedule charging a piece about what it costs
    (``sm90_device_charge``), x1.03 at b = 512 (extra 512 and 1024) and b = 400 (extra 1024),
    x1.01 at b = 1024; against contiguous ranges of requests cut at their cost's midpoints (the
    cut this replaced, which tied the split schedule at extra 512 and lost at extra 1024: 18-block
    requests cut too coarsely), x1.02-1.13. Below ~6 waves whole requests leave too few per
    partition to balance (the contiguous cut: x0.91 at b = 128 and x0.96 at 256 against the split
    schedule, ``benchmarks/v4_charge_probe.py``; the balanced cut was not measured there), hence
    ``PACKED_MIN_WAVES``. Measured with V4's main list of 128 and extra lists of 512 and 1024; other
    lists of 3-18 blocks with an extra list take it unmeasured. h = 64 (half the requests per
    partition) and s_q > 1 were not measured with it, so not taken, nor lists without an extra list."""
    if arch != archs.SM90.name or h_q != PACKED_H_Q or s_q != 1 or not extra_topk:
        return False
    waves = b * (h_q // 64) / num_sms
    return PER_REQUEST_TINY_BLOCKS < blocks <= PACKED_MAX_BLOCKS and waves >= PACKED_MIN_WAVES


def uses_token_walk(arch: str, b: int, s_q: int, h_q: int, parts: int, num_sms: int) -> bool:
    """SM90 mixed batch: one request, one partition and more (token, head half) CTAs than SMs.

    Only b == 1: then q, indices, out and lse always have an (s_q, 1, ...) view. Calls with
    topk_length (their schedule is made on the device) keep FlashMLA's grid: the caller tests
    topk_length first."""
    return arch == archs.SM90.name and b == 1 and parts == 1 and s_q * (h_q // 64) > num_sms >= h_q // 64
