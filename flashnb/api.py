"""The public functions: validate, plan, allocate, launch, hand back the caller's kind of array.

Layering as in flash-attn: ``flash_attention`` / ``flash_attention_backward`` (public, documented options)
-> ``plan.forward`` / ``plan.backward`` (which backend, tiles, kernels and grids serve the call; the refusals)
-> ``_forward_launch`` / ``_backward_launches`` (device arrays in, the plan's launches) -> the
kernel factories in ``flashnb.kernels`` (one compiled kernel per specialisation key, cached).
"""
import numpy as np

from . import _arrays, _dispatch, _options, kvcache, plan
from .plan import BACKENDS  # noqa: F401  (flashnb.BACKENDS)
from .kernels._jit import launch, memset_zero
from .kernels import tf32_prepare
from .kernels._tiles import np_acc

def flash_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), attn_mask=None,
                    attn_bias=None, alibi_slopes=None, softcap=0.0, block_mask=None, block_mask_size=(128, 128),
                    dropout_p=0.0, seed=0, return_lse=False, block_q=None, block_k=None, deterministic=False,
                    stream=None, backend="auto", precision="highest"):
    """Exact attention ``softmax(q k^T * softmax_scale [+ options]) v`` without materialising the scores.

    Arguments (flash-attn's layout; docs/semantics.md defines every option):
        q: ``(batch, seqlen_q, nheads, headdim)``; k, v: ``(batch, seqlen_k, nheads_k, headdim)``,
            ``nheads % nheads_k == 0`` (grouped-query attention). float16, bfloat16, float32 or float64;
            NumPy arrays, CuPy arrays, PyTorch CUDA tensors or Numba device arrays, any strides.
        softmax_scale: default ``1 / sqrt(headdim)``.
        causal, window_size: aligned to the bottom-right corner: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q`` (causal); ``window_size=(left, right)``, -1 unbounded.
            For seqlen_q=2, seqlen_k=5 the causal mask is::

                1 1 1 1 0
                1 1 1 1 1

        attn_mask (bool, True = may attend), attn_bias (float), block_mask (bool, per block of
            ``block_mask_size``): broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)`` (block mask: to
            the block grid). alibi_slopes: ``(nheads,)`` or ``(batch, nheads)``. softcap: 0 = off.
        dropout_p, seed: dropout on the attention probabilities; the keep mask is Philox-4x32-10 of
            ``(seed, batch, head, i, j)``, the same in the backward and in ``reference.dropout_keep_mask``.
        return_lse: also return ``lse`` ``(batch, nheads, seqlen_q)`` (natural log; float64 for float64
            inputs, else float32); a row that sees no key gives ``out = 0``, ``lse = -inf``.
        block_q, block_k: tile sizes (powers of two up to 128); default per head dim.
        stream: a Numba, CuPy or PyTorch stream (default: the caller's library's current stream).
        backend: "auto" (tensor cores where they can serve the call, else SIMT), "simt" (CUDA-core
            kernels, every dtype) or "tensorcore" (float16/bfloat16, even head dim, contiguous head
            dimension, compute capability >= 8.0, tiles >= 16; anything else raises ValueError saying why).
            The backward's "auto" takes the tensor cores under the same conditions plus
            deterministic=False and, above head dim 128, block_k <= 64 (see flash_attention_backward).
            float32 on the tensor cores: tf32 operands, compute capability >= 8.0 (``precision``).
            "wgmma": Hopper's forward (compute capability 9.0; float16/bfloat16 head dims up to 256,
            float32 up to 128 on tf32 wgmma, dense batches, its K and V prepared by a pre-pass into
            temporaries about 4x K's size at "highest", 2x at "high"); "auto" runs it on an H100 above head dim
            48 for 16-bit inputs and for float32 up to head dim 128 (``plan.WGMMA_AUTO_FLOAT32``).
            Small queries (``plan.split_kv``: at most 16 query rows per KV head, no mask, bias or dropout)
            run under "auto" on the split-KV decode kernels of ``flash_attn_with_kvcache``.
        precision: float32 on the tensor cores, as ``torch.set_float32_matmul_precision``: "highest" (the
            default: each operand split into two tf32 parts, three products, float32's accuracy; docs/api.md
            has the error tables) or "high" (one tf32 product: about 3 decimal digits); other dtypes ignore it.

    Returns ``out`` (like ``q``), or ``(out, lse)``, as the same kind of array as ``q``.
    Copies: NumPy inputs are copied to the device and the results back; the tensor-core
    kernels read float16/bfloat16 arrays in place (32-bit word views); the SIMT kernels
    take bfloat16 inputs as float32 copies.
    Inputs are never written.
    """
    del deterministic  # the forward is deterministic by construction (no atomics)
    if type(window_size) is not tuple:      # a list, an array or tensor of two ints (flash-attn takes them)
        window_size = _options.window_pair(window_size)
    return cached_forward(q, k, v, softmax_scale, causal, window_size, attn_mask, attn_bias, alibi_slopes, softcap,
                          block_mask, block_mask_size, dropout_p, seed, return_lse, block_q, block_k, stream, backend,
                          precision)


