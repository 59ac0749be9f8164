"""Validation and normalisation of the public arguments (docs/semantics.md), before any launch.

Everything a kernel launch needs beyond q, k, v is gathered into a
``LaunchOptions``: the compile-time feature flags (part of the kernel's
specialisation key) and the run-time arguments, in the kernel's accumulation
type.  Bad input raises ``ValueError`` or ``TypeError`` naming the argument.
"""
import math
import numbers
import operator
from dataclasses import dataclass

import numpy as np
from numba import cuda

from . import _arrays

MAX_HEAD_DIM = 256
TILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # powers of two: 16 threads (or fewer) per tile side


@dataclass(frozen=True)
class Flags:
    """Compile-time feature flags: a kernel built without a feature has no code for it."""
    has_window: bool
    has_attn_mask: bool
    has_block_mask: bool
    has_softcap: bool
    has_bias: bool
    has_alibi: bool
    has_dropout: bool
    mods: object = None          # a flex_attention call's functions (kernels._scores.Mods)


@dataclass
class LaunchOptions:
    flags: Flags
    scale: float
    softcap: float
    left: int
    right: int
    attn_mask: object      # device arrays (4-D, size-1 dimensions broadcast) or 1-element dummies
    attn_bias: object
    alibi: object
    block_mask: object
    bm_q: int
    bm_k: int
    drop_threshold: int    # keep iff philox word >= floor(dropout_p * 2**32)
    drop_scale: float      # 1 / (1 - dropout_p)
    seed_lo: int
    seed_hi: int
    cu_seqlens_q: object = None   # a packed batch's int32 device arrays (flashnb.varlen), else 1-element dummies
    cu_seqlens_k: object = None

    def kernel_args(self, acc):
        """The option arguments in kernel order, floats in the accumulation type ``acc``."""
        cu_q = self.cu_seqlens_q if self.cu_seqlens_q is not None else _dummy(1, np.int32)
        cu_k = self.cu_seqlens_k if self.cu_seqlens_k is not None else _dummy(1, np.int32)
        return (acc(self.scale), acc(self.softcap), self.left, self.right, self.attn_mask, self.attn_bias,
                self.alibi, self.block_mask, self.bm_q, self.bm_k, self.drop_threshold,
                acc(self.drop_scale), self.seed_lo, self.seed_hi, cu_q, cu_k)


def check_qkv(q, k, v, names=("q", "k", "v")):
    """Kinds, dtypes, shapes of q, k, v; returns (kind, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)."""
    kinds = [_arrays.kind_of(x, n) for x, n in zip((q, k, v), names)]
    for kd, n in zip(kinds[1:], names[1:]):
        if kd.lib != kinds[0].lib:
            raise TypeError(f"{n} is a {kd.lib} array but {names[0]} is a {kinds[0].lib} array; pass one kind")
        if kd.dtype != kinds[0].dtype:
            raise TypeError(f"{n} has dtype {kd.dtype} but {names[0]} has {kinds[0].dtype}; pass one dtype")
    if kinds[0].dtype not in _arrays.FLOAT_DTYPES:
        raise TypeError(f"{names[0]} has dtype {kinds[0].dtype}; expected one of {', '.join(_arrays.FLOAT_DTYPES)}")
    for x, n in zip((q, k, v), names):
        if len(x.shape) != 4:
            raise ValueError(f"{n} must have 4 dimensions (batch, seqlen, nheads, headdim), got shape {tuple(x.shape)}")
    devices = {_arrays.device_of(x) for x in (q, k, v)}
    if len(devices) > 1:
        raise ValueError(f"{', '.join(names)} are on different devices {sorted(map(str, devices))}")
    batch, seqlen_q, nheads, headdim = map(int, q.shape)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"{names[1]} and {names[2]} must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    bk, seqlen_k, nheads_k, dk = map(int, k.shape)
    if bk != batch:
        raise ValueError(f"{names[1]} has batch {bk} but {names[0]} has batch {batch}")
    if dk != headdim:
        raise ValueError(f"{names[1]} has head dim {dk} but {names[0]} has head dim {headdim}")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads of {names[0]} ({nheads}) must be a multiple of nheads of {names[1]} ({nheads_k})")
    if not 1 <= headdim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim of {names[0]} must be between 1 and {MAX_HEAD_DIM}, got {headdim}")
    return kinds[0], batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def window_pair(window_size):
    """``window_size`` as a pair of Python ints ``>= -1``.  As flash-attn, any integer-like pair is taken: a
    tuple or list, or a NumPy array or tensor of two integers (flash-attn's own tests pass
    ``torch.randint(0, n, (2,))``); bools and non-integral values are refused (ValueError)."""
    try:
        pair = tuple(window_size)
    except TypeError:
        pair = None
    if pair is not None and len(pair) == 2 and not any(isinstance(w, (bool, np.bool_)) for w in pair):
        try:
            pair = tuple(operator.index(w) for w in pair)   # ints, NumPy integers, integer tensors of one element
        except TypeError:
            pair = None
        if pair is not None and all(w >= -1 for w in pair):
            return pair
    raise ValueError(f"window_size must be a pair of ints >= -1 (-1 = unbounded), got {window_size!r}")


