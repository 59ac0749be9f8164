"""The FP8 forward (``flashnb.flash_attention_fp8``, kernels/forward_fp8.py) against its oracle,
``reference.fp8.fp8_flash_forward``: attention of the dequantised e4m3 inputs with P quantised to e4m3 for the
``P V`` product, key tiles of 128 as the kernel's.

Bound.  The oracle quantises P from float64 ``exp``, the kernel from float32 ``exp2`` of a float32 argument:
they differ by ~1e-6 relative, so an entry that close to a midpoint between codes rounds the other way; the
products of e4m3 values are exact, their sums are float64 in the simulator's wgmma twin and float32 in the
softmax.  So the kernel's output is the oracle's rounded to float16, ``|out - ref| <= 2^-10 |ref| + 2^-14 max
|ref|`` (twice the half-unit, and a floor for the float32 accumulation of ``l`` and ``acc``), plus two P entries a
row rounded to the neighbouring code (``_flips``; a CI run drew one).  A key relabelled wrongly in V^T
(``key_at``) or a wrong fragment byte pairs a probability with another key's value, an error of the order of
``|ref|`` itself over many rows (swapping neighbouring keys fails the test).  On a GPU Hopper's FP8 tensor cores are reported
to accumulate with fewer bits than float32 (test_kernel_wgmma.py bounds a product by ``2^-8 sum |a b|``): S moves
by ~1e-4 of its size, and a P entry that far from a midpoint flips (``python -m tools.fp8_check check`` measured
about 1e-2 of max |out| on an H200), so on a GPU the bound is flash-attn's rule against the exact answer
(attention of the dequantised inputs in float64): the kernel's max error at most twice the oracle's (whose error
is P's quantisation), plus float16's rounding; lse, which does not see P's codes, within the products' bound
``2^-8 max_j sum_d |q_d k_d|`` (scaled) of the oracle's.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flashnb
from flashnb.kernels import forward_fp8
from flashnb.kernels._jit import SIMULATOR
from flashnb.kernels._wgmma import e4m3_codes
from reference.fp8 import fp8_flash_forward, quantize_e4m3


def _codes(rng, shape, descale):
    """e4m3 codes of normal data at scale ``descale`` (amax near 448 descale for unit data)."""
    return quantize_e4m3(rng.standard_normal(shape) / descale).astype(np.uint8)


def _descales(rng, per_head, batch, nheads_k):
    if per_head:
        return [rng.uniform(1 / 200, 1 / 50, (batch, nheads_k)).astype(np.float32) for _ in range(3)]
    return [float(rng.uniform(1 / 200, 1 / 50)) for _ in range(3)]


def _flips(q8, k8, v8, qd, kd, vd, causal, blocks=(None, None)):
    """Two P entries a row rounded to the neighbouring e4m3 code: the kernel's float32 ``exp2`` and the oracle's
    float64 ``exp`` differ by ~1e-6 relative, so an entry that close to a midpoint between codes rounds the other
    way (on the order of one a row at these sizes); each moves ``out`` by at most one code's step, ``2^-3 P_ij
    |v_j|``.  A key paired with another key's value moves it by ~``P_ij |v_j|`` over many rows."""
    from reference import attention_probs
    from reference.fp8 import _dequantize_inputs
    q, k, v = _dequantize_inputs(q8, k8, v8, qd, kd, vd, *blocks)
    probs = attention_probs(q, k, v, causal=causal)                      # (batch, nheads, seqlen_q, seqlen_k)
    v_r = np.abs(np.repeat(v, q.shape[2] // k.shape[2], axis=2)).transpose(0, 2, 1, 3)
    top = np.zeros(probs.shape[:3] + (v.shape[3],))
    for j in range(probs.shape[3]):
        np.maximum(top, probs[:, :, :, j, None] * v_r[:, :, None, j], out=top)
    return 2 * 2.0 ** -3 * top.transpose(0, 2, 1, 3)


def _check(b, sq, sk, hk, group, d, causal, per_head, seed):
    rng = np.random.default_rng(seed)
    h = hk * group
    qd, kd, vd = _descales(rng, per_head, b, hk)
    q8 = _codes(rng, (b, sq, h, d), 1 / 100)
    k8 = _codes(rng, (b, sk, hk, d), 1 / 100)
    v8 = _codes(rng, (b, sk, hk, d), 1 / 100)
    copies = [x.copy() for x in (q8, k8, v8)]
    out, lse = flashnb.flash_attention_fp8(q8, k8, v8, qd, kd, vd, causal=causal, return_lse=True)
    for x, c in zip((q8, k8, v8), copies):
        assert np.array_equal(x, c), "an input was modified"
    ref, ref_lse = fp8_flash_forward(q8, k8, v8, qd, kd, vd, block_k=forward_fp8.BLOCK_K, causal=causal)
    assert out.dtype == np.float16 and out.shape == (b, sq, h, d)
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), seen), "rows that see no key: lse -inf"
    if SIMULATOR:
        err = np.abs(out.astype(np.float64) - ref)
        bound = 2.0 ** -10 * np.abs(ref) + 2.0 ** -14 * max(np.abs(ref).max(), 1e-30) + _flips(
            q8, k8, v8, qd, kd, vd, causal)
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert np.all(err <= bound), f"out at {worst}: {out[worst]} against {ref[worst]} (bound {bound[worst]:.2e})"
        assert np.allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)
    else:
        _check_against_exact(out, lse, ref, ref_lse, q8, k8, v8, qd, kd, vd, causal)
    assert np.all(out[~seen.transpose(0, 2, 1)] == 0), "rows that see no key: out 0"


