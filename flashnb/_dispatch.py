"""The dispatch cache: a call's launch plan recorded once per specialisation, replayed in microseconds.

A call of ``flash_attention`` / ``flash_attention_backward`` validates its
arguments, plans (``plan.py``), allocates, packs each kernel's parameters and
launches: 130-400 us of host time, most of it re-deriving what the previous
call with the same shapes already knew.  Here the first call with a given
*signature* runs that full path under a recorder, which notes

* every allocation (shape, dtype: ``_arrays.empty_like_kind`` and ``scratch``),
* every launch (kernel handle, grid, block, shared bytes, the packed parameter
  buffer) and every memset,
* and, for each device pointer those carry, where it came from: the i-th input
  array, the j-th allocation, or a constant of the library (the stand-ins for
  absent options, ``_options._dummy``).

A later call with the same signature replays the recording: it allocates the
same buffers, writes the new pointers into copies of the recorded parameter
buffers and launches them with ``cuLaunchKernel`` on the caller's current
stream -- no validation, no planning, no packing.  That is sound because the
signature holds everything the full path's decisions read: the kind, dtype,
shape, strides, device and 16-byte alignment of every array (and which of
them share an address), and the value and type of every other argument.  A call
whose arrays or options differ in any of these is a miss and takes the full
path, which validates it from scratch; a call the full path refuses raises
there and is never recorded.  A recording is kept only if every pointer it
launches with is accounted for: anything else (a bfloat16 copy the SIMT
kernels need, a NumPy array copied to the device) leaves the call uncached
(``unfit``), and it takes the full path every time.  Calls with dropout are
not cached (their seed changes every step); calls with an explicit ``stream``
neither.

In Numba's CUDA simulator the same recordings replay by calling the kernels
with the recorded arguments, the input arrays and allocations substituted,
so the CI suites exercise the keying and the substitution.
"""
import ctypes
import threading
from collections import OrderedDict

import numpy as np

from . import _arrays
from .kernels import _jit, _tma

MAX_ENTRIES = 256                     # recordings kept (the oldest dropped first)
_CACHE = OrderedDict()                # signature -> Replay (or None: known unfit), oldest first
_LOCK = threading.Lock()
_local = _jit.RECORDING               # .recorder: the Recorder of this thread's call being recorded
CONSTANT_PTRS = set()                 # device addresses that stay valid for the process (the option stand-ins)
# replay the Hopper forward's tensor maps (re-derived from the new inputs' addresses); off, a call with tensor maps
# is left unrecorded.  Measured on the H100 (bench/results/h100-hopper-bwd-2026-11-25.md,
# tests/kernels/test_torch_gpu.py::test_dispatch_cache_and_the_hopper_forwards_tensor_maps): bit-identical to the
# full path, 26-28 us of host time a call against 168 us unrecorded
REPLAY_TENSOR_MAPS = True
stats = {"hits": 0, "misses": 0, "recorded": 0, "unfit": 0, "unrecorded": 0, "steps": 0}
# Length-generic steps: a decoding loop's key count grows by one a step, so its signature never comes back and
# every step would take the full path.  An op that passes ``generic=(positions, axis)`` also looks a miss up by
# its *length-generic* key (``length_generic``: the signature with the length of those arrays on that axis left
# out); the full path of such a call may offer a step (``offer_step``: a callable that binds and launches a call
# of that key at any length, re-deriving what depends on the length), kept here and called on later misses.
MAX_STEPS = 64
_STEPS = OrderedDict()                # length-generic key -> step, oldest first
# An op whose calls keep missing (a decoding loop: a new key count every step, so no signature comes back) stops
# paying for recordings that never replay, and stops pushing the recordings that do out of the cache: after
# MISS_STREAK misses in a row with no hit between, only one miss in RECORD_EVERY is recorded (so a signature that
# recurs is still caught, and its first hit ends the streak).
MISS_STREAK, RECORD_EVERY = 32, 16
_STREAK = {}                          # op -> its misses since its last hit

_PLAIN = frozenset((int, float, bool, str, type(None)))
_KEYABLE = {}                         # scalars' types that a key takes -> the positions of the tuples among them
_TENSOR = _arrays.torch.Tensor if _arrays.torch is not None else None


