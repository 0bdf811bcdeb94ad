"""The reference against a direct float64 computation, token by token (no vectorized tricks)."""

import math

import pytest
import torch

from cute_mla.formats import dequantize_v32
from cute_mla.reference import sparse_decode_reference
from cute_mla.testing import make_inputs


def direct_float64(q, k_cache, indices, scale, sink, topk_length):
    b, s_q, h_q, _ = q.shape
    kv = dequantize_v32(k_cache.reshape(-1, 656)).to(torch.bfloat16).double()
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
    assert torch.equal(torch.isinf(lse), torch.isinf(rlse)) and (lse[torch.isinf(lse)] > 0).all()
    fin = torch.isfinite(rlse)
    assert fin.any(), "the case must have rows with valid tokens"
    assert (lse[fin].double() - rlse[fin]).abs().max() < 1e-5
    assert (out.double() - rout).abs().max() < 1e-5
    assert not torch.isnan(out).any()


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
