"""GPU (SM90): the sparse decode main kernel against the fp32 torch reference.

Fresh random inputs in FlashMLA's test style (cute_mla.testing.make_inputs): unused cache slots are
NaN bytes, -1 and out-of-range indices, sinks with +inf/-inf, random topk_length including 0,
all-invalid rows, non-power-of-two scales, page block sizes 2/61/64/576, h_q 64/128, s_q 1/3,
b 4/74, both kernel variants. The split variant runs on FlashMLA's greedy schedule and its partial
results are merged here in torch (the combine kernel has its own tests).

``python tests/test_sm90_gpu.py --bench`` prints CUDA-event timings (median of 20).
"""

from __future__ import annotations

import sys

import pytest
import torch

from cute_mla.reference import sparse_decode_reference
from cute_mla.scheduler import accum_offsets, blocks_per_request, num_sm_parts, plan_splits_host
from cute_mla.testing import check_out_lse, make_inputs, diagnose, median_event_us, merge_splits

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

NUM_SMS = 132


def _kernel(h_q, split, has_topk_length, has_attn_sink, tuning=None, accum_dtype="float32"):
    from cute_mla.kernels.sm90.sparse_decode import DEFAULT_TUNING, Sm90SparseDecodeConfig, compile_sparse_decode

    cfg = Sm90SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink,
                                 accum_dtype=accum_dtype)
    return cfg, compile_sparse_decode(cfg, tuning=tuning or DEFAULT_TUNING)


def _schedule(topk, topk_length, b, parts, device, overhead=None):
    """The host schedule (FlashMLA's piece charge of 5 blocks unless ``overhead`` is given)."""
    nb = blocks_per_request(topk, None if topk_length is None else topk_length.tolist(), b)
    s = plan_splits_host(nb, parts) if overhead is None else plan_splits_host(nb, parts, overhead)
    tile_md = torch.tensor(s.rows, dtype=torch.int32, device=device).reshape(parts, 8)
    offsets = accum_offsets(s.num_splits)
    return s, tile_md, torch.tensor(offsets, dtype=torch.int32, device=device)


