"""Packed batches, KV caches and split-KV decoding, defined on top of standard attention (``reference.standard``).

* ``attention_varlen`` / ``attention_varlen_backward``: flash-attn's packed layout -- q ``(total_q, nheads,
  headdim)``, k and v ``(total_k, nheads_k, headdim)``, sequence ``b`` at rows ``cu_seqlens[b]:cu_seqlens[b + 1]``
  (int32, shape ``(batch + 1,)``) -- defined as standard attention of each sequence on its own: causal and
  windows aligned to the bottom-right corner of each sequence, ALiBi slopes per sequence.  ``lse`` is
  ``(nheads, total_q)``, flash-attn's varlen layout.
* ``kvcache_append`` and ``attention_with_kvcache``: new keys/values written into a cache at
  ``cache_seqlens[b]`` (dense ``(batch, seqlen_cache, nheads_k, headdim)`` or paged ``(num_pages, page_size,
  nheads_k, headdim)`` through ``block_table (batch, pages_per_sequence)``), then attention of the new queries
  over each sequence's valid prefix ``cache_seqlens[b] + seqlen_new`` (bottom-right aligned per sequence).
* ``combine_splits``: partial results over disjoint key ranges merged exactly (flash-decoding's second step):
  ``lse = logsumexp_s lse_s``, ``out = sum_s exp(lse_s - lse) out_s``.

Not yet defined for packed batches (a ValueError says so): dense-shaped options (``attn_mask``, ``attn_bias``,
``block_mask``) and dropout (its Philox counter would take the sequence index and local positions).
"""
import numpy as np

from .standard import attention, attention_backward

_PACKED_REFUSED = ("attn_mask", "attn_bias", "block_mask", "dropout_p")


def check_cu_seqlens(cu, total, name):
    """The sequences' boundaries as int64, after checking flash-attn's contract: int32, 1-D, starts at 0,
    non-decreasing, last entry ``total``."""
    cu = np.asarray(cu)
    if cu.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape (batch + 1,), got {cu.shape}")
    if cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()}")
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] must be the total number of rows {total}, got {int(cu[-1])}")
    return cu.astype(np.int64)


