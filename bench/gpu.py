"""The few GPU operations the harness needs, done through PyTorch (preferred) or CuPy.

Everything the benchmark launches (PyTorch, CuPy, and flashnb's Numba kernels,
which run on the stream of the arrays they are given, else on the default
stream) goes to the legacy default stream, so a pair of CUDA events recorded
there brackets exactly the work of one call.

Peak extra device memory is the sum, over the three allocators that can be in
play, of (peak - usage at the start) during one call:

* PyTorch's caching allocator: ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats``;
* CuPy's memory pool: a ``cupy.cuda.MemoryHook`` that adds each block handed out
  and subtracts each block given back;
* Numba's allocations (``cuda.device_array`` and friends, should flashnb use
  them): a counting subclass of Numba's own memory manager, installed before
  Numba creates its context (``install_numba_memory_counter``).

Memory cached but not in use by an allocator is not counted: this is the
memory the computation needs, not what a pool happens to hold.  If two
allocators peak at different moments the sum is an upper bound.
"""
from __future__ import annotations

import contextlib
import gc
import weakref

MIB = 1 << 20
FLUSH_MIN_BYTES = 256 * MIB   # what triton.testing.do_bench clears; H100's L2 is 50 MB


class _Counter:
    """Bytes in use now, and the peak since the last ``start``."""

    def __init__(self):
        self.current = 0
        self.peak = 0
        self.base = 0

    def allocated(self, nbytes: int):
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def freed(self, nbytes: int):
        self.current -= nbytes

    def start(self):
        self.base = self.peak = self.current

    def extra(self) -> int:
        return max(0, self.peak - self.base)


NUMBA_COUNTER = _Counter()
_numba_counter_installed = False


