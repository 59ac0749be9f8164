"""The dispatch cache (flashnb/_dispatch.py) in the simulator: a replayed call computes what the full path
computes, every difference the plan reads is a miss, and a miss is validated from scratch.

The calls take Numba device arrays (the simulator's), which the cache records and replays like PyTorch
tensors on a GPU (tests/kernels/test_torch_gpu.py repeats the core of this there).  Shapes are tiny:
each call runs the kernels thread by thread.
"""
import numpy as np
import pytest
from numba import cuda

import flashnb
from flashnb import _dispatch, plan
from flashnb.kernels import _tma
from kernel_harness import assert_bitwise_equal, poison_outputs, recorded_then_replayed  # noqa: F401 (autouse)

OPTS = dict(causal=True, softcap=4.0)


@pytest.fixture(autouse=True)
def empty_cache():
    _dispatch.clear()
    yield
    _dispatch.clear()


def arrays(seed, dtype=np.float32, batch=1, seqlen_q=9, seqlen_k=11, nheads=2, nheads_k=1, headdim=8):
    rng = np.random.default_rng(seed)
    shapes = [(batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
              (batch, seqlen_k, nheads_k, headdim), (batch, seqlen_q, nheads, headdim)]
    return [cuda.to_device(rng.standard_normal(s).astype(dtype)) for s in shapes]


def host(*xs):
    return [x.copy_to_host() for x in xs]


def fwd_bwd(q, k, v, dout, **opts):
    out, lse = flashnb.flash_attention(q, k, v, return_lse=True, **opts)
    grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, **opts)
    return host(out, lse, *grads)


@pytest.mark.parametrize("dtype, backend", [(np.float32, "simt"), (np.float16, "tensorcore")])
def test_replay_computes_what_the_full_path_computes(dtype, backend):
    opts = dict(OPTS, backend=backend, block_q=16 if backend == "tensorcore" else 8, block_k=16)
    fwd_bwd(*arrays(0, dtype), **opts)                                    # recorded
    assert _dispatch.stats["recorded"] == 2
    new = arrays(1, dtype)                                                # the same signature, other data
    replayed = fwd_bwd(*new, **opts)
    assert _dispatch.stats["hits"] == 2
    _dispatch.clear()
    full = fwd_bwd(*new, **opts)                                          # the full path on the same data
    assert _dispatch.stats["hits"] == 0
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), replayed, full):
        assert_bitwise_equal(a, b, f"replayed {name}")
    assert not np.allclose(replayed[0], fwd_bwd(*arrays(0, dtype), **opts)[0]), "the replay ignored its inputs"


@pytest.mark.parametrize("replay_maps", [False, True])
def test_the_hopper_forward_with_tensor_maps(monkeypatch, replay_maps):
    """backend="wgmma" on a dense batch: its tiles by the copy engine, whose tensor maps hold the inputs'
    addresses.  Without ``REPLAY_TENSOR_MAPS`` such a call is never recorded (every call takes the full path);
    with it the replay re-derives the maps from the new inputs (``_tma.maps_for``) and computes what the full
    path computes."""
    monkeypatch.setattr(_dispatch, "REPLAY_TENSOR_MAPS", replay_maps)
    opts = dict(OPTS, backend="wgmma", block_q=64, block_k=16)
    q, k, v, _ = arrays(0, np.float16, seqlen_q=5, seqlen_k=7)
    flashnb.flash_attention(q, k, v, **opts)
    assert _dispatch.stats["recorded" if replay_maps else "unfit"] == 1
    new = arrays(1, np.float16, seqlen_q=5, seqlen_k=7)[:3]
    replayed = host(flashnb.flash_attention(*new, **opts))[0]
    assert _dispatch.stats["hits"] == (1 if replay_maps else 0)
    replayed_specs = list(_tma.SPECS.values())
    assert [_dispatch._ptr(x) for x in new] in [[spec[0] for spec in specs] for specs in replayed_specs], (
        "no tensor maps of the new inputs' addresses")
    _dispatch.clear()
    full = host(flashnb.flash_attention(*new, **opts))[0]
    assert_bitwise_equal(replayed, full, "replayed out")
    assert not np.allclose(replayed, host(flashnb.flash_attention(q, k, v, **opts))[0]), "the replay ignored its inputs"


