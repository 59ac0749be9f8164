"""Tiled attention oracles: FlashAttention-1 and -2, forward and backward, block by block.

These compute exactly what ``reference.standard`` computes, but in the order and
with the state a kernel has: S and P are never materialised beyond one
``block_q x block_k`` tile, and the softmax is computed online.

* ``flash_forward``     FlashAttention-2 forward (Dao 2023, Algorithm 1 and section 3.1):
                        outer loop over query blocks Q_i, inner over key blocks K_j, V_j;
                        running max ``m_i``, running sum ``l_i``, unnormalised ``acc``;
                        one division by ``l_i`` at the end; only ``lse = m_i + log(l_i)`` is stored.
* ``flash_forward_v1``  FlashAttention-1 forward (Dao et al. 2022, Algorithm 1, with dropout
                        as Algorithm 2): outer loop over K_j, V_j, inner over Q_i; O, l, m live
                        in "HBM" arrays that are read and written back at every step (line 12-13),
                        and O is kept normalised after every step.
* ``flash_backward``    recompute backward: FA1 Algorithm 4 loop order (outer K_j, V_j,
                        inner Q_i) with FA2's preprocessing ``delta = rowsum(dO * O)``;
                        P is recomputed per tile as ``exp(S - lse)``.
* ``flash_backward_v1`` FA1 Algorithm 4 as written: ``D_i = rowsum(dO_i * O_i)`` is
                        recomputed inside the inner loop from O_i, which is loaded every time.

Tiles that causal, the window or ``block_mask`` forbid entirely are skipped, as a
kernel skips them (FA1 Algorithm 5, block-sparse): they are neither loaded nor
computed. Skipping is decided per (batch, head) program; the loops below are
vectorised over (batch, head), so a tile that some programs skip is computed for
all and the skipping programs keep their state unchanged (``_keep_live``).

Block sizes are any positive integers; the last block of a sequence is simply
shorter (``r1 = min(r0 + block_q, seqlen_q)``), which is the bounds handling a
kernel needs when the length is not a multiple of the block.

``io_counter`` (optional; ``read(name, n)`` / ``write(name, n)``) receives every
block load and store of an HBM tensor, in elements, as in the algorithms' "Load
... from HBM" / "Write ... to HBM" lines; ``reference.io_model`` holds the
matching closed forms.
"""
from __future__ import annotations

import numpy as np

from ._scores import check_block_size, prepare
from .standard import _count_kv_head_sum, _NoCount

__all__ = ["flash_forward", "flash_forward_v1", "flash_backward", "flash_backward_v1", "attention_delta"]


# ----------------------------------------------------------------------------- helpers
def _blocks(n: int, block: int):
    """``(start, stop)`` of each block of ``range(n)``; the last one may be shorter."""
    return [(start, min(start + block, n)) for start in range(0, n, block)]


def _finite_or_zero(m: np.ndarray) -> np.ndarray:
    """A running max with ``-inf`` (nothing seen yet / all masked) replaced by 0.

    Subtracting it is then always safe: ``exp(-inf - 0) = 0``, whereas
    ``exp(-inf - (-inf))`` would be ``exp(nan)``.
    """
    return np.where(np.isneginf(m), m.dtype.type(0), m)


def _keep_live(live: np.ndarray, new: tuple, old: tuple) -> tuple:
    """Per (batch, head): take ``new`` state where the program computed this tile, else keep ``old``."""
    if live.all():
        return new
    return tuple(np.where(live.reshape(live.shape + (1,) * (n.ndim - 2)), n, o) for n, o in zip(new, old))


def _live_tiles(pb, c0: int, c1: int, block_q: int):
    """Query blocks that have something to compute against key block ``c0:c1``.

    Returns ``(tiles, column_live)``: ``tiles`` lists ``(r0, r1, structural, live)``
    for the query blocks that at least one (batch, head) program computes, and
    ``column_live`` (batch, nheads) says which programs touch this key block at all
    (only those load K_j, V_j).
    """
    tiles = []
    column_live = np.zeros((pb.batch, pb.nheads), dtype=bool)
    for r0, r1 in _blocks(pb.seqlen_q, block_q):
        structural = pb.structural_mask(r0, r1, c0, c1)
        live = pb.live(structural)
        if live.any():
            tiles.append((r0, r1, structural, live))
            column_live |= live
    return tiles, column_live


