"""Input validation and purity of the oracle: bad inputs raise ValueError/TypeError naming the argument;
inputs are never modified."""
import re

import numpy as np
import pytest
from hypothesis import given

import reference
import strategies as S

RNG = np.random.default_rng(0)
Q = RNG.standard_normal((2, 5, 4, 8))
K = RNG.standard_normal((2, 7, 2, 8))
V = RNG.standard_normal((2, 7, 2, 8))
DOUT = RNG.standard_normal(Q.shape)

BAD_ARRAYS = {
    # broken argument: [((q, k, v), names any of which the message must contain), ...]
    "q": [((Q[0], K, V), ("q",)), ((Q[..., :4], K, V), ("q", "k")), ((Q.astype(complex), K, V), ("q",))],
    "k": [((Q, K[0], V), ("k",)), ((Q, K[:1], V), ("k",))],
    "v": [((Q, K, V[:, :6]), ("v",)), ((Q, K, V[..., :7]), ("v",)), ((Q, K, V[:, :, :1]), ("v",))],
    # 3 query heads cannot share 2 k/v heads
    "nheads": [((Q[:, :, :3], K, V), ("nheads", "nheads_k"))],
}

BAD_OPTIONS = {
    "dropout_p": [dict(dropout_p=1.0), dict(dropout_p=-0.1), dict(dropout_p=1.5)],
    "seed": [dict(dropout_p=0.1, seed=-1), dict(dropout_p=0.1, seed=2**64), dict(dropout_p=0.1, seed=1.5)],
    "window_size": [dict(window_size=(-2, 0)), dict(window_size=(0, -5)), dict(window_size=(1, 2, 3))],
    "attn_mask": [dict(attn_mask=np.ones((5, 6), bool)), dict(attn_mask=np.ones((3, 4, 5, 7), bool)),
                  dict(attn_mask=np.ones((5, 7)))],
    "attn_bias": [dict(attn_bias=np.zeros((5, 6))), dict(attn_bias=np.zeros((2, 3, 5, 7))),
                  dict(attn_bias=np.zeros((5, 7), bool))],
    "alibi_slopes": [dict(alibi_slopes=np.ones(3)), dict(alibi_slopes=np.ones((3, 4))),
                     dict(alibi_slopes=np.ones((2, 4, 1)))],
    "softcap": [dict(softcap=-1.0)],
    "block_mask": [dict(block_mask=np.ones((3, 2), bool), block_mask_size=(4, 4)),   # needs (2, 2)
                   dict(block_mask=np.ones((1, 1)), block_mask_size=(8, 8))],
    "block_mask_size": [dict(block_mask=np.ones((1, 1), bool), block_mask_size=(0, 4)),
                        dict(block_mask=np.ones((1, 1), bool), block_mask_size=(4,))],
}


def _names(msg: str, arg: str) -> bool:
    return re.search(rf"(?<![A-Za-z_]){re.escape(arg)}(?![A-Za-z_])", msg) is not None


def _raises_naming(arg, fn, *args, **kwargs):
    names = (arg,) if isinstance(arg, str) else tuple(arg)
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    assert any(_names(str(info.value), name) for name in names), \
        f"error message does not name {' or '.join(names)}: {info.value!r}"


def _all_entry_points(q, k, v, **opts):
    """(name, callable) for every public function taking q, k, v and the options."""
    dout = np.ones(q.shape)
    out, lse = reference.attention(Q, K, V)
    return [
        ("attention", lambda: reference.attention(q, k, v, **opts)),
        ("attention_backward", lambda: reference.attention_backward(dout, q, k, v, **opts)),
        ("flash_forward", lambda: reference.flash_forward(q, k, v, 4, 4, **opts)),
        ("flash_forward_v1", lambda: reference.flash_forward_v1(q, k, v, 4, 4, **opts)),
        ("flash_backward", lambda: reference.flash_backward(dout, q, k, v, out, lse, 4, 4, **opts)),
        ("flash_backward_v1", lambda: reference.flash_backward_v1(dout, q, k, v, out, lse, 4, 4, **opts)),
    ]


@pytest.mark.parametrize("arg,case", [(a, i) for a, cases in BAD_ARRAYS.items() for i in range(len(cases))])
def test_bad_arrays_are_rejected_by_name(arg, case):
    (q, k, v), names = BAD_ARRAYS[arg][case]
    for name, call in _all_entry_points(q, k, v):
        if name.startswith("flash_backward") and arg in ("q", "nheads"):
            continue                                               # out/lse no longer match q; covered below
        _raises_naming(names, call)


