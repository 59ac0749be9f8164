"""Whether two dumps of ``tools.ptx_same`` (``PTX_SAME_DUMP=DIR``) assemble to the same SASS, kernel by kernel.

    git stash; PTX_SAME_DUMP=/tmp/before python -m tools.ptx_same "wgmma dkdv"; git stash pop
    PTX_SAME_DUMP=/tmp/after python -m tools.ptx_same "wgmma dkdv"
    python -m tools.sass_same /tmp/before /tmp/after

PTX that differs only in where NVVM placed an instruction or how it numbered registers (an inlined helper is
optimised before it knows its caller's values) often assembles to the same SASS; this says which do.  Each
``NNN.raw`` (the PTX as compiled) goes through ptxas (sm_90a where it holds wgmma, else sm_90; the ``.version``
line raised to what the vector reductions need) and cuobjdump; the instructions are compared without their
addresses.  Needs ``ptxas`` and ``cuobjdump`` on the PATH (``tools.sass_tc`` says where from).
"""
import glob
import os
import re
import subprocess
import sys
import tempfile


def sass(raw_path):
    """The SASS instructions (text, no addresses) of one dumped PTX file."""
    txt = open(raw_path).read()
    arch = "sm_90a" if ".target sm_90a" in txt else "sm_90"
    txt = re.sub(r"\.version \d+\.\d+", ".version 8.7", txt)
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(txt)
        subprocess.run(["ptxas", f"-arch={arch}", "-o", cubin, ptx], check=True, capture_output=True)
        out = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in out.splitlines()
            if re.match(r"\s+/\*[0-9a-f]+\*/\s", line)]


def main(argv=None):
    a, b = (argv or sys.argv[1:])[:2]
    differ = 0
    for fa in sorted(glob.glob(os.path.join(a, "*.raw"))):
        fb = os.path.join(b, os.path.basename(fa))
        if not os.path.exists(fb):
            print(os.path.basename(fa), "missing in", b)
            differ += 1
            continue
        x, y = sass(fa), sass(fb)
        same = x == y
        differ += not same
        print(os.path.basename(fa), "SASS identical" if same else f"SASS differs: {len(x)} -> {len(y)} instructions")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
