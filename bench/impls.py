"""Every implementation the benchmark can time, behind one interface.

An ``Impl`` is a name, an availability probe and ``make(case, data, pass_)``,
which does the untimed setup of one pass and returns the zero-argument callable
the harness times:

* ``fwd``    -- the training forward (flashnb returns ``lse``; PyTorch records the graph);
* ``bwd``    -- the backward alone, from the saved state of one untimed forward
  (flashnb: ``out, lse``; PyTorch: the autograd graph, replayed with ``retain_graph``;
  CuPy: ``P``);
* ``fwdbwd`` -- forward then backward.

Implementations:

``flashnb-<backend>``   ``flashnb.flash_attention`` / ``flash_attention_backward``, one per
                        entry of ``flashnb.BACKENDS`` (just ``simt`` if it has none), and
                        ``flashnb-auto`` (``backend="auto"``: what a caller gets by default);
``torch-materialised``  softmax(Q K^T * scale + mask) V in PyTorch, autograd backward
                        (flash-attn's ``attention_pytorch`` benchmark baseline);
``cupy-materialised``   the same in CuPy, with the closed-form backward (FA paper, Algorithm 3);
``sdpa-<backend>``      ``torch.nn.functional.scaled_dot_product_attention`` forced to one
                        backend (flash, cudnn, efficient, math) with ``sdpa_kernel``.

All of them read the same q, k, v, dout (``CaseData``): PyTorch tensors when
PyTorch is installed, shared zero-copy with CuPy through DLPack.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from bench.cases import Case
from bench.flops import NO_WINDOW

SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


@dataclass
class Libraries:
    """The optional libraries, imported once; ``why_not`` says why one is missing."""
    torch: object = None
    cupy: object = None
    flashnb: object = None
    why_not: dict = field(default_factory=dict)


@dataclass
class Impl:
    name: str
    family: str                    # "flashnb" or "baseline"
    make: Callable                 # (case, data, pass_) -> zero-argument callable
    check: Callable | None = None  # (case, data) -> relative max error of the forward, or None
    unavailable: str | None = None


# ---- the inputs -------------------------------------------------------------------------

class CaseData:
    """q, k, v, dout for one case, generated once on the device and shared by every impl."""

    def __init__(self, gpu, case: Case, seed: int, cupy=None):
        self.gpu, self.case, self._cupy_module = gpu, case, cupy
        c = case
        shape_q = (c.batch, c.seqlen_q, c.nheads, c.headdim)
        shape_k = (c.batch, c.seqlen_k, c.nheads_k, c.headdim)
        self.q = gpu.randn(shape_q, c.dtype, seed)
        self.k = gpu.randn(shape_k, c.dtype, seed + 1)
        self.v = gpu.randn(shape_k, c.dtype, seed + 2)
        self.dout = gpu.randn(shape_q, c.dtype, seed + 3)
        self._cache = {}

    @property
    def library(self) -> str:
        return self.gpu.library

    def arrays(self):
        """(q, k, v, dout) in the primary library, with no autograd state."""
        if self.library == "torch":
            return tuple(x.detach() for x in (self.q, self.k, self.v, self.dout))
        return self.q, self.k, self.v, self.dout

    def torch_leaves(self):
        """(q, k, v) as leaf tensors requiring grad (views of the same memory), and dout."""
        if "leaves" not in self._cache:
            self._cache["leaves"] = tuple(x.detach().requires_grad_(True) for x in (self.q, self.k, self.v))
        return (*self._cache["leaves"], self.dout.detach())

    def cupy_arrays(self):
        """(q, k, v, dout) as CuPy arrays sharing the primary arrays' memory."""
        if "cupy" not in self._cache:
            cp = self._cupy_module
            self._cache["cupy"] = tuple(cp.from_dlpack(x) if self.library == "torch" else x
                                        for x in self.arrays())
        return self._cache["cupy"]

    def allowed(self, xp, device_kw: dict):
        """Boolean (seqlen_q, seqlen_k) mask of the pairs that may attend, or None if all may.

        The rule of docs/semantics.md, built on the device with ``xp`` (torch or cupy).
        """
        c = self.case
        if not c.causal and c.window == NO_WINDOW:
            return None
        i = xp.arange(c.seqlen_q, **device_kw)[:, None]
        j = xp.arange(c.seqlen_k, **device_kw)[None, :]
        diag = i + (c.seqlen_k - c.seqlen_q)
        ok = j >= 0
        left, right = c.window
        if c.causal:
            ok = ok & (j <= diag)
        if left >= 0:
            ok = ok & (j >= diag - left)
        if right >= 0:
            ok = ok & (j <= diag + right)
        return ok

    def torch_mask(self, additive: bool):
        """The mask for PyTorch: boolean (True = attend), or additive (0 / -inf) in the dtype."""
        key = ("torch_mask", additive)
        if key not in self._cache:
            import torch
            ok = self.allowed(torch, {"device": "cuda"})
            if ok is not None and additive:
                ok = torch.zeros(ok.shape, dtype=getattr(torch, self.case.dtype), device="cuda").masked_fill_(
                    ~ok, float("-inf"))
            self._cache[key] = ok
        return self._cache[key]

    def cupy_bias(self):
        """Additive (0 / -inf) CuPy mask in the dtype, or None."""
        if "cupy_bias" not in self._cache:
            cp = self._cupy_module
            ok = self.allowed(cp, {})
            bias = None
            if ok is not None:
                bias = cp.zeros(ok.shape, dtype=self.cupy_arrays()[0].dtype)
                bias[~ok] = -cp.inf
            self._cache["cupy_bias"] = bias
        return self._cache["cupy_bias"]


