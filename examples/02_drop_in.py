"""cute-mla as a drop-in for FlashMLA's sparse decode: the same two calls after a one-line import change.

Two calls of DeepSeek V3.2's sparse MLA decode (FP8 cache of 656 B per token, top-k 2048, 20 % of
the indices -1), each checked against the fp32 reference with FlashMLA's tolerances:

* a decode batch: 64 requests of one query token, 128 heads (``b=64, s_q=1``);
* vLLM's mixed batch: every token of the step as one request (``b=1, s_q=tokens``, 64 heads).
  FlashMLA allocates ``(b + num_sm_parts) x s_q x h_q x 512`` fp32 split-KV accumulators here
  (2052 MiB at 8192 tokens) that are never read; cute-mla's plan has one partition and allocates
  nothing.

When FlashMLA is importable (vLLM's build), both libraries run on the same inputs: their outputs
are compared, and each one's time per call (eager, CUDA events) and transient memory are printed.

    python examples/02_drop_in.py                 # mixed batch of 8192 tokens
    python examples/02_drop_in.py --tokens 32768  # FlashMLA's accumulators: 8208 MiB

Needs: GPU
"""

from __future__ import annotations

import argparse
import sys

from cute_mla.playground import require_gpu

# The whole change an engine makes; everything below calls the same two functions either way:
#
#   from flash_mla import get_mla_metadata, flash_mla_with_kvcache     # FlashMLA
#   from cute_mla import get_mla_metadata, flash_mla_with_kvcache      # cute-mla
#
# To run both side by side on the same inputs, this script calls them through their modules
# (``lib.get_mla_metadata``, ``lib.flash_mla_with_kvcache``).

TOPK = 2048
POOL = 131072          # tokens of the FP8 cache (page blocks of 64)
CHECKED_TOKENS = 256   # query tokens of the mixed batch checked against the fp32 reference


def decode(lib, sched, x):
    """One layer's call, as an engine writes it (``sched``: the step's metadata object)."""
    from cute_mla.formats import V32

    return lib.flash_mla_with_kvcache(x.q, x.k_cache, None, None, V32.d_v, sched, softmax_scale=x.softmax_scale,
                                      is_fp8_kvcache=True, indices=x.indices)


def run(name, lib, x):
    """``lib``'s (out, lse) on inputs ``x``; prints its time per call and transient memory."""
    from cute_mla.testing import median_event_us, step_transient_bytes

    sched, _ = lib.get_mla_metadata()      # once per decode step, shared by all its layers
    decode(lib, sched, x)                  # the first call compiles (or loads) the kernel and plans
    # a step's memory beyond its outputs: a fresh metadata object's first call
    (out, lse), transient = step_transient_bytes(lambda: lib.get_mla_metadata()[0], lambda s: decode(lib, s, x))
    us = median_event_us(lambda: decode(lib, sched, x), iters=10)
    print(f"  {name:<9} {us:9.1f} us per call (eager, median)   transient {transient / 2**20:8.1f} MiB")
    plan = getattr(sched, "plan", None)    # cute-mla's metadata object carries the call's plan
    if plan is not None:
        print(f"  {'':<9} plan: {plan.kernel} ({plan.variant}), {plan.num_sm_parts} partitions, workspace "
              f"{plan.workspace_bytes / 2**20:.1f} MiB; FlashMLA's formula: {plan.flashmla_workspace_bytes / 2**20:.1f} MiB")
    return out, lse


def check(name, out, lse, x, rows):
    """``out``/``lse`` of the query tokens ``rows`` against the fp32 reference (FlashMLA's tolerances)."""
    from cute_mla.reference import sparse_decode_reference
    from cute_mla.testing import check_out_lse

    # Query tokens are independent: the reference of a slice is the slice of the reference.
    q, idx = x.q[:, rows], x.indices[:, rows]
    ref_out, ref_lse = sparse_decode_reference(q, x.k_cache, idx, x.softmax_scale)
    try:
        check_out_lse(out[:, rows], lse[:, :, rows], ref_out, ref_lse)
    except AssertionError as e:
        sys.exit(f"{name}: does not match the reference: {e}")
    print(f"  {name:<9} matches the fp32 reference on {q.shape[0] * q.shape[1]} query tokens (FlashMLA's tolerances)")


def case(title, b, s_q, h_q, fm):
    import torch

    import cute_mla
    from cute_mla.testing import make_inputs

    print(f"\n{title}: b={b} s_q={s_q} h_q={h_q} topk={TOPK}")
    # Random inputs in FlashMLA's test style, made on the host; duplicates allowed in each list
    # (a unique draw per query token is slow on the host at this size; the reference counts them too).
    x = make_inputs(b, s_q, h_q, TOPK, num_tokens=POOL, unique=False, device="cuda")
    rows = slice(None) if s_q <= CHECKED_TOKENS else slice(None, None, s_q // CHECKED_TOKENS)
    out, lse = run("cute-mla", cute_mla, x)
    check("cute-mla", out, lse, x, rows)
    if fm is None:
        return
    fo, fl = run("FlashMLA", fm, x)
    check("FlashMLA", fo, fl, x, rows)
    diff = (out.float() - fo.float()).abs().max().item()
    same = torch.equal(out, fo)
    print(f"  cute-mla vs FlashMLA: max |out difference| {diff:.2e}{' (bit-identical)' if same else ''}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="query tokens of the mixed batch (default 8192)")
    args = ap.parse_args()
    if args.tokens < 1:
        sys.exit(f"--tokens: must be at least 1, got {args.tokens}")
    require_gpu(__file__, hint=f"`cute-mla plan --b 1 --s-q {args.tokens} --h-q 64` shows the mixed batch's plan")

    from cute_mla.archs import gpu_summary
    from cute_mla.playground.bench import import_flashmla

    print(f"GPU: {gpu_summary()}")
    fm = import_flashmla()
    case("decode batch", 64, 1, 128, fm)
    case("mixed batch (vLLM)", 1, args.tokens, 64, fm)


if __name__ == "__main__":
    main()
