"""Edge cases of the kernels, each against the float64 oracle (tolerances: kernel_harness's docstring).

Empty sequences (seqlen_q = 0: empty outputs, zero dK/dV; seqlen_k = 0: out = 0,
lse = -inf, zero dQ), seqlen 1, rows and whole batches that see no key (out =
0, lse = -inf, zero gradients, never NaN) by every masking mechanism, huge
scores (q scaled by 1e4: exp overflow in code that forgets the max), head dim
1, MQA (nheads_k = 1), one query against many keys, and NaN inputs, whose NaN
must reach exactly the outputs the oracle says.
"""
import dataclasses
import types

import numpy as np
import pytest

import strategies as S
from kernel_harness import (LONG_KEYS, SIMULATOR, check_backward, check_forward, expected, kernel_backward,
                            kernel_forward, poison_outputs)  # noqa: F401 (autouse fixture)

DTYPES = [np.float64, np.float32, np.float16]
DT_IDS = ["f64", "f32", "f16"]


def problem(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype=np.float64, block_q=4, block_k=4,
            q_scale=1.0, seed=0, **opts):
    rng = np.random.default_rng(seed)

    def normal(*shape, factor=1.0):
        return (rng.standard_normal(shape) * factor).astype(dtype)

    return S.Problem(q=normal(batch, seqlen_q, nheads, headdim, factor=q_scale),
                     k=normal(batch, seqlen_k, nheads_k, headdim), v=normal(batch, seqlen_k, nheads_k, headdim),
                     dout=normal(batch, seqlen_q, nheads, headdim), opts=types.MappingProxyType(opts),
                     block_q=block_q, block_k=block_k, data_seed=seed)


def forward_backward_match(p, deterministic=False):
    """Kernel forward + backward (fed the kernel's out, lse) against the oracle; returns the kernel results."""
    exp = expected(p)
    out, lse = kernel_forward(p)
    check_forward(exp, out, lse)
    grads = kernel_backward(p, out, lse, deterministic=deterministic)
    check_backward(exp, grads)
    return out, lse, grads


