"""Arrays in, the same kind of arrays out: NumPy, Numba device arrays, PyTorch, CuPy; strides; streams.

The kernels read every input through its strides, so a strided view must give
*bit-identical* results to a contiguous copy of it (same values, same
arithmetic); so must the same data passed as another kind of array.  Each
test also checks one result against the float64 oracle (kernel_harness
tolerances), so the comparisons are not between two equally wrong answers.
PyTorch and CuPy tests need a real GPU (``gpu`` marker) and the library
(``pytest.importorskip``).
"""
import types

import numpy as np
import pytest
from numba import cuda

import flashnb
import strategies as S
from kernel_harness import (assert_bitwise_equal, check_backward, check_forward, expected,
                            poison_outputs)  # noqa: F401 (autouse fixture)

OPTS = dict(causal=True, softcap=4.0, dropout_p=0.25, seed=11)
TILES = dict(block_q=8, block_k=4)


def data(dtype=np.float64, batch=2, seqlen_q=5, seqlen_k=6, nheads=2, nheads_k=1, headdim=3, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(dtype)
    dout = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dtype)
    return q, k, v, dout


def numpy_path(q, k, v, dout, deterministic=True, **opts):
    """(out, lse, dq, dk, dv) through NumPy arrays, checked against the oracle."""
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True, **opts)
    grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **opts)
    p = S.Problem(q=np.ascontiguousarray(q), k=np.ascontiguousarray(k), v=np.ascontiguousarray(v),
                  dout=np.ascontiguousarray(dout),
                  opts=types.MappingProxyType({n: x for n, x in opts.items() if n not in ("block_q", "block_k")}),
                  block_q=opts.get("block_q"), block_k=opts.get("block_k"))
    exp = expected(p)
    check_forward(exp, out, lse)
    check_backward(exp, grads)
    return (out, lse) + tuple(grads)


NAMES = ("out", "lse", "dq", "dk", "dv")


def assert_all_bitwise(got, want, what):
    for name, a, b in zip(NAMES, got, want):
        assert_bitwise_equal(a, b, f"{what}: {name}")


# ---------------------------------------------------------------------------------- NumPy
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_numpy_in_numpy_out(dtype):
    q, k, v, dout = data(dtype)
    res = numpy_path(q, k, v, dout, **OPTS, **TILES)
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    for name, x, want in zip(NAMES, res, ((q.shape, dtype), ((2, 2, 5), lse_dtype), (q.shape, dtype),
                                          (k.shape, dtype), (v.shape, dtype))):
        assert isinstance(x, np.ndarray), f"{name}: {type(x).__name__}, expected numpy.ndarray"
        assert (x.shape, x.dtype) == (want[0], np.dtype(want[1])), f"{name}: {x.dtype}{x.shape}"
    out_only = flashnb.flash_attention(q, k, v, **OPTS, **TILES)
    assert isinstance(out_only, np.ndarray)
    assert_bitwise_equal(out_only, res[0], "return_lse=False")


