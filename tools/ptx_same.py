"""A hash of the PTX of the shipped kernels' default specialisations (SIMT forward, dK/dV, dQ; mma.sync forward and
dK/dV; the Hopper forward and dK/dV), for sm_90 on the CPU machine, at three option sets (none; window + block mask +
softcap + ALiBi; window + mask + bias + dropout); then the split-KV decode kernel at the specialisations
``flashnb.kvcache`` builds (its settings, ``plan.plan_decode``'s work split: 16-bit and float32, dense and paged,
split or not, staged or in registers, LEAN or not, with the window / softcap / ALiBi / leftpad options) and its
combine.  Mangled names (which embed closure ids) and comments are
dropped, and Numba's ``.common .global`` flag declarations, and the shared arrays' names (numbered per process)
renumbered by first appearance, so equal hashes mean the same instructions.  Compare two trees:

    git worktree add /tmp/old REV
    (cd /tmp/old && PYTHONPATH=/tmp/old:$OLDPWD python $OLDPWD/tools/ptx_same.py) > old.txt
    python -m tools.ptx_same > new.txt; diff old.txt new.txt

Arguments, if any, are label prefixes: only those lines are compiled and printed (``python -m tools.ptx_same decode``).
The FP8 forward (dense and packed, plain and warp-specialised) and its pre-passes too (``fp8``).  ``PTX_SAME_DUMP=DIR`` also writes each normalised PTX to ``DIR/NNN.ptx`` (in the printed order), for a diff, and
the PTX as compiled to ``DIR/NNN.raw`` (for ptxas).
"""
import os
import sys
import hashlib
import re

from tools.sass_tc import _stand_in_device
_stand_in_device()
from numba import cuda
from numba.cuda import types
from flashnb import plan
from flashnb.kernels.forward import make_forward
from flashnb.kernels.backward import make_dkdv, make_dq
from flashnb.kernels.forward_tc import make_forward_tc
from flashnb.kernels.backward_tc import make_dkdv_tc
from flashnb.kernels import decode as _decode
from flashnb import kvcache
plan.shared_limit = lambda: 232448
plan.compute_capability = lambda: (9, 0)
f4a, f4c = types.Array(types.float32, 4, "A"), types.Array(types.float32, 4, "C")
f3 = types.Array(types.float32, 3, "C"); u4 = types.Array(types.uint8, 4, "C"); u4w = types.Array(types.uint32, 4, "C")
opts = (types.float32, types.float32, types.int64, types.int64, u4, f4c, types.Array(types.float32, 2, "C"), u4,
        types.int64, types.int64, types.int64, types.float32, types.int64, types.int64,
        types.Array(types.int32, 1, "C"), types.Array(types.int32, 1, "C"))
_dumped = []
def h(ptx):
    """(hash, size) of the PTX without comments and mangled names."""
    raw = ptx
    ptx = re.sub(r"//.*", "", ptx)
    ptx = re.sub(r"\.common \.global .*\n", "", ptx)   # Numba's per-function exception flags, used or not
    ptx = re.sub(r"_ZN[0-9A-Za-z_]+", "SYM", ptx)   # mangled names embed closure ids
    smem = {}                                        # shared arrays are numbered per process: by first use here
    ptx = re.sub(r"_cudapy_smem_\d+", lambda m: smem.setdefault(m.group(0), "SMEM%d" % len(smem)), ptx)
    if os.environ.get("PTX_SAME_DUMP"):
        _dumped.append(ptx)
        with open(os.path.join(os.environ["PTX_SAME_DUMP"], "%03d.ptx" % len(_dumped)), "w") as f:
            f.write(ptx)
        with open(os.path.join(os.environ["PTX_SAME_DUMP"], "%03d.raw" % len(_dumped)), "w") as f:
            f.write(raw)                             # as compiled: ptxas takes it
    return hashlib.md5(ptx.encode()).hexdigest()[:10], len(ptx)
