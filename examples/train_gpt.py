"""Train a small character-level GPT with three attention implementations and compare them.

    python examples/train_gpt.py                      # on a GPU: flashnb, sdpa-flash, materialised, 300 steps each
    python examples/train_gpt.py --attn flashnb,sdpa-flash --steps 500 --compile --json run.json
    python examples/train_gpt.py --device cpu --tiny --attn materialised,sdpa-math   # a smoke test without a GPU

The model is nanoGPT's (pre-LayerNorm blocks, GELU MLP, tied embeddings; default 6 layers, width 384,
6 heads, context 1024, no dropout), trained under bfloat16 autocast with AdamW and a warmup + cosine learning
rate.  The text is this repository's own: README.md, docs/**/*.md and the Python sources, character level,
each file split 90/10 into train and validation.  Only the attention differs between the runs:

* ``flashnb``      -- ``flashnb.torch.flash_attn_func(q, k, v, causal=True)``, q/k/v as (B, T, H, D);
* ``sdpa-flash``   -- ``F.scaled_dot_product_attention(is_causal=True)`` inside
  ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` (on a CPU: PyTorch's CPU flash kernel);
* ``sdpa-math``    -- the same inside ``sdpa_kernel(SDPBackend.MATH)``;
* ``materialised`` -- ``softmax(q k^T * scale + causal mask) v`` in PyTorch (the T x T matrix in memory).

Every run starts from the same initial weights and sees the same batches, so the loss curves differ only
by rounding; the script prints the largest difference between the implementations at each logged step.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
ATTNS = ("flashnb", "sdpa-flash", "sdpa-math", "materialised")


# ---- data: the repository's own text, character level ------------------------------------------

def corpus_files() -> list[Path]:
    md = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    py = [p for top in ("flashnb", "reference", "bench", "tools", "examples", "tests")
          for p in sorted((REPO / top).rglob("*.py"))]
    return [p for p in md + py if p.is_file()]


def load_corpus():
    """(train ids, val ids, vocabulary, info): the first 90% of every file trains, the last 10% validates."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files()]
    chars = sorted(set("".join(texts)))
    index = {c: i for i, c in enumerate(chars)}
    cut = [int(len(t) * 0.9) for t in texts]
    train = "".join(t[:c] for t, c in zip(texts, cut))
    val = "".join(t[c:] for t, c in zip(texts, cut))
    encode = lambda s: torch.tensor([index[c] for c in s], dtype=torch.long)
    info = {"files": len(texts), "chars": sum(map(len, texts)), "vocab": len(chars),
            "train_chars": len(train), "val_chars": len(val)}
    return encode(train), encode(val), chars, info


def get_batch(data, batch_size, block_size, generator, device):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


# ---- the model -----------------------------------------------------------------------------------

@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 1024
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0


def make_attention(impl: str):
    """Causal self-attention ``f(q, k, v)`` of q, k, v in (B, T, H, D) layout, returning (B, T, H, D)."""
    if impl == "flashnb":
        import flashnb.torch
        return lambda q, k, v: flashnb.torch.flash_attn_func(q, k, v, causal=True)
    if impl in ("sdpa-flash", "sdpa-math"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.FLASH_ATTENTION if impl == "sdpa-flash" else SDPBackend.MATH

        def sdpa(q, k, v):
            with sdpa_kernel(backend):                                   # SDPA's layout is (B, H, T, D)
                y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True)
            return y.transpose(1, 2)
        return sdpa
    if impl == "materialised":
        def materialised(q, k, v):
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))             # (B, H, T, D)
            T = q.size(-2)
            att = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5)        # (B, H, T, T) in memory
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
            att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
            return (att.to(v.dtype) @ v).transpose(1, 2)
        return materialised
    raise ValueError(f"unknown attention {impl!r}")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attn_impl: str):
        super().__init__()
        self.n_head, self.attention = cfg.n_head, make_attention(attn_impl)
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)
        y = self.attention(q, k, v).reshape(B, T, C)
        x = x + self.drop(self.c_proj(y))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, attn_impl: str):
        super().__init__()
        self.cfg = cfg
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, attn_impl) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight                              # tied embeddings
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


# ---- training ------------------------------------------------------------------------------------