def _check_against_exact(out, lse, ref, ref_lse, q8, k8, v8, qd, kd, vd, causal, blocks=(None, None)):
    """On a GPU (module docstring): max |out - exact| <= 2 max |ref - exact| + float16's rounding, exact the float64
    attention of the dequantised inputs; |lse - ref_lse| within the FP8 products' bound on S."""
    from reference import attention
    from reference.fp8 import _dequantize_inputs
    q, k, v = _dequantize_inputs(q8, k8, v8, qd, kd, vd, *blocks)
    exact, _ = attention(q, k, v, causal=causal)
    top = max(np.abs(exact).max(), 1e-30)
    kernel_err = np.abs(out.astype(np.float64) - exact).max()
    oracle_err = np.abs(ref - exact).max()
    assert kernel_err <= 2 * oracle_err + 2.0 ** -10 * top, f"max error {kernel_err:.3e}, the oracle's {oracle_err:.3e}"
    group = q.shape[2] // k.shape[2]
    scale = 1 / math.sqrt(q.shape[3])
    qk_abs = np.einsum("bihd,bjhd->bhij", np.abs(q), np.repeat(np.abs(k), group, axis=2)) * scale
    s_bound = 2.0 ** -8 * qk_abs.max(axis=-1).transpose(0, 2, 1)            # (batch, seqlen_q, nheads)
    seen = np.isfinite(ref_lse)
    lse_err = np.abs(np.where(seen, lse - ref_lse, 0)).transpose(0, 2, 1)
    assert np.all(lse_err <= s_bound + 1e-5), f"lse error {lse_err.max():.3e}"


@pytest.mark.parametrize("d, causal, sq, sk", [(64, False, 70, 150), (128, True, 70, 200), (64, True, 150, 40)])
def test_fp8_forward_matches_its_oracle(d, causal, sq, sk):
    """Explicit cases: one query tile over two key tiles (the last partial) at head dims 64 and 128, causal with
    two query tiles and more queries than keys (the first rows see no key)."""
    _check(1, sq, sk, 1, 2, d, causal, True, d + sq)


@pytest.mark.parametrize("d, causal, sq, sk, block_q, block_k, hk, group", [
    (64, True, 260, 300, 256, 128, 1, 1), (64, False, 70, 300, None, 256, 1, 2), (64, True, 200, 150, 128, None, 1, 2),
    (64, False, 40, 200, None, 128, 2, 2)])
def test_fp8_forward_with_block_descales_matches_its_oracle(d, causal, sq, sk, block_q, block_k, hk, group):
    """Block quantisation (``quantize_fp8(per="block")``, ``descale_block_q`` / ``descale_block_k``): the rows of
    each block at their own scale (4^i for block i, so every key tile's K and V descales differ and the kernel's
    accumulator changes units each tile), grouped query heads (with two key heads: each query head's per-head
    descale its key head's, h // 2, and each key head's own blocks); the other tensors' descales per
    (batch, key head) where only one side has blocks.  Held to ``fp8_flash_forward`` with the same blocks, as
    ``_check`` holds the plain call."""
    rng = np.random.default_rng(d + sq + sk)
    b = 1

    def data(L, h, block):
        x = rng.standard_normal((b, L, h, d))
        if block is not None:
            x *= 4.0 ** (np.arange(L) // block)[None, :, None, None]
        return x

    q, k, v = data(sq, hk * group, block_q), data(sk, hk, block_k), data(sk, hk, block_k)
    q *= (1.0 + np.arange(hk * group))[None, None, :, None]              # each head its own scale
    k *= (1.0 + 3 * np.arange(hk))[None, None, :, None]
    if block_q is None:
        q8, dq = flashnb.quantize_fp8(q, per="head", group=group)
    else:
        q8, dq = flashnb.quantize_fp8(q, per="block", block=block_q)
    (k8, dk), (v8, dv) = (flashnb.quantize_fp8(x, per="block" if block_k else "head", block=block_k or 1)
                          for x in (k, v))
    assert (block_q is None or len(np.unique(dq)) > 1) and (block_k is None or len(np.unique(dk)) > 1)
    copies = [x.copy() for x in (q8, k8, v8, dq, dk, dv)]
    blocks = dict(descale_block_q=block_q, descale_block_k=block_k)
    out, lse = flashnb.flash_attention_fp8(q8, k8, v8, dq, dk, dv, causal=causal, return_lse=True, **blocks)
    for x, c in zip((q8, k8, v8, dq, dk, dv), copies):
        assert np.array_equal(x, c), "an input was modified"
    ref, ref_lse = fp8_flash_forward(q8, k8, v8, dq, dk, dv, block_k=forward_fp8.BLOCK_K, causal=causal, **blocks)
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    if SIMULATOR:
        err = np.abs(out.astype(np.float64) - ref)
        bound = 2.0 ** -10 * np.abs(ref) + 2.0 ** -14 * np.abs(ref).max() + _flips(
            q8, k8, v8, dq, dk, dv, causal, (block_q, block_k))
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert np.all(err <= bound), f"out at {worst}: {out[worst]} against {ref[worst]} (bound {bound[worst]:.2e})"
        assert np.allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)
    else:
        _check_against_exact(out, lse, ref, ref_lse, q8, k8, v8, dq, dk, dv, causal, (block_q, block_k))
    assert np.all(out[~seen.transpose(0, 2, 1)] == 0)


@pytest.mark.parametrize("change, error, words", [
    (dict(descale_block_q=100), ValueError, "descale_block_q"),
    (dict(descale_block_k=True), ValueError, "descale_block_k"),
    (dict(descale_block_q=128, q_descale=np.ones((1, 2, 1), np.float32)), ValueError, "q_descale"),
    (dict(descale_block_k=128, v_descale=np.ones((1, 1), np.float32)), ValueError, "v_descale"),
    (dict(descale_block_k=128, k_descale=-np.ones((1, 1, 2), np.float32)), ValueError, "k_descale"),
    (dict(descale_block_k=128, k_descale=np.array([[[1e-30, 1.0]]], np.float32),
          q_descale=np.full((1, 2, 2), 1e-20, np.float32)), ValueError, "softmax_scale \\* q_descale"),
])
def test_fp8_block_descales_refuse_bad_input(change, error, words):
    """Blocks that are not multiples of the tiles, descales of the wrong shape (q's a query head's own; k's and v's
    per key head), not positive, or whose product with the scale leaves float32 (1e-20 x 1e-30 underflows to 0):
    refused before any launch, naming the argument."""
    rng = np.random.default_rng(3)
    q8, k8, v8 = _codes(rng, (1, 200, 2, 64), 1 / 100), _codes(rng, (1, 150, 1, 64), 1 / 100), _codes(
        rng, (1, 150, 1, 64), 1 / 100)
    kw = dict(q_descale=np.full((1, 2, 2), 0.01, np.float32), k_descale=np.full((1, 1, 2), 0.01, np.float32),
              v_descale=np.full((1, 1, 2), 0.01, np.float32), descale_block_q=128, descale_block_k=128)
    kw.update(change)
    if "descale_block_q" in change and change["descale_block_q"] != 128:
        kw["q_descale"] = 0.01
    with pytest.raises(error, match=words):
        flashnb.flash_attention_fp8(q8, k8, v8, **kw)


