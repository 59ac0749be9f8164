"""flashnb.flex_attention / flex_attention_backward / create_block_mask against the oracle (reference.flex),
which runs the very same Python functions over NumPy index grids.

The functions are drawn from a family (issue 43): score_mods ALiBi, softcap (math.tanh, with its
score_mod_grad), a relative-position bias table captured from the closure, a per-head scale (the three
differentiated by the complex step); mask_mods
causal, a sliding window, a document mask (captured document ids), prefix-LM; each alone or one of each.
float64 within 1e-10 and float32 within 1e-4 of the result's scale (the SIMT kernels' arithmetic; the scores
are at most ~50 in size here); float16 by flash-attn's rule against the oracle computed in float16
(``reference.flex``'s ``dtype=``).  The states of create_block_mask equal reference.flex.block_states exactly;
the built-in options written as mods give the built-in options' results; bad functions are refused before
any launch, naming the argument.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from numba import cuda

import flashnb
from kernel_harness import examples, poison_outputs  # noqa: F401 (autouse fixture)
from reference import flex as rf


def score_mods(rng, H, L, S):
    slopes = np.array([0.5 ** (h + 1) for h in range(H)])
    table = rng.standard_normal(L + S)                         # bias by relative position, captured

    def alibi(score, b, h, q_idx, kv_idx):
        return score - 0.5 * (h + 1) * abs(q_idx - kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):          # math.tanh: no complex step, so its derivative is given
        return 3.0 * math.tanh(score / 3.0)

    def softcap_grad(score, b, h, q_idx, kv_idx):
        return 1.0 - math.tanh(score / 3.0) ** 2

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + S]

    def head_scale(score, b, h, q_idx, kv_idx):
        return score * (1.0 + slopes[0] * h)

    def batch_head(score, b, h, q_idx, kv_idx):          # b and h reach the function as the oracle's
        return score + 0.3 * b * (kv_idx % 2) - 0.2 * h * (kv_idx % 3)   # (a constant along the keys would cancel)

    mods = {"alibi": alibi, "softcap": softcap, "rel_bias": rel_bias, "head_scale": head_scale,
            "batch_head": batch_head}
    return mods, {"softcap": softcap_grad}


def mask_mods(rng, L, S):
    docs = np.sort(rng.integers(0, 3, max(L, S)))                # document ids of packed sequences, captured
    window = int(rng.integers(1, 6))
    prefix = int(rng.integers(0, S + 1))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    def document(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    def checker(b, h, q_idx, kv_idx):                    # depends on b and h: states of shape (B, H) differ
        return (q_idx + kv_idx + 3 * h + 5 * b) % 4 != 0

    return {"causal": causal, "sliding": sliding, "document": document, "prefix_lm": prefix_lm, "checker": checker}


@st.composite
def flex_problems(draw, dtypes=(np.float64, np.float32, np.float16)):
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    B, Hk = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = Hk * draw(st.sampled_from([1, 2]))
    L, S = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    E = draw(st.sampled_from([4, 8, 16]))
    dtype = draw(st.sampled_from(dtypes))
    sm = draw(st.sampled_from([None, "alibi", "softcap", "rel_bias", "head_scale", "batch_head"]))
    mm = draw(st.sampled_from([None, "causal", "sliding", "document", "prefix_lm", "checker"]))
    mask_dims = draw(st.sampled_from([(B, H)] if mm == "checker" else [(None, None), (B, None), (B, H)]))
    block = draw(st.sampled_from([(4, 4), (8, 4), (16, 16), (128, 128)]))
    q = rng.standard_normal((B, H, L, E)).astype(dtype)
    k, v = (rng.standard_normal((B, Hk, S, E)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal((B, H, L, E)).astype(dtype)
    mods, grads = score_mods(rng, H, L, S)
    score_mod, score_mod_grad = (None, None) if sm is None else (mods[sm], grads.get(sm))
    mask_mod = None if mm is None else mask_mods(rng, L, S)[mm]
    return dict(q=q, k=k, v=v, dout=dout, score_mod=score_mod, score_mod_grad=score_mod_grad, mask_mod=mask_mod,
                block=block,
                mask_dims=mask_dims, what=f"{dtype.__name__} B{B} H{H}/{Hk} L{L} S{S} E{E} {sm} {mm} {block}")


HALF_ULP16 = 2.0 ** -11


def _tol(dtype, ref, low=None):
    """float64: 1e-10, float32: 1e-4 of the scale (1 + max |ref|).  float16 (computed in float32): flash-attn's
    rule, twice the float16 oracle's error plus a floor of half a float16 ulp and the float32 bound."""
    scale = 1.0 + float(np.max(np.abs(ref), initial=0.0))
    if dtype != np.float16:
        return (1e-10 if dtype == np.float64 else 1e-4) * scale
    err16 = float(np.max(np.abs(np.asarray(low, np.float64) - ref), initial=0.0))
    return 2 * err16 + (HALF_ULP16 + 1e-4) * scale


def _close(got, ref, dtype, what, low=None):
    got = np.asarray(got, np.float64)
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), finite), f"{what}: non-finite entries differ"
    err = float(np.max(np.abs(got[finite] - ref[finite]), initial=0.0))
    bound = _tol(dtype, ref[finite], None if low is None else np.asarray(low)[finite])
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"
    assert np.array_equal(got[~finite], ref[~finite]), f"{what}: non-finite values differ"


@pytest.mark.parametrize("dtype, backend", [(np.float64, "auto"), (np.float32, "auto"), (np.float16, "simt"),
                                            (np.float16, "tensorcore"), (np.float16, "auto")])
