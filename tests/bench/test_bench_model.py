"""``bench.model`` (``python -m bench --model llama``; the timing runs on a GPU, recorded in bench/results/):
the padded batches of ``--pad`` and the option parsing.  Needs torch (skipped in CI, which has none)."""
import pytest

torch = pytest.importorskip("torch")

from bench import model  # noqa: E402


def test_pad_left_pads_every_other_sequence():
    ids, mask = model.batch_of(4, 10, 3, 50, seed=1, torch=torch, device="cpu")
    assert ids.shape == mask.shape == (4, 10)
    assert mask[0].all() and mask[2].all()
    assert not mask[1, :3].any() and mask[1, 3:].all() and not mask[3, :3].any()
    assert (ids[mask == 0] == 0).all() and (ids[mask == 1] > 0).all()      # padding id 0, tokens never 0
    plain, none = model.batch_of(4, 10, 0, 50, seed=1, torch=torch, device="cpu")
    assert none is None and torch.equal(plain[mask == 1], ids[mask == 1])  # the same tokens where not padded
    with pytest.raises(ValueError, match="--pad 10"):
        model.batch_of(2, 10, 10, 50, seed=1, torch=torch, device="cpu")
    assert model.parse_args(["--pad", "64"]).pad == 64 and model.parse_args([]).pad == 0


def test_table_columns_and_speeds():
    """The markdown table: the measured columns (``main``'s ``extra`` ones after ``train ms``), speeds against the first
    row's; without ``extra`` exactly the columns it always had."""
    rows = [{"impl": "sdpa", "train ms": 20.0, "loss 1st/last": "10.4/10.3", "gen tok/s": 1300.0,
             "tokens = 1st impl": "1.000"},
            {"impl": "numba_attention", "train ms": 19.0, "loss 1st/last": "10.4/10.3", "gen tok/s": 1235.0,
             "tokens = 1st impl": "0.996"}]
    lines = model.table(rows)
    assert lines[0] == ("| impl | train ms | gen tok/s | loss 1st/last | tokens = 1st impl | train vs sdpa | "
                        "generate vs sdpa |")
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert lines[3] == "| numba_attention | 19.00 | 1235.00 | 10.4/10.3 | 0.996 | 1.053x | 0.950x |"
    extra = [{"impl": r["impl"], "train ms": r["train ms"], "attn GPU ms": 3.0, "GPU ms": 19.5,
              "loss 1st/last": r["loss 1st/last"]} for r in rows]
    assert model.table(extra)[0] == ("| impl | train ms | attn GPU ms | GPU ms | loss 1st/last | train vs sdpa | "
                                     "generate vs sdpa |")
    assert model.table(extra)[2] == "| sdpa | 20.00 | 3.00 | 19.50 | 10.4/10.3 | 1.000x |  |"
    with pytest.raises(SystemExit):                 # the bound's profile is tools.model_bound's option now
        model.parse_args(["--profile"])
