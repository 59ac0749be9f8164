"""``flash_attn_with_kvcache``: attention of new query tokens over a KV cache, with the cache append, dense or
paged caches and split-KV decoding (flash-decoding), following flash-attn's function of the same name.

Layers as in ``api``: validate everything on the host (``_check``) -> plan (``plan.decode_launches``: row tiles,
lanes per key, splits, stages, the kernels' variants and grids; ``plan.append_launch``) -> bind the arrays and
launch ``kernels.decode``'s append, decode and combine kernels.
The oracle is ``reference.attention_with_kvcache`` (docs/semantics.md, "KV cache").

``cache_seqlens`` and ``block_table`` held on the host (NumPy arrays, CPU PyTorch tensors, an int) are checked
here, before any launch; held in device memory they go to the kernels as they are, with no copy back and no
synchronisation (a decode step stays asynchronous and capturable in a CUDA graph), and the kernels check
what they read (``decode.make_sequence_check``): a sequence with an out-of-range entry gets NaN rows and no
append.
"""
import dataclasses
import functools
import math
import numbers
from typing import NamedTuple

import numpy as np
from numba import cuda

from . import _arrays, _dispatch, _options, plan
from .kernels import decode as _decode
from .kernels import rotary as _rotary
from .kernels import _jit
from .kernels._jit import SIMULATOR, launch

DTYPES = ("float16", "bfloat16", "float32")
KEYS_PER_LANE = 2                     # T: keys per lane group per step (loads in flight per lane: 2 T rows' chunks)
NWARPS = 2 if SIMULATOR else 8        # the simulator's grids stay small; two warps still exercise the warp merge
E_BUDGET = 4 if SIMULATOR else 64     # q and acc values per lane per row tile (x ROWS): sets the lanes per key;
                                      # tiny in the simulator so that its tiny head dims still split a key over lanes
BLOCKS_PER_SM = 2 if SIMULATOR else 1  # decode blocks resident per SM (registers): the slots the split count fills
STAGES = 4                            # K/V tiles staged through shared memory, STAGES - 1 steps ahead (0: registers)
STAGE_BYTES_PER_SM = 192 * 1024       # the stages' shared memory of the BLOCKS_PER_SM blocks of an SM, together
LEAN = True                           # decode.make_decode's LEAN path (fewer instructions per step)
# NWARPS 8, one block an SM and LEAN: measured 1.04-1.06x the earlier 4 warps, two blocks an SM (the shape,
# H100, bench/results/h100-decode-2026-11-25.md, "run 4": 0.99-1.01x SDPA FlashAttention-2's kernels)
# The settings above are read at every call: ``python -m tools.tune_decode "LEAN=1,STAGES=6" ...`` times
# other values against these (tools/tune_decode.py), with no code edit.
SIM_SMS = 2                           # the simulator's stand-in SM count: tiny problems still split


_sm_counts = {}


def sm_count():
    """Multiprocessors of the current device (``SIM_SMS`` in the simulator)."""
    if SIMULATOR:
        return SIM_SMS
    ctx = _jit.current_context()           # (a ctypes call: Numba's current device costs ~10 us a call)
    n = _sm_counts.get(ctx)
    if n is None:
        n = _sm_counts[ctx] = int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    return n


# ------------------------------------------------------------------------------------------------ validation
def _on_host(x):
    """``x`` as a NumPy array when the caller holds it on the host (a NumPy array, a CPU PyTorch tensor), else
    None: an array in device memory, never copied back (the kernels check its entries)."""
    if isinstance(x, np.ndarray):
        return x
    torch = _arrays.torch
    if torch is not None and isinstance(x, torch.Tensor) and not x.is_cuda:
        return x.detach().numpy()
    return None


def _metadata(x, name, shape):
    """An int32 metadata array checked for dtype and shape (``shape`` entries None: any size): (its NumPy
    copy when on the host, else None; what the kernels get: the NumPy array or the device array)."""
    host = _on_host(x)
    dtype = host.dtype.name if host is not None else _arrays.kind_of(x, name).dtype
    if dtype != "int32":
        raise TypeError(f"{name} must be an int32 array, got dtype {dtype}")
    got = tuple(int(n) for n in x.shape)
    if len(got) != len(shape) or any(want is not None and n != want for n, want in zip(got, shape)):
        want = ", ".join("n" if w is None else str(w) for w in shape)
        raise ValueError(f"{name} must have shape ({want}{',' if len(shape) == 1 else ''}), got {got}")
    return host, (host if host is not None else x)


