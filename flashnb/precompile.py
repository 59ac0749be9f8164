"""Compile the common kernel specialisations into the disk cache ahead of time.

    python -m flashnb.precompile [--dtypes float16,bfloat16,float32] [--headdims 64,128] [--jobs N]
    python -m flashnb.precompile --list        # the cache's entries
    python -m flashnb.precompile --clear       # delete them

Each (dtype, head dim, causal or not) runs one small forward and backward through ``flashnb.flash_attention``
and ``flash_attention_backward`` with the default tiles and backend, so exactly the kernels and argument
types a real call of that kind launches are compiled (or found) and stored: the tensor-core kernels for
float16 and bfloat16, the SIMT ones for float32.  The tiles depend on the head dim and the device, not on the
sequence lengths, so any later call of the same dtype, head dim and options on contiguous arrays loads them
from disk.  Strided arrays, options that change the kernels (masks, bias, ALiBi, softcap, dropout, windows,
``deterministic``, own tiles) and other head dims compile on their first call and are stored then.
bfloat16 runs on PyTorch CUDA tensors (skipped without them).  The cache's location and key:
``flashnb/kernels/_cache.py`` and docs/internals.md.

Numba compiles one kernel at a time per process (it holds the GIL), so the (dtype, head dim, causal) tasks run
in ``--jobs`` processes at once (default: one per task, up to the CPU count); the disk cache's atomic writes
make that safe.  ``precompile(tasks, jobs)`` is the same from Python (the benchmark calls it).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

DTYPES = ("float16", "bfloat16", "float32")
HEADDIMS = (64, 128)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flashnb.precompile",
                                 description="Compile the common kernel specialisations into flashnb's disk cache.")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated input dtypes (default: %(default)s)")
    ap.add_argument("--headdims", default=",".join(map(str, HEADDIMS)),
                    help="comma-separated head dims (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="processes compiling at once (default: one per task, up to the CPU count)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # DTYPE,HEADDIM,CAUSAL: a worker's task
    ap.add_argument("--list", action="store_true", help="list the cache's entries and exit")
    ap.add_argument("--clear", action="store_true", help="delete the cache's entries and exit")
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        ap.error(f"--dtypes: {bad} not among {list(DTYPES)}")
    try:
        headdims = [int(d) for d in args.headdims.split(",") if d.strip()]
    except ValueError:
        ap.error(f"--headdims must be comma-separated integers, got {args.headdims!r}")

    if args.one is not None:                  # a worker: one task, its log as one JSON line
        from numba import cuda
        from .kernels._jit import SIMULATOR
        if SIMULATOR or not cuda.is_available():
            print("no CUDA GPU (or the simulator): nothing to compile", file=sys.stderr)
            return 1
        dtype, d, causal = args.one.split(",")
        print(json.dumps(_task_rows(dtype, int(d), causal == "1")))
        return 0
    from .kernels import _cache
    directory = _cache.cache_dir()
    where = (f"from {_cache.ENV}" if os.environ.get(_cache.ENV, "").strip() else f"the default; {_cache.ENV} sets it")
    print(f"kernel cache: {directory if directory is not None else 'off'} ({where})")
    if args.clear:
        print(f"removed {_cache.clear()} entries")
    if args.list:
        _list(_cache)
    if args.list or args.clear:
        return 0
    if directory is None:
        print(f"the cache is off ({_cache.ENV}={_cache.OFF}): compiled kernels would not be kept; nothing done")
        return 1

    from numba import cuda
    from .kernels._jit import SIMULATOR
    if SIMULATOR:
        print("Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1): kernels are interpreted, not compiled; "
              "nothing to compile")
        return 0
    if not cuda.is_available():
        print("no CUDA GPU: nothing can be compiled for one here (run this on the machine that will use the cache)")
        return 1

    from tabulate import tabulate
    from .kernels._jit import _arch
    start = time.perf_counter()
    rows = precompile([(dtype, d, causal) for dtype in dtypes for d in headdims for causal in (False, True)],
                      args.jobs)
    print(f"target {_arch()}")
    print(tabulate(rows, headers="keys"))
    done = {how: sum(1 for r in rows if r["how"] == how) for how in sorted({r["how"] for r in rows}) if how}
    print(f"{', '.join(f'{n} {how}' for how, n in done.items())}; {time.perf_counter() - start:.1f} s in all")
    return 0


def precompile(tasks, jobs=0):
    """Compile (or find on disk) the kernels of each (dtype, head dim, causal) task: in this process with
    ``jobs == 1``, else in up to ``jobs`` worker processes at once (0: one per task, up to the CPU count).
    Returns one row per kernel (call, kernel, how, seconds, entry)."""
    tasks = list(tasks)
    jobs = jobs or min(len(tasks), os.cpu_count() or 1)
    if jobs <= 1:
        return [r for t in tasks for r in _task_rows(*t)]

    def work(task):
        dtype, d, causal = task
        done = subprocess.run([sys.executable, "-m", "flashnb.precompile", "--one", f"{dtype},{d},{int(causal)}"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
            return [dict(call=_what(dtype, d, causal), kernel="(worker failed)", how="failed", s="",
                         entry=tail[0][:120])]
        return json.loads(done.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(jobs) as pool:
        return [r for rows in pool.map(work, tasks) for r in rows]


def _what(dtype, d, causal):
    return f"{dtype} d={d}{' causal' if causal else ''}"


def _task_rows(dtype, d, causal):
    """Run one task here; its rows."""
    from .kernels import _cache
    what = _what(dtype, d, causal)
    before = len(_cache.log)
    t = time.perf_counter()
    skipped = _run(dtype, d, causal)
    seconds = time.perf_counter() - t
    if skipped:
        return [dict(call=what, kernel=skipped, how="skipped", s="", entry="")]
    rows = [dict(call=what, kernel=r["kernel"].replace("flashnb.kernels.", ""), how=r["how"], s=f"{r['seconds']:.2f}",
                 entry=r["entry"].name if r["entry"] is not None else "") for r in _cache.log[before:]]
    print(f"{what}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return rows or [dict(call=what, kernel="(all ready in this process)", how="", s=f"{seconds:.2f}", entry="")]


def _run(dtype, headdim, causal):
    """One small forward and backward of ``dtype`` at ``headdim``; a reason if it cannot run here, else None."""
    import flashnb
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, 128, 2, headdim)) for _ in range(4)]
    torch = None
    if dtype == "bfloat16":
        try:
            import torch
        except ImportError:
            return "bfloat16 needs PyTorch (CUDA tensors): skipped"
        if not torch.cuda.is_available():
            return "bfloat16 needs PyTorch with CUDA: skipped"
        arrays = [torch.tensor(a, dtype=torch.bfloat16, device="cuda") for a in arrays]
    else:
        arrays = [a.astype(dtype) for a in arrays]
    q, k, v, dout = arrays
    out, lse = flashnb.flash_attention(q, k, v, causal=causal, return_lse=True)
    flashnb.flash_attention_backward(dout, q, k, v, out, lse, causal=causal)
    if torch is not None:
        torch.cuda.synchronize()
    return None


def _list(cache):
    """Print the cache's entries: file, bytes, kernel, target, and whether it matches this installation."""
    from tabulate import tabulate
    current = {"sources": cache.source_hash(), **cache.toolchain()}
    rows = []
    for path, key, name, size in cache.entries():
        if key is None:
            rows.append(dict(entry=path.name, bytes=size, kernel="(unreadable: replaced on its next use)"))
            continue
        fields = dict(line.split(" ", 1) for line in key.splitlines()[1:] if " " in line)
        stale = sorted(k for k, v in current.items() if fields.get(k) != str(v))
        kernel = fields.get("kernel", "?").split(" jit(")[0].replace("flashnb.kernels.", "")
        rows.append(dict(entry=path.name, bytes=size, kernel=kernel,
                         arch=fields.get("arch", "?"), state="current" if not stale else "stale: " + ",".join(stale)))
    print(tabulate(rows, headers="keys") if rows else "no entries")


if __name__ == "__main__":
    sys.exit(main())
