"""Tile sweep for the tensor-core forward or backward on a GPU: check against float64, then time, one table.

    python -m tools.tune_tc [--dtype float16] [--seqlens 4096] [--configs 64=64:64,128:64;128=64:64]
    python -m tools.tune_tc --pass bwd [--configs 64=32:64,64:64;128=16:64;256=32:64:2] [--ablate dq-sync]
    python -m tools.tune_tc --backend wgmma [--configs 64=128:128,128:128:0;128=128:64]
    python -m tools.tune_tc --dtype float32 --backend wgmma --precision high [--configs 64=128:64;128=64:32]
    python -m tools.tune_tc --pass bwd --backend wgmma [--configs 64=32:128;128=32:128]
    python -m tools.tune_tc --pass bwd --dtype float32 --backend wgmma --precision highest [--configs 64=32:128]

``--pass bwd``: the configurations are the backward's (BLOCK_Q, BLOCK_K[, warps per 16 keys: the
head-dim split[, m-tiles of 16 keys per warp[, S^T shared]]]); the forward runs at
its default tiles; the table has the backward's time alone and forward+backward against
SDPA's FlashAttention-2 forward+backward.  ``--backend wgmma``: the Hopper forward, configurations
(BLOCK_Q, BLOCK_K[, tma: 0 = the tiles by cp.async instead of the copy engine]), and SDPA's cuDNN backend
timed beside FlashAttention-2; with ``--pass bwd`` the Hopper dK/dV kernel (``plan.WGMMA_BACKWARD``, and
``WGMMA_BACKWARD_256`` above head dim 128,
configurations (BLOCK_Q, BLOCK_K)).  (Its warpgroup ping-pong,
``make_forward_tc(PINGPONG=)``, and its overlap of P V with the next tile's softmax, ``OVERLAP=``, were measured
here at commits 5f6956e and 4681f5e and removed: docs/notes/hopper.md.)

For each head dim and (BLOCK_Q, BLOCK_K): the forward's error against a float64
PyTorch computation on a small problem, then its time (calls queued between
CUDA events, inputs rotated over four sets: ``tune_simt._time``) at the FlashAttention-2 benchmark shapes
(batch * seqlen = 16k tokens, nheads * headdim = 2048), causal and not, next to
PyTorch SDPA's FlashAttention-2 backend measured in the same run.  Resources
(registers, shared and local memory) of every kernel launched are listed at the
end.  Results feed docs/notes/tensorcore.md.

The kernels' timing-only experiments were measured here and then removed from the kernels: the backward's
ablations with wrong results (``--ablate dq,atomics,grad``, ``make_dkdv_tc(ABLATE=)``, measured at commit
332a623: bench/results/h100-tune-tc-bwd-2026-11-22.md; ``--ablate`` keeps the variants whose results are
correct), the forward's longest-first query tiles (``make_forward_tc(LPT=)``, a 6th ``--configs`` field:
bench/results/h100-tune-tc-2026-11-23.md) and its diagonal tiles masked by 32-bit compares
(``make_forward_tc(MASK32=)``, a 7th field: bench/results/h100-timeline-2026-11-23.md).
"""
import argparse
import functools
import sys

from tools.tune_simt import _check as _check_grads
from tools.tune_simt import _fwd_flops, _resources, _time


