"""float32's backward on the tensor cores (kernels/backward_tc.py with ``DTYPE_NAME="float32"``) against the float64
oracle.

* ``precision="highest"`` (3xTF32): the float32 bound of kernel_harness, and, in the simulator, the issue's rule:
  dq, dk, dv within twice the error of the SIMT kernels' backward (float32 on the CUDA cores) on the same inputs,
  plus a floor for what 3xTF32 itself drops.  A split operand ``big + small`` is the float32 value to a relative
  2**-22 (each tf32 rounding keeps 11 significant bits), and the product drops ``small * small`` (another 2**-22):
  each term of a product is off by up to 3 x 2**-22 = 6 EPS32 of its magnitude.  A gradient's terms carry that of
  their own product, of dP's (inside the scale: ``magnitudes`` sums ``|dO| |V|``) and of the scores' (an absolute
  score error of 6 EPS32 ``s_dot`` is that relative error in P): floor ``8 EPS32 (2 + s_dot)`` of the scale.
  The simulator's mma twins accumulate exactly, so there the rule checks the algorithm (the splits, the three
  products per k-step, the permuted k-steps, the fragments); on a GPU only the float32 bound is asserted (the
  forward missed the rule there by 4-16x before its per-k-step partial sums, test_kernel_forward_tf32), and
  ``tools/tf32_bwd_error.py`` measures the ratio.
* ``precision="high"`` (one tf32 product), with the oracle's ``out`` and ``lse`` (so that the bound is the
  backward's own): K, V, Q, dO are truncated to tf32 by the tensor cores (relative error < 2**-10), P and dS
  rounded (<= 2**-11).  A score and dP are off by 2**-9 of ``|q| . |k|`` and ``|dO| . |V|`` (two truncated
  operands), so P by ``score_err = 2**-9 s_dot`` (+ float32's) relatively, and dV, dK, dQ by at most
  ``2**-11 + 2**-10 + 2**-9 + score_err`` of their scales; the bound is twice that plus the float32 bound.

In the simulator the tf32 ``mma`` and the fused 3xTF32 step (``backward_tc.tf32x3_mma``) are shared-memory twins
that read the operands as the tensor cores do (the low 13 bits of each word dropped), so the kernel code under
test is the GPU's.  Options, grouped-query heads, odd head dims (scalar dQ atomics), the layouts the plan takes
for float32 (one warp per 16 keys; above head dim 64 S^T shared by pairs of warps with the deferred dQ).
"""
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import flashnb
import reference
import strategies as S
from flashnb import plan
from flashnb.kernels._jit import SIMULATOR
from kernel_harness import (EPS32, LAYOUT_GRID, check_backward, examples, expected, kernel_backward, kernel_forward,
                            kernel_problems, poison_outputs, rel_bound)  # noqa: F401

if SIMULATOR:
    TILES = st.sampled_from([(16, 16), (32, 16), (16, 32), (None, None)])
    HEADDIMS = (1, 3, 4, 8)
    MAX_SEQLEN = 24
    # the properties' first (derandomised) examples are the smallest: at least two 8-query and 8-key k-steps
    # and two dQ m-tiles in each, so the permuted k-steps and the fragments' rows matter from the first example
    MIN_SEQLEN = 17
else:
    TILES = st.tuples(st.sampled_from([None, 16, 32, 64]), st.sampled_from([None, 16, 32, 64, 128]))
    HEADDIMS = (1, 8, 33, 64, 80, 128, 256)
    MAX_SEQLEN = None
    MIN_SEQLEN = 1

TF32_EPS = 2.0 ** -10                   # truncation's relative error; rounding's is half of it


def problems(**kw):
    kw.setdefault("headdims", HEADDIMS)
    kw.setdefault("tiles", TILES)
    return kernel_problems(dtypes=(np.float32,), max_seqlen=MAX_SEQLEN, **kw)


