"""flashnb.torch on CPU tensors (NumPy copies, Numba's simulator without a GPU): the layer's semantics --
SDPA's top-left causal and masks, flash-attn's bottom-right causal, gradients, refusals, the custom ops under
``torch.compile`` -- against PyTorch's own math in float64.  Needs torch (not installed in CI: skipped there with
the reason; tests/kernels/test_torch_gpu.py covers the same and more on a GPU)."""
import math

import numpy as np
import pytest

import reference

torch = pytest.importorskip("torch")
ft = pytest.importorskip("flashnb.torch")
F = torch.nn.functional
TOL = 1e-12


def rnd(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def compiled_equals_eager(loss, inputs):
    """``loss`` traced whole by ``torch.compile`` (no graph break) gives the eager call's value and gradients."""
    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(*inputs)
    g_got = torch.autograd.grad(got, inputs)
    want = loss(*inputs)
    g_want = torch.autograd.grad(want, inputs)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("sq, sk", [(5, 9), (9, 5)])
def test_sdpa_wrapper_top_left_causal_and_gqa(sq, sk):
    torch.manual_seed(sq)
    q, k, v = rnd(1, 2, sq, 8), rnd(1, 1, sk, 8), rnd(1, 1, sk, 8)
    dout = torch.randn(1, 2, sq, 8, dtype=torch.float64)
    out = ft.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    for a, b in zip(grads(out, (q, k, v), dout), grads(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_wrapper_masks(kind):
    torch.manual_seed(1)
    q, k, v = rnd(2, 2, 6, 8), rnd(2, 2, 7, 8), rnd(2, 2, 7, 8)
    if kind == "bool":
        mask = torch.rand(2, 1, 6, 7) > 0.3
        mask[..., 0] = True
    else:
        mask = torch.randn(1, 2, 6, 7, dtype=torch.float64)
    torch.testing.assert_close(ft.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=TOL, atol=TOL)


def test_flash_attn_func_is_flash_attns_layout_and_bottom_right_causal():
    torch.manual_seed(2)
    q, k, v = rnd(1, 4, 2, 8), rnd(1, 6, 1, 8), rnd(1, 6, 1, 8)
    dout = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    out, lse, probs = ft.flash_attn_func(q, k, v, causal=True, softcap=3.0, return_attn_probs=True)
    assert probs is None and lse.shape == (1, 2, 4)
    host = [x.detach().numpy() for x in (q, k, v)]
    want, want_lse = reference.attention(*host, causal=True, softcap=3.0, softmax_scale=1 / math.sqrt(8))
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-12, atol=1e-12)
    want_grads = reference.attention_backward(dout.numpy(), *host, causal=True, softcap=3.0,
                                              softmax_scale=1 / math.sqrt(8))
    for g, w in zip(grads(out, (q, k, v), dout), want_grads):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-10, atol=1e-12)


def test_refusals_name_the_argument():
    q, k, v = rnd(1, 2, 4, 8), rnd(1, 2, 4, 8), rnd(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attn_mask and is_causal"):
        ft.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        ft.scaled_dot_product_attention(q, rnd(1, 1, 4, 8), rnd(1, 1, 4, 8))
    with pytest.raises(ValueError, match="attn_bias requires grad"):
        ft.flash_attn_func(q, k, v, attn_bias=torch.zeros(1, 1, 2, 2, dtype=torch.float64, requires_grad=True))
    assert not ft.supports_sdpa_call(q, k, v[..., :4])


def test_functorch_transforms_meet_autograd_functions_own_refusal():
    """The eager path calls the autograd.Function's C apply directly, except under a functorch transform, where
    ``Function.apply`` says why it cannot serve one (no setup_context), as it did before."""
    q, k, v = rnd(1, 4, 2, 8), rnd(1, 4, 2, 8), rnd(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda q: ft.flash_attn_func(q, k, v).sum())(q.detach())


def test_custom_ops_trace_without_graph_breaks():
    torch.manual_seed(3)
    q, k, v = rnd(1, 4, 2, 6), rnd(1, 5, 1, 6), rnd(1, 5, 1, 6)

    def loss(q, k, v):
        return ft.flash_attn_func(q, k, v, causal=True).square().sum()

    compiled_equals_eager(loss, (q, k, v))


def test_flash_attn_varlen_func_with_a_block_table():
    """Paged keys and values (flash-attn's block_table): without autograd, the packed call's result on the keys
    the pages hold; with tensors that require grad, refused."""
    torch.manual_seed(6)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    q, k, v = rnd(5, 2, 4), rnd(7, 1, 4), rnd(7, 1, 4)
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)            # pages of 2 rows, out of order
    kp, vp = torch.randn(4, 2, 1, 4, dtype=torch.float64), torch.randn(4, 2, 1, 4, dtype=torch.float64)
    for b in range(2):
        for j in range(int(cu_k[b + 1] - cu_k[b])):
            kp[table[b, j // 2], j % 2] = k[cu_k[b] + j].detach()
            vp[table[b, j // 2], j % 2] = v[cu_k[b] + j].detach()
    with torch.no_grad():
        out = ft.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 3, 4, causal=True, block_table=table)
        want = ft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, causal=True)
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="block_table .* without autograd"):
        ft.flash_attn_varlen_func(q, kp.requires_grad_(), vp, cu_q, cu_k, 3, 4, block_table=table)


def test_flash_attn_varlen_func_packed_sequences_and_gradients():
    """flash-attn's varlen layout: each packed sequence attended on its own (bottom-right causal per sequence,
    an empty sequence in the middle), out and lse against reference.attention_varlen, gradients against its
    backward; under torch.compile the same through the flashnb::varlen_* custom ops."""
    torch.manual_seed(4)
    cu_q, cu_k = torch.tensor([0, 3, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 6, 8], dtype=torch.int32)
    q, k, v = rnd(7, 2, 6), rnd(8, 1, 6), rnd(8, 1, 6)
    dout = torch.randn(7, 2, 6, dtype=torch.float64)
    out, lse, probs = ft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True, softcap=2.0,
                                                return_attn_probs=True)
    assert probs is None and lse.shape == (2, 7)
    host = [x.detach().numpy() for x in (q, k, v)]
    opts = dict(causal=True, softcap=2.0, softmax_scale=1 / math.sqrt(6))
    want, want_lse = reference.attention_varlen(*host, cu_q.numpy(), cu_k.numpy(), **opts)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-12, atol=1e-12)
    want_grads = reference.attention_varlen_backward(dout.numpy(), *host, cu_q.numpy(), cu_k.numpy(), **opts)
    for g, w in zip(grads(out, (q, k, v), dout), want_grads):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-10, atol=1e-12)

    def loss(q, k, v):
        return (ft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True, softcap=2.0) * dout).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for g, w in zip(torch.autograd.grad(compiled(q, k, v), (q, k, v)), want_grads):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="dropout_p is not defined for packed"):
        ft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, dropout_p=0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        ft.flash_attn_varlen_func(q, k, v, torch.tensor([0, 4, 3, 7], dtype=torch.int32), cu_k, 4, 5)


