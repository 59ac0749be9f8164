"""flash-attn's calling contract where flashnb takes flash-attn's names: the parameters in flash-attn's order
(a positional caller's arguments keep their meaning), integer-like ``window_size`` pairs, ``cache_batch_idx``
(against the oracle, ``reference.attention_with_kvcache(cache_batch_idx=...)``), and the parameters not served
yet refused with an error naming them, before any launch and with the caches untouched."""
import inspect

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flashnb
from kernel_harness import Untouched, examples
from reference import varlen

# flash_attn/flash_attn_interface.py (flash-attn 2.x): the parameters of the functions flashnb names after it
FLASH_ATTN_KVCACHE = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                      "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size",
                      "softcap", "rotary_interleaved", "alibi_slopes", "num_splits", "return_softmax_lse")


FLASH_ATTN_FUNC = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
                   "deterministic", "return_attn_probs")
FLASH_ATTN_VARLEN = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                     "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
                     "return_attn_probs", "block_table")


def _positional(fn):
    params = list(inspect.signature(fn).parameters.values())
    names = tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)
    assert all(p.kind == p.KEYWORD_ONLY for p in params[len(names):]), fn   # flashnb's additions: keyword-only
    return names


def test_varlen_parameters_in_flash_attn_order():
    assert _positional(flashnb.flash_attn_varlen_func) == FLASH_ATTN_VARLEN


def test_torch_functions_in_flash_attn_order():
    ft = pytest.importorskip("flashnb.torch")
    assert _positional(ft.flash_attn_func) == FLASH_ATTN_FUNC
    assert _positional(ft.flash_attn_varlen_func) == FLASH_ATTN_VARLEN