class _Call(NamedTuple):
    kind: object
    batch: int
    seqlen_q: int
    nheads: int
    headdim: int
    nheads_k: int
    seqlen_new: int
    page: int            # rows per page (paged) or the dense cache's rows
    capacity: int        # rows a sequence may hold
    n_max: int           # the most rows a sequence holds after the append: the capacity when only the device knows
    uniform: int         # the one length when cache_seqlens is None or an int, else -1
    seqlens: object      # cache_seqlens as the kernels get it: a NumPy or device array (None when uniform)
    table: object        # block_table as the kernels get it: a NumPy or device array, or None (dense)
    leftpad: object = None   # cache_leftpad as the kernels get it: a NumPy or device array, or None


def _check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, return_softmax_lse, alibi_slopes=None,
           cache_leftpad=None):
    """Every argument against the contract (docstring of ``flash_attn_with_kvcache``), before any launch."""
    names = ("q", "k_cache", "v_cache")
    kinds = [_arrays.kind_of(x, n) for x, n in zip((q, k_cache, v_cache), names)]
    kind = kinds[0]
    for kd, n in zip(kinds[1:], names[1:]):
        if kd.lib != kind.lib:
            raise TypeError(f"{n} is a {kd.lib} array but q is a {kind.lib} array; pass one kind")
        if kd.dtype != kind.dtype:
            raise TypeError(f"{n} has dtype {kd.dtype} but q has {kind.dtype}; pass one dtype")
    if kind.dtype not in DTYPES:
        raise TypeError(f"q has dtype {kind.dtype}; flash_attn_with_kvcache takes {', '.join(DTYPES)}")
    for x, n in zip((q, k_cache, v_cache), names):
        if len(x.shape) != 4:
            raise ValueError(f"{n} must have 4 dimensions, got shape {tuple(x.shape)}")
    batch, seqlen_q, nheads, headdim = map(int, q.shape)
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    cb, page, nheads_k, dk = map(int, k_cache.shape)
    if dk != headdim:
        raise ValueError(f"k_cache has head dim {dk} but q has head dim {headdim}")
    if not 1 <= headdim <= _options.MAX_HEAD_DIM:
        raise ValueError(f"head dim of q must be between 1 and {_options.MAX_HEAD_DIM}, got {headdim}")
    if kind.dtype != "float32" and headdim % 2:
        raise ValueError(f"head dim must be even for {kind.dtype} (the kernels read pairs as 32-bit words), got {headdim}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads of k_cache ({nheads_k})")
    _arrays.check_device(q, "q")
    for x, n in ((k_cache, "k_cache"), (v_cache, "v_cache"), (k, "k"), (v, "v"), (cache_seqlens, "cache_seqlens"),
                 (block_table, "block_table"), (alibi_slopes, "alibi_slopes"), (cache_leftpad, "cache_leftpad")):
        if x is not None and not isinstance(x, numbers.Integral):
            _arrays.check_same_device(x, n, q)

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or neither)")
    seqlen_new = 0
    if k is not None:
        for x, n in ((k, "k"), (v, "v")):
            kd = _arrays.kind_of(x, n)
            if kd.lib != kind.lib or kd.dtype != kind.dtype:
                raise TypeError(f"{n} is a {kd.lib} {kd.dtype} array but q is a {kind.lib} {kind.dtype} array")
            if len(x.shape) != 4 or int(x.shape[0]) != batch or int(x.shape[2]) != nheads_k or int(x.shape[3]) != headdim:
                raise ValueError(f"{n} must have shape ({batch}, seqlen_new, {nheads_k}, {headdim}), got {tuple(x.shape)}")
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        seqlen_new = int(k.shape[1])

    if block_table is None:
        if cb != batch:
            raise ValueError(f"k_cache has batch {cb} but q has batch {batch} (a paged cache needs block_table)")
        capacity, table_h, table = page, None, None
    else:
        table_h, table = _metadata(block_table, "block_table", (batch, None))
        if page % _decode.KEY_ALIGN:
            raise ValueError(f"the page size (k_cache.shape[1] = {page}) must be a multiple of "
                             f"{_decode.KEY_ALIGN} (the decode kernel's key alignment)")
        capacity = page * int(block_table.shape[1])

    uniform, seqlens = -1, None
    if cache_seqlens is None:
        if seqlen_new > capacity:
            raise ValueError(f"seqlen_new = {seqlen_new} exceeds the cache's {capacity} rows")
        uniform = capacity - seqlen_new
        lens = np.full(batch, uniform, np.int64)
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        uniform = int(cache_seqlens)
        lens = np.full(batch, uniform, np.int64)
    else:
        lens, seqlens = _metadata(cache_seqlens, "cache_seqlens", (batch,))
        if lens is not None:
            lens = lens.astype(np.int64)
    if lens is not None and (np.any(lens < 0) or np.any(lens + seqlen_new > capacity)):
        b = int(np.argmax((lens < 0) | (lens + seqlen_new > capacity)))
        raise ValueError(f"cache_seqlens[{b}] + seqlen_new = {int(lens[b])} + {seqlen_new} is outside the cache's "
                         f"0..{capacity} rows")
    if table_h is not None and lens is not None:     # else the kernels check the pages they would touch
        num_pages = int(k_cache.shape[0])
        for b in range(batch):
            need = -(-int(lens[b] + seqlen_new) // page)
            pages = table_h[b, :need]
            if np.any(pages < 0) or np.any(pages >= num_pages):
                raise ValueError(f"block_table[{b}, :{need}] (the pages sequence {b} touches) holds indices outside "
                                 f"0..{num_pages - 1}: {pages.tolist()}")
    leftpad = None
    if cache_leftpad is not None:
        pad_h, leftpad = _metadata(cache_leftpad, "cache_leftpad", (batch,))
        if pad_h is not None:            # else the kernel takes max(its first key, cache_leftpad[b]): no read outside
            top = (lens + seqlen_new) if lens is not None else np.full(batch, capacity)
            if np.any(pad_h < 0) or np.any(pad_h > top):
                b = int(np.argmax((pad_h < 0) | (pad_h > top)))
                raise ValueError(f"cache_leftpad[{b}] = {int(pad_h[b])} is outside 0..{int(top[b])} (the rows sequence "
                                 f"{b} holds after the append)")
    n_max = capacity if lens is None else (int(np.max(lens)) + seqlen_new if batch else 0)
    if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = chosen from the shape), got {num_splits!r}")
    if not isinstance(return_softmax_lse, (bool, np.bool_)):
        raise TypeError(f"return_softmax_lse must be a bool, got {type(return_softmax_lse).__name__}")
    return _Call(kind, batch, seqlen_q, nheads, headdim, nheads_k, seqlen_new, page, capacity, n_max, uniform,
                 seqlens, table, leftpad)


