"""Backward oracle (reference.attention_backward, flash_backward) against docs/semantics.md.

Three independent witnesses: the test's own closed form (strategies.naive_attention),
central finite differences of the scalar loss sum(out * dout) in float64, and
the tiled recompute backwards (FA2's delta and FA1 Algorithm 4) against the closed form.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import reference
import strategies as S

SMALL = dict(max_seqlen=20, max_batch=2, max_nheads=4)
RECOMPUTE = [reference.flash_backward, reference.flash_backward_v1]


def _model(p: S.Problem, **changes):
    opts = dict(p.opts)
    opts.update(changes)
    keep = None
    if opts.get("dropout_p", 0.0) > 0:
        keep = reference.dropout_keep_mask(opts.get("seed", 0), p.batch, p.nheads, p.seqlen_q, p.seqlen_k,
                                           opts["dropout_p"])
    return S.naive_attention(p.q, p.k, p.v, p.dout, keep=keep, **opts)


def _check_grads(grads, m, rel, what):
    for name, g in zip(("dq", "dk", "dv"), grads):
        S.assert_close(g, m[name], m["mag_" + name], rel, f"{what} {name}")


@given(S.problems(allow_empty=True))
def test_closed_form_backward_matches_independent_model(p):
    """attention_backward == ds = p (dp - delta), dq = scale ds k, dk = scale ds^T q, dv = P~^T dout (semantics.md).

    The dropout keep mask comes from reference.dropout_keep_mask, so this also
    checks the backward uses the same mask as the forward (test_oracle_forward
    checks the forward against our own Philox).
    """
    grads = reference.attention_backward(p.dout, p.q, p.k, p.v, **p.opts)
    m = _model(p)
    for g, ref in zip(grads, (p.q, p.k, p.v)):
        assert g.shape == ref.shape
    _check_grads(grads, m, S.rounding_rel(m, p.headdim, p.seqlen_k), "attention_backward")


@pytest.mark.parametrize("backward", RECOMPUTE, ids=lambda f: f.__name__)
@given(p=S.problems(**SMALL))
def test_recompute_backward_matches_closed_form(backward, p):
    """flash_backward[_v1] (tiled, recomputes P from q, k and the saved lse) == attention_backward."""
    out, lse = reference.attention(p.q, p.k, p.v, **p.opts)
    expected = reference.attention_backward(p.dout, p.q, p.k, p.v, **p.opts)
    grads = backward(p.dout, p.q, p.k, p.v, out, lse, p.block_q, p.block_k, **p.opts)
    m = _model(p)
    rel = S.rounding_rel(m, p.headdim, p.seqlen_k)
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        S.assert_close(g, e, m["mag_" + name], rel, f"{backward.__name__} {name}")


@given(S.problems(**SMALL))
def test_recompute_backward_from_tiled_forward(p):
    """The tiled pipeline end to end: flash_forward's (out, lse) fed to flash_backward == closed form."""
    out, lse = reference.flash_forward(p.q, p.k, p.v, p.block_q, p.block_k, **p.opts)
    # the backward tiles need not match the forward's: swap them on purpose
    grads = reference.flash_backward(p.dout, p.q, p.k, p.v, out, lse, p.block_k, p.block_q, **p.opts)
    m = _model(p)
    _check_grads(grads, m, S.rounding_rel(m, p.headdim, p.seqlen_k), "flash_forward -> flash_backward")


@pytest.mark.parametrize("backward", RECOMPUTE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("block_q,block_k", [(1, 1), (2, 3), (4, 16), (7, 5), (16, 4), (64, 64)])
def test_recompute_backward_block_sweep(backward, block_q, block_k):
    rng = np.random.default_rng(99)
    q = rng.standard_normal((2, 13, 4, 6)) * 10
    k, v = rng.standard_normal((2, 2, 11, 2, 6))
    dout = rng.standard_normal(q.shape)
    opts = dict(causal=True, window_size=(6, -1), softcap=8.0, dropout_p=0.25, seed=2**63 + 11,
                attn_bias=rng.standard_normal((13, 11)))
    out, lse = reference.attention(q, k, v, **opts)
    expected = reference.attention_backward(dout, q, k, v, **opts)
    grads = backward(dout, q, k, v, out, lse, block_q, block_k, **opts)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-11 * np.abs(e).max())


