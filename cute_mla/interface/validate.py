"""Host-side argument checks of the public API: every bad input is refused before any launch.

Each check raises ValueError (a wrong value or shape), TypeError (a wrong type or dtype) or
NotImplementedError (a FlashMLA feature cute-mla has not built yet), naming the argument, what was
given and what is accepted. Nothing here reads device memory.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from ..archs import UnsupportedDeviceError

KV_CACHE_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)
FP32_MAX = torch.finfo(torch.float32).max   # a softmax scale reaches the kernels as a float32


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    shape = getattr(t, "shape", None)
    if shape is not None:     # an array of another library: its type and shape, not its values
        return f"{type(t).__module__}.{type(t).__name__} of shape {tuple(shape)}"
    text = repr(t)
    return f"{type(t).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_tensor(name: str, t, *, dtypes: Sequence[torch.dtype], dim: Optional[int] = None,
                 shape: Optional[Sequence[Optional[int]]] = None, device: Optional[torch.device] = None,
                 last_contiguous: bool = True, contiguous: bool = False, shape_doc: str = "") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor{' ' + shape_doc if shape_doc else ''}, got {_desc(t)}")
    if t.layout is not torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if not torch.compiler.is_compiling():     # a trace cannot ask: check_deferred asks the real tensor
        check_not_neg(name, t)
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: got dtype {t.dtype}, accepted: {', '.join(str(d) for d in dtypes)}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dims {shape_doc}, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise ValueError(f"{name}: expected shape {shape_doc or tuple(shape)}, got {tuple(t.shape)} (dim {i} is {got}, expected {want})")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where q is), got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {t.stride()}")
    return t


def check_vector(name: str, t, dtype: torch.dtype, length: int, length_doc: str, device: torch.device) -> None:
    """An optional per-head or per-row argument (``attn_sink``, ``topk_length``): None, or a
    contiguous 1-D ``dtype`` tensor of ``length`` (``length_doc`` names it) on ``device``."""
    if t is not None:
        check_tensor(name, t, dtypes=(dtype,), dim=1, shape=(length,), device=device, contiguous=True,
                     shape_doc=f"({length_doc},)")


def check_aligned_strides(name: str, t: torch.Tensor, align_bytes: int = 16, tma: bool = False) -> None:
    """TMA and 16-byte vector accesses need every outer stride (in bytes) and the base 16-byte aligned
    (the base: not in a trace, which has no data pointer; :func:`check_deferred` checks it on the
    real tensor). Vector loads never step along a dim of size 1, so its stride is free, except for
    a tensor the kernels address through a TMA tensor map (``tma``: q and out), whose compiled
    signature takes every stride, size 1 or not, and which must not broadcast (stride 0)."""
    es = t.element_size()
    for i, s in enumerate(t.stride()[:-1]):
        if (t.shape[i] > 1 or tma) and (s * es) % align_bytes:
            size_one = " on a dim of size 1 (a TMA tensor map takes every dim's stride)" if t.shape[i] == 1 else ""
            raise ValueError(f"{name}: stride {i} is {s} elements ({s * es} bytes){size_one}, accepted: a multiple of "
                             f"{align_bytes} bytes ({FRESH_STRIDES} gives one)")
        if tma and s == 0 and t.shape[i] > 1:
            raise ValueError(f"{name}: stride {i} is 0 on a dim of size {t.shape[i]} (a broadcast view), accepted: "
                             f"distinct rows ({FRESH_STRIDES} gives them)")
    if not torch.compiler.is_compiling():
        check_pointer(name, t, align_bytes)


# a copy with strides made from its sizes: .contiguous() keeps the strides of a tensor torch already
# calls contiguous, whose size-1 dims may have any stride
FRESH_STRIDES = ".clone(memory_format=torch.contiguous_format)"


def check_distinct_elements(name: str, t: torch.Tensor) -> None:
    """An output's elements at distinct addresses (no stride 0, no overlapping dims): ordered by
    stride, each dim longer than one steps past the span of the smaller ones."""
    span = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < span:
            raise ValueError(f"{name}: its elements overlap (shape {tuple(t.shape)}, strides {tuple(t.stride())}), "
                             "accepted: a view whose elements are distinct, such as a slice of a contiguous tensor")
        span += stride * (size - 1)


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from a strided tensor's first element to the end of its last (0 when empty)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _byte_span(t: torch.Tensor) -> Tuple[int, int]:
    """[first, last + 1) byte addresses a strided tensor's elements lie in."""
    return t.data_ptr(), t.data_ptr() + span_bytes(t)


def check_apart(name: str, t, other_name: str, other) -> None:
    """An output whose bytes lie apart from an input's: the kernels may still read ``other`` while
    CTAs write ``t``, so shared bytes would give silent garbage. Spans are compared, so two
    interleaved views of one buffer are refused too. Checked on every call (addresses change
    between calls); what is not a strided tensor passes here and is named by the other checks."""
    if not (isinstance(t, torch.Tensor) and isinstance(other, torch.Tensor)
            and t.layout is torch.strided and other.layout is torch.strided):
        return
    lo, hi = _byte_span(t)
    olo, ohi = _byte_span(other)
    if lo < ohi and olo < hi:
        raise ValueError(f"{name}: its memory [{lo:#x}, {hi:#x}) overlaps {other_name}'s [{olo:#x}, {ohi:#x}); "
                         f"accepted: an {name} that shares no bytes with the inputs (the kernels read {other_name} "
                         f"while they write {name})")


