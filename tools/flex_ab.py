"""Plan settings of the flex_attention kernels against each other, in one process: ``bench --flex``'s cases
(bfloat16, one sequence of 16384 tokens, 2048 / d heads), ``flashnb.torch.flex_attention`` forward and
forward+backward under each setting, and flashnb's dense call where the case is a built-in option.

    python -m tools.flex_ab --settings "FLEX_TWO_BLOCKS=0;FLEX_TWO_BLOCKS=1"
                            [--cases causal,document] [--headdims 64] [--rounds 4]

(a setting: space-separated ``NAME=INT`` of ``flashnb.plan``'s module constants, as ``tools.plan_ab``.)  Times:
``bench.flex._gpu_ms`` (CUDA events around one call, host time included, median of its repetitions); each round
times every setting in turn, in the given order in even rounds and the reverse in odd ones; a cell is the median
over rounds.  Each setting's output and gradients are compared with the first setting's
(``max |diff|``; dQ's atomics add in any order, so a few ulps of it move run to run): the plan changes launch
bounds and block order, never results beyond float32 rounding.  The dense column: the dense call under each setting
in turn (A / B / ...), timed the same way.
"""
import argparse
import statistics

from bench import flex as bf
from tools.plan_ab import _apply


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", required=True)
    ap.add_argument("--cases", default=",".join(bf.CASES))
    ap.add_argument("--headdims", default="64")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    import torch
    import flashnb
    import flashnb.torch as ft
    settings = [x.strip() for x in args.settings.split(";")]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rounds} rounds; settings:")
    for i, setting in enumerate(settings):
        print(f"* {chr(65 + i)}: `{setting}`")
    print()
    print("| d | case | pass | " + " | ".join(f"{chr(65 + i)} ms" for i in range(len(settings)))
          + " | dense ms | max diff |")
    print("|---|---|---|" + "---|" * len(settings) + "---|---|")
    ids = bf.document_ids()
    for d in (int(x) for x in args.headdims.split(",")):
        h = bf.HIDDEN // d
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, h, bf.SEQLEN, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for _ in range(3))
        dout = torch.randn_like(q)
        for case in args.cases.split(","):
            score_mod, mask_mod, grad = bf.flashnb_mods(case, h, ids)
            mask = None if mask_mod is None else flashnb.create_block_mask(mask_mod, None, None, bf.SEQLEN, bf.SEQLEN,
                                                                           BLOCK_SIZE=bf.BLOCK)

            def fwd():
                return ft.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, score_mod_grad=grad)

            def fwdbwd():
                return torch.autograd.grad(fwd(), (q, k, v), dout)

            outs = []
            for setting in settings:
                _apply(setting)
                with torch.no_grad():
                    out = fwd().float()
                outs.append((out,) + tuple(x.float() for x in fwdbwd()))
            diff = max(float((a - b).abs().max()) for o in outs for a, b in zip(o, outs[0]))
            dense = bf.dense_options(case, h)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

            def dfwd():
                return ft.flash_attn_func(qt, kt, vt, **dense)

            def dfwdbwd():
                return torch.autograd.grad(dfwd(), (q, k, v), dout.transpose(1, 2))

            for name, fn, dfn in (("fwd", fwd, dfwd), ("fwd+bwd", fwdbwd, dfwdbwd)):
                cells = " | ".join(_rounds(torch, settings, args.rounds, fn, name == "fwd"))
                dense_ms = "-"
                if dense is not None:      # the dense call with the same option, under each setting in turn
                    dense_ms = " / ".join(_rounds(torch, settings, args.rounds, dfn, name == "fwd"))
                print(f"| {d} | {case} | {name} | {cells} | {dense_ms} | {diff:.2g} |", flush=True)


def _rounds(torch, settings, rounds, fn, no_grad):
    """Each setting's median time of ``fn`` (ms, as text) over ``rounds``: every setting in turn in each round, in
    the given order in even rounds and the reverse in odd ones."""
    got = [[] for _ in settings]
    for r in range(rounds):
        order = list(enumerate(settings))
        for i, setting in (order if r % 2 == 0 else order[::-1]):
            _apply(setting)
            if no_grad:
                with torch.no_grad():
                    got[i].append(bf._gpu_ms(torch, fn))
            else:
                got[i].append(bf._gpu_ms(torch, fn))
    return [f"{statistics.median(x):.3f}" for x in got]


if __name__ == "__main__":
    main()