def _packed_opts(opts, batch):
    for name in _PACKED_REFUSED:
        value = opts.get(name)
        if value is not None and not (name == "dropout_p" and value == 0):
            raise ValueError(f"{name} is not defined for packed (varlen) batches")
    alibi = opts.get("alibi_slopes")
    if alibi is None:
        return lambda b: dict(opts)
    alibi = np.asarray(alibi)
    if alibi.ndim == 2 and alibi.shape[0] != batch:
        raise ValueError(f"alibi_slopes of shape {alibi.shape} must have batch {batch} rows")
    return lambda b: dict(opts, alibi_slopes=alibi[b] if alibi.ndim == 2 else alibi)


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k):
    cq = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    ck = check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe one batch, got {cq.shape} and {ck.shape}")
    return [(b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(cq.shape[0] - 1)]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **opts):
    """Returns ``(out (total_q, nheads, headdim), lse (nheads, total_q))`` (module docstring)."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    seqs = _sequences(q, k, cu_seqlens_q, cu_seqlens_k)
    per = _packed_opts(opts, len(seqs))
    dtype = np.dtype(opts.get("dtype") or np.float64)
    out = np.zeros(q.shape, dtype)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b, sq, sk in seqs:
        if sq.stop == sq.start:
            continue
        o, l = attention(q[None, sq], k[None, sk], v[None, sk], **per(b))
        out[sq], lse[:, sq] = o[0], l[0]
    return out, lse.astype(np.float32 if dtype.itemsize == 2 else np.float64)


def attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, **opts):
    """Gradients ``(dq, dk, dv)`` of ``sum(out * dout)`` for ``attention_varlen``, packed like q, k, v."""
    q, k, v, dout = (np.asarray(x) for x in (q, k, v, dout))
    seqs = _sequences(q, k, cu_seqlens_q, cu_seqlens_k)
    per = _packed_opts(opts, len(seqs))
    dtype = np.dtype(opts.get("dtype") or np.float64)
    dq, dk, dv = (np.zeros(x.shape, dtype) for x in (q, k, v))
    for b, sq, sk in seqs:
        if sq.stop == sq.start or sk.stop == sk.start:
            continue
        g = attention_backward(dout[None, sq], q[None, sq], k[None, sk], v[None, sk], **per(b))
        dq[sq], dk[sk], dv[sk] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------ KV cache
def _pages(k_cache, block_table, b, length):
    """Rows ``0:length`` of sequence ``b`` of a paged cache, gathered through its block table."""
    page = k_cache.shape[1]
    need = -(-length // page)
    pages = np.asarray(block_table)[b, :need]
    if np.any(pages < 0) or np.any(pages >= k_cache.shape[0]):
        raise ValueError(f"block_table[{b}] holds page indices outside 0..{k_cache.shape[0] - 1}: {pages.tolist()}")
    return k_cache[pages].reshape((-1,) + k_cache.shape[2:])[:length]


def kvcache_append(k_cache, v_cache, k, v, cache_seqlens, block_table=None):
    """Copies of the caches with ``k``, ``v`` ``(batch, seqlen_new, nheads_k, headdim)`` written at rows
    ``cache_seqlens[b]:cache_seqlens[b] + seqlen_new`` of each sequence (through ``block_table`` if paged)."""
    k_cache, v_cache = np.array(k_cache), np.array(v_cache)
    k, v, lens = np.asarray(k), np.asarray(v), np.asarray(cache_seqlens)
    capacity = k_cache.shape[1] * (np.asarray(block_table).shape[1] if block_table is not None else 1)
    for b in range(k.shape[0]):
        start, n = int(lens[b]), k.shape[1]
        if start < 0 or start + n > capacity:
            raise ValueError(f"cache_seqlens[{b}] + seqlen_new = {start + n} exceeds the cache's {capacity} rows")
        for r in range(n):
            row = start + r
            if block_table is None:
                k_cache[b, row], v_cache[b, row] = k[b, r], v[b, r]
            else:
                page, off = np.asarray(block_table)[b, row // k_cache.shape[1]], row % k_cache.shape[1]
                k_cache[page, off], v_cache[page, off] = k[b, r], v[b, r]
    return k_cache, v_cache


def apply_rotary(x, cos, sin, positions, interleaved=True):
    """The rotary embedding (RoFormer; flash-attn's convention): ``x`` ``(batch, seqlen, nheads, headdim)``,
    ``cos``/``sin`` ``(seqlen_ro, rotary_dim / 2)``, ``positions`` ``(batch, seqlen)`` the table row of each
    token.  The first ``rotary_dim`` dims are rotated in pairs by the angle whose cosine and sine the table holds:
    ``(x[2i], x[2i + 1])`` with ``interleaved`` (GPT-J), ``(x[i], x[i + rotary_dim / 2])`` without (GPT-NeoX);
    the other dims are kept.  In float64."""
    x = np.array(x, np.float64)
    half = np.asarray(cos).shape[1]
    c = np.asarray(cos, np.float64)[np.asarray(positions)][:, :, None, :]     # (batch, seqlen, 1, half)
    s = np.asarray(sin, np.float64)[np.asarray(positions)][:, :, None, :]
    if interleaved:
        x0, x1 = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = x0 * c - x1 * s, x0 * s + x1 * c
    else:
        x0, x1 = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half], x[..., half:2 * half] = x0 * c - x1 * s, x0 * s + x1 * c
    return x


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                           cache_batch_idx=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                           cache_leftpad=None, **opts):
    """``(out, lse, k_cache, v_cache)``: ``k``/``v`` appended (``kvcache_append``; the returned caches are
    copies), then the attention of q ``(batch, seqlen_q, nheads, headdim)`` over each sequence's first
    ``cache_seqlens[b] + seqlen_new`` cached rows (all rows without ``cache_seqlens``), bottom-right aligned per
    sequence.  ``lse`` is ``(batch, nheads, seqlen_q)``.  ``cache_batch_idx`` (dense caches): sequence ``b``
    is row ``cache_batch_idx[b]`` of the caches (distinct rows), which may hold more rows than the batch.
    ``rotary_cos``/``rotary_sin`` (with ``k``; ``apply_rotary``): ``k``'s new rows rotated at their positions
    ``cache_seqlens[b] + i`` before the append, ``q``'s too where causal or windowed (a window side below the
    cache's rows), else all of q at position ``cache_seqlens[b]`` (flash-attn's rule); the appended rows are
    rounded to the caches' dtype.  ``cache_leftpad`` (dense caches; flash-attn's): sequence ``b`` starts at row
    ``cache_leftpad[b]`` of its cache, the rows before it are padding no query sees.  Every position stays the
    cache's row index (the append, the rotary angles, the bottom-right alignment at ``cache_seqlens[b] +
    seqlen_new``, ALiBi's distances), so the padding is a mask on the keys ``j < cache_leftpad[b]``."""
    q = np.asarray(q)
    batch = q.shape[0]
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin need the new rows k, v")
        rows = k_cache.shape[1] * (np.asarray(block_table).shape[1] if block_table is not None else 1)
        lens0 = (np.full(batch, rows - np.asarray(k).shape[1]) if cache_seqlens is None
                 else np.broadcast_to(np.asarray(cache_seqlens), (batch,)))
        seqlen_new, seqlen_q = np.asarray(k).shape[1], q.shape[1]
        left, right = (w if w < rows else -1 for w in opts.get("window_size", (-1, -1)))   # sides past the cache
        local = opts.get("causal", False) or left >= 0 or right >= 0                      # bound nothing
        pos_k = lens0[:, None] + np.arange(seqlen_new)[None, :]
        pos_q = lens0[:, None] + (np.arange(seqlen_q)[None, :] if local else np.zeros((1, seqlen_q), int))
        k = apply_rotary(k, rotary_cos, rotary_sin, pos_k, rotary_interleaved).astype(np.asarray(k_cache).dtype)
        q = apply_rotary(q, rotary_cos, rotary_sin, pos_q, rotary_interleaved)
        return attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
                                      cache_leftpad=cache_leftpad, **opts)
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError("cache_batch_idx is for dense caches, not with block_table")
        rows_of = np.asarray(cache_batch_idx).astype(np.int64)
        if len(set(rows_of.tolist())) != batch or np.any(rows_of < 0) or np.any(rows_of >= k_cache.shape[0]):
            raise ValueError(f"cache_batch_idx must pick {batch} distinct rows of 0..{k_cache.shape[0] - 1}")
        out, lse, kc, vc = attention_with_kvcache(q, np.asarray(k_cache)[rows_of], np.asarray(v_cache)[rows_of], k, v,
                                                  cache_seqlens, cache_leftpad=cache_leftpad, **opts)
        k_cache, v_cache = np.array(k_cache), np.array(v_cache)
        k_cache[rows_of], v_cache[rows_of] = kc, vc
        return out, lse, k_cache, v_cache
    rows = k_cache.shape[1] * (np.asarray(block_table).shape[1] if block_table is not None else 1)
    lens = np.full(batch, rows if k is None else rows - np.asarray(k).shape[1]) if cache_seqlens is None \
        else np.asarray(cache_seqlens)
    if k is not None:
        k_cache, v_cache = kvcache_append(k_cache, v_cache, k, v, lens, block_table)
        lens = lens + np.asarray(k).shape[1]
    if cache_leftpad is not None and block_table is not None:
        raise ValueError("cache_leftpad is for dense caches, not with block_table (as flash-attn)")
    pad = np.zeros(batch, np.int64) if cache_leftpad is None else np.asarray(cache_leftpad).astype(np.int64)
    per = _packed_opts(opts, batch)
    dtype = np.dtype(opts.get("dtype") or np.float64)
    out = np.zeros(q.shape, dtype)
    lse = np.full((batch, q.shape[2], q.shape[1]), -np.inf)
    for b in range(batch):
        n = int(lens[b])
        if n > rows:
            raise ValueError(f"cache_seqlens[{b}] = {n} exceeds the cache's {rows} rows")
        if not 0 <= pad[b] <= n:
            raise ValueError(f"cache_leftpad[{b}] = {pad[b]} is outside 0..{n} (the rows sequence {b} holds)")
        kb = k_cache[b, :n] if block_table is None else _pages(k_cache, block_table, b, n)
        vb = v_cache[b, :n] if block_table is None else _pages(v_cache, block_table, b, n)
        # the padding's rows dropped: the bottom-right alignment (at n) and ALiBi's distance i + off - j are
        # unchanged by dropping keys at the front, so this is the cache's positions with j < pad masked
        kb, vb = kb[pad[b]:], vb[pad[b]:]
        o, l = attention(q[b:b + 1], kb[None], vb[None], **per(b))
        out[b], lse[b] = o[0], l[0]
    return out, lse, k_cache, v_cache


# ------------------------------------------------------------------------------------------------ split-KV
def combine_splits(outs, lses):
    """Merge partial attentions over disjoint key ranges: ``outs (splits, ..., headdim)`` and ``lses (splits,
    ...)`` -> ``(out, lse)``.  A row no split saw keeps ``lse = -inf`` and ``out = 0``."""
    outs, lses = np.asarray(outs, np.float64), np.asarray(lses, np.float64)
    top = np.max(lses, axis=0)
    safe = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(lses - safe)                                  # exp(-inf) = 0 for splits that saw nothing
    total = np.sum(weights, axis=0)
    lse = np.where(total > 0, safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    scale = np.where(total > 0, 1.0 / np.where(total > 0, total, 1.0), 0.0)
    return np.sum(weights[..., None] * outs, axis=0) * scale[..., None], lse
