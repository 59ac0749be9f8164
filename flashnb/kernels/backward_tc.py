"""FlashAttention-2 backward on tensor cores (float16 / bfloat16 inputs, float32 accumulation).

The same three steps as ``backward.py`` (FA2 Algorithm 2; oracle ``reference.flash_backward``),
with the products on ``mma.sync.m16n8k16`` (primitives: ``_mma``):

1. ``backward.make_preprocess(WORDS_OF=...)``: ``delta_i = rowsum(dO_i * O_i)`` and ``lse`` in base 2,
   from 32-bit words.
2. ``dkdv_tc``: one block per (key tile, key/value head, batch); ``BLOCK_K / (16 MTK)`` warps
   each own ``16 MTK`` keys (``MTK`` m-tiles of 16; ``DSPLIT = 2``: two warps per 16 MTK keys, each
   holding half of dK's and dV's dims, and with ``SHARE`` half of the queries of S^T and dP^T, which
   both read back from shared memory).  K_j, V_j stay in shared memory; for every query tile of every
   query head of the group (Q_i, dO_i copied in with ``cp.async``, double-buffered: the next
   tile's Q, dO and its lse, delta rows are in flight while this one computes)::

       S^T  = K_j Q_i^T,  dP^T = V_j dO_i^T          a: ldmatrix of K/V rows; b: ldmatrix of Q/dO rows
       P^T, dS^T element-wise                        no score option: plain_grad (a window's mask by
                                                     comparisons); else backward.make_element_grad
       dV_j += P_drop^T dO_i,  dK_j += dS^T Q_i      a: P^T, dS^T packed from the accumulators;
                                                     b: ldmatrix.trans of dO/Q rows
       dQ_i += dS K_j                                dS^T through shared memory (ldmatrix.trans gives
                                                     dS's a fragments), float32 atomics; 16 x 16 DQ_NP
                                                     units of dQ dealt to all the warps (dq_phase), after
                                                     a barrier of its own or, with DEFER_DQ, after the
                                                     next item's first barrier

   dK, dV of the grouped query heads are summed in registers.
3. ``cast_tc``: the float32 dQ accumulator to 16-bit words (flat arrays, four words a thread).

float32 inputs (``DTYPE_NAME="float32"``) run the same kernel on tf32 tensor cores (``mma.m16n8k8``), as
``forward_tc`` does: a word is one value, and ``m16n8k8``'s tf32 a and b fragments are, in words, ``m16n8k16``'s
16-bit ones, so S^T and dP^T read K, V, Q, dO with the same ``ldmatrix``.  The products over queries (dV, dK)
and keys (dQ) take a k-step of 8 with its entries permuted (query or key ``2t + e`` as k index ``t + 4e``, as
in ``forward_tc``'s P V): S^T's and dP^T's accumulators are then P^T's and dS^T's a fragments as they are, and the
b fragments (dO, Q, K rows ``2t``, ``2t + 1`` at column ``g``) come by conflict-free 32-bit loads, since 32-bit
values have no ``ldmatrix.trans``.  ``TF32X3`` (``precision="highest"``): 3xTF32, each operand split into a tf32
part and a tf32 residual, three products per k-step into a zeroed partial added in float32 (see
``make_dkdv_tc``); without it (``"high"``) one product.  ``preprocess_tf32`` and ``cast_tc`` handle the
float32 words of dO, O and dQ.

Hopper's form of the dK/dV kernel (``WGMMA``: warpgroup MMA from swizzled tiles, ``EXCHANGE``, ``DQ_WGMMA``, the
tensor-copy engine) shares this kernel body; its steps are built in ``backward_wgmma``.

The deterministic (atomic-free) dQ pass exists only on the SIMT backend.
"""
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
from numba import cuda

from ._copy import make_async_tile_copy, make_swizzled_tile_copy, tc_padded_words
from ._jit import SIMULATOR, device_function, kernel, kernel_factory, unrolled
from ._mma import SMEM_ALIGN, make_mma_pair, memory_primitives, primitives, tf32_primitives
from ._scores import make_allowed_fn, make_tile_mask_fn, mask_block
from ._tiles import U, make_tile_order, packed_tile_head_batch, sequence_span
from ._wgmma import ATOM_BYTES, SMEM_ALIGN as WG_ALIGN, SWIZZLE_BYTES
from .backward import CAST_ITEMS, CAST_THREADS, make_element_grad, make_query_tile_range
from .backward_wgmma import make_dkdv_wgmma_steps
from .forward import LOG2E, make_mask_bounds, make_window_helpers

F32 = np.float32
U32_DT, F32_DT = np.dtype(np.uint32), np.dtype(np.float32)


_MMA_TF32 = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"


