"""A hash of the PTX of the shipped kernels' default specialisations (SIMT forward, dK/dV, dQ; mma.sync forward and
dK/dV; the Hopper forward), for sm_90 on the CPU machine, at three option sets (none; window + block mask +
softcap + ALiBi; window + mask + bias + dropout).  Mangled names (which embed closure ids) and comments are
dropped, and Numba's ``.common .global`` flag declarations, so equal hashes mean the same instructions.  Compare two trees:

    git worktree add /tmp/old REV
    (cd /tmp/old && PYTHONPATH=/tmp/old:$OLDPWD python $OLDPWD/tools/ptx_same.py) > old.txt
    python -m tools.ptx_same > new.txt; diff old.txt new.txt
"""
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
plan.shared_limit = lambda: 232448
plan.compute_capability = lambda: (9, 0)
f4a, f4c = types.Array(types.float32, 4, "A"), types.Array(types.float32, 4, "C")
f3 = types.Array(types.float32, 3, "C"); u4 = types.Array(types.uint8, 4, "C"); u4w = types.Array(types.uint32, 4, "C")
opts = (types.float32, types.float32, types.int64, types.int64, u4, f4c, types.Array(types.float32, 2, "C"), u4,
        types.int64, types.int64, types.int64, types.float32, types.int64, types.int64,
        types.Array(types.int32, 1, "C"), types.Array(types.int32, 1, "C"))
def h(ptx):
    """(hash, size) of the PTX without comments and mangled names."""
    ptx = re.sub(r"//.*", "", ptx)
    ptx = re.sub(r"\.common \.global .*\n", "", ptx)   # Numba's per-function exception flags, used or not
    ptx = re.sub(r"_ZN[0-9A-Za-z_]+", "SYM", ptx)   # mangled names embed closure ids
    return hashlib.md5(ptx.encode()).hexdigest()[:10], len(ptx)
for flags in [(False,)*7, (True, False, True, True, False, True, False), (True, True, False, False, True, False, True)]:
    k = make_forward(32, 32, 64, "float32", *flags)[0]
    print("simt fwd", flags, h(cuda.compile_ptx(k.py_func, (f4a,)*4 + (f3, types.int64, types.int64) + opts, cc=(9,0))[0]))
    k = make_dkdv(32, 32, 64, "float32", True, *flags, P_FORMAT="float16")[0]
    print("simt dkdv", flags, h(cuda.compile_ptx(k.py_func, (f4a,)*4 + (f3, f3, f4a, f4a, f4c, types.int64, types.int64) + opts, cc=(9,0))[0]))
    k = make_dq(32, 32, 64, "float32", *flags)[0]
    print("simt dq", flags, h(cuda.compile_ptx(k.py_func, (f4a,)*4 + (f3, f3, f4a, types.int64, types.int64) + opts, cc=(9,0))[0]))
    bq, bk = plan.default_tc_tiles(64, None, None, "float16"); mt = plan.tc_m_tiles(bq, 64)
    k = make_forward_tc(bq, bk, 64, "float16", True, mt, plan.tc_q_in_smem(mt, 64), *flags, True)[0]
    print("tc fwd", flags, h(cuda.compile_ptx(k.py_func, (u4w,)*4 + (f3, types.int64, types.int64) + opts + (types.Array(types.uint64, 2, "C"),), cc=(9,0))[0]))
    bq, bk = plan.default_wgmma_tiles(64, None, None, "float16")
    k = make_forward_tc(bq, bk, 64, "float16", True, 1, True, *flags, True, WGMMA=True, TMA=True)[0]
    print("wgmma fwd", flags, h(cuda.compile_ptx(k.py_func, (u4w,)*4 + (f3, types.int64, types.int64) + opts + (types.Array(types.uint64, 2, "C"),), cc=(9,0,"a"))[0]))
    bq, bk = plan.default_tc_bwd_tiles(64, None, None, "float16"); split, mtk, share = plan._tc_bwd_layout(bq, bk, 64, "float16")
    k = make_dkdv_tc(bq, bk, 64, "float16", True, *flags, split, True, MTK=mtk, SHARE=share)[0]
    print("tc dkdv", flags, h(cuda.compile_ptx(k.py_func, (u4w,)*4 + (f3, f3, u4w, u4w, f4c, types.int64, types.int64) + opts, cc=(9,0))[0]))
