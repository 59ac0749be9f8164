"""Dropout keep mask: Philox-4x32-10 as a pure function of ``(seed, b, h, i, j)``.

Implements docs/semantics.md, section "Dropout". FlashAttention never stores the
dropout mask: the forward (FA1 Algorithm 2) and the backward (FA1 Algorithm 4)
regenerate the same bits from the generator state. A
counter-based generator makes that regeneration trivial: the random word for
element ``(b, h, i, j)`` is ``philox4x32_10(counter=(j, i, h, b), key=seed)[0]``,
with no sequential state at all, so any tile can be regenerated in any order.

Philox-4x32-10 is Random123's generator (Salmon, Moraes, Dror, Shaw, "Parallel
random numbers: as easy as 1, 2, 3", SC'11). One round is a Feistel-like
"product, hi, lo, xor" step on four 32-bit words; the 64-bit product of two
32-bit words is exact in uint64, so numpy does ``mulhilo32`` with one multiply.

Everything here is vectorised over numpy arrays of counters; nothing loops over
elements.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = [
    "PHILOX_M4x32_0", "PHILOX_M4x32_1", "PHILOX_W32_0", "PHILOX_W32_1", "PHILOX_ROUNDS",
    "PHILOX4x32_10_KNOWN_ANSWERS", "philox4x32_10", "dropout_threshold", "dropout_keep",
    "dropout_keep_mask",
]

PHILOX_M4x32_0 = 0xD2511F53   # multiplier applied to counter word 0
PHILOX_M4x32_1 = 0xCD9E8D57   # multiplier applied to counter word 2
PHILOX_W32_0 = 0x9E3779B9     # Weyl key increment for key word 0 (golden ratio, 2**32 / phi)
PHILOX_W32_1 = 0xBB67AE85     # Weyl key increment for key word 1 (sqrt(3) - 1, times 2**32)
PHILOX_ROUNDS = 10

_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)

# Known answers (counter words, key words, output words), the three
# "philox4x32 10" lines of Random123's tests/kat_vectors
# (github.com/DEShawResearch/random123). The last counter/key are the hex digits
# of pi, as in that file.
PHILOX4x32_10_KNOWN_ANSWERS = (
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
)


def _as_words(words, count: int, name: str) -> list[np.ndarray]:
    """``count`` uint32 values (scalars or arrays), checked, as uint64 arrays."""
    try:
        n = len(words)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of {count} uint32 words (or arrays of them)") from None
    if n != count:
        raise ValueError(f"{name} must have {count} words, got {n}")
    out = []
    for w in words:
        a = np.asarray(w)
        if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{name} words must be integers, got dtype {a.dtype}")
        if a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
            raise ValueError(f"{name} words must lie in [0, 2**32)")
        out.append(a.astype(np.uint64))
    return out


def philox4x32_10(counter_words, key_words) -> np.ndarray:
    """Random123's Philox-4x32-10: four uint32 output words per counter.

    counter_words: 4 words ``(c0, c1, c2, c3)``, each a uint32 scalar or array;
        they broadcast together (an array of shape ``(4, ...)`` works too).
    key_words: 2 words ``(k0, k1)``, broadcastable with the counters.
    Returns a uint32 array of shape ``(4, *broadcast_shape)``.

    One round maps ``(c0, c1, c2, c3)`` with key ``(k0, k1)`` to
    ``(hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0))``;
    the key is bumped by the Weyl constants between rounds.

    >>> [hex(int(w)) for w in philox4x32_10((0, 0, 0, 0), (0, 0))]
    ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    c0, c1, c2, c3 = _as_words(counter_words, 4, "counter_words")
    k0, k1 = _as_words(key_words, 2, "key_words")
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(c0, c1, c2, c3, k0, k1)
    m0, m1 = np.uint64(PHILOX_M4x32_0), np.uint64(PHILOX_M4x32_1)
    w0, w1 = np.uint64(PHILOX_W32_0), np.uint64(PHILOX_W32_1)
    for rnd in range(PHILOX_ROUNDS):
        if rnd > 0:                                  # key schedule: k += W between rounds
            k0 = (k0 + w0) & _MASK32
            k1 = (k1 + w1) & _MASK32
        prod0 = m0 * c0                              # mulhilo32: a 32x32 -> 64-bit product is exact in uint64
        prod1 = m1 * c2
        c0, c1, c2, c3 = ((prod1 >> _SHIFT32) ^ c1 ^ k0, prod1 & _MASK32,
                          (prod0 >> _SHIFT32) ^ c3 ^ k1, prod0 & _MASK32)
    return np.stack([c0, c1, c2, c3]).astype(np.uint32)


def _check_seed(seed) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer in [0, 2**64), got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must lie in [0, 2**64), got {seed}")
    return seed


def _check_dropout_p(dropout_p) -> float:
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {type(dropout_p).__name__}")
    dropout_p = float(dropout_p)
    if not (0.0 <= dropout_p < 1.0):             # also rejects NaN
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    return dropout_p


def dropout_threshold(dropout_p: float) -> int:
    """``floor(dropout_p * 2**32)``: an element is kept iff its word is ``>=`` this.

    ``dropout_p * 2**32`` is exact in float64 (a power-of-two scaling), and for
    ``dropout_p < 1`` the floor is at most ``2**32 - 1``, so it fits a uint32.
    """
    return math.floor(_check_dropout_p(dropout_p) * 2.0**32)


def dropout_keep(seed: int, dropout_p: float, b, h, i, j) -> np.ndarray:
    """Keep decisions for the elements at broadcastable index arrays ``b, h, i, j``.

    ``h`` is the *query* head. This is what a kernel regenerates for one tile:
    pass ``i = rows[:, None]``, ``j = cols[None, :]`` for a ``(block_q, block_k)`` tile.
    """
    seed = _check_seed(seed)
    threshold = np.uint32(dropout_threshold(dropout_p))
    key = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)     # two uint32 words
    r = philox4x32_10((j, i, h, b), key)[0]                  # counter = (j, i, h, b); first output word
    return r >= threshold                                    # uint32 comparison


def dropout_keep_mask(seed: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                      dropout_p: float) -> np.ndarray:
    """The ``(batch, nheads, seqlen_q, seqlen_k)`` boolean keep mask of docs/semantics.md.

    ``True`` keeps the element (scaled by ``1 / (1 - dropout_p)``), ``False`` drops it.
    """
    for name, n in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {type(n).__name__}")
        if n < 0 or n > 0xFFFFFFFF:
            raise ValueError(f"{name} must lie in [0, 2**32), got {n}")
    b = np.arange(batch, dtype=np.uint64)[:, None, None, None]
    h = np.arange(nheads, dtype=np.uint64)[None, :, None, None]
    i = np.arange(seqlen_q, dtype=np.uint64)[None, None, :, None]
    j = np.arange(seqlen_k, dtype=np.uint64)[None, None, None, :]
    keep = dropout_keep(seed, dropout_p, b, h, i, j)
    return np.broadcast_to(keep, (batch, nheads, seqlen_q, seqlen_k)).copy()
