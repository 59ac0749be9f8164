"""Ring attention on ``torch.distributed``: the autograd function, the ring loops, one block's kernels
(the package docstring, ``flashnb.distributed``, says what it computes and how to call it)."""
import datetime
import math
import weakref

import numpy as np
import torch
import torch.distributed as dist

from .. import api
from ..torch import attention_function
from . import _agree as _agreement
from ._schedule import ALL, LAYOUTS, block, positions

__all__ = ["ring_attention", "shard", "unshard"]


def ring_attention(q, k, v, causal=False, softmax_scale=None, group=None, layout="zigzag", return_lse=False,
                   backend="auto", timeout=None):
    """This rank's rows of ``attention(q_full, k_full, v_full)`` for a sequence sharded over the ranks of
    ``group`` (default: the whole world), differentiable in q, k, v.

    q ``(batch, L, nheads, headdim)``, k and v ``(batch, L, nheads_k, headdim)``: this rank's ``L`` rows of the
    sequence in ``layout`` (``shard`` makes them). Every rank passes the same shapes, dtype and options.
    causal: query position ``i`` sees key position ``j <= i`` (global positions; queries and keys are the
    same sequence). Returns ``out`` like q, or ``(out, lse)`` with lse ``(batch, nheads, L)`` float32
    (float64 for float64 inputs).

    timeout: None (wait as the process group does: its own timeout), or a ``datetime.timedelta`` / seconds:
    the longest this rank waits for one exchange (the agreement's gather, each step's shards) before raising
    ``RuntimeError`` naming the step and the peers, so that a rank that failed or stalled ends the others within
    about ``timeout`` (forward and backward alike).  On GPUs a signature's first pass with a timeout is rehearsed
    once on this rank's shards, so that no kernel is first loaded while an exchange is in flight (docs/distributed.md:
    what NCCL and CUDA would otherwise block on, and what to do after the error).

    Speed: the exchanges overlap the attention when the group's NCCL streams have a higher priority than the
    compute stream (``ProcessGroupNCCL.Options`` with ``is_high_priority_stream=True``; docs/distributed.md: 82%
    -> 90% scaling of the causal forward on 4 H100s).
    """
    world, rank = _ring_of(group)
    _check(q, k, v, layout, world, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    timeout = _timeout(timeout)
    # rehearsed before the agreement: a rank failing in its first blocks (compiling, out of memory) leaves the
    # others waiting in the store, which the timeout bounds, rather than in an exchange
    _rehearse_once("forward", _ring_forward, (q, k, v), group, world, rank, layout, bool(causal), scale, backend,
                   timeout)
    _agree(q, k, group, world, layout, causal, scale, backend, timeout)
    settings = (group, world, rank, layout, bool(causal), scale, backend, timeout)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _RingAttention.apply(q, k, v, settings)
    else:
        with torch.no_grad():
            out, lse = _ring_forward(q, k, v, *settings)
    return (out, lse) if return_lse else out


def shard(x, group=None, layout="zigzag", dim=1):
    """This rank's rows (along ``dim``) of the full tensor ``x``, in ``layout``; a contiguous copy."""
    world, rank = _ring_of(group)
    _check_layout(layout)
    n = x.shape[dim]
    if n % (world * (2 if layout == "zigzag" else 1)):
        raise ValueError(f"x.shape[{dim}] = {n} must be a multiple of {2 if layout == 'zigzag' else 1} x the "
                         f"world size {world} for the {layout} layout")
    index = torch.tensor(positions(layout, rank, world, n // world), device=x.device)
    return x.index_select(dim, index).contiguous()


def unshard(x, group=None, layout="zigzag", dim=1):
    """The full tensor from every rank's shard ``x`` (``all_gather``, rows put back in order)."""
    world, _ = _ring_of(group)
    _check_layout(layout)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    n = x.shape[dim]
    order = np.argsort(np.concatenate([positions(layout, r, world, n) for r in range(world)]))
    return torch.cat(parts, dim=dim).index_select(dim, torch.as_tensor(order, device=x.device))


# ------------------------------------------------------------------------------------------------ checks
def _ring_of(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashnb.distributed needs torch.distributed initialised (dist.init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check(q, k, v, layout, world, causal):
    _check_layout(layout)
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d torch.Tensor (batch, seqlen, nheads, headdim)")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be one sequence's "
                         "shards: one batch, one length, one head dim, k and v alike")
    if causal and layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"the zigzag layout holds two chunks per rank: the shard length {q.shape[1]} must be even")
    if world < 1:
        raise ValueError("the process group is empty")


_AGREED = weakref.WeakKeyDictionary()   # group -> the signatures every rank of it has been seen to agree on


def _group_key(group):
    """The process group itself (``None`` resolved to the default group, so that it and ``dist.group.WORLD``
    are one): a group destroyed and created again is a new object, hence a fresh agreement and connection.
    (The caches hold it weakly: a strong reference kept a destroyed group alive until the interpreter's end,
    where its teardown aborted the process.)"""
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_group() if group is None else group


def _timeout(timeout):
    """None, or a positive ``timedelta`` (c10d takes a zero one as no timeout at all)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta) and timeout > datetime.timedelta(0):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return datetime.timedelta(seconds=timeout)
    raise ValueError(f"timeout must be None, a datetime.timedelta or a number of seconds > 0, got {timeout!r}")


def _agree(q, k, group, world, layout, causal, scale, backend, timeout=None):
    """Before the first exchange of a signature on a group: gather every rank's ``_agree.encode`` row and raise
    ``ValueError`` on every rank where they differ (``_agree.disagreement`` names the fields and the ranks'
    values); then connect the ring (``_connect``).  A signature once agreed on is not checked again, so a
    training loop pays this once.  (A rank that changes its signature alone after an agreed step is checked
    while the others are not: docs/distributed.md says how that ends.)"""
    dtype = str(q.dtype).removeprefix("torch.")
    row = _agreement.encode(dtype, q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[2], layout, causal,
                            scale, backend)
    if world == 1:
        return
    agreed = _AGREED.setdefault(_group_key(group), set())
    if tuple(row) in agreed:
        return
    message = _agreement.disagreement(_gather_rows(row, group, world, timeout))
    if message is not None:
        raise ValueError(message)
    _connect(q, group, world, timeout=timeout)
    agreed.add(tuple(row))


_ROUNDS = weakref.WeakKeyDictionary()   # group -> agreements this rank started on it (names a round's keys)


def _gather_rows(row, group, world, timeout):
    """Every rank's ``row``, through the process group's key-value store (not NCCL: a collective whose peer never
    comes can block NCCL's host code while it connects, past any timeout; measured, docs/distributed.md).
    Each rank sets its row and waits for the others' for ``timeout`` (None: the store's own, the process group's
    timeout), then ``RuntimeError`` names the ranks that never came.  Each round leaves its rows in the store
    (a few dozen bytes a rank; one round per signature a group agrees on)."""
    store, rank = _store_of(group), dist.get_rank(group)
    gkey = _group_key(group)
    round_ = _ROUNDS[gkey] = _ROUNDS.get(gkey, 0) + 1
    keys = [f"flashnb.ring.agree/{round_}/{r}" for r in range(world)]
    store.set(keys[rank], ",".join(map(str, row)))
    try:
        store.wait(keys, timeout if timeout is not None else store.timeout)
    except (RuntimeError, dist.DistStoreError) as e:       # (DistStoreError: the store's timeout)
        try:
            missing = [r for r, name in enumerate(keys) if not store.check([name])]
        except Exception:                                  # (the store itself gone)
            missing = "unknown"
        raise RuntimeError(f"ring_attention: the ranks' agreement did not complete within "
                           f"{timeout if timeout is not None else store.timeout}: rank(s) {missing} of the group "
                           f"never called (a rank failed, or calls ring_attention with a signature the others "
                           f"agreed on before; docs/distributed.md). The group's agreements are out of step "
                           f"now: destroy the process group. {e}") from e
    return [[int(x) for x in store.get(name).decode().split(",")] for name in keys]


def _store_of(group):
    """The process group's key-value store (c10d keeps it with the group; no public accessor in torch 2.11)."""
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_process_group_store(group if group is not None
                                                     else distributed_c10d._get_default_group())


def _connect(q, group, world, rank=None, timeout=None):
    """One exchange of a single element around the ring, right after the agreement, while every rank is known
    to be there: NCCL connects a pair of ranks at their first exchange, blocking the host until the peer comes,
    so the ring's connections are made now rather than at a step a failed peer never reaches."""
    rank = dist.get_rank(group) if rank is None else rank
    requests, _ = _exchange([torch.zeros(1, dtype=q.dtype, device=q.device)], group, world, rank)
    _wait(requests, timeout, "the ring's first connection")


# ------------------------------------------------------------------------------------------------ the ring
def _exchange(tensors, group, world, rank):
    """Start sending ``tensors`` to the next rank and receiving their like from the previous one:
    ``(requests, received)``."""
    received = [torch.empty_like(t) for t in tensors]
    nxt, prev = _global_rank(group, (rank + 1) % world), _global_rank(group, (rank - 1) % world)
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev, group) for r in received]
    return dist.batch_isend_irecv(ops), received


def _global_rank(group, group_rank):
    """P2POp takes peers by their rank in the world."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _wait(requests, timeout=None, what="an exchange"):
    """Wait for ``requests``; with a ``timeout``, at most that long for each, then ``RuntimeError``."""
    for r in requests:
        if timeout is None:
            r.wait()
            continue
        try:
            r.wait(timeout=timeout)
        except RuntimeError as e:
            raise RuntimeError(f"ring_attention: {what} did not complete within {timeout}: a rank of the ring failed "
                               f"or stalled (after this, destroy the process group: its communicator may be "
                               f"unusable). {e}") from e


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _local_exchange(tensors, group, world, rank):
    """A rehearsal's exchange: nothing sent, the shard in hand kept (its shapes are the ones that would arrive)."""
    return [], list(tensors)


_REHEARSED = set()       # (pass, rank, world, device, shapes, dtype, layout, causal, backend) rehearsed here


def _rehearse_once(name, ring_pass, tensors, group, world, rank, layout, causal, scale, backend, timeout):
    """With a ``timeout`` on GPUs, before a signature's first exchange: run ``ring_pass`` once on this rank's own
    shards with nothing exchanged, so that every kernel the real pass launches (flashnb's and PyTorch's) is loaded.
    CUDA loads a kernel at its first launch (lazy loading), and a load waits for the context's running kernels:
    a first launch while an exchange with a failed peer spins on the GPU would block the host for good, out of
    the timeout's reach (measured on 2 GPUs, bench/results/h200x2-ring-2026-11-27.md).  Costs one local pass,
    once per signature; nothing without a timeout (the process group's watchdog bounds that case)."""
    if timeout is None or world == 1 or not tensors[0].is_cuda:
        return
    key = (name, rank, world, tensors[0].device, tuple(tuple(t.shape) for t in tensors), tensors[0].dtype, layout,
           causal, backend)
    if key in _REHEARSED:
        return
    with torch.no_grad():
        ring_pass(*tensors, group, world, rank, layout, causal, scale, backend, None, _local_exchange)
    _REHEARSED.add(key)


def _ring_forward(q, k, v, group, world, rank, layout, causal, scale, backend, timeout=None, exchange=None):
    """``(out, lse)`` of this rank's queries over every shard, merged step by step (``reference.ring``)."""
    if exchange is None:                 # (ring_attention rehearsed it, before the agreement)
        exchange = _exchange
    acc = _acc_dtype(q)
    out = torch.empty(q.shape, dtype=acc, device=q.device)        # (set by the first block: no pass of its own)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc, device=q.device)
    kv, first = (k, v), True
    for step in range(world):
        pending = exchange(kv, group, world, rank) if step < world - 1 else None
        rows = block(layout, causal, rank, (rank - step) % world, q.shape[1])
        if rows is not None:
            qs, ks, block_causal = rows
            o, l = _attend(q[:, qs], kv[0][:, ks], kv[1][:, ks], block_causal, scale, backend)
            if first and qs == ALL:         # the first block reaching every row: nothing to merge with yet
                out.copy_(o)
                lse.copy_(l)
            else:
                if first:                    # rows the first block does not reach: nothing seen yet
                    out.zero_()
                    lse.fill_(-math.inf)
                _merge(out[:, qs], lse[:, :, qs], o, l)
            first = False
        if pending is not None:
            _wait(pending[0], timeout, f"rank {rank}'s forward exchange of step {step} (to rank {(rank + 1) % world}, "
                                       f"from rank {(rank - 1) % world})")
            kv = tuple(pending[1])
    if first:                                # no block reached this rank's rows
        out.zero_()
        lse.fill_(-math.inf)
    return out.to(q.dtype), lse


def _merge(out, lse, o, l):
    """``(out, lse) <- combine((out, lse), (o, l))`` in place (``reference.combine_splits`` for two parts)."""
    new = torch.logaddexp(lse, l.to(lse.dtype))
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)       # rows nothing has reached yet
    weight = lambda x: torch.exp(x - safe).transpose(1, 2).unsqueeze(-1)    # noqa: E731  (b, h, L) -> (b, L, h, 1)
    out.mul_(weight(lse)).addcmul_(o, weight(l.to(lse.dtype)))      # (one pass over out, no temporary of its size)
    lse.copy_(new)


