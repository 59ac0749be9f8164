"""The oracle: attention in plain NumPy, float64 by default, independent of ``flashnb``.

Every function implements docs/semantics.md; docs/algorithm.md walks from one to
the next.

* ``attention``, ``attention_backward``      standard attention, S and P materialised
  (FlashAttention paper, Algorithms 0 and 3)            -- ``reference.standard``
* ``flash_forward``, ``flash_forward_v1``      tiled forwards, FA2 and FA1 loop orders
* ``flash_backward``, ``flash_backward_v1``    recompute backwards (FA2 delta / FA1 Algorithm 4)
                                                       -- ``reference.flash``
* ``dropout_keep_mask``, ``philox4x32_10``     the dropout generator -- ``reference.dropout``
* ``io_model``                                 HBM traffic: closed forms and counted oracles
* ``attention_varlen``, ``attention_varlen_backward``, ``attention_with_kvcache``, ``kvcache_append``,
  ``combine_splits``, ``apply_rotary``         packed batches, KV caches (rotary embedding), split-KV merge
                                                       -- ``reference.varlen``
* ``flex_attention``, ``block_states``          score_mod / mask_mod attention (FlexAttention's semantics) and
                                               the block mask's empty / partial / full blocks -- ``reference.flex``
* ``fp8_attention``, ``quantize_e4m3``, ``dequantize_e4m3``
                                               FP8 (e4m3) inputs with descaling factors: the format, its quantiser,
                                               attention of the dequantised inputs, quantisation error bounds
                                                       -- ``reference.fp8``
* ``ring_attention``, ``ring_attention_backward``, ``zigzag_positions``, ``contiguous_positions``
                                               a sequence sharded over P ranks, K/V passed round a ring
                                                       -- ``reference.ring``

This package never imports ``flashnb``: it is what the kernels are checked against.
"""
from . import io_model
from ._scores import OPTION_DEFAULTS
from .dropout import PHILOX4x32_10_KNOWN_ANSWERS, dropout_keep, dropout_keep_mask, philox4x32_10
from .flex import block_states, flex_attention
from .fp8 import dequantize_e4m3, fp8_attention, quantize_e4m3
from .flash import attention_delta, flash_backward, flash_backward_v1, flash_forward, flash_forward_v1
from .io_model import IOCount
from .ring import contiguous_positions, ring_attention, ring_attention_backward, zigzag_positions
from .standard import attention, attention_backward, attention_probs
from .varlen import (apply_rotary, attention_varlen, attention_varlen_backward, attention_with_kvcache,
                     combine_splits, kvcache_append)

__all__ = [
    "attention", "attention_backward", "attention_probs", "attention_delta",
    "flash_forward", "flash_forward_v1", "flash_backward", "flash_backward_v1",
    "dropout_keep_mask", "dropout_keep", "philox4x32_10", "PHILOX4x32_10_KNOWN_ANSWERS",
    "io_model", "IOCount", "OPTION_DEFAULTS",
    "attention_varlen", "attention_varlen_backward", "attention_with_kvcache", "kvcache_append", "combine_splits",
    "apply_rotary",
    "ring_attention", "ring_attention_backward", "zigzag_positions", "contiguous_positions",
    "flex_attention", "block_states",
    "fp8_attention", "quantize_e4m3", "dequantize_e4m3",
]
