"""flashnb: FlashAttention (Dao et al. 2022; FlashAttention-2, Dao 2023) as Numba CUDA kernels.

    out = flashnb.flash_attention(q, k, v, causal=True)
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True)
    dq, dk, dv = flashnb.flash_attention_backward(dout, q, k, v, out, lse)

Shapes are flash-attn's: q ``(batch, seqlen_q, nheads, headdim)``, k and v
``(batch, seqlen_k, nheads_k, headdim)``.  The semantics of every option are in
docs/semantics.md; the pure-NumPy oracle in ``reference/`` implements the same
independently and the test suite holds the kernels to it.
"""
from .api import BACKENDS, flash_attention, flash_attention_backward
from .fp8 import (flash_attention_fp8, flash_attention_fp8_varlen, flash_attn_with_kvcache_fp8, hadamard_rotation,
                  quantize_fp8)
from .flex import BlockMask, create_block_mask, flex_attention, flex_attention_backward
from .kvcache import flash_attn_with_kvcache
from .varlen import flash_attn_varlen_backward, flash_attn_varlen_func

__version__ = "0.1.0"
__all__ = ["BACKENDS", "flash_attention", "flash_attention_backward", "flash_attn_varlen_func",
           "flash_attn_varlen_backward", "flash_attn_with_kvcache", "flex_attention", "flex_attention_backward",
           "create_block_mask", "BlockMask", "flash_attention_fp8", "flash_attention_fp8_varlen",
           "flash_attn_with_kvcache_fp8", "quantize_fp8",
           "hadamard_rotation", "__version__"]
