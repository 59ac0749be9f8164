"""Arrays in, arrays of the same kind out: NumPy, CuPy, PyTorch and Numba device arrays.

On a GPU every input is described to the kernels as a ``View`` -- its device
address, shape, byte strides and element type -- read straight from the
caller's array with no copy and no Numba object (strided views stay strided);
``kernels._jit.launch`` turns views into kernel parameters.  NumPy arrays are
copied to the device (a Numba device array behind the view) and results copied
back.  In Numba's CUDA simulator the kernels are Python functions over array
objects, so there the same functions return the simulator's device arrays
instead of views.  bfloat16 has no CUDA-array-interface type code: the
tensor-core path views bfloat16 tensors as ``int16`` bit patterns, the SIMT
kernels take float32 copies (see ``api``).
"""
import contextlib
from typing import NamedTuple

import numpy as np
from numba import config, cuda

from .kernels._jit import RECORDING, View, c_strides, current_context

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


class Kind(NamedTuple):
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
        return Kind("torch", _torch_dtype_name(x.dtype))
    if cupy is not None and isinstance(x, cupy.ndarray):
        return Kind("cupy", x.dtype.name)
    if _is_numba_device_array(x):
        return Kind("numba", np.dtype(x.dtype).name)
    if hasattr(x, "__cuda_array_interface__"):      # any other CUDA array: viewed as a Numba array
        return Kind("numba", np.dtype(x.__cuda_array_interface__["typestr"]).name)
    raise TypeError(f"{name} must be a NumPy, CuPy, PyTorch CUDA or Numba device array, got {type(x).__name__}")


_TORCH_NAMES = {}  # torch dtype -> its name ("float16", "bfloat16", ...)


def _torch_dtype_name(torch_dtype):
    name = _TORCH_NAMES.get(torch_dtype)
    if name is None:
        name = _TORCH_NAMES[torch_dtype] = str(torch_dtype).replace("torch.", "")
    return name


def device_of(x):
    """The CUDA device ordinal an array lives on (None for NumPy arrays)."""
    if isinstance(x, np.ndarray):
        return None
    if torch is not None and isinstance(x, torch.Tensor):
        return x.device.index
    if cupy is not None and isinstance(x, cupy.ndarray):
        return x.device.id
    return None


def check_device(x, name):
    """ValueError unless ``x`` (a CuPy or PyTorch array) is on the device whose context is current: the
    kernels run there (PyTorch and CuPy make their current device's context current; with none current,
    Numba's is made so)."""
    dev = device_of(x)
    if dev is None or SIMULATOR:
        return
    current_context()
    from cuda.bindings import driver
    err, current = driver.cuCtxGetDevice()
    if err != 0 or int(current) != dev:
        where = f"the current device is {int(current)}" if err == 0 else f"no device is current ({err!r})"
        raise ValueError(f"{name} is on CUDA device {dev} but {where}; "
                         f"call under torch.cuda.device({dev}) / cupy.cuda.Device({dev})")


def check_same_device(x, name, like):
    """ValueError if ``x`` (None or an array) lives on another CUDA device than ``like``."""
    if x is None:
        return
    dev = device_of(x)
    if dev is not None and dev != device_of(like):
        raise ValueError(f"{name} is on CUDA device {dev} but q is on {device_of(like)}; pass arrays of one device")


def to_device(x, stream):
    """The kernels' view of ``x`` (GPU: a ``View``; simulator: a device array); NumPy arrays are copied to the
    device, booleans are viewed as uint8."""
    if isinstance(x, np.ndarray):
        if x.dtype == np.bool_:
            x = x.view(np.uint8)
        # the copy to the device needs one contiguous buffer: a strided NumPy view is packed first
        d = cuda.to_device(np.ascontiguousarray(x), stream=stream.numba)
        return d if SIMULATOR else View.of(d)
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            x = x.view(torch.uint8)
        return _torch_view(x, x.dtype)
    if cupy is not None and isinstance(x, cupy.ndarray) and x.dtype == np.bool_:
        x = x.view(np.uint8)
    if SIMULATOR:
        return x if _is_numba_device_array(x) else cuda.as_cuda_array(x)
    if not _is_numba_device_array(x):
        _wait_for_producer(x, stream)
    return View.of(x)