@settings(max_examples=examples(5), deadline=None)
@given(data=st.data())
def test_flex_forward_and_backward_match_the_oracle(dtype, backend, data):
    p = data.draw(flex_problems(dtypes=(dtype,)))
    q, k, v, dout, dtype = p["q"], p["k"], p["v"], p["dout"], p["q"].dtype.type
    B, H, L, _ = q.shape
    S = k.shape[2]
    block_mask = None
    if p["mask_mod"] is not None:
        block_mask = flashnb.create_block_mask(p["mask_mod"], *p["mask_dims"], L, S, BLOCK_SIZE=p["block"])
    gqa = H != k.shape[1]
    out, lse = flashnb.flex_attention(q, k, v, score_mod=p["score_mod"], block_mask=block_mask, enable_gqa=gqa,
                                      return_lse=True, backend=backend)
    ref, ref_lse = rf.flex_attention(q, k, v, score_mod=p["score_mod"], mask_mod=p["mask_mod"], enable_gqa=gqa,
                                     return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (B, H, L)
    low = low_lse = None
    lows = (None, None, None)
    mods = dict(score_mod=p["score_mod"], mask_mod=p["mask_mod"], enable_gqa=gqa)
    if dtype == np.float16:                                 # the oracle in the input precision
        with np.errstate(all="ignore"):
            low, low_lse = rf.flex_attention(q, k, v, return_lse=True, dtype=np.float16, **mods)
            lows = rf.flex_attention_backward(dout, q, k, v, score_mod_grad=p["score_mod_grad"], dtype=np.float16,
                                              **mods)
    _close(out, ref, dtype, f"out ({p['what']})", low)
    _close(lse, ref_lse, dtype, f"lse ({p['what']})", low_lse)
    grads = flashnb.flex_attention_backward(dout, q, k, v, out, lse, score_mod=p["score_mod"],
                                            block_mask=block_mask, enable_gqa=gqa, score_mod_grad=p["score_mod_grad"],
                                            backend=backend)
    want = rf.flex_attention_backward(dout, q, k, v, score_mod_grad=p["score_mod_grad"], **mods)
    for name, g, w, x, lo in zip(("dq", "dk", "dv"), grads, want, (q, k, v), lows):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {g.shape} {g.dtype}"
        _close(g, w, dtype, f"{name} ({p['what']})", lo)


@settings(max_examples=examples(10), deadline=None)
@given(seed=st.integers(0, 2**31), L=st.integers(1, 40), S=st.integers(1, 40),
       name=st.sampled_from(["causal", "sliding", "document", "prefix_lm"]),
       block=st.sampled_from([1, 3, (4, 8), 16]), dims=st.sampled_from([(None, None), (2, None), (2, 3)]))
def test_create_block_mask_states_are_the_oracles(seed, L, S, name, block, dims):
    mask_mod = mask_mods(np.random.default_rng(seed), L, S)[name]
    got = flashnb.create_block_mask(mask_mod, *dims, L, S, BLOCK_SIZE=block)
    want = rf.block_states(mask_mod, *dims, L, S, block)
    assert got.states.dtype == np.int8
    np.testing.assert_array_equal(got.states, want)


def test_the_builtin_options_as_mods_give_the_builtin_results():
    """ALiBi and a causal mask written as functions equal flash_attention's alibi_slopes and causal=True
    (L = S: top-left and bottom-right causal agree), forward and backward, float64."""
    rng = np.random.default_rng(3)
    B, H, L, E = 2, 2, 13, 8
    q, k, v, dout = (rng.standard_normal((B, H, L, E)) for _ in range(4))
    slopes = np.array([0.5, 0.25])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - (0.5 if h == 0 else 0.25) * abs(q_idx - kv_idx)

    def alibi_grad(score, b, h, q_idx, kv_idx):
        return 1.0

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = flashnb.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=4)
    out, lse = flashnb.flex_attention(q, k, v, score_mod=alibi, block_mask=mask, return_lse=True)
    t = lambda x: np.ascontiguousarray(x.swapaxes(1, 2))  # noqa: E731
    want, want_lse = flashnb.flash_attention(t(q), t(k), t(v), causal=True, alibi_slopes=slopes, return_lse=True)
    np.testing.assert_allclose(t(out), want, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12, rtol=0)
    grads = flashnb.flex_attention_backward(dout, q, k, v, out, lse, score_mod=alibi, block_mask=mask,
                                            score_mod_grad=alibi_grad)
    wants = flashnb.flash_attention_backward(t(dout), t(q), t(k), t(v), want, want_lse, causal=True,
                                             alibi_slopes=slopes)
    for g, w in zip(grads, wants):
        np.testing.assert_allclose(t(g), w, atol=1e-12, rtol=0)


def test_a_row_that_sees_no_key_gives_zero_and_minus_inf():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 1, 6, 4)) for _ in range(3))
    mask = flashnb.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < q_idx, None, None, 6, 6, BLOCK_SIZE=2)
    out, lse = flashnb.flex_attention(q, k, v, block_mask=mask, return_lse=True)
    assert np.all(out[0, 0, 0] == 0) and lse[0, 0, 0] == -np.inf           # row 0: no key before it
    ref, ref_lse = rf.flex_attention(q, k, v, mask_mod=mask.mask_mod, return_lse=True)
    np.testing.assert_allclose(out, ref, atol=1e-12, rtol=0)


def _captures(table):
    def mask(b, h, q_idx, kv_idx):
        return table[q_idx] == table[kv_idx]
    return mask


class _DlpackOnly:
    """Stands for an array with DLPack but no CUDA array interface (a CPU tensor)."""
    def __dlpack__(self):
        raise AssertionError("not called")

    def __getitem__(self, i):
        return 0.0


def _foreign_capture():
    ids = _DlpackOnly()

    def mod(score, b, h, q_idx, kv_idx):
        return score + ids[q_idx]
    return mod


def _device_capture(values):
    table = cuda.to_device(values)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[q_idx]
    return mod


def _qkv():
    rng = np.random.default_rng(5)
    return tuple(rng.standard_normal((1, 2, 5, 4)) for _ in range(3))


def test_a_math_score_mod_needs_score_mod_grad_for_the_backward():
    """math.tanh cannot take the complex step: the backward refuses it before any launch, naming the remedy;
    with score_mod_grad it runs, and equals the oracle's backward."""
    q, k, v = _qkv()

    def capped(score, b, h, q_idx, kv_idx):
        return 2.0 * math.tanh(score / 2.0)

    def capped_grad(score, b, h, q_idx, kv_idx):
        return 1.0 - math.tanh(score / 2.0) ** 2

    out, lse = flashnb.flex_attention(q, k, v, score_mod=capped, return_lse=True)
    with pytest.raises(ValueError, match="score_mod cannot take a complex score.*score_mod_grad"):
        flashnb.flex_attention_backward(q, q, k, v, out, lse, score_mod=capped)
    grads = flashnb.flex_attention_backward(q, q, k, v, out, lse, score_mod=capped, score_mod_grad=capped_grad)
    want = rf.flex_attention_backward(q, q, k, v, score_mod=capped, score_mod_grad=capped_grad)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, atol=1e-12, rtol=0)


