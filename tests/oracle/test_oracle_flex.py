"""The oracle of score_mod / mask_mod attention (``reference.flex``), held to the oracle's built-in options: the
mods that express causal masks, sliding windows, ALiBi and softcap give ``reference.attention``'s results with
those options; a mod written element-wise (``if``, ``math``) gives its vectorised twin's; grouped heads equal
repeated heads; ``block_states`` says empty / partial / full exactly where the mask does; a row with no key gives
out 0 and lse -inf.  Shapes and data from Hypothesis, float64 throughout."""
import math

import numpy as np
from hypothesis import given, settings, strategies as st

import reference
from reference import flex

TOL = 1e-12


def _bhsd(x):
    return np.swapaxes(x, 1, 2)          # flash-attn's (B, S, H, D) <-> flex's (B, H, S, D)


@st.composite
def problems(draw, square=False):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    B, Hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from((1, 2)))
    L = draw(st.integers(1, 9))
    S = L if square else draw(st.integers(1, 9))
    E = draw(st.sampled_from((1, 4, 8)))
    q = rng.standard_normal((B, Hkv * group, L, E))
    k, v = (rng.standard_normal((B, Hkv, S, E)) for _ in range(2))
    return q, k, v, float(draw(st.sampled_from((0.3, 1.0, 2.5))))


def _attention(q, k, v, scale, **opts):
    out, lse = reference.attention(_bhsd(q), _bhsd(k), _bhsd(v), softmax_scale=scale, **opts)
    return _bhsd(out), lse


@settings(max_examples=40, deadline=None)
@given(p=problems())
def test_no_mods_is_attention(p):
    q, k, v, scale = p
    out, lse = flex.flex_attention(q, k, v, scale=scale, enable_gqa=True, return_lse=True)
    want, want_lse = _attention(q, k, v, scale)
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(lse, want_lse, rtol=TOL, atol=TOL)


@settings(max_examples=40, deadline=None)
@given(p=problems())
def test_top_left_causal_mod_is_the_causal_mask(p):
    q, k, v, scale = p
    L, S = q.shape[2], k.shape[2]
    out, lse = flex.flex_attention(q, k, v, mask_mod=lambda b, h, i, j: i >= j, scale=scale, enable_gqa=True,
                                   return_lse=True)
    want, want_lse = _attention(q, k, v, scale, attn_mask=np.tril(np.ones((L, S), bool)))
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))


@settings(max_examples=40, deadline=None)
@given(p=problems(square=True), left=st.integers(0, 4))
def test_sliding_window_mod_is_the_window(p, left):
    q, k, v, scale = p
    out = flex.flex_attention(q, k, v, mask_mod=lambda b, h, i, j: (i >= j) & (i - j <= left), scale=scale,
                              enable_gqa=True)
    want, _ = _attention(q, k, v, scale, window_size=(left, 0))
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)


@settings(max_examples=40, deadline=None)
@given(p=problems(square=True), cap=st.sampled_from((0.5, 3.0)))
def test_alibi_and_softcap_mods_are_the_options(p, cap):
    q, k, v, scale = p
    H = q.shape[1]
    slopes = 2.0 ** -np.arange(1, H + 1)
    alibi = lambda s, b, h, i, j: s + slopes[h] * (j - i)                     # noqa: E731 (causal: -slope |i - j|)
    out = flex.flex_attention(q, k, v, score_mod=alibi, mask_mod=lambda b, h, i, j: i >= j, scale=scale,
                              enable_gqa=True)
    want, _ = _attention(q, k, v, scale, causal=True, alibi_slopes=slopes)
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)
    softcap = lambda s, b, h, i, j: cap * np.tanh(s / cap)                    # noqa: E731
    out = flex.flex_attention(q, k, v, score_mod=softcap, scale=scale, enable_gqa=True)
    want, _ = _attention(q, k, v, scale, softcap=cap)
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)


