"""The timing harness on the CPU: a fake GPU whose clock the fake implementations advance.

Checks what the harness promises: the first call and the warm-up are not timed,
the L2 is flushed before every timed call, the median is reported, the number of
repetitions follows the time budget, refusals and OOM become rows with reasons,
a lost device stops the sweep with the results so far, and the whole GPU path of
``python -m bench`` (``cli.run_with_gpu``) runs end to end.
"""
import contextlib
import json
import types
import warnings

import numpy as np
import pytest

from bench import cli
from bench.cases import Case, sweep
from bench.flops import attended_pairs
from bench.harness import DeviceLost, Progress, Settings, measure, percentile, repetitions, run_sweep
from bench.impls import CaseData, Impl, select


class FakeEvent:
    t = None


class FakeGpu:
    """Just enough of ``bench.gpu.Gpu``: a clock in ms that the callables advance."""
    library = "fake"

    def __init__(self, *_):
        self.clock, self.flushes, self.log, self.lost = 0.0, 0, [], None

    def event_pair(self):
        return FakeEvent(), FakeEvent()

    def record(self, e):
        e.t = self.clock

    def elapsed_ms(self, a, b):
        return b.t - a.t

    def flush_l2(self):
        self.flushes += 1
        self.log.append("flush")

    def synchronize(self):
        if self.lost:
            raise RuntimeError(self.lost)

    @contextlib.contextmanager
    def peak_extra_memory(self):
        result = {"bytes": None}
        yield result
        result["bytes"] = 4096

    def release_cached_memory(self):
        pass

    def healthy(self):
        return self.lost

    def info(self):
        return {"name": "Fake GPU", "sms": 1}


def ticking(gpu, costs):
    """A callable whose n-th call takes costs[n] ms (the last cost repeats)."""
    calls = []

    def fn():
        cost = costs[min(len(calls), len(costs) - 1)]
        calls.append(cost)
        gpu.log.append("call")
        gpu.clock += cost
    fn.calls = calls
    return fn


def impl_of(fn_for_pass, name="flashnb-fake", family="flashnb", check=None):
    return Impl(name, family, lambda case, data, pass_: fn_for_pass(pass_), check)


CASE = Case("float16", 2, 4, 4, 128, 128, 64, False)


def test_first_call_and_warmup_are_excluded_and_median_reported():
    gpu = FakeGpu()
    # call 1 compiles (1000 ms), 3 warm-up calls, then timed calls: 1, 2, 3, ... ms
    costs = [1000.0, 50.0, 50.0, 50.0] + [float(i) for i in range(1, 100)]
    fn = ticking(gpu, costs)
    res = measure(impl_of(lambda p: fn), CASE, None, "fwd", gpu, Settings(warmup=3, reps=9, max_time_s=10))
    assert res.status == "ok" and res.reps == 9
    assert res.ms == 5.0 and res.ms_p10 == pytest.approx(1.8) and res.ms_p90 == pytest.approx(8.2)
    assert res.peak_bytes == 4096
    assert len(fn.calls) == 1 + 3 + 9 + 1          # first, warm-up, timed, memory
    # every timed (and warm-up) call comes right after a flush
    timed_log = gpu.log[1:]
    assert all(timed_log[i] == "flush" and timed_log[i + 1] == "call" for i in range(0, 2 * 12, 2))


def test_repetitions_follow_the_time_budget():
    s = Settings(reps=30, max_time_s=1.0)
    assert repetitions(1.0, s) == 30          # fast: capped by reps
    assert repetitions(100.0, s) == 10        # 1 s / 100 ms
    assert repetitions(5000.0, s) == 5        # slow: never below 5
    assert repetitions(5000.0, Settings(reps=3, max_time_s=1.0)) == 3   # nor above reps


def test_slow_calls_cut_the_warmup_short():
    gpu = FakeGpu()
    fn = ticking(gpu, [10.0, 900.0])
    res = measure(impl_of(lambda p: fn), CASE, None, "fwd", gpu, Settings(warmup=10, reps=30, max_time_s=1.0))
    assert len(fn.calls) == 1 + 1 + 5 + 1      # one warm-up call used over a quarter of the budget: enough
    assert res.reps == 5 and res.ms == 900.0


def test_percentile_is_numpy_linear():
    xs = sorted(np.random.default_rng(0).random(17).tolist())
    for q in (0, 10, 50, 90, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))


