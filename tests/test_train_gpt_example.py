"""examples/train_gpt.py on the CPU: a tiny model for three steps (the GPU run is the example's real job)."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                          # the example's dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run_trains_and_reports(tmp_path, capsys):
    train_gpt = load_example()
    out_json = tmp_path / "run.json"
    result = train_gpt.main(["--device", "cpu", "--tiny", "--steps", "3", "--attn", "flashnb,materialised",
                             "--json", str(out_json)])
    text = capsys.readouterr().out
    assert result["corpus"]["chars"] > 100_000 and "corpus:" in text
    assert "flashnb" in result["runs"] and "CUDA" in result["runs"]["flashnb"]["skipped"]   # not faked on a CPU
    assert "SKIPPED" in text
    run = result["runs"]["materialised"]
    losses = [loss for _, loss in run["losses"]]
    assert [step for step, _ in run["losses"]] == [0, 1, 2] and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]                           # three AdamW steps already lower it (fixed seed)
    assert math.isfinite(run["final_train"]) and math.isfinite(run["final_val"]) and run["tokens_per_s"] > 0
    assert run["timed_steps"] == 2                          # the first step is the excluded warm-up
    assert "== comparison" in text and "== training loss" in text and "max |diff|" in text
    assert out_json.exists() and '"loss_curve"' in out_json.read_text()


def test_implementations_agree_on_the_cpu():
    """Same weights, same batches: the attention implementations give the same losses (float32 on the CPU)."""
    train_gpt = load_example()
    result = train_gpt.main(["--device", "cpu", "--tiny", "--steps", "2", "--eval-iters", "1",
                             "--attn", "sdpa-math,materialised"])
    assert max(row["max_abs_diff"] for row in result["loss_curve"]) < 1e-4
