"""tools/flash_attn_shim (flash-attn's API on flashnb, for flash-attn's upstream tests) and tools/flash_attn_select
(the upstream grid's subset): the shim's own helpers against direct formulas, the packed variants' split, and
the greedy cover. No GPU, no kernels and no upstream file needed."""
import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tools.flash_attn_select import CASE_RULES, greedy_cover  # noqa: E402

SHIM = Path(__file__).resolve().parents[2] / "tools" / "flash_attn_shim" / "flash_attn"


def _load(relative, name):
    """A shim module loaded from its file under a private name (``import flash_attn`` is left alone)."""
    spec = importlib.util.spec_from_file_location(name, SHIM / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


padding = _load("bert_padding.py", "_shim_bert_padding")
rotary = _load("layers/rotary.py", "_shim_rotary")


# ------------------------------------------------------------------------------------------------ bert_padding
def test_unpad_then_pad_round_trip():
    g = torch.Generator().manual_seed(0)
    batch, seqlen = 4, 7
    x = torch.randn(batch, seqlen, 3, 2, 5, generator=g, requires_grad=True)
    lengths = torch.tensor([7, 0, 3, 5])
    mask = torch.arange(seqlen)[None] < lengths[:, None]
    mask[3, 1] = False                                  # a hole: rows are taken wherever the mask is set
    packed, indices, cu, max_seqlen, seqused = padding.unpad_input(x, mask)
    want = x.detach()[mask]
    assert torch.equal(packed.detach(), want) and packed.shape == (int(mask.sum()), 3, 2, 5)
    assert torch.equal(indices, torch.nonzero(mask.reshape(-1)).reshape(-1))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 7, 7, 10, 14]
    assert max_seqlen == 7 and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == [7, 0, 3, 4]
    back = padding.pad_input(packed, indices, batch, seqlen)
    assert torch.equal(back.detach(), x.detach() * mask[:, :, None, None, None])
    back.sum().backward()                               # differentiable both ways: ones where taken
    assert torch.equal(x.grad, mask[:, :, None, None, None].expand_as(x).float())


def test_unpad_unused_mask_counts_in_cu_seqlens_not_in_seqused():
    x = torch.arange(2 * 4, dtype=torch.float32).reshape(2, 4, 1)
    used = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    packed, indices, cu, max_seqlen, seqused = padding.unpad_input(x, used, unused)
    assert packed.reshape(-1).tolist() == [0, 1, 2, 4, 5, 6]
    assert cu.tolist() == [0, 3, 6] and max_seqlen == 3 and seqused.tolist() == [2, 1]


# ------------------------------------------------------------------------------------------------ rotary
def _rotary_direct(x, cos, sin, interleaved, offsets):
    """The rotation element by element: pair j of the first rotary_dim features turns by angle j at the row's
    position."""
    out = x.clone().double()
    half = cos.shape[1]
    batch, seqlen, nheads, _ = x.shape
    for b, s, h, j in itertools.product(range(batch), range(seqlen), range(nheads), range(half)):
        pos = s + offsets[b]
        c, si = float(cos[pos, j]), float(sin[pos, j])
        ia, ib = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
        a, bb = float(x[b, s, h, ia]), float(x[b, s, h, ib])
        out[b, s, h, ia], out[b, s, h, ib] = a * c - bb * si, a * si + bb * c
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", [0, 3, "tensor"])
def test_apply_rotary_emb_matches_the_direct_formula(interleaved, offsets):
    g = torch.Generator().manual_seed(1)
    batch, seqlen, nheads, d, rotary_dim, seqlen_ro = 2, 3, 2, 10, 8, 12
    x = torch.randn(batch, seqlen, nheads, d, generator=g)
    angle = torch.rand(seqlen_ro, rotary_dim // 2, generator=g) * 2 * math.pi
    cos, sin = angle.cos(), angle.sin()
    given = torch.tensor([4, 9], dtype=torch.int32) if offsets == "tensor" else offsets
    per_batch = given.tolist() if offsets == "tensor" else [offsets] * batch
    out = rotary.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=given)
    want = _rotary_direct(x, cos, sin, interleaved, per_batch)
    assert out.dtype == x.dtype and torch.allclose(out.double(), want, atol=1e-6)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])      # past rotary_dim: kept


def test_apply_rotary_emb_packed_inplace_and_bounds():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 3, 8, generator=g)
    angle = torch.rand(9, 4, generator=g)
    cos, sin = angle.cos(), angle.sin()
    offsets = torch.tensor([1, 5], dtype=torch.int32)
    batched = rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    packed = rotary.apply_rotary_emb(x.reshape(8, 3, 8), cos, sin, seqlen_offsets=offsets, cu_seqlens=cu,
                                     max_seqlen=4)
    assert torch.allclose(packed, batched.reshape(8, 3, 8))
    y = x.clone()
    assert rotary.apply_rotary_emb(y, cos, sin, seqlen_offsets=offsets, inplace=True) is y
    assert torch.allclose(y, batched)
    with pytest.raises(ValueError, match="beyond the 9 rows"):
        rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=6)


