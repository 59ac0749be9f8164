"""One rank of the gloo ring-attention check (tests/distributed/test_ring_gloo.py starts P of them).

Every rank draws the same full q, k, v, dout from the seed, runs ``flashnb.distributed.ring_attention`` on its
shard (CPU tensors: flashnb's kernels through NumPy, in the simulator where there is no GPU), and checks its
rows of out, lse, dq, dk, dv against the float64 oracle of the whole sequence (``reference.attention`` /
``attention_backward``), float32 inputs, a relative bound. Exit status 0 = every case passed on this rank.

``RING_DEVICE=cuda`` runs the same cases on GPUs over NCCL (one GPU a rank; tests/gpu_ring_nccl.py).
"""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import reference
from flashnb.distributed import ring_attention, shard, unshard

DEVICE = os.environ.get("RING_DEVICE", "cpu")


def check(case, seed, rank, world):
    rng = np.random.default_rng(seed)
    batch, seqlen, nheads, nheads_k, d = 1, case["seqlen"], case["nheads"], case["nheads_k"], case["headdim"]
    q = rng.standard_normal((batch, seqlen, nheads, d)).astype(np.float32)
    k, v = (rng.standard_normal((batch, seqlen, nheads_k, d)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    scale = float(rng.uniform(0.3, 1.0))
    causal, layout = case["causal"], case["layout"]
    want = reference.attention(q, k, v, causal=causal, softmax_scale=scale)
    want_grads = reference.attention_backward(dout, q, k, v, causal=causal, softmax_scale=scale)

    cut = lambda x: shard(torch.from_numpy(x).to(DEVICE), layout=layout)              # noqa: E731
    qs, ks, vs = (cut(x).requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(qs, ks, vs, causal=causal, softmax_scale=scale, layout=layout, return_lse=True)
    out.backward(cut(dout))
    got = {"out": unshard(out.detach(), layout=layout), "lse": unshard(lse, layout=layout, dim=2),
           "dq": unshard(qs.grad, layout=layout), "dk": unshard(ks.grad, layout=layout),
           "dv": unshard(vs.grad, layout=layout)}
    for name, ref in zip(("out", "lse", "dq", "dk", "dv"), (want[0], want[1]) + tuple(want_grads)):
        g = got[name].cpu().numpy().astype(np.float64)
        err = np.max(np.abs(g - ref)) / max(np.max(np.abs(ref)), 1e-30)
        # float32 inputs and float32 accumulation over a few dozen terms: a few ulps of float32 relative to the
        # largest entry (the kernels' own bound for float32 in tests/kernel_harness.py is of this order)
        assert err < 2e-5, f"rank {rank}/{world} {case} seed {seed}: {name} relative error {err:.2e}"


def disagree(case, seed, rank, world):
    """Rank 1 passes something else than the others (``case["rank1"]``: dtype, length, heads, causal): every
    rank must raise ValueError naming it (``case["expect"]``), before any exchange; then an agreeing call runs
    (the group is still usable), and its repeat gathers nothing (the agreement is remembered).  Each case's
    signatures are new to every rank (``case["agree_length"]``): the check runs at a signature's first call,
    and a rank whose signature the group agreed on earlier does not gather again (docs/distributed.md)."""
    from flashnb.distributed import ring
    rng = np.random.default_rng(seed)
    mine = dict(dtype="float32", length=8, heads=2, causal=True)
    if rank == 1:
        mine.update(case["rank1"])
    dtype = getattr(torch, mine["dtype"])
    q = torch.from_numpy(rng.standard_normal((1, mine["length"], mine["heads"], 8))).to(DEVICE, dtype)
    k = v = torch.from_numpy(rng.standard_normal((1, mine["length"], 1, 8))).to(DEVICE, dtype)
    try:
        ring_attention(q, k, v, causal=mine["causal"])
    except ValueError as e:
        assert case["expect"] in str(e), f"rank {rank}: {e}"
    else:
        raise AssertionError(f"rank {rank}: no error for {case}")
    n = case["agree_length"]
    q, k, v = (torch.from_numpy(rng.standard_normal((1, n, h, 8)).astype(np.float32)).to(DEVICE) for h in (2, 1, 1))
    ring_attention(q, k, v, causal=True)
    calls = []
    real = ring._gather_rows
    ring._gather_rows = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        ring_attention(q, k, v, causal=True)
    finally:
        ring._gather_rows = real
    assert not calls, f"rank {rank}: the agreed signature was gathered again"


def fail(case, seed, rank, world):
    """Rank 1 fails (``case["fail"]``: "before" the call, as an out-of-memory before it would; in its first
    block's "forward" or "backward"; or "later": in its backward of a second call, the first having run whole,
    so that nothing is compiled, rehearsed or connected any more) and stays alive for twice the timeout: every
    other rank, calling with ``timeout``, must end with ring_attention's RuntimeError within the timeout and a
    margin (``case["bound"]``, counted from the start of the pass in which rank 1 fails), not wait for the
    process group's timeout."""
    import time
    from flashnb.distributed import ring
    timeout, where = case["timeout"], case["fail"]
    q, k, v = (torch.randn(1, 8, h, 8, device=DEVICE, requires_grad=True) for h in (2, 1, 1))
    if where == "later":                         # a healthy call first, on every rank
        ring_attention(q, k, v, causal=True, timeout=timeout).sum().backward()
    if rank == 1:
        if where in ("forward", "backward", "later"):
            def broken(*args, **kwargs):
                raise RuntimeError("injected failure")
            setattr(ring, "_attend" if where == "forward" else "_attend_backward", broken)
            try:
                ring_attention(q, k, v, causal=True, timeout=timeout).sum().backward()
            except RuntimeError as e:
                assert "injected failure" in str(e), str(e)
        time.sleep(2 * timeout)
        if DEVICE == "cuda":
            _destroy_after_failure(rank)
        return
    import faulthandler
    bound = case.get("bound", timeout + 10)
    faulthandler.dump_traceback_later(bound + 5, exit=False)     # a rank stuck past the bound shows where
    print(f"rank {rank}: calling ring_attention(timeout={timeout})", flush=True)
    t0 = time.perf_counter()
    try:
        out = ring_attention(q, k, v, causal=True, timeout=timeout)
        if where in ("backward", "later"):       # rank 1 fails in its backward: count from there
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        out.sum().backward()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as e:
        took = time.perf_counter() - t0
        assert "did not complete within" in str(e), f"rank {rank}: {e}"
        assert took < bound, f"rank {rank} ended after {took:.1f} s (timeout {timeout} s, bound {bound} s)"
        print(f"rank {rank}: {str(e)[:200]} after {took:.1f} s", flush=True)
    else:
        raise AssertionError(f"rank {rank}: no error although rank 1 failed ({case})")
    if DEVICE == "cuda":
        _destroy_after_failure(rank)


def _destroy_after_failure(rank, limit=20.0):
    """What docs/distributed.md tells a user to do after the error: destroy the process group.  Reported with
    the time it took (NCCL aborts the communicator); then a hard exit, so that a teardown still waiting on the
    failed peer cannot outlive the test."""
    import threading
    import time
    t0 = time.perf_counter()
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True)
    worker.start()
    worker.join(limit)
    print(f"rank {rank}: destroy_process_group {'returned' if not worker.is_alive() else 'still running'} after "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    sys.stdout.flush()
    os._exit(0)


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if DEVICE == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        import datetime
        group_timeout = datetime.timedelta(seconds=float(os.environ.get("RING_GROUP_TIMEOUT", 600)))
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=group_timeout,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    seed, cases = int(sys.argv[1]), json.loads(sys.argv[2])
    try:
        for i, case in enumerate(cases):
            (disagree if "rank1" in case else fail if "fail" in case else check)(case, seed + i, rank, world)
    finally:
        if not any("fail" in case for case in cases):     # (a failed ring's group is left to the process's end)
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
