"""Hopper's tensor-copy engine (``cp.async.bulk.tensor``) and shared-memory barriers (``mbarrier``) for the
Hopper forward, and their simulator twins.

One thread issues a tile's copy: the engine reads a *box* of a tensor in global memory, described by a
*tensor map* (128 bytes, encoded on the host by ``cuTensorMapEncodeTiled``: the tensor's address, sizes and byte
strides, the box's sizes, the 128-byte swizzle), and writes it to shared memory in the swizzled layout of
``_wgmma`` (box rows of 128 bytes, 16-byte chunk ``j`` of row ``r`` at ``j ^ (r % 8)``); elements outside the
tensor arrive as zeros.  A copy completes on an ``mbarrier``: the issuing thread announces the bytes it expects
(``arrive_expect_tx``), the engine counts them off, and the barrier's phase completes when they have all landed.
Waiting threads spin on ``try_wait.parity`` for that phase's parity.  The same barriers, with plain ``arrive``s,
hand a stage back from the threads that read it to the thread that refills it.

The tensor maps live in global memory (``tensor_maps``: device rows per distinct set, cached, copied from pinned
host rows on the launch stream, so a new set never blocks the host), the kernel receiving a uint64 array whose
16-word rows are the maps.  (A separate copy warp, FA3's producer, was tried first: 288 threads of the
forward's ~190-236 registers pass the SM's 65536 at head dim 128 causal and 256, and ``cuLaunchKernel`` refused
them; without ``setmaxnreg`` and a register cap at entry, which Numba's kernels do not declare, the copies are
issued by one of the readers.)

The simulator has no copy engine and no asynchrony: ``tma_box`` copies the box itself (the calling thread, from
the source array, through the same swizzled offsets and zero fill), and the barrier operations do nothing; the
kernel orders its simulated copies with ``syncthreads``.  So CI checks the boxes' coordinates and layouts, and
the GPU suites and compute-sanitizer (racecheck, synccheck) the barriers' protocol.
"""
import numpy as np
from numba import cuda

from ._jit import SIMULATOR, View, _driver, device_address as _address, device_function
from ._mma import memory_primitives
from ._sync import SIM_COND, sim_block_state, sim_wait
from ._wgmma import SWIZZLE_BYTES, BLOCK_COLS, swizzled_offset

MAP_WORDS = 16                # a tensor map: 128 bytes, 64-byte aligned
BOX_COLS = BLOCK_COLS         # a box's row: 64 16-bit values (128 bytes, the swizzle's width)


