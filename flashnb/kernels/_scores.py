"""Element-wise score rules shared by every kernel: score modifiers, masks, dropout.

These implement docs/semantics.md for one element ``(b, h, i, j)`` (``h`` the
query head, ``i`` the query row, ``j`` the key row) and are inlined into the
kernels' register micro-tile loops.  Each factory takes the compile-time
feature flags, so a kernel built without a feature contains no code for it.

Order of operations (semantics.md): scale, softcap, bias and ALiBi, masks,
softmax, dropout.
"""
import math
from typing import NamedTuple

import numpy as np

from ._jit import device_function

# Philox-4x32-10 (Salmon et al., SC'11, Random123): round multipliers and Weyl key increments.
PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint64(0x9E3779B9)
PHILOX_W1 = np.uint64(0xBB67AE85)
LOW32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)
PHILOX_ROUNDS = 10


class Mods(NamedTuple):
    """A ``flex_attention`` call's functions (``flashnb.flex``), as device functions: ``score_mod(score, b, h,
    q_idx, kv_idx)``, ``mask_mod(b, h, q_idx, kv_idx)`` and ``score_grad(score, b, h, q_idx, kv_idx)``, the
    score_mod's derivative in the score (the caller's ``score_mod_grad``, or the complex step); None: absent.
    Part of a kernel's specialisation (functions hash by identity)."""
    score_mod: object = None
    mask_mod: object = None
    score_grad: object = None
    block: tuple = None           # the block mask's (BLOCK_Q, BLOCK_K) with a mask_mod: compile-time divisors
    index32: bool = False         # the score_mod's indices as int32, clamped in int32 (the tensor-core forward and
    #                               the element gradient; ``plan.FLEX_MOD_INT32``)
    mask_written: int = 3         # a mask_mod's bits written out (``forward_tc.mask_bit``): 1 the forward, 2 the
    #                               tensor-core dK/dV kernel; else a loop (``plan.FLEX_MASK_WRITTEN``)
    mask_index32: bool = False    # the mask_mod's indices as int32 there (``plan.FLEX_MASK_INT32``)
    capture_grad: object = None   # ``capture_grad(ds, score, b, h, q_idx, kv_idx)``: adds an element's part of the
    #                               gradients into captured arrays (``_mod_grad``; the dK/dV kernels call it)
    mask_narrow: bool = False     # with ``mask_index32``, the written-out bits' bounds in int32 too, and the
    #                               mask_mod compiled with int32 comparisons (``plan.FLEX_MASK_NARROW``)


def mask_block(MODS):
    """A kernel's ``MASK_BLOCK``: the mask_mod's block size (its states' divisor, a compile-time constant), or
    None without a mask_mod."""
    if MODS is None or MODS.mask_mod is None:
        return None
    assert MODS.block is not None, "a mask_mod comes with its block size"
    return tuple(int(x) for x in MODS.block)


def make_score_fn(ACC, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, SCORE_MOD=None):
    """``score(qk, i, j, b, h, off, scale, softcap, bias, alibi)``: the score before masking, natural units.

    ``qk = dot(q_i, k_j)``; returns ``softcap * tanh(scale * qk / softcap) + bias - slope * |i + off - j|``
    with each term present only when its flag is set; with ``SCORE_MOD`` (a device function; never combined
    with the options), ``SCORE_MOD(scale * qk, b, h, i, j)``: the caller passes indices inside the sequences.
    """
    HAS_SCORE_MOD = SCORE_MOD is not None

    @device_function
    def score(qk, i, j, b, h, off, scale, softcap, bias, alibi):
        x = qk * scale
        if HAS_SCORE_MOD:
            return ACC(SCORE_MOD(x, b, h, i, j))
        if HAS_SOFTCAP:
            x = softcap * math.tanh(x / softcap)
        if HAS_BIAS:
            # size-1 dimensions broadcast: min(index, size - 1) is 0 there
            x += ACC(bias[min(b, bias.shape[0] - 1), min(h, bias.shape[1] - 1),
                          min(i, bias.shape[2] - 1), min(j, bias.shape[3] - 1)])
        if HAS_ALIBI:
            # |i + off - j| = |(seqlen_k - j) - (seqlen_q - i)| < 2^31 inside the sequences (outside, masked): to
            # float through int32, on the integer pipe (I2FP), not int64's conversion on exp2's 16-lane unit
            x -= ACC(alibi[min(b, alibi.shape[0] - 1), h]) * ACC(np.int32(abs(i + off - j)))
        return x

    return score


@device_function
def and_inside_window(ok, i, j, off, left, right):
    """``ok`` and whether key ``j`` is inside query ``i``'s window ``i + off - left <= j <= i + off + right``
    (bottom-right aligned; a side of ``-1`` is unbounded; causal is ``right = 0``)."""
    rel = j - (i + off)
    if left >= 0:
        ok = ok and rel >= -left
    if right >= 0:
        ok = ok and rel <= right
    return ok


