"""Where the time of one benchmarked call goes on the GPU: every kernel, memset and gap between them.

    python -m tools.timeline [--headdim 64] [--seqlens 1024 2048] [--causal 0 1] [--pass fwdbwd]
                             [--impl flashnb-auto sdpa-flash] [--reps 20]

Each (case, impl) is called exactly as ``python -m bench`` calls it (``bench.impls``; the L2 flushed
before each call, a CUDA event pair around it, calls queued with no synchronisation between them) and
then, the same loop again, under the PyTorch profiler (CUPTI).  The GPU's timeline is cut into calls at
the flush, and each position in a call (the n-th kernel or memset) gets its mean duration and the mean
idle time before it.  Three totals then place the call's time:

* ``events``: the bench's figure, median of the event pairs;
* ``span``: first operation's start to the last one's end, per call (``events`` minus the idle time
  before the first operation and the events' own cost);
* ``busy``: the sum of the operations' durations (``span`` minus the gaps inside the call);

and ``graph``, the median time of the call captured once in a CUDA graph and replayed (no host work
between launches; "n/a" with the reason when capture failed, for example a synchronisation inside
the call), and ``host``, the median host time of one call in the queued loop.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from tabulate import tabulate

GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def _short(name: str, width: int = 70) -> str:
    """The name without ``void`` and arguments, at most ``width`` characters; a memset's or copy's size kept."""
    size = name[name.rindex(") ") + 2:] if name.endswith(" B") and ") " in name else ""
    head = name.replace("void ", "").split("(")[0].rstrip() or name
    name = f"{head} {size}" if size else head
    return name if len(name) <= width else name[:width - 3] + "..."


def _gpu_ops(trace_path: str) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every kernel, memset and copy in a Chrome trace, by start; a memset's
    or copy's name carries its size ("Memset (Device) 268435456 B")."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ops = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES:
            nbytes = (e.get("args") or {}).get("bytes")
            name = e.get("name", "?") + (f" {nbytes} B" if nbytes is not None else "")
            ops.append((float(e["ts"]), float(e.get("dur", 0.0)), name))
    return sorted(ops)


def _profile(loop, torch) -> list[tuple[float, float, str]]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loop()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return _gpu_ops(path)
    finally:
        os.unlink(path)


def _calls(ops, flush_name: str) -> list[list[tuple[float, float, str]]]:
    """The operations after each flush, up to the next flush; the flush itself leads each list."""
    calls = []
    for op in ops:
        if op[2] == flush_name:
            calls.append([op])
        elif calls:
            calls[-1].append(op)
    return calls


def _graph_ms(fn, gpu, torch, reps: int) -> tuple[float | None, str]:
    """Median time of ``fn`` captured in a CUDA graph and replayed (L2 flushed before each replay)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
    except Exception as exc:                                  # noqa: BLE001 - reported, not fatal
        torch.cuda.synchronize()
        return None, f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    times = []
    for _ in range(reps):
        start, end = gpu.event_pair()
        gpu.flush_l2()
        gpu.record(start)
        graph.replay()
        gpu.record(end)
        torch.cuda.synchronize()
        times.append(gpu.elapsed_ms(start, end))
    del graph
    return statistics.median(times), ""


def analyse(fn, gpu, torch, reps: int):
    """(summary dict, per-position rows) for the zero-argument call ``fn``."""
    for _ in range(3):                                        # compile, allocate, settle the caches
        fn()
    torch.cuda.synchronize()
    flush_ops = _profile(lambda: gpu.flush_l2(), torch)
    flush_name = flush_ops[-1][2]

    events, host = [], []

    def loop():
        pairs = [gpu.event_pair() for _ in range(reps)]
        for start, end in pairs:
            gpu.flush_l2()
            gpu.record(start)
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            gpu.record(end)
        torch.cuda.synchronize()
        events.extend(gpu.elapsed_ms(s, e) for s, e in pairs)

    loop()                                                    # the bench's figure, unprofiled
    events_ms, host_ms = statistics.median(events), 1e3 * statistics.median(host)
    calls = _calls(_profile(loop, torch), flush_name)[1:]     # the first call may wait for the host
    shapes = {tuple(op[2] for op in c[1:]) for c in calls}
    if len(shapes) != 1:
        raise RuntimeError(f"the calls launched different operations ({len(shapes)} sequences)")
    names = next(iter(shapes))
    rows = []
    for i, name in enumerate(names):
        durs = [c[i + 1][1] for c in calls]
        gaps = [c[i + 1][0] - (c[i][0] + c[i][1]) for c in calls]
        rows.append([i + 1, _short(name), statistics.mean(durs), statistics.mean(gaps)])
    spans = [(c[-1][0] + c[-1][1] - c[1][0]) / 1e3 for c in calls]
    busy = [sum(op[1] for op in c[1:]) / 1e3 for c in calls]
    graph_ms, why = _graph_ms(fn, gpu, torch, reps)
    summary = {"events ms": events_ms, "span ms": statistics.mean(spans), "busy ms": statistics.mean(busy),
               "graph ms": graph_ms if graph_ms is not None else why, "host ms": host_ms,
               "profiled calls": len(calls)}
    return summary, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdim", type=int, nargs="+", default=[64])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "fwdbwd"), default="fwdbwd")
    ap.add_argument("--impl", nargs="+", default=["flashnb-auto", "sdpa-flash"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)

    from bench.cases import sweep
    from bench.cli import _import_libraries
    from bench.gpu import Gpu
    from bench.impls import CaseData, all_impls, select

    libs = _import_libraries()
    torch = libs.torch
    gpu = Gpu(torch, libs.cupy)
    impls = select(all_impls(libs), args.impl)
    cases = sweep((args.dtype,), tuple(args.seqlens), tuple(args.headdim), tuple(bool(c) for c in args.causal))
    print(f"# {gpu.info().get('name')}, torch {torch.__version__}, pass {args.pass_}, {args.reps} calls per figure")
    for case in cases:
        data = CaseData(gpu, case, seed=0)
        for impl in impls:
            fn = impl.make(case, data, args.pass_)
            summary, rows = analyse(fn, gpu, torch, args.reps)
            print(f"\n## {case.label()}, {impl.name}")
            print(", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
            print(tabulate(rows, headers=["#", "operation", "mean us", "idle before, us"], floatfmt=".1f"))
            del fn
            gpu.release_cached_memory()


if __name__ == "__main__":
    main()
