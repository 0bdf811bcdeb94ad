"""GPU (SM90): ``cute_mla.flash_mla_sparse_fwd`` (sparse MLA prefill) against the float64 reference.

FlashMLA's own prefill suite (tests/test_flash_mla_sparse_prefill.py: its correctness,
with-features and corner case lists, inputs made as its tests/lib.py makes them, its tolerances)
at d_qk 576 and 512, for h_q 64 and 128 and for the small head counts 8, 16 and 32; then NaN in
every KV row no valid slot reads, ``out=`` (contiguous and a strided head slice), CUDA graph
replay with new indices, and ``torch.compile(fullgraph=True)``.

Every case draws fresh inputs from its own fixed seed (``PrefillCase.seed``: a hash of its name),
so a failure replays as is. The 70000-token cases (FlashMLA's grid-limit case) run one at a time in
a single test each, since the largest holds ~22 GB of q and out.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import cute_mla
from cute_mla.testing import (
    PREFILL_HEADS,
    SparsePrefillInputs,
    check_prefill,
    make_prefill_inputs,
    non_contiguous,
    prefill_corner_cases,
    prefill_correctness_cases,
    prefill_feature_cases,
)

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

D_V = 512


def run(x, out=None):
    """The op on inputs ``x`` (a SparsePrefillInputs), FlashMLA's positional order."""
    return cute_mla.flash_mla_sparse_fwd(x.q, x.kv, x.indices, x.sm_scale, x.d_v, attn_sink=x.attn_sink,
                                         topk_length=x.topk_length, out=out)


def check_layout(x, out, max_logits, lse):
    """FlashMLA's outputs: out (s_q, h_q, 512) bf16, max_logits and lse (s_q, h_q) fp32, on q's
    device, contiguous."""
    s_q, h_q, _ = x.q.shape
    assert out.shape == (s_q, h_q, D_V) and out.dtype == torch.bfloat16 and out.device == x.q.device
    for name, t in (("max_logits", max_logits), ("lse", lse)):
        assert t.shape == (s_q, h_q) and t.dtype == torch.float32 and t.device == x.q.device, name
        assert t.is_contiguous(), name
    assert out.is_contiguous()


def run_and_check(case):
    x = case.make_inputs("cuda")
    out, max_logits, lse = run(x)
    check_layout(x, out, max_logits, lse)
    ref = x.reference()
    torch.cuda.synchronize()
    check_prefill(out, max_logits, lse, *ref)


def _checked(cases):
    return [c for c in cases if c.check_correctness]


def _param(cases):
    return [pytest.param(c, id=c.name) for c in cases]


# ---------------------------------------------------------------- (a) FlashMLA's lists, h_q 64 and 128

MAIN_CASES = [c for h_q in (128, 64)
              for c in prefill_correctness_cases(h_q) + prefill_feature_cases(h_q) + _checked(prefill_corner_cases(h_q))]


@pytest.mark.parametrize("case", _param(MAIN_CASES))
def test_flashmla_cases(case):
    run_and_check(case)


# ---------------------------------------------------------------- (b) the same lists at h_q 8, 16, 32
#
# Every correctness and with-features case, and the s_q = 1 corner cases, at both d_qk. The four
# large corner shapes (s_q 1234 / 4096 with all-invalid rows, s_q 1024 with empty 64-blocks) run at
# one d_qk per head count (576 for h_q 8 and 32, 512 for h_q 16): the same index patterns as at
# h_q 64 / 128, kept to a third of the list to bound the suite's time.

SMALL_HEADS = (8, 16, 32)


def _small_head_corners(h_q):
    big_d_qk = 512 if h_q == 16 else 576
    return [c for c in _checked(prefill_corner_cases(h_q)) if c.s_q == 1 or c.d_qk == big_d_qk]


SMALL_CASES = [c for h_q in SMALL_HEADS
               for c in prefill_correctness_cases(h_q) + prefill_feature_cases(h_q) + _small_head_corners(h_q)]


@pytest.mark.parametrize("case", _param(SMALL_CASES))
def test_flashmla_cases_small_heads(case):
    run_and_check(case)


# ---------------------------------------------------------------- s_q = 70000 (grid limits)


def _check_70000(case):
    """FlashMLA's check_correctness=False case: the launch runs; here also rows on both sides of
    65535 (and a few random ones) against the reference, and no NaN anywhere."""
    x = case.make_inputs("cuda")
    out, max_logits, lse = run(x)
    check_layout(x, out, max_logits, lse)
    s_q = x.q.shape[0]
    g = torch.Generator().manual_seed(case.seed)
    rows = torch.cat([torch.tensor([0, 1, 65534, 65535, 65536, 65537, s_q - 2, s_q - 1]),
                      torch.randint(0, s_q, (8,), generator=g)]).cuda()
    ref = x.reference(rows)
    torch.cuda.synchronize()
    assert not torch.isnan(lse).any() and not torch.isnan(max_logits).any()
    assert not torch.isnan(out).any()
    check_prefill(out[rows], max_logits[rows], lse[rows], *ref)
    del x, out, max_logits, lse
    torch.cuda.empty_cache()