def _loss(p: S.Problem, q, k, v):
    out, _ = reference.attention(q, k, v, **p.opts)
    return float(np.sum(out * p.dout))


@given(S.problems(scale=1.0, max_seqlen=12, max_nheads=3, headdims=(1, 2, 3, 4, 5, 8)),
       st.integers(0, 2**32))
def test_backward_matches_central_finite_differences(p, seed):
    """<grad_x L, u> == (L(x + h u) - L(x - h u)) / 2h for L = sum(out * dout), x in {q, k, v}, float64.

    h = 1e-5 on unit-variance data with a unit-norm direction u: the truncation
    error is O(h^2 |L'''|) ~ 1e-10 and the cancellation error O(eps |L| / h) ~ 1e-11,
    so 1e-6 * ||grad|| (the largest possible directional derivative) plus 1e-8
    holds with a wide margin, while a wrong factor (scale, 1/(1-p), a missing
    softcap derivative) is off by O(||grad||).
    """
    rng = np.random.default_rng(seed)
    grads = reference.attention_backward(p.dout, p.q, p.k, p.v, **p.opts)
    h = 1e-5
    for index, name in enumerate(("q", "k", "v")):
        x = (p.q, p.k, p.v)[index]
        if x.size == 0:
            continue
        u = rng.standard_normal(x.shape)
        u /= np.linalg.norm(u)
        args_plus = [p.q, p.k, p.v]
        args_minus = [p.q, p.k, p.v]
        args_plus[index] = x + h * u
        args_minus[index] = x - h * u
        fd = (_loss(p, *args_plus) - _loss(p, *args_minus)) / (2 * h)
        analytic = float(np.sum(grads[index] * u))
        tol = 1e-6 * np.linalg.norm(grads[index]) + 1e-8
        assert abs(fd - analytic) <= tol, f"d{name}: finite difference {fd!r} vs analytic {analytic!r} (tol {tol:.3g})"


@given(S.problems(max_nheads=6))
def test_gqa_grads_are_mha_grads_summed_over_the_group(p):
    """dk, dv of a shared k/v head == sum of the MHA gradients of the query heads that read it."""
    group = p.nheads // p.nheads_k
    k_rep, v_rep = np.repeat(p.k, group, axis=2), np.repeat(p.v, group, axis=2)
    dq0, dk0, dv0 = reference.attention_backward(p.dout, p.q, p.k, p.v, **p.opts)
    dq1, dk1, dv1 = reference.attention_backward(p.dout, p.q, k_rep, v_rep, **p.opts)
    fold = lambda x: x.reshape(p.batch, p.seqlen_k, p.nheads_k, group, p.headdim).sum(axis=3)
    m = _model(p)
    rel = S.rounding_rel(m, p.headdim, p.seqlen_k)
    S.assert_close(dq0, dq1, m["mag_dq"], rel, "dq")
    S.assert_close(dk0, fold(dk1), m["mag_dk"], rel, "dk")
    S.assert_close(dv0, fold(dv1), m["mag_dv"], rel, "dv")