def _setup(q, k, v, block_q, block_k, io_counter, opts):
    pb = prepare(q, k, v, opts)
    block_q = check_block_size(block_q, "block_q")
    block_k = check_block_size(block_k, "block_k")
    return pb, block_q, block_k, (io_counter or _NoCount())


# ----------------------------------------------------------------------------- FA2 forward
def flash_forward(q, k, v, block_q, block_k, *, io_counter=None, **opts):
    """FlashAttention-2 forward: returns ``(out, lse)`` like ``reference.attention``.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim);
    block_q, block_k: tile sizes (any positive integers). Options as ``reference.attention``.
    """
    pb, block_q, block_k, counter = _setup(q, k, v, block_q, block_k, io_counter, opts)
    dt = pb.dtype
    B, H, Nq, d = pb.batch, pb.nheads, pb.seqlen_q, pb.headdim
    out = np.zeros((B, H, Nq, d), dtype=dt)                      # HBM: O
    lse = np.full((B, H, Nq), -np.inf, dtype=dt)                 # HBM: lse

    for r0, r1 in _blocks(Nq, block_q):                          # outer loop: one program per Q_i (FA2 3.1)
        br = r1 - r0
        q_loaded = np.zeros((B, H), dtype=bool)                  # which programs have loaded Q_i
        m_i = np.full((B, H, br), -np.inf, dtype=dt)             # running row max         (SRAM)
        l_i = np.zeros((B, H, br), dtype=dt)                     # running sum of exp(s - m_i)
        acc = np.zeros((B, H, br, d), dtype=dt)                  # unnormalised output, sum exp(s - m_i) v

        for c0, c1 in _blocks(pb.seqlen_k, block_k):             # inner loop over K_j, V_j
            structural = pb.structural_mask(r0, r1, c0, c1)
            live = pb.live(structural)                           # (B, H)
            if not live.any():
                continue                                         # fully masked tile: skipped, never loaded
            bc, n_live = c1 - c0, int(live.sum())
            counter.read("Q", int((live & ~q_loaded).sum()) * br * d)   # Q_i loaded once, before its first tile
            q_loaded |= live
            counter.read("K", n_live * bc * d)
            counter.read("V", n_live * bc * d)

            s, _ = pb.scores(r0, r1, c0, c1, structural)         # S_ij, masked        (B, H, br, bc)
            m_new = np.maximum(m_i, s.max(axis=-1))              # m_new = max(m_i, rowmax(S_ij))
            m_safe = _finite_or_zero(m_new)
            p = np.exp(s - m_safe[..., None])                    # P~_ij = exp(S_ij - m_new)
            alpha = np.exp(m_i - m_safe)                         # exp(m_i - m_new): rescales the old state
            l_new = alpha * l_i + p.sum(axis=-1, dtype=dt)       # l_new = exp(m_i - m_new) l_i + rowsum(P~_ij)
            p = pb.apply_dropout(p, pb.keep(r0, r1, c0, c1))     # dropout on P~ (regenerated); l_i uses undropped P
            acc_new = alpha[..., None] * acc + p @ pb.v[:, :, c0:c1]   # acc = diag(alpha) acc + P~_ij V_j
            m_i, l_i, acc = _keep_live(live, (m_new, l_new, acc_new), (m_i, l_i, acc))

        # Epilogue, once per query block: the deferred normalisation of FA2 (one
        # division instead of one per inner step) and the only statistic stored, lse.
        empty = l_i == 0                                         # fully masked row (or seqlen_k == 0)
        l_safe = np.where(empty, dt.type(1), l_i)
        out[:, :, r0:r1] = acc / l_safe[..., None]               # O_i = diag(l_i)^-1 acc  (0 if empty)
        with np.errstate(divide="ignore"):
            lse[:, :, r0:r1] = np.where(empty, dt.type(-np.inf), m_i + np.log(l_safe))   # L_i = m_i + log(l_i)
        counter.write("O", B * H * br * d)
        counter.write("lse", B * H * br)

    return pb.to_external(out), lse.astype(pb.lse_dtype)


