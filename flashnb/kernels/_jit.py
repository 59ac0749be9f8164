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
numba-cuda 0.30) and ``cuLaunchKernel`` starts the kernel.  The numba-cuda
internals relied on are all here: that parameter layout,
``_codelibrary.get_cufunc()`` for the compiled kernel's handle, and for the disk
cache of compiled kernels (``_cache``; "disk cache" below) the code library's
``get_cubin()``, ``_entry_name`` and module-setup fields.
"""
import ctypes
import functools
import hashlib
import inspect
import itertools
import struct
import threading
import time
import types as pytypes
import warnings

import numpy as np
from numba import config, cuda
from numba.core.errors import NumbaPerformanceWarning
from numba.core.types import Type as NumbaType

from . import _cache

SIMULATOR = bool(config.ENABLE_CUDASIM)


def device_function(fn):
    """A device helper, inlined into its caller on the GPU (its local arrays then stay in registers)."""
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def unrolled(elem, shape):
    """A device function ``each(x0, x1, ...)`` that calls the device function ``elem(i, j, k, x0, x1, ...)`` for
    every index ``(i, j, k)`` of ``shape``, written out with the indices as literals.  For an element step too
    long for LLVM to unroll a loop over (a score_mod's ``tanh``): in a loop, a local array indexed at a run-time
    index lives in local memory for the whole kernel; written out, every index is a constant and the array stays
    in registers."""
    args = ", ".join(f"x{i}" for i in range(elem.py_func.__code__.co_argcount - len(shape)))
    lines = [f"def each({args}):"]
    lines += [f"    elem({', '.join(map(str, idx))}, {args})" for idx in itertools.product(*map(range, shape))]
    space = {}
    exec(compile("\n".join(lines), f"<unrolled over {shape}>", "exec"), {"elem": elem}, space)
    return device_function(space["each"])


def kernel(fn=None, *, min_blocks=None, threads=None):
    """A kernel; lazily compiled per argument types by Numba's dispatcher.  ``kernel(min_blocks=B,
    threads=T)``: with launch bounds (``.maxntid T``, ``.minnctapersm B``: ptxas keeps the registers to what B
    blocks of T threads an SM leave; the simulator takes no launch bounds)."""
    if fn is None:
        return lambda f: kernel(f, min_blocks=min_blocks, threads=threads)
    if min_blocks and not SIMULATOR:
        return cuda.jit(launch_bounds=(threads, min_blocks))(fn)
    return cuda.jit(fn)


def device_address(x):
    """The device address of a ``View``, a Numba device array or the simulator's stand-in for one."""
    if type(x) is View:
        return x.ptr
    if SIMULATOR:
        return x._ary.__array_interface__["data"][0]
    return int(x.__cuda_array_interface__["data"][0] or 0)


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
_compiled = {}   # (kernel, argument key) -> (Numba's overload or a DiskKernel, struct format, words of values,
                 #                            parameter offsets)
_handles = {}    # (overload or DiskKernel, CUDA context) -> (kernel handle (a CUkernel), its static shared bytes)
_shared = {}     # (kernel handle, device) -> dynamic shared bytes allowed
_capability = {} # CUDA context -> compute capability of its device
_shared_limit = {}  # CUDA context -> dynamic shared bytes a block of its device may opt into
RECORDING = threading.local()  # .recorder: set while flashnb._dispatch records this thread's call; launch and
                               # memset_zero tell it through its note_launch / note_memset (no import upward)