@pytest.mark.parametrize("call, error, match", [
    (lambda q, k, v: flashnb.flex_attention(q, k, v, score_mod=3), TypeError, "score_mod must be a function"),
    (lambda q, k, v: flashnb.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: True), TypeError,
     "score_mod must return a real number"),
    (lambda q, k, v: flashnb.flex_attention(q, k, v, score_mod=lambda s, b, h: s), ValueError, "score_mod failed"),
    (lambda q, k, v: flashnb.create_block_mask(lambda b, h, i, j: 1.5, None, None, 5, 5), TypeError,
     "mask_mod must return a bool"),
    (lambda q, k, v: flashnb.flex_attention(q, k, v, block_mask=np.ones((1, 1, 1, 1), bool)), TypeError,
     "block_mask must be a BlockMask"),
    (lambda q, k, v: flashnb.flex_attention(q, k, v, block_mask=flashnb.create_block_mask(
        lambda b, h, i, j: i >= j, None, None, 5, 6)), ValueError, "block_mask was made for Q_LEN=5, KV_LEN=6"),
    (lambda q, k, v: flashnb.flex_attention(q, k[:, :1], v[:, :1]), ValueError, "enable_gqa=True"),
    (lambda q, k, v: flashnb.flex_attention(q[0], k, v), ValueError, "query must have 4 dimensions"),
    (lambda q, k, v: flashnb.create_block_mask(lambda b, h, i, j: i >= j, None, None, 5, 5, BLOCK_SIZE=0),
     ValueError, "BLOCK_SIZE"),
    (lambda q, k, v: flashnb.create_block_mask(_captures(np.zeros(20000, np.int32)), None, None, 5, 5), ValueError,
     "mask_mod captures 160000 bytes of NumPy arrays"),
    (lambda q, k, v: flashnb.flex_attention(q, k, v, score_mod=_foreign_capture()), TypeError,
     "captures 'ids' .*without the CUDA array interface"),
    (lambda q, k, v: flashnb.flex_attention(q, k, v, score_mod=_device_capture(np.zeros(5, np.complex64))),
     TypeError, "captures the device array 'table' of type complex64"),
    (lambda q, k, v: flashnb.flex_attention(q, k, v, score_mod=_device_capture(np.zeros(4))), ValueError,
     r"score_mod failed on \(b, h, q_idx, kv_idx\) = \(0, 0, 4, 0\): IndexError"),
    (lambda q, k, v: flashnb.create_block_mask(_captures([0, 1, 2, 3, 4]), None, None, 5, 5), TypeError,
     "captures the list 'table'.*tuple or a NumPy array"),
])
def test_bad_input_is_refused_naming_the_argument(call, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        call(q, k, v)


def test_a_numba_compile_error_names_the_functions():
    """Numba's error from compiling a kernel with the caller's functions (raised before the launch) becomes a
    TypeError naming them, with Numba's message as its cause; other errors pass through unchanged."""
    from numba.core.errors import TypingError
    from flashnb import flex

    def bad(score, b, h, q_idx, kv_idx):
        return score + len(str(q_idx))

    with pytest.raises(TypeError, match=r"could not compile the flex_attention functions \(score_mod '.*bad'\) "
                                        r"into the kernels: No implementation of str\(int64\)") as info:
        with flex._named_compile_errors(bad, None, None):
            raise TypingError("No implementation of str(int64)\n more")
    assert isinstance(info.value.__cause__, TypingError)
    with pytest.raises(ZeroDivisionError):
        with flex._named_compile_errors(bad, None, None):
            raise ZeroDivisionError


@pytest.mark.gpu
def test_a_function_numba_cannot_compile_is_named_before_any_launch():
    """On the GPU: ``str(q_idx)`` compiles in no kernel; the call raises the named TypeError."""
    def bad(score, b, h, q_idx, kv_idx):
        return score + len(str(q_idx))

    q, k, v = _qkv()
    with pytest.raises(TypeError, match="could not compile the flex_attention functions"):
        flashnb.flex_attention(q, k, v, score_mod=bad)


@pytest.mark.parametrize("backend", ["tensorcore", "simt"])
def test_int32_indices_for_the_score_mod_give_the_same_results(monkeypatch, backend):
    """``plan.FLEX_MOD_INT32`` (a score_mod's indices as int32, clamped in int32): the kernels built with it
    (``Mods.index32``) give the results of the int64 ones, forward and backward, with a relative-position table
    (the indices index an array) and ALiBi (they meet a float)."""
    from flashnb import flex, plan
    rng = np.random.default_rng(21)
    L, S = 40, 56
    table = rng.standard_normal(L + S)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + S] - 0.25 * (h + 1) * abs(q_idx - kv_idx)

    q = rng.standard_normal((1, 2, L, 16)).astype(np.float16)
    k, v = (rng.standard_normal((1, 2, S, 16)).astype(np.float16) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float16)
    results = []
    for on in (False, True):
        monkeypatch.setattr(plan, "FLEX_MOD_INT32", on)
        seen = []
        monkeypatch.setattr(flex, "Mods", lambda *a, _real=flex.Mods, **kw: seen.append(_real(*a, **kw)) or seen[-1])
        out, lse = flashnb.flex_attention(q, k, v, score_mod=mod, return_lse=True, backend=backend)
        grads = flashnb.flex_attention_backward(dout, q, k, v, out, lse, score_mod=mod, backend=backend)
        assert seen and all(m.index32 == on for m in seen)
        results.append((out, lse) + tuple(grads))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_the_written_out_mask_bits_and_int32_indices_give_the_same_results(monkeypatch):
    """``plan.FLEX_MASK_WRITTEN`` (a mask_mod's bits of a partial tile written out, at clamped indices),
    ``plan.FLEX_MASK_INT32`` (its indices as int32) and ``plan.FLEX_MASK_NARROW`` (the bounds in int32 too; the
    mask_mod's int32 comparisons are a compile pass the simulator does not run: tests/test_mod_float32.py types
    them) against the loop with int64 indices: the same outputs, lse and gradients on the tensor-core kernels,
    with a document mask over captured ids and a prefix (the indices index an array and meet a constant) and
    sequences that end inside a tile; blocks of 128 put each tile inside one block (the written-out path; blocks
    smaller than a tile take the loop either way)."""
    from flashnb import flex, plan
    rng = np.random.default_rng(22)
    L, S = 40, 56
    ids = np.sort(rng.integers(0, 4, S)).astype(np.int32)

    def doc(b, h, q_idx, kv_idx):     # (the last keys seen by every query: past them only the bounds decide)
        return ((ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)) | (kv_idx < 5) | (kv_idx >= S - 3)

    q = rng.standard_normal((1, 2, L, 16)).astype(np.float16)
    k, v = (rng.standard_normal((1, 2, S, 16)).astype(np.float16) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float16)
    mask = flashnb.create_block_mask(doc, None, None, L, S, BLOCK_SIZE=128)
    results = []
    for written, int32, narrow in ((0, False, 0), (3, True, 1), (3, True, 2)):
        monkeypatch.setattr(plan, "FLEX_MASK_WRITTEN", written)
        monkeypatch.setattr(plan, "FLEX_MASK_INT32", int32)
        monkeypatch.setattr(plan, "FLEX_MASK_NARROW", narrow)
        seen = []
        monkeypatch.setattr(flex, "Mods", lambda *a, _real=flex.Mods, **kw: seen.append(_real(*a, **kw)) or seen[-1])
        out, lse = flashnb.flex_attention(q, k, v, block_mask=mask, return_lse=True, backend="tensorcore")
        grads = flashnb.flex_attention_backward(dout, q, k, v, out, lse, block_mask=mask, backend="tensorcore")
        assert seen and all(m.mask_written == written and m.mask_index32 == int32 for m in seen)
        assert (seen[0].mask_narrow, seen[-1].mask_narrow) == (bool(narrow & 1), bool(narrow & 2))   # fwd, bwd
        results.append((out, lse) + tuple(grads))
    assert np.all(np.isfinite(results[0][0]))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_the_straight_line_element_gradient_gives_the_same_results(monkeypatch):
    """``plan.BWD_FAST_GRAD`` (the tensor-core dK/dV kernel's element step with one exp2 and the masks as selects,
    ``make_element_grad(FAST=True)``) against the branches and ``math.exp2``: the same gradients for a score_mod
    over a captured table with a document mask over captured ids (partial tiles, whose masked scores are large),
    a softcap with its given derivative, and the dense ALiBi, softcap and bias options with a causal mask and a
    window; sequences end inside a tile.  The planner passes the setting to the kernel (checked)."""
    from flashnb import _dispatch, plan
    rng = np.random.default_rng(23)
    L, S, H = 40, 56, 1
    ids = np.sort(rng.integers(0, 4, S)).astype(np.int32)
    slopes = rng.uniform(0.1, 1.0, H).astype(np.float32)

    def doc(b, h, q_idx, kv_idx):
        return ((ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)) | (kv_idx < 5)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 5.0 * math.tanh(score / 5.0)

    def softcap_grad(score, b, h, q_idx, kv_idx):
        t = math.tanh(score / 5.0)
        return 1.0 - t * t

    q = (3 * rng.standard_normal((1, H, L, 16))).astype(np.float16)
    k, v = ((3 * rng.standard_normal((1, H, S, 16))).astype(np.float16) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float16)
    bias = rng.standard_normal((1, H, L, S)).astype(np.float32)
    mask = flashnb.create_block_mask(doc, None, None, L, S, BLOCK_SIZE=128)
    fwd_alibi = flashnb.flex_attention(q, k, v, score_mod=alibi, block_mask=mask, return_lse=True,
                                       backend="tensorcore")
    fwd_softcap = flashnb.flex_attention(q, k, v, score_mod=softcap, return_lse=True, backend="tensorcore")
    calls = [        # (the backwards alone under each setting: the forwards are the setting's inputs, computed once)
        lambda: flashnb.flex_attention_backward(dout, q, k, v, *fwd_alibi, score_mod=alibi, block_mask=mask,
                                                backend="tensorcore"),
        lambda: flashnb.flex_attention_backward(dout, q, k, v, *fwd_softcap, score_mod=softcap,
                                                score_mod_grad=softcap_grad, backend="tensorcore")]
    qt, kt, vt, dt = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v, dout))
    for opts in (dict(causal=True, alibi_slopes=slopes), dict(softcap=5.0, window_size=(9, 3)),
                 dict(attn_bias=bias, causal=True)):
        fwd = flashnb.flash_attention(qt, kt, vt, return_lse=True, backend="tensorcore", **opts)
        calls.append(lambda opts=opts, fwd=fwd: flashnb.flash_attention_backward(dt, qt, kt, vt, *fwd,
                                                                                 backend="tensorcore", **opts))
    results = []
    for fast in (False, True):
        monkeypatch.setattr(plan, "BWD_FAST_GRAD", fast)
        _dispatch.clear()
        seen = []
        monkeypatch.setattr(plan, "make_dkdv_tc", lambda *a, _real=plan.make_dkdv_tc, **kw: (
            seen.append(kw.get("FAST_GRAD", False)) if any(a[5:12]) or kw.get("MODS") else None) or _real(*a, **kw))
        results.append([call() for call in calls])
        assert len(seen) >= len(calls) and set(seen) == {fast}          # (the kernels with an element step)
    for before, after in zip(*results):
        for a, b in zip(before, after):
            assert np.all(np.isfinite(a))
            np.testing.assert_array_equal(a, b)