def test_flex_attention_is_differentiable_and_equals_the_oracle():
    """flashnb.torch.flex_attention: a score_mod (complex step) and a document mask, GQA, float64 CPU tensors;
    out and the gradients of q, k, v against reference.flex; a math.tanh score_mod without score_mod_grad is
    refused before the forward when a gradient will be asked for, and runs without grad."""
    import flashnb
    from reference import flex as rf
    torch.manual_seed(7)
    q, k, v = rnd(1, 2, 7, 8), rnd(1, 1, 9, 8), rnd(1, 1, 9, 8)
    dout = torch.randn(1, 2, 7, 8, dtype=torch.float64)
    doc = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2])

    def bias(score, b, h, q_idx, kv_idx):
        return score - 0.3 * (h + 1) * abs(q_idx - kv_idx)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    mask = flashnb.create_block_mask(same_doc, None, None, 7, 9, BLOCK_SIZE=4)
    out = ft.flex_attention(q, k, v, score_mod=bias, block_mask=mask, enable_gqa=True)
    args = [x.detach().numpy() for x in (q, k, v)]
    ref = rf.flex_attention(*args, score_mod=bias, mask_mod=same_doc, enable_gqa=True)
    torch.testing.assert_close(out, torch.as_tensor(ref), rtol=TOL, atol=TOL)
    want = rf.flex_attention_backward(dout.numpy(), *args, score_mod=bias, mask_mod=same_doc, enable_gqa=True)
    for g, w in zip(grads(out, (q, k, v), dout), want):
        torch.testing.assert_close(g, torch.as_tensor(w), rtol=1e-10, atol=1e-10)

    def capped(score, b, h, q_idx, kv_idx):
        return 2.0 * math.tanh(score / 2.0)

    with pytest.raises(ValueError, match="score_mod_grad"):
        ft.flex_attention(q, k, v, score_mod=capped, enable_gqa=True)
    with torch.no_grad():
        out = ft.flex_attention(q, k, v, score_mod=capped, enable_gqa=True)
    torch.testing.assert_close(out, torch.as_tensor(rf.flex_attention(*args, score_mod=capped, enable_gqa=True)),
                               rtol=TOL, atol=TOL)


