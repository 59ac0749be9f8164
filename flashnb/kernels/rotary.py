"""The rotary embedding as a pre-pass of ``flash_attn_with_kvcache`` (``reference.apply_rotary``;
flash-attn's ``rotary_cos``, ``rotary_sin``, ``rotary_interleaved``).

``make_rotary(DTYPE_NAME, INTERLEAVED, HAS_SEQLENS, AT_START)``: ``x`` ``(batch, seqlen, nheads, words)`` (32-bit
words: 16-bit pairs or float32) -> ``out`` of the same shape, one thread per output word, grid-stride.  Token
``s`` of sequence ``b`` takes row ``pos = start_b + s`` of the tables (``start_b = seqlens[b]``, or ``base_len``
without the array; ``AT_START``: ``pos = start_b`` for every token, flash-attn's queries when neither causal nor
windowed); the tables ``cos``, ``sin`` ``(seqlen_ro, rotary_dim / 2)`` are word views of q's format.  Dim ``d``
below ``rotary_dim`` is one of a pair ``(2i, 2i + 1)`` (``INTERLEAVED``) or ``(i, i + rotary_dim / 2)``, rotated
by angle ``i``: ``x_a cos - x_b sin``, ``x_a sin + x_b cos``; computed in float32, rounded to the input format
(to nearest).  A row whose position is outside the tables (a device ``seqlens`` the host did not check) is
written NaN, so the call's result shows it; nothing outside the arrays is read.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda

from ._jit import device_function, kernel, kernel_factory
from ._mma import primitives

F32 = np.float32
THREADS = 256


@lru_cache(maxsize=None)
@kernel_factory
def make_rotary(DTYPE_NAME, INTERLEAVED, HAS_SEQLENS, AT_START):
    SIXTEEN = DTYPE_NAME in ("float16", "bfloat16")
    EPW = 2 if SIXTEEN else 1                       # values per 32-bit word
    NAN = F32(math.nan)
    if SIXTEEN:
        _, pack2, unpack2 = primitives(DTYPE_NAME)

    @device_function
    def value(row, d):
        """Element ``d`` of a row of words, as float32."""
        if SIXTEEN:
            lo, hi = unpack2(row[d // 2])
            return hi if d % 2 else lo
        return F32(row[d])

    @device_function
    def rotated(row, cos_row, sin_row, d, half):
        """Dim ``d`` of the rotated row (``half`` = rotary_dim / 2; dims from ``2 half`` on are kept)."""
        if d >= 2 * half:
            return value(row, d)
        if INTERLEAVED:
            i = d // 2
            a, b = value(row, 2 * i), value(row, 2 * i + 1)
            first = d % 2 == 0
        else:
            i = d if d < half else d - half
            a, b = value(row, i), value(row, i + half)
            first = d < half
        c, s = value(cos_row, i), value(sin_row, i)
        return a * c - b * s if first else a * s + b * c

    @kernel
    def rotary(x, out, cos, sin, seqlens, base_len, half):
        batch, seqlen, nheads, hw = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
        total = batch * seqlen * nheads * hw
        for idx in range(cuda.grid(1), total, cuda.gridsize(1)):
            wd = idx % hw
            row = idx // hw
            h = row % nheads
            s = (row // nheads) % seqlen
            b = row // (nheads * seqlen)
            pos = seqlens[b] if HAS_SEQLENS else base_len
            if not AT_START:
                pos += s
            inside = 0 <= pos < cos.shape[0]
            p = pos if inside else 0
            v0 = rotated(x[b, s, h], cos[p], sin[p], wd * EPW, half)
            v1 = F32(0)
            if SIXTEEN:
                v1 = rotated(x[b, s, h], cos[p], sin[p], wd * EPW + 1, half)
            if not inside:
                v0 = v1 = NAN
            if SIXTEEN:
                out[b, s, h, wd] = pack2(v0, v1)
            else:
                out[b, s, h, wd] = v0

    return rotary


def grid(n_words):
    """Blocks of ``THREADS`` for ``n_words`` output words (grid-stride beyond 8192 blocks)."""
    return max(1, min(-(-n_words // THREADS), 8192))