@settings(max_examples=3, deadline=None)
@given(b=st.integers(1, 2), sq=st.integers(1, 140), sk=st.integers(1, 300), hk=st.integers(1, 2),
       group=st.sampled_from([1, 2]), causal=st.booleans(), per_head=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_fp8_forward_property(b, sq, sk, hk, group, causal, per_head, seed):
    """Shapes (key tiles past the two stages: the copy engine refills a stage), grouped heads, descales per
    tensor or per (batch, key head), causal or not, at head dim 64."""
    _check(b, sq, sk, hk, group, 64, causal, per_head, seed)


@pytest.mark.skipif(SIMULATOR, reason="head dim 256 takes ~80 s in the simulator; tools/fp8_check.py runs it")
def test_fp8_forward_head_dim_256():
    _check(1, 130, 300, 1, 2, 256, True, True, 256)


@pytest.mark.skipif(SIMULATOR, reason="PyTorch CUDA tensors (tests/test_dispatch.py replays Numba arrays there)")
def test_fp8_forward_replays_torch_tensors_and_their_descales():
    """PyTorch float8_e4m3fn inputs with (batch, nheads_k) float32 descale tensors, FA3's convention: the second
    call with other tensors of the same signature is a replay of the dispatch cache, equal to the full path's
    output bit for bit, and reads its own descales."""
    torch = pytest.importorskip("torch")
    from flashnb import _dispatch

    def inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        xs = [torch.randn(2, s, h, 128, device="cuda", generator=g) for s, h in ((300, 4), (500, 2), (500, 2))]
        return [flashnb.quantize_fp8(x, "head", group=g_) for x, g_ in zip(xs, (2, 1, 1))]

    _dispatch.clear()
    first = inputs(0)
    flashnb.flash_attention_fp8(*(c for c, _ in first), *(d for _, d in first), causal=True)
    assert _dispatch.stats["recorded"] == 1
    new = inputs(1)
    args = [c for c, _ in new] + [d for _, d in new]
    replayed = flashnb.flash_attention_fp8(*args, causal=True)
    assert _dispatch.stats["hits"] == 1
    _dispatch.clear()
    full = flashnb.flash_attention_fp8(*args, causal=True)
    assert torch.equal(replayed, full), "a replayed call differs from the full path's"
    twice = flashnb.flash_attention_fp8(*args[:5], args[5] * 2, causal=True)       # v's descales doubled
    assert torch.allclose(twice.float(), 2 * full.float(), rtol=2 ** -7, atol=0), "the replay ignored v_descale"


def test_key_at_pairs_p_fragments_with_their_keys():
    """V^T's position ``c`` holds the key whose probability byte ``c`` of P's A fragment carries: A's columns
    ``4 t .. 4 t + 3`` (``+ 16``) are the accumulators' columns ``2 t, 2 t + 1`` of n-tiles 0, 1 (2, 3)."""
    keys = [forward_fp8.key_at(c) for c in range(32)]
    assert sorted(keys) == list(range(32))
    for t in range(4):
        for h in range(2):
            for i in range(4):
                assert keys[16 * h + 4 * t + i] == 8 * (2 * h + i // 2) + 2 * t + i % 2


def _relabelled_keys(n):
    """The key at each of V^T's ``n`` positions: ``32 (p // 32) + key_at(p % 32)``."""
    return np.array([32 * (p // 32) + forward_fp8.key_at(p % 32) for p in range(n)])


@pytest.mark.parametrize("seqlen_k, nheads_k, d, words", [(150, 2, 64, True), (300, 1, 128, True),
                                                          (200, 3, 256, True), (150, 2, 64, False)])
def test_the_pre_passes_write_v_transposed_and_relabelled(seqlen_k, nheads_k, d, words):
    """``make_prepare_vt_words`` (four bytes a load and a store, on flat views; ``words``) and ``make_prepare_vt``
    (byte by byte, any strides: v without a word view): V^T's position ``p`` of row ``d`` holds key ``32 (p // 32)
    + key_at(p % 32)``'s byte ``d``, zero past the keys; the keys not a multiple of a group (32) nor of a block
    (128), so the last block writes only V^T's padded length.  V^T is poisoned first; its memory is (batch,
    nheads_k, d, keys) as the call's scratch is, and v is a slice of a wider array (its key stride is not its
    row's)."""
    from numba import cuda
    from flashnb import _arrays
    from flashnb.kernels._jit import launch
    from flashnb.fp8 import _words_prepass_args
    rng = np.random.default_rng(seqlen_k)
    wide = rng.integers(1, 256, (2, seqlen_k, nheads_k + 1, d), dtype=np.uint8)
    v = wide[:, :, :nheads_k]
    n = forward_fp8.vt_keys(seqlen_k)
    stream = _arrays.resolve_stream(cuda.default_stream(), None)
    vt_d = cuda.to_device(np.full((2, nheads_k, d, n), 0xAB, np.uint8))
    s = vt_d.strides
    vt_view = _arrays.strided_view(vt_d, (2, d, nheads_k, n), (s[0], s[2], s[1], s[3]))
    wide_d = _arrays.to_device(wide, stream)
    vb = _arrays.strided_view(wide_d, (2, seqlen_k, nheads_k, d), wide_d.strides)     # heads 0 .. nheads_k - 1
    if words:
        launch(forward_fp8.make_prepare_vt_words(d), forward_fp8.prepare_vt_words_grid(2, seqlen_k, nheads_k),
               forward_fp8.PREP_THREADS, stream, 0, _words_prepass_args(_arrays.word_view(vb),
                                                                        _arrays.word_view(vt_view)))
    else:
        launch(forward_fp8.make_prepare_vt(d), forward_fp8.prepare_vt_grid(2, seqlen_k, nheads_k, d),
               forward_fp8.PREP_THREADS, stream, 0, (vb, vt_view))
    cuda.synchronize()
    got = vt_d.copy_to_host()                                      # (2, nheads_k, d, n)
    keys = _relabelled_keys(n)
    want = np.where(keys < seqlen_k, v[:, np.minimum(keys, seqlen_k - 1)].transpose(0, 2, 3, 1), 0)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("words", [True, False])
def test_the_packed_pre_passes_write_each_sequence_transposed_and_relabelled(words):
    """``make_prepare_vt_packed_words`` (``words``) and ``make_prepare_vt_packed`` (v without a word view): each
    sequence's V^T from its column ``vt_start[b]``, position ``p`` holding its key ``32 (p // 32) + key_at(p % 32)``,
    zero past its keys up to its whole tiles; a packed batch with an empty sequence, lengths off a group (32) and
    off a tile (128), a sequence of two tiles; v a slice of a wider array (its key stride is not its row's); V^T
    poisoned first, every byte compared.  The word form fails with the tile's first key off by the sequence's V^T
    start."""
    from numba import cuda
    from flashnb import _arrays, plan
    from flashnb.fp8 import _packed_words_args, _tiles_of
    from flashnb.kernels._jit import launch
    lens, nheads_k, d = np.array([45, 0, 129, 32]), 2, 64
    cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tiles = _tiles_of(lens)
    vt_start = np.concatenate([[0], np.cumsum(tiles)]).astype(np.int32)
    group_seq = np.repeat(np.arange(len(lens), dtype=np.int32), tiles // forward_fp8.VT_KEYS)
    rng = np.random.default_rng(5)
    wide = rng.integers(1, 256, (1, int(cu_k[-1]), nheads_k + 1, d), dtype=np.uint8)
    stream = _arrays.resolve_stream(cuda.default_stream(), None)
    p = plan.fp8_forward_packed(len(lens), 8, group_seq.shape[0], nheads_k, nheads_k, d, False, "float16")
    cols = int(vt_start[-1])
    dev = [cuda.to_device(x) for x in (cu_k, vt_start, group_seq)]
    vt_d = cuda.to_device(np.full((1, nheads_k, d, cols), 0xAB, np.uint8))
    s = vt_d.strides
    vt = _arrays.strided_view(vt_d, (1, d, nheads_k, cols), (s[0], s[2], s[1], s[3]))
    wide_d = _arrays.to_device(wide, stream)
    vb = _arrays.strided_view(wide_d, (1, int(cu_k[-1]), nheads_k, d), wide_d.strides)
    if words:
        launch(p.prepare_words.kernel, p.prepare_words.grid, p.prepare_words.threads, stream, 0,
               _packed_words_args(_arrays.word_view(vb), _arrays.word_view(vt), *dev))
    else:
        launch(p.prepare.kernel, p.prepare.grid, p.prepare.threads, stream, 0, (vb, vt, *dev))
    cuda.synchronize()
    got = vt_d.copy_to_host()                                      # (1, nheads_k, d, cols)
    want = np.zeros_like(got)
    for b, n in enumerate(lens):
        keys = _relabelled_keys(int(tiles[b]))
        seq = wide[0, cu_k[b]:cu_k[b + 1], :nheads_k]              # (n, nheads_k, d)
        if n:
            want[0, :, :, vt_start[b]:vt_start[b + 1]] = np.where(
                keys < n, seq[np.minimum(keys, n - 1)].transpose(1, 2, 0), 0)
    assert np.array_equal(got, want)


def test_e4m3_codes_are_the_oracles_quantiser():
    """The simulator's twin of ``cvt.rn.satfinite.e4m3x2.f32``: nearest, ties to even, saturating, signed zeros."""
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(20000) * np.logspace(-4, 3, 20000),
                        [0.0, -0.0, 448, 460, 464, 1e9, -1e9, 2.0 ** -10, 3 * 2.0 ** -10, -2.0 ** -11, 1.0625]])
    assert np.array_equal(e4m3_codes(x), quantize_e4m3(x, saturate=True))


def _small(d=64):
    rng = np.random.default_rng(0)
    return [_codes(rng, s, 0.01) for s in ((1, 5, 2, d), (1, 7, 1, d), (1, 7, 1, d))]


@pytest.mark.parametrize("change, error, words", [
    (lambda a: dict(q=a["q"].astype(np.float16)), TypeError, "q must hold e4m3 codes"),
    (lambda a: dict(k=a["k"][0]), ValueError, "k must be 4-D"),
    (lambda a: dict(v=a["v"][:, :6]), ValueError, "k and v must have the same shape"),
    (lambda a: dict(q=np.concatenate([a["q"]] * 2, axis=2)[:, :, :3], k=np.concatenate([a["k"]] * 2, axis=2),
                    v=np.concatenate([a["v"]] * 2, axis=2)), ValueError, "multiple of k's nheads_k"),
    (lambda a: dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (lambda a: dict(q_descale=-0.5), ValueError, "q_descale"),
    (lambda a: dict(v_descale=np.ones((2, 1), np.float32)), ValueError, "v_descale"),
    (lambda a: dict(k_descale=np.array([[np.nan]], np.float32)), ValueError, "k_descale"),
    (lambda a: dict(q_descale=1e-50), ValueError, "q_descale must be positive and finite in float32"),
    (lambda a: dict(v_descale=np.full((1, 1), 1e39)), ValueError, "v_descale must be positive and finite in float32"),
    (lambda a: dict(q_descale=1e20, k_descale=1e20), ValueError, "softmax_scale \\* q_descale \\* k_descale"),
    (lambda a: dict(out_dtype="bfloat16"), TypeError, "out_dtype bfloat16"),
    (lambda a: dict(out_dtype="float32"), ValueError, "out_dtype"),
])
def test_fp8_forward_refuses_bad_input(change, error, words):
    q, k, v = _small()
    args = dict(q=q, k=k, v=v)
    args.update(change(args))
    with pytest.raises(error, match=words):
        flashnb.flash_attention_fp8(**args)


def test_fp8_forward_refuses_other_head_dims():
    rng = np.random.default_rng(1)
    q, k, v = (_codes(rng, s, 0.01) for s in ((1, 5, 2, 96), (1, 7, 1, 96), (1, 7, 1, 96)))
    with pytest.raises(ValueError, match="headdim must be one of"):
        flashnb.flash_attention_fp8(q, k, v)


def test_fp8_default_scale_is_one_over_sqrt_headdim():
    """``softmax_scale=None`` is ``1 / sqrt(64)``: the same output as passing it (and lse)."""
    q, k, v = _small()
    a, la = flashnb.flash_attention_fp8(q, k, v, return_lse=True)
    b, lb = flashnb.flash_attention_fp8(q, k, v, softmax_scale=1 / math.sqrt(64), return_lse=True)
    assert np.array_equal(a, b) and np.array_equal(la, lb)


def test_fp8_descales_as_device_arrays_equal_floats():
    """A one-value float32 device array (a stride-0 view in the kernel) and a (batch, nheads_k) one give the output
    of the same values passed as floats, bit for bit; a float64 device array is refused."""
    from numba import cuda
    q, k, v = _small()
    want = flashnb.flash_attention_fp8(q, k, v, 0.01, 0.02, 0.03)
    one = cuda.to_device(np.array([0.02], np.float32))
    per_head = cuda.to_device(np.full((1, 1), 0.03, np.float32))
    got = flashnb.flash_attention_fp8(q, k, v, 0.01, one, per_head)
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="k_descale must be a float32 device array"):
        flashnb.flash_attention_fp8(q, k, v, 0.01, cuda.to_device(np.array([0.02])), 0.03)


# ---- the quantiser and the incoherent rotation (flashnb.quantize_fp8, flashnb.hadamard_rotation) ----

@pytest.mark.parametrize("per", ["tensor", "head"])
def test_quantize_fp8_round_trips_within_e4m3_rounding(per):
    """``codes * descale`` is within ``reference.fp8.rounding_bound`` of x; each slice's amax lands on 448."""
    from reference.fp8 import dequantize_e4m3, rounding_bound
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 9, 3, 64)) * rng.uniform(0.01, 100, (2, 1, 3, 1))
    x[1, :, 2] = 0.0                                                     # an all-zero (batch, head): descale 1
    codes, descale = flashnb.quantize_fp8(x, per)
    assert codes.dtype == np.uint8
    d = np.asarray(descale)[:, None, :, None] if per == "head" else descale
    back = dequantize_e4m3(codes) * d
    assert np.all(np.abs(back - x) <= rounding_bound(x, d) * (1 + 1e-12))
    if per == "head":
        assert descale.shape == (2, 3) and descale[1, 2] == 1.0
        top = np.abs(dequantize_e4m3(codes)).max(axis=(1, 3))
        assert np.all((top == 448) | (np.abs(x).max(axis=(1, 3)) == 0))
    else:
        assert np.abs(dequantize_e4m3(codes)).max() == 448


def test_fp8_block_descales_with_no_key():
    """No key: every row 0 and lse -inf, and the kernel's one read of tile 0's V descale stays inside its array (the
    host gives it one value; the simulator's arrays raise on a read past their end)."""
    rng = np.random.default_rng(4)
    q8 = _codes(rng, (1, 20, 2, 64), 1 / 100)
    k8 = np.zeros((1, 0, 1, 64), np.uint8)
    none = np.zeros((1, 1, 0), np.float32)
    out, lse = flashnb.flash_attention_fp8(q8, k8, k8, np.full((1, 2, 1), 0.01, np.float32), none, none,
                                           return_lse=True, descale_block_q=128, descale_block_k=128)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_quantize_fp8_per_block_is_the_oracles():
    """``per="block"``: the oracle's block quantiser (``reference.fp8.quantize_blocks_e4m3``), codes and descales,
    a last block shorter than the others; PyTorch's codes the same but at a float32 rounding tie."""
    from reference.fp8 import quantize_blocks_e4m3
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 21, 3, 64)) * 4.0 ** (np.arange(21) // 8)[None, :, None, None]
    x[1, 8:16, 2] = 0.0                                                  # an all-zero block: descale 1
    codes, descale = flashnb.quantize_fp8(x, "block", block=8)
    want_codes, want_descale = quantize_blocks_e4m3(x, 8)
    assert descale.shape == (2, 3, 3) and descale.dtype == np.float32 and descale[1, 2, 1] == 1.0
    np.testing.assert_allclose(descale, want_descale, rtol=1e-7)
    assert np.array_equal(codes, want_codes)
    torch = pytest.importorskip("torch")
    c_t, d_t = flashnb.quantize_fp8(torch.tensor(x, dtype=torch.float32), "block", block=8)
    assert c_t.dtype == torch.float8_e4m3fn and tuple(d_t.shape) == (2, 3, 3)
    assert np.allclose(d_t.numpy(), descale, rtol=1e-6)
    assert (c_t.view(torch.uint8).numpy() == codes).mean() > 0.999


def test_quantize_fp8_torch_codes_are_numpys():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(6).standard_normal((1, 33, 2, 128)).astype(np.float32)
    c_np, d_np = flashnb.quantize_fp8(x, "head", flashnb.hadamard_rotation(128, 3))
    c_t, d_t = flashnb.quantize_fp8(torch.tensor(x), "head", flashnb.hadamard_rotation(128, 3))
    assert c_t.dtype == torch.float8_e4m3fn
    assert np.allclose(d_t.numpy(), d_np, rtol=1e-6)
    same = c_t.view(torch.uint8).numpy() == c_np
    assert same.mean() > 0.999, "float32 against float64 scaling may differ only at a rounding tie"


def test_quantize_fp8_group_shares_a_descale_per_key_head():
    """``group=g``: one descale per ``g`` consecutive heads (q's per key/value head, the shape the kernel takes),
    their amax -> 448."""
    from reference.fp8 import dequantize_e4m3
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 20, 4, 64)) * np.array([1.0, 30.0, 0.1, 2.0])[None, None, :, None]
    codes, descale = flashnb.quantize_fp8(q, "head", group=2)
    assert descale.shape == (1, 2)
    assert np.allclose(descale[0], [np.abs(q[..., :2, :]).max() / 448, np.abs(q[..., 2:, :]).max() / 448])
    top = np.abs(dequantize_e4m3(codes)).max(axis=(1, 3))[0]
    assert top[1] == 448 and top[3] == 448 and top[0] < 448 and top[2] < 448


