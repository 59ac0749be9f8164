"""dV where each query sees one key (bfloat16, d 128, seqlen_q 339, seqlen_k 1, causal or not, 4/4 and 6/2 heads),
per backend and dQ path, against the float64 sum of the dO rows that see the key, rounded once: how many
elements are off and by how much.  The recomputed P there is 1 only to within 2**-24 (lse's natural-log round
trip); found by flash-attn's deterministic test (issue 40).  ``python -m tools.one_key_dv`` on a GPU machine."""
import torch
import flashnb


def main():
    torch.manual_seed(0)
    for causal in (True, False):
        for heads, heads_k in ((4, 4), (6, 2)):
            q = torch.randn(2, 339, heads, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(2, 1, heads_k, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(2, 1, heads_k, 128, device="cuda", dtype=torch.bfloat16)
            do = torch.randn(2, 339, heads, 128, device="cuda", dtype=torch.bfloat16)
            g = heads // heads_k
            rows = do.double()[:, 338:] if causal else do.double()   # the rows that see the key (bottom-right causal)
            exact = rows.sum(1, keepdim=True).view(2, 1, heads_k, g, 128).sum(3)
            for backend in ("auto", "simt", "tensorcore", "wgmma"):
                for det in (False, True):
                    try:
                        out, lse = flashnb.flash_attention(q, k, v, causal=causal, return_lse=True, backend=backend)
                        dq, dk, dv = flashnb.flash_attention_backward(do, q, k, v, out, lse, causal=causal,
                                                                      deterministic=det, backend=backend)
                    except Exception as e:              # noqa: BLE001 (a backend that does not take the shape)
                        print(f"causal={causal} h={heads}/{heads_k} {backend} det={det}: {type(e).__name__}: {e}"[:200])
                        continue
                    want = exact.to(torch.bfloat16).double()
                    diff = (dv.double() - want).abs()
                    ulp = (want.abs() * 2 ** -7).clamp_min(1e-30)
                    bad = int((diff > 0).sum())
                    lse2 = lse.double() if lse.dim() else lse
                    print(f"causal={causal} h={heads}/{heads_k} {backend:10s} det={det}: dv elements off {bad} of "
                          f"{dv.numel()}, max {float((diff / ulp).max()):.2f} ulp; out vs v max "
                          f"{float((out[:, 338:].double() - v.double().repeat_interleave(g, 2)).abs().max()):.3g}; "
                          f"lse[...,338] {lse2.reshape(-1)[:1].tolist()}", flush=True)

if __name__ == "__main__":
    main()
