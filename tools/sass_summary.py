"""One line of SASS essentials per tensor-core kernel configuration, for before/after comparisons.

    python -m tools.sass_summary fwd 128,64,64 128,64,64,causal=1 ...
    python -m tools.sass_summary bwd 32,128,64 64,128,128,causal=1 ...

Each configuration is ``BLOCK_Q,BLOCK_K,HEAD_DIM[,OPTION=VALUE...]`` as ``tools.sass_tc`` takes them; prints
ptxas's registers, stack frame and spills, and the counts of HMMA, LDSM, LDGSTS, RED/ATOM, LDL, STL, BAR and all
instructions.  Needs what ``tools.sass_tc`` needs (ptxas, cuobjdump).
"""
import collections
import re
import sys

from tools import sass_tc


def summary(which, cfg, out_dir="/tmp/sass_summary"):
    parts = cfg.split(",")
    bq, bk, d = map(int, parts[:3])
    options = {p.split("=")[0]: int(p.split("=")[1]) for p in parts[3:]}
    build = sass_tc.compile_forward if which == "fwd" else sass_tc.compile_backward
    _, _, info, sass = build(bq, bk, d, options, out_dir, "9.0")
    count = collections.Counter(op for _, op, _ in sass_tc.instructions(sass))
    regs = re.search(r"Used (\d+) registers", info).group(1)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    stack = re.search(r"(\d+) bytes stack frame", info).group(1)
    red = sum(v for k, v in count.items() if k.startswith(("RED", "ATOM")))
    return (f"{which} {cfg:24s} regs {regs} stack {stack} spill {spill.group(1)}/{spill.group(2)} "
            f"HMMA {count['HMMA']} LDSM {count['LDSM']} LDGSTS {count['LDGSTS']} RED/ATOM {red} "
            f"LDL {count['LDL']} STL {count['STL']} BAR {count['BAR']} total {sum(count.values())}")


if __name__ == "__main__":
    for cfg in sys.argv[2:]:
        print(summary(sys.argv[1], cfg), flush=True)
