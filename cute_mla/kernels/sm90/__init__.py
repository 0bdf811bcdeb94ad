"""SM90 (Hopper, sm_90a) kernels: the sparse MLA decode main kernel.

``config.py`` holds what a compile depends on (plain Python); ``sparse_decode.py`` the host side,
the kernel entry, compile and launch; one module per warp-group role.
"""

from .config import DEFAULT_TUNING, RegisterBudget, Sm90SparseDecodeConfig, Sm90Tuning, kernel_config  # noqa: F401
