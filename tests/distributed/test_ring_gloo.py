"""flashnb.distributed.ring_attention end to end on CPU ranks: P processes joined by torch.distributed's gloo
backend, each running flashnb's kernels (in the simulator where there is no GPU) on its shard, forward and
backward, checked against the float64 oracle of the whole sequence (tests/distributed/ring_worker.py).
The NCCL runs on GPUs are recorded in bench/results/ (python -m flashnb.distributed.bench)."""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("torch", reason="flashnb.distributed is built on torch.distributed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "distributed", "ring_worker.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ring(world, cases, timeout=240, **env_extra):
    """Run ``cases`` on ``world`` ranks; every rank must end within ``timeout`` seconds with status 0."""
    seed, codes, outputs, late = _launch(world, cases, timeout, **env_extra)
    failed = [(r, o) for r, (c, o) in enumerate(zip(codes, outputs)) if c != 0 or r in late]
    assert not failed, (f"seed {seed}; ranks still running after {timeout} s: {late}\n"
                        + "\n".join(f"rank {r}:\n{o[-3000:]}" for r, o in failed))
    return outputs


def _launch(world, cases, timeout, **env_extra):
    """``(seed, exit statuses, outputs, ranks killed at the timeout)`` of the ranks running ``cases``."""
    seed = int(np.random.default_rng().integers(0, 2**31))       # fresh data every run; the seed is reported
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1", **env_extra)
    procs = [subprocess.Popen([sys.executable, WORKER, str(seed), json.dumps(cases)], cwd=ROOT,
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    deadline, outputs, late = time.monotonic() + timeout, [], []
    try:
        for r, p in enumerate(procs):
            try:
                outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                late.append(r)
                p.kill()
                outputs.append(p.communicate()[0])
    finally:
        for p in procs:
            p.kill()
    return seed, [p.returncode for p in procs], outputs, late


def test_two_ranks_every_layout_causal_and_gqa():
    _run_ring(2, [dict(seqlen=16, nheads=2, nheads_k=2, headdim=8, causal=True, layout="zigzag"),
                  dict(seqlen=16, nheads=2, nheads_k=1, headdim=8, causal=True, layout="contiguous"),
                  dict(seqlen=12, nheads=2, nheads_k=1, headdim=8, causal=False, layout="zigzag")])


def test_three_ranks_zigzag_causal():
    _run_ring(3, [dict(seqlen=24, nheads=2, nheads_k=1, headdim=8, causal=True, layout="zigzag")])


def test_ranks_that_disagree_all_raise_naming_it():
    """Rank 1 of 2 passes another dtype, shard length, head count or causal flag: every rank raises ValueError
    naming the field and each rank's value, with no hang (before: NCCL blocked until its watchdog, or returned
    another rank's bytes read as the wrong dtype); the group then runs an agreeing call, whose repeat gathers
    nothing.  tests/distributed/test_ring_agree.py checks the messages of every field without torch."""
    _run_ring(2, [dict(rank1=dict(dtype="float64"), expect="dtype (rank 0: float32, rank 1: float64)", agree_length=10),
                  dict(rank1=dict(length=6), expect="shard length (rank 0: 8, rank 1: 6)", agree_length=12),
                  dict(rank1=dict(heads=4), expect="query heads (rank 0: 2, rank 1: 4)", agree_length=14),
                  dict(rank1=dict(causal=False), expect="causal (rank 0: True, rank 1: False)", agree_length=16)],
              timeout=120)


@pytest.mark.parametrize("where", ["before", "forward", "backward", "later"])
def test_a_failing_rank_ends_the_others_within_the_timeout(where):
    """Rank 1 fails before the call, in its first block's forward or backward, or in the backward of a second
    call (the first whole), and then lingers: rank 0, calling with
    ``timeout=3``, ends with ring_attention's RuntimeError (naming the exchange) within the timeout and a
    margin, instead of waiting for the process group's timeout (30 minutes by default for gloo, 10 for NCCL).
    Mutation-checked: without the timeout passed to the waits, rank 0 waits past the harness's limit."""
    _run_ring(2, [dict(fail=where, timeout=3)], timeout=90)


def test_timeout_must_be_positive():
    """c10d takes a zero timeout as none at all: refused, as negative ones and other types are."""
    import datetime
    from flashnb.distributed import ring
    for bad in (datetime.timedelta(0), datetime.timedelta(seconds=-1), 0, -2.0, True, "5"):
        with pytest.raises(ValueError, match="timeout"):
            ring._timeout(bad)
    assert ring._timeout(2) == datetime.timedelta(seconds=2) and ring._timeout(None) is None


def test_the_rehearsal_runs_each_ranks_blocks_with_nothing_exchanged(monkeypatch):
    """``ring._rehearse_once`` (GPUs, with a timeout) runs a pass on the rank's own shards through
    ``_local_exchange``: every rank's schedule of blocks, forward and backward, no communication (no process
    group here), once per signature; without a timeout, or on CPU tensors, it runs nothing."""
    import torch
    from flashnb.distributed import ring
    q, k, v = torch.randn(1, 8, 2, 8), torch.randn(1, 8, 1, 8), torch.randn(1, 8, 1, 8)
    blocks = []
    monkeypatch.setattr(ring, "_attend", lambda q_, k_, v_, causal, *rest: blocks.append((q_.shape[1], k_.shape[1], causal))
                        or (torch.zeros(q_.shape), torch.zeros(q_.shape[0], q_.shape[2], q_.shape[1])))
    for rank in range(3):
        ring._ring_forward(q, k, v, None, 3, rank, "zigzag", True, 0.3, "auto", None, ring._local_exchange)
    # zigzag, causal, 3 ranks: each rank's own shard under the mask, then half of the rows or keys of each other
    # (rank r meets the shards of ranks r, r - 1, r - 2 in turn: an earlier rank's first half of keys, or a later
    # rank's whole shard for its second half of queries)
    assert blocks == [(8, 8, True), (4, 8, False), (4, 8, False)] + [(8, 8, True), (8, 4, False), (4, 8, False)] \
        + [(8, 8, True), (8, 4, False), (8, 4, False)]
    blocks.clear()
    ring._rehearse_once("forward", ring._ring_forward, (q, k, v), None, 3, 0, "zigzag", True, 0.3, "auto", 5.0)
    assert blocks == [] and not ring._REHEARSED                                 # CPU tensors: nothing to load
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    ring._rehearse_once("forward", ring._ring_forward, (q, k, v), None, 3, 0, "zigzag", True, 0.3, "auto", None)
    assert blocks == []                                                         # no timeout: no rehearsal
    for _ in range(2):
        ring._rehearse_once("forward", ring._ring_forward, (q, k, v), None, 3, 0, "zigzag", True, 0.3, "auto", 5.0)
    assert len(blocks) == 3 and len(ring._REHEARSED) == 1                       # once per signature
    grads = []                                                                  # the backward's, likewise
    monkeypatch.setattr(ring, "_attend_backward", lambda dout, q_, k_, v_, *rest: grads.append(q_.shape[1])
                        or (torch.zeros(q_.shape), torch.zeros(k_.shape), torch.zeros(v_.shape)))
    out, lse = torch.zeros(q.shape), torch.zeros(1, 2, 8)
    for _ in range(2):
        ring._rehearse_once("backward", ring._ring_backward, (torch.ones(q.shape), q, k, v, out, lse), None, 3, 1,
                            "zigzag", True, 0.3, "auto", 5.0)
    assert grads == [8, 8, 4] and len(ring._REHEARSED) == 2
    ring._REHEARSED.clear()
