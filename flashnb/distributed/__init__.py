"""Exact attention over a sequence sharded across GPUs: ring attention on ``torch.distributed``.

    import torch.distributed as dist
    from flashnb.distributed import ring_attention, shard, unshard
    dist.init_process_group("nccl")                     # torchrun --nproc-per-node=P ...
    q, k, v = (shard(x) for x in (q_full, k_full, v_full))   # (batch, seqlen / P, heads, dim), zigzag rows
    out = ring_attention(q, k, v, causal=True)          # this rank's rows of attention(q_full, k_full, v_full)
    out.sum().backward()                                # dq, dk, dv of this rank's rows

Each rank holds the rows of one shard of the sequence (``layout``: ``"zigzag"``, the default, or
``"contiguous"``; ``shard`` / ``unshard`` cut and reassemble a full tensor). The key/value shards travel around
the ring of ranks with asynchronous point-to-point operations (``torch.distributed.batch_isend_irecv``: NCCL
on GPUs, gloo on CPUs) while the shard in hand is computed with flashnb's kernels; the partial ``(out, lse)`` are
merged with the exact log-sum-exp combine in float32. The backward passes the shards around once more, with
the dK/dV accumulators (float32) travelling with them and one last hop bringing each home. ``reference.ring``
is the NumPy definition, step for step.

Causal attention with the zigzag layout gives every rank the same work at every step (the first step, its own
shard, is a causal block of ``L`` rows; each later one a full block of ``L x L/2``); the contiguous layout
leaves rank 0 idle after its first step. ``docs/distributed.md`` has the launch, the measurements and what
changes on 8 GPUs and across nodes.
"""

__all__ = ["ring_attention", "shard", "unshard", "LAYOUTS"]

from ._schedule import LAYOUTS  # noqa: E402  (no torch: the schedule is checked in CI without it)


def __getattr__(name):
    """The torch-built parts load on first use, so that ``flashnb.distributed._schedule`` needs no torch."""
    if name in ("ring_attention", "shard", "unshard"):
        from . import ring
        return getattr(ring, name)
    raise AttributeError(f"module 'flashnb.distributed' has no attribute {name!r}")