def launch(kern, grid, block, stream, shared_bytes, args):
    """Launch ``kern`` on a 1-D ``grid`` of 1-D ``block``s on ``stream`` (an ``_arrays.Stream``) with
    ``shared_bytes`` of dynamic shared memory (the kernel's limit is raised first where its static shared
    memory and these bytes together pass 48 KB).

    ``args``: ``View``s, Numba device arrays, Python ints (int64), NumPy float32 / float64 scalars.  A grid of no
    blocks has nothing to do (a packed batch of empty sequences, say) and launches nothing.
    """
    if grid == 0:
        return
    if SIMULATOR:
        recorder = getattr(RECORDING, "recorder", None)
        if recorder is not None:
            recorder.note_launch(kern, grid, block, shared_bytes, args)
        kern[grid, block, stream.numba, shared_bytes](*args)
        return
    key, values = _flatten(kern, args)
    entry = _compiled.get((kern, key))
    if entry is None:
        entry = _compiled[kern, key] = _compile(kern, key)
    overload, fmt, nwords, offsets = entry
    context = current_context()
    cached = _handles.get((overload, context))
    if cached is None:                                         # Numba's, or the disk cache's cubin, loaded
        handle = kernel_handle(entry, context)
        cached = _handles[overload, context] = (handle, static_shared_bytes(handle), ctypes.c_void_p(int(handle)))
    handle, static_bytes, c_handle = cached
    if shared_bytes + static_bytes > 48 * 1024:
        _allow_shared(handle, shared_bytes)
    LAUNCHED[id(kern)] = (kern, block, shared_bytes)
    buf = np.empty(nwords + len(offsets), np.uint64)           # values, then a pointer to each parameter
    struct.pack_into(fmt, buf, 0, *values)
    base = buf.__array_interface__["data"][0]
    buf[nwords:] = offsets + np.uint64(base)
    recorder = getattr(RECORDING, "recorder", None)
    if recorder is not None:
        _record(recorder, kern, grid, block, shared_bytes, args, handle, buf, nwords, offsets)
    one = _ONE
    err = _libcuda().cuLaunchKernel(c_handle, ctypes.c_uint(grid), one, one, ctypes.c_uint(block), one, one,
                                    ctypes.c_uint(shared_bytes), ctypes.c_void_p(stream.handle),
                                    ctypes.c_void_p(base + 8 * nwords), None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernel of {kern.py_func.__name__} (grid {grid}, block {block}, "
                           f"{shared_bytes} bytes of shared memory) failed: {err!r}")


def _record(recorder, kern, grid, block, shared_bytes, args, handle, buf, nwords, offsets):
    """Tell the dispatch recorder about a launch: its packed buffer and the buffer word of each array's address
    (an array's parameters are ``meminfo, parent, nitems, itemsize, data, ...``: the address is the 5th)."""
    address_word, value = {}, 0
    for pos, a in enumerate(args):
        if type(a) is not View and getattr(a, "__cuda_ndarray__", False) is True:
            a = View.of(a)
        if type(a) is View:
            address_word[pos] = int(offsets[value + 4]) // 8
            value += len(a.params)
        else:
            value += 1
    recorder.note_launch(kern, grid, block, shared_bytes, args, (handle, buf, nwords, address_word))


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
    """The compiled specialisation of ``kern`` for the argument key (``_specialisation``: from the disk cache,
    or compiled by Numba), with the struct format, words of values and parameter offsets of its launch."""
    argtypes, fmt, nwords, offsets = _layout(key)
    return _specialisation(kern, key, argtypes), fmt, nwords, offsets


def _layout(key):
    """Numba's argument types for the argument key, and its launch's struct format, words of values and
    parameter offsets (from the key alone: no compiled kernel needed)."""
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
    fmt = "@" + "".join(chars)
    offsets = [struct.calcsize("@" + "".join(chars[:i + 1])) - struct.calcsize(c) for i, c in enumerate(chars)]
    return tuple(argtypes), fmt, -(-struct.calcsize(fmt) // 8), np.array(offsets, np.uint64)


# ------------------------------------------------------------------------------------------------ disk cache
# Compile once per machine (``_cache``): a specialisation of a kernel with a stable id (``kernel_factory``) is
# looked up on disk by ``_specialisation`` before Numba compiles it, and stored there after.  A cached one is
# a ``DiskKernel``: its cubin is loaded with the driver's library API (``cuLibraryLoadData`` and
# ``cuLibraryGetKernel``, as numba-cuda 0.30 loads its own cubins through cuda.core), so its handle is a
# context-independent ``CUkernel`` like Numba's, which ``cuLaunchKernel`` and ``_allow_shared``'s
# ``cuKernelSetAttribute`` take unchanged.  Its Dispatcher has no overload for it: tools that read
# ``kern.overloads`` (registers, SASS) call ``numba_overloads``, which compiles.

def kernel_factory(fn):
    """Decorator of a kernel factory (a ``make_*``, under its ``lru_cache``): gives each kernel it returns (a
    Dispatcher, or each one in a returned tuple) ``flashnb_id``, a stable text naming it across processes: the
    factory's module, qualified name and arguments (defaults filled in, so every way of calling with the same
    values gives one id) and the kernel's index in the tuple.  The disk cache keys on it; kernels without one,
    or whose factory arguments are not plain values (numbers, strings, None, tuples), are not cached on disk."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def factory(*args, **kwargs):
        made = fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if all(_plain(v) for v in bound.arguments.values()):
            call = [_text(v) for v in bound.args] + [f"{k}={_text(v)}" for k, v in sorted(bound.kwargs.items())]
            text = f"{fn.__module__}.{fn.__qualname__}({', '.join(call)})"
            for i, item in enumerate(made if isinstance(made, tuple) else (made,)):
                if hasattr(item, "py_func"):
                    item.flashnb_id = f"{text}[{i}]" if isinstance(made, tuple) else text
        return made

    return factory


def _plain(value):
    """Whether ``_text(value)`` names the value in any process (no object addresses): plain values, tuples of
    them, and objects given a stable ``flashnb_id`` (a ``flex_attention`` function compiled by ``flex``)."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    if isinstance(getattr(value, "flashnb_id", None), str):
        return True
    return value is None or isinstance(value, (bool, int, float, str, np.generic, np.dtype))


def _text(value):
    """The text of a plain value (``_plain``): its ``repr``, an object's ``flashnb_id``, a tuple's items (a named
    tuple with its type's name)."""
    if isinstance(value, tuple):
        items = ", ".join(_text(v) for v in value)
        if type(value) is not tuple:
            return f"{type(value).__name__}({items})"
        return f"({items}{',' if len(value) == 1 else ''})"
    ident = getattr(value, "flashnb_id", None)
    return f"<{ident}>" if isinstance(ident, str) else repr(value)


def code_digest(code):
    """sha256 (hex) of what a code object computes: its bytecode, constants (nested code by its digest), names
    and argument layout, not its file or line numbers (so a checkout's path does not enter a key)."""
    h = hashlib.sha256()

    def feed(c):
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars, c.co_argcount,
                       c.co_kwonlyargcount, c.co_flags)).encode())
        for const in c.co_consts:
            if isinstance(const, pytypes.CodeType):
                feed(const)
            else:
                h.update(const_text(const).encode())

    def const_text(const):          # a frozenset's order (``x in {"a", "b"}``) follows the process's string hashes
        if isinstance(const, (frozenset, set)):
            return "{" + ", ".join(sorted(const_text(x) for x in const)) + "}"
        if isinstance(const, tuple):
            return "(" + ", ".join(const_text(x) for x in const) + ")"
        return f"{type(const).__name__} {const!r}"

    feed(code)
    return h.hexdigest()


