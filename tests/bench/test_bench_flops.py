"""The FLOP formula and the sweep, against hand-computed cases and the H100 anchor table."""
import pytest

from bench.cases import Case, sweep
from bench.flops import attended_pairs, attention_flops, forward_flops, tflops_per_s


def brute_force_pairs(nq, nk, causal, window):
    """Count allowed (i, j) by the rule of docs/semantics.md, one pair at a time."""
    left, right = window
    off = nk - nq
    n = 0
    for i in range(nq):
        for j in range(nk):
            ok = (not causal or j <= i + off) and (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
            n += ok
    return n


def test_dense_forward_is_4_b_h_nq_nk_d():
    assert forward_flops(2, 3, 5, 7, 11) == 4 * 2 * 3 * 5 * 7 * 11 == 9240


def test_causal_square_is_exactly_half_not_the_triangle():
    # flash-attn convention: 4 B H N^2 d / 2, although N (N + 1) / 2 pairs are unmasked
    assert forward_flops(1, 1, 4, 4, 8, causal=True) == 4 * 16 * 8 // 2 == 256
    assert attended_pairs(4, 4, causal=True) == 10


@pytest.mark.parametrize("nq, nk, pairs", [(3, 5, 3 + 4 + 5), (5, 3, 0 + 0 + 1 + 2 + 3), (1, 6, 6), (6, 1, 1)])
def test_causal_rectangular_counts_bottom_right_pairs(nq, nk, pairs):
    assert attended_pairs(nq, nk, causal=True) == pairs
    assert forward_flops(2, 3, nq, nk, 16, causal=True) == 4 * 2 * 3 * pairs * 16


def test_window_counts_exact_pairs():
    # 4 x 4, window (1, 0): row 0 sees key 0, rows 1..3 see keys i-1, i
    assert attended_pairs(4, 4, window=(1, 0)) == 1 + 2 + 2 + 2
    # a window with causal on a square is not the plain half any more
    assert forward_flops(1, 2, 4, 4, 8, causal=True, window=(1, -1)) == 4 * 2 * 7 * 8


@pytest.mark.parametrize("nq, nk", [(1, 1), (7, 7), (5, 9), (9, 5), (16, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (2, -1), (-1, 1), (3, 2)])
def test_attended_pairs_matches_brute_force(nq, nk, causal, window):
    assert attended_pairs(nq, nk, causal, window) == brute_force_pairs(nq, nk, causal, window)


def test_backward_and_fwdbwd_factors():
    fwd = attention_flops(2, 4, 128, 128, 64, pass_="fwd")
    assert attention_flops(2, 4, 128, 128, 64, pass_="bwd") == 2.5 * fwd
    assert attention_flops(2, 4, 128, 128, 64, pass_="fwdbwd") == 3.5 * fwd
    causal = attention_flops(2, 4, 128, 128, 64, causal=True, pass_="fwdbwd")
    assert causal == 3.5 * fwd / 2
    assert isinstance(causal, int)
    with pytest.raises(ValueError):
        attention_flops(1, 1, 1, 1, 1, pass_="forward")


@pytest.mark.parametrize("n, d, causal, ms, tflops", [
    # rows of ../shared/anchors/h100-sdpa-2026-11-22.txt (torch SDPA on the H100), fwd
    (4096, 64, False, 1.79, 307.1),
    (512, 64, True, 0.227, 151.2),
    (16384, 128, True, 1.935, 568.2),
])
def test_reproduces_the_anchor_tflops(n, d, causal, ms, tflops):
    case = sweep(("float16",), (n,), (d,), (causal,))[0]
    # the anchor rounds ms to 3 decimals: allow that rounding, not more
    assert tflops_per_s(case.flops("fwd"), ms) == pytest.approx(tflops, rel=0.0005 / ms + 1e-3)


def test_default_sweep_is_flash_attn_benchmark_setting():
    cases = sweep()
    assert len(cases) == 6 * 2 * 2
    assert {c.batch * c.seqlen_q for c in cases} == {16384}
    assert {c.nheads * c.headdim for c in cases} == {2048}
    assert {c.seqlen_q for c in cases} == {512, 1024, 2048, 4096, 8192, 16384}
    assert all(c.nheads_k == c.nheads and c.seqlen_k == c.seqlen_q for c in cases)


def test_case_rejects_bad_gqa_and_dtype():
    with pytest.raises(ValueError, match="multiple"):
        Case("float16", 1, 6, 4, 8, 8, 64, False)
    with pytest.raises(ValueError, match="dtype"):
        Case("float64", 1, 1, 1, 8, 8, 64, False)


def test_tflops_of_failed_or_zero_time_is_none():
    assert tflops_per_s(10**12, None) is None
    assert tflops_per_s(10**12, 0.0) is None
    assert tflops_per_s(10**12, 1000.0) == pytest.approx(1.0)
