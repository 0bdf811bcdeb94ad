"""The kernel-authoring playground: compile any kernel for any arch on any machine and read what
came out (PTX, cubin, SASS, resources). ``cute-mla compile`` is its command line; ``examples/``
are its scripts."""

from __future__ import annotations

import os
import sys


def require_gpu(script: str, hint: str = "") -> None:
    """Exit with one line (status 1, no traceback) unless an SM90 or SM100 GPU is present.

    Every GPU example calls this first, so that on a CPU-only machine it says what it needs
    instead of failing inside torch. ``hint``: what to run instead on this machine.
    """
    from ..archs import UnsupportedDeviceError, device_spec, gpu_summary

    name = os.path.basename(script)
    have = gpu_summary()
    if have is not None:
        try:
            device_spec("cuda")
            return
        except UnsupportedDeviceError:
            pass
    tail = f"; {hint}" if hint else ""
    sys.exit(f"{name} needs an SM90 or SM100 GPU; this machine has {have or 'none'}{tail}")