# ---------------------------------------------------------------------------------- empty sequences
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("seqlen_k", [0, 5])
def test_seqlen_q_zero_gives_empty_outputs_and_zero_dk_dv(dtype, seqlen_k):
    p = problem(2, 0, seqlen_k, 2, 1, 3, dtype)
    out, lse, (dq, dk, dv) = forward_backward_match(p)
    assert out.shape == (2, 0, 2, 3) and lse.shape == (2, 2, 0) and dq.shape == (2, 0, 2, 3)
    assert dk.shape == dv.shape == (2, seqlen_k, 1, 3)
    assert not np.any(dk) and not np.any(dv), "no query: dK and dV must be exactly zero"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_seqlen_k_zero_gives_zero_out_neginf_lse_zero_dq(dtype, deterministic):
    p = problem(2, 5, 0, 2, 2, 3, dtype, block_q=8, block_k=2, causal=True)
    out, lse, (dq, dk, dv) = forward_backward_match(p, deterministic)
    assert np.all(out == 0), "no key: out must be exactly 0"
    assert np.all(np.isneginf(lse)), "no key: lse must be -inf"
    assert np.all(dq == 0), "no key: dQ must be exactly 0"
    assert dk.shape == dv.shape == (2, 0, 2, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_batch_zero(dtype):
    p = problem(0, 4, 3, 2, 1, 3, dtype)
    out, lse, grads = forward_backward_match(p)
    assert out.shape == (0, 4, 2, 3) and lse.shape == (0, 2, 4)
    assert [g.shape for g in grads] == [(0, 4, 2, 3), (0, 3, 1, 3), (0, 3, 1, 3)]


# ---------------------------------------------------------------------------------- length 1
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("seqlens,causal", [((1, 1), False), ((1, 1), True), ((1, 7), True), ((7, 1), False),
                                            ((7, 1), True)], ids=["q1k1", "q1k1_causal", "q1k7_causal", "q7k1",
                                                                  "q7k1_causal"])
def test_sequence_length_one(dtype, seqlens, causal):
    """One query or one key (causal: q7k1 leaves rows 0..5 with no key, q1k7 lets the query see every key)."""
    p = problem(2, seqlens[0], seqlens[1], 2, 2, 4, dtype, block_q=4, block_k=4, causal=causal)
    out, lse, _ = forward_backward_match(p)
    if seqlens[1] == 1 and not causal:
        # one key: softmax = 1 exactly, so out = v in every row
        np.testing.assert_array_equal(out, np.broadcast_to(p.v, out.shape).astype(out.dtype))


# ---------------------------------------------------------------------------------- rows that see no key
def _masked_rows_cases():
    """(id, shape kwargs, options, boolean (batch, nheads, seqlen_q) of rows that see no key)."""
    b, h, sq, sk = 2, 2, 7, 5
    rows = np.zeros((b, h, sq), bool)
    mask = np.ones((b, h, sq, sk), bool)
    mask[0, 1, [0, 3, 6]] = False
    mask[1, 0, 2] = False
    r = rows.copy()
    r[0, 1, [0, 3, 6]] = True
    r[1, 0, 2] = True
    yield "attn_mask_rows", dict(attn_mask=mask), r
    batch_mask = np.ones((b, 1, 1, sk), bool)
    batch_mask[1] = False                                # a whole batch masked
    r = rows.copy()
    r[1] = True
    yield "attn_mask_whole_batch", dict(attn_mask=batch_mask), r
    # causal with seqlen_q > seqlen_k: query i sees j <= i - 2, so rows 0, 1 see nothing
    r = rows.copy()
    r[:, :, :2] = True
    yield "causal_top_rows", dict(causal=True), r
    # window (0, 0): query i sees only key i + off = i - 2
    yield "window_diagonal", dict(window_size=(0, 0)), r
    # window (1, -1) with causal: rows 0, 1 see nothing, others up to 2 keys
    yield "window_left_and_causal", dict(window_size=(1, -1), causal=True), r
    bm = np.ones((b, h, 3, 2), bool)                     # block_mask_size (3, 3): 3 x 2 blocks
    bm[0, 0, 1, :] = False                               # rows 3..5 of (0, 0)
    bm[1] = False                                        # the whole of batch 1
    r = rows.copy()
    r[0, 0, 3:6] = True
    r[1] = True
    yield "block_mask", dict(block_mask=bm, block_mask_size=(3, 3)), r


MASKED = list(_masked_rows_cases())


EXTRA = {"dropout_p": 0.3, "seed": 5, "alibi_slopes": np.array([0.5, 0.25]), "softcap": 3.0}


@pytest.mark.parametrize("case", MASKED, ids=[c[0] for c in MASKED])
@pytest.mark.parametrize("dtype,extra", [(np.float64, {}), (np.float32, EXTRA), (np.float16, {}),
                                         (np.float16, EXTRA)],
                         ids=["f64", "f32_dropout_alibi_softcap", "f16", "f16_dropout_alibi_softcap"])
def test_rows_that_see_no_key_give_zero_out_neginf_lse_zero_grads(case, dtype, extra):
    _, opts, dead = case
    p = problem(2, 7, 5, 2, 1, 3, dtype, block_q=4, block_k=4, q_scale=3.0, **opts, **extra)
    out, lse, (dq, dk, dv) = forward_backward_match(p, deterministic=bool(extra))
    dead_bih = dead.transpose(0, 2, 1)                   # (batch, seqlen_q, nheads)
    assert np.all(out[dead_bih] == 0), "a row that sees no key must give out = 0 exactly"
    assert np.all(np.isneginf(lse[dead])) and np.all(np.isfinite(lse[~dead])), "lse = -inf exactly on dead rows"
    assert np.all(dq[dead_bih] == 0), "a row that sees no key must give dQ = 0 exactly"
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not np.isnan(x).any(), f"{name}: NaN"


# ---------------------------------------------------------------------------------- huge scores
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("opts", [{}, {"causal": True}, {"softcap": 20.0, "window_size": (3, 1)}],
                         ids=["plain", "causal", "softcap_window"])
def test_huge_scores_no_overflow(dtype, opts):
    """q scaled by 1e4: scores ~ +-1e4 (exp overflows without the running max); partial tiles at both ends."""
    p = problem(1, 6, 7, 2, 1, 4, dtype, block_q=4, block_k=2, q_scale=1e4, seed=3, **opts)
    out, lse, grads = forward_backward_match(p)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads)):
        assert not np.isnan(x).any() and not np.isposinf(x).any(), f"{name}: NaN or +inf"


