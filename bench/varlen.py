"""``python -m bench --varlen``: a packed batch of random lengths (issue 23's varlen target) against the dense
kernels on the same tokens and against padding to the longest sequence.

The batch: sequences of random lengths (uniform in 128..4096, seed 0) packed to ``TOKENS`` = 16384 tokens,
nheads * headdim = 2048 (flash-attn's benchmark convention), float16, head dim 64 and 128, causal or not.
Rows (all through ``flashnb.torch`` / PyTorch autograd on CUDA tensors; fwd+bwd = forward, then
``torch.autograd.grad`` of q, k, v):

* ``flashnb varlen``: ``flashnb.torch.flash_attn_varlen_func`` on the packed tensors, ``cu_seqlens`` as CPU
  int32 tensors (read on the host with no synchronisation; a CUDA tensor would cost a device-to-host copy per
  call, ``flashnb.varlen``).
* ``flashnb dense, each sequence``: ``flash_attn_func`` on each sequence alone, one after another: the dense
  kernels' time on exactly the same tokens and FLOPs (plus a launch per sequence).
* ``flashnb dense, equal lengths``: ``flash_attn_func`` on a dense batch of equal lengths ``L`` with about the
  same tokens and the same attention FLOPs (``L = sum(len^2) / sum(len)``, rounded to 64): the dense kernels'
  throughput at this batch's effective length.
* ``flashnb padded`` / ``sdpa-flash padded``: every sequence padded to the longest (``batch x max_len``), no
  padding mask (a lower bound for padding: a mask would add work), flashnb's dense call and PyTorch SDPA's
  FlashAttention-2 backend (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``, the reference point).

Times: median of CUDA-event times of one call (L2 flushed before each); ``TFLOP/s``: the packed batch's useful
FLOPs (4 * nheads * d * allowed (query, key) pairs per sequence; bwd 2.5x) over the row's time, so the padded
rows' wasted work shows as lower throughput; ``vs varlen``: the row's time / varlen's (above 1: varlen is faster).
Before timing, varlen's forward is compared with the dense per-sequence forward (``max |err|``).  Without a GPU
(the simulator) it says why nothing is timed and stops.
"""
from __future__ import annotations

import statistics
import sys

from bench.report import record_line, record_table

TOKENS, HIDDEN, MIN_LEN, MAX_LEN, SEED = 16384, 2048, 128, 4096, 0
HEADDIMS, CAUSAL = (64, 128), (False, True)
REPS, WARMUP = 20, 3


def random_lengths(tokens=TOKENS, low=MIN_LEN, high=MAX_LEN, seed=SEED):
    """Lengths uniform in ``low..high`` (numpy's ``default_rng(seed)``) until they sum to ``tokens`` (the last one
    cut to fit)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(min(rng.integers(low, high + 1), tokens - sum(lengths))))
    return lengths


def pairs(lengths, causal):
    """Allowed (query, key) pairs of the packed batch: ``len^2`` per sequence, ``len (len + 1) / 2`` causal."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def flops(lengths, nheads, headdim, causal, what):
    """Useful FLOPs of the packed batch: fwd = 4 * nheads * headdim * pairs, bwd 2.5x, fwd+bwd 3.5x."""
    fwd = 4 * nheads * headdim * pairs(lengths, causal)
    return {"fwd": fwd, "fwdbwd": 3.5 * fwd}[what]


def equal_length(lengths, multiple=64):
    """The length of a dense batch with the packed batch's tokens and attention FLOPs: sum(len^2) / sum(len)."""
    eff = sum(n * n for n in lengths) / sum(lengths)
    return max(multiple, int(round(eff / multiple)) * multiple)