# ------------------------------------------------------------------------------------------------ signature
def signature(op, arrays, scalars):
    """(key, device addresses of the arrays) of a call: the key holds ``op``, each array's (type, dtype, shape,
    strides, device, address mod 16) or None, which arrays share an address, each scalar with its type and
    the current device; (None, None) where the call is not cacheable (a NumPy array, an empty array, an
    argument of another type)."""
    parts, ptrs = [op], []
    tensor = _TENSOR
    for x in arrays:
        if x is None:
            parts.append(None)
            ptrs.append(0)
        elif type(x) is tensor:             # _describe's first case, inline (most calls)
            device, ptr = x.get_device(), x.data_ptr()
            if device < 0 or ptr == 0:
                return None, None
            parts.append((tensor, x.dtype, x.shape, x.stride(), device, ptr & 15))
            ptrs.append(ptr)
        else:
            d = _describe(x)
            if d is None:
                return None, None
            parts.append(d[0])
            ptrs.append(d[1])
    live = set(ptrs)
    live.discard(0)
    parts.append(None if len(live) == len(ptrs) - parts.count(None) else tuple(ptrs.index(p) for p in ptrs))
    types = tuple(map(type, scalars))
    tuples = _KEYABLE.get(types)
    if tuples is None:
        if not all(t in _PLAIN or t is tuple for t in types):
            return None, None
        tuples = _KEYABLE[types] = tuple(i for i, t in enumerate(types) if t is tuple)
    for i in tuples:
        for e in scalars[i]:
            if type(e) is not int:
                return None, None
    parts.append(types)
    parts.append(scalars)
    parts.append(current_device(arrays[0]))
    return tuple(parts), ptrs


def _describe(x):
    """(key part, device address) of an array; None for arrays the cache does not take."""
    torch = _arrays.torch
    if torch is not None and isinstance(x, torch.Tensor):
        device = x.get_device()
        ptr = x.data_ptr()
        if device < 0 or ptr == 0:          # a CPU tensor (refused by the full path), an empty one
            return None
        return (type(x), x.dtype, x.shape, x.stride(), device, ptr & 15), ptr
    if _arrays._is_numba_device_array(x):
        ptr = _ptr(x)
        if ptr == 0:
            return None
        return (type(x), x.dtype, tuple(x.shape), tuple(x.strides), ptr & 15), ptr
    return None


_ptr = _jit.device_address


def current_device(x):
    """The part of a signature the current device adds (the plan reads its limits; launches go to it):
    PyTorch's current device for a tensor ``x``, else the current CUDA context."""
    if _jit.SIMULATOR:
        return 0
    torch = _arrays.torch
    if torch is not None and isinstance(x, torch.Tensor):
        return torch._C._cuda_getDevice()
    return _jit.current_context()


# ------------------------------------------------------------------------------------------------ lookup
def lookup(key):
    """The recording for ``key`` (None: record this call; ``UNFIT``: take the full path without recording).
    A hit reads the dict without the lock (one dict read is atomic); recordings are dropped oldest first."""
    if key is None:
        return UNFIT
    rec = _CACHE.get(key, _MISSING)
    if rec is _MISSING:
        stats["misses"] += 1
        return None
    if rec is None:
        return UNFIT
    stats["hits"] += 1
    return rec


_MISSING = object()
UNFIT = object()


def clear():
    with _LOCK:
        _CACHE.clear()
        _STEPS.clear()
        _STREAK.clear()
        for k in stats:
            stats[k] = 0


def _store(key, rec):
    with _LOCK:
        _CACHE[key] = rec
        while len(_CACHE) > MAX_ENTRIES:
            _CACHE.popitem(last=False)


