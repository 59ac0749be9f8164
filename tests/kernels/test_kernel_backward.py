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