def _as_4d(x, name, full_shape, dtype_kind, stream):
    """Validate a broadcastable mask/bias and return its device array with 4 dimensions (size-1 broadcast)."""
    kind = _arrays.kind_of(x, name)
    if dtype_kind == "bool" and kind.dtype != "bool":
        raise TypeError(f"{name} must be a boolean array (True = may attend), got dtype {kind.dtype}")
    if dtype_kind == "states" and kind.dtype != "int32":
        raise TypeError(f"{name} must hold flex.BlockMask.kernel_states (int32), got dtype {kind.dtype}")
    if dtype_kind == "float" and kind.dtype not in _arrays.FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point array, got dtype {kind.dtype}")
    if kind.dtype == "bfloat16":
        x = x.float()
    shape = tuple(int(s) for s in x.shape)
    if len(shape) > 4:
        raise ValueError(f"{name} must have at most 4 dimensions, got shape {shape}")
    padded = (1,) * (4 - len(shape)) + shape
    for have, want in zip(padded, full_shape):
        if have not in (1, want):
            raise ValueError(f"{name} of shape {shape} is not broadcastable to {tuple(full_shape)}")
    x = x.reshape(padded) if isinstance(x, np.ndarray) else x[(None,) * (4 - len(shape))]
    return _arrays.to_device(x, stream)


_dummies = {}


def _dummy(ndim, dtype):
    """A one-element device array standing in for an absent optional input (its code is compiled out)."""
    key = (ndim, dtype)
    if key not in _dummies:
        d = cuda.to_device(np.zeros((1,) * ndim, dtype=dtype))
        _dummies[key] = d if _arrays.SIMULATOR else _arrays.View.of(d)
        from ._dispatch import CONSTANT_PTRS, _ptr
        CONSTANT_PTRS.add(_ptr(_dummies[key]))       # alive for the process: a replay may launch with it
    return _dummies[key]


def check_seed_and_block_size(seed, block_mask_size):
    """``seed`` and ``block_mask_size``, which every forward and backward call validates (also where no
    dropout or block mask uses them, as a call on another path would)."""
    if not _is_int(seed) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    if (not isinstance(block_mask_size, (tuple, list)) or len(block_mask_size) != 2
            or not all(_is_int(s) and s > 0 for s in block_mask_size)):
        raise ValueError(f"block_mask_size must be a pair of positive ints, got {block_mask_size!r}")


def window_sides(window_size, causal, seqlen_q, seqlen_k):
    """The kernels' window ``(left, right)`` (-1: no bound on that side) for a checked ``window_size`` pair and
    ``causal`` at these lengths."""
    # a side at or beyond max(seqlen_q, seqlen_k) bounds nothing (|key - (query + off)| is below it): clamped
    # there, so that no side, however large, overflows the kernels' 64-bit index arithmetic
    bound = max(seqlen_q, seqlen_k, 1)
    left, right = (min(int(w), bound) for w in window_size)
    if causal:  # causal is the window's right edge at the diagonal (bottom-right aligned)
        right = 0 if right < 0 else min(right, 0)
    # a side that bounds no key of any row is dropped, so that the kernels compile no window check for it: query i
    # sees keys i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right, so the right side bounds nothing
    # once right >= seqlen_q - 1 (a decoding step's causal mask: one query row at the bottom sees every key) and
    # the left once left >= seqlen_k - 1 (packed batches pass their longest sequences: still nothing bounded)
    if right >= seqlen_q - 1:
        right = -1
    if left >= seqlen_k - 1:
        left = -1
    return left, right


