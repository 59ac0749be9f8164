"""The disk cache of compiled kernels (flashnb/kernels/_cache.py) and its use in the launch path (_jit).

No GPU needed: the store is files and hashes; the launch path's use of it runs on a stand-in kernel and
driver.  What only a GPU shows (a real cubin loaded in a fresh process without compiling) is
tests/gpu_compile_cache.py.
"""
import multiprocessing
import os
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

from flashnb import precompile
from flashnb.kernels import _cache, _jit

SETTING = 1   # a module setting that code_state's test reads through a function's globals
VERSIONS = {"flashnb": "0.1.0", "numba": "0.68.1", "numba-cuda": "0.30.4", "nvvm": "2.0", "cudart": "13.5",
            "driver": "13000", "nvjitlink": "13.5", "python": "CPython 3.11.7"}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test: a fresh cache directory, zeroed counters and log, the warning not yet given."""
    directory = tmp_path / "cache"
    monkeypatch.setenv(_cache.ENV, str(directory))
    monkeypatch.setattr(_cache, "counters", dict.fromkeys(_cache.counters, 0))
    monkeypatch.setattr(_cache, "log", [])
    monkeypatch.setattr(_cache, "_warned", False)
    return directory


def key(kernel="make_forward(64, 64)", args="array(float32, 4d, C), int64", arch="sm_90a", sources="s1", **versions):
    return _cache.key_text(kernel, args, arch, toolchain_versions={**VERSIONS, **versions}, sources=sources)


# ------------------------------------------------------------------------------------------------ keys
def test_every_field_of_the_key_names_its_own_file_and_equal_fields_the_same():
    base = key()
    variants = [key(kernel="make_forward(64, 128)"), key(args="array(float32, 4d, A), int64"), key(arch="sm_80"),
                key(sources="s2")] + [key(**{name: "other"}) for name in VERSIONS]
    paths = [_cache.path_for(k) for k in [base] + variants]
    assert len(set(paths)) == len(paths)                       # all distinct
    assert key() == base and _cache.path_for(key()) == paths[0]
    assert paths[0].parent == _cache.cache_dir() and paths[0].suffix == _cache.SUFFIX


def test_the_default_key_follows_the_source_hash_and_the_toolchain(monkeypatch):
    """An entry stored under today's sources and versions is a miss once either changes (the invalidation)."""
    monkeypatch.setattr(_cache, "source_hash", lambda: "sources-1")
    monkeypatch.setattr(_cache, "toolchain", lambda: dict(VERSIONS))
    stored = _cache.key_text("k()", "int64", "sm_90a")
    assert "sources-1" in stored and "numba-cuda 0.30.4" in stored
    assert _cache.store(stored, "entry", b"cubin")
    assert _cache.load(_cache.key_text("k()", "int64", "sm_90a")) == ("entry", b"cubin")
    monkeypatch.setattr(_cache, "source_hash", lambda: "sources-2")          # a kernel source edited
    assert _cache.load(_cache.key_text("k()", "int64", "sm_90a")) is None
    monkeypatch.setattr(_cache, "source_hash", lambda: "sources-1")
    monkeypatch.setattr(_cache, "toolchain", lambda: {**VERSIONS, "numba-cuda": "0.31.0"})  # an upgrade
    assert _cache.load(_cache.key_text("k()", "int64", "sm_90a")) is None
    assert _cache.counters["missed"] == 2 and _cache.counters["loaded"] == 1


def test_source_hash_covers_py_cu_ptx_files_and_nothing_else(tmp_path):
    root = tmp_path / "kernels"
    (root / "__pycache__").mkdir(parents=True)
    for name, text in (("a.py", "x = 1"), ("b.cu", "__device__ int f();"), ("c.ptx", ".version 8.0"),
                       ("notes.txt", "n"), ("__pycache__/a.py", "cached")):
        (root / name).write_text(text)
    h0 = _cache.hash_sources(root)
    assert h0 == _cache.hash_sources(root)
    changed = []
    for edit in (lambda: (root / "a.py").write_text("x = 2"), lambda: (root / "b.cu").write_text("int g();"),
                 lambda: (root / "c.ptx").write_text(".version 8.1"), lambda: (root / "d.cuh").write_text("//"),
                 lambda: (root / "d.cuh").rename(root / "e.cuh")):
        edit()
        changed.append(_cache.hash_sources(root))
    assert len({h0, *changed}) == 6
    for ignored in ("notes.txt", "__pycache__/a.py"):
        (root / ignored).write_text("edited")
        assert _cache.hash_sources(root) == changed[-1]