def test_tensor_maps_are_copied_from_pinned_rows_on_the_launch_stream(monkeypatch):
    """The GPU's path of ``_tma.maps_for``, its driver faked: a new set of maps is encoded into rows of the
    pinned arena and copied to the same rows of the device arena on the given stream; the same specs on the
    same stream reuse them (no copy), another stream gets its own copy; the arena hands out each row once,
    and starts over only after the device has drained (``synchronize``), when ``_MAX_MAPS`` sets are kept."""
    import ctypes
    from flashnb.kernels import _jit
    copies, syncs = [], []

    class Driver:
        @staticmethod
        def cuMemcpyHtoDAsync(dst, src, nbytes, stream):
            copies.append((dst, src, nbytes, stream))
            ctypes.memmove(dst, src, nbytes)
            return (0,)

    monkeypatch.setattr(_tma, "SIMULATOR", False)
    monkeypatch.setattr(_tma, "_driver", lambda: Driver)
    monkeypatch.setattr(_jit, "current_context", lambda: 1)
    monkeypatch.setattr(_tma, "encode_map", lambda ptr, shape, strides, rows: [ptr, rows] + [7] * 14)
    monkeypatch.setattr(_tma.cuda, "synchronize", lambda: syncs.append(len(copies)))
    monkeypatch.setattr(_tma, "_MAX_MAPS", 4)
    monkeypatch.setattr(_tma, "_ARENA_ROWS", 10)
    monkeypatch.setattr(_tma, "_arenas", {})
    monkeypatch.setattr(_tma, "_maps", {})
    monkeypatch.setattr(_tma, "SPECS", {})

    def specs(i, n=2):
        return tuple((1000 * i + j, (1, 8, 2, 4), (64, 8, 4, 1), 64) for j in range(n))

    a = _tma.maps_for(specs(1), 5)
    arena = _tma._arenas[1]
    assert copies == [(arena.device_ptr, arena.host_ptr, 256, 5)]
    assert (a.ptr, a.shape) == (arena.device_ptr, (2, 16))
    assert arena.device[:2, :2].tolist() == [[1000, 64], [1001, 64]]
    assert _tma.maps_for(specs(1), 5) is a and len(copies) == 1
    b = _tma.maps_for(specs(1), 6)
    assert b.ptr == arena.device_ptr + 256 and copies[-1][3] == 6
    assert _tma.SPECS[a.ptr] == _tma.SPECS[b.ptr] == specs(1)
    c = _tma.maps_for(specs(2, 3), 5)                       # rows 4-6
    d = _tma.maps_for(specs(3, 1), 5)                       # row 7: 4 sets kept
    assert (c.ptr - a.ptr, d.ptr - a.ptr) == (4 * 128, 7 * 128) and not syncs
    e = _tma.maps_for(specs(4), 5)                          # a fifth set: drain, start over at row 0
    assert syncs == [4] and e.ptr == arena.device_ptr and list(_tma._maps) == [(specs(4), 5)]
    assert arena.device[:2, :2].tolist() == [[4000, 64], [4001, 64]]
    _tma.maps_for(specs(5, 3), 5)
    _tma.maps_for(specs(6, 3), 5)                           # rows 2-7: the arena holds 10
    f = _tma.maps_for(specs(7, 3), 5)                       # too few rows left: drain, start over
    assert syncs == [4, 7] and f.ptr == arena.device_ptr


def test_every_difference_the_plan_reads_is_a_miss():
    q, k, v, _ = arrays(0)
    flashnb.flash_attention(q, k, v, **OPTS)
    base_misses = _dispatch.stats["misses"]
    strided = cuda.to_device(np.random.default_rng(2).standard_normal((1, 11, 2, 8)).astype(np.float32))[:, :, :1]
    variants = [
        dict(q=arrays(0, seqlen_q=8)[0]),                    # shape
        dict(k=strided),                                     # strides
        dict(q=arrays(0, dtype=np.float64)[0], k=arrays(0, dtype=np.float64)[1],
             v=arrays(0, dtype=np.float64)[2]),              # dtype
        dict(softcap=4.5), dict(causal=False), dict(softmax_scale=0.3), dict(window_size=(3, 0)),
        dict(block_q=4), dict(backend="simt"),               # options
        dict(v=k),                                           # which arrays share an address
    ]
    for n, change in enumerate(variants, 1):
        call = dict(dict(q=q, k=k, v=v), **OPTS)
        call.update(change)
        flashnb.flash_attention(**call)
        assert _dispatch.stats["misses"] == base_misses + n, f"variant {change} was not a miss"
    assert _dispatch.stats["hits"] == 0


