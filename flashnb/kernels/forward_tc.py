"""FlashAttention-2 forward on tensor cores (float16 / bfloat16 inputs, float32 accumulation).

The same algorithm as ``forward.py`` (FA2 Algorithm 1; oracle ``reference.flash_forward``)
with the work split as in FA2 section 3.3: ``NWARPS`` warps split the query
tile, ``MT`` row blocks of 16 rows each (``m16n8k16``'s M), and share the K and
V tiles in shared memory.  Per key tile, each warp computes

    S   = Q K_j^T          mma over HEAD_DIM / 16 k-steps x BLOCK_K / 8 n-tiles; Q's fragments held
                           in registers (or, ``Q_SMEM``, read from a shared Q tile at each k-step)
    S  <- modifiers, masks, log2 units; m_i, l_i, acc rescaled (online softmax in registers,
                                                                row max across the 4 lanes of a quad;
                                                                with no modifier and a positive scale,
                                                                S stays raw and the scale goes into exp2)
    acc += P V_j           P packed from S's accumulators straight into A fragments (never stored)

and at the end ``out = acc / l_i`` (rounded to the input format), ``lse = m_i + log(l_i)``.

Data are handled as 32-bit words of two 16-bit values (the operand format of
``mma``): q, k, v, out arrive as ``uint32`` views of the caller's arrays (head
dim even, pairs contiguous; ``api`` checks).  K_j and V_j are copied into shared
memory with ``cp.async`` (16-byte chunks where the layout is 16-byte aligned,
``VEC16``; else 4-byte words), double-buffered: tile j + 1 is in flight while
tile j is computed.  Both stay row-major; ``ldmatrix.x4`` reads K's ``b``
fragments and ``ldmatrix.x4.trans`` V's (keys become the k dimension).  Row
strides are padded to 4 (mod 8) words: the 8 rows of 16 bytes that one
``ldmatrix`` phase reads fall in 32 different banks.  A head dim that is not a
multiple of 16 is padded with zeros (cp.async's zero fill) in shared memory (the copies: ``_copy``).

Hopper's form of the same kernel (``WGMMA``: warpgroup MMA from swizzled tiles, the tensor-copy engine, tf32
``wgmma``) shares this kernel body; its steps are built in ``forward_wgmma``.
"""
import math
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
from numba import cuda

from ._copy import make_async_tile_copy, make_swizzled_tile_copy, tc_padded_words
from ._jit import SIMULATOR, device_function, kernel, kernel_factory, unrolled
from ._mma import SMEM_ALIGN, make_mma_pair, memory_primitives, primitives, tf32_primitives
from ._scores import Mods, make_allowed_fn, make_score_fn, make_tile_mask_fn, mask_block, philox_keep
from ._tiles import U, make_row_allreduce, make_tile_order, packed_tile_head_batch, sequence_span
from ._wgmma import SMEM_ALIGN as WG_ALIGN, SWIZZLE_BYTES
from .forward import LN2, LOG2E, make_mask_bounds, make_next_tile, make_window_helpers
from .forward_wgmma import make_forward_wgmma_steps


