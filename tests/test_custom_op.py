"""The ``torch.library`` ops a traced call goes through (``cute_mla.interface.ops``).

CPU: ``torch.compile(fullgraph=True)`` traces the public API with fake CUDA tensors (no GPU, no
launch): the graph holds the two ops, the outputs have FlashMLA's shapes, dtypes and strides, and a
bad input is still refused by name. GPU: a compiled module equals the eager call, also under CUDA
graphs (``mode="reduce-overhead"``) with lengths that change between replays.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_mla
from cute_mla.interface import ops
from cute_mla.plan import plan_sparse_decode
from cute_mla.plan.schedule import make_schedule, order_view, schedule_sizes, schedule_views

from _trace_helpers import Recorder, fake_cuda


def _call(q, cache, idx, topk_length=None, sink=None, xcache=None, xidx=None, xlen=None, out=None, scale=None):
    sched, _ = cute_mla.get_mla_metadata()
    return cute_mla.flash_mla_with_kvcache(q, cache, None, None, 512, sched, softmax_scale=scale, is_fp8_kvcache=True,
                                           indices=idx, topk_length=topk_length, attn_sink=sink, extra_k_cache=xcache,
                                           extra_indices_in_kvcache=xidx, extra_topk_length=xlen, out=out)


CASES = {
    # name: (b, s_q, h_q, d_qk, row bytes, topk, with topk_length, with sink, extra_topk, with out)
    "v32": (2, 1, 64, 576, 656, 128, False, False, 0, False),
    "v32-lengths-sink": (3, 2, 128, 576, 656, 2048, True, True, 0, False),
    "v32-token-walk": (1, 64, 64, 576, 656, 2048, False, False, 0, True),
    "v4-extra": (4, 2, 128, 512, 584, 128, True, True, 512, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_traced_call_has_flashmla_shapes(fake_sm90, case):
    b, s_q, h_q, d_qk, row, topk, lengths, sink, extra_topk, with_out = CASES[case]
    mode = FakeTensorMode()
    i32, u8 = torch.int32, torch.uint8
    args = dict(q=fake_cuda((b, s_q, h_q, d_qk), torch.bfloat16, mode), cache=fake_cuda((100, 64, 1, row), u8, mode),
                idx=fake_cuda((b, s_q, topk), i32, mode))
    if lengths:
        args["topk_length"] = fake_cuda((b,), i32, mode)
    if sink:
        args["sink"] = fake_cuda((h_q,), torch.float32, mode)
    if extra_topk:
        args.update(xcache=fake_cuda((50, 2, 1, row), u8, mode), xidx=fake_cuda((b, s_q, extra_topk), i32, mode),
                    xlen=fake_cuda((b,), i32, mode))
    if with_out:
        args["out"] = fake_cuda((b, s_q, h_q, 512), torch.bfloat16, mode)
    rec = Recorder()
    compiled = torch.compile(_call, fullgraph=True, backend=rec)
    with mode:
        out, lse = compiled(**args)
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
    assert lse.shape == (b, h_q, s_q) and lse.dtype == torch.float32
    assert lse.stride() == (s_q * h_q, 1, h_q)          # FlashMLA's: a transposed view of (b, s_q, h_q)
    if with_out:
        assert out is args["out"]
    assert rec.targets().count("cute_mla.sparse_decode_schedule") == 1
    assert rec.targets().count("cute_mla.sparse_decode") == 1


def test_traced_call_with_dynamic_shapes(fake_sm90):
    """A dynamic-shape trace specializes the plan's sizes (the fake implementations guard them)."""
    rec = Recorder()
    compiled = torch.compile(_call, fullgraph=True, backend=rec, dynamic=True)
    for b in (2, 3, 5):
        mode = FakeTensorMode()
        q = fake_cuda((b, 1, 64, 576), torch.bfloat16, mode)
        cache, idx = fake_cuda((100, 64, 1, 656), torch.uint8, mode), fake_cuda((b, 1, 128), torch.int32, mode)
        with mode:
            out, lse = compiled(q, cache, idx)
        assert out.shape == (b, 1, 64, 512) and lse.shape == (b, 64, 1)


