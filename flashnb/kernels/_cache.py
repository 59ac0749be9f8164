"""The on-disk cache of compiled kernels: each kernel specialisation compiles once per machine, not per process.

Numba takes seconds to compile one specialisation (a factory's kernel at one set of argument types) and keeps
the result only for the process.  ``_jit._compile`` asks this module first: an entry holds the cubin Numba
linked for the device and the name of its entry point, and ``_jit`` loads it with the CUDA driver without
compiling.  This module is pure Python (files, hashes, versions), so the tests run it without a GPU.

**Key** (``key_text``): the kernel's stable id (``_jit.kernel_factory``: the factory's module, name and
arguments), its jit options and ``_jit.code_state`` (the values in its closures and the module globals its
code uses, through its device functions), the Numba types of the launch's arguments, the target
architecture (``sm_90a`` on an H100), a hash of every source file under ``flashnb/kernels/``
(``source_hash``), and the versions of flashnb, Python, Numba, numba-cuda, llvmlite, NumPy, cuda-bindings,
NVVM, the CUDA runtime, nvJitLink and the driver, and the Numba settings that change generated code
(``toolchain``).  An entry's file name is the first 40 hex digits of the key's sha256; the full key is
stored in the entry and compared on load, so a changed source, version or device never loads an old cubin.

**Location** (``cache_dir``): ``$FLASHNB_CACHE_DIR`` if set (``off`` turns the cache off; an empty value
counts as unset), else platformdirs' user cache directory for "flashnb" (``~/.cache/flashnb`` on Linux).

**Entry file**: ``MAGIC``, the sha256 of the payload (32 bytes), the payload: a 4-byte little-endian header
length, the header (UTF-8 JSON ``{"key": ..., "name": ...}``), the cubin.  ``load`` treats a missing,
unreadable, truncated or altered file, a wrong magic or checksum and a different stored key alike: a miss
(the caller compiles and ``store`` overwrites the entry).  ``store`` writes a temporary file in the same
directory and renames it over the entry (``os.replace``), so concurrent processes never see a partial entry;
if the directory cannot be written it warns once per process and the call goes on uncached.
"""
import functools
import hashlib
import json
import os
import platform
import struct
import tempfile
import threading
import warnings
from pathlib import Path

ENV = "FLASHNB_CACHE_DIR"
OFF = "off"
MAGIC = b"FLASHNB-KERNEL\x00\x01"   # 16 bytes; the last one is the file format's version
SUFFIX = ".kernel"
TMP_PREFIX = ".tmp-"
KEY_VERSION = 1                      # bumped when the meaning of a key's fields changes
SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".h", ".ptx")
KERNELS_DIR = Path(__file__).resolve().parent

# What the launch path did in this process, for reports and tests: entries ``loaded`` from disk, kernels
# ``compiled`` by Numba (counted by ``_jit``), entries ``stored``; ``missed`` (no entry), ``rejected``
# (an unusable entry: see ``load``), ``store_failed`` (the directory cannot be written).
counters = dict.fromkeys(("loaded", "compiled", "stored", "missed", "rejected", "store_failed"), 0)
# One record per specialisation the launch path made ready (``note``): kernel, args, arch, how, seconds,
# entry file.
log = []
_lock = threading.Lock()
_warned = False


# ------------------------------------------------------------------------------------------------ location
def cache_dir():
    """The cache's directory (a ``Path``), or None when ``FLASHNB_CACHE_DIR=off``."""
    env = os.environ.get(ENV, "").strip()
    if env.lower() == OFF:
        return None
    if env:
        return Path(env).expanduser()
    try:
        import platformdirs
        return Path(platformdirs.user_cache_dir("flashnb", appauthor=False))
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "flashnb"


def path_for(key):
    """The entry file of ``key`` (None when the cache is off)."""
    directory = cache_dir()
    if directory is None:
        return None
    return directory / (hashlib.sha256(key.encode("utf-8")).hexdigest()[:40] + SUFFIX)


# ------------------------------------------------------------------------------------------------ key
def key_text(kernel, args, arch, *, toolchain_versions=None, sources=None):
    """The full key of one compiled kernel, as text: ``kernel`` its stable id, ``args`` its argument types,
    ``arch`` the target (``"sm_90a"``); ``toolchain_versions`` (default ``toolchain()``) and ``sources``
    (default ``source_hash()``) are what else it depends on."""
    versions = toolchain() if toolchain_versions is None else toolchain_versions
    lines = [f"flashnb kernel cache key {KEY_VERSION}", f"kernel {kernel}", f"args {args}", f"arch {arch}",
             f"sources {source_hash() if sources is None else sources}"]
    lines += [f"{name} {versions[name]}" for name in sorted(versions)]
    return "\n".join(lines)


def hash_sources(root):
    """sha256 (hex) of every source file under ``root`` (``SOURCE_SUFFIXES``): their paths and contents."""
    h = hashlib.sha256()
    root = Path(root)
    for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts):
        if path.is_file():
            data = path.read_bytes()
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + struct.pack("<Q", len(data)) + data)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def source_hash():
    """``hash_sources`` of ``flashnb/kernels/`` (once per process)."""
    return hash_sources(KERNELS_DIR)


