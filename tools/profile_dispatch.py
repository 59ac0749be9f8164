"""Where a warm call's host time goes: cProfile of 300 calls of flashnb's forward, backward and
flashnb.torch's forward+backward on (1, 16, 1, 64) float16 tensors; the 18 largest own times of each.
`python -m tools.profile_dispatch` on a GPU machine."""
import cProfile
import pstats

import torch

import flashnb
import flashnb.torch as ft

torch.manual_seed(0)
q, k, v, do = (torch.randn(1, 16, 1, 64, device="cuda", dtype=torch.float16) for _ in range(4))
qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
out, lse = flashnb.flash_attention(q, k, v, return_lse=True)
cases = {"forward": lambda: flashnb.flash_attention(q, k, v, return_lse=True),
         "backward": lambda: flashnb.flash_attention_backward(do, q, k, v, out, lse),
         "flash_attn_func forward+backward": lambda: ft.flash_attn_func(qg, kg, vg).backward(do)}
for name, f in cases.items():
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        f()
    torch.cuda.synchronize()
    prof.disable()
    print(f"==== {name}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
