"""Bad input to flashnb.flash_attention / flash_attention_backward: a clean ValueError or TypeError naming the argument.

One test per class of bad input (shapes, dtypes, kinds, head counts, ndim,
head dim, mask/bias/block-mask shapes and dtypes, ALiBi shape, dropout_p,
softmax_scale, softcap, window_size, tiles, seed, backend, the backward's
dout/out/lse), each asserting the exception type *and* that the message names
the argument; then a Hypothesis property that mutates one argument of a
valid call into a bad value and expects the same.  Nothing here may reach a
kernel launch (a wrongly accepted call would also be caught: it returns
instead of raising).
"""
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flashnb

B, SQ, SK, H, HK, D = 2, 3, 4, 4, 2, 5


def arrays(dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, SQ, H, D)).astype(dtype)
    k = rng.standard_normal((B, SK, HK, D)).astype(dtype)
    v = rng.standard_normal((B, SK, HK, D)).astype(dtype)
    return q, k, v


def backward_args(dtype=np.float32):
    q, k, v = arrays(dtype)
    out = np.zeros_like(q)
    dout = np.ones_like(q)
    lse = np.zeros((B, H, SQ), np.float64 if dtype == np.float64 else np.float32)
    return dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)


def call_forward(q=None, k=None, v=None, **opts):
    q0, k0, v0 = arrays()
    return flashnb.flash_attention(q0 if q is None else q, k0 if k is None else k, v0 if v is None else v, **opts)


def call_backward(**changes):
    a = backward_args()
    args = {n: changes.pop(n, a[n]) for n in ("dout", "q", "k", "v", "out", "lse")}
    return flashnb.flash_attention_backward(args["dout"], args["q"], args["k"], args["v"], args["out"],
                                            args["lse"], **changes)


def raises(exc, name):
    """pytest.raises(exc) whose message must name the argument ``name`` as a word."""
    return pytest.raises(exc, match=rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z_])")


BOTH = pytest.mark.parametrize("fn", ["forward", "backward"])


def call(fn, **kw):
    return call_forward(**kw) if fn == "forward" else call_backward(**kw)


# ---------------------------------------------------------------------------------- q, k, v
@BOTH
@pytest.mark.parametrize("name,shape", [("k", (B + 1, SK, HK, D)), ("k", (B, SK, HK, D + 1)),
                                        ("v", (B, SK + 1, HK, D)), ("v", (B, SK, HK + 1, D))])
def test_mismatched_shapes(fn, name, shape):
    with raises(ValueError, name):
        call(fn, **{name: np.zeros(shape, np.float32)})


@BOTH
@pytest.mark.parametrize("name", ["k", "v"])
def test_mismatched_dtypes(fn, name):
    with raises(TypeError, name):
        call(fn, **{name: arrays(np.float64)[1]})


@BOTH
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64, np.uint8])
def test_non_float_dtype(fn, dtype):
    q, k, v = (x.astype(dtype) for x in arrays())
    kw = dict(q=q, k=k, v=v)
    if fn == "backward":
        kw.update(dout=q, out=q)
    with raises(TypeError, "q"):
        call(fn, **kw)


@BOTH
@pytest.mark.parametrize("bad", [[[[[1.0]]]], 3.0, "k", None], ids=["list", "float", "str", "None"])
def test_not_an_array(fn, bad):
    q, k, v = arrays()
    a = backward_args()
    with raises(TypeError, "k"):
        if fn == "forward":
            flashnb.flash_attention(q, bad, v)
        else:
            flashnb.flash_attention_backward(a["dout"], q, bad, v, a["out"], a["lse"])


@BOTH
def test_mismatched_kinds_numpy_and_numba(fn):
    from numba import cuda
    with raises(TypeError, "k"):
        call(fn, k=cuda.to_device(arrays()[1]))


@BOTH
@pytest.mark.parametrize("nheads,nheads_k", [(3, 2), (2, 3), (1, 2), (4, 3)])
def test_nheads_not_a_multiple_of_nheads_k(fn, nheads, nheads_k):
    q = np.zeros((B, SQ, nheads, D), np.float32)
    k = np.zeros((B, SK, nheads_k, D), np.float32)
    kw = dict(q=q, k=k, v=k)
    if fn == "backward":
        kw.update(dout=q, out=q, lse=np.zeros((B, nheads, SQ), np.float32))
    with raises(ValueError, "nheads"):
        call(fn, **kw)


@BOTH
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("ndim", [3, 5])
def test_wrong_ndim(fn, name, ndim):
    shape = {"q": (B, SQ, H, D), "k": (B, SK, HK, D), "v": (B, SK, HK, D)}[name]
    shape = shape[:3] if ndim == 3 else shape + (1,)
    with raises(ValueError, name):
        call(fn, **{name: np.zeros(shape, np.float32)})


