"""cp.async copies of a tile of rows into shared memory, for the tensor-core kernels: row-major with padded strides
(``tc_padded_words``: the mma.sync kernels' ``ldmatrix`` reads) or 128-byte-swizzled (the Hopper kernels' wgmma
operands).  Shared by ``forward_tc`` / ``backward_tc`` and ``forward_wgmma`` / ``backward_wgmma``."""
from functools import lru_cache

from numba import cuda

from ._jit import device_function
from ._mma import memory_primitives
from ._tiles import U
from ._wgmma import SWIZZLE_BYTES, swizzled_offset


def tc_padded_words(n_words):
    """Row stride (in 32-bit words) of a shared tile: 4 (mod 8), conflict-free for 8-row x 4-word fragment reads."""
    return n_words + (4 - n_words % 8) % 8


@lru_cache(maxsize=None)
def make_async_tile_copy(NROWS, ROW_WORDS, STRIDE, HEAD_WORDS, CW, NTHREADS):
    """``copy(src, src_base, src_row, row0, nrows, smem, dst)``: cp.async ``NROWS`` rows into ``smem[dst:]``.

    Rows ``row0 ..`` of ``src`` (a word view; ``src_base`` the word offset of its row 0 in this
    (batch, head), ``src_row`` words per row), ``CW`` words per copy, ``ROW_WORDS`` words per row
    (the head dim padded to 16), rows ``STRIDE`` words apart in shared memory.  Rows at or past
    ``nrows`` and words past ``HEAD_WORDS`` are zero-filled: the padding must be 0, not stale
    shared memory (0 x NaN is NaN in an mma).  The caller commits.
    """
    CHUNKS = ROW_WORDS // CW
    cp_async = memory_primitives()["cp_async16" if CW == 4 else "cp_async4"]
    # a whole tile of unpadded rows: a compile-time trip count, no bounds, the source offset stepped by one
    # add per copy.  Threads take chunk columns, ROW_STEP rows per pass; where the chunks of a row do not
    # divide the threads (head dims 80, 96, 112: 10, 12, 14 chunks) the last NTHREADS % CHUNKS threads idle,
    # and where the passes do not divide the rows the last pass is bounded
    FAST = ROW_WORDS == HEAD_WORDS and CHUNKS <= NTHREADS
    ROW_STEP = NTHREADS // CHUNKS if FAST else 0
    ITERS = -(-NROWS // ROW_STEP) if FAST else 0
    ALL_ACTIVE = NTHREADS % CHUNKS == 0
    LAST_FULL = FAST and NROWS % ROW_STEP == 0

    @device_function
    def copy(src, src_base, src_row, row0, nrows, smem, dst):
        if FAST and nrows >= NROWS:
            r0 = cuda.threadIdx.x // CHUNKS
            c = (cuda.threadIdx.x - r0 * CHUNKS) * CW
            d = U(dst + r0 * STRIDE + c)
            s = src_base + (row0 + r0) * src_row + c
            if ALL_ACTIVE or r0 < ROW_STEP:
                for it in range(ITERS):
                    if LAST_FULL or it < ITERS - 1 or r0 + it * ROW_STEP < NROWS:
                        cp_async(smem, d + U(it * ROW_STEP * STRIDE), src, s, 4 * CW)
                    s += ROW_STEP * src_row
            return
        for idx in range(cuda.threadIdx.x, NROWS * CHUNKS, NTHREADS):
            r = idx // CHUNKS
            c = (idx - r * CHUNKS) * CW
            ok = r < nrows and c < HEAD_WORDS
            row = row0 + r if ok else row0             # a zero fill still names a valid source address
            col = c if ok else 0
            cp_async(smem, U(dst + r * STRIDE + c), src, src_base + row * src_row + col, 4 * CW if ok else 0)

    return copy


@lru_cache(maxsize=None)
def make_swizzled_tile_copy(NROWS, ROW_WORDS, HEAD_WORDS, NTHREADS):
    """``make_async_tile_copy``'s ``copy`` into a 128-byte-swizzled tile (``_wgmma``: blocks of 64 columns,
    ``NROWS`` rows of 128 bytes each, chunk ``j`` of row ``r`` at chunk ``j ^ (r % 8)``), 16 bytes per cp.async.
    A whole tile of unpadded rows: thread ``tid`` copies chunk ``tid % CHUNKS`` of rows ``tid // CHUNKS + i
    ROW_STEP``; ``ROW_STEP`` a multiple of 8, so the chunk's swizzled place is the same in every row it copies
    and its shared offset steps by ``ROW_STEP`` rows."""
    CHUNKS = ROW_WORDS // 4
    cp_async = memory_primitives()["cp_async16"]
    ROW_STEP = NTHREADS // CHUNKS
    FAST = ROW_WORDS == HEAD_WORDS and NTHREADS % CHUNKS == 0 and ROW_STEP % 8 == 0 and NROWS % ROW_STEP == 0
    ITERS = NROWS // ROW_STEP if FAST else 0
    ROW_WORDS_SMEM = SWIZZLE_BYTES // 4

    @device_function
    def copy(src, src_base, src_row, row0, nrows, smem, dst):
        if FAST and nrows >= NROWS:
            r0 = cuda.threadIdx.x // CHUNKS
            c = cuda.threadIdx.x - r0 * CHUNKS
            d = U(dst + swizzled_offset(NROWS, r0, 8 * c) // 4)
            s = src_base + (row0 + r0) * src_row + 4 * c
            for it in range(ITERS):
                cp_async(smem, d + U(it * ROW_STEP * ROW_WORDS_SMEM), src, s, 16)
                s += ROW_STEP * src_row
            return
        for idx in range(cuda.threadIdx.x, NROWS * CHUNKS, NTHREADS):
            r = idx // CHUNKS
            c = idx - r * CHUNKS
            ok = r < nrows and 4 * c < HEAD_WORDS
            row = row0 + r if ok else row0             # a zero fill still names a valid source address
            col = 4 * c if ok else 0
            cp_async(smem, U(dst + swizzled_offset(NROWS, r, 8 * c) // 4), src, src_base + row * src_row + col,
                     16 if ok else 0)

    return copy