def _paged(rng, k, v, cu_k, page, spare=2):
    """Pages ``(num_pages, page, nheads_k, headdim)`` holding each sequence's keys and values of the packed
    ``k``, ``v`` (pages in a random order, spare pages of noise), and the block table."""
    lengths = np.diff(cu_k)
    per_seq = max(1, int(-(-lengths.max() // page)))
    num_pages = len(lengths) * per_seq + spare
    order = rng.permutation(num_pages)
    table = order[:len(lengths) * per_seq].reshape(len(lengths), per_seq).astype(np.int32)
    kp, vp = (rng.standard_normal((num_pages, page) + k.shape[1:]).astype(k.dtype) for _ in range(2))
    for b, n in enumerate(lengths):
        for j in range(n):
            kp[table[b, j // page], j % page] = k[cu_k[b] + j]
            vp[table[b, j // page], j % page] = v[cu_k[b] + j]
    return kp, vp, table


@pytest.mark.parametrize("causal, page", [(False, 2), (True, 3)])
def test_varlen_block_table_reads_the_pages(causal, page):
    """flash-attn's paged KV cache for packed batches: the same bits as the packed keys and values it holds
    (GQA, an empty sequence, pages in a random order among spare ones)."""
    rng = np.random.default_rng(4)
    cu_q, cu_k = np.array([0, 2, 2, 5], np.int32), np.array([0, 4, 5, 12], np.int32)
    q = rng.standard_normal((5, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((12, 2, 8)).astype(np.float32) for _ in range(2))
    kp, vp, table = _paged(rng, k, v, cu_k, page)
    with Untouched(q, kp, vp, table):
        out, lse, probs = flashnb.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 3, 7, causal=causal, block_table=table,
                                                         return_attn_probs=True)
    want, want_lse = flashnb.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 7, causal=causal, return_lse=True)
    assert probs is None
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    ref, _ = varlen.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("change, match", [
    (dict(packed=True), r"with block_table, k must be pages"),
    (dict(table=np.array([[0, 1], [2, 9]], np.int32)), r"block_table\[1\] names pages outside 0..5"),
    (dict(table=np.zeros((3, 2), np.int32)), r"block_table must have shape \(batch, pages_per_sequence\)"),
    (dict(table=np.zeros((2, 2), np.int64)), "must be int32"),
    (dict(table=np.zeros((2, 1), np.int32)), "more keys than its 1 pages of 2 rows"),
])
def test_varlen_block_table_refusals_name_the_argument(change, match):
    rng = np.random.default_rng(5)
    cu = np.array([0, 3, 7], np.int32)
    q = rng.standard_normal((7, 2, 4)).astype(np.float32)
    kp = rng.standard_normal((6, 2, 2, 4)).astype(np.float32)            # 6 pages of 2 rows
    table = change.get("table", np.array([[0, 1], [2, 3]], np.int32))
    k = q.copy() if change.get("packed") else kp
    with Untouched(q, kp, table), pytest.raises((ValueError, TypeError), match=match):
        flashnb.flash_attn_varlen_func(q, k, k, cu, cu, 4, 4, block_table=table)


def test_varlen_attn_probs_returned():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((7, 2, 4)).astype(np.float32) for _ in range(3))
    cu = np.array([0, 3, 7], np.int32)
    out, lse, probs = flashnb.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, 0.0, 0.5, True, return_attn_probs=True)
    want, want_lse = flashnb.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, softmax_scale=0.5, causal=True,
                                                    return_lse=True)
    assert probs is None
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


def test_kvcache_parameters_in_flash_attn_order():
    params = list(inspect.signature(flashnb.flash_attn_with_kvcache).parameters.values())
    positional = tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)
    assert positional == FLASH_ATTN_KVCACHE
    assert all(p.kind == p.KEYWORD_ONLY for p in params[len(positional):])     # flashnb's additions (stream)


def _dense(rng, batch, rows, nheads_k, headdim, dtype=np.float32, cache_rows=None):
    shape = (cache_rows or batch, rows, nheads_k, headdim)
    return (rng.standard_normal(shape).astype(dtype) for _ in range(2))


@settings(max_examples=examples(6, 8))
@given(seed=st.integers(0, 2**32 - 1), spare=st.integers(0, 2), append=st.booleans(), causal=st.booleans(),
       dtype=st.sampled_from((np.float32, np.float16)))
def test_cache_batch_idx_matches_oracle(seed, spare, append, causal, dtype):
    """Sequence b reads and appends to cache row ``cache_batch_idx[b]`` (rows in random order, spare rows nobody
    uses, which stay as they were): out, lse within float32's / float16's bound, the caches bit-exact."""
    rng = np.random.default_rng(seed)
    batch, nheads, nheads_k, headdim, rows = 2, 4, 2, 4, 16
    new = 2 if append else 0
    q = rng.standard_normal((batch, 1, nheads, headdim)).astype(dtype)
    kc, vc = _dense(rng, batch, rows, nheads_k, headdim, dtype, batch + spare)
    k = v = None
    if append:
        k, v = (rng.standard_normal((batch, new, nheads_k, headdim)).astype(dtype) for _ in range(2))
    lens = rng.integers(0, rows - new + 1, batch).astype(np.int32)
    idx = rng.permutation(batch + spare)[:batch].astype(np.int32)
    want_out, want_lse, want_kc, want_vc = varlen.attention_with_kvcache(q, kc, vc, k, v, lens,
                                                                         cache_batch_idx=idx, causal=causal)
    kc2, vc2 = kc.copy(), vc.copy()
    with Untouched(q, k, v, lens, idx):
        out, lse = flashnb.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=lens, cache_batch_idx=idx,
                                                   causal=causal, return_softmax_lse=True)
    np.testing.assert_array_equal(kc2, want_kc)
    np.testing.assert_array_equal(vc2, want_vc)
    tol = 1e-5 if dtype == np.float32 else 2e-3       # |out| <= max |v| ~ 4: float16's half-ulp there is 2e-3
    np.testing.assert_allclose(out.astype(np.float64), want_out, atol=tol, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-4, rtol=0)


def test_cache_batch_idx_is_not_the_identity():
    """A fixed case where the picked rows differ from the batch order: the result differs from ignoring it."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 1, 2, 4)).astype(np.float32)
    kc, vc = _dense(rng, 2, 16, 2, 4, cache_rows=3)
    idx = np.array([2, 0], np.int32)
    out = flashnb.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=np.array([16, 16], np.int32), cache_batch_idx=idx)
    want, _, _, _ = varlen.attention_with_kvcache(q, kc[idx], vc[idx])
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
    plain = flashnb.flash_attn_with_kvcache(q, kc[:2], vc[:2])
    assert np.abs(out - plain).max() > 1e-2


@pytest.mark.parametrize("bad, match", [
    (dict(cache_leftpad=np.zeros(2, np.int32), block_table=np.zeros((2, 1), np.int32)), "cache_leftpad is for dense"),
    (dict(cache_leftpad=np.array([0, 6], np.int32)), r"cache_leftpad\[1\] = 6 is outside 0..5"),
    (dict(cache_leftpad=np.array([-1, 0], np.int32)), r"cache_leftpad\[0\]"),
    (dict(cache_leftpad=np.array([0, 1], np.int64)), "cache_leftpad must be an int32"),
    (dict(cache_leftpad=np.array([0], np.int32)), r"cache_leftpad must have shape \(2,\)"),
    (dict(cache_batch_idx=np.array([0, 5], np.int32)), r"cache_batch_idx\[1\]"),
    (dict(cache_batch_idx=np.array([0, 1], np.int64)), "cache_batch_idx must be an int32"),
    (dict(cache_batch_idx=np.array([0], np.int32)), r"cache_batch_idx must have shape \(2,\)"),
    (dict(cache_batch_idx=np.array([0, 1], np.int32), block_table=np.zeros((2, 1), np.int32)), "block_table"),
    (dict(window_size=(1.5, 0)), "window_size"),
    (dict(window_size=(True, 0)), "window_size"),
    (dict(window_size=(-2, 0)), "window_size"),
])
def test_kvcache_refusals_name_the_argument(bad, match):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 2, 4)).astype(np.float32)
    kc, vc = _dense(rng, 2, 16, 2, 4, cache_rows=3)
    k, v = (rng.standard_normal((2, 1, 2, 4)).astype(np.float32) for _ in range(2))
    with Untouched(q, kc, vc, k, v), pytest.raises((ValueError, TypeError), match=match):
        flashnb.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=np.array([3, 4], np.int32),
                                        **{"cache_batch_idx": np.array([2, 0], np.int32), **bad})


def test_cache_batch_idx_needs_whole_pages():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 2, 4)).astype(np.float32)
    kc, vc = _dense(rng, 1, 12, 2, 4, cache_rows=2)
    with pytest.raises(ValueError, match=r"cache_batch_idx needs .* multiple of 16"):
        flashnb.flash_attn_with_kvcache(q, kc, vc, cache_batch_idx=np.array([1], np.int32))


@pytest.mark.parametrize("form", [list, np.array, lambda w: tuple(np.int32(x) for x in w)])
def test_window_size_integer_like(form):
    """``window_size`` as a list, a NumPy array of two ints or NumPy integers gives the tuple's result, in
    ``flash_attention``, its backward and ``flash_attn_with_kvcache``."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 6, 2, 4)).astype(np.float32) for _ in range(3))
    want = flashnb.flash_attention(q, k, v, window_size=(2, 1))
    np.testing.assert_array_equal(flashnb.flash_attention(q, k, v, window_size=form((2, 1))), want)
    out, lse = flashnb.flash_attention(q, k, v, window_size=(2, 1), return_lse=True)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, window_size=(2, 1))
    for a, b in zip(flashnb.flash_attention_backward(dout, q, k, v, out, lse, window_size=form((2, 1))), grads):
        np.testing.assert_array_equal(a, b)
    kc, vc = _dense(rng, 1, 16, 2, 4)
    want = flashnb.flash_attn_with_kvcache(q[:, :1], kc, vc, window_size=(3, 0))
    np.testing.assert_array_equal(flashnb.flash_attn_with_kvcache(q[:, :1], kc, vc, window_size=form((3, 0))), want)