def _wait_for_producer(x, stream):
    """The CUDA array interface's ``stream``: the exporter's work on ``x`` may still be queued there; a
    launch on another stream waits for it (Numba's ``as_cuda_array`` synchronised that stream too)."""
    producer = x.__cuda_array_interface__.get("stream")
    if producer is None:
        return
    producer = 0 if producer == 1 else int(producer)    # 1: the legacy default stream, handle 0 here
    if producer != stream.handle:
        from cuda.bindings import driver
        (err,) = driver.cuStreamSynchronize(producer)
        if err != 0:
            raise RuntimeError(f"cuStreamSynchronize of the array's stream failed: {err!r}")


def to_device_bits(x, stream):
    """Like ``to_device``, but 16-bit float tensors as ``int16`` bit patterns (bfloat16 has no other route)."""
    if torch is not None and isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return _torch_view(x, torch.int16)
    return to_device(x, stream)


def _torch_view(t, dtype):
    """A PyTorch CUDA tensor's view with element type ``dtype`` (a torch dtype of the tensor's element size)."""
    if SIMULATOR:                                          # pragma: no cover - no CUDA tensors in the simulator
        return cuda.as_cuda_array(t.detach().view(dtype))
    item = t.element_size()
    return View(t.data_ptr(), tuple(t.shape), tuple(s * item for s in t.stride()), _np_dtype(dtype), t)


_NP_DTYPES = {}   # torch dtype -> NumPy dtype


def _np_dtype(torch_dtype):
    dtype = _NP_DTYPES.get(torch_dtype)
    if dtype is None:
        if torch_dtype == torch.bfloat16:
            raise TypeError("bfloat16 tensors reach the kernels as int16 bit patterns or float32 copies")
        dtype = _NP_DTYPES[torch_dtype] = np.dtype(str(torch_dtype).replace("torch.", ""))
    return dtype


_U32 = np.dtype(np.uint32)