def check_out_apart(out: torch.Tensor, inputs, spans) -> None:
    """:func:`check_apart` of ``out`` and each of ``inputs`` ((name, tensor or None) pairs), given
    their byte spans (``(out's, (each input's or None, ...))``, cached per signature): a call pays
    the address comparisons, and check_apart names an overlap."""
    out_bytes, in_bytes = spans
    lo = out.data_ptr()
    hi = lo + out_bytes
    for (name, t), n in zip(inputs, in_bytes):
        if t is not None:
            tlo = t.data_ptr()
            if lo < tlo + n and tlo < hi:
                check_apart("out", out, name, t)


def check_pointer(name: str, t: Optional[torch.Tensor], align_bytes: int = 16, what: str = "the data pointer") -> None:
    """The base-pointer half of :func:`check_aligned_strides`, and a paged cache's base (``what``:
    :data:`CACHE_BASE`, as its page blocks' alignment starts there); None passes."""
    if t is not None and t.data_ptr() % align_bytes:
        raise ValueError(f"{name}: {what} must be {align_bytes}-byte aligned, got an offset of "
                         f"{t.data_ptr() % align_bytes} bytes")


CACHE_BASE = "base pointer and stride(0)"   # check_pointer's ``what`` for a paged cache


def check_not_neg(name: str, t: torch.Tensor) -> None:
    if t.is_neg():
        raise ValueError(f"{name}: a lazily negated view (torch._neg_view) is not read as negated by the kernels; "
                         "pass t.resolve_neg()")


def check_deferred(tensors, caches) -> None:
    """The checks a traced call defers to its op, which sees the real tensors: base pointers and the
    neg bit. ``tensors`` and ``caches``: (name, tensor or None) pairs; a cache's base needs 16 bytes."""
    for name, t in tensors + caches:
        if t is not None:
            check_not_neg(name, t)
    for name, t in tensors:
        check_pointer(name, t)
    for name, t in caches:
        check_pointer(name, t, what=CACHE_BASE)


def tensor_signature(t):
    """What the tensor checks read of one argument: its type, dtype, shape, strides, device,
    base-pointer alignment and neg bit; None for None (an absent optional). Raises for what is not
    a strided tensor: the caller then runs the full checks, which name it. Arguments of the same
    signatures pass or fail the same per-tensor checks, so an API keeps the signatures that passed
    and a repeated call pays this and a dict lookup; what depends on addresses (out apart from the
    inputs) the API still checks on every call."""
    if t is None:
        return None
    if t.layout is not torch.strided:
        raise TypeError
    return type(t), t.dtype, t.shape, t.stride(), t.device, t.data_ptr() & 15, t.is_neg()


_SIGNATURE_ERRORS = (AttributeError, RuntimeError, TypeError, NotImplementedError)   # tensor_signature of a non-tensor


def call_key(d_v, t0, t1, t2, t3, t4, t5, t6=None, t7=None, t8=None) -> Optional[tuple]:
    """A call's signature, hashable: its value dim ``d_v`` (an exact int) and each tensor's (or
    None's) :func:`tensor_signature`; None where an argument is neither (the full checks then run
    and name it). It runs on every call before the launch, so it is one tuple of fixed length (an
    API with fewer tensors leaves the last None)."""
    if type(d_v) is not int:
        return None
    sig = tensor_signature
    try:     # (an absent optional's None inline: a call's key pays no frame for it)
        return (d_v, sig(t0), sig(t1), sig(t2), None if t3 is None else sig(t3), None if t4 is None else sig(t4),
                None if t5 is None else sig(t5), None if t6 is None else sig(t6), None if t7 is None else sig(t7),
                None if t8 is None else sig(t8))
    except _SIGNATURE_ERRORS:
        return None


def known_call(cache: dict, key: Optional[tuple], out, inputs):
    """The record :func:`remember` kept for a call signature ``key`` (:func:`call_key`), its out
    compared with ``inputs``' addresses ((name, tensor or None) pairs, read only when out is given)
    against the byte spans kept with it; None for a signature not seen (its checks are to run)."""
    known = cache.get(key) if key is not None else None
    if known is not None and known[1] is not None:
        check_out_apart(out, inputs, known[1])
    return known


def remember(cache: dict, limit: int, key: Optional[tuple], dims, out, inputs, then: Callable) -> tuple:
    """(dims, spans, then(dims)) of a call whose argument checks just passed with ``dims``: out
    kept apart from ``inputs`` (its byte spans and theirs kept), then ``then(dims)`` (the device
    check, or the plan and schedule a signature fixes); kept in ``cache`` under ``key`` (cleared
    past ``limit`` entries), so that the signature's next calls pay :func:`known_call` alone."""
    known = dims, _out_spans(out, inputs), then(dims)
    if key is not None:
        if len(cache) >= limit:
            cache.clear()
        cache[key] = known
    return known


def _out_spans(out, inputs):
    """None without out; else the byte spans of out and of the inputs (they follow from the
    signature, so a known signature only compares addresses), this call's out checked apart from
    the inputs."""
    if out is None:
        return None
    spans = span_bytes(out), tuple(None if t is None else span_bytes(t) for _, t in inputs)
    check_out_apart(out, inputs, spans)
    return spans


def require_cuda(q) -> None:
    """The device check, after every argument check: the kernels run on a CUDA GPU."""
    if q.device.type != "cuda":
        raise UnsupportedDeviceError(f"q: cute-mla kernels run on a CUDA GPU (SM90 or SM100); got tensors on {q.device}")
