"""flashnb as a Hugging Face transformers attention implementation.

    import flashnb.transformers                      # registers "numba_attention"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="numba_attention")
    model.set_attn_implementation("numba_attention")  # or switch a loaded model

Importing this module registers ``attention_forward`` under the name ``"numba_attention"`` (``NAME``) with
transformers' ``AttentionInterface``, and transformers' SDPA mask builder (``sdpa_mask``: a boolean ``(batch, 1, seqlen_q,
seqlen_k)`` mask, or None where the mask is plain causal, as for SDPA) with its ``AttentionMaskInterface``.
Every model whose attention layers call the interface then runs flashnb's kernels through ``flashnb.torch``
(differentiable; custom ops under ``torch.compile``):

* transformers' layout ``(batch, heads, seqlen, head_dim)`` is read as flash-attn's ``(batch, seqlen, heads,
  head_dim)`` through a transposed view (no copy), and the output comes back as the contiguous ``(batch, seqlen,
  heads, head_dim)`` the attention layers expect;
* grouped-query heads are served as they are (no ``repeat_kv``); ``scaling``, ``dropout`` (training),
  ``softcap`` (Gemma 2) are passed to the kernels; sliding windows arrive inside the mask transformers builds
  (``sliding_window`` itself is then not needed);
* no mask: causal (top-left, as SDPA) or not (``is_causal``), with no mask read; a one-token decoding step
  runs on the split-KV kernels (``plan.split_kv``); a mask (padding, windows, packed sequences): a boolean
  mask, or an additive float one, read by the kernels; a boolean mask that allows nothing past the diagonal
  also gets the causal window (``_within_causal``: the kernels skip those tiles).  A padded batch's decoding step (a few query rows, no
  gradient, a mask that is left padding plus causal, and the layer's sliding window if any, checked whole
  once per step) runs on the split-KV kernels too, as a cache with ``cache_leftpad`` (``_padded_decode``).

What flashnb does not compute -- a value head dim unlike the query's, head dims above 256, a learned
``position_bias`` (T5), a query batch broadcast against the keys' -- falls back to transformers' own SDPA implementation, with a warning naming the
reason once per reason. ``output_attentions=True`` returns no weights (None), as SDPA's implementation.
"""
import math
import warnings
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import _options, plan
from .torch import _attention, _kvcache_decode

NAME = "numba_attention"    # not "flashnb": transformers takes any name holding "flash" for a flash-attn build
__all__ = ["NAME", "attention_forward", "fallback_reason"]


def fallback_reason(query, key, value, attention_mask=None, position_bias=None):
    """Why flashnb cannot serve an attention layer's call (then transformers' SDPA does), or None."""
    if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
        return (f"the batch of the query ({query.shape[0]}) and of the keys ({key.shape[0]}) differ (SDPA broadcasts "
                f"it; flashnb does not)")
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        return (f"value head dim {value.shape[-1]} / key head dim {key.shape[-1]} differ from the query's "
                f"{query.shape[-1]}")
    if query.shape[-1] > _options.MAX_HEAD_DIM:
        return f"head dim {query.shape[-1]} is above flashnb's {_options.MAX_HEAD_DIM}"
    if position_bias is not None:
        return "a position_bias (learned relative bias) is given"
    return None


_warned = set()


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      softcap=None, sliding_window=None, position_bias=None, **kwargs):
    """transformers' attention-function signature: ``query`` ``(batch, heads, seqlen_q, head_dim)``, ``key``,
    ``value`` ``(batch, kv_heads, seqlen_k, head_dim)``, ``attention_mask`` boolean (True = attend) or additive,
    broadcastable to ``(batch, heads, seqlen_q, seqlen_k)``, or None.  Returns ``(out, None)`` with ``out``
    ``(batch, seqlen_q, heads, head_dim)``."""
    # (the mask transformers builds holds the window wherever it bounds anything; a padded decoding step reads
    # its size to recognise the mask)
    reason = fallback_reason(query, key, value, attention_mask, position_bias)
    if reason is not None:
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"flashnb: {reason}; this attention runs on transformers' SDPA implementation",
                          stacklevel=2)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, position_bias=position_bias, softcap=softcap, **kwargs)
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None (flashnb registers transformers' SDPA mask "
                        f"builder), got {type(attention_mask).__name__}")
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and attention_mask is None
    right = -1
    if causal and seqlen_q > 1:          # SDPA's top-left causal mask (transformers' convention without a mask)
        if seqlen_k > seqlen_q:          # keys past seqlen_q are never seen (an empty static cache's prefill)
            k, v = k[:, :seqlen_q], v[:, :seqlen_q]
        right = max(seqlen_q - k.shape[1], 0)    # top-left = a bottom-right window reaching this far right
    mask = bias = None
    if attention_mask is not None:
        mask, bias = (attention_mask, None) if attention_mask.dtype == torch.bool else (None, attention_mask)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)
    if mask is not None and not dropout:
        out = _padded_decode(q, k, v, mask, scale, float(softcap) if softcap else 0.0, sliding_window)
        if out is not None:
            return out, None
    if mask is not None and seqlen_q > 1 and _within_causal(mask, seqlen_q, k.shape[1]):
        right = 0                        # the mask allows nothing past the diagonal: the kernels skip those tiles
    out, _ = _attention(q, k, v, mask, bias, None, None, scale, False, -1, right,
                        float(softcap) if softcap else 0.0, (128, 128), float(dropout), False, "auto")
    return out, None


