"""The IO-model table: predicted HBM traffic of standard vs flash attention, next to measured time.

Predictions come from ``reference.io_model`` (FlashAttention paper, section 3.2
and Theorem 2): standard attention (Algorithms 0 and 3) against the FA2 loop
order that flashnb's kernels use (forward: a query block stays on chip while K,
V stream; backward: ``delta`` precomputed, Algorithm 4's loops), with the
paper's block sizes for an SRAM of ``sram_bytes`` (Algorithm 1, line 1).  Every
element is counted at the input dtype's size.  Rows: the paper's Figure 2
setting (GPT-2 medium, fp16) and the non-causal shapes of the sweep.

The measured columns (a GPU only) are the median times of the same shapes:
standard = ``torch-materialised`` (else ``cupy-materialised``), flash = the
fastest flashnb backend.
"""
from __future__ import annotations

from bench.cases import Case, sweep
from bench.report import CASE_KEYS, Column, Section, fmt_ms

STANDARD_IMPLS = ("torch-materialised", "cupy-materialised")
ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
FIGURE2_LABEL = "Figure 2"


def figure2_case() -> Case:
    from reference.io_model import FIGURE2_SETTING as s
    return Case("float16", s["batch"], s["nheads"], s["nheads"], s["seqlen"], s["seqlen"], s["headdim"], False)


def io_cases(dtype="float16", seqlens=(512, 1024, 2048, 4096, 8192, 16384), headdims=(64, 128),
             **sweep_kw) -> list[tuple[str, Case]]:
    """(label, case): Figure 2's setting, then the non-causal sweep (no window or dropout: not modelled)."""
    cases = [(FIGURE2_LABEL, figure2_case())]
    cases += [("sweep", c) for c in sweep((dtype,), seqlens, headdims, (False,), **sweep_kw)]
    return cases


def predict(case: Case, sram_bytes: int | None = None) -> dict:
    """HBM bytes of standard and flash (FA2) attention, forward and backward, for ``case``."""
    from reference import io_model as m
    sram = m.A100_SRAM_BYTES if sram_bytes is None else sram_bytes
    elem = ELEM_BYTES[case.dtype]
    br, bc = m.paper_block_sizes(case.headdim, sram, elem)
    args = (case.batch, case.nheads, case.seqlen_q, case.seqlen_k, case.headdim)
    gqa = {"nheads_k": case.nheads_k}
    return {
        "block_q": bc, "block_k": br,   # FA2's forward keeps the query block: (Bc, Br), as io_model.flash_hbm_bytes
        "std_fwd_bytes": m.standard_forward_io(*args, **gqa).bytes(elem),
        "std_bwd_bytes": m.standard_backward_io(*args, **gqa).bytes(elem),
        "flash_fwd_bytes": m.flash2_forward_io(*args, bc, br, **gqa).bytes(elem),
        "flash_bwd_bytes": m.flash2_backward_io(*args, br, bc, **gqa).bytes(elem),
    }


def _measured(results: list[dict], case: Case, pass_: str, impls) -> tuple[str | None, float | None]:
    """(impl, median ms) of the fastest ok result among ``impls`` for this case and pass."""
    key = tuple(case.fields()[k] for k in CASE_KEYS)
    best = None
    for r in results:
        if r["status"] == "ok" and r["pass"] == pass_ and tuple(r[k] for k in CASE_KEYS) == key \
                and impls(r["impl"]) and (best is None or r["ms"] < best[1]):
            best = (r["impl"], r["ms"])
    return best or (None, None)


def _standard(results, case, pass_):
    for name in STANDARD_IMPLS:                    # first available standard impl, in order
        got = _measured(results, case, pass_, lambda i, n=name: i == n)
        if got[0]:
            return got
    return None, None


def io_records(cases: list[tuple[str, Case]], results: list[dict], sram_bytes: int | None = None) -> list[dict]:
    out = []
    for label, case in cases:
        rec = {"setting": label, **case.fields(), **predict(case, sram_bytes)}
        rec["ratio"] = (rec["std_fwd_bytes"] + rec["std_bwd_bytes"]) / (rec["flash_fwd_bytes"] + rec["flash_bwd_bytes"])
        for p in ("fwd", "bwd"):
            rec[f"std_impl_{p}"], rec[f"std_{p}_ms"] = _standard(results, case, p)
            rec[f"flash_impl_{p}"], rec[f"flash_{p}_ms"] = _measured(results, case, p,
                                                                    lambda i: i.startswith("flashnb"))
        out.append(rec)
    return out


def io_section(cases, results, sram_bytes: int | None = None, measured: bool = True) -> Section:
    from reference import io_model as m
    records = io_records(cases, results, sram_bytes)
    gb = lambda x: "" if x is None else f"{x / 1e9:.3g}"
    cols = [Column("setting", "setting"), Column("dtype", "dtype"), Column("batch", "B"), Column("nheads", "H"),
            Column("seqlen_q", "N"), Column("headdim", "d"),
            Column("std_fwd_bytes", "std fwd GB", gb), Column("flash_fwd_bytes", "flash fwd GB", gb),
            Column("std_bwd_bytes", "std bwd GB", gb), Column("flash_bwd_bytes", "flash bwd GB", gb),
            Column("ratio", "std/flash", lambda x: f"{x:.1f}x")]
    if measured:
        cols += [Column("std_fwd_ms", "std fwd ms", fmt_ms), Column("flash_fwd_ms", "flash fwd ms", fmt_ms),
                 Column("std_bwd_ms", "std bwd ms", fmt_ms), Column("flash_bwd_ms", "flash bwd ms", fmt_ms)]
    sram = m.A100_SRAM_BYTES if sram_bytes is None else sram_bytes
    fig2 = m.figure2_comparison(sram)
    notes = [
        f"Model: reference.io_model closed forms; standard = Algorithms 0 + 3, flash = FA2 loop order; "
        f"block sizes from an SRAM of {sram // 1024} KiB (paper, Algorithm 1 line 1); GB = 1e9 bytes; "
        f"std/flash = predicted bytes of standard over flash, fwd + bwd.",
        f"Figure 2 check (fwd + bwd, fp16): model {fig2['standard_gb']:.1f} GB standard vs "
        f"{fig2['flash1_gb']:.1f} GB FA1 / {fig2['flash2_gb']:.1f} GB FA2; the paper measured "
        f"{fig2['paper_standard_gb']} GB vs {fig2['paper_flash_gb']} GB on an A100.",
    ]
    if measured:
        std_names = sorted({r[k] for r in records for k in ("std_impl_fwd", "std_impl_bwd") if r[k]})
        flash_names = sorted({r[k] for r in records for k in ("flash_impl_fwd", "flash_impl_bwd") if r[k]})
        notes.append(f"Measured (median ms): standard = {', '.join(std_names) or 'not measured'}; "
                     f"flash = {', '.join(flash_names) or 'not measured'} (the fastest flashnb backend per cell).")
    else:
        notes.append("Measured times need a GPU: run `python -m bench --io` on a machine with CUDA.")
    return Section("io_model", "IO model: predicted HBM traffic, standard vs flash attention", cols, records, notes)
