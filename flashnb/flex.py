"""``flex_attention``: PyTorch FlexAttention's ``score_mod`` and ``mask_mod`` as plain Python functions, compiled
by Numba into flashnb's kernels (SIMT and tensor cores).

    def alibi(score, b, h, q_idx, kv_idx):          # score_mod: the scaled score, and its indices
        return score - 0.5 * (h + 1) * abs(q_idx - kv_idx)

    def causal(b, h, q_idx, kv_idx):                # mask_mod: may query q_idx see key kv_idx
        return q_idx >= kv_idx

    mask = flashnb.create_block_mask(causal, None, None, L, S, BLOCK_SIZE=16)
    out = flashnb.flex_attention(q, k, v, score_mod=alibi, block_mask=mask)     # q (B, H, L, E), k, v (B, Hkv, S, E)

The semantics are FlexAttention's (``reference.flex`` is the oracle, which runs the very same functions over
index grids): ``s = score_mod(scale * q.k, b, h, q_idx, kv_idx)``, ``-inf`` where ``mask_mod`` is False (the
indices top-left: a causal mask is ``q_idx >= kv_idx`` whatever L and S), softmax over the keys, a row with no
key gives 0 and ``lse = -inf``.  ``create_block_mask`` classifies each (batch, head, query block, key block) as
empty (never loaded), partial or full on the device (``kernels/flex.py``); the kernels skip the empty blocks and
evaluate ``mask_mod`` only where a block is partial.

A function is compiled the first time a call uses it, for the dtypes of that call, and inlined where the
options' code goes (``kernels._scores``).  It may use arithmetic, comparisons, ``abs``, ``min``/``max``,
``math`` and ``cmath`` functions, and read NumPy arrays it captures (frozen into the kernel as constants: keep
them small; a new array means a new function).  The backward needs ``d score_mod / d score``: pass
``score_mod_grad(score, b, h, q_idx, kv_idx)``, or write ``score_mod`` so that it takes a complex score (no
``math.*`` on the score: ``cmath`` works) and flashnb takes the complex step ``Im f(s + i t) / t``, exact to
rounding.  What cannot hold is refused before any launch with an error naming the function.
"""
import contextlib
import dis
import hashlib
import itertools
import numbers
import re
import types
import weakref

import numpy as np

from . import _arrays, _dispatch, _options, api, plan
from .kernels import _jit
from .kernels._jit import device_function
from .kernels._mod_float32 import float32_device_function, int32_compare_device_function
from .kernels._scores import Mods
from .kernels.flex import EMPTY, FULL, PARTIAL, THREADS, grid, make_block_states

__all__ = ["BlockMask", "create_block_mask", "flex_attention", "flex_attention_backward", "EMPTY", "PARTIAL", "FULL"]

COMPLEX_STEP = 1e-30
COMPLEX_STEP_FLOAT32 = 2.0 ** -66       # (float32: 1e-30 times a derivative below 1e-8 would be subnormal)
MASKS = weakref.WeakValueDictionary()   # the live BlockMasks by handle (a graph that names one is passed it)
_HANDLES = itertools.count()


class BlockMask:
    """``create_block_mask``'s result: the ``mask_mod``, the block size ``(BLOCK_Q, BLOCK_K)``, the lengths it
    was made for, and ``states``, a NumPy int8 array ``(B or 1, H or 1, ceil(Q_LEN / BLOCK_Q), ceil(KV_LEN /
    BLOCK_K))`` of ``EMPTY``, ``PARTIAL``, ``FULL``."""

    def __init__(self, mask_mod, states, block_size, q_len, kv_len):
        self.mask_mod, self.states, self.block_size = mask_mod, states, block_size
        self.q_len, self.kv_len = q_len, kv_len
        # names the mask where only plain values pass (flashnb.torch's custom ops); a str, which Dynamo keeps a
        # constant (an int attribute that differs between two compiles is made symbolic by the second)
        self.handle = f"mask{next(_HANDLES)}"
        MASKS[self.handle] = self
        self._as = {}             # the kind of array a call passes -> the states as that kind

    def states_like(self, like):
        """``kernel_states`` as an array of ``like``'s kind and device (the kernels' block mask: they load no
        empty block, and run the mask_mod on a tile unless every block under it is full)."""
        torch = _arrays.torch
        key = (str(like.device) if torch is not None and isinstance(like, torch.Tensor)
               else (type(like).__name__, _arrays.device_of(like),
                     _jit.current_context() if _arrays._is_numba_device_array(like) and not _jit.SIMULATOR else None))
        if key not in self._as:
            states = kernel_states(self.states)
            if torch is not None and isinstance(like, torch.Tensor):
                states = torch.as_tensor(states, device=like.device)
            elif _arrays._is_numba_device_array(like):
                from numba import cuda
                states = cuda.to_device(states)
            self._as[key] = states
        return self._as[key]

    def __repr__(self):
        counts = {n: int((self.states == v).sum()) for n, v in (("empty", EMPTY), ("partial", PARTIAL),
                                                                ("full", FULL))}
        return (f"BlockMask(shape={self.states.shape}, block_size={self.block_size}, "
                + ", ".join(f"{n}={c}" for n, c in counts.items()) + ")")


