"""A tiny flashnb.torch forward+backward, twice (the second replays the dispatch cache's recording), float16
(tensor cores) and float32 (SIMT): the process compute-sanitizer runs in
(`compute-sanitizer --tool memcheck python3 -m tools.sanitize_torch`)."""
import torch

import flashnb.torch as ft
from flashnb import _dispatch

for dtype in (torch.float16, torch.float32):
    for _ in range(2):
        q, k, v = (torch.randn(1, 70, 2, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        out = ft.flash_attn_func(q, k, v, causal=True)
        out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("sanitize_torch done:", _dispatch.stats, flush=True)
