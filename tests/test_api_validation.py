"""One test per rejected argument: the error names the argument, what was given and what is accepted.

All of these are raised on the host before any launch, so they run on a CPU-only machine."""

import pytest
import torch

from cute_mla import FlashMLASchedMeta, flash_mla_with_kvcache, get_mla_metadata
from cute_mla.archs import UnsupportedDeviceError


def good(b=2, s_q=1, h_q=64, topk=128):
    return dict(
        q=torch.zeros(b, s_q, h_q, 576, dtype=torch.bfloat16),
        k_cache=torch.zeros(8, 64, 1, 656, dtype=torch.uint8),
        block_table=None, cache_seqlens=None, head_dim_v=512,
        tile_scheduler_metadata=get_mla_metadata()[0],
        softmax_scale=0.04, is_fp8_kvcache=True,
        indices=torch.zeros(b, s_q, topk, dtype=torch.int32),
    )


def call(**over):
    kw = good()
    kw.update(over)
    return flash_mla_with_kvcache(**kw)


CASES = [
    # (argument overrides, exception, message fragment)
    (dict(q=torch.zeros(2, 1, 64, 576, dtype=torch.float16)), TypeError, "q: got dtype torch.float16, accepted: torch.bfloat16"),
    (dict(q=torch.zeros(2, 64, 576, dtype=torch.bfloat16)), ValueError, r"q: expected 4 dims \(b, s_q, h_q, d_qk\)"),
    (dict(q=torch.zeros(2, 1, 32, 576, dtype=torch.bfloat16)), ValueError, "h_q: got 32, accepted: 64 or 128"),
    (dict(q=torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)[..., ::2].repeat(1, 1, 1, 2)[..., :576].transpose(0, 0)
          .as_strided((2, 1, 64, 576), (576 * 64, 576 * 64, 1, 64))), ValueError, "q: the last dim must be contiguous"),
    (dict(indices=torch.zeros(2, 1, 100, dtype=torch.int32)), ValueError, "topk: got 100, accepted: a positive multiple of 64"),
    (dict(indices=torch.zeros(2, 1, 128, dtype=torch.int64)), TypeError, "indices: got dtype torch.int64, accepted: torch.int32"),
    (dict(indices=torch.zeros(3, 1, 128, dtype=torch.int32)), ValueError, r"indices: expected shape \(b, s_q, topk\), got \(3, 1, 128\)"),
    (dict(indices=None), NotImplementedError, "indices: dense decode"),
    (dict(head_dim_v=576), ValueError, "head_dim_v: got 576, accepted: 512"),
    (dict(k_cache=torch.zeros(8, 64, 1, 600, dtype=torch.uint8)), ValueError, "k_cache: unknown cache format for d_qk=576 with 600 bytes"),
    (dict(k_cache=torch.zeros(8, 64, 1, 352, dtype=torch.uint8)), NotImplementedError, "V32_NVFP4_FP8ROPE format"),
    (dict(k_cache=torch.zeros(8, 64, 1, 656, dtype=torch.float32)), TypeError, "k_cache: got dtype torch.float32"),
    (dict(k_cache=torch.zeros(8, 64, 2, 656, dtype=torch.uint8)), ValueError, "k_cache: h_k"),
    (dict(k_cache=torch.zeros(8, 64, 1, 672, dtype=torch.uint8)[..., :656]), ValueError, r"k_cache: rows inside a page block must be packed"),
    (dict(causal=True), ValueError, "causal: must be False with indices"),
    (dict(is_fp8_kvcache=False), ValueError, "is_fp8_kvcache: must be True"),
    (dict(tile_scheduler_metadata=torch.zeros(132, 8, dtype=torch.int32)), TypeError, "tile_scheduler_metadata: expected the FlashMLASchedMeta"),
    (dict(num_splits=torch.zeros(3, dtype=torch.int32)), ValueError, "num_splits: must be None"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale: expected a finite float"),
    (dict(attn_sink=torch.zeros(64, dtype=torch.bfloat16)), TypeError, "attn_sink: got dtype torch.bfloat16, accepted: torch.float32"),
    (dict(attn_sink=torch.zeros(128)), ValueError, r"attn_sink: expected shape \(h_q,\)"),
    (dict(topk_length=torch.zeros(2, dtype=torch.int64)), TypeError, "topk_length: got dtype torch.int64"),
    (dict(topk_length=torch.zeros(5, dtype=torch.int32)), ValueError, r"topk_length: expected shape \(b,\)"),
    (dict(extra_k_cache=torch.zeros(8, 64, 1, 656, dtype=torch.uint8)), NotImplementedError, "extra_k_cache"),
    (dict(out=torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)), ValueError, r"out: expected shape \(b, s_q, h_q, 512\)"),
    (dict(out=torch.zeros(2, 1, 64, 512, dtype=torch.float32)), TypeError, "out: got dtype torch.float32"),
    (dict(q=torch.zeros(2, 1, 64, 512, dtype=torch.bfloat16)), NotImplementedError, "d_qk: 512"),
]


