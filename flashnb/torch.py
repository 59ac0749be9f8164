"""flashnb for PyTorch models: differentiable, ``torch.compile``-able, capturable in CUDA graphs.

    from flashnb.torch import flash_attn_func            # flash-attn's name, arguments and layout
    out = flash_attn_func(q, k, v, causal=True)           # (batch, seqlen, nheads, headdim)

    from flashnb.torch import scaled_dot_product_attention   # SDPA's layout and semantics
    out = scaled_dot_product_attention(q, k, v, is_causal=True)   # (batch, nheads, seqlen, headdim)

    with flashnb.torch.sdpa_patched():                    # a model that calls F.scaled_dot_product_attention
        loss = model(x).sum()                             # runs flashnb where it can serve the call

Layering (flash-attn's): ``flash_attn_func`` / ``scaled_dot_product_attention`` (the public signatures) ->
``_attention`` (the options in one form) -> in eager mode an ``autograd.Function`` calling the forward and
backward directly (~7 us of autograd overhead), under ``torch.compile`` the custom ops ``flashnb::forward`` and
``flashnb::backward`` (``torch.library.custom_op`` with ``register_fake`` and ``register_autograd``, so a
compiled graph holds them with no break) -> ``flashnb.flash_attention`` / ``flash_attention_backward`` on the
tensors, whose dispatch cache (``flashnb._dispatch``) replays a warm specialisation in microseconds.

CPU tensors run through NumPy copies (in Numba's CUDA simulator where there is no GPU): slow, for tests.
"""
import math
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from . import _options, api, flex, kvcache, varlen

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flex_attention", "scaled_dot_product_attention",
           "sdpa_patched", "supports_sdpa_call"]


# ------------------------------------------------------------------------------------------------ flash-attn
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, attn_mask=None,
                    attn_bias=None, block_mask=None, block_mask_size=(128, 128), backend="auto"):
    """flash-attn's ``flash_attn_func``: ``softmax(q k^T * softmax_scale [+ options]) v``, differentiable in
    q, k, v.

    q ``(batch, seqlen_q, nheads, headdim)``, k and v ``(batch, seqlen_k, nheads_k, headdim)`` (grouped-query
    attention: nheads a multiple of nheads_k); float16, bfloat16, float32 or float64 CUDA tensors. causal and
    window_size are aligned to the bottom-right corner, as flash-attn's (docs/semantics.md). dropout_p is
    applied as given (pass 0.0 in evaluation, as with flash-attn); each call draws a fresh seed from torch's
    CPU generator (``torch.manual_seed`` makes it repeatable).

    flashnb's additions, keyword-only: attn_mask (bool, True = may attend), attn_bias (float, added to the
    scores; no gradient: one that requires grad raises ValueError), block_mask / block_mask_size, backend
    ("auto", "simt", "tensorcore"); masks and bias broadcast to ``(batch, nheads, seqlen_q, seqlen_k)``.

    Returns ``out`` like q; with ``return_attn_probs``, ``(out, softmax_lse, None)`` (lse ``(batch, nheads,
    seqlen_q)`` float32; flashnb never materialises the probabilities, so the third value is None).
    """
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs must be a bool, got {type(return_attn_probs).__name__}")
    window_size = _window_pair(window_size)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = _attention(q, k, v, attn_mask, attn_bias, alibi_slopes, block_mask, softmax_scale, causal,
                          window_size[0], window_size[1], softcap, block_mask_size, dropout_p, deterministic,
                          backend)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, backend="auto"):
    """flash-attn's ``flash_attn_varlen_func``: attention of each sequence of a packed batch on its own,
    differentiable in q, k, v.

    q ``(total_q, nheads, headdim)``, k and v ``(total_k, nheads_k, headdim)``; sequence ``b`` is rows
    ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of q (int32 tensors of ``batch + 1`` entries; likewise
    ``cu_seqlens_k``); ``max_seqlen_q``, ``max_seqlen_k``: ints at least every sequence's length.  causal and
    window_size are aligned to each sequence's bottom-right corner; alibi_slopes ``(nheads,)`` or ``(batch,
    nheads)``.  dropout_p must be 0 (packed dropout is not defined: ValueError).  ``cu_seqlens`` are read on
    the host before the launch (``flashnb.varlen``): a synchronisation where they live on the GPU.

    Returns ``out`` like q; with ``return_attn_probs``, ``(out, softmax_lse, None)`` (lse ``(nheads, total_q)``).
    """
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs must be a bool, got {type(return_attn_probs).__name__}")
    window_size = _options.window_pair(window_size)
    if block_table is not None:         # paged keys: gathered, then the packed call, without autograd (as flash-attn)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise ValueError("block_table (a paged KV cache) is served without autograd: call under torch.no_grad() "
                             "or with tensors that do not require grad")
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table,
                             backend)
    if dropout_p != 0:
        raise ValueError(f"dropout_p is not defined for packed (varlen) batches (pass 0.0), got {dropout_p!r}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if alibi_slopes is not None and isinstance(alibi_slopes, Tensor) and alibi_slopes.requires_grad \
            and torch.is_grad_enabled():
        raise ValueError("alibi_slopes requires grad, but flashnb computes no gradient for alibi_slopes; "
                         "pass alibi_slopes.detach()")
    args = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), alibi_slopes, float(softmax_scale),
            bool(causal), int(window_size[0]), int(window_size[1]), float(softcap), bool(deterministic), backend)
    if torch.compiler.is_compiling():
        out, lse = torch.ops.flashnb.varlen_forward(q, k, v, *args)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _FlashAttentionVarlen.apply(q, k, v, args)
    else:
        with torch.no_grad():
            out, lse = _varlen_forward_impl(q, k, v, *args)
    return (out, lse, None) if return_attn_probs else out


