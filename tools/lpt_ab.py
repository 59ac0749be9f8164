"""The tensor-core kernels' block order on causal calls (``plan.LPT_SECTION``) against SDPA, in one process.

    python -m tools.lpt_ab [--sections 0,4,8] [--cases float16:64:4096,float32:128:4096] [--rounds 2]
    python -m tools.lpt_ab --warm SECTION [--cases ...]      (compile one section's kernels into the disk cache)

For each case (dtype, head dim, N at flash-attn's benchmark shapes: batch * N = 16k tokens, heads * head dim =
2048; float32 at ``precision="highest"``) and each section size, the causal forward and forward+backward of
``flashnb.flash_attention`` / ``flash_attention_backward`` (``backend="auto"``, float32 ``"tensorcore"``
unless ``--backend``), timed by ``tune_simt._time`` (calls queued between CUDA events, inputs rotated over
four sets); SDPA's FlashAttention-2 backend (16-bit) or memory-efficient one (float32) in the same process.  The
sections alternate within each round, so that clock and thermal drift fall on all alike; each cell is the
median over rounds.  ``--warm`` runs each case once at a small N with one section, so that several processes
can fill the disk cache at once before the timed run.
"""
import argparse
import statistics

from tools.tune_simt import _time


def _inputs(dtype, d, n, sets=4):
    import torch
    b, h = max(16384 // n, 1), 2048 // d
    return [tuple(torch.randn(b, n, h, d, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4))
            for _ in range(sets)]


def _flashnb_calls(dtype, backend):
    import flashnb
    kw = dict(causal=True, backend=backend)
    if dtype == "float32":
        kw["precision"] = "highest"

    def fwd(q, k, v, do):
        flashnb.flash_attention(q, k, v, **kw)

    def fwdbwd(q, k, v, do):
        out, lse = flashnb.flash_attention(q, k, v, return_lse=True, **kw)
        flashnb.flash_attention_backward(do, q, k, v, out, lse, **kw)

    return fwd, fwdbwd


def _sdpa_calls(dtype):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = SDPBackend.EFFICIENT_ATTENTION if dtype == "float32" else SDPBackend.FLASH_ATTENTION
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fwd(q, k, v, do):
        with sdpa_kernel(be), torch.no_grad():
            sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)

    def fwdbwd(q, k, v, do):
        q2, k2, v2 = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        with sdpa_kernel(be):
            sdpa(q2, k2, v2, is_causal=True).backward(do.transpose(1, 2))

    return fwd, fwdbwd


def _set_section(section):
    from flashnb import _dispatch, plan
    plan.LPT_SECTION = section
    _dispatch.clear()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="0,4,8")
    ap.add_argument("--cases", default="float16:64:2048,float16:64:4096,float16:128:2048,float16:128:4096,"
                                       "float32:128:2048,float32:128:4096")
    ap.add_argument("--backend", default=None, help="flashnb's backend (default: auto; float32: tensorcore)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", type=int, default=None, metavar="SECTION")
    args = ap.parse_args(argv)
    cases = [(dt, int(d), int(n)) for dt, d, n in (c.split(":") for c in args.cases.split(","))]
    backend = lambda dt: args.backend or ("tensorcore" if dt == "float32" else "auto")   # noqa: E731
    if args.warm is not None:
        _set_section(args.warm)
        for dt, d, _ in cases:
            fwd, fwdbwd = _flashnb_calls(dt, backend(dt))
            fwdbwd(*_inputs(dt, d, 256, sets=1)[0])
        return
    import torch
    sections = [int(s) for s in args.sections.split(",")]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, causal, "
          f"sections {sections}, {args.rounds} rounds")
    print("| dtype | d | N | pass | SDPA ms | " + " | ".join(f"section {s} ms (x SDPA)" for s in sections) + " |")
    print("|---|---|---|---|---|" + "---|" * len(sections))
    for dt, d, n in cases:
        sets = _inputs(dt, d, n)
        mine = _flashnb_calls(dt, backend(dt))
        theirs = _sdpa_calls(dt)
        for which, name in ((0, "fwd"), (1, "fwd+bwd")):
            base, got = [], {s: [] for s in sections}
            for _ in range(args.rounds):
                base.append(_time(theirs[which], sets))
                for s in sections:
                    _set_section(s)
                    got[s].append(_time(mine[which], sets))
            b = statistics.median(base)
            cells = [f"{statistics.median(got[s]):.3f} ({b / statistics.median(got[s]):.3f}x)" for s in sections]
            print(f"| {dt} | {d} | {n} | {name} | {b:.3f} | " + " | ".join(cells) + " |", flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
