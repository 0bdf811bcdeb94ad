"""End-to-end GPU tests of the public API against the fp32 reference (FlashMLA's sweep and
tolerances), CUDA graph replay, and the workspace rule measured with the allocator."""

import dataclasses

import pytest
import torch

from cute_mla import flash_mla_with_kvcache, get_mla_metadata, plan_sparse_decode
from cute_mla.archs import device_arch, device_num_sms
from cute_mla.reference import sparse_decode_reference
from cute_mla.testing import check_out_lse, held_workspace_bytes, make_inputs, step_first_and_later_bytes
from _decode_heads import DECODE_HEADS, require_heads

pytestmark = pytest.mark.gpu


def run_case(x, out=None, sched=None):
    sched = get_mla_metadata()[0] if sched is None else sched
    o, l = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, softmax_scale=x.softmax_scale,
                                  is_fp8_kvcache=True, indices=x.indices, attn_sink=x.attn_sink,
                                  topk_length=x.topk_length, out=out)
    return o, l, sched


def check(x, o, l):
    ro, rl = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, x.attn_sink, x.topk_length)
    torch.cuda.synchronize()
    check_out_lse(o, l, ro, rl)


SWEEP = [(512, 64, 2), (512, 64, 64), (1024, 576, 61), (2046, 2048, 64), (2046, 2048, 576)]


@pytest.mark.parametrize("h_q", DECODE_HEADS)
@pytest.mark.parametrize("s_k,topk,pbs", SWEEP)
@pytest.mark.parametrize("b", [4, 74, 321])
@pytest.mark.parametrize("s_q", [1, 3])
def test_flashmla_sweep(seed, h_q, s_k, topk, pbs, b, s_q):
    require_heads(h_q)
    x = make_inputs(b, s_q, h_q, topk, num_tokens=s_k, page_block_size=pbs, with_sink=True,
                    out_of_range_frac=0.05, all_invalid_rows=1, device="cuda")
    o, l, _ = run_case(x)
    check(x, o, l)


@pytest.mark.parametrize("h_q", DECODE_HEADS)
@pytest.mark.parametrize("b,s_q,topk", [(4, 1, 2048), (74, 3, 576), (1, 2, 2048), (3, 40, 1024)])
def test_topk_length_and_odd_scales(seed, h_q, b, s_q, topk):
    require_heads(h_q)
    x = make_inputs(b, s_q, h_q, topk, num_tokens=4000, page_block_size=61, with_sink=True, with_topk_length=True,
                    power_of_two_scales=False, out_of_range_frac=0.05, device="cuda")
    o, l, _ = run_case(x)
    check(x, o, l)


# s_q 8192 at h_q 64 only, to keep the GPU run short (h_q 128 reaches 1024 here; the SM90 tests run
# its token walk at 150 tokens and the benchmarks at 8192); 16 heads (a TP8 rank) up to 100,000 tokens.
@pytest.mark.parametrize("s_q,h_q", [(1, 64), (128, 64), (1024, 64), (8192, 64), (1, 128), (128, 128), (1024, 128),
                                     (1, 16), (1024, 8), (8192, 32), (100000, 16)])
def test_mixed_batch(seed, h_q, s_q):
    require_heads(h_q)
    x = make_inputs(1, s_q, h_q, 2048, num_tokens=65536, page_block_size=64, with_sink=(s_q < 1024),
                    unique=False, nan_unused=(s_q <= 128), device="cuda")
    o, l, _ = run_case(x)
    check(x, o, l)