def test_s_q_70000():
    """h_q 64 and 128 (one after the other: up to ~22 GB of q and out at h_q 128)."""
    for h_q in (128, 64):
        for case in prefill_corner_cases(h_q):
            if not case.check_correctness:
                _check_70000(case)


def test_s_q_70000_small_heads():
    for h_q in SMALL_HEADS:
        for case in prefill_corner_cases(h_q):
            if not case.check_correctness:
                _check_70000(case)


# ---------------------------------------------------------------- (c) NaN in KV rows no valid slot reads


@pytest.mark.parametrize("topk_length", [False, True])
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [8, 32, 64, 128])
def test_nan_in_unread_kv_rows_changes_nothing(h_q, d_qk, topk_length):
    """Every KV row no valid slot reads is NaN (row 0, rows named only by invalid or past-
    topk_length slots, and the KV buffer's padding): out, max_logits and lse are the bits of the
    run without NaN, and match the reference."""
    s_q, s_kv, topk = 96, 65536, 512              # ~half the KV rows unread
    x = make_prefill_inputs(s_q, s_kv, topk, h_q, d_qk, attn_sink=True, topk_length=topk_length, all_invalid_rows=True,
                            seed=zlib.crc32(f"nan-{h_q}-{d_qk}-{topk_length}".encode()), device="cuda")
    idx = x.indices
    idx[idx == 0] = -1                                # row 0 is never read
    idx[:, :, 5::11] = s_kv                           # more invalid slots: s_kv, negative, huge
    idx[:, :, 7::13] = -7
    idx[:, :, 9::17] = 2**31 - 1
    clean = run(x)
    torch.cuda.synchronize()

    flat = idx[:, 0].long()
    valid = (flat >= 0) & (flat < s_kv)
    if topk_length:
        valid &= torch.arange(topk, device="cuda")[None] < x.topk_length[:, None].long()
    read = torch.zeros(s_kv, dtype=torch.bool, device="cuda")
    read[flat[valid]] = True
    assert not read[0] and (~read).sum() > s_kv // 4
    if topk_length:
        named = torch.zeros(s_kv, dtype=torch.bool, device="cuda")
        named[flat[(flat >= 0) & (flat < s_kv)]] = True
        assert (named & ~read).any(), "rows named only past topk_length exist"
    kv_nan = non_contiguous(x.kv, fill=float("nan"))  # padding NaN too
    kv_nan[~read] = float("nan")
    x_nan = type(x)(**{**vars(x), "kv": kv_nan})
    poisoned = run(x_nan)
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "max_logits", "lse"), clean, poisoned):
        assert not torch.isnan(b).any(), f"{name}: NaN reached the result"
        assert torch.equal(a, b), f"{name}: differs from the run without NaN"
    check_prefill(*poisoned, *x.reference())


# ---------------------------------------------------------------- (c2) logits whose running max moves