# ------------------------------------------------------------------------------------------------ SDPA
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by flashnb, with SDPA's semantics.

    query ``(batch, nheads, seqlen_q, headdim)``, key and value ``(batch, nheads_k, seqlen_k, headdim)``
    (``nheads_k != nheads`` needs ``enable_gqa=True``, as SDPA); ``is_causal``: the causal mask aligned to
    the top-left corner (query i sees keys ``j <= i``), SDPA's convention; ``attn_mask``: boolean (True =
    takes part) or additive float, broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)``, not together
    with ``is_causal``. One difference: a query row that sees no key gives 0 here, NaN in SDPA's math backend.
    Differentiable in query, key, value; an additive mask that requires grad raises ValueError.
    """
    reason = _sdpa_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if reason is not None:
        raise ValueError(reason)
    seqlen_q, seqlen_k = query.shape[-2], key.shape[-2]
    mask = bias = None
    if attn_mask is not None:
        mask, bias = (attn_mask, None) if attn_mask.dtype == torch.bool else (None, attn_mask)
    right = -1
    if is_causal:
        if seqlen_q >= seqlen_k:        # top-left causal = the bottom-right window reaching seqlen_q - seqlen_k on
            right = seqlen_q - seqlen_k
        else:                           # a window cannot reach left of the bottom-right diagonal: a mask does
            mask = _top_left_causal(seqlen_q, seqlen_k, query.device)
    softmax_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    out, _ = _attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask, bias, None, None,
                        softmax_scale, False, -1, right, 0.0, (128, 128), dropout_p, False, "auto")
    return out.transpose(1, 2)


def supports_sdpa_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    """Whether ``scaled_dot_product_attention`` serves these arguments (else ``sdpa_patched`` leaves the call to
    PyTorch, which it also does for CPU tensors): tensors of 4 dimensions, one head dim, heads that group, a
    mask not given together with ``is_causal``."""
    return _sdpa_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) is None


def _sdpa_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        if not isinstance(t, Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return f"{name} must have 4 dimensions (batch, nheads, seqlen, headdim), got shape {tuple(t.shape)}"
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        return "query, key and value must share one head dim (flashnb computes no other case)"
    hq, hk = query.shape[1], key.shape[1]
    if hq != hk and not (enable_gqa and hk > 0 and hq % hk == 0):
        return (f"query has {hq} heads and key {hk}: grouped-query attention needs enable_gqa=True and a "
                "multiple (as SDPA)")
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            return f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}"
        if is_causal:
            return "attn_mask and is_causal=True cannot be given together (as SDPA)"
    return None


_TOP_LEFT = {}


def _top_left_causal(seqlen_q, seqlen_k, device):
    """SDPA's causal mask for seqlen_q < seqlen_k (query i sees keys j <= i), cached per shape and device."""
    key = (seqlen_q, seqlen_k, device)
    mask = _TOP_LEFT.get(key)
    if mask is None:
        mask = _TOP_LEFT[key] = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device).tril()
    return mask


