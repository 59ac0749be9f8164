"""Warp-level tensor-core primitives: ``mma.sync.m16n8k16`` and float32 -> 16-bit packing.

numba-cuda has no tensor-core API.  On the GPU each primitive is a Numba
``@intrinsic`` that emits one inline-PTX instruction (no foreign code, no
linking; under LLVM it inlines to a single ``HMMA.16816.F32`` or ``F2FP``).  In
the simulator the same names are Python device functions that do the warp's
work through a shared-memory scratch and two barriers, so CI runs the *same*
tensor-core kernels on the CPU.  Everything else (tiles, softmax, masks, loops)
stays in the kernels, in Python.

Fragment layout of ``d = a @ b + c`` for one warp (PTX ISA, "Matrix Fragments
for mma.m16n8k16"), lane ``= 4 * g + t`` (``g = lane >> 2``, ``t = lane & 3``).
A 16-bit pair is one 32-bit register, low half first:

    a (16 x 16, row-major) a[0] = A[g,   2t:2t+2]   a[1] = A[g+8, 2t:2t+2]
                           a[2] = A[g, 2t+8:2t+10]  a[3] = A[g+8, 2t+8:2t+10]
    b (16 x 8, "col")      b[0] = B[2t:2t+2, g]     b[1] = B[2t+8:2t+10, g]
    c, d (16 x 8, float32) c[0], c[1] = C[g, 2t], C[g, 2t+1]
                           c[2], c[3] = C[g+8, 2t], C[g+8, 2t+1]

So ``a`` fragments are 32-bit words of a row-major tile, ``b`` fragments are
32-bit words of a tile stored key-major (``B^T`` row-major), and an output
fragment of one ``mma`` (two n-tiles side by side) is, packed in pairs, exactly
the ``a`` fragment of the next: FlashAttention-2 keeps ``P`` in registers.

Every thread of the block must call a simulated ``mma`` together (it contains
barriers); the kernels call them in uniform control flow, as the hardware
requires of ``mma.sync`` within a warp anyway.
"""
import math

import numpy as np
from numba import cuda

from ._jit import SIMULATOR, device_function

FORMATS = {"float16": "f16", "bfloat16": "bf16", "float32": "tf32"}   # PTX type of the operands


def _gpu_primitives(fmt):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i32, f32 = ir.IntType(32), ir.FloatType()
    shape = "m16n8k8" if fmt == "tf32" else "m16n8k16"     # tf32: 8 values of k in the same 4 + 2 registers
    mma_ptx = (f"mma.sync.aligned.{shape}.row.col.f32.{fmt}.{fmt}.f32 "
               "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
    RET = types.UniTuple(types.float32, 4)

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """(d0, d1, d2, d3) = a @ b + c on one warp's fragments (uint32 a, b; float32 c)."""
        sig = RET(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, signature, args):
            tys = signature.args
            ins = [context.cast(builder, x, t, types.uint32) for x, t in zip(args[:6], tys[:6])]
            ins += [context.cast(builder, x, t, types.float32) for x, t in zip(args[6:], tys[6:])]
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fnty, mma_ptx, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, ins)
            return context.make_tuple(builder, RET, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    if fmt == "tf32":
        return mma, None, None

    @intrinsic
    def pack2(typingctx, lo, hi):
        """uint32 holding ``lo`` (low half) and ``hi`` rounded to the 16-bit format, to nearest even."""
        sig = types.uint32(lo, hi)

        def codegen(context, builder, signature, args):
            lo_v, hi_v = (context.cast(builder, x, t, types.float32) for x, t in zip(args, signature.args))
            asm = ir.InlineAsm(ir.FunctionType(i32, [f32, f32]), f"cvt.rn.{fmt}x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, [hi_v, lo_v])      # cvt puts its first source in the upper half

        return sig, codegen

    if fmt == "f16":
        unpack_ptx = "{ .reg .f16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }"
    else:
        unpack_ptx = "{ .reg .b32 l, h; shl.b32 l, $2, 16; and.b32 h, $2, 0xffff0000; mov.b32 $0, l; mov.b32 $1, h; }"
    RET2 = types.UniTuple(types.float32, 2)

    @intrinsic
    def unpack2(typingctx, word):
        """(lo, hi): the two 16-bit values of a uint32 word as float32 (exact)."""
        sig = RET2(word)

        def codegen(context, builder, signature, args):
            w = context.cast(builder, args[0], signature.args[0], types.uint32)
            res = builder.call(ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32, f32]), [i32]), unpack_ptx,
                                            "=f,=f,r"), [w])
            return context.make_tuple(builder, RET2, [builder.extract_value(res, 0), builder.extract_value(res, 1)])

        return sig, codegen

    return mma, pack2, unpack2


