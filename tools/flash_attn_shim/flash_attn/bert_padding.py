"""flash-attn's ``bert_padding`` helpers in plain PyTorch, written from their documented behaviour: a padded
batch ``(batch, seqlen, ...)`` and a mask to packed rows ``(total, ...)`` and back (differentiable both ways)."""
import torch
import torch.nn.functional as F

__all__ = ["pad_input", "unpad_input"]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The rows of ``hidden_states`` ``(batch, seqlen, ...)`` where ``attention_mask`` ``(batch, seqlen)`` (bool or
    int, nonzero = valid) or ``unused_mask`` (allocated but unused) is set, packed in row-major order.

    Returns ``(packed (total, ...), indices (total,) into the flattened batch x seqlen rows, cu_seqlens int32
    (batch + 1,), max_seqlen (a Python int), seqused int32 (batch,): each sequence's rows in attention_mask)``;
    ``cu_seqlens`` counts the rows of both masks."""
    valid = attention_mask != 0
    taken = valid if unused_mask is None else valid | (unused_mask != 0)
    lengths = taken.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(taken.reshape(-1)).reshape(-1)
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return rows[indices], indices, cu_seqlens, int(lengths.max()), valid.sum(dim=-1, dtype=torch.int32)


def pad_input(hidden_states, indices, batch, seqlen):
    """The packed rows ``hidden_states`` ``(total, ...)`` put back at ``indices`` of a zero ``(batch, seqlen,
    ...)`` tensor (``unpad_input``'s inverse on the rows it took)."""
    rest = hidden_states.shape[1:]
    out = hidden_states.new_zeros((batch * seqlen, *rest)).index_copy(0, indices, hidden_states)
    return out.reshape(batch, seqlen, *rest)
