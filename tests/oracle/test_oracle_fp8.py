"""The FP8 oracle (``reference.fp8``).

Checked here:
- the e4m3 table against the format's definition, value by value where it matters;
- the quantiser: nearest value, ties to the even code, saturation or PyTorch's NaN, sign, descaling. Where
  torch is installed it is also checked against PyTorch's own cast on every tie and 200k random floats;
- ``fp8_attention``: attention of the dequantised inputs, with per-tensor and per-(batch, key/value head)
  descaling and grouped heads;
- the two error bounds, on random and outlier-heavy data, with and without a causal mask. Each must hold, and
  neither may be vacuous: each is within a modest factor of the error it bounds.
Shapes and data come from Hypothesis.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import reference
from reference import fp8

P = fp8._POSITIVE


def test_the_table_is_the_format():
    t = fp8.e4m3_table()
    known = {0x00: 0.0, 0x01: 2.0 ** -9, 0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x38: 1.0, 0x39: 1.125,
             0x40: 2.0, 0x7E: 448.0, 0x80: -0.0, 0xB8: -1.0, 0xFE: -448.0}
    for code, value in known.items():
        assert t[code] == value and np.signbit(t[code]) == np.signbit(value), hex(code)
    assert np.isnan(t[0x7F]) and np.isnan(t[0xFF]) and np.isnan(t).sum() == 2
    assert np.all(np.diff(P) > 0) and len(P) == 127                       # 0x00-0x7E increase
    assert np.array_equal(t[0x80:0xFF], -t[0x00:0x7F])                    # sign-magnitude


def test_representable_values_round_trip_and_ties_go_to_the_even_code():
    codes = np.arange(0x7F, dtype=np.uint8)
    assert np.array_equal(fp8.quantize_e4m3(P), codes)
    assert np.array_equal(fp8.quantize_e4m3(-P), codes | 0x80)
    mid = (P[1:] + P[:-1]) / 2                                             # every tie between neighbours
    got = fp8.quantize_e4m3(mid)
    lower = np.arange(0x7E)
    assert np.array_equal(got, np.where(lower % 2 == 0, lower, lower + 1))
    above, below = np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)   # off a tie: the nearer one
    assert np.array_equal(fp8.quantize_e4m3(above), lower + 1)
    assert np.array_equal(fp8.quantize_e4m3(below), lower)


def test_beyond_the_range():
    big = np.array([448.0, 450.0, 464.0, 465.0, 1e30, np.inf])
    assert np.all(fp8.dequantize_e4m3(fp8.quantize_e4m3(big)) == 448.0)          # saturating: the kernels'
    assert np.all(fp8.dequantize_e4m3(fp8.quantize_e4m3(-big)) == -448.0)
    torch_like = fp8.dequantize_e4m3(fp8.quantize_e4m3(big, saturate=False))
    assert np.array_equal(torch_like[:3], [448.0, 448.0, 448.0]) and np.all(np.isnan(torch_like[3:]))
    assert np.isnan(fp8.dequantize_e4m3(fp8.quantize_e4m3(np.array([np.nan])))).all()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), log_descale=st.floats(-8, 8), spread=st.floats(1, 14))
def test_nearest_value_within_half_a_step(seed, log_descale, spread):
    rng = np.random.default_rng(seed)
    descale = 2.0 ** log_descale * rng.uniform(0.5, 2.0)
    x = rng.standard_normal(500) * np.exp(rng.uniform(-spread, spread, 500)) * descale
    back = fp8.dequantize_e4m3(fp8.quantize_e4m3(x, descale), descale)
    err = np.abs(back - x)
    bound = fp8.rounding_bound(x, descale)
    assert np.all(err <= bound * (1 + 1e-12)), np.max(err / bound)
    inside = np.abs(x) <= fp8.E4M3_MAX * descale
    # nearest: no representable value is closer (sign-symmetric, so compare magnitudes)
    grid = P * descale
    nearest = np.min(np.abs(np.abs(x[inside])[:, None] - grid[None, :]), axis=1)
    assert np.allclose(np.abs(np.abs(back[inside]) - np.abs(x[inside])), nearest, rtol=0, atol=1e-300)
    assert np.array_equal(np.signbit(back), np.signbit(x))
    assert np.array_equal(fp8.quantize_e4m3(x, descale), fp8.quantize_e4m3(x / descale))


def test_matches_pytorchs_cast():
    torch = pytest.importorskip("torch")      # CI has no torch; the tests above hold the format on their own
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-12, 7, 200_000))).astype(np.float32).astype(np.float64)
    mid = (P[1:] + P[:-1]) / 2
    x = np.concatenate([x, P, -P, mid, -mid, [455.0, 464.0, 465.0, 479.0, 480.0, 1e9, np.inf, -np.inf, -0.0]])
    theirs = torch.from_numpy(x).to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    ours = fp8.quantize_e4m3(x, saturate=False)
    both_nan = np.isnan(fp8.dequantize_e4m3(ours)) & np.isnan(fp8.dequantize_e4m3(theirs))
    assert np.all((ours == theirs) | both_nan)


def test_the_p_bound_refuses_a_descale_that_saturates():
    """Below 1/448, P = 1 / p_descale passes 448 and saturates: the bound's premise fails, so it refuses; the
    algorithm (a model of the kernel) still runs and shows the saturation error the bound would miss."""
    q, k, v = (np.ones((1, 1, 1, 4)) for _ in range(3))
    with pytest.raises(ValueError, match="p_descale must be at least 1/448"):
        fp8.p_quantization_bound(q, k, v, 1 / 1000)
    codes = [fp8.quantize_e4m3(x) for x in (q, k, v)]
    out, _ = fp8.fp8_flash_forward(*codes, p_descale=1 / 1000)
    assert abs(out[0, 0, 0, 0] - 0.448) < 1e-12             # P = 1 saturated to 448 / 1000


def test_bad_input():
    with pytest.raises(TypeError, match="codes"):
        fp8.dequantize_e4m3(np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="descaling"):
        fp8.quantize_e4m3(np.ones(3), 0.0)
    with pytest.raises(ValueError, match="batch, nheads_k"):
        fp8.fp8_attention(*(np.zeros((2, 3, 2, 4), np.uint8),) * 3, q_descale=np.ones((2, 3)))


@st.composite
def problems(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    B, Hk, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from((1, 2)))
    L, S, d = draw(st.integers(1, 12)), draw(st.integers(1, 12)), draw(st.sampled_from((4, 8, 16)))
    outliers = draw(st.booleans())

    def data(shape):
        x = rng.standard_normal(shape)
        if outliers:                           # a few entries 20-200x the rest, as in trained activations
            hit = rng.random(shape) < 0.02
            x = np.where(hit, x * rng.uniform(20, 200, shape), x)
        return x

    q, k, v = data((B, L, Hk * group, d)), data((B, S, Hk, d)), data((B, S, Hk, d))
    per_head = draw(st.booleans())
    descales = []
    for x, heads in ((q, Hk * group), (k, Hk), (v, Hk)):
        amax = np.abs(x).reshape(B, -1, heads, d).max(axis=(1, 3)) / fp8.E4M3_MAX      # (B, heads): no saturation
        if per_head:
            descales.append(amax.reshape(B, Hk, -1).max(axis=2))                       # per (batch, kv head)
        else:
            descales.append(float(amax.max()))
    causal = draw(st.booleans())
    return q, k, v, descales, causal, draw(st.sampled_from((None, 0.3)))


def _quantize(x, descale, group=1):
    d = descale if np.ndim(descale) == 0 else np.repeat(descale, group, axis=1)[:, None, :, None]
    return fp8.quantize_e4m3(x, d)


@settings(max_examples=50, deadline=None)
@given(p=problems())
def test_fp8_attention_is_attention_of_the_dequantised_inputs(p):
    q, k, v, (dq, dk, dv), causal, scale = p
    group = q.shape[2] // k.shape[2]
    q8, k8, v8 = _quantize(q, dq, group), _quantize(k, dk), _quantize(v, dv)
    out, lse = fp8.fp8_attention(q8, k8, v8, dq, dk, dv, causal=causal, softmax_scale=scale)

    def deq(codes, descale, g=1):
        d = descale if np.ndim(descale) == 0 else np.repeat(descale, g, axis=1)[:, None, :, None]
        return fp8.dequantize_e4m3(codes) * d

    want, want_lse = reference.attention(deq(q8, dq, group), deq(k8, dk), deq(v8, dv), causal=causal,
                                         softmax_scale=scale)
    assert np.array_equal(out, want) and np.array_equal(lse, want_lse)


@settings(max_examples=60, deadline=None)
@given(p=problems())
def test_the_input_quantisation_bound_holds(p):
    q, k, v, (dq, dk, dv), causal, scale = p
    group = q.shape[2] // k.shape[2]
    out8, _ = fp8.fp8_attention(_quantize(q, dq, group), _quantize(k, dk), _quantize(v, dv), dq, dk, dv,
                                causal=causal, softmax_scale=scale)
    out, _ = reference.attention(q, k, v, causal=causal, softmax_scale=scale)
    bound = fp8.input_quantization_bound(q, k, v, dq, dk, dv, softmax_scale=scale)
    err = np.abs(out8 - out)
    assert np.all(err <= bound * (1 + 1e-9) + 1e-12), np.max(err - bound)


def _fa3_p_quantised(q, k, v, p_descale, causal, scale):
    """FA3's forward with P quantised, one tile of every key: P = exp(s - rowmax) quantised with ``p_descale``,
    out = deq(P) V / l with l from the unquantised P (float64)."""
    probs = reference.attention_probs(q, k, v, causal=causal, softmax_scale=scale)      # normalised
    peak = probs.max(axis=-1, keepdims=True)
    unnormalised = np.where(peak > 0, probs / np.where(peak > 0, peak, 1.0), 0.0)      # exp(s - max) <= 1
    rounded = fp8.dequantize_e4m3(fp8.quantize_e4m3(unnormalised, p_descale), p_descale)
    group = q.shape[2] // k.shape[2]
    v_r = np.repeat(v, group, axis=2).transpose(0, 2, 1, 3)
    out = (rounded @ v_r) * peak                    # / l, and 1 / l is the peak of the normalised P
    return out.transpose(0, 2, 1, 3)


@settings(max_examples=60, deadline=None)
@given(p=problems(), p_descale=st.sampled_from((1.0, 1.0 / 448, 1.0 / 16)))
def test_the_p_quantisation_bound_holds(p, p_descale):
    q, k, v, _, causal, scale = p
    out, _ = reference.attention(q, k, v, causal=causal, softmax_scale=scale)
    got = _fa3_p_quantised(q, k, v, p_descale, causal, scale)
    bound = fp8.p_quantization_bound(q, k, v, p_descale, softmax_scale=scale, causal=causal)
    err = np.abs(got - out)
    assert np.all(err <= bound * (1 + 1e-9) + 1e-12), np.max(err - bound)
    # not vacuous: quantising P costs at most 2^-4 of the largest value plus the subnormal steps' share
    cap = (fp8.E4M3_UNIT_ROUNDOFF + k.shape[1] * fp8.E4M3_SUBNORMAL_HALF_STEP * p_descale) * np.abs(v).max()
    assert np.all(bound <= cap * (1 + 1e-12))


def test_the_input_bound_is_useful_where_scores_move_little():
    """The input bound is a worst case: it grows with ``|q| |k| headdim`` (a sum of same-signed rounding
    errors) and is vacuous for large scores. Where the scores move little, it is a small fraction of the
    values: here below a tenth of max |v|, and above the error it bounds."""
    rng = np.random.default_rng(7)
    q, k = (0.1 * rng.standard_normal((2, 16, 4, 16)) for _ in range(2))
    v = rng.standard_normal((2, 16, 4, 16))
    ds = [np.abs(x).max() / fp8.E4M3_MAX for x in (q, k, v)]
    bound = fp8.input_quantization_bound(q, k, v, *ds)
    out8, _ = fp8.fp8_attention(*(fp8.quantize_e4m3(x, d) for x, d in zip((q, k, v), ds)), *ds, causal=True)
    out, _ = reference.attention(q, k, v, causal=True)
    assert np.max(bound) < 0.1 * np.abs(v).max()
    assert np.all(np.abs(out8 - out) <= bound)


@settings(max_examples=60, deadline=None)
@given(p=problems(), p_descale=st.sampled_from((1.0, 1.0 / 448, 1.0 / 16)), block_k=st.integers(1, 7))
def test_the_fa3_algorithm_stays_within_the_p_bound(p, p_descale, block_k):
    """The online softmax quantises each tile's P against the running max: the bound derived for the final max
    still holds (the argument in its docstring), for any tile size; lse, from the unquantised P, is the
    oracle's."""
    q, k, v, (dq, dk, dv), causal, scale = p
    group = q.shape[2] // k.shape[2]
    q8, k8, v8 = _quantize(q, dq, group), _quantize(k, dk), _quantize(v, dv)
    out, lse = fp8.fp8_flash_forward(q8, k8, v8, dq, dk, dv, p_descale, block_k, causal=causal, softmax_scale=scale)
    want, want_lse = fp8.fp8_attention(q8, k8, v8, dq, dk, dv, causal=causal, softmax_scale=scale)
    qd, kd, vd = fp8._dequantize_inputs(q8, k8, v8, dq, dk, dv)
    bound = fp8.p_quantization_bound(qd, kd, vd, p_descale, softmax_scale=scale, causal=causal)
    assert np.all(np.abs(out - want) <= bound * (1 + 1e-9) + 1e-12), np.max(np.abs(out - want) - bound)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)      # l from the unquantised P


