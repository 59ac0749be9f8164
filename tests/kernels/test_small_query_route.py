"""Small-query routing: ``flash_attention`` with few query rows per KV head (``plan.split_kv``: decoding,
speculative decoding, a chunked prefill's tail) runs on the split-KV decode kernels.  Properties: the route is
taken exactly where the plan says (counted at ``kvcache.attend``), its out and lse meet the harness's bounds
against the oracle (causal, windows, softcap, ALiBi, the scale, GQA; float32 and float16), its lse feeds the
generic backward to the oracle's gradients, and the calls the route must not take (masks, bias, dropout, tiles
or a backend asked for, more rows) keep the generic path."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import flashnb
import strategies as S
from flashnb import kvcache, plan
from kernel_harness import Untouched, check_backward, check_forward, examples, expected


@pytest.fixture
def routed(monkeypatch):
    """A list that gets one entry per call ``kvcache.attend`` serves."""
    calls = []
    real = kvcache.attend

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(kvcache, "attend", counting)
    return calls


@st.composite
def small_problems(draw):
    dtype = np.dtype(draw(st.sampled_from((np.float32, np.float16))))
    nheads_k = draw(st.integers(1, 2))
    group = draw(st.sampled_from((1, 2, 4)))
    seqlen_q = draw(st.integers(1, plan.SPLIT_KV_MAX_ROWS // group))
    seqlen_k = draw(st.integers(1, 24))
    headdim = draw(st.sampled_from((2, 4, 8) if dtype == np.float16 else (1, 3, 4, 8)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    batch, nheads = draw(st.integers(1, 2)), nheads_k * group
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dtype)
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(dtype) for _ in range(2))
    opts = {}
    for name in draw(st.lists(st.sampled_from(("causal", "window_size", "softcap", "alibi_slopes",
                                               "softmax_scale")), unique=True, max_size=3)):
        if name == "causal":
            opts["causal"] = True
        elif name == "window_size":
            opts["window_size"] = (draw(st.integers(-1, 8)), draw(st.integers(-1, 3)))
        elif name == "softcap":
            opts["softcap"] = draw(st.sampled_from((0.5, 5.0)))
        elif name == "alibi_slopes":
            opts["alibi_slopes"] = rng.uniform(0.05, 1.0, (nheads,))
        else:
            opts["softmax_scale"] = draw(st.sampled_from((0.3, -0.7)))
    dout = rng.standard_normal(q.shape).astype(dtype)
    return S.Problem(q, k, v, dout, opts, 1, 1)


@settings(max_examples=examples(7, 16), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=small_problems())
def test_small_queries_take_the_split_kv_kernels(p, routed):
    routed.clear()                   # (the fixture is shared by the drawn examples)
    exp = expected(p, backward=True)
    with Untouched(p.q, p.k, p.v, p.opts):
        out, lse = flashnb.flash_attention(p.q, p.k, p.v, return_lse=True, **p.opts)
    assert len(routed) == 1, "plan.split_kv chose the generic path"
    check_forward(exp, out, lse)
    grads = flashnb.flash_attention_backward(p.dout, p.q, p.k, p.v, out, lse, **p.opts)
    check_backward(exp, grads)


@pytest.mark.parametrize("change", [
    dict(attn_mask=np.ones((1, 1, 2, 24), bool)), dict(attn_bias=np.zeros((1, 1, 2, 24), np.float32)),
    dict(dropout_p=0.1), dict(block_q=16), dict(backend="simt"), dict(q_rows=9), dict(dtype=np.float64)])
def test_calls_the_route_leaves_alone(change, routed):
    """Each of these keeps the generic kernels (and gives the same result as the routed call where defined)."""
    change = dict(change)
    rng = np.random.default_rng(0)
    dtype = change.pop("dtype", np.float32)
    seqlen_q = change.pop("q_rows", 2)
    q = rng.standard_normal((1, seqlen_q, 4, 8)).astype(dtype)      # 2 KV heads: 2 query heads each
    k, v = (rng.standard_normal((1, 24, 2, 8)).astype(dtype) for _ in range(2))
    flashnb.flash_attention(q, k, v, **change)
    assert routed == []


def test_routed_equals_the_generic_path_in_float32(routed):
    """The decode kernels and the SIMT kernels agree to float32 rounding on a GQA decode step."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 1, 8, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 45, 2, 8)).astype(np.float32) for _ in range(2))
    out, lse = flashnb.flash_attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = flashnb.flash_attention(q, k, v, causal=True, return_lse=True, backend="simt")
    assert len(routed) == 1
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-6, rtol=0)


def test_split_kv_decision():
    args = dict(dtype="float16", batch=16, seqlen_q=1, seqlen_k=4096, nheads=32, nheads_k=8, headdim=128,
                backend="auto", tiles_given=False, plain=True)
    assert plan.split_kv(**args)
    assert plan.split_kv(**dict(args, seqlen_q=4))                  # 4 tokens x 4 heads = 16 rows
    assert not plan.split_kv(**dict(args, seqlen_q=5))
    for change in (dict(backend="tensorcore"), dict(tiles_given=True), dict(plain=False), dict(dtype="float64"),
                   dict(headdim=127), dict(seqlen_k=0), dict(batch=0)):
        assert not plan.split_kv(**dict(args, **change)), change
    assert plan.split_kv(**dict(args, dtype="float32", headdim=127))


@pytest.mark.parametrize("bad, match", [(dict(seed=-1), "seed"), (dict(block_mask_size=(0, 0)), "block_mask_size")])
def test_routed_calls_validate_as_the_generic_path(bad, match, routed):
    """Arguments the decode kernels do not use are still checked (a routed call and a generic one refuse alike)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 2, 4)).astype(np.float32)
    k, v = (rng.standard_normal((1, 6, 1, 4)).astype(np.float32) for _ in range(2))
    with pytest.raises(ValueError, match=match):
        flashnb.flash_attention(q, k, v, **bad)
    with pytest.raises(ValueError, match=match):
        flashnb.flash_attention(q, k, v, backend="simt", **bad)