def _rope(seqlen_ro, half, dtype):
    ang = np.arange(seqlen_ro)[:, None] * (10000.0 ** (-np.arange(half) / half))[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


@settings(max_examples=examples(6, 12))
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from((np.float32, np.float16)),
       interleaved=st.booleans(), mode=st.sampled_from(("causal", "window", "none")),
       paged=st.booleans(), lens_form=st.sampled_from(("array", "int", "none")), seqlen_q=st.integers(1, 3),
       half=st.sampled_from((2, 4)), device_lens=st.booleans())
def test_rotary_matches_oracle(seed, dtype, interleaved, mode, paged, lens_form, seqlen_q, half, device_lens):
    """flash-attn's rotary embedding inside the call: the new keys rotated at ``cache_seqlens[b] + i`` before the
    append, q at its own rows when causal or windowed, else at ``cache_seqlens[b]``; rotary_dim 4 or 8 of head
    dim 8 (the other dims kept).  Against the oracle given the rotated q and k rounded to the input dtype (the
    kernel rounds them there): out and lse to the dtype's rounding, the caches' appended rows to one unit of
    the dtype's rounding (float32 arithmetic against float64's), every other row exact."""
    from numba import cuda
    import reference
    rng = np.random.default_rng(seed)
    batch, nheads, nheads_k, d, new = 2, 4, 2, 8, 2
    q = rng.standard_normal((batch, seqlen_q, nheads, d)).astype(dtype)
    k, v = (rng.standard_normal((batch, new, nheads_k, d)).astype(dtype) for _ in range(2))
    if paged:
        table = rng.permutation(5)[:4].reshape(batch, 2).astype(np.int32)
        kc, vc = (rng.standard_normal((5, 16, nheads_k, d)).astype(dtype) for _ in range(2))
        capacity = 32
    else:
        table = None
        kc, vc = (rng.standard_normal((batch, 20, nheads_k, d)).astype(dtype) for _ in range(2))
        capacity = 20
    lens = rng.integers(0, capacity - new + 1, batch).astype(np.int32)
    if lens_form == "int":
        lens[:] = lens[0]
    elif lens_form == "none":
        lens[:] = capacity - new
    arg = {"array": lens, "int": int(lens[0]), "none": None}[lens_form]
    if device_lens and lens_form == "array":
        arg = cuda.to_device(lens)
    cos, sin = _rope(capacity + 3, half, dtype)
    opts = {"causal": dict(causal=True), "window": dict(window_size=(5, 1)), "none": {}}[mode]
    local = mode != "none"
    pos_k = lens[:, None] + np.arange(new)[None, :]
    pos_q = lens[:, None] + (np.arange(seqlen_q)[None, :] if local else np.zeros((1, seqlen_q), int))
    q_rot = reference.apply_rotary(q, cos, sin, pos_q, interleaved).astype(dtype)
    k_rot = reference.apply_rotary(k, cos, sin, pos_k, interleaved).astype(dtype)
    want_out, want_lse, want_kc, want_vc = varlen.attention_with_kvcache(q_rot, kc, vc, k_rot, v, lens, table, **opts)
    kc2, vc2 = kc.copy(), vc.copy()
    with Untouched(q, k, v, cos, sin, lens):
        out, lse = flashnb.flash_attn_with_kvcache(q, kc2, vc2, k, v, cos, sin, arg, block_table=table,
                                                   rotary_interleaved=interleaved, return_softmax_lse=True, **opts)
    np.testing.assert_array_equal(vc2, want_vc)
    ulp = np.finfo(dtype).eps
    np.testing.assert_allclose(kc2.astype(np.float64), want_kc.astype(np.float64), rtol=ulp, atol=ulp)
    moved = kc2 != want_kc
    assert not np.any(moved & (np.abs(want_kc.astype(np.float64)) < 1e30) & ~_appended(kc2.shape, lens, new, table))
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(out.astype(np.float64), want_out, atol=tol, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-4, rtol=0)


