"""The forward kernel (flashnb.flash_attention) against the float64 oracle (reference.attention).

Properties over random problems (tests/strategies.py, sized by kernel_harness
for the simulator or a GPU): seqlen_q != seqlen_k, lengths of 1 and lengths that
are not multiples of the tile, tiles larger than the sequence, MHA/GQA/MQA, odd
head dims, tiles drawn from powers of two, every option alone and in
combination, float64/float32/float16.  Outputs are NaN-poisoned before the
launch, inputs must come back bit-identical.  Tolerances: kernel_harness's
docstring (float64 1e-10, float32 1e-4 relative to the output scale, float16
flash-attn's 2x-the-float16-oracle rule).
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import strategies as S
from kernel_harness import (check_forward, examples, expected, kernel_forward, kernel_problems,
                            assert_bitwise_equal, poison_outputs)  # noqa: F401 (autouse fixture)

# The simulator spends ~1 s per forward at these sizes: the parametrised
# per-option tests draw fewer examples each (every option is still exercised).
PER_OPTION_EXAMPLES = examples(4, 15)


def _forward_matches_oracle(p):
    out, lse = kernel_forward(p)
    check_forward(expected(p, backward=False), out, lse)


@given(p=kernel_problems(dtypes=(np.float64,)))
def test_forward_float64_matches_oracle(p):
    """out within 1e-10 (+ score rounding) of the output scale, lse likewise, -inf rows exact."""
    _forward_matches_oracle(p)


@given(p=kernel_problems(dtypes=(np.float32,)))
def test_forward_float32_matches_oracle(p):
    """out within 1e-4 (+ score rounding) of the output scale in float32 arithmetic."""
    _forward_matches_oracle(p)


@given(p=kernel_problems(dtypes=(np.float16,)))
def test_forward_float16_within_twice_float16_oracle_error(p):
    """max |kernel - oracle64| <= 2 max |oracle16 - oracle64| + floor (flash-attn's rule)."""
    _forward_matches_oracle(p)


@pytest.mark.parametrize("option", sorted(S.ALL_OPTIONS))
@settings(max_examples=PER_OPTION_EXAMPLES)
@given(data=st.data())
def test_forward_each_option_alone(option, data):
    """Each option group of semantics.md on its own (any dtype): catches an option that only works combined."""
    p = data.draw(kernel_problems(dtypes=(np.float64, np.float32, np.float16), options={option},
                                  required={option}), label="problem")
    _forward_matches_oracle(p)


@settings(max_examples=PER_OPTION_EXAMPLES + 2)
@given(p=kernel_problems(dtypes=(np.float64, np.float32), required=S.ALL_OPTIONS))
def test_forward_every_option_at_once(p):
    """All nine option groups in one call (their specialisation flags all on)."""
    _forward_matches_oracle(p)


@settings(max_examples=examples(6, 20))
@given(p=kernel_problems(dtypes=(np.float64, np.float32, np.float16)))
def test_forward_bit_identical_over_two_runs_and_with_or_without_lse(p):
    """The forward has no atomics: two runs give the same bits; return_lse=False gives the same out."""
    out1, lse1 = kernel_forward(p)
    out2, lse2 = kernel_forward(p)
    assert_bitwise_equal(out1, out2, "out, run 1 vs run 2")
    assert_bitwise_equal(lse1, lse2, "lse, run 1 vs run 2")
    out3 = kernel_forward(p, return_lse=False)
    assert isinstance(out3, np.ndarray), "return_lse=False must return out alone"
    assert_bitwise_equal(out1, out3, "out with return_lse=True vs False")
    check_forward(expected(p, backward=False), out1, lse1)


@settings(max_examples=examples(6, 25))
@given(p=kernel_problems(dtypes=(np.float64, np.float32, np.float16), tiles=st.just((None, None))))
def test_forward_default_tiles(p):
    """block_q = block_k = None: the API's default tiles for the head dim and dtype."""
    _forward_matches_oracle(p)


def _simt_shared(bq, bk, headdim, acc, backward):
    """Bytes of shared memory per block of the SIMT forward, or the larger of the dK/dV and dQ kernels'."""
    from flashnb.kernels.backward import make_dkdv, make_dq
    from flashnb.kernels.forward import make_forward
    if backward:
        return max(make_dkdv(bq, bk, headdim, acc, True, *[False] * 7)[1], make_dq(bq, bk, headdim, acc, *[False] * 7)[1])
    return make_forward(bq, bk, headdim, acc, *[False] * 7)[1]


@pytest.mark.parametrize("acc", ["float32", "float64"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_default_tiles_fit_the_device(acc, headdim):
    """The SIMT kernels' default tiles: the measured ones at the H100's 227 KB of shared memory per block, halved
    until the forward (and, separately, the dK/dV and dQ kernels) fit a smaller device's (8.0: 163 KB; 8.6 /
    8.9: 99 KB; 7.5: 64 KB; 48 KB without opting in); with one side given by the caller, only the other."""
    from flashnb import plan
    measured = next(t for d, t in plan._GPU_TILES[acc] if headdim <= d)
    for limit in (48 * 1024, 64 * 1024, 99 * 1024, 163 * 1024, 227 * 1024):
        for backward in (False, True):
            bq, bk = plan._default_simt_tiles(headdim, acc, backward, limit)
            assert bq <= measured[0] and bk <= measured[1], (limit, backward, bq, bk)
            need = _simt_shared(bq, bk, headdim, acc, backward)
            assert need <= limit, (limit, backward, bq, bk, need)
            for given in (dict(block_q=measured[0]), dict(block_k=measured[1])):
                tq, tk = plan._default_simt_tiles(headdim, acc, backward, limit, **given)
                assert (tq, tk) == (given.get("block_q", tq), given.get("block_k", tk)), (given, tq, tk)
                need = _simt_shared(tq, tk, headdim, acc, backward)
                free = tk if "block_q" in given else tq
                assert need <= limit or free == 1, (limit, backward, given, tq, tk, need)
    for backward in (False, True):
        assert plan._default_simt_tiles(headdim, acc, backward, 227 * 1024) == measured
    if (acc, headdim) == ("float32", 128):   # the backward's 64 x 32 needs 107904 bytes, over 8.6 / 8.9's limit
        assert plan._default_simt_tiles(128, acc, True, 99 * 1024) == (32, 32)
        assert plan._default_simt_tiles(128, acc, True, 99 * 1024, block_q=64) == (64, 16)


def test_default_tiles_are_chosen_per_pass(monkeypatch):
    """The forward asks for the forward's default tiles and the backward for the backward's (whose kernels need
    more shared memory), each with the side the caller gave."""
    import flashnb
    from flashnb import plan
    calls = []
    real = plan.default_tiles
    monkeypatch.setattr(plan, "default_tiles", lambda *a: (calls.append(a), real(*a))[1])
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 9, 2, 16)).astype(np.float32) for _ in range(3))
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True, block_q=4)
    flashnb.flash_attention_backward(q, q, k, v, out, lse, block_k=4)
    assert calls == [(16, "float32", False, 4, None), (16, "float32", True, None, 4)], calls


@settings(max_examples=examples(6, 25))
@given(p=kernel_problems(dtypes=(np.float64, np.float32), scale=1.0), softmax_scale=st.floats(-2.0, 2.0))
def test_forward_any_finite_softmax_scale(p, softmax_scale):
    """softmax_scale may be 0 (uniform attention) or negative: it only multiplies q . k."""
    p = p.with_opts(softmax_scale=softmax_scale)
    _forward_matches_oracle(p)