def test_huge_negative_lse_with_padded_key_tile():
    """Every score ~ -800 and a key tile longer than the keys: the padding must not overflow exp (lse ~ -800)."""
    q = np.full((1, 1, 1, 1), 800.0)
    k = np.full((1, 1, 1, 1), -1.0)
    p = S.Problem(q=q, k=k, v=np.ones_like(k), dout=np.ones_like(q), opts=types.MappingProxyType({}),
                  block_q=1, block_k=2)
    forward_backward_match(p)


# ---------------------------------------------------------------------------------- small head dims, MQA, long keys
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("opts", [{}, {"causal": True, "dropout_p": 0.2, "seed": 2**40 + 3}],
                         ids=["plain", "causal_dropout"])
def test_head_dim_one(dtype, opts):
    forward_backward_match(problem(2, 5, 6, 2, 2, 1, dtype, block_q=2, block_k=4, **opts))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_multi_query_attention_one_kv_head(dtype, deterministic):
    """nheads_k = 1: every query head reads the same k, v; dK, dV sum over all query heads."""
    nheads = 3 if SIMULATOR else 8
    p = problem(2, 6, 5, nheads, 1, 3, dtype, block_q=8, block_k=4, causal=True,
                alibi_slopes=np.linspace(0.1, 1.0, nheads))
    forward_backward_match(p, deterministic)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("opts", [{}, {"causal": True}, {"window_size": (9, 0)}], ids=["plain", "causal", "window"])
def test_single_query_against_long_keys(dtype, opts):
    """seqlen_q = 1, seqlen_k long: many key tiles for one query tile (and causal sees every key: off = n - 1)."""
    headdim = 4 if SIMULATOR else 128
    block_k = 16 if SIMULATOR else None
    forward_backward_match(problem(1, 1, LONG_KEYS + 3, 2, 1, headdim, dtype, block_q=1 if SIMULATOR else None,
                                   block_k=block_k, **opts))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("side", [2**62, 2**63 - 1, 2**64 + 3])
@pytest.mark.parametrize("causal", [False, True])
def test_window_sides_beyond_the_sequence_bound_nothing(dtype, side, causal):
    """A window side of any size (up to and past int64's range) masks like an unbounded one. The sides are
    clamped to max(seqlen_q, seqlen_k) before any launch (near 2^63 they wrapped around in the kernels' 64-bit
    arithmetic and masked every key on a GPU; past 2^63 they did not fit a kernel argument), and then dropped
    as the sides that bound nothing are (``test_window_sides_that_bound_nothing_are_dropped``)."""
    from flashnb import _options
    opts = _options.normalise(batch=1, seqlen_q=21, seqlen_k=19, nheads=2, headdim=4, acc=np.float32, stream=None,
                              window_size=(side, side), causal=causal)
    assert (opts.left, opts.right) == (-1, 0 if causal else -1), (opts.left, opts.right)
    headdim = 4 if SIMULATOR else 64
    base = problem(1, 21, 19, 2, 1, headdim, dtype, block_q=4 if SIMULATOR else None,
                   block_k=4 if SIMULATOR else None, causal=causal)
    huge = dataclasses.replace(base, opts=types.MappingProxyType(dict(base.opts, window_size=(side, side))))
    exp = expected(base)                             # the oracle of the unbounded window
    out, lse = kernel_forward(huge)
    check_forward(exp, out, lse)
    check_backward(exp, kernel_backward(huge, out, lse))