def _gpu_ms(torch, fn, flush, reps=REPS, warmup=WARMUP):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(torch, headdims=HEADDIMS, causals=CAUSAL, lengths=None, log=print):
    """The varlen table's records: dict(headdim, causal, impl, fwd_ms, fwdbwd_ms, fwd_tflops, fwdbwd_tflops,
    vs_varlen_fwd, vs_varlen_fwdbwd, max_err, note)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashnb.torch as ft

    lengths = lengths or random_lengths()
    total, longest, batch = sum(lengths), max(lengths), len(lengths)
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(batch)], dtype=torch.int32)   # CPU: no sync
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    records = []
    for d in headdims:
        h = HIDDEN // d
        gen = torch.Generator(device="cuda").manual_seed(SEED)
        q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.float16, generator=gen).requires_grad_()
                   for _ in range(3))
        dout = torch.randn(total, h, d, device="cuda", dtype=torch.float16, generator=gen)
        seqs = [slice(int(cu[i]), int(cu[i + 1])) for i in range(batch)]
        # each sequence's own leaf tensors (slices of q would add autograd's slice-backward copies to its time)
        each = [tuple(x.detach()[s][None].clone().requires_grad_() for x in (q, k, v)) for s in seqs]
        each_dout = [dout[s][None] for s in seqs]
        pad = [torch.zeros(batch, longest, h, d, device="cuda", dtype=torch.float16) for _ in range(4)]
        for x, p in zip((q, k, v, dout), pad):
            for i, s in enumerate(seqs):
                p[i, :s.stop - s.start] = x.detach()[s]
        qp, kp, vp = (p.requires_grad_() for p in pad[:3])
        dp = pad[3]
        n_eq = equal_length(lengths)
        b_eq = max(1, total // n_eq)
        qe, ke, ve = (torch.randn(b_eq, n_eq, h, d, device="cuda", dtype=torch.float16, generator=gen)
                      .requires_grad_() for _ in range(3))
        de = torch.randn(b_eq, n_eq, h, d, device="cuda", dtype=torch.float16, generator=gen)
        for causal in causals:
            def varlen_fwd(c=causal):
                return ft.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=c)

            def each_fwd(c=causal):
                return [ft.flash_attn_func(qs, ks, vs, causal=c) for qs, ks, vs in each]

            def equal_fwd(c=causal):
                return ft.flash_attn_func(qe, ke, ve, causal=c)

            def padded_fwd(c=causal):
                return ft.flash_attn_func(qp, kp, vp, causal=c)

            def sdpa_fwd(c=causal):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2),
                                                          vp.transpose(1, 2), is_causal=c).transpose(1, 2)

            def with_grad(fwd, inputs, grad_out):
                def fn():
                    torch.autograd.grad(fwd(), inputs, grad_out)
                return fn

            with torch.no_grad():
                got = varlen_fwd()
                want = torch.cat([o[0] for o in each_fwd()])
            err = float((got.float() - want.float()).abs().max())
            log(f"d={d} causal={causal}: {batch} sequences, {total} tokens, longest {longest}; "
                f"equal-length batch {b_eq} x {n_eq}; varlen vs dense per sequence max |err| {err:.1e}")
            rows = [("flashnb varlen", varlen_fwd, (q, k, v), dout, ""),
                    ("flashnb dense, each sequence", each_fwd, [x for t in each for x in t], each_dout,
                     f"{batch} calls"),
                    ("flashnb dense, equal lengths", equal_fwd, (qe, ke, ve), de, f"{b_eq} x {n_eq}"),
                    ("flashnb padded", padded_fwd, (qp, kp, vp), dp, f"{batch} x {longest}, no mask"),
                    ("sdpa-flash padded", sdpa_fwd, (qp, kp, vp), dp, f"{batch} x {longest}, no mask")]
            base = {}
            for name, fwd, inputs, grad_out, note in rows:
                rec = dict(headdim=d, causal=causal, impl=name, note=note,
                           max_err=err if name == "flashnb varlen" else None)
                try:
                    with torch.no_grad():
                        rec["fwd_ms"] = _gpu_ms(torch, fwd, flush_buf.zero_)
                    rec["fwdbwd_ms"] = _gpu_ms(torch, with_grad(fwd, inputs, grad_out), flush_buf.zero_)
                except Exception as exc:                     # noqa: BLE001 - a row that cannot run says why
                    rec["note"] = f"{note}; failed: {type(exc).__name__}: {exc}"[:200]
                    records.append(rec)
                    continue
                for what in ("fwd", "fwdbwd"):
                    ms = rec[f"{what}_ms"]
                    if name == "flashnb dense, equal lengths":   # its own FLOPs (about the packed batch's)
                        useful = flops([n_eq] * b_eq, h, d, causal, what)
                    else:
                        useful = flops(lengths, h, d, causal, what)
                    rec[f"{what}_tflops"] = useful / (ms * 1e-3) / 1e12
                    if name == "flashnb varlen":
                        base[what] = ms
                    rec[f"vs_varlen_{what}"] = ms / base[what] if what in base else None
                records.append(rec)
                log(_row(rec))
    return records


COLUMNS = (("headdim", "d", "d"), ("causal", "causal", ""), ("impl", "impl", "s"), ("fwd_ms", "fwd ms", ".3f"),
           ("fwdbwd_ms", "fwd+bwd ms", ".3f"), ("fwd_tflops", "fwd TFLOP/s", ".1f"),
           ("fwdbwd_tflops", "fwd+bwd TFLOP/s", ".1f"), ("vs_varlen_fwd", "fwd vs varlen", ".2f"),
           ("vs_varlen_fwdbwd", "fwd+bwd vs varlen", ".2f"), ("max_err", "max |err|", ".1e"), ("note", "note", "s"))



def _row(rec):
    return record_line(rec, COLUMNS)


def table(records):
    """A markdown table of the records."""
    return record_table(records, COLUMNS)


def main(argv=None) -> int:
    """Entry of ``python -m bench --varlen``; the simulator (no GPU) only says why nothing is timed."""
    from bench import env
    argv = sys.argv[1:] if argv is None else list(argv)
    torch = env.gpu_section(argv, "varlen", "varlen", "tests/kernels/test_kernel_varlen.py")
    if torch is None:
        return 0
    lengths = random_lengths()
    print(f"# packed batch: {len(lengths)} sequences, {sum(lengths)} tokens, lengths {lengths} (uniform "
          f"{MIN_LEN}..{MAX_LEN}, seed {SEED}); nheads * headdim = {HIDDEN}; float16")
    print(f"# ms: median of {REPS} calls after {WARMUP} warm-up, CUDA events, L2 flushed before each; TFLOP/s: the "
          "packed batch's useful FLOPs over the row's time (equal lengths: its own); vs varlen: time / varlen's")
    records = run(torch, lengths=lengths, log=lambda s: print("# " + s, flush=True))
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
