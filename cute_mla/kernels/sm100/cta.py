"""The CTA both SM100 kernels are built on: the decode kernel's MMA side, which the prefill kernel
runs on gathered bf16 rows instead of dequantized ones. Here are the tiled MMAs and the layouts of
their shared-memory operands, the byte formulas the warps write P and the output staging with, the
shared-memory struct's layout, the tensor-memory hand-over between the MMA warp and the softmax
warpgroup, and the TMA view of a (..., heads, dims) tensor.

Each function emits IR where it is called (the DSL inlines it at trace time): a kernel that calls
them compiles as if their bodies were written at the call.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import tcgen05

from ...dsl.compat import (OperandMajorMode, TmemAllocator, tcgen05_fence_after_thread_sync,
                           tcgen05_fence_before_thread_sync)
from . import ptx
from .config import TILE, TMEM, Bar, WarpSchedule

# Bar.TMEM's threads: the softmax warpgroup and the MMA warp
TMEM_BAR_THREADS = WarpSchedule().softmax_threads + 32

# --------------------------------------------------------------------------------------------------
# Layouts. The MMAs and TMAs read CuTe layouts; the warps that write shared memory with plain 16-B
# stores use the byte formulas below. tests/test_sm100_compile.py checks every formula against the
# CuTe layout it stands for, element by element (swizzles act on byte addresses: S<B,4,3> XORs
# address bits [4, 4+B) with bits [7, 7+B); every tile base is 1024-B aligned).
# --------------------------------------------------------------------------------------------------


def swizzle_bytes(b: int, bits: int) -> int:
    """CuTe's ``Swizzle<bits, 4, 3>`` applied to a byte offset (SW64: bits=2, SW128: bits=3)."""
    return b ^ (((b >> 7) & ((1 << bits) - 1)) << 4)


