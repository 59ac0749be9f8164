"""Hopper's warpgroup MMA primitives (flashnb/kernels/_wgmma.py) against NumPy, one warpgroup, one product.

The operands are written into shared memory by plain stores at ``swizzled_offset`` (the layout the forward's
copies use), the product runs through ``wgmma_ss`` (A and B K-major: ``A B^T`` of two row-major tiles) or
``wgmma_rs`` (A in registers as ``mma.m16n8k16``'s a fragments, B MN-major: ``A B`` of a row-major B), and
each thread writes its accumulators out by the m16n8 accumulator layout.  On an H100 this checks that the
descriptors, the swizzle and the fragment layouts are the hardware's; in the simulator it runs the twin,
which reads the same bytes through the hardware's address rule, so the kernels' layouts are checked in CI.
Products of 16-bit values are exact in float32's 24 bits only for short sums; the bound is float32's
accumulation error over K terms of the absolute products (``K u sum |a b|``), and a wrong layout, stride or
swizzle moves entries by O(1).

e4m3 (``dtype_name="e4m3"``, ``m64nNk32``, both operands K-major, FP8 attention's products, issue 45): bytes in
shared memory (``wgmma_ss``, ``A B^T``) and A in registers as four bytes a word (``wgmma_rs``: rows ``g`` / ``g +
8`` of the warp's 16, columns ``32 ks + 4 t ..`` and ``+ 16``), B K-major.  The codes are random bytes (NaN codes
excepted), read by ``reference.fp8.dequantize_e4m3``; their products are exact in float32, but Hopper's FP8
tensor cores are reported to add them with fewer than float32's bits (FlashAttention-3 and DeepSeek-V3 promote
partial sums for that reason), so the bound is ``2^-8 sum |a b|``: a wrong layout moves an entry by O(1) of it.

tf32 (``dtype_name="tf32"``, ``m64nNk8``, both operands K-major): float32 words in shared memory (``wgmma_ss``,
``A B^T``) and A in registers as ``mma.m16n8k8``'s tf32 a fragments with B K-major (``wgmma_rs``, ``A B^T`` of a
row-major B: P V with V stored transposed).  The inputs are float32 with all 23 mantissa bits random; the oracle
is the float64 product of the values the hardware reads (PTX: the low 13 bits truncated), so a twin or layout
that reads the bits otherwise misses by ~2**-11 of a product.  Products of tf32 values are exact and the
oracle's float64 sum is within K 2**-53 sum |a b|, so the only error is the hardware's float32 accumulation:
the same ``K u sum |a b|`` bound (with a factor 2 for its unspecified rounding), K + 1 terms where the
accumulator is added.
"""
import numpy as np
import pytest
from numba import cuda

from flashnb.kernels._jit import SIMULATOR, device_function
from reference.fp8 import dequantize_e4m3
from flashnb.kernels._wgmma import (SMEM_ALIGN, chunk_offset, fence_proxy_async, k_major_steps, make_wgmma, mn_major_steps,
                                    swizzled_offset)

# (N, K): the swizzled rows are 64 columns, so K-major operands (ss) need K % 64 == 0, MN-major ones (rs)
# N % 64 == 0; the forward's products: S = Q K_j^T (N = BLOCK_K keys, K = the head dim), P V_j (N = the head dim)
# (both tiles within the 48 KB of shared memory a launch has without opting in)
SS_CASES = [(16, 64), (32, 128)] if SIMULATOR else [(16, 64), (64, 128), (128, 64), (176, 64), (16, 256)]
RS_CASES = [(64, 16), (128, 32)] if SIMULATOR else [(64, 16), (64, 128), (128, 64), (128, 176), (256, 64)]
DTYPES = ("float16", "bfloat16")
# tf32 (N, K): K = 8 a k-step, 32 values a swizzled row; the simulator runs 1-2 k-steps (5 once: the step to
# the second block of rows), the GPU up to 4 blocks
# (tiles within the 48 KB of shared memory a launch has without opting in)
TF32_SS_CASES = ([(8, 16), (64, 8), (128, 16), (16, 40)] if SIMULATOR
                 else [(8, 32), (64, 64), (128, 32), (96, 64), (256, 32), (16, 128)])
TF32_RS_CASES = ([(8, 8), (64, 16), (128, 8)] if SIMULATOR
                 else [(8, 128), (64, 32), (128, 64), (176, 64), (256, 32)])
