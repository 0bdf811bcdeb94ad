import pytest
import torch

from cute_mla import plan_sparse_decode
from cute_mla.plan.policy import default_policy
from cute_mla.plan.sparse_decode import FLASHMLA_ACCUM_BYTES_PER_HEAD, LSE_ACCUM_BYTES

V4_DEVICE_PIECE_CHARGE = default_policy("sm_90a").device_charge("V4")
from cute_mla.plan.schedule import balanced_schedule_device
from cute_mla.scheduler import FIXED_OVERHEAD, accum_offsets, longest_partition, plan_splits_host
from cute_mla.scheduler.partition import head_blocks


def fixed_overhead_blocks(arch, *, b, parts, blocks):
    """The scheduler's per-piece charge under the arch's policy."""
    return default_policy(arch).fixed_overhead(b, parts, blocks)


@pytest.mark.parametrize("s_q", [1, 8, 128, 1024, 8192, 32768])
def test_sm90_mixed_batch_workspace(s_q):
    p = plan_sparse_decode(1, s_q, 64, 576, 2048, arch="sm_90a", num_sms=132)
    assert p.kernel == "sm90_sparse_decode"
    if s_q >= 67:   # one partition: nothing can be split
        assert p.num_sm_parts == 1
        assert not p.split and p.workspace_bytes == 0 and p.accum_rows == 0
        assert "o_accum" not in p.tensor_maps and "combine" not in p.launches
    else:
        assert p.split and p.launches[-1] == "combine"
        # bf16 partials: always staged and stored by TMA (an o_accum tensor map), the pair (s_q=1) too
        assert "o_accum" in p.tensor_maps
        # exactly the real split rows of the host schedule
        off = accum_offsets(p.host_schedule.num_splits)
        assert p.accum_rows == off[-1] == p.host_schedule.num_splits[-1]
        # bf16 partials on SM90 (the SM90 kernel's ACCUM_DTYPE): 512 x 2 B + a 4-B lse per row, token and head
        assert p.accum_dtype == "bfloat16"
        assert p.workspace_bytes == p.accum_rows * s_q * 64 * (512 * 2 + LSE_ACCUM_BYTES)
    assert p.workspace_bytes <= p.flashmla_workspace_bytes


def test_sm90_s_q_1_exact_rows():
    p = plan_sparse_decode(1, 1, 64, 576, 2048, arch="sm_90a", num_sms=132)
    assert p.num_sm_parts == 132 and p.accum_rows == 32      # 32 blocks -> 32 one-block pieces
    assert p.workspace_bytes == 32 * 64 * (1024 + 4)          # bf16 o_accum rows + fp32 lse_accum
    assert p.flashmla_workspace_bytes == (1 + 132) * 64 * FLASHMLA_ACCUM_BYTES_PER_HEAD   # FlashMLA's fp32 rows


