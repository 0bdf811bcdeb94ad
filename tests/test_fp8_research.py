"""Issue 23's research tools on the CPU: the accuracy emulation's bf16 path is the kernel's numerics
(it matches the fp32 oracle within FlashMLA's tolerances), its FP8 pieces are exact where they
must be, and the wgmma probe compiles for sm_90a with e4m3 wgmma, unserialized."""

import pytest
import torch

from benchmarks import fp8_accuracy as acc
from cute_mla.reference import dequantized_pool
from cute_mla.testing import check_out_lse, make_inputs


def tiny(**options):
    return make_inputs(2, 2, 64, 128, num_tokens=512, generator=torch.Generator().manual_seed(3), **options)


@pytest.mark.parametrize("options", [{}, {"power_of_two_scales": False}, {"with_topk_length": True}])
def test_bf16_emulation_matches_reference(options):
    """The emulated production path against the fp32 oracle (keys rounded to bf16, as the kernel
    and FlashMLA's test reference see them): FlashMLA's tolerances hold, empty rows included."""
    inp = tiny(**options)
    g = acc.gather_rows(inp)
    out, lse = acc.run_variant("bf16", inp, g, acc.keys_bf16(g))
    ref_out, ref_lse = inp.reference()   # no sink, no extra pool
    check_out_lse(out, lse, ref_out, ref_lse)


def test_gathered_rows_dequantize_like_the_format():
    """e4m3 values times their group scale, and the RoPE, are the format's dequantized keys."""
    inp = tiny()
    g = acc.gather_rows(inp)
    keys = acc.keys_bf16(g)
    pool = dequantized_pool(inp.k_cache, 576)                     # bf16-rounded, as fp32
    idx = inp.indices.reshape(-1, inp.indices.shape[-1]).to(torch.int64)
    valid = (idx >= 0) & (idx < pool.shape[0])
    assert torch.equal(valid, g.valid)
    assert torch.equal(keys[g.valid], pool[idx[valid]])


def test_qk_fp8_of_e4m3_q_is_exact():
    """A q whose groups are already e4m3 values with their amax at 448 quantizes to itself, so QK-FP8
    equals the bf16 path's S up to fp32 summation order."""
    inp = tiny()
    g = acc.gather_rows(inp)
    rows, h = inp.q.shape[0] * inp.q.shape[1], inp.q.shape[2]
    q = torch.randn(rows, h, 576).to(torch.float8_e4m3fn).float()
    q[..., :512].view(rows, h, 4, 128)[..., 0] = 448.0
    q = q.to(torch.bfloat16)
    s8 = acc.scores_qk_fp8(q, g, pow2=False)
    s16 = acc.scores_bf16(q, acc.keys_bf16(g))
    assert torch.allclose(s8, s16, rtol=1e-5, atol=1e-3)


def test_truncate_bits():
    x = torch.tensor([1.0 + 2 ** -20, -3.75, 0.0])
    assert torch.equal(acc.truncate_bits(x.double(), 14).float(), torch.tensor([1.0, -3.75, 0.0]))


def test_probe_compiles_fp8_wgmma():
    """The probe's three variants compile for sm_90a; the e4m3 ones issue wgmma ...e4m3.e4m3 with
    K = 32 (16 per 512 dims) and none is serialized (one gsb0 wait per chain)."""
    probe = pytest.importorskip("benchmarks.fp8_mma_probe")
    reports = {r["variant"]: r for r in (probe.compile_report(probe.ProbeConfig(v)) for v in probe.VARIANTS)}
    assert reports["bf16"]["ptx_wgmma"] == 32 and "bf16.bf16" in reports["bf16"]["ptx_wgmma_form"]
    for v in ("fp8", "fp8-grouped"):
        assert reports[v]["ptx_wgmma"] == 16 and reports[v]["ptx_wgmma_form"].endswith("m64n64k32.f32.e4m3.e4m3")
    if "sass_gmma" in reports["fp8"]:
        assert reports["fp8"]["sass_gmma_gsb0"] == 1
        assert reports["fp8-grouped"]["sass_gmma_gsb0"] == 4          # one drain per 128-dim group
        assert all(r["local_memory_ops"] == 0 for r in reports.values())
