"""Arrays in, arrays of the same kind out: NumPy, CuPy, PyTorch and Numba device arrays.

Every input is viewed as a Numba device array without a copy where the
library allows it (the CUDA array interface; strided views stay strided).
NumPy arrays are copied to the device and results copied back.  bfloat16 has
no CUDA-array-interface type code: the API converts bfloat16 tensors to
float32 copies for the SIMT kernels (see ``api``).
"""
from dataclasses import dataclass

import numpy as np
from numba import config, cuda

try:  # optional: accept and return PyTorch tensors
    import torch
except ImportError:  # pragma: no cover - torch is an optional extra
    torch = None
try:  # optional: accept and return CuPy arrays
    import cupy
except ImportError:  # pragma: no cover - cupy is an optional extra
    cupy = None

# Set by the test suite: every output buffer the API allocates is filled with NaN
# before the launch, so an element a kernel forgets to write fails the comparison.
POISON_OUTPUTS = False

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
SIMULATOR = bool(config.ENABLE_CUDASIM)


@dataclass(frozen=True)
class Kind:
    """Which library an argument came from, and its element type (``"bfloat16"`` included)."""
    lib: str      # "numpy", "cupy", "torch", "numba"
    dtype: str


def kind_of(x, name):
    """Classify ``x``; raise TypeError naming ``name`` for anything that is not a supported array."""
    if isinstance(x, np.ndarray):
        return Kind("numpy", x.dtype.name)
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cuda:
            raise TypeError(f"{name} is a CPU torch tensor; move it to a CUDA device (or pass a NumPy array)")
        return Kind("torch", str(x.dtype).replace("torch.", ""))
    if cupy is not None and isinstance(x, cupy.ndarray):
        return Kind("cupy", x.dtype.name)
    if _is_numba_device_array(x):
        return Kind("numba", np.dtype(x.dtype).name)
    if hasattr(x, "__cuda_array_interface__"):      # any other CUDA array: viewed as a Numba array
        return Kind("numba", np.dtype(x.__cuda_array_interface__["typestr"]).name)
    raise TypeError(f"{name} must be a NumPy, CuPy, PyTorch CUDA or Numba device array, got {type(x).__name__}")


def device_of(x):
    """The CUDA device ordinal an array lives on (None for NumPy arrays)."""
    if isinstance(x, np.ndarray):
        return None
    if torch is not None and isinstance(x, torch.Tensor):
        return x.device.index
    if cupy is not None and isinstance(x, cupy.ndarray):
        return x.device.id
    return None


def to_device(x, stream):
    """A Numba device array viewing ``x`` (NumPy: a copy to the device; booleans as uint8)."""
    if isinstance(x, np.ndarray):
        if x.dtype == np.bool_:
            x = x.view(np.uint8)
        # the copy to the device needs one contiguous buffer: a strided NumPy view is packed first
        return cuda.to_device(np.ascontiguousarray(x), stream=stream)
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            x = x.view(torch.uint8)
        return cuda.as_cuda_array(x.detach())
    if cupy is not None and isinstance(x, cupy.ndarray) and x.dtype == np.bool_:
        x = x.view(np.uint8)
    if _is_numba_device_array(x):
        return x
    return cuda.as_cuda_array(x)


def to_device_bits(x, stream):
    """Like ``to_device``, but 16-bit float arrays as ``int16`` bit patterns (bfloat16 has no other route)."""
    if torch is not None and isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return cuda.as_cuda_array(x.detach().view(torch.int16))
    return to_device(x, stream)


def word_view(d):
    """A ``uint32`` view of a 16-bit device array, two neighbours of the last axis per word; no copy.

    None where the layout does not allow it: an odd last axis, a last axis that
    is not contiguous, a stride or base address that is not a multiple of 4 bytes.
    """
    shape, strides = tuple(d.shape), tuple(d.strides)
    if shape[-1] % 2 or strides[-1] != 2:
        return None
    words = shape[:-1] + (shape[-1] // 2,)
    # a size-1 dimension's stride is never used: any multiple of 4 will do
    wstrides = tuple(4 if n == 1 else s for n, s in zip(shape[:-1], strides[:-1])) + (4,)
    if any(s % 4 for s in wstrides):
        return None
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        ary = d._ary
        return FakeCUDAArray(ary.view(np.uint32)) if ary.ctypes.data % 4 == 0 else None
    if 0 in shape:
        return cuda.device_array(words, np.uint32)        # nothing is read from it
    ptr = d.__cuda_array_interface__["data"][0]
    if ptr % 4:
        return None
    desc = dict(shape=words, strides=wstrides, typestr="<u4", data=(ptr, False), version=3)
    return cuda.from_cuda_array_interface(desc, owner=d, sync=False)


def rows_aligned16(w):
    """True iff every row (last axis) of the device array ``w`` starts on a 16-byte boundary and fills 16-byte chunks."""
    shape, strides = tuple(w.shape), tuple(w.strides)
    if w.dtype.itemsize * shape[-1] % 16:
        return False
    if any(s % 16 for n, s in zip(shape[:-1], strides[:-1]) if n > 1):
        return False
    ptr = w._ary.ctypes.data if SIMULATOR else w.__cuda_array_interface__["data"][0]
    return ptr % 16 == 0


def _is_numba_device_array(x):
    """A Numba device array (or the simulator's stand-in): both carry ``__cuda_ndarray__ = True``."""
    return getattr(x, "__cuda_ndarray__", False) is True


def empty_like_kind(kind, shape, dtype, like, stream, bits=False):
    """(array returned to the caller, its Numba device view) of ``shape`` and ``dtype`` in ``kind.lib``.

    ``bits``: a 16-bit float tensor's view is of its bit patterns (``to_device_bits``).
    """
    if kind.lib == "torch":
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
        if POISON_OUTPUTS:
            t.fill_(float("nan"))
        return t, (to_device_bits if bits else to_device)(t, stream)
    if kind.lib == "cupy":
        with cupy.cuda.Device(like.device.id):
            c = cupy.full(shape, np.nan, dtype=dtype) if POISON_OUTPUTS else cupy.empty(shape, dtype=dtype)
        return c, cuda.as_cuda_array(c)
    if dtype == "bfloat16":
        raise TypeError("bfloat16 is only available through PyTorch tensors")
    if POISON_OUTPUTS:
        d = cuda.to_device(np.full(shape, np.nan, dtype=dtype), stream=stream)
    else:
        d = cuda.device_array(shape, dtype=dtype, stream=stream)
    return d, d


def finish(kind, returned, device_view, stream):
    """The value handed back: NumPy results are copied to the host, others returned as they are."""
    if kind.lib == "numpy":
        return device_view.copy_to_host(stream=stream)
    return returned


def resolve_stream(stream, kind):
    """A Numba stream for the launch: the one given, else the caller's library's current stream."""
    if stream is not None:
        if isinstance(stream, int):
            return cuda.external_stream(stream)
        if hasattr(stream, "cuda_stream"):                 # torch.cuda.Stream
            return cuda.external_stream(stream.cuda_stream)
        if cupy is not None and isinstance(stream, cupy.cuda.Stream):
            return cuda.external_stream(stream.ptr)
        if isinstance(stream, type(cuda.default_stream())):  # a Numba stream (the simulator's too)
            return stream
        raise TypeError(f"stream must be a Numba, CuPy or PyTorch stream or a raw CUstream int, got {type(stream).__name__}")
    if kind.lib == "torch":
        return cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    if kind.lib == "cupy":
        ptr = cupy.cuda.get_current_stream().ptr
        return cuda.external_stream(ptr) if ptr else cuda.default_stream()
    return cuda.default_stream()