# ------------------------------------------------------------------------------------------------ the adapter
@pytest.fixture
def interface(monkeypatch):
    """The shim's flash_attn_interface with flashnb.torch's calls replaced by recorders over a plain reference
    (no kernels): what the adapter hands flashnb, and where the gradients go."""
    shim = _load("flash_attn_interface.py", "_shim_interface")
    calls = []

    def dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              return_attn_probs):
        calls.append(dict(q=q, k=k, v=v, dropout_p=dropout_p, causal=causal, deterministic=deterministic,
                          grad=torch.is_grad_enabled()))
        rep = q.shape[-2] // k.shape[-2]
        k, v = k.repeat_interleave(rep, -2), v.repeat_interleave(rep, -2)
        p = torch.einsum("...qhd,...khd->...hqk", q, k).softmax(-1)
        out = torch.einsum("...hqk,...khd->...qhd", p, v)
        return (out, None, None) if return_attn_probs else out

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *rest):
        calls.append(dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, grad=torch.is_grad_enabled()))
        return q * 1.0

    monkeypatch.setattr(shim._ft, "flash_attn_func", dense)
    monkeypatch.setattr(shim._ft, "flash_attn_varlen_func", varlen)
    return shim, calls


def test_packed_variants_split_views_and_gradients_reach_the_packed_tensor(interface):
    shim, calls = interface
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 5, 3, 4, 8, generator=g, requires_grad=True)
    out = shim.flash_attn_qkvpacked_func(qkv, 0.0, causal=True, deterministic=True)
    assert calls[-1]["causal"] and calls[-1]["deterministic"]
    for i, name in enumerate("qkv"):                    # views of the packed tensor, in q, k, v order
        assert calls[-1][name].data_ptr() == qkv[:, :, i].data_ptr()
    want = shim.flash_attn_func(*(qkv[:, :, i] for i in range(3)))
    assert torch.allclose(out, want)
    out.sum().backward()
    assert qkv.grad is not None and qkv.grad[:, :, 2].abs().sum() > 0

    q = torch.randn(2, 5, 4, 8, generator=g, requires_grad=True)
    kv = torch.randn(2, 6, 2, 2, 8, generator=g, requires_grad=True)
    shim.flash_attn_kvpacked_func(q, kv).sum().backward()
    assert calls[-1]["k"].data_ptr() == kv[:, :, 0].data_ptr() and kv.grad[:, :, 1].abs().sum() > 0

    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    packed = torch.randn(10, 3, 4, 8, generator=g)
    shim.flash_attn_varlen_qkvpacked_func(packed, cu, 7)
    assert calls[-1]["cu_q"] is cu and calls[-1]["cu_k"] is cu
    assert calls[-1]["v"].data_ptr() == packed[:, 2].data_ptr()
    kvp = torch.randn(12, 2, 2, 8, generator=g)
    shim.flash_attn_varlen_kvpacked_func(packed[:, 0], kvp, cu, cu, 7, 7)
    assert calls[-1]["k"].data_ptr() == kvp[:, 0].data_ptr()


def test_dropout_mask_refused_and_paged_varlen_without_grad(interface):
    shim, calls = interface
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="S_dmask"):
        shim.flash_attn_func(q, q, q, 0.1, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="S_dmask"):
        shim.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 4, 4, 0.1, return_attn_probs=True)
    out, lse, dmask = shim.flash_attn_func(q, q, q, 0.0, return_attn_probs=True)
    assert dmask is None                                # flash-attn's own value without dropout
    shim.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 4, 4, block_table=torch.zeros(1, 1))
    assert calls[-1]["grad"] is False                   # a paged cache: no autograd (flashnb refuses it)
    shim.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 4, 4)
    assert calls[-1]["grad"] is True
    with pytest.raises(ImportError, match="internal"):
        shim.__getattr__("_flash_attn_varlen_forward")


# ------------------------------------------------------------------------------------------------ the cover
def _grid(*sizes):
    return np.array(list(itertools.product(*(range(s) for s in sizes))), dtype=np.int64)


def test_greedy_cover_takes_every_value_then_pairs():
    sizes = (2, 3, 12, 2, 10)
    grid = _grid(*sizes)
    chosen, (done, present) = greedy_cover(grid, 40, seed=0)
    assert len(chosen) == 40 and chosen == sorted(set(chosen))
    for j, size in enumerate(sizes):                    # every value of every parameter
        assert set(grid[chosen, j].tolist()) == set(range(size))
    all_pairs = sum(a * b for a, b in itertools.combinations(sizes, 2))
    assert present == all_pairs and done > all_pairs // 2
    assert greedy_cover(grid, 40, seed=0) == (chosen, (done, present))     # deterministic
    assert greedy_cover(grid, 40, seed=1)[0] != chosen                      # the seed orders the ties


def test_greedy_cover_stops_when_every_pair_is_covered_and_keeps_values_when_sampling():
    grid = _grid(2, 2, 3)
    chosen, (done, present) = greedy_cover(grid, 100)
    assert done == present == 2 * 2 + 2 * 3 + 2 * 3 and len(chosen) < len(grid)
    big = _grid(5, 7, 3, 4, 6)
    rows = np.flatnonzero(big[:, 1] != 6 - big[:, 0])   # a grid with holes, as after the rules
    chosen, _ = greedy_cover(big[rows], 12, seed=0, candidates=40)          # sampled first
    for j in range(big.shape[1]):
        assert set(big[rows][chosen, j].tolist()) == set(big[rows, j].tolist())
    assert greedy_cover(big[:0], 10) == ([], (0, 0))


def test_kvcache_rule_drops_the_cases_the_test_skips_itself():
    (rule, reason), = CASE_RULES["test_flash_attn_kvcache"]
    base = dict(seqlen_q=1, seqlen_k=128, new_kv=True, rotary_fraction=0.5, has_batch_idx=False,
                has_leftpad=False, paged_kv_block_size=None)
    assert not rule(base) and "skips these itself" in reason
    assert rule({**base, "new_kv": False})                                 # rotary without new keys
    assert rule({**base, "has_leftpad": True, "paged_kv_block_size": 256})
    assert not rule({**base, "new_kv": False, "rotary_fraction": 0.0})
