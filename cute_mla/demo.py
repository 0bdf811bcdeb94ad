"""``cute-mla demo``: a realistic sparse decode, checked against the reference, with time and memory.

On a GPU: vLLM's mixed-batch layout (b=1, s_q=tokens, 64 heads) and a decode batch (b=64, s_q=2,
128 heads), both with top-k 2048 over a 131072-token FP8 pool and 20% of the indices invalid.
Without a GPU: the plans of the same calls, and the reference on a small case.
"""

from __future__ import annotations

import time

import torch

from . import archs
from .archs import gpu_summary
from .plan import plan_sparse_decode

SHAPES = [  # (name, b, s_q, h_q)
    ("mixed batch (vLLM, b=1, s_q=tokens)", 1, 8192, 64),
    ("decode batch (MTP, s_q=2)", 64, 2, 128),
]


def _gpu(args) -> int:
    from . import flash_mla_with_kvcache, get_mla_metadata
    from .reference import sparse_decode_reference
    from .testing import check_out_lse, make_inputs, step_transient_bytes

    dev = torch.device("cuda")
    print(f"GPU: {gpu_summary()}")
    for name, b, s_q, h in SHAPES:
        if args.quick:
            s_q = min(s_q, 1024)
        x = make_inputs(b, s_q, h, 2048, num_tokens=131072, unique=False, nan_unused=False, device=dev)
        sched, _ = get_mla_metadata()
        kw = dict(softmax_scale=x.softmax_scale, is_fp8_kvcache=True, indices=x.indices)
        t0 = time.perf_counter()
        out, lse = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, **kw)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        del out, lse
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def timed_call():
            e0.record()
            o = flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, sched, **kw)
            e1.record()
            return o

        out, lse = timed_call()
        _, transient = step_transient_bytes(lambda: get_mla_metadata()[0],
                                            lambda s: flash_mla_with_kvcache(x.q, x.k_cache, None, None, 512, s, **kw))
        ro, rl = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale)
        check_out_lse(out, lse, ro, rl)
        us = e0.elapsed_time(e1) * 1e3
        tflops = 2 * h * (576 + 512) * 2048 * b * s_q / us * 1e-6
        plan = sched.plan
        print(f"\n{name}: b={b} s_q={s_q} h_q={h} topk=2048  ->  {plan.kernel} ({plan.variant}), {plan.num_sm_parts} partitions")
        print("  matches the fp32 reference (FlashMLA's tolerances)")
        print(f"  {us:.1f} us per call ({tflops:.0f} TFLOP/s), first call {first:.2f} s (compile)")
        print(f"  memory per step beyond out and lse {transient / 2**20:.2f} MiB (plan: {plan.workspace_bytes / 2**20:.2f} MiB; "
              f"FlashMLA allocates {plan.flashmla_workspace_bytes / 2**20:.1f} MiB here)")
    return 0


def _cpu(args) -> int:
    from .reference import sparse_decode_reference
    from .testing import make_inputs

    spec = archs.SM90
    print(f"No supported GPU here: showing the plans of the demo calls ({spec.family}, {spec.default_num_sms} SMs) "
          "and the reference on a small case.")
    for name, b, s_q, h in SHAPES:
        print(f"\n{name}")
        print(plan_sparse_decode(b, s_q, h, 576, 2048, arch=spec.name, num_sms=spec.default_num_sms).describe())
    x = make_inputs(2, 2, 64, 128, num_tokens=512, with_sink=True, all_invalid_rows=1)
    out, lse = sparse_decode_reference(x.q, x.k_cache, x.indices, x.softmax_scale, x.attn_sink)
    print(f"\nreference on b=2, s_q=2, h_q=64, topk=128 (one all-invalid row): out {tuple(out.shape)}, "
          f"lse {tuple(lse.shape)}, rows with lse=+inf: {int(torch.isinf(lse).all(1).sum())}")
    return 0


def main(args) -> int:
    if torch.cuda.is_available():
        return _gpu(args)
    return _cpu(args)
