"""Validation before timing: flashnb against the oracle at toy sizes.

Runs ``flashnb.flash_attention`` (with ``return_lse``) and
``flash_attention_backward`` once per backend and dtype on tiny NumPy inputs
(so it also works in Numba's CUDA simulator, about 2 s per case) and compares
``out, lse, dq, dk, dv`` with ``reference.attention`` / ``attention_backward``
(float64) on the same rounded inputs.  The shape is chosen to break naive code:
seqlen_q != seqlen_k (bottom-right causal), neither a multiple of a tile, and
grouped-query attention.
"""
from __future__ import annotations

import time
import warnings

import numpy as np

from bench.impls import accepts

# Toy problem: (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
SMOKE_SHAPE = (1, 9, 13, 2, 1, 16)
SMOKE_CAUSAL = True
# Max |flashnb - oracle| allowed; inputs are N(0, 1): fp32 rounding gives ~1e-6, fp16 ~5e-4
TOLERANCE = {"float32": 1e-4, "float16": 1e-2}


def _inputs(dtype: str, seed: int = 0):
    b, nq, nk, h, hk, d = SMOKE_SHAPE
    rng = np.random.default_rng(seed)
    shapes = [(b, nq, h, d), (b, nk, hk, d), (b, nk, hk, d), (b, nq, h, d)]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]       # q, k, v, dout


def smoke_run(dtypes=("float32", "float16"), backends=None) -> list[dict]:
    """One record per (backend, dtype): status "ok" / "FAIL" / "n/a" / "unavailable", max errors.

    ``backends``: which to validate (default every entry of ``flashnb.BACKENDS``; ``("auto",)`` checks
    what a caller gets without choosing, with fewer kernels to compile)."""
    b, nq, nk, h, hk, d = SMOKE_SHAPE
    shape = f"B={b} Nq={nq} Nk={nk} H={h} Hk={hk} d={d} causal={SMOKE_CAUSAL}"
    try:
        import flashnb
        forward, backward = flashnb.flash_attention, flashnb.flash_attention_backward
        backends = tuple(getattr(flashnb, "BACKENDS", ("simt",))) if backends is None else tuple(backends)
    except Exception as exc:                           # noqa: BLE001 - ImportError, AttributeError, or a broken import
        return [{"impl": "flashnb", "dtype": "", "shape": shape, "status": "unavailable",
                 "detail": f"flashnb cannot be run yet: {type(exc).__name__}: {exc}"}]
    from reference import attention, attention_backward

    records = []
    for backend in backends:
        for dtype in dtypes:
            rec = {"impl": f"flashnb-{backend}", "dtype": dtype, "shape": shape}
            q, k, v, dout = _inputs(dtype)
            t0 = time.perf_counter()
            try:
                kw = {"causal": SMOKE_CAUSAL}
                fwd_kw = dict(kw, backend=backend) if accepts(forward, "backend") else kw
                bwd_kw = dict(kw, backend=backend) if accepts(backward, "backend") else kw
                with warnings.catch_warnings():     # toy grids and host arrays: Numba's performance
                    warnings.simplefilter("ignore")  # warnings say nothing about the real runs
                    out, lse = forward(q, k, v, return_lse=True, **fwd_kw)
                    dq, dk, dv = backward(dout, q, k, v, out, lse, **bwd_kw)
            except Exception as exc:                       # noqa: BLE001 - a refusal is a result too
                rec.update(status="n/a", detail=f"{type(exc).__name__}: {exc}")
                records.append(rec)
                continue
            ref_out, ref_lse = attention(q, k, v, **kw)
            ref_dq, ref_dk, ref_dv = attention_backward(dout, q, k, v, **kw)
            errors = {name: float(np.max(np.abs(np.asarray(got, np.float64) - want)))
                      for name, got, want in (("out", out, ref_out), ("lse", lse, ref_lse), ("dq", dq, ref_dq),
                                              ("dk", dk, ref_dk), ("dv", dv, ref_dv))}
            worst = max(errors.values())
            ok = worst <= TOLERANCE[dtype]              # False for NaN too
            rec.update(status="ok" if ok else "FAIL", max_error=worst, tolerance=TOLERANCE[dtype],
                       seconds=time.perf_counter() - t0,
                       detail=", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
            records.append(rec)
    return records
