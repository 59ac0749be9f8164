"""The pure-Python host time of a warm (dispatch-cache hit) call, without a GPU: per call and per layer.

CPU tensors stand in for CUDA ones (``cpu_as_gpu``: they say device 0 and ``is_cuda``, PyTorch's current device
and stream are 0, ``_jit.SIMULATOR`` is off so the replay takes the GPU's path), and the cache holds recordings in
the GPU's form made from the simulator's of the same calls (``gpu_recordings``: the same allocations, launches,
memsets and patched words), whose launches and memsets call libm's ``fegetround`` (which returns 0) through
``_dispatch._Driver`` in the driver's functions' place (ctypes' cost is paid, the driver's is not).  The stand-ins
are Python functions where PyTorch's are C ones, so the absolute numbers are slightly off (``stand-in`` below times
them); the GPU's own measure is ``python -m tools.torch_host_time``.

`NUMBA_ENABLE_CUDASIM=1 python -m tools.host_path_cpu` (the variable is set here if absent).
"""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import contextlib  # noqa: E402
import ctypes  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import cuda  # noqa: E402

import flashnb  # noqa: E402
import flashnb.torch as ft  # noqa: E402
from flashnb import _dispatch  # noqa: E402
from flashnb.kernels import _jit  # noqa: E402

SHAPE = (1, 16, 1, 64)


def gpu_recordings():
    """{op: Replay} (made under ``cpu_as_gpu``): the simulator's recordings of SHAPE's float16 forward (return_lse) and backward, each launch
    turned into the GPU's form (a parameter buffer of two words per argument, the arrays' addresses patched)."""
    _jit.SIMULATOR = True
    _dispatch.clear()
    rng = np.random.default_rng(0)
    q, k, v, do = (cuda.to_device(rng.standard_normal(SHAPE).astype(np.float16)) for _ in range(4))
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True)
    flashnb.flash_attention_backward(do, q, k, v, out, lse)
    _jit.SIMULATOR = False
    made = {}
    for key, rec in _dispatch._CACHE.items():
        allocs = [("torch", shape, torch.from_numpy(np.empty(0, dtype)).dtype, torch.device("cpu"))
                  for _, shape, dtype, _ in rec.allocs]
        steps = []
        for step in rec.steps:
            if step[0] == "memset":
                steps.append(step)
                continue
            _, kern, grid, block, shared, args, slots = step
            nwords = 2 * len(args)
            buf = np.zeros(nwords + len(args), np.uint64)
            params = buf.__array_interface__["data"][0] + 8 * nwords
            steps.append(("launch", 0, grid, block, shared, buf, params, tuple((2 * pos, tag) for pos, tag in slots)))
        made[key[0]] = _dispatch.Replay(allocs, steps, rec.outputs, rec.as_tuple)
    _dispatch.clear()
    return made


@contextlib.contextmanager
def cpu_as_gpu():
    """CPU tensors taken as device 0's, the replay on the GPU's path (see the module's docstring)."""
    saved = (torch.Tensor.__dict__.get("get_device"), torch.Tensor.__dict__.get("is_cuda"),
             torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream, _jit.SIMULATOR, _dispatch._libcuda)
    torch.Tensor.get_device = lambda self: 0
    torch.Tensor.is_cuda = property(lambda self: True)
    torch._C._cuda_getDevice = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    _jit.SIMULATOR = False
    _dispatch._libcuda = _dispatch._Driver(ctypes.CDLL("libm.so.6"), "fegetround", "fegetround")
    try:
        yield
    finally:
        for name, value in (("get_device", saved[0]), ("is_cuda", saved[1])):
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)
        torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream, _jit.SIMULATOR, _dispatch._libcuda = saved[2:]


