"""Standard attention, materialising S and P: FlashAttention paper, Algorithm 0 and Algorithm 3.

Algorithm 0 (forward), one line per step, per (batch, head):

    1. S = softmax_scale * Q K^T                  (N_q x N_k, written to HBM)
       ... then softcap, bias, ALiBi and masks (docs/semantics.md steps 2-4)
    2. P = softmax(S)                             (N_q x N_k, written to HBM)
       lse = log(rowsum(exp(S)))                  (kept so the backward can be checked against it)
       P_drop = P * keep / (1 - dropout_p)        (dropout, FA1 Appendix B)
    3. O = P_drop V

Algorithm 3 (backward), derived from the forward line by line:

    1. dV = P_drop^T dO                           (forward: O = P_drop V)
    2. dP = (dO V^T) * keep / (1 - dropout_p)     (forward: O = P_drop V, P_drop = P * keep / (1 - p))
    3. dS = P * (dP - rowsum(P * dP))             (forward: P = softmax(S); softmax Jacobian
                                                   dS_ij = sum_l P_il (delta_lj - P_ij) dP_il)
       dS *= 1 - tanh(S_raw / softcap)**2         (forward: S = softcap * tanh(S_raw / softcap))
    4. dQ = softmax_scale * dS K                  (forward: S = softmax_scale * Q K^T)
    5. dK = softmax_scale * dS^T Q, summed over the query heads that share a key/value head

Everything is vectorised over (batch, heads); nothing loops. The score matrix
comes from ``reference._scores.Problem.scores``, which the tiled oracles share.

``io_counter`` (optional, any object with ``read(name, n)`` and ``write(name, n)``)
receives the HBM traffic of the algorithm's lines, in elements; see
``reference.io_model``.
"""
from __future__ import annotations

import numpy as np

from ._scores import prepare

__all__ = ["attention", "attention_probs", "attention_backward"]


class _NoCount:
    def read(self, name, n):
        pass

    def write(self, name, n):
        pass


def _softmax(s: np.ndarray):
    """Row softmax of ``s`` (..., N_k) and its log-sum-exp, safe for rows that are all ``-inf``.

    Returns ``(p, lse)``. A row with every key masked (or no keys at all) has
    ``lse = -inf`` and ``p = 0`` (docs/semantics.md), never NaN.
    """
    neg_inf = s.dtype.type(-np.inf)
    m = np.max(s, axis=-1, initial=neg_inf)                  # row max; `initial` handles seqlen_k == 0
    m_safe = np.where(m == neg_inf, s.dtype.type(0), m)      # all -inf row: subtract 0, not -inf (-inf - -inf = NaN)
    e = np.exp(s - m_safe[..., None])                        # exp(-inf) = 0 for masked entries
    l = np.sum(e, axis=-1, dtype=s.dtype)                    # >= 1 unless the row is fully masked
    with np.errstate(divide="ignore"):
        lse = m_safe + np.log(l)                             # log(0) = -inf: fully masked row
    p = e / np.where(l == 0, s.dtype.type(1), l)[..., None]  # 0 / 1 = 0 on fully masked rows
    return p, lse


def _forward(pb, counter):
    B, H, Nq, Nk, d = pb.batch, pb.nheads, pb.seqlen_q, pb.seqlen_k, pb.headdim
    BH = B * H
    counter.read("Q", BH * Nq * d)                           # line 1: load Q, K; write S
    counter.read("K", BH * Nk * d)
    s, t = pb.scores(0, Nq, 0, Nk)                           # (B, H, Nq, Nk)
    counter.write("S", BH * Nq * Nk)
    counter.read("S", BH * Nq * Nk)                          # line 2: read S; write P (and lse)
    p, lse = _softmax(s)                                     # p: (B, H, Nq, Nk), lse: (B, H, Nq)
    counter.write("P", BH * Nq * Nk)
    counter.write("lse", BH * Nq)
    keep = pb.keep(0, Nq, 0, Nk)                             # (B, H, Nq, Nk) or None
    p_drop = pb.apply_dropout(p, keep)
    counter.read("P", BH * Nq * Nk)                          # line 3: load P, V; write O
    counter.read("V", BH * Nk * d)
    out = p_drop @ pb.v                                      # (B, H, Nq, d)
    counter.write("O", BH * Nq * d)
    return s, t, p, p_drop, keep, out, lse


