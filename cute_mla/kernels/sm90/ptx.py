"""Inline-PTX / raw-pointer helpers of the SM90 sparse decode kernel: the gather's global loads and
L2 prefetches, the prefill kernel's cp.async gather, the cluster transport (mapa, bulk shared ->
distributed-shared copies, cluster-scope
mbarrier ops) and stmatrix. Shared helpers are in ``cute_mla.dsl.ptx``.

Everything here is a plain Python function that emits IR when called from a ``@cute.kernel``
(the DSL inlines it at trace time).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from ...dsl.ptx import vec_i32_type
from .config import L2_POLICIES


def ld_global_v4(addr: Int64, l1: str = "evict_last", l2: str = "size_256b"):
    """128-bit ``ld.global`` with L1::evict_last and L2::256B prefetch (SASS ``LDG.E.EL.LTC256B.128``).

    The cache rows are re-read by the ``h_q/64`` CTAs of one token and their 256-B L2
    neighbours are usually requested by the sibling threads of the same row; both hints measured
    faster on the gather, ``.nc`` no faster, so it is not used (docs/performance.md).
    ``l1`` / ``l2``: the L1 eviction priority and L2 prefetch size (``cute.arch.load`` literals;
    ``""`` leaves the hint out), ``Sm90Tuning.gather_l1`` / ``gather_l2``.
    """
    return ld_global_vec(addr, 4, l1, l2)


def ld_global_vec(addr: Int64, words: int, l1: str = "evict_last", l2: str = "size_256b"):
    """``words`` x 32-bit ``ld.global`` (2 or 4; ``addr`` aligned to the load's size) with the
    hints of :func:`ld_global_v4`."""
    p = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4 * words)
    return cute.arch.load(
        p,
        vec_i32_type(words),
        level1_eviction_priority=l1 or None,
        level_prefetch_size=l2 or None,
    )


def prefetch_l2_line(addr: Int64) -> None:
    """``prefetch.global.L2 [addr]``: the L2 line holding ``addr``. A per-thread instruction (SASS
    ``CCTL``), unlike ``cp.async.bulk.prefetch.L2``, whose operands are uniform registers, so a warp
    with different addresses per lane runs it in a loop over the distinct addresses (one pass per
    lane), which the per-thread form does not pay."""
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
    writes that wait on it. The release compiles to MEMBAR.ALL.GPU before the arrive, which waits
    for every memory operation the thread has in flight."""
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


def cp_async_16(dst: Int32, src: Int64, src_bytes, l2: str = "") -> None:
    """``cp.async.cg.shared.global`` of 16 B from ``src`` to the shared address ``dst``; only the
    first ``src_bytes`` (16 or 0) are read, the rest zero-filled (an invalid row: nothing is read,
    its slot holds zeros, so a NaN row can never reach an MMA). ``l2``: an L2 prefetch-size
    qualifier (``"L2::256B"``) or ``""``."""
    hint = f".{l2}" if l2 else ""
    llvm.inline_asm(
        None,
        [Int32(dst).ir_value(), Int64(src).ir_value(), Int32(src_bytes).ir_value()],
        f"cp.async.cg.shared.global{hint} [$0], [$1], 16, $2;",
        "r,l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def l2_policy(kind: str) -> Int64:
    """``createpolicy.fractional`` over every address (fraction 1.0): the 64-bit L2 cache policy a
    ``.L2::cache_hint`` access carries, ``kind`` one of :data:`~.config.L2_POLICIES`."""
    assert kind in L2_POLICIES, kind
    return Int64(llvm.inline_asm(
        T.i64(),
        [],
        f"createpolicy.fractional.L2::{kind}.b64 $0, 1.0;",
        "=l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


def cp_async_arrive_noinc(mbar: Int32) -> None:
    """``cp.async.mbarrier.arrive.noinc.shared::cta.b64``: an arrive on ``mbar`` once every
    ``cp.async`` this thread issued before has landed (counted in the barrier's expected arrivals)."""
    llvm.inline_asm(
        None,
        [Int32(mbar).ir_value()],
        "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];",
        "r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def stmatrix_trans(addr: Int32, regs) -> None:
    """``stmatrix.sync.aligned.m8n8.x{1,2,4}.trans.shared.b16``: ``len(regs)`` 8x8 bf16 matrices,
    warp-wide, each stored transposed. Register i of lane l holds its fragment of matrix i (row
    l // 4, columns 2 (l % 4) and + 1: the MMA accumulator's fragment of an 8x8 block); lane l
    gives the shared address of memory row l % 8 of matrix l // 8 (lanes 0-7 for x1, 0-15 for
    x2), which receives the fragment's *column* l % 8 (8 contiguous bf16, 16 B). An accumulator
    block of 8 rows x 8 columns lands as 8 columns x 8 rows: the swapped MMA's S^T / O^T
    fragments leave as P^T / O rows (heads) this way."""
    n = len(regs)
    assert n in (1, 2, 4)
    operands = ", ".join(f"${i + 1}" for i in range(n))
    llvm.inline_asm(
        None,
        [Int32(addr).ir_value()] + [Int32(r).ir_value() for r in regs],
        f"stmatrix.sync.aligned.m8n8.x{n}.trans.shared.b16 [$0], {{{operands}}};",
        ",".join(["r"] * (n + 1)),
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
