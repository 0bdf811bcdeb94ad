"""Accuracy of FP8 tensor-core variants of the V3.2 sparse decode, emulated on the CPU (issue 23).

Every variant reads the same quantized V3.2 cache (512 e4m3 NoPE values with four fp32 scales per
token, one per 128 dims, and 64 bf16 RoPE values) and is compared with the float64 oracle of that
cache (``sparse_decode_reference`` in float64 with the keys as dequantized, not rounded to bf16):

- ``bf16``: the production kernel's numerics. q bf16, K dequantized to bf16 (``bf16(fp8 * scale)``),
  S in fp32, P = exp(S - max) in fp32 summed in fp32 for l, rounded to bf16 for P V, V bf16, O in
  fp32, out rounded to bf16.
- ``qk-fp8-pow2`` / ``qk-fp8-fp32``: q quantized to e4m3 per (token, head, 128-dim group) with a
  power-of-two or an exact amax/448 scale; each group's product (q8 . k8, exact products summed in
  fp32) is scaled by q_scale * k_scale, the four groups and the bf16 RoPE product summed in fp32.
  PV as in ``bf16``.
- ``qk-fp8-fp32-acc14``: the same, with the FP8 accumulator of Hopper's tensor core modelled as
  keeping 14 significant bits (DeepSeek-V3 report, section 3.3.2): the running sum is truncated to
  14 bits after each K = 32 instruction and promoted to fp32 at each 128-dim group, which the
  per-group scales force anyway. A model of the hardware, not its exact rule.
- ``pv-fp8``: QK as in ``bf16``; for each 128-column group g of O the kernel would run P_g V8_g with
  P_g[i, j] = p[i, j] * k_scale[j, g] quantized to e4m3 with one scale per (row, 64-token tile)
  (amax / 448, fp32) and V8 the cache's e4m3 bytes; products summed in fp32, then times the row
  scale.
- ``both``: ``qk-fp8-fp32`` and ``pv-fp8`` together.

The numerics are emulated in torch: the tensor cores' fp32 accumulation order differs, and the
softmax uses one max per row where the kernel keeps a running max per 64-token tile (both in fp32;
the difference is a few fp32 ulps, far below the bf16 / e4m3 roundings measured here).

Input distributions: FlashMLA's test inputs (``cute_mla.testing.make_inputs``: q ~ N(0,1) clamped
to +-1, KV ~ N(0,1)/10 clamped, 20 % of the indices -1) with power-of-two and with exact amax/448
cache scales, and heavy-tailed inputs (the same indices; q and KV unclamped, a few channels of each
and 1 % of the tokens scaled, the largest values ~100x the median or more; ``-shared``: one outlier
channel common to q and KV, which makes large, peaked logits). FlashMLA's absolute tolerance
(1e-3 on out) is sized for FlashMLA's inputs (|out| < ~0.01): on the heavy-tailed ones the bf16
path itself misses it on a few elements, so there the yardstick is the ratio to the bf16 path.

    python -m benchmarks.fp8_accuracy --out benchmarks/results/cpu-fp8-accuracy.json

About 40 s on a 2-core CPU at the default shapes (2x16x64 and 1x16x128, top-k 2048).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from cute_mla.formats import V32
from cute_mla.formats.layout import FP8_E4M3_MAX, cache_bytes, pow2_scale
from cute_mla.reference import sparse_decode_reference, valid_positions
from cute_mla.testing import SparseDecodeInputs, check_out_lse, cos_diff, make_inputs

GROUP = V32.group_size            # 128 NoPE dims share one cache scale
GROUPS = V32.d_nope // GROUP      # 4
TILE_TOKENS = 64                  # the kernel's K tile: the row scale of an FP8 P is per tile
MMA_K_FP8 = 32                    # K of one e4m3 wgmma
ACC_BITS = 14                     # significant bits of the modelled FP8 accumulator
E4M3 = torch.float8_e4m3fn

NOTE = ("numerics emulated in torch on the CPU, not measured on tensor cores: fp32 sums run in another "
        "order than the wgmma's and the softmax takes one max per row (the kernel: a running max per 64-token "
        "tile); the acc14 variant models Hopper's FP8 accumulator (14 significant bits, truncated after each "
        "K=32 instruction), which is an assumption, not a measurement")


# ---------------------------------------------------------------------------------------- the cache
@dataclass
class Gathered:
    """The top-k rows of every (b, s_q) row, split the way the variants read them."""

    k8: torch.Tensor       # (rows, topk, 512) fp32: the e4m3 values as stored (exact in fp32)
    k_scale: torch.Tensor  # (rows, topk, 4) fp32: the cache's group scales
    rope: torch.Tensor     # (rows, topk, 64) fp32: the bf16 RoPE values
    valid: torch.Tensor    # (rows, topk) bool


def gather_rows(inp: SparseDecodeInputs) -> Gathered:
    """Decode the cache bytes into e4m3 values, scales and RoPE and gather each row's top-k tokens;
    invalid positions read token 0 and are zeroed (the cache holds NaN bytes in unused slots)."""
    raw = cache_bytes(inp.k_cache, V32.row_bytes)
    nb, page, _ = raw.shape
    raw = raw.reshape(nb * page, V32.row_bytes).contiguous()
    b, s_q, topk = inp.indices.shape
    valid = valid_positions(inp.indices, nb * page, inp.topk_length).reshape(b * s_q, topk)
    safe = torch.where(valid, inp.indices.reshape(b * s_q, topk).to(torch.int64), torch.zeros((), dtype=torch.int64))
    rows = raw[safe]                                                        # (rows, topk, 656) uint8
    k8 = rows[..., :V32.d_nope].contiguous().view(E4M3).float()
    k_scale = rows[..., V32.scale_offset:V32.rope_offset].contiguous().view(torch.float32)
    rope = rows[..., V32.rope_offset:].contiguous().view(torch.bfloat16).float()
    zero = ~valid[..., None]
    return Gathered(k8.masked_fill(zero, 0.0), k_scale.masked_fill(zero, 0.0), rope.masked_fill(zero, 0.0), valid)


def keys_bf16(g: Gathered) -> torch.Tensor:
    """(rows, topk, 576) keys as the bf16 kernel's producer writes them: bf16(fp8 * scale), RoPE as is."""
    nope = (g.k8.view(*g.k8.shape[:2], GROUPS, GROUP) * g.k_scale[..., None]).reshape(g.k8.shape)
    return torch.cat([nope, g.rope], dim=-1).to(torch.bfloat16).float()


