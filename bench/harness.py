"""One harness times every implementation: warm-up, then CUDA events around each call.

For each (case, implementation, pass):

1. setup, untimed: ``impl.make`` (a backward gets its saved state from one forward);
2. warm-up, excluded: one call (compiles Numba kernels, picks cuBLAS/cuDNN algorithms,
   fills allocator caches), then up to ``warmup`` timed calls that estimate the
   time of one call;
3. ``reps`` timed calls, each preceded by an L2 flush (so inputs come from HBM,
   as they would in a model), each bracketed by its own pair of CUDA events on
   the default stream; the count is cut so that the timed calls take about
   ``max_time_s``, but never below ``min(MIN_REPS, reps)``;
4. the reported time is the median (and the 10th/90th percentiles);
5. one more call measures the peak extra device memory (``Gpu.peak_extra_memory``).

An implementation that refuses a case (dtype, head dim, mask, ...) or runs out
of memory yields a result with status ``n/a`` or ``OOM`` and the reason; the
sweep goes on.  Only an error that leaves the device unusable (a sticky CUDA
error) stops it, with ``DeviceLost``.
"""
from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass

from bench.cases import Case
from bench.flops import tflops_per_s
from bench.gpu import is_out_of_memory

MIN_REPS = 5
MISMATCH_TOLERANCE = 5e-2   # relative max |flashnb - SDPA| of the forward that marks a result as wrong


@dataclass
class Settings:
    warmup: int = 3
    reps: int = 30
    max_time_s: float = 1.0
    seed: int = 0
    check: bool = True


@dataclass
class Result:
    """One row of the long results table: a case, an implementation, a pass."""
    case: Case
    impl: str
    pass_: str
    status: str = "ok"                 # "ok", "n/a", "OOM"
    ms: float | None = None            # median
    ms_p10: float | None = None
    ms_p90: float | None = None
    reps: int = 0
    peak_bytes: int | None = None
    max_rel_err: float | None = None   # flashnb forward vs torch SDPA, when checked
    note: str = ""

    @property
    def flops(self) -> int:
        return self.case.flops(self.pass_)

    @property
    def tflops(self) -> float | None:
        return tflops_per_s(self.flops, self.ms) if self.status == "ok" else None

    def record(self) -> dict:
        """Flat dict with the fields of ``report.RESULT_FIELDS``."""
        return {**self.case.fields(), "impl": self.impl, "pass": self.pass_, "status": self.status,
                "ms": self.ms, "ms_p10": self.ms_p10, "ms_p90": self.ms_p90, "reps": self.reps,
                "tflops": self.tflops, "flops": self.flops,
                "peak_mib": None if self.peak_bytes is None else self.peak_bytes / 2**20,
                "max_rel_err": self.max_rel_err, "note": self.note}


