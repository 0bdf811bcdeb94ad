"""The plan of a call (which kernel, which variant, what memory) and its schedule (which partition
handles which request blocks), made on the host before any launch: one module per op
(``sparse_decode.py``), the rules it applies as a per-arch policy value (``policy.py``)."""

from .policy import SparseDecodePolicy, default_policy  # noqa: F401
from .sparse_decode import SparseDecodePlan, check_problem, plan_sparse_decode  # noqa: F401