@lru_cache(maxsize=None)
def tf32x3_mma():
    """``mma3_add(a0..a3, s0..s3, b0, b1, t0, t1, c0..c3) -> d0..d3``: ``d = c + (A_s B + A B_s + A B)``, one
    k-step of 3xTF32 on ``m16n8k8`` fragments (a: the big parts of A, s: its small parts; b, t: of B; c, d:
    float32 accumulators, ``_mma``'s layouts): the three products go into a zeroed partial, added to ``c`` by
    round-to-nearest float32 adds (the tensor cores' float32 accumulation does not round to nearest: forward_tc's
    pv_tile_tf32, bench/results/h100-tf32-2026-11-25.md).

    On the GPU one inline-PTX block (three ``mma.sync`` and four ``add.f32``): to LLVM one call, so that the loops
    of the dK/dV kernel that index register arrays by their counter stay small enough to unroll (as three mma
    intrinsics and four adds the 3xTF32 kernel's dV/dK loop was left rolled, and S^T, dP^T went to local memory).
    In the simulator the warp's fragments meet once in shared memory and lane 0 forms the partial exactly (float64,
    rounded to float32 once), as ``_mma``'s ``mma`` twin does for one product.
    """
    if SIMULATOR:
        return _sim_tf32x3_mma()
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i32, f32 = ir.IntType(32), ir.FloatType()
    ptx = ("{ .reg .f32 p0, p1, p2, p3; "
           "mov.f32 p0, 0f00000000; mov.f32 p1, 0f00000000; mov.f32 p2, 0f00000000; mov.f32 p3, 0f00000000; "
           f"{_MMA_TF32} {{p0, p1, p2, p3}}, {{$8, $9, $10, $11}}, {{$12, $13}}, {{p0, p1, p2, p3}}; "
           f"{_MMA_TF32} {{p0, p1, p2, p3}}, {{$4, $5, $6, $7}}, {{$14, $15}}, {{p0, p1, p2, p3}}; "
           f"{_MMA_TF32} {{p0, p1, p2, p3}}, {{$4, $5, $6, $7}}, {{$12, $13}}, {{p0, p1, p2, p3}}; "
           "add.f32 $0, $16, p0; add.f32 $1, $17, p1; add.f32 $2, $18, p2; add.f32 $3, $19, p3; }")
    RET = types.UniTuple(types.float32, 4)

    @intrinsic
    def mma3_add(typingctx, a0, a1, a2, a3, s0, s1, s2, s3, b0, b1, t0, t1, c0, c1, c2, c3):
        sig = RET(a0, a1, a2, a3, s0, s1, s2, s3, b0, b1, t0, t1, c0, c1, c2, c3)

        def codegen(context, builder, signature, args):
            tys = signature.args
            ins = [context.cast(builder, x, t, types.uint32) for x, t in zip(args[:12], tys[:12])]
            ins += [context.cast(builder, x, t, types.float32) for x, t in zip(args[12:], tys[12:])]
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 12 + [f32] * 4)
            asm = ir.InlineAsm(fnty, ptx, "=f,=f,=f,=f," + ",".join(["r"] * 12 + ["f"] * 4))
            res = builder.call(asm, ins)
            return context.make_tuple(builder, RET, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    return mma3_add


def _sim_tf32x3_mma():
    from ._mma import A8_LANE, A8_REG, B8_LANE, B8_REG, C_LANE, C_REG, MAX_WARPS, tf32_values

    @device_function
    def mma3_add(a0, a1, a2, a3, s0, s1, s2, s3, b0, b1, t0, t1, c0, c1, c2, c3):
        frag_a = cuda.shared.array((MAX_WARPS, 32, 8), U32_DT)       # a, then s
        frag_b = cuda.shared.array((MAX_WARPS, 32, 4), U32_DT)       # b, then t
        frag_c = cuda.shared.array((MAX_WARPS, 32, 4), F32_DT)
        tid = cuda.threadIdx.x
        w, lane = tid // 32, tid % 32
        for i, x in enumerate((a0, a1, a2, a3, s0, s1, s2, s3)):
            frag_a[w, lane, i] = x
        frag_b[w, lane, 0], frag_b[w, lane, 1], frag_b[w, lane, 2], frag_b[w, lane, 3] = b0, b1, t0, t1
        frag_c[w, lane, 0], frag_c[w, lane, 1], frag_c[w, lane, 2], frag_c[w, lane, 3] = c0, c1, c2, c3
        cuda.syncthreads()
        if lane == 0:
            fa, fb = frag_a[w], frag_b[w]
            a, a_s = tf32_values(fa[A8_LANE, A8_REG]), tf32_values(fa[A8_LANE, A8_REG + 4])
            b, b_s = tf32_values(fb[B8_LANE, B8_REG]), tf32_values(fb[B8_LANE, B8_REG + 2])
            part = (a_s @ b + a @ b_s + a @ b).astype(np.float32)
            frag_c[w][C_LANE, C_REG] = frag_c[w][C_LANE, C_REG] + part
        cuda.syncthreads()
        d0, d1, d2, d3 = frag_c[w, lane, 0], frag_c[w, lane, 1], frag_c[w, lane, 2], frag_c[w, lane, 3]
        cuda.syncthreads()                                   # read before the next call overwrites
        return d0, d1, d2, d3

    return mma3_add


@lru_cache(maxsize=None)
@kernel_factory
def make_cast_tc(DTYPE_NAME):
    """``dst[t]`` = the word of ``src[2t], src[2t + 1]`` rounded to the 16-bit format, over flat (1-D) arrays:
    the float32 dQ accumulator to 16-bit words; laid out like ``backward.make_cast`` (``cast_grid`` blocks).
    float32: ``dst[t]`` = the bits of ``src[t]`` (the accumulator copied into the caller's dq words)."""
    if DTYPE_NAME == "float32":
        as_bits = tf32_primitives()["as_bits"]

        @kernel
        def copy_tc(src, dst):
            base = cuda.blockIdx.x * (CAST_THREADS * CAST_ITEMS) + cuda.threadIdx.x
            for e in range(CAST_ITEMS):
                t = base + e * CAST_THREADS
                if t < dst.shape[0]:
                    dst[t] = as_bits(src[t])

        return copy_tc

    _, pack2, _ = primitives(DTYPE_NAME)

    @kernel
    def cast_tc(src, dst):
        base = cuda.blockIdx.x * (CAST_THREADS * CAST_ITEMS) + cuda.threadIdx.x
        for e in range(CAST_ITEMS):
            t = base + e * CAST_THREADS
            if t < dst.shape[0]:
                dst[t] = pack2(src[2 * t], src[2 * t + 1])

    return cast_tc


def dkdv_dims(headdim, dsplit, wgmma):
    """The dK/dV kernel's padded head dim ``D_PAD``: each of its ``dsplit`` parts whole pairs of n-tiles (16
    dims), or with ``wgmma`` whole swizzled blocks of 64 values."""
    unit = (64 if wgmma else 16) * dsplit
    return -(-headdim // unit) * unit


def dq_frag_shape(batch, nheads, seqlen_q, headdim, block_q, dsplit, wgmma):
    """The fragment-ordered dQ accumulator of ``make_dkdv_tc(DQ_FRAG=True)``: ``(batch, nheads, rows, dims)``
    float32, the query rows padded to whole query tiles and the dims to the kernel's ``D_PAD`` (``dkdv_dims``),
    so that the kernel's reductions need no bounds.  Each 16 rows x ``dims`` slab is a run of 128-float blocks,
    one an n-tile of 8 dims, in the mma accumulator's order: float ``4 lane + e`` of a block is lane
    ``lane = 4 g + t``'s value ``e``, that is row ``g + 8 (e // 2)``, dim ``2 t + e % 2`` of the block
    (``make_cast_frag`` undoes it)."""
    return batch, nheads, -(-seqlen_q // block_q) * block_q, dkdv_dims(headdim, dsplit, wgmma)


@lru_cache(maxsize=None)
@kernel_factory
def make_cast_frag(DTYPE_NAME):
    """dQ's 16-bit words from the fragment-ordered accumulator (``dq_frag_shape``): ``src`` the accumulator's
    floats, flat; ``dst`` the words of the ``(batch, seqlen_q, nheads, headdim)`` dQ, flat.  A thread takes one
    lane's four floats of a block (16 contiguous bytes, four float loads; ``cast_grid`` over ``src.size / 4``)
    and writes its two words (rows ``g`` and ``g + 8``, dims ``2 t, 2 t + 1``) where they fall inside dQ."""
    _, pack2, _ = primitives(DTYPE_NAME)

    @kernel
    def cast_frag(src, dst, nheads, seqlen_q, rows, dims, headdim):
        nt_d = dims >> 3                                # blocks (n-tiles) of a 16-row slab
        slabs = rows >> 4                               # slabs of a (batch, head)
        half_d = headdim >> 1                           # words of a dQ row
        base = cuda.blockIdx.x * (CAST_THREADS * CAST_ITEMS) + cuda.threadIdx.x
        for e in range(CAST_ITEMS):
            q = base + e * CAST_THREADS                 # floats 4 q .. 4 q + 3: lane q % 32 of block q / 32
            if 4 * q < src.shape[0]:
                lane = q & 31
                blk = q >> 5
                slab = blk // nt_d
                nt = blk - slab * nt_d
                bh = slab // slabs
                i = 16 * (slab - bh * slabs) + (lane >> 2)
                b = bh // nheads
                if 8 * nt + 2 * (lane & 3) < headdim:       # (an even head dim: so is the dim after it)
                    o = ((b * seqlen_q + i) * nheads + bh - b * nheads) * half_d + 4 * nt + (lane & 3)
                    if i < seqlen_q:
                        dst[o] = pack2(src[4 * q], src[4 * q + 1])
                    if i + 8 < seqlen_q:
                        dst[o + 8 * nheads * half_d] = pack2(src[4 * q + 2], src[4 * q + 3])

    return cast_frag


def dq_pairs(MQ, NP_D, NWARPS, DSPLIT):
    """n-tile pairs per dQ unit: the most dividing ``NP_D`` that still leaves a unit for every warp, up to 4
    with the head-dim split and 2 without.  Measured (bench/results/h100-tune-tc-bwd-2026-11-22.md, sixth
    session): 2 against 1 is 14% less backward time at d = 64; at d = 128 2 is 3% faster than 1 and 4
    6% slower than 2; at d = 256 (split) 4 is 7% faster than 1 and 2% faster than 2."""
    for pairs in (4, 2) if DSPLIT > 1 else (2,):
        if NP_D % pairs == 0 and MQ * NP_D // pairs >= NWARPS:
            return pairs
    return 1


@lru_cache(maxsize=None)
@kernel_factory
def make_dkdv_tc(BLOCK_Q, BLOCK_K, HEAD_DIM, DTYPE_NAME, VEC16, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK,
                 HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, DSPLIT=1, RED2=False, MTK=1, DQ_NP=0,
                 DEFER_DQ=None, SHARE=False, VARLEN=False, TF32X3=True, WGMMA=False, EXCHANGE=False, SECTION=0,
                 DQ_FRAG=False, DQ_WGMMA=False, TMA=False, MODS=None, FAST_GRAD=False):
    """Build the tensor-core dK/dV (+ atomic dQ) kernel: (kernel, dynamic shared bytes, threads per block).

    ``DSPLIT``: warps per 16 MTK keys.  With 2, each warp of a pair accumulates dK, dV for half of the head
    dim (the accumulators of head dims above 128, or of 128 at two m-tiles, do not fit in one warp's
    registers next to S^T and dP^T); without ``SHARE`` both compute the same S^T and dP^T (twice the work).

    ``MTK``: m-tiles of 16 keys per warp.  With 2, each Q / dO fragment read from shared memory feeds
    twice the ``mma`` (twice dK's and dV's registers).

    ``RED2``: add dQ's pairs of adjacent dims with one ``red.global.add.v2.f32`` (compute capability
    9.0+) instead of two scalar float32 atomics.

    ``DQ_NP``: n-tile pairs (16 dims each) per unit of dQ = dS K_j; each unit is 16 queries x 16 DQ_NP
    dims, and each dS fragment read with ``ldmatrix`` feeds ``2 DQ_NP`` ``mma``.  0: ``dq_pairs``'s choice.

    ``DEFER_DQ``: item w's dQ = dS K_j is computed after the next item's first barrier, from a second
    dS^T buffer: one barrier per item instead of two (with ``SHARE``, two instead of three).  False: right
    after a barrier of its own.  None: deferred with the head-dim split only (measured,
    bench/results/h100-tune-tc-bwd-2026-11-23.md: 2-2.5% less backward time at d = 256; at d = 64 and 128
    without the split mixed, mostly slower, -2% to +8%).

    ``SHARE`` (with ``DSPLIT = 2``): S^T and dP^T are computed once, not twice.  The two warps of a pair split
    the queries of the tile (each computes its 16 MTK keys x BLOCK_Q / 2 queries), both write their P_drop^T and
    dS^T to shared memory, and after a barrier each reads the a fragments of dV += P_drop^T dO_i and
    dK += dS^T Q_i for all the queries with ``ldmatrix`` (FlashAttention-2's layout: the warp tiles of the
    products are larger, so fewer shared-memory reads feed each ``mma``).  dV, dK read this item's Q, dO
    buffer after the item's last barrier, and the copy two items ahead goes into it: the next item issues
    that copy after its first barrier (the deferred dQ, the default), or, with ``DEFER_DQ=False``, a barrier
    after dV, dK (dQ right after it) keeps them apart.

    ``SECTION``: the blocks of a dense batch in ``_tiles.make_tile_order``'s longest-first order, the (key/value
    head, batch) pairs in sections of ``SECTION``; 0: tile fastest.

    ``VARLEN``: a packed batch, as in ``forward.make_forward``: the blocks run over each sequence's key tiles;
    ``dq_accum`` stays the packed ``(1, total_q, nheads, headdim)`` accumulator, which ``dq_phase`` addresses
    as batch 0 with the sequence's rows shifted by its first row.

    ``DTYPE_NAME="float32"``: tf32 operands (``mma.m16n8k8``; the module docstring), with the float32 helpers
    (``scores_t_tf32``, ``dv_dk_tile_tf32``, ``dq_tf32``, ``store_words_tf32``, ``store_dk_dv``'s float32
    branch).  P^T and dS^T are stored in shared memory as float32 words, each 8 queries in the k-step's permuted
    order.  ``TF32X3`` (``precision="highest"``): every operand split into a tf32 part and its tf32 residual
    (``tf32_primitives``'s ``split_bits``), each k-step's three products ``a_small b_big + a_big b_small +
    a_big b_big`` into a zeroed partial that is added to the accumulator by ordinary (round-to-nearest) float32
    adds: the tensor cores' float32 accumulation does not round to nearest (forward_tc,
    bench/results/h100-tf32-2026-11-25.md).  Where
    the parts come from: K's small parts once per block into shared memory (``K_SMALL``; K's tile rounded in
    place), they feed S^T's a fragments and dQ's b fragments; Q_i's and dO_i's once per item (``QS_OFF``: read by
    every warp along the keys in S^T, dP^T, dV and dK); V's (the a fragments of dP^T only, each used for all the
    warp's queries) and P^T's, dS^T's in registers at each k-step.  Without ``TF32X3`` (``precision="high"``): one
    product; P^T and dS^T rounded to tf32, K, V, Q, dO truncated by the tensor cores.

    ``WGMMA`` (compute capability 9.0, 16-bit inputs, one warp per 16 keys, or with ``DSPLIT = 2`` two, each
    with half of dK's and dV's dims, both computing S^T and dP^T): S^T, dP^T, dV and dK by Hopper's
    warpgroup MMA (``_wgmma``), as the forward's: each warpgroup owns 64 keys of the tile, so per warp the
    accumulators are the m16n8 fragments the element-wise step reads now; ``S^T = K_j Q_i^T``, ``dP^T = V_j dO_i^T``
    with both operands from 128-byte-swizzled shared tiles (head dim padded to 64), ``dV += P_drop^T dO_i`` and
    ``dK += dS^T Q_i`` with P_drop^T, dS^T packed from the accumulators and dO_i, Q_i MN-major.  dQ keeps
    ``mma.sync`` (``dq_phase``), reading K_j from a second, unswizzled copy.  ``EXCHANGE`` (with ``DSPLIT = 2``):
    the first warpgroup computes S^T, the second dP^T, and each hands its product to the other through shared
    memory (``exchange_products``; thread ``tid`` and ``tid + 128`` hold the same keys and queries), so each
    product is computed once instead of twice.

    ``DQ_FRAG`` (16-bit inputs, dense batches, compute capability 9.0): ``dq_accum`` is ``dq_frag_shape``'s
    fragment-ordered accumulator, and each lane adds its four floats of an n-tile (n-tiles that are all padding
    excepted) with one ``red.global.add.v4.f32``, so that a warp's reduction covers 512 contiguous bytes (four
    whole 128-byte lines) instead of 8 rows x 32 bytes: the L2 takes a request of four sectors where it took
    four requests of one (bench/results/h100-dq-frag-2026-11-26.md).

    ``TMA`` (with ``WGMMA``, dense batches): Q_i and dO_i come by the tensor-copy engine (``_tma``; tensor maps
    0 and 1 of ``maps``) into two stages, each completing on its ``full`` barrier, instead of cp.async from every
    thread.  One block barrier an item instead of two: the one before dQ (dS^T complete) also says that every
    thread is past the item's reads of its stage (S^T, dP^T, dV, dK; dQ reads dS^T and K_j), so thread 0 refills
    it with the item after next right there, and publishes the next item's lse2, delta rows (stored before it);
    dS^T alternates between two buffers, so the next item's stores never meet this item's dQ.

    ``DQ_WGMMA`` (with ``WGMMA`` and ``DQ_FRAG``, 64-query tiles, one warp per 16 keys): dQ_i += dS K_j by the
    warpgroups too, each for its share of the dims (``DQ_N``): dS^T is stored as 128-byte-swizzled [key][query]
    rows, the MN-major A of ``wgmma_ss`` (``trans_a``), and K_j's swizzled tile is its MN-major B, so the
    unswizzled copy of K_j and the ``mma.sync`` phase go; each thread's accumulators are the m16n8 fragments
    ``DQ_FRAG``'s blocks hold.

    The kernel body is FA2's Algorithm 2 for one key tile; its steps are the helpers below (``scores_t``,
    ``plain_grad`` / ``option_grad``, ``dv_dk_tile``, ``dq_phase``, ``store_dk_dv``).  (The timing ablations
    of the dQ phase, the atomics and the element-wise step, whose results were wrong by design, were measured
    at commit 332a623, bench/results/h100-tune-tc-bwd-2026-11-22.md, and left the kernel.)
    ``MODS``: a ``flex_attention`` call's functions, element by element through ``backward.make_element_grad``.
    ``FAST_GRAD``: that element step as straight-line code (``make_element_grad(FAST=True)``: one MUFU.EX2, the
    masks as selects), for the score options and mods (``plan.BWD_FAST_GRAD``).
    """
    DEFER_DQ = DSPLIT > 1 if DEFER_DQ is None else DEFER_DQ
    # Above head dim 64, a string test that Numba evaluates at run time (not folded) in the guard of dq_phase's
    # fast path keeps ptxas from merging that path with the bounded one, which changes its register allocation.
    # Measured on the H100 (bench/results/h100-plan-2026-11-25.md): without it the 64 x 128 kernel at d = 128
    # spills 176 bytes instead of 40 and its backward runs 2-6% slower; at d = 64, 1-8% faster without it.
    KEEP_APART = HEAD_DIM > 64
    PATHS_APART = ""
    TF32 = DTYPE_NAME == "float32"
    SPLIT = TF32 and TF32X3                  # 3xTF32: big and small parts of every operand
    VALS = 1 if TF32 else 2                  # values per 32-bit word
    RED2 = RED2 and HEAD_DIM % 2 == 0        # (float32: an odd head dim's pairs of dims are not 8-byte aligned)
    assert BLOCK_Q % 16 == 0 and BLOCK_K % (16 * MTK) == 0 and HEAD_DIM % VALS == 0 and DSPLIT in (1, 2)
    QS = DSPLIT if SHARE else 1              # parts of the queries in S^T, dP^T: warp w computes part w // KW
    assert not SHARE or (DSPLIT == 2 and BLOCK_Q % (16 * QS) == 0)
    if WGMMA:
        assert not TF32 and MTK == 1 and not SHARE and not DEFER_DQ and VEC16 and BLOCK_K % 64 == 0
    DQ_WGMMA = DQ_WGMMA and WGMMA
    assert not DQ_WGMMA or (DSPLIT == 1 and BLOCK_Q == 64 and DQ_FRAG)
    assert not TMA or (WGMMA and not VARLEN)
    assert not DQ_FRAG or not (TF32 or VARLEN)
    KW = BLOCK_K // (16 * MTK)               # warps along the keys: 16 MTK keys each
    NWARPS = KW * DSPLIT                     # warp w: keys 16 MTK (w % KW) ..; dims of dK, dV: part w // KW
    NTHREADS = 32 * NWARPS
    D_PAD = dkdv_dims(HEAD_DIM, DSPLIT, WGMMA)   # each part of dK, dV: whole pairs of n-tiles (WGMMA: blocks of 64)
    HEAD_WORDS = HEAD_DIM // VALS
    D_WORDS = D_PAD // VALS
    KSTEPS_D = D_WORDS // 8                  # k-steps of K Q^T and V dO^T (8 words each)
    NT_D = D_PAD // 8                        # n-tiles of dK, dV, dQ (8 dims each)
    NT_DW = NT_D // DSPLIT                   # n-tiles of dK, dV in one warp's registers
    NT_Q = BLOCK_Q // 8                      # n-tiles of S^T, dP^T (8 queries each)
    NT_QA = NT_Q // QS                       # n-tiles of S^T, dP^T in one warp's registers
    KSTEPS_Q = BLOCK_Q // (8 * VALS)         # k-steps of P^T dO and dS^T Q (16 queries each, tf32: 8)
    KSTEPS_K = BLOCK_K // (8 * VALS)         # k-steps of dS K (16 keys each, tf32: 8)
    MQ = BLOCK_Q // 16                       # query m-tiles of dQ, spread over the warps
    STRIDE = D_WORDS if WGMMA else tc_padded_words(D_WORDS)   # (WGMMA: swizzled rows)
    DS_STRIDE = BLOCK_Q // 2 if DQ_WGMMA else tc_padded_words(BLOCK_Q // VALS)   # (DQ_WGMMA: swizzled rows)
    QTILE = BLOCK_Q * STRIDE                 # words of one Q (or dO) tile
    K_OFF = 0
    V_OFF = K_OFF + BLOCK_K * STRIDE
    Q_OFF = V_OFF + BLOCK_K * STRIDE         # buffer s: Q_i at Q_OFF + 2 s QTILE, dO_i QTILE after it
    DS_TILE = BLOCK_K * DS_STRIDE
    DS_OFF = Q_OFF + 4 * QTILE               # dS^T as words: [key][query pair]; buffer s at DS_OFF + s DS_TILE
    P_OFF = DS_OFF + (2 if DEFER_DQ or TMA else 1) * DS_TILE   # SHARE: P_drop^T as words, [key][query pair]
    L_OFF = P_OFF + (DS_TILE if SHARE else 0)           # buffer s: lse_i log2(e) at L_OFF + 2 s BLOCK_Q, delta_i after it
    K_SMALL = L_OFF + 4 * BLOCK_Q            # SPLIT: the small parts of K_j, then of Q_i and dO_i (this item's)
    QS_OFF = K_SMALL + BLOCK_K * STRIDE
    SMEM_WORDS = QS_OFF + 2 * QTILE if SPLIT else K_SMALL
    KD_OFF, KD_STRIDE = K_OFF, STRIDE        # K_j as dQ's b fragments read it
    if WGMMA and not DQ_WGMMA:               # a second copy of K_j with padded rows (ldmatrix.trans, no swizzle)
        KD_OFF, KD_STRIDE = SMEM_WORDS, tc_padded_words(D_WORDS)
        SMEM_WORDS = KD_OFF + BLOCK_K * KD_STRIDE
    DQ_N = D_PAD // (KW // 4) if DQ_WGMMA else 8   # DQ_WGMMA: dims of dQ per warpgroup
    DQ_NT_WG = DQ_N // 8                           # (its n-tiles)
    assert not DQ_WGMMA or (DQ_N % 16 == 0 and (4 * DS_OFF) % ATOM_BYTES == 0)
    EXCHANGE = EXCHANGE and WGMMA and DSPLIT == 2
    assert not EXCHANGE or KW == 4           # one warpgroup a half: thread tid's partner is tid +- 128
    X_WORDS = 4 * NT_QA * 128                # EXCHANGE: one warpgroup's S^T or dP^T, [element][thread]
    X_OFF = SMEM_WORDS                       # the first warpgroup's S^T at X_OFF, the second's dP^T after it
    if EXCHANGE:
        SMEM_WORDS = X_OFF + 2 * X_WORDS
    FULL = 4 * (-(-SMEM_WORDS // 2) * 2)     # TMA: the stages' full barriers (8 bytes each), after the tiles
    if TMA:
        SMEM_WORDS = FULL // 4 + 4
    SHARED_BYTES = SMEM_WORDS * 4
    QDO_BYTES = 2 * 4 * QTILE                 # TMA: the bytes of one stage's copies (Q_i, dO_i)
    A_ALL = 4 * KSTEPS_Q if WGMMA else 1     # WGMMA: words of P_drop^T's (dS^T's) a fragments, every k-step
    LROWS = -(-BLOCK_Q // NTHREADS)          # lse/delta rows per thread
    NP_D = NT_D // 2                         # dQ's n-tile pairs (16 dims each)
    DQ_NP = DQ_NP or dq_pairs(MQ, NP_D, NWARPS, DSPLIT)
    assert NP_D % DQ_NP == 0
    NU_D = NP_D // DQ_NP                     # units along the dims
    DQ_NT = 2 * DQ_NP                        # n-tiles of one unit
    DQ_UNITS = MQ * NU_D                     # dQ = dS K_j in 16 x 16 DQ_NP units (m-tile, DQ_NP pairs) over the warps
    DQ_ROUNDS = -(-DQ_UNITS // NWARPS)
    CW = 4 if VEC16 else 1
    HAS_SCORE_MOD = MODS is not None and MODS.score_mod is not None      # (a flex_attention call's functions)
    HAS_MASK_MOD = MODS is not None and MODS.mask_mod is not None
    PLAIN = not (HAS_SOFTCAP or HAS_BIAS or HAS_ALIBI or HAS_DROPOUT or HAS_SCORE_MOD)   # P, dS need no option
    WRITTEN_OUT = HAS_SCORE_MOD or HAS_SOFTCAP or HAS_BIAS   # element steps too long for ptxas to unroll a loop over
    # masked tiles by comparisons: a window and no mask held in memory (without a window, only the last key
    # tile is masked, by make_element_grad: the comparisons' registers cost 2-9% on every tile, measured)
    WINDOW_ONLY = PLAIN and HAS_WINDOW and not (HAS_ATTN_MASK or HAS_BLOCK_MASK or HAS_MASK_MOD)
    BIG = 1 << 40
    ZERO, POS_INF, NEG_INF, LOG2E_T = F32(0), F32(np.inf), F32(-np.inf), F32(LOG2E)

    mma, pack2, _ = primitives(DTYPE_NAME)
    mma_pair = make_mma_pair(DTYPE_NAME)
    mma3_add = tf32x3_mma()
    tf32 = tf32_primitives()
    split_bits, round_bits, split_value, round_value, as_bits = (
        tf32[name] for name in ("split_bits", "round_bits", "split_value", "round_value", "as_bits"))
    mem = memory_primitives()
    cp_async_commit, wait_all, wait_prev = mem["cp_async_commit"], mem["cp_async_wait_all"], mem["cp_async_wait_prev"]
    ldmatrix_x4, ldmatrix_x4_trans = mem["ldmatrix_x4"], mem["ldmatrix_x4_trans"]
    exp2, red_add_f32x2, red_add_f32x4 = mem["exp2_ftz"], mem["red_add_f32x2"], mem["red_add_f32x4"]
    # (the gradients into captured arrays: without SHARE, both warps of a pair compute the same elements, so the
    # first part's warps add them)
    grad = make_element_grad("float32", HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, HAS_WINDOW,
                             HAS_ATTN_MASK, HAS_BLOCK_MASK, MODS,
                             CAPTURE_THREADS=32 * KW if DSPLIT > 1 and not SHARE else NTHREADS, FAST=FAST_GRAD)
    allowed = make_allowed_fn(HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MODS and MODS.mask_mod, mask_block(MODS))
    tile_mask, ONE_BLOCK = make_tile_mask_fn(HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MODS, BLOCK_Q, BLOCK_K)
    MASK_WRITTEN = bool(MODS and MODS.mask_written & 2) and ONE_BLOCK     # (as in ``forward_tc``)
    MASK_WORDS = (MTK * NT_QA * 4 + 31) // 32        # a mask_mod's bits of one thread's S^T (``mask_words_t``)
    PLAIN_MASK_MOD = PLAIN and HAS_MASK_MOD
    _, tile_state = make_window_helpers(BLOCK_Q, BLOCK_K, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK,
                                        mask_block(MODS))
    query_tile_range = make_query_tile_range(BLOCK_Q)
    _, query_bounds = make_mask_bounds(BLOCK_Q, BLOCK_K, mask_block(MODS))
    tile_order = make_tile_order(SECTION)             # (a causal dK/dV kernel's longest key tiles are its first)

    if WGMMA:
        copy_kv = make_swizzled_tile_copy(BLOCK_K, D_WORDS, HEAD_WORDS, NTHREADS)
        copy_q = make_swizzled_tile_copy(BLOCK_Q, D_WORDS, HEAD_WORDS, NTHREADS)
        copy_kd = make_async_tile_copy(BLOCK_K, D_WORDS, KD_STRIDE, HEAD_WORDS, CW, NTHREADS)
        PART_BYTES = D_PAD // DSPLIT // 64 * BLOCK_Q * SWIZZLE_BYTES   # dO_i's, Q_i's blocks of one part of dims
    else:
        copy_kv = make_async_tile_copy(BLOCK_K, D_WORDS, STRIDE, HEAD_WORDS, CW, NTHREADS)
        copy_q = make_async_tile_copy(BLOCK_Q, D_WORDS, STRIDE, HEAD_WORDS, CW, NTHREADS)
        PART_BYTES = 0

    def make_plain_grad(MASKED):
        @device_function
        def plain_grad(s_reg, dp_reg, fsmem, lb, t, scale_log2, rel0, lo, hi, kend):
            """P^T = 2^(S^T scale log2(e) - lse2), dS^T = P^T (dP^T - delta) in this thread's fragments, each
            query's lse2 and delta read once for all its keys.  ``MASKED``: the exponent is -inf (P = 0)
            where key - (query + off) = ``rel0`` + (offset of the element) leaves [``lo``, ``hi``] or the key's
            offset from this thread's first key reaches ``kend`` (past the last key).  Rows past the last query
            have lse2 = +inf.  Comparisons, no branches: a loop body small enough to unroll, so the
            fragments stay in registers."""
            for n in range(NT_QA):
                for c in range(2):
                    il = 8 * n + 2 * t + c
                    lse_c = fsmem[U(lb + il)]
                    delta_c = fsmem[U(lb + BLOCK_Q + il)]
                    for m in range(MTK):
                        for r in range(2):               # (a range with a variable start is not unrolled)
                            e = 2 * r + c
                            x = s_reg[m, n, e] * scale_log2 - lse_c
                            if MASKED:
                                rel = rel0 + (16 * m + 8 * r - 8 * n - c)
                                if (rel < lo) | (rel > hi) | (16 * m + 8 * r >= kend):
                                    x = NEG_INF
                            pe = exp2(x)
                            dp_reg[m, n, e] = pe * (dp_reg[m, n, e] - delta_c)
                            s_reg[m, n, e] = pe

        return plain_grad

    plain_grad, plain_grad_masked = make_plain_grad(False), make_plain_grad(True)

    @device_function
    def next_work(w, gi, qi, n_work, nqt, qt_lo, hk, group, b, k0, seqlen_q, seqlen_k, off, left, right,
                  block_mask, bm_q, bm_k):
        """The first work item after ``w`` (item = query head ``gi`` of the group x query tile ``qt_lo + qi``,
        ``w = gi nqt + qi``) the block mask keeps, as ``(w, gi, qi)``: stepped, never divided."""
        w += 1
        qi += 1
        if qi == nqt:
            qi = 0
            gi += 1
        if HAS_BLOCK_MASK:
            while w < n_work:
                q0 = (qt_lo + qi) * BLOCK_Q
                visible, _ = tile_state(b, hk * group + gi, q0, min(q0 + BLOCK_Q, seqlen_q) - 1, k0, seqlen_k,
                                        off, left, right, block_mask, bm_q, bm_k)
                if visible:
                    break
                w += 1                                    # a skipped block: never loaded
                qi += 1
                if qi == nqt:
                    qi = 0
                    gi += 1
        return w, gi, qi

    if WGMMA:   # the warpgroup products, the copy engine's stages, dQ by the warpgroups (backward_wgmma)
        hopper = make_dkdv_wgmma_steps(SimpleNamespace(**{n: v for n, v in locals().items() if n.isupper()}),
                                       next_work)
        wgmma_t, fence_async, mbar_wait = hopper.wgmma_t, hopper.fence_async, hopper.mbar_wait
        exchange_products, dv_dk_tile_wgmma, dq_wgmma_phase = (
            hopper.exchange_products, hopper.dv_dk_tile_wgmma, hopper.dq_wgmma_phase)
        start_stages, refill = hopper.start_stages, hopper.refill

    @device_function
    def start_q_copy(q, dout, b, h, q0, seqlen_q, smem, base):
        """cp.async Q_i, dO_i into the buffer at ``base`` (rows past the queries zero-filled), one commit group."""
        # strides in bytes, multiples of 4 (word views): >> 2 is // 4 without the floor's sign fix-up
        copy_q(q, (b * q.strides[0] + h * q.strides[2]) >> 2, q.strides[1] >> 2, q0, seqlen_q - q0, smem, base)
        copy_q(dout, (b * dout.strides[0] + h * dout.strides[2]) >> 2, dout.strides[1] >> 2, q0, seqlen_q - q0,
               smem, base + QTILE)
        cp_async_commit()

    @device_function
    def load_rows(lse2, delta, b, h, q0, seqlen_q, l_row, d_row):
        """This thread's rows of lse2 and delta for the tile at ``q0`` into registers (+inf: P = 0 past the end)."""
        for s in range(LROWS):
            r = cuda.threadIdx.x + s * NTHREADS
            i = q0 + r
            ok = r < BLOCK_Q and i < seqlen_q
            l_row[s] = lse2[b, h, i] if ok else POS_INF
            d_row[s] = delta[b, h, i] if ok else ZERO

    @device_function
    def store_rows(fsmem, base, l_row, d_row):
        for s in range(LROWS):
            r = cuda.threadIdx.x + s * NTHREADS
            if r < BLOCK_Q:
                fsmem[base + r] = l_row[s]
                fsmem[base + BLOCK_Q + r] = d_row[s]

    @device_function
    def store_words(smem, base, reg, kw, g, t):
        """``reg`` (this warp's m-tiles of keys x n-tiles of queries) as 16-bit pairs into the [key][query pair]
        words at ``base``."""
        for m in range(MTK):
            row = base + (16 * (MTK * kw + m) + g) * DS_STRIDE + t
            for n in range(NT_QA):
                smem[U(row + 4 * n)] = pack2(reg[m, n, 0], reg[m, n, 1])
                smem[U(row + 8 * DS_STRIDE + 4 * n)] = pack2(reg[m, n, 2], reg[m, n, 3])

    @device_function
    def dq_phase(smem, dq_accum, ds_base, b, h, q0, seqlen_q, warp, g, t, ds_lane, t_lane, scale32, dq_reg):
        """dQ_i += dS K_j for the query tile at ``q0`` of head ``h``, dS^T read from the words at ``ds_base``
        (a packed batch's: ``b`` 0, ``q0`` and ``seqlen_q`` counted from the packed accumulator's row 0)."""
        # 16 x 16 DQ_NP units (m-tile mq, n-tiles n .. n + 2 DQ_NP - 1) dealt to the warps in rounds; every warp runs
        # every round (the simulator's mma is block-collective): one past the last unit recomputes unit 0
        # and adds nothing
        # flat offsets into dq_accum (C-contiguous): this thread's row q0 + g, dims 2t, 2t + 1;
        # a whole query tile and an unpadded head dim need no bounds
        if DQ_FRAG:             # dq_frag_shape's blocks: this lane's four floats of the tile's first block
            dq_row = ((b * dq_accum.shape[1] + h) * dq_accum.shape[2] + q0) * D_PAD + 4 * (4 * g + t)
            dq_rs = D_PAD                               # (a 16-row slab: 16 rows of D_PAD floats)
            q_full = True
        else:
            nheads = dq_accum.shape[2]
            dq_rs = nheads * HEAD_DIM                   # elements per query row of dq_accum
            dq_row = ((b * seqlen_q + q0 + g) * nheads + h) * HEAD_DIM + 2 * t
            q_full = q0 + BLOCK_Q <= seqlen_q
        for rnd in range(DQ_ROUNDS):
            u = rnd * NWARPS + warp
            active = True if DQ_UNITS % NWARPS == 0 else u < DQ_UNITS
            if not active:
                u = 0
            mq = u // NU_D
            n = DQ_NT * (u - mq * NU_D)
            dq_off = dq_row + 16 * mq * dq_rs + (128 if DQ_FRAG else 8) * n   # (an n-tile: a block, or 8 dims)
            for p in range(DQ_NT):
                for e in range(4):
                    dq_reg[p, e] = ZERO
            if TF32:                                    # (ds_lane, t_lane: the words of 32-bit loads)
                dq_tf32(smem, ds_base, mq, n, ds_lane, t_lane, dq_reg)
            else:
                for kk in range(KSTEPS_K):
                    a0, a1, a2, a3 = ldmatrix_x4_trans(smem, U(ds_base + 16 * kk * DS_STRIDE + 8 * mq + ds_lane))
                    for p in range(0, DQ_NT, 2):
                        b0, b1, b2, b3 = ldmatrix_x4_trans(smem,
                                                           U(KD_OFF + 16 * kk * KD_STRIDE + 4 * (n + p) + t_lane))
                        dq_reg[p, 0], dq_reg[p, 1], dq_reg[p, 2], dq_reg[p, 3] = mma(
                            a0, a1, a2, a3, b0, b1, dq_reg[p, 0], dq_reg[p, 1], dq_reg[p, 2], dq_reg[p, 3])
                        dq_reg[p + 1, 0], dq_reg[p + 1, 1], dq_reg[p + 1, 2], dq_reg[p + 1, 3] = mma(
                            a0, a1, a2, a3, b2, b3, dq_reg[p + 1, 0], dq_reg[p + 1, 1], dq_reg[p + 1, 2],
                            dq_reg[p + 1, 3])
            if DQ_FRAG:                                 # rows and dims padded: no bounds
                if active:
                    for p in range(DQ_NT):
                        if D_PAD == HEAD_DIM or 8 * (n + p) < HEAD_DIM:      # (n-tiles of padding: nothing to add)
                            red_add_f32x4(dq_accum, dq_off + 128 * p, dq_reg[p, 0] * scale32, dq_reg[p, 1] * scale32,
                                          dq_reg[p, 2] * scale32, dq_reg[p, 3] * scale32)
                continue
            if RED2 and (not KEEP_APART or PATHS_APART in ("", "-")) and active and q_full and D_PAD == HEAD_DIM:
                for r in range(2):
                    o = dq_off + 8 * r * dq_rs
                    for p in range(DQ_NT):
                        red_add_f32x2(dq_accum, o + 8 * p, dq_reg[p, 2 * r] * scale32,
                                      dq_reg[p, 2 * r + 1] * scale32)
                continue
            for half in range(DQ_NT):
                for r in range(2):
                    i = q0 + 16 * mq + g + 8 * r
                    d = 8 * (n + half) + 2 * t               # even; an even HEAD_DIM has d + 1 < HEAD_DIM too
                    if active and (q_full or i < seqlen_q) and (D_PAD == HEAD_DIM or d < HEAD_DIM):
                        if RED2:
                            red_add_f32x2(dq_accum, dq_off + 8 * r * dq_rs + 8 * half,
                                          dq_reg[half, 2 * r] * scale32, dq_reg[half, 2 * r + 1] * scale32)
                        else:
                            cuda.atomic.add(dq_accum, (b, i, h, d), dq_reg[half, 2 * r] * scale32)
                            if HEAD_DIM % 2 == 0 or d + 1 < HEAD_DIM:        # (an odd float32 head dim)
                                cuda.atomic.add(dq_accum, (b, i, h, d + 1), dq_reg[half, 2 * r + 1] * scale32)

    @device_function
    def scores_t(smem, qb, db, a_lane, b_lane, fa, fb, s_reg, dp_reg):
        """S^T = K_j Q_i^T and dP^T = V_j dO_i^T (rows: this warp's keys; columns: its queries): a fragments by
        ldmatrix of the K / V rows, b fragments of two n-tiles of queries by ldmatrix of the Q / dO rows."""
        for m in range(MTK):
            for n in range(NT_QA):
                for e in range(4):
                    s_reg[m, n, e] = ZERO
                    dp_reg[m, n, e] = ZERO
        for ks in range(KSTEPS_D):
            for m in range(MTK):
                fa[m, 0], fa[m, 1], fa[m, 2], fa[m, 3] = ldmatrix_x4(
                    smem, U(K_OFF + a_lane + 16 * m * STRIDE + 8 * ks))
                fb[m, 0], fb[m, 1], fb[m, 2], fb[m, 3] = ldmatrix_x4(
                    smem, U(V_OFF + a_lane + 16 * m * STRIDE + 8 * ks))
            for n in range(0, NT_QA, 2):
                b0, b1, b2, b3 = ldmatrix_x4(smem, U(qb + 8 * n * STRIDE + 8 * ks + b_lane))
                for m in range(MTK):
                    mma_pair(fa, m, b0, b1, b2, b3, s_reg, n)
                b0, b1, b2, b3 = ldmatrix_x4(smem, U(db + 8 * n * STRIDE + 8 * ks + b_lane))
                for m in range(MTK):
                    mma_pair(fb, m, b0, b1, b2, b3, dp_reg, n)

    @device_function
    def mask_bit_t(m, n, e, words, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask,
                   block_mask, bm_q, bm_k):
        """Sets element ``(m, n, e)``'s bit of ``words`` where the pair is allowed (``_scores.tile_mask``), for
        S^T."""
        if tile_mask(q0 + qa + 8 * n + 2 * t + (e % 2), k0 + 16 * (MTK * kw + m) + g + 8 * (e // 2), b, h, seqlen_q,
                     seqlen_k, off, left, right, attn_mask, block_mask, bm_q, bm_k):
            x = (m * NT_QA + n) * 4 + e
            words[x >> 5] |= np.uint32(1) << np.uint32(x & 31)

    mask_each_t = unrolled(mask_bit_t, (MTK, NT_QA, 4)) if HAS_MASK_MOD else None

    @device_function
    def mask_words_loop_t(words, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask,
                          block_mask, bm_q, bm_k):
        """``mask_words_t`` as a loop (``plan.FLEX_MASK_WRITTEN`` without its bit 2): the words in local memory."""
        for w in range(MASK_WORDS):
            words[w] = np.uint32(0)
        for m in range(MTK):
            for n in range(NT_QA):
                for e in range(4):
                    if allowed(q0 + qa + 8 * n + 2 * t + (e % 2), k0 + 16 * (MTK * kw + m) + g + 8 * (e // 2), b, h,
                               seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask, bm_q, bm_k):
                        x = (m * NT_QA + n) * 4 + e
                        words[x >> 5] |= np.uint32(1) << np.uint32(x & 31)

    @device_function
    def mask_words_out_t(words, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask,
                         block_mask, bm_q, bm_k):
        """``words``: one bit per S^T element of this thread (element ``(m * NT_QA + n) * 4 + e``), set where the
        pair is allowed: apart from S^T, written out as ``forward_tc.mask_words`` (the words in registers)."""
        for w in range(MASK_WORDS):
            words[w] = np.uint32(0)
        mask_each_t(words, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask,
                    bm_q, bm_k)

    mask_words_t = mask_words_out_t if MASK_WRITTEN else mask_words_loop_t

    @device_function
    def zero_masked(s_reg, dp_reg, words):
        """P^T, dS^T = 0 where ``words`` (``mask_words_t``) has the element's bit clear (an exp2 of a masked
        score, computed and then dropped, may be inf: it never reaches the products)."""
        for m in range(MTK):
            for n in range(NT_QA):
                for e in range(4):
                    bit = (m * NT_QA + n) * 4 + e
                    if (words[bit >> 5] >> np.uint32(bit & 31)) & np.uint32(1) == 0:
                        s_reg[m, n, e] = ZERO
                        dp_reg[m, n, e] = ZERO

    @device_function
    def grad_element(m, n, e, s_reg, dp_reg, fsmem, lb, words, need_mask, k0, q0, qa, kw, g, t, b, h, seqlen_q,
                     seqlen_k, off, scale32, softcap, left, right, attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                     drop_threshold, drop_scale, seed_lo, seed_hi):
        """Element ``(m, n, e)`` of P_drop^T and dS^T (``option_grad``); with a mask_mod, 0 where its bit in
        ``words`` is clear (P = 0, so dS = 0)."""
        j = k0 + 16 * (MTK * kw + m) + g + 8 * (e // 2)
        il = qa + 8 * n + 2 * t + (e % 2)
        if HAS_MASK_MOD:                             # (FAST_GRAD: the bit as a select inside grad, no branch)
            bit = (m * NT_QA + n) * 4 + e
            dead = need_mask & ((words[bit >> 5] >> np.uint32(bit & 31)) & np.uint32(1) == 0)
            if dead and not FAST_GRAD:
                p_drop, ds = ZERO, ZERO
            else:
                p_drop, ds = grad(s_reg[m, n, e], dp_reg[m, n, e], q0 + il, j, b, h, fsmem[U(lb + il)],
                                  fsmem[U(lb + BLOCK_Q + il)], dead, False, seqlen_q, seqlen_k, off, scale32,
                                  softcap, left, right, attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                                  drop_threshold, drop_scale, seed_lo, seed_hi)
        else:
            p_drop, ds = grad(s_reg[m, n, e], dp_reg[m, n, e], q0 + il, j, b, h, fsmem[U(lb + il)],
                              fsmem[U(lb + BLOCK_Q + il)], False, need_mask, seqlen_q, seqlen_k, off, scale32,
                              softcap, left, right, attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                              drop_threshold, drop_scale, seed_lo, seed_hi)
        s_reg[m, n, e] = p_drop
        dp_reg[m, n, e] = ds

    grad_each = unrolled(grad_element, (MTK, NT_QA, 4)) if WRITTEN_OUT else None

    @device_function
    def option_grad(s_reg, dp_reg, fsmem, lb, need_mask, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off,
                    scale32, softcap, left, right, attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                    drop_threshold, drop_scale, seed_lo, seed_hi):
        """P_drop^T and dS^T element-wise with the score options and masks (``backward.make_element_grad``):
        element e of (m, n) is key k0 + 16 (MTK kw + m) + g + 8 (e >> 1), query q0 + qa + 8n + 2t + (e & 1).
        With a score_mod, softcap or bias, written out (``grad_element``: its code is too long for a loop to
        unroll), a mask_mod first as bits (``mask_words_t``)."""
        if WRITTEN_OUT:
            words = cuda.local.array(MASK_WORDS, np.uint32)
            if HAS_MASK_MOD and need_mask:
                mask_words_t(words, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask,
                             block_mask, bm_q, bm_k)
            grad_each(s_reg, dp_reg, fsmem, lb, words, need_mask, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off,
                      scale32, softcap, left, right, attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                      drop_threshold, drop_scale, seed_lo, seed_hi)
            return
        for m in range(MTK):
            for n in range(NT_QA):
                for e in range(4):
                    j = k0 + 16 * (MTK * kw + m) + g + 8 * (e // 2)
                    il = qa + 8 * n + 2 * t + (e % 2)
                    p_drop, ds = grad(s_reg[m, n, e], dp_reg[m, n, e], q0 + il, j, b, h, fsmem[U(lb + il)],
                                      fsmem[U(lb + BLOCK_Q + il)], False, need_mask, seqlen_q, seqlen_k, off,
                                      scale32, softcap, left, right, attn_mask, attn_bias, alibi, block_mask,
                                      bm_q, bm_k, drop_threshold, drop_scale, seed_lo, seed_hi)
                    s_reg[m, n, e] = p_drop
                    dp_reg[m, n, e] = ds

    @device_function
    def dv_dk_tile(smem, qb, db, ds_buf, pa_lane, t_lane, nd0, s_reg, dp_reg, fa, fb, dv_acc, dk_acc):
        """dV += P_drop^T dO_i, dK += dS^T Q_i (scale at the end; this warp's dims): a from the accumulators
        (SHARE: ldmatrix of P_drop^T, dS^T rows), b = ldmatrix.trans of dO / Q rows (k = 16 queries, two
        n-tiles of dims)."""
        for kq in range(KSTEPS_Q):
            for m in range(MTK):
                if SHARE:
                    fa[m, 0], fa[m, 1], fa[m, 2], fa[m, 3] = ldmatrix_x4(
                        smem, U(P_OFF + pa_lane + 16 * m * DS_STRIDE + 8 * kq))
                    fb[m, 0], fb[m, 1], fb[m, 2], fb[m, 3] = ldmatrix_x4(
                        smem, U(ds_buf + pa_lane + 16 * m * DS_STRIDE + 8 * kq))
                else:
                    fa[m, 0] = pack2(s_reg[m, 2 * kq, 0], s_reg[m, 2 * kq, 1])
                    fa[m, 1] = pack2(s_reg[m, 2 * kq, 2], s_reg[m, 2 * kq, 3])
                    fa[m, 2] = pack2(s_reg[m, 2 * kq + 1, 0], s_reg[m, 2 * kq + 1, 1])
                    fa[m, 3] = pack2(s_reg[m, 2 * kq + 1, 2], s_reg[m, 2 * kq + 1, 3])
                    fb[m, 0] = pack2(dp_reg[m, 2 * kq, 0], dp_reg[m, 2 * kq, 1])
                    fb[m, 1] = pack2(dp_reg[m, 2 * kq, 2], dp_reg[m, 2 * kq, 3])
                    fb[m, 2] = pack2(dp_reg[m, 2 * kq + 1, 0], dp_reg[m, 2 * kq + 1, 1])
                    fb[m, 3] = pack2(dp_reg[m, 2 * kq + 1, 2], dp_reg[m, 2 * kq + 1, 3])
            for n in range(0, NT_DW, 2):
                b0, b1, b2, b3 = ldmatrix_x4_trans(smem, U(db + 16 * kq * STRIDE + 4 * (nd0 + n) + t_lane))
                for m in range(MTK):
                    mma_pair(fa, m, b0, b1, b2, b3, dv_acc, n)
                b0, b1, b2, b3 = ldmatrix_x4_trans(smem, U(qb + 16 * kq * STRIDE + 4 * (nd0 + n) + t_lane))
                for m in range(MTK):
                    mma_pair(fb, m, b0, b1, b2, b3, dk_acc, n)

    @device_function
    def store_dk_dv(dk, dv, dk_acc, dv_acc, b, hk, k0, kw, nd0, g, t, seqlen_k, scale32):
        """dK = scale dK_acc, dV = dV_acc (summed over the query heads of the group) as 16-bit words (float32:
        a word per value)."""
        for m in range(MTK):
            for r in range(2):
                j = k0 + 16 * (MTK * kw + m) + g + 8 * r
                if j < seqlen_k:
                    for n in range(NT_DW):
                        if TF32:
                            for e in range(2):
                                c = 8 * (nd0 + n) + 2 * t + e
                                if c < HEAD_WORDS:
                                    dk[U(b), U(j), U(hk), U(c)] = as_bits(dk_acc[m, n, 2 * r + e] * scale32)
                                    dv[U(b), U(j), U(hk), U(c)] = as_bits(dv_acc[m, n, 2 * r + e])
                        else:
                            c = 4 * (nd0 + n) + t
                            if c < HEAD_WORDS:
                                dk[U(b), U(j), U(hk), U(c)] = pack2(dk_acc[m, n, 2 * r] * scale32,
                                                                    dk_acc[m, n, 2 * r + 1] * scale32)
                                dv[U(b), U(j), U(hk), U(c)] = pack2(dv_acc[m, n, 2 * r], dv_acc[m, n, 2 * r + 1])

    # ---- float32 (tf32 operands).  In the products over queries (dV, dK) and keys (dQ) the k-step's entry
    # 2t + e is k index t + 4e (the module docstring): a0..a3 of an a fragment are S^T-layout elements
    # e = 0, 2, 1, 3 (TF32_A), and a b fragment is rows 2t, 2t + 1 (b0, b1) of column g, and of column g + 8 for
    # the next n-tile (b2, b3): 32-bit loads at ``kv_word`` (= 2t STRIDE + g) from a k-step's first row
    TF32_A = (0, 2, 1, 3)

    @device_function
    def tf32_operand(x, big, small, m, e):
        """``big[m, e]`` = float32 ``x`` as a tf32 operand: rounded, or (SPLIT) its big part with the small one in
        ``small[m, e]``."""
        if SPLIT:
            big[m, e], small[m, e] = split_value(x)
        else:
            big[m, e] = round_value(x)

    @device_function
    def tf32_word(w, big, small, m, e):
        """``tf32_operand`` of the float32 bits ``w`` (a word read from shared memory)."""
        if SPLIT:
            big[m, e], small[m, e] = split_bits(w)
        else:
            big[m, e] = round_bits(w)

    @device_function
    def mma3_pair(a, a_s, m, b0, b1, b2, b3, s0, s1, s2, s3, c, n):
        """``c[m, n] += A_m B(b0, b1)`` and ``c[m, n + 1] += A_m B(b2, b3)`` in 3xTF32 (``mma_pair``'s; ``a_s``,
        s0..s3: the small parts of ``a`` and b0..b3), each k-step's products into a zeroed partial (``mma3_add``)."""
        c[m, n, 0], c[m, n, 1], c[m, n, 2], c[m, n, 3] = mma3_add(
            a[m, 0], a[m, 1], a[m, 2], a[m, 3], a_s[m, 0], a_s[m, 1], a_s[m, 2], a_s[m, 3], b0, b1, s0, s1,
            c[m, n, 0], c[m, n, 1], c[m, n, 2], c[m, n, 3])
        c[m, n + 1, 0], c[m, n + 1, 1], c[m, n + 1, 2], c[m, n + 1, 3] = mma3_add(
            a[m, 0], a[m, 1], a[m, 2], a[m, 3], a_s[m, 0], a_s[m, 1], a_s[m, 2], a_s[m, 3], b2, b3, s2, s3,
            c[m, n + 1, 0], c[m, n + 1, 1], c[m, n + 1, 2], c[m, n + 1, 3])

    @device_function
    def b_words(smem, at):
        """A b fragment pair of tf32 words from the k-step rows at ``at``: rows 2t, 2t + 1 (``at`` = the k-step's
        first row + ``kv_word``) of column g (b0, b1) and of column g + 8, the next n-tile (b2, b3)."""
        return smem[U(at)], smem[U(at + STRIDE)], smem[U(at + 8)], smem[U(at + STRIDE + 8)]

    @device_function
    def split_smem(smem, src, dst, nwords):
        """SPLIT: ``smem[src:src + nwords]`` -> its tf32 big parts in place and its small parts at ``dst``, by
        the whole block (the caller synchronises before and after)."""
        for i in range(cuda.threadIdx.x, nwords, NTHREADS):
            big, small = split_bits(smem[U(src + i)])
            smem[U(src + i)] = big
            smem[U(dst + i)] = small

    @device_function
    def scores_t_tf32(smem, qb, db, a_lane, b_lane, fa, fb, fa_s, fb_s, s_reg, dp_reg):
        """``scores_t`` on float32 words (a k-step of 8 dims is 8 words: the same ``ldmatrix`` reads).  SPLIT: K's
        small parts from ``K_SMALL``, V's split here (each a fragment feeds all the warp's queries), Q_i's and
        dO_i's from ``QS_OFF``; each k-step's three products into a zeroed partial (``mma3_pair``)."""
        for m in range(MTK):
            for n in range(NT_QA):
                for e in range(4):
                    s_reg[m, n, e] = ZERO
                    dp_reg[m, n, e] = ZERO
        for ks in range(KSTEPS_D):
            for m in range(MTK):
                at = a_lane + 16 * m * STRIDE + 8 * ks
                fa[m, 0], fa[m, 1], fa[m, 2], fa[m, 3] = ldmatrix_x4(smem, U(K_OFF + at))
                w0, w1, w2, w3 = ldmatrix_x4(smem, U(V_OFF + at))
                if SPLIT:
                    fa_s[m, 0], fa_s[m, 1], fa_s[m, 2], fa_s[m, 3] = ldmatrix_x4(smem, U(K_SMALL + at))
                    fb[m, 0], fb_s[m, 0] = split_bits(w0)
                    fb[m, 1], fb_s[m, 1] = split_bits(w1)
                    fb[m, 2], fb_s[m, 2] = split_bits(w2)
                    fb[m, 3], fb_s[m, 3] = split_bits(w3)
                else:
                    fb[m, 0], fb[m, 1], fb[m, 2], fb[m, 3] = w0, w1, w2, w3
            for n in range(0, NT_QA, 2):
                at = 8 * n * STRIDE + 8 * ks + b_lane
                b0, b1, b2, b3 = ldmatrix_x4(smem, U(qb + at))
                if SPLIT:
                    s0, s1, s2, s3 = ldmatrix_x4(smem, U(QS_OFF + at))
                    for m in range(MTK):
                        mma3_pair(fa, fa_s, m, b0, b1, b2, b3, s0, s1, s2, s3, s_reg, n)
                else:
                    for m in range(MTK):
                        mma_pair(fa, m, b0, b1, b2, b3, s_reg, n)
                b0, b1, b2, b3 = ldmatrix_x4(smem, U(db + at))
                if SPLIT:
                    s0, s1, s2, s3 = ldmatrix_x4(smem, U(QS_OFF + QTILE + at))
                    for m in range(MTK):
                        mma3_pair(fb, fb_s, m, b0, b1, b2, b3, s0, s1, s2, s3, dp_reg, n)
                else:
                    for m in range(MTK):
                        mma_pair(fb, m, b0, b1, b2, b3, dp_reg, n)

    @device_function
    def dv_dk_tile_tf32(smem, qb, db, ds_buf, pa_lane, kv_word, nd0, s_reg, dp_reg, fa, fb, fa_s, fb_s, dv_acc,
                        dk_acc):
        """``dv_dk_tile`` on tf32 operands, a k-step of 8 queries: a from S^T's accumulators (elements ``TF32_A``;
        SHARE: ldmatrix of the P_drop^T, dS^T words, stored in that order), split or rounded here; b: dO / Q rows
        2t, 2t + 1 of the k-step by 32-bit loads (SPLIT: and their small parts from ``QS_OFF``)."""
        for kq in range(KSTEPS_Q):
            for m in range(MTK):
                if SHARE:
                    at = pa_lane + 16 * m * DS_STRIDE + 8 * kq
                    w0, w1, w2, w3 = ldmatrix_x4(smem, U(P_OFF + at))
                    tf32_word(w0, fa, fa_s, m, 0)
                    tf32_word(w1, fa, fa_s, m, 1)
                    tf32_word(w2, fa, fa_s, m, 2)
                    tf32_word(w3, fa, fa_s, m, 3)
                    w0, w1, w2, w3 = ldmatrix_x4(smem, U(ds_buf + at))
                    tf32_word(w0, fb, fb_s, m, 0)
                    tf32_word(w1, fb, fb_s, m, 1)
                    tf32_word(w2, fb, fb_s, m, 2)
                    tf32_word(w3, fb, fb_s, m, 3)
                else:
                    for e in range(4):
                        tf32_operand(s_reg[m, kq, TF32_A[e]], fa, fa_s, m, e)
                        tf32_operand(dp_reg[m, kq, TF32_A[e]], fb, fb_s, m, e)
            row = 8 * kq * STRIDE + kv_word
            for n in range(0, NT_DW, 2):
                at = row + 8 * (nd0 + n)
                b0, b1, b2, b3 = b_words(smem, db + at)
                if SPLIT:
                    s0, s1, s2, s3 = b_words(smem, QS_OFF + QTILE + at)
                    for m in range(MTK):
                        mma3_pair(fa, fa_s, m, b0, b1, b2, b3, s0, s1, s2, s3, dv_acc, n)
                else:
                    for m in range(MTK):
                        mma_pair(fa, m, b0, b1, b2, b3, dv_acc, n)
                b0, b1, b2, b3 = b_words(smem, qb + at)
                if SPLIT:
                    s0, s1, s2, s3 = b_words(smem, QS_OFF + at)
                    for m in range(MTK):
                        mma3_pair(fb, fb_s, m, b0, b1, b2, b3, s0, s1, s2, s3, dk_acc, n)
                else:
                    for m in range(MTK):
                        mma_pair(fb, m, b0, b1, b2, b3, dk_acc, n)

    @device_function
    def store_words_tf32(fsmem, base, reg, kw, g, t):
        """``reg`` (this warp's m-tiles of keys x n-tiles of queries) as float32 words into the [key][query] rows at
        ``base``, each 8 queries in the k-step's order: query 2t + e at word t + 4e."""
        for m in range(MTK):
            row = base + (16 * (MTK * kw + m) + g) * DS_STRIDE + t
            for n in range(NT_QA):
                fsmem[U(row + 8 * n)] = reg[m, n, 0]
                fsmem[U(row + 8 * n + 4)] = reg[m, n, 1]
                fsmem[U(row + 8 * DS_STRIDE + 8 * n)] = reg[m, n, 2]
                fsmem[U(row + 8 * DS_STRIDE + 8 * n + 4)] = reg[m, n, 3]

    @device_function
    def dq_tf32(smem, ds_base, mq, n, ds_word, kv_word, dq_reg):
        """dq_reg += dS K_j on one dQ unit (query m-tile ``mq``, n-tiles ``n ..``), a k-step of 8 keys: dS's a
        fragment from the dS^T words (keys 2t, 2t + 1 of the k-step as rows, queries g, g + 8 of the m-tile at
        ``ds_word``), split or rounded; K's b fragments by 32-bit loads (SPLIT: and their small parts from
        ``K_SMALL``)."""
        fq = cuda.local.array((1, 4), U32_DT)                 # dS's a fragment of the k-step
        fq_s = cuda.local.array((1, 4), U32_DT)               # its small parts (SPLIT)
        for kk in range(KSTEPS_K):
            at = ds_base + 8 * kk * DS_STRIDE + 16 * mq + ds_word
            tf32_word(smem[U(at)], fq, fq_s, 0, 0)
            tf32_word(smem[U(at + 8)], fq, fq_s, 0, 1)
            tf32_word(smem[U(at + DS_STRIDE)], fq, fq_s, 0, 2)
            tf32_word(smem[U(at + DS_STRIDE + 8)], fq, fq_s, 0, 3)
            row = K_OFF + 8 * kk * STRIDE + kv_word
            for p in range(0, DQ_NT, 2):
                at = row + 8 * (n + p)
                b0, b1, b2, b3 = b_words(smem, at)
                if SPLIT:
                    s0, s1, s2, s3 = b_words(smem, at - K_OFF + K_SMALL)
                    dq_reg[p, 0], dq_reg[p, 1], dq_reg[p, 2], dq_reg[p, 3] = mma3_add(
                        fq[0, 0], fq[0, 1], fq[0, 2], fq[0, 3], fq_s[0, 0], fq_s[0, 1], fq_s[0, 2], fq_s[0, 3], b0, b1,
                        s0, s1, dq_reg[p, 0], dq_reg[p, 1], dq_reg[p, 2], dq_reg[p, 3])
                    dq_reg[p + 1, 0], dq_reg[p + 1, 1], dq_reg[p + 1, 2], dq_reg[p + 1, 3] = mma3_add(
                        fq[0, 0], fq[0, 1], fq[0, 2], fq[0, 3], fq_s[0, 0], fq_s[0, 1], fq_s[0, 2], fq_s[0, 3], b2, b3,
                        s2, s3, dq_reg[p + 1, 0], dq_reg[p + 1, 1], dq_reg[p + 1, 2], dq_reg[p + 1, 3])
                else:
                    dq_reg[p, 0], dq_reg[p, 1], dq_reg[p, 2], dq_reg[p, 3] = mma(
                        fq[0, 0], fq[0, 1], fq[0, 2], fq[0, 3], b0, b1, dq_reg[p, 0], dq_reg[p, 1], dq_reg[p, 2],
                        dq_reg[p, 3])
                    dq_reg[p + 1, 0], dq_reg[p + 1, 1], dq_reg[p + 1, 2], dq_reg[p + 1, 3] = mma(
                        fq[0, 0], fq[0, 1], fq[0, 2], fq[0, 3], b2, b3, dq_reg[p + 1, 0], dq_reg[p + 1, 1],
                        dq_reg[p + 1, 2], dq_reg[p + 1, 3])

    @device_function
    def await_item(more):
        """Item w's copies landed (``more``: the next item's copy group may stay in flight), made visible to the
        tensor cores (WGMMA), for every thread (a barrier)."""
        if more:
            wait_prev()
        else:
            wait_all()
        if WGMMA:
            fence_async()
        cuda.syncthreads()

    @device_function
    def share_products(smem, fsmem, ds_buf, qa, s_reg, dp_reg, kw, g, t):
        """SHARE: this warp's queries (from ``qa``) of P_drop^T and dS^T to shared memory (at ``P_OFF``,
        ``ds_buf``), then a barrier: every warp reads them all."""
        if TF32:
            store_words_tf32(fsmem, P_OFF + qa, s_reg, kw, g, t)
            store_words_tf32(fsmem, ds_buf + qa, dp_reg, kw, g, t)
        else:
            store_words(smem, P_OFF + qa // 2, s_reg, kw, g, t)
            store_words(smem, ds_buf + qa // 2, dp_reg, kw, g, t)
        cuda.syncthreads()

    @device_function
    def dv_dk_step(smem, qb, db, ds_buf, pa_lane, t_lane, nd0, part_bytes, s_reg, dp_reg, fa, fb, fa_s, fb_s, p_all,
                   ds_all, dv_acc, dk_acc):
        """dV += P_drop^T dO_i, dK += dS^T Q_i: by ``mma`` (``dv_dk_tile``, tf32: ``dv_dk_tile_tf32``) or
        ``wgmma`` (``dv_dk_tile_wgmma``)."""
        if TF32:
            dv_dk_tile_tf32(smem, qb, db, ds_buf, pa_lane, t_lane, nd0, s_reg, dp_reg, fa, fb, fa_s, fb_s, dv_acc,
                            dk_acc)
        elif WGMMA:
            dv_dk_tile_wgmma(smem, qb, db, part_bytes, s_reg, dp_reg, p_all, ds_all, dv_acc, dk_acc)
        else:
            dv_dk_tile(smem, qb, db, ds_buf, pa_lane, t_lane, nd0, s_reg, dp_reg, fa, fb, dv_acc, dk_acc)

    @device_function
    def store_ds(smem, fsmem, ds_buf, dp_reg, kw, g, t):
        """This warp's dS^T as [key][query] words at ``ds_buf`` (16-bit pairs; tf32: float32 words; DQ_WGMMA:
        128-byte-swizzled rows, query pair 4 n + t of key row r in chunk n ^ (r % 8), and r % 8 is g)."""
        if TF32:
            store_words_tf32(fsmem, ds_buf, dp_reg, kw, g, t)
        elif DQ_WGMMA:
            row = ds_buf + (16 * kw + g) * DS_STRIDE + t
            for n in range(NT_QA):
                sw = 4 * (n ^ g)
                smem[U(row + sw)] = pack2(dp_reg[0, n, 0], dp_reg[0, n, 1])
                smem[U(row + 8 * DS_STRIDE + sw)] = pack2(dp_reg[0, n, 2], dp_reg[0, n, 3])
        else:
            store_words(smem, ds_buf, dp_reg, kw, g, t)

    @device_function
    def dv_dk_and_ds(smem, fsmem, qb, db, ds_buf, qa, pa_lane, t_lane, nd0, part_bytes, warp, kw, g, t, s_reg, dp_reg,
                     fa, fb, fa_s, fb_s, p_all, ds_all, dv_acc, dk_acc):
        """dV += P_drop^T dO_i, dK += dS^T Q_i, and dS^T to shared memory as words for dQ (``ldmatrix.trans`` turns
        its [key][query] rows into dS's a fragments; with DSPLIT = 2 the first warp of each pair writes it, both
        holding the same dS^T; SHARE: every warp's queries of P_drop^T and dS^T shared first, for all)."""
        if SHARE:
            share_products(smem, fsmem, ds_buf, qa, s_reg, dp_reg, kw, g, t)
        dv_dk_step(smem, qb, db, ds_buf, pa_lane, t_lane, nd0, part_bytes, s_reg, dp_reg, fa, fb, fa_s, fb_s,
                   p_all, ds_all, dv_acc, dk_acc)
        if not SHARE and (DSPLIT == 1 or warp < KW):
            store_ds(smem, fsmem, ds_buf, dp_reg, kw, g, t)

    @device_function
    def dq_step(smem, fsmem, maps, q, dout, dq_accum, b, hk, group, h, q0, wn, gn, qn_i, n_work, nqt, qt_lo, k0,
                seqlen_q, seqlen_k, off, left, right, block_mask, bm_q, bm_k, buf, ds_buf, dq_b, dq_row0, warp, g, t,
                ds_lane, t_lane, scale32, l_row, d_row, dq_reg, dq_acc):
        """The item's block barrier (dS^T complete; every warp past its reads of buffer ``buf``), then dQ_i += dS
        K_j.  TMA: the next item's rows stored before it (the barrier publishes them) and stage ``buf`` refilled
        after it with the item after next, returned as ``(w2, g2, q2_i)`` (else ``(wn, gn, qn_i)``)."""
        w2, g2, q2_i = wn, gn, qn_i
        if TMA and wn < n_work:
            store_rows(fsmem, L_OFF + (1 - buf) * 2 * BLOCK_Q, l_row, d_row)
        if DQ_WGMMA:
            fence_async()                        # dS^T's stores, for the tensor cores
        cuda.syncthreads()
        if TMA:
            w2, g2, q2_i = refill(smem, maps, q, dout, b, hk, group, wn, gn, qn_i, n_work, nqt, qt_lo, k0,
                                  seqlen_q, seqlen_k, off, left, right, block_mask, bm_q, bm_k, buf)
        if DQ_WGMMA:
            dq_wgmma_phase(smem, dq_accum, ds_buf, b, h, q0, warp, g, t, scale32, dq_acc)
        else:
            dq_phase(smem, dq_accum, ds_buf, dq_b, h, dq_row0 + q0, dq_row0 + seqlen_q, warp, g, t, ds_lane,
                     t_lane, scale32, dq_reg)
        return w2, g2, q2_i

    @device_function
    def item_buffers(buf):
        """Where an item's tiles are in buffer ``buf``: Q_i, dO_i (``qb``, ``db``) and its lse2, delta rows (``lb``)."""
        qb = Q_OFF + buf * 2 * QTILE
        return qb, qb + QTILE, L_OFF + buf * 2 * BLOCK_Q

    @device_function
    def products_t(smem, fsmem, qb, db, a_lane, b_lane, warp, wg_rows, fa, fb, fa_s, fb_s, s_reg, dp_reg):
        """S^T = K_j Q_i^T and dP^T = V_j dO_i^T into ``s_reg``, ``dp_reg``: by mma.sync (tf32: 3 products a
        term), or by the warpgroups (``EXCHANGE``: one product each, then swapped)."""
        if TF32:
            scores_t_tf32(smem, qb, db, a_lane, b_lane, fa, fb, fa_s, fb_s, s_reg, dp_reg)
        elif WGMMA and EXCHANGE:
            first_wg = warp < KW
            a_off = 4 * (K_OFF if first_wg else V_OFF) + wg_rows          # K_j Q_i^T, or V_j dO_i^T
            b_off = 4 * (qb if first_wg else db)
            wgmma_t(s_reg, smem, a_off, b_off, 0)
            exchange_products(fsmem, s_reg, dp_reg, first_wg)
        elif WGMMA:
            wgmma_t(s_reg, smem, 4 * K_OFF + wg_rows, 4 * qb, 0)
            wgmma_t(dp_reg, smem, 4 * V_OFF + wg_rows, 4 * db, 0)
        else:
            scores_t(smem, qb, db, a_lane, b_lane, fa, fb, s_reg, dp_reg)

    @device_function
    def grads_t(s_reg, dp_reg, fsmem, lb, need_mask, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off, scale32,
                scale_log2, softcap, left, right, attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                drop_threshold, drop_scale, seed_lo, seed_hi):
        """P_drop^T (in ``s_reg``) and dS^T = P^T (dP^T - delta) (in ``dp_reg``), element-wise: the plain form on
        a tile with no option and no mask, the window's comparisons, or every option and mask in memory."""
        if PLAIN and not need_mask:
            plain_grad(s_reg, dp_reg, fsmem, lb + qa, t, scale_log2, 0, 0, 0, 0)
        elif PLAIN_MASK_MOD:                         # the plain form, then P, dS = 0 where the mask's bit is not set
            words = cuda.local.array(MASK_WORDS, np.uint32)
            mask_words_t(words, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask,
                         block_mask, bm_q, bm_k)
            plain_grad(s_reg, dp_reg, fsmem, lb + qa, t, scale_log2, 0, 0, 0, 0)
            zero_masked(s_reg, dp_reg, words)
        elif WINDOW_ONLY:
            jb = k0 + 16 * MTK * kw + g              # this thread's first key
            plain_grad_masked(s_reg, dp_reg, fsmem, lb + qa, t, scale_log2, jb - (q0 + qa + 2 * t) - off,
                              -left if left >= 0 else -BIG, right if right >= 0 else BIG, seqlen_k - jb)
        else:
            option_grad(s_reg, dp_reg, fsmem, lb, need_mask, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off,
                        scale32, softcap, left, right, attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                        drop_threshold, drop_scale, seed_lo, seed_hi)

    @device_function
    def sequence_views(cu_seqlens_q, b, k_start, n_k, q, dout, lse2, delta, k, v, dk, dv):
        """VARLEN: sequence ``b``'s rows of every array (its keys from ``k_start``, ``n_k`` of them), as a dense
        batch's; its bottom-right offset n_k - n_q; its first query's row in the packed dQ."""
        q_start, n_q = sequence_span(cu_seqlens_q, b)
        q, dout = q[:, q_start:q_start + n_q], dout[:, q_start:q_start + n_q]
        lse2, delta = lse2[:, :, q_start:q_start + n_q], delta[:, :, q_start:q_start + n_q]
        k, v = k[:, k_start:k_start + n_k], v[:, k_start:k_start + n_k]
        dk, dv = dk[:, k_start:k_start + n_k], dv[:, k_start:k_start + n_k]
        return q, dout, lse2, delta, k, v, dk, dv, n_k - n_q, q_start

    @device_function
    def work_items(qt_lo, qt_hi, b, h0, group, k0, k_last, block_mask, bm_q, bm_k):
        """The key tile's query tiles from ``qt_lo`` narrowed by the block mask, ``nqt`` of them (at least 1), and
        its ``n_work`` items (query head of the group, query tile): ``(qt_lo, nqt, n_work)``."""
        qt_lo, qt_hi = query_bounds(qt_lo, qt_hi, b, h0, group, k0, k_last, block_mask, bm_q, bm_k)
        return qt_lo, max(qt_hi - qt_lo, 1), group * (qt_hi - qt_lo) if qt_hi > qt_lo else 0

    @device_function
    def load_item(q, dout, lse2, delta, b, h, q0, seqlen_q, smem, base, l_row, d_row):
        """An item's (query head ``h``, first query ``q0``) Q_i, dO_i by cp.async to words ``base`` on (TMA: by the
        copy engine, issued elsewhere) and its lse2, delta rows into registers ``l_row``, ``d_row``."""
        if not TMA:
            start_q_copy(q, dout, b, h, q0, seqlen_q, smem, base)
        load_rows(lse2, delta, b, h, q0, seqlen_q, l_row, d_row)

    @device_function
    def await_stage(smem, buf, it, more):
        """Item ``it``'s Q_i, dO_i (in buffer ``buf``) have landed: TMA: its stage's full barrier, at the item's
        phase; else ``await_item(more)`` (and its lse2, delta rows, for every thread)."""
        if TMA:
            mbar_wait(smem, FULL + 8 * buf, (it // 2) % 2)
        else:
            await_item(more)

    @kernel
    def flash_dkdv_tc(q, k, v, dout, lse2, delta, dk, dv, dq_accum, group, off, scale, softcap, left, right,
                      attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k, drop_threshold, drop_scale,
                      seed_lo, seed_hi, cu_seqlens_q, cu_seqlens_k, maps):
        if VARLEN:                                        # this block's sequence, viewed as a dense batch's
            kt, hk, b = packed_tile_head_batch(cu_seqlens_k, k.shape[2])
            k_start, n_k = sequence_span(cu_seqlens_k, b)
            if kt * BLOCK_K >= n_k:
                return                                    # a key tile past its sequence: nothing to do
            q, dout, lse2, delta, k, v, dk, dv, off, dq_row0 = sequence_views(
                cu_seqlens_q, b, k_start, n_k, q, dout, lse2, delta, k, v, dk, dv)
            dq_b = 0                                      # where query row i's dQ accumulates: [dq_b, dq_row0 + i]
        else:
            kt, hk, b = tile_order((k.shape[1] + BLOCK_K - 1) // BLOCK_K, k.shape[2])
            dq_b, dq_row0 = b, 0
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        k0 = kt * BLOCK_K
        k_last = min(k0 + BLOCK_K, seqlen_k) - 1
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid - 32 * warp
        kw = warp % KW if DSPLIT > 1 else warp          # this warp's keys: k0 + 16 MTK kw ..
        nd0 = NT_DW * (warp // KW) if DSPLIT > 1 else 0  # its first n-tile of dK, dV
        qa = (BLOCK_Q // QS) * (warp // KW) if SHARE else 0   # its first query of S^T, dP^T
        g = lane // 4
        t = lane - 4 * g
        mi = lane // 8
        scale32, scale_log2 = F32(scale), F32(scale) * LOG2E_T

        smem = cuda.shared.array(0, U32_DT, alignment=WG_ALIGN if WGMMA else SMEM_ALIGN)
        fsmem = cuda.shared.array(0, F32_DT)
        a_lane = (16 * MTK * kw + 8 * (mi % 2) + lane % 8) * STRIDE + 4 * (mi // 2)
        b_lane = (qa + 8 * (mi // 2) + lane % 8) * STRIDE + 4 * (mi % 2)
        t_lane = (8 * (mi % 2) + lane % 8) * KD_STRIDE + 4 * (mi // 2)   # (KD_STRIDE = STRIDE but with WGMMA)
        ds_lane = (8 * (mi // 2) + lane % 8) * DS_STRIDE + 4 * (mi % 2)
        pa_lane = (16 * MTK * kw + 8 * (mi % 2) + lane % 8) * DS_STRIDE + 4 * (mi // 2)   # SHARE: P^T, dS^T as a
        if TF32:                        # 32-bit loads instead of the .trans reads: this lane's word of a k-step
            t_lane = 2 * t * STRIDE + g                           # b: dO / Q / K rows 2t, 2t + 1, column g
            ds_lane = 2 * t * DS_STRIDE + g // 2 + 4 * (g % 2)    # dS's a: keys 2t, 2t + 1 (rows), query g

        s_reg = cuda.local.array((MTK, NT_QA, 4), F32)     # S^T, then P_drop^T (m-tile of keys, n-tile of queries)
        dp_reg = cuda.local.array((MTK, NT_QA, 4), F32)    # dP^T, then dS^T
        dk_acc, dv_acc = cuda.local.array((MTK, NT_DW, 4), F32), cuda.local.array((MTK, NT_DW, 4), F32)
        fa, fb = cuda.local.array((MTK, 4), U32_DT), cuda.local.array((MTK, 4), U32_DT)   # a fragments: K, P^T; V, dS^T
        fa_s = cuda.local.array((MTK if SPLIT else 1, 4), U32_DT)   # SPLIT: their small parts
        fb_s = cuda.local.array((MTK if SPLIT else 1, 4), U32_DT)
        dq_reg = cuda.local.array((DQ_NT, 4), F32)
        dq_acc = cuda.local.array((DQ_NT_WG, 4), F32)    # DQ_WGMMA: this thread's dQ fragments
        p_all, ds_all = cuda.local.array(A_ALL, U32_DT), cuda.local.array(A_ALL, U32_DT)   # WGMMA: P_drop^T's, dS^T's
        wg_rows = (kw // 4) * 64 * SWIZZLE_BYTES                         # WGMMA: this warpgroup's K / V rows
        part_bytes = (warp // KW) * PART_BYTES if DSPLIT > 1 else 0        # and its part of the dims (DSPLIT)
        l_row, d_row = cuda.local.array(LROWS, F32), cuda.local.array(LROWS, F32)   # the next item's lse2, delta rows
        for m in range(MTK):
            for n in range(NT_DW):
                for e in range(4):
                    dk_acc[m, n, e] = ZERO
                    dv_acc[m, n, e] = ZERO
        copy_kv(k, (b * k.strides[0] + hk * k.strides[2]) >> 2, k.strides[1] >> 2, k0, seqlen_k - k0, smem, K_OFF)
        copy_kv(v, (b * v.strides[0] + hk * v.strides[2]) >> 2, v.strides[1] >> 2, k0, seqlen_k - k0, smem, V_OFF)
        if WGMMA and not DQ_WGMMA:
            copy_kd(k, (b * k.strides[0] + hk * k.strides[2]) >> 2, k.strides[1] >> 2, k0, seqlen_k - k0, smem,
                    KD_OFF)
        cp_async_commit()
        # work items w = (query head gi of the group, query tile qt_lo + w % nqt), in order; double-buffered:
        # item w + 1's Q, dO (cp.async) and lse2, delta (registers) are in flight while item w computes
        qt_lo, qt_hi = query_tile_range(k0, k_last, off, left, right, seqlen_q)
        qt_lo, nqt, n_work = work_items(qt_lo, qt_hi, b, hk * group, group, k0, k_last, block_mask, bm_q, bm_k)
        w, gi, qi = next_work(-1, 0, -1, n_work, nqt, qt_lo, hk, group, b, k0, seqlen_q, seqlen_k, off, left,
                              right, block_mask, bm_q, bm_k)
        if TMA:                                           # stage 0: item w, stage 1: item wn, in flight
            wn, gn, qn_i = next_work(w, gi, qi, n_work, nqt, qt_lo, hk, group, b, k0, seqlen_q, seqlen_k, off, left,
                                     right, block_mask, bm_q, bm_k)
            start_stages(smem, maps, q, dout, b, hk * group, qt_lo, w, gi, qi, wn, gn, qn_i, n_work, seqlen_q)
        if w < n_work:
            q0 = (qt_lo + qi) * BLOCK_Q
            if not TMA:
                start_q_copy(q, dout, b, hk * group + gi, q0, seqlen_q, smem, Q_OFF)
            load_rows(lse2, delta, b, hk * group + gi, q0, seqlen_q, l_row, d_row)
            store_rows(fsmem, L_OFF, l_row, d_row)
        if TMA:                                           # K_j, V_j and item w's rows landed, for everyone
            await_item(False)
        it, buf = 0, 0                                   # the item's number (TMA: its stage's phase), its buffer
        first = True                                     # SPLIT: K_j is split with the first item's Q_i, dO_i
        pending, ph, pq0 = False, 0, 0                   # DEFER_DQ: the previous item's dQ, its head, first query
        while w < n_work:
            h = hk * group + gi
            q0 = (qt_lo + qi) * BLOCK_Q
            q_last = min(q0 + BLOCK_Q, seqlen_q) - 1
            if not TMA:
                wn, gn, qn_i = next_work(w, gi, qi, n_work, nqt, qt_lo, hk, group, b, k0, seqlen_q, seqlen_k, off,
                                         left, right, block_mask, bm_q, bm_k)
            if DEFER_DQ:      # item w's Q, dO, lse2, delta landed for everyone; every warp done with item w - 1
                await_item(False)                        # (buffers 1 - buf free, its dS^T complete)
            if wn < n_work:
                # buffer 1 - buf was last read before this barrier (DEFER_DQ) or the previous item's dQ barrier
                qn = (qt_lo + qn_i) * BLOCK_Q
                load_item(q, dout, lse2, delta, b, hk * group + gn, qn, seqlen_q, smem, Q_OFF + (1 - buf) * 2 * QTILE,
                          l_row, d_row)
            if DEFER_DQ:
                if pending:
                    dq_phase(smem, dq_accum, DS_OFF + (1 - buf) * DS_TILE, dq_b, ph, dq_row0 + pq0,
                             dq_row0 + seqlen_q, warp, g, t, ds_lane, t_lane, scale32, dq_reg)
            else:
                await_stage(smem, buf, it, wn < n_work)  # item w's Q_i, dO_i (no TMA: lse2, delta) have landed
            _, need_mask = tile_state(b, h, q0, q_last, k0, seqlen_k, off, left, right, block_mask, bm_q, bm_k)
            qb, db, lb = item_buffers(buf)
            if SPLIT:                                    # K_j (once), Q_i, dO_i -> big parts, small parts
                if first:
                    split_smem(smem, K_OFF, K_SMALL, BLOCK_K * STRIDE)
                    first = False
                split_smem(smem, qb, QS_OFF, 2 * QTILE)  # (QS_OFF last read by item w - 1's dV, dK: before the
                cuda.syncthreads()                       # barrier above)

            products_t(smem, fsmem, qb, db, a_lane, b_lane, warp, wg_rows, fa, fb, fa_s, fb_s, s_reg, dp_reg)

            grads_t(s_reg, dp_reg, fsmem, lb, need_mask, k0, q0, qa, kw, g, t, b, h, seqlen_q, seqlen_k, off, scale32,
                    scale_log2, softcap, left, right, attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                    drop_threshold, drop_scale, seed_lo, seed_hi)   # P_drop^T, dS^T = P^T (dP^T - delta)

            ds_buf = DS_OFF + (buf * DS_TILE if DEFER_DQ or TMA else 0)
            dv_dk_and_ds(smem, fsmem, qb, db, ds_buf, qa, pa_lane, t_lane, nd0, part_bytes, warp, kw, g, t, s_reg,
                         dp_reg, fa, fb, fa_s, fb_s, p_all, ds_all, dv_acc, dk_acc)
            if DEFER_DQ:                                 # added after the next item's barrier (or the last one)
                pending, ph, pq0 = True, h, q0
            else:                                        # dQ_i += dS K_j, after the item's barrier
                w2, g2, q2_i = dq_step(smem, fsmem, maps, q, dout, dq_accum, b, hk, group, h, q0, wn, gn, qn_i,
                                       n_work, nqt, qt_lo, k0, seqlen_q, seqlen_k, off, left, right, block_mask,
                                       bm_q, bm_k, buf, ds_buf, dq_b, dq_row0, warp, g, t, ds_lane, t_lane,
                                       scale32, l_row, d_row, dq_reg, dq_acc)
            if wn < n_work and not TMA:                  # item w + 1's rows, published by its first barrier, into
                # buffer 1 - buf (last read before the previous item's dQ barrier)
                store_rows(fsmem, L_OFF + (1 - buf) * 2 * BLOCK_Q, l_row, d_row)
            buf, it, w, gi, qi = 1 - buf, it + 1, wn, gn, qn_i   # the next item
            if TMA:
                wn, gn, qn_i = w2, g2, q2_i

        wait_all()                                       # no copy may outlive the block
        if DEFER_DQ and pending:                         # the last item's dQ
            cuda.syncthreads()
            dq_phase(smem, dq_accum, DS_OFF + (1 - buf) * DS_TILE, dq_b, ph, dq_row0 + pq0, dq_row0 + seqlen_q, warp,
                     g, t, ds_lane, t_lane, scale32, dq_reg)
        store_dk_dv(dk, dv, dk_acc, dv_acc, b, hk, k0, kw, nd0, g, t, seqlen_k, scale32)

    return flash_dkdv_tc, SHARED_BYTES, NTHREADS