_KEY_LENGTH = ((1, 2), 1)   # k's and v's length (axis 1): a routed call's step serves every key count (kvcache._Step)


def cached_forward(q, k, v, softmax_scale, causal, window_size, attn_mask, attn_bias, alibi_slopes, softcap,
                   block_mask, block_mask_size, dropout_p, seed, return_lse, block_q, block_k, stream, backend,
                   precision):
    """``flash_attention`` with every option in order, ``window_size`` a tuple (``flashnb.torch`` calls it so): a
    replay of the dispatch cache, or the full path, ``_full_forward`` (no closure to make on a hit: ~0.3 us)."""
    return _dispatch.cached_call(
        "forward", (q, k, v, attn_mask, attn_bias, alibi_slopes, block_mask),
        (softmax_scale, causal, window_size, softcap, block_mask_size, dropout_p, seed, return_lse, block_q,
         block_k, backend, precision),
        _full_forward, cacheable=stream is None and type(dropout_p) in (int, float) and dropout_p == 0,
        args=(q, k, v, softmax_scale, causal, window_size, attn_mask, attn_bias, alibi_slopes, softcap, block_mask,
              block_mask_size, dropout_p, seed, return_lse, block_q, block_k, stream, backend, precision),
        generic=_KEY_LENGTH)


def _full_forward(q, k, v, softmax_scale, causal, window_size, attn_mask, attn_bias, alibi_slopes, softcap,
                  block_mask, block_mask_size, dropout_p, seed, return_lse, block_q, block_k, stream, backend,
                  precision):
    return _forward(q, k, v, dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                  attn_mask=attn_mask, attn_bias=attn_bias, alibi_slopes=alibi_slopes, softcap=softcap,
                                  block_mask=block_mask, block_mask_size=block_mask_size, dropout_p=dropout_p,
                                  seed=seed),
                    return_lse, block_q, block_k, stream, backend, precision)


def _forward(q, k, v, options, return_lse, block_q, block_k, stream, backend, precision="highest"):
    """``flash_attention``'s full path: validate, plan, allocate, launch."""
    kind, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = _options.check_qkv(q, k, v)
    plan.check_backend(backend)
    plan.check_precision(precision)
    launch_stream = _arrays.resolve_stream(stream, kind, q)
    plain = (all(options[n] is None for n in ("attn_mask", "attn_bias", "block_mask")) and options["dropout_p"] == 0
             and options.get("mods") is None)
    if (plan.split_kv(kind.dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, backend,
                      block_q is not None or block_k is not None, plain)
            and _decode_layout(kind, (q, k, v), launch_stream)):
        _options.check_seed_and_block_size(options["seed"], options["block_mask_size"])
        return kvcache.attend(q, k, v, options, return_lse, stream)
    with _arrays.stream_scope(launch_stream, kind, q):   # the library's own work of the call runs there too
        opts, call = _setup(kind, q, (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim), launch_stream,
                            block_q, block_k, backend, False, **options)
        call = call._replace(precision=precision)
        p, words = _planned(plan.forward, call, (q, k, v), ("q", "k", "v"), launch_stream, backward=False)
        lse_ret, lse_d = _arrays.empty_like_kind(kind, (batch, nheads, seqlen_q), p.acc, q, launch_stream)
        out_shape = (batch, seqlen_q, nheads, headdim)
        if p.backend == "tensorcore":
            out_ret, out_d = _arrays.empty_like_kind(kind, out_shape, kind.dtype, q, launch_stream, bits=True)
            qw, kw, vw = words
            kw, vw = _tf32_operands(p, kw, vw, kind, q, launch_stream)
            _forward_launch(p, qw, kw, vw, _arrays.word_view(out_d), lse_d, opts, launch_stream)
        else:
            qd, kd, vd = _prepare((q, k, v), kind, launch_stream)
            out_ret, out_d = _arrays.empty_like_kind(kind, out_shape, kind.dtype, q, launch_stream)
            if kind.dtype == "bfloat16":
                _dispatch.unfit()              # float32 copies made and read back by torch
            out_k = out_d if kind.dtype != "bfloat16" else _arrays.scratch(out_d.shape, np.float32, kind, q,
                                                                             launch_stream)
            _forward_launch(p, qd, kd, vd, out_k, lse_d, opts, launch_stream)
            if kind.dtype == "bfloat16":
                out_ret.copy_(_torch_from(out_k))
        out = _arrays.finish(kind, out_ret, out_d, launch_stream)
        return (out, _arrays.finish(kind, lse_ret, lse_d, launch_stream)) if return_lse else out


