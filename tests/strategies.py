"""Hypothesis strategies for attention problems, shared by the oracle tests and the kernel tests.

Every size bound is a parameter: the oracle tests and the simulator tests use
tiny shapes, the GPU tests shapes of thousands of tokens.  The drawn problems
aim at what breaks naive code (docs/semantics.md; STYLE.md habit 6):
``seqlen_q != seqlen_k``, lengths of 1 and lengths that are not multiples of the
block, blocks larger than the sequence, odd head dims, MHA/GQA/MQA, fully
masked rows, large-magnitude scores (exp overflow is the classic bug), every
option of the contract alone and combined.

Random data is never zeros: Hypothesis draws a NumPy seed and the arrays come
from ``np.random.default_rng(seed)``, so a failing example is replayable from
its repr (which prints the seed and the options, not the arrays).

Public names
------------
``ALL_OPTIONS``        the option groups of the contract (a frozenset of names)
``POSITIONAL_OPTIONS`` the groups whose effect depends on the key position ``j``
``Problem``            one drawn problem: arrays, options, tile sizes
``problems(...)``      the composite strategy drawing a ``Problem``
``option_subsets(...)`` a strategy for subsets of option groups
``naive_scores(...)``  the test side's own rendering of semantics.md steps 1-4,
                       written independently of ``reference/`` (used to check lse)
"""
from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Mapping, Sequence

import numpy as np
from hypothesis import strategies as st

# One name per option *group* of docs/semantics.md; a group may set several
# keyword arguments ("block_mask" sets block_mask and block_mask_size,
# "dropout" sets dropout_p and seed).
ALL_OPTIONS = frozenset({
    "softmax_scale", "causal", "window_size", "attn_mask", "attn_bias",
    "alibi_slopes", "softcap", "block_mask", "dropout",
})
# Groups that tie a score to the key position j (or draw per-(i, j) data): a
# test that permutes the keys must leave these out (or permute them too).
POSITIONAL_OPTIONS = frozenset({"causal", "window_size", "alibi_slopes", "block_mask", "dropout"})

DEFAULT_HEADDIMS = (1, 2, 3, 4, 5, 7, 8, 16)


