"""FP8 forward on a Hopper GPU: correctness against the oracle, and speed against flashnb's own 16-bit forward.

    python -m tools.fp8_check check            # shapes x options against reference.fp8.fp8_flash_forward
    python -m tools.fp8_check small            # one small call per head dim and causal, dense, packed, over a
                                               # KV cache and with block descales (for compute-sanitizer)
    python -m tools.fp8_check bench [--seqlens 4096,16384] [--headdims 128,256] [--settings "A=1;B=1"] [--blocks]
    python -m tools.fp8_check profile --headdims 128 --seqlens 4096   # one call, for ncu --profile-from-start off
    python -m tools.fp8_check kernels [--seqlens ...] [--headdims ...] # each call's kernels timed apart
    python -m tools.fp8_check prepass [--seqlens ...] [--headdims ...] [--once]  # V^T's pre-passes alone
    python -m tools.fp8_check fixed [--headdims ...]   # a block's fixed cost: one query tile over 1..32 key tiles

``check``: torch float8_e4m3fn inputs (per-(batch, kv head) descales); the kernel's error against the exact
answer (float64 attention of the dequantised inputs) at most twice the oracle's (``fp8_flash_forward``: P
quantised, float64 sums) plus the output's rounding (flash-attn's rule: Hopper's FP8 products keep fewer bits
than float32, so S moves by ~1e-4 and P entries near a midpoint between codes flip); the distance to the oracle
itself, and the FP8 output's error against float64 attention of the unquantised inputs beside the 16-bit
kernel's, reported.  ``bench``: CUDA events around each call (host time included: the call's launches, V^T's pre-pass
among them), median of 20 after 3 (and the host's time inside the call, its launches being asynchronous),
batch x seqlen = 16k tokens, heads x headdim = 2048 (the bench's shapes),
TFLOP/s = 4 B H N^2 d (halved when causal).
"""
import argparse
import sys
import time

import numpy as np