def _decode_layout(kind, arrays, stream):
    """Whether the split-KV decode kernels can read the arrays as they are: float32 any strides, 16-bit ones as
    32-bit words (a contiguous head dimension, rows 4-byte aligned); NumPy arrays are copied contiguous."""
    if kind.dtype == "float32" or kind.lib == "numpy":
        return True
    return all(_arrays.has_word_view(x, stream) for x in arrays)


def _tf32_operands(p, k, v, kind, like, stream):
    """The forward's K and V operands: with ``p.prepare`` (float32 on tf32 wgmma), its pre-pass's ``kk`` and
    ``vt`` made from K's and V's word views (``kernels.tf32_prepare.make_prepare_tf32``), in temporaries of the
    call; else ``k``, ``v``."""
    if p.prepare is None:
        return k, v
    batch, seqlen_k, nheads_k, _ = k.shape
    split = p.call.precision == "highest"
    kk_shape, vt_shape = tf32_prepare.tf32_operand_shapes(batch, seqlen_k, nheads_k, p.call.headdim, split)
    kk = _arrays.scratch(kk_shape, np.uint32, kind, like, stream)
    vt = _arrays.scratch(vt_shape, np.uint32, kind, like, stream)
    s = vt.strides
    vt = _arrays.strided_view(vt, (batch, vt_shape[2], nheads_k, vt_shape[3]), (s[0], s[2], s[1], s[3]))
    step = p.prepare_launch(batch, seqlen_k, nheads_k)
    if step is not None:
        _run(step, stream, (k, v, kk, vt))
    return kk, vt


def _forward_launch(p, q, k, v, out, lse, opts, stream):
    """The plan's forward: on uint32 word views of q, k, v, out (tensor cores) or device arrays (SIMT)."""
    if p.forward is not None:
        if p.tma and not _dispatch.REPLAY_TENSOR_MAPS:
            _dispatch.unfit()         # its tensor maps hold the arrays' addresses: no replay with other arrays
        _run(p.forward, stream, p.args(q, k, v, out, lse, opts, stream.handle))


def flash_attention_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                             attn_mask=None, attn_bias=None, alibi_slopes=None, softcap=0.0, block_mask=None,
                             block_mask_size=(128, 128), dropout_p=0.0, seed=0, block_q=None, block_k=None,
                             deterministic=False, stream=None, backend="auto", precision="highest"):
    """Gradients ``(dq, dk, dv)`` of ``sum(out * dout)`` for ``out, lse = flash_attention(..., return_lse=True)``.

    The same options as the forward (they must match the forward call). ``dk``, ``dv`` are summed over
    the query heads that share a key/value head. ``deterministic=True`` computes dQ in a second pass
    over key tiles (bit-identical run to run); the default adds each key tile's share of dQ with
    float atomics (faster; the summation order may vary run to run). Returns arrays of ``q``'s kind;
    the same copies as ``flash_attention``. ``backend``: "tensorcore" runs the tensor-core backward
    (float16/bfloat16, even head dims, tiles >= 16, block_k <= 64 above head dim 128, atomic dQ),
    refusing with a ValueError what it cannot serve; "simt" the SIMT one; "auto" the tensor-core
    backward where it can serve the call, else the SIMT one (``deterministic=True`` always runs on SIMT).
    float32 runs on SIMT unless ``backend="tensorcore"``; there ``precision`` ("highest": 3xTF32, or "high": one
    tf32 product, as ``flash_attention`` takes it) chooses the tensor cores' precision, independently of the
    forward's.
    """
    if type(window_size) is not tuple:
        window_size = _options.window_pair(window_size)
    return cached_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size, attn_mask, attn_bias,
                           alibi_slopes, softcap, block_mask, block_mask_size, dropout_p, seed, block_q, block_k,
                           deterministic, stream, backend, precision)


