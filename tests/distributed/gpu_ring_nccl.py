"""test_ring_gloo's cases on GPUs over NCCL: one process per GPU (all of the host's, at least 2), each running
tests/distributed/ring_worker.py with ``RING_DEVICE=cuda``.

(Not a ``test_*`` module: pytest collects it only when named, on a machine with 2 or more GPUs:
``python -m pytest -s tests/distributed/gpu_ring_nccl.py``; the results are recorded in bench/results/.)

* the ring against the float64 oracle of the whole sequence (every layout, causal and not, GQA);
* ranks that disagree on dtype, shard length, head count or ``causal``: every rank raises ``ValueError`` naming
  it (before the agreement, NCCL hung until its watchdog or returned another rank's bytes as the wrong dtype);
* a rank that fails before the call or inside its backward: the other ranks, calling with ``timeout=5``, end
  with ring_attention's ``RuntimeError`` within the timeout and a margin, and report how long
  ``destroy_process_group`` then took.
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 or more GPUs", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_ring_gloo import _launch, _run_ring  # noqa: E402

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


@pytest.mark.parametrize("where", ["before", "backward"])
def test_a_failing_rank_ends_the_others_within_the_timeout(where):
    """With NCCL's connections made at initialisation (``NCCL_RUNTIME_CONNECT=0``, ``device_id`` given to
    ``init_process_group``): otherwise a rank's first collective blocks the host inside NCCL while it connects
    to a peer that never comes (docs/distributed.md)."""
    try:
        outputs = _run_ring(WORLD, [dict(fail=where, timeout=5)], timeout=75, NCCL_RUNTIME_CONNECT="0", **NCCL)
    except AssertionError as e:
        print(f"\n{where}: FAILED\n{str(e)[-6000:]}", flush=True)       # at once: a killed run still shows it
        raise
    _show(outputs)


def test_without_eager_connections_the_process_groups_timeout_bounds_the_wait():
    """NCCL's default (connections made at the first collective): a peer that fails before the call can leave the
    agreement's all_gather blocked in NCCL's host code, out of ``timeout``'s reach; the process group's own timeout
    (20 s here) must still end the waiting rank, by ring_attention's error or PyTorch's watchdog ending the process
    (docs/distributed.md says which)."""
    seed, codes, outputs, late = _launch(WORLD, [dict(fail="before", timeout=5, bound=40)], 60,
                                         RING_GROUP_TIMEOUT="20", **NCCL)
    print(f"\nruntime connect: exit statuses {codes}, still running at 60 s: {late}")
    for r, o in enumerate(outputs):
        print(f"--- rank {r}:\n" + "\n".join(line[:300] for line in o.splitlines()[-25:]))
    assert 0 not in late, "rank 0 outlived the process group's timeout by 40 s"
