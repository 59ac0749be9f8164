"""Packed (varlen) batches: flashnb.flash_attn_varlen_func / flash_attn_varlen_backward against the oracle.

The oracle (reference.attention_varlen) is standard attention of each sequence on its own; so each sequence of
a drawn packed batch is checked as its own dense problem under kernel_harness's tolerances (float64 1e-10 and
float32 1e-4 relative to the result's scale, float16 2x the float16 oracle's error + floor), its rows cut out
of the packed results.  Sequences with no queries or no keys must give exact zeros (and lse = -inf).  Drawn:
batches of 1-3 sequences of random lengths (0 included: empty sequences first, in the middle, last),
seqlen_q != seqlen_k per sequence, tiles longer and shorter than the sequences, MHA/GQA, odd head dims,
causal / windows / ALiBi per head or per sequence / softcap / any softmax scale, both backends (the
tensor-core kernels run in the simulator through their primitive twins), the atomic and the deterministic
dQ.  Outputs are NaN-poisoned before the launch (a row no block writes fails), inputs must come back
bit-identical.  A packed batch of equal lengths is the dense batch: bit-identical to flash_attention.

The simulator runs ~3600 threads/s, so its grids are tiny (a few tiles per sequence); on a GPU the same
properties draw sequences of hundreds of rows, the default tiles and head dims up to 256.
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import flashnb
import reference
from flashnb import plan
import strategies as S
from flashnb.kernels._jit import SIMULATOR
from kernel_harness import (HEADDIMS, Untouched, assert_bitwise_equal, check_backward, check_forward, examples,
                            expected, poison_outputs)  # noqa: F401 (autouse fixture)

if SIMULATOR:
    MAX_LEN, MAX_BATCH, SIMT_TILES, TC_TILES = 9, 3, (2, 4, 8), (16,)
    TC_HEADDIMS = (2, 4, 6, 16)
    WG_TILES_Q, WG_TILES_K, WG_HEADDIMS = (64,), (16,), (8, 16, 40)      # (64 keys: the pinned example)
else:
    MAX_LEN, MAX_BATCH, SIMT_TILES, TC_TILES = 300, 4, (None, 16, 32, 64), (None, 16, 32, 64)
    TC_HEADDIMS = (8, 32, 64, 80, 128, 256)
    WG_TILES_Q, WG_TILES_K, WG_HEADDIMS = (None, 64, 128), (None, 64, 128), (64, 72, 128, 256)


@dataclasses.dataclass
class Packed:
    """A packed batch: q, dout ``(total_q, nheads, headdim)``, k, v ``(total_k, nheads_k, headdim)``, the
    sequences' boundaries, the options (as for the dense call), tiles, backend, deterministic dQ."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    opts: dict
    block_q: object
    block_k: object
    backend: str
    deterministic: bool

    @property
    def batch(self):
        return self.cu_q.shape[0] - 1

    @property
    def max_seqlens(self):
        return int(np.max(np.diff(self.cu_q), initial=0)), int(np.max(np.diff(self.cu_k), initial=0))

    def sequence(self, b):
        """Sequence ``b`` as a dense ``strategies.Problem`` of batch 1 (the oracle's definition)."""
        sq, sk = slice(self.cu_q[b], self.cu_q[b + 1]), slice(self.cu_k[b], self.cu_k[b + 1])
        opts = dict(self.opts)
        alibi = opts.get("alibi_slopes")
        if alibi is not None and alibi.ndim == 2:
            opts["alibi_slopes"] = alibi[b]
        return S.Problem(self.q[None, sq], self.k[None, sk], self.v[None, sk], self.dout[None, sq], opts,
                         self.block_q or 8, self.block_k or 8)


