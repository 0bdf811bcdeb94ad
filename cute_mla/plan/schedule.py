"""The schedule of a planned call, as its kernels read it: one module builds it and uploads it.

Three int32 tensors on the call's device, made once per decode step (``FlashMLASchedMeta``):

* ``tile_md`` (partitions, 8): one row per partition (``scheduler.SchedField``);
* ``num_splits`` (b+1,): FlashMLA's prefix sum of the split count of each request;
* ``accum_offsets`` (b+1,): cute-mla's prefix sum of accumulator rows, where only split requests
  own rows (``scheduler.accum_offsets``); the kernels and the combine index ``o_accum`` with it.

Where the host knows the schedule (no ``topk_length``) the plan computed it: :func:`make_schedule`
uploads it once per (plan, device) into a cached buffer (:class:`UploadedSchedule`). With
``topk_length`` (device values the host must not read) it is built on the device: the blocks of
each request from the lengths (``scheduler.partition.blocks_of_length``), then the scheduler
kernel or, for one-partition-per-request and balanced plans, torch ops; no host synchronization.
A balanced schedule also holds a request order (b,): its rows index positions in it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from ..scheduler import (BLOCK_TOPK, SCHED_ROW_INTS, SchedField, accum_offsets, accum_offsets_device,
                         blocks_of_length, extra_blocks_of_length, plan_splits)
from .sparse_decode import SparseDecodePlan

_lock = threading.Lock()
# (plan, device) -> UploadedSchedule, and (BalancedDeal, device) -> the balanced cut's fixed tables.
# Never evicted: a captured CUDA graph keeps reading the tensors (and, for an upload made during
# capture, the pinned source) it was captured with, while engines (vLLM) make a new
# FlashMLASchedMeta per step and do not keep the capture's. Each entry is O(partitions) ints
# (token-walk plans too: plan.py), one per distinct plan; a balanced one O(b + partitions), one per
# batch size that plans the balanced cut.
_host_schedules: dict = {}


class UploadedSchedule:
    """One plan's schedule on one device: a pinned host copy and the device copy kernels read.

    The device copy is filled by an asynchronous upload, in one of two ways:

    * outside a graph capture (eager): the upload runs now, on the current stream, so launches on
      that stream are ordered after it; a launch on another stream waits for its event until the
      event has been seen complete (then the entry is ``ready`` and costs one flag test per call);
    * during a capture: the upload is a node of the graph being captured and runs only at that
      graph's replays. Until an eager upload has been issued, each capture that reads the entry
      gets its own upload node (once per capture, not per layer: captures are told apart by
      their CUDA capture id), so neither an eager call nor another graph ever reads the device
      copy before it holds the schedule. (A capture begun after an eager upload reads the
      uploaded data: ``torch.cuda.graph`` synchronizes the device before it captures.)
    """

    __slots__ = ("host", "dev", "views", "ready", "event", "captures")

    def __init__(self, host: torch.Tensor, dev: torch.Tensor, views):
        self.host, self.dev = host, dev
        # views of dev: (tile_md, num_splits, accum_offsets), or the balanced tables by name
        self.views = views
        self.ready = False            # an eager upload is known complete
        self.event = None             # the eager upload's event until it is seen complete
        self.captures = set()         # ids of the captures that hold an upload node

    def ensure_uploaded(self) -> None:
        """Called before every launch that reads the schedule; once ``ready``, a flag test."""
        if self.ready:
            return
        with _lock:
            device = self.dev.device
            if device.type != "cuda":
                self.dev.copy_(self.host)
                self.ready = True
                return
            with torch.cuda.device(device):
                self._upload_or_wait(_capture_id(device))

    def _upload_or_wait(self, capture: Optional[int]) -> None:
        """The upload state machine (current device = the entry's): ``capture`` as :func:`_capture_id`."""
        if capture is not None:
            if self.event is None and (capture < 0 or capture not in self.captures):
                self.dev.copy_(self.host, non_blocking=True)
                self.captures.add(capture)
        elif self.event is None:
            self.dev.copy_(self.host, non_blocking=True)
            self.event = _record_event()
        elif _event_done(self.event):
            self.ready, self.event = True, None
        else:
            _wait_event(self.event)


def _record_event():
    ev = torch.cuda.Event()
    ev.record()
    return ev


def _event_done(ev) -> bool:
    return ev.query()


def _wait_event(ev) -> None:
    torch.cuda.current_stream().wait_event(ev)


def _capture_id(device: torch.device) -> Optional[int]:
    """None when work issued now on ``device`` runs; else the id of the CUDA-graph capture that
    records it (-1 when the driver query is unavailable: such a capture is never deduplicated)."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return None
    try:
        from cuda.bindings import driver

        res = driver.cuStreamGetCaptureInfo(torch.cuda.current_stream(device).cuda_stream)
        if res[0] == driver.CUresult.CUDA_SUCCESS:
            return int(res[2])
    except Exception:  # noqa: BLE001  (bindings missing or of another signature: upload every time)
        pass
    return -1


@contextmanager
def _relaxed_capture_mode():
    """This thread's CUDA stream-capture mode relaxed for the block: the driver calls that a
    global-mode capture forbids (cudaMalloc, cudaHostAlloc, event queries) are then permitted to it;
    none of them is a stream operation, so nothing is captured. Without the driver bindings, the
    mode stays as it is."""
    try:
        from cuda.bindings import driver

        err, previous = driver.cuThreadExchangeStreamCaptureMode(driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    except Exception:  # noqa: BLE001  (bindings missing or of another signature)
        driver = None
    try:
        yield
    finally:
        if driver is not None and err == driver.CUresult.CUDA_SUCCESS:
            driver.cuThreadExchangeStreamCaptureMode(previous)


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """``host`` in pinned memory; during a capture, in relaxed capture mode (the pinned allocator's
    driver calls are not permitted under a global-mode capture)."""
    if not torch.cuda.is_current_stream_capturing():
        return host.pin_memory()
    with _relaxed_capture_mode():
        return host.pin_memory()


def _device_buffer(n: int, device: torch.device) -> torch.Tensor:
    """An empty int32 (n,) tensor on ``device`` for a cache entry, in no CUDA graph's memory pool.

    The caching allocator puts an allocation in a graph's private pool when it is made on a
    stream capturing that graph, and puts every allocation of a thread there while torch.compile's
    cudagraph trees warm a graph up on that thread (nothing is captured then). An entry made there
    would live in the graph's pool, which the trees account for as their outputs only: they report
    such a live tensor ("not tracked as outputs"), and may hand its memory out again when they
    reset the pool's state. Routing the allocation to a dedicated ``torch.cuda.MemPool`` cannot
    escape, since the routing begun first takes precedence. So the buffer is allocated on a
    short-lived thread, on its own default stream (not capturing), in the general pool; relaxed
    capture mode lets its cudaMalloc run while a global-mode capture is under way. It is never
    freed (cache entries are never evicted), so its allocating stream does not matter. The join
    waits for the allocation, not for the device."""
    if device.type != "cuda":
        return torch.empty(n, dtype=torch.int32, device=device)
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    made = []

    def allocate():
        try:
            with _relaxed_capture_mode(), torch.cuda.device(device):
                made.append(torch.empty(n, dtype=torch.int32, device=device))
        except BaseException as e:  # noqa: BLE001  (raised again in the calling thread)
            made.append(e)

    helper = threading.Thread(target=allocate, name="cute-mla-schedule-alloc", daemon=True)
    helper.start()
    helper.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def schedule_sizes(plan: "SparseDecodePlan") -> Tuple[int, int]:
    """(partitions, n): the packed schedule's tile_md rows and its num_splits / accum_offsets length."""
    if plan.host_schedule is not None:
        return len(plan.host_schedule.rows), len(plan.host_schedule.num_splits)
    return plan.num_sm_parts, plan.b + 1   # per-request plans have b partitions


def schedule_length(plan: "SparseDecodePlan") -> int:
    """Ints in the packed schedule of ``plan``: its rows, num_splits, accum_offsets, and the
    request order where the plan orders requests (:func:`order_view`)."""
    p, n = schedule_sizes(plan)
    return p * SCHED_ROW_INTS + 2 * n + (plan.b if plan.orders_requests else 0)


def schedule_views(plan: "SparseDecodePlan", packed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile_md, num_splits, accum_offsets) views of a packed schedule."""
    p, n = schedule_sizes(plan)
    rows = p * SCHED_ROW_INTS
    return packed[:rows].view(p, SCHED_ROW_INTS), packed[rows:rows + n], packed[rows + n:rows + 2 * n]


def order_view(plan: "SparseDecodePlan", packed: torch.Tensor) -> Optional[torch.Tensor]:
    """The request order (b,) of a packed schedule that has one (``plan.orders_requests``), else None."""
    if not plan.orders_requests:
        return None
    p, n = schedule_sizes(plan)
    start = p * SCHED_ROW_INTS + 2 * n
    return packed[start:start + plan.b]


def uploaded_schedule(plan: "SparseDecodePlan", device: torch.device) -> UploadedSchedule:
    """The plan's host schedule on ``device``: ``.views`` = (tile_md, num_splits, accum_offsets).

    Cached per (plan, device): every call with the same shapes reads the same, stable addresses
    (CUDA graphs bake them in). Callers that keep an entry call its ``ensure_uploaded()`` before
    each launch (:class:`UploadedSchedule`: uploads made during a capture run only at replays).
    """
    s = plan.host_schedule
    return _cached_upload((plan, str(device)), device,
                          lambda: [v for row in s.rows for v in row] + list(s.num_splits) + list(accum_offsets(s.num_splits)),
                          lambda dev: schedule_views(plan, dev))


def _cached_upload(key, device: torch.device, host_ints, views_of) -> UploadedSchedule:
    """The cache entry ``key`` (made on first use: ``host_ints()`` as int32, pinned, and its device
    copy with ``views_of(dev)``), its upload ensured (:class:`UploadedSchedule`)."""
    with _lock:
        entry = _host_schedules.get(key)
        if entry is None:
            # on the host by name: under a CUDA default device a bare torch.tensor is a CUDA tensor,
            # which cannot be pinned
            host = torch.tensor(host_ints(), dtype=torch.int32, device="cpu")
            if device.type == "cuda":
                host = _pinned(host)
            dev = _device_buffer(host.numel(), device)   # outside any graph's pool
            entry = _host_schedules[key] = UploadedSchedule(host, dev, views_of(dev))
    entry.ensure_uploaded()
    return entry


@dataclass
class Schedule:
    """The schedule tensors of one call (views of a cached upload, or tensors made on the device)."""

    tile_md: torch.Tensor
    num_splits: torch.Tensor
    accum_offsets: torch.Tensor
    upload: Optional[UploadedSchedule] = None      # host schedules: the cached upload
    # (b,) int32: the request at each position the rows index (plans that order requests), else None
    request_order: Optional[torch.Tensor] = None
    keepalive: Tuple[torch.Tensor, ...] = field(default=(), repr=False)

    def ensure_ready(self) -> None:
        """Before every launch that reads the schedule (:class:`UploadedSchedule`: an upload first
        made during a graph capture holds nothing before that graph replays); a flag test once
        an eager upload is known complete, nothing for device schedules."""
        if self.upload is not None and not self.upload.ready:
            self.upload.ensure_uploaded()


def _torch_min(a, b):
    return a.clamp(max=b)


def _torch_max(a, b):
    return a.clamp(min=b)


def device_num_blocks(topk_length: Optional[torch.Tensor], topk: int, b: int, device: torch.device,
                      extra_topk: int = 0, extra_topk_length: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Blocks of each request from the device lengths (``blocks_of_length`` then
    ``extra_blocks_of_length``, torch ops, no sync); a list without lengths has its full length."""
    return _device_lists(topk_length, topk, b, device, extra_topk, extra_topk_length, False)[0]


def device_blocks_and_rows(topk_length: Optional[torch.Tensor], topk: int, b: int, device: torch.device,
                           extra_topk: int = 0,
                           extra_topk_length: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(:func:`device_num_blocks`, rows): with each request's positions inside its lengths, main
    list plus extra list (the effective lengths of ``blocks_of_length`` and
    ``extra_blocks_of_length``, at least 0), the most rows the SM90 producer gathers for it. The
    lists share a request's compacted tiles, so its tiles follow these rows, ``ceil(rows / 64)``,
    not its blocks (a main list of 65 and an extra list of 65 are 4 blocks but 3 tiles). Both from
    the same clamped lengths: each op is a node of a captured decode step."""
    return _device_lists(topk_length, topk, b, device, extra_topk, extra_topk_length, True)


def _device_lists(topk_length, topk, b, device, extra_topk, extra_topk_length, with_rows: bool):
    """(blocks, rows or None) of :func:`device_blocks_and_rows`; the rows' two ops only ``with_rows``."""
    if topk_length is not None:
        rows, nb = blocks_of_length(topk_length, topk, _torch_min, _torch_max)
        rows = rows.clamp(min=0) if with_rows else None
    else:
        nb = torch.full((b,), topk // BLOCK_TOPK, dtype=torch.int32, device=device)
        rows = torch.full((b,), topk, dtype=torch.int32, device=device) if with_rows else None
    if extra_topk_length is not None:
        extra_rows, extra_nb = extra_blocks_of_length(extra_topk_length, extra_topk, _torch_min, _torch_max)
        nb = nb + extra_nb
        rows = rows + extra_rows if with_rows else None
    elif extra_topk:
        nb = nb + extra_topk // BLOCK_TOPK
        rows = rows + extra_topk if with_rows else None
    return nb.to(torch.int32), rows.to(torch.int32) if with_rows else None


def per_request_schedule_device(num_blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One partition per request, nothing split, with torch ops on the device: (tile_md (b, 8),
    num_splits (b+1,)); ``scheduler.per_request_rows`` on the host."""
    b = num_blocks.shape[0]
    ar = torch.arange(b, dtype=torch.int32, device=num_blocks.device)
    tile_md = torch.zeros(b, SCHED_ROW_INTS, dtype=torch.int32, device=num_blocks.device)
    tile_md[:, SchedField.BEGIN_REQ] = ar
    tile_md[:, SchedField.END_REQ] = ar
    tile_md[:, SchedField.END_BLOCK] = num_blocks
    num_splits = torch.arange(b + 1, dtype=torch.int32, device=num_blocks.device)
    return tile_md, num_splits


@dataclass(frozen=True)
class BalancedDeal:
    """What the balanced cut of ``b`` requests into ``parts`` partitions fixes before the lengths are
    known (host ints; :func:`balanced_schedule_device`). Ranks are positions in the requests sorted
    by decreasing cost; ``rounds`` full rounds deal ranks ``0 .. dealt-1`` back and forth, the last
    round's ``last`` cheapest ranks go to the least loaded partitions. The partitions are labelled
    as rows by increasing load after the full rounds, so that rows ``0 .. last-1`` (those that receive a last-round rank)
    hold ``rounds + 1`` requests and the others ``rounds``: every row's position range is fixed."""

    b: int
    parts: int

    @property
    def rounds(self) -> int:
        return (self.b - 1) // self.parts

    @property
    def dealt(self) -> int:
        return self.rounds * self.parts

    @property
    def last(self) -> int:
        return self.b - self.dealt

    def begin(self, row: int) -> int:
        r, last = self.rounds, self.last
        return row * (r + 1) if row < last else last * (r + 1) + (row - last) * r

    def count(self, row: int) -> int:
        return self.rounds + (row < self.last)

    def rank_of_round(self, rnd: int, part: int) -> int:
        """The rank that round ``rnd`` (< rounds) deals to partition ``part``: left to right in even
        rounds, right to left in odd ones."""
        return rnd * self.parts + (part if rnd % 2 == 0 else self.parts - 1 - part)

    def host_tables(self) -> list:
        """The int32 tables :func:`balanced_schedule_device` reads, packed (:func:`balanced_views`):
        ``tile_md`` with every row's position range (END_BLOCK left 0), ``num_splits`` (one piece
        a request), zero accumulator offsets; ``deal`` (dealt,) the rank each (round, partition)
        gets, round-major; per position, its row, and ``rank = base + sign * partition`` (the last
        round's ranks: sign 0); ``ends`` (min(b, parts),) the last position of each non-empty row."""
        b, parts, r = self.b, self.parts, self.rounds
        tile_md, row_of, base, sign, ends = [], [], [], [], []
        for row in range(parts):
            n, begin = self.count(row), self.begin(row)
            md = [0] * SCHED_ROW_INTS
            md[SchedField.BEGIN_REQ], md[SchedField.END_REQ] = (begin, begin + n - 1) if n else (b, b - 1)
            tile_md += md
            if n:
                ends.append(begin + n - 1)
            for j in range(n):
                row_of.append(row)
                if j < r:
                    base.append(j * parts + (0 if j % 2 == 0 else parts - 1))
                    sign.append(1 if j % 2 == 0 else -1)
                else:
                    base.append(self.dealt + row)
                    sign.append(0)
        deal = [self.rank_of_round(j, q) for j in range(r) for q in range(parts)]
        return tile_md + list(range(b + 1)) + [0] * (b + 1) + deal + row_of + base + sign + ends


def balanced_views(deal: BalancedDeal, packed: torch.Tensor) -> dict:
    """Named views of :meth:`BalancedDeal.host_tables` packed in ``packed``."""
    sizes = dict(tile_md=deal.parts * SCHED_ROW_INTS, num_splits=deal.b + 1, offsets=deal.b + 1, deal=deal.dealt,
                 row_of=deal.b, base=deal.b, sign=deal.b, ends=min(deal.b, deal.parts))
    views, at = {}, 0
    for name, n in sizes.items():
        views[name] = packed[at:at + n]
        at += n
    views["tile_md"] = views["tile_md"].view(deal.parts, SCHED_ROW_INTS)
    return views


def balanced_tables(b: int, parts: int, device: torch.device) -> UploadedSchedule:
    """The fixed tables of the balanced cut of ``b`` requests into ``parts`` on ``device``
    (:func:`balanced_views`), uploaded once and cached as host schedules are (stable addresses,
    safe to make first inside a graph capture: :class:`UploadedSchedule`); uploaded before return."""
    deal = BalancedDeal(b, parts)
    return _cached_upload((deal, str(device)), device, deal.host_tables, lambda dev: balanced_views(deal, dev))


def balanced_schedule_device(num_blocks: torch.Tensor, parts: int,
                             cost: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``parts`` partitions of whole requests of about equal cost, nothing split, with torch ops on
    the device (no sync): (tile_md (parts, 8), num_splits (b+1,), order (b,)). The rows hold
    positions in ``order``, which names the request at each position (the kernel's
    ``request_order``); a row's requests are contiguous there.

    Request r costs ``cost[r]``, by default its blocks; :func:`make_schedule` passes its rows
    (:func:`device_blocks_and_rows`), which its compacted tiles and its gathers follow. (A charge per
    request would change nothing: it keeps the order of the requests' costs, and every partition
    holds one request of each round before the last, so it adds the same to every partition's load
    there.) The requests are dealt in rounds of ``parts`` by decreasing cost, back and forth across
    the partitions (round 0 left to right, round 1 right to left, ...), except the last round, the
    cheapest requests, whose k-th goes to the k-th least loaded partition: a greedy of longest-first
    quality (the partitions' costs within about one small request of each other) at a fixed number
    of ops. Row k is the k-th least loaded partition (:class:`BalancedDeal`), and within it the
    costliest request comes first. A row without requests (b < parts) is the empty row of
    ``scheduler.whole_request_rows`` (begin_req = b), which the kernel skips.

    What does not depend on the lengths is a cached upload (:func:`balanced_tables`); what does
    is 13 ops: the sort by cost, the full rounds' loads and their sort, each position's rank,
    the order, and each row's last block count. ``num_splits`` is a view of the cached tables."""
    t = balanced_tables(num_blocks.shape[0], parts, num_blocks.device).views
    tile_md, order = _deal(num_blocks, num_blocks if cost is None else cost, t)
    return tile_md, t["num_splits"], order


def _deal(num_blocks: torch.Tensor, cost: torch.Tensor, t: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tile_md, order) of :func:`balanced_schedule_device`, from its tables ``t``
    (:func:`balanced_views`): requests dealt by ``cost``, each row's last block count from
    ``num_blocks``."""
    parts = t["tile_md"].shape[0]
    rounds = t["deal"].shape[0] // parts
    sorted_cost, by_cost = torch.sort(cost, descending=True, stable=True)
    if rounds:
        load = sorted_cost.index_select(0, t["deal"]).view(rounds, parts).sum(0)
        least_loaded = torch.sort(load, stable=True).indices
        rank = least_loaded.index_select(0, t["row_of"]) * t["sign"] + t["base"]
    else:                   # one request a row at most: rank = position
        rank = t["base"]
    order = by_cost.index_select(0, rank).to(torch.int32)
    tile_md = t["tile_md"].clone()
    tile_md[:len(t["ends"]), SchedField.END_BLOCK] = num_blocks.index_select(0, order.index_select(0, t["ends"]))
    return tile_md, order


def make_schedule(plan: SparseDecodePlan, device: torch.device, topk_length: Optional[torch.Tensor],
                  extra_topk_length: Optional[torch.Tensor] = None) -> Schedule:
    """The schedule of ``plan`` on ``device``: the host's, uploaded (cached), or built on the device
    from ``topk_length`` / ``extra_topk_length``."""
    if plan.host_schedule is not None:
        upload = uploaded_schedule(plan, device)
        return Schedule(*upload.views, upload=upload)
    if plan.schedule == "balanced":
        # nothing split: the tables' zero offsets (no request owns accumulator rows)
        nb, rows = device_blocks_and_rows(topk_length, plan.topk, plan.b, device, plan.extra_topk, extra_topk_length)
        t = balanced_tables(plan.b, plan.num_sm_parts, device).views
        tile_md, order = _deal(nb, rows, t)
        return Schedule(tile_md, t["num_splits"], t["offsets"], request_order=order, keepalive=(nb, rows))
    nb = device_num_blocks(topk_length, plan.topk, plan.b, device, plan.extra_topk, extra_topk_length)
    if plan.schedule == "per_request":
        tile_md, num_splits = per_request_schedule_device(nb)
        # nothing split: no request owns accumulator rows
        return Schedule(tile_md, num_splits, torch.zeros(plan.b + 1, dtype=torch.int32, device=device), keepalive=(nb,))
    tile_md, num_splits = plan_splits(nb, plan.num_sm_parts, plan.fixed_overhead)
    return Schedule(tile_md, num_splits, accum_offsets_device(num_splits), keepalive=(nb,))
