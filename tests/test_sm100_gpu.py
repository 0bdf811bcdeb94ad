"""GPU (SM100 / B200): the sparse decode main kernel against the fp32 torch reference.

NOT RUN YET: no Blackwell GPU was available when this was written. It is meant to run as-is on a
compute-capability 10.x GPU (it skips elsewhere) and is the first thing to run there (see
docs/sm100.md, "what to check first on real hardware").

FlashMLA's sparse-decode sweep and tolerances: h_q 64/128; (s_k, topk, page_block_size) in
{(512,64,2), (512,64,64), (1024,576,61), (2046,2048,64), (2046,2048,576)}; b in {4, 74, 321};
s_q in {1, 3}; NaN bytes in every cache slot no valid index points at, -1 and out-of-range indices,
one all-invalid row, sinks with +inf/-inf, with and without topk_length (0 included), power-of-two
and arbitrary fp32 scales. out: abs 1e-3 or rel 2.01/128 and cosine diff <= 5e-6; lse: abs 1e-6 or
rel 8.01/65536; inf positions identical.

Both kernel variants run: the no-split variant on the per-request schedule (one partition per
request), the split variant on FlashMLA's greedy schedule for this GPU's SM count, with the partial
results merged here in float64 torch (the combine kernel has its own tests; the public-API test
below runs the real launcher, combine included).

``python tests/test_sm100_gpu.py --bench`` prints CUDA-event timings (median of 20).
"""

import sys

import pytest
import torch

from cute_mla.kernels import DecodeTensors
from cute_mla.reference import sparse_decode_reference
from cute_mla.scheduler import accum_offsets, blocks_per_request, num_sm_parts, per_request_rows, plan_splits_host
from cute_mla.scheduler.partition import HostSchedule
from cute_mla.testing import check_out_lse, make_inputs, diagnose, median_event_us, merge_splits

pytestmark = [pytest.mark.gpu, pytest.mark.sm100]

SWEEP = [(512, 64, 2), (512, 64, 64), (1024, 576, 61), (2046, 2048, 64), (2046, 2048, 576)]


def _num_sms():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _kernel(h_q, split, has_topk_length, has_attn_sink):
    from cute_mla.kernels.sm100.sparse_decode import Sm100SparseDecodeConfig, compile_sparse_decode

    cfg = Sm100SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink)
    return cfg, compile_sparse_decode(cfg)


def _schedule(topk, topk_length, b, split, s_q, h_q, device):
    nb = blocks_per_request(topk, None if topk_length is None else topk_length.tolist(), b)
    if split:
        s = plan_splits_host(nb, num_sm_parts("sm_100a", _num_sms(), s_q, h_q))
    else:
        s = HostSchedule(rows=per_request_rows(nb), num_splits=tuple(range(b + 1)))
    tile_md = torch.tensor(s.rows, dtype=torch.int32, device=device).reshape(len(s.rows), 8)
    offsets = torch.tensor(accum_offsets(s.num_splits), dtype=torch.int32, device=device)
    return s, tile_md, offsets