# ------------------------------------------------------------------------------------------------ recording
class Recorder:
    """What one call does, as it does it: the lower layers find it in ``_jit.RECORDING.recorder`` while a call
    is recorded and tell it of each allocation, memset and launch (``note_alloc``, ``note_memset``,
    ``note_launch``)."""

    def __init__(self, arrays):
        self.inputs = {}
        for i, x in enumerate(arrays):
            if x is not None:
                self.inputs.setdefault(_describe(x)[1], i)
        self.allocs = []          # (library, shape, dtype, device)
        self.alloc_ptrs = {}      # address -> allocation index
        self.alloc_ids = {}       # id(returned array) -> allocation index
        self.keep = []            # the returned arrays, alive while recording (their ids stay unique)
        self.steps = []
        self.fit = True

    def tag(self, ptr):
        """Where a device address came from: ("in", i), ("alloc", j), ("const",), or ("maps", specs): tensor
        maps of inputs or of the call's allocations (``_tma.maps_for``; each spec's address replaced by its
        source's ("in", i) or ("alloc", j)); None if unknown."""
        i = self.inputs.get(ptr)
        if i is not None:
            return ("in", i)
        j = self.alloc_ptrs.get(ptr)
        if j is not None:
            return ("alloc", j)
        if ptr in CONSTANT_PTRS:
            return ("const",)
        specs = _tma.SPECS.get(ptr) if REPLAY_TENSOR_MAPS else None
        if specs is None:
            return None
        sources = [self._source(spec[0]) for spec in specs]
        if None in sources:
            return None
        return ("maps", tuple((src,) + spec[1:] for src, spec in zip(sources, specs)))

    def _source(self, ptr):
        i = self.inputs.get(ptr)
        if i is not None:
            return ("in", i)
        j = self.alloc_ptrs.get(ptr)
        return None if j is None else ("alloc", j)

    def note_alloc(self, returned, view, shape, dtype, like):
        """Called by ``_arrays.empty_like_kind`` / ``scratch`` while recording: a new array (``returned`` to the
        caller, ``view`` the kernels'), of ``shape`` and ``dtype`` (a NumPy dtype or dtype name), like ``like``."""
        torch = _arrays.torch
        lib = "torch" if torch is not None and isinstance(returned, torch.Tensor) else "numba"
        if lib == "numba" and not _arrays._is_numba_device_array(returned):
            self.fit = False
            return
        device = like.device if lib == "torch" else None
        dt = returned.dtype if lib == "torch" else np.dtype(dtype)
        j = len(self.allocs)
        self.allocs.append((lib, tuple(int(s) for s in shape), dt, device))
        self.alloc_ptrs.setdefault(_ptr(view), j)
        if lib == "torch":
            self.alloc_ptrs.setdefault(returned.data_ptr(), j)
        self.alloc_ids[id(returned)] = j
        self.keep.append(returned)

    def note_memset(self, view):
        """Called by ``_jit.memset_zero`` while recording."""
        tag = self.tag(_ptr(view))
        if tag is None or tag[0] != "alloc":
            self.fit = False
            return
        self.steps.append(("memset", tag[1], view.nbytes if type(view) is _jit.View else view._ary.nbytes))

    def note_launch(self, kern, grid, block, shared, args, packed=None):
        """Called by ``_jit.launch`` while recording.  ``packed``: on a GPU, (kernel handle, parameter buffer,
        words of values, {argument position: buffer word of its device address} for the array arguments)."""
        slots = []                      # (argument position or buffer word, tag)
        for pos, a in enumerate(args):
            if type(a) is _jit.View or _arrays._is_numba_device_array(a):
                ptr = _ptr(a)
                tag = self.tag(ptr)
                if tag is None:
                    self.fit = False
                    return
                if tag[0] != "const":
                    slots.append((pos, tag))
        if packed is None:              # the simulator: substitute arguments
            self.steps.append(("call", kern, grid, block, shared, tuple(args), tuple(slots)))
            return
        handle, buf, nwords, address_word = packed
        words = tuple((address_word[pos], tag) for pos, tag in slots)
        own = _own_buffer(buf, nwords)
        self.steps.append(("launch", int(handle), grid, block, shared, own, own.__array_interface__["data"][0]
                          + 8 * nwords, words))


