"""A flex_attention function's arithmetic in float32 for the float32-accumulating kernels
(``flashnb.kernels._mod_float32``): typed by numba-cuda's compiler in a child process without the simulator (no
GPU is needed to type a device function: the device is stood in, as tools.sass_tc does)."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, math, sys
import numpy as np
import numba.cuda.dispatcher as dispatcher
from numba.cuda import types

class _Capability:
    compute_capability = (9, 0)

dispatcher.get_current_device = lambda: _Capability()
from flashnb import flex
from flashnb.kernels._mod_float32 import float32_device_function, int32_compare_device_function
from flashnb.kernels._jit import device_function

slopes = np.array([0.5, 0.25, 0.125], np.float32)
table = np.arange(8, dtype=np.float32)

def alibi(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx)

def product(score, b, h, q_idx, kv_idx):          # q_idx * kv_idx may pass 2^32: no 32-bit detour
    return score + table[h] * (q_idx * kv_idx)

def shifted(score, b, h, q_idx, kv_idx):          # q_idx + kv_idx + 1 < 2^32 but not 2^31: uint32
    return score + table[h] * (q_idx + kv_idx + 1)

def ratio(score, b, h, q_idx, kv_idx):            # an int over an int, and math.log of an int
    return score + q_idx / (kv_idx + 1) + math.log(abs(q_idx - kv_idx) + 1)

def power(score, b, h, q_idx, kv_idx):            # float32 ** int is float32 already (Numba's integer power)
    return score ** 2 + score

def branchy(score, b, h, q_idx, kv_idx):          # a branch, a ternary and a loop (Jump and Branch statements)
    bias = score * 0 if q_idx >= kv_idx else slopes[h] * (q_idx - kv_idx)
    for i in range(2):
        bias = bias + slopes[i] * i
    if kv_idx > 3:
        bias = bias - table[h] * kv_idx
    return score + bias

def cubed(score, b, h, q_idx, kv_idx):            # q_idx^3 passes int64 (it wraps): no 32-bit detour after it
    return score + table[h] * ((q_idx * q_idx * q_idx) // 2 ** 61)

def casts(dev, args):
    cres = dev.compile_device(args)
    typemap = cres.fndesc.typemap
    kinds = sorted(str(t) for name, t in typemap.items() if name.startswith("$flashnb_cast"))
    wide = sorted({str(t) for t in typemap.values() if str(t) in ("float64", "complex128")})
    return {"ret": str(cres.signature.return_type), "casts": kinds, "wide": wide}

WINDOW = 1024
ids = np.array([0, 0, 1, 1, 2], np.int32)

def sliding(b, h, q_idx, kv_idx):                 # q_idx - kv_idx is int64 by Numba's rules, in int32's bounds
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

def far(b, h, q_idx, kv_idx):                     # q_idx + kv_idx may pass 2^31: left in int64
    return q_idx + kv_idx < 3000000000

def document(b, h, q_idx, kv_idx):                # int32 ids, int32 indices: nothing to narrow
    return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

def compare_casts(dev, args):
    cres = dev.compile_device(args)
    return sorted(str(t) for name, t in cres.fndesc.typemap.items() if name.startswith("$flashnb_cast"))

i64 = types.int64
i32 = types.int32
sig = (types.float32, i64, i64, i64, i64)
out = {}
for fn in (alibi, product, shifted, ratio, power, branchy, cubed):
    out[fn.__name__] = {"plain": casts(device_function(fn), sig), "float32": casts(float32_device_function(fn), sig)}
step = flex._complex_step(alibi, True)
step.compile_device(sig)
mod = flex._compiled(alibi, True)
out["step"] = casts(mod, (types.complex64, i64, i64, i64, i64))
for fn in (sliding, far, document):
    out["mask " + fn.__name__] = {"int32 args": compare_casts(int32_compare_device_function(fn), (i32,) * 4),
                                  "int64 args": compare_casts(int32_compare_device_function(fn), (i64,) * 4),
                                  "plain": compare_casts(device_function(fn), (i32,) * 4)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def typed():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_float32_times_an_index_difference_stays_float32_through_int32(typed):
    """NumPy's rules make ALiBi's ``slopes[h] * (q_idx - kv_idx)`` float64; the pass converts the difference (in
    (-2^31, 2^31) by the indices' bounds) through int32 to float32, and nothing is float64."""
    assert typed["alibi"]["plain"]["ret"] == "float64"           # (what the pass exists for)
    assert typed["alibi"]["float32"] == {"ret": "float32", "casts": ["float32", "int32"], "wide": []}


def test_the_32_bit_detour_is_taken_only_where_the_range_fits(typed):
    assert typed["product"]["float32"] == {"ret": "float32", "casts": ["float32"], "wide": []}
    assert typed["shifted"]["float32"] == {"ret": "float32", "casts": ["float32", "uint32"], "wide": []}


def test_an_integer_quotient_and_math_of_an_integer_are_float32(typed):
    """``q_idx / (kv_idx + 1)`` converts both sides (PyTorch: an int over an int is float32): q_idx through int32,
    ``kv_idx + 1`` (up to 2^31) through uint32; ``math.log`` of an integer takes it as float32 (``abs(q - kv) + 1``:
    uint32)."""
    got = typed["ratio"]["float32"]
    assert got["ret"] == "float32" and got["wide"] == []
    assert got["casts"] == ["float32"] * 3 + ["int32", "uint32", "uint32"]
    assert typed["ratio"]["plain"]["wide"] == ["float64"]


def test_branches_and_loops_are_rewritten_too(typed):
    got = typed["branchy"]["float32"]
    assert got["ret"] == "float32" and got["wide"] == [] and "int32" in got["casts"]
    assert typed["branchy"]["plain"]["wide"] == ["float64"]


def test_a_range_past_int64_is_unknown(typed):
    """``q_idx ** 3`` wraps in int64: its quotient's range is not known, so it converts as int64 (no int32 or
    uint32 on the way, which would turn a wrapped negative quotient into a large positive one)."""
    assert typed["cubed"]["float32"] == {"ret": "float32", "casts": ["float32"], "wide": []}


def test_an_operation_numba_types_float32_is_left_alone(typed):
    """``score ** 2`` is float32 by Numba's integer power: converting the 2 would make it ``powf``."""
    assert typed["power"]["float32"] == {"ret": "float32", "casts": [], "wide": []}


def test_the_complex_step_of_a_float32_kernel_is_complex64(typed):
    assert typed["step"] == {"ret": "complex64", "casts": ["float32", "int32"], "wide": []}


def test_a_mask_mods_integer_comparisons_run_in_int32_where_their_bounds_fit(typed):
    """``int32_compare_device_function``: the sliding window's ``q_idx - kv_idx <= WINDOW`` (int64 by Numba's rules
    from int32 indices, a 64-bit compare in SASS) compares int32s: the difference and the global's value are cast;
    with int64 indices ``q_idx >= kv_idx`` is narrowed too.  A sum that may pass 2^31 stays int64, and int32 ids
    against int32 indices need nothing."""
    assert typed["mask sliding"] == {"int32 args": ["int32", "int32"], "int64 args": ["int32"] * 4, "plain": []}
    assert typed["mask far"] == {"int32 args": [], "int64 args": [], "plain": []}
    assert typed["mask document"] == {"int32 args": [], "int64 args": ["int32", "int32"], "plain": []}