@pytest.mark.parametrize("s_q,h_q", [(300, 64), (150, 128)])
def test_token_walk_matches_one_cta_per_token(seed, s_q, h_q):
    """The token walk (b == 1, more CTAs than SMs: plan docstring) gives the bits of FlashMLA's grid
    of one CTA per (token, head half), here launched directly; also into a preallocated strided
    ``out``, and against the reference with NaN in every unused cache slot."""
    from cute_mla.kernels import SparseDecodeTensors
    from cute_mla.kernels.sm90 import sparse_decode as sd

    if device_arch(torch.device("cuda")) != "sm_90a":
        pytest.skip("SM90 plan")
    x = make_inputs(1, s_q, h_q, 2048, num_tokens=16384, invalid_frac=0.3, with_sink=True, nan_unused=True,
                    device="cuda")
    big = torch.full((1, s_q, h_q, 640), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, l, sched = run_case(x, out=big[..., :512])
    assert sched.plan.token_walk and o.data_ptr() == big.data_ptr()
    check(x, o, l)
    cfg = sd.kernel_config(h_q=h_q, format="V3.2", split=False, has_topk_length=False, has_attn_sink=True)
    tile_md = torch.tensor([[0, 0, 0, 32, 0, 0, 0, 0]], dtype=torch.int32, device="cuda")
    zeros = torch.zeros(2, dtype=torch.int32, device="cuda")
    o1 = torch.full((1, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    l1 = torch.full((1, s_q, h_q), float("nan"), dtype=torch.float32, device="cuda")
    t = SparseDecodeTensors(x.q, x.k_cache.view(torch.uint8).squeeze(2), x.indices, None, x.attn_sink, out=o1, lse=l1,
                            tile_md=tile_md, accum_offsets=zeros, softmax_scale=x.softmax_scale)
    sd.launch(sd.compile(cfg), cfg, t)
    torch.cuda.synchronize()
    assert torch.equal(o, o1) and torch.equal(l, l1.transpose(1, 2))


def test_preallocated_out(seed):
    x = make_inputs(4, 2, 64, 256, num_tokens=1000, device="cuda")
    out = torch.full((4, 2, 64, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, l, _ = run_case(x, out=out)
    assert o.data_ptr() == out.data_ptr()
    check(x, o, l)


def test_out_inside_q_is_refused(seed):
    """An out that shares q's bytes is refused before the launch, also for a signature already
    seen; q is left as it was."""
    x = make_inputs(4, 2, 64, 256, num_tokens=1000, device="cuda")
    sched = get_mla_metadata()[0]
    q0 = x.q.clone()
    run_case(x, out=torch.empty(4, 2, 64, 512, dtype=torch.bfloat16, device="cuda"), sched=sched)
    inside = x.q.view(-1)[:4 * 2 * 64 * 512].view(4, 2, 64, 512)
    with pytest.raises(ValueError, match="^out: its memory .* overlaps q's"):
        run_case(x, out=inside, sched=sched)
    torch.cuda.synchronize()
    assert torch.equal(x.q, q0)


@pytest.mark.parametrize("b,s_q,h_q,topk_length", [(1, 1, 64, False), (4, 2, 128, False), (128, 1, 64, False), (8, 1, 64, True),
                                                   (1, 200, 128, False)])  # the last: token walk
def test_cuda_graph_replay_with_new_inputs(seed, b, s_q, h_q, topk_length):
    x = make_inputs(b, s_q, h_q, 2048, num_tokens=8192, with_sink=True, with_topk_length=topk_length, device="cuda")
    sched, _ = get_mla_metadata()
    kw = dict(softmax_scale=x.softmax_scale, is_fp8_kvcache=True, attn_sink=x.attn_sink, topk_length=x.topk_length)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, indices=x.indices, **kw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o, l = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, indices=x.indices, **kw)
    for _ in range(3):
        y = make_inputs(b, s_q, h_q, 2048, num_tokens=8192, device="cuda")
        x.q.copy_(y.q)
        x.indices.copy_(y.indices)
        x.k_cache.copy_(y.k_cache)
        o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(x, o, l)


def test_schedule_first_uploaded_during_a_capture(seed):
    """A plan whose first call is captured: its schedule upload is a node of that graph and runs only
    at its replays. Another graph captured before that, and an eager call before that (the captured
    FlashMLASchedMeta itself), must still read the schedule, not memory nobody has written yet; and
    a capture of several layers holds one upload, not one per layer."""
    from cute_mla.plan import schedule

    from cute_mla.kernels.combine import combine_config

    # target: top-k 1536, a plan no other test makes; warm: another plan with the same kernels
    (target, topk), (warm, warm_topk) = ((2, 1, 64), 1536), ((2, 1, 64), 2048)
    dev = torch.device("cuda")
    pt, pw = (plan_sparse_decode(*shape, 576, k, arch=device_arch(dev), num_sms=device_num_sms(dev))
              for shape, k in ((target, topk), (warm, warm_topk)))
    # the same kernels (decode variant and combine), so nothing compiles or loads during the captures
    assert pt.host_schedule is not None and pt != pw
    assert (pt.split, pt.column_pair, pt.accum_dtype) == (pw.split, pw.column_pair, pw.accum_dtype)
    assert (combine_config(pt.arch, 64, False, pt.num_sm_parts, accum_dtype=pt.accum_dtype)
            == combine_config(pw.arch, 64, False, pw.num_sm_parts, accum_dtype=pw.accum_dtype))
    w = make_inputs(*warm, warm_topk, num_tokens=4096, device="cuda")
    run_case(w)
    torch.cuda.synchronize()
    x = make_inputs(*target, topk, num_tokens=4096, device="cuda")
    key = (pt, str(x.q.device))
    schedule._host_schedules.pop(key, None)   # (a rerun in the same process)
    kw = dict(softmax_scale=x.softmax_scale, is_fp8_kvcache=True, indices=x.indices)
    sched_1, _ = get_mla_metadata()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        o1, l1 = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched_1, **kw)
        flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched_1, **kw)   # a second layer
    entry = schedule._host_schedules[key]
    assert len(entry.captures) == 1 and -1 not in entry.captures and not entry.ready and entry.event is None
    with torch.cuda.graph(g2):   # a fresh metadata object: the cached entry, not yet uploaded
        o2, l2 = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, get_mla_metadata()[0], **kw)
    assert len(entry.captures) == 2
    o2.fill_(float("nan"))
    g2.replay()
    torch.cuda.synchronize()
    check(x, o2, l2)
    o, l = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched_1, **kw)   # eager, before g1 ever ran
    check(x, o, l)
    assert entry.event is not None or entry.ready
    o1.fill_(float("nan"))
    g1.replay()
    torch.cuda.synchronize()
    check(x, o1, l1)


