"""The simulator's barriers for warp-specialised kernels (``kernels._sync``, ``_tma.tma_primitives(waiting=True)``):
a wait lasts until its phase completes, a protocol error raises instead of hanging, and reductions over a row's
own threads run while other roles wait on barriers.  The GPU's barriers are PTX's: its kernels' suites and
compute-sanitizer's synccheck check their protocol there."""
import numpy as np
import pytest
from numba import cuda

from flashnb.kernels import _sync
from flashnb.kernels._jit import SIMULATOR
from flashnb.kernels._tiles import make_row_allreduce
from flashnb.kernels._tma import tma_primitives

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="the simulator's twins (the GPU's are PTX)")
STAGES, ROUNDS = 2, 5
FULL, EMPTY, DONE = 0, 8 * STAGES, 16 * STAGES     # byte offsets of the barriers
DATA = (16 * STAGES + 8) // 4                       # words: the stages' data after the barriers


def _pipeline(release=True, producer_waits=True):
    """A producer (thread 0) fills two stages of 32 words ``ROUNDS`` times; a consumer warp (threads 32-63) adds
    each round's words to ``out`` and hands the stage back (lane 0, after its warp's barrier).  No
    ``syncthreads`` after the set-up.  ``producer_waits=False``: the producer never waits for a stage to come back,
    and the consumer starts only once the producer is done (barrier ``DONE``), so the run is the same every time."""
    prims = tma_primitives(waiting=True)
    init, expect, arrive, complete, wait = (prims[n] for n in ("mbar_init", "mbar_arrive_expect_tx", "mbar_arrive",
                                                                "mbar_complete_tx", "mbar_wait"))

    @cuda.jit
    def kernel(src, out):
        smem = cuda.shared.array(DATA + 32 * STAGES, np.uint32)
        tid = cuda.threadIdx.x
        if tid == 0:
            for s in range(STAGES):
                init(smem, FULL + 8 * s, 1)
                init(smem, EMPTY + 8 * s, 1)
            init(smem, DONE, 1)
        cuda.syncthreads()
        if tid < 32:
            if tid == 0:
                for r in range(ROUNDS):
                    s = r % STAGES
                    if producer_waits:
                        wait(smem, EMPTY + 8 * s, (r // STAGES + 1) % 2)
                    expect(smem, FULL + 8 * s, 128)
                    for i in range(32):
                        smem[DATA + 32 * s + i] = src[r, i]
                    complete(smem, FULL + 8 * s, 128)          # the copy engine's side: its bytes landed
                arrive(smem, DONE)
            return
        lane = tid - 32
        if not producer_waits:
            wait(smem, DONE, 0)
        for r in range(ROUNDS):
            s = r % STAGES
            wait(smem, FULL + 8 * s, (r // STAGES) % 2)
            out[lane] += smem[DATA + 32 * s + lane]
            _sync.warp_sync()
            if release and lane == 0:
                arrive(smem, EMPTY + 8 * s)

    return kernel


def test_waiting_barriers_order_a_producer_and_its_consumers(monkeypatch):
    """The consumer sees each round's data once: the producer waits for the stage to come back before it
    rewrites it.  A producer that does not wait completes a stage's phases ahead of its reader, so the reader's
    parity sees a phase it has not read (round 0 reads round 4's data) and then waits for one that has passed: on
    the GPU a hang, here an error."""
    rng = np.random.default_rng(0)
    src = rng.integers(0, 1000, (ROUNDS, 32)).astype(np.uint32)
    out = np.zeros(32, np.uint32)
    _pipeline()[1, 64](src, out)
    assert np.array_equal(out, src.sum(axis=0))
    monkeypatch.setattr(_sync, "SIM_WAIT_S", 0.5)
    with pytest.raises(RuntimeError, match="GPU would hang"):
        _pipeline(producer_waits=False)[1, 64](src, np.zeros(32, np.uint32))


def test_a_stage_never_handed_back_raises_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(_sync, "SIM_WAIT_S", 0.5)
    src = np.ones((ROUNDS, 32), np.uint32)
    with pytest.raises(RuntimeError, match="GPU would hang"):
        _pipeline(release=False)[1, 64](src, np.zeros(32, np.uint32))


def test_arrivals_complete_phases_and_a_wait_sees_the_last_one(monkeypatch):
    """Each ``count`` arrivals complete a phase; a wait on the parity of the last completed phase returns (a fresh
    barrier's "previous" phase counts as completed: parity 1), a wait on the current phase's parity does not (the
    simulator raises after its limit)."""
    arrive, init, wait = (tma_primitives(waiting=True)[n] for n in ("mbar_arrive", "mbar_init", "mbar_wait"))
    monkeypatch.setattr(_sync, "SIM_WAIT_S", 0.2)

    @cuda.jit
    def kernel(out, arrivals, parity):
        smem = cuda.shared.array(2, np.uint32)
        init(smem, 0, 2)
        for _ in range(arrivals):
            arrive(smem, 0)
        wait(smem, 0, parity)
        out[0] = 1

    for arrivals, parity in ((0, 1), (0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (4, 1), (5, 1), (5, 0)):
        completed = arrivals // 2                      # phases completed; the current one has parity completed % 2
        out = np.zeros(1, np.int32)
        if parity != completed % 2:
            kernel[1, 1](out, arrivals, parity)
            assert out[0] == 1
        else:
            with pytest.raises(RuntimeError, match="GPU would hang"):
                kernel[1, 1](out, arrivals, parity)


def test_a_barrier_used_before_its_init_raises():
    wait = tma_primitives(waiting=True)["mbar_wait"]

    @cuda.jit
    def kernel():
        smem = cuda.shared.array(2, np.uint32)
        wait(smem, 0, 0)

    with pytest.raises(RuntimeError, match="before mbar_init"):
        kernel[1, 1]()


def test_row_reductions_over_their_own_threads_run_while_a_producer_waits():
    """Warp 1 takes row maxima of 4-thread rows (``ROW_SYNC``: barriers over each row's threads), then hands a
    barrier to thread 0, which waits for it.  With the block's ``syncthreads`` in the reduction the consumer would
    wait for thread 0, itself waiting on the barrier: a deadlock."""
    reduce = make_row_allreduce(1, 4, 64, np.float32, is_max=True, ROW_SYNC=True)
    prims = tma_primitives(waiting=True)
    init, arrive, wait = prims["mbar_init"], prims["mbar_arrive"], prims["mbar_wait"]

    @cuda.jit
    def kernel(x, out, flag):
        smem = cuda.shared.array(2, np.uint32)
        scratch = cuda.shared.array(64, np.float32)
        vals = cuda.local.array(1, np.float32)
        tid = cuda.threadIdx.x
        if tid == 0:
            init(smem, 0, 32)
        cuda.syncthreads()
        if tid < 32:
            if tid == 0:
                wait(smem, 0, 0)
                flag[0] = out[32:].max()        # every row's maximum is written by now
            return
        vals[0] = x[tid - 32]
        reduce(vals, scratch, tid // 4, tid % 4)
        out[tid] = vals[0]
        arrive(smem, 0)

    x = np.random.default_rng(1).standard_normal(32).astype(np.float32)
    out, flag = np.full(64, -np.inf, np.float32), np.zeros(1, np.float32)
    kernel[1, 64](x, out, flag)
    assert np.array_equal(out[32:], np.repeat(x.reshape(8, 4).max(axis=1), 4))
    assert flag[0] == x.max()


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_the_ring_parities_wait_for_exactly_the_phase_each_item_needs(stages):
    """``_sync.full_parity`` / ``empty_parity`` against a model of the ring.  A wait on parity ``p`` returns once
    ``phases % 2 != p``.  Before filling item ``j``, the producer has seen the stage's ``j // stages - 1`` uses
    handed back (it filled item ``j - stages``) and at most ``j // stages``: its wait must return exactly when the
    use before ``j`` (number ``j // stages - 1``) is back.  A consumer of item ``j`` sees the stage filled
    ``j // stages`` or ``j // stages + 1`` times: its wait must return exactly when fill ``j // stages`` (item
    ``j``'s own) has landed.  An off-by-one-phase parity, which the simulated kernel can miss when its threads
    happen to finish a stage before the producer refills it, fails here."""
    for j in range(4 * stages + 3):
        use = j // stages                                   # item j is its stage's use number `use`
        for handed_back in {max(use - 1, 0), use}:
            returns = handed_back % 2 != _sync.empty_parity(j, stages)
            assert returns == (handed_back >= use), (j, handed_back)
        for fills in (use, use + 1):
            returns = fills % 2 != _sync.full_parity(j, stages)
            assert returns == (fills >= use + 1), (j, fills)
