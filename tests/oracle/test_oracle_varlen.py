"""The packed-batch, KV-cache and split-KV oracle (reference/varlen.py) against independent witnesses: the dense
oracle on a front-padded batch (per-sequence bottom-right alignment), a dense cache holding the same rows as a
paged one, and attention restricted to key ranges and merged."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import reference
from reference import varlen

OPTS = st.sampled_from([{}, dict(causal=True), dict(window_size=(3, 1)), dict(softcap=2.5),
                        dict(causal=True, alibi=True)])


def _alibi(opts, batch, nheads, rng):
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.1, 1.0, (batch, nheads))
    return opts


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 8)), min_size=1, max_size=3), opts=OPTS,
       seed=st.integers(0, 2**16))
def test_varlen_is_the_dense_oracle_on_a_front_padded_batch(lens, opts, seed):
    rng = np.random.default_rng(seed)
    batch, nheads, nheads_k, d = len(lens), 2, 1, 4
    opts = _alibi(opts, batch, nheads, rng)
    sq, sk = (np.array([x[i] for x in lens]) for i in (0, 1))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (sq, sk))
    q = rng.standard_normal((sq.sum(), nheads, d))
    k, v = (rng.standard_normal((sk.sum(), nheads_k, d)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    out, lse = varlen.attention_varlen(q, k, v, cu_q, cu_k, **opts)
    grads = varlen.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **opts)
    # the witness: sequences right-aligned in a dense batch, the padding keys masked out; front padding keeps
    # each sequence's bottom-right corner on the dense call's
    mq, mk = max(sq.max(), 1), sk.max()
    dq_, dk_ = np.zeros((batch, mq, nheads, d)), np.zeros((batch, mk, nheads_k, d))
    pq, pk, pv, pdo = dq_.copy(), dk_.copy(), dk_.copy(), dq_.copy()
    mask = np.zeros((batch, 1, mq, mk), bool)
    for b in range(batch):
        oq, ok = mq - sq[b], mk - sk[b]
        pq[b, oq:], pdo[b, oq:] = q[cu_q[b]:cu_q[b + 1]], dout[cu_q[b]:cu_q[b + 1]]
        pk[b, ok:], pv[b, ok:] = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        mask[b, :, :, ok:] = True
    want_out, want_lse = reference.attention(pq, pk, pv, attn_mask=mask, **opts)
    want = reference.attention_backward(pdo, pq, pk, pv, attn_mask=mask, **opts)
    for b in range(batch):
        oq, ok, rq, rk = mq - sq[b], mk - sk[b], slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        np.testing.assert_allclose(out[rq], want_out[b, oq:], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[:, rq], want_lse[b, :, oq:], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grads[0][rq], want[0][b, oq:], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(grads[1][rk], want[1][b, ok:], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(grads[2][rk], want[2][b, ok:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cu, error", [
    (np.array([0, 3, 5], np.int64), TypeError), (np.array([0, 4, 3, 5], np.int32), ValueError),
    (np.array([1, 5], np.int32), ValueError), (np.array([0, 4], np.int32), ValueError)])
def test_varlen_refuses_bad_cu_seqlens(cu, error):
    q = np.ones((5, 1, 2))
    with pytest.raises(error, match="cu_seqlens_q"):
        varlen.attention_varlen(q, q, q, cu, np.array([0, 5], np.int32))


@pytest.mark.parametrize("name", ["attn_mask", "attn_bias", "block_mask", "dropout_p"])
def test_varlen_refuses_what_it_does_not_define(name):
    q, cu = np.ones((3, 1, 2)), np.array([0, 3], np.int32)
    with pytest.raises(ValueError, match=name):
        varlen.attention_varlen(q, q, q, cu, cu, **{name: 0.5 if name == "dropout_p" else np.ones((1, 1, 3, 3))})


@settings(max_examples=25, deadline=None)
@given(seqlen_k=st.integers(1, 12), seqlen_q=st.integers(1, 4), nsplits=st.integers(1, 4), causal=st.booleans(),
       seed=st.integers(0, 2**16))
def test_any_split_of_the_keys_combines_to_attention(seqlen_k, seqlen_q, nsplits, causal, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, seqlen_q, 2, 4))
    k, v = (rng.standard_normal((2, seqlen_k, 1, 4)) for _ in range(2))
    cuts = np.sort(rng.integers(0, seqlen_k + 1, nsplits - 1))
    bounds = np.concatenate([[0], cuts, [seqlen_k]])
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):              # a split may be empty, or see no key of a row
        mask = np.zeros((1, 1, seqlen_q, seqlen_k), bool)
        mask[..., lo:hi] = True
        o, l = reference.attention(q, k, v, attn_mask=mask, causal=causal)
        outs.append(o)
        lses.append(l.transpose(0, 2, 1))                     # (batch, seqlen_q, nheads): out's layout
    out, lse = varlen.combine_splits(outs, lses)
    want_out, want_lse = reference.attention(q, k, v, causal=causal)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse.transpose(0, 2, 1), rtol=1e-12, atol=1e-12)


def test_combine_keeps_rows_that_no_split_saw_empty():
    out, lse = varlen.combine_splits(np.ones((2, 3, 4)), np.full((2, 3), -np.inf))
    assert np.all(out == 0) and np.all(lse == -np.inf)


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(0, 9), min_size=1, max_size=3), new=st.integers(0, 3), seqlen_q=st.integers(1, 3),
       page=st.sampled_from([2, 4]), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_kvcache_dense_and_paged_agree_with_attention_over_the_prefix(lens, new, seqlen_q, page, causal, seed):
    rng = np.random.default_rng(seed)
    batch, rows = len(lens), 12
    lens = np.array(lens, np.int32)
    cache_k, cache_v = (rng.standard_normal((batch, rows, 1, 4)) for _ in range(2))
    q = rng.standard_normal((batch, seqlen_q, 2, 4))
    k_new, v_new = (rng.standard_normal((batch, new, 1, 4)) for _ in range(2))
    before = cache_k.copy()
    out, lse, k_after, v_after = varlen.attention_with_kvcache(q, cache_k, cache_v, k_new, v_new, lens,
                                                               causal=causal)
    assert np.array_equal(cache_k, before), "the input cache was modified"
    for b in range(batch):
        n = lens[b]
        assert np.array_equal(k_after[b, n:n + new], k_new[b]) and np.array_equal(k_after[b, :n], cache_k[b, :n])
        assert np.array_equal(k_after[b, n + new:], cache_k[b, n + new:])
        kb = np.concatenate([cache_k[b, :n], k_new[b]])[None]
        vb = np.concatenate([cache_v[b, :n], v_new[b]])[None]
        o, l = reference.attention(q[b:b + 1], kb, vb, causal=causal)
        np.testing.assert_allclose(out[b], o[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b], l[0], rtol=1e-12, atol=1e-12)
    # the same rows in a paged cache, pages in a random order
    per_seq = rows // page
    table = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)
    paged_k, paged_v = np.zeros((batch * per_seq, page, 1, 4)), np.zeros((batch * per_seq, page, 1, 4))
    for b in range(batch):
        for p in range(per_seq):
            paged_k[table[b, p]] = cache_k[b, p * page:(p + 1) * page]
            paged_v[table[b, p]] = cache_v[b, p * page:(p + 1) * page]
    out_p, lse_p, _, _ = varlen.attention_with_kvcache(q, paged_k, paged_v, k_new, v_new, lens, block_table=table,
                                                       causal=causal)
    np.testing.assert_array_equal(out_p, out)
    np.testing.assert_array_equal(lse_p, lse)


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(0, 9), min_size=1, max_size=3), new=st.integers(0, 3), seqlen_q=st.integers(1, 3),
       opts=OPTS, seed=st.integers(0, 2**16))
def test_kvcache_leftpad_is_a_mask_on_the_keys_before_it(lens, new, seqlen_q, opts, seed):
    """``cache_leftpad``: the cache's positions unchanged (bottom-right alignment at ``cache_seqlens[b] +
    seqlen_new``, windows, ALiBi's distances), keys ``j < cache_leftpad[b]`` masked: the witness is the dense
    oracle over the whole prefix with that key mask as ``attn_mask``."""
    rng = np.random.default_rng(seed)
    batch, rows = len(lens), 12
    opts = _alibi(opts, batch, 2, rng)
    lens = np.array(lens, np.int32)
    pad = np.array([rng.integers(0, n + new + 1) for n in lens], np.int32)     # up to every row (no key left)
    cache_k, cache_v = (rng.standard_normal((batch, rows, 1, 4)) for _ in range(2))
    q = rng.standard_normal((batch, seqlen_q, 2, 4))
    k_new, v_new = (rng.standard_normal((batch, new, 1, 4)) for _ in range(2))
    out, lse, k_after, _ = varlen.attention_with_kvcache(q, cache_k, cache_v, k_new, v_new, lens,
                                                         cache_leftpad=pad, **opts)
    plain = varlen.attention_with_kvcache(q, cache_k, cache_v, k_new, v_new, lens, **opts)
    assert np.array_equal(k_after, plain[2]), "the padding changed the append"
    for b in range(batch):
        n = lens[b] + new
        kb = np.concatenate([cache_k[b, :lens[b]], k_new[b]])[None]
        vb = np.concatenate([cache_v[b, :lens[b]], v_new[b]])[None]
        mask = np.broadcast_to(np.arange(n) >= pad[b], (1, 1, seqlen_q, n))
        per = dict(opts)
        if "alibi_slopes" in per:
            per["alibi_slopes"] = per["alibi_slopes"][b:b + 1]
        o, l = reference.attention(q[b:b + 1], kb, vb, attn_mask=mask, **per)
        np.testing.assert_allclose(out[b], o[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b], l[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="cache_leftpad"):
        bad = pad.copy()
        bad[0] = lens[0] + new + 1
        varlen.attention_with_kvcache(q, cache_k, cache_v, k_new, v_new, lens, cache_leftpad=bad)


def test_kvcache_refuses_overflow_and_bad_pages():
    cache = np.zeros((1, 4, 1, 2))
    with pytest.raises(ValueError, match="exceeds"):
        varlen.attention_with_kvcache(np.ones((1, 1, 1, 2)), cache, cache, np.ones((1, 2, 1, 2)),
                                      np.ones((1, 2, 1, 2)), np.array([3], np.int32))
    with pytest.raises(ValueError, match="block_table"):
        varlen.attention_with_kvcache(np.ones((1, 1, 1, 2)), cache, cache, None, None, np.array([3], np.int32),
                                      block_table=np.array([[5]], np.int32))