def cached_call(op, arrays, scalars, full_call, cacheable=True, args=(), generic=None):
    """``full_call(*args)``, or the replay of its recording: the entry point of the public functions.
    ``arrays`` and ``scalars``: every argument of the call (``signature``); ``generic``: ``(positions, axis)``
    of the arrays whose length on ``axis`` a length-generic step may vary (``length_generic``), or None."""
    key, ptrs = signature(op, arrays, scalars) if cacheable else (None, None)
    rec = lookup(key)
    if rec is UNFIT:
        return full_call(*args)
    if rec is not None:
        _STREAK[op] = 0
        return rec(arrays, ptrs)
    streak = _STREAK[op] = _STREAK.get(op, 0) + 1
    record = streak <= MISS_STREAK or streak % RECORD_EVERY == 0
    gkey = None if generic is None else length_generic(key, *generic)
    if gkey is not None:
        step = _STEPS.get(gkey)
        if step is not None:          # recorded as a full path's call is: a model's other layers replay it
            with _Recording(key if record else None, arrays) as recording:
                result = step(arrays)
                if result is not None:
                    recording.finish(result)
            if result is not None:
                stats["steps"] += 1
                stats["unrecorded"] += not record
                return result
        _local.step = None
        _local.wants_step = True
    try:
        if not record:
            stats["unrecorded"] += 1
            result = full_call(*args)
        else:
            with _Recording(key, arrays) as recording:
                result = full_call(*args)
                recording.finish(result)
    finally:
        if gkey is not None:
            step, _local.step, _local.wants_step = _local.step, None, False
    if gkey is not None and step is not None:
        with _LOCK:
            _STEPS[gkey] = step
            while len(_STEPS) > MAX_STEPS:
                _STEPS.popitem(last=False)
    return result


