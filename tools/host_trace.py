"""Where a warm forward+backward's host time goes below Python: torch.profiler (CPU and CUDA activity) over 100
warm calls of ``flashnb.torch.flash_attn_func(...).backward(do)`` and of SDPA's, on (1, 16, 1, 64) float16
tensors (tools/torch_host_time's shape); prints each one's wall us a call and its largest self-CPU ops (the
CUDA runtime and driver calls, aten ops, autograd nodes).  cProfile of the Python side:
tools/profile_dispatch.py.  `python -m tools.host_trace` on a GPU machine."""
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import flashnb.torch as ft

CALLS = 100


def main():
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 16, 1, 64, device="cuda", dtype=torch.float16) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qs, ks, vs = (x.transpose(1, 2) for x in (qg, kg, vg))
    dos = do.transpose(1, 2)
    cases = {"flashnb.torch.flash_attn_func forward+backward": lambda: ft.flash_attn_func(qg, kg, vg).backward(do),
             "SDPA forward+backward": lambda: F.scaled_dot_product_attention(qs, ks, vs).backward(dos),
             "flashnb.torch.flash_attn_func, no grad": lambda: ft.flash_attn_func(q, k, v),
             "SDPA, no grad": lambda: F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))}
    for name, f in cases.items():
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(CALLS):
            f()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / CALLS * 1e6
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                f()
            torch.cuda.synchronize()
        print(f"==== {name}: {wall:.1f} us a call unprofiled; per call below (us, x{CALLS} in the table)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