# ------------------------------------------------------------------------------------------------------------
# The GPU: inline PTX
# ------------------------------------------------------------------------------------------------------------
def _gpu_primitives():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i32, i64 = ir.IntType(32), ir.IntType(64)

    def shared_addr(context, builder, aryty, aryval, off, offty):
        ary = context.make_array(aryty)(context, builder, aryval)
        base = builder.ptrtoint(builder.addrspacecast(ary.data, ir.PointerType(ary.data.type.pointee, 3)), i32)
        return builder.add(base, builder.trunc(context.cast(builder, off, offty, types.uint64), i32))

    def asm(builder, ptx, cons, vals):
        fnty = ir.FunctionType(ir.VoidType(), [v.type for v in vals])
        builder.call(ir.InlineAsm(fnty, ptx, cons + (",~{memory}" if cons else "~{memory}"), side_effect=True),
                     vals)

    def u32(context, builder, v, t):
        return builder.trunc(context.cast(builder, v, t, types.uint64), i32)

    def barrier_with_value(ptx):
        """An intrinsic ``op(smem, off, value)``: ``ptx`` on the barrier at byte ``off`` of ``smem`` ($0, its
        shared address) and a 32-bit ``value`` ($1)."""
        @intrinsic
        def op(typingctx, smem, off, value):
            def codegen(context, builder, sig, args):
                t = sig.args
                asm(builder, ptx, "r,r", [shared_addr(context, builder, t[0], args[0], args[1], t[1]),
                                          u32(context, builder, args[2], t[2])])
                return context.get_dummy_value()
            return types.void(smem, off, value), codegen
        return op

    # mbar_init(smem, off, count): expects ``count`` arrivals per phase
    mbar_init = barrier_with_value("mbarrier.init.shared::cta.b64 [$0], $1;")
    # mbar_arrive_expect_tx(smem, off, nbytes): arrive, and announce ``nbytes`` of copies completing on this phase
    mbar_arrive_expect_tx = barrier_with_value("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;")
    # mbar_wait(smem, off, parity): spin until the phase of parity ``parity`` (0 or 1) has completed
    mbar_wait = barrier_with_value("{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1; "
                                   "@!done bra WAIT; }")

    @intrinsic
    def mbar_fence_init(typingctx):
        """Make this thread's barrier initialisations visible to the copy engine (before the block's barrier)."""
        def codegen(context, builder, sig, args):
            asm(builder, "fence.mbarrier_init.release.cluster; fence.proxy.async.shared::cta;", "", [])
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def mbar_arrive(typingctx, smem, off):
        """Arrive on the barrier (a reader handing its stage back)."""
        def codegen(context, builder, sig, args):
            t = sig.args
            asm(builder, "mbarrier.arrive.shared::cta.b64 _, [$0];", "r",
                [shared_addr(context, builder, t[0], args[0], args[1], t[1])])
            return context.get_dummy_value()
        return types.void(smem, off), codegen

    @intrinsic
    def tma_load_4d(typingctx, smem, dst, maps, which, c0, c1, c2, c3, bar):
        """Copy the box at element coordinates (c0, c1, c2, c3) (innermost first) of tensor map ``which`` of
        ``maps`` to byte ``dst`` of ``smem``, completing on the barrier at byte ``bar``."""
        def codegen(context, builder, sig, args):
            t = sig.args
            ary = context.make_array(t[2])(context, builder, args[2])
            row = builder.mul(context.cast(builder, args[3], t[3], types.uint64), ir.Constant(i64, 8 * MAP_WORDS))
            tmap = builder.add(builder.ptrtoint(ary.data, i64), row)
            coords = [u32(context, builder, args[i], t[i]) for i in range(4, 8)]
            ptx = ("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                   "[$0], [$1, {$2, $3, $4, $5}], [$6];")
            asm(builder, ptx, "r,l,r,r,r,r,r",
                [shared_addr(context, builder, t[0], args[0], args[1], t[1]), tmap] + coords
                + [shared_addr(context, builder, t[0], args[0], args[8], t[8])])
            return context.get_dummy_value()
        return types.void(smem, dst, maps, which, c0, c1, c2, c3, bar), codegen

    return dict(mbar_init=mbar_init, mbar_fence_init=mbar_fence_init, mbar_arrive_expect_tx=mbar_arrive_expect_tx,
                mbar_arrive=mbar_arrive, mbar_wait=mbar_wait, tma_load_4d=tma_load_4d)


# ------------------------------------------------------------------------------------------------------------
# The simulator: barriers do nothing (the kernel synchronises its simulated copies itself)
# ------------------------------------------------------------------------------------------------------------
def _sim_primitives():
    @device_function
    def mbar_init(smem, off, count):
        pass

    @device_function
    def mbar_fence_init():
        pass

    @device_function
    def mbar_arrive_expect_tx(smem, off, nbytes):
        pass

    @device_function
    def mbar_arrive(smem, off):
        pass

    @device_function
    def mbar_wait(smem, off, parity):
        pass

    return dict(mbar_init=mbar_init, mbar_fence_init=mbar_fence_init, mbar_arrive_expect_tx=mbar_arrive_expect_tx,
                mbar_arrive=mbar_arrive, mbar_wait=mbar_wait, tma_load_4d=None)


# ------------------------------------------------------------------------------------------------------------
# The simulator, for a warp-specialised kernel: barriers that wait
# ------------------------------------------------------------------------------------------------------------
def _sim_waiting_primitives():
    """Twins of the barrier operations that keep each barrier's state (its count, arrivals and bytes pending,
    phases completed) and make ``mbar_wait`` wait for its phase, as the GPU's do; ``mbar_complete_tx`` is the copy
    engine's side (the simulated box load calls it after its copy).  A wait that cannot finish raises instead of
    hanging (``_sync``).  With them a kernel needs no ``syncthreads`` to order its simulated copies: a producer /
    consumer kernel, whose roles wait on each other and never on the whole block."""
    def barrier(off):
        bar = sim_block_state().get(("mbar", off))
        if bar is None:
            raise RuntimeError(f"mbarrier at byte {off} used before mbar_init")
        return bar

    def complete_if_done(bar):
        if bar["arrivals"] == 0 and bar["tx"] == 0:     # the phase completes; the next expects as many arrivals
            bar["phases"] += 1
            bar["arrivals"] = bar["count"]
            SIM_COND.notify_all()

    def arrive(off, nbytes):
        with SIM_COND:
            bar = barrier(off)
            if bar["arrivals"] <= 0:
                raise RuntimeError(f"mbarrier at byte {off}: more arrivals than its count {bar['count']}")
            bar["tx"] += nbytes
            bar["arrivals"] -= 1
            complete_if_done(bar)

    @device_function
    def mbar_init(smem, off, count):
        with SIM_COND:
            sim_block_state()[("mbar", off)] = dict(count=count, arrivals=count, tx=0, phases=0)

    @device_function
    def mbar_fence_init():
        pass

    @device_function
    def mbar_arrive_expect_tx(smem, off, nbytes):
        arrive(off, nbytes)

    @device_function
    def mbar_arrive(smem, off):
        arrive(off, 0)

    @device_function
    def mbar_complete_tx(smem, off, nbytes):
        with SIM_COND:
            bar = barrier(off)
            bar["tx"] -= nbytes
            complete_if_done(bar)

    @device_function
    def mbar_wait(smem, off, parity):
        # the phase of parity ``parity`` has completed once the current phase's parity differs from it
        with SIM_COND:
            bar = barrier(off)
            sim_wait(lambda: bar["phases"] % 2 != parity, f"mbarrier at byte {off}, parity {parity}")

    return dict(mbar_init=mbar_init, mbar_fence_init=mbar_fence_init, mbar_arrive_expect_tx=mbar_arrive_expect_tx,
                mbar_arrive=mbar_arrive, mbar_wait=mbar_wait, mbar_complete_tx=mbar_complete_tx, tma_load_4d=None)


_cache = {}


def tma_primitives(waiting=False):
    """The barrier operations (``mbar_init``, ``mbar_fence_init``, ``mbar_arrive_expect_tx``, ``mbar_arrive``,
    ``mbar_wait``) and, on the GPU, ``tma_load_4d``.  ``waiting``: in the simulator, barriers that wait (for a
    kernel with no ``syncthreads`` between its copies and their readers), with ``mbar_complete_tx``; the GPU's
    are the same either way."""
    key = "waiting" if waiting and SIMULATOR else "prims"
    if key not in _cache:
        _cache[key] = (_sim_waiting_primitives() if waiting else _sim_primitives()) if SIMULATOR \
            else _gpu_primitives()
    return _cache[key]


def make_tile_load(NROWS, HEAD_WORDS, NBLK, WAITING=False):
    """``load(smem, dst, maps, which, src, src_base, src_row, row0, nrows, c2, c3, bar)``: rows ``row0 ..
    row0 + NROWS - 1`` of a (batch, seq, head, word) tensor's (batch ``c3``, head ``c2``) slice, as ``NBLK``
    boxes of 64 columns, into the swizzled tile at byte ``dst`` of ``smem`` (blocks of 64 columns ``NROWS * 128``
    bytes apart), completing on the barrier at byte ``bar``.  Rows past the sequence (``nrows`` from ``row0``)
    and columns past the head dim arrive as zeros.  The GPU's copy reads tensor map ``which`` of ``maps``
    (``src``, ``src_base`` and ``src_row``, the word view's element offset of row 0 and its words per row, name
    the same data for the simulator, whose copy is made by the calling thread, at once; ``WAITING``: with
    ``tma_primitives(waiting=True)``'s barriers, the copy then completes its bytes on ``bar``)."""
    box = make_box_load(NROWS, NBLK, WAITING)

    @device_function
    def load(smem, dst, maps, which, src, src_base, src_row, row0, nrows, c2, c3, bar):
        box(smem, dst, maps, which, src, src_base, src_row, row0, nrows, 0, HEAD_WORDS, c2, c3, bar)

    return load


def make_box_load(NROWS, NBLK, WAITING=False):
    """``make_tile_load``'s ``load`` from word column ``col0`` on: ``load(smem, dst, maps, which, src, src_base,
    src_row, row0, nrows, col0, ncols, c2, c3, bar)``, columns from ``ncols`` on arriving as zeros (the
    simulator's; the GPU's past the tensor map's extent)."""
    if not SIMULATOR:
        tma_load_4d = tma_primitives()["tma_load_4d"]

        @device_function
        def load(smem, dst, maps, which, src, src_base, src_row, row0, nrows, col0, ncols, c2, c3, bar):
            for j in range(NBLK):
                tma_load_4d(smem, dst + j * NROWS * SWIZZLE_BYTES, maps, which, 2 * col0 + j * BOX_COLS, row0, c2,
                            c3, bar)

        return load

    CHUNKS = NBLK * BOX_COLS // 8          # 16-byte chunks of a padded row
    cp_async16 = memory_primitives()["cp_async16"]
    complete_tx = tma_primitives(waiting=True)["mbar_complete_tx"] if WAITING else None

    @device_function
    def load(smem, dst, maps, which, src, src_base, src_row, row0, nrows, col0, ncols, c2, c3, bar):
        for r in range(NROWS):
            for c in range(CHUNKS):
                ok = r < nrows and col0 + 4 * c < ncols
                cp_async16(smem, (dst + swizzled_offset(NROWS, r, 8 * c)) // 4, src,
                           src_base + (row0 + r) * src_row + col0 + 4 * c if ok else 0, 16 if ok else 0)
        if WAITING:
            complete_tx(smem, bar, NROWS * CHUNKS * 16)    # the box's bytes, zero fill included, as the GPU's

    return load


# ------------------------------------------------------------------------------------------------------------
# The host: tensor maps
# ------------------------------------------------------------------------------------------------------------
_maps = {}                # (specs, stream) -> the device rows of their maps
SPECS = {}                # a buffer's device address -> its specs (the dispatch cache's replay re-derives them)
_MAX_MAPS = 256           # sets of maps kept; the next new set waits for the device and starts over
_ARENA_ROWS = 4 * _MAX_MAPS
_arenas = {}              # CUDA context -> _Arena


class _Arena:
    """Rows of tensor maps in pinned host memory and their device twins, handed out in order and never rewritten
    until ``reset``.  A new set of maps is encoded into its host rows and copied to its device rows by
    ``cuMemcpyHtoDAsync`` on the launch stream: stream order puts the copy before the kernel that reads it, and the
    host runs on (a pageable copy would wait until the GPU drained everything queued before it).  Rows are reused
    only after ``reset``, which waits for the device: no copy still reads them, no kernel still reads their twins."""

    def __init__(self):
        self.host = cuda.pinned_array((_ARENA_ROWS, MAP_WORDS), np.uint64)
        self.device = cuda.device_array((_ARENA_ROWS, MAP_WORDS), np.uint64)
        self.host_ptr = self.host.__array_interface__["data"][0]
        self.device_ptr = _address(self.device)
        self.next = 0

    def take(self, n):
        """The first of ``n`` free rows, or None when too few are left (``reset`` first)."""
        if self.next + n > _ARENA_ROWS:
            return None
        first, self.next = self.next, self.next + n
        return first

    def reset(self):
        cuda.synchronize()
        self.next = 0


def _arena(make=True):
    """The current CUDA context's arena (None if it has none and not ``make``)."""
    from ._jit import current_context
    context = current_context()
    arena = _arenas.get(context)
    if arena is None and make:
        arena = _arenas[context] = _Arena()
    return arena


def clear():
    """Forget every set of maps.  The current context's rows are handed out again after its device has drained;
    another context's arena goes on from where it was (and resets itself when full, with its context current)."""
    if not SIMULATOR:
        arena = _arena(make=False)
        if arena is not None:
            arena.reset()
    _maps.clear()
    SPECS.clear()


def encode_map(ptr, shape, strides, box_rows):
    """The 16 uint64 words of a tensor map over a 16-bit (batch, seq, head, word) word view at device address
    ``ptr`` of ``shape`` (words) and byte ``strides``: 16-bit elements, dims (head dim, seq, heads, batch),
    boxes of 64 x ``box_rows`` x 1 x 1, 128-byte swizzle, zeros outside.  A dimension of size 1 takes any valid
    stride (it is never stepped): the extent of the one before."""
    from cuda.bindings import driver as drv

    if 0 in shape:               # an empty array (a packed batch of no rows): its map is never read, and the
        return [0] * MAP_WORDS   # driver encodes no zero extent
    b, s, h, words = shape
    sb, ss, sh = strides[0], strides[1], strides[2]
    dims = [2 * words, s, h, b]
    steps = []
    extent = 4 * words                  # bytes of a row
    for n, st in ((s, ss), (h, sh), (b, sb)):
        steps.append(st if n > 1 else extent)
        extent = steps[-1] * n
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    err, tmap = drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, ptr, [u64(n) for n in dims],
        [u64(n) for n in steps], [u32(n) for n in (BOX_COLS, box_rows, 1, 1)], [u32(1)] * 4,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err!r} (shape {shape}, strides {strides})")
    return [int(x) for x in tmap.opaque]


