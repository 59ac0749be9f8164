"""Hopper's warpgroup MMA (``wgmma.mma_async``, sm_90a) for the tensor-core forward, and its simulator twin.

A warpgroup (4 consecutive warps, 128 threads) computes ``D (64 x N, float32) += A (64 x 16 k) B (16 k x N)``
per instruction on 16-bit operands (``A (64 x 8 k) B (8 k x N)`` on tf32 ones, last paragraph); B always, and
A optionally, come from shared memory through 64-bit *matrix descriptors*
(start address, two strides, the swizzle mode).  Only what the forward needs is here:

* ``wgmma_ss``: A and B from shared memory, both "K-major" (contiguous along k): ``S = Q K_j^T`` with the
  Q tile and the K tile stored row by row; or both MN-major (``trans_a``, ``trans_b``): the backward's
  ``dQ_i = dS K_j`` with dS^T and K_j stored key by key;
* ``wgmma_rs``: A from registers (P, packed from S's accumulators: the register fragments of A are those of
  ``mma.m16n8k16``, one 16-row block per warp), B from shared memory "MN-major" (contiguous along n):
  ``acc += P V_j`` with the V tile stored row by row, as K's.

Every operand tile uses one layout, the **128-byte swizzle**: the tile is cut into blocks of 64 columns
(128 bytes of 16-bit values); block ``c // 64`` holds rows of 128 bytes, row ``r`` at byte ``128 r``, and
its 16-byte chunk ``j`` (columns ``8 j .. 8 j + 7`` of the block) stored at chunk position ``j ^ (r % 8)``.
The hardware applies that XOR to address bits 4-6 from bits 7-9, so a tile starts on a 1024-byte boundary
(``SMEM_ALIGN``).  In PTX's terms (ISA, "Shared Memory Matrix Layout", canonical layouts with
``T = 8`` 16-bit values per 16 bytes):

    K-major,  128B swizzle: ((8, m), (T, 2k)) : ((8T, SBO), (1, T))     SBO = 1024 (8 rows of 128 bytes)
    MN-major, 128B swizzle: ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO))
                            LBO = the byte stride of 64-column blocks, SBO = 1024 (8 k-rows)

so a k-step of 16 columns of a K-major tile starts 32 bytes further in its 128-byte rows (4 k-steps per
block, then the next block), and a k-step of 16 rows of an MN-major tile starts 16 rows (2048 bytes) further.
``swizzled_offset`` is the layout for the copies that fill the tiles; the k-step start offsets are
compile-time constants of each primitive, added to the descriptor inside its one ``asm`` block.

Each primitive is one inline-PTX block: ``wgmma.fence``, the k-steps' ``wgmma.mma_async``, ``commit_group``,
``wait_group 0``; it returns with its accumulators final, so the compiler never sees registers that the
tensor cores are still writing (the price: no overlap of one product with the next inside a warpgroup; the
warp scheduler still overlaps warpgroups and blocks).  Shared memory written by ordinary stores or
``cp.async`` must be made visible to the tensor cores' (async) proxy before it is read: each writer runs
``fence_proxy_async`` after its copies land and before the barrier that precedes the product.

The simulator twin reads the same shared bytes through the same address arithmetic (canonical offset, then
the XOR on absolute address bits), so CI checks the kernels' layouts and descriptors against the rule the
hardware applies; one thread's accumulators are its own rows and columns (the layout of ``mma``'s m16n8
accumulators, per warp: row ``16 w + g (+ 8)``, columns ``8 j + 2 t (+ 1)`` for ``j < N / 8``).  ``wgmma_rs``
gathers A's rows from the 4 lanes of a quad through a shared scratch, with barriers.

**tf32 operands** (``dtype_name`` ``"tf32"`` or ``"float32"``: float32 attention, issue 24):
``wgmma.mma_async.sync.aligned.m64nNk8.f32.tf32.tf32``, K = 8 a k-step, each operand a 32-bit word holding a
float32.  PTX has no transpose immediates for .tf32 ("the transpose operation is only supported for ... .f16/
.bf16"), so both operands are K-major: ``wgmma_ss`` computes ``S = Q K^T`` as for 16 bits, and ``wgmma_rs``
takes B K-major too (``trans_b=0``; for P V, the V tile stored transposed, keys contiguous).  In bytes nothing
changes: PTX's canonical layouts count ``T = 16 bytes / element size`` values (T = 4 for tf32), so a swizzled
K-major tile is the same ``((8, m), (T, 2k))`` pattern of 128-byte rows, 32 values a row; a k-step of 8 tf32
values is 32 bytes, as a 16-bit k-step of 16 values, so ``k_major_steps`` and the descriptors (SBO 1024,
128-byte swizzle) carry over unchanged, and the copies place tf32 column ``c`` at ``swizzled_offset(rows, r,
2 c)`` (16-byte chunks of 4 values).  A's register fragments (4 words a k-step) are ``mma.m16n8k8``'s tf32 a,
one 16-row block per warp: ``a0 = A[16 w + g, t]``, ``a1 = A[16 w + g + 8, t]``, ``a2 = A[16 w + g, t + 4]``,
``a3 = A[16 w + g + 8, t + 4]`` (CUTLASS's ``GMMA::ALayout_64x8`` for 32-bit types, decoded; PTX draws it only
as a figure; the GPU test checks it).  That is not the accumulators' column layout (a thread holds columns
``2 t, 2 t + 1``), so ``make_pack_a`` has no tf32 form: a P V on tf32 must move values between the lanes of a
quad, or relabel the k order of P and of V^T alike (register position ``t`` <- key ``2 t``, ``t + 4`` <- key
``2 t + 1``).  PTX: the instruction "will truncate lower 13 bits of the 32-bit input data"; the twin reads the
operands the same way (``tf32_values``, the low 13 bits cleared, as the mma.sync twin does), so values already
rounded to tf32 (``tf32_primitives``, the kernels' contract) are read exactly and others as the hardware reads
them.  Products of tf32 values (11-bit significands) are exact in float64; the twin sums a thread's dot
products in float64 and rounds once to float32, a result within the hardware's float32 accumulation error
(whose order and rounding PTX leaves unspecified).

**e4m3 operands** (``dtype_name="e4m3"``: FP8 attention's products, issue 45; not yet run on a GPU):
``wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3``, K = 32 a k-step, each operand a byte (``float8_e4m3fn``).
As for tf32, PTX has no transpose for 8-bit operands, so both are K-major and a k-step is again 32 bytes of a
swizzled row (128 values a row): ``k_major_steps`` carries over. A's register fragments (4 words a k-step, 4 bytes
a word) are ``mma.m16n8k32``'s 8-bit a: ``a0`` = row ``16 w + g``, columns ``32 ks + 4 t .. + 3``; ``a1`` row ``+ 8``;
``a2``, ``a3`` the same rows at columns ``+ 16``. The twin decodes the bytes by ``e4m3_values`` and sums in float64;
the hardware's FP8 accumulation is reported to keep fewer bits than float32's, which the kernels' tests bound.
"""
from functools import lru_cache