def test_the_real_source_hash_is_the_kernels_directory_once_per_process():
    assert _cache.source_hash() == _cache.hash_sources(_cache.KERNELS_DIR)
    assert (_cache.KERNELS_DIR / "forward_tc.py").is_file()
    hits = _cache.source_hash.cache_info().hits
    _cache.source_hash()
    assert _cache.source_hash.cache_info().hits == hits + 1


def test_toolchain_names_every_version_the_key_needs():
    versions = _cache.toolchain()
    for name in ("flashnb", "numba", "numba-cuda", "llvmlite", "python", "nvvm", "cudart", "nvjitlink", "driver"):
        assert versions[name], name
    assert versions["numba-cuda"].startswith("0.30")


# ------------------------------------------------------------------------------------------------ entries
def test_store_then_load_and_the_file_format(cache):
    k = key()
    assert _cache.load(k) is None and _cache.counters["missed"] == 1
    assert _cache.store(k, "_Z6kernel", b"\x7fELF" + bytes(range(256)))
    assert _cache.load(k) == ("_Z6kernel", b"\x7fELF" + bytes(range(256)))
    data = _cache.path_for(k).read_bytes()
    assert data.startswith(_cache.MAGIC)
    assert _cache.decode(data) == (k, "_Z6kernel", b"\x7fELF" + bytes(range(256)))
    assert [p.name for p in cache.iterdir()] == [_cache.path_for(k).name]   # no temporary file left
    assert _cache.counters == dict(_cache.counters, loaded=1, stored=1, missed=1, rejected=0)


def _truncate(n):
    return lambda data, k: data[:n]


def _flip(where):
    def flip(data, k):
        i = where(len(data))
        return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
    return flip


def _valid_checksum(payload):
    import hashlib
    return _cache.MAGIC + hashlib.sha256(payload).digest() + payload