# e4m3 (N, K): K = 32 a k-step, 128 values a swizzled row (the simulator crosses into the second block at K 160)
E4M3_SS_CASES = [(8, 32), (16, 160)] if SIMULATOR else [(8, 128), (64, 128), (128, 256), (256, 128), (16, 512)]
E4M3_RS_CASES = [(8, 64), (64, 32)] if SIMULATOR else [(8, 128), (64, 64), (128, 128), (256, 64)]


def _words(x):
    """uint32 view of a 16-bit array whose last dimension is even."""
    return np.ascontiguousarray(x).view(np.uint32)


@device_function
def copy_swizzled(smem, off, src, rows, chunks):
    """The word array ``src`` (``rows`` rows of ``chunks`` 16-byte chunks) into the 128-byte-swizzled tile at
    byte ``off`` of ``smem``, by the warpgroup: chunk ``j`` of row ``r`` at ``swizzled_offset(rows, r, 8 j)``
    (16-bit columns ``8 j ..``, tf32 columns ``4 j ..``)."""
    for i in range(cuda.threadIdx.x, rows * chunks, 128):
        r, j = i // chunks, i % chunks
        at = (off + swizzled_offset(rows, r, 8 * j)) // 4
        for w in range(4):
            smem[at + w] = src[r, 4 * j + w]


