"""Test-data generation and FlashMLA's comparison rules, shared by tests, benchmarks and the demo."""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, fields, replace
from typing import List, Optional, Sequence, Tuple

import torch

from .formats import V4, V32, KVCacheFormat, detect_format, format_for_d_qk
from .reference import sparse_decode_reference, sparse_prefill_reference, valid_positions
from .scheduler import FIXED_OVERHEAD, accum_offsets, blocks_per_request, plan_splits_host
from .scheduler.partition import HostSchedule


@dataclass
class SparseDecodeInputs:
    q: torch.Tensor              # (b, s_q, h_q, d_qk) bf16
    k_cache: torch.Tensor        # (num_blocks, page_block_size, 1, row bytes) uint8
    indices: torch.Tensor        # (b, s_q, topk) int32
    topk_length: Optional[torch.Tensor]
    attn_sink: Optional[torch.Tensor]
    softmax_scale: float
    # V4's extra pool (None without one): a second cache of the format, its own page block size
    extra_k_cache: Optional[torch.Tensor] = None        # (extra blocks, extra page, 1, row bytes) uint8
    extra_indices: Optional[torch.Tensor] = None        # (b, s_q, extra_topk) int32
    extra_topk_length: Optional[torch.Tensor] = None    # (b,) int32

    @property
    def format(self) -> KVCacheFormat:
        """The cache's format (from d_qk and its row bytes, as the API detects it)."""
        return detect_format(self.q.shape[-1], self.k_cache.shape[-1])

    def call_kwargs(self) -> dict:
        """The keyword arguments of ``flash_mla_with_kvcache`` besides q, k_cache and the four
        positional ones (FlashMLA's names)."""
        return dict(softmax_scale=self.softmax_scale, is_fp8_kvcache=True, indices=self.indices,
                    attn_sink=self.attn_sink, topk_length=self.topk_length, extra_k_cache=self.extra_k_cache,
                    extra_indices_in_kvcache=self.extra_indices, extra_topk_length=self.extra_topk_length)

    def kernel_config(self, kernel_config, split: bool, **kw):
        """The config ``kernel_config`` (an arch's ``kernel_config``) makes for these inputs: their
        heads, format, lengths, sink and extra pool, with ``split`` and any other fields ``kw``."""
        return kernel_config(h_q=self.q.shape[2], format=self.format.name, split=split,
                             has_topk_length=self.topk_length is not None, has_attn_sink=self.attn_sink is not None,
                             has_extra=self.extra_indices is not None,
                             has_extra_topk_length=self.extra_topk_length is not None, **kw)

    def reference(self, q: Optional[torch.Tensor] = None, **kw):
        """:func:`cute_mla.reference.sparse_decode_reference` of these inputs (``q`` replaced if given)."""
        return sparse_decode_reference(self.q if q is None else q, self.k_cache, self.indices, self.softmax_scale,
                                       self.attn_sink, self.topk_length, extra_k_cache=self.extra_k_cache,
                                       extra_indices=self.extra_indices, extra_topk_length=self.extra_topk_length, **kw)


@dataclass(frozen=True)
class InputOptions:
    """What :func:`make_inputs` varies besides the shape (its keyword arguments)."""

    num_tokens: int = 4096
    page_block_size: int = 64
    invalid_frac: float = 0.2          # indices set to -1
    out_of_range_frac: float = 0.0     # indices set past the pool or to another negative value
    with_topk_length: bool = False
    with_sink: bool = False            # sinks of N(0,1), +inf and -inf
    power_of_two_scales: bool = True   # FlashMLA's quantizer recipe, or exact amax/448 scales (V3.2 only)
    nan_unused: bool = True            # NaN bytes in every cache slot no valid index reads
    all_invalid_rows: int = 0          # (b, s) rows whose indices are all -1 (both lists)
    device: object = "cpu"
    generator: Optional[torch.Generator] = None
    # padding after each page block: V3.2 whole rows (None: 1, FlashMLA's test layout); V4 576-B
    # data rows on top of the quantizer's padding to a multiple of 576 B (None: 0)
    block_stride_pad: Optional[int] = None
    unique: bool = True                # unique indices per row (large benchmark shapes: duplicates)
    d_qk: int = V32.d_qk               # 576: V3.2 cache; 512: V4 cache
    extra_topk: int = 0                # V4's extra pool: its list length (0: no extra pool)
    extra_num_tokens: Optional[int] = None        # tokens of the extra pool (None: num_tokens)
    extra_page_block_size: Optional[int] = None   # its page block size (None: page_block_size)
    with_extra_topk_length: bool = False
    # Given lengths instead of random ones (b values each; they imply with_topk_length /
    # with_extra_topk_length). A test that needs particular lengths passes them here rather than
    # setting them after the call: the NaN bytes go to the slots these lengths leave unread, so a
    # later, longer length would make valid tokens NaN and the reference NaN with them.
    topk_lengths: Optional[Tuple[int, ...]] = None
    extra_topk_lengths: Optional[Tuple[int, ...]] = None