def test_a_refusal_becomes_an_na_row_with_the_warnings_as_reason():
    gpu = FakeGpu()

    def refuse(pass_):
        warnings.warn("Flash attention only supports float16 and bfloat16")
        raise RuntimeError("No available kernel. Aborting execution.")
    res = measure(impl_of(refuse, "sdpa-flash", "baseline"), CASE, None, "fwd", gpu, Settings())
    assert res.status == "n/a" and res.ms is None and res.tflops is None
    assert res.note == ("RuntimeError: No available kernel. Aborting execution. | "
                        "Flash attention only supports float16 and bfloat16")


def test_out_of_memory_is_reported_as_oom_even_mid_timing():
    gpu = FakeGpu()
    n = []

    def fn():
        n.append(1)
        if len(n) > 2:
            OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
    res = measure(impl_of(lambda p: fn), CASE, None, "fwd", gpu, Settings())
    assert res.status == "OOM" and res.reps == 0 and "16.00 GiB" in res.note


def test_forward_check_flags_a_mismatch():
    gpu = FakeGpu()
    fn = ticking(gpu, [1.0])
    res = measure(impl_of(lambda p: fn, check=lambda case, data: 0.3), CASE, None, "fwd", gpu, Settings(reps=5))
    assert res.status == "ok" and res.max_rel_err == 0.3 and res.note.startswith("MISMATCH")
    res = measure(impl_of(lambda p: fn, check=lambda case, data: 1e-3), CASE, None, "fwd", gpu, Settings(reps=5))
    assert res.note == ""
    res = measure(impl_of(lambda p: fn, check=lambda case, data: float("nan")), CASE, None, "fwd", gpu,
                  Settings(reps=5))
    assert res.note.startswith("MISMATCH")
    res = measure(impl_of(lambda p: fn, check=lambda case, data: 0.3), CASE, None, "bwd", gpu, Settings(reps=5))
    assert res.max_rel_err is None                 # only the forward is checked


def test_sweep_runs_every_case_impl_pass_and_survives_failures():
    gpu = FakeGpu()
    cases = sweep(("float16",), (128, 256), (64,), (False, True))
    good = impl_of(lambda p: ticking(gpu, [1.0]))
    bad = impl_of(lambda p: (_ for _ in ()).throw(ValueError("head dim 64 unsupported")), "cupy-materialised",
                  "baseline")
    made = []
    out = run_sweep(cases, [good, bad], ("fwd", "fwdbwd"), gpu, Settings(reps=5), lambda c: made.append(c) or c,
                    Progress(0, enabled=False))
    assert made == cases
    assert len(out) == 4 * 2 * 2
    assert [(r.case, r.impl, r.pass_) for r in out[:4]] == [
        (cases[0], "flashnb-fake", "fwd"), (cases[0], "flashnb-fake", "fwdbwd"),
        (cases[0], "cupy-materialised", "fwd"), (cases[0], "cupy-materialised", "fwdbwd")]
    assert {r.status for r in out if r.impl == "flashnb-fake"} == {"ok"}
    assert {r.note for r in out if r.impl != "flashnb-fake"} == {"ValueError: head dim 64 unsupported"}


def test_inputs_that_do_not_fit_give_oom_rows_for_every_impl():
    gpu = FakeGpu()

    def no_memory(case):
        raise MemoryError("out of memory allocating q")
    out = run_sweep([CASE], [impl_of(lambda p: None)], ("fwd", "bwd"), gpu, Settings(), no_memory,
                    Progress(0, enabled=False))
    assert [(r.status, r.pass_) for r in out] == [("OOM", "fwd"), ("OOM", "bwd")]
    assert out[0].note.startswith("inputs: MemoryError")


def test_a_lost_device_stops_the_sweep_and_keeps_the_results_so_far():
    gpu = FakeGpu()
    ok = impl_of(lambda p: ticking(gpu, [1.0]))

    def crash(pass_):
        gpu.lost = "CUDA_ERROR_ILLEGAL_ADDRESS"
        raise RuntimeError("an illegal memory access was encountered")
    with pytest.raises(DeviceLost) as info:
        run_sweep([CASE, CASE], [ok, impl_of(crash, "flashnb-bad")], ("fwd",), gpu, Settings(reps=5),
                  lambda c: c, Progress(0, enabled=False))
    assert [r.impl for r in info.value.partial_results] == ["flashnb-fake"]
    assert "ILLEGAL_ADDRESS" in str(info.value)


