"""reference.io_model: closed-form HBM traffic vs the instrumented oracles, Theorem 2's scaling, Figure 2.

FlashAttention (Dao et al. 2022), Theorem 2: standard attention makes
Theta(N d + N^2) HBM accesses, FlashAttention Theta(N^2 d^2 / M).
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import reference
import strategies as S
from reference import io_model

# Option groups that never skip a tile: the instrumented count must equal the closed form.
NON_STRUCTURAL = S.ALL_OPTIONS - {"causal", "window_size", "block_mask"}
N2_TENSORS = {"S", "P", "dS", "dP"}


def _counts(p: S.Problem):
    """{algorithm: (closed form, instrumented count)} for the six algorithms of io_model."""
    dims = (p.batch, p.nheads, p.seqlen_q, p.seqlen_k, p.headdim)
    blocks = (p.block_q, p.block_k)
    kw = dict(nheads_k=p.nheads_k)
    out, lse, c_std_f = io_model.attention_counted(p.q, p.k, p.v, **p.opts)
    *_, c_std_b = io_model.attention_backward_counted(p.dout, p.q, p.k, p.v, **p.opts)
    *_, c_f2 = io_model.flash_forward_counted(p.q, p.k, p.v, *blocks, **p.opts)
    *_, c_f1 = io_model.flash_forward_v1_counted(p.q, p.k, p.v, *blocks, **p.opts)
    *_, c_b2 = io_model.flash_backward_counted(p.dout, p.q, p.k, p.v, out, lse, *blocks, **p.opts)
    *_, c_b1 = io_model.flash_backward_v1_counted(p.dout, p.q, p.k, p.v, out, lse, *blocks, **p.opts)
    return {
        "standard forward": (io_model.standard_forward_io(*dims, **kw), c_std_f),
        "standard backward": (io_model.standard_backward_io(*dims, **kw), c_std_b),
        "FA2 forward": (io_model.flash2_forward_io(*dims, *blocks, **kw), c_f2),
        "FA1 forward": (io_model.flash1_forward_io(*dims, *blocks, **kw), c_f1),
        "FA2 backward": (io_model.flash2_backward_io(*dims, *blocks, **kw), c_b2),
        "FA1 backward": (io_model.flash1_backward_io(*dims, *blocks, **kw), c_b1),
    }


@given(S.problems(options=NON_STRUCTURAL, max_seqlen=20, allow_empty=True))
def test_closed_forms_equal_instrumented_counts_exactly(p):
    """Per tensor and direction, the closed form == what the oracle counted, element for element."""
    for name, (model, counted) in _counts(p).items():
        assert model.as_dict() == counted.as_dict(), f"{name}: model {model} != counted {counted}"


@given(S.problems(max_seqlen=20, required={"causal"}) | S.problems(max_seqlen=20, required={"window_size"})
       | S.problems(max_seqlen=20, required={"block_mask"}))
def test_skipped_tiles_only_lower_the_count(p):
    """With causal / window / block_mask, tiles are skipped: each tensor's count is <= the closed form."""
    for name, (model, counted) in _counts(p).items():
        for key, n in counted.as_dict().items():
            assert n <= model.as_dict().get(key, 0), f"{name} {key}: counted {n} > model {model.as_dict().get(key)}"


