"""Packed (varlen) batches: flash-attn's ``flash_attn_varlen_func`` on flashnb's kernels.

A packed batch holds sequences of unequal lengths back to back with no padding: q ``(total_q, nheads,
headdim)``, k and v ``(total_k, nheads_k, headdim)``, sequence ``b`` at rows ``cu_seqlens_q[b] ..
cu_seqlens_q[b + 1]`` of q (``cu_seqlens_k`` likewise for k, v).  Each sequence is attended on its own, with
causal and windows aligned to its own bottom-right corner (docs/semantics.md; the oracle is
``reference.attention_varlen``).

The kernels are the dense ones built with ``VARLEN`` (``kernels/forward.py`` and the others): each (array
of the packed batch) is handed to them as a ``(batch, total, nheads, headdim)`` view whose batch stride is 0
(``_packed``), and each block slices its sequence's rows out of it with ``cu_seqlens`` (``_tiles.sequence_span``),
so that the kernel body sees a dense batch whose row ``i`` of sequence ``b`` is ``[b, i]``.  The grid runs over
``max_seqlen_q`` query tiles (``max_seqlen_k`` key tiles in the dK/dV kernel) x heads x sequences; a block whose
tile starts past its sequence's end returns at once.  The backward's per-row steps (delta, the dQ cast) run on
the packed rows as one sequence of ``total_q`` rows.

``cu_seqlens`` are checked on the host before anything is launched (int32, 1-D, from 0, never decreasing, the
last entry the total, ``max_seqlen`` no shorter than any sequence): device arrays are copied to the host once
per call for that (a synchronisation with their stream).  The kernels read the checked values: the caller's
own device array where it is a contiguous one of q's kind on q's device (``_on_device``), else a device copy of
the host values; so no block ever indexes outside its arrays.  After the checks, a call goes through the dispatch
cache (``_dispatch.cached_call``): a replay binds the new call's arrays, ``cu_seqlens`` among them.
"""
import numbers

import numpy as np
from numba import cuda

from . import _arrays, _dispatch, _options, api, plan
from .kernels._jit import memset_zero

_REFUSED = ("attn_mask", "attn_bias", "block_mask")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, attn_mask=None,
                           attn_bias=None, block_mask=None, return_lse=False, block_q=None, block_k=None,
                           stream=None, backend="auto"):
    """Attention of each sequence of a packed batch on its own, without materialising the scores.

    Arguments (flash-attn's varlen layout; the options as in ``flashnb.flash_attention``):
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_k, headdim)``, ``nheads % nheads_k == 0``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, the sequences' first rows and the total: sequence
            ``b`` is rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of q (and of ``cu_seqlens_k`` of k, v);
            empty sequences allowed.  Any array kind (NumPy, CuPy, PyTorch, Numba); read on the host.
        max_seqlen_q, max_seqlen_k: ints at least every sequence's length (the grid's tiles per sequence).
        causal, window_size: aligned to each sequence's bottom-right corner.
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)`` (per sequence). softcap: 0 = off.
        dropout_p, attn_mask, attn_bias, block_mask: not defined for packed batches (ValueError unless 0 / None).

    Returns ``out`` ``(total_q, nheads, headdim)`` like q, or ``(out, lse)`` with ``lse`` ``(nheads, total_q)``
    (flash-attn's varlen layout; float64 for float64 inputs, else float32); with ``return_attn_probs`` (flash-attn's
    name), ``(out, lse, None)``: the probabilities are never materialised.  A query of a sequence with no keys
    gives ``out = 0``, ``lse = -inf``.  Copies as ``flash_attention``'s.

    block_table: int32 ``(batch, pages_per_sequence)`` or None (flash-attn's paged KV cache for packed
        batches): k and v are then ``(num_pages, page_size, nheads_k, headdim)`` pages and sequence ``b``'s key
        ``j`` is row ``j % page_size`` of page ``block_table[b, j // page_size]``; ``cu_seqlens_k`` still gives
        each sequence's key count (``cu_seqlens_k[-1]`` its total).  Served by gathering each sequence's keys and
        values into packed copies, then the packed call: one copy of the keys read, no autograd; NumPy,
        PyTorch and CuPy arrays (the table read on the host, as ``cu_seqlens``).

    The parameters up to ``block_table`` are flash-attn's, in its order (a positional caller's arguments keep
    their meaning).  The rest are flashnb's, keyword-only.
    """
    del deterministic  # the forward is deterministic by construction (no atomics)
    if block_table is not None:
        k, v = _gather_pages(k, v, block_table, cu_seqlens_k)
    if not isinstance(return_attn_probs, (bool, np.bool_)):
        raise TypeError(f"return_attn_probs must be a bool, got {type(return_attn_probs).__name__}")
    if return_attn_probs:
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                          softmax_scale, causal, window_size, softcap, alibi_slopes,
                                          attn_mask=attn_mask, attn_bias=attn_bias, block_mask=block_mask,
                                          return_lse=True, block_q=block_q, block_k=block_k, stream=stream,
                                          backend=backend)
        return out, lse, None
    _refuse(dropout_p, attn_mask, attn_bias, block_mask)
    kind, total_q, total_k, nheads, nheads_k, headdim = check_packed(q, k, v)
    plan.check_backend(backend)
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k)
    if type(window_size) is not tuple:
        window_size = _options.window_pair(window_size)
    return _dispatch.cached_call(       # checked every call (above); planned, bound and launched once a signature
        "varlen_forward", (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes),
        (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap, return_lse, block_q, block_k,
         backend), _full_forward, cacheable=stream is None,
        args=(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
              window_size, softcap, alibi_slopes, return_lse, block_q, block_k, stream, backend))


