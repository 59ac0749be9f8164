"""FlashAttention-2 backward as Numba CUDA kernels (SIMT), recomputing P from ``lse``.

Three kernels, as in FA2 section 3.1 / Algorithm 2:

1. ``preprocess``: ``delta_i = rowsum(dO_i * O_i)``, a few threads per (batch, head, query)
   (also the tensor-core backward's, on 32-bit words of 16-bit pairs).
2. ``dkdv``: one block per (key tile, key/value head, batch); the key tile stays
   in shared memory while the block walks every query tile (of every query head
   of its group, so grouped-query ``dK, dV`` are summed in registers, without
   atomics):

       S^T  = K_j Q_i^T                 (recompute)
       P^T  = exp2(S^T log2(e) - lse_i log2(e))           [0 where masked or lse_i = -inf]
       dV_j += (P^T * keep / (1 - p_drop)) dO_i
       dP^T = V_j dO_i^T
       dS^T = P^T * (dP^T * keep / (1 - p_drop) - delta_i)   [x (1 - tanh^2) through a softcap]
       dK_j += scale * dS^T Q_i
       dQ_i += scale * dS K_j           (ATOMIC_DQ: float atomics into an accumulator)

3. ``dq`` (deterministic mode): one block per (query tile, head, batch)
   recomputing S, P, dP, dS against every key tile and summing ``dQ`` in
   registers: no atomics, bit-identical run to run.

The oracle for this is ``reference.flash_backward``.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda

from ._jit import SIMULATOR, device_function, kernel, kernel_factory
from ._mma import memory_primitives, primitives, tf32_primitives
from ._scores import Mods, make_allowed_fn, make_score_fn, mask_block, philox_keep
from ._tiles import (U, tile_head_batch, make_mm_abt, make_mm_acc, make_row_allreduce, make_tile_load,
                     packed_tile_head_batch, padded, scratch_size, sequence_span)
from .forward import LOG2E, make_mask_bounds, make_window_helpers, tile_threads


@lru_cache(maxsize=None)
@kernel_factory
def make_preprocess(ACC_NAME, WORDS_OF=None, THREADS_C=1):
    """``delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]``; lse in log2 units, +inf for empty rows.

    ``THREADS_C`` (a power of two up to 32, ``preprocess_threads``) consecutive threads share a row: thread
    ``tx`` reads columns ``tx, tx + THREADS_C, ...``, so a warp's loads cover whole rows (one thread per row
    read 32 rows at a stride of ``nheads * headdim`` elements per load: 5x FA2's time, bench/results/
    h100-timeline-2026-11-23.md), and ``_tiles.make_row_allreduce`` sums the partials.  A block of 128 threads
    holds ``128 / THREADS_C`` rows of one (batch, head).

    ``WORDS_OF`` ("float16" / "bfloat16"): ``dout`` and ``out`` are 32-bit word views holding pairs of
    that format (the tensor-core backward's arrays), unpacked with ``_mma``'s ``unpack2``; "float32": word views
    of float32 values (the tf32 backward's), read as floats (``tf32_primitives``' bitcast).
    """
    ACC = np.dtype(ACC_NAME).type
    ZERO, LOG2E_T, POS_INF, NEG_INF = ACC(0), ACC(LOG2E), ACC(np.inf), ACC(-np.inf)
    ROWS = PREPROCESS_THREADS // THREADS_C
    SHIFT = THREADS_C.bit_length() - 1
    reduce_sum = make_row_allreduce(1, THREADS_C, PREPROCESS_THREADS, ACC, False)
    SCRATCH = max(1, scratch_size(ROWS, THREADS_C))

    if WORDS_OF == "float32":
        as_float = tf32_primitives()["as_float"]

        @device_function
        def col_dot(dout, out, b, i, h, c):
            return as_float(dout[b, i, h, c]) * as_float(out[b, i, h, c])
    elif WORDS_OF:
        unpack2 = primitives(WORDS_OF)[2]

        @device_function
        def col_dot(dout, out, b, i, h, c):
            d0, d1 = unpack2(dout[b, i, h, c])
            o0, o1 = unpack2(out[b, i, h, c])
            return d0 * o0 + d1 * o1
    else:
        @device_function
        def col_dot(dout, out, b, i, h, c):
            return ACC(dout[b, i, h, c]) * ACC(out[b, i, h, c])

    @kernel
    def preprocess(dout, out, lse, delta, lse2):
        chunk, h, b = tile_head_batch((out.shape[1] + ROWS - 1) // ROWS, out.shape[2])
        ty = cuda.threadIdx.x >> SHIFT
        tx = cuda.threadIdx.x & (THREADS_C - 1)
        i = chunk * ROWS + ty
        part = cuda.local.array(1, ACC)
        scratch = cuda.shared.array(SCRATCH, ACC)
        acc = ZERO
        if i < out.shape[1]:
            for c in range(tx, out.shape[3], THREADS_C):
                acc += col_dot(dout, out, b, i, h, c)
        part[0] = acc
        reduce_sum(part, scratch, ty, tx)                 # every thread of the block: the simulator's has barriers
        if i < out.shape[1] and tx == 0:
            delta[b, h, i] = part[0]
            x = ACC(lse[b, h, i])
            # exp2(s - lse2) must be 0 for a row that saw no key (lse = -inf): use +inf there
            lse2[b, h, i] = x * LOG2E_T if x != NEG_INF else POS_INF

    return preprocess


PREPROCESS_THREADS = 128


def preprocess_threads(ncols):
    """Threads per row of ``make_preprocess`` for rows of ``ncols`` columns: about four columns each, a power of
    two from 1 to 32 (to 4 in the simulator, which runs a Python thread per CUDA thread: 4 still exercises the
    strided columns and the reduction)."""
    return min(4 if SIMULATOR else 32, 1 << max(0, (ncols // 4).bit_length() - 1))


def preprocess_grid(seqlen_q, nheads, batch, threads_c):
    """Blocks of ``PREPROCESS_THREADS`` threads that ``make_preprocess(..., threads_c)`` needs."""
    return -(-seqlen_q // (PREPROCESS_THREADS // threads_c)) * nheads * batch


@lru_cache(maxsize=None)
def make_element_grad(ACC_NAME, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, HAS_WINDOW, HAS_ATTN_MASK,
                      HAS_BLOCK_MASK, MODS=None, CAPTURE_THREADS=0, FAST=False):
    """``grad(qk, dp, i, j, b, h, lse2_i, delta_i, dead, need_mask, ...) -> (p_dropped, ds)`` for one element:
    recomputed P and dS (before ``scale``); P = 0 where ``dead`` (the caller's mask, e.g. a mask_mod's bit) or,
    with ``need_mask``, where the masks disallow the pair.
    ``MODS``: the score_mod's chain rule, ``dS *= score_grad(scale * qk, b, h, i, j)`` where P > 0.
    ``FAST`` (float32, the tensor-core kernels): the exponent as their forward takes it, one MUFU.EX2
    (``exp2_ftz``: P below 2^-126 is 0) instead of ``math.exp2``'s range check and rescaling, and a masked
    element's exponent -inf by a select instead of a branch around the exponent, so that an element step is
    straight-line code and a row's lse and delta loads are shared by its elements.
    ``CAPTURE_THREADS``: with ``MODS.capture_grad``, the threads of the block below this count add the element's
    part of the gradients into captured arrays (``capture_grad(dS, ...)``, dS before the chain rule): a dK/dV
    kernel's threads that own their elements (two warps holding the same elements: one adds); 0: none (the dQ
    kernel, which computes the same elements again)."""
    ACC = np.dtype(ACC_NAME).type
    ZERO, ONE, LOG2E_T = ACC(0), ACC(1), ACC(LOG2E)
    MODS = MODS or Mods()
    HAS_SCORE_MOD = MODS.score_mod is not None
    INDEX32 = MODS.index32
    score_grad = MODS.score_grad
    capture_grad = MODS.capture_grad
    HAS_CAPTURE = capture_grad is not None and CAPTURE_THREADS > 0
    score = make_score_fn(ACC, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, MODS.score_mod)
    allowed = make_allowed_fn(HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MODS.mask_mod, mask_block(MODS))
    assert not FAST or ACC_NAME == "float32"
    exp2 = memory_primitives()["exp2_ftz"] if FAST else math.exp2
    NEG_INF = ACC(-np.inf)

    @device_function
    def grad(qk, dp, i, j, b, h, lse2_i, delta_i, dead, need_mask, seqlen_q, seqlen_k, off, scale, softcap, left,
             right, attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k, drop_threshold, drop_scale,
             seed_lo, seed_hi):
        b_in, h_in = b, h
        if HAS_SCORE_MOD and INDEX32:                    # (int32: no 64-bit index work a score)
            i_in, j_in = min(np.int32(i), np.int32(seqlen_q - 1)), min(np.int32(j), np.int32(seqlen_k - 1))
            b_in, h_in = np.int32(b), np.int32(h)
            x = score(qk, i_in, j_in, b_in, h_in, off, scale, softcap, attn_bias, alibi)
        elif HAS_SCORE_MOD:                              # (the user's function: indices inside the sequences)
            i_in, j_in = min(i, seqlen_q - 1), min(j, seqlen_k - 1)
            x = score(qk, i_in, j_in, b, h, off, scale, softcap, attn_bias, alibi)
        else:
            i_in, j_in = i, j
            x = score(qk, i, j, b, h, off, scale, softcap, attn_bias, alibi)
        if FAST:                                             # P = exp(S - lse); exp2(-inf) = 0 where masked
            x2 = x * LOG2E_T - lse2_i
            if dead:
                x2 = NEG_INF
            if need_mask and not allowed(i, j, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask,
                                         bm_q, bm_k):
                x2 = NEG_INF
            p = exp2(x2)
        elif dead or (need_mask and not allowed(i, j, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask,
                                                block_mask, bm_q, bm_k)):
            p = ZERO                                         # masked: no exp of a score that may be huge
        else:
            p = math.exp2(x * LOG2E_T - lse2_i)             # P = exp(S - lse)
        if HAS_DROPOUT:
            keep = drop_scale if philox_keep(seed_lo, seed_hi, b, h, i, j, drop_threshold) else ZERO
            p_drop = p * keep
            ds = p * (dp * keep - delta_i)
        else:
            p_drop = p
            ds = p * (dp - delta_i)
        if HAS_SOFTCAP:
            t = math.tanh(qk * scale / softcap)
            ds = ds * (ONE - t * t)                          # d/dx softcap*tanh(x/softcap) = 1 - tanh^2
        if HAS_SCORE_MOD and FAST and not HAS_CAPTURE:       # (evaluated everywhere; a select keeps dS = 0 where
            ds_mod = ds * ACC(score_grad(qk * scale, b_in, h_in, i_in, j_in))     # P = 0, whatever it gives there)
            ds = ZERO if p == ZERO else ds_mod
        elif HAS_SCORE_MOD:
            if p != ZERO:                                    # (masked: never evaluated; dS is 0 there)
                if HAS_CAPTURE and cuda.threadIdx.x < CAPTURE_THREADS:
                    capture_grad(ds, qk * scale, b_in, h_in, i_in, j_in)
                ds = ds * ACC(score_grad(qk * scale, b_in, h_in, i_in, j_in))
        return p_drop, ds

    return grad


@lru_cache(maxsize=None)
def make_round_to(FORMAT):
    """``round_to(x)``: a float32 ``x >= 0`` rounded to ``FORMAT`` ("float16" / "bfloat16": nearest, ties to
    even, as ``cvt.rn``), returned as float32.  Integer work on the bits (clear the dropped mantissa bits after
    adding half of them, plus one where the kept part is odd); float16's subnormals (below 2**-14, multiples
    of 2**-24) by adding and subtracting 0.5, whose float32 ulp is 2**-24."""
    bits = tf32_primitives()
    as_bits, as_float = bits["as_bits"], bits["as_float"]
    FP16 = FORMAT == "float16"
    DROP = np.uint32(13 if FP16 else 16)                 # float32's 23 mantissa bits less the format's 10 or 7
    HALF = np.uint32((1 << (int(DROP) - 1)) - 1)
    MASK = np.uint32((0xFFFFFFFF >> int(DROP)) << int(DROP))
    ONE = np.uint32(1)
    SUBNORMAL, POINT5 = np.float32(2.0 ** -14), np.float32(0.5)

    @device_function
    def round_to(x):
        if FP16 and x < SUBNORMAL:
            return (x + POINT5) - POINT5
        w = as_bits(x)
        return as_float(np.uint32((w + HALF + ((w >> DROP) & ONE)) & MASK))

    return round_to


@lru_cache(maxsize=None)
def make_query_tile_range(BLOCK_Q):
    """``query_tile_range(k_first, k_last, off, left, right, seqlen_q)``, for the dK/dV kernels."""

    @device_function
    def query_tile_range(k_first, k_last, off, left, right, seqlen_q):
        """Query tiles ``[lo, hi)`` holding a query that may see some key in ``[k_first, k_last]``."""
        lo = 0
        hi = (seqlen_q + BLOCK_Q - 1) // BLOCK_Q
        if right >= 0:
            lo = max(k_first - off - right, 0) // BLOCK_Q   # j <= i + off + right
        if left >= 0:
            i_max = k_last - off + left                        # j >= i + off - left
            hi = min(hi, i_max // BLOCK_Q + 1) if i_max >= 0 else 0
        return lo, hi

    return query_tile_range


@lru_cache(maxsize=None)
@kernel_factory
def make_dkdv(BLOCK_Q, BLOCK_K, HEAD_DIM, ACC_NAME, ATOMIC_DQ, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK,
              HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, VARLEN=False, P_FORMAT=None, MODS=None):
    """Build the dK/dV kernel (rows = keys, columns = queries); returns (kernel, shared bytes, threads).

    ``VARLEN``: a packed batch, as in ``forward.make_forward``: the blocks run over each sequence's key tiles;
    ``dq_accum`` stays the packed ``(1, total_q, nheads, headdim)`` accumulator (rows ``q_start + i``).
    ``MODS``: a ``flex_attention`` call's functions (``forward.make_forward``).
    ``P_FORMAT`` ("float16" / "bfloat16", the inputs' format): ``dV = P_drop^T dO`` takes ``P_drop`` rounded
    to that format, as the tensor-core kernels (and flash-attn) do.  The recomputed ``P`` of a row whose
    softmax is one key is not exactly 1 (``lse`` is stored in natural log and converted back to base 2: the
    round trip misses by an ulp for ~15% of values), and a float32 ``P = 1 - 2**-24`` moved a dV that lies on
    a tie of the 16-bit format to the other side (grouped heads summed: one bfloat16 ulp off the exact
    value); rounded, it is 1.
    """
    ACC = np.dtype(ACC_NAME).type
    ACC_DT = np.dtype(ACC)
    THREADS_R, THREADS_C = tile_threads(BLOCK_K, "rows"), tile_threads(BLOCK_Q, "cols")
    NTHREADS = THREADS_R * THREADS_C
    TR = BLOCK_K // THREADS_R                # key rows per thread
    TC = BLOCK_Q // THREADS_C                # query columns per thread
    TD = -(-HEAD_DIM // THREADS_C)           # dims per thread in dK, dV (and dQ)
    TRQ = max(1, BLOCK_Q // THREADS_R)       # query rows per thread in the dQ partial product (atomic dQ)
    EVEN_D = HEAD_DIM % THREADS_C == 0
    STRIDE = padded(HEAD_DIM)
    DS_STRIDE = padded(BLOCK_Q)
    K_OFF = 0
    V_OFF = K_OFF + BLOCK_K * STRIDE
    Q_OFF = V_OFF + BLOCK_K * STRIDE
    DO_OFF = Q_OFF + BLOCK_Q * STRIDE
    P_OFF = DO_OFF + BLOCK_Q * STRIDE        # P^T (dropped), then dS^T: BLOCK_K x BLOCK_Q
    L_OFF = P_OFF + BLOCK_K * DS_STRIDE      # lse_i * log2(e)
    D_OFF = L_OFF + BLOCK_Q                  # delta_i
    SMEM_N = D_OFF + BLOCK_Q
    SHARED_BYTES = SMEM_N * ACC_DT.itemsize
    ZERO, POS_INF = ACC(0), ACC(np.inf)
    assert not ATOMIC_DQ or TRQ >= 1, "atomic dQ needs BLOCK_Q >= min(16, BLOCK_K)"

    load_kv = make_tile_load(BLOCK_K, HEAD_DIM, STRIDE, NTHREADS, ACC)
    load_q = make_tile_load(BLOCK_Q, HEAD_DIM, STRIDE, NTHREADS, ACC)
    st_tile = make_mm_abt(TR, TC, THREADS_C, HEAD_DIM, STRIDE, STRIDE, ACC)        # K Q^T and V dO^T
    acc_tile = make_mm_acc(TR, TD, THREADS_C, BLOCK_Q, HEAD_DIM, DS_STRIDE, STRIDE, ACC)     # (.)^T-rows x Q/dO
    dq_tile = make_mm_acc(TRQ, TD, THREADS_C, BLOCK_K, HEAD_DIM, DS_STRIDE, STRIDE, ACC, TRANSPOSE_P=True)
    grad = make_element_grad(ACC_NAME, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, HAS_WINDOW,
                             HAS_ATTN_MASK, HAS_BLOCK_MASK, MODS, CAPTURE_THREADS=NTHREADS)
    _, tile_state = make_window_helpers(BLOCK_Q, BLOCK_K, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK,
                                        mask_block(MODS))
    ROUND_P = P_FORMAT is not None
    round_p = make_round_to(P_FORMAT or "bfloat16")

    query_tile_range = make_query_tile_range(BLOCK_Q)
    _, query_bounds = make_mask_bounds(BLOCK_Q, BLOCK_K, mask_block(MODS))

    @kernel
    def flash_dkdv(q, k, v, dout, lse2, delta, dk, dv, dq_accum, group, off, scale, softcap, left, right,
                   attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k, drop_threshold, drop_scale,
                   seed_lo, seed_hi, cu_seqlens_q, cu_seqlens_k):
        if VARLEN:                                        # this block's sequence, viewed as a dense batch's
            kt, hk, b = packed_tile_head_batch(cu_seqlens_k, k.shape[2])
            k_start, n_k = sequence_span(cu_seqlens_k, b)
            if kt * BLOCK_K >= n_k:
                return                                    # a key tile past its sequence: nothing to do
            q_start, n_q = sequence_span(cu_seqlens_q, b)
            q, dout = q[:, q_start:q_start + n_q], dout[:, q_start:q_start + n_q]
            lse2, delta = lse2[:, :, q_start:q_start + n_q], delta[:, :, q_start:q_start + n_q]
            k, v = k[:, k_start:k_start + n_k], v[:, k_start:k_start + n_k]
            dk, dv = dk[:, k_start:k_start + n_k], dv[:, k_start:k_start + n_k]
            off = n_k - n_q                               # bottom-right alignment per sequence
            dq_b, dq_row0 = 0, q_start                    # where query row i's dQ accumulates: [dq_b, dq_row0 + i]
        else:
            kt, hk, b = tile_head_batch((k.shape[1] + BLOCK_K - 1) // BLOCK_K, k.shape[2])
            dq_b, dq_row0 = b, 0
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        k0 = kt * BLOCK_K
        tid = cuda.threadIdx.x
        ty = tid // THREADS_C
        tx = tid - ty * THREADS_C
        k_last = min(k0 + BLOCK_K, seqlen_k) - 1

        smem = cuda.shared.array(0, ACC_DT)
        k_smem = smem[K_OFF:V_OFF]
        v_smem = smem[V_OFF:Q_OFF]
        q_smem = smem[Q_OFF:DO_OFF]
        do_smem = smem[DO_OFF:P_OFF]
        p_smem = smem[P_OFF:L_OFF]
        lse_smem = smem[L_OFF:D_OFF]
        delta_smem = smem[D_OFF:SMEM_N]

        s_reg = cuda.local.array((TR, TC), ACC)
        dp_reg = cuda.local.array((TR, TC), ACC)
        dk_acc = cuda.local.array((TR, TD), ACC)
        dv_acc = cuda.local.array((TR, TD), ACC)
        dq_part = cuda.local.array((TRQ, TD), ACC)
        for r in range(TR):
            for c in range(TD):
                dk_acc[r, c] = ZERO
                dv_acc[r, c] = ZERO

        load_kv(k, b, k0, hk, seqlen_k - k0, k_smem)
        load_kv(v, b, k0, hk, seqlen_k - k0, v_smem)
        qt_lo, qt_hi = query_tile_range(k0, k_last, off, left, right, seqlen_q)
        qt_lo, qt_hi = query_bounds(qt_lo, qt_hi, b, hk * group, group, k0, k_last, block_mask, bm_q, bm_k)
        for g in range(group):
            h = hk * group + g
            for qt in range(qt_lo, qt_hi):
                q0 = qt * BLOCK_Q
                q_last = min(q0 + BLOCK_Q, seqlen_q) - 1
                visible, need_mask = tile_state(b, h, q0, q_last, k0, seqlen_k, off, left, right,
                                                block_mask, bm_q, bm_k)
                if not visible:
                    continue                             # a skipped block: never loaded

                cuda.syncthreads()                       # the previous tile's readers are done
                load_q(q, b, q0, h, seqlen_q - q0, q_smem)
                load_q(dout, b, q0, h, seqlen_q - q0, do_smem)
                for t in range(tid, BLOCK_Q, NTHREADS):
                    i = q0 + t
                    # rows past the end: lse2 = +inf makes their P exactly 0
                    lse_smem[t] = lse2[b, h, i] if i < seqlen_q else POS_INF
                    delta_smem[t] = delta[b, h, i] if i < seqlen_q else ZERO
                cuda.syncthreads()

                st_tile(k_smem, q_smem, s_reg, ty, tx)   # S^T = K Q^T
                st_tile(v_smem, do_smem, dp_reg, ty, tx)  # dP^T = V dO^T
                for r in range(TR):
                    j = k0 + ty * TR + r
                    for c in range(TC):
                        il = tx + c * THREADS_C
                        p_drop, ds = grad(s_reg[r, c], dp_reg[r, c], q0 + il, j, b, h, lse_smem[il],
                                          delta_smem[il], False, need_mask, seqlen_q, seqlen_k, off, scale, softcap,
                                          left, right, attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                                          drop_threshold, drop_scale, seed_lo, seed_hi)
                        s_reg[r, c] = p_drop
                        dp_reg[r, c] = ds
                # dV += P_drop^T dO  (P_drop in the inputs' 16-bit format, as the tensor cores take it)
                for r in range(TR):
                    for c in range(TC):
                        p_smem[U((ty * TR + r) * DS_STRIDE + tx + c * THREADS_C)] = (
                            round_p(s_reg[r, c]) if ROUND_P else s_reg[r, c])
                cuda.syncthreads()
                acc_tile(p_smem, do_smem, dv_acc, ty, tx)
                cuda.syncthreads()
                # dK += dS^T Q (scale applied at the end)
                for r in range(TR):
                    for c in range(TC):
                        p_smem[U((ty * TR + r) * DS_STRIDE + tx + c * THREADS_C)] = dp_reg[r, c]
                cuda.syncthreads()
                acc_tile(p_smem, q_smem, dk_acc, ty, tx)
                if ATOMIC_DQ:
                    # dQ_i += dS K_j: this block's share, added atomically (blocks of other key tiles race here)
                    for r in range(TRQ):
                        for c in range(TD):
                            dq_part[r, c] = ZERO
                    dq_tile(p_smem, k_smem, dq_part, ty, tx)
                    for r in range(TRQ):
                        i = q0 + ty * TRQ + r
                        if i < seqlen_q:
                            for c in range(TD):
                                d = tx + c * THREADS_C
                                if EVEN_D or d < HEAD_DIM:
                                    cuda.atomic.add(dq_accum, (dq_b, dq_row0 + i, h, d), dq_part[r, c] * scale)

        for r in range(TR):
            j = k0 + ty * TR + r
            if j < seqlen_k:
                for c in range(TD):
                    d = tx + c * THREADS_C
                    if EVEN_D or d < HEAD_DIM:
                        dk[b, j, hk, d] = dk_acc[r, c] * scale
                        dv[b, j, hk, d] = dv_acc[r, c]

    return flash_dkdv, SHARED_BYTES, NTHREADS


@lru_cache(maxsize=None)
@kernel_factory
def make_dq(BLOCK_Q, BLOCK_K, HEAD_DIM, ACC_NAME, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK,
            HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, VARLEN=False, MODS=None):
    """Build the deterministic dQ kernel (rows = queries, columns = keys); returns (kernel, bytes, threads).
    ``VARLEN``: a packed batch, ``MODS``: a ``flex_attention`` call's functions, as in ``forward.make_forward``."""
    ACC = np.dtype(ACC_NAME).type
    ACC_DT = np.dtype(ACC)
    THREADS_R, THREADS_C = tile_threads(BLOCK_Q, "rows"), tile_threads(BLOCK_K, "cols")
    NTHREADS = THREADS_R * THREADS_C
    TR = BLOCK_Q // THREADS_R
    TC = BLOCK_K // THREADS_C
    TD = -(-HEAD_DIM // THREADS_C)
    EVEN_D = HEAD_DIM % THREADS_C == 0
    STRIDE = padded(HEAD_DIM)
    DS_STRIDE = padded(BLOCK_K)
    Q_OFF = 0
    DO_OFF = Q_OFF + BLOCK_Q * STRIDE
    K_OFF = DO_OFF + BLOCK_Q * STRIDE
    V_OFF = K_OFF + BLOCK_K * STRIDE
    DS_OFF = V_OFF + BLOCK_K * STRIDE
    SMEM_N = DS_OFF + BLOCK_Q * DS_STRIDE
    SHARED_BYTES = SMEM_N * ACC_DT.itemsize
    ZERO, POS_INF = ACC(0), ACC(np.inf)

    load_q = make_tile_load(BLOCK_Q, HEAD_DIM, STRIDE, NTHREADS, ACC)
    load_k = make_tile_load(BLOCK_K, HEAD_DIM, STRIDE, NTHREADS, ACC)
    s_tile = make_mm_abt(TR, TC, THREADS_C, HEAD_DIM, STRIDE, STRIDE, ACC)        # Q K^T and dO V^T
    dq_tile = make_mm_acc(TR, TD, THREADS_C, BLOCK_K, HEAD_DIM, DS_STRIDE, STRIDE, ACC)
    grad = make_element_grad(ACC_NAME, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, HAS_WINDOW,
                             HAS_ATTN_MASK, HAS_BLOCK_MASK, MODS)
    key_tile_range, tile_state = make_window_helpers(BLOCK_Q, BLOCK_K, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK,
                                                     mask_block(MODS))
    key_bounds, _ = make_mask_bounds(BLOCK_Q, BLOCK_K, mask_block(MODS))

    @kernel
    def flash_dq(q, k, v, dout, lse2, delta, dq, group, off, scale, softcap, left, right,
                 attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k, drop_threshold, drop_scale,
                 seed_lo, seed_hi, cu_seqlens_q, cu_seqlens_k):
        if VARLEN:                                        # this block's sequence, viewed as a dense batch's
            qt, h, b = packed_tile_head_batch(cu_seqlens_q, q.shape[2])
            q_start, n_q = sequence_span(cu_seqlens_q, b)
            if qt * BLOCK_Q >= n_q:
                return                                    # a query tile past its sequence: nothing to do
            k_start, n_k = sequence_span(cu_seqlens_k, b)
            q, dout = q[:, q_start:q_start + n_q], dout[:, q_start:q_start + n_q]
            dq = dq[:, q_start:q_start + n_q]
            lse2, delta = lse2[:, :, q_start:q_start + n_q], delta[:, :, q_start:q_start + n_q]
            k, v = k[:, k_start:k_start + n_k], v[:, k_start:k_start + n_k]
            off = n_k - n_q                               # bottom-right alignment per sequence
        else:
            qt, h, b = tile_head_batch((q.shape[1] + BLOCK_Q - 1) // BLOCK_Q, q.shape[2])
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        q0 = qt * BLOCK_Q
        hk = h // group
        tid = cuda.threadIdx.x
        ty = tid // THREADS_C
        tx = tid - ty * THREADS_C
        q_last = min(q0 + BLOCK_Q, seqlen_q) - 1

        smem = cuda.shared.array(0, ACC_DT)
        q_smem = smem[Q_OFF:DO_OFF]
        do_smem = smem[DO_OFF:K_OFF]
        k_smem = smem[K_OFF:V_OFF]
        v_smem = smem[V_OFF:DS_OFF]
        ds_smem = smem[DS_OFF:SMEM_N]

        s_reg = cuda.local.array((TR, TC), ACC)
        dp_reg = cuda.local.array((TR, TC), ACC)
        dq_acc = cuda.local.array((TR, TD), ACC)
        lse_reg = cuda.local.array(TR, ACC)
        delta_reg = cuda.local.array(TR, ACC)
        for r in range(TR):
            i = q0 + ty * TR + r
            lse_reg[r] = lse2[b, h, i] if i < seqlen_q else POS_INF
            delta_reg[r] = delta[b, h, i] if i < seqlen_q else ZERO
            for c in range(TD):
                dq_acc[r, c] = ZERO

        load_q(q, b, q0, h, seqlen_q - q0, q_smem)
        load_q(dout, b, q0, h, seqlen_q - q0, do_smem)
        kt_lo, kt_hi = key_tile_range(q0, q_last, off, left, right, seqlen_k)
        kt_lo, kt_hi = key_bounds(kt_lo, kt_hi, b, h, q0, q_last, block_mask, bm_q, bm_k)
        for kt in range(kt_lo, kt_hi):
            k0 = kt * BLOCK_K
            visible, need_mask = tile_state(b, h, q0, q_last, k0, seqlen_k, off, left, right,
                                            block_mask, bm_q, bm_k)
            if not visible:
                continue                                 # a skipped block: never loaded

            cuda.syncthreads()
            load_k(k, b, k0, hk, seqlen_k - k0, k_smem)
            load_k(v, b, k0, hk, seqlen_k - k0, v_smem)
            cuda.syncthreads()
            s_tile(q_smem, k_smem, s_reg, ty, tx)        # S = Q K^T
            s_tile(do_smem, v_smem, dp_reg, ty, tx)      # dP = dO V^T
            for r in range(TR):
                i = q0 + ty * TR + r
                for c in range(TC):
                    j = k0 + tx + c * THREADS_C
                    _, ds = grad(s_reg[r, c], dp_reg[r, c], i, j, b, h, lse_reg[r], delta_reg[r], False, need_mask,
                                 seqlen_q, seqlen_k, off, scale, softcap, left, right, attn_mask, attn_bias,
                                 alibi, block_mask, bm_q, bm_k, drop_threshold, drop_scale, seed_lo, seed_hi)
                    ds_smem[U((ty * TR + r) * DS_STRIDE + tx + c * THREADS_C)] = ds
            cuda.syncthreads()
            dq_tile(ds_smem, k_smem, dq_acc, ty, tx)     # dQ += dS K

        for r in range(TR):
            i = q0 + ty * TR + r
            if i < seqlen_q:
                for c in range(TD):
                    d = tx + c * THREADS_C
                    if EVEN_D or d < HEAD_DIM:
                        dq[b, i, h, d] = dq_acc[r, c] * scale

    return flash_dq, SHARED_BYTES, NTHREADS


@lru_cache(maxsize=None)
@kernel_factory
def make_cast(ACC_NAME):
    """``dst[t] = src[t]`` over flat (1-D) arrays: the atomic dQ accumulator to the output dtype.

    ``CAST_ITEMS`` elements per thread, ``CAST_THREADS`` apart (each load of a warp is one contiguous run);
    ``cast_grid`` blocks of ``CAST_THREADS``.
    """

    @kernel
    def cast(src, dst):
        base = cuda.blockIdx.x * (CAST_THREADS * CAST_ITEMS) + cuda.threadIdx.x
        for e in range(CAST_ITEMS):
            t = base + e * CAST_THREADS
            if t < dst.shape[0]:
                dst[t] = src[t]

    return cast


CAST_THREADS, CAST_ITEMS = 128, 4


def cast_grid(n):
    """Blocks of ``make_cast`` (and ``backward_tc.make_cast_tc``) for ``n`` output elements."""
    return -(-n // (CAST_THREADS * CAST_ITEMS))