def _passes(pass_: str, forward: Callable, backward: Callable):
    """The callable for ``pass_`` from ``forward() -> saved`` and ``backward(saved) -> grads``."""
    if pass_ == "fwd":
        return forward
    if pass_ == "bwd":
        saved = forward()                      # untimed: the state a training step would hold
        return lambda: backward(saved)
    if pass_ == "fwdbwd":
        return lambda: backward(forward())
    raise ValueError(f"unknown pass {pass_!r}")


# ---- flashnb ----------------------------------------------------------------------------

def accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _flashnb_options(case: Case) -> dict:
    """Only the options that differ from their defaults, so a flashnb without them still runs."""
    kw = {"causal": case.causal}
    if case.window != NO_WINDOW:
        kw["window_size"] = case.window
    if case.dropout_p:
        kw.update(dropout_p=case.dropout_p, seed=0)
    return kw


def flashnb_impl(flashnb, backend: str | None, precision: str | None = None) -> Impl:
    """``precision``: float32 on the tensor cores, ``flashnb-tf32-highest`` (3xTF32) or ``flashnb-tf32-high``
    (one tf32 product): forward and backward with ``backend="tensorcore"`` at that precision (a flashnb whose
    backward takes no ``precision`` runs its backward with "auto", on SIMT)."""
    name = f"flashnb-{backend or 'default'}"
    if precision:                   # flashnb-tf32-highest (mma.sync), flashnb-wgmma-tf32-high (Hopper), ...
        name = "flashnb-tf32-" + precision if backend == "tensorcore" else f"{name}-tf32-{precision}"
    bwd_precision = precision is not None and accepts(flashnb.flash_attention_backward, "precision")

    def calls(case: Case):
        fwd_kw = dict(_flashnb_options(case), return_lse=True)
        bwd_kw = _flashnb_options(case)
        if backend is not None and accepts(flashnb.flash_attention, "backend"):
            fwd_kw["backend"] = backend
        if backend is not None and accepts(flashnb.flash_attention_backward, "backend"):
            bwd_kw["backend"] = "auto" if precision and not bwd_precision else backend
        if precision is not None:
            fwd_kw["precision"] = precision
        if bwd_precision:
            bwd_kw["precision"] = precision
        return fwd_kw, bwd_kw

    def make(case: Case, data: CaseData, pass_: str):
        q, k, v, dout = data.arrays()
        fwd_kw, bwd_kw = calls(case)
        forward = lambda: flashnb.flash_attention(q, k, v, **fwd_kw)              # -> (out, lse)
        backward = lambda saved: flashnb.flash_attention_backward(dout, q, k, v, *saved, **bwd_kw)
        return _passes(pass_, forward, backward)

    def check(case: Case, data: CaseData):
        """Relative max |flashnb - SDPA| of the forward output (None: nothing to compare with)."""
        if data.library != "torch" or case.dropout_p:
            return None                    # no SDPA, or a different dropout generator
        import torch
        q, k, v, _ = data.arrays()
        out, _lse = flashnb.flash_attention(q, k, v, **calls(case)[0])
        with torch.no_grad():
            ref = _sdpa_call(case, data, q, k, v, backend=None)
        ref, out = ref.float(), torch.as_tensor(out).float()
        finite = torch.isfinite(ref)
        err = (out - ref).abs()[finite].max().item() if finite.any() else 0.0
        scale = ref.abs()[finite].max().item() if finite.any() else 1.0
        return err / max(scale, 1e-30)

    return Impl(name, "flashnb", make, check)


# ---- PyTorch ----------------------------------------------------------------------------

