"""Validation and the masked score tile, shared by every oracle in ``reference``.

This is docs/semantics.md, "Order of operations", steps 1-4, written once:

    s = softmax_scale * q @ k^T                                   # 1. scale
    if softcap > 0:  s = softcap * tanh(s / softcap)              # 2. softcap
    s = s + attn_bias - slope * |i + off - j|                     # 3. bias and ALiBi
    s = -inf where causal / window / attn_mask / block_mask forbid   # 4. masks

for any rectangle ``rows x cols`` of the score matrix. Standard attention
(``reference.standard``) asks for the whole ``seqlen_q x seqlen_k`` rectangle;
the tiled algorithms (``reference.flash``) ask for one ``block_q x block_k``
tile at a time. Both therefore see bit-identical scores for the same pair
``(i, j)``, so any disagreement between them is in the softmax/accumulation
logic, which is what the oracles are meant to exhibit.

Internally the oracle works in the layout ``(batch, nheads, seqlen, headdim)``
(heads before sequence, so that ``@`` batches over ``(batch, nheads)``), with
the key/value heads repeated to ``nheads`` (grouped-query attention: query head
``h`` reads key/value head ``h // group``). Gradients of the repeated heads are
summed back with ``Problem.sum_kv_heads``.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .dropout import _check_dropout_p, _check_seed, dropout_keep

__all__ = ["OPTION_DEFAULTS", "Problem", "prepare", "check_block_size", "as_array"]

# The options of docs/semantics.md, plus the oracle's own `dtype` (compute precision).
OPTION_DEFAULTS = dict(
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attn_mask=None,
    attn_bias=None,
    alibi_slopes=None,
    softcap=0.0,
    block_mask=None,
    block_mask_size=(128, 128),
    dropout_p=0.0,
    seed=0,
    dtype=None,
)

_COMPUTE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


# ----------------------------------------------------------------------------- small checks
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def as_array(x, name: str, *, kind: str = "float", ndim: int | None = None) -> np.ndarray:
    """``np.asarray(x)`` with a dtype check; never copies or modifies the caller's array."""
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    a = np.asarray(x)
    if kind == "float" and a.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    if kind == "real" and a.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be a real-valued (float or integer) array, got dtype {a.dtype}")
    if kind == "bool" and a.dtype != np.bool_:
        raise TypeError(f"{name} must be a boolean array (True = may attend), got dtype {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    return a


def check_block_size(value, name: str) -> int:
    """A tile size of the tiled algorithms: any positive integer."""
    if not _is_int(value):
        raise TypeError(f"{name} must be a positive integer, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


def _check_pair(value, name: str, *, minimum: int) -> tuple[int, int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ValueError(f"{name} must be a pair of integers, got {value!r}")
    a, b = value
    if not (_is_int(a) and _is_int(b)):
        raise ValueError(f"{name} must be a pair of integers, got {value!r}")
    if a < minimum or b < minimum:
        raise ValueError(f"{name} entries must be >= {minimum}, got {value!r}")
    return int(a), int(b)


def _broadcast_view(a: np.ndarray, shape: tuple, name: str, what: str) -> np.ndarray:
    """A read-only broadcast view of ``a`` as ``shape``, or ValueError naming ``name``."""
    if a.ndim > len(shape):
        raise ValueError(f"{name} of shape {a.shape} is not broadcastable to {what} {shape}")
    try:
        full = np.broadcast_shapes(a.shape, shape)
    except ValueError:
        full = None
    if full != tuple(shape):
        raise ValueError(f"{name} of shape {a.shape} is not broadcastable to {what} {shape}")
    return np.broadcast_to(a, shape)


# ----------------------------------------------------------------------------- the problem
class Problem:
    """Validated inputs and options, in the oracle's layout and compute precision.

    Attributes (shapes in the internal layout):
        q: (batch, nheads, seqlen_q, headdim)
        k, v: (batch, nheads, seqlen_k, headdim), key/value heads repeated `group` times
        dtype: the compute dtype (float64 unless the `dtype` option asks otherwise)
        scale, softcap: scalars of `dtype`
    """

    def __init__(self, q, k, v, opts: dict):
        unknown = sorted(set(opts) - set(OPTION_DEFAULTS))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(OPTION_DEFAULTS)}")
        o = {**OPTION_DEFAULTS, **opts}

        # --- compute precision: float64 by default whatever the input dtype (upcast)
        if o["dtype"] is None:
            self.dtype = np.dtype(np.float64)
        else:
            try:
                self.dtype = np.dtype(o["dtype"])
            except TypeError:
                raise TypeError(f"dtype must be None, float16, float32 or float64, got {o['dtype']!r}") from None
            if self.dtype not in _COMPUTE_DTYPES:
                raise TypeError(f"dtype must be None, float16, float32 or float64, got {self.dtype}")
        # lse is float32 for 16-bit computation (semantics.md), otherwise the compute dtype
        self.lse_dtype = np.dtype(np.float32) if self.dtype.itemsize == 2 else self.dtype

        # --- tensors
        q = as_array(q, "q", ndim=4)
        k = as_array(k, "k", ndim=4)
        v = as_array(v, "v", ndim=4)
        batch, seqlen_q, nheads, headdim = q.shape
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
        if k.shape[0] != batch:
            raise ValueError(f"k and v must have the batch size of q ({batch}), got {k.shape[0]}")
        if k.shape[3] != headdim:
            raise ValueError(f"k and v must have the headdim of q ({headdim}), got {k.shape[3]}")
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        if headdim < 1:
            raise ValueError(f"headdim must be >= 1, got q of shape {q.shape}")
        if nheads < 1 or nheads_k < 1:
            raise ValueError(f"nheads and nheads_k must be >= 1, got q {q.shape} and k {k.shape}")
        if nheads % nheads_k != 0:
            raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k}) (grouped-query attention)")
        self.batch, self.nheads, self.nheads_k, self.headdim = batch, nheads, nheads_k, headdim
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.group = nheads // nheads_k
        self.off = seqlen_k - seqlen_q                 # bottom-right alignment of causal/window/ALiBi

        # (batch, seqlen, heads, headdim) -> (batch, heads, seqlen, headdim), cast to the compute dtype.
        # astype always copies here, so the caller's arrays are never touched.
        self.q = self.to_internal(q)
        self.k = np.repeat(self.to_internal(k), self.group, axis=1)   # query head h reads kv head h // group
        self.v = np.repeat(self.to_internal(v), self.group, axis=1)

        # --- scalar options
        scale = o["softmax_scale"]
        if scale is None:
            scale = 1.0 / math.sqrt(headdim)
        elif not _is_real(scale):
            raise TypeError(f"softmax_scale must be a real number or None, got {type(scale).__name__}")
        elif not math.isfinite(scale):
            raise ValueError(f"softmax_scale must be finite, got {scale}")
        self.scale = self.dtype.type(scale)

        softcap = o["softcap"]
        if not _is_real(softcap):
            raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
        if not (math.isfinite(softcap) and softcap >= 0):
            raise ValueError(f"softcap must be finite and >= 0 (0 disables it), got {softcap}")
        self.softcap = self.dtype.type(softcap) if softcap > 0 else None

        if not isinstance(o["causal"], (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {type(o['causal']).__name__}")
        self.causal = bool(o["causal"])
        self.window = _check_pair(o["window_size"], "window_size", minimum=-1)
        self.dropout_p = _check_dropout_p(o["dropout_p"])
        self.seed = _check_seed(o["seed"])

        # --- array options, kept as broadcast views (nothing is materialised at full size)
        full = (batch, nheads, seqlen_q, seqlen_k)
        self.attn_mask = None
        if o["attn_mask"] is not None:
            m = as_array(o["attn_mask"], "attn_mask", kind="bool")
            self.attn_mask = _broadcast_view(m, full, "attn_mask", "(batch, nheads, seqlen_q, seqlen_k) =")
        self.attn_bias = None
        if o["attn_bias"] is not None:
            b = as_array(o["attn_bias"], "attn_bias", kind="real")
            self.attn_bias = _broadcast_view(b, full, "attn_bias", "(batch, nheads, seqlen_q, seqlen_k) =")
        self.slopes = None                              # (batch | 1, nheads, 1, 1)
        if o["alibi_slopes"] is not None:
            s = as_array(o["alibi_slopes"], "alibi_slopes", kind="real")
            if s.shape == (nheads,):
                s = s[None, :]
            elif s.shape != (batch, nheads):
                raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or "
                                 f"(batch, nheads) = ({batch}, {nheads}), got {s.shape}")
            self.slopes = s.astype(self.dtype)[:, :, None, None]
        self.block_mask_size = _check_pair(o["block_mask_size"], "block_mask_size", minimum=1)
        self.block_mask = None
        if o["block_mask"] is not None:
            bq, bk = self.block_mask_size
            nblocks = (batch, nheads, -(-seqlen_q // bq), -(-seqlen_k // bk))     # ceil division
            m = as_array(o["block_mask"], "block_mask", kind="bool")
            self.block_mask = _broadcast_view(
                m, nblocks, "block_mask", "(batch, nheads, ceil(seqlen_q / bq), ceil(seqlen_k / bk)) =")

    # ------------------------------------------------------------------------- layouts
    def to_internal(self, x: np.ndarray) -> np.ndarray:
        """(batch, seqlen, heads, headdim) -> contiguous (batch, heads, seqlen, headdim) in the compute dtype."""
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).astype(self.dtype))

    def like_q(self, x, name: str) -> np.ndarray:
        """Validate an array shaped like q (out, dout) and convert it to the internal layout."""
        a = as_array(x, name, ndim=4)
        want = (self.batch, self.seqlen_q, self.nheads, self.headdim)
        if a.shape != want:
            raise ValueError(f"{name} must have the shape of q {want}, got {a.shape}")
        return self.to_internal(a)

    def lse_in(self, lse) -> np.ndarray:
        """Validate a saved lse ``(batch, nheads, seqlen_q)`` and cast it to the compute dtype."""
        a = as_array(lse, "lse", ndim=3)
        want = (self.batch, self.nheads, self.seqlen_q)
        if a.shape != want:
            raise ValueError(f"lse must have shape (batch, nheads, seqlen_q) = {want}, got {a.shape}")
        return a.astype(self.dtype)

    def to_external(self, x: np.ndarray) -> np.ndarray:
        """(batch, heads, seqlen, headdim) -> contiguous (batch, seqlen, heads, headdim)."""
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).astype(self.dtype))

    def sum_kv_heads(self, dx: np.ndarray) -> np.ndarray:
        """Per-query-head gradient (batch, nheads, seqlen_k, d) -> (batch, seqlen_k, nheads_k, d).

        Query heads ``h_k * group ... h_k * group + group - 1`` share key/value head
        ``h_k``, so their gradients add up.
        """
        b, _, n, d = dx.shape
        dx = dx.reshape(b, self.nheads_k, self.group, n, d).sum(axis=2, dtype=self.dtype)
        return self.to_external(dx)

    # ------------------------------------------------------------------------- the score tile
    def structural_mask(self, r0: int, r1: int, c0: int, c1: int):
        """Causal, window and block_mask for the tile ``rows r0:r1, cols c0:c1``.

        These are the masks a kernel knows *before* it loads the tile, so it can
        skip a tile that they forbid entirely (FA1 Algorithm 5, block-sparse).
        Returns a boolean array broadcastable to ``(batch, nheads, r1 - r0, c1 - c0)``
        (``True`` = may attend), or ``None`` when nothing is forbidden.
        """
        i = np.arange(r0, r1)[:, None]                 # query positions, (br, 1)
        j = np.arange(c0, c1)[None, :]                 # key positions,   (1, bc)
        ok = None

        def both(a, b):
            return b if a is None else a & b

        if self.causal:                                # bottom-right aligned: j <= i + off
            ok = both(ok, j <= i + self.off)
        left, right = self.window
        if left >= 0:
            ok = both(ok, j >= i + self.off - left)
        if right >= 0:
            ok = both(ok, j <= i + self.off + right)
        if ok is not None:
            ok = ok[None, None]                        # (1, 1, br, bc)
        if self.block_mask is not None:
            bq, bk = self.block_mask_size
            # element (i, j) lies in block (i // bq, j // bk) of the block mask
            ok = both(ok, self.block_mask[:, :, i // bq, j // bk])   # (batch, nheads, br, bc)
        return ok

    def live(self, structural) -> np.ndarray:
        """``(batch, nheads)``: does the (b, h) program have anything to compute in this tile?"""
        if structural is None:
            return np.ones((self.batch, self.nheads), dtype=bool)
        return np.broadcast_to(structural.any(axis=(-2, -1)), (self.batch, self.nheads))

    def scores(self, r0: int, r1: int, c0: int, c1: int, structural="compute"):
        """The masked score tile ``s`` and, with softcap, ``t = tanh(s_scaled / softcap)``.

        Returns ``(s, t)``: ``s`` is ``(batch, nheads, r1 - r0, c1 - c0)`` with ``-inf``
        where a mask forbids the pair; ``t`` is ``None`` without softcap (the
        backward needs ``1 - t**2``, the derivative of ``softcap * tanh(x / softcap)``).
        """
        if isinstance(structural, str):
            structural = self.structural_mask(r0, r1, c0, c1)
        q_i = self.q[:, :, r0:r1]                                  # (B, H, br, d)
        k_j = self.k[:, :, c0:c1]                                  # (B, H, bc, d)
        s = self.scale * (q_i @ k_j.swapaxes(-1, -2))             # 1. scale * q . k     (B, H, br, bc)
        t = None
        if self.softcap is not None:
            t = np.tanh(s / self.softcap)                          # 2. softcap
            s = self.softcap * t
        if self.attn_bias is not None:
            s = s + self.attn_bias[:, :, r0:r1, c0:c1].astype(self.dtype)   # 3. bias
        if self.slopes is not None:
            i = np.arange(r0, r1)[:, None]
            j = np.arange(c0, c1)[None, :]
            dist = np.abs(i + self.off - j).astype(self.dtype)     # |i + off - j|, (br, bc)
            s = s - self.slopes * dist                             #    ALiBi
        allowed = structural
        if self.attn_mask is not None:
            m = self.attn_mask[:, :, r0:r1, c0:c1]
            allowed = m if allowed is None else allowed & m
        if allowed is not None:
            s = np.where(allowed, s, self.dtype.type(-np.inf))     # 4. masks
        return s, t

    def keep(self, r0: int, r1: int, c0: int, c1: int):
        """Dropout keep decisions for the tile, regenerated from ``(seed, b, h, i, j)``; None without dropout."""
        if self.dropout_p == 0.0:
            return None
        b = np.arange(self.batch, dtype=np.uint64)[:, None, None, None]
        h = np.arange(self.nheads, dtype=np.uint64)[None, :, None, None]
        i = np.arange(r0, r1, dtype=np.uint64)[None, None, :, None]
        j = np.arange(c0, c1, dtype=np.uint64)[None, None, None, :]
        return dropout_keep(self.seed, self.dropout_p, b, h, i, j)  # (B, H, br, bc)

    def apply_dropout(self, x: np.ndarray, keep) -> np.ndarray:
        """``x * keep / (1 - dropout_p)``: kept elements scaled up, dropped ones zero."""
        if keep is None:
            return x
        rescale = self.dtype.type(1.0 / (1.0 - self.dropout_p))
        return np.where(keep, x * rescale, self.dtype.type(0))


def prepare(q, k, v, opts: dict) -> Problem:
    """Validate ``q, k, v`` and the options; return the oracle's view of the problem."""
    return Problem(q, k, v, opts)
