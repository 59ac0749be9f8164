"""What FP8 attention costs in accuracy, from the oracle (no GPU): ``python -m tools.fp8_error``.

For each input distribution, the error of the FP8 forward's output (``reference.fp8.fp8_flash_forward``: e4m3
inputs with descaling factors, P quantised to e4m3; the kernel computes it within float16's rounding, see
tests/kernels/test_kernel_fp8.py) against float64 attention of the unquantised inputs, beside the error of exact
attention of float16-rounded inputs with a float16 output (what a 16-bit kernel at best gives).  Descales per
tensor or per head (amax / 448); ``incoherent``: Q and K both multiplied by one random orthogonal matrix (a
Hadamard matrix with random signs, FA3's incoherent processing; Q K^T is unchanged) before quantising, which
spreads an outlier channel over all of them.  Errors are max |err| / max |out| and mean |err| / mean |out|.
"""
import argparse

import numpy as np

from reference import attention
from reference.fp8 import fp8_flash_forward

import flashnb


def data(kind, rng, b, sq, sk, h, d):
    q, k, v = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, h, d)), rng.standard_normal((b, sk, h, d))
    if kind == "outlier channels":            # a few channels of Q and K 20x the rest (LLM activations' pattern)
        q[..., :4] *= 20
        k[..., :4] *= 20
    elif kind == "heavy tails":               # Student-t with 3 degrees of freedom
        q, k, v = (rng.standard_t(3, x.shape) for x in (q, k, v))
    elif kind == "peaked softmax":            # scores with a large spread: near one-hot rows
        q *= 4
    return q, k, v


def errors(got, want):
    e = np.abs(got - want)
    return e.max() / np.abs(want).max(), e.mean() / np.abs(want).mean()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen-q", type=int, default=128)
    ap.add_argument("--seqlen-k", type=int, default=1024)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"seqlen_q {a.seqlen_q}, seqlen_k {a.seqlen_k}, head dim {a.headdim}, {a.heads} heads, causal {a.causal}")
    print("| inputs | float16 inputs and output: max / mean | FP8, per tensor | FP8, per head | FP8, per head, incoherent |")
    print("|---|---|---|---|---|")
    for kind in ("normal", "outlier channels", "heavy tails", "peaked softmax"):
        q, k, v = data(kind, rng, 1, a.seqlen_q, a.seqlen_k, a.heads, a.headdim)
        want, _ = attention(q, k, v, causal=a.causal)
        h16 = [x.astype(np.float16).astype(np.float64) for x in (q, k, v)]
        f16 = attention(*h16, causal=a.causal)[0].astype(np.float16).astype(np.float64)
        cells = ["%.2e / %.2e" % errors(f16, want)]
        rot = flashnb.hadamard_rotation(a.headdim, seed=0)
        for per_head, incoherent in ((False, False), (True, False), (True, True)):
            r = rot if incoherent else None
            per = "head" if per_head else "tensor"
            (q8, qd), (k8, kd), (v8, vd) = (flashnb.quantize_fp8(x, per, rotation) for x, rotation in
                                            ((q, r), (k, r), (v, None)))
            out, _ = fp8_flash_forward(q8, k8, v8, qd, kd, vd, block_k=128, causal=a.causal)
            cells.append("%.2e / %.2e" % errors(out, want))
        print(f"| {kind} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