def test_a_miss_is_validated_from_scratch():
    q, k, v, _ = arrays(0)
    mask = cuda.to_device(np.ones((1, 1, 9, 11), np.bool_))
    flashnb.flash_attention(q, k, v, attn_mask=mask)
    with pytest.raises(ValueError, match="attn_mask"):
        flashnb.flash_attention(arrays(0, seqlen_q=7)[0], k, v, attn_mask=mask)
    with pytest.raises(TypeError, match="dtype"):
        flashnb.flash_attention(q, k, arrays(0, dtype=np.float64)[2], attn_mask=mask)
    with pytest.raises(TypeError, match="causal"):
        flashnb.flash_attention(q, k, v, attn_mask=mask, causal=1)
    with pytest.raises(ValueError, match="softcap"):
        flashnb.flash_attention(q, k, v, attn_mask=mask, softcap=-1.0)
    assert _dispatch.stats["hits"] == 0 and _dispatch.stats["recorded"] == 1


@pytest.mark.parametrize("what", ["numpy", "stream", "dropout"])
def test_calls_the_cache_does_not_take(what):
    q, k, v, _ = arrays(0)
    kw = {}
    if what == "numpy":
        q, k, v = host(q, k, v)
    elif what == "stream":
        kw = dict(stream=cuda.stream())
    else:
        kw = dict(dropout_p=0.25, seed=3)
    a = flashnb.flash_attention(q, k, v, **kw)
    b = flashnb.flash_attention(q, k, v, **kw)
    assert _dispatch.stats == {"hits": 0, "misses": 0, "recorded": 0, "unfit": 0, "unrecorded": 0, "steps": 0}
    a, b = (x if isinstance(x, np.ndarray) else x.copy_to_host() for x in (a, b))
    assert_bitwise_equal(a, b, f"{what}: two calls")


def test_the_oldest_recordings_are_dropped(monkeypatch):
    monkeypatch.setattr(_dispatch, "MAX_ENTRIES", 2)
    q, k, v, _ = arrays(0)
    for softcap in (1.0, 2.0, 3.0):
        flashnb.flash_attention(q, k, v, softcap=softcap)
    assert len(_dispatch._CACHE) == 2
    flashnb.flash_attention(q, k, v, softcap=1.0)                      # dropped: recorded again
    assert _dispatch.stats["hits"] == 0 and _dispatch.stats["recorded"] == 4
    flashnb.flash_attention(q, k, v, softcap=1.0)
    assert _dispatch.stats["hits"] == 1


def test_an_op_that_keeps_missing_stops_recording_until_a_hit(monkeypatch):
    """A decoding loop's calls never come back (a new key count each step): past MISS_STREAK misses in a row
    only every RECORD_EVERY-th is recorded, so the loop neither pays for recordings nor evicts the useful
    ones; a recurring signature is still caught, and its hit ends the streak."""
    monkeypatch.setattr(_dispatch, "MISS_STREAK", 2)
    monkeypatch.setattr(_dispatch, "RECORD_EVERY", 3)
    q, k, v, _ = arrays(0)
    want = {}
    for softcap in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):                     # misses 1..6: 1, 2, 3 and 6 recorded
        want[softcap] = flashnb.flash_attention(q, k, v, softcap=softcap).copy_to_host()
    assert _dispatch.stats["recorded"] == 4 and _dispatch.stats["unrecorded"] == 2
    assert _dispatch._STREAK["forward"] == 6
    got = flashnb.flash_attention(q, k, v, softcap=6.0)                # recorded: a hit, the streak ends
    assert _dispatch.stats["hits"] == 1 and _dispatch._STREAK["forward"] == 0
    np.testing.assert_array_equal(got.copy_to_host(), want[6.0])
    got = flashnb.flash_attention(q, k, v, softcap=4.0)                # unrecorded, missed again: recorded now
    np.testing.assert_array_equal(got.copy_to_host(), want[4.0])
    assert _dispatch.stats["recorded"] == 5 and _dispatch.stats["unrecorded"] == 2


def test_signature_holds_types_and_refuses_what_it_cannot_key():
    q, k, v, _ = arrays(0)
    key_true, _ = _dispatch.signature("forward", (q, k, v), (True,))
    key_one, _ = _dispatch.signature("forward", (q, k, v), (1,))
    assert key_true != key_one                                         # True == 1, but only one is valid
    assert _dispatch.signature("forward", (q, k, v), ([3, 0],)) == (None, None)
    assert _dispatch.signature("forward", (host(q)[0], k, v), ()) == (None, None)


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_the_float32_hopper_forward_replays_maps_of_its_temporaries(monkeypatch, precision):
    """float32 on tf32 wgmma (``plan.WGMMA_TF32``): the pre-pass writes K's tf32 parts and V^T into temporaries of
    the call, whose tensor maps the forward reads; the replay allocates them anew, re-derives those maps from
    their addresses and computes what the full path computes."""
    monkeypatch.setattr(plan, "WGMMA_TF32", True)
    opts = dict(OPTS, backend="wgmma", block_q=64, block_k=16, precision=precision)
    q, k, v, _ = arrays(0, np.float32, seqlen_q=5, seqlen_k=7, headdim=8)
    flashnb.flash_attention(q, k, v, **opts)
    assert _dispatch.stats["recorded"] == 1
    new = arrays(1, np.float32, seqlen_q=5, seqlen_k=7, headdim=8)[:3]
    replayed = host(flashnb.flash_attention(*new, **opts))[0]
    assert _dispatch.stats["hits"] == 1
    _dispatch.clear()
    full = host(flashnb.flash_attention(*new, **opts))[0]
    assert_bitwise_equal(replayed, full, "replayed out")
    assert not np.allclose(replayed, host(flashnb.flash_attention(q, k, v, **opts))[0]), "the replay ignored its inputs"


def test_the_gpus_replay_patches_and_launches_what_was_recorded(monkeypatch):
    """The GPU's replay, run here on CPU tensors with stand-ins for the driver and PyTorch's stream: each launch's
    parameter words get this call's input addresses, its allocations' (a temporary's: its offset in the one
    scratch allocation) and tensor maps re-derived from them; the memset gets its allocation's address and
    count; every call its recorded grid, block, shared bytes and parameters, on the current stream; the outputs
    come back new, in order."""
    torch = pytest.importorskip("torch")
    from flashnb.kernels import _jit
    monkeypatch.setattr(_jit, "SIMULATOR", False)
    calls = []

    class Driver:
        def launch(self, *args):
            calls.append(("launch",) + tuple(getattr(a, "value", a) for a in args))
            return 0

        def memset(self, *args):
            calls.append(("memset",) + tuple(getattr(a, "value", a) for a in args))
            return 0

    monkeypatch.setattr(_dispatch, "_libcuda", Driver())
    monkeypatch.setattr(_dispatch, "_current_stream", lambda x: 77)
    maps_streams = []

    def maps_for(specs, stream):
        maps_streams.append(stream)                 # the maps are copied on the launch stream
        return type("Maps", (), {"ptr": specs[0][0] + 1})()
    monkeypatch.setattr(_tma, "maps_for", maps_for)
    cpu = torch.device("cpu")
    allocs = [("torch", (2, 3), torch.float32, cpu), ("torch", (5,), torch.float32, cpu),
              ("torch", (4,), torch.float16, cpu), ("torch", (7,), torch.float32, cpu)]
    bufs = [np.zeros(2 * 3 + 3, np.uint64) for _ in range(2)]     # two words an argument, then the pointer array
    params = [b.__array_interface__["data"][0] + 8 * 2 * 3 for b in bufs]
    steps = [("launch", 11, 3, 64, 1024, bufs[0], params[0], ((0, ("in", 1)), (2, ("alloc", 1)), (4, ("alloc", 0)))),
             ("memset", 1, 20),
             ("launch", 12, 1, 128, 0, bufs[1], params[1], ((0, ("maps", ((("in", 0), "spec"),))), (2, ("alloc", 2)),
                                                                 (4, ("alloc", 3))))]
    rec = _dispatch.Replay(allocs, steps, (2, 0), True)
    x = torch.zeros(1)
    for ptrs in ([1000, 2000], [3000, 4000]):
        calls.clear()
        out = rec((x, x), ptrs)
        assert [(tuple(t.shape), t.dtype) for t in out] == [((4,), torch.float16), ((2, 3), torch.float32)]
        temporary = int(bufs[0][2])
        assert temporary not in (0, out[0].data_ptr(), out[1].data_ptr())
        assert [int(w) for w in bufs[0][:6:2]] == [ptrs[1], temporary, out[1].data_ptr()]
        assert [int(w) for w in bufs[1][:6:2]] == [ptrs[0] + 1, out[0].data_ptr(), temporary + 256]
        assert calls == [("launch", 11, 3, 1, 1, 64, 1, 1, 1024, 77, params[0], None),
                         ("memset", temporary, 0, 5, 77),
                         ("launch", 12, 1, 1, 1, 128, 1, 1, 0, 77, params[1], None)]
    assert maps_streams == [77, 77]


