"""float32 attention's backward error against float64, for each way of computing it (issue 24's rule for the backward).

    python -m tools.tf32_bwd_error [--seqlens 1024,4096] [--headdims 64,128] [--out FILE.md]

For each shape (batch 2, 8 heads, float32 inputs drawn N(0, 1)), causal and not: dq, dk, dv of flashnb's SIMT
backward (float32 on the CUDA cores: the yardstick), of flashnb's tensor-core backward with ``precision="highest"``
(3xTF32) and ``"high"`` (one tf32 product), all from the SIMT forward's ``out`` and ``lse``, and of PyTorch SDPA's
memory-efficient backend (its own forward); each against autograd in float64 (PyTorch, materialised), as the
largest absolute error of each gradient over its largest magnitude, and the ratio to the SIMT backward's (the rule:
"highest" at most 2). Needs a GPU and PyTorch.
"""
import argparse
import time


def reference_grads(q, k, v, dout, causal):
    """dq, dk, dv of attention in float64 (materialised), in (batch, seqlen, heads, d)."""
    from tools.tf32_error import probabilities
    qd, kd, vd = (x.double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    out = probabilities(qd, kd, causal) @ vd
    out.backward(dout.double().transpose(1, 2))
    return tuple(x.grad.transpose(1, 2) for x in (qd, kd, vd))


def _sdpa_grads(q, k, v, dout, causal):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    out.backward(dout.transpose(1, 2))
    return tuple(x.grad.transpose(1, 2) for x in (qt, kt, vt))


def main(argv=None):
    import torch
    import flashnb

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    def flashnb_grads(**kw):
        def grads(q, k, v, dout, causal):
            out, lse = flashnb.flash_attention(q, k, v, causal=causal, backend="simt", return_lse=True)
            return flashnb.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, **kw)
        return grads

    ways = {
        "SIMT float32": flashnb_grads(backend="simt"),
        "tensor cores, highest": flashnb_grads(backend="tensorcore", precision="highest"),
        "tensor cores, high": flashnb_grads(backend="tensorcore", precision="high"),
        "SDPA memory-efficient": _sdpa_grads,
    }
    lines = [f"# float32 attention's backward error against float64 ({torch.cuda.get_device_name()}, "
             f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__})", "",
             "largest |error| over the largest |gradient|, and its ratio to the SIMT backward's", "",
             "| seqlen | d | causal | way | dq | dk | dv | dq / SIMT | dk / SIMT | dv / SIMT |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in (int(x) for x in args.seqlens.split(",")):
        for d in (int(x) for x in args.headdims.split(",")):
            q, k, v, dout = (torch.randn(2, n, 8, d, device="cuda", generator=gen) for _ in range(4))
            for causal in (False, True):
                refs = reference_grads(q, k, v, dout, causal)
                simt = None
                for name, fn in ways.items():
                    errs = [((torch.as_tensor(g).double() - r).abs().max() / r.abs().max()).item()
                            for g, r in zip(fn(q, k, v, dout, causal), refs)]
                    simt = errs if simt is None else simt
                    lines.append(f"| {n} | {d} | {causal} | {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " | "
                                 + " | ".join(f"{e / s:.2f}" for e, s in zip(errs, simt)) + " |")
                del refs
                torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