import numpy as np
from numba import cuda

from ._jit import SIMULATOR, device_function
from ._mma import FORMATS, halves_to_float, primitives, tf32_values
from ._sync import group_sync

SWIZZLE_BYTES = 128          # a row of a swizzled block: 64 16-bit values
BLOCK_COLS = 64
ATOM_BYTES = 1024            # 8 rows of 128 bytes: the pattern's period (the tiles' alignment)
SMEM_ALIGN = None if SIMULATOR else ATOM_BYTES
MAX_THREADS = 512
MAX_RS_KSTEPS = 16           # the simulator's wgmma_rs: k-steps of its widest A (tf32 P V at 128 keys)
WGMMA_FORMATS = {**FORMATS, "tf32": "tf32", "e4m3": "e4m3"}   # dtype_name -> PTX operand type ("float32": tf32)
EIGHT_BIT = ("e4m3",)                            # operand types of one byte: K-major only, k = 32


def k_step(fmt):
    """Values of k in one instruction: 16 for 16-bit operands, 8 for tf32, 32 for e4m3 (32 bytes of a K-major row
    each way)."""
    return 8 if fmt == "tf32" else 32 if fmt in EIGHT_BIT else 16


def chunk_offset(rows, r, c):
    """Byte offset of the 16-byte chunk holding 16-bit columns ``c .. c + 7`` (``c % 8 == 0``) of row ``r`` in a
    swizzled tile of ``rows`` rows (blocks of 64 columns, ``rows * 128`` bytes each).  ``swizzled_offset`` is
    the same as a device function."""
    return (c >> 6) * rows * SWIZZLE_BYTES + r * SWIZZLE_BYTES + ((((c & 63) >> 3) ^ (r & 7)) << 4)


