"""GPU (SM100 / B200): the sparse decode main kernel against the fp32 torch reference.

NOT RUN YET: no Blackwell GPU was available when this was written. It is meant to run as-is on a
compute-capability 10.0 GPU (it skips elsewhere) and is the first thing to run there (see
docs/sm100.md, "what to check first on real hardware").

FlashMLA's sparse-decode sweep and tolerances: h_q 64/128; (s_k, topk, page_block_size) in
{(512,64,2), (512,64,64), (1024,576,61), (2046,2048,64), (2046,2048,576)}; b in {4, 74, 321};
s_q in {1, 3}; NaN bytes in every cache slot no valid index points at, -1 and out-of-range indices,
one all-invalid row, sinks with +inf/-inf, with and without topk_length (0 included), power-of-two
and arbitrary fp32 scales. out: abs 1e-3 or rel 2.01/128 and cosine diff <= 5e-6; lse: abs 1e-6 or
rel 8.01/65536; inf positions identical.

V4 (d_qk 512) and its extra KV pool: the same checks on make_inputs' V4 caches (``test_v4_*``).

Both kernel variants run: the no-split variant on the per-request schedule (one partition per
request), the split variant on FlashMLA's greedy schedule for this GPU's SM count, with the partial
results merged here in float64 torch (the combine kernel has its own tests; the public-API test
below runs the real launcher, combine included).

Every launch waits through ``finish_or_exit`` (tests/_sm100_helpers.py): a kernel that does not
finish within a minute stops the whole session with a message naming the test (a hung kernel keeps
the GPU, so nothing after it could run).

"""

import pytest
import torch

from cute_mla import archs
from cute_mla.kernels import SparseDecodeTensors
from cute_mla.plan.policy import default_policy
from cute_mla.reference import sparse_decode_reference
from cute_mla.scheduler import accum_offsets, blocks_per_request, per_request_rows, plan_splits_host
from cute_mla.scheduler.partition import HostSchedule
from cute_mla.testing import check_diagnosed, check_out_lse, make_inputs, merge_splits, v4_sweep_inputs

from _sm100_helpers import finish_or_exit

pytestmark = [pytest.mark.gpu, pytest.mark.sm100]

SWEEP = [(512, 64, 2), (512, 64, 64), (1024, 576, 61), (2046, 2048, 64), (2046, 2048, 576)]


def _num_sms():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _kernel(h_q, split, has_topk_length, has_attn_sink, format="V3.2", has_extra=False, has_extra_topk_length=False):
    from cute_mla.kernels.sm100 import sparse_decode as sd

    cfg = sd.Sm100SparseDecodeConfig(h_q=h_q, split=split, has_topk_length=has_topk_length, has_attn_sink=has_attn_sink,
                                     format=format, has_extra=has_extra, has_extra_topk_length=has_extra_topk_length)
    return cfg, sd.compile(cfg)


def _schedule(topk, topk_length, b, split, s_q, h_q, device, extra_topk=0, extra_topk_length=None, cut=True):
    """The host schedule of a request's main blocks, then its extra blocks (the scheduler's rule).
    A split schedule is the one for this GPU's partition count; where that cuts no request but a
    request has more than one block, the partition count doubles until one is cut (``cut``: the
    tests', not the timing's), so every ``split`` case whose requests can be cut writes and merges
    partials (one-block requests cannot be: those cases run the split variant's whole-request
    path)."""
    lengths = lambda t: None if t is None else t.tolist()  # noqa: E731
    nb = blocks_per_request(topk, lengths(topk_length), b, extra_topk=extra_topk,
                            extra_topk_length=lengths(extra_topk_length))
    if split:
        parts = default_policy(archs.SM100.name).num_sm_parts(_num_sms(), s_q, h_q)
        s = plan_splits_host(nb, parts)
        while cut and not s.any_split and max(nb) > 1:
            parts *= 2
            s = plan_splits_host(nb, parts)
    else:
        s = HostSchedule(rows=per_request_rows(nb), num_splits=tuple(range(b + 1)))
    tile_md = torch.tensor(s.rows, dtype=torch.int32, device=device).reshape(len(s.rows), 8)
    offsets = torch.tensor(accum_offsets(s.num_splits), dtype=torch.int32, device=device)
    return s, tile_md, offsets


