"""Compilation helpers shared by the kernel factories.

The same kernel source runs on a real GPU and in Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``).  The simulator's ``jit`` rejects some options
(``forceinline``, ``lineinfo``, ``launch_bounds``) and has no warp shuffles, so
the options are filtered here and the few device helpers that need a shuffle
get a shared-memory twin (see ``_tiles.make_row_allreduce``).
"""
import warnings

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


_raised = set()  # specialised dispatchers whose dynamic shared-memory limit is already raised
LAUNCHED = {}    # id -> (kernel, threads, dynamic shared bytes) of every kernel launched: resource reports


def launch(kern, grid, block, stream, shared_bytes, args):
    """Launch ``kern`` with ``shared_bytes`` of dynamic shared memory, raising the 48 KB limit if needed."""
    if SIMULATOR:
        kern[grid, block, stream, shared_bytes](*args)
        return
    if shared_bytes > 48 * 1024:
        kern = kern.specialize(*args)  # compiled (once) for these argument types
        if id(kern) not in _raised:
            _set_max_dynamic_shared(kern, shared_bytes)
            _raised.add(id(kern))
    LAUNCHED[id(kern)] = (kern, block, shared_bytes)
    with warnings.catch_warnings():
        # small problems give small grids; Numba's "under-utilization" warning is noise to a caller
        warnings.simplefilter("ignore", NumbaPerformanceWarning)
        kern[grid, block, stream, shared_bytes](*args)


def _set_max_dynamic_shared(kern, nbytes):
    """Allow ``nbytes`` (> 48 KB) of dynamic shared memory for the compiled ``kern``.

    CUDA refuses a launch asking for more than 48 KB of dynamic shared memory
    unless the function's ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` attribute was raised
    first.  numba-cuda has no public call for it; this helper isolates the one
    private access (``_codelibrary.get_cufunc()``), verified on numba-cuda 0.30.
    """
    from cuda.bindings import driver as drv

    device_id = cuda.get_current_device().id
    for overload in kern.overloads.values():
        handle = overload._codelibrary.get_cufunc().handle
        (err,) = drv.cuKernelSetAttribute(
            drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            nbytes, handle, device_id)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes}) failed: {err}")
