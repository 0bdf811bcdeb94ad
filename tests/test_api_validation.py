"""One test per rejected argument: the error names the argument, what was given and what is accepted.

All of these are raised on the host before any launch, so they run on a CPU-only machine."""

from types import SimpleNamespace

import numpy as np
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
    (dict(q=torch.zeros(2, 1, 48, 576, dtype=torch.bfloat16)), ValueError, "h_q: got 48, accepted: 8, 16, 32, 64 or 128"),
    (dict(q=torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)[..., ::2].repeat(1, 1, 1, 2)[..., :576].transpose(0, 0)
          .as_strided((2, 1, 64, 576), (576 * 64, 576 * 64, 1, 64))), ValueError, "q: the last dim must be contiguous"),
    # q and out are addressed through TMA tensor maps: every stride counts, size-1 dims too; no broadcast
    (dict(q=torch.zeros(2 * 64 * 576 + 8, dtype=torch.bfloat16).as_strided((2, 1, 64, 576), (64 * 576, 3, 576, 1))),
     ValueError, r"q: stride 1 is 3 elements \(6 bytes\) on a dim of size 1"),
    (dict(q=torch.zeros(576, dtype=torch.bfloat16).expand(2, 1, 64, 576)), ValueError,
     r"q: stride 0 is 0 on a dim of size 2 \(a broadcast view\)"),
    (dict(out=torch.zeros(2 * 64 * 512 + 8, dtype=torch.bfloat16).as_strided((2, 1, 64, 512), (64 * 512, 5, 512, 1))),
     ValueError, r"out: stride 1 is 5 elements \(10 bytes\) on a dim of size 1"),
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
    # an empty cache: every request reads its list's first row (valid or not)
    (dict(k_cache=torch.zeros(0, 64, 1, 656, dtype=torch.uint8)), ValueError, "k_cache: got 0 page blocks of 64 tokens, accepted"),
    (dict(k_cache=torch.zeros(8, 0, 1, 656, dtype=torch.uint8)), ValueError, "k_cache: got 8 page blocks of 0 tokens, accepted"),
    # one page block whose stride(0) (free for a size-1 dim) does not hold it
    (dict(k_cache=torch.zeros(64, 1, 656, dtype=torch.uint8).transpose(0, 1).unsqueeze(2)), ValueError,
     r"k_cache: stride\(0\) of 656 bytes does not hold a page block of 64 x 656 bytes"),
    (dict(causal=True), ValueError, "causal: must be False with indices"),
    (dict(is_fp8_kvcache=False), ValueError, "is_fp8_kvcache: must be True"),
    (dict(tile_scheduler_metadata=torch.zeros(132, 8, dtype=torch.int32)), TypeError, "tile_scheduler_metadata: expected the FlashMLASchedMeta"),
    (dict(num_splits=torch.zeros(3, dtype=torch.int32)), ValueError, "num_splits: must be None"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale: expected a finite float"),
    (dict(softmax_scale=1e39), ValueError, r"softmax_scale: expected a finite float \(within float32's range"),
    (dict(attn_sink=torch.zeros(64, dtype=torch.bfloat16)), TypeError, "attn_sink: got dtype torch.bfloat16, accepted: torch.float32"),
    (dict(attn_sink=torch.zeros(128)), ValueError, r"attn_sink: expected shape \(h_q,\)"),
    (dict(topk_length=torch.zeros(2, dtype=torch.int64)), TypeError, "topk_length: got dtype torch.int64"),
    (dict(topk_length=torch.zeros(5, dtype=torch.int32)), ValueError, r"topk_length: expected shape \(b,\)"),
    (dict(extra_k_cache=torch.zeros(8, 64, 1, 656, dtype=torch.uint8)), ValueError, "^extra_indices_in_kvcache:"),
    (dict(out=torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)), ValueError, r"out: expected shape \(b, s_q, h_q, 512\)"),
    (dict(out=torch.zeros(2, 1, 64, 512, dtype=torch.float32)), TypeError, "out: got dtype torch.float32"),
    # out whose elements overlap: the requests (stride 0), or the heads (8 columns apart)
    (dict(out=torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16).expand(2, 1, 64, 512)), ValueError, r"out: its elements overlap \(shape"),
    (dict(out=torch.zeros(2 * 64 * 512, dtype=torch.bfloat16).as_strided((2, 1, 64, 512), (64 * 512, 64 * 512, 8, 1))),
     ValueError, "out: its elements overlap"),
    # d_qk 512 (V4) with a 656-B (V3.2) cache
    (dict(q=torch.zeros(2, 1, 64, 512, dtype=torch.bfloat16)), ValueError, "^k_cache: unknown cache format for d_qk=512 with 656 bytes"),
    # the extra pool is V4's: with d_qk 576 it is refused (whatever the extra cache's format)
    (dict(extra_k_cache=torch.zeros(8, 64, 1, 656, dtype=torch.uint8), extra_indices_in_kvcache=torch.zeros(2, 1, 128, dtype=torch.int32)),
     ValueError, r"^extra_k_cache: the V3\.2 format .*no extra KV pool"),
    (dict(extra_k_cache=torch.zeros(8, 64, 1, 584, dtype=torch.uint8), extra_indices_in_kvcache=torch.zeros(2, 1, 128, dtype=torch.int32)),
     ValueError, "^extra_k_cache"),
]


