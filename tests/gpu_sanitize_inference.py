"""The packed-batch (varlen) and KV-cache kernels once each, small, for ``compute-sanitizer`` (not a pytest module).

    python3 tests/gpu_sanitize_inference.py [varlen] [kvcache] [routed] [rotary] [clients] [flex] [learned]   # once without the tool: fills the disk cache
    compute-sanitizer --tool memcheck  python3 tests/gpu_sanitize_inference.py kvcache
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize_inference.py kvcache
    compute-sanitizer --tool synccheck python3 tests/gpu_sanitize_inference.py kvcache

(no argument: every part).  Varlen: forward and backward, SIMT and tensor cores (and on compute capability 9.0
the Hopper forward, its tiles by the copy engine, and the Hopper dK/dV kernel, plan.WGMMA_BACKWARD_PACKED),
float16, causal or not,
sequences of unequal lengths with an empty one and lengths that are not multiples of the tiles.  KV cache
(``KVCACHE``): float16 and bfloat16; dense and paged caches; ``cache_seqlens`` and ``block_table`` in device
memory (checked by the kernels), as an int, and out of range (the kernels must refuse those sequences without
a stray read or write: NaN rows, no append); with and without an append; one split and several (the combine);
decoding (one query) and a chunk of 12 queries over several row tiles; the decode candidates of
``tools.tune_decode`` (LEAN, 16 lanes a key with 6 stages, 8 warps); 3 stages (48 KB of dynamic shared
memory over 8 KB of static: ``_jit.launch``'s opt-in).  Each result is compared with the oracle loosely (the
property suites hold them to tight bounds): this run is about memory and synchronisation errors.
"""
import sys

import numpy as np
import torch

import flashnb
import reference
from flashnb import kvcache as kv


def varlen(rng):
    lens_q, lens_k = np.array([37, 0, 130, 5]), np.array([41, 3, 130, 77])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    hopper = torch.cuda.get_device_capability() == (9, 0)       # "wgmma": the Hopper forward, copy engine
    for d in (64, 128):
        q = rng.standard_normal((lens_q.sum(), 4, d))
        k, v = (rng.standard_normal((lens_k.sum(), 2, d)) for _ in range(2))
        dout = rng.standard_normal(q.shape)
        for causal in (False, True):
            ref, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
            for backend in ("simt", "tensorcore") + (("wgmma",) if hopper else ()):
                flashnb.plan.WGMMA_BACKWARD_PACKED = backend == "wgmma"      # its backward: the Hopper dK/dV kernel
                t = [torch.as_tensor(x, device="cuda", dtype=torch.float16) for x in (q, k, v, dout)]
                cq, ck = (torch.as_tensor(c, device="cuda") for c in (cu_q, cu_k))
                out, lse = flashnb.flash_attn_varlen_func(*t[:3], cq, ck, int(lens_q.max()), int(lens_k.max()),
                                                          causal=causal, return_lse=True, backend=backend)
                err = float((out.double().cpu() - torch.as_tensor(ref)).abs().max())
                assert err < 0.05, f"varlen d={d} causal={causal} {backend}: forward error {err}"
                flashnb.flash_attn_varlen_backward(t[3], *t[:3], out, lse, cq, ck, int(lens_q.max()),
                                                   int(lens_k.max()), causal=causal, backend=backend)
                print(f"ok varlen d={d} causal={causal} {backend}", flush=True)


