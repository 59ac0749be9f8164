"""Ring attention (context parallelism), simulated in NumPy: P ranks each hold a shard of one sequence.

Rank ``r`` holds the query, key and value rows whose global positions are ``positions[r]`` (any partition of
``0 .. N - 1``: contiguous chunks, zigzag, striped, random).  The key/value shards travel around the ring: at
step ``t`` rank ``r`` holds the shard of rank ``(r - t) mod P``, computes the attention of its queries over
those keys (``causal``: query position ``i`` sees key position ``j`` iff ``j <= i``), and merges the partial
``(out, lse)`` into its running result with ``combine_splits`` (the exact log-sum-exp merge).  After ``P``
steps every rank holds ``attention`` of its queries over the whole sequence.

The backward goes around the ring once more: each rank recomputes the probabilities of its queries over the
shard in hand from the *final* ``lse`` (``P = exp(S - lse)``, FA2's recompute), adds its share to its own dQ,
and adds its shares of dK and dV to accumulators that travel with the shard; one last hop brings every
accumulator home.

Both are written as the ring runs (a list of ranks, a loop over steps), with no communication library, so
that ``flashnb.distributed`` can be checked step by step against them.
"""
import numpy as np

from .standard import attention
from .varlen import combine_splits


def contiguous_positions(seqlen, world_size):
    """Rank ``r`` holds rows ``r * seqlen / P .. (r + 1) * seqlen / P``."""
    _check_split(seqlen, world_size, 1)
    n = seqlen // world_size
    return [np.arange(r * n, (r + 1) * n) for r in range(world_size)]


def zigzag_positions(seqlen, world_size):
    """The sequence cut into ``2P`` chunks; rank ``r`` holds chunks ``r`` and ``2P - 1 - r``, so that under a
    causal mask every rank has the same amount of work."""
    _check_split(seqlen, world_size, 2)
    n = seqlen // (2 * world_size)
    return [np.concatenate([np.arange(r * n, (r + 1) * n), np.arange((2 * world_size - 1 - r) * n,
                                                                      (2 * world_size - r) * n)])
            for r in range(world_size)]


def _check_split(seqlen, world_size, chunks):
    if world_size < 1 or seqlen % (chunks * world_size):
        raise ValueError(f"seqlen {seqlen} must be a multiple of {chunks} x world_size ({world_size})")


def _block_mask(pos_q, pos_k, causal):
    return pos_k[None, :] <= pos_q[:, None] if causal else np.ones((pos_q.size, pos_k.size), bool)


def _expand_heads(x, nheads):
    """k or v ``(batch, seqlen, nheads_k, d)`` with each key/value head repeated for its query heads."""
    return np.repeat(x, nheads // x.shape[2], axis=2)


def ring_attention(q_shards, k_shards, v_shards, positions, *, causal=False, softmax_scale=None):
    """``(outs, lses)``: per rank, ``out (batch, L_r, nheads, d)`` and ``lse (batch, nheads, L_r)`` of its
    queries over the whole sequence, computed by passing the key/value shards around the ring (module
    docstring).  Shards are ``(batch, L_r, nheads[_k], d)``; ``positions[r]`` the global positions of rank
    ``r``'s rows."""
    world = len(q_shards)
    q_shards, k_shards, v_shards = ([np.asarray(x, np.float64) for x in xs] for xs in (q_shards, k_shards, v_shards))
    outs, lses = [], []
    for r in range(world):
        q = q_shards[r]
        out, lse = np.zeros(q.shape), np.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf)
        for t in range(world):
            s = (r - t) % world                      # the shard in hand at step t
            mask = _block_mask(positions[r], positions[s], causal)
            o, l = attention(q, k_shards[s], v_shards[s], attn_mask=mask, softmax_scale=softmax_scale)
            out_bhld, lse = combine_splits([out.transpose(0, 2, 1, 3), o.transpose(0, 2, 1, 3)], [lse, l])
            out = out_bhld.transpose(0, 2, 1, 3)
        outs.append(out)
        lses.append(lse)
    return outs, lses


def ring_attention_backward(dout_shards, q_shards, k_shards, v_shards, out_shards, lse_shards, positions, *,
                            causal=False, softmax_scale=None):
    """``(dqs, dks, dvs)`` per rank: the gradients of ``sum(out * dout)`` for ``ring_attention``, with the
    dK/dV accumulators travelling around the ring (module docstring)."""
    world = len(q_shards)
    f64 = [[np.asarray(x, np.float64) for x in xs]
           for xs in (dout_shards, q_shards, k_shards, v_shards, out_shards, lse_shards)]
    dout_shards, q_shards, k_shards, v_shards, out_shards, lse_shards = f64
    d = q_shards[0].shape[3]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    dqs = [np.zeros(q.shape) for q in q_shards]
    # acc[r] is the (dk, dv) accumulator rank r holds: at step t it belongs to shard (r - t) mod P
    acc = [None] * world
    for t in range(world):
        received = [acc[(r - 1) % world] for r in range(world)]       # the hop from the previous rank
        for r in range(world):
            s = (r - t) % world
            dq, dk, dv = _block_backward(dout_shards[r], q_shards[r], k_shards[s], v_shards[s], out_shards[r],
                                         lse_shards[r], _block_mask(positions[r], positions[s], causal), scale)
            dqs[r] += dq
            acc[r] = (dk, dv) if t == 0 else (received[r][0] + dk, received[r][1] + dv)
    home = [acc[(r - 1) % world] for r in range(world)]                # the last hop: shard r's sums to rank r
    return dqs, [h[0] for h in home], [h[1] for h in home]


def _block_backward(dout, q, k, v, out, lse, mask, scale):
    """The share of one query shard over one key/value shard in the gradients, from the final ``lse``."""
    nheads, nheads_k = q.shape[2], k.shape[2]
    ke, ve = _expand_heads(k, nheads), _expand_heads(v, nheads)
    s = np.einsum("bihd,bjhd->bhij", q, ke) * scale
    p = np.where(mask, np.exp(np.where(mask, s, 0.0) - np.where(np.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    delta = np.einsum("bihd,bihd->bhi", dout, out)
    dv = np.einsum("bhij,bihd->bjhd", p, dout)
    dp = np.einsum("bihd,bjhd->bhij", dout, ve)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bhij,bjhd->bihd", ds, ke) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    group = nheads // nheads_k
    fold = lambda g: g.reshape(g.shape[:2] + (nheads_k, group, g.shape[3])).sum(axis=3)  # noqa: E731
    return dq, fold(dk), fold(dv)