def test_incoherent_rotation_keeps_scores_and_cuts_outlier_error():
    """``hadamard_rotation`` is orthogonal, so ``(q R)(k R)^T = q k^T``; on Q and K with outlier channels, FP8
    attention (the kernel's definition, ``fp8_flash_forward``) of rotated, quantised inputs is closer to float64
    attention than without the rotation (docs/notes/fp8.md step 3 measured ~3x at this shape's scale)."""
    from reference import attention
    r = flashnb.hadamard_rotation(64, seed=1)
    assert np.allclose(r @ r.T, np.eye(64), atol=1e-6)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, n, 2, 64)) for n in (64, 256, 256))
    q[..., :2] *= 20
    k[..., :2] *= 20
    assert np.allclose(np.einsum("bqhd,bkhd->bhqk", q @ r, k @ r), np.einsum("bqhd,bkhd->bhqk", q, k), atol=1e-3)
    want, _ = attention(q, k, v)
    errs = []
    for rotation in (None, r):
        (q8, qd), (k8, kd), (v8, vd) = (flashnb.quantize_fp8(x, "head", rot) for x, rot in
                                        ((q, rotation), (k, rotation), (v, None)))
        out, _ = fp8_flash_forward(q8, k8, v8, qd, kd, vd, block_k=128)
        errs.append(np.abs(out - want).mean())
    assert errs[1] < errs[0] / 1.5, errs


