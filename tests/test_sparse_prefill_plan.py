"""CPU: the sparse prefill op's plan, its CLI, its compile for sm_90a and its traced form.

``torch.compile(fullgraph=True)`` traces ``flash_mla_sparse_fwd`` with fake CUDA tensors (no GPU):
the graph holds ``cute_mla::sparse_prefill`` once, outputs have FlashMLA's shapes and dtypes, a
padded head count pads in the graph, and a bad input is refused by name inside the trace.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import re
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_mla
from cute_mla.plan.sparse_prefill import SUPPORTED_H_Q, kernel_variants, plan_sparse_prefill

from _trace_helpers import Recorder, fake_cuda


# ------------------------------------------------------------------------------------------- plan


@pytest.mark.parametrize("h_q", SUPPORTED_H_Q)
@pytest.mark.parametrize("d_qk", [576, 512])
def test_plan_never_splits_and_pads_small_heads_only_where_the_arch_must(h_q, d_qk):
    """SM90 runs 8, 16 and 32 heads natively (no copy); SM100's kernel takes 64 or 128, so the call
    pads there and the plan names the transient bytes."""
    sm90 = plan_sparse_prefill(4096, h_q, d_qk, 2048, arch="sm_90a", has_topk_length=True)
    assert sm90.kernel_h_q == h_q and not sm90.padded and sm90.padding_bytes == 0
    assert sm90.tile == ("heads on N (swap-AB)" if h_q < 64 else "heads on M")
    assert ("swap-AB" in sm90.describe()) == (h_q < 64)
    assert not sm90.split and sm90.workspace_bytes == 0
    assert sm90.items == 4096 * -(-h_q // 64)
    assert sm90.kernel == "sm90_sparse_prefill" and sm90.tensor_maps == ("q", "out")
    sm100 = plan_sparse_prefill(4096, h_q, d_qk, 2048, arch="sm_100a", has_topk_length=True)
    assert sm100.kernel_h_q == max(h_q, 64) and sm100.padded == (h_q < 64) and sm100.tile == "heads on M"
    assert sm100.padding_bytes == (4096 * 64 * (d_qk * 2 + 512 * 2 + 8) if h_q < 64 else 0)
    assert ("padded" in sm100.describe()) == (h_q < 64)


@pytest.mark.parametrize("args, message", [
    ((16, 48, 576, 2048), "h_q: got 48"),
    ((16, 64, 640, 2048), "d_qk: got 640"),
    ((16, 64, 576, 100), "topk: got 100"),
    ((16, 64, 576, 0), "topk: got 0"),
    ((2**31, 128, 576, 64), "s_q: got"),
    ((2**24, 128, 576, 64), "int32-indexed"),
])
def test_plan_refuses_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        plan_sparse_prefill(*args, arch="sm_90a")


def test_plan_on_an_arch_without_a_kernel_says_so():
    from cute_mla import registry
    if ("sparse_prefill", "sm_100a") not in registry.PENDING:
        pytest.skip("the sm_100a prefill kernel is registered")
    with pytest.raises(ValueError, match="sm_100a"):
        plan_sparse_prefill(16, 64, 576, 2048, arch="sm_100a")


def test_variants_cover_every_kernel_config_a_plan_takes():
    from cute_mla import registry
    configs = {cfg for _, cfg in kernel_variants("sm_90a")}
    mod = registry.config_module("sparse_prefill", "sm_90a")
    for h_q in SUPPORTED_H_Q:
        for d_qk in (576, 512):
            for tl in (False, True):
                for s_kv in (None, 1, 32768, 65536, 2**31 - 1):
                    plan = plan_sparse_prefill(8, h_q, d_qk, 128, arch="sm_90a", has_topk_length=tl, s_kv=s_kv)
                    for sink in (False, True):
                        assert mod.config_for(plan, sink) in configs
    # 8, 16, 32, 64, 128 heads x 2 widths x topk_length x sink, and 576/128 with and without the
    # row prefetch (kv rows past or in the L2)
    assert len(configs) == 44


def test_kv_rows_in_l2_turn_the_128_head_prefetch_off():
    """The plan says whether kv's rows fit the arch's L2 (its bytes at d_qk, against
    ``ArchSpec.l2_bytes``); the SM90 rule prefetches rows into L2 only at 128 heads and d_qk 576 with
    rows past it (or unknown); an explicit knob wins."""
    from cute_mla import archs, registry
    mod = registry.config_module("sparse_prefill", "sm_90a")
    fit = archs.SM90.l2_bytes // (576 * 2)
    for s_kv, fits in ((None, False), (1, True), (32768, True), (fit, True), (fit + 1, False), (65536, False)):
        plan = plan_sparse_prefill(4096, 128, 576, 2048, arch="sm_90a", s_kv=s_kv)
        assert plan.kv_fits_l2 is fits
        assert mod.config_for(plan, True).tuning.prefetch_rows is not fits
        assert mod.config_for(plan, True, mod.Tuning(prefetch_rows=True)).tuning.prefetch_rows
    assert plan_sparse_prefill(4096, 128, 512, 1024, arch="sm_90a", s_kv=fit + 1).kv_fits_l2   # 1024-B rows
    for h_q, d_qk in ((128, 512), (64, 576), (16, 576)):
        for s_kv in (1, 65536):
            plan = plan_sparse_prefill(4096, h_q, d_qk, 2048, arch="sm_90a", s_kv=s_kv)
            assert not mod.config_for(plan, False).tuning.prefetch_rows
    assert not plan_sparse_prefill(4096, 128, 576, 2048, arch="sm_100a", s_kv=1).kv_fits_l2  # no L2 rule there
    for bad in (0, -1, 2.0, "1"):
        with pytest.raises(ValueError, match="^s_kv: got"):
            plan_sparse_prefill(4096, 128, 576, 2048, arch="sm_90a", s_kv=bad)


# -------------------------------------------------------------------------------------------- CLI


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cute_mla.cli", *args], capture_output=True, text=True)


def test_sm90_tuning_rule_by_shape_and_explicit_knobs_win():
    """The SM90 kernel's knobs follow the shape (128 heads: the 256-B fill, and the row prefetch at
    d_qk 576; fewer heads: neither; the ping-pong tile's Q and out evict_first, out staged outside
    Q at d_qk 512 and Q reloaded chunk by chunk at 576; the swap-AB tile neither); a knob the tuning sets is kept; the config
    compiles concrete values, so two spellings of one kernel are one cache entry."""
    from cute_mla.kernels.sm90 import prefill_config as pc

    def knobs(h_q, d_qk, tuning=None):
        t = pc.kernel_config(h_q=h_q, d_qk=d_qk, has_topk_length=False, has_attn_sink=True, tuning=tuning).tuning
        return t.gather_l2, t.prefetch_rows, t.qo_policy, t.staging

    assert knobs(128, 576) == ("L2::256B", True, "evict_first", "q_reload")
    in_l2 = pc.kernel_config(h_q=128, d_qk=576, has_topk_length=False, has_attn_sink=True, kv_fits_l2=True).tuning
    assert (in_l2.gather_l2, in_l2.prefetch_rows) == ("L2::256B", False)
    assert knobs(128, 512) == ("L2::256B", False, "evict_first", "ring")
    assert knobs(64, 576) == ("", False, "evict_first", "q_reload")
    assert knobs(64, 512) == ("", False, "evict_first", "ring")
    for d_qk in (576, 512):
        for h_q in (8, 16, 32):
            assert knobs(h_q, d_qk) == ("", False, "", "q")
    assert knobs(64, 576, pc.Sm90PrefillTuning(prefetch_rows=True)) == ("", True, "evict_first", "q_reload")
    assert knobs(128, 576, pc.Sm90PrefillTuning(gather_l2="")) == ("", True, "evict_first", "q_reload")
    assert knobs(16, 576, pc.Sm90PrefillTuning(qo_policy="evict_first")) == ("", False, "evict_first", "q")
    assert knobs(64, 512, pc.Sm90PrefillTuning(qo_policy="", staging="q_reload")) == ("", False, "", "q_reload")
    explicit = pc.Sm90PrefillTuning(gather_l2="L2::256B", prefetch_rows=False, qo_policy="evict_first", staging="ring")
    a = pc.kernel_config(h_q=128, d_qk=512, has_topk_length=True, has_attn_sink=False)
    b = pc.kernel_config(h_q=128, d_qk=512, has_topk_length=True, has_attn_sink=False, tuning=explicit)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(ValueError, match="prefetch_rows takes a bool"):
        pc.Sm90PrefillTuning(prefetch_rows="yes")
    with pytest.raises(ValueError, match="qo_policy takes '' or one of evict_first, evict_last, evict_normal"):
        pc.Sm90PrefillTuning(qo_policy="evict_later")
    for h_q, d_qk in ((64, 576), (128, 576)):
        with pytest.raises(ValueError, match=f"staging: the 'ring' is built for d_qk 512 .* got h_q {h_q}, d_qk {d_qk}"):
            pc.kernel_config(h_q=h_q, d_qk=d_qk, has_topk_length=False, has_attn_sink=False,
                             tuning=pc.Sm90PrefillTuning(staging="ring"))
    for staging in ("ring", "q_reload"):
        with pytest.raises(ValueError, match=f"staging: the swap-AB tile \\(16 heads\\) .* got '{staging}'"):
            pc.kernel_config(h_q=16, d_qk=512, has_topk_length=False, has_attn_sink=False,
                             tuning=pc.Sm90PrefillTuning(staging=staging))
    for h_q, d_qk in ((64, 512), (128, 576)):
        with pytest.raises(ValueError, match=f"staging: the ping-pong tile \\({h_q} heads\\) .* got 'q'"):
            pc.kernel_config(h_q=h_q, d_qk=d_qk, has_topk_length=False, has_attn_sink=False,
                             tuning=pc.Sm90PrefillTuning(staging="q"))
    with pytest.raises(ValueError, match="staging takes one of q, ring, q_reload, got 'sQ'"):
        pc.Sm90PrefillTuning(staging="sQ")


def test_sm90_lazy_max_rule_and_refusals():
    """The lazy running max: on by the rule on the ping-pong tile (64 and 128 heads), either way
    when set there, refused on the swap-AB tile, and a non-bool named."""
    from cute_mla.kernels.sm90 import prefill_config as pc

    def lazy(h_q, d_qk, tuning=None):
        return pc.kernel_config(h_q=h_q, d_qk=d_qk, has_topk_length=False, has_attn_sink=True, tuning=tuning).tuning.lazy_max

    assert [lazy(h, d) for h in (64, 128) for d in (576, 512)] == [True] * 4
    assert [lazy(h, 576) for h in (8, 16, 32)] == [False] * 3
    assert lazy(64, 512, pc.Sm90PrefillTuning(lazy_max=False)) is False
    assert lazy(128, 576, pc.Sm90PrefillTuning(lazy_max=False)) is False
    with pytest.raises(ValueError, match="lazy_max: a knob of the ping-pong tile .* got h_q 16"):
        pc.kernel_config(h_q=16, d_qk=576, has_topk_length=False, has_attn_sink=False,
                         tuning=pc.Sm90PrefillTuning(lazy_max=True))
    with pytest.raises(ValueError, match="lazy_max takes a bool, got 'retire'"):
        pc.Sm90PrefillTuning(lazy_max="retire")


def test_sm90_ffma_exp_rule_scales_and_refusals():
    """One FFMA an element in the softmax: on by the rule on the ping-pong tile, off when set so,
    refused on the swap-AB tile and as a non-bool. A config with it takes only scales of at least
    the smallest normal fp32 (zero, negative and subnormal scales would turn a masked -inf into
    NaN or +inf, or a max into a min); its ``any_scale`` form is the same config without it, and
    every other config (SM100's too) takes every scale and is its own ``any_scale``."""
    from cute_mla.kernels.sm100 import prefill_config as pc100
    from cute_mla.kernels.sm90 import prefill_config as pc

    def cfg(h_q, d_qk=576, tuning=None):
        return pc.kernel_config(h_q=h_q, d_qk=d_qk, has_topk_length=False, has_attn_sink=True, tuning=tuning)

    assert [cfg(h, d).tuning.ffma_exp for h in (64, 128) for d in (576, 512)] == [True] * 4
    assert [cfg(h).tuning.ffma_exp for h in (8, 16, 32)] == [False] * 3
    on, off = cfg(128), cfg(128, tuning=pc.Sm90PrefillTuning(ffma_exp=False))
    assert off.tuning.ffma_exp is False and on != off
    scales = (0.0416, 1.0, pc.MIN_FFMA_SCALE, 1e30, 0.0, -0.0, -0.0416, 1e-39, pc.MIN_FFMA_SCALE / 2)
    assert [on.takes_scale(x) for x in scales] == [True] * 4 + [False] * 5
    assert all(off.takes_scale(x) for x in scales) and all(cfg(16).takes_scale(x) for x in scales)
    small = cfg(16)
    assert on.any_scale() == off and off.any_scale() is off and small.any_scale() is small
    assert dataclasses.replace(on.any_scale().tuning, ffma_exp=True) == on.tuning     # only the knob differs
    sm100 = pc100.kernel_config(h_q=128, d_qk=576, has_topk_length=False, has_attn_sink=True)
    assert all(sm100.takes_scale(x) for x in scales) and sm100.any_scale() is sm100
    with pytest.raises(ValueError, match="ffma_exp: a knob of the ping-pong tile .* got h_q 32"):
        cfg(32, tuning=pc.Sm90PrefillTuning(ffma_exp=True))
    with pytest.raises(ValueError, match="ffma_exp takes a bool, got 1"):
        pc.Sm90PrefillTuning(ffma_exp=1)


def test_sm90_skip_unit_scale_rule_and_refusals():
    """Skipping O's rescale where no row moved: on by the rule with the lazy running max (the
    ping-pong tile), either way when set there, refused on the swap-AB tile, a non-bool named."""
    from cute_mla.kernels.sm90 import prefill_config as pc

    def skip(h_q, d_qk, tuning=None):
        return pc.kernel_config(h_q=h_q, d_qk=d_qk, has_topk_length=True, has_attn_sink=False,
                                tuning=tuning).tuning.skip_unit_scale

    assert [skip(h, d) for h in (64, 128) for d in (576, 512)] == [True] * 4
    assert [skip(h, 512) for h in (8, 16, 32)] == [False] * 3
    assert skip(64, 512, pc.Sm90PrefillTuning(skip_unit_scale=False)) is False
    with pytest.raises(ValueError, match="skip_unit_scale: a knob of the ping-pong tile .* got h_q 8"):
        pc.kernel_config(h_q=8, d_qk=512, has_topk_length=False, has_attn_sink=False,
                         tuning=pc.Sm90PrefillTuning(skip_unit_scale=True))
    with pytest.raises(ValueError, match="skip_unit_scale takes a bool, got 1"):
        pc.Sm90PrefillTuning(skip_unit_scale=1)


def test_sm90_staging_ring_fits_and_is_reported():
    """The staging ring fits the CTA's shared memory at d_qk 512 and the report counts it."""
    from cute_mla.archs import SMEM_PER_CTA
    from cute_mla.kernels.sm90 import sparse_prefill as m

    on = m.kernel_config(h_q=64, d_qk=512, has_topk_length=False, has_attn_sink=False)
    off = m.kernel_config(h_q=64, d_qk=512, has_topk_length=False, has_attn_sink=False,
                          tuning=m.Sm90PrefillTuning(staging="q_reload"))
    assert on.tuning.staging == "ring"
    assert m.smem_bytes(on) == m.smem_bytes(off) + 16 * 1024 <= SMEM_PER_CTA


@pytest.mark.parametrize("h_q, d_qk, policy", [(64, 512, "evict_first"), (16, 576, "evict_first"), (16, 576, "")])
def test_sm90_qo_policy_rides_on_q_loads_and_out_stores(h_q, d_qk, policy, tmp_path):
    """With a Q/out policy, one createpolicy per MMA warp group's use and the Q loads and out stores
    carry it; without one, no createpolicy at all (the gather never takes one)."""
    from cute_mla.kernels.sm90 import sparse_prefill as m
    from cute_mla.playground import inspect as ki

    cfg = m.kernel_config(h_q=h_q, d_qk=d_qk, has_topk_length=False, has_attn_sink=True,
                          tuning=m.Sm90PrefillTuning(qo_policy=policy))
    m.compile(cfg, dump_dir=str(tmp_path))
    ptx, _ = ki.find_artifacts(str(tmp_path), "sm_90a")
    text = open(ptx).read()
    made = text.count(f"createpolicy.fractional.L2::{policy}.b64") if policy else text.count("createpolicy")
    assert (made > 0) == bool(policy)


def test_cli_plan_names_the_padding_and_no_workspace():
    r = _cli("plan", "--op", "sparse_prefill", "--s-q", "4096", "--h-q", "16", "--d-qk", "576", "--topk", "2048",
             "--arch", "sm_100a")
    assert r.returncode == 0, r.stderr
    assert "workspace 0 bytes" in r.stdout and "16 heads run as 64" in r.stdout
    r = _cli("plan", "--op", "sparse_prefill", "--s-q", "100", "--h-q", "128", "--d-qk", "512", "--topk", "512",
             "--json")
    d = json.loads(r.stdout)
    assert (d["op"], d["kernel_h_q"], d["workspace_bytes"], d["split"]) == ("sparse_prefill", 128, 0, False)
    assert (d["s_kv"], d["kv_fits_l2"]) == (None, False)
    r = _cli("plan", "--op", "sparse_prefill", "--s-q", "4096", "--h-q", "128", "--d-qk", "576", "--topk", "2048",
             "--s-kv", "32768")
    assert r.returncode == 0, r.stderr
    assert "s_kv=32768 (rows in L2)" in r.stdout
    r = _cli("plan", "--op", "sparse_decode", "--s-kv", "32768")
    assert r.returncode != 0 and "--s-kv: not an option of --op sparse_decode" in r.stderr


def test_cli_plan_refuses_decode_only_options():
    r = _cli("plan", "--op", "sparse_prefill", "--b", "4", "--extra-topk", "512")
    assert r.returncode != 0 and "--b, --extra-topk: not an option of --op sparse_prefill" in r.stderr


def test_cli_compile_writes_ptx_cubin_and_resources(tmp_path):
    r = _cli("compile", "--op", "sparse_prefill", "--arch", "sm_90a", "--d-qk", "576", "--h-q", "128",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert glob.glob(str(tmp_path / "sparse_prefill-sm_90a-h128-d576.ptx"))
    assert glob.glob(str(tmp_path / "sparse_prefill-sm_90a-h128-d576.cubin"))
    assert "dynamic shared memory" in r.stdout and "wgmma" in r.stdout
    r = _cli("compile", "--op", "sparse_prefill", "--arch", "sm_90a", "--split", "--out", str(tmp_path))
    assert r.returncode != 0 and "--split: not an option of --op sparse_prefill" in r.stderr


# ---------------------------------------------------------------------------------------- compile


@pytest.mark.parametrize("h_q, d_qk, kv_fits_l2", [(64, 576, False), (128, 512, False), (128, 576, True), (8, 576, False),
                                                  (16, 576, False), (16, 512, False), (32, 576, False),
                                                  (32, 512, False)])
def test_sm90_kernel_compiles_without_spills_or_serialized_wgmma(h_q, d_qk, kv_fits_l2, tmp_path):
    """Every wgmma pipelined (ptxas serializes them all when a pending accumulator crosses a
    branch merge), no local memory, the gather as cp.async with zero fill. 8, 16 and 32 heads in
    the swap-AB tile: wgmma m64n{h_q}k16 only (QK twice in the code: before an item's first tile
    and behind each PV; PV 4 chunks x 4 k-steps per MMA warp group), P^T and out leaving the
    fragments by stmatrix.trans; 64 and 128 heads in the ping-pong's 64-head tile."""
    from cute_mla.kernels.sm90 import sparse_prefill as m
    from cute_mla.playground import inspect as ki

    cfg = m.kernel_config(h_q=h_q, d_qk=d_qk, has_topk_length=True, has_attn_sink=True, kv_fits_l2=kv_fits_l2)
    assert cfg.swapped == (h_q < 64)
    m.compile(cfg, dump_dir=str(tmp_path))
    ptx, cubin = ki.find_artifacts(str(tmp_path), "sm_90a")
    text = open(ptx).read()
    assert "cp.async.cg.shared.global" in text and "cp.async.mbarrier.arrive.noinc" in text
    assert ("stmatrix.sync.aligned.m8n8" in text and ".trans.shared.b16" in text) == cfg.swapped
    assert m.smem_bytes(cfg) <= 227 * 1024
    if ki.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    sass = ki.sass(cubin)
    stats = ki.hgmma_stats(sass)
    assert stats.total > 0 and stats.with_gsb0 <= 16, stats
    assert ki.local_memory_ops(sass) == 0
    shapes = set(re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass))
    if cfg.swapped:
        assert shapes == {f"64x{h_q}x16"}, shapes
        assert stats.total == 2 * (d_qk // 16) + 2 * 16, stats
    else:
        assert shapes == {"64x64x16", "64x256x16"}, shapes   # QK over 64 rows, PV over 256 columns


# ------------------------------------------------------------------------------------ traced form


def _call(q, kv, idx, sink=None, tl=None, out=None):
    return cute_mla.flash_mla_sparse_fwd(q, kv, idx, 0.5, 512, sink, tl, out)


@pytest.mark.parametrize("h_q, with_out", [(128, False), (64, True), (16, False), (8, True)])
def test_traced_call_has_flashmla_shapes(fake_sm90, h_q, with_out):
    mode = FakeTensorMode()
    s_q, d_qk = 37, 576
    args = dict(q=fake_cuda((s_q, h_q, d_qk), torch.bfloat16, mode), kv=fake_cuda((300, 1, d_qk), torch.bfloat16, mode),
                idx=fake_cuda((s_q, 1, 128), torch.int32, mode), sink=fake_cuda((h_q,), torch.float32, mode),
                tl=fake_cuda((s_q,), torch.int32, mode))
    if with_out:
        args["out"] = fake_cuda((s_q, h_q, 512), torch.bfloat16, mode)
    rec = Recorder()
    compiled = torch.compile(_call, fullgraph=True, backend=rec)
    with mode:
        out, max_logits, lse = compiled(**args)
    assert out.shape == (s_q, h_q, 512) and out.dtype == torch.bfloat16
    assert max_logits.shape == lse.shape == (s_q, h_q) and lse.dtype == max_logits.dtype == torch.float32
    assert lse.is_contiguous() and max_logits.is_contiguous()
    assert rec.targets().count("cute_mla.sparse_prefill") == 1
    if with_out:
        assert out is args["out"]


def test_traced_call_refuses_bad_input_by_name(fake_sm90):
    mode = FakeTensorMode()
    q = fake_cuda((4, 64, 576), torch.bfloat16, mode)
    kv = fake_cuda((300, 1, 512), torch.bfloat16, mode)
    idx = fake_cuda((4, 1, 128), torch.int32, mode)
    compiled = torch.compile(_call, fullgraph=True, backend=Recorder())
    with mode, pytest.raises(Exception, match="kv: expected shape"):
        compiled(q, kv, idx)


def test_op_declares_out_mutated():
    schema = torch.ops.cute_mla.sparse_prefill.default._schema
    out = [a for a in schema.arguments if a.name == "out"][0]
    assert out.alias_info is not None and out.alias_info.is_write