@contextmanager
def sdpa_patched():
    """Within the block, ``torch.nn.functional.scaled_dot_product_attention`` runs flashnb's wherever it can
    serve the call (CUDA tensors, one head dim, ...: ``supports_sdpa_call``), else PyTorch's own.

    It patches the attribute of ``torch.nn.functional``: code that looks the function up when it runs (as
    ``F.scaled_dot_product_attention(...)`` does) is routed; a name imported before the block
    (``from torch.nn.functional import scaled_dot_product_attention``) is not.
    """
    original = torch.nn.functional.scaled_dot_product_attention

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if (isinstance(query, Tensor) and query.is_cuda
                and supports_sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)):
            return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                enable_gqa)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    torch.nn.functional.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, score_mod_grad=None):
    """``flashnb.flex_attention`` (docs/flex.md) on PyTorch tensors, differentiable in query, key and value;
    under ``torch.compile`` the custom ops ``flashnb::flex_forward`` / ``flex_backward``, which name the functions
    by a handle.  ``score_mod_grad``: the score_mod's derivative in the score for the backward (else the complex
    step: a score_mod that cannot take it is refused here, before the forward, when a gradient will be asked
    for; under ``torch.compile``, in the backward).  CPU tensors run through NumPy (the simulator)."""
    if torch.compiler.is_compiling():
        if _learned_captures(score_mod) and torch.is_grad_enabled():
            raise ValueError("flex_attention: the score_mod captures a tensor that requires grad; gradients into "
                             "captured tensors run eagerly, not under torch.compile (call flashnb.torch.flex_attention "
                             "outside the compiled region, or capture the tensor's .detach())")
        handle = _flex_handle(score_mod, "" if block_mask is None else block_mask.handle, score_mod_grad)
        out, lse = torch.ops.flashnb.flex_forward(query, key, value, handle, None if scale is None else float(scale),
                                                  bool(enable_gqa))
        return (out, lse) if return_lse else out
    learned = _learned_captures(score_mod) if torch.is_grad_enabled() else ()
    if not learned and not query.is_cuda and score_mod is not None:      # (the simulator reads NumPy copies)
        score_mod = _bound_on_cpu(score_mod)
    args = (score_mod, block_mask, scale, enable_gqa, score_mod_grad)
    if learned:
        names, tables = zip(*learned)
        on_host = score_mod if query.is_cuda else _bound_on_cpu(score_mod)
        if score_mod_grad is None:
            flex._check_complex_step(on_host)
        flex._captured_grad_names(names, on_host, False)
        dims = (int(query.shape[0]), int(query.shape[1]), int(query.shape[2]), int(key.shape[2]))
        dims = dims if min(dims) > 0 else None
        flex._checked(on_host, ("captured steps", names, dims),                          # (before the forward; once
                      lambda: flex.check_captured_grads(on_host, names, dims),           # per function, captures
                      flex._fingerprint(on_host))                                        # and shape)
        out, lse = _FlexLearned.apply(query, key, value, args, names, *tables)
        return (out, lse) if return_lse else out
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        if score_mod is not None and score_mod_grad is None:
            flex._check_complex_step(score_mod)
        out, lse = _FlexAttention.apply(query, key, value, args)
    else:
        with torch.no_grad():
            out, lse = _flex_forward_impl(query, key, value, *args)
    return (out, lse) if return_lse else out


