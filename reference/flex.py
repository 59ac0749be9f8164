"""FlexAttention's semantics in NumPy: attention whose scores a ``score_mod`` rewrites and whose mask a
``mask_mod`` defines, both plain Python functions of the score and the indices (issue: score_mod and mask_mod
compiled into the kernels; this is their oracle, written first).

    s[b, h, i, j] = scale * q[b, h, i] . k[b, h // group, j]
    s[b, h, i, j] = score_mod(s[b, h, i, j], b, h, i, j)              (default: unchanged)
    s[b, h, i, j] = -inf unless mask_mod(b, h, i, j)                  (default: every pair)
    out = softmax(s) v, lse = log sum_j exp(s)                        (a row with no key: out 0, lse -inf)

Layout as PyTorch's ``flex_attention``: query ``(B, Hq, L, E)``, key ``(B, Hkv, S, E)``, value ``(B, Hkv, S,
Ev)``; ``Hkv != Hq`` needs ``enable_gqa`` (query head ``h`` reads key/value head ``h // (Hq / Hkv)``).  The
masks are top-left: a causal ``mask_mod`` is ``q_idx >= kv_idx`` whatever ``L`` and ``S``.

``mod_grid`` evaluates a mod over NumPy index grids: vectorised where the function works on arrays (its
operators broadcast), else element by element (a function with ``if`` on its arguments, or ``math.tanh``), so
the very function a kernel compiles is the one the oracle runs.  ``block_states`` is the oracle of
``create_block_mask``: each (b, h, query block, key block) empty, partial or full.
"""
from __future__ import annotations

import types
import warnings

import numpy as np

from .standard import _softmax

__all__ = ["flex_attention", "flex_attention_backward", "score_mod_derivative", "captured_derivative", "mod_grid",
           "block_states", "EMPTY", "PARTIAL", "FULL"]

EMPTY, PARTIAL, FULL = 0, 1, 2


def _grids(B, H, L, S):
    return (np.arange(B)[:, None, None, None], np.arange(H)[None, :, None, None],
            np.arange(L)[None, None, :, None], np.arange(S)[None, None, None, :])


def mod_grid(fn, shape, score=None):
    """``fn`` over every ``(b, h, q_idx, kv_idx)`` of ``shape = (B, H, L, S)`` (with ``score`` first when given:
    a score_mod), as a float64 (score_mod) or bool (mask_mod) array of that shape."""
    b, h, i, j = _grids(*shape)
    args = (b, h, i, j) if score is None else (score, b, h, i, j)
    try:
        with np.errstate(all="ignore"):
            out = np.asarray(fn(*args))
        out = np.broadcast_to(out, shape)
    except (TypeError, ValueError):       # ``if`` on an array, math.* on an array: one element at a time
        out = np.empty(shape, dtype=object)
        for idx in np.ndindex(*shape):
            bb, hh, ii, jj = idx
            out[idx] = fn(bb, hh, ii, jj) if score is None else fn(score[idx], bb, hh, ii, jj)
    return out.astype(bool if score is None else np.float64)


def _prepare(query, key, value, scale, enable_gqa, dtype=None):
    """``(q, k, v, group, scale)`` in ``dtype`` (float64 by default), k and v with their heads repeated to the
    query's."""
    dtype = np.dtype(np.float64 if dtype is None else dtype)
    if dtype not in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype must be None, float16, float32 or float64, got {dtype}")
    q, k, v = (np.asarray(x).astype(dtype) for x in (query, key, value))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("query, key and value must have 4 dimensions (batch, heads, seqlen, dim)")
    B, Hq, L, E = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != B or k.shape[3] != E:
        raise ValueError(f"key {k.shape} and value {v.shape} do not fit query {q.shape}")
    Hkv = k.shape[1]
    if Hkv != Hq and not (enable_gqa and Hkv > 0 and Hq % Hkv == 0):
        raise ValueError(f"query has {Hq} heads and key {Hkv}: grouped heads need enable_gqa=True and a multiple")
    group = Hq // Hkv
    scale = dtype.type(1.0 / np.sqrt(E) if scale is None else float(scale))
    return q, np.repeat(k, group, axis=1), np.repeat(v, group, axis=1), group, scale


