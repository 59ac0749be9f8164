"""``flashnb.flash_attn_with_kvcache`` (kernels/decode.py) against the oracle ``reference.attention_with_kvcache``.

Properties over random tiny problems: dense and paged caches (pages in random order, spare pages), with and
without an append (``k``/``v``), ``cache_seqlens`` as an array, an int or None, one split, several and the
automatic choice, MHA/GQA/MQA, seqlen_q 1-3, every option the oracle defines (causal and windows bottom-right
per sequence, softcap, ALiBi, the scale), float32 and float16; outputs poisoned with NaN, split scratch too.
The caches after the call must equal the oracle's appended copies bit for bit (rows outside the appended
range unchanged) and the other inputs come back untouched.  Tolerances: ``kernel_harness`` per sequence (the
dense oracle over that sequence's valid prefix: float32 1e-4 of the output scale plus score rounding, float16
flash-attn's twice-the-float16-oracle rule).  Bad input: a ValueError/TypeError naming the argument before
any launch, the caches unchanged.  ``cache_seqlens`` / ``block_table`` in device memory (``cuda.to_device``)
are not checked on the host: the same results as on the host, and out-of-range entries give NaN rows for
exactly those sequences, no append for them, and no other cache memory changed.
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from numba import cuda

import flashnb
import strategies as S
from flashnb import kvcache, plan
from flashnb.kernels._jit import SIMULATOR
from kernel_harness import Untouched, check_forward, examples, expected, poison_outputs  # noqa: F401 (fixture)
from reference import varlen
from tools import tune_decode

PAGE = 16                     # the smallest page the kernel takes (decode.KEY_ALIGN)
MAX_ROWS_DENSE = 24 if SIMULATOR else 700


@dataclasses.dataclass
class Case:
    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    k: np.ndarray | None
    v: np.ndarray | None
    cache_seqlens: object
    block_table: np.ndarray | None
    opts: dict
    num_splits: int

    def __repr__(self):
        return (f"Case(q={self.q.dtype}{self.q.shape}, cache={self.k_cache.shape}, "
                f"new={None if self.k is None else self.k.shape}, cache_seqlens={self.cache_seqlens!r}, "
                f"paged={self.block_table is not None}, opts={ {k: (v if not isinstance(v, np.ndarray) else v.shape) for k, v in self.opts.items()} }, "
                f"num_splits={self.num_splits})")


@st.composite
def cases(draw, dtypes=(np.float32, np.float16), paged=None, append=None, options=("causal", "window_size",
          "softcap", "alibi_slopes", "softmax_scale")):
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    batch = draw(st.integers(1, 2))
    nheads_k = draw(st.integers(1, 2))
    group = draw(st.sampled_from((1, 2, 3)))
    nheads = nheads_k * group
    headdim = draw(st.sampled_from((2, 4, 6, 8) if dtype == np.float16 else (1, 3, 4, 8)))
    seqlen_q = draw(st.integers(1, 3))
    is_paged = draw(st.booleans()) if paged is None else paged
    if is_paged:
        per_seq = draw(st.integers(1, 2))
        capacity = per_seq * PAGE
    else:
        capacity = draw(st.integers(1, MAX_ROWS_DENSE))
    seqlen_new = draw(st.integers(1, min(3, capacity))) if (draw(st.booleans()) if append is None else append) else 0
    lens = np.array([draw(st.integers(0, capacity - seqlen_new)) for _ in range(batch)], np.int32)
    form = draw(st.sampled_from(("array", "int", "none")))
    if form == "int":
        lens[:] = lens[0]
        cache_seqlens = int(lens[0])
    elif form == "none":
        lens[:] = capacity - seqlen_new
        cache_seqlens = None
    else:
        cache_seqlens = lens
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    qscale = draw(st.sampled_from((1.0, 4.0)))
    q = (rng.standard_normal((batch, seqlen_q, nheads, headdim)) * qscale).astype(dtype)
    if is_paged:
        num_pages = batch * per_seq + draw(st.integers(0, 2))                  # spare pages nobody uses
        table = rng.permutation(num_pages)[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
        shape = (num_pages, PAGE, nheads_k, headdim)
    else:
        table = None
        shape = (batch, capacity, nheads_k, headdim)
    k_cache, v_cache = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    k = v = None
    if seqlen_new:
        k, v = (rng.standard_normal((batch, seqlen_new, nheads_k, headdim)).astype(dtype) for _ in range(2))
    opts = {}
    for name in draw(st.lists(st.sampled_from(options), unique=True, max_size=3)):
        if name == "causal":
            opts["causal"] = True
        elif name == "window_size":
            opts["window_size"] = (draw(st.integers(-1, 6)), draw(st.integers(-1, 3)))
        elif name == "softcap":
            opts["softcap"] = draw(st.sampled_from((0.5, 3.0)))
        elif name == "alibi_slopes":
            opts["alibi_slopes"] = rng.uniform(0.05, 1.0, (batch, nheads) if draw(st.booleans()) else (nheads,))
        elif name == "softmax_scale":
            opts["softmax_scale"] = draw(st.sampled_from((0.3, -0.7)))
    num_splits = draw(st.sampled_from((0, 1, 2, 3)))
    return Case(q, k_cache, v_cache, k, v, cache_seqlens, table, opts, num_splits)


def _per_sequence_opts(opts, b):
    o = dict(opts)
    if "alibi_slopes" in o and np.ndim(o["alibi_slopes"]) == 2:
        o["alibi_slopes"] = o["alibi_slopes"][b]
    return o


def _prefix(cache, table, b, n):
    if table is None:
        return cache[b, :n]
    return varlen._pages(cache, table, b, n)


def on_device(x):
    """A metadata array moved to device memory (a Numba device array): the kernels, not the host, check it."""
    return cuda.to_device(x) if isinstance(x, np.ndarray) else x


def call(c: Case, kc, vc, device=False):
    """``flash_attn_with_kvcache`` on the case, the caches ``kc``/``vc`` appended in place; ``device``: the
    metadata arrays passed in device memory."""
    meta = on_device if device else (lambda x: x)
    return flashnb.flash_attn_with_kvcache(c.q, kc, vc, c.k, c.v, cache_seqlens=meta(c.cache_seqlens),
                                           block_table=meta(c.block_table), num_splits=c.num_splits,
                                           return_softmax_lse=True, **c.opts)


def oracle(c: Case):
    """The KV-cache oracle on the case: (out, lse, k_cache, v_cache after the append)."""
    lens = (np.full(c.q.shape[0], c.cache_seqlens, np.int32) if isinstance(c.cache_seqlens, int)
            else c.cache_seqlens)                             # the oracle takes an array (or None)
    return varlen.attention_with_kvcache(c.q, c.k_cache, c.v_cache, c.k, c.v, lens, c.block_table, **c.opts)


def check_case(c: Case, device=False):
    """One call against the oracle: out and lse per sequence (kernel_harness's bounds), caches bit-exact."""
    want_out, _, want_kc, want_vc = oracle(c)
    kc, vc = c.k_cache.copy(), c.v_cache.copy()
    with Untouched(c.q, c.k, c.v, c.block_table, c.cache_seqlens, c.opts):
        out, lse = call(c, kc, vc, device)
    np.testing.assert_array_equal(kc, want_kc, err_msg="k_cache after the append")
    np.testing.assert_array_equal(vc, want_vc, err_msg="v_cache after the append")
    check_outputs(c, out, lse, want_out, want_kc, want_vc)


def check_outputs(c: Case, out, lse, want_out, want_kc, want_vc):
    """out and lse of each sequence against the harness's oracle over its valid prefix (of the appended caches)."""
    assert out.shape == c.q.shape and out.dtype == c.q.dtype
    assert lse.shape == (c.q.shape[0], c.q.shape[2], c.q.shape[1]) and lse.dtype == np.float32
    batch, seqlen_q = c.q.shape[:2]
    seqlen_new = 0 if c.k is None else c.k.shape[1]
    capacity = c.k_cache.shape[1] * (1 if c.block_table is None else c.block_table.shape[1])
    lens = np.broadcast_to(capacity - seqlen_new if c.cache_seqlens is None else np.asarray(c.cache_seqlens), (batch,))
    for b in range(batch):
        n = int(lens[b]) + seqlen_new
        kb, vb = _prefix(want_kc, c.block_table, b, n), _prefix(want_vc, c.block_table, b, n)
        p = S.Problem(c.q[b:b + 1], kb[None], vb[None], np.ones_like(c.q[b:b + 1]), _per_sequence_opts(c.opts, b), 1, 1)
        exp = expected(p, backward=False)
        np.testing.assert_array_equal(exp.out, want_out[b:b + 1])      # the harness's oracle is the KV-cache oracle's
        check_forward(exp, out[b:b + 1], lse[b:b + 1], what=f"sequence {b} of {c!r}: ")


@settings(max_examples=examples(14, 16))     # GPU: each drawn specialisation compiles (seconds)
@given(c=cases())
def test_kvcache_matches_oracle(c):
    """Dense or paged, appended or not, any split count: out/lse within the harness bounds, caches exact."""
    check_case(c)


@settings(max_examples=examples(8, 8))
@given(c=cases(paged=False), data=st.data())
def test_cache_leftpad_matches_oracle(c, data):
    """flash-attn's ``cache_leftpad``: each sequence's keys start at its pad (drawn up to every row it holds,
    so a sequence may see no key), positions unchanged; on the host or in device memory, with splits, windows,
    ALiBi, an append."""
    batch = c.q.shape[0]
    seqlen_new = 0 if c.k is None else c.k.shape[1]
    capacity = c.k_cache.shape[1]
    lens = np.broadcast_to(capacity - seqlen_new if c.cache_seqlens is None else np.asarray(c.cache_seqlens), (batch,))
    pad = np.array([data.draw(st.integers(0, int(lens[b]) + seqlen_new)) for b in range(batch)], np.int32)
    device = data.draw(st.booleans())
    oracle_lens = None if c.cache_seqlens is None else np.asarray(lens, np.int32)
    want_out, want_lse, want_kc, want_vc = varlen.attention_with_kvcache(c.q, c.k_cache, c.v_cache, c.k, c.v,
                                                                         oracle_lens, cache_leftpad=pad, **c.opts)
    kc, vc = c.k_cache.copy(), c.v_cache.copy()
    with Untouched(c.q, c.k, c.v, pad, c.opts):
        out, lse = flashnb.flash_attn_with_kvcache(c.q, kc, vc, c.k, c.v, cache_seqlens=c.cache_seqlens,
                                                   cache_leftpad=on_device(pad) if device else pad,
                                                   num_splits=c.num_splits, return_softmax_lse=True, **c.opts)
    np.testing.assert_array_equal(kc, want_kc, err_msg="k_cache after the append")
    for b in range(batch):
        n = int(lens[b]) + seqlen_new
        kb, vb = want_kc[b, pad[b]:n], want_vc[b, pad[b]:n]
        p = S.Problem(c.q[b:b + 1], kb[None], vb[None], np.ones_like(c.q[b:b + 1]), _per_sequence_opts(c.opts, b), 1, 1)
        exp = expected(p, backward=False)
        np.testing.assert_array_equal(exp.out, want_out[b:b + 1])      # the witness is the leftpad oracle's
        check_forward(exp, out[b:b + 1], lse[b:b + 1], what=f"sequence {b} (pad {pad[b]}) of {c!r}: ")


def test_cache_leftpad_is_not_ignored():
    """A fixed case: the padded rows are visible without cache_leftpad and change the result."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    kc, vc = (rng.standard_normal((2, 20, 1, 8)).astype(np.float32) for _ in range(2))
    pad = np.array([7, 0], np.int32)
    out = flashnb.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=np.array([20, 20], np.int32), cache_leftpad=pad)
    want, _, _, _ = varlen.attention_with_kvcache(q, kc, vc, cache_leftpad=pad)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
    plain = flashnb.flash_attn_with_kvcache(q, kc, vc)
    assert np.abs(out[0] - plain[0]).max() > 1e-2 and np.abs(out[1] - plain[1]).max() < 1e-6


@settings(max_examples=examples(4, 8))
@given(c=cases(paged=True, append=True, options=("causal",)))
def test_paged_append_across_pages(c):
    """Appends that may cross a page boundary, pages in random order with spare pages."""
    check_case(c)


def _decode_case(dtype=np.float32, batch=2, nheads=4, nheads_k=2, headdim=4, rows=20, lens=(0, 13), new=0,
                 seed=0, paged=False, page=PAGE):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, 1, nheads, headdim)).astype(dtype)
    table = None
    if paged:
        per = -(-rows // page)
        table = np.arange(batch * per, dtype=np.int32).reshape(batch, per)[:, ::-1].copy()
        shape = (batch * per, page, nheads_k, headdim)
    else:
        shape = (batch, rows, nheads_k, headdim)
    kc, vc = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    k = v = None
    if new:
        k, v = (rng.standard_normal((batch, new, nheads_k, headdim)).astype(dtype) for _ in range(2))
    return Case(q, kc, vc, k, v, np.array(lens, np.int32), table, {}, 0)


def test_empty_cache_rows_see_nothing():
    """A sequence with no cached rows and no append: out 0, lse -inf (the other sequence is normal)."""
    c = _decode_case(lens=(0, 13))
    for splits in (1, 2):
        c.num_splits = splits
        check_case(c)
    out, lse = flashnb.flash_attn_with_kvcache(c.q, c.k_cache, c.v_cache, cache_seqlens=c.cache_seqlens,
                                               return_softmax_lse=True)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0])) and np.all(np.isfinite(lse[1]))


def test_window_masks_a_whole_split():
    """A window that leaves the first split of every row empty: its (0, -inf) partial must not disturb the merge."""
    c = _decode_case(lens=(20, 17), rows=24)
    c.opts = dict(window_size=(3, 0))
    c.num_splits = 2
    check_case(c)


def test_untouched_cache_rows_keep_nan():
    """Rows past cache_seqlens + seqlen_new are never read: NaN there changes nothing."""
    c = _decode_case(lens=(5, 9), rows=16, new=2, paged=True)
    for cache in (c.k_cache, c.v_cache):
        cache[0, 7:] = np.nan        # page 0: sequence 0's rows, 5 cached + 2 appended
        cache[1, 11:] = np.nan       # page 1: sequence 1's rows, 9 cached + 2 appended
    check_case(c)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_paged_stages_within_and_across_pages(dtype):
    """Pages of two key steps (``KPB`` keys a block step): a step inside one page takes the hoisted copies
    (decode's ``FAST_COPY``: the page's block-table entry once per step), one that crosses a page (a split
    starting off a step boundary) or the sequence's end the per-copy path; pages in reverse order.  The
    caches are views whose rows are 40 or 24 bytes apart, not 16-byte aligned (4-byte copies: in the
    simulator's two warps, the layout whose copies tile the block evenly with 32 keys a step, as 16-byte
    copies do at the GPU's shapes)."""
    headdim = 8
    lk = plan.plan_decode(np.dtype(dtype).name, 2, 2, 1, 1, headdim, 256, False, 1,
                          slots=kvcache.sm_count() * kvcache.BLOCKS_PER_SM, e_budget=kvcache.E_BUDGET).lanes_per_key
    kpb = kvcache.NWARPS * (32 // lk) * kvcache.KEYS_PER_LANE
    page = max(2 * kpb, PAGE)
    c = _decode_case(dtype, nheads=2, nheads_k=2, headdim=headdim, rows=4 * page, lens=(4 * page, 3 * page - 5),
                     paged=True, page=page)
    pad = 2 if dtype == np.float32 else 4
    want_out, _, want_kc, want_vc = oracle(c)
    wide = [np.concatenate([x, np.full(x.shape[:-1] + (pad,), np.nan, dtype)], -1) for x in (c.k_cache, c.v_cache)]
    kc, vc = (cuda.to_device(x)[:, :, :, :headdim] for x in wide)
    for splits in (1, 6):            # 6 splits: their steps start off the steps' page boundaries, some crossing one
        out, lse = flashnb.flash_attn_with_kvcache(cuda.to_device(c.q), kc, vc, cache_seqlens=c.cache_seqlens,
                                                   block_table=c.block_table, num_splits=splits,
                                                   return_softmax_lse=True)
        check_outputs(c, out.copy_to_host(), lse.copy_to_host(), want_out, want_kc, want_vc)


def test_chunked_prefill_rows_over_several_tiles():
    """A prompt chunk: 12 new tokens appended and attended causally (24 query rows of a KV head: three row tiles
    of 8), paged, over a cache that already holds 9 rows, with 2 splits."""
    rng = np.random.default_rng(5)
    batch, nheads, nheads_k, d, sq = 1, 4, 2, 4, 12
    table = np.array([[1, 0]], np.int32)
    kc, vc = (rng.standard_normal((2, PAGE, nheads_k, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((batch, sq, nheads, d)).astype(np.float32)
    k, v = (rng.standard_normal((batch, sq, nheads_k, d)).astype(np.float32) for _ in range(2))
    check_case(Case(q, kc, vc, k, v, np.array([9], np.int32), table, dict(causal=True), 2))


# ------------------------------------------------------------------------------------------------ bad input
def _bad(**changes):
    c = _decode_case(new=1, paged=True, rows=32, lens=(3, 30))
    args = dict(q=c.q, k_cache=c.k_cache, v_cache=c.v_cache, k=c.k, v=c.v, cache_seqlens=c.cache_seqlens,
                block_table=c.block_table)
    args.update(changes)
    return args


BAD = [
    ("cache_seqlens", ValueError, dict(cache_seqlens=np.array([3, 32], np.int32))),       # 32 + 1 > 32 rows
    ("cache_seqlens", ValueError, dict(cache_seqlens=np.array([-1, 3], np.int32))),
    ("cache_seqlens", TypeError, dict(cache_seqlens=np.array([3, 3], np.int64))),
    ("cache_seqlens", ValueError, dict(cache_seqlens=np.array([3], np.int32))),
    ("cache_seqlens", ValueError, dict(cache_seqlens=40)),
    ("block_table", ValueError, dict(block_table=np.array([[0, 1], [9, 2]], np.int32))),  # page 9 of 4
    ("block_table", ValueError, dict(block_table=np.array([[0, 1], [-1, 2]], np.int32))),
    ("block_table", TypeError, dict(block_table=np.array([[0, 1], [3, 2]], np.int64))),
    ("block_table", ValueError, dict(block_table=np.array([[0, 1, 2, 3]], np.int32))),
    ("page size", ValueError, dict(k_cache=np.zeros((8, 8, 2, 4), np.float32), v_cache=np.zeros((8, 8, 2, 4), np.float32))),
    ("k and v", ValueError, dict(v=None)),
    ("dtype", TypeError, dict(q=np.zeros((2, 1, 4, 4), np.float64))),
    ("head dim", ValueError, dict(q=np.zeros((2, 1, 4, 8), np.float32))),
    ("multiple", ValueError, dict(q=np.zeros((2, 1, 3, 4), np.float32))),
    ("num_splits", ValueError, dict(num_splits=-1)),
    ("k must have shape", ValueError, dict(k=np.zeros((2, 1, 1, 4), np.float32), v=np.zeros((2, 1, 1, 4), np.float32))),
]


@pytest.mark.parametrize("match, error, changes", BAD, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(BAD)])
def test_bad_input_is_refused_before_any_launch(match, error, changes):
    args = _bad(**changes)
    before = [np.array(a, copy=True) for a in (args["k_cache"], args["v_cache"])]
    with pytest.raises(error, match=match):
        flashnb.flash_attn_with_kvcache(**args)
    for a, b in zip((args["k_cache"], args["v_cache"]), before):
        np.testing.assert_array_equal(a, b, err_msg="a refused call wrote the cache")


def test_seqlens_past_touched_pages_are_not_checked():
    """Only the pages a sequence touches are checked: a garbage entry past them is allowed (as flash-attn)."""
    c = _decode_case(paged=True, rows=32, lens=(3, 5))
    c.block_table[:, 1] = 99
    check_case(c)


@pytest.mark.parametrize("headdim", [3, 5])
def test_odd_head_dim_float16_served_as_flash_attn_does(headdim):
    """An odd 16-bit head dim: padded copies, the append copied back into the caller's caches, out cut back;
    with rotary, leftpad, splits, the default scale of the unpadded head dim."""
    rng = np.random.default_rng(headdim)
    q = rng.standard_normal((2, 2, 2, headdim)).astype(np.float16)
    kc, vc = (rng.standard_normal((2, 20, 1, headdim)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((2, 2, 1, headdim)).astype(np.float16) for _ in range(2))
    lens, pad = np.array([5, 17], np.int32), np.array([1, 0], np.int32)
    cos = sin = None
    if headdim >= 4:                          # (rotary_dim is a multiple of 4, at most the head dim)
        angle = rng.uniform(0, 2 * np.pi, (20, 2))
        cos, sin = np.cos(angle).astype(np.float16), np.sin(angle).astype(np.float16)
    want_out, want_lse, want_kc, want_vc = varlen.attention_with_kvcache(
        q, kc, vc, k, v, lens, rotary_cos=cos, rotary_sin=sin, cache_leftpad=pad, causal=True)
    kc2, vc2 = kc.copy(), vc.copy()
    with Untouched(q, k, v, lens, pad, cos, sin):
        out, lse = flashnb.flash_attn_with_kvcache(q, kc2, vc2, k, v, cos, sin, lens, cache_leftpad=pad, causal=True,
                                                   num_splits=2, return_softmax_lse=True)
    assert out.shape == q.shape and out.dtype == np.float16
    np.testing.assert_array_equal(kc2, want_kc)
    np.testing.assert_array_equal(vc2, want_vc)
    np.testing.assert_allclose(out.astype(np.float64), want_out, atol=4e-3, rtol=0)   # float16 half-ulps at |v| < 4
    np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=0)


def test_odd_head_dim_refuses_a_rotary_dim_past_it():
    """Head dim 3 padded to 4 must not let a rotary_dim of 4 through: it is checked against the caller's 3."""
    q = np.ones((1, 1, 1, 3), np.float16)
    kc = np.ones((1, 16, 1, 3), np.float16)
    k = np.ones((1, 1, 1, 3), np.float16)
    table = np.ones((16, 2), np.float16)                     # rotary_dim 4
    with Untouched(q, kc, k), pytest.raises(ValueError, match=r"rotary_dim .* at most the head dim 3"):
        flashnb.flash_attn_with_kvcache(q, kc, kc.copy(), k, k, table, table, 4)


# ------------------------------------------------------------------------------------------------ device metadata
@settings(max_examples=examples(5, 8))
@given(c=cases(options=("causal", "window_size", "alibi_slopes")))
def test_device_metadata_matches_oracle(c):
    """``cache_seqlens`` / ``block_table`` in device memory: checked by the kernels, not the host, and the split
    count planned for the cache's capacity: still the oracle's results, caches exact."""
    check_case(c, device=True)


@pytest.mark.parametrize("paged", [False, True])
def test_device_metadata_gives_the_host_paths_bits(paged):
    """One split: the same kernels over the same keys as with the metadata on the host, so the same bits."""
    c = _decode_case(paged=paged, rows=32, lens=(3, 29), new=2)
    c.num_splits = 1
    runs = []
    for device in (False, True):
        kc, vc = c.k_cache.copy(), c.v_cache.copy()
        runs.append((*call(c, kc, vc, device), kc, vc))
    for what, host, dev in zip(("out", "lse", "k_cache", "v_cache"), *runs):
        np.testing.assert_array_equal(dev, host, err_msg=what)


REFUSED_LENS = (5, 31, 20, 17, 9, -3)    # rows cached; two new rows each; 32 rows a sequence (2 pages of 16)


def _refused_case(dtype, paged, splits):
    """Six sequences whose metadata (meant for device memory) is partly out of range.  Dense: sequence 1
    (31 + 2 rows > 32) and 5 (-3 rows).  Paged, also: sequence 2's second page (where its new rows go) is one
    past the pool, sequence 3's first page is -1 (its new rows go to its good second page); sequence 4's unused
    second entry is garbage (allowed: never read).  Returns (case, the sequences that must come out NaN)."""
    c = _decode_case(dtype, batch=6, nheads=2, nheads_k=1, rows=32, lens=REFUSED_LENS, new=2, seed=7, paged=paged)
    c.num_splits = splits
    if not paged:
        return c, [1, 5]
    num_pages = c.k_cache.shape[0]
    c.block_table[2, 1] = num_pages
    c.block_table[3, 0] = -1
    c.block_table[4, 1] = 99
    return c, [1, 2, 3, 5]


@pytest.mark.parametrize("dtype, paged, splits", [(np.float32, True, 1), (np.float16, True, 2), (np.float32, False, 2)])
def test_bad_device_metadata_gives_nan_for_exactly_those_sequences(dtype, paged, splits):
    """Entries out of range in device memory: NaN in every out/lse row of those sequences (through the combine
    too), no append for them, the other sequences the oracle's, and the caches unchanged outside the good
    sequences' new rows (no read or write out of range: a wild page index would fault or corrupt)."""
    c, bad = _refused_case(dtype, paged, splits)
    good = [b for b in range(c.q.shape[0]) if b not in bad]
    kc, vc = c.k_cache.copy(), c.v_cache.copy()
    out, lse = call(c, kc, vc, device=True)
    assert np.all(np.isnan(out[bad])) and np.all(np.isnan(lse[bad]))

    sub = dataclasses.replace(c, q=c.q[good], k=c.k[good], v=c.v[good], cache_seqlens=c.cache_seqlens[good])
    if paged:
        sub.block_table = c.block_table[good]
    else:
        sub.k_cache, sub.v_cache = c.k_cache[good], c.v_cache[good]
    want_out, _, sub_kc, sub_vc = oracle(sub)                 # the good sequences alone, appended
    want_kc, want_vc = sub_kc, sub_vc                         # paged: the whole pool
    if not paged:                                             # dense: their rows back in the whole batch's caches
        want_kc, want_vc = c.k_cache.copy(), c.v_cache.copy()
        want_kc[good], want_vc[good] = sub_kc, sub_vc
    np.testing.assert_array_equal(kc, want_kc, err_msg="k_cache: only the good sequences' new rows may change")
    np.testing.assert_array_equal(vc, want_vc, err_msg="v_cache: only the good sequences' new rows may change")
    check_outputs(sub, out[good], lse[good], want_out, sub_kc, sub_vc)


def test_bad_host_metadata_still_raises():
    """The same metadata on the host: a ValueError before any launch, naming the first bad entry, caches unchanged."""
    for paged, match in ((False, r"cache_seqlens\[1\]"), (True, r"cache_seqlens\[1\]")):
        c, _ = _refused_case(np.float32, paged, 1)
        kc, vc = c.k_cache.copy(), c.v_cache.copy()
        with pytest.raises(ValueError, match=match):
            call(c, kc, vc)
        np.testing.assert_array_equal(kc, c.k_cache)
        np.testing.assert_array_equal(vc, c.v_cache)
    c.cache_seqlens = np.array([5, 30, 20, 17, 9, 0], np.int32)              # lengths in range: now the pages
    with pytest.raises(ValueError, match=r"block_table\[2, :2\]"):
        call(c, c.k_cache.copy(), c.v_cache.copy())


def test_cpu_torch_metadata_is_checked_on_the_host():
    """CPU PyTorch tensors count as host metadata: checked before any launch; valid ones give the NumPy results."""
    torch = pytest.importorskip("torch")
    c, _ = _refused_case(np.float32, True, 1)
    args = dict(cache_seqlens=torch.from_numpy(c.cache_seqlens), block_table=torch.from_numpy(c.block_table))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\]"):
        flashnb.flash_attn_with_kvcache(c.q, c.k_cache.copy(), c.v_cache.copy(), c.k, c.v, **args)
    c = _decode_case(paged=True, rows=32, lens=(3, 29), new=2)
    kc, vc = c.k_cache.copy(), c.v_cache.copy()
    out = flashnb.flash_attn_with_kvcache(c.q, kc, vc, c.k, c.v, cache_seqlens=torch.from_numpy(c.cache_seqlens),
                                          block_table=torch.from_numpy(c.block_table))
    want_out, _, want_kc, _ = oracle(c)
    np.testing.assert_array_equal(kc, want_kc)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ candidates
def simulator_settings(spec):
    """A ``tools.tune_decode`` candidate (``flashnb.kvcache`` settings timed against the default on the
    GPU) for these tests' tiny head dims: E_BUDGET = 16, with which they take 1-2 lanes per key and 64-128-key
    steps, so that the LEAN kernel's hoisted copies (whole stages of a dense cache) and its steps without the
    range mask run; in the simulator also half the warps (its default is 2, the GPU's 4)."""
    values = tune_decode.parse_variant(spec)
    if SIMULATOR and "NWARPS" in values:
        values["NWARPS"] //= 2
    values["E_BUDGET"] = 16
    return values


LONG = [  # (dtype, head dim, group, rows, lens, new, paged, splits, options): several whole 64-key steps
    (np.float16, 16, 1, 300, (290, 17), 2, False, 0, {}),
    (np.float32, 8, 1, 300, (250, 131), 1, True, 2, {}),
    (np.float16, 16, 2, 300, (297, 100), 3, True, 1, dict(window_size=(70, 0))),
]


def _long_case(dtype, d, group, rows, lens, new, paged, splits, opts):
    c = _decode_case(dtype, batch=len(lens), nheads=group, nheads_k=1, headdim=d, rows=rows, lens=lens, new=new,
                     seed=3, paged=paged)
    c.num_splits, c.opts = splits, dict(opts)
    return c


@pytest.mark.parametrize("case", LONG, ids=["dense-f16", "paged-f32", "paged-window-f16"])
def test_lean_decode_matches_oracle(case, monkeypatch):
    """The LEAN decode kernel: dense whole stages through the hoisted copy offsets (the last one clamped),
    interior steps without the range mask, the window's steps with it, paged stages the generic way."""
    for name, value in simulator_settings("LEAN=1").items():
        monkeypatch.setattr(kvcache, name, value)
    check_case(_long_case(*case))


@pytest.mark.parametrize("spec", [v for v in tune_decode.VARIANTS if v != "LEAN=1"])
def test_decode_variants_match_oracle(spec, monkeypatch):
    """The other candidates of ``tools.tune_decode`` (more stages and blocks, twice the warps)."""
    for name, value in simulator_settings(spec).items():
        monkeypatch.setattr(kvcache, name, value)
    check_case(_long_case(*LONG[0]))


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True])
def test_torch_decode_long_cache(dtype, paged):
    """PyTorch CUDA tensors, the issue's head layout (8 KV heads, 4 query heads each, d = 128), 3000-4100 cached
    keys, one new token appended, automatic splits: out against the oracle in float64 within flash-attn's rule."""
    import torch
    from kernel_harness import round_bf16
    tdt = getattr(torch, dtype)
    rng = np.random.default_rng(1)
    batch, nheads, nheads_k, d, page = 2, 32, 8, 128, 256
    lens = np.array([3000, 4095], np.int32)
    capacity = 4352
    q = rng.standard_normal((batch, 1, nheads, d)).astype(np.float32)
    kn, vn = (rng.standard_normal((batch, 1, nheads_k, d)).astype(np.float32) for _ in range(2))
    if paged:
        per = capacity // page
        table = rng.permutation(batch * per).reshape(batch, per).astype(np.int32)
        shape = (batch * per, page, nheads_k, d)
    else:
        table, shape = None, (batch, capacity, nheads_k, d)
    kc, vc = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    rnd = (lambda x: x.astype(np.float16).astype(np.float32)) if dtype == "float16" else round_bf16
    q, kn, vn, kc, vc = (rnd(x) for x in (q, kn, vn, kc, vc))
    dev = lambda x: torch.from_numpy(x).to("cuda", tdt)
    tkc, tvc = dev(kc), dev(vc)
    out, lse = flashnb.flash_attn_with_kvcache(dev(q), tkc, tvc, dev(kn), dev(vn),
                                               cache_seqlens=torch.from_numpy(lens).cuda(),
                                               block_table=None if table is None else torch.from_numpy(table).cuda(),
                                               causal=True, return_softmax_lse=True)
    torch.cuda.synchronize()
    want_out, want_lse, want_kc, _ = varlen.attention_with_kvcache(q, kc, vc, kn, vn, lens, table, causal=True)
    np.testing.assert_array_equal(tkc.float().cpu().numpy(), want_kc)
    got = out.float().cpu().numpy()
    err = np.max(np.abs(got - want_out))
    low = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[dtype] * np.max(np.abs(want_out))
    assert err <= 4 * low, f"max |kernel - oracle| = {err:.3g}, 4 half-ulps of the output = {4 * low:.3g}"
    np.testing.assert_allclose(lse.cpu().numpy(), want_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_stages_fit_the_shared_memory_at_every_head_dim(dtype):
    """At the GPU's settings (8 warps, one block an SM, 192 KB of stages, 64 values a lane), every head dim and
    row count gets stages that fit, or none (the registers' pipeline): float32 rows of 64+ dims with one query row
    asked 256 KB before (two stages of 128 KB), which the launch refused."""
    from flashnb.kernels import decode
    for rows in (1, 2, 4, 8):
        for head_dim in range(8, 257, 8):
            for vec16 in (False, True):
                lk = decode.lane_layout(head_dim, dtype, rows, vec16, 64)[0]
                st_ = decode.stages_that_fit(4, dtype, head_dim, lk, kvcache.KEYS_PER_LANE, 8, 192 * 1024)
                size = decode.stage_size(dtype, head_dim, lk, kvcache.KEYS_PER_LANE, 8)
                assert st_ == 0 or 2 <= st_ <= 4 and st_ * size <= 192 * 1024, (rows, head_dim, vec16, st_)
    assert decode.stages_that_fit(4, "float32", 64, 2, 2, 8, 192 * 1024) == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_decode_without_stages_matches_oracle(dtype, monkeypatch):
    """Stages that do not fit fall back to the registers' pipeline (``STAGES`` 0): the same results."""
    monkeypatch.setattr(kvcache, "STAGE_BYTES_PER_SM", 1)
    c = _decode_case(dtype, lens=(20, 13), rows=24, new=1)
    for splits in (1, 2):
        c.num_splits = splits
        check_case(c)
