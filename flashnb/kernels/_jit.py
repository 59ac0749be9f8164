"""Compilation and launch helpers shared by the kernel factories.

The same kernel source runs on a real GPU and in Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``).  The simulator's ``jit`` rejects some options
(``forceinline``, ``lineinfo``, ``launch_bounds``) and has no warp shuffles, so
the options are filtered here and the few device helpers that need a shuffle
get a shared-memory twin (see ``_tiles.make_row_allreduce``).

On a GPU, ``launch`` does not go through Numba's kernel dispatcher: a call of
``kernel[grid, block, stream, shared](*args)`` types every argument, looks up
the specialisation and turns each array into ctypes values, about 100 us for
the forward's 21 arguments (bench/results/h100-host-2026-11-22.md).  Here the
arguments arrive as ``View`` objects (an array's address, shape and strides,
read once from the caller's array) and plain scalars; a tuple of their types
keys a cache of compiled specialisations (compiled by Numba on first use,
``Dispatcher.compile``), their values are packed into one buffer with
``struct`` in Numba's parameter layout (an array is ``meminfo, parent, nitems,
itemsize, data, shape..., strides...``: ``_Kernel._prepare_args`` in
numba-cuda 0.30) and ``cuLaunchKernel`` starts the kernel.  Two numba-cuda
internals are relied on, both here: that parameter layout, and
``_codelibrary.get_cufunc()`` for the compiled kernel's handle.
"""
import struct
import warnings

import numpy as np
from numba import config, cuda
from numba.core.errors import NumbaPerformanceWarning

SIMULATOR = bool(config.ENABLE_CUDASIM)


def device_function(fn):
    """A device helper, inlined into its caller on the GPU (its local arrays then stay in registers)."""
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def kernel(fn):
    """A kernel; lazily compiled per argument types by Numba's dispatcher."""
    return cuda.jit(fn)


class View:
    """A device array as a kernel parameter: ``ptr`` (device address), ``shape``, ``strides`` (bytes),
    ``dtype`` (a NumPy dtype); ``owner`` keeps the memory alive while the view is in use.

    ``key`` (dtype, ndim, C-contiguous) selects the compiled specialisation (Numba's array
    type: layout "C" or "A"); ``params`` are the values of its kernel parameters.
    ``__cuda_array_interface__`` lets PyTorch, CuPy and Numba read it.
    """
    __slots__ = ("ptr", "shape", "strides", "dtype", "owner", "key", "params")

    def __init__(self, ptr, shape, strides, dtype, owner):
        self.ptr, self.shape, self.strides, self.dtype, self.owner = int(ptr), shape, strides, dtype, owner
        size, step, contiguous = 1, dtype.itemsize, True
        for n, s in zip(reversed(shape), reversed(strides)):
            if n != 1 and s != step:
                contiguous = False
            step *= n
            size *= n
        self.key = (dtype, len(shape), contiguous)
        self.params = (0, 0, size, dtype.itemsize, self.ptr) + shape + strides

    @classmethod
    def of(cls, ary, owner=None):
        """The view of anything with a ``__cuda_array_interface__`` (a Numba device array, say)."""
        cai = ary.__cuda_array_interface__
        dtype, shape = np.dtype(cai["typestr"]), tuple(int(n) for n in cai["shape"])
        strides = cai.get("strides") or c_strides(shape, dtype.itemsize)
        return cls(cai["data"][0] or 0, shape, tuple(int(s) for s in strides), dtype, ary if owner is None else owner)

    @property
    def nbytes(self):
        return self.params[2] * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "strides": self.strides, "typestr": self.dtype.str,
                "data": (self.ptr, False), "version": 3}