@pytest.mark.parametrize("b,s_q,h_q", [(1, 8192, 64), (1, 1024, 128), (128, 1, 64)])
def test_no_split_allocates_nothing(seed, b, s_q, h_q):
    x = make_inputs(b, s_q, h_q, 2048, num_tokens=65536, unique=False, nan_unused=False, device="cuda")
    transient, later, sched = step_first_and_later_bytes(x)
    plan = sched.plan
    assert not plan.split and plan.workspace_bytes == 0 and held_workspace_bytes(sched) == 0
    print(f"b={b} s_q={s_q} h_q={h_q}: transient {transient / 2**20:.3f} MiB (FlashMLA: {plan.flashmla_workspace_bytes / 2**20:.1f} MiB)")
    assert transient <= 2**20 and later <= 2**20


@pytest.mark.parametrize("b,s_q,h_q,tl", [(1, 1, 64, False), (1, 8, 128, False), (16, 2, 128, True)])
def test_split_allocates_what_the_plan_says(seed, b, s_q, h_q, tl):
    x = make_inputs(b, s_q, h_q, 2048, num_tokens=16384, with_topk_length=tl, device="cuda")
    transient, later, sched = step_first_and_later_bytes(x)
    plan = sched.plan
    assert plan.split
    print(f"b={b} s_q={s_q} h_q={h_q} topk_length={tl}: transient {transient / 2**20:.3f} MiB then {later} B, plan "
          f"{plan.workspace_bytes / 2**20:.3f} MiB, FlashMLA {plan.flashmla_workspace_bytes / 2**20:.3f} MiB")
    # the step's first call: the accumulators (rounded up by the caching allocator to 512-byte
    # blocks; a device schedule's few small tensors) and nothing else, kept in the metadata object
    assert plan.workspace_bytes <= transient <= plan.workspace_bytes + 2 * 512 + 4096
    assert held_workspace_bytes(sched) == plan.workspace_bytes
    # the step's later calls reuse them
    assert later < 4096
    assert plan.workspace_bytes <= plan.flashmla_workspace_bytes