# ------------------------------------------------------------------------------------------- pieces
def quantize_e4m3(x: torch.Tensor, amax: torch.Tensor, pow2: bool):
    """x / scale rounded to e4m3 (round to nearest even, saturated) and the scale; ``amax`` broadcasts
    against x. A zero amax gets scale 1 (its values are all 0)."""
    if pow2:
        scale = pow2_scale(amax)
    else:
        # amax clamped to a normal fp32 range: P values far below the row's max are fp32 subnormals,
        # whose amax / 448 would underflow to a zero scale.
        scale = torch.where(amax > 0, amax.clamp(min=1e-30) / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(E4M3).float()
    return q, scale


def truncate_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x with its significand truncated (toward zero) to ``bits`` bits."""
    m, e = torch.frexp(x)                                   # x = m * 2^e, 0.5 <= |m| < 1
    step = 2.0 ** bits
    return torch.ldexp(torch.trunc(m * step) / step, e)


def scores_bf16(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """S = q K^T in fp32 (rows, h, topk): bf16 operands, fp32 sums."""
    return torch.einsum("rhd,rkd->rhk", q.float(), keys)


def scores_qk_fp8(q: torch.Tensor, g: Gathered, pow2: bool, acc_bits: Optional[int] = None,
                  q_group: int = GROUP) -> torch.Tensor:
    """S with the NoPE part on e4m3 wgmma: q quantized per (token, head, ``q_group`` dims); each
    group's fp32 partial times q_scale * k_scale[j, its 128-dim cache group]; RoPE in bf16; all
    summed in fp32. ``q_group`` 32 is one promotion per K = 32 instruction (the finest SM90 allows)."""
    rows, h, _ = q.shape
    n_grp = V32.d_nope // q_group
    qn = q[..., :V32.d_nope].float().reshape(rows, h, n_grp, q_group)
    q8, q_scale = quantize_e4m3(qn, qn.abs().amax(dim=-1, keepdim=True), pow2)  # q_scale (rows, h, n_grp, 1)
    k8 = g.k8.reshape(rows, -1, n_grp, q_group)
    s = torch.einsum("rhd,rkd->rhk", q[..., V32.d_nope:].float(), g.rope)
    for grp in range(n_grp):
        if acc_bits is None:
            part = torch.einsum("rhd,rkd->rhk", q8[:, :, grp], k8[:, :, grp])
        else:
            # One K = 32 instruction at a time; each instruction's own sum is exact here (products of
            # e4m3 values fit in fp32 and 32 of them are summed before the truncation).
            part = torch.zeros(rows, h, k8.shape[1])
            for c in range(0, q_group, MMA_K_FP8):
                step = torch.einsum("rhd,rkd->rhk", q8[:, :, grp, c:c + MMA_K_FP8].double(),
                                    k8[:, :, grp, c:c + MMA_K_FP8].double())
                part = truncate_bits(part.double() + step, acc_bits).float()
        s = s + part * (q_scale[:, :, grp] * g.k_scale[:, None, :, grp * q_group // GROUP])
    return s


def softmax_parts(s: torch.Tensor, valid: torch.Tensor, softmax_scale: float):
    """The kernel's softmax in fp32 (natural-log form here): p = exp(s * scale - m) of the valid
    tokens, l = sum p, lse = log l + m; rows with no valid token: p = 0, lse = +inf."""
    t = (s * softmax_scale).masked_fill(~valid[:, None, :], float("-inf"))
    m = t.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(m)
    p = torch.exp(t - torch.where(empty, torch.zeros_like(m), m))
    l = p.sum(dim=-1, keepdim=True)
    lse = torch.where(empty, torch.full_like(m, math.inf), torch.log(l) + m)
    return p, l, lse.squeeze(-1)


def pv_bf16(p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """O = bf16(P) V with V the bf16 keys' first 512 dims, fp32 sums."""
    return torch.einsum("rhk,rkd->rhd", p.to(torch.bfloat16).float(), keys[..., :V32.d_v])


def pv_fp8(p: torch.Tensor, g: Gathered) -> torch.Tensor:
    """O with P V on e4m3 wgmma: per 128-column group g, P_g = p * k_scale[:, g] quantized to e4m3
    with an fp32 scale per (row, 64-token tile); V8 the cache's e4m3 bytes; fp32 sums."""
    rows, h, topk = p.shape
    tiles = topk // TILE_TOKENS
    v8 = g.k8.reshape(rows, topk, GROUPS, GROUP)
    out = torch.empty(rows, h, V32.d_v)
    for grp in range(GROUPS):
        pg = (p * g.k_scale[:, None, :, grp]).reshape(rows, h, tiles, TILE_TOKENS)
        p8, row_scale = quantize_e4m3(pg, pg.amax(dim=-1, keepdim=True), pow2=False)   # (rows, h, tiles, 1)
        vt = v8[:, :, grp].reshape(rows, tiles, TILE_TOKENS, GROUP)
        part = torch.einsum("rhtk,rtkd->rhtd", p8, vt)                                   # per tile, fp32
        out[..., grp * GROUP:(grp + 1) * GROUP] = (part * row_scale).sum(dim=2)
    return out


# ----------------------------------------------------------------------------------------- variants
def run_variant(name: str, inp: SparseDecodeInputs, g: Gathered, keys: torch.Tensor):
    """(out (b, s_q, h, 512) fp32 of bf16 values, lse (b, h, s_q) fp32) of one variant."""
    b, s_q, h, _ = inp.q.shape
    q = inp.q.reshape(b * s_q, h, V32.d_qk)
    qk, pv = VARIANTS[name]
    p, l, lse = softmax_parts(qk(q, g, keys), g.valid, inp.softmax_scale)
    o = pv(p, g, keys)
    empty = torch.isinf(lse)[..., None]
    out = torch.where(empty, torch.zeros_like(o), o / torch.where(empty, torch.ones_like(l), l))
    out = out.to(torch.bfloat16).float()                    # the kernel's out is bf16
    return out.reshape(b, s_q, h, V32.d_v), lse.reshape(b, s_q, h).transpose(1, 2)


VARIANTS: Dict[str, tuple] = {
    "bf16": (lambda q, g, k: scores_bf16(q, k), lambda p, g, k: pv_bf16(p, k)),
    "qk-fp8-pow2": (lambda q, g, k: scores_qk_fp8(q, g, pow2=True), lambda p, g, k: pv_bf16(p, k)),
    "qk-fp8-fp32": (lambda q, g, k: scores_qk_fp8(q, g, pow2=False), lambda p, g, k: pv_bf16(p, k)),
    "qk-fp8-fp32-acc14": (lambda q, g, k: scores_qk_fp8(q, g, pow2=False, acc_bits=ACC_BITS),
                          lambda p, g, k: pv_bf16(p, k)),
    "qk-fp8-fp32-g32": (lambda q, g, k: scores_qk_fp8(q, g, pow2=False, q_group=MMA_K_FP8),
                        lambda p, g, k: pv_bf16(p, k)),
    "pv-fp8": (lambda q, g, k: scores_bf16(q, k), lambda p, g, k: pv_fp8(p, g)),
    "both": (lambda q, g, k: scores_qk_fp8(q, g, pow2=False), lambda p, g, k: pv_fp8(p, g)),
}


# ------------------------------------------------------------------------------------------- inputs
def heavy_tailed(inp: SparseDecodeInputs, seed: int, shared: bool) -> SparseDecodeInputs:
    """``inp``'s indices with heavy-tailed q and KV: N(0,1) q and N(0,1)/10 KV, unclamped; 8 of q's
    512 NoPE channels scaled by 5-30x and 4 of KV's by 3-15x, 1 % of the tokens by 2-5x (all
    log-uniform: the largest values reach 100-200x the tensor's median magnitude, reported as
    ``q_max_over_median`` / ``k_max_over_median``). ``shared``: one outlier
    channel is the same in q and KV (an outlier channel both agree on makes the large, peaked
    logits of attention sinks); else they are disjoint. The cache is requantized in the same page
    layout."""
    gen = torch.Generator().manual_seed(seed)
    b, s_q, h, d = inp.q.shape
    nb, page = inp.k_cache.shape[0], inp.k_cache.shape[1]
    n = nb * page

    def factors(k, lo, hi):
        return torch.exp(torch.empty(k).uniform_(math.log(lo), math.log(hi), generator=gen))

    chans = torch.randperm(V32.d_nope, generator=gen)
    q_ch = chans[:8]
    kv_ch = torch.cat([chans[:1], chans[8:11]]) if shared else chans[8:12]
    q = torch.randn(b, s_q, h, d, generator=gen)
    q[..., q_ch] *= factors(8, 5.0, 30.0)
    kv = torch.randn(n, d, generator=gen) / 10
    kv[:, kv_ch] *= factors(4, 3.0, 15.0)
    toks = torch.randperm(n, generator=gen)[: max(1, n // 100)]
    kv[toks] *= factors(len(toks), 2.0, 5.0)[:, None]
    cache = V32.quantize_cache(kv.reshape(nb, page, d), power_of_two_scales=True)
    return SparseDecodeInputs(q=q.to(torch.bfloat16), k_cache=cache, indices=inp.indices, topk_length=None,
                              attn_sink=None, softmax_scale=inp.softmax_scale)


def input_stats(inp: SparseDecodeInputs, g: Gathered, keys: torch.Tensor) -> dict:
    """How heavy the tails are: max / median magnitude of q and of the gathered keys, and the
    largest |softmax_scale * q.k| (the logits' range decides how peaked the softmax is)."""
    b, s_q, h, _ = inp.q.shape
    q = inp.q.float().reshape(b * s_q, h, -1)
    k = keys[g.valid]
    s = scores_bf16(q, keys).masked_fill(~g.valid[:, None, :], 0.0) * inp.softmax_scale
    ratio = lambda t: (t.abs().max() / t.abs().median()).item()  # noqa: E731
    return dict(q_max_over_median=round(ratio(q), 1), k_max_over_median=round(ratio(k), 1),
                max_abs_logit=round(s.abs().max().item(), 2))


DISTRIBUTIONS: Dict[str, Callable] = {
    "flashmla": lambda b, s_q, h, topk, seed: make_inputs(
        b, s_q, h, topk, num_tokens=16384, generator=torch.Generator().manual_seed(seed)),
    "flashmla-fp32-scales": lambda b, s_q, h, topk, seed: make_inputs(
        b, s_q, h, topk, num_tokens=16384, power_of_two_scales=False, generator=torch.Generator().manual_seed(seed)),
    "heavy-tailed": lambda b, s_q, h, topk, seed: heavy_tailed(make_inputs(
        b, s_q, h, topk, num_tokens=16384, nan_unused=False, generator=torch.Generator().manual_seed(seed)), seed + 1,
        shared=False),
    "heavy-tailed-shared": lambda b, s_q, h, topk, seed: heavy_tailed(make_inputs(
        b, s_q, h, topk, num_tokens=16384, nan_unused=False, generator=torch.Generator().manual_seed(seed)), seed + 1,
        shared=True),
}


# ------------------------------------------------------------------------------------------ metrics
def errors(out, lse, ref_out, ref_lse) -> dict:
    """Error figures against the oracle (finite entries), and FlashMLA's verdict."""
    o, r = out.double(), ref_out.double()
    d = (o - r).abs()
    cos = cos_diff(o, r)
    fin = torch.isfinite(ref_lse)
    le = (lse.double()[fin] - ref_lse.double()[fin]).abs()
    try:
        check_out_lse(out, lse, ref_out, ref_lse)
        verdict = "pass"
    except AssertionError as e:
        verdict = "FAIL: " + str(e).split(";")[0]
    return dict(max_abs=d.max().item(), rel_l2=(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r)).item(),
                cos_diff=cos, lse_max_abs=le.max().item() if le.numel() else 0.0,
                max_abs_ref=r.abs().max().item(), flashmla_tolerances=verdict)


def study(shapes, seed: int, variants, log=print) -> list:
    rows = []
    for dist, make in DISTRIBUTIONS.items():
        for b, s_q, h, topk in shapes:
            inp = make(b, s_q, h, topk, seed)
            ref_out, ref_lse = sparse_decode_reference(inp.q, inp.k_cache, inp.indices, inp.softmax_scale,
                                                       kv_as_bf16=False, compute_dtype=torch.float64)
            g = gather_rows(inp)
            keys = keys_bf16(g)
            stats = input_stats(inp, g, keys)
            log(f"{dist} {b}x{s_q}x{h}: {stats}")
            for name in variants:
                t0 = time.perf_counter()
                out, lse = run_variant(name, inp, g, keys)
                e = errors(out, lse, ref_out, ref_lse)
                row = dict(distribution=dist, b=b, s_q=s_q, h_q=h, topk=topk, variant=name, **e, **stats,
                           seconds=round(time.perf_counter() - t0, 2))
                rows.append(row)
                log(f"{dist:21s} {b}x{s_q}x{h} topk {topk} {name:18s} max_abs {e['max_abs']:.2e} rel_l2 {e['rel_l2']:.2e} "
                    f"cos_diff {e['cos_diff']:.2e} lse {e['lse_max_abs']:.2e} | {e['flashmla_tolerances']}")
    return rows


def markdown(rows) -> str:
    lines = ["| inputs | b x s_q x h_q | variant | max abs | rel l2 (x bf16's) | cos diff | lse max abs | FlashMLA tolerances |",
             "|---|---|---|---|---|---|---|---|"]
    base = {(r["distribution"], r["b"], r["s_q"], r["h_q"]): r["rel_l2"] for r in rows if r["variant"] == "bf16"}
    for r in rows:
        b16 = base.get((r["distribution"], r["b"], r["s_q"], r["h_q"]))
        times = f" ({r['rel_l2'] / b16:.1f}x)" if b16 else ""
        verdict = "pass" if r["flashmla_tolerances"] == "pass" else r["flashmla_tolerances"][len("FAIL: "):]
        lines.append(f"| {r['distribution']} | {r['b']}x{r['s_q']}x{r['h_q']} | {r['variant']} | {r['max_abs']:.2e} | "
                     f"{r['rel_l2']:.2e}{times} | {r['cos_diff']:.2e} | {r['lse_max_abs']:.2e} | {verdict} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shapes", default="2x16x64,1x16x128", help="b x s_q x h_q, comma separated (32 and 16 "
                    "query tokens: the same work at both head counts)")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown at the end")
    args = ap.parse_args(argv)
    shapes = [(*map(int, sh.split("x")), args.topk) for sh in args.shapes.split(",")]
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    print(f"NOTE: {NOTE}")
    t0 = time.perf_counter()
    rows = study(shapes, args.seed, variants)
    took = time.perf_counter() - t0
    print(f"{len(rows)} rows in {took:.1f} s")
    if args.markdown:
        print(markdown(rows))
    if args.out:
        meta = dict(note=NOTE, oracle="sparse_decode_reference, float64, keys as dequantized (kv_as_bf16=False)",
                    tolerances="cute_mla.testing.check_out_lse (FlashMLA's sparse decode test)", seed=args.seed,
                    torch=torch.__version__, machine=platform.machine(), threads=torch.get_num_threads(),
                    seconds=round(took, 1))
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