@pytest.mark.parametrize("call, error, words", [
    (lambda: flashnb.quantize_fp8(np.zeros((2, 3, 4)), "tensor"), ValueError, "x must be 4-D"),
    (lambda: flashnb.quantize_fp8(np.zeros((1, 2, 3, 4)), "row"), ValueError, "per must be"),
    (lambda: flashnb.quantize_fp8(np.zeros((1, 2, 3, 4)), "head", np.eye(8)), ValueError, "rotation must be"),
    (lambda: flashnb.quantize_fp8([[[[1.0]]]], "tensor"), TypeError, "x must be a PyTorch tensor or a NumPy"),
    (lambda: flashnb.hadamard_rotation(96), ValueError, "power of two"),
    (lambda: flashnb.quantize_fp8(np.zeros((1, 2, 3, 4)), "head", group=2), ValueError, "group must be"),
    (lambda: flashnb.quantize_fp8(np.zeros((1, 2, 3, 4)), "block", block=0), ValueError, "block must be"),
])
def test_quantize_fp8_refuses_bad_input(call, error, words):
    with pytest.raises(error, match=words):
        call()


@pytest.mark.parametrize("lens_q, lens_k, hk, group, d, causal, per_head", [
    ((70, 0, 20, 9), (150, 30, 5, 40), 2, 1, 64, False, True),   # an empty sequence; keys past a tile and past 32;
    #                                                              two key heads; NaN codes in the last sequence
    ((130, 9), (100, 0), 1, 2, 128, True, False)])                 # two query tiles, more queries than keys, a
