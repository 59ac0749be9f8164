"""FP8 attention's oracle: the e4m3 format, its quantiser, attention of FP8 inputs, and bounds on what
quantisation costs.

The format is ``float8_e4m3fn``: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits. There is no infinity,
and NaN is ``S.1111.111`` (codes 0x7F and 0xFF).
- Normal codes are ``(1 + m/8) 2^(e-7)``, from 2^-6 to 448 = 1.75 x 2^8.
- Subnormal codes are ``m 2^-9``.
- Positive codes 0x00-0x7E increase with their value.

A tensor travels as codes and a descaling factor: ``x ~ dequantize(codes) * descale``. This is
FlashAttention-3's convention: ``q_descale``, ``k_descale``, ``v_descale``, per tensor or per (batch, key/value
head).

* ``quantize_e4m3(x, descale, saturate=True)``: the codes of ``x / descale``, rounded to the nearest value,
  ties to the even code.
  - ``saturate=True`` is the kernels' conversion (PTX ``cvt.rn.satfinite.e4m3x2.f32``): beyond 448 it clamps to
    +-448.
  - ``saturate=False`` is PyTorch's ``tensor.to(torch.float8_e4m3fn)``: magnitudes above 464 (half-way to the
    next binade's first step) become NaN.
* ``dequantize_e4m3(codes, descale)``: the values, in float64.
* ``quantize_blocks_e4m3(x, block)``: FA3's block quantisation, a descaling factor per (batch, head, block of
  rows), each the block's largest magnitude over 448; ``fp8_attention`` and ``input_quantization_bound`` take
  such descales with ``block_q`` / ``block_k``.
* ``fp8_attention(q8, k8, v8, q_descale, k_descale, v_descale, **opts)``: what an FP8 kernel computes, defined
  as attention, in float64, of the dequantised inputs (``reference.attention``, every option of it). The
  kernel's own error is measured against this; the inputs' quantisation error is not the kernel's.
* ``rounding_bound(x, descale)``: per element, the most ``|dequantize(quantize(x)) - x|`` can be:
  ``max(2^-4 |x|, 2^-10 descale)`` inside the range. That is half a unit in the last place: relative ``2^-4`` for
  normals, absolute ``2^-10 descale`` for subnormals.
* ``input_quantization_bound(q, k, v, ...)``: a bound, per output element, on ``|attention(quantised inputs) -
  attention(inputs)|``; the derivation is in its docstring.
* ``p_quantization_bound(q, k, v, ...)``: a bound on what quantising the probabilities ``P`` to e4m3 for the
  ``P V`` product costs, as FA3's forward does (the row sums from the unquantised ``P``).
* ``fp8_flash_forward(q8, k8, v8, ..., p_descale, block_k)``: FA3's FP8 forward as an algorithm, in float64 so
  that only its quantisation shows. Key tiles go through an online softmax; each tile's ``exp(s - running max)``
  is quantised to e4m3 for ``P V``. The kernel is to be held to it, and it is held to ``fp8_attention`` within
  ``p_quantization_bound``: that checks the bound's claim for a running max.
* ``fp8_flash_forward_varlen(q8, k8, v8, cu_seqlens_q, cu_seqlens_k, ...)``: the same for a packed batch
  (flash-attn's varlen layout), each sequence on its own, its descales the rows of ``(batch, nheads_k)`` arrays.
* ``fp8_flash_forward_kvcache(q8, k_cache8, v_cache8, cache_seqlens, k8, v8, ...)``: the same over a dense KV
  cache: the new rows appended (to copies), each sequence over its cache's first rows.
"""
from __future__ import annotations

import numpy as np

from .standard import attention, attention_probs

__all__ = ["E4M3_MAX", "E4M3_UNIT_ROUNDOFF", "E4M3_SUBNORMAL_HALF_STEP", "e4m3_table", "quantize_e4m3",
           "dequantize_e4m3", "quantize_blocks_e4m3", "fp8_attention", "fp8_flash_forward",
           "fp8_flash_forward_varlen", "fp8_flash_forward_kvcache", "rounding_bound",
           "input_quantization_bound", "p_quantization_bound"]

