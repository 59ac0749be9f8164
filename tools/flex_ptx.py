"""The flex_attention kernels compiled for sm_90 on the CPU machine (no GPU): the SIMT forward, dK/dV and dQ
kernels, the float16 tensor-core forward and dK/dV kernels (mma.sync, at the planner's tiles for head dim 64) and
the Hopper forward (wgmma with tiles by the tensor-copy engine, sm_90a)
with a score_mod (ALiBi, by the complex step; softcap with math.tanh and its given derivative) and a
mask_mod reading a captured NumPy array (document ids, frozen as a constant), and create_block_mask's kernel;
prints each PTX's size and its ``call`` count (0: the functions are inlined).  ``python -m tools.flex_ptx``
(numba-cuda with its NVVM; run without NUMBA_ENABLE_CUDASIM)."""
import math

import numpy as np
from numba import cuda
from numba.cuda import types

from tools.sass_tc import _stand_in_device

_stand_in_device()

from flashnb import flex  # noqa: E402  (after the stand-in device)
from flashnb.kernels._scores import Mods  # noqa: E402
from flashnb import plan  # noqa: E402
from flashnb.kernels.backward import make_dkdv, make_dq  # noqa: E402
from flashnb.kernels.backward_tc import make_dkdv_tc  # noqa: E402
from flashnb.kernels.forward_tc import make_forward_tc  # noqa: E402
from flashnb.kernels.flex import make_block_states  # noqa: E402
from flashnb.kernels.forward import make_forward  # noqa: E402

DOC = np.array([0, 0, 1, 1, 2], np.int32)


def alibi(score, b, h, q_idx, kv_idx):
    return score - 0.5 * (h + 1) * abs(q_idx - kv_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 3.0 * math.tanh(score / 3.0)


def softcap_grad(score, b, h, q_idx, kv_idx):
    return 1.0 - math.tanh(score / 3.0) ** 2


def same_doc(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & (q_idx >= kv_idx)


def _ptxas(ptx, cc):
    """ptxas's registers and spills for the PTX (where ptxas is on the path)."""
    import re
    import shutil
    import subprocess
    import tempfile
    if shutil.which("ptxas") is None:
        return "no ptxas"
    arch = "sm_90a" if len(cc) > 2 else "sm_90"
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/k.ptx"
        with open(path, "w") as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 8.5", ptx))
        out = subprocess.run(["ptxas", f"-arch={arch}", "-v", "-o", f"{tmp}/k.cubin", path], capture_output=True,
                             text=True)
    if out.returncode:
        return "ptxas failed: " + out.stderr.strip().splitlines()[-1]
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
    return f"{regs.group(1)} registers, spills {spill.group(1)}/{spill.group(2)} bytes"


def main():
    f4a, f4c = types.Array(types.float32, 4, "A"), types.Array(types.float32, 4, "C")
    f3 = types.Array(types.float32, 3, "C")
    u4, b4 = types.Array(types.uint8, 4, "C"), types.Array(types.int32, 4, "C")   # (b4: the padded states)
    options = (types.float32, types.float32, types.int64, types.int64, u4, f4c, types.Array(types.float32, 2, "C"),
               b4, types.int64, types.int64, types.int64, types.float32, types.int64, types.int64,
               types.Array(types.int32, 1, "C"), types.Array(types.int32, 1, "C"))
    for name, sm, mm, grad in (("alibi + document mask", alibi, same_doc, flex._complex_step(alibi)),
                               ("softcap", softcap, None, flex._compiled(softcap_grad))):
        mods = Mods(flex._compiled(sm), flex._compiled(mm), grad, None if mm is None else (16, 16))
        flags = (False, False, mm is not None, False, False, False, False)      # the block mask of the states
        kernels = (
            ("forward", make_forward(32, 32, 64, "float32", *flags, MODS=mods)[0],
             (f4a, f4a, f4a, f4a, f3, types.int64, types.int64)),
            ("dK/dV", make_dkdv(32, 32, 64, "float32", True, *flags, P_FORMAT="float16", MODS=mods)[0],
             (f4a, f4a, f4a, f4a, f3, f3, f4a, f4a, f4c, types.int64, types.int64)),
            ("dQ", make_dq(32, 32, 64, "float32", *flags, MODS=mods)[0],
             (f4a, f4a, f4a, f4a, f3, f3, f4a, types.int64, types.int64)),
        )
        u4w = types.Array(types.uint32, 4, "C")
        plan.shared_limit = lambda: 232448                 # the H100's opt-in shared memory per block (no device here)
        plan.compute_capability = lambda: (9, 0)
        bq, bk = plan.default_tc_tiles(64, None, None, "float16")
        mt = plan.tc_m_tiles(bq, 64)
        kernels += (
            ("tensor-core forward", make_forward_tc(bq, bk, 64, "float16", True, mt, plan.tc_q_in_smem(mt, 64), *flags,
                                                    MODS=mods)[0],
             (u4w, u4w, u4w, u4w, f3, types.int64, types.int64), (types.Array(types.uint64, 2, "C"),)),)
        bq, bk = plan.default_wgmma_tiles(64, None, None, "float16")
        kernels += (
            ("Hopper forward (wgmma, tensor maps; sm_90a)",
             make_forward_tc(bq, bk, 64, "float16", True, 1, True, *flags, False, WGMMA=True, TMA=True, MODS=mods)[0],
             (u4w, u4w, u4w, u4w, f3, types.int64, types.int64), (types.Array(types.uint64, 2, "C"),), (9, 0, "a")),)
        bq, bk = plan.default_tc_bwd_tiles(64, None, None, "float16")
        split, mtk, share = plan._tc_bwd_layout(bq, bk, 64, "float16")
        kernels += (
            ("tensor-core dK/dV", make_dkdv_tc(bq, bk, 64, "float16", True, *flags, split, True, MTK=mtk, SHARE=share,
                                               MODS=mods)[0],
             (u4w, u4w, u4w, u4w, f3, f3, u4w, u4w, f4c, types.int64, types.int64), (types.Array(types.uint64, 2, "C"),)),)
        for what, kern, head, *tail in kernels:
            cc = tail[1] if len(tail) > 1 else (9, 0)
            ptx, _ = cuda.compile_ptx(kern.py_func, head + options + tuple(tail[0] if tail else ()), cc=cc)
            print(f"{name}: {what} PTX {len(ptx)} characters, {ptx.count('call.uni')} calls; {_ptxas(ptx, cc)}",
                  flush=True)
    kern = make_block_states(flex._compiled(same_doc), 16, 16)
    ptx, _ = cuda.compile_ptx(kern.py_func, (types.Array(types.int8, 4, "C"), types.int64, types.int64), cc=(9, 0))
    print(f"create_block_mask: PTX {len(ptx)} characters, {ptx.count('call.uni')} calls")


if __name__ == "__main__":
    main()