def make_inputs(b: int, s_q: int, h_q: int, topk: int, **options) -> SparseDecodeInputs:
    """Random inputs in FlashMLA's test style; ``options`` are :class:`InputOptions` fields.

    q ~ N(0,1) clamped to +-1; KV ~ N(0,1)/10 clamped; each (b, s) row gets random token indices
    (spread over a randomly permuted pool of page blocks), a fraction set to -1 and a fraction set
    out of range; every cache slot no valid index points at is filled with NaN bytes (V4: its data
    row and its scale row); page blocks are padded (``block_stride_pad``).

    ``d_qk=512`` makes a V4 cache; ``extra_topk > 0`` adds V4's extra pool (its own cache, indices
    and, with ``with_extra_topk_length``, lengths), generated after everything else, so the main
    pool's data are the same with or without it. V3.2 inputs are byte-identical to those of
    earlier versions of this function for the same seed and options.
    """
    unknown = set(options) - {f.name for f in fields(InputOptions)}
    if unknown:
        raise TypeError(f"make_inputs: unknown options {sorted(unknown)}")
    # Everything is generated on the host (CPU generators), whatever torch's default device is.
    with torch.device("cpu"):
        return _make_inputs(b, s_q, h_q, topk, InputOptions(**options))


def v4_sweep_inputs(seed: int, b: int, s_q: int, h_q: int, topk: int, **options) -> SparseDecodeInputs:
    """V4 inputs in the style of FlashMLA's d_qk = 512 sweep (sinks on, 5 % of the indices out of
    range unless ``options`` say otherwise) on the GPU, from a generator seeded with ``seed``."""
    options.setdefault("with_sink", True)
    options.setdefault("out_of_range_frac", 0.05)
    return make_inputs(b, s_q, h_q, topk, d_qk=V4.d_qk, device="cuda", generator=torch.Generator().manual_seed(seed),
                       **options)


def _make_inputs(b: int, s_q: int, h_q: int, topk: int, o: InputOptions) -> SparseDecodeInputs:
    fmt = format_for_d_qk(o.d_qk)
    if o.extra_topk and not fmt.extra_pool:
        raise ValueError(f"make_inputs: extra_topk needs the V4 format (d_qk={V4.d_qk}), got d_qk={o.d_qk}")
    if o.extra_topk_lengths is not None and not o.extra_topk:
        raise ValueError("make_inputs: extra_topk_lengths needs an extra pool (extra_topk > 0)")
    g = o.generator
    q = (torch.randn(b, s_q, h_q, fmt.d_qk, generator=g).clamp(-1, 1)).to(torch.bfloat16)
    cache, num_tokens = _random_cache(fmt, o.num_tokens, o.page_block_size, o)
    idx, empty_rows = _random_indices(b, s_q, topk, num_tokens, o)
    topk_length = None
    if o.topk_lengths is not None:
        topk_length = _given_lengths("topk_lengths", o.topk_lengths, b)
    elif o.with_topk_length:
        topk_length = torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32)
        topk_length[0] = 0 if b > 1 else topk_length[0]
    if o.nan_unused:
        _poison_unused_rows(cache, fmt, idx, topk_length, num_tokens)
    attn_sink = None
    if o.with_sink:
        attn_sink = torch.randn(h_q, generator=g)
        m = torch.rand(h_q, generator=g)
        attn_sink[m < 0.31] = float("inf")
        attn_sink[(m >= 0.31) & (m < 0.62)] = float("-inf")
    extra = (None, None, None)
    if o.extra_topk:
        extra = _random_extra_pool(fmt, b, s_q, empty_rows, o)

    dev = torch.device(o.device)
    mv = lambda t: None if t is None else t.to(dev)  # noqa: E731
    return SparseDecodeInputs(q=mv(q), k_cache=_to_device(cache, dev), indices=mv(idx), topk_length=mv(topk_length),
                              attn_sink=mv(attn_sink), softmax_scale=fmt.d_qk ** -0.55,
                              extra_k_cache=_to_device(extra[0], dev), extra_indices=mv(extra[1]),
                              extra_topk_length=mv(extra[2]))