def run_kernel(inp, split, schedule=None):
    """Launch the SM100 main kernel; for the split variant merge the partials in torch.
    ``schedule``: (HostSchedule, tile_md, accum_offsets) to run with instead of the call's own.

    Returns (out (b, s_q, h, 512) fp32, lse (b, h, s_q) fp32, schedule)."""
    from cute_mla.kernels.sm100 import sparse_decode as sd

    q, dev = inp.q, inp.q.device
    b, s_q, h_q, _ = q.shape
    topk = inp.indices.shape[-1]
    kv = inp.k_cache.squeeze(2)
    has_extra = inp.extra_indices is not None
    extra_topk = inp.extra_indices.shape[-1] if has_extra else 0
    cfg, compiled = _kernel(h_q, split, inp.topk_length is not None, inp.attn_sink is not None, format=inp.format.name,
                            has_extra=has_extra, has_extra_topk_length=inp.extra_topk_length is not None)
    sched, tile_md, offsets = schedule or _schedule(topk, inp.topk_length, b, split, s_q, h_q, dev, extra_topk,
                                                    inp.extra_topk_length)
    # NaN-filled outputs: every element the kernel owns must be written.
    out = torch.full((b, s_q, h_q, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((b, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
    o_acc = lse_acc = None
    if split:
        rows = max(sched.split_rows, 1)
        o_acc = torch.full((rows, s_q, h_q, 512), float("nan"), dtype=torch.float32, device=dev)
        lse_acc = torch.full((rows, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
    extra_kv = inp.extra_k_cache.squeeze(2) if has_extra else None
    t = SparseDecodeTensors(q, kv, inp.indices, inp.topk_length, inp.attn_sink, extra_kv, inp.extra_indices,
                            inp.extra_topk_length, out=out, lse=lse, tile_md=tile_md, accum_offsets=offsets,
                            o_accum=o_acc, lse_accum=lse_acc, softmax_scale=inp.softmax_scale)
    sd.launch(compiled, cfg, t)
    finish_or_exit(f"b={b} s_q={s_q} h_q={h_q} topk={topk} split={split}")
    out = out.float()
    if split:
        out, lse = merge_splits(out, lse, o_acc, lse_acc, sched, inp.attn_sink)
    return out, lse.transpose(1, 2), sched


def _check(inp, split, schedule=None):
    out, lse, sched = run_kernel(inp, split, schedule)
    ref_out, ref_lse = inp.reference()
    check_diagnosed(out, lse, ref_out, ref_lse, sched)
    return sched


def _check_o_halves(inp):
    """The no-split kernel's out[..., :256] and out[..., 256:] against the reference, apart: O[:, 256:]
    lives in TMEM lanes 16-31 of each 32-lane slab (the second N=256 accumulator of the M=64
    layout), O[:, :256] in lanes 0-15. A failure names the half."""
    out, lse, _ = run_kernel(inp, split=False)
    ref_out, ref_lse = inp.reference()
    for name, cols in (("out[..., :256] (TMEM lanes 0-15)", slice(0, 256)),
                       ("out[..., 256:] (TMEM lanes 16-31)", slice(256, 512))):
        try:
            check_out_lse(out[..., cols], lse, ref_out[..., cols], ref_lse)
        except AssertionError as e:
            raise AssertionError(f"{name} is wrong: {e}") from e


# A single small case first: if this fails, nothing else will pass (see docs/sm100.md).
def test_smoke_one_tile(seed):
    """b=1, s_q=1, h_q=64, one 64-token block, every index valid; the halves of O apart (the upper
    one is the first hardware use of TMEM lanes 16-31), then the whole call."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(1, 1, 64, 64, num_tokens=512, page_block_size=64, invalid_frac=0.0, nan_unused=True,
                      device="cuda", generator=g)
    _check_o_halves(inp)
    _check(inp, split=False)


@pytest.mark.parametrize("d_qk", [576, 512], ids=["v32", "v4"])
def test_gather4_rows(seed, d_qk):
    """gather4 as such: the raw-row boxes (V3.2: 544 B of a 656-B row, the NoPE bytes and the four
    fp32 scales; V4: 448 B of a 576-B data row) and the RoPE boxes, 4 rows a box from 4 different
    page blocks of 3 tokens with 2 rows of padding after each (coordinate = block * rows per block
    + row), indices in random order, every one valid; V3.2 with arbitrary fp32 scales (read from
    bytes 512-527 of the box). A token order permuted within a box, a wrong pitch or a wrong box
    width show here while the one-block smoke case (page 64, no padding) may pass."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(1, 2, 64, 128, num_tokens=600, page_block_size=3, block_stride_pad=2, invalid_frac=0.0,
                      power_of_two_scales=(d_qk != 576), d_qk=d_qk, device="cuda", generator=g)
    _check_o_halves(inp)
    _check(inp, split=False)


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("s_k,topk,pbs", SWEEP)
@pytest.mark.parametrize("b", [4, 74, 321])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("split", [False, True], ids=["nosplit", "split"])
@pytest.mark.parametrize("with_topk_length", [False, True], ids=["", "topk_length"])
def test_flashmla_sweep(seed, h_q, s_k, topk, pbs, b, s_q, split, with_topk_length):
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(b, s_q, h_q, topk, num_tokens=s_k, page_block_size=pbs, with_sink=True,
                      out_of_range_frac=0.05, all_invalid_rows=1, with_topk_length=with_topk_length,
                      power_of_two_scales=(s_q == 1), device="cuda", generator=g)
    _check(inp, split)


@pytest.mark.parametrize("h_q", [64, 128])
def test_split_pieces_are_exercised(seed, h_q):
    """A case whose greedy schedule really cuts requests (so o_accum / lse_accum are written)."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(4, 1, h_q, 2048, num_tokens=8192, page_block_size=64, with_sink=True, out_of_range_frac=0.05,
                      power_of_two_scales=False, all_invalid_rows=1, device="cuda", generator=g)
    sched = _check(inp, split=True)
    assert sched.any_split


def test_non_power_of_two_scales_exact(seed):
    """PR #184's case: b=1, s_q=2, h=64, topk=64 over 2 blocks x 64, non-power-of-two fp32 scales,
    physical out-of-range indices and -1, topk_length=60. FlashMLA's SM100 truncated these scales."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(1, 2, 64, 64, num_tokens=128, page_block_size=64, out_of_range_frac=0.1,
                      power_of_two_scales=False, device="cuda", generator=g)
    inp.topk_length = torch.tensor([60], dtype=torch.int32, device="cuda")
    _check(inp, split=False)


def test_public_api_dispatches_here(seed):
    """flash_mla_with_kvcache on this GPU runs the SM100 kernel (and the combine when split)."""
    from cute_mla import flash_mla_with_kvcache, get_mla_metadata

    g = torch.Generator().manual_seed(seed)
    for b, topk in ((4, 2048), (74, 576)):
        x = make_inputs(b, 1, 128, topk, num_tokens=4096, page_block_size=64, with_sink=True, out_of_range_frac=0.05,
                        device="cuda", generator=g)
        sched, _ = get_mla_metadata()
        o, l = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, softmax_scale=x.softmax_scale,
                                      is_fp8_kvcache=True, indices=x.indices, attn_sink=x.attn_sink)
        assert sched.plan.kernel == "sm100_sparse_decode"
        ro, rl = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, x.attn_sink)
        finish_or_exit(f"public API b={b} topk={topk}")
        check_out_lse(o, l, ro, rl)


# ------------------------------------------------------------------------------ all-invalid and empty requests


def test_all_invalid_rows_and_zero_lengths(seed):
    """Rows whose indices are all invalid and requests with topk_length 0 (one masked block): out 0,
    lse +inf, without NaN from the NaN bytes of unused cache slots (b=4, s_q=2, h_q=64 and 128)."""
    g = torch.Generator().manual_seed(seed)
    for h_q in (64, 128):
        inp = make_inputs(4, 2, h_q, 128, num_tokens=1024, page_block_size=64, all_invalid_rows=2,
                          topk_lengths=(0, 128, 0, 77), nan_unused=True, device="cuda", generator=g)
        for split in (False, True):
            out, lse, _ = run_kernel(inp, split)
            assert (out[0] == 0).all() and (out[2] == 0).all() and (lse[[0, 2]] == float("inf")).all()
            _check(inp, split)


def _uploaded(s: HostSchedule):
    """(schedule, tile_md, accum_offsets) of a host schedule, for run_kernel."""
    tile_md = torch.tensor(s.rows, dtype=torch.int32, device="cuda").reshape(len(s.rows), 8)
    return s, tile_md, torch.tensor(accum_offsets(s.num_splits), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("h_q", [64, 128])
def test_empty_range_writes_an_empty_request(seed, h_q):
    """A schedule that disagrees with topk_length can give a request an empty block range. Every role
    skips it and it is written as an all-invalid request (out 0, lse +inf), both where the CTA's O
    holds the previous request's values and where TMEM was never written; the neighbours are
    unaffected. FlashMLA traps here; before the guard this hung (the MMA warp waited for a P).

    Partition 0: request 0 whole, request 1 as its last request with end block 0 (empty).
    Partition 1: request 2 from block 5 (its topk_length 64 gives it 1 block: empty, the CTA's
    first request), request 3 blocks [0, 4) (its topk_length 256: all of it)."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(4, 2, h_q, 512, num_tokens=2048, page_block_size=64, topk_lengths=(512, 300, 64, 256),
                      out_of_range_frac=0.05, device="cuda", generator=g)
    rows = ((0, 1, 0, 0, 0, 0, 0, 0), (2, 3, 5, 4, 0, 0, 0, 0))
    out, lse, _ = run_kernel(inp, split=False, schedule=_uploaded(HostSchedule(rows, tuple(range(5)))))
    ref_out, ref_lse = inp.reference()
    for r in (1, 2):
        assert (out[r] == 0).all(), f"request {r} (empty range): out is not 0"
        assert (lse[r] == float("inf")).all(), f"request {r} (empty range): lse is not +inf"
    for r in (0, 3):
        check_out_lse(out[r], lse[r], ref_out[r], ref_lse[r])


@pytest.mark.parametrize("h_q", [64, 128])
def test_stale_split_schedule_after_a_shorter_topk_length(seed, h_q):
    """The split schedule of topk_length [2048] * 3 over 4 partitions, run with request 1 shortened
    to 100 tokens: partition 2 starts request 1 at block 19 of its now 2 blocks (an empty piece,
    o_accum 0 and lse_accum -inf), partition 1 still covers its valid tokens. The merged result is
    the reference of the new lengths, and nothing hangs."""
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(3, 1, h_q, 2048, num_tokens=8192, page_block_size=64, topk_lengths=(2048, 100, 2048),
                      with_sink=True, out_of_range_frac=0.05, device="cuda", generator=g)
    old = plan_splits_host(blocks_per_request(2048, [2048] * 3), 4)
    assert old.rows[2][:4] == (1, 2, 19, 10), old.rows      # request 1 starts partition 2 at block 19
    _check(inp, split=True, schedule=_uploaded(old))


def test_public_api_reused_schedule_with_changed_topk_length(seed):
    """flash_mla_with_kvcache called twice with one schedule object, the second time with a shorter
    topk_length (the schedule is reused as built for the first call's lengths): it finishes and,
    the shortened request's valid tokens being inside its old range, matches the reference."""
    from cute_mla import flash_mla_with_kvcache, get_mla_metadata

    g = torch.Generator().manual_seed(seed)
    x = make_inputs(3, 1, 64, 2048, num_tokens=8192, page_block_size=64, topk_lengths=(2048, 2048, 2048),
                    device="cuda", generator=g)
    sched, _ = get_mla_metadata()
    for lengths in ([2048, 2048, 2048], [2048, 100, 2048]):
        x.topk_length = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        o, l = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, softmax_scale=x.softmax_scale,
                                      is_fp8_kvcache=True, indices=x.indices, topk_length=x.topk_length)
        finish_or_exit(f"public API, topk_length {lengths}")
        ro, rl = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, topk_length=x.topk_length)
        check_out_lse(o, l, ro, rl)


# ------------------------------------------------------------------------------ V4 (d_qk 512) + extra pool
# The V4 cache ("MODEL1": 576-B data rows, then 8-B ue8m0 scale rows per page block; V = all 512
# dims, RoPE included) and its extra KV pool, straight through the SM100 kernel. make_inputs builds
# the caches with quantize_v4 (page blocks padded to a multiple of 576 B, plus ``block_stride_pad``
# more data rows) and fills every data row and scale row no valid index reads with NaN bytes, so a
# RoPE (now part of V) or scale of an invalid token that leaks shows as NaN.


def test_v4_smoke_one_tile(seed):
    """The first V4 case to run (docs/sm100.md): one 64-token block, every index valid, no extra pool."""
    inp = v4_sweep_inputs(seed, 1, 1, 64, 64, num_tokens=512, page_block_size=64, invalid_frac=0.0, with_sink=False,
                     out_of_range_frac=0.0)
    _check_o_halves(inp)
    _check(inp, split=False)


def test_v4_smoke_extra_pool(seed):
    """One main block and one extra block (its own cache, page block size 2), every index valid."""
    inp = v4_sweep_inputs(seed, 1, 1, 64, 64, num_tokens=512, page_block_size=64, invalid_frac=0.0, with_sink=False,
                     out_of_range_frac=0.0, extra_topk=64, extra_num_tokens=256, extra_page_block_size=2)
    _check(inp, split=False)


# (b, s_q, topk, pool tokens, page block, extra_topk, extra pool tokens, extra page block, topk_length,
#  extra_topk_length, all-invalid rows, block_stride_pad)
V4_SWEEP = [
    (1, 1, 128, 512, 64, 0, 0, 0, False, False, 0, 0),
    (4, 1, 64, 512, 2, 0, 0, 0, True, False, 1, 1),
    (4, 3, 128, 1024, 53, 512, 1024, 64, True, True, 1, 0),
    (8, 2, 64, 512, 2, 512, 1024, 53, False, True, 2, 0),
    (74, 1, 128, 2046, 64, 512, 1024, 2, False, True, 0, 2),
    (74, 2, 576, 1024, 61, 0, 0, 0, True, False, 1, 0),
    (128, 1, 128, 2046, 64, 1024, 2046, 53, True, True, 2, 0),
    (321, 1, 64, 512, 64, 512, 512, 64, False, False, 0, 1),
]


def _v4_id(c):
    b, s_q, topk, _, page, extra, _, epage, tl, etl, empty, pad = c
    return (f"{b}x{s_q}-topk{topk}-p{page}" + (f"-extra{extra}-p{epage}" if extra else "")
            + ("-tl" if tl else "") + ("-etl" if etl else "") + (f"-empty{empty}" if empty else "")
            + (f"-pad{pad}" if pad else ""))


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("case", V4_SWEEP, ids=_v4_id)
@pytest.mark.parametrize("split", [False, True], ids=["nosplit", "split"])
def test_v4_sweep(seed, h_q, case, split):
    b, s_q, topk, tokens, page, extra, etokens, epage, tl, etl, empty, pad = case
    inp = v4_sweep_inputs(seed, b, s_q, h_q, topk, num_tokens=tokens, page_block_size=page, with_topk_length=tl,
                     all_invalid_rows=empty, block_stride_pad=pad, extra_topk=extra, extra_num_tokens=etokens or None,
                     extra_page_block_size=epage or None, with_extra_topk_length=etl)
    _check(inp, split)


@pytest.mark.parametrize("parts", [13, 74, 148])
@pytest.mark.parametrize("h_q", [64, 128])
def test_v4_split_pieces_cross_into_the_extra_list(seed, h_q, parts):
    """Greedy pieces that start inside the extra list and pieces that span main and extra blocks:
    the kernel's per-block pool choice (main blocks first, then extra) against the scheduler's.
    The schedule is the host planner's for a fixed partition count (74 and 148 are a B200's at h_q
    128 and 64), so the pieces cross whatever this GPU's SM count is."""
    inp = v4_sweep_inputs(seed, 8, 1, h_q, 2048, num_tokens=8192, page_block_size=64, extra_topk=1024,
                     extra_num_tokens=4096, extra_page_block_size=53, all_invalid_rows=1)
    sched = plan_splits_host(blocks_per_request(2048, None, 8, extra_topk=1024), parts)
    n_main = 2048 // 64
    assert sched.any_split
    assert any(r[0] == r[1] and r[2] < n_main < r[3] for r in sched.rows), "no piece spans main and extra blocks"
    assert any(r[2] > n_main for r in sched.rows), "no piece starts inside the extra list"
    _check(inp, split=True, schedule=_uploaded(sched))


def test_v4_lengths_zero_and_empty_lists(seed):
    """topk_length 0 (one masked main block), extra_topk_length 0 (no extra block), both at once."""
    inp = v4_sweep_inputs(seed, 3, 2, 64, 128, num_tokens=1024, page_block_size=53, extra_topk=128,
                     extra_num_tokens=512, extra_page_block_size=2, topk_lengths=(0, 0, 77),
                     extra_topk_lengths=(0, 65, 0))
    _check(inp, split=False)
    _check(inp, split=True)


@pytest.mark.parametrize("h_q", [64, 128])
def test_v4_stale_schedule_with_the_extra_pool(seed, h_q):
    """The split schedule of main and extra lists of 512 (8 + 8 blocks a request, 3 partitions), run
    with both topk_lengths cut to 64 (blocks: 1 main + 8 extra). Partitions keep their old ranges
    where the schedule gives both ends: partition 2's request 1 runs [7, 16), tiles past the end of
    the last request's extra list, which the INDEX warp must not read (it reads no index at or past
    a list's length); partition 1 starts request 0 at block 14 of its 9 (an empty piece). Every
    valid block is still in exactly one piece: the reference of the new lengths, and nothing hangs."""
    inp = v4_sweep_inputs(seed, 2, 1, h_q, 512, num_tokens=2048, page_block_size=64, extra_topk=512,
                     extra_num_tokens=1024, extra_page_block_size=2, topk_lengths=(64, 64))
    old = plan_splits_host(blocks_per_request(512, [512, 512], extra_topk=512), 3)
    assert old.rows[0][:4] == (0, 0, 0, 14) and old.rows[1][:4] == (0, 1, 14, 7), old.rows
    _check(inp, split=True, schedule=_uploaded(old))


def test_v4_public_api_dispatches_here(seed):
    """flash_mla_with_kvcache with a V4 cache and an extra pool on this GPU runs the SM100 kernel."""
    from cute_mla import flash_mla_with_kvcache, get_mla_metadata

    for b, topk, extra in ((4, 128, 512), (74, 2048, 1024)):
        x = v4_sweep_inputs(seed, b, 1, 128, topk, num_tokens=4096, page_block_size=64, extra_topk=extra,
                       extra_num_tokens=2048, extra_page_block_size=2, with_extra_topk_length=True)
        sched, _ = get_mla_metadata()
        o, l = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, **x.call_kwargs())
        assert sched.plan.kernel == "sm100_sparse_decode"
        ro, rl = x.reference()
        finish_or_exit(f"public API V4 b={b} topk={topk} extra={extra}")
        check_out_lse(o, l, ro, rl)