def test_the_block_order_of_a_mask_mod_changes_no_result(monkeypatch):
    """``plan.FLEX_SECTION`` (a flex call's blocks in the dense causal call's longest-first order, the kernels'
    ``SECTION``) against the plain order: the same output, lse, dK and dV (each block computes them whole), dQ within
    float16 rounding of its atomics' other order; the planner passes the order to both kernels (checked)."""
    from flashnb import _dispatch, plan
    rng = np.random.default_rng(24)
    L = 70

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    q, k, v, dout = (rng.standard_normal((1, 3, L, 16)).astype(np.float16) for _ in range(4))
    mask = flashnb.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    results = []
    for section in (0, 3):
        monkeypatch.setattr(plan, "FLEX_SECTION", section)
        _dispatch.clear()
        seen = []
        for name in ("make_forward_tc", "make_dkdv_tc"):
            monkeypatch.setattr(plan, name, lambda *a, _real=getattr(plan, name), **kw: (
                seen.append(kw.get("SECTION", 0)) if kw.get("MODS") else None) or _real(*a, **kw))
        out, lse = flashnb.flex_attention(q, k, v, block_mask=mask, return_lse=True, backend="tensorcore")
        grads = flashnb.flex_attention_backward(dout, q, k, v, out, lse, block_mask=mask, backend="tensorcore")
        assert seen and set(seen) == ({plan.LPT_SECTION_FWD, plan.LPT_SECTION_BWD} if section else {0})
        results.append((out, lse) + tuple(grads))
    (out0, lse0, dq0, dk0, dv0), (out1, lse1, dq1, dk1, dv1) = results
    assert np.all(np.isfinite(dq0))
    for a, b in ((out0, out1), (lse0, lse1), (dk0, dk1), (dv0, dv1)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(dq1.astype(np.float32), dq0.astype(np.float32), rtol=2 ** -10, atol=2 ** -14)


def test_captured_device_arrays_are_read_in_place():
    """A mask_mod over device document ids and a score_mod over a device bias table (Numba device arrays: the
    simulator's, or the GPU's, whose address numba-cuda embeds in the kernel) give the oracle's results with the
    same values as NumPy arrays, forward and backward; a write into them in place is read by the next call with the
    same compiled function (its fingerprint is the address and layout, not the values), and the host probes read
    a host copy."""
    from flashnb import flex
    rng = np.random.default_rng(8)
    L = 24
    ids, bias = np.sort(rng.integers(0, 3, L)).astype(np.int32), rng.standard_normal(2 * L).astype(np.float32)
    d_ids, d_bias = cuda.to_device(ids), cuda.to_device(bias)

    def doc(b, h, q_idx, kv_idx):
        return (d_ids[q_idx] == d_ids[kv_idx]) & (q_idx >= kv_idx)

    def rel(score, b, h, q_idx, kv_idx):
        return score + d_bias[q_idx - kv_idx + L]

    q, k, v, dout = (rng.standard_normal((1, 2, L, 8)) for _ in range(4))
    for step in range(2):
        host_ids, host_bias = d_ids.copy_to_host(), d_bias.copy_to_host()

        def doc_np(b, h, q_idx, kv_idx):
            return (host_ids[q_idx] == host_ids[kv_idx]) & (q_idx >= kv_idx)

        def rel_np(score, b, h, q_idx, kv_idx):
            return score + host_bias[q_idx - kv_idx + L]

        mask = flashnb.create_block_mask(doc, None, None, L, L, BLOCK_SIZE=8)
        out, lse = flashnb.flex_attention(q, k, v, score_mod=rel, block_mask=mask, return_lse=True)
        ref, _ = rf.flex_attention(q, k, v, score_mod=rel_np, mask_mod=doc_np, return_lse=True)
        np.testing.assert_allclose(out, ref, atol=1e-11, rtol=0)
        grads = flashnb.flex_attention_backward(dout, q, k, v, out, lse, score_mod=rel, block_mask=mask)
        want = rf.flex_attention_backward(dout, q, k, v, score_mod=rel_np, mask_mod=doc_np)
        for g, w in zip(grads, want):
            np.testing.assert_allclose(g, w, atol=1e-10, rtol=0)
        if step == 0:
            prints = flex._fingerprint(rel), flex._fingerprint(doc)
            d_ids.copy_to_device(np.sort(rng.integers(0, 4, L)).astype(np.int32))   # new values, same arrays
            d_bias.copy_to_device(rng.standard_normal(2 * L).astype(np.float32))
            assert not np.array_equal(d_ids.copy_to_host(), ids)
    assert (flex._fingerprint(rel), flex._fingerprint(doc)) == prints


def test_the_mask_runs_inside_tiles_that_do_not_reach_the_end():
    """96 tokens in documents of 17, 33 and 46 (so every tile holds a document boundary, and interior tiles do
    not cross the end of the keys, where the kernels mask anyway): the tensor cores' forward and backward (the
    property test's tiny shapes seldom have such tiles at their tile sizes; the SIMT kernels' small tiles do),
    float16 by flash-attn's rule (dout = q: any fixed array will do)."""
    backend = "tensorcore"
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, 96, 16)).astype(np.float16) for _ in range(3))
    doc = np.repeat([0, 1, 2], [17, 33, 46])

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    mask = flashnb.create_block_mask(same_doc, None, None, 96, 96, BLOCK_SIZE=32)
    out, lse = flashnb.flex_attention(q, k, v, block_mask=mask, backend=backend, return_lse=True)
    ref = rf.flex_attention(q, k, v, mask_mod=same_doc)
    with np.errstate(all="ignore"):
        low = rf.flex_attention(q, k, v, mask_mod=same_doc, dtype=np.float16)
        lows = rf.flex_attention_backward(q, q, k, v, mask_mod=same_doc, dtype=np.float16)
    _close(out, ref, np.float16, f"{backend} document mask", low)
    grads = flashnb.flex_attention_backward(q, q, k, v, out, lse, block_mask=mask, backend=backend)
    for name, g, w, lo in zip(("dq", "dk", "dv"), grads, rf.flex_attention_backward(q, q, k, v, mask_mod=same_doc),
                              lows):
        _close(g, w, np.float16, f"{backend} document mask {name}", lo)