def _sdpa_call(case: Case, data: CaseData, q, k, v, backend):
    """SDPA on (B, N, H, d) tensors through (B, H, N, d) views, result back in (B, N, H, d)."""
    import torch
    import torch.nn.functional as F
    kw = {"dropout_p": case.dropout_p, "scale": case.softmax_scale}
    if case.nheads != case.nheads_k:
        kw["enable_gqa"] = True
    if case.window != NO_WINDOW:
        kw["attn_mask"] = data.torch_mask(additive=False)
    elif case.causal and case.seqlen_q == case.seqlen_k:
        kw["is_causal"] = True
    elif case.causal:                      # SDPA's is_causal is top-left aligned; ours is bottom-right
        from torch.nn.attention.bias import causal_lower_right
        kw["attn_mask"] = causal_lower_right(case.seqlen_q, case.seqlen_k)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if backend is None:
        return F.scaled_dot_product_attention(qt, kt, vt, **kw).transpose(1, 2)
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(qt, kt, vt, **kw).transpose(1, 2)


def _torch_autograd_passes(pass_: str, forward, leaves, dout):
    import torch
    grads = lambda out: torch.autograd.grad(out, leaves, dout, retain_graph=(pass_ == "bwd"))
    return _passes(pass_, forward, grads)


def sdpa_impl(torch, backend_name: str) -> Impl:
    from torch.nn.attention import SDPBackend
    backend = getattr(SDPBackend, SDPA_BACKENDS[backend_name], None)

    def make(case: Case, data: CaseData, pass_: str):
        q, k, v, dout = data.torch_leaves()
        forward = lambda: _sdpa_call(case, data, q, k, v, backend)
        return _torch_autograd_passes(pass_, forward, (q, k, v), dout)

    why = None if backend is not None else f"this PyTorch has no SDPBackend.{SDPA_BACKENDS[backend_name]}"
    return Impl(f"sdpa-{backend_name}", "baseline", make, unavailable=why)


def torch_materialised_impl(torch) -> Impl:
    import torch.nn.functional as F

    def make(case: Case, data: CaseData, pass_: str):
        q, k, v, dout = data.torch_leaves()
        bias = data.torch_mask(additive=True)
        group = case.nheads // case.nheads_k

        def forward():
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))          # (B, H, N, d) views
            if group > 1:                                                 # query head h uses kv head h // group
                kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
            s = torch.matmul(qt, kt.transpose(-2, -1)).mul_(case.softmax_scale)   # S: (B, H, Nq, Nk) in HBM
            if bias is not None:
                s.add_(bias)
            p = torch.softmax(s, dim=-1)                                  # P: (B, H, Nq, Nk) in HBM
            if case.dropout_p:
                p = F.dropout(p, case.dropout_p)
            return torch.matmul(p, vt).transpose(1, 2)

        return _torch_autograd_passes(pass_, forward, (q, k, v), dout)

    return Impl("torch-materialised", "baseline", make)


# ---- CuPy -------------------------------------------------------------------------------

def cupy_materialised_impl(cp) -> Impl:
    """Standard attention in CuPy: Algorithm 0 forward, Algorithm 3 backward (FA paper)."""

    def make(case: Case, data: CaseData, pass_: str):
        q, k, v, dout = data.cupy_arrays()
        bias = data.cupy_bias()
        B, H, Hk, Nk, d = case.batch, case.nheads, case.nheads_k, case.seqlen_k, case.headdim
        group, scale, p_drop = H // Hk, case.softmax_scale, case.dropout_p
        dt = q.dtype

        def heads_first(x, repeat=1):                      # (B, N, h, d) -> (B, H, N, d) view or copy
            x = x.transpose(0, 2, 1, 3)
            return cp.repeat(x, repeat, axis=1) if repeat > 1 else x

        def forward():
            qt, kt, vt = heads_first(q), heads_first(k, group), heads_first(v, group)
            s = cp.matmul(qt, kt.transpose(0, 1, 3, 2))    # 1. S = Q K^T (B, H, Nq, Nk)
            s *= dt.type(scale)
            if bias is not None:
                s += bias
            s -= s.max(axis=-1, keepdims=True)             # 2. P = softmax(S), in place
            cp.exp(s, out=s)
            s /= s.sum(axis=-1, keepdims=True)
            p, keep = s, None
            if p_drop:
                keep = cp.random.random(p.shape, dtype=cp.float32) >= p_drop
                p_used = p * keep * dt.type(1 / (1 - p_drop))
            else:
                p_used = p
            out = cp.matmul(p_used, vt)                    # 3. O = P V  (B, H, Nq, d)
            return out, p, keep

        def backward(saved):
            out, p, keep = saved
            qt, kt, vt = heads_first(q), heads_first(k, group), heads_first(v, group)
            do = heads_first(dout)
            p_used = p if keep is None else p * keep * dt.type(1 / (1 - p_drop))
            dv = cp.matmul(p_used.transpose(0, 1, 3, 2), do)        # 1. dV = P^T dO
            dp = cp.matmul(do, vt.transpose(0, 1, 3, 2))            # 2. dP = dO V^T
            if keep is not None:
                dp *= keep
                dp *= dt.type(1 / (1 - p_drop))
            dp -= (do * out).sum(axis=-1, keepdims=True).astype(dt)  # 3. dS = P (dP - delta), delta = rowsum(dO O)
            dp *= p
            dq = cp.matmul(dp, kt)                                  # 4. dQ = scale dS K
            dq *= dt.type(scale)
            dk = cp.matmul(dp.transpose(0, 1, 3, 2), qt)            # 5. dK = scale dS^T Q
            dk *= dt.type(scale)
            if group > 1:                                           # sum the query heads of each kv head
                dk = dk.reshape(B, Hk, group, Nk, d).sum(axis=2)
                dv = dv.reshape(B, Hk, group, Nk, d).sum(axis=2)
            return tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))

        if pass_ == "fwd":
            return lambda: forward()[0].transpose(0, 2, 1, 3)
        return _passes(pass_, forward, backward)

    return Impl("cupy-materialised", "baseline", make)