def code_state_parts(fn):
    """The lines ``code_state`` hashes: what ``fn``'s compiled code is built from besides its factory's
    arguments: the code of every function it reaches (``code_digest``: a function outside ``flashnb/kernels/``, a
    ``flex_attention`` function say, has no other part of the key that holds its code), the values in its closure
    and the module globals its code names, through every device function, intrinsic and Python function among
    them (plain values by ``repr``, arrays by their bytes, containers by their items, modules by no name, other
    objects by their type's name).  A factory that reads a module setting (``forward.MAX_THREADS``, which
    tools/tune_simt.py changes between rebuilds) gives kernels with one id but other code: this part of the disk
    cache's key tells them apart."""
    parts, seen = [], set()

    def value(v):
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes, np.generic, np.dtype)):
            return repr(v)
        if isinstance(v, type):
            return f"class {v.__module__}.{v.__qualname__}"
        if isinstance(v, (tuple, list)):
            return "(" + ", ".join(value(x) for x in v) + ")"
        if isinstance(v, (set, frozenset)):
            return "{" + ", ".join(sorted(value(x) for x in v)) + "}"
        if isinstance(v, dict):
            return "{" + ", ".join(sorted(f"{value(k)}: {value(x)}" for k, x in v.items())) + "}"
        if isinstance(v, pytypes.ModuleType):
            return "module"      # by no name: numba.types reads as numba.core.types or not, by import order
                                 # (the toolchain's versions key the modules' contents)
        if isinstance(v, np.ndarray):
            return f"ndarray {v.dtype} {v.shape} {hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()}"
        if isinstance(v, NumbaType):
            return f"numba {v}"
        f = v if isinstance(v, pytypes.FunctionType) else (
            getattr(v, "py_func", None) or getattr(v, "_defn", None) or getattr(v, "__wrapped__", None))
        if isinstance(f, pytypes.FunctionType):                # a function, Dispatcher, intrinsic, lru_cache
            function(f)
            return f"function {f.__module__}.{f.__qualname__}"
        return f"object {type(v).__module__}.{type(v).__qualname__}"

    def function(f):
        if id(f) in seen:
            return
        seen.add(id(f))
        cells = []
        for cell in f.__closure__ or ():
            try:
                cells.append(value(cell.cell_contents))
            except ValueError:                                 # a cell not yet filled
                cells.append("<empty>")
        names = sorted(n for n in _code_names(f.__code__) if n in f.__globals__)
        used = ", ".join(f"{n}={value(f.__globals__[n])}" for n in names)
        parts.append(f"{f.__module__}.{f.__qualname__} code {code_digest(f.__code__)} "
                     f"cells [{', '.join(cells)}] defaults "
                     f"{value(f.__defaults__ or ())} globals [{used}]")

    function(fn)
    return parts