#                                                                   sequence of no key, grouped heads
def test_fp8_forward_of_a_packed_batch_matches_its_oracle(lens_q, lens_k, hk, group, d, causal, per_head):
    """``flash_attention_fp8_varlen``: each sequence of a packed batch attended on its own, against
    ``fp8_flash_forward_varlen`` (key tiles of 128) by the dense test's bound (simulator) or flash-attn's rule
    against the exact answer (GPU, per sequence); descales per (sequence, key head) or per tensor; the rows of a
    sequence with no key 0 and -inf; NaN codes in a sequence reach no other (V^T's tiles padded with zeros, keys
    past a sequence masked); the inputs unmodified."""
    from reference.fp8 import fp8_flash_forward_varlen
    rng = np.random.default_rng(sum(lens_q) + sum(lens_k))
    h = hk * group
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q8 = _codes(rng, (int(cu_q[-1]), h, d), 1 / 100)
    k8, v8 = (_codes(rng, (int(cu_k[-1]), hk, d), 1 / 100) for _ in range(2))
    poisoned = len(lens_q) == 4                              # the last sequence's codes NaN (0x7F)
    if poisoned:
        for x, cu in ((q8, cu_q), (k8, cu_k), (v8, cu_k)):
            x[cu[-2]:] = 0x7F
    qd, kd, vd = _descales(rng, per_head, len(lens_q), hk)
    copies = [x.copy() for x in (q8, k8, v8, cu_q, cu_k)]
    out, lse = flashnb.flash_attention_fp8_varlen(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k), qd, kd, vd,
                                                  causal=causal, return_lse=True)
    for x, c in zip((q8, k8, v8, cu_q, cu_k), copies):
        assert np.array_equal(x, c), "an input was modified"
    ref, ref_lse = fp8_flash_forward_varlen(q8, k8, v8, cu_q, cu_k, qd, kd, vd, block_k=forward_fp8.BLOCK_K,
                                            causal=causal)
    assert out.dtype == np.float16 and out.shape == ref.shape and lse.shape == ref_lse.shape
    seen = np.isfinite(ref_lse)
    rows = slice(0, cu_q[-2] if poisoned else cu_q[-1])
    assert np.array_equal(np.isfinite(lse[:, rows]), seen[:, rows]), "rows that see no key: lse -inf"
    assert np.all(out[rows][~seen[:, rows].T] == 0), "rows that see no key: out 0"
    for b in range(len(lens_q) - poisoned):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        assert np.all(np.isfinite(out[qs:qe].astype(np.float64))), f"sequence {b}: not finite"
        if qe == qs or ke == ks:
            continue
        one = [x[b:b + 1] if per_head else x for x in (qd, kd, vd)]
        args = (q8[None, qs:qe], k8[None, ks:ke], v8[None, ks:ke], *one)
        o, l_, r, r_lse = out[None, qs:qe], lse[None, :, qs:qe], ref[None, qs:qe], ref_lse[None, :, qs:qe]
        if SIMULATOR:
            err = np.abs(o.astype(np.float64) - r)
            bound = 2.0 ** -10 * np.abs(r) + 2.0 ** -14 * max(np.abs(r).max(), 1e-30) + _flips(*args, causal)
            assert np.all(err <= bound), f"sequence {b}: max error {err.max():.3e}"
            ok = np.isfinite(r_lse)
            assert np.allclose(l_[ok], r_lse[ok], rtol=1e-5, atol=1e-5), f"sequence {b}: lse"
        else:
            _check_against_exact(o, l_, r, r_lse, *args, causal)


