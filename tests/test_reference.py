"""The reference against a direct float64 computation, token by token (no vectorized tricks)."""

import math

import pytest
import torch

from cute_mla.reference import sparse_decode_reference
from cute_mla.testing import make_inputs



def assert_matches_float64(out, lse, rout, rlse):
    """The fp32 oracle against a float64 computation: the same empty rows (lse +inf), lse and out
    within 1e-5, no NaN."""
    assert torch.equal(torch.isinf(lse), torch.isinf(rlse)) and (lse[torch.isinf(lse)] > 0).all()
    fin = torch.isfinite(rlse)
    assert fin.any(), "the case must have rows with valid tokens"
    assert (lse[fin].double() - rlse[fin]).abs().max() < 1e-5
    assert (out.double() - rout).abs().max() < 1e-5
    assert not torch.isnan(out).any()

def decode_v32_float64(k_cache):
    """A V3.2 cache decoded byte by byte from its address formula, independent of the format module:
    token ``t`` of a ``page``-token block has its 656-B row at ``(t // page) * stride(0) + (t % page)
    * 656``: 512 e4m3 NoPE (group g = dims [128g, 128g + 128)), 4 fp32 scales, 64 bf16 RoPE. Each
    NoPE key is float32(e4m3) * scale rounded to bf16 once, as the format defines it. Returns
    (num_tokens, 576) float64."""
    nb, page = k_cache.shape[0], k_cache.shape[1]
    flat = torch.empty(0, dtype=torch.uint8).set_(k_cache.untyped_storage())
    base0, stride0 = k_cache.storage_offset() * k_cache.element_size(), k_cache.stride(0) * k_cache.element_size()
    keys = []
    for t in range(nb * page):
        row = flat[base0 + (t // page) * stride0 + (t % page) * 656:][:656]
        nope = row[:512].view(torch.float8_e4m3fn).float()
        scales = row[512:528].view(torch.float32).repeat_interleave(128)
        rope = row[528:656].view(torch.bfloat16).double()
        keys.append(torch.cat([(nope * scales).to(torch.bfloat16).double(), rope]))
    return torch.stack(keys)


def direct_float64(q, k_cache, indices, scale, sink, topk_length):
    b, s_q, h_q, _ = q.shape
    kv = decode_v32_float64(k_cache)
    n_tok = kv.shape[0]
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.zeros(b, h_q, s_q, dtype=torch.float64)
    for i in range(b):
        for s in range(s_q):
            ids = [int(t) for k, t in enumerate(indices[i, s].tolist())
                   if 0 <= t < n_tok and (topk_length is None or k < int(topk_length[i]))]
            for h in range(h_q):
                if not ids:
                    lse[i, h, s] = math.inf
                    continue
                qv = q[i, s, h].double()
                logits = torch.stack([(qv * kv[t]).sum() * scale for t in ids])
                m = logits.max()
                w = torch.exp(logits - m)
                l = w.sum()
                lse[i, h, s] = (torch.log(l) + m).item()
                o = sum(w[j] * kv[t, :512] for j, t in enumerate(ids)) / l
                if sink is not None:
                    o = o / (1 + math.exp(min(float(sink[h]) - lse[i, h, s].item(), 700))) if sink[h] != math.inf else o * 0
                out[i, s, h] = o
    return out, lse


@pytest.mark.parametrize("case", [
    dict(b=2, s_q=2, topk=64, page_block_size=61, with_sink=True, with_topk_length=True, out_of_range_frac=0.1, all_invalid_rows=1),
    dict(b=3, s_q=1, topk=128, page_block_size=2, with_sink=False, with_topk_length=False, power_of_two_scales=False, all_invalid_rows=1),
])
def test_reference_matches_float64(seed, case):
    x = make_inputs(h_q=64, num_tokens=300, invalid_frac=0.3, **case)
    while x.topk_length is not None and x.topk_length[-1] < 8:   # request 0 has length 0: keep one non-empty
        x = make_inputs(h_q=64, num_tokens=300, invalid_frac=0.3, **case)
    if x.attn_sink is not None:
        x.attn_sink[:3] = torch.tensor([math.inf, -math.inf, 0.5])
    out, lse = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, x.attn_sink, x.topk_length)
    rout, rlse = direct_float64(x.q, x.k_cache, x.indices, x.softmax_scale, x.attn_sink, x.topk_length)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_matches_float64(out, lse, rout, rlse)


def test_empty_rows_give_zero_and_plus_inf(seed):
    x = make_inputs(2, 1, 64, 64, num_tokens=100, with_sink=True)
    x.indices[0] = -1
    tl = torch.tensor([64, 0], dtype=torch.int32)   # request 1: topk_length 0
    out, lse = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, x.attn_sink, tl)
    assert (out == 0).all()
    assert torch.isposinf(lse).all()