@pytest.mark.parametrize("over,exc,msg", CASES, ids=[c[2][:40] for c in CASES])
def test_rejected_argument(over, exc, msg):
    with pytest.raises(exc, match=msg):
        call(**over)


# ------------------------------------------------------------------------------------------- V4


def _no_schedule(sched, *args, **kwargs):
    """Stands in for the API's ``_schedule`` on the CPU: a ready schedule and a launcher that launches nothing."""
    sched.schedule = SimpleNamespace(ensure_ready=lambda: None, request_order=None)
    return lambda *a, **k: None


def good_v4(b=2, s_q=1, h_q=64, topk=128, extra_topk=512):
    """A V4 call with an extra pool of another page block size (2) and both lists' lengths."""
    return dict(good(b, s_q, h_q, topk),
                q=torch.zeros(b, s_q, h_q, 512, dtype=torch.bfloat16),
                k_cache=torch.zeros(8, 64, 1, 584, dtype=torch.uint8),
                extra_k_cache=torch.zeros(16, 2, 1, 584, dtype=torch.uint8),
                extra_indices_in_kvcache=torch.zeros(b, s_q, extra_topk, dtype=torch.int32),
                topk_length=torch.zeros(b, dtype=torch.int32),
                extra_topk_length=torch.zeros(b, dtype=torch.int32))


def call_v4(**over):
    kw = good_v4()
    kw.update(over)
    return flash_mla_with_kvcache(**kw)


META = torch.device("meta")   # a device other than q's that exists on every machine
XI = "extra_indices_in_kvcache"

