"""flash-attn's ``apply_rotary_emb`` in plain PyTorch, written from its documented behaviour (differentiable
through autograd; computed in float32, returned in x's dtype)."""
import torch

__all__ = ["apply_rotary_emb"]


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """Rotate the first ``rotary_dim = 2 * cos.shape[-1]`` features of ``x`` by the angles at each row's position.

    x ``(batch, seqlen, nheads, headdim)``, or ``(total, nheads, headdim)`` with ``cu_seqlens`` ``(batch + 1,)``;
    cos, sin ``(seqlen_ro, rotary_dim / 2)``. Row ``i`` of sequence ``b`` is at position ``i +
    seqlen_offsets[b]`` (``seqlen_offsets`` an int or a ``(batch,)`` tensor). Feature pairs ``(j, j + rotary_dim
    / 2)`` (GPT-NeoX), or ``(2j, 2j + 1)`` with ``interleaved`` (GPT-J), turn by angle ``j``:
    ``(a, b) -> (a cos - b sin, a sin + b cos)``; features past ``rotary_dim`` are kept. ``inplace`` writes the
    result into x and returns it. ``max_seqlen`` is accepted for flash-attn's signature and not needed."""
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(f"cos and sin must both be (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} exceeds the head dim {x.shape[-1]}")
    device = x.device
    offsets = seqlen_offsets.to(device=device, dtype=torch.long) if torch.is_tensor(seqlen_offsets) \
        else torch.tensor(int(seqlen_offsets), device=device)
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        positions = torch.arange(seqlen, device=device) + offsets.reshape(-1, 1)      # (batch or 1, seqlen)
        positions = positions.expand(batch, seqlen)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        rows = torch.arange(x.shape[0], device=device)
        seq = torch.searchsorted(cu[1:], rows, right=True)                           # row's sequence
        positions = rows - cu[seq] + (offsets[seq] if offsets.dim() else offsets)
    if positions.numel() and int(positions.max()) >= cos.shape[0]:
        raise ValueError(f"a position reaches {int(positions.max())}, beyond the {cos.shape[0]} rows of cos/sin")
    c = cos[positions].float().unsqueeze(-2)          # (..., 1, half): the same angle for every head
    s = sin[positions].float().unsqueeze(-2)
    part = x[..., :rotary_dim].float()
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = part[..., :half], part[..., half:]
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    out = torch.cat((turned.to(x.dtype), x[..., rotary_dim:]), dim=-1)
    if inplace:
        return x.copy_(out)
    return out
