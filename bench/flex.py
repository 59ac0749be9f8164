"""``python -m bench --flex``: ``flashnb.flex_attention`` against PyTorch's ``flex_attention`` under
``torch.compile`` with the same functions (issue 43's targets), and against flashnb's dense call.

Shapes: bfloat16, one sequence of ``SEQLEN`` = 16384 tokens, nheads * headdim = 2048, head dim 64 and 128.
Cases (each written twice, as plain Python for flashnb and with torch ops for PyTorch):

* ``causal``: mask ``q_idx >= kv_idx``;
* ``document``: 8 documents of random lengths (seed 0) packed in the sequence, causal within each (ids captured:
  an int8 NumPy array for flashnb (16 KB, read twice: 32 KB of constant memory), a CUDA tensor for PyTorch);
* ``document cuda``: the same documents with the ids a captured CUDA tensor for both libraries (flashnb reads it
  from global memory in place; a captured NumPy array is a constant of the kernel, read from constant memory);
* ``sliding 1024``: causal with a window of 1024 keys;
* ``alibi``: causal, score_mod ``score - slope_h * (q_idx - kv_idx)`` (flashnb: the slopes a captured float32 array);
* ``softcap 30``: causal, score_mod ``30 tanh(score / 30)`` (flashnb: ``math.tanh`` and its ``score_mod_grad``);
* ``none``: no function at all (flex's overhead against the dense call).

Rows: ``flashnb flex`` (``flashnb.torch.flex_attention``, the block mask made once), ``torch flex compiled``
(``torch.compile(flex_attention)``, its ``create_block_mask`` made once), ``flashnb dense`` where the case is a
built-in option (``flash_attn_func`` with causal, a window, ``alibi_slopes`` or ``softcap``).  Times: median of
CUDA-event times of one call after warm-up (host time included: the events bracket the Python call), forward
and forward+backward (``torch.autograd.grad`` of q, k, v); TFLOP/s from the pairs the mask keeps (4 h d pairs
forward, 3.5x forward+backward).  Before timing: flashnb's and PyTorch's outputs compared (``max |err|``).
Without a GPU it says why nothing is timed and stops.
"""
from __future__ import annotations

import math
import statistics
import sys

from bench.report import record_line, record_table

SEQLEN, HIDDEN, DOCS, WINDOW, SOFTCAP, SEED = 16384, 2048, 8, 1024, 30.0, 0
HEADDIMS = (64, 128)
CASES = ("causal", "document", "document cuda", "sliding 1024", "alibi", "softcap 30", "none")
BLOCK = 128
REPS, WARMUP = 10, 3


def document_ids(seqlen=SEQLEN, docs=DOCS, seed=SEED):
    """Document id of every token: ``docs`` documents of random lengths (cut points uniform, seeded)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, seqlen), docs - 1, replace=False))
    ids = np.zeros(seqlen, np.int8)
    for c in cuts:
        ids[c:] += 1
    return ids


def alibi_slopes(nheads):
    """ALiBi's slopes: 2^(-8 (h + 1) / nheads)."""
    return tuple(2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads))