def run_kernel(inp, split, parts, tuning=None, accum_dtype="float32", overhead=None):
    """Launch the main kernel on ``inp``; for the split variant merge the partials in torch (fp64),
    the partials' o_accum of ``accum_dtype`` (fp32 or bf16: the config's).

    Returns (out (b, s_q, h, 512) fp32, lse (b, h, s_q) fp32, schedule)."""
    from cute_mla.kernels.sm90.sparse_decode import launch_sparse_decode

    q, dev = inp.q, inp.q.device
    b, s_q, h_q, _ = q.shape
    topk = inp.indices.shape[-1]
    kv = inp.k_cache.squeeze(2)
    cfg, compiled = _kernel(h_q, split, inp.topk_length is not None, inp.attn_sink is not None, tuning,
                            accum_dtype if split else "float32")
    sched, tile_md, offsets = _schedule(topk, inp.topk_length, b, parts, dev, overhead)
    if not split:
        assert not sched.any_split, "the no-split variant only runs on schedules without split pieces"
    out = torch.full((b, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((b, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
    o_acc = lse_acc = None
    rows = max(sched.split_rows, 1)
    if split:
        o_acc = torch.full((rows, s_q, h_q, 512), float("nan"), dtype=getattr(torch, accum_dtype), device=dev)
        lse_acc = torch.full((rows, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
    launch_sparse_decode(compiled, cfg, q, kv, inp.indices, inp.topk_length, inp.attn_sink, tile_md, offsets,
                         out, lse, o_acc, lse_acc, inp.softmax_scale)
    torch.cuda.synchronize()
    out = out.float()
    if split:
        out, lse = merge_splits(out, lse, o_acc, lse_acc, sched, inp.attn_sink)
    return out, lse.transpose(1, 2), sched


# name: (b, s_q, h_q, topk, page_block_size, split, topk_length, sink, pow2 scales, all-invalid rows, out-of-range frac)
CASES = {
    "tiny_nosplit": (1, 1, 64, 64, 64, False, False, False, True, 0, 0.0),
    "b4_h64_split_pbs2": (4, 1, 64, 1024, 2, True, False, True, False, 0, 0.05),
    "b4_s3_h128_nosplit_pbs61": (4, 3, 128, 576, 61, False, True, True, False, 1, 0.05),
    "b74_h128_split_pbs64": (74, 1, 128, 2048, 64, True, False, True, True, 0, 0.05),
    "b74_s3_h64_split_pbs576": (74, 3, 64, 2048, 576, True, True, False, False, 5, 0.05),
    "b4_s3_h64_split_invalid": (4, 3, 64, 576, 2, True, True, True, False, 4, 0.1),
    "b74_h64_nosplit_pbs64": (74, 1, 64, 576, 64, False, True, True, True, 3, 0.05),
    "b74_s3_h128_split_pbs61": (74, 3, 128, 576, 61, True, True, True, False, 2, 0.05),
}


@pytest.mark.parametrize("name", list(CASES) + [f"{n}_bf16_accum" for n, c in CASES.items() if c[5]])
def test_sparse_decode_matches_reference(name, seed):
    """Every case against the fp32 reference; the split cases once more with bf16 partials (the
    SM90 plan's accum_dtype)."""
    accum = "bfloat16" if name.endswith("_bf16_accum") else "float32"
    b, s_q, h_q, topk, page, split, tl, sink, pow2, all_invalid, oor = CASES[name.removesuffix("_bf16_accum")]
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(b, s_q, h_q, topk, num_tokens=max(4096, 2 * topk), page_block_size=page, invalid_frac=0.15,
                      out_of_range_frac=oor, with_topk_length=tl, with_sink=sink, power_of_two_scales=pow2,
                      all_invalid_rows=all_invalid, device="cuda", generator=g)
    parts = num_sm_parts("sm_90a", NUM_SMS, s_q, h_q) if split else 1
    out, lse, sched = run_kernel(inp, split, parts, accum_dtype=accum)
    ref_out, ref_lse = sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale,
                                               attn_sink=inp.attn_sink, topk_length=inp.topk_length)
    if split:
        assert sched.any_split, "the split case should exercise split pieces"
    try:
        check_out_lse(out, lse, ref_out, ref_lse)
    except AssertionError:
        diagnose(out, lse, ref_out, ref_lse, sched)
        raise


def _mask_pattern(idx, pattern, g):
    """Overwrite entries of ``idx`` (b, s_q, topk) with -1 in a layout the index compaction must survive."""
    flat = idx.view(-1, idx.shape[-1])
    topk = flat.shape[1]
    pos = torch.arange(topk)
    if pattern == "front_half":  # the first half of every list masked: whole blocks without a valid token
        flat[:, : topk // 2] = -1
    elif pattern == "alternate_blocks":  # every other 64-block masked
        flat[:, (pos // 64) % 2 == 1] = -1
    elif pattern == "sparse":  # ~95 % masked: most requests need one padded tile (requests never share a tile)
        flat[torch.rand(flat.shape, generator=g) < 0.95] = -1
    elif pattern == "runs":  # random runs of 1..300 masked positions
        for row in range(flat.shape[0]):
            p = 0
            while p < topk:
                n = int(torch.randint(1, 300, (1,), generator=g))
                if torch.rand(1, generator=g) < 0.5:
                    flat[row, p : p + n] = -1
                p += n
    elif pattern == "one_valid":  # a single valid token per list, at a random position
        keep = torch.randint(0, topk, (flat.shape[0],), generator=g)
        kept = flat[torch.arange(flat.shape[0]), keep].clone()
        flat[:] = -1
        flat[torch.arange(flat.shape[0]), keep] = kept
    elif pattern != "none":
        raise ValueError(pattern)


# pattern x (b, s_q, h_q, topk, split, topk_length): multi-request partitions (b=74), split pieces,
# topk_length cutting lists short, h_q 128 (two CTAs per token). Masked entries come on top of make_inputs'
# 15 % of -1 and 5 % out-of-range indices.
COMPACTION_SHAPES = [(74, 2, 64, 2048, True, True), (9, 1, 128, 1024, True, False), (74, 1, 64, 576, False, True)]


@pytest.mark.parametrize("pattern", ["none", "front_half", "alternate_blocks", "sparse", "runs", "one_valid"])
@pytest.mark.parametrize("shape", range(len(COMPACTION_SHAPES)))
def test_index_compaction_patterns(pattern, shape, seed):
    """Tiles built from the valid indices only: every masking layout gives the reference's answer."""
    b, s_q, h_q, topk, split, tl = COMPACTION_SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(b, s_q, h_q, topk, num_tokens=2 * topk, page_block_size=64, invalid_frac=0.15,
                      out_of_range_frac=0.05, with_topk_length=tl, with_sink=True, device="cpu", generator=g)
    _mask_pattern(inp.indices, pattern, g)
    inp = type(inp)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(inp).items()})
    parts = num_sm_parts("sm_90a", NUM_SMS, s_q, h_q) if split else 1
    out, lse, sched = run_kernel(inp, split, parts)
    ref_out, ref_lse = sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale,
                                               attn_sink=inp.attn_sink, topk_length=inp.topk_length)
    try:
        check_out_lse(out, lse, ref_out, ref_lse)
    except AssertionError:
        diagnose(out, lse, ref_out, ref_lse, sched)
        raise


def _tuning(name):
    from cute_mla.kernels.sm90.sparse_decode import Crossover, Streaming, Tuning

    return {
        # one tile per 64 positions (the producer before index compaction), kept for A/B timing
        "uncompacted": Tuning(compact_indices=False, streaming=Streaming.OFF, crossover=Crossover.OFF),
        "uncompacted_streamed": Tuning(compact_indices=False, streaming=Streaming.BOTH, crossover=Crossover.OFF),
        "compacted_half_pipelined": Tuning(streaming=Streaming.OFF, crossover=Crossover.OFF),
        "no_qk_pv_overlap": Tuning(overlap_qk_pv=False),
        "bulk_prefetch_one_index_chunk_ahead": Tuning(prefetch_lines=False, scan_two_ahead=False),
        "no_row_prefetch": Tuning(prefetch_rows=False),
        "oacc_direct_store": Tuning(oacc_direct_store=True),
        "oacc_direct_store_bf16_accum": Tuning(oacc_direct_store=True),   # run with bf16 partials
        "next_q_prefetch": Tuning(prefetch_next_q=True),
        "late_metadata": Tuning(early_metadata=False),
        # h=64 split pieces on a cluster of 2 that splits the output columns (experimental)
        "column_pair": Tuning(column_pair=True),
        "help_second_tile": Tuning(help_second_tile=True),
        "pdl_wait": Tuning(pdl_wait=True),
        "unchunked_epilogue": Tuning(chunked_epilogue=False),
        "unchunked_epilogue_bf16_accum": Tuning(chunked_epilogue=False),   # run with bf16 partials
        "column_pair_unchunked_epilogue_bf16_accum": Tuning(column_pair=True, chunked_epilogue=False),
        "lse_first": Tuning(store_lse_first=True),
    }[name]


@pytest.mark.parametrize("name", ["uncompacted", "uncompacted_streamed", "compacted_half_pipelined", "no_qk_pv_overlap",
                                  "bulk_prefetch_one_index_chunk_ahead", "no_row_prefetch", "oacc_direct_store",
                                  "oacc_direct_store_bf16_accum", "next_q_prefetch", "late_metadata", "column_pair",
                                  "help_second_tile", "pdl_wait", "unchunked_epilogue", "unchunked_epilogue_bf16_accum",
                                  "column_pair_unchunked_epilogue_bf16_accum", "lse_first"])
def test_schedule_knobs_match(name, seed):
    """Every non-default Tuning is checked against the fp32 reference; the ones that keep the
    default's tiles (compaction on) must also give the default's bits: they only reschedule work."""
    from cute_mla.kernels.sm90.sparse_decode import DEFAULT_TUNING

    tuning = _tuning(name)
    accum = "bfloat16" if name.endswith("_bf16_accum") else "float32"
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(74, 3, 64, 2048, num_tokens=4096, invalid_frac=0.2, with_topk_length=True, with_sink=True,
                      device="cuda", generator=g)
    parts = num_sm_parts("sm_90a", NUM_SMS, 3, 64)
    out, lse, sched = run_kernel(inp, True, parts, tuning, accum)
    ref_out, ref_lse = sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale,
                                               attn_sink=inp.attn_sink, topk_length=inp.topk_length)
    check_out_lse(out, lse, ref_out, ref_lse)
    if tuning.compact_indices == DEFAULT_TUNING.compact_indices:
        out0, lse0, _ = run_kernel(inp, True, parts, accum_dtype=accum)
        assert torch.equal(out, out0), f"{name}: out differs from the default tuning's"
        assert torch.equal(lse.nan_to_num(7.0), lse0.nan_to_num(7.0)), f"{name}: lse differs from the default tuning's"


# (b, s_q, topk, split, topk_length): h_q = 128 shapes for the crossover (cluster of two CTAs).
CROSSOVER_SHAPES = [(9, 1, 1024, True, False), (74, 2, 2048, True, True), (33, 3, 576, False, True), (1, 8, 2048, True, False),
                    (4, 16, 2048, False, False)]  # the last: 4 whole requests per CTA (ring wrap, buffer reuse)


@pytest.mark.parametrize("transport", ["WARP_COPIES", "HALF_COPY", "WARP_COPIES_TWO_TILES"])
@pytest.mark.parametrize("pattern", ["none", "sparse", "runs", "one_valid"])
@pytest.mark.parametrize("shape", range(len(CROSSOVER_SHAPES)))
def test_crossover_matches(pattern, shape, transport, seed):
    """h=128 crossover (each CTA of the pair dequantizes half of every tile for both): the fp32
    reference's answer, and the bits of Crossover.OFF (same tiles, same arithmetic)."""
    from cute_mla.kernels.sm90.sparse_decode import Crossover, Tuning

    b, s_q, topk, split, tl = CROSSOVER_SHAPES[shape]
    inp = _patterned_inputs(b, s_q, 128, topk, tl, 0.15, pattern, seed)
    parts = num_sm_parts("sm_90a", NUM_SMS, s_q, 128) if split else 1
    _check_variant(inp, split, parts, Tuning(crossover=Crossover[transport]), Tuning(crossover=Crossover.OFF),
                   "crossover", "the two-independent-CTA kernel's")


def _patterned_inputs(b, s_q, h_q, topk, tl, invalid_frac, pattern, seed):
    """Inputs made on the CPU (the masking pattern is drawn there), then moved to the GPU."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(b, s_q, h_q, topk, num_tokens=2 * topk, page_block_size=64, invalid_frac=invalid_frac,
                      out_of_range_frac=0.05, with_topk_length=tl, with_sink=True, device="cpu", generator=g)
    _mask_pattern(inp.indices, pattern, g)
    return type(inp)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(inp).items()})


def _check_variant(inp, split, parts, tuning, baseline, what, baseline_name, accum_dtype="float32", overhead=None):
    """``tuning`` gives the fp32 reference's answer and ``baseline``'s bits (both with o_accum of
    ``accum_dtype``, on the schedule with piece charge ``overhead``). Returns the schedule."""
    out, lse, sched = run_kernel(inp, split, parts, tuning, accum_dtype, overhead)
    ref_out, ref_lse = sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale,
                                               attn_sink=inp.attn_sink, topk_length=inp.topk_length)
    check_out_lse(out, lse, ref_out, ref_lse)
    out0, lse0, _ = run_kernel(inp, split, parts, baseline, accum_dtype, overhead)
    assert torch.equal(out, out0), f"{what}: out differs from {baseline_name}"
    assert torch.equal(lse.nan_to_num(7.0), lse0.nan_to_num(7.0)), f"{what}: lse differs"
    return sched


# (b, s_q, topk, split, topk_length): h_q = 64 shapes whose partitions hold two compacted tiles
# (1x8x64's 2-block split pieces with the plan's piece charge; 74 requests of 2 blocks over 132
# partitions, whole requests that store out) next to one-tile and longer ones, for
# Tuning.help_second_tile.
HELP_SECOND_SHAPES = [(1, 8, 2048, True, False), (2, 4, 1024, True, False), (74, 1, 128, True, False)]


def _two_tile_ctas(inp, sched):
    """(request, token) CTAs whose partition is one request's range of at most 128 positions with
    65-128 valid indices: two compacted tiles found by the producer's first scan, the partitions
    Tuning.help_second_tile hands tile 1 of to WG1."""
    idx = inp.indices.cpu()
    b, s_q, topk = idx.shape
    num_tokens = inp.k_cache.shape[0] * inp.k_cache.shape[1]
    n = 0
    for r in sched.rows:
        req, end_req, b0, b1 = r[0], r[1], r[2], r[3]
        if req != end_req or req >= b:
            continue
        length = topk if inp.topk_length is None else max(min(int(inp.topk_length[req]), topk), 0)
        lo, hi = b0 * 64, min(b1 * 64, length)
        if hi - lo > 128 or hi <= lo:
            continue
        seg = idx[req, :, lo:hi]
        valid = ((seg >= 0) & (seg < num_tokens)).sum(dim=-1)
        n += int(((valid > 64) & (valid <= 128)).sum())
    return n


@pytest.mark.parametrize("pattern", ["none", "front_half", "sparse", "runs", "one_valid"])
@pytest.mark.parametrize("shape", range(len(HELP_SECOND_SHAPES)))
def test_help_second_tile_matches(pattern, shape, seed):
    """WG1 converting a two-tile partition's second tile: the fp32 reference's answer and the
    default kernel's bits (the same tiles and conversion, only another warp group doing it)."""
    from cute_mla.kernels.sm90.sparse_decode import Tuning

    from cute_mla.scheduler import fixed_overhead_blocks

    b, s_q, topk, split, tl = HELP_SECOND_SHAPES[shape]
    inp = _patterned_inputs(b, s_q, 64, topk, tl, 0.2, pattern, seed)
    parts = num_sm_parts("sm_90a", NUM_SMS, s_q, 64) if split else 1
    overhead = fixed_overhead_blocks("sm_90a", 64, b=b, parts=parts, blocks=topk // 64)   # the plan's charge
    sched = _check_variant(inp, split, parts, Tuning(help_second_tile=True), None, "help_second_tile",
                           "the default kernel's", "bfloat16", overhead)
    if pattern == "none":   # ~20 % masked: the shapes are chosen so that two-tile partitions occur
        assert _two_tile_ctas(inp, sched) > 0, "no partition takes the help path"


# (b, s_q, topk, topk_length, transport): h_q = 64 split shapes for Tuning.column_pair, the latency
# rows' one-tile pieces first.
COLUMN_PAIR_SHAPES = [(1, 1, 2048, False, "WARP_COPIES"), (1, 8, 2048, False, "WARP_COPIES"),
                      (2, 1, 1536, True, "HALF_COPY"), (9, 2, 1024, True, "WARP_COPIES_TWO_TILES")]


@pytest.mark.parametrize("accum", ["float32", "bfloat16"])
@pytest.mark.parametrize("pattern", ["none", "sparse", "one_valid"])
@pytest.mark.parametrize("shape", range(len(COLUMN_PAIR_SHAPES)))
def test_column_pair_matches(pattern, shape, accum, seed):
    """h=64 column pair (a cluster of 2 per piece, each CTA 256 of the 512 output columns): the fp32
    reference's answer and the default kernel's bits (same tiles, same k-steps per column), with
    fp32 and bf16 partials."""
    from cute_mla.kernels.sm90.sparse_decode import Crossover, Tuning

    b, s_q, topk, tl, transport = COLUMN_PAIR_SHAPES[shape]
    inp = _patterned_inputs(b, s_q, 64, topk, tl, 0.2, pattern, seed)
    parts = num_sm_parts("sm_90a", NUM_SMS, s_q, 64)
    _check_variant(inp, True, parts, Tuning(column_pair=True, crossover=Crossover[transport]), None,
                   "column pair", "the default kernel's", accum)


@pytest.mark.parametrize("compact", [True, False])
def test_negative_topk_length_means_empty(compact, seed):
    """A negative topk_length is an empty list (as 0): no valid token, like the reference."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(9, 2, 64, 512, num_tokens=2048, invalid_frac=0.1, with_topk_length=True, with_sink=False,
                      device="cuda", generator=g)
    inp.topk_length[::3] = torch.tensor([-1, -64, -(2 ** 31)], dtype=inp.topk_length.dtype, device="cuda")
    parts = num_sm_parts("sm_90a", NUM_SMS, 2, 64)
    tuning = None if compact else _tuning("uncompacted")
    out, lse, sched = run_kernel(inp, True, parts, tuning)
    ref_out, ref_lse = sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale,
                                               attn_sink=inp.attn_sink, topk_length=inp.topk_length)
    check_out_lse(out, lse, ref_out, ref_lse)
    assert torch.all(out[::3] == 0)


# ------------------------------------------------------------------------------------------ timing


def _bench_inputs(b, s_q, h_q, topk, num_tokens, page=64, pow2=True):
    from cute_mla.formats import quantize_v32

    dev = "cuda"
    q = torch.randn(b, s_q, h_q, 576, device=dev).clamp(-1, 1).to(torch.bfloat16)
    blocks = num_tokens // page
    big = torch.empty(blocks, page + 1, 656, dtype=torch.uint8, device=dev)
    kv = big[:, :page]
    kv.copy_(quantize_v32((torch.randn(num_tokens, 576, device=dev) / 10).clamp(-1, 1), power_of_two_scales=pow2)
             .view(blocks, page, 656))
    idx = torch.randint(0, num_tokens, (b, s_q, topk), dtype=torch.int32, device=dev)
    return q, kv, idx


def bench(b, s_q, h_q, topk, num_tokens, iters=20, tuning=None, pow2=True):
    from cute_mla.kernels.sm90.sparse_decode import DEFAULT_TUNING, Sm90SparseDecodeConfig, compile_sparse_decode, launch_sparse_decode

    q, kv, idx = _bench_inputs(b, s_q, h_q, topk, num_tokens, pow2=pow2)
    parts = num_sm_parts("sm_90a", NUM_SMS, s_q, h_q)
    sched, tile_md, offsets = _schedule(topk, None, b, parts, q.device)
    split = sched.any_split
    tuning = tuning or DEFAULT_TUNING
    cfg = Sm90SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=False, has_attn_sink=False)
    compiled = compile_sparse_decode(cfg, tuning=tuning)
    out = torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, s_q, h_q, dtype=torch.float32, device=q.device)
    rows = max(sched.split_rows, 1)
    o_acc = torch.empty(rows, s_q, h_q, 512, dtype=torch.float32, device=q.device) if split else None
    lse_acc = torch.empty(rows, s_q, h_q, dtype=torch.float32, device=q.device) if split else None

    def go():
        launch_sparse_decode(compiled, cfg, q, kv, idx, None, None, tile_md, offsets, out, lse, o_acc, lse_acc, 576 ** -0.5)

    t = median_event_us(go, iters)
    tokens = b * s_q * topk
    flops = 2 * h_q * tokens * (576 + 512)
    print(f"b={b} s_q={s_q} h_q={h_q} topk={topk} P={parts} split={split} pow2_scales={pow2} {tuning}: {t:.1f} us "
          f"({flops / t / 1e6:.0f} TFLOPS, {tokens * 656 / t / 1e6:.2f} TB/s gathered)")
    return t


if __name__ == "__main__" and "--bench" in sys.argv:
    from cute_mla.kernels.sm90.sparse_decode import Tuning

    tunings = [Tuning(overlap_qk_pv=True), Tuning(overlap_qk_pv=False)] if "--ablate" in sys.argv else [None]
    for tu in tunings:
        bench(1, 8192, 64, 2048, 65536, tuning=tu)   # FlashMLA: 6732 us
        bench(128, 2, 128, 2048, 32768, tuning=tu)   # FlashMLA: 447.5 us
    # non-power-of-two scales take the exact fp32 dequant path
    bench(1, 8192, 64, 2048, 65536, pow2=False)
    bench(128, 2, 128, 2048, 32768, pow2=False)