def k_tile_byte(t, d):
    """Byte offset of bf16 K[t, d] (d % 8 == 0) in one SW128 K-major K stage: 64-dim column blocks
    of 4 KiB (32 tokens x 128 B), 16-B chunk j = (d % 64) / 8 of row t at j ^ (t % 8)."""
    return 4096 * (d // 64) + 128 * t + 16 * (((d % 64) // 8) ^ (t % 8))


def p_tile_byte(r, tok):
    """Byte offset of bf16 P[r, tok] (tok % 8 == 0) in the SW64 K-major P tile (64-B rows)."""
    return 64 * r + 16 * ((tok // 8) ^ ((r // 2) % 4))


def out_box_byte(r, col):
    """Byte offset of bf16 out[r, col] (col % 8 == 0) in one 64 x 32 SW64 staging box."""
    return 64 * r + 16 * ((col // 8) ^ ((r // 2) % 4))


def tiled_mmas():
    """(QK, PV) tiled MMAs (call inside a DSL trace). Both 1-CTA, M = 64 heads (data-path layout F);
    the same for every format and key width (only the number of k-steps differs)."""
    cta = tcgen05.CtaGroup.ONE
    # QK: S (64 heads x 32 tokens) = Q (K-major) . K (K-major), d_qk / 16 k-steps (36 V3.2, 32 V4).
    qk = sm100_utils.make_trivial_tiled_mma(
        BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, cta, (TILE.heads, TILE.tokens)
    )
    # PV: O_half (64 x 256) += P (64 x 32, K-major) . V_half; V = the K tile read MN-major.
    pv = sm100_utils.make_trivial_tiled_mma(
        BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32, cta, (TILE.heads, TILE.half_v)
    )
    return qk, pv


def operand_layouts(qk, pv, tile, stages, k_stages: int) -> dict:
    """The MMAs' shared-memory operands and the output box (call inside a DSL trace): Q (``stages.q``
    buffers), ``k_stages`` K tiles of ``tile.k_dims`` dims, P (``stages.p``), the V view over the
    K tiles and the bf16 output staging box (64 heads x 32 dims, SW64)."""
    L = {}
    L["q"] = sm100_utils.make_smem_layout_a(qk, (tile.heads, tile.tokens, tile.d_qk), BFloat16, stages.q)
    L["k"] = sm100_utils.make_smem_layout_b(qk, (tile.heads, tile.tokens, tile.k_dims), BFloat16, k_stages)
    L["p"] = sm100_utils.make_smem_layout_a(pv, (tile.heads, tile.half_v, tile.tokens), BFloat16, stages.p)
    # V of one PV half: the MN-major B layout over the same bytes as the K-major K tile (same SW128
    # atoms: dim d at element (d % 64) + 2048 (d // 64), token t at 64 t). Two more modes address
    # the O half (half_v / 64 column blocks on) and the K stage.
    v_one = sm100_utils.make_smem_layout_b(pv, (tile.heads, tile.half_v, tile.tokens), BFloat16, 1)
    L["v_swizzle"] = v_one.inner
    L["v_outer"] = cute.append(
        cute.append(cute.select(v_one.outer, mode=[0, 1, 2]),
                    cute.make_layout(2, stride=(tile.half_v // tile.chunk) * tile.tokens * tile.chunk)),
        cute.make_layout(k_stages, stride=tile.k_stage_elems),
    )
    L["out_box"] = cute.tile_to_shape(
        tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW64, BFloat16), (tile.heads, tile.epi_cols), (0, 1)
    )
    return L


def permuted(t: cute.Tensor, order) -> cute.Tensor:
    """``t`` with its modes in ``order``: the TMA view of a (..., h, d) tensor whose boxes tile
    heads x dims (called in the host trace)."""
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(t.shape[i] for i in order),
                                                         stride=tuple(t.stride[i] for i in order)))


# --------------------------------------------------------------------------------------------------
# Shared memory
# --------------------------------------------------------------------------------------------------


def smem_buffer(dtype, elems: int, align: int = 1024):
    """A struct field of ``elems`` values (a tile's buffers start 1024-B aligned: a whole swizzle
    pattern)."""
    return cute.struct.Align[cute.struct.MemRange[dtype, elems], align]


def cta_storage(pipelines: dict, ring_stages: int, buffers: dict):
    """The CTA's shared memory, one struct (its size is what the launch requests), in this order:
    two mbarriers (full, empty) per stage of each pipeline (``pipelines``: name -> stages, field
    ``<name>_bar``), the word TMEM's address is handed over in, the index ring (a validity word and
    ``TILE.tokens`` TMA row coordinates per stage), then ``buffers`` (field name -> type)."""
    fields = {f"{name}_bar": cute.struct.MemRange[Int64, 2 * n] for name, n in pipelines.items()}
    fields["tmem_holding"] = Int32
    fields["valid"] = cute.struct.MemRange[Uint32, ring_stages]
    fields["coord"] = smem_buffer(Int32, ring_stages * TILE.tokens, 16)
    fields.update(buffers)
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


# --------------------------------------------------------------------------------------------------
# Tensor memory: the MMA warp allocates it and hands its address to the softmax warpgroup at
# Bar.TMEM; both meet there again before the MMA warp deallocates it.
# --------------------------------------------------------------------------------------------------


def allocate_tmem(storage, mma_warp: int) -> TmemAllocator:
    """The CTA's ``TMEM.alloc`` columns, allocated by warp ``mma_warp`` (every thread calls this;
    the caller fences and synchronizes the CTA after it)."""
    tmem = TmemAllocator(
        storage.tmem_holding.ptr,
        barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=Bar.TMEM, num_threads=TMEM_BAR_THREADS),
        allocator_warp_id=mma_warp,
    )
    tmem.allocate(TMEM.alloc)
    return tmem


def take_tmem(tmem: TmemAllocator, allocator: bool):
    """TMEM's address once it is allocated; the allocating warp then gives up its permit."""
    tmem.wait_for_alloc()
    tmem_ptr = tmem.retrieve_ptr(Float32)
    if allocator:
        tmem.relinquish_alloc_permit()
    return tmem_ptr


def free_tmem(tmem: TmemAllocator, tmem_ptr) -> None:
    """The MMA warp, after its last MMA: every tcgen05 op has completed once the softmax warpgroup
    (which waits for the last PV and reads O last) reaches Bar.TMEM; the fence orders the dealloc
    after its tcgen05.ld / st (its :func:`release_tmem` fence pairs with this one)."""
    cute.arch.barrier(barrier_id=Bar.TMEM, number_of_threads=TMEM_BAR_THREADS)
    tcgen05_fence_after_thread_sync()
    tmem.free(tmem_ptr)


def release_tmem() -> None:
    """The softmax warpgroup, after its last tcgen05.ld / st: arrives at Bar.TMEM for the dealloc."""
    tcgen05_fence_before_thread_sync()
    cute.arch.barrier(barrier_id=Bar.TMEM, number_of_threads=TMEM_BAR_THREADS)


# --------------------------------------------------------------------------------------------------
# P: the softmax warpgroup -> the PV MMA
# --------------------------------------------------------------------------------------------------


@cute.jit
def store_p_row(p_base: Int32, row: Int32, r: cute.Tensor):
    """bf16 P[row, :] (the tile's ``TILE.tokens`` values in ``r``, held by the row's thread) -> the
    SW64 K-major P tile at ``p_base``, 16 B at a time."""
    for c in cutlass.range_constexpr(TILE.tokens // 8):
        v = [ptx.pack_bf16x2(r[8 * c + 2 * e], r[8 * c + 2 * e + 1]) for e in range(4)]
        ptx.st_shared_v4(p_base + p_tile_byte(row, 8 * c), v[0], v[1], v[2], v[3])


def commit_p(p_pipe, p_state) -> None:
    """Every softmax thread, after the P stores: they are made visible to the tensor core (async
    proxy), this thread's TMEM accesses ordered before the commit, and P handed to the MMA warp."""
    cute.arch.fence_view_async_shared()
    tcgen05_fence_before_thread_sync()
    p_pipe.producer_commit(p_state)
