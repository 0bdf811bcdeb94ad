"""The plan of a call (which kernel, which variant, what memory) and its schedule (which partition
handles which request blocks), made on the host before any launch."""

from .plan import SparseDecodePlan, check_problem, plan_sparse_decode  # noqa: F401
