"""Every shipped kernel configuration once, small, for ``compute-sanitizer`` (not a pytest module).

    compute-sanitizer --tool memcheck  python3 tests/gpu_sanitize.py [DTYPES [HEADDIMS [BACKENDS]]]
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize.py [DTYPES [HEADDIMS [BACKENDS]]]
    compute-sanitizer --tool synccheck python3 tests/gpu_sanitize.py [DTYPES [HEADDIMS [BACKENDS]]]

(``DTYPES``: e.g. ``float16,bfloat16``; ``HEADDIMS``: e.g. ``64,128``; ``BACKENDS``: those of ``DTYPES`` below to
run, e.g. ``tensorcore:highest,tensorcore:high``; default all.)

"Shipped" = the default tiles (plan.default_tiles / default_tc_tiles) of every
head-dim class, for every input dtype and backend, with and without the masks
and options (each flag combination is its own specialisation), forward and
backward of each backend (SIMT: atomic and deterministic dQ; tensor cores: atomic
dQ).  Sequence lengths are not multiples of the tiles, so the partial-tile paths
run too.  Each forward result is compared with the oracle loosely; the backward results are only computed
(the property suites hold both to tight bounds): this run is about memory and
synchronisation errors.
"""
import sys

import numpy as np
from numba import cuda

import flashnb
import reference

HEADDIMS = (40, 64, 128, 256)
OPTION_SETS = {
    "plain": {},
    "causal": dict(causal=True),
    "all": dict(window_size=(70, 3), softcap=3.0, dropout_p=0.2, seed=3, alibi_slopes=np.array([0.2, 0.1]),
                block_mask=np.array([[True, False, True, True], [True, True, False, True]]),
                block_mask_size=(128, 64)),   # 2 x 4 blocks of the 133 x 201 scores
    "mask+bias": dict(attn_mask=None, attn_bias=None),   # filled per shape below
}


DTYPES = {"float16": (np.float16, ("tensorcore", "simt", "wgmma", "wgmma-bwd", "wgmma-bwd-tma")),
          "bfloat16": ("bfloat16", ("tensorcore", "simt", "wgmma", "wgmma-bwd", "wgmma-bwd-tma")),
          "float32": (np.float32, ("simt", "tensorcore:highest", "tensorcore:high", "wgmma:highest", "wgmma:high")),
          "float64": (np.float64, ("simt",))}
# "tensorcore:PRECISION": float32 on tf32 tensor cores, forward and backward at that precision; "wgmma": the Hopper
# forward (compute capability 9.0 only; its backward is the tensor-core one); "wgmma-bwd": the Hopper forward and
# the Hopper dK/dV kernel (plan.WGMMA_BACKWARD, and WGMMA_BACKWARD_256 above head dim 128); "wgmma-bwd-tma": the same
# with its Q_i, dO_i by the copy engine (plan.WGMMA_BWD_TMA); "wgmma:PRECISION": float32 on tf32 wgmma
# (plan.WGMMA_TF32, up to head dim 128), its backward the tf32 tensor-core one


def main(headdims=HEADDIMS, sq=133, sk=201, dtypes=tuple(DTYPES), only=None):
    rng = np.random.default_rng(0)
    checked = 0
    for dtype, backends in (DTYPES[n] for n in dtypes):
        for d in headdims:
            q = rng.standard_normal((1, sq, 2, d))
            k = rng.standard_normal((1, sk, 1, d))
            v = rng.standard_normal((1, sk, 1, d))
            dout = rng.standard_normal((1, sq, 2, d))
            for name, opts in OPTION_SETS.items():
                opts = dict(opts)
                if name == "mask+bias":
                    opts = dict(attn_mask=rng.random((1, 2, sq, sk)) < 0.8, attn_bias=rng.standard_normal((1, 1, sq, sk)))
                for backend in backends:
                    if only is not None and backend not in only:
                        continue
                    if backend.startswith("wgmma") and tuple(cuda.get_current_device().compute_capability) != (9, 0):
                        continue
                    if backend.startswith("wgmma:") and d > 128:
                        continue
                    flashnb.plan.WGMMA_BWD_TMA = backend == "wgmma-bwd-tma"
                    if backend == "wgmma-bwd-tma":
                        backend = "wgmma-bwd"
                    flashnb.plan.WGMMA_BACKWARD = flashnb.plan.WGMMA_BACKWARD_256 = backend == "wgmma-bwd"
                    flashnb.plan.WGMMA_TF32 = backend.startswith("wgmma:")
                    bwd_backend = "wgmma" if backend == "wgmma-bwd" else "tensorcore"
                    backend = "wgmma" if backend == "wgmma-bwd" else backend
                    arrays = _cast((q, k, v, dout), dtype)
                    backend, _, precision = backend.partition(":")
                    extra = dict(precision=precision) if precision else {}
                    out, lse = flashnb.flash_attention(*arrays[:3], return_lse=True, backend=backend, **opts, **extra)
                    ref, _ = reference.attention(*(_host(x) for x in arrays[:3]), **opts)
                    err = float(np.max(np.abs(_host(out) - ref)))
                    assert err < 0.05, f"{dtype} d={d} {name} {backend}: forward error {err}"
                    # the backward of the same backend: tensor cores (atomic dQ; float32 at the forward's
                    # precision), or SIMT with atomic and deterministic dQ
                    if backend == "simt":
                        for deterministic in (False, True):
                            flashnb.flash_attention_backward(*arrays[3:], *arrays[:3], out, lse, backend="simt",
                                                             deterministic=deterministic, **opts)
                    else:
                        flashnb.flash_attention_backward(*arrays[3:], *arrays[:3], out, lse, backend=bwd_backend,
                                                         **opts, **extra)
                    checked += 1
                    print(f"ok {np.dtype(dtype).name if dtype != 'bfloat16' else dtype} d={d} {name} {backend}"
                          + (f" precision={precision}" if precision else "")
                          + (" with the Hopper dK/dV kernel" if bwd_backend == "wgmma" else ""), flush=True)
    print(f"{checked} configurations ran", flush=True)


def _cast(arrays, dtype):
    if dtype == "bfloat16":
        import torch
        return [torch.as_tensor(x, device="cuda").to(torch.bfloat16) for x in arrays]
    return [np.asarray(x, dtype=dtype) for x in arrays]


def _host(x):
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return x.float().cpu().numpy().astype(np.float64)


if __name__ == "__main__":
    # optional arguments: dtype names (comma list), then head dims (comma list), then backends (comma list)
    args = sys.argv[1:]
    main(dtypes=tuple(args[0].split(",")) if args else tuple(DTYPES),
         headdims=tuple(int(x) for x in args[1].split(",")) if len(args) > 1 else HEADDIMS,
         only=tuple(args[2].split(",")) if len(args) > 2 else None)
