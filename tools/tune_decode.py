"""The KV-cache decode kernels' settings against each other, at ``python -m bench --decode``'s shape (GPU).

Three modes, each on ``bench.decode``'s shape, inputs, timing and table (batch 16, one query token, 32 query heads
over 8 KV heads, head dim 128, float16; GPU us, kernels us, per call us, against SDPA and the HBM bound):

* ``python -m tools.tune_decode [SPEC ...]``: the A/B of kernel candidates, dense caches.  Per cache length the
  default flashnb, flashnb under each SPEC (comma-separated ``NAME=INT`` settings of ``flashnb.kvcache``, e.g.
  ``LEAN=1,STAGES=6``; none given: ``VARIANTS``), flashnb reading SDPA's layout (``(batch, heads, keys, dim)``
  storage seen through a transposed view: the same bytes SDPA reads), the device-metadata rows (``seqlens
  tensor``, ``paged``), the dense cache read as pages in order, SDPA FlashAttention-2 on its layout and on the
  cache's (``(batch, keys, heads, dim)`` storage, transposed), with ``kernels vs default`` (the default's kernel
  time over the row's).  Older records: ``python -m bench.decode --variants [SPEC ...]``.
* ``python -m tools.tune_decode --sweep``: ``bench --decode``'s table with the tuning rows: flashnb at fixed split
  counts (1, 4, 8), ``flashnb (pages in order)`` (the dense cache's own memory read as pages through a block table
  ``0, 1, 2, ..``: the paged kernel at the dense row's addresses, which separates the cost of the table from that
  of scattered pages), ``flashnb flash_attention backend=tensorcore`` (the generic call kept on the generic
  tensor-core forward: what it ran before ``plan.split_kv`` routed it to the decode kernels), then flashnb at
  other lane layouts (``SWEEP``: stages, keys per lane, values per lane) at 4k and 32k keys.  Older records:
  ``python -m bench --decode --decode-sweep``.
* ``python -m tools.tune_decode --precompile I`` (I in 0-3): compile part I of the kernels the two modes above use
  into flashnb's disk cache, on small inputs of the same specialisations, so that four processes compile in
  parallel while something else runs (bench/results/h100-decode-2026-11-25.md, run 3).  Older records:
  ``python -m bench.decode --precompile I``.

``--seqlens 4096,32768`` limits the lengths (not the lane layouts').  The settings are module globals of
``flashnb.kvcache``, read at every call, so a candidate needs no code edit; ``settings`` restores them after a row.
"""
from __future__ import annotations

import contextlib
import sys

from bench import decode
from bench.decode import BATCH, HEADDIM, NHEADS, NHEADS_K, PAGE, SEQLENS

SWEEP = ((0, 2, 64), (3, 2, 64))   # (STAGES, KEYS_PER_LANE, E_BUDGET) of --sweep's lane-layout rows
VARIANTS = (                        # the A/B's candidates (flashnb.kvcache settings), each against the default
    "LEAN=0,NWARPS=4,BLOCKS_PER_SM=2",                           # the default before run 4 of the record
    "NWARPS=4,BLOCKS_PER_SM=2",                                  # LEAN alone
    "E_BUDGET=32,BLOCKS_PER_SM=3,STAGES=6,NWARPS=4",             # 16 lanes a key, 164 registers: 12 warps an SM
)


def parse_variant(spec):
    """``"NAME=INT,NAME=INT"`` -> {NAME: int}, each NAME an int (or bool) setting of ``flashnb.kvcache``."""
    from flashnb import kvcache
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, value = item.partition("=")
        if not name.isupper() or not isinstance(getattr(kvcache, name, None), int):
            raise ValueError(f"variant {spec!r}: {name!r} is not an int setting of flashnb.kvcache")
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


def in_order(torch, kc, vc):
    """The dense caches seen as pages of ``PAGE`` rows (no copy), sequence ``b``'s pages ``b * per ..``, and their
    block table: the same bytes as the dense cache, read through the table."""
    per = kc.shape[1] // PAGE
    table = torch.arange(BATCH * per, dtype=torch.int32, device="cuda").view(BATCH, per)
    return kc.view(-1, PAGE, NHEADS_K, HEADDIM), vc.view(-1, PAGE, NHEADS_K, HEADDIM), table