F16, BF16 = torch.float16, torch.bfloat16
KVCACHE = [  # (dtype, paged, seqlens: "tensor" | "int" | "bad", seqlen_q, new, splits, kvcache settings)
    (F16, False, "bad", 1, 1, 3, {}),                    # dense decode, append, split + combine; sequence 0 refused
    (F16, True, "bad", 1, 1, 3, {}),                     # paged, the same; sequences 0 and 2 refused
    (F16, True, "tensor", 1, 1, 1, {}),                  # paged decode and append, one split
    (BF16, True, "tensor", 12, 12, 3, {}),               # chunked prefill: 48 rows in 6 tiles, paged, split
    (BF16, False, "int", 1, 0, 0, {}),                   # bfloat16 decode, no metadata array, automatic split
    (F16, False, "int", 1, 0, 0, {"STAGES": 3}),         # 48 KB dynamic + 8 KB static shared memory
    # tools.tune_decode's candidates, as its A/B rows compile them (an int length; the same splitting)
    (F16, False, "int", 1, 0, 0, {"LEAN": 1}),
    (F16, False, "int", 1, 0, 0, {"LEAN": 1, "E_BUDGET": 32, "BLOCKS_PER_SM": 3, "STAGES": 6}),
    (F16, False, "int", 1, 0, 1, {"LEAN": 1, "NWARPS": 8, "BLOCKS_PER_SM": 1}),
]