def _full_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, return_lse, block_q, block_k, stream, backend):
    """The packed forward's full path (checked arguments; ``cu_q``, ``cu_k``: the host copies of ``cu_seqlens``)."""
    kind, total_q, _, nheads, nheads_k, headdim = check_packed(q, k, v)
    batch = cu_q.shape[0] - 1
    launch_stream = _arrays.resolve_stream(stream, kind, q)
    with _arrays.stream_scope(launch_stream, kind, q):
        opts, call = _setup(kind, q, (batch, int(max_seqlen_q), int(max_seqlen_k), nheads, nheads_k, headdim),
                            total_q, (cu_seqlens_q, cu_q), (cu_seqlens_k, cu_k), launch_stream, block_q, block_k,
                            backend, False,
                            softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                            alibi_slopes=alibi_slopes, softcap=softcap)
        p, words = api._planned(plan.forward, call, (q, k, v), ("q", "k", "v"), launch_stream, backward=False)
        lse_ret, lse_d = _arrays.empty_like_kind(kind, (nheads, total_q), p.acc, q, launch_stream)
        out_shape = (total_q, nheads, headdim)
        if p.backend == "tensorcore":
            out_ret, out_d = _arrays.empty_like_kind(kind, out_shape, kind.dtype, q, launch_stream, bits=True)
            qw, kw, vw = (_packed(w, 1) for w in words)          # (a packed batch: one sequence of rows)
            kw, vw = api._tf32_operands(p, kw, vw, kind, q, launch_stream)
            api._forward_launch(p, _rebatch(qw, batch), _rebatch(kw, batch), _rebatch(vw, batch),
                                _packed(_arrays.word_view(out_d), batch), _packed(lse_d, batch), opts, launch_stream)
        else:
            qd, kd, vd = api._prepare((q, k, v), kind, launch_stream)
            out_ret, out_d = _arrays.empty_like_kind(kind, out_shape, kind.dtype, q, launch_stream)
            if kind.dtype == "bfloat16":
                _dispatch.unfit()              # float32 copies made and read back by torch
            out_k = out_d if kind.dtype != "bfloat16" else _arrays.scratch(out_shape, np.float32, kind, q,
                                                                             launch_stream)
            api._forward_launch(p, *(_packed(x, batch) for x in (qd, kd, vd, out_k)), _packed(lse_d, batch), opts,
                                launch_stream)
            if kind.dtype == "bfloat16":
                out_ret.copy_(api._torch_from(out_k))
        out = _arrays.finish(kind, out_ret, out_d, launch_stream)
        return (out, _arrays.finish(kind, lse_ret, lse_d, launch_stream)) if return_lse else out


def flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                               softcap=0.0, dropout_p=0.0, attn_mask=None, attn_bias=None, block_mask=None,
                               block_q=None, block_k=None, deterministic=False, stream=None, backend="auto"):
    """Gradients ``(dq, dk, dv)`` (packed like q, k, v) of ``sum(out * dout)`` for ``out, lse =
    flash_attn_varlen_func(..., return_lse=True)``; the same options as that call.  ``lse``: ``(nheads,
    total_q)``.  ``deterministic`` and ``backend`` as in ``flashnb.flash_attention_backward``."""
    _refuse(dropout_p, attn_mask, attn_bias, block_mask)
    kind, total_q, total_k, nheads, nheads_k, headdim = check_packed(q, k, v)
    plan.check_backend(backend)
    for x, name, shape in ((dout, "dout", tuple(q.shape)), (out, "out", tuple(q.shape)),
                           (lse, "lse", (nheads, total_q))):
        api.check_like(x, name, shape, kind, q)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k)
    if type(window_size) is not tuple:
        window_size = _options.window_pair(window_size)
    return _dispatch.cached_call(
        "varlen_backward", (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes),
        (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap, block_q, block_k,
         bool(deterministic), backend), _full_backward, cacheable=stream is None,
        args=(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_size, alibi_slopes, softcap, block_q, block_k, bool(deterministic),
              stream, backend))


def _full_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_size, alibi_slopes, softcap, block_q, block_k, deterministic, stream,
                   backend):
    """The packed backward's full path (checked arguments, as ``_full_forward``)."""
    kind, total_q, total_k, nheads, nheads_k, headdim = check_packed(q, k, v)
    batch = cu_q.shape[0] - 1
    launch_stream = _arrays.resolve_stream(stream, kind, q)
    with _arrays.stream_scope(launch_stream, kind, q):
        opts, call = _setup(kind, q, (batch, int(max_seqlen_q), int(max_seqlen_k), nheads, nheads_k, headdim),
                            total_q, (cu_seqlens_q, cu_q), (cu_seqlens_k, cu_k), launch_stream, block_q, block_k,
                            backend, bool(deterministic),
                            softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                            alibi_slopes=alibi_slopes, softcap=softcap)
        p, words = api._planned(plan.backward, call, (dout, q, k, v, out), ("dout", "q", "k", "v", "out"),
                                launch_stream, backward=True)
        shapes = ((total_q, nheads, headdim), (total_k, nheads_k, headdim), (total_k, nheads_k, headdim))
        lse_d = _arrays.to_device(lse, launch_stream)
        if p.backend == "tensorcore":
            grads = [_arrays.empty_like_kind(kind, shape, kind.dtype, q, launch_stream, bits=True) for shape in shapes]
            _backward_launches(p, *words, lse_d, *(_arrays.word_view(view) for _, view in grads), opts,
                               launch_stream, kind, q, batch)
            return tuple(_arrays.finish(kind, ret, view, launch_stream) for ret, view in grads)
        if kind.dtype == "bfloat16":
            _dispatch.unfit()                  # float32 copies made and read back by torch
        arrays = api._prepare((dout, q, k, v, out), kind, launch_stream)
        grads = []
        for shape in shapes:
            ret, view = _arrays.empty_like_kind(kind, shape, kind.dtype, q, launch_stream)
            kernel_view = view if kind.dtype != "bfloat16" else _arrays.scratch(shape, np.float32, kind, q, launch_stream)
            grads.append((ret, view, kernel_view))
        _backward_launches(p, *arrays, lse_d, *(g[2] for g in grads), opts, launch_stream, kind, q, batch)
        result = []
        for ret, view, kernel_view in grads:
            if kind.dtype == "bfloat16":
                ret.copy_(api._torch_from(kernel_view))
            result.append(_arrays.finish(kind, ret, view, launch_stream))
        return tuple(result)