def _summary(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"<{value.dtype} array {value.shape}>"
    return repr(value)


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """One attention problem in flash-attn's layout (docs/semantics.md).

    ``q, dout``: (batch, seqlen_q, nheads, headdim); ``k, v``: (batch, seqlen_k, nheads_k, headdim).
    ``opts``: the keyword options, read-only (pass as ``**problem.opts``).
    ``block_q, block_k``: tile sizes for the tiled algorithms.
    ``data_seed``: the ``default_rng`` seed the arrays came from (for replay).
    """
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    opts: Mapping[str, Any]
    block_q: int
    block_k: int
    data_seed: int = 0

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def seqlen_q(self) -> int:
        return self.q.shape[1]

    @property
    def seqlen_k(self) -> int:
        return self.k.shape[1]

    @property
    def nheads(self) -> int:
        return self.q.shape[2]

    @property
    def nheads_k(self) -> int:
        return self.k.shape[2]

    @property
    def headdim(self) -> int:
        return self.q.shape[3]

    def with_opts(self, **changes) -> "Problem":
        """A copy with some options changed (``None`` values are dropped: back to the default)."""
        opts = dict(self.opts)
        opts.update(changes)
        opts = {key: value for key, value in opts.items() if value is not None}
        return dataclasses.replace(self, opts=types.MappingProxyType(opts))

    def _repr_pretty_(self, printer, cycle):          # Hypothesis prints falsifying examples with this
        printer.text(repr(self))

    def __repr__(self) -> str:
        opts = ", ".join(f"{key}={_summary(value)}" for key, value in sorted(self.opts.items()))
        return (f"Problem(batch={self.batch}, seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}, "
                f"nheads={self.nheads}, nheads_k={self.nheads_k}, headdim={self.headdim}, "
                f"dtype={self.q.dtype}, block_q={self.block_q}, block_k={self.block_k}, "
                f"data_seed={self.data_seed}, |q|max={float(np.max(np.abs(self.q), initial=0)):.3g}, "
                f"opts={{{opts}}})")


def option_subsets(options: Sequence[str] | frozenset = ALL_OPTIONS, *, required=frozenset(),
                   max_size: int | None = None) -> st.SearchStrategy[frozenset]:
    """Subsets of the option groups ``options`` (always containing ``required``).

    Kernel tests restrict this to what a kernel supports, e.g.
    ``option_subsets({"causal", "softmax_scale"})``.
    """
    options = frozenset(options)
    required = frozenset(required)
    unknown = (options | required) - ALL_OPTIONS
    if unknown:
        raise ValueError(f"unknown option groups: {sorted(unknown)}")
    if not required <= options:
        options = options | required
    rest = sorted(options - required)
    return st.lists(st.sampled_from(rest), unique=True, max_size=max_size).map(
        lambda chosen: required | frozenset(chosen)) if rest else st.just(required)


def _broadcast_shape(draw, full: tuple[int, ...]) -> tuple[int, ...]:
    """A shape broadcastable to ``full``: each axis full or 1, leading axes possibly dropped."""
    shape = tuple(draw(st.sampled_from((n, 1))) for n in full)
    drop = draw(st.integers(0, 2))
    return shape[drop:]


@st.composite
def shapes(draw, *, max_batch=2, min_seqlen=1, max_seqlen=40, max_nheads=4,
           headdims=DEFAULT_HEADDIMS, allow_empty=False, gqa=True):
    """(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim).

    seqlen_q and seqlen_k are drawn independently (equal lengths are still
    drawn often: Hypothesis shrinks towards them); with ``allow_empty`` either
    may be 0.  nheads_k divides nheads (MHA, GQA, MQA) unless ``gqa=False``.
    """
    batch = draw(st.integers(1, max_batch))
    low = 0 if allow_empty else min_seqlen
    seqlen_q = draw(st.integers(low, max_seqlen))
    seqlen_k = draw(st.one_of(st.just(seqlen_q), st.integers(low, max_seqlen)))
    nheads = draw(st.integers(1, max_nheads))
    if gqa:
        nheads_k = draw(st.sampled_from([d for d in range(1, nheads + 1) if nheads % d == 0]))
    else:
        nheads_k = nheads
    headdim = draw(st.sampled_from(tuple(headdims)))
    return batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim


@st.composite
def problems(draw, *, max_batch=2, min_seqlen=1, max_seqlen=40, max_nheads=4,
             headdims=DEFAULT_HEADDIMS, dtypes=(np.float64,), options=ALL_OPTIONS,
             required=frozenset(), block_sizes=None, max_block=None, scale=1e3,
             allow_empty=False, gqa=True, fully_masked_rows=True, max_dropout_p=0.9,
             block_mask_sizes=None):
    """Draw a ``Problem``.

    max_batch, min_seqlen, max_seqlen, max_nheads: size bounds.
    headdims: head dims to choose from (odd ones included by default).
    dtypes: dtypes of q, k, v, dout (a kernel test passes ``(np.float16,)``).
    options, required: option groups that may / must be used (see ALL_OPTIONS).
    block_sizes: tile sizes to sample ``block_q``, ``block_k`` from; ``None``
        means any integer in ``[1, max_block]``, ``max_block`` defaulting to
        ``max_seqlen + 8`` so blocks larger than the sequence occur.
    scale: largest factor q is multiplied by (scores grow with it; 1e3 makes
        ``exp(s)`` overflow in any code that forgets the max subtraction).
        ``scale=1`` gives unit-variance data (finite differences want that).
    allow_empty: let seqlen_q or seqlen_k be 0.
    gqa: let nheads_k be a proper divisor of nheads.
    fully_masked_rows: let ``attn_mask`` mask whole rows.
    max_dropout_p: the largest dropout probability drawn.
    block_mask_sizes: values to sample each side of ``block_mask_size`` from;
        ``None`` means any integer in ``[1, max_seqlen]`` (a kernel that needs
        the block mask aligned to its tiles passes its tile sizes' multiples).
    """
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = draw(shapes(
        max_batch=max_batch, min_seqlen=min_seqlen, max_seqlen=max_seqlen, max_nheads=max_nheads,
        headdims=headdims, allow_empty=allow_empty, gqa=gqa))
    dtype = np.dtype(draw(st.sampled_from(tuple(dtypes))))
    if block_sizes is None:
        top = max_block if max_block is not None else max_seqlen + 8
        block = st.integers(1, max(1, top))
    else:
        block = st.sampled_from(tuple(block_sizes))
    block_q, block_k = draw(block), draw(block)

    data_seed = draw(st.integers(0, 2**63 - 1))
    rng = np.random.default_rng(data_seed)
    # Magnitude of q: 1, a power of ten up to `scale`, or log-uniform in [1, scale].
    if scale <= 1.0:
        q_scale = float(scale)
    else:
        decades = [1.0] + [10.0 ** e for e in range(1, 10) if 10.0 ** e < scale] + [float(scale)]
        q_scale = draw(st.one_of(st.sampled_from(decades),
                                 st.floats(0.0, math.log10(scale)).map(lambda e: 10.0 ** e)))
    v_scale = draw(st.sampled_from((1.0, 10.0)))

    def normal(shape, factor=1.0):
        return (rng.standard_normal(shape) * factor).astype(dtype)

    q = normal((batch, seqlen_q, nheads, headdim), q_scale)
    k = normal((batch, seqlen_k, nheads_k, headdim))
    v = normal((batch, seqlen_k, nheads_k, headdim), v_scale)
    dout = normal((batch, seqlen_q, nheads, headdim))

    chosen = draw(option_subsets(options, required=required))
    full = (batch, nheads, seqlen_q, seqlen_k)
    opts: dict[str, Any] = {}
    if "softmax_scale" in chosen:
        # zero and negative scales too: the tensor-core forward folds only a positive scale into exp2
        opts["softmax_scale"] = draw(st.one_of(st.just(1.0), st.floats(0.01, 2.0), st.floats(-2.0, 0.0)))
    if "causal" in chosen:
        opts["causal"] = True
    if "window_size" in chosen:
        side = st.one_of(st.just(-1), st.integers(0, max(max_seqlen, 1)))
        left, right = draw(side), draw(side)
        opts["window_size"] = (left, right)
    if "attn_mask" in chosen:
        shape = _broadcast_shape(draw, full)
        density = draw(st.sampled_from((0.5, 0.8, 0.95, 1.0)))
        mask = rng.random(shape) < density
        if fully_masked_rows and len(shape) >= 2 and shape[-2] > 1 and draw(st.booleans()):
            rows = rng.integers(0, shape[-2], size=draw(st.integers(1, 3)))
            mask[..., rows, :] = False
        opts["attn_mask"] = mask
    if "attn_bias" in chosen:
        shape = _broadcast_shape(draw, full)
        bias_scale = draw(st.sampled_from((1.0, 10.0, 100.0)))
        opts["attn_bias"] = (rng.standard_normal(shape) * bias_scale).astype(
            draw(st.sampled_from((np.float64, np.float32))))
    if "alibi_slopes" in chosen:
        shape = draw(st.sampled_from(((nheads,), (batch, nheads))))
        opts["alibi_slopes"] = rng.uniform(0.0, 1.0, shape)
    if "softcap" in chosen:
        opts["softcap"] = draw(st.floats(0.5, 50.0))
    if "block_mask" in chosen:
        side = (st.integers(1, max(max_seqlen, 1)) if block_mask_sizes is None
                else st.sampled_from(tuple(block_mask_sizes)))
        size = (draw(side), draw(side))
        nblocks = (-(-seqlen_q // size[0]), -(-seqlen_k // size[1]))
        shape = _broadcast_shape(draw, (batch, nheads) + nblocks)
        density = draw(st.sampled_from((0.5, 0.8, 1.0)))
        opts["block_mask"] = rng.random(shape) < density
        opts["block_mask_size"] = size
    if "dropout" in chosen:
        opts["dropout_p"] = draw(st.one_of(st.sampled_from((0.1, 0.5)), st.floats(0.0, max_dropout_p)))
        opts["seed"] = draw(st.one_of(st.integers(0, 2**32 - 1), st.integers(2**32, 2**64 - 1)))
    return Problem(q=q, k=k, v=v, dout=dout, opts=types.MappingProxyType(opts),
                   block_q=block_q, block_k=block_k, data_seed=data_seed)


# --------------------------------------------------------------------------------------
# The test side's own model of semantics.md steps 1-4 (not reference/'s code):
# written with explicit index grids so that the oracle is checked against a
# second, independent reading of the contract.
# --------------------------------------------------------------------------------------

def naive_allowed(batch, nheads, seqlen_q, seqlen_k, *, causal=False, window_size=(-1, -1),
                  attn_mask=None, block_mask=None, block_mask_size=(128, 128), **_ignored):
    """Boolean (batch, nheads, seqlen_q, seqlen_k): may query i attend to key j."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    off = seqlen_k - seqlen_q
    allowed = np.ones((batch, nheads, seqlen_q, seqlen_k), dtype=bool)
    if causal:
        allowed &= j <= i + off
    left, right = window_size
    if left >= 0:
        allowed &= j >= i + off - left
    if right >= 0:
        allowed &= j <= i + off + right
    if attn_mask is not None:
        allowed &= np.broadcast_to(np.asarray(attn_mask, dtype=bool), allowed.shape)
    if block_mask is not None:
        bq, bk = block_mask_size
        nbq, nbk = -(-seqlen_q // bq), -(-seqlen_k // bk)
        blocks = np.broadcast_to(np.asarray(block_mask, dtype=bool), (batch, nheads, nbq, nbk))
        allowed &= blocks[:, :, i // bq, j // bk]
    return allowed


def naive_scores(q, k, *, softmax_scale=None, softcap=0.0, attn_bias=None, alibi_slopes=None,
                 causal=False, window_size=(-1, -1), attn_mask=None, block_mask=None,
                 block_mask_size=(128, 128), **_ignored):
    """Scores after steps 1-4 of semantics.md, float64 (batch, nheads, seqlen_q, seqlen_k), -inf where masked.

    Also returns the raw scaled scores before the softcap (for the softcap
    derivative): ``(s, s_raw)``.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    k_rep = np.repeat(k, nheads // nheads_k, axis=2)           # query head h reads h // group
    s_raw = scale * np.einsum("bihd,bjhd->bhij", q, k_rep)
    s = softcap * np.tanh(s_raw / softcap) if softcap > 0 else s_raw.copy()
    if attn_bias is not None:
        s = s + np.asarray(attn_bias, dtype=np.float64)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float64).reshape(-1, nheads)
                                 if np.ndim(alibi_slopes) == 2 else alibi_slopes, (batch, nheads))
        dist = np.abs(np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q) - np.arange(seqlen_k)[None, :])
        s = s - slopes[:, :, None, None] * dist
    allowed = naive_allowed(batch, nheads, seqlen_q, seqlen_k, causal=causal, window_size=window_size,
                            attn_mask=attn_mask, block_mask=block_mask, block_mask_size=block_mask_size)
    s = np.where(allowed, s, -np.inf)
    return s, s_raw


def naive_philox4x32_10(counter, key):
    """Philox-4x32-10 (Random123), vectorised over NumPy uint64 arrays; the test side's own copy.

    counter: 4 arrays/ints (c0..c3), key: 2 arrays/ints; returns the 4 output words as uint64 arrays.
    """
    mask = np.uint64(0xFFFFFFFF)
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & mask for c in counter)
    k0, k1 = (np.asarray(c, dtype=np.uint64) & mask for c in key)
    for _ in range(10):
        p0, p1 = m0 * c0, m1 * c2                      # 32x32 -> 64-bit products fit in uint64
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
    return c0, c1, c2, c3


