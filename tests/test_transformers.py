"""``flashnb.transformers``: the ``"flashnb"`` attention implementation inside tiny, randomly initialised
transformers models on CPU tensors (Numba's simulator), against transformers' own ``sdpa`` (Llama, Mistral) or
``eager`` (Gemma 2's softcap, which SDPA refuses) implementations with the same weights, in float64: logits,
gradients of every parameter, a padded batch (a 2-D attention mask), sliding windows shorter than the sequence,
GQA without ``repeat_kv``, greedy ``generate()`` with a KV cache, and the fallback.  Needs torch and
transformers (not installed in CI: skipped there with the reason; the GPU runs are recorded in bench/results/).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fnt = pytest.importorskip("flashnb.transformers")

TOL = 1e-9          # float64 throughout: the kernels and PyTorch's math agree to rounding


def _model(family, seed=0, dtype=torch.float64, **extra):
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    }[family]
    cfg = cfg_cls(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, **extra)
    torch.manual_seed(seed)
    return model_cls(cfg).to(dtype).eval()


def _pair(family, baseline, **extra):
    ours, ref = _model(family, **extra), _model(family, **extra)
    ref.load_state_dict(ours.state_dict())
    ours.set_attn_implementation(fnt.NAME)
    ref.set_attn_implementation(baseline)
    return ours, ref


def _compare(ours, ref, ids, mask=None, grads=True, tol=TOL):
    with torch.enable_grad():
        lo = ours(input_ids=ids, attention_mask=mask).logits
        lr = ref(input_ids=ids, attention_mask=mask).logits
        keep = torch.ones_like(lo[..., :1]) if mask is None else mask[..., None].to(lo.dtype)   # padded rows: any
        torch.testing.assert_close(lo * keep, lr * keep, rtol=tol, atol=tol)
        if grads:
            w = torch.randn(lo.shape, dtype=lo.dtype, generator=torch.Generator().manual_seed(1)) * keep
            (lo * w).sum().backward()
            (lr * w).sum().backward()
            for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=tol * 10, atol=tol * 10, msg=lambda m: f"{name}: {m}")


def _ids(batch, seqlen, seed=2):
    return torch.randint(0, 61, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def test_llama_logits_and_gradients_match_sdpa():
    ours, ref = _pair("llama", "sdpa")
    _compare(ours, ref, _ids(2, 11))


def test_llama_padded_batch_matches_sdpa():
    """Left padding through a 2-D attention mask: transformers builds the boolean mask, the kernels read it."""
    ours, ref = _pair("llama", "sdpa")
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    _compare(ours, ref, _ids(2, 10, seed=3), mask)


def test_a_padded_prefill_skips_the_tiles_past_the_diagonal(monkeypatch):
    """transformers' padded causal mask allows nothing past the diagonal: the call adds the causal window
    (``right = 0``: the kernels skip those tiles instead of reading the mask there), analysed once for the
    layers of a forward pass; logits and gradients still equal SDPA's."""
    rights, computed = [], []
    real, real_analysis = fnt._attention, fnt._analysis
    monkeypatch.setattr(fnt, "_attention", lambda *a: rights.append(a[10]) or real(*a))
    monkeypatch.setattr(fnt, "_analysis", lambda m, name, compute: real_analysis(
        m, name, lambda x: computed.append(name) or compute(x)))
    ours, ref = _pair("llama", "sdpa")
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    _compare(ours, ref, _ids(2, 10, seed=8), mask)
    assert rights == [0, 0], rights                # both layers, causal window added
    assert [c[0] for c in computed if isinstance(c, tuple)].count("within_causal") == 1, computed   # one for both layers


