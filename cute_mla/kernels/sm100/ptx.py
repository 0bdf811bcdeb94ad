"""Small shared-memory / conversion helpers of the SM100 sparse decode kernel.

Each function is plain Python that emits IR when called from a ``@cute.kernel`` (the DSL inlines it
at trace time). Addresses are raw 32-bit shared-memory byte addresses: the swizzled tiles are
written with the swizzle formula spelled out next to each call site, which is the same mapping as
the CuTe layouts the MMAs read (the compile test checks the layouts, the GPU test the values).
"""

from __future__ import annotations

from cutlass import Float32, Int32
import cutlass.cute as cute
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from ..ptx_common import pack_bf16x2, st_shared_v4, vec_elem  # noqa: F401  (shared helpers)


def _vec_i32(n: int):
    return ir.VectorType.get([n], T.i32())


def smem_addr(ptr) -> Int32:
    """The 32-bit shared-memory byte address of a smem pointer."""
    return Int32(ptr.toint())


def ld_shared_v4(addr: Int32):
    """``ld.shared.v4.b32`` at a 16-B aligned address; returns an MLIR vector<4xi32>."""
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=16)
    return cute.arch.load(p, _vec_i32(4))


def ld_shared_b32(addr: Int32) -> Int32:
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=4)
    return Int32(cute.arch.load(p, Int32))


def f32_bits(x: Float32) -> Int32:
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value()))


def bits_f32(x: Int32) -> Float32:
    return Float32(llvm.bitcast(T.f32(), Int32(x).ir_value()))


def fp8x4_to_bf16x4_scaled(word: Int32, scale: Float32):
    """Four e4m3 bytes (little-endian in ``word``) -> two bf16x2 words of ``bf16(fp8 * scale)``.

    e4m3 -> f16 is exact (``cvt.rn.f16x2.e4m3x2``), f16 -> f32 is exact, the product is one fp32
    multiply with the FULL fp32 scale (round to nearest), and the single rounding to bf16 is
    ``cvt.rn.bf16x2.f32``. That is bit-for-bit ``(fp8.float() * scale).bfloat16()``, the reference
    dequantization: no power-of-two truncation of the scale (FlashMLA's SM100 ue8m0 bug) and no
    bf16 rounding of the scale (FlashMLA's SM90 numerics). ``mul.rn`` keeps ptxas from fusing.
    Element 0 (lowest byte) lands in the low half of the first result word.
    """
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]),
        [Int32(word).ir_value(), Float32(scale).ir_value()],
        "{\n\t"
        ".reg .b16 lo, hi, a0, a1, a2, a3;\n\t"
        ".reg .b32 h0, h1;\n\t"
        ".reg .f32 f0, f1, f2, f3;\n\t"
        "mov.b32 {lo, hi}, $2;\n\t"
        "cvt.rn.f16x2.e4m3x2 h0, lo;\n\t"
        "cvt.rn.f16x2.e4m3x2 h1, hi;\n\t"
        "mov.b32 {a0, a1}, h0;\n\t"
        "mov.b32 {a2, a3}, h1;\n\t"
        "cvt.f32.f16 f0, a0;\n\t"
        "cvt.f32.f16 f1, a1;\n\t"
        "cvt.f32.f16 f2, a2;\n\t"
        "cvt.f32.f16 f3, a3;\n\t"
        "mul.rn.f32 f0, f0, $3;\n\t"
        "mul.rn.f32 f1, f1, $3;\n\t"
        "mul.rn.f32 f2, f2, $3;\n\t"
        "mul.rn.f32 f3, f3, $3;\n\t"
        "cvt.rn.bf16x2.f32 $0, f1, f0;\n\t"
        "cvt.rn.bf16x2.f32 $1, f3, f2;\n\t"
        "}\n",
        "=r,=r,r,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(llvm.extractvalue(T.i32(), res, [0])), Int32(llvm.extractvalue(T.i32(), res, [1]))


