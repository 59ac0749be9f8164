"""Which rows of a ring step take part, and under which mask (no torch here: CI checks it against the oracle).

A rank's shard of ``L`` rows holds the global positions of its layout (``reference.ring`` defines them):

* ``contiguous``: rank ``r`` holds chunk ``r`` of ``P``;
* ``zigzag``: the sequence cut into ``2P`` chunks, rank ``r`` holds chunks ``r`` and ``2P - 1 - r`` (in that
  order), so that under a causal mask every rank does the same work.

``block(layout, causal, rank, source, L)`` says how rank ``rank``'s queries meet the keys of rank ``source``'s
shard: ``None`` (no pair is allowed) or ``(q_rows, k_rows, causal)``, two slices of the shards and whether the
kernel's causal mask applies to them (for two slices of equal length it is the global causal mask there).
"""

LAYOUTS = ("zigzag", "contiguous")

ALL = slice(None)


def block(layout, causal, rank, source, seqlen):
    if not causal:
        return ALL, ALL, False
    if source == rank:          # the diagonal: in both layouts the shard's positions increase along its rows
        return ALL, ALL, True
    if layout == "contiguous":  # earlier chunks are seen whole, later ones not at all
        return (ALL, ALL, False) if source < rank else None
    half = seqlen // 2
    if source < rank:           # both query chunks see the source's first chunk whole, neither its second
        return ALL, slice(0, half), False
    return slice(half, None), ALL, False   # only the second query chunk sees the source, whole


def positions(layout, rank, world_size, seqlen):
    """The global positions (a ``range`` list) of the ``seqlen`` rows rank ``rank`` holds."""
    if layout == "contiguous":
        return list(range(rank * seqlen, (rank + 1) * seqlen))
    n = seqlen // 2
    second = 2 * world_size - 1 - rank
    return list(range(rank * n, (rank + 1) * n)) + list(range(second * n, (second + 1) * n))