def _scores(raw, score_mod, mask_mod):
    """The scores after the score_mod and the mask (-inf where ``mask_mod`` is False), in ``raw``'s dtype (the
    score_mod evaluated in float64 and rounded back: a mod's own arithmetic is not the dtype's concern)."""
    s = raw if score_mod is None else mod_grid(score_mod, raw.shape, raw).astype(raw.dtype)
    if mask_mod is not None:
        s = np.where(mod_grid(mask_mod, s.shape), s, raw.dtype.type(-np.inf))
    return s


def flex_attention(query, key, value, score_mod=None, mask_mod=None, scale=None, enable_gqa=False,
                   return_lse=False, dtype=None):
    """``out`` ``(B, Hq, L, Ev)``, or ``(out, lse)`` with ``lse`` ``(B, Hq, L)`` (natural log).  ``dtype``: compute
    in float16, float32 or float64 (the default), as ``reference.attention(dtype=)``: the flash-attn rule's
    "oracle in the input precision"; lse float32 for float16."""
    q, k, v, _, scale = _prepare(query, key, value, scale, enable_gqa, dtype)
    s = _scores(scale * (q @ np.swapaxes(k, -1, -2)), score_mod, mask_mod)
    p, lse = _softmax(s)
    out = p @ v
    lse = lse.astype(np.float32) if q.dtype.itemsize == 2 else lse
    return (out, lse) if return_lse else out


def score_mod_derivative(score_mod, score, b, h, i, j):
    """``d score_mod / d score`` at every entry, by the complex step: ``Im f(s + i t) / t`` with ``t = 1e-30``,
    exact to rounding for the functions a score_mod is built of (arithmetic, ``np.tanh``, ``np.exp``, indexed
    tables) without a difference quotient's cancellation; a function that cannot take complex scores (``math``,
    comparisons on the score), or takes them but drops their imaginary part (``abs(score)``: the step then
    disagrees with a central difference), raises ``TypeError``: pass ``score_mod_grad``."""
    t = 1e-30
    z = score + 1j * t
    lost = np.exceptions.ComplexWarning       # a cast that drops the imaginary part would give 0 silently
    with warnings.catch_warnings():
        warnings.simplefilter("error", lost)
        try:
            with np.errstate(all="ignore"):
                out = np.broadcast_to(np.asarray(score_mod(z, b, h, i, j)), score.shape)
        except (TypeError, ValueError, lost):     # ``if`` on the indices: one element at a time, as ``mod_grid``
            out = np.empty(score.shape, complex)
            try:
                for idx in np.ndindex(*score.shape):
                    out[idx] = score_mod(complex(z[idx]), *idx)   # (a Python complex: math.* refuses it)
            except (TypeError, ValueError, lost) as e:
                raise TypeError("score_mod cannot be differentiated by the complex step (it must take complex "
                                "scores: no math.*, no comparisons on the score); pass score_mod_grad") from e
    if not np.iscomplexobj(out):          # the score did not reach the result: a constant in the score
        out = np.zeros(score.shape, complex)
    step = out.imag / t
    # a function can take a complex score and still lose its imaginary part where it matters (abs(score) is real):
    # the step must agree with a central difference, else the function needs its derivative given
    h = 1e-6 * (1.0 + np.abs(score))
    with np.errstate(all="ignore"):
        fd = (mod_grid(score_mod, score.shape, score + h) - mod_grid(score_mod, score.shape, score - h)) / (2 * h)
    if not np.all(np.abs(step - fd) <= 1e-4 * (1.0 + np.abs(fd))):
        raise TypeError("score_mod's complex step disagrees with its central difference (abs(score), or a part of "
                        "the score taken as real?): pass score_mod_grad")
    return step


