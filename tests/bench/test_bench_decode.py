"""bench/decode.py without a GPU: it says why nothing is timed; its HBM bound and table."""
from bench import decode


def test_hbm_bound_is_the_issue_number():
    # K and V of batch 16 x 8 KV heads x 4096 keys x 128 dims in float16, read once at 3 TB/s: GPU.md's ~90 us
    assert abs(decode.hbm_bound_us(4096) - 89.5) < 0.1
    assert abs(decode.hbm_bound_us(32768) - 715.8) < 0.1


def test_decode_without_gpu_says_so(capsys):
    from flashnb.kernels._jit import SIMULATOR
    if not SIMULATOR:
        return                                   # on a GPU machine main() times things: the GPU record covers it
    assert decode.main([]) == 0
    assert "need a GPU" in capsys.readouterr().out


def test_table_and_speedups():
    recs = [dict(seqlen_k=4096, layout="dense", impl="sdpa-flash", gpu_us=120.0, hbm_bound_us=89.5),
            dict(seqlen_k=4096, layout="dense", impl="flashnb", gpu_us=100.0, call_us=150.0, hbm_bound_us=89.5),
            dict(seqlen_k=4096, layout="paged", impl="flashnb", note="ValueError: x", hbm_bound_us=89.5)]
    decode.speedups(recs)
    assert recs[1]["vs_sdpa_flash"] == 1.2 and "vs_sdpa_flash" not in recs[2]
    text = decode.table(recs)
    assert text.count("\n") == 4 and "| 4096 | paged | flashnb |" in text and "ValueError: x" in text