# ------------------------------------------------------------------------------------------------ KV cache
def kv_arrays(seed, paged, dtype=np.float32):
    """A decode call's device arrays: q (2 sequences, 1 token, 4 heads over 2 KV heads, head dim 8), the caches
    (dense 32 rows, or 4 pages of 16 in reverse order), one new row to append, the lengths 5 and 20, the table."""
    rng = np.random.default_rng(seed)
    shape = (4, 16, 2, 8) if paged else (2, 32, 2, 8)
    host_arrays = [rng.standard_normal(s).astype(dtype) for s in ((2, 1, 4, 8), shape, shape, (2, 1, 2, 8),
                                                                   (2, 1, 2, 8))]
    q, kc, vc, kn, vn = (cuda.to_device(x) for x in host_arrays)
    lens = cuda.to_device(np.array([5, 20], np.int32))
    table = cuda.to_device(np.array([[3, 2], [1, 0]], np.int32)) if paged else None
    return dict(q=q, k_cache=kc, v_cache=vc, k=kn, v=vn, cache_seqlens=lens, block_table=table)


def kv_call(a, **opts):
    """The call on ``a``; host copies of out, lse and the caches after the append."""
    out, lse = flashnb.flash_attn_with_kvcache(**a, return_softmax_lse=True, **opts)
    return host(out, lse, a["k_cache"], a["v_cache"])


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_replay_computes_what_the_full_path_computes(paged):
    """A decode loop's second call replays the first's launches (the append, the split decode, the combine)
    with its own arrays: out, lse and the appended caches bit for bit those of the full path."""
    opts = dict(causal=True, softcap=3.0, num_splits=2)
    first = kv_call(kv_arrays(0, paged), **opts)
    assert _dispatch.stats["recorded"] == 1
    replayed = kv_call(kv_arrays(1, paged), **opts)                   # the same signature, other data
    assert _dispatch.stats["hits"] == 1
    _dispatch.clear()
    full = kv_call(kv_arrays(1, paged), **opts)
    assert _dispatch.stats["hits"] == 0
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), replayed, full):
        assert_bitwise_equal(a, b, f"replayed {name}")
    assert not np.allclose(replayed[0], first[0]), "the replay ignored its inputs"


def test_kvcache_calls_the_cache_does_not_take():
    """An int cache_seqlens (its value plans the splits: a decode loop's would be a new key every step) and
    host metadata take the full path every call."""
    a = kv_arrays(0, paged=True)
    for changes in (dict(cache_seqlens=5), dict(cache_seqlens=np.array([5, 20], np.int32)),
                    dict(block_table=np.array([[3, 2], [1, 0]], np.int32))):
        flashnb.flash_attn_with_kvcache(**dict(a, **changes))
        flashnb.flash_attn_with_kvcache(**dict(a, **changes))
    assert _dispatch.stats == {"hits": 0, "misses": 0, "recorded": 0, "unfit": 0, "unrecorded": 0, "steps": 0}


def test_a_gpu_launch_tells_the_recorder_each_arrays_address_word():
    """``_jit._record`` (the GPU's launch path, which CI cannot run) hands the recorder found in
    ``_jit.RECORDING`` the packed buffer and, for each array argument, the buffer word holding its address (the
    5th of an array's parameters ``meminfo, parent, nitems, itemsize, data, shape..., strides...``)."""
    from flashnb.kernels import _jit
    seen = []

    class Recorder:
        def note_launch(self, *args):
            seen.append(args)

    f32 = np.dtype(np.float32)
    a = _jit.View(4096, (2, 3), (12, 4), f32, None)
    b = _jit.View(8192, (5,), (4,), np.dtype(np.uint32), None)
    args = (a, 7, np.float32(0.5), b)
    key, values = _jit._flatten(None, args)
    _, fmt, nwords, offsets = _jit._layout(key)
    buf = np.zeros(nwords + len(offsets), np.uint64)
    import struct
    struct.pack_into(fmt, buf, 0, *values)
    _jit._record(Recorder(), "kern", 3, 64, 0, args, 99, buf, nwords, offsets)
    ((kern, grid, block, shared, got_args, (handle, got_buf, got_nwords, address_word)),) = seen
    assert (kern, grid, block, shared, handle, got_nwords) == ("kern", 3, 64, 0, 99, nwords)
    assert got_args is args and got_buf is buf
    assert sorted(address_word) == [0, 3]
    assert int(buf[address_word[0]]) == 4096 and int(buf[address_word[3]]) == 8192