def flex_attention_backward(dout, query, key, value, score_mod=None, mask_mod=None, scale=None, enable_gqa=False,
                            score_mod_grad=None, dtype=None, captured_grads=()):
    """``(dq, dk, dv)`` of ``sum(flex_attention(...) * dout)``: the recompute backward with the score_mod's chain
    rule, ``dS_raw = dS * score_mod'(s_raw)`` (``score_mod_grad(s, b, h, i, j)`` where given, else
    ``score_mod_derivative``); ``dk``, ``dv`` summed over the query heads of a key/value head.  In ``dtype``
    (float64 by default; the derivative evaluated in float64 and rounded to it).

    ``captured_grads``: names of NumPy arrays the score_mod captures (its closure's variables or the globals it
    reads; a learned bias table, per-head slopes): then ``(dq, dk, dv, grads)`` with ``grads[name]`` the gradient
    of the same sum in that array, ``sum over (b, h, i, j) of dS * d score_mod / d array[t]`` at every entry ``t``
    (``captured_derivative``: the complex step in each entry)."""
    q, kr, vr, group, scale = _prepare(query, key, value, scale, enable_gqa, dtype)
    do = np.asarray(dout).astype(q.dtype)
    B, Hq, L, _ = q.shape
    Hkv, S = Hq // group, kr.shape[2]
    raw = scale * (q @ np.swapaxes(kr, -1, -2))
    grids = _grids(B, Hq, L, S)
    s = _scores(raw, score_mod, mask_mod)
    p, _ = _softmax(s)
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(vr, -1, -2)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    grads = {}
    if captured_grads:
        if score_mod is None:
            raise ValueError("captured_grads needs a score_mod (the arrays it captures)")
        for name in captured_grads:                  # (ds: d sum / d the score_mod's result, before its chain rule)
            grads[name] = captured_derivative(score_mod, name, raw.astype(np.float64), ds.astype(np.float64))
    if score_mod is not None:
        raw64 = raw.astype(np.float64)
        grad = (mod_grid(score_mod_grad, raw.shape, raw64) if score_mod_grad is not None
                else score_mod_derivative(score_mod, raw64, *grids))
        ds = ds * np.where(p > 0, grad, 0.0).astype(q.dtype)   # masked entries: p = 0, their derivative never counts
    dq = scale * ds @ kr
    dk = scale * np.swapaxes(ds, -1, -2) @ q
    fold = lambda x: x.reshape(B, Hkv, group, S, -1).sum(axis=2)     # noqa: E731
    return (dq, fold(dk), fold(dv)) + ((grads,) if captured_grads else ())


def _capture_place(fn, name):
    """Where ``fn`` captures ``name``: "closure" or "global"; ValueError where it does not (an argument or local
    variable of that name shadows any, and a global must be read by ``fn``'s own code: helpers it calls are not
    followed)."""
    code = fn.__code__
    label = getattr(fn, "__name__", fn)
    if name in code.co_varnames:
        raise ValueError(f"{label!r} has an argument or local variable {name!r}, not a capture (a default argument "
                         "is evaluated once: capture the array from the enclosing scope instead)")
    if name in code.co_freevars:
        return "closure"
    if name in code.co_names and name in fn.__globals__:
        return "global"
    raise ValueError(f"{label!r} captures no variable {name!r} in its own code (helpers it calls are not followed)")