def _backward_launches(p, dout, q, k, v, out, lse, dq, dk, dv, opts, stream, kind, like, batch):
    """``api._backward_launches`` on a packed batch: the preprocess (delta, lse in base 2) over the packed rows as
    one sequence, the dK/dV kernel over each sequence's key tiles (atomic dQ into a packed ``(1, total_q,
    nheads, headdim)`` accumulator), then its cast or the dQ pass over each sequence's query tiles."""
    c = p.call
    if p.preprocess is None and p.dkdv is None and p.finish is None:
        return
    acc = np.dtype(p.acc).type
    delta, lse2 = (_arrays.scratch((c.nheads, c.total_q), acc, kind, like, stream) for _ in range(2))
    if p.preprocess is not None:
        api._run(p.preprocess, stream, tuple(_packed(x, 1) for x in (dout, out, lse, delta, lse2)))
    if p.atomic:
        assert p.dq_frag is None, "a packed batch's dQ accumulator is in rows"
        dq_accum = _arrays.scratch((1, c.total_q, c.nheads, c.headdim), acc, kind, like, stream)
        if c.total_q > 0:
            memset_zero(dq_accum, stream)
    else:
        dq_accum = _arrays.scratch((1, 1, 1, 1), acc, kind, like, stream)
    q, k, v, dout, lse2, delta, dk, dv = (_packed(x, batch) for x in (q, k, v, dout, lse2, delta, dk, dv))
    if p.dkdv is not None:
        api._run(p.dkdv, stream, p.dkdv_args(q, k, v, dout, lse2, delta, dk, dv, dq_accum, opts, stream.handle))
    if p.finish is not None:
        args = ((_arrays.flat(dq_accum), _arrays.flat(dq)) if p.atomic
                else p.dq_args(q, k, v, dout, lse2, delta, _packed(dq, batch), opts))
        api._run(p.finish, stream, args)


def _setup(kind, q, dims, total_q, cu_q, cu_k, stream, block_q, block_k, backend, deterministic, **options):
    """``api._setup`` with the longest sequences as the lengths (the options' window bound, the grid's tiles),
    the checked ``cu_seqlens`` (``cu_q``, ``cu_k``: (as given, checked host copy)) on the device, and the plan's
    ``Call`` marked packed (``total_q``)."""
    opts, call = api._setup(kind, q, dims, stream, block_q, block_k, backend, deterministic, **options)
    opts.cu_seqlens_q = _on_device(*cu_q, kind, q, stream)
    opts.cu_seqlens_k = _on_device(*cu_k, kind, q, stream)
    return opts, call._replace(total_q=total_q)


def _on_device(given, checked, kind, like, stream):
    """The kernels' int32 view of checked ``cu_seqlens``: the caller's own array where it is a contiguous device
    array of q's kind on q's device (a Numba array: on the current context's, as q) -- the values just checked,
    so a replay of the dispatch cache binds the new call's array -- else a copy of the checked host values,
    through PyTorch's caching allocator for PyTorch calls (no cudaMalloc / cudaFree per call), else Numba's.  A
    call with a copy is not recorded (the copy's address comes from no input or allocation the recorder knows)."""
    torch, cupy = _arrays.torch, _arrays.cupy
    if torch is not None and isinstance(given, torch.Tensor) and kind.lib == "torch":
        if given.is_cuda and given.is_contiguous() and given.device == like.device:
            return _arrays.to_device(given, stream)
        return _arrays.to_device(torch.from_numpy(checked).to(like.device, non_blocking=True), stream)
    if cupy is not None and isinstance(given, cupy.ndarray) and kind.lib == "cupy":
        if given.flags.c_contiguous and given.device.id == like.device.id:
            return _arrays.to_device(given, stream)
    if _arrays._is_numba_device_array(given) and kind.lib == "numba" and given.is_c_contiguous():
        return _arrays.to_device(given, stream)
    return _arrays.to_device(checked, stream)


