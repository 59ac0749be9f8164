"""Launch plans: from a validated call to the kernels, tiles and grids that serve it.

``api`` validates a call and describes it as a ``Call`` (shapes, dtype, options' flags, the caller's tiles and
backend, the arrays' layout): everything the choice depends on, and nothing else, so a ``Call`` is hashable and
equal calls get equal plans (the key a dispatch cache can reuse).  ``forward(call)`` and ``backward(call)``
return an immutable plan: the backend, the tiles, and each launch as (kernel, grid, threads, shared bytes);
``api`` then allocates, builds the argument tuples (``ForwardPlan.args``, ``BackwardPlan.*_args``) and
launches.  Why the tensor cores cannot serve a call, and why a kernel does not fit the device, is decided here
and raised from here (``ValueError``), before any array is allocated.

The tile and variant heuristics of both backends live here too, each with the measurement behind it
(docs/performance.md; the version history in docs/notes/tensorcore.md).  The device's limits (shared memory
per block, compute capability) are read from the current device; a cache of plans must key on the device too.
"""
import math
from functools import lru_cache
from typing import NamedTuple, Optional

import numpy as np

from . import _options
from ._options import Flags
from .kernels._jit import SIMULATOR, compute_capability, shared_limit
from .kernels._tiles import np_acc
from .kernels.backward import (CAST_THREADS, PREPROCESS_THREADS, cast_grid, make_cast, make_dkdv, make_dq,
                               make_preprocess, preprocess_grid, preprocess_threads)
from .kernels.backward_tc import dq_frag_shape, make_cast_frag, make_cast_tc, make_dkdv_tc
from .kernels.forward import LOG2E, make_forward, tile_threads
from .kernels.forward_tc import make_forward_tc
from .kernels import forward_fp8 as _fp8
from .kernels.tf32_prepare import PREP_THREADS, make_prepare_tf32, prepare_tf32_grid, tf32_head_words
from .kernels._tma import tensor_maps
from .kernels import decode as _decode

BACKENDS = ("simt", "tensorcore", "wgmma")


class Call(NamedTuple):
    """What decides a plan.  ``block_q``, ``block_k``: the caller's (None: the default); ``backend``: the
    caller's ("auto", "simt", "tensorcore"); ``positive_scale``: ``tc_positive_scale(scale)``; ``layout``:
    for a call the tensor cores may serve, ``(the first array with no word view or None, every row 16-byte
    aligned)`` of its 16-bit arrays
    (``api`` probes it only where ``wants_words`` says so), else None.  ``total_q``: a packed (varlen) batch's
    total query rows (``flashnb.varlen``; ``seqlen_q``, ``seqlen_k`` are then the longest sequence's and the
    kernels are built with ``VARLEN``), None for a dense batch.  ``precision``: float32 on the tensor cores,
    ``"highest"`` (3xTF32) or ``"high"`` (one tf32 product); the other dtypes ignore it."""
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    flags: Flags
    positive_scale: bool
    block_q: Optional[int]
    block_k: Optional[int]
    backend: str
    deterministic: bool = False
    layout: Optional[tuple] = None
    total_q: Optional[int] = None
    precision: str = "highest"


class Launch(NamedTuple):
    kernel: object
    grid: int
    threads: int
    shared: int


class ForwardPlan(NamedTuple):
    call: Call
    backend: str                    # "tensorcore" or "simt"
    block_q: int
    block_k: int
    acc: str                        # lse's dtype; the SIMT kernel's accumulation type
    forward: Optional[Launch]       # None: nothing to compute (no batch, query or head)
    tma: bool = False               # the Hopper forward's tiles come by the copy engine: tensor maps of q, k, v
    prepare: object = None          # float32 on tf32 wgmma: the pre-pass kernel making k, v's tf32 operands
                                    # (``prepare_launch``: its launch for the arrays of a call)

    def args(self, q, k, v, out, lse, opts, stream=0):
        """The forward kernel's arguments; with ``prepare``, ``k`` and ``v`` are its outputs (``kk``, ``vt``).
        ``stream``: the raw ``CUstream`` the kernel runs on (the tensor maps are copied there)."""
        args = (q, k, v, out, lse) + _group_off(self.call) + opts.kernel_args(np.dtype(self.acc).type)
        if self.backend != "tensorcore":
            return args
        if not self.tma:       # (the kernel's cp.async copies read no tensor map)
            return args + (_options._dummy(2, np.uint64),)
        packed = self.call.total_q is not None        # (a packed batch's views: batch stride 0, one batch mapped)
        v_rows = self.block_k if self.prepare is None else tf32_head_words(self.call.headdim)   # (V^T: dims)
        return args + (tensor_maps(((q, self.block_q), (k, self.block_k), (v, v_rows)), packed, stream),)

    def prepare_launch(self, batch, seqlen_k, nheads_k):
        """The pre-pass's launch over K and V of that shape (``kernels.tf32_prepare``), or None: nothing to make."""
        grid = prepare_tf32_grid(batch, seqlen_k, nheads_k, self.call.headdim)
        return Launch(self.prepare, grid, PREP_THREADS, 0) if grid else None


class BackwardPlan(NamedTuple):
    call: Call
    backend: str
    block_q: int
    block_k: int
    acc: str                        # delta's, lse2's and the dQ accumulator's dtype
    preprocess: Optional[Launch]    # delta = rowsum(dO * O), lse in base 2
    dkdv: Optional[Launch]          # dK, dV (and with ``atomic`` dQ's partial sums)
    atomic: bool                    # dQ summed with atomics into an accumulator, which ``finish`` casts
    finish: Optional[Launch]        # the accumulator's cast, or the dQ pass (atomic False)
    dq_frag: Optional[tuple] = None  # the fragment-ordered dQ accumulator's shape (``dq_frag_shape``)
    tma: bool = False               # the Hopper dK/dV kernel's Q_i, dO_i come by the copy engine: maps of q, dout

    def accum_shape(self):
        """The dQ accumulator's shape: ``(batch, seqlen_q, nheads, headdim)``, or the fragment-ordered one."""
        c = self.call
        return self.dq_frag or (c.batch, c.seqlen_q, c.nheads, c.headdim)

    def cast_args(self):
        """The accumulator's cast's arguments after the two flat arrays (the fragment-ordered one's sizes)."""
        if self.dq_frag is None:
            return ()
        c = self.call
        return c.nheads, c.seqlen_q, self.dq_frag[2], self.dq_frag[3], c.headdim

    def dkdv_args(self, q, k, v, dout, lse2, delta, dk, dv, dq_accum, opts, stream=0):
        """The dK/dV kernel's arguments; ``stream``: the raw ``CUstream`` it runs on (``tma``'s maps are copied
        there)."""
        args = (q, k, v, dout, lse2, delta, dk, dv, dq_accum) + _group_off(self.call) + self._options(opts)
        if self.backend != "tensorcore":
            return args
        return args + (tensor_maps(((q, self.block_q), (dout, self.block_q)), False, stream) if self.tma
                       else _options._dummy(2, np.uint64),)

    def dq_args(self, q, k, v, dout, lse2, delta, dq, opts):
        return (q, k, v, dout, lse2, delta, dq) + _group_off(self.call) + self._options(opts)

    def _options(self, opts):
        return opts.kernel_args(np.dtype(self.acc).type)


def _group_off(call):
    """Query heads per key/value head, and the bottom-right alignment's offset seqlen_k - seqlen_q."""
    return call.nheads // call.nheads_k, call.seqlen_k - call.seqlen_q


def _flag_args(flags):
    return (flags.has_window, flags.has_attn_mask, flags.has_block_mask, flags.has_softcap, flags.has_bias,
            flags.has_alibi, flags.has_dropout)


def check_backend(backend):
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")


PRECISIONS = ("highest", "high")


def check_precision(precision):
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


# ------------------------------------------------------------------------------------------------ plans
def wants_words(call, backward=False):
    """Whether the tensor cores may serve the call, so that ``api`` should make the word views and probe the
    layout: asked for (or "auto") and nothing but the layout against them."""
    return call.backend != "simt" and _tc_choice(call, backward)[1] is None


def forward(call):
    """The forward's plan: the tensor-core kernel where it can serve the call (forced, or "auto"), else SIMT."""
    tiles, refusal = _tc_choice(call, False)
    if _use_tensor_cores(call, refusal):
        bq, bk = tiles
        tma = _tma(call)
        launch = _forward_tc_launch(call, bq, bk, tma)
        prepare = None
        if launch is not None and call.dtype == "float32" and _hopper(call):
            prepare = make_prepare_tf32(call.headdim, call.precision == "highest")
        return ForwardPlan(call, "tensorcore", bq, bk, "float32", launch, tma, prepare)
    acc = _acc(call.dtype)
    bq, bk = _simt_tiles(call, acc, backward=False)
    return ForwardPlan(call, "simt", bq, bk, acc, _forward_simt_launch(call, bq, bk, acc))


def backward(call):
    """The backward's plan: the tensor-core dK/dV kernel with atomic dQ where it can serve the call, else the
    SIMT kernels (atomic dQ, or a second pass over key tiles with ``deterministic`` or small query tiles)."""
    tiles, refusal = _tc_choice(call, True)
    if _use_tensor_cores(call, refusal):
        return _backward_tc_plan(call, *tiles)
    acc = _acc(call.dtype)
    bq, bk = _simt_tiles(call, acc, backward=True)
    return _backward_simt_plan(call, bq, bk, acc)


# Small queries (decoding, speculative decoding, a chunked prefill's tail) over a KV head: "auto" runs them on the
# split-KV decode kernels (``flashnb.kvcache``'s), which spread each sequence's keys over the SMs, where the generic
# forward's grid has one block per query tile and head and leaves most SMs idle.  Rows are query tokens x the query
# heads of a KV head (GQA packed into one block, as the decode kernel does).
SPLIT_KV_MAX_ROWS = 16
SPLIT_KV_DTYPES = ("float16", "bfloat16", "float32")