def _learned_captures(score_mod):
    """``(name, tensor)`` of each tensor that requires grad among what ``score_mod`` captures (a learned bias table,
    per-head slopes): their gradients come from the dK/dV kernels (``flex_attention_backward``'s
    ``captured_grads``)."""
    if score_mod is None:
        return ()
    return tuple((name, t) for name, t in flex._captured(score_mod) if isinstance(t, Tensor) and t.requires_grad)


class _FlexLearned(torch.autograd.Function):
    """``flex_attention`` differentiable in query, key, value and the tensors the score_mod captures that require
    grad (eager only).  CPU tensors run through NumPy (the simulator), the captured ones bound as NumPy copies."""

    @staticmethod
    def forward(ctx, q, k, v, args, names, *tables):
        score_mod = _bound_on_cpu(args[0]) if not q.is_cuda else args[0]
        out, lse = _flex_forward_impl(q, k, v, score_mod, *args[1:])
        ctx.save_for_backward(q, k, v, out, lse, *tables)     # (an in-place change before the backward: refused)
        ctx.args, ctx.names = args, names
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        nones = (None,) * (5 + len(ctx.names))
        if dout is None:
            return nones
        q, k, v, out, lse, *tables = ctx.saved_tensors
        score_mod, block_mask, scale, enable_gqa, score_mod_grad = ctx.args
        if q.is_cuda:
            *grads, learned = flex.flex_attention_backward(dout, q, k, v, out, lse, score_mod, block_mask, scale,
                                                           enable_gqa, score_mod_grad, captured_grads=ctx.names)
        else:
            score_mod = _bound_on_cpu(score_mod)
            *grads, learned = flex.flex_attention_backward(*_numpy(dout, q, k, v, out), lse.detach().numpy(),
                                                           score_mod, block_mask, scale, enable_gqa, score_mod_grad,
                                                           captured_grads=ctx.names)
            grads = [_from_numpy(g, q.dtype) for g in grads]
            learned = {n: torch.from_numpy(np.ascontiguousarray(g)) for n, g in learned.items()}
        table_grads = tuple(learned[n].to(t.dtype) for n, t in zip(ctx.names, tables))
        return (*grads, None, None, *table_grads)


def _bound_on_cpu(score_mod):
    """``score_mod`` with each captured CPU tensor bound as a NumPy copy (the simulator's kernels read NumPy
    arrays; a new function each call, compiled again as the simulator does); CUDA tensors stay."""
    for name, t in flex._captured(score_mod):
        if isinstance(t, Tensor) and not t.is_cuda:
            score_mod = flex._rebound(score_mod, name, t.detach().numpy())
    return score_mod


_FLEX, _FLEX_HANDLES = [], {}     # a custom op's handle -> (score_mod, block mask handle, score_mod_grad), and back


@torch._dynamo.assume_constant_result
def _flex_handle(score_mod, mask_handle, score_mod_grad):
    """The handle of a flex call's functions (traced as a constant: functions are constants to Dynamo, a
    ``BlockMask`` is not, so the mask comes by its own handle)."""
    key = (score_mod, mask_handle, score_mod_grad)
    if key not in _FLEX_HANDLES:
        _FLEX_HANDLES[key] = len(_FLEX)
        _FLEX.append(key)
    return _FLEX_HANDLES[key]


def _flex_call(handle):
    score_mod, mask_handle, score_mod_grad = _FLEX[handle]
    if mask_handle and mask_handle not in flex.MASKS:
        raise ValueError(f"flex_attention: the BlockMask of handle {mask_handle} no longer exists; a compiled graph "
                         "runs with the masks it is called with, so keep the mask alive while calling it")
    return score_mod, flex.MASKS[mask_handle] if mask_handle else None, score_mod_grad


def _flex_forward_impl(q, k, v, score_mod, block_mask, scale, enable_gqa, score_mod_grad):
    if q.is_cuda:
        return flex.flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa, return_lse=True)
    out, lse = flex.flex_attention(*_numpy(q, k, v), score_mod, block_mask, scale, enable_gqa, return_lse=True)
    return _from_numpy(out, q.dtype), torch.from_numpy(lse)