V4_CASES = [
    # half an extra pool, or lengths without one
    (dict(extra_indices_in_kvcache=None), ValueError, f"^{XI}:"),
    (dict(extra_indices_in_kvcache=None, extra_topk_length=None), ValueError, f"^{XI}:"),
    (dict(extra_k_cache=None), ValueError, "^extra_k_cache:"),
    (dict(extra_k_cache=None, extra_indices_in_kvcache=None), ValueError, "^extra_topk_length:"),
    # the extra cache in another format than k_cache's
    (dict(extra_k_cache=torch.zeros(16, 2, 1, 656, dtype=torch.uint8)), ValueError, "^extra_k_cache: unknown cache format for d_qk=512 with 656 bytes"),
    (dict(extra_k_cache=torch.zeros(16, 2, 1, 528, dtype=torch.uint8)), NotImplementedError, "^extra_k_cache: the V41 format"),
    (dict(k_cache=torch.zeros(8, 64, 1, 656, dtype=torch.uint8)), ValueError, "^k_cache: unknown cache format for d_qk=512 with 656 bytes"),
    # extra_topk: a positive multiple of 64
    (dict(extra_indices_in_kvcache=torch.zeros(2, 1, 100, dtype=torch.int32)), ValueError, "extra_topk: got 100, accepted"),
    # an empty extra list is not "no extra pool": named as extra_topk, not as a stride
    (dict(extra_indices_in_kvcache=torch.zeros(2, 1, 0, dtype=torch.int32)), ValueError, "extra_topk: got 0"),
    # the extra indices
    (dict(extra_indices_in_kvcache=torch.zeros(2, 1, 512, dtype=torch.int64)), TypeError, f"^{XI}: got dtype torch.int64, accepted: torch.int32"),
    (dict(extra_indices_in_kvcache=torch.zeros(3, 1, 512, dtype=torch.int32)), ValueError, rf"^{XI}: expected shape \(b, s_q, extra_topk\)"),
    (dict(extra_indices_in_kvcache=torch.zeros(2, 2, 512, dtype=torch.int32)), ValueError, rf"^{XI}: expected shape \(b, s_q, extra_topk\)"),
    (dict(extra_indices_in_kvcache=torch.zeros(2, 512, dtype=torch.int32)), ValueError, f"^{XI}: expected 3 dims"),
    (dict(extra_indices_in_kvcache=torch.zeros(2, 1, 1024, dtype=torch.int32)[..., ::2]), ValueError, f"^{XI}: the last dim must be contiguous"),
    (dict(extra_indices_in_kvcache=torch.zeros(2, 1, 512, dtype=torch.int32, device=META)), ValueError, f"^{XI}: expected a tensor on cpu"),
    (dict(extra_indices_in_kvcache=[[[0] * 512]] * 2), TypeError, f"^{XI}: expected a torch.Tensor"),
    # the extra cache
    (dict(extra_k_cache=torch.zeros(16, 2, 1, 584, dtype=torch.float32)), TypeError, "^extra_k_cache: got dtype torch.float32"),
    (dict(extra_k_cache=torch.zeros(16, 2, 2, 584, dtype=torch.uint8)), ValueError, "^extra_k_cache: h_k"),
    (dict(extra_k_cache=torch.zeros(16, 2, 584, dtype=torch.uint8)), ValueError, "^extra_k_cache: expected 4 dims"),
    (dict(extra_k_cache=torch.zeros(16, 2, 1, 600, dtype=torch.uint8)[..., :584]), ValueError, "^extra_k_cache: rows inside a page block must be packed"),
    (dict(extra_k_cache=torch.zeros(16, 53, 1, 584, dtype=torch.uint8)), ValueError, "^extra_k_cache: base pointer and stride.0. must be 16-byte aligned"),
    (dict(extra_k_cache=torch.zeros(16, 2, 1, 584, dtype=torch.uint8, device=META)), ValueError, "^extra_k_cache: expected a tensor on cpu"),
    (dict(extra_k_cache=torch.zeros(16, 2, 1, 584, dtype=torch.uint8).numpy()), TypeError, "^extra_k_cache: expected a torch.Tensor"),
    # the extra lengths
    (dict(extra_topk_length=torch.zeros(2, dtype=torch.int64)), TypeError, "^extra_topk_length: got dtype torch.int64"),
    (dict(extra_topk_length=torch.zeros(5, dtype=torch.int32)), ValueError, r"^extra_topk_length: expected shape \(b,\)"),
    (dict(extra_topk_length=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "^extra_topk_length: expected 1 dims"),
    (dict(extra_topk_length=torch.zeros(4, dtype=torch.int32)[::2]), ValueError, "^extra_topk_length: must be contiguous"),
    (dict(extra_topk_length=torch.zeros(2, dtype=torch.int32, device=META)), ValueError, "^extra_topk_length: expected a tensor on cpu"),
    # the main tensors of a V4 call
    (dict(topk_length=torch.zeros(5, dtype=torch.int32)), ValueError, r"^topk_length: expected shape \(b,\)"),
    (dict(out=torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)), ValueError, r"^out: expected shape \(b, s_q, h_q, 512\)"),
    (dict(head_dim_v=448), ValueError, "^head_dim_v: got 448, accepted: 512"),
    (dict(indices=torch.zeros(2, 1, 100, dtype=torch.int32)), ValueError, "topk: got 100, accepted: a positive multiple of 64"),
    (dict(k_cache=torch.zeros(8, 53, 1, 584, dtype=torch.uint8)), ValueError, "^k_cache: base pointer and stride.0. must be 16-byte aligned"),
    (dict(extra_k_cache=torch.zeros(0, 2, 1, 584, dtype=torch.uint8)), ValueError, "^extra_k_cache: got 0 page blocks of 2 tokens"),
    (dict(k_cache=torch.zeros(64 * 584, dtype=torch.uint8).as_strided((1, 64, 1, 584), (4608, 584, 584, 1))), ValueError,
     r"^k_cache: stride\(0\) of 4608 bytes does not hold a page block of 64 x 584 bytes"),
]


@pytest.mark.parametrize("over,exc,msg", V4_CASES, ids=[f"{i}-{c[2][:40]}" for i, c in enumerate(V4_CASES)])
def test_v4_rejected_argument(over, exc, msg):
    with pytest.raises(exc, match=msg):
        call_v4(**over)


