"""Test-session setup: choose the real GPU or Numba's CUDA simulator, and the Hypothesis profile.

This module is imported by pytest before any test module, so it can set
``NUMBA_ENABLE_CUDASIM`` before numba is first imported.  When no CUDA device
answers ``cuDeviceGetCount`` (probed through the driver library with ctypes, so
numba is not imported to find out), the whole session runs in the simulator and
the pytest header says so.
"""
import ctypes
import os

import pytest
from hypothesis import HealthCheck, settings


def _cuda_device_count() -> int:
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0


if os.environ.get("NUMBA_ENABLE_CUDASIM") is None and _cuda_device_count() == 0:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

# Hypothesis profiles: `ci` is derandomised and bounded to fit the CI budget on
# 2 cores; `dev` is the default for local runs; `thorough` is for long runs.
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])
settings.register_profile("ci", derandomize=True, max_examples=25, print_blob=True, **_common)
settings.register_profile("dev", max_examples=40, **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
# the recorded GPU runs: every drawn specialisation (tiles, head dim, dtype, options)
# compiles its kernels (~5-10 s), so a GPU session draws fewer examples, derandomised
settings.register_profile("gpu", derandomize=True, max_examples=8, print_blob=True, **_common)
_profile = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
settings.load_profile(_profile)


def pytest_report_header(config):
    where = ("Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1): no CUDA device found" if SIMULATOR
             else "real CUDA device")
    return [f"flashnb: kernels run on the {where}", f"flashnb: hypothesis profile '{_profile}'"]


def pytest_collection_modifyitems(config, items):
    if not SIMULATOR:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA device; this session runs in the Numba simulator")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