def _flex_backward_impl(dout, q, k, v, out, lse, score_mod, block_mask, scale, enable_gqa, score_mod_grad):
    if q.is_cuda:
        return flex.flex_attention_backward(dout, q, k, v, out, lse, score_mod, block_mask, scale, enable_gqa,
                                            score_mod_grad)
    grads = flex.flex_attention_backward(*_numpy(dout, q, k, v, out), lse.detach().numpy(), score_mod, block_mask,
                                         scale, enable_gqa, score_mod_grad)
    return tuple(_from_numpy(g, q.dtype) for g in grads)


# ------------------------------------------------------------------------------------------------ dispatch
def _attention(q, k, v, attn_mask, attn_bias, alibi_slopes, block_mask, scale, causal, left, right, softcap,
               block_mask_size, dropout_p, deterministic, backend):
    """(out, lse): through the custom ops under ``torch.compile``, else through ``_FlashAttention``."""
    if attn_bias is not None or alibi_slopes is not None:
        for t, name in ((attn_bias, "attn_bias"), (alibi_slopes, "alibi_slopes")):
            if t is not None and isinstance(t, Tensor) and t.requires_grad and torch.is_grad_enabled():
                raise ValueError(f"{name} requires grad, but flashnb computes no gradient for {name}; "
                                 f"pass {name}.detach() (or compute attention with the bias elsewhere)")
    seed = None
    if dropout_p > 0:      # a fresh seed per call, from torch's CPU generator (a tensor: traced, not baked in)
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    bm_q, bm_k = block_mask_size
    args = (attn_mask, attn_bias, alibi_slopes, block_mask, scale, causal, left, right, softcap, bm_q, bm_k,
            dropout_p, seed, deterministic, backend)
    if torch.compiler.is_compiling():      # the op's schema takes floats as floats
        return torch.ops.flashnb.forward(q, k, v, attn_mask, attn_bias, alibi_slopes, block_mask, float(scale),
                                         causal, left, right, float(softcap), bm_q, bm_k, float(dropout_p), seed,
                                         deterministic, backend)
    if not torch.is_grad_enabled():
        return _forward_impl(q, k, v, *args)
    if q.requires_grad or k.requires_grad or v.requires_grad:
        if torch._C._are_functorch_transforms_active():
            return _FlashAttention.apply(q, k, v, args)
        unwrap = torch._C._functorch.unwrap_if_dead
        return _flash_apply(unwrap(q), unwrap(k), unwrap(v), args)   # the options as one argument: less to inspect
    torch._C._set_grad_enabled(False)    # torch.no_grad() without its context manager (~1 us)
    try:
        return _forward_impl(q, k, v, *args)
    finally:
        torch._C._set_grad_enabled(True)


def _window_pair(window_size):
    """``_options.window_pair(window_size)``, a tuple of two ints >= -1 (the common case) checked inline (~0.5 us
    less)."""
    if type(window_size) is tuple and len(window_size) == 2:
        left, right = window_size
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return window_size
    return _options.window_pair(window_size)