@pytest.mark.parametrize("over", [
    dict(), dict(topk_length=None, extra_topk_length=None), dict(extra_topk_length=None),
    dict(extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None),   # V4 without an extra pool
    dict(extra_indices_in_kvcache=torch.zeros(2, 1, 1024, dtype=torch.int32)),
    dict(extra_k_cache=torch.zeros(16, 2, 1, 584, dtype=torch.int8)),
    dict(extra_k_cache=torch.zeros(4 * 31104, dtype=torch.uint8).as_strided((4, 53, 1, 584), (31104, 584, 584, 1))),
    dict(k_cache=torch.zeros(8, 64, 1, 584, dtype=torch.float8_e4m3fn), out=torch.zeros(2, 1, 64, 512, dtype=torch.bfloat16)),
    # one page block, numpy scalars for the scale and head_dim_v, out sliced from a wider buffer
    dict(k_cache=torch.zeros(1, 64, 1, 584, dtype=torch.uint8), softmax_scale=np.float32(0.04), head_dim_v=np.int64(512),
         out=torch.zeros(2, 1, 64, 1024, dtype=torch.bfloat16)[..., :512]),
])
def test_v4_valid_arguments_reach_the_device_check(over):
    """Well-formed V4 calls (with and without the extra pool and the lengths, FlashMLA's padded page
    blocks of 53 tokens) pass every host check: on a CPU machine the CUDA requirement is what stops them."""
    with pytest.raises(UnsupportedDeviceError, match="CUDA GPU"):
        call_v4(**over)


def test_v4_checked_signature_includes_the_extra_pool(monkeypatch):
    """The once-per-signature tensor checks (see below) cover the extra pool's tensors: a call that
    changes only one of them is checked again."""
    from cute_mla.interface import api

    monkeypatch.setattr(api, "_require_cuda", lambda q: None)
    monkeypatch.setattr(api, "_schedule", _no_schedule)
    runs = []
    full = api._validate_tensors
    monkeypatch.setattr(api, "_validate_tensors", lambda *a, **k: runs.append(1) or full(*a, **k))
    kw = good_v4()
    flash_mla_with_kvcache(**kw)
    flash_mla_with_kvcache(**dict(kw, extra_indices_in_kvcache=kw["extra_indices_in_kvcache"].clone()))
    assert len(runs) == 1
    bad = [
        (dict(extra_indices_in_kvcache=kw["extra_indices_in_kvcache"].to(torch.int64)), TypeError, f"^{XI}: got dtype"),
        (dict(extra_k_cache=torch.zeros(16, 2, 1, 656, dtype=torch.uint8)), ValueError, "^extra_k_cache"),
        (dict(extra_k_cache=torch.zeros(16, 2, 1, 600, dtype=torch.uint8)[..., :584]), ValueError, "^extra_k_cache: rows inside"),
        (dict(extra_topk_length=torch.zeros(3, dtype=torch.int32)), ValueError, "^extra_topk_length: expected shape"),
        (dict(extra_indices_in_kvcache=torch.zeros(2, 1, 96, dtype=torch.int32)), ValueError, "extra_topk: got 96"),
    ]
    for over, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            flash_mla_with_kvcache(**dict(kw, **over))
    assert len(runs) == 1 + len(bad)


def test_valid_arguments_without_gpu_raise_clear_error():
    with pytest.raises(UnsupportedDeviceError, match="CUDA GPU"):
        call()


def test_sched_meta_reused_with_other_shapes():
    from cute_mla.interface.api import _schedule

    cpu = torch.device("cpu")
    v32, v4 = torch.zeros(1, 64, 1, 656, dtype=torch.uint8), torch.zeros(1, 64, 1, 584, dtype=torch.uint8)
    sched = FlashMLASchedMeta(have_initialized=True, config=(4, 1, 64, "V3.2", 128, 0, False, False, cpu))
    with pytest.raises(ValueError, match=r"tile_scheduler_metadata: this FlashMLASchedMeta was filled for"):
        _schedule(sched, torch.zeros(2, 1, 64, 576), v32, (2, 1, 64, 128, 0), None)
    # the same shapes in the other format, with an extra pool (V4), or with its lengths, are other schedules
    sched = FlashMLASchedMeta(have_initialized=True, config=(2, 1, 64, "V3.2", 128, 0, False, False, cpu))
    with pytest.raises(ValueError, match=r"tile_scheduler_metadata: this FlashMLASchedMeta was filled for"):
        _schedule(sched, torch.zeros(2, 1, 64, 512), v4, (2, 1, 64, 128, 0), None)
    sched = FlashMLASchedMeta(have_initialized=True, config=(2, 1, 64, "V4", 128, 0, False, False, cpu))
    with pytest.raises(ValueError, match=r"tile_scheduler_metadata: this FlashMLASchedMeta was filled for"):
        _schedule(sched, torch.zeros(2, 1, 64, 512), v4, (2, 1, 64, 128, 512), None)
    sched = FlashMLASchedMeta(have_initialized=True, config=(2, 1, 64, "V4", 128, 512, False, False, cpu))
    with pytest.raises(ValueError, match=r"tile_scheduler_metadata: this FlashMLASchedMeta was filled for"):
        _schedule(sched, torch.zeros(2, 1, 64, 512), v4, (2, 1, 64, 128, 512), None,
                  extra_topk_length=torch.zeros(2, dtype=torch.int32))