def want(label):
    return len(sys.argv) < 2 or any(label.startswith(a) for a in sys.argv[1:])
FLAG_SETS = [(False,)*7, (True, False, True, True, False, True, False), (True, True, False, False, True, False, True)]
for flags in FLAG_SETS:
    if want("simt fwd"):
        k = make_forward(32, 32, 64, "float32", *flags)[0]
        print("simt fwd", flags, h(cuda.compile_ptx(k.py_func, (f4a,)*4 + (f3, types.int64, types.int64) + opts, cc=(9,0))[0]))
    if want("simt dkdv"):
        k = make_dkdv(32, 32, 64, "float32", True, *flags, P_FORMAT="float16")[0]
        print("simt dkdv", flags, h(cuda.compile_ptx(k.py_func, (f4a,)*4 + (f3, f3, f4a, f4a, f4c, types.int64, types.int64) + opts, cc=(9,0))[0]))
    if want("simt dq"):
        k = make_dq(32, 32, 64, "float32", *flags)[0]
        print("simt dq", flags, h(cuda.compile_ptx(k.py_func, (f4a,)*4 + (f3, f3, f4a, types.int64, types.int64) + opts, cc=(9,0))[0]))
    bq, bk = plan.default_tc_tiles(64, None, None, "float16"); mt = plan.tc_m_tiles(bq, 64)
    if want("tc fwd"):
        k = make_forward_tc(bq, bk, 64, "float16", True, mt, plan.tc_q_in_smem(mt, 64), *flags, True)[0]
        print("tc fwd", flags, h(cuda.compile_ptx(k.py_func, (u4w,)*4 + (f3, types.int64, types.int64) + opts + (types.Array(types.uint64, 2, "C"),), cc=(9,0))[0]))
    bq, bk = plan.default_wgmma_tiles(64, None, None, "float16")
    if want("wgmma fwd"):
        k = make_forward_tc(bq, bk, 64, "float16", True, 1, True, *flags, True, WGMMA=True, TMA=True)[0]
        print("wgmma fwd", flags, h(cuda.compile_ptx(k.py_func, (u4w,)*4 + (f3, types.int64, types.int64) + opts + (types.Array(types.uint64, 2, "C"),), cc=(9,0,"a"))[0]))
    bq, bk = plan.default_tc_bwd_tiles(64, None, None, "float16"); split, mtk, share = plan._tc_bwd_layout(bq, bk, 64, "float16")
    if want("tc dkdv"):
        k = make_dkdv_tc(bq, bk, 64, "float16", True, *flags, split, True, MTK=mtk, SHARE=share)[0]
        print("tc dkdv", flags, h(cuda.compile_ptx(k.py_func, (u4w,)*4 + (f3, f3, u4w, u4w, f4c, types.int64, types.int64) + opts + (types.Array(types.uint64, 2, "C"),), cc=(9,0))[0]))
# the Hopper dK/dV kernel as plan.py builds it (16-bit, dense: DQ_FRAG and Q_i, dO_i by the copy engine (TMA); above
# head dim 128 two warpgroups, EXCHANGE)
for d in (64, 128, 256):
    for flags in FLAG_SETS:
        if want("wgmma dkdv %d %s" % (d, flags)):
            bq, bk = plan.wgmma_bwd_block_q(d), plan.default_tc_bwd_tiles(d, None, None, "float16")[1]
            k = make_dkdv_tc(bq, bk, d, "float16", True, *flags, plan.wgmma_bwd_dim_split(d), True, DEFER_DQ=False,
                             WGMMA=True, **plan._exchange(d), DQ_FRAG=True, **plan._dq_wgmma(True, bq, d),
                             TMA=plan.WGMMA_BWD_TMA)[0]
            print("wgmma dkdv", d, flags, h(cuda.compile_ptx(k.py_func, (u4w,)*4 + (f3, f3, u4w, u4w, f4c, types.int64, types.int64) + opts + (types.Array(types.uint64, 2, "C"),), cc=(9,0,"a"))[0]))
