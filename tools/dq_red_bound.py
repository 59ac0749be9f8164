"""What dQ's float32 reductions cost on their own: the Hopper dK/dV kernel's ``red.global.add.v2.f32`` pattern
with a stand-in for its products, so that the L2's reduction work can be timed apart from everything else.

    python -m tools.dq_red_bound [--headdim 256] [--seqlen 4096] [--block-q 32] [--block-k 64]
                                 [--work 0,600,1200,1800] [--rounds 5]

Each block plays one key tile of one (batch, head), 256 threads, one block an SM (dynamic shared memory held, as
the kernel's 187 KB); it walks the head's ``seqlen / block_q`` query tiles, and for each runs ``work`` dependent
float32 FMAs a thread (the products' stand-in) and then adds a ``block_q x headdim`` tile into the
``(batch, seqlen, heads, headdim)`` float32 accumulator as the kernel does: a warp's instruction covers 8 query
rows x 8 dims (a lane: row ``g``, dims ``2t, 2t+1``), each warp an 8th of the tile's units.  ``--frag``: the
accumulator in the mma fragments' order instead (each 16 rows x 8 dims a block of 128 floats): ``--frag 4``,
``lane * 4 + e``, so that a warp's ``red.global.add.v4.f32`` covers 512 contiguous bytes; ``--frag 2``, two
halves of ``lane * 2 + e``, two ``v2`` of 256 contiguous bytes.  Two modes: ``none``, the FMAs only; ``burst``,
the tile's reductions after the item's FMAs (the kernel's order: ``dq_phase`` after the products).  The FMA loop
is a crude stand-in (its cycles per FMA depend on how the compiler unrolls it): the row ``work 0`` is the
measurement, the reductions' rate alone.

The shape is flash-attn's benchmark's (batch * seqlen = 16k tokens, heads * headdim = 2048), non-causal: each
accumulator element receives ``seqlen / block_k`` additions. Prints milliseconds (minimum over rounds of the
median of 5 launches) and the reductions' rate (bytes of float32 added per second).
"""
import argparse

import numpy as np


def make_kernel(D, BQ, WORK, MODE, FRAG=0):
    from numba import cuda, float32
    from flashnb.kernels._jit import kernel
    from flashnb.kernels._mma import memory_primitives
    red_add_f32x2 = memory_primitives()["red_add_f32x2"]
    red_add_f32x4 = memory_primitives()["red_add_f32x4"]
    UNITS = (BQ // 8) * (D // 8)               # 8 rows x 8 dims an instruction of a warp
    assert UNITS % 8 == 0
    UPW = UNITS // 8                           # a warp's instructions an item
    D8 = D // 8
    if FRAG:                                   # 16 rows x 8 dims a unit, one v4 a lane: (UNITS / 2) units
        UPW //= 2

    @cuda.jit(device=True, inline=True)
    def add_unit(dq, row0, lane, rows, g, t, unit, x):
        # unit: FRAG, 16 rows x 8 dims; else 8 x 8; rows: floats between query rows of the rows layout
        if FRAG == 4:                          # 16-row slabs of D dims, 128-float blocks in fragment order
            ms = unit // D8
            red_add_f32x4(dq, (row0 + 16 * ms) * D + 128 * (unit - ms * D8) + 4 * lane, x, x, x, x)
        elif FRAG == 2:                        # the same blocks as two halves of (lane, 2): two v2 a lane
            ms = unit // D8
            o = (row0 + 16 * ms) * D + 128 * (unit - ms * D8) + 2 * lane
            red_add_f32x2(dq, o, x, x)
            red_add_f32x2(dq, o + 64, x, x)
        else:                                  # rows of the (batch, seqlen, heads, headdim) accumulator
            rb = unit // D8
            o = row0 * D + (8 * rb + g) * rows + 8 * (unit - rb * D8) + 2 * t
            red_add_f32x2(dq, o, x, x)

    @kernel
    def reds(dq, nk, nq, heads):
        smem = cuda.shared.array(0, float32)   # holds the SM (one block, as the kernel's shared memory does)
        blk = cuda.blockIdx.x
        bh = blk // nk
        b = bh // heads
        h = bh - b * heads
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = tid & 3
        x = float32(tid) * float32(1e-3)
        seqlen = nq * BQ
        for i in range(nq):
            # the tile's first row: FRAG, of the (batch, head)'s slabs; else of (batch, seqlen, heads, D)
            row0 = (bh * seqlen + i * BQ) if FRAG else ((b * seqlen + i * BQ) * heads + h)
            rows = heads * D
            for w in range(WORK):
                x = x * float32(0.9999) + float32(1e-4)
            if MODE == 1:
                for u in range(UPW):
                    add_unit(dq, row0, lane, rows, g, t, warp * UPW + u, x)
        if x == float32(-1.0):                 # never: keeps the FMAs alive in mode 0
            smem[0] = x
            dq[0] = smem[0]

    return reds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--headdim", type=int, default=256)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--block-q", type=int, default=32)
    ap.add_argument("--block-k", type=int, default=64)
    ap.add_argument("--work", default="0,600,1200,1800")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shared", type=int, default=187 * 1024)
    ap.add_argument("--frag", type=int, choices=(0, 2, 4), default=0,
                    help="the accumulator in fragment order, one v4 (4) or two v2 (2) a lane")
    a = ap.parse_args()
    from numba import cuda
    from flashnb._arrays import Stream
    from flashnb.kernels._jit import launch
    D, N = a.headdim, a.seqlen
    B, H = max(16384 // N, 1), 2048 // D
    nk, nq = N // a.block_k, N // a.block_q
    dq = cuda.to_device(np.zeros((B, N, H, D), np.float32))
    stream = Stream(0)
    grid = nk * B * H
    red_bytes = 4.0 * B * N * H * D * nk
    print(f"d {D}, N {N}, batch {B}, heads {H}, {a.block_q} x {a.block_k} tiles, "
          f"{('rows, v2', '', 'fragment order, v2', '', 'fragment order, v4')[a.frag]}: {grid} blocks, "
          f"{red_bytes / 1e9:.2f} GB of float32 reductions ({nk} an element)")
    print("| work (FMAs an item) | none ms | burst ms | burst - none | burst GB/s |")
    print("|---|---|---|---|---|")
    for work in (int(w) for w in a.work.split(",")):
        kerns = [make_kernel(D, a.block_q, work, m, a.frag) for m in range(2)]
        best = [float("inf")] * 2
        for _ in range(a.rounds):
            for m, kern in enumerate(kerns):
                launch(kern, grid, 256, stream, a.shared, (dq, nk, nq, H))       # compile, warm
                cuda.synchronize()
                times = []
                for _ in range(5):
                    e0, e1 = cuda.event(), cuda.event()
                    e0.record()
                    launch(kern, grid, 256, stream, a.shared, (dq, nk, nq, H))
                    e1.record()
                    e1.synchronize()
                    times.append(cuda.event_elapsed_time(e0, e1))
                best[m] = min(best[m], float(np.median(times)))
        none, burst = best
        print(f"| {work} | {none:.3f} | {burst:.3f} | {burst - none:.3f} | {red_bytes / burst / 1e6:.0f} |")


if __name__ == "__main__":
    main()