@lru_cache(maxsize=None)
@kernel_factory
def make_forward_tc(BLOCK_Q, BLOCK_K, HEAD_DIM, DTYPE_NAME, VEC16, MT, Q_SMEM, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK,
                    HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, POS_SCALE=False, VARLEN=False, TF32X3=True,
                    WGMMA=False, TMA=False, QS_REG=False, SECTION=0, MIN_BLOCKS=0, MODS=None):
    """Build the tensor-core forward kernel: (kernel, dynamic shared bytes, threads per block).

    ``MODS`` (``_scores.Mods``): a ``flex_attention`` call's ``score_mod`` and ``mask_mod``, inlined where the
    options' code goes, as in ``forward.make_forward``.

    ``MT``: m16 row blocks per warp.  ``Q_SMEM``: keep the Q tile in shared memory and
    ldmatrix its fragments at each k-step (frees ``MT * HEAD_DIM / 4`` registers per thread),
    instead of holding them in registers for the whole kernel.  ``POS_SCALE``: the launch
    promises ``scale > 0``; with no score option the scale then moves into ``exp2``'s argument
    (the row max taken on the raw scores, ``p = exp2(s * scale_log2 - m_i)``: one FFMA per score
    instead of a multiply and a subtract).  (Two experiments measured slower and removed, with their
    records in docs/notes/tensorcore.md: the query tiles last first, ``LPT``, and the window mask by
    32-bit compares, ``MASK32``.)  ``SECTION``: a dense batch's blocks in ``_tiles.make_tile_order``'s longest-first
    order, the query tiles last first across sections of ``SECTION`` (head, batch) pairs (0: tile fastest; the
    ``LPT`` above ran each head's tiles last first, which leaves the last heads' long tiles at the grid's end).
    ``MIN_BLOCKS``: launch bounds asking ptxas for registers that leave ``MIN_BLOCKS`` blocks an SM (0: none).
    ``VARLEN``: a packed batch, as in ``forward.make_forward`` (the word
    views' batch stride is 0, so the base offsets ``b * strides[0]`` vanish), but with each sequence's rows
    addressed from its first (``q_start``, ``k_start``) instead of sliced out: a slice of a C-contiguous array is
    an "A"-layout array whose every index pays for its strides (d = 64: 4368 SASS instructions and 64 / 112
    bytes of spills sliced, 2816 and 20 / 104 offset; the dense kernel 2680 and none).

    ``DTYPE_NAME="float32"``: the same kernel on tf32 tensor cores (``mma.m16n8k8``; a word is one value, and
    ``m16n8k8``'s tf32 fragments are, in words, ``m16n8k16``'s 16-bit ones, so Q's and K's fragments come as
    before).  ``TF32X3`` (``precision="highest"``): each operand split into a tf32 part and a tf32 residual,
    three products per mma (``a_small b_big + a_big b_small + a_big b_big``, about float32's accuracy); K_j and
    V_j are split once per tile into a second shared buffer, Q once (registers, or its shared tile), P in
    registers.  Without it (``precision="high"``): one product, Q and P rounded to tf32, K and V truncated by
    the tensor cores.  P V takes P straight from S's accumulators with the keys of an 8-key k-step permuted
    (key ``2t`` as k index ``t``, ``2t + 1`` as ``t + 4``), the same permutation on V's rows, which come by
    plain 32-bit loads (no ldmatrix transpose for 32-bit values).

    ``WGMMA`` (compute capability 9.0, 16-bit inputs): the two products by Hopper's warpgroup MMA
    (``_wgmma``): each warpgroup of 4 warps owns 64 query rows (``MT = 1``: per warp the same 16 rows and the
    same accumulator fragments as ``mma``'s, so masks, softmax and epilogue are unchanged); ``S = Q K_j^T``
    with Q and K_j from shared memory, ``acc += P V_j`` with P from registers (S's accumulators, packed) and
    V_j from shared memory.  Q, K_j and V_j are stored 128-byte swizzled (``make_swizzled_tile_copy``) with
    the head dim padded to 64, and ``fence.proxy.async`` hands each landed tile to the tensor cores.
    ``TMA`` (with ``WGMMA``): the tiles come by the tensor-copy engine (``_tma``) instead of cp.async: thread
    0 issues Q's and K_j, V_j's boxes (tensor maps 0-2 of ``maps``) into one of two stages; the readers wait on
    the stage's ``full`` barrier and arrive on its ``empty`` one when done with it, and thread 0 copies tile
    j + 1 into a stage once every reader of tile j - 1 has left it: no block-wide barrier in the loop.  A
    packed batch's boxes are rows of the packed tensor, so a tile past a sequence's end holds the next
    sequence's rows (zeros past the tensor): its queries are never stored and its keys are masked, and the
    last key tile's values past the sequence are zeroed in shared memory before ``P V_j`` (P is 0 there, but
    0 times a non-finite value is not).
    ``WGMMA`` with ``DTYPE_NAME="float32"`` (``WG_TF32``, dense batches): the products on tf32 ``wgmma``, which
    reads both operands K-major only: ``k`` and ``v`` are then the pre-pass's ``kk`` and ``vt``
    (``tf32_prepare.make_prepare_tf32``: K's tf32 parts, V^T with the keys relabelled as ``pv_tile_tf32``'s),
    whose tiles the copy engine brings ready, four to a stage (K_j, V_j^T and, ``TF32X3``, their small parts); Q
    is split once, after it lands; S and P V_j as three products each, P V_j's into a per-tile partial
    (docs/notes/hopper.md, steps 8 and 10).  ``QS_REG`` (with ``WG_TF32`` and ``TF32X3``): Q's small parts in
    registers, as the a fragments of ``S``'s small-part product (``wgmma_rs``; 4 words a k-step, 64 at head dim
    128), not in shared memory, so two warpgroups' Q fits beside two stages at head dim 128; P V_j's partial then covers
    half the dims at a time (its other half of registers are Q's).

    The kernel body is FA2's Algorithm 1; each step of a key tile is one helper below (``score_tile``,
    ``mask_tile``, ``online_softmax``, ``pv_step``), the epilogue ``store_out_lse``; the stages' hand-offs
    (``release_stage``; ``forward_wgmma``'s ``init_barriers``, ``prepare_stage``) are helpers too.
    """
    TF32 = DTYPE_NAME == "float32"
    SPLIT = TF32 and TF32X3                  # 3xTF32: big and small parts of every operand
    VALS = 1 if TF32 else 2                  # values per 32-bit word
    assert BLOCK_Q % (16 * MT) == 0 and BLOCK_K % 16 == 0 and HEAD_DIM % VALS == 0
    NWARPS = BLOCK_Q // (16 * MT)            # each warp owns MT m-tiles of 16 query rows
    NTHREADS = 32 * NWARPS
    ROWS = 2 * MT                            # query rows per thread: (m-tile, fragment half)
    HEAD_WORDS = HEAD_DIM // VALS            # words of one row in global memory
    # words of one row in shared memory: a k-step of the mma reads 8, and P V's n-tiles (8 values) go in pairs;
    # WGMMA: whole swizzled blocks of 64 values (32 words)
    D_ALIGN = 32 if WGMMA else 8 * (3 - VALS)
    D_WORDS = -(-HEAD_WORDS // D_ALIGN) * D_ALIGN
    D_PAD = D_WORDS * VALS                   # head dim padded to the mma's k
    KSTEPS_D = D_WORDS // 8                  # k-steps of Q K^T
    NT_K = BLOCK_K // 8                      # n-tiles of S (8 keys each)
    MASK_WORDS = (MT * NT_K * 4 + 31) // 32  # a mask_mod's bits of one thread's S (``mask_words``)
    KSTEPS_K = BLOCK_K // (8 * VALS)         # k-steps of P V (16 keys each, tf32: 8)
    NT_D = D_PAD // 8                        # n-tiles of the output (8 dims each)
    if WGMMA:
        assert MT == 1 and Q_SMEM and VEC16 and NWARPS % 4 == 0 and BLOCK_K % 16 == 0
    STRIDE = D_WORDS if WGMMA else tc_padded_words(D_WORDS)   # words per key row of a K or V tile (WGMMA: swizzled)
    TILE = BLOCK_K * STRIDE                  # words of one K (or V) tile
    V_OFF = TILE                             # buffer s: K at s * STAGE_WORDS, V at s * STAGE_WORDS + V_OFF
    STAGE_WORDS = 2 * TILE
    WG_TF32 = WGMMA and TF32                 # float32 on tf32 wgmma, its K and V prepared by the pre-pass
    if WG_TF32:   # a stage: K_j (big parts), V_j^T, then SPLIT: K_j's small parts, V_j^T's (make_prepare_tf32's)
        assert TMA and not VARLEN
        VT_WORDS = D_PAD * 32 * -(-BLOCK_K // 32)   # D_PAD rows of 128 bytes per 32 keys (a partial block too)
        K_SMALL = V_OFF + VT_WORDS
        VT_SMALL = K_SMALL + TILE
        STAGE_WORDS = (2 if SPLIT else 1) * (TILE + VT_WORDS)
    Q_OFF = 2 * STAGE_WORDS                  # two buffers of (K_j, V_j), then the Q tile if Q_SMEM
    Q_WORDS = BLOCK_Q * STRIDE if Q_SMEM else 0
    SMALL = Q_OFF + Q_WORDS                  # SPLIT: the small parts of K_j, V_j (one buffer), then of Q
    SMALL_Q = SMALL if WG_TF32 else SMALL + 2 * TILE   # (WG_TF32: K_j's, V_j^T's small parts are in the stages)
    QS_REG = QS_REG and WG_TF32 and SPLIT    # Q's small parts in registers (wgmma_rs), not at SMALL_Q
    QS_WORDS = 4 * KSTEPS_D if QS_REG else 1  # (their a fragments: 4 words a k-step)
    HALF_D = NT_D * 4                         # QS_REG: P V_j's partial covers half of the (padded) dims
    PART_NT = NT_D // 2 if QS_REG else NT_D if WG_TF32 and SPLIT else 1   # the partial's n-tiles
    SMEM_WORDS = SMALL_Q + Q_WORDS if SPLIT and not QS_REG else SMALL
    SCRATCH = NTHREADS * 2 * MT if SIMULATOR else 0  # the quad reduction's scratch (simulator only), after the tiles
    SHARED_BYTES = (SMEM_WORDS + SCRATCH) * 4
    if TMA:   # the copy engine fills the stages; barriers after the tiles: full[s], empty[s], Q's
        assert WGMMA
        STAGES = 2
        FULL = -(-SHARED_BYTES // 8) * 8
        EMPTY = FULL + 8 * STAGES
        Q_FULL = EMPTY + 8 * STAGES
        SHARED_BYTES = Q_FULL + 8
        KV_BYTES, Q_BYTES = 4 * STAGE_WORDS, 4 * Q_WORDS  # bytes one stage's copies, and Q's, complete
    TILE_ALIGN = WG_ALIGN if WGMMA else SMEM_ALIGN   # the swizzle's 1024-byte atoms start on its boundaries
    P_ALL = 4 * KSTEPS_K if WGMMA else 1
    CW = 4 if VEC16 else 1                   # words per cp.async
    CHUNKS = D_WORDS // CW                   # cp.async copies per key row
    MODS = MODS or Mods()
    INDEX32 = MODS.index32
    HAS_SCORE_MOD = MODS.score_mod is not None
    HAS_MASK_MOD = MODS.mask_mod is not None
    HAS_MODS = HAS_SOFTCAP or HAS_BIAS or HAS_ALIBI or HAS_SCORE_MOD
    FOLD = POS_SCALE and not HAS_MODS        # S stays raw until exp2 (scale_log2 > 0 keeps the row max's place)
    # masks from comparisons where the general mask loop would put S in local memory: a window, no score
    # option or mask in memory, two m-tiles per warp (with one, S stays in registers either way, and the
    # comparisons measured 1-6% slower at d = 128, causal: bench/results/h100-tune-tc-2026-11-23.md)
    WINDOW_ONLY = HAS_WINDOW and not (HAS_MODS or HAS_ATTN_MASK or HAS_BLOCK_MASK or HAS_MASK_MOD) and MT > 1
    BIG = 1 << 40
    F32 = np.float32
    ZERO, NEG_INF, LOG2E_T, LN2_T = F32(0), F32(-np.inf), F32(LOG2E), F32(LN2)
    W0 = np.uint32(0)
    U32_DT, F32_DT = np.dtype(np.uint32), np.dtype(np.float32)

    _, pack2, _ = primitives(DTYPE_NAME)
    mma_pair = make_mma_pair(DTYPE_NAME)
    tf32 = tf32_primitives()
    split_bits, round_bits, split_value, round_value, as_bits = (
        tf32[name] for name in ("split_bits", "round_bits", "split_value", "round_value", "as_bits"))
    mem = memory_primitives()
    cp_async = mem["cp_async16"] if VEC16 else mem["cp_async4"]
    cp_async_commit, wait_all, wait_prev = mem["cp_async_commit"], mem["cp_async_wait_all"], mem["cp_async_wait_prev"]
    ldmatrix_x4, ldmatrix_x4_trans = mem["ldmatrix_x4"], mem["ldmatrix_x4_trans"]
    exp2 = mem["exp2_ftz"]
    # a query row's 4 values per n-tile live in the 4 lanes of a quad: reduce over them
    quad_max = make_row_allreduce(2 * MT, 4, NTHREADS, F32, is_max=True)
    quad_sum = make_row_allreduce(2 * MT, 4, NTHREADS, F32, is_max=False)
    score = make_score_fn(F32, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, MODS.score_mod)
    MASK_BLOCK = mask_block(MODS)
    allowed = make_allowed_fn(HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MODS.mask_mod, MASK_BLOCK)
    tile_mask, ONE_BLOCK = make_tile_mask_fn(HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MODS, BLOCK_Q, BLOCK_K)
    key_tile_range, tile_state = make_window_helpers(BLOCK_Q, BLOCK_K, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK,
                                                     MASK_BLOCK)
    tile_order = make_tile_order(SECTION, LAST_FIRST=True)   # (a causal forward's longest query tiles: its last)

    @device_function
    def load_q_frags(q, b, h, row0, seqlen_q, t, q_reg, q_small, m, q_start):
        """Q's a fragments of m-tile ``m`` (rows ``row0``, ``row0 + 8``) straight from global memory (read once);
        tf32: rounded, or (``SPLIT``) split into ``q_reg`` and ``q_small``."""
        for ks in range(KSTEPS_D):
            for half in range(2):
                c = ks * 8 + t + 4 * half
                for r in range(2):
                    i = row0 + 8 * r
                    w = q[U(b), U(q_start + i), U(h), U(c)] if (i < seqlen_q and c < HEAD_WORDS) else W0
                    if SPLIT:
                        q_reg[m, ks, 2 * half + r], q_small[m, ks, 2 * half + r] = split_bits(w)
                    elif TF32:
                        q_reg[m, ks, 2 * half + r] = round_bits(w)
                    else:
                        q_reg[m, ks, 2 * half + r] = w

    @device_function
    def lane_coords():
        """(warp, lane, fragment row ``g`` (and ``g + 8``), fragment column pair ``t``) of this thread."""
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x - 32 * warp
        g = lane // 4
        return warp, lane, g, lane - 4 * g

    @device_function
    def init_state(m_i, l_i, acc):
        """``m_i = -inf``, ``l_i = 0``, ``acc = 0``."""
        for r in range(ROWS):
            m_i[r] = NEG_INF
            l_i[r] = ZERO
        for m in range(MT):
            for n in range(NT_D):
                for e in range(4):
                    acc[m, n, e] = ZERO

    @device_function
    def split_smem(smem, src, dst, nwords):
        """SPLIT: ``smem[src:src + nwords]`` -> its tf32 big parts in place and its small parts at ``dst``, by
        the whole block (the caller synchronises before and after)."""
        for i in range(cuda.threadIdx.x, nwords, NTHREADS):
            smem[src + i], smem[dst + i] = split_bits(smem[src + i])

    # cp.async work split: thread tid copies chunk column (tid % CHUNKS) of rows tid // CHUNKS + i ROW_STEP,
    # a compile-time trip count (no remainder loop) when the chunks divide evenly among the threads
    EVEN_COPY = NTHREADS % CHUNKS == 0 and BLOCK_K % (NTHREADS // CHUNKS) == 0 and not WGMMA
    ROW_STEP = NTHREADS // CHUNKS if EVEN_COPY else 0
    ITERS = BLOCK_K // ROW_STEP if EVEN_COPY else 0
    FULL_ROWS = D_WORDS == HEAD_WORDS        # no padding words: every chunk of a key row is in the source

    if WGMMA:
        copy_kv = make_swizzled_tile_copy(BLOCK_K, D_WORDS, HEAD_WORDS, NTHREADS)
    else:
        copy_kv = make_async_tile_copy(BLOCK_K, D_WORDS, STRIDE, HEAD_WORDS, CW, NTHREADS)

    @device_function
    def start_kv_copy(k, v, k_base, v_base, k_row, v_row, k0, seqlen_k, smem, base):
        """cp.async K_j, V_j into the buffer at ``base``; rows past the keys and words past the head dim get zeros.

        ``k_base``, ``k_row``: word offset of k[b, 0, hk, 0] and words per key row (likewise v):
        one multiply-add per copy instead of Numba's four-index arithmetic; for a whole tile of
        unpadded rows (every tile but the last), no bounds at all and one add per copy.
        """
        nrows = seqlen_k - k0
        if EVEN_COPY and FULL_ROWS and nrows >= BLOCK_K:   # a whole tile: the copier's bound-free path
            copy_kv(k, k_base, k_row, k0, nrows, smem, base)
            copy_kv(v, v_base, v_row, k0, nrows, smem, base + V_OFF)
        elif EVEN_COPY:
            r0 = cuda.threadIdx.x // CHUNKS
            c = (cuda.threadIdx.x - r0 * CHUNKS) * CW
            col_ok = c < HEAD_WORDS
            for it in range(ITERS):
                r = r0 + it * ROW_STEP
                ok = col_ok and r < nrows
                row = k0 + r if ok else k0          # a zero fill still names a valid source address
                col = c if ok else 0
                nbytes = 4 * CW if ok else 0
                cp_async(smem, U(base + r * STRIDE + c), k, k_base + row * k_row + col, nbytes)
                cp_async(smem, U(base + V_OFF + r * STRIDE + c), v, v_base + row * v_row + col, nbytes)
        else:                                       # the copier (the whole tile's bound-free path, or its general loop)
            copy_kv(k, k_base, k_row, k0, nrows, smem, base)
            copy_kv(v, v_base, v_row, k0, nrows, smem, base + V_OFF)
        cp_async_commit()

    if WGMMA:
        copy_q = make_swizzled_tile_copy(BLOCK_Q, D_WORDS, HEAD_WORDS, NTHREADS)
    else:
        copy_q = make_async_tile_copy(BLOCK_Q, D_WORDS, STRIDE, HEAD_WORDS, CW, NTHREADS)

    next_tile = make_next_tile(BLOCK_Q, BLOCK_K, HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MASK_BLOCK)
    key_bounds, _ = make_mask_bounds(BLOCK_Q, BLOCK_K, MASK_BLOCK)

    if WGMMA:   # the warpgroup products, the copy engine's stages, the float32 form (forward_wgmma)
        hopper = make_forward_wgmma_steps(SimpleNamespace(**{n: v for n, v in locals().items() if n.isupper()}),
                                          split_smem)
        wgmma_qk, fence_async, pv_tile_wgmma = hopper.wgmma_qk, hopper.fence_async, hopper.pv_tile_wgmma
        score_tile_wgmma_tf32, pv_tile_wgmma_tf32 = hopper.score_tile_wgmma_tf32, hopper.pv_tile_wgmma_tf32
    if TMA:
        mbar_wait, mbar_arrive, load_q_tile, load_kv_stage = (
            hopper.mbar_wait, hopper.mbar_arrive, hopper.load_q_tile, hopper.load_kv_stage)
        init_barriers, prepare_stage = hopper.init_barriers, hopper.prepare_stage

    # ---- the steps of one key tile, on this thread's fragments: element e of (m-tile m, n-tile n) is query
    # row0 + 16 m + 8 (e >> 1) and key k0 + 8 n + 2 t + (e & 1) (m16n8k16's accumulator layout)
    @device_function
    def score_tile(smem, base, q_reg, q_small, q_frag, q_frag_s, q_lane, k_lane, s_reg):
        """S = Q K_j^T: per k-step, Q's a fragments of every m-tile (registers, or ldmatrix from the shared Q
        tile), then per ldmatrix of K two n-tiles (16 keys) fed to every m-tile (``SPLIT``: the small parts'
        products first, then the big parts')."""
        for m in range(MT):
            for n in range(NT_K):
                for e in range(4):
                    s_reg[m, n, e] = ZERO
        for ks in range(KSTEPS_D):
            for m in range(MT):
                if Q_SMEM:
                    q_frag[m, 0], q_frag[m, 1], q_frag[m, 2], q_frag[m, 3] = ldmatrix_x4(
                        smem, U(q_lane + 16 * m * STRIDE + 8 * ks))
                    if SPLIT:
                        q_frag_s[m, 0], q_frag_s[m, 1], q_frag_s[m, 2], q_frag_s[m, 3] = ldmatrix_x4(
                            smem, U(q_lane - Q_OFF + SMALL_Q + 16 * m * STRIDE + 8 * ks))
                else:
                    for e in range(4):
                        q_frag[m, e] = q_reg[m, ks, e]
                        if SPLIT:
                            q_frag_s[m, e] = q_small[m, ks, e]
            for n in range(0, NT_K, 2):
                b0, b1, b2, b3 = ldmatrix_x4(smem, U(base + 8 * n * STRIDE + 8 * ks + k_lane))
                if SPLIT:
                    s0, s1, s2, s3 = ldmatrix_x4(smem, U(SMALL + 8 * n * STRIDE + 8 * ks + k_lane))
                    for m in range(MT):
                        mma_pair(q_frag_s, m, b0, b1, b2, b3, s_reg, n)
                        mma_pair(q_frag, m, s0, s1, s2, s3, s_reg, n)
                for m in range(MT):
                    mma_pair(q_frag, m, b0, b1, b2, b3, s_reg, n)

    @device_function
    def window_mask_tile(s_reg, row0, k0, t, seqlen_q, seqlen_k, off, left, right, scale_log2):
        """S in log2 units with a window's mask by comparisons, no branches: a loop body small enough to unroll
        (the general loop of ``modify_mask_tile`` is not unrolled with a window: S would live in local memory in
        the whole kernel).  A score leaves the window iff key - (query + off) = rel0 + dj - di leaves
        [-left, right], or its key or query is past the sequence."""
        rel0 = k0 + 2 * t - row0 - off                # key - (query + off) of element (0, 0, 0)
        lo = -left if left >= 0 else -BIG
        hi = right if right >= 0 else BIG
        kend = seqlen_k - (k0 + 2 * t)
        qend = seqlen_q - row0
        for m in range(MT):
            for n in range(NT_K):
                for e in range(4):
                    dj = 8 * n + (e % 2)
                    di = 16 * m + 8 * (e // 2)
                    x = s_reg[m, n, e] if FOLD else s_reg[m, n, e] * scale_log2
                    if (rel0 + (dj - di) < lo) | (rel0 + (dj - di) > hi) | (dj >= kend) | (di >= qend):
                        x = NEG_INF
                    s_reg[m, n, e] = x

    @device_function
    def mask_words_loop(words, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask,
                        bm_q, bm_k):
        """``mask_words`` as a loop (``plan.FLEX_MASK_WRITTEN`` without its bit 1): the words in local memory."""
        for w in range(MASK_WORDS):
            words[w] = W0
        for m in range(MT):
            for n in range(NT_K):
                for e in range(4):
                    if allowed(row0 + 16 * m + 8 * (e // 2), k0 + 8 * n + 2 * t + (e % 2), b, h, seqlen_q, seqlen_k,
                               off, left, right, attn_mask, block_mask, bm_q, bm_k):
                        x = (m * NT_K + n) * 4 + e
                        words[x >> 5] |= np.uint32(1) << np.uint32(x & 31)

    @device_function
    def mask_bit(m, n, e, words, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask,
                 bm_q, bm_k):
        """Sets element ``(m, n, e)``'s bit of ``words`` where its score is allowed (``_scores.tile_mask``)."""
        if tile_mask(row0 + 16 * m + 8 * (e // 2), k0 + 8 * n + 2 * t + (e % 2), b, h, seqlen_q, seqlen_k, off,
                     left, right, attn_mask, block_mask, bm_q, bm_k):
            x = (m * NT_K + n) * 4 + e
            words[x >> 5] |= np.uint32(1) << np.uint32(x & 31)

    mask_each = unrolled(mask_bit, (MT, NT_K, 4)) if HAS_MASK_MOD else None

    @device_function
    def mask_words_out(words, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask, bm_q,
                       bm_k):
        """``words``: one bit per S element of this thread (element ``(m * NT_K + n) * 4 + e``), set where the
        score is allowed.  Written out (``mask_bit`` at literal indices), so that the words stay in registers and
        each element's indices are the thread's base plus a constant; apart from S."""
        for w in range(MASK_WORDS):
            words[w] = W0
        mask_each(words, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask, bm_q, bm_k)

    mask_words = mask_words_out if MODS.mask_written & 1 and ONE_BLOCK else mask_words_loop

    @device_function
    def modify_element(m, n, e, s_reg, words, need_mask, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right,
                       scale, scale_log2, softcap, attn_bias, alibi, attn_mask, block_mask, bm_q, bm_k):
        """Element ``(m, n, e)`` of S <- its score modifiers, and -inf where the masks cut it (``need_mask``;
        with a mask_mod, its bit in ``words`` clear); log2 units (raw under FOLD)."""
        i = row0 + 16 * m + 8 * (e // 2)
        j = k0 + 8 * n + 2 * t + (e % 2)
        if HAS_SCORE_MOD and INDEX32:       # (int32: no 64-bit index work a score; indices < 2^31)
            x = score(s_reg[m, n, e], min(np.int32(i), np.int32(seqlen_q - 1)),
                      min(np.int32(j), np.int32(seqlen_k - 1)), np.int32(b), np.int32(h), off, scale,
                      softcap, attn_bias, alibi) * LOG2E_T
        elif HAS_SCORE_MOD:     # the user's function sees only indices inside the sequences
            x = score(s_reg[m, n, e], min(i, seqlen_q - 1), min(j, seqlen_k - 1), b, h, off, scale,
                      softcap, attn_bias, alibi) * LOG2E_T
        elif HAS_MODS:
            x = score(s_reg[m, n, e], i, j, b, h, off, scale, softcap, attn_bias, alibi) * LOG2E_T
        elif FOLD:
            x = s_reg[m, n, e]
        else:
            x = s_reg[m, n, e] * scale_log2
        if need_mask:
            if HAS_MASK_MOD:
                bit = (m * NT_K + n) * 4 + e
                if (words[bit >> 5] >> np.uint32(bit & 31)) & np.uint32(1) == 0:
                    x = NEG_INF
            elif not allowed(i, j, b, h, seqlen_q, seqlen_k, off, left, right,
                             attn_mask, block_mask, bm_q, bm_k):
                x = NEG_INF
        s_reg[m, n, e] = x

    modify_each = unrolled(modify_element, (MT, NT_K, 4)) if HAS_MODS else None

    @device_function
    def modify_mask_tile(s_reg, need_mask, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right, scale,
                         scale_log2, softcap, attn_bias, alibi, attn_mask, block_mask, bm_q, bm_k):
        """S <- score modifiers (softcap, bias, ALiBi) and, on a tile the masks cut, -inf where a score is not
        allowed; log2 units (raw under FOLD).  With a mask_mod, the mask first as bits (``mask_words``)."""
        words = cuda.local.array(MASK_WORDS, np.uint32)
        if HAS_MASK_MOD and need_mask:
            mask_words(words, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask, bm_q,
                       bm_k)
        if HAS_MODS:                     # written out: a score step (softcap, bias, ALiBi, a score_mod) is too long
                                         # for ptxas to unroll a loop over (S would live in local memory)
            modify_each(s_reg, words, need_mask, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right, scale,
                        scale_log2, softcap, attn_bias, alibi, attn_mask, block_mask, bm_q, bm_k)
        else:
            for m in range(MT):
                for n in range(NT_K):
                    for e in range(4):
                        modify_element(m, n, e, s_reg, words, need_mask, row0, k0, t, b, h, seqlen_q, seqlen_k, off,
                                       left, right, scale, scale_log2, softcap, attn_bias, alibi, attn_mask,
                                       block_mask, bm_q, bm_k)

    @device_function
    def scale_tile(s_reg, scale_log2):
        """S in log2 units, on a tile inside every mask with no modifier."""
        for m in range(MT):
            for n in range(NT_K):
                for e in range(4):
                    s_reg[m, n, e] *= scale_log2

    @device_function
    def mask_tile(s_reg, need_mask, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right, scale, scale_log2,
                  softcap, attn_bias, alibi, attn_mask, block_mask, bm_q, bm_k):
        """S <- mask(score mods(S)) in log2 units (raw under FOLD): a window alone by comparisons
        (``window_mask_tile``), else ``modify_mask_tile`` where an option or the masks apply, else ``scale_tile``."""
        if WINDOW_ONLY and need_mask:
            window_mask_tile(s_reg, row0, k0, t, seqlen_q, seqlen_k, off, left, right, scale_log2)
        elif not WINDOW_ONLY and (HAS_MODS or need_mask):
            modify_mask_tile(s_reg, need_mask, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right, scale,
                             scale_log2, softcap, attn_bias, alibi, attn_mask, block_mask, bm_q, bm_k)
        elif not FOLD:
            scale_tile(s_reg, scale_log2)

    @device_function
    def online_softmax(s_reg, m_i, l_i, acc, row, scratch, tid, t, scale_log2, row0, k0, b, h,
                       drop_threshold, drop_scale, seed_lo, seed_hi):
        """m_new = max(m_i, rowmax S); P = exp2(S - m_new) (dropped out after l_i takes it); l_i and acc
        rescaled by alpha = exp2(m_i - m_new).  A row's max is over the 4 lanes of a quad."""
        for m in range(MT):
            for r in range(2):
                x = NEG_INF
                for n in range(NT_K):
                    x = max(x, max(s_reg[m, n, 2 * r], s_reg[m, n, 2 * r + 1]))
                row[2 * m + r] = x * scale_log2 if FOLD else x
        quad_max(row, scratch, tid // 4, t)
        for m in range(MT):
            for r in range(2):
                m_new = max(m_i[2 * m + r], row[2 * m + r])
                m_use = m_new if m_new != NEG_INF else ZERO   # nothing seen yet: exp2(-inf) = 0, not NaN
                alpha = exp2(m_i[2 * m + r] - m_use)
                m_i[2 * m + r] = m_new
                l_tile = ZERO
                for n in range(NT_K):
                    for e in range(2 * r, 2 * r + 2):
                        p = exp2((s_reg[m, n, e] * scale_log2 if FOLD else s_reg[m, n, e]) - m_use)
                        l_tile += p                            # l_i uses P before dropout
                        if HAS_DROPOUT:
                            i = row0 + 16 * m + 8 * r
                            j = k0 + 8 * n + 2 * t + (e % 2)
                            p = p * drop_scale if philox_keep(seed_lo, seed_hi, b, h, i, j, drop_threshold) else ZERO
                        s_reg[m, n, e] = p
                l_i[2 * m + r] = l_i[2 * m + r] * alpha + l_tile
                for n in range(NT_D):
                    acc[m, n, 2 * r] *= alpha
                    acc[m, n, 2 * r + 1] *= alpha

    @device_function
    def pv_tile_tf32(smem, base, v_word, s_reg, p_reg, p_small, acc, part):
        """acc += P V_j on tf32 operands: k-step kk is S's n-tile kk (8 keys), key ``2t + e`` of it taken as k
        index ``t + 4 e`` both in P's a fragment (S's accumulators as they are) and in V's b fragments (rows
        ``2t``, ``2t + 1`` at column ``g`` of each output n-tile: two 32-bit loads per n-tile, conflict-free as
        2 STRIDE = 8 or 24 mod 32 words).  ``SPLIT``: a k-step's three products go into a zeroed partial
        ``part``, added to ``acc`` by ordinary (round-to-nearest) float32 adds: the tensor cores' float32
        accumulation does not round to nearest, and adding every key's products of a row into ``acc`` itself
        cost 4-16x the SIMT kernels' error (bench/results/h100-tf32-2026-11-25.md)."""
        for kk in range(KSTEPS_K):
            for m in range(MT):
                for e in range(4):
                    x = s_reg[m, kk, (e % 2) * 2 + e // 2]      # a0..a3 = S[g, 2t], S[g+8, 2t], S[g, 2t+1], S[g+8, 2t+1]
                    if SPLIT:
                        p_reg[m, e], p_small[m, e] = split_value(x)
                    else:
                        p_reg[m, e] = round_value(x)
            row = v_word + 8 * kk * STRIDE
            for n in range(0, NT_D, 2):
                at = base + V_OFF + row + 8 * n
                b0, b1, b2, b3 = smem[at], smem[at + STRIDE], smem[at + 8], smem[at + STRIDE + 8]
                if SPLIT:
                    at = SMALL + TILE + row + 8 * n
                    s0, s1, s2, s3 = smem[at], smem[at + STRIDE], smem[at + 8], smem[at + STRIDE + 8]
                    for m in range(MT):
                        for j in range(2):
                            for e in range(4):
                                part[m, j, e] = ZERO
                        mma_pair(p_small, m, b0, b1, b2, b3, part, 0)
                        mma_pair(p_reg, m, s0, s1, s2, s3, part, 0)
                        mma_pair(p_reg, m, b0, b1, b2, b3, part, 0)
                        for j in range(2):
                            for e in range(4):
                                acc[m, n + j, e] += part[m, j, e]
                else:
                    for m in range(MT):
                        mma_pair(p_reg, m, b0, b1, b2, b3, acc, n)

    @device_function
    def pv_tile(smem, base, v_lane, s_reg, p_reg, acc):
        """acc += P V_j: P's a fragments are S's accumulators of n-tiles 2kk, 2kk + 1, packed; one
        ldmatrix.trans gives V's b fragments of two output n-tiles, used by every m-tile."""
        for kk in range(KSTEPS_K):
            for m in range(MT):
                p_reg[m, 0] = pack2(s_reg[m, 2 * kk, 0], s_reg[m, 2 * kk, 1])
                p_reg[m, 1] = pack2(s_reg[m, 2 * kk, 2], s_reg[m, 2 * kk, 3])
                p_reg[m, 2] = pack2(s_reg[m, 2 * kk + 1, 0], s_reg[m, 2 * kk + 1, 1])
                p_reg[m, 3] = pack2(s_reg[m, 2 * kk + 1, 2], s_reg[m, 2 * kk + 1, 3])
            for n in range(0, NT_D, 2):
                b0, b1, b2, b3 = ldmatrix_x4_trans(smem, U(base + 16 * kk * STRIDE + 4 * n + v_lane))
                for m in range(MT):
                    mma_pair(p_reg, m, b0, b1, b2, b3, acc, n)

    @device_function
    def release_stage(smem, buf, i):
        """This thread is done with stage ``buf`` (TMA: arrives on its ``empty`` barrier; cp.async: the block
        synchronises); the next tile's (stage, number)."""
        if TMA:
            mbar_arrive(smem, EMPTY + 8 * buf)
            if SIMULATOR:
                cuda.syncthreads()
            return buf, i + 1
        cuda.syncthreads()
        return 1 - buf, i

    @device_function
    def pv_step(smem, base, v_lane, v_word, s_reg, p_reg, p_small, p_all, p_all_s, part, wpart, acc):
        """acc += P V_j of the tile in the buffer at ``base``: by ``wgmma`` (tf32: ``pv_tile_wgmma_tf32``) or
        ``mma`` (tf32: ``pv_tile_tf32``)."""
        if WG_TF32:
            pv_tile_wgmma_tf32(smem, base, s_reg, p_all, p_all_s, acc, wpart)
        elif WGMMA:
            pv_tile_wgmma(smem, base, s_reg, p_all, acc)
        elif TF32:
            pv_tile_tf32(smem, base, v_word, s_reg, p_reg, p_small, acc, part)
        else:
            pv_tile(smem, base, v_lane, s_reg, p_reg, acc)

    @device_function
    def store_out_lse(out, lse, acc, m_i, l_i, scratch, tid, t, row0, b, h, seqlen_q, q_start):
        """out = acc / l_i (rounded to the input format), lse = (m_i + log2 l_i) ln 2; l_i summed over the quad
        first.  A row that saw no key (l_i = 0) gets out = 0, lse = -inf."""
        quad_sum(l_i, scratch, tid // 4, t)
        for m in range(MT):
            for r in range(2):
                i = row0 + 16 * m + 8 * r
                if i < seqlen_q:
                    l = l_i[2 * m + r]
                    inv_l = ZERO if l == ZERO else F32(1) / l
                    for n in range(NT_D):
                        if TF32:
                            for e in range(2):
                                c = 8 * n + 2 * t + e
                                if c < HEAD_WORDS:
                                    out[U(b), U(q_start + i), U(h), U(c)] = as_bits(acc[m, n, 2 * r + e] * inv_l)
                        else:
                            c = 4 * n + t
                            if c < HEAD_WORDS:
                                out[U(b), U(q_start + i), U(h), U(c)] = pack2(acc[m, n, 2 * r] * inv_l,
                                                                    acc[m, n, 2 * r + 1] * inv_l)
                    if t == 0:
                        lse[b, h, q_start + i] = NEG_INF if l == ZERO else (m_i[2 * m + r] + math.log2(l)) * LN2_T

    @kernel(min_blocks=MIN_BLOCKS, threads=NTHREADS)
    def flash_forward_tc(q, k, v, out, lse, group, off, scale, softcap, left, right,
                         attn_mask, attn_bias, alibi, block_mask, bm_q, bm_k,
                         drop_threshold, drop_scale, seed_lo, seed_hi, cu_seqlens_q, cu_seqlens_k, maps):
        if VARLEN:                                        # this block's sequence: its rows from q_start, k_start
            qt, h, b = packed_tile_head_batch(cu_seqlens_q, q.shape[2])
            q_start, seqlen_q = sequence_span(cu_seqlens_q, b)
            if qt * BLOCK_Q >= seqlen_q:
                return                                    # a query tile past its sequence: nothing to do
            k_start, seqlen_k = sequence_span(cu_seqlens_k, b)
            off = seqlen_k - seqlen_q                     # bottom-right alignment per sequence
        else:
            qt, h, b = tile_order((q.shape[1] + BLOCK_Q - 1) // BLOCK_Q, q.shape[2])
            q_start, seqlen_q = 0, q.shape[1]
            k_start, seqlen_k = 0, k.shape[1]
        q0 = qt * BLOCK_Q
        hk = h // group
        tid = cuda.threadIdx.x
        warp, lane, g, t = lane_coords()
        row0 = q0 + 16 * MT * warp + g       # query row of (m-tile m, half r): row0 + 16 m + 8 r
        q_last = min(q0 + BLOCK_Q, seqlen_q) - 1
        scale_log2 = F32(scale) * LOG2E_T

        smem = cuda.shared.array(0, U32_DT, alignment=TILE_ALIGN)   # [buffer][K_j | V_j][key][word], then Q
        scratch = cuda.shared.array(0, F32_DT)[SMEM_WORDS:SMEM_WORDS + SCRATCH]
        # ldmatrix row addresses of this lane (lane l names row l % 8 of matrix l // 8):
        # K: matrices (keys +0 | +8) x (words +0 | +4) -> b0, b1 of n-tiles n, n + 1
        # V: matrices (dims  +0 | +4 words) x (keys +0 | +8), transposed -> b0, b1 of n-tiles n, n + 1
        mi = lane // 8
        k_lane = (8 * (mi // 2) + lane % 8) * STRIDE + 4 * (mi % 2)
        v_lane = V_OFF + (8 * (mi % 2) + lane % 8) * STRIDE + 4 * (mi // 2)
        v_word = 2 * t * STRIDE + g                                 # tf32: this lane's V word of a k-step

        q_reg = cuda.local.array((MT if not Q_SMEM else 1, KSTEPS_D, 4), np.uint32)   # Q's a fragments (registers)
        q_small = cuda.local.array((MT if SPLIT and not Q_SMEM else 1, KSTEPS_D, 4), np.uint32)   # their small parts
        q_frag = cuda.local.array((MT, 4), np.uint32)           # Q's a fragments of one k-step
        q_frag_s = cuda.local.array((MT, 4), np.uint32)         # their small parts (SPLIT)
        p_small = cuda.local.array((MT, 4), np.uint32)          # P's small parts (SPLIT)
        part = cuda.local.array((MT, 2, 4), F32)                 # a k-step's P V products (SPLIT)
        s_reg = cuda.local.array((MT, NT_K, 4), F32)             # S, then P, of the key tile
        p_reg = cuda.local.array((MT, 4), np.uint32)             # P's a fragments of one k-step
        p_all = cuda.local.array(P_ALL, np.uint32)              # WGMMA: P's a fragments of every k-step
        p_all_s = cuda.local.array(P_ALL if WG_TF32 and SPLIT and not QS_REG else 1, np.uint32)   # their small parts
        wpart = cuda.local.array((1, PART_NT, 4), F32)           # WG_TF32 and SPLIT: P V_j's partial
        q_small_a = cuda.local.array(QS_WORDS, np.uint32)        # QS_REG: Q's small parts
        q_bytes = 4 * Q_OFF + (warp // 4) * 64 * SWIZZLE_BYTES   # WGMMA: this warpgroup's 64 rows of the Q tile
        acc = cuda.local.array((MT, NT_D, 4), F32)               # O_i, unnormalised
        m_i = cuda.local.array(ROWS, F32)  # row 2 m + r: running max (base-2 units)
        l_i = cuda.local.array(ROWS, F32)  # per-thread partial row sums, reduced over the quad at the end
        row = cuda.local.array(ROWS, F32)
        init_state(m_i, l_i, acc)                        # m_i = -inf, l_i = 0, acc = 0
        for m in range(MT if not Q_SMEM else 0):         # without Q_SMEM: Q's a fragments in registers, read once
            load_q_frags(q, b, h, row0 + 16 * m, seqlen_q, t, q_reg, q_small, m, q_start)
        # this lane's ldmatrix row of Q's a fragments (m-tile 0): matrices (rows +0 | +8) x (words +0 | +4)
        q_lane = Q_OFF + (16 * MT * warp + 8 * (mi % 2) + lane % 8) * STRIDE + 4 * (mi // 2)
        k_base = (b * k.strides[0] + k_start * k.strides[1] + hk * k.strides[2]) // 4   # bytes, 4 per word
        v_base = (b * v.strides[0] + k_start * v.strides[1] + hk * v.strides[2]) // 4
        k_row, v_row = k.strides[1] // 4, v.strides[1] // 4

        # the key tiles this query tile sees (a window's range, a block mask's skips); the first one's copy
        kt_lo, kt_hi = key_tile_range(q0, q_last, off, left, right, seqlen_k)
        kt_lo, kt_hi = key_bounds(kt_lo, kt_hi, b, h, q0, q_last, block_mask, bm_q, bm_k)
        kt = next_tile(kt_lo - 1, kt_hi, b, h, q0, q_last, seqlen_k, off, left, right, block_mask, bm_q, bm_k)
        q_base, q_row = (b * q.strides[0] + q_start * q.strides[1] + h * q.strides[2]) // 4, q.strides[1] // 4
        if TMA and VARLEN:     # the copy engine's rows: the packed tensor's (its batch stride 0: coordinate 0)
            cb, q_first, k_first, q_rows, k_rows = 0, q_start, k_start, q.shape[1], k.shape[1]
        else:
            cb, q_first, k_first, q_rows, k_rows = b, 0, 0, seqlen_q, seqlen_k
        if TMA:
            init_barriers(smem, tid)
            if kt < kt_hi and tid == 0:                      # Q and the first K/V tile, in flight
                load_q_tile(smem, maps, q, q_base - q_first * q_row, q_row, q_first + q0, q_rows, h, cb)
                load_kv_stage(smem, maps, k, v, k_base - k_first * k_row, v_base - k_first * v_row, k_row, v_row,
                              k_first + kt * BLOCK_K, k_rows, hk, cb, 0)
        elif kt < kt_hi:
            if Q_SMEM:                                       # the Q tile, committed with the K/V group below
                copy_q(q, q_base, q_row, q0, seqlen_q - q0, smem, Q_OFF)
            start_kv_copy(k, v, k_base, v_base, k_row, v_row, kt * BLOCK_K, seqlen_k, smem, 0)
        buf = 0                                              # the stage of tile j (TMA: j % STAGES)
        i = 0                                                # TMA: tile j's number, for its stage's phase
        first = True                                         # (SPLIT, Q_SMEM: Q's tile is split with the first K/V)
        while kt < kt_hi:
            k0 = kt * BLOCK_K
            kn = next_tile(kt, kt_hi, b, h, q0, q_last, seqlen_k, off, left, right, block_mask, bm_q, bm_k)
            _, need_mask = tile_state(b, h, q0, q_last, k0, seqlen_k, off, left, right, block_mask, bm_q, bm_k)
            if TMA:
                buf = i % STAGES
                if tid == 0 and kn < kt_hi:                  # K_{j+1}, V_{j+1} into the other stage, once every
                    nxt = (i + 1) % STAGES                   # reader of tile j - 1 has handed it back
                    if i + 1 >= STAGES:
                        mbar_wait(smem, EMPTY + 8 * nxt, ((i + 1) // STAGES - 1) % 2)
                    load_kv_stage(smem, maps, k, v, k_base - k_first * k_row, v_base - k_first * v_row, k_row,
                                  v_row, k_first + kn * BLOCK_K, k_rows, hk, cb, nxt)
                if SIMULATOR:
                    cuda.syncthreads()                       # (the simulator's copies are done at once)
                if i == 0:
                    mbar_wait(smem, Q_FULL, 0)
                mbar_wait(smem, FULL + 8 * buf, (i // STAGES) % 2)   # K_j, V_j have landed in stage buf
                prepare_stage(smem, i, buf, k0, seqlen_k, tid, warp, g, t, q_small_a)   # (tf32 Q; VARLEN: zeros)
            elif kn < kt_hi:                                 # K_{j+1}, V_{j+1} fly while tile j computes
                start_kv_copy(k, v, k_base, v_base, k_row, v_row, kn * BLOCK_K, seqlen_k, smem,
                              (1 - buf) * STAGE_WORDS)
                wait_prev()
            else:
                wait_all()
            if WGMMA and not TMA:
                fence_async()                                # ... made visible to the tensor cores
            if not TMA:
                cuda.syncthreads()                           # everyone's copies of K_j, V_j have landed
            base = buf * STAGE_WORDS
            if SPLIT and not WG_TF32:                                      # K_j, V_j (and Q once) -> big and small parts
                if Q_SMEM and first:
                    split_smem(smem, Q_OFF, SMALL_Q, Q_WORDS)
                split_smem(smem, base, SMALL, 2 * TILE)
                first = False
                cuda.syncthreads()

            if WG_TF32:                                                                    # S = Q K_j^T
                score_tile_wgmma_tf32(smem, base, q_bytes, s_reg, q_small_a)
            elif WGMMA:
                wgmma_qk(s_reg, smem, q_bytes, 4 * base, 0)
            else:
                score_tile(smem, base, q_reg, q_small, q_frag, q_frag_s, q_lane, k_lane, s_reg)
            mask_tile(s_reg, need_mask, row0, k0, t, b, h, seqlen_q, seqlen_k, off, left, right, scale,  # S <- mask(S)
                      scale_log2, softcap, attn_bias, alibi, attn_mask, block_mask, bm_q, bm_k)
            online_softmax(s_reg, m_i, l_i, acc, row, scratch, tid, t, scale_log2, row0, k0, b, h,   # m_i, l_i, P
                           drop_threshold, drop_scale, seed_lo, seed_hi)
            pv_step(smem, base, v_lane, v_word, s_reg, p_reg, p_small, p_all, p_all_s, part, wpart, acc)  # acc += P V_j
            buf, i = release_stage(smem, buf, i)             # done with stage buf: the next tile's
            kt = kn

        store_out_lse(out, lse, acc, m_i, l_i, scratch, tid, t, row0, b, h, seqlen_q, q_start)   # out = acc / l_i

    return flash_forward_tc, SHARED_BYTES, NTHREADS
