"""Tile sweep for the tensor-core forward or backward on a GPU: check against float64, then time, one table.

    python -m bench.tune_tc [--dtype float16] [--seqlens 4096] [--configs 64=64:64,128:64;128=64:64]
    python -m bench.tune_tc --pass bwd [--configs 64=32:64,64:64;128=16:64;256=32:64:2]

``--pass bwd``: the configurations are the backward's (BLOCK_Q, BLOCK_K[, warps per 16 keys: the
head-dim split[, m-tiles of 16 keys per warp[, S^T shared]]]); the forward runs at
its default tiles; the table has the backward's time alone and forward+backward against
SDPA's FlashAttention-2 forward+backward.

For each head dim and (BLOCK_Q, BLOCK_K): the forward's error against a float64
PyTorch computation on a small problem, then its time (calls queued between
CUDA events, inputs rotated over four sets: ``tune_simt._time``) at the FlashAttention-2 benchmark shapes
(batch * seqlen = 16k tokens, nheads * headdim = 2048), causal and not, next to
PyTorch SDPA's FlashAttention-2 backend measured in the same run.  Resources
(registers, shared and local memory) of every kernel launched are listed at the
end.  Results feed docs/tensorcore.md.
"""
import argparse
import functools
import sys

from bench.tune_simt import _check as _check_grads
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
    ap.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--ablate", default="", help="with --pass bwd: comma list of variants to time besides the "
                    "shipped kernel: backward_tc.make_dkdv_tc ABLATE values (dq, atomics, grad; their results are "
                    "wrong), scalar-red (dQ by scalar atomics instead of red.global.add.v2.f32) and dq-pairs=N "
                    "(dQ in units of 16 x 16N: make_dkdv_tc's DQ_NP, results correct), dq-sync (each item's dQ after a "
                    "second barrier of its own: DEFER_DQ=False, results correct; without the head-dim split this "
                    "is the shipped order), dq-defer (DEFER_DQ=True: results correct; with the head-dim split the "
                    "shipped order)")
    ap.add_argument("--configs", default="64=64:64;128=64:64",
                    help="bq:bk[:mt[:qs[:fold[:lpt[:mask32]]]]] per head dim (mt: m16 row blocks per warp, default "
                         "api.tc_m_tiles; qs: 1 = Q fragments from shared memory, default api.tc_q_in_smem; fold: "
                         "0 = scale applied before the row max, default 1 = folded into exp2 where "
                         "api.tc_positive_scale allows; lpt: 1 = query tiles last first, default "
                         "api.tc_longest_first; mask32: 1 = diagonal tiles masked by 32-bit compares, default "
                         "api.tc_mask32); with --pass bwd "
                         "bq:bk[:ds[:mtk[:share]]] (ds: warps per 16 keys, default api.tc_bwd_dim_split; mtk: m-tiles "
                         "of 16 keys per warp, default api.tc_bwd_key_tiles; share: 1 = S^T, dP^T computed once "
                         "per pair of warps and shared, default api.tc_bwd_share)")
    args = ap.parse_args(argv)

    import torch
    from tabulate import tabulate
    import flashnb

    dtype = getattr(torch, args.dtype)
    if args.which == "bwd":
        rows = _sweep_bwd(args, dtype)
        print(f"# {torch.cuda.get_device_name()} dtype={args.dtype}; fb_ratio = SDPA FlashAttention-2 forward+backward "
              "time / flashnb forward+backward time (>1: flashnb faster); bwd_tflops counts 2.5x the forward's flops")
        print(tabulate(rows, headers="keys"))
        _resources()
        return
    api = flashnb.api
    saved = api.tc_m_tiles, api.tc_q_in_smem, api.tc_positive_scale, api.tc_longest_first, api.tc_mask32
    try:
        rows = _sweep_fwd(args, dtype, *saved)
    finally:
        api.tc_m_tiles, api.tc_q_in_smem, api.tc_positive_scale, api.tc_longest_first, api.tc_mask32 = saved
    print(f"# {torch.cuda.get_device_name()} dtype={args.dtype}; ratio = SDPA FlashAttention-2 time / "
          "flashnb time (>1: flashnb faster)")
    print(tabulate(rows, headers="keys"))
    _resources()


def _sweep_fwd(args, dtype, default_mt, default_qs, positive_scale, default_lpt, default_mask32):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import flashnb
    rows = []
    for part in filter(None, args.configs.split(";")):
        d, pairs = part.split("=")
        d = int(d)
        for cfg in (tuple(map(int, p.split(":"))) for p in pairs.split(",")):
            bq, bk = cfg[:2]
            mt = cfg[2] if len(cfg) > 2 else default_mt(bq, d)
            qs = bool(cfg[3]) if len(cfg) > 3 else default_qs(mt, d)
            fold = bool(cfg[4]) if len(cfg) > 4 else True
            lpt = bool(cfg[5]) if len(cfg) > 5 else None
            mask32 = bool(cfg[6]) if len(cfg) > 6 else None
            flashnb.api.tc_longest_first = (default_lpt if lpt is None else lambda has_window, lpt=lpt: lpt)
            flashnb.api.tc_mask32 = (default_mask32 if mask32 is None else lambda has_window, m=mask32: m)
            flashnb.api.tc_m_tiles = lambda block_q, headdim, mt=mt: mt          # the variant under test
            flashnb.api.tc_q_in_smem = lambda m_tiles, headdim, qs=qs: qs
            flashnb.api.tc_positive_scale = lambda scale, fold=fold: fold and positive_scale(scale)
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
                    rows.append(dict(d=d, tiles=f"{bq}x{bk}", mt=mt, q_smem=int(qs), fold=int(fold),
                                     lpt=int(flashnb.api.tc_longest_first(causal)),
                                     mask32=int(flashnb.api.tc_mask32(causal)),
                                     causal=causal, N=n, rel_err=f"{err:.1e}",
                                     fwd_ms=round(t_f, 3), tflops=round(f / t_f / 1e9, 1),
                                     fa2_tflops=round(f / t_s / 1e9, 1), ratio=round(t_s / t_f, 3)))
                    print(rows[-1], file=sys.stderr, flush=True)
    return rows