@pytest.mark.parametrize("backend", ["simt", "tensorcore"])
def test_full_blocks_skip_the_mask_mod(backend):
    """The kernels trust the states: a block marked FULL runs no mask_mod (what makes a full block as cheap as
    no mask), PARTIAL runs it, EMPTY is never loaded.  Shown with states that disagree with the function on
    purpose: 64 x 64 pairs (whole tiles, none crossing the end of the keys), a mask_mod that forbids every pair
    off the diagonal; marked all FULL the result is attention without a mask, marked PARTIAL it is the
    diagonal (out = v), and the diagonal blocks EMPTY leave only the off-diagonal blocks, which see nothing:
    zero rows."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 1, 64, 16)).astype(np.float16) for _ in range(3))

    def diagonal(b, h, q_idx, kv_idx):
        return q_idx == kv_idx

    def call(states):
        mask = flashnb.BlockMask(diagonal, np.asarray(states, np.int8).reshape(1, 1, 4, 4), (16, 16), 64, 64)
        return np.asarray(flashnb.flex_attention(q, k, v, block_mask=mask, backend=backend), np.float64)

    no_mask = rf.flex_attention(q, k, v)
    np.testing.assert_allclose(call(np.full(16, flashnb.flex.FULL)), no_mask, atol=2e-3, rtol=0)
    np.testing.assert_allclose(call(np.full(16, flashnb.flex.PARTIAL)), v.astype(np.float64), atol=1e-3, rtol=0)
    assert np.all(call(np.where(np.eye(4, dtype=bool), flashnb.flex.EMPTY, flashnb.flex.PARTIAL)) == 0)


@pytest.mark.parametrize("dtype, backend", [(np.float32, "simt"), (np.float16, "tensorcore")])
def test_functions_see_the_batch_and_the_query_head(dtype, backend):
    """A mask_mod and a score_mod that depend on b and h (states of shape (B, H)), grouped heads: each kernel
    passes the query's batch and head, as the oracle does (not 0, not the key/value head)."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 4, 20, 8)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 20, 8)).astype(dtype) for _ in range(2))
    checker = mask_mods(rng, 20, 20)["checker"]
    batch_head = score_mods(rng, 4, 20, 20)[0]["batch_head"]
    mask = flashnb.create_block_mask(checker, 2, 4, 20, 20, BLOCK_SIZE=8)
    out, lse = flashnb.flex_attention(q, k, v, score_mod=batch_head, block_mask=mask, enable_gqa=True,
                                      return_lse=True, backend=backend)
    kw = dict(score_mod=batch_head, mask_mod=checker, enable_gqa=True)
    with np.errstate(all="ignore"):
        low = None if dtype != np.float16 else rf.flex_attention(q, k, v, dtype=np.float16, **kw)
        lows = (None,) * 3 if dtype != np.float16 else rf.flex_attention_backward(q, q, k, v, dtype=np.float16, **kw)
    _close(out, rf.flex_attention(q, k, v, **kw), dtype, "out", low)
    grads = flashnb.flex_attention_backward(q, q, k, v, out, lse, score_mod=batch_head, block_mask=mask,
                                            enable_gqa=True, backend=backend)
    for name, g, w, lo in zip(("dq", "dk", "dv"), grads, rf.flex_attention_backward(q, q, k, v, **kw), lows):
        _close(g, w, dtype, name, lo)


def test_a_changed_capture_is_a_new_compile_never_a_stale_kernel():
    """Numba freezes what a function captures: an array changed in place, or a number rebound, between calls
    must give the new result (the simulator reads live values; the check is that the compile key follows them)."""
    q, k, v = _qkv()
    table = np.zeros(10)

    def biased(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]

    first = flashnb.flex_attention(q, k, v, score_mod=biased)
    key = flashnb.flex._fingerprint(biased)
    table[2] = 5.0
    assert flashnb.flex._fingerprint(biased) != key
    np.testing.assert_allclose(flashnb.flex_attention(q, k, v, score_mod=biased),
                               rf.flex_attention(q, k, v, score_mod=biased), atol=1e-12, rtol=0)
    assert not np.allclose(first, rf.flex_attention(q, k, v, score_mod=biased))


def test_abs_of_the_score_needs_its_derivative():
    """abs(score) takes a complex score and returns a real number: the complex step would say 0; the host check
    against a central difference refuses it before any launch."""
    q, k, v = _qkv()
    out, lse = flashnb.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: abs(s), return_lse=True)
    with pytest.raises(ValueError, match="central difference.*score_mod_grad"):
        flashnb.flex_attention_backward(q, q, k, v, out, lse, score_mod=lambda s, b, h, i, j: abs(s))