def lr_at(step, args):
    if step < args.warmup_lr:
        return args.lr * (step + 1) / args.warmup_lr
    frac = (step - args.warmup_lr) / max(1, args.steps - args.warmup_lr)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))  # cosine down to lr / 10


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def estimate_loss(model, data, args, device, autocast):
    g = torch.Generator().manual_seed(args.seed + 1)                     # the same eval batches every time
    model.eval()
    losses = []
    for _ in range(args.eval_iters):
        x, y = get_batch(data, args.batch_size, args.block_size, g, device)
        with autocast:
            losses.append(model(x, y).item())
    model.train()
    return sum(losses) / len(losses)


def train_one(impl, args, cfg, train_data, val_data, device) -> dict:
    """Train a fresh model (seed args.seed) with one attention; returns the run's record."""
    torch.manual_seed(args.seed)
    model = GPT(cfg, impl).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    step_model = torch.compile(model) if args.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp)
    g = torch.Generator().manual_seed(args.seed)                         # the same batches for every impl
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, evals, timed_s, timed_steps = [], [], 0.0, 0
    for step in range(args.steps):
        x, y = get_batch(train_data, args.batch_size, args.block_size, g, device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        synchronize(device)
        t0 = time.perf_counter()
        with autocast:
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= args.warmup:                                          # warm-up steps: compile, autotune
            timed_s += time.perf_counter() - t0
            timed_steps += 1
        last = step == args.steps - 1
        if step % args.log_every == 0 or last:
            losses.append((step, loss.item()))
            print(f"  {impl:>12} step {step:4d}  loss {losses[-1][1]:.4f}  lr {lr_at(step, args):.2e}", flush=True)
        if (step > 0 and step % args.eval_every == 0) or last:
            evals.append((step, estimate_loss(model, train_data, args, device, autocast),
                          estimate_loss(model, val_data, args, device, autocast)))
            print(f"  {impl:>12} step {step:4d}  train {evals[-1][1]:.4f}  val {evals[-1][2]:.4f}", flush=True)
    tokens_per_s = timed_steps * args.batch_size * args.block_size / timed_s if timed_steps else None
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    print(f"  {impl:>12} done: {_fmt(tokens_per_s, ',.0f')} tokens/s over {timed_steps} timed steps "
          f"(after {min(args.warmup, args.steps)} warm-up), peak memory {_fmt(peak, '.0f')} MiB", flush=True)
    del model, step_model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens_per_s": tokens_per_s, "timed_steps": timed_steps, "peak_mib": peak, "losses": losses,
            "evals": evals, "final_train": evals[-1][1], "final_val": evals[-1][2]}


# ---- reporting -----------------------------------------------------------------------------------