@contextlib.contextmanager
def preloaded(recordings, calls):
    """The cache's first lookup of each op stores that op's recording (so the call hits); every
    ``_dispatch.cached_call`` is noted in ``calls`` as (op, arrays, scalars)."""
    lookup, cached_call = _dispatch.lookup, _dispatch.cached_call

    def storing_lookup(key):
        if key is not None and key not in _dispatch._CACHE:
            _dispatch._store(key, recordings[key[0]])
        return lookup(key)

    def noting_cached_call(op, arrays, scalars, full_call, cacheable=True, args=()):
        calls.append((op, arrays, scalars))
        return cached_call(op, arrays, scalars, full_call, cacheable, args)

    _dispatch.lookup, _dispatch.cached_call = storing_lookup, noting_cached_call
    try:
        yield
    finally:
        _dispatch.lookup, _dispatch.cached_call = lookup, cached_call


def per_call(f, n=2000, repeats=9):
    """(median, min) microseconds per call of ``f`` over ``repeats`` runs of ``n`` calls."""
    for _ in range(50):
        f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times), min(times)


def main():
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(SHAPE, dtype=torch.float16) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    with cpu_as_gpu():
        recordings = gpu_recordings()
        calls = []
        with preloaded(recordings, calls):
            out, lse = flashnb.flash_attention(q, k, v, return_lse=True)
            flashnb.flash_attention_backward(do, q, k, v, out, lse)
            with torch.no_grad():
                ft.flash_attn_func(q, k, v)
            ft.flash_attn_func(qg, kg, vg).backward(do)
        assert _dispatch.stats["hits"] == len(calls) == 5 and _dispatch.stats["misses"] == 0, (_dispatch.stats, calls)
        (_, fwd_arrays, fwd_scalars), (_, bwd_arrays, bwd_scalars) = calls[:2]
        fwd_rec, bwd_rec = recordings["forward"], recordings["backward"]
        _, fwd_ptrs = _dispatch.signature("forward", fwd_arrays, fwd_scalars)
        _, bwd_ptrs = _dispatch.signature("backward", bwd_arrays, bwd_scalars)

        def no_grad():
            with torch.no_grad():
                ft.flash_attn_func(q, k, v)

        rows = [
            ("forward: flashnb.flash_attention", lambda: flashnb.flash_attention(q, k, v, return_lse=True)),
            ("  cached_call", lambda: _dispatch.cached_call("forward", fwd_arrays, fwd_scalars, None)),
            ("  signature", lambda: _dispatch.signature("forward", fwd_arrays, fwd_scalars)),
            ("  replay", lambda: fwd_rec(fwd_arrays, fwd_ptrs)),
            ("backward: flashnb.flash_attention_backward",
             lambda: flashnb.flash_attention_backward(do, q, k, v, out, lse)),
            ("  cached_call", lambda: _dispatch.cached_call("backward", bwd_arrays, bwd_scalars, None)),
            ("  signature", lambda: _dispatch.signature("backward", bwd_arrays, bwd_scalars)),
            ("  replay", lambda: bwd_rec(bwd_arrays, bwd_ptrs)),
            ("flashnb.torch.flash_attn_func, no grad (under torch.no_grad())", no_grad),
            ("flashnb.torch.flash_attn_func, forward+backward", lambda: ft.flash_attn_func(qg, kg, vg).backward(do)),
            ("  (torch SDPA, no grad, CPU)", lambda: _sdpa_no_grad(q, k, v)),
            ("  (torch autograd alone: (q * 1).sum().backward())", lambda: (qg * 1).sum().backward()),
            ("stand-in: Tensor.get_device (a Python lambda here)", lambda: q.get_device()),
            ("stand-in: torch.empty((1, 16, 1, 64), float16, cpu)",
             lambda: torch.empty(SHAPE, dtype=torch.float16, device=torch.device("cpu"))),
        ]
        hits = _dispatch.stats["hits"]
        for name, f in rows:
            med, best = per_call(f)
            print(f"{name:<66} median {med:6.2f} us  (min {best:6.2f})", flush=True)
        assert _dispatch.stats["misses"] == 0 and _dispatch.stats["hits"] > hits
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}; dispatch cache: {_dispatch.stats}")


def _sdpa_no_grad(q, k, v):
    with torch.no_grad():
        torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))


if __name__ == "__main__":
    main()