def attention_function(name, forward_impl, backward_impl, doc):
    """An ``autograd.Function`` ``name`` over ``forward_impl(q, k, v, *args) -> (out, lse)`` and
    ``backward_impl(dout, q, k, v, out, lse, *args) -> (dq, dk, dv)``, applied as ``.apply(q, k, v, args)`` (the
    options as one argument: less for apply to inspect). lse is not differentiable and its gradient stays None
    (no zeros made for it); a backward whose ``dout`` is None (out took no part) returns None for all."""

    def forward(ctx, q, k, v, args):
        out, lse = forward_impl(q, k, v, *args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    def backward(ctx, dout, dlse):
        if dout is None:
            return None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        return (*backward_impl(dout, q, k, v, out, lse, *ctx.args), None)

    return type(name, (torch.autograd.Function,), {"__doc__": doc, "forward": staticmethod(forward),
                                                   "backward": staticmethod(backward)})


def _call_options(attn_mask, attn_bias, alibi_slopes, block_mask, scale, causal, left, right, softcap, bm_q, bm_k,
                  dropout_p, seed):
    return dict(softmax_scale=scale, causal=causal, window_size=(left, right), attn_mask=attn_mask,
                attn_bias=attn_bias, alibi_slopes=alibi_slopes, softcap=softcap, block_mask=block_mask,
                block_mask_size=(bm_q, bm_k), dropout_p=dropout_p, seed=0 if seed is None else int(seed[0]))


def _forward_impl(q, k, v, attn_mask, attn_bias, alibi_slopes, block_mask, scale, causal, left, right, softcap,
                  bm_q, bm_k, dropout_p, seed, deterministic, backend):
    if q.is_cuda:           # (autograd is off here: in an autograd.Function's forward, in a custom op)
        return api.cached_forward(q, k, v, scale, causal, (left, right), attn_mask, attn_bias, alibi_slopes, softcap,
                                  block_mask, (bm_q, bm_k), dropout_p, 0 if seed is None else int(seed[0]), True,
                                  None, None, None, backend, _precision(q))
    opts = _call_options(attn_mask, attn_bias, alibi_slopes, block_mask, scale, causal, left, right, softcap,
                         bm_q, bm_k, dropout_p, seed)
    out, lse = api.flash_attention(*_numpy(q, k, v), return_lse=True, backend=backend, **_numpy_options(opts))
    return _from_numpy(out, q.dtype), torch.from_numpy(lse)


def _backward_impl(dout, q, k, v, out, lse, attn_mask, attn_bias, alibi_slopes, block_mask, scale, causal, left,
                   right, softcap, bm_q, bm_k, dropout_p, seed, deterministic, backend):
    if dout.stride(-1) != 1:            # as flash-attn: the tensor cores read rows of dout
        dout = dout.contiguous()
    if q.is_cuda:
        return api.cached_backward(dout, q, k, v, out, lse, scale, causal, (left, right), attn_mask, attn_bias,
                                   alibi_slopes, softcap, block_mask, (bm_q, bm_k), dropout_p,
                                   0 if seed is None else int(seed[0]), None, None, deterministic, None, backend,
                                   _precision(q))
    opts = _call_options(attn_mask, attn_bias, alibi_slopes, block_mask, scale, causal, left, right, softcap,
                         bm_q, bm_k, dropout_p, seed)
    grads = api.flash_attention_backward(*_numpy(dout, q, k, v, out), lse.detach().numpy(), backend=backend,
                                         deterministic=deterministic, **_numpy_options(opts))
    return tuple(_from_numpy(g, q.dtype) for g in grads)


def _varlen_options(alibi_slopes, scale, causal, left, right, softcap):
    return dict(softmax_scale=scale, causal=causal, window_size=(left, right), alibi_slopes=alibi_slopes,
                softcap=softcap)


def _varlen_forward_impl(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, scale, causal, left, right, softcap,
                         deterministic, backend):
    opts = _varlen_options(alibi_slopes, scale, causal, left, right, softcap)
    if q.is_cuda:
        return varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, backend=backend,
                                             **opts)
    out, lse = varlen.flash_attn_varlen_func(*_numpy(q, k, v, cu_q, cu_k), max_q, max_k, return_lse=True,
                                             backend=backend, **_numpy_options(opts))
    return _from_numpy(out, q.dtype), torch.from_numpy(lse)


def _varlen_backward_impl(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi_slopes, scale, causal, left,
                          right, softcap, deterministic, backend):
    opts = _varlen_options(alibi_slopes, scale, causal, left, right, softcap)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if q.is_cuda:
        return varlen.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, backend=backend,
                                                 deterministic=deterministic, **opts)
    grads = varlen.flash_attn_varlen_backward(*_numpy(dout, q, k, v, out), lse.detach().numpy(),
                                              *_numpy(cu_q, cu_k), max_q, max_k, backend=backend,
                                              deterministic=deterministic, **_numpy_options(opts))
    return tuple(_from_numpy(g, q.dtype) for g in grads)