class DeviceLost(RuntimeError):
    """The device no longer answers (sticky CUDA error); no further measurement is possible."""


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of an ascending list, q in [0, 100]."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def repetitions(estimate_ms: float, settings: Settings) -> int:
    """How many timed calls: about ``max_time_s`` worth, within [min(MIN_REPS, reps), reps]."""
    floor = min(MIN_REPS, settings.reps)
    if estimate_ms <= 0:
        return settings.reps
    return int(max(floor, min(settings.reps, settings.max_time_s * 1e3 // estimate_ms)))


def time_callable(fn, gpu, settings: Settings) -> list[float]:
    """Per-call times in ms, ascending, of the timed repetitions of ``fn`` (see the module docstring)."""
    fn()                                                     # first call: compile, autotune, allocate
    gpu.synchronize()
    warm_ms = []
    for _ in range(max(1, settings.warmup)):
        warm_ms.append(_timed_calls(fn, gpu, 1)[0])
        if sum(warm_ms) > 250 * settings.max_time_s:     # slow call: a quarter of the budget is enough
            break
    times = _timed_calls(fn, gpu, repetitions(min(warm_ms), settings))
    return sorted(times)


def _timed_calls(fn, gpu, n: int) -> list[float]:
    events = [gpu.event_pair() for _ in range(n)]
    for start, end in events:
        gpu.flush_l2()
        gpu.record(start)
        fn()                                                 # the result is dropped at once
        gpu.record(end)
    gpu.synchronize()
    return [gpu.elapsed_ms(start, end) for start, end in events]


def _reason(exc: BaseException, caught_warnings) -> str:
    """One line: the exception, then the distinct warnings raised on the way (PyTorch's SDPA
    explains in warnings why a backend refused)."""
    parts = [f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")]
    for w in caught_warnings:
        text = " ".join(str(w.message).split())
        if text and text not in parts:
            parts.append(text)
    return " | ".join(parts)


def measure(impl, case: Case, data, pass_: str, gpu, settings: Settings) -> Result:
    """Time one pass of one implementation on one case; never raises except ``DeviceLost``."""
    result = Result(case, impl.name, pass_)
    fn = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn = impl.make(case, data, pass_)
            times = time_callable(fn, gpu, settings)
            with gpu.peak_extra_memory() as mem:
                fn()
            result.ms = percentile(times, 50)
            result.ms_p10, result.ms_p90 = percentile(times, 10), percentile(times, 90)
            result.reps, result.peak_bytes = len(times), mem["bytes"]
            if settings.check and pass_ == "fwd" and impl.check is not None:
                result.max_rel_err = impl.check(case, data)
                if result.max_rel_err is not None and not result.max_rel_err <= MISMATCH_TOLERANCE:
                    result.note = f"MISMATCH: forward differs from torch SDPA by {result.max_rel_err:.2e} (relative)"
        except Exception as exc:                            # noqa: BLE001 - every failure becomes a row
            result.status = "OOM" if is_out_of_memory(exc) else "n/a"
            result.ms = result.ms_p10 = result.ms_p90 = None
            result.reps, result.peak_bytes = 0, None
            result.note = _reason(exc, caught)
            lost = gpu.healthy()
            if lost is not None:
                raise DeviceLost(f"{impl.name} {pass_} on {case.label()}: {result.note}; then: {lost}") from exc
        finally:
            del fn
            gpu.release_cached_memory()
    return result


class Progress:
    """A one-line progress indicator on stderr (a line per case when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self._last_case = None

    def update(self, case: Case, impl: str, pass_: str):
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        eta = "" if self.done == 0 else f", ~{elapsed / self.done * (self.total - self.done):.0f} s left"
        head = f"[{self.done + 1}/{self.total} {elapsed:.0f} s{eta}]"
        if self.tty:
            line = f"{head} {case.label()} {impl} {pass_}"
            self.stream.write("\r" + line[:150].ljust(150))
        elif case != self._last_case:
            self.stream.write(f"{head} {case.label()}\n")
        self._last_case = case
        self.stream.flush()

    def step(self):
        self.done += 1

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\r" + " " * 150 + "\r")
            self.stream.flush()


def run_sweep(cases, impls, passes, gpu, settings: Settings, make_data, progress: Progress) -> list[Result]:
    """Every (case, impl, pass), in that order; the inputs of a case are made once and shared.

    On ``DeviceLost`` or Ctrl-C the results so far are attached to the exception
    (``exc.partial_results``) so that the caller can still report them.
    """
    results: list[Result] = []
    try:
        for case in cases:
            try:
                data = make_data(case)
            except Exception as exc:                        # noqa: BLE001 - e.g. OOM for the inputs
                status = "OOM" if is_out_of_memory(exc) else "n/a"
                note = f"inputs: {_reason(exc, [])}"
                for impl in impls:
                    for pass_ in passes:
                        results.append(Result(case, impl.name, pass_, status=status, note=note))
                        progress.step()
                gpu.release_cached_memory()
                continue
            for impl in impls:
                for pass_ in passes:
                    progress.update(case, impl.name, pass_)
                    results.append(measure(impl, case, data, pass_, gpu, settings))
                    progress.step()
            del data
            gpu.release_cached_memory()
    except (DeviceLost, KeyboardInterrupt) as exc:
        exc.partial_results = results
        raise
    finally:
        progress.close()
    return results
