"""Shared by tests/kernels/: problem sizes (simulator or GPU), the kernel calls, the oracle, the tolerances.

Every kernel result is compared with ``reference`` computed in float64 on the
same input values.  The tolerances, per input dtype, and why:

* Magnitudes.  Each compared tensor gets a *scale*: the largest sum of the
  absolute values of the terms that make up one of its elements, computed
  from the oracle's probabilities (``magnitudes``): ``sum_j p~_ij |v_j|`` for
  ``out``, ``sum_j p_ij (|dp_ij| + |delta_i|) |k_j| * softmax_scale`` for ``dq``,
  and so on.  Rounding errors are proportional to it; it does not shrink when
  the result cancels (a one-hot softmax gives ``dq`` ~ 0 but its rounding
  error stays ~ eps * scale).  A wrong mask, scale, rescale or missed tile
  changes a result by O(1) times its scale.
* Scores.  A score is a dot product of length ``headdim``: its rounding error
  is at most ``(headdim + 2) * u * s_dot`` (Higham's bound, plus the scale and
  log2(e) multiplications) with ``s_dot = softmax_scale * max |q_i| . |k_j|``,
  plus a few ``u`` times the added terms ``s_add = max |bias| + max |ALiBi|``.
  An absolute error in a score is a *relative* error in its probability, and
  ``lse``'s error is that same absolute amount.  So
  ``score_err = eps * ((headdim + 2) * s_dot + 4 * s_add)`` (eps = 2u).
* float64 inputs (float64 arithmetic): ``REL_FLOOR64 = 1e-10`` relative to
  the scale, plus ``2 * score_err``.  The accumulations (<= 4096 keys, <= 256
  dims) contribute at most n * u < 5e-13 (worst case), so the floor has more
  than 200x head-room and is still ~1e10 times smaller than any real bug.
* float32 inputs (float32 arithmetic): ``REL_FLOOR32 = 1e-4`` relative to the
  scale, plus ``2 * score_err`` in float32's eps.  The longest accumulation is
  over <= 4096 keys (or query rows for dK/dV): the kernels sum a tile of
  ``BLOCK_K`` terms per thread and then the tiles in sequence, so the worst
  case is ``(BLOCK_K + n / BLOCK_K) * u`` ~ 8e-6 with the default tiles and the
  random-walk estimate ``sqrt(n) * u`` ~ 4e-6; 1e-4 leaves 10x over the
  worst realistic case.  Large scores (q scaled by 1e3) legitimately lose
  more, which the ``score_err`` term states.
* float16 inputs: flash-attn's rule.  The kernel's max error against the
  float64 oracle must be at most twice the max error of the *oracle computed
  in float16* (``reference.attention(..., dtype=np.float16)``, same for the
  backward) plus a floor ``FLOOR16 = (2**-11 + float32 bound) * scale``: half an
  ulp of float16 for the final rounding of the kernel's float32 result, plus
  the float32 arithmetic bound above (the kernels compute float16 in
  float32), so a case where float16 happens to be exact does not demand more
  than the kernel can give.  Where the float16 oracle overflows (non-finite
  where float64 is finite) the rule has no meaning and the floor alone applies.
* lse: the -inf entries (rows that see no key) must be exactly where the
  oracle has them; finite entries within the same bound used absolutely
  (``score_err`` is absolute; the floor covers the log of the row sum).

``POISON_OUTPUTS``: the ``poison_outputs`` fixture (import it into a test
module) makes the API fill every output with NaN before the launch, so an
element a kernel forgets to write fails the no-NaN check.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import settings, strategies as st

import flashnb
import reference
import strategies as S
from flashnb import _arrays
from flashnb.kernels._jit import SIMULATOR

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
EPS32 = float(np.finfo(np.float32).eps)
EPS64 = float(np.finfo(np.float64).eps)
REL_FLOOR64 = 1e-10
REL_FLOOR32 = 1e-4
HALF_ULP16 = 2.0 ** -11

# --------------------------------------------------------------------------------------
# Sizes.  The simulator runs every CUDA thread as a Python thread and costs about
# 0.03 s per (query tile, key tile) step of one (batch, head) at the smallest tiles,
# so its problems are tiny and the sequence bound shrinks with the tiles
# (SIM_TILE_STEPS steps per (batch, head) at most).  On a GPU the same suites draw
# thousands of tokens, head dims up to 256 and the default tiles (None).
# --------------------------------------------------------------------------------------
if SIMULATOR:
    BLOCKS = (1, 2, 4, 8, 16)
    HEADDIMS = (1, 2, 3, 4, 5, 7, 8)
    MAX_SEQLEN, MAX_SEQLEN_F16 = 16, 16
    MAX_BATCH, MAX_NHEADS = 2, 3
    SIM_TILE_STEPS = 16
    LONG_KEYS = 40            # "a single query against long keys"
else:
    BLOCKS = (None, None, 1, 16, 32, 64, 128)
    HEADDIMS = (1, 3, 8, 17, 32, 59, 64, 80, 96, 127, 128, 160, 192, 255, 256)
    MAX_SEQLEN, MAX_SEQLEN_F16 = 2048, 512   # float16 oracle: NumPy float16 matmul has no BLAS
    MAX_BATCH, MAX_NHEADS = 2, 4
    SIM_TILE_STEPS = None
    LONG_KEYS = 8192


# The warp-layout properties of the tensor-core backward (key tiles per warp, shared scores, dQ unit widths,
# whole-tile copies) need long sequences (several 16-wide tiles), which cost the simulator most; the layout
# does not depend on the batch or on more than two heads (those offsets are covered by the general
# properties), so in the simulator they draw one batch element and at most two heads (a GQA group of two).
LAYOUT_GRID = dict(max_batch=1, max_nheads=2) if SIMULATOR else {}


def examples(sim, gpu=25):
    """Examples for one test, given as its count under the ``ci`` profile (25 per test) in the simulator
    (``sim``) or on a GPU (``gpu``), scaled with the active profile (``dev`` 40, ``thorough`` 1000,
    ``gpu`` 8), so an explicit per-test count never overrides a smaller or larger profile."""
    n = sim if SIMULATOR else gpu
    return max(1, round(n * settings().max_examples / 25))


def _max_seqlen(block_q, block_k, dtype_cap):
    if not SIMULATOR:
        if block_q == 1 or block_k == 1:       # one thread per block: keep the grid sane
            return min(dtype_cap, 256)
        return dtype_cap
    steps = math.isqrt(SIM_TILE_STEPS * block_q * block_k)
    return max(3, min(dtype_cap, steps))


@st.composite
def kernel_problems(draw, *, dtypes=(np.float64,), options=S.ALL_OPTIONS, required=frozenset(),
                    tiles=None, scale=None, max_seqlen=None, **overrides):
    """A ``strategies.Problem`` sized for where the kernels run (simulator or GPU).

    ``tiles``: a strategy for ``(block_q, block_k)``; default: both from ``BLOCKS``.
    ``scale``: largest factor q is multiplied by (default 1e3; 10 for float16,
    whose float16 oracle must not overflow for the comparison rule to mean anything).
    Other keywords go to ``strategies.problems``.
    """
    dtype = np.dtype(draw(st.sampled_from(tuple(dtypes))))
    if tiles is None:
        tiles = st.tuples(st.sampled_from(BLOCKS), st.sampled_from(BLOCKS))
    block_q, block_k = draw(tiles)
    cap = MAX_SEQLEN_F16 if dtype == F16 else MAX_SEQLEN
    if max_seqlen is not None:
        cap = min(cap, max_seqlen)
    bq = 8 if block_q is None else block_q      # the simulator's default tiles are 8 x 8
    bk = 8 if block_k is None else block_k
    kw = dict(max_batch=MAX_BATCH, max_nheads=MAX_NHEADS, headdims=HEADDIMS,
              max_seqlen=max(_max_seqlen(bq, bk, cap), overrides.get("min_seqlen", 1)),   # an asked-for floor wins
              dtypes=(dtype,), options=options, required=required,
              block_sizes=(1,), scale=(10.0 if dtype == F16 else 1e3) if scale is None else scale)
    kw.update(overrides)
    p = draw(S.problems(**kw))
    return dataclasses.replace(p, block_q=block_q, block_k=block_k)


def atomic_tiles():
    """Tiles for which the default (non-deterministic) backward adds dQ with atomics.

    flashnb.api takes the atomic path iff ``block_q >= min(16, block_k)`` (the dQ
    partial product's rows must cover the query tile); ``DqPath`` checks that it did.
    """
    blocks = [b for b in BLOCKS if b is not None]
    return st.tuples(st.sampled_from(blocks), st.sampled_from(blocks)).filter(lambda t: t[0] >= min(16, t[1]))


class DqPath:
    """``with DqPath() as path: <backward>``; then ``path.used`` is {"atomic"}, {"two-pass"} or empty.

    Records which dQ strategy flashnb.plan chose by wrapping its kernel factories
    (``make_cast`` finishes the atomic accumulation, ``make_dq`` is the second pass).
    """

    def __enter__(self):
        from flashnb import plan
        self.plan, self.used = plan, set()
        self.saved = plan.make_cast, plan.make_dq

        def cast(*args, _f=plan.make_cast):
            self.used.add("atomic")
            return _f(*args)

        def dq(*args, _f=plan.make_dq):
            self.used.add("two-pass")
            return _f(*args)

        plan.make_cast, plan.make_dq = cast, dq
        return self

    def __exit__(self, *exc):
        self.plan.make_cast, self.plan.make_dq = self.saved
        return False


# --------------------------------------------------------------------------------------
# Poisoned outputs, untouched inputs
# --------------------------------------------------------------------------------------
@pytest.fixture(autouse=True, scope="module")
def poison_outputs():
    """Every output the API allocates is NaN before the kernels run (module scope: Hypothesis-safe)."""
    saved = _arrays.POISON_OUTPUTS
    _arrays.POISON_OUTPUTS = True
    yield
    _arrays.POISON_OUTPUTS = saved


def _host_arrays(*objs):
    found = []
    for obj in objs:
        if isinstance(obj, np.ndarray):
            found.append(obj)
        elif isinstance(obj, dict) or hasattr(obj, "values"):
            found.extend(v for v in obj.values() if isinstance(v, np.ndarray))
    return found


class Untouched:
    """``with Untouched(q, k, opts): ...`` fails if any NumPy array among them changed (bitwise)."""

    def __init__(self, *objs):
        self.arrays = _host_arrays(*objs)

    def __enter__(self):
        self.saved = [(a.dtype, a.shape, a.tobytes()) for a in self.arrays]
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            for i, (a, (dtype, shape, data)) in enumerate(zip(self.arrays, self.saved)):
                assert a.dtype == dtype and a.shape == shape and a.tobytes() == data, \
                    f"input array #{i} {a.dtype}{a.shape} was modified by the call"
        return False


# --------------------------------------------------------------------------------------
# Kernel calls
# --------------------------------------------------------------------------------------
def _launch(fn, p, args, kw):
    """Call the API; on a GPU, explicit tiles the API rejects for shared memory are a rejected example."""
    try:
        return fn(*args, **kw)
    except ValueError as e:
        explicit = kw.get("block_q") is not None or kw.get("block_k") is not None
        if not SIMULATOR and explicit and "shared memory" in str(e):
            from hypothesis import reject
            reject()      # a documented limit of that tile choice (flashnb.plan.check_shared), not a failure
        raise


def kernel_forward(p: S.Problem, **extra):
    """``flashnb.flash_attention`` on the problem (``return_lse=True`` unless overridden); checks no input was written."""
    kw = dict(p.opts, block_q=p.block_q, block_k=p.block_k, return_lse=True)
    kw.update(extra)
    with Untouched(p.q, p.k, p.v, kw):
        return _launch(flashnb.flash_attention, p, (p.q, p.k, p.v), kw)


def kernel_backward(p: S.Problem, out, lse, **extra):
    """``flashnb.flash_attention_backward`` on the problem's dout; checks no input was written."""
    kw = dict(p.opts, block_q=p.block_q, block_k=p.block_k)
    kw.update(extra)
    with Untouched(p.dout, p.q, p.k, p.v, out, lse, kw):
        return _launch(flashnb.flash_attention_backward, p, (p.dout, p.q, p.k, p.v, out, lse), kw)


# --------------------------------------------------------------------------------------
# The oracle and the magnitudes
# --------------------------------------------------------------------------------------
def _bhsd(x):
    """(batch, seqlen, heads, d) -> float64 (batch, heads, seqlen, d)."""
    return np.asarray(x, dtype=np.float64).transpose(0, 2, 1, 3)


def magnitudes(p: S.Problem, out_ref):
    """Scales of out, dq, dk, dv (sums of |terms|, maxed over the tensor) and (s_dot, s_add) of the scores.

    Computed with matmuls from the oracle's probabilities (cheap at GPU sizes too).
    """
    opts = dict(p.opts)
    group = p.nheads // p.nheads_k
    headdim = p.headdim
    scale = opts.get("softmax_scale")
    scale = 1.0 / math.sqrt(headdim) if scale is None else float(scale)
    aq = np.abs(_bhsd(p.q))
    ak = np.repeat(np.abs(_bhsd(p.k)), group, axis=1)
    av = np.repeat(np.abs(_bhsd(p.v)), group, axis=1)
    ado = np.abs(_bhsd(p.dout))
    s_dot = abs(scale) * float(np.max(aq @ ak.swapaxes(-1, -2), initial=0.0))
    s_add = 0.0
    if opts.get("attn_bias") is not None:
        s_add += float(np.max(np.abs(np.asarray(opts["attn_bias"], dtype=np.float64)), initial=0.0))
    if opts.get("alibi_slopes") is not None:
        s_add += float(np.max(np.abs(opts["alibi_slopes"]), initial=0.0)) * (p.seqlen_q + p.seqlen_k)
    if min(p.seqlen_q, p.seqlen_k, p.batch) == 0:
        return dict(out=0.0, dq=0.0, dk=0.0, dv=0.0, s_dot=s_dot, s_add=s_add)
    probs = reference.attention_probs(p.q, p.k, p.v, **opts)            # (b, h, sq, sk), before dropout
    pd = opts.get("dropout_p", 0.0)
    if pd > 0:
        drop = reference.dropout_keep_mask(opts.get("seed", 0), p.batch, p.nheads, p.seqlen_q, p.seqlen_k, pd)
        drop = drop / (1.0 - pd)
    else:
        drop = 1.0
    pdrop = probs * drop
    delta_abs = np.sum(ado * np.abs(_bhsd(out_ref)), axis=-1)          # >= |delta_i|
    ads = probs * ((ado @ av.swapaxes(-1, -2)) * drop + delta_abs[..., None])   # >= |ds|

    def fold(x):                                                        # sum the query heads of a kv head
        b, _, n, d = x.shape
        return x.reshape(b, p.nheads_k, group, n, d).sum(axis=2)

    return dict(out=float(np.max(pdrop @ av)),
                dq=float(np.max(abs(scale) * (ads @ ak))),
                dk=float(np.max(fold(abs(scale) * (ads.swapaxes(-1, -2) @ aq)))),
                dv=float(np.max(fold(pdrop.swapaxes(-1, -2) @ ado))),
                s_dot=s_dot, s_add=s_add)


def rel_bound(dtype, headdim, mags):
    """The relative bound of the module docstring for float64 or float32 arithmetic."""
    floor, eps = (REL_FLOOR64, EPS64) if np.dtype(dtype) == F64 else (REL_FLOOR32, EPS32)
    score_err = eps * ((headdim + 2) * mags["s_dot"] + 4 * mags["s_add"])
    return floor + 2 * score_err


@dataclasses.dataclass
class Expected:
    """The float64 oracle's results, their scales, and (float16 inputs) the float16 oracle's."""
    dtype: np.dtype
    out: np.ndarray
    lse: np.ndarray
    grads: dict | None
    mags: dict
    rel: float
    low: dict | None                  # float16 oracle: out, lse, dq, dk, dv


def expected(p: S.Problem, backward=True) -> Expected:
    dtype = np.dtype(p.q.dtype)
    opts = dict(p.opts)
    out, lse = reference.attention(p.q, p.k, p.v, **opts)
    grads = None
    if backward:
        dq, dk, dv = reference.attention_backward(p.dout, p.q, p.k, p.v, **opts)
        grads = dict(dq=dq, dk=dk, dv=dv)
    mags = magnitudes(p, out)
    rel = rel_bound(F64 if dtype == F64 else F32, p.headdim, mags)
    low = None
    if dtype == F16:
        with np.errstate(all="ignore"):               # float16 may overflow: then only the floor applies
            o16, l16 = reference.attention(p.q, p.k, p.v, dtype=np.float16, **opts)
            low = dict(out=o16, lse=l16)
            if backward:
                low.update(zip(("dq", "dk", "dv"),
                               reference.attention_backward(p.dout, p.q, p.k, p.v, dtype=np.float16, **opts)))
    return Expected(dtype=dtype, out=out, lse=lse, grads=grads, mags=mags, rel=rel, low=low)


# --------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------
def _first_bad(mask):
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _max_err(a, b, where):
    return float(np.max(np.abs(a[where] - b[where]), initial=0.0))


def assert_matches(name, got, ref, scale, exp: Expected, low=None, what=""):
    """``got`` (kernel) vs ``ref`` (float64 oracle) under the bound of the module docstring."""
    got = np.asarray(got)
    assert got.shape == ref.shape, f"{what}{name}: shape {got.shape}, oracle {ref.shape}"
    if exp.dtype != F64 and got.size:
        assert got.dtype == exp.dtype, f"{what}{name}: dtype {got.dtype}, expected {exp.dtype}"
    got = got.astype(np.float64)
    ref_nan = np.isnan(ref)
    bad = np.isnan(got) & ~ref_nan
    assert not bad.any(), (f"{what}{name}: {int(bad.sum())} NaN of {bad.size} where the oracle has none "
                           f"(first at {_first_bad(bad)}); unwritten poisoned output or a 0/0")
    fin = ~ref_nan
    err = _max_err(got, ref, fin)
    if exp.dtype == F16:
        floor = (HALF_ULP16 + exp.rel) * scale
        bound, rule = floor, "floor only (float16 oracle overflowed)"
        low = np.asarray(low, dtype=np.float64)
        if np.all(np.isfinite(low[fin])):
            err16 = _max_err(low, ref, fin)
            bound, rule = 2 * err16 + floor, f"2 * float16-oracle error {err16:.3g} + floor {floor:.3g}"
    else:
        # below the result type's smallest normal number a value is subnormal or flushed to zero (the GPU's ftz):
        # an absolute floor of a few of them, else a float32 gradient of 1e-139 (Hypothesis draws such inputs)
        # would have to be exact
        tiny = 4 * np.finfo(exp.dtype if exp.dtype in (F32, F64) else F32).tiny
        bound, rule = exp.rel * scale + tiny, f"rel {exp.rel:.3g} * scale {scale:.3g} + underflow floor {tiny:.3g}"
    if not err <= bound:
        idx = _first_bad(np.abs(got - ref) == err) if got.size else ()
        raise AssertionError(f"{what}{name}: max |kernel - oracle| = {err:.3g} > {bound:.3g} ({rule}); "
                             f"at {idx}: kernel {got[idx]!r}, oracle {ref[idx]!r}")


def assert_lse_matches(got, exp: Expected, what=""):
    got = np.asarray(got)
    ref = exp.lse.astype(np.float64)
    assert got.shape == ref.shape, f"{what}lse: shape {got.shape}, oracle {ref.shape}"
    want_dtype = F64 if exp.dtype == F64 else F32
    if got.size:
        assert got.dtype == want_dtype, f"{what}lse: dtype {got.dtype}, expected {want_dtype}"
    got = got.astype(np.float64)
    assert not np.isnan(got).any(), f"{what}lse: NaN at {_first_bad(np.isnan(got))}"
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref),
                                  err_msg=f"{what}lse: -inf (rows that see no key) not where the oracle has them")
    fin = np.isfinite(ref)
    assert np.all(np.isfinite(got[fin])), f"{what}lse: non-finite where the oracle is finite"
    err = _max_err(got, ref, fin)
    if exp.dtype == F16:
        floor = exp.rel
        low = np.asarray(exp.low["lse"], dtype=np.float64)
        bound = floor + (2 * _max_err(low, ref, fin) if np.all(np.isfinite(low[fin])) else 0.0)
    else:
        bound = exp.rel
    assert err <= bound, f"{what}lse: max |kernel - oracle| = {err:.3g} > {bound:.3g} (absolute)"


