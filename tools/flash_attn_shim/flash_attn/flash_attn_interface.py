"""flash-attn's ``flash_attn_interface`` on flashnb: the public functions with flash-attn's signatures.

* ``flash_attn_func``, ``flash_attn_varlen_func``: ``flashnb.torch``'s (flash-attn's parameter order and return
  convention), differentiable in q, k, v.
* the packed variants: the packed tensor split into views along its "3" / "2" axis (``unbind``), then the
  unpacked call, so autograd's gradient lands in the packed tensor.
* ``flash_attn_with_kvcache``: ``flashnb.flash_attn_with_kvcache`` as it is (flash-attn's parameters and order).

Adaptations (each a place where flash-attn's and flashnb's contracts differ):

* ``return_attn_probs=True`` with ``dropout_p > 0``: flash-attn returns the dropout-masked probabilities
  ``S_dmask`` as its third value; flashnb never materialises them, so this raises ``NotImplementedError``.
  (With ``dropout_p == 0`` flash-attn's third value is ``None``, as flashnb's.)
* ``flash_attn_varlen_func(..., block_table=...)`` (paged KV): flash-attn computes no gradient for it and
  flashnb refuses inputs that require grad; the call runs under ``torch.no_grad()`` (``out`` has no grad_fn).
* ``_get_block_size_n``: flash-attn's kernel tile width, which its tests use only to read ``S_dmask``; a
  plausible value (those tests are deselected).
* flash-attn's internals (``_flash_attn_forward``, ``_flash_attn_varlen_forward``, ..., the C++ extension
  ``flash_attn_gpu``) have no counterpart: importing them raises ``ImportError`` saying so.
"""
import torch

import flashnb
import flashnb.torch as _ft

USE_TRITON_ROCM = False     # flash-attn's switch to its Triton AMD backend; its tests skip a test on it

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
           "USE_TRITON_ROCM"]

# flash-attn's private functions and its C++ extension: nothing in flashnb answers to them
_INTERNALS = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
              "_flash_attn_varlen_backward", "flash_attn_gpu", "flash_attn_cuda")


def __getattr__(name):
    if name in _INTERNALS:
        raise ImportError(f"flash_attn.flash_attn_interface.{name} is flash-attn's internal (its C++ extension's "
                          "entry points); the flashnb shim serves only the public functions")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _no_dropout_mask(dropout_p, return_attn_probs):
    if return_attn_probs and dropout_p > 0:
        raise NotImplementedError(
            "return_attn_probs=True with dropout_p > 0 asks for flash-attn's S_dmask (the dropout-masked "
            "probabilities); flashnb never materialises them. Call with return_attn_probs=False, or dropout_p=0 "
            "(then the third value is None, as flash-attn's)")


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-tile width flash-attn's kernels store ``S_dmask`` in, which its tests need to read it; flashnb has
    no ``S_dmask``, so the tests that call this are deselected and the value is only plausible."""
    return 128 if head_dim <= 64 else 64


# ------------------------------------------------------------------------------------------------ dense
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q ``(batch, seqlen_q, nheads, d)``, k, v ``(batch, seqlen_k, nheads_k, d)``; ``out`` or
    ``(out, softmax_lse, None)``."""
    _no_dropout_mask(dropout_p, return_attn_probs)
    return _ft.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv ``(batch, seqlen, 3, nheads, d)``."""
    q, k, v = qkv.unbind(dim=-3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q ``(batch, seqlen_q, nheads, d)``, kv ``(batch, seqlen_k, 2, nheads_k, d)``."""
    k, v = kv.unbind(dim=-3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


# ------------------------------------------------------------------------------------------------ packed batches
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q ``(total_q, nheads, d)``, k, v ``(total_k, nheads_k, d)`` (or pages ``(num_pages, page_size, nheads_k,
    d)`` with ``block_table``); ``out`` or ``(out, softmax_lse, None)``."""
    _no_dropout_mask(dropout_p, return_attn_probs)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table)
    if block_table is not None:         # flash-attn: no gradient through a paged cache; flashnb: refused with grad
        with torch.no_grad():
            return _ft.flash_attn_varlen_func(*args)
    return _ft.flash_attn_varlen_func(*args)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv ``(total, 3, nheads, d)``; one ``cu_seqlens`` for queries and keys."""
    q, k, v = qkv.unbind(dim=-3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q ``(total_q, nheads, d)``, kv ``(total_k, 2, nheads_k, d)``."""
    k, v = kv.unbind(dim=-3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


# ------------------------------------------------------------------------------------------------ KV cache
flash_attn_with_kvcache = flashnb.flash_attn_with_kvcache   # flash-attn's parameters, in flash-attn's order