# ------------------------------------------------------------------------------------------------ the call
def _device_words(x, name, kind, stream):
    """(device view the kernels read: uint32 words of 16-bit data or float32, device array to copy back to a
    NumPy caller or None)."""
    back = None
    if isinstance(x, np.ndarray):
        back = cuda.to_device(np.ascontiguousarray(x), stream=stream.numba)
        d = back if SIMULATOR else _arrays.View.of(back)
    elif kind.dtype == "float32":
        d = _arrays.to_device(x, stream)
    else:
        d = _arrays.to_device_bits(x, stream)
    if kind.dtype == "float32":
        return d, back
    w = _arrays.word_view(d)
    if w is None:
        raise ValueError(f"{name}: float16/bfloat16 arrays must have a contiguous head dimension (stride 1) and "
                         f"4-byte aligned rows, got strides {tuple(d.strides)}")
    return w, back


_options_cache = {}


def _normalised(c, stream, softmax_scale, causal, window_size, alibi_slopes, softcap):
    """``_options.normalise`` for this call; without ALiBi slopes (the one option that is an array) the result
    depends only on plain values and is kept per key (a decode loop repeats the same options every step)."""
    def norm():
        return _options.normalise(batch=c.batch, seqlen_q=c.seqlen_q, seqlen_k=max(c.capacity, 1), nheads=c.nheads,
                                  headdim=c.headdim, acc=np.float32, stream=stream, softmax_scale=softmax_scale,
                                  causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
                                  softcap=softcap)
    if alibi_slopes is not None or not isinstance(window_size, tuple):
        return norm()
    values = (softmax_scale, causal, *window_size, softcap, c.batch, c.seqlen_q, c.capacity, c.nheads, c.headdim)
    key = tuple((type(x), x) for x in values)         # causal=1 must not hit causal=True's entry
    try:
        opts = _options_cache.get(key)
    except TypeError:                                  # an unhashable value: validate it the long way
        return norm()
    if opts is None:
        opts = norm()
        if len(_options_cache) < 4096:
            _options_cache[key] = opts
    return opts