def normalise(*, batch, seqlen_q, seqlen_k, nheads, headdim, acc, stream, softmax_scale=None,
              causal=False, window_size=(-1, -1), attn_mask=None, attn_bias=None, alibi_slopes=None,
              softcap=0.0, block_mask=None, block_mask_size=(128, 128), dropout_p=0.0, seed=0, mods=None):
    """Check every option against docs/semantics.md and build the ``LaunchOptions``."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(headdim)
    if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    left, right = window_sides(window_pair(window_size), causal, seqlen_q, seqlen_k)
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    check_seed_and_block_size(seed, block_mask_size)

    full = (batch, nheads, seqlen_q, seqlen_k)
    mask_d = _as_4d(attn_mask, "attn_mask", full, "bool", stream) if attn_mask is not None else _dummy(4, np.uint8)
    bias_d = _as_4d(attn_bias, "attn_bias", full, "float", stream) if attn_bias is not None else _dummy(4, acc)
    bm_q, bm_k = int(block_mask_size[0]), int(block_mask_size[1])
    if block_mask is not None:
        blocks = (batch, nheads, -(-seqlen_q // bm_q), -(-seqlen_k // bm_k))
        states = mods is not None and mods.mask_mod is not None      # flex: the states padded with their bounds
        if states:
            blocks = blocks[:2] + (blocks[2] + 2, blocks[3] + 2)
        bmask_d = _as_4d(block_mask, "block_mask", blocks, "states" if states else "bool", stream)
    else:
        bmask_d = _dummy(4, np.uint8)
    if alibi_slopes is not None:
        kind = _arrays.kind_of(alibi_slopes, "alibi_slopes")
        if kind.dtype not in _arrays.FLOAT_DTYPES:
            raise TypeError(f"alibi_slopes must be a floating-point array, got dtype {kind.dtype}")
        shape = tuple(int(s) for s in alibi_slopes.shape)
        if shape not in ((nheads,), (batch, nheads)):
            raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {shape}")
        if kind.dtype == "bfloat16":
            alibi_slopes = alibi_slopes.float()
        alibi_d = _arrays.to_device(alibi_slopes.reshape((1,) * (2 - len(shape)) + shape)
                                    if isinstance(alibi_slopes, np.ndarray)
                                    else alibi_slopes[(None,) * (2 - len(shape))], stream)
    else:
        alibi_d = _dummy(2, acc)

    flags = Flags(has_window=left >= 0 or right >= 0, has_attn_mask=attn_mask is not None,
                  has_block_mask=block_mask is not None, has_softcap=softcap > 0,
                  has_bias=attn_bias is not None, has_alibi=alibi_slopes is not None,
                  has_dropout=dropout_p > 0, mods=mods)
    return LaunchOptions(flags=flags, scale=float(softmax_scale), softcap=float(softcap) if softcap > 0 else 1.0,
                         left=left, right=right, attn_mask=mask_d, attn_bias=bias_d, alibi=alibi_d,
                         block_mask=bmask_d, bm_q=bm_q, bm_k=bm_k,
                         drop_threshold=int(math.floor(dropout_p * 2**32)), drop_scale=1.0 / (1.0 - dropout_p),
                         seed_lo=int(seed) & 0xFFFFFFFF, seed_hi=(int(seed) >> 32) & 0xFFFFFFFF)


def check_tile(value, name):
    if value is None:
        return None
    if not _is_int(value) or value not in TILE_SIZES:
        raise ValueError(f"{name} must be one of {TILE_SIZES} (a power of two), got {value!r}")
    return int(value)
