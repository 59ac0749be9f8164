"""Split-KV decoding over a KV cache (flash-decoding; Dao, Haziza, Massa, Sizov 2023) and its cache append.

Decoding attends a few query rows (``seqlen_q`` new tokens x the ``group`` query heads that share one KV
head) to thousands of cached keys: K and V are read once and each element feeds only ``rows`` multiply-adds,
so the kernel is bound by HBM bandwidth, not arithmetic.  Three kernels:

* ``make_append``: ``k_new``, ``v_new`` ``(batch, seqlen_new, nheads_k, headdim)`` written into the cache at
  rows ``cache_seqlens[b] ..`` (dense, or through ``block_table`` when paged).  Oracle: ``reference.kvcache_append``.
* ``make_decode``: one thread block per (split, row tile, KV head, batch).  The block takes the key range
  ``[s * split_len, (s + 1) * split_len)`` of sequence ``b`` (clipped to its ``n_b = cache_seqlens[b] +
  seqlen_new`` valid rows and to the window of its rows) for the ``ROWS`` query rows ``(query i, head h)``
  of its tile -- all the query heads of the GQA group, so each K/V row is read once per group.  Oracle:
  ``reference.attention_with_kvcache``; with splits, ``(out_s, lse_s)`` per split in float32 scratch.
* ``make_combine``: ``lse = logsumexp_s lse_s``, ``out = sum_s exp(lse_s - lse) out_s`` (the split-KV merge,
  ``reference.combine_splits``); skipped when there is one split.

Metadata the host could not check (a ``cache_seqlens`` or ``block_table`` in device memory: copying it back
would cost a synchronisation per call) is checked where it is read (``make_sequence_check``): a sequence whose
``cache_seqlens[b]`` lies outside ``0 .. capacity - seqlen_new``, or whose rows ``0 .. cache_seqlens[b] +
seqlen_new - 1`` sit on a block-table entry outside ``0 .. num_pages - 1``, gets no append and NaN in every
``out``/``lse`` row (the combine keeps a split's NaN), and no cache row outside the pool is ever touched.

Work split inside a decode block (SIMT, float32 arithmetic; FA2's online softmax, Algorithm 1 lines 8-10):
``LK`` consecutive lanes share one key row, each lane owning ``CPL`` 16-byte chunks of it (chunk ``c = t + LK
i`` for lane ``t`` of the group: a warp's load instruction reads whole 64-byte runs of ``32 / LK`` rows), and
the ``G = 32 / LK`` lane groups of a warp take ``T`` consecutive keys each per step.  Per step a lane

    s = q . k_j                      its E dims (K_j loaded by the previous step, ld.global.nc.v4: 16-byte
                                     loads), then a butterfly over the LK lanes of the key; K_{j+1} loads start
    m_new = max(m_i, rowmax s)       a butterfly over the G groups: one running max per row per warp
    acc, l_i *= exp2(m_i - m_new)    only when the max grew (a warp-uniform branch; exact: otherwise the
                                     factor is 1), which after the first keys is rare
    p = exp2(s - m_new); l_i += p; acc += p v_j; V_{j+1} loads start

so ``acc`` holds, per lane, its E dims of the group's keys, all relative to the warp's ``m_i``.  At the end
the groups are summed (butterfly), the warps merged through shared memory (``m = max_w m_w``, ``l = sum_w l_w
exp2(m_w - m)``, ``acc = sum_w acc_w exp2(m_w - m)``) and ``out = acc / l``, ``lse = (m + log2 l) ln 2``
written (or the split's partial pair).  A row that sees no key gives ``out = 0``, ``lse = -inf``.

Data are read as 32-bit words: two float16/bfloat16 values (``uint32`` views of the caller's arrays,
unpacked exactly to float32) or one float32.  The simulator has no shuffles and no inline PTX: the butterflies
go through a shared-memory scratch with two barriers per step (``make_xor_reduce``) and the vector loads read
the array's memory directly (``_sim_loads``); every thread reaches every butterfly (block-uniform loops).
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda

from ._jit import SIMULATOR, device_function, kernel, kernel_factory
from ._mma import SMEM_ALIGN, memory_primitives, primitives
from ._scores import and_inside_window

LOG2E = 1.4426950408889634   # 1 / ln(2): exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453     # ln(2): log(l) = log2(l) * ln(2)
FULL_MASK = 0xFFFFFFFF       # every lane of the warp takes part in a shuffle
KEY_ALIGN = 16               # split lengths and loop starts are multiples of this; page sizes must be too
F32 = np.float32


# ------------------------------------------------------------------------------------------------ loads
def _gpu_loads():
    """``ld_v4(ary, off)`` / ``ld_v1(ary, off)``: 4 (one 16-byte vector load) or 1 32-bit element(s) of a
    uint32 or float32 array at flat element offset ``off`` from its first element, through the read-only
    (non-coherent) path: the caches are not written during the kernel."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i64 = ir.IntType(64)

    def make(n):
        regs = ", ".join(f"${k}" for k in range(n))
        ptx = ("{ .reg .u64 ga; cvta.to.global.u64 ga, $%d; ld.global.nc%s.b32 %s, [ga]; }"
               % (n, ".v4" if n == 4 else "", "{" + regs + "}" if n == 4 else "$0"))

        @intrinsic
        def ld(typingctx, ary, off):
            dt = ary.dtype
            ret = types.UniTuple(dt, n) if n > 1 else dt
            sig = ret(ary, off)

            def codegen(context, builder, signature, args):
                aryty, offty = signature.args
                arr = context.make_array(aryty)(context, builder, args[0])
                o = builder.mul(context.cast(builder, args[1], offty, types.int64), ir.Constant(i64, 4))
                addr = builder.add(builder.ptrtoint(arr.data, i64), o)
                is_int = isinstance(aryty.dtype, types.Integer)
                elt = ir.IntType(32) if is_int else ir.FloatType()
                c = "r" if is_int else "f"
                rty = ir.LiteralStructType([elt] * n) if n > 1 else elt
                asm = ir.InlineAsm(ir.FunctionType(rty, [i64]), ptx, ",".join([f"={c}"] * n + ["l"]))
                res = builder.call(asm, [addr])
                if n == 1:
                    return res
                return context.make_tuple(builder, ret, [builder.extract_value(res, k) for k in range(n)])

            return sig, codegen

        return ld

    return make(4), make(1)