# dK/dV kernels as plan.backward builds them for other calls: float32 on tf32 (mma.sync), a packed 16-bit batch
# (the Hopper kernel with cp.async), bfloat16 causal, a padded head dim
PLAN_DKDV = [("float32", 64, {}), ("float32", 128, {}), ("float16", 128, {"total_q": 4000}),
             ("bfloat16", 128, {"causal": True}), ("float16", 96, {})]
for dt, d, extra in PLAN_DKDV:
    label = "plan dkdv %s %d %s" % (dt, d, sorted(extra))
    if want(label):
        built = []
        real = plan.make_dkdv_tc
        plan.make_dkdv_tc = lambda *a, **kw: built.append((a, kw)) or real(*a, **kw)
        flags = plan.Flags(*((True,) + (False,) * 6)) if extra.get("causal") else plan.Flags(*(False,) * 7)
        c = plan.Call(dt, 2, 1000, 1500, 8, 2, d, flags, True, None, None,
                      "tensorcore" if dt == "float32" else "auto", False, (None, True))
        if "total_q" in extra:
            c = c._replace(total_q=extra["total_q"], seqlen_q=1500)
        plan.backward.cache_clear() if hasattr(plan.backward, "cache_clear") else None
        plan.backward(c)
        plan.make_dkdv_tc = real
        a, kw = built[-1]
        k = real(*a, **kw)[0]
        arch = (9, 0, "a") if kw.get("WGMMA") else (9, 0)
        print(label, h(cuda.compile_ptx(k.py_func, (u4w,)*4 + (f3, f3, u4w, u4w, f4c, types.int64, types.int64) + opts + (types.Array(types.uint64, 2, "C"),), cc=arch)[0]))
# the FP8 forward (e4m3, Hopper) and its V^T pre-pass
from flashnb.kernels import forward_fp8 as _fp8
for label, keywords, ndim in (("fp8 fwd", {}, 2), ("fp8 varlen fwd", {"VARLEN": True}, 2),
                              ("fp8 blocks fwd", {"BLOCKS": True}, 3),      # (the descales' dimensions)
                              ("fp8 ws fwd", {"WARP_SPECIALISED": True}, 2),
                              ("fp8 ws varlen fwd", {"WARP_SPECIALISED": True, "VARLEN": True}, 2),
                              ("fp8 ws blocks fwd", {"WARP_SPECIALISED": True, "BLOCKS": True}, 3)):
    for d in (64, 128, 256):
        for causal in (False, True):
            if want("%s %d %s" % (label, d, causal)):
                k = _fp8.make_forward_fp8(d, "bfloat16", causal, **keywords)[0]
                fd = types.Array(types.float32, ndim, "A")
                sig = (u4w,) * 4 + (f3, fd, fd, fd, types.int64, types.int64, types.float32,
                                    types.Array(types.uint64, 2, "C")) + (types.Array(types.int32, 1, "C"),) * 3
                print(label, d, causal, h(cuda.compile_ptx(k.py_func, sig, cc=(9, 0, "a"),
                                                           launch_bounds=k.targetoptions.get("launch_bounds"))[0]))
if want("fp8 prepare"):
    b8 = types.Array(types.uint8, 4, "A")
    print("fp8 prepare", h(cuda.compile_ptx(_fp8.make_prepare_vt(128).py_func, (b8, b8), cc=(9, 0))[0]))
    i1 = types.Array(types.int32, 1, "C")
    print("fp8 prepare packed", h(cuda.compile_ptx(_fp8.make_prepare_vt_packed(128).py_func, (b8, b8, i1, i1, i1),
                                                   cc=(9, 0))[0]))
    w1, i8 = types.Array(types.uint32, 1, "A"), types.int64
    for d in (64, 128, 256):
        print("fp8 prepare words", d, h(cuda.compile_ptx(_fp8.make_prepare_vt_words(d).py_func, (w1, w1) + (i8,) * 10,
                                                          cc=(9, 0))[0]))
    for d in (64, 128, 256):
        print("fp8 prepare packed words", d, h(cuda.compile_ptx(_fp8.make_prepare_vt_packed_words(d).py_func,
                                                                 (w1, w1, i1, i1, i1) + (i8,) * 5, cc=(9, 0))[0]))