@st.composite
def packed_problems(draw, *, backend="simt", dtypes=(np.float64, np.float32, np.float16), lengths=None):
    """A ``Packed`` batch sized for where the kernels run; ``lengths``: a strategy for (lens_q, lens_k)."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    if backend == "tensorcore":
        block_q, block_k = draw(st.sampled_from(TC_TILES)), draw(st.sampled_from(TC_TILES))
        headdim = draw(st.sampled_from(TC_HEADDIMS))
    elif backend == "wgmma":
        block_q, block_k = draw(st.sampled_from(WG_TILES_Q)), draw(st.sampled_from(WG_TILES_K))
        headdim = draw(st.sampled_from(WG_HEADDIMS))
    else:
        block_q, block_k = draw(st.sampled_from(SIMT_TILES)), draw(st.sampled_from(SIMT_TILES))
        headdim = draw(st.sampled_from(HEADDIMS))
    if lengths is None:
        batch = draw(st.integers(1, MAX_BATCH))
        length = st.integers(0, MAX_LEN)                 # 0 among them: Hypothesis favours the bounds
        lens_q = draw(st.lists(length, min_size=batch, max_size=batch))
        lens_k = draw(st.one_of(st.just(lens_q), st.lists(length, min_size=batch, max_size=batch)))
    else:
        lens_q, lens_k = draw(lengths)
    nheads_k = draw(st.integers(1, 2))
    nheads = nheads_k * draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q_scale = draw(st.sampled_from((1.0, 3.0) if dtype == np.float16 else (1.0, 10.0, 100.0)))

    def normal(rows, heads, factor=1.0):
        return (rng.standard_normal((rows, heads, headdim)) * factor).astype(dtype)

    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    opts = {}
    longest = max(lens_q + lens_k + [1])
    if draw(st.booleans()):
        opts["causal"] = True
    if draw(st.booleans()):
        side = st.one_of(st.just(-1), st.integers(0, longest))
        opts["window_size"] = (draw(side), draw(side))
    if draw(st.booleans()):
        shape = draw(st.sampled_from(((nheads,), (len(lens_q), nheads))))
        opts["alibi_slopes"] = rng.uniform(0.0, 1.0, shape)
    if draw(st.booleans()):
        opts["softcap"] = draw(st.floats(0.5, 20.0))
    if draw(st.booleans()):
        opts["softmax_scale"] = draw(st.one_of(st.floats(0.05, 1.5), st.floats(-1.0, 0.0)))
    deterministic = backend == "simt" and draw(st.booleans())
    return Packed(normal(cu_q[-1], nheads, q_scale), normal(cu_k[-1], nheads_k), normal(cu_k[-1], nheads_k),
                  normal(cu_q[-1], nheads), cu_q, cu_k, opts, block_q, block_k, backend, deterministic)


def _launch(fn, p: Packed, *args, **kw):
    """On a GPU, explicit tiles the planner refuses for this device (shared memory, threads per block) are a
    rejected example, as in kernel_harness; in the simulator every drawn call must run."""
    try:
        return fn(*args, **kw)
    except ValueError as e:
        limits = ("shared memory" in str(e) or "threads" in str(e))
        if not SIMULATOR and (p.block_q is not None or p.block_k is not None) and limits:
            from hypothesis import reject
            reject()
        raise


def varlen_forward(p: Packed, **extra):
    kw = dict(p.opts, block_q=p.block_q, block_k=p.block_k, backend=p.backend, return_lse=True)
    kw.update(extra)
    with Untouched(p.q, p.k, p.v, p.cu_q, p.cu_k, kw):
        return _launch(flashnb.flash_attn_varlen_func, p, p.q, p.k, p.v, p.cu_q, p.cu_k, *p.max_seqlens, **kw)


def varlen_backward(p: Packed, out, lse):
    kw = dict(p.opts, block_q=p.block_q, block_k=p.block_k, backend=p.backend, deterministic=p.deterministic)
    with Untouched(p.dout, p.q, p.k, p.v, out, lse, p.cu_q, p.cu_k, kw):
        return _launch(flashnb.flash_attn_varlen_backward, p, p.dout, p.q, p.k, p.v, out, lse, p.cu_q, p.cu_k,
                       *p.max_seqlens, **kw)


def check_packed(p: Packed, out, lse, grads=None):
    """Every sequence against the dense oracle of that sequence alone (kernel_harness's bounds); a sequence with
    no queries or no keys: exact zeros (lse -inf).  Shapes and dtypes of the packed results first."""
    total_q, nheads, _ = p.q.shape
    assert out.shape == p.q.shape and out.dtype == p.q.dtype, (out.shape, out.dtype)
    assert lse.shape == (nheads, total_q), lse.shape
    assert lse.dtype == (np.float64 if p.q.dtype == np.float64 else np.float32), lse.dtype
    for b in range(p.batch):
        sq, sk = slice(p.cu_q[b], p.cu_q[b + 1]), slice(p.cu_k[b], p.cu_k[b + 1])
        n_q, n_k = sq.stop - sq.start, sk.stop - sk.start
        what = f"sequence {b} ({n_q} queries, {n_k} keys): "
        seq_grads = None if grads is None else (grads[0][None, sq], grads[1][None, sk], grads[2][None, sk])
        if n_q == 0 or n_k == 0:
            assert np.all(out[sq] == 0) and np.all(np.isneginf(lse[:, sq])), what + "out must be 0, lse -inf"
            if grads is not None:
                for name, g in zip(("dq", "dk", "dv"), seq_grads):
                    assert np.all(g == 0), what + f"{name} must be 0"
            continue
        seq = p.sequence(b)
        exp = expected(seq, backward=grads is not None)
        check_forward(exp, out[None, sq], lse[None, :, sq], what)
        if grads is not None:
            check_backward(exp, seq_grads, what)


def _forward_backward_match_oracle(p: Packed):
    out, lse = varlen_forward(p)
    grads = varlen_backward(p, out, lse)
    check_packed(p, out, lse, grads)


# the pinned examples: no queries and 4 keys, 5 queries and no keys, nothing, 3 queries and 7 keys
@settings(max_examples=examples(8, 25))
@given(p=packed_problems())
@example(p=Packed(*(np.linspace(-1, 1, n * 2 * 3).reshape(n, 2, 3) for n in (8, 11, 11, 8)),
                  np.array([0, 0, 5, 5, 8], np.int32), np.array([0, 4, 4, 4, 11], np.int32),
                  {"causal": True}, 2, 4, "simt", False))            # block_q < block_k: the dQ pass
@example(p=Packed(*(np.linspace(-1, 1, n * 2 * 3).reshape(n, 2, 3) for n in (8, 11, 11, 8)),
                  np.array([0, 0, 5, 5, 8], np.int32), np.array([0, 4, 4, 4, 11], np.int32),
                  {"window_size": (3, 0), "alibi_slopes": np.linspace(0.1, 0.9, 8).reshape(4, 2)}, 4, 2, "simt",
                  False))                                                 # block_q >= block_k: atomic dQ
def test_varlen_simt_matches_oracle(p):
    """SIMT forward and backward (atomic or deterministic dQ), every packed option, float64/32/16."""
    _forward_backward_match_oracle(p)


@settings(max_examples=examples(5, 15))
@given(p=packed_problems(backend="tensorcore", dtypes=(np.float16,)))
@example(p=Packed(*(np.linspace(-2, 2, n * 2 * 4).reshape(n, 2, 4).astype(np.float16) for n in (8, 11, 11, 8)),
                  np.array([0, 0, 5, 5, 8], np.int32), np.array([0, 4, 4, 4, 11], np.int32),
                  {"window_size": (2, 1)}, 16, 16, "tensorcore", False))
def test_varlen_tensorcore_matches_oracle(p):
    """Tensor-core forward and backward (mma.sync twins in the simulator), float16."""
    _forward_backward_match_oracle(p)


def _with_poisoned_neighbour(p: Packed, rows):
    """p with a sequence of no queries and ``rows`` keys of non-finite K and V (NaN, inf, -inf) inserted after
    its first: a tile past the first sequence's end that reads whole rows of the packed tensor (the Hopper
    forward's copy engine) reads them, and no other sequence's result may."""
    bad = np.array([np.nan, np.inf, -np.inf])[np.arange(rows * p.k.shape[1] * p.k.shape[2]) % 3]
    bad = bad.reshape(rows, *p.k.shape[1:]).astype(p.k.dtype)
    at = p.cu_k[1]
    opts = dict(p.opts)
    alibi = opts.get("alibi_slopes")
    if alibi is not None and alibi.ndim == 2:
        opts["alibi_slopes"] = np.insert(alibi, 1, alibi[0], axis=0)
    return dataclasses.replace(
        p, k=np.concatenate([p.k[:at], bad, p.k[at:]]), v=np.concatenate([p.v[:at], bad[::-1], p.v[at:]]),
        cu_q=np.insert(p.cu_q, 1, p.cu_q[1]).astype(np.int32),
        cu_k=np.concatenate([p.cu_k[:2], p.cu_k[1:] + rows]).astype(np.int32), opts=opts)


@settings(max_examples=examples(3, 12), deadline=None)
@given(p=packed_problems(backend="wgmma", dtypes=(np.float16,)), poison=st.integers(0, 20))
@example(p=Packed(*(np.linspace(-2, 2, n * 2 * 8).reshape(n, 2, 8).astype(np.float16) for n in (8, 11, 11, 8)),
                  np.array([0, 0, 5, 5, 8], np.int32), np.array([0, 4, 4, 4, 11], np.int32),
                  {"causal": True}, None, None, "wgmma", False), poison=3)
@example(p=Packed(*(np.linspace(-2, 2, n * 2 * 16).reshape(n, 2, 16).astype(np.float16) for n in (8, 11, 11, 8)),
                  np.array([0, 0, 5, 5, 8], np.int32), np.array([0, 4, 4, 4, 11], np.int32),
                  {"window_size": (2, 1)}, 64, 64, "wgmma", False), poison=0)   # the Hopper dK/dV kernel
def test_varlen_wgmma_matches_oracle(p, poison):
    """The Hopper forward (its tiles by the copy engine as rows of the packed tensor) and the backward of
    backend="wgmma" (the Hopper dK/dV kernel, ``plan.WGMMA_BACKWARD_PACKED``, where its key tiles are whole
    warpgroups), float16; with
    ``poison`` rows of non-finite keys and values after the first sequence (a sequence of no queries), every
    sequence's forward still its own oracle's."""
    if poison:
        p = _with_poisoned_neighbour(p, poison)
        out, lse = varlen_forward(p)
        check_packed(p, out, lse)
        return
    built = []
    real = plan.make_dkdv_tc
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "make_dkdv_tc", lambda *a, **kw: (built.append(kw), real(*a, **kw))[1])
        mp.setattr(plan, "WGMMA_BACKWARD_PACKED", True)          # (its default; kept should it be switched off)
        _forward_backward_match_oracle(p)
    if built and (p.block_k or 128) % 64 == 0 and p.q.shape[2] <= 128 and p.cu_k[-1] > 0:   # (no keys: no kernel)
        assert built[-1].get("WGMMA") and built[-1].get("VARLEN"), built[-1]


@settings(max_examples=examples(3, 10))
@given(data=st.data(), backend=st.sampled_from(("simt", "tensorcore")))
def test_varlen_of_equal_lengths_is_the_dense_batch_bit_for_bit(data, backend):
    """Sequences of one length packed are a dense batch: the same bits as flash_attention on it (forward, lse,
    and with the deterministic SIMT dQ or the dK/dV of either backend, the backward)."""
    batch, n_q, n_k = data.draw(st.integers(1, 2)), data.draw(st.integers(1, MAX_LEN)), data.draw(st.integers(1, MAX_LEN))
    p = data.draw(packed_problems(backend=backend, dtypes=(np.float32,) if backend == "simt" else (np.float16,),
                                  lengths=st.just(([n_q] * batch, [n_k] * batch))))
    out, lse = varlen_forward(p)
    dense = lambda x: x.reshape((batch, -1) + x.shape[1:])                   # noqa: E731
    kw = dict(p.opts, block_q=p.block_q, block_k=p.block_k, backend=backend)
    out_d, lse_d = flashnb.flash_attention(dense(p.q), dense(p.k), dense(p.v), return_lse=True, **kw)
    assert_bitwise_equal(out, out_d.reshape(out.shape), "out, packed vs dense")
    assert_bitwise_equal(lse, lse_d.transpose(1, 0, 2).reshape(lse.shape), "lse, packed vs dense")
    grads = varlen_backward(p, out, lse)
    grads_d = flashnb.flash_attention_backward(dense(p.dout), dense(p.q), dense(p.k), dense(p.v), out_d, lse_d,
                                               deterministic=p.deterministic, **kw)
    for name, g, gd in zip(("dq", "dk", "dv"), grads, grads_d):
        if name == "dq" and not p.deterministic:
            continue                                          # atomic dQ: the summation order may differ
        assert_bitwise_equal(g, gd.reshape(g.shape), f"{name}, packed vs dense")


def test_varlen_oracle_agrees_with_the_per_sequence_check():
    """check_packed's per-sequence oracle is reference.attention_varlen's definition: on a pinned batch the two
    give the same out, lse and gradients (so the kernel tests hold the kernels to the varlen oracle)."""
    p = Packed(*(np.random.default_rng(n).standard_normal((n, 2, 3)) for n in (8, 11, 11, 8)),
               np.array([0, 0, 5, 5, 8], np.int32), np.array([0, 4, 4, 4, 11], np.int32),
               {"causal": True, "alibi_slopes": np.full((4, 2), 0.5)}, 2, 4, "simt", False)
    out, lse = reference.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, **p.opts)
    grads = reference.attention_varlen_backward(p.dout, p.q, p.k, p.v, p.cu_q, p.cu_k, **p.opts)
    check_packed(p, out, lse, grads)
    with pytest.raises(AssertionError):
        check_packed(p, out + np.where(np.arange(8)[:, None, None] == 6, 1e-3, 0.0), lse, grads)


# ------------------------------------------------------------------------------------------------ bad input
def _small():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((7, 2, 4)).astype(np.float32)
    k = rng.standard_normal((5, 1, 4)).astype(np.float32)
    return q, k, k.copy(), np.array([0, 3, 7], np.int32), np.array([0, 5, 5], np.int32)


@pytest.mark.parametrize("change, error, message", [
    (dict(cu_q=np.array([0, 3, 7], np.int64)), TypeError, "cu_seqlens_q must be int32"),
    (dict(cu_k=[0, 5, 5]), TypeError, "cu_seqlens_k must be a NumPy"),
    (dict(cu_q=np.array([[0, 3, 7]], np.int32)), ValueError, r"cu_seqlens_q must have shape \(batch \+ 1,\)"),
    (dict(cu_q=np.array([], np.int32)), ValueError, r"cu_seqlens_q must have shape \(batch \+ 1,\)"),
    (dict(cu_q=np.array([1, 3, 7], np.int32)), ValueError, "cu_seqlens_q must start at 0 and never decrease"),
    (dict(cu_k=np.array([0, 5, 4], np.int32)), ValueError, "cu_seqlens_k must start at 0 and never decrease"),
    (dict(cu_q=np.array([0, 3, 6], np.int32)), ValueError, r"cu_seqlens_q\[-1\] must be the total number of rows 7"),
    (dict(cu_k=np.array([0, 5, 9], np.int32)), ValueError, r"cu_seqlens_k\[-1\] must be the total number of rows 5"),
    (dict(cu_k=np.array([0, 2, 3, 5], np.int32)), ValueError, "must describe one batch"),
    (dict(max_q=3), ValueError, "max_seqlen_q = 3 is shorter than the longest sequence of cu_seqlens_q"),
    (dict(max_k=4), ValueError, "max_seqlen_k = 4 is shorter"),
    (dict(max_q=4.0), TypeError, "max_seqlen_q must be an int"),
    (dict(q=np.zeros((1, 7, 2, 4), np.float32)), ValueError, "q must have 3 dimensions"),
    (dict(k=np.zeros((5, 3, 4), np.float32)), ValueError, "k and v must have the same shape"),
    (dict(dropout_p=0.1), ValueError, "dropout_p is not defined for packed"),
    (dict(attn_mask=np.ones((7, 5), bool)), ValueError, "attn_mask is not defined for packed"),
    (dict(attn_bias=np.ones((7, 5))), ValueError, "attn_bias is not defined for packed"),
    (dict(block_mask=np.ones((1, 1), bool)), ValueError, "block_mask is not defined for packed"),
    (dict(alibi_slopes=np.ones((3, 2))), ValueError, r"alibi_slopes must have shape \(2,\) or \(2, 2\)"),
])
def test_varlen_bad_input_raises_before_any_launch(change, error, message, monkeypatch):
    """Each malformed argument: the error names it, and no kernel was launched (none may read out of bounds)."""
    from flashnb import api
    launched = []
    monkeypatch.setattr(api, "_run", lambda *a: launched.append(a))
    q, k, v, cu_q, cu_k = _small()
    args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=4, max_k=5)
    kw = {}
    for name, value in change.items():
        (args if name in args else kw)[name] = value
    if "k" in change:
        args["v"] = np.zeros((5, 1, 4), np.float32)
    positional = (args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"], args["max_q"], args["max_k"])
    with pytest.raises(error, match=message):
        flashnb.flash_attn_varlen_func(*positional, **kw)
    out = np.zeros_like(q)
    lse = np.zeros((2, 7), np.float32)
    with pytest.raises(error, match=message):
        flashnb.flash_attn_varlen_backward(out, *positional[:3], out, lse, *positional[3:], **kw)
    assert not launched


def test_varlen_backend_refusal_is_the_dense_calls():
    """backend="tensorcore" on what the tensor cores cannot serve (float64) raises the planner's ValueError."""
    q, k, v, cu_q, cu_k = (x.astype(np.float64) if x.dtype == np.float32 else x for x in _small())
    with pytest.raises(ValueError, match="backend='tensorcore' cannot serve this call"):
        flashnb.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, backend="tensorcore")
    with pytest.raises(ValueError, match="backend='tensorcore' cannot serve this call"):
        flashnb.flash_attn_varlen_backward(q, q, k, v, q, np.zeros((2, 7)), cu_q, cu_k, 4, 5, backend="tensorcore")


