"""Seconds to `import flashnb`, and to the first forward and first forward+backward in a fresh process
(float16 (2, 1024, 8, 64) torch tensors, causal), printed as one line; run it twice for the second-process
figure (the on-disk kernel cache filled by the first). `python -m tools.first_call LABEL`.
With FIRST_CALL_FLEX=1 the call is ``flashnb.torch.flex_attention`` with a score_mod (ALiBi, differentiated by
the complex step) and a document mask reading captured ids (``create_block_mask`` included in the first
forward): issue 43's "a second process loads it from disk (under 0.5 s)"."""
import os
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402
if os.environ.get("FIRST_CALL_KEYS"):
    import json
    from flashnb.kernels import _cache as _c, _jit as _j
    ASKED, _load, PARTS, _dk = [], _c.load, {}, _j._disk_key
    _c.load = lambda key: (ASKED.append(key), _load(key))[1]
    _j._disk_key = lambda kern, argtypes, arch: (PARTS.setdefault(getattr(kern, "flashnb_id", "?"), _j.code_state_parts(
        kern.py_func)), _dk(kern, argtypes, arch))[1]
t1 = time.perf_counter()
import flashnb  # noqa: E402
import flashnb.torch as ft  # noqa: E402
t2 = time.perf_counter()
q, k, v = (torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
torch.cuda.synchronize()
if os.environ.get("FIRST_CALL_SDPA_FIRST"):   # torch's own first-backward costs (lazy imports) land on SDPA
    ts = time.perf_counter()
    s = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
    s.backward(torch.randn_like(s))
    torch.cuda.synchronize()
    print(f"first-call {sys.argv[1] if len(sys.argv) > 1 else '?'}: SDPA's first forward+backward in the process "
          f"{time.perf_counter() - ts:.2f} s", flush=True)
    q.grad = k.grad = v.grad = None


DOCS = __import__("numpy").repeat(__import__("numpy").arange(4, dtype="int16"), 256)


def alibi(score, b, h, q_idx, kv_idx):
    return score - 0.0625 * (h + 1) * abs(q_idx - kv_idx)


def same_doc_causal(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


t3 = time.perf_counter()
if os.environ.get("FIRST_CALL_FLEX"):
    mask = flashnb.create_block_mask(same_doc_causal, None, None, 1024, 1024)
    out = ft.flex_attention(*(x.transpose(1, 2) for x in (q, k, v)), score_mod=alibi, block_mask=mask)
else:
    out = ft.flash_attn_func(q, k, v, causal=True)
torch.cuda.synchronize()
t4 = time.perf_counter()
dout = torch.randn_like(out)
if os.environ.get("FIRST_CALL_PROFILE"):              # where the first backward's time goes
    import cProfile
    import pstats
    with cProfile.Profile() as prof:
        out.backward(dout)
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
else:
    out.backward(dout)
torch.cuda.synchronize()
t5 = time.perf_counter()
label = sys.argv[1] if len(sys.argv) > 1 else "?"
print(f"first-call {label}: import torch {t1 - t0:.2f} s, import flashnb+flashnb.torch {t2 - t1:.2f} s, "
      f"first forward {t4 - t3:.2f} s, first forward+backward {t5 - t3:.2f} s", flush=True)
from flashnb.kernels import _cache  # noqa: E402
print(f"first-call {label}: disk cache {_cache.counters}; "
      + ", ".join(f"{r['kernel'].split('(')[0].rsplit('.', 1)[-1]} {r['how']} {r['seconds']:.2f} s" for r in _cache.log))
if os.environ.get("FIRST_CALL_KEYS"):      # why an entry stored by an earlier process missed in this one
    import difflib
    stored = [k for _, k, _, _ in _cache.entries() if k]
    parts_file = os.path.join(_cache.cache_dir(), "parts.json")
    before = json.load(open(parts_file)) if os.path.exists(parts_file) else {}
    for kid, parts in PARTS.items():
        if kid in before and before[kid] != parts:
            print(f"first-call {label}: code state parts of {kid[:80]} differ from the first process's:")
            for line in difflib.unified_diff(before[kid], parts, lineterm="", n=0):
                print("   ", line[:600])
    json.dump({**before, **PARTS}, open(parts_file, "w"))
    for key in ASKED:
        if key in stored:
            continue
        head = key.split("\n")[1][:60]
        near = [k for k in stored if k.split("\n")[1][:60] == head]
        print(f"first-call {label}: missed {head}...; {len(near)} stored keys of that factory")
        for k in near[:1]:
            for line in difflib.unified_diff(k.split("\n"), key.split("\n"), lineterm="", n=0):
                print("   ", line[:400])