def _varlen_paged(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window_size, softcap, alibi_slopes,
                  return_attn_probs, block_table, backend):
    """``flash_attn_varlen_func`` with ``block_table`` (``flashnb.varlen``: the pages gathered, then the packed
    call); CPU tensors through NumPy (the simulator)."""
    opts = dict(dropout_p=dropout_p, softmax_scale=scale, causal=causal, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs, block_table=block_table,
                backend=backend)
    if q.is_cuda:
        return varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **opts)
    opts = _numpy_options(opts)
    result = varlen.flash_attn_varlen_func(*_numpy(q, k, v, cu_q, cu_k), max_q, max_k, **opts)
    if return_attn_probs:
        return _from_numpy(result[0], q.dtype), torch.from_numpy(result[1]), None
    return _from_numpy(result, q.dtype)


def _kvcache_decode(q, k, v, cache_seqlens, cache_leftpad, scale, causal, softcap, left=-1):
    """``q`` over ``k``, ``v`` as a KV cache of ``cache_seqlens[b]`` rows starting at ``cache_leftpad[b]``, no
    append, no autograd (a decoding step: ``flashnb.transformers``' padded batches), ``left`` the window's left
    side; CPU tensors through NumPy (the simulator)."""
    opts = dict(softmax_scale=scale, causal=causal, softcap=softcap, window_size=(left, 0 if causal else -1))
    if q.is_cuda:
        return kvcache.flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                                               **opts)
    out = kvcache.flash_attn_with_kvcache(*_numpy(q, k, v), cache_seqlens=cache_seqlens.numpy(),
                                         cache_leftpad=cache_leftpad.numpy(), **opts)
    return _from_numpy(out, q.dtype)


def _precision(q):
    """float32's tensor-core precision from ``torch.get_float32_matmul_precision()``, read at each call:
    "highest" (PyTorch's default) -> "highest" (3xTF32, float32's accuracy), "high" or "medium" -> "high" (one
    tf32 product, what PyTorch's own float32 matmuls then do); other dtypes ignore it."""
    if q.dtype != torch.float32:
        return "highest"
    return "highest" if torch.get_float32_matmul_precision() == "highest" else "high"


# CPU tensors (tests without a GPU): NumPy copies; bfloat16 as float32
def _numpy(*tensors):
    return tuple(t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy() for t in tensors)


def _numpy_options(opts):
    return {name: (_numpy(x)[0] if isinstance(x, Tensor) else x) for name, x in opts.items()}


def _from_numpy(a, dtype):
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


_FlashAttention = attention_function(
    "_FlashAttention", _forward_impl, _backward_impl,
    "The eager path: autograd's bookkeeping (~7 us a call) without the custom op's dispatch (~15 us more).")
# ``_FlashAttention.apply`` less its Python wrapper (~1.5 us a call), which with no functorch transform active
# unwraps the dead functorch wrappers among the tensor arguments (``_attention`` does) and calls this (binding default
# arguments first only for a Function with a ``setup_context``, which these have not)
_flash_apply = super(torch.autograd.Function, _FlashAttention).apply
_FlexAttention = attention_function(
    "_FlexAttention", _flex_forward_impl, _flex_backward_impl, "``flex_attention``'s eager path.")
_FlashAttentionVarlen = attention_function(
    "_FlashAttentionVarlen", _varlen_forward_impl, _varlen_backward_impl,
    "``flash_attn_varlen_func``'s eager path, as ``_FlashAttention``'s.")


# ------------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("flashnb::forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], attn_bias: Optional[Tensor],
                alibi_slopes: Optional[Tensor], block_mask: Optional[Tensor], scale: float, causal: bool, left: int,
                right: int, softcap: float, bm_q: int, bm_k: int, dropout_p: float, seed: Optional[Tensor],
                deterministic: bool, backend: str) -> tuple[Tensor, Tensor]:
    return _forward_impl(q, k, v, attn_mask, attn_bias, alibi_slopes, block_mask, scale, causal, left, right,
                         softcap, bm_q, bm_k, dropout_p, seed, deterministic, backend)