def test_element_wise_mods_equal_their_vectorised_twins():
    """A mod with ``if`` and ``math.tanh`` (it fails on arrays) is evaluated element by element."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))

    def causal(b, h, i, j):
        if i >= j:
            return True
        return False

    def softcap(s, b, h, i, j):
        return 2.0 * math.tanh(s / 2.0)
    got = flex.flex_attention(q, k, v, score_mod=softcap, mask_mod=causal)
    want = flex.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: 2.0 * np.tanh(s / 2.0),
                               mask_mod=lambda b, h, i, j: i >= j)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_document_mask_blocks_and_empty_rows():
    """Packed documents (a captured array of document ids): attention within each document only; the block
    states are empty / partial / full exactly as the mask's tiles; a query that sees no key gives out 0 and lse
    -inf."""
    doc = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    mask = lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)                   # noqa: E731
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 1, 10, 4)) for _ in range(3))
    out = flex.flex_attention(q, k, v, mask_mod=mask)
    for d in range(3):
        rows = np.flatnonzero(doc == d)
        want, _ = _attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], 0.5, causal=True)
        np.testing.assert_allclose(out[:, :, rows], want, rtol=TOL, atol=TOL)
    states = flex.block_states(mask, None, None, 10, 10, block_size=(4, 4))
    keep = flex.mod_grid(mask, (1, 1, 10, 10))[0, 0]
    for qb in range(3):
        for kb in range(3):
            tile = keep[qb * 4:(qb + 1) * 4, kb * 4:(kb + 1) * 4]
            want = flex.FULL if tile.all() else flex.PARTIAL if tile.any() else flex.EMPTY
            assert states[0, 0, qb, kb] == want
    assert (states == flex.EMPTY).any() and (states == flex.PARTIAL).any()
    out, lse = flex.flex_attention(q, k, v, mask_mod=lambda b, h, i, j: j > i + 20, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@settings(max_examples=30, deadline=None)
@given(p=problems())
def test_grouped_heads_equal_repeated_heads(p):
    q, k, v, scale = p
    group = q.shape[1] // k.shape[1]
    mod = lambda s, b, h, i, j: s + 0.1 * h - 0.05 * (i - j) ** 2            # noqa: E731
    got = flex.flex_attention(q, k, v, score_mod=mod, scale=scale, enable_gqa=True)
    want = flex.flex_attention(q, np.repeat(k, group, 1), np.repeat(v, group, 1), score_mod=mod, scale=scale)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def _backward(q, k, v, dout, scale, **opts):
    grads = reference.attention_backward(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), softmax_scale=scale, **opts)
    return tuple(_bhsd(g) for g in grads)


@settings(max_examples=30, deadline=None)
@given(p=problems(square=True), cap=st.sampled_from((0.5, 3.0)))
def test_backward_of_the_option_mods_is_the_options_backward(p, cap):
    """The complex-step derivative of the ALiBi and softcap mods gives reference.attention_backward's chain
    rule (softcap's 1 - tanh^2), causal masked."""
    q, k, v, scale = p
    dout = np.random.default_rng(0).standard_normal(q.shape)
    slopes = 2.0 ** -np.arange(1, q.shape[1] + 1)
    causal = lambda b, h, i, j: i >= j                                        # noqa: E731
    alibi = lambda s, b, h, i, j: s + slopes[h] * (j - i)                     # noqa: E731
    got = flex.flex_attention_backward(dout, q, k, v, score_mod=alibi, mask_mod=causal, scale=scale, enable_gqa=True)
    want = _backward(q, k, v, dout, scale, causal=True, alibi_slopes=slopes)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)
    softcap = lambda s, b, h, i, j: cap * np.tanh(s / cap)                    # noqa: E731
    got = flex.flex_attention_backward(dout, q, k, v, score_mod=softcap, scale=scale, enable_gqa=True)
    want = _backward(q, k, v, dout, scale, softcap=cap)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


