"""The oracle's rotary embedding (``reference.apply_rotary``) and its use in ``attention_with_kvcache``: the
properties that define it, independent of any kernel.

* a rotation: each rotated pair keeps its length; cos = 1, sin = 0 is the identity; dims past ``rotary_dim``
  are kept;
* interleaved (GPT-J) and not (GPT-NeoX) are the same rotation of differently paired dims;
* RoPE's point: with a table of angles ``pos * theta_i``, ``rot(q, m) . rot(k, n)`` depends on ``m - n`` only;
* flash-attn's positions in the KV cache: the new keys at ``cache_seqlens[b] + i``, the queries there too when
  causal or windowed, else all at ``cache_seqlens[b]``.
"""
import numpy as np
from hypothesis import given, settings, strategies as st

import reference
from reference import varlen


def table(seqlen_ro, half, base=10000.0):
    theta = base ** (-np.arange(half) / half)
    ang = np.arange(seqlen_ro)[:, None] * theta[None, :]
    return np.cos(ang), np.sin(ang)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), half=st.sampled_from((1, 2, 4)), extra=st.sampled_from((0, 2, 3)),
       interleaved=st.booleans())
def test_rotation_keeps_pair_lengths_and_the_other_dims(seed, half, extra, interleaved):
    rng = np.random.default_rng(seed)
    d = 2 * half + extra
    x = rng.standard_normal((2, 5, 3, d))
    cos, sin = table(9, half)
    pos = rng.integers(0, 9, (2, 5))
    y = reference.apply_rotary(x, cos, sin, pos, interleaved)
    pairs = (lambda a: (a[..., 0:2 * half:2], a[..., 1:2 * half:2])) if interleaved else \
        (lambda a: (a[..., :half], a[..., half:2 * half]))
    (x0, x1), (y0, y1) = pairs(x), pairs(y)
    np.testing.assert_allclose(y0 ** 2 + y1 ** 2, x0 ** 2 + x1 ** 2, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(y[..., 2 * half:], x[..., 2 * half:])
    assert np.array_equal(reference.apply_rotary(x, np.ones_like(cos), np.zeros_like(sin), pos, interleaved), x)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), half=st.sampled_from((1, 2, 4)))
def test_interleaved_and_halves_are_one_rotation_of_other_pairs(seed, half):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 4, 2, 2 * half))
    cos, sin = table(6, half)
    pos = rng.integers(0, 6, (1, 4))
    perm = np.concatenate([np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)])   # interleaved -> halves
    np.testing.assert_allclose(reference.apply_rotary(x, cos, sin, pos, True)[..., perm],
                               reference.apply_rotary(x[..., perm], cos, sin, pos, False), rtol=1e-13, atol=1e-13)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shift=st.integers(1, 20), interleaved=st.booleans())
def test_scores_depend_on_the_relative_position_only(seed, shift, interleaved):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((1, 1, 1, 8)) for _ in range(2))
    cos, sin = table(64, 4)
    m, n = rng.integers(0, 40, 2)
    at = lambda x, p: reference.apply_rotary(x, cos, sin, np.array([[p]]), interleaved)   # noqa: E731
    s0 = float(np.sum(at(q, m) * at(k, n)))
    s1 = float(np.sum(at(q, m + shift) * at(k, n + shift)))
    assert abs(s0 - s1) <= 1e-10 * (1 + abs(s0))


def test_kvcache_positions_follow_flash_attn():
    """Causal: query i of sequence b at cache_seqlens[b] + i, the same rows as the new keys; not causal, not
    windowed: every query at cache_seqlens[b]."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 2, 8))
    kc, vc = (rng.standard_normal((2, 16, 1, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 3, 1, 8)) for _ in range(2))
    lens = np.array([4, 9])
    cos, sin = table(16, 4)
    for causal in (True, False):
        out, _, kc2, _ = varlen.attention_with_kvcache(q, kc, vc, k, v, lens, rotary_cos=cos, rotary_sin=sin,
                                                       causal=causal)
        pos_k = lens[:, None] + np.arange(3)
        pos_q = pos_k if causal else np.repeat(lens[:, None], 3, 1)
        want_k = reference.apply_rotary(k, cos, sin, pos_k)
        for b in range(2):
            np.testing.assert_array_equal(kc2[b, lens[b]:lens[b] + 3], want_k[b])
        want, _, _, _ = varlen.attention_with_kvcache(reference.apply_rotary(q, cos, sin, pos_q), kc, vc, want_k, v,
                                                      lens, causal=causal)
        np.testing.assert_array_equal(out, want)


def test_a_window_past_the_cache_is_no_window_for_the_positions():
    """flash-attn drops window sides at or past the cache's rows before deciding where q is rotated."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 1, 4))
    kc, vc = (rng.standard_normal((1, 8, 1, 4)) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, 1, 4)) for _ in range(2))
    cos, sin = table(8, 2)
    wide, _, _, _ = varlen.attention_with_kvcache(q, kc, vc, k, v, np.array([3]), rotary_cos=cos, rotary_sin=sin,
                                                  window_size=(8, -1))
    none, _, _, _ = varlen.attention_with_kvcache(q, kc, vc, k, v, np.array([3]), rotary_cos=cos, rotary_sin=sin)
    np.testing.assert_array_equal(wide, none)
