"""The sparse prefill kernels' compiled entry, one for every arch: its tensor parameters (fields of
:class:`~cute_mla.kernels.SparsePrefillTensors`, in order) and the fake tensors a compile traces
them with (symbolic sizes and strides, so one compile serves every shape and needs no GPU).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from . import SparsePrefillTensors, entry_getter, fake_entry

ENTRY = ("q", "kv", "indices", "topk_length", "attn_sink", "out", "max_logits", "lse")
entry_of = entry_getter(ENTRY, SparsePrefillTensors)
# a bound launch (a kernel module's ``bind``) takes the entry's tensors then the scale: the bundle's fields
assert SparsePrefillTensors._fields == ENTRY + ("softmax_scale",), "the entry's tensors are the bundle's, in order"


def fake_tensors(h_q: int, d_qk: int, d_v: int, has_topk_length: bool, has_attn_sink: bool) -> list:
    """The entry's fake tensors in ``ENTRY`` order (None for an optional input the config does not
    take): q, out and kv with any 16-B strides and a unit last dim, indices with any row stride;
    kv and indices keep the call's unit head dim (any stride), so a call passes them unsqueezed."""
    rt = cute.runtime
    s_q, s_kv = cute.sym_int(), cute.sym_int()
    topk = cute.sym_int(divisibility=64)

    def s64(div):
        return cute.sym_int64(divisibility=div)

    f = {}
    f["q"] = rt.make_fake_tensor(BFloat16, (s_q, h_q, d_qk), stride=(s64(8), s64(8), 1), assumed_align=16)
    f["kv"] = rt.make_fake_tensor(BFloat16, (s_kv, 1, d_qk), stride=(s64(8), s64(1), 1), assumed_align=16)
    f["indices"] = rt.make_fake_tensor(Int32, (s_q, 1, topk), stride=(s64(1), s64(1), 1), assumed_align=4)
    if has_topk_length:
        f["topk_length"] = rt.make_fake_compact_tensor(Int32, (s_q,), assumed_align=4)
    if has_attn_sink:
        f["attn_sink"] = rt.make_fake_compact_tensor(Float32, (h_q,), assumed_align=4)
    f["out"] = rt.make_fake_tensor(BFloat16, (s_q, h_q, d_v), stride=(s64(8), s64(8), 1), assumed_align=16)
    f["max_logits"] = rt.make_fake_compact_tensor(Float32, (s_q, h_q), stride_order=(1, 0), assumed_align=4)
    f["lse"] = rt.make_fake_compact_tensor(Float32, (s_q, h_q), stride_order=(1, 0), assumed_align=4)
    return fake_entry(ENTRY, f)


def without_head_dim(t: cute.Tensor) -> cute.Tensor:
    """kv (s_kv, 1, d_qk) or indices (s_q, 1, topk) as the kernels index them: (rows, cols), the
    unit head dim dropped (its stride is never stepped)."""
    return cute.make_tensor(t.iterator, cute.make_layout((t.shape[0], t.shape[2]), stride=(t.stride[0], t.stride[2])))


def fake_stream():
    """The launch stream of a compile: torch's current stream through TVM-FFI's environment."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