def kvcache(rng):
    batch, heads, heads_k, d, rows, page = 3, 8, 2, 128, 700, 256
    pages = -(-rows // page)
    for dtype, paged, seqlens, seqlen_q, new, splits, kv_settings in KVCACHE:
        q = rng.standard_normal((batch, seqlen_q, heads, d))
        if paged:
            kc, vc = (rng.standard_normal((batch * pages + 1, page, heads_k, d)) for _ in range(2))
            table = rng.permutation(batch * pages + 1)[:batch * pages].reshape(batch, pages).astype(np.int32)
            capacity = pages * page
        else:
            kc, vc = (rng.standard_normal((batch, rows, heads_k, d)) for _ in range(2))
            table, capacity = None, rows
        mid = capacity // 2
        lens = np.array([0, mid, capacity - max(new, 1)], np.int32)
        bad = []
        if seqlens == "int":
            lens[:] = mid
        if seqlens == "bad":                             # sequence 0: too long; paged, sequence 2: a page past the pool
            lens[0], bad = capacity, [0]
            if paged:
                table[2, pages - 1], bad = batch * pages + 1, [0, 2]
        kn, vn = ((rng.standard_normal((batch, new, heads_k, d)),) * 2) if new else (None, None)
        good = [b for b in range(batch) if b not in bad]
        ref, _, _, _ = reference.attention_with_kvcache(
            q[good], kc if paged else kc[good], vc if paged else vc[good], None if kn is None else kn[good],
            None if vn is None else vn[good], cache_seqlens=lens[good], block_table=None if table is None else table[good],
            causal=True)
        t = lambda x: None if x is None else torch.as_tensor(x, device="cuda").to(dtype)  # noqa: E731
        saved = {k: getattr(kv, k) for k in kv_settings}
        try:
            for k, v in kv_settings.items():
                setattr(kv, k, type(saved[k])(v))
            out = flashnb.flash_attn_with_kvcache(
                t(q), t(kc), t(vc), t(kn), t(vn),
                cache_seqlens=mid if seqlens == "int" else torch.as_tensor(lens, device="cuda"),
                block_table=None if table is None else torch.as_tensor(table, device="cuda"),
                num_splits=splits, causal=True)
        finally:
            for k, v in saved.items():
                setattr(kv, k, v)
        out = out.double().cpu()
        what = f"kvcache {dtype} paged={paged} seqlens={seqlens} q={seqlen_q} new={new} splits={splits} {kv_settings}"
        err = float((out[good] - torch.as_tensor(ref)).abs().max())
        assert err < 0.1, f"{what}: {err}"
        assert bool(out[bad].isnan().all()), f"{what}: the refused sequences {bad} are not NaN"
        print(f"ok {what}", flush=True)


def routed(rng):
    """``flash_attention``'s small-query calls (plan.split_kv: the decode kernels over q, k, v as a full cache;
    float16, bfloat16, float32; GQA; causal or a window; one query and several; short and split key ranges) and
    ``flash_attn_with_kvcache(cache_batch_idx=...)`` (a dense cache served as pages of one row each, device
    indices, an append)."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for seqlen_q, seqlen_k, opts in ((1, 700, dict(causal=True)), (4, 700, dict(causal=True)),
                                         (2, 3000, dict(window_size=(100, 0))), (1, 37, {})):
            q = rng.standard_normal((2, seqlen_q, 8, 128))
            for kv_heads in (2, 8):          # 8: one query row a KV head (float32: stages do not fit, registers)
                kk, vv = (rng.standard_normal((2, seqlen_k, kv_heads, 128)) for _ in range(2))
                ref, _ = reference.attention(q, kk, vv, **opts)
                t = lambda x: torch.as_tensor(x, device="cuda").to(dtype)  # noqa: E731
                out = flashnb.flash_attention(t(q), t(kk), t(vv), **opts).double().cpu()
                err = float((out - torch.as_tensor(ref)).abs().max())
                assert err < 0.1, f"routed {dtype} {seqlen_q}x{seqlen_k} {opts} kv heads {kv_heads}: {err}"
                print(f"ok routed {dtype} q={seqlen_q} k={seqlen_k} {opts} kv heads {kv_heads}", flush=True)
    q = rng.standard_normal((2, 1, 8, 128))
    kc, vc = (rng.standard_normal((5, 512, 2, 128)) for _ in range(2))
    kn, vn = (rng.standard_normal((2, 1, 2, 128)) for _ in range(2))
    idx, lens = np.array([4, 1], np.int32), np.array([300, 511], np.int32)
    ref, _, _, _ = reference.attention_with_kvcache(q, kc, vc, kn, vn, lens, cache_batch_idx=idx, causal=True)
    t = lambda x: torch.as_tensor(x, device="cuda").to(torch.float16)  # noqa: E731
    out = flashnb.flash_attn_with_kvcache(t(q), t(kc), t(vc), t(kn), t(vn), cache_seqlens=torch.as_tensor(lens).cuda(),
                                          cache_batch_idx=torch.as_tensor(idx).cuda(), causal=True)
    err = float((out.double().cpu() - torch.as_tensor(ref)).abs().max())
    assert err < 0.1, f"cache_batch_idx: {err}"
    print("ok cache_batch_idx", flush=True)


def rotary(rng):
    """``flash_attn_with_kvcache`` with ``rotary_cos``/``rotary_sin`` (kernels/rotary.py): float16, bfloat16 and
    float32, interleaved or not, rotary_dim 64 or the whole head dim 128, causal (q at its own rows) or not (q
    at cache_seqlens), cache_seqlens on the device, a paged cache, 3 new tokens."""
    batch, heads, heads_k, d, page, new = 2, 8, 2, 128, 256, 3
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for interleaved, half, causal, paged in ((True, 32, True, False), (False, 64, False, True),
                                                 (False, 32, True, True), (True, 64, False, False)):
            q = rng.standard_normal((batch, new, heads, d))
            kn, vn = (rng.standard_normal((batch, new, heads_k, d)) for _ in range(2))
            rows = 2 * page
            if paged:
                table = np.array([[3, 0], [1, 2]], np.int32)
                kc, vc = (rng.standard_normal((4, page, heads_k, d)) for _ in range(2))
            else:
                table = None
                kc, vc = (rng.standard_normal((batch, rows, heads_k, d)) for _ in range(2))
            lens = np.array([100, rows - new], np.int32)
            ang = np.arange(rows)[:, None] * (10000.0 ** (-np.arange(half) / half))[None, :]
            cos, sin = np.cos(ang), np.sin(ang)
            ref, _, _, _ = reference.attention_with_kvcache(q, kc, vc, kn, vn, lens, table, rotary_cos=cos,
                                                            rotary_sin=sin, rotary_interleaved=interleaved,
                                                            causal=causal)
            t = lambda x: torch.as_tensor(x, device="cuda").to(dtype)  # noqa: E731
            out = flashnb.flash_attn_with_kvcache(
                t(q), t(kc), t(vc), t(kn), t(vn), t(cos), t(sin), torch.as_tensor(lens, device="cuda"),
                block_table=None if table is None else torch.as_tensor(table, device="cuda"), causal=causal,
                rotary_interleaved=interleaved)
            err = float((out.double().cpu() - torch.as_tensor(ref)).abs().max())
            what = f"rotary {dtype} interleaved={interleaved} dim={2 * half} causal={causal} paged={paged}"
            assert err < 0.1, f"{what}: {err}"
            print(f"ok {what}", flush=True)


def clients(rng):
    """What real clients added (issue 40): ``flash_attn_with_kvcache(cache_leftpad=...)`` (the decode kernel's
    ``HAS_LEFTPAD``: device pads, one split and several, an append, a window, one query and a chunk of 5), odd
    16-bit head dims in the cache (zero-padded copies, the caches copied back after an append), and
    ``flash_attn_varlen_func(block_table=...)`` (the page gather, then the packed call), float16 and bfloat16."""
    batch, heads, heads_k, rows = 3, 8, 2, 700
    for dtype in (torch.float16, torch.bfloat16):
        t = lambda x: torch.as_tensor(x, device="cuda").to(dtype)  # noqa: E731
        for seqlen_q, new, splits, window in ((1, 0, 1, (-1, -1)), (1, 1, 0, (-1, -1)), (5, 0, 4, (200, 0)),
                                              (1, 2, 3, (64, 0))):
            d = 128
            q = rng.standard_normal((batch, seqlen_q, heads, d))
            kc, vc = (rng.standard_normal((batch, rows, heads_k, d)) for _ in range(2))
            kn, vn = ((rng.standard_normal((batch, new, heads_k, d)) for _ in range(2)) if new else (None, None))
            lens = np.array([300, 650, rows - new], np.int32)
            pad = np.array([0, 123, rows - new - 1], np.int32)
            ref, _, _, _ = reference.attention_with_kvcache(q, kc, vc, kn, vn, lens, cache_leftpad=pad + 0,
                                                            causal=True, window_size=window)
            out = flashnb.flash_attn_with_kvcache(
                t(q), t(kc), t(vc), None if kn is None else t(kn), None if vn is None else t(vn),
                cache_seqlens=torch.as_tensor(lens, device="cuda"), cache_leftpad=torch.as_tensor(pad, device="cuda"),
                causal=True, window_size=window, num_splits=splits)
            err = float((out.double().cpu() - torch.as_tensor(ref)).abs().max())
            what = f"leftpad {dtype} q={seqlen_q} new={new} splits={splits} window={window}"
            assert err < 0.1, f"{what}: {err}"
            print(f"ok {what}", flush=True)
        for d in (59, 127):
            q = rng.standard_normal((batch, 1, heads, d))
            kc, vc = (rng.standard_normal((batch, rows, heads_k, d)) for _ in range(2))
            kn, vn = (rng.standard_normal((batch, 1, heads_k, d)) for _ in range(2))
            lens = np.array([10, 400, rows - 1], np.int32)
            ref, want_kc, want_vc, _ = reference.attention_with_kvcache(q, kc, vc, kn, vn, lens, causal=True)
            kc_d, vc_d = t(kc), t(vc)
            out = flashnb.flash_attn_with_kvcache(t(q), kc_d, vc_d, t(kn), t(vn),
                                                  cache_seqlens=torch.as_tensor(lens, device="cuda"), causal=True)
            err = float((out.double().cpu() - torch.as_tensor(ref)).abs().max())
            assert err < 0.1, f"odd head dim {d} {dtype}: {err}"
            for b in range(batch):                        # the appended row reached the caller's caches
                got = kc_d[b, lens[b]].double().cpu()
                assert float((got - torch.as_tensor(kn[b, 0]).to(dtype).double()).abs().max()) == 0, "k append"
            print(f"ok odd head dim {d} {dtype}", flush=True)
        cu_q, cu_k = np.array([0, 3, 3, 260], np.int32), np.array([0, 500, 501, 1300], np.int32)
        page, d = 256, 128
        q = rng.standard_normal((int(cu_q[-1]), heads, d))
        k, v = (rng.standard_normal((int(cu_k[-1]), heads_k, d)) for _ in range(2))
        pages = -(-np.diff(cu_k) // page)
        table = np.zeros((3, int(pages.max())), np.int32)
        order = rng.permutation(int(pages.sum()) + 2)
        kp, vp = (np.zeros((len(order), page, heads_k, d)) for _ in range(2))
        used = 0
        for b in range(3):
            for j in range(int(pages[b])):
                table[b, j] = order[used]
                used += 1
            for j in range(int(cu_k[b + 1] - cu_k[b])):
                kp[table[b, j // page], j % page] = k[cu_k[b] + j]
                vp[table[b, j // page], j % page] = v[cu_k[b] + j]
        for causal in (False, True):
            ref, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
            out = flashnb.flash_attn_varlen_func(t(q), t(kp), t(vp), torch.as_tensor(cu_q, device="cuda"),
                                                 torch.as_tensor(cu_k, device="cuda"), 257, 799, causal=causal,
                                                 block_table=torch.as_tensor(table, device="cuda"))
            err = float((out.double().cpu() - torch.as_tensor(ref)).abs().max())
            assert err < 0.1, f"varlen block_table {dtype} causal={causal}: {err}"
            print(f"ok varlen block_table {dtype} causal={causal}", flush=True)


HEADDIMS_FLEX = (64, 128)        # (FLEX_HEADDIMS=64 in the environment: head dim 64 only)


def flex(rng):
    """flex_attention forward and backward with a score_mod (ALiBi, differentiated by the complex step) and a
    block mask (causal within captured documents; block 64 x 64, so empty, partial and full blocks), every
    backend: "auto" (on compute capability 9.0 the Hopper forward), "tensorcore" (``mma.sync``), "simt";
    float16 and float32; head dims 64 and 128; 4 query heads over 2; lengths that are not multiples of a tile;
    and the block-states kernel of ``create_block_mask``."""
    from reference import flex as rf
    L, S = 300, 333
    docs = np.sort(rng.integers(0, 4, max(L, S)))

    def alibi(score, b, h, q_idx, kv_idx):
        return score - 0.25 * (h + 1) * abs(q_idx - kv_idx)

    def doc_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    # block 64: smaller than the tensor-core tiles (a tile's states in a loop); block 128: a tile inside one block
    # (one read), and with no score_mod the mask-only kernels (the Hopper forward at two blocks an SM, the dK/dV
    # kernel's plain form with the mask's bits)
    runs = [(64, alibi, d, dtype, backend) for d in HEADDIMS_FLEX
            for dtype, backend in ((F16, "auto"), (F16, "tensorcore"), (F16, "simt"), (torch.float32, "auto"))]
    runs += [(128, score_mod, 64, F16, backend) for score_mod in (None, alibi) for backend in ("auto", "tensorcore")]
    problems = {}                                  # (score_mod, d) -> inputs and the oracle's results
    for block, score_mod, d, dtype, backend in runs:
        mask = flashnb.create_block_mask(doc_causal, None, None, L, S, BLOCK_SIZE=block)
        if (score_mod, d) not in problems:
            q = rng.standard_normal((2, 4, L, d))
            k, v = (rng.standard_normal((2, 2, S, d)) for _ in range(2))
            dout = rng.standard_normal(q.shape)
            mods = dict(score_mod=score_mod, mask_mod=doc_causal, enable_gqa=True)
            problems[score_mod, d] = (q, k, v, dout, rf.flex_attention(q, k, v, **mods),
                                      rf.flex_attention_backward(dout, q, k, v, **mods))
        q, k, v, dout, ref, want = problems[score_mod, d]
        what = f"flex block {block} {'alibi' if score_mod else 'mask only'} d={d} {dtype} {backend}"
        t = [torch.as_tensor(x, device="cuda", dtype=dtype) for x in (q, k, v, dout)]
        out, lse = flashnb.flex_attention(*t[:3], score_mod=score_mod, block_mask=mask, enable_gqa=True,
                                          return_lse=True, backend=backend)
        err = float((out.double().cpu() - torch.as_tensor(ref)).abs().max())
        assert err < 0.05, f"{what}: forward error {err}"
        grads = flashnb.flex_attention_backward(t[3], *t[:3], out, lse, score_mod=score_mod, block_mask=mask,
                                                enable_gqa=True, backend=backend)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            err = float((g.double().cpu() - torch.as_tensor(w)).abs().max())
            assert err < 0.1 * (1 + float(np.abs(w).max())), f"{what}: {name} error {err}"
        print(f"ok {what}", flush=True)


def learned(rng):
    """Gradients into captured tensors (``flex_attention_backward(captured_grads=...)``): a learned relative-bias
    table and ALiBi slopes (float32 CUDA tensors) read by a score_mod, the dK/dV kernels adding each element's part
    with atomics at the index it read (a table read under an if: some elements read nothing); every backend, head
    dims 64 and 256 (the Hopper dK/dV kernel's two warpgroups holding the same elements: one adds), a causal block
    mask of 64 x 64."""
    from reference import flex as rf
    from strategies import learned_bias_mods
    L = 200
    buckets = (L - 1) // 16                        # relative positions in buckets of 16: (q_idx - kv_idx) // 16
    table_np, slopes_np = rng.standard_normal((4, 2 * buckets + 1)), rng.standard_normal(4) * 0.1
    table = torch.as_tensor(table_np, device="cuda", dtype=torch.float32)
    slopes = torch.as_tensor(slopes_np, device="cuda", dtype=torch.float32)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = flashnb.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=64)
    rel = learned_bias_mods(table, slopes, buckets)[0]
    rel_np = learned_bias_mods(table_np.astype(np.float32), slopes_np.astype(np.float32), buckets)[1]
    for d in (64, 256):
        q, dout = (rng.standard_normal((1, 4, L, d)) for _ in range(2))
        k, v = (rng.standard_normal((1, 2, L, d)) for _ in range(2))
        *_, want = rf.flex_attention_backward(dout, q, k, v, score_mod=rel_np, mask_mod=causal, enable_gqa=True,
                                              captured_grads=("table", "slopes"))
        for dtype, backend in ((F16, "auto"), (F16, "tensorcore"), (F16, "simt"), (torch.float32, "auto")):
            t = [torch.as_tensor(x, device="cuda", dtype=dtype) for x in (q, k, v, dout)]
            out, lse = flashnb.flex_attention(*t[:3], score_mod=rel, block_mask=mask, enable_gqa=True,
                                              return_lse=True, backend=backend)
            *_, got = flashnb.flex_attention_backward(t[3], *t[:3], out, lse, score_mod=rel, block_mask=mask,
                                                      enable_gqa=True, backend=backend,
                                                      captured_grads=("table", "slopes"))
            what = f"learned d={d} {dtype} {backend}"
            for name in ("table", "slopes"):
                w = want[name]
                err = float((got[name].double().cpu() - torch.as_tensor(w)).abs().max())
                assert err < 0.05 * (1 + float(np.abs(w).max())), f"{what}: d{name} error {err}"
            print(f"ok {what}", flush=True)


if __name__ == "__main__":
    import os
    if os.environ.get("FLEX_HEADDIMS"):
        HEADDIMS_FLEX = tuple(int(d) for d in os.environ["FLEX_HEADDIMS"].split(","))
    for item in os.environ.get("PLAN_SETTINGS", "").split():     # e.g. "FLEX_MASK_NARROW=1 FLEX_SECTION=1"
        name, value = item.split("=")
        assert hasattr(flashnb.plan, name), name
        setattr(flashnb.plan, name, int(value))
        print(f"plan.{name} = {value}", flush=True)
    parts = sys.argv[1:] or ["varlen", "kvcache", "routed", "rotary", "clients", "flex", "learned"]
    rng = np.random.default_rng(0)
    if "varlen" in parts:
        varlen(rng)
    if "kvcache" in parts:
        kvcache(rng)
    if "routed" in parts:
        routed(rng)
    if "rotary" in parts:
        rotary(rng)
    if "clients" in parts:
        clients(rng)
    if "flex" in parts:
        flex(rng)
    if "learned" in parts:
        learned(rng)
    print("done", flush=True)