def tensor_maps(views_and_rows, packed=False, stream=0):
    """A device uint64 array of the tensor maps of ``(view, box_rows)`` pairs (word views), one row of 16 words
    each: ``maps_for`` their specs, copied on ``stream`` (a raw ``CUstream``, the kernel's).  ``packed``: the views
    of a packed batch (batch stride 0, ``flashnb.varlen``), mapped as one batch of the packed rows."""
    return maps_for(tuple((_address(v), (1,) + tuple(v.shape[1:]) if packed else tuple(v.shape), tuple(v.strides),
                           rows) for v, rows in views_and_rows), stream)


def maps_for(specs, stream=0):
    """The maps of ``specs``, each ``(device address, shape, strides, box_rows)``: device rows kept per distinct
    specs and stream (a loop over the same arrays encodes and copies nothing new; the copy is ordered before the
    kernels of its own stream only, so another stream gets its own).  ``SPECS`` names the specs of each rows'
    address.  The simulator's rows hold zeros (its copies read the arrays themselves)."""
    key = (specs, stream)
    buf = _maps.get(key)
    if buf is not None:
        return buf
    if SIMULATOR:
        if len(_maps) >= _MAX_MAPS:
            _maps.clear()
            SPECS.clear()
        buf = cuda.to_device(np.zeros((len(specs), MAP_WORDS), np.uint64))
    else:
        arena = _arena()
        first = arena.take(len(specs)) if len(_maps) < _MAX_MAPS else None
        if first is None:                 # no kernel still in flight may read a row handed out again
            clear()
            first = arena.take(len(specs))
        arena.host[first:first + len(specs)] = [encode_map(*spec) for spec in specs]
        nbytes, offset = len(specs) * MAP_WORDS * 8, first * MAP_WORDS * 8
        (err,) = _driver().cuMemcpyHtoDAsync(arena.device_ptr + offset, arena.host_ptr + offset, nbytes, stream)
        if err != 0:
            raise RuntimeError(f"cuMemcpyHtoDAsync of tensor maps failed: {err!r}")
        buf = View(arena.device_ptr + offset, (len(specs), MAP_WORDS), (MAP_WORDS * 8, 8), np.dtype(np.uint64),
                   arena)
    _maps[key] = buf
    SPECS[_address(buf)] = specs
    return buf
