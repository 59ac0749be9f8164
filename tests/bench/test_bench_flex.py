"""bench/flex.py without a GPU: it says why nothing is timed; its documents, pair counts, functions and table;
the CLI flag."""
import numpy as np
import pytest

from bench import flex


def test_documents_cover_the_sequence_in_order():
    ids = flex.document_ids()
    assert ids.dtype == np.int8 and ids.size == flex.SEQLEN and 2 * ids.nbytes <= 65536   # a kernel constant, read twice
    assert np.all(np.diff(ids) >= 0) and set(np.unique(ids)) == set(range(flex.DOCS))
    assert np.array_equal(ids, flex.document_ids())                                    # seeded


def _pairs_by_grid(case, n, ids):
    score_mod, mask_mod, _ = flex.flashnb_mods(case, 2, ids)
    if mask_mod is None:
        return n * n
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return int(np.sum(mask_mod(0, 0, i, j)))


@pytest.mark.parametrize("case", flex.CASES)
def test_pair_counts_are_the_masks(case, monkeypatch):
    """The FLOP count's pairs equal the flashnb mask_mod's count over the whole grid (at 2500 tokens)."""
    monkeypatch.setattr(flex, "WINDOW", 100)
    monkeypatch.setattr(flex, "cuda_ids", lambda ids: ids)       # no GPU here: the same ids on the host
    ids = flex.document_ids(2500)
    assert flex.allowed_pairs(case, 2500, ids) == _pairs_by_grid(case, 2500, ids)


def test_score_mods_differentiate_and_match_the_built_in_options():
    """ALiBi's score_mod is the dense call's alibi on the causal side; softcap's given derivative is the
    derivative."""
    alibi, _, _ = flex.flashnb_mods("alibi", 4, None)
    slopes = flex.alibi_slopes(4)
    assert alibi(1.5, 0, 2, 10, 4) == pytest.approx(1.5 - slopes[2] * 6)
    softcap, _, grad = flex.flashnb_mods("softcap 30", 4, None)
    x, t = 7.0, 1e-6
    assert grad(x, 0, 0, 0, 0) == pytest.approx((softcap(x + t, 0, 0, 0, 0) - softcap(x - t, 0, 0, 0, 0)) / (2 * t),
                                                rel=1e-6)


def test_flex_without_gpu_says_so(capsys):
    from flashnb.kernels._jit import SIMULATOR
    if not SIMULATOR:
        pytest.skip("on a GPU machine main() times things")
    assert flex.main([]) == 0
    assert "need a GPU" in capsys.readouterr().out


def test_cli_flex_flag_runs_the_flex_section(monkeypatch):
    from bench import cli
    called = []
    monkeypatch.setattr(flex, "main", lambda argv: called.append(argv) or 0)
    assert cli.main(["--flex"]) == 0 and called == [["--flex"]]


def test_table():
    recs = [dict(headdim=64, case="causal", impl="flashnb flex", fwd_ms=1.0, fwdbwd_ms=3.0, vs_torch_fwd=1.5),
            dict(headdim=64, case="document", impl="torch flex compiled", note="failed: x")]
    text = flex.table(recs)
    assert text.count("\n") == 3 and "| 64 | causal | flashnb flex | 1.000 | 3.000 |" in text and "failed: x" in text
