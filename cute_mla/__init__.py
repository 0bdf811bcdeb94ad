"""cute-mla: DeepSeek-style sparse MLA decode attention in the CuTe Python DSL.

Drop-in for FlashMLA's sparse decode::

    from cute_mla import get_mla_metadata, flash_mla_with_kvcache
    sched, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, sched, softmax_scale=scale,
                                      is_fp8_kvcache=True, indices=indices)

The split-KV workspace follows the schedule: nothing is allocated when no request is split
(see :func:`plan_sparse_decode`).
"""

__version__ = "0.1.0"

from .interface import (  # noqa: F401
    FlashMLASchedMeta,
    SparseDecodePlan,
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    get_mla_metadata,
    plan_sparse_decode,
)
from .plan.sparse_prefill import SparsePrefillPlan, plan_sparse_prefill  # noqa: F401

__all__ = ["FlashMLASchedMeta", "SparseDecodePlan", "SparsePrefillPlan", "flash_mla_sparse_fwd", "flash_mla_with_kvcache",
           "get_mla_metadata", "plan_sparse_decode", "plan_sparse_prefill", "__version__"]
