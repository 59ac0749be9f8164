"""bench/varlen.py without a GPU: it says why nothing is timed; its batch, FLOP count and table; the CLI flag."""
import pytest

from bench import varlen


def test_random_lengths_pack_16k_tokens_in_range():
    lengths = varlen.random_lengths()
    assert sum(lengths) == varlen.TOKENS == 16384
    assert all(1 <= n <= varlen.MAX_LEN for n in lengths) and all(n >= varlen.MIN_LEN for n in lengths[:-1])
    assert lengths == varlen.random_lengths()                     # seeded: every run times the same batch


def test_flops_count_allowed_pairs_per_sequence():
    assert varlen.pairs([3, 4], causal=False) == 9 + 16
    assert varlen.pairs([3, 4], causal=True) == 6 + 10
    assert varlen.flops([3, 4], nheads=2, headdim=8, causal=False, what="fwd") == 4 * 2 * 8 * 25
    assert varlen.flops([3, 4], nheads=2, headdim=8, causal=False, what="fwdbwd") == 3.5 * 4 * 2 * 8 * 25
    # a dense batch of equal lengths with the packed batch's tokens and FLOPs: sum(len^2) / sum(len)
    assert varlen.equal_length([1000, 3000]) == 2496       # (1e6 + 9e6) / 4000 = 2500, rounded to 64


def test_varlen_without_gpu_says_so(capsys):
    from flashnb.kernels._jit import SIMULATOR
    if not SIMULATOR:
        pytest.skip("on a GPU machine main() times things: the GPU record covers it")
    assert varlen.main([]) == 0
    assert "need a GPU" in capsys.readouterr().out


def test_cli_varlen_flag_runs_the_varlen_section(monkeypatch):
    from bench import cli
    called = []
    monkeypatch.setattr(varlen, "main", lambda argv: called.append(argv) or 0)
    assert cli.main(["--varlen"]) == 0 and called == [["--varlen"]]


def test_table():
    recs = [dict(headdim=64, causal=False, impl="flashnb varlen", fwd_ms=1.0, fwdbwd_ms=3.0, vs_varlen_fwd=1.0),
            dict(headdim=64, causal=True, impl="sdpa-flash padded", note="failed: x")]
    text = varlen.table(recs)
    assert text.count("\n") == 3 and "| 64 | False | flashnb varlen | 1.000 | 3.000 |" in text and "failed: x" in text
