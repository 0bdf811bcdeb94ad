"""Which GPU we run on, asked once per device (no call here synchronizes with the GPU)."""

from __future__ import annotations

import functools
from typing import Optional

import torch

ARCH_BY_MAJOR = {9: "sm_90a", 10: "sm_100a"}


class UnsupportedDeviceError(RuntimeError):
    """Raised when no supported GPU is present or a tensor lives on an unsupported device."""


@functools.lru_cache(maxsize=None)
def _device_props(index: int):
    return torch.cuda.get_device_properties(index)


def device_arch(device: torch.device) -> str:
    """'sm_90a' or 'sm_100a' for a CUDA device, else :class:`UnsupportedDeviceError`."""
    device = torch.device(device)
    if device.type != "cuda":
        raise UnsupportedDeviceError(f"cute-mla kernels need a CUDA device; got tensors on {device}")
    props = _device_props(device.index if device.index is not None else torch.cuda.current_device())
    arch = ARCH_BY_MAJOR.get(props.major)
    if arch is None or (props.major == 9 and props.minor != 0):
        raise UnsupportedDeviceError(
            f"cute-mla supports SM90 (Hopper, compute capability 9.0) and SM100 (Blackwell, 10.x); "
            f"{props.name} is compute capability {props.major}.{props.minor}")
    return arch


def device_num_sms(device: torch.device) -> int:
    device = torch.device(device)
    return _device_props(device.index if device.index is not None else torch.cuda.current_device()).multi_processor_count


def gpu_summary() -> Optional[str]:
    """A one-line description of the current GPU, or None without one."""
    if not torch.cuda.is_available():
        return None
    p = _device_props(torch.cuda.current_device())
    return f"{p.name} (compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
