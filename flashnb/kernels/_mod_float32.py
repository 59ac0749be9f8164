"""A ``flex_attention`` function's arithmetic in the scores' precision: float32 where the kernel's scores are
float32 (16-bit and float32 inputs), as PyTorch's FlexAttention computes it.

Numba types a mod with NumPy's rules: ``slopes[h] * (q_idx - kv_idx)``, a float32 times an int64, is a float64, so
the kernel converts every element's index difference to float64, multiplies in float64 and converts back (on
Hopper each conversion runs on the same 16-lane unit as ``exp2``: ALiBi written that way measured 2.8x a causal
mask's forward, bench/results/h200-flex-2026-11-28b.md).  PyTorch's rules keep the float's width: a float32 tensor
times an int tensor is float32, and an int divided by an int is float32 (the default dtype).

``float32_device_function(fn)`` compiles ``fn`` with one pass more, before Numba's type inference
(``narrow``): it types the function, and where an operation that Numba types float64 (or complex128) mixes an
integer with a float32 or complex64 (or divides two integers; or a ``math`` function takes an integer), it
converts the integer to float32 first and types it again, until nothing is left to convert (``float32 ** int``,
already float32 by Numba's integer power, is left alone).  An integer whose range fits in 32 bits by the indices'
bounds (each index is in ``[0, 2^31)``; constants; ``+ - * abs //`` and ``%`` by a positive constant of such
values; a bound past int64 is unknown, as int64 wraps) converts through int32 (or uint32), a conversion the SM
does on its integer pipe (``I2FP``), not on the 16-lane one.  Functions the mod calls compile as they would.

The oracle keeps NumPy's float64; the difference is float32 rounding of the mod's terms, inside the kernels'
bounds.  The simulator runs the function as Python (NumPy's rules), not this pass.
"""
import functools
import math
import operator

import numpy as np

INDEX_BOUND = 2 ** 31 - 1          # b, h, q_idx and kv_idx are each in [0, INDEX_BOUND]
INT32, UINT32, INT64 = (-2 ** 31, 2 ** 31 - 1), (0, 2 ** 32 - 1), (-2 ** 63, 2 ** 63 - 1)
_ARITH = (operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
          operator.pow, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
          operator.imod, operator.ipow)


def float32_device_function(fn):
    """``fn`` as a CUDA device function whose integer terms meet float32 as float32 (module docstring); in the
    simulator the plain device function."""
    from ._jit import SIMULATOR, device_function
    plain = device_function(fn)
    if SIMULATOR:
        return plain
    return _dispatcher_class(True, False)(fn, targetoptions=dict(plain.targetoptions))


def int32_compare_device_function(fn):
    """``fn`` (a mask_mod) as a CUDA device function whose integer comparisons run in int32 where both sides'
    bounds fit (``q_idx - kv_idx <= 1024``: Numba types ``int32 - int32`` as int64, and a 64-bit compare costs
    ptxas three instructions, a 32-bit one one); the same decisions, as the bounds hold.  Its floats stay as
    written.  In the simulator the plain device function."""
    from ._jit import SIMULATOR, device_function
    plain = device_function(fn)
    if SIMULATOR:
        return plain
    return _dispatcher_class(False, True)(fn, targetoptions=dict(plain.targetoptions))


@functools.cache
def _dispatcher_class(floats, compares):
    """A CUDA dispatcher whose device compiles run the pass before type inference on its own function (the
    functions it calls compile as they would).  numba-cuda's ``compile_device`` takes no pipeline, so the compiler
    class it reads is swapped for the compile, under Numba's (reentrant) compiler lock, and the function being
    compiled is named in ``_ACTIVE``: the pass acts on that function only.  Built on first use: the simulator has
    no compiler."""
    from numba.cuda import compiler
    from numba.cuda.core.compiler_lock import global_compiler_lock
    from numba.cuda.core.compiler_machinery import FunctionPass, register_pass
    from numba.cuda.core.typed_passes import NopythonTypeInference
    from numba.cuda.dispatcher import CUDADispatcher
    base = compiler.CUDACompiler

    @register_pass(mutates_CFG=False, analysis_only=False)
    class ModsFloat32(FunctionPass):
        _name = "flashnb_mods_float32"

        def __init__(self):
            FunctionPass.__init__(self)

        def run_pass(self, state):
            return (bool(_ACTIVE) and state.func_id.func is _ACTIVE[-1]
                    and narrow(state, floats=floats, compares=compares))

    class Compiler(base):
        def define_pipelines(self):
            (pm,) = base.define_pipelines(self)
            pm.passes.insert([cls for cls, _ in pm.passes].index(NopythonTypeInference),
                             (ModsFloat32, "a mod's integers meet float32 as float32"))
            pm.finalize()
            return [pm]

    class Dispatcher(CUDADispatcher):
        def compile_device(self, args, return_type=None):
            if args in self.overloads:
                return self.overloads[args]
            with global_compiler_lock:
                previous = compiler.CUDACompiler
                compiler.CUDACompiler = Compiler
                _ACTIVE.append(self.py_func)
                try:
                    return CUDADispatcher.compile_device(self, args, return_type)
                finally:
                    _ACTIVE.pop()
                    compiler.CUDACompiler = previous

    return Dispatcher


