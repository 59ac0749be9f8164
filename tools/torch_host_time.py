"""Host time per call through flashnb.torch and the raw functions on a tiny float16 problem (1, 16, 1, 64), warm:
200 calls between two synchronisations, median of 7 repeats (microseconds), against torch SDPA.
`python -m tools.torch_host_time` on a GPU machine."""
import statistics
import time

import torch
import torch.nn.functional as F

import flashnb
import flashnb.torch as ft
from flashnb import _dispatch


def per_call(f, n=200, repeats=7):
    f()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            f()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times), min(times)


def main():
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 16, 1, 64, device="cuda", dtype=torch.float16) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qs, ks, vs = (x.transpose(1, 2) for x in (qg, kg, vg))
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True)

    def fa_fwdbwd():
        ft.flash_attn_func(qg, kg, vg).backward(do)

    def sdpa_fwdbwd():
        F.scaled_dot_product_attention(qs, ks, vs).backward(do.transpose(1, 2))

    rows = [("flashnb.flash_attention (forward)", lambda: flashnb.flash_attention(q, k, v, return_lse=True)),
            ("flashnb.flash_attention_backward", lambda: flashnb.flash_attention_backward(do, q, k, v, out, lse)),
            ("flashnb.torch.flash_attn_func, no grad", lambda: ft.flash_attn_func(q, k, v)),
            ("flashnb.torch.flash_attn_func, forward+backward", fa_fwdbwd),
            ("torch SDPA forward, no grad", lambda: F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))),
            ("torch SDPA forward+backward", sdpa_fwdbwd)]
    for name, f in rows:
        med, best = per_call(f)
        print(f"host-time {name}: median {med:.1f} us (min {best:.1f})", flush=True)
    print("dispatch cache:", _dispatch.stats)


if __name__ == "__main__":
    main()