# Numba settings (environment variables) that change the code of a kernel with the same jit options
_NUMBA_SETTINGS = ("OPT", "BOUNDSCHECK", "DEBUGINFO_DEFAULT", "CUDA_DEBUGINFO_DEFAULT", "EXTEND_VARIABLE_LIFETIMES",
                   "CUDA_ENABLE_NRT", "FORCE_CUDA_CC")


@functools.lru_cache(maxsize=None)
def toolchain():
    """{name: version} of everything that turns the sources into a cubin or loads it (once per process;
    ``"none"`` for what is missing, e.g. the driver on a machine without a GPU)."""
    from importlib import metadata
    versions = {"python": f"{platform.python_implementation()} {platform.python_version()}"}
    for dist in ("flashnb", "numba", "numba-cuda", "llvmlite", "numpy", "cuda-bindings"):
        versions[dist] = _version(lambda: metadata.version(dist))

    def nvvm():
        from numba.cuda.cudadrv import nvvm as lib
        return f"{lib.NVVM().get_version()} ir {lib.NVVM().get_ir_version()}"

    def cudart():
        from numba.cuda.cudadrv import runtime
        return runtime.runtime.get_version()

    def nvjitlink():
        from cuda.bindings import nvjitlink as lib
        return lib.version()

    def driver():
        from cuda.bindings import driver as lib
        err, version = lib.cuDriverGetVersion()
        return version if int(err) == 0 else None

    def settings():
        from numba import config
        return ",".join(f"{name}={getattr(config, name, None)!r}" for name in _NUMBA_SETTINGS)

    for name, get in (("nvvm", nvvm), ("cudart", cudart), ("nvjitlink", nvjitlink), ("driver", driver),
                      ("numba-settings", settings)):
        versions[name] = _version(get)
    return versions


def _version(get):
    try:
        value = get()
    except Exception:   # absent or unloadable (no driver here, say): a fixed value, still part of the key
        return "none"
    return "none" if value is None else str(value)


# ------------------------------------------------------------------------------------------------ entries
def encode(key, name, cubin):
    """An entry file's bytes."""
    header = json.dumps({"key": key, "name": name}).encode("utf-8")
    payload = struct.pack("<I", len(header)) + header + bytes(cubin)
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode(data):
    """(key, name, cubin) of an entry file's bytes, or None if they are not a whole, unaltered entry."""
    start = len(MAGIC) + 32
    if len(data) < start + 4 or data[:len(MAGIC)] != MAGIC:
        return None
    payload = memoryview(data)[start:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC):start]:
        return None
    (size,) = struct.unpack_from("<I", payload)
    if 4 + size >= len(payload):                               # no room for a cubin
        return None
    try:
        header = json.loads(bytes(payload[4:4 + size]).decode("utf-8"))
        key, name = header["key"], header["name"]
    except (ValueError, KeyError, TypeError):
        return None
    if not (isinstance(key, str) and isinstance(name, str) and name):
        return None
    return key, name, bytes(payload[4 + size:])


def load(key):
    """(entry name, cubin) stored for ``key``, or None (a miss: no entry, the cache off, or an entry that is
    unreadable, truncated, altered or of another key)."""
    path = path_for(key)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        count("missed")
        return None
    entry = decode(data)
    if entry is None or entry[0] != key:
        count("rejected")
        return None
    count("loaded")
    return entry[1], entry[2]


def store(key, name, cubin):
    """Store ``cubin`` (bytes) and its entry point ``name`` under ``key``, replacing any entry atomically.
    True if stored; False if the cache is off or cannot be written (warned once per process, never raised)."""
    path = path_for(key)
    if path is None:
        return False
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=SUFFIX, dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):                          # mkstemp's 0600 would hide it from a shared cache
                os.fchmod(f.fileno(), 0o644)
            f.write(encode(key, name, cubin))
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        count("store_failed")
        warn_once(f"flashnb: cannot write the kernel cache in {path.parent} ({e}); kernels will compile in "
                   f"every process. Set {ENV} to a writable directory (or to '{OFF}').")
        return False
    count("stored")
    return True


def entries(directory=None):
    """[(path, key or None, name or None, bytes)] of the entry files in ``directory`` (default: the cache's;
    key None: not a valid entry)."""
    directory = cache_dir() if directory is None else Path(directory)
    if directory is None or not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob("*" + SUFFIX)):
        if path.name.startswith(TMP_PREFIX):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        entry = decode(data)
        found.append((path, entry and entry[0], entry and entry[1], len(data)))
    return found


def clear(directory=None):
    """Delete the entry files (and leftover temporary files) in ``directory`` (default: the cache's) and
    nothing else; the number deleted."""
    directory = cache_dir() if directory is None else Path(directory)
    if directory is None or not directory.is_dir():
        return 0
    removed = 0
    for path in directory.glob("*" + SUFFIX):
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def note(kernel, args, arch, how, seconds, entry=None):
    """Record that the launch path made a specialisation ready (``how``: "loaded", "compiled", ...;
    ``entry``: its entry file, None if not cached on disk)."""
    with _lock:
        log.append(dict(kernel=kernel, args=args, arch=arch, how=how, seconds=seconds, entry=entry))


def count(name):
    with _lock:
        counters[name] += 1


def warn_once(message):
    """Warn (a RuntimeWarning) once per process about the cache."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)