def _dummy(ndim, dtype):
    return _options._dummy(ndim, dtype)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, stream=None):
    """Attention of ``q`` over a KV cache, after appending ``k``/``v`` to it in place (flash-attn's conventions).

    Arguments:
        q: ``(batch, seqlen_q, nheads, headdim)``; seqlen_q 1 (decoding) to a few hundred (chunked prefill,
            speculative decoding). float16, bfloat16 or float32, with a contiguous head dimension. An odd head
            dim in 16 bits is served as flash-attn serves it: on copies padded with a zero column, the caches
            copied back after an append (a copy of each cache per call; NumPy, PyTorch or CuPy arrays,
            ``stream=None``).
        k_cache, v_cache: dense ``(batch, seqlen_cache, nheads_k, headdim)``, or paged ``(num_pages, page_size,
            nheads_k, headdim)`` with ``block_table``; ``nheads % nheads_k == 0`` (GQA/MQA).
        k, v: ``(batch, seqlen_new, nheads_k, headdim)`` or None: written into the caches at rows
            ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1`` of sequence ``b`` **in place** (the one
            exception to "inputs are never written"; NumPy caches are copied to the device and back).
            ``cache_seqlens`` itself is not updated (as in flash-attn).
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)``, q's kind and dtype (``rotary_dim`` a multiple
            of 4 up to the head dim), with ``k``: flash-attn's rotary embedding inside the call
            (``reference.apply_rotary``): the new keys rotated at rows ``cache_seqlens[b] + i`` before the
            append, q at its own rows too when causal or windowed, else every query at ``cache_seqlens[b]``;
            ``rotary_interleaved`` pairs dims ``(2i, 2i + 1)`` (True, GPT-J) or ``(i, i + rotary_dim / 2)``
            (GPT-NeoX). Computed in float32, rounded to the input dtype.  The tables must have at least the
            cache's rows (``seqlen_ro >= capacity``, as flash-attn); "windowed" counts window sides below the
            capacity only (flash-attn drops the others).
        cache_seqlens: int32 ``(batch,)`` array or an int: the rows each sequence holds before the append;
            None: the whole cache (minus ``seqlen_new``). Each must satisfy ``0 <= cache_seqlens[b]`` and
            ``cache_seqlens[b] + seqlen_new <= capacity`` (the dense cache's rows, or page_size x
            pages_per_sequence).
        cache_batch_idx: int32 ``(batch,)`` or None: sequence ``b`` reads and appends to row
            ``cache_batch_idx[b]`` of a dense cache (None: row ``b``); the cache may then hold more rows than
            the batch. Served as a paged cache of one page a sequence, so the cache's rows (``k_cache.shape[1]``)
            must be a multiple of 16; not together with ``block_table`` (as flash-attn). Indices on the host
            are checked before any launch; rows chosen twice are appended to twice (flash-attn's caveat).
        cache_leftpad: int32 ``(batch,)`` or None: sequence ``b`` starts at row ``cache_leftpad[b]`` of its cache;
            the rows before it are padding no query sees (flash-attn's). Positions stay the cache's rows: the
            append at ``cache_seqlens[b]``, the rotary angles, the bottom-right alignment and ALiBi's distances
            are as without it (``reference.attention_with_kvcache``). ``0 <= cache_leftpad[b] <=
            cache_seqlens[b] + seqlen_new``; dense caches only (not with ``block_table``, as flash-attn; with
            ``cache_batch_idx`` it is the padding of the row a sequence reads).
        block_table: int32 ``(batch, pages_per_sequence)`` page indices; the page size must be a multiple of 16.
            The pages a sequence touches (its first ``ceil((cache_seqlens[b] + seqlen_new) / page_size)``
            entries) must lie in ``0..num_pages - 1``; entries past them are never read.

        Where the metadata lives decides who checks it. On the host (an int, a NumPy array, a CPU PyTorch
        tensor): checked before any launch, a ValueError naming the entry. In device memory (a CUDA tensor,
        CuPy or Numba array): never copied back (no synchronisation: a decode loop stays asynchronous and
        CUDA-graph capturable); the kernels check every entry they read, and a sequence with an entry out of
        range gets no append and NaN in all its ``out`` and ``lse`` rows, while the other sequences are
        computed as usual and no memory outside the caches' valid rows is read or written. With a device
        ``cache_seqlens`` the split count assumes the longest possible sequence (the capacity), as flash-attn.
        num_splits: split each sequence's keys over this many blocks (flash-decoding), combined exactly by a
            second kernel; 0 chooses from batch x KV heads and the SM count (flash-attn's heuristic), 1 = none.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as ``flash_attention``
            (docs/semantics.md); causal and windows are aligned to the bottom-right corner of each sequence's
            ``cache_seqlens[b] + seqlen_new`` valid keys; alibi_slopes ``(nheads,)`` or ``(batch, nheads)``.
        return_softmax_lse: also return ``lse`` ``(batch, nheads, seqlen_q)`` float32 (natural log).
        stream: as ``flash_attention``.

    Returns ``out`` (like ``q``) or ``(out, lse)``; a row that sees no key gives ``out = 0``, ``lse = -inf``.

    Host time: a call whose arrays are all in device memory and whose ``cache_seqlens`` is None or a device
    array replays the launches recorded by the first call of its signature (``_dispatch``: a decode loop's
    calls after the first); a call over a whole dense cache (no append, rotary, pages or ALiBi) whose cache has
    grown since is bound by the length-generic step of its first call (``_Step``); an int ``cache_seqlens`` (its
    value decides the split plan) or metadata on the host takes the full path every call.
    """
    if cache_leftpad is not None and block_table is not None:
        raise ValueError("cache_leftpad is for dense caches: it cannot be given with block_table (as flash-attn)")
    if _odd_16bit(q):
        return _with_even_head_dim(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                   rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, stream)
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    if type(window_size) is not tuple:
        window_size = _options.window_pair(window_size)
    if cache_batch_idx is not None:
        k_cache, v_cache, block_table = _batch_idx_as_pages(k_cache, v_cache, cache_batch_idx, block_table, q)
    rotary = None
    if rotary_cos is not None or rotary_sin is not None:
        rotary = (rotary_cos, rotary_sin, bool(rotary_interleaved))
    uniform = isinstance(cache_seqlens, (int, np.integer))
    return _dispatch.cached_call(
        "kvcache", (q, k_cache, v_cache, k, v, None if uniform else cache_seqlens, block_table, alibi_slopes,
                    rotary_cos, rotary_sin, cache_leftpad),
        (num_splits, softmax_scale, causal, window_size, softcap, return_softmax_lse, bool(rotary_interleaved)),
        lambda: _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, softmax_scale,
                              causal, window_size, softcap, alibi_slopes, return_softmax_lse, stream, rotary,
                              cache_leftpad),
        cacheable=stream is None and not uniform, generic=_CACHE_LENGTH)