# ----------------------------------------------------------------------------- FA1 forward
def flash_forward_v1(q, k, v, block_q, block_k, *, io_counter=None, **opts):
    """FlashAttention-1 forward (Algorithm 1 loop order): returns ``(out, lse)``.

    The paper's Algorithm 1 ends with O, l and m in HBM; the final ``lse = m + log(l)``
    (read l, m; write lse) is this oracle's epilogue, so that its result can be fed to
    the backward like ``flash_forward``'s.
    """
    pb, block_q, block_k, counter = _setup(q, k, v, block_q, block_k, io_counter, opts)
    dt = pb.dtype
    B, H, Nq, d = pb.batch, pb.nheads, pb.seqlen_q, pb.headdim
    BH = B * H
    # line 2: initialise O = 0, l = 0, m = -inf in HBM
    O = np.zeros((B, H, Nq, d), dtype=dt)
    l = np.zeros((B, H, Nq), dtype=dt)
    m = np.full((B, H, Nq), -np.inf, dtype=dt)
    counter.write("O", BH * Nq * d)
    counter.write("l", BH * Nq)
    counter.write("m", BH * Nq)

    for c0, c1 in _blocks(pb.seqlen_k, block_k):                 # line 5: outer loop over K_j, V_j
        bc = c1 - c0
        tiles, column_live = _live_tiles(pb, c0, c1, block_q)
        counter.read("K", int(column_live.sum()) * bc * d)       # line 6: load K_j, V_j
        counter.read("V", int(column_live.sum()) * bc * d)
        v_j = pb.v[:, :, c0:c1]
        for r0, r1, structural, live in tiles:                   # line 7: inner loop over Q_i
            br, n_live = r1 - r0, int(live.sum())
            for name, size in (("Q", br * d), ("O", br * d), ("l", br), ("m", br)):
                counter.read(name, n_live * size)                # line 8: load Q_i, O_i, l_i, m_i
            O_i, l_i, m_i = O[:, :, r0:r1], l[:, :, r0:r1], m[:, :, r0:r1]

            s, _ = pb.scores(r0, r1, c0, c1, structural)         # line 9: S_ij = Q_i K_j^T (and masks)
            m_tilde = s.max(axis=-1)                             # line 10: m~_ij = rowmax(S_ij)
            p_tilde = np.exp(s - _finite_or_zero(m_tilde)[..., None])   # P~_ij = exp(S_ij - m~_ij)
            l_tilde = p_tilde.sum(axis=-1, dtype=dt)             #          l~_ij = rowsum(P~_ij)
            m_new = np.maximum(m_i, m_tilde)                     # line 11: m_new = max(m_i, m~_ij)
            m_new_safe = _finite_or_zero(m_new)
            alpha = np.exp(m_i - m_new_safe)                     #          exp(m_i - m_new)
            beta = np.exp(m_tilde - m_new_safe)                  #          exp(m~_ij - m_new)
            l_new = alpha * l_i + beta * l_tilde                 #          l_new = alpha l_i + beta l~_ij
            p_tilde = pb.apply_dropout(p_tilde, pb.keep(r0, r1, c0, c1))   # Algorithm 2: dropout on P~_ij
            # line 12: O_i = diag(l_new)^-1 (diag(l_i) alpha O_i + beta P~_ij V_j), normalised at every step
            O_new = (l_i * alpha)[..., None] * O_i + beta[..., None] * (p_tilde @ v_j)
            O_new = O_new / np.where(l_new == 0, dt.type(1), l_new)[..., None]   # fully masked so far: O stays 0
            O_new, l_new, m_new = _keep_live(live, (O_new, l_new, m_new), (O_i, l_i, m_i))
            O[:, :, r0:r1], l[:, :, r0:r1], m[:, :, r0:r1] = O_new, l_new, m_new
            counter.write("O", n_live * br * d)                  # line 12-13: write O_i, l_i, m_i to HBM
            counter.write("l", n_live * br)
            counter.write("m", n_live * br)

    # epilogue (not in Algorithm 1): lse = m + log(l), -inf for fully masked rows
    counter.read("l", BH * Nq)
    counter.read("m", BH * Nq)
    with np.errstate(divide="ignore"):
        lse = np.where(l == 0, dt.type(-np.inf), _finite_or_zero(m) + np.log(np.where(l == 0, dt.type(1), l)))
    counter.write("lse", BH * Nq)
    return pb.to_external(O), lse.astype(pb.lse_dtype)


