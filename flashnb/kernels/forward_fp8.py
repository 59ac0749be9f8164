"""The FP8 forward on Hopper: e4m3 Q, K, V with descaling factors, the output in float16 or bfloat16 (issue 45).

FlashAttention-3's FP8 forward, as ``reference.fp8.fp8_flash_forward`` defines it:

    S = Q K_j^T                              (e4m3 wgmma, float32 accumulators; the codes, undescaled)
    m_new = max(m, rowmax S * c)             c = softmax_scale * q_descale * k_descale * log2(e)
    P = exp2(S c - m_new)                    (<= 1)
    l = l exp2(m - m_new) + rowsum P         (the unquantised P)
    acc = acc exp2(m - m_new) + e4m3(P) V_j  (e4m3 wgmma, A = P from registers)

then ``out = acc v_descale / l`` and ``lse = (m + log2 l) ln 2``.  P is quantised with descaling factor 1: its
entries are at most 1, far inside e4m3's range.

e4m3 wgmma reads both operands K-major: V_j must arrive as V_j^T, keys contiguous.  ``make_prepare_vt`` writes
V^T once per call, its keys of each 32 relabelled so that P's A fragments are S's accumulators as they are: a
thread's accumulators of a k-step (32 keys) are columns ``8 n + 2 t, 8 n + 2 t + 1`` of n-tiles ``n = 0 .. 3``,
its A bytes are columns ``4 t .. 4 t + 3`` and ``16 + 4 t .. 16 + 4 t + 3``; position ``c`` of V^T holds key
``key_at(c)`` and byte ``i`` of A's word is position ``4 t + i`` (``+ 16``).

One block: 128 queries (two warpgroups of 64 rows), key tiles of 128 keys through two stages of the tensor-copy
engine (K_j and V_j^T; Q once), one block barrier a tile (thread 0 refills the stage every thread has just
finished reading).  Dense batches; causal (bottom-right aligned) or not; grouped-query heads.  A byte row of a
head dim of 64, 128 or 256 is a 16-bit row of half as many values, so the copies, tensor maps and swizzled tiles
are the 16-bit kernels' (``_tma``, ``_wgmma``) at half the width.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda

from ._jit import SIMULATOR, device_function, kernel, kernel_factory
from ._mma import memory_primitives, primitives
from ._sync import empty_parity_d, full_parity_d, register_handover, warp_sync
from ._tiles import make_row_allreduce
from ._tma import make_box_load, make_tile_load, tma_primitives
from ._wgmma import SMEM_ALIGN, SWIZZLE_BYTES, k_major_steps, make_wgmma, pack_e4m3x4
from .forward import LN2, LOG2E

BLOCK_Q = 128                     # two warpgroups of 64 query rows
BLOCK_K = 128                     # keys of a tile: one 128-byte row of V_j^T, 4 k-steps of 32
NTHREADS = 256
STAGES = 2                        # K_j / V_j^T stages of the copy engine
NTHREADS_WS = 384                 # warp-specialised: a producer warpgroup, then the two consumer warpgroups
# setmaxnreg moves registers within what the launch gave the block: launch bounds of one block of 384 threads
# cap a thread at 168 at entry (65536 / 384, rounded down to 8), and 128 x 24 + 256 x 240 = 384 x 168 exactly
# (an increase past the pool would wait for ever)
ENTRY_REGS = 65536 // NTHREADS_WS // 8 * 8
PRODUCER_REGS, CONSUMER_REGS = 24, 240
assert 128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= NTHREADS_WS * ENTRY_REGS
HEAD_DIMS = (64, 128, 256)
VT_KEYS = 32                      # V^T's keys are padded to (and relabelled within) groups of 32
PREP_THREADS = 256


def threads(WARP_SPECIALISED=False):
    """A block's threads of ``make_forward_fp8``'s kernel."""
    return NTHREADS_WS if WARP_SPECIALISED else NTHREADS


def key_at(c):
    """The key (of its group of 32) at V^T position ``c``: A's byte ``i`` of word ``4 t`` (columns ``16 h + 4 t
    + i``) is P's accumulator of n-tile ``2 h + i // 2``, column ``2 t + i % 2``."""
    h, r = c // 16, c % 16
    return 16 * h + 8 * ((r % 4) // 2) + 2 * (r // 4) + r % 2


key_at_d = device_function(key_at)


def vt_keys(seqlen_k):
    """V^T's row length: the keys padded to whole groups of 32."""
    return -(-seqlen_k // VT_KEYS) * VT_KEYS


def prepare_vt_grid(batch, seqlen_k, nheads_k, headdim):
    return batch * nheads_k * (vt_keys(seqlen_k) // VT_KEYS) * (headdim // VT_KEYS)


ROWS_PER_PASS = PREP_THREADS // VT_KEYS
TILE_SHAPE = (VT_KEYS, VT_KEYS + 4)                   # the pre-passes' shared tile: [key][dim]
B0 = np.uint8(0)


@device_function
def transpose_group(tile, v, vt, bv, h, cb, first, end, col0):
    """V^T's 32 columns ``col0 ..`` of dims ``32 cb ..`` (head ``h``, batch row ``bv``) from keys ``first ..
    first + 31`` of ``v``, each group's keys relabelled (``key_at``), zero from key ``end`` on; through ``tile``,
    one thread block."""
    tx = cuda.threadIdx.x % VT_KEYS
    for r in range(cuda.threadIdx.x // VT_KEYS, VT_KEYS, ROWS_PER_PASS):    # V's rows, along the dims
        key = first + r
        tile[r, tx] = v[bv, key, h, cb * VT_KEYS + tx] if key < end else B0
    cuda.syncthreads()
    for r in range(cuda.threadIdx.x // VT_KEYS, VT_KEYS, ROWS_PER_PASS):    # V^T's rows, along the keys
        vt[bv, cb * VT_KEYS + r, h, col0 + tx] = tile[key_at_d(tx), r]


@lru_cache(maxsize=None)
@kernel_factory
def make_prepare_vt(HEAD_DIM):
    """``prepare(v, vt)``: V^T of e4m3 ``v`` (batch, seqlen_k, nheads_k, HEAD_DIM bytes) into ``vt`` (its (batch,
    HEAD_DIM, nheads_k, ``vt_keys``) view, in memory (batch, nheads_k, HEAD_DIM, keys)): position ``p`` of row ``d``
    holds key ``32 (p // 32) + key_at(p % 32)``'s byte ``d``, zero past the keys.  One block per (32 keys, 32 dims,
    head, batch), through a shared tile."""
    DBLK = HEAD_DIM // VT_KEYS

    @kernel
    def prepare(v, vt):
        seqlen_k, nheads_k = v.shape[1], v.shape[2]
        key_blocks = vt.shape[3] // VT_KEYS
        blk = cuda.blockIdx.x
        cb = blk % DBLK                                   # (dim block, key block, head, batch), dims fastest
        blk //= DBLK
        kb = blk % key_blocks
        bh = blk // key_blocks
        tile = cuda.shared.array(TILE_SHAPE, np.uint8)
        transpose_group(tile, v, vt, bh // nheads_k, bh % nheads_k, cb, kb * VT_KEYS, seqlen_k, kb * VT_KEYS)

    return prepare


VT_TILE_KEYS = 128                # the word pre-pass's keys a block (four groups of 32)
U0 = np.uint32(0)
U8_MASK = np.uint32(0xFF)
U32, U64 = np.uint32, np.uint64


def prepare_vt_words_grid(batch, seqlen_k, nheads_k):
    return batch * nheads_k * -(-vt_keys(seqlen_k) // VT_TILE_KEYS)


@device_function
def vt_tile_key(c):
    """The key (of a block's 128) at the block's V^T position ``c``: ``key_at`` within its group of 32."""
    return 32 * (c >> 5) + key_at_d(c & 31)


def flat_words(shape, strides):
    """The span in words of a word array of ``shape`` and byte ``strides`` (non-negative), and its strides in words:
    ``make_prepare_vt_words``' flat views."""
    return 1 + sum((n - 1) * (st // 4) for n, st in zip(shape, strides)), tuple(st // 4 for st in strides)


@lru_cache(maxsize=None)
def make_words_tile(HEAD_DIM):
    """``move(tile, v, vt, src, valid, dst, cols, v_k, vt_d)``: V^T's 128 positions (one block's) of every dim,
    through ``tile`` (rows of HEAD_DIM / 4 + 1 words), four bytes a load and a store: ``v``, ``vt`` flat word views
    (``flat_words``), ``src`` the word offset of the block's first key at word 0 of its head, ``valid`` its keys
    (the rows past them read as zeros), ``dst`` the offset of V^T's row 0 at the block's first word, ``cols`` V^T's
    words from there on (those past its row are not written), ``v_k`` and ``vt_d`` the strides in words of a key and
    of a V^T row.

    A thread keeps one column of the key rows it loads (``WORDS`` a row, ``PREP_THREADS / WORDS`` rows a pass) and
    one word of the V^T rows it stores (8 rows a pass; a warp writes 128 contiguous bytes of a row): the four keys
    behind its word (``key_at``), their shared offsets and the byte shift are fixed before the loops, which only add,
    and the offsets are unsigned (no negative-index fix-up)."""
    WORDS = HEAD_DIM // 4
    LOG2_WORDS = WORDS.bit_length() - 1
    PITCH = WORDS + 1
    ROW_WORDS = VT_TILE_KEYS // 4                         # V^T's words of one row of a block: 32
    KEYS_PER_PASS = PREP_THREADS // WORDS
    LOAD_PASSES = VT_TILE_KEYS // KEYS_PER_PASS
    DIMS_PER_PASS = PREP_THREADS // ROW_WORDS             # 8
    STORE_PASSES = HEAD_DIM // DIMS_PER_PASS
    assert WORDS == 1 << LOG2_WORDS and DIMS_PER_PASS % 4 == 0

    @device_function
    def move(tile, v, vt, src, valid, dst, cols, v_k, vt_d):
        tid = cuda.threadIdx.x
        c, r = tid & (WORDS - 1), tid >> LOG2_WORDS      # this thread's column and first row of the tile
        at = U32(r * PITCH + c)
        src += U64(r * v_k + c)
        for p in range(LOAD_PASSES):                      # V's rows, along the dims
            tile[at] = v[src] if r + p * KEYS_PER_PASS < valid else U0
            src += U64(KEYS_PER_PASS * v_k)
            at += U32(KEYS_PER_PASS * PITCH)
        cuda.syncthreads()
        kw, d0 = tid & (ROW_WORDS - 1), tid >> 5          # this thread's word of a row, its first row (dim)
        if kw < cols:
            shift = np.uint32(8 * (d0 & 3))               # dims d0 + 8 p share d0's byte in their word
            k0, k1, k2, k3 = (vt_tile_key(4 * kw), vt_tile_key(4 * kw + 1), vt_tile_key(4 * kw + 2),
                              vt_tile_key(4 * kw + 3))
            a0, a1, a2, a3 = (U32(k0 * PITCH + (d0 >> 2)), U32(k1 * PITCH + (d0 >> 2)), U32(k2 * PITCH + (d0 >> 2)),
                              U32(k3 * PITCH + (d0 >> 2)))
            dst += U64(d0 * vt_d + kw)
            for p in range(STORE_PASSES):                 # V^T's rows d0 + 8 p, along the keys
                o = U32(2 * p)                            # (d0 + 8 p) // 4 = d0 // 4 + 2 p
                vt[dst] = (((tile[a0 + o] >> shift) & U8_MASK) | (((tile[a1 + o] >> shift) & U8_MASK) << np.uint32(8))
                           | (((tile[a2 + o] >> shift) & U8_MASK) << np.uint32(16))
                           | (((tile[a3 + o] >> shift) & U8_MASK) << np.uint32(24)))
                dst += U64(DIMS_PER_PASS * vt_d)

    return move, VT_TILE_KEYS * PITCH


@lru_cache(maxsize=None)
@kernel_factory
def make_prepare_vt_words(HEAD_DIM):
    """``prepare(v, vt, seqlen_k, nheads_k, tiles, v_b, v_k, v_h, vt_b, vt_d, vt_h, vt_words)``: ``make_prepare_vt``'s
    V^T four bytes a load and a store (``make_words_tile``), for a ``v`` with a word view.  ``v`` and ``vt`` are flat
    word views (``flat_words``) of v's codes (batch, seqlen_k, nheads_k, HEAD_DIM / 4 words) and of V^T's word view
    (batch, HEAD_DIM, nheads_k, ``vt_words`` = ``vt_keys`` / 4), with the strides in words of v's (batch, key, head)
    and V^T's (batch, dim, head) axes.  One block per (128 keys, head, batch), ``tiles`` key tiles a head, zero past
    the keys.

    The first word pre-pass indexed the four-dimensional arrays in each iteration (signed 64-bit, with the
    negative-index fix-ups): issue-bound, 251 us a 16k-token call at d 128 under ncu, this one 35 us (H200,
    bench/results/h200-fp8-2026-11-29b.md, call 1)."""
    move, TILE_WORDS = make_words_tile(HEAD_DIM)

    @kernel
    def prepare(v, vt, seqlen_k, nheads_k, tiles, v_b, v_k, v_h, vt_b, vt_d, vt_h, vt_words):
        kt, bh = cuda.blockIdx.x % tiles, cuda.blockIdx.x // tiles
        b, h = bh // nheads_k, bh % nheads_k
        first = kt * VT_TILE_KEYS
        col0 = first // 4
        tile = cuda.shared.array(TILE_WORDS, np.uint32)
        move(tile, v, vt, U64(b * v_b + h * v_h + first * v_k), seqlen_k - first,
             U64(b * vt_b + h * vt_h + col0), vt_words - col0, v_k, vt_d)

    return prepare


@lru_cache(maxsize=None)
@kernel_factory
def make_prepare_vt_packed_words(HEAD_DIM):
    """``prepare(v, vt, cu_seqlens_k, vt_start, group_seq, tiles, v_k, v_h, vt_d, vt_h)``: ``make_prepare_vt_packed``'s
    V^T four bytes a load and a store (``make_words_tile``): ``v`` and ``vt`` flat word views of v's codes (1,
    total_k, nheads_k, HEAD_DIM / 4 words) and of V^T's word view (1, HEAD_DIM, nheads_k, ``vt_start[-1]`` / 4), with
    the strides in words of v's (key, head) and V^T's (dim, head) axes.  One block per (128 columns, head), ``tiles``
    column tiles a head: a sequence's columns are whole tiles, so tile ``t``'s sequence is ``group_seq[4 t]``."""
    assert VT_TILE_KEYS == BLOCK_K == 4 * VT_KEYS         # (``vt_tile_keys``' padding)
    move, TILE_WORDS = make_words_tile(HEAD_DIM)

    @kernel
    def prepare(v, vt, cu_seqlens_k, vt_start, group_seq, tiles, v_k, v_h, vt_d, vt_h):
        t, h = cuda.blockIdx.x % tiles, cuda.blockIdx.x // tiles
        b = group_seq[4 * t]
        first = cu_seqlens_k[b] + t * VT_TILE_KEYS - vt_start[b]          # the tile's first key (packed row)
        tile = cuda.shared.array(TILE_WORDS, np.uint32)
        move(tile, v, vt, U64(h * v_h + first * v_k), cu_seqlens_k[b + 1] - first,
             U64(h * vt_h + t * (VT_TILE_KEYS // 4)), VT_TILE_KEYS // 4, v_k, vt_d)

    return prepare


def vt_tile_keys(seqlen_k):
    """A packed batch's V^T: each sequence's keys padded to whole key tiles, so that a tile never reads the next
    sequence's values (its columns past the keys are zeros)."""
    return -(-seqlen_k // BLOCK_K) * BLOCK_K


@lru_cache(maxsize=None)
@kernel_factory
def make_prepare_vt_packed(HEAD_DIM):
    """``prepare(v, vt, cu_seqlens_k, vt_start, group_seq)``: ``make_prepare_vt``'s V^T of a packed batch: ``v``
    (1, total_k, nheads_k, HEAD_DIM bytes), ``vt`` (1, HEAD_DIM, nheads_k, ``vt_start[-1]``) view; sequence ``b``'s
    keys from column ``vt_start[b]`` (``vt_tile_keys`` of them), their groups of 32 relabelled as a dense batch's,
    zero past the keys.  One block per (32 columns, 32 dims, head); ``group_seq[g]``: the sequence of column group
    ``g``."""
    DBLK = HEAD_DIM // VT_KEYS

    @kernel
    def prepare(v, vt, cu_seqlens_k, vt_start, group_seq):
        blk = cuda.blockIdx.x
        cb = blk % DBLK                                   # (dim block, column group, head), dims fastest
        blk //= DBLK
        g = blk % group_seq.shape[0]
        h = blk // group_seq.shape[0]
        if h >= v.shape[2]:
            return
        b = group_seq[g]
        tile = cuda.shared.array(TILE_SHAPE, np.uint8)
        transpose_group(tile, v, vt, 0, h, cb, cu_seqlens_k[b] + g * VT_KEYS - vt_start[b],   # its first key
                        cu_seqlens_k[b + 1], g * VT_KEYS)

    return prepare


@lru_cache(maxsize=None)
@kernel_factory
def make_forward_fp8(HEAD_DIM, OUT_DTYPE, CAUSAL, MIN_BLOCKS=1, VARLEN=False, BLOCKS=False, WARP_SPECIALISED=False):
    """``forward(q, k, vt, out, lse, q_descale, k_descale, v_descale, group, off, scale, maps, cu_seqlens_q,
    cu_seqlens_k, vt_start)`` and its shared bytes: ``q``, ``k``
    (batch, seq, heads, HEAD_DIM / 4) word views of e4m3 codes, ``vt`` ``make_prepare_vt``'s (batch, HEAD_DIM,
    nheads_k, keys / 4) word view, ``out`` (batch, seqlen_q, nheads, HEAD_DIM / 2) words of ``OUT_DTYPE``
    (float16 or bfloat16) pairs, ``lse`` (batch, nheads, seqlen_q) float32, the descales (batch, nheads_k)
    float32 views (stride 0 for one value), ``group`` query heads per key head, ``off = seqlen_k - seqlen_q``,
    ``maps`` the tensor maps of q, k, vt (boxes of 128, 128, HEAD_DIM rows).  Grid: query tiles x heads x batch.

    ``VARLEN``: a packed batch (flash-attn's varlen layout): q, k, out, lse of one batch row holding every
    sequence's rows (lse (1, nheads, total_q)), ``vt`` ``make_prepare_vt_packed``'s (sequence ``b``'s keys from
    column ``vt_start[b]``), the descales per (sequence, key head); a block of the grid (the longest sequence's
    query tiles x heads x sequences) takes its sequence's rows, ``off`` its own ``n_k - n_q``, and returns where its
    tile is past the sequence; the copy engine's boxes are rows of the packed tensors (rows past the sequence belong
    to the next one: its keys are masked, its queries' rows never stored).  Dense calls pass one-entry
    ``cu_seqlens_*`` and ``vt_start``, unread.

    ``BLOCKS``: block quantisation (dense batches): the descales per tile, ``q_descale`` (batch, nheads, query
    tiles) (a query head's own), ``k_descale`` and ``v_descale`` (batch, nheads_k, key tiles), the host's
    expansion of the caller's blocks (multiples of the tiles).  Key tile ``j``'s scores take ``q_descale *
    k_descale[j]`` in their exponent scale; the accumulator is kept in units of the last tile's V descale and
    rescaled when the next tile's differs (``v_rescale``), so ``P V_j`` adds V_j's codes as they are.

    ``WARP_SPECIALISED``: FlashAttention-3's roles, ``NTHREADS_WS`` threads.  Warpgroup 0 is the producer: it
    gives up its registers (``setmaxnreg.dec``) and its thread 0 issues every copy, refilling a stage as soon as
    both consumers have handed it back on the stage's ``empty`` barrier.  Warpgroups 1 and 2 are the consumers
    (64 query rows each, up to ``CONSUMER_REGS`` registers by ``setmaxnreg.inc``): each runs its own chain (wait for
    the stage's ``full`` phase, S, softmax, P V, hand the stage back, one arrival a warp) with no block barrier in
    the loop, so one warpgroup's products overlap the other's softmax as the scheduler finds them.  The launch
    bounds (one block of ``NTHREADS_WS``) give the register cap at entry that ``setmaxnreg`` needs.  In the
    simulator, barriers that wait (``tma_primitives(waiting=True)``) and reductions and fragment exchanges over
    quads order the roles; a protocol error raises there instead of hanging.

    ``MIN_BLOCKS``: launch bounds for that many blocks an SM (2 at head dim 64: 16 warps an SM instead of 8).
    Measured no faster on an H200 and removed (docs/notes/fp8.md step 4; the code is in commit 8bbdd68): three
    stages, FA3's order of the products, the warpgroups' turns by named barriers, S_{j+1} in flight under the
    softmax of S_j.  On the warp-specialised kernel (step 6; the code is in commit c32a386): FlashAttention-3's
    pingpong (the consumers' products in turns by named barriers) and its intra-warpgroup overlap (the softmax of
    S_j under P_{j-1} V_{j-1}), each correct and sanitizer-clean on an H200, neither faster."""
    assert HEAD_DIM in HEAD_DIMS
    assert not (BLOCKS and VARLEN), "block descales are for dense batches"
    assert not (WARP_SPECIALISED and MIN_BLOCKS != 1), "the warp-specialised block takes the SM's registers"
    WS = WARP_SPECIALISED
    THREADS = threads(WS)
    CONSUMER_WARPS = 8                               # the two consumer warpgroups: one arrival a warp on ``empty``
    F32 = np.float32
    U32_DT, F32_DT = np.dtype(np.uint32), np.dtype(np.float32)
    ZERO, NEG_INF, LOG2E_T, LN2_T = F32(0), F32(-np.inf), F32(LOG2E), F32(LN2)
    NBLK = -(-HEAD_DIM // SWIZZLE_BYTES)             # 128-byte blocks of a row
    HEAD_WORDS = HEAD_DIM // 4
    KSTEPS_D = HEAD_DIM // 32                        # S's k-steps
    N_ACC_S = BLOCK_K // 2                           # a thread's accumulators of S: 16 n-tiles x 4
    N_ACC_O = HEAD_DIM // 2
    P_WORDS = 4 * (BLOCK_K // 32)                    # P's A fragments: 4 words a k-step
    Q_BYTES = BLOCK_Q * SWIZZLE_BYTES * NBLK
    K_BYTES = BLOCK_K * SWIZZLE_BYTES * NBLK
    VT_BYTES = HEAD_DIM * SWIZZLE_BYTES              # HEAD_DIM rows of 128 keys
    STAGE_BYTES = K_BYTES + VT_BYTES
    Q_OFF = 0
    STAGE0 = Q_BYTES
    FULL = STAGE0 + STAGES * STAGE_BYTES             # full[s], then Q's barrier, then empty[s]: 8 bytes each
    Q_FULL = FULL + 8 * STAGES
    EMPTY = Q_FULL + 8                               # (WARP_SPECIALISED) the consumers hand stage s back
    SCRATCH = EMPTY + (8 * STAGES if WS else 0)      # the quad reductions' scratch (simulator only)
    SCRATCH_WORDS = 2 * THREADS if SIMULATOR else 0
    SHARED_BYTES = SCRATCH + 4 * SCRATCH_WORDS
    wgmma_s = make_wgmma("ss", "e4m3", BLOCK_K, k_major_steps(BLOCK_Q, KSTEPS_D), k_major_steps(BLOCK_K, KSTEPS_D))
    wgmma_pv = make_wgmma("rs", "e4m3", HEAD_DIM, (), k_major_steps(HEAD_DIM, BLOCK_K // 32), quad_sync=WS)
    pack4 = pack_e4m3x4()
    _, pack2, _ = primitives(OUT_DTYPE)
    exp2 = memory_primitives()["exp2_ftz"]
    tma = tma_primitives(waiting=WS)
    mbar_init, mbar_fence_init, mbar_expect, mbar_wait, mbar_arrive = (
        tma["mbar_init"], tma["mbar_fence_init"], tma["mbar_arrive_expect_tx"], tma["mbar_wait"], tma["mbar_arrive"])
    load_q = make_tile_load(BLOCK_Q, HEAD_WORDS, NBLK, WAITING=WS)
    load_k = make_tile_load(BLOCK_K, HEAD_WORDS, NBLK, WAITING=WS)
    load_vt = make_box_load(HEAD_DIM, 1, WAITING=WS)
    quad_max = make_row_allreduce(2, 4, THREADS, F32, is_max=True, ROW_SYNC=WS)
    quad_sum = make_row_allreduce(2, 4, THREADS, F32, is_max=False, ROW_SYNC=WS)
    release_registers, take_registers = register_handover(PRODUCER_REGS, CONSUMER_REGS)

    @device_function
    def block_coords(n_qt, nheads):
        """(query tile, head, batch) of this block: tiles slowest, so every head's longest causal tiles (its last)
        come first."""
        per_tile = cuda.gridDim.x // n_qt                # heads x batch
        bh = cuda.blockIdx.x % per_tile
        rank = cuda.blockIdx.x // per_tile
        return (n_qt - 1 - rank if CAUSAL else rank), bh % nheads, bh // nheads

    @device_function
    def load_stage(smem, maps, k, vt, j, k_start, vt_col, hk, b, s):
        """K_j and V_j^T into stage ``s``, completing on full[s] (thread 0): K's rows from ``k_start`` (the
        sequence's first key row), V^T's columns from ``vt_col``."""
        bar = FULL + 8 * s
        mbar_expect(smem, bar, STAGE_BYTES)
        dst = STAGE0 + s * STAGE_BYTES
        k0 = j * BLOCK_K
        load_k(smem, dst, maps, 1, k, (b * k.strides[0] + hk * k.strides[2]) >> 2, k.strides[1] >> 2, k_start + k0,
               k.shape[1] - k_start - k0, hk, b, bar)
        load_vt(smem, dst + K_BYTES, maps, 2, vt, (b * vt.strides[0] + hk * vt.strides[2]) >> 2, vt.strides[1] >> 2,
                0, HEAD_DIM, (vt_col + k0) // 4, vt.shape[3], hk, b, bar)

    @device_function
    def mask_tile(s_acc, k0, seqlen_k, row_g, off):
        """Scores of keys past the sequence, or (``CAUSAL``) past row ``i``'s last key ``i + off``, <- -inf."""
        t = cuda.threadIdx.x % 4
        for n in range(BLOCK_K // 8):
            for e in range(4):
                j = k0 + 8 * n + 2 * t + e % 2
                i = row_g + 8 * (e // 2)
                if j >= seqlen_k or (CAUSAL and j > i + off):
                    s_acc[4 * n + e] = NEG_INF

    @device_function
    def softmax_step(s_acc, m_i, l_i, o_acc, c, row, scratch):
        """m_i, l_i, o_acc rescaled to the new row max (over the quad's lanes), S -> P = exp2(S c - m_new).  The
        max is taken of S and then scaled (c > 0), so each exponent is one fused multiply-add; o_acc is rescaled
        only where the max moved."""
        for r in range(2):
            x = NEG_INF
            for n in range(BLOCK_K // 8):
                x = max(x, max(s_acc[4 * n + 2 * r], s_acc[4 * n + 2 * r + 1]))
            row[r] = x * c
        quad_max(row, scratch, cuda.threadIdx.x // 4, cuda.threadIdx.x % 4)
        for r in range(2):
            m_new = max(m_i[r], row[r])
            m_use = m_new if m_new != NEG_INF else ZERO      # nothing seen yet: exp2(-inf) = 0, not NaN
            l_tile = ZERO
            for n in range(BLOCK_K // 8):
                for e in range(2 * r, 2 * r + 2):
                    p = exp2(s_acc[4 * n + e] * c - m_use)
                    l_tile += p
                    s_acc[4 * n + e] = p
            if m_new > m_i[r]:
                alpha = exp2(m_i[r] - m_use)
                l_i[r] *= alpha
                for n in range(HEAD_DIM // 8):
                    o_acc[4 * n + 2 * r] *= alpha
                    o_acc[4 * n + 2 * r + 1] *= alpha
            m_i[r] = m_new
            l_i[r] += l_tile

    @device_function
    def pack_p(s_acc, p_frag):
        """P's A fragments, 4 words a k-step of 32 keys: rows g, g + 8 x n-tiles (4 kk, 4 kk + 1), (4 kk + 2, + 3)."""
        for kk in range(BLOCK_K // 32):
            a = 16 * kk
            for r in range(2):
                p_frag[4 * kk + r] = pack4(s_acc[a + 2 * r], s_acc[a + 2 * r + 1], s_acc[a + 4 + 2 * r],
                                           s_acc[a + 5 + 2 * r])
                p_frag[4 * kk + 2 + r] = pack4(s_acc[a + 8 + 2 * r], s_acc[a + 9 + 2 * r], s_acc[a + 12 + 2 * r],
                                               s_acc[a + 13 + 2 * r])

    @device_function
    def store_out_lse(out, lse, o_acc, m_i, l_i, row_g, b, h, seqlen_q, q_start, v_descale, scratch):
        """out = acc v_descale / l (l summed over the quad), lse = (m + log2 l) ln 2, at rows ``q_start + i``; a
        row that saw no key: 0, -inf."""
        t = cuda.threadIdx.x % 4
        quad_sum(l_i, scratch, cuda.threadIdx.x // 4, t)
        for r in range(2):
            l = l_i[r]
            i = row_g + 8 * r
            if i < seqlen_q:
                f = ZERO if l == ZERO else v_descale / l
                for n in range(HEAD_DIM // 8):
                    out[b, q_start + i, h, 4 * n + t] = pack2(o_acc[4 * n + 2 * r] * f,
                                                              o_acc[4 * n + 2 * r + 1] * f)
                if t == 0:
                    lse[b, h, q_start + i] = NEG_INF if l == ZERO else (m_i[r] + math.log2(l)) * LN2_T

    @device_function
    def v_rescale(o_acc, vd, vd_j):
        """``BLOCKS``: the accumulator, in units of V descale ``vd``, into those of tile j's ``vd_j``."""
        if vd_j != vd:
            r = vd / vd_j
            for n in range(N_ACC_O):
                o_acc[n] *= r
        return vd_j

    @device_function
    def hand_back(smem, maps, k, vt, j, n_kt, k_start, vt_col, hk, b):
        """Every thread is done with tile j's stage: thread 0 refills it with tile ``j + STAGES``."""
        cuda.syncthreads()
        if cuda.threadIdx.x == 0 and j + STAGES < n_kt:
            load_stage(smem, maps, k, vt, j + STAGES, k_start, vt_col, hk, b, j % STAGES)

    @device_function
    def release_stage(smem, j):
        """``WARP_SPECIALISED``: this warp is done with tile j's stage; its lane 0 arrives on the stage's ``empty``
        barrier (``CONSUMER_WARPS`` arrivals complete its phase)."""
        warp_sync()
        if cuda.threadIdx.x % 32 == 0:
            mbar_arrive(smem, EMPTY + 8 * (j % STAGES))

    @device_function
    def produce(smem, maps, q, k, vt, n_kt, q_start, qt, k_start, vt_col, h, hk, bd):
        """``WARP_SPECIALISED``, the producer's thread 0: Q, then each key tile into its stage once both consumers
        have handed the stage back (the ``empty`` phase of its last use; the first ``STAGES`` tiles wait for none:
        parity 1 of a fresh barrier counts as complete)."""
        mbar_expect(smem, Q_FULL, Q_BYTES)
        load_q(smem, Q_OFF, maps, 0, q, (bd * q.strides[0] + h * q.strides[2]) >> 2, q.strides[1] >> 2,
               q_start + qt * BLOCK_Q, q.shape[1] - q_start - qt * BLOCK_Q, h, bd, Q_FULL)
        for j in range(n_kt):
            mbar_wait(smem, EMPTY + 8 * (j % STAGES), empty_parity_d(j, STAGES))
            load_stage(smem, maps, k, vt, j, k_start, vt_col, hk, bd, j % STAGES)

    @device_function
    def scores(s_acc, smem, wg, j, qt, seqlen_k, row_g, off):
        """S = Q K_j^T (tile j's stage), masked where the tile reaches past the keys or the diagonal."""
        mbar_wait(smem, FULL + 8 * (j % STAGES), full_parity_d(j, STAGES))
        wgmma_s(s_acc, smem, Q_OFF + 64 * wg * SWIZZLE_BYTES, STAGE0 + (j % STAGES) * STAGE_BYTES, 0)
        k0 = j * BLOCK_K
        if k0 + BLOCK_K > seqlen_k or (CAUSAL and k0 + BLOCK_K - 1 > qt * BLOCK_Q + 64 * wg + off):
            mask_tile(s_acc, k0, seqlen_k, row_g, off)

    @device_function
    def sequence(cu_seqlens_q, cu_seqlens_k, vt_start, b):
        """A packed batch's sequence ``b``: (first query row, queries, first key row, keys, V^T's first column)."""
        q_start, n_q = cu_seqlens_q[b], cu_seqlens_q[b + 1] - cu_seqlens_q[b]
        k_start, n_k = cu_seqlens_k[b], cu_seqlens_k[b + 1] - cu_seqlens_k[b]
        return q_start, n_q, k_start, n_k, vt_start[b]

    @kernel(min_blocks=MIN_BLOCKS, threads=THREADS)
    def forward(q, k, vt, out, lse, q_descale, k_descale, v_descale, group, off, scale, maps, cu_seqlens_q,
                cu_seqlens_k, vt_start):
        nheads = q.shape[2]
        if VARLEN:              # the grid: the longest sequence's tiles x heads x sequences; rows of batch row 0
            n_qt = cuda.gridDim.x // (nheads * (cu_seqlens_q.shape[0] - 1))
            qt, h, b = block_coords(n_qt, nheads)
            q_start, seqlen_q, k_start, seqlen_k, vt_col = sequence(cu_seqlens_q, cu_seqlens_k, vt_start, b)
            if qt * BLOCK_Q >= seqlen_q:
                return                                   # a tile past its sequence (every thread: no barrier yet)
            off = seqlen_k - seqlen_q                    # bottom-right alignment per sequence
            bd = 0                                       # the packed arrays' batch row
        else:
            seqlen_q, seqlen_k = q.shape[1], k.shape[1]
            n_qt = (seqlen_q + BLOCK_Q - 1) // BLOCK_Q
            qt, h, b = block_coords(n_qt, nheads)
            q_start, k_start, vt_col = 0, 0, 0
            bd = b
        hk = h // group
        tid = cuda.threadIdx.x
        wg = tid // 128 - 1 if WS else tid // 128       # the consumer warpgroup (-1: the producer)
        row_g = qt * BLOCK_Q + 64 * wg + 16 * ((tid // 32) % 4) + (tid % 32) // 4   # this thread's first row
        if BLOCKS:                          # the query tile's descale; each key tile's below
            c_q = F32(scale) * q_descale[b, h, qt] * LOG2E_T
            c = c_q
            vd = v_descale[b, hk, 0]
        else:
            c = F32(scale) * q_descale[b, hk] * k_descale[b, hk] * LOG2E_T
        k_end = min(seqlen_k, qt * BLOCK_Q + BLOCK_Q + off) if CAUSAL else seqlen_k   # keys past it: seen by none
        n_kt = (k_end + BLOCK_K - 1) // BLOCK_K if k_end > 0 else 0

        smem = cuda.shared.array(0, U32_DT, alignment=SMEM_ALIGN)
        scratch = cuda.shared.array(0, F32_DT)[SCRATCH // 4:SCRATCH // 4 + SCRATCH_WORDS]
        if tid == 0:
            for s in range(STAGES):
                mbar_init(smem, FULL + 8 * s, 1)
                if WS:
                    mbar_init(smem, EMPTY + 8 * s, CONSUMER_WARPS)
            mbar_init(smem, Q_FULL, 1)
            mbar_fence_init()
        cuda.syncthreads()
        if WS:                                           # the block's last barrier: the roles part here
            if wg < 0:
                release_registers()
                if tid == 0:
                    produce(smem, maps, q, k, vt, n_kt, q_start, qt, k_start, vt_col, h, hk, bd)
                return
            take_registers()
        else:
            if tid == 0:
                mbar_expect(smem, Q_FULL, Q_BYTES)
                load_q(smem, Q_OFF, maps, 0, q, (bd * q.strides[0] + h * q.strides[2]) >> 2, q.strides[1] >> 2,
                       q_start + qt * BLOCK_Q, q.shape[1] - q_start - qt * BLOCK_Q, h, bd, Q_FULL)
                for j in range(min(n_kt, STAGES)):
                    load_stage(smem, maps, k, vt, j, k_start, vt_col, hk, bd, j)
            cuda.syncthreads()                           # (the simulator's copies are made by thread 0, at once)

        s_acc = cuda.local.array(N_ACC_S, F32)
        o_acc = cuda.local.array(N_ACC_O, F32)
        p_frag = cuda.local.array(P_WORDS, U32_DT)
        m_i = cuda.local.array(2, F32)
        l_i = cuda.local.array(2, F32)
        row = cuda.local.array(2, F32)
        for r in range(2):
            m_i[r] = NEG_INF
            l_i[r] = ZERO
        for n in range(N_ACC_O):
            o_acc[n] = ZERO
        mbar_wait(smem, Q_FULL, 0)
        for j in range(n_kt):
            scores(s_acc, smem, wg, j, qt, seqlen_k, row_g, off)                     # S = Q K_j^T
            if BLOCKS:
                c = c_q * k_descale[b, hk, j]
            softmax_step(s_acc, m_i, l_i, o_acc, c, row, scratch)
            if BLOCKS:
                vd = v_rescale(o_acc, vd, v_descale[b, hk, j])
            pack_p(s_acc, p_frag)
            wgmma_pv(o_acc, p_frag, smem, STAGE0 + (j % STAGES) * STAGE_BYTES + K_BYTES, 1)       # acc += P V_j
            if WS:
                release_stage(smem, j)
            else:
                hand_back(smem, maps, k, vt, j, n_kt, k_start, vt_col, hk, bd)
        if BLOCKS:
            store_out_lse(out, lse, o_acc, m_i, l_i, row_g, bd, h, seqlen_q, q_start, vd, scratch)
        else:
            store_out_lse(out, lse, o_acc, m_i, l_i, row_g, bd, h, seqlen_q, q_start, v_descale[b, hk], scratch)

    return forward, SHARED_BYTES
