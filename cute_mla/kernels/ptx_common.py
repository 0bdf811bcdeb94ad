"""Small PTX-level helpers both architectures' kernels use (shared-memory vector stores, vector
element access, fp32 -> bf16x2 packing). Arch-specific helpers stay in ``sm90/ptx.py`` and
``sm100/ptx.py``, which re-export these."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import T


def vec_i32_type(n: int):
    return ir.VectorType.get([n], T.i32())


def st_shared_v4(addr: Int32, w0, w1, w2, w3) -> None:
    """``st.shared.v4.b32`` of four i32 values at a 16-B aligned shared address."""
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=16)
    vals = [Int32(w).ir_value() for w in (w0, w1, w2, w3)]
    cute.arch.store(p, vector.from_elements(vec_i32_type(4), vals))


def vec_elem(v, i: int) -> Int32:
    """Element ``i`` (compile-time) of an i32 vector as a DSL ``Int32``."""
    return Int32(vector.extract(v, [], [i]))


def pack_bf16x2(lo: Float32, hi: Float32) -> Int32:
    """``cvt.rn.bf16x2.f32``: ``lo`` in the low half (the lower address once stored), ``hi`` above."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(hi).ir_value(), Float32(lo).ir_value()],
            "cvt.rn.bf16x2.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )
