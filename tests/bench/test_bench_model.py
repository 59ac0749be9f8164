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


def test_no_attention_is_a_bound_that_attends_to_nothing():
    """``--impl no-attention``: each layer's output is its query (no key or value read), differentiable, in the
    layout the attention layers expect."""
    transformers = pytest.importorskip("transformers")
    q = torch.randn(2, 4, 5, 8, requires_grad=True)          # (batch, heads, seqlen, head_dim)
    out, weights = model.no_attention(None, q, torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8), None)
    assert weights is None and out.shape == (2, 5, 4, 8) and out.is_contiguous()
    assert torch.equal(out, q.transpose(1, 2))
    out.sum().backward()
    assert torch.equal(q.grad, torch.ones_like(q))
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    transformers.AttentionInterface.register(model.NO_ATTENTION, model.no_attention)
    llama = transformers.LlamaForCausalLM(cfg)
    llama.set_attn_implementation(model.NO_ATTENTION)
    ids = torch.randint(0, 50, (2, 6))
    llama(input_ids=ids, labels=ids).loss.backward()
