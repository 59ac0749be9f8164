"""Where examples/train_gpt.py's step time goes, per attention: torch.profiler over 5 steps after 3 warm-up
steps of the default model (6 layers, width 384, 6 heads, context 1024, batch 16, bfloat16 autocast); prints
wall ms per step, the GPU's busy ms per step, and the largest CUDA kernels. `python -m tools.profile_train`."""
import importlib.util
import pathlib
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
spec = importlib.util.spec_from_file_location("train_gpt", path)
tg = importlib.util.module_from_spec(spec)
sys.modules["train_gpt"] = tg        # (dataclasses look their module up there)
spec.loader.exec_module(tg)


def main(steps=5, batch=16, T=1024):
    cfg = tg.GPTConfig(vocab_size=97)
    x = torch.randint(0, 97, (batch, T), device="cuda")
    y = torch.randint(0, 97, (batch, T), device="cuda")
    for impl in ("flashnb", "sdpa-flash"):
        torch.manual_seed(0)
        model = tg.GPT(cfg, impl).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps * 1e3
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in events) / steps / 1e3
        print(f"== {impl}: {wall:.2f} ms per step (profiled), GPU kernels {busy:.2f} ms per step")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:8]:
            print(f"   {e.self_device_time_total / steps / 1e3:7.3f} ms  {e.count // steps:4d}x  {e.key[:100]}")
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        print(f"   unprofiled: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