_CACHE_LENGTH = ((1, 2), 1)   # the caches' rows (axis 1): a whole dense cache's call is a step at any length (_Step)


def _odd_16bit(q):
    """A float16/bfloat16 ``q`` with an odd head dim (the kernels read pairs of 16-bit values as 32-bit words)."""
    return (len(getattr(q, "shape", ())) == 4 and int(q.shape[3]) % 2 == 1
            and _arrays.kind_of(q, "q").dtype in ("float16", "bfloat16"))


def _with_even_head_dim(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                        alibi_slopes, num_splits, return_softmax_lse, stream):
    """flash-attn's answer to an odd 16-bit head dim: q, the caches and the new rows padded with a zero
    column (the scores and the first ``headdim`` output columns unchanged; the scale stays the unpadded head
    dim's), the call made on the copies, the caches' rows copied back after an append, ``out`` cut back.  Costs
    a copy of each cache per call, as flash-attn's does; NumPy, PyTorch and CuPy arrays, on their current
    stream (so ``stream`` must be None)."""
    lib = _arrays.kind_of(q, "q").lib
    d = int(q.shape[3])
    if lib == "numba" or stream is not None:
        raise ValueError(f"an odd head dim ({d}) for {_arrays.kind_of(q, 'q').dtype} is served by padding copies of "
                         f"NumPy, PyTorch or CuPy arrays on their current stream: pass one of those with stream=None, "
                         f"or an even head dim")
    for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache"), (k, "k"), (v, "v")):
        if x is not None and (len(x.shape) != 4 or int(x.shape[3]) != d):
            raise ValueError(f"{name} must have head dim {d} like q, got shape {tuple(x.shape)}")
    if rotary_cos is not None and len(rotary_cos.shape) == 2 and 2 * int(rotary_cos.shape[1]) > d:
        raise ValueError(f"rotary_dim (2 x rotary_cos.shape[1] = {2 * int(rotary_cos.shape[1])}) must be at most "
                         f"the head dim {d}")
    pad = functools.partial(_pad_head_dim, lib=lib)
    kc, vc = pad(k_cache), pad(v_cache)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    result = flash_attn_with_kvcache(pad(q), kc, vc, pad(k), pad(v), rotary_cos, rotary_sin, cache_seqlens,
                                     cache_batch_idx, cache_leftpad, block_table, scale, causal, window_size, softcap,
                                     rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)
    if k is not None:                    # the append landed in the copies: into the caller's caches
        for dst, src in ((k_cache, kc), (v_cache, vc)):
            if lib == "torch":
                dst.copy_(src[..., :d])
            else:
                dst[...] = src[..., :d]
    if return_softmax_lse:
        return result[0][..., :d], result[1]
    return result[..., :d]


def _pad_head_dim(x, lib):
    """``x`` with one zero column after its last (head) dimension; None stays None."""
    if x is None:
        return None
    if lib == "torch":
        import torch
        return torch.nn.functional.pad(x, (0, 1))
    if lib == "cupy":
        import cupy
        return cupy.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 1)])
    return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 1)])


def attend(q, k, v, options, return_lse, stream):
    """``flash_attention``'s small-query calls (``plan.split_kv``): q over k, v as a full dense cache, no
    append, through the decode kernels (their split over the keys and the combine).  ``options``: the forward's
    (``plan.split_kv`` has ruled out masks, bias and dropout).  ``_with_kvcache`` offers the dispatch cache a
    ``_Step`` for the call's other key counts (a decoding loop's next steps)."""
    return _with_kvcache(q, k, v, None, None, None, None, 0, options["softmax_scale"], options["causal"],
                         options["window_size"], options["softcap"], options["alibi_slopes"], return_lse, stream)


