"""One forward and one backward at the FlashAttention-2 benchmark shape, twice: a target for Nsight Compute.

    ncu --kernel-name regex:"flash_forward|flash_dkdv" --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python -m bench.profile_simt 64

(the first call of each kernel compiles it; the profiled launches are the second ones).
The profiles in docs/performance.md were taken this way.
"""
import sys


def main(headdim=64):
    import torch
    import flashnb
    batch, seqlen, nheads = 4, 4096, 2048 // headdim
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, headdim, device="cuda") for _ in range(4))
    for _ in range(2):
        out, lse = flashnb.flash_attention(q, k, v, return_lse=True)
        flashnb.flash_attention_backward(dout, q, k, v, out, lse)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
