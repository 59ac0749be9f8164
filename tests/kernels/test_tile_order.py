"""The order in which the tensor-core kernels deal their blocks (``_tiles.make_tile_order``), in the simulator or on
the GPU: each block of a ``n_tiles * nheads * batch`` grid writes the (tile, head, batch) it takes.  Every triple
must be taken exactly once (else a tile is computed twice and another never), each section must hold its own
(head, batch) pairs only, and within a section the tiles must come longest first, each across all the section's
pairs.  The kernels' results do not depend on the order, so the suites of the kernels cannot see a wrong one
unless it drops or repeats a tile; this test sees the order itself."""
import numpy as np
from hypothesis import given, settings, strategies as st
from numba import cuda

from flashnb.kernels._jit import kernel
from flashnb.kernels._tiles import make_tile_order, tile_head_batch

_KERNELS = {}


def _order_kernel(section, last_first):
    key = (section, last_first)
    if key not in _KERNELS:
        order = make_tile_order(section, last_first)

        @kernel
        def record(n_tiles, nheads, out):
            if cuda.threadIdx.x == 0:
                tile, h, b = order(n_tiles, nheads)
                out[cuda.blockIdx.x, 0] = tile
                out[cuda.blockIdx.x, 1] = h
                out[cuda.blockIdx.x, 2] = b

        _KERNELS[key] = record
    return _KERNELS[key]


def _taken(section, last_first, n_tiles, nheads, batch):
    blocks = n_tiles * nheads * batch
    out = cuda.to_device(np.full((blocks, 3), -1, np.int64))       # poisoned: a block that writes nothing shows
    _order_kernel(section, last_first)[blocks, 32](n_tiles, nheads, out)
    return out.copy_to_host()


@settings(max_examples=12, deadline=None)
@given(section=st.integers(1, 5), last_first=st.booleans(), n_tiles=st.integers(1, 5), nheads=st.integers(1, 4),
       batch=st.integers(1, 3))
def test_sections_deal_every_tile_once_longest_first(section, last_first, n_tiles, nheads, batch):
    taken = _taken(section, last_first, n_tiles, nheads, batch)
    triples = {tuple(int(x) for x in row) for row in taken}
    assert triples == {(t, h, b) for t in range(n_tiles) for h in range(nheads) for b in range(batch)}
    assert len(triples) == len(taken)
    pairs = nheads * batch
    i = 0
    for s in range(-(-pairs // section)):
        width = min(section, pairs - s * section)
        own = list(range(s * section, s * section + width))
        for step in range(n_tiles):
            tile = n_tiles - 1 - step if last_first else step
            rows = taken[i:i + width]
            assert (rows[:, 0] == tile).all(), (s, step, rows)
            assert sorted(rows[:, 2] * nheads + rows[:, 1]) == own, (s, step, rows)
            i += width
    assert i == len(taken)


def test_no_section_is_tile_fastest():
    assert make_tile_order(0) is tile_head_batch
    taken = _taken(0, False, 3, 2, 2)
    expect = [(t, h, b) for b in range(2) for h in range(2) for t in range(3)]
    assert [tuple(int(x) for x in row) for row in taken] == expect
