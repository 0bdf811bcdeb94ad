"""GPU: the split-KV combine against an fp64 torch merge of random partials.

Split counts are random per request: 0 and 1 (left alone), 2, > 32 (several register slots),
> 132 (beyond a full H200 partition count, bucket 160); lses may be -inf, whole requests may be
empty, sinks may be +-inf or absent; one grid has b*s_q > 65535; one call is replayed from a
CUDA graph with new inputs.
"""

import math

import pytest
import torch

from cute_mla.archs import device_arch
from cute_mla.kernels.combine import WARPS_PER_HEAD, CombineConfig, combine_max_splits, compile as compile_combine, launch as launch_combine

pytestmark = pytest.mark.gpu

D_V = 512
OUT_SENTINEL = 7.0  # what out/lse hold before the call: unsplit requests must keep it
LSE_SENTINEL = 123.0


def make_case(counts, s_q, h_q, sink_kind, empty_frac=0.3, gen=None, device="cuda", accum_dtype="float32"):
    """Random split partials for per-request split counts ``counts`` (0/1 = not split); o_accum of
    ``accum_dtype`` (the fp64 reference reads the same, rounded values)."""
    b = len(counts)
    offs = torch.zeros(b + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    rows = int(offs[-1])
    lse_accum = (torch.rand(rows, s_q, h_q, generator=gen) * 25 - 5).to(device)  # log2 units
    lse_accum[torch.rand(rows, s_q, h_q, generator=gen).to(device) < empty_frac] = -math.inf
    # A few (request, query, head) with every split empty: out 0, lse +inf.
    for r in range(b):
        if counts[r] > 1 and r % 3 == 0:
            lse_accum[int(offs[r]):int(offs[r + 1]), 0, : h_q // 2] = -math.inf
    o_accum = torch.randn(rows, s_q, h_q, D_V, generator=gen).to(device=device, dtype=getattr(torch, accum_dtype))
    sink = None
    if sink_kind == "finite+inf":
        sink = (torch.randn(h_q, generator=gen) * 4).to(device)
        sink[0], sink[1], sink[2] = math.inf, -math.inf, 40.0
    elif sink_kind == "-inf":
        sink = torch.full((h_q,), -math.inf, device=device)
    return dict(
        lse_accum=lse_accum,
        o_accum=o_accum,
        accum_offsets=offs.to(torch.int32).to(device),
        attn_sink=sink,
        out=torch.full((b, s_q, h_q, D_V), OUT_SENTINEL, dtype=torch.bfloat16, device=device),
        lse=torch.full((b, s_q, h_q), LSE_SENTINEL, dtype=torch.float32, device=device),
    )


def reference(case):
    """fp64 merge of the split requests: (index of split requests, out (k,s,h,512), lse (k,s,h))."""
    offs = case["accum_offsets"].long()
    counts = offs[1:] - offs[:-1]
    b = counts.numel()
    split = counts > 1
    req_of_row = torch.repeat_interleave(torch.arange(b, device=offs.device), counts)
    keep = split[req_of_row]
    pos = torch.cumsum(split.long(), 0) - 1  # request -> index among split requests
    k = int(split.sum())
    seg = pos[req_of_row[keep]]
    L = case["lse_accum"][keep].double()
    O = case["o_accum"][keep].double()
    _, s_q, h = case["lse"].shape
    m = torch.full((k, s_q, h), -math.inf, dtype=torch.float64, device=L.device)
    m = m.scatter_reduce(0, seg[:, None, None].expand_as(L), L, "amax", include_self=True)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    ssum = torch.zeros_like(m).index_add_(0, seg, torch.exp2(L - m[seg]))
    g = torch.where(ssum == 0, torch.full_like(m, math.inf), torch.log2(ssum) + m)
    lse_ref = g * math.log(2.0)
    if case["attn_sink"] is not None:
        s2 = (case["attn_sink"].double() * math.log2(math.e)).expand_as(g)
        with_sink = g + torch.log2(1 + torch.exp2(s2 - g))
        no_tok = torch.where(s2 == -math.inf, torch.full_like(s2, math.inf), s2)
        g = torch.where(torch.isfinite(g), with_sink, no_tok)
    w = torch.exp2(L - g[seg])
    out_ref = torch.zeros(k, s_q, h, D_V, dtype=torch.float64, device=L.device)
    out_ref.index_add_(0, seg, w[..., None] * O)
    return split, out_ref, lse_ref


def check(case):
    split, out_ref, lse_ref = reference(case)
    out, lse = case["out"], case["lse"]
    torch.testing.assert_close(out[split].double(), out_ref, rtol=8e-3, atol=2e-3)
    torch.testing.assert_close(lse[split].double(), lse_ref, rtol=1e-5, atol=1e-4)
    # Requests with 0 or 1 split belong to the main kernel: untouched.
    assert bool((out[~split] == OUT_SENTINEL).all()) and bool((lse[~split] == LSE_SENTINEL).all())
    return split


def run(case, h_q, max_splits, warps_per_head=4):
    cfg = CombineConfig(h_q=h_q, has_attn_sink=case["attn_sink"] is not None, max_splits=max_splits,
                        arch=device_arch(torch.device("cuda")),
                        accum_dtype=str(case["o_accum"].dtype).removeprefix("torch."), warps_per_head=warps_per_head)
    compiled = compile_combine(cfg)
    launch_combine(compiled, cfg, case["lse_accum"], case["o_accum"], case["accum_offsets"], case["attn_sink"],
                   case["out"], case["lse"])
    torch.cuda.synchronize()
    return cfg, compiled


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("sink_kind", [None, "finite+inf", "-inf"])
@pytest.mark.parametrize("shape", ["small", "over32", "over132"])
@pytest.mark.parametrize("warps_per_head", WARPS_PER_HEAD)
def test_matches_fp64(h_q, sink_kind, shape, warps_per_head, seed):
    gen = torch.Generator().manual_seed(seed)
    if shape == "small":
        counts = [1, 2, 0, 3, 2, 1, 5]
        s_q = 3
    elif shape == "over32":
        counts = [33, 1, 40, 2, 64]
        s_q = 2
    else:
        counts = [133, 150, 1, 160]
        s_q = 1
    max_splits = combine_max_splits(max(counts))
    case = make_case(counts, s_q, h_q, sink_kind, gen=gen)
    run(case, h_q, max_splits, warps_per_head)
    check(case)
    # make_case emptied (request r % 3 == 0, query 0, first half of the heads): out 0, lse +inf.
    r = next(i for i, c in enumerate(counts) if c > 1 and i % 3 == 0)
    assert bool((case["out"][r, 0, : h_q // 2] == 0).all())
    assert bool((case["lse"][r, 0, : h_q // 2] == math.inf).all())


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("sink_kind", [None, "finite+inf"])
@pytest.mark.parametrize("counts,s_q", [([1, 2, 0, 3, 2, 1, 5], 3), ([33, 1, 40, 2, 64], 2), ([133, 150, 1, 160], 1)])
@pytest.mark.parametrize("warps_per_head", WARPS_PER_HEAD)
def test_bf16_partials_match_fp64(h_q, sink_kind, counts, s_q, warps_per_head, seed):
    """bf16 o_accum (the SM90 plan's accum_dtype): 8-byte row loads widened to fp32."""
    gen = torch.Generator().manual_seed(seed)
    case = make_case(counts, s_q, h_q, sink_kind, gen=gen, accum_dtype="bfloat16")
    run(case, h_q, combine_max_splits(max(counts)), warps_per_head)
    check(case)
    r = next(i for i, c in enumerate(counts) if c > 1 and i % 3 == 0)
    assert bool((case["out"][r, 0, : h_q // 2] == 0).all())
    assert bool((case["lse"][r, 0, : h_q // 2] == math.inf).all())


def test_random_counts_in_large_bucket(seed):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 161, (24,), generator=gen).tolist()
    case = make_case(counts, 1, 64, "finite+inf", gen=gen)
    run(case, 64, 160)
    check(case)
    # every bucket that holds the counts accumulates the rows in the same order: the same bits
    first = (case["out"].clone(), case["lse"].clone())
    case["out"].fill_(OUT_SENTINEL)
    case["lse"].fill_(LSE_SENTINEL)
    run(case, 64, 256)
    assert torch.equal(case["out"], first[0]) and torch.equal(case["lse"], first[1])
    # and so does a warp per head (rows summed in the same order, 4 per batch instead of 16)
    case["out"].fill_(OUT_SENTINEL)
    case["lse"].fill_(LSE_SENTINEL)
    run(case, 64, 160, warps_per_head=1)
    assert torch.equal(case["out"], first[0]) and torch.equal(case["lse"], first[1])


@pytest.mark.parametrize("warps_per_head", WARPS_PER_HEAD)
def test_grid_beyond_65535(warps_per_head, seed):
    """b*s_q > 65535 rides on grid x: the last requests must be combined too."""
    gen = torch.Generator().manual_seed(seed)
    b, h_q = 70_001, 8
    counts = [1 if r % 1000 == 1 else 0 for r in range(b)]  # compact offsets: unsplit requests own 0 or 1 row
    for r in list(range(0, 100, 7)) + list(range(65_530, 65_545)) + [b - 2, b - 1]:
        counts[r] = 2 + r % 5
    case = make_case(counts, 1, h_q, "finite+inf", gen=gen)
    run(case, h_q, 32, warps_per_head)
    split = check(case)
    assert bool(split[b - 1]) and bool((case["lse"][b - 1] != LSE_SENTINEL).all())


@pytest.mark.parametrize("warps_per_head", WARPS_PER_HEAD)
def test_strided_out(warps_per_head, seed):
    """out may be a view (here: heads sliced out of a wider buffer); only stride(-1) == 1 is needed."""
    gen = torch.Generator().manual_seed(seed)
    h_q = 64
    case = make_case([2, 1, 4], 2, h_q, "finite+inf", gen=gen)
    wide = torch.full((3, 2, h_q + 8, D_V), OUT_SENTINEL, dtype=torch.bfloat16, device="cuda")
    case["out"] = wide[:, :, 4 : 4 + h_q]
    run(case, h_q, 32, warps_per_head)
    check(case)
    assert bool((wide[:, :, :4] == OUT_SENTINEL).all()) and bool((wide[:, :, 4 + h_q :] == OUT_SENTINEL).all())


@pytest.mark.parametrize("warps_per_head", WARPS_PER_HEAD)
def test_too_many_splits_poisons(warps_per_head, seed):
    gen = torch.Generator().manual_seed(seed)
    case = make_case([2, 33, 1], 1, 64, None, gen=gen)
    run(case, 64, 32, warps_per_head)
    assert bool(case["out"][1].isnan().all()) and bool(case["lse"][1].isnan().all())
    assert not bool(case["out"][0].isnan().any())


def test_no_split_at_all_leaves_outputs(seed):
    """Compact offsets with no split request: zero accumulator rows, nothing written."""
    gen = torch.Generator().manual_seed(seed)
    case = make_case([0, 0, 1, 0], 2, 64, "finite+inf", gen=gen)
    assert case["o_accum"].shape[0] == 1
    run(case, 64, 32)
    check(case)


def test_cuda_graph_replay(seed):
    """Capture one launch, then change the inputs in place: each replay must follow them.

    A launch that missed torch's capture stream would run once eagerly and leave the graph empty;
    the outputs would then stay at the sentinel after a replay.
    """
    gen = torch.Generator().manual_seed(seed)
    counts, s_q, h_q = [3, 1, 40, 2], 2, 128
    case = make_case(counts, s_q, h_q, "finite+inf", gen=gen)
    cfg = CombineConfig(h_q=h_q, has_attn_sink=True, max_splits=64, arch=device_arch(torch.device("cuda")))
    compiled = compile_combine(cfg)
    args = [case[k] for k in ("lse_accum", "o_accum", "accum_offsets", "attn_sink", "out", "lse")]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch_combine(compiled, cfg, *args)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_combine(compiled, cfg, *args)

    for _ in range(3):
        fresh = make_case(counts, s_q, h_q, "finite+inf", gen=gen)
        for k in ("lse_accum", "o_accum", "attn_sink"):
            case[k].copy_(fresh[k])
        case["out"].fill_(OUT_SENTINEL)
        case["lse"].fill_(LSE_SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        check(case)
