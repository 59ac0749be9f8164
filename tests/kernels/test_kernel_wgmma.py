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
"""
import numpy as np
import pytest
from numba import cuda

from flashnb.kernels._jit import SIMULATOR
from flashnb.kernels._wgmma import (SMEM_ALIGN, chunk_offset, fence_proxy_async, k_major_steps, make_wgmma, mn_major_steps,
                                    swizzled_offset)

# (N, K): the swizzled rows are 64 columns, so K-major operands (ss) need K % 64 == 0, MN-major ones (rs)
# N % 64 == 0; the forward's products: S = Q K_j^T (N = BLOCK_K keys, K = the head dim), P V_j (N = the head dim)
# (both tiles within the 48 KB of shared memory a launch has without opting in)
SS_CASES = [(16, 64), (32, 128)] if SIMULATOR else [(16, 64), (64, 128), (128, 64), (176, 64), (16, 256)]
RS_CASES = [(64, 16), (128, 32)] if SIMULATOR else [(64, 16), (64, 128), (128, 64), (128, 176), (256, 64)]
DTYPES = ("float16", "bfloat16")


def _words(x):
    """uint32 view of a 16-bit array whose last dimension is even."""
    return np.ascontiguousarray(x).view(np.uint32)


def _make_ss(N, K, dtype_name):
    """out (64 x N) = A (64 x K) B^T, B (N x K): both tiles K-major in shared memory."""
    b_bytes = N * K * 2
    a_off = 0
    b_off = -(-64 * K * 2 // 1024) * 1024
    wgmma = make_wgmma("ss", dtype_name, N, k_major_steps(64, K // 16), k_major_steps(N, K // 16))
    fence = fence_proxy_async()
    WORDS = (b_off + b_bytes) // 4
    NT = N // 8
    U32, F32 = np.dtype(np.uint32), np.float32

    @cuda.jit
    def kern(a, b, out):
        smem = cuda.shared.array(0, U32, alignment=SMEM_ALIGN)
        tid = cuda.threadIdx.x
        for i in range(tid, 64 * K // 8, 128):                  # 16-byte chunks of A, then of B
            r, c = i // (K // 8), 8 * (i % (K // 8))
            at = (a_off + swizzled_offset(64, r, c)) // 4
            for w in range(4):
                smem[at + w] = a[r, c // 2 + w]
        for i in range(tid, N * K // 8, 128):
            r, c = i // (K // 8), 8 * (i % (K // 8))
            at = (b_off + swizzled_offset(N, r, c)) // 4
            for w in range(4):
                smem[at + w] = b[r, c // 2 + w]
        fence()
        cuda.syncthreads()
        acc = cuda.local.array((NT, 4), F32)
        for j in range(N // 8):
            for e in range(4):
                acc[j, e] = F32(7.0)                             # scale-d = 0 must ignore it
        wgmma(acc, smem, a_off, b_off, 0)
        w, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        for j in range(N // 8):
            for e in range(4):
                out[16 * w + g + 8 * (e // 2), 8 * j + 2 * t + e % 2] = acc[j, e]

    return kern, WORDS * 4


def _make_rs(N, K, dtype_name):
    """out (64 x N) = 0.5 + A (64 x K) B (K x N): A's fragments from global memory, B MN-major."""
    lbo = K * 128                                                # 64-column blocks of B, K rows each
    wgmma = make_wgmma("rs", dtype_name, N, (), mn_major_steps(K // 16), b_lbo=lbo, trans_b=1)
    fence = fence_proxy_async()
    NT, NREGS = N // 8, 4 * (K // 16)
    U32, F32 = np.dtype(np.uint32), np.float32

    @cuda.jit
    def kern(a, b, out):
        smem = cuda.shared.array(0, U32, alignment=SMEM_ALIGN)
        tid = cuda.threadIdx.x
        for i in range(tid, K * N // 8, 128):
            r, c = i // (N // 8), 8 * (i % (N // 8))
            at = swizzled_offset(K, r, c) // 4
            for w in range(4):
                smem[at + w] = b[r, c // 2 + w]
        fence()
        cuda.syncthreads()
        w, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        regs = cuda.local.array(NREGS, np.uint32)
        for ks in range(K // 16):                                # mma.m16n8k16's a fragments
            regs[4 * ks + 0] = a[16 * w + g, 8 * ks + t]
            regs[4 * ks + 1] = a[16 * w + g + 8, 8 * ks + t]
            regs[4 * ks + 2] = a[16 * w + g, 8 * ks + t + 4]
            regs[4 * ks + 3] = a[16 * w + g + 8, 8 * ks + t + 4]
        acc = cuda.local.array((NT, 4), F32)
        for j in range(N // 8):
            for e in range(4):
                acc[j, e] = F32(0.5)                             # scale-d = 1 adds to it
        wgmma(acc, regs, smem, 0, 1)
        for j in range(N // 8):
            for e in range(4):
                out[16 * w + g + 8 * (e // 2), 8 * j + 2 * t + e % 2] = acc[j, e]

    return kern, K * N * 2


def _sixteen(rng, shape, dtype_name):
    """Random values in the 16-bit format: (uint16 bits, float64 values)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype_name == "float16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)            # bfloat16 by truncation: exact values below
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _check(out, ref, absprod, K):
    bound = 2 * K * 2.0 ** -24 * absprod + 1e-30
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= bound), f"max error {err.max()} (bound {bound[err.argmax() // err.shape[1], err.argmax() % err.shape[1]]})"


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