@pytest.mark.parametrize("b,s_q,h_q,overhead,pieces", [
    (1, 8, 64, 0, 16),      # 16 partitions: 16 pieces of 2 blocks (FlashMLA's charge of 5: 11 pieces of 3)
    (1, 8, 128, 0, 8),      # 8 partitions: 8 pieces of 4 (charge 5: 7 pieces of 5)
    (16, 1, 128, 0, 64),
    (1, 1, 64, 5, 32),      # one-block pieces either way
    (4, 1, 64, 5, 64),      # charge 0 would cut 128 one-block pieces (measured slower): 64 of 2
    (9, 1, 64, 5, 99),      # charge 0 would not shorten the longest partition (9 blocks), only add pieces
    (128, 2, 128, 5, 128),  # b >= partitions: FlashMLA's charge
])
def test_sm90_piece_overhead_fills_partitions(b, s_q, h_q, overhead, pieces):
    """SM90, fewer requests than partitions: no per-piece charge when that leaves two blocks or more
    per partition on average and shortens the longest partition (fixed_overhead_blocks)."""
    p = plan_sparse_decode(b, s_q, h_q, 576, 2048, arch="sm_90a", num_sms=132)
    assert p.fixed_overhead == overhead
    assert p.host_schedule.num_splits[-1] == pieces
    if overhead == 0:   # the longest partition is shorter than with FlashMLA's charge
        flashmla = plan_splits_host([2048 // 64] * b, p.num_sm_parts, FIXED_OVERHEAD)
        assert longest_partition(p.host_schedule.rows, 32) < longest_partition(flashmla.rows, 32)


def test_flashmla_seed_numbers():
    # the seed's table: FlashMLA's dead workspace is (b + P) x s_q x h_q x 2052 bytes
    p = plan_sparse_decode(1, 32768, 64, 576, 2048, arch="sm_90a", num_sms=132)
    assert round(p.flashmla_workspace_bytes / 2**20) == 8208 and p.workspace_bytes == 0
    p = plan_sparse_decode(1, 8192, 128, 576, 2048, arch="sm_90a", num_sms=132)
    assert round(p.flashmla_workspace_bytes / 2**20, 1) == 4104.0 and p.workspace_bytes == 0


def test_decode_batch_no_split_when_requests_fit():
    p = plan_sparse_decode(128, 1, 64, 576, 2048, arch="sm_90a", num_sms=132)
    assert not p.split and p.workspace_bytes == 0 and p.num_sm_parts == 132


def test_topk_length_plans_device_schedule_with_bounded_workspace():
    p = plan_sparse_decode(128, 2, 128, 576, 2048, arch="sm_90a", num_sms=132, has_topk_length=True)
    assert p.schedule == "device" and p.launches[0] == "scheduler"
    assert p.accum_rows == min(2 * (p.num_sm_parts - 1), 128 + p.num_sm_parts - 1)
    assert p.workspace_bytes < p.flashmla_workspace_bytes
    p1 = plan_sparse_decode(1, 4096, 64, 576, 2048, arch="sm_90a", num_sms=132, has_topk_length=True)
    assert p1.num_sm_parts == 1 and p1.workspace_bytes == 0 and not p1.split


@pytest.mark.parametrize("topk,split", [(64, False), (640, False), (704, True), (2048, True)])
def test_sm100_no_split_rule(topk, split):
    p = plan_sparse_decode(4, 1, 64, 576, topk, arch="sm_100a", num_sms=148)
    assert p.kernel == "sm100_sparse_decode"
    assert p.split is split
    if not split:
        assert p.schedule == "per_request" and p.num_sm_parts == 4 and p.workspace_bytes == 0
        assert "o_accum" not in p.tensor_maps
        assert p.host_schedule.rows[3] == (3, 3, 0, topk // 64, 0, 0, 0, 0)
    else:
        assert "o_accum" in p.tensor_maps


def test_sm100_topk_length_short_topk_is_per_request():
    p = plan_sparse_decode(4, 3, 128, 576, 512, arch="sm_100a", num_sms=148, has_topk_length=True)
    assert p.schedule == "per_request" and not p.split and p.host_schedule is None


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(h_q=48), ValueError, "h_q: got 48, accepted: 8, 16, 32, 64 or 128"),
    (dict(h_q=32, arch="sm_100a"), ValueError, "h_q: got 32, the sm_100a sparse decode kernel takes 64, 128"),
    (dict(topk=100), ValueError, "topk: got 100, accepted: a positive multiple of 64"),
    (dict(d_qk=600), ValueError, "d_qk: got 600"),
    (dict(arch="sm_80"), ValueError, "arch: got 'sm_80'"),
    (dict(b=0), ValueError, "b: must be a positive int"),
    (dict(topk=2**30), ValueError, f"topk: got {2**30}, accepted: a positive multiple of 64 up to {2**30 - 64}"),
])
def test_plan_rejects(kw, exc, msg):
    args = dict(b=1, s_q=1, h_q=64, d_qk=576, topk=2048, arch="sm_90a")
    args.update(kw)
    with pytest.raises(exc, match=msg):
        plan_sparse_decode(args["b"], args["s_q"], args["h_q"], args["d_qk"], args["topk"], arch=args["arch"], num_sms=132)


