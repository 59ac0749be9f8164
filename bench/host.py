"""Host time per call: what one call costs the CPU, on a problem too small to keep the GPU busy.

On a tiny warm problem, (1, 16, 1, 64) float16 PyTorch tensors in flash-attn's layout (batch 1, 16
queries and keys, 1 head, head dim 64; SDPA gets the same as (1, 1, 16, 64)), the kernels take
microseconds, so back-to-back calls run as fast as the host can issue them: the time of one call is the
wall time of ``HOST_CALLS`` calls with one ``torch.cuda.synchronize`` at the end, divided by
``HOST_CALLS``; the median (and the minimum) of ``HOST_REPEATS`` such loops, after a few warm-up calls
(which compile flashnb's specialisation).  Small models, short sequences and decoding are bound by this
time, not by the kernels (bench/results/h100-host-2026-11-22.md, tools/host_time.py).

Rows:

* ``flashnb.torch.flash_attn_func``: the PyTorch entry point, through autograd (q, k, v require grad):
  fwd, and fwd+bwd (``torch.autograd.grad``);
* ``flashnb.flash_attention``: the array API without autograd: ``flash_attention(..., return_lse=True)``,
  ``flash_attention_backward`` from its saved ``out, lse``, and the two in a row;
* ``torch SDPA``: ``torch.nn.functional.scaled_dot_product_attention`` with PyTorch's own choice of
  backend, through autograd: fwd, and fwd+bwd.
"""
from __future__ import annotations

import statistics
import time

from bench.report import Column, Section

HOST_SHAPE = (1, 16, 1, 64)          # (batch, seqlen, nheads, headdim), float16
HOST_CALLS = 200
HOST_REPEATS = 5
HOST_WARMUP = 3
PASS_HEADERS = {"fwd": "fwd us", "bwd": "bwd us", "fwdbwd": "fwd+bwd us"}


def per_call_us(fn, synchronize, calls: int = HOST_CALLS, repeats: int = HOST_REPEATS) -> tuple[float, float]:
    """(median, min) over ``repeats`` loops of the wall time of ``calls`` back-to-back calls / ``calls``, in us."""
    for _ in range(HOST_WARMUP):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times), min(times)


def host_calls(torch):
    """[(implementation, pass, callable or None, why not)] for the rows of the table (see the module docstring)."""
    import torch.nn.functional as F
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(HOST_SHAPE, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
    leaves = tuple(x.detach().clone().requires_grad_(True) for x in (q, k, v))
    grad = lambda out, inputs, d: torch.autograd.grad(out, inputs, d)
    rows = []

    name = "flashnb.torch.flash_attn_func"
    try:
        import flashnb.torch
        f = flashnb.torch.flash_attn_func
        rows += [(name, "fwd", lambda: f(*leaves), None),
                 (name, "fwdbwd", lambda: grad(f(*leaves), leaves, dout), None)]
    except Exception as exc:                                    # noqa: BLE001 - say why, time the rest
        why = f"import flashnb.torch failed: {type(exc).__name__}: {exc}"
        rows += [(name, p, None, why) for p in ("fwd", "fwdbwd")]

    name = "flashnb.flash_attention"
    try:
        import flashnb
        fwd, bwd = flashnb.flash_attention, flashnb.flash_attention_backward
        out, lse = fwd(q, k, v, return_lse=True)
        rows += [(name, "fwd", lambda: fwd(q, k, v, return_lse=True), None),
                 (name, "bwd", lambda: bwd(dout, q, k, v, out, lse), None),
                 (name, "fwdbwd", lambda: bwd(dout, q, k, v, *fwd(q, k, v, return_lse=True)), None)]
    except Exception as exc:                                    # noqa: BLE001
        why = f"{type(exc).__name__}: {exc}"
        rows += [(name, p, None, why) for p in ("fwd", "bwd", "fwdbwd")]

    name = "torch SDPA"                                         # (batch, heads, seqlen, headdim) leaves
    sdpa_leaves = tuple(x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    sdpa_dout = dout.transpose(1, 2).contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(*sdpa_leaves)
    rows += [(name, "fwd", sdpa, None), (name, "fwdbwd", lambda: grad(sdpa(), sdpa_leaves, sdpa_dout), None)]
    return rows


def measure_host(torch, calls: int = HOST_CALLS, repeats: int = HOST_REPEATS) -> list[dict]:
    """One record per row of ``host_calls``: implementation, pass, us (median), us_min, status, note."""
    sync = torch.cuda.synchronize
    records = []
    for impl, pass_, fn, why in host_calls(torch):
        rec = {"impl": impl, "pass": pass_, "us": None, "us_min": None, "calls": calls, "repeats": repeats,
               "status": "n/a", "note": why or ""}
        if fn is not None:
            try:
                rec["us"], rec["us_min"] = per_call_us(fn, sync, calls, repeats)
                rec["status"] = "ok"
            except Exception as exc:                            # noqa: BLE001 - every failure becomes a row
                rec["note"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        records.append(rec)
    return records


def host_section(records: list[dict]) -> Section:
    """One row per implementation, a column per pass (median us per call, min in brackets)."""
    rows: dict[str, dict] = {}
    notes: list[str] = []
    for r in records:
        row = rows.setdefault(r["impl"], {"impl": r["impl"], "fwd": "", "bwd": "", "fwdbwd": "", "note": ""})
        if r["status"] == "ok":
            row[r["pass"]] = f"{r['us']:.0f} ({r['us_min']:.0f})"
        else:
            row[r["pass"]] = r["status"]
            if r["note"] and r["note"] not in notes:
                notes.append(r["note"])
            row["note"] = f"[{notes.index(r['note']) + 1}]" if r["note"] else ""
    b, n, h, d = HOST_SHAPE
    calls, repeats = (records[0]["calls"], records[0]["repeats"]) if records else (HOST_CALLS, HOST_REPEATS)
    cols = [Column("impl", "call"), *(Column(p, head, str) for p, head in PASS_HEADERS.items()),
            Column("note", "note", str)]
    title = (f"Host time per call: float16 B={b} N={n} H={h} d={d} (GPU work of microseconds), "
             f"{calls} back-to-back calls / {calls}, median (min) of {repeats} loops, us")
    return Section("host", title, cols, list(rows.values()),
                   notes=[f"[{i}] {t}" for i, t in enumerate(notes, 1)]
                   + ["fwd through autograd records the graph (q, k, v require grad); fwd+bwd = forward, then "
                      "torch.autograd.grad (flashnb.flash_attention: flash_attention_backward on its out, lse)"],
                   data=records)