def test_a_score_mod_over_float32_slopes_takes_the_complex_step():
    """ALiBi with the slopes a float32 array (as a model keeps them): its complex step on the host is a NumPy
    complex64, a number like any other; the backward's check takes it (it was refused as "not a number") and the
    gradients are the oracle's."""
    q, k, v = _qkv()
    slopes = np.array([0.5, 0.25], np.float32)
    alibi = lambda s, b, h, i, j: s + slopes[h] * (j - i)                         # noqa: E731
    flashnb.flex._check_complex_step(alibi)
    out, lse = flashnb.flex_attention(q, k, v, score_mod=alibi, return_lse=True)
    got = flashnb.flex_attention_backward(q, q, k, v, out, lse, score_mod=alibi)
    for g, w in zip(got, rf.flex_attention_backward(q, q, k, v, score_mod=alibi)):
        np.testing.assert_allclose(g, w, atol=1e-9, rtol=1e-9)


def test_the_host_checks_run_again_when_a_capture_changes():
    """The host checks of a function are kept per function and captured values (``flex._checked``): the same
    function and captures are not probed again, and a changed capture is (here a number that becomes a string,
    which the probe refuses by name before any launch)."""
    q, k, v = _qkv()
    factor = 2.0
    mod = lambda s, b, h, i, j: s * factor                                        # noqa: E731
    np.testing.assert_allclose(flashnb.flex_attention(q, k, v, score_mod=mod),
                               rf.flex_attention(q, k, v, score_mod=mod), atol=1e-12, rtol=0)
    assert any(key[0] is mod for key in flashnb.flex._CHECKED), "the check was not kept"
    factor = "2"                                                                  # noqa: F841 (read by mod)
    with pytest.raises(ValueError, match="score_mod failed on"):
        flashnb.flex_attention(q, k, v, score_mod=mod)


def test_a_table_too_short_for_the_indices_is_refused_before_any_launch():
    """The host probes a function at the corners of the call's index space (first and last b, h, q_idx, kv_idx),
    so a captured table that the last query or the widest offset would read past its end raises there, naming
    the indices, for a mask_mod (in create_block_mask and again in the call) and a score_mod; a table that fits
    passes."""
    q, k, v = _qkv()                                            # (B, H, L, E) = (1, 2, 5, 4), S = 5
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    short_ids = np.zeros(L - 1, np.int32)
    with pytest.raises(ValueError, match=rf"mask_mod failed on \(b, h, q_idx, kv_idx\) = \(0, 0, 0, {S - 1}\): "
                                         "IndexError"):
        flashnb.create_block_mask(lambda b, h, i, j: short_ids[j] >= 0, None, None, L, S)
    bias = np.zeros(L + S - 2)                                  # q - kv + S - 1 runs over 0 .. L + S - 2: one short
    with pytest.raises(ValueError, match=rf"score_mod failed on \(b, h, q_idx, kv_idx\) = \(0, 0, {L - 1}, 0\)"):
        flashnb.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[i - j + S - 1])
    slopes = np.ones(H - 1)                                     # a per-head table one short
    with pytest.raises(ValueError, match=rf"= \(0, {H - 1}, 0, 0\)"):
        flashnb.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * slopes[h])
    fits = np.zeros(L + S - 1)
    out = flashnb.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + fits[i - j + S - 1])
    assert out.shape == q.shape


def test_a_hand_made_block_mask_is_checked():
    q, k, v = _qkv()
    good = flashnb.create_block_mask(lambda b, h, i, j: i >= j, None, None, 5, 5, BLOCK_SIZE=2)
    with pytest.raises(ValueError, match="states must be int8"):
        flashnb.flex_attention(q, k, v, block_mask=flashnb.BlockMask(good.mask_mod, good.states[:, :, :2], (2, 2),
                                                                     5, 5))
    with pytest.raises(ValueError, match="no mask_mod"):
        flashnb.flex_attention(q, k, v, block_mask=flashnb.BlockMask(None, good.states, (2, 2), 5, 5))
    ids, bias = np.zeros(3000), np.zeros(3000)                  # 24 KB each, read twice and once: 72 KB together
    both = flashnb.create_block_mask(lambda b, h, i, j: ids[i] == ids[j], None, None, 5, 5, BLOCK_SIZE=2)
    with pytest.raises(ValueError, match="capture 72000 bytes of NumPy arrays together"):
        flashnb.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[i], block_mask=both)
    big = np.zeros(5000)                                        # 40 KB read twice: 80 KB (ptxas: "too much global constant data")
    with pytest.raises(ValueError, match="mask_mod captures 80000 bytes"):
        flashnb.create_block_mask(lambda b, h, i, j: big[i] == big[j], None, None, 5, 5, BLOCK_SIZE=2)


@settings(max_examples=examples(20), deadline=None)
@given(seed=st.integers(0, 2**31), shape=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 9),
                                                   st.integers(1, 9)))
def test_kernel_states_pad_each_block_row_and_column_with_its_kept_range(seed, shape):
    """``flex.kernel_states``: the states, then per query block its first kept key block and last plus one
    (``nkb`` and 0 where none is kept), per key block the same over query blocks: the ranges the kernels'
    tile loops run over (``forward.make_mask_bounds``)."""
    from flashnb.flex import kernel_states
    states = np.random.default_rng(seed).choice(np.array([0, 0, 1, 2], np.int8), size=shape)
    got = kernel_states(states)
    B, H, nqb, nkb = shape
    assert got.dtype == np.int32 and got.shape == (B, H, nqb + 2, nkb + 2)
    assert np.array_equal(got[:, :, :nqb, :nkb], states)
    for b in range(B):
        for h in range(H):
            for i in range(nqb):
                kept = [j for j in range(nkb) if states[b, h, i, j]]
                assert tuple(got[b, h, i, nkb:]) == ((kept[0], kept[-1] + 1) if kept else (nkb, 0))
            for j in range(nkb):
                kept = [i for i in range(nqb) if states[b, h, i, j]]
                assert tuple(got[b, h, nqb:, j]) == ((kept[0], kept[-1] + 1) if kept else (nqb, 0))


def test_float32_kernels_compile_float_constants_as_float32_and_divisions_as_products():
    """A score_mod's Python floats become float32 for the float32-accumulating kernels, ``x / c`` (c a literal)
    the product with float32 ``1 / c`` (within an ulp of the quotient); a mask_mod keeps float64 (a bool decided
    as create_block_mask and the oracle decide it: ``q * 0.3 <= k`` differs at q = 50 in float32)."""
    import math
    from flashnb import flex

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * math.tanh(score / 30.0)

    f32 = flex._float32_constants(softcap)
    assert f32 is not softcap and "/" not in [i.argrepr for i in __import__("dis").get_instructions(f32)]
    s = np.linspace(-40, 40, 101).astype(np.float32)
    got = np.array([f32(x, 0, 0, 0, 0) for x in s])
    assert got.dtype == np.float32
    assert np.allclose(got, 30 * np.tanh(s.astype(np.float64) / 30), rtol=4 * 2.0 ** -24 * 4, atol=1e-6)

    def band(b, h, q_idx, kv_idx):
        return q_idx * 0.3 <= kv_idx

    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 1, 64, 8)).astype(np.float32) for _ in range(3))
    mask = flashnb.create_block_mask(band, None, None, 64, 64, BLOCK_SIZE=16)
    out = flashnb.flex_attention(q, k, v, block_mask=mask, backend="simt")
    ref = rf.flex_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask_mod=band)
    assert np.allclose(out, ref, rtol=1e-4, atol=1e-5), np.abs(out - ref).max()