@pytest.mark.parametrize("seqlen_q, seqlen_k, window, causal, want", [
    (1, 100, (-1, -1), True, (-1, -1)),       # a decoding step's causal mask: the one row sees every key
    (3, 100, (-1, -1), True, (-1, 0)),        # three rows: the first two do not see the last keys
    (3, 100, (-1, 2), False, (-1, -1)),       # right >= seqlen_q - 1: nothing bounded
    (3, 100, (-1, 1), False, (-1, 1)),
    (3, 100, (99, -1), False, (-1, -1)),      # left >= seqlen_k - 1: nothing bounded
    (3, 100, (98, -1), False, (98, -1)),
    (5, 3, (-1, -1), True, (-1, 0)),          # seqlen_q > seqlen_k: the first rows see no key
])
def test_window_sides_that_bound_nothing_are_dropped(seqlen_q, seqlen_k, window, causal, want):
    """``normalise`` drops a window side that masks no key of any row (bottom-right aligned: row i sees keys
    ``i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right``), so that the kernels compile no
    window check for it; the sides it keeps bound at least one key (the oracle's masks say which)."""
    from flashnb import _options
    opts = _options.normalise(batch=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=1, headdim=4, acc=np.float32,
                              stream=None, window_size=window, causal=causal)
    assert (opts.left, opts.right) == want
    assert opts.flags.has_window == (want != (-1, -1))
    i, j = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
    off = seqlen_k - seqlen_q
    if want[0] >= 0:
        assert (j < i + off - want[0]).any(), "the kept left side bounds no key"
    if want[1] >= 0:
        assert (j > i + off + want[1]).any(), "the kept right side bounds no key"


# ---------------------------------------------------------------------------------- NaN inputs
def _nan_cases():
    # (id, tensor, index to poison, options): the oracle decides which outputs become NaN
    yield "q_row", "q", (1, 2, 0, slice(None)), {}
    yield "q_one_dim_causal", "q", (0, 4, 1, 2), {"causal": True}
    yield "k_row", "k", (1, 3, 0, slice(None)), {}
    yield "k_row_causal", "k", (0, 3, 0, slice(None)), {"causal": True}
    yield "v_one_dim", "v", (0, 2, 0, 1), {}


NAN_CASES = list(_nan_cases())


@pytest.mark.parametrize("case", NAN_CASES, ids=[c[0] for c in NAN_CASES])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_nan_input_reaches_exactly_the_outputs_the_oracle_says(case, dtype):
    name, tensor, index, opts = case
    p = problem(2, 6, 6, 2, 1, 3, dtype, block_q=4, block_k=2, seed=7, **opts)
    poisoned = getattr(p, tensor).copy()
    poisoned[index] = np.nan
    p = dataclasses.replace(p, **{tensor: poisoned})
    exp = expected(p, backward=False)
    nan_out, nan_lse = np.isnan(exp.out), np.isnan(exp.lse)
    assert nan_out.any() and not nan_out.all(), "test set-up: the oracle should have some NaN and some finite"
    out, lse = kernel_forward(p)
    np.testing.assert_array_equal(np.isnan(out), nan_out, err_msg=f"{name}: out is NaN exactly where the oracle is")
    np.testing.assert_array_equal(np.isnan(lse), nan_lse, err_msg=f"{name}: lse is NaN exactly where the oracle is")
    scale = exp.mags["out"]
    fin = ~nan_out
    err = np.max(np.abs(out[fin].astype(np.float64) - exp.out[fin]))
    # magnitudes of a NaN problem are NaN: bound the finite part by max |v| (out is a convex combination of v)
    bound = 1e-10 if dtype == np.float64 else 1e-4
    assert np.isnan(scale) or err <= bound * scale or err <= bound * np.nanmax(np.abs(p.v)), \
        f"{name}: finite entries off by {err:.3g}"
