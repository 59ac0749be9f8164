"""Host time per call of ``flashnb.flex_attention`` and ``flex_attention_backward`` with mods (an ALiBi score_mod,
a causal document mask) on a tiny bfloat16 problem (1, 8, 128, 64): torch CUDA tensors, warm, 200 calls between two
synchronisations, median of 7 repeats (microseconds); the dispatch cache's replay against the full path (every
lookup told "unfit").

    python -m tools.flex_host_time
"""
import statistics
import time

import numpy as np
import torch

import flashnb
from flashnb import _dispatch


def _per_call(f, calls=200):
    """Microseconds a call of ``f`` over ``calls`` calls between two synchronisations."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    slopes = np.float32(2.0) ** -np.arange(1, 9, dtype=np.float32)
    doc = np.repeat(np.arange(4, dtype=np.int32), 32)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    mask = flashnb.create_block_mask(document, None, None, 128, 128)
    out, lse = flashnb.flex_attention(q, k, v, alibi, mask, return_lse=True)
    calls = (("forward", lambda: flashnb.flex_attention(q, k, v, alibi, mask, return_lse=True)),
             ("backward", lambda: flashnb.flex_attention_backward(do, q, k, v, out, lse, alibi, mask)))
    replayed_and_full("flex", calls)


def replayed_and_full(what, calls):
    """Each ``(name, call)`` of ``calls`` timed warm (``_per_call``, median of 7), first as the dispatch cache
    replays it, then on the full path (every lookup told "unfit"); printed, then the cache's counts."""
    lookup = _dispatch.lookup
    try:
        for label, patched in (("replayed", lookup), ("full path", lambda key: _dispatch.UNFIT)):
            _dispatch.lookup = patched
            for name, f in calls:
                f()
                times = [_per_call(f) for _ in range(7)]
                print(f"{what} {name} {label}: median {statistics.median(times):.1f} us (min {min(times):.1f})",
                      flush=True)
    finally:
        _dispatch.lookup = lookup
    print("dispatch stats", _dispatch.stats)


if __name__ == "__main__":
    main()