def allowed_pairs(case, seqlen=SEQLEN, ids=None):
    """(query, key) pairs the case's mask keeps: causal n (n + 1) / 2, a window's band, documents' triangles."""
    if case == "none":
        return seqlen * seqlen
    if case == "sliding 1024":
        w = WINDOW
        return sum(min(i, w) + 1 for i in range(seqlen))
    if case in ("document", "document cuda"):
        import numpy as np
        ids = document_ids(seqlen) if ids is None else ids
        return sum(n * (n + 1) // 2 for n in np.bincount(ids))
    return seqlen * (seqlen + 1) // 2


def flops(case, nheads, headdim, what, seqlen=SEQLEN):
    fwd = 4 * nheads * headdim * allowed_pairs(case, seqlen)
    return {"fwd": fwd, "fwdbwd": 3.5 * fwd}[what]


def cuda_ids(ids):
    """The document ids as a CUDA tensor (what PyTorch's case captures)."""
    import torch
    return torch.as_tensor(ids, device="cuda")


def flashnb_mods(case, nheads, ids):
    """(score_mod, mask_mod, score_mod_grad) of a case, plain Python for flashnb."""
    import numpy as np
    if case == "document cuda":
        ids, case = cuda_ids(ids), "document"
    slopes = np.array(alibi_slopes(nheads), np.float32)    # a table indexed by h: an array (docs/flex.md)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * math.tanh(score / SOFTCAP)

    def softcap_grad(score, b, h, q_idx, kv_idx):
        t = math.tanh(score / SOFTCAP)
        return 1.0 - t * t

    return {"causal": (None, causal, None), "document": (None, document, None), "sliding 1024": (None, sliding, None),
            "alibi": (alibi, causal, None), "softcap 30": (softcap, causal, softcap_grad),
            "none": (None, None, None)}[case]


def torch_mods(torch, case, nheads, ids):
    """The same case with torch ops, for PyTorch's flex_attention."""
    case = "document" if case == "document cuda" else case
    slopes = torch.tensor(alibi_slopes(nheads), device="cuda")
    ids = torch.as_tensor(ids, device="cuda")

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    return {"causal": (None, causal), "document": (None, document), "sliding 1024": (None, sliding),
            "alibi": (alibi, causal), "softcap 30": (softcap, causal), "none": (None, None)}[case]


def dense_options(case, nheads):
    """``flash_attn_func``'s options for a case the built-in options express (None: no such call)."""
    import torch
    return {"causal": dict(causal=True), "sliding 1024": dict(causal=True, window_size=(WINDOW, 0)),
            "alibi": dict(causal=True, alibi_slopes=torch.tensor(alibi_slopes(nheads), device="cuda")),
            "softcap 30": dict(causal=True, softcap=SOFTCAP), "none": {}}.get(case)


def _gpu_ms(torch, fn, reps=REPS, warmup=WARMUP):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(torch, headdims=HEADDIMS, cases=CASES, log=print):
    """The table's records: dict(headdim, case, impl, fwd_ms, fwdbwd_ms, fwd_tflops, fwdbwd_tflops,
    vs_torch_fwd, vs_torch_fwdbwd, max_err, note)."""
    from torch.nn.attention import flex_attention as tflex

    import flashnb
    import flashnb.torch as ft

    import torch._dynamo
    # one compiled function for every case: each new score_mod / mask_mod is a recompile, past Dynamo's default
    # limit of 8 it would fall back to the eager flex_attention, which materialises the scores (out of memory)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    compiled = torch.compile(tflex.flex_attention)
    ids = document_ids()
    records = []
    for d in headdims:
        h = HIDDEN // d
        gen = torch.Generator(device="cuda").manual_seed(SEED)
        q, k, v = (torch.randn(1, h, SEQLEN, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for _ in range(3))
        dout = torch.randn(1, h, SEQLEN, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for case in cases:
            score_mod, mask_mod, grad = flashnb_mods(case, h, ids)
            t_score, t_mask = torch_mods(torch, case, h, ids)
            mask = None if mask_mod is None else flashnb.create_block_mask(mask_mod, None, None, SEQLEN, SEQLEN,
                                                                          BLOCK_SIZE=BLOCK)
            t_block = None if t_mask is None else tflex.create_block_mask(t_mask, None, None, SEQLEN, SEQLEN,
                                                                          device="cuda", BLOCK_SIZE=BLOCK)

            def ours(q=q, k=k, v=v, sm=score_mod, m=mask, g=grad):
                return ft.flex_attention(q, k, v, score_mod=sm, block_mask=m, score_mod_grad=g)

            def theirs(q=q, k=k, v=v, sm=t_score, m=t_block):
                return compiled(q, k, v, score_mod=sm, block_mask=m)

            rows = [("flashnb flex", ours, ""), ("torch flex compiled", theirs, "")]
            opts = dense_options(case, h)
            if opts is not None:
                def dense(q=q, k=k, v=v, o=opts):
                    return ft.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              **o).transpose(1, 2)
                rows.append(("flashnb dense", dense, ", ".join(f"{key}" for key in opts)))
            with torch.no_grad():
                err = float((ours().float() - theirs().float()).abs().max())
            log(f"d={d} {case}: flashnb flex vs torch flex max |err| {err:.2e}")
            base = {}
            for name, fwd, note in rows:
                rec = dict(headdim=d, case=case, impl=name, note=note, max_err=err if name == "flashnb flex" else None)
                try:
                    with torch.no_grad():
                        rec["fwd_ms"] = _gpu_ms(torch, fwd)
                    rec["fwdbwd_ms"] = _gpu_ms(torch, lambda fwd=fwd: torch.autograd.grad(fwd(), (q, k, v), dout))
                except Exception as exc:                     # noqa: BLE001 - a row that cannot run says why
                    rec["note"] = f"{note}; failed: {type(exc).__name__}: {exc}"[:200]
                    records.append(rec)
                    continue
                for what in ("fwd", "fwdbwd"):
                    ms = rec[f"{what}_ms"]
                    rec[f"{what}_tflops"] = flops(case, h, d, what) / (ms * 1e-3) / 1e12
                    if name == "torch flex compiled":
                        base[what] = ms
                records.append(rec)
                log(record_line(rec, COLUMNS))
            for rec in records[-len(rows):]:
                for what in ("fwd", "fwdbwd"):
                    if what in base and rec.get(f"{what}_ms"):
                        rec[f"vs_torch_{what}"] = base[what] / rec[f"{what}_ms"]
    return records


COLUMNS = (("headdim", "d", "d"), ("case", "case", "s"), ("impl", "impl", "s"), ("fwd_ms", "fwd ms", ".3f"),
           ("fwdbwd_ms", "fwd+bwd ms", ".3f"), ("fwd_tflops", "fwd TFLOP/s", ".1f"),
           ("fwdbwd_tflops", "fwd+bwd TFLOP/s", ".1f"), ("vs_torch_fwd", "fwd speed vs torch flex", ".2f"),
           ("vs_torch_fwdbwd", "fwd+bwd speed vs torch flex", ".2f"), ("max_err", "max |err|", ".1e"),
           ("note", "note", "s"))


def table(records):
    """A markdown table of the records."""
    return record_table(records, COLUMNS)


def main(argv=None) -> int:
    """Entry of ``python -m bench --flex``; the simulator (no GPU) only says why nothing is timed."""
    from bench import env
    argv = sys.argv[1:] if argv is None else list(argv)
    torch = env.gpu_section(argv, "flex", "flex", "tests/kernels/test_kernel_flex.py")
    if torch is None:
        return 0
    print(f"# one sequence of {SEQLEN} tokens, nheads * headdim = {HIDDEN}, bfloat16; block masks of {BLOCK}; "
          f"ms: median of {REPS} calls after {WARMUP}, CUDA events around the Python call (host time included); "
          "speed vs torch flex: its time / the row's (above 1: faster than PyTorch's compiled flex_attention)")
    headdims = HEADDIMS
    if "--headdims" in argv:                       # e.g. --headdims 64 (one run per head dim fits a time limit)
        headdims = tuple(int(d) for d in argv[argv.index("--headdims") + 1].split(","))
    cases = CASES
    if "--cases" in argv:                          # e.g. --cases "causal,sliding 1024"
        cases = tuple(argv[argv.index("--cases") + 1].split(","))
        for case in cases:
            if case not in CASES:
                raise SystemExit(f"--cases: {case!r} is not one of {', '.join(CASES)}")
    records = run(torch, headdims=headdims, cases=cases, log=lambda s: print("# " + s, flush=True))
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