@BOTH
@pytest.mark.parametrize("headdim", [0, 257, 512])
def test_head_dim_zero_or_above_256(fn, headdim):
    q = np.zeros((B, SQ, H, headdim), np.float32)
    k = np.zeros((B, SK, HK, headdim), np.float32)
    kw = dict(q=q, k=k, v=k)
    if fn == "backward":
        kw.update(dout=q, out=q)
    with raises(ValueError, "head dim"):
        call(fn, **kw)


# ---------------------------------------------------------------------------------- array options
FULL = (B, H, SQ, SK)


@BOTH
@pytest.mark.parametrize("shape", [(B + 1, H, SQ, SK), (B, H, SQ + 1, SK), (SK + 1,), (1, 1, 1, 1, 1), (2, SK)])
@pytest.mark.parametrize("name", ["attn_mask", "attn_bias"])
def test_mask_and_bias_shapes(fn, name, shape):
    x = np.ones(shape, bool) if name == "attn_mask" else np.zeros(shape, np.float32)
    with raises(ValueError, name):
        call(fn, **{name: x})


@BOTH
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint8])
def test_attn_mask_must_be_boolean(fn, dtype):
    with raises(TypeError, "attn_mask"):
        call(fn, attn_mask=np.ones(FULL, dtype))


@BOTH
@pytest.mark.parametrize("dtype", [np.bool_, np.int32, np.complex128])
def test_attn_bias_must_be_float(fn, dtype):
    with raises(TypeError, "attn_bias"):
        call(fn, attn_bias=np.ones(FULL, dtype))


@BOTH
@pytest.mark.parametrize("shape,size", [((B, H, 2, 2), (1, 4)), ((B, H, 2, 1), (1, 4)), ((B, H, 4, 5), (1, 1)),
                                        ((3, H, 1, 1), (4, 4))])
def test_block_mask_shape(fn, shape, size):
    with raises(ValueError, "block_mask"):
        call(fn, block_mask=np.ones(shape, bool), block_mask_size=size)


@BOTH
def test_block_mask_must_be_boolean(fn):
    with raises(TypeError, "block_mask"):
        call(fn, block_mask=np.ones((1, 1), np.float32))


@BOTH
@pytest.mark.parametrize("size", [(0, 4), (4, -1), (4,), 4, (4.0, 4), "44", None])
def test_block_mask_size(fn, size):
    with raises(ValueError, "block_mask_size"):
        call(fn, block_mask=np.ones((1, 1), bool), block_mask_size=size)


@BOTH
@pytest.mark.parametrize("shape", [(H + 1,), (B, H + 1), (B + 1, H), (1, H, 1), ()])
def test_alibi_slopes_shape(fn, shape):
    with raises(ValueError, "alibi_slopes"):
        call(fn, alibi_slopes=np.ones(shape))


@BOTH
def test_alibi_slopes_must_be_float(fn):
    with raises(TypeError, "alibi_slopes"):
        call(fn, alibi_slopes=np.ones(H, np.int64))


# ---------------------------------------------------------------------------------- scalar options
@BOTH
@pytest.mark.parametrize("p", [1.0, 1.5, -0.1, float("nan"), float("inf"), "0.1", True])
def test_dropout_p_outside_unit_interval(fn, p):
    with pytest.raises((ValueError, TypeError), match="dropout_p"):
        call(fn, dropout_p=p)


@BOTH
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), "1", True])
def test_non_finite_softmax_scale(fn, scale):
    with pytest.raises((ValueError, TypeError), match="softmax_scale"):
        call(fn, softmax_scale=scale)


@BOTH
@pytest.mark.parametrize("softcap", [-1.0, -1e-9, float("nan"), float("inf"), "5", None])
def test_negative_or_non_finite_softcap(fn, softcap):
    with pytest.raises((ValueError, TypeError), match="softcap"):
        call(fn, softcap=softcap)


@BOTH
@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (1,), (1, 2, 3), 4, (1.5, 2), ("1", 2), None, (True, 1)])
def test_bad_window_size(fn, window):
    with pytest.raises((ValueError, TypeError), match="window_size"):
        call(fn, window_size=window)


@BOTH
@pytest.mark.parametrize("causal", ["yes", 1, None])
def test_causal_must_be_bool(fn, causal):
    with raises(TypeError, "causal"):
        call(fn, causal=causal)


@BOTH
@pytest.mark.parametrize("name", ["block_q", "block_k"])
@pytest.mark.parametrize("value", [0, 3, 12, 256, -16, 16.0, "16", True])
def test_bad_tile_sizes(fn, name, value):
    with raises(ValueError, name):
        call(fn, **{name: value})