@pytest.mark.parametrize("seqlens, new, hk, group, d, causal, per_head", [
    ((0, 70), 3, 1, 2, 64, True, True),       # chunked prefill: an append, an empty cache, grouped heads
    ((130,), 0, 1, 1, 128, False, False)])    # no append, two key tiles, one descale a tensor
def test_fp8_forward_over_a_kv_cache_matches_its_oracle(seqlens, new, hk, group, d, causal, per_head):
    """``flash_attn_with_kvcache_fp8``: each sequence over its cache's first ``cache_seqlens[b] + seqlen_new`` rows
    after the new rows are written there, against ``fp8_flash_forward_kvcache`` (the caches after the append bit
    for bit; out and lse by the packed test's bounds in the simulator, flash-attn's rule on the GPU); rows past a
    sequence's length (NaN codes) are never read; q and the new rows unmodified."""
    from reference.fp8 import fp8_flash_forward_kvcache
    rng = np.random.default_rng(sum(seqlens) + new)
    batch, seqlen_q, capacity, h = len(seqlens), 4, 150, hk * group
    lens = np.array(seqlens, np.int32)
    q8 = _codes(rng, (batch, seqlen_q, h, d), 1 / 100)
    kc, vc = (_codes(rng, (batch, capacity, hk, d), 1 / 100) for _ in range(2))
    for b, n in enumerate(lens):                               # rows past a sequence's rows: NaN codes, never read
        kc[b, n + new:] = 0x7F
        vc[b, n + new:] = 0x7F
    kn, vn = ((_codes(rng, (batch, new, hk, d), 1 / 100) for _ in range(2)) if new else (None, None))
    qd, kd, vd = _descales(rng, per_head, batch, hk)
    ref, ref_lse, ref_kc, ref_vc = fp8_flash_forward_kvcache(q8, kc, vc, lens, kn, vn, qd, kd, vd,
                                                             block_k=forward_fp8.BLOCK_K, causal=causal)
    copies = [x.copy() for x in (q8,) + ((kn, vn) if new else ())]
    out, lse = flashnb.flash_attn_with_kvcache_fp8(q8, kc, vc, lens, kn, vn, qd, kd, vd, causal=causal,
                                                   return_lse=True)
    for x, c in zip((q8,) + ((kn, vn) if new else ()), copies):
        assert np.array_equal(x, c), "an input was modified"
    assert np.array_equal(kc, ref_kc) and np.array_equal(vc, ref_vc), "the append"
    assert out.dtype == np.float16 and out.shape == ref.shape and lse.shape == ref_lse.shape == (batch, h, seqlen_q)
    for b in range(batch):
        n = int(lens[b]) + new
        one = [x[b:b + 1] if per_head else x for x in (qd, kd, vd)]
        args = (q8[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], *one)
        o, l_, r, r_lse = out[b:b + 1], lse[b:b + 1], ref[b:b + 1], ref_lse[b:b + 1]
        if n == 0:
            assert np.all(o == 0) and np.all(l_ == -np.inf), f"sequence {b}: no key"
            continue
        assert np.all(np.isfinite(o.astype(np.float64))), f"sequence {b}: not finite"
        if SIMULATOR:
            err = np.abs(o.astype(np.float64) - r)
            bound = 2.0 ** -10 * np.abs(r) + 2.0 ** -14 * max(np.abs(r).max(), 1e-30) + _flips(*args, causal)
            assert np.all(err <= bound), f"sequence {b}: max error {err.max():.3e}"
            ok = np.isfinite(r_lse)
            assert np.array_equal(np.isfinite(l_), ok) and np.allclose(l_[ok], r_lse[ok], rtol=1e-5, atol=1e-5)
        else:
            _check_against_exact(o, l_, r, r_lse, *args, causal)


@pytest.mark.parametrize("change, error, words", [
    (dict(cache_seqlens=np.array([3, 149], np.int32)), ValueError, "cache_seqlens must be in \\[0, 148\\]"),
    (dict(cache_seqlens=np.array([3, 4], np.int64)), ValueError, "cache_seqlens must be an int or an int32"),
    (dict(k=None), ValueError, "k and v come together"),
    (dict(v_cache=np.zeros((2, 151, 1, 64), np.uint8)), ValueError, "k_cache and v_cache must have one shape"),
    (dict(k=np.zeros((2, 2, 2, 64), np.uint8), v=np.zeros((2, 2, 2, 64), np.uint8)), ValueError,
     "k and v must be \\(batch, seqlen_new, nheads_k, headdim\\)"),
    (dict(q=np.zeros((2, 4, 64), np.uint8)), ValueError, "q must be 4-D"),
    (dict(v_descale=0.0), ValueError, "v_descale must be a positive finite float"),
    (dict(k_descale=np.ones((2, 1), np.float32), v_descale=np.zeros((2, 1), np.float32)), ValueError,
     "v_descale must be positive and finite"),
])
def test_fp8_kvcache_refuses_bad_input(change, error, words):
    """Before any launch and before the append (the caches unchanged), naming the argument."""
    args = dict(q=np.zeros((2, 4, 2, 64), np.uint8), k_cache=np.zeros((2, 150, 1, 64), np.uint8),
                v_cache=np.zeros((2, 150, 1, 64), np.uint8), cache_seqlens=np.array([3, 4], np.int32),
                k=np.ones((2, 2, 1, 64), np.uint8), v=np.ones((2, 2, 1, 64), np.uint8))
    args.update(change)
    before = args["k_cache"].copy()
    with pytest.raises(error, match=words):
        flashnb.flash_attn_with_kvcache_fp8(**args)
    assert np.array_equal(args["k_cache"], before), "the cache was written before the refusal"