def naive_keep(seed, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    """Keep mask of semantics.md's dropout section, from ``naive_philox4x32_10``."""
    b, h, i, j = np.meshgrid(np.arange(batch), np.arange(nheads), np.arange(seqlen_q), np.arange(seqlen_k),
                             indexing="ij")
    r = naive_philox4x32_10((j, i, h, b), (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))[0]
    return r >= np.uint64(math.floor(dropout_p * 2**32))


def naive_attention(q, k, v, dout, *, keep=None, **opts):
    """Forward and closed-form backward of semantics.md written out directly (float64).

    Returns a dict with out, lse, dq, dk, dv, and elementwise magnitudes
    ``|out|``-, ``|dq|``-, ... bounds (sums of absolute values of the terms,
    ``mag_out`` etc.) that scale the rounding-error tolerances, plus
    ``s_abs``: the largest ``|score|`` before masking that rounding acts on
    (sum of |terms| of the dot product, plus |bias| and |ALiBi|).
    ``keep``: the (batch, nheads, seqlen_q, seqlen_k) keep mask, required when dropout_p > 0.
    """
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    scale = opts.get("softmax_scale")
    scale = 1.0 / math.sqrt(headdim) if scale is None else scale
    softcap = opts.get("softcap", 0.0)
    p_drop = opts.get("dropout_p", 0.0)
    s, s_raw = naive_scores(q, k, **opts)
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)

    row_max = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    row_sum = np.sum(np.exp(s - safe_max), axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(row_sum > 0, safe_max + np.log(row_sum), -np.inf)
    p = np.where(np.isfinite(lse), np.exp(s - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
    if p_drop > 0:
        drop = np.asarray(keep, dtype=np.float64) / (1.0 - p_drop)
    else:
        drop = np.ones_like(p)
    pd = p * drop
    out = np.einsum("bhij,bjhd->bihd", pd, v_rep)

    dp = np.einsum("bihd,bjhd->bhij", dout, v_rep) * drop
    delta = np.einsum("bihd,bihd->bhi", dout, out)[..., None]
    ds = p * (dp - delta)
    if softcap > 0:
        ds = ds * (1.0 - np.tanh(s_raw / softcap) ** 2)
    dq = scale * np.einsum("bhij,bjhd->bihd", ds, k_rep)
    dk_rep = scale * np.einsum("bhij,bihd->bjhd", ds, q)
    dv_rep = np.einsum("bhij,bihd->bjhd", pd, dout)

    def fold(x):                                                 # sum the query heads of a k/v head
        return x.reshape(batch, seqlen_k, nheads_k, group, headdim).sum(axis=3)

    # delta's magnitude: its terms dout * out with out's own magnitude (out's rounding is relative to the sum of
    # |its terms|, not to |out|, which can cancel; |delta| alone under-bounds delta's error there)
    mag_delta = np.einsum("bihd,bihd->bhi", np.abs(dout), np.einsum("bhij,bjhd->bihd", pd, np.abs(v_rep)))[..., None]
    ads = p * (np.abs(np.einsum("bihd,bjhd->bhij", np.abs(dout), np.abs(v_rep)) * drop) + mag_delta)
    s_abs = abs(scale) * np.einsum("bihd,bjhd->bhij", np.abs(q), np.abs(k_rep))
    if opts.get("attn_bias") is not None:
        s_abs = s_abs + np.abs(np.asarray(opts["attn_bias"], dtype=np.float64))
    s_abs = s_abs + np.abs(np.where(np.isfinite(s), s, 0.0))
    return dict(
        out=out, lse=lse[..., 0], dq=dq, dk=fold(dk_rep), dv=fold(dv_rep), p=p, keep_scale=drop,
        mag_out=np.einsum("bhij,bjhd->bihd", pd, np.abs(v_rep)),
        mag_dq=abs(scale) * np.einsum("bhij,bjhd->bihd", ads, np.abs(k_rep)),
        mag_dk=fold(abs(scale) * np.einsum("bhij,bihd->bjhd", ads, np.abs(q))),
        mag_dv=fold(np.einsum("bhij,bihd->bjhd", pd, np.abs(dout))),
        s_abs=float(np.max(s_abs, initial=0.0)),
    )


# --------------------------------------------------------------------------------------
# Tolerances.  Rounding in float64 attention comes from three places: the dot
# products (at most headdim * eps * sum_d |q_d k_d| per score, Higham's bound),
# the exponentials and their rescaling (a few eps relative per term and per
# block), and the sums over keys (seqlen_k * eps relative to the sum of
# |terms|).  An error in a score shifts its probability by the same amount
# *relatively*, so every output element is off by at most
#     rel = c * eps * (headdim * s_abs + seqlen_k + c)
# times the sum of the absolute values of its terms ("magnitude", returned by
# naive_attention).  c = 16 is head-room over the worst case, not a fudge for
# wrong results: a wrong mask, scale or rescale gives errors of order one
# times the magnitude, ~1e8 times larger than this bound at the sizes drawn.
# --------------------------------------------------------------------------------------

EPS64 = float(np.finfo(np.float64).eps)


def rounding_rel(model: dict, headdim: int, seqlen_k: int, eps: float = EPS64, c: float = 16.0) -> float:
    """The relative rounding bound described above, for a naive_attention result."""
    return c * eps * (headdim * model["s_abs"] + seqlen_k + c)


def assert_close(actual, expected, magnitude, rel, what: str):
    """|actual - expected| <= rel * (magnitude + 1e-12 * max(magnitude)) + 4 * float64's smallest normal,
    elementwise, no NaN."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN in result"
    magnitude = np.broadcast_to(np.asarray(magnitude, dtype=np.float64), expected.shape)
    # plus a few of float64's smallest normal number: values below it are subnormal, rounded to multiples of 5e-324
    # (Hypothesis draws scales like -5e-324), where no relative bound holds
    bound = rel * (magnitude + 1e-12 * np.max(magnitude, initial=0.0)) + 4 * np.finfo(np.float64).tiny
    err = np.abs(actual - expected)
    bad = ~(err <= bound)
    if bad.any():
        idx = tuple(int(x) for x in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} elements off; first at {idx}: "
                             f"got {actual[idx]!r}, expected {expected[idx]!r}, |err| {err[idx]:.3g} > "
                             f"bound {bound[idx]:.3g} (rel {rel:.3g}); max |err| {np.max(err):.3g}")


def assert_lse_close(actual, expected, rel, what: str = "lse"):
    """Same -inf pattern, finite entries within ``rel`` absolutely (lse's rounding is absolute)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN"
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected),
                                  err_msg=f"{what}: -inf (fully masked rows) differ")
    fin = np.isfinite(expected)
    err = np.abs(actual[fin] - expected[fin])
    assert np.all(err <= rel), f"{what}: max |err| {np.max(err, initial=0):.3g} > {rel:.3g}"


def learned_bias_mods(table, slopes, buckets):
    """``(rel, rel_grid)``: a score_mod over a learned relative-bias table (``table[h, (q_idx - kv_idx) // 16 +
    buckets]``, read under an if: below the diagonal only) and learned ALiBi slopes, as the kernels take it, and
    the same function over index grids for the oracle (no if: a product by the condition).  The GPU tests and
    tests/gpu_sanitize_inference.py's ``learned`` part (gradients into captured tensors)."""
    def rel(score, b, h, q_idx, kv_idx):
        x = score - slopes[h] * abs(q_idx - kv_idx)
        if q_idx >= kv_idx:
            x = x + table[h, (q_idx - kv_idx) // 16 + buckets]
        return x

    def rel_grid(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * abs(q_idx - kv_idx) + (q_idx >= kv_idx) * table[h, (q_idx - kv_idx) // 16 + buckets]

    return rel, rel_grid