@pytest.mark.parametrize("arg,case", [(a, i) for a, cases in BAD_OPTIONS.items() for i in range(len(cases))])
def test_bad_options_are_rejected_by_name(arg, case):
    opts = BAD_OPTIONS[arg][case]
    for name, call in _all_entry_points(Q, K, V, **opts):
        _raises_naming(arg, call)


def test_bad_dout_out_lse_and_blocks_are_rejected_by_name():
    out, lse = reference.attention(Q, K, V)
    _raises_naming("dout", reference.attention_backward, DOUT[:, :4], Q, K, V)
    for backward in (reference.flash_backward, reference.flash_backward_v1):
        _raises_naming("dout", backward, DOUT[:, :4], Q, K, V, out, lse, 4, 4)
        _raises_naming("out", backward, DOUT, Q, K, V, out[:, :4], lse, 4, 4)
        _raises_naming("lse", backward, DOUT, Q, K, V, out, lse[..., :4], 4, 4)
    for fn, args in ((reference.flash_forward, (Q, K, V)), (reference.flash_forward_v1, (Q, K, V)),
                     (reference.flash_backward, (DOUT, Q, K, V, out, lse)),
                     (reference.flash_backward_v1, (DOUT, Q, K, V, out, lse))):
        _raises_naming("block_q", fn, *args, 0, 4)
        _raises_naming("block_k", fn, *args, 4, 0)
        _raises_naming("block_q", fn, *args, 2.5, 4)


def test_bad_dropout_keep_mask_arguments():
    _raises_naming("dropout_p", reference.dropout_keep_mask, 0, 1, 1, 4, 4, 1.0)
    _raises_naming("seed", reference.dropout_keep_mask, -1, 1, 1, 4, 4, 0.5)
    _raises_naming("seed", reference.dropout_keep_mask, 2**64, 1, 1, 4, 4, 0.5)
    _raises_naming("seqlen_q", reference.dropout_keep_mask, 0, 1, 1, -1, 4, 0.5)


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError):
        reference.attention(Q, K, V, casual=True)                 # a typo must not be silently ignored


def _freeze(x):
    if isinstance(x, np.ndarray):
        x = x.copy()
        x.setflags(write=False)
    return x


@given(S.problems(max_seqlen=16))
def test_inputs_are_never_modified(p):
    """Every entry point leaves its array arguments bit-for-bit unchanged (and works on read-only arrays)."""
    opts = {key: _freeze(value) for key, value in p.opts.items()}
    q, k, v, dout = (_freeze(a) for a in (p.q, p.k, p.v, p.dout))
    out, lse = reference.attention(q, k, v, **opts)
    out, lse = _freeze(out), _freeze(lse)
    arrays = [q, k, v, dout, out, lse] + [value for value in opts.values() if isinstance(value, np.ndarray)]
    before = [a.copy() for a in arrays]
    reference.attention_backward(dout, q, k, v, **opts)
    reference.flash_forward(q, k, v, p.block_q, p.block_k, **opts)
    reference.flash_forward_v1(q, k, v, p.block_q, p.block_k, **opts)
    reference.flash_backward(dout, q, k, v, out, lse, p.block_q, p.block_k, **opts)
    reference.flash_backward_v1(dout, q, k, v, out, lse, p.block_q, p.block_k, **opts)
    reference.dropout_keep_mask(opts.get("seed", 0), p.batch, p.nheads, p.seqlen_q, p.seqlen_k,
                                opts.get("dropout_p", 0.0))
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(a, b)
    # Writable inputs too (the read-only flag alone would hide a copy-then-compare bug).
    w = [p.q.copy(), p.k.copy(), p.v.copy(), p.dout.copy()]
    wopts = {key: (value.copy() if isinstance(value, np.ndarray) else value) for key, value in p.opts.items()}
    o, l = reference.attention(w[0], w[1], w[2], **wopts)
    reference.attention_backward(w[3], w[0], w[1], w[2], **wopts)
    reference.flash_forward(w[0], w[1], w[2], p.block_q, p.block_k, **wopts)
    reference.flash_forward_v1(w[0], w[1], w[2], p.block_q, p.block_k, **wopts)
    reference.flash_backward(w[3], w[0], w[1], w[2], o, l, p.block_q, p.block_k, **wopts)
    reference.flash_backward_v1(w[3], w[0], w[1], w[2], o, l, p.block_q, p.block_k, **wopts)
    for a, b in zip(w, (p.q, p.k, p.v, p.dout)):
        np.testing.assert_array_equal(a, b)
    for key, value in wopts.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, p.opts[key])
