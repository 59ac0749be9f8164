"""The largest GPU kernels of one training step of bench/model.py's Llama (the default shape: 4 layers, hidden
1024, 8 heads of 128, bfloat16, batch 2 x 4096), per attention implementation: torch.profiler over 2 steps after
3 warm-up steps, kernels sorted by GPU time (ms a step), and the host's wall ms a step.
`python -m tools.profile_model_step [IMPL ...]` (default: sdpa numba_attention) on a GPU machine."""
import sys
import time

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import flashnb.transformers  # noqa: F401  (registers "numba_attention")
from bench import model as bm


def main(impls):
    args = bm.parse_args([])
    for impl in impls:
        m = bm.build(args, impl, torch, transformers)
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        ids, _ = bm.batch_of(args.batch, args.seqlen, 0, m.config.vocab_size, 1, torch)

        def step():
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with bm.backend_scope(impl, torch):
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / 2 * 1e3
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
        print(f"==== {impl}: {wall:.2f} ms a step (unprofiled)")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=90))
        del m, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["sdpa", "numba_attention"])
