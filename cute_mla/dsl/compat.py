"""Version-sensitive CuTe DSL names, in one place (pinned: nvidia-cutlass-dsl 4.8.1).

Kernels import drifting names from here, never from their DSL home directly, so that a DSL
upgrade touches this file only. Add a name here when a kernel needs one that moved between
releases.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: F401  (re-exported)

try:  # 4.8: moved out of cutlass.utils
    from cutlass.memory import SmemAllocator, TmemAllocator  # noqa: F401
except ImportError:  # pragma: no cover - older DSL
    from cutlass.utils import SmemAllocator, TmemAllocator  # type: ignore # noqa: F401

try:  # 4.8: one enum for wgmma and tcgen05
    from cutlass.cute.nvgpu import OperandMajorMode  # noqa: F401
except ImportError:  # pragma: no cover
    from cutlass.cute.nvgpu.warpgroup import OperandMajorMode  # type: ignore # noqa: F401

try:  # 4.8: moved to cutlass.tensor_utils (cutlass.utils.LayoutEnum warns on every use)
    from cutlass.tensor_utils import LayoutEnum  # noqa: F401
except ImportError:  # pragma: no cover - older DSL
    from cutlass.utils import LayoutEnum  # type: ignore # noqa: F401

# 4.4+: setmaxnreg wrappers (warpgroup_reg_alloc/dealloc are deprecated aliases)
setmaxregister_increase = cute.arch.setmaxregister_increase
setmaxregister_decrease = cute.arch.setmaxregister_decrease

DSL_VERSION = getattr(cutlass, "__version__", "4.8.1")

# tcgen05 ordering fences (no public cute.arch wrapper in 4.8.1; the NVVM op is stable).
from cutlass._mlir.dialects import nvvm as _nvvm  # noqa: E402


def tcgen05_fence_before_thread_sync() -> None:
    """``tcgen05.fence::before_thread_sync``: order prior tcgen05 ops (ld/st/mma) before an arrive."""
    _nvvm.tcgen05_fence(kind=_nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


def tcgen05_fence_after_thread_sync() -> None:
    """``tcgen05.fence::after_thread_sync``: order later tcgen05 ops after a completed wait."""
    _nvvm.tcgen05_fence(kind=_nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)
