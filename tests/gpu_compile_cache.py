"""GPU smoke test of the disk cache of compiled kernels (flashnb/kernels/_cache.py) across processes.

    python tests/gpu_compile_cache.py              # a script: prints each process's report
    pytest -m gpu tests/gpu_compile_cache.py       # the same as one test (skipped in the simulator)

(Not a ``test_*`` module: pytest collects it only when named.)  Three fresh processes share a new, empty
``FLASHNB_CACHE_DIR`` and each run the same float16 causal forward and backward (tensor cores, head dim 128:
the forward asks for more than 48 KB of dynamic shared memory, so the raised limit is set on a disk-loaded
kernel too), timing the first calls:

1. compiles every kernel (forward, preprocess, dK/dV, cast) with Numba and stores each;
2. loads every kernel from disk and compiles none: ``_cache.counters``, no call of
   ``CUDADispatcher.compile`` (spied on), no overload in any launched Dispatcher; its results equal the first
   process's (``dq`` to float atomics' reordering: the tensor-core backward adds dQ with atomics);
3. after one entry's cubin had a byte flipped: compiles exactly that kernel, rewrites its entry, loads the
   others, and gets the same results.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

SHAPE = (2, 512, 4, 128)   # (batch, seqlen, heads, head dim)


def child(out_path):
    """One fresh process: the calls, then a JSON report on stdout and the results in ``out_path``."""
    from numba.cuda.dispatcher import CUDADispatcher
    compiles = []
    compile_ = CUDADispatcher.compile

    def spy(self, sig):
        compiles.append(self.py_func.__name__)
        return compile_(self, sig)

    CUDADispatcher.compile = spy
    t0 = time.perf_counter()
    import flashnb
    from flashnb.kernels import _cache, _jit
    t1 = time.perf_counter()
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal(SHAPE).astype(np.float16) for _ in range(4))
    t2 = time.perf_counter()
    out, lse = flashnb.flash_attention(q, k, v, causal=True, return_lse=True)
    t3 = time.perf_counter()
    dq, dk, dv = flashnb.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    t4 = time.perf_counter()
    flashnb.flash_attention_backward(dout, q, k, v, *flashnb.flash_attention(q, k, v, causal=True, return_lse=True),
                                     causal=True)
    t5 = time.perf_counter()
    np.savez(out_path, out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    print(json.dumps(dict(
        import_s=round(t1 - t0, 2), first_forward_s=round(t3 - t2, 2), first_backward_s=round(t4 - t3, 2),
        second_forward_backward_s=round(t5 - t4, 3), counters=_cache.counters, dispatcher_compiles=compiles,
        overloads=sum(len(kern.overloads) for kern, _, _ in _jit.LAUNCHED.values()),
        max_shared=max(shared for _, _, shared in _jit.LAUNCHED.values()),
        cache_dir=str(_cache.cache_dir()),
        log=[(r["kernel"].split("(")[0].rsplit(".", 1)[-1], r["how"], round(r["seconds"], 2)) for r in _cache.log])))


def _run(cache_dir, n):
    path = os.path.join(cache_dir, f"results-{n}.npz")
    env = dict(os.environ, FLASHNB_CACHE_DIR=os.path.join(cache_dir, "kernels"))
    done = subprocess.run([sys.executable, __file__, "--child", path], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"process {n} failed:\n{done.stdout}\n{done.stderr}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"process {n}: {json.dumps(report, indent=1)}", flush=True)
    return report, dict(np.load(path))


def _same_results(a, b, what):
    for name in ("out", "lse", "dk", "dv"):
        assert np.array_equal(a[name], b[name], equal_nan=True), f"{what}: {name} differs"
    scale = float(np.max(np.abs(a["dq"].astype(np.float32))))
    err = float(np.max(np.abs(a["dq"].astype(np.float32) - b["dq"].astype(np.float32))))
    assert err <= 2e-3 * scale + 1e-3, f"{what}: dq differs by {err} (max |dq| {scale})"


def check():
    with tempfile.TemporaryDirectory(prefix="flashnb-cache-smoke-") as d:
        first, r1 = _run(d, 1)
        c1 = first["counters"]
        assert c1["compiled"] >= 4 and c1["stored"] == c1["compiled"] and c1["loaded"] == 0, c1
        assert first["max_shared"] > 48 * 1024, first["max_shared"]

        second, r2 = _run(d, 2)
        c2 = second["counters"]
        assert c2["compiled"] == 0 and c2["loaded"] == c1["stored"] and c2["stored"] == 0, c2
        assert second["dispatcher_compiles"] == [] and second["overloads"] == 0, second
        _same_results(r1, r2, "process 2 (all from disk) against process 1 (compiled)")
        first_s = first["first_forward_s"] + first["first_backward_s"]
        second_s = second["first_forward_s"] + second["first_backward_s"]
        assert second_s < 0.5 * first_s, (first_s, second_s)

        entries = sorted(os.path.join(d, "kernels", f) for f in os.listdir(os.path.join(d, "kernels"))
                         if f.endswith(".kernel"))
        assert len(entries) == c1["stored"], entries
        with open(entries[0], "r+b") as f:                     # a byte of the cubin (near the end) flipped
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
        third, r3 = _run(d, 3)
        c3 = third["counters"]
        assert c3["rejected"] == 1 and c3["compiled"] == 1 and c3["stored"] == 1, c3
        assert c3["loaded"] == c1["stored"] - 1 and len(third["dispatcher_compiles"]) == 1, third
        _same_results(r1, r3, "process 3 (one recompiled) against process 1")
        from flashnb.kernels import _cache
        assert all(_cache.decode(open(p, "rb").read()) is not None for p in entries)
    print(f"disk cache across processes: first calls {first_s:.2f} s compiling {c1['compiled']} kernels, "
          f"{second_s:.2f} s loading them; a corrupted entry recompiled and replaced")


@pytest.mark.gpu
def test_kernels_compile_once_then_load_from_disk_in_new_processes():
    check()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    elif os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        sys.exit("tests/gpu_compile_cache.py needs a real GPU (NUMBA_ENABLE_CUDASIM=1 is set)")
    else:
        check()
