"""The ring's schedule (flashnb/distributed/_schedule.py, no torch) against the oracle's layouts: for every
rank and every shard in hand, the rows and mask handed to the kernel are exactly the pairs of global positions
the causal mask allows, and the layouts are reference.ring's. Runs in CI, where torch is not installed."""
import numpy as np
import pytest

from flashnb.distributed import _schedule
from reference import ring

LAYOUTS = {"zigzag": ring.zigzag_positions, "contiguous": ring.contiguous_positions}


@pytest.mark.parametrize("layout", _schedule.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_block_covers_exactly_the_allowed_pairs(layout, world, causal):
    seqlen = 2 * world * 3
    pos = LAYOUTS[layout](seqlen, world)
    shard = seqlen // world
    for rank in range(world):
        assert _schedule.positions(layout, rank, world, shard) == pos[rank].tolist()
        for source in range(world):
            want = (pos[source][None, :] <= pos[rank][:, None]) if causal else np.ones((shard, shard), bool)
            got = np.zeros((shard, shard), bool)
            rows = _schedule.block(layout, causal, rank, source, shard)
            if rows is not None:
                qs, ks, block_causal = rows
                sub = got[qs, ks]
                assert sub.shape[0] == sub.shape[1] or not block_causal   # the kernel's causal needs a square
                got[qs, ks] = np.tril(np.ones(sub.shape, bool)) if block_causal else True
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} source {source}")


def test_zigzag_gives_every_rank_the_same_causal_work_at_every_step():
    world, shard = 4, 8
    for step in range(world):
        work = set()
        for rank in range(world):
            rows = _schedule.block("zigzag", True, rank, (rank - step) % world, shard)
            qs, ks, c = rows
            n = len(range(shard)[qs]) * len(range(shard)[ks])
            work.add(n / 2 if c else n)
        assert work == {shard * shard / 2}