@pytest.mark.parametrize("bad, message", [
    (dict(q_dtype=torch.float32), "q: got dtype torch.float32"),
    (dict(idx_dtype=torch.int64), "indices: got dtype torch.int64"),
    (dict(row=600), "k_cache"),
])
def test_traced_call_refuses_bad_input(fake_sm90, bad, message):
    """Under fullgraph the API's checks run in the trace: the error names the argument."""
    mode = FakeTensorMode()
    q = fake_cuda((2, 1, 64, 576), bad.get("q_dtype", torch.bfloat16), mode)
    cache = fake_cuda((100, 64, 1, bad.get("row", 656)), torch.uint8, mode)
    idx = fake_cuda((2, 1, 128), bad.get("idx_dtype", torch.int32), mode)
    compiled = torch.compile(_call, fullgraph=True, backend=Recorder())
    with mode, pytest.raises(Exception, match=message):
        compiled(q, cache, idx)


def test_device_facts_are_a_trace_constant_without_importing_dynamo():
    """The trace reads (arch, SM count) once, as a constant; marking it so must not import
    torch._dynamo into every process that imports cute_mla (1.2 s), so ops.py sets the marker
    assume_constant_result sets: a torch that marks differently fails here."""
    def probe():
        return 0

    marked = torch.compiler.assume_constant_result(probe)
    assert vars(marked) == {"_dynamo_marked_constant": True}
    assert vars(ops.device_facts).get("_dynamo_marked_constant") is True
    code = "import sys, cute_mla; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_ops_declare_out_mutated():
    schema = torch.ops.cute_mla.sparse_decode.default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["out"]
    assert not any(a.alias_info for a in torch.ops.cute_mla.sparse_decode_schedule.default._schema.arguments)


@pytest.mark.parametrize("b, s_q, h_q, topk, lengths, extra_topk, schedule", [
    (2, 1, 64, 2048, False, 0, "host"),             # host schedule, split
    (1, 64, 64, 2048, False, 0, "host"),            # token walk
    (128, 1, 64, 128, True, 512, "per_request"),    # per request (device lengths)
    (32, 1, 128, 128, True, 512, "device"),         # device scheduler
    (512, 1, 128, 128, True, 512, "balanced"),      # whole requests dealt (device lengths, torch ops, an order)
    (3, 2, 64, 2048, True, 0, "device"),
])
def test_packed_schedule_size_matches_the_fake(b, s_q, h_q, topk, lengths, extra_topk, schedule):
    """The fake schedule's length is what the real op returns (host schedules on the CPU; device
    ones by the torch-op scheduler where it runs on the CPU, else from the plan's fields)."""
    d_qk = 512 if extra_topk else 576
    plan = plan_sparse_decode(b, s_q, h_q, d_qk, topk, arch="sm_90a", num_sms=132, has_topk_length=lengths,
                              extra_topk=extra_topk, has_extra_topk_length=bool(extra_topk))
    assert plan.schedule == schedule
    p, n = schedule_sizes(plan)
    q = torch.empty(b, s_q, h_q, d_qk, dtype=torch.bfloat16)
    cache = torch.empty(1, 64, 1, 584 if extra_topk else 656, dtype=torch.uint8)
    fake = ops._schedule_fake(q, cache, torch.empty(b, dtype=torch.int32) if lengths else None,
                              torch.empty(b, dtype=torch.int32) if extra_topk else None, topk, extra_topk, "sm_90a", 132)
    assert fake.shape == (p * 8 + 2 * n + (b if plan.orders_requests else 0),) and fake.dtype == torch.int32
    if plan.host_schedule is not None:
        s = make_schedule(plan, torch.device("cpu"), None)
        packed = s.upload.dev
        tile_md, num_splits, offsets = schedule_views(plan, packed)
        assert torch.equal(tile_md, s.tile_md) and torch.equal(num_splits, s.num_splits)
        assert torch.equal(offsets, s.accum_offsets) and packed.numel() == fake.numel()
    elif plan.schedule == "per_request":
        assert (p, n) == (b, b + 1)
    else:
        assert (p, n) == (plan.num_sm_parts, b + 1)
    if plan.schedule in ("per_request", "balanced"):
        # the torch-op schedulers run on the CPU: the real op's schedule has the fake's length
        lens = torch.randint(1, topk + 1, (b,), dtype=torch.int32)
        extra_lens = torch.randint(1, extra_topk + 1, (b,), dtype=torch.int32) if extra_topk else None
        real = ops._schedule_impl(q, cache, lens, extra_lens, topk, extra_topk, "sm_90a", 132)
        assert real.shape == fake.shape and real.dtype == torch.int32
        order = order_view(plan, real)
        assert (order is None) == (not plan.orders_requests)
        if order is not None:
            # the order section is where order_view reads it: the schedule's own order
            s = make_schedule(plan, torch.device("cpu"), lens, extra_lens)
            assert torch.equal(order, s.request_order) and sorted(order.tolist()) == list(range(b))
            assert torch.equal(schedule_views(plan, real)[0], s.tile_md)


