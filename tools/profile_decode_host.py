"""Host time of decoding steps whose key count grows by one a step, as a transformers ``generate()`` loop makes
them (each step a new shape: the dispatch cache misses and the full path runs).  Batch 8, one query token,
8 heads of 128 over 8 KV heads, bfloat16, 1024 -> 1024 + STEPS keys (views of one cache; the dispatch cache emptied
before each loop, so every step's first call is a new signature, as in generate()).  Per-step time of
``flashnb.flash_attention`` (routed to the split-KV kernels), ``flashnb.transformers.attention_forward`` and
SDPA, back to back with one synchronisation, then cProfile of the flashnb steps (largest own and cumulative
times).  The flashnb rows are timed with one call a step (every call a miss: past the
miss streak, unrecorded), with the same rule off (``_dispatch.MISS_STREAK`` out of reach: every miss recorded),
and with LAYERS calls a step of the same shape (a model's layers: the first records, the others replay), per call.  ``python -m tools.profile_decode_host`` on a GPU machine; ``--steps-ab``: the dispatch cache's
length-generic steps on and off in alternating rounds (``steps_ab``)."""
import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flashnb
import flashnb.transformers as fnt
from flashnb import _dispatch

STEPS = 256

LAYERS = 4


def per_step_us(step, reps=3, calls=1):
    """Host time of one call, min over ``reps`` loops of STEPS steps of ``calls`` calls (one length a step)."""
    best = None
    for _ in range(reps):
        _dispatch.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(STEPS):
            for _ in range(calls):
                step(i)
        torch.cuda.synchronize()
        us = (time.perf_counter() - t) / (STEPS * calls) * 1e6
        best = us if best is None else min(best, us)
    return best


def main():
    torch.manual_seed(0)
    b, h, hk, d, n0 = 8, 8, 8, 128, 1024
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kf, vf = (torch.randn(b, n0 + STEPS, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kt, vt = kf.transpose(1, 2), vf.transpose(1, 2)          # transformers' layout, views
    qt = q.transpose(1, 2)
    module = torch.nn.Module()
    module.is_causal = True
    steps = {
        "flashnb.flash_attention": lambda i: flashnb.flash_attention(q, kf[:, :n0 + i], vf[:, :n0 + i], causal=True),
        "flashnb.transformers.attention_forward": lambda i: fnt.attention_forward(
            module, qt, kt[:, :, :n0 + i], vt[:, :, :n0 + i], None),
        "flashnb.flash_attn_with_kvcache (int seqlens)": lambda i: flashnb.flash_attn_with_kvcache(
            q, kf, vf, cache_seqlens=n0 + i),
        "SDPA (default backend)": lambda i: F.scaled_dot_product_attention(qt, kt[:, :, :n0 + i], vt[:, :, :n0 + i]),
    }
    with torch.no_grad():
        if "--steps-ab" in sys.argv:
            return steps_ab(steps)
        for name, step in steps.items():
            step(0)
            print(f"{name}: {per_step_us(step):.1f} us a call (min of 3 loops of {STEPS} steps)", flush=True)
            if name.startswith("flashnb"):
                streak = _dispatch.MISS_STREAK
                _dispatch.MISS_STREAK = 1 << 62
                try:
                    print(f"{name}, every miss recorded: {per_step_us(step):.1f} us a call", flush=True)
                finally:
                    _dispatch.MISS_STREAK = streak
            print(f"{name}, {LAYERS} calls a step: {per_step_us(step, calls=LAYERS):.1f} us a call", flush=True)
        for name in ("flashnb.flash_attention", "flashnb.transformers.attention_forward"):
            _dispatch.clear()
            prof = cProfile.Profile()
            prof.enable()
            for i in range(STEPS):
                steps[name](i)
            torch.cuda.synchronize()
            prof.disable()
            print(f"==== {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(22)


def steps_ab(steps, rounds=7):
    """``--steps-ab``: the routed calls with the dispatch cache's length-generic steps on and off
    (``api._KEY_LENGTH``), one and LAYERS calls a step, and SDPA, in alternating rounds of one process (this
    host's timings drift between calls): median and min per row."""
    from flashnb import api
    on = api._KEY_LENGTH
    rows = {}
    for _ in range(rounds):
        for name in ("flashnb.flash_attention", "flashnb.transformers.attention_forward", "SDPA (default backend)"):
            for calls in (1, LAYERS):
                for generic in ((on, None) if name.startswith("flashnb") else (on,)):
                    api._KEY_LENGTH = generic
                    try:
                        us = per_step_us(steps[name], reps=1, calls=calls)
                    finally:
                        api._KEY_LENGTH = on
                    label = f"{name}, {calls} call{'s' if calls > 1 else ''} a step" + (
                        "" if not name.startswith("flashnb") else ", steps on" if generic else ", steps off")
                    rows.setdefault(label, []).append(us)
    for label, us in rows.items():
        print(f"{label:<72} median {statistics.median(us):7.1f} us  min {min(us):7.1f} us  ({len(us)} rounds)")
    _dispatch.clear()
    prof = cProfile.Profile()
    step = steps["flashnb.flash_attention"]
    step(0)
    prof.enable()
    for i in range(1, STEPS):
        step(i)
    torch.cuda.synchronize()
    prof.disable()
    print(f"==== flashnb.flash_attention, steps on: {_dispatch.stats}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