def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def print_tables(runs: dict, reference: str) -> dict:
    """The comparison and the side-by-side loss curves; returns both as records."""
    done = {k: r for k, r in runs.items() if "skipped" not in r}
    if not done:
        return {"comparison": [], "loss_curve": []}
    ref = done.get(reference) or next(iter(done.values()))
    ref_name = next(k for k, r in done.items() if r is ref)
    print(f"\n== comparison (relative to {ref_name}) ==")
    print(f"{'attention':>14} {'tokens/s':>12} {'speed':>7} {'peak MiB':>9} {'train':>8} {'val':>8} "
          f"{'d train':>8} {'d val':>8}")
    comparison = []
    for name, r in done.items():
        speed = r["tokens_per_s"] / ref["tokens_per_s"] if r["tokens_per_s"] and ref["tokens_per_s"] else None
        comparison.append({"attention": name, "tokens_per_s": r["tokens_per_s"], "speed_vs_ref": speed,
                           "peak_mib": r["peak_mib"], "final_train": r["final_train"], "final_val": r["final_val"],
                           "d_train": r["final_train"] - ref["final_train"], "d_val": r["final_val"] - ref["final_val"]})
        print(f"{name:>14} {_fmt(r['tokens_per_s'], ',.0f'):>12} {_fmt(speed, '.2f') + 'x':>7} "
              f"{_fmt(r['peak_mib'], '.0f'):>9} {r['final_train']:8.4f} {r['final_val']:8.4f} "
              f"{r['final_train'] - ref['final_train']:+8.4f} {r['final_val'] - ref['final_val']:+8.4f}")
    print("\n== training loss (same batches, same initial weights) ==")
    names = list(done)
    print(f"{'step':>6} " + " ".join(f"{n:>14}" for n in names) + f" {'max |diff|':>11}")
    curve = []
    for i, (step, _) in enumerate(next(iter(done.values()))["losses"]):
        row = [done[n]["losses"][i][1] for n in names]
        spread = max(row) - min(row)
        curve.append({"step": step, **dict(zip(names, row)), "max_abs_diff": spread})
        print(f"{step:6d} " + " ".join(f"{x:14.4f}" for x in row) + f" {spread:11.4f}")
    if len(names) > 1:
        print(f"largest |loss difference| between the implementations at a logged step: "
              f"{max(c['max_abs_diff'] for c in curve):.4f}")
    return {"reference": ref_name, "comparison": comparison, "loss_curve": curve}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", default="flashnb,sdpa-flash,materialised", help=f"comma list of {', '.join(ATTNS)}")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 300; --tiny 20)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny model and context, for a CPU smoke test")
    p.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 16; --tiny 4)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default %(default)s)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 5; --tiny 1)")
    p.add_argument("--log-every", type=int, default=None, help="print the loss every N steps (default 25; --tiny 1)")
    p.add_argument("--eval-every", type=int, default=100, help="train/val loss estimate every N steps and at the end")
    p.add_argument("--eval-iters", type=int, default=None, help="batches per loss estimate (default 20; --tiny 2)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--json", metavar="FILE", help="write the configuration, every run and the tables there")
    args = p.parse_args(argv)
    args.attn = [a.strip() for a in args.attn.split(",") if a.strip()]
    if bad := [a for a in args.attn if a not in ATTNS]:
        p.error(f"unknown --attn {bad}; choose from {', '.join(ATTNS)}")
    tiny = args.tiny
    for name, full, small in (("steps", 300, 20), ("batch_size", 16, 4), ("warmup", 5, 1), ("log_every", 25, 1),
                              ("eval_iters", 20, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else full)
    args.block_size = 64 if tiny else 1024
    args.model = dict(n_layer=2, n_head=4, n_embd=64) if tiny else dict(n_layer=6, n_head=6, n_embd=384)
    args.warmup_lr = max(1, min(100, args.steps // 10))
    args.amp = args.device.startswith("cuda")                          # bfloat16 autocast on the GPU only
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"error: no CUDA device (PyTorch {torch.__version__}); for a smoke test: --device cpu --tiny")
    train_data, val_data, chars, corpus = load_corpus()
    print(f"corpus: {corpus['files']} files of this repository, {corpus['chars']:,} characters, vocabulary "
          f"{corpus['vocab']}; train {corpus['train_chars']:,}, val {corpus['val_chars']:,}")
    cfg = GPTConfig(vocab_size=len(chars), block_size=args.block_size, **args.model)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; model {cfg.n_layer} layers, width {cfg.n_embd}, "
          f"{cfg.n_head} heads, context {cfg.block_size}; batch {args.batch_size}, {args.steps} steps, "
          f"{'bfloat16 autocast' if args.amp else 'float32'}{', torch.compile' if args.compile else ''}")
    runs = {}
    for impl in args.attn:
        why = None
        if impl == "flashnb":
            if device.type != "cuda":
                why = "flashnb runs on CUDA devices only (its kernels are Numba CUDA kernels); skipped on " + name
            else:
                try:
                    import flashnb.torch  # noqa: F401
                except Exception as exc:                                 # noqa: BLE001 - say why, run the rest
                    why = f"import flashnb.torch failed: {type(exc).__name__}: {exc}"
        if why:
            print(f"\n-- {impl}: SKIPPED: {why}", flush=True)
            runs[impl] = {"skipped": why}
            continue
        print(f"\n-- {impl}", flush=True)
        runs[impl] = train_one(impl, args, cfg, train_data, val_data, device)
    tables = print_tables(runs, reference="sdpa-flash")
    result = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "model": asdict(cfg),
              "corpus": corpus, "device": name, "torch": torch.__version__, "runs": runs, **tables}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nwritten to {args.json}")
    return result


if __name__ == "__main__":
    main()
