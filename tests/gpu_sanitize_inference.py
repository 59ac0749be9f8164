"""The packed-batch (varlen) and KV-cache kernels once each, small, for ``compute-sanitizer`` (not a pytest module).

    compute-sanitizer --tool memcheck  python3 tests/gpu_sanitize_inference.py
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize_inference.py
    compute-sanitizer --tool synccheck python3 tests/gpu_sanitize_inference.py

Varlen: forward and backward, SIMT and tensor cores, float16, causal or not, sequences of unequal lengths with
an empty one and lengths that are not multiples of the tiles. KV cache: float16 and bfloat16, dense and paged,
with and without an append, one split and several (the combine kernel), decoding (one query) and a chunk of
queries. Each result is compared with the oracle loosely (the property suites hold them to tight bounds):
this run is about memory and synchronisation errors.
"""
import numpy as np
import torch

import flashnb
import reference


def varlen(rng):
    lens_q, lens_k = np.array([37, 0, 130, 5]), np.array([41, 3, 130, 77])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    for d in (64, 128):
        q = rng.standard_normal((lens_q.sum(), 4, d))
        k, v = (rng.standard_normal((lens_k.sum(), 2, d)) for _ in range(2))
        dout = rng.standard_normal(q.shape)
        for causal in (False, True):
            ref, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
            for backend in ("simt", "tensorcore"):
                t = [torch.as_tensor(x, device="cuda", dtype=torch.float16) for x in (q, k, v, dout)]
                cq, ck = (torch.as_tensor(c, device="cuda") for c in (cu_q, cu_k))
                out, lse = flashnb.flash_attn_varlen_func(*t[:3], cq, ck, int(lens_q.max()), int(lens_k.max()),
                                                          causal=causal, return_lse=True, backend=backend)
                err = float((out.double().cpu() - torch.as_tensor(ref)).abs().max())
                assert err < 0.05, f"varlen d={d} causal={causal} {backend}: forward error {err}"
                flashnb.flash_attn_varlen_backward(t[3], *t[:3], out, lse, cq, ck, int(lens_q.max()),
                                                   int(lens_k.max()), causal=causal, backend=backend)
                print(f"ok varlen d={d} causal={causal} {backend}", flush=True)


def kvcache(rng):
    batch, heads, heads_k, d, rows, page = 3, 8, 2, 128, 700, 256
    for dtype in (torch.float16, torch.bfloat16):
        for paged in (False, True):
            for seqlen_q, new in ((1, 1), (1, 0), (12, 12)):
                for splits in (1, 3):
                    q = rng.standard_normal((batch, seqlen_q, heads, d))
                    if paged:
                        pages = -(-rows // page)
                        kc, vc = (rng.standard_normal((batch * pages, page, heads_k, d)) for _ in range(2))
                        table = rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32)
                    else:
                        kc, vc = (rng.standard_normal((batch, rows, heads_k, d)) for _ in range(2))
                        table = None
                    lens = np.array([0, 333, rows - max(new, 1)], np.int32)
                    kn, vn = ((rng.standard_normal((batch, new, heads_k, d)),) * 2) if new else (None, None)
                    ref, _, _, _ = reference.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                                                    block_table=table, causal=True)
                    t = lambda x: None if x is None else torch.as_tensor(x, device="cuda").to(dtype)  # noqa: E731
                    out = flashnb.flash_attn_with_kvcache(
                        t(q), t(kc), t(vc), t(kn), t(vn), cache_seqlens=torch.as_tensor(lens, device="cuda"),
                        block_table=None if table is None else torch.as_tensor(table, device="cuda"),
                        num_splits=splits, causal=True)
                    err = float((out.double().cpu() - torch.as_tensor(ref)).abs().max())
                    assert err < 0.1, f"kvcache {dtype} paged={paged} q={seqlen_q} new={new} splits={splits}: {err}"
                    print(f"ok kvcache {dtype} paged={paged} seqlen_q={seqlen_q} new={new} splits={splits}",
                          flush=True)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    varlen(rng)
    kvcache(rng)
    print("done", flush=True)
