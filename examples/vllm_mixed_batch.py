"""vLLM's mixed-batch call through cute-mla: every token of the step as one request (b=1, s_q=tokens).

With 64 heads and 8192 tokens FlashMLA allocates 2052 MiB of split-KV accumulators here that are
never read; cute-mla's plan has one partition, runs the no-split kernel and allocates nothing.

    python examples/vllm_mixed_batch.py            # on an H100/H200 or B200
"""

import sys

import torch

from cute_mla import flash_mla_with_kvcache, get_mla_metadata
from cute_mla.archs import gpu_summary
from cute_mla.formats import quantize_v32

if not torch.cuda.is_available():
    sys.exit(f"examples/vllm_mixed_batch.py needs an SM90 or SM100 GPU; this machine has {gpu_summary() or 'none'} "
             "(cute-mla plan --b 1 --s-q 8192 shows the plan without one)")

tokens, heads, topk, pool, page = 8192, 64, 2048, 131072, 64
dev = "cuda"

kv = (torch.randn(pool, 576, device=dev) / 10).clamp(-1, 1)
k_cache = quantize_v32(kv).view(pool // page, page, 1, 656)                  # the V3.2 FP8 cache
q = torch.randn(1, tokens, heads, 576, device=dev).clamp(-1, 1).to(torch.bfloat16)
indices = torch.randint(0, pool, (1, tokens, topk), device=dev, dtype=torch.int32)
indices[torch.rand(indices.shape, device=dev) < 0.2] = -1                     # invalid entries

sched, _ = get_mla_metadata()          # one per step, shared by all layers of the step
out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, sched, softmax_scale=576 ** -0.5,
                                  is_fp8_kvcache=True, indices=indices)
print(sched.plan.describe())
print("out", tuple(out.shape), out.dtype, " lse", tuple(lse.shape), lse.dtype)
