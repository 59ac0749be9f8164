"""What gradients into captured tensors cost (``flex_attention_backward``'s ``captured_grads``, through
``flashnb.torch.flex_attention``'s autograd), on ``bench --flex``'s shape (bfloat16, one sequence of ``--seqlen``
tokens, 2048 / d heads, causal): each score_mod over a float32 CUDA tensor, once fixed (the tensor detached: no
gradient into it) and once learned (it requires grad: the dK/dV kernels add each element's part with atomics),
forward+backward with host time included (``bench.flex._gpu_ms``), and PyTorch's compiled ``flex_attention`` with
the same function and a learned tensor, in the same run.

    python -m tools.flex_learned_cost [--headdims 64] [--seqlen 16384]

The mods: ALiBi with learned per-head slopes (every element of a head adds into one entry: the worst contention)
and a T5-style table of 32 relative-position buckets a head (``(q_idx - kv_idx) // 64``, clamped).
"""
import argparse

from bench import flex as bf


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdims", default="64")
    ap.add_argument("--seqlen", type=int, default=bf.SEQLEN)
    args = ap.parse_args(argv)
    import torch
    import flashnb
    import flashnb.torch as ft
    n = args.seqlen
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, seqlen {n}")
    print("| d | score_mod | flashnb fixed f+b ms | flashnb learned f+b ms | torch flex learned f+b ms | "
          "max |d table| diff vs torch |")
    print("|---|---|---|---|---|---|")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        tflex = torch.compile(flex_attention)
    except Exception as e:                   # noqa: BLE001 (reported, the flashnb rows still run)
        print(f"torch flex unavailable: {e}")
        tflex = None
    for d in (int(x) for x in args.headdims.split(",")):
        h = bf.HIDDEN // d
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        dout = torch.randn_like(q)
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda").requires_grad_()
        table = (0.1 * torch.randn(h, 32, device="cuda", generator=gen)).requires_grad_()

        def make(slopes, table):
            def alibi(score, b, hh, q_idx, kv_idx):
                return score - slopes[hh] * (q_idx - kv_idx)

            def t5(score, b, hh, q_idx, kv_idx):        # (a masked pair's index is clamped too: the host probes)
                return score + table[hh, max(min((q_idx - kv_idx) // 64, 31), 0)]

            return {"alibi slopes": (alibi, slopes), "t5 buckets": (t5, table)}

        def torch_mods(slopes, table):                  # the same functions on PyTorch's index tensors
            def alibi(score, b, hh, q_idx, kv_idx):
                return score - slopes[hh] * (q_idx - kv_idx)

            def t5(score, b, hh, q_idx, kv_idx):
                return score + table[hh, torch.clamp((q_idx - kv_idx) // 64, 0, 31)]

            return {"alibi slopes": alibi, "t5 buckets": t5}

        def causal(b, hh, q_idx, kv_idx):
            return q_idx >= kv_idx

        mask = flashnb.create_block_mask(causal, None, None, n, n, BLOCK_SIZE=bf.BLOCK)
        t_mask = create_block_mask(causal, None, None, n, n, BLOCK_SIZE=bf.BLOCK) if tflex else None
        learned, fixed = make(slopes, table), make(slopes.detach(), table.detach())
        theirs_mods = torch_mods(slopes, table)
        for name in learned:
            mod, tensor = learned[name]
            fixed_mod = fixed[name][0]
            t_fixed = bf._gpu_ms(torch, lambda: torch.autograd.grad(
                ft.flex_attention(q, k, v, score_mod=fixed_mod, block_mask=mask), (q, k, v), dout))
            t_learned = bf._gpu_ms(torch, lambda: torch.autograd.grad(
                ft.flex_attention(q, k, v, score_mod=mod, block_mask=mask), (q, k, v, tensor), dout))
            ours = torch.autograd.grad(ft.flex_attention(q, k, v, score_mod=mod, block_mask=mask), tensor, dout)[0]
            t_torch, diff = float("nan"), float("nan")
            if tflex is not None:
                try:
                    t_torch = bf._gpu_ms(torch, lambda: torch.autograd.grad(
                        tflex(q, k, v, score_mod=theirs_mods[name], block_mask=t_mask), (q, k, v, tensor), dout))
                    theirs = torch.autograd.grad(tflex(q, k, v, score_mod=theirs_mods[name], block_mask=t_mask),
                                                 tensor, dout)[0]
                    diff = float((ours - theirs).abs().max())
                except Exception as e:       # noqa: BLE001 (PyTorch may refuse a mod: reported, not fatal)
                    print(f"torch flex failed on {name}: {type(e).__name__}: {str(e)[:200]}")
            print(f"| {d} | {name} | {t_fixed:.3f} | {t_learned:.3f} | {t_torch:.3f} | {diff:.3g} |", flush=True)


if __name__ == "__main__":
    main()