def test_schedule_matches_flashmla():
    """Our host and device schedules against the metadata FlashMLA itself builds (vLLM's build).
    Where our SM90 plan charges no per-piece overhead (fewer requests than partitions:
    ``scheduler.partition.fixed_overhead_blocks``) the schedule deliberately differs: there it must
    equal FlashMLA's algorithm run with that charge, on host and device."""
    from cute_mla.scheduler import FIXED_OVERHEAD, SCHED_ROW_INTS, plan_splits_host

    fm = pytest.importorskip("vllm.third_party.flashmla.flash_mla_interface")
    if device_arch(torch.device("cuda")) != "sm_90a":
        pytest.skip("FlashMLA's SM90 schedule")
    for (b, s_q, h_q, tl) in [(1, 1, 64, False), (1, 10, 64, False), (37, 1, 128, False), (300, 2, 64, False)]:
        x = make_inputs(b, s_q, h_q, 2048, num_tokens=8192, with_topk_length=False, device="cuda")
        fsched, _ = fm.get_mla_metadata()
        fm.flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, fsched, softmax_scale=x.softmax_scale,
                                  is_fp8_kvcache=True, indices=x.indices)
        sched, _ = get_mla_metadata()
        flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, softmax_scale=x.softmax_scale,
                               is_fp8_kvcache=True, indices=x.indices)
        got, want = sched.tile_scheduler_metadata[:, :7].cpu(), fsched.tile_scheduler_metadata[:, :7].cpu()
        want_splits = fsched.num_splits.cpu()
        charge = sched.plan.fixed_overhead
        assert charge == (0 if (b, s_q, h_q) == (37, 1, 128) else FIXED_OVERHEAD)
        if charge != FIXED_OVERHEAD:
            # FlashMLA stays the oracle of the algorithm: run with its charge it gives FlashMLA's rows
            fm_host = plan_splits_host([32] * b, sched.plan.num_sm_parts, FIXED_OVERHEAD)
            assert torch.equal(torch.tensor(fm_host.rows, dtype=torch.int32).reshape(-1, SCHED_ROW_INTS)[:, :7], want)
            assert torch.equal(torch.tensor(fm_host.num_splits, dtype=torch.int32), want_splits)
            host = plan_splits_host([32] * b, sched.plan.num_sm_parts, charge)
            want = torch.tensor(host.rows, dtype=torch.int32).reshape(-1, SCHED_ROW_INTS)[:, :7]
            want_splits = torch.tensor(host.num_splits, dtype=torch.int32)
        assert torch.equal(got, want), f"b={b} s_q={s_q} h_q={h_q}: metadata differs"
        assert torch.equal(sched.num_splits.cpu(), want_splits)
        # and the device scheduler kernel on the same block counts
        from cute_mla.scheduler import plan_splits
        nb = torch.full((b,), 32, dtype=torch.int32, device="cuda")
        md, ns = plan_splits(nb, sched.plan.num_sm_parts, charge)
        assert torch.equal(md[:, :7].cpu(), want) and torch.equal(ns.cpu(), want_splits)


def test_mixed_batch_beyond_65535_tokens(seed):
    """No grid dimension caps s_q: 100k query tokens in one call (rows past 65535 checked)."""
    s_q, h_q, topk, pool = 100_000, 64, 128, 65536
    g = torch.Generator(device="cuda").manual_seed(seed)
    from cute_mla.formats import quantize_v32
    kv = (torch.randn(pool, 576, device="cuda", generator=g) / 10).clamp(-1, 1)
    k_cache = quantize_v32(kv).view(pool // 64, 64, 1, 656)
    q = torch.randn(1, s_q, h_q, 576, device="cuda", generator=g).clamp(-1, 1).to(torch.bfloat16)
    idx = torch.randint(0, pool, (1, s_q, topk), device="cuda", generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, device="cuda", generator=g) < 0.2] = -1
    sched, _ = get_mla_metadata()
    o, l = flash_mla_with_kvcache(q, k_cache, None, None, 512, sched, softmax_scale=0.05, is_fp8_kvcache=True, indices=idx)
    assert not sched.plan.split
    rows = torch.cat([torch.arange(0, 64), torch.arange(65500, 65600), torch.arange(s_q - 64, s_q)]).cuda()
    ro, rl = sparse_decode_reference(q[:, rows], k_cache, idx[:, rows], 0.05)
    check_out_lse(o[:, rows], l[:, :, rows], ro, rl)


@pytest.mark.parametrize("shape", [(1, 8, 64), (2, 1, 128), (64, 2, 64)])   # split, split + cluster, whole requests
def test_chained_calls_in_one_graph(seed, shape):
    """Three calls in one graph, as an engine's layers: call b's q is made by a torch op from call
    a's out (read after write across calls); call c runs right behind call b's combine (its
    partials may reuse memory that combine reads: write after read). Every call matches the fp32
    reference, on each of three replays with fresh inputs."""
    b, s_q, h_q = shape
    g = torch.Generator().manual_seed(seed)
    x = make_inputs(b, s_q, h_q, 2048, num_tokens=8192, invalid_frac=0.2, with_sink=True, device="cuda", generator=g)
    qa, qb, qc = (torch.empty_like(x.q) for _ in range(3))
    sched, _ = get_mla_metadata()
    kw = dict(softmax_scale=x.softmax_scale, is_fp8_kvcache=True, indices=x.indices, attn_sink=x.attn_sink)

    def fresh():
        for t in (qa, qb, qc):
            t.copy_(torch.randn(x.q.shape, generator=g).to(torch.bfloat16))

    def calls():
        oa, la = flash_mla_with_kvcache(qa, x.k_cache, None, None, 512, sched, **kw)
        qb[..., :512].copy_(oa * 4)
        ob, lb = flash_mla_with_kvcache(qb, x.k_cache, None, None, 512, sched, **kw)
        oc, lc = flash_mla_with_kvcache(qc, x.k_cache, None, None, 512, sched, **kw)
        return (oa, la), (ob, lb), (oc, lc)

    fresh()
    calls()   # compiles, plans and uploads the schedule outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = calls()
    for _ in range(3):
        fresh()
        for o, _ in results:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for qx, (o, l) in zip((qa, qb, qc), results):
            ro, rl = sparse_decode_reference(qx, x.k_cache, x.indices, x.softmax_scale, x.attn_sink, None)
            check_out_lse(o, l, ro, rl)


