"""Tile sweep for the SIMT kernels on a GPU: check against float64, then time, one table.

    python -m tools.tune_simt [--dtype float32] [--seqlens 1024,4096] [--headdims 64,128]

For each head dim and tile configuration: correctness of forward and backward
against a float64 PyTorch computation on a small problem, then the forward and
forward+backward time (calls queued between CUDA events, inputs rotated over
four sets: ``_time``) at the FlashAttention-2 benchmark shapes (batch * seqlen = 16k tokens,
nheads * headdim = 2048), next to PyTorch SDPA's memory-efficient backend
measured in the same run.  Resource usage (registers, shared memory, local
memory) comes from the compiled kernels.  Results feed docs/performance.md.
"""
import argparse
import math
import statistics
import sys

import numpy as np


def _fwd_flops(b, h, n, d, causal):
    return 4 * b * h * n * n * d / (2 if causal else 1)


def _time(fn, sets, reps=20, rounds=3):
    """ms per call: ``reps`` calls queued between two CUDA events, inputs rotated over ``sets``; the
    median of ``rounds`` such rounds.  Queued, a call's host-side work overlaps the GPU work of the
    calls before it (as in a training loop), so where the GPU time per call exceeds the host's this is
    the GPU's time (``python -m tools.profile_target --host`` measures the host's)."""
    import torch
    for s in sets[:2]:
        fn(*s)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for r in range(reps):
            fn(*sets[r % len(sets)])
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def _check(dtype, d, bq, bk, causal, backend="auto", fwd_tiles=True, **precision):
    """Max error of out and grads against float64 at a small shape (relative to each one's max).

    ``fwd_tiles``: the forward runs at (bq, bk) too (else at its default tiles); ``precision``: float32's on the
    tensor cores, forward and backward."""
    import torch
    import flashnb
    torch.manual_seed(0)
    B, S, H = 2, 300, 3
    q, k, v, do = (torch.randn(B, S, H, d, device="cuda", dtype=dtype) for _ in range(4))
    tiles = dict(block_q=bq, block_k=bk) if fwd_tiles else {}
    out, lse = flashnb.flash_attention(q, k, v, causal=causal, return_lse=True, backend=backend, **tiles,
                                       **precision)
    dq, dk, dv = flashnb.flash_attention_backward(do, q, k, v, out, lse, causal=causal, block_q=bq, block_k=bk,
                                                  backend=backend, **precision)
    q64, k64, v64 = (x.double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    ref.backward(do.double().transpose(1, 2))
    errs = []
    for mine, theirs in ((out, ref), (dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        theirs = theirs.transpose(1, 2)
        errs.append(float((mine.double() - theirs).abs().max() / theirs.abs().max()))
    return max(errs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--configs", default="", help="bq:bk pairs per head dim, e.g. 64=64:64,64:32;128=64:32")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--threads", default="16x16",
                    help="thread layouts to try, ROWSxCOLS (rows own micro-tile rows, cols are the lanes of a row)")
    args = ap.parse_args(argv)

    import torch
    from tabulate import tabulate
    import flashnb
    from flashnb.plan import default_tiles

    dtype = getattr(torch, args.dtype)
    configs = {}
    for part in filter(None, args.configs.split(";")):
        d, pairs = part.split("=")
        configs[int(d)] = [tuple(map(int, p.split(":"))) for p in pairs.split(",")]
    rows = []
    for threads in args.threads.split(","):
        _set_threads(threads)
        rows += _sweep(args, configs, dtype, threads)
    print(f"# {torch.cuda.get_device_name()} dtype={args.dtype} causal={args.causal}; "
          f"ratio = SDPA memory-efficient time / flashnb time (>1: flashnb faster)")
    print(tabulate(rows, headers="keys"))
    _resources()


def _set_threads(threads):
    """Variant: ``ROWSxCOLS`` threads per tile side (``forward.MAX_THREADS``). Rebuilds the kernels."""
    from flashnb.kernels import backward, forward
    rows, cols = map(int, threads.split("x"))
    forward.MAX_THREADS.update(rows=rows, cols=cols)
    from flashnb import plan
    for f in (forward.make_forward, forward.make_window_helpers, backward.make_dkdv, backward.make_dq,
              plan._default_simt_tiles):            # the default tiles' shared-memory fit depends on the threads
        f.cache_clear()


def _sweep(args, configs, dtype, threads):
    import torch
    import flashnb
    from flashnb.plan import default_tiles
    rows = []
    for d in map(int, args.headdims.split(",")):
        acc = "float64" if args.dtype == "float64" else "float32"
        for bq, bk in configs.get(d, [default_tiles(d, acc)]):
            err = _check(dtype, d, bq, bk, args.causal, backend="simt")
            for n in map(int, args.seqlens.split(",")):
                b, h = max(1, 16384 // n), 2048 // d
                sets = [tuple(torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(4))
                        for _ in range(4)]
                f = _fwd_flops(b, h, n, d, args.causal)

                def fwd(q, k, v, do):
                    return flashnb.flash_attention(q, k, v, causal=args.causal, block_q=bq, block_k=bk,
                                                   return_lse=True, backend="simt")

                def fwdbwd(q, k, v, do):
                    out, lse = fwd(q, k, v, do)
                    return flashnb.flash_attention_backward(do, q, k, v, out, lse, causal=args.causal,
                                                            block_q=bq, block_k=bk, backend="simt")

                def sdpa(q, k, v, do, grad=False):
                    from torch.nn.attention import SDPBackend, sdpa_kernel
                    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                    if grad:
                        qt, kt, vt = (x.detach().requires_grad_() for x in (qt, kt, vt))
                    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
                        if grad:
                            o.backward(do.transpose(1, 2))
                    return o

                t_f = _time(fwd, sets)
                t_s = _time(sdpa, sets)
                row = dict(d=d, tiles=f"{bq}x{bk}", thr=threads, N=n, B=b, H=h, rel_err=f"{err:.1e}",
                           fwd_ms=round(t_f, 3), fwd_tflops=round(f / t_f / 1e9, 1),
                           eff_fwd_tflops=round(f / t_s / 1e9, 1), fwd_ratio=round(t_s / t_f, 3))
                if not args.no_bwd:
                    t_fb = _time(fwdbwd, sets, reps=10)
                    t_sb = _time(lambda *s: sdpa(*s, grad=True), sets, reps=10)
                    row.update(fb_ms=round(t_fb, 3), fb_tflops=round(3.5 * f / t_fb / 1e9, 1),
                               eff_fb_tflops=round(3.5 * f / t_sb / 1e9, 1), fb_ratio=round(t_sb / t_fb, 3))
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
    return rows


def _resources():
    """Registers / shared / local memory of every kernel specialisation launched in this run."""
    from tabulate import tabulate
    from flashnb.kernels._jit import LAUNCHED, numba_overloads
    rows = []
    for kern, threads, shared in LAUNCHED.values():
        overloads = numba_overloads(kern)      # compiles the specialisations loaded from the disk cache
        for sig in overloads:
            rows.append(dict(kernel=kern.py_func.__name__, threads=threads, dyn_shared=shared,
                             regs=overloads[sig].regs_per_thread, local=overloads[sig].local_mem_per_thread,
                             dtype=str(sig[0].dtype)))
    print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    main()
