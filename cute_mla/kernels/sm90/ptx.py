"""Small inline-PTX / raw-pointer helpers of the SM90 sparse decode producer.

Everything here is a plain Python function that emits IR when called from a ``@cute.kernel``
(the DSL inlines it at trace time). Numbers and the reasons for each trick are in
``shared/reference/sm90-building-blocks.md`` §1-§2 (measured on an H200).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import T

# 2^120 as fp32 bits: the FP8 bit trick below produces value * 2^-120 (e4m3 bias 7 read with the
# bf16 bias 127), so the per-128-value scale is pre-multiplied by 2^120 once.
_TWO_POW_120_F32_HEX = "0f7B800000"


def _vec4_i32_type():
    return ir.VectorType.get([4], T.i32())


def ld_global_v4(addr: Int64):
    """128-bit ``ld.global`` with L1::evict_last and L2::256B prefetch (SASS ``LDG.E.EL.LTC256B.128``).

    The 656-byte cache rows are re-read by the ``h_q/64`` CTAs of one token and their 256-B L2
    neighbours are usually requested by the sibling threads of the same row; both hints were
    measured to help in the gather micro-benchmark (§1.3). ``.nc`` was not faster, so it is not used.
    """
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=16)
    return cute.arch.load(
        p,
        _vec4_i32_type(),
        level1_eviction_priority="evict_last",
        level_prefetch_size="size_256b",
    )


def ld_shared_v2(addr: Int32):
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=8)
    return cute.arch.load(p, ir.VectorType.get([2], T.i32()))


def st_shared_v4(addr: Int32, w0, w1, w2, w3) -> None:
    """``st.shared.v4.b32`` of four i32 values at a 16-B aligned shared address."""
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=16)
    vals = [Int32(w).ir_value() for w in (w0, w1, w2, w3)]
    cute.arch.store(p, vector.from_elements(_vec4_i32_type(), vals))


def vec_elem(v, i: int) -> Int32:
    """Element ``i`` (compile-time) of an i32 vector as a DSL ``Int32``."""
    return Int32(vector.extract(v, [], [i]))


def scale_hi_lo_bf16x2(scale_bits: Int32):
    """(hi, lo) bf16x2 pair with hi + lo = scale * 2^120 to ~16 bits (both halves of each equal).

    hi = bf16(scale * 2^120) and lo = bf16(scale * 2^120 - hi). Multiplying by hi alone is
    FlashMLA's SM90 numerics (scale rounded to bf16): exact for power-of-two scales, but a
    non-power-of-two scale then carries up to 2^-9 relative error into every key and value of its
    128-wide group, which costs about 3x in output cosine error against an fp32 dequantization
    (measured 6e-6 vs 2e-6, over the 5e-6 tolerance). With fma(x, hi, x*lo) the key is
    bf16(fp8 * scale) to within double rounding, for one extra bf16x2 op per pair.
    Scales >= 2^8 overflow the bf16 range after the 2^120 bias and are not supported.
    """
    hi = Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(scale_bits).ir_value()],
            "{\n.reg .f32 f;\nmov.b32 f, $1;\nmul.f32 f, f, " + _TWO_POW_120_F32_HEX + ";\n"
            "cvt.rn.bf16x2.f32 $0, f, f;\n}",
            "=r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )
    lo = Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(scale_bits).ir_value(), hi.ir_value()],
            "{\n.reg .f32 f, h;\n.reg .b32 hb;\nmov.b32 f, $1;\nmul.f32 f, f, " + _TWO_POW_120_F32_HEX + ";\n"
            "shl.b32 hb, $2, 16;\nmov.b32 h, hb;\nsub.f32 f, f, h;\ncvt.rn.bf16x2.f32 $0, f, f;\n}",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )
    return hi, lo


def _fp8x2_to_bf16x2_scaled(word: Int32, s_hi: Int32, s_lo: Int32, selector: str) -> Int32:
    # prmt puts each selected byte in a 16-bit lane with the sign replicated into the upper byte,
    # shl 4 + and 0x87F087F0 keeps sign / 4 exponent bits / 3 mantissa bits at their bf16
    # positions (a bf16 of value fp8 * 2^-120, subnormals included, never NaN/Inf); then
    # fma(x, hi, x * lo) applies scale * 2^120 with one final rounding. 5 SASS ops per pair
    # (the cvt path needs 6, see sm90-building-blocks.md §2.3).
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(word).ir_value(), Int32(s_hi).ir_value(), Int32(s_lo).ir_value()],
            "{\n.reg .b32 t, p;\nprmt.b32 t, $1, $1, " + selector + ";\nshl.b32 t, t, 4;\n"
            "and.b32 t, t, 0x87F087F0;\nmul.rn.bf16x2 p, t, $3;\nfma.rn.bf16x2 $0, t, $2, p;\n}",
            "=r,r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def fp8x4_to_bf16x4_scaled(word: Int32, s_hi: Int32, s_lo: Int32):
    """Four e4m3 values (one i32) -> two bf16x2 words (low pair, high pair), times the scale."""
    return (
        _fp8x2_to_bf16x2_scaled(word, s_hi, s_lo, "0x9180"),
        _fp8x2_to_bf16x2_scaled(word, s_hi, s_lo, "0xB3A2"),
    )


def bf16x2_pack(lo: Float32, hi: Float32) -> Int32:
    """``cvt.rn.bf16x2.f32``: lo goes to the low half (lower address), hi to the upper half."""
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


def select_i32(pred, a, b) -> Int32:
    return Int32(cutlass.select_(pred, Int32(a), Int32(b)))