def _strided_views(q, k, v, dout):
    """Non-contiguous views holding the same values as q, k, v, dout."""
    b, sq, h, d = q.shape
    # q: every other row of a sequence twice as long
    q_big = np.zeros((b, 2 * sq, h, d), q.dtype)
    q_big[:, ::2] = q
    # k: a (batch, d, seqlen, heads) array transposed to (batch, seqlen, heads, d)
    k_t = np.ascontiguousarray(k.transpose(0, 3, 1, 2)).transpose(0, 2, 3, 1)
    # v: the first d of a wider head dim, and the sequence reversed twice (negative strides)
    v_wide = np.zeros(v.shape[:3] + (d + 3,), v.dtype)
    v_wide[..., :d] = v[:, ::-1]
    v_view = v_wide[..., :d][:, ::-1]
    # dout: transposed then sliced
    do_t = np.ascontiguousarray(dout.transpose(3, 1, 2, 0)).transpose(3, 1, 2, 0)
    views = q_big[:, ::2], k_t, v_view, do_t
    for x, y in zip(views, (q, k, v, dout)):
        assert not x.flags.c_contiguous and np.array_equal(x, y)
    return views


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_strided_numpy_inputs_equal_contiguous(dtype):
    q, k, v, dout = data(dtype)
    bias = np.random.default_rng(1).standard_normal((2, 5, 6)).transpose(0, 2, 1)   # strided (2, 6, 5)
    bias = np.ascontiguousarray(bias).transpose(0, 2, 1)                            # values (2, 5, 6), strided
    mask = (np.random.default_rng(2).random((1, 10, 6)) < 0.8)[:, ::2]              # strided (1, 5, 6)
    opts = dict(OPTS, attn_bias=bias[:, None], attn_mask=mask, **TILES)
    want = numpy_path(*(np.ascontiguousarray(x) for x in (q, k, v, dout)), **opts)
    sq, sk, sv, sdo = _strided_views(q, k, v, dout)
    out, lse = flashnb.flash_attention(sq, sk, sv, return_lse=True, **opts)
    # out and lse passed back strided too
    out_s = np.zeros((2, 10, 2, 3), out.dtype)[:, ::2]
    out_s[...] = out
    grads = flashnb.flash_attention_backward(sdo, sq, sk, sv, out_s, lse, deterministic=True, **opts)
    assert_all_bitwise((out, lse) + tuple(grads), want, "strided NumPy vs contiguous")


# ---------------------------------------------------------------------------------- Numba device arrays
def _is_device_array(x):
    return hasattr(x, "copy_to_host") and not isinstance(x, np.ndarray)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_numba_device_arrays_in_device_arrays_out(dtype):
    q, k, v, dout = data(dtype)
    want = numpy_path(q, k, v, dout, **OPTS, **TILES)
    dq_, dk_, dv_, ddo = (cuda.to_device(x) for x in (q, k, v, dout))
    out, lse = flashnb.flash_attention(dq_, dk_, dv_, return_lse=True, **OPTS, **TILES)
    assert _is_device_array(out) and _is_device_array(lse), f"got {type(out).__name__}, {type(lse).__name__}"
    grads = flashnb.flash_attention_backward(ddo, dq_, dk_, dv_, out, lse, deterministic=True, **OPTS, **TILES)
    assert all(_is_device_array(g) for g in grads)
    host = [x.copy_to_host() for x in (out, lse) + tuple(grads)]
    assert_all_bitwise(host, want, "Numba device arrays vs NumPy")
    for x, orig in zip((dq_, dk_, dv_, ddo), (q, k, v, dout)):
        assert x.copy_to_host().tobytes() == orig.tobytes(), "a device input was modified"


def test_strided_numba_device_arrays_equal_contiguous():
    """Views of device arrays (every other row, every other head, the first d of a wider head dim)."""
    q, k, v, dout = data(np.float64)
    want = numpy_path(q, k, v, dout, **OPTS, **TILES)
    q_big = np.zeros((2, 10, 2, 3))
    q_big[:, ::2] = q
    k_big = np.zeros((2, 6, 2, 3))
    k_big[:, :, ::2] = k
    v_wide = np.zeros((2, 6, 1, 7))
    v_wide[..., :3] = v
    do_big = np.zeros((2, 5, 2, 3, 2))
    do_big[..., 1] = dout
    # explicit slices: Numba's device arrays do not take an Ellipsis
    d_q, d_k, d_v, d_do = (cuda.to_device(q_big)[:, ::2], cuda.to_device(k_big)[:, :, ::2],
                           cuda.to_device(v_wide)[:, :, :, :3], cuda.to_device(do_big)[:, :, :, :, 1])
    out, lse = flashnb.flash_attention(d_q, d_k, d_v, return_lse=True, **OPTS, **TILES)
    grads = flashnb.flash_attention_backward(d_do, d_q, d_k, d_v, out, lse, deterministic=True, **OPTS, **TILES)
    host = [x.copy_to_host() for x in (out, lse) + tuple(grads)]
    assert_all_bitwise(host, want, "strided device arrays vs NumPy")