def _inputs(torch, b, sq, sk, h, hk, d, seed, outliers=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", generator=g)
    v = torch.randn(b, sk, hk, d, device="cuda", generator=g)
    if outliers:
        k[:, :, :, 0] *= 20
    return q, k, v


def check():
    import torch
    import flashnb
    from reference import attention
    from reference.fp8 import _dequantize_inputs, fp8_flash_forward
    worst = 0.0
    rows = []
    for i, (b, sq, sk, h, hk, d, causal, outl) in enumerate([
            (2, 200, 333, 4, 2, 64, False, False), (2, 200, 333, 4, 2, 64, True, False),
            (1, 513, 513, 4, 4, 128, True, False), (2, 130, 700, 8, 2, 128, False, True),
            (1, 300, 257, 2, 1, 256, True, False), (1, 384, 640, 4, 2, 256, False, True),
            (3, 1, 999, 4, 1, 128, False, False), (1, 700, 300, 2, 2, 128, True, False),
            (1, 128, 4096, 2, 2, 128, False, False), (1, 128, 8192, 1, 1, 256, False, False)]):
        q, k, v = _inputs(torch, b, sq, sk, h, hk, d, i, outl)
        q8, qd = flashnb.quantize_fp8(q, "head", group=h // hk)           # one descale per key/value head
        k8, kd = flashnb.quantize_fp8(k, "head")
        v8, vd = flashnb.quantize_fp8(v, "head")
        for out_dtype in ((torch.bfloat16,) if i % 2 == 0 else (torch.float16,)):
            out, lse = flashnb.flash_attention_fp8(q8, k8, v8, qd, kd, vd, causal=causal, out_dtype=out_dtype,
                                                   return_lse=True)
            torch.cuda.synchronize()
            codes = [x.view(torch.uint8).cpu().numpy() for x in (q8, k8, v8)]
            ref, ref_lse = fp8_flash_forward(*codes, qd.cpu().numpy(), kd.cpu().numpy(), vd.cpu().numpy(),
                                             block_k=128, causal=causal)
            got = out.float().cpu().numpy()
            unit = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -11
            err = np.abs(got - ref)
            deq = _dequantize_inputs(*codes, qd.cpu().numpy(), kd.cpu().numpy(), vd.cpu().numpy())
            exact, _ = attention(*deq, causal=causal)                       # the dequantised inputs, float64
            top = np.abs(exact).max()
            kernel_err, oracle_err = np.abs(got - exact).max(), np.abs(ref - exact).max()
            ok = bool(kernel_err <= 2 * oracle_err + 2 * unit * top) and np.all(np.isfinite(got))   # flash-attn's rule
            lse_err = float(np.max(np.abs(np.where(np.isinf(ref_lse), 0, lse.cpu().numpy() - ref_lse))))
            full, _ = attention(*(x.double().cpu().numpy() for x in (q, k, v)), causal=causal)
            fp16 = flashnb.flash_attention(q.half(), k.half(), v.half(), causal=causal).float().cpu().numpy()
            rows.append((b, sq, sk, h, hk, d, causal, outl, str(out_dtype)[6:], float(err.max() / top), lse_err,
                         float(kernel_err / top), float(oracle_err / top), float(np.abs(got - full).max() / top),
                         float(np.abs(fp16 - full).max() / top), ok))
            worst = max(worst, 0 if ok else 1)
    print("Errors relative to max |exact|; exact = float64 attention of the dequantised inputs; ok: kernel's error "
          "<= 2 x the oracle's + 2 output units (flash-attn's rule)")
    print("| b | sq | sk | h | hk | d | causal | outliers | out | vs FP8 oracle | lse err | kernel vs exact | "
          "oracle vs exact | kernel vs float64 of unquantised | fp16 kernel vs float64 | ok |")
    print("|" + "---|" * 16)
    for r in rows:
        print("| " + " | ".join(f"{x:.2e}" if isinstance(x, float) else str(x) for x in r) + " |")
    print("ALL OK" if worst == 0 else "FAILED")
    return int(worst)


def small():
    import torch
    import flashnb
    for d in (64, 128, 256):
        for causal in (False, True):
            q, k, v = _inputs(torch, 1, 133, 201, 2, 1, d, d)
            q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
            out = flashnb.flash_attention_fp8(q8, k8, v8, causal=causal)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
            # the packed batch: sequences of 70, 0, 63 queries over 150, 30, 0 keys (an empty sequence, one of no key)
            cu_q = torch.tensor([0, 70, 70, 133], dtype=torch.int32, device="cuda")
            cu_k = torch.tensor([0, 150, 180, 180], dtype=torch.int32, device="cuda")
            out = flashnb.flash_attention_fp8_varlen(q8[0], k8[0, :180], v8[0, :180], cu_q, cu_k, 70, 150,
                                                     causal=causal)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
            # over a KV cache of 3 sequences (capacity 201): 4 queries, 3 new rows appended at 50, 0 and 198 rows
            kc, vc = k8.expand(3, -1, -1, -1).contiguous(), v8.expand(3, -1, -1, -1).contiguous()
            kn, vn = kc[:, :3].clone(), vc[:, :3].clone()
            lens = torch.tensor([50, 0, 198], dtype=torch.int32, device="cuda")
            out = flashnb.flash_attn_with_kvcache_fp8(q8[:, :4].expand(3, -1, -1, -1).contiguous(), kc, vc, lens,
                                                      kn, vn, causal=causal)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
            # block descales (query blocks of 128, key blocks of 256: the last block partial)
            (qb, dq), (kb, dk), (vb, dv) = (flashnb.quantize_fp8(x, per="block", block=n)
                                            for x, n in ((q, 128), (k, 256), (v, 256)))
            out = flashnb.flash_attention_fp8(qb, kb, vb, dq, dk, dv, causal=causal, descale_block_q=128,
                                              descale_block_k=256)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
    print("24 configurations ran (dense, packed, over a KV cache, and with block descales)")
    return 0


def profile(d=128, n=4096, causal=False):
    """One FP8 call (batch x seqlen = 16k tokens, heads x headdim = 2048) between the profiler's start and stop, after
    a warm-up: ``ncu --profile-from-start off ... python -m tools.fp8_check profile``."""
    import torch
    import flashnb
    b, h = 16384 // n, 2048 // d
    q, k, v = (x.to(torch.float8_e4m3fn) for x in _inputs(torch, b, n, n, h, h, d, 0))
    flashnb.flash_attention_fp8(q, k, v, causal=causal)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    flashnb.flash_attention_fp8(q, k, v, causal=causal)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


def _apply(setting):
    """``NAME=INT ...`` assignments of ``flashnb.plan``'s FP8 constants (``FP8_TWO_BLOCKS``); the plan cache and
    the dispatch cache cleared."""
    from flashnb import _dispatch, plan
    for item in setting.split():
        name, value = item.split("=")
        assert name.startswith("FP8_") and hasattr(plan, name), name
        setattr(plan, name, int(value))
    plan.fp8_forward.cache_clear()
    plan.fp8_forward_packed.cache_clear()
    _dispatch.clear()


def bench(seqlens, headdims, settings=("",), blocks=False):
    import torch
    import flashnb
    for setting in settings:
        _apply(setting)
        print(f"setting: {setting or 'as shipped'}" + (" (FP8 with block descales: query and key blocks of 128)"
                                                      if blocks else ""))
        _bench(torch, flashnb, seqlens, headdims, blocks)
    return 0


def _shapes(torch, seqlens, headdims):
    """The bench's problems: (d, N, batch, heads, float16 q, k, v, their e4m3 casts), batch x N = 16k tokens, heads x
    d = 2048."""
    for d in headdims:
        for n in seqlens:
            b, h = 16384 // n, 2048 // d
            q, k, v = (x.half() for x in _inputs(torch, b, n, n, h, h, d, 0))
            yield (d, n, b, h, q, k, v) + tuple(x.to(torch.float8_e4m3fn) for x in (q, k, v))


def _bench(torch, flashnb, seqlens, headdims, blocks=False):
    print("| d | N | causal | fp16 ms | FP8 ms | fp16 TFLOP/s | FP8 TFLOP/s | FP8 / fp16 speed | host us fp16 / FP8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d, n, b, h, q, k, v, q8, k8, v8 in _shapes(torch, seqlens, headdims):
        descales = dict()
        if blocks:      # one descale a (batch, head, block of 128 rows): codes and descales from the quantiser
            (q8, dq), (k8, dk), (v8, dv) = (flashnb.quantize_fp8(x, per="block", block=128) for x in (q, k, v))
            descales = dict(q_descale=dq, k_descale=dk, v_descale=dv, descale_block_q=128, descale_block_k=128)
        for causal in (False, True):
            times = {}
            for name, fn in (("fp16", lambda: flashnb.flash_attention(q, k, v, causal=causal)),
                             ("fp8", lambda: flashnb.flash_attention_fp8(q8, k8, v8, causal=causal,
                                                                        **descales))):
                for _ in range(3):
                    fn()
                ts, host = [], []
                for _ in range(20):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    t0 = time.perf_counter()
                    fn()
                    host.append(time.perf_counter() - t0)
                    e1.record()
                    torch.cuda.synchronize()
                    ts.append(e0.elapsed_time(e1))
                times[name] = float(np.median(ts))
                times[name + " host"] = float(np.median(host)) * 1e6
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            f16, f8 = times["fp16"], times["fp8"]
            print(f"| {d} | {n} | {causal} | {f16:.3f} | {f8:.3f} | {flops / f16 / 1e9:.0f} | "
                  f"{flops / f8 / 1e9:.0f} | {f16 / f8:.2f}x | {times['fp16 host']:.0f} / {times['fp8 host']:.0f} |")


def _device_us(torch, fn, calls=10):
    """``fn``'s kernels' device time a call by ``torch.profiler`` (``calls`` calls after 3): {"prep": V^T's
    pre-passes, "fwd": every other kernel}, and ``fn``'s last result."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        r = fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = (us if us is not None else getattr(e, "self_cuda_time_total", 0.0)) / calls
        if us > 0:
            kind = "prep" if "prepare" in e.key else "fwd"
            per[kind] = per.get(kind, 0.0) + us
    return per, r


def kernels(seqlens, headdims, settings=("",)):
    """Each call's kernels, timed apart (``torch.profiler``'s CUDA activity, 10 calls after 3): V^T's pre-pass and the
    FP8 forward against the float16 forward's own kernels, so a ratio of calls can be split into the kernels' and the
    rest (host time, launch gaps)."""
    import torch
    import flashnb
    for setting in settings:
        _apply(setting)
        print(f"setting: {setting or 'as shipped'}")
        _kernels(torch, flashnb, seqlens, headdims)
    return 0


def _kernels(torch, flashnb, seqlens, headdims):
    print("| d | N | causal | fp16 kernels us | FP8 forward us | V^T pre-pass us | FP8 / fp16, kernels only |")
    print("|---|---|---|---|---|---|---|")
    for d, n, b, h, q, k, v, q8, k8, v8 in _shapes(torch, seqlens, headdims):
        for causal in (False, True):
            f16 = sum(_device_us(torch, lambda: flashnb.flash_attention(q, k, v, causal=causal))[0].values())
            per, _ = _device_us(torch, lambda: flashnb.flash_attention_fp8(q8, k8, v8, causal=causal))
            f8, pre = per.get("fwd", 0.0), per.get("prep", 0.0)
            print(f"| {d} | {n} | {causal} | {f16:.0f} | {f8:.0f} | {pre:.0f} | {f16 / (f8 + pre):.2f}x |")


def prepass(seqlens, headdims, once=False):
    """V^T's pre-passes launched alone, each kernel's device time by ``torch.profiler`` (10 launches after 3): the
    byte and word pre-passes of a dense batch and of the same keys as a packed batch (``b`` sequences of ``N``),
    against PyTorch's copy of v and its transpose ``permute(0, 2, 3, 1).contiguous()`` (the same bytes moved, no
    relabelling); the byte and word outputs compared byte for byte.  ``--once``: one launch of each, for ncu."""
    import torch
    from flashnb import _arrays, fp8, plan
    from flashnb.kernels import forward_fp8 as kf
    print("| d | N | batch | heads | copy us | torch transpose us | byte us | word us | GB/s (word) | packed byte us | "
          "packed word us | equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d, n, b, h, q, k, v, q8, k8, v8 in _shapes(torch, seqlens, headdims):
        kind, _ = fp8._check(q8, k8, v8, None)
        stream = _arrays.resolve_stream(None, kind, q8)
        outs, times = {}, {}
        with _arrays.stream_scope(stream, kind, q8):
            vb = fp8._codes(v8, "v", stream)
            base = plan.fp8_forward(b, n, n, h, h, d, False, "bfloat16")
            u8 = v8.view(torch.uint8)
            fns = {"copy": lambda: u8.clone(), "torch": lambda: u8.permute(0, 2, 3, 1).contiguous(),
                   "byte": lambda: fp8._transposed_v(base._replace(prepare_words=None), vb, kind, q8, stream),
                   "word": lambda: fp8._transposed_v(base, vb, kind, q8, stream)}
            # the same keys as one packed batch of b sequences of n: fp8._packed_forward's pre-pass
            lens = np.full(b, n)
            cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            tiles = fp8._tiles_of(lens)
            vt_start = np.concatenate([[0], np.cumsum(tiles)]).astype(np.int32)
            group_seq = np.repeat(np.arange(b, dtype=np.int32), tiles // kf.VT_KEYS)
            pk = plan.fp8_forward_packed(b, n, group_seq.shape[0], h, h, d, False, "bfloat16")
            dev = [torch.as_tensor(x, device="cuda") for x in (cu_k, vt_start, group_seq)]
            dev = [_arrays.to_device(x, stream) for x in dev]
            vbp = _arrays.to_device(u8.reshape(1, b * n, h, d), stream)
            cols = int(vt_start[-1])
            vt_p = torch.empty((1, h, d, cols), dtype=torch.uint8, device="cuda")
            vt_d = _arrays.to_device(vt_p, stream)
            st = vt_d.strides
            vt_v = _arrays.strided_view(vt_d, (1, d, h, cols), (st[0], st[2], st[1], st[3]))
            fns["packed byte"] = lambda: fp8._run(pk.prepare, stream, (vbp, vt_v, *dev)) or vt_p
            fns["packed word"] = lambda: fp8._run(pk.prepare_words, stream, fp8._packed_words_args(
                _arrays.word_view(vbp), _arrays.word_view(vt_v), *dev)) or vt_p
            for name, fn in fns.items():
                if once:
                    fn()
                    continue
                per, r = _device_us(torch, fn)
                times[name] = sum(per.values())
                if name in ("byte", "word", "packed byte", "packed word"):
                    outs[name] = torch.as_tensor(r, device="cuda").clone()
        torch.cuda.synchronize()
        if once:
            print(f"| {d} | {n} | {b} | {h} | once |")
            continue
        equal = torch.equal(outs["byte"], outs["word"]) and torch.equal(outs["packed byte"], outs["packed word"])
        gbs = 2 * v8.numel() / times["word"] / 1e3
        print(f"| {d} | {n} | {b} | {h} | {times['copy']:.1f} | {times['torch']:.1f} | {times['byte']:.1f} | "
              f"{times['word']:.1f} | {gbs:.0f} | {times['packed byte']:.1f} | {times['packed word']:.1f} | "
              f"{equal} |")
    return 0


def fixed(headdims, key_tiles=(1, 2, 4, 8, 16, 32)):
    """A block's fixed cost against its cost a key tile: one query tile (128 queries) over 128 x ``key_tiles`` keys,
    batch x heads = 1056 blocks (8 a multiprocessor of an H100 / H200), each kernel's device time by
    ``torch.profiler`` (10 calls after 3), FP8 (the forward kernel, V^T's pre-pass apart) and float16; a least-squares
    line ``time = blocks per SM x (fixed + per tile x tiles)`` per kernel."""
    import torch
    import flashnb
    per_sm = 1056 / torch.cuda.get_device_properties(0).multi_processor_count
    print("| d | key tiles | fp16 kernels us | FP8 forward us | V^T pre-pass us |")
    print("|---|---|---|---|---|")
    fits = []
    for d in headdims:
        h = 2048 // d
        b = 1056 // h
        rows = []
        for nt in key_tiles:
            q, k, v = (x.half() for x in _inputs(torch, b, 128, 128 * nt, h, h, d, nt))
            q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
            f16, _ = _device_us(torch, lambda: flashnb.flash_attention(q, k, v))
            f8, _ = _device_us(torch, lambda: flashnb.flash_attention_fp8(q8, k8, v8))
            per = {("fp16", "fwd"): sum(f16.values())} | {("fp8", kind): us for kind, us in f8.items()}
            rows.append((nt, per.get(("fp16", "fwd"), 0.0), per.get(("fp8", "fwd"), 0.0), per.get(("fp8", "prep"), 0)))
            print(f"| {d} | {nt} | {rows[-1][1]:.1f} | {rows[-1][2]:.1f} | {rows[-1][3]:.1f} |")
        x = np.array([r[0] for r in rows], float)
        for name, col in (("fp16", 1), ("FP8", 2)):
            y = np.array([r[col] for r in rows]) / per_sm
            slope, icpt = np.polyfit(x, y, 1)
            fits.append(f"| {d} | {name} | {icpt:.2f} | {slope:.3f} |")
    print()
    print("| d | kernel | a block's fixed cost us | us a key tile |")
    print("|---|---|---|---|")
    print("\n".join(fits))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("check", "small", "bench", "profile", "kernels", "prepass", "fixed"))
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--headdims", default="64,128,256")
    ap.add_argument("--settings", default="", help="bench, kernels: settings separated by ';', each NAME=INT "
                    "assignments of flashnb.plan's FP8 constants (FP8_TWO_BLOCKS=0)")
    ap.add_argument("--setting", default="", help="check / small: one such setting")
    ap.add_argument("--blocks", action="store_true", help="bench: FP8 with block descales (blocks of 128 rows)")
    ap.add_argument("--once", action="store_true", help="prepass: one launch of each (for ncu)")
    a = ap.parse_args(argv)
    _apply(a.setting)
    if a.what == "check":
        return check()
    if a.what == "small":
        return small()
    if a.what == "kernels":
        return kernels([int(x) for x in a.seqlens.split(",")], [int(x) for x in a.headdims.split(",")],
                       a.settings.split(";"))
    if a.what == "fixed":
        return fixed([int(x) for x in a.headdims.split(",")])
    if a.what == "prepass":
        return prepass([int(x) for x in a.seqlens.split(",")], [int(x) for x in a.headdims.split(",")], a.once)
    if a.what == "profile":
        return profile(int(a.headdims.split(",")[0]), int(a.seqlens.split(",")[0]))
    return bench([int(x) for x in a.seqlens.split(",")], [int(x) for x in a.headdims.split(",")],
                 a.settings.split(";"), a.blocks)


if __name__ == "__main__":
    sys.exit(main())