def install_numba_memory_counter() -> str | None:
    """Count Numba's device allocations; returns None, or why it could not be done.

    Must run before Numba creates its CUDA context (before any flashnb call).
    """
    global _numba_counter_installed
    if _numba_counter_installed:
        return None
    try:
        try:
            from numba.cuda.core import config          # numba-cuda >= 0.2x keeps the CUDA settings here
        except ImportError:
            from numba.core import config
        if getattr(config, "CUDA_MEMORY_MANAGER", "default") != "default":
            return f"numba uses the external memory manager {config.CUDA_MEMORY_MANAGER}; its memory is not counted"
        from numba import cuda
        from numba.cuda.cudadrv.driver import NumbaCUDAMemoryManager

        class CountingNumbaMemoryManager(NumbaCUDAMemoryManager):
            """Numba's default manager, plus a count of the bytes each pointer holds until it dies."""

            def memalloc(self, size):
                mem = super().memalloc(size)
                NUMBA_COUNTER.allocated(size)
                weakref.finalize(mem, NUMBA_COUNTER.freed, size)
                return mem

        cuda.set_memory_manager(CountingNumbaMemoryManager)
    except Exception as exc:  # numba internals moved: the column then misses Numba's share
        return f"Numba's allocations are not counted ({type(exc).__name__}: {exc})"
    _numba_counter_installed = True
    return None


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the out-of-memory errors of PyTorch, CuPy and the CUDA driver (Numba)."""
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    if "OutOfMemoryError" in names:
        return True
    text = str(exc).lower()
    return any(m in text for m in ("out of memory", "cuda_error_out_of_memory", "cublas_status_alloc_failed"))


class Gpu:
    """Events, synchronisation, L2 flush, memory accounting and input data for one device.

    ``library`` is "torch" when PyTorch with CUDA is importable, else "cupy".
    """

    def __init__(self, torch=None, cupy=None):
        if torch is None and cupy is None:
            raise RuntimeError("timing needs PyTorch or CuPy to drive the GPU; neither is installed")
        self.torch = torch
        self.cupy = cupy
        self.library = "torch" if torch is not None else "cupy"
        self._flush_buffer = None
        self._cupy_hook = None

    # ---- device facts -------------------------------------------------------------
    def info(self) -> dict:
        info = {}
        if self.torch is not None:
            p = self.torch.cuda.get_device_properties(0)
            info.update(name=p.name, compute_capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                        memory=f"{p.total_memory / 2**30:.1f} GiB", l2_bytes=getattr(p, "L2_cache_size", 0),
                        cuda_runtime_torch=self.torch.version.cuda)
        if self.cupy is not None:
            rt = self.cupy.cuda.runtime
            v = rt.runtimeGetVersion()
            info["cuda_runtime_cupy"] = f"{v // 1000}.{(v % 1000) // 10}"
            if self.torch is None:
                p = rt.getDeviceProperties(0)
                name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
                info.update(name=name, compute_capability=f"{p['major']}.{p['minor']}",
                            sms=p["multiProcessorCount"], memory=f"{p['totalGlobalMem'] / 2**30:.1f} GiB",
                            l2_bytes=p.get("l2CacheSize", 0))
        if info.get("l2_bytes"):
            info["l2_cache"] = f"{info['l2_bytes'] / MIB:.0f} MiB"
        return info

    # ---- timing -------------------------------------------------------------------
    def synchronize(self):
        if self.torch is not None:
            self.torch.cuda.synchronize()
        if self.cupy is not None:
            self.cupy.cuda.runtime.deviceSynchronize()

    def event_pair(self):
        """(start, end) timing events; ``record(e)`` them, then ``elapsed_ms(start, end)``."""
        if self.library == "torch":
            return self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        return self.cupy.cuda.Event(), self.cupy.cuda.Event()

    def record(self, event):
        event.record()      # on the current stream: the default stream, see the module docstring

    def elapsed_ms(self, start, end) -> float:
        if self.library == "torch":
            return start.elapsed_time(end)
        return self.cupy.cuda.get_elapsed_time(start, end)

    def flush_l2(self):
        """Overwrite a buffer twice the L2 size (at least 256 MiB) so no input stays cached."""
        if self._flush_buffer is None:
            nbytes = max(FLUSH_MIN_BYTES, 2 * int(self.info().get("l2_bytes") or 0))
            if self.library == "torch":
                self._flush_buffer = self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda")
            else:
                self._flush_buffer = self.cupy.empty(nbytes, dtype=self.cupy.uint8)
        if self.library == "torch":
            self._flush_buffer.zero_()
        else:
            self._flush_buffer.fill(0)

    # ---- memory -------------------------------------------------------------------
    @contextlib.contextmanager
    def peak_extra_memory(self):
        """Yields a dict whose "bytes" is set, on exit, to the peak extra memory of the block."""
        result = {"bytes": None}
        self.synchronize()
        if self.torch is not None:
            self.torch.cuda.reset_peak_memory_stats()
            torch_base = self.torch.cuda.memory_allocated()
        NUMBA_COUNTER.start()
        hook = self._cupy_counting_hook()
        if hook is not None:
            hook.counter.start()
        with (hook if hook is not None else contextlib.nullcontext()):
            yield result
            self.synchronize()
        extra = NUMBA_COUNTER.extra()
        if self.torch is not None:
            extra += max(0, self.torch.cuda.max_memory_allocated() - torch_base)
        if hook is not None:
            extra += hook.counter.extra()
        result["bytes"] = extra

    def _cupy_counting_hook(self):
        if self.cupy is None:
            return None
        if self._cupy_hook is None:
            counter = _Counter()

            class CountingHook(self.cupy.cuda.MemoryHook):
                name = "flashnb_bench_peak"

                def malloc_postprocess(self, **kw):
                    if kw.get("mem_ptr"):
                        counter.allocated(kw["mem_size"])

                def free_postprocess(self, **kw):
                    counter.freed(kw["mem_size"])

            self._cupy_hook = CountingHook()
            self._cupy_hook.counter = counter
        return self._cupy_hook

    def release_cached_memory(self):
        """Give cached blocks back to the driver, so one library's cache cannot starve another."""
        gc.collect()
        if self.cupy is not None:
            self.cupy.get_default_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()
        with contextlib.suppress(Exception):
            import sys
            if "numba" in sys.modules:
                from numba import cuda
                cuda.current_context().deallocations.clear()

    def healthy(self) -> str | None:
        """None when the device still answers; the error otherwise (a sticky CUDA error)."""
        try:
            self.synchronize()
            return None
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    # ---- data ---------------------------------------------------------------------
    def randn(self, shape, dtype: str, seed: int):
        """Standard normal array of the primary library, generated on the device."""
        if self.library == "torch":
            g = self.torch.Generator(device="cuda")
            g.manual_seed(seed)
            return self.torch.randn(shape, generator=g, device="cuda", dtype=getattr(self.torch, dtype))
        x = self.cupy.random.default_rng(seed).standard_normal(shape, dtype="float32")
        return x.astype(self.cupy_dtype(dtype))

    def cupy_dtype(self, dtype: str):
        if dtype == "bfloat16":
            raise TypeError("CuPy has no bfloat16 arrays")
        return dtype