def test_get_mla_metadata_ignores_arguments():
    sched, none = get_mla_metadata(torch.zeros(3), 1, 1, num_heads_q=64, topk=2048)
    assert isinstance(sched, FlashMLASchedMeta) and none is None and not sched.have_initialized


def test_checked_signature_is_not_rechecked_but_any_change_is(monkeypatch):
    """The tensor checks run once per argument signature and FlashMLASchedMeta (the other layers
    of a decode step skip them); a call whose tensors differ in anything checked runs them again
    and fails as before. The CUDA requirement and the launch are stubbed so that this runs on a CPU."""
    from cute_mla.interface import api

    monkeypatch.setattr(api, "_require_cuda", lambda q: None)
    monkeypatch.setattr(api, "_schedule", _no_schedule)
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
    monkeypatch.setattr(api, "_schedule", _no_schedule)
    kw = good()
    flash_mla_with_kvcache(**dict(kw, attn_sink=torch.zeros(64)))
    with pytest.raises(ValueError, match=msg):
        flash_mla_with_kvcache(**dict(kw, **over))


def test_out_sharing_bytes_with_an_input_is_refused_on_every_call(monkeypatch):
    """An out inside q's buffer (other CTAs still read q while one writes out) is refused, the first
    time a signature is seen and when it comes back with the same signature; an out beside q in
    one buffer passes; so does one inside another input (the cache, the indices)."""
    from cute_mla.interface import api

    monkeypatch.setattr(api, "_require_cuda", lambda q: None)
    monkeypatch.setattr(api, "_schedule", _no_schedule)
    kw = good()
    buf = torch.zeros(2 * 64 * 576 + 2 * 64 * 512, dtype=torch.bfloat16)
    q, beside = buf[:2 * 64 * 576].view(2, 1, 64, 576), buf[2 * 64 * 576:].view(2, 1, 64, 512)
    inside = buf[64:64 + 2 * 64 * 512].view(2, 1, 64, 512)      # 128 bytes in: same alignment as beside
    flash_mla_with_kvcache(**dict(kw, q=q, out=beside))
    with pytest.raises(ValueError, match=r"^out: its memory \[0x[0-9a-f]+, 0x[0-9a-f]+\) overlaps q's"):
        flash_mla_with_kvcache(**dict(kw, q=q, out=inside))      # a known signature
    sched = get_mla_metadata()[0]
    with pytest.raises(ValueError, match="^out: its memory"):
        flash_mla_with_kvcache(**dict(kw, q=q, out=inside, tile_scheduler_metadata=sched))   # a new one
    in_cache = kw["k_cache"].view(-1)[:2 * 64 * 512 * 2].view(torch.bfloat16).view(2, 1, 64, 512)
    with pytest.raises(ValueError, match="^out: its memory .* overlaps k_cache's"):
        flash_mla_with_kvcache(**dict(kw, q=q, out=in_cache))
    idx = torch.zeros(2 * 64 * 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^out: its memory .* overlaps indices'"):
        flash_mla_with_kvcache(**dict(kw, q=q, out=idx.view(2, 1, 64, 512), indices=idx[:256].view(torch.int32)
                                      .view(2, 1, 64)))


def test_check_apart_compares_byte_spans():
    from cute_mla.interface.validate import check_apart, span_bytes

    buf = torch.zeros(64, 8, dtype=torch.bfloat16)
    check_apart("out", buf[:32], "q", buf[32:])                  # adjacent halves
    check_apart("out", buf[:0], "q", buf)                        # empty
    check_apart("out", None, "q", buf)                           # named by the other checks
    with pytest.raises(ValueError, match="out: its memory"):
        check_apart("out", buf[:, :4], "q", buf[:, 4:])          # interleaved: spans overlap
    assert span_bytes(buf[:, :4]) == (63 * 8 + 3 + 1) * 2 and span_bytes(buf[:0]) == 0


def test_an_array_of_another_library_is_named_by_type_and_shape():
    import numpy as np

    with pytest.raises(TypeError) as e:
        call(q=np.zeros((2, 1, 64, 576)))
    msg = str(e.value)
    assert msg == "q: expected a torch.Tensor (b, s_q, h_q, d_qk), got numpy.ndarray of shape (2, 1, 64, 576)"
