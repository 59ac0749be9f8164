"""Can Numba reach Hopper's wgmma (sm_90a)?  Compiles one warpgroup MMA on a machine with no GPU and prints
what each step gives (docs/notes/hopper.md records the answer).

    python -m tools.wgmma_probe

A Numba ``@intrinsic`` emits ``wgmma.fence`` / ``wgmma.mma_async.m64n8k16.f32.f16.f16`` (A and B from
shared-memory descriptors) / ``commit_group`` / ``wait_group`` as inline PTX. ``numba.cuda.compile_ptx`` is
asked for compute capability ``(9, 0)`` and ``(9, 0, "a")``; each PTX goes through ``ptxas -arch=sm_90`` and
``-arch=sm_90a``, and the SASS (``cuobjdump``) is searched for ``HGMMA`` and ``WARPGROUP``.  Needs ``ptxas``
and ``cuobjdump`` on the PATH (the wheels nvidia-cuda-nvcc and nvidia-cuda-cuobjdump).  Not a kernel that
computes anything meaningful: the descriptors are whatever the caller passes; it is never launched.
"""
import os
import re
import subprocess
import tempfile

import numpy as np

PTX = ("{ .reg .pred p; setp.ne.b32 p, $6, 0; mov.f32 $0, $7; mov.f32 $1, $8; mov.f32 $2, $9; mov.f32 $3, $10; "
       "wgmma.fence.sync.aligned; "
       "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {$0, $1, $2, $3}, $4, $5, p, 1, 1, 0, 0; "
       "wgmma.commit_group.sync.aligned; wgmma.wait_group.sync.aligned 0; }")


def make_kernel():
    from llvmlite import ir
    from numba import cuda, types
    from numba.cuda.extending import intrinsic

    f32, i64, i32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
    RET = types.UniTuple(types.float32, 4)

    @intrinsic
    def wgmma_m64n8k16(typingctx, desc_a, desc_b, scale_d, c0, c1, c2, c3):
        """D (64 x 8, float32, 4 values a thread) = A B (+ D if scale_d): A, B by shared-memory descriptors."""
        sig = RET(desc_a, desc_b, scale_d, c0, c1, c2, c3)

        def codegen(context, builder, signature, args):
            tys = signature.args
            da, db = (context.cast(builder, x, t, types.uint64) for x, t in zip(args[:2], tys[:2]))
            sd = context.cast(builder, args[2], tys[2], types.int32)
            cs = [context.cast(builder, x, t, types.float32) for x, t in zip(args[3:], tys[3:])]
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i64, i64, i32] + [f32] * 4)
            asm = ir.InlineAsm(fnty, PTX, "=f,=f,=f,=f,l,l,r,f,f,f,f", side_effect=True)
            res = builder.call(asm, [da, db, sd] + cs)
            return context.make_tuple(builder, RET, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    def probe(out, da, db):
        z = np.float32(0)
        d0, d1, d2, d3 = wgmma_m64n8k16(da[0], db[0], 0, z, z, z, z)
        out[cuda.threadIdx.x] = d0 + d1 + d2 + d3

    return probe, (types.float32[::1], types.uint64[::1], types.uint64[::1])


def main():
    from numba import cuda
    kernel, sig = make_kernel()
    work = tempfile.mkdtemp(prefix="wgmma_probe_")
    for cc in ((9, 0), (9, 0, "a")):
        ptx, _ = cuda.compile_ptx(kernel, sig, cc=cc)
        target = re.search(r"\.target (\S+)", ptx).group(1)
        path = os.path.join(work, "probe.ptx")
        with open(path, "w") as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 9.0", ptx))   # what the installed ptxas accepts
        for arch in ("sm_90", "sm_90a"):
            cubin = os.path.join(work, f"probe_{arch}.cubin")
            r = subprocess.run(["ptxas", f"-arch={arch}", "-o", cubin, path], capture_output=True, text=True)
            sass = (subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
                    if r.returncode == 0 else "")
            errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower() or "fatal" in ln.lower()]
            said = "ok" if r.returncode == 0 else errors[0].strip()
            print(f"compile_ptx(cc={cc}) -> .target {target}; ptxas -arch={arch}: {said}; "
                  f"HGMMA: {'HGMMA' in sass}; WARPGROUP: {'WARPGROUP' in sass}")
            for line in sass.splitlines():
                if re.search(r"HGMMA|WARPGROUP", line):
                    print("    " + re.sub(r"\s+/\*.*?\*/\s*$", "", line.strip()))


if __name__ == "__main__":
    main()