@settings(max_examples=20, deadline=None)
@given(p=problems())
def test_backward_matches_finite_differences(p):
    """A score_mod of the score and the indices (a relative bias table, a quadratic in the score) and a document
    mask: the backward against central differences of the forward (float64; step 1e-6)."""
    q, k, v, scale = p
    rng = np.random.default_rng(1)
    dout = rng.standard_normal(q.shape)
    table = rng.standard_normal(20)
    mod = lambda s, b, h, i, j: s + 0.1 * s * s + table[np.abs(i - j)]       # noqa: E731
    mask = lambda b, h, i, j: (i // 3 == j // 3) | (j == 0)                  # noqa: E731
    loss = lambda q_, k_, v_: float(np.sum(flex.flex_attention(q_, k_, v_, mod, mask, scale, True) * dout))  # noqa
    grads = flex.flex_attention_backward(dout, q, k, v, mod, mask, scale, True)
    for n, (x, g) in enumerate(zip((q, k, v), grads)):
        idx = tuple(rng.integers(0, m) for m in x.shape)
        xp, xm = x.copy(), x.copy()
        xp[idx] += 1e-6
        xm[idx] -= 1e-6
        args_p, args_m = [q, k, v], [q, k, v]
        args_p[n], args_m[n] = xp, xm
        fd = (loss(*args_p) - loss(*args_m)) / 2e-6
        assert abs(fd - g[idx]) <= 1e-5 * (1 + abs(fd)), (n, idx, fd, g[idx])


def test_a_mod_the_complex_step_cannot_take_needs_its_derivative():
    """``math.tanh`` takes no complex score: the backward asks for ``score_mod_grad``, and with it gives the
    complex step's result for the ``np.tanh`` twin."""
    rng = np.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal((1, 1, 3, 4)) for _ in range(4))
    scalar = lambda s, b, h, i, j: 2.0 * math.tanh(s / 2.0)                  # noqa: E731
    try:
        flex.flex_attention_backward(dout, q, k, v, score_mod=scalar)
    except TypeError as e:
        assert "score_mod_grad" in str(e)
    else:
        raise AssertionError("math.tanh of a complex score was differentiated")
    got = flex.flex_attention_backward(dout, q, k, v, score_mod=scalar,
                                       score_mod_grad=lambda s, b, h, i, j: 1.0 - np.tanh(s / 2.0) ** 2)
    want = flex.flex_attention_backward(dout, q, k, v, score_mod=lambda s, b, h, i, j: 2.0 * np.tanh(s / 2.0))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_a_mod_branching_on_the_indices_is_differentiated_element_wise():
    """``if`` on the indices fails on arrays: the forward and the complex step go element by element, and give
    the vectorised twin's gradients."""
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 2, 4, 4)) for _ in range(4))

    def branchy(s, b, h, i, j):
        if i >= j:
            return s * s * 0.2 + s
        return s - 1.0
    twin = lambda s, b, h, i, j: np.where(i >= j, s * s * 0.2 + s, s - 1.0)   # noqa: E731
    for a, b in zip(flex.flex_attention_backward(dout, q, k, v, score_mod=branchy),
                    flex.flex_attention_backward(dout, q, k, v, score_mod=twin)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(p=problems(), dtype=st.sampled_from((np.float16, np.float32)), mods=st.booleans())
def test_dtype_computes_in_that_precision_close_to_float64(p, dtype, mods):
    """``dtype=``: the flash-attn rule's oracle in the input precision.  Results in that dtype (lse float32 for
    float16), within that precision's rounding of float64's (|s| <= ~10 here: 1e-2 of the scale for float16,
    1e-5 for float32), forward and backward; float64 is the default, bit for bit.  The gradients' bound is the
    rounding of dP and delta (of the order of ``|dout| sum |v|``, which cancel in ``dP - delta``) carried by
    ``scale |k|`` (``|q|``): ``8 u (1 + max |grad| + scale max sum |v| max |q, k|)``, u the dtype's unit roundoff
    (3000 draws: at most 2 u (float16), 4.6 u (float32) of it; the old ``1e-2 (1 + max |grad|)`` failed a CI run by
    1.3x at scale 2.5)."""
    q, k, v, scale = p
    q, k, v = (x.astype(dtype).astype(np.float64) for x in (q, k, v))       # inputs the dtype holds exactly
    kw = dict(scale=scale, enable_gqa=True)
    if mods:
        kw.update(score_mod=lambda s, b, h, i, j: s - 0.25 * abs(i - j), mask_mod=lambda b, h, i, j: i >= j)
    out, lse = flex.flex_attention(q, k, v, return_lse=True, dtype=dtype, **kw)
    out64, lse64 = flex.flex_attention(q, k, v, return_lse=True, **kw)
    same, same_lse = flex.flex_attention(q, k, v, return_lse=True, dtype=np.float64, **kw)
    assert np.array_equal(same, out64) and np.array_equal(same_lse, lse64)
    assert out.dtype == dtype and lse.dtype == np.float32
    tol = 1e-2 if dtype == np.float16 else 1e-5
    fin = np.isfinite(lse64)
    assert np.array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(out, out64, atol=tol * (1 + np.abs(out64).max()), rtol=0)
    np.testing.assert_allclose(lse[fin], lse64[fin], atol=tol * (1 + np.abs(lse64[fin]).max(initial=0)), rtol=0)
    dout = np.ones_like(out64)
    grads = flex.flex_attention_backward(dout, q, k, v, dtype=dtype, **kw)
    u = float(np.finfo(dtype).eps) / 2
    reach = scale * np.abs(v).sum(-1).max() * max(np.abs(q).max(), np.abs(k).max())
    for g, w in zip(grads, flex.flex_attention_backward(dout, q, k, v, **kw)):
        assert g.dtype == dtype
        np.testing.assert_allclose(g, w, atol=8 * u * (1 + np.abs(w).max() + reach), rtol=0)


def test_a_mod_that_drops_the_imaginary_part_is_refused():
    """abs(score) takes a complex score but returns a real number: its complex step would be 0 everywhere.  The
    step is checked against a central difference and the backward asks for ``score_mod_grad``; with it, the
    gradient is the one of sign(score)."""
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((1, 1, 3, 4)) for _ in range(4))
    try:
        flex.flex_attention_backward(dout, q, k, v, score_mod=lambda s, b, h, i, j: abs(s))
    except TypeError as e:
        assert "central difference" in str(e) and "score_mod_grad" in str(e)
    else:
        raise AssertionError("abs(score) was differentiated by the complex step")
    got = flex.flex_attention_backward(dout, q, k, v, score_mod=lambda s, b, h, i, j: abs(s),
                                       score_mod_grad=lambda s, b, h, i, j: np.sign(s))
    want = flex.flex_attention_backward(dout, q, k, v, score_mod=lambda s, b, h, i, j: np.sqrt(s * s + 1e-300))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


