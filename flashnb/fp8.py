"""FP8 attention on Hopper: ``flash_attention_fp8``, FlashAttention-3's FP8 forward (issue 45).

    out = flashnb.flash_attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale, causal=True)

``q8``, ``k8``, ``v8`` hold e4m3 codes: PyTorch ``float8_e4m3fn`` CUDA tensors, or NumPy / CuPy / Numba ``uint8``
arrays (the codes as bytes), in flash-attn's layout (batch, seqlen, heads, headdim).  The values are
``codes * descale``, FA3's convention: each descaling factor is a positive float, or an array of shape (batch,
nheads_k) (one per batch and key/value head; a query head takes its key/value head's), or None (1).  Python and
NumPy descales are checked positive and finite; PyTorch descale tensors are not (that would wait for the GPU):
a zero, negative or non-finite one gives meaningless rows.  What is computed is
``reference.fp8.fp8_flash_forward``: attention of the dequantised inputs, with the probabilities quantised to
e4m3 for the ``P V`` product (their row sums from the unquantised ones).  The output is float16 or bfloat16
(``out_dtype``; PyTorch's default bfloat16, as FA3's, NumPy's float16).

``flash_attention_fp8_varlen`` takes a packed batch (flash-attn's varlen layout, ``cu_seqlens``), each sequence
attended on its own (``reference.fp8.fp8_flash_forward_varlen``).

Layers as in ``api``: validate on the host (``_check``) -> plan (``plan.fp8_forward``: the V^T pre-pass and the
forward, cached per shape) -> bind (word views of the codes, V^T's temporary, the tensor maps) -> launch.

For callers holding 16-bit or float32 tensors, ``quantize_fp8(x, per="tensor"|"head"|"block", rotation=None,
group=1, block=128)`` gives the codes and descales (amax -> 448; "block": FA3's block quantisation, for
``flash_attention_fp8``'s ``descale_block_q`` / ``descale_block_k``), and ``hadamard_rotation(headdim, seed)`` the
random orthogonal matrix of FA3's incoherent processing: pass the same one for q and k (``q K^T`` is unchanged),
none for v.  On Q and K with outlier channels it cuts the FP8 output's mean error about 3.5x (docs/notes/fp8.md step 3).
"""
import math
import threading

import numpy as np

from . import _arrays, _dispatch, plan, varlen
from .kernels._jit import launch
from .kernels.forward_fp8 import BLOCK_K, HEAD_DIMS, VT_KEYS, VT_TILE_KEYS, flat_words, vt_tile_keys
from .kernels._wgmma import e4m3_codes

try:  # optional: PyTorch tensors in and out
    import torch
except ImportError:  # pragma: no cover - torch is an optional extra
    torch = None

OUT_DTYPES = ("float16", "bfloat16")
E4M3_MAX = 448.0
_SCALAR_DESCALES = {}     # (value, device, context) -> its one-value float32 device array, kept for the process
_SCALAR_LOCK = threading.Lock()


def hadamard_rotation(headdim, seed=0):
    """A random orthogonal ``(headdim, headdim)`` float32 NumPy matrix: Sylvester's Hadamard matrix with random
    column signs (from ``seed``), divided by ``sqrt(headdim)``; ``headdim`` a power of two.  ``x @ R`` for q and k
    alike leaves ``q k^T`` as it was and spreads a channel's outliers over every channel."""
    if isinstance(headdim, bool) or not isinstance(headdim, (int, np.integer)) or headdim < 1 or headdim & (headdim - 1):
        raise ValueError(f"headdim must be a power of two, got {headdim!r}")
    h = np.ones((1, 1))
    while h.shape[0] < headdim:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], int(headdim))
    return (h * signs[None, :] / math.sqrt(headdim)).astype(np.float32)