@device_function
def store_acc(out, acc):
    """This thread's accumulators (per warp ``w``: ``mma``'s m16n8 layout, rows ``16 w + g (+ 8)``, columns
    ``8 j + 2 t (+ 1)``) into the 64 x N ``out``."""
    lane = cuda.threadIdx.x % 32
    w, g, t = cuda.threadIdx.x // 32, lane // 4, lane % 4
    for j in range(acc.shape[0]):
        for e in range(4):
            out[16 * w + g + 8 * (e // 2), 8 * j + 2 * t + e % 2] = acc[j, e]


@device_function
def load_a_fragments(a, regs):
    """``wgmma_rs``'s A fragments of this thread from the word array ``a`` (64 rows), 4 words a k-step: words
    ``8 ks + t``, ``+ 4`` of rows ``16 w + g``, ``+ 8`` (``mma.m16n8k16``'s a for 16-bit pairs, ``m16n8k8``'s for
    tf32)."""
    lane = cuda.threadIdx.x % 32
    w, g, t = cuda.threadIdx.x // 32, lane // 4, lane % 4
    for ks in range(regs.shape[0] // 4):
        regs[4 * ks + 0] = a[16 * w + g, 8 * ks + t]
        regs[4 * ks + 1] = a[16 * w + g + 8, 8 * ks + t]
        regs[4 * ks + 2] = a[16 * w + g, 8 * ks + t + 4]
        regs[4 * ks + 3] = a[16 * w + g + 8, 8 * ks + t + 4]


def _make_ss(N, K, dtype_name):
    """out (64 x N) = A (64 x K) B^T, B (N x K): both tiles K-major in shared memory, 16-bit values or (``"tf32"``)
    float32 words with tf32 products."""
    vals = {"tf32": 4, "e4m3": 16}.get(dtype_name, 8)          # values a 16-byte chunk
    a_off, b_off = 0, _tile_bytes(64, K, vals)                  # a multiple of 1024 bytes
    steps = K // (2 * vals)                                     # k-steps: 16 values, 8 tf32, 32 e4m3
    wgmma = make_wgmma("ss", dtype_name, N, k_major_steps(64, steps), k_major_steps(N, steps))
    fence = fence_proxy_async()
    NT = N // 8
    U32, F32 = np.dtype(np.uint32), np.float32

    @cuda.jit
    def kern(a, b, out):
        smem = cuda.shared.array(0, U32, alignment=SMEM_ALIGN)
        copy_swizzled(smem, a_off, a, 64, K // vals)           # 16-byte chunks of A, then of B
        copy_swizzled(smem, b_off, b, N, K // vals)
        fence()
        cuda.syncthreads()
        acc = cuda.local.array((NT, 4), F32)
        for j in range(NT):
            for e in range(4):
                acc[j, e] = F32(7.0)                             # scale-d = 0 must ignore it
        wgmma(acc, smem, a_off, b_off, 0)
        store_acc(out, acc)

    return kern, b_off + _tile_bytes(N, K, vals)


def _make_rs(N, K, dtype_name):
    """out (64 x N) = 0.5 + A (64 x K) B: A's fragments from global memory; B MN-major (K x N words of pairs) for
    16-bit values, K-major (N x K float32 words: PTX has no transposed B for .tf32) for ``"tf32"``."""
    if dtype_name == "tf32":
        wgmma = make_wgmma("rs", "tf32", N, (), k_major_steps(N, K // 8))
        rows, chunks, nregs, shared = N, K // 4, 4 * (K // 8), _tile_bytes(N, K, 4)
    elif dtype_name == "e4m3":                                   # K-major B too: bytes, 32 a k-step
        wgmma = make_wgmma("rs", "e4m3", N, (), k_major_steps(N, K // 32))
        rows, chunks, nregs, shared = N, K // 16, 4 * (K // 32), _tile_bytes(N, K, 16)
    else:                                                        # 64-column blocks of B, K rows each
        wgmma = make_wgmma("rs", dtype_name, N, (), mn_major_steps(K // 16), b_lbo=K * 128, trans_b=1)
        rows, chunks, nregs, shared = K, N // 8, 4 * (K // 16), K * N * 2
    fence = fence_proxy_async()
    NT = N // 8
    U32, F32 = np.dtype(np.uint32), np.float32

    @cuda.jit
    def kern(a, b, out):
        smem = cuda.shared.array(0, U32, alignment=SMEM_ALIGN)
        copy_swizzled(smem, 0, b, rows, chunks)
        fence()
        cuda.syncthreads()
        regs = cuda.local.array(nregs, np.uint32)
        load_a_fragments(a, regs)                                # mma.m16n8k16's a (word pairs), m16n8k8's (tf32)
        acc = cuda.local.array((NT, 4), F32)
        for j in range(NT):
            for e in range(4):
                acc[j, e] = F32(0.5)                             # scale-d = 1 adds to it
        wgmma(acc, regs, smem, 0, 1)
        store_acc(out, acc)

    return kern, shared


def _tile_bytes(rows, k, vals):
    """Bytes of a K-major swizzled tile of ``vals`` values a 16-byte chunk: one block of ``rows`` 128-byte rows per
    8 chunks of k (a partial block still spans whole rows: the swizzle spreads a row's chunks over all 128
    bytes)."""
    return rows * 128 * -(-k // (8 * vals))


def _float32_words(rng, shape):
    """Random float32 with all mantissa bits random: (uint32 words, float64 of the tf32 values the hardware reads:
    the low 13 bits truncated), plus the round-to-nearest reading for the failure message."""
    x = rng.standard_normal(shape).astype(np.float32)
    bits = x.view(np.uint32)
    truncated = (bits & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)
    nearest = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)
    return bits, truncated, nearest


def _sixteen(rng, shape, dtype_name):
    """Random values in the 16-bit format: (uint16 bits, float64 values)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype_name == "float16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)            # bfloat16 by truncation: exact values below
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _check(out, ref, absprod, K, note=""):
    bound = 2 * K * 2.0 ** -24 * absprod + 1e-30
    err = np.abs(out.astype(np.float64) - ref)
    worst = np.unravel_index(err.argmax(), err.shape)
    assert np.all(err <= bound), f"max error {err.max()} (bound {bound[worst]}){note}"


def _nearest_note(out, ref_nearest, seed):
    """For a failure message: the data's seed, and how far ``out`` is from the product of the operands rounded to
    nearest instead of truncated (the hardware reading them otherwise than PTX says)."""
    err = np.abs(out.astype(np.float64) - ref_nearest).max()
    return f"; seed {seed}; vs round-to-nearest operands: max error {err}"


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("N,K", SS_CASES)
def test_wgmma_ss_is_a_times_b_transposed(N, K, dtype_name):
    rng = np.random.default_rng(N * 1000 + K)
    a_bits, a = _sixteen(rng, (64, K), dtype_name)
    b_bits, b = _sixteen(rng, (N, K), dtype_name)
    kern, shared = _make_ss(N, K, dtype_name)
    out = np.full((64, N), np.nan, np.float32)                   # poisoned: every entry must be written
    d_out = cuda.to_device(out)
    kern[1, 128, 0, shared](cuda.to_device(_words(a_bits)), cuda.to_device(_words(b_bits)), d_out)
    _check(d_out.copy_to_host(), a @ b.T, np.abs(a) @ np.abs(b).T, K)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("N,K", RS_CASES)
def test_wgmma_rs_is_registers_times_mn_major(N, K, dtype_name):
    rng = np.random.default_rng(N * 1000 + K + 1)
    a_bits, a = _sixteen(rng, (64, K), dtype_name)
    b_bits, b = _sixteen(rng, (K, N), dtype_name)
    kern, shared = _make_rs(N, K, dtype_name)
    out = np.full((64, N), np.nan, np.float32)
    d_out = cuda.to_device(out)
    kern[1, 128, 0, shared](cuda.to_device(_words(a_bits)), cuda.to_device(_words(b_bits)), d_out)
    _check(d_out.copy_to_host(), 0.5 + a @ b, 0.5 + np.abs(a) @ np.abs(b), K)


def test_swizzled_offsets_cover_the_tile_once():
    """The copies' layout is a permutation of the tile's 16-byte chunks, inside 1024-byte atoms."""
    for rows, cols in ((8, 64), (64, 128), (128, 256)):
        offs = sorted(chunk_offset(rows, r, c) for r in range(rows) for c in range(0, cols, 8))
        assert offs == list(range(0, rows * cols * 2, 16))


@pytest.mark.parametrize("kind,N,K", [("ss",) + c for c in TF32_SS_CASES] + [("rs",) + c for c in TF32_RS_CASES])
def test_wgmma_tf32_is_a_times_b_transposed(kind, N, K):
    """tf32 operands, B (N x K) K-major either way: "ss" out = A B^T, "rs" (A's fragments in registers, added to
    0.5) out = 0.5 + A B^T; against the float64 product of the operands as the hardware reads them."""
    seed = np.random.SeedSequence().entropy                      # fresh data, reproducible from the message
    rng = np.random.default_rng(seed)
    a_bits, a, a_near = _float32_words(rng, (64, K))
    b_bits, b, b_near = _float32_words(rng, (N, K))
    kern, shared = (_make_ss if kind == "ss" else _make_rs)(N, K, "tf32")
    c = 0.0 if kind == "ss" else 0.5
    d_out = cuda.to_device(np.full((64, N), np.nan, np.float32))  # poisoned: every entry must be written
    kern[1, 128, 0, shared](cuda.to_device(a_bits), cuda.to_device(b_bits), d_out)
    out = d_out.copy_to_host()
    _check(out, c + a @ b.T, c + np.abs(a) @ np.abs(b).T, K + (kind == "rs"),
           _nearest_note(out, c + a_near @ b_near.T, seed))


def _e4m3(rng, shape):
    """Random ``float8_e4m3fn`` codes, NaN codes excepted: (uint32 words of the bytes, float64 values)."""
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 0x01                          # S.1111.111 (NaN) -> S.1111.110 (448)
    return np.ascontiguousarray(codes).view(np.uint32), dequantize_e4m3(codes)


@pytest.mark.parametrize("kind,N,K", [("ss",) + c for c in E4M3_SS_CASES] + [("rs",) + c for c in E4M3_RS_CASES])
def test_wgmma_e4m3_is_a_times_b_transposed(kind, N, K):
    """e4m3 operands, B (N x K) K-major either way: "ss" out = A B^T, "rs" (A's bytes in registers, added to 0.5)
    out = 0.5 + A B^T; against the float64 product of the codes' values."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    a_words, a = _e4m3(rng, (64, K))
    b_words, b = _e4m3(rng, (N, K))
    kern, shared = (_make_ss if kind == "ss" else _make_rs)(N, K, "e4m3")
    c = 0.0 if kind == "ss" else 0.5
    d_out = cuda.to_device(np.full((64, N), np.nan, np.float32))  # poisoned: every entry must be written
    kern[1, 128, 0, shared](cuda.to_device(a_words), cuda.to_device(b_words), d_out)
    out = d_out.copy_to_host().astype(np.float64)
    err, bound = np.abs(out - (c + a @ b.T)), 2.0 ** -8 * (c + np.abs(a) @ np.abs(b).T)
    assert np.all(err <= bound), f"max error {np.nanmax(err)} (seed {seed})"


def test_wgmma_e4m3_rejects_a_transposed_operand():
    """PTX has no transpose for 8-bit operands: an MN-major B, or A, is refused before anything is built."""
    with pytest.raises(ValueError, match="trans_b"):
        make_wgmma("ss", "e4m3", 64, (0,), mn_major_steps(1), b_lbo=2048, trans_b=1)
    with pytest.raises(ValueError, match="trans_a"):
        make_wgmma("ss", "e4m3", 64, mn_major_steps(1), (0,), trans_a=1)


def test_wgmma_tf32_rejects_a_transposed_b():
    """PTX has no transpose for .tf32: an MN-major B is refused before anything is built."""
    with pytest.raises(ValueError, match="trans_b"):
        make_wgmma("rs", "tf32", 64, (), mn_major_steps(2), b_lbo=2048, trans_b=1)