def _tc_backward(p, precision, out=None, lse=None):
    """dq, dk, dv on the tensor cores at ``precision`` for the problem (``out``, ``lse``: default the tensor-core
    forward's at that precision); tiles the planner refuses for their threads are not drawn."""
    bq, bk = plan.default_tc_bwd_tiles(p.headdim, None, None, "float32", precision)
    assume(plan.tc_bwd_threads(p.block_q or bq, p.block_k or bk, p.headdim, "float32") <= 256)
    if out is None:
        out, lse = kernel_forward(p, backend="tensorcore", precision=precision)
    return out, lse, kernel_backward(p, out, lse, backend="tensorcore", precision=precision)


def _assert_within_twice_simt(p, exp, grads, out, lse):
    """The issue's rule (module docstring): each gradient's error at most twice the SIMT backward's on the same
    ``out`` and ``lse``, plus 3xTF32's floor."""
    simt = flashnb.flash_attention_backward(p.dout, p.q, p.k, p.v, out, lse, **p.opts, backend="simt")
    for name, got, base in zip(("dq", "dk", "dv"), grads, simt):
        ref = exp.grads[name]
        fin = np.isfinite(ref)
        err = float(np.max(np.abs(np.asarray(got, np.float64) - ref)[fin], initial=0.0))
        simt_err = float(np.max(np.abs(np.asarray(base, np.float64) - ref)[fin], initial=0.0))
        floor = 8 * EPS32 * (2 + exp.mags["s_dot"]) * exp.mags[name] + 4 * np.finfo(np.float32).tiny
        assert err <= 2 * simt_err + floor, \
            f"{name}: 3xTF32 error {err:.3g} > 2 x SIMT's {simt_err:.3g} + {floor:.3g}"


def _check_highest(p):
    out, lse, grads = _tc_backward(p, "highest")
    exp = expected(p)
    check_backward(exp, grads)                                    # the float32 bound
    if SIMULATOR:                                                 # (module docstring: on a GPU the bound only)
        _assert_within_twice_simt(p, exp, grads, out, lse)


def _high_expected(p):
    """The float32 Expected with the tf32 bound of the module docstring."""
    exp = expected(p)
    score_err = 2 * TF32_EPS * exp.mags["s_dot"] + EPS32 * ((p.headdim + 2) * exp.mags["s_dot"] + 4 * exp.mags["s_add"])
    unit = TF32_EPS / 2 + TF32_EPS + 2 * TF32_EPS
    exp.rel = rel_bound(np.float32, p.headdim, exp.mags) + 2 * unit + 2 * score_err
    return exp


def _check_high(p):
    out, lse = (x.astype(np.float32) for x in reference.attention(p.q, p.k, p.v, **p.opts))
    _, _, grads = _tc_backward(p, "high", out, lse)
    check_backward(_high_expected(p), grads)


@settings(max_examples=examples(4, 25))
@given(p=problems(max_batch=1, min_seqlen=MIN_SEQLEN) if SIMULATOR else problems())
def test_highest_within_twice_the_simt_error(p):
    """(In the simulator one batch element, the cost of 3xTF32's three products per step: the batch offsets are
    the 16-bit kernel's code, and the "high" property draws two.)"""
    _check_highest(p)


@settings(max_examples=examples(4, 25))
@given(p=problems(min_seqlen=MIN_SEQLEN))
def test_high_within_the_tf32_bound(p):
    _check_high(p)


@pytest.mark.parametrize("precision", plan.PRECISIONS)
@settings(max_examples=examples(2, 8))
@given(p=problems(required=S.ALL_OPTIONS, min_seqlen=min(MIN_SEQLEN, 9)))
def test_every_option_at_once(precision, p):
    (_check_highest if precision == "highest" else _check_high)(p)


def _with_layout(p, check, split, key_tiles, share):
    """``check(p)`` with the dK/dV kernel's warp layout forced (warps per 16 keys, key m-tiles per warp, S^T shared),
    whatever the plan would choose for this problem."""
    real = plan._tc_bwd_layout
    plan._tc_bwd_layout = lambda block_q, block_k, headdim, dtype: (split, key_tiles, share)
    try:
        check(p)
    finally:
        plan._tc_bwd_layout = real


