"""SASS of ``bench --flex``'s kernels at bf16 on the CPU machine (no GPU): the Hopper forward (wgmma + TMA) and the
Hopper dK/dV kernel (wgmma, dQ by wgmma, Q_i / dO_i by TMA) with a case's score_mod / mask_mod, built as
``flex.flex_attention`` builds them under plan settings given as ``NAME=VALUE`` (as ``tools.flex_ab`` takes them).
Prints registers, spills, the instruction count and the opcodes whose counts differ between the settings
(``--keep DIR``: each setting's files in ``DIR/N/``).

    python -m tools.flex_sass --case alibi --headdim 128 --settings "FLEX_MASK_NARROW=0;FLEX_MASK_NARROW=3"

(ptxas and cuobjdump on the path; run without NUMBA_ENABLE_CUDASIM.)  The tiles are the planner's bf16 ones at
head dim 128 (forward 128 x 128, dK/dV 64 x 128) and 64 (forward 128 x 128, dK/dV 64 x 128); pass --fwd-tiles,
--bwd-tiles to change them."""
import argparse
import collections
import os
import re
import tempfile

from tools.sass_tc import _build, _stand_in_device, instructions

plan = _stand_in_device()

from numba.cuda import types  # noqa: E402

from bench import flex as bench_flex  # noqa: E402
from flashnb import flex  # noqa: E402
from flashnb.kernels._scores import Mods  # noqa: E402
from flashnb.kernels.backward_tc import make_dkdv_tc  # noqa: E402
from flashnb.kernels.forward_tc import make_forward_tc  # noqa: E402


def _mods(case, nheads, backward):
    """The case's Mods as ``flex.flex_attention`` builds them under the current plan settings."""
    score_mod, mask_mod, grad = bench_flex.flashnb_mods(case, nheads, bench_flex.document_ids(bench_flex.SEQLEN))
    narrow = bool(int(plan.FLEX_MASK_NARROW) & (2 if backward else 1)) and mask_mod is not None
    return Mods(flex._compiled(score_mod, True), flex._compiled(mask_mod, False, int32_compares=narrow),
                flex._compiled(grad, True) if grad is not None
                else flex._complex_step(score_mod, True) if backward and score_mod else None,
                None if mask_mod is None else (128, 128),
                bool(plan.FLEX_MOD_INT32) and score_mod is not None, int(plan.FLEX_MASK_WRITTEN),
                bool(plan.FLEX_MASK_INT32) and mask_mod is not None, mask_narrow=narrow)


def _options():
    b4 = types.Array(types.uint8, 4, "C")
    return (types.float32, types.float32, types.int64, types.int64, b4, types.Array(types.float32, 4, "C"),
            types.Array(types.float32, 2, "C"), types.Array(types.int32, 4, "C"), types.int64, types.int64,
            types.int64, types.float32, types.int64, types.int64,
            types.Array(types.int32, 1, "C"), types.Array(types.int32, 1, "C"))


def build(case, d, fwd_tiles, bwd_tiles, out_dir):
    """{kernel: (ptxas info, sass)} under the current plan settings."""
    u4 = types.Array(types.uint32, 4, "C")
    f3 = types.Array(types.float32, 3, "C")
    tmaps = (types.Array(types.uint64, 2, "C"),)
    has_mask = bench_flex.flashnb_mods(case, 1, bench_flex.document_ids(bench_flex.SEQLEN))[1] is not None
    flags = (False, False, has_mask, False, False, False, False)
    section = lambda bit: {"SECTION": 8} if int(plan.FLEX_SECTION) & bit and has_mask else {}  # noqa: E731
    out = {}
    kern, shared, threads = make_forward_tc(*fwd_tiles, d, "bfloat16", True, 1, True, *flags, True, WGMMA=True,
                                            TMA=True, MODS=_mods(case, 8, False), **section(1))
    sig = (u4, u4, u4, u4, f3, types.int64, types.int64) + _options() + tmaps
    out["forward"] = _build(kern, sig, shared, threads, os.path.join(out_dir, "fwd"), "8.5", arch="sm_90a")[2:]
    fast = {"FAST_GRAD": True} if plan.BWD_FAST_GRAD else {}
    kern, shared, threads = make_dkdv_tc(*bwd_tiles, d, "bfloat16", True, *flags, 1, True, DEFER_DQ=False,
                                         WGMMA=True, DQ_FRAG=True, DQ_WGMMA=True, TMA=True,
                                         MODS=_mods(case, 8, True), **fast, **section(2))
    sig = (u4, u4, u4, u4, f3, f3, u4, u4, types.Array(types.float32, 4, "C"), types.int64, types.int64) + \
        _options() + tmaps
    out["dK/dV"] = _build(kern, sig, shared, threads, os.path.join(out_dir, "dkdv"), "8.5", arch="sm_90a")[2:]
    return out


def _apply(setting):
    for item in setting.split():
        name, value = item.split("=")
        setattr(plan, name, type(getattr(plan, name))(int(value)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="alibi")
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--settings", default="")
    ap.add_argument("--fwd-tiles", default="128,128")
    ap.add_argument("--bwd-tiles", default="64,128")
    ap.add_argument("--keep", default=None, help="a folder to keep each setting's PTX, cubin and SASS in")
    args = ap.parse_args(argv)
    fwd_tiles = tuple(int(x) for x in args.fwd_tiles.split(","))
    bwd_tiles = tuple(int(x) for x in args.bwd_tiles.split(","))
    saved = {k: getattr(plan, k) for k in dir(plan) if k.isupper()}
    counts = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.keep or tmp
        for i, setting in enumerate(s.strip() for s in args.settings.split(";")):
            for k, v in saved.items():
                setattr(plan, k, v)
            _apply(setting)
            res = build(args.case, args.headdim, fwd_tiles, bwd_tiles, os.path.join(tmp, str(i)))
            counts.append({})
            for kernel, (info, sass) in res.items():
                regs = re.search(r"Used (\d+) registers", info).group(1)
                spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups()
                ops = collections.Counter(op for _, op, _ in instructions(sass))
                counts[-1][kernel] = ops
                print(f"{args.case} d {args.headdim} [{setting or 'defaults'}] {kernel}: {regs} registers, spills "
                      f"{spill[0]}/{spill[1]} bytes, {sum(ops.values())} instructions", flush=True)
    for kernel in counts[0]:
        ops = sorted(set().union(*(c[kernel] for c in counts)))
        diff = [(op, [c[kernel][op] for c in counts]) for op in ops if len({c[kernel][op] for c in counts}) > 1]
        print(f"{kernel}, opcodes that differ: " + ", ".join(f"{op} {'/'.join(map(str, n))}" for op, n in diff))


if __name__ == "__main__":
    main()
