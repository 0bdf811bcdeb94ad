import random

import pytest
import torch

from cute_mla.plan.policy import default_policy
from cute_mla.scheduler import (accum_offsets, accum_offsets_device, blocks_of_length, blocks_per_request, max_accum_rows,
                                num_sm_parts, plan_splits, plan_splits_host)


def pieces(num_blocks, sched):
    """(request, first_block, end_block, split_idx, split_flag) of every partition's work."""
    b = len(num_blocks)
    out = []
    for row in sched.rows:
        br, er, bb, eb, bs, fs, ls, _ = row
        if br >= b:
            continue
        for r in range(br, er + 1):
            lo = bb if r == br else 0
            hi = eb if r == er else num_blocks[r]
            flag = (r == br and fs) or (r == er and ls)
            out.append((r, lo, hi, bs if r == br else 0, bool(flag)))
    return out


def check_invariants(num_blocks, P, F=5):
    s = plan_splits_host(num_blocks, P, F)
    b = len(num_blocks)
    assert len(s.rows) == P and len(s.num_splits) == b + 1 and s.num_splits[0] == 0
    ps = pieces(num_blocks, s)
    # every block of every request covered exactly once, in order
    for r in range(b):
        mine = [p for p in ps if p[0] == r]
        assert mine, f"request {r} is never processed"
        assert mine[0][1] == 0 and mine[-1][2] == num_blocks[r]
        for a, c in zip(mine, mine[1:]):
            assert a[2] == c[1], f"request {r}: gap or overlap between pieces"
        for p in mine:
            assert p[1] < p[2], f"request {r}: empty piece {p}"
        n = s.num_splits[r + 1] - s.num_splits[r]
        assert n == len(mine), f"request {r}: num_splits says {n} pieces, partitions hold {len(mine)}"
        # the flags match the ranges, split indices count 0..n-1
        assert all(p[4] == (n > 1) for p in mine)
        assert [p[3] for p in mine] == list(range(n)) if n > 1 else True
    assert s.num_splits[b] <= b + P - 1
    off = accum_offsets(s.num_splits)
    assert off[b] == s.split_rows <= max_accum_rows(P, b)
    if P == 1:
        assert not s.any_split and s.split_rows == 0
    return s


def test_worked_example():
    # SM90, 132 SMs, h=64, b=1, s_q=10, topk=2048 -> P=13, 32 blocks, payload 8, 11 splits
    P = num_sm_parts(132, 10, 64, per_head_block=True)
    assert P == 13
    s = check_invariants(blocks_per_request(2048, b=1), P)
    assert s.num_splits == (0, 11)
    assert [r[2:4] for r in s.rows[:11]] == [(3 * i, min(3 * i + 3, 32)) for i in range(11)]
    assert all(r[0] == 1 for r in s.rows[11:]), "trailing partitions are empty (begin_req == b)"


def test_num_sm_parts_table():
    sm90, sm100 = default_policy("sm_90a"), default_policy("sm_100a")
    assert sm90.num_sm_parts(132, 1, 64) == 132
    assert sm90.num_sm_parts(132, 1, 128) == 66
    assert sm90.num_sm_parts(132, 66, 64) == 2 and sm90.num_sm_parts(132, 67, 64) == 1
    assert sm90.num_sm_parts(132, 33, 128) == 2 and sm90.num_sm_parts(132, 34, 128) == 1
    assert sm100.num_sm_parts(148, 74, 64) == 2 and sm100.num_sm_parts(148, 75, 64) == 1
    assert sm100.num_sm_parts(148, 1, 128) == 148   # FlashMLA's head64 kernel: heads do not divide
    with pytest.raises(ValueError, match="arch"):
        default_policy("sm_80")
    with pytest.raises(ValueError, match="num_sms"):
        num_sm_parts(0, 1, 64, per_head_block=True)


@pytest.mark.parametrize("trial", range(40))
def test_random_invariants(trial):
    rnd = random.Random(trial)
    b = rnd.choice([1, 2, 3, 7, 64, 321, 1000])
    P = rnd.choice([1, 2, 13, 66, 132])
    nb = [rnd.randint(1, rnd.choice([1, 4, 32, 256])) for _ in range(b)]
    check_invariants(nb, P, rnd.choice([5, 3, 1, 0]))   # FlashMLA's charge, others, SM90 V4's and the zero rule's


def test_p1_never_splits_any_lengths():
    rnd = random.Random(0)
    for _ in range(20):
        nb = [rnd.randint(1, 300) for _ in range(rnd.randint(1, 50))]
        s = plan_splits_host(nb, 1)
        assert s.num_splits == tuple(range(len(nb) + 1))
        assert all(r[5] == 0 and r[6] == 0 for r in s.rows)


def test_tensor_api_cpu_matches_host():
    nb = torch.tensor([32, 1, 7, 64, 3], dtype=torch.int32)
    md, ns = plan_splits(nb, 13)
    s = plan_splits_host(nb.tolist(), 13)
    assert md.dtype == torch.int32 and md.shape == (13, 8) and ns.shape == (6,)
    assert md.tolist() == [list(r) for r in s.rows] and ns.tolist() == list(s.num_splits)
    assert accum_offsets_device(ns).tolist() == list(accum_offsets(s.num_splits))


def test_plan_splits_rejects_bad_input():
    with pytest.raises(ValueError, match="num_blocks: expected a 1-D int32 tensor"):
        plan_splits(torch.ones(3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="num_sm_parts"):
        plan_splits(torch.ones(3, dtype=torch.int32), 0)


def test_blocks_per_request():
    assert blocks_per_request(2048, b=3) == [32, 32, 32]
    assert blocks_per_request(2048, [0, 1, 64, 65, 2048, 5000]) == [1, 1, 1, 2, 32, 32]


def test_blocks_of_length_one_rule_for_ints_and_tensors():
    """The topk_length rule (FlashMLA's: the length clamped to [0, topk], at least one block) gives
    the same blocks for Python ints (the plan) and int32 tensors (the device schedule), negative and
    oversized lengths included."""
    import torch

    from cute_mla.plan.schedule import device_num_blocks

    topk = 2048
    lengths = [-(2 ** 31), -65, -64, -1, 0, 1, 63, 64, 65, 127, 128, 1000, 2047, 2048, 2049, 2 ** 31 - 1]
    flashmla = [(max(min(max(n, 0), topk), 1) - 1) // 64 + 1 for n in lengths]
    assert [blocks_of_length(n, topk)[1] for n in lengths] == flashmla
    assert device_num_blocks(torch.tensor(lengths, dtype=torch.int32), topk, len(lengths), torch.device("cpu")).tolist() == flashmla
    assert [blocks_of_length(n, topk)[0] for n in (5000, 100, -3)] == [2048, 100, -3]   # positions >= it are invalid