def _padded_decode(q, k, v, mask, scale, softcap, sliding_window=None):
    """A decoding step of a padded batch on the split-KV kernels, or None (then the mask path serves it).

    transformers gives a padded batch's step a boolean mask ``(batch, 1, seqlen_q, seqlen_k)``; for a few query
    rows per KV head (``plan.SPLIT_KV_MAX_ROWS``), no gradient, and a mask that is left padding plus causal
    (row ``i`` of sequence ``b`` sees keys ``pad[b] <= j <= end[b] - seqlen_q + i``, and with a
    ``sliding_window`` W also ``j > end[b] - seqlen_q + i - W``, transformers' window), the step is
    ``flash_attn_with_kvcache`` over the keys as a cache of ``end[b]`` rows with ``cache_leftpad=pad`` (and the
    window ``(W - 1, 0)``): the decode kernels, not a masked forward.  ``_mask_structure`` checks the mask whole (one host synchronisation
    per mask: the layers of a step share it)."""
    if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)) or mask.dim() != 4 \
            or mask.shape[1] != 1 or mask.shape[0] != q.shape[0] or mask.shape[3] != k.shape[1] \
            or mask.shape[2] != q.shape[1]:
        return None
    dtype = str(q.dtype).removeprefix("torch.")
    if (dtype not in plan.SPLIT_KV_DTYPES or (dtype != "float32" and q.shape[-1] % 2)
            or q.shape[1] * (q.shape[2] // k.shape[2]) > plan.SPLIT_KV_MAX_ROWS):
        return None
    window = int(sliding_window) if isinstance(sliding_window, int) and sliding_window > 0 else None
    structure = _mask_structure(mask, window)
    if structure is None:
        return None
    pad, end = structure
    return _kvcache_decode(q, k, v, end, pad, scale, True, softcap, -1 if window is None else window - 1)


_recent_masks = []   # [(a weak reference to a mask, its version, {analysis: result})], the newest last: each
                     # analysis once per mask, which the layers of a step share (two masks a step where full and
                     # sliding layers alternate); weak, so that a new mask at a freed one's address is new
_RECENT = 4


def _analysis(mask, name, compute):
    """``compute(mask)``, once per mask (and version) for all the layers of a forward pass.  An inference
    tensor (``torch.inference_mode``) has no version counter: computed at every call."""
    if mask.is_inference():
        return compute(mask)
    for ref, version, results in _recent_masks:
        if ref() is mask and version == mask._version:
            break
    else:
        results = {}
        _recent_masks.append((weakref.ref(mask), mask._version, results))
        del _recent_masks[:-_RECENT]
    if name not in results:
        results[name] = compute(mask)
    return results[name]


def _within_causal(mask, seqlen_q, seqlen_k):
    """Whether a boolean ``(batch or 1, 1 or heads, seqlen_q, seqlen_k)`` mask allows no key past the bottom-right
    diagonal (``j > i + seqlen_k - seqlen_q``): transformers' causal masks, padded or not, windowed or not.  Then
    the call may add the causal window: the same attention, with the tiles past the diagonal skipped (the mask
    alone reads them all).  A mask broadcast along its query or key dimension is not looked at (False).  One
    synchronisation per mask."""
    def compute(m):
        if m.dim() != 4 or tuple(m.shape[-2:]) != (seqlen_q, seqlen_k):
            return False
        i = torch.arange(seqlen_q, device=m.device)[:, None]
        past = torch.arange(seqlen_k, device=m.device) > i + (seqlen_k - seqlen_q)
        return not bool((m & past).any().item())
    return _analysis(mask, ("within_causal", seqlen_q, seqlen_k), compute)


def _mask_structure(mask, window=None):
    """``(pad, end)`` int32 ``(batch,)`` tensors on the mask's device where ``mask[b, 0, i, j]`` is exactly
    ``pad[b] <= j <= end[b] - seqlen_q + i`` (and ``j > end[b] - seqlen_q + i - window`` with a window), every
    sequence seeing some key; else None."""
    return _analysis(mask, ("left_padded_causal", window), lambda m: _left_padded_causal(m, window))


def _left_padded_causal(mask, window):
    rows = mask[:, 0]                                                  # (batch, seqlen_q, seqlen_k)
    seqlen_q, seqlen_k = rows.shape[1], rows.shape[2]
    last = rows[:, -1]                                                 # the row that sees the last key
    j = torch.arange(seqlen_k, device=mask.device)
    pad = torch.where(rows.any(1), j, seqlen_k).amin(-1)              # the first key any row sees
    end = torch.where(last, j + 1, 0).amax(-1)
    i = torch.arange(seqlen_q, device=mask.device)[:, None]
    diagonal = end[:, None, None] - seqlen_q + i
    expected = (j >= pad[:, None, None]) & (j <= diagonal)
    if window is not None:
        expected &= j > diagonal - window
    ok = bool(((expected == rows).all() & last.any(-1).all()).item())   # (the one synchronisation)
    return (pad.to(torch.int32), end.to(torch.int32)) if ok else None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