def check_forward(exp: Expected, out, lse=None, what=""):
    low = exp.low["out"] if exp.low else None
    assert_matches("out", out, exp.out, exp.mags["out"], exp, low, what)
    if lse is not None:
        assert_lse_matches(lse, exp, what)


def check_backward(exp: Expected, grads, what=""):
    assert len(grads) == 3, f"{what}backward returned {len(grads)} arrays, expected dq, dk, dv"
    for name, g in zip(("dq", "dk", "dv"), grads):
        low = exp.low[name] if exp.low else None
        assert_matches(name, g, exp.grads[name], exp.mags[name], exp, low, what)


def assert_bitwise_equal(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    assert a.tobytes() == b.tobytes(), (f"{what}: not bit-identical; max |diff| "
                                        f"{float(np.nanmax(np.abs(a.astype(np.float64) - b), initial=0)):.3g}")


# --------------------------------------------------------------------------------------
# bfloat16 (the tensor-core backend).  NumPy has no bfloat16: values are carried as
# float32 numbers that bfloat16 represents exactly, rounded with ``round_bf16``.
# The flash-attn rule needs "the oracle computed in bfloat16": ``bf16_oracle_out``
# rounds what a bfloat16 attention rounds (the probabilities before P V, and the
# output), the rest in float64.  Bound: 2x its error plus a floor of half a
# bfloat16 ulp of the scale plus the float32 bound.
# --------------------------------------------------------------------------------------
HALF_ULP_BF16 = 2.0 ** -8


def round_bf16(x):
    """``x`` rounded to bfloat16 (to nearest even), as float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)
    out = r.view(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), out)


def bf16_oracle_out(p: S.Problem):
    """The output of attention with the probabilities and the result rounded to bfloat16."""
    opts = dict(p.opts)
    probs = reference.attention_probs(p.q, p.k, p.v, **opts)                 # (b, h, sq, sk), float64
    pd = opts.get("dropout_p", 0.0)
    if pd > 0:
        keep = reference.dropout_keep_mask(opts.get("seed", 0), p.batch, p.nheads, p.seqlen_q, p.seqlen_k, pd)
        probs = probs * keep / (1.0 - pd)
    v = np.repeat(_bhsd(p.v), p.nheads // p.nheads_k, axis=1)
    out = round_bf16(round_bf16(probs).astype(np.float64) @ v).astype(np.float64)
    return out.transpose(0, 2, 1, 3)


def check_forward_bf16(p: S.Problem, out, lse):
    """bfloat16 ``out`` (given as float32 values) and float32 ``lse`` against the float64 oracle."""
    exp = expected(p, backward=False)                                      # p's arrays are float32
    out = np.asarray(out, dtype=np.float64)
    assert out.shape == exp.out.shape, f"out: shape {out.shape}, oracle {exp.out.shape}"
    fin = ~np.isnan(exp.out)
    bad = np.isnan(out) & fin
    assert not bad.any(), f"out: {int(bad.sum())} NaN where the oracle has none (first at {_first_bad(bad)})"
    err = _max_err(out, exp.out, fin)
    err_bf16 = _max_err(bf16_oracle_out(p), exp.out, fin)
    bound = 2 * err_bf16 + (HALF_ULP_BF16 + exp.rel) * exp.mags["out"]
    assert err <= bound, f"out: max |kernel - oracle| = {err:.3g} > {bound:.3g} (2 * bfloat16-oracle error {err_bf16:.3g} + floor)"
    assert_lse_matches(lse, exp)


def recorded_then_replayed(call, recordings):
    """A dispatch-cache test's three calls: ``call(0)`` recorded (``recordings`` recordings), ``call(1)`` replayed
    from them, and ``call(1)`` again on the full path (the cache emptied); returns the last two's results."""
    from flashnb import _dispatch
    _dispatch.clear()
    call(0)
    assert _dispatch.stats["recorded"] == recordings
    replayed = call(1)
    assert _dispatch.stats["hits"] == recordings
    _dispatch.clear()
    full = call(1)
    assert _dispatch.stats["hits"] == 0
    return replayed, full