class _Step:
    """A routed call (``attend``), or a ``flash_attn_with_kvcache`` call over a whole dense cache (no append, no
    rotary, no pages, no ALiBi: a padded batch's decoding step from ``flashnb.transformers``), for any key count:
    the dispatch cache's length-generic step for the calls that differ from this one only in the keys' length
    (``_dispatch.length_generic``: the same kinds, dtypes, q, heads, head dim, options, and k/v strides that are
    the same function of the length).  What depends on the length is derived again each call: the window's sides,
    the split plan and the kernel's variant (``_attend``), the word views and their alignment; the call's own
    ``cache_seqlens`` and ``cache_leftpad`` (device arrays, at ``flash_attn_with_kvcache``'s positions 5 and 10 of
    the dispatch cache's arrays) are bound; the rest (the checks, the options) is this first call's."""

    def __init__(self, q, k, v, options, return_lse, num_splits=0, cache_seqlens=None, cache_leftpad=None):
        self.c = c = _check(q, k, v, None, None, cache_seqlens, None, num_splits, return_lse, None, cache_leftpad)
        stream = _arrays.resolve_stream(None, c.kind, q)
        self.opts = _normalised(c, stream, options["softmax_scale"], options["causal"], options["window_size"], None,
                                options["softcap"])
        self.window, self.causal, self.return_lse = options["window_size"], options["causal"], return_lse
        self.num_splits = int(num_splits)
        self.bind_seqlens, self.bind_leftpad = c.seqlens is not None, c.leftpad is not None
        self.by_sides = {}           # (left, right) -> the options with those window sides

    def __call__(self, arrays):
        q, k, v = arrays[0], arrays[1], arrays[2]
        c = self.c
        kind, n = c.kind, int(k.shape[1])
        stream = _arrays.resolve_stream(None, kind, q)
        words = [_step_words(x, kind, stream) for x in (q, k, v)]
        if any(w is None for w in words):   # a length whose strides give no word view: the full path decides
            return None
        sides = _options.window_sides(self.window, self.causal, c.seqlen_q, n)
        opts = self.by_sides.get(sides)
        if opts is None:
            opts = self.by_sides[sides] = dataclasses.replace(
                self.opts, left=sides[0], right=sides[1],
                flags=dataclasses.replace(self.opts.flags, has_window=sides[0] >= 0 or sides[1] >= 0))
        seqlens_d = _arrays.to_device(arrays[5], stream) if self.bind_seqlens else _dummy(1, np.int32)
        leftpad_d = _arrays.to_device(arrays[10], stream) if self.bind_leftpad else _dummy(1, np.int32)
        uniform = -1 if self.bind_seqlens else n
        c = c._replace(page=n, capacity=n, n_max=n, uniform=uniform)
        out_ret, out_d, lse_ret, lse_d = _outputs(c, q, stream, seqlens_d, max(uniform, 0), _dummy(2, np.int32),
                                                  leftpad_d, *words, opts, self.num_splits)
        out = _arrays.finish(kind, out_ret, out_d, stream)
        return (out, _arrays.finish(kind, lse_ret, lse_d, stream)) if self.return_lse else out


def _step_words(x, kind, stream):
    """``_device_words``' view of a device array, or None where its layout gives none."""
    if kind.dtype == "float32":
        return _arrays.to_device(x, stream)
    return _arrays.word_view(_arrays.to_device_bits(x, stream))


def _batch_idx_as_pages(k_cache, v_cache, cache_batch_idx, block_table, q):
    """``cache_batch_idx`` over a dense cache as a paged cache of one page a sequence: the caches unchanged (their
    rows are the pages) and the table ``cache_batch_idx.reshape(batch, 1)`` (a view: the append and the decode
    read it as they read any table, and a device array stays on the device)."""
    if block_table is not None:
        raise ValueError("cache_batch_idx cannot be given with block_table (a paged cache): pass one (as flash-attn)")
    if isinstance(cache_batch_idx, numbers.Integral) or len(getattr(cache_batch_idx, "shape", ())) != 1:
        raise ValueError(f"cache_batch_idx must be an int32 array of shape (batch,), got {cache_batch_idx!r}")
    batch = int(q.shape[0]) if len(q.shape) == 4 else -1
    if int(cache_batch_idx.shape[0]) != batch:
        raise ValueError(f"cache_batch_idx must have shape ({batch},), got {tuple(cache_batch_idx.shape)}")
    rows = int(k_cache.shape[1]) if len(k_cache.shape) == 4 else 0
    if rows % _decode.KEY_ALIGN:
        raise ValueError(f"cache_batch_idx needs a cache whose rows (k_cache.shape[1] = {rows}) are a multiple of "
                         f"{_decode.KEY_ALIGN} (it is served as a paged cache of one page a sequence)")
    host, _ = _metadata(cache_batch_idx, "cache_batch_idx", (batch,))
    if host is not None and batch and (host.min() < 0 or host.max() >= int(k_cache.shape[0])):
        b = int(np.argmax((host < 0) | (host >= int(k_cache.shape[0]))))
        raise ValueError(f"cache_batch_idx[{b}] = {int(host[b])} is outside the cache's rows 0..{int(k_cache.shape[0]) - 1}")
    return k_cache, v_cache, cache_batch_idx.reshape(batch, 1)