def _gpu_memory_primitives():
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    i32, i64 = ir.IntType(32), ir.IntType(64)

    def item_address(context, builder, aryty, aryval, idx_types, idx_vals):
        """Generic address (i64) of ``ary[idx...]``."""
        ary = context.make_array(aryty)(context, builder, aryval)
        inds = [context.cast(builder, v, t, types.intp) for v, t in zip(idx_vals, idx_types)]
        return builder.ptrtoint(cgutils.get_item_pointer(context, builder, aryty, ary, inds), i64)

    def shared_address(context, builder, aryty, aryval, idx_type, idx_val):
        """32-bit shared-window address of ``ary[i]`` (a 1-D C-contiguous shared array): the array's
        base cast to the shared address space once, plus ``4 i`` in 32-bit arithmetic.  Visible to
        ptxas as ``add.s32`` (folded into the instruction's immediate offset), where a 64-bit generic
        address would cost a 64-bit add and a move per access."""
        assert aryty.ndim == 1 and aryty.layout == "C", aryty
        ary = context.make_array(aryty)(context, builder, aryval)
        base = builder.ptrtoint(builder.addrspacecast(ary.data, ir.PointerType(ary.data.type.pointee, 3)), i32)
        i = builder.trunc(context.cast(builder, idx_val, idx_type, types.uint64), i32)
        size = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
        return builder.add(base, builder.mul(i, ir.Constant(i32, size)))

    def make_cp_async(nbytes):
        cache = "cg" if nbytes == 16 else "ca"            # 16 bytes: bypass L1 (FA2 does the same)
        ptx = ("{ .reg .u64 ga; cvta.to.global.u64 ga, $1; "
               f"cp.async.{cache}.shared.global [$0], [ga], {nbytes}, $2; }}")

        @intrinsic
        def cp_async(typingctx, dst, dst_i, src, src_off, src_bytes):
            """Start copying ``nbytes`` from element ``src_off`` (counted from ``src``'s first element, in
            elements) to shared ``dst[dst_i]``; ``src_bytes`` < nbytes: the rest is zero-filled."""
            sig = types.void(dst, dst_i, src, src_off, src_bytes)

            def codegen(context, builder, signature, args):
                tys = signature.args
                d = shared_address(context, builder, tys[0], args[0], tys[1], args[1])
                ary = context.make_array(tys[2])(context, builder, args[2])
                off = builder.mul(context.cast(builder, args[3], tys[3], types.int64),
                                  ir.Constant(i64, context.get_abi_sizeof(context.get_data_type(tys[2].dtype))))
                g = builder.add(builder.ptrtoint(ary.data, i64), off)
                n = context.cast(builder, args[4], tys[4], types.uint32)
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32, i64, i32]), ptx, "r,l,r",
                                          side_effect=True), [d, g, n])
                return context.get_dummy_value()

            return sig, codegen

        return cp_async

    @intrinsic
    def cp_async_commit(typingctx):
        """Close the group of copies this thread started since the last commit."""
        def codegen(context, builder, signature, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "",
                                      side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen

    def make_wait(n):
        @intrinsic
        def cp_async_wait(typingctx):
            """Wait until at most ``n`` of this thread's committed groups are still in flight."""
            def codegen(context, builder, signature, args):
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {n};", "",
                                          side_effect=True), [])
                return context.get_dummy_value()
            return types.void(), codegen
        return cp_async_wait

    def make_ldmatrix(trans):
        ptx = f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0, $1, $2, $3}}, [$4];"
        RET = types.UniTuple(types.uint32, 4)

        @intrinsic
        def ldmatrix_x4(typingctx, ary, i):
            """Four 8 x 8 16-bit matrices; lane ``l`` names row ``l % 8`` of matrix ``l // 8`` (at ``ary[i]``)."""
            sig = RET(ary, i)

            def codegen(context, builder, signature, args):
                a = shared_address(context, builder, signature.args[0], args[0], signature.args[1], args[1])
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32]), ptx,
                                   "=r,=r,=r,=r,r", side_effect=True)
                res = builder.call(asm, [a])
                return context.make_tuple(builder, RET, [builder.extract_value(res, j) for j in range(4)])

            return sig, codegen

        return ldmatrix_x4

    @intrinsic
    def exp2_ftz(typingctx, x):
        """2**x as one MUFU.EX2 (ex2.approx.ftz: ~2 ulp; results below 2**-126 flush to 0).

        ``math.exp2`` lowers to ex2.approx without ftz, which the compiler wraps in a
        denormal range check and two rescaling multiplies: 4 extra instructions per score.
        """
        sig = types.float32(x)

        def codegen(context, builder, signature, args):
            xv = context.cast(builder, args[0], signature.args[0], types.float32)
            f32 = ir.FloatType()
            return builder.call(ir.InlineAsm(ir.FunctionType(f32, [f32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f"),
                                [xv])

        return sig, codegen

    def make_red_add(n):
        """``ary.flat[off + e] += x_e`` for ``n`` (2 or 4) float32 values (``ary`` C-contiguous float32) as one
        vector reduction (sm_90: ``red.global.add.v2.f32`` / ``.v4.f32``; the ``4 n`` bytes must be aligned to
        their size).  The flat offset lets the caller step it instead of recomputing four indices."""
        regs = ", ".join(f"${e + 1}" for e in range(n))
        ptx = f"{{ .reg .u64 ga; cvta.to.global.u64 ga, $0; red.global.add.v{n}.f32 [ga], {{{regs}}}; }}"
        f32 = ir.FloatType()

        def codegen(context, builder, signature, args):
            tys = signature.args
            assert tys[0].layout == "C", tys[0]
            arr = context.make_array(tys[0])(context, builder, args[0])
            o = builder.mul(context.cast(builder, args[1], tys[1], types.int64), ir.Constant(i64, 4))
            a = builder.add(builder.ptrtoint(arr.data, i64), o)
            vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args[2:], tys[2:])]
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i64] + [f32] * n), ptx, "l" + ",f" * n,
                                      side_effect=True), [a] + vals)
            return context.get_dummy_value()

        if n == 2:
            @intrinsic
            def red_add(typingctx, ary, off, x, y):
                return types.void(ary, off, x, y), codegen
        else:
            @intrinsic
            def red_add(typingctx, ary, off, x, y, z, w):
                return types.void(ary, off, x, y, z, w), codegen
        return red_add

    return dict(exp2_ftz=exp2_ftz, cp_async16=make_cp_async(16), cp_async4=make_cp_async(4), cp_async_commit=cp_async_commit,
                cp_async_wait_all=make_wait(0), cp_async_wait_prev=make_wait(1),
                ldmatrix_x4=make_ldmatrix(False), ldmatrix_x4_trans=make_ldmatrix(True), red_add_f32x2=make_red_add(2),
                red_add_f32x4=make_red_add(4))