@given(S.problems(**SMALL), st.integers(0, 2**32))
def test_fully_masked_rows_contribute_zero_gradients(p, seed):
    """A fully masked row has dq == 0 exactly, and its dout does not reach dk, dv (no NaN anywhere)."""
    rng = np.random.default_rng(seed)
    dead = rng.random((p.batch, p.nheads, p.seqlen_q, 1)) < 0.4
    mask = p.opts.get("attn_mask")
    pm = p.with_opts(attn_mask=~dead if mask is None else (mask & ~dead))
    dead_bih = np.broadcast_to(dead[..., 0], (p.batch, p.nheads, p.seqlen_q))
    out, lse = reference.attention(pm.q, pm.k, pm.v, **pm.opts)
    m = _model(pm)
    rel = S.rounding_rel(m, p.headdim, p.seqlen_k)
    dout2 = pm.dout.copy()
    dout2.transpose(0, 2, 1, 3)[dead_bih] = 1e6                   # dout of dead rows must not matter
    backwards = [lambda do: reference.attention_backward(do, pm.q, pm.k, pm.v, **pm.opts)]
    backwards += [lambda do, f=f: f(do, pm.q, pm.k, pm.v, out, lse, p.block_q, p.block_k, **pm.opts)
                  for f in RECOMPUTE]
    for backward in backwards:
        grads = backward(pm.dout)
        assert not any(np.isnan(g).any() for g in grads)
        assert np.all(grads[0].transpose(0, 2, 1, 3)[dead_bih] == 0.0)
        _check_grads(grads, m, rel, "with fully masked rows")
        grads2 = backward(dout2)
        for name, g, g2 in zip(("dk", "dv"), grads[1:], grads2[1:]):
            S.assert_close(g2, g, m["mag_" + name], rel, f"{name} with dout changed on fully masked rows")


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(3, 0), (0, 3), (0, 0)])
def test_empty_sequence_gradients(seqlen_q, seqlen_k):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, seqlen_q, 2, 4))
    k, v = rng.standard_normal((2, 2, seqlen_k, 1, 4))
    dout = rng.standard_normal(q.shape)
    out, lse = reference.attention(q, k, v)
    for grads in [reference.attention_backward(dout, q, k, v)] + [f(dout, q, k, v, out, lse, 4, 4) for f in RECOMPUTE]:
        for g, x in zip(grads, (q, k, v)):
            assert g.shape == x.shape and np.all(g == 0)


@given(S.problems(required={"dropout"}, **SMALL))
def test_dropout_forward_and_backward_use_the_keep_mask(p):
    """Forward and backward with dropout == the hand-built computation with reference.dropout_keep_mask.

    The same keep mask must drive P~ in the forward (out) and dp, dv in the
    backward; a backward that regenerated a different mask (e.g. keyed on the
    k/v head, or with i and j swapped) fails here.
    """
    m = _model(p)
    rel = S.rounding_rel(m, p.headdim, p.seqlen_k)
    out, lse = reference.attention(p.q, p.k, p.v, **p.opts)
    S.assert_close(out, m["out"], m["mag_out"], rel, "out with dropout")
    _check_grads(reference.attention_backward(p.dout, p.q, p.k, p.v, **p.opts), m, rel, "attention_backward")
    for backward in RECOMPUTE:
        _check_grads(backward(p.dout, p.q, p.k, p.v, out, lse, p.block_q, p.block_k, **p.opts),
                     m, rel, backward.__name__)


@given(S.problems(**SMALL))
def test_delta_is_rowsum_dout_out_and_rowsum_p_dp(p):
    """FA2's delta = rowsum(dout * out) (attention_delta) equals the softmax Jacobian's rowsum(P * dP)."""
    out, _ = reference.attention(p.q, p.k, p.v, **p.opts)
    delta = reference.attention_delta(p.dout, out)
    m = _model(p)
    rel = S.rounding_rel(m, p.headdim, p.seqlen_k)
    dp = np.einsum("bihd,bjhd->bhij", p.dout, np.repeat(p.v, p.nheads // p.nheads_k, axis=2)) * m["keep_scale"]
    expected = np.sum(m["p"] * dp, axis=-1)
    magnitude = np.sum(m["p"] * np.abs(dp), axis=-1) + np.einsum("bihd,bihd->bhi", np.abs(p.dout), m["mag_out"])
    assert delta.shape == (p.batch, p.nheads, p.seqlen_q)
    S.assert_close(delta, expected, magnitude, rel, "delta")