def c_strides(shape, itemsize):
    """Byte strides of a C-contiguous array."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


LAUNCHED = {}    # id -> (kernel, threads, dynamic shared bytes) of every kernel launched: resource reports
_compiled = {}   # (kernel, argument key) -> (compiled overload, struct format, words of values, parameter offsets)
_handles = {}    # (compiled overload, CUDA context) -> kernel handle
_shared = {}     # (kernel handle, device) -> dynamic shared bytes allowed
_capability = {} # CUDA context -> compute capability of its device
_shared_limit = {}  # CUDA context -> dynamic shared bytes a block of its device may opt into


def launch(kern, grid, block, stream, shared_bytes, args):
    """Launch ``kern`` on a 1-D ``grid`` of 1-D ``block``s on ``stream`` (an ``_arrays.Stream``) with
    ``shared_bytes`` of dynamic shared memory (above 48 KB the kernel's limit is raised first).

    ``args``: ``View``s, Numba device arrays, Python ints (int64), NumPy float32 / float64 scalars.
    """
    if SIMULATOR:
        kern[grid, block, stream.numba, shared_bytes](*args)
        return
    key, values = _flatten(kern, args)
    entry = _compiled.get((kern, key))
    if entry is None:
        entry = _compiled[kern, key] = _compile(kern, key)
    overload, fmt, nwords, offsets = entry
    drv = _driver()
    context = current_context()
    handle = _handles.get((overload, context))
    if handle is None:                                         # Numba loads the module into this context
        handle = _handles[overload, context] = overload._codelibrary.get_cufunc().handle
    if shared_bytes > 48 * 1024:
        _allow_shared(handle, shared_bytes)
    LAUNCHED[id(kern)] = (kern, block, shared_bytes)
    buf = np.empty(nwords + len(offsets), np.uint64)           # values, then a pointer to each parameter
    struct.pack_into(fmt, buf, 0, *values)
    base = buf.__array_interface__["data"][0]
    buf[nwords:] = offsets + np.uint64(base)
    (err,) = drv.cuLaunchKernel(handle, grid, 1, 1, block, 1, 1, shared_bytes, stream.handle, base + 8 * nwords, 0)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernel of {kern.py_func.__name__} (grid {grid}, block {block}, "
                           f"{shared_bytes} bytes of shared memory) failed: {err!r}")


_FORMATS = {int: "q", np.float32: "f", np.float64: "d", float: "d", bool: "?"}


def _flatten(kern, args):
    """(argument key, parameter values) of a launch's arguments."""
    key, values = [], []
    for i, a in enumerate(args):
        if type(a) is not View and getattr(a, "__cuda_ndarray__", False) is True:
            a = View.of(a)                                     # a Numba device array
        if type(a) is View:
            key.append(a.key)
            values.extend(a.params)
        elif type(a) in _FORMATS:
            key.append(type(a))
            values.append(a)
        else:
            raise TypeError(f"argument {i} of kernel {kern.py_func.__name__} has type {type(a).__name__}; "
                            "expected a View, a Numba device array, an int or a NumPy float32/float64")
    return tuple(key), values


def _compile(kern, key):
    """Compile ``kern`` for the argument key; the struct format and parameter offsets of its launch."""
    from numba.cuda import types
    from numba.cuda.np.numpy_support import from_dtype
    scalar = {int: types.int64, np.float32: types.float32, np.float64: types.float64, float: types.float64,
              bool: types.boolean}
    argtypes, chars = [], []
    for k in key:
        if isinstance(k, tuple):
            dtype, ndim, contiguous = k
            argtypes.append(types.Array(from_dtype(dtype), ndim, "C" if contiguous else "A"))
            chars += ["q", "q", "q", "q", "Q"] + ["q"] * (2 * ndim)
        else:
            argtypes.append(scalar[k])
            chars.append(_FORMATS[k])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaPerformanceWarning)
        overload = kern.compile(tuple(argtypes))
    fmt = "@" + "".join(chars)
    offsets = [struct.calcsize("@" + "".join(chars[:i + 1])) - struct.calcsize(c) for i, c in enumerate(chars)]
    return overload, fmt, -(-struct.calcsize(fmt) // 8), np.array(offsets, np.uint64)


def compute_capability():
    """The compute capability of the current device (cached per CUDA context)."""
    if SIMULATOR:
        return cuda.get_current_device().compute_capability
    context = current_context()
    cc = _capability.get(context)
    if cc is None:
        cc = _capability[context] = cuda.get_current_device().compute_capability
    return cc


def shared_limit():
    """Bytes of dynamic shared memory one block may opt into on the current device (cached per CUDA
    context): 227 KB on compute capability 9.0, 163 KB on 8.0, 99 KB on 8.6 / 8.9; None in the simulator."""
    if SIMULATOR:
        return None
    context = current_context()
    limit = _shared_limit.get(context)
    if limit is None:
        limit = _shared_limit[context] = int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    return limit


def current_context():
    """The handle (an int) of this thread's current CUDA context; Numba's is made current if there is none."""
    context = int(_driver().cuCtxGetCurrent()[1])
    if context == 0:
        cuda.current_context()
        context = int(_driver().cuCtxGetCurrent()[1])
    return context


def _driver():
    from cuda.bindings import driver
    return driver


def _allow_shared(handle, nbytes):
    """Allow ``nbytes`` (> 48 KB) of dynamic shared memory for the kernel ``handle`` on the current device.

    CUDA refuses a launch asking for more than 48 KB of dynamic shared memory
    unless the kernel's ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` attribute was raised first.
    """
    drv = _driver()
    err, device = drv.cuCtxGetDevice()
    key = (int(handle), int(device))
    if _shared.get(key, 0) >= nbytes:
        return
    (err,) = drv.cuKernelSetAttribute(drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      nbytes, handle, device)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes}) failed: {err}")
    _shared[key] = nbytes


def memset_zero(view, stream):
    """Zero a contiguous device array whose size is a multiple of 4 bytes, on ``stream``."""
    if SIMULATOR:
        view.copy_to_device(np.zeros(view.shape, view.dtype), stream=stream.numba)
        return
    if not view.key[2] or view.nbytes % 4:
        raise ValueError(f"memset_zero needs a contiguous array of whole 32-bit words, got {view.shape}, {view.dtype}")
    (err,) = _driver().cuMemsetD32Async(view.ptr, 0, view.nbytes // 4, stream.handle)
    if err != 0:
        raise RuntimeError(f"cuMemsetD32Async failed: {err!r}")