CORRUPTIONS = {
    "empty": _truncate(0),
    "magic only": _truncate(len(_cache.MAGIC)),
    "no payload": _truncate(len(_cache.MAGIC) + 32),
    "half": lambda data, k: data[:len(data) // 2],
    "last byte lost": lambda data, k: data[:-1],
    "flipped magic": _flip(lambda n: 3),
    "flipped checksum": _flip(lambda n: len(_cache.MAGIC) + 5),
    "flipped header": _flip(lambda n: len(_cache.MAGIC) + 32 + 10),
    "flipped cubin": _flip(lambda n: n - 7),
    "appended byte": lambda data, k: data + b"\0",
    "wrong magic": lambda data, k: b"NOT-A-KERNEL-\0\0\1" + data[len(_cache.MAGIC):],
    "another key": lambda data, k: _cache.encode(k + " (another)", "_Z6kernel", b"cubin"),
    "header not json": lambda data, k: _valid_checksum(b"\x05\0\0\0{key:" + b"cubin"),
    "header length past the end": lambda data, k: _valid_checksum(b"\xff\0\0\0{}"),
    "header without name": lambda data, k: _valid_checksum(b'\x0b\0\0\0{"key": ""}' + b"cubin"),
    "no cubin": lambda data, k: _cache.encode(k, "_Z6kernel", b""),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_entry_is_a_miss_and_the_next_store_repairs_it(corruption):
    k = key()
    assert _cache.store(k, "_Z6kernel", b"cubin bytes")
    path = _cache.path_for(k)
    path.write_bytes(CORRUPTIONS[corruption](path.read_bytes(), k))
    assert _cache.load(k) is None
    assert _cache.counters["rejected"] == 1 and _cache.counters["loaded"] == 0
    assert _cache.store(k, "_Z6kernel", b"cubin bytes")
    assert _cache.load(k) == ("_Z6kernel", b"cubin bytes")


def test_an_unreadable_entry_is_a_miss(cache):
    k = key()
    _cache.path_for(k).mkdir(parents=True)                     # a directory where the file should be
    assert _cache.load(k) is None
    assert _cache.counters["missed"] == 1


def _writer(directory, me, rounds, results):
    """One of several processes: store a shared key (each writer its own content) and its own key, and read
    the shared key back after each store; report entries it could not use."""
    os.environ[_cache.ENV] = directory
    _cache.counters.update(dict.fromkeys(_cache.counters, 0))
    shared, own = key(kernel="shared"), key(kernel=f"own {me}")
    cubin = bytes([me]) * 300_000                             # big enough that writes overlap
    for _ in range(rounds):
        ok = _cache.store(shared, f"writer{me}", cubin) and _cache.store(own, f"writer{me}", cubin)
        found = _cache.load(shared)
        ok = ok and found is not None and found[1] == bytes([int(found[0][6:])]) * 300_000
        if not ok:
            break
    results.put((me, ok, _cache.counters["rejected"]))


def test_concurrent_writers_never_leave_or_show_a_partial_entry(cache):
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    results = ctx.Queue()
    writers = [ctx.Process(target=_writer, args=(str(cache), me, 25, results)) for me in range(6)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    reports = sorted(results.get(timeout=10) for _ in writers)
    assert [w.exitcode for w in writers] == [0] * 6
    assert reports == [(me, True, 0) for me in range(6)]
    names = sorted(p.name for p in cache.iterdir())
    assert len(names) == 7 and not any(n.startswith(_cache.TMP_PREFIX) for n in names)
    for path, k, name, size in _cache.entries():
        assert k is not None, path
        assert _cache.load(k)[1] == bytes([int(name[6:])]) * 300_000


def test_an_unwritable_directory_warns_once_and_never_raises(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(_cache.ENV, str(blocker / "cache"))      # its parent is a file: no directory possible
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _cache.store(key(), "n", b"c") is False
        assert _cache.store(key(kernel="other"), "n", b"c") is False
        assert _cache.load(key()) is None
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert "cannot write the kernel cache" in str(caught[0].message)
    assert _cache.counters["store_failed"] == 2
    assert _cache.entries() == [] and _cache.clear() == 0


def test_off_disables_the_cache_and_empty_means_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv(_cache.ENV, "off")
    assert _cache.cache_dir() is None and _cache.path_for(key()) is None
    assert _cache.store(key(), "n", b"c") is False and _cache.load(key()) is None
    assert _cache.counters == dict.fromkeys(_cache.counters, 0)
    monkeypatch.setenv(_cache.ENV, "")
    import platformdirs
    assert _cache.cache_dir() == type(_cache.cache_dir())(platformdirs.user_cache_dir("flashnb", appauthor=False))
    monkeypatch.setitem(sys.modules, "platformdirs", None)      # not installed: the XDG location
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _cache.cache_dir() == tmp_path / "xdg" / "flashnb"


def test_entries_lists_and_clear_deletes_only_cache_files(cache):
    assert _cache.store(key(), "a", b"1") and _cache.store(key(kernel="b"), "b", b"2")
    (cache / ("0" * 40 + _cache.SUFFIX)).write_bytes(b"junk")
    (cache / (_cache.TMP_PREFIX + "left" + _cache.SUFFIX)).write_bytes(b"partial")
    (cache / "keep.txt").write_text("not ours")
    listed = _cache.entries()
    assert sorted((k is not None, n) for _, k, n, _ in listed) == [(False, None), (True, "a"), (True, "b")]
    assert _cache.clear() == 4
    assert [p.name for p in cache.iterdir()] == ["keep.txt"]


# ------------------------------------------------------------------------------------------------ kernel ids
DOCS = np.array([0, 0, 1, 1, 1, 2])


def _alibi(score, b, h, q_idx, kv_idx):          # flex_attention functions at module level: the same in a new process
    return score - 0.5 * (h + 1) * abs(q_idx - kv_idx)


def _same_doc(b, h, q_idx, kv_idx):
    return DOCS[q_idx] == DOCS[kv_idx]


def _flex_forward(score_mod=_alibi, mask_mod=_same_doc):
    from flashnb import flex
    from flashnb.kernels import forward
    from flashnb.kernels._scores import Mods
    mods = Mods(flex._compiled(score_mod), flex._compiled(mask_mod), None, (16, 16))
    return forward.make_forward(16, 16, 8, "float32", False, False, True, *[False] * 4, MODS=mods)[0]   # block mask


def _ids():
    from flashnb.kernels import backward, backward_tc, forward, forward_tc
    flags = [False] * 7
    return {
        "flex": _flex_forward().flashnb_id,
        "flex state": _jit.code_state(_flex_forward().py_func),
        "cast32": backward.make_cast("float32").flashnb_id,
        "cast64": backward.make_cast("float64").flashnb_id,
        "pre": backward.make_preprocess("float32").flashnb_id,
        "pre_explicit": backward.make_preprocess("float32", None, 1).flashnb_id,
        "pre_keywords": backward.make_preprocess(THREADS_C=1, ACC_NAME="float32").flashnb_id,
        "pre_words": backward.make_preprocess("float32", "float16", 4).flashnb_id,
        "fwd16": forward.make_forward(16, 16, 8, "float32", *flags)[0].flashnb_id,
        "fwd_causal": forward.make_forward(16, 16, 8, "float32", True, *flags[1:])[0].flashnb_id,
        "fwd_tc": forward_tc.make_forward_tc(16, 16, 16, "float16", True, 1, False, *flags)[0].flashnb_id,
        "fwd_tc_bf16": forward_tc.make_forward_tc(16, 16, 16, "bfloat16", True, 1, False, *flags)[0].flashnb_id,
        "cast_tc": backward_tc.make_cast_tc("float16").flashnb_id,
        "fwd16 state": _jit.code_state(forward.make_forward(16, 16, 8, "float32", *flags)[0].py_func),
        "fwd_tc state": _jit.code_state(
            forward_tc.make_forward_tc(16, 16, 16, "float16", True, 1, False, *flags)[0].py_func),
    }


def test_kernel_factory_ids_are_canonical_and_distinct():
    ids = _ids()
    assert ids["pre"] == ids["pre_explicit"] == ids["pre_keywords"] == \
        "flashnb.kernels.backward.make_preprocess('float32', None, 1)"
    assert ids["fwd16"] == ("flashnb.kernels.forward.make_forward(16, 16, 8, 'float32', False, False, False, False, "
                            "False, False, False, False, None)[0]")
    distinct = {name: i for name, i in ids.items() if name not in ("pre_explicit", "pre_keywords")}
    assert len(set(distinct.values())) == len(distinct)


def test_flex_functions_name_their_kernels_by_code_and_the_key_holds_their_captures(monkeypatch):
    """A flex_attention function names its kernels by its qualified name and code (``flex._stable_id``), so a
    second process finds them on disk (``test_kernel_factory_ids_are_the_same_in_another_process``); another
    body is another id; a captured array is in the key's code state (a changed array: a new entry, never the
    old cubin); a function capturing an object whose value no text names gives kernels with no id (compiled in
    each process)."""
    kern = _flex_forward()
    assert kern.flashnb_id.startswith("flashnb.kernels.forward.make_forward(16, 16, 8, 'float32'")
    assert ", Mods(<flex test_compile_cache._alibi " in kern.flashnb_id
    assert "<flex test_compile_cache._same_doc " in kern.flashnb_id and kern.flashnb_id.endswith(", None, (16, 16), False, 3, False, None, False))[0]")

    def _alibi(score, b, h, q_idx, kv_idx):                        # the same name, another body
        return score - 0.25 * (h + 1) * abs(q_idx - kv_idx)
    _alibi.__qualname__ = "_alibi"
    assert _flex_forward(score_mod=_alibi).flashnb_id != kern.flashnb_id
    state = _jit.code_state(kern.py_func)
    monkeypatch.setitem(globals(), "DOCS", np.array([0, 0, 1, 1, 2, 2]))
    other = _flex_forward()
    assert other.flashnb_id == kern.flashnb_id and _jit.code_state(other.py_func) != state
    thing = object()

    def opaque(b, h, q_idx, kv_idx):
        return thing is not None
    assert not hasattr(_flex_forward(mask_mod=opaque), "flashnb_id")


def test_kernel_factory_ids_are_the_same_in_another_process():
    code = "import json, test_compile_cache as t; print(json.dumps(t._ids()))"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM=os.environ.get("NUMBA_ENABLE_CUDASIM", "1"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                         cwd=os.path.dirname(__file__), check=True).stdout
    import json
    assert json.loads(out.splitlines()[-1]) == _ids()


def test_code_state_tells_apart_kernels_built_under_other_module_settings(monkeypatch):
    """tools/tune_simt.py changes ``forward.MAX_THREADS`` and rebuilds: same factory arguments, other code."""
    from flashnb.kernels import forward
    build = forward.make_forward.__wrapped__                  # past the lru_cache: the cached kernels untouched
    args = (16, 16, 8, "float32") + (False,) * 7
    kern = build(*args)[0]
    assert _jit.code_state(build(*args)[0].py_func) == _jit.code_state(kern.py_func)
    monkeypatch.setitem(forward.MAX_THREADS, "rows", 4)
    other = build(*args)[0]
    assert other.flashnb_id == kern.flashnb_id
    assert _jit.code_state(other.py_func) != _jit.code_state(kern.py_func)


def test_code_state_follows_closures_globals_and_nested_functions(monkeypatch):
    def make(n, inner_n, table):
        def inner():
            return inner_n + len(table)

        def kernel():
            return n + inner() + SETTING

        return kernel

    monkeypatch.setitem(globals(), "SETTING", 1)
    state = _jit.code_state(make(1, 2, {"a": 1, "b": 2}))
    assert _jit.code_state(make(1, 2, {"b": 2, "a": 1})) == state            # dict order does not matter
    assert _jit.code_state(make(9, 2, {"a": 1, "b": 2})) != state            # a closure value
    assert _jit.code_state(make(1, 9, {"a": 1, "b": 2})) != state            # a nested function's
    assert _jit.code_state(make(1, 2, {"a": 1, "b": 3})) != state            # inside a container
    monkeypatch.setitem(globals(), "SETTING", 2)
    assert _jit.code_state(make(1, 2, {"a": 1, "b": 2})) != state            # a global the code names
    monkeypatch.setitem(globals(), "SETTING", 1)
    assert _jit.code_state(make(1, 2, {"a": 1, "b": 2})) == state


def test_kernel_factory_on_a_toy_factory():
    from functools import lru_cache

    class Dispatcher:
        py_func = None

    @lru_cache(maxsize=None)
    @_jit.kernel_factory
    def make_toy(a, b=2, *, c=(1, "x")):
        return Dispatcher(), 128, Dispatcher()

    k0, _, k2 = make_toy(1)
    assert k0.flashnb_id == f"{__name__}.{make_toy.__qualname__}(1, 2, c=(1, 'x'))[0]"
    assert k2.flashnb_id.endswith("[2]")
    assert make_toy(a=1, b=2)[0].flashnb_id == k0.flashnb_id
    assert not hasattr(make_toy(object())[0], "flashnb_id")    # an argument with no stable text: not cached


# ------------------------------------------------------------------------------------------------ launch path
def test_the_parameter_layout_comes_from_the_key_alone():
    argtypes, fmt, nwords, offsets = _jit._layout(((np.dtype(np.float32), 2, True), int, np.float32))
    assert [str(t) for t in argtypes] == ["array(float32, 2d, C)", "int64", "float32"]
    assert fmt == "@qqqqQqqqqqf" and nwords == 11
    assert list(offsets) == [8 * i for i in range(10)] + [80]


class _Overload:
    """A stand-in for numba-cuda's compiled kernel: its code library's cubin, entry name and handle."""
    def __init__(self):
        lib = types.SimpleNamespace(_entry_name="_Z3toy", _setup_functions=[], _teardown_functions=[],
                                    referenced_objects={}, get_cubin=lambda: types.SimpleNamespace(code=b"CUBIN"),
                                    get_cufunc=lambda: types.SimpleNamespace(handle="numba-handle"))
        self._codelibrary, self.cooperative = lib, False
        self.target_context = types.SimpleNamespace(enable_nrt=False)


class _Kernel:
    def __init__(self):
        self.flashnb_id, self.targetoptions, self.compiled, self.overloads = "toy(1)", {"opt": True}, [], {}
        self.py_func = _writer

    def compile(self, argtypes):
        self.compiled.append(argtypes)
        return _Overload()


class _Driver:
    """A stand-in for cuda.bindings.driver's library API."""
    CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)

    def __init__(self, refuse=False):
        self.calls, self.refuse = [], refuse

    def cuLibraryLoadData(self, code, *options):
        self.calls.append(("load", bytes(code)))
        return (1 if self.refuse else 0), "library"

    def cuLibraryGetKernel(self, library, name):
        self.calls.append(("kernel", library, name))
        return 0, "disk-handle"


@pytest.fixture
def gpu_path(monkeypatch):
    monkeypatch.setattr(_jit, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(_cache, "source_hash", lambda: "s")
    monkeypatch.setattr(_cache, "toolchain", lambda: dict(VERSIONS))
    driver = _Driver()
    monkeypatch.setattr(_jit, "_driver", lambda: driver)
    return driver


def test_a_new_process_loads_what_the_first_compiled_without_compiling(gpu_path):
    key_ = ((np.dtype(np.float32), 2, True), int)
    first = _Kernel()
    entry = _jit._compile(first, key_)
    assert len(first.compiled) == 1 and _cache.counters["compiled"] == 1 and _cache.counters["stored"] == 1
    assert _jit.kernel_handle(entry, context=1) == "numba-handle"
    assert _cache.log[-1]["how"] == "compiled, stored" and _cache.log[-1]["arch"] == "sm_90a"
    again = _Kernel()                                           # the same kernel in a new process
    entry = _jit._compile(again, key_)
    assert again.compiled == [] and _cache.counters["loaded"] == 1
    assert type(entry[0]) is _jit.DiskKernel and entry[1:3] == _jit._layout(key_)[1:3]
    assert _jit.kernel_handle(entry, context=1) == "disk-handle"
    assert _jit.kernel_handle(entry, context=2) == "disk-handle"
    assert gpu_path.calls == [("load", b"CUBIN"), ("kernel", "library", b"_Z3toy")]   # loaded once
    assert again.compiled == [] and _cache.log[-1]["how"] == "loaded"


def test_a_kernel_without_an_id_or_with_the_cache_off_is_compiled_every_time(gpu_path, monkeypatch):
    anonymous = _Kernel()
    del anonymous.flashnb_id
    _jit._compile(anonymous, (int,))
    monkeypatch.setenv(_cache.ENV, "off")
    _jit._compile(_Kernel(), (int,))
    assert _cache.counters["compiled"] == 2 and _cache.counters["stored"] == 0 and _cache.counters["missed"] == 0


def test_a_cubin_the_driver_refuses_or_of_another_arch_is_compiled(gpu_path, monkeypatch):
    _jit._compile(_Kernel(), (int,))
    again = _Kernel()
    entry = _jit._compile(again, (int,))
    gpu_path.refuse = True
    with pytest.warns(RuntimeWarning, match="cuLibraryLoadData"):
        assert _jit.kernel_handle(entry, context=1) == "numba-handle"
    assert len(again.compiled) == 1
    gpu_path.refuse = False
    monkeypatch.setattr(_jit, "compute_capability", lambda: (8, 0))   # a second device of another kind
    assert _jit.kernel_handle(entry, context=2) == "numba-handle"
    assert len(again.compiled) == 2 and _cache.log[-1]["arch"] == "sm_80"


def test_numba_overloads_compiles_the_kernels_that_came_from_disk(gpu_path, monkeypatch):
    _jit._compile(_Kernel(), (int,))
    again = _Kernel()
    monkeypatch.setattr(_jit, "_compiled", {})
    _jit._compiled[again, (int,)] = _jit._compile(again, (int,))
    _jit._compiled[_Kernel(), (int,)] = _jit._compile(_Kernel(), (int,))   # another kernel's: left alone
    assert again.compiled == []
    assert _jit.numba_overloads(again) is again.overloads and len(again.compiled) == 1


@pytest.mark.parametrize("trouble", ["module setup", "cubin of another type"])
def test_a_compiled_kernel_that_cannot_be_stored_still_serves_the_call(gpu_path, monkeypatch, trouble):
    kern, overload = _Kernel(), _Overload()
    if trouble == "module setup":
        overload._codelibrary._setup_functions = [print]       # Numba would run it on loading: not cacheable
    else:
        overload._codelibrary.get_cubin = lambda: object()     # numba-cuda's internals changed
    monkeypatch.setattr(kern, "compile", lambda argtypes: overload)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _jit._compile(kern, (int,))[0] is overload
    assert _cache.log[-1]["how"] == "compiled, not stored" and _cache.entries() == []
    assert len(caught) == (trouble != "module setup")


def _compile_without_gpu():
    """(In a process without the simulator.)  ``_jit._compile`` of a real kernel, ``make_cast_tc("float16")``,
    through numba-cuda's own ``Dispatcher.compile`` and ``_Kernel``, given a stand-in compute capability 9.0
    device and no binding to a context (the two things that need a GPU): the store path on real code
    libraries.  Prints ``SKIP ...`` where numba-cuda cannot compile (no NVVM or NVRTC: the `cu13` extra), else ``DONE {report}``."""
    import json
    try:                                       # the toolkit pieces numba-cuda compiles with: NVVM and NVRTC
        from numba.cuda.cudadrv import nvrtc, nvvm
        nvvm.NVVM()
        nvrtc.get_arch_option(9, 0)
    except Exception as e:
        print("SKIP", type(e).__name__, e)
        return
    from numba.cuda import codegen, dispatcher
    from flashnb.kernels.backward_tc import make_cast_tc
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    ensure_cc = codegen.CUDACodeLibrary._ensure_cc
    codegen.CUDACodeLibrary._ensure_cc = lambda self, cc: (9, 0, "a") if cc is None else ensure_cc(self, cc)
    dispatcher._Kernel.bind = lambda self: None
    _jit.compute_capability = lambda: (9, 0)
    kern = make_cast_tc("float16")
    entry = _jit._compile(kern, ((np.dtype(np.float32), 1, True), (np.dtype(np.uint32), 1, True)))
    print("DONE", json.dumps(dict(kind=type(entry[0]).__name__, counters=_cache.counters,
                                  entry=entry[0]._codelibrary._entry_name)))


def test_a_real_kernel_is_stored_as_an_sm_90a_cubin_without_a_gpu(cache):
    import json
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", "import test_compile_cache as t; t._compile_without_gpu()"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=os.path.dirname(__file__))
    last = (out.stdout.strip().splitlines() or [""])[-1]
    assert out.returncode == 0 and last.startswith(("SKIP", "DONE")), out.stdout + out.stderr
    if last.startswith("SKIP"):
        pytest.skip(f"numba-cuda cannot compile on this machine: {last[5:]}")
    report = json.loads(last[5:])
    assert report["kind"] == "_Kernel"
    assert report["counters"]["compiled"] == 1 and report["counters"]["stored"] == 1
    [(path, key_, name, size)] = _cache.entries()
    assert name == report["entry"] and "\narch sm_90a\n" in key_ and "make_cast_tc('float16')" in key_
    cubin = _cache.load(key_)[1]
    assert cubin[:4] == b"\x7fELF" and name.encode() in cubin


# ------------------------------------------------------------------------------------------------ precompile
def test_precompile_in_the_simulator_has_nothing_to_compile(capsys, cache):
    assert _jit.SIMULATOR
    assert precompile.main([]) == 0
    assert "nothing to compile" in capsys.readouterr().out
    assert not cache.exists()


def test_precompile_list_and_clear(capsys, cache):
    assert _cache.store(key(), "a", b"1")
    assert precompile.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert _cache.path_for(key()).name in out and "make_forward(64, 64)" in out and "stale" in out
    assert precompile.main(["--clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out and _cache.entries() == []
    with pytest.raises(SystemExit):
        precompile.main(["--dtypes", "float8"])


def test_precompile_with_the_cache_off_does_nothing_and_says_so(capsys, monkeypatch):
    monkeypatch.setenv(_cache.ENV, "off")
    assert precompile.main([]) == 1
    assert "the cache is off" in capsys.readouterr().out


def test_code_state_names_no_module():
    """A module captured by a kernel's code enters the key by no name: ``numba.types`` reads as ``numba.types`` or
    ``numba.core.types`` by import order (a second process on the H100 missed every kernel reaching the mma
    primitives), and the toolchain's versions key the modules' contents."""
    import math
    import numpy

    def make(mod):
        def kernel():
            return mod
        return kernel

    assert _jit.code_state(make(math)) == _jit.code_state(make(numpy))
    assert _jit.code_state(make(math)) != _jit.code_state(make(1))