def _moving_max_inputs(h_q: int, d_qk: int, topk: int, pattern: str, sink: bool, seed: int):
    """Logits laid along each token's list so the rows' running max moves: up a ramp (every tile
    for short lists, every few tiles for long ones), by rare spikes, or by steps of a saw; a head's
    slope ``c_h`` (logit ~ c_h * f(position)) is random, zero or negative, so in one 64-head block
    some rows move and others never do. With invalid slots (-1), an empty row, and two fully
    masked tiles in another row. FlashMLA's random inputs barely move the max after a list's first
    tile."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    draw = dict(generator=g, device="cuda")
    s_q, s_kv = 12, topk + 64
    scale = d_qk ** -0.5
    u = torch.randn(d_qk, **draw)
    u /= u.norm()
    pos = torch.arange(topk, device="cuda", dtype=torch.float32)
    if pattern == "ramp":
        f = pos / topk * 60.0
    elif pattern == "spikes":
        f = torch.where(torch.rand(topk, **draw) < 0.03, 25.0, 0.0)
    else:   # "saw"
        f = (pos // 64) % 3 * 10.0
    rows = torch.randperm(s_kv, **draw)[:topk]
    kv = torch.randn(s_kv, d_qk, **draw) * 0.3
    kv[rows] += f[:, None] * u[None, :] / scale
    c = torch.rand(s_q, h_q, **draw) * 2.0 - 0.5
    c[:, ::7] = 0.0
    q = c[:, :, None] * u[None, None, :] + torch.randn(s_q, h_q, d_qk, **draw) * 0.05
    idx = rows.int().repeat(s_q, 1)
    idx[torch.rand(idx.shape, **draw) < 0.1] = -1
    idx[0] = -1
    if topk >= 192:
        idx[1, 64:192] = -1
    attn_sink = None
    if sink:
        attn_sink = torch.randn(h_q, **draw) * 3.0
        attn_sink[::5] = float("-inf")
    return SparsePrefillInputs(q.bfloat16(), kv.bfloat16().view(s_kv, 1, d_qk), idx.view(s_q, 1, topk), scale,
                               attn_sink, None)


@pytest.mark.parametrize("pattern", ["ramp", "spikes", "saw"])
@pytest.mark.parametrize("topk", [128, 448, 2048])
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [64, 128, 16])
def test_running_max_that_moves(h_q, d_qk, topk, pattern):
    """The rescaling of O, P and the row sums where the running max moves within a pair, across
    pairs, for some rows of a block and not others: out, max_logits and lse match the reference
    within FlashMLA's tolerances."""
    x = _moving_max_inputs(h_q, d_qk, topk, pattern, sink=topk != 448,
                           seed=zlib.crc32(f"moving-{h_q}-{d_qk}-{topk}-{pattern}".encode()))
    out, max_logits, lse = run(x)
    torch.cuda.synchronize()
    check_prefill(out, max_logits, lse, *x.reference())


# The ping-pong's knobs off their rule (the paths a variant takes): a plain running max, O rescaled
# in every warp, the row prefetch at rows that fit the L2 (the rule turns it on only past it), and
# P as exp2(S * scale - m) in two ops (the kernel that a scale ``ffma_exp`` cannot take runs).
OTHER_KNOBS = {"eager_max": dict(lazy_max=False, skip_unit_scale=False),
               "every_rescale": dict(skip_unit_scale=False),
               "prefetch": dict(prefetch_rows=True),
               "two_op_exp": dict(ffma_exp=False)}


@pytest.mark.parametrize("knobs", list(OTHER_KNOBS))
@pytest.mark.parametrize("pattern", ["ramp", "saw"])
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [64, 128])
def test_running_max_that_moves_with_other_knobs(h_q, d_qk, pattern, knobs):
    """The moving-max inputs (an odd tile count: the pair without its odd tile too) through the
    public call's eager path with the ping-pong's knobs set off their rule: the reference within
    FlashMLA's tolerances."""
    from cute_mla.interface.prefill import eager_call
    from cute_mla.kernels.sm90.prefill_config import Sm90PrefillTuning

    x = _moving_max_inputs(h_q, d_qk, 448, pattern, sink=True,
                           seed=zlib.crc32(f"knobs-{h_q}-{d_qk}-{pattern}-{knobs}".encode()))
    out, max_logits, lse = eager_call(x.q, x.kv, x.indices, x.sm_scale, D_V, x.attn_sink, x.topk_length, None,
                                      Sm90PrefillTuning(**OTHER_KNOBS[knobs]))
    torch.cuda.synchronize()
    check_prefill(out, max_logits, lse, *x.reference())


# Scales the ping-pong's one-FFMA softmax cannot take (its config's ``takes_scale``), which the
# launcher runs on the config's ``any_scale`` form, and the least one it takes.
SCALES = {"negative": lambda d_qk: -d_qk ** -0.5, "zero": lambda d_qk: 0.0, "subnormal": lambda d_qk: 1e-39,
          "least_normal": lambda d_qk: 2.0 ** -126}


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [64, 128, 16])
def test_any_scale(h_q, d_qk, scale):
    """The moving-max inputs at a negative, a zero, a subnormal and the least normal scale through
    the public call: the reference within FlashMLA's tolerances (a max over scaled logits is a min
    of the raw ones at a negative scale; masked slots stay out at every scale)."""
    x = _moving_max_inputs(h_q, d_qk, 448, "saw", sink=True, seed=zlib.crc32(f"scale-{h_q}-{d_qk}-{scale}".encode()))
    x.sm_scale = SCALES[scale](d_qk)
    out, max_logits, lse = run(x)
    torch.cuda.synchronize()
    check_prefill(out, max_logits, lse, *x.reference())


# ---------------------------------------------------------------- (d) out=