E4M3_MAX = 448.0
E4M3_UNIT_ROUNDOFF = 2.0 ** -4         # half a unit in the last place, relative, for normal values
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10  # half a unit in the last place, absolute, for subnormal values
_NAN_CODE = 0x7F
_OVERFLOW_TO_NAN = 464.0               # PyTorch's cast: above this, NaN (464 itself rounds to the even 448)


def e4m3_table():
    """The float64 value of each of the 256 codes (NaN at 0x7F and 0xFF), from the format's definition."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e, m = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(e == 0, m * 2.0 ** -9, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    value = sign * value
    value[(codes & 0x7F) == _NAN_CODE] = np.nan
    return value


_TABLE = e4m3_table()
_POSITIVE = _TABLE[:_NAN_CODE]         # codes 0x00-0x7E, increasing


def _descale(descale):
    d = np.asarray(1.0 if descale is None else descale, np.float64)
    if np.any(~np.isfinite(d)) or np.any(d <= 0):
        raise ValueError("a descaling factor must be finite and > 0")
    return d


def quantize_e4m3(x, descale=None, saturate=True):
    """The e4m3 codes (uint8) of ``x / descale``: nearest value, ties to the even code; beyond the range
    +-448 with ``saturate`` (the kernels' conversion), else NaN above 464 (PyTorch's cast).  NaN stays NaN."""
    y = np.asarray(x, np.float64) / _descale(descale)
    mag = np.abs(y)
    finite = np.where(np.isnan(mag), 0.0, np.minimum(mag, E4M3_MAX))
    hi = np.clip(np.searchsorted(_POSITIVE, finite, side="left"), 0, len(_POSITIVE) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = finite - _POSITIVE[lo], _POSITIVE[hi] - finite
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = code | np.where(np.signbit(y), 0x80, 0)
    if not saturate:
        code = np.where(mag > _OVERFLOW_TO_NAN, code | _NAN_CODE, code)
    code = np.where(np.isnan(y), _NAN_CODE | np.where(np.signbit(y), 0x80, 0), code)
    return code.astype(np.uint8)


def dequantize_e4m3(codes, descale=None):
    """The float64 values of e4m3 ``codes`` (uint8), times ``descale``."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes must be uint8 e4m3 codes, got {codes.dtype}")
    return _TABLE[codes] * _descale(descale)


