"""``python -m bench``: option parsing, and the no-GPU path run as a real subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cli, report
from bench.cases import Case

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_the_quick_set():
    args = cli.parse_args([])
    assert args.quick and not args.full and args.with_host
    assert args.dtype == ("float16",) and args.passes == ("fwd", "fwdbwd") and args.impl is None
    assert args.format == "table" and args.output is None and args.plot is None and args.check
    assert [(c.seqlen_q, c.headdim, c.causal) for c in args.cases] == [
        (n, d, causal) for d in (64, 128) for causal in (False, True) for n in (1024, 4096)]
    assert args.cases[0] == Case("float16", 16, 32, 32, 1024, 1024, 64, False)      # 16k tokens, width 2048
    assert args.cases[-1] == Case("float16", 4, 16, 16, 4096, 4096, 128, True)
    assert "quick set: 8 cases" in cli.what_runs(args)


def test_full_is_the_flash_attn_sweep():
    args = cli.parse_args(["--full"])
    assert args.full and not args.quick and args.with_host
    assert args.dtype == ("float16",) and args.passes == ("fwd", "bwd", "fwdbwd") and args.impl is None
    assert len(args.cases) == 24
    assert args.cases[0] == Case("float16", 32, 32, 32, 512, 512, 64, False)
    assert args.cases[-1] == Case("float16", 1, 16, 16, 16384, 16384, 128, True)
    assert cli.what_runs(args).startswith("full sweep (--full): 24 cases")


@pytest.mark.parametrize("argv", [["--headdims", "64"], ["--pass", "fwd"], ["--impl", "sdpa"], ["--dtype", "float16"],
                                  ["--causal", "true"], ["--io"]])
def test_any_case_option_selects_from_the_full_sweep_as_before(argv):
    """An explicit shape, --impl or --pass option (or --io) keeps the pre-quick-set defaults for the rest."""
    args = cli.parse_args(argv)
    full = cli.parse_args(["--full"])
    assert not args.quick and not args.with_host
    assert args.seqlens == full.seqlens and args.tokens == 16384 and args.hidden == 2048
    assert args.passes == (("fwd",) if argv == ["--pass", "fwd"] else full.passes)
    assert args.headdims == ((64,) if argv == ["--headdims", "64"] else (64, 128))


def test_host_only_and_the_exclusive_modes(capsys):
    args = cli.parse_args(["--host"])
    assert args.host and not args.quick and not args.with_host and cli.what_runs(args).startswith("host time only")
    for argv in (["--host", "--full"], ["--io", "--host"], ["--full", "--io"]):
        with pytest.raises(SystemExit) as info:
            cli.parse_args(argv)
        assert info.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_options_shape_the_cases():
    args = cli.parse_args(["--dtype", "float32,bfloat16", "--seqlens", "1024,4096", "--headdims", "128",
                           "--causal", "true", "--nheads", "32", "--nheads-k", "8", "--batch", "2",
                           "--window", "128,0", "--dropout", "0.1", "--seqlen-k", "2048",
                           "--pass", "fwd,fwdbwd", "--impl", "flashnb,sdpa-flash", "--reps", "7"])
    assert args.passes == ("fwd", "fwdbwd") and args.impl == ("flashnb", "sdpa-flash") and args.reps == 7
    assert [(c.dtype, c.seqlen_q) for c in args.cases] == [
        ("float32", 1024), ("float32", 4096), ("bfloat16", 1024), ("bfloat16", 4096)]
    c = args.cases[0]
    assert (c.batch, c.nheads, c.nheads_k, c.seqlen_k, c.headdim, c.causal, c.window, c.dropout_p) == \
        (2, 32, 8, 2048, 128, True, (128, 0), 0.1)


@pytest.mark.parametrize("argv", [
    ["--dtype", "float64"], ["--seqlens", "0"], ["--seqlens", "1k"], ["--headdims", ""],
    ["--pass", "forward"], ["--causal", "maybe"], ["--window", "3"], ["--window", "-2,0"],
    ["--dropout", "1.0"], ["--reps", "0"], ["--max-time", "-1"], ["--warmup", "-1"],
    ["--nheads", "6", "--nheads-k", "4"], ["--format", "xml"],
])
def test_bad_options_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_help_mentions_every_option_family(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = capsys.readouterr().out
    for opt in ("--dtype", "--seqlens", "--headdims", "--nheads-k", "--window", "--dropout", "--impl", "--pass",
                "--reps", "--format", "--output", "--plot", "--io", "--list", "--full", "--host"):
        assert opt in text


def run_bench(*argv, timeout=120):
    """``python -m bench`` in a child process, forced onto the no-GPU path by NUMBA_ENABLE_CUDASIM=1."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "bench", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_no_gpu_run_prints_io_table_and_smoke_result():
    proc = run_bench()
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "# command: " in out and "-m bench" in out and "# device: none (Numba CUDA simulator)" in out
    assert "timings need a GPU" in out and "no timings" in proc.stderr
    assert "## IO model: predicted HBM traffic, standard vs flash attention" in out
    assert "# cases: quick set: 8 cases" in out
    io_lines = [line for line in out.splitlines() if line.startswith(("Figure 2  ", "sweep  "))]
    assert len(io_lines) == 1 + 4 and io_lines[0].split()[:8] == ["Figure", "2", "float16", "64", "16", "1024",
                                                                  "64", "9.13"]       # the quick set's 2 x 2 shapes
    assert "## Validation" in out
    # the smoke run either checked flashnb or said clearly why it could not; the quick set validates what it
    # times, flashnb-auto at float16
    validation = out[out.index("## Validation"):out.index("## IO model")]
    assert ("flashnb-auto" in validation and " ok " in validation and "float32" not in validation
            and "flashnb-simt" not in validation) or "unavailable" in validation