def _appended(shape, lens, new, table):
    """The cache rows the append writes (dense: rows lens[b]..lens[b] + new of row b; paged: through the table)."""
    mask = np.zeros(shape, bool)
    for b in range(len(lens)):
        for r in range(int(lens[b]), int(lens[b]) + new):
            if table is None:
                mask[b, r] = True
            else:
                mask[table[b, r // shape[1]], r % shape[1]] = True
    return mask


def test_rotary_is_applied():
    """A fixed case where the rotation matters: the result differs from the call without the tables."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, 2, 8)).astype(np.float32) for _ in range(2))
    kc, vc = (rng.standard_normal((1, 16, 2, 8)).astype(np.float32) for _ in range(2))
    cos, sin = _rope(16, 4, np.float32)
    a = flashnb.flash_attn_with_kvcache(q, kc.copy(), vc.copy(), k, v, cos, sin, 9)
    b = flashnb.flash_attn_with_kvcache(q, kc.copy(), vc.copy(), k, v, cache_seqlens=9)
    assert np.abs(a - b).max() > 1e-2


@pytest.mark.parametrize("bad, match", [
    (dict(rotary_cos=np.ones((16, 2), np.float32)), "together"),
    (dict(rotary_cos=np.ones((16, 2), np.float16), rotary_sin=np.ones((16, 2), np.float16)), "rotary_cos is a"),
    (dict(rotary_cos=np.ones((16, 3), np.float32), rotary_sin=np.ones((16, 3), np.float32)), "multiple of 4"),
    (dict(rotary_cos=np.ones((16, 6), np.float32), rotary_sin=np.ones((16, 6), np.float32)), "up to the head dim"),
    (dict(rotary_cos=np.ones((16, 2), np.float32), rotary_sin=np.ones((15, 2), np.float32)), "same shape"),
    (dict(rotary_cos=np.ones((15, 2), np.float32), rotary_sin=np.ones((15, 2), np.float32)), "cache's 16 rows"),
    (dict(rotary_cos=np.ones((0, 2), np.float32), rotary_sin=np.ones((0, 2), np.float32)), "cache's 16 rows"),
    (dict(rotary_cos=np.ones((16, 2), np.float32), rotary_sin=np.ones((16, 2), np.float32), k=None, v=None),
     "need the new keys"),
    (dict(rotary_interleaved=1), "rotary_interleaved"),
])
def test_rotary_refusals_name_the_argument(bad, match):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 2, 4)).astype(np.float32)
    kc, vc = _dense(rng, 2, 16, 2, 4)
    k, v = (rng.standard_normal((2, 1, 2, 4)).astype(np.float32) for _ in range(2))
    args = {**dict(k=k, v=v, cache_seqlens=np.array([3, 4], np.int32)), **bad}
    with Untouched(q, kc, vc, k, v), pytest.raises((ValueError, TypeError), match=match):
        flashnb.flash_attn_with_kvcache(q, kc, vc, **args)


def test_rotary_window_past_the_cache_is_not_local():
    """A window side at or past the cache's rows bounds nothing, and flash-attn drops it before deciding where q
    is rotated: ``window_size=(10**6, -1)`` without causal rotates every query at ``cache_seqlens[b]``, as no
    window does; (3, -1) rotates each query at its own row."""
    import reference
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, 2, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 2, 8)).astype(np.float32) for _ in range(2))
    kc, vc = (rng.standard_normal((1, 16, 2, 8)).astype(np.float32) for _ in range(2))
    cos, sin = _rope(16, 4, np.float32)
    lens = np.array([5], np.int32)
    for window, at_start in (((10**6, -1), True), ((3, -1), False)):
        pos_q = lens[:, None] + (0 if at_start else np.arange(2)[None, :])
        q_rot = reference.apply_rotary(q, cos, sin, np.broadcast_to(pos_q, (1, 2)))
        k_rot = reference.apply_rotary(k, cos, sin, lens[:, None] + np.arange(2)[None, :])
        want, _, _, _ = varlen.attention_with_kvcache(q_rot, kc, vc, k_rot.astype(np.float32), v, lens,
                                                      window_size=window)
        got = flashnb.flash_attn_with_kvcache(q, kc.copy(), vc.copy(), k, v, cos, sin, lens, window_size=window)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
