"""Tile primitives for the SIMT kernels: loads into shared memory, register micro-tile products, row reductions.

A thread block of ``THREADS_R * THREADS_C`` threads works on a ``ROWS x COLS``
tile of scores.  Thread ``(ty, tx)`` (``tid = ty * THREADS_C + tx``) owns the
register micro-tile

    rows  ty * TR + r       for r < TR = ROWS / THREADS_R   (contiguous: one row block per thread row)
    cols  tx + c * THREADS_C for c < TC = COLS / THREADS_C   (strided: neighbouring lanes read neighbouring
                                                             shared-memory rows, so a padded row stride
                                                             puts them in different banks)

and, for the ``ROWS x HEAD_DIM`` output accumulator, dims ``tx + c * THREADS_C``
for ``c < TD = ceil(HEAD_DIM / THREADS_C)``.  Shared-memory tiles are rows of
``HEAD_DIM`` values at a padded stride (``HEAD_DIM + 1``): the row-strided reads
of the product loop then hit 32 different banks.

The ``THREADS_C`` threads sharing a row are consecutive lanes of one warp, so a
row reduction is a butterfly of ``shfl_xor`` on the GPU.  The simulator has no
shuffles: there the same reduction goes through a shared-memory scratch row and
two barriers (``make_row_allreduce``), with the same result.
"""
import math

import numpy as np
from numba import cuda

from ._jit import SIMULATOR, device_function
from ._sync import group_sync

FULL_MASK = 0xFFFFFFFF  # every lane of the warp takes part in the shuffle
# Index cast for hot loops.  Numba indexes with signed 64-bit integers and, for a
# signed index, emits a negative-index wraparound (compare, select, add) on every
# access, which also stops LLVM from folding the unrolled accesses into one base
# pointer plus constant offsets.  An unsigned index has no wraparound: ``a[U(i)]``
# (a no-op conversion) turns ~6 integer instructions per shared-memory load into 0.
U = np.uint64
UNROLL = 4  # reduction-loop unroll factor of the micro-tile products (written out: 4 calls)


@device_function
def tile_head_batch(n_tiles, nheads):
    """(tile, head, batch) of this block in a 1-D grid of ``n_tiles * nheads * batch`` blocks, tile fastest.

    One dimension because ``gridDim.y`` and ``gridDim.z`` stop at 65535 (a batch of
    70k sequences, or 70k rows, would not launch); tile fastest so that the blocks
    of one head run together and share its K and V in L2.
    """
    bh = cuda.blockIdx.x // n_tiles
    b = bh // nheads
    return cuda.blockIdx.x - bh * n_tiles, bh - b * nheads, b


