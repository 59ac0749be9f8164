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