# ----------------------------------------------------------------------------- backward
def attention_delta(dout, out, *, dtype=None) -> np.ndarray:
    """FA2's backward preprocessing ``delta = rowsum(dout * out)``, shape (batch, nheads, seqlen_q).

    It equals ``rowsum(P * dP)`` of the softmax Jacobian, because
    ``dout . out = sum_j P_drop_ij (dout . v_j) = sum_j P_ij dP_ij``.
    """
    from ._scores import as_array
    do = as_array(dout, "dout", ndim=4)
    o = as_array(out, "out", ndim=4)
    if do.shape != o.shape:
        raise ValueError(f"dout and out must have the same shape, got {do.shape} and {o.shape}")
    dt = np.dtype(np.float64 if dtype is None else dtype)
    return np.sum(do.astype(dt) * o.astype(dt), axis=-1, dtype=dt).transpose(0, 2, 1).copy()


def _backward(dout, q, k, v, out, lse, block_q, block_k, io_counter, opts, *, fa1: bool):
    """Shared body of ``flash_backward`` (FA2 delta) and ``flash_backward_v1`` (FA1 Algorithm 4)."""
    pb, block_q, block_k, counter = _setup(q, k, v, block_q, block_k, io_counter, opts)
    dt = pb.dtype
    B, H, Nq, Nk, d = pb.batch, pb.nheads, pb.seqlen_q, pb.seqlen_k, pb.headdim
    BH = B * H
    do = pb.like_q(dout, "dout")                                 # (B, H, Nq, d)
    o = pb.like_q(out, "out")                                    # (B, H, Nq, d)
    lse = pb.lse_in(lse)                                         # (B, H, Nq)
    # A fully masked row has lse = -inf. Putting +inf in its place makes
    # P = exp(S - lse) = 0 for every S in that row, S = -inf included
    # (exp(-inf - (-inf)) would be NaN), so the row contributes zero gradients.
    lse_safe = np.where(np.isneginf(lse), dt.type(np.inf), lse)

    dq = np.zeros((B, H, Nq, d), dtype=dt)                       # HBM, accumulated across key blocks
    dk = np.zeros((B, H, Nk, d), dtype=dt)                       # HBM, per query head until the GQA sum
    dv = np.zeros((B, H, Nk, d), dtype=dt)
    if fa1:
        counter.write("dQ", BH * Nq * d)                         # Algorithm 4: initialise dQ, dK, dV = 0 in HBM
        counter.write("dK", BH * Nk * d)
        counter.write("dV", BH * Nk * d)
        delta = None
    else:
        counter.read("dO", BH * Nq * d)                          # FA2 preprocessing: delta = rowsum(dO * O)
        counter.read("O", BH * Nq * d)
        delta = np.sum(do * o, axis=-1, dtype=dt)                # (B, H, Nq)
        counter.write("delta", BH * Nq)
        counter.write("dQ", BH * Nq * d)                         # dQ = 0 in HBM

    for c0, c1 in _blocks(Nk, block_k):                          # outer loop over K_j, V_j
        bc = c1 - c0
        tiles, column_live = _live_tiles(pb, c0, c1, block_q)
        counter.read("K", int(column_live.sum()) * bc * d)       # load K_j, V_j
        counter.read("V", int(column_live.sum()) * bc * d)
        k_j, v_j = pb.k[:, :, c0:c1], pb.v[:, :, c0:c1]          # (B, H, bc, d)
        dk_j = np.zeros((B, H, bc, d), dtype=dt)                 # SRAM accumulators
        dv_j = np.zeros((B, H, bc, d), dtype=dt)

        for r0, r1, structural, live in tiles:                   # inner loop over Q_i
            br, n_live = r1 - r0, int(live.sum())
            reads = [("Q", br * d), ("dO", br * d), ("dQ", br * d), ("lse", br)]
            reads += [("O", br * d)] if fa1 else [("delta", br)]
            for name, size in reads:
                counter.read(name, n_live * size)
            q_i, do_i = pb.q[:, :, r0:r1], do[:, :, r0:r1]       # (B, H, br, d)

            s, t = pb.scores(r0, r1, c0, c1, structural)         # S_ij, recomputed        (B, H, br, bc)
            p = np.exp(s - lse_safe[:, :, r0:r1, None])          # P_ij = exp(S_ij - L_i), recomputed
            keep = pb.keep(r0, r1, c0, c1)                       # dropout mask, regenerated
            p_drop = pb.apply_dropout(p, keep)
            dv_new = dv_j + p_drop.swapaxes(-1, -2) @ do_i       # dV_j += P_drop^T dO_i
            dp = pb.apply_dropout(do_i @ v_j.swapaxes(-1, -2), keep)   # dP_ij = (dO_i V_j^T) * keep / (1 - p)
            if fa1:
                delta_i = np.sum(do_i * o[:, :, r0:r1], axis=-1, dtype=dt)   # Algorithm 4: D_i = rowsum(dO_i * O_i)
            else:
                delta_i = delta[:, :, r0:r1]
            ds = p * (dp - delta_i[..., None])                   # dS_ij = P_ij * (dP_ij - D_i)
            if t is not None:
                ds = ds * (1 - t * t)                            # through softcap: d tanh = 1 - tanh^2
            dq_new = dq[:, :, r0:r1] + pb.scale * (ds @ k_j)     # dQ_i += scale dS_ij K_j   (written back)
            dk_new = dk_j + pb.scale * (ds.swapaxes(-1, -2) @ q_i)   # dK_j += scale dS_ij^T Q_i
            dq_i, dk_j, dv_j = _keep_live(live, (dq_new, dk_new, dv_new), (dq[:, :, r0:r1], dk_j, dv_j))
            dq[:, :, r0:r1] = dq_i
            counter.write("dQ", n_live * br * d)

        dk[:, :, c0:c1], dv[:, :, c0:c1] = dk_j, dv_j            # write dK_j, dV_j (every program, zeros if idle)
        counter.write("dK", BH * bc * d)
        counter.write("dV", BH * bc * d)

    _count_kv_head_sum(pb, counter)
    return pb.to_external(dq), pb.sum_kv_heads(dk), pb.sum_kv_heads(dv)


def flash_backward(dout, q, k, v, out, lse, block_q, block_k, *, io_counter=None, **opts):
    """Recompute backward with FA2's ``delta``: returns ``(dq, dk, dv)`` like ``reference.attention_backward``.

    out, lse: the forward's results (any of the oracles', or a kernel's). Rows with
    ``lse = -inf`` (fully masked) give zero gradients, never NaN.
    """
    return _backward(dout, q, k, v, out, lse, block_q, block_k, io_counter, opts, fa1=False)


def flash_backward_v1(dout, q, k, v, out, lse, block_q, block_k, *, io_counter=None, **opts):
    """FA1 Algorithm 4: like ``flash_backward`` but ``D_i`` is recomputed from ``O_i`` in every tile.

    The paper's Algorithm 4 loads ``l_i`` and ``m_i``; this oracle loads ``lse_i = m_i + log(l_i)``
    in their place (``P_ij = diag(l_i)^-1 exp(S_ij - m_i) = exp(S_ij - lse_i)``).
    """
    return _backward(dout, q, k, v, out, lse, block_q, block_k, io_counter, opts, fa1=True)
