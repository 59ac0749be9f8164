"""Arrays in, arrays of the same kind out: NumPy, CuPy, PyTorch and Numba device arrays.

Every input is viewed as a Numba device array without a copy where the
library allows it (the CUDA array interface; strided views stay strided).
NumPy arrays are copied to the device and results copied back.  bfloat16 has
no CUDA-array-interface type code: the API converts bfloat16 tensors to
float32 copies for the SIMT kernels (see ``api``).
"""
from dataclasses import dataclass

import numpy as np
from numba import cuda

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


def _is_numba_device_array(x):
    """A Numba device array (or the simulator's stand-in): both carry ``__cuda_ndarray__ = True``."""
    return getattr(x, "__cuda_ndarray__", False) is True


def empty_like_kind(kind, shape, dtype, like, stream):
    """(array returned to the caller, its Numba device view) of ``shape`` and ``dtype`` in ``kind.lib``."""
    if kind.lib == "torch":
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
        if POISON_OUTPUTS:
            t.fill_(float("nan"))
        return t, to_device(t, stream)
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