def make_tile_order(SECTION=0, LAST_FIRST=False):
    """``tile_head_batch``'s signature with the blocks dealt longest first (FlashAttention-3's LPT order): the
    (head, batch) pairs in sections of ``SECTION``, a section's blocks tile by tile, each tile across the section's
    pairs; ``LAST_FIRST`` counts the tiles from the last (a causal forward's longest query tiles are its last, a
    causal dK/dV kernel's longest key tiles its first).  ``SECTION = 0``: ``tile_head_batch`` itself.

    Why: with tile fastest a head's longest blocks start wherever the head starts, so the last heads' long blocks
    start near the end of the grid and run on while the other SMs idle (a tail of 3-7% of a causal dK/dV kernel
    that runs one block an SM, in a list-scheduling model of the benchmark shapes).  Dealt tile by tile across
    the whole grid, every long block starts first, but a wave then holds one tile of every head, and the queries
    (keys) each block sweeps do not fit in L2; a section of a few heads keeps the sweep's working set to those
    heads."""
    if not SECTION:
        return tile_head_batch

    @device_function
    def section_tile_head_batch(n_tiles, nheads):
        per = SECTION * n_tiles                               # blocks of a whole section
        s = cuda.blockIdx.x // per
        r = cuda.blockIdx.x - s * per
        width = min(SECTION, cuda.gridDim.x // n_tiles - s * SECTION)   # (head, batch) pairs of this section
        i = r // width
        bh = s * SECTION + r - i * width
        b = bh // nheads
        return (n_tiles - 1 - i if LAST_FIRST else i), bh - b * nheads, b

    return section_tile_head_batch


@device_function
def packed_tile_head_batch(cu_seqlens, nheads):
    """``tile_head_batch`` of a packed (varlen) batch: the grid is ``max_seqlen`` tiles x heads x sequences, the
    sequences counted by ``cu_seqlens`` (``batch + 1`` entries), the tiles per (head, sequence) by the grid."""
    return tile_head_batch(cuda.gridDim.x // (nheads * (cu_seqlens.shape[0] - 1)), nheads)


@device_function
def sequence_span(cu_seqlens, b):
    """(first row, rows) of sequence ``b`` of a packed batch: rows ``cu_seqlens[b] .. cu_seqlens[b + 1]``.

    A kernel then slices its sequence out of each packed array, a ``(batch, total, nheads, headdim)`` view
    whose batch stride is 0 (``flashnb.varlen``): ``x[:, start:start + n]`` is ``(batch, n, nheads, headdim)``,
    sequence ``b``'s row ``i`` at ``[b, i]`` as in a dense batch, so the body reads it unchanged and never past
    the sequence (``[:, :, start:start + n]`` for the per-row ``(batch, nheads, total)`` lse, delta).  The slice
    is written in the kernel: a device function may not return a view it made (no runtime on the device).
    """
    start = cu_seqlens[b]
    return start, cu_seqlens[b + 1] - start


def padded(n):
    """Shared-memory row stride for rows of ``n`` values: odd, so consecutive rows start in different banks."""
    return n + 1 if n % 2 == 0 else n


def make_tile_load(ROWS, HEAD_DIM, STRIDE, NTHREADS, ACC):
    """``load(src, b, row0, h, nrows, dst)``: ``dst[r, d] = src[b, row0 + r, h, d]`` as ``ACC``, zeros past ``nrows``.

    Consecutive threads take consecutive ``d``: coalesced global reads when the
    head dimension is contiguous.  Rows at or past ``nrows`` are written as zeros
    so that a partial tile contributes nothing (and reads no memory it does not own).
    """
    ZERO = ACC(0)
    TOTAL = ROWS * HEAD_DIM

    @device_function
    def load(src, b, row0, h, nrows, dst):
        for idx in range(cuda.threadIdx.x, TOTAL, NTHREADS):
            r = idx // HEAD_DIM  # HEAD_DIM is a compile-time constant: a multiply-shift, not a division
            d = idx - r * HEAD_DIM
            if r < nrows:
                dst[U(r * STRIDE + d)] = ACC(src[U(b), U(row0 + r), U(h), U(d)])
            else:
                dst[U(r * STRIDE + d)] = ZERO

    return load


def make_mm_abt(TR, TC, THREADS_C, KDIM, A_STRIDE, B_STRIDE, ACC):
    """``mm(a, b, c, ty, tx)``: ``c[r, j] = sum_d a[ty*TR + r, d] * b[tx + j*THREADS_C, d]`` (C = A B^T).

    ``a`` and ``b`` are shared-memory tiles with rows of ``KDIM`` values; ``c`` is
    the thread's ``TR x TC`` register micro-tile, overwritten.  Per ``d`` each
    thread loads ``TR + TC`` values and does ``TR * TC`` fused multiply-adds.
    """
    ZERO = ACC(0)

    @device_function
    def step(a, b, c, ty, tx, d, a_reg, b_reg):
        for r in range(TR):
            a_reg[r] = a[U((ty * TR + r) * A_STRIDE + d)]
        for j in range(TC):
            b_reg[j] = b[U((tx + j * THREADS_C) * B_STRIDE + d)]
        for r in range(TR):
            for j in range(TC):
                c[r, j] += a_reg[r] * b_reg[j]

    @device_function
    def mm(a, b, c, ty, tx):
        a_reg = cuda.local.array(TR, ACC)
        b_reg = cuda.local.array(TC, ACC)
        for r in range(TR):
            for j in range(TC):
                c[r, j] = ZERO
        # the reduction loop unrolled 4 times by hand (LLVM leaves a loop of this size
        # rolled): loads get immediate offsets and the loop overhead is amortised
        for d0 in range(0, KDIM - KDIM % UNROLL, UNROLL):
            step(a, b, c, ty, tx, d0, a_reg, b_reg)
            step(a, b, c, ty, tx, d0 + 1, a_reg, b_reg)
            step(a, b, c, ty, tx, d0 + 2, a_reg, b_reg)
            step(a, b, c, ty, tx, d0 + 3, a_reg, b_reg)
        for d in range(KDIM - KDIM % UNROLL, KDIM):
            step(a, b, c, ty, tx, d, a_reg, b_reg)

    return mm


def make_mm_acc(TR, TD, THREADS_C, KDIM, HEAD_DIM, P_STRIDE, V_STRIDE, ACC, TRANSPOSE_P=False):
    """``mm(p, v, acc, ty, tx)``: ``acc[r, c] += sum_k P[row_r, k] * v[k, tx + c*THREADS_C]`` (acc += P V).

    ``P[row, k]`` is ``p[row * P_STRIDE + k]``, or ``p[k * P_STRIDE + row]`` with
    ``TRANSPOSE_P`` (the backward's ``P^T dO`` and ``dS^T Q``).  Dims past
    ``HEAD_DIM`` (when ``THREADS_C`` does not divide it) are skipped.
    """
    EVEN = HEAD_DIM % THREADS_C == 0
    ZERO = ACC(0)

    @device_function
    def step(p, v, acc, ty, tx, k, p_reg, v_reg):
        for r in range(TR):
            if TRANSPOSE_P:
                p_reg[r] = p[U(k * P_STRIDE + ty * TR + r)]
            else:
                p_reg[r] = p[U((ty * TR + r) * P_STRIDE + k)]
        for c in range(TD):
            d = tx + c * THREADS_C
            if EVEN or d < HEAD_DIM:
                v_reg[c] = v[U(k * V_STRIDE + d)]
            else:
                v_reg[c] = ZERO                              # a dim past HEAD_DIM: never stored
        for r in range(TR):
            for c in range(TD):
                acc[r, c] += p_reg[r] * v_reg[c]

    @device_function
    def mm(p, v, acc, ty, tx):
        p_reg = cuda.local.array(TR, ACC)
        v_reg = cuda.local.array(TD, ACC)
        for k0 in range(0, KDIM - KDIM % UNROLL, UNROLL):   # unrolled by hand, as in make_mm_abt
            step(p, v, acc, ty, tx, k0, p_reg, v_reg)
            step(p, v, acc, ty, tx, k0 + 1, p_reg, v_reg)
            step(p, v, acc, ty, tx, k0 + 2, p_reg, v_reg)
            step(p, v, acc, ty, tx, k0 + 3, p_reg, v_reg)
        for k in range(KDIM - KDIM % UNROLL, KDIM):
            step(p, v, acc, ty, tx, k, p_reg, v_reg)

    return mm


def make_row_allreduce(TR, THREADS_C, NTHREADS, ACC, is_max, ROW_SYNC=False):
    """``reduce(vals, scratch, ty, tx)``: every thread of a row ends with the row's max (or sum) in ``vals[r]``.

    GPU: butterfly ``shfl_xor`` over the ``THREADS_C`` consecutive lanes of the
    row (log2(THREADS_C) steps, no shared memory, no barrier).  Simulator: write
    partials to ``scratch[row, tx]``, barrier, read them all back, barrier.
    ``scratch`` holds ``ROWS * THREADS_C`` values (unused on the GPU).  ``ROW_SYNC``: the simulator's barriers
    are over the row's own threads (``_sync.group_sync``), not the block (a warp-specialised kernel's consumers,
    whose producer never reaches their barriers).
    """
    assert THREADS_C & (THREADS_C - 1) == 0 and THREADS_C <= 32
    STEPS = int(math.log2(THREADS_C))
    # lanes that exist: a block of fewer than 32 threads has a partial warp
    LANES = FULL_MASK if NTHREADS >= 32 else (1 << NTHREADS) - 1

    if not SIMULATOR:
        @device_function
        def reduce_gpu(vals, scratch, ty, tx):
            for r in range(TR):
                x = vals[r]
                offset = THREADS_C >> 1
                for _ in range(STEPS):
                    y = cuda.shfl_xor_sync(LANES, x, offset)
                    x = max(x, y) if is_max else x + y
                    offset >>= 1
                vals[r] = x

        return reduce_gpu

    if ROW_SYNC:
        @device_function
        def sync(ty):
            group_sync(("row", ty), THREADS_C)
    else:
        @device_function
        def sync(ty):
            cuda.syncthreads()

    @device_function
    def reduce_sim(vals, scratch, ty, tx):
        for r in range(TR):
            scratch[(ty * TR + r) * THREADS_C + tx] = vals[r]
        sync(ty)
        for r in range(TR):
            x = scratch[(ty * TR + r) * THREADS_C]
            for t in range(1, THREADS_C):
                y = scratch[(ty * TR + r) * THREADS_C + t]
                x = max(x, y) if is_max else x + y
            vals[r] = x
        sync(ty)

    return reduce_sim


def scratch_size(ROWS, THREADS_C):
    """Shared-memory values the row reduction needs (only the simulator uses them)."""
    return ROWS * THREADS_C if SIMULATOR else 0


def np_acc(dtype):
    """The accumulation type for an input dtype: float64 for float64, float32 otherwise."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32