def _sim_loads():
    """The simulator's loads: the same elements, read from the array's memory by flat offset."""

    def flat(ary):
        a = getattr(ary, "_ary", ary)                 # the simulator's array wraps a NumPy array
        span = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.strides)) // a.itemsize
        return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,))

    @device_function
    def ld_v4(ary, off):
        f = flat(ary)
        return f[off], f[off + 1], f[off + 2], f[off + 3]

    @device_function
    def ld_v1(ary, off):
        return flat(ary)[off]

    return ld_v4, ld_v1


_loads = []


def loads():
    if not _loads:
        _loads.extend(_sim_loads() if SIMULATOR else _gpu_loads())
    return tuple(_loads)


def _gpu_staging():
    """``ld_shared_v4(smem, i)``: words ``i .. i + 3`` of a 1-D shared array (16-byte aligned) as one
    ``ld.shared.v4``; ``wait_groups(n)``: ``cp.async.wait_group n`` for ``n`` in 0..7 (numba-cuda has neither)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i32 = ir.IntType(32)

    @intrinsic
    def ld_shared_v4(typingctx, ary, i):
        dt = ary.dtype
        ret = types.UniTuple(dt, 4)
        sig = ret(ary, i)

        def codegen(context, builder, signature, args):
            aryty, ity = signature.args
            arr = context.make_array(aryty)(context, builder, args[0])
            base = builder.ptrtoint(builder.addrspacecast(arr.data, ir.PointerType(arr.data.type.pointee, 3)), i32)
            off = builder.mul(builder.trunc(context.cast(builder, args[1], ity, types.uint64), i32), ir.Constant(i32, 4))
            is_int = isinstance(aryty.dtype, types.Integer)
            elt, c = (i32, "r") if is_int else (ir.FloatType(), "f")
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([elt] * 4), [i32]),
                               "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", f"={c},={c},={c},={c},r", side_effect=True)
            res = builder.call(asm, [builder.add(base, off)])
            return context.make_tuple(builder, ret, [builder.extract_value(res, k) for k in range(4)])

        return sig, codegen

    waits = []
    for n in range(8):
        def make(n=n):
            @intrinsic
            def wait(typingctx):
                def codegen(context, builder, signature, args):
                    builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {n};", "",
                                              side_effect=True), [])
                    return context.get_dummy_value()
                return types.void(), codegen
            return wait
        waits.append(make())
    return ld_shared_v4, waits


def _sim_staging():
    @device_function
    def ld_shared_v4(ary, i):
        return ary[i], ary[i + 1], ary[i + 2], ary[i + 3]

    @device_function
    def nothing():
        pass

    return ld_shared_v4, [nothing] * 8


_staging = []


def staging():
    if not _staging:
        _staging.extend(_sim_staging() if SIMULATOR else _gpu_staging())
    return tuple(_staging)


# ------------------------------------------------------------------------------------------------ butterflies
@lru_cache(maxsize=None)
def make_xor_reduce(N, OFF_LO, OFF_HI, IS_MAX, NTHREADS):
    """``reduce(vals, scratch)``: ``vals[n]`` (a local array of ``N``) combined (max or sum) over the lanes
    ``lane ^ o`` for ``o = OFF_LO, 2 OFF_LO, .. < OFF_HI`` (powers of two): a butterfly, every lane ends with
    the result.  GPU: ``shfl_xor``; simulator: through ``scratch`` (``NTHREADS * N`` values), two barriers a
    step, so every thread of the block must call it."""
    STEPS = []
    o = OFF_LO
    while o < OFF_HI:
        STEPS.append(o)
        o *= 2
    NSTEPS = len(STEPS)
    FIRST = OFF_LO

    if not SIMULATOR:
        @device_function
        def reduce_gpu(vals, scratch):
            off = FIRST
            for _ in range(NSTEPS):
                for n in range(N):
                    y = cuda.shfl_xor_sync(FULL_MASK, vals[n], off)
                    vals[n] = max(vals[n], y) if IS_MAX else vals[n] + y
                off *= 2

        return reduce_gpu

    @device_function
    def reduce_sim(vals, scratch):
        tid = cuda.threadIdx.x
        off = FIRST
        for _ in range(NSTEPS):
            for n in range(N):
                scratch[tid * N + n] = vals[n]
            cuda.syncthreads()
            partner = tid ^ off
            for n in range(N):
                y = scratch[partner * N + n]
                vals[n] = max(vals[n], y) if IS_MAX else vals[n] + y
            cuda.syncthreads()
            off *= 2

    return reduce_sim


# ------------------------------------------------------------------------------------------------ layout
def lane_layout(head_dim, dtype_name, rows, vec16, e_budget):
    """``(LK, CPL, CW, E)``: lanes per key row, 16-byte (or 4-byte) chunks per lane, words per chunk, float32
    values per lane per row.  ``LK`` is the smallest power of two that keeps ``rows * E`` (q and acc values a
    lane holds per row tile) within ``e_budget`` and ``E`` within half of it (one row: the K/V words of a key
    grow with E too; E = 64 spilled at head dim 128), at most 32."""
    epw = 2 if dtype_name in ("float16", "bfloat16") else 1
    hw = head_dim // epw
    cw = 4 if vec16 else 1
    nch = -(-hw // cw)
    lk = 1
    while lk < 32 and (rows * (-(-nch // lk)) * cw * epw > e_budget or (-(-nch // lk)) * cw * epw > e_budget // 2):
        lk *= 2
    cpl = -(-nch // lk)
    return lk, cpl, cw, cpl * cw * epw


def stages_that_fit(stages, dtype_name, head_dim, lk, t, nwarps, max_bytes=96 * 1024):
    """``stages``, lowered (to 2 at least) until the staged K/V tiles take at most ``max_bytes`` of shared
    memory: the blocks meant to share an SM still fit it (``kvcache`` passes its share of the SM: 96 KB for two
    blocks; one row of a 256-wide head at the default shape would ask 128 KB); 0 (the registers' pipeline)
    where not even two stages fit (float32 rows of 64 dims or more, one query row: two lanes a key, 128 KB a
    stage; a launch asking for it failed on the H200)."""
    if stages == 0:
        return 0
    stage_bytes = stage_size(dtype_name, head_dim, lk, t, nwarps)
    while stages > 2 and stages * stage_bytes > max_bytes:
        stages -= 1
    return stages if stages * stage_bytes <= max_bytes else 0


def stage_size(dtype_name, head_dim, lk, t, nwarps):
    """Bytes of one stage (a K and a V tile of one block step)."""
    words = (head_dim * (2 if dtype_name in ("float16", "bfloat16") else 4)) // 4
    return 2 * nwarps * (32 // lk) * t * words * 4


# ------------------------------------------------------------------------------------------------ metadata
@lru_cache(maxsize=None)
def make_sequence_check(PAGED, HAS_SEQLENS):
    """``rows(seqlens, base_len, seqlen_new, block_table, k_cache, b, page)``: the rows sequence ``b`` holds
    after the append (``cache_seqlens[b] + seqlen_new``, or ``base_len + seqlen_new`` without an array), or
    -1 when its metadata is out of range: ``cache_seqlens[b] < 0``, more rows than the cache's capacity
    (``page x pages per sequence`` when paged, the dense cache's rows otherwise), or a block-table entry of
    those rows (``block_table[b, :ceil(rows / page)]``) outside ``0 .. num_pages - 1``.  Paged: the block's
    threads share the entries and agree through a barrier, so every thread of the block must call it."""

    @device_function
    def rows(seqlens, base_len, seqlen_new, block_table, k_cache, b, page):
        n0 = seqlens[b] if HAS_SEQLENS else base_len
        n = n0 + seqlen_new
        capacity = page * block_table.shape[1] if PAGED else k_cache.shape[1]
        ok = (n0 >= 0 and n <= capacity) if HAS_SEQLENS else True
        if PAGED:                                    # this thread's share of the entries, then the block's verdict
            num_pages = k_cache.shape[0]
            bad = 0
            n_pages = (n + page - 1) // page if ok else 0
            for p in range(cuda.threadIdx.x, n_pages, cuda.blockDim.x):
                pg = block_table[b, p]
                if pg < 0 or pg >= num_pages:
                    bad = 1
            ok = ok and cuda.syncthreads_or(bad) == 0
        return n if ok else -1

    return rows


# ------------------------------------------------------------------------------------------------ kernels
@lru_cache(maxsize=None)
@kernel_factory
def make_decode(DTYPE_NAME, HEAD_DIM, ROWS, LK, T, NWARPS, VEC16, PAGED, HAS_SEQLENS, SPLIT,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, STAGES=0, LEAN=False, HAS_LEFTPAD=False):
    """Build the decode kernel: (kernel, threads per block, dynamic shared bytes).

    ``ROWS`` query rows per block (rows ``(i, h)`` of one KV head, i-major), ``LK`` lanes per key row, ``T``
    keys per lane group per step, ``NWARPS`` warps, ``VEC16`` the caches' rows allow 16-byte loads,
    ``PAGED`` caches addressed through a block table, ``HAS_SEQLENS`` per-sequence lengths from an array (else
    one length for all), ``SPLIT`` write the partial ``(out_s, lse_s)`` of a split instead of ``(out, lse)``.
    ``STAGES``: 0 reads K and V straight into registers (16-byte loads, the next step's in flight during
    this step's arithmetic); ``STAGES >= 2`` stages each step's K and V tiles (``KPB`` keys) through shared
    memory with ``cp.async``, ``STAGES - 1`` steps ahead: more bytes in flight per SM than registers hold.
    ``LEAN`` (a candidate, measured against the default by ``tools.tune_decode``): fewer instructions
    per step for the same arithmetic -- a stage that lies wholly before ``hi``, and paged within one page,
    takes each thread's cp.async sources from one offset per tile (paged: one block-table load) and a
    constant step per copy; only the last stage clamps, paged also a stage across pages, ``exp2`` as one
    ``ex2.approx.ftz`` (``_mma.exp2_ftz``: no denormal fix-up around it), the key-range mask only on the first
    and last steps, one warp-uniform rescale branch for all rows, and the stage ring stepped instead of taken
    modulo ``STAGES``.
    ``HAS_LEFTPAD``: sequence ``b``'s keys start at row ``leftpad[b]`` (flash-attn's ``cache_leftpad``: the rows
    before it are padding; positions stay the cache's rows), else at 0.
    """
    SIXTEEN = DTYPE_NAME in ("float16", "bfloat16")
    EPW = 2 if SIXTEEN else 1                 # values per 32-bit word
    HW = HEAD_DIM // EPW                      # words per row (16-bit: HEAD_DIM is even, the API checks)
    CW = 4 if VEC16 else 1                    # words per load
    assert HW % CW == 0 and 32 % LK == 0
    NCH = HW // CW                            # chunks per key row
    CPL = -(-NCH // LK)                       # chunks per lane
    EVEN_CH = NCH % LK == 0                   # every lane's chunks exist
    WPL = CPL * CW                            # words per lane per key row
    E = WPL * EPW                             # float32 values per lane per row
    G = 32 // LK                              # key groups per warp
    KPB = NWARPS * G * T                      # keys per block step
    NTHREADS = 32 * NWARPS
    HAS_MODS = HAS_SOFTCAP or HAS_ALIBI
    NRT = ROWS * T
    RE = ROWS * E                             # local-array sizes must be single constants
    TW = T * WPL
    SIM_SCRATCH = NTHREADS * max(ROWS * E, NRT, 2) if SIMULATOR else 1
    ACC_SMEM = NWARPS * ROWS * HEAD_DIM       # the warps' accumulators, merged at the end
    STAGED = STAGES > 0
    TILE_W = KPB * HW                         # words of one staged K (or V) tile
    STAGE_W = 2 * TILE_W                      # a stage: K tile, then V tile
    SHARED_BYTES = STAGES * STAGE_W * 4
    NCOPIES = KPB * NCH                       # cp.async copies per tile
    NPASS = -(-NCOPIES // NTHREADS)           # copies per thread per tile
    EVEN_PASS = NCOPIES % NTHREADS == 0
    ROWS_PER_PASS = NTHREADS // NCH if NTHREADS % NCH == 0 else 0   # tile rows one copy pass covers
    FAST_COPY = LEAN and STAGED and ROWS_PER_PASS > 0 and EVEN_PASS
    RING_W = STAGES * STAGE_W
    assert not STAGED or STAGES >= 2
    ZERO, ONE, NEG_INF, NAN, LOG2E_T, LN2_T = F32(0), F32(1), F32(-np.inf), F32(np.nan), F32(LOG2E), F32(LN2)
    W_DT = np.uint32 if SIXTEEN else F32    # the arrays' 32-bit element: two 16-bit values or one float32
    ZW = W_DT(0)
    W_NP = np.dtype(W_DT)

    ld_v4, ld_v1 = loads()
    mem = memory_primitives()
    cp_copy, commit = mem["cp_async16" if CW == 4 else "cp_async4"], mem["cp_async_commit"]
    ld_shared_v4, waits = staging()
    wait_stage = waits[max(STAGES - 2, 0)]   # this step's group done, the STAGES - 2 later ones may still fly
    if SIXTEEN:
        _, pack2, unpack2 = primitives(DTYPE_NAME)
    if LEAN:
        exp2 = mem["exp2_ftz"]
    else:
        @device_function
        def exp2(x):
            return math.exp2(x)
    sum_key = make_xor_reduce(NRT, 1, LK, False, NTHREADS)        # s over the LK lanes of a key row
    max_groups = make_xor_reduce(ROWS, LK, 32, True, NTHREADS)    # row max over the warp's groups
    sequence_rows = make_sequence_check(PAGED, HAS_SEQLENS)
    sum_acc = make_xor_reduce(ROWS * E, LK, 32, False, NTHREADS)  # acc over the groups, at the end
    sum_l = make_xor_reduce(ROWS, LK, 32, False, NTHREADS)

    @device_function
    def load_row(cache, base, t_l, words, o):
        """This lane's words of one cache row (word offset ``base``) into ``words[o:o + WPL]``; missing chunks 0."""
        for i in range(CPL):
            c = t_l + LK * i
            if EVEN_CH or c < NCH:
                if CW == 4:
                    words[o + i * 4], words[o + i * 4 + 1], words[o + i * 4 + 2], words[o + i * 4 + 3] = \
                        ld_v4(cache, base + c * 4)
                else:
                    words[o + i] = ld_v1(cache, base + c)
            else:
                for u in range(CW):
                    words[o + i * CW + u] = ZW

    @device_function
    def row_base(cache, block_table, b, hk, j, page):
        """Word offset of key ``j``'s row of KV head ``hk`` in sequence ``b`` (through the block table)."""
        st0 = cache.strides[0] // 4
        st1 = cache.strides[1] // 4
        st2 = cache.strides[2] // 4
        if PAGED:
            p = j // page
            return block_table[b, p] * st0 + (j - p * page) * st1 + hk * st2
        return b * st0 + j * st1 + hk * st2

    @device_function
    def load_keys(cache, block_table, b, hk, j0, hi, page, t_l, words):
        """This lane's words of the T cache rows ``j0 ..`` into ``words``; a key at or past ``hi`` reads row
        ``hi - 1`` instead (a valid row; the key is masked), so no load leaves the sequence's valid rows."""
        for t in range(T):
            jj = max(min(j0 + t, hi - 1), 0)
            load_row(cache, row_base(cache, block_table, b, hk, jj, page), t_l, words, t * WPL)

    @device_function
    def issue_stage(k_cache, v_cache, block_table, b, hk, key0, p0, r0, hi, page, stage, buf):
        """Start the cp.async copies of the K and V rows ``key0 .. key0 + KPB - 1`` into ``stage[buf:]``
        (rows past ``hi`` copy row ``hi - 1``: valid memory, masked later); the block's threads share them.
        Paged: ``key0`` is row ``r0`` of the sequence's page ``p0`` (``next_stage``).

        The sources' offsets first, then the copies: a paged cache costs a later key's page stepped to from
        ``p0`` (``page >= 16``) and one block-table load per copy pass, all
        independent, so their latencies overlap (a cp.async is an opaque asm statement: a load after one is
        not moved before it).  ``key0 < hi`` (a step that exists), so ``key0 <= jj < key0 + KPB``."""
        kst0, kst1, kst2 = k_cache.strides[0] // 4, k_cache.strides[1] // 4, k_cache.strides[2] // 4
        vst0, vst1, vst2 = v_cache.strides[0] // 4, v_cache.strides[1] // 4, v_cache.strides[2] // 4
        koff = cuda.local.array(NPASS, np.int64)
        voff = cuda.local.array(NPASS, np.int64)
        for pp in range(NPASS):
            idx = cuda.threadIdx.x + pp * NTHREADS
            kk = idx // NCH
            c = idx - kk * NCH
            jj = min(key0 + kk, hi - 1)
            if PAGED:
                pi = p0
                row = r0 + (jj - key0)
                while row >= page:
                    row -= page
                    pi += 1
                pg = block_table[b, pi]
                koff[pp] = pg * kst0 + row * kst1 + hk * kst2 + c * CW
                voff[pp] = pg * vst0 + row * vst1 + hk * vst2 + c * CW
            else:
                koff[pp] = b * kst0 + jj * kst1 + hk * kst2 + c * CW
                voff[pp] = b * vst0 + jj * vst1 + hk * vst2 + c * CW
        for pp in range(NPASS):
            idx = cuda.threadIdx.x + pp * NTHREADS
            if EVEN_PASS or idx < NCOPIES:
                kk = idx // NCH
                d = buf + kk * HW + (idx - kk * NCH) * CW
                cp_copy(stage, d, k_cache, koff[pp], 4 * CW)
                cp_copy(stage, d + TILE_W, v_cache, voff[pp], 4 * CW)

    @device_function
    def copy_sources(k_cache, v_cache, hk):
        """``FAST_COPY``: (K offset, V offset) of this thread's first copy within a stage, from the stage's first
        row of KV head 0 (row ``tid // NCH`` of the tile, chunk ``tid % NCH``), the offsets' step per copy pass
        (``ROWS_PER_PASS`` rows) and the copy's place in a staged tile (the same every stage: ptxas keeps them
        or recomputes them, as registers allow)."""
        kk = cuda.threadIdx.x // NCH
        c = cuda.threadIdx.x - kk * NCH
        kst1, vst1 = k_cache.strides[1] // 4, v_cache.strides[1] // 4
        k_src = kk * kst1 + hk * (k_cache.strides[2] // 4) + c * CW
        v_src = kk * vst1 + hk * (v_cache.strides[2] // 4) + c * CW
        return k_src, v_src, ROWS_PER_PASS * kst1, ROWS_PER_PASS * vst1, kk * HW + c * CW

    @device_function
    def whole_stage_origin(k_cache, v_cache, block_table, b, key0, p, row, hi, page):
        """``FAST_COPY``: the word offsets (K, V) of row ``key0`` of sequence ``b`` (KV head 0; paged: row ``row``
        of the sequence's page ``p``) when the stage's rows ``key0 .. key0 + KPB - 1`` all lie before ``hi``
        and, paged, in one page (then they are one run of cache rows, nothing to clamp); (-1, -1) otherwise."""
        if key0 + KPB > hi:
            return -1, -1
        if PAGED:
            if row + KPB > page:
                return -1, -1
            pg = block_table[b, p]
            return (pg * (k_cache.strides[0] // 4) + row * (k_cache.strides[1] // 4),
                    pg * (v_cache.strides[0] // 4) + row * (v_cache.strides[1] // 4))
        return (b * (k_cache.strides[0] // 4) + key0 * (k_cache.strides[1] // 4),
                b * (v_cache.strides[0] // 4) + key0 * (v_cache.strides[1] // 4))

    @device_function
    def issue_step(k_cache, v_cache, block_table, b, hk, key0, p, row, hi, page, stage, buf):
        """Start the copies of the stage of keys ``key0 ..`` (paged: from row ``row`` of page ``p``) into
        ``stage[buf:]``: ``FAST_COPY``'s constant step per pass where the stage is whole
        (``whole_stage_origin``: one multiply-add per tile, paged one block-table load), else ``issue_stage``."""
        if FAST_COPY:
            k_off, v_off = whole_stage_origin(k_cache, v_cache, block_table, b, key0, p, row, hi, page)
            if k_off >= 0:
                k_src, v_src, k_pass, v_pass, dst = copy_sources(k_cache, v_cache, hk)
                k_off += k_src
                v_off += v_src
                for pp in range(NPASS):
                    d = buf + dst + pp * ROWS_PER_PASS * HW
                    cp_copy(stage, d, k_cache, k_off + pp * k_pass, 4 * CW)
                    cp_copy(stage, d + TILE_W, v_cache, v_off + pp * v_pass, 4 * CW)
                return
        issue_stage(k_cache, v_cache, block_table, b, hk, key0, p, row, hi, page, stage, buf)

    @device_function
    def next_stage(p, row, page):
        """Paged: the page and row of the key ``KPB`` past row ``row`` of page ``p`` (a step's keys on, no
        division); dense: (0, 0)."""
        if not PAGED:
            return p, row
        row += KPB
        while row >= page:
            row -= page
            p += 1
        return p, row

    @device_function
    def read_stage(stage, buf, kk, t_l, words, o):
        """This lane's words of staged row ``kk`` (a tile at ``stage[buf:]``) into ``words[o:o + WPL]``."""
        for i in range(CPL):
            c = t_l + LK * i
            if EVEN_CH or c < NCH:
                if CW == 4:
                    words[o + i * 4], words[o + i * 4 + 1], words[o + i * 4 + 2], words[o + i * 4 + 3] = \
                        ld_shared_v4(stage, buf + kk * HW + c * 4)
                else:
                    words[o + i] = stage[buf + kk * HW + c]
            else:
                for u in range(CW):
                    words[o + i * CW + u] = ZW

    @device_function
    def to_floats(words, n, vals, o):
        """Word ``n`` of ``words`` as float32 into ``vals[o], vals[o + 1]`` (16-bit) or ``vals[o]``."""
        if SIXTEEN:
            vals[o], vals[o + 1] = unpack2(words[n])
        else:
            vals[o] = F32(words[n])

    # ---- the decode kernel's steps (FA2's Algorithm 1 per lane; the kernel body below reads as the algorithm)
    @device_function
    def block_coords(k_cache, n_splits, n_row_tiles):
        """(split ``sp``, row tile ``rt``, KV head ``hk``, batch ``b``) of this block, split fastest."""
        nheads_k = k_cache.shape[2]
        sp = cuda.blockIdx.x % n_splits
        rest = cuda.blockIdx.x // n_splits
        rt = rest % n_row_tiles
        rest = rest // n_row_tiles
        hk = rest % nheads_k
        return sp, rt, hk, rest // nheads_k

    @device_function
    def lane_coords():
        """(warp ``w``, key group ``g`` of the warp, lane ``t_l`` among the group's ``LK``) of this thread."""
        w = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x - w * 32
        g = lane // LK
        return w, g, lane - g * LK

    @device_function
    def init_row(q, alibi, b, qi, h, valid, r, t_l, fold, q_reg, acc, m_i, l_i, row_i, slope, qw, fv):
        """Row r's state (query ``qi``, head ``h``; ``valid``: not past the last row): ``m_i = -inf``, ``l_i = 0``,
        ``acc = 0``, its query index ``row_i`` (-1 past the last row) and ALiBi slope, and this lane's dims of its
        query times ``fold`` in ``q_reg``."""
        m_i[r] = NEG_INF
        l_i[r] = ZERO
        row_i[r] = qi if valid else -1
        if HAS_ALIBI:
            slope[r] = F32(alibi[min(b, alibi.shape[0] - 1), h]) if valid else ZERO
        for i in range(CPL):
            c = t_l + LK * i
            for u in range(CW):
                wd = c * CW + u
                if valid and (EVEN_CH or c < NCH):
                    qw[i * CW + u] = q[b, qi, h, wd]
                else:
                    qw[i * CW + u] = ZW
        for x in range(WPL):
            to_floats(qw, x, fv, x * EPW)
        for e in range(E):
            q_reg[r * E + e] = fv[e] * fold
            acc[r * E + e] = ZERO

    @device_function
    def fill_stage(k_cache, v_cache, block_table, b, hk, start, s, nsteps, p, row, hi, page, stage, buf):
        """The copies of step ``s``'s stage (keys ``start + s KPB ..``; paged: from row ``row`` of page ``p``) into
        ``stage[buf:]`` where the step exists; one commit group either way (the count stays exact).  Returns the
        page and row of the next stage to fill."""
        if s < nsteps:
            issue_step(k_cache, v_cache, block_table, b, hk, start + s * KPB, p, row, hi, page, stage, buf)
        commit()
        return next_stage(p, row, page)

    @device_function
    def row_floats(w, t, fv):
        """This lane's dims of key ``t``'s row (its words in ``w``) as floats in ``fv``."""
        for x in range(WPL):
            to_floats(w, t * WPL + x, fv, x * EPW)

    @device_function
    def scores(q_reg, kw, fv, s):
        """``s[r, t] = q_r . k_t`` over this lane's dims (``sum_key`` adds the LK lanes' parts)."""
        for t in range(T):
            row_floats(kw, t, fv)
            for r in range(ROWS):
                a = ZERO
                for e in range(E):
                    a += q_reg[r * E + e] * fv[e]
                s[r * T + t] = a

    @device_function
    def score_mods(x, i, j, off, slope_r, scale, softcap):
        """A raw score made log2-scaled with the score options: scale, softcap, ALiBi (``HAS_MODS``)."""
        x = x * scale
        if HAS_SOFTCAP:
            x = softcap * math.tanh(x / softcap)
        if HAS_ALIBI:
            x -= slope_r * F32(abs(i + off - j))
        return x * LOG2E_T

    @device_function
    def key_visible(i, j, off, lo, hi, left, right):
        """Whether query ``i`` sees key ``j``: inside ``[lo, hi)`` and (window) its sides."""
        ok = j >= lo and j < hi
        if HAS_WINDOW:
            ok = and_inside_window(ok, i, j, off, left, right)
        return ok

    @device_function
    def rescale_row(m_i, l_i, acc, r, alpha, m_new):
        """Row r's ``l_i`` and ``acc`` times ``alpha``, ``m_i = m_new``."""
        l_i[r] *= alpha
        for e in range(E):
            acc[r * E + e] *= alpha
        m_i[r] = m_new

    @device_function
    def online_max(m_i, l_i, acc, mx):
        """``m_new = max(m_i, mx)``; ``l_i``, ``acc`` rescaled by ``exp2(m_i - m_new)`` only where the max grew (a
        warp-uniform branch; exact: otherwise the factor is 1; exp2(-inf) = 0 for a row that saw nothing yet)."""
        if LEAN:                                   # one warp-uniform branch for the rows' rescales
            grew = False
            for r in range(ROWS):
                grew = grew or mx[r] > m_i[r]
            if grew:
                for r in range(ROWS):
                    m_new = max(m_i[r], mx[r])
                    alpha = exp2(m_i[r] - m_new) if m_new > m_i[r] else ONE   # exact 1: the max stayed
                    rescale_row(m_i, l_i, acc, r, alpha, m_new)
        else:
            for r in range(ROWS):
                m_new = max(m_i[r], mx[r])
                if m_new > m_i[r]:
                    rescale_row(m_i, l_i, acc, r, exp2(m_i[r] - m_new), m_new)

    @device_function
    def exp_scores(s, m_i, l_i):
        """``p = exp2(s - m_i)`` in place of ``s``, ``l_i += rowsum p``."""
        for r in range(ROWS):
            m_use = m_i[r] if m_i[r] != NEG_INF else ZERO
            for t in range(T):
                p = exp2(s[r * T + t] - m_use)
                s[r * T + t] = p
                l_i[r] += p

    @device_function
    def add_pv(vw, s, fv, acc):
        """``acc += p v`` over this lane's dims."""
        for t in range(T):
            row_floats(vw, t, fv)
            for r in range(ROWS):
                p = s[r * T + t]
                for e in range(E):
                    acc[r * E + e] += p * fv[e]

    @device_function
    def merge_warps(acc_smem, ml_smem, r, wd):
        """Word ``wd`` of row r's output ``(v0, v1)`` and its ``lse``: the warps' partials merged (``m = max_w
        m_w``, ``l = sum_w l_w exp2(m_w - m)``, ``acc = sum_w acc_w exp2(m_w - m)``), ``out = acc / l``, ``lse =
        (m + log2 l) ln 2``; a row that saw no key gives ``out = 0``, ``lse = -inf``."""
        m = NEG_INF
        for ww in range(NWARPS):
            m = max(m, ml_smem[0, ww, r])
        m_use = m if m != NEG_INF else ZERO
        l = ZERO
        for ww in range(NWARPS):
            l += ml_smem[1, ww, r] * math.exp2(ml_smem[0, ww, r] - m_use)
        inv_l = ZERO if l == ZERO else ONE / l
        v0 = ZERO
        v1 = ZERO
        for ww in range(NWARPS):
            f = math.exp2(ml_smem[0, ww, r] - m_use)
            v0 += acc_smem[(ww * ROWS + r) * HEAD_DIM + wd * EPW] * f
            if SIXTEEN:
                v1 += acc_smem[(ww * ROWS + r) * HEAD_DIM + wd * EPW + 1] * f
        v0 *= inv_l
        v1 *= inv_l
        return v0, v1, NEG_INF if l == ZERO else (m + math.log2(l)) * LN2_T

    @device_function
    def store_word(out, lse, out_s, lse_s, sp, b, qi, h, wd, v0, v1, row_lse):
        """Word ``wd`` of row (qi, h) and (word 0) its lse: ``(out, lse)``, or the split's ``(out_s, lse_s)``."""
        if SPLIT:
            out_s[sp, b, qi, h, wd * EPW] = v0
            if SIXTEEN:
                out_s[sp, b, qi, h, wd * EPW + 1] = v1
            if wd == 0:
                lse_s[sp, b, h, qi] = row_lse
        else:
            if SIXTEEN:
                out[b, qi, h, wd] = pack2(v0, v1)
            else:
                out[b, qi, h, wd] = v0
            if wd == 0:
                lse[b, h, qi] = row_lse

    @kernel
    def decode(q, k_cache, v_cache, out, lse, out_s, lse_s, seqlens, base_len, seqlen_new, block_table, page,
               group, n_row_tiles, n_splits, split_len, scale, softcap, left, right, alibi, leftpad):
        sp, rt, hk, b = block_coords(k_cache, n_splits, n_row_tiles)
        seqlen_q = q.shape[1]
        tid = cuda.threadIdx.x
        w, g, t_l = lane_coords()

        n = sequence_rows(seqlens, base_len, seqlen_new, block_table, k_cache, b, page)   # valid rows
        bad = n < 0                                    # metadata out of range: no key read, NaN written
        if bad:
            n = 0
        off = n - seqlen_q                                             # bottom-right alignment
        nrows = group * seqlen_q
        r0 = rt * ROWS
        qi_first = r0 // group
        qi_last = (min(r0 + ROWS, nrows) - 1) // group
        lo = sp * split_len
        hi = min(lo + split_len, n)
        if HAS_LEFTPAD:                                # the padding's rows are never loaded nor seen
            lo = max(lo, leftpad[b])
        if HAS_WINDOW:                                 # keys no row of the tile may see are never loaded
            if left >= 0:
                lo = max(lo, qi_first + off - left)
            if right >= 0:
                hi = min(hi, qi_last + off + right + 1)
        lo = max(lo, 0)
        start = lo - lo % KEY_ALIGN                    # T keys of one lane group stay in one page
        nsteps = (hi - start + KPB - 1) // KPB if hi > lo else 0

        scratch = cuda.shared.array(SIM_SCRATCH, F32)            # butterflies' scratch (simulator only)
        acc_smem = cuda.shared.array(ACC_SMEM, F32)             # (warp, row, dim)
        ml_smem = cuda.shared.array((2, NWARPS, ROWS), F32)     # m_i, l_i per (warp, row)

        q_reg = cuda.local.array(RE, F32)      # the lane's dims of each row's query (log2-scaled)
        acc = cuda.local.array(RE, F32)
        m_i = cuda.local.array(ROWS, F32)
        l_i = cuda.local.array(ROWS, F32)
        mx = cuda.local.array(ROWS, F32)
        s = cuda.local.array(NRT, F32)
        kw = cuda.local.array(TW, W_DT)
        vw = cuda.local.array(TW, W_DT)
        qw = cuda.local.array(WPL, W_DT)
        fv = cuda.local.array(E, F32)
        row_i = cuda.local.array(ROWS, np.int64)     # query index of each row (-1: past the last row)
        slope = cuda.local.array(ROWS, F32)

        fold = scale * LOG2E_T if not HAS_MODS else ONE
        for r in range(ROWS):
            rr = r0 + r
            qi = rr // group
            h = hk * group + (rr - qi * group)
            init_row(q, alibi, b, qi, h, rr < nrows, r, t_l, fold, q_reg, acc, m_i, l_i, row_i, slope, qw, fv)

        # software pipeline: K_{j+1} is loaded once S_j is computed, V_{j+1} once P_j V_j is: the loads of the
        # next step are in flight during this step's arithmetic, in the same registers
        kk0 = (w * G + g) * T                          # this lane group's first key within a step
        j_lane = start + kk0
        buf = 0                                        # LEAN: the stage read this step, the one refilled
        fill = (STAGES - 1) * STAGE_W
        p_fill = start // page if PAGED else 0         # paged: the page and row of the next stage to fill
        row_fill = start - p_fill * page if PAGED else 0
        if STAGED:
            stage = cuda.shared.array(0, W_NP, alignment=SMEM_ALIGN)   # STAGES x (K tile, V tile)
            for s0 in range(STAGES - 1):
                if s0 < nsteps:
                    issue_step(k_cache, v_cache, block_table, b, hk, start + s0 * KPB, p_fill, row_fill, hi,
                               page, stage, s0 * STAGE_W)
                commit()                               # one group per stage, empty or not: the count stays exact
                p_fill, row_fill = next_stage(p_fill, row_fill, page)
        elif nsteps > 0:
            load_keys(k_cache, block_table, b, hk, j_lane, hi, page, t_l, kw)
            load_keys(v_cache, block_table, b, hk, j_lane, hi, page, t_l, vw)
        for step in range(nsteps):
            j0 = j_lane + step * KPB
            if STAGED:
                wait_stage()
                cuda.syncthreads()                     # every thread's copies of this step landed; step - 1's
                nxt = step + STAGES - 1                # readers are done with the buffer refilled here
                if not LEAN:
                    fill = (nxt % STAGES) * STAGE_W
                    buf = (step % STAGES) * STAGE_W
                p_fill, row_fill = fill_stage(k_cache, v_cache, block_table, b, hk, start, nxt, nsteps, p_fill,
                                              row_fill, hi, page, stage, fill)
                for t in range(T):
                    read_stage(stage, buf, kk0 + t, t_l, kw, t * WPL)
            scores(q_reg, kw, fv, s)                   # s = q . k, this lane's dims
            if not STAGED and step + 1 < nsteps:
                load_keys(k_cache, block_table, b, hk, j0 + KPB, hi, page, t_l, kw)
            sum_key(s, scratch)                        # whole dot products, in every lane of the group
            step0 = start + step * KPB                 # LEAN: a step inside [lo, hi) needs no range mask
            edge = not LEAN or HAS_WINDOW or step0 < lo or step0 + KPB > hi
            for r in range(ROWS):
                i = row_i[r]
                best = NEG_INF
                for t in range(T):
                    j = j0 + t
                    x = s[r * T + t]
                    if HAS_MODS:
                        x = score_mods(x, i, j, off, slope[r], scale, softcap)
                    if edge and not key_visible(i, j, off, lo, hi, left, right):
                        x = NEG_INF
                    s[r * T + t] = x
                    best = max(best, x)
                mx[r] = best
            max_groups(mx, scratch)                    # the warp's row max over this step's keys
            online_max(m_i, l_i, acc, mx)              # m_i = max(m_i, mx), l_i and acc rescaled
            exp_scores(s, m_i, l_i)                    # p = exp2(s - m_i), l_i += rowsum p
            if STAGED:
                for t in range(T):
                    read_stage(stage, buf + TILE_W, kk0 + t, t_l, vw, t * WPL)
            add_pv(vw, s, fv, acc)                     # acc += p v
            if not STAGED and step + 1 < nsteps:
                load_keys(v_cache, block_table, b, hk, j0 + KPB, hi, page, t_l, vw)
            if LEAN:                                   # the ring steps on: this stage is refilled next
                fill = buf
                buf = buf + STAGE_W if buf + STAGE_W < RING_W else 0

        # the warp: sum the groups (same m_i); the block: merge the warps through shared memory
        sum_acc(acc, scratch)
        sum_l(l_i, scratch)
        if g == 0:
            for r in range(ROWS):
                for i in range(CPL):
                    c = t_l + LK * i
                    if EVEN_CH or c < NCH:
                        for x in range(CW * EPW):
                            acc_smem[(w * ROWS + r) * HEAD_DIM + c * CW * EPW + x] = acc[r * E + i * CW * EPW + x]
                if t_l == 0:
                    ml_smem[0, w, r] = m_i[r]
                    ml_smem[1, w, r] = l_i[r]
        cuda.syncthreads()
        for idx in range(tid, ROWS * HW, NTHREADS):
            r = idx // HW
            wd = idx - r * HW
            rr = r0 + r
            if rr < nrows:
                qi = rr // group
                h = hk * group + (rr - qi * group)
                v0, v1, row_lse = merge_warps(acc_smem, ml_smem, r, wd)
                if bad:
                    v0 = v1 = row_lse = NAN
                store_word(out, lse, out_s, lse_s, sp, b, qi, h, wd, v0, v1, row_lse)

    return decode, NTHREADS, SHARED_BYTES


@lru_cache(maxsize=None)
@kernel_factory
def make_combine(DTYPE_NAME):
    """The split-KV merge (``reference.combine_splits``): one thread per output word, grid-stride.

    ``out_s (splits, batch, seqlen_q, nheads, headdim)`` and ``lse_s (splits, batch, nheads, seqlen_q)`` in
    float32 -> ``out`` (words of the input format) and ``lse (batch, nheads, seqlen_q)``: ``lse = M + log
    sum_s exp(lse_s - M)`` with ``M = max_s lse_s``, ``out = sum_s exp(lse_s - lse) out_s``; a row that no
    split saw keeps ``out = 0``, ``lse = -inf``; a row with a NaN ``lse_s`` (a sequence whose metadata the
    decode kernel refused) gets NaN.
    """
    SIXTEEN = DTYPE_NAME in ("float16", "bfloat16")
    EPW = 2 if SIXTEEN else 1
    NEG_INF, ZERO, NAN = F32(-np.inf), F32(0), F32(np.nan)
    if SIXTEEN:
        _, pack2, _ = primitives(DTYPE_NAME)

    @kernel
    def combine(out_s, lse_s, out, lse):
        n_splits, batch, seqlen_q, nheads = out_s.shape[0], out_s.shape[1], out_s.shape[2], out_s.shape[3]
        hw = out.shape[3]
        total = batch * seqlen_q * nheads * hw
        for idx in range(cuda.grid(1), total, cuda.gridsize(1)):
            wd = idx % hw
            row = idx // hw
            h = row % nheads
            qi = (row // nheads) % seqlen_q
            b = row // (nheads * seqlen_q)
            m = NEG_INF
            refused = False
            for sp in range(n_splits):
                x = lse_s[sp, b, h, qi]
                refused = refused or math.isnan(x)
                m = max(m, x)
            v0 = ZERO
            v1 = ZERO
            row_lse = NEG_INF
            if refused:
                v0 = v1 = row_lse = NAN
            elif m != NEG_INF:
                total_w = ZERO
                for sp in range(n_splits):
                    total_w += math.exp(lse_s[sp, b, h, qi] - m)
                row_lse = m + math.log(total_w)
                for sp in range(n_splits):
                    f = math.exp(lse_s[sp, b, h, qi] - row_lse)   # exp(-inf) = 0: a split that saw no key
                    if f > ZERO:
                        v0 += f * out_s[sp, b, qi, h, wd * EPW]
                        if SIXTEEN:
                            v1 += f * out_s[sp, b, qi, h, wd * EPW + 1]
            if SIXTEEN:
                out[b, qi, h, wd] = pack2(v0, v1)
            else:
                out[b, qi, h, wd] = v0
            if wd == 0:
                lse[b, h, qi] = row_lse

    return combine


@lru_cache(maxsize=None)
@kernel_factory
def make_append(PAGED, HAS_SEQLENS):
    """The cache append (``reference.kvcache_append``): ``blocks_per_seq`` blocks per sequence, one thread per
    word of its ``k_new``/``v_new`` rows, block-stride; row ``r`` of sequence ``b`` goes to cache row
    ``cache_seqlens[b] + r`` (page ``block_table[b, row // page]``, offset ``row % page`` when paged).  A
    sequence whose metadata is out of range (``make_sequence_check``) is not written at all.  Works on any
    32-bit view (16-bit pairs or float32)."""
    sequence_rows = make_sequence_check(PAGED, HAS_SEQLENS)

    @kernel
    def append(k_new, v_new, k_cache, v_cache, seqlens, base_len, block_table, page, blocks_per_seq):
        seqlen_new, nheads_k, hw = k_new.shape[1], k_new.shape[2], k_new.shape[3]
        b = cuda.blockIdx.x // blocks_per_seq
        n = sequence_rows(seqlens, base_len, seqlen_new, block_table, k_cache, b, page)
        if n < 0:
            return
        first = n - seqlen_new                       # the sequence's first new row
        total = seqlen_new * nheads_k * hw
        stride = blocks_per_seq * cuda.blockDim.x
        for idx in range((cuda.blockIdx.x - b * blocks_per_seq) * cuda.blockDim.x + cuda.threadIdx.x, total, stride):
            wd = idx % hw
            rest = idx // hw
            hk = rest % nheads_k
            r = rest // nheads_k
            row = first + r
            if PAGED:
                p = row // page
                pg = block_table[b, p]
                k_cache[pg, row - p * page, hk, wd] = k_new[b, r, hk, wd]
                v_cache[pg, row - p * page, hk, wd] = v_new[b, r, hk, wd]
            else:
                k_cache[b, row, hk, wd] = k_new[b, r, hk, wd]
                v_cache[b, row, hk, wd] = v_new[b, r, hk, wd]

    return append
