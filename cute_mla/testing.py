"""Test-data generation and FlashMLA's comparison rules, shared by tests, benchmarks and the demo."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

from . import archs
from .formats import V32, quantize_v32
from .scheduler import FIXED_OVERHEAD, accum_offsets, blocks_per_request, plan_splits_host

ROW = V32.row_bytes


@dataclass
class SparseDecodeInputs:
    q: torch.Tensor              # (b, s_q, h_q, d_qk) bf16
    k_cache: torch.Tensor        # (num_blocks, page_block_size, 1, row bytes) uint8
    indices: torch.Tensor        # (b, s_q, topk) int32
    topk_length: Optional[torch.Tensor]
    attn_sink: Optional[torch.Tensor]
    softmax_scale: float


@dataclass(frozen=True)
class InputOptions:
    """What :func:`make_inputs` varies besides the shape (its keyword arguments)."""

    num_tokens: int = 4096
    page_block_size: int = 64
    invalid_frac: float = 0.2          # indices set to -1
    out_of_range_frac: float = 0.0     # indices set past the pool or to another negative value
    with_topk_length: bool = False
    with_sink: bool = False            # sinks of N(0,1), +inf and -inf
    power_of_two_scales: bool = True   # FlashMLA's quantizer recipe, or exact amax/448 scales
    nan_unused: bool = True            # NaN bytes in every cache slot no valid index reads
    all_invalid_rows: int = 0          # (b, s) rows whose indices are all -1
    device: object = "cpu"
    generator: Optional[torch.Generator] = None
    block_stride_pad: int = 1          # rows of padding after each page block (stride(0) > page * row)
    unique: bool = True                # unique indices per row (large benchmark shapes: duplicates)


def make_inputs(b: int, s_q: int, h_q: int, topk: int, **options) -> SparseDecodeInputs:
    """Random inputs in FlashMLA's test style; ``options`` are :class:`InputOptions` fields.

    q ~ N(0,1) clamped to +-1; KV ~ N(0,1)/10 clamped; each (b, s) row gets random token indices
    (spread over a randomly permuted pool of page blocks), a fraction set to -1 and a fraction set
    out of range; every cache slot no valid index points at is filled with NaN bytes; page blocks
    are padded (stride(0) = (page_block_size + block_stride_pad) rows).
    """
    unknown = set(options) - {f.name for f in fields(InputOptions)}
    if unknown:
        raise TypeError(f"make_inputs: unknown options {sorted(unknown)}")
    o = InputOptions(**options)
    g = o.generator
    page = o.page_block_size
    num_blocks = -(-o.num_tokens // page)
    num_tokens = num_blocks * page
    q = (torch.randn(b, s_q, h_q, V32.d_qk, generator=g).clamp(-1, 1)).to(torch.bfloat16)
    kv = (torch.randn(num_tokens, V32.d_qk, generator=g) / 10).clamp(-1, 1)
    raw = quantize_v32(kv, power_of_two_scales=o.power_of_two_scales)
    cache = torch.zeros(num_blocks, page + o.block_stride_pad, 1, ROW, dtype=torch.uint8)
    cache = cache[:, :page]
    cache.copy_(raw.reshape(num_blocks, page, 1, ROW))
    idx = _random_indices(b, s_q, topk, num_tokens, o)
    topk_length = None
    if o.with_topk_length:
        topk_length = torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32)
        topk_length[0] = 0 if b > 1 else topk_length[0]
    if o.nan_unused:
        _poison_unused_rows(cache, idx, topk_length, num_tokens)
    attn_sink = None
    if o.with_sink:
        attn_sink = torch.randn(h_q, generator=g)
        m = torch.rand(h_q, generator=g)
        attn_sink[m < 0.31] = float("inf")
        attn_sink[(m >= 0.31) & (m < 0.62)] = float("-inf")

    dev = torch.device(o.device)
    mv = lambda t: None if t is None else t.to(dev)  # noqa: E731
    if dev.type != "cpu":
        # keep the padded page-block stride on the device too
        big = torch.empty(num_blocks, page + o.block_stride_pad, 1, ROW, dtype=torch.uint8, device=dev)
        big[:, :page].copy_(cache)
        cache_dev = big[:, :page]
    else:
        cache_dev = cache
    return SparseDecodeInputs(q=mv(q), k_cache=cache_dev, indices=mv(idx), topk_length=mv(topk_length),
                              attn_sink=mv(attn_sink), softmax_scale=V32.d_qk ** -0.55)


def _random_indices(b: int, s_q: int, topk: int, num_tokens: int, o: InputOptions) -> torch.Tensor:
    g = o.generator
    topk_eff = min(topk, num_tokens)
    if o.unique:
        idx = torch.stack([torch.randperm(num_tokens, generator=g)[:topk_eff] for _ in range(b * s_q)]).to(torch.int32)
    else:  # large benchmark shapes: duplicates are harmless (the reference counts them too)
        idx = torch.randint(0, num_tokens, (b * s_q, topk_eff), generator=g, dtype=torch.int32)
    if topk_eff < topk:
        idx = torch.cat([idx, torch.full((b * s_q, topk - topk_eff), -1, dtype=torch.int32)], dim=1)
    r = torch.rand(idx.shape, generator=g)
    idx[r < o.invalid_frac] = -1
    if o.out_of_range_frac:
        oor = (r >= o.invalid_frac) & (r < o.invalid_frac + o.out_of_range_frac)
        big = torch.randint(num_tokens, 2**31 - 1, idx.shape, generator=g, dtype=torch.int64).to(torch.int32)
        idx[oor] = torch.where(torch.rand(idx.shape, generator=g) < 0.5, big, torch.full_like(big, -7))[oor]
    idx = idx.reshape(b, s_q, topk)
    if o.all_invalid_rows:
        flat = idx.view(b * s_q, topk)
        for row in torch.randperm(b * s_q, generator=g)[:o.all_invalid_rows].tolist():
            flat[row] = -1
    return idx


def _poison_unused_rows(cache: torch.Tensor, idx: torch.Tensor, topk_length, num_tokens: int) -> None:
    """NaN bytes (0xFF is NaN in e4m3, fp32 and bf16) in every cache slot no valid index reads."""
    b, _, topk = idx.shape
    page = cache.shape[1]
    used = torch.zeros(num_tokens, dtype=torch.bool)
    vi = idx.to(torch.int64)
    valid = (vi >= 0) & (vi < num_tokens)
    if topk_length is not None:
        valid &= torch.arange(topk).view(1, 1, topk) < topk_length.view(b, 1, 1).to(torch.int64)
    used[vi[valid]] = True
    unused = (~used).nonzero().flatten()
    cache[unused // page, unused % page, 0] = torch.full((ROW,), 0xFF, dtype=torch.uint8)


def check_allclose(name: str, got: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float,
                   cos_diff_tol: Optional[float] = None) -> None:
    """FlashMLA's rule: per element abs_err < abs_tol or rel_err < rel_tol; inf/NaN
    positions identical; optionally cosine difference 1 - 2<a,b>/(|a|^2+|b|^2) <= cos_diff_tol."""
    got = got.double().cpu()
    ref = ref.double().cpu()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs reference {tuple(ref.shape)}"
    for what, fn in (("nan", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        mism = fn(got) != fn(ref)
        assert not mism.any(), f"{name}: {what} positions differ at {mism.sum().item()} elements, first {mism.nonzero()[0].tolist()}"
    finite = torch.isfinite(ref)
    g, r = got[finite], ref[finite]
    abs_err = (g - r).abs()
    rel_err = abs_err / (r.abs() + 1e-6)
    bad = (abs_err >= abs_tol) & (rel_err >= rel_tol)
    if bad.any():
        i = bad.nonzero()[0].item()
        raise AssertionError(f"{name}: {bad.sum().item()} of {g.numel()} elements out of tolerance "
                             f"(abs {abs_tol}, rel {rel_tol}); e.g. got {g[i].item()} vs ref {r[i].item()}; "
                             f"max abs err {abs_err.max().item():.3e}")
    if cos_diff_tol is not None and g.numel():
        denom = (g * g + r * r).sum()
        cos_diff = (1 - 2 * (g * r).sum() / denom).item() if denom > 0 else 0.0
        assert cos_diff <= cos_diff_tol, f"{name}: cosine difference {cos_diff:.3e} > {cos_diff_tol}"


def check_out_lse(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> None:
    """The sparse decode tolerances of FlashMLA's test suite."""
    check_allclose("out", out.float(), ref_out, abs_tol=1e-3, rel_tol=2.01 / 128, cos_diff_tol=5e-6)
    check_allclose("lse", lse.float(), ref_lse, abs_tol=1e-6, rel_tol=8.01 / 65536)


