"""``python -m bench --decode``: decoding over a KV cache (issue 23's shape) against SDPA and the HBM bound.

The shape: batch 16, one query token, 32 query heads over 8 KV heads, head dim 128, float16, 4k-32k cached
keys, dense caches and paged ones (page 256, pages in random order).  Rows:

* ``flashnb``: ``flashnb.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=N)``, split count chosen
  by the heuristic; ``flashnb (seqlens tensor)``: the dense call with ``cache_seqlens`` a CUDA int32 tensor;
  paged calls pass ``block_table`` and ``cache_seqlens`` as CUDA tensors (an int ``cache_seqlens`` before
  2026-11-26).  With device metadata a call replays its signature's recorded launches (flashnb's dispatch
  cache, from 2026-11-26): the host time of a decode loop's step; an int takes the full path every call.
  Device metadata is checked by the kernels, never copied to the host (no sync; before 2026-11-26 each such
  call synchronised on a host copy).  ``flashnb (pages in
  order)``: the dense cache's own memory read as pages through a block table ``0, 1, 2, ..``: the paged
  kernel at the dense row's addresses, which separates the cost of the table from that of scattered pages.
* ``sdpa-flash`` / ``sdpa-cudnn``: ``F.scaled_dot_product_attention`` under one backend, with the 4 query heads
  of a KV group packed as 4 query rows of that KV head (``q (16, 8, 4, 128)`` against ``k, v (16, 8, N,
  128)``, no causal mask: one query token sees every key), so K and V are read once, as flashnb reads them;
  ``sdpa-flash gqa``: the plain layout with ``enable_gqa=True`` where the backend takes it.
* ``flash-attn``: ``flash_attn.flash_attn_with_kvcache`` where the package is installed.
* ``HBM bound``: the bytes of K and V read once, over 3.0e12 B/s (GPU.md's measured HBM rate).

Two times per row: ``GPU`` (median over calls of CUDA events around one call, L2 flushed before each) and
``per call`` (host time included: ``CALLS`` back-to-back calls, one synchronisation, wall time / calls: what a
decode loop pays when the host cannot run ahead).  Without a GPU (the simulator) it prints why and stops.
``--decode-sweep`` adds flashnb rows at fixed split counts and two lane layouts (tuning records).

``python -m bench.decode --variants [SPEC ...]`` (A/B of kernel candidates, dense caches): per cache length the
default flashnb, flashnb under each SPEC (comma-separated ``NAME=INT`` settings of ``flashnb.kvcache``, e.g.
``LEAN=1,STAGES=6``; none given: ``VARIANTS``), flashnb reading SDPA's layout (``(batch, heads, keys, dim)``
storage seen through a transposed view: the same bytes SDPA reads), the device-metadata rows (``seqlens
tensor``, ``paged``), SDPA FlashAttention-2 on its layout and on the cache's (``(batch, keys, heads, dim)``
storage, transposed), with ``kernels vs default`` (the default's kernel time over the row's).
``--seqlens 4096,32768`` limits the lengths.

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

from bench.report import record_line, record_table

BATCH, NHEADS, NHEADS_K, HEADDIM, PAGE = 16, 32, 8, 128, 256
SEQLENS = (4096, 8192, 16384, 32768)
HBM_BYTES_PER_S = 3.0e12
REPS, CALLS, WARMUP = 30, 50, 3


def hbm_bound_us(seqlen, batch=BATCH, nheads_k=NHEADS_K, headdim=HEADDIM, itemsize=2):
    """Microseconds to read K and V once at ``HBM_BYTES_PER_S``."""
    return 2 * batch * seqlen * nheads_k * headdim * itemsize / HBM_BYTES_PER_S * 1e6


SWEEP = ((0, 2, 64), (3, 2, 64))   # (STAGES, KEYS_PER_LANE, E_BUDGET) of --decode-sweep's extra rows
VARIANTS = (                        # --variants' candidates (flashnb.kvcache settings), each against the default
    "LEAN=0,NWARPS=4,BLOCKS_PER_SM=2",                           # the default before run 4 of the record
    "NWARPS=4,BLOCKS_PER_SM=2",                                  # LEAN alone
    "E_BUDGET=32,BLOCKS_PER_SM=3,STAGES=6,NWARPS=4",             # 16 lanes a key, 164 registers: 12 warps an SM
)
SLEEP_CYCLES = 3_000_000   # ~1.5 ms of GPU clock: the host enqueues a call while the GPU still sleeps


def _gpu_us(torch, fn, flush, reps=REPS):
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


def _kernel_us(torch, fn, flush, reps=10):
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


def _inputs(torch, g, n):
    """The decode shape's arrays at ``n`` cached keys (``g`` seeded with ``n``): q, the dense cache, the same in
    SDPA's layout ((batch, heads, seqlen, dim), contiguous), q packed by GQA group ((b, kv head, the group's
    heads as rows, d)), the lengths as a CUDA tensor, a paged copy (pages in random order, its table), and the
    float32 SDPA reference."""
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
    return q, kc, vc, k_sdpa, v_sdpa, q_packed, lens_t, table, kp, vp, ref


def _in_order(torch, kc, vc):
    """The dense caches seen as pages of ``PAGE`` rows (no copy), sequence ``b``'s pages ``b * per ..``, and their
    block table: the same bytes as the dense cache, read through the table."""
    per = kc.shape[1] // PAGE
    table = torch.arange(BATCH * per, dtype=torch.int32, device="cuda").view(BATCH, per)
    return kc.view(-1, PAGE, NHEADS_K, HEADDIM), vc.view(-1, PAGE, NHEADS_K, HEADDIM), table


def _record(torch, n, name, layout, context, fn, ref, flush, log):
    """One row: ``fn`` measured (``_measure``) inside ``context()`` (entered once, not per call); a failure is
    the row's note."""
    rec = dict(seqlen_k=n, layout=layout, impl=name, hbm_bound_us=round(hbm_bound_us(n), 1))
    try:
        with context():
            _measure(torch, fn, name, ref, flush, rec)
    except Exception as exc:                                  # noqa: BLE001 - one row's failure, reported
        rec["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    log(_row(rec))
    return rec


def run(torch, seqlens=SEQLENS, sweep=False, log=print):
    """The decode table's records: dict(case, impl, gpu_us, call_us, vs_hbm, note)."""
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
    for n in seqlens:
        q, kc, vc, k_sdpa, v_sdpa, q_packed, lens_t, table, kp, vp, ref = _inputs(torch, g, n)
        kpo, vpo, table_o = _in_order(torch, kc, vc)
        q_sdpa = q.transpose(1, 2)                             # (b, 32 heads, 1, d)
        k_new, v_new = kc[:, n - 1:].clone(), vc[:, n - 1:].clone()    # the last row appended again: same values
        impls = [
            ("flashnb", "dense", lambda: flashnb.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n)),
            ("flashnb (seqlens tensor)", "dense", lambda: flashnb.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens_t)),
            ("flashnb +append", "dense", lambda: flashnb.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=n - 1)),
            ("flashnb", "paged", lambda: flashnb.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens_t,
                                                                         block_table=table)),
            ("flashnb (pages in order)", "paged", lambda: flashnb.flash_attn_with_kvcache(
                q, kpo, vpo, cache_seqlens=lens_t, block_table=table_o)),
            # the generic call a model's attention makes (plan.split_kv routes it to the decode kernels), and the
            # same call kept on the generic tensor-core forward (what it ran before the routing)
            ("flashnb flash_attention", "dense", lambda: flashnb.flash_attention(q, kc, vc, causal=True)),
            ("flashnb flash_attention backend=tensorcore", "dense",
             lambda: flashnb.flash_attention(q, kc, vc, causal=True, backend="tensorcore")),
        ]
        if sweep:
            for splits in (1, 4, 8):
                impls.append((f"flashnb splits={splits}", "dense",
                              lambda s=splits: flashnb.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, num_splits=s)))
        sdpa = F.scaled_dot_product_attention
        impls.append(("sdpa-flash", "dense", lambda: sdpa(q_packed, k_sdpa, v_sdpa), SDPBackend.FLASH_ATTENTION))
        impls.append(("sdpa-cudnn", "dense", lambda: sdpa(q_packed, k_sdpa, v_sdpa), SDPBackend.CUDNN_ATTENTION))
        impls.append(("sdpa-flash gqa", "dense", lambda: sdpa(q_sdpa, k_sdpa, v_sdpa, enable_gqa=True),
                      SDPBackend.FLASH_ATTENTION))
        if fa is not None:
            impls.append(("flash-attn", "dense", lambda: fa(q, kc, vc, cache_seqlens=lens_t)))
            impls.append(("flash-attn", "paged", lambda: fa(q, kp, vp, cache_seqlens=lens_t, block_table=table)))
        elif n == seqlens[0]:
            log(f"# not measured: {fa_why}")
        for name, layout, fn, *backend in impls:
            context = (lambda b=backend[0]: sdpa_kernel(b)) if backend else contextlib.nullcontext
            records.append(_record(torch, n, name, layout, context, fn, ref, flush, log))
        del kc, vc, kp, vp, kpo, vpo, k_sdpa, v_sdpa
        torch.cuda.empty_cache()
    if sweep:
        records += _lane_sweep(torch, flush, log)
    _speedups(records)
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
    rec["gpu_us"] = _gpu_us(torch, fn, flush)
    rec["call_us"] = _per_call_us(torch, fn)
    rec["gpu_vs_hbm"] = rec["gpu_us"] / rec["hbm_bound_us"]
    try:
        rec["kernel_us"], rec["kernels"] = _kernel_us(torch, fn, flush)
    except Exception as exc:                                  # noqa: BLE001 - the profiler is a second opinion
        rec["kernels"] = f"profiler: {type(exc).__name__}"