BIAS_TABLE = np.linspace(-1.0, 1.0, 17)               # a global a score_mod reads (captured_grads finds it there)


def _global_bias_mod(s, b, h, i, j):
    return s + BIAS_TABLE[np.abs(i - j)]


@settings(max_examples=20, deadline=None)
@given(p=problems())
def test_gradients_into_captured_arrays_match_finite_differences(p):
    """``captured_grads``: the gradient of ``sum(out * dout)`` in arrays the score_mod captures -- a learned
    relative bias per head (closure) scaled by per-head slopes (closure, used nonlinearly with the score), and a
    table read from the module's globals -- against central differences of the forward in single entries (float64;
    step 1e-6), with a document mask; the gradients in q, k, v unchanged by asking."""
    q, k, v, scale = p
    rng = np.random.default_rng(2)
    H, L, S = q.shape[1], q.shape[2], k.shape[2]
    dout = rng.standard_normal(q.shape)
    bias = rng.standard_normal((H, L + S - 1))
    slopes = rng.uniform(0.5, 1.5, H)
    mod = lambda s, b, h, i, j: slopes[h] * s + bias[h, i - j + S - 1]           # noqa: E731
    mask = lambda b, h, i, j: (i // 3 == j // 3) | (j == 0)                       # noqa: E731
    *qkv, grads = flex.flex_attention_backward(dout, q, k, v, mod, mask, scale, True,
                                               captured_grads=("bias", "slopes"))
    for a, b in zip(qkv, flex.flex_attention_backward(dout, q, k, v, mod, mask, scale, True)):
        np.testing.assert_array_equal(a, b)
    assert grads["bias"].shape == bias.shape and grads["slopes"].shape == slopes.shape

    def loss(bias_, slopes_):
        m = lambda s, b, h, i, j: slopes_[h] * s + bias_[h, i - j + S - 1]       # noqa: E731
        return float(np.sum(flex.flex_attention(q, k, v, m, mask, scale, True) * dout))

    for name, table in (("bias", bias), ("slopes", slopes)):
        for _ in range(3):
            idx = tuple(rng.integers(0, m) for m in table.shape)
            tp, tm = table.copy(), table.copy()
            tp[idx] += 1e-6
            tm[idx] -= 1e-6
            fd = ((loss(tp, slopes) - loss(tm, slopes)) if name == "bias"
                  else (loss(bias, tp) - loss(bias, tm))) / 2e-6
            assert abs(fd - grads[name][idx]) <= 1e-5 * (1 + abs(fd)), (name, idx, fd, grads[name][idx])
    *_, g = flex.flex_attention_backward(dout, q, k, v, _global_bias_mod, None, scale, True,
                                         captured_grads=("BIAS_TABLE",))
    table = BIAS_TABLE.copy()
    for d in range(min(L, S, 3)):
        tp, tm = table.copy(), table.copy()
        tp[d] += 1e-6
        tm[d] -= 1e-6
        lp, lm = (float(np.sum(flex.flex_attention(q, k, v, lambda s, b, h, i, j, t=t: s + t[np.abs(i - j)], None,
                                                   scale, True) * dout)) for t in (tp, tm))
        assert abs((lp - lm) / 2e-6 - g["BIAS_TABLE"][d]) <= 1e-5 * (1 + abs(g["BIAS_TABLE"][d]))


def test_an_additive_bias_gets_the_score_gradient_summed_where_it_is_read():
    """For ``s + bias[h, i - j + S - 1]`` the gradient in ``bias`` is dS summed over each diagonal (the
    definition written out); a name the function does not capture, or one that is not an array, is refused."""
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((2, 3, 5, 4)) for _ in range(4))
    S = 5
    bias = rng.standard_normal((3, 2 * S - 1))
    mod = lambda s, b, h, i, j: s + bias[h, i - j + S - 1]                       # noqa: E731
    *_, grads = flex.flex_attention_backward(dout, q, k, v, mod, captured_grads=("bias",))
    scale = 1 / np.sqrt(4)
    s = mod(scale * q @ np.swapaxes(k, -1, -2), *flex._grids(2, 3, 5, S))
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(p * dp, -1, keepdims=True))
    want = np.zeros_like(bias)
    for i in range(5):
        for j in range(S):
            want[:, i - j + S - 1] += ds[:, :, i, j].sum(axis=0)
    np.testing.assert_allclose(grads["bias"], want, rtol=1e-10, atol=1e-12)
    import pytest
    with pytest.raises(ValueError, match="captures no variable 'table'"):
        flex.flex_attention_backward(dout, q, k, v, mod, captured_grads=("table",))
    offset = 4
    with pytest.raises(TypeError, match="not a NumPy array"):
        flex.flex_attention_backward(dout, q, k, v, lambda s, b, h, i, j: s + offset, captured_grads=("offset",))