def merge_splits(out, lse, o_acc, lse_acc, sched, sink):
    """The split-KV combine in float64 torch, for kernel tests that launch a split variant
    directly: base-2 partial lse, weights 2^(lse_i - G), the sink applied once. ``sched`` is the
    HostSchedule the kernel ran with (accumulator rows at :func:`accum_offsets` of its num_splits)."""
    ns = sched.num_splits
    offs = accum_offsets(ns)
    for r in range(len(ns) - 1):
        n = ns[r + 1] - ns[r]
        if n == 1:
            continue
        L = lse_acc[offs[r]: offs[r] + n].double()          # (n, s_q, h)
        O = o_acc[offs[r]: offs[r] + n].double()            # (n, s_q, h, 512)
        mx = L.max(dim=0).values
        mx = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)
        tot = torch.exp2(L - mx).sum(dim=0)
        G = torch.where(tot == 0, torch.full_like(tot, math.inf), torch.log2(tot) + mx)
        w = torch.where(torch.isinf(G), torch.zeros_like(L), torch.exp2(L - G))
        o = (w[..., None] * O).sum(dim=0)
        lse_nat = G * math.log(2.0)
        if sink is not None:
            f = torch.sigmoid(lse_nat - sink.double().view(1, -1))
            f = torch.where(torch.isposinf(lse_nat), torch.zeros_like(f), f)
            o = o * f[..., None]
        out[r] = o.float()
        lse[r] = lse_nat.float()
    return out, lse