def _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, return_softmax_lse, stream, rotary=None, cache_leftpad=None):
    """``flash_attn_with_kvcache``'s full path: check, plan, allocate, launch.  ``rotary``: ``(cos, sin,
    interleaved)`` or None."""
    c = _check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, return_softmax_lse, alibi_slopes,
               cache_leftpad)
    if rotary is not None:
        _check_rotary(c, q, k, *rotary)
    kind = c.kind
    launch_stream = _arrays.resolve_stream(stream, kind, q)
    with _arrays.stream_scope(launch_stream, kind, q):
        opts = _normalised(c, launch_stream, softmax_scale, causal, window_size, alibi_slopes, softcap)
        q_w, _ = _device_words(q, "q", kind, launch_stream)
        kc_w, kc_back = _device_words(k_cache, "k_cache", kind, launch_stream)
        vc_w, vc_back = _device_words(v_cache, "v_cache", kind, launch_stream)
        seqlens_d = _dummy(1, np.int32) if c.seqlens is None else _arrays.to_device(c.seqlens, launch_stream)
        table_d = _dummy(2, np.int32) if c.table is None else _arrays.to_device(c.table, launch_stream)
        leftpad_d = _dummy(1, np.int32) if c.leftpad is None else _arrays.to_device(c.leftpad, launch_stream)
        base_len = max(c.uniform, 0)
        appending = k is not None and c.batch * c.seqlen_new * c.nheads_k > 0
        if appending:                                  # (every layout checked before the first launch)
            kn_w, _ = _device_words(k, "k", kind, launch_stream)
            vn_w, _ = _device_words(v, "v", kind, launch_stream)
        if rotary is not None:
            q_w = _rotated(q_w, rotary, not _local(c, causal, window_size), c, seqlens_d, base_len, kind, q,
                           launch_stream)

        if appending:
            if rotary is not None:
                kn_w = _rotated(kn_w, rotary, False, c, seqlens_d, base_len, kind, q, launch_stream)
            step, blocks_per_seq = plan.append_launch(c.batch, c.seqlen_new, c.nheads_k, int(kn_w.shape[3]),
                                                      c.table is not None, c.seqlens is not None)
            _run(step, launch_stream, (kn_w, vn_w, kc_w, vc_w, seqlens_d, base_len, table_d, c.page, blocks_per_seq))

        out_ret, out_d, lse_ret, lse_d = _outputs(c, q, launch_stream, seqlens_d, base_len, table_d, leftpad_d, q_w,
                                                  kc_w, vc_w, opts, int(num_splits))
        for back, host in ((kc_back, k_cache), (vc_back, v_cache)):
            if back is not None and k is not None:
                host[...] = back.copy_to_host(stream=launch_stream.numba)
        out = _arrays.finish(kind, out_ret, out_d, launch_stream)
        result = (out, _arrays.finish(kind, lse_ret, lse_d, launch_stream)) if return_softmax_lse else out
    if (_dispatch.wants_step() and k is None and rotary is None and c.table is None and alibi_slopes is None
            and stream is None):        # a whole dense cache: its next lengths can be steps
        _dispatch.offer_step(_Step(q, k_cache, v_cache, dict(softmax_scale=softmax_scale, causal=causal,
                                                             window_size=window_size, softcap=softcap),
                                   return_softmax_lse, num_splits, cache_seqlens, cache_leftpad))
    return result


def _outputs(c, q, stream, seqlens_d, base_len, table_d, leftpad_d, q_w, kc_w, vc_w, opts, num_splits):
    """``out`` and ``lse`` allocated (returned arrays and device views) and computed by ``_attend``."""
    kind = c.kind
    out_ret, out_d = _arrays.empty_like_kind(kind, (c.batch, c.seqlen_q, c.nheads, c.headdim), kind.dtype, q,
                                             stream, bits=True)
    lse_ret, lse_d = _arrays.empty_like_kind(kind, (c.batch, c.nheads, c.seqlen_q), "float32", q, stream)
    out_w = out_d if kind.dtype == "float32" else _arrays.word_view(out_d)
    if c.batch * c.seqlen_q * c.nheads > 0:
        _attend(c, q_w, kc_w, vc_w, out_w, lse_d, seqlens_d, base_len, table_d, opts, num_splits, kind, q, stream,
                leftpad_d)
    return out_ret, out_d, lse_ret, lse_d


