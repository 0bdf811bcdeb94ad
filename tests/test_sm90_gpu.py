"""GPU (SM90): the sparse decode main kernel against the fp32 torch reference.

Fresh random inputs in FlashMLA's test style (cute_mla.testing.make_inputs): unused cache slots are
NaN bytes, -1 and out-of-range indices, sinks with +inf/-inf, random topk_length including 0,
all-invalid rows, non-power-of-two scales, page block sizes 2/61/64/576, h_q 64/128, s_q 1/3,
b 4/74, both kernel variants. The split variant runs on FlashMLA's greedy schedule and its bf16
partials are merged here in torch (the combine kernel has its own tests).

``python tests/test_sm90_gpu.py --bench`` prints CUDA-event timings (median of 20).
"""

from __future__ import annotations

import pytest
import torch

from cute_mla import archs
from cute_mla.kernels.sm90 import DEFAULT_TUNING, Sm90Tuning, kernel_config
from cute_mla.reference import sparse_decode_reference
from cute_mla.plan.policy import default_policy
from cute_mla.testing import check_diagnosed, check_out_lse, make_inputs, run_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

NUM_SMS = archs.SM90.default_num_sms
ARCH = archs.SM90.name
POLICY = default_policy(ARCH)


def _cfg(inp, split, tuning=None, column_pair=False):
    return inp.kernel_config(kernel_config, split, column_pair=column_pair, tuning=tuning)


def _run(inp, split, parts, tuning=None, column_pair=False, overhead=None):
    kw = {} if overhead is None else dict(overhead=overhead)
    return run_kernel(inp, _cfg(inp, split, tuning, column_pair), parts, **kw)


def _reference(inp):
    return sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale, attn_sink=inp.attn_sink,
                                   topk_length=inp.topk_length)


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


@pytest.mark.parametrize("name", list(CASES))
def test_sparse_decode_matches_reference(name, seed):
    """Every case against the fp32 reference (split cases with the arch's bf16 partials)."""
    b, s_q, h_q, topk, page, split, tl, sink, pow2, all_invalid, oor = CASES[name]
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(b, s_q, h_q, topk, num_tokens=max(4096, 2 * topk), page_block_size=page, invalid_frac=0.15,
                      out_of_range_frac=oor, with_topk_length=tl, with_sink=sink, power_of_two_scales=pow2,
                      all_invalid_rows=all_invalid, device="cuda", generator=g)
    parts = POLICY.num_sm_parts(NUM_SMS, s_q, h_q) if split else 1
    out, lse, sched = _run(inp, split, parts)
    ref_out, ref_lse = _reference(inp)
    if split:
        assert sched.any_split, "the split case should exercise split pieces"
    check_diagnosed(out, lse, ref_out, ref_lse, sched)


