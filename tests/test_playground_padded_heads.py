"""The benchmarks' FlashMLA anchor for 8, 16 and 32 heads (``playground.bench.PaddedHeads``, no
GPU): q and the sinks zero-padded to 64 heads (once per input), out and lse cut back to the call's
heads."""

import pytest
import torch

from cute_mla.playground import bench


class FakeFlashMLA:
    def __init__(self):
        self.seen = []

    def get_mla_metadata(self):
        return "sched", None

    def flash_mla_with_kvcache(self, q, k_cache, bt, sl, d_v, sched, attn_sink=None, **kw):
        self.seen.append((q.clone(), None if attn_sink is None else attn_sink.clone()))
        b, s_q, h, _ = q.shape
        out = torch.arange(h, dtype=torch.float32).view(1, 1, h, 1).expand(b, s_q, h, d_v).clone()
        return out, torch.arange(h, dtype=torch.float32).view(1, h, 1).expand(b, h, s_q).clone()


@pytest.mark.parametrize("h", [8, 16, 32, 64, 128])
def test_padded_heads(h):
    fake = FakeFlashMLA()
    lib = bench.padded(fake)
    q = torch.randn(2, 3, h, 576)
    sink = torch.randn(h)
    out, lse = lib.flash_mla_with_kvcache(q, None, None, None, 512, "sched", attn_sink=sink)
    qp, sp = fake.seen[0]
    kernel_h = max(h, 64)
    assert qp.shape == (2, 3, kernel_h, 576) and sp.shape == (kernel_h,)
    assert torch.equal(qp[:, :, :h], q) and not qp[:, :, h:].any() and torch.equal(sp[:h], sink)
    assert out.shape == (2, 3, h, 512) and lse.shape == (2, h, 3)
    assert torch.equal(out[0, 0, :, 0], torch.arange(h, dtype=torch.float32))
    assert lib.get_mla_metadata() == ("sched", None) and bench.padded(None) is None
    lib.flash_mla_with_kvcache(q, None, None, None, 512, "sched", attn_sink=sink)
    if h < 64:   # the same input: the same padded copy, made once
        assert fake.seen[1][0].data_ptr() != q.data_ptr()
        assert len(lib._padded) == 2
        q.add_(1.0)   # changed in place: padded again
        lib.flash_mla_with_kvcache(q, None, None, None, 512, "sched", attn_sink=sink)
        assert torch.equal(fake.seen[2][0][:, :, :h], q)


def test_padded_heads_new_input_at_an_old_address():
    """A fresh q that the allocator could place where a previous (freed) q lived must be padded
    anew, not served the old copy: each cached copy keeps its source alive, so the address stays
    taken while the copy is cached (the V4 benchmark draws new inputs per draw)."""
    fake = FakeFlashMLA()
    lib = bench.padded(fake)
    for draw in range(3):
        q = torch.full((1, 1, 16, 576), float(draw))
        lib.flash_mla_with_kvcache(q, None, None, None, 512, "sched")
        assert torch.equal(fake.seen[-1][0][:, :, :16], q), f"draw {draw} ran on a stale padded copy"
        del q