@pytest.mark.parametrize("layout", ["contiguous", "head_slice"])
@pytest.mark.parametrize("h_q", PREFILL_HEADS)
def test_out_is_written_in_place(h_q, layout):
    """A given ``out`` (contiguous, or heads [3, 3 + h_q) of a (s_q, 2 h_q + 5, 512) tensor) is
    the returned tensor, holds the result of the call without ``out`` bit for bit, and nothing
    around the slice is touched."""
    d_qk = 576 if h_q in (8, 64) else 512
    x = make_prefill_inputs(150, 3000, 384, h_q, d_qk, attn_sink=True, topk_length=True, all_invalid_rows=True,
                            seed=zlib.crc32(f"out-{h_q}-{layout}".encode()), device="cuda")
    s_q = x.q.shape[0]
    nan = float("nan")
    if layout == "contiguous":
        big = torch.full((s_q, h_q, D_V), nan, dtype=torch.bfloat16, device="cuda")
        out = big
    else:
        big = torch.full((s_q, 2 * h_q + 5, D_V), nan, dtype=torch.bfloat16, device="cuda")
        out = big[:, 3:3 + h_q]
        assert not out.is_contiguous() and out.stride() == ((2 * h_q + 5) * D_V, D_V, 1)
    o, max_logits, lse = run(x, out=out)
    fresh = run(x)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr() and o.shape == out.shape and o.stride() == out.stride()
    assert torch.equal(o, out) and torch.equal(out, fresh[0])
    assert torch.equal(max_logits, fresh[1]) and torch.equal(lse, fresh[2])
    if layout == "head_slice":
        assert big[:, :3].isnan().all() and big[:, 3 + h_q:].isnan().all(), "out= wrote outside its slice"
    check_prefill(out, max_logits, lse, *x.reference())


# ---------------------------------------------------------------- (e) CUDA graphs


@pytest.mark.parametrize("h_q,d_qk,topk_length", [(64, 576, True), (128, 512, False), (16, 512, True), (8, 576, False)])
def test_cuda_graph_replay_with_new_indices(h_q, d_qk, topk_length):
    """A captured call replayed after new q, indices, sinks (and lengths) are copied into the same
    input tensors: each replay equals an eager call on those inputs, bit for bit."""
    s_q, s_kv, topk = 200, 4096, 512
    tag = f"graph-{h_q}-{d_qk}-{topk_length}"

    def inputs(step):
        return make_prefill_inputs(s_q, s_kv, topk, h_q, d_qk, attn_sink=True, topk_length=topk_length,
                                   all_invalid_rows=True, seed=zlib.crc32(f"{tag}-{step}".encode()), device="cuda")

    x = inputs(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, max_logits, lse = run(x)
    for step in range(1, 4):
        y = inputs(step)
        x.q.copy_(y.q)
        x.indices.copy_(y.indices)
        x.attn_sink.copy_(y.attn_sink)
        if topk_length:
            x.topk_length.copy_(y.topk_length)
        for t in (out, max_logits, lse):
            t.fill_(float("nan"))
        g.replay()
        eager = run(x)
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "max_logits", "lse"), (out, max_logits, lse), eager):
            assert torch.equal(a, b), f"replay {step}: {name} differs from the eager call"
    check_prefill(out, max_logits, lse, *x.reference())


# ---------------------------------------------------------------- (f) torch.compile


def _attention(q, kv, indices, attn_sink, topk_length, out=None):
    """An engine's layer around the op: traced whole under fullgraph."""
    o, max_logits, lse = cute_mla.flash_mla_sparse_fwd(q, kv, indices, q.shape[-1] ** -0.5, 512, attn_sink=attn_sink,
                                                       topk_length=topk_length, out=out)
    return o * 2, max_logits, lse - max_logits


@pytest.mark.parametrize("h_q,d_qk,topk_length,with_out", [(64, 576, True, False), (128, 512, False, True),
                                                           (16, 512, True, True)])
def test_compiled_equals_eager(h_q, d_qk, topk_length, with_out):
    torch._dynamo.reset()
    x = make_prefill_inputs(100, 2048, 256, h_q, d_qk, attn_sink=True, topk_length=topk_length, all_invalid_rows=True,
                            seed=zlib.crc32(f"compile-{h_q}-{d_qk}".encode()), device="cuda")
    args = (x.q, x.kv, x.indices, x.attn_sink, x.topk_length)
    out_e = torch.full((100, h_q, D_V), float("nan"), dtype=torch.bfloat16, device="cuda") if with_out else None
    out_c = torch.full((100, h_q, D_V), float("nan"), dtype=torch.bfloat16, device="cuda") if with_out else None
    eager = _attention(*args, out=out_e)
    compiled = torch.compile(_attention, fullgraph=True)(*args, out=out_c)
    torch.cuda.synchronize()
    for name, a, b in zip(("out * 2", "max_logits", "lse - max_logits"), compiled, eager):
        assert torch.equal(a, b), f"{name} differs from eager"
    if with_out:
        assert torch.equal(out_c, out_e) and not out_c.isnan().any()
