"""The Hopper dK/dV kernel's steps (FA2 Algorithm 2 on compute capability 9.0): ``S^T = K_j Q_i^T``,
``dP^T = V_j dO_i^T``, ``dV += P_drop^T dO_i`` and ``dK += dS^T Q_i`` by warpgroup MMA (``_wgmma``) from
128-byte-swizzled shared tiles; with ``EXCHANGE`` (two warpgroups on the same keys, above head dim 128) each
warpgroup computes one of S^T, dP^T and hands it to the other; with ``DQ_WGMMA`` dQ_i += dS K_j by the warpgroups
too; with ``TMA`` Q_i and dO_i come by the tensor-copy engine (``_tma``) into two stages on full mbarriers.

``backward_tc.make_dkdv_tc(WGMMA=True)`` builds the kernel: its body (the work items, the element-wise step,
dQ's mma.sync phase where the warpgroups do not take it, the stores) is the mma.sync kernel's, each warp's
accumulators being the same m16n8 fragments; the steps that differ are built here by ``make_dkdv_wgmma_steps``
from the kernel's layout.
"""
from types import SimpleNamespace

from numba import cuda

from ._jit import device_function
from ._mma import memory_primitives
from ._tiles import U
from ._tma import make_tile_load, tma_primitives
from ._wgmma import SWIZZLE_BYTES, fence_proxy_async, k_major_steps, make_pack_a, make_wgmma, mn_major_steps