def code_state(fn):
    """sha256 (hex) of ``code_state_parts(fn)``: the disk cache's key part."""
    return hashlib.sha256("\n".join(code_state_parts(fn)).encode()).hexdigest()


def _code_names(code):
    """The global (and attribute) names a code object and the code nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, pytypes.CodeType):
            names |= _code_names(const)
    return names


class DiskKernel:
    """A specialisation whose cubin came from the disk cache (for the ``arch`` of the context that asked):
    loaded into the process by ``handle`` on its first launch, without Numba."""
    __slots__ = ("kern", "key", "argtypes", "arch", "name", "cubin", "library", "kernel")

    def __init__(self, kern, key, argtypes, arch, name, cubin):
        self.kern, self.key, self.argtypes, self.arch, self.name, self.cubin = kern, key, argtypes, arch, name, cubin
        self.library = self.kernel = None

    def handle(self):
        """The kernel's ``CUkernel`` (the library is loaded once per process and kept: never unloaded)."""
        if self.kernel is None:
            drv = _driver()
            err, library = drv.cuLibraryLoadData(self.cubin, None, None, 0, None, None, 0)
            if err != drv.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuLibraryLoadData of a cached {self.kern.py_func.__name__} failed: {err}")
            err, kernel = drv.cuLibraryGetKernel(library, self.name.encode())
            if err != drv.CUresult.CUDA_SUCCESS:
                drv.cuLibraryUnload(library)
                raise RuntimeError(f"cuLibraryGetKernel({self.name}) of a cached kernel failed: {err}")
            self.library, self.kernel = library, kernel
        return self.kernel


def kernel_handle(entry, context):
    """The kernel handle to launch an entry of ``_compiled`` with in ``context`` (current): Numba's (which
    loads its module into the context), or the disk-cached cubin's.  A cached cubin for another architecture
    than the context's device, or one the driver refuses, is compiled by Numba instead."""
    compiled = entry[0]
    if type(compiled) is DiskKernel:
        if compiled.arch == _arch():
            try:
                return compiled.handle()
            except Exception as e:                             # never fail a call for the cache: compile
                warnings.warn(f"flashnb: {e}; compiling it", RuntimeWarning)
        compiled = _specialisation(compiled.kern, compiled.key, compiled.argtypes, use_disk=False)
    return compiled._codelibrary.get_cufunc().handle


def _specialisation(kern, key, argtypes, use_disk=True):
    """``kern`` for ``argtypes``: a ``DiskKernel`` where the disk cache holds it (with ``use_disk``), else
    Numba's overload, compiled now (``Dispatcher.compile``) and stored in the disk cache."""
    start = time.perf_counter()
    arch = _arch()
    disk_key = _disk_key(kern, argtypes, arch)
    what = getattr(kern, "flashnb_id", kern.py_func.__qualname__)
    args = ", ".join(map(str, argtypes))
    entry = None if disk_key is None else _cache.path_for(disk_key)
    if use_disk and disk_key is not None:
        found = _cache.load(disk_key)
        if found is not None:
            _cache.note(what, args, arch, "loaded", time.perf_counter() - start, entry)
            return DiskKernel(kern, key, argtypes, arch, *found)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaPerformanceWarning)
        overload = kern.compile(argtypes)
    _cache.count("compiled")
    how = "compiled"
    if disk_key is not None:
        how = "compiled, not stored"
        try:
            lib = overload._codelibrary
            if _storable(overload) and _cache.store(disk_key, lib._entry_name, _cubin_bytes(lib.get_cubin())):
                how = "compiled, stored"
        except Exception as e:                                 # numba-cuda's internals not as expected here
            _cache.warn_once(f"flashnb: compiled kernels cannot be cached ({type(e).__name__}: {e})")
    _cache.note(what, args, arch, how, time.perf_counter() - start, entry)
    return overload


