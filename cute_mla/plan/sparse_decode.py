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

Which schedule a call gets is the arch's :class:`~cute_mla.plan.policy.SparseDecodePolicy`
(``no_split_max_topk``, ``per_request``, ``packed``, ``device_piece_charges``, ``token_walk``,
``column_pair_max_busy_ctas``): :func:`plan_sparse_decode` applies its rules in one order, and
:func:`kernel_variants` enumerates the kernels the same rules can reach (what ``cute-mla warmup``
compiles).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .. import archs, registry
from ..formats import KVCacheFormat, format_for_d_qk, format_named, supported_formats
from ..scheduler import partition as sched
from .policy import SparseDecodePolicy, default_policy

SUPPORTED_H_Q = (8, 16, 32, 64, 128)   # on some arch; each arch's kernel says which it runs (DECODE_HEADS)
MAX_QUERY_ROWS = 2**31 - 1   # b * s_q: the combine's grid x and int32 row indices
MAX_REQUESTS = 2**20         # b: the host scheduler and the plan walk every request in Python
BLOCK_TOPK = sched.BLOCK_TOPK
# topk, extra_topk: list positions are int32, and the SM90 kernels carry the extra list's positions
# offset by 2^30 (kernels/sm90/index_scan.EXTRA_BASE), so each list is shorter than that.
MAX_TOPK = 2**30 - BLOCK_TOPK
ACCUM_ITEM_BYTES = {"float32": 4, "bfloat16": 2}   # o_accum element sizes (SparseDecodePlan.accum_dtype)
LSE_ACCUM_BYTES = 4                    # one fp32 lse_accum entry per (row, token, head)
FLASHMLA_ACCUM_BYTES_PER_HEAD = 512 * 4 + LSE_ACCUM_BYTES   # FlashMLA's fp32 o_accum row of d_v=512 and its lse


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
    kernel: str                         # the arch's kernel name (registry.OpSpec.kernels)
    split: bool                         # the split variant (takes accumulators) runs
    schedule: str                       # "host" (computed here) | "device" (scheduler kernel) | "per_request" | "balanced"
    accum_rows: int                     # rows of o_accum / lse_accum (0 when nothing is split)
    host_schedule: Optional[sched.HostSchedule]
    token_walk: bool = False            # the s_q tokens run as s_q one-token requests (policy.token_walk)
    column_pair: bool = False           # h=64 split: a cluster of 2 CTAs per piece (policy.column_pair_max_busy_ctas)
    accum_dtype: str = "float32"        # o_accum's element type when split (the kernel's ACCUM_DTYPE); lse_accum is fp32
    extra_topk: int = 0                 # the extra pool's list length (0: no extra pool)
    has_extra_topk_length: bool = False # the call passes extra_topk_length
    format: str = "V3.2"                # the cache format's name (formats.format_named)
    op: str = "sparse_decode"

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
        """The TMA descriptors the plan's kernel builds (the kernel module's ``tensor_maps``)."""
        mod = registry.config_module(self.op, self.arch)
        return mod.tensor_maps(mod.config_for(self, has_attn_sink=False))

    @property
    def launches(self) -> Tuple[str, ...]:
        out = ("scheduler",) if self.schedule == "device" else ()
        out += (self.kernel,)
        return out + (("combine",) if self.split else ())

    @property
    def flashmla_workspace_bytes(self) -> int:
        """What FlashMLA (vLLM's fork) allocates for the same call: (b + num_sm_parts) rows whenever
        split-KV is on, i.e. always on SM90 and above top-k 640 on SM100; with 8, 16 or 32 heads
        padded to 64, as engines call it."""
        no_split_max = default_policy(self.arch).no_split_max_topk
        if no_split_max is not None and self.topk + self.extra_topk <= no_split_max:
            return 0
        return (self.b + self.num_sm_parts) * self.s_q * max(self.h_q, 64) * FLASHMLA_ACCUM_BYTES_PER_HEAD

    def describe(self) -> str:
        lines = [
            f"op {self.op}  arch {self.arch}  format {self.format}  b={self.b} s_q={self.s_q} h_q={self.h_q} "
            f"d_qk={self.d_qk} topk={self.topk}"
            f"{f' extra_topk={self.extra_topk}' if self.extra_topk else ''}"
            f"{' topk_length' if self.has_topk_length else ''}{' extra_topk_length' if self.has_extra_topk_length else ''}",
            f"kernel {self.kernel} ({self.variant})  num_sm_parts={self.num_sm_parts}  schedule: {self.schedule}",
        ]
        if self.h_q < 64:
            lines.append(f"MMA tile: the {self.h_q} heads on N, a K tile's 64 rows on M (swap-AB): one CTA per token "
                         "and partition, no padded heads")
        if self.token_walk:
            lines.append(f"token walk: {self.s_q} one-token requests over {len(self.host_schedule.rows)} partitions "
                         "of whole tokens")
        if self.column_pair:
            lines.append("column pair: each piece on a cluster of 2 CTAs, 256 of the 512 output columns each")
        if self.orders_requests:
            lines.append(f"balanced: whole requests dealt by their rows into {self.num_sm_parts} partitions; the rows index "
                         "positions in the schedule's request order")
        lines += [
            f"launches: {', '.join(self.launches)}",
            f"accumulator rows: {self.accum_rows}{f' ({self.accum_dtype} o_accum)' if self.split else ''}  "
            f"workspace: {self.workspace_bytes} bytes ({self.workspace_bytes / 2**20:.2f} MiB)",
            f"tensor maps: {', '.join(self.tensor_maps)}",
            f"FlashMLA would allocate: {self.flashmla_workspace_bytes / 2**20:.2f} MiB",
        ]
        return "\n".join(lines)