# the decode kernel at kvcache's settings: (dtype, head dim, group, seqlen_q, vec16, PAGED, HAS_SEQLENS, split,
# window, softcap, alibi, LEAN, leftpad, STAGES (None: kvcache's, fitted))
i64, f32t = types.int64, types.float32
DECODE = [("float16", 128, 4, 1, True, False, True, True, False, False, False, True, False, None),
          ("float16", 128, 4, 1, True, True, True, False, False, False, False, True, False, None),
          ("float16", 128, 4, 1, True, True, True, True, True, True, True, True, True, None),
          ("bfloat16", 128, 4, 1, True, False, False, True, True, False, False, True, False, None),
          ("bfloat16", 256, 4, 1, True, True, True, True, False, True, True, True, False, None),
          ("float16", 64, 8, 2, True, False, True, True, True, False, False, False, False, None),
          ("float16", 128, 4, 1, False, True, True, True, False, False, False, True, True, None),
          ("float16", 128, 4, 1, True, False, True, True, True, True, False, False, False, 0),
          ("float32", 128, 1, 1, True, False, True, True, False, False, False, True, False, None),
          ("float32", 64, 4, 1, True, True, True, False, True, True, True, True, True, None)]
for dt, d, group, sq, vec16, paged, seqlens, split, win, cap, alibi, lean, leftpad, stages in DECODE:
    label = " ".join(map(str, ("decode", dt, d, group, sq, vec16, paged, seqlens, split, win, cap, alibi, lean,
                                leftpad, stages)))
    if want(label):
        p = plan.plan_decode(dt, 1, 8, group, sq, d, 4096, vec16, 0, 132 * kvcache.BLOCKS_PER_SM, kvcache.E_BUDGET)
        if stages is None:
            stages = _decode.stages_that_fit(kvcache.STAGES, dt, d, p.lanes_per_key, kvcache.KEYS_PER_LANE,
                                             kvcache.NWARPS, kvcache.STAGE_BYTES_PER_SM // kvcache.BLOCKS_PER_SM)
        k = _decode.make_decode(dt, d, p.rows, p.lanes_per_key, kvcache.KEYS_PER_LANE, kvcache.NWARPS, p.vec16, paged,
                                seqlens, split, win, cap, alibi, stages, lean, leftpad)[0]
        w4 = types.Array(types.float32 if dt == "float32" else types.uint32, 4, "A")
        sig = (w4, w4, w4, w4, types.Array(types.float32, 3, "C"), types.Array(types.float32, 5, "C"),
               types.Array(types.float32, 4, "C"), types.Array(types.int32, 1, "C"), i64, i64,
               types.Array(types.int32, 2, "C"), i64, i64, i64, i64, i64, f32t, f32t, i64, i64,
               types.Array(types.float32, 2, "C"), types.Array(types.int32, 1, "C"))
        print(label, h(cuda.compile_ptx(k.py_func, sig, cc=(9,0))[0]))
for dt in ("float16", "bfloat16", "float32"):
    if want("combine " + dt):
        k = _decode.make_combine(dt)
        w4 = types.Array(types.float32 if dt == "float32" else types.uint32, 4, "A")
        sig = (types.Array(types.float32, 5, "C"), types.Array(types.float32, 4, "C"), w4, types.Array(types.float32, 3, "A"))
        print("combine", dt, h(cuda.compile_ptx(k.py_func, sig, cc=(9,0))[0]))
