"""The Hopper forward's steps (FA2 Algorithm 1 on compute capability 9.0): ``S = Q K_j^T`` and ``acc += P V_j`` by
warpgroup MMA (``_wgmma``) from 128-byte-swizzled shared tiles, the tiles brought by the tensor-copy engine
(``_tma``) into two stages handed over on mbarriers, and the float32 form on tf32 ``wgmma`` (``WG_TF32``: K_j and
V_j^T prepared by ``tf32_prepare``; 3xTF32 with ``SPLIT``, Q's small parts in registers with ``QS_REG``).

``forward_tc.make_forward_tc(WGMMA=True)`` builds the kernel: its body (the online softmax, the masks, the epilogue)
is the mma.sync kernel's, each warp's accumulators being the same m16n8 fragments; the steps that differ are
built here by ``make_forward_wgmma_steps`` from the kernel's layout (its docstring says what each is).
"""
from types import SimpleNamespace

from numba import cuda

from ._jit import device_function
from ._mma import tf32_primitives
from ._tma import make_box_load, make_tile_load, tma_primitives
from ._wgmma import SWIZZLE_BYTES, fence_proxy_async, k_major_steps, make_pack_a, make_wgmma, mn_major_steps


def make_forward_wgmma_steps(L, split_smem):
    """The Hopper forward's device functions, as a namespace, for the layout ``L`` (``make_forward_tc``'s constants,
    by their names there) and its ``split_smem``: ``wgmma_qk`` (S = Q K_j^T), ``fence_async``; the copy engine's
    (``TMA``) ``load_q_tile``, ``load_kv_stage``, ``init_barriers``, ``prepare_stage``, ``mbar_wait``,
    ``mbar_arrive``; ``pv_tile_wgmma`` (acc += P V_j); ``WG_TF32``'s ``score_tile_wgmma_tf32`` and
    ``pv_tile_wgmma_tf32``."""
    BLOCK_Q, BLOCK_K, DTYPE_NAME, NTHREADS, HEAD_WORDS = L.BLOCK_Q, L.BLOCK_K, L.DTYPE_NAME, L.NTHREADS, L.HEAD_WORDS
    D_WORDS, D_PAD, KSTEPS_D, KSTEPS_K, NT_D, HALF_D = L.D_WORDS, L.D_PAD, L.KSTEPS_D, L.KSTEPS_K, L.NT_D, L.HALF_D
    TILE, V_OFF, STAGE_WORDS, Q_OFF, Q_WORDS, SMALL_Q = L.TILE, L.V_OFF, L.STAGE_WORDS, L.Q_OFF, L.Q_WORDS, L.SMALL_Q
    TF32, SPLIT, WG_TF32, QS_REG, TMA, VARLEN, W0 = L.TF32, L.SPLIT, L.WG_TF32, L.QS_REG, L.TMA, L.VARLEN, L.W0
    K_SMALL, VT_SMALL = (L.K_SMALL, L.VT_SMALL) if WG_TF32 else (0, 0)
    STAGES, FULL, EMPTY, Q_FULL, KV_BYTES, Q_BYTES = (
        (L.STAGES, L.FULL, L.EMPTY, L.Q_FULL, L.KV_BYTES, L.Q_BYTES) if TMA else (0,) * 6)
    tf32 = tf32_primitives()
    split_bits, round_bits, split_value, round_value = (
        tf32[name] for name in ("split_bits", "round_bits", "split_value", "round_value"))

    # S = Q K_j^T: both K-major; P V_j: V_j MN-major (its 64-column blocks BLOCK_K rows apart)
    wgmma_qk = make_wgmma("ss", DTYPE_NAME, BLOCK_K, k_major_steps(BLOCK_Q, KSTEPS_D),
                          k_major_steps(BLOCK_K, KSTEPS_D))
    fence_async = fence_proxy_async()
    if not TF32:
        wgmma_pv = make_wgmma("rs", DTYPE_NAME, NT_D * 8, (), mn_major_steps(KSTEPS_K),
                              b_lbo=BLOCK_K * SWIZZLE_BYTES, trans_b=1)
        pack_p = make_pack_a(DTYPE_NAME, KSTEPS_K)
    if WG_TF32:   # tf32: P V_j from V_j^T, K-major (keys contiguous: D_PAD rows of BLOCK_K values)
        wgmma_pv = make_wgmma("rs", DTYPE_NAME, NT_D * 8, (), k_major_steps(NT_D * 8, KSTEPS_K))
    if QS_REG:    # S's small-part product with Q's small parts as register a fragments; P V_j by halves of the dims
        wgmma_qk_rs = make_wgmma("rs", DTYPE_NAME, BLOCK_K, (), k_major_steps(BLOCK_K, KSTEPS_D))
        wgmma_pv_half = make_wgmma("rs", DTYPE_NAME, HALF_D, (), k_major_steps(NT_D * 8, KSTEPS_K))
    if TMA:
        tma = tma_primitives()
        mbar_init, mbar_fence_init, mbar_wait, mbar_arrive = (
            tma[name] for name in ("mbar_init", "mbar_fence_init", "mbar_wait", "mbar_arrive"))
        mbar_expect = tma["mbar_arrive_expect_tx"]
        load_q_box = make_tile_load(BLOCK_Q, HEAD_WORDS, D_WORDS // 32)
        load_kv_box = make_tile_load(BLOCK_K, HEAD_WORDS, D_WORDS // 32)
    if WG_TF32:   # K_j's big and small parts: columns of kk's rows; V_j^T's: D_PAD rows of vt from key k0
        load_k_part = make_box_load(BLOCK_K, D_WORDS // 32)
        load_vt_part = make_box_load(D_PAD, -(-BLOCK_K // 32))

    # ---- TMA: the copy engine's loads, issued by one thread; tensor maps 0, 1, 2 of ``maps`` are Q's, K's, V's
    # (rows counted in the tensor: a packed batch's from its first row, the tensor's ``rows`` rows long)
    @device_function
    def load_q_tile(smem, maps, q, q_base, q_row, row0, rows, h, b):
        """The Q tile (its rows from ``row0``), completing on Q's barrier."""
        mbar_expect(smem, Q_FULL, Q_BYTES)
        load_q_box(smem, 4 * Q_OFF, maps, 0, q, q_base, q_row, row0, rows - row0, h, b, Q_FULL)

    @device_function
    def load_kv_stage(smem, maps, k, v, k_base, v_base, k_row, v_row, row0, rows, hk, b, s):
        """K_j, V_j (keys from ``row0``) into stage ``s``, completing on full[s]; ``WG_TF32``: K_j's and V_j^T's
        parts from the pre-pass's ``kk`` and ``vt`` (``v_base``: vt's row 0, ``v_row`` its words per row)."""
        mbar_expect(smem, FULL + 8 * s, KV_BYTES)
        dst = 4 * s * STAGE_WORDS
        bar = FULL + 8 * s
        if WG_TF32:
            n = rows - row0
            load_k_part(smem, dst, maps, 1, k, k_base, k_row, row0, n, 0, D_WORDS, hk, b, bar)
            load_vt_part(smem, dst + 4 * V_OFF, maps, 2, v, v_base, v_row, 0, D_PAD, row0, v_row, hk, b, bar)
            if SPLIT:
                load_k_part(smem, dst + 4 * K_SMALL, maps, 1, k, k_base, k_row, row0, n, D_WORDS, 2 * D_WORDS,
                            hk, b, bar)
                load_vt_part(smem, dst + 4 * VT_SMALL, maps, 2, v, v_base, v_row, D_PAD, D_PAD, row0, v_row,
                             hk, b, bar)
        else:
            load_kv_box(smem, dst, maps, 1, k, k_base, k_row, row0, rows - row0, hk, b, bar)
            load_kv_box(smem, dst + 4 * V_OFF, maps, 2, v, v_base, v_row, row0, rows - row0, hk, b, bar)

    @device_function
    def init_barriers(smem, tid):
        """The stages' barriers (full[s]: the copy thread's arrive and the bytes; empty[s]: every reader's) and Q's,
        set up by thread 0 before any thread uses them."""
        if tid == 0:
            for s in range(STAGES):
                mbar_init(smem, FULL + 8 * s, 1)
                mbar_init(smem, EMPTY + 8 * s, NTHREADS)
            mbar_init(smem, Q_FULL, 1)
            mbar_fence_init()
        cuda.syncthreads()

    @device_function
    def zero_rows_past(smem, tile, n, tid):
        """Rows ``n ..`` of the swizzled K or V tile at word ``tile`` (a row: 32 words of each 64-column block,
        the blocks ``BLOCK_K`` rows apart) <- 0."""
        for i in range(-(-TILE // NTHREADS)):
            w = i * NTHREADS + tid                           # word w % 32 of row (w // 32) % BLOCK_K
            if w < TILE and (w // 32) % BLOCK_K >= n:
                smem[tile + w] = W0

    @device_function
    def pv_tile_wgmma(smem, base, s_reg, p_all, acc):
        """acc += P V_j by the warpgroup: P's a fragments of every k-step (16 keys: S's n-tiles 2 kk, 2 kk + 1,
        packed as in ``pv_tile``) in registers, V_j from its swizzled shared tile."""
        pack_p(s_reg, p_all)
        wgmma_pv(acc, p_all, smem, 4 * (base + V_OFF), 1)

    # ---- WG_TF32: float32 on tf32 wgmma.  K-major only: V_j^T comes from the pre-pass
    # (``tf32_prepare.make_prepare_tf32``), its keys relabelled within each 8 (key 2t at k index t, 2t + 1 at
    # t + 4) so that P's a fragments are S's accumulators as they are (a0..a3 = S[g, 2t], S[g+8, 2t], S[g, 2t+1],
    # S[g+8, 2t+1]), as ``pv_tile_tf32`` does with V's rows
    @device_function
    def prepare_q_tf32(smem, tid):
        """Q's tile -> tf32 big parts in place and (``SPLIT``) small parts at ``SMALL_Q``, or rounded to tf32; by
        the whole block, between the caller's barriers, once."""
        if SPLIT:
            split_smem(smem, Q_OFF, SMALL_Q, Q_WORDS)
        else:
            for i in range(tid, Q_WORDS, NTHREADS):
                smem[Q_OFF + i] = round_bits(smem[Q_OFF + i])

    @device_function
    def split_q_fragments(smem, warp, g, t, q_small_a):
        """``QS_REG``: this thread's a-fragment words of Q (rows ``16 warp + g (+ 8)``, columns ``8 ks + t (+ 4)``;
        each word of the tile is one thread's) -> their big parts in place, their small parts into
        ``q_small_a`` (4 a k-step); the caller's fence and barrier hand the big parts to the tensor cores.
        In the 128-byte swizzle (``swizzled_offset``, 32 words a row, 4 a chunk) column ``8 ks + t + 4 h`` of row
        ``r`` is word ``t`` of chunk ``(2 ks + h) % 8 ^ r % 8`` of block ``ks // 4``; rows ``r``, ``r + 8`` share
        ``r % 8``."""
        r = 16 * warp + g
        row_word = Q_OFF + 32 * r + t
        for ks in range(KSTEPS_D):
            for h in range(2):
                i = row_word + (ks // 4) * (32 * BLOCK_Q) + 4 * (((2 * ks + h) % 8) ^ (r % 8))
                smem[i], q_small_a[4 * ks + 2 * h] = split_bits(smem[i])
                j = i + 8 * 32                                   # (row r + 8)
                smem[j], q_small_a[4 * ks + 2 * h + 1] = split_bits(smem[j])

    @device_function
    def score_tile_wgmma_tf32(smem, base, q_bytes, s_reg, q_small_a):
        """S = Q K_j^T on tf32 wgmma; SPLIT: the small parts' products first, then the big parts'."""
        if QS_REG:
            wgmma_qk_rs(s_reg, q_small_a, smem, 4 * base, 0)
            wgmma_qk(s_reg, smem, q_bytes, 4 * (base + K_SMALL), 1)
            wgmma_qk(s_reg, smem, q_bytes, 4 * base, 1)
        elif SPLIT:
            wgmma_qk(s_reg, smem, q_bytes + 4 * (SMALL_Q - Q_OFF), 4 * base, 0)
            wgmma_qk(s_reg, smem, q_bytes, 4 * (base + K_SMALL), 1)
            wgmma_qk(s_reg, smem, q_bytes, 4 * base, 1)
        else:
            wgmma_qk(s_reg, smem, q_bytes, 4 * base, 0)

    @device_function
    def split_p(s_reg, p_all, which):
        """``QS_REG``: P's a fragments from S's accumulators (keys relabelled as V_j^T's): part ``which`` of each
        value's split (0 big, 1 small)."""
        for kk in range(KSTEPS_K):
            for e in range(4):
                p_all[4 * kk + e] = split_value(s_reg[0, kk, (e % 2) * 2 + e // 2])[which]

    @device_function
    def pv_tile_wgmma_tf32(smem, base, s_reg, p_all, p_small, acc, part):
        """acc += P V_j on tf32 wgmma, P's a fragments from S's accumulators (keys relabelled as V_j^T's), rounded
        or split; SPLIT: the three products into a zeroed partial added to ``acc`` by round-to-nearest adds (as
        ``pv_tile_tf32``'s per k-step; here per tile); ``QS_REG``: P's small and then big parts in one register
        set (``p_all``), the three products into a partial of half the dims at a time, each half added to ``acc``
        by round-to-nearest adds (the tensor cores' accumulation truncates: accumulated into ``acc`` itself the
        error measured 8-16x the SIMT kernels')."""
        if QS_REG:
            for half in range(2):                # (a partial of half the dims: its registers are Q's)
                dims = half * HALF_D * SWIZZLE_BYTES             # V_j^T's rows of these dims
                split_p(s_reg, p_all, 1)
                wgmma_pv_half(part, p_all, smem, 4 * (base + V_OFF) + dims, 0)
                split_p(s_reg, p_all, 0)
                wgmma_pv_half(part, p_all, smem, 4 * (base + VT_SMALL) + dims, 1)
                wgmma_pv_half(part, p_all, smem, 4 * (base + V_OFF) + dims, 1)
                for n in range(NT_D // 2):
                    for e in range(4):
                        acc[0, half * (NT_D // 2) + n, e] += part[0, n, e]
            return
        for kk in range(KSTEPS_K):
            for e in range(4):
                x = s_reg[0, kk, (e % 2) * 2 + e // 2]
                if SPLIT:
                    p_all[4 * kk + e], p_small[4 * kk + e] = split_value(x)
                else:
                    p_all[4 * kk + e] = round_value(x)
        if SPLIT:
            wgmma_pv(part, p_small, smem, 4 * (base + V_OFF), 0)
            wgmma_pv(part, p_all, smem, 4 * (base + VT_SMALL), 1)
            wgmma_pv(part, p_all, smem, 4 * (base + V_OFF), 1)
            for n in range(NT_D):
                for e in range(4):
                    acc[0, n, e] += part[0, n, e]
        else:
            wgmma_pv(acc, p_all, smem, 4 * (base + V_OFF), 1)

    @device_function
    def prepare_stage(smem, i, buf, k0, seqlen_k, tid, warp, g, t, q_small_a):
        """The landed tiles made ready for the tensor cores: ``WG_TF32``, Q's tf32 parts once (``QS_REG``: the
        small ones kept in registers); ``VARLEN``, the next sequence's values past this one's end zeroed.  These
        generic-proxy writes are fenced for the tensor cores."""
        if QS_REG and i == 0:
            split_q_fragments(smem, warp, g, t, q_small_a)
        elif WG_TF32 and i == 0:
            prepare_q_tf32(smem, tid)
        if VARLEN and k0 + BLOCK_K > seqlen_k:
            zero_rows_past(smem, buf * STAGE_WORDS + V_OFF, seqlen_k - k0, tid)
        if (WG_TF32 and i == 0) or (VARLEN and k0 + BLOCK_K > seqlen_k):
            fence_async()
            cuda.syncthreads()

    return SimpleNamespace(wgmma_qk=wgmma_qk, fence_async=fence_async, mbar_wait=mbar_wait if TMA else None,
                           mbar_arrive=mbar_arrive if TMA else None, load_q_tile=load_q_tile,
                           load_kv_stage=load_kv_stage, init_barriers=init_barriers, prepare_stage=prepare_stage,
                           pv_tile_wgmma=pv_tile_wgmma, score_tile_wgmma_tf32=score_tile_wgmma_tf32,
                           pv_tile_wgmma_tf32=pv_tile_wgmma_tf32)