def _check_rotary(c, q, k, cos, sin, interleaved):
    """The rotary tables against the call (flash-attn's contract), before any launch."""
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together (or neither)")
    if k is None:
        raise ValueError("rotary_cos/rotary_sin need the new keys k and v (flash-attn rotates k before the append)")
    for x, name in ((cos, "rotary_cos"), (sin, "rotary_sin")):
        kd = _arrays.kind_of(x, name)
        if kd.lib != c.kind.lib or kd.dtype != c.kind.dtype:
            raise TypeError(f"{name} is a {kd.lib} {kd.dtype} array but q is a {c.kind.lib} {c.kind.dtype} array")
        if len(x.shape) != 2:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), got {tuple(x.shape)}")
        _arrays.check_same_device(x, name, q)
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    seqlen_ro, half = map(int, cos.shape)
    if half == 0 or (2 * half) % 4 or 2 * half > c.headdim:
        raise ValueError(f"rotary_dim (2 x rotary_cos.shape[1] = {2 * half}) must be a positive multiple of 4 up to "
                         f"the head dim {c.headdim}")
    if seqlen_ro < c.capacity:          # flash-attn's rule: every row a sequence may hold has its angles
        raise ValueError(f"the rotary tables (rotary_cos.shape[0] = {seqlen_ro}) must have at least the cache's "
                         f"{c.capacity} rows")


def _local(c, causal, window_size):
    """flash-attn's "causal or local" for the rotary positions of q: after dropping window sides at or beyond
    the cache's capacity (they bound nothing), as flash-attn does."""
    left, right = (w if w < c.capacity else -1 for w in window_size)
    return bool(causal) or left >= 0 or right >= 0


def _rotated(x_w, rotary, at_start, c, seqlens_d, base_len, kind, like, stream):
    """A rotated copy of the word view ``x_w`` (q or the new keys), by ``kernels.rotary``."""
    cos, sin, interleaved = rotary
    cos_w, _ = _device_words(cos, "rotary_cos", kind, stream)
    sin_w, _ = _device_words(sin, "rotary_sin", kind, stream)
    out = _arrays.scratch(tuple(x_w.shape), np.float32 if kind.dtype == "float32" else np.uint32, kind, like, stream)
    n = int(np.prod(x_w.shape))
    if n:
        launch(_rotary.make_rotary(kind.dtype, interleaved, c.seqlens is not None, at_start), _rotary.grid(n),
               _rotary.THREADS, stream, 0, (x_w, out, cos_w, sin_w, seqlens_d, base_len, int(cos.shape[1])))
    return out


def _attend(c, q_w, kc_w, vc_w, out_w, lse_d, seqlens_d, base_len, table_d, opts, num_splits, kind, like, stream,
            leftpad_d):
    """The decode kernel (and the combine, with splits) for a checked call: ``plan.decode_launches``, bound."""
    f = opts.flags
    vec16 = _arrays.rows_aligned16(kc_w) and _arrays.rows_aligned16(vc_w)
    plan_ = plan.decode_launches(kind.dtype, c.batch, c.nheads, c.nheads_k, c.seqlen_q, c.headdim, c.n_max, vec16,
                                 num_splits, sm_count(), settings(), c.table is not None, c.seqlens is not None,
                                 f.has_window, f.has_softcap, f.has_alibi, c.leftpad is not None)
    p = plan_.split
    if plan_.combine is not None:
        out_s = _arrays.scratch((p.n_splits, c.batch, c.seqlen_q, c.nheads, c.headdim), np.float32, kind, like,
                                stream)
        lse_s = _arrays.scratch((p.n_splits, c.batch, c.nheads, c.seqlen_q), np.float32, kind, like, stream)
        if SIMULATOR and _arrays.POISON_OUTPUTS:        # a split block that forgets a row fails the tests
            out_s.copy_to_device(np.full(out_s.shape, np.nan, np.float32))
            lse_s.copy_to_device(np.full(lse_s.shape, np.nan, np.float32))
    else:
        out_s, lse_s = _dummy(5, np.float32), _dummy(4, np.float32)
    _run(plan_.decode, stream,
         (q_w, kc_w, vc_w, out_w, lse_d, out_s, lse_s, seqlens_d, base_len, c.seqlen_new, table_d, c.page,
          c.nheads // c.nheads_k, p.n_row_tiles, p.n_splits, p.split_len, np.float32(opts.scale),
          np.float32(opts.softcap), opts.left, opts.right, opts.alibi, leftpad_d))
    if plan_.combine is not None:
        _run(plan_.combine, stream, (out_s, lse_s, out_w, lse_d))


def settings():
    """This module's decode settings as the plan takes them (read at every call)."""
    return plan.DecodeSettings(KEYS_PER_LANE, NWARPS, STAGES, STAGE_BYTES_PER_SM // BLOCKS_PER_SM, bool(LEAN),
                               E_BUDGET, BLOCKS_PER_SM)


def _run(step, stream, args):
    """Launch a ``plan.Launch`` with ``args``."""
    launch(step.kernel, step.grid, step.threads, stream, step.shared, args)
