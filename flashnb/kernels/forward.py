"""FlashAttention-2 forward as a Numba CUDA kernel (SIMT: CUDA cores, float32 or float64 arithmetic).

One thread block per (query tile, head, batch) (FA2 section 3.2: parallel over
sequence blocks).  The block stages its ``BLOCK_Q x HEAD_DIM`` query tile in
shared memory once, then for each key tile it may see:

    K_j, V_j -> shared memory                     (FA2 Algorithm 1, line 6)
    S = Q K_j^T                 register micro-tiles (line 8)
    S <- modifiers, masks, in log2 units           (scores * log2(e): exp2 is one instruction)
    m_new = max(m_i, rowmax(S))                    (line 9)
    P = exp2(S - m_new), l_i = l_i exp2(m_i - m_new) + rowsum(P)
    acc = acc * exp2(m_i - m_new) + P V_j          (line 10, P through shared memory)

and at the end writes ``out = acc / l_i`` and ``lse = m_i + log(l_i)`` (lines
12-14: the normalisation is deferred to here).  Key tiles that the window,
causal or block mask forbid entirely are never loaded; only tiles that cross a
mask boundary (or the end of the keys) evaluate the element-wise mask, under a
uniform branch; features a call does not use are compiled out (flags in the
specialisation key).  The oracle for this is ``reference.flash_forward``.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda

from ._jit import device_function, kernel, kernel_factory
from ._scores import Mods, make_allowed_fn, make_score_fn, mask_block, philox_keep
from ._tiles import (U, make_mm_abt, make_mm_acc, make_row_allreduce, make_tile_load, packed_tile_head_batch,
                     padded, scratch_size, sequence_span, tile_head_batch)

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453    # ln(2): log(l) = log2(l) * ln(2)


# Threads along each side of a score tile: "rows" own register micro-tile rows (their
# values are broadcast across a row of lanes), "cols" are the lanes of one row (a
# power of two <= 32, so a row reduction stays inside a warp).  Tuned on an H100:
# docs/performance.md.
MAX_THREADS = {"rows": 16, "cols": 16}


def tile_threads(block, axis):
    """Threads along one side (``"rows"`` or ``"cols"``) of a tile of ``block`` elements."""
    return min(MAX_THREADS[axis], block)


@lru_cache(maxsize=None)
def make_window_helpers(BLOCK_Q, BLOCK_K, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MASK_BLOCK=None):
    """Tile-level mask arithmetic, shared by the forward and backward kernels.  ``MASK_BLOCK`` (a mask_mod's
    block size, ``_scores.mask_block``): the block mask holds ``create_block_mask``'s states (0 empty, 1 partial,
    2 full; ``kernels/flex.py``) in blocks of that constant size, and the ``mask_mod`` runs on a tile unless every
    block under it is full."""
    FULL_STATE = 2
    HAS_MASK_MOD = MASK_BLOCK is not None
    BMQ, BMK = MASK_BLOCK if HAS_MASK_MOD else (1, 1)
    ONE_BLOCK = HAS_MASK_MOD and BMQ % BLOCK_Q == 0 and BMK % BLOCK_K == 0   # every tile inside one mask block
    assert HAS_BLOCK_MASK or not HAS_MASK_MOD, "a mask_mod comes with its block states"

    @device_function
    def key_tile_range(q_first, q_last, off, left, right, seqlen_k):
        """Key tiles ``[lo, hi)`` holding a key that some query in ``[q_first, q_last]`` may see."""
        lo = 0
        hi = (seqlen_k + BLOCK_K - 1) // BLOCK_K
        if left >= 0:
            lo = max(q_first + off - left, 0) // BLOCK_K
        if right >= 0:
            j_max = q_last + off + right  # the last key the last query may see
            hi = min(hi, j_max // BLOCK_K + 1) if j_max >= 0 else 0
        return lo, hi

    @device_function
    def inside_window(q_first, q_last, k_first, k_last, off, left, right):
        """True iff every (query, key) pair of the tile lies inside the window."""
        ok = True
        if left >= 0:
            ok = k_first - (q_last + off) >= -left
        if right >= 0:
            ok = ok and k_last - (q_first + off) <= right
        return ok

    @device_function
    def block_mask_cover(b, h, q_first, q_last, k_first, k_last, block_mask, bm_q, bm_k):
        """(any, all): whether any / every block-mask block under the tile is allowed (``HAS_MASK_MOD``: all
        full, so that the tile needs no ``mask_mod``)."""
        if ONE_BLOCK:                    # the tile's one block: one read (tiles start on their size's multiples)
            state = block_mask[min(b, block_mask.shape[0] - 1), min(h, block_mask.shape[1] - 1), q_first // BMQ,
                               k_first // BMK]
            return state != 0, state == FULL_STATE
        any_on = False
        all_on = True
        if HAS_MASK_MOD:                 # compile-time divisors: shifts for the usual powers of two
            bm_q, bm_k = BMQ, BMK
        for bi in range(q_first // bm_q, q_last // bm_q + 1):
            for bj in range(k_first // bm_k, k_last // bm_k + 1):
                state = block_mask[min(b, block_mask.shape[0] - 1), min(h, block_mask.shape[1] - 1),
                                   min(bi, block_mask.shape[2] - 1), min(bj, block_mask.shape[3] - 1)]
                on = state != 0
                any_on = any_on or on
                all_on = all_on and (state == FULL_STATE if HAS_MASK_MOD else on)
        return any_on, all_on

    @device_function
    def tile_state(b, h, q_first, q_last, k_first, seqlen_k, off, left, right, block_mask, bm_q, bm_k):
        """(visible, need_mask) for queries ``[q_first, q_last]`` x keys ``[k_first, k_first + BLOCK_K)``.

        visible: the block mask leaves some of the tile (otherwise it is skipped, never
        loaded: section 3.3); need_mask: the element-wise mask must run, because the tile
        crosses the end of the keys, a window edge or a block-mask edge, or an
        ``attn_mask`` is given.  Tiles inside everything pay one uniform branch.
        """
        need_mask = k_first + BLOCK_K > seqlen_k or HAS_ATTN_MASK
        if HAS_WINDOW:
            need_mask = need_mask or not inside_window(q_first, q_last, k_first, k_first + BLOCK_K - 1,
                                                       off, left, right)
        visible = True
        if HAS_BLOCK_MASK:
            visible, all_on = block_mask_cover(b, h, q_first, q_last, k_first,
                                               min(k_first + BLOCK_K, seqlen_k) - 1, block_mask, bm_q, bm_k)
            need_mask = need_mask or not all_on
        return visible, need_mask

    return key_tile_range, tile_state


@lru_cache(maxsize=None)
def make_mask_bounds(BLOCK_Q, BLOCK_K, MASK_BLOCK):
    """``key_bounds`` and ``query_bounds``: a tile range narrowed to the blocks a ``flex_attention`` block mask
    keeps (``MASK_BLOCK``, the mask_mod's block size; None: the range as given).  ``flex.kernel_states`` pads the
    states with each query block's first and last-plus-one kept key block (columns ``nkb``, ``nkb + 1``) and each
    key block's kept query blocks (rows ``nqb``, ``nqb + 1``), so a tile's loop runs from its first kept block to
    its last instead of testing every block of the row (a sliding window keeps 9 of 128)."""
    HAS_MASK_MOD = MASK_BLOCK is not None
    BMQ, BMK = MASK_BLOCK if HAS_MASK_MOD else (1, 1)

    @device_function
    def key_bounds(lo, hi, b, h, q_first, q_last, block_mask, bm_q, bm_k):
        """Key tiles ``[lo, hi)`` of queries ``[q_first, q_last]`` within the blocks kept for them."""
        if HAS_MASK_MOD:
            nkb = block_mask.shape[3] - 2
            bb, hh = min(b, block_mask.shape[0] - 1), min(h, block_mask.shape[1] - 1)
            first = nkb
            last = 0
            for qb in range(q_first // BMQ, q_last // BMQ + 1):
                first = min(first, block_mask[bb, hh, qb, nkb])
                last = max(last, block_mask[bb, hh, qb, nkb + 1])
            lo = max(lo, first * BMK // BLOCK_K)
            hi = min(hi, (last * BMK + BLOCK_K - 1) // BLOCK_K)
        return lo, hi

    @device_function
    def query_bounds(lo, hi, b, h0, nh, k_first, k_last, block_mask, bm_q, bm_k):
        """Query tiles ``[lo, hi)`` of keys ``[k_first, k_last]`` within the blocks kept for them by any of the
        query heads ``h0 .. h0 + nh - 1`` (a key/value head's group)."""
        if HAS_MASK_MOD:
            nqb = block_mask.shape[2] - 2
            bb = min(b, block_mask.shape[0] - 1)
            first = nqb
            last = 0
            for hh in range(min(h0, block_mask.shape[1] - 1), min(h0 + nh, block_mask.shape[1])):
                for kb in range(k_first // BMK, k_last // BMK + 1):
                    first = min(first, block_mask[bb, hh, nqb, kb])
                    last = max(last, block_mask[bb, hh, nqb + 1, kb])
            lo = max(lo, first * BMQ // BLOCK_Q)
            hi = min(hi, (last * BMQ + BLOCK_Q - 1) // BLOCK_Q)
        return lo, hi

    return key_bounds, query_bounds


@lru_cache(maxsize=None)
def make_next_tile(BLOCK_Q, BLOCK_K, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MASK_BLOCK=None):
    """``next_tile(kt, kt_hi, b, h, q_first, q_last, seqlen_k, off, left, right, block_mask, bm_q, bm_k)``."""
    _, tile_state = make_window_helpers(BLOCK_Q, BLOCK_K, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MASK_BLOCK)

    @device_function
    def next_tile(kt, kt_hi, b, h, q_first, q_last, seqlen_k, off, left, right, block_mask, bm_q, bm_k):
        """The first key tile after ``kt`` that the block mask does not skip (``kt + 1`` without one)."""
        kt += 1
        if HAS_BLOCK_MASK:
            while kt < kt_hi:
                visible, _ = tile_state(b, h, q_first, q_last, kt * BLOCK_K, seqlen_k, off, left, right,
                                        block_mask, bm_q, bm_k)
                if visible:
                    break
                kt += 1                                   # a skipped block: never loaded (section 3.3)
        return kt

    return next_tile


@lru_cache(maxsize=None)
@kernel_factory
def make_forward(BLOCK_Q, BLOCK_K, HEAD_DIM, ACC_NAME, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK,
                 HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, VARLEN=False, MODS=None):
    """Build (once per specialisation) the forward kernel: (kernel, dynamic shared bytes, threads per block).

    ``MODS`` (``_scores.Mods``): a ``flex_attention`` call's ``score_mod`` and ``mask_mod``, inlined where the
    options' code would go (``flashnb.flex`` passes no option with them but the block mask of its states).

    ``VARLEN``: a packed batch (``flashnb.varlen``): q, k, v, out arrive as ``(batch, total, nheads, headdim)``
    views with batch stride 0 and lse as ``(batch, nheads, total_q)``; each block takes its sequence's rows
    from ``cu_seqlens_q``, ``cu_seqlens_k`` (``_tiles.sequence_span``) and runs the same body (``off`` is then the
    sequence's own ``seqlen_k - seqlen_q``).  Without it the two arrays are unused and the code is the dense one.
    """
    ACC = np.dtype(ACC_NAME).type
    THREADS_Q, THREADS_K = tile_threads(BLOCK_Q, "rows"), tile_threads(BLOCK_K, "cols")
    NTHREADS = THREADS_Q * THREADS_K
    TQ = BLOCK_Q // THREADS_Q                # query rows per thread
    TK = BLOCK_K // THREADS_K                # key columns per thread
    TD = -(-HEAD_DIM // THREADS_K)           # output dims per thread (ceil)
    EVEN_D = HEAD_DIM % THREADS_K == 0
    QK_STRIDE = padded(HEAD_DIM)             # q/k rows: padded so row-strided reads spread over banks
    V_STRIDE = QK_STRIDE                     # v read along d by consecutive lanes: conflict-free either way
    P_STRIDE = padded(BLOCK_K)
    # one dynamic shared-memory buffer, carved into the tiles below
    Q_OFF = 0
    K_OFF = Q_OFF + BLOCK_Q * QK_STRIDE
    V_OFF = K_OFF + BLOCK_K * QK_STRIDE
    P_OFF = V_OFF + BLOCK_K * V_STRIDE
    R_OFF = P_OFF + BLOCK_Q * P_STRIDE
    SMEM_N = R_OFF + max(scratch_size(BLOCK_Q, THREADS_K), 1)
    SHARED_BYTES = SMEM_N * np.dtype(ACC).itemsize
    MODS = MODS or Mods()
    HAS_SCORE_MOD = MODS.score_mod is not None
    HAS_MODS = HAS_SOFTCAP or HAS_BIAS or HAS_ALIBI or HAS_SCORE_MOD
    ACC_DT = np.dtype(ACC)
    ZERO, NEG_INF, LOG2E_T, LN2_T = ACC(0), ACC(-np.inf), ACC(LOG2E), ACC(LN2)

    load_q = make_tile_load(BLOCK_Q, HEAD_DIM, QK_STRIDE, NTHREADS, ACC)
    load_kv = make_tile_load(BLOCK_K, HEAD_DIM, QK_STRIDE, NTHREADS, ACC)   # K and V share a layout
    qk_tile = make_mm_abt(TQ, TK, THREADS_K, HEAD_DIM, QK_STRIDE, QK_STRIDE, ACC)
    pv_tile = make_mm_acc(TQ, TD, THREADS_K, BLOCK_K, HEAD_DIM, P_STRIDE, V_STRIDE, ACC)
    row_max = make_row_allreduce(TQ, THREADS_K, NTHREADS, ACC, is_max=True)
    row_sum = make_row_allreduce(TQ, THREADS_K, NTHREADS, ACC, is_max=False)
    score = make_score_fn(ACC, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, MODS.score_mod)
    MASK_BLOCK = mask_block(MODS)
    allowed = make_allowed_fn(HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MODS.mask_mod, MASK_BLOCK)
    key_tile_range, tile_state = make_window_helpers(BLOCK_Q, BLOCK_K, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK,
                                                     MASK_BLOCK)
    key_bounds, _ = make_mask_bounds(BLOCK_Q, BLOCK_K, MASK_BLOCK)
    next_tile = make_next_tile(BLOCK_Q, BLOCK_K, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MASK_BLOCK)

    @kernel
    def flash_forward(q, k, v, out, lse, group, off, scale, softcap, left, right,
                      attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                      drop_threshold, drop_scale, seed_lo, seed_hi, cu_seqlens_q, cu_seqlens_k):
        if VARLEN:                                        # this block's sequence, viewed as a dense batch's
            qt, h, b = packed_tile_head_batch(cu_seqlens_q, q.shape[2])
            q_start, n_q = sequence_span(cu_seqlens_q, b)
            if qt * BLOCK_Q >= n_q:
                return                                    # a query tile past its sequence: nothing to do
            k_start, n_k = sequence_span(cu_seqlens_k, b)
            q, out = q[:, q_start:q_start + n_q], out[:, q_start:q_start + n_q]
            lse = lse[:, :, q_start:q_start + n_q]
            k, v = k[:, k_start:k_start + n_k], v[:, k_start:k_start + n_k]
            off = n_k - n_q                               # bottom-right alignment per sequence
        else:
            qt, h, b = tile_head_batch((q.shape[1] + BLOCK_Q - 1) // BLOCK_Q, q.shape[2])
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        q0 = qt * BLOCK_Q
        hk = h // group                                   # grouped-query attention: shared K/V head
        tid = cuda.threadIdx.x
        ty = tid // THREADS_K
        tx = tid - ty * THREADS_K
        q_last = min(q0 + BLOCK_Q, seqlen_q) - 1
        scale_log2 = scale * LOG2E_T

        smem = cuda.shared.array(0, ACC_DT)
        q_smem = smem[Q_OFF:K_OFF]       # BLOCK_Q x HEAD_DIM, stride QK_STRIDE
        k_smem = smem[K_OFF:V_OFF]       # BLOCK_K x HEAD_DIM, stride QK_STRIDE
        v_smem = smem[V_OFF:P_OFF]       # BLOCK_K x HEAD_DIM, stride V_STRIDE
        p_smem = smem[P_OFF:R_OFF]       # BLOCK_Q x BLOCK_K probabilities, stride P_STRIDE
        scratch = smem[R_OFF:SMEM_N]     # row-reduction scratch (simulator only)

        s_reg = cuda.local.array((TQ, TK), ACC)
        acc = cuda.local.array((TQ, TD), ACC)
        m_i = cuda.local.array(TQ, ACC)
        l_i = cuda.local.array(TQ, ACC)   # per-thread partial row sums, reduced once at the end
        row = cuda.local.array(TQ, ACC)
        for r in range(TQ):
            m_i[r] = NEG_INF
            l_i[r] = ZERO
            for c in range(TD):
                acc[r, c] = ZERO

        load_q(q, b, q0, h, seqlen_q - q0, q_smem)
        kt_lo, kt_hi = key_tile_range(q0, q_last, off, left, right, seqlen_k)
        kt_lo, kt_hi = key_bounds(kt_lo, kt_hi, b, h, q0, q_last, block_mask, bm_q, bm_k)
        kt = next_tile(kt_lo - 1, kt_hi, b, h, q0, q_last, seqlen_k, off, left, right, block_mask, bm_q, bm_k)
        if kt < kt_hi:
            load_kv(k, b, kt * BLOCK_K, hk, seqlen_k - kt * BLOCK_K, k_smem)
            load_kv(v, b, kt * BLOCK_K, hk, seqlen_k - kt * BLOCK_K, v_smem)
        cuda.syncthreads()
        while kt < kt_hi:
            k0 = kt * BLOCK_K
            kn = next_tile(kt, kt_hi, b, h, q0, q_last, seqlen_k, off, left, right, block_mask, bm_q, bm_k)
            _, need_mask = tile_state(b, h, q0, q_last, k0, seqlen_k, off, left, right, block_mask, bm_q, bm_k)

            qk_tile(q_smem, k_smem, s_reg, ty, tx)       # S = Q K_j^T
            for r in range(TQ):
                i = q0 + ty * TQ + r
                for c in range(TK):
                    j = k0 + tx + c * THREADS_K
                    if HAS_SCORE_MOD:       # the user's function sees only indices inside the sequences
                        x = score(s_reg[r, c], min(i, seqlen_q - 1), min(j, seqlen_k - 1), b, h, off, scale,
                                  softcap, attn_bias, alibi) * LOG2E_T
                    elif HAS_MODS:
                        x = score(s_reg[r, c], i, j, b, h, off, scale, softcap, attn_bias, alibi) * LOG2E_T
                    else:
                        x = s_reg[r, c] * scale_log2
                    if need_mask:
                        if not allowed(i, j, b, h, seqlen_q, seqlen_k, off, left, right,
                                       attn_mask, block_mask, bm_q, bm_k):
                            x = NEG_INF
                    s_reg[r, c] = x

            # online softmax (base 2): m_new = max(m_i, rowmax S); rescale by exp2(m_i - m_new)
            for r in range(TQ):
                x = NEG_INF
                for c in range(TK):
                    x = max(x, s_reg[r, c])
                row[r] = x
            row_max(row, scratch, ty, tx)
            for r in range(TQ):
                m_new = max(m_i[r], row[r])
                m_use = m_new if m_new != NEG_INF else ZERO   # a row with nothing seen yet: exp2(-inf) = 0, not NaN
                alpha = math.exp2(m_i[r] - m_use)
                m_i[r] = m_new
                l_tile = ZERO
                for c in range(TK):
                    p = math.exp2(s_reg[r, c] - m_use)
                    l_tile += p                               # l_i uses P before dropout
                    if HAS_DROPOUT:
                        i = q0 + ty * TQ + r
                        j = k0 + tx + c * THREADS_K
                        p = p * drop_scale if philox_keep(seed_lo, seed_hi, b, h, i, j, drop_threshold) else ZERO
                    p_smem[U((ty * TQ + r) * P_STRIDE + tx + c * THREADS_K)] = p
                l_i[r] = l_i[r] * alpha + l_tile
                for c in range(TD):
                    acc[r, c] *= alpha
            cuda.syncthreads()
            pv_tile(p_smem, v_smem, acc, ty, tx)         # acc += P V_j
            cuda.syncthreads()                           # every reader of K_j, V_j, P is done
            if kn < kt_hi:
                load_kv(k, b, kn * BLOCK_K, hk, seqlen_k - kn * BLOCK_K, k_smem)
                load_kv(v, b, kn * BLOCK_K, hk, seqlen_k - kn * BLOCK_K, v_smem)
                cuda.syncthreads()
            kt = kn

        row_sum(l_i, scratch, ty, tx)
        for r in range(TQ):
            i = q0 + ty * TQ + r
            if i < seqlen_q:
                l = l_i[r]
                # l == 0: a row that saw no key gives out = 0, lse = -inf.  A NaN score makes l
                # NaN (the GPU's max ignores NaN, exp2 does not): out and lse NaN, as in the oracle.
                inv_l = ZERO if l == ZERO else ACC(1) / l
                for c in range(TD):
                    d = tx + c * THREADS_K
                    if EVEN_D or d < HEAD_DIM:
                        out[U(b), U(i), U(h), U(d)] = acc[r, c] * inv_l
                if tx == 0:
                    lse[b, h, i] = NEG_INF if l == ZERO else (m_i[r] + math.log2(l)) * LN2_T

    return flash_forward, SHARED_BYTES, NTHREADS
