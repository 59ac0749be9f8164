"""The pre-pass of the Hopper forward on float32 (tf32 wgmma): K's and V^T's operands, made once per call.

tf32 wgmma reads both operands K-major, so P V_j needs V_j^T (keys contiguous), and 3xTF32 needs every operand's
tf32 big and small parts.  Made in each query block, per key tile, that work cost as much as the tile's products
(bench/results/h100-tf32-wgmma-2026-11-26.md); made once here, the forward's (``forward_tc.make_forward_tc``,
``WGMMA=True``, ``DTYPE_NAME="float32"``) copy engine brings the tiles ready.  ``plan.forward`` plans it
(``ForwardPlan.prepare``); ``api`` allocates its outputs (``tf32_operand_shapes``) and launches it.
"""
from functools import lru_cache

import numpy as np
from numba import cuda

from ._jit import device_function, kernel, kernel_factory
from ._mma import tf32_primitives

PREP_KEYS = 32                    # keys (and head-dim words) of one pre-pass block
PREP_THREADS = 256


def tf32_head_words(headdim):
    """A float32 row's words in the Hopper forward's swizzled tiles: the head dim padded to whole 32-word (128-byte)
    blocks (the kernel's ``D_WORDS``, ``D_PAD``), V^T's rows."""
    return -(-headdim // 32) * 32


def tf32_key_words(seqlen_k):
    """V^T's row length: the keys padded to whole groups of 8 (P's permutation; rows of 16-byte multiples)."""
    return -(-seqlen_k // 8) * 8


def tf32_operand_shapes(batch, seqlen_k, nheads_k, headdim, split):
    """The pre-pass's outputs: ``kk`` (batch, seqlen_k, nheads_k, parts * D_WORDS), each key row K's tf32 big
    parts then (``split``) its small parts, the head dim padded to whole 32-word swizzle blocks; ``vt`` (batch,
    parts * D_WORDS, nheads_k, key words) in memory order (batch, nheads_k, rows, keys): V^T's big rows, then
    its small rows, the keys of each 8 relabelled (``make_prepare_tf32``)."""
    d_words, parts = tf32_head_words(headdim), 2 if split else 1
    return (batch, seqlen_k, nheads_k, parts * d_words), (batch, nheads_k, parts * d_words, tf32_key_words(seqlen_k))


def prepare_tf32_grid(batch, seqlen_k, nheads_k, headdim):
    return batch * nheads_k * -(-tf32_key_words(seqlen_k) // PREP_KEYS) * (tf32_head_words(headdim) // PREP_KEYS)


@lru_cache(maxsize=None)
@kernel_factory
def make_prepare_tf32(HEAD_DIM, SPLIT):
    """The pre-pass of the Hopper forward on float32 (``make_forward_tc(WGMMA=True)``, ``DTYPE_NAME="float32"``):
    ``prepare(k, v, kk, vt)`` from K, V's word views writes ``kk`` and ``vt`` (``tf32_operand_shapes``; ``vt``
    as its (batch, rows, nheads_k, keys) view): K's words rounded to tf32, or (``SPLIT``) split into big and
    small parts; V transposed, its key ``2t`` of each 8 at position ``t`` and ``2t + 1`` at ``t + 4`` (so that P's
    a fragments are S's accumulators as they are), rounded or split; zeros past the head dim and the keys.  One
    block per (32 keys, 32 words of the head dim, head, batch): K's and V's rows read along the head dim, V^T's
    written along the keys through a shared tile."""
    D_WORDS = tf32_head_words(HEAD_DIM)
    DBLK = D_WORDS // PREP_KEYS
    ROWS_PER_PASS = PREP_THREADS // PREP_KEYS
    TILE_SHAPE = (PREP_KEYS, PREP_KEYS + 1)           # (a padded row: the transposed reads hit 32 banks)
    W0 = np.uint32(0)
    tf32 = tf32_primitives()
    split_bits, round_bits = tf32["split_bits"], tf32["round_bits"]

    @device_function
    def key_at(p):
        """The key (of its group of 8) at V^T position ``p``."""
        t = p % 8
        return p - t + (2 * t if t < 4 else 2 * (t - 4) + 1)

    @kernel
    def prepare(k, v, kk, vt):
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        key_blocks = -(-vt.shape[3] // PREP_KEYS)
        blk = cuda.blockIdx.x
        cb = blk % DBLK                                   # (head-dim block, key block, head, batch), dims fastest
        blk //= DBLK
        kb = blk % key_blocks
        bh = blk // key_blocks
        h = bh % nheads_k
        b = bh // nheads_k
        tile = cuda.shared.array(TILE_SHAPE, np.uint32)   # [key][word]: V's block
        tx = cuda.threadIdx.x % PREP_KEYS
        c = cb * PREP_KEYS + tx
        for r in range(cuda.threadIdx.x // PREP_KEYS, PREP_KEYS, ROWS_PER_PASS):   # K's and V's rows
            key = kb * PREP_KEYS + r
            wv = W0
            if key < seqlen_k:
                wk = W0
                if c < HEAD_DIM:
                    wk, wv = k[b, key, h, c], v[b, key, h, c]
                if SPLIT:
                    kk[b, key, h, c], kk[b, key, h, D_WORDS + c] = split_bits(wk)
                else:
                    kk[b, key, h, c] = round_bits(wk)
            tile[r, tx] = wv
        cuda.syncthreads()
        p = kb * PREP_KEYS + tx                           # V^T's position p of rows c (each pass one word c)
        for r in range(cuda.threadIdx.x // PREP_KEYS, PREP_KEYS, ROWS_PER_PASS):
            row = cb * PREP_KEYS + r
            if p < vt.shape[3]:
                w = tile[key_at(tx), r]
                if SPLIT:
                    vt[b, row, h, p], vt[b, D_WORDS + row, h, p] = split_bits(w)
                else:
                    vt[b, row, h, p] = round_bits(w)

    return prepare
