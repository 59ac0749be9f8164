"""The public functions: validate, choose a kernel specialisation, launch, hand back the caller's kind of array.

Layering as in flash-attn: ``flash_attention`` / ``flash_attention_backward``
(public, documented options) -> ``_forward`` / ``_backward`` (device arrays in,
device arrays out) -> the kernel factories in ``flashnb.kernels`` (one compiled
kernel per specialisation key, cached).
"""
from functools import lru_cache

import numpy as np

from . import _arrays, _options
from .kernels._jit import SIMULATOR, compute_capability, launch, memset_zero, shared_limit
from .kernels._tiles import np_acc
from .kernels.backward import (CAST_THREADS, PREPROCESS_THREADS, cast_grid, make_cast, make_dkdv, make_dq,
                               make_preprocess, preprocess_grid, preprocess_threads)
from .kernels.forward import LOG2E, make_forward, tile_threads
from .kernels.backward_tc import make_cast_tc, make_dkdv_tc
from .kernels.forward_tc import make_forward_tc

BACKENDS = ("simt", "tensorcore")

# Default tiles (BLOCK_Q, BLOCK_K) by accumulation type and head dim: the largest
# tiles whose shared memory (q, k, v, p in the accumulation type) leaves room
# for two or more blocks per SM on the H100 (measurements: docs/performance.md);
# halved where a device's shared memory per block is smaller (default_tiles).
_GPU_TILES = {
    "float32": ((64, (64, 64)), (128, (64, 32)), (256, (32, 32))),
    "float64": ((64, (64, 32)), (128, (32, 32)), (256, (32, 16))),
}
_SIM_TILES = (8, 8)  # the simulator runs one Python thread per CUDA thread: keep blocks small
# Tensor-core tiles: BLOCK_Q = 16 x m-tiles per warp (tc_m_tiles) x warps, BLOCK_K a multiple of 16.
# Each head-dim class: the measured tiles (docs/tensorcore.md), then the fallback where a device's shared
# memory per block is smaller than the H100's (compute capability 8.6 / 8.9: 99 KB).
_TC_TILES = ((64, ((128, 64),)), (128, ((128, 64), (64, 64))), (256, ((128, 32), (64, 32))))
_TC_SIM_TILES = (16, 16)


def default_tiles(headdim, acc_name, backward=False, block_q=None, block_k=None):
    """The SIMT kernels' (block_q, block_k), the caller's side kept where one is given: ``_GPU_TILES``, the free
    sides halved (the larger, block_k on a tie) down to 1 until the forward's (``backward``: the dK/dV and dQ
    kernels') shared memory fits the device's."""
    if SIMULATOR:
        return block_q or _SIM_TILES[0], block_k or _SIM_TILES[1]
    if headdim > _options.MAX_HEAD_DIM:
        raise ValueError(f"head dim {headdim} exceeds {_options.MAX_HEAD_DIM}")
    return _default_simt_tiles(headdim, acc_name, bool(backward), shared_limit(), block_q, block_k)


@lru_cache(maxsize=None)
def _default_simt_tiles(headdim, acc_name, backward, limit, block_q=None, block_k=None):
    bq, bk = next(tiles for max_d, tiles in _GPU_TILES[acc_name] if headdim <= max_d)
    bq, bk = block_q or bq, block_k or bk
    candidates = [(bq, bk)]
    while (block_q is None and bq > 1) or (block_k is None and bk > 1):
        if block_k is not None or bk == 1 or (block_q is None and bq > bk):
            bq //= 2
        else:
            bk //= 2
        candidates.append((bq, bk))

    def shared_bytes(bq, bk):
        if backward:
            return max(make_dkdv(bq, bk, headdim, acc_name, True, *([False] * 7))[1],
                       make_dq(bq, bk, headdim, acc_name, *([False] * 7))[1])
        return make_forward(bq, bk, headdim, acc_name, *([False] * 7))[1]
    return _fitting(candidates, limit, shared_bytes)