def test_the_op_checks_what_a_trace_cannot(monkeypatch):
    """Base pointers, neg bits, out apart from the inputs and the schedule's size are checked by the
    op on the real tensors, before any launch; a direct call of the op also gets the API's tensor
    checks (a cache whose stride(0) does not hold its page block)."""
    from cute_mla.interface import api

    monkeypatch.setattr(api, "_require_cuda", lambda q: None)    # CPU tensors reach the later checks
    q = torch.zeros(2 * 64 * 576 + 8, dtype=torch.bfloat16)[8:].view(2, 1, 64, 576)   # 16-byte aligned
    cache = torch.zeros(10, 64, 1, 656, dtype=torch.uint8)
    idx, out = torch.zeros(2, 1, 128, dtype=torch.int32), torch.zeros(2, 1, 64, 512, dtype=torch.bfloat16)

    def decode(q=q, cache=cache, out=out, schedule=torch.zeros(8, dtype=torch.int32)):
        return ops._decode_impl(q, cache, idx, None, None, None, None, None, schedule, out, 0.1, "sm_90a", 132)

    with pytest.raises(ValueError, match="^q: the data pointer must be 16-byte aligned"):
        decode(q=torch.zeros(2 * 64 * 576 + 1, dtype=torch.bfloat16)[1:].view(2, 1, 64, 576))
    with pytest.raises(ValueError, match="^k_cache: base pointer"):
        decode(cache=torch.zeros(10 * 64 * 656 + 1, dtype=torch.uint8)[1:].view(10, 64, 1, 656))
    with pytest.raises(ValueError, match="^out: a lazily negated view"):
        decode(out=torch._neg_view(out))
    short = torch.zeros(10 * 64 * 656, dtype=torch.uint8).as_strided((10, 64, 1, 656), (64 * 600, 656, 656, 1))
    with pytest.raises(ValueError, match=r"^k_cache: stride\(0\) of 38400 bytes does not hold a page block"):
        decode(cache=short)
    with pytest.raises(ValueError, match="^out: its memory .* overlaps k_cache's"):
        decode(out=cache.view(-1)[:2 * 64 * 512 * 2].view(torch.bfloat16).view(2, 1, 64, 512))
    with pytest.raises(ValueError, match=r"^schedule: expected this call's packed schedule, \(\d+,\) int32"):
        decode()   # 8 ints: not this plan's
    with pytest.raises(ValueError, match="^out: its memory .* overlaps q's"):   # a signature seen just before
        decode(out=q.reshape(-1)[:2 * 64 * 512].view(2, 1, 64, 512))


# ------------------------------------------------------------------------------------------- GPU


class _Attention(torch.nn.Module):
    """A small module whose forward calls the public API, as an engine's attention layer does."""

    def forward(self, q, cache, idx, topk_length, sink, xcache, xidx, xlen):
        o, l = _call(q, cache, idx, topk_length, sink, xcache, xidx, xlen, scale=q.shape[-1] ** -0.55)
        return o * 2, l


def _gpu_inputs(b, s_q, h_q, topk, d_qk, extra_topk, lengths, nan_unused=True):
    from cute_mla.testing import make_inputs

    x = make_inputs(b, s_q, h_q, topk, num_tokens=4096, page_block_size=64, with_sink=True, with_topk_length=lengths,
                    d_qk=d_qk, extra_topk=extra_topk, with_extra_topk_length=bool(extra_topk) and lengths,
                    nan_unused=nan_unused, device="cuda")
    return [x.q, x.k_cache, x.indices, x.topk_length, x.attn_sink, x.extra_k_cache, x.extra_indices,
            x.extra_topk_length]