def _variant(make_dkdv_tc, ablate, *args, **kw):
    """``make_dkdv_tc`` as api calls it (positional, RED2 last), with a variant of --ablate."""
    if ablate == "scalar-red":
        return make_dkdv_tc(*args[:-1], False, **kw)
    if ablate.startswith("dq-pairs="):                   # a dQ unit width other than dq_pairs's choice
        return make_dkdv_tc(*args, DQ_NP=int(ablate.split("=")[1]), **kw)
    if ablate == "dq-defer":                             # B9's deferred dQ without the head-dim split too
        return make_dkdv_tc(*args, DEFER_DQ=True, **kw)
    if ablate == "dq-sync":                              # B8's order: dQ after a barrier of its own
        return make_dkdv_tc(*args, DEFER_DQ=False, **kw)
    return make_dkdv_tc(*args, ABLATE=ablate, **kw)


def _sweep_bwd(args, dtype):
    import flashnb
    from flashnb.kernels.backward_tc import make_dkdv_tc
    dim_split, key_tiles, share = flashnb.api.tc_bwd_dim_split, flashnb.api.tc_bwd_key_tiles, flashnb.api.tc_bwd_share
    rows = []
    try:
        _sweep_bwd_configs(args, dtype, rows, make_dkdv_tc)
    finally:
        flashnb.api.make_dkdv_tc = make_dkdv_tc
        flashnb.api.tc_bwd_dim_split, flashnb.api.tc_bwd_key_tiles = dim_split, key_tiles
        flashnb.api.tc_bwd_share = share
    return rows


def _sweep_bwd_configs(args, dtype, rows, make_dkdv_tc):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import flashnb
    default_split, default_mtk, default_share = (flashnb.api.tc_bwd_dim_split, flashnb.api.tc_bwd_key_tiles,
                                                 flashnb.api.tc_bwd_share)
    for part in filter(None, args.configs.split(";")):
        d, pairs = part.split("=")
        d = int(d)
        for cfg in (tuple(map(int, p.split(":"))) for p in pairs.split(",")):
            bq, bk = cfg[:2]
            # the api's choices (each consults the others) for what the configuration leaves out
            flashnb.api.tc_bwd_dim_split, flashnb.api.tc_bwd_key_tiles, flashnb.api.tc_bwd_share = (
                default_split, default_mtk, default_share)
            ds = cfg[2] if len(cfg) > 2 else default_split(bq, bk, d)
            mtk = cfg[3] if len(cfg) > 3 else default_mtk(bq, bk, d)
            sh = bool(cfg[4]) if len(cfg) > 4 else default_share(bq, bk, d) and ds == 2
            flashnb.api.tc_bwd_dim_split = lambda block_q, block_k, headdim, ds=ds: ds   # the variant under test
            flashnb.api.tc_bwd_key_tiles = lambda block_q, block_k, headdim, mtk=mtk: mtk
            flashnb.api.tc_bwd_share = lambda block_q, block_k, headdim, sh=sh: sh
            for causal, ablate in ((c, a) for a in [""] + list(filter(None, args.ablate.split(","))) for c in (False, True)):
                flashnb.api.make_dkdv_tc = functools.partial(_variant, make_dkdv_tc, ablate)
                err = _check_grads(dtype, d, bq, bk, causal, backend="tensorcore", fwd_tiles=False)
                for n in map(int, args.seqlens.split(",")):
                    b, h = max(1, 16384 // n), 2048 // d
                    sets = [tuple(torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(4))
                            for _ in range(4)]
                    saved = [flashnb.flash_attention(*s[:3], causal=causal, return_lse=True) for s in sets]

                    def bwd(q, k, v, do):
                        out, lse = next(o for s, o in zip(sets, saved) if s[0] is q)
                        return flashnb.flash_attention_backward(do, q, k, v, out, lse, causal=causal, block_q=bq,
                                                                block_k=bk, backend="tensorcore")

                    def fwdbwd(q, k, v, do):
                        out, lse = flashnb.flash_attention(q, k, v, causal=causal, return_lse=True)
                        return flashnb.flash_attention_backward(do, q, k, v, out, lse, causal=causal, block_q=bq,
                                                                block_k=bk, backend="tensorcore")

                    def sdpa(q, k, v, do):
                        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).backward(
                                do.transpose(1, 2))

                    f = _fwd_flops(b, h, n, d, causal)
                    t_b, t_fb, t_s = _time(bwd, sets, reps=10), _time(fwdbwd, sets, reps=10), _time(sdpa, sets, reps=10)
                    rows.append(dict(d=d, tiles=f"{bq}x{bk}", split=ds, mtk=mtk, share=int(sh), ablate=ablate or "-", causal=causal, N=n,
                                     rel_err=f"{err:.1e}",
                                     bwd_ms=round(t_b, 3), bwd_tflops=round(2.5 * f / t_b / 1e9, 1),
                                     fb_ms=round(t_fb, 3), fb_tflops=round(3.5 * f / t_fb / 1e9, 1),
                                     fa2_fb_tflops=round(3.5 * f / t_s / 1e9, 1), fb_ratio=round(t_s / t_fb, 3)))
                    print(rows[-1], file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