@pytest.mark.parametrize("name, value, error, message", [
    ("lse", np.zeros((7, 2), np.float32), ValueError, r"lse must have shape \(2, 7\)"),
    ("lse", np.zeros((2, 7), np.float16), TypeError, "lse must be float32 or float64"),
    ("out", np.zeros((7, 2, 4), np.float64), TypeError, "out has dtype float64 but q has float32"),
    ("dout", np.zeros((6, 2, 4), np.float32), ValueError, r"dout must have shape \(7, 2, 4\)"),
    ("deterministic", 1, TypeError, "deterministic must be a bool"),
])
def test_varlen_backward_bad_arrays(name, value, error, message):
    q, k, v, cu_q, cu_k = _small()
    args = dict(dout=np.zeros_like(q), out=np.zeros_like(q), lse=np.zeros((2, 7), np.float32), deterministic=False)
    args[name] = value
    with pytest.raises(error, match=message):
        flashnb.flash_attn_varlen_backward(args["dout"], q, k, v, args["out"], args["lse"], cu_q, cu_k, 4, 5,
                                           deterministic=args["deterministic"])


def test_varlen_no_sequences_and_no_rows():
    """A batch of no sequences, and sequences that are all empty: empty results, nothing launched."""
    q = np.zeros((0, 2, 4), np.float32)
    for cu in (np.array([0], np.int32), np.array([0, 0, 0], np.int32)):
        out, lse = flashnb.flash_attn_varlen_func(q, q[:, :1], q[:, :1], cu, cu, 0, 0, return_lse=True)
        assert out.shape == (0, 2, 4) and lse.shape == (2, 0)
        grads = flashnb.flash_attn_varlen_backward(q, q, q[:, :1], q[:, :1], out, lse, cu, cu, 0, 0)
        assert [g.shape for g in grads] == [(0, 2, 4), (0, 1, 4), (0, 1, 4)]