@settings(max_examples=30, deadline=None)
@given(p=problems(), block_q=st.integers(1, 5), block_k=st.integers(1, 5), tile=st.integers(1, 7))
def test_the_fa3_algorithm_with_block_descales(p, block_q, block_k, tile):
    """``fp8_flash_forward`` with block descales (``descale_block_q``, ``descale_block_k``) against
    ``fp8_attention`` of the same blocks: within the P bound of the blocks' dequantised inputs, lse the oracle's;
    descales equal across the blocks give the per-(batch, head) call's result exactly."""
    q, k, v, _, causal, scale = p
    (q8, dq), (k8, dk), (v8, dv) = (fp8.quantize_blocks_e4m3(x, b) for x, b in ((q, block_q), (k, block_k),
                                                                                 (v, block_k)))
    blocks = dict(descale_block_q=block_q, descale_block_k=block_k)
    out, lse = fp8.fp8_flash_forward(q8, k8, v8, dq, dk, dv, 1.0, tile, causal=causal, softmax_scale=scale, **blocks)
    want, want_lse = fp8.fp8_attention(q8, k8, v8, dq, dk, dv, block_q=block_q, block_k=block_k, causal=causal,
                                       softmax_scale=scale)
    qd, kd, vd = fp8._dequantize_inputs(q8, k8, v8, dq, dk, dv, block_q, block_k)
    bound = fp8.p_quantization_bound(qd, kd, vd, 1.0, softmax_scale=scale, causal=causal)
    assert np.all(np.abs(out - want) <= bound * (1 + 1e-9) + 1e-12), np.max(np.abs(out - want) - bound)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    B, Hq, Hk = q.shape[0], q.shape[2], k.shape[2]
    per_q, per_kv = (np.random.default_rng(6).uniform(0.5, 2, (B, Hk)) for _ in range(2))
    blocks_q = np.repeat(np.repeat(per_q, Hq // Hk, axis=1)[..., None], -(-q.shape[1] // block_q), axis=2)
    blocks_k = np.repeat(per_kv[..., None], -(-k.shape[1] // block_k), axis=2)
    a = fp8.fp8_flash_forward(q8, k8, v8, blocks_q, blocks_k, blocks_k, 1.0, tile, causal=causal,
                              softmax_scale=scale, **blocks)
    b = fp8.fp8_flash_forward(q8, k8, v8, per_q, per_kv, per_kv, 1.0, tile, causal=causal, softmax_scale=scale)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_the_fa3_algorithm_quantises_p():
    """Not the unquantised attention: on data whose probabilities are not e4m3 values the outputs differ."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 6, 2, 8)) for _ in range(3))
    codes = [fp8.quantize_e4m3(x, np.abs(x).max() / fp8.E4M3_MAX) for x in (q, k, v)]
    ds = [np.abs(x).max() / fp8.E4M3_MAX for x in (q, k, v)]
    out, _ = fp8.fp8_flash_forward(*codes, *ds, block_k=2)
    want, _ = fp8.fp8_attention(*codes, *ds)
    assert 1e-4 < np.abs(out - want).max() < 0.1


@settings(max_examples=40, deadline=None)
@given(p=problems(), block_q=st.integers(1, 5), block_k=st.integers(1, 5))
def test_block_quantisation(p, block_q, block_k):
    """FA3's block quantisation (``quantize_blocks_e4m3``): a descale per (batch, head, block of rows), the block's
    largest magnitude over 448, so no entry saturates and each entry is within ``rounding_bound`` of its block's
    descale, at most the per-tensor one's; ``fp8_attention`` with ``block_q`` / ``block_k`` is attention of the
    blocks' dequantised values; the input bound holds with the block descales and is no larger than with one
    descale per tensor."""
    q, k, v, _, causal, scale = p
    (q8, dq), (k8, dk), (v8, dv) = (fp8.quantize_blocks_e4m3(x, b) for x, b in ((q, block_q), (k, block_k),
                                                                                 (v, block_k)))
    for x, codes, d, block in ((q, q8, dq, block_q), (k, k8, dk, block_k), (v, v8, dv, block_k)):
        B, L, H, _ = x.shape
        assert d.shape == (B, H, -(-L // block)) and np.all(d > 0)
        rows = np.repeat(d, block, axis=2)[:, :, :L].transpose(0, 2, 1)[..., None]    # each row's descale
        back = fp8.dequantize_e4m3(codes) * rows
        assert np.all(np.abs(back - x) <= fp8.rounding_bound(x, rows) * (1 + 1e-12))
        assert np.all(np.abs(fp8.dequantize_e4m3(codes)) <= fp8.E4M3_MAX)
        whole = np.abs(x).max() / fp8.E4M3_MAX
        assert np.all(rows <= whole * (1 + 1e-15) + (whole == 0))
    out, lse = fp8.fp8_attention(q8, k8, v8, dq, dk, dv, block_q=block_q, block_k=block_k, causal=causal,
                                 softmax_scale=scale)

    def deq(codes, d, block):
        return fp8.dequantize_e4m3(codes) * np.repeat(d, block, axis=2)[:, :, :codes.shape[1]].transpose(0, 2, 1)[
            ..., None]

    want, want_lse = reference.attention(deq(q8, dq, block_q), deq(k8, dk, block_k), deq(v8, dv, block_k),
                                         causal=causal, softmax_scale=scale)
    assert np.array_equal(out, want) and np.array_equal(lse, want_lse)
    exact, _ = reference.attention(q, k, v, causal=causal, softmax_scale=scale)
    bound = fp8.input_quantization_bound(q, k, v, dq, dk, dv, softmax_scale=scale, block_q=block_q, block_k=block_k)
    assert np.all(np.abs(out - exact) <= bound * (1 + 1e-9) + 1e-12)
    tensor = [np.abs(x).max() / fp8.E4M3_MAX or 1.0 for x in (q, k, v)]
    assert np.all(bound <= fp8.input_quantization_bound(q, k, v, *tensor, softmax_scale=scale) * (1 + 1e-9) + 1e-15)
    # descales equal across the blocks give the per-(batch, head) path's bound exactly (the rows' expansion)
    B, Hq, Hk = q.shape[0], q.shape[2], k.shape[2]
    per_q, per_kv = (np.random.default_rng(5).uniform(0.5, 2, (B, Hk)) for _ in range(2))
    blocks_q = np.repeat(np.repeat(per_q, Hq // Hk, axis=1)[..., None], -(-q.shape[1] // block_q), axis=2)
    blocks_k = np.repeat(per_kv[..., None], -(-k.shape[1] // block_k), axis=2)
    assert np.array_equal(
        fp8.input_quantization_bound(q, k, v, blocks_q, blocks_k, blocks_k, softmax_scale=scale, block_q=block_q,
                                     block_k=block_k),
        fp8.input_quantization_bound(q, k, v, per_q, per_kv, per_kv, softmax_scale=scale))


def test_block_quantisation_keeps_an_outliers_cost_in_its_block():
    """One query row 10^5 x the others: with one descale per tensor the other rows fall among e4m3's subnormals
    and the attention of the other query blocks loses precision (here 3.4x the error); with a descale per block
    of 4 rows only the outlier's block pays (its rows' outputs are left out of the comparison).  (An outlier key or value
    row is read by every query: no blocking of the rows keeps its cost from them.)"""
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((1, 16, 2, 8)) for _ in range(3))
    q[:, 13] *= 1e5                      # beyond e4m3's normal range (448 / 2^-6 = 28672) below the outlier
    exact, _ = reference.attention(q, k, v)
    tensor = [np.abs(x).max() / fp8.E4M3_MAX for x in (q, k, v)]
    per_tensor, _ = fp8.fp8_attention(*(fp8.quantize_e4m3(x, d) for x, d in zip((q, k, v), tensor)), *tensor)
    blocks = [fp8.quantize_blocks_e4m3(x, 4) for x in (q, k, v)]
    per_block, _ = fp8.fp8_attention(*(c for c, _ in blocks), *(d for _, d in blocks), block_q=4, block_k=4)
    rows = np.r_[0:12]                                             # the query blocks without the outlier
    err_tensor = np.abs(per_tensor - exact)[:, rows].max()
    err_block = np.abs(per_block - exact)[:, rows].max()
    assert err_block < 0.5 * err_tensor, (err_block, err_tensor)     # (0.053 against 0.182 at this seed)


def test_block_quantisation_refuses_bad_input():
    with pytest.raises(ValueError, match="block must be an int"):
        fp8.quantize_blocks_e4m3(np.ones((1, 4, 1, 2)), 0)
    with pytest.raises(ValueError, match="4 dimensions"):
        fp8.quantize_blocks_e4m3(np.ones((4, 2)), 2)
    for bad in (np.inf, np.nan):
        x = np.ones((1, 4, 1, 2))
        x[0, 1, 0, 1] = bad
        with pytest.raises(ValueError, match="finite"):
            fp8.quantize_blocks_e4m3(x, 2)
    codes, descale = fp8.quantize_blocks_e4m3(np.ones((1, 4, 2, 0)), 3)         # no columns: nothing to scale
    assert codes.shape == (1, 4, 2, 0) and np.array_equal(descale, np.ones((1, 2, 2)))
    with pytest.raises(ValueError, match=r"ceil\(seqlen / block\)"):
        fp8.fp8_attention(*(np.zeros((1, 4, 1, 2), np.uint8),) * 3, np.ones((1, 1, 3)), block_q=2)


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 50)), min_size=1, max_size=4),
       hk=st.integers(1, 2), group=st.sampled_from([1, 2]), causal=st.booleans(), per_head=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_the_packed_fa3_algorithm_is_each_sequence_on_its_own(lens, hk, group, causal, per_head, seed):
    """``fp8_flash_forward_varlen``: each sequence of a packed batch (empty ones too) is ``fp8_flash_forward`` of
    that sequence alone, with its row of the (sequence, key head) descales; lse in the (nheads, total_q) layout;
    the rows of a sequence with no key 0 and -inf."""
    rng = np.random.default_rng(seed)
    h, d = hk * group, 16
    lq, lk = np.array([a for a, _ in lens]), np.array([b for _, b in lens])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lq, lk))
    q8, k8, v8 = (fp8.quantize_e4m3(rng.standard_normal((int(n), m, d)) * 40) for n, m in
                  ((cu_q[-1], h), (cu_k[-1], hk), (cu_k[-1], hk)))
    ds = [rng.uniform(0.01, 0.05, (len(lens), hk)) if per_head else float(rng.uniform(0.01, 0.05)) for _ in range(3)]
    out, lse = fp8.fp8_flash_forward_varlen(q8, k8, v8, cu_q, cu_k, *ds, block_k=16, causal=causal)
    assert out.shape == (cu_q[-1], h, d) and lse.shape == (h, cu_q[-1])
    for b in range(len(lens)):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        one = [x[b:b + 1] if per_head else x for x in ds]
        ref, ref_lse = fp8.fp8_flash_forward(q8[None, qs:qe], k8[None, ks:ke], v8[None, ks:ke], *one, block_k=16,
                                             causal=causal)
        np.testing.assert_array_equal(out[qs:qe], ref[0])
        np.testing.assert_array_equal(lse[:, qs:qe], ref_lse[0])
        if ke == ks:
            assert np.all(out[qs:qe] == 0) and np.all(lse[:, qs:qe] == -np.inf)