def test_flex_attention_learns_a_captured_tensor():
    """A learned table captured by the score_mod (a CPU tensor that requires grad; NumPy copies in the simulator,
    another captured CPU tensor too): ``torch.autograd.grad`` gives its gradient, the oracle's ``captured_grads``
    in float64, and q, k, v's; under ``torch.no_grad`` the same output."""
    from reference import flex as rf
    torch.manual_seed(4)
    L = 7
    table = torch.randn(2, 2 * L, dtype=torch.float64, requires_grad=True)
    ids = torch.arange(L)                                      # another captured CPU tensor, no grad

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L] + 0.0 * ids[q_idx]

    q, k, v = rnd(1, 2, L, 8), rnd(1, 2, L, 8), rnd(1, 2, L, 8)
    out = ft.flex_attention(q, k, v, score_mod=rel)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, table), dout)
    values = table.detach().numpy()

    def rel_np(score, b, h, q_idx, kv_idx):
        return score + values[h, q_idx - kv_idx + L] + 0.0 * ids.numpy()[q_idx]

    *want, learned = rf.flex_attention_backward(dout.numpy(), *(x.detach().numpy() for x in (q, k, v)),
                                                score_mod=rel_np, captured_grads=("values",))
    for g, w in zip(got, want + [learned["values"]]):
        np.testing.assert_allclose(g.numpy(), w, atol=TOL, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(ft.flex_attention(q, k, v, score_mod=rel), out.detach(), rtol=0, atol=0)


def test_flex_attention_under_torch_compile():
    """flashnb.torch.flex_attention traced whole (fullgraph) by torch.compile: the custom ops flex_forward and
    flex_backward name the functions and the block mask by handles; values and gradients equal the eager call's."""
    import flashnb
    torch.manual_seed(8)
    q, k, v = rnd(1, 2, 6, 8), rnd(1, 2, 6, 8), rnd(1, 2, 6, 8)

    def bias(score, b, h, q_idx, kv_idx):
        return score - 0.5 * (h + 1) * abs(q_idx - kv_idx)

    mask = flashnb.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 6, 6, BLOCK_SIZE=4)

    def loss(q, k, v):
        return ft.flex_attention(q, k, v, score_mod=bias, block_mask=mask, scale=0.4).square().sum()

    compiled_equals_eager(loss, (q, k, v))


def test_flex_attention_compiled_again_with_another_block_mask():
    """A second compile of one function with another BlockMask: the mask's handle stays a constant (an int
    handle was made symbolic by Dynamo's automatic dynamic shapes on the recompile, and the trace failed)."""
    import flashnb
    torch.manual_seed(9)
    q, k, v = rnd(1, 2, 6, 8), rnd(1, 2, 6, 8), rnd(1, 2, 6, 8)
    masks = [flashnb.create_block_mask(lambda b, h, q_idx, kv_idx, w=w: q_idx - kv_idx <= w, None, None, 6, 6,
                                       BLOCK_SIZE=4) for w in (6, 2, 1)]

    def attend(q, k, v, mask):
        return ft.flex_attention(q, k, v, block_mask=mask)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    for mask in masks:
        torch.testing.assert_close(compiled(q, k, v, mask), attend(q, k, v, mask), rtol=0, atol=0)


def test_has_word_view_answers_as_word_view_does(monkeypatch):
    """``_arrays.has_word_view``'s arithmetic for 16-bit CUDA tensors (the routed call's layout check, GPU-only)
    against ``word_view`` of the same tensor's view: CPU tensors taken as CUDA ones (``is_cuda``, the simulator's
    flag off), so both run their GPU path, which reads only shapes, strides and addresses."""
    from flashnb import _arrays
    monkeypatch.setattr(_arrays, "SIMULATOR", False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    base = torch.randn(3, 10, 6, 8, dtype=torch.float32).to(torch.float16)
    flat = torch.randn(2000, dtype=torch.float32).to(torch.bfloat16)
    cases = [base, base[:, 1:], base[:, :, 2:4], base[..., :6], base[..., 1:7], base[..., ::2], base.transpose(1, 2),
             base[:, :1], base.unsqueeze(1)[:, :, :, :, :4].reshape(3, 10, 6, 4), base[..., :0],
             flat[1:1 + 2 * 5 * 3 * 8].view(2, 5, 3, 8), flat[2:2 + 2 * 5 * 3 * 8].view(2, 5, 3, 8),
             flat[:2 * 5 * 3 * 7].view(2, 5, 3, 7), torch.as_strided(flat, (2, 4, 3, 8), (97, 24, 8, 1)),
             torch.as_strided(flat, (2, 1, 3, 8), (96, 5, 8, 1))]
    for i, x in enumerate(cases):
        want = _arrays.word_view(_arrays.to_device_bits(x, None)) is not None
        assert _arrays.has_word_view(x, None) == want, (i, tuple(x.shape), x.stride(), x.data_ptr() % 4)
    assert {_arrays.has_word_view(x, None) for x in cases} == {True, False}      # both answers drawn