def test_no_gpu_full_run_has_the_whole_io_table():
    proc = run_bench("--full", "--no-check")
    assert proc.returncode == 0, proc.stderr
    io_lines = [line for line in proc.stdout.splitlines() if line.startswith(("Figure 2  ", "sweep  "))]
    assert len(io_lines) == 1 + 12 and "# cases: full sweep (--full): 24 cases" in proc.stdout


def test_no_gpu_host_says_it_needs_a_gpu():
    proc = run_bench("--host")
    assert proc.returncode == 0, proc.stderr
    assert "host time of a call needs a GPU" in proc.stdout and "## " not in proc.stdout


def test_no_gpu_json_output_file(tmp_path):
    path = tmp_path / "r.json"
    proc = run_bench("--no-check", "--format", "json", "--output", str(path), "--seqlens", "1024", "--headdims", "64")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(path.read_text())
    assert doc["results"] == [] and "timings need a GPU" in doc["messages"][0]
    rows = doc["io_model"]
    assert [r["setting"] for r in rows] == ["Figure 2", "sweep"]
    assert rows[1]["std_fwd_bytes"] > rows[1]["flash_fwd_bytes"] > 0 and rows[1]["std_fwd_ms"] is None
    assert "## IO model" in proc.stdout              # the terminal table still goes to stdout


def test_no_gpu_csv_has_the_io_table():
    proc = run_bench("--no-check", "--format", "csv", "--seqlens", "2048", "--headdims", "64")
    assert proc.returncode == 0, proc.stderr
    header, results = report.read_csv(proc.stdout)
    assert results == [] and header["device"].startswith("none")
    io = report.read_csv_tables(proc.stdout)["io_model"]
    assert [(r["setting"], r["seqlen_q"]) for r in io] == [("Figure 2", "1024"), ("sweep", "2048")]


def test_no_gpu_markdown_and_list():
    proc = run_bench("--no-check", "--format", "markdown", "--headdims", "128")
    assert proc.returncode == 0, proc.stderr
    (title, headers, rows), = report.read_markdown_tables(proc.stdout)
    assert title.startswith("IO model") and headers[:2] == ["setting", "dtype"] and len(rows) == 1 + 6
    proc = run_bench("--list")
    assert proc.returncode == 0, proc.stderr
    assert "sdpa-flash" in proc.stdout and "cupy-materialised" in proc.stdout and "no CUDA device" in proc.stdout


def test_plot_without_matplotlib_fails_early_and_says_why(tmp_path):
    import importlib.util
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed here; the message is for machines without it")
    proc = run_bench("--plot", str(tmp_path / "p.png"))
    assert proc.returncode == 2
    assert "needs matplotlib" in proc.stderr and proc.stdout == ""