def _with_capture(fn, name, value):
    """``fn`` with its captured ``name`` (a closure variable, or a global its code reads) bound to ``value``."""
    code = fn.__code__
    if _capture_place(fn, name) == "closure":
        cells = tuple(types.CellType(value) if var == name else cell
                      for var, cell in zip(code.co_freevars, fn.__closure__))
        new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    else:
        new = types.FunctionType(code, {**fn.__globals__, name: value}, fn.__name__, fn.__defaults__,
                                 fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def captured_array(fn, name):
    """The NumPy array ``fn`` captures as ``name`` (closure variable, or a global its code reads)."""
    code = fn.__code__
    if _capture_place(fn, name) == "closure":
        value = fn.__closure__[code.co_freevars.index(name)].cell_contents
    else:
        value = fn.__globals__[name]
    if not isinstance(value, np.ndarray):
        raise TypeError(f"the captured {name!r} is a {type(value).__name__}, not a NumPy array")
    return value


def _mod_over(fn, score, grids):
    """``fn`` over the grid, as complex values; a ComplexWarning (a cast that drops the imaginary part) raises."""
    lost = np.exceptions.ComplexWarning
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("error", lost)
        try:
            return np.broadcast_to(np.asarray(fn(score, *grids)), score.shape)
        except (TypeError, ValueError):     # ``if`` on the indices: one element at a time, as ``mod_grid``
            got = np.empty(score.shape, complex)
            for idx in np.ndindex(*score.shape):
                got[idx] = fn(score[idx], *idx)
            return got


def captured_derivative(score_mod, name, score, weight):
    """``sum over (b, h, i, j) of weight * d score_mod(score, b, h, i, j) / d table[t]`` for every entry ``t`` of
    the array ``table`` that ``score_mod`` captures as ``name``, shaped like it: the complex step in one entry at a
    time (``table + i 1e-30 e_t``; the function must take a complex table: arithmetic and indexing do), the
    score and indices over the grid of ``score``'s shape ``(B, H, L, S)``.  A function that drops the imaginary
    part (``abs`` of the entry, a cast to a real type) would give 0 silently: every entry's step is checked
    against a central difference, and a disagreement raises ``TypeError``."""
    table = captured_array(score_mod, name)
    t = 1e-30
    out = np.zeros(table.shape, np.float64)
    grids = _grids(*score.shape)
    for entry in np.ndindex(*table.shape):
        stepped = table.astype(np.complex128)
        stepped[entry] += 1j * t
        try:
            step = np.imag(_mod_over(_with_capture(score_mod, name, stepped), score, grids)) / t
        except np.exceptions.ComplexWarning as e:
            raise TypeError(f"score_mod drops the imaginary part of {name!r} (a cast to a real type): its gradient "
                            "in that array cannot be taken by the complex step") from e
        h = 1e-6 * (1.0 + abs(float(table[entry])))
        ends = []
        for sign in (1, -1):
            moved = table.astype(np.float64)
            moved[entry] += sign * h
            ends.append(np.real(_mod_over(_with_capture(score_mod, name, moved), score, grids)))
        fd = (ends[0] - ends[1]) / (2 * h)
        if not np.all(np.abs(step - fd) <= 1e-4 * (1.0 + np.abs(fd))):
            raise TypeError(f"score_mod's complex step in {name!r} disagrees with its central difference (abs of an "
                            "entry, or a part of it taken as real?): its gradient in that array is not defined here")
        out[entry] = np.sum(weight * step)
    return out


def block_states(mask_mod, B, H, L, S, block_size=(128, 128)):
    """``create_block_mask``'s content: ``(B, H, ceil(L / bq), ceil(S / bk))`` of ``EMPTY`` (no pair of the
    block is kept: never loaded), ``PARTIAL`` (the mask is evaluated) or ``FULL`` (every pair kept: no mask
    evaluated); ``B`` or ``H`` None broadcast (one entry)."""
    bq, bk = (block_size, block_size) if np.isscalar(block_size) else block_size
    B, H = B or 1, H or 1
    keep = mod_grid(mask_mod, (B, H, L, S))
    nq, nk = -(-L // bq), -(-S // bk)
    states = np.empty((B, H, nq, nk), np.int8)
    for qb in range(nq):
        for kb in range(nk):
            tile = keep[:, :, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
            states[:, :, qb, kb] = np.where(tile.all(axis=(2, 3)), FULL, np.where(tile.any(axis=(2, 3)), PARTIAL,
                                                                                  EMPTY))
    return states
