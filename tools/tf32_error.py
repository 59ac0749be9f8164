"""float32 attention's error against float64, for each way of computing it (the tables of docs/api.md).

    python -m tools.tf32_error [--seqlens 1024,4096] [--headdims 64,128] [--out FILE.md]

For each shape (batch 2, 8 heads, float32 inputs drawn N(0, 1)), causal and not: the forward of flashnb's SIMT
kernels (float32 on the CUDA cores: the yardstick of the flash-attn rule for float32), flashnb on the tensor
cores with ``precision="highest"`` (3xTF32) and ``"high"`` (one tf32 product), the same on Hopper's tf32 wgmma
(``backend="wgmma"``, compute capability 9.0), and PyTorch SDPA's
memory-efficient backend; each against attention in float64 (PyTorch, materialised), as the largest and the
mean absolute error of ``out`` over its largest magnitude, and the ratio of each largest error to the SIMT
kernels'. Needs a GPU and PyTorch.
"""
import argparse
import math
import time

import numpy as np


def probabilities(qd, kd, causal):
    """softmax(Q K^T / sqrt(d)) of (batch, heads, seqlen, d) tensors, causal bottom-right aligned."""
    import torch
    s = qd @ kd.transpose(-1, -2) / math.sqrt(qd.shape[-1])
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool, device=qd.device).tril(m - n), -math.inf)
    return torch.softmax(s, -1)


def reference(q, k, v, causal):
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    return (probabilities(qd, kd, causal) @ vd).transpose(1, 2)


def main(argv=None):
    import torch
    import flashnb

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ways = {
        "SIMT float32": lambda q, k, v, c: flashnb.flash_attention(q, k, v, causal=c, backend="simt"),
        "tensor cores, highest": lambda q, k, v, c: flashnb.flash_attention(q, k, v, causal=c, backend="tensorcore"),
        "tensor cores, high": lambda q, k, v, c: flashnb.flash_attention(q, k, v, causal=c, backend="tensorcore",
                                                                          precision="high"),
        "Hopper wgmma, highest": lambda q, k, v, c: flashnb.flash_attention(q, k, v, causal=c, backend="wgmma"),
        "Hopper wgmma, high": lambda q, k, v, c: flashnb.flash_attention(q, k, v, causal=c, backend="wgmma",
                                                                          precision="high"),
        "SDPA memory-efficient": lambda q, k, v, c: _sdpa(q, k, v, c),
    }
    if torch.cuda.get_device_capability() != (9, 0):     # (the Hopper forward: compute capability 9.0 only)
        ways = {name: way for name, way in ways.items() if not name.startswith("Hopper")}
    lines = [f"# float32 attention's error against float64 ({torch.cuda.get_device_name()}, "
             f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__})", "",
             "| seqlen | d | causal | way | max err / max abs | mean err / max abs | max err / SIMT's |",
             "|---|---|---|---|---|---|---|"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in (int(x) for x in args.seqlens.split(",")):
        for d in (int(x) for x in args.headdims.split(",")):
            q, k, v = (torch.randn(2, n, 8, d, device="cuda", generator=gen) for _ in range(3))
            for causal in (False, True):
                ref = reference(q, k, v, causal)
                scale = ref.abs().max().item()
                simt = None
                for name, fn in ways.items():
                    err = (fn(q, k, v, causal).double() - ref).abs()
                    mx, mean = err.max().item() / scale, err.mean().item() / scale
                    simt = mx if simt is None else simt
                    lines.append(f"| {n} | {d} | {causal} | {name} | {mx:.2e} | {mean:.2e} | {mx / simt:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def _sdpa(q, k, v, causal):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