@_forward_op.register_fake
def _(q, k, v, attn_mask, attn_bias, alibi_slopes, block_mask, scale, causal, left, right, softcap, bm_q, bm_k,
      dropout_p, seed, deterministic, backend):
    batch, seqlen_q, nheads, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=lse_dtype)


@torch.library.custom_op("flashnb::backward", mutates_args=())
def _backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 attn_mask: Optional[Tensor], attn_bias: Optional[Tensor], alibi_slopes: Optional[Tensor],
                 block_mask: Optional[Tensor], scale: float, causal: bool, left: int, right: int, softcap: float,
                 bm_q: int, bm_k: int, dropout_p: float, seed: Optional[Tensor], deterministic: bool,
                 backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(dout, q, k, v, out, lse, attn_mask, attn_bias, alibi_slopes, block_mask, scale, causal,
                          left, right, softcap, bm_q, bm_k, dropout_p, seed, deterministic, backend)


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = inputs[3:]
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _op_backward(backward_op):
    """The autograd formula of a forward custom op whose gradients ``backward_op(dout, q, k, v, out, lse, *args)``
    computes (``_setup_context`` saved them)."""
    def backward(ctx, dout, dlse):
        if dout is None:
            return (None,) * (3 + len(ctx.args))
        q, k, v, out, lse = ctx.saved_tensors
        return (*backward_op(dout, q, k, v, out, lse, *ctx.args), *(None,) * len(ctx.args))
    return backward


_forward_op.register_autograd(_op_backward(torch.ops.flashnb.backward), setup_context=_setup_context)


# flex_attention under torch.compile: the functions by a handle (``_flex_handle``), outputs contiguous (as the fake)
@torch.library.custom_op("flashnb::flex_forward", mutates_args=())
def _flex_forward_op(q: Tensor, k: Tensor, v: Tensor, handle: int, scale: Optional[float],
                     enable_gqa: bool) -> tuple[Tensor, Tensor]:
    score_mod, block_mask, grad = _flex_call(handle)
    out, lse = _flex_forward_impl(q, k, v, score_mod, block_mask, scale, enable_gqa, grad)
    return out.contiguous(), lse


@_flex_forward_op.register_fake
def _(q, k, v, handle, scale, enable_gqa):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype)


@torch.library.custom_op("flashnb::flex_backward", mutates_args=())
def _flex_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, handle: int,
                      scale: Optional[float], enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor]:
    score_mod, block_mask, grad = _flex_call(handle)
    grads = _flex_backward_impl(dout, q, k, v, out, lse, score_mod, block_mask, scale, enable_gqa, grad)
    return tuple(g.contiguous() for g in grads)


@_flex_backward_op.register_fake
def _(dout, q, k, v, out, lse, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_flex_forward_op.register_autograd(_op_backward(torch.ops.flashnb.flex_backward), setup_context=_setup_context)


# flash_attn_varlen_func under torch.compile: the output shapes are q's and (nheads, total_q), whatever the
# sequences' lengths, so the fake implementations need no data
@torch.library.custom_op("flashnb::varlen_forward", mutates_args=())
def _varlen_forward_op(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                       alibi_slopes: Optional[Tensor], scale: float, causal: bool, left: int, right: int,
                       softcap: float, deterministic: bool, backend: str) -> tuple[Tensor, Tensor]:
    return _varlen_forward_impl(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, scale, causal, left, right, softcap,
                                deterministic, backend)


@_varlen_forward_op.register_fake
def _(q, k, v, *args):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)


@torch.library.custom_op("flashnb::varlen_backward", mutates_args=())
def _varlen_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                        cu_k: Tensor, max_q: int, max_k: int, alibi_slopes: Optional[Tensor], scale: float,
                        causal: bool, left: int, right: int, softcap: float, deterministic: bool,
                        backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _varlen_backward_impl(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi_slopes, scale, causal,
                                 left, right, softcap, deterministic, backend)


@_varlen_backward_op.register_fake
def _(dout, q, k, v, out, lse, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_varlen_forward_op.register_autograd(_op_backward(torch.ops.flashnb.varlen_backward), setup_context=_setup_context)