def test_sink_scales_out_not_lse(seed):
    x = make_inputs(1, 1, 64, 64, num_tokens=100, invalid_frac=0.0)
    o0, l0 = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale)
    sink = torch.zeros(64)
    sink[0], sink[1] = math.inf, -math.inf
    o1, l1 = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, attn_sink=sink)
    assert torch.equal(l0, l1)
    assert (o1[0, 0, 0] == 0).all()
    torch.testing.assert_close(o1[0, 0, 1], o0[0, 0, 1])
    factor = 1 / (1 + torch.exp(-l0[0, 2, 0]))
    torch.testing.assert_close(o1[0, 0, 2], o0[0, 0, 2] * factor)


# ------------------------------------------------------------------------------- V4 and extra pool


def decode_v4_float64(k_cache):
    """A V4 cache decoded byte by byte from its address formula, independent of the format module:
    token ``t`` of a ``page``-token block ``t // page`` has its data row at ``blk * stride(0) + row
    * 576`` (448 e4m3, 64 bf16 RoPE) and its 7 ue8m0 scales at ``blk * stride(0) + page * 576 + row
    * 8``. Returns (num_tokens, 512) float64."""
    nb, page = k_cache.shape[0], k_cache.shape[1]
    flat = torch.empty(0, dtype=torch.uint8).set_(k_cache.untyped_storage())
    base0, stride0 = k_cache.storage_offset() * k_cache.element_size(), k_cache.stride(0) * k_cache.element_size()
    keys = []
    for t in range(nb * page):
        base = base0 + (t // page) * stride0
        row = t % page
        data = flat[base + row * 576: base + row * 576 + 576]
        scales = flat[base + page * 576 + row * 8: base + page * 576 + row * 8 + 7]
        nope = data[:448].view(torch.float8_e4m3fn).double()
        scale = torch.pow(2.0, scales.double() - 127).repeat_interleave(64)
        rope = data[448:].view(torch.bfloat16).double()
        keys.append(torch.cat([nope * scale, rope]))
    return torch.stack(keys)


def _valid_ids(indices_row, n_tok, length):
    return [int(t) for k, t in enumerate(indices_row.tolist())
            if 0 <= t < n_tok and (length is None or k < int(length))]


def direct_float64_v4(x):
    """Joint softmax over the main and the extra list, token by token, V = all 512 dims."""
    b, s_q, h_q, _ = x.q.shape
    kv = decode_v4_float64(x.k_cache)
    ekv = decode_v4_float64(x.extra_k_cache) if x.extra_k_cache is not None else None
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i in range(b):
        for s in range(s_q):
            keys = [kv[t] for t in _valid_ids(x.indices[i, s], kv.shape[0],
                                              None if x.topk_length is None else x.topk_length[i])]
            if ekv is not None:
                keys += [ekv[t] for t in _valid_ids(x.extra_indices[i, s], ekv.shape[0],
                                                    None if x.extra_topk_length is None else x.extra_topk_length[i])]
            if not keys:
                continue
            k = torch.stack(keys)                                  # (n, 512)
            logits = (k @ x.q[i, s].double().T) * x.softmax_scale  # (n, h)
            m = logits.max(dim=0).values
            w = torch.exp(logits - m)
            l = w.sum(dim=0)
            lse[i, :, s] = torch.log(l) + m
            o = (w.T @ k) / l[:, None]                             # (h, 512): V is the whole key
            if x.attn_sink is not None:
                for h in range(h_q):
                    sink = float(x.attn_sink[h])
                    o[h] *= 0.0 if sink == math.inf else 1 / (1 + math.exp(min(sink - lse[i, h, s].item(), 700)))
            out[i, s] = o
    return out, lse


V4_CASES = [
    # main list and extra pool with lengths, out-of-range entries, an all-invalid row, sinks
    dict(b=3, s_q=2, topk=64, page_block_size=53, extra_topk=128, extra_num_tokens=300, extra_page_block_size=2,
         with_topk_length=True, with_extra_topk_length=True, with_sink=True, out_of_range_frac=0.1, all_invalid_rows=1),
    # extra pool without lengths, the same page size both pools, padded page blocks
    dict(b=2, s_q=3, topk=128, page_block_size=64, extra_topk=64, extra_num_tokens=130, block_stride_pad=2,
         with_sink=False, out_of_range_frac=0.05),
    # V4 without an extra pool
    dict(b=2, s_q=1, topk=128, page_block_size=61, with_topk_length=True, with_sink=True, all_invalid_rows=1),
]


@pytest.mark.parametrize("case", V4_CASES)
def test_v4_reference_matches_float64(seed, case):
    x = make_inputs(h_q=64, d_qk=512, num_tokens=200, invalid_frac=0.3, **case)
    while torch.isinf(x.reference()[1]).all():     # lengths of 0 and the all-invalid row: keep one non-empty row
        x = make_inputs(h_q=64, d_qk=512, num_tokens=200, invalid_frac=0.3, **case)
    if x.attn_sink is not None:
        x.attn_sink[:3] = torch.tensor([math.inf, -math.inf, 0.5])
    out, lse = x.reference()
    rout, rlse = direct_float64_v4(x)
    assert out.shape == (x.q.shape[0], x.q.shape[1], 64, 512) and lse.shape == (x.q.shape[0], 64, x.q.shape[1])
    assert_matches_float64(out, lse, rout, rlse)
    if case.get("all_invalid_rows"):
        assert torch.isinf(lse).any(), "an all-invalid row (both lists) has lse +inf"
    # the float64 reference agrees with the fp32 one on every row
    o64, l64 = x.reference(compute_dtype=torch.float64)
    assert (o64 - rout).abs().max() < 1e-9 and torch.equal(torch.isinf(l64), torch.isinf(rlse))


def test_chunks_of_query_tokens_give_the_same_bits(seed):
    """Query tokens are independent: one at a time, in chunks of 5 and all 12 at once give the same
    bits, both lists included; the default chunk keeps a chunk's gathered keys in the byte budget."""
    from cute_mla.reference import CHUNK_KEY_BYTES, key_chunk_rows

    x = make_inputs(3, 4, 64, 128, d_qk=512, num_tokens=500, extra_topk=192, extra_num_tokens=700,
                    invalid_frac=0.2, with_topk_length=True, with_extra_topk_length=True, with_sink=True)
    whole = x.reference(chunk_rows=12)
    for got in (x.reference(chunk_rows=1), x.reference(chunk_rows=5), x.reference()):
        assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(got, whole))
    # V4 with an extra list of 1024: 1152 keys of 512 fp32 a token
    assert key_chunk_rows(1152, 512, torch.float32) == CHUNK_KEY_BYTES // (1152 * 2048)
    assert key_chunk_rows(1152, 512, torch.float64, budget=1) == 1