def test_causal_skips_tiles():
    """Causal, square, 4 blocks per side: the tiled forwards skip the 6 tiles above the diagonal."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, 8, 1, 4))
    *_, dense = io_model.flash_forward_counted(q, k, v, 2, 2)
    *_, causal = io_model.flash_forward_counted(q, k, v, 2, 2, causal=True)
    assert dense.reads["K"] == 4 * 8 * 4                 # each of 4 query blocks streams all of K
    assert causal.reads["K"] == (1 + 2 + 3 + 4) * 2 * 4  # query block r sees key blocks 0..r


@given(S.problems(max_seqlen=20))
def test_tiled_algorithms_never_touch_n_squared_tensors(p):
    """S, P, dS, dP exist in HBM only for standard attention."""
    for name, (_, counted) in _counts(p).items():
        tensors = set(counted.reads) | set(counted.writes)
        if name.startswith("standard"):
            assert p.seqlen_q * p.seqlen_k == 0 or "P" in tensors, name
        else:
            assert not tensors & N2_TENSORS, f"{name} moves {tensors & N2_TENSORS}"


@pytest.mark.parametrize("n,d", [(1, 1), (7, 3), (1024, 64), (4096, 128)])
def test_standard_total_matches_hand_count(n, d):
    """Algorithm 0 + 3 per head, square: 11 N^2 + 12 N d + N elements (S, P, dP, dS passes; Q, K, V, O, dO, dQ, dK, dV; lse)."""
    assert io_model.standard_hbm_bytes(1, 1, n, d, elem_bytes=1) == 11 * n * n + 12 * n * d + n
    assert io_model.standard_hbm_bytes(3, 5, n, d, elem_bytes=2) == 2 * 15 * (11 * n * n + 12 * n * d + n)


def test_standard_traffic_grows_like_nd_plus_n_squared():
    """Doubling N: x2 while N << d (the N d term), x4 once N >> d (the N^2 term)."""
    def std(n, d):
        return io_model.standard_hbm_bytes(1, 1, n, d)
    assert 1.9 < std(16, 4096) / std(8, 4096) < 2.1
    assert 3.9 < std(32768, 64) / std(16384, 64) <= 4.0
    for n, d in [(64, 64), (1024, 64), (16384, 128), (8, 4096)]:
        assert 1 <= std(n, d) / 2 / (n * d + n * n) <= 12               # Theta(N d + N^2), elements


def _flash(n, d, m_elems, version=1):
    return io_model.flash_hbm_bytes(1, 1, n, d, 2, 2 * m_elems, version=version) / 2


@pytest.mark.parametrize("version", [1, 2])
def test_flash_traffic_is_theta_n2_d2_over_m(version):
    """flash / (N^2 d^2 / M) stays within a constant band over a grid of N, d, M (d <= M <= N d, >= 4 tiles)."""
    ratios = []
    for n in (1024, 4096, 16384):
        for d in (32, 64, 128):
            for m in (16384, 49152, 98304, 196608):
                if m <= n * d and n / -(-m // (4 * d)) >= 4:
                    ratios.append(_flash(n, d, m, version) / (n * n * d * d / m))
    assert len(ratios) > 20
    assert 16 <= min(ratios) and max(ratios) <= 64, (min(ratios), max(ratios))


@pytest.mark.parametrize("version", [1, 2])
def test_flash_scaling_ratios(version):
    """At large N: doubling N or d multiplies flash traffic by ~4, doubling M divides it by ~2."""
    n, d, m = 16384, 64, 98304
    base = _flash(n, d, m, version)
    assert 3.7 < _flash(2 * n, d, m, version) / base < 4.3
    assert 3.5 < _flash(n, 2 * d, m, version) / base < 4.5
    assert 0.45 < _flash(n, d, 2 * m, version) / base < 0.6
    # The standard/flash ratio tends to a constant of order M / d^2 (= 24 here).
    ratio = io_model.standard_hbm_bytes(1, 1, n, d) / (2 * base)
    assert m / d**2 / 10 < ratio < m / d**2


def test_figure2_setting_is_of_the_order_the_paper_reports():
    """GPT-2 medium fwd+bwd, fp16, A100 SRAM: the paper measures 40.3 GB (standard) vs 4.4 GB (flash)."""
    f = io_model.figure2_comparison()
    assert f["setting"]["batch"] == 64 and f["setting"]["nheads"] == 16
    assert f["setting"]["seqlen"] == 1024 and f["setting"]["headdim"] == 64 and f["setting"]["elem_bytes"] == 2
    n, d = 1024, 64
    assert f["standard_gb"] == pytest.approx(64 * 16 * 2 * (11 * n * n + 12 * n * d + n) / 1e9, rel=1e-12)
    # Of the order of the measurement: within 2x each, and a ratio within 2x of the paper's 9.2x.
    assert 40.3 / 2 < f["standard_gb"] < 40.3 * 2
    for key in ("flash1_gb", "flash2_gb"):
        assert 4.4 / 2 < f[key] < 4.4 * 2, key
        assert (40.3 / 4.4) / 2 < f["standard_gb"] / f[key] < (40.3 / 4.4) * 2, key


def test_paper_block_sizes():
    """Algorithm 1 line 1: Bc = ceil(M / 4d), Br = min(Bc, d); A100 192 KiB fp16 -> M = 98304, (64, 384)."""
    assert io_model.paper_block_sizes(64) == (64, 384)
    assert io_model.paper_block_sizes(128) == (128, 192)
    assert io_model.paper_block_sizes(256, sram_bytes=4096, elem_bytes=4) == (1, 1)
    with pytest.raises(ValueError):
        io_model.paper_block_sizes(64, sram_bytes=64, elem_bytes=2)
