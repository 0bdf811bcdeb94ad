"""GPU: the V4 cache format ("MODEL1", d_qk 512, 584 B/token) and its extra KV pool through the
public API, against the fp32 reference (FlashMLA's d_qk=512 sweep and tolerances).

Inputs in FlashMLA's test style (cute_mla.testing.make_inputs): NaN bytes in every data row and
scale row of both pools that no valid index reads, -1 and out-of-range indices, sinks of N(0,1),
+inf and -inf, random topk_length / extra_topk_length including 0, all-invalid rows, page block
sizes 2, 53 and 64 with an extra pool of another page block size, page blocks padded to a
multiple of 576 B. h_q 64 and 128, s_q 1-4 (a few longer), b 1-512, top-k 64 / 128 / 576 with
extra_topk 0 / 512 / 1024.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cute_mla import flash_mla_with_kvcache, get_mla_metadata, plan_sparse_decode
from cute_mla.archs import device_arch, device_num_sms
from cute_mla.testing import (check_allclose, check_out_lse, held_workspace_bytes, make_inputs,
                              step_first_and_later_bytes, v4_sweep_inputs)
from _decode_heads import DECODE_HEADS, require_heads

pytestmark = pytest.mark.gpu


def run_case(x, out=None, sched=None):
    sched = get_mla_metadata()[0] if sched is None else sched
    o, l = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, out=out, **x.call_kwargs())
    return o, l, sched


def check(x, o, l):
    ro, rl = x.reference()
    torch.cuda.synchronize()
    check_out_lse(o, l, ro, rl)


# (b, s_q, topk, pool tokens, page block, extra_topk, extra pool tokens, extra page block, topk_length,
#  extra_topk_length, all-invalid rows)
SWEEP = [
    (1, 1, 128, 512, 64, 0, 0, 0, False, False, 0),
    (1, 1, 128, 512, 64, 512, 1024, 2, True, True, 0),
    (1, 2, 128, 1024, 53, 1024, 2046, 64, False, True, 0),
    (1, 4, 128, 512, 2, 1024, 2046, 53, True, True, 1),
    (2, 1, 576, 1024, 53, 1024, 1024, 2, True, False, 0),
    (4, 1, 64, 512, 2, 0, 0, 0, True, False, 1),
    (4, 3, 128, 512, 64, 512, 1024, 53, True, False, 1),
    (4, 4, 576, 1024, 53, 512, 512, 2, True, True, 0),
    (8, 2, 64, 512, 2, 512, 1024, 53, False, True, 2),
    (16, 1, 128, 1024, 64, 512, 512, 53, True, True, 0),
    (32, 1, 128, 2046, 64, 1024, 2046, 2, True, True, 1),
    (32, 2, 128, 1024, 2, 512, 1024, 64, False, False, 0),
    (64, 1, 128, 2046, 64, 1024, 2046, 53, False, False, 0),
    (74, 1, 128, 2046, 64, 512, 1024, 53, True, True, 3),
    (74, 3, 64, 512, 64, 1024, 2046, 2, False, True, 0),
    (74, 3, 576, 1024, 53, 0, 0, 0, True, False, 2),
    (128, 1, 128, 2046, 64, 1024, 2046, 64, True, True, 0),
    (128, 4, 128, 1024, 53, 512, 1024, 2, False, False, 1),
    (148, 1, 128, 2046, 2, 1024, 2046, 53, True, False, 0),
    (321, 1, 128, 2046, 64, 512, 1024, 2, True, True, 2),
    (321, 3, 64, 512, 53, 0, 0, 0, False, False, 0),
    (512, 1, 128, 2046, 64, 1024, 2046, 2, True, True, 0),
    (512, 2, 128, 2046, 64, 512, 1024, 53, False, False, 4),
    (512, 4, 128, 1024, 2, 1024, 2046, 64, True, True, 0),
    # longer s_q: split requests, one partition, and (SM90, b=1) the token walk
    (2, 16, 128, 1024, 53, 1024, 2046, 64, True, True, 1),
    (1, 64, 128, 2046, 64, 512, 2046, 2, False, False, 0),
    (1, 300, 128, 2046, 64, 512, 1024, 53, False, False, 2),
]


def _sweep_id(c):
    b, s_q, topk, _, page, extra, _, epage, tl, etl, empty = c
    return (f"b{b}-s{s_q}-k{topk}-p{page}" + (f"-x{extra}p{epage}" if extra else "")
            + ("-tl" if tl else "") + ("-xtl" if etl else "") + (f"-empty{empty}" if empty else ""))


@pytest.mark.parametrize("h_q", DECODE_HEADS)
@pytest.mark.parametrize("case", SWEEP, ids=[_sweep_id(c) for c in SWEEP])
def test_v4_sweep(seed, h_q, case):
    require_heads(h_q)
    b, s_q, topk, s_k, page, extra, extra_s_k, epage, tl, etl, empty = case
    kw = dict(extra_topk=extra, extra_num_tokens=extra_s_k, extra_page_block_size=epage,
              with_extra_topk_length=etl) if extra else {}
    x = v4_sweep_inputs(seed, b, s_q, h_q, topk, num_tokens=s_k, page_block_size=page, with_topk_length=tl,
               all_invalid_rows=empty, **kw)
    o, l, sched = run_case(x)
    assert sched.plan.d_qk == 512 and sched.plan.extra_topk == extra
    check(x, o, l)


@pytest.mark.parametrize("h_q", DECODE_HEADS)
@pytest.mark.parametrize("b,s_q,extra_topk", [(4, 2, 512), (74, 1, 1024), (1, 3, 0)])
def test_v4_rows_without_valid_tokens(seed, h_q, b, s_q, extra_topk):
    """Rows with no valid token in either list (all -1, out of range, or lengths of 0) give out 0
    and lse +inf, sinks or not; rows whose main list is empty but not their extra list (and the
    reverse) attend the other list only.

    With an extra list, the lengths are given (the NaN bytes go where they leave slots unread):
    request 0 has no main list (so token 0, its extra list made invalid below, has nothing valid),
    the last request no main list and a non-empty extra one, request 1 a main list and no extra one."""
    require_heads(h_q)
    lengths = {}
    if extra_topk:
        g = torch.Generator().manual_seed(seed)
        main = torch.randint(1, 129, (b,), generator=g).tolist()
        extra = torch.randint(1, extra_topk + 1, (b,), generator=g).tolist()
        main[0] = main[-1] = 0
        extra[1] = 0
        lengths = dict(topk_lengths=tuple(main), extra_topk_lengths=tuple(extra))
    else:
        lengths = dict(with_topk_length=True)
    x = v4_sweep_inputs(seed, b, s_q, h_q, 128, num_tokens=1024, page_block_size=53, extra_topk=extra_topk,
                        extra_num_tokens=1024, extra_page_block_size=2, all_invalid_rows=1, **lengths)
    x.indices[0, 0] = -1                                         # request 0, token 0: nothing valid ...
    if extra_topk:
        x.extra_indices[0, 0, ::2] = -1
        x.extra_indices[0, 0, 1::2] = 2**31 - 1                  # ... out of range in the extra pool
    o, l, _ = run_case(x)
    check(x, o, l)
    torch.cuda.synchronize()
    assert torch.isposinf(l[0, :, 0]).all() and (o[0, 0] == 0).all()


@pytest.mark.parametrize("h_q", DECODE_HEADS)
@pytest.mark.parametrize("sink", [math.inf, -math.inf])
def test_v4_infinite_sinks(seed, h_q, sink):
    """Sink +inf: out exactly 0 (lse unchanged); -inf: as if no sink was given."""
    require_heads(h_q)
    x = v4_sweep_inputs(seed, 8, 2, h_q, 128, num_tokens=2046, extra_topk=512, extra_num_tokens=1024,
               extra_page_block_size=53, with_topk_length=True, with_extra_topk_length=True)
    x.attn_sink = torch.full((h_q,), sink, device="cuda")
    o, l, _ = run_case(x)
    check(x, o, l)
    o0, l0, _ = run_case(dataclasses.replace(x, attn_sink=None))
    torch.cuda.synchronize()
    check_allclose("lse", l, l0, abs_tol=1e-6, rel_tol=8.01 / 65536)      # the sink leaves lse alone
    if sink == math.inf:
        assert (o == 0).all()
    else:
        check_out_lse(o, l, o0.float(), l0)


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("b,s_q,extra_topk", [(4, 2, 1024), (128, 1, 512)])
def test_v4_preallocated_out(seed, h_q, b, s_q, extra_topk):
    """``out=``: a strided view of a larger NaN-filled buffer is written in place and returned."""
    x = v4_sweep_inputs(seed, b, s_q, h_q, 128, num_tokens=2046, extra_topk=extra_topk, extra_num_tokens=2046,
               extra_page_block_size=2, with_topk_length=True, with_extra_topk_length=True)
    big = torch.full((b, s_q, h_q, 640), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, l, _ = run_case(x, out=big[..., :512])
    assert o.data_ptr() == big.data_ptr() and o.shape == (b, s_q, h_q, 512)
    check(x, o, l)
    assert torch.isnan(big[..., 512:]).all()


@pytest.mark.parametrize("b,s_q,h_q,extra_topk,lengths", [
    (128, 1, 64, 512, False), (512, 1, 128, 1024, False), (4, 200, 64, 1024, False), (1, 300, 128, 512, False),
    (64, 2, 64, 512, True), (1, 1, 64, 1024, False), (2, 4, 128, 512, False), (32, 1, 128, 1024, True),
    (128, 1, 128, 512, True),
])
def test_v4_workspace_follows_the_plan(seed, b, s_q, h_q, extra_topk, lengths):
    """An unsplit plan allocates no accumulators (nothing beyond out and lse); a split plan exactly
    its accumulator rows (the caching allocator rounds to 512-B blocks)."""
    x = v4_sweep_inputs(seed, b, s_q, h_q, 128, num_tokens=4096, extra_topk=extra_topk, extra_num_tokens=4096,
               extra_page_block_size=2, with_topk_length=lengths, with_extra_topk_length=lengths,
               unique=False, nan_unused=False)
    dev = torch.device("cuda")
    want = plan_sparse_decode(b, s_q, h_q, 512, 128, arch=device_arch(dev), num_sms=device_num_sms(dev),
                              has_topk_length=lengths, extra_topk=extra_topk, has_extra_topk_length=lengths)
    transient, later, sched = step_first_and_later_bytes(x)
    plan = sched.plan
    assert plan == want and held_workspace_bytes(sched) == plan.workspace_bytes
    if not plan.split:
        assert plan.workspace_bytes == 0 and transient <= 2**20 and later <= 2**20
    else:
        # the step's first call allocates the accumulators and keeps them; its later calls reuse them
        assert plan.workspace_bytes <= transient <= plan.workspace_bytes + 2 * 512 + 4096
        assert later < 4096
        assert plan.workspace_bytes < plan.flashmla_workspace_bytes


@pytest.mark.parametrize("h_q, b, extra_topk", [(128, 396, 512), (128, 600, 512), (128, 400, 1024), (8, 396, 512),
                                                 (16, 512, 1024)])
def test_v4_balanced_whole_requests(seed, h_q, b, extra_topk):
    """An extra list of 512 or 1024 and lengths from six waves of CTAs up at h_q = 128 (three at 8
    and 16 heads, the swap-AB tile): the balanced plan (whole requests dealt by their rows into one wave
    of partitions on the device, walked through a request order) gives the reference's answer,
    eagerly and with the schedule made inside a CUDA-graph capture."""
    x = v4_sweep_inputs(seed, b, 1, h_q, 128, num_tokens=2046, page_block_size=64, with_topk_length=True,
                        extra_topk=extra_topk, extra_num_tokens=1024, extra_page_block_size=53,
                        with_extra_topk_length=True, all_invalid_rows=2)
    o, l, sched = run_case(x)
    if device_arch(torch.device("cuda")) == "sm_90a":
        assert sched.plan.schedule == "balanced" and not sched.plan.split
        order = sched.schedule.request_order
        # the order is not the identity (the test would not tell a kernel that ignores it)
        assert sorted(order.tolist()) == list(range(b)) and order.tolist() != list(range(b))
    check(x, o, l)
    # a fresh metadata object's first call captured: the schedule's torch ops replay with the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o2, l2, _ = run_case(x, sched=get_mla_metadata()[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o2, o) and torch.equal(l2.nan_to_num(7.0), l.nan_to_num(7.0))


@pytest.mark.parametrize("b,s_q,h_q,lengths", [(1, 1, 64, True), (8, 2, 128, True), (128, 1, 64, False)])
def test_v4_cuda_graph_replay_with_new_inputs(seed, b, s_q, h_q, lengths):
    """A captured V4 call with an extra pool replays on new q, indices and caches (same lengths)."""
    g = torch.Generator().manual_seed(seed)
    opts = dict(num_tokens=2046, page_block_size=64, extra_topk=1024, extra_num_tokens=2046, extra_page_block_size=53)
    x = make_inputs(b, s_q, h_q, 128, d_qk=512, device="cuda", generator=g, with_sink=True,
                    with_topk_length=lengths, with_extra_topk_length=lengths, **opts)
    sched, _ = get_mla_metadata()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run_case(x, sched=sched)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, l, _ = run_case(x, sched=sched)
    for _ in range(3):
        y = make_inputs(b, s_q, h_q, 128, d_qk=512, device="cuda", generator=g, nan_unused=False, **opts)
        for dst, src in ((x.q, y.q), (x.indices, y.indices), (x.extra_indices, y.extra_indices),
                         (x.k_cache, y.k_cache), (x.extra_k_cache, y.extra_k_cache)):
            dst.copy_(src)
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(x, o, l)
