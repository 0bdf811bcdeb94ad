"""Small inline-PTX / raw-pointer helpers of the SM90 sparse decode producer.

Everything here is a plain Python function that emits IR when called from a ``@cute.kernel``
(the DSL inlines it at trace time). Numbers and the reasons for each trick are in
``shared/reference/sm90-building-blocks.md`` §1-§2 (measured on an H200).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import T

from ..ptx_common import pack_bf16x2 as bf16x2_pack, st_shared_v4, vec_elem  # noqa: F401  (shared helpers)

# 2^120 as fp32 bits: the FP8 bit trick below produces value * 2^-120 (e4m3 bias 7 read with the
# bf16 bias 127), so the per-128-value scale is pre-multiplied by 2^120 once.
_TWO_POW_120_F32_HEX = "0f7B800000"


def _vec4_i32_type():
    return ir.VectorType.get([4], T.i32())


def ld_global_v4(addr: Int64, l1: str = "evict_last", l2: str = "size_256b"):
    """128-bit ``ld.global`` with L1::evict_last and L2::256B prefetch (SASS ``LDG.E.EL.LTC256B.128``).

    The 656-byte cache rows are re-read by the ``h_q/64`` CTAs of one token and their 256-B L2
    neighbours are usually requested by the sibling threads of the same row; both hints were
    measured to help in the gather micro-benchmark (§1.3). ``.nc`` was not faster, so it is not used.
    ``l1`` / ``l2``: the L1 eviction priority and L2 prefetch size (``cute.arch.load`` literals;
    ``""`` leaves the hint out), a :class:`Tuning` knob.
    """
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=16)
    return cute.arch.load(
        p,
        _vec4_i32_type(),
        level1_eviction_priority=l1 or None,
        level_prefetch_size=l2 or None,
    )


def l2_policy(priority: str) -> Int64:
    """``createpolicy.fractional.L2::<priority>.b64`` (fraction 1.0): a cache policy for the
    ``.L2::cache_hint`` forms below and for TMA copies' ``cache_policy`` (``evict_first`` /
    ``evict_last``)."""
    assert priority in ("evict_first", "evict_last", "evict_normal")
    return Int64(
        llvm.inline_asm(
            T.i64(),
            [],
            f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;",
            "=l",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def ld_global_v4_policy(addr: Int64, policy: Int64, l1: str = "evict_last", l2: str = "size_256b"):
    """:func:`ld_global_v4` with an L2 cache policy (``.L2::cache_hint``); same vector result."""
    l1_q = f".L1::{l1}" if l1 else ""
    l2_q = {"": "", "size_64b": ".L2::64B", "size_128b": ".L2::128B", "size_256b": ".L2::256B"}[l2]
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int64(addr).ir_value(), Int64(policy).ir_value()],
        f"ld.global{l1_q}.L2::cache_hint{l2_q}.v4.b32 {{$0, $1, $2, $3}}, [$4], $5;",
        "=r,=r,=r,=r,l,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    elems = [llvm.extractvalue(T.i32(), res, [i]) for i in range(4)]
    return vector.from_elements(_vec4_i32_type(), elems)


def prefetch_l2_bulk_policy(addr: Int64, size: int, policy: Int64) -> None:
    """:func:`prefetch_l2_bulk` with an L2 cache policy."""
    assert size % 16 == 0 and size > 0
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(), Int64(policy).ir_value()],
        f"cp.async.bulk.prefetch.L2.global.L2::cache_hint [$0], {size}, $1;",
        "l,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def prefetch_l2_bulk(addr: Int64, size: int) -> None:
    """``cp.async.bulk.prefetch.L2.global [addr], size``: pull ``size`` bytes (a multiple of 16, 16-B
    aligned address) into L2 through the TMA unit; no registers, no L1 line, no completion to wait on."""
    assert size % 16 == 0 and size > 0
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value()],
        f"cp.async.bulk.prefetch.L2.global [$0], {size};",
        "l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def prefetch_l2_line(addr: Int64) -> None:
    """``prefetch.global.L2 [addr]``: the L2 line holding ``addr``. A per-thread instruction (SASS
    ``CCTL``), unlike :func:`prefetch_l2_bulk`, whose operands are uniform registers, so a warp with
    different addresses per lane runs it in a loop over the distinct addresses (one pass per lane:
    ncu measured that loop at ~13 % of the producer's time)."""
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value()],
        "prefetch.global.L2 [$0];",
        "l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def mapa_shared_cluster(addr: Int32, rank) -> Int32:
    """``mapa.shared::cluster.u32``: the shared::cluster address of CTA ``rank``'s copy of the
    local shared address ``addr`` (a 32-bit window address, usable by bulk copies / remote mbarrier ops)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(addr).ir_value(), Int32(rank).ir_value()],
            "mapa.shared::cluster.u32 $0, $1, $2;",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def bulk_copy_to_peer(dst: Int32, src: Int32, size: int, rmbar: Int32) -> None:
    """``cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes``: ``size`` bytes
    (multiple of 16) of this CTA's shared memory at ``src`` into a peer CTA's at cluster address
    ``dst`` by the TMA unit; the peer's mbarrier at cluster address ``rmbar`` gets the
    complete_tx. The source must be visible to the async proxy (``fence.proxy.async`` after the
    ``st.shared`` that wrote it)."""
    assert size % 16 == 0
    llvm.inline_asm(
        None,
        [Int32(dst).ir_value(), Int32(src).ir_value(), Int32(rmbar).ir_value()],
        f"cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [$0], [$1], {size}, [$2];",
        "r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def mbarrier_arrive_remote(rmbar: Int32) -> None:
    """``mbarrier.arrive.release.cluster.shared::cluster.b64`` on a peer CTA's mbarrier (cluster
    address): release at cluster scope, so what this thread did before (its CTA's consumers freed
    a buffer, which this thread observed through an mbarrier wait) is ordered before the peer's
    writes that wait on it."""
    llvm.inline_asm(
        None,
        [Int32(rmbar).ir_value()],
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [$0];",
        "r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def mbarrier_wait_acquire_cluster(mbar: Int32, parity) -> None:
    """Spin on ``mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64`` until the phase with
    ``parity`` completed: acquire at cluster scope (the arrive came from the peer CTA)."""
    llvm.inline_asm(
        None,
        [Int32(mbar).ir_value(), Int32(parity).ir_value()],
        "{\n.reg .pred p;\nWAIT_${:uid}:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$0], $1;\n"
        "@!p bra WAIT_${:uid};\n}",
        "r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def ld_shared_v2(addr: Int32):
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=8)
    return cute.arch.load(p, ir.VectorType.get([2], T.i32()))


def ld_shared_v4(addr: Int32):
    """``ld.shared.v4.b32`` at a 16-B aligned shared address (elements via :func:`vec_elem`)."""
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=16)
    return cute.arch.load(p, _vec4_i32_type())


def ld_shared_i32(addr: Int32) -> Int32:
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=4)
    return cute.arch.load(p, Int32)


def st_shared_i32(addr: Int32, value) -> None:
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=4)
    cute.arch.store(p, Int32(value))


def scale_to_bf16x2_times_2pow120(scale_bits: Int32) -> Int32:
    """bf16x2(scale * 2^120) from the fp32 bits of a V3.2 scale (both halves equal).

    Used only on the fast path, for power-of-two scales below 2^8, where it is exact.
    """
    return Int32(
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


def _fp8x2_to_bf16x2_pow2(word: Int32, scale2: Int32, selector: str) -> Int32:
    # prmt puts each selected byte in a 16-bit lane with the sign replicated into the upper byte,
    # shl 4 + and 0x87F087F0 keeps sign / 4 exponent bits / 3 mantissa bits at their bf16
    # positions (a bf16 of value fp8 * 2^-120, subnormals included, never NaN/Inf), and the bf16x2
    # multiply applies scale * 2^120. 4 SASS ops per pair vs 6 for the cvt path (§2.3). Exact
    # (bit-identical to bf16(float(fp8) * scale)) when the scale is a power of two.
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(word).ir_value(), Int32(scale2).ir_value()],
            "{\n.reg .b32 t;\nprmt.b32 t, $1, $1, " + selector + ";\nshl.b32 t, t, 4;\n"
            "and.b32 t, t, 0x87F087F0;\nmul.rn.bf16x2 $0, t, $2;\n}",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def fp8x4_to_bf16x4_pow2(word: Int32, scale2: Int32):
    """Four e4m3 values (one i32) -> two bf16x2 words (low pair, high pair) times a power-of-two scale."""
    return (
        _fp8x2_to_bf16x2_pow2(word, scale2, "0x9180"),
        _fp8x2_to_bf16x2_pow2(word, scale2, "0xB3A2"),
    )


def _fp8x2_to_bf16x2_exact(word: Int32, scale_bits: Int32, half: str) -> Int32:
    # e4m3x2 -> f16x2 (exact) -> 2 x f32 (exact) -> fp32 multiply (RN) -> bf16x2 (RNE): the very
    # operations of torch's float(fp8) * scale then .to(bfloat16), so any fp32 scale gives
    # bit-identical keys. 6 SASS ops per pair.
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(word).ir_value(), Int32(scale_bits).ir_value()],
            "{\n.reg .b16 l, h, h0, h1;\n.reg .b32 p;\n.reg .f32 f0, f1, s;\n"
            "mov.b32 {l, h}, $1;\ncvt.rn.f16x2.e4m3x2 p, " + half + ";\nmov.b32 {h0, h1}, p;\n"
            "cvt.f32.f16 f0, h0;\ncvt.f32.f16 f1, h1;\nmov.b32 s, $2;\n"
            "mul.rn.f32 f0, f0, s;\nmul.rn.f32 f1, f1, s;\ncvt.rn.bf16x2.f32 $0, f1, f0;\n}",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def fp8x4_to_bf16x4_exact(word: Int32, scale_bits: Int32):
    """Four e4m3 values (one i32) -> two bf16x2 words times any fp32 scale (given as its bits)."""
    return _fp8x2_to_bf16x2_exact(word, scale_bits, "l"), _fp8x2_to_bf16x2_exact(word, scale_bits, "h")


def is_fast_scale(scale_bits: Int32):
    """Power of two (or zero) below 2^8: the bit-trick path is exact for it."""
    return ((scale_bits & 0x007FFFFF) == 0) & (((scale_bits >> 23) & 0xFF) <= 127 + 7)


def select_i32(pred, a, b) -> Int32:
    return Int32(cutlass.select_(pred, Int32(a), Int32(b)))


def stmatrix_x4(addr: Int32, r0, r1, r2, r3) -> None:
    """``stmatrix.sync.aligned.m8n8.x4.shared.b16``: four 8x8 bf16 matrices, warp-wide. Lane l gives
    the shared address of row l % 8 of matrix l // 8 (16 contiguous bytes) and, in ``r<i>``, its
    own two elements of matrix i (row l // 4, columns 2 (l % 4) and + 1: the MMA accumulator's
    fragment of an 8x8 block, the lower column in the low half)."""
    llvm.inline_asm(
        None,
        [Int32(addr).ir_value()] + [Int32(r).ir_value() for r in (r0, r1, r2, r3)],
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