def word_view(d):
    """A ``uint32`` view of a 16-bit device array, two neighbours of the last axis per word (of a 32-bit one, each
    value's bits; of a byte array, four neighbours: the FP8 forward's e4m3 codes); no copy.

    None where the layout does not allow it: an odd last axis (16-bit), a last axis that
    is not contiguous, a stride or base address that is not a multiple of 4 bytes.
    """
    shape, strides = tuple(d.shape), tuple(d.strides)
    item = np.dtype(d.dtype).itemsize
    if item not in (1, 2, 4):
        return None
    per = 4 // item                                    # values per word: 4, 2 or 1
    words = shape[:-1] + (shape[-1] // per,)
    if 0 in shape and shape[-1] % per == 0:            # nothing is read from it (its strides may be anything)
        if SIMULATOR:
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
            return FakeCUDAArray(np.empty(words, np.uint32))
        return View(0, words, c_strides(words, 4), _U32, None)
    if shape[-1] % per or strides[-1] != item:
        return None
    # a size-1 dimension's stride is never used: any multiple of 4 will do
    wstrides = tuple(4 if n == 1 else s for n, s in zip(shape[:-1], strides[:-1])) + (4,)
    if any(s % 4 for s in wstrides):
        return None
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        ary = d._ary
        return FakeCUDAArray(ary.view(np.uint32)) if ary.ctypes.data % 4 == 0 else None
    if d.ptr % 4:
        return None
    return View(d.ptr, words, wstrides, _U32, d.owner)


def has_word_view(x, stream):
    """Whether ``word_view(to_device_bits(x, stream))`` would give a view (not None), without making it: a PyTorch
    CUDA tensor of 16-bit floats is answered from its shape, strides and address (a routed call asks before the
    kernels' path makes the views it launches with)."""
    if (torch is not None and type(x) is torch.Tensor and not SIMULATOR and x.dtype in (torch.float16, torch.bfloat16)
            and x.is_cuda):
        shape = x.shape
        if 0 in shape:
            return shape[-1] % 2 == 0
        if shape[-1] % 2 or x.stride(-1) != 1 or x.data_ptr() % 4:
            return False
        return all(n == 1 or s % 2 == 0 for n, s in zip(shape[:-1], x.stride()[:-1]))
    return word_view(to_device_bits(x, stream)) is not None


def flat(d):
    """The 1-D view of a C-contiguous device array (the kernels' view): the same memory, one index."""
    n = int(np.prod(d.shape, dtype=np.int64))
    contiguous = d._ary.flags.c_contiguous if SIMULATOR else d.key[2]
    if not contiguous:                # a reshape would copy: the kernel's writes would be lost
        raise ValueError(f"flat needs a C-contiguous array, got shape {d.shape}, strides {d.strides}")
    if SIMULATOR:
        return d.reshape(n)
    return View(d.ptr, (n,), (d.dtype.itemsize,), d.dtype, d.owner)


def strided_view(d, shape, strides):
    """A view of device array ``d``'s memory with ``shape`` and byte ``strides`` (a permutation of its axes, a
    stride-0 axis): no copy."""
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(np.lib.stride_tricks.as_strided(d._ary, tuple(shape), tuple(strides)))
    d = d if type(d) is View else View.of(d)
    return View(d.ptr, tuple(shape), tuple(strides), d.dtype, d.owner)


def any_layout(d):
    """``d`` as a kernel argument of Numba's layout "A" whatever its strides, so contiguous and broadcast views
    share one compiled specialisation (the simulator types arrays itself)."""
    if SIMULATOR:
        return d
    d = d if type(d) is View else View.of(d)
    v = View(d.ptr, d.shape, d.strides, d.dtype, d.owner)
    v.key = (d.dtype, len(d.shape), False)
    return v


def rows_aligned16(w):
    """True iff every row (last axis) of the device array ``w`` starts on a 16-byte boundary and fills 16-byte chunks."""
    shape, strides = tuple(w.shape), tuple(w.strides)
    if w.dtype.itemsize * shape[-1] % 16:
        return False
    if any(s % 16 for n, s in zip(shape[:-1], strides[:-1]) if n > 1):
        return False
    ptr = w._ary.ctypes.data if SIMULATOR else w.ptr
    return ptr % 16 == 0


def _is_numba_device_array(x):
    """A Numba device array (or the simulator's stand-in): both carry ``__cuda_ndarray__ = True``."""
    return getattr(x, "__cuda_ndarray__", False) is True


def empty_like_kind(kind, shape, dtype, like, stream, bits=False):
    """(array returned to the caller, the kernels' view of it) of ``shape`` and ``dtype`` in ``kind.lib``.

    ``bits``: a 16-bit float tensor's view is of its bit patterns (``to_device_bits``).
    """
    returned, view = _empty_like_kind(kind, shape, dtype, like, stream, bits)
    recorder = getattr(RECORDING, "recorder", None)
    if recorder is not None:
        recorder.note_alloc(returned, view, shape, dtype, like)
    return returned, view


def _empty_like_kind(kind, shape, dtype, like, stream, bits=False):
    if kind.lib == "torch":
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
        if POISON_OUTPUTS:
            t.fill_(float("nan"))
        # bfloat16 has no NumPy type: its view is of bit patterns (the SIMT kernels write a float32 copy instead)
        return t, (to_device_bits if bits or dtype == "bfloat16" else to_device)(t, stream)
    if kind.lib == "cupy":
        with cupy.cuda.Device(like.device.id):
            c = cupy.full(shape, np.nan, dtype=dtype) if POISON_OUTPUTS else cupy.empty(shape, dtype=dtype)
        return c, to_device(c, stream)
    if dtype == "bfloat16":
        raise TypeError("bfloat16 is only available through PyTorch tensors")
    if POISON_OUTPUTS:
        d = cuda.to_device(np.full(shape, np.nan, dtype=dtype), stream=stream.numba)
    else:
        d = cuda.device_array(shape, dtype=dtype, stream=stream.numba)
    return d, (d if SIMULATOR else View.of(d))


def scratch(shape, dtype, kind, like, stream):
    """A temporary device array of one call (contents undefined): from the caller's library's stream-ordered
    allocator (no cudaMalloc) where the call runs on that library's current stream, else from Numba's."""
    if not SIMULATOR and stream.current and kind.lib == "torch":
        returned = torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name), device=like.device)
        view = to_device(returned, stream)
    elif not SIMULATOR and stream.current and kind.lib == "cupy":
        with cupy.cuda.Device(like.device.id):
            returned = cupy.empty(shape, dtype=dtype)
        view = to_device(returned, stream)
    else:
        returned = cuda.device_array(shape, dtype=dtype, stream=stream.numba)
        view = returned if SIMULATOR else View.of(returned)
    recorder = getattr(RECORDING, "recorder", None)
    if recorder is not None:
        recorder.note_alloc(returned, view, shape, dtype, like)
    return view


