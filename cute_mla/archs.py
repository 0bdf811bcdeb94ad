"""The architectures cute-mla builds for: one table from an arch name to its facts (compile target,
compute capability, default SM count, limits).

Every other module asks this table (``ARCHS``, :func:`get`) rather than spelling an arch name or
one of its facts itself. Which kernel runs an op on an arch is the registry's fact
(``cute_mla.registry``); nothing here imports the DSL or a kernel module, so ``import cute_mla``
stays cheap and plans work on any machine.

The device helpers at the end ask a CUDA device for its arch and SM count (once per device; no
call here synchronizes with the GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional

import torch

MAX_GRID_Y = 65535           # CUDA's grid.y limit: scheduler partitions are grid y
SMEM_PER_CTA = 227 * 1024    # dynamic shared memory one CTA may use on SM90 and SM100


@dataclass(frozen=True)
class ArchSpec:
    """What every op's plan, launcher and tools need to know about one architecture. What a
    kernel does on it lives with the kernel (``cute_mla.registry``), how an op plans for it in
    that op's policy (``cute_mla.plan.policy``)."""

    name: str                    # the compile target (``--gpu-arch``)
    family: str
    major: int                   # compute capability of the GPUs that run it, exactly: an 'a' target's
    minor: int                   # features exist only there (sm_90a on 9.0, sm_100a on 10.0, not 10.3)
    default_num_sms: int         # planning without a device (``cute-mla plan``); a device's own count otherwise
    # The L2 of the arch's datacenter parts, where a plan rule reads it (None: no rule does)
    l2_bytes: Optional[int] = None


SM90 = ArchSpec(name="sm_90a", family="Hopper", major=9, minor=0, default_num_sms=132, l2_bytes=50 * 2**20)
SM100 = ArchSpec(name="sm_100a", family="Blackwell", major=10, minor=0, default_num_sms=148)

ARCHS: Dict[str, ArchSpec] = {a.name: a for a in (SM90, SM100)}
SUPPORTED_ARCHS = tuple(ARCHS)


def get(arch: str) -> ArchSpec:
    """The spec of an arch name, or a ValueError naming the accepted ones."""
    spec = ARCHS.get(arch)
    if spec is None:
        raise ValueError(f"arch: got {arch!r}, accepted: {', '.join(SUPPORTED_ARCHS)}")
    return spec


def check_arch(arch: str) -> str:
    return get(arch).name


# ------------------------------------------------------------------------------------ devices


class UnsupportedDeviceError(RuntimeError):
    """Raised when no supported GPU is present or a tensor lives on an unsupported device."""


@functools.lru_cache(maxsize=None)
def _device_props(index: int):
    return torch.cuda.get_device_properties(index)


def _props(device: torch.device):
    device = torch.device(device)
    return _device_props(device.index if device.index is not None else torch.cuda.current_device())


def device_spec(device: torch.device) -> ArchSpec:
    """The spec of a CUDA device's arch, else :class:`UnsupportedDeviceError`."""
    device = torch.device(device)
    if device.type != "cuda":
        raise UnsupportedDeviceError(f"cute-mla kernels need a CUDA device; got tensors on {device}")
    props = _props(device)
    for spec in ARCHS.values():
        if (props.major, props.minor) == (spec.major, spec.minor):
            return spec
    supported = " and ".join(f"{a.family} ({a.major}.{a.minor})" for a in ARCHS.values())
    raise UnsupportedDeviceError(
        f"cute-mla supports {supported}; {props.name} is compute capability {props.major}.{props.minor}")


def device_arch(device: torch.device) -> str:
    """The arch name of a CUDA device (``device_spec(device).name``)."""
    return device_spec(device).name


def device_num_sms(device: torch.device) -> int:
    return _props(device).multi_processor_count


def gpu_summary() -> Optional[str]:
    """A one-line description of the current GPU, or None without one."""
    if not torch.cuda.is_available():
        return None
    p = _device_props(torch.cuda.current_device())
    return f"{p.name} (compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