@pytest.mark.parametrize("over,exc,msg", CASES, ids=[c[2][:40] for c in CASES])
def test_rejected_argument(over, exc, msg):
    with pytest.raises(exc, match=msg):
        call(**over)


def test_valid_arguments_without_gpu_raise_clear_error():
    with pytest.raises(UnsupportedDeviceError, match="CUDA GPU"):
        call()


def test_sched_meta_reused_with_other_shapes():
    sched = FlashMLASchedMeta(have_initialized=True, config=(4, 1, 64, 128, False, torch.device("cpu")))
    with pytest.raises(ValueError, match=r"tile_scheduler_metadata: this FlashMLASchedMeta was filled for"):
        from cute_mla.interface.api import _schedule
        _schedule(sched, torch.zeros(2, 1, 64, 576), 2, 1, 64, 128, None)


def test_get_mla_metadata_ignores_arguments():
    sched, none = get_mla_metadata(torch.zeros(3), 1, 1, num_heads_q=64, topk=2048)
    assert isinstance(sched, FlashMLASchedMeta) and none is None and not sched.have_initialized


def test_checked_signature_is_not_rechecked_but_any_change_is(monkeypatch):
    """The tensor checks run once per argument signature and FlashMLASchedMeta (the other layers
    of a decode step skip them); a call whose tensors differ in anything checked runs them again
    and fails as before. The CUDA requirement and the launch are stubbed so that this runs on a CPU."""
    from cute_mla.interface import api

    monkeypatch.setattr(api, "_require_cuda", lambda q: None)
    monkeypatch.setattr(api, "_schedule", lambda *a, **k: (lambda *a2, **k2: None))
    runs = []
    full = api._validate_tensors
    monkeypatch.setattr(api, "_validate_tensors", lambda *a: runs.append(1) or full(*a))
    kw = good()
    sched = kw["tile_scheduler_metadata"]
    flash_mla_with_kvcache(**kw)
    flash_mla_with_kvcache(**dict(kw, q=kw["q"].clone(), indices=kw["indices"].clone()))   # same signature
    assert len(runs) == 1 and len(sched._validated) == 1
    bad = [
        (dict(indices=kw["indices"].to(torch.int64)), TypeError, "indices: got dtype torch.int64"),
        (dict(k_cache=torch.zeros(8, 64, 1, 672, dtype=torch.uint8)[..., :656]), ValueError, "k_cache: rows inside a page block must be packed"),
        (dict(q=torch.zeros(2 * 64 * 576 + 1, dtype=torch.bfloat16)[1:].view(2, 1, 64, 576)), ValueError, "q: the data pointer must be 16-byte aligned"),
        (dict(out=torch.zeros(2, 1, 64, 256, dtype=torch.bfloat16)), ValueError, "out: expected shape"),
        (dict(attn_sink=[0.0] * 64), TypeError, "attn_sink: expected a torch.Tensor"),
        (dict(head_dim_v=[512]), ValueError, "head_dim_v: got"),
    ]
    for over, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            flash_mla_with_kvcache(**dict(kw, **over))
    assert len(runs) == 1 + len(bad)


@pytest.mark.parametrize("over,msg", [
    (dict(attn_sink=torch.zeros(64).to_sparse()), "attn_sink: expected a dense"),
    (dict(q=torch._neg_view(torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16))), "q: a lazily negated view"),
])
def test_sparse_and_negated_views_are_named(over, msg, monkeypatch):
    """Also after a plain tensor of the same shape passed for the same FlashMLASchedMeta."""
    from cute_mla.interface import api

    monkeypatch.setattr(api, "_require_cuda", lambda q: None)
    monkeypatch.setattr(api, "_schedule", lambda *a, **k: (lambda *a2, **k2: None))
    kw = good()
    flash_mla_with_kvcache(**dict(kw, attn_sink=torch.zeros(64)))
    with pytest.raises(ValueError, match=msg):
        flash_mla_with_kvcache(**dict(kw, **over))