def quantize_fp8(x, per="tensor", rotation=None, group=1, block=128):
    """``(codes, descale)`` with ``x ~ codes * descale`` (after ``x @ rotation`` if given), for
    ``flash_attention_fp8``: ``x`` (batch, seqlen, heads, headdim), a PyTorch tensor (codes ``float8_e4m3fn`` on its
    device, descale a float32 tensor) or a NumPy array (codes ``uint8``, descale a float or a float32 array).
    ``per="tensor"``: one descale, ``amax / 448``; ``"head"``: one per (batch, ``group`` consecutive heads), shape
    (batch, heads / group): for q, ``group = nheads / nheads_k`` gives the one descale per key/value head the
    kernel takes; ``"block"``: one per (batch, head, ``block`` rows), shape (batch, heads, ceil(seqlen / block)), for
    ``flash_attention_fp8``'s ``descale_block_q`` / ``descale_block_k`` (FA3's block quantisation: an outlier costs
    only its own block's precision).  The codes round to the nearest e4m3 value (ties to even); an all-zero slice
    gets descale 1."""
    is_torch = torch is not None and isinstance(x, torch.Tensor)
    if not is_torch and not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a PyTorch tensor or a NumPy array, got {type(x).__name__}")
    if per not in ("tensor", "head", "block"):
        raise ValueError(f"per must be 'tensor', 'head' or 'block', got {per!r}")
    if len(x.shape) != 4:
        raise ValueError(f"x must be 4-D (batch, seqlen, heads, headdim), got shape {tuple(x.shape)}")
    b, n, h, d = (int(s) for s in x.shape)
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1 or h % group:
        raise ValueError(f"group must be a positive int dividing the {h} heads, got {group!r}")
    if per == "block" and (isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1):
        raise ValueError(f"block must be a positive int, got {block!r}")
    if rotation is not None and tuple(rotation.shape) != (d, d):
        raise ValueError(f"rotation must be ({d}, {d}) for head dim {d}, got shape {tuple(rotation.shape)}")
    nb = -(-n // block) if per == "block" else 0
    if is_torch:
        x = x.float()
        if rotation is not None:
            x = x @ torch.as_tensor(rotation, dtype=torch.float32, device=x.device)
        if per == "block":
            padded = torch.zeros((b, nb * block, h, d), dtype=torch.float32, device=x.device)
            padded[:, :n] = x.abs()
            amax = padded.reshape(b, nb, block, h, d).amax(dim=(2, 4)).transpose(1, 2)      # (b, h, nb)
            descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
            rows = descale.repeat_interleave(block, 2)[:, :, :n].transpose(1, 2)[..., None]
            return (x / rows).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), descale.float()
        amax = x.abs().amax(dim=(1, 3)).reshape(b, h // group, group).amax(-1) if per == "head" else x.abs().amax()
        descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        scaled = x / (descale.repeat_interleave(group, 1)[:, None, :, None] if per == "head" else descale)
        return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), descale.float()
    x = np.asarray(x, np.float64)
    if rotation is not None:
        x = x @ np.asarray(rotation, np.float64)
    if per == "block":
        padded = np.zeros((b, nb * block, h, d))
        padded[:, :n] = np.abs(x)
        amax = padded.reshape(b, nb, block, h, d).max(axis=(2, 4), initial=0.0).transpose(0, 2, 1)
        descale = np.where(amax > 0, amax / E4M3_MAX, 1.0)
        rows = np.repeat(descale, block, 2)[:, :, :n].transpose(0, 2, 1)[..., None]
        return e4m3_codes(x / rows).astype(np.uint8), descale.astype(np.float32)
    amax = np.abs(x).max(axis=(1, 3)).reshape(b, h // group, group).max(-1) if per == "head" else np.abs(x).max()
    descale = np.where(amax > 0, amax / E4M3_MAX, 1.0)
    scaled = x / (np.repeat(descale, group, 1)[:, None, :, None] if per == "head" else descale)
    codes = e4m3_codes(scaled).astype(np.uint8)
    return codes, (descale.astype(np.float32) if per == "head" else float(descale))


def flash_attention_fp8(q, k, v, q_descale=None, k_descale=None, v_descale=None, *, causal=False,
                        softmax_scale=None, out_dtype=None, return_lse=False, stream=None, descale_block_q=None,
                        descale_block_k=None):
    """FP8 attention's forward: ``out`` (batch, seqlen_q, nheads, headdim) in ``out_dtype``, and with
    ``return_lse`` the log-sum-exp (batch, nheads, seqlen_q) in float32.

    ``causal`` is bottom-right aligned (flash-attn's); ``softmax_scale`` defaults to ``1 / sqrt(headdim)`` and must
    be positive; head dims 64, 128, 256; ``nheads`` a multiple of ``nheads_k`` (grouped-query attention).  Needs a
    Hopper GPU (compute capability 9.0), or Numba's simulator.

    Block quantisation (``quantize_fp8(x, per="block", block=...)``): ``descale_block_q`` rows a block of q, whose
    ``q_descale`` is then (batch, nheads, ceil(seqlen_q / descale_block_q)) (a query head's own), and
    ``descale_block_k`` rows a block of k and v, whose descales are (batch, nheads_k, ceil(seqlen_k /
    descale_block_k)); multiples of 128 (the kernel's tiles).  Either may be given alone (the other tensors' descales
    as above); the descales are then NumPy arrays or PyTorch tensors (or floats), and the call takes the full path.

    A call is replayed from the dispatch cache (``_dispatch``) when one with the same signature has run: PyTorch
    or Numba device arrays, descales floats, None or float32 device arrays, no ``stream``, no blocks."""
    if descale_block_q is not None or descale_block_k is not None:
        return _full_forward(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, out_dtype, return_lse,
                             stream, blocks=(descale_block_q, descale_block_k))
    descales = (q_descale, k_descale, v_descale)
    held = tuple(d if _is_array(d) else None for d in descales)
    values = tuple(None if _is_array(d) else d for d in descales)
    return _dispatch.cached_call(
        "fp8_forward", (q, k, v) + held, values + (causal, softmax_scale, str(out_dtype), return_lse),
        _full_forward, cacheable=stream is None,
        args=(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, out_dtype, return_lse, stream))


def _is_array(d):
    return d is not None and not isinstance(d, (int, float, np.integer, np.floating))


def _full_forward(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, out_dtype, return_lse, stream,
                  blocks=None):
    """``flash_attention_fp8``'s full path: validate, plan, bind, launch.  ``blocks``: (descale_block_q,
    descale_block_k), block quantisation."""
    kind, dims = _check(q, k, v, softmax_scale)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = dims
    if blocks is not None:
        _check_blocks(blocks)
    out_dtype, scale = _settings(kind, headdim, softmax_scale, out_dtype, q_descale, k_descale)
    launch_stream = _arrays.resolve_stream(stream, kind, q)
    with _arrays.stream_scope(launch_stream, kind, q):
        if blocks is None:
            descale = [_descale(d, name, kind, q, batch, nheads_k, launch_stream)
                       for d, name in zip((q_descale, k_descale, v_descale), ("q_descale", "k_descale", "v_descale"))]
        else:
            descale = _block_descales(blocks, (q_descale, k_descale, v_descale), kind, q, dims, scale, launch_stream)
        out, out_d = _arrays.empty_like_kind(kind, (batch, seqlen_q, nheads, headdim), out_dtype, q, launch_stream,
                                             bits=True)
        lse, lse_d = _arrays.empty_like_kind(kind, (batch, nheads, seqlen_q), "float32", q, launch_stream)
        if batch and seqlen_q and nheads:
            p = plan.fp8_forward(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, bool(causal), out_dtype,
                                 blocks is not None)
            qw, kw, vb = (_codes(x, name, launch_stream) for x, name in ((q, "q"), (k, "k"), (v, "v")))
            vt_w = _transposed_v(p, vb, kind, q, launch_stream)
            args = p.forward_args(qw, kw, vt_w, _arrays.word_view(out_d), lse_d, *descale,
                                  nheads // nheads_k, seqlen_k - seqlen_q, scale, launch_stream.handle)
            _run(p.forward, launch_stream, args)
    out = _arrays.finish(kind, out, out_d, launch_stream)
    if return_lse:
        return out, _arrays.finish(kind, lse, lse_d, launch_stream)
    return out


def flash_attention_fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale=None,
                               k_descale=None, v_descale=None, *, causal=False, softmax_scale=None, out_dtype=None,
                               return_lse=False, stream=None):
    """``flash_attention_fp8`` of a packed batch: ``q`` (total_q, nheads, headdim), ``k``, ``v`` (total_k, nheads_k,
    headdim) e4m3 codes; sequence ``b`` is rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of q (``cu_seqlens_k``
    of k, v; int32 ``(batch + 1,)`` arrays of any kind, checked on the host as ``flash_attn_varlen_func``'s);
    ``max_seqlen_*`` ints at least every sequence's length; descales as ``flash_attention_fp8``'s with ``batch``
    the sequences; ``causal`` aligned to each sequence's bottom-right corner.  Returns ``out`` (total_q, nheads,
    headdim), and with ``return_lse`` the log-sum-exp (nheads, total_q) float32; a sequence's query with no key
    gives 0 and -inf.  Not replayed by the dispatch cache (every call takes the full path)."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if len(getattr(x, "shape", ())) != 3:
            raise ValueError(f"{name} must be 3-D (total, heads, headdim) for a packed batch, got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
    if tuple(k.shape) != tuple(v.shape) or int(k.shape[2]) != int(q.shape[2]):
        raise ValueError(f"k and v must be (total_k, nheads_k, headdim) with q's headdim {int(q.shape[2])}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    q4, k4, v4 = (x[None] for x in (q, k, v))
    kind, dims = _check(q4, k4, v4, softmax_scale)
    _, total_q, total_k, nheads, nheads_k, headdim = dims
    cu_q, cu_k = varlen.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k)
    out_dtype, scale = _settings(kind, headdim, softmax_scale, out_dtype, q_descale, k_descale)
    launch_stream = _arrays.resolve_stream(stream, kind, q)
    with _arrays.stream_scope(launch_stream, kind, q):
        return _packed_forward(kind, q, q4, k4, v4, cu_q, cu_k, _tiles_of(np.diff(cu_k.astype(np.int64))),
                               int(max_seqlen_q), (q_descale, k_descale, v_descale), nheads, nheads_k, headdim,
                               causal, out_dtype, scale, return_lse, launch_stream,
                               lambda: (varlen._on_device(cu_seqlens_q, cu_q, kind, q, launch_stream),
                                        varlen._on_device(cu_seqlens_k, cu_k, kind, q, launch_stream)))


def flash_attn_with_kvcache_fp8(q, k_cache, v_cache, cache_seqlens, k=None, v=None, q_descale=None,
                                k_descale=None, v_descale=None, *, causal=False, softmax_scale=None, out_dtype=None,
                                return_lse=False, stream=None):
    """FP8 attention over a dense KV cache of e4m3 codes (chunked prefill, or decoding): ``q`` (batch, seqlen_q,
    nheads, headdim), ``k_cache``, ``v_cache`` (batch, capacity, nheads_k, headdim), ``cache_seqlens`` an int or an
    int32 ``(batch,)`` array of any kind (read on the host) of the rows each sequence holds; ``k``, ``v`` (batch,
    seqlen_new, nheads_k, headdim) codes, if given, are written into the caches at rows ``cache_seqlens[b] ..``
    first (in place, as ``flash_attn_with_kvcache``'s append), and sequence ``b`` attends to its first
    ``cache_seqlens[b] + seqlen_new`` rows; ``causal`` aligned to that bottom-right corner.  Descales as
    ``flash_attention_fp8``'s (per tensor or ``(batch, nheads_k)``; the caches' own descales: the new rows must be
    quantised with them).  Returns ``out`` (batch, seqlen_q, nheads, headdim) and with ``return_lse`` the
    log-sum-exp (batch, nheads, seqlen_q).  Oracle: ``reference.fp8.fp8_flash_forward_kvcache``.

    It runs ``flash_attention_fp8_varlen``'s kernels: the cache is a packed batch of 2 * batch sequences, sequence
    ``b``'s rows then the unused rest of its cache as one with no query (its blocks return at once, and it gets no
    V^T columns; a sequence's last key tile reads up to 127 rows past its keys, masked), so each call transposes the
    used rows of V (as the dense call does all of V).  ``cache_seqlens`` and descale arrays are read on the host
    (a synchronisation a call)."""
    for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if len(getattr(x, "shape", ())) != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, headdim), got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    batch, seqlen_q, nheads, headdim = (int(n) for n in q.shape)
    _, capacity, nheads_k, _ = (int(n) for n in k_cache.shape)
    if int(k_cache.shape[0]) != batch:
        raise ValueError(f"k_cache must have q's batch {batch}, got {int(k_cache.shape[0])}")
    kind, _ = _check(q, k_cache, v_cache, softmax_scale)
    if (k is None) != (v is None):
        raise ValueError("k and v come together (the new rows of both caches) or not at all")
    seqlen_new = 0
    if k is not None:
        for x, name in ((k, "k"), (v, "v")):
            if _arrays.kind_of(x, name).lib != kind.lib:
                raise TypeError(f"{name} must be of the caches' library ({kind.lib}), got {_arrays.kind_of(x, name).lib}")
        if tuple(k.shape) != tuple(v.shape) or len(k.shape) != 4 or (int(k.shape[0]), int(k.shape[2]),
                                                                    int(k.shape[3])) != (batch, nheads_k, headdim):
            raise ValueError(f"k and v must be (batch, seqlen_new, nheads_k, headdim) = ({batch}, ., {nheads_k}, "
                             f"{headdim}), got {tuple(k.shape)} and {tuple(v.shape)}")
        _check(k, k, v, softmax_scale)
        seqlen_new = int(k.shape[1])
    if batch * capacity >= 2 ** 31 or batch * seqlen_q >= 2 ** 31:
        raise ValueError(f"the caches' {batch * capacity} rows (or q's {batch * seqlen_q}) exceed the kernels' int32 "
                         "row offsets")
    lengths = _host_seqlens(cache_seqlens, batch)
    if np.any(lengths < 0) or np.any(lengths + seqlen_new > capacity):
        raise ValueError(f"cache_seqlens must be in [0, {capacity - seqlen_new}] (the capacity {capacity} less the "
                         f"{seqlen_new} new rows), got {lengths.tolist()}")
    out_dtype, scale = _settings(kind, headdim, softmax_scale, out_dtype, q_descale, k_descale)
    pairs = [_descale_pairs(d, name, kind, q, batch, nheads_k)
             for d, name in zip((q_descale, k_descale, v_descale), ("q_descale", "k_descale", "v_descale"))]
    q4, k4, v4 = (_flat(x, name) for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")))
    launch_stream = _arrays.resolve_stream(stream, kind, q)
    with _arrays.stream_scope(launch_stream, kind, q):
        if kind.lib in ("cupy", "numba"):               # (their rows' alignment, refused before the append)
            for x, name in ((q4, "q"), (k4, "k")):
                _codes(x, name, launch_stream)
        if seqlen_new:
            _append(k_cache, v_cache, k, v, lengths)
        used = lengths + seqlen_new
        ends = np.arange(1, batch + 1, dtype=np.int64) * capacity
        cu_k = np.stack([ends - capacity + used, ends], axis=1).reshape(-1)        # each sequence, then its rest
        cu_k = np.concatenate([[0], cu_k]).astype(np.int32)
        cu_q = np.concatenate([[0], np.repeat(np.arange(1, batch + 1) * seqlen_q, 2)]).astype(np.int32)
        tiles = np.stack([_tiles_of(used), np.zeros(batch, np.int64)], axis=1).reshape(-1)
        result = _packed_forward(kind, q, q4, k4, v4, cu_q, cu_k, tiles, seqlen_q, pairs, nheads, nheads_k, headdim,
                                 causal, out_dtype, scale, return_lse, launch_stream,
                                 lambda: tuple(_host_int32(c, kind, q, launch_stream) for c in (cu_q, cu_k)))
    out, lse = result if return_lse else (result, None)
    out = out.reshape(batch, seqlen_q, nheads, headdim)
    if not return_lse:
        return out
    return out, _batch_first(lse, nheads, batch, seqlen_q)


def _batch_first(lse, nheads, batch, seqlen_q):
    """The packed call's ``lse`` (nheads, batch * seqlen_q) as a contiguous (batch, nheads, seqlen_q) array of its
    kind."""
    if torch is not None and isinstance(lse, torch.Tensor):
        return lse.reshape(nheads, batch, seqlen_q).permute(1, 0, 2).contiguous()
    if isinstance(lse, np.ndarray):
        return np.ascontiguousarray(lse.reshape(nheads, batch, seqlen_q).transpose(1, 0, 2))
    if _arrays.cupy is not None and isinstance(lse, _arrays.cupy.ndarray):
        return _arrays.cupy.ascontiguousarray(lse.reshape(nheads, batch, seqlen_q).transpose(1, 0, 2))
    from numba import cuda                                  # a Numba device array: through the host (it is small)
    host = lse.copy_to_host().reshape(nheads, batch, seqlen_q).transpose(1, 0, 2)
    return cuda.to_device(np.ascontiguousarray(host))


def _host_seqlens(cache_seqlens, batch):
    """``cache_seqlens`` (an int, or an int32 ``(batch,)`` array of any kind) as a host int64 array."""
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, (bool, np.bool_)):
        return np.full(batch, int(cache_seqlens), np.int64)
    host = varlen._on_host(cache_seqlens, "cache_seqlens")
    if host.dtype != np.int32 or tuple(host.shape) != (batch,):
        raise ValueError(f"cache_seqlens must be an int or an int32 array of shape ({batch},), got {host.dtype} "
                         f"{tuple(host.shape)}")
    return host.astype(np.int64)


def _descale_pairs(d, name, kind, q, batch, nheads_k):
    """A descale of the KV-cache call as the packed call of 2 * batch sequences takes it, checked before the
    append: a value as it is, a ``(batch, nheads_k)`` array read on the host with each row twice (the second of a
    pair is the rest of a cache, which has no query)."""
    if not _is_array(d) or (isinstance(d, np.ndarray) and d.size == 1):
        _scalar(d, name)
        return d
    if torch is not None and isinstance(d, torch.Tensor):
        host = d.detach().float().cpu().numpy()
    elif hasattr(d, "copy_to_host"):
        host = d.copy_to_host()
    elif _arrays.cupy is not None and isinstance(d, _arrays.cupy.ndarray):
        host = _arrays.cupy.asnumpy(d)
    elif isinstance(d, np.ndarray):
        host = d
    else:
        raise TypeError(f"{name} must be a float, None, or a (batch, nheads_k) NumPy, PyTorch, CuPy or Numba array, "
                        f"got {type(d).__name__}")
    if host.size == 1:
        return _scalar(float(host.reshape(())), name)
    host = np.asarray(host, np.float32)
    if host.shape != (batch, nheads_k):
        raise ValueError(f"{name} must be a float or an array of shape (batch, nheads_k) = ({batch}, {nheads_k}), "
                         f"got shape {host.shape}")
    if not (np.all(np.isfinite(host)) and np.all(host > 0)):
        raise ValueError(f"{name} must be positive and finite in float32")
    return np.repeat(host, 2, axis=0)


def _append(k_cache, v_cache, k, v, lengths):
    """The new rows into the caches at each sequence's ``lengths[b]``, by the arrays' own slice copies."""
    for b, n in enumerate(lengths.tolist()):
        for cache, new in ((k_cache, k), (v_cache, v)):
            rows = slice(n, n + int(new.shape[1]))
            if torch is not None and isinstance(cache, torch.Tensor):
                cache[b, rows].copy_(new[b])
            elif hasattr(cache, "copy_to_device"):                    # Numba device arrays
                cache[b, rows].copy_to_device(new[b])
            else:
                cache[b, rows] = new[b]


def _flat(x, name):
    """``x`` (batch, rows, heads, headdim) as one packed batch row (1, batch * rows, heads, headdim), a view."""
    shape = (1, int(x.shape[0]) * int(x.shape[1])) + tuple(int(n) for n in x.shape[2:])
    try:
        return x.reshape(shape)
    except Exception as e:                    # noqa: BLE001 (a Numba device array that is not contiguous)
        raise ValueError(f"{name} must be contiguous (its rows one packed batch), got strides "
                         f"{tuple(getattr(x, 'strides', ()))}") from e


def _tiles_of(lengths):
    """Each sequence's V^T columns in a packed call: its keys in whole key tiles (``vt_tile_keys``)."""
    return vt_tile_keys(np.asarray(lengths, np.int64))


def _packed_forward(kind, q, q4, k4, v4, cu_q, cu_k, tiles, max_seqlen_q, descales, nheads, nheads_k, headdim, causal,
                    out_dtype, scale, return_lse, launch_stream, cu_on_device):
    """The packed FP8 forward of checked arrays (``flash_attention_fp8_varlen``'s and
    ``flash_attn_with_kvcache_fp8``'s): ``q4``, ``k4``, ``v4`` one batch row of packed rows, ``cu_q``, ``cu_k`` the
    host int32 offsets, ``tiles`` each sequence's V^T columns, ``cu_on_device()`` the offsets on the device.
    Returns ``out`` (total_q, nheads, headdim) and with ``return_lse`` ``lse`` (nheads, total_q)."""
    batch = cu_q.shape[0] - 1
    total_q = int(q4.shape[1])
    vt_start = np.concatenate([[0], np.cumsum(tiles)]).astype(np.int32)
    group_seq = np.repeat(np.arange(batch, dtype=np.int32), tiles // VT_KEYS)
    descale = [_descale(d, name, kind, q4, batch, nheads_k, launch_stream)
               for d, name in zip(descales, ("q_descale", "k_descale", "v_descale"))]
    out, out_d = _arrays.empty_like_kind(kind, (total_q, nheads, headdim), out_dtype, q, launch_stream, bits=True)
    lse, lse_d = _arrays.empty_like_kind(kind, (nheads, total_q), "float32", q, launch_stream)
    if total_q and nheads:
        p = plan.fp8_forward_packed(batch, max_seqlen_q, group_seq.shape[0], nheads, nheads_k, headdim, bool(causal),
                                    out_dtype)
        qw, kw, vb = (_codes(x, name, launch_stream) for x, name in ((q4, "q"), (k4, "k"), (v4, "v")))
        cu_q_d, cu_k_d = cu_on_device()
        vt_start_d, group_d = (_host_int32(a, kind, q, launch_stream) for a in (vt_start, group_seq))
        cols = max(int(vt_start[-1]), BLOCK_K)                # (no key at all: one tile of zeros, never read)
        vt = _arrays.scratch((1, nheads_k, headdim, cols), np.uint8, kind, q, launch_stream)
        st = vt.strides
        vt = _arrays.strided_view(vt, (1, headdim, nheads_k, cols), (st[0], st[2], st[1], st[3]))
        if group_seq.shape[0]:
            vw = _arrays.word_view(vb)
            if vw is not None:
                _run(p.prepare_words, launch_stream, _packed_words_args(vw, _arrays.word_view(vt), cu_k_d, vt_start_d,
                                                                        group_d))
            else:
                _run(p.prepare, launch_stream, (vb, vt, cu_k_d, vt_start_d, group_d))
        out_w = _arrays.word_view(_arrays.strided_view(out_d, (1,) + tuple(out_d.shape),
                                                       (0,) + tuple(out_d.strides)))
        lse_v = _arrays.strided_view(lse_d, (1,) + tuple(lse_d.shape), (0,) + tuple(lse_d.strides))
        args = p.forward_args(qw, kw, _arrays.word_view(vt), out_w, lse_v, *descale, nheads // nheads_k, 0,
                              scale, launch_stream.handle, packed=(cu_q_d, cu_k_d, vt_start_d))
        _run(p.forward, launch_stream, args)
    out = _arrays.finish(kind, out, out_d, launch_stream)
    if return_lse:
        return out, _arrays.finish(kind, lse, lse_d, launch_stream)
    return out


def _settings(kind, headdim, softmax_scale, out_dtype, q_descale, k_descale):
    """``(out_dtype, softmax_scale)`` of a checked call, before any launch: this device can run the FP8 forward,
    and the exponent scale is positive and finite (``_check_exponent_scale``)."""
    out_dtype = _out_dtype(out_dtype, kind)
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    refusal = plan.fp8_refusal()
    if refusal is not None:
        raise ValueError(refusal)
    _check_exponent_scale(scale, q_descale, k_descale)
    return out_dtype, scale


def _check_exponent_scale(scale, q_descale, k_descale):
    """With float descales: ``softmax_scale * q_descale * k_descale``, the kernel's exponent scale, positive and
    finite in float32 (a descale array is checked where it is bound)."""
    if not (_is_array(q_descale) or _is_array(k_descale)):
        c = np.float32(scale) * np.float32(_scalar(q_descale, "q_descale")) * np.float32(
            _scalar(k_descale, "k_descale"))
        if not (np.isfinite(c) and c > 0):
            raise ValueError(f"softmax_scale * q_descale * k_descale must be positive and finite in float32, got {c}")


def _host_int32(a, kind, like, stream):
    """A small host int32 array on ``like``'s device: through PyTorch's caching allocator for PyTorch calls (no
    cudaMalloc / cudaFree a call), else Numba's."""
    if kind.lib == "torch":
        return _arrays.to_device(torch.from_numpy(a).to(like.device), stream)
    return _arrays.to_device(a, stream)


def _check(q, k, v, softmax_scale):
    """The call's kind and dims (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim); TypeError / ValueError
    naming the argument."""
    kinds = [_arrays.kind_of(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
    for x, kd, name in zip((q, k, v), kinds, ("q", "k", "v")):
        if kd.dtype not in ("float8_e4m3fn", "uint8") or (kd.lib == "torch") != (kd.dtype == "float8_e4m3fn"):
            raise TypeError(f"{name} must hold e4m3 codes: a torch.float8_e4m3fn CUDA tensor, or a uint8 NumPy, "
                            f"CuPy or Numba array; got {kd.lib} {kd.dtype}")
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, headdim), got shape {tuple(x.shape)}")
    if len({kd.lib == "torch" for kd in kinds}) > 1:
        raise TypeError(f"q, k and v must all be PyTorch tensors or all be arrays, got {[kd.lib for kd in kinds]}")
    _arrays.check_device(q, "q")
    for x, name in ((k, "k"), (v, "v")):
        _arrays.check_same_device(x, name, q)
    batch, seqlen_q, nheads, headdim = (int(n) for n in q.shape)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if int(k.shape[0]) != batch or int(k.shape[3]) != headdim:
        raise ValueError(f"k must be (batch, seqlen_k, nheads_k, headdim) with q's batch {batch} and headdim "
                         f"{headdim}, got {tuple(k.shape)}")
    nheads_k = int(k.shape[2])
    if nheads_k < 1 or nheads % nheads_k:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of k's nheads_k ({nheads_k})")
    if headdim not in HEAD_DIMS:
        raise ValueError(f"headdim must be one of {HEAD_DIMS} for the FP8 forward, got {headdim}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and not isinstance(
            softmax_scale, bool) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None, got {softmax_scale!r}")
    return kinds[0], (batch, seqlen_q, int(k.shape[1]), nheads, nheads_k, headdim)


def _out_dtype(out_dtype, kind):
    if out_dtype is None:
        return "bfloat16" if kind.lib == "torch" else "float16"
    if torch is not None and isinstance(out_dtype, torch.dtype):
        out_dtype = str(out_dtype).replace("torch.", "")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be float16 or bfloat16, got {out_dtype!r}")
    if out_dtype == "bfloat16" and kind.lib != "torch":
        raise TypeError("out_dtype bfloat16 needs PyTorch tensors (NumPy and CuPy have no bfloat16)")
    return out_dtype


def _descale(d, name, kind, q, batch, nheads_k, stream):
    """A descaling factor as the kernel reads it: a (batch, nheads_k) float32 device view (a stride-0 one for a
    single value), of the caller's tensor where it is float32 on q's device, else of a copy; a float's (or None's)
    one-value device array is kept for the process (a replay of the dispatch cache launches with it)."""
    if torch is not None and isinstance(d, torch.Tensor):
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"{name} is a PyTorch tensor but q is not: pass a float or an array of q's library")
        if d.device != q.device or tuple(d.shape) not in ((), (1,), (batch, nheads_k)):
            raise ValueError(f"{name} must be a float or a tensor of shape (batch, nheads_k) = ({batch}, {nheads_k}) "
                             f"on q's device, got shape {tuple(d.shape)} on {d.device}")
        dev = _arrays.to_device(d.to(torch.float32), stream)
    elif isinstance(d, np.ndarray) and d.size != 1:
        if d.shape != (batch, nheads_k):
            raise ValueError(f"{name} must be a float or an array of shape (batch, nheads_k) = ({batch}, "
                             f"{nheads_k}), got shape {d.shape}")
        d32 = np.ascontiguousarray(d, np.float32)
        if not (np.all(np.isfinite(d32)) and np.all(d32 > 0)):
            raise ValueError(f"{name} must be positive and finite in float32")
        dev = _arrays.to_device(d32, stream)
    elif _arrays._is_numba_device_array(d) or hasattr(d, "__cuda_array_interface__"):   # CuPy, Numba
        if np.dtype(d.dtype) != np.float32 or tuple(d.shape) not in ((), (1,), (batch, nheads_k)):
            raise ValueError(f"{name} must be a float32 device array of shape (batch, nheads_k) = ({batch}, "
                             f"{nheads_k}) or one value, got {np.dtype(d.dtype)} {tuple(d.shape)}")
        _arrays.check_same_device(d, name, q)
        dev = _arrays.to_device(d, stream)
    elif _is_array(d) and not isinstance(d, (np.ndarray, np.generic)):
        raise TypeError(f"{name} must be a float, None, a (batch, nheads_k) array or PyTorch tensor, got "
                        f"{type(d).__name__}")
    else:
        dev = _one_value(_scalar(d, name), q, stream)
    if tuple(dev.shape) != (batch, nheads_k):                         # one value for every (batch, key head)
        dev = _arrays.strided_view(dev, (batch, nheads_k), (0, 0))
    return _arrays.any_layout(dev)


def _check_blocks(blocks):
    for name, block in zip(("descale_block_q", "descale_block_k"), blocks):
        if block is not None and (isinstance(block, (bool, np.bool_)) or not isinstance(block, (int, np.integer))
                                  or block < BLOCK_K or block % BLOCK_K):
            raise ValueError(f"{name} must be None or a positive multiple of {BLOCK_K} (the kernel's tiles), got "
                             f"{block!r}")


def _block_descales(blocks, descales, kind, q, dims, scale, stream):
    """A block-quantised call's descales as the kernel reads them (``make_forward_fp8(BLOCKS=True)``), checked
    before any launch: q's per (batch, nheads, query tile), k's and v's per (batch, nheads_k, key tile), float32
    on q's device; a descale without blocks (a float, None, or (batch, nheads_k)) repeated over them.  Host values
    (floats, NumPy) are checked positive and finite, and so is the kernel's exponent scale ``scale q_descale
    k_descale`` at their extremes, in float32."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, _ = dims
    is_torch_q = torch is not None and isinstance(q, torch.Tensor)
    n_qt, n_kt = -(-seqlen_q // BLOCK_K), -(-seqlen_k // BLOCK_K)        # (BLOCK_Q = BLOCK_K = 128)
    n_kt = max(n_kt, 1)          # (with no key the kernel still reads tile 0's V descale; its rows give 0)
    out, host = [], {}
    for d, name, block, heads, tiles, seqlen in (
            (descales[0], "q_descale", blocks[0], nheads, n_qt, seqlen_q),
            (descales[1], "k_descale", blocks[1], nheads_k, n_kt, seqlen_k),
            (descales[2], "v_descale", blocks[1], nheads_k, n_kt, seqlen_k)):
        is_torch = torch is not None and isinstance(d, torch.Tensor)
        if is_torch and not is_torch_q:
            raise TypeError(f"{name} is a PyTorch tensor but q is not: pass a float or a NumPy array")
        if _is_array(d) and not (is_torch or isinstance(d, (np.ndarray, np.generic))):
            raise TypeError(f"{name}: a call with descale blocks takes floats, NumPy arrays or PyTorch tensors, got "
                            f"{type(d).__name__}")
        if block is None and (is_torch or isinstance(d, np.ndarray)) and tuple(d.shape) not in ((), (1,)):
            if tuple(d.shape) != (batch, nheads_k):
                raise ValueError(f"{name} must be a float or of shape (batch, nheads_k) = ({batch}, {nheads_k}), "
                                 f"got shape {tuple(d.shape)}")
            per = _repeat(d[:, :, None], heads // nheads_k, 1)            # (batch, heads, 1)
            per = _repeat(per, tiles, 2)
        elif block is None and is_torch:                                  # one value, on the device
            per = d.reshape(1, 1, 1).expand(batch, heads, tiles)
        elif block is None:
            per = np.full((batch, heads, tiles), _scalar(d, name), np.float32)
        else:
            nb = -(-seqlen // block)
            if not (is_torch or isinstance(d, np.ndarray)) or tuple(d.shape) != (batch, heads, nb):
                what = "nheads" if name == "q_descale" else "nheads_k"
                raise ValueError(f"{name} with blocks of {block} rows must be an array of shape (batch, {what}, "
                                 f"ceil(seqlen / {block})) = ({batch}, {heads}, {nb}), got "
                                 f"{type(d).__name__} {tuple(getattr(d, 'shape', ()))}")
            per = _repeat(d, block // BLOCK_K, 2)[:, :, :tiles]
            if per.shape[2] < tiles:                                      # no key: one value, unread
                per = torch.ones((batch, heads, 1), device=d.device) if is_torch else np.ones((batch, heads, 1))
        if is_torch:
            if per.device != q.device:
                raise ValueError(f"{name} must be on q's device {q.device}, got {per.device}")
            dev = per.to(torch.float32).contiguous()
        else:
            dev = np.ascontiguousarray(per, np.float32)
            if not (np.all(np.isfinite(dev)) and np.all(dev > 0)):
                raise ValueError(f"{name} must be positive and finite in float32")
            host[name] = dev
            if is_torch_q:
                dev = torch.from_numpy(dev).to(q.device)
        out.append(_arrays.any_layout(_arrays.to_device(dev, stream)))
    qd, kd = host.get("q_descale"), host.get("k_descale")     # (a PyTorch tensor's values stay on the device)
    if qd is not None and kd is not None and qd.size:
        with np.errstate(over="ignore", under="ignore"):
            extremes = (np.float32(scale) * qd.min() * kd.min(), np.float32(scale) * qd.max() * kd.max())
        for c in extremes:
            if not (np.isfinite(c) and c > 0):
                raise ValueError(f"softmax_scale * q_descale * k_descale must be positive and finite in float32, "
                                 f"got {c} at the descales' extremes")
    return out


def _repeat(x, n, axis):
    """Each entry of ``x`` ``n`` times along ``axis`` (NumPy or PyTorch)."""
    if torch is not None and isinstance(x, torch.Tensor):
        return x.repeat_interleave(n, axis)
    return np.repeat(np.asarray(x), n, axis)


def _one_value(value, q, stream):
    """A one-value float32 device array of ``value`` on q's device, kept for the process (a replay of the dispatch
    cache launches with it; 256 values at most, past them a fresh one each call, which leaves the call out of the
    cache: its address is never a constant's)."""
    key = (value, _arrays.device_of(q), None if _arrays.SIMULATOR else _arrays.current_context())
    arr = _SCALAR_DESCALES.get(key)
    if arr is not None:
        return arr
    arr = _arrays.to_device(np.array([value], np.float32), stream)
    with _SCALAR_LOCK:
        if len(_SCALAR_DESCALES) >= 256:
            _dispatch.unfit()
            return arr
        kept = _SCALAR_DESCALES.setdefault(key, arr)     # (another thread's, if it got there first)
        if kept is arr:
            stream.numba.synchronize()   # (once a value: a later call on another stream reads it landed)
            _dispatch.CONSTANT_PTRS.add(_dispatch._ptr(arr))
    return kept


def _scalar(d, name):
    if d is None:
        return 1.0
    if isinstance(d, np.ndarray) and d.size == 1:
        d = d.reshape(()).item()
    if (isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, float, np.integer, np.floating))
            or not math.isfinite(d) or d <= 0):
        raise ValueError(f"{name} must be a positive finite float, an array of shape (batch, nheads_k), or None; "
                         f"got {d!r}")
    if not (np.isfinite(np.float32(d)) and np.float32(d) > 0):
        raise ValueError(f"{name} must be positive and finite in float32 (the kernel's), got {d!r}")
    return float(d)