def test_explicit_numba_stream_with_numpy_inputs():
    """stream= a Numba stream: the copies and launches go on it; results as on the default stream."""
    q, k, v, dout = data(np.float32)
    want = numpy_path(q, k, v, dout, **OPTS, **TILES)
    stream = cuda.stream()
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True, stream=stream, **OPTS, **TILES)
    grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, deterministic=True, stream=stream,
                                             **OPTS, **TILES)
    stream.synchronize()
    assert_all_bitwise((out, lse) + tuple(grads), want, "Numba stream vs default stream")


# ---------------------------------------------------------------------------------- PyTorch (GPU)
def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _to_torch(torch, arrays, dtype):
    return [torch.as_tensor(np.ascontiguousarray(x), device="cuda").to(dtype) for x in arrays]


def _torch_numpy_reference(torch, tensors, **opts):
    """The NumPy path on the tensors' values (bfloat16: as float32, the kernels' compute type).

    bfloat16: the API hands the backward the forward's ``out`` *rounded to bfloat16*
    (it is a bfloat16 tensor), so the NumPy backward gets that rounded ``out`` too.
    """
    if tensors[0].dtype != torch.bfloat16:
        return numpy_path(*(t.cpu().numpy() for t in tensors), **opts)
    q, k, v, dout = (t.float().cpu().numpy() for t in tensors)
    out, lse, *_ = numpy_path(q, k, v, dout, **opts)           # forward and backward checked against the oracle
    out_bf16 = torch.as_tensor(out).to(torch.bfloat16).float().numpy()
    grads = flashnb.flash_attention_backward(dout, q, k, v, out_bf16, lse, deterministic=True, **opts)
    return (out, lse) + tuple(grads)


def _assert_torch_equal(torch, got, want, what):
    for name, t, w in zip(NAMES, got, want):
        assert isinstance(t, torch.Tensor) and t.is_cuda, f"{what}: {name} is {type(t).__name__}"
        w_t = torch.as_tensor(w)
        if name != "lse":
            w_t = w_t.to(t.dtype)          # bfloat16: the float32 result rounded, as the API does
        assert t.dtype == w_t.dtype, f"{what}: {name} dtype {t.dtype}, expected {w_t.dtype}"
        assert torch.equal(t.cpu(), w_t), f"{what}: {name} differs from the NumPy path"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32"])
def test_torch_cuda_tensors_in_and_out(dtype_name):
    torch = _torch()
    dtype = getattr(torch, dtype_name)
    tensors = _to_torch(torch, data(np.float32, seqlen_q=130, seqlen_k=257, headdim=64), dtype)
    q, k, v, dout = tensors
    want = _torch_numpy_reference(torch, tensors, **OPTS)
    # bfloat16 on the SIMT backend, which computes on float32 copies like the NumPy path; the
    # tensor-core backend's bfloat16 is held to the oracle in test_kernel_forward_tc
    backend = "simt" if dtype_name == "bfloat16" else "auto"
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True, backend=backend, **OPTS)
    grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, deterministic=True, **OPTS)
    torch.cuda.synchronize()
    assert out.dtype == dtype and lse.dtype == torch.float32
    _assert_torch_equal(torch, (out, lse) + tuple(grads), want, f"torch {dtype_name}")


@pytest.mark.gpu
def test_torch_strided_tensors_equal_contiguous():
    torch = _torch()
    q, k, v, dout = _to_torch(torch, data(np.float32, seqlen_q=100, seqlen_k=77, headdim=32), torch.float32)
    want = _torch_numpy_reference(torch, (q, k, v, dout), **OPTS)
    q_s = torch.zeros((2, 200, 2, 32), device="cuda")[:, ::2]
    q_s.copy_(q)
    k_s = k.transpose(1, 2).contiguous().transpose(1, 2)
    v_s = torch.zeros((2, 77, 1, 40), device="cuda")[..., :32]
    v_s.copy_(v)
    out, lse = flashnb.flash_attention(q_s, k_s, v_s, return_lse=True, **OPTS)
    grads = flashnb.flash_attention_backward(dout, q_s, k_s, v_s, out, lse, deterministic=True, **OPTS)
    torch.cuda.synchronize()
    _assert_torch_equal(torch, (out, lse) + tuple(grads), want, "strided torch")