GPU_CASES = [(1, 1, 64, 2048, 576, 0, False), (4, 2, 128, 2048, 576, 0, True), (1, 64, 64, 2048, 576, 0, False),
             (32, 1, 128, 128, 512, 512, True), (128, 1, 64, 128, 512, 1024, True),
             (400, 1, 128, 128, 512, 1024, True)]   # the last: the balanced cut (a request order in the schedule)


@pytest.mark.gpu
@pytest.mark.parametrize("b, s_q, h_q, topk, d_qk, extra_topk, lengths", GPU_CASES)
def test_compiled_equals_eager(seed, b, s_q, h_q, topk, d_qk, extra_topk, lengths):
    torch._dynamo.reset()
    args = _gpu_inputs(b, s_q, h_q, topk, d_qk, extra_topk, lengths)
    module = _Attention()
    eager_o, eager_l = module(*args)
    compiled = torch.compile(module, fullgraph=True)
    o, l = compiled(*args)
    torch.cuda.synchronize()
    # the same plan, schedule and kernels: bit for bit
    assert torch.equal(o, eager_o) and torch.equal(l, eager_l)


@pytest.mark.gpu
@pytest.mark.parametrize("b, s_q, h_q, topk, d_qk, extra_topk, lengths", [GPU_CASES[1], GPU_CASES[3], GPU_CASES[5]])
def test_compiled_under_cuda_graphs_follows_new_lengths(monkeypatch, seed, b, s_q, h_q, topk, d_qk, extra_topk, lengths):
    """``mode="reduce-overhead"`` replays a CUDA graph: the schedule made in the graph reads the
    lengths of each replay (the metadata object is not what a graph reads). The schedule cache
    starts empty, so its entries (the balanced cut's tables) are first made inside the cudagraph
    trees' warm-up, whatever ran before: they must stay out of the trees' memory pool."""
    from cute_mla.plan import schedule

    monkeypatch.setattr(schedule, "_host_schedules", {})
    torch._dynamo.reset()
    # no NaN in the slots the first lengths leave unused: the new lengths make them valid
    args = _gpu_inputs(b, s_q, h_q, topk, d_qk, extra_topk, lengths, nan_unused=False)
    module = _Attention()
    compiled = torch.compile(module, fullgraph=True, mode="reduce-overhead")
    for step in range(4):
        args[3].copy_(torch.randint(0, topk + 1, (b,), dtype=torch.int32, device="cuda"))
        if args[7] is not None:
            args[7].copy_(torch.randint(0, extra_topk + 1, (b,), dtype=torch.int32, device="cuda"))
        o, l = compiled(*args)
        eager_o, eager_l = module(*args)
        torch.cuda.synchronize()
        assert not o.isnan().any()
        assert torch.equal(o, eager_o) and torch.equal(l, eager_l), f"replay {step}"


@pytest.mark.gpu
def test_schedule_cache_buffers_stay_out_of_graph_pools():
    """A schedule cache entry's device buffer is allocated outside the pool that this thread's
    allocations are routed to: a memory pool in use (as during a cudagraph tree's warm-up, which
    routes them without capturing) or a capture's private pool (a global-mode capture, where the
    allocation may need a cudaMalloc: the large buffer)."""
    from cute_mla.plan import schedule

    def pool_of(t):
        for seg in torch.cuda.memory_snapshot():
            if seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"]:
                return tuple(seg["segment_pool_id"])
        raise AssertionError("not in the caching allocator")

    dev = torch.device("cuda")
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        routed = torch.empty(16, dtype=torch.int32, device=dev)
        kept = [schedule._device_buffer(n, dev) for n in (16, 1 << 24)]
    assert pool_of(routed) == tuple(pool.id)
    assert all(pool_of(t) != tuple(pool.id) for t in kept)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [schedule._device_buffer(n, dev) for n in (16, 1 << 24)]
    assert all(pool_of(t) != tuple(graph.pool()) for t in captured)
    assert all(t.device == torch.device("cuda", torch.cuda.current_device()) for t in kept + captured)