def kernel_states(states):
    """The kernels' block mask: ``states`` (int8, ``(B, H, nqb, nkb)``) as int32 padded to ``(B, H, nqb + 2,
    nkb + 2)`` with each query block's first kept key block and last plus one (columns ``nkb``, ``nkb + 1``; ``nkb``
    and 0 where it keeps none) and each key block's first and last-plus-one kept query block (rows ``nqb``,
    ``nqb + 1``), so a kernel's loop over tiles starts and ends at the kept blocks (``forward.make_mask_bounds``)."""
    B, H, nqb, nkb = states.shape
    padded = np.zeros((B, H, nqb + 2, nkb + 2), np.int32)
    padded[:, :, :nqb, :nkb] = states
    kept = states != EMPTY
    for axis, n, (first, last) in ((3, nkb, (np.s_[:, :, :nqb, nkb], np.s_[:, :, :nqb, nkb + 1])),
                                   (2, nqb, (np.s_[:, :, nqb, :nkb], np.s_[:, :, nqb + 1, :nkb]))):
        some = kept.any(axis=axis)
        padded[first] = np.where(some, kept.argmax(axis=axis), n)
        padded[last] = np.where(some, n - np.flip(kept, axis=axis).argmax(axis=axis), 0)
    return padded


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=128):
    """The block states of ``mask_mod`` over ``(B, H, Q_LEN, KV_LEN)`` (``B`` or ``H`` None: the mask does not
    depend on it, one entry), computed on the device.  ``BLOCK_SIZE``: an int or a pair (query, key)."""
    for value, name in ((Q_LEN, "Q_LEN"), (KV_LEN, "KV_LEN")):
        if not _options._is_int(value) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    for value, name in ((B, "B"), (H, "H")):
        if value is not None and (not _options._is_int(value) or value < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
    _check_mod(mask_mod, "mask_mod", 4, (B or 1, H or 1, Q_LEN, KV_LEN) if Q_LEN > 0 and KV_LEN > 0 else None)
    pair = (BLOCK_SIZE, BLOCK_SIZE) if _options._is_int(BLOCK_SIZE) else tuple(BLOCK_SIZE)
    if len(pair) != 2 or not all(_options._is_int(s) and s > 0 for s in pair):
        raise ValueError(f"BLOCK_SIZE must be a positive int or a pair of them, got {BLOCK_SIZE!r}")
    bq, bk = (int(s) for s in pair)
    shape = (B or 1, H or 1, -(-int(Q_LEN) // bq), -(-int(KV_LEN) // bk))
    states = np.zeros(shape, np.int8)
    n = int(np.prod(shape))
    if n:
        from numba import cuda
        d = cuda.to_device(states)
        with _named_compile_errors(None, mask_mod, None):
            _jit.launch(make_block_states(_compiled(mask_mod), bq, bk), grid(n), THREADS, _arrays.resolve_stream(
                None, _arrays.kind_of(states, "states"), states), 0, (d, int(Q_LEN), int(KV_LEN)))
        states = d.copy_to_host()
    return BlockMask(mask_mod, states, (bq, bk), int(Q_LEN), int(KV_LEN))


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, *, stream=None, backend="auto"):
    """Attention with ``score_mod`` and ``block_mask``'s ``mask_mod`` (the module's docstring), FlexAttention's
    layout: query ``(B, Hq, L, E)``, key and value ``(B, Hkv, S, E)`` (``Hkv != Hq`` needs ``enable_gqa``).
    Returns ``out`` ``(B, Hq, L, E)`` of the query's kind and dtype, or ``(out, lse)`` with ``lse`` ``(B, Hq, L)``
    (float32; float64 for float64 inputs).  NumPy, PyTorch (CUDA), CuPy and Numba device arrays.  ``backend`` as
    ``flash_attention``'s: "auto" runs 16-bit inputs on the tensor cores (the Hopper forward on compute
    capability 9.0), float64 on the SIMT kernels, float32 on the SIMT kernels except the forward on compute
    capability 9.0 (the 3xTF32 Hopper forward, as ``flash_attention``'s)."""
    q, k, v, options = _call(query, key, value, score_mod, block_mask, scale, enable_gqa, None, False)
    with _named_compile_errors(score_mod, block_mask, None):
        out, lse = _dispatch.cached_call(
            ("flex_forward", options["mods"], options["block_mask_size"]), (q, k, v, options["block_mask"]),
            (scale, backend), api._forward, cacheable=stream is None,
            args=(q, k, v, options, True, None, None, stream, backend))
    out = _swap(out)
    return (out, lse) if return_lse else out


def flex_attention_backward(dout, query, key, value, out, lse, score_mod=None, block_mask=None, scale=None,
                            enable_gqa=False, score_mod_grad=None, deterministic=False, *, captured_grads=(),
                            stream=None, backend="auto"):
    """``(dq, dk, dv)`` of ``sum(out * dout)`` for ``out, lse = flex_attention(..., return_lse=True)`` with the
    same functions; in FlexAttention's layout, ``dk``, ``dv`` summed over the query heads of a key/value head.
    ``score_mod_grad(score, b, h, q_idx, kv_idx)``: the score_mod's derivative in the score; without it the
    complex step (the score_mod must then take a complex score).  ``backend``, ``deterministic`` as
    ``flash_attention_backward``'s.

    ``captured_grads``: names of float32 or float64 arrays the score_mod captures (its closure's variables or
    the globals it reads: a learned bias table, per-head slopes); then ``(dq, dk, dv, grads)``, ``grads[name]``
    the gradient in that array, of its kind and dtype (``reference.flex.flex_attention_backward``'s
    ``captured_grads``).  The dK/dV kernels add each element's part with atomics (float32 for 16-bit and float32
    inputs), so the sums' order varies from run to run, and ``deterministic=True`` is refused with it.  Each read
    of the array in the score_mod's code must be one element, outside loops (``kernels._mod_grad``)."""
    names = _captured_grad_names(captured_grads, score_mod, deterministic)
    if names and stream is not None:
        raise ValueError("captured_grads runs on the caller's current stream (its gradient buffers are zeroed and "
                         "read there): pass stream=None")
    q, k, v, options = _call(query, key, value, score_mod, block_mask, scale, enable_gqa, score_mod_grad, True,
                             names)
    dout, out = _swap(dout), _swap(out)
    learned = options.pop("learned")
    lib = _arrays.kind_of(query, "query").lib
    for entry in learned:
        entry.zero(lib)
    with _named_compile_errors(score_mod, block_mask, score_mod_grad):
        grads = _dispatch.cached_call(
            ("flex_backward", options["mods"], options["block_mask_size"]),
            (dout, q, k, v, out, lse, options["block_mask"]), (scale, deterministic, backend), api._backward,
            cacheable=stream is None,
            args=(dout, q, k, v, out, lse, options, None, None, deterministic, stream, backend))
    grads = tuple(_swap(g) for g in grads)
    if not names:
        return grads
    return grads + ({entry.name: entry.result(lib) for entry in learned},)


# ------------------------------------------------------------------------------------------------ checks
@contextlib.contextmanager
def _named_compile_errors(score_mod, mask, score_mod_grad):
    """A Numba compile error of a flex call's kernels (raised when a kernel is first compiled, before its launch)
    as a TypeError naming the caller's functions: the kernels compile without them, so the functions are what
    Numba could not compile (``str(q_idx)``, a dict, a call Numba has no implementation of)."""
    try:
        yield
    except Exception as e:                                # noqa: BLE001 (Numba's compile errors, re-raised named)
        from numba.core.errors import NumbaError
        if not isinstance(e, NumbaError):
            raise
        mask_mod = getattr(mask, "mask_mod", mask)
        names = ", ".join(f"{what} {getattr(fn, '__qualname__', repr(fn))!r}" for what, fn in
                          (("score_mod", score_mod), ("mask_mod", mask_mod), ("score_mod_grad", score_mod_grad))
                          if fn is not None)
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))        # (Numba highlights its messages on a terminal)
        first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
        raise TypeError(f"Numba could not compile the flex_attention functions ({names}) into the kernels: "
                        f"{first} (a function may use arithmetic, comparisons, abs, min/max, math and cmath, and "
                        "read arrays, numbers and tuples it captures; the full message is the cause below)") from e


