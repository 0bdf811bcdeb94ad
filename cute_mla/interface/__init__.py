"""Public API and dispatcher: FlashMLA-compatible entry points and the workspace-aware plan."""

from .api import FlashMLASchedMeta, flash_mla_with_kvcache, get_mla_metadata  # noqa: F401
from .plan import SparseDecodePlan, plan_sparse_decode  # noqa: F401