def _check(dtype, d, bq, bk, causal, backend="tensorcore", **precision):
    """Max |out - float64| relative to max |float64| at a small shape."""
    import torch
    import flashnb
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 300, 3, d, device="cuda", dtype=dtype) for _ in range(3))
    out = flashnb.flash_attention(q, k, v, causal=causal, block_q=bq, block_k=bk, backend=backend, **precision)
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v)),
                                                           is_causal=causal).transpose(1, 2)
    return float((out.double() - ref).abs().max() / ref.abs().max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--seqlens", default="4096")
    ap.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--backend", choices=("tensorcore", "wgmma"), default="tensorcore")
    ap.add_argument("--precision", choices=("highest", "high"), default="highest",
                    help="--dtype float32: the tensor cores' precision (the baseline: SDPA's memory-efficient "
                         "backend; --backend wgmma switches plan.WGMMA_TF32 on)")
    ap.add_argument("--ablate", default="", help="with --pass bwd: comma list of variants to time besides the "
                    "shipped kernel: scalar-red (dQ by scalar atomics instead of red.global.add.v2.f32), dq-pairs=N "
                    "(dQ in units of 16 x 16N: make_dkdv_tc's DQ_NP), dq-sync (each item's dQ after a second "
                    "barrier of its own: DEFER_DQ=False; without the head-dim split this is the shipped order), "
                    "dq-defer (DEFER_DQ=True; with the head-dim split the shipped order)")
    ap.add_argument("--configs", default="64=64:64;128=64:64",
                    help="bq:bk[:mt[:qs[:fold]]] per head dim (mt: m16 row blocks per warp, default "
                         "plan.tc_m_tiles; qs: 1 = Q fragments from shared memory, default plan.tc_q_in_smem; fold: "
                         "0 = scale applied before the row max, default 1 = folded into exp2 where "
                         "plan.tc_positive_scale allows); with --pass bwd "
                         "bq:bk[:ds[:mtk[:share]]] (ds: warps per 16 keys, default plan.tc_bwd_dim_split; mtk: m-tiles "
                         "of 16 keys per warp, default plan.tc_bwd_key_tiles; share: 1 = S^T, dP^T computed once "
                         "per pair of warps and shared, default plan.tc_bwd_share)")
    args = ap.parse_args(argv)

    import torch
    from tabulate import tabulate
    from flashnb import plan

    dtype = getattr(torch, args.dtype)
    if args.which == "bwd":
        rows = _sweep_bwd(args, dtype)
        base = (f"memory-efficient backend (flashnb: --backend {args.backend} --precision {args.precision})"
                if args.dtype == "float32" else "FlashAttention-2")
        print(f"# {torch.cuda.get_device_name()} dtype={args.dtype}; fb_ratio = SDPA {base} forward+backward "
              "time / flashnb forward+backward time (>1: flashnb faster); bwd_tflops counts 2.5x the forward's flops")
        print(tabulate(rows, headers="keys"))
        _resources()
        return
    saved = plan.tc_m_tiles, plan.tc_q_in_smem, plan.tc_positive_scale, plan.WGMMA_TF32
    plan.WGMMA_TF32 = saved[3] or (args.dtype == "float32" and args.backend == "wgmma")
    try:
        rows = _sweep_fwd(args, dtype, *saved[:3])
    finally:
        plan.tc_m_tiles, plan.tc_q_in_smem, plan.tc_positive_scale, plan.WGMMA_TF32 = saved
        plan.WGMMA_TMA = True
    base = "memory-efficient backend" if args.dtype == "float32" else "FlashAttention-2"
    print(f"# {torch.cuda.get_device_name()} dtype={args.dtype}; ratio = SDPA {base} time / "
          "flashnb time (>1: flashnb faster)")
    print(tabulate(rows, headers="keys"))
    _resources()


def _sweep_fwd(args, dtype, default_mt, default_qs, positive_scale):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import flashnb
    from flashnb import plan
    rows = []
    for part in filter(None, args.configs.split(";")):
        d, pairs = part.split("=")
        d = int(d)
        for cfg in (tuple(map(int, p.split(":"))) for p in pairs.split(",")):
            bq, bk = cfg[:2]
            wg = args.backend == "wgmma"
            mt = 1 if wg else (cfg[2] if len(cfg) > 2 else default_mt(bq, d))
            qs = True if wg else (bool(cfg[3]) if len(cfg) > 3 else default_qs(mt, d))
            fold = bool(cfg[4]) if len(cfg) > 4 and not wg else True
            plan.tc_m_tiles = lambda block_q, headdim, mt=mt: mt          # the variant under test
            plan.tc_q_in_smem = lambda m_tiles, headdim, qs=qs: qs
            plan.tc_positive_scale = lambda scale, fold=fold: fold and positive_scale(scale)
            plan.WGMMA_TMA = bool(cfg[2]) if wg and len(cfg) > 2 else True    # wgmma: the copy engine, or cp.async
            f32 = dtype == torch.float32
            extra = {"precision": args.precision} if f32 else {}
            base_backend = SDPBackend.EFFICIENT_ATTENTION if f32 else SDPBackend.FLASH_ATTENTION
            for causal in (False, True):
                err = _check(dtype, d, bq, bk, causal, args.backend, **extra)
                for n in map(int, args.seqlens.split(",")):
                    b, h = max(1, 16384 // n), 2048 // d
                    sets = [tuple(torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(3))
                            for _ in range(4)]

                    def fwd(q, k, v):
                        return flashnb.flash_attention(q, k, v, causal=causal, block_q=bq, block_k=bk,
                                                       return_lse=True, backend=args.backend, **extra)

                    def sdpa(q, k, v, which=base_backend):
                        with sdpa_kernel(which):
                            return torch.nn.functional.scaled_dot_product_attention(
                                *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)

                    f = _fwd_flops(b, h, n, d, causal)
                    t_f, t_s = _time(fwd, sets), _time(sdpa, sets)
                    row = dict(d=d, tiles=f"{bq}x{bk}", mt=mt, q_smem=int(qs), fold=int(fold), causal=causal, N=n,
                               rel_err=f"{err:.1e}", fwd_ms=round(t_f, 3), tflops=round(f / t_f / 1e9, 1),
                               **{"eff_tflops" if f32 else "fa2_tflops": round(f / t_s / 1e9, 1)},
                               ratio=round(t_s / t_f, 3))
                    if f32:
                        row = {"precision": args.precision, **row}
                    if wg and not f32:
                        row["tma"] = int(plan.WGMMA_TMA)
                        t_c = _time(lambda q, k, v: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION), sets)
                        row = dict(row, cudnn_tflops=round(f / t_c / 1e9, 1),
                                   vs_cudnn=round(t_c / t_f, 3))
                    rows.append(row)
                    print(rows[-1], file=sys.stderr, flush=True)
    return rows


def _variant(make_dkdv_tc, variant, *args, **kw):
    """``make_dkdv_tc`` as the plan calls it (positional, RED2 last), with a variant of --ablate ("": as is)."""
    if variant == "":
        return make_dkdv_tc(*args, **kw)
    if variant == "scalar-red":
        return make_dkdv_tc(*args[:-1], False, **kw)
    if variant.startswith("dq-pairs="):                  # a dQ unit width other than dq_pairs's choice
        return make_dkdv_tc(*args, DQ_NP=int(variant.split("=")[1]), **kw)
    if variant == "dq-defer":                            # B9's deferred dQ without the head-dim split too
        return make_dkdv_tc(*args, DEFER_DQ=True, **kw)
    if variant == "dq-sync":                             # B8's order: dQ after a barrier of its own
        return make_dkdv_tc(*args, DEFER_DQ=False, **kw)
    raise SystemExit(f"unknown --ablate variant {variant!r}")


def _sweep_bwd(args, dtype):
    from flashnb import plan
    make_dkdv_tc = plan.make_dkdv_tc
    dim_split, key_tiles, share = plan.tc_bwd_dim_split, plan.tc_bwd_key_tiles, plan.tc_bwd_share
    rows = []
    enabled = plan.WGMMA_BACKWARD, plan.WGMMA_BACKWARD_256
    plan.WGMMA_BACKWARD = plan.WGMMA_BACKWARD_256 = args.backend == "wgmma"   # (above head dim 128 too)
    try:
        _sweep_bwd_configs(args, dtype, rows, make_dkdv_tc)
    finally:
        plan.WGMMA_BACKWARD, plan.WGMMA_BACKWARD_256 = enabled
        plan.make_dkdv_tc = make_dkdv_tc
        plan.tc_bwd_dim_split, plan.tc_bwd_key_tiles, plan.tc_bwd_share = dim_split, key_tiles, share
    return rows


def _sweep_bwd_configs(args, dtype, rows, make_dkdv_tc):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import flashnb
    from flashnb import plan
    default_split, default_mtk, default_share = plan.tc_bwd_dim_split, plan.tc_bwd_key_tiles, plan.tc_bwd_share
    backend = args.backend                       # "wgmma": the Hopper dK/dV kernel (plan.WGMMA_BACKWARD)
    # float32: forward and backward at --precision on --backend (the tf32 dK/dV kernel is the tensor-core one
    # either way), against SDPA's memory-efficient backend (its FlashAttention-2 backend takes 16-bit only)
    f32 = dtype == torch.float32
    prec = {"precision": args.precision} if f32 else {}
    fwd = {"backend": backend, **prec} if f32 else {}
    baseline = SDPBackend.EFFICIENT_ATTENTION if f32 else SDPBackend.FLASH_ATTENTION
    for part in filter(None, args.configs.split(";")):
        d, pairs = part.split("=")
        d = int(d)
        for cfg in (tuple(map(int, p.split(":"))) for p in pairs.split(",")):
            bq, bk = cfg[:2]
            # the plan's choices (each consults the others) for what the configuration leaves out
            plan.tc_bwd_dim_split, plan.tc_bwd_key_tiles, plan.tc_bwd_share = default_split, default_mtk, default_share
            ds = cfg[2] if len(cfg) > 2 else default_split(bq, bk, d)
            mtk = 1 if f32 else cfg[3] if len(cfg) > 3 else default_mtk(bq, bk, d)   # (float32: always one)
            sh = bool(cfg[4]) if len(cfg) > 4 else default_share(bq, bk, d) and ds == 2
            plan.tc_bwd_dim_split = lambda block_q, block_k, headdim, ds=ds: ds   # the variant under test
            plan.tc_bwd_key_tiles = lambda block_q, block_k, headdim, mtk=mtk: mtk
            plan.tc_bwd_share = lambda block_q, block_k, headdim, sh=sh: sh
            variants = [""] + list(filter(None, args.ablate.split(",")))
            for causal, variant in ((c, a) for a in variants for c in (False, True)):
                plan.make_dkdv_tc = functools.partial(_variant, make_dkdv_tc, variant)
                err = _check_grads(dtype, d, bq, bk, causal, backend=backend, fwd_tiles=False, **prec)
                for n in map(int, args.seqlens.split(",")):
                    b, h = max(1, 16384 // n), 2048 // d
                    sets = [tuple(torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(4))
                            for _ in range(4)]
                    saved = [flashnb.flash_attention(*s[:3], causal=causal, return_lse=True, **fwd) for s in sets]

                    def bwd(q, k, v, do):
                        out, lse = next(o for s, o in zip(sets, saved) if s[0] is q)
                        return flashnb.flash_attention_backward(do, q, k, v, out, lse, causal=causal, block_q=bq,
                                                                block_k=bk, backend=backend, **prec)

                    def fwdbwd(q, k, v, do):
                        out, lse = flashnb.flash_attention(q, k, v, causal=causal, return_lse=True, **fwd)
                        return flashnb.flash_attention_backward(do, q, k, v, out, lse, causal=causal, block_q=bq,
                                                                block_k=bk, backend=backend, **prec)

                    def sdpa(q, k, v, do):
                        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                        with sdpa_kernel(baseline):
                            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).backward(
                                do.transpose(1, 2))

                    f = _fwd_flops(b, h, n, d, causal)
                    t_b, t_fb, t_s = _time(bwd, sets, reps=10), _time(fwdbwd, sets, reps=10), _time(sdpa, sets, reps=10)
                    rows.append(dict(d=d, backend=backend, tiles=f"{bq}x{bk}", split=ds, mtk=mtk, share=int(sh), ablate=variant or "-",
                                     causal=causal, N=n, rel_err=f"{err:.1e}",
                                     bwd_ms=round(t_b, 3), bwd_tflops=round(2.5 * f / t_b / 1e9, 1),
                                     fb_ms=round(t_fb, 3), fb_tflops=round(3.5 * f / t_fb / 1e9, 1),
                                     **{"eff_fb_tflops" if f32 else "fa2_fb_tflops": round(3.5 * f / t_s / 1e9, 1)},
                                     fb_ratio=round(t_s / t_fb, 3)))
                    print(rows[-1], file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
