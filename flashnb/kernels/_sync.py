"""Barriers over part of a block, for warp-specialised kernels, and their simulator twins.

A producer / consumer kernel (FlashAttention-3's shape: one warpgroup issues the copy engine's loads, the others
compute) has no block barrier in its loop: its roles wait on ``mbarrier`` phases (``_tma``), a warp on its own
lanes, a row of a fragment on its quad.  Numba's simulator runs each thread of a block as a Python thread and
knows only ``syncthreads``, which waits for every live thread, so a consumer waiting there would wait on a
producer that is itself waiting for the consumers to free a stage.  The twins here keep their state per simulated
block (on the simulator's block manager, which runs one block) under one condition variable, and a wait that cannot
finish raises after ``SIM_WAIT_S`` (or when the simulator aborts the block) instead of hanging: a protocol error
is a failing test.

* ``group_sync(group, nthreads)``: the simulator's barrier over the ``nthreads`` threads that call it with the
  same key ``group`` (a warp's lanes, a quad); None on the GPU, where the kernels use ``warp_sync`` and warp
  shuffles (so a GPU kernel that calls it fails to compile instead of running without a barrier).
* ``warp_sync()``: ``bar.warp.sync`` on the GPU; a barrier over the warp's 32 lanes in the simulator.
* ``full_parity(j, STAGES)``, ``empty_parity(j, STAGES)``: the parities a ring of ``STAGES`` stages waits on
  for its ``j``-th item (``*_d``: the device functions).
* ``register_handover(DEC, INC)``: ``setmaxnreg.dec`` / ``.inc`` (Hopper; the kernel needs launch bounds for the
  register cap at entry, docs/notes/hopper.md step 21); nothing in the simulator.
"""
import threading
import time

from numba import cuda

from ._jit import SIMULATOR, device_function

SIM_WAIT_S = 120.0        # a simulated wait longer than this is a protocol error (a hang on the GPU): it raises
SIM_COND = threading.Condition()


def sim_block_state():
    """This simulated block's barrier state: a dict kept on the simulator's block manager (one per block, made
    afresh for each; keyed by the block's index besides), so a block's barriers never meet another's.  Call with
    ``SIM_COND`` held."""
    thread = threading.current_thread()
    blocks = thread._manager.__dict__.setdefault("_flashnb_barriers", {})
    return blocks.setdefault(tuple(thread.blockIdx), {})


def sim_wait(done, what):
    """Wait (``SIM_COND`` held) until ``done()``; raises if the simulator aborts the block (another of its threads
    raised) or after ``SIM_WAIT_S``."""
    thread, deadline = threading.current_thread(), time.monotonic() + SIM_WAIT_S
    while not done():
        if getattr(thread, "abort", False):
            raise RuntimeError(f"{what}: the block was aborted")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: no progress in {SIM_WAIT_S:g} s (the GPU would hang here)")
        SIM_COND.wait(0.01)


def _sim_group_sync(group, nthreads):
    with SIM_COND:
        g = sim_block_state().setdefault(("group", group), dict(waiting=0, generation=0))
        generation = g["generation"]
        g["waiting"] += 1
        if g["waiting"] == nthreads:
            g["waiting"] = 0
            g["generation"] += 1
            SIM_COND.notify_all()
        else:
            sim_wait(lambda: g["generation"] != generation, f"barrier of group {group}")


if SIMULATOR:
    group_sync = device_function(_sim_group_sync)

    @device_function
    def warp_sync():
        group_sync(("warp", cuda.threadIdx.x // 32), 32)
else:
    group_sync = None          # the simulator's only: a GPU kernel that called it would compile no barrier

    @device_function
    def warp_sync():
        cuda.syncwarp()


def full_parity(j, STAGES):
    """The parity a consumer waits on for item ``j`` of a ring of ``STAGES`` stages: the stage's ``full`` barrier
    completes one phase per fill, and item ``j`` is its fill number ``j // STAGES`` (from 0)."""
    return (j // STAGES) % 2


def empty_parity(j, STAGES):
    """The parity the producer waits on before it fills item ``j``'s stage: the stage's ``empty`` barrier completes
    one phase per use handed back, and the use before item ``j`` is number ``j // STAGES - 1``; for the first
    ``STAGES`` items, parity 1 of a fresh barrier, which counts as complete."""
    return (j // STAGES + 1) % 2


full_parity_d, empty_parity_d = device_function(full_parity), device_function(empty_parity)


def register_handover(DEC, INC):
    """``(release, take)``: device functions running ``setmaxnreg.dec.sync.aligned.u32 DEC`` and ``setmaxnreg.inc
    ... INC``, every thread of a warpgroup together (the simulator's do nothing)."""
    if SIMULATOR:
        @device_function
        def nothing():
            pass
        return nothing, nothing

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def asm(text):
        @intrinsic
        def op(typingctx):
            def codegen(context, builder, sig, args):
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True),
                             [])
                return context.get_dummy_value()
            return types.void(), codegen
        return op

    return (asm(f"setmaxnreg.dec.sync.aligned.u32 {DEC};"), asm(f"setmaxnreg.inc.sync.aligned.u32 {INC};"))