# (BLOCK_Q, BLOCK_K) of the dK/dV kernel, BLOCK_K / (16 tc_bwd_key_tiles) x tc_bwd_dim_split warps: the
# fastest of the H100 sweeps (bench/results/h100-tune-tc-bwd-2026-11-22.md; above head dim 64 with S^T
# shared, tc_bwd_share: bench/results/h100-tune-tc-2026-11-23.md, ninth session), then the fallbacks where a
# device's shared memory per block is smaller than the H100's (8.0: 163 KB; 8.6 / 8.9: 99 KB)
_TC_BWD_TILES = ((64, ((32, 128), (32, 64))), (128, ((64, 128), (32, 64))),
                 (256, ((64, 64), (32, 64), (16, 64), (16, 32))))


def _tc_candidates(table, headdim, block_q, block_k):
    """A tensor-core kernel's tile candidates for the head dim: the class's, with the caller's side kept where one
    is given and then the other side halved down to 16."""
    candidates = []
    for bq, bk in next(tiles for max_d, tiles in table if headdim <= max_d):
        if (block_q or bq, block_k or bk) not in candidates:
            candidates.append((block_q or bq, block_k or bk))
    bq, bk = candidates[-1]
    while (block_q is None) != (block_k is None) and (bk if block_q else bq) > 16:
        bq, bk = (bq, bk // 2) if block_q else (bq // 2, bk)
        candidates.append((bq, bk))
    return candidates


def _fitting(candidates, limit, shared_bytes):
    """The first (block_q, block_k) of ``candidates`` whose kernel fits in ``limit`` bytes of shared memory
    per block, else the last (which the call then finds too large: ``_shared_refusal``)."""
    return next((c for c in candidates if shared_bytes(*c) <= limit), candidates[-1])


def default_tc_bwd_tiles(headdim, block_q=None, block_k=None):
    """The tensor-core dK/dV kernel's (block_q, block_k): the caller's where given, else the first candidate that
    fits the device's shared memory per block (``_tc_candidates``)."""
    if block_q and block_k:
        return block_q, block_k
    if SIMULATOR:
        return block_q or _TC_SIM_TILES[0], block_k or _TC_SIM_TILES[1]
    return _default_tc_bwd_tiles(headdim, shared_limit(), block_q, block_k)


@lru_cache(maxsize=None)
def _default_tc_bwd_tiles(headdim, limit, block_q=None, block_k=None):
    d = headdim + headdim % 2
    return _fitting(_tc_candidates(_TC_BWD_TILES, headdim, block_q, block_k), limit,
                    lambda bq, bk: tc_bwd_shared_bytes(bq, bk, d))


def tc_bwd_shared_bytes(block_q, block_k, headdim):
    """Dynamic shared memory per block of the tensor-core dK/dV kernel (the options do not change it)."""
    return make_dkdv_tc(block_q, block_k, headdim, "float16", True, *([False] * 7),
                        tc_bwd_dim_split(block_q, block_k, headdim), True,   # as _backward_tc calls it (RED2 last)
                        MTK=tc_bwd_key_tiles(block_q, block_k, headdim), SHARE=tc_bwd_share(block_q, block_k, headdim))[1]


def tc_bwd_key_tiles(block_q, block_k, headdim):
    """m-tiles of 16 keys per warp in the tensor-core dK/dV kernel: 2 (each Q / dO fragment read from shared
    memory feeds twice the ``mma``) where the registers allow it: head dims up to 64 with block_q <= 32, and up
    to 128 with S^T shared (``tc_bwd_share``; half of dK's, dV's dims and of S^T's, dP^T's queries per warp)
    (measured, docs/tensorcore.md); block_k a multiple of 32."""
    if block_k % 32:
        return 1
    if headdim <= 64:
        return 2 if block_q <= 32 else 1
    return 2 if headdim <= 128 and tc_bwd_share(block_q, block_k, headdim) else 1


def tc_bwd_dim_split(block_q, block_k, headdim):
    """Warps per 16 keys in the tensor-core dK/dV kernel (each warp of a pair holds half of dK's and dV's
    dims): 2 above head dim 128, where one warp's registers cannot hold dK and dV next to S^T and dP^T, and
    wherever S^T is shared (``tc_bwd_share``: the pair splits its queries)."""
    return 2 if headdim > 128 or tc_bwd_share(block_q, block_k, headdim) else 1


def tc_bwd_share(block_q, block_k, headdim):
    """S^T and dP^T computed once per pair of warps, each for half of the query tile, and shared through
    shared memory (``make_dkdv_tc(SHARE=True)``, FlashAttention-2's layout): above head dim 64, with block_q a
    multiple of 32 (whole 16-query steps per warp), and up to 64 at head dims up to 128 (there two m-tiles of
    keys per warp, ``tc_bwd_key_tiles``: 64 queries a warp would double S^T's registers).  Measured on the
    H100 at 64 x 128 tiles (64 x 64 above 128), in a first form whose race the deferred dQ fixed (within 1%
    of it at d = 128 in the sweep): 8-13% less backward time at d = 128, 6-9% at 80, 18-21% at 96, 22-26% at
    192 and 256, and at 32 x 64 (the fallback) 4-6% at 128; at d = 64, 12-16% more
    (bench/results/h100-tune-tc-2026-11-23.md, ninth session)."""
    return headdim > 64 and block_q % 32 == 0 and (block_q <= 64 or headdim > 128)


def tc_bwd_threads(block_q, block_k, headdim):
    """Threads per block of the tensor-core dK/dV kernel: 32 per (16 x key m-tiles) keys per dim part."""
    return (32 * block_k // (16 * tc_bwd_key_tiles(block_q, block_k, headdim))
            * tc_bwd_dim_split(block_q, block_k, headdim))


def tc_m_tiles(block_q, headdim):
    """m16 row blocks per warp: 2 (each K/V fragment read from shared memory feeds two mma) up to head dim 64,
    and up to 128 with 4 or more warps and Q in shared memory (``tc_q_in_smem``; 80-96 bytes of spills, and
    still 7-19% less time than one m-tile; with 2 warps per block half as fast); above 128, 1 (docs/tensorcore.md)."""
    return 2 if (block_q >= 32 and headdim <= 64) or (block_q >= 128 and headdim <= 128) else 1


def tc_q_in_smem(m_tiles, headdim):
    """Q's fragments from shared memory (ldmatrix per k-step) rather than registers where two m-tiles per warp
    would not leave the registers for Q's fragments, head dims above 64 (measured, docs/tensorcore.md)."""
    return m_tiles > 1 and headdim > 64


def tc_longest_first(has_window):
    """Whether the forward runs a head's query tiles last first (``forward_tc``'s ``LPT``)."""
    return False


def tc_mask32(has_window):
    """Whether the forward masks its diagonal tiles by 32-bit compares (``forward_tc``'s ``MASK32``: 278 instead of
    942 SASS instructions a diagonal tile at d = 64; not yet timed on a GPU)."""
    return False


@lru_cache(maxsize=256)
def tc_positive_scale(scale):
    """Whether the forward may fold the scale into exp2: 0 < float32(scale) * log2(e) < inf."""
    with np.errstate(over="ignore"):
        x = np.float32(np.float32(scale) * np.float32(LOG2E))
    return bool(0 < x < np.inf)


def default_tc_tiles(headdim, block_q=None, block_k=None):
    """The tensor-core forward's (block_q, block_k): the caller's where given, else the first candidate that fits
    the device's shared memory per block (``_tc_candidates``)."""
    if block_q and block_k:
        return block_q, block_k
    if SIMULATOR:
        return block_q or _TC_SIM_TILES[0], block_k or _TC_SIM_TILES[1]
    return _default_tc_tiles(headdim, shared_limit(), block_q, block_k)


@lru_cache(maxsize=None)
def _default_tc_tiles(headdim, limit, block_q=None, block_k=None):
    d = headdim + headdim % 2
    return _fitting(_tc_candidates(_TC_TILES, headdim, block_q, block_k), limit,
                    lambda bq, bk: tc_shared_bytes(bq, bk, d))


def tc_shared_bytes(block_q, block_k, headdim):
    """Dynamic shared memory per block of the tensor-core forward (the options do not change it)."""
    mt = tc_m_tiles(block_q, headdim)
    return make_forward_tc(block_q, block_k, headdim, "float16", True, mt, tc_q_in_smem(mt, headdim),
                           *([False] * 7))[1]


def _tiles(block_q, block_k, headdim, acc_name, backward=False):
    block_q, block_k = _options.check_tile(block_q, "block_q"), _options.check_tile(block_k, "block_k")
    if block_q and block_k:
        return block_q, block_k
    return default_tiles(headdim, acc_name, backward, block_q, block_k)


def _shared_refusal(nbytes, what):
    """Why a kernel of ``nbytes`` of shared memory per block cannot run on this device (None if it can)."""
    limit = shared_limit()
    if limit is not None and nbytes > limit:
        return (f"{what} needs {nbytes} bytes of shared memory per block (this device's limit: {limit}); "
                "choose smaller block_q / block_k")
    return None


def _check_shared(nbytes, what):
    refusal = _shared_refusal(nbytes, what)
    if refusal is not None:
        raise ValueError(refusal)


def _setup(kind, q, batch, seqlen_q, seqlen_k, nheads, headdim, launch_stream, block_q, block_k, **options):
    """What a forward or backward launch needs: (accumulation type, LaunchOptions).

    16-bit inputs accumulate in float32 (bfloat16 through float32 copies in the SIMT kernels).
    """
    acc = np.float32 if kind.dtype == "bfloat16" else np_acc(kind.dtype)
    _options.check_tile(block_q, "block_q")
    _options.check_tile(block_k, "block_k")
    _arrays.check_device(q, "q")
    for name in ("attn_mask", "attn_bias", "alibi_slopes", "block_mask"):
        _arrays.check_same_device(options.get(name), name, q)
    opts = _options.normalise(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, headdim=headdim,
                              acc=acc, stream=launch_stream, **options)
    return acc, opts


def _tensorcore_refusal(kind, headdim, block_q, block_k):
    """Why the tensor-core kernels cannot serve a call (None if they can), before any array is touched."""
    if kind.dtype not in ("float16", "bfloat16"):
        return f"it computes float16 and bfloat16 inputs only, got {kind.dtype}"
    if headdim % 2:
        return f"it needs an even head dim (pairs of values per 32-bit word), got {headdim}"
    for value, name in ((block_q, "block_q"), (block_k, "block_k")):
        if value is not None and value < 16:
            return f"{name} must be a multiple of 16 (the mma tile), got {value}"
    if not SIMULATOR and compute_capability() < (8, 0):
        return "mma.sync on float16/bfloat16 needs compute capability 8.0 or newer"
    return None


def _word_views(arrays, names, kind, stream):
    """uint32 views (two 16-bit values per word) of the arrays for the tensor-core kernels, or a refusal."""
    views = []
    for x, name in zip(arrays, names):
        w = _arrays.word_view(_arrays.to_device_bits(x, stream))
        if w is None:
            return None, (f"{name}'s head dimension must be contiguous (stride 1) with other strides even "
                          "and a 4-byte-aligned start")
        views.append(w)
    return views, None


def _pick_backend(backend, refusal):
    """True for the tensor-core kernels: forced, or "auto" with nothing against them."""
    if backend == "tensorcore" and refusal is not None:
        raise ValueError(f"backend='tensorcore' cannot serve this call: {refusal}")
    return refusal is None and backend in ("auto", "tensorcore")


def _prepare(arrays, kind, stream):
    """Numba device views of the caller's arrays (bfloat16 tensors: float32 copies)."""
    out = []
    for x in arrays:
        if kind.dtype == "bfloat16":
            x = x.float()
        out.append(_arrays.to_device(x, stream))
    return out


def flash_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), attn_mask=None,
                    attn_bias=None, alibi_slopes=None, softcap=0.0, block_mask=None, block_mask_size=(128, 128),
                    dropout_p=0.0, seed=0, return_lse=False, block_q=None, block_k=None, deterministic=False,
                    stream=None, backend="auto"):
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

    Returns ``out`` (like ``q``), or ``(out, lse)``, as the same kind of array as ``q``.
    Copies: NumPy inputs are copied to the device and the results back; the tensor-core
    kernels read float16/bfloat16 arrays in place (32-bit word views); the SIMT kernels
    take bfloat16 inputs as float32 copies.
    Inputs are never written.
    """
    del deterministic  # the forward is deterministic by construction (no atomics)
    kind, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = _options.check_qkv(q, k, v)
    _check_backend(backend)
    launch_stream = _arrays.resolve_stream(stream, kind, q)
    with _arrays.stream_scope(launch_stream, kind, q):   # the library's own work of the call runs there too
        acc, opts = _setup(kind, q, batch, seqlen_q, seqlen_k, nheads, headdim, launch_stream, block_q, block_k,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           attn_mask=attn_mask, attn_bias=attn_bias, alibi_slopes=alibi_slopes, softcap=softcap,
                           block_mask=block_mask, block_mask_size=block_mask_size, dropout_p=dropout_p, seed=seed)
        refusal = _tensorcore_refusal(kind, headdim, block_q, block_k)
        if refusal is None and backend != "simt":
            tq, tk = default_tc_tiles(headdim, block_q, block_k)
            refusal = _shared_refusal(tc_shared_bytes(tq, tk, headdim),
                                      f"its forward with block_q={tq}, block_k={tk}, head dim {headdim}")
        words = None
        if refusal is None and backend != "simt":
            words, refusal = _word_views((q, k, v), ("q", "k", "v"), kind, launch_stream)
        if _pick_backend(backend, refusal):
            out_ret, out_d = _arrays.empty_like_kind(kind, (batch, seqlen_q, nheads, headdim), kind.dtype, q,
                                                     launch_stream, bits=True)
            lse_ret, lse_d = _arrays.empty_like_kind(kind, (batch, nheads, seqlen_q), "float32", q, launch_stream)
            _forward_tc(*words, _arrays.word_view(out_d), lse_d, opts, tq, tk, kind.dtype, launch_stream)
            out = _arrays.finish(kind, out_ret, out_d, launch_stream)
            return (out, _arrays.finish(kind, lse_ret, lse_d, launch_stream)) if return_lse else out
        bq, bk = _tiles(block_q, block_k, headdim, acc.__name__)
        qd, kd, vd = _prepare((q, k, v), kind, launch_stream)
        out_ret, out_d = _arrays.empty_like_kind(kind, (batch, seqlen_q, nheads, headdim), kind.dtype, q,
                                                 launch_stream)
        out_k = out_d if kind.dtype != "bfloat16" else _arrays.scratch(out_d.shape, np.float32, kind, q, launch_stream)
        lse_ret, lse_d = _arrays.empty_like_kind(kind, (batch, nheads, seqlen_q), acc.__name__, q, launch_stream)
        _forward(qd, kd, vd, out_k, lse_d, opts, bq, bk, acc, launch_stream)
        if kind.dtype == "bfloat16":
            out_ret.copy_(_torch_from(out_k))
        out = _arrays.finish(kind, out_ret, out_d, launch_stream)
        if return_lse:
            return out, _arrays.finish(kind, lse_ret, lse_d, launch_stream)
        return out


def _forward(q, k, v, out, lse, opts, bq, bk, acc, stream):
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return
    f = opts.flags
    kern, shared, threads = make_forward(bq, bk, headdim, acc.__name__, f.has_window, f.has_attn_mask,
                                         f.has_block_mask, f.has_softcap, f.has_bias, f.has_alibi, f.has_dropout)
    _check_shared(shared, f"the forward with block_q={bq}, block_k={bk}, head dim {headdim}")
    grid = -(-seqlen_q // bq) * nheads * batch           # 1-D: (query tile, head, batch), tile fastest
    launch(kern, grid, threads, stream, shared,
           (q, k, v, out, lse, nheads // nheads_k, seqlen_k - seqlen_q) + opts.kernel_args(acc))


def _forward_tc(q, k, v, out, lse, opts, bq, bk, dtype_name, stream):
    """The tensor-core forward on uint32 word views of q, k, v, out (``forward_tc``)."""
    batch, seqlen_q, nheads, words = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return
    f = opts.flags
    vec16 = all(_arrays.rows_aligned16(x) for x in (q, k, v))          # 16-byte cp.async, else 4-byte
    mt = tc_m_tiles(bq, 2 * words)
    kern, shared, threads = make_forward_tc(bq, bk, 2 * words, dtype_name, vec16, mt, tc_q_in_smem(mt, 2 * words),
                                            f.has_window, f.has_attn_mask, f.has_block_mask, f.has_softcap,
                                            f.has_bias, f.has_alibi, f.has_dropout, tc_positive_scale(opts.scale),
                                            tc_longest_first(f.has_window), tc_mask32(f.has_window))
    _check_shared(shared, f"the tensor-core forward with block_q={bq}, block_k={bk}, head dim {2 * words}")
    grid = -(-seqlen_q // bq) * nheads * batch
    launch(kern, grid, threads, stream, shared,
           (q, k, v, out, lse, nheads // nheads_k, seqlen_k - seqlen_q) + opts.kernel_args(np.float32))


def flash_attention_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                             attn_mask=None, attn_bias=None, alibi_slopes=None, softcap=0.0, block_mask=None,
                             block_mask_size=(128, 128), dropout_p=0.0, seed=0, block_q=None, block_k=None,
                             deterministic=False, stream=None, backend="auto"):
    """Gradients ``(dq, dk, dv)`` of ``sum(out * dout)`` for ``out, lse = flash_attention(..., return_lse=True)``.

    The same options as the forward (they must match the forward call). ``dk``, ``dv`` are summed over
    the query heads that share a key/value head. ``deterministic=True`` computes dQ in a second pass
    over key tiles (bit-identical run to run); the default adds each key tile's share of dQ with
    float atomics (faster; the summation order may vary run to run). Returns arrays of ``q``'s kind;
    the same copies as ``flash_attention``. ``backend``: "tensorcore" runs the tensor-core backward
    (float16/bfloat16, even head dims, tiles >= 16, block_k <= 64 above head dim 128, atomic dQ),
    refusing with a ValueError what it cannot serve; "simt" the SIMT one; "auto" the tensor-core
    backward where it can serve the call, else the SIMT one (``deterministic=True`` always runs on SIMT).
    """
    kind, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = _options.check_qkv(q, k, v)
    _check_backend(backend)
    for x, name, shape in ((dout, "dout", tuple(q.shape)), (out, "out", tuple(q.shape)),
                           (lse, "lse", (batch, nheads, seqlen_q))):
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
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    launch_stream = _arrays.resolve_stream(stream, kind, q)
    with _arrays.stream_scope(launch_stream, kind, q):   # the library's own work of the call runs there too
        acc, opts = _setup(kind, q, batch, seqlen_q, seqlen_k, nheads, headdim, launch_stream, block_q, block_k,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           attn_mask=attn_mask, attn_bias=attn_bias, alibi_slopes=alibi_slopes, softcap=softcap,
                           block_mask=block_mask, block_mask_size=block_mask_size, dropout_p=dropout_p, seed=seed)
        refusal = _tensorcore_refusal(kind, headdim, block_q, block_k)
        if refusal is None and backend != "simt":
            tq, tk = default_tc_bwd_tiles(headdim, block_q, block_k)
            threads = tc_bwd_threads(tq, tk, headdim)
            if threads > 256:
                refusal = (f"block_k={tk} at head dim {headdim} needs {threads} threads of ~240 registers, "
                           "more than an SM has; above head dim 128 it takes block_k up to 64")
            else:
                refusal = _shared_refusal(tc_bwd_shared_bytes(tq, tk, headdim),
                                          f"its dK/dV kernel with block_q={tq}, block_k={tk}, head dim {headdim}")
        if refusal is None and deterministic:
            refusal = "its dQ is summed with atomics; deterministic=True needs backend='simt' (or 'auto')"
        words = None
        if refusal is None and backend in ("auto", "tensorcore"):
            words, refusal = _word_views((dout, q, k, v, out), ("dout", "q", "k", "v", "out"), kind, launch_stream)
        if _pick_backend(backend, refusal):
            lse_d = _arrays.to_device(lse, launch_stream)
            grads = [_arrays.empty_like_kind(kind, shape, kind.dtype, q, launch_stream, bits=True)
                     for shape in ((batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
                                   (batch, seqlen_k, nheads_k, headdim))]
            _backward_tc(*words, lse_d, *(_arrays.word_view(view) for _, view in grads), opts, tq, tk, kind.dtype,
                         launch_stream, kind, q)
            return tuple(_arrays.finish(kind, ret, view, launch_stream) for ret, view in grads)
        bq, bk = _tiles(block_q, block_k, headdim, acc.__name__, backward=True)
        dd, qd, kd, vd, od = _prepare((dout, q, k, v, out), kind, launch_stream)
        lsed = _arrays.to_device(lse, launch_stream)
        grads = []
        for shape in ((batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
                      (batch, seqlen_k, nheads_k, headdim)):
            ret, view = _arrays.empty_like_kind(kind, shape, kind.dtype, q, launch_stream)
            kernel_view = view if kind.dtype != "bfloat16" else _arrays.scratch(shape, np.float32, kind, q, launch_stream)
            grads.append((ret, view, kernel_view))
        _backward(dd, qd, kd, vd, od, lsed, grads[0][2], grads[1][2], grads[2][2], opts, bq, bk, acc, launch_stream,
                  deterministic, kind, q)
        result = []
        for ret, view, kernel_view in grads:
            if kind.dtype == "bfloat16":
                ret.copy_(_torch_from(kernel_view))
            result.append(_arrays.finish(kind, ret, view, launch_stream))
        return tuple(result)


def _backward(dout, q, k, v, out, lse, dq, dk, dv, opts, bq, bk, acc, stream, deterministic, kind, like):
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if batch == 0 or nheads == 0:
        return
    f = opts.flags
    flags = (f.has_window, f.has_attn_mask, f.has_block_mask, f.has_softcap, f.has_bias, f.has_alibi,
             f.has_dropout)
    group, off = nheads // nheads_k, seqlen_k - seqlen_q
    args = opts.kernel_args(acc)
    delta, lse2 = (_arrays.scratch((batch, nheads, seqlen_q), acc, kind, like, stream) for _ in range(2))
    if seqlen_q > 0:
        tc = preprocess_threads(headdim)
        launch(make_preprocess(acc.__name__, None, tc), preprocess_grid(seqlen_q, nheads, batch, tc),
               PREPROCESS_THREADS, stream, 0, (dout, out, lse, delta, lse2))
    # atomics need the dQ partial product's rows to cover the query tile (BLOCK_Q >= threads per key side)
    atomic = not deterministic and bq >= tile_threads(bk, "rows") and seqlen_q > 0
    if atomic:
        dq_accum = _arrays.scratch(dq.shape, acc, kind, like, stream)
        memset_zero(dq_accum, stream)
    else:
        dq_accum = _arrays.scratch((1, 1, 1, 1), acc, kind, like, stream)
    if seqlen_k > 0:
        kern, shared, threads = make_dkdv(bq, bk, headdim, acc.__name__, atomic, *flags)
        _check_shared(shared, f"the dK/dV kernel with block_q={bq}, block_k={bk}, head dim {headdim}")
        launch(kern, -(-seqlen_k // bk) * nheads_k * batch, threads, stream, shared,
               (q, k, v, dout, lse2, delta, dk, dv, dq_accum, group, off) + args)
    if seqlen_q == 0:
        return
    if atomic:
        cast = make_cast(acc.__name__)
        launch(cast, cast_grid(batch * seqlen_q * nheads * headdim), CAST_THREADS, stream, 0,
               (_arrays.flat(dq_accum), _arrays.flat(dq)))
    else:
        kern, shared, threads = make_dq(bq, bk, headdim, acc.__name__, *flags)
        _check_shared(shared, f"the dQ kernel with block_q={bq}, block_k={bk}, head dim {headdim}")
        launch(kern, -(-seqlen_q // bq) * nheads * batch, threads, stream, shared,
               (q, k, v, dout, lse2, delta, dq, group, off) + args)


def _backward_tc(dout, q, k, v, out, lse, dq, dk, dv, opts, bq, bk, dtype_name, stream, kind, like):
    """The tensor-core backward on uint32 word views (``backward_tc``); dQ through a float32 accumulator."""
    batch, seqlen_q, nheads, words = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if batch == 0 or nheads == 0:
        return
    f = opts.flags
    delta, lse2 = (_arrays.scratch((batch, nheads, seqlen_q), np.float32, kind, like, stream) for _ in range(2))
    if seqlen_q > 0:
        tc = preprocess_threads(words)
        launch(make_preprocess("float32", dtype_name, tc), preprocess_grid(seqlen_q, nheads, batch, tc),
               PREPROCESS_THREADS, stream, 0, (dout, out, lse, delta, lse2))
    dq_accum = _arrays.scratch((batch, seqlen_q, nheads, 2 * words), np.float32, kind, like, stream)
    if seqlen_q > 0:
        memset_zero(dq_accum, stream)
    if seqlen_k > 0:
        vec16 = all(_arrays.rows_aligned16(x) for x in (dout, q, k, v))
        kern, shared, threads = make_dkdv_tc(bq, bk, 2 * words, dtype_name, vec16, f.has_window, f.has_attn_mask,
                                             f.has_block_mask, f.has_softcap, f.has_bias, f.has_alibi,
                                             f.has_dropout, tc_bwd_dim_split(bq, bk, 2 * words), _red2(),
                                             MTK=tc_bwd_key_tiles(bq, bk, 2 * words),
                                             SHARE=tc_bwd_share(bq, bk, 2 * words))
        _check_shared(shared, f"the tensor-core dK/dV kernel with block_q={bq}, block_k={bk}, head dim {2 * words}")
        launch(kern, -(-seqlen_k // bk) * nheads_k * batch, threads, stream, shared,
               (q, k, v, dout, lse2, delta, dk, dv, dq_accum, nheads // nheads_k, seqlen_k - seqlen_q)
               + opts.kernel_args(np.float32))
    if seqlen_q > 0:
        launch(make_cast_tc(dtype_name), cast_grid(batch * seqlen_q * nheads * words), CAST_THREADS, stream, 0,
               (_arrays.flat(dq_accum), _arrays.flat(dq)))


def _red2():
    """Vector float32 reductions (red.global.add.v2.f32) exist from compute capability 9.0; the simulator's twin
    is two atomics."""
    return SIMULATOR or compute_capability() >= (9, 0)


def _check_backend(backend):
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")


def _torch_from(device_array):
    import torch
    return torch.as_tensor(device_array, device="cuda")