def cached_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size, attn_mask, attn_bias, alibi_slopes,
                    softcap, block_mask, block_mask_size, dropout_p, seed, block_q, block_k, deterministic, stream,
                    backend, precision):
    """``flash_attention_backward`` with every option in order, ``window_size`` a tuple: as ``cached_forward``."""
    return _dispatch.cached_call(
        "backward", (dout, q, k, v, out, lse, attn_mask, attn_bias, alibi_slopes, block_mask),
        (softmax_scale, causal, window_size, softcap, block_mask_size, dropout_p, seed, block_q, block_k,
         deterministic, backend, precision),
        _full_backward, cacheable=stream is None and type(dropout_p) in (int, float) and dropout_p == 0,
        args=(dout, q, k, v, out, lse, softmax_scale, causal, window_size, attn_mask, attn_bias, alibi_slopes,
              softcap, block_mask, block_mask_size, dropout_p, seed, block_q, block_k, deterministic, stream, backend,
              precision))


def _full_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size, attn_mask, attn_bias, alibi_slopes,
                   softcap, block_mask, block_mask_size, dropout_p, seed, block_q, block_k, deterministic, stream,
                   backend, precision):
    return _backward(dout, q, k, v, out, lse, dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                                   attn_mask=attn_mask, attn_bias=attn_bias, alibi_slopes=alibi_slopes,
                                                   softcap=softcap, block_mask=block_mask,
                                                   block_mask_size=block_mask_size, dropout_p=dropout_p, seed=seed),
                     block_q, block_k, deterministic, stream, backend, precision)