def attention(q, k, v, *, io_counter=None, **opts):
    """Standard attention (Algorithm 0): returns ``(out, lse)``.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    Options as in docs/semantics.md (``softmax_scale, causal, window_size, attn_mask,
    attn_bias, alibi_slopes, softcap, block_mask, block_mask_size, dropout_p, seed``)
    plus ``dtype``: compute in float16/float32/float64 (default None = float64).

    Returns ``out`` (batch, seqlen_q, nheads, headdim) in the compute dtype and
    ``lse`` (batch, nheads, seqlen_q): float64 by default, float32 for 16-bit ``dtype``.
    """
    pb = prepare(q, k, v, opts)
    *_, out, lse = _forward(pb, io_counter or _NoCount())
    return pb.to_external(out), lse.astype(pb.lse_dtype)


def attention_probs(q, k, v, **opts) -> np.ndarray:
    """The softmax ``P`` before dropout, (batch, nheads, seqlen_q, seqlen_k), for tests and docs."""
    pb = prepare(q, k, v, opts)
    s, _ = pb.scores(0, pb.seqlen_q, 0, pb.seqlen_k)
    return _softmax(s)[0]


def attention_backward(dout, q, k, v, *, io_counter=None, **opts):
    """Closed-form gradient of ``attention`` (Algorithm 3): returns ``(dq, dk, dv)``.

    dout: like q. ``dk, dv`` have the shape of ``k`` and are summed over the
    query heads that share a key/value head. The softcap chain rule and dropout
    (same ``seed``, same keep mask as the forward) are included; no gradient is
    returned for ``attn_bias`` or ``alibi_slopes``. Fully masked rows contribute zero.
    Results are in the compute dtype (float64 by default).
    """
    pb = prepare(q, k, v, opts)
    counter = io_counter or _NoCount()
    do = pb.like_q(dout, "dout")                             # (B, H, Nq, d)
    # Algorithm 3 starts with P already in HBM; recompute it here without counting it.
    s, t, p, p_drop, keep, out, lse = _forward(pb, _NoCount())
    B, H, Nq, Nk, d = pb.batch, pb.nheads, pb.seqlen_q, pb.seqlen_k, pb.headdim
    BH = B * H

    # line 1: dV = P_drop^T dO                               (B, H, Nk, d)
    counter.read("P", BH * Nq * Nk)
    counter.read("dO", BH * Nq * d)
    dv = p_drop.swapaxes(-1, -2) @ do
    counter.write("dV", BH * Nk * d)

    # line 2: dP = dO V^T, through dropout                   (B, H, Nq, Nk)
    counter.read("dO", BH * Nq * d)
    counter.read("V", BH * Nk * d)
    dp = pb.apply_dropout(do @ pb.v.swapaxes(-1, -2), keep)
    counter.write("dP", BH * Nq * Nk)

    # line 3: dS = P * (dP - rowsum(P * dP)), the softmax Jacobian applied to dP.
    # (rowsum(P * dP) equals FA2's delta = rowsum(dO * O); flash.py uses the latter.)
    counter.read("P", BH * Nq * Nk)
    counter.read("dP", BH * Nq * Nk)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True, dtype=pb.dtype))
    if t is not None:
        ds = ds * (1 - t * t)                                # d/dx softcap * tanh(x / softcap) = 1 - tanh^2
    counter.write("dS", BH * Nq * Nk)

    # line 4: dQ = scale * dS K                              (B, H, Nq, d)
    counter.read("dS", BH * Nq * Nk)
    counter.read("K", BH * Nk * d)
    dq = pb.scale * (ds @ pb.k)
    counter.write("dQ", BH * Nq * d)

    # line 5: dK = scale * dS^T Q                            (B, H, Nk, d)
    counter.read("dS", BH * Nq * Nk)
    counter.read("Q", BH * Nq * d)
    dk = pb.scale * (ds.swapaxes(-1, -2) @ pb.q)
    counter.write("dK", BH * Nk * d)

    _count_kv_head_sum(pb, counter)
    return pb.to_external(dq), pb.sum_kv_heads(dk), pb.sum_kv_heads(dv)


def _count_kv_head_sum(pb, counter):
    """GQA epilogue: per-query-head dK, dV are read back and summed into nheads_k heads."""
    if pb.group > 1:
        n_in = pb.batch * pb.nheads * pb.seqlen_k * pb.headdim
        n_out = pb.batch * pb.nheads_k * pb.seqlen_k * pb.headdim
        for name in ("dK", "dV"):
            counter.read(name, n_in)
            counter.write(name, n_out)