@pytest.mark.parametrize("s_q,h_q", [(133, 64), (1024, 64), (8192, 64), (32768, 64), (67, 128), (1024, 128), (8192, 128)])
def test_sm90_token_walk_covers_every_token_once(s_q, h_q):
    """b == 1 with more (token, head half) CTAs than SMs: the s_q tokens run as one-token requests,
    num_sms / (h_q/64) partitions of contiguous whole tokens, balanced to one token, nothing split."""
    p = plan_sparse_decode(1, s_q, h_q, 576, 2048, arch="sm_90a", num_sms=132)
    assert p.token_walk and not p.split and p.workspace_bytes == 0 and p.schedule == "host"
    assert p.num_sm_parts == 1                         # FlashMLA's count (its workspace formula uses it)
    rows = p.host_schedule.rows
    assert len(rows) == 132 // (h_q // 64)
    # the call's one request, unsplit: the plan stays O(partitions) for any s_q
    assert p.host_schedule.num_splits == (0, 1) and not p.host_schedule.any_split
    nxt = 0
    for r in rows:
        assert r == (nxt, r[1], 0, 32, 0, 0, 0, 0), r
        nxt = r[1] + 1
    assert nxt == s_q
    counts = [r[1] - r[0] + 1 for r in rows]
    assert max(counts) - min(counts) <= 1 and max(counts) == -(-s_q // len(rows))
    assert "token walk" in p.describe()


@pytest.mark.parametrize("b,s_q,h_q,tl,arch", [(1, 132, 64, False, "sm_90a"), (1, 66, 128, False, "sm_90a"),
                                               (2, 1024, 64, False, "sm_90a"), (1, 1024, 64, True, "sm_90a"),
                                               (1, 1024, 64, False, "sm_100a")])
def test_token_walk_only_where_it_applies(b, s_q, h_q, tl, arch):
    """One wave or less, b > 1, device schedules (topk_length) and SM100 keep the grid of one CTA
    per (token, head half)."""
    p = plan_sparse_decode(b, s_q, h_q, 576, 2048, arch=arch, num_sms=132, has_topk_length=tl)
    assert not p.token_walk and "token walk" not in p.describe()


def test_host_schedule_upload_is_cached_and_o_partitions():
    """An engine brings a new s_q (a new plan) at every step and a captured graph keeps reading the
    uploaded schedule, so uploads are cached for good: a hit returns the same tensors (stable
    addresses) and a token-walk entry holds O(partitions) ints, not O(s_q)."""
    import torch

    from cute_mla.plan import schedule

    cpu = torch.device("cpu")
    for s_q in (140, 100_000):
        p = plan_sparse_decode(1, s_q, 64, 576, 2048, arch="sm_90a", num_sms=132)
        tile_md, num_splits, offsets = schedule.uploaded_schedule(p, cpu).views
        assert schedule.uploaded_schedule(p, cpu).views[0].data_ptr() == tile_md.data_ptr()
        assert tile_md.tolist() == [list(r) for r in p.host_schedule.rows] and tile_md.shape == (132, 8)
        assert num_splits.tolist() == [0, 1] and offsets.tolist() == [0, 0]
        assert schedule._host_schedules[(p, "cpu")].host.numel() == 132 * 8 + 4


def test_schedule_upload_state_machine(monkeypatch):
    """UploadedSchedule's rules, with the CUDA side effects replaced by a log: an upload issued
    during a capture runs only when that graph replays, so each capture gets one upload node
    (two calls of one capture: one node) until an eager upload has been issued; the eager upload
    records an event; later calls wait for it (on whatever stream they run) until it is seen
    complete, and from then on do nothing."""
    import torch

    from cute_mla.plan import schedule

    log = []
    done = {"ev": False}
    monkeypatch.setattr(schedule, "_record_event", lambda: log.append("record") or "ev")
    monkeypatch.setattr(schedule, "_event_done", lambda ev: done[ev])
    monkeypatch.setattr(schedule, "_wait_event", lambda ev: log.append("wait"))

    host = torch.arange(12, dtype=torch.int32)
    dev = torch.zeros_like(host)
    entry = schedule.UploadedSchedule(host, dev, (dev[:8].view(1, 8), dev[8:10], dev[10:]))

    def step(capture):
        entry.dev.zero_()
        entry._upload_or_wait(capture)
        copied = bool(entry.dev.any())
        return copied

    assert step(7) and step(7) is False          # capture 7: one upload node for both calls
    assert step(8) and step(8) is False          # capture 8 gets its own
    assert step(-1) and step(-1)                 # capture id unknown: every call uploads
    assert entry.captures == {7, 8, -1} and log == [] and not entry.ready
    assert step(None) and log == ["record"]      # eager: the upload, then its event
    assert step(None) is False and log == ["record", "wait"]   # not yet complete: wait, no copy
    assert step(9) is False                      # a capture after the eager upload adds nothing
    done["ev"] = True
    assert step(None) is False and entry.ready and entry.event is None
    entry.dev.zero_()
    entry.ensure_uploaded()                      # ready: a flag test, nothing copied or waited
    assert not entry.dev.any() and log == ["record", "wait"]


def test_schedule_upload_on_the_host_is_immediate():
    import torch

    from cute_mla.plan import schedule

    cpu = torch.device("cpu")
    p = plan_sparse_decode(5, 1, 64, 576, 1088, arch="sm_90a", num_sms=132)
    entry = schedule.uploaded_schedule(p, cpu)
    assert entry.ready and torch.equal(entry.dev, entry.host)
    assert entry.views[0].tolist() == [list(r) for r in p.host_schedule.rows]


def test_token_walk_needs_a_partition_per_head_half():
    p = plan_sparse_decode(1, 8, 128, 576, 2048, arch="sm_90a", num_sms=1)   # 16 CTAs, 1 SM: no walk
    assert not p.token_walk


@pytest.mark.parametrize("b,s_q,h_q,tl", [(1, 1, 64, False), (8, 1, 64, False), (1, 8, 64, False), (1, 1, 128, False),
                                       (4, 1, 64, True), (128, 1, 64, False)])
def test_sm90_split_partials_are_bf16_and_stored_by_tma(b, s_q, h_q, tl):
    """SM90 split plans store bf16 partials (the arch's accum dtype), always staged and stored by
    TMA (an o_accum tensor map); no-split plans have no accumulators at all."""
    p = plan_sparse_decode(b, s_q, h_q, 576, 2048, arch="sm_90a", num_sms=132, has_topk_length=tl)
    assert p.accum_dtype == ("bfloat16" if p.split else "float32")
    assert ("o_accum" in p.tensor_maps) == p.split


@pytest.mark.parametrize("b,s_q,h_q,topk,tl,pair", [(1, 1, 64, 2048, False, True), (1, 1, 64, 128, False, True),
                                                    (2, 1, 64, 1024, False, True), (2, 1, 64, 2048, False, False),
                                                    (1, 2, 64, 2048, False, False), (1, 8, 64, 2048, False, False),
                                                    (1, 1, 128, 2048, False, False), (1, 1, 64, 2048, True, False),
                                                    (1, 1, 64, 64, False, False)])
def test_sm90_column_pair_where_few_pieces(b, s_q, h_q, topk, tl, pair):
    """h=64 split plans with at most COLUMN_PAIR_MAX_BUSY_CTAS busy CTAs run column pairs (a cluster
    of 2 per piece): out from registers, the bf16 partials by TMA (Q and o_accum the tensor maps).
    Device schedules, h=128, no-split plans and busier shapes keep one CTA per piece."""
    COLUMN_PAIR_MAX_BUSY_CTAS = default_policy("sm_90a").column_pair_max_busy_ctas

    p = plan_sparse_decode(b, s_q, h_q, 576, topk, arch="sm_90a", num_sms=132, has_topk_length=tl)
    assert p.column_pair is pair
    if pair:
        busy = sum(1 for r in p.host_schedule.rows if r[0] < b and r[0] <= r[1])
        assert p.split and busy * s_q <= COLUMN_PAIR_MAX_BUSY_CTAS
        assert p.tensor_maps == ("q", "o_accum") and "column pair" in p.describe()
    else:
        assert "column pair" not in p.describe()
    # a GPU with few SMs: the doubled CTAs must stay well inside it (at most num_sms / 2)
    small = plan_sparse_decode(b, s_q, h_q, 576, topk, arch="sm_90a", num_sms=16, has_topk_length=tl)
    if small.column_pair:
        assert sum(1 for r in small.host_schedule.rows if r[0] < b and r[0] <= r[1]) * s_q <= 16 // 4
    assert small.column_pair is (pair and topk <= 128)


# ------------------------------------------------------------------------ V4 (d_qk 512), extra pool

V4_ARCHS = [("sm_90a", 132), ("sm_100a", 148)]


def _v4(b, s_q, h_q, arch, num_sms, topk=128, extra_topk=0, **kw):
    return plan_sparse_decode(b, s_q, h_q, 512, topk, arch=arch, num_sms=num_sms, extra_topk=extra_topk, **kw)


def _accum_row_bytes(p):
    from cute_mla.plan.sparse_decode import ACCUM_ITEM_BYTES
    return p.s_q * p.h_q * (512 * ACCUM_ITEM_BYTES[p.accum_dtype] + LSE_ACCUM_BYTES)


@pytest.mark.parametrize("arch,num_sms,b,s_q,h_q,extra_topk", [
    ("sm_90a", 132, 128, 1, 64, 0), ("sm_90a", 132, 128, 1, 64, 512), ("sm_90a", 132, 128, 2, 128, 1024),
    ("sm_90a", 132, 512, 1, 128, 1024), ("sm_90a", 132, 32, 4, 64, 1024),
    ("sm_90a", 132, 4, 132, 64, 512),                  # one partition
    ("sm_100a", 148, 1, 1, 64, 0), ("sm_100a", 148, 1, 1, 128, 512), ("sm_100a", 148, 512, 2, 128, 512),
    ("sm_100a", 148, 148, 1, 128, 1024), ("sm_100a", 148, 32, 4, 64, 1024),
])
def test_v4_unsplit_plans_have_no_workspace(arch, num_sms, b, s_q, h_q, extra_topk):
    p = _v4(b, s_q, h_q, arch, num_sms, extra_topk=extra_topk)
    assert p.d_qk == 512 and p.d_v == 512 and p.extra_topk == extra_topk
    assert not p.split and p.accum_rows == 0 and p.workspace_bytes == 0
    assert "o_accum" not in p.tensor_maps and "combine" not in p.launches
    assert p.blocks_per_request == (128 + extra_topk) // 64
    if arch == "sm_100a" and 128 + extra_topk <= 640:   # FlashMLA's SM100 rule counts both lists
        assert p.schedule == "per_request" and p.num_sm_parts == b and p.flashmla_workspace_bytes == 0
        assert p.host_schedule.rows[-1] == (b - 1, b - 1, 0, (128 + extra_topk) // 64, 0, 0, 0, 0)
    else:
        assert p.schedule == "host" and not p.host_schedule.any_split
        assert p.flashmla_workspace_bytes == (b + p.num_sm_parts) * s_q * h_q * FLASHMLA_ACCUM_BYTES_PER_HEAD


@pytest.mark.parametrize("arch,num_sms,b,s_q,h_q,extra_topk", [
    ("sm_90a", 132, 1, 1, 64, 0), ("sm_90a", 132, 1, 1, 64, 1024), ("sm_90a", 132, 2, 1, 128, 512),
    ("sm_90a", 132, 32, 1, 64, 512), ("sm_90a", 132, 148, 1, 64, 1024), ("sm_90a", 132, 512, 4, 64, 1024),
    ("sm_100a", 148, 1, 1, 64, 1024), ("sm_100a", 148, 128, 2, 128, 1024), ("sm_100a", 148, 512, 1, 64, 1024),
])
def test_v4_split_plans_allocate_exactly_the_split_rows(arch, num_sms, b, s_q, h_q, extra_topk):
    """No lengths: the host schedules top-k/64 + extra_topk/64 blocks per request, and the
    accumulators hold exactly the pieces of the split requests."""
    p = _v4(b, s_q, h_q, arch, num_sms, extra_topk=extra_topk)
    assert p.schedule == "host" and p.split and "combine" in p.launches and "o_accum" in p.tensor_maps
    want = plan_splits_host([(128 + extra_topk) // 64] * b, p.num_sm_parts, p.fixed_overhead)
    assert p.host_schedule == want
    assert p.accum_rows == want.split_rows == accum_offsets(want.num_splits)[-1] > 0
    assert p.workspace_bytes == p.accum_rows * _accum_row_bytes(p)
    assert p.workspace_bytes < p.flashmla_workspace_bytes
    assert f"extra_topk={extra_topk}" in p.describe() if extra_topk else "extra_topk" not in p.describe()


@pytest.mark.parametrize("arch,num_sms", V4_ARCHS)
@pytest.mark.parametrize("tl,etl", [(True, False), (False, True), (True, True)])
def test_v4_lengths_plan_a_device_schedule(arch, num_sms, tl, etl):
    """topk_length or extra_topk_length (device values): the schedule is made on the device and the
    accumulators are sized for the worst case; one partition, or SM100's short lists: none."""
    kw = dict(has_topk_length=tl, has_extra_topk_length=etl)
    p = _v4(32, 1, 64, arch, num_sms, extra_topk=1024, **kw)
    assert (p.has_topk_length, p.has_extra_topk_length) == (tl, etl) and p.lengths_on_device
    assert p.schedule == "device" and p.host_schedule is None
    assert p.launches[0] == "scheduler" and p.split
    assert p.accum_rows == min(2 * (p.num_sm_parts - 1), 32 + p.num_sm_parts - 1)
    assert p.workspace_bytes == p.accum_rows * _accum_row_bytes(p) < p.flashmla_workspace_bytes
    one = _v4(4, num_sms, 64, arch, num_sms, extra_topk=512, **kw)   # s_q = num_sms: one partition
    if arch == "sm_90a":
        assert one.num_sm_parts == 1 and one.schedule == "device"
    else:
        assert one.schedule == "per_request"
    assert not one.split and one.workspace_bytes == 0
    if arch == "sm_100a":
        short = _v4(4, 1, 128, arch, num_sms, extra_topk=512, **kw)
        assert short.schedule == "per_request" and short.host_schedule is None and not short.split


def test_v4_device_blocks_with_both_lengths():
    """The per-request schedule made with torch ops (SM100, top-k + extra_topk <= 640) from both
    lists' lengths: the main list's blocks (at least one), then the extra list's (possibly none)."""
    import torch

    from cute_mla.plan.schedule import device_blocks_and_rows, device_num_blocks, make_schedule
    from cute_mla.scheduler import blocks_per_request

    cpu = torch.device("cpu")
    tl = torch.tensor([0, 64, 65, 1000, -4], dtype=torch.int32)
    etl = torch.tensor([-3, 0, 1, 600, 448], dtype=torch.int32)
    want = [1, 1, 3, 10, 8]
    assert blocks_per_request(128, tl.tolist(), extra_topk=512, extra_topk_length=etl.tolist()) == want
    assert device_num_blocks(tl, 128, 5, cpu, 512, etl).tolist() == want
    assert device_num_blocks(None, 128, 5, cpu, 512, etl).tolist() == [2, 2, 3, 10, 9]
    assert device_num_blocks(tl, 128, 5, cpu, 512, None).tolist() == [9, 9, 10, 10, 9]
    # the rows inside the lengths, which the compacted tiles follow (65 + 1 rows: 3 blocks, 2 tiles)
    for args, rows in [((tl, 128, 5, cpu, 512, etl), [0, 64, 66, 640, 448]),
                       ((None, 128, 5, cpu, 512, etl), [128, 128, 129, 640, 576]),
                       ((tl, 128, 5, cpu, 512, None), [512, 576, 577, 640, 512]), ((None, 2048, 3, cpu), [2048] * 3)]:
        nb, r = device_blocks_and_rows(*args)
        assert r.tolist() == rows and r.dtype == nb.dtype == torch.int32
        assert torch.equal(nb, device_num_blocks(*args))
    p = _v4(5, 1, 64, "sm_100a", 148, extra_topk=512, has_topk_length=True, has_extra_topk_length=True)
    s = make_schedule(p, cpu, tl, etl)
    assert s.tile_md[:, 3].tolist() == want and s.tile_md[:, 0].tolist() == list(range(5))
    assert s.num_splits.tolist() == list(range(6)) and s.accum_offsets.tolist() == [0] * 6


def test_v4_token_walk_counts_both_lists():
    p = _v4(1, 300, 64, "sm_90a", 132, extra_topk=512)
    assert p.token_walk and not p.split and p.workspace_bytes == 0
    assert all(r[3] == (128 + 512) // 64 for r in p.host_schedule.rows)


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(extra_topk=100), ValueError, "extra_topk: got 100, accepted: 0 .* multiple of 64"),
    (dict(extra_topk=-64), ValueError, "extra_topk: got -64"),
    (dict(extra_topk=512, d_qk=576), ValueError, "extra_k_cache: the V3.2 format"),
    (dict(has_extra_topk_length=True), ValueError, "extra_topk_length: given without an extra pool"),
    (dict(d_v=448), ValueError, "head_dim_v: got 448, accepted: 512"),
    (dict(topk=100, extra_topk=512), ValueError, "topk: got 100"),
    (dict(extra_topk=2**30), ValueError, f"extra_topk: got {2**30}, accepted: .* up to {2**30 - 64}"),
])
@pytest.mark.parametrize("arch,num_sms", V4_ARCHS)
def test_v4_plan_rejects(arch, num_sms, kw, exc, msg):
    args = dict(d_qk=512, topk=128)
    args.update(kw)
    d_qk, topk = args.pop("d_qk"), args.pop("topk")
    with pytest.raises(exc, match=msg):
        plan_sparse_decode(4, 1, 64, d_qk, topk, arch=arch, num_sms=num_sms, **args)


@pytest.mark.parametrize("arch,num_sms", V4_ARCHS)
def test_v4_sm100_no_split_limit_counts_both_lists(arch, num_sms):
    """SM100 runs one partition per request while top-k + extra_topk <= 640 (FlashMLA's rule)."""
    at = _v4(4, 1, 64, arch, num_sms, topk=128, extra_topk=512)
    past = _v4(4, 1, 64, arch, num_sms, topk=128, extra_topk=576)
    if arch == "sm_100a":
        assert at.schedule == "per_request" and not at.split
        assert past.schedule == "host" and past.num_sm_parts == 148
    else:
        assert at.schedule == past.schedule == "host"


@pytest.mark.parametrize("b, h_q, extra, expect", [
    (128, 64, 512, "per_request"), (128, 128, 512, "device"),              # 10 blocks, 0.5 .. 2 waves of CTAs
    (32, 64, 512, "device"), (32, 128, 512, "device"),                     # under half a wave
    (512, 64, 512, "device"), (512, 128, 512, "balanced"),                 # beyond 2 waves (h=128: whole requests from 6)
    (396, 128, 512, "balanced"), (395, 128, 512, "device"),                # whole requests from 6 waves of h=128 CTAs
    (512, 128, 448, "balanced"), (512, 128, 1024, "balanced"), (396, 128, 1024, "balanced"),
    (395, 128, 1024, "device"), (512, 128, 1088, "device"),                # up to 18 blocks
    (128, 64, 1024, "device"), (128, 128, 1024, "device"), (512, 64, 1024, "device"),   # 18 blocks: split
    (1, 64, 0, "per_request"), (32, 128, 0, "per_request"), (512, 64, 0, "per_request"),   # 2 blocks: up to 4 waves
    (512, 128, 0, "device"),
    (512, 8, 512, "balanced"), (396, 16, 512, "balanced"), (395, 8, 512, "device"),   # 8, 16 heads: from 3 waves
    (128, 8, 512, "device"), (512, 32, 512, "device"), (512, 16, 1024, "balanced"), (512, 8, 1088, "device"),
])
def test_sm90_short_lists_with_lengths_run_whole_requests(b, h_q, extra, expect):
    """V4-sized lists with device lengths: no split, no accumulators, no combine where the plan's
    rules say so (one partition per request, or whole requests packed into one wave of
    partitions at h_q = 128); the split device schedule otherwise."""
    p = plan_sparse_decode(b, 1, h_q, 512, 128, arch="sm_90a", num_sms=132, has_topk_length=True, extra_topk=extra,
                           has_extra_topk_length=extra > 0)
    # V3.2 lists of the same length
    v32 = plan_sparse_decode(b, 1, h_q, 576, 128 + extra, arch="sm_90a", num_sms=132, has_topk_length=True)
    if expect == "per_request":
        assert (p.schedule, p.num_sm_parts, p.split, p.workspace_bytes, p.launches) == (
            "per_request", b, False, 0, ("sm90_sparse_decode",))
    elif expect == "balanced":
        assert (p.schedule, p.num_sm_parts, p.split, p.workspace_bytes, p.launches) == (
            "balanced", 132 // head_blocks(h_q), False, 0, ("sm90_sparse_decode",))
        assert p.orders_requests and "request order" in p.describe()
        # whole requests only where they were measured: s_q = 1 with an extra list
        assert plan_sparse_decode(b, 2, h_q, 512, 128, arch="sm_90a", num_sms=132, has_topk_length=True,
                                  extra_topk=extra, has_extra_topk_length=True).schedule != "balanced"
        assert plan_sparse_decode(b, 1, h_q, 512, 128 + extra, arch="sm_90a", num_sms=132,
                                  has_topk_length=True).schedule != "balanced"
        assert v32.schedule != "balanced"
    else:
        assert p.schedule == "device" and p.split and p.fixed_overhead == V4_DEVICE_PIECE_CHARGE
    if expect != "balanced":
        assert not p.orders_requests and "request order" not in p.describe()
    # V3.2 keeps FlashMLA's piece charge, and with it one partition per request for 10-block lists
    # at h = 128 as at h = 64
    if v32.schedule == "device":
        assert v32.fixed_overhead == fixed_overhead_blocks("sm_90a", b=b, parts=v32.num_sm_parts, blocks=2 + extra // 64)
    if extra == 512 and 0.5 <= b * head_blocks(h_q) / 132 <= 2:   # (request, head block) CTAs
        assert v32.schedule == "per_request"
    # long lists (V3.2's 2048) keep the balanced split schedule
    assert plan_sparse_decode(b, 1, h_q, 576, 2048, arch="sm_90a", num_sms=132, has_topk_length=True).schedule == "device"
    # without lengths the host schedules as before
    assert plan_sparse_decode(b, 1, h_q, 512, 128, arch="sm_90a", num_sms=132, extra_topk=extra).schedule == "host"


@pytest.mark.parametrize("b, s_q, h_q", [(1, 1, 64), (32, 1, 128), (128, 2, 64), (256, 1, 128), (512, 2, 128)])
def test_device_piece_charge_is_v4_on_sm90_only(b, s_q, h_q):
    """V4 device split schedules on SM90 charge a piece V4_DEVICE_PIECE_CHARGE blocks; V3.2's and
    SM100's keep the scheduler's rule (FlashMLA's 5, or SM90's 0 for few requests); host
    schedules are untouched."""
    v4 = plan_sparse_decode(b, s_q, h_q, 512, 128, arch="sm_90a", num_sms=132, has_topk_length=True,
                            extra_topk=1024, has_extra_topk_length=True)
    assert v4.schedule == "device" and v4.fixed_overhead == V4_DEVICE_PIECE_CHARGE
    for arch, num_sms, d_qk, topk, extra in [("sm_90a", 132, 576, 2048, 0), ("sm_100a", 148, 512, 128, 1024)]:
        kw = dict(arch=arch, num_sms=num_sms, has_topk_length=True, extra_topk=extra, has_extra_topk_length=extra > 0)
        p = plan_sparse_decode(b, s_q, h_q, d_qk, topk, **kw)
        assert p.schedule == "device"
        assert p.fixed_overhead == fixed_overhead_blocks(arch, b=b, parts=p.num_sm_parts, blocks=(topk + extra) // 64)
    host = plan_sparse_decode(b, s_q, h_q, 512, 128, arch="sm_90a", num_sms=132, extra_topk=1024)
    assert host.schedule == "host"
    assert host.fixed_overhead == fixed_overhead_blocks("sm_90a", b=b, parts=host.num_sm_parts, blocks=18)


@pytest.mark.parametrize("charge", [0, 1, 3])
@pytest.mark.parametrize("by_rows", [False, True])
def test_balanced_schedule_deals_whole_requests(charge, by_rows):
    """The balanced device schedule (torch ops, here on the CPU): its order names every request
    once; each partition holds a contiguous range of positions, whole (block range 0 .. the
    blocks of the request at its last position); a partition without a request has FlashMLA's
    empty row; the costliest partition costs at most the cheapest plus one request; nothing split.
    Dealt by the blocks, or by a cost of their own (the rows inside the lengths), whose order
    differs from the blocks'."""
    g = torch.Generator().manual_seed(charge + 10 * by_rows)
    for b, parts in [(1, 66), (5, 66), (66, 66), (67, 66), (128, 66), (321, 66), (512, 66), (512, 132), (600, 33),
                     (7, 1)]:
        nb = torch.randint(1, 19, (b,), generator=g, dtype=torch.int32)
        rows = (64 * nb - torch.randint(0, 64, (b,), generator=g, dtype=torch.int32)) if by_rows else None
        tile_md, num_splits, order = balanced_schedule_device(nb, parts, rows)
        assert tile_md.shape == (parts, 8) and tile_md.dtype == order.dtype == torch.int32
        assert torch.equal(num_splits, torch.arange(b + 1, dtype=torch.int32))
        assert sorted(order.tolist()) == list(range(b))
        cost = ((rows if by_rows else nb) + charge).tolist()
        seen, loads = [], []
        for begin, end, b0, b1, *rest in tile_md.tolist():
            assert rest == [0, 0, 0, 0] and b0 == 0
            if begin == b:
                assert (end, b1) == (b - 1, 0)
                loads.append(0)
                continue
            assert begin <= end and b1 == nb[order[end]]
            seen += range(begin, end + 1)
            loads.append(sum(cost[r] for r in order[begin:end + 1].tolist()))
        assert seen == list(range(b))
        assert max(loads) <= min(loads) + max(cost)


def test_balanced_cut_weighs_rows_not_blocks():
    """A balanced V4 plan's schedule deals the requests by the rows inside their lengths, which the
    kernel's compacted tiles follow (the main and extra lists share a request's tiles): on the
    benchmark's lengths (uniform, main 128, extra 512; b=512 over 132 partitions) the partitions'
    rows lie within 4 % of their mean and their whole tiles within 8 %, where a deal by blocks
    leaves the rows over 8 % above it."""
    from cute_mla.plan.schedule import device_blocks_and_rows, make_schedule

    cpu = torch.device("cpu")
    p = _v4(512, 1, 8, "sm_90a", 132, extra_topk=512, has_topk_length=True, has_extra_topk_length=True)
    assert p.schedule == "balanced" and p.num_sm_parts == 132
    g = torch.Generator().manual_seed(3)
    tl = torch.randint(1, 129, (512,), generator=g, dtype=torch.int32)
    etl = torch.randint(1, 513, (512,), generator=g, dtype=torch.int32)
    nb, rows = device_blocks_and_rows(tl, 128, 512, cpu, 512, etl)
    tiles = (rows + 63) // 64

    def spread(order, tile_md, per_request):
        loads = [int(per_request[order[begin:end + 1].long()].sum()) for begin, end in tile_md[:, :2].tolist()]
        mean = sum(loads) / len(loads)
        return max(loads) / mean, min(loads) / mean

    s = make_schedule(p, cpu, tl, etl)
    assert s.tile_md[:, 3].tolist() == nb[s.request_order[s.tile_md[:, 1].long()].long()].tolist()
    hi, lo = spread(s.request_order, s.tile_md, rows)
    assert hi < 1.04 and lo > 0.95, (hi, lo)
    hi, lo = spread(s.request_order, s.tile_md, tiles)
    assert hi < 1.08 and lo > 0.92, (hi, lo)
    tile_md, _, order = balanced_schedule_device(nb, 132)
    assert spread(order, tile_md, rows)[0] > 1.08


def test_balanced_schedule_fixes_what_the_lengths_do_not():
    """The balanced cut's position ranges, num_splits and zero offsets do not depend on the lengths:
    views of one cached upload per (b, partitions) (stable addresses for CUDA graphs); what does is
    a dozen ops (it was ~48 before they were cached; a graph node costs ~2-3 us on the H100)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cute_mla.plan.schedule import BalancedDeal, balanced_tables

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += func.overloadpacket.__name__ not in ("view", "select", "slice")
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(7)
    b, parts = 512, 66
    first = balanced_schedule_device(torch.randint(3, 19, (b,), generator=g, dtype=torch.int32), parts)
    nb = torch.randint(3, 19, (b,), generator=g, dtype=torch.int32)
    with Count():
        second = balanced_schedule_device(nb, parts)
    assert Count.ops <= 13
    assert second[1].data_ptr() == first[1].data_ptr()        # num_splits: the cached table
    assert torch.equal(first[0][:, :3], second[0][:, :3])     # begin_req, end_req, begin_block
    deal = BalancedDeal(b, parts)
    assert (deal.rounds, deal.last) == (7, 50)
    assert [deal.count(k) for k in (0, 49, 50, 65)] == [8, 8, 7, 7] and deal.begin(50) == 400
    views = balanced_tables(b, parts, torch.device("cpu")).views
    assert views["offsets"].tolist() == [0] * (b + 1) and views["num_splits"].tolist() == list(range(b + 1))


def test_list_lengths_fit_the_extra_offset():
    """SM90 carries extra-list positions offset by EXTRA_BASE in int32: every main position lies
    below it and every offset extra position below 2^31 (plan.MAX_TOPK bounds both lists)."""
    from cute_mla.kernels.sm90.index_scan import EXTRA_BASE
    from cute_mla.plan.sparse_decode import MAX_TOPK

    assert MAX_TOPK <= EXTRA_BASE and EXTRA_BASE + MAX_TOPK <= 2**31 - 1


@pytest.mark.parametrize("cc,arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), None), ((9, 1), None),
                                     ((12, 0), None), ((8, 0), None)])
def test_device_arch_is_exact(monkeypatch, cc, arch):
    """An 'a' target's features exist only on its own compute capability: sm_90a on 9.0 and
    sm_100a on 10.0; a B300 (10.3) or an RTX Blackwell (12.0) gets a clear refusal, not kernels
    that do not load."""
    from types import SimpleNamespace

    from cute_mla import archs

    monkeypatch.setattr(archs, "_props", lambda device: SimpleNamespace(major=cc[0], minor=cc[1], name="a GPU"))
    if arch is not None:
        assert archs.device_spec(torch.device("cuda", 0)).name == arch
    else:
        with pytest.raises(archs.UnsupportedDeviceError, match=rf"Hopper \(9\.0\) and Blackwell \(10\.0\); "
                                                                rf"a GPU is compute capability {cc[0]}\.{cc[1]}"):
            archs.device_spec(torch.device("cuda", 0))
