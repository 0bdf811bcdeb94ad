"""Small shared-memory / bit-cast helpers of the SM100 sparse decode kernel (shared ones, and the
e4m3 conversions the format's dequant routine uses, are in ``cute_mla.dsl.ptx``).

Each function is plain Python that emits IR when called from a ``@cute.kernel`` (the DSL inlines it
at trace time). Addresses are raw 32-bit shared-memory byte addresses: the swizzled tiles are
written with the swizzle formula spelled out next to each call site, which is the same mapping as
the CuTe layouts the MMAs read (the compile test checks the layouts, the GPU test the values).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from ...dsl.ptx import (  # noqa: F401  (shared helpers)
    ld_shared_i32,
    ld_shared_v4,
    pack_bf16x2,
    select_i32,
    st_shared_i32,
    st_shared_v4,
    vec_elem,
    vec_i32_type,
)


def smem_addr(ptr) -> Int32:
    """The 32-bit shared-memory byte address of a smem pointer."""
    return Int32(ptr.toint())


def f32_bits(x: Float32) -> Int32:
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value()))


def ld_global_v2(addr: Int64):
    """``ld.global.v2.b32`` at an 8-B aligned global address (elements via :func:`vec_elem`): one
    V4 scale row (7 ue8m0 bytes and a pad byte)."""
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=8)
    return cute.arch.load(p, vec_i32_type(2))