def _refuse(dropout_p, attn_mask, attn_bias, block_mask):
    """The dense call's options that packed batches do not define (as ``reference.varlen``): ValueError."""
    for name, value in zip(_REFUSED, (attn_mask, attn_bias, block_mask)):
        if value is not None:
            raise ValueError(f"{name} is not defined for packed (varlen) batches")
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool) or dropout_p != 0:
        raise ValueError(f"dropout_p is not defined for packed (varlen) batches (pass 0.0), got {dropout_p!r}")


def check_packed(q, k, v):
    """Kinds, dtypes, shapes of packed q, k, v (``_options.check_qkv``'s rules, one dimension fewer):
    (kind, total_q, total_k, nheads, nheads_k, headdim)."""
    kinds = [_arrays.kind_of(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    for kd, n in zip(kinds[1:], ("k", "v")):
        if kd.lib != kinds[0].lib:
            raise TypeError(f"{n} is a {kd.lib} array but q is a {kinds[0].lib} array; pass one kind")
        if kd.dtype != kinds[0].dtype:
            raise TypeError(f"{n} has dtype {kd.dtype} but q has {kinds[0].dtype}; pass one dtype")
    if kinds[0].dtype not in _arrays.FLOAT_DTYPES:
        raise TypeError(f"q has dtype {kinds[0].dtype}; expected one of {', '.join(_arrays.FLOAT_DTYPES)}")
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        if len(x.shape) != 3:
            raise ValueError(f"{n} must have 3 dimensions (total_tokens, nheads, headdim) in a packed batch, "
                             f"got shape {tuple(x.shape)}")
    if len({_arrays.device_of(x) for x in (q, k, v)}) > 1:
        raise ValueError("q, k, v are on different devices")
    total_q, nheads, headdim = map(int, q.shape)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    total_k, nheads_k, dk = map(int, k.shape)
    if dk != headdim:
        raise ValueError(f"k has head dim {dk} but q has head dim {headdim}")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads of k ({nheads_k})")
    if not 1 <= headdim <= _options.MAX_HEAD_DIM:
        raise ValueError(f"head dim of q must be between 1 and {_options.MAX_HEAD_DIM}, got {headdim}")
    return kinds[0], total_q, total_k, nheads, nheads_k, headdim


def _gather_pages(k, v, block_table, cu_seqlens_k):
    """The packed ``(total_k, nheads_k, headdim)`` keys and values of paged ``k``, ``v`` ``(num_pages, page_size,
    nheads_k, headdim)`` through ``block_table`` (checked: int32, one row a sequence, every page a sequence
    touches inside the pool), in the arrays' own kind."""
    kind = _arrays.kind_of(k, "k")
    if kind.lib == "numba":
        raise ValueError("block_table in flash_attn_varlen_func gathers the pages with the arrays' library: pass "
                         "NumPy, PyTorch or CuPy arrays (or packed keys and values without block_table)")
    for x, name in ((k, "k"), (v, "v")):
        if len(x.shape) != 4:
            raise ValueError(f"with block_table, {name} must be pages (num_pages, page_size, nheads_k, headdim), "
                             f"got shape {tuple(x.shape)}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    num_pages, page = int(k.shape[0]), int(k.shape[1])
    table = _on_host(block_table, "block_table")
    cu = _on_host(cu_seqlens_k, "cu_seqlens_k")
    if table.dtype != np.int32 or cu.dtype != np.int32:
        raise TypeError(f"block_table and cu_seqlens_k must be int32, got {table.dtype} and {cu.dtype}")
    if table.ndim != 2 or cu.ndim != 1 or table.shape[0] != cu.shape[0] - 1:
        raise ValueError(f"block_table must have shape (batch, pages_per_sequence) with batch = "
                         f"len(cu_seqlens_k) - 1 = {cu.shape[0] - 1}, got {table.shape}")
    lengths = np.diff(cu.astype(np.int64))
    if np.any(lengths < 0) or (lengths.size and lengths.max() > page * table.shape[1]):
        raise ValueError(f"a sequence of cu_seqlens_k holds more keys than its {table.shape[1]} pages of {page} rows "
                         f"(or the lengths decrease): {_shown(cu)}")
    rows = []
    for b, n in enumerate(lengths):
        j = np.arange(n)
        pages = table[b, j // page].astype(np.int64)
        if n and (pages.min() < 0 or pages.max() >= num_pages):
            raise ValueError(f"block_table[{b}] names pages outside 0..{num_pages - 1} among the "
                             f"{-(-int(n) // page)} its {int(n)} keys touch")
        rows.append(pages * page + j % page)
    index = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    flat = (num_pages * page, int(k.shape[2]), int(k.shape[3]))
    if kind.lib == "torch":
        import torch
        index_t = torch.as_tensor(index, device=k.device)
        return tuple(x.reshape(flat).index_select(0, index_t) for x in (k, v))
    return tuple(x.reshape(flat)[index] for x in (k, v))      # NumPy, CuPy: fancy indexing copies


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    """The checked ``cu_seqlens_q``, ``cu_seqlens_k`` as host int32 arrays, before any launch: int32, 1-D, one
    batch for both, starting at 0, never decreasing, ending at the total rows, and ``max_seqlen_*`` an int at
    least every sequence's length.  Device arrays are copied to the host (once; they are small)."""
    cus = []
    for cu, name, total, max_len, max_name in ((cu_seqlens_q, "cu_seqlens_q", total_q, max_seqlen_q, "max_seqlen_q"),
                                               (cu_seqlens_k, "cu_seqlens_k", total_k, max_seqlen_k, "max_seqlen_k")):
        cu = _on_host(cu, name)
        if cu.dtype != np.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.ndim != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must have shape (batch + 1,), got {cu.shape}")
        lengths = np.diff(cu.astype(np.int64))
        if cu[0] != 0 or np.any(lengths < 0):
            raise ValueError(f"{name} must start at 0 and never decrease, got {_shown(cu)}")
        if cu[-1] != total:
            raise ValueError(f"{name}[-1] must be the total number of rows {total}, got {int(cu[-1])}")
        if not isinstance(max_len, numbers.Integral) or isinstance(max_len, bool):
            raise TypeError(f"{max_name} must be an int, got {type(max_len).__name__}")
        longest = int(lengths.max()) if lengths.size else 0
        if max_len < longest:
            raise ValueError(f"{max_name} = {max_len} is shorter than the longest sequence of {name} ({longest})")
        cus.append(np.ascontiguousarray(cu))
    if cus[0].shape != cus[1].shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe one batch, got {cus[0].shape[0] - 1} and "
                         f"{cus[1].shape[0] - 1} sequences")
    return cus


def _on_host(cu, name):
    """A host NumPy copy of ``cu`` (any supported array kind, a CPU torch tensor too)."""
    if isinstance(cu, np.ndarray):
        return cu
    torch = _arrays.torch
    if torch is not None and isinstance(cu, torch.Tensor):
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        return cu.detach().cpu().numpy()
    if _arrays.cupy is not None and isinstance(cu, _arrays.cupy.ndarray):
        return _arrays.cupy.asnumpy(cu)
    if _arrays._is_numba_device_array(cu):
        return cu.copy_to_host()
    if hasattr(cu, "__cuda_array_interface__"):
        return cuda.as_cuda_array(cu).copy_to_host()
    raise TypeError(f"{name} must be a NumPy, CuPy, PyTorch or Numba int32 array, got {type(cu).__name__}")


def _shown(cu):
    return cu.tolist() if cu.size <= 16 else f"{cu[:8].tolist()} ... ({cu.size} entries)"


def _rebatch(d, batch):
    """``_packed``'s view of a batch of one packed array: its batch axis ``batch`` long, stride 0."""
    return _arrays.strided_view(d, (batch,) + tuple(d.shape[1:]), (0,) + tuple(d.strides[1:]))


def _packed(d, batch):
    """The kernels' ``(batch, *d.shape)`` view of device array ``d`` with batch stride 0: every sequence's
    block sees the whole packed array and slices its own rows (``_tiles.sequence_span``)."""
    return _arrays.strided_view(d, (batch,) + tuple(d.shape), (0,) + tuple(d.strides))
