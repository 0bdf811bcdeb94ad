"""PTX-level helpers both architectures' kernels use: shared-memory loads and stores by address,
vector element access, predicated selects, bf16x2 packing and the e4m3 -> bf16 conversions the
cache formats' dequant routines are built from.

Everything here is a plain Python function that emits IR when a kernel calls it at trace time.
Arch-specific helpers live in ``kernels/sm90/ptx.py`` and ``kernels/sm100/ptx.py``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import T

# 2^120 as fp32 bits: the e4m3 bit trick below produces value * 2^-120 (e4m3 bias 7 read with the
# bf16 bias 127), so a power-of-two scale is pre-multiplied by 2^120 once.
_TWO_POW_120_F32_HEX = "0f7B800000"


def vec_i32_type(n: int):
    return ir.VectorType.get([n], T.i32())


def _asm(result_type, operands, text: str, constraints: str, side_effects: bool = False):
    return llvm.inline_asm(result_type, operands, text, constraints, has_side_effects=side_effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


# ------------------------------------------------------------------------------ shared memory


def st_shared_v4(addr: Int32, w0, w1, w2, w3) -> None:
    """``st.shared.v4.b32`` of four i32 values at a 16-B aligned shared address."""
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=16)
    vals = [Int32(w).ir_value() for w in (w0, w1, w2, w3)]
    cute.arch.store(p, vector.from_elements(vec_i32_type(4), vals))


def ld_shared_v4(addr: Int32):
    """``ld.shared.v4.b32`` at a 16-B aligned shared address (elements via :func:`vec_elem`)."""
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=16)
    return cute.arch.load(p, vec_i32_type(4))


def ld_shared_i32(addr: Int32) -> Int32:
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=4)
    return cute.arch.load(p, Int32)


def st_shared_i32(addr: Int32, value) -> None:
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=4)
    cute.arch.store(p, Int32(value))


# ------------------------------------------------------------------------------ values


def vec_elem(v, i: int) -> Int32:
    """Element ``i`` (compile-time) of an i32 vector as a DSL ``Int32``."""
    return Int32(vector.extract(v, [], [i]))


def select_i32(pred, a, b) -> Int32:
    return Int32(cutlass.select_(pred, Int32(a), Int32(b)))


def divisor_magic(d):
    """(magic, shift) with ``(n * magic) >> shift == n // d`` for every n in [0, 2^31), d in
    [1, 2^31): shift = 31 + ceil(log2 d), magic = ceil(2^shift / d) (Granlund and Montgomery's
    round-up method for 31-bit dividends; magic < 2^32, or 2^31 for d = 1). One 64-bit division:
    made once per divisor, where the kernel starts, for :func:`divide_by_magic` to use per row."""
    shift = Int32(63) - Int32(cute.arch.clz(Uint32(d) - Uint32(1)))
    magic = ((cutlass.Uint64(1) << cutlass.Uint64(shift)) + cutlass.Uint64(d) - cutlass.Uint64(1)) // cutlass.Uint64(d)
    return Int32(magic), shift


def divide_by_magic(n, magic, shift) -> Uint32:
    """n // d for n in [0, 2^31), with d's :func:`divisor_magic`: a wide multiply and a shift in
    place of the ~18-instruction division by a value unknown at compile time."""
    return Uint32((cutlass.Uint64(Uint32(n)) * cutlass.Uint64(Uint32(magic))) >> cutlass.Uint64(shift))


def pack_bf16x2(lo: Float32, hi: Float32) -> Int32:
    """``cvt.rn.bf16x2.f32``: ``lo`` in the low half (the lower address once stored), ``hi`` above."""
    return Int32(_asm(T.i32(), [Float32(hi).ir_value(), Float32(lo).ir_value()], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"))


# ------------------------------------------------------------------------------ e4m3 -> bf16


def is_pow2_scale(scale_bits: Int32):
    """An fp32 scale (its bits) that is a power of two (or zero) below 2^8: the bit-trick
    conversion is exact for it."""
    return ((scale_bits & 0x007FFFFF) == 0) & (((scale_bits >> 23) & 0xFF) <= 127 + 7)


def ue8m0_to_f32_bits(word: Int32, byte: int) -> Int32:
    """The fp32 bits of the ue8m0 scale in byte ``byte`` (compile-time) of ``word``: 2^(e - 127),
    the denormal 0x00400000 for e = 0."""
    e = (Int32(word) >> (8 * byte)) & 0xFF
    return select_i32(e == 0, 0x00400000, e << 23)


def ue8m0_takes_fast_path(word: Int32, byte: int):
    """Whether the ue8m0 scale in byte ``byte`` of ``word`` is one :func:`is_pow2_scale` accepts
    (2^-126 .. 2^7: 1 <= e <= 127 + 7)."""
    e = (Int32(word) >> (8 * byte)) & 0xFF
    return Uint32(e - 1) < Uint32(127 + 7)


def ue8m0_pow2_multiplier(word: Int32, byte: int) -> Int32:
    """:func:`pow2_scale_multiplier` of the ue8m0 scale in byte ``byte`` of ``word``, from its
    exponent: bf16x2(2^(e - 127) * 2^120) = the bf16 exponent field e + 120 in both halves (e as
    :func:`ue8m0_takes_fast_path` accepts)."""
    # prmt puts byte e in the low byte of both 16-bit lanes (zeros above); one multiply-add then
    # makes (e + 120) << 7 in each lane ((134 + 120) << 7 < 2^16: no carry into the upper lane).
    sel = byte | (4 << 4) | (byte << 8) | (4 << 12)
    e2 = Int32(_asm(T.i32(), [Int32(word).ir_value()], f"prmt.b32 $0, $1, 0, {sel:#x};", "=r,r"))
    return e2 * 128 + ((120 << 7) | (120 << 23))


def pow2_scale_multiplier(scale_bits: Int32) -> Int32:
    """bf16x2(scale * 2^120) from the fp32 bits of a scale (both halves equal): the multiplier of
    :func:`fp8x4_to_bf16x4_pow2`, exact for the scales :func:`is_pow2_scale` accepts."""
    return Int32(_asm(
        T.i32(), [Int32(scale_bits).ir_value()],
        "{\n.reg .f32 f;\nmov.b32 f, $1;\nmul.f32 f, f, " + _TWO_POW_120_F32_HEX + ";\n"
        "cvt.rn.bf16x2.f32 $0, f, f;\n}",
        "=r,r"))


def _fp8x2_to_bf16x2_pow2(word: Int32, multiplier: Int32, selector: str) -> Int32:
    # prmt puts each selected byte in a 16-bit lane with the sign replicated into the upper byte,
    # shl 4 + and 0x87F087F0 keeps sign / 4 exponent bits / 3 mantissa bits at their bf16
    # positions (a bf16 of value fp8 * 2^-120, subnormals included, never NaN/Inf), and the bf16x2
    # multiply applies scale * 2^120. 4 SASS ops per pair against 6 for the cvt path; exact
    # (bit-identical to bf16(float(fp8) * scale)) when the scale is a power of two.
    return Int32(_asm(
        T.i32(), [Int32(word).ir_value(), Int32(multiplier).ir_value()],
        "{\n.reg .b32 t;\nprmt.b32 t, $1, $1, " + selector + ";\nshl.b32 t, t, 4;\n"
        "and.b32 t, t, 0x87F087F0;\nmul.rn.bf16x2 $0, t, $2;\n}",
        "=r,r,r"))


def fp8x4_to_bf16x4_pow2(word: Int32, multiplier: Int32):
    """Four e4m3 values (one i32) -> two bf16x2 words (low pair, high pair) times a power-of-two
    scale given as :func:`pow2_scale_multiplier`."""
    return (_fp8x2_to_bf16x2_pow2(word, multiplier, "0x9180"), _fp8x2_to_bf16x2_pow2(word, multiplier, "0xB3A2"))


def _fp8x2_to_bf16x2_exact(word: Int32, scale_bits: Int32, half: str) -> Int32:
    # e4m3x2 -> f16x2 (exact) -> 2 x f32 (exact) -> fp32 multiply (RN) -> bf16x2 (RNE): the very
    # operations of torch's float(fp8) * scale then .to(bfloat16), so any fp32 scale gives
    # bit-identical keys. 6 SASS ops per pair; mul.rn keeps ptxas from fusing.
    return Int32(_asm(
        T.i32(), [Int32(word).ir_value(), Int32(scale_bits).ir_value()],
        "{\n.reg .b16 l, h, h0, h1;\n.reg .b32 p;\n.reg .f32 f0, f1, s;\n"
        "mov.b32 {l, h}, $1;\ncvt.rn.f16x2.e4m3x2 p, " + half + ";\nmov.b32 {h0, h1}, p;\n"
        "cvt.f32.f16 f0, h0;\ncvt.f32.f16 f1, h1;\nmov.b32 s, $2;\n"
        "mul.rn.f32 f0, f0, s;\nmul.rn.f32 f1, f1, s;\ncvt.rn.bf16x2.f32 $0, f1, f0;\n}",
        "=r,r,r"))


def fp8x4_to_bf16x4_exact(word: Int32, scale_bits: Int32):
    """Four e4m3 values (one i32, lowest byte first) -> two bf16x2 words times any fp32 scale
    (given as its bits); element 0 lands in the low half of the first word."""
    return _fp8x2_to_bf16x2_exact(word, scale_bits, "l"), _fp8x2_to_bf16x2_exact(word, scale_bits, "h")