# ------------------------------------------------------------------------------------------------ GPU, PyTorch
@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [64, 128])
def test_varlen_torch_cuda_each_sequence_is_its_dense_call_bit_for_bit(dtype_name, causal, headdim):
    """On CUDA tensors (the tensor-core kernels, as training would call them): every sequence of a packed batch
    of random lengths (one empty) gives the same bits as flash_attention on that sequence alone (out, lse, dK,
    dV; dQ, summed with atomics in either order, within the float32 accumulator's rounding of the output), and
    flashnb.torch.flash_attn_varlen_func's gradients are the backward's."""
    torch = pytest.importorskip("torch")
    import flashnb.torch as ft
    gen = torch.Generator(device="cuda").manual_seed(headdim + causal)
    dtype = getattr(torch, dtype_name)
    lens_q = [700, 0, 1, 129, 1024, 77]
    lens_k = [700, 5, 300, 129, 1100, 77]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 8, headdim, device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, headdim, device="cuda", dtype=dtype, generator=gen, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    out, lse, _ = ft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    grads = flashnb.flash_attn_varlen_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_q,
                                               cu_k, max(lens_q), max(lens_k), causal=causal)
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        assert torch.equal(a, b) or name == "dq", f"{name}: the torch layer's gradient is not the backward's"
    for b in range(len(lens_q)):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0:
            assert torch.all(dk[sk] == 0) and torch.all(dv[sk] == 0), f"sequence {b}: no queries, dK, dV must be 0"
            continue
        qs, ks, vs = (x.detach()[s][None] for x, s in ((q, sq), (k, sk), (v, sk)))
        o, l = flashnb.flash_attention(qs, ks, vs, causal=causal, return_lse=True)
        g = flashnb.flash_attention_backward(dout[sq][None], qs, ks, vs, o, l, causal=causal)
        assert torch.equal(out.detach()[sq], o[0]), f"sequence {b}: out differs from its dense call"
        assert torch.equal(lse[:, sq], l[0]), f"sequence {b}: lse differs from its dense call"
        assert torch.equal(dk[sk], g[1][0]) and torch.equal(dv[sk], g[2][0]), f"sequence {b}: dK/dV differ"
        tol = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        torch.testing.assert_close(dq[sq], g[0][0], rtol=tol, atol=tol * float(g[0].abs().max()))
