"""The backward kernels (flashnb.flash_attention_backward) against the float64 oracle (reference.attention_backward).

Each example runs the kernel forward, feeds its ``out`` and ``lse`` to the kernel
backward (as a training step does), and checks both against the oracle:
``dq``, ``dk``, ``dv`` (``dk``, ``dv`` summed over the query heads of a GQA
group), for float64/float32/float16, every option alone and combined, random
tiles, and both dQ strategies: the default adds each key tile's share of dQ
with atomics (taken when ``block_q >= min(16, block_k)``, see flashnb.api), and
``deterministic=True`` computes dQ in a second pass (bit-identical run to run).
Tolerances: kernel_harness's docstring.  Outputs NaN-poisoned, inputs checked
untouched (dout, q, k, v, out, lse and every option array).
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import strategies as S
from flashnb.kernels._jit import SIMULATOR
from kernel_harness import (DqPath, examples, assert_bitwise_equal, atomic_tiles, check_backward,
                            check_forward, expected, kernel_backward, kernel_forward, kernel_problems,
                            poison_outputs)  # noqa: F401 (autouse fixture)

# The simulator spends 2-6 s per forward + backward at these sizes: the main
# suites draw 15 examples each (not the profile's 25) to fit the CI budget;
# the parametrised per-option tests fewer (every option is still exercised).
MAIN_EXAMPLES = examples(15)
PER_OPTION_EXAMPLES = examples(3, 15)


def _backward_matches_oracle(p, deterministic):
    exp = expected(p)
    out, lse = kernel_forward(p)
    check_forward(exp, out, lse)
    with DqPath() as path:
        grads = kernel_backward(p, out, lse, deterministic=deterministic)
    if deterministic and p.seqlen_q > 0:
        assert path.used == {"two-pass"}, f"deterministic=True must not use atomics (used {path.used})"
    check_backward(exp, grads, what=f"deterministic={deterministic}, dQ path {sorted(path.used)}: ")


@settings(max_examples=MAIN_EXAMPLES)
@given(p=kernel_problems(dtypes=(np.float64,)), deterministic=st.booleans())
def test_backward_float64_matches_oracle(p, deterministic):
    """dq, dk, dv within 1e-10 (+ score rounding) of their scales."""
    _backward_matches_oracle(p, deterministic)


@settings(max_examples=MAIN_EXAMPLES)
@given(p=kernel_problems(dtypes=(np.float32,)), deterministic=st.booleans())
def test_backward_float32_matches_oracle(p, deterministic):
    """dq, dk, dv within 1e-4 (+ score rounding) of their scales, float32 arithmetic."""
    _backward_matches_oracle(p, deterministic)


@settings(max_examples=MAIN_EXAMPLES)
@given(p=kernel_problems(dtypes=(np.float16,)), deterministic=st.booleans())
def test_backward_float16_within_twice_float16_oracle_error(p, deterministic):
    """max |kernel - oracle64| <= 2 max |oracle16 - oracle64| + floor, for dq, dk, dv (flash-attn's rule)."""
    _backward_matches_oracle(p, deterministic)


@pytest.mark.parametrize("option", sorted(S.ALL_OPTIONS))
@settings(max_examples=PER_OPTION_EXAMPLES)
@given(data=st.data())
def test_backward_each_option_alone(option, data):
    """Each option group on its own (the backward recomputes the scores: every option's code path again)."""
    p = data.draw(kernel_problems(dtypes=(np.float64, np.float32, np.float16), options={option},
                                  required={option}), label="problem")
    _backward_matches_oracle(p, data.draw(st.booleans(), label="deterministic"))


@settings(max_examples=PER_OPTION_EXAMPLES + 1)
@given(p=kernel_problems(dtypes=(np.float64, np.float32), required=S.ALL_OPTIONS), deterministic=st.booleans())
def test_backward_every_option_at_once(p, deterministic):
    """All nine option groups in one backward call."""
    _backward_matches_oracle(p, deterministic)


@settings(max_examples=examples(8, 25))
@given(p=kernel_problems(dtypes=(np.float64, np.float32, np.float16), tiles=atomic_tiles()))
def test_backward_atomic_dq_and_deterministic_dq_both_match_oracle(p):
    """SIMT backward, tiles where the default takes the atomic dQ path: it and the two-pass dQ both agree with
    the oracle (float16 under backend="auto" goes to the tensor-core backward: test_kernel_forward_tc)."""
    exp = expected(p)
    out, lse = kernel_forward(p)
    with DqPath() as path:
        grads = kernel_backward(p, out, lse, backend="simt")
    assert path.used == {"atomic"}, (f"the default backward took the {sorted(path.used)} dQ path for tiles "
                                     f"{p.block_q}x{p.block_k}: update kernel_harness.atomic_tiles")
    check_backward(exp, grads, what="atomic dQ: ")
    check_backward(exp, kernel_backward(p, out, lse, deterministic=True, backend="simt"), what="deterministic dQ: ")


@settings(max_examples=examples(5, 20))
@given(p=kernel_problems(dtypes=(np.float64, np.float32, np.float16)))
def test_backward_deterministic_bit_identical_over_two_runs(p):
    """deterministic=True: the same dq, dk, dv bits on every run (dK/dV never use atomics)."""
    out, lse = kernel_forward(p)
    first = kernel_backward(p, out, lse, deterministic=True)
    second = kernel_backward(p, out, lse, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert_bitwise_equal(a, b, f"{name}, run 1 vs run 2")
    check_backward(expected(p), first)


@settings(max_examples=examples(5, 20))
@given(p=kernel_problems(dtypes=(np.float64, np.float32), tiles=st.just((None, None))),
       deterministic=st.booleans())
def test_backward_default_tiles(p, deterministic):
    """block_q = block_k = None: the API's default tiles."""
    _backward_matches_oracle(p, deterministic)


@settings(max_examples=examples(5, 20))
@given(p=kernel_problems(dtypes=(np.float64,)), deterministic=st.booleans())
def test_backward_with_oracle_out_and_lse(p, deterministic):
    """The backward needs only the forward's out and lse: the oracle's give the same gradients."""
    exp = expected(p)
    grads = kernel_backward(p, exp.out, exp.lse, deterministic=deterministic)
    check_backward(exp, grads)


# ---- the preprocess (delta, lse2) on its own ----------------------------------------------

def _preprocess_case(rng, dtype, nheads, seqlen, ncols, words):
    """(dout, out, lse) on the host: random, lse with -inf rows (queries that saw no key)."""
    width = 2 * ncols if words else ncols
    dout, out = (rng.standard_normal((2, seqlen, nheads, width)).astype(dtype) for _ in range(2))
    lse = rng.standard_normal((2, nheads, seqlen)).astype(np.float32 if dtype != np.float64 else dtype)
    lse[rng.random(lse.shape) < 0.2] = -np.inf
    return dout, out, lse


@pytest.mark.parametrize("threads_c", [1, 2, 4] + ([] if SIMULATOR else [8, 16, 32]))
@pytest.mark.parametrize("words", [False, True])
@settings(max_examples=examples(2, 6))
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from([np.float16, np.float32, np.float64]),
       ncols=st.integers(1, 9) if SIMULATOR else st.integers(1, 160), extra=st.integers(0, 130))
def test_preprocess_rows_over_several_threads(threads_c, words, seed, dtype, ncols, extra):
    """``make_preprocess`` at a forced ``THREADS_C``: ``delta = rowsum(dout * out)`` and ``lse2 = lse log2(e)``
    (+inf where lse = -inf), several blocks per head and a partial last one (seqlen = 2 blocks of rows + extra),
    head dims that the threads of a row do not divide; ``words``: 32-bit word views of float16 pairs (the
    tensor-core backward's).  Bounds: the float64 sum of |dout * out| times the columns times the accumulator's
    epsilon (each product exact or rounded once, each addition rounded once); lse2 to 2 epsilons."""
    from numba import cuda
    from flashnb.kernels.backward import PREPROCESS_THREADS, make_preprocess, preprocess_grid
    if words:
        dtype = np.float16
    rng = np.random.default_rng(seed)
    nheads, seqlen = 2, 2 * (PREPROCESS_THREADS // threads_c) + extra
    dout, out, lse = _preprocess_case(rng, dtype, nheads, seqlen, ncols, words)
    acc = np.float64 if dtype == np.float64 else np.float32
    kern = make_preprocess(np.dtype(acc).name, "float16" if words else None, threads_c)
    args = [cuda.to_device(x.view(np.uint32) if words else x) for x in (dout, out)] + [cuda.to_device(lse)]
    args += [cuda.to_device(np.full((2, nheads, seqlen), np.nan, dtype=acc)) for _ in range(2)]
    kern[preprocess_grid(seqlen, nheads, 2, threads_c), PREPROCESS_THREADS](*args)
    delta, lse2 = (a.copy_to_host() for a in args[3:])
    prod = np.einsum("bihd,bihd->bhi", dout.astype(np.float64), out.astype(np.float64))
    mag = np.einsum("bihd,bihd->bhi", np.abs(dout.astype(np.float64)), np.abs(out.astype(np.float64)))
    bound = mag * dout.shape[-1] * np.finfo(acc).eps + np.finfo(acc).tiny
    assert np.all(np.abs(delta - prod) <= bound), f"delta: max error {np.max(np.abs(delta - prod)):.3g}"
    ref2 = np.where(np.isneginf(lse), np.inf, lse.astype(np.float64) * np.log2(np.e))
    fin = np.isfinite(ref2)
    assert np.all(lse2[~fin] == np.inf)
    assert np.all(np.abs(lse2[fin] - ref2[fin]) <= 2 * np.finfo(acc).eps * np.abs(ref2[fin]) + np.finfo(acc).tiny)


def test_backward_float16_dv_of_one_key_is_exact_at_ties():
    """Each sequence's last query row alone sees the one key (causal, seqlen_k 1), so dV is the sum of the
    group's dO rows with P = 1: exact in float32, then rounded once.  The dO rows are drawn so that every
    sum lies on a tie between two float16 neighbours (round half to even decides); a recomputed P of
    1 -+ 2**-24 (lse's natural-log round trip) moved them to the other side until dV took P rounded to the
    inputs' format, as the tensor cores do (flash-attn's upstream suite found it in bfloat16, through
    ``deterministic=True``, which the SIMT backward serves).  The tensor-core kernels round P already."""
    import flashnb
    rng = np.random.default_rng(11)
    batch, seqlen_q, heads_k, group, d = 2, 3, 4, 3, 8
    q = rng.standard_normal((batch, seqlen_q, heads_k * group, d)).astype(np.float16)
    k, v = (rng.standard_normal((batch, 1, heads_k, d)).astype(np.float16) for _ in range(2))
    dout = rng.standard_normal((batch, seqlen_q, heads_k * group, d)).astype(np.float16)
    # the last row's dO over a group: a + (2**-12 + t) + (2**-12 - t), a in [1, 2) with an odd last bit
    a = (1 + (2 * rng.integers(0, 512, (batch, heads_k, d)) + 1) * 2.0 ** -10) * rng.choice([-1, 1], (batch, heads_k, d))
    t = rng.integers(1, 3, (batch, heads_k, d)) * 2.0 ** -14
    parts = np.stack([a, np.sign(a) * (2.0 ** -12 + t), np.sign(a) * (2.0 ** -12 - t)], axis=-2)   # (b, hk, g, d)
    dout[:, -1] = parts.reshape(batch, heads_k * group, d).astype(np.float16)
    assert np.array_equal(dout[:, -1].astype(np.float64), parts.reshape(batch, heads_k * group, d))
    exact = parts.sum(-2)                                       # a + 2**-11: halfway between a and its neighbour
    want = exact.astype(np.float16)                             # NumPy rounds half to even: a + 2**-10 (a is odd)
    assert not np.array_equal(want, a.astype(np.float16))
    out, lse = flashnb.flash_attention(q, k, v, causal=True, return_lse=True, backend="simt")
    np.testing.assert_array_equal(out[:, -1].astype(np.float64),
                                  np.repeat(v[:, 0].astype(np.float64), group, axis=1))
    _, _, dv = flashnb.flash_attention_backward(dout, q, k, v, out, lse, causal=True, backend="simt",
                                                deterministic=True)          # (dV: the same kernel either way)
    np.testing.assert_array_equal(dv[:, 0], want)