def make_allowed_fn(HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MASK_MOD=None, MASK_BLOCK=None):
    """``allowed(i, j, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask, bm_q, bm_k)``.

    True iff query ``i`` may attend key ``j``: both in range, inside the
    (bottom-right aligned) window ``i + off - left <= j <= i + off + right``
    (``-1`` unbounded; causal is ``right = 0``), allowed by ``attn_mask`` and by
    the block mask at block ``(i // bm_q, j // bm_k)``, and by ``MASK_MOD(b, h, i, j)`` (a device function,
    called only for a pair inside the sequences).
    """
    HAS_MASK_MOD = MASK_MOD is not None
    CONST_BLOCK = MASK_BLOCK is not None           # the block mask's divisors as constants (shifts, not divisions)
    BMQ, BMK = MASK_BLOCK if CONST_BLOCK else (1, 1)

    @device_function
    def allowed(i, j, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask, bm_q, bm_k):
        ok = i < seqlen_q and j < seqlen_k
        if HAS_MASK_MOD:
            if ok:
                ok = bool(MASK_MOD(b, h, i, j))
        if HAS_WINDOW:
            ok = and_inside_window(ok, i, j, off, left, right)
        if HAS_ATTN_MASK:
            ok = ok and attn_mask[min(b, attn_mask.shape[0] - 1), min(h, attn_mask.shape[1] - 1),
                                  min(i, attn_mask.shape[2] - 1), min(j, attn_mask.shape[3] - 1)] != 0
        if HAS_BLOCK_MASK:
            ok = ok and block_mask[min(b, block_mask.shape[0] - 1), min(h, block_mask.shape[1] - 1),
                                   min(i // (BMQ if CONST_BLOCK else bm_q), block_mask.shape[2] - 1),
                                   min(j // (BMK if CONST_BLOCK else bm_k), block_mask.shape[3] - 1)] != 0
        return ok

    return allowed


def make_tile_mask_fn(HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK, MODS, BLOCK_Q, BLOCK_K):
    """``(tile_mask, written)`` for the tensor-core kernels' mask_mod bits of a partial tile:
    ``tile_mask(i, j, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask, bm_q, bm_k)`` is
    ``MODS.mask_mod`` at indices clamped into the sequences (int32 with ``MODS.mask_index32``; no branch, so that
    an element's reads are its row's and its column's, shared with the thread's other elements), then the bounds
    and the other masks.  Inside one mask block (the block size a multiple of the tiles) a tile reaches the element
    mask only when its one block is partial, and the mask_mod alone decides: no block-state read an element.
    ``written``: whether the kernel writes the bits out (``MODS.mask_written`` has its bit and the tiles sit inside
    one block; smaller blocks keep the loop: their block reads written out spilled, 704 bytes with 16 x 16)."""
    block = mask_block(MODS)
    one_block = block is not None and block[0] % BLOCK_Q == 0 and block[1] % BLOCK_K == 0
    other_masks = make_allowed_fn(HAS_WINDOW, HAS_ATTN_MASK, HAS_BLOCK_MASK and not one_block, None, block)
    mask_mod = None if block is None else MODS.mask_mod
    INDEX32 = bool(block is not None and MODS.mask_index32)
    # with int32 indices, ``mask_narrow`` and no other mask (a flex call inside one mask block), the bounds in int32
    # too: the sequences' ends are the only other test, and a 64-bit compare costs ptxas three instructions
    BOUNDS32 = (INDEX32 and MODS.mask_narrow
                and not (HAS_WINDOW or HAS_ATTN_MASK or (HAS_BLOCK_MASK and not one_block)))

    @device_function
    def tile_mask(i, j, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask, bm_q, bm_k):
        if INDEX32:
            i32, j32 = np.int32(i), np.int32(j)
            ok = bool(mask_mod(np.int32(b), np.int32(h), min(i32, np.int32(seqlen_q - 1)),
                               min(j32, np.int32(seqlen_k - 1))))
            if BOUNDS32:
                return ok & (i32 < np.int32(seqlen_q)) & (j32 < np.int32(seqlen_k))
        else:
            ok = bool(mask_mod(b, h, min(i, seqlen_q - 1), min(j, seqlen_k - 1)))
        return ok & other_masks(i, j, b, h, seqlen_q, seqlen_k, off, left, right, attn_mask, block_mask, bm_q, bm_k)

    return tile_mask, one_block


@device_function
def philox_keep(seed_lo, seed_hi, b, h, i, j, threshold):
    """Dropout keep bit of element (b, h, i, j): first word of Philox-4x32-10((j, i, h, b), seed) >= threshold.

    uint32 products are formed in uint64 (hi = product >> 32, lo = product & 0xFFFFFFFF).
    """
    c0 = np.uint64(j)
    c1 = np.uint64(i)
    c2 = np.uint64(h)
    c3 = np.uint64(b)
    k0 = np.uint64(seed_lo)
    k1 = np.uint64(seed_hi)
    for rnd in range(PHILOX_ROUNDS):
        if rnd > 0:  # the key is bumped between rounds, not before the first
            k0 = (k0 + PHILOX_W0) & LOW32
            k1 = (k1 + PHILOX_W1) & LOW32
        p0 = PHILOX_M0 * c0
        p1 = PHILOX_M1 * c2
        c0, c1, c2, c3 = ((p1 >> SHIFT32) ^ c1 ^ k0, p1 & LOW32, (p0 >> SHIFT32) ^ c3 ^ k1, p0 & LOW32)
    return c0 >= np.uint64(threshold)