def test_v4_joint_softmax_is_the_merge_of_both_lists(seed):
    """The joint result equals the two lists' separate results merged by their lse (a split-KV
    combine of two pieces), and the extra list alone equals the extra pool as a main pool."""
    x = make_inputs(3, 2, 64, 128, d_qk=512, num_tokens=500, extra_topk=192, extra_num_tokens=700,
                    extra_page_block_size=7, with_topk_length=True, with_extra_topk_length=True, invalid_frac=0.2,
                    nan_unused=False)   # (the lengths are set below)
    x.topk_length[:] = torch.tensor([0, 100, 128], dtype=torch.int32)
    x.extra_topk_length[:] = torch.tensor([150, 0, 192], dtype=torch.int32)
    o, l = x.reference(compute_dtype=torch.float64)
    om, lm = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, None, x.topk_length,
                                     compute_dtype=torch.float64)
    oe, le = sparse_decode_reference(x.q, x.extra_k_cache, x.extra_indices, x.softmax_scale, None,
                                     x.extra_topk_length, compute_dtype=torch.float64)
    lm_, le_ = (torch.where(torch.isposinf(t), torch.full_like(t, -math.inf), t) for t in (lm, le))
    g = torch.logaddexp(lm_, le_)
    wm, we = (torch.exp(t - g).transpose(1, 2)[..., None] for t in (lm_, le_))
    torch.testing.assert_close(l, g, rtol=0, atol=1e-12)
    torch.testing.assert_close(o, wm * om + we * oe, rtol=0, atol=1e-12)
    torch.testing.assert_close(o[0], oe[0], rtol=0, atol=1e-12)   # request 0: main list empty
    torch.testing.assert_close(o[1], om[1], rtol=0, atol=1e-12)   # request 1: extra list empty


