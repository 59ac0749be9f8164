"""The tensor-core forward's resources and SASS for sm_90, compiled on a machine with no GPU.

    python -m tools.sass_tc BLOCK_Q BLOCK_K HEAD_DIM [causal=1] [MT=2] [QS=0|1] [FOLD=0|1] [WGMMA=1 [TMA=1]]
                            [F32=1 [TF32X3=0]] [SECTION=N] [MIN_BLOCKS=2]
    python -m tools.sass_tc --pass bwd BLOCK_Q BLOCK_K HEAD_DIM [causal=1] [DSPLIT=] [MTK=] [SHARE=] [DEFER_DQ=]
                            [WGMMA=1 [EXCHANGE=1] [DQ_FRAG=1]] [F32=1 [TF32X3=0]] [SECTION=N]

(``--pass bwd``: the tensor-core dK/dV kernel, ``make_dkdv_tc``, with the defaults ``plan.backward`` picks;
``WGMMA=1``: the Hopper forward, ``MT=1``, Q in shared memory, compiled for sm_90a; ``TMA=1``: its tiles by the
copy engine; ``F32=1``: float32 inputs on tf32 operands, 3xTF32 unless ``TF32X3=0``)

prints ptxas's registers, spills and stack frame, the SASS opcode counts, and the straight-line runs of 40 or
more instructions (split at branches and branch targets) with their most frequent opcodes; the PTX, cubin and
SASS are kept in ``--out`` (default /tmp/sass_tc).  Needs ``ptxas`` and ``cuobjdump`` (with ``nvdisasm``) on
the PATH: the wheels nvidia-cuda-nvcc, nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm hold them.  PTX is
written by numba-cuda's ``compile_ptx`` at compute capability 9.0 (its device-function dispatchers ask the
current device for a capability, so a stand-in answers (9, 0) here); the ``.version`` line is lowered to what
the installed ptxas accepts (``--ptx-version``, default 9.0).  The tables of docs/notes/tensorcore.md ("The
shipped configurations and their SASS") and bench/results/h100-ncu-2026-11-23.md were taken this way.
"""
import argparse
import collections
import os
import re
import subprocess


_INT_OPTIONS = ("SECTION", "MIN_BLOCKS")       # the forward's options that are counts, not flags


def compile_forward(bq, bk, d, options, out_dir, ptx_version):
    from numba.cuda import types
    plan = _stand_in_device()
    from flashnb.kernels.forward_tc import make_forward_tc

    causal = options.pop("causal", 0) == 1
    wgmma = options.get("WGMMA", 0) == 1
    mt = options.pop("MT", 1 if wgmma else plan.tc_m_tiles(bq, d))
    qs = bool(options.pop("QS", wgmma or plan.tc_q_in_smem(mt, d)))
    fold = bool(options.pop("FOLD", 1))
    dtype = "float32" if options.pop("F32", 0) else "float16"        # float32: tf32 operands (TF32X3=0: "high")
    kern, shared, threads = make_forward_tc(bq, bk, d, dtype, True, mt, qs, causal, *([False] * 6), fold,
                                            **{k: (v if k in _INT_OPTIONS else bool(v)) for k, v in options.items()})
    u4 = types.Array(types.uint32, 4, "C")
    sig = (u4, u4, u4, u4, types.Array(types.float32, 3, "C"), types.int64, types.int64) + _OPTION_TYPES() + (
        types.Array(types.uint64, 2, "C"),)                                                   # the tensor maps
    return _build(kern, sig, shared, threads, os.path.join(out_dir, f"forward_{bq}_{bk}_{d}"), ptx_version,
                  arch="sm_90a" if wgmma else "sm_90")


def compile_backward(bq, bk, d, options, out_dir, ptx_version):
    """The tensor-core dK/dV kernel at the options ``plan.backward`` would pick (``options`` override them)."""
    from numba.cuda import types
    plan = _stand_in_device()
    from flashnb.kernels.backward_tc import make_dkdv_tc

    causal = options.pop("causal", 0) == 1
    dtype = "float32" if options.pop("F32", 0) else "float16"        # float32: tf32 operands (TF32X3=0: "high")
    split, mtk, share = plan._tc_bwd_layout(bq, bk, d, dtype)
    kw = dict(DSPLIT=split, MTK=mtk, SHARE=share)
    if options.get("WGMMA"):                     # the Hopper dK/dV kernel: one warp per 16 keys, dQ undeferred
        kw = dict(DSPLIT=1, MTK=1, SHARE=False, DEFER_DQ=False)
    kw.update({k: (bool(v) if k in ("SHARE", "DEFER_DQ", "WGMMA", "EXCHANGE", "TF32X3", "DQ_FRAG", "DQ_WGMMA", "TMA")
                   else v)
               for k, v in options.items()})
    wgmma = kw.get("WGMMA", False)
    dsplit = kw.pop("DSPLIT")
    kern, shared, threads = make_dkdv_tc(bq, bk, d, dtype, True, causal, *([False] * 6), dsplit, True, **kw)
    u4 = types.Array(types.uint32, 4, "C")
    f3 = types.Array(types.float32, 3, "C")
    sig = (u4, u4, u4, u4, f3, f3, u4, u4, types.Array(types.float32, 4, "C"),   # q k v dout lse2 delta dk dv dq
           types.int64, types.int64) + _OPTION_TYPES() + (                            # group off, options,
        types.Array(types.uint64, 2, "C"),)                                             # the tensor maps
    return _build(kern, sig, shared, threads, os.path.join(out_dir, f"dkdv_{bq}_{bk}_{d}"), ptx_version,
                  arch="sm_90a" if wgmma else "sm_90")


