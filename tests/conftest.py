"""Test-session setup: choose the real GPU or Numba's CUDA simulator, and the Hypothesis profile.

This module is imported by pytest before any test module, so it can set
``NUMBA_ENABLE_CUDASIM`` before numba is first imported.  When no CUDA device
answers ``cuDeviceGetCount`` (probed through the driver library with ctypes, so
numba is not imported to find out), the whole session runs in the simulator and
the pytest header says so.
"""
import ctypes
import os
import sys

import numpy as np
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

# The simulator runs each CUDA thread as a Python thread, and its block manager
# polls them in a loop that never blocks: with Python's default 5 ms switch
# interval every thread that wants the GIL back waited up to 5 ms behind that
# loop, and a 0.2 ms interval made the simulated kernels 2-4x faster (2026-11-24).
# The loop now sleeps between passes that release nothing (``SIM_POLL_S``,
# ``_block_manager_that_sleeps``), and the default interval is then the faster
# one: the simulated FP8 forward 49 -> 12 s, a decode replay 66 -> 13 s
# (docs/testing.md, "Where the time goes").
SIM_SWITCH_INTERVAL_S = 5e-3
SIM_POLL_S = 5e-4
SIM_MANAGER_SOURCE = "54626c6819f55d51"      # numba-cuda 0.30.4's BlockManager.run, which the replacement copies


def _simulated_shared_arrays_made_once():
    """Replace the simulator's ``cuda.shared.array`` (static shapes) with one that makes each array once.

    numba-cuda 0.30's simulator keys a block's static shared arrays by the calling source line and makes one
    on the first call from that line, with no lock: two threads that both arrive before it exists each make
    their own, and then write and read different arrays (garbage indices and values; seen with the short
    switch interval above, in the simulated ``ldmatrix`` of kernels/_mma.py).  It also finds the line with
    ``traceback.extract_stack``, which walks the whole stack on every call.  This one reads the caller's frame
    and makes a missing array under a lock; the key and the one-array-per-line rule are the simulator's own.
    Dynamic shared memory (shape 0) is left to the original.
    """
    import threading

    from numba.cuda.np import numpy_support
    from numba.cuda.simulator import kernelapi
    from numba.cuda import types

    made = threading.Lock()
    original = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return original(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        res = self._allocations.get(key)
        if res is None:
            with made:
                res = self._allocations.get(key)
                if res is None:
                    res = np.empty(shape, numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else dtype)
                    self._allocations[key] = res
        return res

    kernelapi.FakeCUDAShared.array = array


def _block_manager_that_sleeps():
    """Replace the simulator's ``BlockManager.run`` with one whose polling loop sleeps ``SIM_POLL_S`` between
    passes that release nothing.

    numba-cuda 0.30's manager starts a block's threads and then scans them in a loop that never blocks, to
    release a ``syncthreads`` once every live thread waits there.  That loop holds the GIL whenever it runs, so
    every simulated thread waits behind it.  This one is the original loop with a short sleep added where it
    released nothing this pass; the rules (who is blocked, when all are released, how an exception aborts the
    others) are the original's.  It is a copy of numba-cuda 0.30.4's loop: if the installed simulator's
    ``BlockManager.run`` is not that one (its source's hash), the original stays and the switch interval goes
    back to item 1's 0.2 ms (docs/testing.md, "Where the time goes"), so an upgrade runs slower, never wrong.
    """
    import hashlib
    import inspect
    import time

    from numba.cuda.simulator import kernel

    source = hashlib.sha256(inspect.getsource(kernel.BlockManager.run).encode()).hexdigest()[:16]
    if source != SIM_MANAGER_SOURCE:
        return False

    def run(self, grid_point, *args):
        threads, livethreads, blockedthreads = set(), set(), set()
        for block_point in np.ndindex(*self._block_dim):
            t = kernel.BlockThread(lambda: self._f(*args), self, grid_point, block_point, self._debug)
            t.start()
            threads.add(t)
            livethreads.add(t)
        while livethreads:
            for t in livethreads:
                if t.syncthreads_blocked:
                    blockedthreads.add(t)
                elif t.exception:
                    for t_other in threads:       # abort every other thread, as the original
                        t_other.abort = True
                        t_other.syncthreads_blocked = False
                        t_other.syncthreads_event.set()
                    raise t.exception[0].with_traceback(t.exception[1])
            if livethreads == blockedthreads:
                for t in blockedthreads:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                blockedthreads = set()
            else:
                time.sleep(SIM_POLL_S)
            livethreads = {t for t in livethreads if t.is_alive()}
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    kernel.BlockManager.run = run
    return True


if SIMULATOR:
    sys.setswitchinterval(SIM_SWITCH_INTERVAL_S if _block_manager_that_sleeps() else 2e-4)
    _simulated_shared_arrays_made_once()

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


def _plan_settings():
    """``PLAN_SETTINGS="NAME=INT ..."`` in the environment: those constants of ``flashnb.plan`` for the whole session
    (a recorded GPU run of a flag that is off by default, e.g. ``PLAN_SETTINGS="FP8_WARP_SPECIALISED=1"``); the
    pytest header lists them.  Unset in CI."""
    settings_ = os.environ.get("PLAN_SETTINGS", "").split()
    if settings_:
        from flashnb import plan
        for item in settings_:
            name, value = item.split("=")
            if not hasattr(plan, name):
                raise pytest.UsageError(f"PLAN_SETTINGS: flashnb.plan has no {name}")
            setattr(plan, name, type(getattr(plan, name))(int(value)))
    return settings_


_PLAN_SETTINGS = _plan_settings()


def pytest_report_header(config):
    where = ("Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1): no CUDA device found" if SIMULATOR
             else "real CUDA device")
    return [f"flashnb: kernels run on the {where}", f"flashnb: hypothesis profile '{_profile}'"] + (
        [f"flashnb: plan settings {' '.join(_PLAN_SETTINGS)}"] if _PLAN_SETTINGS else [])


def pytest_collection_modifyitems(config, items):
    if not SIMULATOR:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA device; this session runs in the Numba simulator")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The per-test budget of the CI tier (docs/testing.md, "The budget"): in the simulator under the `ci`
# profile no single test may run longer than this; one that does fails, naming its time, so the suite
# cannot creep back towards CI's limit one slow property at a time.  The README's test command also
# prints the 15 slowest tests of every run.
CI_TEST_BUDGET_S = 60.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (SIMULATOR and _profile == "ci" and report.when == "call" and report.passed
            and report.duration > CI_TEST_BUDGET_S):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} passed but ran {report.duration:.1f} s, over the {CI_TEST_BUDGET_S:.0f} s "
                           "per-test budget of the ci profile in the simulator (docs/testing.md, \"The budget\"): "
                           "shrink its simulated grid or its example count, pinning edge cases with @example")