def length_generic(key, positions, axis):
    """``key`` (a ``signature``) with the length of the arrays at ``positions`` on ``axis`` left out: their shapes
    without that axis, and each of their strides that is a multiple of the length written as that multiple
    (``("L", stride // length)``: a dense cache's batch stride grows with it), so that calls differing only in
    that length (the same in each of those arrays) share the key.  None where the call has no such key (not
    cacheable, an array absent, lengths that differ or are 0).  The strides stay exact: a key and a length give
    back every stride."""
    if key is None:
        return None
    parts, length = list(key), None
    for i in positions:
        d = parts[1 + i]
        if d is None:
            return None
        shape, strides = d[2], d[3]
        n = shape[axis]
        if n == 0 or (length is not None and n != length):
            return None
        length = n
        parts[1 + i] = d[:2] + (tuple(shape[:axis]) + tuple(shape[axis + 1:]),
                                tuple(("L", s // n) if s % n == 0 else s for s in strides)) + d[4:]
    parts[0] = (key[0], "length-generic")
    return tuple(parts)


def wants_step():
    """Whether the call being run (its full path) may offer a length-generic step (``offer_step``)."""
    return getattr(_local, "wants_step", False)


def offer_step(step):
    """The full path's step for its call's length-generic key: ``step(arrays)`` binds and launches a call of that
    key at any length, or returns None (it cannot: the full path then runs).  Kept only where ``wants_step()``."""
    if getattr(_local, "wants_step", False):
        _local.step = step


class _Recording:
    def __init__(self, key, arrays):
        self.key, self.arrays, self.recorder = key, arrays, None

    def __enter__(self):
        if self.key is not None:
            self.recorder = _local.recorder = Recorder(self.arrays)
        return self

    def finish(self, result):
        """Store the recording of the call that returned ``result`` (an array or a tuple of them)."""
        rec = self.recorder
        if rec is None:
            return
        outputs = []
        for r in (result if isinstance(result, tuple) else (result,)):
            j = rec.alloc_ids.get(id(r))
            if j is None:
                rec.fit = False
                break
            outputs.append(j)
        if not rec.fit:
            stats["unfit"] += 1
            _store(self.key, None)
            return
        stats["recorded"] += 1
        _store(self.key, Replay(rec.allocs, rec.steps, tuple(outputs), isinstance(result, tuple)))

    def __exit__(self, *exc):
        if self.recorder is not None:
            _local.recorder = None
        return False


def active():
    return getattr(_local, "recorder", None)


def unfit():
    """The call being recorded does work the recording cannot replay (a torch-side copy, say)."""
    rec = active()
    if rec is not None:
        rec.fit = False


def _own_buffer(buf, nwords):
    """A copy of a packed parameter buffer whose pointer array points into the copy."""
    b = buf.copy()
    b[nwords:] = buf[nwords:] - np.uint64(buf.__array_interface__["data"][0]) + np.uint64(
        b.__array_interface__["data"][0])
    return b


# ------------------------------------------------------------------------------------------------ replay
class Replay:
    """A recorded call: allocate, patch, launch.  On a GPU what every replay does alike is worked out once, here:
    the allocations made one by one (the outputs first), the temporaries' offsets in one scratch allocation, and
    for each launch the buffer words to patch with the index of their address in ``ptrs + alloc_ptrs``, and its
    other arguments as ctypes objects (``_Driver``)."""

    def __init__(self, allocs, steps, outputs, as_tuple):
        self.allocs, self.steps, self.outputs, self.as_tuple = allocs, steps, outputs, as_tuple
        self.lock = threading.Lock()
        # on a GPU the temporaries (allocations not returned) of a PyTorch call come from one allocation
        self.scratch, self.scratch_bytes = {}, 0
        if _jit.SIMULATOR:
            return
        for j, (lib, shape, dtype, device) in enumerate(allocs):
            if lib == "torch" and j not in outputs:
                self.scratch[j] = self.scratch_bytes
                size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                self.scratch_bytes += -(-size // 256) * 256
                self.scratch_device = device
        self.scratch_offsets = tuple(self.scratch.items())
        rest = tuple(j for j in range(len(allocs)) if j not in outputs and j not in self.scratch)
        self.fresh = tuple((j, allocs[j][0] == "torch", allocs[j]) for j in tuple(outputs) + rest)
        n, self.plan = len(allocs), []
        for step in steps:
            if step[0] == "launch":
                _, handle, grid, block, shared, buf, params, words = step
                sources = None if any(tag[0] == "maps" for _, tag in words) else tuple(
                    (w, tag[1] if tag[0] == "in" else tag[1] - n) for w, tag in words)
                args = tuple(map(ctypes.c_uint, (grid, 1, 1, block, 1, 1, shared)))
                self.plan.append((True, (ctypes.c_void_p(handle),) + args, memoryview(buf), ctypes.c_void_p(params),
                                  sources, words))
            else:
                _, j, nbytes = step
                self.plan.append((False, j, ctypes.c_size_t(nbytes // 4)))

    def __call__(self, arrays, ptrs):
        if _jit.SIMULATOR:
            made = [_allocate(*a) for a in self.allocs]
            self._simulate(arrays, made)
        else:
            made, alloc_ptrs = [None] * len(self.allocs), [0] * len(self.allocs)
            torch = _arrays.torch
            if self.scratch:
                scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=self.scratch_device)
                base = scratch.data_ptr()
                for j, offset in self.scratch_offsets:
                    alloc_ptrs[j] = base + offset
            poison = _arrays.POISON_OUTPUTS
            for j, is_torch, (lib, shape, dtype, device) in self.fresh:
                if is_torch and not poison:
                    a = made[j] = torch.empty(size=shape, dtype=dtype, device=device)   # (size=: ~0.6 us less)
                    alloc_ptrs[j] = a.data_ptr()
                else:
                    a = made[j] = _allocate(lib, shape, dtype, device)
                    alloc_ptrs[j] = _ptr_of_alloc(a)
            addrs = ptrs + alloc_ptrs
            raw_stream = _current_stream(arrays[0])
            stream = ctypes.c_void_p(raw_stream)
            cuda = _cuda()
            with self.lock:
                for step in self.plan:
                    if step[0]:
                        _, args, buf, params, sources, words = step
                        if sources is not None:
                            for w, i in sources:
                                buf[w] = addrs[i]
                        else:
                            for w, tag in words:
                                buf[w] = (ptrs[tag[1]] if tag[0] == "in" else alloc_ptrs[tag[1]] if tag[0] == "alloc"
                                          else _tma.maps_for(_specs(tag[1], ptrs, alloc_ptrs), raw_stream).ptr)
                        err = cuda.launch(*args, stream, params, None)
                        if err:
                            raise RuntimeError(f"cuLaunchKernel failed in a replayed call: CUDA error {err}")
                    else:
                        _, j, count = step
                        err = cuda.memset(ctypes.c_uint64(alloc_ptrs[j]), _ZERO, count, stream)
                        if err:
                            raise RuntimeError(f"cuMemsetD32Async failed in a replayed call: CUDA error {err}")
        if self.as_tuple:
            return tuple([made[j] for j in self.outputs])
        return made[self.outputs[0]]

    def _simulate(self, arrays, made):
        from numba import cuda
        for step in self.steps:
            if step[0] == "memset":
                a = made[step[1]]
                a.copy_to_device(np.zeros(a.shape, a.dtype))
                continue
            _, kern, grid, block, shared, args, slots = step
            args = list(args)
            for pos, tag in slots:
                if tag[0] == "maps":
                    args[pos] = _tma.maps_for(_specs(tag[1], [_ptr(a) if a is not None else 0 for a in arrays],
                                                     [_ptr(a) for a in made]))
                    continue
                base = arrays[tag[1]] if tag[0] == "in" else made[tag[1]]
                args[pos] = _same_view(args[pos], base)
            kern[grid, block, cuda.default_stream(), shared](*args)


def _specs(recorded, ptrs, alloc_ptrs):
    """Tensor-map specs with each recorded source replaced by its address in this call: an input's (``ptrs``)
    or an allocation's (``alloc_ptrs``)."""
    return tuple(((ptrs if spec[0][0] == "in" else alloc_ptrs)[spec[0][1]],) + spec[1:] for spec in recorded)


def _allocate(lib, shape, dtype, device):
    if lib == "torch":
        t = _arrays.torch.empty(size=shape, dtype=dtype, device=device)
        if _arrays.POISON_OUTPUTS and t.is_floating_point():
            t.fill_(float("nan"))
        return t
    from numba import cuda
    if _arrays.POISON_OUTPUTS and dtype.kind == "f":
        return cuda.to_device(np.full(shape, np.nan, dtype=dtype))
    return cuda.device_array(shape, dtype=dtype)


def _ptr_of_alloc(a):
    torch = _arrays.torch
    if torch is not None and isinstance(a, torch.Tensor):
        return a.data_ptr()
    return _ptr(a)


class _Interface:
    """Holds an ``__array_interface__`` (and the array it points into) for ``np.asarray``."""

    def __init__(self, interface, owner):
        self.__array_interface__, self.owner = interface, owner


def _same_view(recorded, base):
    """The simulator's device array over ``base``'s memory with ``recorded``'s shape, strides and dtype (the
    recorded argument was ``base`` itself or a view of it at the same address)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    r = recorded._ary
    interface = {"shape": r.shape, "strides": r.strides, "typestr": r.dtype.str, "version": 3,
                 "data": (_ptr(base), False)}
    return FakeCUDAArray(np.asarray(_Interface(interface, base)))


def _current_stream(x):
    """The raw stream the replay launches on: the caller's library's current stream (as the full path's):
    PyTorch's on ``x``'s device for a tensor ``x``, else the default stream (Numba's arrays)."""
    torch = _arrays.torch
    if torch is not None and isinstance(x, torch.Tensor):
        return torch._C._cuda_getCurrentRawStream(x.get_device())
    return 0


_libcuda = None
_ZERO = ctypes.c_uint(0)


def _cuda():
    """The CUDA driver's launch and memset (a launch costs ~1 us this way)."""
    global _libcuda
    if _libcuda is None:
        _libcuda = _Driver(ctypes.CDLL("libcuda.so.1"))
    return _libcuda


class _Driver:
    """``cuLaunchKernel`` and ``cuMemsetD32Async`` of ``lib`` (or the functions named so) through ctypes with no
    argument types: the replay passes ctypes objects (most made once, in ``Replay``), ~0.3 us a call less than
    ctypes converting Python ints."""

    def __init__(self, lib, launch="cuLaunchKernel", memset="cuMemsetD32Async"):
        self.launch, self.memset = lib[launch], lib[memset]
        self.launch.restype = self.memset.restype = ctypes.c_int