def _helper_reads(h):
    return BIAS_TABLE[h]


def test_captured_gradients_refuse_what_they_cannot_take():
    """A table whose imaginary part the function drops (``abs`` of an entry, a cast to a real type) is refused
    (the step is checked against a central difference); a name that is an argument (a default argument shadowing
    the array), or read only by a helper the function calls, is refused; a keyword-only default is kept."""
    import pytest
    rng = np.random.default_rng(4)
    q, k, v, dout = (rng.standard_normal((1, 2, 3, 4)) for _ in range(4))
    t = np.array([0.5, -1.5])
    for mod in (lambda s, b, h, i, j: abs(t[h]) * s, lambda s, b, h, i, j: np.float64(t[h].real) * s):
        with pytest.raises(TypeError, match="'t'"):
            flex.flex_attention_backward(dout, q, k, v, mod, captured_grads=("t",))
    with pytest.raises(ValueError, match="argument or local variable 't'"):
        flex.flex_attention_backward(dout, q, k, v, lambda s, b, h, i, j, t=t: t[h] * s, captured_grads=("t",))
    with pytest.raises(ValueError, match="helpers it calls are not followed"):
        flex.flex_attention_backward(dout, q, k, v, lambda s, b, h, i, j: _helper_reads(h) * s,
                                     captured_grads=("BIAS_TABLE",))

    def keyword(s, b, h, i, j, *, shift=0.25):
        return t[h] * s + shift

    *_, grads = flex.flex_attention_backward(dout, q, k, v, keyword, captured_grads=("t",))
    assert grads["t"].shape == t.shape and np.all(np.isfinite(grads["t"]))
