"""``python -m bench --decode``: decoding over a KV cache (issue 23's shape) against SDPA and the HBM bound.

The shape: batch 16, one query token, 32 query heads over 8 KV heads, head dim 128, float16, 4k-32k cached
keys, dense caches and paged ones (page 256, pages in random order).  Rows:

* ``flashnb``: ``flashnb.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=N)``, split count chosen
  by the heuristic; ``flashnb (seqlens tensor)``: the dense call with ``cache_seqlens`` a CUDA int32 tensor;
  ``flashnb +append``: the same call appending the step's new key and value first; paged calls pass
  ``block_table`` and ``cache_seqlens`` as CUDA tensors (an int ``cache_seqlens`` before 2026-11-26).  With
  device metadata a call replays its signature's recorded launches (flashnb's dispatch cache, from 2026-11-26):
  the host time of a decode loop's step; an int takes the full path every call.  Device metadata is checked by
  the kernels, never copied to the host (no sync; before 2026-11-26 each such call synchronised on a host copy).
* ``flashnb flash_attention``: the generic call a model's attention makes, ``flashnb.flash_attention(q, k_cache,
  v_cache, causal=True)``, which ``plan.split_kv`` routes to the decode kernels.
* ``sdpa-flash`` / ``sdpa-cudnn``: ``F.scaled_dot_product_attention`` under one backend, with the 4 query heads
  of a KV group packed as 4 query rows of that KV head (``q (16, 8, 4, 128)`` against ``k, v (16, 8, N,
  128)``, no causal mask: one query token sees every key), so K and V are read once, as flashnb reads them;
  ``sdpa-flash gqa``: the plain layout with ``enable_gqa=True`` where the backend takes it.
* ``flash-attn``: ``flash_attn.flash_attn_with_kvcache`` where the package is installed.
* ``HBM bound``: the bytes of K and V read once, over 3.0e12 B/s (GPU.md's measured HBM rate).

Two times per row: ``GPU`` (median over calls of CUDA events around one call, L2 flushed before each) and
``per call`` (host time included: ``CALLS`` back-to-back calls, one synchronisation, wall time / calls: what a
decode loop pays when the host cannot run ahead).  ``--seqlens 4096,32768`` limits the lengths.  Without a GPU
(the simulator) it prints why and stops.

The tuning rows (split counts, lane layouts, the generic tensor-core forward, the dense cache read as pages in
order) and the A/B of ``flashnb.kvcache`` settings are ``python -m tools.tune_decode``; older records name them
``python -m bench --decode --decode-sweep`` and ``python -m bench.decode --variants``.

The process may abort at exit with glibc's ``double free or corruption (!prev)`` after printing every row (seen
2026-11-25 and 2026-11-26, torch 2.11): PyTorch's CUPTI profiler freed activity buffers CUPTI still held at a
profiler's stop (pytorch/pytorch pull requests 195207 and 195471, 2026-08); the ``kernels us`` column starts
and stops a profiler twice per row.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from types import SimpleNamespace

from bench.report import record_line, record_table

BATCH, NHEADS, NHEADS_K, HEADDIM, PAGE = 16, 32, 8, 128, 256
SEQLENS = (4096, 8192, 16384, 32768)
HBM_BYTES_PER_S = 3.0e12
REPS, CALLS, WARMUP = 30, 50, 3


def hbm_bound_us(seqlen, batch=BATCH, nheads_k=NHEADS_K, headdim=HEADDIM, itemsize=2):
    """Microseconds to read K and V once at ``HBM_BYTES_PER_S``."""
    return 2 * batch * seqlen * nheads_k * headdim * itemsize / HBM_BYTES_PER_S * 1e6


SLEEP_CYCLES = 3_000_000   # ~1.5 ms of GPU clock: the host enqueues a call while the GPU still sleeps


def gpu_us(torch, fn, flush, reps=REPS):
    """Median GPU time of one call (CUDA events), L2 flushed before each.  A sleep kernel sits between the
    flush and the start event, so the host's work of the call (its Python, flashnb's checks) happens while the
    GPU is busy and the events bracket the GPU's work only; a call that synchronises inside (a device
    ``cache_seqlens`` or ``block_table`` copied to the host) still shows its host time after that sync."""
    times = []
    for _ in range(reps):
        flush()
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def kernel_us(torch, fn, flush, reps=10):
    """Mean over calls of the summed durations of the call's kernels (the profiler's CUPTI records: Numba's
    launches included), the flush's kernels left out; None where the profiler records no kernel."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(prof):
        cuda_type = torch.autograd.DeviceType.CUDA
        return [e for e in prof.events() if e.device_type == cuda_type]

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush()
        torch.cuda.synchronize()
    flush_names = {e.name for e in kernels(prof)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            fn()
        torch.cuda.synchronize()
    ks = [e for e in kernels(prof) if e.name not in flush_names]
    if not ks:
        return None, ""
    total = sum(e.time_range.elapsed_us() for e in ks)           # a kernel's own start-to-end on the GPU
    names = sorted({e.name.split("(")[0][:40] for e in ks})
    return total / reps, ", ".join(names)


def _per_call_us(torch, fn, calls=CALLS):
    """Wall time per call of back-to-back calls, host time included (best of 3 runs)."""
    best = math.inf
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def _max_err(a, b):
    return float((a.float() - b.float()).abs().max())


def inputs(torch, g, n):
    """The decode shape's arrays at ``n`` cached keys (``g`` seeded with ``n``): ``q``, the dense cache ``kc, vc``,
    the same in SDPA's layout ``k_sdpa, v_sdpa`` ((batch, heads, seqlen, dim), contiguous), ``q_packed`` (q by GQA
    group: (b, kv head, the group's heads as rows, d)), the lengths as a CUDA tensor ``lens_t``, a paged copy
    ``kp, vp`` (pages in random order) and its ``table``, and ``ref``, the float32 SDPA reference."""
    import torch.nn.functional as F
    g.manual_seed(n)
    q = torch.randn(BATCH, 1, NHEADS, HEADDIM, device="cuda", dtype=torch.float16, generator=g)
    kc = torch.randn(BATCH, n, NHEADS_K, HEADDIM, device="cuda", dtype=torch.float16, generator=g)
    vc = torch.randn(BATCH, n, NHEADS_K, HEADDIM, device="cuda", dtype=torch.float16, generator=g)
    k_sdpa, v_sdpa = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    q_packed = q.view(BATCH, NHEADS_K, NHEADS // NHEADS_K, HEADDIM)
    lens_t = torch.full((BATCH,), n, dtype=torch.int32, device="cuda")
    per = n // PAGE
    perm = torch.randperm(BATCH * per, device="cuda", generator=g)
    table = perm.view(BATCH, per).to(torch.int32)
    kp = torch.empty(BATCH * per, PAGE, NHEADS_K, HEADDIM, device="cuda", dtype=torch.float16)
    vp = torch.empty_like(kp)
    kp[perm] = kc.view(BATCH * per, PAGE, NHEADS_K, HEADDIM)
    vp[perm] = vc.view(BATCH * per, PAGE, NHEADS_K, HEADDIM)
    ref = F.scaled_dot_product_attention(q_packed.float(), k_sdpa.float(), v_sdpa.float()).reshape(
        BATCH, 1, NHEADS, HEADDIM)
    return SimpleNamespace(n=n, q=q, kc=kc, vc=vc, k_sdpa=k_sdpa, v_sdpa=v_sdpa, q_packed=q_packed, lens_t=lens_t,
                           table=table, kp=kp, vp=vp, ref=ref)


def record(torch, n, name, layout, context, fn, ref, flush, log):
    """One row: ``fn`` measured (``_measure``) inside ``context()`` (entered once, not per call); a failure is
    the row's note."""
    rec = dict(seqlen_k=n, layout=layout, impl=name, hbm_bound_us=round(hbm_bound_us(n), 1))
    try:
        with context():
            _measure(torch, fn, name, ref, flush, rec)
    except Exception as exc:                                  # noqa: BLE001 - one row's failure, reported
        rec["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    log(row_line(rec))
    return rec


def run(torch, seqlens=SEQLENS, log=print, extra_rows=None):
    """The decode table's records: dict(seqlen_k, layout, impl, gpu_us, call_us, kernel_us, vs_sdpa_flash, ...).
    ``extra_rows(x)``, given ``inputs``' arrays, returns more ``(name, layout, fn)`` rows measured after flashnb's
    (``tools.tune_decode``)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashnb

    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flush = flush_buf.zero_
    try:
        import flash_attn
        fa = flash_attn.flash_attn_with_kvcache
    except Exception as exc:                                  # noqa: BLE001 - reported as a note
        fa, fa_why = None, f"flash-attn not importable ({type(exc).__name__})"
    records = []
    g = torch.Generator(device="cuda")
    call = flashnb.flash_attn_with_kvcache
    for n in seqlens:
        x = inputs(torch, g, n)
        q, kc, vc, lens_t = x.q, x.kc, x.vc, x.lens_t
        k_new, v_new = kc[:, n - 1:].clone(), vc[:, n - 1:].clone()    # the last row appended again: same values
        impls = [
            ("flashnb", "dense", lambda: call(q, kc, vc, cache_seqlens=n)),
            ("flashnb (seqlens tensor)", "dense", lambda: call(q, kc, vc, cache_seqlens=lens_t)),
            ("flashnb +append", "dense", lambda: call(q, kc, vc, k_new, v_new, cache_seqlens=n - 1)),
            ("flashnb", "paged", lambda: call(q, x.kp, x.vp, cache_seqlens=lens_t, block_table=x.table)),
            # the generic call a model's attention makes (plan.split_kv routes it to the decode kernels)
            ("flashnb flash_attention", "dense", lambda: flashnb.flash_attention(q, kc, vc, causal=True)),
        ]
        if extra_rows is not None:
            impls += extra_rows(x)
        sdpa = F.scaled_dot_product_attention
        impls.append(("sdpa-flash", "dense", lambda: sdpa(x.q_packed, x.k_sdpa, x.v_sdpa), SDPBackend.FLASH_ATTENTION))
        impls.append(("sdpa-cudnn", "dense", lambda: sdpa(x.q_packed, x.k_sdpa, x.v_sdpa), SDPBackend.CUDNN_ATTENTION))
        impls.append(("sdpa-flash gqa", "dense", lambda: sdpa(q.transpose(1, 2), x.k_sdpa, x.v_sdpa, enable_gqa=True),
                      SDPBackend.FLASH_ATTENTION))
        if fa is not None:
            impls.append(("flash-attn", "dense", lambda: fa(q, kc, vc, cache_seqlens=lens_t)))
            impls.append(("flash-attn", "paged", lambda: fa(q, x.kp, x.vp, cache_seqlens=lens_t, block_table=x.table)))
        elif n == seqlens[0]:
            log(f"# not measured: {fa_why}")
        for name, layout, fn, *backend in impls:
            context = (lambda b=backend[0]: sdpa_kernel(b)) if backend else contextlib.nullcontext
            records.append(record(torch, n, name, layout, context, fn, x.ref, flush, log))
        del x, q, kc, vc, k_new, v_new, impls
        torch.cuda.empty_cache()
    speedups(records)
    return records


def _measure(torch, fn, name, ref, flush, rec):
    """One row: the error against the float32 reference, the GPU time and the per-call time."""
    out = fn()
    torch.cuda.synchronize()
    if name.startswith("sdpa"):
        out = out.transpose(1, 2) if "gqa" in name else out.reshape(ref.shape)
    rec["max_err"] = _max_err(out, ref)
    for _ in range(WARMUP):
        fn()
    rec["gpu_us"] = gpu_us(torch, fn, flush)
    rec["call_us"] = _per_call_us(torch, fn)
    rec["gpu_vs_hbm"] = rec["gpu_us"] / rec["hbm_bound_us"]
    try:
        rec["kernel_us"], rec["kernels"] = kernel_us(torch, fn, flush)
    except Exception as exc:                                  # noqa: BLE001 - the profiler is a second opinion
        rec["kernels"] = f"profiler: {type(exc).__name__}"


def speedups(records):
    """``vs sdpa-flash``: SDPA flash's GPU time over the row's, same seqlen (dense baseline for both layouts)."""
    for key, out in (("gpu_us", "vs_sdpa_flash"), ("kernel_us", "kernels_vs_sdpa")):
        base = {r["seqlen_k"]: r.get(key) for r in records if r["impl"] == "sdpa-flash"}
        for r in records:
            if r.get(key) and base.get(r["seqlen_k"]):
                r[out] = base[r["seqlen_k"]] / r[key]


COLUMNS = (("seqlen_k", "N", "d"), ("layout", "cache", "s"), ("impl", "impl", "s"), ("gpu_us", "GPU us", ".1f"),
           ("kernel_us", "kernels us", ".1f"), ("call_us", "per call us", ".1f"), ("hbm_bound_us", "HBM bound us", ".1f"),
           ("gpu_vs_hbm", "GPU / bound", ".2f"), ("vs_sdpa_flash", "vs sdpa-flash", ".2f"),
           ("kernels_vs_sdpa", "kernels vs sdpa-flash", ".3f"), ("kernels_vs_default", "kernels vs default", ".3f"),
           ("max_err", "max |err|", ".1e"), ("note", "note", "s"), ("kernels", "kernels", "s"))


def row_line(rec):
    return record_line(rec, COLUMNS)


def table(records):
    """A markdown table of the records."""
    return record_table(records, COLUMNS)


def seqlens_option(argv):
    """``--seqlens 4096,32768`` from ``argv``, else ``SEQLENS``."""
    if "--seqlens" in argv:
        return tuple(int(x) for x in argv[argv.index("--seqlens") + 1].split(","))
    return SEQLENS


def print_header():
    """The shape and the timing method, as ``# `` lines (after ``env``'s report header)."""
    print(f"# shape: batch {BATCH}, seqlen_q 1, {NHEADS} query heads over {NHEADS_K} KV heads, head dim {HEADDIM}, "
          f"float16; paged caches: page {PAGE}, pages in random order")
    print(f"# GPU us: median of {REPS} calls, CUDA events after a {SLEEP_CYCLES}-cycle sleep kernel (the host "
          f"enqueues meanwhile), L2 flushed before each; kernels us: the call's kernel durations from the "
          f"profiler (CUPTI), mean of 10; per call us: {CALLS} back-to-back "
          f"calls, one sync, best of 3 (host time included); HBM bound: K and V bytes / {HBM_BYTES_PER_S:.1e} B/s")


def main(argv=None) -> int:
    """Entry of ``python -m bench --decode``; the simulator (no GPU) only says why nothing is timed."""
    from bench import env
    argv = sys.argv[1:] if argv is None else list(argv)
    torch = env.gpu_section(argv, "decode", "decode", "tests/kernels/test_kernel_kvcache.py")
    if torch is None:
        return 0
    print_header()
    records = run(torch, seqlens=seqlens_option(argv), log=lambda s: print("# " + s, flush=True))
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
