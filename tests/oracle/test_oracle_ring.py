"""The ring-attention oracle (reference/ring.py) against standard attention of the whole sequence: any number
of ranks, any partition of the positions (contiguous, zigzag, random), causal or not, grouped-query heads."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import reference
from reference import ring


def _layout(name, seqlen, world, rng):
    if name == "contiguous":
        return ring.contiguous_positions(seqlen, world)
    if name == "zigzag":
        return ring.zigzag_positions(seqlen, world)
    cuts = np.sort(rng.choice(np.arange(1, seqlen), world - 1, replace=False)) if world > 1 else []
    return np.split(rng.permutation(seqlen), cuts)                    # random, unequal shards


@settings(max_examples=30, deadline=None)
@given(world=st.integers(1, 4), chunk=st.integers(1, 3), layout=st.sampled_from(["contiguous", "zigzag", "random"]),
       causal=st.booleans(), group=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_ring_equals_attention_of_the_whole_sequence(world, chunk, layout, causal, group, seed):
    rng = np.random.default_rng(seed)
    batch, nheads_k, d = 2, 1, 4
    nheads, seqlen = nheads_k * group, 2 * world * chunk
    positions = _layout(layout, seqlen, world, rng)
    assert np.array_equal(np.sort(np.concatenate(positions)), np.arange(seqlen))
    q = rng.standard_normal((batch, seqlen, nheads, d))
    k, v = (rng.standard_normal((batch, seqlen, nheads_k, d)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    scale = rng.uniform(0.2, 1.0)
    out, lse = reference.attention(q, k, v, causal=causal, softmax_scale=scale)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, causal=causal, softmax_scale=scale)

    shard = lambda x: [x[:, p] for p in positions]                    # noqa: E731
    outs, lses = ring.ring_attention(shard(q), shard(k), shard(v), positions, causal=causal, softmax_scale=scale)
    grads = ring.ring_attention_backward(shard(dout), shard(q), shard(k), shard(v), outs, lses, positions,
                                         causal=causal, softmax_scale=scale)
    for r, p in enumerate(positions):
        np.testing.assert_allclose(outs[r], out[:, p], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lses[r], lse[:, :, p], rtol=1e-12, atol=1e-12)
        for got, want in zip((g[r] for g in grads), (dq, dk, dv)):
            np.testing.assert_allclose(got, want[:, p], rtol=1e-10, atol=1e-11)


def test_zigzag_balances_causal_work():
    """Under a causal mask each rank's zigzag shard sees the same number of (query, key) pairs; contiguous
    shards do not (the reason for the zigzag layout)."""
    seqlen, world = 64, 4
    pairs = lambda ps: [int(np.sum(np.arange(seqlen)[None, :] <= p[:, None])) for p in ps]   # noqa: E731
    assert len(set(pairs(ring.zigzag_positions(seqlen, world)))) == 1
    assert len(set(pairs(ring.contiguous_positions(seqlen, world)))) == world


@pytest.mark.parametrize("make", [ring.zigzag_positions, ring.contiguous_positions])
def test_layouts_refuse_uneven_splits(make):
    with pytest.raises(ValueError, match="multiple"):
        make(15, 4)
