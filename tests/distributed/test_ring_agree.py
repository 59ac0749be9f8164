"""What the ranks of a ring must agree on (flashnb/distributed/_agree.py, no torch: runs in CI): the rows a rank
contributes and the error naming each disagreement with every rank's value.  The collective itself runs in
tests/distributed/test_ring_gloo.py (needs torch)."""
import pytest

from flashnb.distributed import _agree

BASE = dict(dtype="float16", batch=2, length=1024, heads=4, headdim=128, kv_heads=4, layout="zigzag", causal=True,
            scale=0.125, backend="auto")


def test_equal_rows_agree():
    rows = [_agree.encode(**BASE) for _ in range(3)]
    assert _agree.disagreement(rows) is None


@pytest.mark.parametrize("field, change, said", [
    ("dtype", dict(dtype="bfloat16"), "dtype (rank 0: float16, rank 1: bfloat16)"),
    ("shard length", dict(length=1000), "shard length (rank 0: 1024, rank 1: 1000)"),
    ("query heads", dict(heads=2), "query heads (rank 0: 4, rank 1: 2)"),
    ("key/value heads", dict(kv_heads=2), "key/value heads (rank 0: 4, rank 1: 2)"),
    ("head dim", dict(headdim=64), "head dim (rank 0: 128, rank 1: 64)"),
    ("causal", dict(causal=False), "causal (rank 0: True, rank 1: False)"),
    ("softmax_scale", dict(scale=0.125000001), "softmax_scale (rank 0: 0.125, rank 1: 0.125000001)"),
    ("layout", dict(layout="contiguous"), "layout (rank 0: zigzag, rank 1: contiguous)"),
    ("backend", dict(backend="simt"), "backend (rank 0: auto, rank 1: simt)"),
    ("batch", dict(batch=3), "batch (rank 0: 2, rank 1: 3)"),
])
def test_each_disagreement_is_named_with_every_ranks_value(field, change, said):
    message = _agree.disagreement([_agree.encode(**BASE), _agree.encode(**dict(BASE, **change))])
    assert said in message, message
    assert message.count("(rank 0") == 1                 # that field only


def test_several_fields_and_an_unknown_dtype():
    rows = [_agree.encode(**BASE), _agree.encode(**dict(BASE, dtype="float8_e4m3fn", heads=8)),
            _agree.encode(**BASE)]
    message = _agree.disagreement(rows)
    assert "dtype (rank 0: float16, rank 1: another, rank 2: float16)" in message
    assert "query heads (rank 0: 4, rank 1: 8, rank 2: 4)" in message