def _per_head(descale, batch, nheads, nheads_k, seqlen=None, block=None):
    """A descaling factor per tensor, per (batch, key/value head), or (``block`` rows a block, FA3's block
    quantisation) per (batch, key/value head, block of rows), as an array that broadcasts over ``(batch, seqlen,
    nheads, headdim)``: the query (or key/value) heads ``nheads``, query head ``h`` using key/value head
    ``h // (nheads / nheads_k)``'s."""
    d = _descale(descale)
    if d.ndim == 0:
        return d
    if block is not None:
        blocks = -(-seqlen // block)
        if d.shape != (batch, nheads_k, blocks):
            raise ValueError(f"a block descaling factor must be of shape (batch, nheads_k, ceil(seqlen / block)) = "
                             f"{(batch, nheads_k, blocks)}, got {d.shape}")
        rows = np.repeat(d, block, axis=2)[:, :, :seqlen]                  # (batch, nheads_k, seqlen)
        return np.repeat(rows, nheads // nheads_k, axis=1).transpose(0, 2, 1)[..., None]
    if d.shape != (batch, nheads_k):
        raise ValueError(f"a descaling factor must be a scalar or of shape (batch, nheads_k) = {(batch, nheads_k)}, "
                         f"got {d.shape}")
    return np.repeat(d, nheads // nheads_k, axis=1)[:, None, :, None]


def quantize_blocks_e4m3(x, block, saturate=True):
    """FA3's block quantisation of ``x`` ``(batch, seqlen, nheads, headdim)``: ``(codes, descale)`` with a
    descaling factor per (batch, head, block of ``block`` rows), ``descale`` ``(batch, nheads, ceil(seqlen /
    block))``, each the block's largest magnitude over 448 (a block of zeros: 1), so every block uses e4m3's whole
    range and an outlier costs only its own block's precision."""
    x = np.asarray(x, np.float64)
    if x.ndim != 4:
        raise ValueError(f"x must have 4 dimensions (batch, seqlen, nheads, headdim), got {x.shape}")
    if not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    if not np.all(np.isfinite(x)):
        raise ValueError("x must be finite")
    batch, seqlen, nheads, d = x.shape
    blocks = -(-seqlen // block)
    padded = np.zeros((batch, blocks * block, nheads, d))
    padded[:, :seqlen] = np.abs(x)
    amax = padded.reshape(batch, blocks, block, nheads, d).max(axis=(2, 4), initial=0.0).transpose(0, 2, 1)
    descale = np.where(amax > 0, amax / E4M3_MAX, 1.0)
    return quantize_e4m3(x, _per_head(descale, batch, nheads, nheads, seqlen, block), saturate), descale


def _dequantize_inputs(q8, k8, v8, q_descale, k_descale, v_descale, block_q=None, block_k=None):
    q8, k8, v8 = (np.asarray(x) for x in (q8, k8, v8))
    if q8.ndim != 4 or k8.ndim != 4 or v8.ndim != 4:
        raise ValueError("q8, k8 and v8 must have 4 dimensions (batch, seqlen, nheads, headdim)")
    batch, nheads, nheads_k = q8.shape[0], q8.shape[2], k8.shape[2]
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"nheads_k ({nheads_k}) must divide nheads ({nheads})")
    q = dequantize_e4m3(q8) * (_per_head(q_descale, batch, nheads, nheads_k) if block_q is None   # (blocks of a
                               else _per_head(q_descale, batch, nheads, nheads, q8.shape[1], block_q))  # query head)
    k = dequantize_e4m3(k8) * _per_head(k_descale, batch, nheads_k, nheads_k, k8.shape[1], block_k)
    v = dequantize_e4m3(v8) * _per_head(v_descale, batch, nheads_k, nheads_k, v8.shape[1], block_k)
    return q, k, v


def fp8_attention(q8, k8, v8, q_descale=None, k_descale=None, v_descale=None, *, block_q=None, block_k=None,
                  **opts):
    """``(out, lse)`` of attention over FP8 inputs: ``reference.attention`` of the dequantised inputs, in
    float64.

    q8 ``(batch, seqlen_q, nheads, headdim)``, k8 and v8 ``(batch, seqlen_k, nheads_k, headdim)``: uint8 e4m3
    codes.  Each descaling factor is None (1), a scalar, or ``(batch, nheads_k)`` (FA3's); query head ``h``
    uses key/value head ``h // (nheads / nheads_k)``'s.  Block quantisation (``quantize_blocks_e4m3``):
    ``block_q`` rows a block of q, ``q_descale`` ``(batch, nheads, ceil(seqlen_q / block_q))`` (a query head's
    own); ``block_k`` likewise for k and v, over the key/value heads.  ``opts``: ``reference.attention``'s options
    (``causal``, ``softmax_scale``, windows, ...)."""
    return attention(*_dequantize_inputs(q8, k8, v8, q_descale, k_descale, v_descale, block_q, block_k), **opts)


def rounding_bound(x, descale=None):
    """Per element, the most ``|dequantize_e4m3(quantize_e4m3(x, descale), descale) - x|`` can be (saturating):
    ``max(2^-4 |x|, 2^-10 descale)`` inside the range, ``|x| - 448 descale`` beyond it."""
    x = np.abs(np.asarray(x, np.float64))
    d = _descale(descale)
    inside = np.maximum(E4M3_UNIT_ROUNDOFF * x, E4M3_SUBNORMAL_HALF_STEP * d)
    return np.where(x > E4M3_MAX * d, x - E4M3_MAX * d, inside)


def input_quantization_bound(q, k, v, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, *,
                             block_q=None, block_k=None):
    """A bound, per element of ``out`` ``(batch, seqlen_q, nheads, headdim)``, on
    ``|attention(deq(quant(q)), deq(quant(k)), deq(quant(v))) - attention(q, k, v)|``.  It holds for every
    mask: a mask only removes keys from the maxima below.  Inputs are float, laid out as ``attention``'s.
    Descaling factors (and ``block_q``, ``block_k``) are as in ``fp8_attention``.

    The derivation, for one query row ``i`` and head:
    1. The elementwise errors ``|dq| <= eq``, ``|dk| <= ek``, ``|dv| <= ev`` come from ``rounding_bound``.
    2. Each score moves by at most
       ``delta = scale * max_j sum_d (|q_id| ek_jd + eq_id |k_jd| + eq_id ek_jd)``.
    3. Each ratio ``r_j = p'_j / p_j = e^(d_j) / Z`` lies in ``[A, A e^2delta]`` with ``sum_j p_j r_j = 1``.
       The total variation ``TV = sum_(r_j > 1) p_j (r_j - 1)`` is largest with all the mass at the two ends,
       where it is ``(1 - A)(B - 1) / (B - A)``. Over ``A`` that is at most ``tanh(delta / 2)``, reached at
       ``A = e^-delta``.
    4. ``out' - out = sum_j (p'_j - p_j) v'_j + sum_j p_j (v'_j - v_j)``. The first sum is at most
       ``TV (max_j v'_jd - min_j v'_jd)``: the ``p'_j - p_j`` sum to 0, with ``TV`` on each side.
    5. Hence ``|out'_id - out_id| <= tanh(delta / 2) (max_j v'_jd - min_j v'_jd) + max_j ev_jd``, with
       ``v - ev <= v' <= v + ev``.
    It is a worst case. ``delta`` adds ``headdim`` same-signed rounding errors where random ones add as
    ``sqrt(headdim)``. So on random data the error is typically 1-10% of the bound, and for large scores it
    tends to the values' whole range.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    nheads_k = k.shape[2]
    group = nheads // nheads_k
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    eq = rounding_bound(q, _per_head(q_descale, batch, nheads, nheads_k) if block_q is None
                        else _per_head(q_descale, batch, nheads, nheads, seqlen_q, block_q))
    ek = rounding_bound(k, _per_head(k_descale, batch, nheads_k, nheads_k, k.shape[1], block_k))
    ev = rounding_bound(v, _per_head(v_descale, batch, nheads_k, nheads_k, v.shape[1], block_k))
    k_r, ek_r, v_r, ev_r = (np.repeat(x, group, axis=2) for x in (k, ek, v, ev))   # to the query heads
    qa, ka = np.abs(q), np.abs(k_r)
    moved = (np.einsum("bihd,bjhd->bhij", qa, ek_r) + np.einsum("bihd,bjhd->bhij", eq, ka)
             + np.einsum("bihd,bjhd->bhij", eq, ek_r))
    delta = scale * moved.max(axis=-1)                                      # (batch, nheads, seqlen_q)
    tv = np.tanh(delta / 2).transpose(0, 2, 1)[..., None]                   # (batch, seqlen_q, nheads, 1)
    v_range = ((v_r + ev_r).max(axis=1) - (v_r - ev_r).min(axis=1))[:, None]   # (batch, 1, nheads, d)
    return tv * v_range + ev_r.max(axis=1)[:, None]


def p_quantization_bound(q, k, v, p_descale=1.0, softmax_scale=None, **opts):
    """A bound, per element of ``out``, on what quantising ``P`` costs. The kernel quantises the unnormalised
    probabilities ``exp(s - m) <= 1`` to e4m3 with descaling factor ``p_descale`` for the ``P V`` product.
    The row sum ``l`` comes from the unquantised ``P``, as in FA3's forward.

    Each quantised entry is off by at most ``max(2^-4 p_j, 2^-10 p_descale)`` (``rounding_bound``). This holds
    in the final units too: a tile quantised against an earlier, smaller running max is rescaled by
    ``exp(m_old - m_new) <= 1`` afterwards. So
    ``|dout_id| <= 2^-4 sum_j P_ij |v_jd| + 2^-10 p_descale sum_j |v_jd| / l_i``,
    where ``P`` is the normalised softmax and ``l_i = sum_j exp(s_ij - max_j s_ij) >= 1``.  It needs
    ``p_descale >= 1/448``, so that no ``p <= 1`` saturates (else ValueError).
    ``opts``: ``reference.attention``'s options (the mask decides which keys count)."""
    if not float(p_descale) * E4M3_MAX >= 1.0:
        raise ValueError(f"p_descale must be at least 1/448 (P <= 1 then stays inside e4m3's range; below it P "
                         f"saturates and this bound does not hold), got {p_descale!r}")
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    nheads, nheads_k = q.shape[2], k.shape[2]
    probs = attention_probs(q, k, v, softmax_scale=softmax_scale, **opts)     # (batch, nheads, seqlen_q, seqlen_k)
    _, lse = attention(q, k, v, softmax_scale=softmax_scale, **opts)
    v_r = np.abs(np.repeat(v, nheads // nheads_k, axis=2)).transpose(0, 2, 1, 3)   # (batch, nheads, seqlen_k, d)
    seen = (probs > 0).astype(np.float64)                     # the keys a row attends to
    inv_l = probs.max(axis=-1)                               # 1 / l_i = max_j P_ij (the max entry's exp is 1)
    relative = E4M3_UNIT_ROUNDOFF * probs @ v_r
    absolute = E4M3_SUBNORMAL_HALF_STEP * float(p_descale) * (seen @ v_r) * inv_l[..., None]
    return (relative + absolute).transpose(0, 2, 1, 3)       # (batch, seqlen_q, nheads, d)


def fp8_flash_forward(q8, k8, v8, q_descale=None, k_descale=None, v_descale=None, p_descale=1.0, block_k=64,
                      causal=False, softmax_scale=None, *, descale_block_q=None, descale_block_k=None):
    """``(out, lse)`` of FA3's FP8 forward, in float64. ``causal`` is bottom-right aligned, as ``attention``.
    For each key tile ``j`` of ``block_k`` keys, per query row:

        s = scale * q k_j^T                      (dequantised inputs)
        m_new = max(m, rowmax s)
        p = exp(s - m_new)                       (<= 1)
        l = l exp(m - m_new) + rowsum p          (the unquantised p)
        acc = acc exp(m - m_new) + deq(quant(p, p_descale)) v_j
        m = m_new

    and then ``out = acc / l``, ``lse = m + log l``. A row that sees no key gives ``out = 0`` and
    ``lse = -inf``.  Block quantisation: ``descale_block_q``, ``descale_block_k`` as ``fp8_attention``'s
    ``block_q``, ``block_k`` (the descales' rows a block; ``block_k`` here is the key tile).
    """
    q, k, v = _dequantize_inputs(q8, k8, v8, q_descale, k_descale, v_descale, descale_block_q, descale_block_k)
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, group = k.shape[1], nheads // k.shape[2]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not isinstance(block_k, int) or block_k < 1:
        raise ValueError(f"block_k must be a positive int, got {block_k!r}")
    qh = q.transpose(0, 2, 1, 3)                                             # (batch, nheads, seqlen_q, d)
    kh, vh = (np.repeat(x, group, axis=2).transpose(0, 2, 1, 3) for x in (k, v))
    m = np.full((batch, nheads, seqlen_q, 1), -np.inf)
    l = np.zeros((batch, nheads, seqlen_q, 1))
    acc = np.zeros((batch, nheads, seqlen_q, d))
    rows = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)               # the last key each row may see
    for j0 in range(0, seqlen_k, block_k):
        cols = np.arange(j0, min(j0 + block_k, seqlen_k))
        s = scale * qh @ kh[:, :, cols].swapaxes(-1, -2)
        if causal:
            s = np.where(cols[None, :] <= rows, s, -np.inf)
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        safe = np.where(np.isinf(m_new), 0.0, m_new)                          # rows that saw nothing yet
        alpha = np.exp(m - safe)
        p = np.exp(s - safe)
        l = l * alpha + p.sum(axis=-1, keepdims=True)
        p_q = dequantize_e4m3(quantize_e4m3(p, p_descale), p_descale)
        acc = acc * alpha + p_q @ vh[:, :, cols]
        m = m_new
    seen = l > 0
    out = np.where(seen, acc / np.where(seen, l, 1.0), 0.0)
    lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def fp8_flash_forward_varlen(q8, k8, v8, cu_seqlens_q, cu_seqlens_k, q_descale=None, k_descale=None,
                             v_descale=None, p_descale=1.0, block_k=64, causal=False, softmax_scale=None):
    """``(out, lse)`` of ``fp8_flash_forward`` on each sequence of a packed batch: ``q8`` ``(total_q, nheads,
    headdim)``, ``k8``, ``v8`` ``(total_k, nheads_k, headdim)``; sequence ``b`` is rows ``cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1]`` of q (``cu_seqlens_k`` of k, v); a descaling factor per tensor or per (sequence, key/value
    head), ``(batch, nheads_k)``; causal aligned to each sequence's bottom-right corner.  ``out`` ``(total_q,
    nheads, headdim)``, ``lse`` ``(nheads, total_q)`` (flash-attn's varlen layout); a sequence's query with no
    key: 0 and -inf."""
    cu_q, cu_k = (np.asarray(c, np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    if cu_q.shape != cu_k.shape or cu_q.ndim != 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be 1-D and of one length, got {cu_q.shape} and "
                         f"{cu_k.shape}")
    nheads, d = q8.shape[1], q8.shape[2]
    out = np.zeros((q8.shape[0], nheads, d))
    lse = np.full((nheads, q8.shape[0]), -np.inf)

    def row(descale, b):
        arr = _descale(descale)
        return arr if arr.ndim == 0 else arr[b:b + 1]

    for b in range(cu_q.shape[0] - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        o, l_ = fp8_flash_forward(q8[None, qs:qe], k8[None, ks:ke], v8[None, ks:ke], row(q_descale, b),
                                  row(k_descale, b), row(v_descale, b), p_descale, block_k, causal, softmax_scale)
        out[qs:qe], lse[:, qs:qe] = o[0], l_[0]
    return out, lse


def fp8_flash_forward_kvcache(q8, k_cache8, v_cache8, cache_seqlens, k8=None, v8=None, q_descale=None,
                              k_descale=None, v_descale=None, p_descale=1.0, block_k=64, causal=False,
                              softmax_scale=None):
    """``(out, lse, k_cache8, v_cache8)``: ``fp8_flash_forward`` of each sequence of a dense KV cache of e4m3 codes.
    ``q8`` ``(batch, seqlen_q, nheads, headdim)``, the caches ``(batch, capacity, nheads_k, headdim)``,
    ``cache_seqlens`` an int or ``(batch,)``; ``k8``, ``v8`` ``(batch, seqlen_new, nheads_k, headdim)``, if given,
    are written at rows ``cache_seqlens[b] ..`` of copies of the caches (returned; the inputs are not modified), and
    sequence ``b`` attends to the first ``cache_seqlens[b] + seqlen_new`` rows, causal aligned to that bottom-right
    corner.  Descales per tensor or ``(batch, nheads_k)``.  ``out`` ``(batch, seqlen_q, nheads, headdim)``, ``lse``
    ``(batch, nheads, seqlen_q)``; a query with no key: 0 and -inf."""
    batch = q8.shape[0]
    lengths = np.broadcast_to(np.asarray(cache_seqlens, np.int64), (batch,))
    k_cache8, v_cache8 = np.array(k_cache8), np.array(v_cache8)
    new = 0
    if k8 is not None:
        new = k8.shape[1]
        for b in range(batch):
            k_cache8[b, lengths[b]:lengths[b] + new] = k8[b]
            v_cache8[b, lengths[b]:lengths[b] + new] = v8[b]
    out = np.zeros(q8.shape)
    lse = np.full((batch, q8.shape[2], q8.shape[1]), -np.inf)

    def row(descale, b):
        arr = _descale(descale)
        return arr if arr.ndim == 0 else arr[b:b + 1]

    for b in range(batch):
        n = int(lengths[b]) + new
        out[b:b + 1], lse[b:b + 1] = fp8_flash_forward(q8[b:b + 1], k_cache8[b:b + 1, :n], v_cache8[b:b + 1, :n],
                                                       row(q_descale, b), row(k_descale, b), row(v_descale, b),
                                                       p_descale, block_k, causal, softmax_scale)
    return out, lse, k_cache8, v_cache8