def test_v4_lengths_out_of_range_and_invalid_indices(seed):
    """A length past the list is the whole list, a negative one an empty list; indices that are
    negative or past a pool's last token are invalid in that pool (the extra pool has its own size)."""
    x = make_inputs(2, 1, 64, 64, d_qk=512, num_tokens=256, extra_topk=128, extra_num_tokens=128,
                    extra_page_block_size=2, invalid_frac=0.0, nan_unused=False)
    tl = torch.tensor([1000, -5], dtype=torch.int32)
    etl = torch.tensor([-1, 129], dtype=torch.int32)
    kw = dict(extra_k_cache=x.extra_k_cache, extra_indices=x.extra_indices)
    a = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, None, tl, extra_topk_length=etl, **kw)
    b = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, None, torch.tensor([64, 0]),
                                extra_topk_length=torch.tensor([0, 128]), **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # main index 200 is a valid main token; in the extra pool (128 tokens) it is out of range
    idx = x.indices.clone()
    eidx = x.extra_indices.clone()
    idx[..., 0], eidx[..., 0] = 200, 200
    eidx[..., 1], eidx[..., 2] = -7, 2**31 - 1
    c = sparse_decode_reference(x.q, x.k_cache, idx, x.softmax_scale, extra_k_cache=x.extra_k_cache, extra_indices=eidx)
    d = sparse_decode_reference(x.q, x.k_cache, idx, x.softmax_scale, extra_k_cache=x.extra_k_cache,
                                extra_indices=torch.where(torch.arange(128) < 3, -1, eidx))
    assert torch.equal(c[0], d[0]) and torch.equal(c[1], d[1])
    e = sparse_decode_reference(x.q, x.k_cache, torch.where(torch.arange(64) < 1, -1, idx), x.softmax_scale,
                                extra_k_cache=x.extra_k_cache, extra_indices=eidx)
    assert not torch.equal(c[1], e[1])      # ... while in the main pool (256 tokens) index 200 counts


def test_v4_empty_rows_and_sinks(seed):
    x = make_inputs(3, 2, 64, 128, d_qk=512, num_tokens=300, extra_topk=64, extra_num_tokens=200,
                    with_sink=True, invalid_frac=0.1)
    x.attn_sink[:2] = torch.tensor([math.inf, -math.inf])
    x.indices[0] = -1                                      # request 0: main list all invalid ...
    x.extra_indices[0, 0] = -1                             # ... and token 0's extra list too
    etl = torch.tensor([64, 0, 64], dtype=torch.int32)     # request 1: extra list empty
    tl = torch.tensor([128, 128, 0], dtype=torch.int32)    # request 2: main list empty
    out, lse = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, x.attn_sink, tl,
                                       extra_k_cache=x.extra_k_cache, extra_indices=x.extra_indices,
                                       extra_topk_length=etl)
    assert (out[0, 0] == 0).all() and torch.isposinf(lse[0, :, 0]).all()     # no valid token: 0 and +inf
    assert torch.isfinite(lse[0, :, 1]).all() and torch.isfinite(lse[1:]).all()
    assert (out[:, :, 0] == 0).all()                                          # sink +inf: out 0
    o0, l0 = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, None, tl,
                                     extra_k_cache=x.extra_k_cache, extra_indices=x.extra_indices,
                                     extra_topk_length=etl)
    assert torch.equal(lse, l0)                                               # the sink leaves lse alone
    assert torch.equal(out[:, :, 1], o0[:, :, 1])                             # sink -inf: no effect
    assert not torch.isnan(out).any()


def test_v4_reference_accepts_any_byte_view_and_stride(seed):
    x = make_inputs(2, 1, 64, 64, d_qk=512, num_tokens=128, page_block_size=53, extra_topk=64, block_stride_pad=3)
    o, l = x.reference()
    for view in (torch.int8, torch.float8_e4m3fn):
        o2, l2 = sparse_decode_reference(x.q, x.k_cache.view(view), x.indices, x.softmax_scale,
                                         extra_k_cache=x.extra_k_cache.view(view).squeeze(2), extra_indices=x.extra_indices)
        assert torch.equal(o, o2) and torch.equal(l, l2)


def test_reference_rejects_half_an_extra_pool():
    x = make_inputs(1, 1, 64, 64, d_qk=512, num_tokens=128, extra_topk=64)
    with pytest.raises(ValueError, match="extra_k_cache and extra_indices"):
        sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, extra_indices=x.extra_indices)
    with pytest.raises(ValueError, match="extra_topk_length"):
        sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale,
                                extra_topk_length=torch.zeros(1, dtype=torch.int32))