def _codes(x, name, stream):
    """The kernels' byte view of ``x``'s codes; for q and k (read by the copy engine in 16-byte-aligned rows) its
    word view, from a fresh copy where a PyTorch tensor's rows are not aligned.  v is read by the V^T pre-pass,
    four bytes at a time where it has a word view, else byte by byte (any strides)."""
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.view(torch.uint8)
        d = _arrays.to_device(x, stream)
        if name != "v" and not _aligned(d):
            d = _arrays.to_device(x.clone(memory_format=torch.contiguous_format), stream)
    else:
        d = _arrays.to_device(x, stream)
    if name == "v":
        return d
    if not _aligned(d):
        raise ValueError(f"{name}'s rows must start on 16-byte boundaries (a contiguous last axis, strides and "
                         f"address multiples of 16 bytes)")
    return _arrays.word_view(d)


def _aligned(d):
    return _arrays.word_view(d) is not None and _arrays.rows_aligned16(d)


def _transposed_v(p, vb, kind, like, stream):
    """V^T's word view (batch, headdim, nheads_k, keys / 4), made by the pre-pass from ``vb`` (v's bytes): four bytes
    at a time where v has a word view (``plan.FP8Plan.prepare_words``), else byte by byte (any strides)."""
    batch, _, nheads_k, headdim = vb.shape
    vt = _arrays.scratch((batch, nheads_k, headdim, p.vt_keys), np.uint8, kind, like, stream)
    s = vt.strides
    vt = _arrays.strided_view(vt, (batch, headdim, nheads_k, p.vt_keys), (s[0], s[2], s[1], s[3]))
    vw = _arrays.word_view(vb) if p.prepare_words is not None else None
    if vw is not None:
        vt_w = _arrays.word_view(vt)
        _run(p.prepare_words, stream, _words_prepass_args(vw, vt_w))
        return vt_w
    _run(p.prepare, stream, (vb, vt))
    return _arrays.word_view(vt)


