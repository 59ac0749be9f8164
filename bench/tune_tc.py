"""Tile sweep for the tensor-core forward on a GPU: check against float64, then time, one table.

    python -m bench.tune_tc [--dtype float16] [--seqlens 4096] [--configs 64=64:64,128:64;128=64:64]

For each head dim and (BLOCK_Q, BLOCK_K): the forward's error against a float64
PyTorch computation on a small problem, then its time (median of CUDA-event
timings, inputs rotated over four sets) at the FlashAttention-2 benchmark shapes
(batch * seqlen = 16k tokens, nheads * headdim = 2048), causal and not, next to
PyTorch SDPA's FlashAttention-2 backend measured in the same run.  Resources
(registers, shared and local memory) of every kernel launched are listed at the
end.  Results feed docs/tensorcore.md.
"""
import argparse
import sys

from bench.tune_simt import _fwd_flops, _resources, _time


def _check(dtype, d, bq, bk, causal):
    """Max |out - float64| relative to max |float64| at a small shape."""
    import torch
    import flashnb
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 300, 3, d, device="cuda", dtype=dtype) for _ in range(3))
    out = flashnb.flash_attention(q, k, v, causal=causal, block_q=bq, block_k=bk, backend="tensorcore")
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v)),
                                                           is_causal=causal).transpose(1, 2)
    return float((out.double() - ref).abs().max() / ref.abs().max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--seqlens", default="4096")
    ap.add_argument("--configs", default="64=64:64;128=64:64",
                    help="bq:bk[:mt[:qs]] per head dim (mt: m16 row blocks per warp, default api.tc_m_tiles; "
                         "qs: 1 = Q fragments from shared memory, default api.tc_q_in_smem)")
    args = ap.parse_args(argv)

    import torch
    from tabulate import tabulate
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import flashnb

    dtype = getattr(torch, args.dtype)
    default_mt, default_qs = flashnb.api.tc_m_tiles, flashnb.api.tc_q_in_smem
    rows = []
    for part in filter(None, args.configs.split(";")):
        d, pairs = part.split("=")
        d = int(d)
        for cfg in (tuple(map(int, p.split(":"))) for p in pairs.split(",")):
            bq, bk = cfg[:2]
            mt = cfg[2] if len(cfg) > 2 else default_mt(bq, d)
            qs = bool(cfg[3]) if len(cfg) > 3 else default_qs(mt, d)
            flashnb.api.tc_m_tiles = lambda block_q, headdim, mt=mt: mt          # the variant under test
            flashnb.api.tc_q_in_smem = lambda m_tiles, headdim, qs=qs: qs
            for causal in (False, True):
                err = _check(dtype, d, bq, bk, causal)
                for n in map(int, args.seqlens.split(",")):
                    b, h = max(1, 16384 // n), 2048 // d
                    sets = [tuple(torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(3))
                            for _ in range(4)]

                    def fwd(q, k, v):
                        return flashnb.flash_attention(q, k, v, causal=causal, block_q=bq, block_k=bk,
                                                       return_lse=True, backend="tensorcore")

                    def sdpa(q, k, v):
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return torch.nn.functional.scaled_dot_product_attention(
                                *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)

                    f = _fwd_flops(b, h, n, d, causal)
                    t_f, t_s = _time(fwd, sets), _time(sdpa, sets)
                    rows.append(dict(d=d, tiles=f"{bq}x{bk}", mt=mt, q_smem=int(qs), causal=causal, N=n, rel_err=f"{err:.1e}",
                                     fwd_ms=round(t_f, 3), tflops=round(f / t_f / 1e9, 1),
                                     fa2_tflops=round(f / t_s / 1e9, 1), ratio=round(t_s / t_f, 3)))
                    print(rows[-1], file=sys.stderr, flush=True)
    print(f"# {torch.cuda.get_device_name()} dtype={args.dtype}; ratio = SDPA FlashAttention-2 time / "
          "flashnb time (>1: flashnb faster)")
    print(tabulate(rows, headers="keys"))
    _resources()


if __name__ == "__main__":
    main()
