"""Check and time ring attention on the GPUs of one host:

    python -m torch.distributed.run --nproc-per-node=2 -m flashnb.distributed.bench --out ring.md

1. **Check** (``--check-seqlen``, 4096 tokens): every rank draws the same full q, k, v, dout, runs
   ``ring_attention`` on its zigzag shard, forward and backward, and gathers the result. The flash-attn rule:
   the ring's largest error against the float64 attention (PyTorch, materialised) is at most 2x that of the
   same attention computed in the input precision, plus 1e-5; single-GPU flashnb's error is reported beside it.
2. **Throughput** (``--seqlen``, 131072 tokens): single-GPU flashnb on the whole sequence (each GPU runs it at
   once; the slower's time is reported), then the ring over all ranks (the slowest rank's time). Scaling efficiency
   = tokens/s on P GPUs / (P x tokens/s on one GPU) = T_1 / (P T_P). Times are CUDA-event times around the
   Python calls, host time included, averaged over ``--reps`` calls after one warm-up call.
   Each ring is timed again with ``timeout=60``: what the bounded waits cost.
3. **Agreement**: the host time of the ranks' agreement at a signature's first call and at a later one.
4. **Timeline** (``--trace DIR``): one ring forward+backward under ``torch.profiler`` on every rank; the
   report gives the time the NCCL kernels ran, and how much of it overlapped the attention kernels; rank 0's
   Chrome trace is written to ``DIR/ring-trace-rank0.json.gz``.
"""
import argparse
import gzip
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from flashnb.distributed import ring_attention, shard, unshard
from flashnb.torch import flash_attn_func

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICE = "cuda"          # "cpu" with --cpu: a dry run of this script on gloo (the simulator; tiny shapes only)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _empty_cache():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    parser.add_argument("--check-seqlen", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--trace", default=None, help="a folder for rank 0's Chrome trace")
    parser.add_argument("--out", default=None, help="a Markdown file for the report (rank 0 writes it)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="a dry run on CPU ranks (gloo; the simulator)")
    parser.add_argument("--high-priority", action="store_true",
                        help="create the process group with high-priority NCCL streams (is_high_priority_stream)")
    parser.add_argument("--masks", default="causal,full", help="which masks the throughput table times")
    args = parser.parse_args()

    global DEVICE
    if args.cpu:
        DEVICE = "cpu"
        dist.init_process_group("gloo")
        device, comm = "CPU (gloo)", "gloo"
    else:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        options = None
        if args.high_priority:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), pg_options=options)
        device, comm = torch.cuda.get_device_name(), "NCCL " + ".".join(map(str, torch.cuda.nccl.version()))
        comm += ", high-priority streams" if args.high_priority else ""
    rank, world = dist.get_rank(), dist.get_world_size()
    lines = [f"# Ring attention on {world} x {device}",
             "", f"- torch {torch.__version__}, {comm}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "- command: `python -m torch.distributed.run --nproc-per-node=" + str(world)
             + " -m flashnb.distributed.bench " + " ".join(_argv()) + "`", ""]
    if not args.skip_check:
        lines += check(args, rank, world)
    lines += agreement(args, rank, world)
    if not args.skip_throughput:
        lines += throughput(args, rank, world)
    if args.trace:
        lines += timeline(args, rank, world)
    if rank == 0:
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
    dist.barrier()
    dist.destroy_process_group()


def _argv():
    return sys.argv[1:]


# ------------------------------------------------------------------------------------------------ check
def _reference(q, k, v, causal, scale, dtype):
    """attention in ``dtype`` (float64: the truth; the input dtype: the flash-attn rule's yardstick),
    materialised, scores and softmax in ``dtype`` except the softmax of 16-bit scores (float32, as flash-attn's
    reference)."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        n = q.shape[1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), -math.inf)
    p = torch.softmax(s.float() if dtype != torch.float64 else s, dim=-1).to(dtype)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def _grads(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def check(args, rank, world):
    lines = [f"## Check: ring vs single GPU, {args.check_seqlen} tokens, zigzag layout", "",
             "| case | tensor | ring err | single-GPU flashnb err | input-precision attention err | bound | ok |",
             "|---|---|---|---|---|---|---|"]
    cases = [("float16", 8, 8, 128, True), ("float16", 8, 8, 128, False), ("bfloat16", 8, 2, 64, True),
             ("float16", 8, 2, 64, False)]
    failures = 0
    for dtype_name, heads, heads_k, d, causal in cases:
        dtype, n = DTYPES[dtype_name], args.check_seqlen
        gen = torch.Generator().manual_seed(1234 + d + heads_k + causal)
        q = torch.randn(1, n, heads, d, generator=gen).to(DEVICE, dtype)
        k, v = (torch.randn(1, n, heads_k, d, generator=gen).to(DEVICE, dtype) for _ in range(2))
        dout = torch.randn(1, n, heads, d, generator=gen).to(DEVICE, dtype)
        scale = d ** -0.5
        truth = _grads(lambda a, b, c: _reference(a, b, c, causal, scale, torch.float64), q, k, v, dout.double())
        low = _grads(lambda a, b, c: _reference(a, b, c, causal, scale, dtype), q, k, v, dout)
        single = _grads(lambda a, b, c: flash_attn_func(a, b, c, causal=causal, softmax_scale=scale), q, k, v, dout)

        got = _grads(lambda a, b, c: _RingFull.apply(a, b, c, causal, scale), q, k, v, dout)
        name = f"{dtype_name} h{heads}/{heads_k} d{d} {'causal' if causal else 'full'}"
        for tensor, g, s, lo, t in zip(("out", "dq", "dk", "dv"), got, single, low, truth):
            err = lambda x: (x.double() - t).abs().max().item()          # noqa: E731
            bound = 2 * err(lo) + 1e-5
            ok = err(g) <= bound
            failures += not ok
            lines.append(f"| {name} | {tensor} | {err(g):.2e} | {err(s):.2e} | {err(lo):.2e} | {bound:.2e} | "
                         f"{'yes' if ok else '**NO**'} |")
        truth = low = single = got = None
        _empty_cache()
    total = torch.tensor([failures], device=DEVICE)
    dist.all_reduce(total)
    lines += ["", f"Cases outside the bound, all ranks: {int(total.item())}", ""]
    return lines


class _RingFull(torch.autograd.Function):
    """Full tensors in, full tensors out, the ring in between: shard -> ring_attention -> unshard, and the
    gradients the same way (dout sharded, the ring's backward, the gradients gathered)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        with torch.enable_grad():
            parts = [shard(x.detach()).requires_grad_() for x in (q, k, v)]
            out = ring_attention(*parts, causal=causal, softmax_scale=scale)
        ctx.saved = (parts, out)
        return unshard(out.detach())

    @staticmethod
    def backward(ctx, dout):
        parts, out = ctx.saved
        out.backward(shard(dout))
        return tuple(unshard(p.grad) for p in parts) + (None, None)


# ------------------------------------------------------------------------------------------------ throughput
def _time(fn, reps):
    fn()
    _sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync()
    return (time.perf_counter() - start) / reps


def _slowest(seconds):
    t = torch.tensor([seconds], device=DEVICE, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _flops(n, heads, d, causal, backward):
    f = 4 * n * n * heads * d * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)       # the backward: 2.5x the forward's matrix products (FA2's count)


def throughput(args, rank, world):
    n, h, d, dtype = args.seqlen, args.heads, args.headdim, DTYPES[args.dtype]
    lines = [f"## Throughput: batch 1, {n} tokens, {h} heads, head dim {d}, {args.dtype}", "",
             "| mask | pass | 1 GPU (s) | 1 GPU TFLOP/s | ring (s) | ring TFLOP/s per GPU | scaling efficiency | "
             "ring, timeout=60 (s) | its scaling efficiency |",
             "|---|---|---|---|---|---|---|---|---|"]
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    masks = [m.strip() for m in args.masks.split(",") if m.strip()]
    if not masks or set(masks) - {"causal", "full"}:
        raise SystemExit(f"--masks takes causal and/or full, got {args.masks!r}")
    for causal in [m == "causal" for m in ("causal", "full") if m in masks]:
        full = [torch.randn(1, n, h, d, device=DEVICE, dtype=dtype, generator=gen) for _ in range(4)]
        parts = [shard(x) for x in full]
        for backward in (False, True):
            def single():
                q, k, v = (x.requires_grad_(backward) for x in full[:3])
                out = flash_attn_func(q, k, v, causal=causal)
                if backward:
                    out.backward(full[3])

            def ring(timeout=None):
                q, k, v = (x.requires_grad_(backward) for x in parts[:3])
                out = ring_attention(q, k, v, causal=causal, timeout=timeout)
                if backward:
                    out.backward(parts[3])

            dist.barrier()
            t1 = _slowest(_time(single, args.reps))
            dist.barrier()
            tp = _slowest(_time(ring, args.reps))
            dist.barrier()
            tt = _slowest(_time(lambda: ring(timeout=60), args.reps))
            f = _flops(n, h, d, causal, backward)
            lines.append(f"| {'causal' if causal else 'full'} | {'fwd+bwd' if backward else 'fwd'} | {t1:.3f} | "
                         f"{f / t1 / 1e12:.0f} | {tp:.3f} | {f / tp / world / 1e12:.0f} | {t1 / (world * tp):.1%} | "
                         f"{tt:.3f} | {t1 / (world * tt):.1%} |")
            for x in full + parts:
                x.grad = None
        full = parts = None
        _empty_cache()
    lines.append("")
    return lines


# ------------------------------------------------------------------------------------------------ agreement
def agreement(args, rank, world, reps=20):
    """What the ranks' agreement costs (``ring._agree``, host time, the slowest rank): a signature's first call
    (every rank's row through the process group's store, then one exchange of an element around the ring)
    against a call whose signature was agreed on (a set lookup), each the median of ``reps``."""
    from flashnb.distributed import ring as ring_module
    n, h, d, dtype = args.check_seqlen, args.heads, args.headdim, DTYPES[args.dtype]
    q = torch.randn(1, n // world, h, d, device=DEVICE, dtype=dtype)

    def median_us(fresh):
        times = []
        for i in range(reps):
            scale = 0.1 + i * 1e-3 if fresh else 0.1      # a new softmax_scale: a signature not agreed on yet
            dist.barrier()
            _sync()
            t0 = time.perf_counter()
            ring_module._agree(q, q, None, world, "zigzag", True, scale, "auto")
            times.append(time.perf_counter() - t0)
        return _slowest(sorted(times)[reps // 2]) * 1e6

    ring_module._AGREED.clear()
    first = median_us(fresh=True)
    again = median_us(fresh=False)
    return [f"## The ranks' agreement ({world} ranks; host time, median of {reps}, the slowest rank)", "",
            "| call | time (us) |", "|---|---|",
            f"| a signature's first call (a round through the store, the ring's first connection) | {first:.1f} |",
            f"| a signature agreed on before (every later step of a training loop) | {again:.2f} |", ""]


# ------------------------------------------------------------------------------------------------ timeline
def _union(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _overlap(xs, ys):
    total = 0.0
    for a, b in xs:
        for c, e in ys:
            total += max(0.0, min(b, e) - max(a, c))
    return total


def _is_torch_kernel(name):
    """PyTorch's own kernels (the merge's elementwise work, casts, fills, copies), as against flashnb's."""
    return name.startswith(("void at::", "at::", "Memcpy", "Memset")) or "at::native" in name


def timeline(args, rank, world):
    """Profile one causal ring forward, then one forward+backward: per rank, the GPU span, flashnb's kernels,
    PyTorch's kernels (the merge, casts, copies), NCCL's, and how much of NCCL's time ran under flashnb's."""
    n, h, d, dtype = args.seqlen, args.heads, args.headdim, DTYPES[args.dtype]
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    parts = [shard(torch.randn(1, n, h, d, device=DEVICE, dtype=dtype, generator=gen)) for _ in range(4)]
    q, k, v = (x.requires_grad_() for x in parts[:3])
    ring_attention(q, k, v, causal=True).backward(parts[3])       # warm
    _sync()
    lines = [f"## Timeline: one causal ring pass, {n} tokens (torch.profiler, GPU kernels)", "",
             "| pass | rank | GPU span (ms) | flashnb kernels (ms) | PyTorch kernels (ms) | NCCL kernels (ms) | "
             "NCCL time under flashnb kernels |", "|---|---|---|---|---|---|---|"]
    for backward in (False, True):
        dist.barrier()
        _sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = ring_attention(q, k, v, causal=True)
            if backward:
                out.backward(parts[3])
            _sync()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        span = lambda e: (e.time_range.start, e.time_range.end)          # noqa: E731  (microseconds)
        kinds = {"nccl": [], "torch": [], "flashnb": []}
        for e in kernels:
            kind = "nccl" if "nccl" in e.name.lower() else "torch" if _is_torch_kernel(e.name) else "flashnb"
            kinds[kind].append(span(e))
        comm, ours, theirs = (_union(kinds[x]) for x in ("nccl", "flashnb", "torch"))
        total = lambda xs: sum(b - a for a, b in xs)                     # noqa: E731
        ends = [t for pair in comm + ours + theirs for t in pair] or [0.0]
        stats = torch.tensor([max(ends) - min(ends), total(ours), total(theirs), total(comm), _overlap(comm, ours)],
                             device=DEVICE, dtype=torch.float64)
        every = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(every, stats)
        for r, row in enumerate(every):
            span_us, a, t, c, o = row.tolist()
            lines.append(f"| {'fwd+bwd' if backward else 'fwd'} | {r} | {span_us / 1e3:.1f} | {a / 1e3:.1f} | "
                         f"{t / 1e3:.1f} | {c / 1e3:.1f} | {f'{o / c:.0%}' if c > 0 else '-'} |")
        if rank == 0 and args.trace and backward:
            os.makedirs(args.trace, exist_ok=True)
            raw = os.path.join(args.trace, "ring-trace-rank0.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
                g.write(f.read())
            os.remove(raw)
    lines += ["", "(An NCCL kernel runs from its post until its peer's matching post completes the transfer, so a "
              "rank that posts first also counts its wait for the other.)", ""]
    return lines


if __name__ == "__main__":
    main()