def _words_prepass_args(vw, vt_w):
    """``make_prepare_vt_words``' arguments: flat word views of v's words ``vw`` (batch, seqlen_k, nheads_k, headdim
    / 4) and of V^T's ``vt_w`` (batch, headdim, nheads_k, keys / 4), the sizes, and their strides in words."""
    batch, seqlen_k, nheads_k, _ = vw.shape
    (v_span, v_st), (vt_span, vt_st) = (flat_words(x.shape, x.strides) for x in (vw, vt_w))
    tiles = -(-4 * vt_w.shape[3] // VT_TILE_KEYS)
    return (_arrays.strided_view(vw, (v_span,), (4,)), _arrays.strided_view(vt_w, (vt_span,), (4,)), seqlen_k,
            nheads_k, tiles, v_st[0], v_st[1], v_st[2], vt_st[0], vt_st[1], vt_st[2], vt_w.shape[3])


def _packed_words_args(vw, vt_w, cu_k, vt_start, group_seq):
    """``make_prepare_vt_packed_words``' arguments: flat word views of v's words ``vw`` (1, total_k, nheads_k,
    headdim / 4) and of V^T's ``vt_w`` (1, headdim, nheads_k, columns / 4), the device offsets, the column tiles and
    the strides in words."""
    (v_span, v_st), (vt_span, vt_st) = (flat_words(x.shape, x.strides) for x in (vw, vt_w))
    return (_arrays.strided_view(vw, (v_span,), (4,)), _arrays.strided_view(vt_w, (vt_span,), (4,)), cu_k, vt_start,
            group_seq, group_seq.shape[0] // 4, v_st[1], v_st[2], vt_st[1], vt_st[2])


def _run(step, stream, args):
    launch(step.kernel, step.grid, step.threads, stream, step.shared, args)
