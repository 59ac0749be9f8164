"""Plan settings against each other and SDPA, in one process: the tensor-core kernels' block order
(``plan.LPT_SECTION_FWD`` / ``LPT_SECTION_BWD``), the Hopper dK/dV kernel's ``WGMMA_BACKWARD_EXCHANGE``, ...

    python -m tools.plan_ab --settings "LPT_SECTION_FWD=0 LPT_SECTION_BWD=0;LPT_SECTION_FWD=4 LPT_SECTION_BWD=8"
                            [--cases float16:64:4096,float32:128:4096] [--causal true|false|both] [--rounds 4]
                            [--passes fwd,fwdbwd]
    python -m tools.plan_ab --warm "SETTING" [--cases ...]   (compile one setting's kernels into the disk cache)

(a setting: space-separated ``NAME=INT`` assignments of ``flashnb.plan``'s module constants; settings separated by
``;``.)  For each case (dtype, head dim, N at flash-attn's benchmark shapes: batch * N = 16k tokens, heads * head
dim = 2048; float32 at ``precision="highest"``) and each setting, the forward and forward+backward of
``flashnb.flash_attention`` / ``flash_attention_backward`` (``backend="auto"``; float32 ``"wgmma"``: the Hopper
tf32 forward and the ``mma.sync`` tf32 backward, as the bench's ``flashnb-wgmma-tf32-highest``; or ``--backend``),
timed by ``tune_simt._time`` (calls queued between CUDA events, inputs rotated over four sets); SDPA's
FlashAttention-2 backend (16-bit) or memory-efficient one (float32) in the same process.  Each round times SDPA,
then every setting, in turn, in the given order in even rounds and the reverse in odd ones: the setting timed
first in a round measured up to 6% faster than an identical kernel timed after it (non-causal forwards, which no
setting here changes); each cell is the median over rounds (use an even number).
``--warm`` runs each case once at a small N with one setting, so that several processes can fill the disk cache
at once before the timed run.
"""
import argparse
import statistics

from tools.tune_simt import _time


def _inputs(dtype, d, n, sets=4):
    import torch
    b, h = max(16384 // n, 1), 2048 // d
    return [tuple(torch.randn(b, n, h, d, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4))
            for _ in range(sets)]


def _flashnb_calls(dtype, backend, causal):
    import flashnb
    kw = dict(causal=causal, backend=backend)
    if dtype == "float32":
        kw["precision"] = "highest"

    def fwd(q, k, v, do):
        flashnb.flash_attention(q, k, v, **kw)

    def fwdbwd(q, k, v, do):
        out, lse = flashnb.flash_attention(q, k, v, return_lse=True, **kw)
        flashnb.flash_attention_backward(do, q, k, v, out, lse, **kw)

    return fwd, fwdbwd


def _sdpa_calls(dtype, causal):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = SDPBackend.EFFICIENT_ATTENTION if dtype == "float32" else SDPBackend.FLASH_ATTENTION
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fwd(q, k, v, do):
        with sdpa_kernel(be), torch.no_grad():
            sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)

    def fwdbwd(q, k, v, do):
        q2, k2, v2 = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        with sdpa_kernel(be):
            sdpa(q2, k2, v2, is_causal=causal).backward(do.transpose(1, 2))

    return fwd, fwdbwd


def _apply(setting):
    from flashnb import _dispatch, plan
    for assignment in setting.split():
        name, _, value = assignment.partition("=")
        if not hasattr(plan, name):
            raise SystemExit(f"flashnb.plan has no {name}")
        setattr(plan, name, int(value))
    _dispatch.clear()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", required=True, help="NAME=INT ... ; NAME=INT ...")
    ap.add_argument("--cases", default="float16:64:2048,float16:64:4096,float16:128:2048,float16:128:4096,"
                                       "float32:128:2048,float32:128:4096")
    ap.add_argument("--causal", choices=("true", "false", "both"), default="true")
    ap.add_argument("--backend", default=None, help="flashnb's backend (default: auto; float32: wgmma)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--warm", action="store_true", help="compile the first setting's kernels, time nothing")
    args = ap.parse_args(argv)
    cases = [(dt, int(d), int(n)) for dt, d, n in (c.split(":") for c in args.cases.split(","))]
    causals = {"true": (True,), "false": (False,), "both": (False, True)}[args.causal]
    backend = lambda dt: args.backend or ("wgmma" if dt == "float32" else "auto")   # noqa: E731
    settings = [x.strip() for x in args.settings.split(";")]
    if args.warm:
        _apply(settings[0])
        for dt, d, _ in cases:
            for causal in causals:
                _flashnb_calls(dt, backend(dt), causal)[1](*_inputs(dt, d, 256, sets=1)[0])
        return
    import torch
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rounds} rounds; settings:")
    for i, setting in enumerate(settings):
        print(f"* {chr(65 + i)}: `{setting}`")
    print()
    print("| dtype | d | N | causal | pass | SDPA ms | " + " | ".join(f"{chr(65 + i)} ms (x SDPA)"
                                                                for i in range(len(settings))) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(settings))
    for dt, d, n in cases:
        sets = _inputs(dt, d, n)
        for causal in causals:
            mine = _flashnb_calls(dt, backend(dt), causal)
            theirs = _sdpa_calls(dt, causal)
            for which, name in ((0, "fwd"), (1, "fwd+bwd")):
                if ("fwd", "fwdbwd")[which] not in args.passes.split(","):
                    continue
                base, got = [], [[] for _ in settings]
                for r in range(args.rounds):
                    base.append(_time(theirs[which], sets))
                    order = list(enumerate(settings))
                    for i, setting in (order if r % 2 == 0 else order[::-1]):
                        _apply(setting)
                        got[i].append(_time(mine[which], sets))
                b = statistics.median(base)
                cells = [f"{statistics.median(x):.3f} ({b / statistics.median(x):.3f}x)" for x in got]
                print(f"| {dt} | {d} | {n} | {causal} | {name} | {b:.3f} | " + " | ".join(cells) + " |", flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