@BOTH
@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "7", None])
def test_bad_seed(fn, seed):
    with pytest.raises((ValueError, TypeError), match="seed"):
        call(fn, dropout_p=0.5, seed=seed)


@BOTH
@pytest.mark.parametrize("backend", ["triton", "", None, "SIMT"])
def test_bad_backend(fn, backend):
    with raises(ValueError, "backend"):
        call(fn, backend=backend)


@BOTH
@pytest.mark.parametrize("stream", ["default", 1.5, object()])
def test_bad_stream(fn, stream):
    with raises(TypeError, "stream"):
        call(fn, stream=stream)


# ---------------------------------------------------------------------------------- backward's own arguments
@pytest.mark.parametrize("name", ["dout", "out"])
@pytest.mark.parametrize("shape", [(B, SQ + 1, H, D), (B, SQ, H, D + 1), (B, SQ, H)])
def test_backward_dout_out_shape(name, shape):
    with raises(ValueError, name):
        call_backward(**{name: np.zeros(shape, np.float32)})


@pytest.mark.parametrize("name", ["dout", "out"])
@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_backward_dout_out_dtype(name, dtype):
    with raises(TypeError, name):
        call_backward(**{name: np.zeros((B, SQ, H, D), dtype)})


@pytest.mark.parametrize("shape", [(B, SQ, H), (B, H, SQ + 1), (B, H), (B, H, SQ, 1)])
def test_backward_lse_shape(shape):
    with raises(ValueError, "lse"):
        call_backward(lse=np.zeros(shape, np.float32))


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.bool_])
def test_backward_lse_dtype(dtype):
    with raises(TypeError, "lse"):
        call_backward(lse=np.zeros((B, H, SQ), dtype))


@pytest.mark.parametrize("name", ["dout", "out", "lse"])
def test_backward_argument_not_an_array(name):
    with raises(TypeError, name):
        call_backward(**{name: [1.0, 2.0]})


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_backward_deterministic_must_be_bool(value):
    with raises(TypeError, "deterministic"):
        call_backward(deterministic=value)


# ---------------------------------------------------------------------------------- PyTorch CPU tensors (GPU)
@pytest.mark.gpu
@BOTH
def test_cpu_torch_tensor_is_a_type_error(fn):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    q, k, v = (torch.as_tensor(x, device="cuda") for x in arrays())
    kw = dict(q=q, k=k.cpu(), v=v)
    if fn == "backward":
        kw.update(dout=q, out=q, lse=torch.zeros((B, H, SQ), device="cuda"))
        with raises(TypeError, "k"):
            flashnb.flash_attention_backward(kw["dout"], q, k.cpu(), v, kw["out"], kw["lse"])
    else:
        with raises(TypeError, "k"):
            flashnb.flash_attention(q, k.cpu(), v)