# ------------------------------------------------------------------------------------------------ length-generic steps
def decode_keys(layout, cache, n):
    """The first ``n`` rows of ``cache`` (a NumPy (batch, rows, heads, dim) array) as a decoding loop passes them:
    a new contiguous array ("dense"), transformers' layout (a (batch, heads, n, dim) array seen transposed), or a
    slice of one preallocated device array ("static", its strides the same every step)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    if layout == "dense":
        return cuda.to_device(np.ascontiguousarray(cache[:, :n]))
    if layout == "transformers":
        return FakeCUDAArray(cuda.to_device(np.ascontiguousarray(cache[:, :n].transpose(0, 2, 1, 3)))._ary
                             .transpose(0, 2, 1, 3))
    return cache[:, :n]                                                # a device array already


@pytest.mark.parametrize("dtype, layout, opts", [
    (np.float16, "transformers", dict(causal=True)), (np.float16, "static", dict(window_size=(4, 0), softcap=2.0)),
    (np.float32, "dense", dict(window_size=(4, 0), softcap=2.0)), (np.float32, "static", dict(causal=True))])
def test_decoding_steps_of_every_key_count_take_the_step(dtype, layout, opts):
    """A decoding loop (one query token, one key more a step) misses the cache every step; after its first call
    each step is served by the length-generic step (``kvcache._Step``), which computes out and lse bit for bit as
    the full path does, the window's left side included once it starts to bound the keys."""
    rng = np.random.default_rng(0)
    k_all, v_all = (rng.standard_normal((2, 16, 2, 8)).astype(dtype) for _ in range(2))
    if layout == "static":
        k_all, v_all = cuda.to_device(k_all), cuda.to_device(v_all)
    lengths = range(3, 15, 2)
    qs = [cuda.to_device(rng.standard_normal((2, 1, 4, 8)).astype(dtype)) for _ in lengths]
    stepped = []
    for q, n in zip(qs, lengths):
        out, lse = flashnb.flash_attention(q, decode_keys(layout, k_all, n), decode_keys(layout, v_all, n),
                                           return_lse=True, **opts)
        stepped.append(host(out, lse))
    # each step's call recorded too (a model's other layers at that key count replay it)
    assert _dispatch.stats["steps"] == len(lengths) - 1 and _dispatch.stats["recorded"] == len(lengths)
    q, n = qs[-1], lengths[-1]
    again = host(*flashnb.flash_attention(q, decode_keys(layout, k_all, n), decode_keys(layout, v_all, n),
                                          return_lse=True, **opts))
    assert _dispatch.stats["hits"] == 1
    assert_bitwise_equal(again[0], stepped[-1][0], "the replay of a step's recording")
    for q, n, (out, lse) in zip(qs, lengths, stepped):
        _dispatch.clear()                                              # the full path
        want = host(*flashnb.flash_attention(q, decode_keys(layout, k_all, n), decode_keys(layout, v_all, n),
                                             return_lse=True, **opts))
        assert _dispatch.stats["steps"] == 0
        assert_bitwise_equal(out, want[0], f"out at {n} keys")
        assert_bitwise_equal(lse, want[1], f"lse at {n} keys")


def test_the_length_generic_key():
    """Calls that differ only in the keys' length share the key; every other difference (q's shape, the keys'
    layout, an option, k and v of different lengths) parts them, and the strides come back exactly."""
    rng = np.random.default_rng(0)
    q = cuda.to_device(rng.standard_normal((2, 1, 4, 8)).astype(np.float32))

    def gkey(q, n, m=None, layout="dense", scalars=(True,)):
        cache = rng.standard_normal((2, 20, 2, 8)).astype(np.float32)
        k, v = decode_keys(layout, cache, n), decode_keys(layout, cache, n if m is None else m)
        key, _ = _dispatch.signature("forward", (q, k, v, None), scalars)
        return _dispatch.length_generic(key, (1, 2), 1)
    for layout in ("dense", "transformers"):
        assert gkey(q, 5, layout=layout) == gkey(q, 11, layout=layout) is not None
    assert gkey(q, 5) != gkey(q, 5, layout="transformers")
    assert gkey(q, 5) != gkey(q, 5, scalars=(False,))
    assert gkey(q, 5) != gkey(cuda.to_device(np.zeros((2, 2, 4, 8), np.float32)), 5)
    assert gkey(q, 5, 6) is None and gkey(q, 0) is None
    key = gkey(q, 5, layout="transformers")
    assert key[2][3] == (("L", 2 * 8 * 4), 8 * 4, ("L", 8 * 4), 4)      # (batch, keys, heads, dim) of (b, h, n, d)


