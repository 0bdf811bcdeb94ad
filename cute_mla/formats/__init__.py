"""KV-cache formats of the sparse decode path: one module per format.

Each format module holds its byte layout as a frozen :class:`KVCacheFormat` (the numbers the
validation, the plan, the reference and the kernels read), the host ``quantize_*`` /
``dequantize_*`` functions and the device dequant routine each arch's producer calls. A format is
identified by ``(d_qk, bytes per token)``; :func:`detect_format` names it or says what is accepted
(the API's one mapping from a cache to its format). Plans, kernel configs, compile-cache keys and
warmup name a format by its ``name`` (:func:`format_named`): formats of one ``d_qk`` (V4 and V4.1)
stay apart.
"""

from __future__ import annotations

from typing import Dict, Tuple

from .layout import FP8_E4M3_MAX, FormatGeometry, KVCacheFormat  # noqa: F401
from .v4 import V4, dequantize_v4, quantize_v4  # noqa: F401
from .v32 import V32, dequantize_cache_v32, dequantize_v32, quantize_cache_v32, quantize_v32  # noqa: F401

_FORMATS: Dict[Tuple[int, int], KVCacheFormat] = {(f.d_qk, f.row_bytes): f for f in (V32, V4)}

# Formats FlashMLA knows but cute-mla does not implement yet: a clear NotImplementedError for them.
_KNOWN_UNIMPLEMENTED = {(576, 352): "V32_NVFP4_FP8ROPE", (512, 528): "V41", (512, 288): "V41_FP4"}


def supported_formats() -> Tuple[KVCacheFormat, ...]:
    return tuple(_FORMATS.values())


def detect_format(d_qk: int, bytes_per_token: int) -> KVCacheFormat:
    """The cache format of a ``(d_qk, bytes_per_token)`` pair, or a clear error."""
    fmt = _FORMATS.get((int(d_qk), int(bytes_per_token)))
    if fmt is not None:
        return fmt
    accepted = ", ".join(f"{f.name} (d_qk={f.d_qk}, {f.row_bytes} bytes/token)" for f in _FORMATS.values())
    name = _KNOWN_UNIMPLEMENTED.get((int(d_qk), int(bytes_per_token)))
    if name is not None:
        raise NotImplementedError(
            f"k_cache: the {name} format (d_qk={d_qk}, {bytes_per_token} bytes/token) is not implemented yet; accepted: {accepted}")
    raise ValueError(
        f"k_cache: unknown cache format for d_qk={d_qk} with {bytes_per_token} bytes per token; accepted: {accepted}")


def _name_key(name: str) -> str:
    return str(name).replace(".", "").replace("_", "").lower()


_BY_NAME: Dict[str, KVCacheFormat] = {_name_key(f.name): f for f in _FORMATS.values()}


def format_named(name: str) -> KVCacheFormat:
    """The implemented format of a name (``"V3.2"``, ``"V4"``; case, dots and underscores ignored:
    ``v32`` names V3.2), or a clear error."""
    fmt = _BY_NAME.get(_name_key(name))
    if fmt is not None:
        return fmt
    accepted = ", ".join(f.name for f in _FORMATS.values())
    if any(_name_key(n) == _name_key(name) for n in _KNOWN_UNIMPLEMENTED.values()):
        raise NotImplementedError(f"format: {name} is not implemented yet; accepted: {accepted}")
    raise ValueError(f"format: got {name!r}, accepted: {accepted}")


def format_for_d_qk(d_qk: int) -> KVCacheFormat:
    """The implemented format with this key width (the plan knows d_qk, not the row bytes)."""
    for f in _FORMATS.values():
        if f.d_qk == d_qk:
            return f
    accepted = ", ".join(f"{f.d_qk} ({f.name})" for f in _FORMATS.values())
    if any(k[0] == d_qk for k in _KNOWN_UNIMPLEMENTED):
        raise NotImplementedError(f"d_qk: {d_qk} (the V4.1 formats) is not implemented yet; accepted: {accepted}")
    raise ValueError(f"d_qk: got {d_qk}, accepted: {accepted}")


def kernel_format(name: str, has_extra: bool, has_extra_topk_length: bool) -> KVCacheFormat:
    """A kernel config's format (by name), with its extra-pool flags checked against it (every arch's config)."""
    fmt = format_named(name)
    if has_extra and not fmt.extra_pool:
        raise ValueError(f"has_extra: the {fmt.name} format has no extra pool")
    if has_extra_topk_length and not has_extra:
        raise ValueError("has_extra_topk_length: needs has_extra")
    return fmt
