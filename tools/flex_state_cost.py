"""What reading a block mask's states costs the kernels, on ``bench --flex``'s shape (bfloat16, one sequence of 16384
tokens, 2048 / d heads): flashnb's dense causal call, the same with a block mask of all-kept 128 x 128 blocks (the
kernels then read a state a key tile, as a flex call does; the results are equal), and ``flex_attention`` with a
causal mask_mod, forward and forward+backward (``bench.flex._gpu_ms``: host time included).

    python -m tools.flex_state_cost [--headdims 64,128]
"""
import argparse

from bench import flex as bf


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdims", default="64")
    args = ap.parse_args(argv)
    import torch
    import flashnb
    import flashnb.torch as ft
    n = bf.SEQLEN
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| d | call | fwd ms | fwd+bwd ms | max diff vs dense |")
    print("|---|---|---|---|---|")
    for d in (int(x) for x in args.headdims.split(",")):
        h = bf.HIDDEN // d
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        dout = torch.randn_like(q)
        blocks = -(-n // bf.BLOCK)
        kept = torch.ones(1, h, blocks, blocks, dtype=torch.bool, device="cuda")
        mask = flashnb.create_block_mask(lambda b, hh, qi, ki: qi >= ki, None, None, n, n, BLOCK_SIZE=bf.BLOCK)
        calls = {
            "dense causal": lambda: ft.flash_attn_func(q, k, v, causal=True),
            "dense causal, all-kept block mask": lambda: ft.flash_attn_func(
                q, k, v, causal=True, block_mask=kept, block_mask_size=(bf.BLOCK, bf.BLOCK)),
            "flex causal mask_mod": lambda: ft.flex_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask).transpose(1, 2),
        }
        with torch.no_grad():
            ref = calls["dense causal"]().float()
        for name, fn in calls.items():
            with torch.no_grad():
                diff = float((fn().float() - ref).abs().max())
                fwd = bf._gpu_ms(torch, fn)
            fb = bf._gpu_ms(torch, lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), dout))
            print(f"| {d} | {name} | {fwd:.3f} | {fb:.3f} | {diff:.2g} |", flush=True)


if __name__ == "__main__":
    main()
