"""A Hugging Face model with flashnb against PyTorch's attention: ``python -m bench --model llama``.

A randomly initialised transformers ``LlamaForCausalLM`` (no download; bfloat16 on the GPU), timed as a user
runs it, host time included, every implementation in the same process and on the same weights:

* ``train``: one training step (forward, loss, backward, optimizer step; AdamW) at ``--batch`` x ``--seqlen``
  tokens; the median of ``--steps`` steps after warm-up, in ms;
* ``generate``: ``model.generate`` of ``--new-tokens`` tokens after a ``--prompt``-token prompt, greedy, batch
  ``--gen-batch``, transformers' default (dynamic) KV cache; tokens/s (new tokens x batch / seconds, the prefill
  included), the median of ``--rounds`` runs, the implementations' rounds interleaved.

``--pad N`` left-pads every other sequence of both batches by N tokens (a 2-D attention mask, labels of the
padding ignored): padded prefill, training and decoding steps, as a batch of prompts of unequal lengths has.

Implementations (``--impl``): ``sdpa`` (transformers' SDPA attention with PyTorch's default backend choice),
``sdpa-cudnn`` and ``sdpa-flash`` (the same with SDPA restricted to one backend by ``torch.nn.attention.
sdpa_kernel``) and ``numba_attention`` (``import flashnb.transformers``; ``attn_implementation=
"numba_attention"``).  The greedy tokens of every implementation are compared with the first's (a mismatch is
reported: bfloat16 rounding can flip a near tie).

The bound ``no-attention`` (the step with attention doing nothing) and ``--profile`` (the attention kernels' GPU
time a step) are ``python -m tools.model_bound``, which runs this table with them; the records made before they
moved there name them ``python -m bench --model llama --impl ...,no-attention`` and ``... --profile``.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

IMPLS = ("sdpa", "sdpa-cudnn", "sdpa-flash", "numba_attention")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench --model llama", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", choices=("llama",))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=2, help="training batch (default %(default)s)")
    p.add_argument("--seqlen", type=int, default=4096, help="training sequence length (default %(default)s)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--gen-batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--what", default="train,generate")
    p.add_argument("--impl", default=",".join(IMPLS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--pad", type=int, default=0, help="left padding (tokens) of every other sequence; 0: none")
    return p.parse_args(argv)


def batch_of(n, length, pad, vocab, seed, torch, device="cuda"):
    """``(ids, attention_mask)``: random tokens ``(n, length)``; with ``pad`` > 0 every other sequence (1, 3,
    ...) starts with ``pad`` padding tokens (id 0, mask 0), else the mask is None."""
    ids = torch.randint(1, vocab, (n, length), device=device, generator=torch.Generator(device).manual_seed(seed))
    if pad <= 0:
        return ids, None
    if pad >= length:
        raise ValueError(f"--pad {pad} must be below the sequence length {length}")
    mask = torch.ones(n, length, dtype=torch.long, device=device)
    mask[1::2, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def build(args, impl, torch, transformers):
    """The randomly initialised model (seed 0) with ``impl``'s attention (any name registered with transformers'
    ``AttentionInterface``; ``sdpa-*``: transformers' SDPA, restricted by ``backend_scope``)."""
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, max_position_embeddings=args.seqlen
                                   + args.prompt + args.new_tokens)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", getattr(torch, args.dtype))
    model.set_attn_implementation("sdpa" if impl.startswith("sdpa") else impl)
    return model


def backend_scope(impl, torch):
    if impl == "sdpa-cudnn":
        return torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    if impl == "sdpa-flash":
        return torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    return contextlib.nullcontext()


def train_ms(model, args, torch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids, mask = batch_of(args.batch, args.seqlen, args.pad, model.config.vocab_size, 1, torch)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)      # no loss on the padding
    times, losses = [], []
    for i in range(args.steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss.detach()))
    return statistics.median(times), losses


def generate_once(model, args, torch, new_tokens=None):
    """(tokens/s, the new tokens) of one greedy ``generate()``."""
    n = new_tokens or args.new_tokens
    ids, mask = batch_of(args.gen_batch, args.prompt, args.pad, model.config.vocab_size, 2, torch)
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        torch.cuda.synchronize()
    return n * args.gen_batch / (time.perf_counter() - t0), out[:, args.prompt:]


def table(rows) -> list[str]:
    """The markdown table's lines: the columns the rows have (after ``train ms``, any that ``main``'s ``extra``
    added), and each row's speed against the first row's."""
    base = rows[0]
    known = ("impl", "train ms", "gen tok/s", "loss 1st/last", "tokens = 1st impl")
    extra = [c for c in base if c not in known]
    cols = [c for c in ("train ms", *extra, "gen tok/s", "loss 1st/last", "tokens = 1st impl") if c in base]
    lines = ["| impl | " + " | ".join(cols) + f" | train vs {base['impl']} | generate vs {base['impl']} |",
             "|---" * (len(cols) + 3) + "|"]
    for r in rows:
        vs_t = f"{base['train ms'] / r['train ms']:.3f}x" if "train ms" in r else ""
        vs_g = f"{r['gen tok/s'] / base['gen tok/s']:.3f}x" if "gen tok/s" in r else ""
        cells = [f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        lines.append(f"| {r['impl']} | " + " | ".join(cells) + f" | {vs_t} | {vs_g} |")
    return lines


def main(argv=None, extra=None) -> int:
    """``python -m bench --model llama``.  ``extra(model, args, torch) -> dict``: more columns of a row, measured
    after its training step on the same model (``tools.model_bound``'s profile)."""
    args = parse_args(argv)
    import torch
    import transformers
    import flashnb.transformers  # noqa: F401  (registers "numba_attention")
    impls = [x.strip() for x in args.impl.split(",") if x.strip()]
    what = {x.strip() for x in args.what.split(",")}
    print(f"# {args.model}: {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV) of "
          f"{args.hidden // args.heads}, {args.dtype}; {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}" + (f"; every other sequence left-padded by {args.pad}"
                                                           if args.pad else ""))
    rows = [{"impl": impl} for impl in impls]
    if "train" in what:
        for row in rows:
            model = build(args, row["impl"], torch, transformers)
            with backend_scope(row["impl"], torch):
                model.train()
                row["train ms"], losses = train_ms(model, args, torch)
                if extra is not None:
                    row.update(extra(model, args, torch))
            row["loss 1st/last"] = f"{losses[0]:.4f}/{losses[-1]:.4f}"
            del model
            torch.cuda.empty_cache()
            print(row, file=sys.stderr, flush=True)
    if "generate" in what:
        # generate() at this size is bound by the host, whose speed drifts over a run: the implementations' rounds
        # are interleaved (round r of every implementation, then round r + 1), each model built once
        models = {row["impl"]: build(args, row["impl"], torch, transformers).eval() for row in rows}
        rates, tokens = {impl: [] for impl in models}, {}
        for r in range(args.rounds + 1):
            for impl, model in models.items():
                with backend_scope(impl, torch):
                    rate, tokens[impl] = generate_once(model, args, torch, 8 if r == 0 else None)  # round 0: warm-up
                if r:
                    rates[impl].append(rate)
        first = tokens[impls[0]]
        for row in rows:
            row["gen tok/s"] = statistics.median(rates[row["impl"]])
            row["tokens = 1st impl"] = f"{(tokens[row['impl']] == first).float().mean().item():.3f}"
            print(row, file=sys.stderr, flush=True)
        del models
    for line in table(rows):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