def test_a_step_leaves_a_length_to_the_full_path_where_it_gives_no_word_view(monkeypatch):
    """A step that cannot bind a call (a length at which the keys' strides give no 32-bit word view) returns
    None: the call takes the full path, which decides (here: the generic kernels), and is not counted a step."""
    from flashnb import kvcache
    q, k, v = (cuda.to_device(np.random.default_rng(0).standard_normal(s).astype(np.float16))
               for s in ((1, 1, 2, 8), (1, 6, 1, 8), (1, 6, 1, 8)))
    flashnb.flash_attention(q, k, v)
    k7, v7 = (cuda.to_device(np.random.default_rng(1).standard_normal((1, 7, 1, 8)).astype(np.float16))
              for _ in range(2))
    monkeypatch.setattr(kvcache, "_step_words", lambda *a: None)
    out = flashnb.flash_attention(q, k7, v7)
    monkeypatch.undo()
    assert _dispatch.stats["steps"] == 0 and _dispatch.stats["recorded"] == 2
    _dispatch.clear()
    assert_bitwise_equal(host(out)[0], host(flashnb.flash_attention(q, k7, v7))[0], "out")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_padded_batchs_decoding_steps_over_growing_caches_take_the_step(dtype):
    """``flash_attn_with_kvcache`` over a whole dense cache that grows a row a step (no append; device
    ``cache_seqlens`` and ``cache_leftpad``, as transformers' padded batches pass them): after the first call
    each step is served by the length-generic step, which binds that call's own lengths and padding, bit for bit
    the full path's; the split count asked for is kept."""
    rng = np.random.default_rng(0)
    k_all, v_all = (rng.standard_normal((2, 16, 2, 8)).astype(dtype) for _ in range(2))
    lengths = range(5, 15, 4)            # odd: no length divides a stride (that would be another generic key)
    qs = [cuda.to_device(rng.standard_normal((2, 1, 4, 8)).astype(dtype)) for _ in lengths]

    def call(q, n):
        lens = cuda.to_device(np.array([n, n - 1], np.int32))             # sequence 1 a row short of the cache
        pad = cuda.to_device(np.array([0, 3], np.int32))                  # sequence 1 left-padded by 3
        return host(*flashnb.flash_attn_with_kvcache(q, decode_keys("dense", k_all, n), decode_keys("dense", v_all, n),
                                                     cache_seqlens=lens, cache_leftpad=pad, causal=True, num_splits=2,
                                                     return_softmax_lse=True))
    stepped = [call(q, n) for q, n in zip(qs, lengths)]
    assert _dispatch.stats["steps"] == len(lengths) - 1
    for q, n, got in zip(qs, lengths, stepped):
        _dispatch.clear()
        want = call(q, n)
        assert _dispatch.stats["steps"] == 0
        for name, a, b in zip(("out", "lse"), got, want):
            assert_bitwise_equal(a, b, f"{name} at {n} keys")


