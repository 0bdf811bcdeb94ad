"""The architectures cute-mla builds for: one table from an arch name to its kernel, SM count and limits.

Every other module asks this table (``ARCHS``, :func:`get`) rather than spelling an arch name or
one of its facts itself. Nothing here imports the DSL or a kernel module: kernel modules are named
by import path and loaded by the launcher when a plan needs them, so ``import cute_mla`` stays
cheap and the plan works on any machine.

The device helpers at the end ask a CUDA device for its arch and SM count (once per device; no
call here synchronizes with the GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

MAX_GRID_Y = 65535           # CUDA's grid.y limit: scheduler partitions are grid y
SMEM_PER_CTA = 227 * 1024    # dynamic shared memory one CTA may use on SM90 and SM100


@dataclass(frozen=True)
class ArchSpec:
    """What the plan, the launcher and the tools need to know about one architecture."""

    name: str                    # the compile target (``--gpu-arch``)
    family: str
    major: int                   # compute capability of the GPUs that run it, exactly: an 'a' target's
    minor: int                   # features exist only there (sm_90a on 9.0, sm_100a on 10.0, not 10.3)
    kernel: str                  # the sparse decode kernel's name in plans and reports
    kernel_module: str           # where its config / compile / launch live
    default_num_sms: int         # planning without a device (``cute-mla plan``): H100/H200, B200
    accum_dtype: str             # o_accum element type of split pieces (lse_accum is always fp32)
    # FlashMLA's SM100 rule: top-k lists up to this length run one partition per request, unsplit
    no_split_max_topk: Optional[int]
    # scheduler partitions: num_sms // s_q, divided by the 64-head CTAs of a token (SM90) or not
    parts_per_head_block: bool
    # the fixed per-piece charge may drop to 0 on few-request shapes (scheduler.partition)
    zero_overhead_rule: bool
    tensor_maps_no_split: Tuple[str, ...]   # TMA descriptors the kernel builds (the compile tests check them)
    tensor_maps_split: Tuple[str, ...]
    tensor_maps_extra: Tuple[str, ...] = ()  # added by the extra KV pool (V4)

    def tensor_maps(self, split: bool, extra: bool = False) -> Tuple[str, ...]:
        maps = self.tensor_maps_split if split else self.tensor_maps_no_split
        return maps + (self.tensor_maps_extra if extra else ())


SM90 = ArchSpec(
    name="sm_90a", family="Hopper", major=9, minor=0, kernel="sm90_sparse_decode",
    kernel_module="cute_mla.kernels.sm90.sparse_decode", default_num_sms=132,
    # bf16 partials halve what split pieces store and the combine reads back; their rounding
    # (2^-9 max|V|) is the bound the bf16 P of the PV MMA already puts on O
    accum_dtype="bfloat16", no_split_max_topk=None, parts_per_head_block=True, zero_overhead_rule=True,
    tensor_maps_no_split=("q", "out"), tensor_maps_split=("q", "out", "o_accum"),
)
SM100 = ArchSpec(
    name="sm_100a", family="Blackwell", major=10, minor=0, kernel="sm100_sparse_decode",
    kernel_module="cute_mla.kernels.sm100.sparse_decode", default_num_sms=148,
    accum_dtype="float32", no_split_max_topk=640, parts_per_head_block=False, zero_overhead_rule=False,
    tensor_maps_no_split=("q", "kv_nope", "kv_rope", "out"),
    tensor_maps_split=("q", "kv_nope", "kv_rope", "out", "o_accum"),
    tensor_maps_extra=("extra_nope", "extra_rope"),
)

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