@pytest.mark.parametrize("shape", [(1, 1, 64), (4, 2, 128)])   # the column pair; the h=128 cluster
def test_a_variant_through_the_public_seam(seed, shape):
    """``FlashMLASchedMeta(tuning=...)``: the public call compiles and runs that kernel variant (its
    launcher's config carries it), and a variant that only changes how rows are fetched gives the
    default's bits."""
    from cute_mla import FlashMLASchedMeta
    from cute_mla.kernels.sm90 import DEFAULT_TUNING, Sm90Tuning
    from cute_mla.kernels.sm90.config import tile_gather_l1, tile_registers

    if device_arch(torch.device("cuda")) != "sm_90a":
        pytest.skip("an SM90 kernel variant")
    b, s_q, h_q = shape
    x = make_inputs(b, s_q, h_q, 2048, num_tokens=8192, with_sink=True, device="cuda")
    kw = dict(softmax_scale=x.softmax_scale, is_fp8_kvcache=True, indices=x.indices, attn_sink=x.attn_sink)
    variant = Sm90Tuning(prefetch_rows=False, gather_l2="size_128b")
    sched = FlashMLASchedMeta(tuning=variant)
    o, l = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, **kw)
    # the config compiles the variant with its shape's register budget and L1 hint filled in
    assert sched.launcher(True).main_cfg.tuning == dataclasses.replace(variant, registers=tile_registers(h_q),
                                                                        gather_l1=tile_gather_l1(h_q))
    o0, l0 = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, get_mla_metadata()[0], **kw)
    torch.cuda.synchronize()
    check(x, o, l)
    assert torch.equal(o, o0) and torch.equal(l.nan_to_num(7.0), l0.nan_to_num(7.0))
    assert get_mla_metadata()[0].tuning is None and DEFAULT_TUNING != variant


@pytest.mark.parametrize("mode", ["set_default_device", "context"])
@pytest.mark.parametrize("d_qk, topk_length", [(576, False), (576, True), (512, True)])
def test_under_a_cuda_default_device(seed, mode, d_qk, topk_length):
    """FlashMLA's own tests and many notebooks make CUDA the default device: the host schedule's
    pinned copy, the plan and the inputs' host side must not follow it (the upload once failed
    with "cannot pin 'torch.cuda.IntTensor'")."""
    x = make_inputs(4, 2, 64, 128, num_tokens=2048, with_sink=True, with_topk_length=topk_length, d_qk=d_qk,
                    device="cuda")
    if mode == "set_default_device":
        torch.set_default_device("cuda")
        try:
            o, l, _ = run_case(x)
        finally:
            torch.set_default_device(None)
    else:
        with torch.device("cuda"):
            o, l, _ = run_case(x)
    check(x, o, l)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensors_on_another_gpu_than_the_current_one(seed):
    """q on cuda:1 while cuda:0 is current: the schedule, the SM count and the launches follow the
    tensors' device (a device guard for the call)."""
    x = make_inputs(4, 2, 64, 2048, num_tokens=4096, with_sink=True, device="cuda:1")
    torch.cuda.set_device(0)
    o, l, sched = run_case(x)
    assert o.device == x.q.device and sched.tile_scheduler_metadata.device == x.q.device
    assert torch.cuda.current_device() == 0
    check(x, o, l)
    x2 = make_inputs(4, 2, 64, 2048, num_tokens=4096, with_sink=True, with_topk_length=True, device="cuda:1")
    o, l, sched = run_case(x2)   # a device schedule (scheduler kernel) on cuda:1
    assert sched.tile_scheduler_metadata.device == x2.q.device
    check(x2, o, l)