@pytest.mark.parametrize("change, error, words", [
    (dict(q=np.zeros((1, 8, 2, 64), np.uint8)), ValueError, "q must be 3-D"),
    (dict(cu_seqlens_q=np.array([0, 5, 9], np.int32)), ValueError, "cu_seqlens_q\\[-1\\] must be the total"),
    (dict(cu_seqlens_k=np.array([0, 6], np.int32), max_seqlen_k=6), ValueError, "one batch"),
    (dict(cu_seqlens_q=np.array([0, 3, 8], np.int64)), TypeError, "cu_seqlens_q must be int32"),
    (dict(max_seqlen_q=4), ValueError, "max_seqlen_q = 4 is shorter"),
    (dict(q_descale=np.ones((3, 1), np.float32)), ValueError, "q_descale must be a float or an array of shape"),
    (dict(q_descale=1e20, k_descale=1e20), ValueError, "softmax_scale \\* q_descale \\* k_descale must be"),
    (dict(v=np.zeros((6, 1, 32), np.uint8)), ValueError, "k and v must be \\(total_k, nheads_k, headdim\\)"),
])
def test_fp8_packed_forward_refuses_bad_input(change, error, words):
    """Before any launch, naming the argument: a packed batch's 3-D layout, ``cu_seqlens`` as
    ``flash_attn_varlen_func`` checks them, descales per (sequence, key head)."""
    args = dict(q=np.zeros((8, 2, 64), np.uint8), k=np.zeros((6, 1, 64), np.uint8), v=np.zeros((6, 1, 64), np.uint8),
                cu_seqlens_q=np.array([0, 3, 8], np.int32), cu_seqlens_k=np.array([0, 2, 6], np.int32),
                max_seqlen_q=5, max_seqlen_k=4)
    args.update(change)
    with pytest.raises(error, match=words):
        flashnb.flash_attention_fp8_varlen(**args)


def test_fp8_packed_forward_of_nothing():
    """No query row at all, or no sequence: empty results of the right shapes, no launch; keys of no query: the
    queries' rows 0 and -inf."""
    k = np.zeros((6, 1, 64), np.uint8)
    out, lse = flashnb.flash_attention_fp8_varlen(np.zeros((0, 2, 64), np.uint8), k, k, np.array([0, 0, 0], np.int32),
                                                  np.array([0, 2, 6], np.int32), 0, 4, return_lse=True)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)
    e = np.zeros((0, 1, 64), np.uint8)
    out, lse = flashnb.flash_attention_fp8_varlen(np.zeros((0, 1, 64), np.uint8), e, e, np.array([0], np.int32),
                                                  np.array([0], np.int32), 0, 0, return_lse=True)
    assert out.shape == (0, 1, 64) and lse.shape == (1, 0)
    out, lse = flashnb.flash_attention_fp8_varlen(np.ones((5, 1, 64), np.uint8), e, e, np.array([0, 5], np.int32),
                                                  np.array([0, 0], np.int32), 5, 0, return_lse=True)
    assert np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.gpu
def test_fp8_packed_forward_is_each_sequence_dense_bit_for_bit():
    """On the GPU: each sequence of a packed batch gives the dense call's out and lse on that sequence alone, bit
    for bit (the same tiles from the sequence's first row, the same products; rows of the neighbours masked or
    never stored), head dims 64 and 128, causal or not, descales per (sequence, key head)."""
    rng = np.random.default_rng(31)
    lens_q, lens_k = (300, 0, 45, 129), (260, 17, 400, 1)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    for d in (64, 128):
        for causal in (False, True):
            q8 = _codes(rng, (int(cu_q[-1]), 4, d), 1 / 100)
            k8, v8 = (_codes(rng, (int(cu_k[-1]), 2, d), 1 / 100) for _ in range(2))
            ds = _descales(rng, True, len(lens_q), 2)
            out, lse = flashnb.flash_attention_fp8_varlen(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k), *ds,
                                                          causal=causal, return_lse=True)
            for b in range(len(lens_q)):
                qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
                if qe == qs:
                    continue
                o, l_ = flashnb.flash_attention_fp8(q8[None, qs:qe], k8[None, ks:ke], v8[None, ks:ke],
                                                    *(x[b:b + 1] for x in ds), causal=causal, return_lse=True)
                assert np.array_equal(out[qs:qe], o[0]), f"d {d} causal {causal} sequence {b}: out"
                assert np.array_equal(lse[:, qs:qe], l_[0]), f"d {d} causal {causal} sequence {b}: lse"


@pytest.fixture
def warp_specialised():
    """``plan.FP8_WARP_SPECIALISED`` on for one test (the plan and dispatch caches cleared either side)."""
    from flashnb import _dispatch, plan

    def clear():
        plan.fp8_forward.cache_clear()
        plan.fp8_forward_packed.cache_clear()
        _dispatch.clear()

    before = plan.FP8_WARP_SPECIALISED
    plan.FP8_WARP_SPECIALISED = True
    clear()
    yield
    plan.FP8_WARP_SPECIALISED = before
    clear()


@pytest.mark.parametrize("case", ["blocks", "packed"])
def test_the_warp_specialised_forward_matches_its_oracle(warp_specialised, case):
    """FlashAttention-3's roles (``make_forward_fp8(WARP_SPECIALISED=True)``: a producer warpgroup refilling each
    stage once both consumer warpgroups hand it back, no block barrier in the loop), held to the oracle as the
    plain kernel is; causal, so the last tile is masked.  ``blocks``: five key tiles through two stages, so each
    stage's barriers come back to a parity they have waited on before, and a descale per key tile (the
    accumulator changes units each tile).  ``packed``: three sequences, the first of two query tiles (the second
    query tile's blocks of the others return before the barriers are made), the second with no key (Q loaded,
    no stage), the third's keys within one tile.  It fails if the producer does not wait for a stage to come back
    (tried: the sums go wrong, or the simulator reports the wait that would hang)."""
    if case == "blocks":
        test_fp8_forward_with_block_descales_matches_its_oracle(64, True, 70, 600, None, 128, 1, 1)
    else:
        test_fp8_forward_of_a_packed_batch_matches_its_oracle((130, 9, 20), (300, 0, 40), 1, 1, 64, True, True)