def _mask_pattern(idx, pattern, g, num_tokens, topk_length=None):
    """Overwrite entries of ``idx`` (b, s_q, topk) with -1 in a layout the index compaction must survive
    (``num_tokens`` and ``topk_length`` say which entries are valid, for ``one_valid``)."""
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
    elif pattern == "one_valid":  # one valid token per list, at a random one of its valid positions
        s_q = idx.shape[1]
        for row in range(flat.shape[0]):
            length = topk if topk_length is None else int(topk_length[row // s_q])
            ok = ((flat[row] >= 0) & (flat[row] < num_tokens) & (pos < length)).nonzero().flatten()
            keep = int(ok[torch.randint(0, len(ok), (1,), generator=g)]) if len(ok) else None
            kept = int(flat[row, keep]) if keep is not None else -1
            flat[row] = -1
            if keep is not None:    # (a list with no valid entry, e.g. topk_length 0, stays empty)
                flat[row, keep] = kept
    elif pattern != "none":
        raise ValueError(pattern)


def _patterned_inputs(b, s_q, h_q, topk, tl, invalid_frac, pattern, seed):
    """Inputs made on the CPU (the masking pattern is drawn there), then moved to the GPU."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(b, s_q, h_q, topk, num_tokens=2 * topk, page_block_size=64, invalid_frac=invalid_frac,
                      out_of_range_frac=0.05, with_topk_length=tl, with_sink=True, device="cpu", generator=g)
    _mask_pattern(inp.indices, pattern, g, 2 * topk, inp.topk_length)
    return type(inp)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(inp).items()})


# pattern x (b, s_q, h_q, topk, split, topk_length): multi-request partitions (b=74), split pieces,
# topk_length cutting lists short, h_q 128 (two CTAs per token). Masked entries come on top of make_inputs'
# 15 % of -1 and 5 % out-of-range indices.
COMPACTION_SHAPES = [(74, 2, 64, 2048, True, True), (9, 1, 128, 1024, True, False), (74, 1, 64, 576, False, True)]


@pytest.mark.parametrize("pattern", ["none", "front_half", "alternate_blocks", "sparse", "runs", "one_valid"])
@pytest.mark.parametrize("shape", range(len(COMPACTION_SHAPES)))
def test_index_compaction_patterns(pattern, shape, seed):
    """Tiles built from the valid indices only: every masking layout gives the reference's answer."""
    b, s_q, h_q, topk, split, tl = COMPACTION_SHAPES[shape]
    inp = _patterned_inputs(b, s_q, h_q, topk, tl, 0.15, pattern, seed)
    parts = POLICY.num_sm_parts(NUM_SMS, s_q, h_q) if split else 1
    out, lse, sched = _run(inp, split, parts)
    ref_out, ref_lse = _reference(inp)
    check_diagnosed(out, lse, ref_out, ref_lse, sched)


def _check_variant(inp, split, parts, variant, baseline, what, overhead=None):
    """``variant`` (a ``(tuning, column_pair)`` pair) gives the fp32 reference's answer and
    ``baseline``'s bits (on the schedule with piece charge ``overhead``). Returns the schedule."""
    out, lse, sched = _run(inp, split, parts, *variant, overhead=overhead)
    ref_out, ref_lse = _reference(inp)
    check_out_lse(out, lse, ref_out, ref_lse)
    out0, lse0, _ = _run(inp, split, parts, *baseline, overhead=overhead)
    assert torch.equal(out, out0), f"{what}: out differs from the baseline's"
    assert torch.equal(lse.nan_to_num(7.0), lse0.nan_to_num(7.0)), f"{what}: lse differs"
    return sched


VARIANTS = {
    "no_row_prefetch": Sm90Tuning(prefetch_rows=False),
    "no_gather_hints": Sm90Tuning(gather_l1="", gather_l2=""),
    "gather_l2_128b": Sm90Tuning(gather_l2="size_128b"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tuning_variants_match(name, seed):
    """Every Sm90Tuning variant gives the fp32 reference's answer and the default's bits: the knobs
    only change how the same tiles are fetched."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(74, 3, 64, 2048, num_tokens=4096, invalid_frac=0.2, with_topk_length=True, with_sink=True,
                      device="cuda", generator=g)
    parts = POLICY.num_sm_parts(NUM_SMS, 3, 64)
    _check_variant(inp, True, parts, (VARIANTS[name],), (DEFAULT_TUNING,), name)


# (b, s_q, topk, split, topk_length): h_q = 128 shapes for the cluster (the crossover transport).
CLUSTER_SHAPES = [(9, 1, 1024, True, False), (74, 2, 2048, True, True), (33, 3, 576, False, True), (1, 8, 2048, True, False),
                  (4, 16, 2048, False, False)]  # the last: 4 whole requests per CTA (ring wrap, buffer reuse)


@pytest.mark.parametrize("pattern", ["none", "sparse", "runs", "one_valid"])
@pytest.mark.parametrize("shape", range(len(CLUSTER_SHAPES)))
def test_h128_cluster_matches(pattern, shape, seed):
    """h=128 as a cluster of 2 (each CTA dequantizes half of every tile for both): the fp32
    reference's answer, and the bits of two independent CTAs (``h128_cluster=False``: same tiles,
    same arithmetic)."""
    b, s_q, topk, split, tl = CLUSTER_SHAPES[shape]
    inp = _patterned_inputs(b, s_q, 128, topk, tl, 0.15, pattern, seed)
    parts = POLICY.num_sm_parts(NUM_SMS, s_q, 128) if split else 1
    _check_variant(inp, split, parts, (DEFAULT_TUNING,), (Sm90Tuning(h128_cluster=False),), "h=128 cluster")


# (b, s_q, topk, topk_length): h_q = 64 split shapes for the column pair, the latency rows' one-tile
# pieces first.
COLUMN_PAIR_SHAPES = [(1, 1, 2048, False), (1, 8, 2048, False), (2, 1, 1536, True), (9, 2, 1024, True)]


@pytest.mark.parametrize("pattern", ["none", "sparse", "one_valid"])
@pytest.mark.parametrize("shape", range(len(COLUMN_PAIR_SHAPES)))
def test_column_pair_matches(pattern, shape, seed):
    """h=64 column pair (a cluster of 2 per piece, each CTA 256 of the 512 output columns): the fp32
    reference's answer and the one-CTA kernel's bits (same tiles, same k-steps per column)."""
    b, s_q, topk, tl = COLUMN_PAIR_SHAPES[shape]
    inp = _patterned_inputs(b, s_q, 64, topk, tl, 0.2, pattern, seed)
    parts = POLICY.num_sm_parts(NUM_SMS, s_q, 64)
    overhead = POLICY.fixed_overhead(b, parts, topk // 64)   # the plan's charge
    _check_variant(inp, True, parts, (None, True), (None, False), "column pair", overhead)


def test_negative_topk_length_means_empty(seed):
    """A negative topk_length is an empty list (as 0): no valid token, like the reference."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(9, 2, 64, 512, num_tokens=2048, invalid_frac=0.1, with_topk_length=True, with_sink=False,
                      device="cuda", generator=g)
    inp.topk_length[::3] = torch.tensor([-1, -64, -(2 ** 31)], dtype=inp.topk_length.dtype, device="cuda")
    parts = POLICY.num_sm_parts(NUM_SMS, 2, 64)
    out, lse, sched = _run(inp, True, parts)
    ref_out, ref_lse = _reference(inp)
    check_out_lse(out, lse, ref_out, ref_lse)
    assert torch.all(out[::3] == 0)
