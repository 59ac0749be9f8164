"""Host time per call of ``flashnb.flash_attn_varlen_func`` and ``flash_attn_varlen_backward`` on a small packed
bfloat16 batch (4 sequences, 512 query and 512 key rows in all, 8 heads of 64, causal; ``cu_seqlens`` CUDA int32
tensors): warm, 200 calls between two synchronisations, median of 7 repeats (microseconds); the dispatch cache's
replay against the full path (every lookup told "unfit": what every packed call paid before the packed calls
went through the cache).  Both check ``cu_seqlens`` on the host every call (a copy of each to the host).

    python -m tools.varlen_host_time
"""
import torch

import flashnb
from tools.flex_host_time import replayed_and_full


def main():
    torch.manual_seed(0)
    q, do = (torch.randn(512, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(512, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 100, 228, 400, 512], dtype=torch.int32, device="cuda")
    opts = dict(causal=True)
    out, lse = flashnb.flash_attn_varlen_func(q, k, v, cu, cu, 172, 172, return_lse=True, **opts)
    calls = (("forward", lambda: flashnb.flash_attn_varlen_func(q, k, v, cu, cu, 172, 172, return_lse=True, **opts)),
             ("backward", lambda: flashnb.flash_attn_varlen_backward(do, q, k, v, out, lse, cu, cu, 172, 172, **opts)))
    replayed_and_full("varlen", calls)


if __name__ == "__main__":
    main()