def _random_cache(fmt: KVCacheFormat, num_tokens: int, page: int, o: InputOptions):
    """A quantized cache of KV ~ N(0,1)/10 clamped, page blocks padded (``block_stride_pad``), on
    the host: (cache view, tokens in it)."""
    num_blocks = -(-num_tokens // page)
    num_tokens = num_blocks * page
    kv = (torch.randn(num_tokens, fmt.d_qk, generator=o.generator) / 10).clamp(-1, 1)
    pad = o.block_stride_pad if o.block_stride_pad is not None else (1 if fmt is V32 else 0)
    stride0 = fmt.block_stride(page) + pad * fmt.data_row_bytes
    kv = kv.reshape(num_blocks, page, fmt.d_qk)
    if fmt is V32:   # one padding row per block by default (the layout of earlier versions, byte for byte)
        return fmt.quantize_cache(kv, power_of_two_scales=o.power_of_two_scales, stride0=stride0), num_tokens
    if not o.power_of_two_scales:
        raise ValueError(f"make_inputs: the {fmt.name} format stores power-of-two (ue8m0) scales only")
    return fmt.quantize_cache(kv, stride0=stride0), num_tokens


def _random_extra_pool(fmt: KVCacheFormat, b: int, s_q: int, empty_rows, o: InputOptions):
    """V4's extra pool: (cache, (b, s_q, extra_topk) indices, (b,) lengths or None); the (b * s_q)
    rows ``empty_rows`` (the main list's ``all_invalid_rows``) are all -1 here too: rows with no
    valid token."""
    g = o.generator
    page = o.extra_page_block_size or o.page_block_size
    cache, num_tokens = _random_cache(fmt, o.extra_num_tokens or o.num_tokens, page, o)
    idx, _ = _random_indices(b, s_q, o.extra_topk, num_tokens, replace(o, all_invalid_rows=0))
    flat = idx.view(b * s_q, o.extra_topk)
    for row in empty_rows:
        flat[row] = -1
    length = None
    if o.extra_topk_lengths is not None:
        length = _given_lengths("extra_topk_lengths", o.extra_topk_lengths, b)
    elif o.with_extra_topk_length:
        length = torch.randint(0, o.extra_topk + 1, (b,), generator=g, dtype=torch.int32)
    if o.nan_unused:
        _poison_unused_rows(cache, fmt, idx, length, num_tokens)
    return cache, idx, length


def _given_lengths(name: str, lengths: Sequence[int], b: int) -> torch.Tensor:
    if len(lengths) != b:
        raise ValueError(f"make_inputs: {name} needs one length per request ({b}), got {len(lengths)}")
    return torch.tensor([int(n) for n in lengths], dtype=torch.int32)


def _to_device(cache: Optional[torch.Tensor], dev: torch.device) -> Optional[torch.Tensor]:
    """A host cache view on ``dev`` with the same strides: its whole buffer copied (every page
    block with its padding, so that ``num_blocks * stride(0)`` bytes are valid memory)."""
    if cache is None or dev.type == "cpu":
        return cache
    flat = torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage()).to(dev)
    return torch.as_strided(flat, cache.shape, cache.stride(), cache.storage_offset())


def _random_indices(b: int, s_q: int, topk: int, num_tokens: int, o: InputOptions):
    """(b, s_q, topk) int32 indices and the (b * s_q) rows set all -1 (``all_invalid_rows``)."""
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
    rows = []
    if o.all_invalid_rows:
        flat = idx.view(b * s_q, topk)
        rows = torch.randperm(b * s_q, generator=g)[:o.all_invalid_rows].tolist()
        for row in rows:
            flat[row] = -1
    return idx, rows


def _poison_unused_rows(cache: torch.Tensor, fmt: KVCacheFormat, idx: torch.Tensor, topk_length,
                        num_tokens: int) -> None:
    """NaN bytes (0xFF is NaN in e4m3, ue8m0, fp32 and bf16) in every cache slot no valid index
    reads: a token's whole row (V3.2), or its data row and its scale row (V4, pad byte included)."""
    page = cache.shape[1]
    used = torch.zeros(num_tokens, dtype=torch.bool)
    used[idx.to(torch.int64)[valid_positions(idx, num_tokens, topk_length)]] = True
    unused = (~used).nonzero().flatten()
    blk, row = unused // page, unused % page
    if fmt.scales_in_row:
        cache[blk, row, 0] = torch.full((fmt.row_bytes,), 0xFF, dtype=torch.uint8)
        return
    nb, stride0 = cache.shape[0], cache.stride(0)
    data = torch.as_strided(cache, (nb, page, fmt.data_row_bytes), (stride0, fmt.data_row_bytes, 1))
    scales = torch.as_strided(cache, (nb, page, fmt.scale_row_bytes), (stride0, fmt.scale_row_bytes, 1),
                              cache.storage_offset() + page * fmt.data_row_bytes)
    data[blk, row] = 0xFF
    scales[blk, row] = 0xFF


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
        diff = cos_diff(g, r)
        assert diff <= cos_diff_tol, f"{name}: cosine difference {diff:.3e} > {cos_diff_tol}"


def cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """FlashMLA's cosine difference 1 - 2<a,b>/(|a|^2+|b|^2) (0 for two zero tensors)."""
    denom = (a * a + b * b).sum()
    return (1 - 2 * (a * b).sum() / denom).item() if denom > 0 else 0.0