_ACTIVE = []            # the function a Dispatcher is compiling now (a stack: a mod's compile may nest another's)


def narrow(state, rounds=64, floats=True, compares=False):
    """Rewrite ``state.func_ir`` until its typing mixes no integer with float32 (``floats``) and compares no
    integers wider than int32 whose bounds fit int32 (``compares``); returns whether it changed."""
    from numba.cuda import types
    from numba.cuda.core.typed_passes import type_inference_stage
    changed = False
    for _ in range(rounds):
        typemap, _, _, _ = type_inference_stage(state.typingctx, state.targetctx, state.func_ir,
                                                        state.args, state.return_type, state.locals,
                                                        raise_errors=True)
        ranges = _int_ranges(state.func_ir, typemap, types, named=compares)
        fixes = [f + (True,) for f in _fixes(state.func_ir, typemap, types)] if floats else []
        if compares:
            fixes += [f + (False,) for f in _compare_fixes(state.func_ir, typemap, types, ranges)]
        if not fixes:
            return changed
        for block, stmt, expr, attr, index, to_float in fixes:
            _convert(block, stmt, expr, attr, index, ranges, to_float)
        changed = True
    raise RuntimeError("flashnb: a mod's rewrite did not settle")


_COMPARE = (operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne)


def _compare_fixes(func_ir, typemap, types, ranges):
    """(block, stmt, expr, attribute, None) of each operand of an integer comparison to take as int32: both
    operands integers, one wider than 32 bits, both inside int32's bounds."""
    fixes = []
    for block in func_ir.blocks.values():
        for stmt in block.body:
            expr = getattr(stmt, "value", None)
            if (type(stmt).__name__ != "Assign" or getattr(expr, "op", None) != "binop"
                    or expr.fn not in _COMPARE):
                continue
            lt, rt = typemap[expr.lhs.name], typemap[expr.rhs.name]
            if not (isinstance(lt, types.Integer) and isinstance(rt, types.Integer)):
                continue
            if lt == types.int32 and rt == types.int32:
                continue
            if _fits(ranges.get(expr.lhs.name), INT32) and _fits(ranges.get(expr.rhs.name), INT32):
                fixes += [(block, stmt, expr, side, None) for side, ty in (("lhs", lt), ("rhs", rt))
                          if ty != types.int32]
    return fixes


def _narrow_float(ty, types):
    return ty in (types.float32, types.complex64)


def _fixes(func_ir, typemap, types):
    """(block, stmt, expr, attribute, index) of each integer operand to convert to float32, in an operation whose
    result Numba types as float64 or complex128."""
    fixes = []
    wide = (types.float64, types.complex128)
    for block in func_ir.blocks.values():
        for stmt in block.body:
            if type(stmt).__name__ != "Assign" or typemap.get(stmt.target.name) not in wide:
                continue                          # (float32 ** int stays Numba's integer power, say)
            expr = stmt.value
            if getattr(expr, "op", None) in ("binop", "inplace_binop") and expr.fn in _ARITH:
                lt, rt = typemap[expr.lhs.name], typemap[expr.rhs.name]
                lint, rint = isinstance(lt, types.Integer), isinstance(rt, types.Integer)
                if lint and _narrow_float(rt, types):
                    fixes.append((block, stmt, expr, "lhs", None))
                elif rint and _narrow_float(lt, types):
                    fixes.append((block, stmt, expr, "rhs", None))
                elif lint and rint and expr.fn in (operator.truediv, operator.itruediv):
                    fixes += [(block, stmt, expr, "lhs", None), (block, stmt, expr, "rhs", None)]
            elif getattr(expr, "op", None) == "call" and _is_math(typemap.get(expr.func.name)):
                for i, arg in enumerate(expr.args):
                    if isinstance(typemap[arg.name], types.Integer):
                        fixes.append((block, stmt, expr, "args", i))
    return fixes