@pytest.mark.parametrize("share", [True, False], ids=["shared scores", "both warps compute S^T"])
@settings(max_examples=examples(1, 6))
@given(data=st.data())
def test_highest_head_dim_split(share, data):
    """The 3xTF32 kernel with two warps per 16 keys, each accumulating dK, dV for half of the head dim (padded to a
    multiple of 32: head dim 20 puts real dims in both halves) and dQ deferred to the next item's barrier, forced:
    S^T and dP^T computed once per pair of warps, each for half of the query tile, and read back by both from
    shared memory as float32 words (``tc_bwd_share``: the plan's choice from head dim 80 to 128 at block_q 32), or
    computed by both (above 128 at block_q 16); any option, at least two query tiles or two heads (so the deferred
    dQ of one item runs in the next)."""
    p = data.draw(problems(tiles=st.sampled_from([(32, 16)] if share else [(16, 16), (16, 32)]) if SIMULATOR
                           else st.sampled_from([(32, 64), (32, 32)] if share else [(16, 32), (16, 64)]),
                           headdims=(20,) if SIMULATOR else ((80, 128) if share else (80, 128, 256)),
                           min_seqlen=17 if not share else 1,
                           **LAYOUT_GRID), label="problem")
    assume(p.seqlen_q > (32 if share else 16) or p.nheads > 1)
    _with_layout(p, _check_highest, 2, 1, share)


@settings(max_examples=examples(2, 6))
@given(lens=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=3),
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_highest_packed_batches(lens, causal, seed):
    """A packed (varlen) float32 batch's backward on the tensor cores (``VARLEN`` with tf32 operands; the varlen
    functions take no ``precision``: "highest"): each sequence's gradients against the oracle's dense backward of
    that sequence, within 1e-5 of their largest magnitude (or of 1; unit-normal inputs, head dim 8: some ten
    float32 ulps)."""
    rng = np.random.default_rng(seed)
    sq, sk = (np.array([x[i] for x in lens]) for i in (0, 1))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (sq, sk))
    q, dout = (rng.standard_normal((sq.sum(), 2, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((sk.sum(), 1, 8)).astype(np.float32) for _ in range(2))
    max_q, max_k = max(int(sq.max()), 1), max(int(sk.max()), 1)
    out, lse = flashnb.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True)
    grads = flashnb.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal,
                                               backend="tensorcore")
    tol = 1e-5
    for b in range(len(lens)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref = reference.attention_backward(dout[None, rq], q[None, rq], k[None, rk], v[None, rk], causal=causal)
        for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
            rows = rq if name == "dq" else rk
            scale = max(float(np.max(np.abs(r), initial=0.0)), 1.0)
            err = float(np.max(np.abs(got[rows] - r[0]), initial=0.0))
            assert err <= tol * scale, f"sequence {b} {name}: error {err:.3g} > {tol:.3g} x {scale:.3g}"


def test_precision_is_checked_and_auto_keeps_float32_on_simt(monkeypatch):
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 4, 1, 8)).astype(np.float32) for _ in range(3))
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="precision must be one of"):
        flashnb.flash_attention_backward(q, q, k, v, out, lse, backend="tensorcore", precision="medium")
    with pytest.raises(ValueError, match="deterministic=True needs backend='simt'"):
        flashnb.flash_attention_backward(q, q, k, v, out, lse, backend="tensorcore", deterministic=True)
    chosen = []
    real = plan.backward
    monkeypatch.setattr(plan, "backward", lambda call: chosen.append(real(call)) or chosen[-1])
    flashnb.flash_attention_backward(q, q, k, v, out, lse, precision="high")
    assert [b.backend for b in chosen] == ["simt"]


@pytest.mark.parametrize("headdim", [8, 64, 128, 256])
@pytest.mark.parametrize("precision", plan.PRECISIONS)
def test_default_tiles_fit_the_h100(headdim, precision):
    """float32's backward tiles (plan._TC_BWD_TILES_F32): the first candidate fits 227 KB per block with at most
    256 threads."""
    bq, bk = plan._default_tc_bwd_tiles(headdim, 227 * 1024, None, None, "float32", precision)
    assert plan.tc_bwd_shared_bytes(bq, bk, headdim, "float32", precision) <= 227 * 1024
    assert plan.tc_bwd_threads(bq, bk, headdim, "float32") <= 256
