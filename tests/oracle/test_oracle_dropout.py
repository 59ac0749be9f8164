"""Dropout generator of the oracle: Philox-4x32-10 and the keep mask (docs/semantics.md, Dropout)."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

import reference
import strategies as S

U32 = st.integers(0, 2**32 - 1)

# Random123 kat_vectors, philox4x32_10 (counter words, key words) -> output words.
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


def _words(result):
    """philox4x32_10's result as a tuple of 4 Python ints (accepts a sequence or a (..., 4) array)."""
    arr = np.asarray(result)
    if arr.shape == (4,):
        return tuple(int(x) for x in arr)
    return tuple(int(np.asarray(w).reshape(())) for w in result)


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    assert _words(reference.philox4x32_10(counter, key)) == expected
    assert tuple(int(x) for x in S.naive_philox4x32_10(counter, key)) == expected   # our own copy too


@given(st.tuples(U32, U32, U32, U32), st.tuples(U32, U32))
def test_philox_matches_independent_implementation(counter, key):
    expected = tuple(int(x) for x in S.naive_philox4x32_10(counter, key))
    assert _words(reference.philox4x32_10(counter, key)) == expected


SEEDS = st.one_of(st.integers(0, 2**32 - 1), st.integers(2**32, 2**64 - 1))
PROBS = st.one_of(st.sampled_from((0.0, 0.1, 0.5, 0.9)), st.floats(0.0, 0.99))


@given(SEEDS, st.integers(1, 3), st.integers(1, 4), st.integers(1, 24), st.integers(1, 24), PROBS)
def test_keep_mask_follows_the_contract(seed, batch, nheads, seqlen_q, seqlen_k, p):
    """keep[b, h, i, j] == philox((j, i, h, b), (seed lo, seed hi))[0] >= floor(p * 2**32)."""
    keep = reference.dropout_keep_mask(seed, batch, nheads, seqlen_q, seqlen_k, p)
    assert keep.shape == (batch, nheads, seqlen_q, seqlen_k) and keep.dtype == np.bool_
    np.testing.assert_array_equal(keep, S.naive_keep(seed, batch, nheads, seqlen_q, seqlen_k, p))


@given(SEEDS, st.integers(1, 3), st.integers(1, 3), st.integers(1, 30), st.integers(1, 30), PROBS,
       st.data())
def test_keep_mask_is_a_pure_function_of_position(seed, batch, nheads, seqlen_q, seqlen_k, p, data):
    """A smaller problem's mask is the corresponding corner of a larger one's: bits depend on (seed, b, h, i, j) only."""
    big = reference.dropout_keep_mask(seed, batch, nheads, seqlen_q, seqlen_k, p)
    b2 = data.draw(st.integers(1, batch))
    h2 = data.draw(st.integers(1, nheads))
    q2 = data.draw(st.integers(1, seqlen_q))
    k2 = data.draw(st.integers(1, seqlen_k))
    small = reference.dropout_keep_mask(seed, b2, h2, q2, k2, p)
    np.testing.assert_array_equal(small, big[:b2, :h2, :q2, :k2])
    np.testing.assert_array_equal(reference.dropout_keep_mask(seed, batch, nheads, seqlen_q, seqlen_k, p), big)


def test_keep_mask_depends_on_every_coordinate_and_both_seed_words():
    base = reference.dropout_keep_mask(5, 2, 2, 64, 64, 0.5)
    assert not np.array_equal(base[0], base[1]) and not np.array_equal(base[:, 0], base[:, 1])
    assert not np.array_equal(base[..., :32, :], base[..., 32:, :])
    assert not np.array_equal(base[..., :32], base[..., 32:])
    assert not np.array_equal(base[0, 0], base[0, 0].T)                          # i and j not symmetric
    assert not np.array_equal(base, reference.dropout_keep_mask(5 + 2**32, 2, 2, 64, 64, 0.5))   # high word used
    assert not np.array_equal(base, reference.dropout_keep_mask(6, 2, 2, 64, 64, 0.5))


@pytest.mark.parametrize("p", [0.0, 0.05, 0.1, 0.3, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("seed", [0, 1, 2**32 + 1, 2**64 - 1])
def test_keep_rate_is_one_minus_p(p, seed):
    """Mean of 2*4*128*128 = 131072 keep bits within 4 standard errors of 1 - p (fails ~6e-5 of the time by chance; fixed seeds)."""
    keep = reference.dropout_keep_mask(seed, 2, 4, 128, 128, p)
    n = keep.size
    rate = keep.mean()
    se = math.sqrt(max(p * (1 - p), 1e-12) / n)
    assert abs(rate - (1 - p)) <= 4 * se + 1.0 / n, (rate, 1 - p, se)
    if p == 0.0:
        assert keep.all()


def test_threshold_is_floor_p_times_2_pow_32():
    """keep iff r >= floor(p * 2**32): probe p exactly at an output word r (kept) and just above it (dropped)."""
    r = int(S.naive_philox4x32_10((0, 0, 0, 0), (7, 0))[0])            # element (0, 0, 0, 0) of seed 7
    p_at = r / 2**32
    assert reference.dropout_keep_mask(7, 1, 1, 1, 1, p_at)[0, 0, 0, 0]
    p_above = (r + 1) / 2**32
    assert not reference.dropout_keep_mask(7, 1, 1, 1, 1, p_above)[0, 0, 0, 0]