def check_out_lse(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> None:
    """The sparse decode tolerances of FlashMLA's test suite.

    A NaN in the reference is refused first: well-formed inputs never give one (an all-invalid row
    is out 0, lse +inf), and check_allclose passes NaN positions that match, so a reference that
    reads a NaN-filled slot would check nothing there against an output left NaN."""
    for name, ref in (("out", ref_out), ("lse", ref_lse)):
        nan = torch.isnan(ref)
        assert not nan.any(), (f"reference {name} has {int(nan.sum())} NaN elements, first at "
                               f"{nan.nonzero()[0].tolist()}: the inputs let a valid token read a NaN-filled "
                               "cache slot (lengths set after make_inputs poisoned the unread ones?)")
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


def host_schedule(topk: int, topk_length, b: int, parts: int, device, overhead: int = FIXED_OVERHEAD,
                  extra_topk: int = 0, extra_topk_length=None):
    """FlashMLA's greedy schedule of ``b`` requests over ``parts`` partitions, made on the host (the
    lengths read back when given; a request's blocks are its main list's, then its extra list's):
    (HostSchedule, tile_md tensor, accum_offsets tensor)."""
    lengths = lambda t: None if t is None else t.tolist()  # noqa: E731
    nb = blocks_per_request(topk, lengths(topk_length), b, extra_topk=extra_topk,
                            extra_topk_length=lengths(extra_topk_length))
    s = plan_splits_host(nb, parts, overhead)
    tile_md = torch.tensor(s.rows, dtype=torch.int32, device=device).reshape(parts, -1)
    return s, tile_md, torch.tensor(accum_offsets(s.num_splits), dtype=torch.int32, device=device)


def run_kernel(inp: SparseDecodeInputs, cfg, parts: int, overhead: int = FIXED_OVERHEAD,
               schedule: Optional[HostSchedule] = None):
    """Launch one arch's sparse decode kernel (its config ``cfg``, any variant) directly on ``inp``
    (its extra pool too, when it has one) over the host schedule of ``parts`` partitions (or over
    ``schedule``'s rows as given: partitions no scheduler makes); for the split variant merge the
    partials in torch (fp64). Outputs start as NaN, so anything the kernel leaves unwritten shows.

    Returns (out (b, s_q, h, d_v) fp32, lse (b, h, s_q) fp32, the HostSchedule)."""
    from . import registry
    from .kernels import SparseDecodeTensors

    mod = registry.kernel_module(registry.SPARSE_DECODE.name, cfg.arch)
    q, dev = inp.q, inp.q.device
    b, s_q, h_q, _ = q.shape
    extra_topk = 0 if inp.extra_indices is None else inp.extra_indices.shape[-1]
    if schedule is None:
        sched, tile_md, offsets = host_schedule(inp.indices.shape[-1], inp.topk_length, b, parts, dev, overhead,
                                                extra_topk, inp.extra_topk_length)
    else:
        sched = schedule
        tile_md = torch.tensor(sched.rows, dtype=torch.int32, device=dev).reshape(len(sched.rows), -1)
        offsets = torch.tensor(accum_offsets(sched.num_splits), dtype=torch.int32, device=dev)
    if not cfg.split:
        assert not sched.any_split, "the no-split variant only runs on schedules without split pieces"
    out = torch.full((b, s_q, h_q, V32.d_v), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((b, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
    o_acc = lse_acc = None
    if cfg.split:
        rows = max(sched.split_rows, 1)
        accum = getattr(torch, mod.ACCUM_DTYPE)
        o_acc = torch.full((rows, s_q, h_q, V32.d_v), float("nan"), dtype=accum, device=dev)
        lse_acc = torch.full((rows, s_q, h_q), float("nan"), dtype=torch.float32, device=dev)
    extra = cfg.has_extra and inp.extra_k_cache is not None
    # the bundle holds exactly what the config takes (None for the rest, as the API's would)
    t = SparseDecodeTensors(
        q, inp.k_cache.squeeze(2), inp.indices, inp.topk_length if cfg.has_topk_length else None,
        inp.attn_sink if cfg.has_attn_sink else None, inp.extra_k_cache.squeeze(2) if extra else None,
        inp.extra_indices if extra else None, inp.extra_topk_length if cfg.has_extra_topk_length else None,
        out=out, lse=lse, tile_md=tile_md, accum_offsets=offsets, o_accum=o_acc, lse_accum=lse_acc,
        softmax_scale=inp.softmax_scale)
    mod.launch(mod.compile(cfg), cfg, t)
    torch.cuda.synchronize()
    out = out.float()
    if cfg.split:
        out, lse = merge_splits(out, lse, o_acc, lse_acc, sched, inp.attn_sink)
    return out, lse.transpose(1, 2), sched


def check_diagnosed(out, lse, ref_out, ref_lse, sched) -> None:
    """:func:`check_out_lse`, with :func:`diagnose`'s report printed before a failure is raised."""
    try:
        check_out_lse(out, lse, ref_out, ref_lse)
    except AssertionError:
        diagnose(out, lse, ref_out, ref_lse, sched)
        raise


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


def held_workspace_bytes(sched) -> int:
    """The split workspace a filled ``FlashMLASchedMeta`` keeps for its step's calls, in bytes."""
    return sum(t.nbytes for t in (sched.workspace or ()) if t is not None)


def step_transient_bytes(new_sched, call):
    """:func:`transient_bytes` of a decode step's first call, ``call(new_sched())``: a fresh
    metadata object, after an earlier call compiled the kernels and made the plan. A split cute-mla
    plan allocates its workspace there and keeps it in the object, so the step's later calls (its
    other layers) allocate nothing; FlashMLA allocates its accumulators on every call. Either way
    this is the memory a step needs beyond its outputs. Returns ``(result, bytes)``."""
    sched = new_sched()
    return transient_bytes(lambda: call(sched))


def step_first_and_later_bytes(x: "SparseDecodeInputs"):
    """(bytes a decode step's first public call on ``x`` allocates beyond out and lse, bytes its
    next call (the step's next layer) allocates, the step's ``FlashMLASchedMeta``), after a
    warm-up call that compiled the kernels and made the plan."""
    from .interface.api import flash_mla_with_kvcache, get_mla_metadata

    def call(sched):
        return flash_mla_with_kvcache(x.q, x.k_cache, None, None, format_for_d_qk(x.q.shape[-1]).d_v, sched,
                                      **x.call_kwargs())

    call(get_mla_metadata()[0])      # compile, plan (its outputs freed before the measurement)
    sched = get_mla_metadata()[0]
    _, first = transient_bytes(lambda: call(sched))
    _, later = transient_bytes(lambda: call(sched))
    return first, later, sched


def transient_bytes(fn):
    """Run ``fn()`` (returning the call's output tensors) and measure its transient device memory:
    the peak bytes *requested* from torch's caching allocator during the call, beyond those held
    before, minus the returned tensors. Returns ``(result, bytes)``.

    Requested bytes, not ``memory_allocated``'s blocks: a request served from a cached free block
    takes the whole block when the remainder is too small to split (up to 1 MiB in the large pool),
    which ``max_memory_allocated`` counts (a plan's exact bytes read half a MiB more that way).
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


# --------------------------------------------------------------------------------- sparse prefill
#
# FlashMLA's test inputs, case lists and tolerances for ``flash_mla_sparse_fwd`` (its
# tests/test_flash_mla_sparse_prefill.py, tests/lib.py and tests/kernelkit/{generate,compare}.py),
# written afresh: the same distributions and rules, not the same random streams.

# FlashMLA's invalid index candidates (lib.py); ``None`` stands for s_kv itself.
PREFILL_INVALID_CANDIDATES = (-2**31, -123456, -1, None, 114514, 1919810, 2147480000, 2**31 - 1)
PREFILL_SM_SCALE = 0.5          # FlashMLA's test scale
PREFILL_HEADS = (8, 16, 32, 64, 128)
PREFILL_D_QK = (576, 512)


def prefill_invalid_candidates(s_kv: int) -> Tuple[int, ...]:
    """FlashMLA's invalid index candidates for a KV of ``s_kv`` rows, keeping those that are invalid
    there (all of them for every s_kv of FlashMLA's cases, which stay below 114514 wherever they
    are drawn)."""
    vals = [s_kv if c is None else c for c in PREFILL_INVALID_CANDIDATES]
    return tuple(c for c in vals if c < 0 or c >= s_kv)


@dataclass
class SparsePrefillInputs:
    q: torch.Tensor                       # (s_q, h_q, d_qk) bf16
    kv: torch.Tensor                      # (s_kv, 1, d_qk) bf16
    indices: torch.Tensor                 # (s_q, 1, topk) int32
    sm_scale: float
    attn_sink: Optional[torch.Tensor]     # (h_q,) fp32
    topk_length: Optional[torch.Tensor]   # (s_q,) int32
    d_v: int = 512

    def call_kwargs(self) -> dict:
        """The keyword arguments of ``flash_mla_sparse_fwd`` (FlashMLA's names)."""
        return dict(q=self.q, kv=self.kv, indices=self.indices, sm_scale=self.sm_scale, d_v=self.d_v,
                    attn_sink=self.attn_sink, topk_length=self.topk_length)

    def reference(self, rows=None, **kw):
        """:func:`cute_mla.reference.sparse_prefill_reference` of these inputs: fp32 (out,
        max_logits, lse); of the query rows ``rows`` only (a slice or an index tensor) when given."""
        q, idx, tl = self.q, self.indices, self.topk_length
        if rows is not None:
            q, idx, tl = q[rows], idx[rows], None if tl is None else tl[rows]
        return sparse_prefill_reference(q, self.kv, idx, self.sm_scale, self.d_v, self.attn_sink, tl, **kw)


def non_contiguous(t: torch.Tensor, fill=None) -> torch.Tensor:
    """``t`` copied into a larger buffer (every dim + 1, the last + 128) and sliced back: kernelkit's
    ``non_contiguousify``, so every stride but the last is non-trivial. The padding is left as
    allocated, or ``fill`` when given."""
    base = torch.empty(_padded_shape(t.shape), dtype=t.dtype, device=t.device)
    if fill is not None:
        base.fill_(fill)
    view = base[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    return view


def _padded_shape(shape) -> List[int]:
    return [n + 128 if i == len(shape) - 1 else n + 1 for i, n in enumerate(shape)]


def _flashmla_randn(shape, g: torch.Generator, rng: random.Random, dev, non_contig: bool) -> torch.Tensor:
    """FlashMLA's q / kv: bf16 randn / 10 plus one scalar offset in [-0.05, 0.05), clamped to +-10,
    in bf16 arithmetic; drawn over the padded buffer when ``non_contig`` (kernelkit's
    ``gen_non_contiguous_randn_tensor``: no full-size temporary), then sliced."""
    full = _padded_shape(shape) if non_contig else list(shape)
    base = torch.empty(full, dtype=torch.bfloat16, device=dev)
    base.normal_(generator=g)
    t = base[tuple(slice(0, n) for n in shape)]
    t.div_(10).add_((rng.random() - 0.5) / 10).clamp_(-10, 10)
    return t


def make_prefill_inputs(s_q: int, s_kv: int, topk: int, h_q: int, d_qk: int = 576, *, attn_sink: bool = False,
                        topk_length: bool = False, all_invalid_rows: bool = False, non_contig: bool = True,
                        sm_scale: float = PREFILL_SM_SCALE, seed: int = 0, device="cpu") -> SparsePrefillInputs:
    """Random inputs of ``flash_mla_sparse_fwd`` as FlashMLA's ``tests/lib.py`` makes them, on
    ``device`` from generators seeded with ``seed``.

    q (s_q, h_q, d_qk) and kv (s_kv, 1, d_qk): bf16 randn / 10 plus a random scalar offset in
    +-0.05, clamped to +-10. indices (s_q, 1, topk) int32: each row a random permutation of
    [0, s_kv) cut to topk, padded at the end with random invalid candidates
    (:data:`PREFILL_INVALID_CANDIDATES`) when s_kv < topk; ``all_invalid_rows``: rows with
    randn < -2 (~2.3 %) set to one invalid candidate. ``attn_sink``: (h_q,) randn, ~31 % -inf and
    ~31 % +inf. ``topk_length``: (s_q,) randint(0, max(topk + 1, 64)) clamped to topk (so ~1/(topk+1)
    of the rows are 0). ``non_contig``: q, kv and indices are views into buffers with every dim + 1
    and the last + 128 (kernelkit's ``non_contiguousify``); the indices' padding holds 2^31 - 1.
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    rng = random.Random(seed)
    q = _flashmla_randn((s_q, h_q, d_qk), g, rng, dev, non_contig)
    kv = _flashmla_randn((s_kv, 1, d_qk), g, rng, dev, non_contig)

    cands = prefill_invalid_candidates(s_kv)
    width = max(s_kv, topk)
    keys = torch.rand(s_q, width, generator=g, device=dev)
    keys[:, s_kv:] = -math.inf                       # positions >= s_kv are taken last
    idx = keys.topk(topk, dim=-1, sorted=True).indices.to(torch.int32)
    del keys
    if s_kv < topk:
        cand = torch.tensor(cands, dtype=torch.int32, device=dev)
        fill = cand[torch.randint(0, len(cands), idx.shape, generator=g, device=dev)]
        idx = torch.where(idx >= s_kv, fill, idx)
    if all_invalid_rows:
        rows = torch.randn(s_q, generator=g, device=dev) < -2
        idx[rows] = rng.choice(cands)
    idx = idx.view(s_q, 1, topk)
    if non_contig:
        idx = non_contiguous(idx, fill=2**31 - 1)

    sink = None
    if attn_sink:
        sink = torch.randn(h_q, generator=g, device=dev)
        m = torch.randn(h_q, generator=g, device=dev)
        sink[m < -0.5] = -math.inf
        sink[m > 0.5] = math.inf
    length = None
    if topk_length:
        length = torch.randint(0, max(topk + 1, 64), (s_q,), generator=g, device=dev, dtype=torch.int32)
        length.clamp_(max=topk)
    return SparsePrefillInputs(q=q, kv=kv, indices=idx, sm_scale=sm_scale, attn_sink=sink, topk_length=length)


@dataclass(frozen=True)
class PrefillCase:
    """One of FlashMLA's sparse prefill test cases (its ``TestParam``, the fields the prefill test
    uses)."""

    s_q: int
    s_kv: int
    topk: int
    h_q: int = 128
    d_qk: int = 512
    have_attn_sink: bool = False
    have_topk_length: bool = False
    is_all_indices_invalid: bool = False
    check_correctness: bool = True
    group: str = ""      # the list it comes from ("correctness", "features", "corner"): part of the name and seed

    @property
    def name(self) -> str:
        """A short id: ``[group-]d576-h64-sq62-skv592-k128[-sink][-tl][-allinv][-nocheck]`` (FlashMLA's
        correctness and feature lists share shapes: the group keeps their names and seeds apart)."""
        s = f"{self.group}-" if self.group else ""
        s += f"d{self.d_qk}-h{self.h_q}-sq{self.s_q}-skv{self.s_kv}-k{self.topk}"
        for flag, tag in ((self.have_attn_sink, "sink"), (self.have_topk_length, "tl"),
                          (self.is_all_indices_invalid, "allinv"), (not self.check_correctness, "nocheck")):
            s += f"-{tag}" if flag else ""
        return s

    @property
    def seed(self) -> int:
        """A fixed seed per case (from its name)."""
        return zlib.crc32(self.name.encode())

    def make_inputs(self, device="cuda", seed: Optional[int] = None, **kw) -> SparsePrefillInputs:
        """:func:`make_prefill_inputs` of this case (its own seed unless ``seed`` is given)."""
        return make_prefill_inputs(self.s_q, self.s_kv, self.topk, self.h_q, self.d_qk, attn_sink=self.have_attn_sink,
                                   topk_length=self.have_topk_length, all_invalid_rows=self.is_all_indices_invalid,
                                   seed=self.seed if seed is None else seed, device=device, **kw)


# (s_kv, topk) of FlashMLA's correctness cases: regular, irregular, and s_kv < topk ("OOB topk")
PREFILL_REGULAR_SHAPES = ((128, 128), (256, 256), (512, 512))
PREFILL_IRREGULAR_SHAPES = ((592, 128), (1840, 256), (1592, 384), (1521, 512))
PREFILL_OOB_SHAPES = ((95, 128), (153, 256), (114, 384))


def prefill_correctness_cases(h_q: int, d_qks: Sequence[int] = PREFILL_D_QK) -> List[PrefillCase]:
    """FlashMLA's ``correctness_cases`` at ``h_q``: 10 (s_kv, topk) x s_q in {1, 62, 213}, no sink,
    no topk_length (30 per d_qk)."""
    shapes = PREFILL_REGULAR_SHAPES + PREFILL_IRREGULAR_SHAPES + PREFILL_OOB_SHAPES
    return [PrefillCase(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, group="correctness")
            for d_qk in d_qks for s_kv, topk in shapes for s_q in (1, 62, 213)]


def prefill_feature_cases(h_q: int, d_qks: Sequence[int] = PREFILL_D_QK) -> List[PrefillCase]:
    """FlashMLA's ``correctness_cases_with_features`` at ``h_q``: 7 irregular / OOB shapes x s_q in
    {62, 213} x attn_sink x topk_length (56 per d_qk). FlashMLA's list also loops over a
    ``have_sink_lse`` it never passes on, so each of its cases runs twice; here once."""
    shapes = PREFILL_IRREGULAR_SHAPES + PREFILL_OOB_SHAPES
    return [PrefillCase(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, have_attn_sink=sink, have_topk_length=tl,
                        group="features")
            for d_qk in d_qks for s_kv, topk in shapes for s_q in (62, 213)
            for sink in (False, True) for tl in (False, True)]


def prefill_corner_cases(h_q: int, d_qks: Sequence[int] = PREFILL_D_QK) -> List[PrefillCase]:
    """FlashMLA's ``corner_cases`` at ``h_q`` (9 per d_qk), all with attn_sink and topk_length:
    all-invalid rows for (s_q, s_kv, topk) in (1, 128, 128), (1, 256, 256), (1234, 4321, 4096),
    (4096, 2048, 2048); 64-blocks without a valid index, (s_kv, topk) in (32, 2048), (64, 8192) x
    s_q in {1, 1024}; s_q = 70000, s_kv = topk = 256 (past grid.y's limit; FlashMLA only checks
    that it runs: ``check_correctness=False``)."""
    feat = dict(have_attn_sink=True, have_topk_length=True, group="corner")
    cases = []
    for d_qk in d_qks:
        cases += [PrefillCase(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, is_all_indices_invalid=True, **feat)
                  for s_q, s_kv, topk in ((1, 128, 128), (1, 256, 256), (1234, 4321, 4096), (4096, 2048, 2048))]
        cases += [PrefillCase(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, **feat)
                  for s_kv, topk in ((32, 2048), (64, 8192)) for s_q in (1, 1024)]
        cases.append(PrefillCase(70000, 256, 256, h_q=h_q, d_qk=d_qk, check_correctness=False, **feat))
    return cases


# FlashMLA's prefill tolerances (test_flash_mla_sparse_prefill.py): (abs, rel, cosine difference)
PREFILL_OUT_TOL = (8e-4, 3.01 / 128, 7e-6)
PREFILL_LSE_TOL = (1e-6, 2.01 / 65536, None)


def check_close_chunked(name: str, got: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float,
                        cos_diff_tol: Optional[float] = None, chunk: int = 1 << 24) -> None:
    """kernelkit's ``check_is_allclose`` on ``got``'s device, ``chunk`` elements at a time (float64
    math on the fp32 values): +inf, -inf and NaN at the same positions; elsewhere each element
    passes when abs_err < abs_tol or rel_err = abs_err / (|ref| + 1e-6) < rel_tol; with
    ``cos_diff_tol``, |1 - 2<a,b>/(|a|^2+|b|^2)| <= cos_diff_tol over all elements (the special
    values counted as 0), skipped when |ref|^2 < 1e-12. Raises AssertionError naming the first
    failing position."""
    if tuple(got.shape) != tuple(ref.shape):
        raise AssertionError(f"{name}: shape {tuple(got.shape)} vs reference {tuple(ref.shape)}")
    shape = tuple(got.shape)
    g_all = got.detach().reshape(-1)
    r_all = ref.detach().to(got.device).reshape(-1)
    n = g_all.numel()
    problems = []
    first_bad = None
    nbad = 0
    max_abs = max_rel = 0.0
    ab = sq = rr = 0.0
    for s in range(0, n, chunk):
        a = g_all[s:s + chunk].float().double()
        b = r_all[s:s + chunk].float().double()
        for what, fn in (("+inf", torch.isposinf), ("-inf", torch.isneginf), ("nan", torch.isnan)):
            mism = fn(a) != fn(b)
            if mism.any():
                i = s + int(mism.nonzero()[0])
                problems.append(f"{what} positions differ at {int(mism.sum())} elements in [{s}, {s + a.numel()}), "
                                f"first {_unravel(i, shape)}: got {g_all[i].item()} vs ref {r_all[i].item()}")
        a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
        b = torch.where(torch.isfinite(b), b, torch.zeros_like(b))
        abs_err = (a - b).abs()
        rel_err = abs_err / (b.abs() + 1e-6)
        bad = (abs_err >= abs_tol) & (rel_err >= rel_tol)
        k = int(bad.sum())
        if k:
            if first_bad is None:
                first_bad = s + int(bad.nonzero()[0])
            nbad += k
            max_abs = max(max_abs, abs_err[bad].max().item())
            max_rel = max(max_rel, rel_err[bad].max().item())
        if cos_diff_tol is not None:
            ab += (a * b).sum().item()
            sq += (a * a + b * b).sum().item()
            rr += (b * b).sum().item()
    if nbad:
        i = first_bad
        problems.append(f"{nbad} of {n} elements out of tolerance (abs {abs_tol:.3g}, rel {rel_tol:.4g}); first at "
                        f"{_unravel(i, shape)}: got {g_all[i].item()!r} vs ref {r_all[i].item()!r}; worst failing abs err "
                        f"{max_abs:.3e}, rel err {max_rel:.3e}")
    if cos_diff_tol is not None and rr >= 1e-12:
        diff = 1 - 2 * ab / sq
        if abs(diff) > cos_diff_tol:
            problems.append(f"cosine difference {diff:.3e} > {cos_diff_tol:.3g}")
    if problems:
        raise AssertionError(f"{name}: " + "; ".join(problems))


def _unravel(i: int, shape) -> Tuple[int, ...]:
    pos = []
    for n in reversed(shape):
        pos.append(i % n)
        i //= n
    return tuple(reversed(pos))


def check_prefill(out: torch.Tensor, max_logits: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor,
                  ref_max_logits: torch.Tensor, ref_lse: torch.Tensor) -> None:
    """FlashMLA's sparse prefill tolerances: out (as fp32) abs 8e-4, rel 3.01/128, cosine
    difference 7e-6; max_logits and lse abs 1e-6, rel 2.01/65536; +-inf and NaN positions exact
    (an empty row: max_logits -inf and lse +inf in both). All three are checked and every failure
    is reported in one AssertionError.

    A NaN in the reference is refused first: well-formed inputs never give one, and NaN positions
    that match would pass."""
    problems = []
    for name, ref in (("out", ref_out), ("max_logits", ref_max_logits), ("lse", ref_lse)):
        nan = torch.isnan(ref)
        if nan.any():
            problems.append(f"reference {name} has {int(nan.sum())} NaN elements, first at "
                            f"{tuple(nan.nonzero()[0].tolist())}: a valid slot reads a NaN KV row?")
    if not problems:
        checks = (("out", out, ref_out, PREFILL_OUT_TOL), ("max_logits", max_logits, ref_max_logits, PREFILL_LSE_TOL),
                  ("lse", lse, ref_lse, PREFILL_LSE_TOL))
        for name, got, ref, (abs_tol, rel_tol, cos_tol) in checks:
            try:
                check_close_chunked(name, got, ref, abs_tol, rel_tol, cos_tol)
            except AssertionError as e:
                problems.append(str(e))
    if problems:
        raise AssertionError("sparse prefill mismatch:\n  " + "\n  ".join(problems))