def make_dkdv_wgmma_steps(L, next_work):
    """The Hopper dK/dV kernel's device functions, as a namespace, for the layout ``L`` (``make_dkdv_tc``'s
    constants, by their names there) and its ``next_work``: ``wgmma_t`` (S^T or dP^T by a warpgroup),
    ``exchange_products``, ``dv_dk_tile_wgmma``, ``dq_wgmma_phase``, ``fence_async``; the copy engine's
    (``TMA``) ``start_stages``, ``refill``, ``mbar_wait``."""
    BLOCK_Q, BLOCK_K, HEAD_DIM, DTYPE_NAME, DSPLIT = L.BLOCK_Q, L.BLOCK_K, L.HEAD_DIM, L.DTYPE_NAME, L.DSPLIT
    D_PAD, D_WORDS, HEAD_WORDS, NT_QA = L.D_PAD, L.D_WORDS, L.HEAD_WORDS, L.NT_QA
    KSTEPS_D, KSTEPS_Q, KSTEPS_K = L.KSTEPS_D, L.KSTEPS_Q, L.KSTEPS_K
    K_OFF, Q_OFF, QTILE, X_OFF, X_WORDS = L.K_OFF, L.Q_OFF, L.QTILE, L.X_OFF, L.X_WORDS
    FULL, QDO_BYTES = L.FULL, L.QDO_BYTES
    DQ_N, DQ_NT_WG = L.DQ_N, L.DQ_NT_WG
    red_add_f32x4 = memory_primitives()["red_add_f32x4"]

    # S^T, dP^T: A = this warpgroup's 64 rows of K_j / V_j, B = Q_i / dO_i (both K-major, N = BLOCK_Q);
    # dV, dK: A = P_drop^T / dS^T (registers), B = dO_i / Q_i MN-major (k = 16 queries, N = the head dim)
    wgmma_t = make_wgmma("ss", DTYPE_NAME, BLOCK_Q, k_major_steps(BLOCK_K, KSTEPS_D),
                         k_major_steps(BLOCK_Q, KSTEPS_D))
    wgmma_acc = make_wgmma("rs", DTYPE_NAME, D_PAD // DSPLIT, (), mn_major_steps(KSTEPS_Q),
                           b_lbo=BLOCK_Q * SWIZZLE_BYTES, trans_b=1)
    fence_async = fence_proxy_async()
    pack_a = make_pack_a(DTYPE_NAME, KSTEPS_Q)     # P_drop^T's, dS^T's a fragments (16 queries a k-step)
    tma = tma_primitives()
    mbar_init, mbar_fence_init, mbar_wait, mbar_expect = (
        tma[name] for name in ("mbar_init", "mbar_fence_init", "mbar_wait", "mbar_arrive_expect_tx"))
    load_q_box = make_tile_load(BLOCK_Q, HEAD_WORDS, D_WORDS // 32)     # TMA: Q_i's or dO_i's tile
    # DQ_WGMMA: dQ_i = dS K_j, A = dS^T's [key][query] rows, B = K_j's rows (both MN-major, k = 16 keys)
    wgmma_dq = make_wgmma("ss", DTYPE_NAME, DQ_N, mn_major_steps(KSTEPS_K), mn_major_steps(KSTEPS_K),
                          a_lbo=BLOCK_K * SWIZZLE_BYTES, b_lbo=BLOCK_K * SWIZZLE_BYTES, trans_b=1, trans_a=1)

    @device_function
    def start_q_load(smem, maps, q, dout, b, h, q0, seqlen_q, s):
        """TMA: the copy engine's Q_i, dO_i (rows from ``q0``) into stage ``s``, completing on full[s] (thread 0)."""
        bar = FULL + 8 * s
        mbar_expect(smem, bar, QDO_BYTES)
        qb = 4 * (Q_OFF + s * 2 * QTILE)
        load_q_box(smem, qb, maps, 0, q, (b * q.strides[0] + h * q.strides[2]) >> 2, q.strides[1] >> 2, q0,
                   seqlen_q - q0, h, b, bar)
        load_q_box(smem, qb + 4 * QTILE, maps, 1, dout, (b * dout.strides[0] + h * dout.strides[2]) >> 2,
                   dout.strides[1] >> 2, q0, seqlen_q - q0, h, b, bar)

    @device_function
    def refill(smem, maps, q, dout, b, hk, group, wn, gn, qn_i, n_work, nqt, qt_lo, k0, seqlen_q, seqlen_k, off, left,
               right, block_mask, bm_q, bm_k, s):
        """TMA, after the item's dQ barrier (every thread is past its reads of stage ``s``): the item after next,
        ``(w2, g2, q2_i)`` after ``wn``, into stage ``s`` (thread 0)."""
        w2, g2, q2_i = next_work(wn, gn, qn_i, n_work, nqt, qt_lo, hk, group, b, k0, seqlen_q, seqlen_k, off, left,
                                 right, block_mask, bm_q, bm_k)
        if cuda.threadIdx.x == 0 and w2 < n_work:
            start_q_load(smem, maps, q, dout, b, hk * group + g2, (qt_lo + q2_i) * BLOCK_Q, seqlen_q, s)
        return w2, g2, q2_i

    @device_function
    def start_stages(smem, maps, q, dout, b, h0, qt_lo, w, gi, qi, wn, gn, qn_i, n_work, seqlen_q):
        """TMA: the stages' barriers set up, and items ``w`` and ``wn`` in flight into stages 0 and 1 (thread 0;
        the caller's next block barrier orders the barriers' set-up before any wait)."""
        if cuda.threadIdx.x == 0:
            for s in range(2):
                mbar_init(smem, FULL + 8 * s, 1)
            mbar_fence_init()
            if w < n_work:
                start_q_load(smem, maps, q, dout, b, h0 + gi, (qt_lo + qi) * BLOCK_Q, seqlen_q, 0)
            if wn < n_work:
                start_q_load(smem, maps, q, dout, b, h0 + gn, (qt_lo + qn_i) * BLOCK_Q, seqlen_q, 1)

    @device_function
    def exchange_products(fsmem, s_reg, dp_reg, first):
        """EXCHANGE: this thread's product (S^T in the first warpgroup, dP^T in the second, both in ``s_reg``) to
        shared memory, a barrier, and the other warpgroup's product from the thread with the same fragments:
        then ``s_reg`` holds S^T and ``dp_reg`` dP^T in both.  (The slots are next written after the item's dQ
        barrier, so the next item's stores cannot overtake these loads.)"""
        lane128 = cuda.threadIdx.x % 128
        mine = X_OFF + lane128 + (0 if first else X_WORDS)
        theirs = X_OFF + lane128 + (X_WORDS if first else 0)
        for n in range(NT_QA):
            for e in range(4):
                fsmem[U(mine + 128 * (4 * n + e))] = s_reg[0, n, e]
        cuda.syncthreads()
        for n in range(NT_QA):
            for e in range(4):
                x = fsmem[U(theirs + 128 * (4 * n + e))]
                own = s_reg[0, n, e]
                s_reg[0, n, e] = own if first else x
                dp_reg[0, n, e] = x if first else own

    @device_function
    def dv_dk_tile_wgmma(smem, qb, db, part_bytes, s_reg, dp_reg, p_all, ds_all, dv_acc, dk_acc):
        """WGMMA: dV += P_drop^T dO_i, dK += dS^T Q_i by the warpgroup, A from the accumulators; B the blocks of
        this warp's part of the dims (``DSPLIT``), ``part_bytes`` into dO_i's and Q_i's tiles."""
        pack_a(s_reg, p_all)
        pack_a(dp_reg, ds_all)
        wgmma_acc(dv_acc, p_all, smem, 4 * db + part_bytes, 1)
        wgmma_acc(dk_acc, ds_all, smem, 4 * qb + part_bytes, 1)

    @device_function
    def dq_wgmma_phase(smem, dq_accum, ds_buf, b, h, q0, warp, g, t, scale32, dq_acc):
        """DQ_WGMMA: dQ_i += dS K_j for this warpgroup's ``DQ_N`` dims (dS^T at ``ds_buf``, K_j at ``K_OFF``), each
        lane's four floats of an n-tile added to ``dq_frag_shape``'s blocks (its warp: the 16-row slab
        ``warp % 4``)."""
        c0 = (warp // 4) * DQ_N                          # this warpgroup's first dim
        wgmma_dq(dq_acc, smem, 4 * ds_buf, 4 * K_OFF + (c0 // 64) * BLOCK_K * SWIZZLE_BYTES + 2 * (c0 % 64), 0)
        dq_row = ((b * dq_accum.shape[1] + h) * dq_accum.shape[2] + q0 + 16 * (warp % 4)) * D_PAD + 4 * (4 * g + t)
        for p in range(DQ_NT_WG):
            n = c0 // 8 + p
            if D_PAD == HEAD_DIM or 8 * n < HEAD_DIM:       # (n-tiles of padding: nothing to add)
                red_add_f32x4(dq_accum, dq_row + 128 * n, dq_acc[p, 0] * scale32, dq_acc[p, 1] * scale32,
                              dq_acc[p, 2] * scale32, dq_acc[p, 3] * scale32)

    return SimpleNamespace(wgmma_t=wgmma_t, fence_async=fence_async, mbar_wait=mbar_wait,
                           exchange_products=exchange_products, dv_dk_tile_wgmma=dv_dk_tile_wgmma,
                           dq_wgmma_phase=dq_wgmma_phase, start_stages=start_stages, refill=refill)