# --------------------------------------------------------------------------------------
# Simulator twins.  Index maps from (row, col) of A (16 x 16), B (16 x 8), C (16 x 8) to
# (lane, register, half) of the layout above.
# --------------------------------------------------------------------------------------
_R16, _K16 = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
A_LANE, A_REG, A_HALF = (_R16 % 8) * 4 + (_K16 % 8) // 2, _R16 // 8 + 2 * (_K16 // 8), _K16 % 2
_K, _N = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
B_LANE, B_REG, B_HALF = _N * 4 + (_K % 8) // 2, _K // 8, _K % 2
_R, _C = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
C_LANE, C_REG = (_R % 8) * 4 + _C // 2, (_R // 8) * 2 + _C % 2
MAX_WARPS = 32
U32_DT, F32_DT, I64_DT = np.dtype(np.uint32), np.dtype(np.float32), np.dtype(np.int64)


def halves_to_float(words, half, fmt):
    """float64 values of the 16-bit halves ``half`` (0 low, 1 high) of uint32 ``words``."""
    bits = ((np.asarray(words, dtype=np.uint32) >> (16 * np.asarray(half, dtype=np.uint32))) & 0xFFFF)
    if fmt == "f16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def float_to_bits(x, fmt):
    """16-bit patterns (uint32) of float32 ``x`` rounded to nearest even: float16 or bfloat16."""
    x = np.asarray(x, dtype=np.float32)
    if fmt == "f16":
        return x.astype(np.float16).view(np.uint16).astype(np.uint32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    return np.where(np.isnan(x), np.uint32(0x7FC0), rounded & 0xFFFF).astype(np.uint32)


# m16n8k8 with 32-bit (tf32) operands: a[0] = A[g, t], a[1] = A[g + 8, t], a[2] = A[g, t + 4], a[3] = A[g + 8, t + 4];
# b[0] = B[t, g], b[1] = B[t + 4, g]; c as above.  In 32-bit words these are the 16-bit layouts' words.
_R8, _K8 = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
A8_LANE, A8_REG = (_R8 % 8) * 4 + _K8 % 4, _R8 // 8 + 2 * (_K8 // 4)
_KB, _NB = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
B8_LANE, B8_REG = _NB * 4 + _KB % 4, _KB // 4
TF32_MASK = np.uint32(0xFFFFE000)          # a tf32 operand is a float32 of which the tensor cores read 19 bits


def tf32_values(words):
    """float64 values of uint32 ``words`` read as tf32 operands (float32 bits, the low 13 ignored)."""
    return (np.asarray(words, dtype=np.uint32) & TF32_MASK).view(np.float32).astype(np.float64)


def _sim_mma(operands):
    """The simulator's ``mma``: the warp's fragments meet in shared memory, lane 0 multiplies in float64
    (products of 16-bit or tf32 values are exact), each lane takes its part of D.  ``operands(frag_a,
    frag_b)``: the warp's A and B matrices (float64) from its 32 x 4 and 32 x 2 fragment words."""
    @device_function
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        frag_a = cuda.shared.array((MAX_WARPS, 32, 4), U32_DT)
        frag_b = cuda.shared.array((MAX_WARPS, 32, 2), U32_DT)
        frag_c = cuda.shared.array((MAX_WARPS, 32, 4), F32_DT)
        tid = cuda.threadIdx.x
        w, lane = tid // 32, tid % 32
        frag_a[w, lane, 0], frag_a[w, lane, 1], frag_a[w, lane, 2], frag_a[w, lane, 3] = a0, a1, a2, a3
        frag_b[w, lane, 0], frag_b[w, lane, 1] = b0, b1
        frag_c[w, lane, 0], frag_c[w, lane, 1], frag_c[w, lane, 2], frag_c[w, lane, 3] = c0, c1, c2, c3
        cuda.syncthreads()
        if lane == 0:
            a, b = operands(frag_a[w], frag_b[w])
            frag_c[w][C_LANE, C_REG] = (a @ b + frag_c[w][C_LANE, C_REG]).astype(np.float32)
        cuda.syncthreads()
        d0, d1, d2, d3 = frag_c[w, lane, 0], frag_c[w, lane, 1], frag_c[w, lane, 2], frag_c[w, lane, 3]
        cuda.syncthreads()                                   # read before the next call overwrites
        return d0, d1, d2, d3

    return mma


def _sim_primitives(fmt):
    if fmt == "tf32":                                        # A 16 x 8, B 8 x 8
        return _sim_mma(lambda fa, fb: (tf32_values(fa[A8_LANE, A8_REG]), tf32_values(fb[B8_LANE, B8_REG]))), \
            None, None
    mma = _sim_mma(lambda fa, fb: (halves_to_float(fa[A_LANE, A_REG], A_HALF, fmt),          # A 16 x 16
                                   halves_to_float(fb[B_LANE, B_REG], B_HALF, fmt)))         # B 16 x 8

    @device_function
    def pack2(lo, hi):
        return np.uint32(float_to_bits(lo, fmt) | (float_to_bits(hi, fmt) << np.uint32(16)))

    @device_function
    def unpack2(word):
        return np.float32(halves_to_float(word, 0, fmt)), np.float32(halves_to_float(word, 1, fmt))

    return mma, pack2, unpack2


def _sim_memory_primitives():
    """Copies happen at once (commit/wait have nothing to do); ldmatrix exchanges row addresses in shared memory."""

    def make_cp_async(words):
        @device_function
        def cp_async(dst, dst_i, src, src_off, src_bytes):
            a = getattr(src, "_ary", src)                # the simulator's array wraps a NumPy array
            span = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.strides)) // a.itemsize
            flat = np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,))
            for w in range(words):
                dst[dst_i + w] = flat[src_off + w] if src_bytes > 0 else 0
        return cp_async

    @device_function
    def nothing():
        pass

    def make_ldmatrix(trans):
        @device_function
        def ldmatrix_x4(ary, i):
            rows = cuda.shared.array((MAX_WARPS, 32), I64_DT)
            tid = cuda.threadIdx.x
            w, lane = tid // 32, tid % 32
            rows[w, lane] = i                            # this lane's row: 8 halves = 4 words from ary[i]
            cuda.syncthreads()
            g, t = lane // 4, lane % 4
            regs = [np.uint32(0)] * 4
            for m in range(4):
                if trans:   # halves (row 2t, col g) and (row 2t + 1, col g) of matrix m
                    lo = (int(ary[rows[w, 8 * m + 2 * t] + g // 2]) >> (16 * (g % 2))) & 0xFFFF
                    hi = (int(ary[rows[w, 8 * m + 2 * t + 1] + g // 2]) >> (16 * (g % 2))) & 0xFFFF
                    regs[m] = np.uint32(lo | (hi << 16))
                else:       # halves (row g, cols 2t, 2t + 1): word t of row g
                    regs[m] = np.uint32(ary[rows[w, 8 * m + g] + t])
            cuda.syncthreads()
            return regs[0], regs[1], regs[2], regs[3]
        return ldmatrix_x4

    @device_function
    def exp2_ftz(x):
        return np.float32(math.exp2(x)) if x > -126.0 or x != x else np.float32(0.0)

    @device_function
    def red_add_f32x2(ary, off, x, y):
        a = getattr(ary, "_ary", ary)
        assert a.flags.c_contiguous                      # so that reshape is a view, as the GPU's offsets assume
        flat = a.reshape(-1)
        cuda.atomic.add(flat, off, x)
        cuda.atomic.add(flat, off + 1, y)

    @device_function
    def red_add_f32x4(ary, off, x, y, z, w):
        red_add_f32x2(ary, off, x, y)
        red_add_f32x2(ary, off + 2, z, w)

    return dict(exp2_ftz=exp2_ftz, cp_async16=make_cp_async(4), cp_async4=make_cp_async(1), cp_async_commit=nothing,
                cp_async_wait_all=nothing, cp_async_wait_prev=nothing,
                ldmatrix_x4=make_ldmatrix(False), ldmatrix_x4_trans=make_ldmatrix(True), red_add_f32x2=red_add_f32x2,
                red_add_f32x4=red_add_f32x4)


# alignment of the dynamic shared-memory array: cp.async (16 bytes) and ldmatrix rows need 16;
# the simulator takes no alignment argument
SMEM_ALIGN = None if SIMULATOR else 16


_cache = {}


def memory_primitives():
    """``cp.async`` (16 or 4 bytes, commit, wait), ``ldmatrix.x4`` (plain and ``.trans``), ``ex2.approx.ftz``,
    ``red.global.add.v2.f32`` and ``.v4.f32`` (compute capability 9.0+), as a dict."""
    if "memory" not in _cache:
        _cache["memory"] = _sim_memory_primitives() if SIMULATOR else _gpu_memory_primitives()
    return _cache["memory"]


def primitives(dtype_name):
    """``(mma, pack2, unpack2)`` for ``"float16"`` or ``"bfloat16"`` operands (GPU intrinsics, or simulator twins);
    for ``"float32"``, ``(mma, None, None)``: ``m16n8k8`` on tf32 operands (``tf32_primitives`` rounds and
    splits them)."""
    if dtype_name not in _cache:
        fmt = FORMATS[dtype_name]
        _cache[dtype_name] = _sim_primitives(fmt) if SIMULATOR else _gpu_primitives(fmt)
    return _cache[dtype_name]


_pairs = {}


def make_mma_pair(dtype_name):
    """``mma_pair(a, m, b0, b1, b2, b3, c, n)``: ``c[m, n] += A_m B(b0, b1)`` and ``c[m, n + 1] += A_m B(b2, b3)``,
    A_m the a fragment ``a[m, 0..3]``: the two n-tiles of 8 columns whose b fragments one ``ldmatrix.x4`` read,
    fed with one row block of A (``c[m, n, 0..3]``: the m16n8 accumulators)."""
    if dtype_name not in _pairs:
        mma = primitives(dtype_name)[0]

        @device_function
        def pair(a, m, b0, b1, b2, b3, c, n):
            c[m, n, 0], c[m, n, 1], c[m, n, 2], c[m, n, 3] = mma(
                a[m, 0], a[m, 1], a[m, 2], a[m, 3], b0, b1, c[m, n, 0], c[m, n, 1], c[m, n, 2], c[m, n, 3])
            c[m, n + 1, 0], c[m, n + 1, 1], c[m, n + 1, 2], c[m, n + 1, 3] = mma(
                a[m, 0], a[m, 1], a[m, 2], a[m, 3], b2, b3,
                c[m, n + 1, 0], c[m, n + 1, 1], c[m, n + 1, 2], c[m, n + 1, 3])

        _pairs[dtype_name] = pair
    return _pairs[dtype_name]



def tf32_primitives():
    """Rounding and splitting for tf32 operands, integer and float work only, as a dict of device functions:

    * ``round_bits(w)``: float32 bits ``w`` rounded to tf32 (nearest, ties away from zero: ``cvt.rna.tf32.f32``'s
      rule) by adding half of the 13 dropped bits and clearing them;
    * ``split_bits(w)``: ``(big, small)``, ``big = round_bits(w)`` and ``small`` the tf32 rounding of
      ``x - big`` (exact in float32), so that ``x = big + small`` to about 2**-22 relative: the operands of
      3xTF32 (``a b ~ a_small b_big + a_big b_small + a_big b_big``);
    * ``round_value(x)``, ``split_value(x)``: the same from a float32 value; ``as_bits(x)``: its bits,
      ``as_float(w)``: the float32 of bits ``w``.

    Magnitudes within 2**-12 of float32's largest round to infinity (attention's operands are far from it).
    """
    if "tf32" not in _cache:
        if SIMULATOR:
            @device_function
            def as_float(w):
                return np.array([w], dtype=np.uint32).view(np.float32)[0]

            @device_function
            def as_bits(x):
                return np.array([x], dtype=np.float32).view(np.uint32)[0]
        else:
            as_float, as_bits = _gpu_bitcasts()

        @device_function
        def round_bits(w):
            return np.uint32((w + np.uint32(0x1000)) & TF32_MASK)

        @device_function
        def split_bits(w):
            big = round_bits(w)
            return big, round_bits(as_bits(as_float(w) - as_float(big)))

        @device_function
        def round_value(x):
            return round_bits(as_bits(x))

        @device_function
        def split_value(x):
            return split_bits(as_bits(x))

        _cache["tf32"] = dict(round_bits=round_bits, split_bits=split_bits, round_value=round_value,
                              split_value=split_value, as_bits=as_bits, as_float=as_float)
    return _cache["tf32"]


def _gpu_bitcasts():
    """``as_float(uint32) -> float32`` and ``as_bits(float32) -> uint32``: LLVM bitcasts (no instruction)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def as_float(typingctx, w):
        def codegen(context, builder, signature, args):
            v = context.cast(builder, args[0], signature.args[0], types.uint32)
            return builder.bitcast(v, ir.FloatType())
        return types.float32(w), codegen

    @intrinsic
    def as_bits(typingctx, x):
        def codegen(context, builder, signature, args):
            v = context.cast(builder, args[0], signature.args[0], types.float32)
            return builder.bitcast(v, ir.IntType(32))
        return types.uint32(x), codegen

    return as_float, as_bits