def test_progress_writes_a_line_per_case_when_not_a_terminal(capsys):
    import io
    stream = io.StringIO()
    p = Progress(4, stream=stream)
    for impl in ("a", "b"):
        p.update(CASE, impl, "fwd")
        p.step()
    p.update(Case("float16", 1, 1, 1, 8, 8, 8, True), "a", "fwd")
    p.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[1/4 ") and "causal" in lines[1]


def test_select_by_name_and_prefix():
    impls = [Impl(n, "x", None) for n in ("flashnb-simt", "sdpa-flash", "sdpa-cudnn", "torch-materialised")]
    assert [i.name for i in select(impls, None)] == [i.name for i in impls]
    assert [i.name for i in select(impls, ("sdpa",))] == ["sdpa-flash", "sdpa-cudnn"]
    assert [i.name for i in select(impls, ("torch-materialised", "flashnb"))] == ["flashnb-simt", "torch-materialised"]
    with pytest.raises(ValueError, match="known: flashnb-simt"):
        select(impls, ("triton",))


@pytest.mark.parametrize("case", [
    Case("float16", 1, 2, 2, 7, 7, 8, True),
    Case("float16", 1, 2, 1, 5, 9, 8, True),
    Case("float16", 1, 2, 2, 9, 5, 8, True, window=(2, -1)),
    Case("float16", 1, 2, 2, 6, 6, 8, False, window=(1, 1)),
])
def test_baseline_masks_follow_the_semantics(case):
    """The mask the materialised and SDPA baselines get, built with NumPy standing in for torch/cupy."""
    data = CaseData.__new__(CaseData)
    data.case = case
    ok = data.allowed(np, {})
    assert ok.shape == (case.seqlen_q, case.seqlen_k)
    assert int(ok.sum()) == attended_pairs(case.seqlen_q, case.seqlen_k, case.causal, case.window)
    if case.causal and case.window == (-1, -1):      # bottom-right: the last query sees every key
        assert ok[-1].all()


def test_gpu_path_end_to_end_with_a_fake_device(monkeypatch, tmp_path, capsys):
    """``run_with_gpu`` with the device, libraries and implementations replaced by fakes."""
    import bench.gpu
    import bench.impls
    gpu = FakeGpu()
    speed = {"flashnb-fake": 1.0, "sdpa-flash": 2.0, "torch-materialised": 8.0}

    def fake_impls(libs):
        impls = [impl_of(lambda p, n=n: ticking(gpu, [speed[n] * (2.5 if p == "bwd" else 1.0)]), n,
                         "flashnb" if n.startswith("flashnb") else "baseline") for n in speed]
        return impls + [Impl("cupy-materialised", "baseline", None, unavailable="cupy: not installed")]

    torch_stub = types.SimpleNamespace(backends=types.SimpleNamespace(
        cuda=types.SimpleNamespace(matmul=types.SimpleNamespace(allow_tf32=False))))
    monkeypatch.setattr(cli, "_import_libraries", lambda: bench.impls.Libraries(torch=torch_stub))
    monkeypatch.setattr(bench.gpu, "Gpu", lambda torch, cupy: gpu)
    monkeypatch.setattr(bench.gpu, "install_numba_memory_counter", lambda: None)
    monkeypatch.setattr(bench.impls, "all_impls", fake_impls)
    monkeypatch.setattr(bench.impls, "CaseData", lambda gpu, case, seed, cupy: case)
    monkeypatch.setattr(cli, "_stop_cleanly_on_sigterm", lambda: None)   # leave pytest's signal handlers alone
    out = tmp_path / "run.json"
    argv = ["--seqlens", "512,1024", "--headdims", "64", "--no-check", "--reps", "5", "--quiet",
            "--format", "json", "--output", str(out)]
    assert cli.run_with_gpu(cli.parse_args(argv), argv) == 0
    doc = json.loads(out.read_text())
    assert doc["header"]["device"] == "Fake GPU" and doc["header"]["command"].endswith("--output " + str(out))
    assert any("cupy-materialised" in m for m in doc["messages"])
    # 4 cases x 3 impls x 3 passes in the main table
    assert len(doc["results"]) == 4 * 3 * 3 and {r["status"] for r in doc["results"]} == {"ok"}
    s = {(x["baseline"], x["pass"]): x["geomean_speedup"] for x in doc["summary"]}
    assert s[("sdpa-flash", "fwd")] == pytest.approx(2.0) and s[("torch-materialised", "bwd")] == pytest.approx(8.0)
    io = {r["setting"]: r for r in doc["io_model"] if r["seqlen_q"] == 1024}
    assert io["Figure 2"]["flash_fwd_ms"] == 1.0 and io["Figure 2"]["std_bwd_ms"] == 20.0   # measured extra
    assert io["sweep"]["std_fwd_ms"] == 8.0           # from the main results
    printed = capsys.readouterr().out
    assert "## Is flashnb worth it?" in printed and "0.50x" not in printed and "2.00x (4/4 faster; memory 1x)" in printed


def test_gpu_path_quick_set_with_host_times(monkeypatch, tmp_path):
    """``python -m bench`` with no options on a fake device: the quick set's cases, implementations and
    passes, and the host-time table (its measurement replaced by fake calls)."""
    import bench.gpu
    import bench.host
    import bench.impls
    gpu = FakeGpu()
    names = ["flashnb-auto", "flashnb-simt", "flashnb-tensorcore", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient",
             "sdpa-math", "torch-materialised"]

    def fake_impls(libs):
        return [impl_of(lambda p: ticking(gpu, [1.0]), n, "flashnb" if n.startswith("flashnb") else "baseline")
                for n in names] + [Impl("cupy-materialised", "baseline", None, unavailable="cupy: not installed")]

    torch_stub = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None), backends=types.SimpleNamespace(
        cuda=types.SimpleNamespace(matmul=types.SimpleNamespace(allow_tf32=False))))
    host_calls = [("flashnb.torch.flash_attn_func", "fwd", lambda: None, None),
                  ("flashnb.torch.flash_attn_func", "fwdbwd", lambda: None, None),
                  ("flashnb.flash_attention", "bwd", None, "flashnb: not here"),
                  ("torch SDPA", "fwd", lambda: None, None)]
    monkeypatch.setattr(bench.host, "host_calls", lambda torch: host_calls)
    monkeypatch.setattr(cli, "_import_libraries", lambda: bench.impls.Libraries(torch=torch_stub))
    monkeypatch.setattr(bench.gpu, "Gpu", lambda torch, cupy: gpu)
    monkeypatch.setattr(bench.gpu, "install_numba_memory_counter", lambda: None)
    monkeypatch.setattr(bench.impls, "all_impls", fake_impls)
    monkeypatch.setattr(bench.impls, "CaseData", lambda gpu, case, seed, cupy: case)
    monkeypatch.setattr(cli, "_stop_cleanly_on_sigterm", lambda: None)
    out = tmp_path / "run.json"
    argv = ["--no-check", "--quiet", "--format", "json", "--output", str(out)]
    assert cli.run_with_gpu(cli.parse_args(argv), argv) == 0
    doc = json.loads(out.read_text())
    assert doc["header"]["cases"].startswith("quick set: 8 cases")
    assert {r["impl"] for r in doc["results"]} == {"flashnb-auto", "sdpa-flash", "sdpa-cudnn", "torch-materialised"}
    assert {r["pass"] for r in doc["results"]} == {"fwd", "fwdbwd"} and len(doc["results"]) == 8 * 4 * 2
    host = {(r["impl"], r["pass"]): r for r in doc["host"]}
    assert host[("torch SDPA", "fwd")]["status"] == "ok" and host[("torch SDPA", "fwd")]["us"] >= 0
    assert host[("flashnb.flash_attention", "bwd")]["status"] == "n/a"
    assert "## Host time per call" in render_host(doc)
    assert not any("cupy-materialised" in m for m in doc["messages"])      # not in the quick set: not mentioned

    argv = ["--host", "--format", "json", "--output", str(out)]                # --host: only that table
    assert cli.run_with_gpu(cli.parse_args(argv), argv) == 0
    doc = json.loads(out.read_text())
    assert doc["results"] == [] and len(doc["host"]) == 4 and "summary" not in doc and "io_model" not in doc


def render_host(doc):
    """The terminal rendering of a JSON report's host section."""
    from bench.host import host_section
    from bench.report import render_terminal
    return render_terminal({}, [host_section(doc["host"])])