def _ring_backward(dout, q, k, v, out, lse, group, world, rank, layout, causal, scale, backend, timeout=None,
                   exchange=None):
    """``(dq, dk, dv)``: each step's share from the final ``lse``; dK/dV accumulate while travelling with their
    shard, one last hop brings them home (``reference.ring.ring_attention_backward``)."""
    if exchange is None:
        _rehearse_once("backward", _ring_backward, (dout, q, k, v, out, lse), group, world, rank, layout, causal,
                       scale, backend, timeout)
        exchange = _exchange
    acc = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv, dkv, incoming = (k, v), None, None
    for step in range(world):
        pending = exchange(kv, group, world, rank) if step < world - 1 else None
        rows = block(layout, causal, rank, (rank - step) % world, q.shape[1])
        shares = None
        if rows is not None:
            qs, ks, block_causal = rows
            shares = _attend_backward(dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], out[:, qs],
                                      lse[:, :, qs].contiguous(), block_causal, scale, backend)
            dq[:, qs] += shares[0]
        what = (f"rank {rank}'s backward exchange of step {step} (to rank {(rank + 1) % world}, from rank "
                f"{(rank - 1) % world})")
        if incoming is None:
            dkv = [torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(2)]
        else:
            _wait(incoming[0], timeout, what)
            dkv = incoming[1]
        if shares is not None:
            dkv[0][:, ks] += shares[1]
            dkv[1][:, ks] += shares[2]
        incoming = exchange(dkv, group, world, rank) if world > 1 else ([], dkv)
        if pending is not None:
            _wait(pending[0], timeout, what)
            kv = tuple(pending[1])
    _wait(incoming[0], timeout, f"rank {rank}'s last backward exchange")
    dk, dv = incoming[1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _ring_backward_rows(dout, q, k, v, out, lse, *settings):
    return _ring_backward(dout.contiguous(), q, k, v, out, lse, *settings)


_RingAttention = attention_function("_RingAttention", _ring_forward, _ring_backward_rows,
                                    "ring_attention's autograd: the ring forward, the ring backward.")


# ------------------------------------------------------------------------------------------------ one block
def _attend(q, k, v, causal, scale, backend):
    """flashnb's forward of one block: ``(out, lse)`` (CPU tensors through NumPy, in the simulator)."""
    if q.is_cuda:
        return api.flash_attention(q, k, v, softmax_scale=scale, causal=causal, return_lse=True, backend=backend)
    out, lse = api.flash_attention(*_numpy(q, k, v), softmax_scale=scale, causal=causal, return_lse=True,
                                   backend=backend)
    return torch.from_numpy(out), torch.from_numpy(lse)


def _attend_backward(dout, q, k, v, out, lse, causal, scale, backend):
    """flashnb's backward of one block, from the final ``out`` and ``lse``: ``(dq, dk, dv)`` of the block."""
    if q.is_cuda:
        return api.flash_attention_backward(dout, q, k, v, out, lse.to(_acc_dtype(q)), softmax_scale=scale,
                                            causal=causal, backend=backend)
    grads = api.flash_attention_backward(*_numpy(dout, q, k, v, out), lse.to(_acc_dtype(q)).numpy(),
                                         softmax_scale=scale, causal=causal, backend=backend)
    return tuple(torch.from_numpy(np.ascontiguousarray(g)) for g in grads)


def _numpy(*tensors):
    return tuple((t.detach().float() if t.dtype == torch.bfloat16 else t.detach()).numpy() for t in tensors)
