"""GPU (SM100 / B200): ``cute_mla.flash_mla_sparse_fwd`` on the SM100 sparse prefill kernel against
the reference.

NOT RUN YET: no Blackwell GPU was available when this was written. It runs as is on a compute
capability 10.0 GPU (it skips elsewhere); ``bash benchmarks/sm100_first_run.sh`` runs it (step 7).

The cases, inputs, tolerances and helpers are those of tests/test_sparse_prefill_gpu.py (FlashMLA's
prefill suite, marked ``sm90`` there), run here on SM100 in the order a first run wants: a one-tile
smoke case, FlashMLA's correctness / with-features / corner lists at h_q 64 and 128, NaN in every KV
row no valid position reads, ``out=`` (a strided head slice too), CUDA graph replay with new
indices, and FlashMLA's s_q = 70000 grid case.

Every launch of the smoke and list cases waits through ``finish_or_exit`` (tests/_sm100_helpers.py):
a kernel that does not finish within a minute stops the session with a message naming the case (a
hung kernel keeps the GPU, so nothing after it could run).
"""

from __future__ import annotations

import zlib

import pytest
import torch

import test_sparse_prefill_gpu as base
from _sm100_helpers import finish_or_exit
from cute_mla.testing import check_prefill, make_prefill_inputs, prefill_corner_cases

pytestmark = [pytest.mark.gpu, pytest.mark.sm100]


def run_and_check(x, what: str) -> None:
    """The op on inputs ``x``, waited for under the watchdog, then FlashMLA's layout and tolerances
    against the reference."""
    out, max_logits, lse = base.run(x)
    finish_or_exit(what, "SM100 prefill kernel", "sparse prefill")
    base.check_layout(x, out, max_logits, lse)
    check_prefill(out, max_logits, lse, *x.reference())


def test_runs_on_sm100():
    """The API plans the SM100 kernel on this GPU."""
    from cute_mla.interface.ops import device_facts
    from cute_mla.plan.sparse_prefill import plan_sparse_prefill

    arch, _ = device_facts(torch.device("cuda"))
    assert arch == "sm_100a"
    assert plan_sparse_prefill(1, 64, 576, 64, arch=arch).kernel == "sm100_sparse_prefill"


@pytest.mark.parametrize("h_q,d_qk", [(64, 576), (64, 512), (128, 576)])
def test_smoke_one_tile(h_q, d_qk):
    """One token, top-k 64 (two 32-position tiles), all valid, no sink: does it run at all; then
    the same with an invalid position in each tile (a negative index, one equal to s_kv)."""
    x = make_prefill_inputs(1, 128, 64, h_q, d_qk, seed=zlib.crc32(f"smoke-{h_q}-{d_qk}".encode()), device="cuda")
    run_and_check(x, f"smoke h_q={h_q} d_qk={d_qk}")
    x.indices[..., 5] = -1
    x.indices[..., 40] = 128
    run_and_check(x, f"smoke with invalid positions h_q={h_q} d_qk={d_qk}")


@pytest.mark.parametrize("case", base._param(base.MAIN_CASES))
def test_flashmla_cases(case):
    run_and_check(case.make_inputs("cuda"), case.name)


@pytest.mark.parametrize("topk_length", [False, True])
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [8, 64, 128])
def test_nan_in_unread_kv_rows_changes_nothing(h_q, d_qk, topk_length):
    """NaN in every KV row no valid position reads (invalid, past topk_length, padding): the gather
    zero-fills those rows (coordinate -1), so the bits equal the run without NaN."""
    base.test_nan_in_unread_kv_rows_changes_nothing(h_q, d_qk, topk_length)


@pytest.mark.parametrize("layout", ["contiguous", "head_slice"])
@pytest.mark.parametrize("h_q", [16, 64, 128])
def test_out_is_written_in_place(h_q, layout):
    """The output TMA stores into a caller's out (a strided head slice too), nothing around it."""
    base.test_out_is_written_in_place(h_q, layout)


@pytest.mark.parametrize("h_q,d_qk,topk_length", [(64, 576, True), (128, 512, False), (16, 512, True)])
def test_cuda_graph_replay_with_new_indices(h_q, d_qk, topk_length):
    base.test_cuda_graph_replay_with_new_indices(h_q, d_qk, topk_length)


def test_s_q_70000():
    """FlashMLA's grid case: s_q * h_q / 64 CTAs in grid x, rows on both sides of 65535 checked."""
    for h_q in (128, 64):
        for case in prefill_corner_cases(h_q):
            if not case.check_correctness:
                base._check_70000(case)


def test_random_inputs_match_fp64_reference(seed):
    """A random shape beyond FlashMLA's lists (odd lengths, sink, topk_length)."""
    g = torch.Generator().manual_seed(seed)
    s_q, s_kv = int(torch.randint(1, 300, (1,), generator=g)), int(torch.randint(64, 5000, (1,), generator=g))
    topk = 64 * int(torch.randint(1, 40, (1,), generator=g))
    x = make_prefill_inputs(s_q, s_kv, topk, 128, 576, attn_sink=True, topk_length=True, all_invalid_rows=True,
                            seed=seed, device="cuda")
    run_and_check(x, f"random s_q={s_q} s_kv={s_kv} topk={topk}")
