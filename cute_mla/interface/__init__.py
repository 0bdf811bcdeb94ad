"""The public API: FlashMLA-compatible entry points, their argument checks and the launcher that
turns a call's plan into kernel launches."""

from ..plan import SparseDecodePlan, plan_sparse_decode  # noqa: F401
from .api import FlashMLASchedMeta, flash_mla_with_kvcache, get_mla_metadata  # noqa: F401
from .prefill import flash_mla_sparse_fwd  # noqa: F401