def split_kv(dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, backend, tiles_given, plain):
    """Whether ``flash_attention`` runs the call on the split-KV decode kernels: ``backend="auto"``, no tiles
    asked for, ``plain`` (no attn_mask, attn_bias, block_mask or dropout: the decode kernels serve causal,
    windows, softcap and ALiBi), a dtype they take (16-bit: an even head dim), at most ``SPLIT_KV_MAX_ROWS``
    query rows per KV head, and something to compute (empty calls keep the generic path's conventions)."""
    return (backend == "auto" and not tiles_given and plain and dtype in SPLIT_KV_DTYPES
            and (dtype == "float32" or headdim % 2 == 0) and batch > 0 and seqlen_q > 0 and seqlen_k > 0
            and nheads > 0 and seqlen_q * (nheads // nheads_k) <= SPLIT_KV_MAX_ROWS)


def _use_tensor_cores(call, refusal):
    """True for the tensor-core kernels: forced, or "auto" with nothing against them (the layout included)."""
    if refusal is None and call.backend != "simt":
        assert call.layout is not None, "api probes the layout where wants_words says so"
        refusal = _layout_refusal(call.layout)
    if call.backend in ("tensorcore", "wgmma") and refusal is not None:
        raise ValueError(f"backend={call.backend!r} cannot serve this call: {refusal}")
    return refusal is None and call.backend in ("auto", "tensorcore", "wgmma")


def _acc(dtype):
    """The SIMT kernels' accumulation type: float64 for float64, else float32 (bfloat16 through float32 copies)."""
    return "float32" if dtype == "bfloat16" else np_acc(dtype).__name__


def _empty(call, backward):
    return call.batch == 0 or call.nheads == 0 or (call.seqlen_q == 0 and not backward)


def _forward_tc_launch(call, bq, bk, tma):
    if _empty(call, False):
        return None
    d = call.headdim
    if _hopper(call):
        mt, qs, extra = 1, True, {"WGMMA": True, "TMA": tma,
                                  **_wgmma_tf32_keywords(call.dtype, call.precision, call.headdim),
                                  **_two_blocks(call, bq)}
    else:
        mt, qs, extra = _tc_forward_variant(bq, d, call.dtype, call.precision)
    kern, shared, threads = make_forward_tc(bq, bk, d, call.dtype, call.layout[1], mt, qs,
                                            *_flag_args(call.flags), call.positive_scale, **_varlen(call), **extra,
                                            **_section(call, LPT_SECTION_FWD, 1))
    check_shared(shared, f"the tensor-core forward with block_q={bq}, block_k={bk}, head dim {d}")
    return Launch(kern, _query_tiles(call, bq), threads, shared)


def _forward_simt_launch(call, bq, bk, acc):
    if _empty(call, False):
        return None
    kern, shared, threads = make_forward(bq, bk, call.headdim, acc, *_flag_args(call.flags), **_varlen(call))
    check_shared(shared, f"the forward with block_q={bq}, block_k={bk}, head dim {call.headdim}")
    return Launch(kern, _query_tiles(call, bq), threads, shared)


def _varlen(call):
    """The kernel factories' ``VARLEN`` keyword for a packed batch, and ``MODS`` for a ``flex_attention`` call;
    none for a dense call without them, so that the factories' ``lru_cache`` sees the same call as from
    everywhere else (one compiled kernel, not two)."""
    kw = {} if call.total_q is None else {"VARLEN": True}
    if call.flags.mods is not None:
        kw["MODS"] = call.flags.mods
    return kw


# the tensor-core kernels' blocks longest first on a window (causal) over a dense batch, in sections of this
# many (head, batch) pairs (``_tiles.make_tile_order``); 0: tile fastest.  Measured on the H100
# (bench/results/h100-block-order-2026-11-26.md, python -m tools.plan_ab, causal, 4 rounds, against SDPA's
# FlashAttention-2 / memory-efficient backends): forward+backward with the backward at 0 -> 8 (N 2048 / 4096)
# 0.943-0.981x -> 0.974-1.019x at d 128, 0.909-0.936x -> 0.940-0.965x at 256, float32 1.103x -> 1.130x at d 128;
# the forward 1-11% less time with 8 at every 16-bit head dim and N 2048-4096 (d 64 N 2048 1.039x -> 1.054x,
# d 128 1.369x -> 1.484x, 256 1.748x -> 1.851x at 4096); 4 and 16 within 5% of 8, either way
LPT_SECTION_FWD = 8
LPT_SECTION_BWD = 8


# a flex call's mask_mod takes the same block order (``_section``): its kept blocks usually follow causal's
# direction (causal, documents, prefix-LM, causal windows), and the order costs speed, never results, where they do
# not.  Bits: 1 the forward, 2 the dK/dV kernel.  Measured with FLEX_MASK_NARROW (below; H200, bf16, 16k tokens,
# bench/results/h200-flex-2026-11-28g.md): in the forwards both help every case (d 128 causal 2.36 -> 2.19 ms,
# ALiBi 3.01 -> 2.86, document 0.76 -> 0.69); in the dK/dV kernel the order was within noise (d 128 causal 8.59 ->
# 8.70, document 2.55 -> 2.49 forward+backward): the forward's only (1).  compute-sanitizer memcheck, racecheck
# and synccheck on those forwards: 0 errors (H200, 2026-11-29, bench/results/h200-fp8-2026-11-29.md)
FLEX_SECTION = 1


def _section(call, section, bit):
    """The tensor-core factories' ``SECTION`` keyword: ``section`` where the blocks' work differs by tile (a
    window, causal among them; with ``FLEX_SECTION`` a flex call's mask_mod) in a dense batch; none elsewhere (the
    factories' ``lru_cache`` as in ``_varlen``).  The kernels take causal's direction (the forward's last query
    tiles longest, the dK/dV kernel's first key tiles); for a window bounded on the left only it is the reverse,
    which costs speed, not results."""
    mods = call.flags.mods
    flex = bool(int(FLEX_SECTION) & bit) and mods is not None and mods.mask_mod is not None
    return {"SECTION": section} if section and (call.flags.has_window or flex) and call.total_q is None else {}


def _rows(call):
    """(batch, rows) of the per-row work (the backward's preprocess, the dQ cast): a packed batch is one
    sequence of ``total_q`` rows there."""
    return (call.batch, call.seqlen_q) if call.total_q is None else (1, call.total_q)


def _query_tiles(call, bq):
    """Blocks of a kernel over (query tile, head, batch), tile fastest."""
    return -(-call.seqlen_q // bq) * call.nheads * call.batch


def _key_tiles(call, bk):
    """Blocks of a kernel over (key tile, key/value head, batch)."""
    return -(-call.seqlen_k // bk) * call.nheads_k * call.batch


def _preprocess_launch(call, acc, words_of):
    if call.seqlen_q == 0:
        return None
    ncols = call.headdim // 2 if words_of in ("float16", "bfloat16") else call.headdim   # (float32: a value a word)
    tc = preprocess_threads(ncols)
    batch, rows = _rows(call)
    return Launch(make_preprocess(acc, words_of, tc), preprocess_grid(rows, call.nheads, batch, tc),
                  PREPROCESS_THREADS, 0)


def _cast_launch(kern, n):
    return Launch(kern, cast_grid(n), CAST_THREADS, 0)


# the tensor-core dK/dV kernels' element step with a score option or a mod as straight-line code
# (``make_dkdv_tc(FAST_GRAD=True)``: P by one MUFU.EX2 as in the forward, a masked element's exponent -inf by a
# select, not a branch around it): ncu on an H200 (bench/results/h200-flex-2026-11-28f.md, call 2) showed flex
# ALiBi's dK/dV kernel at 2994 M warp instructions against the dense ALiBi option's 2389 M, a branch, two
# shared loads and a constant load an element, and both with math.exp2's range check (4 instructions an element);
# measured there (call 3, python -m tools.flex_ab --headdims 128, bf16, 16k) forward+backward flex ALiBi 13.12 ->
# 9.74 ms, flex softcap 22.08 -> 18.76, the dense softcap option 21.48 -> 18.75 (against PyTorch's compiled flex in
# one run, call 4: ALiBi 1.06x, softcap 1.09x); the gradients bit for bit the same in the simulator, on the GPU
# within dQ's atomics' order
BWD_FAST_GRAD = True


def _fast_grad(call):
    """``FAST_GRAD`` for the tensor-core dK/dV kernels where an element step runs ``make_element_grad``: a score
    option or a mod (the plain kernels keep their keywords, and so their compiled and cached kernels)."""
    f = call.flags
    step = f.has_softcap or f.has_bias or f.has_alibi or f.has_dropout or f.mods is not None
    return {"FAST_GRAD": True} if BWD_FAST_GRAD and step else {}


def _backward_tc_plan(call, bq, bk):
    if _hopper_backward(call, bk) and call.block_q is None:
        bq = wgmma_bwd_block_q(call.headdim, call.total_q is not None)
    if _empty(call, True):
        return BackwardPlan(call, "tensorcore", bq, bk, "float32", None, None, True, None)
    d, words = call.headdim, call.headdim // (1 if call.dtype == "float32" else 2)
    dkdv = None
    frag = None
    tma = False
    if call.seqlen_k > 0 and _hopper_backward(call, bk):
        if WGMMA_DQ_FRAG and call.total_q is None:
            frag = dq_frag_shape(call.batch, call.nheads, call.seqlen_q, d, bq, wgmma_bwd_dim_split(d), True)
        tma = WGMMA_BWD_TMA and call.total_q is None
        kern, shared, threads = make_dkdv_tc(bq, bk, d, call.dtype, True, *_flag_args(call.flags),
                                             wgmma_bwd_dim_split(d), _red2(), DEFER_DQ=False, WGMMA=True,
                                             **_varlen(call), **_section(call, LPT_SECTION_BWD, 2), **_exchange(d),
                                             **({"DQ_FRAG": True} if frag else {}), **_dq_wgmma(frag, bq, d),
                                             **({"TMA": True} if tma else {}), **_fast_grad(call))
        check_shared(shared, f"the Hopper dK/dV kernel with block_q={bq}, block_k={bk}, head dim {d}")
        dkdv = Launch(kern, _key_tiles(call, bk), threads, shared)
    elif call.seqlen_k > 0:
        split, mtk, share = _tc_bwd_layout(bq, bk, d, call.dtype)
        if (TC_DQ_FRAG and call.total_q is None and call.dtype != "float32" and _red2()
                and d <= TC_DQ_FRAG_MAX_HEADDIM):
            frag = dq_frag_shape(call.batch, call.nheads, call.seqlen_q, d, bq, split, False)
        kern, shared, threads = make_dkdv_tc(bq, bk, d, call.dtype, call.layout[1], *_flag_args(call.flags),
                                             split, _red2(), MTK=mtk, SHARE=share, **_varlen(call),
                                             **_tf32_keywords(call.dtype, call.precision),
                                             **_section(call, LPT_SECTION_BWD, 2),
                                             **({"DQ_FRAG": True} if frag else {}), **_fast_grad(call))
        check_shared(shared, f"the tensor-core dK/dV kernel with block_q={bq}, block_k={bk}, head dim {d}")
        dkdv = Launch(kern, _key_tiles(call, bk), threads, shared)
    cast = None
    if call.seqlen_q > 0 and frag:
        cast = _cast_launch(make_cast_frag(call.dtype), frag[0] * frag[1] * frag[2] * frag[3] // 4)
    elif call.seqlen_q > 0:
        cast = _cast_launch(make_cast_tc(call.dtype), _rows(call)[0] * _rows(call)[1] * call.nheads * words)
    return BackwardPlan(call, "tensorcore", bq, bk, "float32", _preprocess_launch(call, "float32", call.dtype),
                        dkdv, True, cast, frag, tma)


def _hopper_backward(call, block_k):
    """Whether the backward runs the Hopper dK/dV kernel (``make_dkdv_tc(WGMMA=True)``): asked for
    (``backend="wgmma"``), or "auto" on compute capability 9.0 (``WGMMA_AUTO``) above head dim 48; 16-bit
    batches up to head dim 128 (dK's and dV's accumulators in one warp's registers; to 256 with
    ``WGMMA_BACKWARD_256``, two warps a 16 keys), dense (packed with ``WGMMA_BACKWARD_PACKED``), key tiles of
    whole warpgroups (64 keys), 16-byte rows; else the tensor-core one."""
    asked = call.backend == "wgmma" or (call.backend == "auto" and WGMMA_AUTO and not SIMULATOR
                                        and call.headdim > 48 and compute_capability() == (9, 0))
    return (WGMMA_BACKWARD and asked and call.dtype in ("float16", "bfloat16")
            and call.headdim <= (256 if WGMMA_BACKWARD_256 else 128) and call.headdim % 8 == 0 and block_k % 64 == 0
            and (call.total_q is None or WGMMA_BACKWARD_PACKED) and call.layout is not None and call.layout[1])


# measured on the H100 (bench/results/h100-hopper-bwd-2026-11-25.md, tools.tune_tc --pass bwd, N 4096): the
# Hopper dK/dV kernel against the mma.sync one, non-causal / causal: 5.18 / 2.89 ms against 5.38 / 2.90 at head
# dim 64 (64 x 128 tiles; 32 x 128: 6.00 / 3.49), 5.08 / 2.99 against 5.89 / 3.23 at 128 (32 x 128; 64 x 128
# spills there); its query tiles per head-dim class
WGMMA_BACKWARD = True
# 64 x 128 at head dim 128 (255 registers, 8 bytes of spill), with dQ by the warpgroups (WGMMA_DQ): measured on an
# H200 (bench/results/h100-bwd-dq-wgmma-2026-11-27.md, call 1, tools.tune_tc --pass bwd, N 4096) the backward 4.344 /
# 2.435 ms at 32 x 128 against 3.683 / 2.053 at 64 x 128 with dQ on mma.sync; packed batches, whose dQ stays on
# mma.sync (rows layout), measured 2% slower at 64 (python -m bench --varlen, H100, call 3) and keep 32
_WGMMA_BWD_BLOCK_Q = ((64, 64), (128, 64), (256, 32))
_WGMMA_BWD_BLOCK_Q_PACKED = ((64, 64), (128, 32), (256, 32))
# packed batches (VARLEN: the kernel's views sliced to the sequence, as the mma.sync kernel's): measured on the
# H100 (bench/results/h100-tf32-wgmma-2026-11-26.md, python -m bench --varlen, 16k tokens), the packed
# forward+backward 5.18 / 3.35 ms at head dim 64 (non-causal / causal) and 5.21 / 3.41 at 128, against 5.50 /
# 3.51 and 6.20 / 3.83 with the mma.sync dK/dV kernel (the run before); compute-sanitizer clean
WGMMA_BACKWARD_PACKED = True
# above head dim 128 (DSPLIT = 2: two warpgroups on the same 64 keys, each with half of dK's and dV's dims, both
# computing S^T and dP^T, as the mma.sync kernel's pairs of warps): measured on the H100 (same record,
# tools.tune_tc --pass bwd, N 4096, d 256) 7.21 / 4.04 ms against the mma.sync kernel's 7.45 / 4.09
WGMMA_BACKWARD_256 = True


# above head dim 128 the two warpgroups on the same keys each compute one of S^T, dP^T and swap them through shared
# memory (``make_dkdv_tc(EXCHANGE=True)``) instead of both computing both (1.4x the five products' tensor work):
# measured on the H100 (bench/results/h100-block-order-2026-11-26.md, python -m tools.plan_ab, d 256, N 2048 /
# 4096) forward+backward 4.9-6.3% less time, 0.852x / 0.889x -> 0.909x / 0.948x FlashAttention-2 (causal 0.902x /
# 0.922x -> 0.949x / 0.980x), timed first in each round (a bias of up to 6%); across runs the non-causal backward,
# which no block order touches, went from 0.75x to 0.81x FA2 (7.22 -> 6.66-6.68 ms, `python -m bench`); 186,880 bytes
# of shared memory, 244-246 registers, no spill
WGMMA_BACKWARD_EXCHANGE = True


# dQ's partial sums into an accumulator in the mma fragments' order (``make_dkdv_tc(DQ_FRAG=True)``, dense
# batches), one red.global.add.v4.f32 a lane covering four whole 128-byte lines, instead of 8 rows x 32 bytes a
# warp's reduction (one sector an L2 request, against FlashAttention-2's four): measured on the H100
# (bench/results/h100-dq-frag-2026-11-26.md, python -m tools.plan_ab, float16 and bfloat16, N 2048-4096)
# forward+backward 0.92-0.97x -> 1.08-1.13x FlashAttention-2 at head dim 256, 0.98-1.03x -> 1.09-1.15x at 128,
# 1.06-1.09x -> 1.15-1.17x at 64; the reductions alone ran at 3.3 TB/s against 1.85 (tools.dq_red_bound)
WGMMA_DQ_FRAG = True
# the same for the mma.sync 16-bit dK/dV kernel where red.global.add.v4.f32 exists (compute capability 9.0; on the
# H100 "auto" runs it up to head dim 48): measured there (same record, call 6, python -m tools.plan_ab --backend
# tensorcore, 2 rounds) forward+backward 0.982x / 1.012x -> 1.030x / 1.058x FlashAttention-2 at head dim 32
# (causal after the slash), 1.095x / 1.043x -> 1.141x / 1.087x at 48; above 48 not measured (the timing ran out)
# and ptxas spills more with it at 128 (168 bytes against 40), so those keep the rows layout
TC_DQ_FRAG = True
TC_DQ_FRAG_MAX_HEADDIM = 48


# dQ_i += dS K_j by the warpgroups too (``make_dkdv_tc(DQ_WGMMA=True)``: dS^T in swizzled rows, the MN-major A of
# wgmma, K_j's tile its B; no mma.sync phase, no second copy of K_j), where dQ's accumulator is in the fragments'
# order and a query tile is the 64 rows of a warpgroup's product (one warp per 16 keys: head dims up to 128):
# measured on the H100 (bench/results/h100-bwd-dq-wgmma-2026-11-27.md, call 2, python -m tools.plan_ab) forward+backward
# 1.185x / 1.150x -> 1.249x / 1.215x FlashAttention-2 at head dim 64 (causal after the slash), 1.294x / 1.278x ->
# 1.386x / 1.360x at 128 (bfloat16 1.303x / 1.289x -> 1.387x / 1.353x); compute-sanitizer clean
WGMMA_DQ = True
# Q_i and dO_i by the copy engine in dense batches (``make_dkdv_tc(TMA=True)``: two stages with full mbarriers, one
# block barrier an item instead of two, no cp.async from every thread, dS^T in two buffers): measured on the H100
# (bench/results/h100-bwd-tma-2026-11-28.md, call 1, python -m tools.plan_ab --settings
# "WGMMA_BWD_TMA=0;WGMMA_BWD_TMA=1") forward+backward 1.222x / 1.210x -> 1.255x / 1.344x FlashAttention-2 at head
# dim 64 (causal after the slash), 1.382x / 1.359x -> 1.464x / 1.455x at 128, 1.106x / 1.131x -> 1.151x / 1.231x
# at 256 (bfloat16 d 128 1.354x / 1.376x -> 1.461x / 1.447x); compute-sanitizer clean.  Packed batches keep cp.async
WGMMA_BWD_TMA = True
# (S^T with dP^T, and dV with dK, each pair issued together and waited for once: measured no faster on the H100,
# forward+backward 0-3.5% more time at head dims 64-256, bench/results/h100-bwd-dq-wgmma-2026-11-27.md call 4;
# removed: the code is in commit 84b0d03)


def _dq_wgmma(frag, block_q, headdim):
    """The Hopper dK/dV factory's ``DQ_WGMMA`` keyword where it applies and the flag is on."""
    return ({"DQ_WGMMA": True} if WGMMA_DQ and frag and block_q == 64 and wgmma_bwd_dim_split(headdim) == 1
            else {})


def _exchange(headdim):
    """The Hopper dK/dV factory's ``EXCHANGE`` keyword where its warpgroups split the dims and the flag is on."""
    return {"EXCHANGE": True} if WGMMA_BACKWARD_EXCHANGE and wgmma_bwd_dim_split(headdim) == 2 else {}


def wgmma_bwd_dim_split(headdim):
    """Warps per 16 keys of the Hopper dK/dV kernel: 2 above head dim 128 (``make_dkdv_tc``'s ``DSPLIT``)."""
    return 2 if headdim > 128 else 1


def wgmma_bwd_block_q(headdim, packed=False):
    """The Hopper dK/dV kernel's query tile for the head dim (its key tile is the tensor-core kernel's); a packed
    batch keeps ``_WGMMA_BWD_BLOCK_Q_PACKED`` (its dQ stays on mma.sync)."""
    return next(bq for max_d, bq in (_WGMMA_BWD_BLOCK_Q_PACKED if packed else _WGMMA_BWD_BLOCK_Q) if headdim <= max_d)


def _tf32_keywords(dtype, precision):
    """The tensor-core factories' float32 keyword: ``TF32X3`` for ``precision="highest"`` (none for 16-bit inputs,
    so that their kernels keep one cache key)."""
    return {"TF32X3": precision == "highest"} if dtype == "float32" else {}


def _backward_simt_plan(call, bq, bk, acc):
    if _empty(call, True):
        return BackwardPlan(call, "simt", bq, bk, acc, None, None, False, None)
    flags, d = _flag_args(call.flags), call.headdim
    # atomics need the dQ partial product's rows to cover the query tile (BLOCK_Q >= threads per key side)
    atomic = not call.deterministic and bq >= tile_threads(bk, "rows") and call.seqlen_q > 0
    dkdv = None
    if call.seqlen_k > 0:
        p_format = {"P_FORMAT": call.dtype} if call.dtype in ("float16", "bfloat16") else {}
        kern, shared, threads = make_dkdv(bq, bk, d, acc, atomic, *flags, **p_format, **_varlen(call))
        check_shared(shared, f"the dK/dV kernel with block_q={bq}, block_k={bk}, head dim {d}")
        dkdv = Launch(kern, _key_tiles(call, bk), threads, shared)
    finish = None
    if call.seqlen_q > 0 and atomic:
        finish = _cast_launch(make_cast(acc), _rows(call)[0] * _rows(call)[1] * call.nheads * d)
    elif call.seqlen_q > 0:
        kern, shared, threads = make_dq(bq, bk, d, acc, *flags, **_varlen(call))
        check_shared(shared, f"the dQ kernel with block_q={bq}, block_k={bk}, head dim {d}")
        finish = Launch(kern, _query_tiles(call, bq), threads, shared)
    return BackwardPlan(call, "simt", bq, bk, acc, _preprocess_launch(call, acc, None), dkdv, atomic, finish)


# ------------------------------------------------------------------------------------------------ refusals
def _tc_choice(call, backward):
    """(tiles, refusal): the tensor-core kernel's tiles for the call, and why it cannot serve it (None if it can,
    the layout aside); the checks in the order the caller reads them."""
    refusal = tensorcore_refusal(call.dtype, call.headdim, call.block_q, call.block_k)
    if refusal is None and call.dtype == "float32" and call.backend == "auto" and (backward or not _hopper(call)):
        # measured on the H100 (bench/results/h100-tf32-2026-11-25.md): the mma.sync 3xTF32 forward is 1.4x the SIMT
        # kernels' speed at head dim 64 but slower at 128, and 4-16x their error (the tensor cores' float32
        # accumulation); so float32 stays on SIMT unless the caller asks for the tensor cores, except for the
        # Hopper forward (``WGMMA_AUTO_FLOAT32``)
        refusal = "float32 runs on the tensor cores only when asked for (backend='tensorcore')"
    if refusal is None and call.backend == "wgmma" and not backward:      # ("auto" falls back to mma.sync)
        refusal = wgmma_refusal(call.dtype, call.headdim, call.block_q, call.block_k, call.layout,
                                call.total_q is not None)
    if refusal is not None or call.backend == "simt":
        return None, refusal
    d = call.headdim
    if not backward and _hopper(call):
        tq, tk = default_wgmma_tiles(d, call.block_q, call.block_k, call.dtype, call.precision)
        if _three_warpgroups(call):
            tq = 3 * 64
        return (tq, tk), shared_refusal(wgmma_shared_bytes(tq, tk, d, call.dtype, call.precision),
                                        f"its Hopper forward with block_q={tq}, block_k={tk}, head dim {d}")
    if not backward:
        tq, tk = default_tc_tiles(d, call.block_q, call.block_k, call.dtype, call.precision)
        return (tq, tk), shared_refusal(tc_shared_bytes(tq, tk, d, call.dtype, call.precision),
                                        f"its forward with block_q={tq}, block_k={tk}, head dim {d}")
    tq, tk = default_tc_bwd_tiles(d, call.block_q, call.block_k, call.dtype, call.precision)
    threads = tc_bwd_threads(tq, tk, d, call.dtype)
    if threads > 256:
        refusal = (f"block_k={tk} at head dim {d} needs {threads} threads of ~240 registers, "
                   "more than an SM has; above head dim 128 it takes block_k up to 64")
    else:
        refusal = shared_refusal(tc_bwd_shared_bytes(tq, tk, d, call.dtype, call.precision),
                                 f"its dK/dV kernel with block_q={tq}, block_k={tk}, head dim {d}")
    if refusal is None and call.deterministic:
        refusal = "its dQ is summed with atomics; deterministic=True needs backend='simt' (or 'auto')"
    return (tq, tk), refusal


def tensorcore_refusal(dtype, headdim, block_q, block_k):
    """Why the tensor-core kernels cannot serve a call (None if they can), from its dtype, head dim and tiles."""
    if dtype not in ("float16", "bfloat16", "float32"):
        return f"it computes float16, bfloat16 and float32 inputs only, got {dtype}"
    if headdim % 2 and dtype != "float32":
        return f"it needs an even head dim (pairs of values per 32-bit word), got {headdim}"
    for value, name in ((block_q, "block_q"), (block_k, "block_k")):
        if value is not None and value < 16:
            return f"{name} must be a multiple of 16 (the mma tile), got {value}"
    if not SIMULATOR and compute_capability() < (8, 0):
        return "mma.sync on float16/bfloat16/tf32 needs compute capability 8.0 or newer"
    return None


def wgmma_refusal(dtype, headdim, block_q, block_k, layout, packed=False):
    """Why the Hopper forward (``backend="wgmma"``) cannot serve a call (None if it can): 16-bit inputs, or float32
    on tf32 operands with ``WGMMA_TF32`` (dense batches: V^T's keys are relabelled in groups of 8 counted from
    the tensor's first key, not from each packed sequence's); its backward is ``_hopper_backward``'s choice."""
    if dtype == "float32" and WGMMA_TF32:
        if packed:
            return "its float32 forward serves dense batches only (backend='tensorcore' serves packed ones)"
        if headdim % 4 or headdim > 128:
            return f"its float32 forward needs a head dim that is a multiple of 4 (16-byte rows) up to 128, got {headdim}"
        if not WGMMA_TMA:
            return "its float32 forward's prepared operands come by the copy engine (WGMMA_TMA)"
    elif dtype not in ("float16", "bfloat16"):
        return f"its forward computes float16 and bfloat16 inputs only, got {dtype}"
    elif headdim % 8 or headdim > 256:
        return f"it needs a head dim that is a multiple of 8 (16-byte rows) up to 256, got {headdim}"
    if block_q is not None and block_q % 64:
        return f"block_q must be a multiple of 64 (a warpgroup's rows), got {block_q}"
    if layout is not None and layout[0] is None and not layout[1]:
        return "its copies need every row 16-byte aligned"
    if not SIMULATOR and compute_capability() != (9, 0):
        return "wgmma needs compute capability 9.0 (sm_90a)"
    return None


# (BLOCK_Q, BLOCK_K) of the Hopper forward per head-dim class: two warpgroups of 64 query rows; the keys as many
# as S's registers (BLOCK_K / 2 a thread) and two stages of K and V in shared memory allow
_WGMMA_TILES = ((64, (128, 128)), (128, (128, 128)), (256, (128, 64)))
_WGMMA_SIM_TILES = (64, 16)
# float32 on tf32 wgmma (``WGMMA_TF32``, backend="wgmma"; "auto" too since WGMMA_AUTO_FLOAT32), K's tf32 parts and
# V^T made once per call by a pre-pass: measured on the H100 (bench/results/h100-tf32-wgmma-2026-11-26.md,
# tools.tune_tc --dtype float32 --backend wgmma, N 4096, against SDPA's memory-efficient backend, non-causal /
# causal): "highest" 3.03x / 2.68x at head dim 64 (128 x 64), 1.42x / 1.30x at 128 (64 x 32: 3xTF32's small
# parts fill shared memory; with Q's in registers, below, 128 x 32); "high" 6.84x / 5.41x at 64 (128 x 128),
# 5.60x / 4.36x at 128 (128 x 64)
_WGMMA_TF32_TILES = {"highest": ((64, (128, 64)), (128, (64, 32))), "high": ((64, (128, 128)), (128, (128, 64)))}
WGMMA_TF32 = True
# "highest" above head dim 64 with Q's small parts in registers (``make_forward_tc(QS_REG=True)``: S's small-part
# product from registers, P V_j's partial by halves of the dims): Q's tile no longer needs twice its shared memory,
# so two warpgroups (128 x 32) fit at head dim 128.  Measured on the H100 (bench/results/h100-tf32-wgmma-2026-11-26.md,
# python -m bench --dtype float32, N 2048 / 4096, against SDPA's memory-efficient backend): forward 1.90x / 2.10x
# (causal 1.53x / 1.80x) against 64 x 32's 1.33x / 1.42x (1.18x / 1.30x), 0.51-0.92x the SIMT kernels' error
# (python -m tools.tf32_error; P V_j straight into acc: 8-16x), 255 registers and 120-136 bytes of spills.  At
# 64 it measured no faster (3.09x against 3.08x at N 4096, without the partial) with 52-74 more registers, so
# it starts above 64
WGMMA_TF32_QS_REG = True
WGMMA_TF32_QS_MIN_HEADDIM = 65
_WGMMA_TF32_QS_TILES = ((128, (128, 32)),)


def _qs_reg(dtype, precision, headdim):
    """Whether the Hopper tf32 forward keeps Q's small parts in registers (``WGMMA_TF32_QS_REG``)."""
    return (dtype == "float32" and precision == "highest" and WGMMA_TF32_QS_REG
            and WGMMA_TF32_QS_MIN_HEADDIM <= headdim <= 128)


def _wgmma_tf32_keywords(dtype, precision, headdim):
    """The Hopper forward's float32 keywords: ``_tf32_keywords``, and ``QS_REG`` where ``_qs_reg``."""
    kw = _tf32_keywords(dtype, precision)
    if _qs_reg(dtype, precision, headdim):
        kw["QS_REG"] = True
    return kw


# three warpgroups (BLOCK_Q 192) at head dim <= 64, where 384 threads' registers fit (at most 170 a thread): the
# dense 16-bit forward with no option at all (ptxas: 127-134 registers; causal 146-149; every option 196).
# Measured on the H100 (bench/results/h100-tf32-wgmma-2026-11-26.md, batch x N = 16k, 32 heads, d 64): 1.48x SDPA
# FlashAttention-2 at N 4096 against 128 x 128's 1.36x; causal 1.18x against 1.16x at 4096 but 0.70-1.01x against
# 0.86-1.05x at N 512-2048 (its diagonal tiles), so causal (any window) keeps two warpgroups.  Off since two
# warpgroups launch-bounded to two blocks an SM (``WGMMA_FWD_TWO_BLOCKS``) measured faster with no option too
# (bench/results/h100-block-order-2026-11-26.md, python -m tools.plan_ab, 4 rounds): 1.238x / 1.446x / 1.412x ->
# 1.650x / 1.777x / 1.591x FlashAttention-2 at N 1024 / 2048 / 4096 (bfloat16 at 4096 1.450x -> 1.621x)
WGMMA_THREE_WARPGROUPS = False   # (the suites switch it on where they test it)


# the Hopper forward at head dim 64 with two warpgroups (128 query rows), launch-bounded to two blocks an SM
# (128 registers a thread instead of 134 / 149, 16 / 108 bytes of spills, non-causal / causal: ptxas) so that one
# block's prologue, epilogue and barriers overlap the other's products.  Measured on the H100
# (bench/results/h100-block-order-2026-11-26.md, python -m tools.plan_ab, 4 rounds, against SDPA's
# FlashAttention-2): causal forward 0.917x / 1.037x / 1.182x -> 1.193x / 1.328x / 1.485x at N 1024 / 2048 / 4096
# (bfloat16 at 4096: 1.201x -> 1.472x), forward+backward 0.914-1.058x -> 0.972-1.080x.  Kernels with a score
# option or a mask, and packed batches, keep their registers (not measured; more of them would spill).
WGMMA_FWD_TWO_BLOCKS = True


# flex_attention with a mask_mod and no score_mod: the Hopper forward launch-bounded to two blocks an SM as the
# dense one (``_two_blocks``; ptxas: 154 registers -> 128 with 40 / 40 bytes of spills, causal, d 64).
# Measured on an H200 (bench/results/h200-flex-2026-11-28b.md, python -m tools.flex_ab, bf16, 16k tokens, d 64,
# forward / forward+backward ms): two blocks causal 3.63 / 11.99 -> 2.80 / 11.10, documents 1.77 / 4.86 -> 1.41 /
# 4.48, sliding 1024 1.24 / 3.13 -> 0.92 / 2.80.  The blocks in ``SECTION`` order on top (a setting of that run,
# since removed) moved each by -3% to +3%: flex calls keep the grid's order
FLEX_TWO_BLOCKS = True
# the same launch bounds for a flex call with a score_mod: measured on an H200 (bench/results/h200-flex-2026-11-28c.md,
# call 2, python -m tools.flex_ab --settings "FLEX_TWO_BLOCKS_SCORE=0;FLEX_TWO_BLOCKS_SCORE=1", 2 rounds, bf16, 16k
# tokens, d 64, the mods' arithmetic in float32) forward / forward+backward ms: ALiBi 5.38 / 21.29 -> 4.90 / 20.88,
# softcap 30 12.01 / 36.52 -> 9.43 / 33.93 (outputs equal)
FLEX_TWO_BLOCKS_SCORE = True
# a score_mod's indices as int32, clamped in int32 (``_scores.Mods.index32``: the tensor-core forward and the
# element gradient of the backward): ptxas, the Hopper forward with ALiBi, bf16 d 64 at two blocks an SM, 2984 ->
# 2768 SASS instructions (ISETP 207 -> 139, LOP3 206 -> 117, SEL 68 -> 34), the same registers and spills; the
# Hopper dK/dV kernel 4144 -> 4040 (236 -> 232 registers).  Measured (H200, bf16, 16k tokens, d 64, one process,
# 2 rounds; python -m tools.flex_ab --settings "FLEX_MOD_INT32=0;FLEX_MOD_INT32=1" --cases "alibi,softcap 30";
# bench/results/h200-flex-2026-11-28d.md), ms off -> on: ALiBi forward 4.896 -> 4.274, forward+backward 20.96 ->
# 20.10; softcap 30 forward 9.425 -> 9.429 (outputs equal, max diff 0)
FLEX_MOD_INT32 = True

# a mask_mod's bits of a partial tile written out (``forward_tc.mask_bit``: the words in registers, the mask_mod at
# clamped indices with no branch, no block-state read an element inside one mask block) in the forward (1) and the
# tensor-core dK/dV kernel (2), else a loop (a dynamic index: the words in local memory, ~50 SASS instructions an
# element with 64-bit indices and a block-state read); ``FLEX_MASK_INT32``: the mask_mod's indices as int32 there
# (PyTorch's flex gives its functions int32 indices too).  ptxas (mma.sync bf16 d 128, a document mask): the ids
# read once a row and a column (LDC 133 -> 25 written out with clamped indices).  Measured (H200, bf16 d 128, 16k
# tokens, one process, 2 rounds; python -m tools.flex_ab --headdims 128 --cases "document,sliding 1024,alibi"
# --settings "FLEX_MASK_WRITTEN=0 FLEX_MASK_INT32=0;FLEX_MASK_WRITTEN=3 FLEX_MASK_INT32=0;FLEX_MASK_WRITTEN=3
# FLEX_MASK_INT32=1;FLEX_MASK_WRITTEN=1 FLEX_MASK_INT32=1"; bench/results/h200-flex-2026-11-28e.md), ms loop ->
# written -> written + int32 (-> forward only): document forward 1.424 -> 0.926 -> 0.827, forward+backward 3.635
# -> 2.692 -> 2.515 (3.058); sliding 1024 0.684 -> 0.503 -> 0.487, 2.246 -> 1.944 -> 1.868 (2.143); ALiBi (causal)
# 2.877 -> 2.946 -> 2.855, 13.518 -> 13.602 -> 12.922 (13.491); outputs equal (max diff 0)
FLEX_MASK_WRITTEN = 3
FLEX_MASK_INT32 = True
# with it, the partial tiles' bounds in int32 and the mask_mod's integer comparisons in int32 where their bounds fit
# (``Mods.mask_narrow``; ``kernels._mod_float32.int32_compare_device_function``): the same decisions; ptxas at bf16
# d 128, sliding window 1024: the Hopper forward 3504 -> 2664 SASS instructions (185 -> 166 registers), the Hopper
# dK/dV kernel 4328 -> 4064 (its partial tile's straight run 700 -> 452; document 575 -> 465).  Bits: 1 the
# forward's kernels, 2 the backward's.  Measured (H200, bf16, 16k, ``python -m tools.flex_ab --settings
# "FLEX_MASK_NARROW=0 FLEX_SECTION=0;FLEX_MASK_NARROW=1 FLEX_SECTION=1;..."``, bench/results/
# h200-flex-2026-11-28g.md): the forwards 5-16% faster (d 64 sliding 0.62 -> 0.54 ms, document 0.88 -> 0.78), every
# case's forward+backward 0.7-4% faster with the forward's bits alone; in the d 128 backward it cost 1-7% (ALiBi's
# dK/dV kernel 8.32 -> 8.73 ms under ncu: the same 2.45 G instructions, 4.76 -> 5.03 cycles an issue, short
# scoreboard and math-pipe stalls up: ptxas schedules the leaner code worse), so the forward's only (1);
# compute-sanitizer on those forwards: 0 errors (H200, 2026-11-29, bench/results/h200-fp8-2026-11-29.md)
FLEX_MASK_NARROW = 1


def _flex_only(call):
    """A flex_attention call: its functions, and no option but its states (the block mask)."""
    return (call.flags.mods is not None and not any(_flag_args(call.flags)[3:])
            and not any(_flag_args(call.flags)[:2]))


def _mask_only(call):
    """A flex_attention call with a mask_mod and no score_mod, no option but its states (the block mask)."""
    mods = call.flags.mods
    return _flex_only(call) and mods.mask_mod is not None and mods.score_mod is None


def _two_blocks(call, block_q):
    """The Hopper forward's ``MIN_BLOCKS`` keyword: 2 with ``WGMMA_FWD_TWO_BLOCKS`` for 16-bit inputs up to head
    dim 64 at 128 query rows, dense, with no option but a window (causal), or (``FLEX_TWO_BLOCKS``) a flex call's
    mask_mod alone (``FLEX_TWO_BLOCKS_SCORE``: with a score_mod); none elsewhere."""
    plain = not any(_flag_args(call.flags)[1:]) and call.flags.mods is None
    flex = (FLEX_TWO_BLOCKS and _mask_only(call)
            or FLEX_TWO_BLOCKS_SCORE and _flex_only(call) and call.flags.mods.score_mod is not None)
    two = (WGMMA_FWD_TWO_BLOCKS and call.dtype in ("float16", "bfloat16") and call.headdim <= 64
           and block_q == 128 and (plain or flex) and call.total_q is None)
    return {"MIN_BLOCKS": 2} if two else {}


def _three_warpgroups(call):
    """Whether the Hopper forward of ``call`` takes 192 query rows (``WGMMA_THREE_WARPGROUPS``): tiles not the
    caller's, 16-bit, head dim <= 64, dense, no option (no window: causal's diagonal tiles measured slower)."""
    return (WGMMA_THREE_WARPGROUPS and call.block_q is None and call.block_k is None
            and call.dtype in ("float16", "bfloat16") and call.headdim <= 64 and call.total_q is None
            and not any(_flag_args(call.flags)) and call.flags.mods is None)


def default_wgmma_tiles(headdim, block_q=None, block_k=None, dtype="float16", precision="highest"):
    """The Hopper forward's (block_q, block_k): the caller's where given, else the head-dim class's (float32: of
    its precision)."""
    if SIMULATOR:
        bq, bk = _WGMMA_SIM_TILES
    else:
        table = _WGMMA_TF32_TILES[precision] if dtype == "float32" else _WGMMA_TILES
        if _qs_reg(dtype, precision, headdim):
            table = _WGMMA_TF32_QS_TILES
        bq, bk = next(tiles for max_d, tiles in table if headdim <= max_d)
    return block_q or bq, block_k or bk


def _hopper(call):
    """Whether a forward the tensor cores serve runs the Hopper kernel: asked for, or "auto" on compute capability
    9.0 (``WGMMA_AUTO``) above head dim 48 where its tiles come by the copy engine (``WGMMA_TMA``), else above 64
    (the cp.async Hopper forward measured no faster than mma.sync at 64), where it can serve the call and its
    tiles fit (else "auto" keeps the mma.sync forward); never "auto" in the simulator, whose suites choose the
    kernel they test."""
    if call.backend == "wgmma":
        return True
    if not (call.backend == "auto" and WGMMA_AUTO and not SIMULATOR
            and (call.dtype != "float32" or WGMMA_AUTO_FLOAT32)
            and call.headdim > (48 if WGMMA_TMA else WGMMA_AUTO_MIN_HEADDIM)
            and wgmma_refusal(call.dtype, call.headdim, call.block_q, call.block_k, call.layout,
                              call.total_q is not None) is None):
        return False
    tiles = default_wgmma_tiles(call.headdim, call.block_q, call.block_k, call.dtype, call.precision)
    return shared_refusal(wgmma_shared_bytes(*tiles, call.headdim, call.dtype, call.precision), "") is None


def _tma(call):
    """Whether the Hopper forward's tiles come by the copy engine (``WGMMA_TMA``; a packed batch's boxes are
    rows of the packed tensor).  The dispatch cache replays such a call, re-deriving the tensor maps (which hold
    the arrays' addresses) from the new inputs (``_dispatch.REPLAY_TENSOR_MAPS``)."""
    return WGMMA_TMA and _hopper(call)


# measured on the H100 (bench/results/h100-hopper-bwd-2026-11-25.md): host time per call of the Hopper forward
# with the copy engine 26-28 us replayed (the mma.sync forward's: 25-31), 168 us not; at N 512-2048 it is
# 1.07-1.83x the mma.sync forward's speed, but for d 64 causal at 512 (0.97x)
WGMMA_TMA = True

# measured on the H100 (bench/results/h100-tma-2026-11-25.md): with the tiles by the copy engine 1.33 / 1.14x
# FlashAttention-2 at head dim 64 (non-causal / causal), 1.62 / 1.47x at 128, 1.77 / 1.54x at 256; by cp.async
# 1.03 / 0.90x, 1.20 / 1.13x, 1.49 / 1.31x; the mma.sync forward 0.94-0.99x at 64 and 0.82-0.87x above; not
# measured below 64 (padded to 64 there)
WGMMA_AUTO = True
WGMMA_AUTO_MIN_HEADDIM = 64
# float32 forwards too ("auto", above head dim 48 up to 128, dense; the backward stays on SIMT): measured on the H100
# (bench/results/h100-tf32-wgmma-2026-11-26.md) "highest" at 0.48-1.09x (calls 6, 11: 0.51-0.92x at head dim 128 in
# the shipped form) the SIMT kernels' largest error against float64, and 1.3-3.1x the speed of SDPA's
# memory-efficient backend, where the SIMT kernels run at 0.33-0.63x of it
WGMMA_AUTO_FLOAT32 = True


def wgmma_shared_bytes(block_q, block_k, headdim, dtype="float16", precision="highest"):
    """Dynamic shared memory per block of the Hopper forward."""
    return make_forward_tc(block_q, block_k, headdim, "float32" if dtype == "float32" else "float16", True, 1, True,
                           *([False] * 7), WGMMA=True, TMA=WGMMA_TMA,
                           **_wgmma_tf32_keywords(dtype, precision, headdim))[1]


def _layout_refusal(layout):
    bad = layout[0]
    if bad is None:
        return None
    return f"{bad}'s head dimension must be contiguous (stride 1) with other strides even and a 4-byte-aligned start"


def shared_refusal(nbytes, what):
    """Why a kernel of ``nbytes`` of shared memory per block cannot run on this device (None if it can)."""
    limit = shared_limit()
    if limit is not None and nbytes > limit:
        return (f"{what} needs {nbytes} bytes of shared memory per block (this device's limit: {limit}); "
                "choose smaller block_q / block_k")
    return None


def check_shared(nbytes, what):
    refusal = shared_refusal(nbytes, what)
    if refusal is not None:
        raise ValueError(refusal)


# ------------------------------------------------------------------------------------------------ SIMT tiles
# Default tiles (BLOCK_Q, BLOCK_K) by accumulation type and head dim: the largest
# tiles whose shared memory (q, k, v, p in the accumulation type) leaves room
# for two or more blocks per SM on the H100 (measurements: docs/performance.md);
# halved where a device's shared memory per block is smaller (default_tiles).
_GPU_TILES = {
    "float32": ((64, (64, 64)), (128, (64, 32)), (256, (32, 32))),
    "float64": ((64, (64, 32)), (128, (32, 32)), (256, (32, 16))),
}
_SIM_TILES = (8, 8)  # the simulator runs one Python thread per CUDA thread: keep blocks small


def _simt_tiles(call, acc, backward):
    if call.block_q and call.block_k:
        return call.block_q, call.block_k
    return default_tiles(call.headdim, acc, backward, call.block_q, call.block_k)


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


def _fitting(candidates, limit, shared_bytes):
    """The first (block_q, block_k) of ``candidates`` whose kernel fits in ``limit`` bytes of shared memory
    per block, else the last (which the call then finds too large: ``shared_refusal``)."""
    return next((c for c in candidates if shared_bytes(*c) <= limit), candidates[-1])


# ------------------------------------------------------------------------------------------------ tensor-core tiles
# Tensor-core tiles: BLOCK_Q = 16 x m-tiles per warp (tc_m_tiles) x warps, BLOCK_K a multiple of 16.
# Each head-dim class: the measured tiles (docs/notes/tensorcore.md), then the fallback where a device's shared
# memory per block is smaller than the H100's (compute capability 8.6 / 8.9: 99 KB).
_TC_TILES = ((64, ((128, 64),)), (128, ((128, 64), (64, 64))), (256, ((128, 32), (64, 32))),
             (512, ((64, 32), (64, 16), (32, 16))))          # (512: float32 at head dims 129-256)
_TC_SIM_TILES = (16, 16)

# (BLOCK_Q, BLOCK_K) of the dK/dV kernel, BLOCK_K / (16 tc_bwd_key_tiles) x tc_bwd_dim_split warps: the
# fastest of the H100 sweeps (bench/results/h100-tune-tc-bwd-2026-11-22.md; above head dim 64 with S^T
# shared, tc_bwd_share: bench/results/h100-tune-tc-2026-11-23.md, ninth session), then the fallbacks where a
# device's shared memory per block is smaller than the H100's (8.0: 163 KB; 8.6 / 8.9: 99 KB)
_TC_BWD_TILES = ((64, ((32, 128), (32, 64))), (128, ((64, 128), (32, 64))),
                 (256, ((64, 64), (32, 64), (16, 64), (16, 32))))
# float32 (tf32 operands): a row of K, V, Q, dO takes twice a 16-bit row's shared memory, and 3xTF32 adds the small
# parts of K_j, Q_i, dO_i (make_dkdv_tc); the largest tiles with 8 warps (one m-tile of keys each, _tc_bwd_layout)
# whose 3xTF32 kernel fits the H100's 227 KB, then smaller ones.  Measured on the H100 at "highest", N 4096
# (bench/results/h100-tf32-wgmma-2026-11-26.md, tools.tune_tc --pass bwd --dtype float32): the first of each
# head-dim class is the fastest of the tiles swept (d 64: 32 x 64, 64 x 64, 16 x 128, 64 x 32; d 128: 16 x 64,
# 32 x 32)
_TC_BWD_TILES_F32 = ((64, ((32, 128), (32, 64), (16, 64))), (128, ((32, 64), (16, 64), (16, 32))),
                     (256, ((32, 32), (16, 32), (16, 16))))


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


def default_tc_tiles(headdim, block_q=None, block_k=None, dtype="float16", precision="highest"):
    """The tensor-core forward's (block_q, block_k): the caller's where given, else the first candidate that fits
    the device's shared memory per block (``_tc_candidates``; float32 by its head dim in 16-bit words)."""
    if block_q and block_k:
        return block_q, block_k
    if SIMULATOR:
        return block_q or _TC_SIM_TILES[0], block_k or _TC_SIM_TILES[1]
    return _default_tc_tiles(headdim, shared_limit(), block_q, block_k, dtype, precision)


@lru_cache(maxsize=None)
def _default_tc_tiles(headdim, limit, block_q=None, block_k=None, dtype="float16", precision="highest"):
    d = headdim + headdim % 2
    return _fitting(_tc_candidates(_TC_TILES, _words16(headdim, dtype), block_q, block_k), limit,
                    lambda bq, bk: tc_shared_bytes(bq, bk, d, dtype, precision))


def tc_shared_bytes(block_q, block_k, headdim, dtype="float16", precision="highest"):
    """Dynamic shared memory per block of the tensor-core forward (the options do not change it)."""
    mt, qs, extra = _tc_forward_variant(block_q, headdim, dtype, precision)
    return make_forward_tc(block_q, block_k, headdim, dtype if dtype == "float32" else "float16", True, mt, qs,
                           *([False] * 7), **extra)[1]


def _words16(headdim, dtype):
    """The head dim a 16-bit row of the same words would have: the measure of a row's registers and shared
    memory in the tensor-core kernels (a float32 row takes twice a 16-bit row's)."""
    return 2 * headdim if dtype == "float32" else headdim


def _tc_forward_variant(block_q, headdim, dtype, precision):
    """(m-tiles per warp, Q in shared memory, the factory's float32 keywords) of the tensor-core forward: the
    16-bit kernels' choices at the head dim of the same words; 3xTF32 keeps Q in shared memory (its big and
    small parts, split once), which registers would not hold."""
    dw = _words16(headdim, dtype)
    mt = tc_m_tiles(block_q, dw)
    if dtype != "float32":
        return mt, tc_q_in_smem(mt, dw), {}
    split = precision == "highest"
    return mt, split or tc_q_in_smem(mt, dw), {"TF32X3": split}


def default_tc_bwd_tiles(headdim, block_q=None, block_k=None, dtype="float16", precision="highest"):
    """The tensor-core dK/dV kernel's (block_q, block_k): the caller's where given, else the first candidate that
    fits the device's shared memory per block (``_tc_candidates``; float32 from its own table)."""
    if block_q and block_k:
        return block_q, block_k
    if SIMULATOR:
        return block_q or _TC_SIM_TILES[0], block_k or _TC_SIM_TILES[1]
    if dtype != "float32":
        return _default_tc_bwd_tiles(headdim, shared_limit(), block_q, block_k)
    return _default_tc_bwd_tiles(headdim, shared_limit(), block_q, block_k, dtype, precision)


@lru_cache(maxsize=None)
def _default_tc_bwd_tiles(headdim, limit, block_q=None, block_k=None, dtype="float16", precision="highest"):
    table = _TC_BWD_TILES_F32 if dtype == "float32" else _TC_BWD_TILES
    return _fitting(_tc_candidates(table, headdim, block_q, block_k), limit,
                    lambda bq, bk: tc_bwd_shared_bytes(bq, bk, headdim, dtype, precision))


def tc_bwd_shared_bytes(block_q, block_k, headdim, dtype="float16", precision="highest"):
    """Dynamic shared memory per block of the tensor-core dK/dV kernel (the options do not change it)."""
    d = headdim + headdim % 2 if dtype != "float32" else headdim
    split, mtk, share = _tc_bwd_layout(block_q, block_k, d, dtype)
    return make_dkdv_tc(block_q, block_k, d, dtype if dtype == "float32" else "float16", True, *([False] * 7),
                        split, True, MTK=mtk, SHARE=share,          # as the plan builds it (RED2 last)
                        **_tf32_keywords(dtype, precision))[1]


# ------------------------------------------------------------------------------------------------ tensor-core variants
def tc_m_tiles(block_q, headdim):
    """m16 row blocks per warp: 2 (each K/V fragment read from shared memory feeds two mma) up to head dim 64,
    and up to 128 with 4 or more warps and Q in shared memory (``tc_q_in_smem``; 80-96 bytes of spills, and
    still 7-19% less time than one m-tile; with 2 warps per block half as fast); above 128, 1
    (docs/notes/tensorcore.md)."""
    return 2 if (block_q >= 32 and headdim <= 64) or (block_q >= 128 and headdim <= 128) else 1


def tc_q_in_smem(m_tiles, headdim):
    """Q's fragments from shared memory (ldmatrix per k-step) rather than registers where two m-tiles per warp
    would not leave the registers for Q's fragments, head dims above 64 (measured, docs/notes/tensorcore.md)."""
    return m_tiles > 1 and headdim > 64


@lru_cache(maxsize=256)
def tc_positive_scale(scale):
    """Whether the forward may fold the scale into exp2: 0 < float32(scale) * log2(e) < inf."""
    with np.errstate(over="ignore"):
        x = np.float32(np.float32(scale) * np.float32(LOG2E))
    return bool(0 < x < np.inf)


def tc_bwd_key_tiles(block_q, block_k, headdim):
    """m-tiles of 16 keys per warp in the tensor-core dK/dV kernel: 2 (each Q / dO fragment read from shared
    memory feeds twice the ``mma``) where the registers allow it: head dims up to 64 with block_q <= 32, and up
    to 128 with S^T shared (``tc_bwd_share``; half of dK's, dV's dims and of S^T's, dP^T's queries per warp)
    (measured, docs/notes/tensorcore.md); block_k a multiple of 32."""
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


def tc_bwd_threads(block_q, block_k, headdim, dtype="float16"):
    """Threads per block of the tensor-core dK/dV kernel: 32 per (16 x key m-tiles) keys per dim part."""
    split, mtk, _ = _tc_bwd_layout(block_q, block_k, headdim, dtype)
    return 32 * block_k // (16 * mtk) * split


def _tc_bwd_layout(block_q, block_k, headdim, dtype):
    """(warps per 16 keys, m-tiles of keys per warp, S^T shared) of the tensor-core dK/dV kernel: the 16-bit rules
    above (``tc_bwd_dim_split``, ``tc_bwd_key_tiles``, ``tc_bwd_share``, each by head dim: registers hold values,
    and float32's accumulators are as many as 16-bit's).  float32 takes one m-tile of keys per warp (not yet
    measured): twice the warps of a block for its tiles, which twice the shared memory per row keeps to one or two
    blocks an SM, and 3xTF32's three products per fragment already reuse each fragment read thrice."""
    if dtype != "float32":
        return (tc_bwd_dim_split(block_q, block_k, headdim), tc_bwd_key_tiles(block_q, block_k, headdim),
                tc_bwd_share(block_q, block_k, headdim))
    return tc_bwd_dim_split(block_q, block_k, headdim), 1, tc_bwd_share(block_q, block_k, headdim)


def _red2():
    """Vector float32 reductions (red.global.add.v2.f32) exist from compute capability 9.0; the simulator's twin
    is two atomics."""
    return SIMULATOR or compute_capability() >= (9, 0)


# ------------------------------------------------------------------------------------------------ split-KV decode
# The decode kernels' work split (``kernels.decode``; ``flashnb.kvcache`` launches it): query rows per block (query
# tokens x the query heads of a KV head, q and acc in registers), lanes per key, and the split of the keys over
# the SMs (flash-decoding).
DECODE_MAX_ROWS = 8
DECODE_MAX_SPLITS = 128


class DecodePlan(NamedTuple):
    rows: int            # ROWS: query rows per block
    n_row_tiles: int
    lanes_per_key: int   # LK
    vec16: bool
    n_splits: int
    split_len: int       # keys per split, a multiple of KEY_ALIGN


@lru_cache(maxsize=4096)
def num_splits_heuristic(blocks, slots, n_key_blocks, max_splits=DECODE_MAX_SPLITS):
    """flash-attn's ``num_splits_heuristic`` (csrc/flash_attn/flash_api.cpp) with the GPU's block *slots*
    (SMs x resident blocks) for its SM count: no split when the blocks already nearly fill the slots; else
    the fewest splits whose wave efficiency (waves / whole waves) is within 85% of the best, skipping split
    counts that do not change the key blocks per split."""
    if blocks >= 0.8 * slots:
        return 1
    max_splits = max(1, min(max_splits, slots, n_key_blocks))
    eligible = lambda s: s == 1 or -(-n_key_blocks // s) != -(-n_key_blocks // (s - 1))
    eff = {}
    for s in range(1, max_splits + 1):
        if eligible(s):
            waves = blocks * s / slots
            eff[s] = waves / math.ceil(waves)
    best = max(eff.values())
    return min(s for s, e in eff.items() if e >= 0.85 * best)


@lru_cache(maxsize=1024)
def plan_decode(dtype_name, batch, nheads_k, group, seqlen_q, headdim, n_max, vec16, num_splits, slots, e_budget):
    """The split-KV decode kernel's work split for one call (``DecodePlan``; ``flashnb.kvcache``'s calls and the
    small-query calls routed there): ``n_max`` the longest sequence's rows (after the append), ``num_splits``
    0 (chosen: ``num_splits_heuristic``) or asked for, ``slots`` the GPU's block slots (SMs x resident decode
    blocks), ``e_budget`` the lanes' value budget (``kvcache.E_BUDGET``: passed, so that a setting changed between
    calls is not hidden by the cache)."""
    nrows = group * seqlen_q
    rows = 1
    while rows < min(nrows, DECODE_MAX_ROWS):
        rows *= 2
    n_row_tiles = -(-nrows // rows)
    lk = _decode.lane_layout(headdim, dtype_name, rows, vec16, e_budget)[0]
    n_key_blocks = max(1, -(-n_max // _decode.KEY_ALIGN))
    if num_splits == 0:
        num_splits = num_splits_heuristic(batch * nheads_k * n_row_tiles, slots, n_key_blocks)
    split_len = -(-n_key_blocks // min(num_splits, n_key_blocks)) * _decode.KEY_ALIGN
    n_splits = max(1, -(-n_max // split_len))
    return DecodePlan(rows, n_row_tiles, lk, vec16, n_splits, split_len)


class DecodeSettings(NamedTuple):
    """``flashnb.kvcache``'s decode-kernel settings, read at every call (so that a setting changed between calls
    is not hidden by ``decode_launches``' cache): keys per lane, warps, K/V stages and their shared bytes a block,
    the LEAN path, the lanes' value budget, block slots a multiprocessor."""
    keys_per_lane: int
    nwarps: int
    stages: int
    stage_bytes: int
    lean: bool
    e_budget: int
    blocks_per_sm: int


class DecodeLaunches(NamedTuple):
    """A split-KV decode call's launches: the work split (``DecodePlan``), the decode kernel's launch and, when
    the keys are split, the combine's (None without a split)."""
    split: DecodePlan
    decode: Launch
    combine: object


@lru_cache(maxsize=1024)
def decode_launches(dtype_name, batch, nheads, nheads_k, seqlen_q, headdim, n_max, vec16, num_splits, sms, settings,
                    paged, has_seqlens, has_window, has_softcap, has_alibi, has_leftpad):
    """Everything a split-KV decode call launches (``flashnb.kvcache``: its own calls, the routed small-query
    calls and their length-generic steps): ``plan_decode``'s work split for ``sms`` multiprocessors, the K/V
    stages that fit a block's share of shared memory, the decode kernel's variant and grid, and the combine of the
    splits (one thread an output value, at most 8192 blocks)."""
    group = nheads // nheads_k
    s = settings
    p = plan_decode(dtype_name, batch, nheads_k, group, seqlen_q, headdim, n_max, vec16, num_splits,
                    slots=sms * s.blocks_per_sm, e_budget=s.e_budget)
    split = p.n_splits > 1
    stages = _decode.stages_that_fit(s.stages, dtype_name, headdim, p.lanes_per_key, s.keys_per_lane, s.nwarps,
                                     s.stage_bytes)
    kern, threads, shared = _decode.make_decode(dtype_name, headdim, p.rows, p.lanes_per_key, s.keys_per_lane,
                                                s.nwarps, p.vec16, paged, has_seqlens, split, has_window, has_softcap,
                                                has_alibi, stages, bool(s.lean), has_leftpad)
    decode = Launch(kern, batch * nheads_k * p.n_row_tiles * p.n_splits, threads, shared)
    combine = None
    if split:
        words = headdim if dtype_name == "float32" else headdim // 2
        total = batch * seqlen_q * nheads * words
        combine = Launch(_decode.make_combine(dtype_name), min(-(-total // COMBINE_THREADS), 8192), COMBINE_THREADS, 0)
    return DecodeLaunches(p, decode, combine)


COMBINE_THREADS = 128
APPEND_THREADS = 256


def append_launch(batch, seqlen_new, nheads_k, head_words, paged, has_seqlens):
    """The KV cache append's launch (``kernels.decode.make_append``): each sequence's new rows (``head_words``
    32-bit words a row and head) over at most 8192 blocks in all."""
    per_seq = seqlen_new * nheads_k * head_words
    blocks_per_seq = max(1, min(-(-per_seq // APPEND_THREADS), 8192 // batch))
    return Launch(_decode.make_append(paged, has_seqlens), batch * blocks_per_seq, APPEND_THREADS, 0), blocks_per_seq


# ------------------------------------------------------------------------------------------------ FP8 forward
class FP8Plan(NamedTuple):
    """The FP8 forward of one call (``flashnb.fp8``): V^T's pre-pass, then the forward."""
    prepare: Launch
    forward: Launch
    vt_keys: int                    # V^T's row length (keys padded to groups of 32)
    prepare_words: Launch = None    # the pre-pass four bytes at a time, where v has a word view

    def forward_args(self, q, k, vt, out, lse, q_descale, k_descale, v_descale, group, off, scale, stream,
                     packed=None):
        """The forward's arguments after its word views: the tensor maps of q, k, V^T, then ``packed`` (a packed
        batch's int32 device ``cu_seqlens_q``, ``cu_seqlens_k``, ``vt_start``; one-entry dummies for a dense one)."""
        maps = tensor_maps(((q, _fp8.BLOCK_Q), (k, _fp8.BLOCK_K), (vt, vt.shape[1])), False, stream)
        if packed is None:
            packed = (_options._dummy(1, np.int32),) * 3
        return (q, k, vt, out, lse, q_descale, k_descale, v_descale, group, off, np.float32(scale), maps) + tuple(
            packed)


# The FP8 forward at head dim 64 with launch bounds for two blocks an SM (kernels.forward_fp8's MIN_BLOCKS=2: 16
# warps an SM; 128 registers, 44 bytes of spill): 1.19-1.36x one block (H200, bench/results/h200-fp8-2026-11-28.md)
FP8_TWO_BLOCKS = True
# FlashAttention-3's warp-specialised FP8 forward (kernels.forward_fp8's WARP_SPECIALISED: a producer warpgroup
# issuing the copies, two consumer warpgroups of up to 240 registers, no block barrier in the loop).  0: off; 1: every
# head dim; 2: head dims 128 and 256, where it is faster than the plain kernel at every point measured (H200,
# bench/results/h200-fp8-2026-11-29.md, call 1: 1.5-7%); at head dim 64 the plain kernel at two blocks an SM
# (FP8_TWO_BLOCKS) is faster (call 2: 0.76x -> 0.84x at N 4096, 0.93x -> 0.96x at N 16384 against float16).
# FlashAttention-3's pingpong and intra-warpgroup overlap on that kernel were built, correct and sanitizer-clean on
# an H200, and not faster (calls 2-3: the pingpong within noise at d 128 and 1-7% slower at d 256, the overlap
# 1.1-1.5x slower); removed (the code is in commit c32a386)
FP8_WARP_SPECIALISED = 2


def _fp8_warp_specialised(headdim):
    """Whether the plan's FP8 forward at ``headdim`` is the warp-specialised kernel (``FP8_WARP_SPECIALISED``)."""
    return int(FP8_WARP_SPECIALISED) == 1 or (int(FP8_WARP_SPECIALISED) == 2 and headdim != 64)


def _fp8_kernel(headdim, out_dtype, causal, **flags):
    """The FP8 forward's kernel, its shared bytes and its threads under the plan's FP8 constants."""
    if _fp8_warp_specialised(headdim):
        kern, shared = _fp8.make_forward_fp8(headdim, out_dtype, bool(causal), WARP_SPECIALISED=True, **flags)
        return kern, shared, _fp8.threads(True)
    min_blocks = 2 if FP8_TWO_BLOCKS and headdim == 64 else 1
    kern, shared = _fp8.make_forward_fp8(headdim, out_dtype, bool(causal), min_blocks, **flags)
    return kern, shared, _fp8.threads()


@lru_cache(maxsize=256)
def fp8_forward(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, out_dtype, blocks=False):
    """The launches of an FP8 forward of that shape (``kernels.forward_fp8``): Hopper only (compute capability
    9.0, or the simulator), head dims 64, 128, 256, dense batches; ``blocks``: the descales per tile (block
    quantisation)."""
    kern, shared, nthreads = _fp8_kernel(headdim, out_dtype, causal, **({"BLOCKS": True} if blocks else {}))
    check_shared(shared, f"the FP8 forward at head dim {headdim}")
    grid = batch * nheads * -(-seqlen_q // _fp8.BLOCK_Q)
    prep_grid = _fp8.prepare_vt_grid(batch, seqlen_k, nheads_k, headdim)
    words = Launch(_fp8.make_prepare_vt_words(headdim), _fp8.prepare_vt_words_grid(batch, seqlen_k, nheads_k),
                   _fp8.PREP_THREADS, 0)
    return FP8Plan(Launch(_fp8.make_prepare_vt(headdim), prep_grid, _fp8.PREP_THREADS, 0),
                   Launch(kern, grid, nthreads, shared), _fp8.vt_keys(seqlen_k), words)


@lru_cache(maxsize=256)
def fp8_forward_packed(batch, max_seqlen_q, vt_groups, nheads, nheads_k, headdim, causal, out_dtype):
    """The launches of an FP8 forward of a packed batch of ``batch`` sequences: the V^T pre-pass over ``vt_groups``
    column groups of 32 (each sequence's keys padded to whole key tiles, ``forward_fp8.vt_tile_keys``), the
    forward over the longest sequence's query tiles x heads x sequences."""
    kern, shared, nthreads = _fp8_kernel(headdim, out_dtype, causal, VARLEN=True)
    check_shared(shared, f"the FP8 forward at head dim {headdim}")
    grid = batch * nheads * -(-max_seqlen_q // _fp8.BLOCK_Q)
    prep_grid = vt_groups * (headdim // _fp8.VT_KEYS) * nheads_k
    words = Launch(_fp8.make_prepare_vt_packed_words(headdim), vt_groups // 4 * nheads_k, _fp8.PREP_THREADS, 0)
    return FP8Plan(Launch(_fp8.make_prepare_vt_packed(headdim), prep_grid, _fp8.PREP_THREADS, 0),
                   Launch(kern, grid, nthreads, shared), vt_groups * _fp8.VT_KEYS, words)


def fp8_refusal():
    """Why this machine cannot run the FP8 forward, or None."""
    if SIMULATOR or compute_capability() == (9, 0):
        return None
    return (f"the FP8 forward needs a Hopper GPU (compute capability 9.0: e4m3 wgmma), this one is "
            f"{compute_capability()}")