def test_within_causal_reads_the_mask_whole():
    i, j = torch.arange(3)[:, None], torch.arange(5)
    bottom_right = (j <= i + 2)[None, None]                  # 3 queries over 5 keys
    assert fnt._within_causal(bottom_right.clone(), 3, 5)
    assert fnt._within_causal((bottom_right & (j >= 1))[None, 0].clone(), 3, 5)   # padded: fewer keys, still inside
    past = bottom_right.clone()
    past[0, 0, 0, 3] = True                                  # one key past the diagonal
    assert not fnt._within_causal(past, 3, 5)
    assert not fnt._within_causal(torch.ones(1, 1, 3, 5, dtype=torch.bool), 3, 5)   # a bidirectional (encoder) mask
    # broadcast along the queries (a padding-only mask, (batch, 1, 1, seqlen_k)): not looked at, never causal
    assert not fnt._within_causal(torch.ones(1, 1, 1, 5, dtype=torch.bool), 3, 5)
    with torch.inference_mode():                             # no version counter: analysed, not cached
        assert fnt._within_causal((j <= i + 2)[None, None], 3, 5)
        assert fnt._mask_structure((j <= i + 2)[None, None].expand(2, 1, 3, 5)) is not None


def test_a_broadcast_bidirectional_mask_stays_bidirectional():
    """A (batch, 1, 1, seqlen_k) padding mask with several queries (an encoder's, or a direct caller's) is not
    made causal: the output equals SDPA's with that mask."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    mask[..., 0] = False
    module = torch.nn.Module()
    module.is_causal = False
    out, _ = fnt.attention_forward(module, q, k, v, mask)
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=mask).transpose(1, 2), rtol=1e-9, atol=1e-9)


def test_mistral_sliding_window_matches_sdpa():
    """A window of 4 over 12 tokens: the mask transformers builds bounds the keys."""
    ours, ref = _pair("mistral", "sdpa", sliding_window=4)
    _compare(ours, ref, _ids(1, 12, seed=4))


def test_gemma2_softcap_and_sliding_layers_match_eager():
    """Gemma 2's eager attention takes its softmax in float32 (``dtype=torch.float32``) even for float64 models:
    its rounding (~6e-8 relative) bounds the agreement, 1e-6."""
    ours, ref = _pair("gemma2", "eager", sliding_window=5, attn_logit_softcapping=3.0, query_pre_attn_scalar=8)
    _compare(ours, ref, _ids(1, 9, seed=5), tol=1e-6)


def test_generate_with_a_kv_cache_matches_sdpa(monkeypatch):
    """Greedy decoding over a DynamicCache, float32 (the split-KV kernels take float16, bfloat16 and float32):
    every step's one query token runs on them (counted), and the tokens and the logits equal SDPA's to float32
    rounding."""
    from flashnb import kvcache
    steps = []
    real = kvcache.attend
    monkeypatch.setattr(kvcache, "attend", lambda *a, **kw: steps.append(1) or real(*a, **kw))
    ours, ref = _pair("llama", "sdpa", dtype=torch.float32)
    ids = _ids(2, 9, seed=6)         # the prompt: 9 tokens x 2 query heads a KV head, above plan.SPLIT_KV_MAX_ROWS
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    go, gr = ours.generate(ids, **kw), ref.generate(ids, **kw)
    assert torch.equal(go.sequences, gr.sequences)
    for a, b in zip(go.logits, gr.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(steps) == 3 * 2      # 3 decoding steps (after the prompt's) x 2 layers


def test_generate_a_padded_batch_matches_sdpa(monkeypatch):
    """Greedy decoding of a left-padded batch (a 2-D attention mask): transformers gives each step a boolean
    mask; its left padding plus causal structure sends the step to the split-KV kernels with cache_leftpad
    (counted), one mask analysis per step for all layers; the tokens and the logits equal SDPA's."""
    from flashnb import kvcache
    steps, analyses = [], []
    real, real_structure = kvcache._with_kvcache, fnt._mask_structure
    monkeypatch.setattr(kvcache, "_with_kvcache", lambda *a, **kw: steps.append(kw.get("cache_leftpad", a[-1]))
                        or real(*a, **kw))
    monkeypatch.setattr(fnt, "_mask_structure", lambda m, w=None: analyses.append(1) or real_structure(m, w))
    ours, ref = _pair("llama", "sdpa", dtype=torch.float32)
    ids = _ids(3, 9, seed=7)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0                  # two sequences padded on the left, one not
    mask[2, :1] = 0
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    go, gr = ours.generate(ids, attention_mask=mask, **kw), ref.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(go.sequences, gr.sequences)
    for a, b in zip(go.logits, gr.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    pads = [p for p in steps if p is not None]
    assert len(pads) == 3 * 2, steps            # 3 decoding steps x 2 layers, each with the padding
    assert all(p.tolist() == [4, 0, 1] for p in pads)
    assert len(analyses) >= 3 and len(analyses) <= 3 + 1 + 2      # one a step (the prompt's mask: once or per layer)


def test_generate_a_padded_batch_with_a_sliding_window_matches_sdpa(monkeypatch):
    """Mistral with a window of 4 over a 9-token left-padded prompt and 4 new tokens: each step's mask is left
    padding, causal and the window; it runs on the split-KV kernels with the window (counted), and the tokens
    and logits equal SDPA's."""
    from flashnb import kvcache
    steps = []
    real = kvcache._with_kvcache
    monkeypatch.setattr(kvcache, "_with_kvcache", lambda *a, **kw: steps.append((a[-1], a[10])) or real(*a, **kw))
    ours, ref = _pair("mistral", "sdpa", dtype=torch.float32, sliding_window=4)
    ids = _ids(2, 9, seed=9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :6] = 0                  # a pad longer than the window: the window bounds the keys first
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    go, gr = ours.generate(ids, attention_mask=mask, **kw), ref.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(go.sequences, gr.sequences)
    for a, b in zip(go.logits, gr.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    padded = [(p, w) for p, w in steps if p is not None]
    assert len(padded) == 3 * 2 and all(w == (3, 0) for _, w in padded), steps


def test_padded_decode_takes_only_the_masks_it_reads_exactly():
    """A mask with a hole (packed sequences, say) or with rows past the causal diagonal is not left padding
    plus causal: no structure, the mask path serves it."""
    j = torch.arange(8)
    good = ((j >= 2) & (j <= 7 - 1 + torch.arange(2)[:, None]))[None, None].expand(2, 1, 2, 8).clone()
    pad, end = fnt._mask_structure(good)
    assert pad.tolist() == [2, 2] and end.tolist() == [8, 8]
    for spoil in ((0, 0, 1, 4), (1, 0, 0, 7), (0, 0, 0, 1)):    # a hole; a key past the diagonal; one before the pad
        bad = good.clone()
        bad[spoil] = not bad[spoil]
        assert fnt._mask_structure(bad) is None, spoil
    empty = good.clone()
    empty[1] = False                                            # a sequence that sees no key
    assert fnt._mask_structure(empty) is None
    windowed = good & (j > 7 - 1 + torch.arange(2)[:, None] - 3)                 # a window of 3 keys
    assert fnt._mask_structure(windowed.clone()) is None                          # not without the window
    pad, end = fnt._mask_structure(windowed.clone(), 3)
    assert pad.tolist() == [4, 4] and end.tolist() == [8, 8]   # row 0 sees 4..6, row 1 5..7
    assert fnt._mask_structure(windowed.clone(), 4) is None    # another window: not this mask


def test_fallback_for_a_value_head_dim_unlike_the_querys():
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    assert "value head dim 4" in fnt.fallback_reason(q, k, v)
    module = torch.nn.Module()
    module.is_causal = True
    with pytest.warns(UserWarning, match="value head dim"):
        out, _ = fnt.attention_forward(module, q, k, v, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=TOL, atol=TOL)


def test_attention_forward_refuses_a_mask_of_another_type():
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="attention_mask"):
        fnt.attention_forward(torch.nn.Module(), q, q, q, np.ones((1, 1, 3, 3), bool))


def test_fallback_for_a_query_batch_broadcast_against_the_keys():
    """SDPA broadcasts a query batch of 1 against the keys' (learned queries); flashnb falls back to it."""
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 3, 8, dtype=torch.float64)
    assert "batch" in fnt.fallback_reason(q, k, k)