def test_make_inputs_v4_poisons_unused_slots_of_both_pools(seed):
    """Every data row and scale row of a token no valid index reads is NaN bytes, in both pools;
    the others are the quantizer's bytes."""
    from cute_mla.formats import V4, dequantize_v4

    x = make_inputs(2, 2, 64, 64, d_qk=512, num_tokens=300, page_block_size=53, extra_topk=128,
                    extra_num_tokens=200, extra_page_block_size=2, with_topk_length=True, with_extra_topk_length=True)
    assert x.k_cache.stride(0) == V4.block_stride(53) and x.extra_k_cache.stride(0) == V4.block_stride(2)
    for cache, idx, length in ((x.k_cache, x.indices, x.topk_length), (x.extra_k_cache, x.extra_indices, x.extra_topk_length)):
        n = cache.shape[0] * cache.shape[1]
        used = torch.zeros(n, dtype=torch.bool)
        for i in range(idx.shape[0]):
            for s in range(idx.shape[1]):
                used[_valid_ids(idx[i, s], n, length[i])] = True
        raw = decode_v4_float64(cache)
        assert torch.isnan(raw[~used]).all() and not torch.isnan(raw[used]).any()
        assert torch.equal(dequantize_v4(cache).reshape(n, 512).isnan().all(dim=1), ~used)
        # a poisoned token's scale row is 0xFF in all 8 bytes (pad included)
        t = int((~used).nonzero()[0])
        flat = torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage())
        page = cache.shape[1]
        at = cache.storage_offset() + (t // page) * cache.stride(0) + page * 576 + (t % page) * 8
        assert flat[at: at + 8].tolist() == [0xFF] * 8


# ------------------------------------------------------------------------------- sparse prefill


def prefill_brute_force(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """FlashMLA's sparse prefill definition one (row, head) at a time in float64 with Python's
    math: (out, max_logits, lse); a row with no valid slot is out 0, max_logits -inf, lse +inf."""
    s_q, h_q, _ = q.shape
    s_kv = kv.shape[0]
    out = torch.zeros(s_q, h_q, d_v, dtype=torch.float64)
    max_logits = torch.full((s_q, h_q), -math.inf, dtype=torch.float64)
    lse = torch.full((s_q, h_q), math.inf, dtype=torch.float64)
    for i in range(s_q):
        n = indices.shape[-1] if topk_length is None else int(topk_length[i])
        ids = [t for j, t in enumerate(indices[i, 0].tolist()) if j < n and 0 <= t < s_kv]
        if not ids:
            continue
        for h in range(h_q):
            qv = q[i, h].double()
            logits = [float((qv * kv[t, 0].double()).sum()) * sm_scale for t in ids]
            m = max(logits)
            l = m + math.log(sum(math.exp(x - m) for x in logits))
            o = sum(math.exp(x - l) * kv[t, 0, :d_v].double() for x, t in zip(logits, ids))
            if attn_sink is not None:
                sink = float(attn_sink[h])
                o = o * (0.0 if sink == math.inf else 1 / (1 + math.exp(min(sink - l, 700))))
            out[i, h], max_logits[i, h], lse[i, h] = o, m, l
    return out, max_logits, lse


def assert_prefill_matches(got, want):
    """fp32 reference results against float64 ones: dtypes, the same +-inf positions, values to
    fp32 precision, no NaN."""
    for name, g, w in zip(("out", "max_logits", "lse"), got, want):
        assert g.dtype == torch.float32, name
        assert g.shape == w.shape, name
        assert not torch.isnan(g).any(), name
        assert torch.equal(torch.isposinf(g), torch.isposinf(w)), name
        assert torch.equal(torch.isneginf(g), torch.isneginf(w)), name
        fin = torch.isfinite(w)
        err = (g.double()[fin] - w[fin]).abs()
        assert (err <= 2e-7 * w[fin].abs() + 1e-7).all(), f"{name}: max err {err.max().item():.3e}"


PREFILL_REF_CASES = [
    # (s_q, s_kv, topk, h_q, d_qk, sink, topk_length, all-invalid row): s_kv < topk pads with invalid candidates
    (6, 95, 128, 4, 576, True, True, True),
    (5, 300, 128, 3, 512, True, False, True),
    (4, 64, 192, 2, 576, False, True, False),
    (3, 1000, 64, 5, 512, False, False, False),
]


@pytest.mark.parametrize("case", PREFILL_REF_CASES)
def test_prefill_reference_matches_brute_force(case):
    from cute_mla.reference import sparse_prefill_reference
    from cute_mla.testing import make_prefill_inputs

    s_q, s_kv, topk, h_q, d_qk, sink, tl, all_invalid = case
    x = make_prefill_inputs(s_q, s_kv, topk, h_q, d_qk, attn_sink=sink, topk_length=tl, seed=sum(case[:5]))
    assert x.q.stride(-1) == 1 and not x.q.is_contiguous() and not x.kv.is_contiguous()
    if sink:
        x.attn_sink[:3] = torch.tensor([math.inf, -math.inf, 0.3])[:h_q]
    if tl:
        x.topk_length[0] = 0                           # an empty list ...
        x.topk_length[-1] = min(int(x.topk_length[-1]), 37) or 37   # ... and a short one
    if all_invalid:
        x.indices[1] = torch.tensor([-1, s_kv, -2**31, 2**31 - 1], dtype=torch.int32).repeat(topk // 4)
    got = sparse_prefill_reference(x.q, x.kv, x.indices, x.sm_scale, 512, x.attn_sink, x.topk_length)
    want = prefill_brute_force(x.q, x.kv, x.indices, x.sm_scale, 512, x.attn_sink, x.topk_length)
    assert_prefill_matches(got, want)
    assert torch.isfinite(want[2]).any(), "the case needs rows with valid slots"
    if tl or all_invalid:
        assert torch.isposinf(want[2]).any() and torch.isposinf(got[2]).any()
    # the float64 oracle of every chunk size gives the same bits (rows are independent)
    small = sparse_prefill_reference(x.q, x.kv, x.indices, x.sm_scale, 512, x.attn_sink, x.topk_length, chunk_bytes=1)
    assert all(torch.equal(a, b) for a, b in zip(got, small))
    # and the inputs' method is the same call
    assert all(torch.equal(a, b) for a, b in zip(got, x.reference()))
    rows = torch.tensor([s_q - 1, 0])
    assert all(torch.equal(a[rows], b) for a, b in zip(got, x.reference(rows)))


def test_prefill_reference_empty_rows_whatever_the_sink():
    """Empty rows (topk_length 0, all indices invalid, a negative topk_length): out 0, max_logits
    -inf, lse +inf, for sinks +inf, -inf and finite."""
    from cute_mla.reference import sparse_prefill_reference
    from cute_mla.testing import make_prefill_inputs

    x = make_prefill_inputs(5, 200, 64, 3, 576, seed=1)
    x.indices[1] = -1
    x.indices[2] = torch.tensor([200, 114514, -123456, 2**31 - 1], dtype=torch.int32).repeat(16)
    tl = torch.tensor([0, 64, 64, -5, 64], dtype=torch.int32)
    sink = torch.tensor([math.inf, -math.inf, 0.7])
    for s in (None, sink):
        out, ml, lse = sparse_prefill_reference(x.q, x.kv, x.indices, x.sm_scale, attn_sink=s, topk_length=tl)
        empty = torch.tensor([True, True, True, True, False])
        assert (out[empty] == 0).all() and torch.isneginf(ml[empty]).all() and torch.isposinf(lse[empty]).all()
        assert torch.isfinite(ml[~empty]).all() and torch.isfinite(lse[~empty]).all()
        assert not torch.isnan(out).any()


def test_prefill_reference_sink_scales_out_only():
    """+inf sink: out 0; -inf: no effect; finite: out scaled by 1/(1 + exp(sink - lse)); lse and
    max_logits never change."""
    from cute_mla.reference import sparse_prefill_reference
    from cute_mla.testing import make_prefill_inputs

    x = make_prefill_inputs(4, 500, 128, 4, 512, seed=2)
    o0, m0, l0 = sparse_prefill_reference(x.q, x.kv, x.indices, x.sm_scale)
    sink = torch.tensor([math.inf, -math.inf, 0.0, 3.5])
    o1, m1, l1 = sparse_prefill_reference(x.q, x.kv, x.indices, x.sm_scale, attn_sink=sink)
    assert torch.equal(m0, m1) and torch.equal(l0, l1)
    assert (o1[:, 0] == 0).all()
    torch.testing.assert_close(o1[:, 1], o0[:, 1], rtol=1e-6, atol=0)
    for h in (2, 3):
        factor = 1 / (1 + torch.exp(sink[h].double() - l0[:, h].double()))
        torch.testing.assert_close(o1[:, h].double(), o0[:, h].double() * factor[:, None], rtol=1e-6, atol=1e-9)
    # max_logits is sm_scale * q.k in natural units, lse >= max_logits
    assert (l0 >= m0).all() and (l0 <= m0 + math.log(128) + 1e-5).all()


@pytest.mark.parametrize("tl", [False, True])
def test_prefill_reference_nan_in_unread_kv_rows(tl):
    """NaN in every KV row no valid slot reads (row 0, the rows only slots past topk_length name)
    changes nothing, bit for bit."""
    from cute_mla.reference import sparse_prefill_reference
    from cute_mla.testing import make_prefill_inputs

    x = make_prefill_inputs(6, 700, 128, 2, 576, attn_sink=True, topk_length=tl, all_invalid_rows=True, seed=3)
    x.indices[x.indices == 0] = -1                    # row 0 (what invalid slots gather) is never read
    if tl:
        x.topk_length[1] = 0
    clean = sparse_prefill_reference(x.q, x.kv, x.indices, x.sm_scale, 512, x.attn_sink, x.topk_length)
    idx = x.indices[:, 0].long()
    valid = (idx >= 0) & (idx < 700)
    if tl:
        valid &= torch.arange(128)[None] < x.topk_length[:, None].long()
    read = torch.zeros(700, dtype=torch.bool)
    read[idx[valid]] = True
    assert not read[0] and (~read).sum() > 100
    if tl:   # rows only named past topk_length exist
        past = torch.zeros(700, dtype=torch.bool)
        past[idx[(idx >= 0) & (idx < 700) & ~valid]] = True
        assert (past & ~read).any()
    x.kv[~read] = float("nan")
    poisoned = sparse_prefill_reference(x.q, x.kv, x.indices, x.sm_scale, 512, x.attn_sink, x.topk_length)
    for a, b in zip(clean, poisoned):
        assert not torch.isnan(b).any()
        assert torch.equal(a, b)


def test_make_prefill_inputs_follows_flashmla():
    """FlashMLA's lib.py recipe: per row a permutation of [0, s_kv) cut to topk, then (s_kv < topk)
    invalid candidates; the value ranges, the non-contiguous layout, sinks and lengths."""
    from cute_mla.testing import make_prefill_inputs, prefill_invalid_candidates

    x = make_prefill_inputs(40, 100, 192, 16, 576, attn_sink=True, topk_length=True, seed=7)
    assert x.q.shape == (40, 16, 576) and x.q.stride() == (17 * 704, 704, 1) and x.q.dtype == torch.bfloat16
    assert x.kv.shape == (100, 1, 576) and x.kv.stride() == (2 * 704, 704, 1) and x.kv.dtype == torch.bfloat16
    assert x.indices.shape == (40, 1, 192) and x.indices.stride() == (2 * 320, 320, 1) and x.indices.dtype == torch.int32
    assert x.q.abs().max() < 1.5 and x.kv.abs().max() < 1.5 and x.q.float().std() > 0.05
    cands = set(prefill_invalid_candidates(100))
    assert cands == {-2**31, -123456, -1, 100, 114514, 1919810, 2147480000, 2**31 - 1}
    for row in x.indices[:, 0].tolist():
        assert sorted(row[:100]) == list(range(100))
        assert set(row[100:]) <= cands
    assert x.sm_scale == 0.5
    assert x.topk_length.dtype == torch.int32 and x.topk_length.shape == (40,)
    assert (x.topk_length >= 0).all() and (x.topk_length <= 192).all()
    assert x.attn_sink.dtype == torch.float32 and x.attn_sink.shape == (16,)
    # the same seed, the same inputs; all-invalid rows use one candidate throughout
    y = make_prefill_inputs(40, 100, 192, 16, 576, attn_sink=True, topk_length=True, seed=7)
    assert torch.equal(x.q, y.q) and torch.equal(x.indices, y.indices) and torch.equal(x.attn_sink, y.attn_sink)
    z = make_prefill_inputs(2000, 300, 64, 1, 512, all_invalid_rows=True, seed=8, non_contig=False)
    assert z.q.is_contiguous() and z.indices.is_contiguous()
    bad = ((z.indices < 0) | (z.indices >= 300)).all(dim=-1).flatten()
    assert 10 < int(bad.sum()) < 100                   # ~2.3 % of the rows
    assert len(set(z.indices[bad].flatten().tolist())) == 1
    sinks = make_prefill_inputs(1, 64, 64, 4096, 512, attn_sink=True, seed=9).attn_sink
    assert 0.25 < float(torch.isposinf(sinks).float().mean()) < 0.37
    assert 0.25 < float(torch.isneginf(sinks).float().mean()) < 0.37


def test_prefill_case_lists():
    """FlashMLA's lists per (d_qk, h_q): 30 correctness cases, 56 with features (its duplicate
    have_sink_lse loop dropped), 9 corner cases; names unique, seeds fixed."""
    from cute_mla.testing import prefill_corner_cases, prefill_correctness_cases, prefill_feature_cases

    for h_q in (8, 64, 128):
        c, f, k = prefill_correctness_cases(h_q), prefill_feature_cases(h_q), prefill_corner_cases(h_q)
        assert (len(c), len(f), len(k)) == (60, 112, 18)
        names = [p.name for p in c + f + k]
        assert len(set(names)) == len(names)
        assert all(p.h_q == h_q and p.d_qk in (512, 576) and p.topk % 64 == 0 for p in c + f + k)
        assert [p for p in k if not p.check_correctness] == [p for p in k if p.s_q == 70000]
        assert all(p.have_attn_sink and p.have_topk_length for p in k)
        assert sum(p.is_all_indices_invalid for p in k) == 8
    assert prefill_correctness_cases(64, d_qks=(512,))[0].seed == prefill_correctness_cases(64)[30].seed
    assert prefill_correctness_cases(64)[0].seed != prefill_feature_cases(64)[0].seed


def test_check_prefill_applies_flashmla_tolerances():
    from cute_mla.testing import check_close_chunked, check_prefill

    ref_out = torch.randn(3, 4, 512) / 10
    ref_ml = torch.randn(3, 4)
    ref_lse = ref_ml + 1
    ref_ml[0, 0], ref_lse[0, 0] = -math.inf, math.inf            # an empty row
    ref_out[0, 0] = 0
    check_prefill(ref_out.bfloat16(), ref_ml, ref_lse, ref_out, ref_ml, ref_lse)
    # abs OR rel: a large value off by 1e-3 absolute passes on rel, a tiny one on abs
    o = ref_out.clone()
    o[1, 1, 0], ref2 = 10.0 + 1e-3, ref_out.clone()
    ref2[1, 1, 0] = 10.0
    check_close_chunked("out", o, ref2, 8e-4, 3.01 / 128)
    o[1, 1, 0] = 10.5                                             # 5 % off: fails both
    with pytest.raises(AssertionError, match=r"out: 1 of 6144 elements out of tolerance .* \(1, 1, 0\)"):
        check_close_chunked("out", o, ref2, 8e-4, 3.01 / 128, chunk=1000)
    # lse: rel 2.01/65536 ~ 3e-5
    lse = ref_lse.clone()
    lse[2, 3] = ref_lse[2, 3] + 1e-4 * (1 + ref_lse[2, 3].abs())   # off by 1e-4 relative, whatever its sign
    with pytest.raises(AssertionError, match=r"lse: 1 of 12 elements .* \(2, 3\)"):
        check_prefill(ref_out, ref_ml, lse, ref_out, ref_ml, ref_lse)
    # infinities must sit at the same places
    lse = ref_lse.clone()
    lse[0, 0] = -math.inf
    with pytest.raises(AssertionError, match=r"lse: \+inf positions differ"):
        check_prefill(ref_out, ref_ml, lse, ref_out, ref_ml, ref_lse)
    ml = ref_ml.clone()
    ml[1, 2] = math.nan
    with pytest.raises(AssertionError, match="max_logits: nan positions differ"):
        check_prefill(ref_out, ml, ref_lse, ref_out, ref_ml, ref_lse)
    # a NaN in the reference is refused
    with pytest.raises(AssertionError, match="reference max_logits has 1 NaN"):
        check_prefill(ref_out, ml, ref_lse, ref_out, ml, ref_lse)
    # the cosine difference: every element within abs tolerance, the whole tensor biased
    tiny = torch.full((1000,), 1e-3)
    with pytest.raises(AssertionError, match="cosine difference"):
        check_close_chunked("out", tiny * 1.5, tiny, 8e-4, 3.01 / 128, 7e-6)
    check_close_chunked("out", torch.zeros(10), torch.zeros(10), 8e-4, 3.01 / 128, 7e-6)   # all-zero: skipped
    with pytest.raises(AssertionError, match="shape"):
        check_prefill(ref_out[:2], ref_ml, ref_lse, ref_out, ref_ml, ref_lse)