@pytest.mark.gpu
def test_torch_non_default_current_stream():
    """Inside ``with torch.cuda.stream(s)`` the launch goes on s and the result is right once s is synced."""
    torch = _torch()
    q, k, v, dout = _to_torch(torch, data(np.float32, seqlen_q=300, seqlen_k=300, headdim=64), torch.float32)
    want = _torch_numpy_reference(torch, (q, k, v, dout), **OPTS)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out, lse = flashnb.flash_attention(q, k, v, return_lse=True, **OPTS)
        grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, deterministic=True, **OPTS)
    s.synchronize()
    _assert_torch_equal(torch, (out, lse) + tuple(grads), want, "torch on a side stream")


@pytest.mark.gpu
@pytest.mark.parametrize("stream_kind", ["torch", "numba", "int"])
def test_torch_explicit_stream_argument(stream_kind):
    torch = _torch()
    q, k, v, dout = _to_torch(torch, data(np.float32, seqlen_q=64, seqlen_k=200, headdim=16), torch.float32)
    want = _torch_numpy_reference(torch, (q, k, v, dout), **OPTS)
    ts = torch.cuda.Stream()
    ts.wait_stream(torch.cuda.current_stream())
    stream = {"torch": ts, "numba": cuda.external_stream(ts.cuda_stream), "int": ts.cuda_stream}[stream_kind]
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True, stream=stream, **OPTS)
    grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, deterministic=True, stream=stream, **OPTS)
    ts.synchronize()
    _assert_torch_equal(torch, (out, lse) + tuple(grads), want, f"torch, stream={stream_kind}")


# ---------------------------------------------------------------------------------- CuPy (GPU)
def _cupy():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any CUDA runtime failure means no usable device
        pytest.skip(f"cupy has no CUDA device: {e}")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_cupy_arrays_in_and_out(dtype):
    cupy = _cupy()
    host = data(dtype, seqlen_q=129, seqlen_k=65, headdim=48)
    want = numpy_path(*host, **OPTS)
    q, k, v, dout = (cupy.asarray(x) for x in host)
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True, **OPTS)
    grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, deterministic=True, **OPTS)
    cupy.cuda.get_current_stream().synchronize()
    got = (out, lse) + tuple(grads)
    assert all(isinstance(x, cupy.ndarray) for x in got), [type(x).__name__ for x in got]
    assert_all_bitwise([cupy.asnumpy(x) for x in got], want, "CuPy vs NumPy")


@pytest.mark.gpu
@pytest.mark.parametrize("stream_kind", ["cupy", "current", "numba"])
def test_cupy_streams(stream_kind):
    cupy = _cupy()
    host = data(np.float32, seqlen_q=200, seqlen_k=300, headdim=32)
    want = numpy_path(*host, **OPTS)
    q, k, v, dout = (cupy.asarray(x) for x in host)
    cupy.cuda.Device().synchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    kw = dict(OPTS)
    if stream_kind == "cupy":
        kw["stream"] = s
    elif stream_kind == "numba":
        kw["stream"] = cuda.external_stream(s.ptr)
    if stream_kind == "current":
        with s:
            out, lse = flashnb.flash_attention(q, k, v, return_lse=True, **kw)
            grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
    else:
        out, lse = flashnb.flash_attention(q, k, v, return_lse=True, **kw)
        grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
    s.synchronize()
    assert_all_bitwise([cupy.asnumpy(x) for x in (out, lse) + tuple(grads)], want, f"CuPy, stream {stream_kind}")