@pytest.mark.parametrize("block, with_score", [((128, 128), False), ((16, 16), True)])
def test_the_hopper_kernels_with_mods(monkeypatch, block, with_score):
    """``backend="wgmma"``: the Hopper forward and, with the simulator's tensor-core key tiles widened to 64 (whole
    warpgroups), the Hopper dK/dV kernel, with a causal document mask alone (the backward's plain form with the
    mask's bits, partial tiles holding masked scores far above the row's: their exp2 overflows and is dropped) or
    with ALiBi (the written-out step), float16 by flash-attn's rule; block 16: tiles over several blocks (the
    loop), block 128: a tile inside one block (one state read)."""
    from flashnb import plan
    monkeypatch.setattr(plan, "_TC_SIM_TILES", (16, 64))
    built = []                                          # the factories' keywords: the Hopper kernels, both passes
    for name in ("make_forward_tc", "make_dkdv_tc"):
        real = getattr(plan, name)
        monkeypatch.setattr(plan, name, lambda *a, _real=real, _name=name, **kw: (built.append((_name, kw)),
                                                                                _real(*a, **kw))[1])
    rng = np.random.default_rng(11)
    L, S, E = 40, 72, 16
    q = (rng.standard_normal((1, 1, L, E)) * 2.0).astype(np.float16)
    k = (rng.standard_normal((1, 1, S, E)) * 2.0).astype(np.float16)
    k[:, :, 30:36] = 6.0 * q[:, :, 20:26]              # keys the mask hides from rows 20-25, scores far above theirs
    v = rng.standard_normal((1, 1, S, E)).astype(np.float16)
    dout = rng.standard_normal((1, 1, L, E)).astype(np.float16)
    doc = np.repeat(np.arange(4), 20)[:S]

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx + 10 >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - 0.25 * (h + 1) * abs(q_idx - kv_idx)

    score_mod = alibi if with_score else None
    mask = flashnb.create_block_mask(doc_causal, None, None, L, S, BLOCK_SIZE=block)
    mods = dict(score_mod=score_mod, mask_mod=doc_causal)
    out, lse = flashnb.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, return_lse=True,
                                      backend="wgmma")
    ref, ref_lse = rf.flex_attention(q, k, v, return_lse=True, **mods)
    with np.errstate(all="ignore"):
        low, low_lse = rf.flex_attention(q, k, v, return_lse=True, dtype=np.float16, **mods)
        lows = rf.flex_attention_backward(dout, q, k, v, dtype=np.float16, **mods)
    _close(out, ref, np.float16, "out", low)
    _close(lse, ref_lse, np.float16, "lse", low_lse)
    grads = flashnb.flex_attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, block_mask=mask,
                                            backend="wgmma")
    want = rf.flex_attention_backward(dout, q, k, v, **mods)
    for name, g, w, lo in zip(("dq", "dk", "dv"), grads, want, lows):
        assert np.all(np.isfinite(g)), name
        _close(g, w, np.float16, name, lo)
    assert {name for name, kw in built if kw.get("WGMMA") and kw.get("MODS")} == {"make_forward_tc", "make_dkdv_tc"}


# ------------------------------------------------------------------------------------- gradients into captures
def learned_mods(rng, H, L, S):
    """score_mods over learned arrays (issue 43: gradients into captured tensors), each with the names whose
    gradients are asked for: a relative-bias table by head, ALiBi with learned slopes, the table read twice (one
    read under an if), and both arrays in one function."""
    table = rng.standard_normal((H, L + S))
    slopes = rng.standard_normal(H)

    def rel_table(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + S]

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * abs(q_idx - kv_idx)

    def two_reads(score, b, h, q_idx, kv_idx):
        x = score * (1.0 + 0.1 * table[h, 0])
        if q_idx >= kv_idx:
            x = x + table[h, q_idx - kv_idx + S]
        return x

    def both(score, b, h, q_idx, kv_idx):
        return score * (1.0 + 0.1 * slopes[h]) + table[h, q_idx - kv_idx + S]

    return {"rel_table": (rel_table, ("table",)), "alibi": (alibi, ("slopes",)),
            "two_reads": (two_reads, ("table",)), "both": (both, ("table", "slopes"))}


@pytest.mark.parametrize("dtype, backend", [(np.float64, "auto"), (np.float32, "auto"), (np.float16, "simt"),
                                            (np.float16, "tensorcore")])
@settings(max_examples=examples(2), deadline=None)
@given(data=st.data())
def test_gradients_into_captured_arrays_match_the_oracle(dtype, backend, data):
    """``flex_attention_backward(captured_grads=...)``: the gradient in each named array the score_mod captures
    (added by the dK/dV kernels with atomics, one site function per read) against ``reference.flex``'s (the
    complex step in every entry of the array, over the whole grid), by the bounds of the other gradients; dq, dk,
    dv unchanged by asking for them.  Grouped heads, a mask_mod, a second read of the same array under an if."""
    seed = data.draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    Hk = data.draw(st.integers(1, 2))
    H, L, S = Hk * data.draw(st.sampled_from([1, 2])), data.draw(st.integers(1, 20)), data.draw(st.integers(1, 20))
    name = data.draw(st.sampled_from(["rel_table", "alibi", "two_reads", "both"]))
    mm = data.draw(st.sampled_from([None, "causal", "document"]))
    score_mod, names = learned_mods(rng, H, L, S)[name]
    mask_mod = None if mm is None else mask_mods(rng, L, S)[mm]
    q, dout = (rng.standard_normal((1, H, L, 8)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, Hk, S, 8)).astype(dtype) for _ in range(2))
    gqa = H != Hk
    block_mask = None if mask_mod is None else flashnb.create_block_mask(mask_mod, None, None, L, S, BLOCK_SIZE=8)
    out, lse = flashnb.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa,
                                      return_lse=True, backend=backend)
    *grads, learned = flashnb.flex_attention_backward(dout, q, k, v, out, lse, score_mod=score_mod,
                                                      block_mask=block_mask, enable_gqa=gqa, captured_grads=names,
                                                      backend=backend)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, enable_gqa=gqa, captured_grads=names)
    *want, want_learned = rf.flex_attention_backward(dout, q, k, v, **mods)
    lows = (None,) * 4
    if dtype == np.float16:
        with np.errstate(all="ignore"):
            *lows, low_learned = rf.flex_attention_backward(dout, q, k, v, dtype=np.float16, **mods)
    what = f"{dtype.__name__} {backend} H{H}/{Hk} L{L} S{S} {name} {mm} seed {seed}"
    assert set(learned) == set(names)
    for n in names:
        got = learned[n]
        assert isinstance(got, np.ndarray) and got.shape == want_learned[n].shape, f"{n}: {type(got)}"
        _close(got, want_learned[n], dtype, f"d{n} ({what})", None if dtype != np.float16 else low_learned[n])
    plain = flashnb.flex_attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, block_mask=block_mask,
                                            enable_gqa=gqa, backend=backend)
    for gname, g, w, p, lo in zip(("dq", "dk", "dv"), grads, want, plain, lows):
        _close(g, w, dtype, f"{gname} ({what})", lo)
        np.testing.assert_array_equal(g, p, err_msg=f"{gname}: captured_grads changed it ({what})")