@pytest.mark.gpu
@BOTH
def test_tensor_on_another_device_than_the_current_is_a_value_error(fn, monkeypatch):
    """The kernels run on the current device: a tensor that says it lives elsewhere is refused, not read.
    (One GPU here: the tensor's device is faked as the current one + 1.)"""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    from flashnb import _arrays
    q, k, v = (torch.as_tensor(x, device="cuda") for x in arrays())
    real = _arrays.device_of
    monkeypatch.setattr(_arrays, "device_of", lambda x: None if real(x) is None else real(x) + 1)
    with raises(ValueError, "q is on CUDA device"):
        if fn == "backward":
            flashnb.flash_attention_backward(q, q, k, v, q, torch.zeros((B, H, SQ), device="cuda"))
        else:
            flashnb.flash_attention(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dout", "out", "lse", "attn_bias"])
def test_argument_on_another_device_than_q_is_a_value_error(name, monkeypatch):
    """Every array argument must live on q's device (here one argument's device is faked as q's + 1)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    from flashnb import _arrays
    q, k, v = (torch.as_tensor(x, device="cuda") for x in arrays())
    args = dict(dout=q.clone(), out=q.clone(), lse=torch.zeros((B, H, SQ), device="cuda"),
                attn_bias=torch.zeros((B, H, SQ, SK), device="cuda"))
    real = _arrays.device_of
    monkeypatch.setattr(_arrays, "device_of", lambda x: real(x) + 1 if x is args[name] else real(x))
    with raises(ValueError, name):
        flashnb.flash_attention_backward(args["dout"], q, k, v, args["out"], args["lse"], attn_bias=args["attn_bias"])


# ---------------------------------------------------------------------------------- malformed calls, generated
def _mutations():
    """(argument, strategy of bad values, extra valid kwargs the bad value needs)."""
    f32 = np.float32
    return [
        ("q", st.sampled_from([np.zeros((B, SQ, H), f32), np.zeros((B + 1, SQ, H, D), f32),
                               np.zeros((B, SQ, H, D + 1), f32), np.zeros((B, SQ, H, D), np.float64),
                               np.zeros((B, SQ, 3, D), f32), np.zeros((B, SQ, H, D), np.int8), "q", 1]), {}),
        ("k", st.sampled_from([np.zeros((B, SK, HK, D, 1), f32), np.zeros((B, SK + 1, HK, D), f32),
                               np.zeros((B, SK, HK, D), np.float16), np.zeros((B, SK, HK, 0), f32), 2.0]), {}),
        ("v", st.sampled_from([np.zeros((B, SK, HK + 1, D), f32), np.zeros((B, SK, HK, D), bool), []]), {}),
        ("softmax_scale", st.sampled_from([float("nan"), float("inf"), "x", 1j]), {}),
        ("causal", st.sampled_from(["True", 2, 1.0]), {}),
        ("window_size", st.one_of(st.integers(-100, -2).map(lambda w: (w, 0)),
                                  st.integers(-100, -2).map(lambda w: (0, w)),
                                  st.sampled_from([(0,), (0, 0, 0), 3, "3", (0.5, 1)])), {}),
        ("attn_mask", st.sampled_from([np.ones((SQ + 1, SK), bool), np.ones((B, H, SQ, SK), np.float32),
                                       np.ones((3, 1, 1, 1), bool), np.ones((1, 1, 1, 1, 1), bool)]), {}),
        ("attn_bias", st.sampled_from([np.ones((SQ, SK + 2), f32), np.ones((B, H, SQ, SK), bool),
                                       np.ones((B, 3, SQ, SK), f32)]), {}),
        ("alibi_slopes", st.sampled_from([np.ones(H + 2), np.ones((B, H, 1)), np.ones((B + 1, H)),
                                          np.ones(H, np.int32)]), {}),
        ("softcap", st.one_of(st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False),
                              st.sampled_from([float("nan"), float("inf"), "1"])), {}),
        ("block_mask", st.sampled_from([np.ones((B, H, 5, 5), bool), np.ones((1, 1), np.int8)]),
         {"block_mask_size": (1, 1)}),
        ("block_mask_size", st.sampled_from([(0, 1), (1, 0), (1,), (-3, 2)]), {"block_mask": np.ones((1, 1), bool)}),
        ("dropout_p", st.one_of(st.floats(min_value=1.0, allow_nan=False), st.floats(max_value=-1e-9),
                                st.just(float("nan"))), {}),
        ("seed", st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64), st.just(0.5)),
         {"dropout_p": 0.1}),
        ("block_q", st.one_of(st.integers(129, 10**6), st.integers(max_value=0),
                              st.integers(3, 127).filter(lambda n: n & (n - 1)), st.just(2.0)), {}),
        ("block_k", st.one_of(st.integers(129, 10**6), st.integers(3, 127).filter(lambda n: n & (n - 1))), {}),
        ("backend", st.text(max_size=10).filter(lambda s: s not in ("auto", "simt", "tensorcore")), {}),
    ]


MUTATIONS = _mutations()
BACKWARD_MUTATIONS = [
    ("dout", st.sampled_from([np.zeros((B, SQ, H, D + 1), np.float32), np.zeros((B, SQ, H, D), np.float64),
                              np.zeros((B, SQ, H), np.float32), "dout"]), {}),
    ("out", st.sampled_from([np.zeros((B, SQ + 2, H, D), np.float32), np.zeros((B, SQ, H, D), np.float16)]), {}),
    ("lse", st.sampled_from([np.zeros((B, SQ, H), np.float32), np.zeros((B, H, SQ), np.float16),
                             np.zeros((B, H, SQ, 1), np.float32)]), {}),
    ("deterministic", st.sampled_from(["yes", 0, None]), {}),
]
# which word the message must contain, when it is not the argument's own name
MESSAGE_NAME = {"q": r"\bq\b|head dim|nheads", "k": r"\bk\b|head dim|nheads", "v": r"\bv\b|head dim|nheads"}


@settings(max_examples=max(60, settings().max_examples), deadline=None)   # no launches: cheap
@given(data=st.data(), backward=st.booleans())
def test_one_malformed_argument_gives_value_or_type_error_naming_it(data, backward):
    """A valid call with one argument replaced by a bad value raises ValueError/TypeError naming the argument."""
    table = MUTATIONS + (BACKWARD_MUTATIONS if backward else [])
    name, bad_values, needs = data.draw(st.sampled_from(table), label="argument")
    bad = data.draw(bad_values, label=name)
    kw = dict(needs)
    kw[name] = bad
    with pytest.raises((ValueError, TypeError)) as info:
        call_backward(**kw) if backward else call_forward(**kw)
    pattern = MESSAGE_NAME.get(name, rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z_])")
    assert re.search(pattern, str(info.value)), f"message does not name {name!r}: {info.value}"