def _fp8_arrays(seed, batch=1, seqlen_q=9, seqlen_k=40, nheads=2, nheads_k=1, headdim=64):
    from reference.fp8 import quantize_e4m3
    rng = np.random.default_rng(seed)
    return [cuda.to_device(quantize_e4m3(rng.standard_normal(s) * 100).astype(np.uint8)) for s in
            ((batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
             (batch, seqlen_k, nheads_k, headdim))]


def test_the_fp8_forward_replays():
    """``flash_attention_fp8`` (V^T's pre-pass into a scratch array, then the forward with the tensor maps of q, k
    and V^T) is recorded once and replayed, computing what the full path computes from its own inputs: float
    descales through the one-value device arrays it keeps, or a (batch, nheads_k) device array held as an input
    (replayed with other values)."""
    def descales(seed):
        rng = np.random.default_rng(seed)
        return (0.01, cuda.to_device(rng.uniform(0.01, 0.03, (1, 1)).astype(np.float32)), 0.03)

    def call(arrays, ds):
        out, lse = flashnb.flash_attention_fp8(*arrays, *ds, causal=True, return_lse=True)
        return host(out, lse)

    replayed, full = recorded_then_replayed(lambda seed: call(_fp8_arrays(seed), descales(seed)), 1)
    for name, a, b in zip(("out", "lse"), replayed, full):
        assert_bitwise_equal(a, b, f"replayed {name}")
    assert not np.allclose(replayed[0], call(_fp8_arrays(0), descales(0))[0]), "the replay ignored its inputs"


def test_flex_attention_replays_forward_and_backward():
    """``flex_attention`` / ``flex_attention_backward`` with a score_mod and a block mask: validated every call
    (``flex._call``), then replayed, keyed by the compiled functions (a function and what it captures) and the
    block mask's states; a replay computes what the full path computes from its own inputs, and another score_mod
    is a miss."""
    slopes = np.array([0.5, 0.25], np.float32)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = flashnb.create_block_mask(causal, None, None, 9, 11, BLOCK_SIZE=16)

    def call(seed, score_mod=alibi):
        rng = np.random.default_rng(seed)
        q, k, v, dout = (cuda.to_device(rng.standard_normal((1, 2, n, 8)).astype(np.float16))
                         for n in (9, 11, 11, 9))
        opts = dict(score_mod=score_mod, block_mask=block_mask, backend="tensorcore")
        out, lse = flashnb.flex_attention(q, k, v, return_lse=True, **opts)
        grads = flashnb.flex_attention_backward(dout, q, k, v, out, lse, **opts)
        return [np.array(x.copy_to_host() if hasattr(x, "copy_to_host") else x) for x in (out, lse, *grads)]

    replayed, full = recorded_then_replayed(call, 2)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), replayed, full):
        assert_bitwise_equal(a, b, f"replayed {name}")
    assert not np.allclose(replayed[0], call(0)[0]), "the replay ignored its inputs"
    hits = _dispatch.stats["hits"]
    other = call(1, lambda score, b, h, q_idx, kv_idx: score * np.float32(0.5))
    assert _dispatch.stats["hits"] == hits, "another score_mod replayed the first one's kernels"
    assert not np.allclose(other[0], full[0])


@pytest.mark.parametrize("dtype, backend", [(np.float32, "simt"), (np.float16, "tensorcore")])
def test_varlen_replays_forward_and_backward(dtype, backend):
    """``flash_attn_varlen_func`` / ``flash_attn_varlen_backward``: ``cu_seqlens`` checked every call (a replay
    with lengths that break the rules still raises), then replayed, the device ``cu_seqlens`` inputs of the
    kernels; another cut of the same totals computes, replayed, what the full path computes from it."""
    def cuts(seed):
        rng = np.random.default_rng(seed)       # 3 sequences of 17 query rows, 19 key rows: other cuts each seed
        q_cut, k_cut = np.sort(rng.choice(np.arange(1, 17), 2, replace=False)), np.sort(rng.choice(19, 2))
        return (np.concatenate([[0], q_cut, [17]]).astype(np.int32), np.concatenate([[0], k_cut, [19]]).astype(np.int32))

    def call(seed):
        rng = np.random.default_rng(seed)
        q, k, v, dout = (cuda.to_device(rng.standard_normal((n, h, 8)).astype(dtype))
                         for n, h in ((17, 2), (19, 1), (19, 1), (17, 2)))
        cu_q, cu_k = (cuda.to_device(c) for c in cuts(seed))
        opts = dict(causal=True, softcap=4.0, backend=backend)
        out, lse = flashnb.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 19, return_lse=True, **opts)
        grads = flashnb.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 17, 19, **opts)
        return host(out, lse, *grads)

    replayed, full = recorded_then_replayed(call, 2)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), replayed, full):
        assert_bitwise_equal(a, b, f"replayed {name}")
    assert not np.allclose(replayed[0], call(0)[0]), "the replay ignored its inputs"
    rng = np.random.default_rng(1)
    q, k, v = (cuda.to_device(rng.standard_normal((n, h, 8)).astype(dtype)) for n, h in ((17, 2), (19, 1), (19, 1)))
    hits = _dispatch.stats["hits"]
    with pytest.raises(ValueError, match="max_seqlen_q"):        # a sequence longer than max_seqlen_q: checked
        flashnb.flash_attn_varlen_func(q, k, v, cuda.to_device(np.array([0, 1, 2, 17], np.int32)),
                                       cuda.to_device(cuts(0)[1]), 12, 19, causal=True, softcap=4.0, backend=backend)
    assert _dispatch.stats["hits"] == hits
