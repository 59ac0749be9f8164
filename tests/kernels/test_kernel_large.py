"""Indexing beyond 2**31 elements (flash-attn has had illegal-address bugs exactly there).

q, k, v of 1040 x 512 x 32 x 128 = 2,181,038,080 elements each (> 2**31, 4.4 GB in
float16): the last batch entries live past every 32-bit element and byte offset.
Each backend (mma.sync, SIMT, and on compute capability 9.0 the Hopper kernels, whose tensor maps address
the copies) runs the forward and the backward on the whole tensors;
the first and the last (batch, head) slices are then held to the float64 oracle
with the usual rules (kernel_harness).  A 32-bit index overflow would read or
write the wrong rows there (wrong numbers, or an illegal address).  GPU only:
the simulator cannot hold or run this.  Each case needs about 45 GB: a file lock makes the cases of
parallel pytest-xdist workers run one at a time, and each checks the free memory inside the lock
(other GPU work running beside the suite can still take that memory).
"""
import contextlib
import fcntl
import pathlib
import tempfile
import types

import numpy as np
import pytest

import flashnb
import strategies as S
from kernel_harness import check_backward, check_forward, expected

B, N, H, D = 1040, 512, 32, 128
assert B * N * H * D > 2**31


def _slice_problem(t, b, h):
    q, k, v, dout = (np.ascontiguousarray(x[b:b + 1, :, h:h + 1].cpu().numpy()) for x in t)
    return S.Problem(q=q, k=k, v=v, dout=dout, opts=types.MappingProxyType(dict(causal=True)),
                     block_q=None, block_k=None)


@contextlib.contextmanager
def _one_at_a_time():
    """An exclusive lock shared by every process of this user on the machine (pytest-xdist workers)."""
    with open(pathlib.Path(tempfile.gettempdir()) / "flashnb-large-test.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["tensorcore", "simt", "wgmma"])
def test_more_than_2_31_elements(backend):
    torch = pytest.importorskip("torch")
    if backend == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels (tensor maps, copy engine) need compute capability 9.0")
    with _one_at_a_time():
        _check_more_than_2_31_elements(torch, backend)


def _check_more_than_2_31_elements(torch, backend):
    free, _ = torch.cuda.mem_get_info()
    need = 9 * B * N * H * D * 2 + B * N * H * D * 4     # q k v dout out dq dk dv (+ copies), float32 dQ sums
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free device memory, {free / 2**30:.0f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(7)
    t = [torch.randn((B, N, H, D), device="cuda", dtype=torch.float16, generator=gen) for _ in range(4)]
    q, k, v, dout = t
    out, lse = flashnb.flash_attention(q, k, v, causal=True, return_lse=True, backend=backend)
    grads = flashnb.flash_attention_backward(dout, q, k, v, out, lse, causal=True, backend=backend)
    torch.cuda.synchronize()
    for b, h in ((0, 0), (B - 1, H - 1), (B - 1, 0)):
        p = _slice_problem(t, b, h)
        what = f"{backend}, batch {b}, head {h}: "
        exp = expected(p, backward=True)
        check_forward(exp, out[b:b + 1, :, h:h + 1].cpu().numpy(), lse[b:b + 1, h:h + 1].cpu().numpy(), what)
        check_backward(exp, [g[b:b + 1, :, h:h + 1].cpu().numpy() for g in grads], what)
    del t, q, k, v, dout, out, lse, grads
    torch.cuda.empty_cache()