def host_schedule(topk: int, topk_length, b: int, parts: int, device, overhead: int = FIXED_OVERHEAD):
    """FlashMLA's greedy schedule of ``b`` requests over ``parts`` partitions, made on the host (the
    lengths read back when given): (HostSchedule, tile_md tensor, accum_offsets tensor)."""
    nb = blocks_per_request(topk, None if topk_length is None else topk_length.tolist(), b)
    s = plan_splits_host(nb, parts, overhead)
    tile_md = torch.tensor(s.rows, dtype=torch.int32, device=device).reshape(parts, -1)
    return s, tile_md, torch.tensor(accum_offsets(s.num_splits), dtype=torch.int32, device=device)


def run_kernel(inp: SparseDecodeInputs, cfg, parts: int, overhead: int = FIXED_OVERHEAD):
    """Launch one arch's sparse decode kernel (its config ``cfg``, any variant) directly on ``inp``
    over the host schedule of ``parts`` partitions; for the split variant merge the partials in
    torch (fp64). Outputs start as NaN, so anything the kernel leaves unwritten shows.

    Returns (out (b, s_q, h, d_v) fp32, lse (b, h, s_q) fp32, the HostSchedule)."""
    from .interface.launcher import kernel_module
    from .kernels import DecodeTensors

    mod = kernel_module(cfg.arch)
    q, dev = inp.q, inp.q.device
    b, s_q, h_q, _ = q.shape
    sched, tile_md, offsets = host_schedule(inp.indices.shape[-1], inp.topk_length, b, parts, dev, overhead)
    if not cfg.split:
        assert not sched.any_split, "the no-split variant only runs on schedules without split pieces"
    out = torch.full((b, s_q, h_q, V32.d_v), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((b, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
    o_acc = lse_acc = None
    if cfg.split:
        rows = max(sched.split_rows, 1)
        accum = getattr(torch, archs.get(cfg.arch).accum_dtype)
        o_acc = torch.full((rows, s_q, h_q, V32.d_v), float("nan"), dtype=accum, device=dev)
        lse_acc = torch.full((rows, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
    t = DecodeTensors(q, inp.k_cache.squeeze(2), inp.indices, inp.topk_length, inp.attn_sink, tile_md, offsets,
                      out, lse, o_acc, lse_acc)
    mod.launch_sparse_decode(mod.compile_sparse_decode(cfg), cfg, t, inp.softmax_scale)
    torch.cuda.synchronize()
    out = out.float()
    if cfg.split:
        out, lse = merge_splits(out, lse, o_acc, lse_acc, sched, inp.attn_sink)
    return out, lse.transpose(1, 2), sched


def diagnose(out, lse, ref_out, ref_lse, sched):
    """Where the errors are (printed on failure): per request / query token / head."""
    def diff(a, r):
        return torch.where(a == r, torch.zeros_like(a), (a - r).abs().nan_to_num(1e9))

    err = diff(out, ref_out).amax(dim=-1)                              # (b, s_q, h)
    lerr = diff(lse, ref_lse).transpose(1, 2)                          # (b, s_q, h)
    bad = (err > 1e-2) | (lerr > 1e-3)
    if bad.any():
        idx = bad.nonzero()
        ns = sched.num_splits
        split_req = {r for r in range(len(ns) - 1) if ns[r + 1] - ns[r] > 1}
        reqs = sorted(set(idx[:, 0].tolist()))
        heads = sorted(set(idx[:, 2].tolist()))
        print(f"DIAG bad rows {int(bad.sum())}/{bad.numel()}; requests {reqs[:20]} (split: {sorted(split_req & set(reqs))[:20]}); "
              f"query tokens {sorted(set(idx[:, 1].tolist()))[:8]}; heads {heads[:16]}... "
              f"(rows 16w..16w+15 share a TMEM slab; heads >= 64 are the second CTA)")
        i = idx[0].tolist()
        print(f"DIAG first bad {i}: out {out[i[0], i[1], i[2], :4].tolist()} ref {ref_out[i[0], i[1], i[2], :4].tolist()}; "
              f"out[256:260] {out[i[0], i[1], i[2], 256:260].tolist()} ref {ref_out[i[0], i[1], i[2], 256:260].tolist()}; "
              f"lse {lse[i[0], i[2], i[1]].item()} ref {ref_lse[i[0], i[2], i[1]].item()}")


def median_event_us(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median device time of ``fn()`` in µs: CUDA events around each call, synchronized per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return sorted(times)[len(times) // 2]


def transient_bytes(fn):
    """Run ``fn()`` (returning the call's output tensors) and measure its transient device memory:
    the peak bytes *requested* from torch's caching allocator during the call, beyond those held
    before, minus the returned tensors. Returns ``(result, bytes)``.

    Requested bytes, not ``memory_allocated``'s blocks: a request served from a cached free block
    takes the whole block when the remainder is too small to split (up to 1 MiB in the large pool),
    which ``max_memory_allocated`` counts (an 8.031 MiB plan read 8.496 MiB that way on the H200).
    """
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.memory_stats()["requested_bytes.all.peak"] - before
    outs = result if isinstance(result, (tuple, list)) else (result,)
    return result, peak - sum(t.nbytes for t in outs if isinstance(t, torch.Tensor))
