"""tools.model_bound on the CPU: the bound ``no-attention`` attends to nothing and trains, and the options it
keeps for itself or hands to bench.model.  Needs torch (skipped in CI, which has none)."""
import pytest

torch = pytest.importorskip("torch")

from tools import model_bound  # noqa: E402


def test_no_attention_is_a_bound_that_attends_to_nothing():
    """``--impl no-attention``: each layer's output is its query (no key or value read), differentiable, in the
    layout the attention layers expect."""
    transformers = pytest.importorskip("transformers")
    q = torch.randn(2, 4, 5, 8, requires_grad=True)          # (batch, heads, seqlen, head_dim)
    out, weights = model_bound.no_attention(None, q, torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8), None)
    assert weights is None and out.shape == (2, 5, 4, 8) and out.is_contiguous()
    assert torch.equal(out, q.transpose(1, 2))
    out.sum().backward()
    assert torch.equal(q.grad, torch.ones_like(q))
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    model_bound.register(transformers)
    llama = transformers.LlamaForCausalLM(cfg)
    llama.set_attn_implementation(model_bound.NO_ATTENTION)
    ids = torch.randint(0, 50, (2, 6))
    llama(input_ids=ids, labels=ids).loss.backward()


def test_options_split_between_the_tool_and_bench_model():
    from bench import model
    ours, rest = model_bound.parse_args(["--profile", "--what", "train", "--steps", "3"])
    assert ours.profile and rest[:4] == ["--what", "train", "--steps", "3"]
    args = model.parse_args(rest)
    assert args.impl.split(",") == [*model.IMPLS, model_bound.NO_ATTENTION] and args.steps == 3
    ours, rest = model_bound.parse_args(["--impl", "sdpa,no-attention"])
    assert not ours.profile and model.parse_args(rest).impl == "sdpa,no-attention"
