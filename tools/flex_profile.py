"""Where a flex_attention call's time goes on the GPU: bfloat16, one sequence of 16384 tokens, 2048 / d heads of
``--headdim`` (64), cases of ``python -m bench --flex`` (``--cases``, default causal and sliding 1024) against the
dense call with the same option and, with ``--torch``, PyTorch's compiled flex_attention; per case the host time of
a call (no synchronisation), the CUDA-event time of a forward and of a forward+backward, and torch.profiler's
kernels (name, launches, GPU ms).  ``python -m tools.flex_profile [--headdim 128] [--cases document] [--torch]``.
``python -m tools.flex_profile --once [CASE [HEADDIM [bwd]]]``: one call of each (flex, then dense where the case
has a dense option; forward, or forward+backward with ``bwd``) after a warm-up of each, for e.g. ``ncu -k
regex:flash_dkdv_tc --launch-skip 2 --set full python -m tools.flex_profile --once alibi 128 bwd`` (the warm-up
launches skipped: flex's dK/dV kernel, then the dense ALiBi option's)."""
import time

import torch

import flashnb
import flashnb.torch as ft
from bench.flex import _gpu_ms

N, H, D, W = 16384, 32, 64, 1024


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= W)


def event_ms(fn, reps=5):
    """The median CUDA-event time of ``fn`` (bench --flex's timer)."""
    return _gpu_ms(torch, fn, reps=reps, warmup=2)


def host_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) / reps * 1e6
    torch.cuda.synchronize()
    return host


def kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_time_total > 0:
            rows.append((e.device_time_total / 1e3, e.count, e.key[:90]))
    return sorted(rows, reverse=True)[:8]


def once(case="causal", d=D, backward=False):
    """One call of each (flex, then the dense call where the case has one) after a warm-up of each, for ncu."""
    from bench import flex as bf
    h = bf.HIDDEN // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, N, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)
    score_mod, mask_mod, grad = bf.flashnb_mods(case, h, bf.document_ids())
    mask = None if mask_mod is None else flashnb.create_block_mask(mask_mod, None, None, N, N, BLOCK_SIZE=128)
    calls = [lambda: ft.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, score_mod_grad=grad)]
    dense = bf.dense_options(case, h)
    if dense is not None:
        calls.append(lambda: ft.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                **dense).transpose(1, 2))
    if backward:
        calls = [lambda fwd=fwd: torch.autograd.grad(fwd(), (q, k, v), dout) for fwd in calls]
    for fn in calls:           # warm-up: the launches ncu skips
        fn()
    torch.cuda.synchronize()
    for fn in calls:
        fn()
    torch.cuda.synchronize()


def main():
    import argparse
    import sys
    if "--once" in sys.argv:         # --once [CASE] [HEADDIM] [bwd]
        rest = sys.argv[sys.argv.index("--once") + 1:]
        return once(rest[0] if rest else "causal", int(rest[1]) if len(rest) > 1 else D, "bwd" in rest)
    from bench import flex as bf
    from torch.nn.attention import flex_attention as tflex
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdim", type=int, default=D)
    ap.add_argument("--cases", default="causal,sliding 1024")
    ap.add_argument("--torch", action="store_true", help="also PyTorch's compiled flex_attention")
    args = ap.parse_args()
    d = args.headdim
    h = bf.HIDDEN // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, N, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)
    ids = bf.document_ids()
    compiled = torch.compile(tflex.flex_attention) if args.torch else None
    for name in args.cases.split(","):
        score_mod, mask_mod, grad = bf.flashnb_mods(name, h, ids)
        mask = None if mask_mod is None else flashnb.create_block_mask(mask_mod, None, None, N, N, BLOCK_SIZE=128)
        print(f"{name} (d {d}): {mask}")
        calls = {"flex": lambda: ft.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask,
                                                     score_mod_grad=grad)}
        dense = bf.dense_options(name, h)
        if dense is not None:
            calls["dense"] = lambda: ft.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                        **dense).transpose(1, 2)
        if compiled is not None:
            t_score, t_mask = bf.torch_mods(torch, name, h, ids)
            t_block = None if t_mask is None else tflex.create_block_mask(t_mask, None, None, N, N, device="cuda",
                                                                          BLOCK_SIZE=128)
            calls["torch flex compiled"] = lambda: compiled(q, k, v, score_mod=t_score, block_mask=t_block)
        for impl, fwd in calls.items():
            with torch.no_grad():
                hu = host_us(fwd)
                f = event_ms(fwd)
                ks = kernels(fwd)
            fb = event_ms(lambda: torch.autograd.grad(fwd(), (q, k, v), dout))
            kb = kernels(lambda: torch.autograd.grad(fwd(), (q, k, v), dout))
            print(f"{name} {impl}: host {hu:.0f} us a forward call, forward {f:.3f} ms, forward+backward {fb:.3f} ms")
            for ms, n, key in ks:
                print(f"    fwd  {ms:8.3f} ms {n:3d}x {key}")
            for ms, n, key in kb:
                print(f"    f+b  {ms:8.3f} ms {n:3d}x {key}")


if __name__ == "__main__":
    main()