def finish(kind, returned, device_view, stream):
    """The value handed back: NumPy results are copied to the host, others returned as they are."""
    if kind.lib == "numpy":
        return returned.copy_to_host(stream=stream.numba)
    return returned


class Stream:
    """The stream a call runs on: ``handle`` (the raw ``CUstream``: launches, memsets), ``numba`` (a Numba
    stream for Numba's copies and allocations, made on first use) and ``current`` (it is the caller's
    library's current stream, whose allocator ``scratch`` may use)."""
    __slots__ = ("handle", "current", "_numba")

    def __init__(self, handle, current=False, numba=None):
        self.handle, self.current, self._numba = handle, current, numba

    @property
    def numba(self):
        if self._numba is None:
            self._numba = cuda.default_stream() if self.handle == 0 else cuda.external_stream(self.handle)
        return self._numba


def resolve_stream(stream, kind, like=None):
    """The ``Stream`` of a call: the one given (Numba, CuPy or PyTorch stream, or a raw ``CUstream`` int),
    else the current stream of the caller's library on ``like``'s device (Numba's default stream for NumPy
    and Numba arrays)."""
    if stream is None:
        return Stream(_library_stream(kind, like), current=True, numba=cuda.default_stream() if SIMULATOR else None)
    if isinstance(stream, type(cuda.default_stream())):    # a Numba stream (the simulator's too)
        return Stream(0 if SIMULATOR else int(stream.handle), numba=stream)
    if isinstance(stream, int) and not isinstance(stream, bool):
        handle = stream
    elif hasattr(stream, "cuda_stream"):                   # torch.cuda.Stream
        handle = stream.cuda_stream
    elif cupy is not None and isinstance(stream, cupy.cuda.Stream):
        handle = stream.ptr
    else:
        raise TypeError(f"stream must be a Numba, CuPy or PyTorch stream or a raw CUstream int, got {type(stream).__name__}")
    if SIMULATOR:
        return Stream(0, numba=cuda.external_stream(handle))
    return Stream(handle, current=handle == _library_stream(kind, like))


def stream_scope(stream, kind, like):
    """A context in which ``stream`` is the current stream of the caller's library (PyTorch, CuPy), so that
    the library's own work in a call (bfloat16 conversions, copies, allocations) is ordered with the
    kernels; a no-op when it already is."""
    if SIMULATOR or stream.current or kind.lib not in ("torch", "cupy"):
        return _NO_SCOPE
    stream.current = True                                   # inside the scope it is
    if kind.lib == "torch":
        return torch.cuda.stream(torch.cuda.ExternalStream(stream.handle, device=like.device))
    return cupy.cuda.ExternalStream(stream.handle)


_NO_SCOPE = contextlib.nullcontext()


def _library_stream(kind, like=None):
    """The raw handle of the current stream of ``kind``'s library on ``like``'s device (0: the default stream)."""
    if kind.lib == "torch":
        device = like.device.index if like is not None and like.device.index is not None else None
        try:                 # the raw handle, as Triton's launcher reads it: ~0.3 us, a Stream object ~8 us
            return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice() if device is None else device)
        except AttributeError:                            # pragma: no cover - a PyTorch without them
            return torch.cuda.current_stream(device).cuda_stream
    if kind.lib == "cupy":
        return cupy.cuda.get_current_stream().ptr
    return 0
