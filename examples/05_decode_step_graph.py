"""One decode step of a DeepSeek-V3.2-shaped model's attention layers, captured as one CUDA graph.

An engine replays a whole decode step as one CUDA graph; this is that step's sparse MLA part:
61 layers, each with its own queries (``b`` requests x 1 token x 128 heads x 576), its own top-k
indices (2048 of the request's context tokens) and its own FP8 KV cache (V3.2, 656 B per token:
``b x context`` tokens per layer; per-layer caches, not one shared pool, so that no layer finds
another's rows in L2). ``get_mla_metadata()`` is called once per step and its object is shared by
all 61 calls, as in vLLM. 128 heads is the model's full count, as one GPU runs it with
data-parallel attention (tensor parallelism would divide the heads among GPUs). Inputs are random;
the model's other kernels are left out.

Prints the step's time and the time per layer (graph replay between CUDA events, median of
``--replays``), the same for FlashMLA on the same inputs when it is importable (vLLM's build), and
checks the first and last layers' outputs against the fp32 reference.

    python examples/05_decode_step_graph.py                     # b=32, context 4096: ~5.3 GB of caches
    python examples/05_decode_step_graph.py --batch 64 --context 2048

Needs: GPU
"""

from __future__ import annotations

import argparse
import sys

from cute_mla.playground import require_gpu

LAYERS = 61            # DeepSeek V3.2's transformer layers, each with one MLA attention
HEADS = 128            # its query heads
TOPK = 2048            # its indexer's top-k
PAGE = 64              # tokens per page block of the cache


def make_layers(b, context):
    """Per layer: q (b, 1, HEADS, d_qk) bf16, a V3.2 cache of ``b * context`` tokens and (b, 1, TOPK)
    int32 indices; request r's context is tokens [r * context, (r + 1) * context) of its layer's cache."""
    import torch

    from cute_mla.formats import V32

    tokens = b * context
    q, caches, indices = [], [], []
    for _ in range(LAYERS):
        kv = (torch.randn(tokens // PAGE, PAGE, V32.d_qk, device="cuda") / 10).clamp(-1, 1)
        caches.append(V32.quantize_cache(kv))
        del kv
        q.append(torch.randn(b, 1, HEADS, V32.d_qk, device="cuda").clamp(-1, 1).to(torch.bfloat16))
        # TOPK distinct tokens of each request's own context (a random permutation's head)
        pick = torch.rand(b, context, device="cuda").argsort(dim=-1)[:, :TOPK]
        base = torch.arange(b, device="cuda").view(b, 1) * context
        indices.append((pick + base).to(torch.int32).view(b, 1, TOPK))
    return q, caches, indices


def step(lib, sched, q, caches, indices):
    """The step's 61 attention calls, one metadata object for all of them; each layer's (out, lse)."""
    from cute_mla.formats import V32

    return [lib.flash_mla_with_kvcache(q[i], caches[i], None, None, V32.d_v, sched, softmax_scale=V32.d_qk ** -0.5,
                                       is_fp8_kvcache=True, indices=indices[i]) for i in range(LAYERS)]


def capture_step(lib, q, caches, indices):
    """(graph, the layers' outputs it writes, the metadata object): the step captured with one
    metadata object, after a warm-up step (compiles or loads the kernel, fills the object)."""
    from cute_mla.playground.bench import capture_graph

    sched, _ = lib.get_mla_metadata()          # once per step, shared by all layers
    graph, outs = capture_graph(lambda: step(lib, sched, q, caches, indices))
    return graph, outs, sched


def check_layers(name, outs, q, caches, indices):
    """The first and last layers' outputs against the fp32 reference (FlashMLA's tolerances)."""
    from cute_mla.formats import V32
    from cute_mla.reference import sparse_decode_reference
    from cute_mla.testing import check_out_lse

    for i in (0, LAYERS - 1):
        ref_out, ref_lse = sparse_decode_reference(q[i], caches[i], indices[i], V32.d_qk ** -0.5)
        try:
            check_out_lse(*outs[i], ref_out, ref_lse)
        except AssertionError as e:
            sys.exit(f"{name}, layer {i}: does not match the reference: {e}")
    print(f"  {name:<9} layers 0 and {LAYERS - 1} match the fp32 reference (FlashMLA's tolerances)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="requests in the step (default 32)")
    ap.add_argument("--context", type=int, default=4096, help=f"context tokens per request, at least {TOPK} "
                    "and a multiple of 64 (default 4096)")
    ap.add_argument("--replays", type=int, default=50, help="timed graph replays (default 50)")
    args = ap.parse_args()
    if args.batch < 1 or args.replays < 1:
        sys.exit(f"--batch and --replays: must be at least 1, got {args.batch} and {args.replays}")
    if args.context < TOPK or args.context % PAGE:
        sys.exit(f"--context: must be at least {TOPK} and a multiple of {PAGE}, got {args.context}")
    require_gpu(__file__, hint=f"`cute-mla plan --b {args.batch} --s-q 1 --h-q {HEADS}` shows one layer's plan")

    import torch

    import cute_mla
    from cute_mla.archs import gpu_summary
    from cute_mla.formats import V32
    from cute_mla.playground.bench import import_flashmla, replay_median_us, warm_up

    print(f"GPU: {gpu_summary()}")
    q, caches, indices = make_layers(args.batch, args.context)
    cache_gb = sum(c.untyped_storage().nbytes() for c in caches) / 1e9
    print(f"{LAYERS} layers: b={args.batch} s_q=1 h_q={HEADS} d_qk={V32.d_qk} topk={TOPK}; per-layer V3.2 caches of "
          f"{args.batch * args.context} tokens ({cache_gb:.2f} GB in all)")
    flops = 2 * HEADS * (V32.d_qk + V32.d_v) * TOPK * args.batch     # QK and PV of one layer

    warm_up(1.0)                               # an idle GPU clocks down: the first replays would read slow
    times, outputs = {}, {}
    for name, lib in (("cute-mla", cute_mla), ("FlashMLA", import_flashmla())):
        if lib is None:
            continue
        graph, outs, sched = capture_step(lib, q, caches, indices)
        us = replay_median_us(graph, args.replays)
        per_layer = us / LAYERS
        times[name], outputs[name] = us, outs
        print(f"  {name:<9} step {us:8.1f} us   per layer {per_layer:6.2f} us ({flops / per_layer * 1e-6:.0f} TFLOP/s)")
        plan = getattr(sched, "plan", None)    # cute-mla's metadata object carries the calls' plan
        if plan is not None:
            print(f"  {'':<9} each layer: {plan.kernel} ({plan.variant}), {plan.num_sm_parts} partitions")
        check_layers(name, outs, q, caches, indices)
    if len(times) == 2:
        diff = max((a[0].float() - b[0].float()).abs().max().item()
                   for a, b in zip(outputs["cute-mla"], outputs["FlashMLA"]))
        print(f"  FlashMLA / cute-mla step time: {times['FlashMLA'] / times['cute-mla']:.2f}x; "
              f"max |out difference| over all layers {diff:.2e}")
    print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
