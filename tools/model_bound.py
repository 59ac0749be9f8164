"""How much any attention kernel could gain in ``python -m bench --model llama``'s model: its table with a bound
and the attention kernels' share of the step (GPU; torch and transformers).

* ``no-attention`` (an ``--impl``, in the default list here): a bound, not an implementation.  Each attention
  layer returns its query (transposed, made contiguous: one copy, differentiable) and computes nothing else, so its
  step is the model's without attention; ``(time with SDPA) / (time with no-attention)`` is the most any attention
  kernel could gain over SDPA in that step.
* ``--profile``: after a row's timed training steps, torch.profiler over 2 more on the same model: ``attn GPU ms``,
  the GPU time a step of the kernels whose names hold one of ``ATTENTION_KERNELS`` (flashnb's, FlashAttention's,
  cuDNN's), and ``GPU ms``, every kernel's.

Everything else (the model, shapes, options, timing, the table) is ``python -m bench --model llama``'s
(bench/model.py), which this runs with the bound registered with transformers and the profile as extra columns.

Made for bench/results/h100-clients-2026-11-27c.md (the bound: the training step 1.155x and ``generate()``
1.13-1.15x SDPA's at the default shape, where flashnb measured 0.995x and 0.93x; ``--profile``: attention kernels
a step, flashnb 3.05 ms, cuDNN 2.33, FlashAttention-2 4.29), used again in h100-decode-steps-2026-11-27.md; both
records name it ``python3 -m bench --model llama --impl ...,no-attention`` and ``... --profile`` (it was part of
bench until issue 44).  docs/api.md quotes the figures.

    python -m tools.model_bound --what train --profile --impl sdpa,sdpa-flash,numba_attention,no-attention
    python -m tools.model_bound --what generate --impl sdpa,numba_attention,no-attention --rounds 3
"""
from __future__ import annotations

import argparse
import sys

NO_ATTENTION = "no-attention"
ATTENTION_KERNELS = ("flashnb::", "flash", "fmha", "cudnn", "attention", "sdpa")


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention layer that attends to nothing: ``query`` as the output (``(batch, seqlen, heads, head_dim)``,
    one copy), for the bound ``no-attention``."""
    return query.transpose(1, 2).contiguous(), None


def register(transformers):
    """``attn_implementation="no-attention"`` from here on (transformers' ``AttentionInterface``)."""
    transformers.AttentionInterface.register(NO_ATTENTION, no_attention)


def attention_kernel_ms(model, args, torch, steps=2):
    """``(attention ms, all kernels ms)`` of the GPU a training step, from torch.profiler over ``steps`` steps:
    kernels whose names hold one of ``ATTENTION_KERNELS`` (flashnb's, FlashAttention's, cuDNN's), and every
    kernel."""
    from torch.profiler import ProfilerActivity, profile

    from bench.model import batch_of
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids, mask = batch_of(args.batch, args.seqlen, args.pad, model.config.vocab_size, 1, torch)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    attention = total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if e.key.startswith("Memcpy") or e.key.startswith("Memset") or t <= 0 or e.count == 0:
            continue
        total += t
        if any(n in e.key.lower() for n in ATTENTION_KERNELS):
            attention += t
    return attention / steps / 1e3, total / steps / 1e3


def profile_columns(model, args, torch) -> dict:
    """``bench.model.main``'s ``extra``: the row's ``attn GPU ms`` and ``GPU ms``."""
    attention, total = attention_kernel_ms(model, args, torch)
    return {"attn GPU ms": attention, "GPU ms": total}


def parse_args(argv):
    """(this tool's options, the rest for ``bench.model``), with ``--impl`` defaulting to bench's and the bound."""
    from bench.model import IMPLS
    p = argparse.ArgumentParser(
        prog="python -m tools.model_bound", description=__doc__.split("\n\n")[0],
        epilog="Every other option is python -m bench --model llama's (python -m bench --model llama --help); "
               f"--impl defaults to {','.join(IMPLS + (NO_ATTENTION,))}.")
    p.add_argument("--profile", action="store_true",
                   help="also profile 2 training steps: GPU ms a step in attention kernels and in all kernels")
    ours, rest = p.parse_known_args(argv)
    if not any(a == "--impl" or a.startswith("--impl=") for a in rest):
        rest += ["--impl", ",".join(IMPLS + (NO_ATTENTION,))]
    return ours, rest


def main(argv=None) -> int:
    ours, rest = parse_args(sys.argv[1:] if argv is None else list(argv))
    import transformers

    from bench import model
    register(transformers)
    return model.main(rest, extra=profile_columns if ours.profile else None)


if __name__ == "__main__":
    raise SystemExit(main())
