"""``create_block_mask``'s kernel: each (batch, head, query block, key block) of a ``mask_mod`` classified as
EMPTY (no pair kept: its tile is never loaded), PARTIAL (the mask runs element by element) or FULL.

One thread per block walks the block's pairs inside the sequences (``reference.flex.block_states`` is the
oracle).  ``MASK_MOD`` is the caller's function compiled as a device function; a block of 128 x 128 pairs
costs one thread 16k calls of it, once per mask (the attention kernels then read the states).
"""
from functools import lru_cache

import numpy as np
from numba import cuda

from ._jit import kernel, kernel_factory

EMPTY, PARTIAL, FULL = 0, 1, 2
THREADS = 128


@lru_cache(maxsize=None)
@kernel_factory
def make_block_states(MASK_MOD, BLOCK_Q, BLOCK_K):
    """``block_states(states, seqlen_q, seqlen_k)``: ``states`` int8 ``(B, H, ceil(seqlen_q / BLOCK_Q),
    ceil(seqlen_k / BLOCK_K))``, one thread a block, ``THREADS`` a thread block."""
    E, P, F = np.int8(EMPTY), np.int8(PARTIAL), np.int8(FULL)

    @kernel
    def block_states(states, seqlen_q, seqlen_k):
        t = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        n_b, n_h, n_qb, n_kb = states.shape
        if t >= n_b * n_h * n_qb * n_kb:
            return
        kb, qb, h, b = _unflatten(t, n_kb, n_qb, n_h)
        any_on = False
        all_on = True
        for i in range(qb * BLOCK_Q, min(qb * BLOCK_Q + BLOCK_Q, seqlen_q)):
            for j in range(kb * BLOCK_K, min(kb * BLOCK_K + BLOCK_K, seqlen_k)):
                on = bool(MASK_MOD(b, h, i, j))
                any_on = any_on or on
                all_on = all_on and on
        states[b, h, qb, kb] = F if all_on else (P if any_on else E)

    return block_states


@cuda.jit(device=True)
def _unflatten(t, n_kb, n_qb, n_h):
    """``(kb, qb, h, b)`` of a flat index over ``(B, H, n_qb, n_kb)``, the key block fastest."""
    kb = t % n_kb
    t //= n_kb
    qb = t % n_qb
    t //= n_qb
    return kb, qb, t % n_h, t // n_h


def grid(n_blocks):
    return -(-n_blocks // THREADS)
