"""Can a Numba kernel hand registers between warpgroups (FA3's producer / consumers) on sm_90a?  Compiled on the
CPU machine, no GPU: ptxas's registers, spills and the ``USETMAXREG`` instructions of one kernel, with and without
``setmaxnreg``.

    python -m tools.setmaxnreg_probe

The kernel has 384 threads and launch bounds ``(384, 1)`` (``.maxntid 384``, ``.minnctapersm 1``): ptxas caps a
thread at 168 registers at entry (65536 / 384, rounded down to 8).  Warpgroup 0 (the producer) gives registers back
with ``setmaxnreg.dec 24``, and warpgroups 1-2 (the consumers) take ``setmaxnreg.inc 240``, then keep ``NACC``
floats live across a loop (each step reads its neighbour, so none can be computed apart).  Without ``setmaxnreg``
the same consumer code spills at 168.  (Needs ``ptxas`` and ``cuobjdump`` on the PATH, as ``tools.sass_tc``.)
"""
import re
import subprocess

NACC = 200


def _asm(text):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def op(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "", side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen
    return op


def make(handover):
    import numpy as np
    from numba import cuda
    dec, inc = _asm("setmaxnreg.dec.sync.aligned.u32 24;"), _asm("setmaxnreg.inc.sync.aligned.u32 240;")
    F32 = np.float32

    def probe(x, out):
        if cuda.threadIdx.x // 128 == 0:                      # the producer
            if handover:
                dec()
            out[cuda.threadIdx.x] = x[0]
            return
        if handover:                                          # the consumers
            inc()
        acc = cuda.local.array(NACC, F32)
        for i in range(NACC):
            acc[i] = x[i]
        for it in range(x.shape[0]):
            y = x[it]
            t0 = acc[0]
            for i in range(NACC - 1):
                acc[i] = acc[i] * y + acc[i + 1]
            acc[NACC - 1] = acc[NACC - 1] * y + t0
        s = F32(0)
        for i in range(NACC):
            s += acc[i]
        out[cuda.threadIdx.x] = s

    return probe


def main():
    from tools.sass_tc import _stand_in_device
    _stand_in_device()
    from numba import cuda, types
    sig = (types.Array(types.float32, 1, "C"),) * 2
    for handover in (False, True):
        ptx, _ = cuda.compile_ptx(make(handover), sig, cc=(9, 0, "a"), launch_bounds=(384, 1))
        with open("/tmp/setmaxnreg_probe.ptx", "w") as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 9.0", ptx))
        info = subprocess.run(["ptxas", "-arch=sm_90a", "-v", "-o", "/tmp/setmaxnreg_probe.cubin",
                               "/tmp/setmaxnreg_probe.ptx"], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run(["cuobjdump", "-sass", "/tmp/setmaxnreg_probe.cubin"], capture_output=True, text=True,
                              check=True).stdout
        lines = [ln.strip() for ln in info.splitlines() if "Used" in ln or "spill" in ln]
        setmax = [ln.split(";")[0].split("*/")[-1].strip() for ln in sass.splitlines() if "USETMAXREG" in ln]
        print(f"{'with' if handover else 'without'} setmaxnreg: {' | '.join(lines)}; {setmax}")


if __name__ == "__main__":
    main()