swizzled_offset = device_function(chunk_offset)


def k_major_steps(rows, ksteps):
    """Start offsets (bytes) of the k-steps (16 columns each, or 8 tf32 ones: 32 bytes) of a K-major swizzled tile
    of ``rows`` rows."""
    return tuple((16 * ks // BLOCK_COLS) * rows * SWIZZLE_BYTES + 32 * (ks % (BLOCK_COLS // 16)) for ks in range(ksteps))


def mn_major_steps(ksteps):
    """Start offsets (bytes) of the k-steps (16 rows each) of an MN-major swizzled tile."""
    return tuple(16 * SWIZZLE_BYTES * ks for ks in range(ksteps))


# ------------------------------------------------------------------------------------------------------------
# The GPU: one inline-PTX block per product
# ------------------------------------------------------------------------------------------------------------
def _descriptor_bits(lbo, sbo):
    """The descriptor's fields other than the start address: LBO and SBO (16-byte units), 128-byte swizzle."""
    return ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62)


def _gpu_wgmma(kind, N, a_steps, b_steps, a_lbo, b_lbo, trans_a, trans_b, fmt):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    NACC = N // 2
    KSTEPS = len(b_steps)
    shape = f"m64n{N}k{k_step(fmt)}.f32.{fmt}.{fmt}"
    acc_list = "{" + ", ".join(f"${i}" for i in range(NACC)) + "}"
    x = 2 * NACC          # first input after the accumulators and their tied inputs (which are numbered too)
    if kind == "ss":
        ins_ptx = f"${x}", f"${x + 1}"               # A's and B's descriptors (k-step 0)
        flag = x + 2
    else:
        flag = x + 1 + 4 * KSTEPS                   # B's descriptor, then 4 A registers per k-step
    # scale-d is a predicate: p (accumulate into acc, or not) for the first k-step, q (true) for the others
    lines = ["{", ".reg .b64 da, db;", ".reg .pred p, q;", f"setp.ne.b32 p, ${flag}, 0;", "setp.eq.b32 q, 0, 0;",
             "wgmma.fence.sync.aligned;"]
    for ks in range(KSTEPS):
        scale_d = "p" if ks == 0 else "q"
        if kind == "ss":
            lines.append(f"add.s64 da, {ins_ptx[0]}, {a_steps[ks] >> 4};")
            lines.append(f"add.s64 db, {ins_ptx[1]}, {b_steps[ks] >> 4};")
            trans = "" if fmt == "tf32" or fmt in EIGHT_BIT else f", {trans_a}, {trans_b}"   # (none for those)
            lines.append(f"wgmma.mma_async.sync.aligned.{shape} {acc_list}, da, db, {scale_d}, 1, 1{trans};")
        else:
            a = x + 1 + 4 * ks
            lines.append(f"add.s64 db, ${x}, {b_steps[ks] >> 4};")
            trans = "" if fmt == "tf32" or fmt in EIGHT_BIT else f", {trans_b}"
            lines.append(f"wgmma.mma_async.sync.aligned.{shape} {acc_list}, {{${a}, ${a + 1}, ${a + 2}, ${a + 3}}}, "
                         f"db, {scale_d}, 1, 1{trans};")
    lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    ptx = " ".join(lines)
    a_bits, b_bits = _descriptor_bits(a_lbo, 1024), _descriptor_bits(b_lbo, 1024)

    def descriptor(builder, smem_base, off, bits):
        addr = builder.add(smem_base, off)
        start = builder.zext(builder.lshr(builder.and_(addr, ir.Constant(i32, 0x3FFFF)), ir.Constant(i32, 4)), i64)
        return builder.or_(start, ir.Constant(i64, bits))

    def shared_base(context, builder, aryty, aryval):
        ary = context.make_array(aryty)(context, builder, aryval)
        return builder.ptrtoint(builder.addrspacecast(ary.data, ir.PointerType(ary.data.type.pointee, 3)), i32)

    def acc_pointers(context, builder, aryty, aryval):
        ary = context.make_array(aryty)(context, builder, aryval)
        return [builder.gep(ary.data, [ir.Constant(i64, i)]) for i in range(NACC)]

    def run(context, builder, acc_ptrs, extra_types, extra_vals, accumulate):
        accs = [builder.load(p) for p in acc_ptrs]
        cons = ",".join(["=f"] * NACC + [str(i) for i in range(NACC)] + extra_types + ["r"])
        fnty = ir.FunctionType(ir.LiteralStructType([f32] * NACC), [f32] * NACC + [v.type for v in extra_vals] + [i32])
        res = builder.call(ir.InlineAsm(fnty, ptx, cons, side_effect=True), accs + extra_vals + [accumulate])
        for i, p in enumerate(acc_ptrs):
            builder.store(builder.extract_value(res, i), p)

    if kind == "ss":
        @intrinsic
        def wgmma_ss(typingctx, acc, smem, a_off, b_off, accumulate):
            """acc (N/2 float32 a thread) = A B (+ acc if ``accumulate``): A at byte ``a_off``, B at ``b_off`` of
            the shared array ``smem`` (swizzled tiles, K-major unless ``trans_a`` / ``trans_b``)."""
            sig = types.void(acc, smem, a_off, b_off, accumulate)

            def codegen(context, builder, signature, args):
                tys = signature.args
                base = shared_base(context, builder, tys[1], args[1])
                offs = [builder.trunc(context.cast(builder, v, t, types.uint64), i32) for v, t in
                        zip(args[2:4], tys[2:4])]
                da, db = descriptor(builder, base, offs[0], a_bits), descriptor(builder, base, offs[1], b_bits)
                flag = context.cast(builder, args[4], tys[4], types.int32)
                run(context, builder, acc_pointers(context, builder, tys[0], args[0]), ["l", "l"], [da, db], flag)
                return context.get_dummy_value()

            return sig, codegen

        return wgmma_ss

    @intrinsic
    def wgmma_rs(typingctx, acc, a_regs, smem, b_off, accumulate):
        """acc (N/2 float32 a thread) = A B (+ acc if ``accumulate``): A's fragments in ``a_regs`` (4 uint32 words
        per k-step, ``mma.m16n8k16``'s a fragments of this warp's 16 rows, ``m16n8k8``'s for tf32), B at byte
        ``b_off`` of ``smem``."""
        sig = types.void(acc, a_regs, smem, b_off, accumulate)

        def codegen(context, builder, signature, args):
            tys = signature.args
            base = shared_base(context, builder, tys[2], args[2])
            off = builder.trunc(context.cast(builder, args[3], tys[3], types.uint64), i32)
            db = descriptor(builder, base, off, b_bits)
            regs = context.make_array(tys[1])(context, builder, args[1])
            a_vals = [builder.load(builder.gep(regs.data, [ir.Constant(i64, i)])) for i in range(4 * KSTEPS)]
            flag = context.cast(builder, args[4], tys[4], types.int32)
            run(context, builder, acc_pointers(context, builder, tys[0], args[0]), ["l"] + ["r"] * (4 * KSTEPS),
                [db] + a_vals, flag)
            return context.get_dummy_value()

        return sig, codegen

    return wgmma_rs


def _gpu_fence_proxy_async():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def fence_proxy_async(typingctx):
        """Make this thread's writes to shared memory visible to the tensor cores' (async) proxy."""
        def codegen(context, builder, signature, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "fence.proxy.async.shared::cta;", "",
                                      side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen

    return fence_proxy_async


# ------------------------------------------------------------------------------------------------------------
# The simulator: the same addresses, read from the shared array's bytes
# ------------------------------------------------------------------------------------------------------------
def _swizzle(addr):
    """The 128-byte swizzle on absolute shared addresses: bits 4-6 ^= bits 7-9."""
    return addr ^ (((addr >> 7) & 7) << 4)


def e4m3_values(codes):
    """float64 values of ``float8_e4m3fn`` codes (bytes): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits;
    subnormals ``m 2^-9``; NaN for ``S.1111.111``."""
    c = np.asarray(codes).astype(np.int64)
    e, m = (c >> 3) & 15, c & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(c & 0x80, -mag, mag)


_BYTE_SHIFTS = np.arange(0, 32, 8)


@lru_cache(maxsize=None)
def _e4m3_table():
    """The float64 value of each of the 256 e4m3 codes."""
    return e4m3_values(np.arange(256))


@lru_cache(maxsize=None)
def _operand_addresses(start, rows, cols, major, lbo, fmt):
    """``operand_values``'s (word index, bit shift) of each value: the same for every call at the same offset, so
    the simulator's twins, which read an operand once per thread, work the swizzle out once per layout."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    if fmt == "tf32":                                       # 4 values a 16-byte chunk, K-major only
        off = (r % 8) * 128 + (r // 8) * ATOM_BYTES + (c % 4) * 4 + (c // 4) * 16
        return _swizzle(start + off) >> 2, None
    if fmt in EIGHT_BIT:                                    # 16 values a 16-byte chunk, K-major only
        addr = _swizzle(start + (r % 8) * 128 + (r // 8) * ATOM_BYTES + c)
        return addr >> 2, (8 * (addr & 3)).astype(np.uint32)
    if major == "k":
        off = (r % 8) * 128 + (r // 8) * ATOM_BYTES + (c % 8) * 2 + (c // 8) * 16
    else:
        off = (c % 8) * 2 + ((c // 8) % 8) * 16 + (c // 64) * lbo + (r % 8) * 128 + (r // 8) * ATOM_BYTES
    addr = _swizzle(start + off)
    return addr >> 2, (addr >> 1) & 1


def operand_values(words, start, rows, cols, major, lbo, fmt):
    """float64 ``rows x cols`` operand of one k-step read the hardware's way from the shared array ``words``
    (uint32) at byte ``start``: K-major (``rows`` = M or N, ``cols`` = 16 k, 8 for tf32) or MN-major (``rows`` =
    16 k, ``cols`` = N; 16-bit only).  tf32 words are read with their low 13 bits ignored, as the hardware does."""
    index, part = _operand_addresses(int(start), rows, cols, major, int(lbo), fmt)
    w = np.asarray(words)[index]
    if fmt == "tf32":
        return tf32_values(w)
    if fmt in EIGHT_BIT:
        return _e4m3_table()[(w >> part) & 0xFF]
    return halves_to_float(w, part, fmt)


def _a_fragment(word, ks, tt, reg, fmt):
    """(row, first column, values) within A's 16-row block of warp w of register ``reg`` of k-step ``ks`` held by
    lane ``4 g + tt``: row ``g`` or ``g + 8`` given as 0 or 1; 16-bit: columns ``16 ks + 2 tt (+ 8)``, a pair
    (``mma.m16n8k16``'s a); tf32: column ``8 ks + tt (+ 4)``, one value (``mma.m16n8k8``'s a)."""
    if fmt == "tf32":
        return reg % 2, 8 * ks + tt + 4 * (reg // 2), tf32_values(np.array([word]))
    if fmt in EIGHT_BIT:                    # four bytes: columns 32 ks + 4 tt (+ 16) ..
        return reg % 2, 32 * ks + 4 * tt + 16 * (reg // 2), _e4m3_table()[(int(word) >> _BYTE_SHIFTS) & 0xFF]
    return reg % 2, 16 * ks + 2 * tt + 8 * (reg // 2), halves_to_float(np.array([word, word]), np.array([0, 1]), fmt)


def _sim_wgmma(kind, N, a_steps, b_steps, a_lbo, b_lbo, trans_a, trans_b, fmt, quad_sync=False):
    NACC = N // 2
    KSTEPS = len(b_steps)
    assert KSTEPS <= MAX_RS_KSTEPS
    KS = k_step(fmt)
    j, e = np.meshgrid(np.arange(N // 8), np.arange(4), indexing="ij")
    ACC_ROW, ACC_COL = (8 * (e // 2)).reshape(-1), (8 * j + e % 2).reshape(-1)   # + (16 w + g, 2 t)

    def b_operand(smem, b_off, ks):
        if trans_b:
            return operand_values(smem, b_off + b_steps[ks], KS, N, "mn", b_lbo, fmt)
        return operand_values(smem, b_off + b_steps[ks], N, KS, "k", b_lbo, fmt).T

    def store(acc, rows_a, b, accumulate, w, g, t):
        """This thread's accumulators from A's rows ``16 w + g``, ``+ 8`` (``rows_a``: 2 x KS KSTEPS) and B."""
        d = rows_a @ b                                     # 2 x N
        flat = acc.reshape(-1) if hasattr(acc, "reshape") else acc
        for i in range(NACC):
            v = d[ACC_ROW[i] // 8, ACC_COL[i] + 2 * t]
            flat[i] = np.float32(v + (flat[i] if accumulate else 0.0))

    if kind == "ss":
        @device_function
        def wgmma_ss(acc, smem, a_off, b_off, accumulate):
            tid = cuda.threadIdx.x
            w, lane = (tid // 32) % 4, tid % 32
            g, t = lane // 4, lane % 4
            if trans_a:                                    # MN-major A: 16 k-rows of 64 m-columns a k-step
                a = np.concatenate([operand_values(smem, a_off + a_steps[ks], KS, 64, "mn", a_lbo, fmt).T
                                    for ks in range(KSTEPS)], axis=1)
            else:
                a = np.concatenate([operand_values(smem, a_off + a_steps[ks], 64, KS, "k", a_lbo, fmt)
                                    for ks in range(KSTEPS)], axis=1)
            b = np.concatenate([b_operand(smem, b_off, ks) for ks in range(KSTEPS)], axis=0)
            store(acc, a[[16 * w + g, 16 * w + g + 8]], b, accumulate, w, g, t)

        return wgmma_ss

    U32 = np.dtype(np.uint32)
    if quad_sync:
        @device_function
        def sync():
            group_sync(("quad", cuda.threadIdx.x // 4), 4)
    else:
        @device_function
        def sync():
            cuda.syncthreads()

    @device_function
    def wgmma_rs(acc, a_regs, smem, b_off, accumulate):
        # one shape for every product: the simulator hands each call of this line the array of its first call,
        # so a kernel with two wgmma_rs shapes (the tf32 dK/dV kernel tried on 2026-11-26) overran a smaller one
        frags = cuda.shared.array((MAX_THREADS, 4 * MAX_RS_KSTEPS), U32)
        tid = cuda.threadIdx.x
        w, lane = (tid // 32) % 4, tid % 32
        g, t = lane // 4, lane % 4
        for i in range(4 * KSTEPS):
            frags[tid, i] = a_regs.reshape(-1)[i] if hasattr(a_regs, "reshape") else a_regs[i]
        sync()
        quad = tid - t                                      # lane 4 g of this warp
        rows = np.zeros((2, KS * KSTEPS))
        for tt in range(4):
            for ks in range(KSTEPS):
                for reg in range(4):                       # reg: (row g | g + 8) x (first | second column group)
                    row, col, vals = _a_fragment(frags[quad + tt, 4 * ks + reg], ks, tt, reg, fmt)
                    rows[row, col:col + len(vals)] = vals
        sync()
        b = np.concatenate([b_operand(smem, b_off, ks) for ks in range(KSTEPS)], axis=0)
        store(acc, rows, b, accumulate, w, g, t)

    return wgmma_rs


@device_function
def _sim_fence_proxy_async():
    pass


_cache = {}


def make_wgmma(kind, dtype_name, N, a_steps, b_steps, a_lbo=0, b_lbo=0, trans_b=0, trans_a=0, quad_sync=False):
    """``wgmma_ss(acc, smem, a_off, b_off, accumulate)`` (``kind="ss"``) or ``wgmma_rs(acc, a_regs, smem, b_off,
    accumulate)`` (``"rs"``) for one product shape: ``m64nNk16`` on ``dtype_name`` operands (``"float16"``,
    ``"bfloat16"``; ``m64nNk8`` for ``"tf32"`` or ``"float32"``: tf32 operands, K-major only), the k-steps' start
    offsets (bytes, from the operands' ``*_off``) ``a_steps`` / ``b_steps``, the LBO of MN-major operands,
    ``trans_b`` 1 for an MN-major B, ``trans_a`` 1 for an MN-major A (``"ss"`` only: the backward's dQ = dS K_j
    with dS^T stored key by key).  ``acc``: a local float32 array of ``N / 2`` values (any shape, C order).
    ``quad_sync``: the simulator's ``wgmma_rs`` exchanges A's fragments within each quad by ``_sync.group_sync``
    instead of ``syncthreads`` (a warp-specialised kernel, whose other roles never reach its barrier); the GPU's
    product is the same."""
    if kind not in ("ss", "rs"):
        raise ValueError(f"kind must be 'ss' or 'rs', got {kind!r}")
    if dtype_name not in WGMMA_FORMATS:
        raise ValueError(f"dtype_name must be one of {sorted(WGMMA_FORMATS)}, got {dtype_name!r}")
    fmt = WGMMA_FORMATS[dtype_name]
    if (fmt == "tf32" or fmt in EIGHT_BIT) and trans_b:
        raise ValueError(f"trans_b must be 0 for {fmt} operands: PTX has no transpose for them (B K-major only)")
    if trans_a and (fmt == "tf32" or fmt in EIGHT_BIT or kind != "ss"):
        raise ValueError("trans_a needs 16-bit operands and A in shared memory (kind 'ss')")
    if SIMULATOR:
        key = (kind, fmt, N, tuple(a_steps), tuple(b_steps), a_lbo, b_lbo, trans_b, trans_a, quad_sync)
        if key not in _cache:
            _cache[key] = _sim_wgmma(kind, N, tuple(a_steps), tuple(b_steps), a_lbo, b_lbo, trans_a, trans_b, fmt,
                                     quad_sync)
    else:
        key = (kind, fmt, N, tuple(a_steps), tuple(b_steps), a_lbo, b_lbo, trans_b, trans_a)
        if key not in _cache:
            _cache[key] = _gpu_wgmma(kind, N, tuple(a_steps), tuple(b_steps), a_lbo, b_lbo, trans_a, trans_b, fmt)
    return _cache[key]


def make_pack_a(dtype_name, ksteps):
    """``pack_a(reg, a_all)``: the A fragments of ``wgmma_rs`` for ``ksteps`` k-steps of 16 from a warp's float32
    accumulators ``reg`` (shape (1, 2 ksteps, 4), ``mma``'s m16n8 layout: n-tiles 2 kk, 2 kk + 1 are k-step kk's
    columns), packed in pairs to 16-bit words (4 a k-step) in ``a_all``: P of the forward's P V, P^T and dS^T of
    the backward's dV and dK.  16-bit only: tf32's a fragments hold columns ``t, t + 4``, not ``2 t, 2 t + 1``."""
    if WGMMA_FORMATS.get(dtype_name) not in ("f16", "bf16"):
        raise ValueError(f"dtype_name must be 'float16' or 'bfloat16' (no tf32 packing), got {dtype_name!r}")
    key = ("pack_a", dtype_name, ksteps)
    if key not in _cache:
        _, pack2, _ = primitives(dtype_name)

        @device_function
        def pack_a(reg, a_all):
            for kk in range(ksteps):
                a_all[4 * kk + 0] = pack2(reg[0, 2 * kk, 0], reg[0, 2 * kk, 1])
                a_all[4 * kk + 1] = pack2(reg[0, 2 * kk, 2], reg[0, 2 * kk, 3])
                a_all[4 * kk + 2] = pack2(reg[0, 2 * kk + 1, 0], reg[0, 2 * kk + 1, 1])
                a_all[4 * kk + 3] = pack2(reg[0, 2 * kk + 1, 2], reg[0, 2 * kk + 1, 3])

        _cache[key] = pack_a
    return _cache[key]


def fence_proxy_async():
    """``fence.proxy.async.shared::cta`` (nothing to do in the simulator)."""
    if "fence" not in _cache:
        _cache["fence"] = _sim_fence_proxy_async if SIMULATOR else _gpu_fence_proxy_async()
    return _cache["fence"]


# ------------------------------------------------------------------------------------------------------------
# float32 -> e4m3: the FP8 forward's P (issue 45)
# ------------------------------------------------------------------------------------------------------------
_E4M3_POSITIVE = None


def e4m3_codes(x):
    """``float8_e4m3fn`` codes of float values ``x``, as PTX's ``cvt.rn.satfinite.e4m3x2.f32`` makes them: the
    nearest value, ties to the even code, magnitudes past 448 saturated to +-448, NaN to the NaN code 0x7F."""
    global _E4M3_POSITIVE
    if _E4M3_POSITIVE is None:
        _E4M3_POSITIVE = e4m3_values(np.arange(0x7F))              # codes 0x00 .. 0x7E, increasing
    x = np.asarray(x, np.float64)
    mag = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(_E4M3_POSITIVE, mag), 1, 0x7E)     # the first code at or above mag
    lo = hi - 1
    d_lo, d_hi = mag - _E4M3_POSITIVE[lo], _E4M3_POSITIVE[hi] - mag
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = np.where(np.signbit(x), code | 0x80, code)
    return np.where(np.isnan(x), 0x7F, code).astype(np.uint32)


def _gpu_pack_e4m3x4():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    f32, i32 = ir.FloatType(), ir.IntType(32)
    ptx = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
           "mov.b32 $0, {lo, hi}; }")

    @intrinsic
    def pack_e4m3x4(typingctx, x0, x1, x2, x3):
        """One uint32 of four e4m3 codes, ``x0`` in the lowest byte (PTX's cvt puts its first operand high)."""
        sig = types.uint32(types.float32, types.float32, types.float32, types.float32)

        def codegen(context, builder, signature, args):
            vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args)]
            fnty = ir.FunctionType(i32, [f32] * 4)
            return builder.call(ir.InlineAsm(fnty, ptx, "=r,f,f,f,f"), vals)

        return sig, codegen

    return pack_e4m3x4


@device_function
def _sim_pack_e4m3x4(x0, x1, x2, x3):
    c = e4m3_codes(np.array([x0, x1, x2, x3], np.float32))
    return np.uint32(c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24))


def pack_e4m3x4():
    """``pack_e4m3x4(x0, x1, x2, x3)``: a uint32 of the four float32 values' e4m3 codes, ``x0`` in its lowest byte
    (``cvt.rn.satfinite.e4m3x2.f32`` twice; the simulator's twin ``e4m3_codes``)."""
    if "e4m3x4" not in _cache:
        _cache["e4m3x4"] = _sim_pack_e4m3x4 if SIMULATOR else _gpu_pack_e4m3x4()
    return _cache["e4m3x4"]