def _disk_key(kern, argtypes, arch):
    """The disk cache's key of ``kern`` for ``argtypes`` on ``arch``; None if it is not cached on disk (no
    stable id, the cache off)."""
    kid = getattr(kern, "flashnb_id", None)
    if kid is None or _cache.cache_dir() is None:
        return None
    options = getattr(kern, "targetoptions", {})
    text = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
    if " at 0x" in text:                                       # a jit option that is an object: no stable text
        return None
    return _cache.key_text(f"{kid} jit({text}) state {code_state(kern.py_func)}", ", ".join(map(str, argtypes)),
                           arch)


def _storable(overload):
    """Whether a compiled kernel is whole as a cubin: no module setup (NRT, referenced objects, cooperative
    launch, carveout) that Numba does when it loads its own."""
    lib = overload._codelibrary
    return not (lib._setup_functions or lib._teardown_functions or lib.referenced_objects or overload.cooperative
                or getattr(overload, "shared_memory_carveout", None) is not None
                or getattr(overload.target_context, "enable_nrt", False))


def _cubin_bytes(cubin):
    """The bytes of ``CUDACodeLibrary.get_cubin()``'s result (a cuda.core ``ObjectCode`` in numba-cuda 0.30)."""
    return bytes(cubin.code if hasattr(cubin, "code") else cubin)


def _arch():
    """The current device's target, as numba-cuda links for it (``CUDACodeLibrary._ensure_cc``): ``sm_90a``
    on compute capability 9.0 and above (the architecture-specific features), else e.g. ``sm_80``."""
    major, minor = compute_capability()
    return f"sm_{major}{minor}{'a' if (major, minor) >= (9, 0) else ''}"


def numba_overloads(kern):
    """``kern.overloads`` once every specialisation launched in this process is in it: those loaded from the
    disk cache are compiled by Numba now (for tools that read registers, local memory or SASS)."""
    for (k, _), entry in list(_compiled.items()):
        if k is kern and type(entry[0]) is DiskKernel:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NumbaPerformanceWarning)
                kern.compile(entry[0].argtypes)
    return kern.overloads


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
    lib = _libcuda()
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        cuda.current_context()
        if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
            raise RuntimeError("no current CUDA context after Numba made one current")
    return ctx.value


_ONE = ctypes.c_uint(1)
_lib = None


def _libcuda():
    """The CUDA driver through ctypes, for the calls every launch makes (``cuLaunchKernel``, ``cuCtxGetCurrent``):
    a few microseconds less a call than ``cuda.bindings``' wrappers, which convert every argument.  Each returns
    the driver's ``CUresult`` (an int); the arguments go as ctypes objects."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuLaunchKernel", "cuCtxGetCurrent"):
            getattr(lib, name).restype = ctypes.c_int
        _lib = lib
    return _lib


def _driver():
    from cuda.bindings import driver
    return driver


def static_shared_bytes(handle):
    """Bytes of static shared memory (``cuda.shared.array`` of a constant shape) the kernel ``handle`` declares."""
    drv = _driver()
    err, device = drv.cuCtxGetDevice()
    if err == drv.CUresult.CUDA_SUCCESS:
        err, nbytes = drv.cuKernelGetAttribute(drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, handle,
                                               device)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuKernelGetAttribute(SHARED_SIZE_BYTES) failed: {err}")
    return int(nbytes)


def _allow_shared(handle, nbytes):
    """Allow ``nbytes`` of dynamic shared memory for the kernel ``handle`` on the current device.

    CUDA refuses a launch whose static and dynamic shared memory together pass 48 KB unless the kernel's
    ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` attribute was raised to the dynamic bytes first (``launch`` calls this
    then; the attribute's default is 48 KB less the static bytes).
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
    recorder = getattr(RECORDING, "recorder", None)
    if recorder is not None:
        recorder.note_memset(view)
    if SIMULATOR:
        view.copy_to_device(np.zeros(view.shape, view.dtype), stream=stream.numba)
        return
    if not view.key[2] or view.nbytes % 4:
        raise ValueError(f"memset_zero needs a contiguous array of whole 32-bit words, got {view.shape}, {view.dtype}")
    (err,) = _driver().cuMemsetD32Async(view.ptr, 0, view.nbytes // 4, stream.handle)
    if err != 0:
        raise RuntimeError(f"cuMemsetD32Async failed: {err!r}")