def _backward(dout, q, k, v, out, lse, options, block_q, block_k, deterministic, stream, backend,
              precision="highest"):
    """``flash_attention_backward``'s full path."""
    kind, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = _options.check_qkv(q, k, v)
    plan.check_backend(backend)
    plan.check_precision(precision)
    for x, name, shape in ((dout, "dout", tuple(q.shape)), (out, "out", tuple(q.shape)),
                           (lse, "lse", (batch, nheads, seqlen_q))):
        check_like(x, name, shape, kind, q)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    launch_stream = _arrays.resolve_stream(stream, kind, q)
    with _arrays.stream_scope(launch_stream, kind, q):   # the library's own work of the call runs there too
        opts, call = _setup(kind, q, (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim), launch_stream,
                            block_q, block_k, backend, bool(deterministic), **options)
        call = call._replace(precision=precision)
        p, words = _planned(plan.backward, call, (dout, q, k, v, out), ("dout", "q", "k", "v", "out"), launch_stream,
                            backward=True)
        shapes = ((batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
                  (batch, seqlen_k, nheads_k, headdim))
        if p.backend == "tensorcore":
            grads = [_arrays.empty_like_kind(kind, shape, kind.dtype, q, launch_stream, bits=True) for shape in shapes]
            _backward_launches(p, *words, _arrays.to_device(lse, launch_stream),
                               *(_arrays.word_view(view) for _, view in grads), opts, launch_stream, kind, q)
            return tuple(_arrays.finish(kind, ret, view, launch_stream) for ret, view in grads)
        if kind.dtype == "bfloat16":
            _dispatch.unfit()                  # float32 copies made and read back by torch
        arrays = _prepare((dout, q, k, v, out), kind, launch_stream)
        grads = []
        for shape in shapes:
            ret, view = _arrays.empty_like_kind(kind, shape, kind.dtype, q, launch_stream)
            kernel_view = view if kind.dtype != "bfloat16" else _arrays.scratch(shape, np.float32, kind, q, launch_stream)
            grads.append((ret, view, kernel_view))
        _backward_launches(p, *arrays, _arrays.to_device(lse, launch_stream), *(g[2] for g in grads), opts,
                           launch_stream, kind, q)
        result = []
        for ret, view, kernel_view in grads:
            if kind.dtype == "bfloat16":
                ret.copy_(_torch_from(kernel_view))
            result.append(_arrays.finish(kind, ret, view, launch_stream))
        return tuple(result)


def check_like(x, name, shape, kind, q):
    """``dout``, ``out``, ``lse`` of a backward call: q's kind, the expected shape, a fitting dtype, q's device."""
    kd = _arrays.kind_of(x, name)
    if kd.lib != kind.lib:
        raise TypeError(f"{name} is a {kd.lib} array but q is a {kind.lib} array; pass one kind")
    if tuple(int(s) for s in x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if name != "lse" and kd.dtype != kind.dtype:
        raise TypeError(f"{name} has dtype {kd.dtype} but q has {kind.dtype}; pass one dtype")
    if name == "lse" and kd.dtype not in ("float32", "float64"):
        raise TypeError(f"lse must be float32 or float64, got {kd.dtype}")
    _arrays.check_same_device(x, name, q)


def _backward_launches(p, dout, q, k, v, out, lse, dq, dk, dv, opts, stream, kind, like):
    """The plan's backward (FA2 Algorithm 2 in three steps): the preprocess (delta, lse in base 2), the dK/dV
    kernel (with the atomic dQ: its partial sums into a zeroed accumulator), then the accumulator's cast or the
    dQ pass.  The same for both backends: the tensor-core kernels take uint32 word views."""
    c = p.call
    if p.preprocess is None and p.dkdv is None and p.finish is None:
        return
    acc = np.dtype(p.acc).type
    delta, lse2 = (_arrays.scratch((c.batch, c.nheads, c.seqlen_q), acc, kind, like, stream) for _ in range(2))
    if p.preprocess is not None:
        _run(p.preprocess, stream, (dout, out, lse, delta, lse2))
    if p.atomic:
        dq_accum = _arrays.scratch(p.accum_shape(), acc, kind, like, stream)
        if c.seqlen_q > 0:
            memset_zero(dq_accum, stream)
    else:
        dq_accum = _arrays.scratch((1, 1, 1, 1), acc, kind, like, stream)
    if p.dkdv is not None:
        if p.tma and not _dispatch.REPLAY_TENSOR_MAPS:
            _dispatch.unfit()         # its tensor maps hold the arrays' addresses: no replay with other arrays
        _run(p.dkdv, stream, p.dkdv_args(q, k, v, dout, lse2, delta, dk, dv, dq_accum, opts, stream.handle))
    if p.finish is not None:
        args = ((_arrays.flat(dq_accum), _arrays.flat(dq)) + p.cast_args() if p.atomic
                else p.dq_args(q, k, v, dout, lse2, delta, dq, opts))
        _run(p.finish, stream, args)


def _run(step, stream, args):
    """Launch one ``plan.Launch`` on ``stream``."""
    launch(step.kernel, step.grid, step.threads, stream, step.shared, args)


def _setup(kind, q, dims, launch_stream, block_q, block_k, backend, deterministic, **options):
    """The call's ``LaunchOptions`` (16-bit inputs accumulate in float32), its tiles and devices checked, and
    its ``plan.Call`` (the layout not yet probed)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = dims
    _options.check_tile(block_q, "block_q")
    _options.check_tile(block_k, "block_k")
    _arrays.check_device(q, "q")
    for name in ("attn_mask", "attn_bias", "alibi_slopes", "block_mask"):
        _arrays.check_same_device(options.get(name), name, q)
    acc = np.float32 if kind.dtype == "bfloat16" else np_acc(kind.dtype)
    opts = _options.normalise(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, headdim=headdim,
                              acc=acc, stream=launch_stream, **options)
    return opts, plan.Call(kind.dtype, *dims, opts.flags, plan.tc_positive_scale(opts.scale), block_q, block_k,
                           backend, deterministic)


def _planned(make_plan, call, arrays, names, stream, backward):
    """``make_plan(call)`` (``plan.forward`` or ``plan.backward``), and the arrays' uint32 word views where the
    tensor cores may serve the call (else None): the views' layout completes the call first (the first array
    with no view, or None; whether the rows of every array but ``out`` are 16-byte aligned, for 16-byte
    copies)."""
    if not plan.wants_words(call, backward):
        return make_plan(call), None
    views = []
    for x, name in zip(arrays, names):
        w = _arrays.word_view(_arrays.to_device_bits(x, stream))
        if w is None:
            return make_plan(call._replace(layout=(name, False))), None
        views.append(w)
    inputs = [w for w, name in zip(views, names) if name != "out"]
    return make_plan(call._replace(layout=(None, all(_arrays.rows_aligned16(w) for w in inputs)))), views


def _prepare(arrays, kind, stream):
    """Numba device views of the caller's arrays (bfloat16 tensors: float32 copies)."""
    out = []
    for x in arrays:
        if kind.dtype == "bfloat16":
            x = x.float()
        out.append(_arrays.to_device(x, stream))
    return out


def _torch_from(device_array):
    import torch
    return torch.as_tensor(device_array, device="cuda")