def _is_math(fnty):
    """Whether a callee's type is a ``math`` module function (``math.exp``, ``math.log``, ...)."""
    typing_key = getattr(fnty, "typing_key", None)
    return getattr(typing_key, "__module__", None) == "math" or typing_key in vars(math).values()


def _convert(block, stmt, expr, attr, index, ranges, to_float=True):
    """Insert ``float32(int32(x))`` (``uint32`` where x's range fits that, ``float32(x)`` where it fits neither)
    before ``stmt`` and make it the operand; without ``to_float``, ``int32(x)`` (x's range fits int32)."""
    from numba.cuda.core import ir
    var = getattr(expr, attr) if index is None else expr.args[index]
    scope, loc = var.scope, stmt.loc
    at = block.body.index(stmt)
    new = []
    if _fits(ranges.get(var.name), INT32):
        var = _call(ir, scope, loc, np.int32, var, new)
    elif _fits(ranges.get(var.name), UINT32):
        var = _call(ir, scope, loc, np.uint32, var, new)
    if to_float:
        var = _call(ir, scope, loc, np.float32, var, new)
    block.body[at:at] = new
    if index is None:
        setattr(expr, attr, var)
    else:
        expr.args[index] = var


def _call(ir, scope, loc, fn, arg, out):
    g = scope.redefine("$flashnb_" + fn.__name__, loc)
    out.append(ir.Assign(ir.Global(fn.__name__, fn, loc), g, loc))
    v = scope.redefine("$flashnb_cast", loc)
    out.append(ir.Assign(ir.Expr.call(g, (arg,), (), loc), v, loc))
    return v


def _fits(rng, bounds):
    return rng is not None and bounds[0] <= rng[0] and rng[1] <= bounds[1]


def _int_ranges(func_ir, typemap, types, named=False):
    """Bounds of the integer variables defined once, from the arguments' (each integer argument is an index in
    ``[0, INDEX_BOUND]``), integer constants (``named``: also a global or captured integer's value) and
    ``+ - * abs //, %`` by positive constants of them."""
    defs = {}
    for block in func_ir.blocks.values():
        for stmt in block.body:
            if type(stmt).__name__ == "Assign":
                defs.setdefault(stmt.target.name, []).append(stmt.value)
    ranges = {}

    def rng(name, depth=0):
        if name in ranges:
            return ranges[name]
        ranges[name] = None                               # (a cycle through a phi reads as unknown)
        values = defs.get(name, [])
        if depth > 50 or len(values) != 1 or not isinstance(typemap.get(name), types.Integer):
            return None
        found = _range_of(values[0], lambda n: rng(n, depth + 1), typemap, types, named)
        ranges[name] = found if found is None or _fits(found, INT64) else None   # (past int64 it wraps)
        return ranges[name]

    for name in defs:
        rng(name)
    return ranges


def _range_of(value, rng, typemap, types, named=False):
    kind = type(value).__name__
    if kind == "Arg":
        return (0, INDEX_BOUND) if isinstance(typemap.get(value.name), types.Integer) else None
    if ((kind == "Const" or named and kind in ("Global", "FreeVar")) and isinstance(value.value, (int, np.integer))
            and not isinstance(value.value, bool)):
        return (int(value.value), int(value.value))          # (a global or captured integer is frozen: a constant)
    if kind == "Var":
        return rng(value.name)
    if kind != "Expr":
        return None
    if value.op == "cast":
        return rng(value.value.name)
    if value.op in ("binop", "inplace_binop"):
        a, b = rng(value.lhs.name), rng(value.rhs.name)
        if a is None or b is None:
            return None
        fn = value.fn
        if fn in (operator.add, operator.iadd):
            return (a[0] + b[0], a[1] + b[1])
        if fn in (operator.sub, operator.isub):
            return (a[0] - b[1], a[1] - b[0])
        if fn in (operator.mul, operator.imul):
            ends = [x * y for x in a for y in b]
            return (min(ends), max(ends))
        if fn in (operator.floordiv, operator.ifloordiv) and b[0] > 0:
            ends = [x // y for x in a for y in b]
            return (min(ends), max(ends))
        if fn in (operator.mod, operator.imod) and b[0] > 0:
            return (0, b[1] - 1)
        return None
    if value.op == "unary" and value.fn == operator.neg:
        a = rng(value.value.name)
        return None if a is None else (-a[1], -a[0])
    if value.op == "call" and len(value.args) == 1 and not value.kws:
        fnty = typemap.get(value.func.name)
        if getattr(fnty, "typing_key", None) is abs:
            a = rng(value.args[0].name)
            if a is None:
                return None
            lo = 0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1]))
            return (lo, max(abs(a[0]), abs(a[1])))
    return None