# ---- the registry -----------------------------------------------------------------------

def all_impls(libs: Libraries) -> list[Impl]:
    """Every implementation, in table order; missing libraries give ``unavailable`` entries."""
    impls = []
    fnb = libs.flashnb
    if fnb is not None and hasattr(fnb, "flash_attention") and hasattr(fnb, "flash_attention_backward"):
        backends = tuple(getattr(fnb, "BACKENDS", ("simt",)))
        if accepts(fnb.flash_attention, "backend"):
            backends = ("auto",) + backends          # "auto": what a caller gets without choosing
        impls += [flashnb_impl(fnb, b) for b in backends]
        if accepts(fnb.flash_attention, "precision"):          # float32 on the tensor cores
            tf32_backends = ("tensorcore", "wgmma") if "wgmma" in backends else ("tensorcore",)
            impls += [flashnb_impl(fnb, b, p) for b in tf32_backends for p in ("highest", "high")]
    else:
        why = libs.why_not.get("flashnb") or "flashnb has no flash_attention / flash_attention_backward yet"
        impls.append(Impl("flashnb", "flashnb", None, unavailable=why))
    if libs.torch is not None:
        impls += [sdpa_impl(libs.torch, b) for b in SDPA_BACKENDS]
        impls.append(torch_materialised_impl(libs.torch))
    else:
        why = libs.why_not.get("torch", "not installed")
        impls += [Impl(f"sdpa-{b}", "baseline", None, unavailable=f"torch: {why}") for b in SDPA_BACKENDS]
        impls.append(Impl("torch-materialised", "baseline", None, unavailable=f"torch: {why}"))
    if libs.cupy is not None:
        impls.append(cupy_materialised_impl(libs.cupy))
    else:
        impls.append(Impl("cupy-materialised", "baseline", None,
                          unavailable=f"cupy: {libs.why_not.get('cupy', 'not installed')}"))
    return impls


QUICK_IMPLS = ("flashnb-auto", "sdpa-flash", "sdpa-cudnn", "torch-materialised")


def quick_select(impls: list[Impl]) -> list[Impl]:
    """The quick set's implementations: what a caller gets from flashnb by default, PyTorch's two fastest
    SDPA backends and the materialised baseline; a flashnb without ``backend="auto"`` (or one that does not
    import) stands in with its first entry, so the report still says what happened to it."""
    chosen = [i for i in impls if i.name in QUICK_IMPLS]
    if not any(i.family == "flashnb" for i in chosen):
        chosen += [i for i in impls if i.family == "flashnb"][:1]
    return [i for i in impls if i in chosen]


def select(impls: list[Impl], wanted: list[str] | None) -> list[Impl]:
    """The impls named in ``wanted`` (a name, or a prefix such as ``flashnb`` or ``sdpa``)."""
    if not wanted:
        return impls
    chosen = []
    for w in wanted:
        hits = [i for i in impls if i.name.startswith(w)]
        if not hits:
            names = ", ".join(i.name for i in impls)
            raise ValueError(f"unknown implementation {w!r}; known: {names}")
        chosen += [i for i in hits if i not in chosen]
    return [i for i in impls if i in chosen]