def test_gradients_into_a_device_array_come_back_as_one():
    """A captured Numba device array's gradient is a device array (the simulator's, or the GPU's), a lambda's
    reads are found in its source line, and a second call with the same array reuses the compiled site
    functions (its buffer zeroed before each backward: the gradient again, not twice the gradient)."""
    from flashnb import flex
    rng = np.random.default_rng(3)
    L = 12
    d_slopes = cuda.to_device(rng.standard_normal(2))
    alibi = lambda score, b, h, q_idx, kv_idx: score - d_slopes[h] * abs(q_idx - kv_idx)   # noqa: E731
    host = d_slopes.copy_to_host()
    alibi_np = lambda score, b, h, q_idx, kv_idx: score - host[h] * abs(q_idx - kv_idx)    # noqa: E731
    q, k, v, dout = (rng.standard_normal((1, 2, L, 8)) for _ in range(4))
    out, lse = flashnb.flex_attention(q, k, v, score_mod=alibi, return_lse=True)
    *_, want = rf.flex_attention_backward(dout, q, k, v, score_mod=alibi_np, captured_grads=("host",))
    results = []
    for _ in range(2):
        *_, got = flashnb.flex_attention_backward(dout, q, k, v, out, lse, score_mod=alibi,
                                                  captured_grads=["d_slopes"])
        assert _is_device(got["d_slopes"]), type(got["d_slopes"])
        results.append(got["d_slopes"].copy_to_host())
        compiled = len(flex._COMPILED)
    for got in results:                          # (the atomics' order varies: equal to rounding, not bit for bit)
        np.testing.assert_allclose(got, want["host"], atol=1e-10, rtol=0)
    assert len(flex._COMPILED) == compiled


def test_a_score_mod_with_a_helper_inside_and_len_of_its_table():
    """A helper defined inside the score_mod keeps its own returns, and ``len(table)`` is not a read: the table's
    gradient is the oracle's."""
    rng = np.random.default_rng(5)
    L = 9
    table = rng.standard_normal(2 * L)

    def rel(score, b, h, q_idx, kv_idx):
        def twice(z):
            return z + z
        return twice(score) * 0.5 + table[q_idx - kv_idx + len(table) // 2]

    q, k, v, dout = (rng.standard_normal((1, 1, L, 8)) for _ in range(4))
    out, lse = flashnb.flex_attention(q, k, v, score_mod=rel, return_lse=True)
    *_, got = flashnb.flex_attention_backward(dout, q, k, v, out, lse, score_mod=rel, captured_grads=("table",))
    *_, want = rf.flex_attention_backward(dout, q, k, v, score_mod=rel, captured_grads=("table",))
    np.testing.assert_allclose(got["table"], want["table"], atol=1e-10, rtol=0)


def _is_device(x):
    return hasattr(x, "copy_to_host") and not isinstance(x, np.ndarray)


def _learned_table():
    return np.arange(40.0).reshape(2, 20)


TABLE = _learned_table()
SLOPES = np.array([0.5, 0.25])


def _in_loop(score, b, h, q_idx, kv_idx):
    t = 0.0
    for i in range(2):
        t += SLOPES[i]
    return score * t


def _a_slice(score, b, h, q_idx, kv_idx):
    return score + TABLE[h][q_idx]


def _conditional(score, b, h, q_idx, kv_idx):
    return score + (TABLE[h, q_idx] if q_idx >= kv_idx else 0.0)


def _abs_of_entry(score, b, h, q_idx, kv_idx):
    return score * abs(SLOPES[h])


def _abs_under_if(score, b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
        return score + abs(SLOPES[h])
    return score


def _compared(score, b, h, q_idx, kv_idx):
    if SLOPES[h] > 0:
        return score * 2.0
    return score


def _real_part(score, b, h, q_idx, kv_idx):      # .real drops the step, on a path only the probe sees
    x = SLOPES[h] * 1.0
    return score + x.real


def _passed_on(score, b, h, q_idx, kv_idx):
    return score + np.sum(SLOPES)


def _plain_rel(score, b, h, q_idx, kv_idx):
    return score + TABLE[h, q_idx - kv_idx + 10]


INT_TABLE = np.arange(4)


def _int_table(score, b, h, q_idx, kv_idx):
    return score + INT_TABLE[h]


@pytest.mark.parametrize("score_mod, names, extra, error, match", [
    (_in_loop, ("SLOPES",), {}, ValueError, "inside a loop"),
    (_a_slice, ("TABLE",), {}, ValueError, "indices or a slice"),
    (_conditional, ("TABLE",), {}, ValueError, "conditional expression"),
    (_abs_of_entry, ("SLOPES",), {}, ValueError, "passes 'SLOPES''s element to a function"),
    (_abs_under_if, ("SLOPES",), {}, ValueError, "passes 'SLOPES''s element to a function"),
    (_compared, ("SLOPES",), {}, ValueError, "compares 'SLOPES''s element"),
    (_real_part, ("SLOPES",), {}, ValueError, "disagrees with its central difference"),
    (_plain_rel, ("TABLE",), {"stream": 0}, ValueError, "stream=None"),
    (_passed_on, ("SLOPES",), {}, ValueError, "other than by reading one element"),
    (_plain_rel, ("nothing",), {}, ValueError, "does not capture"),
    (_plain_rel, ("TABLE", "TABLE"), {}, TypeError, "each captured array once"),
    (_plain_rel, (3,), {}, TypeError, "each captured array once"),
    (_plain_rel, ("TABLE",), {"deterministic": True}, ValueError, "deterministic"),
    (_int_table, ("INT_TABLE",), {}, TypeError, "float32 or float64"),
    (None, ("TABLE",), {}, ValueError, "needs a score_mod"),
])
def test_captured_grads_that_cannot_hold_are_refused_before_any_launch(score_mod, names, extra, error, match):
    """Each is refused naming what is wrong, before any kernel runs (the outputs' poison would show a launch)."""
    rng = np.random.default_rng(1)
    q, k, v, dout, out = (rng.standard_normal((1, 2, 6, 8)) for _ in range(5))
    lse = rng.standard_normal((1, 2, 6))
    with pytest.raises(error, match=match):
        flashnb.flex_attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, captured_grads=names, **extra)
