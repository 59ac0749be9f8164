"""bench.host on the CPU: the per-call timing loop and the table (the real calls need a GPU)."""
import pytest

from bench import host
from bench.report import render_terminal


def test_per_call_us_divides_one_synchronised_loop():
    calls, syncs = [], []
    median, low = host.per_call_us(lambda: calls.append(1), lambda: syncs.append(1), calls=50, repeats=3)
    assert len(calls) == host.HOST_WARMUP + 3 * 50
    assert len(syncs) == 1 + 3 * 2                       # after the warm-up, then around each loop
    assert 0 <= low <= median < 1e4


def test_measure_host_turns_failures_into_rows(monkeypatch):
    def boom():
        raise RuntimeError("no kernel\nsecond line")

    monkeypatch.setattr(host, "host_calls", lambda torch: [("a", "fwd", lambda: None, None), ("a", "fwdbwd", boom, None),
                                                           ("b", "fwd", None, "import flashnb.torch failed: X")])
    torch_stub = type("T", (), {"cuda": type("C", (), {"synchronize": staticmethod(lambda: None)})})
    recs = host.measure_host(torch_stub, calls=5, repeats=2)
    assert [(r["impl"], r["pass"], r["status"]) for r in recs] == [("a", "fwd", "ok"), ("a", "fwdbwd", "n/a"),
                                                                  ("b", "fwd", "n/a")]
    assert recs[1]["note"] == "RuntimeError: no kernel" and recs[2]["note"].startswith("import flashnb.torch failed")
    text = render_terminal({}, [host.host_section(recs)])
    assert "## Host time per call: float16 B=1 N=16 H=1 d=64" in text
    assert "[1] RuntimeError: no kernel" in text and "[2] import flashnb.torch failed: X" in text
    row_a = next(line for line in text.splitlines() if line.startswith("a "))
    assert "n/a" in row_a and "[1]" in row_a


@pytest.mark.gpu
def test_host_calls_on_a_cuda_device():
    """The real rows, where PyTorch sees a GPU (skipped in the simulator)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    recs = host.measure_host(torch, calls=10, repeats=2)
    by = {(r["impl"], r["pass"]): r for r in recs}
    assert by[("torch SDPA", "fwd")]["status"] == "ok" and by[("torch SDPA", "fwdbwd")]["us"] > 0
    assert set(by) >= {("flashnb.flash_attention", p) for p in ("fwd", "bwd", "fwdbwd")}