def _stand_in_device():
    """numba-cuda's device-function dispatchers ask the current device for its capability: answer (9, 0)."""
    import numba.cuda.dispatcher as dispatcher

    class _Capability:
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Capability()
    from flashnb import plan
    return plan


def _OPTION_TYPES():
    """The kernel parameters of ``_options``' ``kernel_args(np.float32)``, no option set."""
    from numba.cuda import types
    b4 = types.Array(types.uint8, 4, "C")
    return (types.float32, types.float32, types.int64, types.int64, b4, types.Array(types.float32, 4, "C"),
            types.Array(types.float32, 2, "C"), b4, types.int64, types.int64,                 # ... alibi block mask
            types.int64, types.float32, types.int64, types.int64,                             # dropout, seed
            types.Array(types.int32, 1, "C"), types.Array(types.int32, 1, "C"))               # cu_seqlens_q, _k


def _build(kern, sig, shared, threads, stem, ptx_version, arch="sm_90"):
    """PTX (numba-cuda), cubin (ptxas) and SASS (cuobjdump) of ``kern`` at ``sig``, kept at ``stem``.*
    (``arch="sm_90a"`` for kernels holding wgmma)."""
    from numba import cuda
    bounds = kern.targetoptions.get("launch_bounds")                 # (make_forward_tc(MIN_BLOCKS=))
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0, "a") if arch == "sm_90a" else (9, 0),
                              **({"launch_bounds": bounds} if bounds else {}))
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".ptx", "w") as f:
        f.write(re.sub(r"\.version \d+\.\d+", f".version {ptx_version}", ptx))
    info = subprocess.run(["ptxas", f"-arch={arch}", "-v", "-o", stem + ".cubin", stem + ".ptx"],
                          capture_output=True, text=True, check=True).stderr
    sass = subprocess.run(["cuobjdump", "-sass", stem + ".cubin"], capture_output=True, text=True, check=True).stdout
    with open(stem + ".sass", "w") as f:
        f.write(sass)
    return shared, threads, info, sass


def instructions(sass):
    """(address, opcode without modifiers, text) of each SASS instruction."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(3).split(".")[0], m.group(3) + m.group(4)))
    return out


def runs(ins, min_len=40):
    """Straight-line runs of instructions: split after each branch or exit and before each branch target."""
    targets = {int(t, 16) for _, op, text in ins if op == "BRA" for t in re.findall(r"0x[0-9a-f]+", text)}
    cur, out = [], []
    for item in ins:
        if item[0] in targets and cur:
            out.append(cur)
            cur = []
        cur.append(item)
        if item[1] in ("BRA", "EXIT"):
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return [r for r in out if len(r) >= min_len]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("block_q", type=int)
    ap.add_argument("block_k", type=int)
    ap.add_argument("headdim", type=int)
    ap.add_argument("options", nargs="*", help="KEY=INT: causal, MT, QS, FOLD, or a make_forward_tc keyword "
                    "(--pass bwd: causal, DSPLIT, or a make_dkdv_tc keyword)")
    ap.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--out", default="/tmp/sass_tc")
    ap.add_argument("--ptx-version", default="9.0")
    args = ap.parse_args(argv)
    options = {k: int(v) for k, v in (o.split("=") for o in args.options)}
    build = compile_forward if args.which == "fwd" else compile_backward
    shared, threads, info, sass = build(args.block_q, args.block_k, args.headdim, options, args.out, args.ptx_version)
    print("\n".join(line.strip() for line in info.splitlines() if "registers" in line or "stack" in line))
    ins = instructions(sass)
    ops = collections.Counter(op for _, op, _ in ins)
    print(f"dynamic shared memory {shared} B, {threads} threads, {len(ins)} SASS instructions")
    print(" ".join(f"{op}:{n}" for op, n in ops.most_common(24)))
    for r in runs(ins):
        c = collections.Counter(op for _, op, _ in r)
        print(f"  run at {r[0][0]:#06x}: {len(r):4d} instructions  " + " ".join(f"{o}:{n}" for o, n in c.most_common(8)))


if __name__ == "__main__":
    main()