def check_problem(b: int, s_q: int, h_q: int, d_qk: int, topk: int, extra_topk: int = 0,
                  format: Optional[str] = None) -> KVCacheFormat:
    """Shape rules shared by the plan and the API; returns the cache format: the one named by
    ``format``, else the implemented format of width ``d_qk``."""
    for name, v in (("b", b), ("s_q", s_q), ("topk", topk)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be a positive int, got {v!r}")
    if h_q not in SUPPORTED_H_Q:
        raise ValueError(f"h_q: got {h_q}, accepted: 8, 16, 32, 64 or 128 (pad other head counts to the next "
                         "accepted one with zero heads)")
    if b > MAX_REQUESTS or b * s_q > MAX_QUERY_ROWS:
        raise ValueError(f"b, s_q: got b={b}, s_q={s_q}, accepted: b <= {MAX_REQUESTS} and b * s_q <= {MAX_QUERY_ROWS} "
                         "(the combine's grid and the kernels' row indices are int32; the host scheduler walks "
                         "every request)")
    if topk % BLOCK_TOPK or topk > MAX_TOPK:
        raise ValueError(f"topk: got {topk}, accepted: a positive multiple of {BLOCK_TOPK} up to {MAX_TOPK}")
    if not isinstance(extra_topk, int) or extra_topk < 0 or extra_topk % BLOCK_TOPK or extra_topk > MAX_TOPK:
        raise ValueError(f"extra_topk: got {extra_topk!r}, accepted: 0 (no extra pool) or a positive multiple of "
                         f"{BLOCK_TOPK} up to {MAX_TOPK}")
    fmt = format_for_d_qk(d_qk) if format is None else format_named(format)
    if fmt.d_qk != d_qk:
        raise ValueError(f"d_qk: got {d_qk}, the {fmt.name} format has d_qk {fmt.d_qk}")
    if extra_topk and not fmt.extra_pool:
        pools = ", ".join(f"{f.name} (d_qk={f.d_qk})" for f in supported_formats() if f.extra_pool)
        raise ValueError(f"extra_k_cache: the {fmt.name} format (d_qk={d_qk}) has no extra KV pool; formats with one: {pools}")
    return fmt


@functools.lru_cache(maxsize=1024)
def plan_sparse_decode(b: int, s_q: int, h_q: int, d_qk: int, topk: int, *, arch: str, num_sms: int,
                       has_topk_length: bool = False, d_v: int = 512, extra_topk: int = 0,
                       has_extra_topk_length: bool = False, format: Optional[str] = None,
                       policy: Optional[SparseDecodePolicy] = None) -> SparseDecodePlan:
    """Plan one sparse decode call (cached: a plan depends only on its arguments).

    Accepted (:func:`check_problem`; anything else raises ``ValueError`` naming the argument):
    ``b``, ``s_q`` positive (``b <= MAX_REQUESTS``, ``b * s_q <= MAX_QUERY_ROWS``); ``h_q`` one of
    the arch's kernel's head counts (``DECODE_HEADS``: SM90 8, 16, 32, 64, 128; SM100 64, 128);
    ``d_qk`` 576 (V3.2) or 512 (V4), and ``d_v`` 512; ``topk`` a positive multiple of 64 up to
    ``MAX_TOPK``; ``arch`` ``"sm_90a"`` or ``"sm_100a"`` with the device's ``num_sms``.
    ``extra_topk``: the extra pool's list length (V4 only; a multiple of 64), 0 without one.
    ``has_topk_length`` / ``has_extra_topk_length``: the call passes that list's per-request
    lengths (device values: the schedule is then made on the device). ``format``: the cache
    format's name (default: the implemented format of width ``d_qk``; the API names the one its
    cache's row size says). ``policy``: the schedule rules (default: the arch's, ``default_policy``)."""
    fmt = check_problem(b, s_q, h_q, d_qk, topk, extra_topk, format)
    if has_extra_topk_length and not extra_topk:
        raise ValueError("extra_topk_length: given without an extra pool (extra_topk=0)")
    lengths = has_topk_length or has_extra_topk_length
    if d_v != fmt.d_v:
        raise ValueError(f"head_dim_v: got {d_v}, accepted: {fmt.d_v}")
    kernel = registry.SPARSE_DECODE.kernel(archs.get(arch).name).name
    heads = arch_heads(arch)
    if h_q not in heads:
        raise ValueError(f"h_q: got {h_q}, the {arch} sparse decode kernel takes {', '.join(map(str, heads))} "
                         "(pad the heads to 64 with zero heads on this arch)")
    pol = default_policy(arch) if policy is None else policy
    parts = pol.num_sm_parts(num_sms, s_q, h_q)
    blocks = (topk + extra_topk) // BLOCK_TOPK   # per request without lengths (check_problem: multiples of 64)
    overhead = pol.fixed_overhead(b, parts, blocks)
    host_schedule, token_walk = None, False
    short_lists = (pol.no_split_max_topk is not None and topk + extra_topk <= pol.no_split_max_topk
                   and b <= archs.MAX_GRID_Y)
    charge = pol.device_charge(fmt.name)
    if lengths and pol.packed is not None and pol.packed.applies(b, s_q, h_q, blocks, extra_topk, num_sms):
        schedule, accum_rows, overhead = "balanced", 0, 0
    elif short_lists or (lengths and pol.per_request is not None
                         and pol.per_request.applies(b, h_q, blocks, num_sms, pieces_at_cost=charge is not None)):
        schedule, parts, accum_rows = "per_request", b, 0
        if not lengths:
            nb = sched.blocks_per_request(topk, b=b, extra_topk=extra_topk)
            host_schedule = sched.HostSchedule(rows=sched.per_request_rows(nb), num_splits=tuple(range(b + 1)))
    elif lengths:
        schedule = "device"
        overhead = overhead if charge is None else charge
        accum_rows = 0 if parts == 1 else sched.max_accum_rows(parts, b)
    elif uses_token_walk(pol, b, s_q, h_q, parts, num_sms):
        schedule, accum_rows, token_walk = "host", 0, True
        rows = sched.whole_request_rows(s_q, blocks, num_sms // sched.head_blocks(h_q))
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
        num_sm_parts=parts, fixed_overhead=overhead, kernel=kernel, split=split,
        schedule=schedule, accum_rows=accum_rows, host_schedule=host_schedule, token_walk=token_walk,
        column_pair=split and uses_column_pair(pol, b, s_q, h_q, num_sms, host_schedule),
        accum_dtype=registry.config_module(registry.SPARSE_DECODE.name, arch).ACCUM_DTYPE if split else "float32",
        extra_topk=extra_topk,
        has_extra_topk_length=has_extra_topk_length, format=fmt.name)


def _busy_partitions(b: int, host_schedule: sched.HostSchedule) -> int:
    """Partitions of a host schedule with a piece of work (an empty trailing one has begin_req == b)."""
    return sum(1 for r in host_schedule.rows if r[sched.SchedField.BEGIN_REQ] < b
               and r[sched.SchedField.BEGIN_REQ] <= r[sched.SchedField.END_REQ])


def uses_column_pair(policy: SparseDecodePolicy, b: int, s_q: int, h_q: int, num_sms: int,
                     host_schedule: Optional[sched.HostSchedule]) -> bool:
    """A split plan at h_q = 64 with a host schedule runs each piece on a column pair where at most
    ``policy.column_pair_max_busy_ctas`` CTAs, and at most num_sms / 4, would have work without it
    (partitions with a piece x s_q); the policy field says why."""
    if not policy.column_pair_takes(h_q) or host_schedule is None:
        return False
    return _busy_partitions(b, host_schedule) * s_q <= min(policy.column_pair_max_busy_ctas, num_sms // 4)


def uses_token_walk(policy: SparseDecodePolicy, b: int, s_q: int, h_q: int, parts: int, num_sms: int) -> bool:
    """A mixed batch under ``policy.token_walk``: one request, one partition and more (token, head
    block) CTAs than SMs.

    Only b == 1: then q, indices, out and lse always have an (s_q, 1, ...) view. Calls with
    topk_length (their schedule is made on the device) keep FlashMLA's grid: the caller tests
    topk_length first."""
    hb = sched.head_blocks(h_q)
    return policy.token_walk and b == 1 and parts == 1 and s_q * hb > num_sms >= hb


# ------------------------------------------------------------------------- what the rules reach


def reachable_kernels(policy: SparseDecodePolicy, h_q: int, fmt: KVCacheFormat) -> List[dict]:
    """The main-kernel choices (``config_for``'s plan fields, less the sink) that the planner's rules
    can reach for ``h_q`` and a format: split or not, with each list's lengths or not, the extra
    pool where the format has one; the column pair only where the policy has it (h_q = 64 split
    plans with a host schedule: no lengths); the request order only where one of the packed
    rule's head counts, an extra list and lengths meet (never split)."""
    out = []
    extras = [(False, False)] + ([(True, False), (True, True)] if fmt.extra_pool else [])
    for split, tl in itertools.product((False, True), (False, True)):
        for extra, extra_tl in extras:
            lengths = tl or extra_tl
            pairs = [False]
            if policy.column_pair_takes(h_q) and split and not lengths:   # host schedules only
                pairs.append(True)
            for pair in pairs:
                out.append(dict(split=split, has_topk_length=tl, has_extra=extra, has_extra_topk_length=extra_tl,
                                column_pair=pair, request_order=False))
            if policy.packed is not None and policy.packed.takes(h_q, extra) and not split and lengths:
                out.append(dict(split=False, has_topk_length=tl, has_extra=True, has_extra_topk_length=extra_tl,
                                column_pair=False, request_order=True))
    return out


def arch_heads(arch: str) -> Tuple[int, ...]:
    """The head counts ``arch``'s sparse decode kernel runs (its config module's ``DECODE_HEADS``)."""
    return registry.config_module(registry.SPARSE_DECODE.name, arch).DECODE_HEADS


def kernel_variants(arch: str, h_qs=None, formats=None, kernels=None):
    """Every (kernel name, config) a sparse decode plan on ``arch`` can compile: the main kernel for
    each head count, format, sink and :func:`reachable_kernels` choice; the combine for each
    head count, sink, split-count bucket and grid walk the arch's default SM count reaches; the
    device scheduler. ``kernels``: the kernel names to enumerate (default: all of the op's).
    ``cute-mla warmup`` compiles them; the registry's compile tests cover one of each kernel."""
    policy = default_policy(arch)
    spec = registry.SPARSE_DECODE
    h_qs = arch_heads(arch) if h_qs is None else tuple(h_qs)
    kinds = spec.kernel_names() if kernels is None else tuple(kernels)
    fmts = supported_formats() if formats is None else tuple(format_named(f) for f in formats)
    out = []
    if spec.name in kinds:
        mod = registry.config_module(spec.name, arch)
        for fmt, h_q in itertools.product(fmts, h_qs):
            for choice in reachable_kernels(policy, h_q, fmt):
                for sink in (False, True):
                    out.append((spec.name, mod.kernel_config(h_q=h_q, format=fmt.name, has_attn_sink=sink, **choice)))
    if "combine" in kinds:
        combine = registry.kernel_module(spec.name, arch, "combine")
        accum = registry.config_module(spec.name, arch).ACCUM_DTYPE   # what the split variant writes
        seen = set()
        num_sms = archs.get(arch).default_num_sms
        for h_q in h_qs:
            for s_q in range(1, num_sms + 1):
                p = policy.num_sm_parts(num_sms, s_q, h_q)
                # with a sink or not; the fewest and the most requests of a grid over requests (its
                # layout follows b * s_q * h_q), and a grid over partitions
                for sink, b in itertools.product((False, True), (1, p, p + 1)):
                    cfg = combine.combine_config(arch, h_q, sink, p, accum, b=b, s_q=s_q)
                    if cfg.cache_key not in seen:
                        seen.add(cfg.cache_key)
                        out.append(("combine", cfg))
    if "scheduler" in kinds:
        out.append(("scheduler", registry.kernel_module(spec.name, arch, "scheduler").Config(arch=arch)))
    return out
