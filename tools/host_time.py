"""Host time per call of flashnb's forward and backward on a tiny float16 problem (1, 16, 1, 64): torch CUDA
tensors, warm specialisation, 200 calls between two synchronisations, median of 7 repeats (microseconds).
Run from a folder whose flashnb is the one to time: `python3 - LABEL < tools/host_time.py` (from the
repo root), `(cd .before && python3 - LABEL < ../tools/host_time.py)` for a copy in .before/."""
import statistics
import sys
import time

import torch

import flashnb

label = sys.argv[1] if len(sys.argv) > 1 else "?"
torch.manual_seed(0)
q, k, v, do = (torch.randn(1, 16, 1, 64, device="cuda", dtype=torch.float16) for _ in range(4))
out, lse = flashnb.flash_attention(q, k, v, return_lse=True)
flashnb.flash_attention_backward(do, q, k, v, out, lse)
torch.cuda.synchronize()
for name, f in (("forward", lambda: flashnb.flash_attention(q, k, v, return_lse=True)),
                ("backward", lambda: flashnb.flash_attention_backward(do, q, k, v, out, lse))):
    times = []
    for _ in range(7):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            f()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / 200 * 1e6)
    print(f"host-time {label} {name} median {statistics.median(times):.1f} us (min {min(times):.1f})", flush=True)