def _call(query, key, value, score_mod, block_mask, scale, enable_gqa, score_mod_grad, backward, learned=()):
    """The call in flashnb's layout (views): ``(q, k, v, options)``, every argument checked before any launch.
    ``learned``: the names of the captured arrays whose gradients the backward adds (``options["learned"]``: their
    ``_Learned`` buffers, zeroed by the caller before the launch)."""
    for x, name in ((query, "query"), (key, "key"), (value, "value")):
        if len(getattr(x, "shape", ())) != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seqlen, dim), got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
    hq, hkv = int(query.shape[1]), int(key.shape[1])
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if hq != hkv and not enable_gqa:
        raise ValueError(f"query has {hq} heads and key {hkv}: grouped heads need enable_gqa=True")
    q, k, v = (_swap(x) for x in (query, key, value))
    L, S = int(query.shape[2]), int(key.shape[2])
    probe = L > 0 and S > 0
    dims = (int(query.shape[0]), hq, L, S)                # the probes' corners (none where an axis is empty)
    dims = dims if min(dims) > 0 else None
    prints = {}                               # each function's captures hashed once a call (``_fingerprint``)

    def checked(fn, what, check):
        if id(fn) not in prints:
            prints[id(fn)] = _fingerprint(fn)
        return _checked(fn, what, check, prints[id(fn)])

    if score_mod is not None:
        checked(score_mod, ("score_mod", 5, dims), lambda: _check_mod(score_mod, "score_mod", 5, dims))
    grad = None
    if backward and score_mod is not None:
        if score_mod_grad is not None:
            checked(score_mod_grad, ("score_mod_grad", 5, dims),
                    lambda: _check_mod(score_mod_grad, "score_mod_grad", 5, dims))
            grad = score_mod_grad
        elif probe:
            checked(score_mod, ("complex step",), lambda: _check_complex_step(score_mod))
    mask_mod = None
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a BlockMask (flashnb.create_block_mask), got "
                            f"{type(block_mask).__name__}")
        if (block_mask.q_len, block_mask.kv_len) != (L, S):
            raise ValueError(f"block_mask was made for Q_LEN={block_mask.q_len}, KV_LEN={block_mask.kv_len}; this "
                             f"call has {L} queries and {S} keys")
        states, (bq, bk) = block_mask.states, block_mask.block_size
        nb, nh = states.shape[:2]
        if states.ndim != 4 or states.dtype != np.int8 or states.shape[2:] != (-(-L // bq), -(-S // bk)):
            raise ValueError(f"block_mask's states must be int8 (B or 1, H or 1, {-(-L // bq)}, {-(-S // bk)}) for "
                             f"its block size {block_mask.block_size}, got {states.dtype} {states.shape}")
        if nb not in (1, int(query.shape[0])) or nh not in (1, hq):
            raise ValueError(f"block_mask's states {states.shape} do not fit batch {query.shape[0]} "
                             f"and {hq} query heads")
        if block_mask.mask_mod is None:
            raise ValueError("block_mask has no mask_mod (make it with flashnb.create_block_mask)")
        mask_mod = block_mask.mask_mod
        checked(mask_mod, ("block_mask's mask_mod", 4, dims),
                lambda: _check_mod(mask_mod, "block_mask's mask_mod", 4, dims))
    captured = sum(checked(fn, ("constant bytes",), lambda fn=fn: _constant_bytes(fn))
                   for fn in (score_mod, mask_mod, grad) if fn is not None)
    if captured > MAX_CAPTURED_BYTES:
        raise ValueError(f"the functions capture {captured} bytes of NumPy arrays together (counted once per place "
                         "the code reads an array: Numba freezes a copy for each); they are frozen into the kernel's "
                         f"constant memory ({MAX_CAPTURED_BYTES} bytes at most)")
    mods = None
    if score_mod is not None or mask_mod is not None:
        fp = prints.get
        f32 = _arrays.kind_of(query, "query").dtype != "float64"        # the kernels accumulate in float32
        # (a mask_mod keeps its float64 constants: it returns a bool, and create_block_mask and the oracle
        # decide its blocks in float64)
        narrow = bool(int(plan.FLEX_MASK_NARROW) & (2 if backward else 1)) and mask_mod is not None
        mods = Mods(_compiled(score_mod, f32, fp(id(score_mod))),
                    _compiled(mask_mod, False, fp(id(mask_mod)), int32_compares=narrow),
                    _compiled(grad, f32, fp(id(grad))) if grad is not None
                    else _complex_step(score_mod, f32, fp(id(score_mod))) if backward and score_mod else None,
                    None if mask_mod is None else block_mask.block_size,
                    bool(plan.FLEX_MOD_INT32) and score_mod is not None, int(plan.FLEX_MASK_WRITTEN),
                    bool(plan.FLEX_MASK_INT32) and mask_mod is not None, mask_narrow=narrow)
    entries = ()
    if learned:
        f32 = _arrays.kind_of(query, "query").dtype != "float64"
        checked(score_mod, ("captured steps", learned, dims), lambda: check_captured_grads(score_mod, learned, dims))
        capture, entries = checked(score_mod, ("captured grads", learned, f32),
                                   lambda: _capture_grad(score_mod, learned, f32, prints[id(score_mod)]))
        mods = mods._replace(capture_grad=capture)
    options = dict(softmax_scale=scale, causal=False, window_size=(-1, -1), attn_mask=None, attn_bias=None,
                   alibi_slopes=None, softcap=0.0,
                   block_mask=None if block_mask is None else block_mask.states_like(query),
                   block_mask_size=(128, 128) if block_mask is None else block_mask.block_size,
                   dropout_p=0.0, seed=0, mods=mods)
    if backward:
        options["learned"] = entries
    return q, k, v, options


MAX_CAPTURED_BYTES = 65536        # the device's constant memory, where Numba freezes a captured NumPy array
_CHECKED = {}                     # (function, what, its captures' fingerprint) -> the host check's result
_MAX_CHECKED = 4096


def _checked(fn, what, check, fingerprint):
    """``check()``'s result (a check raises on a bad function), computed once per function, ``what`` and
    ``_fingerprint``: a function's behaviour on the host is its code and what it captures, so a call with the same
    function and captures skips the probes (the complex step's twelve calls, ``dis`` of its code), and a changed
    capture checks again (``fingerprint``: ``_fingerprint(fn)``, which the caller hashes once for every use)."""
    key = (fn, what, fingerprint)
    if key not in _CHECKED:
        result = check()
        if len(_CHECKED) >= _MAX_CHECKED:   # (a new lambda a call is a new key: bounded)
            _CHECKED.clear()
        _CHECKED[key] = result
    return _CHECKED[key]


def _check_mod(fn, name, nargs, dims=None):
    """A callable that takes ``nargs`` positional arguments, captures what the kernels can read
    (``_check_captures``; NumPy arrays within constant memory), and returns what its kind must: a real number
    (score_mod, score_mod_grad) or a bool (mask_mod).  Probed on the host (a score of 0.5; captured device arrays
    read from host copies) at the corners of the call's index space ``dims`` = ``(B, H, Q_LEN, KV_LEN)``: first
    index 0, then every combination of the first and last ``b``, ``h``, ``q_idx``,
    ``kv_idx`` (16 calls), so that a captured table too short for the indices (``doc[q_idx]`` with fewer ids than
    queries, ``bias[q_idx - kv_idx + n]`` with too large an ``n``) raises here, naming the indices, instead of
    being read past its end in a kernel (which no GPU reports: the values are wrong).  A negative index wraps
    around, on the host as in the kernels (too small an ``n`` reads the table's other end, alike in both: not
    caught).  ``dims`` None: not probed (an empty axis)."""
    if not callable(fn):
        raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
    _check_captures(fn, name)
    nbytes = _constant_bytes(fn)
    if nbytes > MAX_CAPTURED_BYTES:
        raise ValueError(f"{name} captures {nbytes} bytes of NumPy arrays (counted once per place its code reads "
                         "an array: Numba freezes a copy for each); they are frozen into the kernel's constant memory "
                         f"({MAX_CAPTURED_BYTES} bytes at most)")
    if dims is None:                           # (an empty sequence: no index to call it at)
        return
    corners = [(0, 0, 0, 0)] + sorted(set(itertools.product(*((0, int(n) - 1) for n in dims))) - {(0, 0, 0, 0)})
    fn = _on_host(fn)                          # (captured device arrays: their host copies, for the probes)
    for index in corners:
        try:
            got = fn(*((0.5,) if nargs == 5 else ()), *index)
        except Exception as e:                 # noqa: BLE001 (any failure of the caller's function, named)
            raise ValueError(f"{name} failed on (b, h, q_idx, kv_idx) = {index}: {type(e).__name__}: {e}") from e
        if nargs == 4 and not isinstance(got, (bool, np.bool_)):
            raise TypeError(f"mask_mod must return a bool, got {type(got).__name__} at (b, h, q_idx, kv_idx) = "
                            f"{index}")
        if nargs == 5 and (not isinstance(got, numbers.Real) or isinstance(got, (bool, np.bool_))):
            raise TypeError(f"{name} must return a real number, got {type(got).__name__} at (b, h, q_idx, kv_idx) "
                            f"= {index}")


def _check_captures(fn, name):
    """What ``fn`` captures is something the kernels can read: NumPy arrays (frozen), device arrays with the CUDA
    array interface (read in place; a tensor that requires grad is read detached: its gradient is
    ``flex_attention_backward``'s ``captured_grads``, or ``flashnb.torch.flex_attention``'s autograd), numbers
    and tuples."""
    torch = _arrays.torch
    for var, value in _captured(fn):
        if isinstance(value, np.ndarray):
            continue
        elif isinstance(value, (list, dict, set)):
            raise TypeError(f"{name} captures the {type(value).__name__} {var!r}, which Numba cannot compile into a "
                            "kernel; capture a tuple or a NumPy array")
        elif _is_device_array(value):
            _check_device_capture(name, var, value)
        elif hasattr(value, "__dlpack__"):
            raise TypeError(f"{name} captures {var!r} ({type(value).__name__}), an array without the CUDA array "
                            "interface: capture a NumPy array, or a PyTorch, CuPy or Numba device array")


def _is_device_array(value):
    """A PyTorch CUDA tensor, a CuPy or Numba device array (anything with the CUDA array interface), or the
    simulator's stand-in for the last."""
    torch = _arrays.torch
    if torch is not None and isinstance(value, torch.Tensor):
        return value.is_cuda
    if isinstance(value, np.ndarray):
        return False
    if _arrays._is_numba_device_array(value):
        return True
    try:
        return getattr(value, "__cuda_array_interface__", None) is not None
    except Exception:                       # noqa: BLE001 (an interface that refuses: not one a kernel can read)
        return False


_TORCH_READABLE = ("bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64")


def _device_layout(value):
    """``(address, dtype, shape, strides)`` of a device array: what a kernel that reads it in place depends on
    (the simulator's stand-in: its host buffer's)."""
    torch = _arrays.torch
    if torch is not None and isinstance(value, torch.Tensor):
        return value.data_ptr(), str(value.dtype), tuple(value.shape), tuple(value.stride())
    iface = getattr(value, "__cuda_array_interface__", None)
    if iface is None:                                    # (the simulator's device array holds a NumPy array)
        ary = value._ary
        return ary.ctypes.data, ary.dtype.str, ary.shape, ary.strides
    return iface["data"][0], iface["typestr"], tuple(iface["shape"]), tuple(iface.get("strides") or ())


def _check_device_capture(name, var, value):
    """A captured device array is read in place by the kernels, as numba-cuda compiles a captured CUDA array
    (its address embedded in the code, its values read when the kernel runs): it must hold bools, integers or
    floats (a PyTorch tensor of a dtype NumPy has)."""
    torch = _arrays.torch
    if torch is not None and isinstance(value, torch.Tensor):
        kind = str(value.dtype).replace("torch.", "")
        ok = kind in _TORCH_READABLE
    else:
        kind = str(np.dtype(_device_layout(value)[1]))
        ok = np.dtype(kind).kind in "biuf"
    if not ok:
        raise TypeError(f"{name} captures the device array {var!r} of type {kind}: a captured device array must "
                        "hold bools, integers or floats (float16, float32 or float64)")


def _on_host(fn):
    """``fn`` with each captured device array replaced by its host copy (the host probes run Python: a PyTorch
    tensor's element is a tensor, not a number); ``fn`` itself when it captures none."""
    return _with_captures(fn, _is_device_array, _host_copy)


def _with_captures(fn, matches, transform):
    """``fn`` with each value it captures (a closure cell, or a global its code reads) for which ``matches`` holds
    replaced by ``transform(value)``; ``fn`` itself where none does."""
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return fn
    cells = fn.__closure__ or ()
    held = [i for i, c in enumerate(cells) if matches(_cell_value(c))]
    glob_held = [n for n in code.co_names if matches(fn.__globals__.get(n))]
    if not held and not glob_held:
        return fn
    glob = dict(fn.__globals__)
    for n in glob_held:
        glob[n] = transform(glob[n])
    closure = tuple(types.CellType(transform(c.cell_contents)) if i in held else c for i, c in enumerate(cells))
    new = types.FunctionType(code, glob, fn.__name__, fn.__defaults__, closure or None)
    new.__qualname__, new.__module__ = fn.__qualname__, fn.__module__
    return new


def _host_copy(value):
    torch = _arrays.torch
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if hasattr(value, "copy_to_host"):                   # Numba device arrays (the simulator's too)
        return value.copy_to_host()
    if hasattr(value, "get"):                            # CuPy
        return value.get()
    return np.asarray(value)


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:                     # an empty cell
        return None


def _constant_bytes(fn):
    """The constant memory ``fn``'s captured NumPy arrays take in a kernel: each array's bytes once per place
    the code loads it (measured: ptxas counted ``ids[i] == ids[j]`` over a 40000-byte array as 80000 bytes)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return 0
    arrays = {var: value.nbytes for var, value in _captured(fn) if isinstance(value, np.ndarray)}
    if not arrays:
        return 0
    loads = [ins.argval for ins in dis.get_instructions(code)
             if ins.opname in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME", "LOAD_CLASSDEREF")]
    return sum(nbytes * max(1, loads.count(var)) for var, nbytes in arrays.items())


def _captured(fn):
    """``(name, value)`` of what ``fn`` reads from its closure and its module's globals."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    cells = zip(code.co_freevars, fn.__closure__ or ())
    found = []
    for var, cell in cells:
        try:
            found.append((var, cell.cell_contents))
        except ValueError:                 # an empty cell
            continue
    glob = getattr(fn, "__globals__", {})
    found += [(var, glob[var]) for var in code.co_names if var in glob]
    return found


def _captured_grad_names(captured_grads, score_mod, deterministic):
    """``captured_grads`` as a tuple of names, checked (``flex_attention_backward``)."""
    if isinstance(captured_grads, str):
        captured_grads = (captured_grads,)
    try:
        names = tuple(captured_grads)
    except TypeError:
        raise TypeError(f"captured_grads must be a sequence of names, got {type(captured_grads).__name__}") from None
    if not names:
        return ()
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise TypeError(f"captured_grads must name each captured array once, as str, got {names!r}")
    if score_mod is None:
        raise ValueError("captured_grads needs a score_mod (the arrays are what it captures)")
    if deterministic:
        raise ValueError("captured_grads adds into the arrays' gradients with atomics, whose order varies: it cannot "
                         "be deterministic=True")
    found = dict(_captured(score_mod))
    for name in names:
        if name not in found:
            raise ValueError(f"captured_grads names {name!r}, which the score_mod does not capture (its closure and "
                             "the globals its own code reads)")
        kind = _learned_kind(found[name])
        if kind is None:
            raise TypeError(f"captured_grads: {name!r} is a {type(found[name]).__name__} of "
                            f"{getattr(found[name], 'dtype', '?')}; a gradient is taken into a float32 or float64 "
                            "NumPy array, PyTorch CUDA tensor, CuPy or Numba device array")
    return names


def _learned_kind(value):
    """"numpy", "torch", "cupy" or "numba" for a float32 or float64 array a gradient can be taken into, else None."""
    torch = _arrays.torch
    if isinstance(value, np.ndarray):
        lib, dtype = "numpy", value.dtype
    elif torch is not None and isinstance(value, torch.Tensor):
        if not value.is_cuda or value.dtype not in (torch.float32, torch.float64):
            return None
        return "torch"
    elif _arrays.cupy is not None and isinstance(value, _arrays.cupy.ndarray):
        lib, dtype = "cupy", value.dtype
    elif _arrays._is_numba_device_array(value):
        lib, dtype = "numba", value.dtype
    else:
        return None
    return lib if np.dtype(dtype) in (np.float32, np.float64) and value.ndim >= 1 else None


class _Learned:
    """A captured array's gradient buffer (float32, or float64 for float64 inputs), read by the kernels at its
    address (captured by ``capture_grad``): ``zero()`` before a backward, ``result()`` after it, a new array of the
    captured one's kind and dtype."""

    def __init__(self, name, table, float32):
        self.name, self.table, self.kind = name, table, _learned_kind(table)
        acc = np.float32 if float32 else np.float64
        shape = tuple(int(n) for n in table.shape)
        if self.kind == "torch":
            torch = _arrays.torch
            self.buffer = torch.zeros(shape, dtype=torch.float32 if float32 else torch.float64, device=table.device)
        elif self.kind == "cupy":
            with _arrays.cupy.cuda.Device(table.device.id):
                self.buffer = _arrays.cupy.zeros(shape, acc)
        else:
            from numba import cuda
            self.buffer = cuda.to_device(np.zeros(shape, acc))
        self.shape = shape

    def zero(self, lib):
        """Zeroed before a backward whose inputs are of the library ``lib`` (the kernels run on its current stream:
        a buffer of another library's is zeroed, then the device synchronised)."""
        if self.kind in ("torch", "cupy"):
            self.buffer.fill_(0) if self.kind == "torch" else self.buffer.fill(0)
        else:
            self.buffer.copy_to_device(np.zeros(self.shape, self.buffer.dtype))
        self._sync(lib)

    def _sync(self, lib):
        if self.kind != lib and self.kind != "numpy" and not _arrays.SIMULATOR:
            from numba import cuda
            cuda.synchronize()

    def result(self, lib):
        """A new array of the captured one's kind and dtype, after the backward (inputs of the library ``lib``)."""
        if self.kind != lib and not _arrays.SIMULATOR:
            from numba import cuda
            cuda.synchronize()
        if self.kind == "torch":
            return self.buffer.to(self.table.dtype, copy=True)
        if self.kind == "cupy":
            return self.buffer.astype(self.table.dtype)
        host = self.buffer.copy_to_host().astype(self.table.dtype)
        if self.kind == "numpy":
            return host
        from numba import cuda
        return cuda.to_device(host)


def _capture_grad(score_mod, names, float32, fingerprint):
    """``(capture_grad, entries)``: the device function the dK/dV kernels call (``kernels._mod_grad``), over the
    compiled site functions of each named array's reads, and the arrays' ``_Learned`` buffers, which it captures.
    Made once per function, its captures' fingerprint and precision (``_checked``): the same buffers and the
    same kernels for every call with the same captures."""
    from .kernels import _mod_grad
    fn = _detached(score_mod)
    found = dict(_captured(fn))
    if float32:
        step, inv_t = np.complex64(1j * COMPLEX_STEP_FLOAT32), np.float32(1.0 / COMPLEX_STEP_FLOAT32)
    else:
        step, inv_t = 1j * COMPLEX_STEP, 1.0 / COMPLEX_STEP
    sites, buffers, shapes, entries = [], [], [], []
    for name in names:
        table = found[name]
        made = _mod_grad.site_functions(fn, name, len(table.shape), step, _label(score_mod))
        entry = _Learned(name, table, float32)
        entries.append(entry)
        for site in made:
            sites.append(_compiled(site, float32, fingerprint))
            buffers.append(entry.buffer)
            shapes.append(entry.shape)
    return _mod_grad.make_capture_grad(sites, buffers, shapes, inv_t), tuple(entries)


def _label(fn):
    return f"score_mod {getattr(fn, '__qualname__', repr(fn))!r}"


def check_captured_grads(score_mod, names, dims):
    """What ``captured_grads`` needs of ``score_mod``, checked on the host before any launch (``kernels._mod_grad``'s
    rewrite of each read of the named arrays, then ``_check_site_steps`` at the corners of the index space ``dims``
    = ``(B, H, Q_LEN, KV_LEN)``); ValueError naming the function and the array."""
    from .kernels import _mod_grad
    fn = _detached(score_mod)
    found = dict(_captured(fn))
    for name in names:
        table = found[name]
        sites = _mod_grad.site_functions(fn, name, len(table.shape), 1e-30j, _label(score_mod))
        if dims is not None:
            _check_site_steps(fn, name, sites, table, dims, _label(score_mod))


def _check_site_steps(fn, name, sites, table, dims, label):
    """Each site function's complex step agrees with a central difference of ``fn`` in the entry it read, on the
    host with a score of 0.5 at index 0 and the corners of ``dims`` (as ``_check_mod``): a function that drops the
    imaginary part of the entry on a path the static checks of ``kernels._mod_grad`` do not see would give a
    gradient of 0 silently.  ValueError otherwise."""
    from .kernels import _mod_grad
    host = _on_host(fn)
    values = np.asarray(_host_copy(table), np.float64)
    corners = [(0, 0, 0, 0)] + sorted(set(itertools.product(*((0, int(n) - 1) for n in dims))) - {(0, 0, 0, 0)})
    for site in sites:
        site = _on_host(site)
        for index in corners:
            try:
                got, at = site(0.5, *index)
            except TypeError as e:
                raise ValueError(f"{label} cannot take a complex entry of {name!r} (math.* on it?), so its gradient "
                                 f"cannot be taken by the complex step: use cmath ({e})") from e
            if at[0] == _mod_grad.MISSING:
                continue
            step = complex(got).imag / abs(complex(site.__globals__[_mod_grad.STEP]))
            h = 1e-6 * (1.0 + abs(float(values[at])))
            ends = []
            for sign in (1, -1):
                moved = values.copy()
                moved[at] += sign * h
                ends.append(float(_rebound(host, name, moved)(0.5, *index)))
            fd = (ends[0] - ends[1]) / (2 * h)
            if not abs(step - fd) <= 1e-3 * (1.0 + abs(fd)):
                raise ValueError(f"{label}'s complex step in {name!r} ({step:.6g} at (b, h, q_idx, kv_idx) = "
                                 f"{index}) disagrees with its central difference ({fd:.6g}): it drops the entry's "
                                 f"imaginary part, so its gradient in {name!r} cannot be taken")


def _rebound(fn, name, value):
    """``fn`` with its captured ``name`` (a closure variable or a global its code reads) bound to ``value``."""
    code = fn.__code__
    glob, cells = fn.__globals__, fn.__closure__ or ()
    if name in code.co_freevars:
        at = code.co_freevars.index(name)
        cells = tuple(types.CellType(value) if i == at else c for i, c in enumerate(cells))
    else:
        glob = dict(glob)
        glob[name] = value
    return types.FunctionType(code, glob, fn.__name__, fn.__defaults__, cells or None)


def _check_complex_step(score_mod):
    """The backward without ``score_mod_grad`` differentiates by the complex step: the score_mod must take a
    complex score and keep its imaginary part, so that the step agrees with a central difference (probed at
    index 0 and three scores; ``abs(score)`` takes a complex score but returns a real number).  A score_mod that
    computes in float32 (a captured float32 array: NumPy keeps the Python score's float as float32) returns a
    NumPy complex64 step and float32 differences, so its central difference takes a wider step and tolerance."""
    _check_captures(score_mod, "score_mod")
    score_mod = _on_host(score_mod)            # (captured device arrays: their host copies)
    for s in (-0.7, 0.5, 1.3):
        try:
            got = score_mod(complex(s, COMPLEX_STEP), 0, 0, 0, 0)
        except TypeError as e:
            raise ValueError("score_mod cannot take a complex score (math.* on the score, or a comparison of it), "
                             "so the backward cannot differentiate it by the complex step: use cmath, or pass "
                             f"score_mod_grad ({e})") from e
        if not isinstance(got, numbers.Number) or isinstance(got, (bool, np.bool_)):
            raise TypeError(f"score_mod must return a number, got {type(got).__name__}")
        step = complex(got).imag / COMPLEX_STEP
        low = isinstance(score_mod(s, 0, 0, 0, 0), (np.float32, np.float16))    # (float32 arithmetic)
        h, tol = (1e-2, 1e-3) if low else (1e-6, 1e-4)
        fd = (float(score_mod(s + h, 0, 0, 0, 0)) - float(score_mod(s - h, 0, 0, 0, 0))) / (2 * h)
        if not abs(step - fd) <= tol * (1.0 + abs(fd)):
            raise ValueError(f"score_mod's complex step ({step:.6g} at score {s}) disagrees with its central "
                             f"difference ({fd:.6g}): it drops the score's imaginary part (abs(score)?); pass "
                             "score_mod_grad")


_COMPILED = {}


def _compiled(fn, float32=False, fingerprint=None, int32_compares=False):
    """``fn`` as a device function: one per function and values it captures (Numba freezes a captured array or
    number into the kernel, so a changed value must mean a new compile, never the old kernel); ``fingerprint``:
    ``_fingerprint(fn)`` where the caller has it.  ``float32``: for kernels that accumulate in float32 (16-bit and
    float32 inputs), its Python float constants as float32 (``_float32_constants``) and its integers meeting
    float32 as float32 (``kernels._mod_float32``): PyTorch's rules, not NumPy's float64.  ``int32_compares`` (a
    mask_mod, ``plan.FLEX_MASK_NARROW``): its integer comparisons in int32 where both sides' bounds fit."""
    if fn is None:
        return None
    key = (fn, _fingerprint(fn) if fingerprint is None else fingerprint, float32, int32_compares)
    if key not in _COMPILED:
        src = _detached(fn)
        src = _float32_constants(src) if float32 else src
        dev = _COMPILED[key] = (float32_device_function(src) if float32
                                else int32_compare_device_function(src) if int32_compares else device_function(src))
        ident = _stable_id(src)
        if ident is not None:
            dev.flashnb_id = (ident + (" float32-arithmetic" if float32 else "")      # (a new name: 7c42c7f's differ)
                              + (" int32-compares" if int32_compares else ""))
    return _COMPILED[key]


def _detached(fn):
    """``fn`` with each captured PyTorch tensor that requires grad replaced by its ``detach()`` (the same memory:
    numba-cuda reads a tensor through its CUDA array interface, which such a tensor refuses); ``fn`` itself when
    it captures none."""
    torch = _arrays.torch
    if torch is None:
        return fn
    return _with_captures(fn, lambda value: isinstance(value, torch.Tensor) and value.requires_grad,
                          lambda value: value.detach())


def _float32_constants(fn):
    """``fn`` with its Python float constants (literals, closure cells, module globals it reads) as
    ``np.float32``, so that a mod like ``30 * math.tanh(score / 30)`` computes in float32, as the kernel's scores
    do, and not in float64 (measured in ptxas on the Hopper forward: 150 DFMA and S pushed to local memory).
    PyTorch's FlexAttention computes a score_mod in the scores' dtype likewise; the oracle stays float64.  A
    function with no float constant comes back as it is."""
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return fn
    cells = fn.__closure__ or ()
    floats = [i for i, c in enumerate(cells) if _cell_float(c)]
    glob_floats = [n for n in code.co_names if type(fn.__globals__.get(n)) is float]
    if not (any(type(c) is float for c in code.co_consts) or floats or glob_floats):
        return fn
    consts = tuple(np.float32(c) if type(c) is float else c for c in code.co_consts)
    code, consts = _reciprocal_divisions(code, consts)
    glob = fn.__globals__
    if glob_floats:
        glob = dict(glob)
        for n in glob_floats:
            glob[n] = np.float32(glob[n])
    closure = tuple(types.CellType(np.float32(c.cell_contents)) if i in floats else c for i, c in enumerate(cells))
    new = types.FunctionType(code.replace(co_consts=consts), glob, fn.__name__, fn.__defaults__, closure or None)
    new.__qualname__, new.__module__ = fn.__qualname__, fn.__module__
    return new


_LOAD_CONST, _BINARY_OP = dis.opmap["LOAD_CONST"], dis.opmap.get("BINARY_OP")
_NB = {name: i for i, (name, _) in enumerate(getattr(dis, "_nb_ops", ()))}


def _reciprocal_divisions(code, consts):
    """``x / c`` with ``c`` a float literal rewritten as ``x * (1 / c)`` (``c`` in ``consts``, already float32):
    IEEE division's slow path keeps ptxas from unrolling the kernels' tile loops around a mod (S then lives in
    local memory), and the product is within an ulp of the quotient.  Python 3.11's ``LOAD_CONST i; BINARY_OP /``
    pairs only; other code comes back as it is."""
    if _BINARY_OP is None or "NB_TRUE_DIVIDE" not in _NB:
        return code, consts
    raw, consts = bytearray(code.co_code), list(consts)
    ops = [(i, raw[i], raw[i + 1]) for i in range(0, len(raw), 2)]
    changed = False
    for (i, op, arg), (j, op2, arg2) in zip(ops, ops[1:]):
        if (op == _LOAD_CONST and op2 == _BINARY_OP and arg2 == _NB["NB_TRUE_DIVIDE"]
                and (i == 0 or raw[i - 2] != dis.EXTENDED_ARG) and type(consts[arg]) is np.float32
                and consts[arg] != 0):
            consts.append(np.float32(1) / consts[arg])
            if len(consts) > 255:
                return code, tuple(consts[:-1])
            raw[i + 1], raw[j + 1] = len(consts) - 1, _NB["NB_MULTIPLY"]
            changed = True
    if not changed:
        return code, tuple(consts)
    return code.replace(co_code=bytes(raw)), tuple(consts)


def _cell_float(cell):
    try:
        return type(cell.cell_contents) is float
    except ValueError:                     # an empty cell
        return False


_STABLE = (numbers.Number, str, bytes, tuple, type(None), np.ndarray, types.ModuleType, types.FunctionType)


def _stable_id(fn):
    """The name of ``fn`` in the disk cache of compiled kernels (``_jit.kernel_factory``), the same in every
    process: its qualified name and its code's digest.  The kernel's key adds the values it captures
    (``_jit.code_state``: arrays by their bytes, numbers by value, functions by their code), so a changed
    function or capture is a new entry.  None (compiled in each process, never cached on disk) when it captures
    anything else (an object whose value the key cannot name)."""
    if not isinstance(fn, types.FunctionType):
        return None
    if not all(isinstance(value, _STABLE) or hasattr(value, "py_func") for _, value in _captured(fn)):
        return None
    return f"flex {fn.__module__}.{fn.__qualname__} {_jit.code_digest(fn.__code__)[:32]}"


def _fingerprint(fn):
    """What of ``fn``'s captured values a kernel freezes: each NumPy array's dtype, shape and bytes (a hash),
    each device array's address and layout (its values are read in place), each number, string or tuple as it is,
    anything else by identity."""
    parts = []
    for var, value in _captured(fn):
        if isinstance(value, np.ndarray):
            digest = hashlib.blake2b(value.tobytes(), digest_size=16).digest()
            parts.append((var, value.dtype.str, value.shape, digest))
        elif _is_device_array(value):                # read in place: its address and layout, not its values
            parts.append((var, "device", _device_layout(value), _arrays.device_of(value)))
        elif isinstance(value, (numbers.Number, str, bytes, tuple, type(None))):
            parts.append((var, value))
        else:
            parts.append((var, id(value)))
    return tuple(parts)


_STEPS = {}


def _complex_step(score_mod, float32=False, fingerprint=None):
    """``d score_mod / d score`` as a device function: ``Im score_mod(s + i t) / t``, ``t = 1e-30``; for float32
    kernels in complex64 (``t = 2^-66``), as the score_mod's arithmetic is float32 there."""
    mod = _compiled(score_mod, float32, fingerprint)
    if mod not in _STEPS:
        if float32:
            T, INV_T = np.complex64(1j * COMPLEX_STEP_FLOAT32), np.float32(1.0 / COMPLEX_STEP_FLOAT32)

            @device_function
            def score_grad(score, b, h, q_idx, kv_idx):
                return mod(score + T, b, h, q_idx, kv_idx).imag * INV_T
        else:
            T, INV_T = COMPLEX_STEP, 1.0 / COMPLEX_STEP

            @device_function
            def score_grad(score, b, h, q_idx, kv_idx):
                return mod(complex(score, T), b, h, q_idx, kv_idx).imag * INV_T

        if getattr(mod, "flashnb_id", None) is not None:
            score_grad.flashnb_id = f"complex step of {mod.flashnb_id}"
        _STEPS[mod] = score_grad
    return _STEPS[mod]


def _swap(x):
    """``x`` with its dimensions 1 and 2 exchanged, a view: FlexAttention's ``(B, H, S, D)`` and flashnb's
    ``(B, S, H, D)``."""
    torch = _arrays.torch
    if torch is not None and isinstance(x, torch.Tensor):
        return x.transpose(1, 2)
    if _arrays._is_numba_device_array(x):               # (its swapaxes would copy to the host)
        shape = (x.shape[0], x.shape[2], x.shape[1]) + tuple(x.shape[3:])
        strides = (x.strides[0], x.strides[2], x.strides[1]) + tuple(x.strides[3:])
        if _arrays.SIMULATOR:
            return _arrays.strided_view(x, shape, strides)
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        return DeviceNDArray(shape, strides, x.dtype, stream=x.stream, gpu_data=x.gpu_data)
    if hasattr(x, "swapaxes"):
        return x.swapaxes(1, 2)
    raise TypeError(f"flex_attention takes NumPy, PyTorch, CuPy and Numba device arrays, got {type(x).__name__}")

