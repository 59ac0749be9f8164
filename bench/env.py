"""What machine this is: CUDA device detection (without importing numba) and the report header.

``cuda_device_count`` asks the driver library through ctypes, so it can run
before numba is imported; ``use_simulator_if_no_gpu`` then sets
``NUMBA_ENABLE_CUDASIM=1``, which numba reads once, at import.  (The same probe
as tests/conftest.py.)
"""
from __future__ import annotations

import ctypes
import datetime
import importlib
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _libcuda():
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def cuda_device_count() -> int:
    """Number of CUDA devices the driver sees; 0 without a driver or a device."""
    lib = _libcuda()
    if lib is None:
        return 0
    count = ctypes.c_int(0)
    try:
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
    except AttributeError:
        return 0
    return count.value


def use_simulator_if_no_gpu() -> bool:
    """Switch numba to its CUDA simulator when there is no device; True when simulated.

    Must run before the first ``import numba``; an explicit NUMBA_ENABLE_CUDASIM
    in the environment is respected either way.
    """
    if os.environ.get("NUMBA_ENABLE_CUDASIM") is None and cuda_device_count() == 0:
        if "numba" in sys.modules:
            raise RuntimeError("numba was imported before the simulator switch could be set")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def driver_cuda_version() -> str | None:
    """The CUDA version the driver supports (cuDriverGetVersion), e.g. '13.0'."""
    lib = _libcuda()
    if lib is None:
        return None
    v = ctypes.c_int(0)
    try:
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
    except AttributeError:
        return None
    return f"{v.value // 1000}.{(v.value % 1000) // 10}"


def driver_version() -> str | None:
    """The NVIDIA driver version string, e.g. '580.159' (NVML, else nvidia-smi)."""
    for name in ("libnvidia-ml.so.1", "libnvidia-ml.so", "nvml.dll"):
        try:
            nvml = ctypes.CDLL(name)
        except OSError:
            continue
        buf = ctypes.create_string_buffer(96)
        try:
            if nvml.nvmlInit_v2() == 0 and nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)) == 0:
                return buf.value.decode()
        except AttributeError:
            pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return None


_DISTRIBUTIONS = {  # header name -> installed distributions that provide it
    "flashnb": ("flashnb",),
    "numba": ("numba",),
    "numba-cuda": ("numba-cuda", "numba_cuda"),
    "numpy": ("numpy",),
    "torch": ("torch",),
    "cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"),
    "tabulate": ("tabulate",),
}


def library_versions() -> dict[str, str]:
    """Installed versions from package metadata (nothing is imported); 'not installed' else."""
    out = {}
    for name, dists in _DISTRIBUTIONS.items():
        version = None
        for dist in dists:
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        if version is None and name == "flashnb" and (REPO_ROOT / "flashnb").is_dir():
            version = "source tree"
        out[name] = version or "not installed"
    return out


def git_revision() -> str | None:
    """``<short sha>`` of the checkout the benchmark runs from, ``+dirty`` with local changes."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def command_line(argv: list[str] | None = None) -> str:
    """The command as it would be typed again: ``python -m bench ARGS``."""
    argv = sys.argv[1:] if argv is None else argv
    return shlex.join([Path(sys.executable).name, "-m", "bench", *argv])


def gpu_section(argv: list[str], name: str, what: str, test: str):
    """The start of a GPU-only section (``python -m bench --NAME``): None, having said why nothing is timed, in the
    simulator (no GPU); else ``torch``, having printed the report header (device, driver, versions, command)."""
    if use_simulator_if_no_gpu():
        print(f"bench --{name}: no CUDA device (or NUMBA_ENABLE_CUDASIM=1): {what} timings need a GPU; nothing "
              f"measured. The kernels' correctness runs in the simulator: pytest {test}")
        return None
    import torch
    device = {"name": torch.cuda.get_device_name(0), "driver": driver_version(), "cuda_driver": driver_cuda_version()}
    for key, value in header(argv, device, simulator=False).items():
        print(f"# {key}: {value}")
    return torch


def header(argv: list[str] | None, device: dict, simulator: bool) -> dict[str, str]:
    """The report header: where, when, with what, and the exact command line."""
    h = {
        "command": command_line(argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "device": device.get("name") or ("none (Numba CUDA simulator)" if simulator else "none"),
    }
    for key in ("compute_capability", "sms", "memory", "l2_cache", "driver", "cuda_driver",
                "cuda_runtime_torch", "cuda_runtime_cupy"):
        if device.get(key):
            h[key] = str(device[key])
    for name, version in library_versions().items():
        h[name] = version
    rev = git_revision()
    if rev:
        h["git"] = rev
    return h