def run_kernel(inp, split):
    """Launch the SM100 main kernel; for the split variant merge the partials in torch.

    Returns (out (b, s_q, h, 512) fp32, lse (b, h, s_q) fp32, schedule)."""
    from cute_mla.kernels.sm100.sparse_decode import launch_sparse_decode

    q, dev = inp.q, inp.q.device
    b, s_q, h_q, _ = q.shape
    topk = inp.indices.shape[-1]
    kv = inp.k_cache.squeeze(2)
    cfg, compiled = _kernel(h_q, split, inp.topk_length is not None, inp.attn_sink is not None)
    sched, tile_md, offsets = _schedule(topk, inp.topk_length, b, split, s_q, h_q, dev)
    # NaN-filled outputs: every element the kernel owns must be written.
    out = torch.full((b, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((b, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
    o_acc = lse_acc = None
    if split:
        rows = max(sched.split_rows, 1)
        o_acc = torch.full((rows, s_q, h_q, 512), float("nan"), dtype=torch.float32, device=dev)
        lse_acc = torch.full((rows, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
    t = DecodeTensors(q, kv, inp.indices, inp.topk_length, inp.attn_sink, tile_md, offsets, out, lse, o_acc, lse_acc)
    launch_sparse_decode(compiled, cfg, t, inp.softmax_scale)
    torch.cuda.synchronize()
    out = out.float()
    if split:
        out, lse = merge_splits(out, lse, o_acc, lse_acc, sched, inp.attn_sink)
    return out, lse.transpose(1, 2), sched


def _check(inp, split):
    out, lse, sched = run_kernel(inp, split)
    ref_out, ref_lse = sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale,
                                               attn_sink=inp.attn_sink, topk_length=inp.topk_length)
    try:
        check_out_lse(out, lse, ref_out, ref_lse)
    except AssertionError:
        diagnose(out, lse, ref_out, ref_lse, sched)
        raise
    return sched


# A single small case first: if this fails, nothing else will pass (see docs/sm100.md).
def test_smoke_one_tile(seed):
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(1, 1, 64, 64, num_tokens=512, page_block_size=64, invalid_frac=0.0, nan_unused=True,
                      device="cuda", generator=g)
    _check(inp, split=False)


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("s_k,topk,pbs", SWEEP)
@pytest.mark.parametrize("b", [4, 74, 321])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("split", [False, True], ids=["nosplit", "split"])
@pytest.mark.parametrize("with_topk_length", [False, True], ids=["", "topk_length"])
def test_flashmla_sweep(seed, h_q, s_k, topk, pbs, b, s_q, split, with_topk_length):
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(b, s_q, h_q, topk, num_tokens=s_k, page_block_size=pbs, with_sink=True,
                      out_of_range_frac=0.05, all_invalid_rows=1, with_topk_length=with_topk_length,
                      power_of_two_scales=(s_q == 1), device="cuda", generator=g)
    _check(inp, split)


@pytest.mark.parametrize("h_q", [64, 128])
def test_split_pieces_are_exercised(seed, h_q):
    """A case whose greedy schedule really cuts requests (so o_accum / lse_accum are written)."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(4, 1, h_q, 2048, num_tokens=8192, page_block_size=64, with_sink=True, out_of_range_frac=0.05,
                      power_of_two_scales=False, all_invalid_rows=1, device="cuda", generator=g)
    sched = _check(inp, split=True)
    assert sched.any_split


def test_non_power_of_two_scales_exact(seed):
    """PR #184's case: b=1, s_q=2, h=64, topk=64 over 2 blocks x 64, non-power-of-two fp32 scales,
    physical out-of-range indices and -1, topk_length=60. FlashMLA's SM100 truncated these scales."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(1, 2, 64, 64, num_tokens=128, page_block_size=64, out_of_range_frac=0.1,
                      power_of_two_scales=False, device="cuda", generator=g)
    inp.topk_length = torch.tensor([60], dtype=torch.int32, device="cuda")
    _check(inp, split=False)


def test_public_api_dispatches_here(seed):
    """flash_mla_with_kvcache on this GPU runs the SM100 kernel (and the combine when split)."""
    from cute_mla import flash_mla_with_kvcache, get_mla_metadata

    g = torch.Generator().manual_seed(seed)
    for b, topk in ((4, 2048), (74, 576)):
        x = make_inputs(b, 1, 128, topk, num_tokens=4096, page_block_size=64, with_sink=True, out_of_range_frac=0.05,
                        device="cuda", generator=g)
        sched, _ = get_mla_metadata()
        o, l = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, softmax_scale=x.softmax_scale,
                                      is_fp8_kvcache=True, indices=x.indices, attn_sink=x.attn_sink)
        assert sched.plan.kernel == "sm100_sparse_decode"
        ro, rl = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, x.attn_sink)
        torch.cuda.synchronize()
        check_out_lse(o, l, ro, rl)


# ------------------------------------------------------------------------------------------ timing


def bench(b, s_q, h_q, topk, num_tokens, iters=20):
    from cute_mla.formats import quantize_v32
    from cute_mla.kernels.sm100.sparse_decode import launch_sparse_decode

    dev = "cuda"
    q = torch.randn(b, s_q, h_q, 576, device=dev).clamp(-1, 1).to(torch.bfloat16)
    page = 64
    blocks = num_tokens // page
    kv = torch.empty(blocks, page + 1, 656, dtype=torch.uint8, device=dev)[:, :page]
    kv.copy_(quantize_v32((torch.randn(num_tokens, 576, device=dev) / 10).clamp(-1, 1)).view(blocks, page, 656))
    idx = torch.randint(0, num_tokens, (b, s_q, topk), dtype=torch.int32, device=dev)
    split = topk > 640
    sched, tile_md, offsets = _schedule(topk, None, b, split, s_q, h_q, dev)
    split = split and sched.any_split
    if not split:
        sched, tile_md, offsets = _schedule(topk, None, b, False, s_q, h_q, dev)
    cfg, compiled = _kernel(h_q, split, False, False)
    out = torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, s_q, h_q, dtype=torch.float32, device=dev)
    rows = max(sched.split_rows, 1)
    o_acc = torch.empty(rows, s_q, h_q, 512, dtype=torch.float32, device=dev) if split else None
    lse_acc = torch.empty(rows, s_q, h_q, dtype=torch.float32, device=dev) if split else None

    def go():
        launch_sparse_decode(compiled, cfg, DecodeTensors(q, kv, idx, None, None, tile_md, offsets, out, lse, o_acc, lse_acc),
                             576 ** -0.5)

    t = median_event_us(go, iters)
    tokens = b * s_q * topk
    flops = 2 * h_q * tokens * (576 + 512)
    print(f"b={b} s_q={s_q} h_q={h_q} topk={topk} P={tile_md.shape[0]} split={split}: {t:.1f} us "
          f"({flops / t / 1e6:.0f} TFLOPS, {tokens * 656 / t / 1e6:.2f} TB/s gathered)")
    return t


if __name__ == "__main__" and "--bench" in sys.argv:
    bench(1, 8192, 64, 2048, 65536)
    bench(128, 2, 128, 2048, 32768)   # FlashMLA's README configuration
    bench(64, 1, 64, 2048, 32768)
