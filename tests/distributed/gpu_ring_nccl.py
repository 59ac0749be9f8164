"""test_ring_gloo's cases on GPUs over NCCL: one process per GPU (all of the host's, at least 2), each running
tests/distributed/ring_worker.py with ``RING_DEVICE=cuda``.

(Not a ``test_*`` module: pytest collects it only when named, on a machine with 2 or more GPUs:
``python -m pytest -s tests/distributed/gpu_ring_nccl.py``; the results are recorded in bench/results/.)

* the ring against the float64 oracle of the whole sequence (every layout, causal and not, GQA);
* ranks that disagree on dtype, shard length, head count or ``causal``: every rank raises ``ValueError`` naming
  it (before the agreement, NCCL hung until its watchdog or returned another rank's bytes as the wrong dtype);
* a rank that fails before the call, in its first forward or backward block, or in a later call's backward: the other
  ranks, calling with ``timeout=5``, end with ring_attention's ``RuntimeError`` within the timeout and a margin,
  and report how long ``destroy_process_group`` then took.
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 or more GPUs", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_ring_gloo import _run_ring  # noqa: E402

WORLD = torch.cuda.device_count()
NCCL = dict(RING_DEVICE="cuda", NCCL_NVLS_ENABLE="0")


def _show(outputs):
    for r, o in enumerate(outputs):
        for line in o.splitlines():
            if line.startswith("rank "):
                print(f"[rank {r}] {line}")


def test_ring_matches_the_oracle_on_every_gpu():
    n = 8 * WORLD
    _show(_run_ring(WORLD, [dict(seqlen=2 * n, nheads=2, nheads_k=2, headdim=8, causal=True, layout="zigzag"),
                            dict(seqlen=2 * n, nheads=2, nheads_k=1, headdim=8, causal=True, layout="contiguous"),
                            dict(seqlen=n, nheads=2, nheads_k=1, headdim=8, causal=False, layout="zigzag")],
                    timeout=300, **NCCL))


def test_ranks_that_disagree_all_raise_naming_it():
    _show(_run_ring(WORLD, [
        dict(rank1=dict(dtype="float64"), expect="rank 1: float64", agree_length=10),
        dict(rank1=dict(length=6), expect="shard length (rank 0: 8, rank 1: 6", agree_length=12),
        dict(rank1=dict(heads=4), expect="query heads (rank 0: 2, rank 1: 4", agree_length=14),
        dict(rank1=dict(causal=False), expect="causal (rank 0: True, rank 1: False", agree_length=16)],
        timeout=240, **NCCL))


@pytest.mark.parametrize("where", ["before", "forward", "backward", "later"])
def test_a_failing_rank_ends_the_others_within_the_timeout(where):
    """NCCL as it comes (connections made at a pair's first exchange): rank 1 fails before the call, in its
    first forward block (where the rehearsal runs it, before the agreement), in its first backward block (the
    backward's rehearsal), or in the backward of a second call, the first having run whole (mid-ring: nothing
    left to compile, rehearse or connect)."""
    try:
        outputs = _run_ring(WORLD, [dict(fail=where, timeout=5)], timeout=75, **NCCL)
    except AssertionError as e:
        print(f"\n{where}: FAILED\n{str(e)[-6000:]}", flush=True)       # at once: a killed run still shows it
        raise
    _show(outputs)