def run_variants(torch, variants, seqlens=SEQLENS, log=print):
    """The A/B table: dense decode at each length, the default against each variant, the layouts, SDPA."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashnb

    specs = [(spec, parse_variant(spec)) for spec in variants]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").zero_
    sdpa = F.scaled_dot_product_attention
    call = flashnb.flash_attn_with_kvcache
    records = []
    g = torch.Generator(device="cuda")
    for n in seqlens:
        x = decode.inputs(torch, g, n)
        q, kc, vc = x.q, x.kc, x.vc
        kpo, vpo, table_o = in_order(torch, kc, vc)
        rows = [("flashnb", "dense", {}, lambda: call(q, kc, vc, cache_seqlens=n))]
        rows += [(f"flashnb {spec}", "dense", o, lambda: call(q, kc, vc, cache_seqlens=n)) for spec, o in specs]
        rows += [
            ("flashnb (sdpa layout)", "dense", {},
             lambda: call(q, x.k_sdpa.transpose(1, 2), x.v_sdpa.transpose(1, 2), cache_seqlens=n)),
            ("flashnb (seqlens tensor)", "dense", {}, lambda: call(q, kc, vc, cache_seqlens=x.lens_t)),
            ("flashnb", "paged", {}, lambda: call(q, x.kp, x.vp, cache_seqlens=x.lens_t, block_table=x.table)),
            ("flashnb (pages in order)", "paged", {},
             lambda: call(q, kpo, vpo, cache_seqlens=x.lens_t, block_table=table_o)),
            ("sdpa-flash", "dense", SDPBackend.FLASH_ATTENTION, lambda: sdpa(x.q_packed, x.k_sdpa, x.v_sdpa)),
            ("sdpa-flash (cache layout)", "dense", SDPBackend.FLASH_ATTENTION,
             lambda: sdpa(x.q_packed, kc.transpose(1, 2), vc.transpose(1, 2))),
        ]
        for name, layout, how, fn in rows:
            context = (lambda h=how: settings(h)) if isinstance(how, dict) else (lambda h=how: sdpa_kernel(h))
            records.append(decode.record(torch, n, name, layout, context, fn, x.ref, flush, log))
        del x, q, kc, vc, kpo, vpo, rows
        torch.cuda.empty_cache()
    decode.speedups(records)
    base = {r["seqlen_k"]: r.get("kernel_us") for r in records if r["impl"] == "flashnb" and r["layout"] == "dense"}
    for r in records:
        if r.get("kernel_us") and base.get(r["seqlen_k"]) and r["impl"].startswith("flashnb"):
            r["kernels_vs_default"] = base[r["seqlen_k"]] / r["kernel_us"]
    return records


def sweep_rows(torch):
    """``bench.decode.run``'s ``extra_rows``: fixed split counts, pages in order, the generic tensor-core forward."""
    import flashnb
    call = flashnb.flash_attn_with_kvcache

    def rows(x):
        kpo, vpo, table_o = in_order(torch, x.kc, x.vc)
        out = [("flashnb (pages in order)", "paged",
                lambda: call(x.q, kpo, vpo, cache_seqlens=x.lens_t, block_table=table_o)),
               ("flashnb flash_attention backend=tensorcore", "dense",
                lambda: flashnb.flash_attention(x.q, x.kc, x.vc, causal=True, backend="tensorcore"))]
        for splits in (1, 4, 8):
            out.append((f"flashnb splits={splits}", "dense",
                        lambda s=splits: call(x.q, x.kc, x.vc, cache_seqlens=x.n, num_splits=s)))
        return out
    return rows


def lane_sweep(torch, log=print):
    """flashnb at other lane layouts (``SWEEP``: stages, keys per lane T, values per lane budget E): 4k and 32k,
    dense."""
    import flashnb
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").zero_
    out = []
    for stages, t, e in SWEEP:
        with settings({"STAGES": stages, "KEYS_PER_LANE": t, "E_BUDGET": e}):
            for n in (4096, 32768):
                q = torch.randn(BATCH, 1, NHEADS, HEADDIM, device="cuda", dtype=torch.float16)
                kc = torch.randn(BATCH, n, NHEADS_K, HEADDIM, device="cuda", dtype=torch.float16)
                vc = torch.randn_like(kc)
                fn = lambda: flashnb.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n)   # noqa: E731
                rec = dict(seqlen_k=n, layout="dense", impl=f"flashnb stages={stages} T={t} E={e}",
                           hbm_bound_us=round(decode.hbm_bound_us(n), 1))
                try:
                    fn()
                    rec["gpu_us"] = decode.gpu_us(torch, fn, flush)
                    rec["gpu_vs_hbm"] = rec["gpu_us"] / rec["hbm_bound_us"]
                    rec["kernel_us"], rec["kernels"] = decode.kernel_us(torch, fn, flush)
                except Exception as exc:                      # noqa: BLE001
                    rec["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                out.append(rec)
                log(decode.row_line(rec))
                del q, kc, vc
    return out


def precompile(part, torch):
    """Compile part ``part`` (0-3) of the kernels the sweep uses into flashnb's disk cache, on small inputs of the
    same specialisations (contiguous float16, head dim 128, 4 query heads per KV head, batch 16 x 8 KV heads:
    the same split decision)."""
    import flashnb
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
            with settings({"STAGES": stages, "KEYS_PER_LANE": t, "E_BUDGET": e}):
                call(q, kc, vc, cache_seqlens=n)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    from bench import env
    argv = sys.argv[1:] if argv is None else list(argv)
    specs = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] not in
                                                                          ("--seqlens", "--precompile"))]
    variants = tuple(specs) or VARIANTS
    for spec in variants:
        parse_variant(spec)                                       # a typo fails before any GPU work
    if env.use_simulator_if_no_gpu():
        print("tools.tune_decode: no CUDA device (or NUMBA_ENABLE_CUDASIM=1): nothing measured.")
        return 0
    import torch
    if "--precompile" in argv:
        precompile(int(argv[argv.index("--precompile") + 1]), torch)
        return 0
    header = env.header(argv, {"name": torch.cuda.get_device_name(0), "driver": env.driver_version(),
                               "cuda_driver": env.driver_cuda_version()}, simulator=False)
    header["command"] = " ".join(["python", "-m", "tools.tune_decode", *argv])
    for k, v in header.items():
        print(f"# {k}: {v}")
    decode.print_header()
    log = lambda s: print("# " + s, flush=True)                   # noqa: E731
    seqlens = decode.seqlens_option(argv)
    if "--sweep" in argv:
        records = decode.run(torch, seqlens=seqlens, log=log, extra_rows=sweep_rows(torch))
        records += lane_sweep(torch, log=log)
        decode.speedups(records)
    else:
        print(f"# variants (flashnb.kvcache settings, each against the default): {'; '.join(variants)}")
        records = run_variants(torch, variants, seqlens, log=log)
    print(decode.table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
