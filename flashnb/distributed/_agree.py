"""What every rank of a ring must agree on, as a row of integers one small collective can gather, and the
error that names a disagreement (no torch here: CI checks it without torch; ``ring`` gathers the rows).

A ring whose ranks pass different shapes or dtypes exchanges buffers of different sizes or reads one rank's
bytes as another type: NCCL hangs until its watchdog, or the ranks return garbage.  ``ring.ring_attention``
gathers ``encode(...)`` of every rank before the first exchange of each signature and raises ``ValueError`` on
every rank (all of them see the same rows, so all of them decide alike) with ``disagreement(rows)``.
"""
import struct

FIELDS = ("dtype", "batch", "shard length", "query heads", "head dim", "key/value heads", "layout", "causal",
          "softmax_scale", "backend")
DTYPES = ("float16", "bfloat16", "float32", "float64")
LAYOUT_CODES = ("zigzag", "contiguous")
BACKEND_CODES = ("auto", "simt", "tensorcore", "wgmma")
UNKNOWN = -1


def _code(value, names):
    return names.index(value) if value in names else UNKNOWN


def encode(dtype, batch, length, heads, headdim, kv_heads, layout, causal, scale, backend):
    """The row of int64 values (``FIELDS``' order) a rank contributes; ``scale`` by its float64 bits."""
    bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    return [_code(dtype, DTYPES), int(batch), int(length), int(heads), int(headdim), int(kv_heads),
            _code(layout, LAYOUT_CODES), int(bool(causal)), bits, _code(backend, BACKEND_CODES)]


def _decode(field, value):
    names = {"dtype": DTYPES, "layout": LAYOUT_CODES, "backend": BACKEND_CODES}.get(field)
    if names is not None:
        return names[value] if 0 <= value < len(names) else "another"
    if field == "causal":
        return bool(value)
    if field == "softmax_scale":
        return struct.unpack("<d", struct.pack("<q", int(value)))[0]
    return int(value)


def disagreement(rows):
    """None if every rank's row is the same, else the message: each field the ranks disagree on, with each
    rank's value (``rows[r]``: rank r's ``encode``)."""
    parts = []
    for i, field in enumerate(FIELDS):
        values = [int(row[i]) for row in rows]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {_decode(field, x)}" for r, x in enumerate(values))
            parts.append(f"{field} ({per_rank})")
    if not parts:
        return None
    return ("ring_attention: the ranks must pass the same shapes, dtype and options, but they disagree on "
            + "; ".join(parts))