def _lane_sweep(torch, flush, log):
    """flashnb at other lane layouts (keys per lane T, values per lane budget): 4k and 32k, dense."""
    import flashnb
    from flashnb import kvcache
    out = []
    saved = kvcache.KEYS_PER_LANE, kvcache.E_BUDGET, kvcache.STAGES
    try:
        for stages, t, e in SWEEP:
            kvcache.KEYS_PER_LANE, kvcache.E_BUDGET, kvcache.STAGES = t, e, stages
            for n in (4096, 32768):
                q = torch.randn(BATCH, 1, NHEADS, HEADDIM, device="cuda", dtype=torch.float16)
                kc = torch.randn(BATCH, n, NHEADS_K, HEADDIM, device="cuda", dtype=torch.float16)
                vc = torch.randn_like(kc)
                fn = lambda: flashnb.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n)
                rec = dict(seqlen_k=n, layout="dense", impl=f"flashnb stages={stages} T={t} E={e}",
                           hbm_bound_us=round(hbm_bound_us(n), 1))
                try:
                    fn()
                    rec["gpu_us"] = _gpu_us(torch, fn, flush)
                    rec["gpu_vs_hbm"] = rec["gpu_us"] / rec["hbm_bound_us"]
                    rec["kernel_us"], rec["kernels"] = _kernel_us(torch, fn, flush)
                except Exception as exc:                      # noqa: BLE001
                    rec["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                out.append(rec)
                log(_row(rec))
                del kc, vc
    finally:
        kvcache.KEYS_PER_LANE, kvcache.E_BUDGET, kvcache.STAGES = saved
    return out


def parse_variant(spec):
    """``"NAME=INT,NAME=INT"`` -> {NAME: int}, each NAME an int (or bool) setting of ``flashnb.kvcache``."""
    from flashnb import kvcache
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, value = item.partition("=")
        if not name.isupper() or not isinstance(getattr(kvcache, name, None), int):
            raise ValueError(f"--variants: {name!r} is not an int setting of flashnb.kvcache")
        out[name] = int(value)
    return out


@contextlib.contextmanager
def settings(overrides):
    """``flashnb.kvcache``'s module settings changed for the duration (read by every call)."""
    from flashnb import kvcache
    saved = {k: getattr(kvcache, k) for k in overrides}
    try:
        for k, v in overrides.items():
            setattr(kvcache, k, type(saved[k])(v))
        yield
    finally:
        for k, v in saved.items():
            setattr(kvcache, k, v)


def run_variants(torch, variants, seqlens=SEQLENS, log=print):
    """The A/B table: dense decode at each length, the default against each variant, the layouts, SDPA."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashnb

    specs = [(spec, parse_variant(spec)) for spec in variants]
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flush = flush_buf.zero_
    sdpa = F.scaled_dot_product_attention
    call = flashnb.flash_attn_with_kvcache
    records = []
    g = torch.Generator(device="cuda")
    for n in seqlens:
        q, kc, vc, k_sdpa, v_sdpa, q_packed, lens_t, table, kp, vp, ref = _inputs(torch, g, n)
        kpo, vpo, table_o = _in_order(torch, kc, vc)
        rows = [("flashnb", "dense", {}, lambda: call(q, kc, vc, cache_seqlens=n))]
        rows += [(f"flashnb {spec}", "dense", o, lambda: call(q, kc, vc, cache_seqlens=n)) for spec, o in specs]
        rows += [
            ("flashnb (sdpa layout)", "dense", {},
             lambda: call(q, k_sdpa.transpose(1, 2), v_sdpa.transpose(1, 2), cache_seqlens=n)),
            ("flashnb (seqlens tensor)", "dense", {}, lambda: call(q, kc, vc, cache_seqlens=lens_t)),
            ("flashnb", "paged", {}, lambda: call(q, kp, vp, cache_seqlens=lens_t, block_table=table)),
            ("flashnb (pages in order)", "paged", {},
             lambda: call(q, kpo, vpo, cache_seqlens=lens_t, block_table=table_o)),
            ("sdpa-flash", "dense", SDPBackend.FLASH_ATTENTION, lambda: sdpa(q_packed, k_sdpa, v_sdpa)),
            ("sdpa-flash (cache layout)", "dense", SDPBackend.FLASH_ATTENTION,
             lambda: sdpa(q_packed, kc.transpose(1, 2), vc.transpose(1, 2))),
        ]
        for name, layout, how, fn in rows:
            context = (lambda h=how: settings(h)) if isinstance(how, dict) else (lambda h=how: sdpa_kernel(h))
            records.append(_record(torch, n, name, layout, context, fn, ref, flush, log))
        del kc, vc, kp, vp, kpo, vpo, k_sdpa, v_sdpa
        torch.cuda.empty_cache()
    _speedups(records)
    base = {r["seqlen_k"]: r.get("kernel_us") for r in records if r["impl"] == "flashnb" and r["layout"] == "dense"}
    for r in records:
        if r.get("kernel_us") and base.get(r["seqlen_k"]) and r["impl"].startswith("flashnb"):
            r["kernels_vs_default"] = base[r["seqlen_k"]] / r["kernel_us"]
    return records


def _speedups(records):
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


def _row(rec):
    return record_line(rec, COLUMNS)


def table(records):
    """A markdown table of the records."""
    return record_table(records, COLUMNS)


def precompile(part, torch):
    """Compile part ``part`` (0-3) of the kernels ``run`` uses into flashnb's disk cache, on small inputs of the
    same specialisations (contiguous float16, head dim 128, 4 query heads per KV head, batch 16 x 8 KV heads:
    the same split decision), so that parallel processes compile while the tests run."""
    import flashnb
    from flashnb import kvcache
    n = 512
    q = torch.randn(BATCH, 1, NHEADS, HEADDIM, device="cuda", dtype=torch.float16)
    kc, vc = (torch.randn(BATCH, n, NHEADS_K, HEADDIM, device="cuda", dtype=torch.float16) for _ in range(2))
    per = n // PAGE
    kp, vp = (x.view(BATCH * per, PAGE, NHEADS_K, HEADDIM) for x in (kc, vc))
    table = torch.arange(BATCH * per, device="cuda", dtype=torch.int32).view(BATCH, per)
    lens_t = torch.full((BATCH,), n, dtype=torch.int32, device="cuda")
    call = flashnb.flash_attn_with_kvcache
    if part == 0:
        call(q, kc, vc, cache_seqlens=n)
        call(q, kp, vp, cache_seqlens=n, block_table=table)
    elif part == 1:
        call(q, kc, vc, cache_seqlens=lens_t)
        call(q, kc, vc, cache_seqlens=n, num_splits=1)
    else:
        if part == 2:
            call(q, kc, vc, kc[:, n - 1:].clone(), vc[:, n - 1:].clone(), cache_seqlens=n - 1)
        for stages, t, e in SWEEP[part - 2::2]:
            kvcache.STAGES, kvcache.KEYS_PER_LANE, kvcache.E_BUDGET = stages, t, e
            call(q, kc, vc, cache_seqlens=n)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    """Entry of ``python -m bench --decode``; the simulator (no GPU) only says why nothing is timed."""
    from bench import env
    argv = sys.argv[1:] if argv is None else list(argv)
    if env.use_simulator_if_no_gpu():
        print("bench --decode: no CUDA device (or NUMBA_ENABLE_CUDASIM=1): decode timings need a GPU; nothing "
              "measured. The kernels' correctness runs in the simulator: pytest tests/kernels/test_kernel_kvcache.py")
        return 0
    import torch
    if "--precompile" in argv:
        precompile(int(argv[argv.index("--precompile") + 1]), torch)
        return 0
    sweep = "--decode-sweep" in argv
    variants, seqlens = None, SEQLENS
    if "--seqlens" in argv:
        seqlens = tuple(int(x) for x in argv[argv.index("--seqlens") + 1].split(","))
    if "--variants" in argv:
        i = argv.index("--variants") + 1
        specs = []
        while i < len(argv) and not argv[i].startswith("--"):
            specs.append(argv[i])
            i += 1
        variants = tuple(specs) or VARIANTS
        for spec in variants:
            parse_variant(spec)                               # a typo fails before any GPU work
    header = env.header(argv, {"name": torch.cuda.get_device_name(0), "driver": env.driver_version(),
                               "cuda_driver": env.driver_cuda_version()}, simulator=False)
    for k, v in header.items():
        print(f"# {k}: {v}")
    print(f"# shape: batch {BATCH}, seqlen_q 1, {NHEADS} query heads over {NHEADS_K} KV heads, head dim {HEADDIM}, "
          f"float16; paged caches: page {PAGE}, pages in random order")
    print(f"# GPU us: median of {REPS} calls, CUDA events after a {SLEEP_CYCLES}-cycle sleep kernel (the host "
          f"enqueues meanwhile), L2 flushed before each; kernels us: the call's kernel durations from the "
          f"profiler (CUPTI), mean of 10; per call us: {CALLS} back-to-back "
          f"calls, one sync, best of 3 (host time included); HBM bound: K and V bytes / {HBM_BYTES_PER_S:.1e} B/s")
    log = lambda s: print("# " + s, flush=True)                   # noqa: E731
    if variants is not None:
        print(f"# variants (flashnb.kvcache settings, each against the default): {'; '.join(variants)}")
        records = run_variants(torch, variants, seqlens, log=log)
    else:
        records = run(torch, seqlens=seqlens, sweep=sweep, log=log)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
