"""One forward and one backward at the FlashAttention-2 benchmark shape, twice: a target for Nsight Compute.

    python -m tools.profile_target [HEADDIM] [--dtype float32|float16|bfloat16] [--impl flashnb|sdpa-flash|sdpa-cudnn]
                                   [--causal]

For example, flashnb's kernels (SIMT at float32, tensor cores at 16 bits) and then FA2's:

    ncu --clock-control none --kernel-name regex:"flash_forward|flash_dkdv|flash_fwd|flash_bwd" \\
        --launch-skip 2 --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python -m tools.profile_target 64 --dtype float16
    ncu ... python -m tools.profile_target 64 --dtype float16 --impl sdpa-flash

(the first call of each kernel compiles it; the profiled launches are the second ones; ``--launch-skip``
counts launches of matching kernels only).  batch * seqlen = 16k tokens, nheads * headdim = 2048, seqlen 4096.
The second forward and backward run between ``cudaProfilerStart`` and ``cudaProfilerStop``, so
``ncu --profile-from-start off`` takes every kernel of that one step whatever its name (cuDNN's kernels are
named by their generator):

    ncu --profile-from-start off --section ... python -m tools.profile_target 128 --dtype float16 --impl sdpa-cudnn
The profiles in docs/performance.md and docs/notes/tensorcore.md were taken this way.

    python -m tools.profile_target --decode dense|paged|pages-in-order [--seqlen 32768] [--impl sdpa-flash] [--host]

profiles ``bench.decode``'s shape instead (batch 16, one query token, 32 query heads over 8 KV heads, head dim 128,
float16, ``--seqlen`` cached keys): one ``flash_attn_with_kvcache`` call on the dense cache, the paged copy (pages
in random order) or the dense cache's memory read as pages in order, twice (``-k regex:"^decode"``); with
``--impl sdpa-flash`` SDPA's FlashAttention-2 call of the bench (``-k regex:flash_fwd_splitkv``); with ``--host``
the host side of the call, as below.

    python -m tools.profile_target 64 --dtype float16 --host

times the host side of a call instead, on a problem so small (256 heads of 128 queries) that the GPU
waits for the host: the median time of one call with the GPU idle before it (synchronised), the
time per call of a loop of calls with no synchronisation inside it, then Python's profile of those
calls (the functions with the most own time).
"""
import argparse
import cProfile
import pstats
import time


def decode_call(args):
    """``bench.decode``'s call at ``args.seqlen`` cached keys on the cache ``args.decode`` names (or SDPA's)."""
    import torch
    import flashnb
    from bench import decode
    from tools.tune_decode import in_order
    g = torch.Generator(device="cuda")
    x = decode.inputs(torch, g, args.seqlen)
    kpo, vpo, table_o = in_order(torch, x.kc, x.vc)
    k, v, t = {"dense": (x.kc, x.vc, None), "paged": (x.kp, x.vp, x.table),
               "pages-in-order": (kpo, vpo, table_o)}[args.decode]
    if args.impl == "flashnb":
        return lambda: flashnb.flash_attn_with_kvcache(x.q, k, v, cache_seqlens=args.seqlen, block_table=t)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(x.q_packed, x.k_sdpa, x.v_sdpa)
    return sdpa


def host_cost(args):
    """Wall time per call with the GPU waiting for the host, then where it goes (cProfile)."""
    import torch
    import flashnb
    # 128 queries of 256 heads: a grid of 256 blocks (no under-utilisation warning), microseconds of GPU work
    gen = (torch.randn(1, 128, 256, args.headdim, device="cuda", dtype=getattr(torch, args.dtype)) for _ in range(4))
    q, k, v, dout = gen
    impl = args.impl
    if args.decode:                          # the decode call: a forward only
        fwd = decode_call(args)
        out, lse = fwd(), None
        _loop(torch, [("decode " + args.decode, fwd)], impl)
        return

    def fwd():
        if impl == "flashnb":
            return flashnb.flash_attention(q, k, v, causal=args.causal, return_lse=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):     # (batch, heads, seqlen, headdim)
            return torch.nn.functional.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in (q, k, v)), is_causal=args.causal), None

    out, lse = fwd()

    def bwd():
        flashnb.flash_attention_backward(dout, q, k, v, out, lse, causal=args.causal)

    _loop(torch, [("forward", fwd)] + ([("backward", bwd)] if impl == "flashnb" else []), impl)


def _loop(torch, calls, impl):
    """Per (name, call): host time per call, alone and back to back, then cProfile's functions by own time."""
    for name, fn in calls:
        for _ in range(20):
            fn()
        # the call alone, the GPU idle and its queue empty before each (no launch waits for a slot)
        alone = []
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            alone.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{impl} {name}: {1e6 * sorted(alone)[len(alone) // 2]:.1f} us of host time per call (median of "
              f"200 calls, each after a synchronisation); back to back {1e6 * (t1 - t0) / n:.1f} us per call "
              f"({1e6 * (time.perf_counter() - t0) / n:.1f} us with the final synchronisation)")
    for name, fn in calls:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- {name}, 100 calls: cProfile by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("headdim", nargs="?", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--impl", choices=("flashnb", "sdpa-flash", "sdpa-cudnn"), default="flashnb")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--host", action="store_true", help="time the host side of a call (see above)")
    ap.add_argument("--decode", choices=("dense", "paged", "pages-in-order"),
                    help="bench.decode's shape at --seqlen cached keys (see above)")
    args = ap.parse_args(argv)
    if args.host:
        return host_cost(args)
    if args.decode:
        call = decode_call(args)
        for _ in range(2):
            call()
        import torch
        torch.cuda.synchronize()
        return

    import torch
    import flashnb
    d, n = args.headdim, args.seqlen
    batch, nheads = max(1, 16384 // n), 2048 // d
    dtype = getattr(torch, args.dtype)
    q, k, v, dout = (torch.randn(batch, n, nheads, d, device="cuda", dtype=dtype) for _ in range(4))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = SDPBackend.CUDNN_ATTENTION if args.impl == "sdpa-cudnn" else SDPBackend.FLASH_ATTENTION
    for i in range(2):
        if i == 1:                           # the second step alone between the profiler's start and stop
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        if args.impl == "flashnb":
            out, lse = flashnb.flash_attention(q, k, v, causal=args.causal, return_lse=True)
            flashnb.flash_attention_backward(dout, q, k, v, out, lse, causal=args.causal)
        else:
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
            out.backward(dout.transpose(1, 2))
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
