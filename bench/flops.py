"""FLOP counts for attention, the FlashAttention convention written in code.

The convention is the one of flash-attn's ``benchmarks/benchmark_flash_attention.py``
(and of the FlashAttention papers' TFLOP/s plots):

* forward  = 4 * batch * nheads * seqlen_q * seqlen_k * headdim
  (two matmuls, ``Q K^T`` and ``P V``, of 2 * seqlen_q * seqlen_k * headdim each);
  halved for causal attention with ``seqlen_q == seqlen_k``;
* backward = 2.5 x forward  (five matmuls instead of two);
* forward + backward = 3.5 x forward.

The softmax, scaling and masking are not counted.  Query heads are counted
(``nheads``), whatever ``nheads_k`` is: grouped-query attention does the same
matmul work.  Dropout does not change the count.

Where the masked shape is not the plain square causal triangle (causal with
``seqlen_q != seqlen_k``, which is bottom-right aligned, or a sliding window),
the forward counts the exact number of unmasked (query, key) pairs, with the
rule of docs/semantics.md: query ``i`` sees key ``j`` iff
``i + off - left <= j <= i + off + right`` (and ``j <= i + off`` when causal),
``off = seqlen_k - seqlen_q``.
"""
from __future__ import annotations

import numpy as np

PASSES = ("fwd", "bwd", "fwdbwd")
PASS_FACTOR_HALVES = {"fwd": 2, "bwd": 5, "fwdbwd": 7}  # x fwd / 2: 1, 2.5, 3.5
NO_WINDOW = (-1, -1)


def attended_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False,
                   window: tuple[int, int] = NO_WINDOW) -> int:
    """Exact number of (i, j) pairs that survive the causal and window masks."""
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    left, right = window
    i = np.arange(seqlen_q, dtype=np.int64)
    diag = i + (seqlen_k - seqlen_q)           # key aligned with query i (bottom-right)
    lo = np.zeros_like(i) if left < 0 else np.maximum(diag - left, 0)
    hi = np.full_like(i, seqlen_k - 1)
    if causal:
        hi = np.minimum(hi, diag)
    if right >= 0:
        hi = np.minimum(hi, diag + right)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def forward_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                  causal: bool = False, window: tuple[int, int] = NO_WINDOW) -> int:
    """FLOPs of one attention forward pass (see the module docstring)."""
    if causal and seqlen_q == seqlen_k and tuple(window) == NO_WINDOW:
        # flash-attn's convention: exactly half of the square, not N (N + 1) / 2
        return 4 * batch * nheads * seqlen_q * seqlen_k * headdim // 2
    pairs = attended_pairs(seqlen_q, seqlen_k, causal, tuple(window))
    return 4 * batch * nheads * pairs * headdim


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                    causal: bool = False, window: tuple[int, int] = NO_WINDOW,
                    pass_: str = "fwd") -> int:
    """FLOPs of ``pass_`` in ``PASSES``: fwd, bwd = 2.5 fwd, fwdbwd = 3.5 fwd.

    The forward count is always even, so the result is an exact integer.
    """
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, not {pass_!r}")
    fwd = forward_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, window)
    return fwd * PASS_FACTOR_HALVES[pass_] // 2


def tflops_per_s(flops: int, ms: float | None) -> float | None:
    """Throughput in TFLOP/s (10^12 FLOP per second) for a time in milliseconds."""
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12
